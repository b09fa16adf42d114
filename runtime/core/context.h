/* SPDX-License-Identifier: MIT */
/*
 * The context object every layer reads: its backends, its ordered device list and the topology.
 * api/context.c creates and destroys it; topo/physical.c builds its topology part; after
 * ape_context_create() returns, it is read-only but for the atomics and the staging cache
 * (which has its own lock).
 */
#ifndef APE_RUNTIME_CONTEXT_H
#define APE_RUNTIME_CONTEXT_H

#include <stdatomic.h>

#include "core/backend.h"

#pragma GCC visibility push(hidden)

/* Backends one context loads: the built-in ones, then the plugins (api/plugins.c). */
#define APE__MAX_BACKENDS 16

struct ape__numa;
struct ape__phys;
struct ape__staging_cache;
struct ape__plugin;

struct ape__ctx_backend {
	struct ape_backend be;
	bool probed; /* probe ran: teardown is owed */
	struct ape_backend_info info;
};

struct ape_context {
	unsigned flags; /* APE_CONTEXT_* */
	int verbose; /* the call log's level for this context's calls (core/verbose.h) */
	int nbackends;
	struct ape__ctx_backend backends[APE__MAX_BACKENDS];
	int ndevices, cap;
	struct ape_device **devices; /* sorted by rank, then probe order */
	/* The plugins found (runtime/api/plugins.c), loaded or not, in the order found; those
	 * loaded hold their shared object open until the context is destroyed. */
	int nplugins;
	struct ape__plugin *plugins;

	/* The topology (runtime/topo/physical.c): read-only once ape_context_create() returns. */
	struct ape__numa *numa; /* NULL when hwloc could not read the machine */
	ape_numa_policy numa_policy; /* in effect: LOCAL, INTERLEAVE or OFF */
	bool elsewhere; /* describes another machine (topology XML): nothing is ever bound */
	int nphys;
	struct ape__phys *phys; /* the physical list */
	ape_topology_info topo;

	/* "Says so once": one warning per context and kind, from whichever thread gets there. */
	atomic_bool warned_placement, warned_binding, warned_pinning;
	/* Staging buffers placed as the policy says, and plain ones (read by tests): counted each
	 * time one is handed out, fresh or from the cache. */
	atomic_uint_fast64_t staging_placed, staging_plain;
	/* Staging buffers given back, kept for the next call (topo/placement.c; its own lock):
	 * NULL until ape__physical_build() made it. */
	struct ape__staging_cache *staging;
};

/* The device's speed in earlier streamed calls: visible pairs per second, as an exponential
 * average (runtime/exec/multidev.c weighs multi-device splits by it); 0 until measured. */
atomic_uint_fast64_t *ape__device_pairs_per_s(struct ape_device *dev);

/* Releases a device (the backend's device_release, then the core's memory). Accepts NULL. */
void ape__device_free(struct ape_device *dev);

/* Sorts the devices by rank (higher first), then probe order, and numbers them. */
void ape__context_sort_devices(struct ape_context *ctx);

/* Removes the logical devices drop[] marks (indexed by ape_device_list() position), releasing
 * them, and renumbers the rest; new_index[old] receives each device's new position (-1 when
 * dropped). Backends left without a device become unavailable, with `why` as the reason. */
void ape__context_drop_devices(struct ape_context *ctx, const bool *drop, int *new_index,
			       const char *why);

/* The call log's level of calls on dev (its context's). */
static inline int ape__dev_verbose(const struct ape_device *dev)
{
	return dev && dev->be && dev->be->ctx ? dev->be->ctx->verbose : 0;
}

/* Prints a warning unless this context already printed one of this kind. */
void ape__warn_once(atomic_bool *flag, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#pragma GCC visibility pop
#endif
