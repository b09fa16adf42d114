/* SPDX-License-Identifier: MIT */
/*
 * The separable path (docs/kernels.md, "Decode and the separable path"): launches whose every
 * head has lambda = 0, so alpha = 1 and temp = 1 and the rotation of pair p by n omega_p,
 * n = (rel + i) - j, splits into the query's at rel + i and the key's at j. Q and K are rotated
 * once (ape_sep_rot, O(L D)), and the scores are a plain matrix product plus the distance bias:
 * a FlashAttention-2 kernel on tensor cores for f16 and bf16 storage (float32 storage goes to
 * the general prefill kernel).
 *
 *   ape_sep_rot   one warp per query row, rotated at rel + i, one block per key tile, each key
 *                 rotated at j (the exact seed of ape_math.h, float64 angles), each rotated
 *                 value x stored as two of the storage type, hi = x rounded and lo = x - hi
 *                 rounded; f16 rows, and key tiles, that a rotation could take past 65504
 *                 halved (sep_args.h), with their factors; V copied; |q| for the skip bound.
 *   ape_sep_<d>_<type>  one block of 8 warps per (tile of 128 query rows, batch, head); each
 *                 warp owns 16 rows, its Q fragments in registers. Key tiles of 64 keys arrive
 *                 by cp.async into double buffers. S = Q K^T by mma.sync m16n8k16 (float32
 *                 accumulators), times scale (and the row's and the key tile's f16 range
 *                 factors), plus the tile's per-distance bias table
 *                 (ape_bias_diff_f against the block-tile's nearest distance, and the
 *                 distance-bias table's entries, as the general kernel's tables; its float64
 *                 bias goes to bref, and each row adds bref - c_row), then one online-softmax
 *                 update per tile (log2 units, the rows' maxima over the four lanes of a
 *                 quad); P V on tensor cores with P taken from the score registers. A tile
 *                 cut by the causal diagonal runs P V on CUDA cores with the mask per element
 *                 (a masked key adds nothing, not 0 * V: V may hold a NaN the row must not
 *                 receive). Causal blocks walk from the diagonal backward and, with skipping,
 *                 stop once every row may leave out the keys before the tile (ape_may_skip
 *                 with per-tile key norms from ape_prep and ape_kscan, and a table's suffix
 *                 maxima).
 *
 * Why hi and lo: the rotated values are not representable in the storage type, and rounding
 * them once costs 2^-9 (bf16) of every product: with |q| |k| scale of a few units, an LSE error
 * at the bf16 tolerance itself (measured 1.2x of it on the emulator). The scores are
 * Qhi Khi + Qhi Klo + Qlo Khi (three products per k-step; Qlo Klo, below 2^-16 of each product,
 * is left out), float32 accumulators: about float32's accuracy at three times the Q K^T
 * tensor work, which P V matches once more.
 */
#include "common.cuh"
#include "sep_args.h"

namespace ape {

/* x as hi (element e of the row) and lo (element D + e): x rounded, and the rest rounded. */
APE_DEV void split(uint16_t *row, int e, int D, float x, int dt)
{
	const uint16_t hi = dt == APE_CU_F16 ? f2h(x) : f2b(x);
	const float r = x - (dt == APE_CU_F16 ? h2f(hi) : b2f(hi));

	row[e] = hi;
	row[D + e] = dt == APE_CU_F16 ? f2h(r) : f2b(r);
}

/* Pair p of the row at element src of X: (x, y) in the layout's order. */
APE_DEV void load_pair(const void *X, int64_t src, int p, int P, bool interleaved, int dt,
		       float &x, float &y)
{
	x = load_el(X, src + (interleaved ? 2 * p : p), dt);
	y = load_el(X, src + (interleaved ? 2 * p + 1 : p + P), dt);
}

/* 1 when a pair of this lane's share of the f16 row at src has x^2 + y^2 > 65504^2, which a
 * rotation could take past f16's range (sep_args.h); else 0. */
APE_DEV int lane_big(const void *X, int64_t src, int P, bool interleaved, int lane)
{
	int big = 0;

	for (int p = lane; p < P; p += 32) {
		float x, y;

		load_pair(X, src, p, P, interleaved, APE_CU_F16, x, y);
		big |= (double)x * x + (double)y * y > APE_SEP_F16_BIG2;
	}
	return big;
}

/* The row at src of X rotated at `at`, times `shrink` (1 or APE_SEP_F16_SHRINK), into dst as
 * hi and lo; returns this lane's share of |x|^2 (float64). */
APE_DEV double rot_row(const ape_cu_sep_rot_args &a, const void *X, int64_t src, uint16_t *dst,
		       double at, float shrink, int lane)
{
	const int D = a.D, P = D / 2;
	double qq = 0.0;

	for (int p = lane; p < P; p += 32) {
		float x, y, c, s = ape_seed_sincos(at * a.omega[p], &c);

		load_pair(X, src, p, P, a.interleaved, a.dt, x, y);
		split(dst, p, D, (x * c - y * s) * shrink, a.dt);
		split(dst, P + p, D, (x * s + y * c) * shrink, a.dt);
		qq += (double)x * x + (double)y * y;
	}
	return qq;
}

/* Blocks of query rows (one warp per row), then one block per key tile (see sep_args.h). */
APE_DEV void sep_rot(const ape_cu_sep_rot_args &a)
{
	constexpr int W = APE_CU_THREADS / 32;
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int64_t blk = a.block_base + block_linear();
	const int D = a.D, P = D / 2;
	const bool f16 = a.dt == APE_CU_F16;

	if (blk < a.nqb) {
		const int64_t rr = blk * W + warp, pos = rr % a.Lq, bh = rr / a.Lq;

		if (rr >= a.nq)
			return;
		const int64_t src = vrow(a.vq, bh / a.H, bh % a.H, pos);
		const void *X = reinterpret_cast<const void *>(a.q);
		const bool big = f16 && group_sum<32>(lane_big(X, src, P, a.interleaved, lane)) > 0;
		double qq = rot_row(a, X, src, reinterpret_cast<uint16_t *>(a.qr) + rr * 2 * D,
				    (double)(a.rel + pos), big ? APE_SEP_F16_SHRINK : 1.0f, lane);

		qq = group_sum<32>(qq);
		if (lane == 0) {
			reinterpret_cast<double *>(a.qn)[rr] = ape_norm_bound(qq);
			reinterpret_cast<float *>(a.qf)[rr] = big ? 1.0f / APE_SEP_F16_SHRINK : 1.0f;
		}
		return;
	}

	const int64_t kt = blk - a.nqb; /* (b, kv head) * ntk + tile */
	if (kt >= a.nbkv * a.ntk)
		return;
	const int64_t bkv = kt / a.ntk, b = bkv / a.Hkv, kvh = bkv % a.Hkv;
	const int64_t j0 = kt % a.ntk * APE_SEP_BK, len = imin(APE_SEP_BK, a.Lk - j0);
	const void *X = reinterpret_cast<const void *>(a.k);
	int big = 0;

	if (f16) { /* the whole tile halved when one of its keys asks (uniform over the block) */
		for (int64_t r = warp; r < len; r += W)
			big |= lane_big(X, vrow(a.vk, b, kvh, j0 + r), P, a.interleaved, lane);
		big = bar_or(big);
	}
	for (int64_t r = warp; r < len; r += W) {
		const int64_t j = j0 + r, rr = bkv * a.Lk + j;
		const int64_t vs = vrow(a.vv, b, kvh, j);
		const uint16_t *V = reinterpret_cast<const uint16_t *>(a.v);
		uint16_t *vd = reinterpret_cast<uint16_t *>(a.vr) + rr * D;

		rot_row(a, X, vrow(a.vk, b, kvh, j), reinterpret_cast<uint16_t *>(a.kr) + rr * 2 * D,
			(double)j, big ? APE_SEP_F16_SHRINK : 1.0f, lane);
		for (int d = lane; d < D; d += 32)
			vd[d] = V[vs + d];
	}
	if (threadIdx.x == 0)
		reinterpret_cast<float *>(a.kf)[kt] = big ? 1.0f / APE_SEP_F16_SHRINK : 1.0f;
}

template <int DM, int VT> struct Sep {
	static constexpr int BQ = APE_SEP_BQ, BK = APE_SEP_BK, ROW = APE_SEP_ROW(DM);
	static constexpr int KROW = APE_SEP_KROW(DM); /* K rows: hi, then lo */
	static constexpr int KS = DM / 16; /* k-steps of Q K^T */
	static constexpr int NT = BK / 8; /* 8-key tiles of S per warp */
	static constexpr int NO = DM / 8; /* 8-column tiles of O per warp */
	static constexpr int PROW = BK + 4;
	static constexpr int OFF_Q = 0; /* Q, later P of masked tiles */
	static constexpr int OFF_K = APE_SEP_QBYTES(DM) > APE_SEP_PBYTES ? APE_SEP_QBYTES(DM)
									  : APE_SEP_PBYTES;
	static constexpr int OFF_V = OFF_K + 2 * APE_SEP_KBYTES(DM);
	static constexpr int OFF_B = OFF_V + 2 * APE_SEP_VBYTES(DM);
	static constexpr int OFF_MISC = OFF_B + (BQ + BK) * 4;
	static constexpr int OFF_CROW = OFF_MISC + 16; /* c_row per row, float64 */
	static constexpr int OFF_QF = OFF_CROW + BQ * 8; /* the rows' factors (sep_args.h) */
	static constexpr int BYTES = OFF_QF + BQ * 4;
	static_assert(BYTES == APE_SEP_SMEM(DM), "sep_args.h and the kernel disagree");
	static_assert(OFF_K % 16 == 0 && OFF_V % 16 == 0 && OFF_MISC % 8 == 0, "alignment");
	static_assert(APE_CU_THREADS / 32 * 16 == BQ, "a warp per 16 rows");

	/* Key tile t (rotated K as hi and lo, V) into buffer buf; rows past Lk are zeros. */
	static APE_DEV void load_tile(const ape_cu_sep_args &a, unsigned char *sm, int64_t kvrow,
				      int64_t t, int buf)
	{
		constexpr int VR = DM / 8; /* 16-byte vectors per row */
		const int64_t j0 = t * BK;
		const int len = (int)imin(BK, a.Lk - j0);
		const uint16_t *kg = reinterpret_cast<const uint16_t *>(a.kr) + (kvrow + j0) * 2 * DM;
		const uint16_t *vg = reinterpret_cast<const uint16_t *>(a.vr) + (kvrow + j0) * DM;
		uint16_t *ks = reinterpret_cast<uint16_t *>(sm + OFF_K + buf * APE_SEP_KBYTES(DM));
		uint16_t *vs = reinterpret_cast<uint16_t *>(sm + OFF_V + buf * APE_SEP_VBYTES(DM));

		for (int e = threadIdx.x; e < BK * VR; e += APE_CU_THREADS) {
			const int j = e / VR, g = e % VR;
			const bool ok = j < len;

			cp_async16(ks + j * KROW + 8 * g, ok ? kg + j * 2 * DM + 8 * g : kg,
				   ok ? 16 : 0);
			cp_async16(ks + j * KROW + DM + 8 * g, ok ? kg + j * 2 * DM + DM + 8 * g : kg,
				   ok ? 16 : 0);
			cp_async16(vs + j * ROW + 8 * g, ok ? vg + j * DM + 8 * g : vg, ok ? 16 : 0);
		}
		cp_commit();
	}

	/* Half `half` (0: hi, 1: lo) of the block's rotated Q rows into the Q region, rows past Lq
	 * zeros (committed, not waited for). */
	static APE_DEV void load_q(const ape_cu_sep_args &a, unsigned char *sm, int64_t bh,
				   int64_t i0, int half)
	{
		constexpr int VR = DM / 8;
		const int64_t nrow = imin(BQ, a.Lq - i0);
		const uint16_t *qg =
			reinterpret_cast<const uint16_t *>(a.qr) + (bh * a.Lq + i0) * 2 * DM + half * DM;
		uint16_t *qs = reinterpret_cast<uint16_t *>(sm + OFF_Q);

		for (int e = threadIdx.x; e < BQ * VR; e += APE_CU_THREADS) {
			const int r = e / VR, g = e % VR;
			const bool ok = r < nrow;

			cp_async16(qs + r * ROW + 8 * g, ok ? qg + r * 2 * DM + 8 * g : qg, ok ? 16 : 0);
		}
		cp_commit();
	}

	/* The bias of the block-tile's BQ + BK - 1 distances, (bias - bias(aref) + T) * log2(e)
	 * with aref its smallest |n| and T head h's distance-bias table entry (0 without a table);
	 * bias(aref) in float64 to bref, the key tile's factor after it. */
	static APE_DEV void tables(const ape_cu_sep_args &a, unsigned char *sm, int64_t t,
				   int64_t i0, int64_t bkv, const float hp[4], int h)
	{
		float *bt = reinterpret_cast<float *>(sm + OFF_B);
		const float *trow = bias_row(a.bias, h);
		const int64_t nbase = a.rel + i0 - t * BK;
		/* past the problem's rows or keys: saturated, never used */
		const int64_t aref =
			ape_min_abs(ape_sat_add(nbase, -(BK - 1)), ape_sat_add(nbase, BQ - 1));

		for (int e = threadIdx.x; e < BQ + BK - 1; e += APE_CU_THREADS) {
			const int64_t an = ape_abs_dist(ape_sat_add(nbase, e - (BK - 1)));
			float bd = ape_bias_diff_f(hp[0], hp[1], hp[2], an, aref);

			if (trow)
				bd += trow[ape_bias_index(an, a.bias.len)];
			bt[e] = bd * (float)APE_LOG2E;
		}
		if (threadIdx.x == 0) {
			*reinterpret_cast<double *>(sm + OFF_MISC) =
				ape_bias((double)hp[0], hp[1], hp[2], (double)aref);
			*reinterpret_cast<float *>(sm + OFF_MISC + 8) =
				reinterpret_cast<const float *>(a.kf)[bkv * a.ntk + t];
		}
	}

	static APE_DEV float vget(const uint16_t *vs, int j, int col)
	{
		const uint16_t h = vs[j * ROW + col];

		return VT == APE_CU_F16 ? h2f(h) : b2f(h);
	}

	static APE_DEV void run(const ape_cu_sep_args &a)
	{
		unsigned char *sm = smem_base();
		const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
		const int64_t BH = (int64_t)a.B * a.H;
		const int64_t blk = a.block_base + block_linear();

		if (blk >= a.nqt * BH)
			return;

		const int64_t qt = a.nqt - 1 - blk / BH; /* the heaviest (causal: last) tiles first */
		const int64_t bh = blk % BH;
		const int h = (int)(bh % a.H);
		const int64_t b = bh / a.H, kvh = h / (a.H / a.Hkv);
		const int64_t bkv = b * a.Hkv + kvh, kvrow = bkv * a.Lk;
		const int64_t i0 = qt * BQ, Lq = a.Lq, Lk = a.Lk, rel = a.rel, ntk = a.ntk;
		const bool causal = a.flags & APE_CU_F_CAUSAL;
		const bool skip = causal && (a.flags & APE_CU_F_SKIP) && a.tol > 0 && a.pre;
		const float sl2 = (float)(a.scale * APE_LOG2E);
		const int ra = warp * 16 + (lane >> 2); /* this lane's rows: ra and ra + 8 */
		const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;
		float hp[4];

#pragma unroll
		for (int k = 0; k < 4; k++)
			hp[k] = a.hp[4 * h + k];

		/* ---- Q's hi half into shared memory (rows past Lq: zeros); fragments below */
		load_q(a, sm, bh, i0, 0);

		/* c_row of the block's rows, in shared memory (registers are scarce at D = 128) */
		double *crow = reinterpret_cast<double *>(sm + OFF_CROW);
		float *qfac = reinterpret_cast<float *>(sm + OFF_QF);

		for (int r = tid; r < BQ; r += APE_CU_THREADS) {
			crow[r] = ape_bias((double)hp[0], hp[1], hp[2],
					   (double)ape_anchor_distance(ape_sat_add(rel, i0 + r), Lk,
								       causal));
			qfac[r] = i0 + r < Lq ? reinterpret_cast<const float *>(a.qf)[bh * Lq + i0 + r]
					      : 1.0f;
		}

		float o[NO][4], m[2] = { -APE_INF, -APE_INF }, l[2] = { 0.0f, 0.0f };
		uint32_t qf[KS][4], ql[KS][4]; /* Q's fragments: hi, lo */

#pragma unroll
		for (int n = 0; n < NO; n++)
			o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

		const int64_t ilast = imin(i0 + BQ, Lq) - 1;
		int64_t t, tlo = 0, thi = -1;

		if (causal && rel + ilast < 0) {
			cp_wait<0>();
			bar(); /* crow */
			finish(a, bh, i0, 0, 0, m, l, crow, o, lane, ra);
			return; /* no row of the tile sees any key */
		}
		t = causal ? imin(rel + ilast, Lk - 1) / BK : 0;
		tlo = thi = t;
		tables(a, sm, t, i0, bkv, hp, h);
		load_tile(a, sm, kvrow, t, 0);
		cp_wait<0>();
		bar(); /* Q's hi half, the first tile and its table */
#pragma unroll
		for (int ks = 0; ks < KS; ks++)
			ldsm_x4(qf[ks], sm + OFF_Q + ((warp * 16 + lr) * ROW + ks * 16 + lc) * 2);
		bar();
		load_q(a, sm, bh, i0, 1);
		cp_wait<0>();
		bar(); /* Q's lo half */
#pragma unroll
		for (int ks = 0; ks < KS; ks++)
			ldsm_x4(ql[ks], sm + OFF_Q + ((warp * 16 + lr) * ROW + ks * 16 + lc) * 2);
		bar(); /* the Q region becomes the masked tiles' P */

		int buf = 0;
		for (;;) {
			const int64_t next = causal ? t - 1 : (t + 1 < ntk ? t + 1 : -1);

			if (next >= 0)
				load_tile(a, sm, kvrow, next, buf ^ 1);

			const int64_t j0 = t * BK;
			const int len = (int)imin(BK, Lk - j0);
			const int64_t nbase = rel + i0 - j0; /* n of (row 0, key 0) */
			const bool masked = causal && ape_sat_sub(nbase, BK - 1) < 0;
			const unsigned char *ks = sm + OFF_K + buf * APE_SEP_KBYTES(DM);
			const uint16_t *vs =
				reinterpret_cast<const uint16_t *>(sm + OFF_V + buf * APE_SEP_VBYTES(DM));
			const float *bt = reinterpret_cast<const float *>(sm + OFF_B);
			const double bref = *reinterpret_cast<const double *>(sm + OFF_MISC);
			const float kfac = *reinterpret_cast<const float *>(sm + OFF_MISC + 8);
			float s[NT][4];

			/* ---- S = Qhi Khi + Qhi Klo + Qlo Khi on tensor cores */
#pragma unroll
			for (int n = 0; n < NT; n++)
				s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
			for (int np = 0; np < NT / 2; np++) {
#pragma unroll
				for (int kk = 0; kk < KS; kk++) {
					const unsigned char *kp =
						ks + ((np * 16 + (lane & 7) + (lane >> 4) * 8) * KROW + kk * 16 +
						      ((lane >> 3) & 1) * 8) * 2;
					uint32_t kh[4], kl[4];

					ldsm_x4(kh, kp);
					ldsm_x4(kl, kp + DM * 2);
					mma16816<VT>(s[2 * np], qf[kk], kh[0], kh[1]);
					mma16816<VT>(s[2 * np + 1], qf[kk], kh[2], kh[3]);
					mma16816<VT>(s[2 * np], qf[kk], kl[0], kl[1]);
					mma16816<VT>(s[2 * np + 1], qf[kk], kl[2], kl[3]);
					mma16816<VT>(s[2 * np], ql[kk], kh[0], kh[1]);
					mma16816<VT>(s[2 * np + 1], ql[kk], kh[2], kh[3]);
				}
			}

			/* ---- scale, bias, masks; one online-softmax update per row */
			float corr[2];

#pragma unroll
			for (int x = 0; x < 2; x++) {
				const int r = ra + 8 * x;
				const float shift = (float)((bref - crow[r]) * APE_LOG2E);
				/* halved f16 rows and tiles (sep_rot): exact powers of two, 1 otherwise */
				const float sr = sl2 * qfac[r] * kfac;
				float mt = m[x], lsum = 0.0f;

#pragma unroll
				for (int n = 0; n < NT; n++)
#pragma unroll
					for (int y = 0; y < 2; y++) {
						const int j = 8 * n + 2 * (lane & 3) + y;
						const float d = s[n][2 * x + y];
						float v = fmaf(d, sr, bt[r - j + BK - 1] + shift);

						/* a NaN or Inf input must not vanish into a zero weight */
						v = isfinite(d) ? v : APE_NAN;
						if (j >= len ||
						    (causal && ape_sat_add(nbase, r) < j))
							v = -APE_INF;
						s[n][2 * x + y] = v;
						mt = fmaxf(mt, v); /* ignores NaN: ex2 keeps it */
					}
				mt = group_max<4>(mt);
				corr[x] = m[x] == -APE_INF ? 0.0f : ex2(m[x] - mt);
#pragma unroll
				for (int n = 0; n < NT; n++)
#pragma unroll
					for (int y = 0; y < 2; y++) {
						const float v = s[n][2 * x + y];
						const float p = v == -APE_INF ? 0.0f : ex2(v - mt);

						s[n][2 * x + y] = p;
						lsum += p;
					}
				l[x] = fmaf(l[x], corr[x], lsum); /* this lane's share */
				m[x] = mt;
			}
#pragma unroll
			for (int n = 0; n < NO; n++) {
				o[n][0] *= corr[0];
				o[n][1] *= corr[0];
				o[n][2] *= corr[1];
				o[n][3] *= corr[1];
			}

			/* ---- O += P V */
			if (!masked) {
#pragma unroll
				for (int kk = 0; kk < BK / 16; kk++) {
					const uint32_t pf[4] = {
						pack2<VT>(s[2 * kk][0], s[2 * kk][1]),
						pack2<VT>(s[2 * kk][2], s[2 * kk][3]),
						pack2<VT>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
						pack2<VT>(s[2 * kk + 1][2], s[2 * kk + 1][3]),
					};

#pragma unroll
					for (int np = 0; np < NO / 2; np++) {
						uint32_t vf[4];

						ldsm_x4_trans(vf, reinterpret_cast<const unsigned char *>(vs) +
									  ((kk * 16 + lr) * ROW + np * 16 + lc) * 2);
						mma16816<VT>(o[2 * np], pf, vf[0], vf[1]);
						mma16816<VT>(o[2 * np + 1], pf, vf[2], vf[3]);
					}
				}
			} else {
				/* the warp's P in float32, then per element with the mask */
				float *ps = reinterpret_cast<float *>(sm + OFF_Q) + warp * 16 * PROW;
				const int r0 = lane >> 2;

#pragma unroll
				for (int n = 0; n < NT; n++)
#pragma unroll
					for (int y = 0; y < 2; y++) {
						const int j = 8 * n + 2 * (lane & 3) + y;

						ps[r0 * PROW + j] = s[n][y];
						ps[(r0 + 8) * PROW + j] = s[n][2 + y];
					}
				warp_sync();
				for (int j = 0; j < len; j++) {
					const float pa = ps[r0 * PROW + j], pb = ps[(r0 + 8) * PROW + j];
					const bool va = ape_sat_add(nbase, ra) >= j; /* n >= 0 */
					const bool vb = ape_sat_add(nbase, ra + 8) >= j;

#pragma unroll
					for (int n = 0; n < NO; n++) {
						const int col = 8 * n + 2 * (lane & 3);
						const float v0 = vget(vs, j, col), v1 = vget(vs, j, col + 1);

						o[n][0] = fmaf(pa, va ? v0 : 0.0f, o[n][0]);
						o[n][1] = fmaf(pa, va ? v1 : 0.0f, o[n][1]);
						o[n][2] = fmaf(pb, vb ? v0 : 0.0f, o[n][2]);
						o[n][3] = fmaf(pb, vb ? v1 : 0.0f, o[n][3]);
					}
				}
				warp_sync();
			}
			tlo = imin(tlo, t);
			thi = imax(thi, t);

			/* ---- far keys (causal, walking backward): the block stops once every row
			 * may leave out the keys before this tile */
			bool stop = next < 0;

			if (skip && !stop) {
				const float kmax = reinterpret_cast<const float *>(a.pre)[bkv * (ntk + 1) + t];
				int cannot = 0;

#pragma unroll
				for (int x = 0; x < 2; x++) {
					const float lrow = group_sum<4>(l[x]);
					const int64_t i = i0 + ra + 8 * x;
					const int64_t diag = ape_sat_add(rel, i);
					const int64_t cnt = ape_visible_keys(diag, j0, causal);

					if (i < Lq && (lane & 3) == 0 && cnt > 0 &&
					    !may_stop(hp, a.bias, h, fabs(a.scale),
						      reinterpret_cast<const double *>(a.qn)[bh * Lq + i],
						      kmax, ape_keys_min_abs(diag, 0, cnt), cnt,
						      crow[ra + 8 * x],
						      m[x], lrow, -APE_INF, a.tol))
						cannot = 1;
				}
				stop = !bar_or(cannot);
			} else {
				bar(); /* every warp is done with this tile's table and buffers */
			}
			if (stop) {
				cp_wait<0>(); /* nothing may land after the block is gone */
				break;
			}
			tables(a, sm, next, i0, bkv, hp, h);
			cp_wait<0>();
			bar(); /* the next tile and its table */
			t = next;
			buf ^= 1;
		}
		finish(a, bh, i0, tlo * BK, imin((thi + 1) * BK, Lk), m, l, crow, o, lane, ra);
	}

	/* LSE, pairs (keys [jbeg, jend) were computed) and O = acc / l per row; O = 0 in a row
	 * with l = 0 (no key): even a masked key's 0 * V must not reach it. */
	static APE_DEV void finish(const ape_cu_sep_args &a, int64_t bh, int64_t i0, int64_t jbeg,
				   int64_t jend, const float (&m)[2], const float (&l)[2],
				   const double *crow, float (&o)[NO][4], int lane, int ra)
	{
		const bool causal = a.flags & APE_CU_F_CAUSAL;
		const int b = (int)(bh / a.H), h = (int)(bh % a.H);

#pragma unroll
		for (int x = 0; x < 2; x++) {
			const float lrow = group_sum<4>(l[x]);
			const float inv = lrow == 0.0f ? 0.0f : 1.0f / lrow; /* NaN stays NaN */
			const int64_t i = i0 + ra + 8 * x;

			if (i >= a.Lq)
				continue;
			if ((lane & 3) == 0 && a.lse)
				reinterpret_cast<float *>(a.lse)[vrow(a.vlse, b, h, i)] =
					lrow > 0.0f ? (float)(crow[ra + 8 * x] + ((double)m[x] + log2((double)lrow)) *
									  APE_LN2)
					: lrow == 0.0f ? -APE_INF
						       : APE_NAN;
			if ((lane & 3) == 0 && a.pairs) {
				const int64_t diag = a.rel + i;
				const int64_t seen =
					ape_row_visible_pairs(diag, jbeg, jend, causal);

				reinterpret_cast<uint64_t *>(a.pairs)[bh * a.Lq + i] = (uint64_t)seen;
			}
			const int64_t orow = vrow(a.vo, b, h, i);
			void *out = reinterpret_cast<void *>(a.o);

#pragma unroll
			for (int n = 0; n < NO; n++) {
				const int col = 8 * n + 2 * (lane & 3);
				const float v0 = inv == 0.0f ? 0.0f : o[n][2 * x] * inv;
				const float v1 = inv == 0.0f ? 0.0f : o[n][2 * x + 1] * inv;

				if (a.flags & APE_CU_F_O_SCALAR) {
					store_el(out, orow + col, v0, a.dt_out);
					store_el(out, orow + col + 1, v1, a.dt_out);
				} else {
					store_el2(out, orow + col, v0, v1, a.dt_out);
				}
			}
		}
	}
};

} /* namespace ape */

extern "C" __global__ void __launch_bounds__(APE_CU_THREADS)
	ape_sep_rot(const struct ape_cu_sep_rot_args a)
{
	ape::sep_rot(a);
}
APE_EMU_REGISTER(ape_sep_rot, struct ape_cu_sep_rot_args)

#define APE_SEP(name, dm, vt)                                                                      \
	extern "C" __global__ void __launch_bounds__(APE_CU_THREADS, 1)                           \
		name(const struct ape_cu_sep_args a)                                               \
	{                                                                                          \
		ape::Sep<dm, vt>::run(a);                                                          \
	}                                                                                          \
	APE_EMU_REGISTER(name, struct ape_cu_sep_args)

APE_SEP(ape_sep_d64_f16, 64, APE_CU_F16)
APE_SEP(ape_sep_d64_bf16, 64, APE_CU_BF16)
APE_SEP(ape_sep_d128_f16, 128, APE_CU_F16)
APE_SEP(ape_sep_d128_bf16, 128, APE_CU_BF16)
