/* SPDX-License-Identifier: MIT */
#include "rng.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void ape_rng_seed(ape_rng *r, uint64_t seed)
{
	r->s = seed;
}

void ape_rng_init(ape_rng *r, const char *name)
{
	const char *env = getenv("APE_TEST_SEED");
	uint64_t seed;

	if (env && *env) {
		seed = strtoull(env, NULL, 0);
	} else {
		struct timespec ts;

		clock_gettime(CLOCK_REALTIME, &ts);
		seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40);
	}
	fprintf(stderr, "# %s: seed %llu (replay with APE_TEST_SEED=%llu)\n", name,
		(unsigned long long)seed, (unsigned long long)seed);
	r->s = seed;
}

uint64_t ape_rng_next(ape_rng *r)
{
	uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

double ape_rng_uniform(ape_rng *r)
{
	return (double)(ape_rng_next(r) >> 11) * 0x1p-53;
}

double ape_rng_normal(ape_rng *r) /* Box-Muller */
{
	double u1 = ape_rng_uniform(r), u2 = ape_rng_uniform(r);

	return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

int64_t ape_rng_range(ape_rng *r, int64_t lo, int64_t hi)
{
	/* in uint64: hi - lo + 1 overflows int64 for wide ranges (0..INT64_MAX), and is 0 for the
	 * whole range; the same values as lo + next % span wherever that was defined */
	const uint64_t span = (uint64_t)hi - (uint64_t)lo + 1;
	const uint64_t x = ape_rng_next(r);

	return (int64_t)((uint64_t)lo + (span ? x % span : x));
}

void *ape_rng_array(ape_rng *r, size_t n, ape_dtype dtype, float *keep)
{
	void *p = malloc(n * ape_dtype_size(dtype) + 1);
	float buf[256];

	for (size_t i = 0; p && i < n; i += 256) {
		const size_t m = n - i < 256 ? n - i : 256;

		for (size_t j = 0; j < m; j++)
			buf[j] = (float)ape_rng_normal(r);
		if (keep)
			memcpy(keep + i, buf, m * sizeof(float));
		ape_convert((char *)p + i * ape_dtype_size(dtype), dtype, buf, APE_F32, m);
	}
	return p;
}
