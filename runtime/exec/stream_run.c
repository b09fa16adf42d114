/* SPDX-License-Identifier: MIT */
/*
 * The pipeline of one device session: query chunks taken from the call's work queue, each
 * walking its key chunks from the diagonal outward (exec/skip.h), a direction closed as soon as
 * the skip bound proves the rest of it negligible, with up to `depth` jobs in flight; and the
 * run as a whole, with its clean-up after a failure.
 */
#include "exec/stream_impl.h"

#include <math.h>
#include <stdint.h>

#include "exec/launch.h"

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
		if ((ret = ape__stream_retire(s)))
			return ret;
	}
	if ((ret = ape__stream_ensure_qrec(s, r, c->merge, c->kmax != NULL)))
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
		return r->pending ? 0 : ape__stream_finish_query(s, r);
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
			if ((ret = ape__stream_retire(s)))
				return ret;
		}
	}
	if (s->count == s->depth && (ret = ape__stream_retire(s)))
		return ret;
	return ape__stream_issue(s, r, chunk);
}

/* What every launch and every skip test of the call share. */
static void fill_template(struct ape__stream *s)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__problem *p = c->p;
	struct ape__launch *l = &s->tmpl;

	/* with a prior, the launches off the diagonal may leave out all their keys: that test
	 * has its own share of the kernels' (exec/skip_budget.h) */
	ape__launch_init(l, p, c->merge ? APE_F32 : p->out_dtype,
			 ape__skip_launch_tol(&c->tol, c->merge && s->g.plan.prior_bytes));
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
		.tol = c->tol.chunk,
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
		ret = ape__stream_retire(s);
	if (ret) {
		ape__stream_unwind(s);
	} else {
		for (int i = 0; i < s->depth; i++)
			s->kvst[i].pending = false;
		for (int i = 0; i < s->g.plan.q_slots; i++)
			s->qst[i].pending = false;
		st->overlap_ms += ape__stream_overlap_ms(s);
	}
	st->device_clock = s->ops->event_timestamp != NULL;
	if (s->mem.peak > st->peak_bytes)
		st->peak_bytes = s->mem.peak;
	s->c = NULL;
	return ret;
}
