/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on one device (exec/backward.h), streamed in chunks under the device
 * budget. The same path as the forward's: strided host rows packed into staging
 * (exec/pack.c), every device buffer counted against the budget (exec/devmem.c), copies,
 * launches, copies back.
 *
 * Key chunks outer, query chunks inner, both in increasing order, one launch at a time:
 * - a key chunk's K and V go to the device once, with zeroed dK and dV accumulators that every
 *   query chunk's launch adds to (the op accumulates: core/backend.h); when its last query
 *   chunk is done they come back into host copies of the whole dK and dV;
 * - a query chunk's Q, O, dO, LSE and dLSE rows go with each launch; its dQ partial comes back
 *   after each launch and is added, in float64 and in key-chunk order, to a host accumulator;
 * - the parameter gradients accumulate on the device, in float64, over every launch.
 * Every order is fixed, so two calls give the same bits. A (query chunk, key chunk) pair the
 * causal mask hides entirely is never launched.
 *
 * The budget counts every chunk buffer and the scratch the backend declares for a launch
 * (attention_backward_scratch, core/backend.h), held from the launch until its synchronisation:
 * one launch is in flight at a time.
 *
 * The caller's outputs are written only after the last launch succeeded, from those host
 * copies: a failure writes nothing. No pipelining yet: each launch is synchronised before the
 * staging is reused.
 */
#include "exec/backward.h"

#include <inttypes.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "exec/devmem.h"
#include "exec/launch.h"
#include "exec/multidev.h"
#include "exec/pack.h"
#include "exec/plan.h"
#include "exec/skip_budget.h"

/* Device chunk buffers, each with its host staging. Rows of the query side, then the key side. */
enum { B_Q, B_O, B_DOUT, B_LSE, B_DLSE, B_DQ, B_PAIRS, B_K, B_V, B_DK, B_DV, NBUF };

struct chunk_buf {
	const char *what;
	const ape_tensor *t; /* the host tensor its rows come from (inputs), or NULL */
	const int64_t *s;
	uint64_t row_bytes; /* bytes per row of one chunk, all (b, h) together */
	bool used;
	struct ape__buf *buf;
	void *host; /* staging of one chunk */
};

struct bwd_run {
	const struct ape__bwd_req *r;
	const struct ape__backend_ops *ops;
	struct ape__devmem mem;
	struct ape__queue *queue;
	int64_t cq, ck; /* rows per chunk */
	struct chunk_buf b[NBUF];
	ape_tensor lse_t, dlse_t; /* lse and dlse as [B, H, Lq, 1] float tensors */
	int64_t lse_s[4];
	struct ape__buf *dparams_buf;
	double *dparams_host;
	uint64_t dparams_bytes;
	double *dq_acc; /* [B, H, Lq, D]: the sum of dQ over key chunks */
	float *dk_all, *dv_all; /* [B, Hkv, Lk, D] */
	struct ape__bwd_result *res;
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
	struct ape_device *dev = x->r->dev;
	struct ape__bwd_launch l;

	if (!x->ops->attention_backward_scratch)
		return 0;
	launch_shape(x, ck, &l, 0, nq, 0, nk);
	return x->ops->attention_backward_scratch(dev, &l, launch_parts(x));
}

/* Device bytes of chunks of cq query rows and ck key rows: the buffers and the largest
 * launch's scratch (the figure does not decrease with the rows: core/backend.h). */
static uint64_t chunk_bytes(const struct bwd_run *x, int64_t cq, int64_t ck)
{
	uint64_t n = x->dparams_bytes + launch_scratch(x, ck, cq, ck);

	for (int i = 0; i < NBUF; i++)
		if (x->b[i].used)
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
	struct ape_device *dev = r->dev;
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
	const struct chunk_buf b[NBUF] = {
		[B_Q] = { "q", r->q, p->qs, bh * D * esz, true, NULL, NULL },
		[B_O] = { "o", r->o, p->os, bh * D * ape_dtype_size(p->out_dtype), true, NULL, NULL },
		[B_DOUT] = { "dout", r->dout, r->dout_s, bh * D * ape_dtype_size(r->dout->dtype),
			     true, NULL, NULL },
		[B_LSE] = { "lse", &x->lse_t, x->lse_s, bh * sizeof(float), true, NULL, NULL },
		[B_DLSE] = { "dlse", &x->dlse_t, x->lse_s, bh * sizeof(float), r->dlse != NULL,
			     NULL, NULL },
		[B_DQ] = { "dq", NULL, NULL, bh * D * sizeof(float), r->dq != NULL, NULL, NULL },
		/* each row's pairs computed, when the launches may skip keys */
		[B_PAIRS] = { "pairs", NULL, NULL, bh * sizeof(uint64_t), ape__skip_allowed(p),
			      NULL, NULL },
		[B_K] = { "k", r->k, p->ks, bkv * D * esz, true, NULL, NULL },
		[B_V] = { "v", r->v, p->vs, bkv * D * esz, true, NULL, NULL },
		[B_DK] = { "dk", NULL, NULL, bkv * D * sizeof(float), r->dk != NULL, NULL, NULL },
		[B_DV] = { "dv", NULL, NULL, bkv * D * sizeof(float), r->dv != NULL, NULL, NULL },
	};

	memcpy(x->b, b, sizeof(b));
	/* LSE rows are a [B, H, Lq, 1] tensor to the packer */
	ape_tensor_init(&x->lse_t, (void *)r->lse, APE_F32, p->B, p->H, p->Lq, 1);
	ape_tensor_init(&x->dlse_t, (void *)r->dlse, APE_F32, p->B, p->H, p->Lq, 1);
	ape_tensor_strides(&x->lse_t, x->lse_s);
	x->dparams_bytes = r->dparams ? (uint64_t)p->H * 4 * sizeof(double) : 0;
}

/* Host memory, all of it before any device work: chunk staging and the gradients' copies. */
static int prepare_host(struct bwd_run *x)
{
	const struct ape__bwd_req *r = x->r;
	const struct ape__problem *p = r->p;
	const size_t qgrad = (size_t)(p->B * p->H * p->Lq * p->D);
	const size_t kgrad = (size_t)(p->B * p->Hkv * p->Lk * p->D);

	for (int i = 0; i < NBUF; i++) {
		struct chunk_buf *c = &x->b[i];

		if (c->used && !(c->host = ape__malloc((size_t)(c->row_bytes *
								 (uint64_t)(i < B_K ? x->cq
										    : x->ck)))))
			goto out_nomem;
	}
	if (r->dq && !(x->dq_acc = ape__calloc(qgrad, sizeof(double))))
		goto out_nomem;
	if (r->dk && !(x->dk_all = ape__malloc(kgrad * sizeof(float))))
		goto out_nomem;
	if (r->dv && !(x->dv_all = ape__malloc(kgrad * sizeof(float))))
		goto out_nomem;
	if (r->dparams && !(x->dparams_host = ape__malloc((size_t)x->dparams_bytes)))
		goto out_nomem;
	return 0;
out_nomem:
	return ape__error(APE_ENOMEM, "%s: out of host memory staging the backward pass", r->fn);
}

static int alloc_device(struct bwd_run *x)
{
	int ret;

	if ((ret = x->ops->queue_create(x->r->dev, &x->queue)))
		return ret;
	for (int i = 0; i < NBUF; i++) {
		struct chunk_buf *c = &x->b[i];

		if (c->used && (ret = ape__devmem_alloc(&x->mem,
							c->row_bytes *
								(uint64_t)(i < B_K ? x->cq : x->ck),
							&c->buf, c->what)))
			return ret;
	}
	if (x->r->dparams &&
	    ((ret = ape__devmem_alloc(&x->mem, x->dparams_bytes, &x->dparams_buf, "dparams")) ||
	     (ret = x->ops->fill(x->queue, x->dparams_buf, 0, 0, (size_t)x->dparams_bytes))))
		return ret;
	return 0;
}

/* Rows [l0, l0 + n) of the inputs of one side (first..last) to the device. */
static int upload_rows(struct bwd_run *x, int first, int last, int64_t l0, int64_t n)
{
	int ret;

	for (int i = first; i <= last; i++) {
		struct chunk_buf *c = &x->b[i];
		const size_t bytes = (size_t)(c->row_bytes * (uint64_t)n);

		if (!c->used || !c->t)
			continue;
		ape__pack_rows(c->host, c->t, c->s, l0, n);
		if ((ret = x->ops->copy_h2d(x->queue, c->buf, 0, c->host, bytes)))
			return ret;
		x->res->h2d += bytes;
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

/* Copies buffer i's n rows back into its staging, and waits for it. */
static int download_rows(struct bwd_run *x, int i, int64_t n)
{
	struct chunk_buf *c = &x->b[i];
	const size_t bytes = (size_t)(c->row_bytes * (uint64_t)n);
	int ret;

	if (!c->used)
		return 0;
	if ((ret = x->ops->copy_d2h(x->queue, c->host, c->buf, 0, bytes)) ||
	    (ret = x->ops->synchronize(x->queue)))
		return ret;
	x->res->d2h += bytes;
	return 0;
}

/* The launch of query rows [i0, i0 + nq) against key rows [j0, j0 + nk). */
static int launch(struct bwd_run *x, int64_t i0, int64_t nq, int64_t j0, int64_t nk)
{
	struct ape__event *e0 = NULL, *e1 = NULL;
	struct ape__bwd_launch l;
	uint64_t scratch;
	double ms = 0;
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
			  ? x->ops->attention_backward_scratch(x->r->dev, &l, ape__bwd_parts(&l))
			  : 0;
	ape__devmem_hold(&x->mem, scratch);
	if (!(ret = x->ops->event_record(x->queue, &e0)) &&
	    !(ret = x->ops->attention_backward(x->queue, &l)) &&
	    !(ret = x->ops->event_record(x->queue, &e1)) &&
	    !(ret = x->ops->synchronize(x->queue)) &&
	    !(ret = x->ops->event_elapsed(e0, e1, &ms))) {
		x->res->kernel_ms += ms;
		x->res->launches++;
	}
	/* synchronised, or failed: a queue that failed is destroyed, and waited for, before any
	 * other buffer is freed (release()) */
	ape__devmem_drop(&x->mem, scratch);
	x->ops->event_destroy(e0);
	x->ops->event_destroy(e1);
	return ret;
}

/*
 * The pairs buffer before a launch: each row's visible keys among the launch's, what a backend
 * that skips nothing computes (it may leave the buffer as it is); after: their sum.
 */
static int pairs_before(struct bwd_run *x, int64_t i0, int64_t nq, int64_t j0, int64_t nk)
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
			/* causal: keys at n >= 0; distances are validated to fit */
			int64_t v = p->q_start + i0 + i - (p->k_start + j0) + 1;

			v = !p->causal ? nk : v < 0 ? 0 : v > nk ? nk : v;
			h[bh * nq + i] = (uint64_t)v;
		}
	if ((ret = x->ops->copy_h2d(x->queue, c->buf, 0, h, bytes)))
		return ret;
	x->res->h2d += bytes;
	return 0;
}

static void pairs_after(struct bwd_run *x, int64_t nq)
{
	const struct chunk_buf *c = &x->b[B_PAIRS];
	const uint64_t *h = c->host;

	if (!c->used)
		return;
	for (int64_t r = 0; r < x->r->p->B * x->r->p->H * nq; r++)
		x->res->pairs_computed += h[r];
	x->res->pairs_counted = true;
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

	if (!all)
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

static int run_chunks(struct bwd_run *x)
{
	const struct ape__problem *p = x->r->p;
	int ret;

	for (int64_t j0 = 0; j0 < p->Lk; j0 += x->ck) {
		const int64_t nk = p->Lk - j0 < x->ck ? p->Lk - j0 : x->ck;

		if ((ret = upload_rows(x, B_K, B_V, j0, nk)) || (ret = zero_rows(x, B_DK, nk)) ||
		    (ret = zero_rows(x, B_DV, nk)))
			return ret;
		for (int64_t i0 = 0; i0 < p->Lq; i0 += x->cq) {
			const int64_t nq = p->Lq - i0 < x->cq ? p->Lq - i0 : x->cq;

			if (!chunk_visible(p, i0, nq, j0))
				continue;
			if ((ret = upload_rows(x, B_Q, B_DLSE, i0, nq)) ||
			    (ret = zero_rows(x, B_DQ, nq)) ||
			    (ret = pairs_before(x, i0, nq, j0, nk)) ||
			    (ret = launch(x, i0, nq, j0, nk)) || (ret = download_rows(x, B_DQ, nq)) ||
			    (ret = download_rows(x, B_PAIRS, nq)))
				return ret;
			pairs_after(x, nq);
			if (x->dq_acc)
				add_dq(x, i0, nq);
		}
		if ((ret = download_rows(x, B_DK, nk)) || (ret = download_rows(x, B_DV, nk)))
			return ret;
		place_dkv(x, B_DK, x->dk_all, j0, nk);
		place_dkv(x, B_DV, x->dv_all, j0, nk);
	}
	if (x->r->dparams &&
	    ((ret = x->ops->copy_d2h(x->queue, x->dparams_host, x->dparams_buf, 0,
				     (size_t)x->dparams_bytes)) ||
	     (ret = x->ops->synchronize(x->queue))))
		return ret;
	x->res->d2h += x->dparams_bytes;
	return 0;
}

/*
 * Only after every launch succeeded: the float32 copies (dQ rounded from its float64 sum),
 * converted for 16-bit tensors, into the caller's layout. Every conversion buffer is taken
 * before the first byte is written, so that running out of memory here writes nothing too.
 */
static int write_outputs(struct bwd_run *x)
{
	const struct ape__bwd_req *r = x->r;
	const struct ape__problem *p = r->p;
	const size_t nq = (size_t)(p->B * p->H * p->Lq * p->D);
	ape_tensor *ts[3] = { r->dq, r->dk, r->dv };
	const int64_t *ss[3] = { r->dq_s, r->dk_s, r->dv_s };
	const float *all[3] = { NULL, x->dk_all, x->dv_all };
	float *dq32 = NULL;
	void *conv[3] = { NULL, NULL, NULL };
	int ret = 0;

	if (r->dq) {
		dq32 = ape__malloc(nq * sizeof(float) + 1);
		if (!dq32)
			goto out_nomem;
		for (size_t i = 0; i < nq; i++)
			dq32[i] = (float)x->dq_acc[i];
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
		r->dparams[i] = (float)x->dparams_host[i];
	goto out_free;
out_nomem:
	ret = ape__error(APE_ENOMEM, "%s: out of host memory converting the gradients", r->fn);
out_free:
	free(dq32);
	for (int i = 0; i < 3; i++)
		free(conv[i]);
	return ret;
}

static void release(struct bwd_run *x)
{
	x->ops->queue_destroy(x->queue); /* waits for what is still in flight */
	for (int i = 0; i < NBUF; i++) {
		struct chunk_buf *c = &x->b[i];

		ape__devmem_free(&x->mem, &c->buf,
				 c->row_bytes * (uint64_t)(i < B_K ? x->cq : x->ck));
		free(c->host);
	}
	ape__devmem_free(&x->mem, &x->dparams_buf, x->dparams_bytes);
	free(x->dparams_host);
	free(x->dq_acc);
	free(x->dk_all);
	free(x->dv_all);
}

int ape__backward_supported(const char *fn, const struct ape_device *dev)
{
	if (dev->be->ops->attention_backward)
		return 0;
	return ape__error(APE_ENOTSUP,
			  "%s: %s:%d %s: the backward pass is not implemented on this backend yet",
			  fn, dev->info.backend, dev->info.backend_index, dev->info.name);
}

int ape__exec_backward(const struct ape__bwd_req *r, struct ape__bwd_result *res)
{
	struct ape_device *dev = r->dev;
	struct bwd_run x;
	int ret;

	memset(res, 0, sizeof(*res));
	if ((ret = ape__backward_supported(r->fn, dev)))
		return ret;
	memset(&x, 0, sizeof(x));
	x.r = r;
	x.ops = dev->be->ops;
	x.res = res;
	res->budget = r->budget ? r->budget : ape__default_budget(dev);
	ape__devmem_init(&x.mem, dev, res->budget);
	describe(&x);
	ret = plan(&x, r->chunk_q ? r->chunk_q : APE__CHUNK_DEFAULT,
		   r->chunk_k ? r->chunk_k : APE__CHUNK_DEFAULT, res->budget);
	if (!ret)
		ret = prepare_host(&x);
	if (!ret) {
		ret = alloc_device(&x);
		if (!ret)
			ret = run_chunks(&x);
		if (ret)
			ret = ape__error_prefix(ape__error_on(ret, dev), r->fn);
	}
	if (!ret)
		ret = write_outputs(&x);
	res->cq = x.cq;
	res->ck = x.ck;
	res->peak = x.mem.peak;
	release(&x);
	return ret;
}
