/* SPDX-License-Identifier: MIT */
/*
 * The pre-passes, once per launch and bound by memory bandwidth:
 *   ape_prep   K as float32 pairs for the prefill kernel ([u | w] halves of dmax / 2 floats,
 *              zeros past D / 2, whatever the storage type and rope layout), V padded to dmax
 *              columns for the generic head sizes, and per tile of keys the largest key norm
 *              for the skip bound (float64 sums, rounded up; a NaN or Inf anywhere in the
 *              tile's K or V gives +inf, so such a tile is never skipped and its NaN reaches
 *              every row that sees it, as in the reference).
 *   ape_kscan  prefix and suffix maxima of those norms: "the largest norm among the tiles not
 *              visited yet in this direction" becomes one load.
 *   ape_dwindow  (decode only) the range of keys the decode kernel must read: the anchor keys
 *              nearest each query row are scored exactly, and the skip bound, with the anchor's
 *              weight as a lower bound of the computed weight, proves the rest negligible.
 */
#include "common.cuh"

namespace ape {

/* One block per (batch x kv head, tile of keys); a warp per key row, lanes along the row. */
APE_DEV void prep(const ape_cu_prep_args &a)
{
	const int64_t blk = a.block_base + block_linear();
	float *wmax = reinterpret_cast<float *>(smem_base()); /* APE_CU_PREP_SMEM bytes */
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int D = a.D, P = D / 2, PM = a.dmax / 2;
	const int esz = a.dt == APE_CU_F32 ? 4 : 2;
	float mx = 0.0f;

	if (blk >= a.nbkv * a.ntile)
		return;
	const int64_t bkv = blk / a.ntile, t = blk % a.ntile;
	const int64_t j0 = t * a.tile, j1 = imin(j0 + a.tile, a.Lk);

	const int64_t b = bkv / a.Hkv, kvh = bkv % a.Hkv;

	for (int64_t j = j0 + warp; j < j1; j += APE_CU_THREADS / 32) {
		const int64_t row = bkv * a.Lk + j; /* of kp and vp: contiguous */
		/* (keys read in place: where the pages put them; args.h) */
		const int64_t kr = vrow(a.vk, b, kvh, 0) + key_at(a.pg, a.vk.sl, j);
		const int64_t vr = vrow(a.vv, b, kvh, 0) + key_at(a.pg, a.vv.sl, j);
		const void *K = reinterpret_cast<const void *>(a.k);
		const void *V = reinterpret_cast<const void *>(a.v);
		double ss = 0.0;
		float vs = 0.0f;

		for (int p = lane; p < PM; p += 32) {
			const bool ok = p < P;
			const float u = ok ? load_el(K, kr + (a.interleaved ? 2 * p : p), a.dt) : 0.0f;
			const float w = ok ? load_el(K, kr + (a.interleaved ? 2 * p + 1 : p + P), a.dt)
					   : 0.0f;

			if (a.kp) {
				float *kp = reinterpret_cast<float *>(a.kp) + row * a.dmax;

				kp[p] = u;
				kp[PM + p] = w;
			}
			ss += (double)u * u + (double)w * w;
		}
		for (int d = lane; d < a.dmax; d += 32) {
			const bool ok = d < D;

			if (a.ktile && ok)
				vs += 0.0f * load_el(V, vr + d, a.dt); /* NaN for NaN or Inf */
			if (a.vp) {
				unsigned char *dst = reinterpret_cast<unsigned char *>(a.vp) +
						     (row * a.dmax + d) * esz;
				const unsigned char *src = reinterpret_cast<const unsigned char *>(a.v) +
							   (vr + d) * esz;

				if (esz == 4)
					*reinterpret_cast<uint32_t *>(dst) =
						ok ? *reinterpret_cast<const uint32_t *>(src) : 0u;
				else
					*reinterpret_cast<uint16_t *>(dst) =
						ok ? *reinterpret_cast<const uint16_t *>(src) : (uint16_t)0;
			}
		}
		if (a.ktile) {
			float n;

			ss = group_sum<32>(ss);
			vs = group_sum<32>(vs);
			n = (float)sqrt(ss) + vs;
			if (!(n <= mx))
				mx = isnan(n) ? APE_INF : n;
		}
	}
	if (!a.ktile)
		return;
	if (lane == 0)
		wmax[warp] = mx;
	bar();
	if (threadIdx.x == 0) {
		for (int w = 1; w < APE_CU_THREADS / 32; w++)
			mx = fmaxf(mx, wmax[w]);
		/* rounded up: float rounding of the norm stays below the bound */
		reinterpret_cast<float *>(a.ktile)[bkv * a.ntile + t] = ape_norm_bound_f(mx);
	}
}

/* One thread per (batch x kv head). */
APE_DEV void kscan(const ape_cu_scan_args &a)
{
	const int64_t bkv = block_linear() * APE_CU_THREADS + threadIdx.x;

	if (bkv >= a.nbkv)
		return;
	const float *kt = reinterpret_cast<const float *>(a.ktile) + bkv * a.ntile;
	float *pre = reinterpret_cast<float *>(a.pre) + bkv * (a.ntile + 1);
	float *suf = reinterpret_cast<float *>(a.suf) + bkv * (a.ntile + 1);
	float run = 0.0f;

	pre[0] = 0.0f;
	for (int64_t t = 0; t < a.ntile; t++) {
		run = fmaxf(run, kt[t]);
		pre[t + 1] = run;
	}
	run = 0.0f;
	suf[a.ntile] = 0.0f;
	for (int64_t t = a.ntile - 1; t >= 0; t--) {
		run = fmaxf(run, kt[t]);
		suf[t] = run;
	}
}

} /* namespace ape */

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS) ape_prep(const struct ape_cu_prep_args a)
{
	ape::prep(a);
}
APE_EMU_REGISTER(ape_prep, struct ape_cu_prep_args)

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS) ape_kscan(const struct ape_cu_scan_args a)
{
	ape::kscan(a);
}
APE_EMU_REGISTER(ape_kscan, struct ape_cu_scan_args)

/* attention_merge (core/backend.h, struct ape_be_merge): row r's partial result folded into its
 * running one, one thread per row (the row's LSE is read before and written after its O, by
 * the same thread), the weights in float64 (ape/ape_math.h, ape_merge_lse()). */
extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_lmerge(const struct ape_cu_lmerge_args a)
{
	const int64_t r = ape::block_linear() * APE_CU_THREADS + (int64_t)threadIdx.x;
	float *o, *lse = reinterpret_cast<float *>(a.lse);
	float *ent = reinterpret_cast<float *>(a.ent), *md = reinterpret_cast<float *>(a.md);
	const float *po, *plse = reinterpret_cast<const float *>(a.plse);
	const float *pent = reinterpret_cast<const float *>(a.pent);
	const float *pmd = reinterpret_cast<const float *>(a.pmd);
	double l = 0, w1 = 0, w2 = 0, lw1 = 0, lw2 = 0;
	int how;

	if (r >= a.rows)
		return;
	o = reinterpret_cast<float *>(a.o) + r * a.D;
	po = reinterpret_cast<const float *>(a.po) + r * a.D;
	if (a.pairs && a.pairs32)
		reinterpret_cast<uint32_t *>(a.pairs)[r] +=
			(uint32_t)reinterpret_cast<const uint64_t *>(a.ppairs)[r];
	else if (a.pairs)
		reinterpret_cast<uint64_t *>(a.pairs)[r] +=
			reinterpret_cast<const uint64_t *>(a.ppairs)[r];
	how = ape_merge_lse(lse[r], plse[r], &l, &w1, &w2, &lw1, &lw2);
	if (how == APE_MERGE_KEEP)
		return;
	if (how == APE_MERGE_NAN) {
		for (int64_t d = 0; d < a.D; d++)
			o[d] = NAN;
		lse[r] = NAN;
		if (ent)
			ent[r] = md[r] = NAN;
		return;
	}
	if (how == APE_MERGE_TAKE) {
		for (int64_t d = 0; d < a.D; d++)
			o[d] = po[d];
		lse[r] = plse[r];
		if (ent) {
			ent[r] = pent[r];
			md[r] = pmd[r];
		}
		return;
	}
	for (int64_t d = 0; d < a.D; d++)
		o[d] = (float)(w1 * o[d] + w2 * po[d]);
	if (ent) {
		ent[r] = (float)ape_merge_entropy(w1, ent[r], lw1, w2, pent[r], lw2);
		md[r] = (float)(w1 * md[r] + w2 * pmd[r]);
	}
	lse[r] = (float)l;
}
APE_EMU_REGISTER(ape_lmerge, struct ape_cu_lmerge_args)
