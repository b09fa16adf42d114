/* SPDX-License-Identifier: MIT */
/*
 * The pipelined executor of one device: a session holds the device's queues, chunk buffers,
 * staging buffers and merge accumulators; a run takes query chunks from a work queue and, for
 * each, walks its key chunks from the diagonal outward, copying, computing and merging with up
 * to `depth` chunks in flight. Forward calls make a session per call and device; a KV cache
 * keeps one for its life.
 */
#ifndef APE_RUNTIME_STREAM_H
#define APE_RUNTIME_STREAM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "exec/plan.h"
#include "exec/problem.h"
#include "exec/skip.h"
#include "exec/trace.h"

#pragma GCC visibility push(hidden)

struct ape__stream;
struct ape__workq;

/* What a session is built for: the largest call it will run. */
struct ape__stream_geom {
	int64_t B, H, Hkv, D;
	ape_dtype in_dtype;
	struct ape__plan plan; /* cq, ck: most rows per chunk; depth; slots */
	bool host_kv; /* keys and values come from host tensors (staging for them) */
	bool no_overlap; /* do not record intervals for the overlap figure (no host allocation) */
	uint64_t budget; /* UINT64_MAX: none */
};

/* Key chunks that do not come from host tensors (the KV cache). */
struct ape__kv_loader {
	/*
	 * Enqueues on q whatever fills dk and dv with key rows [j0, j0 + n) in [B, Hkv, n, D]
	 * layout. `lane` (0..depth-1) identifies q among the session's copy queues, for loaders
	 * that need staging of their own per queue. Adds the bytes it moves to the counters.
	 */
	int (*load)(void *arg, struct ape__queue *q, int lane, int64_t j0, int64_t n,
		    struct ape__buf *dk, struct ape__buf *dv, uint64_t *h2d, uint64_t *d2h,
		    uint64_t *d2d);
	void *arg;
};

/* One call, read-only: the sessions of several devices share it. */
struct ape__stream_call {
	const struct ape__problem *p;
	const ape_tensor *q, *k, *v; /* k, v: NULL with a loader */
	const struct ape__kv_loader *loader;
	ape_tensor *o; /* rows of finished query chunks are written here ... */
	float *lse; /* ... and here ([B, H, Lq]); NULL: not wanted */
	int64_t cq, ck, nq, nk; /* this call's chunking, within the session's */
	bool merge; /* partial outputs in float32, merged on the host (nk > 1) */
	const struct ape__kmax *kmax; /* NULL: no chunk-level skipping */
	double tol_chunk; /* skip weight allowed per direction of the walk */
	double tol_kernel; /* skip_tol of every launch */
	bool want_pairs;
	bool poison; /* APE_CONTEXT_POISON_OUTPUTS */
	struct ape__workq *wq;
	atomic_bool *abort; /* raised by a failing worker: the others stop */
};

struct ape__stream_stats {
	uint64_t pairs_computed, chunks, chunks_skipped;
	uint64_t work; /* query rows x key rows launched: the speed measure of multi-device splits */
	uint64_t h2d, d2h, d2d; /* bytes */
	double kernel_ms, copy_ms, overlap_ms;
	int64_t qchunks_done; /* query chunks whose rows were written */
	uint64_t peak_bytes;
	bool device_clock; /* overlap_ms is measured (the backend timestamps events) */
};

/* Backend scratch per launch: the backend's own figure, or a conservative estimate. */
uint64_t ape__scratch_of(struct ape_device *dev, const struct ape__launch *l);

int ape__stream_create(struct ape_device *dev, const struct ape__stream_geom *g,
		       struct ape__stream **out);
/* Allocates every buffer the session may use now, so that runs allocate none (KV cache). */
int ape__stream_reserve(struct ape__stream *s);
/*
 * Runs query chunks taken from c->wq as worker `who` until there are none left. Returns 0, a
 * negative code (message set; rows of the query chunks already finished are written), or 1
 * when it stopped because *c->abort was raised. `trace` may be NULL. Stats are added to *st.
 */
int ape__stream_run(struct ape__stream *s, const struct ape__stream_call *c, int who,
		    struct ape__trace_dev *trace, struct ape__stream_stats *st);
/* Waits for the session's queues and frees everything. Accepts NULL. */
void ape__stream_destroy(struct ape__stream *s);
/* Device memory the session holds now. */
uint64_t ape__stream_device_bytes(const struct ape__stream *s);

/* ---- work distribution and the whole streamed call (runtime/exec/multidev.c) */

/* The next query chunk for worker `who`, or -1: query chunks are split into contiguous ranges,
 * one per worker; a worker whose range is empty takes the last chunk of the range with the
 * most left. */
int64_t ape__workq_next(struct ape__workq *w, int who);
/* A work queue of one worker (the KV cache's), set to chunks 0..nq-1 before each run. */
int ape__workq_create(struct ape__workq **out);
void ape__workq_destroy(struct ape__workq *w);
void ape__workq_single(struct ape__workq *w, int64_t nq);
/* n workers (<= 64), worker i taking chunks [bounds[i], bounds[i + 1]). */
void ape__workq_set(struct ape__workq *w, int n, const int64_t *bounds);

/* A streamed forward call, validated. */
struct ape__exec_req {
	const char *fn; /* for messages */
	ape_device *const *devs;
	int ndev;
	int64_t chunk_q, chunk_k; /* most rows per chunk, >= 1 */
	uint64_t budget; /* per device; 0: the device's default */
	int depth; /* 1..3 */
	const double *weights; /* NULL: measured */
	const char *trace_path; /* NULL: none */
	const struct ape__problem *p; /* Lq, Lk >= 1 */
	const ape_tensor *q, *k, *v;
	ape_tensor *o;
	float *lse;
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

#pragma GCC visibility pop
#endif
