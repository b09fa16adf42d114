/* SPDX-License-Identifier: MIT */
/* What the C benchmark drivers in bench/ share: seeded N(0,1) inputs and medians. */
#ifndef APE_BENCH_UTIL_H
#define APE_BENCH_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* n N(0,1) floats from the 64-bit LCG state *s (Box-Muller), in a new array; NULL: no memory */
static inline float *bench_randn(size_t n, uint64_t *s)
{
	float *x = malloc(n * sizeof(float));

	for (size_t i = 0; x && i < n; i++) {
		double u1, u2;

		*s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
		u1 = ((double)(*s >> 11) + 1) / 9007199254740993.0;
		*s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
		u2 = (double)(*s >> 11) / 9007199254740992.0;
		x[i] = (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
	}
	return x;
}

static inline int bench_cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* The median of v[0..n) (n >= 1); sorts v */
static inline double bench_median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), bench_cmp);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
