/* SPDX-License-Identifier: MIT */
/*
 * Copies into the device session: a query chunk's rows (packed into pinned staging, with their
 * norms for the skip bound), and key/value chunks, either packed from host tensors or filled
 * by the call's loader (the KV cache's gathers), into a slot chosen so that chunks the next
 * query chunks need stay resident.
 */
#include "exec/stream_impl.h"

#include <stdlib.h>

#include "core/clock.h"
#include "exec/pack.h"

int ape__stream_load_query(struct ape__stream *s, struct qrec *r)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__backend_ops *ops = s->ops;
	const int slot = s->qnext;
	const size_t esz = ape_dtype_size(s->g.in_dtype);
	const uint64_t bytes = ape__stream_row_bytes(s, s->g.H, r->n, esz);
	struct qslot *qs = &s->qs[slot];
	struct stage *st = &s->qst[slot];
	int ret;

	s->qnext = (s->qnext + 1) % s->g.plan.q_slots;
	if ((ret = ape__stream_ensure_qslot(s, slot)))
		return ret;
	if (st->pending) { /* the previous copy from this staging buffer */
		if ((ret = ops->synchronize(s->qup[slot])))
			return ret;
		st->pending = false;
	}
	ape__pack_rows(st->mem.ptr, c->q, c->p->qs, r->i0, r->n);
	if (c->kmax) {
		float row[256];

		for (int64_t i = 0; i < s->g.B * s->g.H * r->n; i++) {
			ape_convert(row, APE_F32, (char *)st->mem.ptr + (size_t)(i * s->g.D) * esz,
				    s->g.in_dtype, (size_t)s->g.D);
			r->qnorm[i] = ape__norm(row, s->g.D);
		}
	}
	r->host_t = ape__now_ms();
	if ((ret = ape__stream_wait_on(s, s->qup[slot], qs->used)) ||
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
		ret = ape__stream_grow_kv(s);
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

int ape__stream_load_keys(struct ape__stream *s, struct job *j)
{
	const struct ape__stream_call *c = s->c;
	const struct ape__backend_ops *ops = s->ops;
	const size_t esz = ape_dtype_size(s->g.in_dtype);
	const uint64_t half = ape__stream_row_bytes(s, s->g.Hkv, j->n, esz);
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

		if ((ret = ape__stream_ensure_host(s, &st->mem, 2 * s->g.plan.kv_bytes)))
			return ret;
		if (st->pending) {
			if ((ret = ops->synchronize(q)))
				return ret;
			st->pending = false;
		}
		ape__pack_rows(st->mem.ptr, c->k, c->p->ks, j->j0, j->n);
		ape__pack_rows((char *)st->mem.ptr + half, c->v, c->p->vs, j->j0, j->n);
	}
	j->host_t[0] = ape__now_ms();
	kv->chunk = -1; /* until the copy is enqueued, it holds nothing usable */
	if ((ret = ape__stream_wait_on(s, q, kv->used)) || (ret = ops->event_record(q, &j->up0)))
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
