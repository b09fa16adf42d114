/* SPDX-License-Identifier: MIT */
/*
 * One job of the pipeline, an (outer chunk, inner chunk) launch: issuing it (its copies in,
 * its kernels, the copy of its outputs back, each queue waiting on the events it needs),
 * retiring it (its device times, its outputs handed to the pass), the end of an outer chunk
 * (its accumulators back), and the events they own.
 */
#include "exec/stream_impl.h"

#include <math.h>
#include <string.h>

#include "core/clock.h"
#include "exec/pack.h"

static void forget(struct ape_be_event **ref, const struct ape_be_event *e)
{
	if (*ref == e)
		*ref = NULL;
}

/* The work e stands for has completed: no slot needs to wait for it any more. */
static void forget_everywhere(struct ape__stream *s, const struct ape_be_event *e)
{
	if (!e)
		return;
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		forget(&s->os[i].ready, e);
		forget(&s->os[i].used, e);
	}
	for (int i = 0; i < s->nis; i++) {
		forget(&s->is[i].ready, e);
		forget(&s->is[i].used, e);
	}
}

static void drop_event(struct ape__stream *s, struct ape_be_event **e)
{
	forget_everywhere(s, *e);
	s->ops->event_destroy(*e);
	*e = NULL;
}

static void drop_job_events(struct ape__stream *s, struct jslot *j)
{
	drop_event(s, &j->load_e0);
	drop_event(s, &j->load_e1);
	drop_event(s, &j->kernel_e0);
	drop_event(s, &j->kernel_e1);
	drop_event(s, &j->back_e0);
	drop_event(s, &j->back_e1);
}

/* Trace lanes: copies of query rows and of key rows by the axis they move, read-backs by slot
 * (an outer slot's after the job slots'). */
static int copy_lane(const struct ape__stream *s, int axis, int i)
{
	(void)s;
	return (axis == APE__AXIS_Q ? APE__LANE_H2D_Q : APE__LANE_H2D_KV) + i;
}

/* The chunk indices of a span as the trace names them (query chunk, key chunk). */
static void span_chunks(const struct ape__stream *s, int64_t oc, int64_t ic, int64_t *qc,
			int64_t *kc)
{
	*qc = s->pass->outer == APE__AXIS_Q ? oc : ic;
	*kc = s->pass->outer == APE__AXIS_Q ? ic : oc;
}

int ape__stream_issue_back(struct ape__stream *s, struct oslot *o)
{
	const struct ape_backend_plugin *ops = s->ops;
	const struct ape__pass *p = s->pass;
	uint64_t off = 0;
	int ret = 0;

	memset(o->back_host, 0, sizeof(o->back_host));
	o->back_e0 = o->back_e1 = NULL;
	o->back_issued = true;
	for (int t = 0; t < p->nt && !ret; t++) {
		const size_t n = (size_t)ape__stream_rows_bytes(s, t, o->n);

		/* an outer chunk without a job never initialised its accumulators: nothing back */
		if (p->t[t].role != APE__ROLE_OUTER_ACC || !p->t[t].back ||
		    s->at[t] != APE__AT_CHUNK || !o->loaded)
			continue;
		/* after the last kernel writing it (its queue is not the kernels') */
		if (!o->back_e0 && !(ret = ape__stream_wait_on(s, o->queue, o->used)) &&
		    !(ret = ops->event_record(o->queue, &o->back_e0)))
			o->back_t = ape__now_ms();
		if (!ret)
			ret = ops->copy_d2h(o->queue, (char *)o->stage_back.ptr + off, o->buf[t], 0, n);
		o->back_host[t] = (char *)o->stage_back.ptr + off;
		off += n;
	}
	o->back_off = off;
	if (!ret && o->back_e0)
		ret = ops->event_record(o->queue, &o->back_e1);
	return ret;
}

int ape__stream_finish_outer(struct ape__stream *s, struct oslot *o)
{
	const struct ape_backend_plugin *ops = s->ops;
	const struct ape__pass *p = s->pass;
	const int slot = (int)(o - s->os);
	int64_t qc, kc;
	int ret = 0;

	span_chunks(s, o->oc, -1, &qc, &kc);
	if (!o->back_issued)
		ret = ape__stream_issue_back(s, o);
	if (!ret && o->back_e0 && !(ret = ops->synchronize(o->queue))) {
		o->stage_pending = false;
		s->st->d2h += o->back_off;
		ret = ape__stream_span(s, o->back_e0, o->back_e1,
				       APE__LANE_D2H + APE__MAX_DEPTH + slot, p->ops->span[4], qc, kc,
				       o->back_off, o->back_t, o->back_t, NULL);
	}
	ops->event_destroy(o->back_e0);
	ops->event_destroy(o->back_e1);
	o->back_e0 = o->back_e1 = NULL;
	o->back_issued = false;
	if (ret)
		return ret;
	/* the last step: after it nothing of the chunk can fail (its rows may be the caller's) */
	p->ops->outer_done(p->self, slot, o->oc, o->o0, o->n, o->back_host);
	o->oc = -1;
	o->loaded = false;
	s->st->outer_done++;
	return 0;
}

/* Where job j finds tensor t of the run. */
static struct ape_be_buf *job_buf(const struct ape__stream *s, const struct jslot *j, int t)
{
	const struct ape__pass_tensor *x = &s->pass->t[t];

	if (s->at[t] == APE__AT_UNUSED)
		return NULL;
	if (s->at[t] == APE__AT_WRAPPED)
		return s->wrap[t];
	switch (x->role) {
	case APE__ROLE_OUTER_IN:
	case APE__ROLE_OUTER_ACC:
		return j->os->buf[t];
	case APE__ROLE_INNER_IN:
		return j->is >= 0 ? s->is[j->is].buf[t] : NULL;
	case APE__ROLE_CALL_ACC:
	case APE__ROLE_CALL_IN:
		return s->call_buf[t];
	default:
		return j->buf[t];
	}
}

/* Makes j's inner inputs the loader's pages, if the loader can say where they are and the
 * pass takes them so. */
static bool try_pages(struct ape__stream *s, struct jslot *j)
{
	const struct ape__kv_loader *ld = s->c->loader;
	const struct ape__pass *p = s->pass;
	struct ape_be_buf *k, *v;
	int tk = -1, tv = -1;

	if (!ld || !ld->pages || !p->ops->in_pages ||
	    !ld->pages(ld->arg, j->pj.i0, j->pj.in, &k, &v, &j->pages))
		return false;
	for (int t = 0; t < p->nt; t++)
		if (p->t[t].role == APE__ROLE_INNER_IN && !p->t[t].host) {
			if (tk < 0)
				tk = t;
			else
				tv = t;
		}
	if (tk < 0 || tv < 0)
		return false;
	/* the pass decides from the whole launch: its outputs too (a backend's in-place path
	 * may not write them all, the diagnostics for one) */
	for (int t = 0; t < p->nt; t++)
		if (p->t[t].role != APE__ROLE_INNER_IN && !j->pj.buf[t])
			j->pj.buf[t] = job_buf(s, j, t);
	j->pj.buf[tk] = k;
	j->pj.buf[tv] = v;
	j->pj.pages = &j->pages;
	if (p->ops->in_pages(p->self, &j->pj))
		return true;
	j->pj.pages = NULL;
	j->pj.buf[tk] = j->pj.buf[tv] = NULL;
	return false;
}

/* JOB_IN rows made by the pass, copied before the launch on the compute queue (the job's
 * staging is not reused before the job retires, after the copy). */
static int send_job_inputs(struct ape__stream *s, struct jslot *j, uint64_t *bytes)
{
	const struct ape__pass *p = s->pass;
	uint64_t off = 0;
	int ret = 0;

	for (int t = 0; t < p->nt && !ret; t++) {
		const struct ape__pass_tensor *x = &p->t[t];
		const int64_t rows = x->axis == p->outer ? j->pj.on : j->pj.in;
		const size_t n = (size_t)(x->row_bytes * (uint64_t)rows);
		char *h;

		if (x->role != APE__ROLE_JOB_IN || s->at[t] == APE__AT_UNUSED)
			continue;
		/* only now: a pass without job inputs has no staging (NULL + 0 is UB) */
		h = (char *)j->stage.ptr + off;
		p->ops->job_input(p->self, &j->pj, t, h, n);
		ret = s->ops->copy_h2d(s->exec, j->buf[t], 0, h, n);
		off += n;
	}
	*bytes += off;
	return ret;
}

/* Fills of the job's outputs before its launch: accumulating ones with their start value,
 * the others with NaN under APE_CONTEXT_POISON_OUTPUTS (so an element a kernel misses shows). */
static int fill_outputs(struct ape__stream *s, struct jslot *j)
{
	const struct ape__pass *p = s->pass;
	int ret = 0;

	for (int t = 0; t < p->nt && !ret; t++) {
		const struct ape__pass_tensor *x = &p->t[t];
		const int64_t rows = x->axis == p->outer ? j->pj.on : j->pj.in;

		if (x->role != APE__ROLE_JOB_OUT || s->at[t] == APE__AT_UNUSED)
			continue;
		if (s->at[t] == APE__AT_WRAPPED) {
			/* the host output itself: no kernel of another job writes these rows */
			s->st->in_place = true;
			if (s->c->poison)
				ape__fill_rows(x->host, x->s, x->axis == p->outer ? j->pj.o0 : j->pj.i0,
					       rows, 0x7fc07fc0u);
			continue;
		}
		if (x->init_each || s->c->poison)
			/* 0x7fc07fc0: a quiet NaN in f32, and two in f16 or bf16 */
			ret = s->ops->fill(s->exec, j->buf[t], 0,
					   x->init_each ? x->init : 0x7fc07fc0u,
					   (size_t)(x->row_bytes * (uint64_t)rows));
	}
	return ret;
}

/* The read-back of j's outputs on its down queue, after its kernels; the staging offsets of
 * JOB_OUT tensors follow the JOB_IN ones. */
static int read_back(struct ape__stream *s, struct jslot *j)
{
	const struct ape__pass *p = s->pass;
	uint64_t off = 0;
	int ret;

	uint64_t in_off = 0;

	bool copies = false;

	for (int t = 0; t < p->nt; t++) {
		const struct ape__pass_tensor *x = &p->t[t];

		if (x->role == APE__ROLE_JOB_IN && s->at[t] != APE__AT_UNUSED)
			off += x->row_bytes * (uint64_t)(x->axis == p->outer ? j->pj.on : j->pj.in);
		copies |= (x->role == APE__ROLE_JOB_OUT || x->role == APE__ROLE_JOB_IN) && x->back &&
			  s->at[t] != APE__AT_UNUSED && s->at[t] != APE__AT_WRAPPED;
		j->pj.host[t] = NULL;
	}
	/* the run's one job, its outputs (if any) written in place: its kernels are the end */
	j->back_on_exec = !copies && s->c->no == 1 && s->c->ni == 1;
	if (j->back_on_exec)
		return 0;
	if ((ret = s->ops->event_wait(j->down, j->kernel_e1)) ||
	    (ret = s->ops->event_record(j->down, &j->back_e0)))
		return ret;
	for (int t = 0; t < p->nt && !ret; t++) {
		const struct ape__pass_tensor *x = &p->t[t];
		const int64_t rows = x->axis == p->outer ? j->pj.on : j->pj.in;
		const size_t n = (size_t)(x->row_bytes * (uint64_t)rows);
		uint64_t at;
		char *h;

		j->pj.host[t] = NULL;
		if ((x->role != APE__ROLE_JOB_OUT && x->role != APE__ROLE_JOB_IN) ||
		    s->at[t] == APE__AT_UNUSED || s->at[t] == APE__AT_WRAPPED)
			continue; /* wrapped: a JOB_OUT written in place (JOB_IN is never wrapped) */
		/* a JOB_IN tensor comes back over its own rows in the staging: they went out
		 * before the kernels ran */
		at = x->role == APE__ROLE_JOB_IN ? in_off : off;
		if (x->role == APE__ROLE_JOB_IN)
			in_off += n;
		if (!x->back)
			continue;
		/* only now: nothing to bring back may mean no staging (NULL + 0 is UB) */
		h = (char *)j->stage.ptr + at;
		ret = s->ops->copy_d2h(j->down, h, j->buf[t], 0, n);
		j->pj.host[t] = h;
		j->back_bytes += n;
		if (x->role == APE__ROLE_JOB_OUT)
			off += n;
	}
	if (!ret)
		ret = s->ops->event_record(j->down, &j->back_e1);
	s->st->d2h += j->back_bytes;
	return ret;
}

int ape__stream_issue(struct ape__stream *s, struct oslot *o, int64_t ic)
{
	const struct ape__pass *p = s->pass;
	const int slot = (s->head + s->count) % s->depth;
	struct jslot *j = &s->ring[slot];
	uint64_t up = 0;
	int ret;

	memset(&j->pj, 0, sizeof(j->pj));
	j->os = o;
	j->is = -1;
	j->loaded = false;
	j->back_on_exec = false;
	j->load_bytes = j->back_bytes = j->scratch = 0;
	j->pj.oc = o->oc;
	j->pj.ic = ic;
	j->pj.o0 = o->o0;
	j->pj.on = o->n;
	j->pj.in = ape__stream_inner_rows(s, ic, &j->pj.i0);
	j->pj.slot = (int)(o - s->os);
	j->pj.nth = o->issued;
	s->count++; /* from here on, ape__stream_retire() cleans it up whatever fails */
	o->pending++;
	o->issued++;
	if ((ret = ape__stream_ensure_jslot(s, j)))
		return ret;
	if (!o->loaded && (ret = ape__stream_load_outer(s, o)))
		return ret;
	if (try_pages(s, j)) {
		if ((ret = s->c->loader->wait(s->c->loader->arg, s->exec)))
			return ret;
	} else {
		if ((ret = ape__stream_load_inner(s, j)))
			return ret;
		if (j->is >= 0)
			s->is[j->is].busy++;
	}
	for (int t = 0; t < p->nt; t++) {
		if (!j->pj.buf[t])
			j->pj.buf[t] = job_buf(s, j, t);
		j->pj.wrapped[t] = s->at[t] == APE__AT_WRAPPED;
	}
	j->scratch = p->ops->scratch(p->self, s->dev, j->pj.on, j->pj.in);
	ape__devmem_hold(&s->mem, j->scratch);

	if ((ret = ape__stream_wait_on(s, s->exec, o->ready)) ||
	    (j->is >= 0 && (ret = ape__stream_wait_on(s, s->exec, s->is[j->is].ready))) ||
	    (ret = send_job_inputs(s, j, &up)) || (ret = fill_outputs(s, j)))
		return ret;
	s->st->h2d += up;
	j->host_t[1] = ape__now_ms();
	if ((ret = s->ops->event_record(s->exec, &j->kernel_e0)) ||
	    (ret = p->ops->launch(p->self, s->exec, &j->pj)) ||
	    (ret = s->ops->event_record(s->exec, &j->kernel_e1)))
		return ret;
	if (j->is >= 0)
		s->is[j->is].used = j->kernel_e1;
	o->used = j->kernel_e1;
	j->host_t[2] = ape__now_ms();
	if ((ret = read_back(s, j)))
		return ret;
	s->st->chunks++;
	return 0;
}

int ape__stream_retire(struct ape__stream *s)
{
	const struct ape__pass *p = s->pass;
	const int slot = s->head;
	struct jslot *j = &s->ring[slot];
	struct oslot *o = j->os;
	double t = j->host_t[0];
	int64_t qc, kc;
	int ret;

	span_chunks(s, j->pj.oc, j->pj.ic, &qc, &kc);
	ret = s->ops->synchronize(j->back_on_exec ? s->exec : j->down);
	if (!ret && j->loaded)
		ret = ape__stream_span(s, j->load_e0, j->load_e1,
				       copy_lane(s, p->outer == APE__AXIS_Q ? APE__AXIS_K : APE__AXIS_Q,
						 j->lane),
				       p->ops->span[1], qc, kc, j->load_bytes, j->host_t[0],
				       j->host_t[0], &t);
	if (!ret)
		ret = ape__stream_span(s, j->kernel_e0, j->kernel_e1, APE__LANE_KERNEL,
				       p->ops->span[2], qc, kc, 0, fmax(j->host_t[1], t), j->host_t[1],
				       &t);
	if (!ret && j->back_bytes)
		ret = ape__stream_span(s, j->back_e0, j->back_e1, APE__LANE_D2H + slot,
				       p->ops->span[3], qc, kc, j->back_bytes,
				       fmax(j->host_t[2], t), j->host_t[2], NULL);
	/* the outer chunk's inputs arrived before this job's kernels ran: account them now, so
	 * that nothing fallible remains once the pass has taken results in */
	if (!ret && o->load_e0) {
		span_chunks(s, o->oc, -1, &qc, &kc);
		ret = ape__stream_span(s, o->load_e0, o->load_e1,
				       copy_lane(s, p->outer, (int)(o - s->os)), p->ops->span[0], qc,
				       kc, o->load_bytes, o->load_t, o->load_t, NULL);
		drop_event(s, &o->load_e0);
		drop_event(s, &o->load_e1);
	}
	if (!ret) {
		p->ops->consume(p->self, &j->pj);
		s->st->work += (uint64_t)j->pj.on * (uint64_t)j->pj.in;
	}
	if (j->is >= 0)
		s->is[j->is].busy--;
	ape__devmem_drop(&s->mem, j->scratch);
	drop_job_events(s, j);
	s->head = (s->head + 1) % s->depth;
	s->count--;
	o->pending--;
	if (!ret && !o->pending && !o->walking)
		ret = ape__stream_finish_outer(s, o);
	return ret;
}

void ape__stream_unwind(struct ape__stream *s)
{
	const struct ape_backend_plugin *ops = s->ops;

	if (s->exec)
		ops->synchronize(s->exec);
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		if (s->ring[i].up)
			ops->synchronize(s->ring[i].up);
		if (s->ring[i].down)
			ops->synchronize(s->ring[i].down);
		if (s->os[i].queue)
			ops->synchronize(s->os[i].queue);
		s->inner_stage[i].pending = false;
		s->os[i].stage_pending = false;
	}
	while (s->count) {
		struct jslot *j = &s->ring[s->head];

		ape__devmem_drop(&s->mem, j->scratch);
		drop_job_events(s, j);
		s->head = (s->head + 1) % s->depth;
		s->count--;
	}
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		drop_event(s, &s->os[i].load_e0);
		drop_event(s, &s->os[i].load_e1);
		drop_event(s, &s->os[i].back_e0);
		drop_event(s, &s->os[i].back_e1);
		s->os[i].back_issued = false;
		s->os[i].oc = -1;
		s->os[i].loaded = false;
		s->os[i].pending = 0;
	}
	for (int i = 0; i < s->nis; i++) {
		s->is[i].chunk = -1;
		s->is[i].busy = 0;
	}
}
