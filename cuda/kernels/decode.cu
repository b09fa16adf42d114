/* SPDX-License-Identifier: MIT */
/*
 * Decoding: 1 to 16 query rows per (batch, head) against a long key cache (flash-decoding).
 *
 * The keys a (batch, kv head) must read, [lo, hi) (the causally visible ones, or with skipping
 * the window ape_dwindow proved), are split into S contiguous splits, one block each, so that a
 * single query row still spreads over the whole GPU. A block serves every query row of its kv
 * head (the GQA group's heads times Lq), so K and V cross HBM once per split, not once per head.
 * Inside a block, 256 threads form groups of TPR = D / 16 lanes; a group owns one query row and
 * one run of consecutive keys of the split, each lane 8 of the row's pairs and 16 of its output
 * columns. Per key: the lanes' partial dot products are summed with shuffles, the row's score is
 * formed with its temperature and bias (and the distance-bias table's entry, with a table), and
 * one online-softmax step updates the lane's 16 columns. At the end the runs of a row are merged
 * in shared memory into the split's partial (O unnormalised, m, l, pairs); ape_dmerge merges the
 * splits by their LSE.
 *
 * Bandwidth: each lane copies its own K and V bytes of the keys ahead with cp.async into a ring
 * of 6 stages (4 for float32; 96 or 128 KB per block) in shared memory, laid out so that a warp's
 * 16-byte accesses hit distinct banks; no block barrier is needed while streaming, since a lane
 * reads only what it copied itself. With one 256-thread block per SM (about 180 registers per
 * thread) that keeps 5 keys x 16 KB = 80 KB per SM in flight, three times what HBM3e needs at
 * its latency (4.8 TB/s x ~0.7 us / 132 SMs = 25 KB). The arithmetic per key and row (the
 * rotation recurrence of 8 pairs per lane, reseeded exactly every 64 keys, the temperature and
 * bias) stays below the memory time for a single query row by about 3x on an H200.
 */
#include "common.cuh"

namespace ape {

/*
 * The entry of a ragged launch's segment table (args.h, APE_DC_SEGW) whose column col, which
 * never decreases along the table, is the last at most x: col 7 (blk0) finds a block's segment
 * (segments without keys have no block: the last of equal blk0 is the one with blocks), col 0
 * (q0) a query row's.
 */
APE_DEV const int64_t *seg_find(uint64_t segt, int64_t nseg, int64_t x, int col)
{
	const int64_t *t = reinterpret_cast<const int64_t *>(segt);
	int64_t lo = 0, hi = nseg - 1;

	while (lo < hi) {
		const int64_t mid = lo + (hi - lo + 1) / 2;

		if (t[mid * APE_DC_SEGW + col] <= x)
			lo = mid;
		else
			hi = mid - 1;
	}
	return t + lo * APE_DC_SEGW;
}

/*
 * DIAG (the _diag kernels, docs/diagnostics.md): each group also keeps the running sums of the
 * diagnostics, S1 = sum_j p_j x_j and S2 = sum_j p_j |n_j| (x_j = score - m, log2 units like m
 * and l), rescaled with l when the maximum moves; runs and splits merge them by the same rule
 * (APE_DIAG_RESCALE_S1: a partial result is a "key" carrying its own S1), the splits in
 * ape_dmerge_diag, which writes ENT and MD. Without DIAG none of that code exists.
 */
template <int DMAX, bool EXACT, int VT, bool DIAG> struct Decode {
	static constexpr int NTH = APE_CU_THREADS;
	static constexpr int TPR = APE_DC_TPR(DMAX);
	static constexpr int PT = 8; /* pairs per lane */
	static constexpr int VC = DMAX / TPR; /* V columns per lane: 16 */
	static constexpr int NG = NTH / TPR; /* groups per block */
	static constexpr int NVEC = APE_DC_NVEC(VT);
	static constexpr int STAGES = APE_DC_STAGES(VT);
	static constexpr int ESZ = VT == APE_CU_F32 ? 4 : 2;
	static constexpr int PMAX = DMAX / 2;
	/* merge area floats per group: acc, m, l, pairs, (a free slot, S1, S2) */
	static constexpr int MROW = APE_DC_MROW(DMAX, DIAG);
	static_assert(PT * TPR == PMAX && VC == 16, "decode lane shape");
	static_assert(NVEC * 16 == (2 * PT + VC) * ESZ, "a lane's K and V bytes per key");
	static_assert(NG * MROW * 4 <= APE_DC_SMEM(DMAX, VT, EXACT, DIAG), "merge area");

	/* The 16-byte ring slot of vector v of stage st for this thread. */
	static APE_DEV unsigned char *slot(unsigned char *ring, int st, int v)
	{
		return ring + ((st * NVEC + v) * NTH + threadIdx.x) * 16;
	}

	/* Element offset, within a key row, of this lane's vector v (exact D only). */
	static APE_DEV int vec_offset(int v, int c, bool inter)
	{
		constexpr int EPV = 16 / ESZ; /* elements per vector */
		constexpr int KV = 2 * PT / EPV; /* vectors of K */

		if (v >= KV) /* V: columns c*VC .. */
			return c * VC + (v - KV) * EPV;
		if (inter) /* (u, w) interleaved: 2*PT contiguous elements */
			return 2 * PT * c + v * EPV;
		/* half layout: u = K[c*PT ..], w = K[PMAX + c*PT ..], KV/2 vectors each */
		return (v < KV / 2 ? 0 : PMAX) + c * PT + (v % (KV / 2)) * EPV;
	}

	/* Copies this lane's bytes of the key at walk w into stage st (zeros when !ok), one
	 * group; kb, vb: the element offsets of the kv head's base in K and V. With
	 * APE_CU_F_KV_CHECK (keys read in place that the host could not prove aligned) a vector
	 * whose source is not 16-byte aligned is copied with plain loads instead: the same bytes
	 * in the ring (copy_row16()). */
	static APE_DEV void issue(const ape_cu_decode_args &a, unsigned char *ring, int st,
				  int64_t kb, int64_t vb, KeyWalk &w, bool ok, int c, bool inter)
	{
		const unsigned char *K = reinterpret_cast<const unsigned char *>(a.c.k);
		const unsigned char *V = reinterpret_cast<const unsigned char *>(a.c.v);
		const int64_t kr = ok ? kb + w.at(a.c.pg, a.c.vk.sl) : 0;
		const int64_t vr = ok ? vb + w.at(a.c.pg, a.c.vv.sl) : 0;
		const bool check = ok && (a.c.flags & APE_CU_F_KV_CHECK);

#pragma unroll
		for (int v = 0; v < NVEC; v++) {
			const bool isv = v >= 2 * PT * ESZ / 16;
			const unsigned char *src =
				isv ? V + (vr + vec_offset(v, c, inter)) * ESZ : K + (kr + vec_offset(v, c, inter)) * ESZ;

			copy_row16(slot(ring, st, v), src, K, ok, check);
		}
		cp_commit();
	}

	static APE_DEV float elem(const unsigned char *p, int k)
	{
		if (VT == APE_CU_F32)
			return reinterpret_cast<const float *>(p)[k];
		if (VT == APE_CU_F16)
			return h2f(reinterpret_cast<const uint16_t *>(p)[k]);
		return b2f(reinterpret_cast<const uint16_t *>(p)[k]);
	}

	/* This lane's K pairs and V columns of one key, from the ring or (generic D) from memory. */
	static APE_DEV void fetch(const ape_cu_decode_args &a, unsigned char *ring, int st,
				  int64_t kb, int64_t vb, KeyWalk &kw, bool ok, int c, bool inter,
				  float (&u)[PT], float (&w)[PT], float (&vv)[VC])
	{
		if (EXACT) {
			constexpr int EPV = 16 / ESZ;
			constexpr int KV = 2 * PT / EPV;
			unsigned char *b = slot(ring, st, 0);
			const int stride = NTH * 16; /* bytes between a lane's vectors */

#pragma unroll
			for (int p = 0; p < PT; p++) {
				if (inter) {
					u[p] = elem(b + (2 * p / EPV) * stride, 2 * p % EPV);
					w[p] = elem(b + ((2 * p + 1) / EPV) * stride, (2 * p + 1) % EPV);
				} else {
					u[p] = elem(b + (p / EPV) * stride, p % EPV);
					w[p] = elem(b + (KV / 2 + p / EPV) * stride, p % EPV);
				}
			}
#pragma unroll
			for (int d = 0; d < VC; d++)
				vv[d] = elem(b + (KV + d / EPV) * stride, d % EPV);
		} else {
			const int D = a.c.D, P = D / 2;
			const int64_t kr = ok ? kb + kw.at(a.c.pg, a.c.vk.sl) : 0;
			const int64_t vr = ok ? vb + kw.at(a.c.pg, a.c.vv.sl) : 0;
			const void *K = reinterpret_cast<const void *>(a.c.k);
			const void *V = reinterpret_cast<const void *>(a.c.v);

#pragma unroll
			for (int p = 0; p < PT; p++) {
				const int pg = c * PT + p;
				const bool in = ok && pg < P;

				u[p] = in ? load_el(K, kr + (inter ? 2 * pg : pg), VT) : 0.0f;
				w[p] = in ? load_el(K, kr + (inter ? 2 * pg + 1 : pg + P), VT) : 0.0f;
			}
#pragma unroll
			for (int d = 0; d < VC; d++) {
				const int col = c * VC + d;

				vv[d] = ok && col < D ? load_el(V, vr + col, VT) : 0.0f;
			}
		}
	}

	/* The kernel: walk() with the distance-bias table's lookup compiled in only for a launch
	 * that has a table, so that one without pays nothing for it per key. */
	static APE_DEV void run(const ape_cu_decode_args &a)
	{
		if (a.c.bias.tab)
			walk<true>(a);
		else
			walk<false>(a);
	}

	/* TAB: the launch has a distance-bias table (a.c.bias), added to every score. */
	template <bool TAB> static APE_DEV void walk(const ape_cu_decode_args &a)
	{
		unsigned char *sm = smem_base();
		const int tid = threadIdx.x, g = tid / TPR, c = tid % TPR;
		const int64_t nbkv = (int64_t)a.c.B * a.c.Hkv;
		const int64_t blk = a.block_base + block_linear();
		/* the problem this block serves: the launch's, or its segment's as a dense launch
		 * of it alone (B = 1; args.h, APE_DC_SEGW): its rows from q0, its keys from k0,
		 * its partial rows from pbase */
		int64_t S = a.splits, Lq = a.c.Lq, Lk = a.c.Lk, rel = a.c.rel, q0 = 0, k0 = 0;
		int64_t pbase = 0, first = 0;

		if (a.segt) {
			if (blk >= a.splits) /* the grid's blocks */
				return;
			const int64_t *e = seg_find(a.segt, a.nseg, blk, 7);

			Lq = e[1];
			Lk = e[3];
			rel = e[4];
			S = e[5];
			q0 = e[0];
			k0 = e[2];
			pbase = e[6];
			first = e[7];
		} else if (blk >= S * nbkv) {
			return;
		}

		const int64_t s = (blk - first) % S, bkv = (blk - first) / S;
		const int64_t b = bkv / a.c.Hkv, kvh = bkv % a.c.Hkv;
		const int64_t kb = vrow(a.c.vk, b, kvh, 0), vb = vrow(a.c.vv, b, kvh, 0);
		const int gsz = a.c.H / a.c.Hkv;
		const int G = gsz * (int)Lq;
		const bool causal = a.c.flags & APE_CU_F_CAUSAL;
		const bool inter = a.c.flags & APE_CU_F_INTERLEAVED;
		const int D = EXACT ? DMAX : a.c.D, P = D / 2;
		/* the partial rows of one split (dense: every row of the launch) */
		const int64_t rows = (a.segt ? 1 : (int64_t)a.c.B) * a.c.H * Lq;
		/* the keys the last row sees */
		int64_t lo = 0, hi = ape_visible_keys(rel + (Lq - 1), Lk, causal);

		if (a.window) {
			lo = reinterpret_cast<const int64_t *>(a.window)[2 * bkv];
			hi = reinterpret_cast<const int64_t *>(a.window)[2 * bkv + 1];
		}
		hi = imax(hi, lo);
		const int64_t ks = lo + (hi - lo) * s / S, ke = lo + (hi - lo) * (s + 1) / S;
		const int RP = G < NG ? G : NG; /* rows per pass */
		const int RUNS = NG / RP;
		const int64_t niter = (ke - ks + RUNS - 1) / RUNS;
		float *merge = reinterpret_cast<float *>(sm);

		for (int pass0 = 0; pass0 < G; pass0 += RP) {
			const int row_in = g % RP, run = g / RP;
			const bool active = run < RUNS && pass0 + row_in < G;
			const int grow = active ? pass0 + row_in : 0;
			const int hg = grow / (int)Lq, i = grow % (int)Lq;
			const int h = (int)kvh * gsz + hg;
			const int64_t rs = active ? ks + (ke - ks) * run / RUNS : ks;
			const int64_t re = active ? ks + (ke - ks) * (run + 1) / RUNS : ks;
			float hp[4];

			head_params(a.c, h, hp);

			/* ---- the row: pairs, sigma, alpha, the rotation step */
			const void *Q = reinterpret_cast<const void *>(a.c.q);
			const int64_t qrow = vrow(a.c.vq, b, h, q0 + i);
			float qx[PT], qy[PT], cw[PT], sw[PT], xr[PT], yr[PT];
			double sum = 0, ss = 0;

#pragma unroll
			for (int p = 0; p < PT; p++) {
				const int pg = c * PT + p;
				const bool ok = EXACT || pg < P;

				qx[p] = ok ? load_el(Q, qrow + (inter ? 2 * pg : pg), a.c.dt_in) : 0.0f;
				qy[p] = ok ? load_el(Q, qrow + (inter ? 2 * pg + 1 : pg + P), a.c.dt_in)
					   : 0.0f;
				sum += (double)qx[p] + (double)qy[p];
			}
			sum = group_sum<TPR>(sum);
#pragma unroll
			for (int p = 0; p < PT; p++) {
				const double mean = sum / D, x = qx[p], y = qy[p];

				if (EXACT || c * PT + p < P)
					ss += (x - mean) * (x - mean) + (y - mean) * (y - mean);
			}
			ss = group_sum<TPR>(ss);
			const double ia = ape_inv_alpha(hp[3], ss, D);
#pragma unroll
			for (int p = 0; p < PT; p++) {
				const int pg = c * PT + p;

				sw[p] = ape_seed_sincos((EXACT || pg < P ? a.c.omega[pg] : 0.0) * ia, &cw[p]);
				xr[p] = yr[p] = 0.0f;
			}
			const int64_t diag = rel + i;
			const int64_t an0 = ape_anchor_distance(diag, Lk, causal);
			const float sl2 = (float)(a.c.scale * APE_LOG2E);
			/* the head's distance-bias table row */
			const float *trow = TAB ? bias_row(a.c.bias, h) : nullptr;
			float m = -APE_INF, l = 0.0f, acc[VC];
			float e1 = 0.0f, e2 = 0.0f; /* DIAG: S1, S2 */
			uint32_t cnt = 0;

#pragma unroll
			for (int d = 0; d < VC; d++)
				acc[d] = 0.0f;

			/* ---- stream the run's keys (kw: the key the next copy or load reads, as
			 * the launch counts them: the segment's from k0) */
			KeyWalk kw;

			kw.start(a.c.pg, k0 + rs);
			if (EXACT) {
#pragma unroll
				for (int st = 0; st < STAGES - 1; st++) {
					issue(a, sm, st, kb, vb, kw,
					      active && st < niter && rs + st < re, c, inter);
					kw.next(a.c.pg);
				}
			}
			for (int64_t jj = 0; jj < niter; jj++) {
				const int64_t key = rs + jj;
				const bool valid = active && key < re;
				float u[PT], w[PT], vv[VC], dot0 = 0.0f, dot1 = 0.0f;

				if (EXACT) {
					const int64_t ahead = jj + STAGES - 1;

					issue(a, sm, (int)(ahead % STAGES), kb, vb, kw,
					      active && ahead < niter && rs + ahead < re, c, inter);
					kw.next(a.c.pg);
					cp_wait<STAGES - 1>();
				}
				fetch(a, sm, (int)(jj % STAGES), kb, vb, kw, valid, c, inter, u, w,
				      vv);
				if (!EXACT)
					kw.next(a.c.pg);
				if (jj % APE_DC_RESEED == 0) {
					const double nia = (double)(diag - key) * ia;

#pragma unroll
					for (int p = 0; p < PT; p++) {
						const int pg = c * PT + p;
						float cs, sn = ape_seed_sincos(nia * (EXACT || pg < P ? a.c.omega[pg]
												 : 0.0),
									   &cs);

						xr[p] = qx[p] * cs - qy[p] * sn;
						yr[p] = qx[p] * sn + qy[p] * cs;
					}
				}
#pragma unroll
				for (int p = 0; p < PT; p++) {
					const float x = xr[p], y = yr[p];

					if (p & 1)
						dot1 = fmaf(y, w[p], fmaf(x, u[p], dot1));
					else
						dot0 = fmaf(y, w[p], fmaf(x, u[p], dot0));
					xr[p] = fmaf(x, cw[p], y * sw[p]);
					yr[p] = fmaf(y, cw[p], -(x * sw[p]));
				}
				const float dot = group_sum<TPR>(dot0 + dot1);
				const int64_t n = diag - key;

				if (valid && (!causal || n >= 0)) {
					const int64_t an = ape_abs_dist(n);
					const float t = ape_temp_f(sl2, hp[3], an);
					float bd = ape_bias_diff_f(hp[0], hp[1], hp[2], an, an0);
					float s2;

					if constexpr (TAB)
						bd += trow[ape_bias_index(an, a.c.bias.len)];
					s2 = fmaf(dot, t, bd * (float)APE_LOG2E);
					float p;

					s2 = isfinite(dot) ? s2 : APE_NAN;
					if (s2 > m) {
						const float corr = m == -APE_INF ? 0.0f : ex2(m - s2);

						if constexpr (DIAG) { /* ape/ape_math.h */
							e1 = corr > 0.0f
								     ? APE_DIAG_RESCALE_S1(e1, l, corr, m - s2)
								     : 0.0f;
							e2 *= corr;
						}
						l *= corr;
#pragma unroll
						for (int d = 0; d < VC; d++)
							acc[d] *= corr;
						m = s2;
					}
					p = ex2(s2 - m); /* NaN stays NaN */
					l += p;
					if constexpr (DIAG) {
						e1 += ape_diag_s1_term_f(p, s2 - m);
						e2 = fmaf(p, (float)an, e2);
					}
#pragma unroll
					for (int d = 0; d < VC; d++)
						acc[d] = fmaf(p, vv[d], acc[d]);
					cnt++;
				}
			}
			if (EXACT)
				cp_wait<0>();
			bar(); /* the ring becomes the merge area */

			/* ---- merge the runs of each row into the split's partial */
			{
				float *my = merge + g * MROW;

#pragma unroll
				for (int d = 0; d < VC; d++)
					my[c * VC + d] = acc[d];
				if (c == 0) {
					my[DMAX] = m;
					my[DMAX + 1] = l;
					reinterpret_cast<uint32_t *>(my)[DMAX + 2] = cnt;
					if constexpr (DIAG) {
						my[DMAX + 4] = e1;
						my[DMAX + 5] = e2;
					}
				}
			}
			bar();
			for (int e = tid; e < RP * DMAX; e += NTH) {
				const int r = e / DMAX, d = e % DMAX, row = pass0 + r;

				if (row >= G || d >= D)
					continue;
				const int rh = (int)kvh * gsz + row / (int)Lq, ri = row % (int)Lq;
				const int64_t out = pbase + (b * a.c.H + rh) * Lq + ri;
				float mm = -APE_INF, ll = 0.0f, o = 0.0f;
				uint32_t pc = 0;

				for (int q = 0; q < RUNS; q++)
					mm = fmaxf(mm, merge[(q * RP + r) * MROW + DMAX]);
				for (int q = 0; q < RUNS; q++) {
					const float *src = merge + (q * RP + r) * MROW;
					const float f = src[DMAX] == -APE_INF ? 0.0f : ex2(src[DMAX] - mm);

					ll = fmaf(src[DMAX + 1], f, ll);
					o = fmaf(src[d], f, o);
					pc += reinterpret_cast<const uint32_t *>(src)[DMAX + 2];
				}
				reinterpret_cast<float *>(a.part_o)[(s * rows + out) * D + d] = o;
				if (d == 0) {
					reinterpret_cast<float *>(a.part_ml)[2 * (s * rows + out)] = mm;
					reinterpret_cast<float *>(a.part_ml)[2 * (s * rows + out) + 1] = ll;
					reinterpret_cast<uint64_t *>(a.part_pairs)[s * rows + out] = pc;
				}
				if constexpr (DIAG) {
					if (d == 0) {
						float f1 = 0.0f, f2 = 0.0f;

						for (int q = 0; q < RUNS; q++) {
							const float *src = merge + (q * RP + r) * MROW;
							const float mq = src[DMAX];
							const float f = mq == -APE_INF ? 0.0f : ex2(mq - mm);

							f1 += f > 0.0f ? APE_DIAG_RESCALE_S1(src[DMAX + 4],
											     src[DMAX + 1], f,
											     mq - mm)
								       : 0.0f;
							f2 = fmaf(src[DMAX + 5], f, f2);
						}
						reinterpret_cast<float *>(a.part_sd)[2 * (s * rows + out)] = f1;
						reinterpret_cast<float *>(a.part_sd)[2 * (s * rows + out) + 1] = f2;
					}
				}
			}
			bar(); /* the merge area becomes the ring of the next pass */
		}
	}
};

/*
 * The splits of each row merged by their LSE: O = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s,
 * LSE = c_row + ln 2 (M + log2 L). One warp per row, lanes along the columns.
 */
template <bool DIAG> APE_DEV void dmerge(const ape_cu_merge_args &a)
{
	const int lane = threadIdx.x & 31;
	const int64_t row = (a.block_base + block_linear()) * (APE_CU_THREADS / 32) + (threadIdx.x >> 5);

	if (row >= a.rows)
		return;
	const int64_t Lq = a.c.Lq;
	const int D = a.c.D;
	const int bh = (int)(row / Lq); /* B * H <= INT32_MAX (the host checks it) */
	const int64_t i = row - (int64_t)bh * Lq;
	const int b = bh / a.c.H, h = bh % a.c.H;
	/* the row's splits: partial s at pr + s * ps; a ragged launch's row as its segment's
	 * (args.h, APE_DC_SEGW), at distance rel + i from its first key of Lk */
	int64_t S = a.splits, pr = row, ps = a.rows, rel = a.c.rel + i, Lk = a.c.Lk;

	if (a.segt) {
		const int64_t *e = seg_find(a.segt, a.nseg, i, 0);

		S = e[5];
		ps = a.c.H * e[1];
		pr = e[6] + h * e[1] + (i - e[0]);
		rel = e[4] + (i - e[0]);
		Lk = e[3];
	}
	const float *ml = reinterpret_cast<const float *>(a.part_ml);
	const float *po = reinterpret_cast<const float *>(a.part_o);
	float M = -APE_INF, L = 0.0f;
	uint64_t pairs = 0;

	for (int64_t s = 0; s < S; s++)
		M = fmaxf(M, ml[2 * (pr + s * ps)]);
	for (int64_t s = 0; s < S; s++) {
		const float ms = ml[2 * (pr + s * ps)];

		L = fmaf(ml[2 * (pr + s * ps) + 1], ms == -APE_INF ? 0.0f : ex2(ms - M), L);
		pairs += reinterpret_cast<const uint64_t *>(a.part_pairs)[pr + s * ps];
	}
	const float inv = L == 0.0f ? 0.0f : 1.0f / L; /* NaN stays NaN */
	const int64_t orow = vrow(a.c.vo, b, h, i);

	for (int d = lane; d < D; d += 32) {
		float o = 0.0f;

		for (int64_t s = 0; s < S; s++) {
			const float ms = ml[2 * (pr + s * ps)];

			o = fmaf(po[(pr + s * ps) * D + d], ms == -APE_INF ? 0.0f : ex2(ms - M), o);
		}
		store_el(reinterpret_cast<void *>(a.c.o), orow + d, o * inv, a.c.dt_out);
	}
	if (lane == 0) {
		const bool causal = a.c.flags & APE_CU_F_CAUSAL;
		float hp[4];

		head_params(a.c, h, hp);
		if (a.c.lse) {
			const double crow = ape_bias((double)hp[0], hp[1], hp[2],
						     (double)ape_anchor_distance(rel, Lk,
										 causal));

			reinterpret_cast<float *>(a.c.lse)[vrow(a.c.vlse, b, h, i)] =
				L > 0.0f ? (float)(crow + ((double)M + log2((double)L)) * APE_LN2)
				: L == 0.0f ? -APE_INF
					    : APE_NAN;
		}
		if (a.c.pairs)
			reinterpret_cast<uint64_t *>(a.c.pairs)[row] = pairs;
		if constexpr (DIAG) {
			/* the splits' S1, S2 in the frame of M (ape/ape_math.h); no split: 0, 0 */
			const float *sd = reinterpret_cast<const float *>(a.part_sd);
			float s1 = 0.0f, s2 = 0.0f;

			for (int64_t s = 0; s < S; s++) {
				const float ms = ml[2 * (pr + s * ps)];
				const float f = ms == -APE_INF ? 0.0f : ex2(ms - M);

				s1 += f > 0.0f ? APE_DIAG_RESCALE_S1(sd[2 * (pr + s * ps)],
								     ml[2 * (pr + s * ps) + 1], f,
								     ms - M)
					       : 0.0f;
				s2 = fmaf(sd[2 * (pr + s * ps) + 1], f, s2);
			}
			if (a.c.ent)
				reinterpret_cast<float *>(a.c.ent)[vrow(a.c.vent, b, h, i)] =
					(float)ape_diag_entropy((double)L, (double)s1 * APE_LN2);
			if (a.c.md)
				reinterpret_cast<float *>(a.c.md)[vrow(a.c.vmd, b, h, i)] =
					(float)ape_diag_distance((double)L, (double)s2);
		}
	}
}

} /* namespace ape */

#define APE_DECODE1(name, dmax, exact, vt, diag)                                                   \
	extern "C" __global__ void __launch_bounds__(APE_CU_THREADS, 1)                           \
		name(const struct ape_cu_decode_args a)                                            \
	{                                                                                          \
		ape::Decode<dmax, exact, vt, diag>::run(a);                                        \
	}                                                                                          \
	APE_EMU_REGISTER(name, struct ape_cu_decode_args)

/* each kernel, and its twin with the diagnostics (name_diag) */
#define APE_DECODE(name, dmax, exact, vt)                                                          \
	APE_DECODE1(name, dmax, exact, vt, false)                                                  \
	APE_DECODE1(name##_diag, dmax, exact, vt, true)

APE_DECODE(ape_decode_d64_f32, 64, true, APE_CU_F32)
APE_DECODE(ape_decode_d64_f16, 64, true, APE_CU_F16)
APE_DECODE(ape_decode_d64_bf16, 64, true, APE_CU_BF16)
APE_DECODE(ape_decode_d128_f32, 128, true, APE_CU_F32)
APE_DECODE(ape_decode_d128_f16, 128, true, APE_CU_F16)
APE_DECODE(ape_decode_d128_bf16, 128, true, APE_CU_BF16)
APE_DECODE(ape_decode_g128_f32, 128, false, APE_CU_F32)
APE_DECODE(ape_decode_g128_f16, 128, false, APE_CU_F16)
APE_DECODE(ape_decode_g128_bf16, 128, false, APE_CU_BF16)
APE_DECODE(ape_decode_g256_f32, 256, false, APE_CU_F32)
APE_DECODE(ape_decode_g256_f16, 256, false, APE_CU_F16)
APE_DECODE(ape_decode_g256_bf16, 256, false, APE_CU_BF16)

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS) ape_dmerge(const struct ape_cu_merge_args a)
{
	ape::dmerge<false>(a);
}
APE_EMU_REGISTER(ape_dmerge, struct ape_cu_merge_args)

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_dmerge_diag(const struct ape_cu_merge_args a)
{
	ape::dmerge<true>(a);
}
APE_EMU_REGISTER(ape_dmerge_diag, struct ape_cu_merge_args)
