/* SPDX-License-Identifier: MIT */
/*
 * The APE backward pass (APE-SPEC.md, "Gradients"), OpenCL C 1.2, built after attention.cl in
 * the same program (it uses its loads, ld(), and its lane types). Six kernels, enqueued in
 * order by ocl_backward.c:
 *
 *   ape_bwd_prep     Q with dO, and K with V, as float32 rows in the sweeps' order (twice);
 *   ape_bwd_dist     per head and distance: temp, bias and their parameter derivatives;
 *   ape_bwd_rows     per query row: mean, sigma, alpha, the saved LSE and Dl_i - dLSE_i
 *                    (Dl_i = dO_i . O_i), once, for the two sweeps;
 *   ape_bwd_keys     keys outer: one work-item owns a key and sums dK_j and dV_j over every row
 *                    of every query head that reads its kv head, then adds them once;
 *   ape_bwd_queries  queries outer: one work-item owns a row and sums dQ_i, the alpha path A_i
 *                    (applied to dQ_i at the end) and the row's four parameter sums;
 *   ape_bwd_params   per head: the rows' parameter sums in float64, in row order, added to
 *                    dparams.
 *
 * No float atomics anywhere: every sum has one owner and a fixed order, so two runs are bit
 * for bit the same. Both sweeps recompute P_ij = exp(s_ij - LSE_i) from q, k and the saved
 * LSE; nothing of size Lq * Lk exists. The rotation of one (row, key) pair is evaluated in
 * vectors of APE_RW pairs: each angle n omega_p / alpha_i seeded exactly in APE_REAL by
 * ape_seed_sincos (the forward's seed), the pair products in float32. The per-pair scalar work
 * (temperature, bias, exp, the parameter terms) runs in APE_REAL through ape_math.h.
 *
 * Built only with APE_FP64: dparams are float64 sums, and the host refuses the backward pass
 * on a device without cl_khr_fp64 (ocl_backward.c).
 */
#if APE_FP64

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

/*
 * One row of Q with its dO, or of K with its V, as the sweeps read it: float32, the pairs'
 * first components (npad of them, zero past P, so padded lanes add nothing), their second
 * components, then the D components of the vector (zero up to dpad). Converting f16/bf16 or
 * de-interleaving once per row, not once per pair.
 */
__kernel void ape_bwd_prep(__global const void *A, int dt_a, __global const void *Bv, int dt_b,
			   long rows, int D, int npad, int dpad, int inter, __global float *out)
{
	const long row = get_global_id(0), base = row * (long)BD(D);
	const int P = BD(D) / 2;
	__global float *o = out + row * (2 * npad + dpad);

	if (row >= rows)
		return;
	for (int p = 0; p < npad; p++) {
		o[p] = p < P ? ld(A, base + (inter ? 2 * p : p), dt_a) : 0.0f;
		o[npad + p] = p < P ? ld(A, base + (inter ? 2 * p + 1 : p + P), dt_a) : 0.0f;
	}
	for (int d = 0; d < dpad; d++)
		o[2 * npad + d] = d < BD(D) ? ld(Bv, base + d, dt_b) : 0.0f;
}

/* The distance terms of each head at every distance n = nmin + idx a launch has, once: the
 * sweeps look them up per pair instead of evaluating logs and roots in APE_REAL. */
__kernel void ape_bwd_dist(__global const APE_REAL *prm, int npad, int H, long nmin, long ndist,
			   __global APE_REAL *tab)
{
	const long idx = get_global_id(0), h = get_global_id(1), n = nmin + idx;
	__global const APE_REAL *hp = prm + npad + 4 * h;
	__global APE_REAL *tb = tab + (h * ndist + idx) * TB_N;
	const APE_REAL an = (APE_REAL)(n < 0 ? -n : n);

	if (idx >= ndist || h >= H)
		return;
	tb[TB_T] = ape_temp(hp[3], an);
	tb[TB_BIAS] = ape_bias(hp[0], hp[1], hp[2], an);
	tb[TB_DD] = ape_grad_dbias_ddelta(an);
	tb[TB_DB] = ape_grad_dbias_dbeta(an);
	tb[TB_DG] = ape_grad_dbias_dgamma(an);
	tb[TB_DTL] = ape_grad_dtemp_dlambda(hp[3], an);
}

KFN float bwd_dot(__global const float *a, __global const float *b, int nvec)
{
	vf acc = 0.0f;

	NOUNROLL for (int c = 0; c < nvec; c++)
		acc = fma(VL(a + c * APE_RW), VL(b + c * APE_RW), acc);
	return bwd_hsum(acc);
}

/*
 * The rotated dot product of one (row, key) pair (prepared rows qr and kr) at nia = n / alpha_i.
 * cs, sn hold each chunk's cos and sin of theta: seeded exactly from the angle when `seed`,
 * otherwise those of the previous key (n + 1) turned back by one step (stc, sts: cos and sin
 * of omega / alpha_i), the forward's short recurrence. *ddt (when not NULL) gets
 * sum_p APE_GRAD_DDOT_DALPHA_THETA, i.e. d(dot)/d(alpha) times alpha.
 */
KFN float bwd_pair(__global const float *qr, __global const float *kr, int npad,
		   __global const APE_REAL *omega, APE_REAL nia, int npc, vf *cs, vf *sn,
		   const vf *stc, const vf *sts, int seed, float *ddt)
{
	vf acc = 0.0f, accd = 0.0f;

	NOUNROLL for (int c = 0; c < npc; c++) {
		const int o = c * APE_RW;
		const vf xv = VL(qr + o), yv = VL(qr + npad + o);
		const vf uv = VL(kr + o), wv = VL(kr + npad + o);
		vf co, s;

		if (seed) {
			s = ape_seed_sincos(VL(omega + o) * nia, &co);
		} else {
			co = fma(cs[c], stc[c], sn[c] * sts[c]);
			s = fma(sn[c], stc[c], -cs[c] * sts[c]);
		}
		acc += (xv * uv + yv * wv) * co + (xv * wv - yv * uv) * s;
		if (ddt)
			accd += APE_GRAD_DDOT_DALPHA_THETA(xv, yv, uv, wv, co, s,
							   TO_VF(VL(omega + o) * nia));
		cs[c] = co;
		sn[c] = s;
	}
	if (ddt)
		*ddt = bwd_hsum(accd);
	return bwd_hsum(acc);
}

/* cos and sin of each chunk's step omega / alpha (one key further: theta falls by it) */
KFN void bwd_step(__global const APE_REAL *omega, APE_REAL inv_alpha, int npc, vf *stc, vf *sts)
{
	NOUNROLL for (int c = 0; c < npc; c++)
		sts[c] = ape_seed_sincos(VL(omega + c * APE_RW) * inv_alpha, &stc[c]);
}

/* One launch's shape, as the kernels read it */
struct bwd {
	int D, P, npc, ndc, npad, rs, inter;
	long Lq, Lk, rel, nmin, ndist;
	float scale;
};

KFN struct bwd bwd_init(int D, long Lq, long Lk, long rel, float scale, int flags)
{
	struct bwd b;

	b.D = BD(D);
	b.P = b.D / 2;
	b.npc = (b.P + APE_RW - 1) / APE_RW;
	b.ndc = (b.D + APE_RW - 1) / APE_RW;
	b.npad = b.npc * APE_RW;
	b.rs = 2 * b.npad + b.ndc * APE_RW; /* floats per prepared row */
	b.inter = (flags & B_INTERLEAVED) != 0;
	b.Lq = Lq;
	b.Lk = Lk;
	b.rel = rel;
	b.nmin = rel - (Lk - 1);
	b.ndist = Lq + Lk - 1;
	b.scale = scale;
	return b;
}

/*
 * P_ij and dS_ij of a pair whose rotated dot product is `dot`, with its distance's table entry
 * tb, the row's LSE and Dl - dLSE, and dov = dO_i . V_j. *t gets temp(n) * scale (dS times it
 * is d/d(dot)).
 */
KFN float bwd_ds(__global const APE_REAL *tb, float dot, __global const APE_REAL *ri, float dov,
		 float scale, float *p_out, float *t_out)
{
	const APE_REAL t = tb[TB_T];
	const APE_REAL s = t * (APE_REAL)scale * (APE_REAL)dot + tb[TB_BIAS];
	const float p = exp((float)(s - ri[RI_LSE]));

	*p_out = p;
	*t_out = (float)t * scale;
	return p * (dov - (float)ri[RI_DSUB]);
}

__kernel void ape_bwd_rows(__global const void *Q, __global const void *O,
			   __global const void *DO, __global const float *LSE,
			   __global const float *DLSE, __global const APE_REAL *prm, int npad,
			   int D, int H, long Lq, int flags, __global APE_REAL *rinfo)
{
	const long i = get_global_id(0), bh = get_global_id(1);
	const long row = bh * Lq + i, base = row * (long)BD(D);
	const APE_REAL lambda = prm[npad + 4 * (bh % H) + 3];
	APE_REAL mean = 0, ss = 0, dl = 0, sigma;
	__global APE_REAL *ri = rinfo + row * RI_N;

	if (i >= Lq)
		return;
	NOUNROLL for (int d = 0; d < BD(D); d++)
		mean += (APE_REAL)ld(Q, base + d, B_DT_IN(flags));
	mean /= (APE_REAL)BD(D);
	NOUNROLL for (int d = 0; d < BD(D); d++) {
		const APE_REAL e = (APE_REAL)ld(Q, base + d, B_DT_IN(flags)) - mean;

		ss += e * e;
		dl += (APE_REAL)ld(DO, base + d, B_DT_DO(flags)) *
		      (APE_REAL)ld(O, base + d, B_DT_OUT(flags));
	}
	sigma = ape_sigma(ss, BD(D));
	ri[RI_MEAN] = mean;
	ri[RI_SIGMA] = sigma;
	ri[RI_ALPHA] = ape_alpha(lambda, sigma);
	ri[RI_LSE] = LSE[row];
	ri[RI_DSUB] = dl - ((flags & B_DLSE) ? (APE_REAL)DLSE[row] : (APE_REAL)0);
}

/* The arguments both sweeps take first (ocl_backward.c: bwd_sweep_args()): the prepared rows,
 * omega and the heads' parameters, the row and distance tables, the shape, the flags. */
#define BWD_SWEEP_ARGS                                                                             \
	__global const float *QP, __global const float *KP, __global const APE_REAL *prm,         \
		int npad, __global const APE_REAL *rinfo, __global const APE_REAL *tab, int D,     \
		int H, int group, long Lq, long Lk, long rel, float scale, int flags

/* Keys per work-item of the keys sweep: its accumulators are APE_RW lanes wide per component,
 * so fewer for larger D. ocl_backward.c mirrors it. */
#define BWD_KT (APE_DMAX <= 64 ? 8 : APE_DMAX <= 128 ? 4 : 2)
/* Keys between reseeds of the queries sweep's recurrence (the forward's longest tile). */
#define BWD_RESEED 64

/*
 * Keys outer: dV_j = sum_i P_ij dO_i, dK_j = sum_i dS_ij temp scale d(dot)/d(k_j) (q_i's pairs
 * rotated by +theta), over the rows of every query head of key j's kv head, for BWD_KT keys
 * j0.. of one kv head. As in the forward, APE_RW query rows ride in the lanes of a vector: per
 * row vector, each pair's rotation is seeded at the first key and turned one step per key
 * after it; the accumulators keep their lanes until the end, where each is summed once. Lanes
 * past the last row, or that a key is hidden from, add nothing (a select, so that NaN in a
 * row reaches only the keys it sees). QP, KP: the prepared rows (ape_bwd_prep).
 */
__kernel void ape_bwd_keys(BWD_SWEEP_ARGS, __global float *DK, __global float *DV)
{
	const struct bwd b = bwd_init(D, Lq, Lk, rel, scale, flags);
	const long j0 = get_global_id(0) * BWD_KT, bkv = get_global_id(1), Hkv = H / group;
	const int nk = (int)(Lk - j0 < BWD_KT ? Lk - j0 : BWD_KT);
	const int causal = (flags & B_CAUSAL) != 0;
	/* per key kt, component c: lanes at ((kt * D) + c) * APE_RW */
	float dkacc[BWD_KT * APE_DMAX * APE_RW], dvacc[BWD_KT * APE_DMAX * APE_RW];
	/* the row vector: pairs, dO, and per-lane row values */
	float xs[APE_PMAX * APE_RW], ys[APE_PMAX * APE_RW], dos[APE_DMAX * APE_RW];
	float dsub[APE_RW], okf[APE_RW], tl[APE_RW];
	APE_REAL ia[APE_RW], lse[APE_RW], nn[APE_RW], tt[APE_RW], tbias[APE_RW];
	long nl[APE_RW];
	vf cs[APE_PMAX], sn[APE_PMAX], stc[APE_PMAX], sts[APE_PMAX];
	long i0;

	if (j0 >= Lk)
		return;
	NOUNROLL for (int x = 0; x < nk * b.D * APE_RW; x++)
		dkacc[x] = dvacc[x] = 0.0f;
	/* causal: row i sees key j when n = rel + i - j >= 0 */
	i0 = causal ? j0 - rel : 0;
	i0 = i0 < 0 ? 0 : i0;
	for (long h = bkv % Hkv * group; h < (bkv % Hkv + 1) * group; h++) {
		const long rbase = (bkv / Hkv * H + h) * Lq;
		__global const APE_REAL *th = tab + h * b.ndist * TB_N;

		for (long r0 = i0; r0 < Lq; r0 += APE_RW) {
			vr iav, nv;

			NOUNROLL for (int l = 0; l < APE_RW; l++) {
				const long i = r0 + l, ic = i < Lq ? i : Lq - 1, row = rbase + ic;
				__global const APE_REAL *ri = rinfo + row * RI_N;
				__global const float *qr = QP + row * b.rs;
				const int ok = i < Lq;

				ia[l] = (APE_REAL)1 / ri[RI_ALPHA];
				lse[l] = ri[RI_LSE];
				dsub[l] = (float)ri[RI_DSUB];
				nl[l] = rel + ic - j0;
				nn[l] = (APE_REAL)nl[l];
				okf[l] = ok ? 1.0f : 0.0f;
				NOUNROLL for (int p = 0; p < b.P; p++) {
					xs[p * APE_RW + l] = ok ? qr[p] : 0.0f;
					ys[p * APE_RW + l] = ok ? qr[b.npad + p] : 0.0f;
				}
				NOUNROLL for (int d = 0; d < b.D; d++)
					dos[d * APE_RW + l] = ok ? qr[2 * b.npad + d] : 0.0f;
			}
			iav = VL(ia);
			nv = VL(nn) * iav;
			NOUNROLL for (int p = 0; p < b.P; p++) {
				sn[p] = ape_seed_sincos((vr)prm[p] * nv, &cs[p]);
				if (nk > 1)
					sts[p] = ape_seed_sincos((vr)prm[p] * iav, &stc[p]);
			}
			for (int kt = 0; kt < nk; kt++) {
				__global const float *kr = KP + (bkv * Lk + j0 + kt) * b.rs;
				float *dka = dkacc + kt * b.D * APE_RW, *dva = dvacc + kt * b.D * APE_RW;
				vf dot = 0.0f, dov = 0.0f, p, g, okv;
				vr sv;

				NOUNROLL for (int l = 0; l < APE_RW; l++) {
					__global const APE_REAL *tb =
						th + (nl[l] - kt - b.nmin) * TB_N;

					tt[l] = tb[TB_T];
					tbias[l] = tb[TB_BIAS];
					tl[l] = (float)(nl[l] - kt);
				}
				NOUNROLL for (int q = 0; q < b.P; q++) {
					const float u = kr[q], w = kr[b.npad + q];
					const vf x = VL(xs + q * APE_RW), y = VL(ys + q * APE_RW);

					if (kt) { /* one key further: theta falls by one step */
						const vf c = cs[q];

						cs[q] = fma(c, stc[q], sn[q] * sts[q]);
						sn[q] = fma(sn[q], stc[q], -c * sts[q]);
					}
					dot += (x * u + y * w) * cs[q] + (x * w - y * u) * sn[q];
				}
				NOUNROLL for (int d = 0; d < b.D; d++)
					dov = fma(VL(dos + d * APE_RW), (vf)kr[2 * b.npad + d], dov);
				sv = VL(tt) * (APE_REAL)b.scale * TO_VR(dot) + VL(tbias) - VL(lse);
				p = exp(TO_VF(sv));
				g = p * (dov - VL(dsub)) * TO_VF(VL(tt)) * b.scale;
				if (r0 + APE_RW <= Lq && (!causal || r0 + rel - j0 - kt >= 0)) {
					/* every lane's row exists and sees the key */
					NOUNROLL for (int d = 0; d < b.D; d++)
						VS(fma(p, VL(dos + d * APE_RW), VL(dva + d * APE_RW)),
						   dva + d * APE_RW);
					NOUNROLL for (int q = 0; q < b.P; q++) {
						const vf x = VL(xs + q * APE_RW), y = VL(ys + q * APE_RW);
						float *au = dka + q * APE_RW, *aw = dka + (b.P + q) * APE_RW;

						VS(fma(g, x * cs[q] - y * sn[q], VL(au)), au);
						VS(fma(g, y * cs[q] + x * sn[q], VL(aw)), aw);
					}
					continue;
				}
				/* a lane adds only where its row exists and sees the key: a select
				 * on each product, so that NaN in a row reaches only keys it sees */
				okv = VL(okf);
				if (causal)
					okv = APE_V_SELECT((vf)0.0f, okv, VL(tl) >= 0.0f);
				NOUNROLL for (int d = 0; d < b.D; d++)
					VS(VL(dva + d * APE_RW) +
						   APE_V_SELECT((vf)0.0f, p * VL(dos + d * APE_RW),
								okv > 0.5f),
					   dva + d * APE_RW);
				NOUNROLL for (int q = 0; q < b.P; q++) {
					const vf x = VL(xs + q * APE_RW), y = VL(ys + q * APE_RW);
					float *au = dka + q * APE_RW, *aw = dka + (b.P + q) * APE_RW;

					VS(VL(au) + APE_V_SELECT((vf)0.0f, g * (x * cs[q] - y * sn[q]),
								 okv > 0.5f),
					   au);
					VS(VL(aw) + APE_V_SELECT((vf)0.0f, g * (y * cs[q] + x * sn[q]),
								 okv > 0.5f),
					   aw);
				}
			}
		}
	}
	for (int kt = 0; kt < nk; kt++) {
		const long kbase = (bkv * Lk + j0 + kt) * b.D;
		const float *dka = dkacc + kt * b.D * APE_RW, *dva = dvacc + kt * b.D * APE_RW;

		if (flags & B_DK)
			NOUNROLL for (int q = 0; q < b.P; q++) {
				DK[kbase + (b.inter ? 2 * q : q)] += bwd_hsum(VL(dka + q * APE_RW));
				DK[kbase + (b.inter ? 2 * q + 1 : q + b.P)] +=
					bwd_hsum(VL(dka + (b.P + q) * APE_RW));
			}
		if (flags & B_DV)
			NOUNROLL for (int d = 0; d < b.D; d++)
				DV[kbase + d] += bwd_hsum(VL(dva + d * APE_RW));
	}
}

/*
 * Queries outer: dQ_i (k_j's pairs rotated by -theta), the alpha path A_i = sum_j dS_ij temp
 * scale d(dot_ij)/d(alpha_i), applied to dQ_i at the end, and the row's parameter sums, in
 * APE_REAL, to PART[row][4] (zero for a row that sees no key of this launch: it adds nothing).
 */
__kernel void ape_bwd_queries(BWD_SWEEP_ARGS, __global const void *Q, __global float *DQ,
			      __global APE_REAL *PART)
{
	const struct bwd b = bwd_init(D, Lq, Lk, rel, scale, flags);
	const long i = get_global_id(0), bh = get_global_id(1), h = bh % H;
	const long row = bh * Lq + i, qbase = row * b.D;
	const long kvrows = (bh / H * (H / group) + h / group) * Lk;
	__global const APE_REAL *hp = prm + npad + 4 * h;
	__global const APE_REAL *ri = rinfo + row * RI_N;
	__global const APE_REAL *th = tab + h * b.ndist * TB_N;
	__global const float *qr = QP + row * b.rs, *dout = qr + 2 * b.npad;
	float dqx[APE_PMAX], dqy[APE_PMAX];
	vf cs[BPV], sn[BPV], stc[BPV], sts[BPV];
	APE_REAL A = 0, dp[4] = { 0, 0, 0, 0 }, coef, alpha, inv_alpha;
	long jend;

	if (i >= Lq)
		return;
	alpha = ri[RI_ALPHA];
	inv_alpha = (APE_REAL)1 / alpha;
	NOUNROLL for (int p = 0; p < b.npad; p++)
		dqx[p] = dqy[p] = 0.0f;
	bwd_step(prm, inv_alpha, b.npc, stc, sts);
	/* causal: keys j <= rel + i */
	jend = (flags & B_CAUSAL) ? (rel + i + 1 < Lk ? rel + i + 1 : Lk) : Lk;
	for (long j = 0; j < jend; j++) {
		const long n = rel + i - j;
		__global const float *kr = KP + (kvrows + j) * b.rs;
		__global const APE_REAL *tb = th + (n - b.nmin) * TB_N;
		float dot, ddt, p, t, ds, g;

		dot = bwd_pair(qr, kr, b.npad, prm, (APE_REAL)n * inv_alpha, b.npc, cs, sn, stc,
			       sts, j % BWD_RESEED == 0, &ddt);
		ds = bwd_ds(tb, dot, ri, bwd_dot(dout, kr + 2 * b.npad, b.ndc), b.scale, &p, &t);
		g = ds * t;
		A += (APE_REAL)g * (APE_REAL)ddt;
		if (flags & B_DP) {
			dp[0] += (APE_REAL)ds * tb[TB_DD];
			dp[1] += (APE_REAL)ds * tb[TB_DB];
			dp[2] += (APE_REAL)ds * tb[TB_DG];
			dp[3] += (APE_REAL)ds * (APE_REAL)b.scale * (APE_REAL)dot * tb[TB_DTL];
		}
		if (!(flags & B_DQ))
			continue;
		NOUNROLL for (int c = 0; c < b.npc; c++) {
			const int o = c * APE_RW;
			const vf uv = VL(kr + o), wv = VL(kr + b.npad + o);

			VS(fma((vf)g, uv * cs[c] + wv * sn[c], VL(dqx + o)), dqx + o);
			VS(fma((vf)g, wv * cs[c] - uv * sn[c], VL(dqy + o)), dqy + o);
		}
	}
	A /= alpha; /* the pairs summed d(dot)/d(alpha) times alpha */
	dp[3] += A * ape_grad_gate(ri[RI_SIGMA]); /* d(alpha)/d(lambda) */
	if (flags & B_DP)
		for (int k = 0; k < 4; k++)
			PART[row * 4 + k] = jend > 0 ? dp[k] : (APE_REAL)0;
	if (!(flags & B_DQ) || jend <= 0)
		return; /* no visible key here: the row adds nothing */
	/* the path through alpha_i: A_i d(alpha)/d(sigma) d(sigma)/d(q) */
	coef = A * ape_grad_dalpha_dsigma(hp[3], ri[RI_SIGMA]) *
	       ape_grad_dsigma_coef((APE_REAL)b.D, ri[RI_SIGMA]);
	NOUNROLL for (int p = 0; p < b.P; p++) {
		const long ia = qbase + (b.inter ? 2 * p : p);
		const long ib = qbase + (b.inter ? 2 * p + 1 : p + b.P);

		DQ[ia] += (float)((APE_REAL)dqx[p] +
				  coef * ((APE_REAL)ld(Q, ia, B_DT_IN(flags)) - ri[RI_MEAN]));
		DQ[ib] += (float)((APE_REAL)dqy[p] +
				  coef * ((APE_REAL)ld(Q, ib, B_DT_IN(flags)) - ri[RI_MEAN]));
	}
}

/* Per head h: the parameter sums of its rows, batch by batch, row by row, added to
 * dparams[h][4] (float64: the device has cl_khr_fp64, or the host does not launch this). */
__kernel void ape_bwd_params(__global const APE_REAL *PART, long B, int H, long Lq,
			     __global double *dparams)
{
	const int h = (int)get_global_id(0);
	APE_REAL acc[4] = { 0, 0, 0, 0 };

	if (h >= H)
		return;
	for (long b = 0; b < B; b++)
		for (long i = 0; i < Lq; i++)
			for (int k = 0; k < 4; k++)
				acc[k] += PART[((b * H + h) * Lq + i) * 4 + k];
	for (int k = 0; k < 4; k++)
		dparams[4 * h + k] += (double)acc[k];
}

#endif /* APE_FP64 */
