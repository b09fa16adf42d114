/* SPDX-License-Identifier: MIT */
/*
 * The one chunk planner: how many rows per chunk along each axis of a pass, how many chunks in
 * flight, how many inner chunks stay resident, under a device-memory budget. Every executor
 * path plans with it: the streamed forward and backward passes (exec/pass.h), the device-
 * resident calls (exec/resident.c, exec/resident_bwd.c) and the KV cache's attend session.
 * Pure arithmetic on sizes, so that tests check every decision without a device.
 *
 * A pass runs a grid of launches over two row axes: the outer axis, whose chunks a device takes
 * one at a time (query rows in the forward pass, key rows in the backward), and the inner axis
 * each outer chunk walks (key rows in the forward, query rows in the backward). What the device
 * holds at once:
 *
 *   o_slots x outer slot      (an outer chunk's inputs and accumulators; 2 when there is a
 *                              next outer chunk to load while the last computes)
 * + min(depth, jobs) x job    (a launch's own outputs and inputs, and the backend's scratch)
 * + i_slots x inner slot      (an inner chunk's inputs; at least min(depth, ni) of them, more
 *                              while the budget allows: resident for later outer chunks)
 * + call                      (accumulators of the whole run: the backward's parameter sums)
 *
 * Large chunks keep kernels efficient, depth hides copies, resident inner chunks save copies;
 * the budget is spent in that order.
 */
#ifndef APE_RUNTIME_PLAN_H
#define APE_RUNTIME_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* Default most rows per chunk along each axis. */
#define APE__CHUNK_DEFAULT 4096
/* Never more resident inner chunks than this: the victim search is linear. */
#define APE__MAX_KV_SLOTS 1024
/* Chunks are halved down to this before the pipeline gives up depth. */
#define APE__CHUNK_PREFERRED_MIN 256

/* Device bytes of a candidate chunking, as the pass counts them (in-place tensors count 0). */
struct ape__plan_bytes {
	uint64_t outer; /* one outer slot */
	uint64_t inner; /* one inner slot */
	uint64_t job; /* one job, without the backend's scratch */
	uint64_t call; /* the run's accumulators */
	uint64_t largest; /* the largest single buffer of any of them */
};

struct ape__plan_req {
	int64_t Lo, Li; /* rows along the outer and the inner axis, >= 1 */
	int64_t max_co, max_ci; /* >= 1 */
	bool inner_whole; /* every launch sees all Li inner rows (resident calls): only co shrinks */
	int depth; /* 1..APE__MAX_DEPTH (core/limits.h) */
	uint64_t budget; /* bytes; UINT64_MAX: none */
	uint64_t max_buffer; /* largest single buffer; UINT64_MAX: none */
	int max_inner_slots; /* resident inner chunks at most; 0: as many as fit */
	/* what a candidate holds: chunks of co outer and ci inner rows, no x ni of them */
	void (*bytes)(void *arg, int64_t co, int64_t ci, int64_t no, int64_t ni,
		      struct ape__plan_bytes *b);
	/* device scratch the backend allocates per launch of co x ci rows (NULL: none) */
	uint64_t (*scratch)(void *arg, int64_t co, int64_t ci);
	void *arg; /* of both */
	const char *what; /* the problem, for messages: "B=1, H=4, Hkv=2, D=64, f32" */
	const char *chunk; /* "one chunk", "the backward pass's chunk": what the message names */
	bool outer_is_key; /* the outer axis is the key rows (the messages say query rows first) */
};

struct ape__plan {
	int64_t co, ci; /* most rows per chunk */
	int64_t no, ni; /* chunks along each axis */
	int depth; /* jobs in flight */
	int o_slots; /* outer slots */
	int i_slots; /* inner slots, >= min(depth, ni) */
	struct ape__plan_bytes b; /* of the chosen chunking */
	uint64_t scratch; /* the backend's scratch per launch */
	uint64_t fixed; /* everything but the inner slots */
	uint64_t peak; /* planned peak: fixed + i_slots x inner, <= budget */
};

/*
 * Chooses chunk sizes, depth and resident slots so that the planned peak fits the budget,
 * keeping chunks large first (halving the larger one down to 256 rows), then lowering the
 * depth to 2, then halving down to one row, then depth 1. Returns 0, or APE_ENOMEM with the
 * message "<fn>: budget N bytes cannot hold one chunk of 1 query row and 1 key row (<what>):
 * that needs M bytes" (or the largest-buffer variant) when even that does not fit.
 */
int ape__plan_make(const struct ape__plan_req *r, const char *fn, struct ape__plan *p);

/* The sizes of one candidate (co, ci, depth), without the resident-slot choice (i_slots is the
 * minimum). Exposed for tests. */
void ape__plan_sizes(const struct ape__plan_req *r, int64_t co, int64_t ci, int depth,
		     struct ape__plan *p);

/* Saturating arithmetic for byte counts: UINT64_MAX stands for "too much". */
static inline uint64_t ape__sat_mul(uint64_t a, uint64_t b)
{
	uint64_t r;

	return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static inline uint64_t ape__sat_add(uint64_t a, uint64_t b)
{
	uint64_t r;

	return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

#pragma GCC visibility pop
#endif
