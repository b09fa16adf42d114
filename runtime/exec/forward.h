/* SPDX-License-Identifier: MIT */
/*
 * A streamed forward call on host tensors over one or more devices (runtime/exec/forward.c):
 * the forward pass (exec/fwd_pass.h) of each device, run by the executor (exec/multidev.h).
 */
#ifndef APE_RUNTIME_FORWARD_H
#define APE_RUNTIME_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "exec/multidev.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/* A forward call, validated. */
struct ape__fwd_req {
	const char *fn; /* for messages */
	ape_device *const *devs;
	int ndev; /* 1..APE_MAX_DEVICES */
	int64_t chunk_q, chunk_k; /* most rows per chunk, >= 1 */
	uint64_t budget; /* per device; 0: the device's default */
	int depth; /* 1..APE__MAX_DEPTH */
	const double *weights; /* NULL: measured */
	const char *trace_path; /* NULL: none */
	bool copy_inputs; /* APE_EXEC_COPY_INPUTS: never read the inputs in place */
	const struct ape__problem *p; /* Lq, Lk >= 1 */
	const ape_tensor *q, *k, *v;
	ape_tensor *o; /* strides p->os */
	float *lse;
	/* the diagnostics, [B, H, Lq] each, or NULL; only on devices whose backend computes
	 * them (the API checked), and then p->skip_tol <= APE_DIAG_SKIP_TOL */
	float *ent, *md;
	bool want_pairs;
	/* o and lse are the call's own staging (APE_EXEC_ATOMIC_OUTPUTS, a ragged call's), not
	 * the caller's: a failure's message says nothing of what was written. Either way, on a
	 * device that reads host memory, launches with one key chunk write o and lse in place */
	bool staged;
};

/*
 * Plans, runs on every device, sums the statistics, writes the trace. Returns 0 or a negative
 * code with the message set (naming, unless staged, how many query chunks were written).
 */
int ape__forward_run(const struct ape__fwd_req *r, struct ape__exec_result *res);

#pragma GCC visibility pop
#endif
