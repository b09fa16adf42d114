/* SPDX-License-Identifier: MIT */
/*
 * Placement of what feeds a device: host staging buffers allocated on the device's NUMA node under the
 * context's policy and pinned through the backend when it can, and the binding of the threads
 * that fill them to the device's local CPUs.
 */
#ifndef APE_RUNTIME_PLACEMENT_H
#define APE_RUNTIME_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>

#include "core/backend.h"

#pragma GCC visibility push(hidden)

struct ape__hostmem {
	void *ptr; /* NULL when nothing is allocated */
	size_t bytes;
	/* how it was placed: APE_NUMA_LOCAL (bound to the device's node), APE_NUMA_INTERLEAVE, or
	 * APE_NUMA_OFF (a plain allocation) */
	ape_numa_policy placed;
	char nodes[64]; /* the nodes it is bound to or spread over; "" when plain */
	bool hwloc; /* freed through hwloc (placed), else free() */
	void *pin; /* the backend's host_register handle, NULL when not pinned */
	bool cacheable; /* from ape__host_alloc(): ape__host_free() may keep it for the next */
};

/*
 * `bytes` (> 0) of host memory for staging data to or from `dev`. Placement that cannot be done
 * (no topology, a topology of another machine, binding refused) is reported once per context and
 * gives a plain allocation: only APE_ENOMEM fails (message set). `m` is zeroed first, so
 * ape__host_free() may be called on it whatever happened. m->bytes may exceed `bytes`: the
 * buffer may come from the context's staging cache, placed and pinned as before, holding what
 * its last user left (never zeroed).
 */
int ape__host_alloc(struct ape_device *dev, size_t bytes, struct ape__hostmem *m);
/*
 * The same, placed exactly as asked (`policy` APE_NUMA_LOCAL or APE_NUMA_INTERLEAVE over
 * `nodes`) or not at all: APE_ENOTSUP when this context cannot place memory (no topology, or
 * another machine's), else the system's refusal as a negative code (-EPERM, -EXDEV, ...) or
 * APE_ENOMEM. No message, no warning: the caller decides what to say.
 */
int ape__host_alloc_placed(struct ape_device *dev, size_t bytes, ape_numa_policy policy,
			   const char *nodes, struct ape__hostmem *m);
/*
 * Unpins and frees, or keeps a buffer of ape__host_alloc() of at most APE__STAGING_CACHE_MAX
 * bytes in the context's staging cache for the next call on the same device (a call of a few
 * milliseconds otherwise pays a mapping, its page faults and the unmapping's TLB shootdown,
 * and a pinning on devices that pin, for its few KiB of tables; bench/RESULTS.md). Accepts a
 * zeroed or already freed `m`; zeroes it.
 */
void ape__host_free(struct ape_device *dev, struct ape__hostmem *m);

/* The staging cache: at most APE__STAGING_CACHE_SLOTS buffers of at most
 * APE__STAGING_CACHE_MAX bytes each, per context. */
#define APE__STAGING_CACHE_SLOTS 8
#define APE__STAGING_CACHE_MAX ((size_t)4 << 20)

/* Makes the context's empty staging cache (ape__physical_build): 0 or APE_ENOMEM. */
int ape__staging_cache_create(struct ape_context *ctx);
/* What the cache keeps now: the number of buffers (and, in *bytes when not NULL, their sum).
 * For tests and the call log. */
int ape__staging_cache_held(struct ape_context *ctx, size_t *bytes);
/* Frees every buffer the cache keeps, and the cache; before the devices and the topology go
 * (ape__physical_free). Accepts a context without one. */
void ape__staging_cache_destroy(struct ape_context *ctx);

/*
 * Binds the calling thread to the local CPUs of `dev` when the context's policy is local, within
 * the affinity it already has (it is narrowed, never widened).
 * Returns 1 when bound, 0 when the policy or the machine says not to (the first refusal of the
 * system is reported once per context), APE_EINVAL for a NULL device.
 */
int ape__bind_thread(struct ape_device *dev);

#pragma GCC visibility pop
#endif
