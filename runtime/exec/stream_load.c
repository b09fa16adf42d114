/* SPDX-License-Identifier: MIT */
/*
 * Copies into the device session: an outer chunk's inputs (packed into staging) with its
 * accumulators initialised, and inner chunks, packed from host tensors or filled by the call's
 * loader (the KV cache's gathers), into a slot chosen so that chunks the next outer chunks need
 * stay resident. Tensors the run wraps where they lie are not copied at all.
 */
#include "exec/stream_impl.h"

#include <stdlib.h>

#include "core/clock.h"
#include "exec/pack.h"

/* Whether tensor t of the run is copied from a host tensor into chunk buffers. */
static bool packed(const struct ape__stream *s, int t)
{
	return s->at[t] == APE__AT_CHUNK && s->pass->t[t].host;
}

int ape__stream_load_outer(struct ape__stream *s, struct oslot *o)
{
	const struct ape_backend_plugin *ops = s->ops;
	const struct ape__pass *p = s->pass;
	uint64_t bytes = 0, off = 0;
	bool any = false;
	int ret;

	if ((ret = ape__stream_ensure_oslot(s, o)))
		return ret;
	for (int t = 0; t < p->nt; t++)
		any |= (p->t[t].role == APE__ROLE_OUTER_IN && packed(s, t)) ||
		       (p->t[t].role == APE__ROLE_OUTER_ACC && s->at[t] != APE__AT_UNUSED);
	o->loaded = true;
	if (!any) /* every input in place, nothing to initialise */
		return 0;
	if (o->stage_pending) { /* the previous copy from this staging buffer */
		if ((ret = ops->synchronize(o->queue)))
			return ret;
		o->stage_pending = false;
	}
	for (int t = 0; t < p->nt; t++)
		if (p->t[t].role == APE__ROLE_OUTER_IN && packed(s, t)) {
			ape__pack_rows((char *)o->stage_in.ptr + off, p->t[t].host, p->t[t].s, o->o0,
				       o->n);
			off += ape__stream_rows_bytes(s, t, o->n);
		}
	o->load_t = ape__now_ms();
	if ((ret = ape__stream_wait_on(s, o->queue, o->used)) ||
	    (ret = ops->event_record(o->queue, &o->load_e0)))
		return ret;
	off = 0;
	for (int t = 0; t < p->nt && !ret; t++) {
		const size_t n = (size_t)ape__stream_rows_bytes(s, t, o->n);

		if (p->t[t].role == APE__ROLE_OUTER_IN && packed(s, t)) {
			ret = ops->copy_h2d(o->queue, o->buf[t], 0, (char *)o->stage_in.ptr + off, n);
			off += n;
			bytes += n;
		} else if (p->t[t].role == APE__ROLE_OUTER_ACC && s->at[t] != APE__AT_UNUSED) {
			ret = ops->fill(o->queue, s->at[t] == APE__AT_WRAPPED ? s->wrap[t] : o->buf[t],
					0, p->t[t].init, n);
		}
	}
	if (ret || (ret = ops->event_record(o->queue, &o->load_e1)))
		return ret;
	o->stage_pending = off > 0;
	o->ready = o->load_e1;
	o->load_bytes = bytes;
	s->st->h2d += bytes;
	return 0;
}

/* Which inner slot to (re)fill: an empty one, then one holding a chunk the pass already ruled
 * out, then a new one while the plan allows, else the idle one farthest from the current
 * walk's first chunk (near chunks serve the next outer chunk too). */
static int pick_victim(struct ape__stream *s, int *out)
{
	const struct ape__pass *p = s->pass;
	int best = -1;
	int64_t far = -1;
	int ret;

	for (int i = 0; i < s->nis; i++)
		if (!s->is[i].busy && (s->is[i].chunk < 0 || s->is[i].chunk <= p->dead_lo ||
				       s->is[i].chunk >= p->dead_hi)) {
			*out = i;
			return 0;
		}
	if (s->nis < s->max_is) {
		ret = ape__stream_grow_inner(s);
		if (!ret) {
			*out = s->nis - 1;
			return 0;
		}
		if (ret != APE_ENOMEM || !s->nis)
			return ret;
		s->max_is = s->nis; /* the device is fuller than planned: no more residency */
	}
	for (int pass = 0; pass < 2 && best < 0; pass++)
		for (int i = 0; i < s->nis; i++) {
			int64_t d = llabs(s->is[i].chunk - s->diag);

			if ((pass || !s->is[i].busy) && d > far) {
				far = d;
				best = i;
			}
		}
	*out = best;
	return 0;
}

/* The loader's two INNER_IN tensors (the keys, then the values). */
static void loader_tensors(const struct ape__pass *p, int *tk, int *tv)
{
	*tk = *tv = -1;
	for (int t = 0; t < p->nt; t++)
		if (p->t[t].role == APE__ROLE_INNER_IN && !p->t[t].host) {
			if (*tk < 0)
				*tk = t;
			else
				*tv = t;
		}
}

int ape__stream_load_inner(struct ape__stream *s, struct jslot *j)
{
	const struct ape__stream_call *c = s->c;
	const struct ape_backend_plugin *ops = s->ops;
	const struct ape__pass *p = s->pass;
	const int64_t ic = j->pj.ic, r0 = j->pj.i0, n = j->pj.in;
	struct jslot *lane;
	struct islot *is;
	struct stage *st;
	uint64_t bytes = 0, off = 0;
	bool any = false, host = false;
	int ret, i, tk, tv;

	for (int t = 0; t < p->nt; t++)
		if (p->t[t].role == APE__ROLE_INNER_IN && s->at[t] == APE__AT_CHUNK) {
			any = true;
			host |= p->t[t].host != NULL;
		}
	j->is = -1;
	if (!any) /* every inner input in place */
		return 0;
	for (i = 0; i < s->nis; i++)
		if (s->is[i].chunk == ic) {
			j->is = i;
			return 0;
		}
	if ((ret = pick_victim(s, &i)))
		return ret;
	is = &s->is[i];
	j->is = i;
	lane = &s->ring[s->nload++ % (unsigned)s->depth];
	if ((ret = ape__stream_queue(s, &lane->up)))
		return ret;
	st = &s->inner_stage[lane - s->ring];
	if (host) {
		uint64_t need = 0;

		for (int t = 0; t < p->nt; t++)
			if (p->t[t].role == APE__ROLE_INNER_IN && packed(s, t))
				need += ape__stream_rows_bytes(s, t, s->g.plan.ci);
		if (st->pending) {
			if ((ret = ops->synchronize(lane->up)))
				return ret;
			st->pending = false;
		}
		if ((ret = ape__stream_ensure_host(s, &st->mem, need)))
			return ret;
		for (int t = 0; t < p->nt; t++)
			if (p->t[t].role == APE__ROLE_INNER_IN && packed(s, t)) {
				ape__pack_rows((char *)st->mem.ptr + off, p->t[t].host, p->t[t].s, r0,
					       n);
				off += ape__stream_rows_bytes(s, t, n);
			}
	}
	j->host_t[0] = ape__now_ms();
	j->lane = (int)(lane - s->ring);
	is->chunk = -1; /* until the copy is enqueued, it holds nothing usable */
	if ((ret = ape__stream_wait_on(s, lane->up, is->used)) ||
	    (ret = ops->event_record(lane->up, &j->load_e0)))
		return ret;
	loader_tensors(p, &tk, &tv);
	if (tk >= 0 && s->at[tk] == APE__AT_CHUNK) {
		uint64_t before = s->st->h2d;

		ret = c->loader->load(c->loader->arg, lane->up, j->lane, r0, n, is->buf[tk],
				      is->buf[tv], &s->st->h2d, &s->st->d2h, &s->st->d2d);
		bytes += s->st->h2d - before;
	}
	off = 0;
	for (int t = 0; t < p->nt && !ret; t++)
		if (p->t[t].role == APE__ROLE_INNER_IN && packed(s, t)) {
			const size_t len = (size_t)ape__stream_rows_bytes(s, t, n);

			ret = ops->copy_h2d(lane->up, is->buf[t], 0, (char *)st->mem.ptr + off, len);
			off += len;
			bytes += len;
			s->st->h2d += len;
		}
	st->pending |= off > 0;
	if (ret || (ret = ops->event_record(lane->up, &j->load_e1)))
		return ret;
	is->chunk = ic;
	is->ready = j->load_e1;
	j->loaded = true;
	j->load_bytes = bytes;
	return 0;
}
