/* SPDX-License-Identifier: MIT */
/*
 * The separable path's kernels (cuda/kernels/separable.cu) and what the host passes them
 * (cuda/cuda_separable.c): launches whose every head has lambda = 0, where the rotation
 * separates (docs/kernels.md, "Decode and the separable path"). Plain structs of fixed-size
 * fields, 8-byte fields first, as in args.h.
 */
#ifndef APE_CUDA_KERNELS_SEP_ARGS_H
#define APE_CUDA_KERNELS_SEP_ARGS_H

#include "args.h"

/* Query rows per block (8 warps of 16 rows) and keys per tile of the attention kernel. */
#define APE_SEP_BQ 128
#define APE_SEP_BK 64
/* Rows of Q, K and V in shared memory are padded by 16 bytes (ldmatrix without bank conflicts). */
#define APE_SEP_ROW(d) ((d) + 8)
/* P of a tile cut by the causal diagonal, float32, per warp 16 rows of BK + 4 floats. */
#define APE_SEP_PBYTES (APE_CU_THREADS / 32 * 16 * (APE_SEP_BK + 4) * 4)
#define APE_SEP_QBYTES(d) (APE_SEP_BQ * APE_SEP_ROW(d) * 2)
/* K rows hold the rotated key's hi and lo halves (D each), then the padding */
#define APE_SEP_KROW(d) (2 * (d) + 8)
#define APE_SEP_KBYTES(d) (APE_SEP_BK * APE_SEP_KROW(d) * 2)
#define APE_SEP_VBYTES(d) (APE_SEP_BK * APE_SEP_ROW(d) * 2)
/* Dynamic shared memory: Q (one half at a time, then P) | K, V double-buffered | the bias
 * table | bref and the key tile's factor | c_row per row | the rows' factors */
#define APE_SEP_SMEM(d)                                                                            \
	((APE_SEP_QBYTES(d) > APE_SEP_PBYTES ? APE_SEP_QBYTES(d) : APE_SEP_PBYTES) +               \
	 2 * APE_SEP_KBYTES(d) + 2 * APE_SEP_VBYTES(d) + (APE_SEP_BQ + APE_SEP_BK) * 4 + 16 +        \
	 APE_SEP_BQ * 8 + APE_SEP_BQ * 4)

/*
 * f16 range: a rotation can lift a value up to sqrt(2) above its input's magnitude, past f16's
 * largest finite 65504. A query row with a pair (x, y) of x^2 + y^2 > 65504^2, and every key of
 * a tile of APE_SEP_BK keys (one batch, one kv head) holding such a pair, is stored halved
 * (x^2 + y^2 <= 65504^2 keeps every rotated value below 65520, where f16 rounds to infinity;
 * halved, any finite pair stays below 46341). Halving is exact but among f16's subnormals,
 * below 2^-14, where a value loses its last bit (2^-25): with |scale| |q| |k| < 128 (the spec's
 * accuracy range) and a norm above 65504 on one side, at most 2^-30 added to a score (logit
 * units) at D = 128.
 * qf (per query row) and kf (per key tile) hold 1, or 1 / APE_SEP_F16_SHRINK for a halved
 * one: the attention kernel multiplies the scores by both, which restores them exactly (powers
 * of two). Launches without such values store and compute exactly as without the guard. bf16
 * has float32's range: its factors are always 1.
 */
#define APE_SEP_F16_SHRINK 0.5f
#define APE_SEP_F16_BIG2 (65504.0 * 65504.0)

/*
 * ape_sep_rot: blocks 0 .. nqb-1 take the query rows (b, h, i), nq of them, one warp per row:
 * rotated at their positions rel + i into qr[(b*H + h)*Lq + i][2][D] (hi, then lo: the rotated
 * value, halved where the f16 range asks (above), rounded to the storage type, and the rest
 * rounded; each half in the half layout, the pairs' first components, then their second ones),
 * the row's factor into qf, and |q| rounded up into qn (float64, for the skip bound). The next
 * nbkv * ntk blocks take one tile of APE_SEP_BK keys of one (b, kv head) each: rotated at j into
 * kr[(b*Hkv + kvh)*Lk + j][2][D] likewise, the tile's factor into kf[(b*Hkv + kvh)*ntk + t],
 * and V copied into vr[...][D]. All in the storage type of the inputs (f16 or bf16).
 */
struct ape_cu_sep_rot_args {
	uint64_t q, k, v; /* inputs where vq, vk, vv say */
	uint64_t qr, kr, vr, qn, qf, kf; /* outputs, contiguous */
	int64_t rel, Lq, Lk;
	int64_t nq, nqb, nbkv, ntk;
	int64_t block_base;
	double omega[128];
	struct ape_cu_view vq, vk, vv;
	int32_t H, Hkv, D, dt, interleaved, pad0;
};

/* ape_sep_d64_f16 and the others: one block per (query tile of APE_SEP_BQ rows, batch, head). */
struct ape_cu_sep_args {
	uint64_t qr, kr, vr, qn, qf, kf; /* ape_sep_rot's outputs */
	uint64_t pre; /* prefix maxima of the key-tile norms (ape_prep, ape_kscan), or 0 */
	uint64_t o, lse, pairs; /* outputs; lse, pairs 0 when not wanted */
	int64_t Lq, Lk, rel;
	int64_t nqt, ntk; /* query tiles per (batch, head), key tiles */
	int64_t block_base;
	double scale, tol; /* tol: the skip tolerance, 0: never skip */
	struct ape_cu_view vo, vlse;
	struct ape_cu_bias bias; /* the distance-bias table (args.h; tab 0: none) */
	int32_t B, H, Hkv, D;
	int32_t dt_out;
	uint32_t flags; /* APE_CU_F_CAUSAL, _LSE, _PAIRS, _SKIP, _O_SCALAR */
	float hp[4 * APE_CU_INLINE_HEADS]; /* delta, beta, gamma, lambda (0) per head */
};

#endif /* APE_CUDA_KERNELS_SEP_ARGS_H */
