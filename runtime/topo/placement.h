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
};

/*
 * `bytes` (> 0) of host memory for staging data to or from `dev`. Placement that cannot be done
 * (no topology, a topology of another machine, binding refused) is reported once per context and
 * gives a plain allocation: only APE_ENOMEM fails (message set). `m` is zeroed first, so
 * ape__host_free() may be called on it whatever happened.
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
/* Unpins and frees; accepts a zeroed or already freed `m`. */
void ape__host_free(struct ape_device *dev, struct ape__hostmem *m);

/*
 * Binds the calling thread to the local CPUs of `dev` when the context's policy is local, within
 * the affinity it already has (it is narrowed, never widened).
 * Returns 1 when bound, 0 when the policy or the machine says not to (the first refusal of the
 * system is reported once per context), APE_EINVAL for a NULL device.
 */
int ape__bind_thread(struct ape_device *dev);

#pragma GCC visibility pop
#endif
