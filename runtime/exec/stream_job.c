/* SPDX-License-Identifier: MIT */
/*
 * One job of the pipeline, a (query chunk, key chunk) launch: issuing it (its copies in, its
 * kernel, the copy of its partial result back, each queue waiting on the events it needs),
 * retiring it (its device times, its result merged or written), and the events it owns.
 */
#include "exec/stream_impl.h"

#include <math.h>
#include <string.h>

#include "core/clock.h"
#include "exec/launch.h"
#include "exec/pack.h"

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

int ape__stream_finish_query(struct ape__stream *s, struct qrec *r)
{
	const struct ape__stream_call *c = s->c;
	int ret = 0;

	if (c->merge)
		ape__acc_store(&r->acc, c->o, c->p->os, c->lse, c->ent, c->md, c->p->Lq, r->i0,
			       r->n);
	else if (!r->jobs) /* direct writes happen per job; no job means no visible key */
		ape__store_empty_rows(c->o, c->p->os, c->lse, c->ent, c->md, c->p->Lq, r->i0,
				      r->n);
	if (r->loaded) {
		ret = ape__stream_span(s, r->e0, r->e1, APE__LANE_H2D_Q + r->slot, "h2d Q", r->qc,
				       -1, r->bytes, r->host_t, NULL);
		drop_event(s, &r->e0);
		drop_event(s, &r->e1);
	}
	r->qc = -1;
	r->loaded = false;
	s->st->qchunks_done++;
	return ret;
}

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
	l->k = j->in_place ? NULL : s->kv[j->kvs].k;
	l->v = j->in_place ? NULL : s->kv[j->kvs].v;
	l->o = s->out[out].o;
	l->lse = s->out[out].lse;
	l->pairs = c->want_pairs ? s->out[out].pairs : NULL;
	l->ent = c->ent || c->md ? s->out[out].ent : NULL;
	l->md = c->ent || c->md ? s->out[out].md : NULL;
	l->q_start = c->p->q_start + r->i0;
	l->k_start = c->p->k_start + j->j0;
}

/* Makes j a launch on keys where the loader keeps them, if the loader can say where and the
 * backend takes such a launch: fills *l (its pages in *pg) and returns true. */
static bool try_in_place(struct ape__stream *s, struct job *j, int out, struct ape__launch *l,
			 struct ape__kv_pages *pg)
{
	const struct ape__kv_loader *ld = s->c->loader;
	struct ape__buf *k, *v;

	if (!ld || !ld->pages || !s->ops->attention_pages ||
	    !ld->pages(ld->arg, j->j0, j->n, &k, &v, pg))
		return false;
	j->in_place = true;
	fill_launch(s, j, out, l);
	l->k = k;
	l->v = v;
	l->pages = pg;
	if (s->ops->attention_pages(s->dev, l))
		return true;
	j->in_place = false;
	return false;
}

static bool want_diag(const struct ape__stream_call *c)
{
	return c->ent || c->md;
}

/* Where a job's results land in its host staging: pair counts first (8-byte aligned at the
 * start of the page-aligned buffer), then LSE, the entropies and distances (when wanted), then
 * O. Offsets for `rows` rows; the entropies at lse_off + rows, the distances after them. */
static void out_layout(const struct ape__stream *s, int64_t rows, size_t *lse_off,
		       size_t *o_off)
{
	*lse_off = s->c->want_pairs ? (size_t)rows * sizeof(uint64_t) : 0;
	*o_off = *lse_off + (size_t)rows * sizeof(float) * (want_diag(s->c) ? 3 : 1);
}

/* Copies a job's [B*H, n] rows of one per-row output into the call's [B, H, Lq] array. */
static void put_rows(const struct ape__stream_call *c, float *dst, const float *src, int64_t bh,
		     const struct qrec *r)
{
	for (int64_t i = 0; dst && i < bh; i++)
		memcpy(dst + i * c->p->Lq + r->i0, src + i * r->n, (size_t)r->n * sizeof(float));
}

int ape__stream_issue(struct ape__stream *s, struct qrec *r, int64_t kc)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__backend_ops *ops = s->ops;
	const int out = (s->head + s->count) % s->depth;
	const size_t oesz = c->merge ? 4 : ape_dtype_size(c->p->out_dtype);
	struct job *j = &s->ring[out];
	struct ape__queue *down = s->down[out];
	struct ape__launch l;
	struct ape__kv_pages pg;
	uint64_t ob, lb;
	size_t lo, oo;
	char *host;
	int ret;

	memset(j, 0, sizeof(*j));
	j->qr = r;
	j->kc = kc;
	j->j0 = kc * c->ck;
	j->n = j->j0 + c->ck < c->p->Lk ? c->ck : c->p->Lk - j->j0;
	s->count++; /* from here on, ape__stream_retire() cleans it up whatever fails */
	r->pending++;
	r->jobs++;
	if ((ret = ape__stream_ensure_out(s, out)))
		return ret;
	host = s->out[out].host.ptr;
	if (!r->loaded && (ret = ape__stream_load_query(s, r)))
		return ret;
	if (try_in_place(s, j, out, &l, &pg)) {
		if ((ret = c->loader->wait(c->loader->arg, s->exec)))
			return ret;
	} else {
		if ((ret = ape__stream_load_keys(s, j)))
			return ret;
		s->kv[j->kvs].busy++;
		fill_launch(s, j, out, &l);
	}
	if (s->qs[r->slot].prior && r->jobs > 1) {
		/* the b-th chunk from the diagonal tests against 2^-b of its share: the whole
		 * direction stays within it however many chunks it has */
		const int64_t b = kc > s->walk.diag ? kc - s->walk.diag : s->walk.diag - kc;

		l.lse_prior = s->qs[r->slot].prior;
		l.prior_tol = ape__skip_prior_tol(l.skip_tol, b);
	}
	j->scratch = ape__scratch_of(s->dev, &l);
	ape__devmem_hold(&s->mem, j->scratch);
	ob = ape__stream_row_bytes(s, s->g.H, r->n, oesz);
	lb = (uint64_t)(s->g.B * s->g.H * r->n) * sizeof(float);

	if ((ret = ape__stream_wait_on(s, s->exec, s->qs[r->slot].ready)) ||
	    (!j->in_place && (ret = ape__stream_wait_on(s, s->exec, s->kv[j->kvs].ready))))
		return ret;
	if (c->poison) {
		/* 0x7fc07fc0: a quiet NaN in f32, and two in f16 or bf16 */
		if ((ret = ops->fill(s->exec, l.o, 0, 0x7fc07fc0u, (size_t)ob)) ||
		    (ret = ops->fill(s->exec, l.lse, 0, 0x7fc07fc0u, (size_t)lb)) ||
		    (l.ent && (ret = ops->fill(s->exec, l.ent, 0, 0x7fc07fc0u, (size_t)lb))) ||
		    (l.md && (ret = ops->fill(s->exec, l.md, 0, 0x7fc07fc0u, (size_t)lb))))
			return ret;
	}
	j->host_t[1] = ape__now_ms();
	if ((ret = ops->event_record(s->exec, &j->k0)) || (ret = ops->attention(s->exec, &l)) ||
	    (ret = ops->event_record(s->exec, &j->k1)))
		return ret;
	if (!j->in_place)
		s->kv[j->kvs].used = j->k1;
	s->qs[r->slot].used = j->k1;
	/* the diagonal launch (a walk's first): its LSE is the later launches' prior */
	if (s->qs[r->slot].prior && r->jobs == 1 &&
	    (ret = ops->copy_d2d(s->exec, s->qs[r->slot].prior, 0, l.lse, 0, (size_t)lb)))
		return ret;

	j->host_t[2] = ape__now_ms();
	j->out_bytes = ob + lb + (l.pairs ? lb * 2 : 0) + (l.ent ? lb * 2 : 0);
	out_layout(s, s->g.B * s->g.H * r->n, &lo, &oo);
	if ((ret = ops->event_wait(down, j->k1)) || (ret = ops->event_record(down, &j->d0)) ||
	    (ret = ops->copy_d2h(down, host + oo, l.o, 0, (size_t)ob)) ||
	    (ret = ops->copy_d2h(down, host + lo, l.lse, 0, (size_t)lb)) ||
	    (l.pairs && (ret = ops->copy_d2h(down, host, l.pairs, 0, (size_t)(2 * lb)))) ||
	    (l.ent && (ret = ops->copy_d2h(down, host + lo + lb, l.ent, 0, (size_t)lb))) ||
	    (l.md && (ret = ops->copy_d2h(down, host + lo + 2 * lb, l.md, 0, (size_t)lb))) ||
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
		ape__acc_add(&r->acc, (const float *)o, lse, want_diag(c) ? lse + rows : NULL,
			     want_diag(c) ? lse + 2 * rows : NULL);
	} else {
		ape__unpack_rows(o, c->o, c->p->os, r->i0, r->n);
		put_rows(c, c->lse, lse, bh, r);
		if (want_diag(c)) {
			put_rows(c, c->ent, lse + rows, bh, r);
			put_rows(c, c->md, lse + 2 * rows, bh, r);
		}
	}
	for (int64_t i = 0; c->want_pairs && i < rows; i++)
		s->st->pairs_computed += pairs[i];
	s->st->work += (uint64_t)rows * (uint64_t)j->n;
}

int ape__stream_retire(struct ape__stream *s)
{
	const int out = s->head;
	struct job *j = &s->ring[out];
	struct qrec *r = j->qr;
	double t = j->host_t[0];
	int ret;

	ret = s->ops->synchronize(s->down[out]);
	if (!ret && j->loaded)
		ret = ape__stream_span(s, j->up0, j->up1, APE__LANE_H2D_KV + j->lane, "h2d K/V",
				       r->qc, j->kc, j->h2d, j->host_t[0], &t);
	if (!ret)
		ret = ape__stream_span(s, j->k0, j->k1, APE__LANE_KERNEL, "attention", r->qc,
				       j->kc, 0, fmax(j->host_t[1], t), &t);
	if (!ret)
		ret = ape__stream_span(s, j->d0, j->d1, APE__LANE_D2H + out, "d2h O/LSE", r->qc,
				       j->kc, j->out_bytes, fmax(j->host_t[2], t), NULL);
	if (!ret)
		consume(s, j, s->out[out].host.ptr);
	if (!j->in_place)
		s->kv[j->kvs].busy--;
	ape__devmem_drop(&s->mem, j->scratch);
	drop_job_events(s, j);
	s->head = (s->head + 1) % s->depth;
	s->count--;
	r->pending--;
	if (!ret && !r->pending && !r->issuing)
		ret = ape__stream_finish_query(s, r);
	return ret;
}

void ape__stream_unwind(struct ape__stream *s)
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
