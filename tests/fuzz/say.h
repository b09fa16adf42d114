/* SPDX-License-Identifier: MIT */
/* What a fuzz target says of an input when asked (FUZZ_TRACE set): shared by the targets. */
#ifndef APE_FUZZ_SAY_H
#define APE_FUZZ_SAY_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* With FUZZ_TRACE set, what a target does with an input, a line on stderr (to see what an input
 * does); nothing otherwise. */
static inline void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void trace(const char *fmt, ...)
{
	static int on = -1;
	va_list ap;

	if (on < 0)
		on = getenv("FUZZ_TRACE") != NULL;
	if (!on)
		return;
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

#endif
