/* SPDX-License-Identifier: MIT */
#ifndef APE_RUNTIME_CONTEXT_H
#define APE_RUNTIME_CONTEXT_H

#include <stdatomic.h>

#include "backend.h"

#pragma GCC visibility push(hidden)

#define APE__MAX_BACKENDS 8

struct ape__numa;
struct ape__phys;

struct ape__ctx_backend {
	struct ape__backend be;
	bool probed; /* probe ran: teardown is owed */
	struct ape_backend_info info;
};

struct ape_context {
	unsigned flags; /* APE_CONTEXT_* */
	int nbackends;
	struct ape__ctx_backend backends[APE__MAX_BACKENDS];
	int ndevices, cap;
	struct ape_device **devices; /* sorted by rank, then probe order */

	/* The topology (runtime/physical.c): read-only once ape_context_create() returns. */
	struct ape__numa *numa; /* NULL when hwloc could not read the machine */
	ape_numa_policy numa_policy; /* in effect: LOCAL, INTERLEAVE or OFF */
	bool elsewhere; /* describes another machine (topology XML): nothing is ever bound */
	int nphys;
	struct ape__phys *phys; /* the physical list */
	ape_topology_info topo;

	/* "Says so once": one warning per context and kind, from whichever thread gets there. */
	atomic_bool warned_placement, warned_binding, warned_pinning;
	/* Staging buffers placed as the policy says, and plain ones (read by tests). */
	atomic_uint_fast64_t staging_placed, staging_plain;
};

/* Options ape_context_create() resolved from its argument and the environment. */
struct ape__ctx_setup {
	const char *topology_xml;
	ape_numa_policy numa; /* resolved: never APE_NUMA_DEFAULT */
	const char *numa_from; /* "APE_NUMA", "ape_context_options.numa" or "default" */
	const char *visible; /* NULL or "": every device */
	const char *visible_from; /* "APE_VISIBLE_DEVICES" or "ape_context_options.visible_devices" */
};

/* Builds the topology and the physical list of a context whose backends are probed and whose
 * devices are sorted (runtime/physical.c). Returns 0 or a negative code with the message set. */
int ape__physical_build(struct ape_context *ctx, const struct ape__ctx_setup *setup);
/* Releases what ape__physical_build() made. Accepts a context it never ran on. */
void ape__physical_free(struct ape_context *ctx);

/* Removes the logical devices drop[] marks (indexed by ape_device_list() position), releasing
 * them, and renumbers the rest; new_index[old] receives each device's new position (-1 when
 * dropped). Backends left without a device become unavailable, with `why` as the reason. */
void ape__context_drop_devices(struct ape_context *ctx, const bool *drop, int *new_index,
			       const char *why);

/* Prints a warning unless this context already printed one of this kind. */
void ape__warn_once(atomic_bool *flag, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#pragma GCC visibility pop
#endif
