/* SPDX-License-Identifier: MIT */
/*
 * The fused APE backward pass (APE-SPEC.md, "Gradients"; docs/cuda.md), FlashAttention-2's
 * structure with APE's rotation. Four kernels, enqueued in this order by cuda_backward.c:
 *
 *   ape_bwd_rows       one warp per query row: mean and sigma of q_i (float64, as the forward
 *                      computes them; the sweeps derive alpha_i from sigma_i) and Dl_i - dLSE_i,
 *                      Dl_i = dO_i . O_i, to a row table (scratch, 24 bytes per row);
 *   ape_bwd_keys_*     keys outer (only when dK or dV is wanted): one block per (tile of key
 *                      rows, batch, kv head); TPR threads share a key row and keep its K and V
 *                      and its dK and dV accumulators in registers (8 pairs each) while query
 *                      rows of every query head of the kv head stream through shared memory,
 *                      in order; dK and dV are added to the accumulators once, at the end;
 *   ape_bwd_queries_*  queries outer (only when dQ or dparams is wanted): one block per (tile of
 *                      query rows, batch, head); TPR threads share a query row (its q, dO and dQ
 *                      in registers) while key tiles stream through shared memory; the alpha path
 *                      A_i = sum_j dS_ij temp scale d(dot_ij)/d(alpha_i) is summed alongside and
 *                      applied to dQ_i at the end; the row's parameter sums (float64) are added
 *                      up per block, in row order, to a per-block slot (scratch);
 *   ape_bwd_params     one thread per head: the blocks' sums in batch and block order, float64,
 *                      added to dparams.
 *
 * No floating-point atomics: every sum has one owner and a fixed order (the lane reductions are
 * butterflies of shuffles, the same on every run), so two runs are bit-identical. Both sweeps
 * recompute P_ij = exp(s_ij - LSE_i) from q, k and the saved LSE; nothing of size Lq * Lk exists.
 * Per (row, key) the score's distance terms (temp * scale and the bias, and with dparams their
 * parameter derivatives) come from a per-stage table in shared memory, float64 where they carry
 * magnitude (the bias), so that s_ij - LSE_i keeps float32's relative accuracy at any |n|.
 *
 * The rotation: the queries sweep walks keys with a fixed alpha_i, so it turns each pair's
 * (cos, sin) of theta by one step per key (the forward's recurrence), seeded exactly by
 * ape_seed_sincos() at every stage of APE_BW_STAGE keys. The keys sweep meets a new alpha_i with
 * every query row, so it seeds every (row, key, pair) angle exactly: no recurrence, the most
 * accurate angle, at the cost of a dozen float operations and a few float64 ones per pair.
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
	static constexpr int PT = PM / TPR; /* pairs per thread: 8 */
	static constexpr int ROWS = APE_BW_ROWS(DMAX);
	static constexpr int STAGE = APE_BW_STAGE(DMAX);
	static constexpr int TBL = APE_BW_TBL(DMAX);
	/* shared memory: staged tiles A and B ([STAGE][x_0..x_PM-1 | y_0..y_PM-1] float32), the
	 * distance table, omega, the staged rows' values, the block's per-row parameter sums */
	static constexpr int OFF_A = 0;
	static constexpr int OFF_B = OFF_A + STAGE * DMAX * 4;
	static constexpr int OFF_TB = OFF_B + STAGE * DMAX * 4; /* double [TBL]: bias */
	static constexpr int OFF_TD = OFF_TB + TBL * 8; /* double [TBL][4]: derivatives */
	static constexpr int OFF_OM = OFF_TD + TBL * 32; /* double [PM]: omega */
	static constexpr int OFF_RIA = OFF_OM + PM * 8; /* double [STAGE]: 1 / alpha */
	static constexpr int OFF_DP = OFF_RIA + STAGE * 8; /* double [ROWS][4] */
	static constexpr int OFF_TT = OFF_DP + ROWS * 32; /* float [TBL]: temp * scale */
	static constexpr int OFF_OMF = OFF_TT + TBL * 4; /* float [PM]: omega */
	static constexpr int OFF_RL = OFF_OMF + PM * 4; /* float [STAGE]: LSE */
	static constexpr int OFF_RD = OFF_RL + STAGE * 4; /* float [STAGE]: Dl - dLSE */
	static constexpr int BYTES = OFF_RD + STAGE * 4;
	static_assert(BYTES == APE_BW_SMEM(DMAX), "bwd_args.h and the kernel disagree");
	static_assert(BYTES <= 48 * 1024, "no opt-in to more shared memory");
	static_assert(PT == 8 && (TPR & (TPR - 1)) == 0, "8 pairs per thread, TPR a power of two");
	static_assert(TBL <= NTH, "one thread per table entry");
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
 * scale, bias): the difference in float64, where the bias and LSE carry magnitude */
APE_DEV float pair_prob(float tsc, double bias, float dot, double lse)
{
	return expf((float)((double)(tsc * dot) + bias - lse));
}

/* dot and dO . V of one (row, key) pair from the shares of the W lanes that hold its pairs */
template <int W> APE_DEV void pair_sums(float &dot, float &dov)
{
	dot = group_sum<W>(dot);
	dov = group_sum<W>(dov);
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

template <int DMAX, bool EXACT> struct Bwd {
	using S = BwShape<DMAX>;
	static constexpr int TPR = S::TPR, PM = S::PM, PT = S::PT, ROWS = S::ROWS;
	static constexpr int STAGE = S::STAGE;

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
	 * The distance table of one (block, stage) meeting: entry e holds n = nlo + e. temp * scale
	 * (float), the bias (double) and, with `derivs`, d(bias)/d(delta, beta, gamma) and
	 * d(temp)/d(lambda) (double).
	 */
	static APE_DEV void table(const ape_cu_bwd_args &a, unsigned char *sm, int64_t nlo,
				  const float *hp, bool derivs)
	{
		const int e = threadIdx.x;

		if (e >= S::TBL)
			return;
		const double an = (double)iabs(nlo + e);
		double *td = reinterpret_cast<double *>(sm + S::OFF_TD) + 4 * e;

		reinterpret_cast<float *>(sm + S::OFF_TT)[e] = (float)(ape_temp(hp[3], an) * a.scale);
		reinterpret_cast<double *>(sm + S::OFF_TB)[e] = ape_bias(hp[0], hp[1], hp[2], an);
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

	/* ---------------------------------------------------------------- keys outer */
	static APE_DEV void keys(const ape_cu_bwd_args &a)
	{
		int64_t kt, bkv;

		if (!block_tile(a.nkt, (int64_t)a.B * a.Hkv, kt, bkv))
			return;

		unsigned char *sm = smem_base();
		const int tid = threadIdx.x, kk = tid / TPR, c = tid % TPR;
		const int64_t b = bkv / a.Hkv, kh = bkv % a.Hkv, group = a.H / a.Hkv;
		const int64_t Lq = a.Lq, Lk = a.Lk, rel = a.rel, j0 = kt * ROWS, j = j0 + kk;
		const int D = EXACT ? DMAX : a.D;
		const bool causal = a.flags & APE_CU_F_CAUSAL;
		const bool inter = a.flags & APE_CU_F_INTERLEAVED;
		const bool want_dk = a.flags & APE_BW_F_DK, want_dv = a.flags & APE_BW_F_DV;
		const bool key_ok = j < Lk;
		const float *A = reinterpret_cast<const float *>(sm + S::OFF_A);
		const float *B = reinterpret_cast<const float *>(sm + S::OFF_B);
		const double *om = reinterpret_cast<const double *>(sm + S::OFF_OM) + c * PT;
		const double *ria = reinterpret_cast<const double *>(sm + S::OFF_RIA);
		const float *rl = reinterpret_cast<const float *>(sm + S::OFF_RL);
		const float *rd = reinterpret_cast<const float *>(sm + S::OFF_RD);
		const float *tt = reinterpret_cast<const float *>(sm + S::OFF_TT);
		const double *tb = reinterpret_cast<const double *>(sm + S::OFF_TB);
		float u[PT], w[PT], vx[PT], vy[PT], dku[PT], dkw[PT], dvx[PT], dvy[PT];

		omegas(a, sm, D / 2);
		pairs(reinterpret_cast<const void *>(a.k), a.dt_in, bkv * Lk + j, key_ok, c, D, inter,
		      u, w);
		pairs(reinterpret_cast<const void *>(a.v), a.dt_in, bkv * Lk + j, key_ok, c, D, inter,
		      vx, vy);
#pragma unroll
		for (int p = 0; p < PT; p++)
			dku[p] = dkw[p] = dvx[p] = dvy[p] = 0.0f;

		/* causal: row i sees key j0 (the block's first, the most visible) from i = j0 - rel */
		const int64_t ibeg = causal ? imax(0, j0 - rel) : 0;

		for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
			const int64_t bh = b * a.H + h;
			const float *hp = bwd_head(a, h);

			for (int64_t i0 = ibeg; i0 < Lq; i0 += STAGE) {
				const int nr = (int)imin(STAGE, Lq - i0);

				bar(); /* the previous stage is no longer read */
				stage(sm, reinterpret_cast<const void *>(a.q), a.dt_in,
				      reinterpret_cast<const void *>(a.dout), a.dt_do, bh * Lq + i0, nr,
				      D, inter);
				/* entry e = r - kk + ROWS - 1: n = rel + (i0 + r) - (j0 + kk) */
				table(a, sm, rel + i0 - j0 - (ROWS - 1), hp, false);
				if (tid < nr) {
					const int64_t row = bh * Lq + i0 + tid;
					const double *ri = reinterpret_cast<const double *>(a.rinfo) +
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
					const float *qx = A + r * DMAX + c * PT, *qy = qx + PM;
					const float *ox = B + r * DMAX + c * PT, *oy = ox + PM;
					float cs[PT], sn[PT], dot = 0.0f, dov = 0.0f;

#pragma unroll
					for (int p = 0; p < PT; p++) {
						const float x = qx[p], y = qy[p];

						sn[p] = ape_seed_sincos(nia * om[p], &cs[p]);
						dot += pair_dot(x, y, u[p], w[p], cs[p], sn[p]);
						dov = fmaf(ox[p], vx[p], fmaf(oy[p], vy[p], dov));
					}
					pair_sums<TPR>(dot, dov);
					if (!key_ok || (causal && n < 0))
						continue; /* adds nothing, not 0 * x */

					const int e = r - kk + ROWS - 1;
					const float pr = pair_prob(tt[e], tb[e], dot, rl[r]);
					const float g = pr * (dov - rd[r]) * tt[e];

#pragma unroll
					for (int p = 0; p < PT; p++) {
						const float x = qx[p], y = qy[p];

						if (want_dv) {
							dvx[p] = fmaf(pr, ox[p], dvx[p]);
							dvy[p] = fmaf(pr, oy[p], dvy[p]);
						}
						if (want_dk) { /* q's pair rotated by +theta */
							dku[p] = fmaf(g, x * cs[p] - y * sn[p], dku[p]);
							dkw[p] = fmaf(g, y * cs[p] + x * sn[p], dkw[p]);
						}
					}
				}
			}
		}
		if (!key_ok)
			return;

		const int P = D / 2;
		const int64_t kbase = (bkv * Lk + j) * D;

#pragma unroll
		for (int p = 0; p < PT; p++) {
			const int pg = c * PT + p;

			if (!EXACT && pg >= P)
				break;
			if (a.dk) {
				float *dk = reinterpret_cast<float *>(a.dk) + kbase;

				dk[comp_x(pg, inter)] += dku[p];
				dk[comp_y(pg, P, inter)] += dkw[p];
			}
			if (a.dv) {
				float *dv = reinterpret_cast<float *>(a.dv) + kbase;

				dv[comp_x(pg, inter)] += dvx[p];
				dv[comp_y(pg, P, inter)] += dvy[p];
			}
		}
	}

	/* ---------------------------------------------------------------- queries outer */
	static APE_DEV void queries(const ape_cu_bwd_args &a)
	{
		int64_t qt, bh;

		if (!block_tile(a.nqt, (int64_t)a.B * a.H, qt, bh))
			return;
		qt = a.nqt - 1 - qt; /* causal: the heaviest blocks first */

		unsigned char *sm = smem_base();
		const int tid = threadIdx.x, r = tid / TPR, c = tid % TPR;
		const int64_t h = bh % a.H;
		const int64_t bkv = bh / a.H * a.Hkv + h / (a.H / a.Hkv);
		const int64_t Lq = a.Lq, Lk = a.Lk, rel = a.rel, i0 = qt * ROWS, i = i0 + r;
		const int D = EXACT ? DMAX : a.D, P = D / 2;
		const bool causal = a.flags & APE_CU_F_CAUSAL;
		const bool inter = a.flags & APE_CU_F_INTERLEAVED;
		const bool want_dq = a.flags & APE_BW_F_DQ, want_dp = a.flags & APE_BW_F_DP;
		const bool row_ok = i < Lq;
		const int64_t row = bh * Lq + (row_ok ? i : 0);
		const float *hp = bwd_head(a, h);
		const double *ri = reinterpret_cast<const double *>(a.rinfo) + row * APE_BW_RI_N;
		const double sigma = ri[APE_BW_RI_SIGMA], alpha = ape_alpha(hp[3], sigma);
		const double ia = 1.0 / alpha;
		const float dsub = (float)ri[APE_BW_RI_DSUB];
		const double lse = reinterpret_cast<const float *>(a.lse)[row];
		const float *Kt = reinterpret_cast<const float *>(sm + S::OFF_A) + c * PT;
		const float *Vt = reinterpret_cast<const float *>(sm + S::OFF_B) + c * PT;
		const double *om = reinterpret_cast<const double *>(sm + S::OFF_OM) + c * PT;
		const float *omf = reinterpret_cast<const float *>(sm + S::OFF_OMF) + c * PT;
		const float *tt = reinterpret_cast<const float *>(sm + S::OFF_TT);
		const double *tb = reinterpret_cast<const double *>(sm + S::OFF_TB);
		const double *td = reinterpret_cast<const double *>(sm + S::OFF_TD);
		float x[PT], y[PT], ox[PT], oy[PT], dqx[PT], dqy[PT], stc[PT], sts[PT];
		double A = 0.0, dp[4] = { 0.0, 0.0, 0.0, 0.0 };

		omegas(a, sm, P);
		pairs(reinterpret_cast<const void *>(a.q), a.dt_in, row, row_ok, c, D, inter, x, y);
		pairs(reinterpret_cast<const void *>(a.dout), a.dt_do, row, row_ok, c, D, inter, ox,
		      oy);
		bar(); /* omega is in */
#pragma unroll
		for (int p = 0; p < PT; p++) {
			dqx[p] = dqy[p] = 0.0f;
			/* one key further, theta falls by omega_p / alpha_i */
			sts[p] = ape_seed_sincos(om[p] * ia, &stc[p]);
		}

		/* keys the block's rows may see: causal, j <= rel + (its last row) */
		const int64_t ilast = imin(i0 + ROWS, Lq) - 1;
		const int64_t jend = causal ? imax(0, imin(rel + ilast + 1, Lk)) : Lk;

		for (int64_t j0 = 0; j0 < jend; j0 += STAGE) {
			const int len = (int)imin(STAGE, jend - j0);

			bar(); /* the previous stage is no longer read */
			stage(sm, reinterpret_cast<const void *>(a.k), a.dt_in,
			      reinterpret_cast<const void *>(a.v), a.dt_in, bkv * Lk + j0, len, D,
			      inter);
			/* entry e = r - jj + STAGE - 1: n = rel + (i0 + r) - (j0 + jj) */
			table(a, sm, rel + i0 - j0 - (STAGE - 1), hp, want_dp);
			bar(); /* the stage is in */

			const int64_t n0 = rel + i - j0;
			float cs[PT], sn[PT];

			{
				const double nia = (double)n0 * ia;

#pragma unroll
				for (int p = 0; p < PT; p++)
					sn[p] = ape_seed_sincos(nia * om[p], &cs[p]);
			}
#pragma unroll 1
			for (int jj = 0; jj < len; jj++) {
				const int64_t n = n0 - jj;
				const float niaf = (float)((double)n * ia);
				const float *ku = Kt + jj * DMAX, *kw = ku + PM;
				const float *vx = Vt + jj * DMAX, *vy = vx + PM;
				float dot = 0.0f, ddt = 0.0f, dov = 0.0f;

#pragma unroll
				for (int p = 0; p < PT; p++) {
					const float uu = ku[p], ww = kw[p];

					if (jj) { /* one key further: theta falls by one step */
						const float c0 = cs[p];

						cs[p] = fmaf(c0, stc[p], sn[p] * sts[p]);
						sn[p] = fmaf(sn[p], stc[p], -c0 * sts[p]);
					}
					dot += pair_dot(x[p], y[p], uu, ww, cs[p], sn[p]);
					ddt += APE_GRAD_DDOT_DALPHA_THETA(x[p], y[p], uu, ww, cs[p],
									  sn[p], omf[p] * niaf);
					dov = fmaf(ox[p], vx[p], fmaf(oy[p], vy[p], dov));
				}
				pair_sums<TPR>(dot, dov);
				if (!row_ok || (causal && n < 0))
					continue; /* adds nothing, not 0 * x */

				const int e = r - jj + STAGE - 1;
				const float pr = pair_prob(tt[e], tb[e], dot, lse);
				const float ds = pr * (dov - dsub), g = ds * tt[e];

				A += (double)g * (double)ddt; /* this lane's pairs' share */
				if (want_dp) {
					dp[0] += (double)ds * td[4 * e + 0];
					dp[1] += (double)ds * td[4 * e + 1];
					dp[2] += (double)ds * td[4 * e + 2];
					dp[3] += (double)ds * a.scale * (double)dot * td[4 * e + 3];
				}
				if (want_dq) { /* k's pair rotated by -theta */
#pragma unroll
					for (int p = 0; p < PT; p++) {
						const float uu = ku[p], ww = kw[p];

						dqx[p] = fmaf(g, uu * cs[p] + ww * sn[p], dqx[p]);
						dqy[p] = fmaf(g, ww * cs[p] - uu * sn[p], dqy[p]);
					}
				}
			}
		}

		/* the pairs summed d(dot)/d(alpha) times alpha: the row's A_i */
		A = group_sum<TPR>(A) / alpha;
		const bool any = row_ok && ape_visible_keys(rel + i, Lk, causal) > 0;

		dp[3] += A * ape_grad_gate(sigma); /* d(alpha)/d(lambda) */
		if (want_dq && any) {
			/* the path through alpha_i: A_i d(alpha)/d(sigma) d(sigma)/d(q) */
			const double coef = A * ape_grad_dalpha_dsigma(hp[3], sigma) *
					    ape_grad_dsigma_coef((double)D, sigma);
			const double mean = ri[APE_BW_RI_MEAN];
			float *dq = reinterpret_cast<float *>(a.dq) + row * D;

#pragma unroll
			for (int p = 0; p < PT; p++) {
				const int pg = c * PT + p;

				if (!EXACT && pg >= P)
					break;
				dq[comp_x(pg, inter)] +=
					(float)((double)dqx[p] + coef * ((double)x[p] - mean));
				dq[comp_y(pg, P, inter)] +=
					(float)((double)dqy[p] + coef * ((double)y[p] - mean));
			}
		}
		if (!want_dp)
			return;
		/* the block's rows in order, then one slot per block */
		double *dps = reinterpret_cast<double *>(sm + S::OFF_DP);

		if (c == 0)
#pragma unroll
			for (int k = 0; k < 4; k++)
				dps[4 * r + k] = any ? dp[k] : 0.0;
		bar();
		if (tid < 4) {
			double s = 0.0;

			for (int rr = 0; rr < ROWS; rr++)
				s += dps[4 * rr + tid];
			reinterpret_cast<double *>(a.part)[(bh * a.nqt + qt) * 4 + tid] = s;
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

/* One thread per head: the queries sweep's block sums, batch by batch, block by block, added to
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

/* copy_view (core/backend.h, struct ape__copy): one thread per element, converted as the
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
		ape_bwd_keys_##name(const struct ape_cu_bwd_args a)                                \
	{                                                                                          \
		ape::Bwd<dmax, exact>::keys(a);                                                    \
	}                                                                                          \
	APE_EMU_REGISTER(ape_bwd_keys_##name, struct ape_cu_bwd_args)                              \
	extern "C" __global__ void __launch_bounds__(APE_CU_THREADS, 1)                           \
		ape_bwd_queries_##name(const struct ape_cu_bwd_args a)                             \
	{                                                                                          \
		ape::Bwd<dmax, exact>::queries(a);                                                 \
	}                                                                                          \
	APE_EMU_REGISTER(ape_bwd_queries_##name, struct ape_cu_bwd_args)

APE_BWD(d64, 64, true)
APE_BWD(d128, 128, true)
APE_BWD(g128, 128, false)
APE_BWD(g256, 256, false)
