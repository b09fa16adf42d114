/* SPDX-License-Identifier: MIT */
/* `ape-bench --numa`: host-to-device copy bandwidth from staging buffers on each NUMA node. */
#ifndef APE_TOOLS_NUMA_BENCH_H
#define APE_TOOLS_NUMA_BENCH_H

#include <stdbool.h>
#include <stddef.h>

#include "ape/ape.h"

/* Measures `dev` from every node of `ctx`'s machine and prints a table (or JSON). Says so when
 * there is only one node and nothing to compare. Returns the exit status: 0, or 1 on failure. */
int numa_bench(ape_context *ctx, ape_device *dev, size_t bytes, int repeats, bool json);

#endif
