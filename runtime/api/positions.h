/* SPDX-License-Identifier: MIT */
/* The dense calls at explicit positions (desc->pos_q, desc->pos_k; api/positions.c), for
 * api/forward.c and api/backward.c. */
#ifndef APE_RUNTIME_API_POSITIONS_H
#define APE_RUNTIME_API_POSITIONS_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/* The visible pairs of one (b, h) head of a validated problem, at its explicit positions when
 * it has them: 0, or APE_EOVERFLOW / APE_ENOMEM with the message (naming fn) set. */
int ape__problem_head_pairs(const char *fn, const struct ape__problem *p, uint64_t *out);

/*
 * The forward of a validated problem p with explicit positions (p->pos_q; Lq, Lk >= 1) where
 * the devices do not read them: each batch element is a one-sequence ragged batch
 * (ape_attention_forward_varlen_ex()) over its slice of q, k, v, staged, and o and lse ([B, H,
 * Lq]) are written only once every element succeeded. stats (checked) as the ragged call
 * reports them, from t0. 0 or a negative code with the message set.
 */
int ape__forward_positions(const char *fn, ape_device *const *devs, int ndev,
			   const ape_exec_options *opts, const ape_attn_desc *desc,
			   const struct ape__problem *p, const ape_tensor *q, const ape_tensor *k,
			   const ape_tensor *v, ape_tensor *o, float *lse, ape_stats *stats,
			   double t0);

/* The backward's tensors beyond the forward's, validated, their strides resolved. */
struct ape__pos_grads {
	const ape_tensor *dout;
	const float *dlse;
	ape_tensor *dq, *dk, *dv;
	float *dparams;
	const int64_t *dout_s, *dq_s, *dk_s, *dv_s;
};

/* The backward the same way (ape_attention_backward_varlen() per batch element, which reads
 * no position on the device: runs of consecutive positions), every output staged and written
 * on success; dparams summed over the elements. */
int ape__backward_positions(const char *fn, ape_device *const *devs, int ndev,
			    const ape_exec_options *opts, const ape_attn_desc *desc,
			    const struct ape__problem *p, const ape_tensor *q, const ape_tensor *k,
			    const ape_tensor *v, const ape_tensor *o, const float *lse,
			    const struct ape__pos_grads *g, ape_stats *stats, double t0);

#pragma GCC visibility pop
#endif
