/* SPDX-License-Identifier: MIT */
/*
 * Contexts: load the backends named in the registry and the plugins found (api/plugins.c), probe
 * them, keep one ordered device list.
 */
#include "core/context.h"
#include "core/alloc.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/ops.h"
#include "core/strace.h"
#include "core/verbose.h"
#include "api/plugins.h"
#include "api/registry.h"
#include "topo/physical.h"

void ape_context_options_init(ape_context_options *opts)
{
	if (!opts)
		return;
	memset(opts, 0, sizeof(*opts));
	opts->struct_size = sizeof(*opts);
	opts->verbose = -1;
}

bool ape__names_have(const char *list, const char *name)
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

static int unknown_backend(const char *list, int len, const char *p,
			   const struct ape__registry_entry *reg, int nreg,
			   const struct ape_context *ctx)
{
	char known[256] = "";
	size_t n = 0;

	for (int i = 0; i < nreg && n < sizeof(known); i++)
		n += (size_t)snprintf(known + n, sizeof(known) - n, "%s%s", i ? ", " : "",
				      reg[i].name);
	ape__plugins_names(ctx, known, sizeof(known), &n);
	return ape__error(APE_EINVAL,
			  "ape_context_create: opts->backends = \"%s\": unknown backend \"%.*s\" "
			  "(known: %s)",
			  list, len, p, known);
}

/* Rejects names in opts->backends that neither a registry entry nor a plugin found has, before
 * anything is probed. */
static int check_backend_list(const char *list, const struct ape__registry_entry *reg, int nreg,
			      const struct ape_context *ctx)
{
	for (const char *p = list; *p;) {
		const char *end = strchr(p, ',');
		int len = end ? (int)(end - p) : (int)strlen(p);
		bool known = false;

		for (int i = 0; i < nreg; i++)
			if ((int)strlen(reg[i].name) == len && !strncmp(p, reg[i].name, (size_t)len))
				known = true;
		if (!known)
			known = ape__plugins_have_name(ctx, p, (size_t)len);
		if (!known)
			return unknown_backend(list, len, p, reg, nreg, ctx);
		p += len + (end ? 1 : 0);
	}
	return 0;
}

/*
 * Devices the backend added from index `before` on whose capabilities its ops cannot back
 * (ape__device_check()): the backend is refused, all its devices released, the reason kept.
 * Its teardown is still owed (it probed).
 */
static bool refuse_devices(struct ape__ctx_backend *cb, int before)
{
	struct ape_context *ctx = cb->be.ctx;
	bool bad = false;

	for (int i = before; i < ctx->ndevices && !bad; i++)
		bad = ape__device_check(ctx->devices[i], cb->info.reason,
					sizeof(cb->info.reason)) != 0;
	if (!bad)
		return false;
	for (int i = before; i < ctx->ndevices; i++)
		ape__device_free(ctx->devices[i]);
	ctx->ndevices = before;
	return true;
}

int ape__backend_probe(struct ape__ctx_backend *cb)
{
	struct ape_context *ctx = cb->be.ctx;
	struct ape_be_probe_result res;
	int before = ctx->ndevices, ret;

	memset(&res, 0, sizeof(res));
	ret = cb->be.ops->probe(&cb->be, &res);
	cb->probed = true;
	if (ret < 0)
		return ret;
	if (refuse_devices(cb, before))
		return 0;
	cb->info.device_count = ctx->ndevices - before;
	cb->info.available = cb->info.device_count > 0;
	if (!cb->info.available)
		snprintf(cb->info.reason, sizeof(cb->info.reason), "%s",
			 res.reason[0] ? res.reason : "no device found");
	return 0;
}

static void probe_backend(struct ape__ctx_backend *cb, const struct ape__registry_entry *reg,
			  const char *only, int *err)
{
	int ret;

	snprintf(cb->info.name, sizeof(cb->info.name), "%s", reg->name);
	cb->info.built = reg->ops != NULL;
	if (!reg->ops) {
		snprintf(cb->info.reason, sizeof(cb->info.reason), "%s", reg->not_built);
		return;
	}
	if (only && !ape__names_have(only, reg->name)) {
		snprintf(cb->info.reason, sizeof(cb->info.reason),
			 "not loaded: left out by ape_context_options.backends");
		return;
	}
	/* the table first: nothing of a backend the core refuses runs, not even its probe */
	if (ape__backend_bind(&cb->be, reg->ops, cb->info.reason, sizeof(cb->info.reason)))
		return;
	ret = ape__backend_probe(cb);
	if (ret < 0)
		*err = ret;
}

/* The options struct as the caller's version of the header knows it: the first version ended
 * at `flags`, later ones add fields at the end. */
#define OPTIONS_V1_SIZE offsetof(ape_context_options, topology_xml)
#define OPTIONS_V2_SIZE offsetof(ape_context_options, opencl_context)
#define OPTIONS_V3_SIZE offsetof(ape_context_options, verbose)
#define OPTIONS_V4_SIZE offsetof(ape_context_options, backend_path)
#define HAS_OPTION(o, field)                                                                       \
	((o) && (o)->struct_size >= offsetof(ape_context_options, field) + sizeof((o)->field))

/* APE_NUMA names a policy; "default" would send it back to itself. */
static int parse_numa(const char *text, ape_numa_policy *out)
{
	int p = ape_numa_policy_from_name(text);

	if (p <= APE_NUMA_DEFAULT)
		return APE_EINVAL;
	*out = (ape_numa_policy)p;
	return 0;
}

/* Where the plugins come from: opts->backend_path when the caller's layout has it and sets it,
 * else APE_BACKEND_PATH (NULL when unset); `from` names it for messages. */
static const char *plugin_path(const ape_context_options *opts, const char **from)
{
	if (HAS_OPTION(opts, backend_path) && opts->backend_path) {
		*from = "ape_context_options.backend_path";
		return opts->backend_path;
	}
	*from = "APE_BACKEND_PATH";
	return getenv("APE_BACKEND_PATH");
}

/* Resolves the topology options from opts and the environment, before anything is probed. */
static int resolve_setup(const ape_context_options *opts, struct ape__ctx_setup *su)
{
	const char *env;

	memset(su, 0, sizeof(*su));
	su->numa = APE_NUMA_LOCAL;
	su->numa_from = "default";
	if (HAS_OPTION(opts, topology_xml))
		su->topology_xml = opts->topology_xml;
	if (HAS_OPTION(opts, numa) && opts->numa != APE_NUMA_DEFAULT) {
		if (opts->numa < APE_NUMA_LOCAL || opts->numa > APE_NUMA_OFF)
			return ape__error(APE_EINVAL,
					  "ape_context_create: opts->numa = %d: not an ape_numa_policy",
					  (int)opts->numa);
		su->numa = opts->numa;
		su->numa_from = "ape_context_options.numa";
	} else if ((env = getenv("APE_NUMA")) && *env) {
		if (parse_numa(env, &su->numa))
			return ape__error(APE_EINVAL,
					  "ape_context_create: APE_NUMA = \"%.64s\": must be local, "
					  "interleave or off", env);
		su->numa_from = "APE_NUMA";
	}
	if (HAS_OPTION(opts, visible_devices) && opts->visible_devices) {
		su->visible = opts->visible_devices;
		su->visible_from = "ape_context_options.visible_devices";
	} else {
		su->visible = getenv("APE_VISIBLE_DEVICES");
		su->visible_from = "APE_VISIBLE_DEVICES";
	}
	return 0;
}

int ape_context_create(ape_context **out, const ape_context_options *opts)
{
	APE__API_CALL("ape_context_create");
	int nreg;
	const struct ape__registry_entry *reg = ape__registry(&nreg);

	return ape__context_create(out, opts, reg, nreg);
}

int ape__context_create(ape_context **out, const ape_context_options *opts,
			const struct ape__registry_entry *reg, int nreg)
{
	struct ape_context *ctx;
	struct ape__ctx_setup setup;
	const char *only = NULL, *path, *path_from;
	int err = 0;

	if (!out)
		return ape__error(APE_EINVAL, "ape_context_create: out = NULL");
	*out = NULL;
	if (opts && opts->struct_size != sizeof(*opts) && opts->struct_size != OPTIONS_V1_SIZE &&
	    opts->struct_size != OPTIONS_V2_SIZE && opts->struct_size != OPTIONS_V3_SIZE &&
	    opts->struct_size != OPTIONS_V4_SIZE)
		return ape__error(APE_EINVAL,
				  "ape_context_create: opts->struct_size = %zu: expected %zu "
				  "(initialise with ape_context_options_init())",
				  opts->struct_size, sizeof(*opts));
	err = resolve_setup(opts, &setup);
	if (err)
		return err;
	if (HAS_OPTION(opts, verbose) && (opts->verbose < -1 || opts->verbose > APE__VERBOSE_MAX))
		return ape__error(APE_EINVAL,
				  "ape_context_create: opts->verbose = %d: expected -1 (APE_VERBOSE "
				  "decides), 0, 1 or 2",
				  opts->verbose);
	if (HAS_OPTION(opts, opencl_device) && !opts->opencl_context != !opts->opencl_device)
		return ape__error(APE_EINVAL,
				  "ape_context_create: opts->%s = NULL while opts->%s is set: give "
				  "both (the caller's cl_context and one of its cl_device_id) or neither",
				  opts->opencl_context ? "opencl_device" : "opencl_context",
				  opts->opencl_context ? "opencl_context" : "opencl_device");
	ctx = ape__calloc(1, sizeof(*ctx));
	if (!ctx)
		return ape__error(APE_ENOMEM, "ape_context_create: out of memory");
	ctx->flags = opts ? opts->flags : 0;
	ctx->verbose = HAS_OPTION(opts, verbose) && opts->verbose >= 0 ? opts->verbose
									 : ape__verbose_env();
	ape__verbose_raise(ctx->verbose);
	/* the plugins first, so that opts->backends may name them; probed after the built-ins */
	path = plugin_path(opts, &path_from);
	err = ape__plugins_find(ctx, path, path_from, ctx->flags & APE_CONTEXT_NO_PLUGIN_DIR);
	if (!err && opts && opts->backends) {
		err = check_backend_list(opts->backends, reg, nreg, ctx);
		only = opts->backends;
	}
	if (err) {
		ape_context_destroy(ctx);
		return err;
	}
	for (int i = 0; i < nreg && i < APE__MAX_BACKENDS && !err; i++) {
		ctx->backends[i].be.ctx = ctx;
		if (HAS_OPTION(opts, opencl_device) && opts->opencl_context &&
		    !strcmp(reg[i].name, "opencl")) {
			ctx->backends[i].be.import.context = opts->opencl_context;
			ctx->backends[i].be.import.device = opts->opencl_device;
			if (!reg[i].ops || (only && !ape__names_have(only, "opencl")))
				err = ape__error(APE_ENODEV,
						 "ape_context_create: opts->opencl_context is set but "
						 "the OpenCL backend is %s",
						 reg[i].ops ? "left out by opts->backends"
							    : "not built into this library");
		}
		ctx->nbackends = i + 1;
		probe_backend(&ctx->backends[i], &reg[i], only, &err);
	}
	if (!err)
		ape__plugins_register(ctx, reg, nreg, only, &err);
	if (err) {
		ape__error_prefix(err, "ape_context_create");
		ape_context_destroy(ctx);
		return err;
	}
	ape__context_sort_devices(ctx);
	err = ape__physical_build(ctx, &setup);
	if (err) {
		ape_context_destroy(ctx);
		return err;
	}
	*out = ctx;
	return 0;
}

void ape_context_destroy(ape_context *ctx)
{
	if (!ctx)
		return;
	ape__physical_free(ctx);
	for (int i = 0; i < ctx->ndevices; i++)
		ape__device_free(ctx->devices[i]);
	free(ctx->devices);
	/* reverse probe order: a later backend may share a driver library loaded by an earlier one */
	for (int i = ctx->nbackends - 1; i >= 0; i--) {
		struct ape__ctx_backend *cb = &ctx->backends[i];

		if (cb->probed && cb->be.ops->teardown)
			cb->be.ops->teardown(&cb->be);
	}
	ape__plugins_close(ctx); /* no plugin code runs from here on */
	free(ctx);
	ape__strace_flush(); /* APE_TRACE: the session so far, on disk */
}

int ape_backend_get_info(const ape_context *ctx, int index, ape_backend_info *info)
{
	APE__API_CALL("ape_backend_get_info");
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
	APE__API_CALL("ape_device_list");
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
	APE__API_CALL("ape_device_get_info");
	if (!dev)
		return ape__error(APE_EINVAL, "ape_device_get_info: dev = NULL");
	if (!info)
		return ape__error(APE_EINVAL, "ape_device_get_info: info = NULL");
	*info = dev->info;
	return 0;
}

uint64_t ape_device_capabilities(const ape_device *dev)
{
	return dev ? dev->caps.features : 0;
}
