/* SPDX-License-Identifier: MIT */
/* Contexts: load the backends named in the registry, probe them, keep one ordered device list. */
#include "context.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "registry.h"

void ape_context_options_init(ape_context_options *opts)
{
	if (!opts)
		return;
	memset(opts, 0, sizeof(*opts));
	opts->struct_size = sizeof(*opts);
}

/* Is `name` one of the comma-separated words of `list`? */
static bool list_has(const char *list, const char *name)
{
	size_t n = strlen(name);

	for (const char *p = list; *p;) {
		const char *end = strchr(p, ',');
		size_t len = end ? (size_t)(end - p) : strlen(p);

		if (len == n && !strncmp(p, name, n))
			return true;
		p += len + (end ? 1 : 0);
	}
	return false;
}

/* Rejects names in opts->backends that no registry entry has, before anything is probed. */
static int check_backend_list(const char *list)
{
	int nreg;
	const struct ape__registry_entry *reg = ape__registry(&nreg);

	for (const char *p = list; *p;) {
		const char *end = strchr(p, ',');
		int len = end ? (int)(end - p) : (int)strlen(p);
		bool known = false;

		for (int i = 0; i < nreg; i++)
			if ((int)strlen(reg[i].name) == len && !strncmp(p, reg[i].name, (size_t)len))
				known = true;
		if (!known)
			return ape__error(APE_EINVAL,
					  "ape_context_create: opts->backends = \"%s\": unknown backend "
					  "\"%.*s\" (known: cuda, opencl, ref)",
					  list, len, p);
		p += len + (end ? 1 : 0);
	}
	return 0;
}

int ape__device_add(struct ape__backend *be, const struct ape_device_info *info, int rank, void *priv)
{
	struct ape_context *ctx = be->ctx;
	struct ape_device *dev;

	if (ctx->ndevices == ctx->cap) {
		int cap = ctx->cap ? 2 * ctx->cap : 8;
		struct ape_device **d = realloc(ctx->devices, (size_t)cap * sizeof(*d));

		if (!d)
			return ape__error(APE_ENOMEM, "%s: out of memory adding a device",
					  be->ops->name);
		ctx->devices = d;
		ctx->cap = cap;
	}
	dev = calloc(1, sizeof(*dev));
	if (!dev)
		return ape__error(APE_ENOMEM, "%s: out of memory adding a device", be->ops->name);
	dev->be = be;
	dev->info = *info;
	snprintf(dev->info.backend, sizeof(dev->info.backend), "%s", be->ops->name);
	dev->rank = rank;
	dev->priv = priv;
	ctx->devices[ctx->ndevices++] = dev;
	return 0;
}

/* Stable order: rank first (higher first), then probe order; insertion sort keeps it stable. */
static void sort_devices(struct ape_context *ctx)
{
	for (int i = 1; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];
		int j = i;

		while (j > 0 && ctx->devices[j - 1]->rank < d->rank) {
			ctx->devices[j] = ctx->devices[j - 1];
			j--;
		}
		ctx->devices[j] = d;
	}
	for (int i = 0; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];
		int nth = 0;

		d->info.index = i;
		for (int j = 0; j < i; j++)
			nth += ctx->devices[j]->be == d->be;
		d->info.backend_index = nth;
	}
}

static void probe_backend(struct ape__ctx_backend *cb, const struct ape__registry_entry *reg,
			  const char *only, int *err)
{
	struct ape_context *ctx = cb->be.ctx;
	struct ape__probe_result res;
	int before = ctx->ndevices, ret;

	snprintf(cb->info.name, sizeof(cb->info.name), "%s", reg->name);
	cb->info.built = reg->ops != NULL;
	if (!reg->ops) {
		snprintf(cb->info.reason, sizeof(cb->info.reason), "%s", reg->not_built);
		return;
	}
	if (only && !list_has(only, reg->name)) {
		snprintf(cb->info.reason, sizeof(cb->info.reason),
			 "not loaded: left out by ape_context_options.backends");
		return;
	}
	if (reg->ops->abi_version != APE__BACKEND_ABI) {
		snprintf(cb->info.reason, sizeof(cb->info.reason),
			 "built for backend ABI %u, this core has ABI %u", reg->ops->abi_version,
			 APE__BACKEND_ABI);
		return;
	}
	cb->be.ops = reg->ops;
	memset(&res, 0, sizeof(res));
	ret = reg->ops->probe(&cb->be, &res);
	cb->probed = true;
	if (ret < 0) {
		*err = ret;
		return;
	}
	cb->info.device_count = ctx->ndevices - before;
	cb->info.available = cb->info.device_count > 0;
	if (!cb->info.available)
		snprintf(cb->info.reason, sizeof(cb->info.reason), "%s",
			 res.reason[0] ? res.reason : "no device found");
}

int ape_context_create(ape_context **out, const ape_context_options *opts)
{
	struct ape_context *ctx;
	const struct ape__registry_entry *reg;
	const char *only = NULL;
	int nreg, err = 0;

	if (!out)
		return ape__error(APE_EINVAL, "ape_context_create: out = NULL");
	*out = NULL;
	if (opts && opts->struct_size != sizeof(*opts))
		return ape__error(APE_EINVAL,
				  "ape_context_create: opts->struct_size = %zu: expected %zu "
				  "(initialise with ape_context_options_init())",
				  opts->struct_size, sizeof(*opts));
	if (opts && opts->backends) {
		err = check_backend_list(opts->backends);
		if (err)
			return err;
		only = opts->backends;
	}
	ctx = calloc(1, sizeof(*ctx));
	if (!ctx)
		return ape__error(APE_ENOMEM, "ape_context_create: out of memory");
	ctx->flags = opts ? opts->flags : 0;
	reg = ape__registry(&nreg);
	for (int i = 0; i < nreg && i < APE__MAX_BACKENDS && !err; i++) {
		ctx->backends[i].be.ctx = ctx;
		ctx->nbackends = i + 1;
		probe_backend(&ctx->backends[i], &reg[i], only, &err);
	}
	if (err) {
		ape__error_prefix(err, "ape_context_create");
		ape_context_destroy(ctx);
		return err;
	}
	sort_devices(ctx);
	*out = ctx;
	return 0;
}

void ape_context_destroy(ape_context *ctx)
{
	if (!ctx)
		return;
	for (int i = 0; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];

		if (d->be->ops->device_release)
			d->be->ops->device_release(d);
		free(d);
	}
	free(ctx->devices);
	/* reverse probe order: a later backend may share a driver library loaded by an earlier one */
	for (int i = ctx->nbackends - 1; i >= 0; i--) {
		struct ape__ctx_backend *cb = &ctx->backends[i];

		if (cb->probed && cb->be.ops->teardown)
			cb->be.ops->teardown(&cb->be);
	}
	free(ctx);
}

int ape_backend_get_info(const ape_context *ctx, int index, ape_backend_info *info)
{
	if (!ctx)
		return ape__error(APE_EINVAL, "ape_backend_get_info: ctx = NULL");
	if (!info)
		return ctx->nbackends;
	if (index < 0 || index >= ctx->nbackends)
		return ape__error(APE_EINVAL, "ape_backend_get_info: index = %d: out of range 0..%d",
				  index, ctx->nbackends - 1);
	*info = ctx->backends[index].info;
	return 0;
}

int ape_device_list(ape_context *ctx, ape_device **devs, int cap)
{
	int n;

	if (!ctx)
		return ape__error(APE_EINVAL, "ape_device_list: ctx = NULL");
	if (!devs)
		return ctx->ndevices;
	if (cap < 0)
		return ape__error(APE_EINVAL, "ape_device_list: cap = %d: must be >= 0", cap);
	n = cap < ctx->ndevices ? cap : ctx->ndevices;
	for (int i = 0; i < n; i++)
		devs[i] = ctx->devices[i];
	return n;
}

int ape_device_get_info(const ape_device *dev, ape_device_info *info)
{
	if (!dev)
		return ape__error(APE_EINVAL, "ape_device_get_info: dev = NULL");
	if (!info)
		return ape__error(APE_EINVAL, "ape_device_get_info: info = NULL");
	*info = dev->info;
	return 0;
}

static const struct ape__ctx_backend *find_backend(const ape_context *ctx, const char *name)
{
	for (int i = 0; i < ctx->nbackends; i++)
		if (!strcmp(ctx->backends[i].info.name, name))
			return &ctx->backends[i];
	return NULL;
}

/* Appends "; passed over NAME: REASON" for each backend preferred over `chosen` (registry order is
 * preference order) that is not available. */
static void note_passed_over(const ape_context *ctx, const struct ape__backend *chosen,
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

static int select_in_backend(ape_context *ctx, const char *name, const char *why, int index,
			     ape_selection *sel)
{
	const struct ape__ctx_backend *cb = find_backend(ctx, name);
	int nth = 0;

	if (!cb)
		return ape__error(APE_EINVAL,
				  "ape_device_select: backend = \"%s\"%s: unknown backend (known: "
				  "auto, cuda, opencl, ref)",
				  name, why);
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
