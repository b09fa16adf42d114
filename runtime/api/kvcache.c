/* SPDX-License-Identifier: MIT */
/*
 * The KV cache: keys and values of one sequence on a device, in fixed-size blocks used as a
 * ring (logical block lb lives in physical block lb mod capacity), so that releasing the oldest
 * blocks makes room for new tokens without moving anything.
 *
 * Appends pack the new tokens into pinned staging (two buffers, two queues: one packs while
 * the other copies) and copy them into their blocks. Attends run the streaming executor on a
 * session made at creation: query rows come from the host, key chunks are gathered from the
 * blocks on the device (copy_d2d, or through host staging when the backend lacks it), partial
 * results are merged by LSE. Everything is allocated by ape_kv_cache_create().
 *
 * Release: with delta > 0 in every head, a key at distance n + dn from a query weighs at most
 * exp(-delta dn + ...) of one at distance n. The proof below bounds the weight of the whole
 * released prefix against one kept key (the newest key at or before the earliest future query)
 * for every future query position at once; see release_proved().
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "core/ape_math.h"
#include "core/alloc.h"
#include "core/context.h"
#include "exec/devmem.h"
#include "core/error.h"
#include "topo/hostmem.h"
#include "exec/lse_merge.h"
#include "exec/pack.h"
#include "api/validate.h"
#include "exec/skip.h"
#include "exec/stream.h"

#define DEPTH 2 /* gathers in flight during an attend */

struct ape_kv_cache {
	struct ape_device *dev;
	const struct ape__backend_ops *ops;
	ape_kv_cache_options o; /* defaults resolved */
	int64_t bt, nblocks; /* tokens per block, physical blocks */
	size_t esz;
	uint64_t blk_bytes; /* one block of K (or V): [B, Hkv, bt, D] */
	struct ape__devmem mem; /* the blocks */
	struct ape__buf **bk, **bv;
	float *bnorm; /* [nblocks][B*Hkv]: largest key norm in each block */

	int64_t t_end; /* tokens appended */
	int64_t lb_first; /* oldest live logical block */

	/* appends */
	struct ape__queue *aq[2];
	struct ape__hostmem astage[2];
	bool apending[2];
	struct ape__event *alast[2]; /* the last copy of each append queue */
	int anext;
	float *rownorm; /* B*Hkv*append_chunk key norms of one piece */

	/* attends */
	struct ape__stream *s;
	struct ape__stream_geom geom;
	struct ape__workq *wq;
	struct ape__kmax km; /* sized for the whole capacity */
	struct ape__hostmem bounce[DEPTH]; /* gathers without copy_d2d */
	struct ape__kv_loader loader;

	/* what the last release proof assumed; future attends must keep it true */
	bool released;
	int64_t q_floor;
	float *rel_delta, *rel_lambda; /* per head */
	double rel_scale, rel_tol;
	float *rel_kmax; /* [B*Hkv]: largest key norm of everything released */
};

void ape_kv_cache_options_init(ape_kv_cache_options *opts)
{
	if (!opts)
		return;
	memset(opts, 0, sizeof(*opts));
	opts->struct_size = sizeof(*opts);
	opts->block_tokens = 256;
	opts->max_queries = 16;
	opts->append_chunk = 1024;
	opts->attend_chunk = APE__CHUNK_DEFAULT;
}

/* ------------------------------------------------------------------ positions and blocks */

static int64_t live_tokens(const struct ape_kv_cache *c)
{
	return c->t_end - c->lb_first * c->bt;
}

static int64_t first_live_position(const struct ape_kv_cache *c)
{
	return c->o.k_start + c->lb_first * c->bt;
}

static int64_t next_position(const struct ape_kv_cache *c)
{
	return c->o.k_start + c->t_end;
}

static int64_t phys(const struct ape_kv_cache *c, int64_t lb)
{
	return lb % c->nblocks;
}

/* Byte offset of row r of (batch, kv head) bg inside a block. */
static size_t blk_off(const struct ape_kv_cache *c, int64_t bg, int64_t r)
{
	return (size_t)((bg * c->bt + r) * c->o.D) * c->esz;
}

/* ------------------------------------------------------------------ creation */

static int check_options(const char *fn, const ape_kv_cache_options *o)
{
	if (!o)
		return ape__error(APE_EINVAL, "%s: opts = NULL", fn);
	if (o->struct_size != sizeof(*o))
		return ape__error(APE_EINVAL,
				  "%s: opts->struct_size = %zu: expected %zu (initialise with "
				  "ape_kv_cache_options_init())",
				  fn, o->struct_size, sizeof(*o));
	if (o->B < 1 || o->Hkv < 1)
		return ape__error(APE_EINVAL, "%s: opts->%s = %" PRId64 ": must be >= 1", fn,
				  o->B < 1 ? "B" : "Hkv", o->B < 1 ? o->B : o->Hkv);
	if (o->H < 0 || (o->H && o->H % o->Hkv))
		return ape__error(APE_EINVAL,
				  "%s: opts->H = %" PRId64 ": must be a multiple of Hkv = %" PRId64
				  " (0: Hkv)",
				  fn, o->H, o->Hkv);
	if (o->D < 2 || o->D > 256 || o->D % 2)
		return ape__error(APE_EINVAL, "%s: opts->D = %" PRId64 ": must be even and in 2..256",
				  fn, o->D);
	if (!ape_dtype_size(o->dtype))
		return ape__error(APE_EINVAL, "%s: opts->dtype = %d: not a libape storage type", fn,
				  (int)o->dtype);
	if (o->capacity_tokens < 1 || o->capacity_tokens > ((int64_t)1 << 40))
		return ape__error(APE_EINVAL,
				  "%s: opts->capacity_tokens = %" PRId64 ": must be in 1..2^40", fn,
				  o->capacity_tokens);
	if (o->block_tokens < 0 || o->max_queries < 0 || o->append_chunk < 0 ||
	    o->attend_chunk < 0) {
		const char *n = o->block_tokens < 0  ? "block_tokens"
				: o->max_queries < 0 ? "max_queries"
				: o->append_chunk < 0 ? "append_chunk"
						      : "attend_chunk";

		return ape__error(APE_EINVAL, "%s: opts->%s: must be >= 0 (0: the default)", fn, n);
	}
	if (o->allow_release && (!isfinite(o->max_query_norm) || !(o->max_query_norm > 0)))
		return ape__error(APE_EINVAL,
				  "%s: opts->max_query_norm = %g: allow_release needs a finite bound "
				  "> 0 on the norm of every future query",
				  fn, o->max_query_norm);
	if (o->k_start > INT64_MAX - ((int64_t)1 << 62))
		return ape__error(APE_EOVERFLOW, "%s: opts->k_start = %" PRId64 ": too large", fn,
				  o->k_start);
	return 0;
}

static void resolve(ape_kv_cache_options *o)
{
	if (!o->H)
		o->H = o->Hkv;
	if (!o->block_tokens)
		o->block_tokens = 256;
	if (!o->max_queries)
		o->max_queries = 16;
	if (!o->append_chunk)
		o->append_chunk = 1024;
	if (!o->attend_chunk)
		o->attend_chunk = APE__CHUNK_DEFAULT;
}

static int cache_load(void *arg, struct ape__queue *q, int lane, int64_t j0, int64_t n,
		      struct ape__buf *dk, struct ape__buf *dv, uint64_t *h2d, uint64_t *d2h,
		      uint64_t *d2d);

static uint64_t cache_scratch(void *arg, int64_t lq, int64_t lk)
{
	const struct ape_kv_cache *c = arg;
	struct ape__launch l;

	memset(&l, 0, sizeof(l));
	l.B = c->o.B;
	l.H = c->o.H;
	l.Hkv = c->o.Hkv;
	l.D = c->o.D;
	l.Lq = lq;
	l.Lk = lk;
	l.in_dtype = c->o.dtype;
	l.out_dtype = APE_F32;
	l.decay_nonneg = true;
	l.skip_tol = 1; /* the largest scratch: with skip tables */
	return ape__scratch_of(c->dev, &l);
}

/* The attend session, planned within what the blocks leave of the budget. */
static int make_session(struct ape_kv_cache *c, const char *fn)
{
	const struct ape__backend_ops *ops = c->ops;
	struct ape__plan_req r = {
		.B = c->o.B, .H = c->o.H, .Hkv = c->o.Hkv, .D = c->o.D,
		.Lq = c->o.max_queries, .Lk = c->nblocks * c->bt,
		.esz = c->esz, .out_esz = 4, .dtype_name = ape_dtype_name(c->o.dtype),
		.pairs = true, .force_merge = true,
		.max_cq = c->o.max_queries, .max_ck = c->o.attend_chunk, .depth = DEPTH,
		.budget = UINT64_MAX, .max_kv_slots = DEPTH,
		.max_buffer = ops->max_alloc ? ops->max_alloc(c->dev) : UINT64_MAX,
		.scratch = cache_scratch, .scratch_arg = c,
	};
	int ret;

	if (c->o.max_device_bytes) {
		if (c->mem.cur >= c->o.max_device_bytes)
			return ape__error(APE_ENOMEM,
					  "%s: opts->max_device_bytes = %" PRIu64 ": the blocks alone "
					  "need %" PRIu64 " bytes",
					  fn, c->o.max_device_bytes, c->mem.cur);
		r.budget = c->o.max_device_bytes - c->mem.cur;
	}
	if ((ret = ape__plan_make(&r, fn, &c->geom.plan)))
		return ret;
	c->geom.B = c->o.B;
	c->geom.H = c->o.H;
	c->geom.Hkv = c->o.Hkv;
	c->geom.D = c->o.D;
	c->geom.in_dtype = c->o.dtype;
	c->geom.host_kv = false;
	c->geom.no_overlap = true;
	c->geom.budget = r.budget;
	if ((ret = ape__stream_create(c->dev, &c->geom, &c->s)) ||
	    (ret = ape__stream_reserve(c->s)))
		return ret;
	for (int i = 0; !ops->copy_d2d && i < DEPTH; i++)
		if ((ret = ape__host_alloc(c->dev, (size_t)(2 * c->geom.plan.kv_bytes),
					   &c->bounce[i])))
			return ret;
	c->loader = (struct ape__kv_loader){ cache_load, c };
	return ape__kmax_alloc(&c->km, c->o.B * c->o.Hkv, c->geom.plan.nk);
}

static int make_blocks(struct ape_kv_cache *c, const char *fn)
{
	int ret = 0;

	c->bk = ape__calloc((size_t)c->nblocks, sizeof(*c->bk));
	c->bv = ape__calloc((size_t)c->nblocks, sizeof(*c->bv));
	c->bnorm = ape__calloc((size_t)(c->nblocks * c->o.B * c->o.Hkv), sizeof(float));
	if (!c->bk || !c->bv || !c->bnorm)
		return ape__error(APE_ENOMEM, "%s: out of memory for %" PRId64 " blocks", fn,
				  c->nblocks);
	for (int64_t i = 0; !ret && i < c->nblocks; i++) {
		if (c->o.max_device_bytes && 2 * c->blk_bytes * (uint64_t)(i + 1) >
						     c->o.max_device_bytes)
			return ape__error(APE_ENOMEM,
					  "%s: opts->max_device_bytes = %" PRIu64 " cannot hold %" PRId64
					  " blocks of %" PRIu64 " bytes (keys and values)",
					  fn, c->o.max_device_bytes, c->nblocks, 2 * c->blk_bytes);
		ret = ape__devmem_alloc(&c->mem, c->blk_bytes, &c->bk[i], "allocating a key block");
		if (!ret)
			ret = ape__devmem_alloc(&c->mem, c->blk_bytes, &c->bv[i],
						"allocating a value block");
	}
	if (ret)
		return ape__error_prefix(ret, fn);
	return 0;
}

static int make_appends(struct ape_kv_cache *c, const char *fn)
{
	const uint64_t bytes = 2 * (uint64_t)(c->o.B * c->o.Hkv * c->o.append_chunk * c->o.D) *
			       c->esz;
	int ret = 0;

	for (int i = 0; !ret && i < 2; i++)
		if (!(ret = c->ops->queue_create(c->dev, &c->aq[i])))
			ret = ape__host_alloc(c->dev, (size_t)bytes, &c->astage[i]);
	if (ret)
		return ape__error_prefix(ret, fn);
	c->rownorm = ape__malloc((size_t)(c->o.B * c->o.Hkv * c->o.append_chunk) * sizeof(float));
	c->rel_delta = ape__calloc((size_t)c->o.H, sizeof(float));
	c->rel_lambda = ape__calloc((size_t)c->o.H, sizeof(float));
	c->rel_kmax = ape__calloc((size_t)(c->o.B * c->o.Hkv), sizeof(float));
	if (!c->rownorm || !c->rel_delta || !c->rel_lambda || !c->rel_kmax)
		return ape__error(APE_ENOMEM, "%s: out of memory", fn);
	return ape__workq_create(&c->wq);
}

int ape_kv_cache_create(ape_device *dev, const ape_kv_cache_options *opts, ape_kv_cache **out)
{
	static const char fn[] = "ape_kv_cache_create";
	struct ape_kv_cache *c;
	int ret;

	if (!out)
		return ape__error(APE_EINVAL, "%s: out = NULL", fn);
	*out = NULL;
	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if ((ret = check_options(fn, opts)))
		return ret;
	c = ape__calloc(1, sizeof(*c));
	if (!c)
		return ape__error(APE_ENOMEM, "%s: out of memory", fn);
	c->dev = dev;
	c->ops = dev->be->ops;
	c->o = *opts;
	resolve(&c->o);
	c->bt = c->o.block_tokens;
	c->nblocks = (c->o.capacity_tokens + c->bt - 1) / c->bt;
	c->esz = ape_dtype_size(c->o.dtype);
	c->blk_bytes = (uint64_t)(c->o.B * c->o.Hkv * c->bt * c->o.D) * c->esz;
	ape__devmem_init(&c->mem, dev, UINT64_MAX);
	if ((ret = make_blocks(c, fn)) || (ret = make_appends(c, fn)) ||
	    (ret = make_session(c, fn))) {
		ape__error_on(ret, dev);
		ape_kv_cache_destroy(c);
		return ret;
	}
	*out = c;
	return 0;
}

void ape_kv_cache_destroy(ape_kv_cache *c)
{
	if (!c)
		return;
	ape__stream_destroy(c->s);
	for (int i = 0; i < 2; i++) {
		c->ops->queue_destroy(c->aq[i]); /* waits for the copies */
		c->ops->event_destroy(c->alast[i]);
		ape__host_free(c->dev, &c->astage[i]);
	}
	for (int i = 0; i < DEPTH; i++)
		ape__host_free(c->dev, &c->bounce[i]);
	/* each table separately: a failed create may have one without the other */
	for (int64_t i = 0; c->bk && i < c->nblocks; i++)
		ape__devmem_free(&c->mem, &c->bk[i], c->blk_bytes);
	for (int64_t i = 0; c->bv && i < c->nblocks; i++)
		ape__devmem_free(&c->mem, &c->bv[i], c->blk_bytes);
	ape__kmax_free(&c->km);
	ape__workq_destroy(c->wq);
	free(c->bk);
	free(c->bv);
	free(c->bnorm);
	free(c->rownorm);
	free(c->rel_delta);
	free(c->rel_lambda);
	free(c->rel_kmax);
	free(c);
}

/* ------------------------------------------------------------------ appends */

/* Copies tokens [t0, t0 + n) from packed staging (K then V, [B, Hkv, n, D] each) into their
 * blocks, one copy per (batch, kv head) and block segment. */
static int copy_piece(struct ape_kv_cache *c, struct ape__queue *q, const char *src, int64_t t0,
		      int64_t n)
{
	const int64_t nbg = c->o.B * c->o.Hkv, D = c->o.D;
	const size_t half = (size_t)(nbg * n * D) * c->esz;
	int ret = 0;

	for (int64_t bg = 0; bg < nbg && !ret; bg++)
		for (int64_t t = t0; t < t0 + n && !ret;) {
			const int64_t lb = t / c->bt, r = t % c->bt;
			const int64_t seg = c->bt - r < t0 + n - t ? c->bt - r : t0 + n - t;
			const size_t so = (size_t)((bg * n + (t - t0)) * D) * c->esz;
			const size_t bytes = (size_t)(seg * D) * c->esz;

			ret = c->ops->copy_h2d(q, c->bk[phys(c, lb)], blk_off(c, bg, r), src + so,
					       bytes);
			if (!ret)
				ret = c->ops->copy_h2d(q, c->bv[phys(c, lb)], blk_off(c, bg, r),
						       src + half + so, bytes);
			t += seg;
		}
	return ret;
}

/* Largest key norm of each block, kept on the host for skipping and release. */
static void note_norms(struct ape_kv_cache *c, const char *packed, int64_t t0, int64_t n)
{
	const int64_t nbg = c->o.B * c->o.Hkv, D = c->o.D;
	float row[256];

	for (int64_t bg = 0; bg < nbg; bg++)
		for (int64_t i = 0; i < n; i++) {
			const int64_t t = t0 + i;
			float *bn = c->bnorm + phys(c, t / c->bt) * nbg + bg;

			ape_convert(row, APE_F32, packed + (size_t)((bg * n + i) * D) * c->esz,
				    c->o.dtype, (size_t)D);
			if (t % c->bt == 0) /* a block's first token: it may be a reused one */
				*bn = 0;
			*bn = fmaxf(*bn, ape__norm(row, D));
		}
}

int ape_kv_cache_append(ape_kv_cache *c, const ape_tensor *k, const ape_tensor *v)
{
	static const char fn[] = "ape_kv_cache_append";
	static const char *const dims[4] = { "B", "Hkv", "n", "D" };
	int64_t ks[4], vs[4], want[4], n, room;
	int ret;

	if (!c)
		return ape__error(APE_EINVAL, "%s: cache = NULL", fn);
	want[0] = c->o.B;
	want[1] = c->o.Hkv;
	want[2] = -1;
	want[3] = c->o.D;
	if ((ret = ape__check_tensor(fn, "k", k, c->o.dtype, want, dims, ks)))
		return ret;
	want[2] = k->shape[2];
	if ((ret = ape__check_tensor(fn, "v", v, c->o.dtype, want, dims, vs)))
		return ret;
	n = k->shape[2];
	room = (c->lb_first + c->nblocks) * c->bt - c->t_end;
	if (n > room)
		return ape__error(APE_ENOMEM,
				  "%s: %" PRId64 " tokens do not fit: the cache holds %" PRId64
				  " of %" PRId64 " (room for %" PRId64 "); release blocks or make a "
				  "larger cache",
				  fn, n, live_tokens(c), c->nblocks * c->bt, room);
	for (int64_t done = 0; done < n;) {
		const int64_t m = n - done < c->o.append_chunk ? n - done : c->o.append_chunk;
		const int i = c->anext;
		const size_t half = (size_t)(c->o.B * c->o.Hkv * m * c->o.D) * c->esz;
		char *st = c->astage[i].ptr;

		c->anext ^= 1;
		if (c->apending[i]) { /* the last copy out of this staging buffer */
			if ((ret = c->ops->synchronize(c->aq[i])))
				return ape__error_prefix(ape__error_on(ret, c->dev), fn);
			c->apending[i] = false;
		}
		ape__pack_rows(st, k, ks, done, m);
		ape__pack_rows(st + half, v, vs, done, m);
		note_norms(c, st, c->t_end, m);
		c->ops->event_destroy(c->alast[i]);
		c->alast[i] = NULL;
		if ((ret = copy_piece(c, c->aq[i], st, c->t_end, m)) ||
		    (ret = c->ops->event_record(c->aq[i], &c->alast[i])))
			return ape__error_prefix(ape__error_on(ret, c->dev), fn);
		c->apending[i] = true;
		c->t_end += m;
		done += m;
	}
	return 0;
}

/* ------------------------------------------------------------------ attends */

/* Gathers live tokens [j0, j0 + n) (counted from the oldest live one) into dk, dv. */
static int cache_load(void *arg, struct ape__queue *q, int lane, int64_t j0, int64_t n,
		      struct ape__buf *dk, struct ape__buf *dv, uint64_t *h2d, uint64_t *d2h,
		      uint64_t *d2d)
{
	struct ape_kv_cache *c = arg;
	const struct ape__backend_ops *ops = c->ops;
	const int64_t nbg = c->o.B * c->o.Hkv, D = c->o.D, t0 = c->lb_first * c->bt + j0;
	const size_t half = (size_t)(nbg * n * D) * c->esz;
	char *bounce = c->bounce[lane].ptr;
	int ret = 0;

	/* appends still copying on their own queues */
	for (int i = 0; i < 2 && !ret; i++)
		if (c->alast[i])
			ret = ops->event_wait(q, c->alast[i]);
	for (int64_t bg = 0; bg < nbg && !ret; bg++)
		for (int64_t t = t0; t < t0 + n && !ret;) {
			const int64_t lb = t / c->bt, r = t % c->bt;
			const int64_t seg = c->bt - r < t0 + n - t ? c->bt - r : t0 + n - t;
			const size_t dst = (size_t)((bg * n + (t - t0)) * D) * c->esz;
			const size_t bytes = (size_t)(seg * D) * c->esz;
			struct ape__buf *sk = c->bk[phys(c, lb)], *sv = c->bv[phys(c, lb)];

			if (ops->copy_d2d) {
				ret = ops->copy_d2d(q, dk, dst, sk, blk_off(c, bg, r), bytes);
				if (!ret)
					ret = ops->copy_d2d(q, dv, dst, sv, blk_off(c, bg, r), bytes);
				*d2d += 2 * bytes;
			} else { /* through host staging; the queue keeps it in order */
				ret = ops->copy_d2h(q, bounce + dst, sk, blk_off(c, bg, r), bytes);
				if (!ret)
					ret = ops->copy_d2h(q, bounce + half + dst, sv,
							    blk_off(c, bg, r), bytes);
				*d2h += 2 * bytes;
			}
			t += seg;
		}
	if (!ret && !ops->copy_d2d) {
		ret = ops->copy_h2d(q, dk, 0, bounce, half);
		if (!ret)
			ret = ops->copy_h2d(q, dv, 0, bounce + half, half);
		*h2d += 2 * half;
	}
	return ret;
}

/* Largest key norm per (batch, kv head) and key chunk of an attend, from the block maxima
 * (a chunk's blocks may hold a few keys outside it: still a bound). */
static void chunk_norms(struct ape_kv_cache *c, int64_t ck, int64_t nk)
{
	const int64_t nbg = c->o.B * c->o.Hkv, t0 = c->lb_first * c->bt;

	c->km.nk = nk;
	for (int64_t bg = 0; bg < nbg; bg++)
		for (int64_t ch = 0; ch < nk; ch++) {
			const int64_t a = t0 + ch * ck, e = a + ck < c->t_end ? a + ck : c->t_end;
			float m = 0;

			for (int64_t lb = a / c->bt; lb <= (e - 1) / c->bt; lb++)
				m = fmaxf(m, c->bnorm[phys(c, lb) * nbg + bg]);
			c->km.pre[bg * nk + ch] = m;
		}
	ape__kmax_scan(&c->km);
}

/* After a release, an attend may not do what the proof excluded. */
static int check_release_terms(const struct ape_kv_cache *c, const char *fn,
			       const struct ape__problem *p, const ape_tensor *q,
			       const int64_t qs[4])
{
	float row[256];

	if (!c->released)
		return 0;
	if (p->q_start < c->q_floor)
		return ape__error(APE_EINVAL,
				  "%s: q_start = %" PRId64 ": blocks were released for queries at "
				  "positions >= %" PRId64,
				  fn, p->q_start, c->q_floor);
	if (!(p->skip_tol >= c->rel_tol) || fabs(p->scale) > c->rel_scale)
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = %g: blocks were released assuming %s %g", fn,
				  !(p->skip_tol >= c->rel_tol) ? "skip_tol" : "scale",
				  !(p->skip_tol >= c->rel_tol) ? p->skip_tol : p->scale,
				  !(p->skip_tol >= c->rel_tol) ? "skip_tol >=" : "|scale| <=",
				  !(p->skip_tol >= c->rel_tol) ? c->rel_tol : c->rel_scale);
	for (int64_t h = 0; h < p->H; h++) {
		const float *prm = p->head_params + 4 * h;

		if (prm[0] < c->rel_delta[h] || prm[1] < 0 || prm[2] < 0 ||
		    prm[3] < c->rel_lambda[h])
			return ape__error(APE_EINVAL,
					  "%s: head %" PRId64 ": delta %g, beta %g, gamma %g, lambda %g: "
					  "blocks were released assuming delta >= %g, beta, gamma >= 0, "
					  "lambda >= %g",
					  fn, h, (double)prm[0], (double)prm[1], (double)prm[2],
					  (double)prm[3], (double)c->rel_delta[h],
					  (double)c->rel_lambda[h]);
	}
	for (int64_t b = 0; b < p->B; b++)
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = 0; i < p->Lq; i++) {
				float nq;

				ape__load_row_f32(q, qs, b, h, i, row);
				nq = ape__norm(row, p->D);
				if (!(nq <= c->o.max_query_norm))
					return ape__error(APE_EINVAL,
							  "%s: q row (b %" PRId64 ", h %" PRId64
							  ", %" PRId64 ") has norm %g, above "
							  "max_query_norm = %g that released blocks "
							  "rely on",
							  fn, b, h, i, (double)nq, c->o.max_query_norm);
			}
	return 0;
}

/* The problem of an attend: the desc checked as a forward call over zero keys, then the
 * cache's keys put in. */
static int attend_problem(struct ape_kv_cache *c, const char *fn, const ape_attn_desc *desc,
			  const ape_tensor *q, const ape_tensor *o, const float *lse,
			  struct ape__problem *p)
{
	static const char *const dims[4] = { "B", "H", "Lq", "D" };
	const int64_t want[4] = { c->o.B, c->o.H, -1, c->o.D };
	ape_tensor none;
	ape_attn_desc d;
	int64_t s[4];
	int ret;

	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	if ((ret = ape__check_tensor(fn, "q", q, c->o.dtype, want, dims, s)))
		return ret;
	if (q->shape[2] > c->o.max_queries)
		return ape__error(APE_EINVAL,
				  "%s: q->shape[2] = %" PRId64 ": more than max_queries = %" PRId64,
				  fn, q->shape[2], c->o.max_queries);
	d = *desc;
	if (d.struct_size == sizeof(d)) {
		d.k_start = first_live_position(c);
		if (!d.q_start_set)
			d.q_start = next_position(c) - q->shape[2];
		d.q_start_set = true;
	}
	ape_tensor_init(&none, NULL, c->o.dtype, c->o.B, c->o.Hkv, 0, c->o.D);
	if ((ret = ape__problem_init(p, fn, &d, q, &none, &none, o, lse)))
		return ret;
	p->Lk = live_tokens(c);
	ret = ape__check_positions(fn, p->q_start, p->Lq, p->k_start, p->Lk);
	if (!ret)
		ret = check_release_terms(c, fn, p, q, p->qs);
	if (ret)
		ape__problem_fini(p);
	return ret;
}

static int try_release(struct ape_kv_cache *c, const struct ape__problem *p, int64_t *released);

int ape_kv_cache_attend(ape_kv_cache *c, const ape_attn_desc *desc, const ape_tensor *q,
			ape_tensor *o, float *lse, ape_stats *stats)
{
	static const char fn[] = "ape_kv_cache_attend";
	struct ape__stream_stats ss;
	struct ape__stream_call call;
	struct ape__problem p;
	atomic_bool abort_flag;
	uint64_t per_head = 0;
	ape_stats st;
	double base;
	int ret;

	if (!c)
		return ape__error(APE_EINVAL, "%s: cache = NULL", fn);
	if (stats && stats->struct_size != sizeof(*stats) &&
	    stats->struct_size != APE_STATS_V1_SIZE)
		return ape__error(APE_EINVAL, "%s: stats->struct_size = %zu: expected %zu", fn,
				  stats->struct_size, sizeof(*stats));
	if ((ret = attend_problem(c, fn, desc, q, o, lse, &p)))
		return ret;
	memset(&ss, 0, sizeof(ss));
	ape_stats_init(&st);
	ape__head_visible_pairs(&p, &per_head); /* validated: no overflow */
	if (p.Lq == 0) {
		ret = 0;
	} else if (p.Lk == 0) {
		ape__store_empty_rows(o, p.os, lse, p.Lq, 0, p.Lq);
	} else {
		const int64_t ck = c->geom.plan.ck, nk = (p.Lk + ck - 1) / ck;
		const bool skipping = p.decay_nonneg && p.skip_tol > 0 && nk > 1;

		/* half of skip_tol stays for what release may drop */
		base = c->o.allow_release ? p.skip_tol / 2 : p.skip_tol;
		memset(&call, 0, sizeof(call));
		call.p = &p;
		call.q = q;
		call.loader = &c->loader;
		call.o = o;
		call.lse = lse;
		call.cq = c->geom.plan.cq;
		call.ck = ck;
		call.nq = (p.Lq + call.cq - 1) / call.cq;
		call.nk = nk;
		call.merge = true;
		call.tol_kernel = nk > 1 ? base / 2 : base;
		call.tol_chunk = p.causal ? base / 2 : base / 4;
		call.want_pairs = stats != NULL;
		call.poison = c->dev->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS;
		call.wq = c->wq;
		atomic_init(&abort_flag, false);
		call.abort = &abort_flag;
		if (skipping) {
			chunk_norms(c, ck, nk);
			call.kmax = &c->km;
		}
		ape__workq_single(c->wq, call.nq);
		ret = ape__stream_run(c->s, &call, 0, NULL, &ss);
		if (ret) /* a lost device may fail the last step, after the rows were written */
			ape__error_prefix(ape__error_written(ape__error_on(ret, c->dev),
							     ss.qchunks_done, call.nq),
					  fn);
	}
	if (!ret && c->o.allow_release)
		try_release(c, &p, NULL);
	if (!ret && stats) {
		st.pairs_visible = per_head * (uint64_t)(p.B * p.H);
		st.pairs_computed = ss.pairs_computed;
		st.kernel_ms = ss.kernel_ms;
		st.bytes_to_device = ss.h2d;
		st.bytes_from_device = ss.d2h;
		st.bytes_device_to_device = ss.d2d;
		st.chunks = ss.chunks;
		st.chunks_skipped = ss.chunks_skipped;
		st.chunk_q = c->geom.plan.cq;
		st.chunk_k = c->geom.plan.ck;
		st.pipeline_depth = c->geom.plan.depth;
		st.devices = 1;
		st.device_budget = c->o.max_device_bytes ? c->o.max_device_bytes : UINT64_MAX;
		st.peak_device_bytes = c->mem.cur + ss.peak_bytes;
		st.copy_ms = ss.copy_ms;
		snprintf(st.backend, sizeof(st.backend), "%s", c->dev->info.backend);
		snprintf(st.device, sizeof(st.device), "%s", c->dev->info.name);
		st.struct_size = stats->struct_size;
		memcpy(stats, &st, stats->struct_size);
	}
	ape__problem_fini(&p);
	return ret;
}

/* ------------------------------------------------------------------ release */

/*
 * Can every future query (position >= q_floor) give the released prefix, tokens [0, t_rel),
 * at most `tol` of the weight it gives the reference key at token t_ref (>= t_rel)?
 *
 * For such a query at distance n_ref >= n0 = q_floor - pos(t_ref) from the reference, every
 * released key is at distance >= n_ref + dn, dn = t_ref - (t_rel - 1). With delta, beta,
 * gamma >= 0, temp <= temp(n0) and |dot| <= |q||k|:
 *   s_released <= temp(n0) |scale| Q kmax_R + bias(n_ref + dn)
 *   s_ref      >= -temp(n0) |scale| Q |k_ref| + bias(n_ref)
 *   bias(n_ref + dn) - bias(n_ref) <= -delta dn     (beta and gamma only add to the gap)
 * and the released keys sit one per distance, each bound delta below the previous, so the
 * prefix weighs at most min(t_rel, 1 / (1 - exp(-delta))) exp(temp(n0) |scale| Q (kmax_R +
 * |k_ref|) - delta dn) times the reference, for every n_ref >= n0 at once. Only delta > 0 makes
 * that small.
 */
static bool release_proved(const struct ape_kv_cache *c, const struct ape__problem *p,
			   int64_t t_rel, int64_t t_ref, int64_t n0, const float *kmax_r,
			   double tol)
{
	const int64_t nbg = c->o.B * c->o.Hkv, group = c->o.H / c->o.Hkv;
	const double dn = (double)(t_ref - (t_rel - 1));
	const float *kref = c->bnorm + phys(c, t_ref / c->bt) * nbg; /* block max >= |k_ref| */

	for (int64_t b = 0; b < c->o.B; b++)
		for (int64_t h = 0; h < c->o.H; h++) {
			const float *prm = p->head_params + 4 * h;
			const int64_t bg = b * c->o.Hkv + h / group;
			double lhs;

			if (!(prm[0] > 0) || prm[1] < 0 || prm[2] < 0)
				return false;
			/* one released key per distance, each bound delta lower than the last */
			lhs = log(ape_tail_count((double)t_rel, prm[0])) +
			      ape_temp(prm[3], (double)n0) * fabs(p->scale) * c->o.max_query_norm *
				      ((double)kmax_r[bg] + (double)kref[bg]) -
			      (double)prm[0] * dn;
			if (!(lhs <= log(tol)))
				return false;
		}
	return true;
}

static int try_release(struct ape_kv_cache *c, const struct ape__problem *p, int64_t *released)
{
	const int64_t nbg = c->o.B * c->o.Hkv;
	const int64_t q_floor = next_position(c) - c->o.max_queries;
	const int64_t ref = q_floor < next_position(c) - 1 ? q_floor : next_position(c) - 1;
	const int64_t t_ref = ref - c->o.k_start;
	const double tol = p->skip_tol / 2;
	float kmax[256], *kr = nbg <= 256 ? kmax : NULL;
	int64_t freed = 0;

	if (released)
		*released = 0;
	if (!c->o.allow_release || !p->decay_nonneg || !(tol > 0) || t_ref < c->lb_first * c->bt)
		return 0;
	if (!kr && !(kr = ape__malloc((size_t)nbg * sizeof(float))))
		return 0; /* releasing is an optimisation: never fail over it */
	/* whole blocks before the reference key, oldest first; each proof covers the whole
	 * released prefix, so the last one made is the one attends must keep true */
	while ((c->lb_first + 1) * c->bt - 1 < t_ref) {
		const int64_t lb = c->lb_first;

		for (int64_t bg = 0; bg < nbg; bg++)
			kr[bg] = fmaxf(c->rel_kmax[bg], c->bnorm[phys(c, lb) * nbg + bg]);
		if (!release_proved(c, p, (lb + 1) * c->bt, t_ref, q_floor - ref, kr, tol))
			break;
		memcpy(c->rel_kmax, kr, (size_t)nbg * sizeof(float));
		c->lb_first++;
		freed += c->bt;
	}
	if (freed) {
		c->released = true;
		c->q_floor = q_floor > c->q_floor ? q_floor : c->q_floor;
		for (int64_t h = 0; h < p->H; h++) {
			c->rel_delta[h] = p->head_params[4 * h];
			c->rel_lambda[h] = p->head_params[4 * h + 3];
		}
		c->rel_scale = fabs(p->scale);
		c->rel_tol = p->skip_tol;
	}
	if (kr != kmax)
		free(kr);
	if (released)
		*released = freed;
	return 0;
}

int ape_kv_cache_release_unreachable(ape_kv_cache *c, const ape_attn_desc *desc,
				     int64_t *released)
{
	static const char fn[] = "ape_kv_cache_release_unreachable";
	struct ape__problem p;
	ape_tensor qt, ot, none;
	float dummy = 0;
	int ret;

	if (released)
		*released = 0;
	if (!c)
		return ape__error(APE_EINVAL, "%s: cache = NULL", fn);
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	if (!c->o.allow_release)
		return ape__error(APE_EINVAL,
				  "%s: the cache was created without allow_release", fn);
	/* the parameters only: a forward over no query and no key */
	ape_tensor_init(&qt, &dummy, c->o.dtype, c->o.B, c->o.H, 0, c->o.D);
	ape_tensor_init(&ot, &dummy, c->o.dtype, c->o.B, c->o.H, 0, c->o.D);
	ape_tensor_init(&none, NULL, c->o.dtype, c->o.B, c->o.Hkv, 0, c->o.D);
	if ((ret = ape__problem_init(&p, fn, desc, &qt, &none, &none, &ot, NULL)))
		return ret;
	ret = try_release(c, &p, released);
	ape__problem_fini(&p);
	return ret;
}

int ape_kv_cache_get_info(const ape_kv_cache *c, ape_kv_cache_info *info)
{
	if (!c || !info)
		return ape__error(APE_EINVAL, "ape_kv_cache_get_info: %s = NULL",
				  !c ? "cache" : "info");
	memset(info, 0, sizeof(*info));
	info->tokens = c->t_end;
	info->live_tokens = live_tokens(c);
	info->first_live_position = first_live_position(c);
	info->next_position = next_position(c);
	info->capacity_tokens = c->nblocks * c->bt;
	info->block_tokens = c->bt;
	info->blocks_live = (c->t_end + c->bt - 1) / c->bt - c->lb_first;
	info->blocks_released = c->lb_first;
	info->min_query_position = c->released ? c->q_floor : INT64_MIN;
	info->device_bytes = c->mem.cur + ape__stream_device_bytes(c->s);
	return 0;
}
