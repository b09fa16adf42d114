/* SPDX-License-Identifier: MIT */
/*
 * The context's device list as every layer maintains it: backends add their devices while they
 * probe (ape_be_device_add), topology drops the invisible ones (ape__context_drop_devices), and the
 * front end sorts them (ape__context_sort_devices). The public face is api/context.c.
 */
#include "core/context.h"
#include "core/alloc.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/error.h"

/* A device with what only the core reads: backends get the embedded struct ape_device, which is
 * also the public handle, and never see the rest. */
struct core_device {
	struct ape_device dev;
	int rank; /* preference: higher is chosen first by "auto" (core/backend.h) */
	atomic_uint_fast64_t pairs_per_s;
};

static struct core_device *core_of(const struct ape_device *dev)
{
	return (struct core_device *)((char *)dev - offsetof(struct core_device, dev));
}

atomic_uint_fast64_t *ape__device_pairs_per_s(struct ape_device *dev)
{
	return &core_of(dev)->pairs_per_s;
}

void ape__device_free(struct ape_device *dev)
{
	if (!dev)
		return;
	if (dev->be->ops->device_release)
		dev->be->ops->device_release(dev);
	free(core_of(dev));
}

int ape_be_device_add(struct ape_backend *be, const struct ape_device_info *info,
		    const struct ape_be_caps *caps, int rank, void *priv)
{
	struct ape_context *ctx = be->ctx;
	struct core_device *cd;

	if (ctx->ndevices == ctx->cap) {
		int cap = ctx->cap ? 2 * ctx->cap : 8;
		struct ape_device **d = ape__realloc(ctx->devices, (size_t)cap * sizeof(*d));

		if (!d)
			return ape__error(APE_ENOMEM, "%s: out of memory adding a device",
					  be->ops->name);
		ctx->devices = d;
		ctx->cap = cap;
	}
	cd = ape__calloc(1, sizeof(*cd));
	if (!cd)
		return ape__error(APE_ENOMEM, "%s: out of memory adding a device", be->ops->name);
	cd->dev.be = be;
	cd->dev.info = *info;
	cd->dev.caps = *caps;
	/* a bit newer than the backend's ABI minor is one it cannot mean (ABI 1.0 had no
	 * bias_table, 1.1 no ragged backward launch, 1.2 no strided one): dropped, so that it
	 * never gets a launch member, or a launch kind, its ABI lacks */
	if (be->raw && be->raw->abi_minor < 1)
		cd->dev.caps.features &= ~(uint64_t)APE_BE_CAP_BIAS_TABLE;
	if (be->raw && be->raw->abi_minor < 2)
		cd->dev.caps.features &= ~(uint64_t)APE_BE_CAP_BWD_SEGMENTS;
	if (be->raw && be->raw->abi_minor < 3)
		cd->dev.caps.features &= ~(uint64_t)APE_BE_CAP_BWD_VIEWS;
	if (!cd->dev.caps.max_alloc)
		cd->dev.caps.max_alloc = UINT64_MAX; /* the contract's "no limit" either way */
	snprintf(cd->dev.info.backend, sizeof(cd->dev.info.backend), "%s", be->ops->name);
	cd->dev.priv = priv;
	cd->rank = rank;
	atomic_init(&cd->pairs_per_s, 0);
	ctx->devices[ctx->ndevices++] = &cd->dev;
	return 0;
}

void *ape_be_priv(const struct ape_backend *be)
{
	return be->priv;
}

void ape_be_set_priv(struct ape_backend *be, void *priv)
{
	be->priv = priv;
}

void ape_be_import(const struct ape_backend *be, void **context, void **device)
{
	*context = be->import.context;
	*device = be->import.device;
}

/* Positions in the list and among the devices of each backend. */
static void index_devices(struct ape_context *ctx)
{
	for (int i = 0; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];
		int nth = 0;

		d->info.index = i;
		for (int j = 0; j < i; j++)
			nth += ctx->devices[j]->be == d->be;
		d->info.backend_index = nth;
	}
}

/* Stable order: rank first (higher first), then probe order; insertion sort keeps it stable. */
void ape__context_sort_devices(struct ape_context *ctx)
{
	for (int i = 1; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];
		int j = i;

		while (j > 0 && core_of(ctx->devices[j - 1])->rank < core_of(d)->rank) {
			ctx->devices[j] = ctx->devices[j - 1];
			j--;
		}
		ctx->devices[j] = d;
	}
	index_devices(ctx);
}

void ape__context_drop_devices(struct ape_context *ctx, const bool *drop, int *new_index,
			       const char *why)
{
	int m = 0;

	for (int i = 0; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];

		new_index[i] = drop[i] ? -1 : m;
		if (!drop[i]) {
			ctx->devices[m++] = d;
			continue;
		}
		for (int b = 0; b < ctx->nbackends; b++)
			if (&ctx->backends[b].be == d->be)
				ctx->backends[b].info.device_count--;
		ape__device_free(d);
	}
	ctx->ndevices = m;
	index_devices(ctx);
	for (int b = 0; b < ctx->nbackends; b++) {
		struct ape__ctx_backend *cb = &ctx->backends[b];

		if (cb->info.available && cb->info.device_count == 0) {
			cb->info.available = false;
			snprintf(cb->info.reason, sizeof(cb->info.reason), "%s", why);
		}
	}
}

void ape__warn_once(atomic_bool *flag, const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	if (atomic_exchange(flag, true))
		return;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	ape__warn("%s", msg);
}
