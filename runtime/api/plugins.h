/* SPDX-License-Identifier: MIT */
/*
 * Backend plugins (include/ape/ape_backend.h): shared objects found through
 * ape_context_options.backend_path or APE_BACKEND_PATH and the plugin folder under the install
 * prefix, opened when a context is created and registered after the built-in backends, through
 * the same checks (runtime/core/ops.c). Each context opens its plugins itself (the dynamic
 * loader counts the references) and closes them when it is destroyed, after their teardown.
 */
#ifndef APE_RUNTIME_PLUGINS_H
#define APE_RUNTIME_PLUGINS_H

#include <stdbool.h>

#include "core/context.h"
#include "api/registry.h"

#pragma GCC visibility push(hidden)

/* One plugin a context found, loaded or not. */
struct ape__plugin {
	ape_plugin_info info; /* what ape_plugin_get_info() returns */
	void *handle; /* dlopen()'s, while open; NULL when it did not open or was closed */
	/* What its ape_backend_plugin() returned, while open; NULL when it returned nothing or the
	 * shared object did not get that far */
	const struct ape_backend_plugin *table;
	int slot; /* its backend's index in ctx->backends once loaded; -1 before and otherwise */
};

/*
 * The plugin folder under the install prefix: APE_PLUGIN_DIR, which the Makefile sets to
 * "$(PREFIX)/lib/libape/backends". Tests point it at a folder of their own.
 */
extern const char *ape__plugin_folder;

/*
 * Finds the plugins of `path` (':'-separated files and folders; NULL or "" none), `from` naming
 * where path came from in messages ("APE_BACKEND_PATH"), then those of the plugin folder unless
 * `no_folder`, and opens each into ctx->plugins: its shared object, its entry point, the head
 * of its table (ABI, name). What cannot be opened is listed with the reason. Before any backend
 * is probed. Returns 0, or APE_ENOMEM (message set; what was found stays in ctx, for
 * ape_context_destroy()).
 */
int ape__plugins_find(struct ape_context *ctx, const char *path, const char *from, bool no_folder);

/* Whether a plugin found in ctx states the backend name of `len` bytes at `name` (not
 * terminated there): opts->backends may name it. */
bool ape__plugins_have_name(const struct ape_context *ctx, const char *name, size_t len);

/* Appends ", NAME" for each name of a plugin found in ctx to buf (cap bytes, terminated), at
 * offset *n (advanced): the names opts->backends could take. */
void ape__plugins_names(const struct ape_context *ctx, char *buf, size_t cap, size_t *n);

/*
 * Registers the plugins found, in order, after the built-in backends of reg (nreg entries) were
 * probed: each table checked (ape__backend_bind()), its name compared with the registry's and
 * the plugins' loaded before it, left out when `only` (opts->backends, or NULL) does not name
 * it, probed and its devices checked like a built-in backend's. A plugin that is refused, left
 * out, fails its probe or adds no device is torn down and closed at once, the reason kept;
 * one that loads holds a backend slot. Sets *err only for a probe failing with APE_ENOMEM (the
 * context then fails, as for a built-in backend).
 */
void ape__plugins_register(struct ape_context *ctx, const struct ape__registry_entry *reg,
			   int nreg, const char *only, int *err);

/* The last plugin found in ctx whose table states `name` and that did not load, or NULL: what
 * ape_device_select() explains a name with when no backend has it. */
const struct ape__plugin *ape__plugins_unloaded(const struct ape_context *ctx, const char *name);

/* Closes every plugin ctx holds open and frees the list: in ape_context_destroy(), after every
 * backend's teardown. */
void ape__plugins_close(struct ape_context *ctx);

#pragma GCC visibility pop
#endif /* APE_RUNTIME_PLUGINS_H */
