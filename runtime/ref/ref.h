/* SPDX-License-Identifier: MIT */
/* The reference evaluation of APE: plain C, float64, one row at a time. */
#ifndef APE_REF_H
#define APE_REF_H

#include "ape/ape_backend.h"

#pragma GCC visibility push(hidden)

/* Element i of a contiguous tensor of storage type t, exactly, as a double. */
static inline double ape__ref_load(const void *base, ape_dtype t, int64_t i)
{
	switch (t) {
	case APE_F16:
		return ape_be_f16_to_f32(((const uint16_t *)base)[i]);
	case APE_BF16:
		return ape_be_bf16_to_f32(((const uint16_t *)base)[i]);
	case APE_F32:
		break;
	}
	return ((const float *)base)[i];
}

/*
 * Computes rows [row_begin, row_end) of the flattened [B*H*Lq] output of launch `l` from host
 * tensors laid out as ape_be_launch_view() says (ent, md: as ape_be_launch_diag_view() says; pairs
 * contiguous; each of lse, pairs, ent, md may be NULL). Extra memory is O(D) per row; no key is ever skipped. The diagnostics
 * come from float64 running sums rescaled with the online softmax (ape_diag_*()).
 */
void ape__ref_rows(const struct ape_be_launch *l, const void *q, const void *k, const void *v,
		   void *o, float *lse, uint64_t *pairs, float *ent, float *md, int64_t row_begin,
		   int64_t row_end);

/* Host pointers of one backward launch (struct ape_be_bwd_launch: which are NULL, the layouts). */
struct ape__ref_bwd_io {
	const void *q, *k, *v, *o, *dout;
	const float *lse, *dlse;
	float *dq, *dk, *dv;
	double *dparams;
	double *dbias; /* NULL, or struct ape_be_bwd_launch.dbias */
};

/*
 * The gradients of launch `l` (the contract of ape_backend_plugin.attention_backward: each
 * non-NULL output accumulated), in float64 with every visible key. Extra memory: a table of a
 * few doubles per query row. Returns 0 or APE_ENOMEM (message set, without the device or the
 * op, which the core's table adds; nothing was added).
 */
int ape__ref_backward(const struct ape_be_bwd_launch *l, const struct ape__ref_bwd_io *io);

#pragma GCC visibility pop
#endif
