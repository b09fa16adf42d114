/* SPDX-License-Identifier: MIT */
/*
 * A whole streamed forward call over one or more devices (runtime/exec/multidev.c): the plan of
 * every device, the split of query chunks by device speed, one worker per device, the merged
 * statistics and the trace.
 */
#ifndef APE_RUNTIME_MULTIDEV_H
#define APE_RUNTIME_MULTIDEV_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "exec/problem.h"
#include "exec/stream.h"

#pragma GCC visibility push(hidden)

/* A streamed forward call, validated. */
struct ape__exec_req {
	const char *fn; /* for messages */
	ape_device *const *devs;
	int ndev; /* 1..APE_MAX_DEVICES */
	int64_t chunk_q, chunk_k; /* most rows per chunk, >= 1 */
	uint64_t budget; /* per device; 0: the device's default */
	int depth; /* 1..APE__MAX_DEPTH */
	const double *weights; /* NULL: measured */
	const char *trace_path; /* NULL: none */
	const struct ape__problem *p; /* Lq, Lk >= 1 */
	const ape_tensor *q, *k, *v;
	ape_tensor *o;
	float *lse;
	/* the diagnostics, [B, H, Lq] each, or NULL; only on devices whose backend declares
	 * attention_diag (the API checked), and then p->skip_tol <= APE_DIAG_SKIP_TOL */
	float *ent, *md;
	bool want_pairs;
	bool staged; /* o and lse are the call's own staging (APE_EXEC_ATOMIC_OUTPUTS) */
};

struct ape__exec_result {
	struct ape__stream_stats st; /* summed over devices; peak_bytes the largest */
	int64_t cq, ck, nq;
	int depth;
	uint64_t budget; /* the smallest of the devices' budgets */
};

/* The budget of a device when the caller gives none: 3/4 of its memory, or none (UINT64_MAX)
 * when it does not say. The backward pass (exec/backward.c) uses it too. */
uint64_t ape__default_budget(const struct ape_device *dev);

/* Plans, runs on every device, merges the statistics, writes the trace. Returns 0 or a
 * negative code with the message set (naming how many query chunks were written). */
int ape__exec_run(const struct ape__exec_req *r, struct ape__exec_result *res);

/*
 * Contiguous ranges of n items for ndev devices: device d takes [bounds[d], bounds[d + 1]),
 * the cumulative cost of the ranges following the cumulative share of the weights (each > 0).
 * The forward splits query chunks with it, the backward (exec/backward.c) key chunks.
 */
void ape__split_ranges(const double *weight, int ndev, const double *cost, int64_t n,
		       int64_t *bounds);

/*
 * Runs body(arg, d) for every d in 0..ndev-1: with one device on the calling thread (binding it
 * would change the caller's affinity for good), else on one thread per device, bound to the
 * device's local CPUs. Returns 0 once every body returned, or APE_ENOMEM naming fn when a
 * thread could not start: *abort is raised first and the threads started are joined.
 */
int ape__run_per_device(const char *fn, ape_device *const *devs, int ndev,
			void (*body)(void *arg, int d), void *arg, atomic_bool *abort);

#pragma GCC visibility pop
#endif
