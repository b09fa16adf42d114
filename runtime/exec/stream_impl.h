/* SPDX-License-Identifier: MIT */
/*
 * The state of a device session, shared by the executor's files (exec/stream.h lists them) and
 * by nothing else.
 *
 * Queues: one compute queue, and per slot of the pipeline a host-to-device queue for key/value
 * chunks and a device-to-host queue for partial outputs, plus one host-to-device queue per
 * query-chunk buffer. Work is ordered across them by events only. The host waits for a
 * specific copy by synchronising the one queue that holds it (slot queues hold nothing else),
 * never for the device as a whole: with three slots, the copy of chunk i + 1 runs while chunk
 * i computes and chunk i - 1's output comes back.
 *
 * Events have one owner each: the job (a query chunk x key chunk launch) that recorded them,
 * or the query chunk that loaded its rows. Slots borrow them (`ready`, `used`) and the owner
 * clears the borrowed references when it retires, after which the work they stood for has
 * completed and nothing needs to wait for it any more.
 */
#ifndef APE_RUNTIME_STREAM_IMPL_H
#define APE_RUNTIME_STREAM_IMPL_H

#include "core/limits.h"
#include "exec/devmem.h"
#include "exec/lse_merge.h"
#include "exec/stream.h"
#include "topo/placement.h"

#pragma GCC visibility push(hidden)

struct qslot {
	struct ape__buf *buf;
	struct ape__event *ready; /* its rows have arrived (borrowed from the query chunk) */
	struct ape__event *used; /* the last kernel reading it (borrowed from a job) */
	/* the LSE of its query chunk's diagonal launch, which the launches after it take as
	 * lse_prior (plan.prior_bytes > 0); written and read on the compute queue only */
	struct ape__buf *prior;
};

struct kvslot {
	struct ape__buf *k, *v;
	int64_t chunk; /* -1: empty */
	struct ape__event *ready, *used;
	int busy; /* jobs in flight reading it */
};

struct outslot {
	struct ape__buf *o, *lse, *pairs, *ent, *md;
	struct ape__hostmem host; /* pairs | LSE | ENT | MD | O as they come back */
};

struct stage {
	struct ape__hostmem mem;
	bool pending; /* a copy from it may still be running on its queue */
};

/* A query chunk being computed. */
struct qrec {
	int64_t qc; /* -1: free */
	int64_t i0, n; /* its rows */
	int pending; /* jobs in flight */
	int jobs; /* jobs issued */
	bool issuing; /* its walk may still add jobs */
	bool loaded;
	int slot; /* query buffer */
	struct ape__acc acc; /* merge mode */
	float *qnorm; /* [B*H*n] for the skip bound */
	struct ape__event *e0, *e1; /* around its query copy */
	double host_t; /* host clock when the copy was enqueued */
	uint64_t bytes;
};

/* One launch: query chunk x key chunk, and the copies around it. */
struct job {
	struct qrec *qr;
	int64_t kc, j0, n;
	int kvs; /* key/value slot */
	int lane; /* copy queue of its load */
	bool loaded; /* it copied its key chunk (up0, up1 are set) */
	bool in_place; /* it reads its keys where the loader keeps them: no key/value slot */
	struct ape__event *up0, *up1, *k0, *k1, *d0, *d1;
	double host_t[3]; /* host clock at enqueue: load, kernel, read-back */
	uint64_t h2d, out_bytes, scratch;
};

struct interval {
	double t0, t1;
	bool kernel;
};

struct ape__stream {
	struct ape_device *dev;
	const struct ape__backend_ops *ops;
	struct ape__stream_geom g;
	struct ape__devmem mem;
	int depth;
	struct ape__queue *exec, *up[APE__MAX_DEPTH], *qup[2], *down[APE__MAX_DEPTH];
	struct qslot qs[2];
	struct kvslot *kv;
	int nkv, max_kv;
	struct stage kvst[APE__MAX_DEPTH], qst[2];
	struct outslot out[APE__MAX_DEPTH];
	struct qrec qr[APE__MAX_DEPTH + 1];
	uint64_t qnorm_rows; /* rows each qrec's qnorm holds */

	/* the run in progress */
	const struct ape__stream_call *c;
	struct ape__stream_stats *st;
	struct ape__trace_dev *trace;
	struct job ring[APE__MAX_DEPTH];
	int head, count;
	unsigned nload;
	int qnext;
	struct qrec *cur;
	struct ape__walk walk;
	/* key chunks the last closed walk proved negligible (<= dead_lo, >= dead_hi): first to
	 * be overwritten, since later query chunks lie farther from them still */
	int64_t dead_lo, dead_hi;
	struct ape__skip_ctx skip;
	struct ape__launch tmpl;
	struct interval *iv;
	size_t niv, capiv;
};

/* Bytes of n rows of `heads` heads (all batches) of esz-byte elements. */
static inline uint64_t ape__stream_row_bytes(const struct ape__stream *s, int64_t heads, int64_t n,
					     size_t esz)
{
	return (uint64_t)(s->g.B * heads * n * s->g.D) * esz;
}

/* Makes queue q wait for e, if there is one. */
static inline int ape__stream_wait_on(struct ape__stream *s, struct ape__queue *q,
				      struct ape__event *e)
{
	return e ? s->ops->event_wait(q, e) : 0;
}

/* ---- the session's buffers, allocated on first use (stream.c) */
int ape__stream_ensure_host(struct ape__stream *s, struct ape__hostmem *m, uint64_t bytes);
int ape__stream_ensure_out(struct ape__stream *s, int i);
int ape__stream_ensure_qslot(struct ape__stream *s, int i);
/* One more key/value slot; APE_ENOMEM beyond the first few only means "no more residency". */
int ape__stream_grow_kv(struct ape__stream *s);
int ape__stream_ensure_qrec(struct ape__stream *s, struct qrec *r, bool merge, bool norms);

/* ---- copies in (stream_load.c) */
/* Packs and sends the rows of r's query chunk; also their norms when skipping may happen. */
int ape__stream_load_query(struct ape__stream *s, struct qrec *r);
/* Makes key chunk j->kc resident, copying it unless it already is. */
int ape__stream_load_keys(struct ape__stream *s, struct job *j);

/* ---- one launch (stream_job.c) */
/* Enqueues everything of one job: its copies, its kernel, the copy back. */
int ape__stream_issue(struct ape__stream *s, struct qrec *r, int64_t kc);
/* Waits for the oldest job, merges or writes its result, and frees its slot. */
int ape__stream_retire(struct ape__stream *s);
/* Writes a query chunk whose jobs have all retired, and frees its record. */
int ape__stream_finish_query(struct ape__stream *s, struct qrec *r);
/* After a failure: let every queue drain, then drop what the jobs in flight held. */
void ape__stream_unwind(struct ape__stream *s);

/* ---- device times (stream_time.c) */
/*
 * Accounts one span (between two completed events of one queue): its device time, and with
 * event timestamps its place in time for the overlap figure and the trace. Without them the
 * trace places it at `host_t` (when it was enqueued, or when what it waited for ended,
 * whichever is later). Its end goes to *end (may be NULL).
 */
int ape__stream_span(struct ape__stream *s, struct ape__event *e0, struct ape__event *e1,
		     int lane, const char *what, int64_t qc, int64_t kc, uint64_t bytes,
		     double host_t, double *end);
/* Room for n intervals, if the host has it (only a statistic: never fails). */
void ape__stream_reserve_intervals(struct ape__stream *s, size_t n);
/* Time copies and kernels of the run ran at once. */
double ape__stream_overlap_ms(struct ape__stream *s);

#pragma GCC visibility pop
#endif
