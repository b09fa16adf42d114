/* SPDX-License-Identifier: MIT */
/*
 * The one place that knows which backends were compiled in: the list the build generates from
 * every backend.mk (runtime/api/backends.mk), in probe order, each built or not with the reason,
 * so that ape-info can say "cuda: not built into this libape (nvcc not found at build time)".
 * Plugins found at run time come after these (runtime/api/plugins.c).
 */
#include "api/registry.h"

/* each built backend's table */
#define APE_BACKEND_BUILT(name, ops) extern const struct ape_backend_plugin ops;
#define APE_BACKEND_NOT_BUILT(name, why)
#include "ape_backends.h"
#undef APE_BACKEND_BUILT
#undef APE_BACKEND_NOT_BUILT

static const struct ape__registry_entry registry[] = {
#define APE_BACKEND_BUILT(name, ops) { #name, &ops, NULL },
#define APE_BACKEND_NOT_BUILT(name, why) { #name, NULL, why },
#include "ape_backends.h"
#undef APE_BACKEND_BUILT
#undef APE_BACKEND_NOT_BUILT
};

const struct ape__registry_entry *ape__registry(int *count)
{
	*count = (int)(sizeof(registry) / sizeof(registry[0]));
	return registry;
}
