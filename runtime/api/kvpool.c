/* SPDX-License-Identifier: MIT */
/*
 * The KV pool (api/kvpool.h): its options, its creation (the page buffers, append staging, the
 * attend session), sequences, forks, appends and the information calls. Attends are in
 * kvpool_attend.c.
 *
 * Appends check everything first (ids, tensors, and that the free pages cover every sequence's
 * new pages and copies on write), then take pages and pack the tokens into pinned staging
 * (two buffers on two queues: one packs while the other copies), one copy per head and run of
 * consecutive slots, noting each page's largest key norm per head on the host for the attends'
 * window proof.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/verbose.h"
#include "exec/pack.h"
#include "exec/skip.h"
#include "api/kvpool.h"
#include "api/validate.h"

#define PAGE_DEFAULT 16
#define BATCH_DEFAULT 256

void ape_kv_pool_options_init(ape_kv_pool_options *opts)
{
	if (!opts)
		return;
	memset(opts, 0, sizeof(*opts));
	opts->struct_size = sizeof(*opts);
	opts->page_tokens = PAGE_DEFAULT;
	opts->max_batch_tokens = BATCH_DEFAULT;
	opts->attend_chunk = APE__CHUNK_DEFAULT;
}

/* ------------------------------------------------------------------ creation */

int ape__kvp_check_options(const char *fn, const ape_kv_pool_options *o)
{
	int ret;

	if (!o)
		return ape__error(APE_EINVAL, "%s: opts = NULL", fn);
	if (o->struct_size != sizeof(*o))
		return ape__error(APE_EINVAL,
				  "%s: opts->struct_size = %zu: expected %zu (initialise with "
				  "ape_kv_pool_options_init())",
				  fn, o->struct_size, sizeof(*o));
	if ((ret = ape__kv_check_shape(fn, o->Hkv, o->H, o->D, o->dtype, o->capacity_tokens)))
		return ret;
	if (o->page_tokens < 0 || o->page_tokens > 65536)
		return ape__error(APE_EINVAL,
				  "%s: opts->page_tokens = %" PRId64 ": must be in 1..65536 (0: %d)",
				  fn, o->page_tokens, PAGE_DEFAULT);
	if (o->max_batch_tokens < 0 || o->max_batch_tokens > ((int64_t)1 << 20))
		return ape__error(APE_EINVAL,
				  "%s: opts->max_batch_tokens = %" PRId64
				  ": must be in 1..2^20 (0: %d)",
				  fn, o->max_batch_tokens, BATCH_DEFAULT);
	if (o->attend_chunk < 0 || o->attend_chunk > ((int64_t)1 << 40))
		return ape__error(APE_EINVAL,
				  "%s: opts->attend_chunk = %" PRId64 ": must be in 0..2^40 (0: %d)",
				  fn, o->attend_chunk, APE__CHUNK_DEFAULT);
	if (!(o->max_query_norm >= 0) || !isfinite(o->max_query_norm))
		return ape__error(APE_EINVAL,
				  "%s: opts->max_query_norm = %g: must be finite and >= 0 (0: no "
				  "release)",
				  fn, o->max_query_norm);
	{
		/* the page buffers' Hkv * slots * D elements at 8 bytes, and the host tables */
		int64_t n;

		if (__builtin_mul_overflow(o->Hkv, o->capacity_tokens + 65536, &n) ||
		    __builtin_mul_overflow(n, o->D, &n) || __builtin_mul_overflow(n, (int64_t)16, &n))
			return ape__error(APE_EOVERFLOW,
					  "%s: opts->Hkv = %" PRId64 ", capacity_tokens = %" PRId64
					  ", D = %" PRId64 ": the pool's sizes pass 64 bits",
					  fn, o->Hkv, o->capacity_tokens, o->D);
	}
	return 0;
}

static void resolve(ape_kv_pool_options *o)
{
	if (!o->H)
		o->H = o->Hkv;
	if (!o->page_tokens)
		o->page_tokens = PAGE_DEFAULT;
	if (!o->max_batch_tokens)
		o->max_batch_tokens = BATCH_DEFAULT;
	if (!o->attend_chunk)
		o->attend_chunk = APE__CHUNK_DEFAULT;
}

/* The page buffers, one for keys and one for values, each one device buffer; over a caller's
 * pages, only the page table. */
static int make_pages(struct ape_kv_pool *pl, const char *fn)
{
	const uint64_t bytes = (uint64_t)(pl->o.Hkv * pl->nslots * pl->o.D) * pl->esz;
	int ret;

	if (pl->ext) {
		if (pl->o.max_device_bytes &&
		    (uint64_t)pl->nslots * sizeof(int64_t) > pl->o.max_device_bytes)
			return ape__error(APE_ENOMEM,
					  "%s: opts->max_device_bytes = %" PRIu64 " cannot hold the "
					  "page table: %" PRIu64 " bytes",
					  fn, pl->o.max_device_bytes,
					  (uint64_t)pl->nslots * sizeof(int64_t));
		if (!(pl->tab_host = ape__malloc((size_t)pl->nslots * sizeof(*pl->tab_host))))
			return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " pages",
					  fn, pl->npages);
		if ((ret = ape__devmem_alloc(&pl->mem, (uint64_t)pl->nslots * sizeof(int64_t),
					     &pl->tab, "allocating the page table")))
			return ape__error_prefix(ret, fn);
		return 0;
	}

	pl->ref = ape__calloc((size_t)pl->npages, sizeof(*pl->ref));
	pl->fnext = ape__malloc((size_t)pl->npages * sizeof(*pl->fnext));
	pl->fprev = ape__malloc((size_t)pl->npages * sizeof(*pl->fprev));
	pl->pnorm = ape__calloc((size_t)(pl->npages * pl->o.Hkv), sizeof(float));
	if (!pl->ref || !pl->fnext || !pl->fprev || !pl->pnorm)
		return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " pages", fn,
				  pl->npages);
	for (int64_t p = 0; p < pl->npages; p++) { /* every page free, in order */
		pl->fnext[p] = p + 1 < pl->npages ? p + 1 : -1;
		pl->fprev[p] = p - 1;
	}
	pl->fhead = 0;
	pl->nfree = pl->npages;
	if (bytes > pl->dev->caps.max_alloc)
		return ape__error(APE_ENOMEM,
				  "%s: the pool's keys take %" PRIu64 " bytes in one buffer; %s:%d "
				  "allocates at most %" PRIu64 " bytes at once (make a smaller pool)",
				  fn, bytes, pl->dev->info.backend, pl->dev->info.backend_index,
				  pl->dev->caps.max_alloc);
	if (pl->o.max_device_bytes &&
	    2 * bytes + (uint64_t)pl->nslots * sizeof(int64_t) > pl->o.max_device_bytes)
		return ape__error(APE_ENOMEM,
				  "%s: opts->max_device_bytes = %" PRIu64 " cannot hold the pages: "
				  "%" PRIu64 " bytes of keys and values, %" PRIu64 " of page table",
				  fn, pl->o.max_device_bytes, 2 * bytes,
				  (uint64_t)pl->nslots * sizeof(int64_t));
	if (!(pl->tab_host = ape__malloc((size_t)pl->nslots * sizeof(*pl->tab_host))))
		return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " pages", fn,
				  pl->npages);
	if ((ret = ape__devmem_alloc(&pl->mem, bytes, &pl->k, "allocating key pages")) ||
	    (ret = ape__devmem_alloc(&pl->mem, bytes, &pl->v, "allocating value pages")) ||
	    (ret = ape__devmem_alloc(&pl->mem, (uint64_t)pl->nslots * sizeof(int64_t), &pl->tab,
				     "allocating the page table")))
		return ape__error_prefix(ret, fn);
	return 0;
}

static int make_rest(struct ape_kv_pool *pl, const char *fn)
{
	const struct ape__problem shape = {
		.B = 1, .H = pl->o.H, .Hkv = pl->o.Hkv, .D = pl->o.D, .Lq = pl->o.max_batch_tokens,
		.Lk = pl->nslots, .in_dtype = pl->o.dtype,
	};
	const uint64_t stage = 2 * (uint64_t)(pl->o.Hkv * pl->o.max_batch_tokens * pl->o.D) *
			       pl->esz;
	uint64_t budget = UINT64_MAX;
	int ret = 0;

	for (int i = 0; !ret && !pl->ext && i < 2; i++) /* append staging: the pool's own pages */
		if (!(ret = pl->ops->queue_create(pl->dev, &pl->aq[i])))
			ret = ape__host_alloc(pl->dev, (size_t)stage, &pl->astage[i]);
	if (ret)
		return ape__error_prefix(ret, fn);
	pl->lse_stage = ape__malloc((size_t)(pl->o.H * pl->o.max_batch_tokens) * sizeof(float));
	pl->diag_stage =
		ape__malloc((size_t)(2 * pl->o.H * pl->o.max_batch_tokens) * sizeof(float));
	if (!pl->lse_stage || !pl->diag_stage)
		return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	if (pl->o.max_device_bytes) {
		if (pl->mem.cur >= pl->o.max_device_bytes)
			return ape__error(APE_ENOMEM,
					  "%s: opts->max_device_bytes = %" PRIu64 ": the pages alone "
					  "need %" PRIu64 " bytes",
					  fn, pl->o.max_device_bytes, pl->mem.cur);
		budget = pl->o.max_device_bytes - pl->mem.cur;
	}
	if ((ret = ape__kv_session_make(&pl->ks, pl->dev, fn, &shape, pl->o.attend_chunk,
					budget)))
		return ret;
	ape__kvp_loader(pl);
	return 0;
}

int ape__kvp_create(ape_device *dev, const char *fn, const ape_kv_pool_options *o, bool ext,
		    size_t size, struct ape_kv_pool **out)
{
	struct ape_kv_pool *pl;
	int ret;

	pl = ape__calloc(1, size);
	if (!pl)
		return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	pl->dev = dev;
	pl->ops = dev->be->ops;
	pl->ext = ext;
	pl->o = *o;
	resolve(&pl->o);
	pl->P = pl->o.page_tokens;
	pl->npages = (pl->o.capacity_tokens + pl->P - 1) / pl->P;
	pl->nslots = pl->npages * pl->P;
	pl->esz = ape_dtype_size(pl->o.dtype);
	pl->g = (struct ape__kvp_geom){ .sp = pl->P * pl->o.D, .sh = pl->nslots * pl->o.D,
					.sr = pl->o.D };
	ape__devmem_init(&pl->mem, dev, UINT64_MAX);
	if ((ret = make_pages(pl, fn)) || (ret = make_rest(pl, fn))) {
		ape__error_on(ret, dev);
		ape_kv_pool_destroy(pl);
		return ret;
	}
	*out = pl;
	return 0;
}

int ape_kv_pool_create(ape_device *dev, const ape_kv_pool_options *opts, ape_kv_pool **out)
{
	APE__API_CALL("ape_kv_pool_create");
	static const char fn[] = "ape_kv_pool_create";
	int ret;

	if (!out)
		return ape__error(APE_EINVAL, "%s: out = NULL", fn);
	*out = NULL;
	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if ((ret = ape__kvp_check_options(fn, opts)))
		return ret;
	if (!dev->be->ops->copy_d2d)
		return ape__error_on(ape__error(APE_ENOTSUP,
						"%s: the %s backend has no device-to-device copy "
						"(a pool gathers and copies pages on the device)",
						fn, dev->info.backend),
				     dev);
	return ape__kvp_create(dev, fn, opts, false, sizeof(struct ape_kv_pool), out);
}

void ape_kv_pool_destroy(ape_kv_pool *pl)
{
	if (!pl)
		return;
	if (pl->ext) { /* the caller's buffers, borrowed for one run at a time */
		pl->k = NULL;
		pl->v = NULL;
	}
	ape__kv_session_free(&pl->ks);
	for (int i = 0; i < 2; i++) {
		if (pl->aq[i])
			pl->ops->queue_destroy(pl->aq[i]); /* waits for the copies */
		pl->ops->event_destroy(pl->alast[i]);
		ape__host_free(pl->dev, &pl->astage[i]);
	}
	if (pl->k && !pl->ext)
		ape__devmem_free(&pl->mem, &pl->k,
				 (uint64_t)(pl->o.Hkv * pl->nslots * pl->o.D) * pl->esz);
	if (pl->v && !pl->ext)
		ape__devmem_free(&pl->mem, &pl->v,
				 (uint64_t)(pl->o.Hkv * pl->nslots * pl->o.D) * pl->esz);
	if (pl->tab)
		ape__devmem_free(&pl->mem, &pl->tab, (uint64_t)pl->nslots * sizeof(int64_t));
	free(pl->tab_host);
	for (int64_t i = 0; !pl->ext && i < pl->nseq; i++) {
		free(pl->seq[i].pages);
		free(pl->seq[i].pre);
		ape__kv_terms_free(&pl->seq[i].rel);
	}
	free(pl->seq);
	free(pl->ref);
	free(pl->fnext);
	free(pl->fprev);
	free(pl->pnorm);
	free(pl->kr);
	free(pl->segs);
	free(pl->full);
	free(pl->lse_stage);
	free(pl->diag_stage);
	free(pl);
}

/* ------------------------------------------------------------------ pages */

static void free_list_remove(struct ape_kv_pool *pl, int64_t p)
{
	if (pl->fprev[p] >= 0)
		pl->fnext[pl->fprev[p]] = pl->fnext[p];
	else
		pl->fhead = pl->fnext[p];
	if (pl->fnext[p] >= 0)
		pl->fprev[pl->fnext[p]] = pl->fprev[p];
	pl->nfree--;
}

/* A free page for sequence s: the one after its last page when free (so its slots stay one
 * run), else the free list's first. The caller checked that one is free. */
static int64_t page_take(struct ape_kv_pool *pl, const struct ape__kvp_seq *s)
{
	int64_t p = pl->fhead;

	if (s->npages && s->pages[s->npages - 1] + 1 < pl->npages &&
	    !pl->ref[s->pages[s->npages - 1] + 1])
		p = s->pages[s->npages - 1] + 1;
	free_list_remove(pl, p);
	pl->ref[p] = 1;
	memset(pl->pnorm + p * pl->o.Hkv, 0, (size_t)pl->o.Hkv * sizeof(float));
	return p;
}

/* Drops one reference to page p; the last returns it to the free list's front. */
void ape__kvp_page_put(struct ape_kv_pool *pl, int64_t p)
{
	if (--pl->ref[p])
		return;
	pl->fprev[p] = -1;
	pl->fnext[p] = pl->fhead;
	if (pl->fhead >= 0)
		pl->fprev[pl->fhead] = p;
	pl->fhead = p;
	pl->nfree++;
}

int64_t ape__kvp_contig(const struct ape_kv_pool *pl, const struct ape__kvp_seq *s, int64_t t,
			int64_t most)
{
	const int64_t held = s->npages * pl->P, end = t + most < held ? t + most : held;
	int64_t lp = t / pl->P, u = (lp + 1) * pl->P;

	while (u < end && pl->g.sp == pl->P * pl->g.sr && s->pages[u / pl->P] == s->pages[lp] + 1) {
		lp = u / pl->P;
		u += pl->P;
	}
	return (u < end ? u : end) - t;
}

/* ------------------------------------------------------------------ sequences */

struct ape__kvp_seq *ape__kvp_find(const struct ape_kv_pool *pl, const char *fn,
				   const char *what, int64_t id)
{
	if (id < 0 || id >= pl->nseq || !pl->seq[id].live) {
		ape__error(APE_EINVAL, "%s: %s = %" PRId64 ": no such sequence in the pool%s", fn,
			   what, id, id >= 0 && id < pl->nseq ? " (removed)" : "");
		return NULL;
	}
	return &pl->seq[id];
}

/* A new sequence's slot (not yet live), or NULL (APE_ENOMEM set). */
static struct ape__kvp_seq *seq_new(struct ape_kv_pool *pl, const char *fn)
{
	if (pl->nseq == pl->seq_cap) {
		const int64_t cap = pl->seq_cap ? 2 * pl->seq_cap : 16;
		struct ape__kvp_seq *g = ape__realloc(pl->seq, (size_t)cap * sizeof(*g));

		if (!g) {
			ape__error(APE_ENOMEM, "%s: out of host memory for a sequence", fn);
			return NULL;
		}
		pl->seq = g;
		pl->seq_cap = cap;
	}
	memset(&pl->seq[pl->nseq], 0, sizeof(pl->seq[0]));
	return &pl->seq[pl->nseq];
}

/* Room for `np` pages in s's list (host memory): 0 or APE_ENOMEM (message set). */
static int seq_reserve(struct ape__kvp_seq *s, const char *fn, int64_t np, int64_t hkv)
{
	int64_t cap = s->cap ? s->cap : 4;
	int64_t *g;
	float *f;

	if (np <= s->cap)
		return 0;
	while (cap < np)
		cap *= 2;
	if (!(g = ape__realloc(s->pages, (size_t)cap * sizeof(*g))))
		return ape__error(APE_ENOMEM, "%s: out of host memory for a page list", fn);
	s->pages = g;
	if (!(f = ape__realloc(s->pre, (size_t)(cap * hkv) * sizeof(*f))))
		return ape__error(APE_ENOMEM, "%s: out of host memory for a page list", fn);
	s->pre = f;
	s->cap = cap;
	return 0;
}

int ape_kv_pool_add_sequence(ape_kv_pool *pl, int64_t k_start, int64_t *seq_id)
{
	APE__API_CALL("ape_kv_pool_add_sequence");
	static const char fn[] = "ape_kv_pool_add_sequence";
	struct ape__kvp_seq *s;

	if (!pl || !seq_id)
		return ape__error(APE_EINVAL, "%s: %s = NULL", fn, !pl ? "pool" : "seq_id");
	/* positions (k_start + tokens, queries before them) keep 2^62 of headroom both ways */
	if (k_start > INT64_MAX - ((int64_t)1 << 62) || k_start < INT64_MIN + ((int64_t)1 << 62))
		return ape__error(APE_EOVERFLOW,
				  "%s: k_start = %" PRId64 ": must be in [-2^62, 2^62)", fn, k_start);
	if (!(s = seq_new(pl, fn)))
		return APE_ENOMEM;
	s->live = true;
	s->k_start = k_start;
	*seq_id = pl->nseq++;
	pl->live++;
	return 0;
}

int ape_kv_pool_remove_sequence(ape_kv_pool *pl, int64_t seq_id)
{
	APE__API_CALL("ape_kv_pool_remove_sequence");
	static const char fn[] = "ape_kv_pool_remove_sequence";
	struct ape__kvp_seq *s;

	if (!pl)
		return ape__error(APE_EINVAL, "%s: pool = NULL", fn);
	if (!(s = ape__kvp_find(pl, fn, "seq_id", seq_id)))
		return APE_EINVAL;
	for (int64_t i = s->first / pl->P; i < s->npages; i++) /* the released are -1 */
		ape__kvp_page_put(pl, s->pages[i]);
	free(s->pages);
	free(s->pre);
	ape__kv_terms_free(&s->rel);
	memset(s, 0, sizeof(*s));
	pl->live--;
	return 0;
}

int ape_kv_pool_fork(ape_kv_pool *pl, int64_t seq_id, int64_t *new_id)
{
	APE__API_CALL("ape_kv_pool_fork");
	static const char fn[] = "ape_kv_pool_fork";
	struct ape__kvp_seq *s, *f;

	if (!pl || !new_id)
		return ape__error(APE_EINVAL, "%s: %s = NULL", fn, !pl ? "pool" : "new_id");
	if (!ape__kvp_find(pl, fn, "seq_id", seq_id))
		return APE_EINVAL;
	if (!(f = seq_new(pl, fn)))
		return APE_ENOMEM;
	s = &pl->seq[seq_id]; /* after seq_new(): it may have moved the table */
	if (seq_reserve(f, fn, s->npages, pl->o.Hkv)) {
		/* the slot is not the pool's yet: the next seq_new() would drop what the first
		 * of seq_reserve()'s two allocations got */
		free(f->pages);
		free(f->pre);
		memset(f, 0, sizeof(*f));
		return APE_ENOMEM;
	}
	if (s->npages) {
		memcpy(f->pages, s->pages, (size_t)s->npages * sizeof(*f->pages));
		memcpy(f->pre, s->pre, (size_t)(s->npages * pl->o.Hkv) * sizeof(*f->pre));
	}
	if (s->rel.released) { /* the release's terms hold for the fork too */
		if (ape__kv_terms_init(&f->rel, fn, pl->o.H, pl->o.Hkv)) {
			free(f->pages);
			free(f->pre);
			memset(f, 0, sizeof(*f));
			return APE_ENOMEM;
		}
		ape__kv_terms_copy(&f->rel, &s->rel, pl->o.H, pl->o.Hkv);
	}
	f->npages = s->npages;
	f->n = s->n;
	f->first = s->first;
	f->k_start = s->k_start;
	f->live = true;
	for (int64_t i = s->first / pl->P; i < s->npages; i++)
		pl->ref[s->pages[i]]++;
	*new_id = pl->nseq++;
	pl->live++;
	return 0;
}

int ape_kv_pool_sequence_info(const ape_kv_pool *pl, int64_t seq_id, int64_t *tokens,
			      int64_t *k_start)
{
	APE__API_CALL("ape_kv_pool_sequence_info");
	static const char fn[] = "ape_kv_pool_sequence_info";
	const struct ape__kvp_seq *s;

	if (!pl)
		return ape__error(APE_EINVAL, "%s: pool = NULL", fn);
	if (!(s = ape__kvp_find(pl, fn, "seq_id", seq_id)))
		return APE_EINVAL;
	if (tokens)
		*tokens = s->n;
	if (k_start)
		*k_start = s->k_start;
	return 0;
}

int ape_kv_pool_get_info(const ape_kv_pool *pl, ape_kv_pool_info *info)
{
	APE__API_CALL("ape_kv_pool_get_info");
	if (!pl || !info)
		return ape__error(APE_EINVAL, "ape_kv_pool_get_info: %s = NULL",
				  !pl ? "pool" : "info");
	memset(info, 0, sizeof(*info));
	info->page_tokens = pl->P;
	info->pages_total = pl->npages;
	info->pages_free = pl->nfree;
	info->pages_used = pl->npages - pl->nfree;
	for (int64_t p = 0; p < pl->npages; p++)
		info->pages_shared += pl->ref[p] > 1;
	for (int64_t i = 0; i < pl->nseq; i++)
		info->tokens += pl->seq[i].live ? pl->seq[i].n - pl->seq[i].first : 0;
	info->sequences = pl->live;
	info->pages_copied = pl->copied;
	info->device_bytes = pl->mem.cur + ape__stream_device_bytes(pl->ks.s);
	return 0;
}

/* ------------------------------------------------------------------ appends */

int ape__kvp_wait(void *arg, struct ape_be_queue *q)
{
	struct ape_kv_pool *pl = arg;
	int ret = 0;

	for (int i = 0; i < 2 && !ret; i++)
		if (pl->alast[i])
			ret = pl->ops->event_wait(q, pl->alast[i]);
	return ret;
}

/* One piece of an append: tokens [src0, src0 + n) of the tensors go to sequence s from its
 * token t0 on. */
struct piece {
	struct ape__kvp_seq *s;
	int64_t src0, t0, n;
	int64_t np0, last0; /* s's pages and last page before the append (undo()) */
};

/* The append queue for the next copies: its staging free again, its work after the other
 * queue's (a page freed and taken again is written in call order). */
static int queue_next(struct ape_kv_pool *pl, int *qi)
{
	const int i = pl->anext;
	int ret = 0;

	if (pl->apending[i]) {
		if ((ret = pl->ops->synchronize(pl->aq[i])))
			return ret;
		pl->apending[i] = false;
	}
	if (pl->alast[i ^ 1])
		ret = pl->ops->event_wait(pl->aq[i], pl->alast[i ^ 1]);
	*qi = i;
	return ret;
}

/* Records the end of queue i's copies and hands the next copies to the other queue. */
static int queue_done(struct ape_kv_pool *pl, int i)
{
	int ret;

	pl->ops->event_destroy(pl->alast[i]);
	pl->alast[i] = NULL;
	ret = pl->ops->event_record(pl->aq[i], &pl->alast[i]);
	pl->apending[i] = true;
	pl->anext = i ^ 1;
	return ret;
}

/* Copies page `from`'s first `rows` tokens into page `to`, every head, keys and values. */
static int copy_page(struct ape_kv_pool *pl, struct ape_be_queue *q, int64_t from, int64_t to,
		     int64_t rows)
{
	const size_t row = (size_t)pl->o.D * pl->esz;
	int ret = 0;

	for (int64_t g = 0; g < pl->o.Hkv && !ret; g++) {
		const size_t a = (size_t)(g * pl->nslots + from * pl->P) * row;
		const size_t b = (size_t)(g * pl->nslots + to * pl->P) * row;

		ret = pl->ops->copy_d2d(q, pl->k, b, pl->k, a, (size_t)rows * row);
		if (!ret)
			ret = pl->ops->copy_d2d(q, pl->v, b, pl->v, a, (size_t)rows * row);
	}
	return ret;
}

/* Pages sequence s needs to append n tokens: new ones, and a copy of a shared last page it
 * would write into. */
static int64_t pages_needed(const struct ape_kv_pool *pl, const struct ape__kvp_seq *s,
			    int64_t n)
{
	const int64_t now = (s->n + pl->P - 1) / pl->P, after = (s->n + n + pl->P - 1) / pl->P;
	const bool cow = n > 0 && s->n % pl->P && pl->ref[s->pages[s->npages - 1]] > 1;

	return after - now + cow;
}

/* Takes the pages of appending n tokens to s (copying its shared last page first, on queue
 * q): afterwards s holds pages for s->n + n tokens. The caller checked there are enough. */
static int take_pages(struct ape_kv_pool *pl, struct ape_be_queue *q, struct ape__kvp_seq *s,
		      int64_t n)
{
	const int64_t after = (s->n + n + pl->P - 1) / pl->P;

	if (n > 0 && s->n % pl->P && pl->ref[s->pages[s->npages - 1]] > 1) {
		const int64_t old = s->pages[s->npages - 1];
		int64_t p;
		int ret;

		s->npages--; /* the copy may continue the run before it */
		p = page_take(pl, s);
		s->pages[s->npages++] = p;
		memcpy(pl->pnorm + p * pl->o.Hkv, pl->pnorm + old * pl->o.Hkv,
		       (size_t)pl->o.Hkv * sizeof(float));
		ape__kvp_page_put(pl, old);
		pl->copied++;
		if ((ret = copy_page(pl, q, old, p, s->n % pl->P)))
			return ret;
	}
	while (s->npages < after)
		s->pages[s->npages] = page_take(pl, s), s->npages++;
	return 0;
}

/* Notes the norms of the staged keys ([Hkv, n, D] at st) of tokens [t0, t0 + n) of s: each
 * page's maxima, and s's running maxima from the first page touched on. */
static void note_norms(struct ape_kv_pool *pl, struct ape__kvp_seq *s, const char *st,
		       int64_t t0, int64_t n)
{
	const int64_t hkv = pl->o.Hkv;
	float row[APE_MAX_D];

	for (int64_t g = 0; g < hkv; g++)
		for (int64_t i = 0; i < n; i++) {
			float *pn = pl->pnorm + s->pages[(t0 + i) / pl->P] * hkv + g;

			ape_convert(row, APE_F32, st + (size_t)((g * n + i) * pl->o.D) * pl->esz,
				    pl->o.dtype, (size_t)pl->o.D);
			*pn = fmaxf(*pn, ape__norm(row, pl->o.D));
		}
	for (int64_t li = t0 / pl->P; li <= (t0 + n - 1) / pl->P; li++)
		for (int64_t g = 0; g < hkv; g++) {
			const float x = pl->pnorm[s->pages[li] * hkv + g];

			s->pre[li * hkv + g] = li ? fmaxf(s->pre[(li - 1) * hkv + g], x) : x;
		}
}

/* Copies staged tokens ([Hkv, n, D] of keys at st, of values at st + half) into s's slots
 * from token t0 on, one copy per head and run of consecutive slots. */
static int copy_staged(struct ape_kv_pool *pl, struct ape_be_queue *q, const struct ape__kvp_seq *s,
		       const char *st, size_t half, int64_t t0, int64_t n)
{
	const size_t row = (size_t)pl->o.D * pl->esz;
	int ret = 0;

	for (int64_t i = 0; i < n && !ret;) {
		const int64_t m = ape__kvp_contig(pl, s, t0 + i, n - i);
		const int64_t slot = ape__kvp_slot(pl, s, t0 + i);

		for (int64_t g = 0; g < pl->o.Hkv && !ret; g++) {
			const size_t dst = (size_t)(g * pl->nslots + slot) * row;
			const size_t src = (size_t)(g * n + i) * row;

			ret = pl->ops->copy_h2d(q, pl->k, dst, st + src, (size_t)m * row);
			if (!ret)
				ret = pl->ops->copy_h2d(q, pl->v, dst, st + half + src,
							(size_t)m * row);
		}
		i += m;
	}
	return ret;
}

/*
 * Undoes a failed append of the pieces: once no copy is in flight (both queues waited for),
 * every sequence holds the pages and tokens it held before (a page copied on write given back
 * for the shared one), so that the append appended nothing. The page norms it raised stay
 * raised: bounds still. After a device failure the pool is unusable all the same.
 */
static void undo(struct ape_kv_pool *pl, struct piece *pc, int64_t npc, int64_t copied)
{
	for (int i = 0; i < 2; i++)
		if (pl->apending[i]) {
			pl->ops->synchronize(pl->aq[i]);
			pl->apending[i] = false;
		}
	for (int64_t i = npc - 1; i >= 0; i--) {
		struct ape__kvp_seq *s = pc[i].s;

		while (s->npages > pc[i].np0)
			ape__kvp_page_put(pl, s->pages[--s->npages]);
		if (pc[i].np0 && s->pages[pc[i].np0 - 1] != pc[i].last0) {
			const int64_t copy = s->pages[pc[i].np0 - 1];

			s->pages[pc[i].np0 - 1] = pc[i].last0;
			pl->ref[pc[i].last0]++;
			ape__kvp_page_put(pl, copy);
		}
		s->n = pc[i].t0;
	}
	pl->copied = copied;
}

/*
 * The append of every piece (validated, room checked): pages taken (copies on write first),
 * then the tokens staged and copied, as many pieces per staging buffer as fit. On a failure
 * (a device's, or a backend op's host memory: event_record, copy_h2d) the append is undone and
 * its code returned (after a device failure the pool is unusable all the same).
 */
static int append_pieces(struct ape_kv_pool *pl, struct piece *pc, int64_t npc,
			 const ape_tensor *k, const int64_t ks[4], const ape_tensor *v,
			 const int64_t vs[4])
{
	const int64_t mb = pl->o.max_batch_tokens, unit = pl->o.Hkv * pl->o.D;
	const int64_t copied = pl->copied;
	int qi, ret;

	for (int64_t i = 0; i < npc; i++) {
		pc[i].np0 = pc[i].s->npages;
		pc[i].last0 = pc[i].np0 ? pc[i].s->pages[pc[i].np0 - 1] : -1;
	}
	/* pages first (one queue: the copies on write come before any new token) */
	if ((ret = queue_next(pl, &qi)))
		goto fail;
	for (int64_t i = 0; i < npc && !ret; i++)
		ret = take_pages(pl, pl->aq[qi], pc[i].s, pc[i].n);
	if (!ret)
		ret = queue_done(pl, qi);
	for (int64_t i = 0, done = 0; i < npc && !ret;) {
		/* one staging buffer's worth: whole pieces, or part of a long one */
		char *st;
		int64_t used = 0;

		if ((ret = queue_next(pl, &qi)))
			break;
		st = pl->astage[qi].ptr;
		while (i < npc && used < mb && !ret) {
			struct piece *p = &pc[i];
			const int64_t m = p->n - done < mb - used ? p->n - done : mb - used;
			char *ks_ = st + (size_t)(used * unit) * pl->esz;
			const size_t half = (size_t)(m * unit) * pl->esz;

			/* keys then values of this part, [Hkv, m, D] each */
			ape__pack_rows(ks_, k, ks, p->src0 + done, m);
			ape__pack_rows(ks_ + half, v, vs, p->src0 + done, m);
			note_norms(pl, p->s, ks_, p->t0 + done, m);
			ret = copy_staged(pl, pl->aq[qi], p->s, ks_, half, p->t0 + done, m);
			used += 2 * m; /* K and V */
			done += m;
			if (done == p->n) {
				p->s->n = p->t0 + p->n;
				i++;
				done = 0;
			}
		}
		if (!ret)
			ret = queue_done(pl, qi);
	}
	if (!ret)
		return 0;
fail:
	undo(pl, pc, npc, copied);
	return ret;
}

/* The tensors of an append: `[1, Hkv, total, D]` of the pool's dtype. */
static int check_kv(struct ape_kv_pool *pl, const char *fn, const ape_tensor *k,
		    const ape_tensor *v, int64_t ks[4], int64_t vs[4])
{
	static const char *const dims[4] = { "B", "Hkv", "n", "D" };
	int64_t want[4] = { 1, pl->o.Hkv, -1, pl->o.D };
	int ret;

	if ((ret = ape__check_tensor(fn, "k", k, pl->o.dtype, want, dims, ks)))
		return ret;
	want[2] = k->shape[2];
	return ape__check_tensor(fn, "v", v, pl->o.dtype, want, dims, vs);
}

/* Whether the free pages cover `need`; else APE_ENOMEM saying so. */
static int check_room(const struct ape_kv_pool *pl, const char *fn, int64_t need, int64_t tokens)
{
	if (need <= pl->nfree)
		return 0;
	return ape__error(APE_ENOMEM,
			  "%s: %" PRId64 " tokens need %" PRId64 " free pages of %" PRId64
			  " tokens; the pool has %" PRId64 " of %" PRId64
			  " (remove sequences or make a larger pool)",
			  fn, tokens, need, pl->P, pl->nfree, pl->npages);
}

int ape_kv_pool_append(ape_kv_pool *pl, int64_t seq_id, const ape_tensor *k, const ape_tensor *v)
{
	APE__API_CALL("ape_kv_pool_append");
	static const char fn[] = "ape_kv_pool_append";
	int64_t ks[4], vs[4];
	struct piece pc;
	int ret;

	if (!pl)
		return ape__error(APE_EINVAL, "%s: pool = NULL", fn);
	if (!(pc.s = ape__kvp_find(pl, fn, "seq_id", seq_id)))
		return APE_EINVAL;
	if ((ret = check_kv(pl, fn, k, v, ks, vs)))
		return ret;
	pc.src0 = 0;
	pc.t0 = pc.s->n;
	pc.n = k->shape[2];
	if (!pc.n)
		return 0;
	if ((ret = check_room(pl, fn, pages_needed(pl, pc.s, pc.n), pc.n)) ||
	    (ret = seq_reserve(pc.s, fn, (pc.s->n + pc.n + pl->P - 1) / pl->P, pl->o.Hkv)))
		return ret;
	if ((ret = append_pieces(pl, &pc, 1, k, ks, v, vs)))
		return ape__error_prefix(ape__error_on(ret, pl->dev), fn);
	return 0;
}

int ape__kvp_check_batch(struct ape_kv_pool *pl, const char *fn, int64_t nseq,
			 const int64_t *seq_ids, const int64_t *cu, const char *cu_name,
			 int64_t total, const char *total_name)
{
	if (nseq < 0)
		return ape__error(APE_EINVAL, "%s: nseq = %" PRId64 ": must be >= 0", fn, nseq);
	if (nseq && (!seq_ids || !cu))
		return ape__error(APE_EINVAL, "%s: %s = NULL with nseq = %" PRId64, fn,
				  !seq_ids ? "seq_ids" : cu_name, nseq);
	if (!nseq) {
		if (total)
			return ape__error(APE_EINVAL, "%s: %s = %" PRId64 " rows for no sequence", fn,
					  total_name, total);
		return 0;
	}
	if (cu[0] != 0)
		return ape__error(APE_EINVAL, "%s: %s[0] = %" PRId64 ": must be 0", fn, cu_name,
				  cu[0]);
	pl->stamp++;
	for (int64_t i = 0; i < nseq; i++) {
		struct ape__kvp_seq *s;

		if (cu[i + 1] < cu[i])
			return ape__error(APE_EINVAL,
					  "%s: %s[%" PRId64 "] = %" PRId64 " < %s[%" PRId64 "] = %" PRId64,
					  fn, cu_name, i + 1, cu[i + 1], cu_name, i, cu[i]);
		if (seq_ids[i] < 0 || seq_ids[i] >= pl->nseq || !pl->seq[seq_ids[i]].live)
			return ape__error(APE_EINVAL,
					  "%s: seq_ids[%" PRId64 "] = %" PRId64
					  ": no such sequence in the pool",
					  fn, i, seq_ids[i]);
		s = &pl->seq[seq_ids[i]];
		if (s->stamp == pl->stamp)
			return ape__error(APE_EINVAL,
					  "%s: seq_ids[%" PRId64 "] = %" PRId64
					  ": named twice in one batch (give its rows as one run)",
					  fn, i, seq_ids[i]);
		s->stamp = pl->stamp;
	}
	if (cu[nseq] != total)
		return ape__error(APE_EINVAL, "%s: %s[%" PRId64 "] = %" PRId64 ": must equal %s = %" PRId64,
				  fn, cu_name, nseq, cu[nseq], total_name, total);
	return 0;
}

int ape_kv_pool_append_batch(ape_kv_pool *pl, int64_t nseq, const int64_t *seq_ids,
			     const int64_t *cu_seqlens, const ape_tensor *k, const ape_tensor *v)
{
	APE__API_CALL("ape_kv_pool_append_batch");
	static const char fn[] = "ape_kv_pool_append_batch";
	int64_t ks[4], vs[4], need = 0, npc = 0;
	struct piece *pc;
	int ret;

	if (!pl)
		return ape__error(APE_EINVAL, "%s: pool = NULL", fn);
	if ((ret = check_kv(pl, fn, k, v, ks, vs)) ||
	    (ret = ape__kvp_check_batch(pl, fn, nseq, seq_ids, cu_seqlens, "cu_seqlens",
					k->shape[2], "k->shape[2]")))
		return ret;
	for (int64_t i = 0; i < nseq; i++)
		need += pages_needed(pl, &pl->seq[seq_ids[i]], cu_seqlens[i + 1] - cu_seqlens[i]);
	if ((ret = check_room(pl, fn, need, k->shape[2])))
		return ret;
	if (!nseq)
		return 0;
	if (!(pc = ape__malloc((size_t)nseq * sizeof(*pc))))
		return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	for (int64_t i = 0; i < nseq && !ret; i++) {
		struct ape__kvp_seq *s = &pl->seq[seq_ids[i]];
		const int64_t n = cu_seqlens[i + 1] - cu_seqlens[i];

		if (!n)
			continue;
		ret = seq_reserve(s, fn, (s->n + n + pl->P - 1) / pl->P, pl->o.Hkv);
		pc[npc++] = (struct piece){ .s = s, .src0 = cu_seqlens[i], .t0 = s->n, .n = n };
	}
	if (!ret && (ret = append_pieces(pl, pc, npc, k, ks, v, vs)))
		ape__error_prefix(ape__error_on(ret, pl->dev), fn);
	free(pc);
	return ret;
}
