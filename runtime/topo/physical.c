/* SPDX-License-Identifier: MIT */
/*
 * A context's physical device list: collect what the backends, DRM and hwloc's PCI scan see,
 * merge it (topology.c), apply the visible-devices filter, then place every device on its NUMA
 * node(s). Built once in ape_context_create() and read-only afterwards, so the getters need no
 * lock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "topo/physical.h"
#include "core/alloc.h"
#include "topo/drm_devices.h"
#include "core/error.h"
#include "topo/numa.h"
#include "topo/placement.h"
#include "topo/topology.h"

static const char fn_create[] = "ape_context_create";

static unsigned api_of_backend(const char *name)
{
	if (!strcmp(name, "cuda"))
		return APE_API_CUDA;
	if (!strcmp(name, "opencl"))
		return APE_API_OPENCL;
	if (!strcmp(name, "ref"))
		return APE_API_HOST;
	return 0;
}

static void sighting_of_device(const struct ape_device *d, struct ape__sighting *s)
{
	const ape_device_info *in = &d->info;

	memset(s, 0, sizeof(*s));
	s->api = api_of_backend(in->backend);
	snprintf(s->pci_address, sizeof(s->pci_address), "%s", in->pci_address);
	s->kind = in->kind;
	snprintf(s->name, sizeof(s->name), "%s", in->name);
	snprintf(s->vendor, sizeof(s->vendor), "%s", in->vendor);
	s->memory_bytes = in->global_mem_bytes;
	s->compute_units = in->compute_units;
	s->device_index = in->index;
	snprintf(s->backend, sizeof(s->backend), "%s", in->backend);
	s->plugin = s->api == 0;
}

/*
 * Every sighting: the logical devices first (so `where` maps them by their index), then DRM,
 * then the bus scan. A context describing another machine takes nothing from this one.
 */
static int collect(struct ape_context *ctx, struct ape__sighting **out, int *n)
{
	struct ape__sighting *s, *drm = NULL, *bus = NULL;
	int ndrm = 0, nbus = 0, m = 0;

	*out = NULL;
	*n = 0;
	if (!ctx->elsewhere) {
		ndrm = ape__drm_scan(&drm, ctx->topo.drm_note, sizeof(ctx->topo.drm_note));
		if (ndrm < 0)
			return ndrm;
	} else {
		snprintf(ctx->topo.drm_note, sizeof(ctx->topo.drm_note),
			 "not scanned: the context describes %s", ape__numa_source(ctx->numa));
	}
	if (ctx->numa && (nbus = ape__numa_pci_scan(ctx->numa, &bus)) < 0) {
		free(drm);
		return nbus;
	}
	s = ape__calloc((size_t)(ctx->ndevices + ndrm + nbus) + 1, sizeof(*s));
	if (!s) {
		free(drm);
		free(bus);
		return ape__error(APE_ENOMEM, "out of memory listing devices");
	}
	for (int i = 0; !ctx->elsewhere && i < ctx->ndevices; i++)
		sighting_of_device(ctx->devices[i], &s[m++]);
	for (int i = 0; i < ndrm; i++)
		s[m++] = drm[i];
	for (int i = 0; i < nbus; i++)
		s[m++] = bus[i];
	free(drm);
	free(bus);
	*out = s;
	*n = m;
	return 0;
}

static int merge(struct ape_context *ctx, const struct ape__sighting *s, int n, int *where)
{
	ape_backend_info bi[APE__MAX_BACKENDS];
	struct ape__merge_input in;
	char elsewhere[320];

	for (int i = 0; i < ctx->nbackends; i++)
		bi[i] = ctx->backends[i].info;
	snprintf(elsewhere, sizeof(elsewhere), "described by %s: not on this machine",
		 ape__numa_source(ctx->numa));
	memset(&in, 0, sizeof(in));
	in.sightings = s;
	in.count = n;
	in.backends = bi;
	in.nbackends = ctx->nbackends;
	in.elsewhere = ctx->elsewhere ? elsewhere : NULL;
	return ape__topology_merge(&in, &ctx->phys, &ctx->nphys, where);
}

/* Hides what the visible-devices list leaves out: physical entries and their logical devices. */
static int apply_visible(struct ape_context *ctx, const struct ape__ctx_setup *su, int *where)
{
	bool *keep, *drop;
	int *new_index, ret;
	char why[96];

	if (!su->visible || !*su->visible)
		return 0;
	snprintf(ctx->topo.visible_devices, sizeof(ctx->topo.visible_devices), "%s = \"%.200s\"",
		 su->visible_from, su->visible);
	keep = ape__calloc((size_t)ctx->nphys + 1, sizeof(*keep));
	drop = ape__calloc((size_t)ctx->ndevices + 1, sizeof(*drop));
	new_index = ape__calloc((size_t)ctx->ndevices + 1, sizeof(*new_index));
	if (!keep || !drop || !new_index) {
		ret = ape__error(APE_ENOMEM, "out of memory");
		goto out_free;
	}
	ret = ape__topology_visible(ctx->phys, ctx->nphys, su->visible, fn_create,
				    su->visible_from, keep);
	if (ret)
		goto out_free;
	/* logical devices come first among the sightings: where[i] is device i's entry */
	for (int i = 0; !ctx->elsewhere && i < ctx->ndevices; i++)
		drop[i] = where[i] >= 0 && !keep[where[i]];
	snprintf(why, sizeof(why), "every device it found is hidden by %s", su->visible_from);
	ape__context_drop_devices(ctx, drop, new_index, why);
	for (int i = 0; i < ctx->nphys; i++) {
		struct ape__phys *p = &ctx->phys[i];

		for (int k = 0; k < APE__API_SLOTS; k++)
			if (p->logical[k] >= 0)
				p->logical[k] = new_index[p->logical[k]];
		if (p->info.device_index >= 0)
			p->info.device_index = new_index[p->info.device_index];
	}
	ctx->nphys = ape__topology_compact(ctx->phys, ctx->nphys, keep);
out_free:
	free(keep);
	free(drop);
	free(new_index);
	return ret;
}

/* The nodes and CPUs one entry is local to; "" when unknown. */
static void locality(struct ape_context *ctx, struct ape__phys *p, const char *all_nodes,
		     const char *all_cpus)
{
	ape_physical_info *in = &p->info;

	in->numa_nodes[0] = in->cpuset[0] = '\0';
	if (!ctx->numa)
		return;
	if (p->has_pci) {
		ape__numa_pci_locality(ctx->numa, &p->pci, in->numa_nodes, sizeof(in->numa_nodes),
				       in->cpuset, sizeof(in->cpuset));
	} else if (in->kind == APE_DEVICE_CPU || in->kind == APE_DEVICE_HOST_REFERENCE) {
		/* the CPU device runs on every CPU the process may use, the reference on the
		 * caller's thread, which may be anywhere */
		snprintf(in->numa_nodes, sizeof(in->numa_nodes), "%s", all_nodes);
		snprintf(in->cpuset, sizeof(in->cpuset), "%s", all_cpus);
	}
	if (!in->numa_nodes[0] && ape__list_count(all_nodes) == 1) {
		/* one node: every device is local to it, whatever else is unknown */
		snprintf(in->numa_nodes, sizeof(in->numa_nodes), "%s", all_nodes);
		if (!in->cpuset[0])
			snprintf(in->cpuset, sizeof(in->cpuset), "%s", all_cpus);
	}
}

static void place(struct ape_context *ctx)
{
	char all_nodes[64] = "", all_cpus[256] = "";

	if (ctx->numa)
		ape__numa_all(ctx->numa, all_nodes, sizeof(all_nodes), all_cpus, sizeof(all_cpus));
	for (int i = 0; i < ctx->nphys; i++) {
		struct ape__phys *p = &ctx->phys[i];
		struct ape__staging st;

		locality(ctx, p, all_nodes, all_cpus);
		p->info.numa_node = ape__list_count(p->info.numa_nodes) == 1
					    ? ape__list_first(p->info.numa_nodes)
					    : -1;
		ape__staging_decide(ctx->numa_policy, p->info.numa_nodes, all_nodes, &st, NULL, 0);
		p->info.staging_policy = st.policy;
		snprintf(p->info.staging_nodes, sizeof(p->info.staging_nodes), "%s", st.nodes);
	}
}

/* Each logical device learns its physical device and placement. */
static void link_devices(struct ape_context *ctx)
{
	for (int i = 0; i < ctx->ndevices; i++) {
		ape_device_info *d = &ctx->devices[i]->info;

		d->physical_index = -1;
		d->numa_node = -1;
		d->cpuset[0] = '\0';
	}
	if (ctx->elsewhere)
		return;
	for (int i = 0; i < ctx->ndevices; i++) {
		ape_device_info *d = &ctx->devices[i]->info;
		int e = -1;

		/* after the filter, find the entry by what it records, not by `where` */
		for (int j = 0; j < ctx->nphys && e < 0; j++)
			for (int k = 0; k < APE__API_SLOTS && e < 0; k++)
				if (ctx->phys[j].logical[k] == i)
					e = j;
		for (int j = 0; j < ctx->nphys && e < 0; j++) {
			const ape_physical_info *p = &ctx->phys[j].info;

			if ((d->pci_address[0] && !strcmp(p->pci_address, d->pci_address)) ||
			    (!d->pci_address[0] && d->kind == APE_DEVICE_CPU && p->kind == d->kind))
				e = j;
		}
		if (e < 0)
			continue;
		d->physical_index = e;
		d->numa_node = ctx->phys[e].info.numa_node;
		snprintf(d->cpuset, sizeof(d->cpuset), "%s", ctx->phys[e].info.cpuset);
	}
}

static void describe_machine(struct ape_context *ctx, const struct ape__ctx_setup *su,
			     const char *hwloc_note)
{
	ape_topology_info *t = &ctx->topo;

	t->numa_policy = ctx->numa_policy;
	if (!ctx->numa) {
		snprintf(t->source, sizeof(t->source), "this machine: hwloc: %s", hwloc_note);
		if (ctx->numa_policy == APE_NUMA_OFF)
			snprintf(t->numa_note, sizeof(t->numa_note), "off (%.240s)", hwloc_note);
		else
			snprintf(t->numa_note, sizeof(t->numa_note),
				 "%s, but the topology is unknown: buffers are plain allocations",
				 ape_numa_policy_name(ctx->numa_policy));
		return;
	}
	t->this_machine = ape__numa_is_real(ctx->numa);
	snprintf(t->source, sizeof(t->source), "%s", ape__numa_source(ctx->numa));
	ape__numa_counts(ctx->numa, &t->numa_nodes, &t->packages, &t->cores, &t->pus);
	if (ctx->numa_policy == APE_NUMA_OFF)
		snprintf(t->numa_note, sizeof(t->numa_note), "off (%s)", su->numa_from);
	else if (!t->this_machine)
		snprintf(t->numa_note, sizeof(t->numa_note),
			 "%s: placements are what that machine would get; nothing is bound here",
			 ape_numa_policy_name(ctx->numa_policy));
	else if (t->numa_nodes == 1)
		snprintf(t->numa_note, sizeof(t->numa_note),
			 "%s: one NUMA node, so every buffer is local",
			 ape_numa_policy_name(ctx->numa_policy));
	else if (ctx->numa_policy == APE_NUMA_LOCAL)
		snprintf(t->numa_note, sizeof(t->numa_note),
			 "local: staging buffers on each device's node, feeding threads on its "
			 "CPUs");
	else
		snprintf(t->numa_note, sizeof(t->numa_note),
			 "interleave: staging buffers spread over every node");
}

int ape__physical_build(struct ape_context *ctx, const struct ape__ctx_setup *su)
{
	struct ape__sighting *s = NULL;
	char note[256];
	int n = 0, *where = NULL, ret;

	atomic_init(&ctx->warned_placement, false);
	atomic_init(&ctx->warned_binding, false);
	atomic_init(&ctx->warned_pinning, false);
	atomic_init(&ctx->staging_placed, 0);
	atomic_init(&ctx->staging_plain, 0);
	if ((ret = ape__staging_cache_create(ctx)))
		return ape__error(ret, "%s: out of memory", fn_create);
	ctx->numa_policy = su->numa;
	ret = ape__numa_open(su->topology_xml, fn_create, &ctx->numa, note, sizeof(note));
	if (ret && su->topology_xml)
		return ret;
	if (ret == APE_ENOTSUP) /* built without hwloc: placement is off by choice, silently */
		ctx->numa_policy = APE_NUMA_OFF;
	/* this machine's topology is a help, not a requirement: without it, no placement */
	ctx->elsewhere = ctx->numa && !ape__numa_is_real(ctx->numa);
	describe_machine(ctx, su, note);
	ret = collect(ctx, &s, &n);
	if (ret)
		goto out_free;
	where = ape__calloc((size_t)n + 1, sizeof(*where));
	if (!where) {
		ret = ape__error(APE_ENOMEM, "out of memory");
		goto out_free;
	}
	ret = merge(ctx, s, n, where);
	if (!ret)
		ret = apply_visible(ctx, su, where);
	if (ret)
		goto out_free;
	place(ctx);
	link_devices(ctx);
out_free:
	if (ret == APE_ENOMEM) /* the other failures name the function already */
		ape__error_prefix(ret, fn_create);
	free(where);
	free(s);
	return ret;
}

void ape__physical_free(struct ape_context *ctx)
{
	ape__staging_cache_destroy(ctx); /* hwloc's buffers, and unpinning: devices live still */
	free(ctx->phys);
	ctx->phys = NULL;
	ctx->nphys = 0;
	ape__numa_close(ctx->numa);
	ctx->numa = NULL;
}
