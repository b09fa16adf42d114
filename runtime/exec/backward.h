/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on one device or several, on the executor every pass runs on
 * (exec/multidev.h): key chunks x query chunks under each device's budget, pipelined, key
 * chunks split among the devices, attention_backward launches into zeroed float32 (and
 * float64) accumulators, gradients summed in a fixed order and written to the caller's tensors
 * only once every device succeeded.
 */
#ifndef APE_RUNTIME_BACKWARD_H
#define APE_RUNTIME_BACKWARD_H

#include <stdint.h>

#include "core/backend.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/* A validated backward call that needs a device: B*H >= 1, Lq >= 1, Lk >= 1. */
struct ape__bwd_req {
	const char *fn; /* for messages */
	struct ape_device *const *devs; /* each with a backward pass (ape__backward_supported) */
	int ndev; /* 1..APE_MAX_DEVICES */
	const double *weights; /* ndev shares of the key chunks, each > 0; NULL: equal shares */
	const char *trace_path; /* NULL: no trace */
	uint64_t budget; /* device bytes, per device; 0: each device's default */
	int64_t chunk_q, chunk_k; /* most rows per chunk; 0: APE__CHUNK_DEFAULT */
	int depth; /* launches in flight, 1..APE__MAX_DEPTH; 0: APE__DEFAULT_DEPTH */
	bool copy_inputs; /* APE_EXEC_COPY_INPUTS: never read the inputs in place */
	const struct ape__problem *p; /* p->out_dtype is o's */
	const ape_tensor *q, *k, *v, *o, *dout;
	const int64_t *dout_s; /* dout's element strides; q, k, v, o's are in p */
	const float *lse, *dlse; /* dlse may be NULL */
	const int64_t *lse_s; /* lse's and dlse's element strides as [B, H, Lq, 1]; NULL:
			       * contiguous (a ragged call's [total_q, H] sets its own) */
	ape_tensor *dq, *dk, *dv; /* NULL: not wanted */
	const int64_t *dq_s, *dk_s, *dv_s;
	float *dparams; /* NULL or 4*H */
};

/* Summed over the devices, unless said otherwise. */
struct ape__bwd_result {
	uint64_t h2d, d2h; /* bytes copied each way */
	uint64_t peak; /* device bytes held at once, on the device that held the most */
	uint64_t budget; /* the smallest budget of the devices; UINT64_MAX: none */
	double kernel_ms; /* device time of the launches */
	double copy_ms; /* device time of the copies */
	int devices; /* devices that were given key chunks */
	uint64_t launches; /* (query chunk, key chunk) pairs launched */
	uint64_t pairs_computed; /* visible (query, key) pairs computed, when pairs_counted */
	bool pairs_counted; /* the launches could skip keys and counted what they computed */
	struct ape_be_path_log paths; /* the kernel paths the launches took */
	int64_t cq, ck; /* rows per chunk the planner chose */
	int depth; /* launches in flight the planner chose */
};

/*
 * The launch of query rows [i0, i0 + nq) against key rows [j0, j0 + nk) of the validated
 * problem p, for a call whose rows meet nkc key chunks (the skip_tol share), without buffers:
 * shapes, positions, parameters; the caller sets the buffers (and views).
 */
void ape__bwd_launch_shape(const struct ape__problem *p, ape_dtype dout_dtype, int64_t nkc,
			   struct ape_be_bwd_launch *l, int64_t i0, int64_t nq, int64_t j0, int64_t nk);

/* 0 when dev's backend implements the backward pass; else APE_ENOTSUP naming the device
 * ("<fn>: opencl:0 NAME: the backward pass is not implemented on this backend yet"). */
int ape__backward_supported(const char *fn, const struct ape_device *dev);

/*
 * Runs the call. Returns 0 with every wanted output written (and the trace, when asked for), or
 * a negative code with the message set and nothing written: APE_ENOTSUP (a device's backend has
 * no attention_backward), APE_ENOMEM (host memory, or a budget too small for one query row and
 * one key row: the message names the device and says what that needs), device errors (the
 * first failing device's, in list order, naming it), APE_EIO (the trace file).
 */
int ape__exec_backward(const struct ape__bwd_req *r, struct ape__bwd_result *res);

#pragma GCC visibility pop
#endif
