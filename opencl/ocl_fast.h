/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend's fast paths, taken ahead of the general kernel (ocl_attention.c) for the
 * launches they can serve exactly (docs/kernels.md, "Decode and the separable path"):
 *   decode     (ocl_decode.c, kernels/decode.cl): a few query rows against many keys, the keys
 *              split over work-items (a CPU device's shape) or work-groups (the work-group
 *              shape, for other devices and under APE_OCL_DEC_SHAPE=gpu) and the partial
 *              results merged by LSE;
 *   separable  (ocl_separable.c, kernels/separable.cl): every head with lambda = 0, where the
 *              rotation separates: Q and K rotated once, then a GEMM-shaped kernel (a CPU
 *              device's, ape_sep_attn, or the work-group shape, ape_sep_attn_wg, for other
 *              devices and under APE_OCL_SEP_SHAPE=gpu); a launch mixing such heads with
 *              others is split by runs of kv groups (dense launches only). Ragged launches
 *              (l->segs) take the same kernels through segment tables, all segments at once.
 * Each applies() predicate is conservative: a launch it does not recognise in full (an output or
 * option these kernels do not write) goes to the general kernel.
 */
#ifndef APE_OPENCL_OCL_FAST_H
#define APE_OPENCL_OCL_FAST_H

#include "ocl.h"

#pragma GCC visibility push(hidden)

/* Launch flags of the fast kernels (mirrored in kernels/decode.cl and kernels/separable.cl):
 * bits 0-1 input dtype, 2-3 output dtype, then these. */
#define APE__FD_CAUSAL 16
#define APE__FD_INTERLEAVED 32
#define APE__FD_LSE 64
#define APE__FD_PAIRS 128
#define APE__FD_SKIP 256
#define APE__FD_BIAS 512 /* separable: the bias from the per-distance table */

/* The outputs every fast kernel writes: O, LSE, pairs. A launch asking for the diagnostics
 * (entropy, mean distance: l->ent, l->md) goes to the general kernel. */
static inline bool ape__ocl_fast_outputs(const struct ape_be_launch *l)
{
	return !l->ent && !l->md;
}

/* ---- ocl_decode.c */
bool ape__ocl_decode_applies(struct ape_device *dev, const struct ape_be_launch *l);
int ape__ocl_decode(struct ape_be_queue *q, const struct ape_be_launch *l);
/* The attention_pages op: the decode reads a KV cache's blocks in place (l->pages) for every
 * launch of its shape, with skipping allowed or not (it skips nothing: exact). */
bool ape__ocl_decode_pages(struct ape_device *dev, const struct ape_be_launch *l);
/* Bytes of scratch the decode allocates for l (0 when it does not apply). */
uint64_t ape__ocl_decode_scratch(struct ape_device *dev, const struct ape_be_launch *l);

/* omega_p (D/2 values), then delta, beta, gamma, lambda per head, in the kernels' APE_REAL, as a
 * read-only buffer of the launch's own. */
cl_mem ape__ocl_fast_params(struct ape_be_queue *q, const struct ape_be_launch *l, cl_int *err);
/*
 * The launch's distance-bias table (struct ape_be_launch.bias_table) and, with smax, its suffix
 * maxima (bias_smax, for the far-key bounds) as read-only buffers of the launch's own in tab[0]
 * and tab[1] (the caller releases them), *len and *hs their entries per row and head stride
 * as the kernels take them; without a table, NULL buffers and 0, 0. 0, or a failure (its
 * message set).
 */
int ape__ocl_bias_upload(struct ape_be_queue *q, const struct ape_be_launch *l, bool smax,
			 cl_mem tab[2], cl_long *len, cl_long *hs);
/* Bytes ape__ocl_bias_upload() allocates for a launch of l's shape, or for all of the runs of
 * its heads ape__ocl_split() makes of it. */
uint64_t ape__ocl_bias_scratch(const struct ape_be_launch *l);
/* The view of tensor t as four kernel arguments (offset, B, H and L strides). */
void ape__ocl_arg_view(struct ape__ocl_args *a, const struct ape_be_launch *l, int t);
/* Enqueues a->k (arguments set through a) over (n0, n1) with local size l0, releases it and
 * clears *a for the next kernel; the first failure, as ape__ocl_enqueue() reports it. */
int ape__ocl_fast_launch(struct ape_be_queue *q, struct ape__ocl_args *a, const char *what,
			 size_t n0, size_t l0, size_t n1);
/* The flags every fast kernel takes. */
cl_int ape__ocl_fast_flags(const struct ape_be_launch *l);

/* ---- ocl_separable.c */
bool ape__ocl_separable_applies(struct ape_device *dev, const struct ape_be_launch *l);
int ape__ocl_separable(struct ape_be_queue *q, const struct ape_be_launch *l);
uint64_t ape__ocl_separable_scratch(struct ape_device *dev, const struct ape_be_launch *l);
/* Mixed launches (some kv groups all separable, others not; no pairs, no lse_prior; not
 * ragged): each run of consecutive kv groups of one kind as a sub-launch, its views moved along
 * H. The separable path's scratch bounds the runs' together (it exceeds the general kernel's per
 * head). */
bool ape__ocl_split_applies(struct ape_device *dev, const struct ape_be_launch *l);
int ape__ocl_split(struct ape_be_queue *q, const struct ape_be_launch *l);

/* The attention_scratch op (ocl_decode.c): the largest of what the general kernel and the fast
 * paths allocate for l, and the distance-bias table's upload. */
uint64_t ape__ocl_attention_scratch(struct ape_device *dev, const struct ape_be_launch *l);

/* ---- kernels_embed.S */
extern const char ape__ocl_src_decode[];
extern const char ape__ocl_src_separable[];

#pragma GCC visibility pop
#endif
