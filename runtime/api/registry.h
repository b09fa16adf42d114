/* SPDX-License-Identifier: MIT */
/* The table of every backend libape knows, built into this library or not. */
#ifndef APE_RUNTIME_REGISTRY_H
#define APE_RUNTIME_REGISTRY_H

#include "core/backend.h"

#pragma GCC visibility push(hidden)

struct ape__registry_entry {
	const char *name;
	const struct ape__backend_ops *ops; /* NULL when not built into this library */
	const char *not_built; /* why it is not built; NULL when it is */
};

/* Entries in probing order; sets *count. */
const struct ape__registry_entry *ape__registry(int *count);

#pragma GCC visibility pop
#endif
