/* SPDX-License-Identifier: MIT */
/* The kernel paths a launch took (core/backend.h, ABI 14): noted by backends, summed by the
 * core, named for the statistics, APE_VERBOSE and traces. */
#include "core/backend.h"

#include <stdio.h>

void ape_be_path_note(struct ape_be_path_log *log, enum ape_be_path p, const char *why)
{
	if (!log || (unsigned)p >= APE_BE_PATH_COUNT)
		return;
	log->launches[p]++;
	log->why[p] = why;
}

const char *ape_be_path_name(enum ape_be_path p)
{
	static const char *const names[APE_BE_PATH_COUNT] = {
		[APE_BE_PATH_REFERENCE] = "reference", [APE_BE_PATH_GENERAL] = "general",
		[APE_BE_PATH_POSITIONS] = "positions", [APE_BE_PATH_RAGGED] = "ragged",
		[APE_BE_PATH_SEPARABLE] = "separable", [APE_BE_PATH_SPLIT] = "split",
		[APE_BE_PATH_DECODE] = "decode",	     [APE_BE_PATH_PAGES] = "decode-in-place",
		[APE_BE_PATH_EMPTY] = "empty",	     [APE_BE_PATH_BACKWARD] = "backward",
	};

	return (unsigned)p < APE_BE_PATH_COUNT ? names[p] : "?";
}

void ape__path_names(char *buf, size_t cap, const struct ape_be_path_log *pl)
{
	size_t n = 0;

	if (!cap)
		return;
	buf[0] = '\0';
	for (int i = 0; i < APE_BE_PATH_COUNT && n < cap; i++)
		if (pl->launches[i]) {
			const int k = snprintf(buf + n, cap - n, "%s%s", n ? "+" : "",
					       ape_be_path_name((enum ape_be_path)i));

			n = k < 0 ? cap : n + (size_t)k;
		}
}

void ape__path_merge(struct ape_be_path_log *dst, const struct ape_be_path_log *src)
{
	for (int p = 0; p < APE_BE_PATH_COUNT; p++) {
		dst->launches[p] += src->launches[p];
		if (src->why[p])
			dst->why[p] = src->why[p];
	}
}
