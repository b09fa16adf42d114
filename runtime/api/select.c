/* SPDX-License-Identifier: MIT */
/*
 * Choosing a device: by backend and index (ape_device_select), or from a text spec that may
 * name a physical device by index or PCI address (ape_device_select_spec). Neither ever falls
 * back silently: what was passed over, and why, is in the note.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/context.h"
#include "core/error.h"
#include "core/verbose.h"
#include "api/plugins.h"
#include "topo/topology.h"

static const struct ape__ctx_backend *find_backend(const ape_context *ctx, const char *name)
{
	for (int i = 0; i < ctx->nbackends; i++)
		if (!strcmp(ctx->backends[i].info.name, name))
			return &ctx->backends[i];
	return NULL;
}

/* Appends "; passed over NAME: REASON" for each backend preferred over `chosen` (registry order is
 * preference order) that is not available. */
static void note_passed_over(const ape_context *ctx, const struct ape_backend *chosen,
			     ape_selection *sel)
{
	for (int i = 0; i < ctx->nbackends; i++) {
		const struct ape__ctx_backend *cb = &ctx->backends[i];
		size_t len = strlen(sel->note);

		if (&cb->be == chosen)
			break;
		if (cb->info.available)
			continue;
		sel->passed_over = true;
		snprintf(sel->note + len, sizeof(sel->note) - len, "; passed over %s: %s",
			 cb->info.name, cb->info.reason);
	}
}

/* The message for a backend name ctx does not have: a plugin found under that name that did not
 * load (APE_ENOBACKEND, with its reason), or no such backend (APE_EINVAL, with the names ctx
 * has). */
static int unknown_backend(const ape_context *ctx, const char *name, const char *why)
{
	const struct ape__plugin *p = ape__plugins_unloaded(ctx, name);
	char known[256] = "auto";
	size_t n = strlen(known);

	if (p)
		return ape__error(APE_ENOBACKEND,
				  "ape_device_select: backend %s%s (the plugin %s) is not available: "
				  "%s",
				  name, why, p->info.path, p->info.reason);
	for (int i = 0; i < ctx->nbackends && n < sizeof(known); i++)
		n += (size_t)snprintf(known + n, sizeof(known) - n, ", %s",
				      ctx->backends[i].info.name);
	return ape__error(APE_EINVAL,
			  "ape_device_select: backend = \"%s\"%s: unknown backend (known: %s)", name,
			  why, known);
}

static int select_in_backend(ape_context *ctx, const char *name, const char *why, int index,
			     ape_selection *sel)
{
	const struct ape__ctx_backend *cb = find_backend(ctx, name);
	int nth = 0;

	if (!cb)
		return unknown_backend(ctx, name, why);
	if (!cb->info.available)
		return ape__error(APE_ENOBACKEND, "ape_device_select: backend %s%s is not available: %s",
				  name, why, cb->info.reason);
	if (index < 0)
		index = 0;
	for (int i = 0; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];

		if (d->be != &cb->be || nth++ != index)
			continue;
		sel->device = d;
		snprintf(sel->note, sizeof(sel->note), "%s:%d (%s), chosen%s", name, index,
			 d->info.name, why);
		return 0;
	}
	return ape__error(APE_ENODEV, "ape_device_select: index = %d: backend %s has %d device(s)",
			  index, name, cb->info.device_count);
}

int ape_device_select(ape_context *ctx, const char *backend, int index, ape_selection *sel)
{
	APE__API_CALL("ape_device_select");
	ape_selection s; /* *sel is written only on success */
	const char *env;
	struct ape_device *d;
	int ret;

	if (!ctx)
		return ape__error(APE_EINVAL, "ape_device_select: ctx = NULL");
	if (!sel)
		return ape__error(APE_EINVAL, "ape_device_select: sel = NULL");
	memset(&s, 0, sizeof(s));
	env = getenv("APE_BACKEND");
	if (backend && strcmp(backend, "auto")) {
		ret = select_in_backend(ctx, backend, " by request", index, &s);
	} else if (env && *env && strcmp(env, "auto")) {
		ret = select_in_backend(ctx, env, " by APE_BACKEND", index, &s);
	} else if (ctx->ndevices == 0) {
		ret = ape__error(APE_ENODEV, "ape_device_select: no device in any backend");
	} else if (index >= ctx->ndevices) {
		ret = ape__error(APE_ENODEV, "ape_device_select: index = %d: there are %d device(s)",
				 index, ctx->ndevices);
	} else {
		d = ctx->devices[index < 0 ? 0 : index];
		s.device = d;
		snprintf(s.note, sizeof(s.note), "%s:%d (%s), chosen by auto", d->info.backend,
			 d->info.backend_index, d->info.name);
		note_passed_over(ctx, d->be, &s);
		ret = 0;
	}
	if (!ret)
		*sel = s;
	return ret;
}

/* ------------------------------------------------------------------ by spec */

static const char spec_fn[] = "ape_device_select_spec";

static bool digits_only(const char *s)
{
	if (!*s)
		return false;
	for (; *s; s++)
		if (*s < '0' || *s > '9')
			return false;
	return true;
}

/* The physical device a spec names, through its default backend. */
static int select_physical(ape_context *ctx, const char *spec, ape_selection *s)
{
	const struct ape__phys *p;
	struct ape_device *d;
	int idx = ape__topology_find(ctx->phys, ctx->nphys, spec, spec_fn);

	if (idx < 0)
		return idx;
	p = &ctx->phys[idx];
	if (!p->info.usable)
		return ape__error(APE_ENOBACKEND, "%s: spec = \"%s\": %s", spec_fn, spec,
				  p->info.reason);
	d = ctx->devices[p->info.device_index];
	s->device = d;
	snprintf(s->note, sizeof(s->note), "%s:%d (%s), physical device %d%s%s, chosen by request",
		 d->info.backend, d->info.backend_index, d->info.name, idx,
		 p->info.pci_address[0] ? " at " : "", p->info.pci_address);
	return 0;
}

/* "opencl:0000:03:00.0": that backend's device at that address, overriding the default. */
static int select_backend_at(ape_context *ctx, const char *backend, const char *addr,
			     const char *spec, ape_selection *s)
{
	const struct ape__ctx_backend *cb = find_backend(ctx, backend);
	const struct ape__phys *p;
	struct ape_device *d = NULL;
	struct ape__pci_addr a;
	int idx;

	if (ape__pci_parse(addr, &a))
		return ape__error(APE_EINVAL, "%s: spec = \"%s\": \"%s\" is neither a device index "
				  "nor a PCI address (0000:03:00.0)", spec_fn, spec, addr);
	idx = ape__topology_find(ctx->phys, ctx->nphys, addr, spec_fn);
	if (idx < 0)
		return idx;
	p = &ctx->phys[idx];
	if (!cb->info.available)
		return ape__error(APE_ENOBACKEND, "%s: spec = \"%s\": backend %s is not available: %s",
				  spec_fn, spec, backend, cb->info.reason);
	for (int i = 0; i < ctx->ndevices && !d; i++)
		if (ctx->devices[i]->be == &cb->be && ctx->devices[i]->info.physical_index == idx)
			d = ctx->devices[i];
	if (!d)
		return ape__error(APE_ENOBACKEND, "%s: spec = \"%s\": %s does not drive the device at "
				  "%s (%s)", spec_fn, spec, backend, p->info.pci_address,
				  p->info.name);
	s->device = d;
	snprintf(s->note, sizeof(s->note), "%s:%d (%s), physical device %d at %s, chosen by request",
		 backend, d->info.backend_index, d->info.name, idx, p->info.pci_address);
	return 0;
}

int ape_device_select_spec(ape_context *ctx, const char *spec, ape_selection *sel)
{
	APE__API_CALL("ape_device_select_spec");
	ape_selection s;
	const char *colon;
	char backend[16];
	int ret;

	if (!ctx)
		return ape__error(APE_EINVAL, "%s: ctx = NULL", spec_fn);
	if (!sel)
		return ape__error(APE_EINVAL, "%s: sel = NULL", spec_fn);
	if (!spec || !*spec || !strcmp(spec, "auto"))
		return ape_device_select(ctx, "auto", -1, sel);
	memset(&s, 0, sizeof(s));
	colon = strchr(spec, ':');
	if (colon && (size_t)(colon - spec) < sizeof(backend)) {
		snprintf(backend, sizeof(backend), "%.*s", (int)(colon - spec), spec);
		if (!strcmp(backend, "auto") || find_backend(ctx, backend)) {
			if (digits_only(colon + 1) && strlen(colon + 1) < 8)
				return ape_device_select(ctx, backend, atoi(colon + 1), sel);
			if (!strcmp(backend, "auto"))
				return ape_device_select_spec(ctx, colon + 1, sel);
			ret = select_backend_at(ctx, backend, colon + 1, spec, &s);
			goto out;
		}
	}
	if (!colon && !digits_only(spec)) /* a backend name, or the error saying it is none */
		return ape_device_select(ctx, spec, -1, sel);
	ret = select_physical(ctx, spec, &s);
out:
	if (!ret)
		*sel = s;
	return ret;
}
