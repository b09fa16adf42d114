/* SPDX-License-Identifier: MIT */
/*
 * The KV pool object, shared by its files and by nothing else: kvpool.c (creation, sequences,
 * forks, appends, information) and kvpool_attend.c (attends: the batch's segments, each
 * sequence's window, the key loader and the executor run on the pool's session).
 *
 * Keys and values of many sequences on one device, in pages of P tokens. The device holds one
 * buffer for keys and one for values, each [Hkv, slots, D] (slots = pages * P; page p is slots
 * p * P .. p * P + P - 1 of every head's plane), so a sequence whose pages follow each other
 * is one plain strided run, read or copied as one piece per head. A sequence is a list of
 * pages in logical order; pages are reference-counted (forks share them) and copied on write.
 */
#ifndef APE_RUNTIME_API_KVPOOL_H
#define APE_RUNTIME_API_KVPOOL_H

#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "exec/devmem.h"
#include "exec/problem.h"
#include "exec/stream.h"
#include "topo/placement.h"
#include "api/kv_session.h"

#pragma GCC visibility push(hidden)

struct ape__kvp_seq {
	bool live;
	int64_t k_start; /* position of token 0 */
	int64_t n; /* tokens */
	int64_t npages, cap; /* pages held, room in pages[] */
	int64_t *pages; /* physical pages, logical order */
	float *pre; /* [cap][Hkv]: the largest key norm of each head over its pages 0 .. i */
	uint64_t stamp; /* the last batch call that named it (duplicate ids) */
	/* tokens 0 .. first - 1 released (whole pages, their entries in pages[] -1), and what the
	 * release assumed of later attends (allocated at the first release) */
	int64_t first;
	struct ape__kv_terms rel;
};

/* An attend's keys: virtual key rows [j0, j0 + n) are tokens [t0, t0 + n) of sequence s. */
struct ape__kvp_krun {
	int64_t j0, n, t0;
	const struct ape__kvp_seq *s;
};

/*
 * Where the pages lie in the two buffers: key row r of page p and kv head g starts at element
 * off + p * sp + g * sh + r * sr (off: koff in the keys' buffer, voff in the values'), its D
 * elements contiguous. The pool's own planes: 0, 0, P * D, nslots * D, D; a caller's pages
 * (ape_paged_kv, kvpaged.c) any layout ape__check_dtensor() accepts.
 */
struct ape__kvp_geom {
	int64_t koff, voff, sp, sh, sr;
};

struct ape_kv_pool {
	struct ape_device *dev;
	const struct ape_backend_plugin *ops;
	ape_kv_pool_options o; /* defaults resolved */
	int64_t P, npages, nslots;
	size_t esz;
	struct ape__devmem mem;
	struct ape_be_buf *k, *v; /* [Hkv, nslots, D] each; a caller's pages: theirs, for one run */
	struct ape__kvp_geom g;
	/* the caller's pages (ape_paged_kv): no page of its own, no append, no norm maxima; its
	 * sequences are the plan's (kvpaged.c) */
	bool ext;

	/* pages: references, the free list (doubly linked, -1 ends it), key-norm maxima */
	int32_t *ref;
	int64_t *fnext, *fprev, fhead, nfree;
	float *pnorm; /* [npages][Hkv]: largest key norm of each head in each page */
	int64_t copied; /* pages copied on write */

	/* sequences, by id (ids are never reused) */
	struct ape__kvp_seq *seq;
	int64_t nseq, seq_cap, live;
	uint64_t stamp;

	/* appends: two staging buffers on two queues, each queue's copies ordered after the
	 * other's (a freed page may be written again) */
	struct ape_be_queue *aq[2];
	struct ape__hostmem astage[2];
	bool apending[2];
	struct ape_be_event *alast[2];
	int anext;

	/* attends */
	struct ape__kv_session ks;
	struct ape__kv_loader loader;
	struct ape__kvp_krun *kr; /* this attend's key runs */
	int64_t nkr, kr_cap;
	struct ape_be_seg *segs; /* ... and its segments */
	struct ape_be_seg *full; /* the same segments uncut: the pairs visible */
	int64_t nsg, segs_cap;
	int64_t lk_total; /* the keys of all its key runs */
	/* the group of them the session runs now: key runs [cur_kr, cur_kr + cur_nkr), ragged
	 * launches or one dense problem */
	int64_t cur_kr, cur_nkr;
	bool cur_ragged;
	/* the table of the group read in place (struct ape_be_kv_pages.table), written to `tab`
	 * before its first launch: a group of one sequence's keys, its pages from its logical page
	 * tab_first on (none written when they lie in one run of slots); a group of several
	 * sequences, the slot of every key row (pages of one token); slots entries at most */
	struct ape_be_buf *tab;
	int64_t *tab_host, tab_first, tab_n;
	bool tab_pending;
	float *lse_stage; /* [H][max_batch_tokens] */
	float *diag_stage; /* entropy, then mean distance, each [H][max_batch_tokens] */
};

/* Element offset of token t of sequence s from its head's plane (struct ape__kvp_geom). */
static inline int64_t ape__kvp_elem(const struct ape_kv_pool *pl, const struct ape__kvp_seq *s,
				    int64_t t)
{
	return s->pages[t / pl->P] * pl->g.sp + t % pl->P * pl->g.sr;
}

/* Slot of token t of sequence s (the pool's own pages: its element offset / D). */
static inline int64_t ape__kvp_slot(const struct ape_kv_pool *pl, const struct ape__kvp_seq *s,
				    int64_t t)
{
	return s->pages[t / pl->P] * pl->P + t % pl->P;
}

/* Tokens from t on whose rows follow t's without a break (rows sr apart across its pages), at
 * most `most`, within the pages s holds. */
int64_t ape__kvp_contig(const struct ape_kv_pool *pl, const struct ape__kvp_seq *s, int64_t t,
			int64_t most);

/* Sequence `id`, or NULL (APE_EINVAL naming `what` and the value) when it is not live. */
struct ape__kvp_seq *ape__kvp_find(const struct ape_kv_pool *pl, const char *fn,
				   const char *what, int64_t id);

/* The ids and offsets of a batch call: nseq >= 0; ids live and distinct; `cu` (called cu_name
 * in messages) nseq + 1 offsets, non-decreasing, from 0 to `total` (called total_name). 0 or
 * APE_EINVAL naming the argument, index and value. */
int ape__kvp_check_batch(struct ape_kv_pool *pl, const char *fn, int64_t nseq,
			 const int64_t *seq_ids, const int64_t *cu, const char *cu_name,
			 int64_t total, const char *total_name);

/* The options of a pool: 0 or APE_EINVAL / APE_EOVERFLOW naming the field (opts->...) and its
 * value (kvpool.c). */
int ape__kvp_check_options(const char *fn, const ape_kv_pool_options *o);

/* Makes a pool of `size` bytes (a struct ape_kv_pool first) on dev from checked options: its
 * own pages, or (ext) a caller's (kvpaged.c: the page table, the session, no page, no append
 * staging). 0, or a negative code with the message set (nothing made, *out untouched). */
int ape__kvp_create(ape_device *dev, const char *fn, const ape_kv_pool_options *o, bool ext,
		    size_t size, struct ape_kv_pool **out);

/* Drops one reference to page p; the last returns it to the free list (kvpool.c). */
void ape__kvp_page_put(struct ape_kv_pool *pl, int64_t p);

/* The terms of every released sequence of an attend's batch kept by its rows (q, positions
 * pos_q or the default), params and skip_tol (kvpool_release.c): 0 or APE_EINVAL naming the
 * batch entry and the sequence. */
int ape__kvp_check_terms(const struct ape_kv_pool *pl, const char *fn,
			 const struct ape__problem *p, const ape_tensor *q, int64_t nseq,
			 const int64_t *seq_ids, const int64_t *cu, const int64_t *pos_q);

/* Sets pl->loader: the attends' key loader (kvpool_attend.c). */
void ape__kvp_loader(struct ape_kv_pool *pl);

/* Orders q after the appends still copying (struct ape__kv_loader.wait). */
int ape__kvp_wait(void *arg, struct ape_be_queue *q);

/*
 * What ape_kv_pool_attend() and ape_paged_kv_run() share (kvpool_attend.c). attend_problem:
 * desc, q, o and lse checked as an attend of the pool's shape (positions from the pool), and
 * the diagnostics' outputs dg (skip_tol tightened to their bound when wanted).
 * plan: the batch's segments and key runs (sequences seq_ids, rows by cu, positions pos_q),
 * each sequence's window cut when the pool has norm maxima and p and q are given (the pool's
 * own attends; a caller's pages have none). run: the planned batch, the pairs visible counted,
 * its groups run on the session. Each returns 0 or a negative code with the message set.
 */
int ape__kvp_attend_problem(struct ape_kv_pool *pl, const char *fn, const ape_attn_desc *desc,
			    const ape_tensor *q, const ape_tensor *o, const float *lse,
			    const struct ape__diag_req *dg, struct ape__problem *p);
int ape__kvp_plan(struct ape_kv_pool *pl, const char *fn, const struct ape__problem *p,
		  const ape_tensor *q, int64_t nseq, const int64_t *seq_ids, const int64_t *cu,
		  const int64_t *pos_q, double wtol);
int ape__kvp_run(struct ape_kv_pool *pl, const char *fn, struct ape__problem *p,
		 const ape_tensor *q, ape_tensor *o, float *lse, const struct ape__diag_req *dg,
		 ape_stats *stats, double t0);

/* The caller's pages (api/kvpaged.c): the object's device, and ape_paged_kv_run() with its
 * messages starting with fn (the DLPack call's), no statistics. */
struct ape_device *ape__paged_kv_device(const ape_paged_kv *pk);
int ape__paged_kv_run(ape_paged_kv *pk, const char *fn, const ape_attn_desc *desc,
		      const ape_dtensor *k_pages, const ape_dtensor *v_pages, const ape_tensor *q,
		      ape_tensor *o, float *lse);

#pragma GCC visibility pop
#endif
