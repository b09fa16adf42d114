/* SPDX-License-Identifier: MIT */
/*
 * The words for the public enums, one table each: what ape-info prints, what ape-run and
 * ape-bench parse, what the context's own notes say. Everyone goes through these functions, so a
 * word is spelt the same way everywhere and a new value is named once.
 */
#include <stdio.h>
#include <string.h>

#include "ape/ape.h"
#include "ape/ape_backend.h"
#include "core/error.h"

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const char *const dtype_names[] = {
	[APE_F32] = "f32",
	[APE_F16] = "f16",
	[APE_BF16] = "bf16",
};

static const char *const layout_names[] = {
	[APE_ROPE_HALF] = "half",
	[APE_ROPE_INTERLEAVED] = "interleaved",
};

static const char *const kind_names[] = {
	[APE_DEVICE_CPU] = "cpu",
	[APE_DEVICE_GPU] = "gpu",
	[APE_DEVICE_ACCELERATOR] = "accelerator",
	[APE_DEVICE_HOST_REFERENCE] = "reference",
};

static const char *const numa_names[] = {
	[APE_NUMA_DEFAULT] = "default",
	[APE_NUMA_LOCAL] = "local",
	[APE_NUMA_INTERLEAVE] = "interleave",
	[APE_NUMA_OFF] = "off",
};

static const char *const link_names[] = {
	[APE_LINK_SELF] = "X",	 [APE_LINK_PIX] = "PIX", [APE_LINK_PXB] = "PXB",
	[APE_LINK_PHB] = "PHB",	 [APE_LINK_NODE] = "NODE", [APE_LINK_SYS] = "SYS",
	[APE_LINK_UNKNOWN] = "-",
};

/* Indexed by bit: APE_API_CUDA is bit 0. */
static const char *const api_names[] = { "cuda", "opencl", "drm", "host" };

/* A static string for every value, known or not: callers print it without checking. */
static const char *name_of(const char *const *names, int n, long v)
{
	return v >= 0 && v < n ? names[v] : "?";
}

/* The position of text in names, or APE_EINVAL with a message that lists every word. */
static int index_of(const char *fn, const char *const *names, int n, const char *text)
{
	char list[128];
	size_t used = 0;

	for (int i = 0; text && i < n; i++)
		if (!strcmp(text, names[i]))
			return i;
	list[0] = '\0';
	for (int i = 0; i < n && used < sizeof(list); i++)
		used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%s",
					 !i ? "" : i == n - 1 ? " or " : ", ", names[i]);
	if (!text)
		return ape__error(APE_EINVAL, "%s: name = NULL: must be %s", fn, list);
	return ape__error(APE_EINVAL, "%s: name = \"%.64s\": must be %s", fn, text, list);
}

/*
 * The pair of public functions for one table. Written by one macro so that the name a message
 * gives is always the function's own, and a new enum's pair cannot differ from the others.
 */
#define APE__NAME_PAIR(word, type, table)                                                          \
	const char *ape_##word##_name(type value)                                                  \
	{                                                                                          \
		return name_of(table, COUNT(table), (long)value);                                  \
	}                                                                                          \
	int ape_##word##_from_name(const char *name)                                               \
	{                                                                                          \
		return index_of("ape_" #word "_from_name", table, COUNT(table), name);             \
	}

APE__NAME_PAIR(dtype, ape_dtype, dtype_names)
APE__NAME_PAIR(rope_layout, ape_rope_layout, layout_names)
APE__NAME_PAIR(device_kind, ape_device_kind, kind_names)
APE__NAME_PAIR(numa_policy, ape_numa_policy, numa_names)
APE__NAME_PAIR(link, int, link_names)

const char *ape_api_name(unsigned api)
{
	for (int i = 0; i < COUNT(api_names); i++)
		if (api == 1u << i)
			return api_names[i];
	return "?";
}

int ape_api_from_name(const char *name)
{
	int i = index_of("ape_api_from_name", api_names, COUNT(api_names), name);

	return i < 0 ? i : (int)(1u << i);
}

/* APE_BE_CAP_* in bit order */
static const char *const cap_names[] = {
	"host_memory", "diag", "diag_views", "backward", "resident_backward", "timestamps",
	"segments", "positions", "bias_table", "bwd_segments", "bwd_views",
};
_Static_assert(APE_BE_CAP_ALL == (1u << COUNT(cap_names)) - 1,
	       "a capability bit of ape/ape_backend.h without a name here");

const char *ape_be_cap_name(uint64_t bit)
{
	for (int i = 0; i < COUNT(cap_names); i++)
		if (bit == (uint64_t)1 << i)
			return cap_names[i];
	return NULL;
}
