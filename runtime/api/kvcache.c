/* SPDX-License-Identifier: MIT */
/*
 * The KV cache (api/kvcache.h): its options, its creation (blocks, append staging, the attend
 * session, everything a later call needs), appends and the information call. Attends are in
 * kvcache_attend.c, releases in kvcache_release.c.
 *
 * Appends pack the new tokens into pinned staging (two buffers, two queues: one packs while
 * the other copies) and copy them into their blocks, noting each block's largest key norm on
 * the host for the skip bound and the release proof.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/context.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/strace.h"
#include "core/verbose.h"
#include "exec/launch.h"
#include "exec/pack.h"
#include "exec/trace.h"
#include "api/kvcache.h"
#include "api/resident.h"
#include "api/validate.h"

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

/* ------------------------------------------------------------------ creation */

static int check_options(const char *fn, const ape_kv_cache_options *o)
{
	int ret;

	if (!o)
		return ape__error(APE_EINVAL, "%s: opts = NULL", fn);
	if (o->struct_size != sizeof(*o))
		return ape__error(APE_EINVAL,
				  "%s: opts->struct_size = %zu: expected %zu (initialise with "
				  "ape_kv_cache_options_init())",
				  fn, o->struct_size, sizeof(*o));
	if (o->B < 1)
		return ape__error(APE_EINVAL, "%s: opts->B = %" PRId64 ": must be >= 1", fn, o->B);
	if ((ret = ape__kv_check_shape(fn, o->Hkv, o->H, o->D, o->dtype, o->capacity_tokens)))
		return ret;
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
	/* positions (k_start + tokens, minus max_queries for the release's earliest query) keep
	 * 2^62 of headroom both ways (the fuzzer found k_start near INT64_MIN overflowing) */
	if (o->k_start > INT64_MAX - ((int64_t)1 << 62) ||
	    o->k_start < INT64_MIN + ((int64_t)1 << 62))
		return ape__error(APE_EOVERFLOW, "%s: opts->k_start = %" PRId64 ": too %s", fn,
				  o->k_start, o->k_start > 0 ? "large" : "small");
	if (o->block_tokens > ((int64_t)1 << 40))
		return ape__error(APE_EINVAL,
				  "%s: opts->block_tokens = %" PRId64 ": must be in 0..2^40 (0: 256)",
				  fn, o->block_tokens);
	if (o->max_queries > ((int64_t)1 << 40))
		return ape__error(APE_EINVAL,
				  "%s: opts->max_queries = %" PRId64 ": must be in 0..2^40 (0: 16)", fn,
				  o->max_queries);
	/* what ape_kv_cache_create() sizes from them, in bytes at 8 per element: the blocks'
	 * B * Hkv * block_tokens * D and the staging's 2 * B * Hkv * append_chunk * D elements,
	 * and the nblocks * B * Hkv key norms (the fuzzer found B * Hkv * block_tokens * D
	 * overflowing) */
	{
		const int64_t bt = o->block_tokens ? o->block_tokens : 256;
		const int64_t ac = o->append_chunk ? o->append_chunk : 1024;
		int64_t bg, n;

		if (__builtin_mul_overflow(o->B, o->Hkv, &bg) ||
		    __builtin_mul_overflow(bg, bt > ac ? bt : ac, &n) ||
		    __builtin_mul_overflow(n, o->D, &n) || __builtin_mul_overflow(n, (int64_t)16, &n) ||
		    __builtin_mul_overflow(bg, o->capacity_tokens / bt + 1, &n))
			return ape__error(APE_EOVERFLOW,
					  "%s: opts->B = %" PRId64 ", Hkv = %" PRId64
					  ", block_tokens = %" PRId64 ", append_chunk = %" PRId64
					  ", D = %" PRId64 ": the cache's sizes pass 64 bits",
					  fn, o->B, o->Hkv, o->block_tokens, o->append_chunk, o->D);
	}
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

/* The attend session (api/kv_session.h), planned within what the blocks leave of the budget;
 * host staging for gathers where the backend has no device-to-device copy. */
static int make_session(struct ape_kv_cache *c, const char *fn)
{
	const struct ape__problem shape = {
		.B = c->o.B, .H = c->o.H, .Hkv = c->o.Hkv, .D = c->o.D, .Lq = c->o.max_queries,
		.Lk = c->nblocks * c->bt, .in_dtype = c->o.dtype,
	};
	uint64_t budget = UINT64_MAX;
	int ret;

	if (c->o.max_device_bytes) {
		if (c->mem.cur >= c->o.max_device_bytes)
			return ape__error(APE_ENOMEM,
					  "%s: opts->max_device_bytes = %" PRIu64 ": the blocks alone "
					  "need %" PRIu64 " bytes",
					  fn, c->o.max_device_bytes, c->mem.cur);
		budget = c->o.max_device_bytes - c->mem.cur;
	}
	if ((ret = ape__kv_session_make(&c->ks, c->dev, fn, &shape, c->o.attend_chunk, budget)))
		return ret;
	for (int i = 0; !c->ops->copy_d2d && i < APE__KV_DEPTH; i++)
		if ((ret = ape__host_alloc(c->dev,
					   (size_t)(2 * c->ks.geom.shape.t[APE__F_K].row_bytes *
						    (uint64_t)c->ks.geom.plan.ci),
					   &c->bounce[i])))
			return ape__error_prefix(ret, fn);
	c->loader = (struct ape__kv_loader){
		.load = ape__kv_load, .arg = c, .pages = ape_be_kv_pages, .wait = ape__kv_wait,
	};
	return 0;
}

/* Bytes of slab i (the last may hold fewer blocks). */
static uint64_t slab_bytes(const struct ape_kv_cache *c, int64_t i)
{
	const int64_t n = c->nblocks - i * c->per_slab;

	return c->blk_bytes * (uint64_t)(n < c->per_slab ? n : c->per_slab);
}

/* The blocks, in as few slabs as the device's largest buffer allows (max_alloc). */
static int make_blocks(struct ape_kv_cache *c, const char *fn)
{
	const uint64_t most = c->dev->caps.max_alloc;
	int ret = 0;

	c->per_slab = most / c->blk_bytes < (uint64_t)c->nblocks ? (int64_t)(most / c->blk_bytes)
								 : c->nblocks;
	if (c->per_slab < 1)
		c->per_slab = 1;
	c->nslabs = (c->nblocks + c->per_slab - 1) / c->per_slab;
	c->sk = ape__calloc((size_t)c->nslabs, sizeof(*c->sk));
	c->sv = ape__calloc((size_t)c->nslabs, sizeof(*c->sv));
	c->bnorm = ape__calloc((size_t)(c->nblocks * c->o.B * c->o.Hkv), sizeof(float));
	if (!c->sk || !c->sv || !c->bnorm)
		return ape__error(APE_ENOMEM, "%s: out of memory for %" PRId64 " blocks", fn,
				  c->nblocks);
	if (c->o.max_device_bytes && 2 * c->blk_bytes * (uint64_t)c->nblocks > c->o.max_device_bytes)
		return ape__error(APE_ENOMEM,
				  "%s: opts->max_device_bytes = %" PRIu64 " cannot hold %" PRId64
				  " blocks of %" PRIu64 " bytes (keys and values)",
				  fn, c->o.max_device_bytes, c->nblocks, 2 * c->blk_bytes);
	for (int64_t i = 0; !ret && i < c->nslabs; i++) {
		ret = ape__devmem_alloc(&c->mem, slab_bytes(c, i), &c->sk[i],
					"allocating key blocks");
		if (!ret)
			ret = ape__devmem_alloc(&c->mem, slab_bytes(c, i), &c->sv[i],
						"allocating value blocks");
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
	if (!c->rownorm || ape__kv_terms_init(&c->rel, fn, c->o.H, c->o.B * c->o.Hkv))
		return ape__error(APE_ENOMEM, "%s: out of memory", fn);
	return 0;
}

int ape_kv_cache_create(ape_device *dev, const ape_kv_cache_options *opts, ape_kv_cache **out)
{
	APE__API_CALL("ape_kv_cache_create");
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
	ape__kv_session_free(&c->ks);
	for (int i = 0; i < 2; i++) {
		c->ops->queue_destroy(c->aq[i]); /* waits for the copies */
		c->ops->event_destroy(c->alast[i]);
		ape__host_free(c->dev, &c->astage[i]);
	}
	for (int i = 0; i < APE__KV_DEPTH; i++)
		ape__host_free(c->dev, &c->bounce[i]);
	/* each table separately: a failed create may have one without the other */
	for (int64_t i = 0; c->sk && i < c->nslabs; i++)
		ape__devmem_free(&c->mem, &c->sk[i], slab_bytes(c, i));
	for (int64_t i = 0; c->sv && i < c->nslabs; i++)
		ape__devmem_free(&c->mem, &c->sv[i], slab_bytes(c, i));
	free(c->sk);
	free(c->sv);
	free(c->bnorm);
	free(c->rownorm);
	ape__kv_terms_free(&c->rel);
	free(c);
}

/* ------------------------------------------------------------------ appends */

int ape__kv_each_seg(const struct ape_kv_cache *c, int64_t t0, int64_t n,
		     int (*fn)(void *arg, const struct ape__kv_seg *sg), void *arg)
{
	const int64_t nbg = c->o.B * c->o.Hkv, D = c->o.D;
	int ret = 0;

	for (int64_t bg = 0; bg < nbg && !ret; bg++)
		for (int64_t t = t0; t < t0 + n && !ret;) {
			const int64_t lb = t / c->bt, r = t % c->bt;
			const int64_t seg = c->bt - r < t0 + n - t ? c->bt - r : t0 + n - t;
			const struct ape__kv_seg sg = {
				.blk = ape__kv_phys(c, lb),
				.off = (size_t)((bg * n + (t - t0)) * D) * c->esz,
				.blk_off = ape__kv_blk_off(c, bg, r),
				.bytes = (size_t)(seg * D) * c->esz,
			};

			ret = fn(arg, &sg);
			t += seg;
		}
	return ret;
}

/* One append piece: packed staging (K then V, `half` bytes each) copied on queue q. */
struct piece {
	struct ape_kv_cache *c;
	struct ape_be_queue *q;
	const char *src;
	size_t half;
};

static int copy_seg(void *arg, const struct ape__kv_seg *sg)
{
	const struct piece *p = arg;
	struct ape_kv_cache *c = p->c;
	int ret;

	size_t bo;
	struct ape_be_buf *bk = ape__kv_block(c, 0, sg->blk, &bo), *bv = ape__kv_block(c, 1, sg->blk, &bo);

	ret = c->ops->copy_h2d(p->q, bk, bo + sg->blk_off, p->src + sg->off, sg->bytes);
	if (!ret)
		ret = c->ops->copy_h2d(p->q, bv, bo + sg->blk_off, p->src + p->half + sg->off,
				       sg->bytes);
	return ret;
}

/* Copies tokens [t0, t0 + n) from packed staging (K then V, [B, Hkv, n, D] each) into their
 * blocks, one copy per (batch, kv head) and block segment. */
static int copy_piece(struct ape_kv_cache *c, struct ape_be_queue *q, const char *src, int64_t t0,
		      int64_t n)
{
	struct piece p = { c, q, src, (size_t)(c->o.B * c->o.Hkv * n * c->o.D) * c->esz };

	return ape__kv_each_seg(c, t0, n, copy_seg, &p);
}

/* Largest key norm of each block, kept on the host for skipping and release. */
static void note_norms(struct ape_kv_cache *c, const char *packed, int64_t t0, int64_t n)
{
	const int64_t nbg = c->o.B * c->o.Hkv, D = c->o.D;
	float row[APE_MAX_D];

	for (int64_t bg = 0; bg < nbg; bg++)
		for (int64_t i = 0; i < n; i++) {
			const int64_t t = t0 + i;
			float *bn = c->bnorm + ape__kv_phys(c, t / c->bt) * nbg + bg;

			ape_convert(row, APE_F32, packed + (size_t)((bg * n + i) * D) * c->esz,
				    c->o.dtype, (size_t)D);
			if (t % c->bt == 0) /* a block's first token: it may be a reused one */
				*bn = 0;
			*bn = fmaxf(*bn, ape__norm(row, D));
		}
}

/* n more tokens fit (after the blocks released so far), else APE_ENOMEM saying what does. */
static int check_room(const struct ape_kv_cache *c, const char *fn, int64_t n)
{
	const int64_t room = (c->lb_first + c->nblocks) * c->bt - c->t_end;

	if (n <= room)
		return 0;
	return ape__error(APE_ENOMEM,
			  "%s: %" PRId64 " tokens do not fit: the cache holds %" PRId64 " of %" PRId64
			  " (room for %" PRId64 "); release blocks or make a larger cache",
			  fn, n, ape__kv_live_tokens(c), c->nblocks * c->bt, room);
}

/*
 * With APE_TRACE, one append piece's copies as a span of the session trace, on the device's
 * track: e0 recorded on q before them, e1 after, enq the host time they were enqueued. Waits for
 * q (only when tracing). A diagnostic: nothing here fails the append.
 */
static void trace_piece(struct ape_kv_cache *c, struct ape_be_queue *q, struct ape_be_event *e0,
			struct ape_be_event *e1, double enq, uint64_t bytes, const char *what)
{
	struct ape__trace_dev td;
	double ms = 0, t1;

	memset(&td, 0, sizeof(td));
	if (!e0 || !e1 || c->ops->synchronize(q) || c->ops->event_elapsed(e0, e1, &ms))
		return;
	td.device_clock = ape_be_caps_have(&c->dev->caps, APE_BE_CAP_TIMESTAMPS) && c->ops->event_timestamp &&
			  !c->ops->event_timestamp(e1, &t1);
	if (!td.device_clock)
		t1 = ape__now_ms();
	ape__trace_label(&td, &c->dev, 0);
	ape__trace_add(&td, what, APE__LANE_H2D_KV, t1 - ms, t1, enq, -1, -1, bytes);
	ape__trace_to_session(&td);
	ape__trace_free(&td);
}

/* An append's line of the call log (docs/profiling.md): what it added, what the cache holds. */
static void log_append(const struct ape_kv_cache *c, const char *fn, int64_t n, double t0)
{
	char name[256];

	if (ape__dev_verbose(c->dev) <= 0 || (ape__api_depth() > 1 && ape__dev_verbose(c->dev) < 2))
		return;
	ape__json_escape(name, sizeof(name), c->dev->info.name);
	if (ape__verbose_json())
		ape__vlog("{\"call\":\"%s\",\"devices\":[\"%s:%d %s\"],\"tokens\":%lld,"
			  "\"live_tokens\":%lld,\"capacity_tokens\":%lld,\"wall_ms\":%.6f}",
			  fn, c->dev->info.backend, c->dev->info.backend_index, name, (long long)n,
			  (long long)ape__kv_live_tokens(c), (long long)(c->nblocks * c->bt),
			  ape__now_ms() - t0);
	else
		ape__vlog("%s: %s:%d %s | +%lld tokens, %lld held of %lld | %.3f ms wall "
			  "(the last copies may still run)",
			  fn, c->dev->info.backend, c->dev->info.backend_index, c->dev->info.name,
			  (long long)n, (long long)ape__kv_live_tokens(c),
			  (long long)(c->nblocks * c->bt), ape__now_ms() - t0);
}

int ape_kv_cache_append(ape_kv_cache *c, const ape_tensor *k, const ape_tensor *v)
{
	APE__API_CALL("ape_kv_cache_append");
	static const char fn[] = "ape_kv_cache_append";
	static const char *const dims[4] = { "B", "Hkv", "n", "D" };
	const double t0 = ape__now_ms();
	const bool tracing = ape__strace_on();
	struct ape_be_event *e0 = NULL;
	double enq;
	int64_t ks[4], vs[4], want[4], n;
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
	if ((ret = check_room(c, fn, n)))
		return ret;
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
		if (tracing && c->ops->event_record(c->aq[i], &e0))
			e0 = NULL; /* (untimed: the trace goes without this piece) */
		enq = ape__now_ms();
		if ((ret = copy_piece(c, c->aq[i], st, c->t_end, m)) ||
		    (ret = c->ops->event_record(c->aq[i], &c->alast[i]))) {
			c->ops->event_destroy(e0);
			return ape__error_prefix(ape__error_on(ret, c->dev), fn);
		}
		if (tracing)
			trace_piece(c, c->aq[i], e0, c->alast[i], enq, 2 * half, "h2d K/V append");
		c->ops->event_destroy(e0);
		e0 = NULL;
		c->apending[i] = true;
		c->t_end += m;
		done += m;
	}
	log_append(c, fn, n, t0);
	return 0;
}

/* One device append piece: tokens [t0, t0 + n) of the source views, copied within the device. */
struct dpiece {
	struct ape_kv_cache *c;
	struct ape_be_queue *q;
	struct ape_be_buf *src[2]; /* k, v */
	struct ape_be_view view[2];
	int64_t t0; /* first source row of the piece */
	int64_t n;
};

static int copy_seg_d2d(void *arg, const struct ape__kv_seg *sg)
{
	const struct dpiece *p = arg;
	struct ape_kv_cache *c = p->c;
	const int64_t D = c->o.D, bg = (int64_t)(sg->off / c->esz) / D / p->n;
	const int64_t b = bg / c->o.Hkv, hk = bg % c->o.Hkv;
	const int64_t row = (int64_t)(sg->off / c->esz) / D % p->n, rows = (int64_t)sg->bytes / c->esz / D;
	int ret = 0;

	for (int kv = 0; kv < 2 && !ret; kv++) {
		const struct ape_be_view *v = &p->view[kv];
		size_t bo;
		struct ape_be_buf *dst = ape__kv_block(c, kv, sg->blk, &bo);
		const int64_t first = v->off + b * v->sb + hk * v->sh + (p->t0 + row) * v->sl;

		if (v->sl == D) /* the rows follow each other: one copy */
			ret = c->ops->copy_d2d(p->q, dst, bo + sg->blk_off, p->src[kv],
					       (size_t)first * c->esz, sg->bytes);
		for (int64_t i = 0; v->sl != D && i < rows && !ret; i++)
			ret = c->ops->copy_d2d(p->q, dst, bo + sg->blk_off + (size_t)(i * D) * c->esz,
					       p->src[kv], (size_t)(first + i * v->sl) * c->esz,
					       (size_t)D * c->esz);
	}
	return ret;
}

int ape_kv_cache_append_device(ape_kv_cache *c, ape_queue *queue, const ape_dtensor *k,
			       const ape_dtensor *v)
{
	APE__API_CALL("ape_kv_cache_append_device");
	static const char fn[] = "ape_kv_cache_append_device";
	static const char *const dims[4] = { "B", "Hkv", "n", "D" };
	const double t0 = ape__now_ms();
	const bool tracing = ape__strace_on();
	struct ape_be_event *e0 = NULL, *e1 = NULL;
	double enq;
	struct dpiece dp = { 0 };
	struct ape_be_event *ready = NULL;
	int64_t want[4], n;
	int ret;

	if (!c)
		return ape__error(APE_EINVAL, "%s: cache = NULL", fn);
	if (!queue)
		return ape__error(APE_EINVAL, "%s: queue = NULL", fn);
	if (queue->dev != c->dev)
		return ape__error(APE_EINVAL, "%s: the queue is of %s:%d, the cache of %s:%d", fn,
				  queue->dev->info.backend, queue->dev->info.backend_index,
				  c->dev->info.backend, c->dev->info.backend_index);
	if (!c->ops->copy_d2d)
		return ape__error_on(ape__error(APE_ENOTSUP, "%s: the %s backend has no "
						"device-to-device copy", fn, c->dev->info.backend),
				     c->dev);
	want[0] = c->o.B;
	want[1] = c->o.Hkv;
	want[2] = -1;
	want[3] = c->o.D;
	if ((ret = ape__check_dtensor(fn, "k", k, c->dev, c->o.dtype, want, dims, &dp.view[0])))
		return ret;
	want[2] = k->shape[2];
	if ((ret = ape__check_dtensor(fn, "v", v, c->dev, c->o.dtype, want, dims, &dp.view[1])))
		return ret;
	n = k->shape[2];
	if ((ret = check_room(c, fn, n)))
		return ret;
	if (!n)
		return 0;
	dp.c = c;
	dp.src[0] = k->buf->b;
	dp.src[1] = v->buf->b;
	/* the caller's work that wrote k and v comes first */
	if ((ret = c->ops->event_record(queue->q, &ready)))
		return ape__error_prefix(ape__error_on(ret, c->dev), fn);
	for (int64_t done = 0; done < n && !ret;) {
		const int64_t m = n - done < c->o.append_chunk ? n - done : c->o.append_chunk;
		const int i = c->anext;
		char *st = c->astage[i].ptr;

		c->anext ^= 1;
		dp.q = c->aq[i];
		dp.t0 = done;
		dp.n = m;
		if ((ret = c->ops->event_wait(dp.q, ready)))
			break;
		if (tracing && c->ops->event_record(dp.q, &e0))
			e0 = NULL; /* (untimed: the trace goes without this piece) */
		enq = ape__now_ms();
		ret = ape__kv_each_seg(c, c->t_end, m, copy_seg_d2d, &dp);
		if (!ret && e0 && !c->ops->event_record(dp.q, &e1))
			trace_piece(c, dp.q, e0, e1, enq,
				    (uint64_t)(2 * c->o.B * c->o.Hkv * m * c->o.D) * c->esz,
				    "d2d K/V append");
		c->ops->event_destroy(e0);
		c->ops->event_destroy(e1);
		e0 = e1 = NULL;
		if (ret)
			break;
		/* the new keys, read back for their norms (skipping and release need them) */
		for (int64_t bg = 0; bg < c->o.B * c->o.Hkv && !ret; bg++)
			for (int64_t t = 0; t < m && !ret; t++) {
				const struct ape_be_view *kv = &dp.view[0];
				const int64_t e = kv->off + bg / c->o.Hkv * kv->sb +
						  bg % c->o.Hkv * kv->sh + (done + t) * kv->sl;

				ret = c->ops->copy_d2h(dp.q, st + (size_t)((bg * m + t) * c->o.D) * c->esz,
						       dp.src[0], (size_t)e * c->esz,
						       (size_t)c->o.D * c->esz);
			}
		if (!ret)
			ret = c->ops->synchronize(dp.q);
		if (ret)
			break;
		c->apending[i] = false;
		note_norms(c, st, c->t_end, m);
		c->t_end += m;
		done += m;
	}
	c->ops->event_destroy(ready);
	if (ret)
		return ape__error_prefix(ape__error_on(ret, c->dev), fn);
	log_append(c, fn, n, t0);
	return 0;
}

int ape_kv_cache_get_info(const ape_kv_cache *c, ape_kv_cache_info *info)
{
	APE__API_CALL("ape_kv_cache_get_info");
	if (!c || !info)
		return ape__error(APE_EINVAL, "ape_kv_cache_get_info: %s = NULL",
				  !c ? "cache" : "info");
	memset(info, 0, sizeof(*info));
	info->tokens = c->t_end;
	info->live_tokens = ape__kv_live_tokens(c);
	info->first_live_position = ape__kv_first_live_position(c);
	info->next_position = ape__kv_next_position(c);
	info->capacity_tokens = c->nblocks * c->bt;
	info->block_tokens = c->bt;
	info->blocks_live = (c->t_end + c->bt - 1) / c->bt - c->lb_first;
	info->blocks_released = c->lb_first;
	info->min_query_position = c->rel.released ? c->rel.q_floor : INT64_MIN;
	info->device_bytes = c->mem.cur + ape__stream_device_bytes(c->ks.s);
	return 0;
}
