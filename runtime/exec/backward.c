/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on one device or several (exec/backward.h), streamed in chunks under each
 * device's budget. The same path as the forward's: strided host rows packed into staging
 * (exec/pack.c), every device buffer counted against the budget (exec/devmem.c), copies,
 * launches, copies back; the forward's split (ape__split_ranges), threads
 * (ape__run_per_device) and trace file (exec/trace.c).
 *
 * Every device plans under its own budget; all then use the smallest chunk sizes any of them
 * needs. The key chunks are split into contiguous ranges, one per device, by the weights
 * (equal shares without them) and each key chunk's visible pairs. The split is fixed before
 * any work, with no stealing at the tail as the forward does, so that the same devices with
 * the same options compute the same chunks on the same backends and give the same bits.
 *
 * On each device, its key chunks outer, query chunks inner, both in increasing order, one
 * launch at a time:
 * - a key chunk's K and V go to the device once, with zeroed dK and dV accumulators that every
 *   query chunk's launch adds to (the op accumulates: core/backend.h); when its last query
 *   chunk is done they come back into host copies of the whole dK and dV;
 * - a query chunk's Q, O, dO, LSE and dLSE rows go with each launch; its dQ partial comes back
 *   after each launch and is added, in float64 and in key-chunk order, to the device's host
 *   accumulator;
 * - the parameter gradients accumulate on the device, in float64, over every launch.
 * Then, on the calling thread, the devices' dQ accumulators and parameter sums are added in
 * float64 in device order (which is key-chunk order: the ranges are contiguous); dK and dV of a
 * key chunk come from its one device. Every order is fixed, so two calls on the same devices
 * give the same bits; another device set (or another split) groups the float64 sums
 * differently, within rounding. A (query chunk, key chunk) pair the causal mask hides entirely
 * is never launched.
 *
 * The budget counts every chunk buffer and the scratch the backend declares for a launch
 * (attention_backward_scratch, core/backend.h), held from the launch until its synchronisation:
 * one launch is in flight at a time.
 *
 * On a device that reads host memory in place (buf_wrap takes it: OpenCL CPU devices, the
 * reference), where one chunk covers a whole input laid out as its staging would be, the input
 * is not copied: its buffer is the caller's tensor (wraps()); with one key chunk, dK and dV
 * accumulate straight into their host copies, with one query chunk too dQ into a float32 one
 * (wraps_output()). No device memory is counted for those.
 *
 * The caller's outputs are written only after every device's last launch succeeded, from
 * those host copies: a failure on any device stops the others and writes nothing. No
 * pipelining yet (pipeline_depth is not used): each launch is synchronised before the staging
 * is reused; devices run at the same time, each on its own thread.
 *
 * Copies and launches are timed with events (copy_ms, kernel_ms) and, with a trace path, are
 * the spans of the forward's trace file: one process per device, a lane for the kernels, one
 * for the query side's copies, one for the key side's, one for copies back.
 */
#include "exec/backward.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/limits.h"
#include "exec/devmem.h"
#include "exec/launch.h"
#include "exec/multidev.h"
#include "exec/pack.h"
#include "exec/plan.h"
#include "exec/skip_budget.h"
#include "exec/trace.h"

/* Device chunk buffers, each with its host staging. Rows of the query side, then the key side. */
enum { B_Q, B_O, B_DOUT, B_LSE, B_DLSE, B_DQ, B_PAIRS, B_K, B_V, B_DK, B_DV, NBUF };

struct chunk_buf {
	const char *what;
	const ape_tensor *t; /* the host tensor its rows come from (inputs), or NULL */
	const int64_t *s;
	uint64_t row_bytes; /* bytes per row of one chunk, all (b, h) together */
	bool used;
	bool wrapped; /* buf is the host tensor itself (buf_wrap): no staging, no copy, not counted */
	struct ape__buf *buf;
	void *host; /* staging of one chunk */
};

/* What the devices of a call share. */
struct bwd_shared {
	const struct ape__bwd_req *r;
	float *dk_all, *dv_all; /* [B, Hkv, Lk, D]: each device writes its key chunks' rows */
	atomic_bool abort; /* raised by a failing device: the others stop */
	struct ape__trace_dev *traces; /* one per device, when tracing */
	double t0; /* host clock at the start of the run */
};

/* Copies enqueued and timed by a pair of events, resolved at the queue's next synchronisation. */
struct span {
	struct ape__event *e0, *e1;
	int lane;
	const char *what;
	int64_t qc, kc;
	uint64_t bytes;
};

#define MAX_SPANS 4 /* copies enqueued between two synchronisations: at most 2 */

/* One device's part of the call. */
struct bwd_run {
	const struct ape__bwd_req *r;
	struct bwd_shared *sh;
	struct ape_device *dev;
	const struct ape__backend_ops *ops;
	struct ape__devmem mem;
	struct ape__queue *queue;
	int64_t cq, ck; /* rows per chunk */
	int64_t kc0, kc1; /* its key chunks [kc0, kc1) */
	struct chunk_buf b[NBUF];
	bool may_wrap; /* the device wraps host memory (probe_wrap()): wraps(), wraps_output() */
	ape_tensor lse_t, dlse_t; /* lse and dlse as [B, H, Lq, 1] float tensors */
	int64_t lse_s[4];
	struct ape__buf *dparams_buf;
	double *dparams_host;
	uint64_t dparams_bytes;
	double *dq_acc; /* [B, H, Lq, D]: the sum of dQ over its key chunks */
	float *dq_all; /* instead, where the DQ buffer wraps it (wraps_output()): dQ itself */
	struct ape__bwd_result res; /* its figures */
	struct span span[MAX_SPANS];
	int nspan;
	struct ape__trace_dev *trace; /* its recorder; NULL: not tracing */
	int ret; /* its outcome: 0, negative (msg holds the message) or 1 (stopped) */
	char msg[1024];
};

/* Key chunks of ck rows. */
static int64_t key_chunks(const struct bwd_run *x, int64_t ck)
{
	return ck > 0 ? (x->r->p->Lk + ck - 1) / ck : 1;
}

void ape__bwd_launch_shape(const struct ape__problem *p, ape_dtype dout_dtype, int64_t nkc,
			   struct ape__bwd_launch *l, int64_t i0, int64_t nq, int64_t j0, int64_t nk)
{
	memset(l, 0, sizeof(*l));
	/* skip_tol shared by the nkc key chunks a row meets: launch tests of t / (1 + t) each add
	 * up to skip_tol / (1 + skip_tol) of the row's weight with t = skip_tol / (nk + skip_tol
	 * (nk - 1)) (docs/kernels.md, "Skipping in the backward pass"); 0 when the decays do not
	 * allow skipping */
	ape__launch_init(&l->f, p, p->out_dtype,
			 ape__skip_allowed(p)
				 ? p->skip_tol / ((double)nkc + p->skip_tol * ((double)nkc - 1))
				 : 0.0);
	l->f.Lq = nq;
	l->f.Lk = nk;
	l->f.q_start = p->q_start + i0; /* validated: positions of every row fit */
	l->f.k_start = p->k_start + j0;
	l->dout_dtype = dout_dtype;
}

/* Launch l of query rows [i0, i0 + nq) against key rows [j0, j0 + nk), in key chunks of ck rows,
 * without its buffers: what the launch and the plan's scratch figure both start from. */
static void launch_shape(const struct bwd_run *x, int64_t ck, struct ape__bwd_launch *l,
			 int64_t i0, int64_t nq, int64_t j0, int64_t nk)
{
	ape__bwd_launch_shape(x->r->p, x->r->dout->dtype, key_chunks(x, ck), l, i0, nq, j0, nk);
}

/* The APE__BWD_* parts of every launch of the call. */
static unsigned launch_parts(const struct bwd_run *x)
{
	return (x->b[B_DQ].used ? APE__BWD_DQ : 0u) | (x->b[B_DK].used ? APE__BWD_DK : 0u) |
	       (x->b[B_DV].used ? APE__BWD_DV : 0u) | (x->r->dparams ? APE__BWD_DPARAMS : 0u) |
	       (x->b[B_DLSE].used ? APE__BWD_DLSE : 0u) | (x->b[B_PAIRS].used ? APE__BWD_PAIRS : 0u);
}

/* The scratch the backend declares for a launch of nq query rows and nk key rows (0 without
 * the op). */
static uint64_t launch_scratch(const struct bwd_run *x, int64_t ck, int64_t nq, int64_t nk)
{
	struct ape__bwd_launch l;

	if (!x->ops->attention_backward_scratch)
		return 0;
	launch_shape(x, ck, &l, 0, nq, 0, nk);
	return x->ops->attention_backward_scratch(x->dev, &l, launch_parts(x));
}

/* Whether rows [0, n) of tensor t (strides s) lie in its memory as ape__pack_rows() would
 * stage them: n is all of its rows, each (batch, head)'s rows contiguous, one after another. */
static bool packed_in_place(const ape_tensor *t, const int64_t s[4], int64_t n)
{
	const int64_t H = t->shape[1], D = t->shape[3];

	return n == t->shape[2] && s[3] == 1 && s[2] == D && (H == 1 || s[1] == n * D) &&
	       (t->shape[0] == 1 || s[0] == H * n * D);
}

/* Whether buffer i, with chunks of `rows` rows, is the caller's input itself (buf_wrap): on a
 * device that wraps host memory, an input whose one chunk is its whole tensor, already in the
 * staging's layout. Such a buffer takes no device memory, no staging and no copy. */
static bool wraps(const struct bwd_run *x, int i, int64_t rows)
{
	const struct chunk_buf *c = &x->b[i];

	return x->may_wrap && c->t && packed_in_place(c->t, c->s, rows);
}

/*
 * Whether output buffer i is a host copy of the whole gradient itself (buf_wrap), which the
 * launches accumulate into in place: on a device that wraps host memory, dK and dV with one key
 * chunk (the host copies dk_all and dv_all, in the staging's layout then), dQ with one key chunk
 * and one query chunk (dq_all: the one partial is the sum). The caller's outputs are still
 * written only at the end, from these copies.
 */
static bool wraps_output(const struct bwd_run *x, int i, int64_t cq, int64_t ck)
{
	const struct ape__problem *p = x->r->p;

	return x->may_wrap && x->b[i].used && ck == p->Lk &&
	       (i == B_DK || i == B_DV || (i == B_DQ && cq == p->Lq));
}

/* Device bytes of chunks of cq query rows and ck key rows: the buffers and the largest
 * launch's scratch (the figure does not decrease with the rows: core/backend.h). */
static uint64_t chunk_bytes(const struct bwd_run *x, int64_t cq, int64_t ck)
{
	uint64_t n = x->dparams_bytes + launch_scratch(x, ck, cq, ck);

	for (int i = 0; i < NBUF; i++)
		if (x->b[i].used && !wraps(x, i, i < B_K ? cq : ck) &&
		    !wraps_output(x, i, cq, ck))
			n += x->b[i].row_bytes * (uint64_t)(i < B_K ? cq : ck);
	return n;
}

static uint64_t largest_buffer(const struct bwd_run *x, int64_t cq, int64_t ck)
{
	uint64_t m = x->dparams_bytes;

	for (int i = 0; i < NBUF; i++) {
		uint64_t n = x->b[i].row_bytes * (uint64_t)(i < B_K ? cq : ck);

		m = x->b[i].used && n > m ? n : m;
	}
	return m;
}

/* Chunk sizes that fit: the most rows the caller allows, the larger side halved until the
 * buffers fit the budget and the device's largest allocation. */
static int plan(struct bwd_run *x, int64_t max_cq, int64_t max_ck, uint64_t budget)
{
	const struct ape__bwd_req *r = x->r;
	const struct ape__problem *p = r->p;
	struct ape_device *dev = x->dev;
	const uint64_t max_buf = dev->be->ops->max_alloc ? dev->be->ops->max_alloc(dev) : UINT64_MAX;
	int64_t cq = p->Lq < max_cq ? p->Lq : max_cq, ck = p->Lk < max_ck ? p->Lk : max_ck;

	while (chunk_bytes(x, cq, ck) > budget || largest_buffer(x, cq, ck) > max_buf) {
		if (cq == 1 && ck == 1)
			return ape__error(APE_ENOMEM,
					  "%s: %s:%d %s: budget %" PRIu64
					  " bytes cannot hold the backward pass's chunk of 1 query row "
					  "and 1 key row (B=%" PRId64 ", H=%" PRId64 ", Hkv=%" PRId64
					  ", D=%" PRId64 ", %s): that needs %" PRIu64
					  " bytes (%" PRIu64 " of them the backend's scratch), in "
					  "buffers of up to %" PRIu64 " bytes (largest allocation %" PRIu64
					  ")",
					  r->fn, dev->info.backend, dev->info.backend_index,
					  dev->info.name, budget, p->B, p->H, p->Hkv, p->D,
					  ape_dtype_name(p->in_dtype), chunk_bytes(x, 1, 1),
					  launch_scratch(x, 1, 1, 1), largest_buffer(x, 1, 1), max_buf);
		if (cq >= ck)
			cq = (cq + 1) / 2;
		else
			ck = (ck + 1) / 2;
	}
	x->cq = cq;
	x->ck = ck;
	return 0;
}

static void describe(struct bwd_run *x)
{
	const struct ape__bwd_req *r = x->r;
	const struct ape__problem *p = r->p;
	const uint64_t bh = (uint64_t)(p->B * p->H), bkv = (uint64_t)(p->B * p->Hkv);
	const uint64_t D = (uint64_t)p->D, esz = ape_dtype_size(p->in_dtype);
	/* what, the host tensor and its strides, row bytes, used */
#define CB(w_, t_, s_, rb_, u_) \
	{ .what = (w_), .t = (t_), .s = (s_), .row_bytes = (rb_), .used = (u_) }
	const struct chunk_buf b[NBUF] = {
		[B_Q] = CB("q", r->q, p->qs, bh * D * esz, true),
		[B_O] = CB("o", r->o, p->os, bh * D * ape_dtype_size(p->out_dtype), true),
		[B_DOUT] = CB("dout", r->dout, r->dout_s, bh * D * ape_dtype_size(r->dout->dtype),
			      true),
		[B_LSE] = CB("lse", &x->lse_t, x->lse_s, bh * sizeof(float), true),
		[B_DLSE] = CB("dlse", &x->dlse_t, x->lse_s, bh * sizeof(float), r->dlse != NULL),
		[B_DQ] = CB("dq", NULL, NULL, bh * D * sizeof(float), r->dq != NULL),
		/* each row's pairs computed, when the launches may skip keys */
		[B_PAIRS] = CB("pairs", NULL, NULL, bh * sizeof(uint64_t), ape__skip_allowed(p)),
		[B_K] = CB("k", r->k, p->ks, bkv * D * esz, true),
		[B_V] = CB("v", r->v, p->vs, bkv * D * esz, true),
		[B_DK] = CB("dk", NULL, NULL, bkv * D * sizeof(float), r->dk != NULL),
		[B_DV] = CB("dv", NULL, NULL, bkv * D * sizeof(float), r->dv != NULL),
	};
#undef CB

	memcpy(x->b, b, sizeof(b));
	/* LSE rows are a [B, H, Lq, 1] tensor to the packer */
	ape_tensor_init(&x->lse_t, (void *)r->lse, APE_F32, p->B, p->H, p->Lq, 1);
	ape_tensor_init(&x->dlse_t, (void *)r->dlse, APE_F32, p->B, p->H, p->Lq, 1);
	ape_tensor_strides(&x->lse_t, x->lse_s);
	x->dparams_bytes = r->dparams ? (uint64_t)p->H * 4 * sizeof(double) : 0;
}

/* Bytes of buffer i's chunk. */
static uint64_t chunk_buf_bytes(const struct bwd_run *x, int i)
{
	return x->b[i].row_bytes * (uint64_t)(i < B_K ? x->cq : x->ck);
}

/*
 * Host memory of one device with key chunks, before any device work: chunk staging, its dQ
 * accumulator (or dq_all) and its parameter sums. Buffers that wraps() or wraps_output() get
 * no staging: alloc_device() wraps the host memory itself.
 */
static int prepare_host(struct bwd_run *x)
{
	const struct ape__bwd_req *r = x->r;
	const struct ape__problem *p = r->p;
	const size_t qgrad = (size_t)(p->B * p->H * p->Lq * p->D);

	for (int i = 0; i < NBUF; i++) {
		struct chunk_buf *c = &x->b[i];

		if (!c->used || wraps(x, i, i < B_K ? x->cq : x->ck) ||
		    wraps_output(x, i, x->cq, x->ck))
			continue;
		if (!(c->host = ape__malloc((size_t)chunk_buf_bytes(x, i))))
			goto out_nomem;
	}
	/* zeros: the rows of a query chunk the causal mask hides get no launch */
	if (wraps_output(x, B_DQ, x->cq, x->ck) ? !(x->dq_all = ape__calloc(qgrad, sizeof(float)))
				  : r->dq && !(x->dq_acc = ape__calloc(qgrad, sizeof(double))))
		goto out_nomem;
	if (r->dparams && !(x->dparams_host = ape__malloc((size_t)x->dparams_bytes)))
		goto out_nomem;
	return 0;
out_nomem:
	return ape__error(APE_ENOMEM, "%s: out of host memory staging the backward pass", r->fn);
}

/* Buffer c over the host memory at host (wraps(), wraps_output(): no staging). */
static int wrap_host(struct bwd_run *x, struct chunk_buf *c, void *host, uint64_t bytes)
{
	size_t got;
	int ret = x->ops->buf_wrap(x->dev, APE__MEM_HOST, host, (size_t)bytes, &c->buf, &got);

	c->wrapped = ret == 0;
	return ret;
}

/*
 * Whether the device wraps host memory in place (*yes), asked of buf_wrap with the LSE array's
 * first element (a device that copies refuses with APE_ENOTSUP): the plan and the buffers
 * follow it. 0, or the op's failure.
 */
static int probe_wrap(struct bwd_run *x, bool *yes)
{
	struct ape__buf *b = NULL;
	size_t got;
	int ret;

	*yes = false;
	if (!x->ops->buf_wrap)
		return 0;
	ret = x->ops->buf_wrap(x->dev, APE__MEM_HOST, (void *)x->r->lse, sizeof(float), &b, &got);
	if (ret == APE_ENOTSUP) {
		ape__error(0, "%s", ""); /* copied, as before */
		return 0;
	}
	if (ret)
		return ape__error_prefix(ape__error_on(ret, x->dev), x->r->fn);
	x->ops->buf_free(x->dev, b);
	*yes = true;
	return 0;
}

static int alloc_device(struct bwd_run *x)
{
	float *const out[NBUF] = { [B_DQ] = x->dq_all, [B_DK] = x->sh->dk_all,
				    [B_DV] = x->sh->dv_all };
	int ret;

	if ((ret = x->ops->queue_create(x->dev, &x->queue)))
		return ret;
	for (int i = 0; i < NBUF; i++) {
		struct chunk_buf *c = &x->b[i];
		const uint64_t bytes = chunk_buf_bytes(x, i);

		if (!c->used)
			continue;
		if (wraps(x, i, i < B_K ? x->cq : x->ck))
			ret = wrap_host(x, c, c->t->data, bytes);
		else if (wraps_output(x, i, x->cq, x->ck))
			ret = wrap_host(x, c, out[i], bytes);
		else
			ret = ape__devmem_alloc(&x->mem, bytes, &c->buf, c->what);
		if (ret)
			return ret;
	}
	if (x->r->dparams &&
	    ((ret = ape__devmem_alloc(&x->mem, x->dparams_bytes, &x->dparams_buf, "dparams")) ||
	     (ret = x->ops->fill(x->queue, x->dparams_buf, 0, 0, (size_t)x->dparams_bytes))))
		return ret;
	return 0;
}

/* ------------------------------------------------------------------ timing and the trace */

/*
 * A copy or launch between events e0 and e1, both complete: its device time to copy_ms or
 * kernel_ms and, when tracing, a span ending at e1's timestamp (the host clock now without
 * timestamps): e0's own time would also count what the queue waited for.
 */
static int span_add(struct bwd_run *x, struct ape__event *e0, struct ape__event *e1, int lane,
		    const char *what, int64_t qc, int64_t kc, uint64_t bytes)
{
	double ms = 0, t1 = ape__now_ms() - x->sh->t0;
	int ret;

	if ((ret = x->ops->event_elapsed(e0, e1, &ms)))
		return ret;
	if (lane == APE__LANE_KERNEL)
		x->res.kernel_ms += ms;
	else
		x->res.copy_ms += ms;
	if (!x->trace)
		return 0;
	if (x->ops->event_timestamp && (ret = x->ops->event_timestamp(e1, &t1)))
		return ret;
	ape__trace_add(x->trace, what, lane, t1 - ms, t1, qc, kc, bytes);
	return 0;
}

/* The event before a group of copies. */
static int span_begin(struct bwd_run *x, struct ape__event **e0)
{
	return x->ops->event_record(x->queue, e0);
}

/* The event after them: the span waits for the queue's next synchronisation. */
static int span_end(struct bwd_run *x, struct ape__event *e0, int lane, const char *what,
		    int64_t qc, int64_t kc, uint64_t bytes)
{
	struct ape__event *e1 = NULL;
	int ret = x->ops->event_record(x->queue, &e1);

	if (ret || x->nspan == MAX_SPANS) {
		x->ops->event_destroy(e0);
		x->ops->event_destroy(e1);
		return ret;
	}
	x->span[x->nspan++] = (struct span){ e0, e1, lane, what, qc, kc, bytes };
	return 0;
}

/* Drops the spans not yet resolved (a failed run). */
static void spans_drop(struct bwd_run *x)
{
	for (int i = 0; i < x->nspan; i++) {
		x->ops->event_destroy(x->span[i].e0);
		x->ops->event_destroy(x->span[i].e1);
	}
	x->nspan = 0;
}

/* Waits for the queue, then resolves the spans enqueued before. */
static int sync(struct bwd_run *x)
{
	int ret = x->ops->synchronize(x->queue);

	for (int i = 0; !ret && i < x->nspan; i++) {
		const struct span *s = &x->span[i];

		ret = span_add(x, s->e0, s->e1, s->lane, s->what, s->qc, s->kc, s->bytes);
	}
	spans_drop(x);
	return ret;
}

/* ------------------------------------------------------------------ one device's chunks */

/* Rows [l0, l0 + n) of the inputs of one side (first..last) to the device; the bytes to *bytes. */
static int upload_rows(struct bwd_run *x, int first, int last, int64_t l0, int64_t n,
		       uint64_t *bytes)
{
	int ret;

	for (int i = first; i <= last; i++) {
		struct chunk_buf *c = &x->b[i];
		const size_t len = (size_t)(c->row_bytes * (uint64_t)n);

		if (!c->used || !c->t || c->wrapped)
			continue;
		ape__pack_rows(c->host, c->t, c->s, l0, n);
		if ((ret = x->ops->copy_h2d(x->queue, c->buf, 0, c->host, len)))
			return ret;
		*bytes += len;
	}
	return 0;
}

/* Zeroes the accumulator of buffer i for n rows. */
static int zero_rows(struct bwd_run *x, int i, int64_t n)
{
	struct chunk_buf *c = &x->b[i];

	if (!c->used)
		return 0;
	return x->ops->fill(x->queue, c->buf, 0, 0, (size_t)(c->row_bytes * (uint64_t)n));
}

/* Enqueues the copy of buffer i's n rows back into its staging; the bytes to *bytes. */
static int download_rows(struct bwd_run *x, int i, int64_t n, uint64_t *bytes)
{
	struct chunk_buf *c = &x->b[i];
	const size_t len = (size_t)(c->row_bytes * (uint64_t)n);
	int ret;

	if (!c->used || c->wrapped) /* a wrapped one is there already */
		return 0;
	if ((ret = x->ops->copy_d2h(x->queue, c->host, c->buf, 0, len)))
		return ret;
	*bytes += len;
	return 0;
}

/* Buffers i and i2's n rows back into their staging (a span of the trace), and waits. */
static int copy_back(struct bwd_run *x, int i, int i2, int64_t n, const char *what, int64_t qc,
		     int64_t kc)
{
	struct ape__event *e0 = NULL;
	uint64_t down = 0;
	int ret;

	if ((!x->b[i].used || x->b[i].wrapped) && (!x->b[i2].used || x->b[i2].wrapped))
		return 0;
	if ((ret = span_begin(x, &e0)))
		return ret;
	if ((ret = download_rows(x, i, n, &down)) || (ret = download_rows(x, i2, n, &down))) {
		x->ops->event_destroy(e0);
		return ret;
	}
	x->res.d2h += down;
	if ((ret = span_end(x, e0, APE__LANE_D2H, what, qc, kc, down)))
		return ret;
	return sync(x);
}

/* The launch of query chunk qc, rows [i0, i0 + nq), against key chunk kc, rows [j0, j0 + nk). */
static int launch(struct bwd_run *x, int64_t qc, int64_t i0, int64_t nq, int64_t kc, int64_t j0,
		  int64_t nk)
{
	struct ape__event *e0 = NULL, *e1 = NULL;
	struct ape__bwd_launch l;
	uint64_t scratch;
	int ret;

	launch_shape(x, x->ck, &l, i0, nq, j0, nk);
	l.f.pairs = x->b[B_PAIRS].buf;
	l.f.q = x->b[B_Q].buf;
	l.f.k = x->b[B_K].buf;
	l.f.v = x->b[B_V].buf;
	l.f.o = x->b[B_O].buf;
	l.f.lse = x->b[B_LSE].buf;
	l.dout = x->b[B_DOUT].buf;
	l.dlse = x->b[B_DLSE].buf;
	l.dq = x->b[B_DQ].buf;
	l.dk = x->b[B_DK].buf;
	l.dv = x->b[B_DV].buf;
	l.dparams = x->dparams_buf;

	/* the backend's scratch, held until the launch is synchronised: the plan made room */
	scratch = x->ops->attention_backward_scratch
			  ? x->ops->attention_backward_scratch(x->dev, &l, ape__bwd_parts(&l))
			  : 0;
	ape__devmem_hold(&x->mem, scratch);
	if (!(ret = x->ops->event_record(x->queue, &e0)) &&
	    !(ret = x->ops->attention_backward(x->queue, &l)) &&
	    !(ret = x->ops->event_record(x->queue, &e1)) && !(ret = sync(x)) &&
	    !(ret = span_add(x, e0, e1, APE__LANE_KERNEL, "attention backward", qc, kc, 0)))
		x->res.launches++;
	/* synchronised, or failed: a queue that failed is destroyed, and waited for, before any
	 * other buffer is freed (release_device()) */
	ape__devmem_drop(&x->mem, scratch);
	x->ops->event_destroy(e0);
	x->ops->event_destroy(e1);
	return ret;
}

/*
 * The pairs buffer before a launch: each row's visible keys among the launch's, what a backend
 * that skips nothing computes (it may leave the buffer as it is), its bytes to *up; after: their
 * sum.
 */
static int pairs_before(struct bwd_run *x, int64_t i0, int64_t nq, int64_t j0, int64_t nk,
			uint64_t *up)
{
	const struct ape__problem *p = x->r->p;
	struct chunk_buf *c = &x->b[B_PAIRS];
	uint64_t *h = c->host;
	size_t bytes = (size_t)(c->row_bytes * (uint64_t)nq);
	int ret;

	if (!c->used)
		return 0;
	for (int64_t bh = 0; bh < p->B * p->H; bh++)
		for (int64_t i = 0; i < nq; i++) {
			/* causal: keys at n >= 0; distances are validated to fit, not one more
			 * (fuzz_problem: a distance of INT64_MAX) */
			const int64_t d = p->q_start + i0 + i - (p->k_start + j0);
			const int64_t v = !p->causal ? nk : d < 0 ? 0 : d >= nk ? nk : d + 1;

			h[bh * nq + i] = (uint64_t)v;
		}
	if ((ret = x->ops->copy_h2d(x->queue, c->buf, 0, h, bytes)))
		return ret;
	*up += bytes;
	return 0;
}

static void pairs_after(struct bwd_run *x, int64_t nq)
{
	const struct chunk_buf *c = &x->b[B_PAIRS];
	const uint64_t *h = c->host;

	if (!c->used)
		return;
	for (int64_t r = 0; r < x->r->p->B * x->r->p->H * nq; r++)
		x->res.pairs_computed += h[r];
	x->res.pairs_counted = true;
}

/* Adds a query chunk's dQ partial (staging, [B, H, nq, D] float) into the accumulator. */
static void add_dq(struct bwd_run *x, int64_t i0, int64_t nq)
{
	const struct ape__problem *p = x->r->p;
	const float *part = x->b[B_DQ].host;
	const int64_t D = p->D;

	for (int64_t bh = 0; bh < p->B * p->H; bh++)
		for (int64_t i = 0; i < nq; i++)
			for (int64_t d = 0; d < D; d++)
				x->dq_acc[(bh * p->Lq + i0 + i) * D + d] += part[(bh * nq + i) * D + d];
}

/* A key chunk's finished dK or dV (staging, [B, Hkv, nk, D] float) into its host copy. */
static void place_dkv(struct bwd_run *x, int i, float *all, int64_t j0, int64_t nk)
{
	const struct ape__problem *p = x->r->p;
	ape_tensor t;
	int64_t s[4];

	if (!all || x->b[i].wrapped) /* the launches wrote it */
		return;
	ape_tensor_init(&t, all, APE_F32, p->B, p->Hkv, p->Lk, p->D);
	ape_tensor_strides(&t, s);
	ape__unpack_rows(x->b[i].host, &t, s, j0, nk);
}

/* Whether any query of rows [i0, i0 + nq) sees any key of rows [j0, j0 + nk). */
static bool chunk_visible(const struct ape__problem *p, int64_t i0, int64_t nq, int64_t j0)
{
	/* the last query against the first key; distances are validated to fit */
	return !p->causal || p->q_start + (i0 + nq - 1) - (p->k_start + j0) >= 0;
}


/* Query chunk qc against key chunk kc: the query side up, the launch, dQ and pairs back. */
static int query_chunk(struct bwd_run *x, int64_t qc, int64_t kc, int64_t j0, int64_t nk)
{
	const int64_t Lq = x->r->p->Lq, i0 = qc * x->cq, nq = Lq - i0 < x->cq ? Lq - i0 : x->cq;
	struct ape__event *e0 = NULL;
	uint64_t up = 0;
	int ret;

	if ((ret = span_begin(x, &e0)))
		return ret;
	if ((ret = upload_rows(x, B_Q, B_DLSE, i0, nq, &up)) ||
	    (ret = pairs_before(x, i0, nq, j0, nk, &up))) {
		x->ops->event_destroy(e0);
		return ret;
	}
	x->res.h2d += up;
	if ((ret = span_end(x, e0, APE__LANE_H2D_Q, "h2d Q/O/dO", qc, kc, up)) ||
	    (ret = zero_rows(x, B_DQ, nq)) || (ret = launch(x, qc, i0, nq, kc, j0, nk)))
		return ret;
	if ((ret = copy_back(x, B_DQ, B_PAIRS, nq, "d2h dQ", qc, kc)))
		return ret;
	pairs_after(x, nq);
	if (x->dq_acc)
		add_dq(x, i0, nq);
	return 0;
}

/* Key chunk kc: K and V up, zeroed dK and dV, every query chunk that sees it, dK and dV back. */
static int key_chunk(struct bwd_run *x, int64_t kc)
{
	const struct ape__problem *p = x->r->p;
	const int64_t j0 = kc * x->ck, nk = p->Lk - j0 < x->ck ? p->Lk - j0 : x->ck;
	struct ape__event *e0 = NULL;
	uint64_t up = 0;
	int ret;

	if ((ret = span_begin(x, &e0)))
		return ret;
	if ((ret = upload_rows(x, B_K, B_V, j0, nk, &up))) {
		x->ops->event_destroy(e0);
		return ret;
	}
	x->res.h2d += up;
	if ((ret = span_end(x, e0, APE__LANE_H2D_KV, "h2d K/V", -1, kc, up)) ||
	    (ret = zero_rows(x, B_DK, nk)) || (ret = zero_rows(x, B_DV, nk)))
		return ret;
	for (int64_t qc = 0; qc * x->cq < p->Lq; qc++) {
		const int64_t i0 = qc * x->cq, nq = p->Lq - i0 < x->cq ? p->Lq - i0 : x->cq;

		if (atomic_load(&x->sh->abort))
			return 1;
		if (chunk_visible(p, i0, nq, j0) && (ret = query_chunk(x, qc, kc, j0, nk)))
			return ret;
	}
	if ((ret = copy_back(x, B_DK, B_DV, nk, "d2h dK/dV", -1, kc)))
		return ret;
	place_dkv(x, B_DK, x->sh->dk_all, j0, nk);
	place_dkv(x, B_DV, x->sh->dv_all, j0, nk);
	return 0;
}

/* One device's key chunks, then its parameter sums back. */
static int run_chunks(struct bwd_run *x)
{
	int ret;

	for (int64_t kc = x->kc0; kc < x->kc1; kc++)
		if ((ret = key_chunk(x, kc)))
			return ret;
	if (x->r->dparams &&
	    ((ret = x->ops->copy_d2h(x->queue, x->dparams_host, x->dparams_buf, 0,
				     (size_t)x->dparams_bytes)) ||
	     (ret = sync(x))))
		return ret;
	x->res.d2h += x->dparams_bytes;
	return 0;
}

/* Device buffers and the queue, freed by the device's own thread once its work is done. */
static void release_device(struct bwd_run *x)
{
	if (x->queue)
		x->ops->queue_destroy(x->queue); /* waits for what is still in flight */
	x->queue = NULL;
	spans_drop(x);
	for (int i = 0; i < NBUF; i++) {
		struct chunk_buf *c = &x->b[i];

		if (c->wrapped)
			x->ops->buf_free(x->dev, c->buf); /* host memory: only the hold */
		else
			ape__devmem_free(&x->mem, &c->buf, chunk_buf_bytes(x, i));
		c->buf = NULL;
		c->wrapped = false;
	}
	ape__devmem_free(&x->mem, &x->dparams_buf, x->dparams_bytes);
}

static void release_host(struct bwd_run *x)
{
	for (int i = 0; i < NBUF; i++)
		free(x->b[i].host);
	free(x->dparams_host);
	free(x->dq_acc);
	free(x->dq_all);
}

/* The work of device d (ape__run_per_device()): a failure raises the abort flag and keeps its
 * message, naming the device. */
static void device_main(void *arg, int d)
{
	struct bwd_run *x = &((struct bwd_run *)arg)[d];

	if (x->trace)
		x->trace->host_start_ms = ape__now_ms() - x->sh->t0;
	if (x->kc0 < x->kc1) {
		x->ret = alloc_device(x);
		if (!x->ret)
			x->ret = run_chunks(x);
	}
	release_device(x);
	if (x->ret < 0) {
		ape__error_prefix(ape__error_on(x->ret, x->dev), x->r->fn);
		snprintf(x->msg, sizeof(x->msg), "%s", ape_last_error());
		atomic_store(&x->sh->abort, true);
	}
}

/*
 * Only after every launch succeeded: the float32 copies (dQ rounded from its float64 sum, or
 * dq_all, the one partial, with -0 made +0 as that sum makes it), converted for 16-bit tensors,
 * into the caller's layout. Every conversion buffer is taken before the first byte is written,
 * so that running out of memory here writes nothing too.
 */
static int write_outputs(const struct bwd_shared *sh, const double *dq_acc, float *dq_all,
			 const double *dparams)
{
	const struct ape__bwd_req *r = sh->r;
	const struct ape__problem *p = r->p;
	const size_t nq = (size_t)(p->B * p->H * p->Lq * p->D);
	ape_tensor *ts[3] = { r->dq, r->dk, r->dv };
	const int64_t *ss[3] = { r->dq_s, r->dk_s, r->dv_s };
	const float *all[3] = { NULL, sh->dk_all, sh->dv_all };
	float *dq32 = NULL;
	void *conv[3] = { NULL, NULL, NULL };
	int ret = 0;

	if (r->dq && dq_all) {
		/* (float)(0.0 + (double)x) is x + 0.0f: x, but +0 for -0 */
		for (size_t i = 0; i < nq; i++)
			dq_all[i] += 0.0f;
		all[0] = dq_all;
	} else if (r->dq) {
		dq32 = ape__malloc(nq * sizeof(float) + 1);
		if (!dq32)
			goto out_nomem;
		for (size_t i = 0; i < nq; i++)
			dq32[i] = (float)dq_acc[i];
		all[0] = dq32;
	}
	for (int i = 0; i < 3; i++) {
		size_t n;

		if (!ts[i] || ts[i]->dtype == APE_F32)
			continue;
		n = (size_t)(ts[i]->shape[0] * ts[i]->shape[1] * ts[i]->shape[2] * ts[i]->shape[3]);
		conv[i] = ape__malloc(n * ape_dtype_size(ts[i]->dtype) + 1);
		if (!conv[i])
			goto out_nomem;
		ape_convert(conv[i], ts[i]->dtype, all[i], APE_F32, n);
	}
	for (int i = 0; i < 3; i++)
		if (ts[i])
			ape__unpack_rows(conv[i] ? conv[i] : all[i], ts[i], ss[i], 0,
					 ts[i]->shape[2]);
	for (int64_t i = 0; r->dparams && i < 4 * p->H; i++)
		r->dparams[i] = (float)dparams[i];
	goto out_free;
out_nomem:
	ret = ape__error(APE_ENOMEM, "%s: out of host memory converting the gradients", r->fn);
out_free:
	free(dq32);
	for (int i = 0; i < 3; i++)
		free(conv[i]);
	return ret;
}

int ape__backward_supported(const char *fn, const struct ape_device *dev)
{
	if (dev->be->ops->attention_backward)
		return 0;
	return ape__error(APE_ENOTSUP,
			  "%s: %s:%d %s: the backward pass is not implemented on this backend yet",
			  fn, dev->info.backend, dev->info.backend_index, dev->info.name);
}

/* ------------------------------------------------------------------ the call */

/* Every device planned with the same chunk sizes: the smallest any of them needs (a plan
 * only shrinks, so the second pass settles). */
static int plan_all(struct bwd_run *x, int n)
{
	const struct ape__bwd_req *r = x[0].r;
	int64_t cq = r->chunk_q ? r->chunk_q : APE__CHUNK_DEFAULT;
	int64_t ck = r->chunk_k ? r->chunk_k : APE__CHUNK_DEFAULT;
	bool settled = false;
	int ret;

	while (!settled) {
		int64_t ncq = cq, nck = ck;

		for (int d = 0; d < n; d++) {
			if ((ret = plan(&x[d], cq, ck, x[d].mem.budget)))
				return ret;
			ncq = x[d].cq < ncq ? x[d].cq : ncq;
			nck = x[d].ck < nck ? x[d].ck : nck;
		}
		settled = true;
		for (int d = 0; d < n; d++)
			settled &= x[d].cq == ncq && x[d].ck == nck;
		cq = ncq;
		ck = nck;
	}
	return 0;
}

/* Key chunks split into contiguous ranges by the weights and each chunk's visible pairs. */
static int split_keys(struct bwd_run *x, int n)
{
	const struct ape__bwd_req *r = x[0].r;
	const struct ape__problem *p = r->p;
	const int64_t ck = x[0].ck, nk = key_chunks(&x[0], ck);
	int64_t bounds[APE_MAX_DEVICES + 1];
	double weight[APE_MAX_DEVICES];
	double *cost;

	if (n == 1) {
		x[0].kc0 = 0;
		x[0].kc1 = nk;
		return 0;
	}
	cost = ape__malloc((size_t)nk * sizeof(double) + 1);
	if (!cost)
		return ape__error(APE_ENOMEM, "%s: out of memory splitting the work", r->fn);
	for (int64_t c = 0; c < nk; c++) {
		struct ape__problem sub = *p;
		uint64_t pairs = 0;

		sub.k_start = p->k_start + c * ck;
		sub.Lk = p->Lk - c * ck < ck ? p->Lk - c * ck : ck;
		cost[c] = ape__head_visible_pairs(&sub, &pairs) ? (double)p->Lq * (double)sub.Lk
								 : (double)pairs + 1;
	}
	for (int d = 0; d < n; d++)
		weight[d] = r->weights ? r->weights[d] : 1.0;
	ape__split_ranges(weight, n, cost, nk, bounds);
	free(cost);
	for (int d = 0; d < n; d++) {
		x[d].kc0 = bounds[d];
		x[d].kc1 = bounds[d + 1];
	}
	return 0;
}

/* The devices' figures, summed (peak: the largest). */
static void sum_results(const struct bwd_run *x, int n, struct ape__bwd_result *res)
{
	for (int d = 0; d < n; d++) {
		const struct ape__bwd_result *f = &x[d].res;

		res->h2d += f->h2d;
		res->d2h += f->d2h;
		res->peak = x[d].mem.peak > res->peak ? x[d].mem.peak : res->peak;
		res->kernel_ms += f->kernel_ms;
		res->copy_ms += f->copy_ms;
		res->launches += f->launches;
		res->pairs_computed += f->pairs_computed;
		res->pairs_counted |= f->pairs_counted;
		res->devices += x[d].kc0 < x[d].kc1;
	}
	res->cq = x[0].cq;
	res->ck = x[0].ck;
}

/*
 * The devices' dQ accumulators and parameter sums into the first one with key chunks, in device
 * order, in float64; then the outputs. Returns 0 or APE_ENOMEM (nothing written).
 */
static int finish(struct bwd_shared *sh, struct bwd_run *x, int n)
{
	const struct ape__problem *p = sh->r->p;
	const size_t qgrad = (size_t)(p->B * p->H * p->Lq * p->D);
	struct bwd_run *to = NULL;

	for (int d = 0; d < n; d++) {
		if (x[d].kc0 == x[d].kc1)
			continue;
		if (!to) {
			to = &x[d];
			continue;
		}
		for (size_t i = 0; to->dq_acc && i < qgrad; i++)
			to->dq_acc[i] += x[d].dq_acc[i];
		for (int64_t i = 0; to->dparams_host && i < 4 * p->H; i++)
			to->dparams_host[i] += x[d].dparams_host[i];
	}
	return write_outputs(sh, to->dq_acc, to->dq_all, to->dparams_host);
}

int ape__exec_backward(const struct ape__bwd_req *r, struct ape__bwd_result *res)
{
	const struct ape__problem *p = r->p;
	const size_t kgrad = (size_t)(p->B * p->Hkv * p->Lk * p->D);
	struct bwd_shared sh;
	struct bwd_run *x;
	int ret = 0;

	memset(res, 0, sizeof(*res));
	for (int d = 0; d < r->ndev; d++)
		if ((ret = ape__backward_supported(r->fn, r->devs[d])))
			return ret;
	memset(&sh, 0, sizeof(sh));
	sh.r = r;
	atomic_init(&sh.abort, false);
	x = ape__calloc((size_t)r->ndev, sizeof(*x));
	if (r->trace_path)
		sh.traces = ape__calloc((size_t)r->ndev, sizeof(*sh.traces));
	if (!x || (r->trace_path && !sh.traces)) {
		free(x);
		free(sh.traces);
		return ape__error(APE_ENOMEM, "%s: out of host memory", r->fn);
	}
	res->budget = UINT64_MAX;
	for (int d = 0; d < r->ndev; d++) {
		const uint64_t budget = r->budget ? r->budget : ape__default_budget(r->devs[d]);

		x[d].r = r;
		x[d].sh = &sh;
		x[d].dev = r->devs[d];
		x[d].ops = r->devs[d]->be->ops;
		if (sh.traces) {
			x[d].trace = &sh.traces[d];
			ape__trace_label(x[d].trace, r->devs, d);
			x[d].trace->device_clock = x[d].ops->event_timestamp != NULL;
		}
		ape__devmem_init(&x[d].mem, r->devs[d], budget);
		res->budget = budget < res->budget ? budget : res->budget;
		describe(&x[d]);
	}
	for (int d = 0; d < r->ndev && !ret; d++)
		ret = probe_wrap(&x[d], &x[d].may_wrap);
	if (!ret)
		ret = plan_all(x, r->ndev);
	if (!ret)
		ret = split_keys(x, r->ndev);
	for (int d = 0; d < r->ndev && !ret; d++)
		if (x[d].kc0 < x[d].kc1)
			ret = prepare_host(&x[d]);
	if (!ret && ((r->dk && !(sh.dk_all = ape__malloc(kgrad * sizeof(float)))) ||
		     (r->dv && !(sh.dv_all = ape__malloc(kgrad * sizeof(float))))))
		ret = ape__error(APE_ENOMEM, "%s: out of host memory staging the backward pass",
				 r->fn);
	if (!ret) {
		sh.t0 = ape__now_ms();
		ret = ape__run_per_device(r->fn, r->devs, r->ndev, device_main, x, &sh.abort);
		for (int d = 0; d < r->ndev && !ret; d++)
			if (x[d].ret < 0) /* the first failure, in device order */
				ret = ape__error(x[d].ret, "%s", x[d].msg);
	}
	if (!ret)
		ret = finish(&sh, x, r->ndev);
	if (!ret && sh.traces)
		ret = ape__trace_write(r->trace_path, r->fn, sh.traces, r->ndev);
	sum_results(x, r->ndev, res);
	for (int d = 0; d < r->ndev; d++) {
		release_host(&x[d]);
		if (sh.traces)
			ape__trace_free(&sh.traces[d]);
	}
	free(sh.traces);
	free(sh.dk_all);
	free(sh.dv_all);
	free(x);
	return ret;
}
