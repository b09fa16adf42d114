/* SPDX-License-Identifier: MIT */
/*
 * What the two KV stores share (the KV cache, api/kvcache.h, and the KV pool, api/kvpool.h):
 * the attend session each makes at creation (a streaming executor session planned once for a
 * forward pass of the store's shape at its largest), its run on every attend with the store's
 * key loader, and the window proof that leaves a sequence's oldest keys out of an attend
 * unread under decay. The stores own where keys live; this file owns how an attend runs.
 */
#ifndef APE_RUNTIME_API_KV_SESSION_H
#define APE_RUNTIME_API_KV_SESSION_H

#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "exec/multidev.h"
#include "exec/problem.h"
#include "exec/skip.h"
#include "exec/stream.h"
#include "api/forward.h"

#pragma GCC visibility push(hidden)

#define APE__KV_DEPTH 2 /* key chunks in flight during an attend */

/* The options both stores share: Hkv >= 1, H a multiple of it (0: Hkv), D even in
 * 2..APE_MAX_D, a storage type, capacity in 1..2^40 tokens. 0 or APE_EINVAL naming the
 * option (opts->...) and its value. */
int ape__kv_check_shape(const char *fn, int64_t Hkv, int64_t H, int64_t D, ape_dtype dtype,
			int64_t capacity);

struct ape__kv_session {
	struct ape_device *dev;
	struct ape__stream *s;
	struct ape__stream_geom geom;
	struct ape__workq *wq;
	struct ape__kmax km; /* sized for the largest number of key chunks */
};

/*
 * Plans and makes ks on dev for attends of at most `shape->Lq` query rows over at most
 * `shape->Lk` keys (shape: B, H, Hkv, D, Lq, Lk, in_dtype; the rest unused), key chunks of at
 * most max_ci rows, the session holding at most `budget` bytes (UINT64_MAX: no limit).
 * Returns 0, or a negative code with a message starting with fn (ks then partly made: free it
 * with ape__kv_session_free()).
 */
int ape__kv_session_make(struct ape__kv_session *ks, struct ape_device *dev, const char *fn,
			 const struct ape__problem *shape, int64_t max_ci, uint64_t budget);
/* Frees what make made. Accepts a zeroed or partly made session. */
void ape__kv_session_free(struct ape__kv_session *ks);

/* One attend on a session. */
struct ape__kv_run {
	const struct ape__problem *p; /* validated; Lq <= the plan's, Lk >= 1 */
	const ape_tensor *q;
	ape_tensor *o; /* through p->os */
	float *lse; /* [B, H, Lq] or NULL */
	const struct ape__diag_req *dg;
	bool want_pairs; /* count the pairs computed */
	bool release; /* the store may release blocks afterwards: a share of skip_tol is kept */
	const struct ape__kv_loader *loader; /* the store's keys */
	/* NULL, or the largest key norm of every (batch, kv head) and key chunk of ck rows
	 * (km->pre[bg * nk + ch]), for chunk-level skipping; the session scans them */
	void (*chunk_norms)(void *arg, struct ape__kmax *km, int64_t ck, int64_t nk);
	void *norms_arg;
};

/* Runs r on ks: its query rows in chunks of the plan, its key chunks loaded by the loader (or
 * read where they lie), partial results merged by LSE. Adds to *res (its plan fields too).
 * Returns 0 or a negative code with the message set, starting with fn. */
int ape__kv_session_run(struct ape__kv_session *ks, const char *fn, const struct ape__kv_run *r,
			struct ape__exec_result *res);

/*
 * A sequence's keys as the window proof sees them: tokens first .. t_end - 1 (counted from the
 * sequence's token 0, at position k_start), in blocks of bt tokens, block lb's largest key norm
 * of each of the nbg = B * Hkv (batch, kv head) pairs at norms(arg, lb)[bg] (a bound for any
 * part of the block).
 */
struct ape__kv_keys {
	int64_t first, t_end, k_start, bt, nbg;
	const float *(*norms)(const void *arg, int64_t lb);
	/* NULL, or the running maxima: prefix(arg, lb)[bg] is the largest of norms(arg, b)[bg]
	 * over blocks first / bt .. lb (then the cut is found by bisection: O(log blocks)) */
	const float *(*prefix)(const void *arg, int64_t lb);
	const void *arg;
};

/*
 * How many of the oldest keys (from kk->first) an attend of query rows [q0, q0 + lq) of q (all
 * B batches, p's heads and parameters), the earliest at position q_start, may leave out unread,
 * their weight proved at most `tol` times the weight of one key each row computes
 * (docs/streaming.md, "The KV cache"). 0 when nothing is provable (no decay, tol 0, queries
 * before the keys). O(blocks), or O(log blocks) with kk->prefix.
 */
int64_t ape__kv_window_cut(const struct ape__kv_keys *kk, const struct ape__problem *p,
			   const ape_tensor *q, int64_t q0, int64_t lq, int64_t q_start, double tol);

/*
 * Releasing a sequence's oldest keys for good (kv_release.c; the KV cache's blocks, the KV
 * pool's pages): the proof that no later query can give them weight, and the terms every later
 * attend must keep for the proof to hold (the positions, parameters, skip_tol and query norms it
 * assumed). One set of terms per released sequence (the cache's batch shares one).
 */
struct ape__kv_terms {
	bool released;
	int64_t q_floor; /* later rows at positions >= q_floor */
	float *delta, *lambda; /* [H]: later delta >= and lambda >= these (beta, gamma >= 0) */
	double scale, tol; /* later |scale| <= scale, skip_tol >= tol */
	float *kmax; /* [nbg]: the largest key norm of everything released */
};

/* Allocates t's arrays for H heads and nbg (batch, kv head) pairs, nothing released; 0 or
 * APE_ENOMEM (message naming fn). */
int ape__kv_terms_init(struct ape__kv_terms *t, const char *fn, int64_t H, int64_t nbg);
void ape__kv_terms_free(struct ape__kv_terms *t);
/* dst (made by init for the same H, nbg) becomes src. */
void ape__kv_terms_copy(struct ape__kv_terms *dst, const struct ape__kv_terms *src, int64_t H,
			int64_t nbg);

/*
 * Releases whole blocks of bt tokens from block lb_first on (tokens counted from the
 * sequence's token 0), oldest first, while the proof holds for every later query at a position
 * >= q_floor with |q| <= max_qnorm and p's parameters (B batches, Hkv kv heads): the released
 * prefix at most `tol` times the weight of the reference key t_ref (the newest key at or
 * before q_floor; blocks wholly before it only). norms(arg, lb) gives block lb's largest key
 * norm per (batch, kv head). Returns the blocks released (0 when nothing is provable: no
 * decay, tol 0); with any, t's terms become p's (positions from q_floor on). Never fails.
 */
int64_t ape__kv_release(struct ape__kv_terms *t, const struct ape__problem *p, int64_t B,
			int64_t Hkv, int64_t lb_first, int64_t bt, int64_t k_start, int64_t t_ref,
			int64_t q_floor, const float *(*norms)(const void *arg, int64_t lb),
			const void *arg, double tol, double max_qnorm);

/*
 * Whether an attend keeps t's terms: its rows [q0, q0 + lq) of q (all B batches), the earliest
 * at position q_min, p's parameters and skip_tol, every row's norm <= max_qnorm. 0, or
 * APE_EINVAL naming what breaks them, `where` (may be "") appended to the message.
 */
int ape__kv_terms_check(const struct ape__kv_terms *t, const char *fn, const char *where,
			const struct ape__problem *p, const ape_tensor *q, const int64_t qs[4],
			int64_t q0, int64_t lq, int64_t q_min, double max_qnorm);

#pragma GCC visibility pop
#endif
