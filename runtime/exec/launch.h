/* SPDX-License-Identifier: MIT */
/*
 * The one builder of attention launches (struct ape_be_launch, core/backend.h): the template every
 * chunk of a call starts from, and the launches the planner prices for their scratch memory.
 */
#ifndef APE_RUNTIME_LAUNCH_H
#define APE_RUNTIME_LAUNCH_H

#include "core/backend.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/*
 * A launch with p's shapes and parameters, output in `out_dtype`, and `skip_tol` when p allows
 * skipping (every head's decays >= 0; else 0); no rows (Lq = Lk = 0), no buffers, no positions.
 * A shell p (shapes only, rope_base 0, as when a KV cache prices its launches before any call)
 * gives a launch for scratch estimates: no rotation frequencies.
 */
void ape__launch_init(struct ape_be_launch *l, const struct ape__problem *p, ape_dtype out_dtype,
		      double skip_tol);

/*
 * Whether dev computes what p asks beyond the operation every backend computes (today: a
 * distance-bias table, APE_BE_CAP_BIAS_TABLE): 0, or APE_ENOTSUP with a message that starts
 * with fn and names the device and the argument. Every call that launches on a device asks.
 */
int ape__launch_supported(const char *fn, const struct ape_device *dev,
			  const struct ape__problem *p);

/* Bytes of one of a call's parameter tables (struct ape_be_launch.params): float64 (which 0) or
 * float32 (which 1), for D and H of p. */
uint64_t ape__params_bytes(const struct ape__problem *p, int which);
/* Fills table `which` of launch l's parameters (omega, then 4 per head) into host. */
void ape__params_fill(const struct ape_be_launch *l, int which, void *host);

/*
 * A ragged call's segments (segs[0 .. nseg-1], over the call's rows) as one launch of query
 * rows [o0, o0 + on) and key rows [i0, i0 + in) sees them: into out, the segments that hold
 * those rows, cut to them, with rows, keys and positions relative to the launch (a segment
 * with no key in the window keeps its rows, with lk 0). Returns how many (>= 1 for on >= 1);
 * out holds nseg at most.
 */
int64_t ape__segs_clip(const struct ape_be_seg *segs, int64_t nseg, int64_t o0, int64_t on,
		       int64_t i0, int64_t in, struct ape_be_seg *out);

/* The keys [*klo, *khi) the query rows [o0, o0 + on) of a ragged call see at all (an empty
 * range, *klo >= *khi, when none). */
void ape__segs_keys(const struct ape_be_seg *segs, int64_t nseg, int64_t o0, int64_t on,
		    int64_t *klo, int64_t *khi);

/* The visible pairs of segments sg[0 .. n-1] of p (p's heads and mask, each segment's
 * positions), all heads summed into *out; -1 when the count overflows 64 bits (not for a
 * validated batch). The ragged calls' (api/varlen.c, exec/backward.c) and the KV pool's
 * (api/kvpool_attend.c). */
int ape__segs_visible(const struct ape__problem *p, const struct ape_be_seg *sg, int64_t n,
		      uint64_t *out);

/* Backend scratch per launch: the backend's own figure, or a conservative estimate. */
uint64_t ape__scratch_of(struct ape_device *dev, const struct ape_be_launch *l);

#pragma GCC visibility pop
#endif
