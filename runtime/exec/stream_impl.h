/* SPDX-License-Identifier: MIT */
/*
 * The state of a device session, shared by the executor's files (exec/stream.h lists them) and
 * by nothing else.
 *
 * Queues: one compute queue; per job slot of the pipeline a host-to-device queue for inner
 * chunks and a device-to-host queue for the job's outputs; per outer slot one queue for its
 * inputs and, when its chunk is done, its accumulators coming back. Work is ordered across them
 * by events only. The host waits for a specific copy by synchronising the one queue that holds
 * it, never for the device as a whole: with three job slots, the copy of chunk i + 1 runs while
 * chunk i computes and chunk i - 1's output comes back. Queues are made on first use, so a run
 * that copies nothing (every input in place) makes only the compute queue.
 *
 * Events have one owner each: the job that recorded them, or the outer chunk that loaded its
 * rows. Slots borrow them (`ready`, `used`) and the owner clears the borrowed references when it
 * retires, after which the work they stood for has completed.
 */
#ifndef APE_RUNTIME_STREAM_IMPL_H
#define APE_RUNTIME_STREAM_IMPL_H

#include "core/limits.h"
#include "exec/devmem.h"
#include "exec/stream.h"
#include "topo/placement.h"

#pragma GCC visibility push(hidden)

/* Where a tensor's rows come from or go to in one run. */
enum { APE__AT_CHUNK, APE__AT_WRAPPED, APE__AT_UNUSED };

/* An outer chunk, from its start to its accumulators coming back: an outer slot. */
struct oslot {
	struct ape_be_buf *buf[APE__PASS_MAX_T]; /* OUTER_IN and OUTER_ACC chunk buffers */
	struct ape__hostmem stage_in; /* OUTER_IN rows packed, tensor after tensor */
	struct ape__hostmem stage_back; /* OUTER_ACC rows come back here */
	bool stage_pending; /* a copy from stage_in may still be running on its queue */
	struct ape_be_queue *queue; /* its copies, both ways */
	struct ape_be_event *ready; /* its inputs have arrived (owned: load_e1) */
	struct ape_be_event *used; /* the last kernel reading or writing it (borrowed) */
	struct ape_be_event *load_e0, *load_e1; /* around its input copy */
	int64_t oc; /* -1: free */
	int64_t o0, n; /* its rows */
	int pending; /* jobs in flight */
	int issued; /* jobs issued */
	bool walking; /* its walk may still issue jobs */
	bool loaded; /* its inputs were enqueued, its accumulators initialised */
	double load_t; /* host clock when its copy was enqueued */
	uint64_t load_bytes;
	/* its read-back, enqueued on its queue as soon as its walk is done (after its last
	 * kernel, by an event wait), before its jobs retire on the host */
	bool back_issued;
	struct ape_be_event *back_e0, *back_e1;
	double back_t;
	uint64_t back_off;
	const void *back_host[APE__PASS_MAX_T];
};

/* An inner chunk's inputs, resident for as long as the slot is not needed for another. */
struct islot {
	struct ape_be_buf *buf[APE__PASS_MAX_T];
	int64_t chunk; /* -1: empty */
	struct ape_be_event *ready, *used;
	int busy; /* jobs in flight reading it */
};

/* One job (outer chunk x inner chunk) in flight, and its slot's buffers. */
struct jslot {
	struct ape_be_buf *buf[APE__PASS_MAX_T]; /* JOB_OUT and JOB_IN buffers */
	struct ape__hostmem stage; /* JOB_IN rows going out, then JOB_OUT rows coming back */
	struct ape_be_queue *up, *down; /* inner loads of this lane; read-backs of this slot */
	struct ape__pass_job pj; /* what the pass sees */
	struct oslot *os;
	int is; /* its inner slot; -1: inner inputs in place */
	int lane; /* the job slot whose up queue copied its inner chunk */
	bool loaded; /* it copied its inner chunk (load_e0, load_e1 are set) */
	/* nothing to read back and the only job of its stream: nothing on its down queue, and
	 * retiring it waits for the exec queue (three commands fewer on a call of one chunk) */
	bool back_on_exec;
	struct ape_be_kv_pages pages;
	struct ape_be_event *load_e0, *load_e1; /* around the copy of its inner chunk */
	struct ape_be_event *kernel_e0, *kernel_e1; /* around its kernels */
	struct ape_be_event *back_e0, *back_e1; /* around the copy of its outputs */
	double host_t[3]; /* host clock at enqueue: load, kernel, read-back */
	uint64_t load_bytes, back_bytes, scratch;
};

struct stage {
	struct ape__hostmem mem;
	bool pending; /* a copy from it may still be running on its queue */
};

struct interval {
	double t0, t1;
	bool kernel;
};

struct ape__stream {
	struct ape_device *dev;
	const struct ape_backend_plugin *ops;
	struct ape__stream_geom g;
	struct ape__devmem mem;
	int depth;
	struct ape_be_queue *exec;
	struct oslot os[APE__MAX_DEPTH];
	struct islot *is;
	int nis, max_is;
	struct stage inner_stage[APE__MAX_DEPTH]; /* per lane: inner rows packed for their copy */
	struct jslot ring[APE__MAX_DEPTH];
	struct ape_be_buf *call_buf[APE__PASS_MAX_T]; /* CALL_ACC and CALL_IN */
	struct ape__hostmem call_back, call_in; /* their staging: back, and in */

	/* the run in progress */
	const struct ape__stream_call *c;
	const struct ape__pass *pass;
	int at[APE__PASS_MAX_T]; /* APE__AT_*: each tensor's place in this run */
	struct ape_be_buf *wrap[APE__PASS_MAX_T]; /* the tensors wrapped where they lie */
	struct ape__stream_stats *st;
	struct ape__trace_dev *trace;
	int head, count; /* the ring of jobs in flight */
	unsigned nload; /* inner loads so far: their lane */
	int onext; /* the outer slot the next outer chunk tries first */
	struct oslot *cur; /* the outer chunk whose walk is issuing */
	int64_t diag; /* the current walk's first inner chunk: resident ones near it stay */
	struct interval *iv;
	size_t niv, capiv;
};

/* Bytes of n rows of tensor t. */
static inline uint64_t ape__stream_rows_bytes(const struct ape__stream *s, int t, int64_t n)
{
	return s->g.shape.t[t].row_bytes * (uint64_t)n;
}

/* Makes queue q wait for e, if there is one. */
static inline int ape__stream_wait_on(struct ape__stream *s, struct ape_be_queue *q,
				      struct ape_be_event *e)
{
	return e ? s->ops->event_wait(q, e) : 0;
}

/* Rows of outer chunk oc / inner chunk ic of the run. */
int64_t ape__stream_outer_rows(const struct ape__stream *s, int64_t oc, int64_t *first);
int64_t ape__stream_inner_rows(const struct ape__stream *s, int64_t ic, int64_t *first);

/* ---- the session's buffers and queues, allocated on first use (stream.c) */
int ape__stream_queue(struct ape__stream *s, struct ape_be_queue **q);
int ape__stream_ensure_host(struct ape__stream *s, struct ape__hostmem *m, uint64_t bytes);
int ape__stream_ensure_oslot(struct ape__stream *s, struct oslot *o);
int ape__stream_ensure_jslot(struct ape__stream *s, struct jslot *j);
int ape__stream_ensure_call(struct ape__stream *s);
/* One more inner slot; APE_ENOMEM beyond the first few only means "no more residency". */
int ape__stream_grow_inner(struct ape__stream *s);

/* ---- copies in (stream_load.c) */
/* Packs and sends outer chunk o's input rows; initialises its accumulators. */
int ape__stream_load_outer(struct ape__stream *s, struct oslot *o);
/* Makes job j's inner chunk resident, copying it unless it already is. */
int ape__stream_load_inner(struct ape__stream *s, struct jslot *j);
/* The view of tensor t's rows [r0, r0 + n) in a run: in its wrap, or its chunk buffer. */
struct ape_be_view ape__stream_view(const struct ape__stream *s, int t, int64_t r0, int64_t n);

/* ---- one job (stream_job.c) */
/* Enqueues everything of one job: its copies, its kernels, the copy back. */
int ape__stream_issue(struct ape__stream *s, struct oslot *o, int64_t ic);
/* Waits for the oldest job, hands its outputs to the pass, frees its slot. */
int ape__stream_retire(struct ape__stream *s);
/* Brings back an outer chunk whose jobs have all retired, hands it to the pass, frees it. */
int ape__stream_finish_outer(struct ape__stream *s, struct oslot *o);
/* Enqueues o's read-back on its queue after its last kernel (o->used), without waiting: the
 * walk is done, jobs may still be in flight. ape__stream_finish_outer() then waits for it. */
int ape__stream_issue_back(struct ape__stream *s, struct oslot *o);
/* After a failure: let every queue drain, then drop what the jobs in flight held. */
void ape__stream_unwind(struct ape__stream *s);

/* ---- device times (stream_time.c) */
/*
 * Accounts one span (between two completed events of one queue): its device time, and with
 * event timestamps its place in time for the overlap figure and the trace. Without them the
 * trace places it at `host_t` (when it was enqueued, or when what it waited for ended,
 * whichever is later). Its end goes to *end (may be NULL).
 */
int ape__stream_span(struct ape__stream *s, struct ape_be_event *e0, struct ape_be_event *e1,
		     int lane, const char *what, int64_t qc, int64_t kc, uint64_t bytes,
		     double host_t, double enq, double *end);
/* Room for n intervals, if the host has it (only a statistic: never fails). */
void ape__stream_reserve_intervals(struct ape__stream *s, size_t n);
/* Time copies and kernels of the run ran at once. */
double ape__stream_overlap_ms(struct ape__stream *s);

#pragma GCC visibility pop
#endif
