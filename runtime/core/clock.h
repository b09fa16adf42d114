/* SPDX-License-Identifier: MIT */
/*
 * The library's one host clock: milliseconds on CLOCK_MONOTONIC, for wall times in statistics,
 * host-side trace placement, speed measurements and the reference backend's events. One
 * definition, so that times taken in different layers can be subtracted from one another.
 */
#ifndef APE_RUNTIME_CLOCK_H
#define APE_RUNTIME_CLOCK_H

#include <time.h>

/* Monotonic host time in milliseconds, from an arbitrary origin. Never fails. */
static inline double ape__now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

#endif
