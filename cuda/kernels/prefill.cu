/* SPDX-License-Identifier: MIT */
/*
 * The fused APE prefill kernel (docs/kernels.md, "CUDA"): FlashAttention-2 structure, one block
 * of 256 threads per (query tile, batch, head), key tiles walked from the diagonal outward.
 *
 * Why QK^T is not a matrix product here: the score of (i, j) rotates pair p of q_i by
 * n * omega_p / alpha_i, and alpha_i depends on the query row, so no one rotation of the keys
 * serves every row of a tile (as it does in RoPE). Each (row, key, pair) needs its own rotation;
 * the kernel computes it with the exact-seed recurrence on CUDA cores: per key and pair two FMAs
 * for the dot product and four operations to turn the query by one step. P V has no such
 * coupling and runs on tensor cores (mma.sync m16n8k16, f16 or bf16 operands matching the
 * storage, float32 accumulators); float32 storage keeps float32 arithmetic end to end (FFMA),
 * since tf32 (10-bit mantissa) would miss the spec's 1e-4 max|V| on one-hot rows.
 *
 * Tile shapes (args.h): 256 threads; a query row is shared by TPR = DMAX / 16 threads, each owning
 * 8 pairs of its rotated query, its rotation step and its query pairs in registers; BQ = 256 / TPR
 * rows per block (64 at D = 64, 32 at 128, 16 at 256). Key tiles of BK = 64 keys (32 at D = 256,
 * where two 64-key float32 K tiles and V tiles would not fit next to each other): the recurrence
 * restarts from an exact float64 seed at every tile, so its drift stays below the accuracy budget.
 * K arrives as float32 pairs (ape_prep converts f16/bf16 and the interleaved layout once per call:
 * converting per use would add a third to the inner loop), V in its storage type; both are copied
 * with cp.async into double buffers while the previous tile computes. The same shapes serve sm_80
 * and sm_90a: the inner loop is bound by FP32 issue on both (Hopper doubles the FP32 units per SM
 * and the tile work with them), one 256-thread block per SM (about 190 registers per thread: the
 * query state), and the shared memory (at most ~150 KB, float32 V at D = 128) fits A100's 163 KB
 * as well as H100's 227 KB.
 *
 * Per tile: (1) scores: each thread dots its pairs against every key of the tile, partial sums
 * are reduce-scattered across the row's TPR lanes (each lane keeps BK / TPR keys), then scaled by
 * the per-distance temperature and bias of a shared table (which also holds the distance-bias
 * table's entries, when the launch has one); (2) one online-softmax update per
 * tile per row (log2 units, in the row's shifted frame); P goes to shared memory; (3) each warp
 * multiplies its 16 rows x CW columns of O by P V. Tiles cut by the causal diagonal mask per
 * pair; a masked key must add nothing at all (not 0 * V: V may hold a NaN the row must not
 * receive), so when such a tile's V holds a non-finite value, P V runs on CUDA cores with the
 * mask applied per element instead of on tensor cores.
 *
 * A ragged launch (args.h, segt) gives each block one entry of its segment table: the block's
 * rows are one segment's query tile, its keys that segment's, its distances the segment's, and
 * the code is the dense one with those bases (a segment without keys writes O = 0, LSE = -inf).
 *
 * Keys read in place (args.h, struct ape_cu_pages; cuda_attention.c): where the kernel reads K
 * or V itself rather than ape_prep's copy (APE_PF_K_PAGES, APE_PF_V_PAGES), the tile copy finds
 * each key's row through the pages (key_at()); rows the host could not prove 16-byte aligned
 * are copied with plain loads where misaligned (copy_row16()). The tiles hold the same bytes as
 * for the keys gathered, so everything after the copy is unchanged.
 *
 * With skipping, a row may leave out every key of the launch before the walk when the LSE that
 * earlier launches found (lse_prior) already outweighs them all (ape_may_skip()); it then scores
 * nothing and holds no vote, and a block whose rows all may returns at once.
 */
#include "common.cuh"

namespace ape {

template <int DMAX> struct PfShape {
	static constexpr int NTH = APE_CU_THREADS;
	static constexpr int TPR = APE_PF_TPR(DMAX);
	static constexpr int PT = DMAX / 2 / TPR; /* pairs per thread: 8 */
	static constexpr int BQ = APE_PF_BQ(DMAX);
	static constexpr int BK = APE_PF_BK(DMAX);
	static constexpr int SB = TPR > 8 ? TPR : 8; /* keys per score sub-block */
	static constexpr int KPS = SB / TPR; /* keys a lane keeps per sub-block */
	static constexpr int KPT = BK / TPR; /* keys a lane keeps per tile */
	static constexpr int NVEC = 2 * PT / 4; /* 16-byte vectors of one lane's K chunk */
	static constexpr int RGS = BQ / 16; /* P V: row groups of 16 */
	static constexpr int CGS = (NTH / 32) / RGS; /* P V: column groups */
	static constexpr int CW = DMAX / CGS; /* P V: columns per warp */
	static constexpr int NTL = CW / 8; /* P V: 8-column tiles per warp */
	static constexpr int TBL = BQ + BK; /* distance table entries (BQ + BK - 1 used) */
	static_assert((TPR & (TPR - 1)) == 0, "TPR is a power of two");
	static_assert(PT % 4 == 0, "a 16-byte K vector must not straddle two lanes' chunks");
	static_assert(RGS * CGS == NTH / 32 && NTL % 2 == 0, "P V warp tiling");
	static_assert(SB % TPR == 0 && BK % SB == 0, "score sub-blocks");
};

template <int DMAX, int VT> struct PfSmem {
	using S = PfShape<DMAX>;
	static constexpr int VESZ = APE_PF_VESZ(VT);
	static constexpr int VROW = APE_PF_VROW(DMAX, VT);
	static constexpr int PROW = APE_PF_PROW(DMAX, VT);
	static constexpr int K_BYTES = S::BK * DMAX * 4;
	static constexpr int V_BYTES = S::BK * VROW * VESZ;
	static constexpr int P_BYTES = S::BQ * PROW * VESZ;
	static constexpr int OFF_K = 0;
	static constexpr int OFF_V = OFF_K + 2 * K_BYTES;
	static constexpr int OFF_P = OFF_V + 2 * V_BYTES;
	/* float32 scores: the P tile itself for float32 storage (same row stride) */
	static constexpr int SROW = APE_PF_SROW(DMAX);
	static constexpr int OFF_S = VT == APE_CU_F32 ? OFF_P : OFF_P + P_BYTES;
	static constexpr int OFF_T = OFF_P + P_BYTES + APE_PF_SBYTES(DMAX, VT);
	static constexpr int OFF_B = OFF_T + S::TBL * 4;
	static constexpr int OFF_CORR = OFF_B + S::TBL * 4;
	static constexpr int OFF_LINV = OFF_CORR + S::BQ * 4;
	static constexpr int OFF_MISC = OFF_LINV + S::BQ * 4; /* bref, flags[2] */
	static constexpr int OFF_OMEGA = OFF_MISC + 64; /* omega_p, PMAX doubles */
	static constexpr int BYTES = OFF_OMEGA + DMAX * 4;
	static_assert(BYTES == APE_PF_SMEM(DMAX, VT), "args.h and the kernel disagree");
	static_assert(OFF_V % 16 == 0 && OFF_P % 16 == 0 && OFF_S % 16 == 0 && OFF_T % 16 == 0 &&
			      OFF_MISC % 16 == 0,
		      "16-byte alignment");
	static_assert(VT != APE_CU_F32 || PROW == SROW, "float32 scores live in the P tile");
};

/*
 * Partial sums of N keys on each of the lanes c of a row group become complete sums of N / (2 MK)
 * keys per lane: at each step the lanes whose bit MK is set keep the upper half of the current
 * keys and send the lower half to their partner (lane c ^ MK), which keeps the lower. Lane c
 * ends with keys [c * KPS, c * KPS + KPS) in part[0 .. KPS). Compile-time recursion: every index
 * is a constant, so part[] stays in registers.
 */
template <int N, int MK> APE_DEV void reduce_scatter(float *part, int c)
{
	if constexpr (MK >= 1) {
		const bool up = c & MK;

#pragma unroll
		for (int e = 0; e < N / 2; e++) {
			float keep = part[e], send = part[e + N / 2];

			swap_if(up, keep, send);
			part[e] = keep + shfl_xor(send, MK);
		}
		reduce_scatter<N / 2, MK / 2>(part, c);
	}
}

/* flags word bits (per tile, in shared memory) */
#define PF_NO_STOP_BACK 1
#define PF_NO_STOP_FWD 2
#define PF_V_NONFINITE 4

/* The order of key tiles: from the diagonal outward, alternating when both sides are open.
 * Every thread holds the same copy; decisions that change it are block-wide. */
struct Walk {
	int64_t lo, hi, ntk;
	bool back, fwd, next_back;

	APE_DEV int64_t peek() const
	{
		const bool ob = lo >= 0 && back, of = hi < ntk && fwd;

		if (ob && (next_back || !of))
			return lo;
		return of ? hi : -1;
	}

	APE_DEV int64_t next()
	{
		const bool ob = lo >= 0 && back, of = hi < ntk && fwd;

		if (ob && (next_back || !of)) {
			next_back = false;
			return lo--;
		}
		if (of) {
			next_back = true;
			return hi++;
		}
		return -1;
	}
};

/*
 * DIAG (the _diag kernels, docs/diagnostics.md): each lane also keeps its share of the two
 * running sums of the diagnostics, S1 = sum_j p_j x_j and S2 = sum_j p_j |n_j| (x_j the score
 * minus the row's maximum, log2 units like m and l), rescaled with l at every tile; finish()
 * sums the row's lanes and writes ENT and MD. Without DIAG none of that code exists.
 */
template <int DMAX, bool EXACT, int VT, bool DIAG> struct Prefill {
	using S = PfShape<DMAX>;
	using M = PfSmem<DMAX, VT>;
	static constexpr int TPR = S::TPR, PT = S::PT, BQ = S::BQ, BK = S::BK, SB = S::SB;
	static constexpr int KPS = S::KPS, KPT = S::KPT, NVEC = S::NVEC, NTL = S::NTL;
	static constexpr int PMAX = DMAX / 2;

	/* The element offset of the row of key `key` (the kv head's, from its key 0) in kp or vp,
	 * whose row stride is sl: key * sl, or where the pages put it when paged (K or V itself
	 * read in place: APE_PF_K_PAGES, APE_PF_V_PAGES; key_at()). */
	static APE_DEV int64_t row_at(const ape_cu_prefill_args &a, bool paged, int64_t sl,
				      int64_t key)
	{
		return paged ? key_at(a.c.pg, sl, key) : key * sl;
	}

	/* Copies key tile t (K float32 pairs, V) into buffer buf; rows past Lk (the block's keys:
	 * the launch's, or its segment's, from its key k0) become zeros. kb, vb: the element
	 * offsets of the kv head's key 0 in kp and vp. K or V read in place through the pages
	 * whose rows the host could not prove aligned (APE_CU_F_KV_CHECK): a misaligned row's
	 * bytes copied with plain loads (copy_row16()). */
	static APE_DEV void load_tile(const ape_cu_prefill_args &a, unsigned char *sm, int64_t kb,
				      int64_t vb, int64_t k0, int64_t t, int buf, int64_t Lk)
	{
		const int tid = threadIdx.x;
		const int64_t j0 = t * BK;
		const int len = (int)imin(BK, Lk - j0);
		const int64_t ksl = a.vkp.sl, vsl = a.vvp.sl;
		const bool kpg = a.paged & APE_PF_K_PAGES, vpg = a.paged & APE_PF_V_PAGES;
		const bool check = a.c.flags & APE_CU_F_KV_CHECK;
		const float *kg = reinterpret_cast<const float *>(a.kp) + kb;
		const unsigned char *vg =
			reinterpret_cast<const unsigned char *>(a.vp) + vb * M::VESZ;
		/* where a row past Lk reads its 0 bytes: the kv head's key 0 (aligned as every row
		 * is), or the buffer's start where the pages may not be (as the decode) */
		const void *kz = kpg ? reinterpret_cast<const void *>(a.kp) : kg;
		const void *vz = vpg ? reinterpret_cast<const void *>(a.vp) : vg;
		float *ks = reinterpret_cast<float *>(sm + M::OFF_K + buf * M::K_BYTES);
		unsigned char *vs = sm + M::OFF_V + buf * M::V_BYTES;
		constexpr int KV4 = DMAX / 4; /* 16-byte vectors per K row */
		constexpr int VV = DMAX * M::VESZ / 16; /* ... per V row */

		/* K row: [u_0 .. u_PMAX-1 | w_0 .. w_PMAX-1] becomes, per lane chunk cc (pairs
		 * cc*PT ..), u then w, its 16-byte vectors XOR-swizzled by the chunk so that the
		 * TPR lanes of a row read different banks */
		for (int e = tid; e < BK * KV4; e += S::NTH) {
			const int j = e / KV4, g = e % KV4;
			const bool wpart = g >= PMAX / 4;
			const int p0 = 4 * (wpart ? g - PMAX / 4 : g);
			const int cc = p0 / PT;
			const int k = (wpart ? NVEC / 2 : 0) + (p0 % PT) / 4;
			float *dst = ks + j * DMAX + cc * 2 * PT + 4 * (k ^ (cc % NVEC));
			const int64_t kr = j < len ? row_at(a, kpg, ksl, k0 + j0 + j) : 0;

			copy_row16(dst, kg + kr + 4 * g, kz, j < len, kpg && check);
		}
		for (int e = tid; e < BK * VV; e += S::NTH) {
			const int j = e / VV, g = e % VV;
			unsigned char *dst = vs + (j * M::VROW) * M::VESZ + 16 * g;
			const int64_t vr = j < len ? row_at(a, vpg, vsl, k0 + j0 + j) : 0;

			copy_row16(dst, vg + vr * M::VESZ + 16 * g, vz, j < len, vpg && check);
		}
		cp_commit();
	}

	/* The tile's per-distance tables: scale * temp * log2(e), and (bias - bias(aref) + T) *
	 * log2(e) where aref is the block-tile's smallest |n| (its bias, in float64, goes to bref)
	 * and T head h's distance-bias table entry (0 without a table: a tile's cost, never a
	 * pair's). rel: the block's distance of (row 0, key 0) (the launch's, or its segment's). */
	static APE_DEV void tables(const ape_cu_prefill_args &a, unsigned char *sm, int64_t t,
				   int64_t i0, const float hp[4], int h, int64_t rel)
	{
		float *tt = reinterpret_cast<float *>(sm + M::OFF_T);
		float *bt = reinterpret_cast<float *>(sm + M::OFF_B);
		const float *trow = bias_row(a.c.bias, h);
		const int64_t nbase = rel + i0 - t * BK; /* n of (row 0, key 0) */
		/* past the problem's rows or keys: saturated, never used */
		const int64_t aref =
			ape_min_abs(ape_sat_add(nbase, -(BK - 1)), ape_sat_add(nbase, BQ - 1));
		const float sl2 = (float)(a.c.scale * APE_LOG2E);

		for (int e = threadIdx.x; e < BQ + BK - 1; e += S::NTH) {
			const int64_t an = ape_abs_dist(ape_sat_add(nbase, e - (BK - 1)));

			float bd = ape_bias_diff_f(hp[0], hp[1], hp[2], an, aref);

			if (trow)
				bd += trow[ape_bias_index(an, a.c.bias.len)];
			tt[e] = ape_temp_f(sl2, hp[3], an);
			bt[e] = bd * (float)APE_LOG2E;
		}
		if (threadIdx.x == 0)
			*reinterpret_cast<double *>(sm + M::OFF_MISC) =
				ape_bias((double)hp[0], hp[1], hp[2], (double)aref);
	}

	static APE_DEV float pload(const unsigned char *ps, int row, int j)
	{
		if (VT == APE_CU_F32)
			return reinterpret_cast<const float *>(ps)[row * M::PROW + j];
		const uint16_t h = reinterpret_cast<const uint16_t *>(ps)[row * M::PROW + j];

		return VT == APE_CU_F16 ? h2f(h) : b2f(h);
	}

	static APE_DEV float2 vload2(const unsigned char *vs, int j, int col)
	{
		if (VT == APE_CU_F32)
			return reinterpret_cast<const float2 *>(vs)[(j * M::VROW + col) / 2];
		const uint32_t w = reinterpret_cast<const uint32_t *>(vs)[(j * M::VROW + col) / 2];

		if (VT == APE_CU_F16)
			return make_float2(h2f(half_of(w, 0)), h2f(half_of(w, 1)));
		return make_float2(b2f(half_of(w, 0)), b2f(half_of(w, 1)));
	}

	/*
	 * o += P V on CUDA cores for this warp's 16 rows and CW columns (mma fragment layout).
	 * MASKED: keys a row cannot see contribute nothing, not 0 * V.
	 */
	template <bool MASKED>
	static APE_DEV void pv_fma(float (&o)[NTL][4], const unsigned char *ps,
				   const unsigned char *vs, int ra, int col0, int len, int64_t n0a,
				   bool causal)
	{
		const int rb = ra + 8;
		const int64_t n0b = ape_sat_add(n0a, 8);

		for (int j = 0; j < len; j++) {
			const float pa = pload(ps, ra, j), pb = pload(ps, rb, j);
			const bool va = !MASKED || !causal || n0a >= j; /* n = n0 - j >= 0 */
			const bool vb = !MASKED || !causal || n0b >= j;

#pragma unroll
			for (int n = 0; n < NTL; n++) {
				const float2 v = vload2(vs, j, col0 + 8 * n);

				o[n][0] = fmaf(pa, va ? v.x : 0.0f, o[n][0]);
				o[n][1] = fmaf(pa, va ? v.y : 0.0f, o[n][1]);
				o[n][2] = fmaf(pb, vb ? v.x : 0.0f, o[n][2]);
				o[n][3] = fmaf(pb, vb ? v.y : 0.0f, o[n][3]);
			}
		}
	}

	/* o += P V on tensor cores: BK / 16 k-steps of NTL m16n8k16 products. */
	static APE_DEV void pv_mma(float (&o)[NTL][4], const unsigned char *ps,
				   const unsigned char *vs, int rg, int cg, int lane)
	{
		/* lanes 8m..8m+7 address the rows of matrix m: m & 1 selects rows +8, m >> 1 the
		 * second 8 columns (A) or the second 8-column tile (B) */
		const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = (lane >> 4) * 8;

#pragma unroll
		for (int ks = 0; ks < BK / 16; ks++) {
			uint32_t af[4];

			ldsm_x4(af, ps + ((rg * 16 + lr) * M::PROW + ks * 16 + lc) * 2);
#pragma unroll
			for (int np = 0; np < NTL / 2; np++) {
				uint32_t bf[4];

				ldsm_x4_trans(bf, vs + ((ks * 16 + lr) * M::VROW + cg * S::CW + np * 16 +
							lc) * 2);
				mma16816<VT>(o[2 * np], af, bf[0], bf[1]);
				mma16816<VT>(o[2 * np + 1], af, bf[2], bf[3]);
			}
		}
	}

	/* Packs this lane's KPS probabilities of one sub-block into the P tile. */
	static APE_DEV void pstore(unsigned char *ps, int r, int j, const float *p)
	{
		if (VT == APE_CU_F32) {
			float *dst = reinterpret_cast<float *>(ps) + r * M::PROW + j;
#pragma unroll
			for (int k = 0; k < KPS; k++)
				dst[k] = p[k];
		} else if (KPS % 2) {
			uint16_t *dst = reinterpret_cast<uint16_t *>(ps) + r * M::PROW + j;
#pragma unroll
			for (int k = 0; k < KPS; k++)
				dst[k] = VT == APE_CU_F16 ? f2h(p[k]) : f2b(p[k]);
		} else {
			uint32_t *dst = reinterpret_cast<uint32_t *>(ps) + (r * M::PROW + j) / 2;
#pragma unroll
			for (int k = 0; k < KPS; k += 2)
				dst[k / 2] = pack2<VT>(p[k], p[k + 1]);
		}
	}

	/* Any Inf or NaN among the first len rows of the V tile? (16-bit types: exponent all ones) */
	static APE_DEV bool v_nonfinite(const unsigned char *vs, int len)
	{
		constexpr int VW = M::VROW / 2; /* 32-bit words per padded row */
		const uint32_t em = VT == APE_CU_F16 ? 0x7c007c00u : 0x7f807f80u;
		bool bad = false;

		for (int e = threadIdx.x; e < len * (DMAX / 2); e += S::NTH) {
			const uint32_t w = reinterpret_cast<const uint32_t *>(vs)[(e / (DMAX / 2)) * VW +
										   e % (DMAX / 2)];

			bad |= (w & (em & 0xffffu)) == (em & 0xffffu) ||
			       (w & (em & 0xffff0000u)) == (em & 0xffff0000u);
		}
		return bad;
	}

	static APE_DEV void run(const ape_cu_prefill_args &a)
	{
		unsigned char *sm = smem_base();
		const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
		const int r = tid / TPR, c = tid % TPR; /* scores: query row in the tile, pair chunk */
		const int64_t BH = (int64_t)a.c.B * a.c.H;
		const int64_t blk = a.block_base + block_linear();

		if (blk >= a.nqt * BH)
			return; /* the grid's rounding: whole blocks only */

		/* the heaviest (causal: last) tiles first; a ragged launch's table is sorted so */
		const int64_t qt = a.segt ? blk / BH : a.nqt - 1 - blk / BH;
		const int64_t bh = blk % BH;
		const int h = (int)(bh % a.c.H);
		const int64_t b = bh / a.c.H, kvh = h / (a.c.H / a.c.Hkv);
		const int64_t bkv = b * a.c.Hkv + kvh;
		/* the block's rows and keys: the launch's, or (ragged) one segment's, rows i0 ..
		 * of its lq (launch rows q0 + i) against its lk keys from k0, at distance rel */
		const int64_t *seg = a.segt ? reinterpret_cast<const int64_t *>(a.segt) +
						      qt * APE_PF_SEGW
					    : nullptr;
		const int64_t q0 = seg ? seg[0] : 0, k0 = seg ? seg[2] : 0;
		const int64_t Lq = seg ? seg[1] : a.c.Lq, Lk = seg ? seg[3] : a.c.Lk;
		const int64_t rel = seg ? seg[4] : a.c.rel, i0 = seg ? seg[5] : qt * BQ;
		const int64_t kbase = vrow(a.vkp, b, kvh, 0), vbase = vrow(a.vvp, b, kvh, 0);
		const int D = EXACT ? DMAX : a.c.D, P = D / 2;
		const bool causal = a.c.flags & APE_CU_F_CAUSAL;
		const bool inter = a.c.flags & APE_CU_F_INTERLEAVED;
		const bool skip = (a.c.flags & APE_CU_F_SKIP) && a.c.tol > 0 && a.pre && a.suf;
		const int dt = a.c.dt_in;
		float hp[4];

		head_params(a.c, h, hp);
		for (int p = tid; p < PMAX; p += S::NTH)
			reinterpret_cast<double *>(sm + M::OFF_OMEGA)[p] =
				EXACT || p < P ? a.c.omega[p] : 0.0;

		/* ---- the query row of this lane's role: its pairs, sigma, alpha, steps, c_row */
		const int64_t i = i0 + r;
		const bool row_ok = i < Lq;
		const int64_t qrow = vrow(a.c.vq, b, h, q0 + (row_ok ? i : 0));
		const void *Q = reinterpret_cast<const void *>(a.c.q);
		float qx[PT], qy[PT], cw[PT], sw[PT];
		double sum = 0, ss = 0, qq = 0;

#pragma unroll
		for (int p = 0; p < PT; p++) {
			const int pg = c * PT + p;
			const bool ok = row_ok && (EXACT || pg < P);

			qx[p] = ok ? load_el(Q, qrow + (inter ? 2 * pg : pg), dt) : 0.0f;
			qy[p] = ok ? load_el(Q, qrow + (inter ? 2 * pg + 1 : pg + P), dt) : 0.0f;
			sum += (double)qx[p] + (double)qy[p];
		}
		sum = group_sum<TPR>(sum);
		{
			const double mean = sum / D;

#pragma unroll
			for (int p = 0; p < PT; p++) {
				const int pg = c * PT + p;
				const double x = qx[p], y = qy[p];

				if (EXACT || pg < P) /* padding pairs are not components of q */
					ss += (x - mean) * (x - mean) + (y - mean) * (y - mean);
				qq += x * x + y * y;
			}
		}
		ss = group_sum<TPR>(ss);
		qq = group_sum<TPR>(qq);
		const double ia = ape_inv_alpha(hp[3], ss, D);
		const double qnorm = ape_norm_bound(qq);
		const int64_t diag = ape_sat_add(rel, i); /* the key at n = 0 (padding: any) */
		const double crow = ape_bias((double)hp[0], hp[1], hp[2],
					     (double)ape_anchor_distance(diag, Lk, causal));

#pragma unroll
		for (int p = 0; p < PT; p++) {
			const int pg = c * PT + p;

			sw[p] = ape_seed_sincos((EXACT || pg < P ? a.c.omega[pg] : 0.0) * ia, &cw[p]);
		}

		/* ---- the walk */
		const int64_t ilast = imin(i0 + BQ, Lq) - 1;
		const int64_t ntk = seg ? (Lk + BK - 1) / BK : a.ntk;
		const int dir_count = causal ? 1 : 2;
		const double tol = skip ? a.c.tol : 0.0;
		float m = -APE_INF, l = 0.0f; /* this lane's share of l; m is the row's */
		float e1 = 0.0f, e2 = 0.0f; /* DIAG: this lane's shares of S1 and S2 */
		float o[NTL][4];
		int64_t t, tlo, thi;
		Walk w;

#pragma unroll
		for (int n = 0; n < NTL; n++)
			o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
		(void)dir_count;
		/* earlier launches' weight (lse_prior): a row whose keys here are all negligible
		 * against it scores nothing (its scores are -inf), writes O = 0, LSE = -inf and no
		 * pairs, and never holds the walk back; padding rows count as such rows */
		const float *prior = skip ? reinterpret_cast<const float *>(a.c.prior) : nullptr;
		const bool gone =
			prior && (!row_ok ||
				  may_stop(hp, a.c.bias, h, fabs(a.c.scale), qnorm,
					   reinterpret_cast<const float *>(a.pre)[bkv * (ntk + 1) + ntk],
					   ape_anchor_distance(diag, Lk, causal),
					   ape_visible_keys(diag, Lk, causal), crow, -APE_INF, 0.0f,
					   prior[bh * Lq + i] - crow, a.c.prior_tol));
		if (Lk == 0 || (causal && rel + ilast < 0) || (prior && !bar_or(!gone))) {
			finish(a, sm, bh, i0, 0, 0, m, l, e1, e2, crow, row_ok, gone, i, r, c, o, warp,
			       lane, diag, q0, Lq);
			return; /* no row of the tile sees any key, or needs one */
		}
		t = causal ? imin(rel + ilast, Lk - 1) / BK
			   : imax(imin(rel + (i0 + ilast) / 2, Lk - 1), 0) / BK;
		w.lo = t - 1;
		w.hi = t + 1;
		w.ntk = ntk;
		w.back = true;
		w.fwd = !causal;
		w.next_back = true;
		tlo = thi = t;

		int *flags = reinterpret_cast<int *>(sm + M::OFF_MISC + 8);
		int buf = 0, parity = 0;

		if (tid == 0)
			flags[0] = flags[1] = 0;
		tables(a, sm, t, i0, hp, h, rel);
		load_tile(a, sm, kbase, vbase, k0, t, 0, Lk);
		int64_t pred = w.peek();

		for (;;) {
			cp_wait<0>();
			bar(); /* S1: tile t and its tables are in shared memory */
			if (pred >= 0)
				load_tile(a, sm, kbase, vbase, k0, pred, buf ^ 1, Lk);

			/* ---- scores, softmax, P */
			const int64_t j0 = t * BK;
			const int len = (int)imin(BK, Lk - j0);
			const int64_t nbase = rel + i0 - j0;
			/* this row's n at the tile's first key */
			const int64_t n0 = ape_sat_add(nbase, r);
			const bool masked = len < BK || (causal && ape_sat_sub(nbase, BK - 1) < 0);
			const float *kt = reinterpret_cast<const float *>(sm + M::OFF_K + buf * M::K_BYTES) +
					  c * 2 * PT;
			const float *tt = reinterpret_cast<const float *>(sm + M::OFF_T);
			const float *bt = reinterpret_cast<const float *>(sm + M::OFF_B);
			unsigned char *ps = sm + M::OFF_P;
			const double bref = *reinterpret_cast<const double *>(sm + M::OFF_MISC);
			const float shift = (float)((bref - crow) * APE_LOG2E);
			float *ss = reinterpret_cast<float *>(sm + M::OFF_S);
			float xr[PT], yr[PT];

			const double nia = (double)n0 * ia;
			const double *om = reinterpret_cast<const double *>(sm + M::OFF_OMEGA) + c * PT;

#pragma unroll
			for (int p = 0; p < PT; p++) {
				float cs, sn = ape_seed_sincos(nia * om[p], &cs);

				xr[p] = qx[p] * cs - qy[p] * sn;
				yr[p] = qx[p] * sn + qy[p] * cs;
			}
			/* sub-blocks of SB keys: partial dot products of this lane's pairs, the query
			 * turned by one step per key; the loop over sub-blocks stays rolled (its body
			 * is SB * PT * 6 instructions already) */
#pragma unroll 1
			for (int sb = 0; sb < BK / SB; sb++) {
				float part[SB];

#pragma unroll
				for (int jj = 0; jj < SB; jj++) {
					const float *kr = kt + (sb * SB + jj) * DMAX;
					float s0 = 0.0f, s1 = 0.0f;

#pragma unroll
					for (int v4 = 0; v4 < NVEC / 2; v4++) {
						const float4 uv = *reinterpret_cast<const float4 *>(
							kr + 4 * (v4 ^ (c % NVEC)));
						const float4 wv = *reinterpret_cast<const float4 *>(
							kr + 4 * ((v4 + NVEC / 2) ^ (c % NVEC)));
#pragma unroll
						for (int q = 0; q < 4; q++) {
							const int p = 4 * v4 + q;
							const float u = (&uv.x)[q], wc = (&wv.x)[q];
							const float x = xr[p], y = yr[p];

							if (q & 1)
								s1 = fmaf(y, wc, fmaf(x, u, s1));
							else
								s0 = fmaf(y, wc, fmaf(x, u, s0));
							xr[p] = fmaf(x, cw[p], y * sw[p]);
							yr[p] = fmaf(y, cw[p], -(x * sw[p]));
						}
					}
					part[jj] = s0 + s1;
				}
				/* reduce-scatter over the row's lanes: lane c keeps keys
				 * [c*KPS, c*KPS + KPS) of the sub-block */
				reduce_scatter<SB, TPR / 2>(part, c);
#pragma unroll
				for (int k = 0; k < KPS; k++) {
					const int j = sb * SB + c * KPS + k;
					const int e = r - j + BK - 1;
					const float d = part[k];
					float s = fmaf(d, tt[e], bt[e] + shift);

					/* a NaN or Inf input must not vanish into a zero weight */
					s = isfinite(d) ? s : APE_NAN;
					if (j >= len || (causal && n0 < j) || gone)
						s = -APE_INF;
					ss[r * M::SROW + j] = s;
				}
			}
			/* one online-softmax update per tile and row, log2 units; a lane reads back the
			 * scores it wrote itself (no barrier needed) */
			{
				float sv[KPT], mt = m, lsum = 0.0f, corr;

#pragma unroll
				for (int sb = 0; sb < BK / SB; sb++)
#pragma unroll
					for (int k = 0; k < KPS; k++)
						sv[sb * KPS + k] = ss[r * M::SROW + sb * SB + c * KPS + k];
#pragma unroll
				for (int k = 0; k < KPT; k++)
					mt = fmaxf(mt, sv[k]); /* ignores NaN: exp() keeps it */
				mt = group_max<TPR>(mt);
				corr = m == -APE_INF ? 0.0f : ex2(m - mt);
				if constexpr (DIAG) {
					/* ape/ape_math.h: nothing yet (corr 0) stays 0 */
					const float nf = (float)n0; /* n of the tile's first key */

					e1 = corr > 0.0f ? APE_DIAG_RESCALE_S1(e1, l, corr, m - mt) : 0.0f;
					e2 *= corr;
#pragma unroll
					for (int k = 0; k < KPT; k++) {
						const int j = (k / KPS) * SB + c * KPS + k % KPS;
						const float x = sv[k] - mt;

						sv[k] = sv[k] == -APE_INF ? 0.0f : ex2(x);
						lsum += sv[k];
						e1 += ape_diag_s1_term_f(sv[k], x);
						e2 = fmaf(sv[k], fabsf(nf - (float)j), e2);
					}
				} else {
#pragma unroll
					for (int k = 0; k < KPT; k++) {
						sv[k] = sv[k] == -APE_INF ? 0.0f : ex2(sv[k] - mt);
						lsum += sv[k];
					}
				}
				l = fmaf(l, corr, lsum);
				m = mt;
#pragma unroll
				for (int sb = 0; sb < BK / SB; sb++)
					pstore(ps, r, sb * SB + c * KPS, sv + sb * KPS);
				if (c == 0)
					reinterpret_cast<float *>(sm + M::OFF_CORR)[r] = corr;
			}

			/* ---- votes: may every row stop a direction? (and a non-finite V) */
			const bool can_back = skip && w.lo >= 0 && w.back;
			const bool can_fwd = skip && w.hi < ntk && w.fwd;
			{
				const float lrow = (can_back || can_fwd) ? group_sum<TPR>(l) : 0.0f;
				int vote = 0;

				if ((can_back || can_fwd) && row_ok && !gone && c == 0) {
					const double as = fabs(a.c.scale);
					/* the scans run over the launch's key tiles (a.ntk); a segment's
					 * keys before (after) one of its tile borders lie among the
					 * launch's tiles before (from) the one holding that key, whose
					 * largest norm bounds theirs (k0 = 0: the border's own tile) */
					const int64_t kb = bkv * (a.ntk + 1);

					if (can_back) {
						const int64_t cnt =
							ape_visible_keys(diag, (w.lo + 1) * BK, causal);
						const int64_t gt = (k0 + (w.lo + 1) * BK + BK - 1) / BK;

						if (!may_stop(hp, a.c.bias, h, as, qnorm,
							      reinterpret_cast<const float *>(a.pre)[kb + gt],
							      ape_keys_min_abs(diag, 0, cnt), cnt, crow, m,
							      lrow,
							      -APE_INF, tol / dir_count))
							vote |= PF_NO_STOP_BACK;
					}
					if (can_fwd) {
						const int64_t cnt = Lk - w.hi * BK;
						const int64_t gt = (k0 + w.hi * BK) / BK;

						if (!may_stop(hp, a.c.bias, h, as, qnorm,
							      reinterpret_cast<const float *>(a.suf)[kb + gt],
							      ape_keys_min_abs(diag, w.hi * BK, Lk), cnt,
							      crow,
							      m, lrow, -APE_INF, tol / dir_count))
							vote |= PF_NO_STOP_FWD;
					}
				}
				if (VT != APE_CU_F32 && masked &&
				    v_nonfinite(sm + M::OFF_V + buf * M::V_BYTES, len))
					vote |= PF_V_NONFINITE;
				if (vote)
					atomic_or_shared(&flags[parity], vote);
			}
			bar(); /* S2: P, corr and the votes are in */
			const int fl = flags[parity];

			if (can_back && !(fl & PF_NO_STOP_BACK))
				w.back = false;
			if (can_fwd && !(fl & PF_NO_STOP_FWD))
				w.fwd = false;
			if (tid == 0)
				flags[parity ^ 1] = 0;
			const int64_t next = w.next();

			/* ---- O = O * corr + P V for this warp's rows and columns */
			{
				const int rg = warp % S::RGS, cg = warp / S::RGS;
				const int ra = rg * 16 + (lane >> 2);
				const float *corr = reinterpret_cast<const float *>(sm + M::OFF_CORR);
				const float ca = corr[ra], cb = corr[ra + 8];
				const unsigned char *vs = sm + M::OFF_V + buf * M::V_BYTES;

#pragma unroll
				for (int n = 0; n < NTL; n++) {
					o[n][0] *= ca;
					o[n][1] *= ca;
					o[n][2] *= cb;
					o[n][3] *= cb;
				}
				if (VT != APE_CU_F32 && !(masked && (fl & PF_V_NONFINITE)))
					pv_mma(o, ps, vs, rg, cg, lane);
				else if (masked)
					pv_fma<true>(o, ps, vs, ra, cg * S::CW + 2 * (lane & 3), len,
						     ape_sat_add(nbase, ra), causal);
				else
					pv_fma<false>(o, ps, vs, ra, cg * S::CW + 2 * (lane & 3), len,
						      ape_sat_add(nbase, ra), causal);
			}

			if (next >= 0 && next != pred) {
				/* a side closed: the prefetched tile is not the next one */
				cp_wait<0>();
				bar();
				load_tile(a, sm, kbase, vbase, k0, next, buf ^ 1, Lk);
			}
			if (next < 0) {
				cp_wait<0>(); /* nothing may land after the block is gone */
				break;
			}
			tables(a, sm, next, i0, hp, h, rel);
			t = next;
			buf ^= 1;
			parity ^= 1;
			pred = w.peek();
			tlo = imin(tlo, t);
			thi = imax(thi, t);
		}
		finish(a, sm, bh, i0, tlo * BK, imin((thi + 1) * BK, Lk), m, l, e1, e2, crow, row_ok,
		       gone, i, r, c, o, warp, lane, diag, q0, Lq);
	}

	/* LSE and pairs per row (score role), then O = acc / l (P V role). Keys [jbeg, jend)
	 * were computed, except by rows `gone` (none). O is 0 in a row with l = 0 (no key):
	 * even a masked or gone key's 0 * V must not reach it. DIAG: ENT and MD from the lanes'
	 * shares e1, e2 of S1, S2 (0 and 0 in a row without a key, NaN in a NaN row). Rows i0 ..
	 * of the block's Lq are the launch's rows q0 + i (a ragged launch's segment; else 0). */
	static APE_DEV void finish(const ape_cu_prefill_args &a, unsigned char *sm, int64_t bh,
				   int64_t i0, int64_t jbeg, int64_t jend, float m, float l, float e1,
				   float e2, double crow, bool row_ok, bool gone, int64_t i, int r,
				   int c, float (&o)[NTL][4], int warp, int lane, int64_t diag,
				   int64_t q0, int64_t Lq)
	{
		const float lrow = group_sum<TPR>(l);

		if constexpr (DIAG) {
			e1 = group_sum<TPR>(e1);
			e2 = group_sum<TPR>(e2);
			if (c == 0 && row_ok && a.c.ent)
				reinterpret_cast<float *>(a.c.ent)[vrow(a.c.vent, (int)bh / a.c.H,
									  (int)bh % a.c.H, q0 + i)] =
					(float)ape_diag_entropy((double)lrow, (double)e1 * APE_LN2);
			if (c == 0 && row_ok && a.c.md)
				reinterpret_cast<float *>(a.c.md)[vrow(a.c.vmd, (int)bh / a.c.H,
									 (int)bh % a.c.H, q0 + i)] =
					(float)ape_diag_distance((double)lrow, (double)e2);
		}
		float *linv = reinterpret_cast<float *>(sm + M::OFF_LINV);

		bar(); /* every warp is done with the last tile's P and corr */
		if (c == 0) {
			linv[r] = lrow == 0.0f ? 0.0f : 1.0f / lrow; /* NaN stays NaN */
			if (row_ok && a.c.lse)
				reinterpret_cast<float *>(a.c.lse)[vrow(a.c.vlse, (int)bh / a.c.H,
									  (int)bh % a.c.H, q0 + i)] =
					lrow > 0.0f ? (float)(crow + ((double)m + log2((double)lrow)) *
									    APE_LN2)
					: lrow == 0.0f ? -APE_INF
						       : APE_NAN;
			if (row_ok && a.c.pairs) {
				const bool causal = a.c.flags & APE_CU_F_CAUSAL;
				const int64_t seen =
					gone ? 0 : ape_row_visible_pairs(diag, jbeg, jend, causal);

				reinterpret_cast<uint64_t *>(a.c.pairs)[bh * a.c.Lq + q0 + i] =
					(uint64_t)seen;
			}
		}
		bar();
		{
			const int rg = warp % S::RGS, cg = warp / S::RGS;
			const int ra = rg * 16 + (lane >> 2);
			const int D = EXACT ? DMAX : a.c.D;

#pragma unroll
			for (int half = 0; half < 2; half++) {
				const int rr = ra + 8 * half;
				const int64_t ii = i0 + rr;
				const float s = linv[rr];

				if (ii >= Lq)
					continue;
				/* B * H <= INT32_MAX (the host checks it): 32-bit divisions */
				const int64_t orow =
					vrow(a.c.vo, (int)bh / a.c.H, (int)bh % a.c.H, q0 + ii);
#pragma unroll
				for (int n = 0; n < NTL; n++) {
					const int col = cg * S::CW + 8 * n + 2 * (lane & 3);

					if (EXACT || col < D)
						store_o2(a.c, orow + col,
							 s == 0.0f ? 0.0f : o[n][2 * half] * s,
							 s == 0.0f ? 0.0f : o[n][2 * half + 1] * s);
				}
			}
		}
	}
};

} /* namespace ape */

#define APE_PREFILL1(name, dmax, exact, vt, diag)                                                  \
	extern "C" __global__ void __launch_bounds__(APE_CU_THREADS, 1)                           \
		name(const struct ape_cu_prefill_args a)                                           \
	{                                                                                          \
		ape::Prefill<dmax, exact, vt, diag>::run(a);                                       \
	}                                                                                          \
	APE_EMU_REGISTER(name, struct ape_cu_prefill_args)

/* each kernel, and its twin with the diagnostics (name_diag) */
#define APE_PREFILL(name, dmax, exact, vt)                                                         \
	APE_PREFILL1(name, dmax, exact, vt, false)                                                 \
	APE_PREFILL1(name##_diag, dmax, exact, vt, true)

APE_PREFILL(ape_prefill_d64_f32, 64, true, APE_CU_F32)
APE_PREFILL(ape_prefill_d64_f16, 64, true, APE_CU_F16)
APE_PREFILL(ape_prefill_d64_bf16, 64, true, APE_CU_BF16)
APE_PREFILL(ape_prefill_d128_f32, 128, true, APE_CU_F32)
APE_PREFILL(ape_prefill_d128_f16, 128, true, APE_CU_F16)
APE_PREFILL(ape_prefill_d128_bf16, 128, true, APE_CU_BF16)
APE_PREFILL(ape_prefill_g128_f32, 128, false, APE_CU_F32)
APE_PREFILL(ape_prefill_g128_f16, 128, false, APE_CU_F16)
APE_PREFILL(ape_prefill_g128_bf16, 128, false, APE_CU_BF16)
APE_PREFILL(ape_prefill_g256_f32, 256, false, APE_CU_F32)
APE_PREFILL(ape_prefill_g256_f16, 256, false, APE_CU_F16)
APE_PREFILL(ape_prefill_g256_bf16, 256, false, APE_CU_BF16)
