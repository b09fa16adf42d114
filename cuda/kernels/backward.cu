/* SPDX-License-Identifier: MIT */
/*
 * The APE backward pass (APE-SPEC.md, "Gradients"; docs/cuda.md), FlashAttention-2's structure
 * with APE's rotation, in one fused sweep (keys outer, each pair's score computed once), as the
 * OpenCL backend's (opencl/kernels/backward.cl). Five kernels, enqueued in this order by
 * cuda_backward.c:
 *
 *   ape_bwd_rows       one warp per query row: mean and sigma of q_i (float64, as the forward
 *                      computes them; the sweep derives alpha_i from sigma_i) and Dl_i - dLSE_i,
 *                      Dl_i = dO_i . O_i, to a row table (scratch, 24 bytes per row);
 *   ape_bwd_fused_*    keys outer: one block per (split, batch, kv head); a split owns the key
 *                      tiles kt = s, s + nsplit, ... (APE_BW_ROWS keys each, dealt round-robin
 *                      so that, causal, the splits get as many long tiles as short ones) and
 *                      walks them in that order. Per tile, TPR threads share a key row and keep
 *                      its K and V and its dK and dV accumulators in registers (8 pairs each)
 *                      while query rows of every query head of the kv head stream through
 *                      shared memory in stages, in order; dK and dV are added to the outputs
 *                      once, at the tile's end (one writer per key). With dQ or dparams wanted,
 *                      each stage's (row, key) dS, dot product and alpha sum wait in shared
 *                      memory for a second pass in which TPR2 threads share a staged row: its
 *                      dQ share sum_j g_ij R(-theta_ij) k_j over the tile's keys (the key tile
 *                      in shared memory, the rotation turned one step per key from an exact
 *                      seed), its alpha path A_i alpha_i and its four parameter sums (float64),
 *                      written to the split's slice at the split's first tile, added after.
 *                      With the distance-bias table's gradient wanted, each stage's dS is also
 *                      summed along its diagonals (one distance each, one thread each, rows in
 *                      order) into the split's per-distance sums (scratch, zeroed by the split
 *                      first);
 *   ape_bwd_reduce     (dQ or dparams only) one warp per query row: the splits' slices summed in
 *                      split order, float64; the alpha path A_i d(alpha)/d(sigma) d(sigma)/d(q)
 *                      applied to dQ_i, added to dQ; the rows' parameter sums (with
 *                      d(alpha)/d(lambda)) summed per block of APE_BW_RED_ROWS rows in row order
 *                      to a per-block slot (scratch);
 *   ape_bwd_params     (dparams only) one thread per head: the blocks' sums in batch and block
 *                      order, float64, added to dparams;
 *   ape_bwd_dbias      (dbias only) one block per entry of the table's gradient: the splits'
 *                      per-distance sums of the distances that read the entry, over batches,
 *                      heads and splits, a fixed share per thread and a fixed tree, added to
 *                      dbias.
 *
 * No floating-point atomics: every sum has one owner and a fixed order (only split s writes
 * slice s, in its fixed tile order; the lane reductions are butterflies of shuffles, the same on
 * every run), so two runs are bit-identical. The sweep recomputes P_ij = exp(s_ij - LSE_i) from
 * q, k and the saved LSE; nothing of size Lq * Lk exists (the slices are nsplit times Lq * D
 * floats and Lq * APE_BW_RP_N doubles per (batch, head)). Per (row, key) the score's distance
 * terms (temp * scale and the bias with the distance-bias table's entry, and with dparams their
 * parameter derivatives) come from a per-stage table in shared memory, float64 where they
 * carry magnitude (the bias), so that s_ij - LSE_i keeps float32's relative accuracy at any |n|.
 *
 * The rotation: the first pass meets a new alpha_i with every query row, so it seeds every (row,
 * key, pair) angle exactly (ape_seed_sincos()): no recurrence, the most accurate angle, at the
 * cost of a dozen float operations and a few float64 ones per pair. The second pass walks the
 * tile's keys with a fixed alpha_i, so it turns each pair's (cos, sin) one step per key (the
 * forward's recurrence) from an exact seed at the tile's first key.
 *
 * Masking: a pair a row cannot see (causal, or past the last key) adds nothing at all (not
 * 0 * x: an input may hold a NaN the gradient must not receive); rows with no visible key add
 * nothing to dQ and dparams.
 */
#include "common.cuh"

#include "bwd_args.h"

namespace ape {

template <int DMAX> struct BwShape {
	static constexpr int NTH = APE_CU_THREADS;
	static constexpr int TPR = APE_BW_TPR(DMAX);
	static constexpr int PM = DMAX / 2; /* pairs of a padded row */
	static constexpr int PT = PM / TPR; /* pairs per thread of the key pass: 8 */
	static constexpr int ROWS = APE_BW_ROWS(DMAX);
	static constexpr int STAGE = APE_BW_STAGE(DMAX);
	static constexpr int TBL = APE_BW_TBL(DMAX);
	static constexpr int TPR2 = APE_BW_TPR2(DMAX);
	static constexpr int PT2 = APE_BW_PT2(DMAX); /* pairs per thread of the row pass */
	/* shared memory: staged query rows A and their dO B ([STAGE][x_0..x_PM-1 | y_0..y_PM-1]
	 * float32), the key tile K (the same, [ROWS]), per (staged row, key) dS, dot and the
	 * alpha sum, the distance table, omega, the staged rows' values */
	static constexpr int OFF_A = 0;
	static constexpr int OFF_B = OFF_A + STAGE * DMAX * 4;
	static constexpr int OFF_K = OFF_B + STAGE * DMAX * 4;
	static constexpr int OFF_DS = OFF_K + ROWS * DMAX * 4; /* float [STAGE][ROWS] */
	static constexpr int OFF_DOT = OFF_DS + STAGE * ROWS * 4; /* float [STAGE][ROWS] */
	static constexpr int OFF_DDT = OFF_DOT + STAGE * ROWS * 4; /* float [STAGE][ROWS] */
	static constexpr int OFF_TB = OFF_DDT + STAGE * ROWS * 4; /* double [TBL]: bias */
	static constexpr int OFF_TD = OFF_TB + TBL * 8; /* double [TBL][4]: derivatives */
	static constexpr int OFF_OM = OFF_TD + TBL * 32; /* double [PM]: omega */
	static constexpr int OFF_RIA = OFF_OM + PM * 8; /* double [STAGE]: 1 / alpha */
	static constexpr int OFF_TT = OFF_RIA + STAGE * 8; /* float [TBL]: temp * scale */
	static constexpr int OFF_OMF = OFF_TT + TBL * 4; /* float [PM]: omega */
	static constexpr int OFF_RL = OFF_OMF + PM * 4; /* float [STAGE]: LSE */
	static constexpr int OFF_RD = OFF_RL + STAGE * 4; /* float [STAGE]: Dl - dLSE */
	static constexpr int BYTES = OFF_RD + STAGE * 4;
	static_assert(BYTES == APE_BW_SMEM(DMAX), "bwd_args.h and the kernel disagree");
	static_assert(BYTES <= 99 * 1024, "within every sm_80+ GPU's opt-in");
	static_assert(PT == 8 && (TPR & (TPR - 1)) == 0, "8 pairs per thread, TPR a power of two");
	static_assert(TBL <= NTH, "one thread per table entry");
	static_assert(TPR2 * STAGE == NTH && TPR2 <= 32 && PT2 * TPR2 == PM,
		      "the row pass: one staged row per TPR2 threads of a warp");
};

/* The components of pair p of a row of D = 2P components (half or interleaved layout) */
APE_DEV int64_t comp_x(int p, bool inter)
{
	return inter ? 2 * p : p;
}

APE_DEV int64_t comp_y(int p, int P, bool inter)
{
	return inter ? 2 * p + 1 : p + P;
}

/* One pair's share of the rotated dot product: query pair (x, y), key pair (u, w), c and s the
 * cosine and sine of theta (APE-SPEC.md, "The score") */
APE_DEV float pair_dot(float x, float y, float u, float w, float c, float s)
{
	return (x * u + y * w) * c + (x * w - y * u) * s;
}

/* P_ij = exp(s_ij - LSE_i) from the row's dot product and its distance's table entries (temp *
 * scale, bias): the difference in float64, where the bias and LSE carry magnitude, and at most
 * 0 (APE_BWD_EXPONENT) */
APE_DEV float pair_prob(float tsc, double bias, float dot, double lse)
{
	const float x = (float)((double)(tsc * dot) + bias - lse);

	return expf(APE_BWD_EXPONENT(x)); /* at most 0 (ape/ape_math.h) */
}

/* The (tile, group) of this block, tiles outer; false for the blocks past ntile * ngroups that
 * the grid's rounding adds. */
APE_DEV bool block_tile(int64_t ntile, int64_t ngroups, int64_t &tile, int64_t &grp)
{
	const int64_t blk = block_linear();

	tile = blk / ngroups;
	grp = blk % ngroups;
	return blk < ntile * ngroups;
}

APE_DEV const float *bwd_head(const ape_cu_bwd_args &a, int64_t h)
{
	return a.hparams ? reinterpret_cast<const float *>(a.hparams) + 4 * h : a.hp + 4 * h;
}

/* One segment of a launch (bwd_args.h, APE_BW_SEGW): a dense launch is its one segment */
struct BwSeg {
	int64_t q0, lq, k0, lk, rel, kt0, db0;
};

APE_DEV BwSeg bw_seg(const ape_cu_bwd_args &a, int64_t e)
{
	if (!a.segt)
		return BwSeg{ 0, a.Lq, 0, a.Lk, a.rel, 0, 0 };

	const int64_t *t = reinterpret_cast<const int64_t *>(a.segt) + e * APE_BW_SEGW;

	return BwSeg{ t[APE_BW_SEG_Q0], t[APE_BW_SEG_LQ],  t[APE_BW_SEG_K0], t[APE_BW_SEG_LK],
		      t[APE_BW_SEG_REL], t[APE_BW_SEG_KT0], t[APE_BW_SEG_DB0] };
}

/* The last segment whose field f (APE_BW_SEG_Q0 or APE_BW_SEG_KT0, nondecreasing) is at most x:
 * the segment of query row x, or of key tile x (segments without keys have no tile: the last of
 * those sharing a kt0 is the one with tiles) */
APE_DEV BwSeg bw_seg_of(const ape_cu_bwd_args &a, int f, int64_t x)
{
	const int64_t *t = reinterpret_cast<const int64_t *>(a.segt);
	int64_t lo = 0, hi = a.nseg - 1;

	if (!a.segt)
		return bw_seg(a, 0);
	while (lo < hi) {
		const int64_t mid = lo + (hi - lo + 1) / 2;

		if (t[mid * APE_BW_SEGW + f] <= x)
			lo = mid;
		else
			hi = mid - 1;
	}
	return bw_seg(a, lo);
}

/* The first query row of segment g (counted from its q0) the fused sweep visits with its key
 * tile lt (counted from its kt0; causal: the first that sees the tile's first key, lt * kblk <=
 * rel + i; lq or more: none). Every row visited with a later tile of the segment is visited
 * with an earlier one, so split s has written row i of g to its slices iff it has a tile of g
 * and i >= tile_row0() of its first (split_wrote()): the sweep writes there and adds after,
 * ape_bwd_reduce reads there. */
APE_DEV int64_t tile_row0(const ape_cu_bwd_args &a, const BwSeg &g, int64_t lt)
{
	return (a.flags & APE_CU_F_CAUSAL) ? imax(0, ape_sat_sub(lt * a.kblk, g.rel)) : 0;
}

/* Has split s written row i (counted from g's q0) of segment g to its slices: its first tile of
 * g, g.kt0 + ((s - g.kt0) mod nsplit), is one of g's and visits row i. Dense: s < nkt and
 * i >= tile_row0() of tile s. */
APE_DEV bool split_wrote(const ape_cu_bwd_args &a, const BwSeg &g, int64_t s, int64_t i)
{
	const int64_t nt = (g.lk + a.kblk - 1) / a.kblk;
	const int64_t lt = ((s - g.kt0) % a.nsplit + a.nsplit) % a.nsplit;

	return lt < nt && i >= tile_row0(a, g, lt);
}

template <int DMAX, bool EXACT> struct Bwd {
	using S = BwShape<DMAX>;
	static constexpr int TPR = S::TPR, PM = S::PM, PT = S::PT, ROWS = S::ROWS;
	static constexpr int STAGE = S::STAGE, TPR2 = S::TPR2, PT2 = S::PT2;

	/* omega in double and float, for every thread's pairs (zeros past D / 2) */
	static APE_DEV void omegas(const ape_cu_bwd_args &a, unsigned char *sm, int P)
	{
		for (int p = threadIdx.x; p < PM; p += S::NTH) {
			const double om = EXACT || p < P ? a.omega[p] : 0.0;

			reinterpret_cast<double *>(sm + S::OFF_OM)[p] = om;
			reinterpret_cast<float *>(sm + S::OFF_OMF)[p] = (float)om;
		}
	}

	/*
	 * The distance table of one (tile, stage) meeting of head h: entry e holds n = nlo + e.
	 * temp * scale (float), the bias with head h's distance-bias table entry (double) and,
	 * with `derivs`, d(bias)/d(delta, beta, gamma) and d(temp)/d(lambda) (double).
	 */
	static APE_DEV void table(const ape_cu_bwd_args &a, unsigned char *sm, int64_t nlo,
				  const float *hp, int64_t h, bool derivs)
	{
		const int e = threadIdx.x;

		if (e >= S::TBL)
			return;
		/* entries past the launch's distances: saturated, never used */
		const int64_t ai = ape_abs_dist(ape_sat_add(nlo, e));
		const double an = (double)ai;
		double *td = reinterpret_cast<double *>(sm + S::OFF_TD) + 4 * e;

		double bias = ape_bias(hp[0], hp[1], hp[2], an);

		if (a.bias.tab)
			bias += (double)bias_at(a.bias, h, ai);
		reinterpret_cast<float *>(sm + S::OFF_TT)[e] = (float)(ape_temp(hp[3], an) * a.scale);
		reinterpret_cast<double *>(sm + S::OFF_TB)[e] = bias;
		if (derivs) {
			td[0] = ape_grad_dbias_ddelta(an);
			td[1] = ape_grad_dbias_dbeta(an);
			td[2] = ape_grad_dbias_dgamma(an);
			td[3] = ape_grad_dtemp_dlambda(hp[3], an);
		}
	}

	/*
	 * Rows row0 .. row0 + count - 1 (count <= STAGE) of two [rows][D] tensors (types dta, dtb)
	 * as float32 pairs into the staged tiles A and B; rows past `count` and pairs past D / 2
	 * become zeros.
	 */
	static APE_DEV void stage(unsigned char *sm, const void *ta, int dta, const void *tb, int dtb,
				  int64_t row0, int count, int D, bool inter)
	{
		const int P = D / 2;
		float *A = reinterpret_cast<float *>(sm + S::OFF_A);
		float *B = reinterpret_cast<float *>(sm + S::OFF_B);

		for (int e = threadIdx.x; e < STAGE * PM; e += S::NTH) {
			const int r = e / PM, p = e % PM;
			const bool ok = r < count && (EXACT || p < P);
			const int64_t base = (row0 + (ok ? r : 0)) * D;

			A[r * DMAX + p] = ok ? load_el(ta, base + comp_x(p, inter), dta) : 0.0f;
			A[r * DMAX + PM + p] = ok ? load_el(ta, base + comp_y(p, P, inter), dta) : 0.0f;
			B[r * DMAX + p] = ok ? load_el(tb, base + comp_x(p, inter), dtb) : 0.0f;
			B[r * DMAX + PM + p] = ok ? load_el(tb, base + comp_y(p, P, inter), dtb) : 0.0f;
		}
	}

	/* This thread's 8 pairs of one row of a [rows][D] tensor, zeros past D / 2 or when !ok */
	static APE_DEV void pairs(const void *t, int dt, int64_t row, bool ok, int c, int D,
				  bool inter, float (&x)[PT], float (&y)[PT])
	{
		const int P = D / 2;

#pragma unroll
		for (int p = 0; p < PT; p++) {
			const int pg = c * PT + p;
			const bool in = ok && (EXACT || pg < P);

			x[p] = in ? load_el(t, row * D + comp_x(pg, inter), dt) : 0.0f;
			y[p] = in ? load_el(t, row * D + comp_y(pg, P, inter), dt) : 0.0f;
		}
	}

	/*
	 * The row pass of one stage (rows i0 .. i0 + nr - 1 of (batch, head) bh against key tile
	 * kt, keys j0 .. j0 + nk - 1): TPR2 threads share staged row r; from the first pass's dS,
	 * dot and alpha sums (shared memory) the row's dQ share over the tile's keys, in key order,
	 * and its five row sums (float64; the keys dealt to the TPR2 threads, then a butterfly),
	 * written to split s's slices at the split's first tile (fresh), added after.
	 */
	static APE_DEV void row_pass(const ape_cu_bwd_args &a, const unsigned char *sm, int64_t s,
				     const BwSeg &g, int64_t bh, int64_t i0, int nr, int64_t j0,
				     int nk, bool fresh)
	{
		const int tid = threadIdx.x, r = tid / TPR2, c = tid % TPR2;
		const int D = EXACT ? DMAX : a.D, P = D / 2;
		const bool causal = a.flags & APE_CU_F_CAUSAL;
		const bool want_dp = a.flags & APE_BW_F_DP;
		const bool row_ok = r < nr;
		const int64_t i = i0 + r, n0 = ape_sat_sub(ape_sat_add(g.rel, i), j0);
		/* keys of the tile the row sees: causal, j <= rel + i */
		const int kend = !row_ok ? 0 : (int)ape_visible_keys(n0, nk, causal);
		const float *Kt = reinterpret_cast<const float *>(sm + S::OFF_K) + c * PT2;
		const float *sds = reinterpret_cast<const float *>(sm + S::OFF_DS) + r * ROWS;
		const float *sdot = reinterpret_cast<const float *>(sm + S::OFF_DOT) + r * ROWS;
		const float *sddt = reinterpret_cast<const float *>(sm + S::OFF_DDT) + r * ROWS;
		const float *tt = reinterpret_cast<const float *>(sm + S::OFF_TT);
		const double *td = reinterpret_cast<const double *>(sm + S::OFF_TD);
		const double *om = reinterpret_cast<const double *>(sm + S::OFF_OM) + c * PT2;
		const double ia = row_ok ? reinterpret_cast<const double *>(sm + S::OFF_RIA)[r] : 1.0;
		const int64_t row = bh * a.Lq + g.q0 + i;
		double rs[APE_BW_RP_N] = { 0.0, 0.0, 0.0, 0.0, 0.0 };

		if (a.flags & APE_BW_F_DQ) {
			float dqx[PT2], dqy[PT2], cs[PT2], sn[PT2], stc[PT2], sts[PT2];
			const double nia = (double)n0 * ia;

#pragma unroll
			for (int p = 0; p < PT2; p++) {
				dqx[p] = dqy[p] = 0.0f;
				/* one key further, theta falls by omega_p / alpha_i */
				sts[p] = ape_seed_sincos(om[p] * ia, &stc[p]);
				sn[p] = ape_seed_sincos(nia * om[p], &cs[p]);
			}
#pragma unroll 1
			for (int kk = 0; kk < kend; kk++) {
				const float g = sds[kk] * tt[r - kk + ROWS - 1];
				const float *ku = Kt + kk * DMAX, *kw = ku + PM;

#pragma unroll
				for (int p = 0; p < PT2; p++) {
					const float uu = ku[p], ww = kw[p];

					if (kk) { /* one key further: theta falls by one step */
						const float c0 = cs[p];

						cs[p] = fmaf(c0, stc[p], sn[p] * sts[p]);
						sn[p] = fmaf(sn[p], stc[p], -c0 * sts[p]);
					}
					/* k's pair rotated by -theta */
					dqx[p] = fmaf(g, uu * cs[p] + ww * sn[p], dqx[p]);
					dqy[p] = fmaf(g, ww * cs[p] - uu * sn[p], dqy[p]);
				}
			}
			if (row_ok) {
				float *dq = reinterpret_cast<float *>(a.dqp) +
					    (s * a.B * a.H * a.Lq + row) * D;

#pragma unroll
				for (int p = 0; p < PT2; p++) {
					const int pg = c * PT2 + p;

					if (!EXACT && pg >= P)
						break;
					dq[pg] = fresh ? dqx[p] : dq[pg] + dqx[p];
					dq[P + pg] = fresh ? dqy[p] : dq[P + pg] + dqy[p];
				}
			}
		}
#pragma unroll 1
		for (int kk = c; kk < kend; kk += TPR2) {
			const int e = r - kk + ROWS - 1;
			const float ds = sds[kk], g = ds * tt[e];

			rs[0] += (double)g * (double)sddt[kk];
			if (want_dp) {
				rs[1] += (double)ds * td[4 * e + 0];
				rs[2] += (double)ds * td[4 * e + 1];
				rs[3] += (double)ds * td[4 * e + 2];
				rs[4] += (double)ds * a.scale * (double)sdot[kk] * td[4 * e + 3];
			}
		}
#pragma unroll
		for (int k = 0; k < APE_BW_RP_N; k++)
			rs[k] = group_sum<TPR2>(rs[k]);
		if (row_ok && c == 0) {
			double *rp = reinterpret_cast<double *>(a.rp) +
				     (s * a.B * a.H * a.Lq + row) * APE_BW_RP_N;

#pragma unroll
			for (int k = 0; k < APE_BW_RP_N; k++)
				rp[k] = fresh ? rs[k] : rp[k] + rs[k];
		}
	}

	/*
	 * The distance-bias table's gradient of one stage (rows i0 .. i0 + nr - 1 of (batch, head)
	 * bh against keys j0 .. j0 + nk - 1): the pairs of one distance lie on one diagonal of the
	 * stage's dS (entry e of the distance table: r - kk = e - ROWS + 1); thread e sums its
	 * diagonal's visible pairs in row order (float64) and adds the sum to split s's sum for
	 * that distance (a.dbp). One thread per distance, the stages in the split's order: a fixed
	 * order, no atomics.
	 */
	static APE_DEV void dbias_pass(const ape_cu_bwd_args &a, const unsigned char *sm, int64_t s,
				       const BwSeg &g, int64_t bh, int64_t i0, int nr, int64_t j0,
				       int nk)
	{
		const int e = threadIdx.x, d = e - (ROWS - 1); /* r - kk on the diagonal */
		const int rlo = d > 0 ? d : 0, rhi = nr < nk + d ? nr : nk + d;

		if (e >= ROWS + STAGE - 1 || rlo >= rhi)
			return;
		/* causal: the diagonal's pairs (one distance) are all visible or none */
		if ((a.flags & APE_CU_F_CAUSAL) && ape_sat_add(g.rel, i0 - j0 + d) < 0)
			return;
		const float *sds = reinterpret_cast<const float *>(sm + S::OFF_DS);
		double sum = 0.0;

		for (int r = rlo; r < rhi; r++)
			sum += (double)sds[r * ROWS + r - d];
		reinterpret_cast<double *>(a.dbp)[(s * a.B * a.H + bh) * a.nd + g.db0 + i0 - j0 + d +
						   g.lk - 1] += sum;
	}

	/* ---------------------------------------------------------------- the fused sweep */
	static APE_DEV void fused(const ape_cu_bwd_args &a)
	{
		int64_t s, bkv;

		if (!block_tile(a.nsplit, (int64_t)a.B * a.Hkv, s, bkv))
			return;

		unsigned char *sm = smem_base();
		const int tid = threadIdx.x, kk = tid / TPR, c = tid % TPR;
		const int64_t b = bkv / a.Hkv, kh = bkv % a.Hkv, group = a.H / a.Hkv;
		const int D = EXACT ? DMAX : a.D;
		const bool causal = a.flags & APE_CU_F_CAUSAL;
		const bool inter = a.flags & APE_CU_F_INTERLEAVED;
		const bool want_dk = a.flags & APE_BW_F_DK, want_dv = a.flags & APE_BW_F_DV;
		/* the rows' sums are wanted: the second pass */
		const bool wrow = a.flags & (APE_BW_F_DQ | APE_BW_F_DP);
		const bool want_db = a.flags & APE_BW_F_DB;
		/* the stage's dS is read after the first pass */
		const bool wds = wrow || want_db;
		const float *A = reinterpret_cast<const float *>(sm + S::OFF_A);
		const float *B = reinterpret_cast<const float *>(sm + S::OFF_B);
		const double *om = reinterpret_cast<const double *>(sm + S::OFF_OM) + c * PT;
		const float *omf = reinterpret_cast<const float *>(sm + S::OFF_OMF) + c * PT;
		const double *ria = reinterpret_cast<const double *>(sm + S::OFF_RIA);
		const float *rl = reinterpret_cast<const float *>(sm + S::OFF_RL);
		const float *rd = reinterpret_cast<const float *>(sm + S::OFF_RD);
		const float *tt = reinterpret_cast<const float *>(sm + S::OFF_TT);
		const double *tb = reinterpret_cast<const double *>(sm + S::OFF_TB);
		float *sds = reinterpret_cast<float *>(sm + S::OFF_DS);
		float *sdot = reinterpret_cast<float *>(sm + S::OFF_DOT);
		float *sddt = reinterpret_cast<float *>(sm + S::OFF_DDT);

		omegas(a, sm, D / 2);
		if (want_db) { /* this split's per-distance sums of the kv head's query heads */
			double *z = reinterpret_cast<double *>(a.dbp) +
				    (s * a.B * a.H + b * a.H + kh * group) * a.nd;

			for (int64_t x = tid; x < group * a.nd; x += S::NTH)
				z[x] = 0.0;
		}
		for (int64_t kt = s; kt < a.nkt; kt += a.nsplit) {
			/* the tile's segment (dense: the launch); rows and keys from its q0 and k0 */
			const BwSeg g = bw_seg_of(a, APE_BW_SEG_KT0, kt);
			const int64_t Lq = g.lq, Lk = g.lk, rel = g.rel, lt = kt - g.kt0;
			const int64_t j0 = lt * ROWS, j = j0 + kk, kbase = bkv * a.Lk + g.k0;
			const int nk = (int)imin(ROWS, Lk - j0);
			const bool key_ok = j < Lk;
			/* the split's first tile of the segment: its slices' rows are fresh */
			const bool fresh = lt < a.nsplit;
			float u[PT], w[PT], vx[PT], vy[PT], dku[PT], dkw[PT], dvx[PT], dvy[PT];

			pairs(reinterpret_cast<const void *>(a.k), a.dt_in, kbase + j, key_ok, c, D,
			      inter, u, w);
			pairs(reinterpret_cast<const void *>(a.v), a.dt_in, kbase + j, key_ok, c, D,
			      inter, vx, vy);
			bar(); /* the previous tile's key tile is no longer read */
#pragma unroll
			for (int p = 0; p < PT; p++) {
				float *K = reinterpret_cast<float *>(sm + S::OFF_K) + kk * DMAX;

				K[c * PT + p] = u[p];
				K[PM + c * PT + p] = w[p];
				dku[p] = dkw[p] = dvx[p] = dvy[p] = 0.0f;
			}

			for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
				const int64_t bh = b * a.H + h;
				const float *hp = bwd_head(a, h);

				for (int64_t i0 = tile_row0(a, g, lt); i0 < Lq; i0 += STAGE) {
					const int nr = (int)imin(STAGE, Lq - i0);

					bar(); /* the previous stage is no longer read */
					stage(sm, reinterpret_cast<const void *>(a.q), a.dt_in,
					      reinterpret_cast<const void *>(a.dout), a.dt_do,
					      bh * a.Lq + g.q0 + i0, nr, D, inter);
					/* entry e = r - kk + ROWS - 1: n = rel + (i0 + r) - (j0 + kk) */
					table(a, sm, ape_sat_sub(rel + i0 - j0, ROWS - 1), hp, h,
					      a.flags & APE_BW_F_DP);
					if (tid < nr) {
						const int64_t row = bh * a.Lq + g.q0 + i0 + tid;
						const double *ri = reinterpret_cast<const double *>(
									   a.rinfo) +
								   row * APE_BW_RI_N;

						reinterpret_cast<double *>(sm + S::OFF_RIA)[tid] =
							1.0 / ape_alpha(hp[3], ri[APE_BW_RI_SIGMA]);
						reinterpret_cast<float *>(sm + S::OFF_RL)[tid] =
							reinterpret_cast<const float *>(a.lse)[row];
						reinterpret_cast<float *>(sm + S::OFF_RD)[tid] =
							(float)ri[APE_BW_RI_DSUB];
					}
					bar(); /* the stage is in */

#pragma unroll 1
					for (int r = 0; r < nr; r++) {
						const int64_t n = rel + i0 + r - j;
						const double nia = (double)n * ria[r];
						const float niaf = (float)nia;
						const float *qx = A + r * DMAX + c * PT, *qy = qx + PM;
						const float *ox = B + r * DMAX + c * PT, *oy = ox + PM;
						float cs[PT], sn[PT], dot = 0.0f, dov = 0.0f, ddt = 0.0f;

#pragma unroll
						for (int p = 0; p < PT; p++) {
							const float x = qx[p], y = qy[p];

							sn[p] = ape_seed_sincos(nia * om[p], &cs[p]);
							dot += pair_dot(x, y, u[p], w[p], cs[p], sn[p]);
							dov = fmaf(ox[p], vx[p], fmaf(oy[p], vy[p], dov));
							if (wrow)
								ddt += APE_GRAD_DDOT_DALPHA_THETA(
									x, y, u[p], w[p], cs[p], sn[p],
									omf[p] * niaf);
						}
						dot = group_sum<TPR>(dot);
						dov = group_sum<TPR>(dov);
						if (wrow)
							ddt = group_sum<TPR>(ddt);
						if (!key_ok || (causal && n < 0))
							continue; /* adds nothing, not 0 * x */

						const int e = r - kk + ROWS - 1;
						const float pr = pair_prob(tt[e], tb[e], dot, rl[r]);
						const float ds = pr * (dov - rd[r]), g = ds * tt[e];

						if (wds && c == 0) { /* for the row and dbias passes */
							sds[r * ROWS + kk] = ds;
							sdot[r * ROWS + kk] = dot;
							sddt[r * ROWS + kk] = ddt;
						}
#pragma unroll
						for (int p = 0; p < PT; p++) {
							const float x = qx[p], y = qy[p];

							if (want_dv) {
								dvx[p] = fmaf(pr, ox[p], dvx[p]);
								dvy[p] = fmaf(pr, oy[p], dvy[p]);
							}
							if (want_dk) { /* q's pair rotated by +theta */
								dku[p] = fmaf(g, x * cs[p] - y * sn[p],
									      dku[p]);
								dkw[p] = fmaf(g, y * cs[p] + x * sn[p],
									      dkw[p]);
							}
						}
					}
					if (wds)
						bar(); /* the stage's dS, dot and alpha sums are in */
					if (wrow)
						row_pass(a, sm, s, g, bh, i0, nr, j0, nk, fresh);
					if (want_db)
						dbias_pass(a, sm, s, g, bh, i0, nr, j0, nk);
				}
			}
			if (!key_ok)
				continue;

			const int P = D / 2;
			const int64_t kel = (kbase + j) * D;

#pragma unroll
			for (int p = 0; p < PT; p++) {
				const int pg = c * PT + p;

				if (!EXACT && pg >= P)
					break;
				if (a.dk) {
					float *dk = reinterpret_cast<float *>(a.dk) + kel;

					dk[comp_x(pg, inter)] += dku[p];
					dk[comp_y(pg, P, inter)] += dkw[p];
				}
				if (a.dv) {
					float *dv = reinterpret_cast<float *>(a.dv) + kel;

					dv[comp_x(pg, inter)] += dvx[p];
					dv[comp_y(pg, P, inter)] += dvy[p];
				}
			}
		}
	}
};

/* ---------------------------------------------------------------- per row, per head */

/* One warp per query row: the row table (sigma, mean, Dl - dLSE) */
APE_DEV void bwd_rows(const ape_cu_bwd_args &a)
{
	const int lane = threadIdx.x & 31;
	const int64_t row = block_linear() * APE_BW_ROWS_PER_BLOCK + (threadIdx.x >> 5);
	const int64_t nrows = (int64_t)a.B * a.H * a.Lq;

	if (row >= nrows)
		return; /* the whole warp: its lanes share the row */

	const int D = a.D;
	const void *Q = reinterpret_cast<const void *>(a.q);
	const void *O = reinterpret_cast<const void *>(a.o);
	const void *DO = reinterpret_cast<const void *>(a.dout);
	double sum = 0.0, ss = 0.0, dl = 0.0, mean, sigma;

	for (int d = lane; d < D; d += 32)
		sum += (double)load_el(Q, row * D + d, a.dt_in);
	mean = group_sum<32>(sum) / D;
	for (int d = lane; d < D; d += 32) {
		const double e = (double)load_el(Q, row * D + d, a.dt_in) - mean;

		ss += e * e;
		dl += (double)load_el(DO, row * D + d, a.dt_do) *
		      (double)load_el(O, row * D + d, a.dt_out);
	}
	ss = group_sum<32>(ss);
	dl = group_sum<32>(dl);
	sigma = ape_sigma(ss, D);
	if (lane == 0) {
		double *ri = reinterpret_cast<double *>(a.rinfo) + row * APE_BW_RI_N;

		ri[APE_BW_RI_SIGMA] = sigma;
		ri[APE_BW_RI_MEAN] = mean;
		ri[APE_BW_RI_DSUB] =
			dl - ((a.flags & APE_BW_F_DLSE)
				      ? (double)reinterpret_cast<const float *>(a.dlse)[row]
				      : 0.0);
	}
}

/*
 * One block per APE_BW_RED_ROWS query rows of a (batch, head), a warp per row (every 8th): the
 * splits' slices of the row in split order (those that visited it: tile_row0()), float64; the
 * alpha path A_i d(alpha)/d(sigma) d(sigma)/d(q) applied to dQ_i, added to dq; the row's
 * parameter sums (with d(alpha)/d(lambda); zero for a row that sees no key), summed over the
 * block's rows in row order to its slot of part.
 */
APE_DEV void bwd_reduce(const ape_cu_bwd_args &a)
{
	int64_t qt, bh;

	if (!block_tile(a.nqt, (int64_t)a.B * a.H, qt, bh))
		return;

	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int D = a.D, P = D / 2;
	const bool causal = a.flags & APE_CU_F_CAUSAL;
	const bool inter = a.flags & APE_CU_F_INTERLEAVED;
	const float *hp = bwd_head(a, bh % a.H);
	const int64_t nrows = (int64_t)a.B * a.H * a.Lq;
	double *dps = reinterpret_cast<double *>(smem_base());

	for (int rr = warp; rr < APE_BW_RED_ROWS; rr += APE_CU_THREADS / 32) {
		const int64_t i = qt * APE_BW_RED_ROWS + rr, row = bh * a.Lq + i;
		/* the row's segment (dense: the launch), and the row counted from its q0 */
		const BwSeg g = bw_seg_of(a, APE_BW_SEG_Q0, i < a.Lq ? i : 0);
		const int64_t il = i - g.q0;
		const bool any = i < a.Lq && ape_visible_keys(ape_sat_add(g.rel, il), g.lk, causal) > 0;
		double su[APE_BW_RP_N] = { 0.0, 0.0, 0.0, 0.0, 0.0 };

		if (!any) { /* no visible key here: the row adds nothing */
			if (lane < 4)
				dps[4 * rr + lane] = 0.0;
			continue;
		}
		const double *ri = reinterpret_cast<const double *>(a.rinfo) + row * APE_BW_RI_N;
		const double sigma = ri[APE_BW_RI_SIGMA], mean = ri[APE_BW_RI_MEAN];
		const double alpha = ape_alpha(hp[3], sigma);

		for (int64_t s = 0; s < a.nsplit; s++) {
			if (!split_wrote(a, g, s, il))
				continue;
#pragma unroll
			for (int k = 0; k < APE_BW_RP_N; k++)
				su[k] += reinterpret_cast<const double *>(
					a.rp)[(s * nrows + row) * APE_BW_RP_N + k];
		}

		const double A = su[0] / alpha;

		if (lane < 4) /* with d(alpha)/d(lambda) */
			dps[4 * rr + lane] = lane == 0	 ? su[1]
					     : lane == 1 ? su[2]
					     : lane == 2 ? su[3]
							 : su[4] + A * ape_grad_gate(sigma);
		if (!(a.flags & APE_BW_F_DQ))
			continue;
		/* the path through alpha_i: A_i d(alpha)/d(sigma) d(sigma)/d(q) */
		const double coef = A * ape_grad_dalpha_dsigma(hp[3], sigma) *
				    ape_grad_dsigma_coef((double)D, sigma);
		const void *Q = reinterpret_cast<const void *>(a.q);
		float *dq = reinterpret_cast<float *>(a.dq) + row * D;

		for (int p = lane; p < P; p += 32) {
			const int64_t ix = comp_x(p, inter), iy = comp_y(p, P, inter);
			double sx = 0.0, sy = 0.0;

			for (int64_t s = 0; s < a.nsplit; s++) {
				if (!split_wrote(a, g, s, il))
					continue;
				const float *dqp = reinterpret_cast<const float *>(a.dqp) +
						   (s * nrows + row) * D;

				sx += (double)dqp[p];
				sy += (double)dqp[P + p];
			}
			dq[ix] += (float)(sx + coef * ((double)load_el(Q, row * D + ix, a.dt_in) - mean));
			dq[iy] += (float)(sy + coef * ((double)load_el(Q, row * D + iy, a.dt_in) - mean));
		}
	}
	if (!(a.flags & APE_BW_F_DP))
		return;
	bar();
	if (threadIdx.x < 4) {
		double s = 0.0;

		for (int rr = 0; rr < APE_BW_RED_ROWS; rr++)
			s += dps[4 * rr + threadIdx.x];
		reinterpret_cast<double *>(a.part)[(bh * a.nqt + qt) * 4 + threadIdx.x] = s;
	}
}

/* One thread per head: ape_bwd_reduce's block sums, batch by batch, block by block, added to
 * dparams[h][4] */
APE_DEV void bwd_params(const ape_cu_bwd_args &a)
{
	const int64_t h = block_linear() * APE_CU_THREADS + threadIdx.x;

	if (h >= a.H)
		return;
	const double *part = reinterpret_cast<const double *>(a.part);
	double acc[4] = { 0.0, 0.0, 0.0, 0.0 };

	for (int64_t b = 0; b < a.B; b++)
		for (int64_t qt = 0; qt < a.nqt; qt++)
#pragma unroll
			for (int k = 0; k < 4; k++)
				acc[k] += part[((b * a.H + h) * a.nqt + qt) * 4 + k];
#pragma unroll
	for (int k = 0; k < 4; k++)
		reinterpret_cast<double *>(a.dparams)[4 * h + k] += acc[k];
}

/*
 * The distance-bias table's gradient: one block per entry m of row ht of dbias (entries db_m0
 * .. db_m0 + db_nm - 1 of each row: those some pair of the launch reaches), summing the splits'
 * per-distance sums (a.dbp) of every distance n whose entry is m (ape_bias_index(|n|, M): n = m
 * and n = -m, or every |n| >= M - 1 for the last entry) over batches, the row's heads (its own,
 * or every head for a shared table) and splits: each thread a fixed share of those terms in a
 * fixed order, then a fixed tree over the threads; the total is added to dbias[ht][m].
 */
APE_DEV void bwd_dbias(const ape_cu_bwd_args &a)
{
	const int64_t blk = block_linear(), Ht = a.bias.hstride ? a.H : 1;

	if (blk >= Ht * a.db_nm)
		return; /* the whole block */

	const int tid = threadIdx.x;
	const int64_t ht = blk / a.db_nm, m = a.db_m0 + blk % a.db_nm, M = a.db_len;
	const int64_t BH = (int64_t)a.B * a.H;
	const bool last = m == M - 1;
	/* the row's heads: its own, or every head for a shared table */
	const int64_t nh = a.bias.hstride ? 1 : a.H, h0 = a.bias.hstride ? ht : 0;
	const double *dbp = reinterpret_cast<const double *>(a.dbp);
	double *red = reinterpret_cast<double *>(smem_base());
	double sum = 0.0;

	/* segment by segment (dense: the launch), those with keys */
	for (int64_t e = 0; e < (a.segt ? a.nseg : 1); e++) {
		const BwSeg g = bw_seg(a, e);

		if (g.lk < 1)
			continue;
		/* the segment's distances: nmin (row 0, key lk - 1) .. nmax (row lq - 1, key 0),
		 * entry db0 + n - nmin of a split's sums; both real pairs' distances: they fit */
		const int64_t nmin = g.rel - (g.lk - 1), nmax = g.rel + (g.lq - 1);
		/* the distances of entry m: [a0, a1] (n >= 0) and [b0, b1] (n < 0), within those */
		const int64_t a0 = imax(nmin, m), a1 = imin(nmax, last ? nmax : m);
		const int64_t b0 = imax(nmin, last ? nmin : -m), b1 = imin(nmax, -imax(m, 1));
		const int64_t la = imax(0, a1 - a0 + 1), len = la + imax(0, b1 - b0 + 1);
		const int64_t total = (int64_t)a.B * nh * a.nsplit * len;

		for (int64_t x = tid; x < total; x += APE_CU_THREADS) {
			/* (batch, head, split), split fastest */
			const int64_t k = x % len, cmb = x / len;
			const int64_t sp = cmb % a.nsplit, bhh = cmb / a.nsplit;
			const int64_t bh = bhh / nh * a.H + h0 + bhh % nh;
			const int64_t n = k < la ? a0 + k : b0 + (k - la);

			sum += dbp[(sp * BH + bh) * a.nd + g.db0 + (n - nmin)];
		}
	}
	red[tid] = sum;
	bar();
	for (int w = APE_CU_THREADS / 2; w > 0; w >>= 1) {
		if (tid < w)
			red[tid] += red[tid + w];
		bar();
	}
	if (tid == 0)
		reinterpret_cast<double *>(a.dbias)[ht * M + m] += red[0];
}

} /* namespace ape */

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_bwd_rows(const struct ape_cu_bwd_args a)
{
	ape::bwd_rows(a);
}
APE_EMU_REGISTER(ape_bwd_rows, struct ape_cu_bwd_args)

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_bwd_params(const struct ape_cu_bwd_args a)
{
	ape::bwd_params(a);
}
APE_EMU_REGISTER(ape_bwd_params, struct ape_cu_bwd_args)

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_bwd_reduce(const struct ape_cu_bwd_args a)
{
	ape::bwd_reduce(a);
}
APE_EMU_REGISTER(ape_bwd_reduce, struct ape_cu_bwd_args)

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_bwd_dbias(const struct ape_cu_bwd_args a)
{
	ape::bwd_dbias(a);
}
APE_EMU_REGISTER(ape_bwd_dbias, struct ape_cu_bwd_args)

/* copy_view (core/backend.h, struct ape_be_copy): one thread per element, converted as the
 * contract says (a bit copy, float32 to f16/bf16 rounded to nearest even, float64 to float32). */
extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_copy_view(const struct ape_cu_copy_args a)
{
	const int64_t e = ape::block_linear() * APE_CU_THREADS + (int64_t)threadIdx.x;
	int64_t d, r, i, h, b, so, dof;

	if (e >= a.n)
		return;
	d = e % a.D;
	r = e / a.D;
	i = r % a.L;
	h = r / a.L % a.H;
	b = r / a.L / a.H;
	so = a.soff + b * a.ssb + h * a.ssh + i * a.ssl + d;
	dof = a.doff + b * a.dsb + h * a.dsh + i * a.dsl + d;
	if (a.dt_src == a.dt_dst) {
		if (a.dt_dst == APE_CU_F64_ELEM)
			reinterpret_cast<uint64_t *>(a.dst)[dof] =
				reinterpret_cast<const uint64_t *>(a.src)[so];
		else if (a.dt_dst == APE_CU_F32)
			reinterpret_cast<uint32_t *>(a.dst)[dof] =
				reinterpret_cast<const uint32_t *>(a.src)[so];
		else
			reinterpret_cast<uint16_t *>(a.dst)[dof] =
				reinterpret_cast<const uint16_t *>(a.src)[so];
	} else if (a.dt_src == APE_CU_F64_ELEM) {
		reinterpret_cast<float *>(a.dst)[dof] =
			(float)reinterpret_cast<const double *>(a.src)[so];
	} else {
		ape::store_el(reinterpret_cast<void *>(a.dst), dof,
			      reinterpret_cast<const float *>(a.src)[so], a.dt_dst);
	}
}
APE_EMU_REGISTER(ape_copy_view, struct ape_cu_copy_args)

#define APE_BWD(name, dmax, exact)                                                                 \
	extern "C" __global__ void __launch_bounds__(APE_CU_THREADS, 1)                           \
		ape_bwd_fused_##name(const struct ape_cu_bwd_args a)                               \
	{                                                                                          \
		ape::Bwd<dmax, exact>::fused(a);                                                   \
	}                                                                                          \
	APE_EMU_REGISTER(ape_bwd_fused_##name, struct ape_cu_bwd_args)

APE_BWD(d64, 64, true)
APE_BWD(d128, 128, true)
APE_BWD(g128, 128, false)
APE_BWD(g256, 256, false)
