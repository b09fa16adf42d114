/* SPDX-License-Identifier: MIT */
/*
 * The public getters of a context's machine: physical devices, the links between them, NUMA
 * nodes. The list is built once in ape_context_create() (topo/physical.c) and read-only
 * afterwards, so they need no lock.
 */
#include "core/context.h"
#include "core/error.h"
#include "core/verbose.h"
#include "topo/numa.h"
#include "topo/topology.h"

int ape_physical_get_info(const ape_context *ctx, int index, ape_physical_info *info)
{
	APE__API_CALL("ape_physical_get_info");
	if (!ctx)
		return ape__error(APE_EINVAL, "ape_physical_get_info: ctx = NULL");
	if (!info)
		return ctx->nphys;
	if (index < 0 || index >= ctx->nphys)
		return ape__error(APE_EINVAL, "ape_physical_get_info: index = %d: out of range 0..%d",
				  index, ctx->nphys - 1);
	*info = ctx->phys[index].info;
	return 0;
}

int ape_physical_link(const ape_context *ctx, int a, int b)
{
	APE__API_CALL("ape_physical_link");
	const struct ape__phys *pa, *pb;

	if (!ctx)
		return ape__error(APE_EINVAL, "ape_physical_link: ctx = NULL");
	if (a < 0 || a >= ctx->nphys || b < 0 || b >= ctx->nphys)
		return ape__error(APE_EINVAL, "ape_physical_link: a = %d, b = %d: out of range 0..%d",
				  a, b, ctx->nphys - 1);
	if (a == b)
		return APE_LINK_SELF;
	pa = &ctx->phys[a];
	pb = &ctx->phys[b];
	if (!ctx->numa || !pa->has_pci || !pb->has_pci)
		return APE_LINK_UNKNOWN;
	return ape__numa_pci_link(ctx->numa, &pa->pci, &pb->pci);
}

int ape_topology_get_info(const ape_context *ctx, ape_topology_info *info)
{
	APE__API_CALL("ape_topology_get_info");
	if (!ctx)
		return ape__error(APE_EINVAL, "ape_topology_get_info: ctx = NULL");
	if (!info)
		return ape__error(APE_EINVAL, "ape_topology_get_info: info = NULL");
	*info = ctx->topo;
	return 0;
}

int ape_numa_get_info(const ape_context *ctx, int index, ape_numa_info *info)
{
	APE__API_CALL("ape_numa_get_info");
	int n;

	if (!ctx)
		return ape__error(APE_EINVAL, "ape_numa_get_info: ctx = NULL");
	n = ctx->topo.numa_nodes;
	if (!info)
		return n;
	if (index < 0 || index >= n || ape__numa_node(ctx->numa, index, info))
		return ape__error(APE_EINVAL, "ape_numa_get_info: index = %d: out of range 0..%d",
				  index, n - 1);
	return 0;
}

int ape_numa_distance(const ape_context *ctx, int from, int to)
{
	APE__API_CALL("ape_numa_distance");
	int d;

	if (!ctx)
		return ape__error(APE_EINVAL, "ape_numa_distance: ctx = NULL");
	d = ctx->numa ? ape__numa_distance(ctx->numa, from, to) : -1;
	if (d < 0)
		return ape__error(APE_EINVAL, "ape_numa_distance: from = %d, to = %d: no such NUMA "
				  "node", from, to);
	return d;
}
