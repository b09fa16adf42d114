/* SPDX-License-Identifier: MIT */
/* The shared pure math of runtime/core/ape_math.h, checked against brute force in float64. */
#include <math.h>

#include "ape_test.h"

#define APE_REAL double
#include "core/ape_math.h"

/*
 * The skip bound's tail: the summed weight of every key at distance >= n0 (one key per distance,
 * count of them) never exceeds exp(U(n0)) * ape_tail_count(count, delta), for any parameters
 * skipping allows (delta, beta, gamma >= 0).
 */
TEST(tail_count_bounds_the_tail_sum)
{
	ape_rng rng;

	ape_rng_init(&rng, "tail_count_bounds_the_tail_sum");
	for (int c = 0; c < 2000; c++) {
		double delta = ape_rng_uniform(&rng) < 0.2 ? 0 : ape_rng_uniform(&rng) * 2;
		double beta = ape_rng_uniform(&rng), gamma = ape_rng_uniform(&rng);
		double lambda = ape_rng_uniform(&rng), a = ape_rng_uniform(&rng) * 50;
		int64_t n0 = ape_rng_range(&rng, 0, 200), count = ape_rng_range(&rng, 1, 20000);
		double u0 = ape_score_bound(lambda, delta, beta, gamma, 1.0, a, 1.0, (double)n0);
		double sum = 0;

		for (int64_t n = n0; n < n0 + count; n++) /* relative to exp(u0) */
			sum += exp(ape_score_bound(lambda, delta, beta, gamma, 1.0, a, 1.0, (double)n) -
				   u0);
		ASSERT_LE(sum, ape_tail_count((double)count, delta))
		TH_LOG("delta %g beta %g gamma %g lambda %g n0 %lld count %lld", delta, beta, gamma,
		       lambda, (long long)n0, (long long)count);
	}
}

/* Without a linear decay the tail can only be bounded by its length. */
TEST(tail_count_without_linear_decay_is_the_count)
{
	EXPECT_EQ(1234.0, ape_tail_count(1234.0, 0.0));
	EXPECT_EQ(2.0, ape_tail_count(2.0, 0.5)); /* fewer keys than the series bound (2.54) */
	EXPECT_LT(ape_tail_count(1e9, 0.5), 2.6); /* 1 / (1 - e^-0.5) = 2.54 */
}

TEST(tail_negligible_is_strict_about_its_inputs)
{
	EXPECT_FALSE(ape_tail_negligible(-100, 0, 1, 10, 0)); /* tol 0: never skip */
	EXPECT_FALSE(ape_tail_negligible(-100, 0, 0, 10, 1e-6)); /* nothing computed yet */
	EXPECT_TRUE(ape_tail_negligible(-100, 0, 1, 10, 1e-6));
	EXPECT_FALSE(ape_tail_negligible(NAN, 0, 1, 10, 1e-6)); /* a NaN bound proves nothing */
}

TEST_HARNESS_MAIN
