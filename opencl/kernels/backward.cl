/* SPDX-License-Identifier: MIT */
/*
 * The APE backward pass (APE-SPEC.md, "Gradients"), OpenCL C 1.2, built after attention.cl in
 * the same program (it uses its loads, ld(), and its lane types). Twelve kernels (per launch one
 * of the four sweeps; the short ones stand in for the preps, rows and reduce as well), enqueued
 * in order by ocl_backward.c:
 *
 *   ape_bwd_prep     Q with dO (in row vectors), and K with V (a row per key), as float32 in
 *                    the sweep's order; with skipping, each kv head's largest key norm;
 *   ape_bwd_dist     per head and distance: temp, bias (with the distance-bias table's entry)
 *                    and their parameter derivatives;
 *   ape_bwd_rows     per row vector: mean, sigma, alpha, the saved LSE, Dl_i - dLSE_i
 *                    (Dl_i = dO_i . O_i), the cos and sin of each pair's per-key step, and the
 *                    keys the skip bound leaves to compute, once, for the sweep;
 *   ape_bwd_fused    the one sweep, keys outer, each pair's score computed once: a work-item
 *                    is a split of a (batch, kv head)'s key blocks; per block it sums dK_j and
 *                    dV_j over every row of every query head that reads the kv head and adds
 *                    them once, and adds the rows' dQ_i, alpha path A_i and parameter sums to
 *                    its split's slice of the partial buffers (and, for the table's gradient,
 *                    dS by distance);
 *   ape_bwd_sep      instead of ape_bwd_fused where every head has lambda = 0 (B_SEP): the
 *                    same sweep (bwd_sweep()) on rows and keys rotated once by their own
 *                    positions (ape_bwd_rows rotates Q in place, ape_bwd_prep rotates K), so
 *                    that no pair turns anything: dot and alpha sums as products, dK and dQ as
 *                    plain sums turned back once per key and per row;
 *   ape_bwd_short, ape_bwd_short_sep
 *                    instead of the preps, ape_bwd_rows, the sweep and ape_bwd_reduce for a
 *                    ragged launch of short segments (ocl_backward.c, bwd_short()): a
 *                    work-item takes whole segments, preparing, tabling, sweeping and reducing
 *                    each with those kernels' functions in its own small slots of scratch;
 *   ape_bwd_reduce   per row vector: the splits' slices summed in split order, the alpha path
 *                    applied to dQ_i, added to dQ; the rows' parameter sums;
 *   ape_bwd_params   per head: the rows' parameter sums in float64, in row order, added to
 *                    dparams;
 *   ape_bwd_dbias_dist, ape_bwd_dbias
 *                    the table's gradient: per table row and distance the splits' dS sums,
 *                    then per entry the distances that read it, added to dbias.
 *
 * A ragged launch (struct ape_be_bwd_launch, "Ragged"; the segment tables of
 * kernels/bwd_layout.h) runs the same kernels over a padded row space (each segment's rows in
 * whole row vectors of their own) and each segment's own key blocks: each row vector and key
 * block takes its segment's rows, keys and rel (bwd_seg()), so that every segment is a dense
 * problem of its own; a dense launch passes no table and is its own one segment.
 *
 * No float atomics anywhere: every sum has one owner and a fixed order, so two runs are bit
 * for bit the same. The sweep recomputes P_ij = exp(s_ij - LSE_i) from q, k and the saved LSE;
 * nothing of size Lq * Lk exists (the partial buffers are nsplit times Lq * D). It uses the
 * forward's layout (docs/kernels.md): APE_RW query rows in the lanes of a vector, keys as
 * scalars, each rotation seeded exactly in APE_REAL by ape_seed_sincos (the forward's seed) at
 * the start of a key block and turned one step per key after it, the pair products in
 * float32; the per-distance terms come from a table of ape_math.h's values in APE_REAL, one
 * vector load per key.
 *
 * Without cl_khr_fp64 (APE_FP64 0, APE_REAL float) the same kernels run with the row and
 * distance terms in float32 (exact seeds only for |n| < 2^12, as the forward's), and the sums
 * that must keep their small terms (RP, PART, DBP, DBD and the per-head totals) as compensated
 * float32 pairs (BWD_TWO_SUM); the host finishes the per-head and per-entry totals in float64
 * (ocl_backward.c, bwd_host_add()).
 */

/*
 * The sums over many terms (the rows' alpha and parameter sums over a split's key blocks and
 * over the splits, RP; the per-row parameter sums, PART, and their per-head totals; dS by
 * distance, DBP and DBD): APE_REAL where that is float64. Without float64 each is a pair, the
 * float32 sum then its error term, BSUM = 2 APE_REAL where float64 takes one (the same 8 bytes:
 * the host sizes both alike), every addition Knuth's TwoSum: t = s + x loses exactly
 * (s - (t - b)) + (x - b), b = t - s, which goes to the error term. The pair's value is within
 * about 2^-24 of the exact sum's magnitude plus n 2^-48 times the sum of the terms' magnitudes,
 * where one float32 sum drifts by n 2^-24 times that. Deterministic: a fixed order, no
 * reassociation (OpenCL C compiles without fast-math options, ocl_program.c).
 */
#if APE_FP64
#define BSUM 1
#else
#define BSUM 2
#endif
#define BWD_TWO_SUM(T, s, c, x)                                                                    \
	do {                                                                                       \
		const T t_ = (s) + (x), b_ = t_ - (s);                                             \
		(c) += ((s) - (t_ - b_)) + ((x) - b_);                                             \
		(s) = t_;                                                                          \
	} while (0)
/* a pair's value; an infinite or NaN sum is itself (its error term is NaN) */
#define BWD_SUM_VALUE(s, c) select((s), (s) + (c), isfinite(s))

/* Pair and component vectors: at most this many APE_RW-wide chunks (APE_DMAX, APE_PMAX are
 * multiples of 16 >= APE_RW) */
#define BPV (APE_PMAX / APE_RW)
#define BDV (APE_DMAX / APE_RW)
#if APE_D
#define BD(D) APE_D
#else
#define BD(D) (D)
#endif

/* launch flags and table layouts: kernels/bwd_layout.h, embedded ahead of this file */

KFN float bwd_hsum(vf v)
{
#if APE_RW == 1
	return v;
#elif APE_RW == 2
	return v.s0 + v.s1;
#elif APE_RW == 4
	return (v.s0 + v.s1) + (v.s2 + v.s3);
#elif APE_RW == 8
	float4 a = v.lo + v.hi;

	return (a.s0 + a.s1) + (a.s2 + a.s3);
#else
	float8 b = v.lo + v.hi;
	float4 a = b.lo + b.hi;

	return (a.s0 + a.s1) + (a.s2 + a.s3);
#endif
}

#if APE_RW == 16
/*
 * bwd_hsum() of the 16 vectors at v (v + 16 c for c = 0..15) at once, sum c in lane c, every sum
 * formed by exactly bwd_hsum()'s additions: lanes l + l + 8, then + 4, then (0 + 1) + (2 + 3),
 * each step on two vectors' halves side by side (15 vector adds and their shuffles for 16 sums,
 * not 16 reductions of a vector each). The end of a sweep block sums each key's dK and dV
 * lanes: one by one, that had a quarter of ape_bwd_fused's profile samples at 16-key blocks.
 */
KFN vf bwd_hsum16(const float *v)
{
	const uint16 h0 = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
	const uint16 h1 = h0 + 8;
	const uint16 q0 = (uint16)(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
	const uint16 q1 = q0 + 4;
	const uint16 e0 = (uint16)(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
	const uint16 e1 = e0 + 1;
	vf t1[8], t2[4], t3[2];

	for (int k = 0; k < 8; k++) {
		const vf a = VL(v + 32 * k), b = VL(v + 32 * k + 16);

		t1[k] = shuffle2(a, b, h0) + shuffle2(a, b, h1);
	}
	for (int k = 0; k < 4; k++)
		t2[k] = shuffle2(t1[2 * k], t1[2 * k + 1], q0) + shuffle2(t1[2 * k], t1[2 * k + 1], q1);
	for (int k = 0; k < 2; k++)
		t3[k] = shuffle2(t2[2 * k], t2[2 * k + 1], e0) + shuffle2(t2[2 * k], t2[2 * k + 1], e1);
	return shuffle2(t3[0], t3[1], e0) + shuffle2(t3[0], t3[1], e1);
}
#endif

/* One dense problem of a launch (kernels/bwd_layout.h, SG_*): segment s of a ragged launch's
 * table SG, or without one (a dense launch) the launch itself. */
struct bseg {
	long q0, lq, k0, lk, rel, rv0, kb0;
};

/* Element [row r, 0] of (batch, head) bh of an input Q, K, V, O or dO whose batches have nh
 * heads: the launch's view of it (kernels/attention.cl's VIEW_ROW: x the offset, y, z, w the
 * B, H and L strides; ocl_backward.c gives the contiguous one where the launch is not strided) */
#define BWD_AT(v, bh, nh, r) (VIEW_ROW((v), (bh) / (nh), (bh) % (nh)) + (long)(r) * (v).w)

KFN struct bseg bwd_seg(__global const long *SG, long s, long Lq, long Lk, long rel)
{
	struct bseg g;

	if (!SG) {
		g.q0 = g.k0 = g.rv0 = g.kb0 = 0;
		g.lq = Lq;
		g.lk = Lk;
		g.rel = rel;
		return g;
	}
	SG += s * SG_N;
	g.q0 = SG[SG_Q0];
	g.lq = SG[SG_LQ];
	g.k0 = SG[SG_K0];
	g.lk = SG[SG_LK];
	g.rel = SG[SG_REL];
	g.rv0 = SG[SG_RV0];
	g.kb0 = SG[SG_KB0];
	return g;
}

/*
 * Q with its dO, or K with its V, as the sweep reads them: float32, the pairs' first components
 * (npad of them, zero past P, so padded lanes add nothing), their second components, then the
 * D components of the vector (zero up to dpad): rs = 2 npad + dpad components per row. Rows go
 * in blocks of `lanes` per (batch, head) bh, component-major inside a block:
 * out[((bh * nblk + i / lanes) * rs + comp) * lanes + i % lanes], nblk = ceil(L / lanes), rows
 * past L zero. With lanes = APE_RW (Q and dO) a row vector of the sweep is one vector load per
 * component; with lanes = 1 (K and V) a key is one contiguous row. Converting f16/bf16 and
 * de-interleaving once per row, not once per pair. With om (omega_p, K's call), each row also
 * gets omega_p times its first components, then minus omega_p times its second, after the rest
 * (rs = 4 npad + dpad): the alpha sums' factors, one broadcast load each in the sweep. With rot
 * as well (K's call for ape_bwd_sep, lanes 1), each key j is rotated by its own position,
 * (u, w) -> (u cos - w sin, u sin + w cos) at the angle j omega_p (seeded exactly by
 * ape_seed_sincos), before all of that, and the cos then the sin of each pair's angle follow
 * the rest (rs = 6 npad + dpad), for turning dK back; the key norm stays the unrotated one's.
 *
 * Work-item i of the np padded rows, written at i: row i of a dense launch (np = L rounded up to
 * lanes). In a ragged launch (SG, kernels/bwd_layout.h; MAP the segment of each unit of `unit`
 * padded rows), its padded space: Q's call (om NULL) the padded row space, unit = lanes =
 * APE_RW, padded row i being row i - RV0 APE_RW of its segment; K's call the key blocks, unit =
 * BWD_KT, padded key i being key i - KB0 BWD_KT of its segment (its angle with rot: that index);
 * zero past the segment's rows or keys (never read).
 */
/*
 * One row of ape_bwd_prep: the row of A at element abase (and of B at bbase) to o (its first
 * component's float; the components `lanes` apart), zero where !ok; `at` its angle's index (om
 * and rot). Returns the row's squared norm (APE_REAL) for the skip bound. Also ape_bwd_short's,
 * into its slots.
 */
KFN APE_REAL bwd_prep_row(__global const void *A, int dt_a, __global const void *Bv, int dt_b,
			  long abase, long bbase, int lanes, int D, int npad, int dpad, int inter,
			  __global float *o, __global const APE_REAL *om, int rot, long at, int ok)
{
	const int P = BD(D) / 2;
	APE_REAL ss = 0;

	/* pairs in chunks of APE_RW (npad is a multiple of it): one vector seed per chunk */
	for (int p0 = 0; p0 < npad; p0 += APE_RW) {
		float cs[APE_RW], sn[APE_RW];

		if (om && rot) {
			vf c;
			const vf s = ape_seed_sincos(VL(om + p0) * (APE_REAL)at, &c);

			VS(c, cs);
			VS(s, sn);
		}
		for (int p = p0; p < p0 + APE_RW; p++) {
			float x = ok && p < P ? ld(A, abase + (inter ? 2 * p : p), dt_a) : 0.0f;
			float y = ok && p < P ? ld(A, abase + (inter ? 2 * p + 1 : p + P), dt_a)
					      : 0.0f;

			ss += (APE_REAL)x * x + (APE_REAL)y * y;
			if (om && rot) { /* as the general sweep's rotated query */
				const float xr = x * cs[p - p0] - y * sn[p - p0];

				y = x * sn[p - p0] + y * cs[p - p0];
				x = xr;
				o[(4 * npad + dpad + p) * lanes] = cs[p - p0];
				o[(5 * npad + dpad + p) * lanes] = sn[p - p0];
			}
			o[p * lanes] = x;
			o[(npad + p) * lanes] = y;
			if (om) { /* as the sweep's float32 products */
				o[(2 * npad + dpad + p) * lanes] = (float)om[p] * x;
				o[(3 * npad + dpad + p) * lanes] = -((float)om[p] * y);
			}
		}
	}
	for (int d = 0; d < dpad; d++)
		o[(2 * npad + d) * lanes] = ok && d < BD(D) ? ld(Bv, bbase + d, dt_b) : 0.0f;
	return ss;
}

__kernel void ape_bwd_prep(__global const void *A, int dt_a, __global const void *Bv, int dt_b,
			   long L, int lanes, int D, int npad, int dpad, int inter,
			   __global float *out, __global int *kmax, __global const APE_REAL *om,
			   int rot, long np, __global const long *SG, __global const int *MAP,
			   int unit, long4 va, long4 vb, int nh)
{
	const long i = get_global_id(0), bh = get_global_id(1);
	long r = i, at = i; /* the real row; the key's index for its angle */
	int ok = i < L;

	if (i >= np)
		return;
	if (MAP) {
		const long u = i / unit;
		const struct bseg g = bwd_seg(SG, MAP[u], L, L, 0);

		at = (u - (om ? g.kb0 : g.rv0)) * unit + i % unit;
		ok = at < (om ? g.lk : g.lq);
		r = (om ? g.k0 : g.q0) + at;
	}
	const long oi = i, nblk = np / lanes;
	const int rs = 2 * npad + dpad + (om ? 2 * npad : 0) + (om && rot ? 2 * npad : 0);
	__global float *o = out + ((bh * nblk + oi / lanes) * rs) * lanes + oi % lanes;
	const APE_REAL ss = bwd_prep_row(A, dt_a, Bv, dt_b, BWD_AT(va, bh, nh, r),
					 BWD_AT(vb, bh, nh, r), lanes, D, npad, dpad, inter, o, om,
					 rot, at, ok);

	/* kmax: the largest norm bound of a (batch, kv head)'s rows, for the skip bound, as float
	 * bits (a non-negative float orders as its int); a NaN norm counts as +inf, so that no
	 * key of that head is ever left out (a NaN's sign bit would make it the smallest int) */
	if (kmax && ok) {
		const float nb = (float)ape_norm_bound(ss);

		atomic_max(kmax + bh, as_int(isnan(nb) ? INFINITY : nb));
	}
}

/* The distance terms of each head at every distance n = nmin + idx a launch has, once: the
 * sweep looks them up instead of evaluating logs and roots. One array per term (TB_AT): the
 * APE_RW rows of a row vector meet APE_RW consecutive distances, one vector load. With a
 * distance-bias table (BT: bM entries per head row, rows bstride apart, 0 when shared; NULL
 * without one) the bias term is the decay bias plus the head's entry, so the sweep takes it at
 * no cost per pair. */
__kernel void ape_bwd_dist(__global const APE_REAL *prm, int npad, int H, long nmin, long ndist,
			   __global const float *BT, long bstride, long bM, __global APE_REAL *tab)
{
	/* past ndist (the work-group's rounding): saturated, never used */
	const long idx = get_global_id(0), h = get_global_id(1), n = ape_sat_add(nmin, idx);
	__global const APE_REAL *hp = prm + npad + 4 * h;
	const long ad = ape_abs_dist(n);
	const APE_REAL an = (APE_REAL)ad;
	APE_REAL bias;

	if (idx >= ndist || h >= H)
		return;
	bias = ape_bias(hp[0], hp[1], hp[2], an);
	if (BT)
		bias += (APE_REAL)BT[h * bstride + ape_bias_index(ad, bM)];
	tab[TB_AT(h, TB_T, ndist) + idx] = ape_temp(hp[3], an);
	tab[TB_AT(h, TB_BIAS, ndist) + idx] = bias;
	tab[TB_AT(h, TB_DD, ndist) + idx] = ape_grad_dbias_ddelta(an);
	tab[TB_AT(h, TB_DB, ndist) + idx] = ape_grad_dbias_dbeta(an);
	tab[TB_AT(h, TB_DG, ndist) + idx] = ape_grad_dbias_dgamma(an);
	tab[TB_AT(h, TB_DTL, ndist) + idx] = ape_grad_dtemp_dlambda(hp[3], an);
}

/* The rotated query one key further: theta falls by one step (c, s: cos and sin of it) */
KFN void bwd_turn(vf *x, vf *y, vf c, vf s)
{
	const vf xn = fma(*x, c, *y * s);

	*y = fma(*y, c, -(*x * s));
	*x = xn;
}

/* One launch's shape, as the sweep reads it: the distance table's nmin and ndist, the row
 * vectors per (batch, head) (ragged: of the padded row space) */
struct bwd {
	int D, P, npad, rs, krs, inter, causal;
	long nmin, ndist, nblk;
	float scale;
};

KFN struct bwd bwd_init(int D, long nmin, long ndist, long nblk, float scale, int flags)
{
	struct bwd b;

	b.D = BD(D);
	b.P = b.D / 2;
	b.npad = (b.P + APE_RW - 1) / APE_RW * APE_RW;
	b.rs = 2 * b.npad + (b.D + APE_RW - 1) / APE_RW * APE_RW; /* floats per prepared row */
	/* per prepared key: omega_p u_p, -omega_p w_p after; with B_SEP, then the cos and sin of
	 * its own angle (ape_bwd_prep) */
	b.krs = b.rs + ((flags & B_SEP) ? 4 : 2) * b.npad;
	b.inter = (flags & B_INTERLEAVED) != 0;
	b.causal = (flags & B_CAUSAL) != 0;
	b.nmin = nmin;
	b.ndist = ndist;
	b.nblk = nblk;
	b.scale = scale;
	return b;
}

/*
 * P_ij of a row vector against one key: its rotated dot products dot, the distance terms t =
 * temp(n) and bias(n) (APE_REAL), the rows' LSE. The score relative to the LSE is formed in
 * APE_REAL for bias - LSE (both may be large at large |n|), then in float32; *tsc gets
 * temp(n) * scale (dS times it is d/d(dot)). Weights below e^-87 are exact zeros, as in the
 * forward (a subnormal operand costs an x86 FMA a microcode assist); the exponent at most 0
 * (ape/ape_math.h, APE_BWD_EXPONENT: a float32 LSE beyond 2^24 can round below the score); NaN
 * stays NaN.
 */
KFN vf bwd_p(vr t, vr bias, vr lse, vf dot, float scale, vf *tsc)
{
	const vf ts = TO_VF(t) * scale, x0 = fma(ts, dot, TO_VF(bias - lse));
	const vf x = APE_V_SELECT(x0, (vf)0.0f, x0 > 0.0f); /* APE_BWD_EXPONENT, ape/ape_math.h */

	*tsc = ts;
	return APE_V_SELECT(exp(x), (vf)0.0f, x < APE_EXP_CUTOFF);
}

/* The lanes of a row vector (rows r0 + lane, lanes lo .. hi-1 real) that see a key: lane >= lo
 * and lane < hi, as a lane mask (all bits set where true; 1 with APE_RW = 1) */
KFN vi bwd_lanes(int lo, int hi)
{
	return (IOTA >= lo) & (IOTA < hi);
}

/*
 * Per row vector (APE_RW rows of one (batch, head) in the lanes, from the prepared Q+dO): each
 * row's mean, sigma and alpha (sums in the forward's order: pair by pair), its saved LSE and
 * Dl_i - dLSE_i (Dl_i = dO_i . O_i), to the row table; and the cos and sin of each pair's
 * per-key step omega_p / alpha_i, to STEP (per row vector: cos for the npad pairs, then sin,
 * APE_RW lanes each), so that the sweep seeds only the rotation's start. With B_SEP (lambda = 0,
 * ape_bwd_sep) instead: the rows' pairs rotated in place by their positions rel + i, and the cos
 * and sin of those angles (rel + i) omega_p to STEP, with which the sweep turns dQ back. BSM:
 * the suffix maxima of the distance-bias table (rows as ape_bwd_dist's BT), for the skip bound;
 * NULL without one.
 */
/* The largest entry of a head's distance-bias table at distance an or beyond (sm: the head's
 * suffix maxima, bM of them; NULL without a table: 0): what the score bound of keys at
 * distances >= an gains from the table, passed to ape_bwd_may_skip() by lowering the LSE. */
KFN APE_REAL bwd_smax(__global const float *sm, long bM, long an)
{
	return sm ? (APE_REAL)sm[ape_bias_index(an, bM)] : (APE_REAL)0;
}

/*
 * The keys one row must compute, [*jlo, *jhi) of its visible keys [0, vend): with B_SKIP, the
 * longest prefix of whole granules (keys at n >= 1) and suffix (n <= -1) whose weight the
 * backward bound proves negligible (ape_bwd_may_skip(), docs/kernels.md; with a table, its
 * suffix maximum at the granules' nearest distance, sm as bwd_smax()). Binary searches: only a
 * prefix or suffix that passed the test is left out.
 *
 * The row vector computes the union of its rows' ranges ([ulo, uhi) so far, ulo > uhi before the
 * first row), so a row needs searching only where it could widen it: a row that passes the test
 * for the prefix [0, ulo) (the suffix from uhi) cannot, and takes ulo (uhi) as its own bound (a
 * part of a negligible prefix weighs less still: sound whatever the test's rounding); otherwise
 * the search looks only below ulo (above uhi). One test per row instead of a search for most
 * rows of a vector: the searches' float64 logs took most of ape_bwd_rows' time (at L = 4096,
 * H = 6, D = 64, causal, the seed's parameters, 33 ms before, 14 ms after, on a loaded CPU).
 */
KFN void bwd_row_range(__global const APE_REAL *hp, float scale, APE_REAL qn, APE_REAL km,
		       APE_REAL lse, float tol, long diag, long Lk, long vend, int causal,
		       __global const float *sm, long bM, long ulo, long uhi, long *jlo, long *jhi)
{
	const APE_REAL as = fabs((APE_REAL)scale);
	/* without the causal mask both sides may be left out: they share tol */
	const float t = causal ? tol : tol / 2;
	long lo = 0, hi, m0, e = diag < Lk ? diag : Lk;

	*jlo = 0;
	*jhi = vend;
	/* prefix: granules m < M lie at n >= 1; lo passed (or is 0) */
	hi = (e > 0 ? e / B_GRANULE : 0) + 1;
	if (ulo <= uhi && ulo % B_GRANULE == 0 && ulo / B_GRANULE < hi) {
		const long cnt = ulo, an = diag - (cnt - 1);

		if (cnt == 0 || ape_bwd_may_skip(hp[3], hp[0], hp[1], hp[2], as, qn, km, (APE_REAL)an,
						 (APE_REAL)cnt, lse - bwd_smax(sm, bM, an), t))
			lo = hi = ulo / B_GRANULE; /* no wider than the union */
		else
			hi = ulo / B_GRANULE;
	}
	while (hi - lo > 1) {
		const long mid = (lo + hi) / 2, cnt = mid * B_GRANULE, an = diag - (cnt - 1);

		if (ape_bwd_may_skip(hp[3], hp[0], hp[1], hp[2], as, qn, km, (APE_REAL)an,
				     (APE_REAL)cnt, lse - bwd_smax(sm, bM, an), t))
			lo = mid;
		else
			hi = mid;
	}
	*jlo = lo * B_GRANULE;
	if (causal || diag >= Lk - 1)
		return;
	/* suffix from granule m at n <= -1: m >= m0; hi passed (or leaves out nothing) */
	m0 = (ape_visible_keys(diag, Lk, 1) + B_GRANULE - 1) / B_GRANULE;
	hi = (Lk + B_GRANULE - 1) / B_GRANULE;
	lo = m0 - 1;
	if (ulo <= uhi && uhi >= Lk) { /* the union reaches the last key already */
		*jhi = Lk;
		return;
	}
	if (ulo <= uhi && uhi % B_GRANULE == 0 && uhi / B_GRANULE > lo && uhi / B_GRANULE < hi) {
		const long s0 = uhi, an = ape_abs_dist(diag - s0);

		if (ape_bwd_may_skip(hp[3], hp[0], hp[1], hp[2], as, qn, km, (APE_REAL)an,
				     (APE_REAL)(Lk - s0), lse - bwd_smax(sm, bM, an), t))
			lo = hi = uhi / B_GRANULE; /* no wider than the union */
		else
			lo = uhi / B_GRANULE;
	}
	while (hi - lo > 1) {
		const long mid = (lo + hi) / 2, s0 = mid * B_GRANULE, an = ape_abs_dist(diag - s0);

		if (ape_bwd_may_skip(hp[3], hp[0], hp[1], hp[2], as, qn, km, (APE_REAL)an,
				     (APE_REAL)(Lk - s0), lse - bwd_smax(sm, bM, an), t))
			hi = mid;
		else
			lo = mid;
	}
	*jhi = hi * B_GRANULE < Lk ? hi * B_GRANULE : Lk;
}

/* One row vector of ape_bwd_rows: rows rb + i0 .. of segment g (its lanes past g.lq padding) of
 * (batch, head) bh, prepared at qt, its row table at ri and steps at st (ape_bwd_short: its
 * slots). */
KFN void bwd_rows_vec(__global float *qt, __global APE_REAL *ri, __global float *st,
		      __global const void *O, __global const float *LSE, __global const float *DLSE,
		      __global const APE_REAL *prm, int npad, int D, int H, int flags,
		      __global const int *kmax, int group, float scale, float tol,
		      __global ulong *PAIRS, __global const float *BSM, long bstride, long bM,
		      const struct bseg g, long i0, long rb, long bh, long4 vo)
{
	const int P = BD(D) / 2;
	const APE_REAL lambda = prm[npad + 4 * (bh % H) + 3];
	/* B_SEP: the rows' positions rel + i (padding lanes: any) */
	const vr pos = (APE_REAL)ape_sat_add(g.rel, i0) + TO_VR(IOTA);
	const int causal = (flags & B_CAUSAL) != 0;
	APE_REAL tm[APE_RW], tss[APE_RW], tia[APE_RW], tqq[APE_RW], tdl[APE_RW];
	vr sum = (vr)0, ss = (vr)0, qq = (vr)0, dlv = (vr)0, mean;
	long vlo = LONG_MAX, vhi = 0;

	NOUNROLL for (int p = 0; p < P; p++)
		sum += TO_VR(VL(qt + p * APE_RW)) + TO_VR(VL(qt + (npad + p) * APE_RW));
	mean = sum / (APE_REAL)BD(D);
	NOUNROLL for (int p = 0; p < P; p++) {
		const vr x = TO_VR(VL(qt + p * APE_RW)) - mean;
		const vr y = TO_VR(VL(qt + (npad + p) * APE_RW)) - mean;

		const vr xq = TO_VR(VL(qt + p * APE_RW)), yq = TO_VR(VL(qt + (npad + p) * APE_RW));

		ss += x * x + y * y;
		qq += xq * xq + yq * yq;
	}
	/* Dl_i = dO_i . O_i, every row's sum in component order as one by one (the float32
	 * products are exact in float64: the same bits), the rows in the lanes (one row at a time,
	 * a chain of dependent float64 adds, had 40 % of the kernel's profile samples) */
	NOUNROLL for (int d = 0; d < BD(D); d++) {
		float ot[APE_RW];

		for (int l = 0; l < APE_RW; l++)
			ot[l] = i0 + l < g.lq ? ld(O, BWD_AT(vo, bh, H, g.q0 + i0 + l) + d,
						   B_DT_OUT(flags))
					    : 0.0f;
		dlv += TO_VR(VL(qt + (2 * npad + d) * APE_RW)) * TO_VR(VL(ot));
	}
	VS(mean, tm);
	VS(ss, tss);
	VS(qq, tqq);
	VS(dlv, tdl);
	NOUNROLL for (int l = 0; l < APE_RW; l++) {
		const long i = i0 + l, row = rb + i;
		APE_REAL sigma;

		if (i >= g.lq) { /* padding lanes of the last row vector */
			ri[RI_MEAN * APE_RW + l] = ri[RI_SIGMA * APE_RW + l] = 0;
			ri[RI_DSUB * APE_RW + l] = 0;
			ri[RI_ALPHA * APE_RW + l] = tia[l] = 1;
			ri[RI_LSE * APE_RW + l] = INFINITY;
			continue;
		}
		sigma = ape_sigma(tss[l], BD(D));
		ri[RI_MEAN * APE_RW + l] = tm[l];
		ri[RI_SIGMA * APE_RW + l] = sigma;
		ri[RI_ALPHA * APE_RW + l] = ape_alpha(lambda, sigma);
		tia[l] = (APE_REAL)1 / ri[RI_ALPHA * APE_RW + l];
		ri[RI_LSE * APE_RW + l] = LSE[row];
		ri[RI_DSUB * APE_RW + l] =
			tdl[l] - ((flags & B_DLSE) ? (APE_REAL)DLSE[row] : (APE_REAL)0);
		{ /* the keys it must compute; the row vector computes their union */
			const long diag = g.rel + i;
			const long vend = ape_visible_keys(diag, g.lk, causal);
			long jlo = 0, jhi = vend;

			if ((flags & B_SKIP) && vend > 0)
				bwd_row_range(prm + npad + 4 * (bh % H), scale,
					      ape_norm_bound(tqq[l]),
					      (APE_REAL)as_float(kmax[bh / H * (H / group) +
								      bh % H / group]),
					      LSE[row], tol, diag, g.lk, vend, causal,
					      BSM ? BSM + bh % H * bstride : BSM, bM, vlo, vhi,
					      &jlo, &jhi);
			if (vend > 0 && jlo < jhi) {
				vlo = jlo < vlo ? jlo : vlo;
				vhi = jhi > vhi ? jhi : vhi;
			}
		}
	}
	if (vlo >= vhi)
		vlo = vhi = 0;
	NOUNROLL for (int l = 0; l < APE_RW; l++) {
		const long i = i0 + l, diag = ape_sat_add(g.rel, i); /* padding lanes: any */
		const long vend = ape_visible_keys(diag, g.lk, causal);
		const long e = vhi < vend ? vhi : vend;

		ri[RI_JLO * APE_RW + l] = (APE_REAL)vlo;
		ri[RI_JHI * APE_RW + l] = (APE_REAL)vhi;
		if ((flags & B_PAIRS) && i < g.lq) /* visible pairs computed */
			PAIRS[rb + i] = (ulong)(e > vlo ? e - vlo : 0);
	}
	NOUNROLL for (int p = 0; p < npad; p++) {
		vf c = (vf)1.0f, sn = (vf)0.0f;

		if (p < P && (flags & B_SEP)) {
			/* the rows rotated by their own positions, in place (the sums above read
			 * them unrotated); the cos and sin of the angle kept for turning dQ back */
			const vf x = VL(qt + p * APE_RW), y = VL(qt + (npad + p) * APE_RW);

			sn = ape_seed_sincos(prm[p] * pos, &c);
			VS(x * c - y * sn, qt + p * APE_RW);
			VS(x * sn + y * c, qt + (npad + p) * APE_RW);
		} else if (p < P) {
			sn = ape_seed_sincos(prm[p] * VL(tia), &c);
		}
		VS(c, st + p * APE_RW);
		VS(sn, st + (npad + p) * APE_RW);
	}
}

__kernel void ape_bwd_rows(__global float *QP, __global const void *O,
			   __global const float *LSE, __global const float *DLSE,
			   __global const APE_REAL *prm, int npad, int D, int H, long Lq, int flags,
			   __global APE_REAL *rinfo, __global float *STEP, __global const int *kmax,
			   int group, long Lk, long rel, float scale, float tol,
			   __global ulong *PAIRS, __global const float *BSM, long bstride, long bM,
			   long nblk, __global const long *SG, __global const int *RVS, long4 vo)
{
	const long ib = get_global_id(0), bh = get_global_id(1);
	/* the row vector's segment (a dense launch: the launch); rows from rb + i0 */
	const struct bseg g = bwd_seg(SG, RVS && ib < nblk ? RVS[ib] : 0, Lq, Lk, rel);
	const long blk = bh * nblk + ib, i0 = (ib - g.rv0) * APE_RW, rb = bh * Lq + g.q0;
	const int rs = 2 * npad + (BD(D) + APE_RW - 1) / APE_RW * APE_RW;

	if (ib >= nblk)
		return;
	bwd_rows_vec(QP + blk * rs * APE_RW, rinfo + RI_AT(blk, 0, APE_RW),
		     STEP + blk * 2 * npad * APE_RW, O, LSE, DLSE, prm, npad, D, H, flags, kmax,
		     group, scale, tol, PAIRS, BSM, bstride, bM, g, i0, rb, bh, vo);
}

/* The arguments the sweep takes first (ocl_backward.c: bwd_sweep_args()): the prepared rows
 * (Q+dO in row vectors, K+V one row per key: ape_bwd_prep), omega and the heads' parameters,
 * the row and distance tables, the shape, the flags; the distance table's range, the row
 * vectors and key blocks per (batch, head), and a ragged launch's segments (SG, KBS the segment
 * of each key block: kernels/bwd_layout.h; NULL: dense). */
#define BWD_SWEEP_ARGS                                                                             \
	__global const float *QP, __global const float *KP, __global const APE_REAL *prm,         \
		int npad, __global const APE_REAL *rinfo, __global const float *STEP,              \
		__global const APE_REAL *tab, int D, int H, int group, long Lq, long Lk, long rel, \
		float scale, int flags, long nmin, long ndist, long nblk, long nkb,                \
		__global const long *SG, __global const int *KBS
#define BWD_SWEEP_PASS                                                                             \
	QP, KP, prm, npad, rinfo, STEP, tab, D, H, group, Lq, Lk, rel, scale, flags, nmin, ndist,  \
		nblk, nkb, SG, KBS
/* What every sweep kernel writes, after BWD_SWEEP_ARGS (ocl_backward.c: struct bwd_out) */
#define BWD_OUT_ARGS                                                                               \
	__global float *DK, __global float *DV, __global float *DQP, __global APE_REAL *RP,        \
		int nsplit, long nrv, __global APE_REAL *DBP
#define BWD_OUT_PASS DK, DV, DQP, RP, nsplit, nrv, DBP

/* Keys per block of the fused sweep: each row vector seeds its rotation once per block and
 * per block a row vector is loaded and set up once, but a row vector computes every key of a
 * block it meets, so with skipping (on by default) the block, and the skip granule it divides
 * (B_GRANULE), bound the keys computed past those the bound needs: at D = 64, H = 6, causal,
 * the seed's parameters, 16 keys computed 24 % fewer pairs than 64 (430080 of 3148800 against
 * 568320 at L = 1024) and the sweep about 20 % less CPU time (8 keys: fewer pairs still, no
 * faster); a dense launch took no longer. The block's dK and dV accumulators
 * are APE_RW lanes wide per component, so fewer keys for larger D. ocl_backward.c mirrors it. */
#define BWD_KT (APE_DMAX <= 128 ? 16 : 8)

/* Row vectors per group (their P and dS wait in private memory while the group's dK, dV and dQ
 * are added: the key accumulators are read and written once per group) and keys per
 * dot-product sub-block (their dot products stay in registers while the pairs run). */
#define KR 8
#define KSB 8
#define KDC 4 /* keys per dK accumulator chunk */

/* The lanes of row vector g that see key kt of the block (causal: n = nl0 + lane - kt >= 0) */
#define KEYS_VIS(g, kt)                                                                           \
	bwd_lanes(b.causal ? (int)clamp(ape_sat_sub((long)(kt), nl0[g]), 0L, (long)APE_RW) : 0, \
		  hi[g])

/* Pair p of a row vector's dQ in a split's slice (ape_bwd_fused) += R(-theta_0) (vx, vy), the
 * Horner walk's sum turned by the block's seed (c0, s0) */
KFN void bwd_dq_add(__global float *dq, int p, int P, vf vx, vf vy, vf c0, vf s0)
{
	VS(VL(dq + p * APE_RW) + fma(vx, c0, vy * s0), dq + p * APE_RW);
	VS(VL(dq + (P + p) * APE_RW) + fma(vy, c0, -(vx * s0)), dq + (P + p) * APE_RW);
}

/*
 * The one sweep of the backward pass, keys outer, each pair's score computed once. A work-item
 * is split `s` of a (batch, kv head): it owns the key blocks kb = s, s + nsplit, ... (BWD_KT
 * keys each; strided so that, causal, the splits get as many long blocks as short ones) and
 * walks them in that order. Per block, over the rows of every query head that reads the kv head
 * (row vectors the skip bound left out of the block's keys, ape_bwd_rows, are passed over), in
 * groups of KR row vectors, as in the forward's layout (APE_RW rows in the lanes of a vector,
 * keys as scalars, the row and distance terms one vector load each):
 *
 *   pass 1, per row vector: the query rotated to the block's first key (seeded exactly by
 *   ape_seed_sincos), then KSB keys at a time the dot products and the alpha sums
 *   E_j = sum_p omega_p (yr_p u_p - xr_p w_p) while the rotated query turns one step per key;
 *   per key P, dS (zero in lanes that do not see the key), g = dS temp scale, kept; the alpha
 *   path's sum A_i += g n / alpha E_j and the four parameter sums in float32 over the block,
 *   added in APE_REAL to the split's RP; with B_DBIAS, dS by distance in float32 over the
 *   block (one row vector meets BWD_KT + APE_RW - 1 distances), added in APE_REAL to the split's
 *   slice of DBP;
 *   dV: P times dO into accumulators that keep their lanes until the block's end;
 *   pass 2, per pair component p, keys in reverse: the rotated query turned back one step per
 *   key (it is d(dot)/d(k_j)), dK += g times it; dQ by Horner's rule,
 *   V = R(w) V + g k_j, so that sum_j g_ij R(-theta_ij) k_j = R(-theta_i0) V (no sin or cos
 *   past the seed), added to the split's DQP.
 *
 * At the block's end each dK_j and dV_j is summed over its lanes once and added to the output
 * (one owner per key). DQP, RP and DBP have one slice per split (zero before the launch); only
 * split s writes slice s, in its fixed block order, so no float atomics and two runs are bit for
 * bit the same; ape_bwd_reduce (ape_bwd_dbias_dist for DBP) sums the slices in split order.
 * Lanes past the last row, or that a
 * key is hidden from, add nothing (a select, so that NaN in a row reaches only the keys it sees
 * and NaN in a key only the rows that see it). Only the wanted outputs are computed, each the
 * same way whatever else is wanted.
 */
/* One row vector of ape_bwd_reduce: rows rb + i0 .. of segment g of (batch, head) bh, its row
 * table at ri, its nsplit slices of DQP from dq0 and of RP from rp0 (dstride and rstride apart;
 * ape_bwd_short: its one slice, in its slots). */
KFN void bwd_reduce_vec(__global const APE_REAL *prm, int npad, __global const APE_REAL *ri, int D,
			int H, int flags, __global const float *dq0, long dstride,
			__global const APE_REAL *rp0, long rstride, int nsplit,
			__global const void *Q, __global float *DQ, __global APE_REAL *PART,
			const struct bseg g, long i0, long rb, long bh, long4 vq)
{
	const int P = BD(D) / 2, causal = (flags & B_CAUSAL) != 0;
	const int inter = (flags & B_INTERLEAVED) != 0;
	__global const APE_REAL *hp = prm + npad + 4 * (bh % H);
	APE_REAL su[RP_N][APE_RW], coef[APE_RW], tx[APE_RW], ty[APE_RW];
#if !APE_FP64
	APE_REAL sh[RP_N][APE_RW], sl[RP_N][APE_RW]; /* the pairs; su their values */
#endif
	long cnt[APE_RW];
	int hi;

	hi = (int)(g.lq - i0 < APE_RW ? g.lq - i0 : APE_RW);
	NOUNROLL for (int f = 0; f < RP_N; f++) {
		vr acc = (vr)0;
#if APE_FP64
		NOUNROLL for (int sp = 0; sp < nsplit; sp++)
			acc += VL(rp0 + sp * rstride + f * APE_RW);
#else
		vr err = (vr)0;

		NOUNROLL for (int sp = 0; sp < nsplit; sp++) {
			__global const APE_REAL *r = rp0 + sp * rstride;
			const vr x = VL(r + f * APE_RW);

			BWD_TWO_SUM(vr, acc, err, x);
			err += VL(r + (RP_N + f) * APE_RW);
		}
		VS(acc, sh[f]);
		VS(err, sl[f]);
		acc = BWD_SUM_VALUE(acc, err);
#endif
		VS(acc, su[f]);
	}
	NOUNROLL for (int l = 0; l < hi; l++) {
		const long i = i0 + l, row = rb + i;
		const APE_REAL sigma = ri[RI_SIGMA * APE_RW + l];
		const APE_REAL Ai = su[0][l] / ri[RI_ALPHA * APE_RW + l];

		/* keys this row sees (causal: j <= rel + i) */
		cnt[l] = ape_visible_keys(g.rel + i, g.lk, causal);
		/* the path through alpha_i: A_i d(alpha)/d(sigma) d(sigma)/d(q) */
		coef[l] = Ai * ape_grad_dalpha_dsigma(hp[3], sigma) *
			  ape_grad_dsigma_coef((APE_REAL)BD(D), sigma);
		if (flags & B_DP) {
			const int ok = cnt[l] > 0;
#if APE_FP64
			PART[row * 4 + 0] = ok ? su[1][l] : (APE_REAL)0;
			PART[row * 4 + 1] = ok ? su[2][l] : (APE_REAL)0;
			PART[row * 4 + 2] = ok ? su[3][l] : (APE_REAL)0;
			/* d(alpha)/d(lambda) */
			PART[row * 4 + 3] = ok ? su[4][l] + Ai * ape_grad_gate(sigma) : (APE_REAL)0;
#else /* the pairs, sum then error term */
			APE_REAL h3 = sh[4][l], l3 = sl[4][l];
			const APE_REAL ga = Ai * ape_grad_gate(sigma);

			/* d(alpha)/d(lambda) */
			BWD_TWO_SUM(APE_REAL, h3, l3, ga);
			for (int k = 0; k < 3; k++) {
				PART[(row * 4 + k) * 2] = ok ? sh[k + 1][l] : (APE_REAL)0;
				PART[(row * 4 + k) * 2 + 1] = ok ? sl[k + 1][l] : (APE_REAL)0;
			}
			PART[(row * 4 + 3) * 2] = ok ? h3 : (APE_REAL)0;
			PART[(row * 4 + 3) * 2 + 1] = ok ? l3 : (APE_REAL)0;
#endif
		}
	}
	if (!(flags & B_DQ))
		return;
	NOUNROLL for (int p = 0; p < P; p++) {
		vr ax = (vr)0, ay = (vr)0;

		NOUNROLL for (int sp = 0; sp < nsplit; sp++) {
			__global const float *dq = dq0 + sp * dstride;

			ax += TO_VR(VL(dq + p * APE_RW));
			ay += TO_VR(VL(dq + (P + p) * APE_RW));
		}
		VS(ax, tx);
		VS(ay, ty);
		NOUNROLL for (int l = 0; l < hi; l++) {
			/* dQ's row (contiguous) and Q's (the launch's view) */
			const long qb = (rb + i0 + l) * BD(D), qv = BWD_AT(vq, bh, H, g.q0 + i0 + l);
			const int ca = inter ? 2 * p : p, cb = inter ? 2 * p + 1 : p + P;
			const APE_REAL mean = ri[RI_MEAN * APE_RW + l];

			if (cnt[l] <= 0)
				continue; /* no visible key here: the row adds nothing */
			DQ[qb + ca] += (float)(tx[l] + coef[l] * ((APE_REAL)ld(Q, qv + ca,
									       B_DT_IN(flags)) -
								  mean));
			DQ[qb + cb] += (float)(ty[l] + coef[l] * ((APE_REAL)ld(Q, qv + cb,
									       B_DT_IN(flags)) -
								  mean));
		}
	}
}

/* ape_bwd_short's arguments past the sweep's (ocl_backward.c): the launch's inputs (Q with dO,
 * K with V, O, LSE, dLSE) and the outputs the other kernels write (pairs, dQ, the rows' parameter
 * sums); its segments, and the row vectors of each work-item's slot per query head (the most a
 * segment has). NULL and 0 for the other sweeps. */
#define BWD_SHORT_ARGS                                                                             \
	__global const void *Q, __global const void *DO, __global const void *K,                   \
		__global const void *V, __global const void *O, __global const float *LSE,         \
		__global const float *DLSE, __global ulong *PAIRS, __global float *DQ,             \
		__global APE_REAL *PART, long nseg, long nrvs, long4 vq, long4 vdo, long4 vk,      \
		long4 vv, long4 vo
#define BWD_SHORT_PASS Q, DO, K, V, O, LSE, DLSE, PAIRS, DQ, PART, nseg, nrvs, vq, vdo, vk, vv, vo
#define BWD_SHORT_NONE                                                                             \
	NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, (long4)(0), (long4)(0),  \
		(long4)(0), (long4)(0), (long4)(0)

/*
 * ape_bwd_short, per segment sg of work-item wi's (batch, kv head): before its key blocks, each
 * row vector of each query head of the kv head as ape_bwd_prep and ape_bwd_rows make it (the
 * same functions), into the work-item's slots of QP, rinfo and STEP (slot row vector
 * (wi group + h - h0) nrvs + i0 / APE_RW), its one slice of DQP and RP cleared; after them
 * (reduce), each as ape_bwd_reduce (the same function) from its one slice. No skipping (the
 * host leaves B_SKIP out: the bound's key norm would come from a pass over every key).
 */
KFN void bwd_short_rows(BWD_SWEEP_ARGS, __global float *DQP, __global APE_REAL *RP, BWD_SHORT_ARGS,
			long wi, const struct bseg sg, int reduce)
{
	const struct bwd b = bwd_init(D, nmin, ndist, nblk, scale, flags);
	const long bkv = get_global_id(1), Hkv = H / group, h0 = bkv % Hkv * group;

	for (long h = h0; h < h0 + group; h++) {
		const long bh = bkv / Hkv * H + h, rb = bh * Lq + sg.q0;

		for (long i0 = 0; i0 < sg.lq; i0 += APE_RW) {
			const long blk = (wi * group + h - h0) * nrvs + i0 / APE_RW;
			/* (the slots: written here, read by the sweep as its prepared rows) */
			__global float *qt = (__global float *)QP + blk * b.rs * APE_RW;
			__global APE_REAL *ri = (__global APE_REAL *)rinfo + RI_AT(blk, 0, APE_RW);
			__global float *dq = DQP ? DQP + blk * b.D * APE_RW : DQP;
			__global APE_REAL *rp = RP ? RP + blk * RP_N * BSUM * APE_RW : RP;

			if (reduce) {
				if (flags & (B_DQ | B_DP))
					bwd_reduce_vec(prm, npad, ri, D, H, flags, dq, 0, rp, 0, 1, Q,
						       DQ, PART, sg, i0, rb, bh, vq);
				continue;
			}
			for (int l = 0; l < APE_RW; l++)
				bwd_prep_row(Q, B_DT_IN(flags), DO, B_DT_DO(flags),
					     BWD_AT(vq, bh, H, sg.q0 + i0 + l),
					     BWD_AT(vdo, bh, H, sg.q0 + i0 + l), APE_RW, D, b.npad,
					     b.rs - 2 * b.npad,
					     b.inter, qt + l, NULL, 0, i0 + l, i0 + l < sg.lq);
			bwd_rows_vec(qt, ri, (__global float *)STEP + blk * 2 * b.npad * APE_RW, O, LSE,
				     DLSE, prm, npad, D, H, flags, NULL, group, scale, 0.0f, PAIRS, NULL,
				     0, 0, sg, i0, rb, bh, vo);
			for (int c = 0; dq && c < b.D * APE_RW; c++)
				dq[c] = 0.0f;
			for (int c = 0; rp && c < RP_N * BSUM * APE_RW; c++)
				rp[c] = 0;
		}
	}
}

KFN void bwd_sweep(BWD_SWEEP_ARGS, __global float *DK, __global float *DV, __global float *DQP,
		   __global APE_REAL *RP, int nsplit, long nrv, __global APE_REAL *DBP,
		   const int sep, BWD_SHORT_ARGS, const int shortm)
{
	const struct bwd b = bwd_init(D, nmin, ndist, nblk, scale, flags);
	const long s = get_global_id(0), bkv = get_global_id(1), Hkv = H / group;
	/* ape_bwd_short: the work-item's slots, its query heads from h0 */
	const long wi = bkv * nsplit + s, h0 = bkv % Hkv * group;
	const int wrow = (flags & (B_DQ | B_DP)) != 0; /* the rows' sums are wanted */
	/* per key kt, component c: lanes at ((kt * D) + c) * APE_RW */
	float dkacc[BWD_KT * APE_DMAX * APE_RW], dvacc[BWD_KT * APE_DMAX * APE_RW];
	vf Pm[KR][BWD_KT], Gm[KR][BWD_KT], X0[KR][APE_PMAX], Y0[KR][APE_PMAX];
	vf C0[KR][APE_PMAX], S0[KR][APE_PMAX];
	vf xs[APE_PMAX], ys[APE_PMAX];
	/* B_DBIAS: a row vector's dS of the block by distance, lane l of key kt at
	 * BWD_KT - 1 - kt + l (distance nl0 - (BWD_KT - 1) + that) */
	float dsd[BWD_KT + APE_RW - 1];
	__global const float *qtg[KR], *cwg[KR], *swg[KR];
	long nl0[KR], blkg[KR];
	int hi[KR], full[KR];

	if (s >= nsplit)
		return;
	for (int x = 0; x < BWD_KT + APE_RW - 1; x++)
		dsd[x] = 0.0f;
	for (long it = s; it < (shortm ? nseg : nkb); it += nsplit) {
		/* the key blocks kb0 .. kb1 - 1 to walk: block it, or (ape_bwd_short) segment it's
		 * blocks, its rows prepared before them and reduced after them */
		long kb0 = it, kb1 = it + 1;

		if (shortm) {
			const struct bseg sg = bwd_seg(SG, it, Lq, Lk, rel);

			bwd_short_rows(BWD_SWEEP_PASS, DQP, RP, BWD_SHORT_PASS, wi, sg, 0);
			kb0 = sg.kb0;
			kb1 = sg.kb0 + (sg.lk + BWD_KT - 1) / BWD_KT;
		}
		for (long kb = kb0; kb < kb1; kb++) {
			/* the block's segment (dense: the launch), its keys j0.. of it, rows 0..lq - 1 */
			const struct bseg sg = bwd_seg(SG, KBS ? KBS[kb] : 0, Lq, Lk, rel);
			const long j0 = (kb - sg.kb0) * BWD_KT, lq = sg.lq, srel = sg.rel;
			const int nk = (int)(sg.lk - j0 < BWD_KT ? sg.lk - j0 : BWD_KT);
			/* the prepared keys: Lk per (batch, kv head), or a ragged launch's key blocks */
			__global const float *kp =
				shortm ? KP + wi * BWD_KT * b.krs
				       : KP + (bkv * (SG ? nkb * BWD_KT : Lk) + kb * BWD_KT) * b.krs;
			long i0;
			/* the accumulators hold nothing yet: the block's first group starts them from zero
			 * instead of reading them (no clearing pass: with skipping, a block often meets a
			 * group or two) */
			int fresh = 1;

			if (shortm) /* ape_bwd_short: the block's keys to the work-item's slot */
				for (int kt = 0; kt < BWD_KT; kt++)
					bwd_prep_row(K, B_DT_IN(flags), V, B_DT_IN(flags),
						     BWD_AT(vk, bkv, Hkv, sg.k0 + j0 + kt),
						     BWD_AT(vv, bkv, Hkv, sg.k0 + j0 + kt), 1, D, b.npad,
						     b.rs - 2 * b.npad, b.inter,
						     (__global float *)kp + kt * b.krs, prm, sep, j0 + kt,
						     j0 + kt < sg.lk);
			/* causal: row i sees key j when n = rel + i - j >= 0; from the row vector holding it */
			i0 = b.causal ? ape_sat_sub(j0, srel) : 0;
			i0 = (i0 < 0 ? 0 : i0) / APE_RW * APE_RW;
			for (long h = bkv % Hkv * group; h < (bkv % Hkv + 1) * group; h++) {
				const long bh = bkv / Hkv * H + h;
				__global const APE_REAL *th = tab + TB_AT(h, 0, b.ndist);

				for (long r0 = i0; r0 < lq;) {
					int nr = 0;

					/* pass 1 for up to KR row vectors */
					for (; r0 < lq && nr < KR; r0 += APE_RW) {
						/* ape_bwd_short: the row vector's slots */
						const long blk = shortm ? (wi * group + h - h0) * nrvs + r0 / APE_RW
									: bh * b.nblk + sg.rv0 + r0 / APE_RW;
						__global const float *qt = QP + blk * b.rs * APE_RW;
						__global const APE_REAL *ri = rinfo + RI_AT(blk, 0, APE_RW);
						__global const float *cw = STEP + blk * 2 * b.npad * APE_RW,
								     *sw = cw + b.npad * APE_RW;
						vf Ad = (vf)0.0f, f0 = (vf)0.0f, f1 = (vf)0.0f, f2 = (vf)0.0f,
						   f3 = (vf)0.0f;
						vr iav, lse, nv;
						vf dsub;
						const int g = nr;

						/* left out by the skip bound (or seen by no row of the vector) */
						if (j0 + nk <= (long)ri[RI_JLO * APE_RW] ||
						    j0 >= (long)ri[RI_JHI * APE_RW])
							continue;
						nr++;
						qtg[g] = qt;
						cwg[g] = cw;
						swg[g] = sw;
						blkg[g] = blk;
						nl0[g] = srel + r0 - j0;
						hi[g] = (int)(lq - r0 < APE_RW ? lq - r0 : APE_RW);
						full[g] = hi[g] == APE_RW &&
							  (!b.causal || nl0[g] - (nk - 1) >= 0);
						iav = (APE_REAL)1 / VL(ri + RI_ALPHA * APE_RW);
						lse = VL(ri + RI_LSE * APE_RW);
						dsub = TO_VF(VL(ri + RI_DSUB * APE_RW));
						nv = ((APE_REAL)nl0[g] + TO_VR(IOTA)) * iav;
						/* the queries rotated to key j0 (by +theta); sep: rotated by
						 * their positions already (ape_bwd_rows), STEP their angles */
						NOUNROLL for (int p = 0; p < b.P; p++) {
							const vf x = VL(qt + p * APE_RW),
								 y = VL(qt + (b.npad + p) * APE_RW);
							vf c, sn;

							if (sep) {
								xs[p] = X0[g][p] = x;
								ys[p] = Y0[g][p] = y;
								C0[g][p] = VL(cw + p * APE_RW);
								S0[g][p] = VL(sw + p * APE_RW);
								continue;
							}
							sn = ape_seed_sincos((vr)prm[p] * nv, &c);
							xs[p] = X0[g][p] = x * c - y * sn;
							ys[p] = Y0[g][p] = x * sn + y * c;
							C0[g][p] = c;
							S0[g][p] = sn;
						}
						NOUNROLL for (int sb = 0; sb < nk; sb += KSB) {
							__global const float *kr[KSB];
							vf S[KSB], E[KSB], DOV[KSB];

	#pragma unroll
							for (int jj = 0; jj < KSB; jj++) {
								kr[jj] = kp + (sb + jj < nk ? sb + jj : nk - 1) *
										      b.krs;
								S[jj] = E[jj] = DOV[jj] = (vf)0.0f;
							}
							/* dO_i . V_j of the sub-block's keys */
							NOUNROLL for (int d = 0; d < b.D; d++) {
								const vf o = VL(qt + (2 * b.npad + d) * APE_RW);

	#pragma unroll
								for (int jj = 0; jj < KSB; jj++)
									DOV[jj] = fma(o, (vf)kr[jj][2 * b.npad + d],
										      DOV[jj]);
							}
							/* two pairs' walks interleaved (one alone waits on the
							 * FMA latency), the sums in pair order as one by one */
							int p = 0;

							NOUNROLL for (; p + 1 < b.P; p += 2) {
								vf x = xs[p], y = ys[p], x2 = xs[p + 1], y2 = ys[p + 1];
								const vf c = VL(cw + p * APE_RW),
									 sn = VL(sw + p * APE_RW);
								const vf c2 = VL(cw + (p + 1) * APE_RW),
									 sn2 = VL(sw + (p + 1) * APE_RW);

	#pragma unroll
								for (int jj = 0; jj < KSB; jj++) {
									__global const float *k = kr[jj];

									S[jj] = fma(x2, (vf)k[p + 1],
										    fma(y2, (vf)k[b.npad + p + 1],
											fma(x, (vf)k[p],
											    fma(y, (vf)k[b.npad + p],
												S[jj]))));
									E[jj] = fma(y2, (vf)k[b.rs + p + 1],
										    fma(x2, (vf)k[b.rs + b.npad + p + 1],
											fma(y, (vf)k[b.rs + p],
											    fma(x, (vf)k[b.rs + b.npad + p],
												E[jj]))));
									if (!sep) {
										bwd_turn(&x, &y, c, sn);
										bwd_turn(&x2, &y2, c2, sn2);
									}
								}
								xs[p] = x;
								ys[p] = y;
								xs[p + 1] = x2;
								ys[p + 1] = y2;
							}
							NOUNROLL for (; p < b.P; p++) {
								vf x = xs[p], y = ys[p];
								const vf c = VL(cw + p * APE_RW),
									 sn = VL(sw + p * APE_RW);

	#pragma unroll
								for (int jj = 0; jj < KSB; jj++) {
									S[jj] = fma(x, (vf)kr[jj][p],
										    fma(y, (vf)kr[jj][b.npad + p], S[jj]));
									E[jj] = fma(y, (vf)kr[jj][b.rs + p],
										    fma(x, (vf)kr[jj][b.rs + b.npad + p],
											E[jj]));
									if (!sep)
										bwd_turn(&x, &y, c, sn);
								}
								xs[p] = x;
								ys[p] = y;
							}
	#pragma unroll
							for (int jj = 0; jj < KSB; jj++) {
								const int kt = sb + jj;
								/* lane 0's distance in the table */
								const long e = nl0[g] - kt - b.nmin;
								const vf dov = DOV[jj];
								vf tsc, pv, ds, gv, dot = S[jj], ea = E[jj];

								if (kt >= nk)
									break;
								pv = bwd_p(VL(th + TB_T * b.ndist + e),
									   VL(th + TB_BIAS * b.ndist + e), lse, dot,
									   b.scale, &tsc);
								ds = pv * (dov - dsub);
								if (!full[g]) {
									const vi vis = KEYS_VIS(g, kt);

									ds = APE_V_SELECT((vf)0.0f, ds, vis);
									dot = APE_V_SELECT((vf)0.0f, dot, vis);
									ea = APE_V_SELECT((vf)0.0f, ea, vis);
								}
								gv = ds * tsc;
								Pm[g][kt] = pv;
								Gm[g][kt] = gv;
								if (flags & B_DBIAS) {
									float dl[APE_RW];

									VS(ds, dl);
	#pragma unroll
									for (int l = 0; l < APE_RW; l++)
										dsd[BWD_KT - 1 - kt + l] += dl[l];
								}
								if (!wrow)
									continue;
								Ad = fma(gv * TO_VF(((APE_REAL)(nl0[g] - kt) +
										     TO_VR(IOTA)) *
										    iav),
									 ea, Ad);
								f0 = fma(ds, TO_VF(VL(th + TB_DD * b.ndist + e)),
									 f0);
								f1 = fma(ds, TO_VF(VL(th + TB_DB * b.ndist + e)),
									 f1);
								f2 = fma(ds, TO_VF(VL(th + TB_DG * b.ndist + e)),
									 f2);
								f3 = fma(ds * dot,
									 TO_VF(VL(th + TB_DTL * b.ndist + e)), f3);
							}
						}
						/* dS by distance to the split's slice, cleared again: entry x at
						 * distance index nl0 - (BWD_KT - 1) + x - nmin, >= 0 from x =
						 * BWD_KT - nk (key nk - 1, lane 0), < ndist up to lane hi[g] - 1
						 * (the lanes past it added zeros only) */
						if (flags & B_DBIAS) {
							const long e0 = DBP_AT(s, bh, nrv / b.nblk, b.ndist * BSUM) +
									nl0[g] - (BWD_KT - 1) - b.nmin;

							NOUNROLL for (int x = BWD_KT - nk; x < BWD_KT - 1 + hi[g]; x++) {
	#if APE_FP64
								DBP[e0 + x] += (APE_REAL)dsd[x];
	#else /* the sum, its error term ndist after it */
								APE_REAL sm = DBP[e0 + x], er = DBP[e0 + b.ndist + x];
								const APE_REAL v = dsd[x];

								BWD_TWO_SUM(APE_REAL, sm, er, v);
								DBP[e0 + x] = sm;
								DBP[e0 + b.ndist + x] = er;
	#endif
								dsd[x] = 0.0f;
							}
						}
						if (wrow) { /* the split's sums of these rows */
							__global APE_REAL *rp =
								RP + ((shortm ? 0 : s * nrv) + blk) * RP_N * BSUM * APE_RW;
	#if APE_FP64
							VS(VL(rp) + TO_VR(Ad), rp);
							VS(VL(rp + APE_RW) + TO_VR(f0), rp + APE_RW);
							VS(VL(rp + 2 * APE_RW) + TO_VR(f1), rp + 2 * APE_RW);
							VS(VL(rp + 3 * APE_RW) + TO_VR(f2), rp + 3 * APE_RW);
							VS(VL(rp + 4 * APE_RW) +
								   TO_VR(f3) * (APE_REAL)b.scale,
							   rp + 4 * APE_RW);
	#else /* the RP_N sums, then their RP_N error terms */
							const vr add[RP_N] = { TO_VR(Ad), TO_VR(f0), TO_VR(f1),
									       TO_VR(f2),
									       TO_VR(f3) * (APE_REAL)b.scale };

	#pragma unroll
							for (int f = 0; f < RP_N; f++) {
								vr sm = VL(rp + f * APE_RW),
								   er = VL(rp + (RP_N + f) * APE_RW);

								BWD_TWO_SUM(vr, sm, er, add[f]);
								VS(sm, rp + f * APE_RW);
								VS(er, rp + (RP_N + f) * APE_RW);
							}
	#endif
						}
					}
					/* dV: P times dO, KSB keys by 2 components in registers at a time */
					if (flags & B_DV)
						NOUNROLL for (int kc = 0; kc < nk; kc += KSB)
							NOUNROLL for (int d0 = 0; d0 < b.D; d0 += 2) {
								vf a0[KSB], a1[KSB];

	#pragma unroll
								for (int jj = 0; jj < KSB; jj++) {
									const float *acc =
										dvacc + ((kc + jj) * b.D + d0) * APE_RW;

									a0[jj] = fresh ? (vf)0.0f : VL(acc);
									a1[jj] = fresh ? (vf)0.0f : VL(acc + APE_RW);
								}
								NOUNROLL for (int g = 0; g < nr; g++) {
									__global const float *o =
										qtg[g] + (2 * b.npad + d0) * APE_RW;
									const vf o0 = VL(o), o1 = VL(o + APE_RW);

									if (full[g]) {
	#pragma unroll
										for (int jj = 0; jj < KSB; jj++) {
											const vf pv = Pm[g][kc + jj];

											a0[jj] = fma(pv, o0, a0[jj]);
											a1[jj] = fma(pv, o1, a1[jj]);
										}
									} else {
	#pragma unroll
										for (int jj = 0; jj < KSB; jj++) {
											const vf pv = Pm[g][kc + jj];
											const vi ok = KEYS_VIS(g, kc + jj);

											a0[jj] += APE_V_SELECT(
												(vf)0.0f, pv * o0, ok);
											a1[jj] += APE_V_SELECT(
												(vf)0.0f, pv * o1, ok);
										}
									}
								}
	#pragma unroll
								for (int jj = 0; jj < KSB; jj++) {
									float *acc =
										dvacc + ((kc + jj) * b.D + d0) * APE_RW;

									if (kc + jj >= nk)
										break;
									VS(a0[jj], acc);
									VS(a1[jj], acc + APE_RW);
								}
							}
					/* dK: g times the rotated query, turned again from the first key, KDC keys'
					 * accumulators in registers at a time; where both row vectors see every
					 * key, two row vectors' walks interleave (one alone waits on the FMA
					 * latency), each key's sum in the same order as one by one */
					if (flags & B_DK)
						NOUNROLL for (int p = 0; p < b.P; p++) {
							vf X[KR], Y[KR];

							NOUNROLL for (int g = 0; g < nr; g++) {
								X[g] = X0[g][p];
								Y[g] = Y0[g][p];
							}
							NOUNROLL for (int kc = 0; kc < nk; kc += KDC) {
								vf ax[KDC], ay[KDC];

	#pragma unroll
								for (int jj = 0; jj < KDC; jj++) {
									const int kt = kc + jj < nk ? kc + jj : nk - 1;

									ax[jj] = fresh ? (vf)0.0f
										       : VL(dkacc + (kt * b.D + p) * APE_RW);
									ay[jj] = fresh ? (vf)0.0f
										       : VL(dkacc + (kt * b.D + b.P + p) *
												    APE_RW);
								}
								NOUNROLL for (int g = 0; g < nr; g++) {
									vf x = X[g], y = Y[g];
									const vf c = VL(cwg[g] + p * APE_RW);
									const vf sn = VL(swg[g] + p * APE_RW);

									if (kc + KDC <= nk && full[g] && g + 1 < nr &&
									    full[g + 1]) {
										vf x2 = X[g + 1], y2 = Y[g + 1];
										const vf c2 = VL(cwg[g + 1] + p * APE_RW);
										const vf sn2 = VL(swg[g + 1] + p * APE_RW);

	#pragma unroll
										for (int jj = 0; jj < KDC; jj++) {
											const vf gv = Gm[g][kc + jj];
											const vf gv2 = Gm[g + 1][kc + jj];

											ax[jj] = fma(gv2, x2,
												     fma(gv, x, ax[jj]));
											ay[jj] = fma(gv2, y2,
												     fma(gv, y, ay[jj]));
											if (!sep) {
												bwd_turn(&x, &y, c, sn);
												bwd_turn(&x2, &y2, c2,
													 sn2);
											}
										}
										X[g + 1] = x2;
										Y[g + 1] = y2;
									} else {
	#pragma unroll
										for (int jj = 0; jj < KDC; jj++) {
											const int kt = kc + jj;

											if (kt >= nk)
												break;
											if (full[g]) {
												ax[jj] = fma(Gm[g][kt], x,
													     ax[jj]);
												ay[jj] = fma(Gm[g][kt], y,
													     ay[jj]);
											} else {
												const vi ok =
													KEYS_VIS(g, kt);

												ax[jj] += APE_V_SELECT(
													(vf)0.0f,
													Gm[g][kt] * x, ok);
												ay[jj] += APE_V_SELECT(
													(vf)0.0f,
													Gm[g][kt] * y, ok);
											}
											if (!sep)
												bwd_turn(&x, &y, c, sn);
										}
									}
									X[g] = x;
									Y[g] = y;
									if (kc + KDC <= nk && full[g] && g + 1 < nr &&
									    full[g + 1])
										g++;
								}
	#pragma unroll
								for (int jj = 0; jj < KDC; jj++) {
									const int kt = kc + jj;

									if (kt >= nk)
										break;
									VS(ax[jj], dkacc + (kt * b.D + p) * APE_RW);
									VS(ay[jj],
									   dkacc + (kt * b.D + b.P + p) * APE_RW);
								}
							}
						}
					fresh = 0;
					/* dQ: Horner's rule over the block's keys in reverse,
					 * V = R(w) V + g k_j, then R(-theta_0) V to the split's slice; where
					 * every lane sees every key two pairs' walks interleave (each step
					 * waits on the last: one walk alone is bound by the FMA latency) */
					if (flags & B_DQ)
						NOUNROLL for (int g = 0; g < nr; g++) {
							__global float *dq =
								DQP + ((shortm ? 0 : s * nrv) + blkg[g]) * b.D * APE_RW;
							int p = 0;

							if (full[g])
								NOUNROLL for (; p + 1 < b.P; p += 2) {
									const vf c = VL(cwg[g] + p * APE_RW);
									const vf sn = VL(swg[g] + p * APE_RW), ns = -sn;
									const vf c2 = VL(cwg[g] + (p + 1) * APE_RW);
									const vf sn2 = VL(swg[g] + (p + 1) * APE_RW),
										 ns2 = -sn2;
									vf vx = (vf)0.0f, vy = (vf)0.0f, vx2 = (vf)0.0f,
									   vy2 = (vf)0.0f;

	#pragma unroll 8
									for (int kt = nk - 1; kt >= 0; kt--) {
										__global const float *k = kp + kt * b.krs;
										const vf gv = Gm[g][kt], an = vx,
											 an2 = vx2;

										if (sep) { /* no turn: a sum */
											vx = fma(gv, k[p], vx);
											vy = fma(gv, k[b.npad + p], vy);
											vx2 = fma(gv, k[p + 1], vx2);
											vy2 = fma(gv, k[b.npad + p + 1],
												  vy2);
											continue;
										}
										vx = fma(vx, c, fma(vy, ns, gv * k[p]));
										vy = fma(an, sn,
											 fma(vy, c, gv * k[b.npad + p]));
										vx2 = fma(vx2, c2,
											  fma(vy2, ns2, gv * k[p + 1]));
										vy2 = fma(an2, sn2,
											  fma(vy2, c2,
											      gv * k[b.npad + p + 1]));
									}
									bwd_dq_add(dq, p, b.P, vx, vy, C0[g][p], S0[g][p]);
									bwd_dq_add(dq, p + 1, b.P, vx2, vy2, C0[g][p + 1],
										   S0[g][p + 1]);
								}
							NOUNROLL for (; p < b.P; p++) {
								const vf c = VL(cwg[g] + p * APE_RW);
								const vf sn = VL(swg[g] + p * APE_RW), ns = -sn;
								vf vx = (vf)0.0f, vy = (vf)0.0f;

								NOUNROLL for (int kt = nk - 1; kt >= 0; kt--) {
									__global const float *k = kp + kt * b.krs;
									const vf gv = Gm[g][kt], an = vx;
									/* a hidden key's NaN must not reach the row */
									vf gu = gv * k[p], gw = gv * k[b.npad + p];

									if (!full[g]) {
										gu = APE_V_SELECT(gu, (vf)0.0f, gv == 0.0f);
										gw = APE_V_SELECT(gw, (vf)0.0f, gv == 0.0f);
									}
									if (sep) { /* no turn: a sum */
										vx += gu;
										vy += gw;
										continue;
									}
									vx = fma(vx, c, fma(vy, ns, gu));
									vy = fma(an, sn, fma(vy, c, gw));
								}
								bwd_dq_add(dq, p, b.P, vx, vy, C0[g][p], S0[g][p]);
							}
						}
				}
			}
			/* (a block no row sees adds nothing) */
			for (int kt = 0; !fresh && kt < nk; kt++) {
				const long kbase = (bkv * Lk + sg.k0 + j0 + kt) * b.D;
				const float *dka = dkacc + kt * b.D * APE_RW, *dva = dvacc + kt * b.D * APE_RW;

				int c = 0;

				/* component c of dK: pair c's first (c < P) or pair c - P's second; sep: the
				 * sums turned back by the key's angle, dk = R(-theta_j) dKr */
				if (flags & B_DK) {
					float sm[APE_DMAX];

	#if APE_RW == 16
					NOUNROLL for (; c + 16 <= b.D; c += 16)
						VS(bwd_hsum16(dka + c * 16), sm + c);
	#endif
					NOUNROLL for (; c < b.D; c++)
						sm[c] = bwd_hsum(VL(dka + c * APE_RW));
					if (sep) {
						__global const float *kc = kp + kt * b.krs + b.rs + 2 * b.npad;

						NOUNROLL for (int p = 0; p < b.P; p++) {
							const float co = kc[p], si = kc[b.npad + p];
							const float u = sm[p], w = sm[b.P + p];

							sm[p] = fma(u, co, w * si);
							sm[b.P + p] = fma(w, co, -(u * si));
						}
					}
					NOUNROLL for (c = 0; c < b.D; c++)
						DK[kbase + (!b.inter ? c : c < b.P ? 2 * c : 2 * (c - b.P) + 1)] +=
							sm[c];
				}
				c = 0;
	#if APE_RW == 16
				if (flags & B_DV)
					NOUNROLL for (; c + 16 <= b.D; c += 16)
						VS(VL(DV + kbase + c) + bwd_hsum16(dva + c * 16), DV + kbase + c);
	#endif
				if (flags & B_DV)
					NOUNROLL for (; c < b.D; c++)
						DV[kbase + c] += bwd_hsum(VL(dva + c * APE_RW));
			}
		}
		if (shortm)
			bwd_short_rows(BWD_SWEEP_PASS, DQP, RP, BWD_SHORT_PASS, wi,
				       bwd_seg(SG, it, Lq, Lk, rel), 1);
	}
}

/* The general sweep (any lambda): bwd_sweep() turning each row's rotation per key */
__kernel void ape_bwd_fused(BWD_SWEEP_ARGS, BWD_OUT_ARGS)
{
	bwd_sweep(BWD_SWEEP_PASS, BWD_OUT_PASS, 0, BWD_SHORT_NONE, 0);
}

/*
 * The separable sweep (lambda = 0 on every head, B_SEP; docs/kernels.md): alpha_i = 1 and
 * temp = 1, so theta_ij = (rel + i - j) omega_p splits into the row's angle and the key's, and
 * dot_ij = Qr_i . Kr_j with Qr_i = R((rel + i) omega) q_i (ape_bwd_rows, in place) and
 * Kr_j = R(j omega) k_j (ape_bwd_prep). bwd_sweep() with no turn anywhere: the alpha sum
 * E_ij = sum_p omega_p (yr_p u_p - xr_p w_p) of the rotated query is the same sum over Qr_i and
 * Kr_j (J R = R J, J the turn by -90 degrees: J R(theta_ij) q . k = J Qr . Kr), the prepared
 * key's omega products as before; dKr_j = sum_i g_ij Qr_i and dQr_i = sum_j g_ij Kr_j are plain
 * sums, turned back once: dk_j = R(-j omega) dKr_j at the block's end, dq_i =
 * R(-(rel + i) omega) dQr_i by bwd_dq_add() with STEP's angles. Everything else (skipping, the
 * splits and their order, the partial buffers, the row and parameter sums) is the general
 * sweep's.
 */
__kernel void ape_bwd_sep(BWD_SWEEP_ARGS, BWD_OUT_ARGS)
{
	bwd_sweep(BWD_SWEEP_PASS, BWD_OUT_PASS, 1, BWD_SHORT_NONE, 0);
}

/*
 * A ragged launch of short segments (ocl_backward.c, bwd_short(): each at most a few row
 * vectors and key blocks) in one kernel, without the launch-sized scratch: a work-item is split
 * `s` of a (batch, kv head), as in the sweep, but owns whole segments (it, it + nsplit, ...).
 * Per segment: its rows prepared and tabled (ape_bwd_prep's and ape_bwd_rows' functions) into
 * the work-item's slots (QP, rinfo, STEP, one slice of DQP and RP, a key block of KP: each
 * work-item's own, reused segment after segment, so they stay in cache); its key blocks, each
 * prepared into the KP slot and swept by bwd_sweep()'s block (the same code: per block the same
 * operations in the same order as the general launch's); then its rows reduced
 * (ape_bwd_reduce's function) into DQ and PART. ape_bwd_dist before it, ape_bwd_params and the
 * table's reductions after it, as for the other sweeps. _sep: lambda = 0 on every head (B_SEP).
 */
__kernel void ape_bwd_short(BWD_SWEEP_ARGS, BWD_OUT_ARGS, BWD_SHORT_ARGS)
{
	bwd_sweep(BWD_SWEEP_PASS, BWD_OUT_PASS, 0, BWD_SHORT_PASS, 1);
}

__kernel void ape_bwd_short_sep(BWD_SWEEP_ARGS, BWD_OUT_ARGS, BWD_SHORT_ARGS)
{
	bwd_sweep(BWD_SWEEP_PASS, BWD_OUT_PASS, 1, BWD_SHORT_PASS, 1);
}

/*
 * Per row vector (one work-item): the splits' sums of ape_bwd_fused in split order: dQ_i, then
 * the alpha path A_i applied to it (A_i d(alpha)/d(sigma) d(sigma)/d(q)), added to DQ; the rows'
 * parameter sums (with d(alpha)/d(lambda)) to PART[row][4] (zero for a row that sees no key of
 * this launch), for ape_bwd_params.
 */
__kernel void ape_bwd_reduce(__global const APE_REAL *prm, int npad,
			     __global const APE_REAL *rinfo, int D, int H, long Lq, long Lk,
			     long rel, int flags, __global const float *DQP,
			     __global const APE_REAL *RP, int nsplit, long nrv,
			     __global const void *Q, __global float *DQ, __global APE_REAL *PART,
			     long nblk, __global const long *SG, __global const int *RVS, long4 vq)
{
	const long ib = get_global_id(0), bh = get_global_id(1);
	/* the row vector's segment (a dense launch: the launch); rows from rb + i0 */
	const struct bseg g = bwd_seg(SG, RVS && ib < nblk ? RVS[ib] : 0, Lq, Lk, rel);
	const long blk = bh * nblk + ib, i0 = (ib - g.rv0) * APE_RW, rb = bh * Lq + g.q0;

	if (ib >= nblk)
		return;
	bwd_reduce_vec(prm, npad, rinfo + RI_AT(blk, 0, APE_RW), D, H, flags,
		       DQP + blk * BD(D) * APE_RW, nrv * BD(D) * APE_RW,
		       RP + blk * RP_N * BSUM * APE_RW, nrv * RP_N * BSUM * APE_RW, nsplit, Q, DQ,
		       PART, g, i0, rb, bh, vq);
}

/* Per head h: the parameter sums of its rows (rows r0 .. r0 + nr - 1 of each (batch, head): a
 * ragged launch's part, ocl_backward.c), batch by batch, row by row, added to dparams[h][4]
 * (float64). Without float64: the compensated pairs' totals to OUT[h][4][2]
 * (sum, error term), which the host adds to dparams in float64 (ocl_backward.c). */
#if APE_FP64
__kernel void ape_bwd_params(__global const APE_REAL *PART, long B, int H, long Lq,
			     __global double *dparams, long r0, long nr)
#else
__kernel void ape_bwd_params(__global const APE_REAL *PART, long B, int H, long Lq,
			     __global float *OUT, long r0, long nr)
#endif
{
	const int h = (int)get_global_id(0);
	APE_REAL acc[4] = { 0, 0, 0, 0 };
#if !APE_FP64
	APE_REAL err[4] = { 0, 0, 0, 0 };
#endif

	if (h >= H)
		return;
	for (long b = 0; b < B; b++)
		for (long i = r0; i < r0 + nr; i++)
			for (int k = 0; k < 4; k++) {
#if APE_FP64
				acc[k] += PART[((b * H + h) * Lq + i) * 4 + k];
#else
				const long at = (((b * H + h) * Lq + i) * 4 + k) * 2;
				const APE_REAL x = PART[at];

				BWD_TWO_SUM(APE_REAL, acc[k], err[k], x);
				err[k] += PART[at + 1];
#endif
			}
	for (int k = 0; k < 4; k++) {
#if APE_FP64
		dparams[4 * h + k] += (double)acc[k];
#else
		OUT[(4 * h + k) * 2] = acc[k];
		OUT[(4 * h + k) * 2 + 1] = err[k];
#endif
	}
}

/*
 * The distance-bias table's gradient, first step: per row r of the table (head r, or with
 * `shared` the one row of every head) and distance n = nmin + idx, ape_bwd_fused's dS sums
 * (DBP_AT) over the batch, the row's heads and the splits, in that order, to DBD[r][idx].
 */
__kernel void ape_bwd_dbias_dist(__global const APE_REAL *DBP, int nsplit, long B, int H,
				 int shared, long ndist, __global APE_REAL *DBD)
{
	const long idx = get_global_id(0), r = get_global_id(1);
	const long h0 = shared ? 0 : r, h1 = shared ? H : r + 1;
	APE_REAL acc = 0;
#if !APE_FP64
	APE_REAL err = 0;
#endif

	if (idx >= ndist)
		return;
	for (long b = 0; b < B; b++)
		for (long h = h0; h < h1; h++)
			for (int sp = 0; sp < nsplit; sp++) {
				const long at = DBP_AT(sp, b * H + h, B * H, ndist * BSUM) + idx;
#if APE_FP64
				acc += DBP[at];
#else /* pairs: the sums, then ndist on their error terms */
				const APE_REAL x = DBP[at];

				BWD_TWO_SUM(APE_REAL, acc, err, x);
				err += DBP[at + ndist];
#endif
			}
	DBD[r * ndist * BSUM + idx] = acc;
#if !APE_FP64
	DBD[r * ndist * BSUM + ndist + idx] = err;
#endif
}

/*
 * Second step, per row r and entry m = m0 + get_global_id(0) (m0 .. m0 + nm - 1: the entries
 * the launch's distances n = nmin .. nmin + ndist - 1 read): the sums of DBD over the distances
 * whose ape_bias_index(|n|, M) is m, n = -m then n = m, or for the last entry every |n| >= M - 1
 * from the most negative n up; added to DBIAS[r][m] (float64, the call's accumulator).
 */
#if APE_FP64
__kernel void ape_bwd_dbias(__global const APE_REAL *DBD, long nmin, long ndist, long M, long m0,
			    long nm, __global double *DBIAS)
#define DB_ADD(k) (acc += d[k])
#else /* the pairs' totals to OUT[r][m - m0][2] (sum, error term), added to DBIAS in float64 by
       * the host (ocl_backward.c) */
__kernel void ape_bwd_dbias(__global const APE_REAL *DBD, long nmin, long ndist, long M, long m0,
			    long nm, __global float *OUT)
#define DB_ADD(k)                                                                                 \
	do {                                                                                       \
		const APE_REAL x_ = d[k];                                                          \
		BWD_TWO_SUM(APE_REAL, acc, err, x_);                                               \
		err += d[ndist + (k)];                                                             \
	} while (0)
#endif
{
	const long m = m0 + get_global_id(0), r = get_global_id(1), nmax = nmin + ndist - 1;
	__global const APE_REAL *d = DBD + r * ndist * BSUM;
	APE_REAL acc = 0;
#if !APE_FP64
	APE_REAL err = 0;
#endif

	if ((long)get_global_id(0) >= nm)
		return;
	if (m < M - 1) {
		if (-m >= nmin && -m <= nmax)
			DB_ADD(-m - nmin);
		if (m > 0 && m >= nmin && m <= nmax)
			DB_ADD(m - nmin);
	} else { /* n <= -m, then n >= m (n >= 1 when m is 0: n = 0 once) */
		for (long n = nmin; n <= nmax && n <= -m; n++)
			DB_ADD(n - nmin);
		for (long n = max(max(m, 1L), nmin); n <= nmax; n++)
			DB_ADD(n - nmin);
	}
#if APE_FP64
	DBIAS[r * M + m] += (double)acc;
#else
	OUT[(r * nm + m - m0) * 2] = acc;
	OUT[(r * nm + m - m0) * 2 + 1] = err;
#endif
}
#undef DB_ADD

#if !APE_FP64
/* The float32 (bits) nearest a float64's bits, ties to even, as (float)x would give where the
 * device has float64: copy_view's float64 accumulators (dparams) to float32 without it. */
KFN uint bwd_f64_bits_to_f32(ulong u)
{
	const uint sign = (uint)(u >> 32) & 0x80000000u;
	const int e = (int)(u >> 52) & 0x7ff;
	const ulong m = u & 0xfffffffffffffUL;
	int ef, sh;
	ulong mm, rem, hf, r;

	if (e == 0x7ff) /* Inf, or a quiet NaN keeping the payload's top bits */
		return sign | 0x7f800000u | (m ? 0x400000u | (uint)(m >> 29) : 0u);
	if (e == 0) /* zero or a float64 subnormal: below float32's least subnormal */
		return sign;
	ef = e - 1023 + 127;
	if (ef >= 255)
		return sign | 0x7f800000u;
	mm = m | 0x10000000000000UL; /* the implicit bit */
	sh = ef >= 1 ? 29 : 29 + 1 - ef; /* float32 subnormals keep fewer bits */
	if (sh > 60)
		return sign;
	r = mm >> sh;
	rem = mm & ((1UL << sh) - 1);
	hf = 1UL << (sh - 1);
	r += rem > hf || (rem == hf && (r & 1));
	/* normal: the implicit bit lands on the exponent's lowest, so add (ef - 1) << 23; a
	 * rounding carry moves up the exponent (to Inf past the largest float32) */
	return sign | (uint)(ef >= 1 ? ((ulong)(ef - 1) << 23) + r : r);
}
#endif

/*
 * copy_view (core/backend.h, struct ape_be_copy): element d of row r (r over B*H*L in b, h, i
 * order) from SRC's view into DST's, converted: a bit copy when the types agree, float32 to
 * f16/bf16 through st() (rounded to nearest even), float64 to float32. Types: ape_dtype values,
 * 3 for float64.
 */
__kernel void ape_copy_view(__global void *DST, int dt_dst, long doff, long dsb, long dsh, long dsl,
			    __global const void *SRC, int dt_src, long soff, long ssb, long ssh,
			    long ssl, long H, long L, long D)
{
	const long d = (long)get_global_id(0), r = (long)get_global_id(1);
	const long i = r % L, b = r / L / H, h = r / L % H;
	long so, dof;

	if (d >= D)
		return;
	so = soff + b * ssb + h * ssh + i * ssl + d;
	dof = doff + b * dsb + h * dsh + i * dsl + d;
	if (dt_src == dt_dst) {
		if (dt_dst == 3)
			((__global ulong *)DST)[dof] = ((__global const ulong *)SRC)[so];
		else if (dt_dst == 0)
			((__global uint *)DST)[dof] = ((__global const uint *)SRC)[so];
		else
			((__global ushort *)DST)[dof] = ((__global const ushort *)SRC)[so];
	} else if (dt_src == 3) {
#if APE_FP64
		((__global float *)DST)[dof] = (float)((__global const double *)SRC)[so];
#else
		((__global uint *)DST)[dof] = bwd_f64_bits_to_f32(((__global const ulong *)SRC)[so]);
#endif
	} else {
		st(DST, dof, ((__global const float *)SRC)[so], dt_dst);
	}
}

