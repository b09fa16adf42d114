/* SPDX-License-Identifier: MIT */
/*
 * A whole pass (exec/pass.h) over one or more devices (runtime/exec/multidev.c): the plan of
 * every device, the split of outer chunks, one worker per device, the summed statistics and
 * the trace. The forward call (exec/forward.c) and the backward call (exec/backward.c) both
 * run through it.
 */
#ifndef APE_RUNTIME_MULTIDEV_H
#define APE_RUNTIME_MULTIDEV_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "exec/pass.h"
#include "exec/stream.h"

#pragma GCC visibility push(hidden)

/* A pass to run, validated. */
struct ape__exec_req {
	const char *fn; /* for messages */
	ape_device *const *devs;
	int ndev; /* 1..APE_MAX_DEVICES */
	int64_t chunk_q, chunk_k; /* most rows per chunk, >= 1 */
	uint64_t budget; /* per device; 0: the device's default */
	int depth; /* 1..APE__MAX_DEPTH */
	/* NULL: by the speed each device reached in earlier forward calls (equal shares until
	 * measured); else ndev shares, each > 0 */
	const double *weights;
	/* the split is fixed before any work, contiguous ranges and no stealing at the tail, so
	 * that the same devices give the same bits (the backward); else idle devices take chunks
	 * from busy ones at the end */
	bool fixed_split;
	const char *trace_path; /* NULL: none */
	bool copy_inputs; /* never wrap inputs where they lie (APE_EXEC_COPY_INPUTS) */
	int64_t Lq, Lk; /* >= 1 */
	struct ape__pass *const *passes; /* one per device, each initialised for its device */
	/* the cost of the outer chunk of rows [r0, r0 + n) for the split */
	double (*cost)(void *arg, int64_t r0, int64_t n);
	void *cost_arg;
	/* called once the chunking is known, before any work: the caller prepares its passes
	 * (host memory per slot, the launch template); 0 or a negative code */
	int (*prepare)(void *arg, const struct ape__plan *plan, int d);
	void *prepare_arg;
	const char *what; /* the problem in messages: "B=1, H=4, Hkv=2, D=64, f32" */
	const char *chunk_name; /* the plan's messages: NULL "one chunk" */
};

struct ape__exec_result {
	struct ape__stream_stats st; /* summed over devices; peak_bytes the largest */
	uint64_t pairs_computed, chunks_skipped; /* the pass's own figures, filled by the caller */
	struct ape_be_path_log paths; /* the kernel paths the launches took, filled likewise */
	int64_t cq, ck; /* rows per chunk along each axis */
	int64_t no; /* outer chunks */
	int depth;
	uint64_t budget; /* the smallest of the devices' budgets */
	int devices; /* devices that were given outer chunks */
	int64_t outer_by_dev[APE_MAX_DEVICES]; /* each device's outer chunks (its share) */
};

/* The budget of a device when the caller gives none: 3/4 of its memory, or none (UINT64_MAX)
 * when it does not say. */
uint64_t ape__default_budget(const struct ape_device *dev);

/* Plans, runs on every device, sums the statistics, writes the trace. Returns 0 or a negative
 * code with the message set (naming the device that failed first, in list order). */
int ape__exec_run(const struct ape__exec_req *r, struct ape__exec_result *res);

/*
 * Contiguous ranges of n items for ndev devices: device d takes [bounds[d], bounds[d + 1]),
 * the cumulative cost of the ranges following the cumulative share of the weights (each > 0).
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
