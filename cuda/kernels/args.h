/* SPDX-License-Identifier: MIT */
/*
 * What the host passes to each CUDA kernel, and the tile shapes both sides must agree on.
 *
 * Shared by the host code (C11, cuda/cuda_attention.c) and the kernels (CUDA C++): plain structs
 * of fixed-size fields, passed by value (cuLaunchKernel's kernelParams[0] points at one), 8-byte
 * fields first so that C and C++ lay them out alike. Every kernel is `extern "C"` and takes
 * exactly one of these structs, which also lets the test driver (tests/fake_cuda) run the
 * kernels on the CPU.
 */
#ifndef APE_CUDA_KERNELS_ARGS_H
#define APE_CUDA_KERNELS_ARGS_H

#include <stdint.h>

/* Storage types: the values of ape_dtype. */
#define APE_CU_F32 0
#define APE_CU_F16 1
#define APE_CU_BF16 2

/* Per-head parameters travel in the argument struct up to this many heads (read from constant
 * memory, no copy); more heads go through a device buffer. */
#define APE_CU_INLINE_HEADS 64

/* Threads per block of the attention kernels. */
#define APE_CU_THREADS 256

/* ---- prefill tile shapes (cuda/kernels/prefill.cu explains the choice) */
/* threads sharing one query row: each owns 8 of its pairs */
#define APE_PF_TPR(dmax) ((dmax) / 16)
/* query rows per block */
#define APE_PF_BQ(dmax) (APE_CU_THREADS / APE_PF_TPR(dmax))
/* keys per tile: the rotation recurrence restarts from an exact seed at every tile */
#define APE_PF_BK(dmax) ((dmax) == 256 ? 32 : 64)
/* V and P rows in shared memory are padded by 16 bytes for 16-bit types (ldmatrix without
 * bank conflicts); float32 rows need no padding */
#define APE_PF_VROW(dmax, vt) ((dmax) + ((vt) == APE_CU_F32 ? 0 : 8))
#define APE_PF_PROW(dmax, vt) (APE_PF_BK(dmax) + ((vt) == APE_CU_F32 ? 4 : 8))
#define APE_PF_VESZ(vt) ((vt) == APE_CU_F32 ? 4 : 2)

/* float32 scores of a tile before the softmax: the P tile itself for float32 storage, a
 * separate buffer otherwise */
#define APE_PF_SROW(dmax) (APE_PF_BK(dmax) + 4)
#define APE_PF_SBYTES(dmax, vt)                                                                    \
	((vt) == APE_CU_F32 ? 0 : APE_PF_BQ(dmax) * APE_PF_SROW(dmax) * 4)

/* Dynamic shared memory of one prefill block, in bytes: K (float32) and V tiles double-buffered,
 * the P tile, the score tile, two distance tables, per-row factors and a few flags. */
#define APE_PF_SMEM(dmax, vt)                                                                      \
	(2 * APE_PF_BK(dmax) * (dmax) * 4 +                                                        \
	 2 * APE_PF_BK(dmax) * APE_PF_VROW(dmax, vt) * APE_PF_VESZ(vt) +                           \
	 APE_PF_BQ(dmax) * APE_PF_PROW(dmax, vt) * APE_PF_VESZ(vt) + APE_PF_SBYTES(dmax, vt) +     \
	 2 * (APE_PF_BQ(dmax) + APE_PF_BK(dmax)) * 4 + 2 * APE_PF_BQ(dmax) * 4 + 64 + (dmax) * 4)

/* ---- decode shapes (cuda/kernels/decode.cu) */
/* threads per (query row, run of keys): each owns 8 pairs and dmax / TPR = 16 columns of V */
#define APE_DC_TPR(dmax) ((dmax) / 16)
/* keys between exact seeds of the rotation */
#define APE_DC_RESEED 64
/* stages of the per-thread cp.async ring (exact D only) and the 16-byte vectors one thread
 * copies per key: its 8 K pairs and its 16 V columns */
#define APE_DC_STAGES(vt) ((vt) == APE_CU_F32 ? 4 : 6)
#define APE_DC_NVEC(vt) ((vt) == APE_CU_F32 ? 8 : 4)
#define APE_DC_SMEM_RING(vt) (APE_DC_STAGES(vt) * APE_DC_NVEC(vt) * APE_CU_THREADS * 16)
/* the block's per-run partial results, merged at the end: acc, m, l and pairs per group, and
 * with diagnostics (diag 1) the two running sums S1, S2 after a free slot */
#define APE_DC_MROW(dmax, diag) ((dmax) + ((diag) ? 6 : 4))
#define APE_DC_SMEM_MERGE(dmax, diag) ((APE_CU_THREADS / APE_DC_TPR(dmax)) * APE_DC_MROW(dmax, diag) * 4)
#define APE_DC_SMEM(dmax, vt, exact, diag)                                                         \
	(((exact) ? APE_DC_SMEM_RING(vt) : 0) > APE_DC_SMEM_MERGE(dmax, diag)                     \
		 ? ((exact) ? APE_DC_SMEM_RING(vt) : 0)                                            \
		 : APE_DC_SMEM_MERGE(dmax, diag))
/* decode launches cover at most this many query rows per (batch, head) */
#define APE_DC_MAX_LQ 16
/* keys per tile of the skip pre-pass when decoding */
#define APE_DC_NORM_TILE 64
/* keys whose exact scores anchor a row's proven window */
#define APE_DC_ANCHOR 64
/* query rows the window kernel handles at once */
#define APE_DC_WROWS 32
/* ... with per row: the anchor's scores, and eight 8-byte values */
#define APE_DC_WINDOW_SMEM (APE_DC_WROWS * (APE_DC_ANCHOR * 4 + 64) + 64)

/* Launch flags. */
#define APE_CU_F_CAUSAL (1u << 0)
#define APE_CU_F_INTERLEAVED (1u << 1)
#define APE_CU_F_LSE (1u << 2)
#define APE_CU_F_PAIRS (1u << 3)
#define APE_CU_F_SKIP (1u << 4)
/* O's element pairs (2k, 2k + 1) of a row are not aligned for one 2-element store (a strided O
 * at an odd offset or stride): the kernels store elements one by one */
#define APE_CU_F_O_SCALAR (1u << 5)
/* keys read in place whose rows the host cannot prove 16-byte aligned (a page table of element
 * offsets, odd strides): the decode kernels at D = 64 and 128 copy a misaligned row's 16 bytes
 * into their ring with plain loads instead of cp.async (the same bytes: the same results) */
#define APE_CU_F_KV_CHECK (1u << 6)

/*
 * Where a tensor lies: element [b, h, i, 0] at off + b*sb + h*sh + i*sl (elements of its type,
 * D contiguous; LSE: element [b, h, i]). The host fills every view, the contiguous ones of a
 * non-strided launch included (core/backend.h, struct ape_be_view), so the kernels have one way
 * to address a tensor. ape_vrow() in common.cuh.
 */
struct ape_cu_view {
	int64_t off, sb, sh, sl;
};

/*
 * Keys read in place (core/backend.h, struct ape_be_kv_pages; cuda_attention.c): bt 0, K and V
 * lie as their views say (key j of batch b, kv head h at vrow(view, b, h, j)). Else the views'
 * off, sb and sh are the pages' k_off (v_off), s_b and s_h, and sl their s_row: key j is token
 * row + j counted from the start of logical block 0, logical block lb being physical block
 * table[first + lb] (table not 0: int64 block numbers, or element offsets with sblock 1) or
 * (first + lb) mod nblocks (the ring), physical block p starting p * sblock elements further.
 * key_at() and struct KeyWalk in common.cuh.
 */
struct ape_cu_pages {
	uint64_t table;
	int64_t bt, nblocks, first, row, sblock;
};

/*
 * A launch's distance-bias table on the device (struct ape_be_launch.bias_table, uploaded per
 * launch into its scratch): head h's entry at distance an is tab[h * hstride +
 * ape_bias_index(an, len)] (float32; hstride 0: one row for every head), smax the same layout's
 * suffix maxima (the skip bounds' term; 0 where nothing skips). tab 0: no table.
 */
struct ape_cu_bias {
	uint64_t tab, smax;
	int64_t len, hstride;
};

/* What every attention kernel needs: the problem, positions and parameters. */
struct ape_cu_common {
	uint64_t q, k, v; /* device pointers: inputs as the caller gave them */
	uint64_t o, lse, pairs; /* outputs; lse, pairs 0 when not wanted */
	/* the diagnostics (docs/diagnostics.md): float, where vent and vmd say (LSE's shape), each
	 * 0 when not wanted; written only by the _diag kernels (0 and 0 for the others) */
	uint64_t ent, md;
	uint64_t prior; /* lse_prior: float [B*H*Lq], the LSE of earlier launches; 0: none */
	uint64_t hparams; /* H * 4 floats (delta, beta, gamma, lambda per head), or 0: inline */
	int64_t Lq, Lk;
	int64_t rel; /* q_start - k_start: the distance of query row i to key j is rel + i - j */
	double omega[128]; /* omega_p for p < D / 2, zeros after */
	double scale;
	double tol; /* skip tolerance per direction of the walk; 0: never skip */
	double prior_tol; /* the whole-launch test against prior (backend.h) */
	struct ape_cu_view vq, vk, vv, vo, vlse; /* the tensors' views (vk, vv: kv heads) */
	struct ape_cu_view vent, vmd; /* ent's and md's (core/backend.h, ape_be_launch_diag_view()) */
	struct ape_cu_pages pg; /* where K and V rows lie when read in place (bt 0: vk, vv) */
	struct ape_cu_bias bias; /* the distance-bias table (tab 0: none) */
	int32_t B, H, Hkv, D;
	int32_t dt_in, dt_out; /* APE_CU_F32, F16, BF16 */
	uint32_t flags; /* APE_CU_F_* */
	int32_t pad0;
	float hp[4 * APE_CU_INLINE_HEADS]; /* per-head parameters when H <= APE_CU_INLINE_HEADS */
};

/* ape_prep: K as float32 pairs [u_0..u_{P-1}, 0.., w_0..w_{P-1}, 0..] of dmax floats per row,
 * V padded to dmax columns, and the largest key norm per tile of `tile` keys. */
struct ape_cu_prep_args {
	uint64_t k, v; /* inputs, [B][Hkv][Lk][D] where vk, vv say */
	uint64_t kp; /* 0, or float [B*Hkv*Lk][dmax] */
	uint64_t vp; /* 0, or [B*Hkv*Lk][dmax] of the input type */
	uint64_t ktile; /* 0, or float [B*Hkv][ntile]: max |k| per tile, +inf with NaN/Inf */
	int64_t Lk, nbkv, ntile;
	int64_t block_base;
	struct ape_cu_view vk, vv;
	struct ape_cu_pages pg; /* keys read in place (the decode's skip pre-pass): bt 0, none */
	int32_t D, dmax, tile, dt, interleaved, Hkv;
};

/* dynamic shared memory of ape_prep (a maximum per warp) and ape_dwindow */
#define APE_CU_PREP_SMEM (APE_CU_THREADS / 32 * 4)

/* ape_kscan: prefix and suffix maxima of the tile norms: pre[t] over tiles < t, suf[t] over
 * tiles >= t, ntile + 1 entries each per (batch, kv head). */
struct ape_cu_scan_args {
	uint64_t ktile, pre, suf;
	int64_t ntile, nbkv;
};

/* The prefill kernels: one block per (query tile, batch, head). */
struct ape_cu_prefill_args {
	struct ape_cu_common c;
	uint64_t kp; /* float32 pair-ordered K rows of dmax floats (or K itself when it is so) */
	uint64_t vp; /* V rows of dmax elements (V itself when D == dmax) */
	struct ape_cu_view vkp, vvp; /* their rows: ape_prep's contiguous ones, or K's and V's own
				      * (16-byte aligned: cp.async reads them; keys read in place:
				      * unless APE_CU_F_KV_CHECK, as in the decode) */
	uint64_t pre, suf; /* skip pre-pass, or 0 */
	int64_t nqt; /* query tiles per (batch, head); ragged: entries of segt */
	int64_t ntk; /* key tiles (ragged: unused, each segment's own) */
	int64_t block_base; /* first block of this launch (grids are split when huge) */
	/* 0, or a ragged launch's tiles (core/backend.h, struct ape_be_launch.segs): int64
	 * [nqt][APE_PF_SEGW], per query tile of one segment its q0, lq, k0, lk, rel (the distance of
	 * (row q0, key k0); 0 without keys) and i0 (the tile's first row within the segment),
	 * heaviest first */
	uint64_t segt;
	/* APE_PF_K_PAGES, APE_PF_V_PAGES: kp (vp) is K (V) itself, read in place (keys read in
	 * place, l->pages): its rows where c.pg puts them (key_at()), the views' sl their s_row */
	uint32_t paged;
	int32_t pad1;
};

#define APE_PF_SEGW 6
#define APE_PF_K_PAGES 1u
#define APE_PF_V_PAGES 2u

/* ape_dwindow: per (batch, kv head) the key range [lo, hi) the decode kernel must read. */
struct ape_cu_window_args {
	struct ape_cu_common c;
	uint64_t pre, suf; /* skip pre-pass over tiles of APE_DC_NORM_TILE keys */
	uint64_t window; /* int64 [B*Hkv][2] */
	int64_t ntile;
	int64_t block_base;
};

/*
 * A ragged decode's segment table (struct ape_cu_decode_args.segt, ape_cu_merge_args.segt):
 * int64 [nseg][APE_DC_SEGW], per segment of the launch (core/backend.h, struct ape_be_seg) its
 * q0, lq, k0, lk, rel (q_start - k_start), its splits S (0 without keys), where its partial rows
 * start (poff: row r = h * lq + i of the segment, split s, at partial row poff + s * H * lq + r)
 * and its first block of the decode's grid (blk0: S * Hkv blocks from there, s fastest). Each
 * segment is split as a dense launch of it alone (B = 1) would be, so that its rows get the same
 * bits whatever shares the launch.
 */
#define APE_DC_SEGW 8

/* The decode kernels: one block per (split, batch, kv head), all query rows of the kv head; a
 * ragged launch (segt): one block per (segment, kv head, split). */
struct ape_cu_decode_args {
	struct ape_cu_common c;
	uint64_t window; /* int64 [B*Hkv][2], or 0: every visible key */
	uint64_t part_o; /* float [S][rows][D] (ragged: [partial rows][D], segt's poff) */
	uint64_t part_ml; /* float [S][rows][2]: m (log2 units, shifted frame), l */
	uint64_t part_pairs; /* uint64 [S][rows] */
	uint64_t part_sd; /* _diag kernels: float [S][rows][2]: S1 (log2 units, frame of m), S2 */
	uint64_t segt; /* 0, or a ragged launch's segment table (APE_DC_SEGW above) */
	int64_t nseg; /* its segments */
	int64_t splits; /* dense: S; ragged: the grid's blocks */
	int64_t block_base;
};

/* ape_dmerge: the splits of every row merged by their LSE into O, LSE and pairs. */
struct ape_cu_merge_args {
	struct ape_cu_common c;
	uint64_t part_o, part_ml, part_pairs;
	uint64_t part_sd; /* ape_dmerge_diag only */
	uint64_t segt; /* 0, or the decode's segment table: each row's splits as its segment says */
	int64_t nseg;
	int64_t splits;
	int64_t rows; /* B * H * Lq */
	int64_t block_base;
};

/* ape_lmerge (attention_merge, core/backend.h struct ape_be_merge): a launch's partial result
 * folded into the running one by their LSE, one thread per row. 0: a buffer left out. */
struct ape_cu_lmerge_args {
	uint64_t o, lse, pairs, ent, md; /* the running result */
	uint64_t po, plse, ppairs, pent, pmd; /* the partial */
	int64_t rows, D;
	int32_t pairs32; /* pairs is uint32 */
};

#endif /* APE_CUDA_KERNELS_ARGS_H */
