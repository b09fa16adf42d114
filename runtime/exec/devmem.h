/* SPDX-License-Identifier: MIT */
/*
 * The allocation counter of streamed calls: every device buffer the executor allocates, and
 * the scratch the backend declares per launch in flight, counted against the budget. Its peak
 * is what ape_stats.peak_device_bytes reports. One counter per device session, one thread.
 */
#ifndef APE_RUNTIME_DEVMEM_H
#define APE_RUNTIME_DEVMEM_H

#include <stdint.h>

#include "core/backend.h"

#pragma GCC visibility push(hidden)

struct ape__devmem {
	struct ape_device *dev;
	uint64_t budget; /* UINT64_MAX: none */
	uint64_t cur, peak;
	uint64_t allocs; /* buf_alloc calls made */
};

void ape__devmem_init(struct ape__devmem *m, struct ape_device *dev, uint64_t budget);
/* A buffer of `bytes`, refused with APE_ENOMEM (message naming `what` and the budget) when it
 * would take the count past the budget. */
int ape__devmem_alloc(struct ape__devmem *m, uint64_t bytes, struct ape_be_buf **out,
		      const char *what);
/* Frees *b (of `bytes`) and sets it NULL; accepts NULL. The buffer must be idle. */
void ape__devmem_free(struct ape__devmem *m, struct ape_be_buf **b, uint64_t bytes);
/* Scratch a backend holds while a launch is in flight: counted, never refused (the plan made
 * room for it). */
void ape__devmem_hold(struct ape__devmem *m, uint64_t bytes);
void ape__devmem_drop(struct ape__devmem *m, uint64_t bytes);

#pragma GCC visibility pop
#endif
