/* SPDX-License-Identifier: MIT */
/*
 * The session of one device: its queues and every buffer the pipeline uses (query, key/value
 * and result slots on the device, their pinned staging on the host, the merge accumulators),
 * allocated on first use or all at once by ape__stream_reserve(), freed by
 * ape__stream_destroy(). The pipeline itself is in stream_run.c.
 */
#include "exec/stream_impl.h"

#include <stdlib.h>

#include "core/alloc.h"
#include "core/context.h"
#include "core/error.h"

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
	for (int i = 0; i <= APE__MAX_DEPTH; i++)
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

int ape__stream_ensure_host(struct ape__stream *s, struct ape__hostmem *m, uint64_t bytes)
{
	if (m->ptr)
		return 0;
	return ape__host_alloc(s->dev, (size_t)bytes, m);
}

int ape__stream_ensure_out(struct ape__stream *s, int i)
{
	const struct ape__plan *p = &s->g.plan;
	struct outslot *o = &s->out[i];
	int ret = 0;

	if (!o->o)
		ret = ape__devmem_alloc(&s->mem, p->o_bytes, &o->o, "allocating a partial O");
	if (!ret && !o->lse)
		ret = ape__devmem_alloc(&s->mem, p->lse_bytes, &o->lse, "allocating a partial LSE");
	if (!ret && !o->ent && p->diag_bytes)
		ret = ape__devmem_alloc(&s->mem, p->diag_bytes, &o->ent, "allocating entropies");
	if (!ret && !o->md && p->diag_bytes)
		ret = ape__devmem_alloc(&s->mem, p->diag_bytes, &o->md, "allocating distances");
	if (!ret && !o->pairs && p->pairs_bytes)
		ret = ape__devmem_alloc(&s->mem, p->pairs_bytes, &o->pairs,
					"allocating pair counts");
	if (!ret)
		ret = ape__stream_ensure_host(s, &o->host, p->out_bytes);
	return ret;
}

int ape__stream_ensure_qslot(struct ape__stream *s, int i)
{
	int ret = 0;

	if (!s->qs[i].buf)
		ret = ape__devmem_alloc(&s->mem, s->g.plan.q_bytes, &s->qs[i].buf,
					"allocating a query chunk");
	if (!ret && !s->qs[i].prior && s->g.plan.prior_bytes)
		ret = ape__devmem_alloc(&s->mem, s->g.plan.prior_bytes, &s->qs[i].prior,
					"allocating a query chunk's LSE");
	if (!ret)
		ret = ape__stream_ensure_host(s, &s->qst[i].mem, s->g.plan.q_bytes);
	return ret;
}

int ape__stream_grow_kv(struct ape__stream *s)
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

int ape__stream_ensure_qrec(struct ape__stream *s, struct qrec *r, bool merge, bool norms)
{
	const int64_t rows = s->g.B * s->g.H * s->g.plan.cq;

	if (merge && !r->acc.o) {
		int ret = ape__acc_alloc(&r->acc, rows, s->g.D, s->g.plan.diag_bytes > 0);

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

/* Intervals of the overlap figure in the largest run: per query chunk the copy of its rows,
 * per job the copy of its keys, its kernel and the copy back. Capped: beyond it (a cache of a
 * million one-row chunks) the figure costs host memory only when such a run happens. */
static size_t intervals_of(const struct ape__plan *p)
{
	const int64_t cap = 1 << 16;

	if (p->nq > cap || p->nk > cap || p->nq * (1 + 3 * p->nk) > cap)
		return (size_t)cap;
	return (size_t)(p->nq * (1 + 3 * p->nk));
}

int ape__stream_reserve(struct ape__stream *s)
{
	int ret = 0;

	for (int i = 0; !ret && i < s->depth; i++)
		ret = ape__stream_ensure_out(s, i);
	for (int i = 0; !ret && i < s->g.plan.q_slots; i++)
		ret = ape__stream_ensure_qslot(s, i);
	while (!ret && s->nkv < s->max_kv)
		ret = ape__stream_grow_kv(s);
	for (int i = 0; !ret && s->g.host_kv && i < s->depth; i++)
		ret = ape__stream_ensure_host(s, &s->kvst[i].mem, 2 * s->g.plan.kv_bytes);
	for (int i = 0; !ret && i <= s->depth; i++)
		ret = ape__stream_ensure_qrec(s, &s->qr[i], s->g.plan.merge, true);
	if (!ret)
		ape__stream_reserve_intervals(s, intervals_of(&s->g.plan));
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
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		ops->queue_destroy(s->up[i]);
		ops->queue_destroy(s->down[i]);
	}
	for (int i = 0; i < 2; i++) {
		ops->queue_destroy(s->qup[i]);
		ape__devmem_free(&s->mem, &s->qs[i].buf, p->q_bytes);
		ape__devmem_free(&s->mem, &s->qs[i].prior, p->prior_bytes);
		ape__host_free(s->dev, &s->qst[i].mem);
	}
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		ape__devmem_free(&s->mem, &s->out[i].o, p->o_bytes);
		ape__devmem_free(&s->mem, &s->out[i].lse, p->lse_bytes);
		ape__devmem_free(&s->mem, &s->out[i].pairs, p->pairs_bytes);
		ape__devmem_free(&s->mem, &s->out[i].ent, p->diag_bytes);
		ape__devmem_free(&s->mem, &s->out[i].md, p->diag_bytes);
		ape__host_free(s->dev, &s->out[i].host);
		ape__host_free(s->dev, &s->kvst[i].mem);
	}
	for (int i = 0; i < s->nkv; i++) {
		ape__devmem_free(&s->mem, &s->kv[i].k, p->kv_bytes);
		ape__devmem_free(&s->mem, &s->kv[i].v, p->kv_bytes);
	}
	for (int i = 0; i <= APE__MAX_DEPTH; i++) {
		ape__acc_free(&s->qr[i].acc);
		free(s->qr[i].qnorm);
	}
	free(s->kv);
	free(s->iv);
	free(s);
}
