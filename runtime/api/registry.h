/* SPDX-License-Identifier: MIT */
/* The table of every backend libape knows, built into this library or not. */
#ifndef APE_RUNTIME_REGISTRY_H
#define APE_RUNTIME_REGISTRY_H

#include "core/backend.h"

#pragma GCC visibility push(hidden)

struct ape__registry_entry {
	const char *name;
	const struct ape_backend_plugin *ops; /* NULL when not built into this library */
	const char *not_built; /* why it is not built; NULL when it is */
};

/* Entries in probing order; sets *count. */
const struct ape__registry_entry *ape__registry(int *count);

/*
 * ape_context_create() over the nreg entries of reg (at most APE__MAX_BACKENDS are loaded)
 * instead of the compiled-in table: what ape_context_create() does with ape__registry(), and a
 * way for tests to load a backend the library does not carry (tests/test_api_contexts.c: tables
 * the core must refuse).
 */
int ape__context_create(ape_context **out, const ape_context_options *opts,
			const struct ape__registry_entry *reg, int nreg);

struct ape__ctx_backend;

/*
 * Probes a backend whose table ape__backend_bind() accepted into cb (a built-in one or a
 * plugin): its probe, then the capabilities of each device it added (ape__device_check(): a
 * backend with a device claiming what its ops cannot do is refused, its devices released),
 * recording in cb->info the devices, whether it is available and why not. Returns 0, or the
 * probe's failure (< 0; cb->probed is set either way, and the devices added before it are still
 * in the context).
 */
int ape__backend_probe(struct ape__ctx_backend *cb);

/* Is `name` one of the comma-separated words of `list`? */
bool ape__names_have(const char *list, const char *name);

#pragma GCC visibility pop
#endif
