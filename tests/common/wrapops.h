/* SPDX-License-Identifier: MIT */
/*
 * A backend seen through a wrapper, for tests of the streaming executor: counts every device
 * allocation (and the bytes held, and their peak), can make the Nth attention launch fail, and
 * can hide optional ops so that the core's fallbacks run. One wrapper per process at a time
 * (the harness forks each test).
 */
#ifndef APE_TEST_WRAPOPS_H
#define APE_TEST_WRAPOPS_H

#include <stdint.h>

#include "ape/ape.h"
#include "backend.h"

#define WRAP_NO_COPY_D2D (1u << 0) /* hide copy_d2d */
#define WRAP_NO_TIMESTAMP (1u << 1) /* hide event_timestamp */
#define WRAP_NO_SCRATCH (1u << 2) /* hide attention_scratch */

struct wrap_counts {
	uint64_t allocs, frees; /* buf_alloc / buf_free calls */
	uint64_t live_bytes, peak_bytes; /* device bytes held, and their peak since reset */
	uint64_t attention_calls;
	uint64_t h2d_calls, d2h_calls, d2d_calls;
};

/* Puts the wrapper in front of dev's backend (every device of that backend in its context). */
void wrap_install(ape_device *dev, unsigned flags);
/* Restores the backend's own ops. */
void wrap_remove(void);
/* The counts so far; wrap_reset() zeroes them (peak_bytes restarts from live_bytes). */
struct wrap_counts wrap_get(void);
void wrap_reset(void);
/* Launch number n (1-based, counted from now) fails with APE_EDEVLOST; 0: none fails. */
void wrap_fail_attention(uint64_t n);

#endif
