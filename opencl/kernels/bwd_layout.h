/* SPDX-License-Identifier: MIT */
/*
 * What the host (opencl/ocl_backward.c) and the backward kernels (kernels/backward.cl) must
 * agree on: the launch flags and the layout of the row and distance tables. Plain macros, in the
 * subset C and OpenCL C share; the build embeds this file ahead of backward.cl, and the host
 * includes it, so the two cannot drift.
 */
#ifndef APE_OCL_BWD_LAYOUT_H
#define APE_OCL_BWD_LAYOUT_H

/* launch flags: the three storage types (ape_dtype, 2 bits each), then one bit each */
#define B_DTYPES(in, out, dout) ((in) | (out) << 2 | (dout) << 4)
#define B_DT_IN(f) ((f) & 3)
#define B_DT_OUT(f) (((f) >> 2) & 3)
#define B_DT_DO(f) (((f) >> 4) & 3)
#define B_CAUSAL 64
#define B_INTERLEAVED 128
#define B_DLSE 256
#define B_DQ 512
#define B_DK 1024
#define B_DV 2048
#define B_DP 4096
#define B_SKIP 8192 /* leave out key tiles the backward bound proves negligible (skip_tol) */
#define B_PAIRS 16384 /* write each row's pairs computed */
#define B_DBIAS 32768 /* the distance-bias table's gradient: dS per distance, DBP */
#define B_SEP 65536 /* lambda = 0 on every head: ape_bwd_sep on rows and keys rotated once */

/* Keys per skip granule: a row vector's computed keys start and end at multiples of it (or at
 * the ends of its visible keys); the sweep's key blocks (BWD_KT) divide it. Small, because a
 * row vector computes every key of the granules it meets (kernels/backward.cl, BWD_KT). */
#define B_GRANULE 16

/* per-row values of ape_bwd_rows, RI_N of them per row, in APE_REAL, in blocks of APE_RW rows
 * (a row vector of the sweep) per (batch, head), field-major inside a block: value `field` of
 * row i of block blk (blk = bh * nblk + i / APE_RW, nblk = ceil(Lq / APE_RW); a ragged launch:
 * i in its padded row space, nblk its NRV, below) sits at RI_AT(blk, field, rw) + i % APE_RW.
 * Rows past Lq (past their segment's lq) get alpha 1, LSE +inf, the rest 0. */
#define RI_AT(blk, field, rw) (((blk) * RI_N + (field)) * (rw))
#define RI_MEAN 0
#define RI_SIGMA 1
#define RI_ALPHA 2
#define RI_LSE 3
#define RI_DSUB 4 /* Dl_i - dLSE_i */
#define RI_JLO 5 /* the row vector's computed keys: [RI_JLO, RI_JHI), the same in every lane */
#define RI_JHI 6
#define RI_N 7

/* per (head, distance) values of ape_bwd_dist, TB_N of them, in APE_REAL, one array per term:
 * term `field` of head h at distance n = nmin + idx sits at TB_AT(h, field, ndist) + idx; the
 * host allocates APE_RW values more (a row vector's load may reach past the last distance). */
#define TB_AT(h, field, ndist) (((h) * TB_N + (field)) * (ndist))
#define TB_T 0 /* temp(n) */
#define TB_BIAS 1 /* bias(n) */
#define TB_DD 2 /* d(bias)/d(delta) */
#define TB_DB 3 /* d(bias)/d(beta) */
#define TB_DG 4 /* d(bias)/d(gamma) */
#define TB_DTL 5 /* d(temp)/d(lambda) */
#define TB_N 6

/* per (split, row vector) sums of ape_bwd_fused, RP_N of them, in APE_REAL, APE_RW lanes each:
 * the alpha path's A, then the four parameter sums; slice s of row vector blk (as in RI_AT) at
 * ((s * nrv + blk) * RP_N + field) * rw, nrv the row vectors of the launch */
#define RP_N 5

/*
 * A ragged launch (struct ape_be_bwd_launch, "Ragged"): its segments in a table of SG_N int64
 * values each (segment s at s * SG_N): the first query row and the rows, the first key and the
 * keys, rel = q_start - k_start, its first row vector and its first key block. The kernels work
 * in a padded row space: each segment's rows padded to whole row vectors of APE_RW rows
 * (ceil(lq / APE_RW) of them from SG_RV0, NRV in all per head), so that a row vector never holds
 * two segments' rows, and each segment's keys cut into key blocks of BWD_KT keys from its own
 * first key (ceil(lk / BWD_KT) from SG_KB0, NKB in all). Alongside: the segment of each row
 * vector (NRV ints) and of each key block (NKB ints). A dense launch has no table: one segment
 * {0, Lq, 0, Lk, q_start - k_start, 0, 0} (kernels/backward.cl, bwd_seg()).
 */
#define SG_Q0 0
#define SG_LQ 1
#define SG_K0 2
#define SG_LK 3
#define SG_REL 4
#define SG_RV0 5
#define SG_KB0 6
#define SG_N 7

/* per (split, batch and head) dS sums of ape_bwd_fused by distance (B_DBIAS), in APE_REAL: the
 * sum at distance n = nmin + idx of slice s of (batch, head) bh at DBP_AT(s, bh, nbh, ndist) +
 * idx, nbh = B H; ape_bwd_dbias_dist sums the slices in a fixed order */
#define DBP_AT(s, bh, nbh, ndist) (((s) * (nbh) + (bh)) * (ndist))

#endif
