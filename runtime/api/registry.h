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

#pragma GCC visibility pop
#endif
