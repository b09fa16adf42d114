/* SPDX-License-Identifier: MIT */
/*
 * ape_dwindow: with skipping, the keys the decode kernel must read, per (batch, kv head).
 *
 * A query row's computed weight is at least the weight of its anchor, the APE_DC_ANCHOR keys
 * nearest its diagonal, which this kernel scores exactly (each pair's angle from its own float64
 * seed; the distance-bias table's entries included). Keys farther away may be left out when the
 * skip bound of docs/kernels.md (with a table's suffix maximum) proves their total weight below
 * skip_tol times the anchor's weight (so below skip_tol times whatever the decode kernel computes,
 * which includes the anchor). The bound only grows as the left-out set grows toward the anchor
 * (the suffix maxima too), so a binary search over tiles finds the nearest provable cut on each
 * side. The block's window is the union over its rows. A row whose keys are all negligible against
 * the weight earlier launches found (lse_prior) adds nothing to it; when no row of the block adds
 * anything, the decode kernel reads no key at all.
 */
#include "common.cuh"

namespace ape {

APE_DEV int64_t shared_min64(int64_t *p, int64_t v)
{
#ifdef APE_CUDA_EMU
	if (v < *p)
		*p = v;
	return *p;
#else
	return atomicMin(reinterpret_cast<long long *>(p), (long long)v);
#endif
}

APE_DEV int64_t shared_max64(int64_t *p, int64_t v)
{
#ifdef APE_CUDA_EMU
	if (v > *p)
		*p = v;
	return *p;
#else
	return atomicMax(reinterpret_cast<long long *>(p), (long long)v);
#endif
}

APE_DEV void dwindow(const ape_cu_window_args &a)
{
	constexpr int WR = APE_DC_WROWS, AN = APE_DC_ANCHOR, T = APE_DC_NORM_TILE;
	unsigned char *sm = smem_base();
	float *sc = reinterpret_cast<float *>(sm); /* [WR][AN] anchor scores, natural log units */
	double *r_ia = reinterpret_cast<double *>(sm + WR * AN * 4);
	double *r_qn = r_ia + WR, *r_crow = r_qn + WR;
	int64_t *r_diag = reinterpret_cast<int64_t *>(r_crow + WR), *r_an0 = r_diag + WR;
	int64_t *r_alo = r_an0 + WR, *r_ahi = r_alo + WR, *r_qrow = r_ahi + WR;
	int64_t *win = r_qrow + WR; /* union: lo, hi */
	const int64_t bkv = a.block_base + block_linear();
	const int tid = threadIdx.x;

	if (bkv >= (int64_t)a.c.B * a.c.Hkv)
		return;
	const int64_t b = bkv / a.c.Hkv, kvh = bkv % a.c.Hkv;
	const int64_t kbase = vrow(a.c.vk, b, kvh, 0);
	const int gsz = a.c.H / a.c.Hkv, D = a.c.D, P = D / 2;
	const int64_t Lq = a.c.Lq, Lk = a.c.Lk, rel = a.c.rel;
	const int G = gsz * (int)Lq;
	const bool causal = a.c.flags & APE_CU_F_CAUSAL;
	const bool inter = a.c.flags & APE_CU_F_INTERLEAVED;
	const int dt = a.c.dt_in;
	const void *Q = reinterpret_cast<const void *>(a.c.q);
	const void *K = reinterpret_cast<const void *>(a.c.k);
	const double tol = a.c.tol / (causal ? 1 : 2);

	if (tid == 0) {
		win[0] = Lk;
		win[1] = 0;
	}
	for (int r0 = 0; r0 < G; r0 += WR) {
		const int nr = G - r0 < WR ? G - r0 : WR;

		/* ---- per row: alpha, |q|, c_row, the anchor keys */
		if (tid < nr) {
			const int row = r0 + tid, h = (int)kvh * gsz + row / (int)Lq;
			const int64_t i = row % (int)Lq, qrow = vrow(a.c.vq, b, h, i);
			const int64_t diag = rel + i;
			double sum = 0, ss = 0, qq = 0, mean;
			float hp[4];

			head_params(a.c, h, hp);
			for (int d = 0; d < D; d++)
				sum += load_el(Q, qrow + d, dt);
			mean = sum / D;
			for (int d = 0; d < D; d++) {
				const double x = load_el(Q, qrow + d, dt);

				ss += (x - mean) * (x - mean);
				qq += x * x;
			}
			r_ia[tid] = ape_inv_alpha(hp[3], ss, D);
			r_qn[tid] = ape_norm_bound(qq);
			r_diag[tid] = diag;
			r_qrow[tid] = qrow;
			r_an0[tid] = ape_anchor_distance(diag, Lk, causal);
			r_crow[tid] = ape_bias((double)hp[0], hp[1], hp[2], (double)r_an0[tid]);
			if (causal) {
				r_ahi[tid] = ape_visible_keys(diag, Lk, causal);
				r_alo[tid] = imax(0, r_ahi[tid] - AN);
			} else {
				const int64_t cc = imax(0, imin(diag, Lk - 1));

				r_alo[tid] = imax(0, imin(cc - AN / 2, Lk - AN));
				r_ahi[tid] = imin(Lk, r_alo[tid] + AN);
			}
		}
		bar();

		/* ---- the anchor's scores, one (row, key) per thread, exact angles */
		for (int e = tid; e < nr * AN; e += APE_CU_THREADS) {
			const int r = e / AN, row = r0 + r, h = (int)kvh * gsz + row / (int)Lq;
			const int64_t key = r_alo[r] + e % AN, qrow = r_qrow[r];
			float s = -APE_INF;

			if (key < r_ahi[r]) {
				const int64_t krow = kbase + key_at(a.c.pg, a.c.vk.sl, key);
				const int64_t n = r_diag[r] - key;
				const double nia = (double)n * r_ia[r];
				float hp[4], dot = 0.0f;

				head_params(a.c, h, hp);
				for (int p = 0; p < P; p++) {
					const int ia_ = inter ? 2 * p : p, ib = inter ? 2 * p + 1 : p + P;
					const float x = load_el(Q, qrow + ia_, dt), y = load_el(Q, qrow + ib, dt);
					const float u = load_el(K, krow + ia_, dt), w = load_el(K, krow + ib, dt);
					float cs, sn = ape_seed_sincos(nia * a.c.omega[p], &cs);

					dot += (x * cs - y * sn) * u + (x * sn + y * cs) * w;
				}
				s = ape_temp_f((float)a.c.scale, hp[3], ape_abs_dist(n)) * dot +
				    (ape_bias_diff_f(hp[0], hp[1], hp[2], ape_abs_dist(n), r_an0[r]) +
				     bias_at(a.c.bias, h, ape_abs_dist(n)));
				s = isfinite(dot) ? s : APE_NAN;
			}
			sc[r * AN + e % AN] = s;
		}
		bar();

		/* ---- per row: the anchor's weight, then the nearest provable cuts */
		if (tid < nr) {
			const int row = r0 + tid, h = (int)kvh * gsz + row / (int)Lq;
			const int64_t diag = r_diag[tid], alo = r_alo[tid], ahi = r_ahi[tid];
			const int64_t ntile = a.ntile, kb = bkv * (ntile + 1);
			const float *pre = reinterpret_cast<const float *>(a.pre) + kb;
			const float *suf = reinterpret_cast<const float *>(a.suf) + kb;
			const double as = fabs(a.c.scale);
			float hp[4], mx = -APE_INF;
			double L = 0, lw;

			head_params(a.c, h, hp);
			/* earlier launches' weight (lse_prior): a row whose keys here are all
			 * negligible against it needs none of them */
			const float *prior = reinterpret_cast<const float *>(a.c.prior);
			const bool gone =
				prior && may_stop(hp, a.c.bias, h, as, r_qn[tid], pre[ntile], r_an0[tid],
						  ape_visible_keys(diag, Lk, causal), r_crow[tid],
						  -APE_INF, 0.0f,
						  prior[(b * a.c.H + h) * Lq + row % (int)Lq] - r_crow[tid],
						  a.c.prior_tol);

			if (!gone && ahi > alo) {
				for (int k = 0; k < AN; k++)
					mx = fmaxf(mx, sc[tid * AN + k]);
				for (int k = 0; k < AN; k++)
					L += sc[tid * AN + k] == -APE_INF ? 0.0 : exp((double)sc[tid * AN + k] - mx);
				/* log of the anchor's weight in the row's frame (NaN: nothing is skipped) */
				lw = (double)mx + log(L);

				/* backward: the largest tb with keys [0, tb*T) negligible */
				int64_t lo = 0, hi = alo / T;

				while (lo < hi) {
					const int64_t mid = (lo + hi + 1) / 2, cnt = mid * T;

					if (may_stop(hp, a.c.bias, h, as, r_qn[tid], pre[mid],
						     ape_keys_min_abs(diag, 0, cnt),
						     cnt, r_crow[tid], (float)(lw * APE_LOG2E), 1.0f, -APE_INF, tol))
						lo = mid;
					else
						hi = mid - 1;
				}
				const int64_t wlo = lo * T;
				int64_t whi = ape_visible_keys(diag, Lk, causal);

				if (!causal) {
					/* forward: the smallest tf with keys [tf*T, Lk) negligible */
					int64_t flo = (ahi + T - 1) / T, fhi = ntile;

					while (flo < fhi) {
						const int64_t mid = (flo + fhi) / 2, cnt = Lk - mid * T;

						if (may_stop(hp, a.c.bias, h, as, r_qn[tid], suf[mid],
							     ape_keys_min_abs(diag, mid * T, Lk),
							     cnt,
							     r_crow[tid], (float)(lw * APE_LOG2E), 1.0f, -APE_INF, tol))
							fhi = mid;
						else
							flo = mid + 1;
					}
					whi = imin(Lk, flo * T);
				}
				shared_min64(&win[0], wlo);
				shared_max64(&win[1], whi);
			}
		}
		bar();
	}
	if (tid == 0) {
		int64_t *out = reinterpret_cast<int64_t *>(a.window) + 2 * bkv;

		out[0] = win[1] > win[0] ? win[0] : 0;
		out[1] = win[1] > win[0] ? win[1] : 0;
	}
}

} /* namespace ape */

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_dwindow(const struct ape_cu_window_args a)
{
	ape::dwindow(a);
}
APE_EMU_REGISTER(ape_dwindow, struct ape_cu_window_args)
