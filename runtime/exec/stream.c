/* SPDX-License-Identifier: MIT */
/*
 * The session of one device: its queues and every buffer the pipeline uses (outer, inner and
 * job slots on the device, their staging on the host, the run's accumulators), allocated on
 * first use or all at once by ape__stream_reserve(), freed by ape__stream_destroy(). The
 * pipeline itself is in stream_run.c.
 */
#include "exec/stream_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "exec/pack.h"

/* ------------------------------------------------------------------ what a pass holds */

/* The rows a tensor has in a chunk of co outer and ci inner rows (0: none). */
static int64_t chunk_rows(const struct ape__pass *p, int t, int64_t co, int64_t ci)
{
	const struct ape__pass_tensor *x = &p->t[t];

	if (x->axis == APE__AXIS_NONE)
		return 0;
	return x->axis == p->outer ? co : ci;
}

bool ape__pass_wraps(const struct ape__pass *p, int t, bool in_place, uint64_t max_wrap,
		     int64_t rows, int64_t all)
{
	const struct ape__pass_tensor *x = &p->t[t];

	if (!in_place || !x->row_bytes)
		return false;
	switch (x->role) {
	case APE__ROLE_OUTER_IN:
	case APE__ROLE_INNER_IN:
		return x->host && (x->views || (rows == all && x->packed)) &&
		       ape__tensor_span_bytes(x->host, x->s) <= max_wrap;
	case APE__ROLE_OUTER_ACC:
		return x->dest && rows == all && x->row_bytes * (uint64_t)all <= max_wrap;
	case APE__ROLE_JOB_OUT:
		/* the call's own staging, at every chunking (each job writes its own rows once) */
		return x->host && !x->init_each &&
		       ape__tensor_span_bytes(x->host, x->s) <= max_wrap;
	default:
		return false;
	}
}

struct ape_be_view ape__pass_view(const struct ape__pass *p, const struct ape__pass_job *j, int t,
				  int64_t heads, int64_t D)
{
	const struct ape__pass_tensor *x = &p->t[t];
	const bool outer = x->axis == p->outer;
	const int64_t r0 = outer ? j->o0 : j->i0, n = outer ? j->on : j->in;

	if (j->wrapped[t])
		return (struct ape_be_view){ r0 * x->s[2], x->s[0], x->s[1], x->s[2] };
	return (struct ape_be_view){ 0, heads * n * D, n * D, D };
}

void ape__pass_bytes(const struct ape__pass *p, bool in_place, uint64_t max_wrap, int64_t Lo,
		     int64_t Li, int64_t co, int64_t ci, struct ape__plan_bytes *b)
{
	memset(b, 0, sizeof(*b));
	for (int t = 0; t < p->nt; t++) {
		const struct ape__pass_tensor *x = &p->t[t];
		const int64_t rows = chunk_rows(p, t, co, ci);
		const int64_t all = x->axis == p->outer ? Lo : Li;
		uint64_t n;

		if (x->role == APE__ROLE_CALL_ACC || x->role == APE__ROLE_CALL_IN) {
			b->call = ape__sat_add(b->call, x->bytes);
			b->largest = x->bytes > b->largest ? x->bytes : b->largest;
			continue;
		}
		if (!x->row_bytes || ape__pass_wraps(p, t, in_place, max_wrap, rows, all))
			continue;
		n = ape__sat_mul(x->row_bytes, (uint64_t)rows);
		b->largest = n > b->largest ? n : b->largest;
		switch (x->role) {
		case APE__ROLE_OUTER_IN:
		case APE__ROLE_OUTER_ACC:
			b->outer = ape__sat_add(b->outer, n);
			break;
		case APE__ROLE_INNER_IN:
			b->inner = ape__sat_add(b->inner, n);
			break;
		default:
			b->job = ape__sat_add(b->job, n);
			break;
		}
	}
}

/* ------------------------------------------------------------------ the session */

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
	s->max_is = g->plan.i_slots;
	ape__devmem_init(&s->mem, dev, g->budget);
	for (int i = 0; i < APE__MAX_DEPTH; i++)
		s->os[i].oc = -1;
	s->is = ape__calloc((size_t)s->max_is + 1, sizeof(*s->is));
	if (!s->is) {
		free(s);
		return ape__error(APE_ENOMEM, "out of memory for a device session");
	}
	if ((ret = ape__stream_queue(s, &s->exec))) {
		ape__stream_destroy(s);
		return ret;
	}
	*out = s;
	return 0;
}

int ape__stream_queue(struct ape__stream *s, struct ape_be_queue **q)
{
	return *q ? 0 : s->ops->queue_create(s->dev, q);
}

int ape__stream_ensure_host(struct ape__stream *s, struct ape__hostmem *m, uint64_t bytes)
{
	if (!bytes || (m->ptr && m->bytes >= bytes))
		return 0;
	/* a run with fewer tensors in place than the last needs more staging */
	ape__host_free(s->dev, m);
	return ape__host_alloc(s->dev, (size_t)bytes, m);
}

/* The chunk buffer of tensor t for `rows` rows, unless the run wraps it. */
static int ensure_buf(struct ape__stream *s, int t, int64_t rows, struct ape_be_buf **b)
{
	const struct ape__pass_tensor *x = &s->g.shape.t[t];
	char what[64];

	if (*b || !x->row_bytes || (s->pass && s->at[t] != APE__AT_CHUNK))
		return 0;
	snprintf(what, sizeof(what), "allocating a chunk of %s", x->name);
	return ape__devmem_alloc(&s->mem, ape__stream_rows_bytes(s, t, rows), b, what);
}

/* Tensor t as the run in progress has it (its flags: back, used), or as the geometry does. */
static const struct ape__pass_tensor *tensor(const struct ape__stream *s, int t)
{
	return s->pass ? &s->pass->t[t] : &s->g.shape.t[t];
}

/* Whether tensor t needs staging for `role` (with `back`: read back): in the run in progress,
 * chunk tensors it uses (and reads back); outside a run, every one the geometry has. */
static bool staged(const struct ape__stream *s, int t, int role, bool back)
{
	const struct ape__pass_tensor *x = tensor(s, t);

	if ((int)x->role != role || !s->g.shape.t[t].row_bytes)
		return false;
	if (!s->pass)
		return true;
	return s->at[t] == APE__AT_CHUNK && (!back || x->back);
}

/* Staging bytes of the tensors of `role` for chunks of `rows` rows (with `back`: only those
 * read back), at the geometry's sizes. */
static uint64_t stage_bytes(const struct ape__stream *s, int role, bool back, int64_t rows)
{
	uint64_t n = 0;

	for (int t = 0; t < s->g.shape.nt; t++)
		if (staged(s, t, role, back))
			n += s->g.shape.t[t].row_bytes * (uint64_t)rows;
	return n;
}

int ape__stream_ensure_oslot(struct ape__stream *s, struct oslot *o)
{
	const struct ape__plan *p = &s->g.plan;
	int ret = ape__stream_queue(s, &o->queue);

	for (int t = 0; !ret && t < s->g.shape.nt; t++) {
		const int role = s->g.shape.t[t].role;

		if (role == APE__ROLE_OUTER_IN || role == APE__ROLE_OUTER_ACC)
			ret = ensure_buf(s, t, p->co, &o->buf[t]);
	}
	/* host tensors' rows are packed here; a loader's (none for outer inputs) are not */
	if (!ret)
		ret = ape__stream_ensure_host(s, &o->stage_in,
					      stage_bytes(s, APE__ROLE_OUTER_IN, false, p->co));
	if (!ret)
		ret = ape__stream_ensure_host(s, &o->stage_back,
					      stage_bytes(s, APE__ROLE_OUTER_ACC, true, p->co));
	return ret;
}

int ape__stream_ensure_jslot(struct ape__stream *s, struct jslot *j)
{
	const struct ape__plan *p = &s->g.plan;
	uint64_t out = 0, in = 0;
	int ret = ape__stream_queue(s, &j->down);

	for (int t = 0; !ret && t < s->g.shape.nt; t++) {
		const struct ape__pass_tensor *x = &s->g.shape.t[t];
		const int64_t rows = x->axis == s->g.shape.outer ? p->co : p->ci;

		if (x->role != APE__ROLE_JOB_OUT && x->role != APE__ROLE_JOB_IN)
			continue;
		ret = ensure_buf(s, t, rows, &j->buf[t]);
		if (staged(s, t, APE__ROLE_JOB_IN, false))
			in += x->row_bytes * (uint64_t)rows;
		else if (staged(s, t, APE__ROLE_JOB_OUT, true))
			out += x->row_bytes * (uint64_t)rows;
	}
	if (!ret)
		ret = ape__stream_ensure_host(s, &j->stage, out + in);
	return ret;
}

int ape__stream_ensure_call(struct ape__stream *s)
{
	uint64_t back = 0, in = 0;
	int ret = 0;

	for (int t = 0; !ret && t < s->g.shape.nt; t++) {
		const struct ape__pass_tensor *x = &s->g.shape.t[t];

		if ((x->role != APE__ROLE_CALL_ACC && x->role != APE__ROLE_CALL_IN) || !x->bytes)
			continue;
		/* on a device reading host memory the tables, and the accumulators read back,
		 * lie in their host staging (stream_run.c, start_call) */
		if (!s->call_buf[t] &&
		    !((x->role == APE__ROLE_CALL_IN || tensor(s, t)->back) && s->c &&
		      s->c->host_tables))
			ret = ape__devmem_alloc(&s->mem, x->bytes, &s->call_buf[t], x->name);
		if (x->role == APE__ROLE_CALL_IN)
			in += x->bytes;
		else
			back += tensor(s, t)->back ? x->bytes : 0;
	}
	if (!ret)
		ret = ape__stream_ensure_host(s, &s->call_back, back);
	if (!ret)
		ret = ape__stream_ensure_host(s, &s->call_in, in);
	return ret;
}

int ape__stream_grow_inner(struct ape__stream *s)
{
	struct islot *is = &s->is[s->nis];
	int ret = 0;

	for (int t = 0; !ret && t < s->g.shape.nt; t++)
		if (s->g.shape.t[t].role == APE__ROLE_INNER_IN)
			ret = ensure_buf(s, t, s->g.plan.ci, &is->buf[t]);
	if (ret) {
		for (int t = 0; t < s->g.shape.nt; t++)
			ape__devmem_free(&s->mem, &is->buf[t],
					 ape__stream_rows_bytes(s, t, s->g.plan.ci));
		return ret;
	}
	is->chunk = -1;
	s->nis++;
	return 0;
}

/* Intervals of the overlap figure in the largest run: per outer chunk the copy of its rows and
 * of its accumulators, per job its copy in, its kernels and its copy back. Capped: beyond it (a
 * cache of a million one-row chunks) the figure costs host memory only when such a run
 * happens. */
static size_t intervals_of(const struct ape__plan *p)
{
	const int64_t cap = 1 << 16;

	if (p->no > cap || p->ni > cap || p->no * (2 + 3 * p->ni) > cap)
		return (size_t)cap;
	return (size_t)(p->no * (2 + 3 * p->ni));
}

int ape__stream_reserve(struct ape__stream *s)
{
	const int nos = s->g.plan.o_slots;
	int ret = 0;

	for (int i = 0; !ret && i < s->depth; i++)
		if (!(ret = ape__stream_ensure_jslot(s, &s->ring[i])))
			ret = ape__stream_queue(s, &s->ring[i].up);
	for (int i = 0; !ret && i < nos; i++)
		ret = ape__stream_ensure_oslot(s, &s->os[i]);
	while (!ret && s->nis < s->max_is)
		ret = ape__stream_grow_inner(s);
	if (!ret)
		ret = ape__stream_ensure_call(s);
	if (!ret)
		ape__stream_reserve_intervals(s, intervals_of(&s->g.plan));
	return ret;
}

uint64_t ape__stream_device_bytes(const struct ape__stream *s)
{
	return s->mem.cur;
}

int64_t ape__stream_outer_rows(const struct ape__stream *s, int64_t oc, int64_t *first)
{
	const int64_t L = s->pass->outer == APE__AXIS_Q ? s->c->Lq : s->c->Lk;

	*first = oc * s->c->co;
	return *first + s->c->co < L ? s->c->co : L - *first;
}

int64_t ape__stream_inner_rows(const struct ape__stream *s, int64_t ic, int64_t *first)
{
	const int64_t L = s->pass->outer == APE__AXIS_Q ? s->c->Lk : s->c->Lq;

	*first = ic * s->c->ci;
	return *first + s->c->ci < L ? s->c->ci : L - *first;
}

void ape__stream_destroy(struct ape__stream *s)
{
	const struct ape_backend_plugin *ops;
	const struct ape__plan *p;

	if (!s)
		return;
	ops = s->ops;
	p = &s->g.plan;
	/* queues first: destroying one waits for its work, so buffers are idle afterwards */
	ops->queue_destroy(s->exec);
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		ops->queue_destroy(s->ring[i].up);
		ops->queue_destroy(s->ring[i].down);
		ops->queue_destroy(s->os[i].queue);
	}
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		for (int t = 0; t < s->g.shape.nt; t++) {
			const struct ape__pass_tensor *x = &s->g.shape.t[t];
			const int64_t rows = x->axis == s->g.shape.outer ? p->co : p->ci;

			ape__devmem_free(&s->mem, &s->os[i].buf[t], ape__stream_rows_bytes(s, t, rows));
			ape__devmem_free(&s->mem, &s->ring[i].buf[t],
					 ape__stream_rows_bytes(s, t, rows));
		}
		ape__host_free(s->dev, &s->os[i].stage_in);
		ape__host_free(s->dev, &s->os[i].stage_back);
		ape__host_free(s->dev, &s->ring[i].stage);
		ape__host_free(s->dev, &s->inner_stage[i].mem);
	}
	for (int i = 0; i < s->nis; i++)
		for (int t = 0; t < s->g.shape.nt; t++)
			ape__devmem_free(&s->mem, &s->is[i].buf[t],
					 ape__stream_rows_bytes(s, t, p->ci));
	for (int t = 0; t < s->g.shape.nt; t++)
		ape__devmem_free(&s->mem, &s->call_buf[t], s->g.shape.t[t].bytes);
	ape__host_free(s->dev, &s->call_back);
	ape__host_free(s->dev, &s->call_in);
	free(s->is);
	free(s->iv);
	free(s);
}
