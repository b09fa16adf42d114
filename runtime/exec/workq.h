/* SPDX-License-Identifier: MIT */
/*
 * The work queue of a streamed call: outer chunks split into contiguous ranges, one per worker
 * (neighbouring outer chunks share inner chunks); a worker whose range is empty takes the last
 * chunk of the range with the most left, so a wrong split only costs balance at the tail,
 * unless the split is fixed (each worker its own range only: the same chunks on the same
 * device every time).
 */
#ifndef APE_RUNTIME_WORKQ_H
#define APE_RUNTIME_WORKQ_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/limits.h"

#pragma GCC visibility push(hidden)

struct ape__workq {
	pthread_mutex_t lock;
	int n; /* workers */
	bool steal; /* idle workers take from busy ones */
	int64_t begin[APE_MAX_DEVICES], end[APE_MAX_DEVICES]; /* worker i's chunks left */
};

/* An empty queue, in place (a call's own); ape__workq_fini() undoes it. */
void ape__workq_init(struct ape__workq *w);
void ape__workq_fini(struct ape__workq *w);
/* A queue on the heap (the KV cache keeps one for its life). Destroy accepts NULL. */
int ape__workq_create(struct ape__workq **out);
void ape__workq_destroy(struct ape__workq *w);
/* n workers (1..APE_MAX_DEVICES), worker i taking chunks [bounds[i], bounds[i + 1]), and,
 * with `steal`, others' chunks once its own are done. */
void ape__workq_set(struct ape__workq *w, int n, const int64_t *bounds, bool steal);
/* One worker, chunks 0..nq-1. */
void ape__workq_single(struct ape__workq *w, int64_t nq);
/* The next outer chunk for worker `who`, or -1 when none is left anywhere. */
int64_t ape__workq_next(struct ape__workq *w, int who);

#pragma GCC visibility pop
#endif
