/* SPDX-License-Identifier: MIT */
/* The kernel paths a launch took (core/backend.h, ABI 14): noted by backends, summed by the
 * core, named for the statistics, APE_VERBOSE and traces. */
#include "core/backend.h"

#include <stdio.h>

void ape__path_note(struct ape__path_log *log, enum ape__path p, const char *why)
{
	if (!log || (unsigned)p >= APE__PATH_COUNT)
		return;
	log->launches[p]++;
	log->why[p] = why;
}

const char *ape__path_name(enum ape__path p)
{
	static const char *const names[APE__PATH_COUNT] = {
		[APE__PATH_REFERENCE] = "reference", [APE__PATH_GENERAL] = "general",
		[APE__PATH_POSITIONS] = "positions", [APE__PATH_RAGGED] = "ragged",
		[APE__PATH_SEPARABLE] = "separable", [APE__PATH_SPLIT] = "split",
		[APE__PATH_DECODE] = "decode",	     [APE__PATH_PAGES] = "decode-in-place",
		[APE__PATH_EMPTY] = "empty",	     [APE__PATH_BACKWARD] = "backward",
	};

	return (unsigned)p < APE__PATH_COUNT ? names[p] : "?";
}

void ape__path_names(char *buf, size_t cap, const struct ape__path_log *pl)
{
	size_t n = 0;

	if (!cap)
		return;
	buf[0] = '\0';
	for (int i = 0; i < APE__PATH_COUNT && n < cap; i++)
		if (pl->launches[i]) {
			const int k = snprintf(buf + n, cap - n, "%s%s", n ? "+" : "",
					       ape__path_name((enum ape__path)i));

			n = k < 0 ? cap : n + (size_t)k;
		}
}

void ape__path_merge(struct ape__path_log *dst, const struct ape__path_log *src)
{
	for (int p = 0; p < APE__PATH_COUNT; p++) {
		dst->launches[p] += src->launches[p];
		if (src->why[p])
			dst->why[p] = src->why[p];
	}
}
