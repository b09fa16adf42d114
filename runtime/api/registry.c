/* SPDX-License-Identifier: MIT */
/*
 * The one place that knows which backends were compiled in. The Makefile defines APE_HAVE_<NAME>
 * for each backend it built and APE_<NAME>_NOT_BUILT with the reason for each it did not, so that
 * ape-info can say "cuda: not built into this libape (nvcc not found at build time)".
 */
#include "api/registry.h"

extern const struct ape_backend_plugin ape__ref_ops;
#ifdef APE_HAVE_OPENCL
extern const struct ape_backend_plugin ape__opencl_ops;
#endif
#ifdef APE_HAVE_CUDA
extern const struct ape_backend_plugin ape__cuda_ops;
#endif

#ifndef APE_OPENCL_NOT_BUILT
#define APE_OPENCL_NOT_BUILT "not built into this libape"
#endif
#ifndef APE_CUDA_NOT_BUILT
#define APE_CUDA_NOT_BUILT "not built into this libape"
#endif

static const struct ape__registry_entry registry[] = {
#ifdef APE_HAVE_CUDA
	{ "cuda", &ape__cuda_ops, NULL },
#else
	{ "cuda", NULL, APE_CUDA_NOT_BUILT },
#endif
#ifdef APE_HAVE_OPENCL
	{ "opencl", &ape__opencl_ops, NULL },
#else
	{ "opencl", NULL, APE_OPENCL_NOT_BUILT },
#endif
	{ "ref", &ape__ref_ops, NULL },
};

const struct ape__registry_entry *ape__registry(int *count)
{
	*count = (int)(sizeof(registry) / sizeof(registry[0]));
	return registry;
}
