/* SPDX-License-Identifier: MIT */
/* What the backward calls on host tensors (api/backward.c) share with the one on device tensors
 * (api/resident_bwd.c): the gradients' validation. */
#ifndef APE_RUNTIME_API_BACKWARD_H
#define APE_RUNTIME_API_BACKWARD_H

#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/* The tensors of a backward call beyond the forward's q, k, v, o: lse and dout required, the
 * others NULL when absent. lse and dlse are [B, H, Lq, 1] float32, dparams [1, 1, H, 4]
 * float32. */
struct ape__bwd_tensors {
	const ape_tensor *lse, *dout, *dlse;
	const ape_tensor *dq, *dk, *dv, *dparams;
};

/* Their element strides, resolved (zeros for an absent one). */
struct ape__bwd_strides {
	int64_t lse[4], dout[4], dlse[4], dq[4], dk[4], dv[4], dparams[4];
};

/*
 * The gradients' rules, against the validated forward problem p (of q, k, v, o): each tensor's
 * type (dout, dq, dk, dv: p's input type or float32; lse, dlse, dparams float32) and shape,
 * outputs without two elements at one address, and no output overlapping an input (q, k, v,
 * o, lse, dout, dlse) or another output. APE_EINVAL with a message naming the argument and its
 * value; fills *s.
 */
int ape__check_backward_tensors(const char *fn, const struct ape__problem *p,
				const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
				const ape_tensor *o, const struct ape__bwd_tensors *t,
				struct ape__bwd_strides *s);

struct ape__bwd_result;

/*
 * The statistics (stats, may be NULL) and the call log's line of a backward call, from what the
 * executor reports (res; NULL: nothing ran on a device, no key or no query row), through the one
 * statistics builder (api/stats.c): pairs_visible over every batch and head, t0 when the call
 * began. The dense calls' (api/backward.c) and the ragged batch's one run (api/varlen_bwd.c).
 */
void ape__bwd_call_done(const char *fn, ape_device *const *devs, int ndev,
			const struct ape__problem *p, int ret, const struct ape__bwd_result *res,
			uint64_t pairs_visible, double t0, ape_stats *stats);

#pragma GCC visibility pop
#endif
