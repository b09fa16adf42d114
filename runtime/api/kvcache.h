/* SPDX-License-Identifier: MIT */
/*
 * The KV cache object, shared by its files and by nothing else: kvcache.c (creation, appends,
 * information), kvcache_attend.c (attends: the gathers and the executor run) and
 * kvcache_release.c (the release proof, and what it requires of later attends).
 *
 * Keys and values of one sequence on a device, in fixed-size blocks used as a ring (logical
 * block lb lives in physical block lb mod capacity), so that releasing the oldest blocks makes
 * room for new tokens without moving anything.
 */
#ifndef APE_RUNTIME_API_KVCACHE_H
#define APE_RUNTIME_API_KVCACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "exec/devmem.h"
#include "exec/fwd_pass.h"
#include "exec/problem.h"
#include "exec/skip.h"
#include "exec/stream.h"
#include "topo/placement.h"
#include "api/kv_session.h"

#pragma GCC visibility push(hidden)

struct ape_kv_cache {
	struct ape_device *dev;
	const struct ape_backend_plugin *ops;
	ape_kv_cache_options o; /* defaults resolved */
	int64_t bt, nblocks; /* tokens per block, physical blocks */
	size_t esz;
	uint64_t blk_bytes; /* one block of K (or V): [B, Hkv, bt, D] */
	struct ape__devmem mem; /* the blocks */
	/* the blocks in slabs of per_slab blocks each (one slab when the device takes a buffer
	 * that large: then launches may read them in place, struct ape_be_kv_pages) */
	struct ape_be_buf **sk, **sv;
	int64_t nslabs, per_slab;
	float *bnorm; /* [nblocks][B*Hkv]: largest key norm in each block */

	int64_t t_end; /* tokens appended */
	int64_t lb_first; /* oldest live logical block */
	/* during an attend: the oldest live tokens it leaves out unread (its window starts
	 * there; kvcache_attend.c's window_cut()); the loaders count j0 from there. 0 between
	 * attends. */
	int64_t win;

	/* appends */
	struct ape_be_queue *aq[2];
	struct ape__hostmem astage[2];
	bool apending[2];
	struct ape_be_event *alast[2]; /* the last copy of each append queue */
	int anext;
	float *rownorm; /* B*Hkv*append_chunk key norms of one piece */

	/* attends: the session planned for a forward pass of the cache's shape */
	struct ape__kv_session ks;
	struct ape__hostmem bounce[APE__KV_DEPTH]; /* gathers without copy_d2d */
	struct ape__kv_loader loader;

	/* what the last release proof assumed; future attends must keep it true */
	struct ape__kv_terms rel; /* what the blocks released so far assumed (api/kv_session.h) */
};

/* ---- positions and blocks */

static inline int64_t ape__kv_live_tokens(const struct ape_kv_cache *c)
{
	return c->t_end - c->lb_first * c->bt;
}

static inline int64_t ape__kv_first_live_position(const struct ape_kv_cache *c)
{
	return c->o.k_start + c->lb_first * c->bt;
}

static inline int64_t ape__kv_next_position(const struct ape_kv_cache *c)
{
	return c->o.k_start + c->t_end;
}

static inline int64_t ape__kv_phys(const struct ape_kv_cache *c, int64_t lb)
{
	return lb % c->nblocks;
}

/* The buffer holding physical block blk of keys (kv 0) or values (kv 1), and the block's
 * byte offset in it. */
static inline struct ape_be_buf *ape__kv_block(const struct ape_kv_cache *c, int kv, int64_t blk,
					     size_t *off)
{
	*off = (size_t)(blk % c->per_slab) * (size_t)c->blk_bytes;
	return (kv ? c->sv : c->sk)[blk / c->per_slab];
}

/* Byte offset of row r of (batch, kv head) bg inside a block. */
static inline size_t ape__kv_blk_off(const struct ape_kv_cache *c, int64_t bg, int64_t r)
{
	return (size_t)((bg * c->bt + r) * c->o.D) * c->esz;
}

/* A run of tokens of one (batch, kv head) that lies in one block. */
struct ape__kv_seg {
	int64_t blk; /* physical block */
	size_t off; /* byte offset in the range's packed [B, Hkv, n, D] buffer */
	size_t blk_off; /* byte offset in the block */
	size_t bytes;
};

/* Calls fn for each run of tokens [t0, t0 + n) (counted from the first appended) within one
 * block, (batch, kv head) by (batch, kv head), until fn returns non-zero; returns that, or 0. */
int ape__kv_each_seg(const struct ape_kv_cache *c, int64_t t0, int64_t n,
		     int (*fn)(void *arg, const struct ape__kv_seg *sg), void *arg);

/* ---- attends (kvcache_attend.c) */

/* The attend session's key-chunk loader: gathers live tokens from the blocks. */
int ape__kv_load(void *arg, struct ape_be_queue *q, int lane, int64_t j0, int64_t n,
		 struct ape_be_buf *dk, struct ape_be_buf *dv, uint64_t *h2d, uint64_t *d2h,
		 uint64_t *d2d);

/* The loader in place (ape__kv_loader.pages, .wait): the blocks' slab and pages of live
 * tokens [j0, j0 + n), when the blocks lie in one slab; the appends still copying. */
bool ape_be_kv_pages(void *arg, int64_t j0, int64_t n, struct ape_be_buf **k, struct ape_be_buf **v,
		   struct ape_be_kv_pages *pg);
int ape__kv_wait(void *arg, struct ape_be_queue *q);

/* ---- release (kvcache_release.c) */

/* After a release, an attend may not do what the proof excluded: APE_EINVAL naming it. */
int ape__kv_check_release_terms(const struct ape_kv_cache *c, const char *fn,
				const struct ape__problem *p, const ape_tensor *q,
				const int64_t qs[4]);
/* Releases the oldest blocks while the proof holds for p's parameters; never fails (0). */
int ape__kv_try_release(struct ape_kv_cache *c, const struct ape__problem *p, int64_t *released);

#pragma GCC visibility pop
#endif
