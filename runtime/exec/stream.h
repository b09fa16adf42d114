/* SPDX-License-Identifier: MIT */
/*
 * The pipelined executor of one device: a session holds the device's queues, chunk buffers,
 * staging buffers and merge accumulators; a run takes query chunks from a work queue and, for
 * each, walks its key chunks from the diagonal outward, copying, computing and merging with up
 * to `depth` chunks in flight. Forward calls make a session per call and device; a KV cache
 * keeps one for its life.
 *
 * The executor of one device in files by concern: stream.c (the session and its buffers),
 * stream_run.c (the pipeline: query chunks and their walks), stream_load.c (copies of query
 * and key chunks), stream_job.c (one launch: issue, retire, merge), stream_time.c (device
 * times, overlap, trace spans); their shared state is exec/stream_impl.h.
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
#include "exec/skip_budget.h"
#include "exec/trace.h"
#include "exec/workq.h"

#pragma GCC visibility push(hidden)

struct ape__stream;

/* What a session is built for: the largest call it will run. */
struct ape__stream_geom {
	int64_t B, H, Hkv, D;
	ape_dtype in_dtype;
	struct ape__plan plan; /* cq, ck: most rows per chunk; depth; slots */
	bool host_kv; /* keys and values come from host tensors (staging for them) */
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
	/*
	 * Optional (NULL: every chunk is loaded). Where key rows [j0, j0 + n) lie on the device,
	 * for a launch that reads them in place: sets *k, *v (block pools) and *pg and returns
	 * true, or returns false (then the chunk is loaded). Enqueues nothing. The session asks
	 * the backend's attention_pages next; when it accepts, wait() orders its compute queue
	 * after whatever still writes those rows, and the launch reads them where they are.
	 */
	bool (*pages)(void *arg, int64_t j0, int64_t n, struct ape__buf **k, struct ape__buf **v,
		      struct ape__kv_pages *pg);
	int (*wait)(void *arg, struct ape__queue *q);
};

/* One call, read-only: the sessions of several devices share it. */
struct ape__stream_call {
	const struct ape__problem *p;
	const ape_tensor *q, *k, *v; /* k, v: NULL with a loader */
	const struct ape__kv_loader *loader;
	ape_tensor *o; /* rows of finished query chunks are written here ... */
	float *lse; /* ... and here ([B, H, Lq]); NULL: not wanted */
	/* ... and the diagnostics here ([B, H, Lq] each; NULL: not wanted; only when the
	 * session's plan has diag_bytes and its backend declares attention_diag; lse is then
	 * computed on the device even when NULL here, for the merge) */
	float *ent, *md;
	int64_t cq, ck, nq, nk; /* this call's chunking, within the session's */
	bool merge; /* partial outputs in float32, merged on the host (nk > 1) */
	const struct ape__kmax *kmax; /* NULL: no chunk-level skipping */
	struct ape__skip_budget tol; /* the shares of skip_tol (exec/skip_budget.h) */
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

int ape__stream_create(struct ape_device *dev, const struct ape__stream_geom *g,
		       struct ape__stream **out);
/* Allocates every buffer the session may use now, so that runs allocate none (KV cache);
 * also room for the overlap figure's intervals of the largest run, as far as it is given. */
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

#pragma GCC visibility pop
#endif
