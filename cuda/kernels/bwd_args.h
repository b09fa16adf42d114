/* SPDX-License-Identifier: MIT */
/*
 * What the host (cuda/cuda_backward.c) passes to the backward kernels (cuda/kernels/backward.cu),
 * and the tile shapes both sides must agree on. Like args.h: plain fixed-size fields, 8-byte
 * fields first, one struct by value per launch (every backward kernel takes the same one).
 */
#ifndef APE_CUDA_KERNELS_BWD_ARGS_H
#define APE_CUDA_KERNELS_BWD_ARGS_H

#include <stdint.h>

#include "args.h"

/* Threads sharing one key row in the fused sweep: each owns 8 pairs, their 16 components of
 * K and V and of the dK and dV it accumulates. */
#define APE_BW_TPR(dmax) ((dmax) / 16)
/* Key rows per block (a key tile) of the fused sweep */
#define APE_BW_ROWS(dmax) (APE_CU_THREADS / APE_BW_TPR(dmax))
/* Query rows (with dO) staged in shared memory per step of the fused sweep, float32 pairs */
#define APE_BW_STAGE(dmax) ((dmax) <= 128 ? 32 : 16)
/* Distance table entries: every n between a key tile's rows and a stage's (one unused) */
#define APE_BW_TBL(dmax) (APE_BW_ROWS(dmax) + APE_BW_STAGE(dmax))
/* The query-row pass of a stage (dQ and the rows' sums): threads per staged row, and the pairs
 * each of them owns (4 at D = 64, 8 otherwise) */
#define APE_BW_TPR2(dmax) (APE_CU_THREADS / APE_BW_STAGE(dmax))
#define APE_BW_PT2(dmax) ((dmax) / 2 / APE_BW_TPR2(dmax))

/* Dynamic shared memory of a fused-sweep block, in bytes (backward.cu lays it out; 54 to 64 KB,
 * above the 48 KB default: cuda_module.c opts in): the staged query rows and their dO, the key
 * tile (float32 pairs); per (staged row, key) dS, the dot product and the alpha sum (float);
 * per distance temp * scale (float), bias and the four parameter derivatives (double); omega
 * in double and float; per staged row 1 / alpha (double), LSE and Dl - dLSE (float). */
#define APE_BW_SMEM(dmax)                                                                          \
	(2 * APE_BW_STAGE(dmax) * (dmax) * 4 + APE_BW_ROWS(dmax) * (dmax) * 4 +                   \
	 3 * APE_BW_STAGE(dmax) * APE_BW_ROWS(dmax) * 4 + APE_BW_TBL(dmax) * (4 + 8 + 32) +        \
	 ((dmax) / 2) * 12 + APE_BW_STAGE(dmax) * 16)

/* Splits of a (batch, kv head)'s key tiles at most (each has its own slices of the partial dQ
 * and row sums: cuda_backward.c). 32, not OpenCL's 8: a GPU has a hundred multiprocessors or
 * more, and with few (batch, kv head) pairs (B = 1, Hkv = 6: 6 x 8 = 48 blocks on an H200's
 * 132) the splits are the sweep's only parallelism; 32 gives 192 there, for nsplit x (Lq D
 * floats + 5 Lq doubles) of scratch per (batch, head). Not measured on a GPU. */
#define APE_BW_SPLITS_MAX 32

/* The per-split row sums of the fused sweep, float64 per query row: the alpha path A_i times
 * alpha_i, then the four parameter sums (d_lambda's without the path through alpha) */
#define APE_BW_RP_N 5

/* Query rows per block of ape_bwd_reduce (its warps take every 8th row); its shared memory:
 * the rows' parameter sums */
#define APE_BW_RED_ROWS 32
#define APE_BW_RED_SMEM (APE_BW_RED_ROWS * 4 * 8)

/* Query rows per block of ape_bwd_rows (one warp each) */
#define APE_BW_ROWS_PER_BLOCK (APE_CU_THREADS / 32)

/* The row table ape_bwd_rows writes: per query row, these doubles (alpha_i follows from sigma_i
 * and the head's lambda where it is used) */
#define APE_BW_RI_SIGMA 0
#define APE_BW_RI_MEAN 1
#define APE_BW_RI_DSUB 2 /* Dl_i - dLSE_i, Dl_i = dO_i . O_i */
#define APE_BW_RI_N 3

/* Launch flags (the forward's APE_CU_F_CAUSAL and APE_CU_F_INTERLEAVED, then these) */
#define APE_BW_F_DLSE (1u << 8)
#define APE_BW_F_DQ (1u << 9)
#define APE_BW_F_DK (1u << 10)
#define APE_BW_F_DV (1u << 11)
#define APE_BW_F_DP (1u << 12)
#define APE_BW_F_DB (1u << 13) /* the distance-bias table's gradient */

/*
 * A ragged launch's segment table (struct ape_cu_bwd_args.segt): int64 [nseg][APE_BW_SEGW], per
 * segment of the launch (core/backend.h, struct ape_be_seg), in the launch's order, its first
 * query row q0 and rows lq, first key k0 and keys lk, rel = q_start - k_start (the distance of
 * its row q0 and key k0; 0 without keys), its first key tile kt0 (the fused sweep's key tiles
 * are each segment's ceil(lk / APE_BW_ROWS) tiles, segment after segment: no tile straddles two
 * segments) and db0, where its per-distance dS sums start in a split's dbp slice (each segment
 * with keys has lq + lk - 1 of them, segment after segment). A dense launch is the one segment
 * {0, Lq, 0, Lk, q_start - k_start, 0, 0} and has no table.
 */
#define APE_BW_SEG_Q0 0
#define APE_BW_SEG_LQ 1
#define APE_BW_SEG_K0 2
#define APE_BW_SEG_LK 3
#define APE_BW_SEG_REL 4
#define APE_BW_SEG_KT0 5
#define APE_BW_SEG_DB0 6
#define APE_BW_SEGW 7

/* Threads of ape_bwd_dbias's blocks: its dynamic shared memory, their sums (float64) */
#define APE_BW_DB_SMEM (APE_CU_THREADS * 8)

/* Every backward kernel's arguments. */
struct ape_cu_bwd_args {
	uint64_t q, k, v, o, lse, dout, dlse; /* inputs (dlse 0: not given) */
	uint64_t dq, dk, dv; /* float accumulators, 0 when not wanted */
	uint64_t dparams; /* double [H][4] accumulator, 0 when not wanted */
	uint64_t rinfo; /* scratch: double [B*H*Lq][APE_BW_RI_N] */
	uint64_t part; /* scratch: double [B*H][nqt][4], ape_bwd_reduce's per-block sums */
	uint64_t dqp; /* scratch: float [nsplit][B*H*Lq][D], the splits' dQ (pairs' x, then y) */
	uint64_t rp; /* scratch: double [nsplit][B*H*Lq][APE_BW_RP_N], the splits' row sums */
	uint64_t hparams; /* H * 4 floats (delta, beta, gamma, lambda per head), or 0: inline */
	uint64_t dbias; /* double [Ht][bias.len] accumulator (Ht: H, or 1 shared), 0: not wanted */
	/* scratch (with dbias): double [nsplit][B*H][nd], each split's dS summed per distance,
	 * entry i - j + Lk - 1 for the pairs of row i and key j (ragged: db0 + i - j + lk - 1 of
	 * the segment's, i and j counted from its q0 and k0) */
	uint64_t dbp;
	uint64_t segt; /* 0 (dense), or a ragged launch's segment table (APE_BW_SEGW above) */
	struct ape_cu_bias bias; /* the distance-bias table (args.h; tab 0: none; smax unused) */
	int64_t Lq, Lk;
	int64_t rel; /* q_start - k_start */
	int64_t nqt; /* blocks of APE_BW_RED_ROWS query rows per (batch, head) */
	int64_t nkt; /* key tiles of the fused sweep per (batch, kv head) (ragged: all segments') */
	int64_t nseg; /* segments of segt (0: dense) */
	int64_t nd; /* per-distance sums of a (split, batch, head) in dbp: Lq + Lk - 1 (ragged: the
		     * segments' lq + lk - 1, those with keys) */
	/* ape_bwd_dbias: entries db_m0 .. db_m0 + db_nm - 1 of each row of db_len (the table's
	 * M; bias.len counts the entries uploaded) */
	int64_t db_m0, db_nm, db_len;
	double omega[128]; /* omega_p for p < D / 2, zeros after */
	double scale;
	int32_t B, H, Hkv, D;
	int32_t dt_in, dt_out, dt_do; /* APE_CU_F32, F16, BF16 of q/k/v, o, dout */
	uint32_t flags; /* APE_CU_F_CAUSAL, APE_CU_F_INTERLEAVED, APE_BW_F_* */
	int32_t nsplit; /* splits of the key tiles, 1 .. APE_BW_SPLITS_MAX */
	int32_t kblk; /* keys per tile: APE_BW_ROWS of the launch's variant */
	float hp[4 * APE_CU_INLINE_HEADS]; /* per-head parameters when H <= APE_CU_INLINE_HEADS */
};

/* ape_copy_view's arguments (core/backend.h, struct ape_be_copy): element views in elements of
 * their types; types APE_CU_F32, F16, BF16, or APE_CU_F64_ELEM (float64). */
#define APE_CU_F64_ELEM 3
struct ape_cu_copy_args {
	uint64_t dst, src;
	int64_t doff, dsb, dsh, dsl;
	int64_t soff, ssb, ssh, ssl;
	int64_t H, L, D, n; /* n = B * H * L * D elements */
	int32_t dt_dst, dt_src;
};

#endif /* APE_CUDA_KERNELS_BWD_ARGS_H */
