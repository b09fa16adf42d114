/* SPDX-License-Identifier: MIT */
/*
 * The pipelined executor of one device, for any pass (exec/pass.h): a session holds the
 * device's queues, chunk buffers and host staging; a run takes outer chunks from a work queue
 * and, for each, walks its inner chunks as the pass says, copying, computing and reading back
 * with up to `depth` jobs in flight. Calls make a session per call and device; a KV cache
 * keeps one for its life.
 *
 * The executor of one device in files by concern: stream.c (the session and its buffers),
 * stream_run.c (the pipeline: outer chunks and their walks), stream_load.c (copies in),
 * stream_job.c (one job: issue, retire), stream_time.c (device times, overlap, trace spans);
 * their shared state is exec/stream_impl.h.
 */
#ifndef APE_RUNTIME_STREAM_H
#define APE_RUNTIME_STREAM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "exec/pass.h"
#include "exec/plan.h"
#include "exec/trace.h"
#include "exec/workq.h"

#pragma GCC visibility push(hidden)

struct ape__stream;

/* What a session is built for: the largest call it will run. */
struct ape__stream_geom {
	struct ape__plan plan; /* co, ci: most rows per chunk; depth; slots */
	/* the pass's tensors at their largest (roles, row bytes; host pointers unused) */
	struct ape__pass shape;
	uint64_t budget; /* UINT64_MAX: none */
};

/* Inner inputs that do not come from host tensors (the KV cache's keys and values). */
struct ape__kv_loader {
	/*
	 * Enqueues on q whatever fills dk and dv with key rows [j0, j0 + n) in [B, Hkv, n, D]
	 * layout. `lane` (0..depth-1) identifies q among the session's copy queues, for loaders
	 * that need staging of their own per queue. Adds the bytes it moves to the counters.
	 */
	int (*load)(void *arg, struct ape_be_queue *q, int lane, int64_t j0, int64_t n,
		    struct ape_be_buf *dk, struct ape_be_buf *dv, uint64_t *h2d, uint64_t *d2h,
		    uint64_t *d2d);
	void *arg;
	/*
	 * Optional (NULL: every chunk is loaded). Where key rows [j0, j0 + n) lie on the device,
	 * for a launch that reads them in place: sets *k, *v (block pools) and *pg and returns
	 * true, or returns false (then the chunk is loaded). Enqueues nothing. The pass's
	 * in_pages() decides next; when it takes them, wait() orders the compute queue after
	 * whatever still writes those rows, and the launch reads them where they are.
	 */
	bool (*pages)(void *arg, int64_t j0, int64_t n, struct ape_be_buf **k, struct ape_be_buf **v,
		      struct ape_be_kv_pages *pg);
	int (*wait)(void *arg, struct ape_be_queue *q);
};

/* One call's run on one device, read-only to the session. */
struct ape__stream_call {
	struct ape__pass *pass; /* this device's; its tensors are the geometry's, rows as large */
	int64_t Lq, Lk; /* rows along each axis */
	int64_t co, ci, no, ni; /* this call's chunking, within the session's */
	const struct ape__kv_loader *loader; /* INNER_IN tensors without a host tensor */
	bool in_place; /* the device reads host memory: inputs are wrapped where they lie */
	bool host_tables; /* ... and the pass's per-run tables (CALL_IN) likewise */
	bool poison; /* APE_CONTEXT_POISON_OUTPUTS: outputs start as NaN */
	struct ape__workq *wq;
	atomic_bool *abort; /* raised by a failing worker: the others stop */
};

struct ape__stream_stats {
	uint64_t chunks; /* jobs launched */
	uint64_t work; /* outer rows x inner rows launched: the speed measure of multi-device splits */
	uint64_t h2d, d2h, d2d; /* bytes */
	double kernel_ms, copy_ms, overlap_ms;
	int64_t outer_done; /* outer chunks whose results were taken in */
	/* a job was handed an output's host memory where it lies (a JOB_OUT with a host tensor,
	 * wrapped): poisoned or written before the run's end, so a failure leaves it unspecified */
	bool in_place;
	uint64_t peak_bytes;
	bool device_clock; /* overlap_ms is measured (the backend timestamps events) */
};

int ape__stream_create(struct ape_device *dev, const struct ape__stream_geom *g,
		       struct ape__stream **out);
/* Allocates every buffer the session may use for calls without in-place inputs, so that runs
 * allocate none (KV cache); also room for the overlap figure's intervals of the largest run. */
int ape__stream_reserve(struct ape__stream *s);
/*
 * Runs outer chunks taken from c->wq as worker `who` until there are none left. Returns 0, a
 * negative code (message set; outer chunks already done were taken in by the pass), or 1 when
 * it stopped because *c->abort was raised. `trace` may be NULL. Stats are added to *st.
 */
int ape__stream_run(struct ape__stream *s, const struct ape__stream_call *c, int who,
		    struct ape__trace_dev *trace, struct ape__stream_stats *st);
/* Waits for the session's queues and frees everything. Accepts NULL. */
void ape__stream_destroy(struct ape__stream *s);
/* Device memory the session holds now. */
uint64_t ape__stream_device_bytes(const struct ape__stream *s);

/*
 * The device bytes of a candidate chunking of pass p (the planner's bytes callback,
 * struct ape__plan_bytes), with inputs in place where `in_place` (the device reads host
 * memory) and max_wrap (the largest buffer it wraps, struct ape_be_caps.max_alloc) allow. Lo,
 * Li: rows along the outer and inner axis.
 */
void ape__pass_bytes(const struct ape__pass *p, bool in_place, uint64_t max_wrap, int64_t Lo,
		     int64_t Li, int64_t co, int64_t ci, struct ape__plan_bytes *b);
/* Whether tensor t of p is wrapped where it lies in a run with chunks of `rows` of its
 * `all` rows, on a device that reads host memory (in_place) in buffers of up to max_wrap
 * bytes (a larger tensor goes through chunk buffers). */
bool ape__pass_wraps(const struct ape__pass *p, int t, bool in_place, uint64_t max_wrap,
		     int64_t rows, int64_t all);
/* Where input t of p (rows of `heads` heads of D elements) lies for job j's launch: in the
 * caller's tensor at its host strides from the job's first row where j wraps it there, else
 * packed [B, heads, rows, D] at offset 0 of its chunk buffer. */
struct ape_be_view ape__pass_view(const struct ape__pass *p, const struct ape__pass_job *j, int t,
				  int64_t heads, int64_t D);

#pragma GCC visibility pop
#endif
