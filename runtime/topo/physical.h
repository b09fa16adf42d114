/* SPDX-License-Identifier: MIT */
/* The physical device list of a context: built once, from the backends' devices, DRM and hwloc. */
#ifndef APE_RUNTIME_PHYSICAL_H
#define APE_RUNTIME_PHYSICAL_H

#include "core/context.h"

#pragma GCC visibility push(hidden)

/* Options ape_context_create() resolved from its argument and the environment. */
struct ape__ctx_setup {
	const char *topology_xml;
	ape_numa_policy numa; /* resolved: never APE_NUMA_DEFAULT */
	const char *numa_from; /* "APE_NUMA", "ape_context_options.numa" or "default" */
	const char *visible; /* NULL or "": every device */
	const char *visible_from; /* "APE_VISIBLE_DEVICES" or "ape_context_options.visible_devices" */
};

/* Builds the topology and the physical list of a context whose backends are probed and whose
 * devices are sorted (runtime/topo/physical.c). Returns 0 or a negative code with the message set. */
int ape__physical_build(struct ape_context *ctx, const struct ape__ctx_setup *setup);
/* Releases what ape__physical_build() made. Accepts a context it never ran on. */
void ape__physical_free(struct ape_context *ctx);

#pragma GCC visibility pop
#endif
