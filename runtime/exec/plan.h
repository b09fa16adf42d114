/* SPDX-License-Identifier: MIT */
/*
 * Chunk planning under a device-memory budget: how many query and key rows per chunk, how many
 * chunks in flight, how many key/value chunks stay resident. Pure arithmetic on sizes, so that
 * tests can check every decision without a device.
 */
#ifndef APE_RUNTIME_PLAN_H
#define APE_RUNTIME_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* Default most rows per chunk in each direction. */
#define APE__CHUNK_DEFAULT 4096
/* Never more resident key/value chunks than this: the victim search is linear. */
#define APE__MAX_KV_SLOTS 1024
/* Chunks are halved down to this before the pipeline gives up depth. */
#define APE__CHUNK_PREFERRED_MIN 256

struct ape__plan_req {
	int64_t B, H, Hkv, Lq, Lk, D; /* Lq, Lk >= 1 */
	size_t esz; /* bytes per element of q, k, v */
	size_t out_esz; /* bytes per element of the caller's o */
	const char *dtype_name; /* for messages */
	bool pairs; /* per-row pair counts come back too */
	bool diag; /* per-row entropy and mean distance come back too (docs/diagnostics.md) */
	bool force_merge; /* partial outputs in float32 even when one key chunk covers Lk */
	int64_t max_cq, max_ck; /* >= 1 */
	int depth; /* 1..APE__MAX_DEPTH (core/limits.h) */
	uint64_t budget; /* bytes; UINT64_MAX: none */
	uint64_t max_buffer; /* largest single buffer; UINT64_MAX: none */
	int max_kv_slots; /* resident key/value chunks at most; 0: as many as fit */
	/* each query chunk keeps its diagonal launch's LSE on the device, for the skip bound of
	 * the launches after it (skipping allowed and the backend copies device to device) */
	bool prior;
	/* device scratch the backend allocates per launch of lq x lk rows (NULL: none) */
	uint64_t (*scratch)(void *arg, int64_t lq, int64_t lk);
	void *scratch_arg;
};

struct ape__plan {
	int64_t cq, ck; /* most rows per chunk */
	int64_t nq, nk; /* chunks along Lq and Lk */
	int depth; /* jobs in flight */
	int q_slots; /* query chunk buffers: 2 to load the next while the last computes */
	int kv_slots; /* key/value chunk buffer pairs, >= min(depth, nk) */
	bool merge; /* launches write float32 partial outputs that the host merges */
	uint64_t q_bytes; /* one query chunk */
	uint64_t kv_bytes; /* one key (or value) chunk */
	uint64_t out_bytes; /* one partial output: O, LSE and pair counts */
	uint64_t o_bytes, lse_bytes, pairs_bytes; /* its parts */
	uint64_t diag_bytes; /* each of the entropy and the mean distance (0: not planned) */
	uint64_t prior_bytes; /* per query chunk buffer: its diagonal LSE (0: none kept) */
	uint64_t scratch; /* the backend's scratch per launch */
	uint64_t fixed; /* everything but the key/value chunks */
	uint64_t peak; /* planned peak: fixed + kv_slots * 2 * kv_bytes, <= budget */
};

/*
 * Chooses chunk sizes, depth and resident slots so that the planned peak fits the budget,
 * keeping chunks large first (halving the larger one down to 256 rows), then lowering the
 * depth to 2, then halving down to one row, then depth 1. Returns 0, or APE_ENOMEM with the
 * message "<fn>: budget N bytes cannot hold one chunk of 1 query row and 1 key row (...):
 * that needs M bytes" when even that does not fit.
 */
int ape__plan_make(const struct ape__plan_req *r, const char *fn, struct ape__plan *p);

/* The sizes of one candidate (cq, ck, depth), without the resident-slot choice (kv_slots is
 * the minimum). Exposed for tests. */
void ape__plan_sizes(const struct ape__plan_req *r, int64_t cq, int64_t ck, int depth,
		     struct ape__plan *p);

#pragma GCC visibility pop
#endif
