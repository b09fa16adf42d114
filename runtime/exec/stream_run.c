/* SPDX-License-Identifier: MIT */
/*
 * The pipeline of one device session: outer chunks taken from the call's work queue, each
 * walking its inner chunks as the pass says, with up to `depth` jobs in flight; the tensors a
 * run wraps where they lie; the run's accumulators; and the run as a whole, with its clean-up
 * after a failure.
 */
#include "exec/stream_impl.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/error.h"
#include "exec/pack.h"

static int begin_outer(struct ape__stream *s, int64_t oc)
{
	const struct ape__pass *p = s->pass;
	struct oslot *o = NULL;
	int ret;

	for (;;) {
		for (int k = 0; k < s->g.plan.o_slots && !o; k++) {
			struct oslot *x = &s->os[(s->onext + k) % s->g.plan.o_slots];

			if (x->oc < 0)
				o = x;
		}
		if (o)
			break;
		if ((ret = ape__stream_retire(s)))
			return ret;
	}
	s->onext = (int)(o - s->os + 1) % s->g.plan.o_slots;
	o->oc = oc;
	o->n = ape__stream_outer_rows(s, oc, &o->o0);
	o->pending = o->issued = 0;
	o->walking = true;
	o->loaded = false;
	if ((ret = p->ops->outer_begin(p->self, (int)(o - s->os), oc, o->o0, o->n)))
		return ret;
	s->cur = o;
	return 0;
}

/* One step of the current outer chunk's walk: a job issued, a wait for one in flight, or the
 * walk finished. */
static int step(struct ape__stream *s)
{
	const struct ape__pass *p = s->pass;
	struct oslot *o = s->cur;
	int64_t ic;
	int dir, ret;

	switch (p->ops->next(p->self, (int)(o - s->os), o->pending, o->issued, &ic, &dir)) {
	case APE__WALK_DONE:
		o->walking = false;
		s->cur = NULL;
		if (!o->pending || !p->early_back)
			return o->pending ? 0 : ape__stream_finish_outer(s, o);
		/* its read-back goes now, after its last kernel: not after the host has seen
		 * every job retire (a round trip saved on a call of one chunk) */
		return ape__stream_issue_back(s, o);
	case APE__WALK_WAIT:
		if (!s->count) /* nothing to wait for: a pass that says so is wrong */
			return ape__error(APE_EBACKEND, "executor: the pass waits with no job in flight");
		return ape__stream_retire(s);
	default:
		if (!dir)
			s->diag = ic;
		if (s->count == s->depth && (ret = ape__stream_retire(s)))
			return ret;
		return ape__stream_issue(s, o, ic);
	}
}

/* Where tensor t lies in this run: wrapped (APE__AT_WRAPPED, in s->wrap[t]), in chunk buffers,
 * or not used. */
static int place_tensor(struct ape__stream *s, int t)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__pass_tensor *x = &s->pass->t[t];
	const bool outer = x->axis == s->pass->outer;
	const int64_t all = (x->axis == APE__AXIS_Q) ? c->Lq : c->Lk;
	const int64_t rows = outer ? c->co : c->ci;
	size_t got, bytes;
	void *ptr;
	int ret;

	s->wrap[t] = NULL;
	if (x->role == APE__ROLE_CALL_ACC || x->role == APE__ROLE_CALL_IN) {
		s->at[t] = x->bytes ? APE__AT_CHUNK : APE__AT_UNUSED;
		return 0;
	}
	if (!x->row_bytes) {
		s->at[t] = APE__AT_UNUSED;
		return 0;
	}
	s->at[t] = APE__AT_CHUNK;
	if (!ape__pass_wraps(s->pass, t, c->in_place, s->dev->caps.max_alloc, rows, all))
		return 0;
	if (x->role == APE__ROLE_OUTER_ACC) {
		ptr = x->dest;
		bytes = (size_t)(x->row_bytes * (uint64_t)all);
	} else {
		ptr = x->host->data;
		bytes = ape__tensor_span_bytes(x->host, x->s);
	}
	ret = s->ops->buf_wrap(s->dev, APE_BE_MEM_HOST, ptr, bytes, &s->wrap[t], &got);
	if (ret)
		return ret;
	s->at[t] = APE__AT_WRAPPED;
	return 0;
}

static void unplace(struct ape__stream *s)
{
	for (int t = 0; t < APE__PASS_MAX_T; t++) {
		s->ops->buf_free(s->dev, s->wrap[t]); /* only the hold: the memory is the caller's */
		s->wrap[t] = NULL;
	}
}

/* The run's accumulators initialised and its inputs copied, before its first job (the
 * staging of the inputs is not reused before the run's last job is done, after the copy). On
 * a device that reads host memory (host_tables) the accumulators read back are their host
 * staging itself, wrapped: the kernels add there, and end_call() has nothing to copy (on a
 * small call, a round trip to the device's threads saved). */
static int start_call(struct ape__stream *s)
{
	const struct ape__pass *p = s->pass;
	uint64_t off = 0, back = 0;
	int ret = ape__stream_ensure_call(s);

	for (int t = 0; t < p->nt && !ret; t++) {
		const struct ape__pass_tensor *x = &p->t[t];
		char *h = (char *)s->call_in.ptr + off;

		if (s->at[t] == APE__AT_UNUSED)
			continue;
		if (x->role == APE__ROLE_CALL_ACC) {
			struct ape_be_buf *acc = s->call_buf[t];
			size_t got;

			if (x->back && s->c->host_tables &&
			    !(ret = s->ops->buf_wrap(s->dev, APE_BE_MEM_HOST,
						     (char *)s->call_back.ptr + back,
						     (size_t)x->bytes, &s->wrap[t], &got))) {
				s->at[t] = APE__AT_WRAPPED;
				acc = s->wrap[t];
			}
			if (!ret && s->at[t] == APE__AT_WRAPPED) {
				/* host memory nothing else touches yet: filled here, one command
				 * fewer on the queue */
				uint32_t *w = (uint32_t *)(void *)((char *)s->call_back.ptr + back);

				for (uint64_t i = 0; i < x->bytes / sizeof(uint32_t); i++)
					w[i] = x->init;
			} else if (!ret) {
				ret = s->ops->fill(s->exec, acc, 0, x->init, (size_t)x->bytes);
			}
			back += x->back ? x->bytes : 0;
		} else if (x->role == APE__ROLE_CALL_IN) {
			size_t got;

			p->ops->call_input(p->self, t, h, (size_t)x->bytes);
			off += x->bytes;
			if (!s->c->host_tables) {
				ret = s->ops->copy_h2d(s->exec, s->call_buf[t], 0, h, (size_t)x->bytes);
				s->st->h2d += x->bytes;
			} else if (!(ret = s->ops->buf_wrap(s->dev, APE_BE_MEM_HOST, h, (size_t)x->bytes,
							    &s->wrap[t], &got))) {
				s->at[t] = APE__AT_WRAPPED; /* read where it lies, for the whole run */
			}
		}
	}
	return ret;
}

/* ... and back after its last. */
static int end_call(struct ape__stream *s)
{
	const struct ape__pass *p = s->pass;
	const void *host[APE__PASS_MAX_T] = { 0 };
	uint64_t off = 0, copied = 0;
	int ret = 0;

	for (int t = 0; t < p->nt && !ret; t++) {
		const struct ape__pass_tensor *x = &p->t[t];

		if (x->role != APE__ROLE_CALL_ACC || !x->back || s->at[t] == APE__AT_UNUSED)
			continue;
		if (s->at[t] != APE__AT_WRAPPED) { /* wrapped: the kernels wrote it there */
			ret = s->ops->copy_d2h(s->exec, (char *)s->call_back.ptr + off,
					       s->call_buf[t], 0, (size_t)x->bytes);
			copied += x->bytes;
		}
		host[t] = (char *)s->call_back.ptr + off;
		off += x->bytes;
	}
	/* (with nothing copied, the queue is idle: every job retired) */
	if (!ret && off)
		ret = s->ops->synchronize(s->exec);
	s->st->d2h += copied;
	if (!ret && p->ops->call_done)
		p->ops->call_done(p->self, host);
	return ret;
}

int ape__stream_run(struct ape__stream *s, const struct ape__stream_call *c, int who,
		    struct ape__trace_dev *trace, struct ape__stream_stats *st)
{
	int ret = 0;

	s->c = c;
	s->pass = c->pass;
	s->st = st;
	s->trace = trace;
	s->head = s->count = 0;
	s->nload = 0;
	s->onext = 0;
	s->cur = NULL;
	s->diag = 0;
	s->niv = 0;
	s->mem.peak = s->mem.cur;
	c->pass->dead_lo = -1;
	c->pass->dead_hi = INT64_MAX;
	for (int i = 0; i < s->nis; i++)
		s->is[i].chunk = -1; /* a new call: nothing resident is valid */
	if (trace)
		trace->device_clock = ape_be_caps_have(&s->dev->caps, APE_BE_CAP_TIMESTAMPS);
	for (int t = 0; t < c->pass->nt && !ret; t++)
		ret = place_tensor(s, t);
	if (!ret)
		ret = start_call(s);

	while (!ret) {
		if (!s->cur) {
			int64_t oc;

			if (atomic_load(c->abort)) {
				ret = 1;
				break;
			}
			oc = ape__workq_next(c->wq, who);
			if (oc < 0)
				break;
			ret = begin_outer(s, oc);
		} else {
			ret = step(s);
		}
	}
	while (!ret && s->count)
		ret = ape__stream_retire(s);
	if (!ret)
		ret = end_call(s);
	if (ret) {
		ape__stream_unwind(s);
	} else {
		for (int i = 0; i < APE__MAX_DEPTH; i++) {
			s->inner_stage[i].pending = false;
			s->os[i].stage_pending = false;
		}
		st->overlap_ms += ape__stream_overlap_ms(s);
	}
	unplace(s);
	st->device_clock = ape_be_caps_have(&s->dev->caps, APE_BE_CAP_TIMESTAMPS);
	if (s->mem.peak > st->peak_bytes)
		st->peak_bytes = s->mem.peak;
	s->c = NULL;
	s->pass = NULL;
	return ret;
}
