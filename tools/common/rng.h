/* SPDX-License-Identifier: MIT */
/* Seeded randomness for tools and tests: fresh by default, reproducible with a printed seed. */
#ifndef APE_TOOLS_RNG_H
#define APE_TOOLS_RNG_H

#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"

typedef struct ape_rng {
	uint64_t s;
} ape_rng;

/* Seeds from APE_TEST_SEED when set, else from the clock and pid; prints
 * "# <name>: seed N (replay with APE_TEST_SEED=N)" on stderr so any run can be replayed. */
void ape_rng_init(ape_rng *r, const char *name);
void ape_rng_seed(ape_rng *r, uint64_t seed);
uint64_t ape_rng_next(ape_rng *r); /* splitmix64 */
double ape_rng_uniform(ape_rng *r); /* [0, 1) */
double ape_rng_normal(ape_rng *r);
int64_t ape_rng_range(ape_rng *r, int64_t lo, int64_t hi); /* inclusive */
/* n standard normal values stored as dtype, in a new allocation (free()); their float32 values
 * also into keep when not NULL. NULL when out of memory. */
void *ape_rng_array(ape_rng *r, size_t n, ape_dtype dtype, float *keep);

#endif
