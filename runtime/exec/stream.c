/* SPDX-License-Identifier: MIT */
/*
 * The pipelined executor of one device.
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
#include "exec/stream.h"
#include "core/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/context.h"
#include "exec/devmem.h"
#include "core/error.h"
#include "topo/hostmem.h"
#include "exec/lse_merge.h"
#include "exec/pack.h"

#define MAX_DEPTH 3

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
	struct ape__buf *o, *lse, *pairs;
	struct ape__hostmem host; /* O | LSE | pairs as they come back */
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
	struct ape__queue *exec, *up[MAX_DEPTH], *qup[2], *down[MAX_DEPTH];
	struct qslot qs[2];
	struct kvslot *kv;
	int nkv, max_kv;
	struct stage kvst[MAX_DEPTH], qst[2];
	struct outslot out[MAX_DEPTH];
	struct qrec qr[MAX_DEPTH + 1];
	uint64_t qnorm_rows; /* rows each qrec's qnorm holds */

	/* the run in progress */
	const struct ape__stream_call *c;
	struct ape__stream_stats *st;
	struct ape__trace_dev *trace;
	struct job ring[MAX_DEPTH];
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

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ------------------------------------------------------------------ sizes */

static uint64_t row_bytes(const struct ape__stream *s, int64_t heads, int64_t n, size_t esz)
{
	return (uint64_t)(s->g.B * heads * n * s->g.D) * esz;
}

uint64_t ape__scratch_of(struct ape_device *dev, const struct ape__launch *l)
{
	const uint64_t kv = (uint64_t)(l->B * l->Hkv);

	if (dev->be->ops->attention_scratch)
		return dev->be->ops->attention_scratch(dev, l);
	/* what a backend may need without saying: float32 copies of K and V, per-tile key
	 * norms with prefix and suffix maxima, per-head parameters in float64 */
	return 2 * kv * (uint64_t)(l->Lk * l->D) * 4 + 12 * kv * (uint64_t)(l->Lk + 2) +
	       8 * (uint64_t)(l->D / 2 + 4 * l->H) + 4096;
}

/* ------------------------------------------------------------------ session */

static int alloc_queues(struct ape__stream *s)
{
	const struct ape__backend_ops *ops = s->ops;
	int ret = ops->queue_create(s->dev, &s->exec);

	for (int i = 0; !ret && i < s->depth; i++)
		if (!(ret = ops->queue_create(s->dev, &s->up[i])))
			ret = ops->queue_create(s->dev, &s->down[i]);
	for (int i = 0; !ret && i < s->g.plan.q_slots; i++)
		ret = ops->queue_create(s->dev, &s->qup[i]);
	return ret;
}

int ape__stream_create(struct ape_device *dev, const struct ape__stream_geom *g,
		       struct ape__stream **out)
{
	struct ape__stream *s = ape__calloc(1, sizeof(*s));
	int ret;

	*out = NULL;
	if (!s)
		return ape__error(APE_ENOMEM, "out of memory for a device session");
	s->dev = dev;
	s->ops = dev->be->ops;
	s->g = *g;
	s->depth = g->plan.depth;
	s->max_kv = g->plan.kv_slots;
	ape__devmem_init(&s->mem, dev, g->budget);
	for (int i = 0; i <= MAX_DEPTH; i++)
		s->qr[i].qc = -1;
	s->kv = ape__calloc((size_t)s->max_kv, sizeof(*s->kv));
	if (!s->kv) {
		free(s);
		return ape__error(APE_ENOMEM, "out of memory for a device session");
	}
	ret = alloc_queues(s);
	if (ret) {
		ape__stream_destroy(s);
		return ret;
	}
	*out = s;
	return 0;
}

static int ensure_host(struct ape__stream *s, struct ape__hostmem *m, uint64_t bytes)
{
	if (m->ptr)
		return 0;
	return ape__host_alloc(s->dev, (size_t)bytes, m);
}

static int ensure_out(struct ape__stream *s, int i)
{
	const struct ape__plan *p = &s->g.plan;
	struct outslot *o = &s->out[i];
	int ret = 0;

	if (!o->o)
		ret = ape__devmem_alloc(&s->mem, p->o_bytes, &o->o, "allocating a partial O");
	if (!ret && !o->lse)
		ret = ape__devmem_alloc(&s->mem, p->lse_bytes, &o->lse, "allocating a partial LSE");
	if (!ret && !o->pairs && p->pairs_bytes)
		ret = ape__devmem_alloc(&s->mem, p->pairs_bytes, &o->pairs,
					"allocating pair counts");
	if (!ret)
		ret = ensure_host(s, &o->host, p->out_bytes);
	return ret;
}

static int ensure_qslot(struct ape__stream *s, int i)
{
	int ret = 0;

	if (!s->qs[i].buf)
		ret = ape__devmem_alloc(&s->mem, s->g.plan.q_bytes, &s->qs[i].buf,
					"allocating a query chunk");
	if (!ret && !s->qs[i].prior && s->g.plan.prior_bytes)
		ret = ape__devmem_alloc(&s->mem, s->g.plan.prior_bytes, &s->qs[i].prior,
					"allocating a query chunk's LSE");
	if (!ret)
		ret = ensure_host(s, &s->qst[i].mem, s->g.plan.q_bytes);
	return ret;
}

/* One more key/value slot; APE_ENOMEM beyond the first few only means "no more residency". */
static int grow_kv(struct ape__stream *s)
{
	struct kvslot *k = &s->kv[s->nkv];
	int ret;

	ret = ape__devmem_alloc(&s->mem, s->g.plan.kv_bytes, &k->k, "allocating a key chunk");
	if (!ret)
		ret = ape__devmem_alloc(&s->mem, s->g.plan.kv_bytes, &k->v,
					"allocating a value chunk");
	if (ret) {
		ape__devmem_free(&s->mem, &k->k, s->g.plan.kv_bytes);
		return ret;
	}
	k->chunk = -1;
	s->nkv++;
	return 0;
}

static int ensure_qrec(struct ape__stream *s, struct qrec *r, bool merge, bool norms)
{
	const int64_t rows = s->g.B * s->g.H * s->g.plan.cq;

	if (merge && !r->acc.o) {
		int ret = ape__acc_alloc(&r->acc, rows, s->g.D);

		if (ret)
			return ret;
	}
	if (norms && !r->qnorm) {
		r->qnorm = ape__malloc((size_t)rows * sizeof(float) + 1);
		if (!r->qnorm)
			return ape__error(APE_ENOMEM, "out of memory for query norms");
	}
	return 0;
}

int ape__stream_reserve(struct ape__stream *s)
{
	int ret = 0;

	for (int i = 0; !ret && i < s->depth; i++)
		ret = ensure_out(s, i);
	for (int i = 0; !ret && i < s->g.plan.q_slots; i++)
		ret = ensure_qslot(s, i);
	while (!ret && s->nkv < s->max_kv)
		ret = grow_kv(s);
	for (int i = 0; !ret && s->g.host_kv && i < s->depth; i++)
		ret = ensure_host(s, &s->kvst[i].mem, 2 * s->g.plan.kv_bytes);
	for (int i = 0; !ret && i <= s->depth; i++)
		ret = ensure_qrec(s, &s->qr[i], s->g.plan.merge, true);
	return ret;
}

uint64_t ape__stream_device_bytes(const struct ape__stream *s)
{
	return s->mem.cur;
}

void ape__stream_destroy(struct ape__stream *s)
{
	const struct ape__backend_ops *ops;
	const struct ape__plan *p;

	if (!s)
		return;
	ops = s->ops;
	p = &s->g.plan;
	/* queues first: destroying one waits for its work, so buffers are idle afterwards */
	ops->queue_destroy(s->exec);
	for (int i = 0; i < MAX_DEPTH; i++) {
		ops->queue_destroy(s->up[i]);
		ops->queue_destroy(s->down[i]);
	}
	for (int i = 0; i < 2; i++) {
		ops->queue_destroy(s->qup[i]);
		ape__devmem_free(&s->mem, &s->qs[i].buf, p->q_bytes);
		ape__devmem_free(&s->mem, &s->qs[i].prior, p->prior_bytes);
		ape__host_free(s->dev, &s->qst[i].mem);
	}
	for (int i = 0; i < MAX_DEPTH; i++) {
		ape__devmem_free(&s->mem, &s->out[i].o, p->o_bytes);
		ape__devmem_free(&s->mem, &s->out[i].lse, p->lse_bytes);
		ape__devmem_free(&s->mem, &s->out[i].pairs, p->pairs_bytes);
		ape__host_free(s->dev, &s->out[i].host);
		ape__host_free(s->dev, &s->kvst[i].mem);
	}
	for (int i = 0; i < s->nkv; i++) {
		ape__devmem_free(&s->mem, &s->kv[i].k, p->kv_bytes);
		ape__devmem_free(&s->mem, &s->kv[i].v, p->kv_bytes);
	}
	for (int i = 0; i <= MAX_DEPTH; i++) {
		ape__acc_free(&s->qr[i].acc);
		free(s->qr[i].qnorm);
	}
	free(s->kv);
	free(s->iv);
	free(s);
}

/* ------------------------------------------------------------------ timing */

static void add_interval(struct ape__stream *s, double t0, double t1, bool kernel)
{
	if (s->niv == s->capiv) {
		size_t cap = s->capiv ? 2 * s->capiv : 64;
		struct interval *iv = ape__realloc(s->iv, cap * sizeof(*iv));

		if (!iv) /* only a statistic: stop measuring overlap */
			return;
		s->iv = iv;
		s->capiv = cap;
	}
	s->iv[s->niv++] = (struct interval){ t0, t1, kernel };
}

/*
 * Accounts one span (between two completed events of one queue): its device time, and with
 * event timestamps its place in time for the overlap figure and the trace. Without them the
 * trace places it at `host_t` (when it was enqueued, or when what it waited for ended,
 * whichever is later). Its end goes to *end.
 */
static int span(struct ape__stream *s, struct ape__event *e0, struct ape__event *e1, int lane,
		const char *what, int64_t qc, int64_t kc, uint64_t bytes, double host_t,
		double *end)
{
	const struct ape__backend_ops *ops = s->ops;
	double ms = 0, t0 = host_t, t1;
	int ret = ops->event_elapsed(e0, e1, &ms);

	if (ret)
		return ret;
	if (lane == APE__LANE_KERNEL)
		s->st->kernel_ms += ms;
	else
		s->st->copy_ms += ms;
	t1 = host_t + ms;
	if (ops->event_timestamp && (s->trace || !s->g.no_overlap)) {
		/* the span's work ended at e1 and ran for ms: e0's own time would also count the
		 * wait for what the queue was told to wait for, and overlap would exceed the
		 * copies' and kernels' device times */
		if ((ret = ops->event_timestamp(e1, &t1)))
			return ret;
		t0 = t1 - ms;
		if (!s->g.no_overlap)
			add_interval(s, t0, t1, lane == APE__LANE_KERNEL);
	}
	if (s->trace)
		ape__trace_add(s->trace, what, lane, t0, t1, qc, kc, bytes);
	if (end)
		*end = t1;
	return 0;
}

static int cmp_interval(const void *a, const void *b)
{
	const struct interval *x = a, *y = b;

	return x->t0 < y->t0 ? -1 : x->t0 > y->t0;
}

/* Length of the union of the intervals that `pick` selects (0: copies, 1: kernels, 2: all);
 * the array is sorted by start. */
static double union_len(const struct interval *iv, size_t n, int pick)
{
	double total = 0, a = 0, b = -INFINITY;

	for (size_t i = 0; i < n; i++) {
		if (pick != 2 && iv[i].kernel != (pick == 1))
			continue;
		if (iv[i].t0 > b) {
			if (b > a)
				total += b - a;
			a = iv[i].t0;
			b = iv[i].t1;
		} else if (iv[i].t1 > b) {
			b = iv[i].t1;
		}
	}
	if (b > a)
		total += b - a;
	return total;
}

/* Time copies and kernels ran at once: |copies| + |kernels| - |copies u kernels|. */
static double overlap_ms(struct ape__stream *s)
{
	if (!s->niv)
		return 0;
	qsort(s->iv, s->niv, sizeof(*s->iv), cmp_interval);
	return fmax(0.0, union_len(s->iv, s->niv, 0) + union_len(s->iv, s->niv, 1) -
			 union_len(s->iv, s->niv, 2));
}

/* ------------------------------------------------------------------ events */

static void forget(struct ape__event **ref, const struct ape__event *e)
{
	if (*ref == e)
		*ref = NULL;
}

/* The work e stands for has completed: no slot needs to wait for it any more. */
static void forget_everywhere(struct ape__stream *s, const struct ape__event *e)
{
	if (!e)
		return;
	for (int i = 0; i < 2; i++) {
		forget(&s->qs[i].ready, e);
		forget(&s->qs[i].used, e);
	}
	for (int i = 0; i < s->nkv; i++) {
		forget(&s->kv[i].ready, e);
		forget(&s->kv[i].used, e);
	}
}

static void drop_event(struct ape__stream *s, struct ape__event **e)
{
	forget_everywhere(s, *e);
	s->ops->event_destroy(*e);
	*e = NULL;
}

static void drop_job_events(struct ape__stream *s, struct job *j)
{
	drop_event(s, &j->up0);
	drop_event(s, &j->up1);
	drop_event(s, &j->k0);
	drop_event(s, &j->k1);
	drop_event(s, &j->d0);
	drop_event(s, &j->d1);
}

static int wait_on(struct ape__stream *s, struct ape__queue *q, struct ape__event *e)
{
	return e ? s->ops->event_wait(q, e) : 0;
}

/* ------------------------------------------------------------------ query chunks */

/* Packs and sends the rows of r's query chunk; also their norms when skipping may happen. */
static int load_query(struct ape__stream *s, struct qrec *r)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__backend_ops *ops = s->ops;
	const int slot = s->qnext;
	const uint64_t bytes = row_bytes(s, s->g.H, r->n, ape_dtype_size(s->g.in_dtype));
	struct qslot *qs = &s->qs[slot];
	struct stage *st = &s->qst[slot];
	int ret;

	s->qnext = (s->qnext + 1) % s->g.plan.q_slots;
	if ((ret = ensure_qslot(s, slot)))
		return ret;
	if (st->pending) { /* the previous copy from this staging buffer */
		if ((ret = ops->synchronize(s->qup[slot])))
			return ret;
		st->pending = false;
	}
	ape__pack_rows(st->mem.ptr, c->q, c->p->qs, r->i0, r->n);
	if (c->kmax) {
		const size_t esz = ape_dtype_size(s->g.in_dtype);
		float row[256];

		for (int64_t i = 0; i < s->g.B * s->g.H * r->n; i++) {
			ape_convert(row, APE_F32, (char *)st->mem.ptr + (size_t)(i * s->g.D) * esz,
				    s->g.in_dtype, (size_t)s->g.D);
			r->qnorm[i] = ape__norm(row, s->g.D);
		}
	}
	r->host_t = now_ms();
	if ((ret = wait_on(s, s->qup[slot], qs->used)) ||
	    (ret = ops->event_record(s->qup[slot], &r->e0)) ||
	    (ret = ops->copy_h2d(s->qup[slot], qs->buf, 0, st->mem.ptr, (size_t)bytes)) ||
	    (ret = ops->event_record(s->qup[slot], &r->e1)))
		return ret;
	st->pending = true;
	qs->ready = r->e1;
	r->slot = slot;
	r->loaded = true;
	r->bytes = bytes;
	s->st->h2d += bytes;
	return 0;
}

static int finish_query(struct ape__stream *s, struct qrec *r)
{
	const struct ape__stream_call *c = s->c;
	int ret = 0;

	if (c->merge)
		ape__acc_store(&r->acc, c->o, c->p->os, c->lse, c->p->Lq, r->i0, r->n);
	else if (!r->jobs) /* direct writes happen per job; no job means no visible key */
		ape__store_empty_rows(c->o, c->p->os, c->lse, c->p->Lq, r->i0, r->n);
	if (r->loaded) {
		ret = span(s, r->e0, r->e1, APE__LANE_H2D_Q + r->slot, "h2d Q", r->qc, -1,
			   r->bytes, r->host_t, NULL);
		drop_event(s, &r->e0);
		drop_event(s, &r->e1);
	}
	r->qc = -1;
	r->loaded = false;
	s->st->qchunks_done++;
	return ret;
}

/* ------------------------------------------------------------------ jobs */

/* The launch for job j; buffers included. */
static void fill_launch(struct ape__stream *s, const struct job *j, int out,
			struct ape__launch *l)
{
	const struct ape__stream_call *c = s->c;
	const struct qrec *r = j->qr;

	*l = s->tmpl;
	l->Lq = r->n;
	l->Lk = j->n;
	l->q = s->qs[r->slot].buf;
	l->k = s->kv[j->kvs].k;
	l->v = s->kv[j->kvs].v;
	l->o = s->out[out].o;
	l->lse = s->out[out].lse;
	l->pairs = c->want_pairs ? s->out[out].pairs : NULL;
	l->q_start = c->p->q_start + r->i0;
	l->k_start = c->p->k_start + j->j0;
}

/* Which key/value slot to (re)fill: an empty one, then one holding a chunk the skip bound
 * already ruled out, then a new one while the plan allows, else the idle one farthest from the
 * current diagonal (near chunks serve the next query chunk too). */
static int pick_victim(struct ape__stream *s, int64_t diag, int *out)
{
	int best = -1;
	int64_t far = -1;
	int ret;

	for (int i = 0; i < s->nkv; i++)
		if (!s->kv[i].busy &&
		    (s->kv[i].chunk < 0 || s->kv[i].chunk <= s->dead_lo ||
		     s->kv[i].chunk >= s->dead_hi)) {
			*out = i;
			return 0;
		}
	if (s->nkv < s->max_kv) {
		ret = grow_kv(s);
		if (!ret) {
			*out = s->nkv - 1;
			return 0;
		}
		if (ret != APE_ENOMEM || !s->nkv)
			return ret;
		s->max_kv = s->nkv; /* the device is fuller than planned: no more residency */
	}
	for (int pass = 0; pass < 2 && best < 0; pass++)
		for (int i = 0; i < s->nkv; i++) {
			int64_t d = llabs(s->kv[i].chunk - diag);

			if ((pass || !s->kv[i].busy) && d > far) {
				far = d;
				best = i;
			}
		}
	*out = best;
	return 0;
}

/* Makes key chunk j->kc resident, copying it unless it already is. */
static int load_keys(struct ape__stream *s, struct job *j)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__backend_ops *ops = s->ops;
	const size_t esz = ape_dtype_size(s->g.in_dtype);
	const uint64_t half = row_bytes(s, s->g.Hkv, j->n, esz);
	struct kvslot *kv;
	struct ape__queue *q;
	int ret, i;

	for (i = 0; i < s->nkv; i++)
		if (s->kv[i].chunk == j->kc) {
			j->kvs = i;
			return 0;
		}
	if ((ret = pick_victim(s, s->walk.diag, &i)))
		return ret;
	kv = &s->kv[i];
	j->kvs = i;
	j->lane = (int)(s->nload++ % (unsigned)s->depth);
	q = s->up[j->lane];
	if (!c->loader) {
		struct stage *st = &s->kvst[j->lane];

		if ((ret = ensure_host(s, &st->mem, 2 * s->g.plan.kv_bytes)))
			return ret;
		if (st->pending) {
			if ((ret = ops->synchronize(q)))
				return ret;
			st->pending = false;
		}
		ape__pack_rows(st->mem.ptr, c->k, c->p->ks, j->j0, j->n);
		ape__pack_rows((char *)st->mem.ptr + half, c->v, c->p->vs, j->j0, j->n);
	}
	j->host_t[0] = now_ms();
	kv->chunk = -1; /* until the copy is enqueued, it holds nothing usable */
	if ((ret = wait_on(s, q, kv->used)) || (ret = ops->event_record(q, &j->up0)))
		return ret;
	if (c->loader) {
		uint64_t before = s->st->h2d;

		ret = c->loader->load(c->loader->arg, q, j->lane, j->j0, j->n, kv->k, kv->v,
				      &s->st->h2d, &s->st->d2h, &s->st->d2d);
		j->h2d = s->st->h2d - before;
	} else {
		const char *src = s->kvst[j->lane].mem.ptr;

		ret = ops->copy_h2d(q, kv->k, 0, src, (size_t)half);
		if (!ret)
			ret = ops->copy_h2d(q, kv->v, 0, src + half, (size_t)half);
		s->kvst[j->lane].pending = true;
		j->h2d = 2 * half;
		s->st->h2d += 2 * half;
	}
	if (ret || (ret = ops->event_record(q, &j->up1)))
		return ret;
	kv->chunk = j->kc;
	kv->ready = j->up1;
	j->loaded = true;
	return 0;
}

/* Where a job's results land in its host staging: pair counts first (8-byte aligned at the
 * start of the page-aligned buffer), then LSE, then O. Offsets for `rows` rows. */
static void out_layout(const struct ape__stream *s, int64_t rows, size_t *lse_off,
		       size_t *o_off)
{
	*lse_off = s->c->want_pairs ? (size_t)rows * sizeof(uint64_t) : 0;
	*o_off = *lse_off + (size_t)rows * sizeof(float);
}

/* Enqueues everything of one job: its copies, its kernel, the copy back. */
static int issue(struct ape__stream *s, struct qrec *r, int64_t kc)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__backend_ops *ops = s->ops;
	const int out = (s->head + s->count) % s->depth;
	const size_t oesz = c->merge ? 4 : ape_dtype_size(c->p->out_dtype);
	struct job *j = &s->ring[out];
	struct ape__queue *down = s->down[out];
	struct ape__launch l;
	uint64_t ob, lb;
	size_t lo, oo;
	char *host;
	int ret;

	memset(j, 0, sizeof(*j));
	j->qr = r;
	j->kc = kc;
	j->j0 = kc * c->ck;
	j->n = j->j0 + c->ck < c->p->Lk ? c->ck : c->p->Lk - j->j0;
	s->count++; /* from here on, retire() cleans it up whatever fails */
	r->pending++;
	r->jobs++;
	if ((ret = ensure_out(s, out)))
		return ret;
	host = s->out[out].host.ptr;
	if (!r->loaded && (ret = load_query(s, r)))
		return ret;
	if ((ret = load_keys(s, j)))
		return ret;
	s->kv[j->kvs].busy++;
	fill_launch(s, j, out, &l);
	if (s->qs[r->slot].prior && r->jobs > 1) {
		/* the b-th chunk from the diagonal tests against 2^-b of its share: the whole
		 * direction stays within it however many chunks it has */
		const int64_t b = kc > s->walk.diag ? kc - s->walk.diag : s->walk.diag - kc;

		l.lse_prior = s->qs[r->slot].prior;
		l.prior_tol = ldexp(l.skip_tol, b < 1000 ? -(int)b : -1000);
	}
	j->scratch = ape__scratch_of(s->dev, &l);
	ape__devmem_hold(&s->mem, j->scratch);
	ob = row_bytes(s, s->g.H, r->n, oesz);
	lb = (uint64_t)(s->g.B * s->g.H * r->n) * sizeof(float);

	if ((ret = wait_on(s, s->exec, s->qs[r->slot].ready)) ||
	    (ret = wait_on(s, s->exec, s->kv[j->kvs].ready)))
		return ret;
	if (c->poison) {
		/* 0x7fc07fc0: a quiet NaN in f32, and two in f16 or bf16 */
		if ((ret = ops->fill(s->exec, l.o, 0, 0x7fc07fc0u, (size_t)ob)) ||
		    (ret = ops->fill(s->exec, l.lse, 0, 0x7fc07fc0u, (size_t)lb)))
			return ret;
	}
	j->host_t[1] = now_ms();
	if ((ret = ops->event_record(s->exec, &j->k0)) || (ret = ops->attention(s->exec, &l)) ||
	    (ret = ops->event_record(s->exec, &j->k1)))
		return ret;
	s->kv[j->kvs].used = j->k1;
	s->qs[r->slot].used = j->k1;
	/* the diagonal launch (a walk's first): its LSE is the later launches' prior */
	if (s->qs[r->slot].prior && r->jobs == 1 &&
	    (ret = ops->copy_d2d(s->exec, s->qs[r->slot].prior, 0, l.lse, 0, (size_t)lb)))
		return ret;

	j->host_t[2] = now_ms();
	j->out_bytes = ob + lb + (l.pairs ? lb * 2 : 0);
	out_layout(s, s->g.B * s->g.H * r->n, &lo, &oo);
	if ((ret = ops->event_wait(down, j->k1)) || (ret = ops->event_record(down, &j->d0)) ||
	    (ret = ops->copy_d2h(down, host + oo, l.o, 0, (size_t)ob)) ||
	    (ret = ops->copy_d2h(down, host + lo, l.lse, 0, (size_t)lb)) ||
	    (l.pairs && (ret = ops->copy_d2h(down, host, l.pairs, 0, (size_t)(2 * lb)))) ||
	    (ret = ops->event_record(down, &j->d1)))
		return ret;
	s->st->d2h += j->out_bytes;
	s->st->chunks++;
	return 0;
}

/* Takes in one job's result from its host staging: merged into its query chunk's rows, or
 * written straight to the outputs when it is the only key chunk there is. */
static void consume(struct ape__stream *s, const struct job *j, const void *host)
{
	const struct ape__stream_call *c = s->c;
	struct qrec *r = j->qr;
	const int64_t bh = s->g.B * s->g.H, rows = bh * r->n;
	const uint64_t *pairs = host;
	const float *lse;
	const char *o;
	size_t lo, oo;

	out_layout(s, rows, &lo, &oo);
	lse = (const float *)((const char *)host + lo);
	o = (const char *)host + oo;
	if (c->merge) {
		ape__acc_add(&r->acc, (const float *)o, lse);
	} else {
		ape__unpack_rows(o, c->o, c->p->os, r->i0, r->n);
		for (int64_t i = 0; c->lse && i < bh; i++)
			memcpy(c->lse + i * c->p->Lq + r->i0, lse + i * r->n,
			       (size_t)r->n * sizeof(float));
	}
	for (int64_t i = 0; c->want_pairs && i < rows; i++)
		s->st->pairs_computed += pairs[i];
	s->st->work += (uint64_t)rows * (uint64_t)j->n;
}

/* Waits for the oldest job, merges or writes its result, and frees its slot. */
static int retire(struct ape__stream *s)
{
	const int out = s->head;
	struct job *j = &s->ring[out];
	struct qrec *r = j->qr;
	double t = j->host_t[0];
	int ret;

	ret = s->ops->synchronize(s->down[out]);
	if (!ret && j->loaded)
		ret = span(s, j->up0, j->up1, APE__LANE_H2D_KV + j->lane, "h2d K/V", r->qc, j->kc,
			   j->h2d, j->host_t[0], &t);
	if (!ret)
		ret = span(s, j->k0, j->k1, APE__LANE_KERNEL, "attention", r->qc, j->kc, 0,
			   fmax(j->host_t[1], t), &t);
	if (!ret)
		ret = span(s, j->d0, j->d1, APE__LANE_D2H + out, "d2h O/LSE", r->qc, j->kc,
			   j->out_bytes, fmax(j->host_t[2], t), NULL);
	if (!ret)
		consume(s, j, s->out[out].host.ptr);
	s->kv[j->kvs].busy--;
	ape__devmem_drop(&s->mem, j->scratch);
	drop_job_events(s, j);
	s->head = (s->head + 1) % s->depth;
	s->count--;
	r->pending--;
	if (!ret && !r->pending && !r->issuing)
		ret = finish_query(s, r);
	return ret;
}

/* ------------------------------------------------------------------ the walk */

static int begin_query(struct ape__stream *s, int64_t qc)
{
	const struct ape__stream_call *c = s->c;
	struct qrec *r = NULL;
	int ret;

	for (;;) {
		for (int i = 0; i <= s->depth && !r; i++)
			if (s->qr[i].qc < 0)
				r = &s->qr[i];
		if (r)
			break;
		if ((ret = retire(s)))
			return ret;
	}
	if ((ret = ensure_qrec(s, r, c->merge, c->kmax != NULL)))
		return ret;
	r->qc = qc;
	r->i0 = qc * c->cq;
	r->n = r->i0 + c->cq < c->p->Lq ? c->cq : c->p->Lq - r->i0;
	r->pending = r->jobs = 0;
	r->issuing = true;
	r->loaded = false;
	if (c->merge)
		ape__acc_reset(&r->acc, s->g.B * s->g.H * r->n);
	ape__walk_init(&s->walk, c->p->q_start + r->i0, c->p->q_start + r->i0 + (r->n - 1),
		       c->p->Lk, c->ck, c->p->k_start, c->p->causal, c->nq == 1 && c->nk == 1);
	s->cur = r;
	return 0;
}

/* Is the rest of the walk in direction dir, from chunk on, provably negligible? */
static bool negligible(struct ape__stream *s, int64_t chunk, int dir)
{
	const struct qrec *r = s->cur;
	const struct ape__skip_rows rows = {
		.n = r->n,
		.pos0 = s->c->p->q_start + r->i0,
		.qnorm = r->qnorm,
		.m = r->acc.m,
		.s = r->acc.s,
	};

	return ape__skip_tail(&s->skip, &rows, chunk, dir);
}

/* One step of the current query chunk's walk: a job issued, a direction skipped, or the walk
 * finished. */
static int step(struct ape__stream *s)
{
	struct qrec *r = s->cur;
	int64_t chunk;
	int dir, ret;

	if (!ape__walk_next(&s->walk, &chunk, &dir)) {
		r->issuing = false;
		s->cur = NULL;
		return r->pending ? 0 : finish_query(s, r);
	}
	if (dir && s->c->kmax) {
		for (;;) {
			if (negligible(s, chunk, dir)) {
				s->st->chunks_skipped += (uint64_t)ape__walk_close(&s->walk, dir,
										   chunk);
				if (dir < 0)
					s->dead_lo = chunk;
				else
					s->dead_hi = chunk;
				return 0;
			}
			/*
			 * Results of this query chunk are still on their way and may well prove the
			 * rest negligible: wait for them rather than copy what may be skipped. The
			 * diagonal chunk and its first neighbour are nearly always needed, so they
			 * go out back to back.
			 */
			if (!r->pending || r->jobs < 2)
				break;
			if ((ret = retire(s)))
				return ret;
		}
	}
	if (s->count == s->depth && (ret = retire(s)))
		return ret;
	return issue(s, r, chunk);
}

/* After a failure: let every queue drain, then drop what the jobs in flight held. */
static void unwind(struct ape__stream *s)
{
	const struct ape__backend_ops *ops = s->ops;

	ops->synchronize(s->exec);
	for (int i = 0; i < s->depth; i++) {
		ops->synchronize(s->up[i]);
		ops->synchronize(s->down[i]);
		s->kvst[i].pending = false;
	}
	for (int i = 0; i < s->g.plan.q_slots; i++) {
		ops->synchronize(s->qup[i]);
		s->qst[i].pending = false;
	}
	while (s->count) {
		struct job *j = &s->ring[s->head];

		ape__devmem_drop(&s->mem, j->scratch);
		drop_job_events(s, j);
		s->head = (s->head + 1) % s->depth;
		s->count--;
	}
	for (int i = 0; i <= s->depth; i++) {
		drop_event(s, &s->qr[i].e0);
		drop_event(s, &s->qr[i].e1);
		s->qr[i].qc = -1;
		s->qr[i].loaded = false;
	}
	for (int i = 0; i < s->nkv; i++) {
		s->kv[i].chunk = -1;
		s->kv[i].busy = 0;
	}
}

static void fill_template(struct ape__stream *s)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__problem *p = c->p;
	struct ape__launch *l = &s->tmpl;

	memset(l, 0, sizeof(*l));
	l->B = p->B;
	l->H = p->H;
	l->Hkv = p->Hkv;
	l->D = p->D;
	l->in_dtype = p->in_dtype;
	l->out_dtype = c->merge ? APE_F32 : p->out_dtype;
	l->head_params = p->head_params;
	l->decay_nonneg = p->decay_nonneg;
	l->scale = p->scale;
	l->rope_base = p->rope_base;
	for (int64_t i = 0; i < p->D / 2; i++)
		l->omega[i] = pow(p->rope_base, -2.0 * (double)i / (double)p->D);
	l->causal = p->causal;
	l->layout = p->layout;
	l->skip_tol = p->decay_nonneg ? c->tol_kernel : 0.0;
	/* with a prior, the launches off the diagonal may leave out all their keys: that test
	 * gets half of the kernels' share, and the walks inside the launches the other half */
	if (c->merge && s->g.plan.prior_bytes)
		l->skip_tol /= 2;

	s->skip = (struct ape__skip_ctx){
		.B = p->B,
		.H = p->H,
		.Hkv = p->Hkv,
		.Lk = p->Lk,
		.ck = c->ck,
		.k_start = p->k_start,
		.causal = p->causal,
		.abs_scale = fabs(p->scale),
		.head_params = p->head_params,
		.km = c->kmax,
		.tol = c->tol_chunk,
	};
}

int ape__stream_run(struct ape__stream *s, const struct ape__stream_call *c, int who,
		    struct ape__trace_dev *trace, struct ape__stream_stats *st)
{
	int ret = 0;

	s->c = c;
	s->st = st;
	s->trace = trace;
	s->head = s->count = 0;
	s->nload = 0;
	s->qnext = 0;
	s->cur = NULL;
	s->niv = 0;
	s->dead_lo = -1;
	s->dead_hi = INT64_MAX;
	s->mem.peak = s->mem.cur;
	for (int i = 0; i < s->nkv; i++)
		s->kv[i].chunk = -1; /* a new call: nothing resident is valid */
	if (trace)
		trace->device_clock = s->ops->event_timestamp != NULL;
	fill_template(s);

	for (;;) {
		if (!s->cur) {
			int64_t qc;

			if (atomic_load(c->abort)) {
				ret = 1;
				break;
			}
			qc = ape__workq_next(c->wq, who);
			if (qc < 0)
				break;
			ret = begin_query(s, qc);
		} else {
			ret = step(s);
		}
		if (ret)
			break;
	}
	while (!ret && s->count)
		ret = retire(s);
	if (ret) {
		unwind(s);
	} else {
		for (int i = 0; i < s->depth; i++)
			s->kvst[i].pending = false;
		for (int i = 0; i < s->g.plan.q_slots; i++)
			s->qst[i].pending = false;
		st->overlap_ms += overlap_ms(s);
	}
	st->device_clock = s->ops->event_timestamp != NULL;
	if (s->mem.peak > st->peak_bytes)
		st->peak_bytes = s->mem.peak;
	s->c = NULL;
	return ret;
}
