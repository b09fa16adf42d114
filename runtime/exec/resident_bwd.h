/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on tensors already in device memory (runtime/exec/resident_bwd.c): the path
 * of ape_attention_backward_enqueue(). Everything is enqueued on the caller's queue, in order:
 * gathers of the inputs into contiguous queue-ordered scratch (core/backend.h: scratch_alloc,
 * copy_view), zeroed accumulators, the attention_backward launches, and copies of the
 * accumulators into the caller's outputs, converted to their types. No host copy, no wait.
 * A ragged problem (p->segs, ape_attention_backward_enqueue_varlen(): the segments' key ranges
 * disjoint, the device taking ragged backward launches) runs the same way, each launch given
 * the segments of its rows.
 */
#ifndef APE_RUNTIME_RESIDENT_BWD_H
#define APE_RUNTIME_RESIDENT_BWD_H

#include "core/backend.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/* The tensors of a resident backward call. */
enum ape__rb_tensor {
	APE__RB_Q, APE__RB_K, APE__RB_V, APE__RB_O, APE__RB_LSE, APE__RB_DOUT, APE__RB_DLSE,
	APE__RB_DQ, APE__RB_DK, APE__RB_DV, APE__RB_DPARAMS, APE__RB_COUNT
};

struct ape__resident_bwd_req {
	const char *fn; /* for messages */
	struct ape_device *dev; /* with attention_backward, scratch_alloc and copy_view */
	struct ape_be_queue *q; /* a queue of dev */
	const struct ape__problem *p; /* validated */
	/* each tensor's buffer (NULL: absent: dlse, or an output not wanted), its validated view
	 * (LSE and dLSE with D = 1; dparams as [1, 1, H, 4]) and storage type */
	struct ape_be_buf *buf[APE__RB_COUNT];
	struct ape_be_view view[APE__RB_COUNT];
	ape_dtype dtype[APE__RB_COUNT];
	uint64_t budget; /* device bytes of scratch; 0: the device's default */
	struct ape_be_path_log *paths; /* NULL, or where the launches note their kernel paths */
};

/*
 * The query rows per launch: all of them when the call's scratch (gathered inputs,
 * accumulators and the backend's own, every key in each launch) fits the budget, else the
 * largest power-of-two fraction that fits. APE_ENOMEM (message naming the call, the device and
 * what one row needs) when not even one row fits. Enqueues nothing.
 */
int ape__resident_bwd_plan(const struct ape__resident_bwd_req *r, int64_t *rows_per_launch);

/*
 * Enqueues the call with launches of `rows` query rows (from ape__resident_bwd_plan()) on r->q
 * and returns without waiting. A call with no query row or no key writes zeros to every wanted
 * output. Returns 0, or a negative code from the backend (message set): work enqueued before
 * the failure may still run; the outputs are then unspecified.
 */
int ape__resident_bwd_enqueue(const struct ape__resident_bwd_req *r, int64_t rows);

#pragma GCC visibility pop
#endif
