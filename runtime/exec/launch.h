/* SPDX-License-Identifier: MIT */
/*
 * The one builder of attention launches (struct ape__launch, core/backend.h): the template every
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
void ape__launch_init(struct ape__launch *l, const struct ape__problem *p, ape_dtype out_dtype,
		      double skip_tol);

/* Bytes of one of a call's parameter tables (struct ape__launch.params): float64 (which 0) or
 * float32 (which 1), for D and H of p. */
uint64_t ape__params_bytes(const struct ape__problem *p, int which);
/* Fills table `which` of launch l's parameters (omega, then 4 per head) into host. */
void ape__params_fill(const struct ape__launch *l, int which, void *host);

/* Backend scratch per launch: the backend's own figure, or a conservative estimate. */
uint64_t ape__scratch_of(struct ape_device *dev, const struct ape__launch *l);

#pragma GCC visibility pop
#endif
