/* SPDX-License-Identifier: MIT */
/*
 * The shared pure math of include/ape/ape_math.h (what the reference, the OpenCL and the CUDA
 * kernels all compute with), every function and formula macro, each against an independent
 * evaluation: exact integers (__int128 and brute-force loops) for the distance rules, long
 * double (or finite differences of it) for the real-valued ones, with the ends of their ranges:
 * the int64 ends of the distances, |n| = 0, 2^63, empty rows, -inf, NaN.
 */
#include <float.h>
#include <math.h>

#include "ape_test.h"

#define APE_REAL double
#include "ape/ape_math.h"

typedef __int128 i128;

#define I64MAX INT64_MAX
#define I64MIN INT64_MIN

/* ---- exact evaluations */

static i128 clamp128(i128 x, i128 lo, i128 hi)
{
	return x < lo ? lo : x > hi ? hi : x;
}

static i128 sat128(i128 x)
{
	return clamp128(x, I64MIN, I64MAX);
}

/* Brute force over the keys: which of keys j0..j1-1 row diag sees, their count, smallest |n|. */
static void keys_brute(i128 diag, i128 j0, i128 j1, int causal, i128 *count, i128 *minabs)
{
	*count = 0;
	*minabs = -1;
	for (i128 j = j0; j < j1; j++) {
		const i128 n = diag - j, an = n < 0 ? -n : n;

		if (causal && n < 0)
			continue;
		(*count)++;
		if (*minabs < 0 || an < *minabs)
			*minabs = an;
	}
}

/* A distance near one of the int64 ends, or small, or anywhere. */
static int64_t draw_distance(ape_rng *r)
{
	switch (ape_rng_range(r, 0, 3)) {
	case 0:
		return I64MAX - ape_rng_range(r, 0, 300);
	case 1:
		return I64MIN + ape_rng_range(r, 0, 300);
	case 2:
		return ape_rng_range(r, -300, 300);
	default:
		return (int64_t)ape_rng_next(r);
	}
}

TEST(saturating_add_sub_abs_are_exact_or_saturated)
{
	static const int64_t ends[] = { I64MIN, I64MIN + 1, -2, -1, 0, 1, 2, I64MAX - 1, I64MAX };
	const int ne = (int)(sizeof(ends) / sizeof(ends[0]));
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 20000 + ne * ne; c++) {
		const int64_t a = c < ne * ne ? ends[c / ne] : draw_distance(&rng);
		const int64_t b = c < ne * ne ? ends[c % ne] : draw_distance(&rng);

		ASSERT_TRUE(ape_sat_add(a, b) == sat128((i128)a + b));
		ASSERT_TRUE(ape_sat_sub(a, b) == sat128((i128)a - b));
		ASSERT_TRUE(ape_abs_dist(a) == sat128(a < 0 ? -(i128)a : (i128)a));
	}
	/* saturating |INT64_MIN| keeps its value in double and float: 2^63 */
	EXPECT_EQ(0x1p63, (double)ape_abs_dist(I64MIN));
	EXPECT_EQ(0x1p63f, (float)ape_abs_dist(I64MIN));
}

/*
 * Every distance rule against brute force over the keys, with rows at the int64 ends: the
 * counts (visible keys, a key range's pairs), the smallest |n| (of a range of distances, of a
 * range of keys) and the anchor distance, for every diag and Lk whose distances fit.
 */
TEST(distance_rules_against_brute_force)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 30000; c++) {
		const int64_t Lk = ape_rng_range(&rng, 0, 40), diag = draw_distance(&rng);
		const int causal = c & 1;
		int64_t j0 = ape_rng_range(&rng, 0, Lk), j1 = ape_rng_range(&rng, 0, Lk);
		i128 cnt, mn;

		/* only rows whose distances to keys 0..Lk-1 all fit (what validation admits) */
		if (Lk > 0 && (i128)diag - (Lk - 1) < I64MIN)
			continue;
		if (j0 > j1) {
			const int64_t t = j0;

			j0 = j1;
			j1 = t;
		}
		keys_brute(diag, 0, Lk, causal, &cnt, &mn);
		ASSERT_TRUE(ape_visible_keys(diag, Lk, causal) == cnt)
		TH_LOG("diag %lld Lk %lld causal %d", (long long)diag, (long long)Lk, causal);
		/* the anchor: the nearest visible |n|, 0 with none; |n| = 2^63 saturates */
		ASSERT_TRUE(ape_anchor_distance(diag, Lk, causal) == (cnt ? sat128(mn) : 0))
		TH_LOG("diag %lld Lk %lld causal %d", (long long)diag, (long long)Lk, causal);
		/* causal: the visible keys are a prefix */
		keys_brute(diag, 0, j1, causal, &cnt, &mn);
		ASSERT_TRUE(ape_visible_keys(diag, j1, causal) == cnt);
		keys_brute(diag, j0, j1, causal, &cnt, &mn);
		ASSERT_TRUE(ape_row_visible_pairs(diag, j0, j1, causal) == cnt);
		if (j0 < j1) {
			keys_brute(diag, j0, j1, 0, &cnt, &mn);
			ASSERT_TRUE(ape_keys_min_abs(diag, j0, j1) == sat128(mn))
			TH_LOG("diag %lld keys %lld..%lld", (long long)diag, (long long)j0,
			       (long long)j1);
			/* ape_min_abs over the range of distances the keys have */
			ASSERT_TRUE(ape_min_abs(diag - (j1 - 1), diag - j0) == sat128(mn));
		}
	}
	/* the ends themselves */
	EXPECT_EQ(1, ape_visible_keys(I64MAX, 1, 1));
	EXPECT_EQ(5, ape_visible_keys(I64MAX, 5, 1));
	EXPECT_EQ(0, ape_visible_keys(I64MIN, 5, 1));
	EXPECT_EQ(I64MAX - 4, ape_anchor_distance(I64MAX, 5, 1));
	EXPECT_EQ(I64MAX - 2, ape_anchor_distance(I64MIN + 3, 4, 0)); /* keys down to INT64_MIN */
	EXPECT_EQ(I64MAX, ape_anchor_distance(I64MIN, 1, 0));	      /* |INT64_MIN|, saturated */
	EXPECT_EQ(I64MAX, ape_min_abs(I64MIN, I64MIN));
	EXPECT_EQ(0, ape_anchor_distance(I64MAX, 0, 0)); /* no key */
	EXPECT_EQ(0, ape_visible_keys(3, 0, 0));
}

/* Rows past the problem's end (tiles evaluate them): defined for every int64 input, no trap
 * under UBSan, results in range. */
TEST(distance_rules_are_total)
{
	static const int64_t v[] = { I64MIN, I64MIN + 1, -1, 0, 1, I64MAX - 1, I64MAX };

	for (int a = 0; a < 7; a++)
		for (int b = 0; b < 7; b++)
			for (int causal = 0; causal < 2; causal++) {
				const int64_t Lk = v[b] < 0 ? 0 : v[b];
				const int64_t vk = ape_visible_keys(v[a], Lk, causal);

				EXPECT_TRUE(vk >= 0 && vk <= Lk);
				EXPECT_TRUE(ape_anchor_distance(v[a], Lk, causal) >= 0);
				EXPECT_TRUE(ape_min_abs(v[a], v[a] > v[b] ? v[a] : v[b]) >= 0);
				EXPECT_TRUE(ape_row_visible_pairs(v[a], Lk / 2, Lk, causal) >= 0);
				if (Lk > 0)
					EXPECT_TRUE(ape_keys_min_abs(v[a], 0, Lk) >= 0);
			}
}

/* The closed form of a head's pairs (128-bit, independent of ape_math.h): rows x = diag0 + 1 ..
 * see clamp(x, 0, Lk) keys. */
static i128 rows_pairs_closed(i128 diag0, i128 nrows, i128 Lk, int causal)
{
	i128 a = diag0 + 1, first, last, sum = 0;

	if (nrows <= 0 || Lk <= 0)
		return 0;
	if (!causal)
		return nrows * Lk;
	first = a > 1 ? a : 1;
	last = a + nrows - 1 < Lk ? a + nrows - 1 : Lk;
	if (last >= first)
		sum += (first + last) * (last - first + 1) / 2;
	first = a > Lk + 1 ? a : Lk + 1;
	last = a + nrows - 1;
	if (last >= first)
		sum += (last - first + 1) * Lk;
	return sum;
}

TEST(rows_visible_pairs_against_brute_force_and_128_bits)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 20000; c++) {
		const int causal = c % 3 != 0;
		const bool small = c % 2 == 0;
		const int64_t nrows =
			small ? ape_rng_range(&rng, 0, 60)
			      : ape_rng_range(&rng, 0, I64MAX / ape_rng_range(&rng, 1, 8));
		const int64_t Lk = small	? ape_rng_range(&rng, 0, 60)
				   : c % 5 == 0 ? I64MAX - ape_rng_range(&rng, 0, 3)
						: ape_rng_range(&rng, 0, I64MAX);
		int64_t diag0 = draw_distance(&rng);
		ape_ulong got;
		i128 want;
		int over;

		/* rows diag0 .. diag0 + nrows - 1 must fit */
		if ((i128)diag0 + nrows - 1 > I64MAX)
			diag0 = (int64_t)(I64MAX - (i128)(nrows > 0 ? nrows - 1 : 0));
		want = rows_pairs_closed(diag0, nrows, Lk, causal);
		if (small) { /* and the sum itself, row by row */
			i128 sum = 0, cnt, mn;

			for (int64_t r = 0; r < nrows; r++) {
				keys_brute((i128)diag0 + r, 0, Lk, causal, &cnt, &mn);
				sum += cnt;
			}
			ASSERT_TRUE(sum == want);
		}
		over = ape_rows_visible_pairs(diag0, nrows, Lk, causal, &got);
		ASSERT_EQ(want > (i128)UINT64_MAX, over)
		TH_LOG("diag0 %lld nrows %lld Lk %lld causal %d", (long long)diag0,
		       (long long)nrows, (long long)Lk, causal);
		ASSERT_TRUE(got == (over ? UINT64_MAX : (uint64_t)want));
	}
	{ /* one row at INT64_MAX with INT64_MAX keys: all of them */
		ape_ulong got;

		EXPECT_EQ(0, ape_rows_visible_pairs(I64MAX, 1, I64MAX, 1, &got));
		EXPECT_TRUE(got == (uint64_t)I64MAX);
		EXPECT_EQ(1, ape_rows_visible_pairs(0, I64MAX, I64MAX, 0, &got));
		EXPECT_TRUE(got == UINT64_MAX);
	}
}

TEST(mul_u64_is_exact_or_flags_overflow)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 20000; c++) {
		const uint64_t a = ape_rng_next(&rng) >> ape_rng_range(&rng, 0, 63);
		const uint64_t b = ape_rng_next(&rng) >> ape_rng_range(&rng, 0, 63);
		const unsigned __int128 p = (unsigned __int128)a * b;
		ape_ulong got;
		const int over = ape_mul_u64(a, b, &got);

		ASSERT_EQ(p > UINT64_MAX, over);
		ASSERT_TRUE(got == (over ? UINT64_MAX : (uint64_t)p));
	}
}

/* ---- the real-valued terms, against long double */

static double rel_err(long double got, long double want)
{
	return (double)(fabsl(got - want) / fmaxl(fabsl(want), LDBL_MIN));
}

TEST(row_statistics_against_long_double)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 2000; c++) {
		const int D = 2 * (int)ape_rng_range(&rng, 1, 128);
		const double lambda = c % 10 ? ape_rng_uniform(&rng) * 3 : 0;
		long double mean = 0, ss = 0, qq = 0, sigma, alpha;
		double x[256], ssd = 0, mean_d = 0;

		for (int d = 0; d < D; d++) {
			x[d] = ape_rng_normal(&rng) * (c % 3 + 0.5);
			mean += x[d];
			mean_d += x[d];
		}
		mean /= D;
		mean_d /= D;
		for (int d = 0; d < D; d++) {
			ss += (x[d] - mean) * (x[d] - mean);
			qq += (long double)x[d] * x[d];
			ssd += (x[d] - mean_d) * (x[d] - mean_d);
		}
		sigma = sqrtl(ss / (D - 1));
		alpha = 1 + lambda / (1 + expl(sigma));
		ASSERT_LT(rel_err(ape_sigma(ssd, D), sigma), 1e-13);
		ASSERT_LT(rel_err(ape_alpha(lambda, (double)sigma), alpha), 1e-15);
		ASSERT_LT(rel_err(ape_inv_alpha(lambda, ssd, D), 1 / alpha), 1e-13);
		/* the norm bound: above |x|, by at most 2^-20 relative */
		ASSERT_GE((long double)ape_norm_bound((double)qq), sqrtl(qq));
		ASSERT_LE((long double)ape_norm_bound((double)qq), sqrtl(qq) * (1 + 0x1p-19L));
		ASSERT_GE((long double)ape_norm_bound_f((float)sqrtl(qq)),
			  (long double)(float)sqrtl(qq));
		ASSERT_LE(ape_norm_bound_f((float)sqrtl(qq)), (float)sqrtl(qq) * (1.0f + 0x1p-19f));
	}
}

/* |n| over the whole range: 0, small, 2^30, anything, near 2^63 */
static int64_t draw_an_i(ape_rng *r)
{
	switch (ape_rng_range(r, 0, 3)) {
	case 0:
		return ape_rng_range(r, 0, 100);
	case 1:
		return ape_rng_range(r, 0, (int64_t)1 << 30);
	case 2:
		return I64MAX - ape_rng_range(r, 0, 1 << 20);
	default:
		return (int64_t)(ape_rng_next(r) >> ape_rng_range(r, 1, 63));
	}
}

static double draw_an(ape_rng *r)
{
	return (double)draw_an_i(r);
}

TEST(temperature_and_bias_against_long_double)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 20000; c++) {
		const int64_t ani = draw_an_i(&rng);
		const double an = (double)ani, lambda = ape_rng_uniform(&rng) * 2;
		const double delta = ape_rng_normal(&rng), beta = ape_rng_normal(&rng);
		const double gamma = ape_rng_normal(&rng);
		const long double t = 1 / (1 + (long double)lambda * an);
		const long double b =
			-(long double)delta * an - beta * log1pl(an) - gamma * sqrtl(an);
		const long double mag = fabsl(delta * (long double)an) + fabsl(beta * log1pl(an)) +
					fabsl(gamma * sqrtl(an));

		ASSERT_LT(rel_err(ape_temp(lambda, an), t), 1e-15);
		ASSERT_LE(fabsl(ape_bias(delta, beta, gamma, an) - b), 1e-15L * mag + 1e-300L);
		ASSERT_LT(rel_err(ape_temp_f(0.125f, (float)lambda, ani),
				  0.125L / (1 + (long double)(float)lambda * (float)ani)),
			  1e-6);
	}
	EXPECT_EQ(1.0, ape_temp(0.5, 0));
	EXPECT_EQ(0.0, ape_bias(1, 1, 1, 0));
}

/* bias(a) - bias(aref) in float32, exact integer difference: accurate to float32 rounding of
 * the difference itself even where each bias is ~1e18. */
TEST(bias_difference_against_long_double)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 20000; c++) {
		const int64_t r0 = draw_an_i(&rng);
		const int64_t aref = r0 > I64MAX - 1000 ? r0 - 1000 : r0;
		const int64_t a = aref + ape_rng_range(&rng, 0, 1000);
		const float delta = (float)ape_rng_uniform(&rng),
			    beta = (float)ape_rng_normal(&rng);
		const float gamma = (float)ape_rng_normal(&rng);
		const long double d = (long double)(a - aref), ar = (float)aref, af = (float)a;
		/* the formula of the header with exact d, against the float arguments it gets */
		const long double want =
			-(delta * d + beta * log1pl(d / (1 + ar)) +
			  gamma * (sqrtl(af) + sqrtl(ar) > 0 ? d / (sqrtl(af) + sqrtl(ar)) : 0));
		const long double mag = fabsl(delta * d) + fabsl(beta * log1pl(d / (1 + ar))) +
					fabsl(gamma * d / fmaxl(sqrtl(af) + sqrtl(ar), 1)) + 1e-30L;

		ASSERT_LE(fabsl(ape_bias_diff_f(delta, beta, gamma, a, aref) - want), 4e-6L * mag)
		TH_LOG("a %lld aref %lld", (long long)a, (long long)aref);
		if (a < (1 << 20)) { /* where float32 holds a and aref: the real difference */
			const long double exact = -(long double)delta * d -
						  beta * (log1pl(a) - log1pl(aref)) -
						  gamma * (sqrtl(a) - sqrtl(aref));

			ASSERT_LE(fabsl(ape_bias_diff_f(delta, beta, gamma, a, aref) - exact),
				  4e-6L * mag + 1e-6L);
		}
	}
	EXPECT_EQ(0.0f, ape_bias_diff_f(1, 1, 1, 0, 0));
	EXPECT_EQ(0.0f, ape_bias_diff_f(1, 1, 1, I64MAX, I64MAX));
}

TEST(seed_sincos_against_long_double)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 50000; c++) {
		/* the exact range: angles of distances up to ~2^30 */
		const double a = (ape_rng_uniform(&rng) * 2 - 1) *
				 ldexp(1, (int)ape_rng_range(&rng, -4, 30));
		float co, si = ape_seed_sincos(a, &co);

		ASSERT_LE(fabsl(si - sinl(a)), 3e-7L) TH_LOG("a = %.17g", a);
		ASSERT_LE(fabsl(co - cosl(a)), 3e-7L) TH_LOG("a = %.17g", a);
	}
	{ /* beyond, still a rotation: finite, on the unit circle */
		float co, si = ape_seed_sincos(0x1p62, &co);

		EXPECT_LE(fabsf(si * si + co * co - 1), 1e-6f);
	}
}

/* ---- the skip bound */

TEST(score_bound_bounds_every_score)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 5000; c++) {
		const double lambda = ape_rng_uniform(&rng), delta = ape_rng_uniform(&rng);
		const double beta = ape_rng_uniform(&rng), gamma = ape_rng_uniform(&rng);
		const double scale = ape_rng_normal(&rng), an = draw_an(&rng);
		const double x = ape_rng_normal(&rng), y = ape_rng_normal(&rng);
		const double u = ape_rng_normal(&rng), w = ape_rng_normal(&rng);
		const double th = ape_rng_uniform(&rng) * 7,
			     step = (double)ape_rng_range(&rng, 0, 50);
		/* one pair rotated by th at a distance an + step: the score the spec defines */
		const long double dot = (x * u + y * w) * cosl(th) + (x * w - y * u) * sinl(th);
		const long double s = dot * scale / (1 + lambda * (an + step)) -
				      delta * (an + step) - beta * log1pl(an + step) -
				      gamma * sqrtl(an + step);
		const double b = ape_score_bound(lambda, delta, beta, gamma, fabs(scale),
						 ape_norm_bound(x * x + y * y),
						 ape_norm_bound(u * u + w * w), an);

		ASSERT_LE(s, (long double)b + 1e-12L * (1 + fabs(b)));
	}
}

/* The weight of `count` keys at an, an + 1, ... whose scores sit at the bound, summed. */
static long double tail_sum(double lambda, double delta, double beta, double gamma, double qk,
			    double an, int64_t count, long double shift, bool weigh_n)
{
	long double sum = 0;

	for (int64_t k = 0; k < count; k++) {
		const double n = an + (double)k;

		sum += expl(ape_score_bound(lambda, delta, beta, gamma, 1, qk, 1, n) - shift) *
		       (weigh_n ? fmax(1, n) : 1);
	}
	return sum;
}

TEST(tail_count_bounds_the_tail_sum)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 2000; c++) {
		double delta = ape_rng_uniform(&rng) < 0.2 ? 0 : ape_rng_uniform(&rng) * 2;
		double beta = ape_rng_uniform(&rng), gamma = ape_rng_uniform(&rng);
		double lambda = ape_rng_uniform(&rng), a = ape_rng_uniform(&rng) * 50;
		int64_t n0 = ape_rng_range(&rng, 0, 200), count = ape_rng_range(&rng, 1, 20000);
		double u0 = ape_score_bound(lambda, delta, beta, gamma, 1.0, a, 1.0, (double)n0);

		ASSERT_LE(tail_sum(lambda, delta, beta, gamma, a, (double)n0, count, u0, false),
			  ape_tail_count((double)count, delta))
		TH_LOG("delta %g beta %g gamma %g lambda %g n0 %lld count %lld", delta, beta, gamma,
		       lambda, (long long)n0, (long long)count);
		/* the backward's count: each key weighed by max(1, |n|) */
		ASSERT_LE(tail_sum(lambda, delta, beta, gamma, a, (double)n0, count, u0, true),
			  ape_bwd_tail_count((double)count, (double)n0, delta) * (1 + 1e-12));
	}
}

/* Without a linear decay the tail can only be bounded by its length. */
TEST(tail_count_without_linear_decay_is_the_count)
{
	EXPECT_EQ(1234.0, ape_tail_count(1234.0, 0.0));
	EXPECT_EQ(2.0, ape_tail_count(2.0, 0.5)); /* fewer keys than the series bound (2.54) */
	EXPECT_LT(ape_tail_count(1e9, 0.5), 2.6); /* 1 / (1 - e^-0.5) = 2.54 */
	EXPECT_EQ(3 * 6 + 3.0, ape_bwd_tail_count(3, 5, 0)); /* 6 + 7 + 8 */
}

TEST(tail_negligible_is_strict_about_its_inputs)
{
	EXPECT_FALSE(ape_tail_negligible(-100, 0, 1, 10, 0));	 /* tol 0: never skip */
	EXPECT_FALSE(ape_tail_negligible(-100, 0, 0, 10, 1e-6)); /* nothing computed yet */
	EXPECT_TRUE(ape_tail_negligible(-100, 0, 1, 10, 1e-6));
	EXPECT_FALSE(ape_tail_negligible(NAN, 0, 1, 10, 1e-6)); /* a NaN bound proves nothing */
	/* the log-space test against the plain one where neither overflows */
	for (double u = -40; u < 5; u += 0.37)
		EXPECT_EQ(10 * exp(u - 1.5) / 3.0 <= 1e-6,
			  ape_tail_negligible(u, 1.5, 3, 10, 1e-6));
}

/*
 * Soundness of both skip tests: when they allow leaving keys out, the keys' true weight (each at
 * its own distance's bound, brute force) is within the tolerance of what the row keeps.
 */
TEST(may_skip_is_sound)
{
	ape_rng rng;
	int skipped = 0;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 3000; c++) {
		const double lambda = ape_rng_uniform(&rng), delta = ape_rng_uniform(&rng) * 0.5;
		const double beta = ape_rng_uniform(&rng) * 0.2,
			     gamma = ape_rng_uniform(&rng) * 0.2;
		const double qk = ape_rng_uniform(&rng) * 5,
			     an = (double)ape_rng_range(&rng, 0, 400);
		const int64_t count = ape_rng_range(&rng, 1, 3000);
		const double crow = ape_rng_normal(&rng) * 3, m = ape_rng_normal(&rng) * 3;
		const double l = 1 + ape_rng_uniform(&rng) * 50,
			     tol = ldexp(1, -(int)ape_rng_range(&rng, 4, 30));
		const double prior = c % 3 ? -INFINITY : ape_rng_normal(&rng) * 3;
		/* the kept weight, in the row's frame m: l plus the prior's */
		const long double kept = l + (prior > -INFINITY ? expl(prior - m) : 0);
		const long double tail =
			tail_sum(lambda, delta, beta, gamma, qk, an, count, crow + m, false);
		const double lse = m + log(l) + crow;

		if (ape_may_skip(lambda, delta, beta, gamma, 1, qk, 1, an, (double)count, crow, m,
				 l, prior, tol)) {
			ASSERT_LE(tail, tol * kept * (1 + 1e-9));
			skipped++;
		}
		if (ape_bwd_may_skip(lambda, delta, beta, gamma, 1, qk, 1, an, (double)count, lse,
				     tol))
			ASSERT_LE(tail_sum(lambda, delta, beta, gamma, qk, an, count, lse, true),
				  tol / (1 + tol) * (1 + 1e-9));
	}
	EXPECT_GT(skipped, 100); /* the test saw both answers */
	EXPECT_TRUE(ape_may_skip(0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, -INFINITY, 1e-6)); /* none */
	EXPECT_FALSE(ape_bwd_may_skip(0, 1, 0, 0, 1, 1, 1, 100, 1, NAN, 1e-6));
	EXPECT_FALSE(ape_bwd_may_skip(0, 1, 0, 0, 1, 1, 1, 100, 1, INFINITY, 1e-6));
	EXPECT_FALSE(ape_bwd_may_skip(-1, 1, 0, 0, 1, 1, 1, 100, 1, 0, 1e-6)); /* lambda < 0 */
}

/* ---- merging and the online softmax */

TEST(merge_rules_against_long_double)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	EXPECT_EQ(3.0, ape_merge_max(3, -INFINITY));
	EXPECT_EQ(-INFINITY, ape_merge_max(-INFINITY, -INFINITY));
	EXPECT_EQ(0.0, ape_merge_factor(-INFINITY, -INFINITY)); /* nothing yet: not NaN */
	EXPECT_EQ(0.0, ape_merge_factor(-INFINITY, 2));
	for (int c = 0; c < 10000; c++) {
		const double l1 = ape_rng_normal(&rng) * 50, l2 = l1 + ape_rng_normal(&rng) * 20;
		const long double l = fmaxl(l1, l2) + log1pl(expl(-fabsl((long double)l1 - l2)));
		double lm, w1, w2, lw1, lw2;

		ASSERT_LT(rel_err(ape_merge_factor(l1, ape_merge_max(l1, l2)),
				  expl((long double)l1 - fmaxl(l1, l2))),
			  1e-13);
		ASSERT_EQ(APE_MERGE_BOTH, ape_merge_lse(l1, l2, &lm, &w1, &w2, &lw1, &lw2));
		ASSERT_LE(fabsl(lm - l), 1e-13L * fmaxl(1, fabsl(l)));
		ASSERT_LE(fabsl(w1 + w2 - 1.0L), 1e-15L * (4 + fabsl(l)));
		ASSERT_LE(fabsl(lw1 - (l1 - l)), 1e-13L * fmaxl(1, fabsl(l)));
		ASSERT_LT(rel_err(w2, expl(l2 - l)), 1e-11);
	}
	/* |LSE| where a float64 cannot hold l_i - l (decay at distances near 2^62): the weights
	 * still sum to 1 and follow the sides' difference (they summed to 2 before) */
	for (int c = 0; c < 1000; c++) {
		const double l1 = -ldexp(1 + ape_rng_uniform(&rng), (int)ape_rng_range(&rng, 53, 64));
		const double l2 = c % 3 ? l1 : nextafter(l1, c % 2 ? 0 : -INFINITY);
		const long double d = (long double)l2 - l1;
		double lm = 0, w1 = 0, w2 = 0, lw1 = 0, lw2 = 0;

		ASSERT_EQ(APE_MERGE_BOTH, ape_merge_lse(l1, l2, &lm, &w1, &w2, &lw1, &lw2));
		ASSERT_LE(fabsl(w1 + w2 - 1.0L), 1e-15L) TH_LOG("l1 %g l2 %g: w %g + %g", l1, l2, w1, w2);
		ASSERT_LE(fabsl((long double)lw2 - lw1 - d), 1e-12L * fmaxl(1, fabsl(d)));
		ASSERT_LE(fabsl(lm - fmaxl(l1, l2)), fabsl(fmaxl(l1, l2)) * 1e-15L);
	}
	{
		double l, w1, w2, lw1, lw2;

		EXPECT_EQ(APE_MERGE_KEEP, ape_merge_lse(1, -INFINITY, &l, &w1, &w2, &lw1, &lw2));
		EXPECT_EQ(APE_MERGE_TAKE, ape_merge_lse(-INFINITY, 1, &l, &w1, &w2, &lw1, &lw2));
		EXPECT_EQ(APE_MERGE_NAN, ape_merge_lse(NAN, 1, &l, &w1, &w2, &lw1, &lw2));
		EXPECT_EQ(APE_MERGE_NAN, ape_merge_lse(1, INFINITY, &l, &w1, &w2, &lw1, &lw2));
		EXPECT_EQ(APE_MERGE_KEEP,
			  ape_merge_lse(-INFINITY, -INFINITY, &l, &w1, &w2, &lw1, &lw2));
	}
}

/* The backward's exponent: itself at or below 0, 0 above (P <= 1), NaN kept, any type. */
TEST(bwd_exponent_is_at_most_zero)
{
	const double xs[] = { -INFINITY, -1e30, -1, -0x1p-1074, 0, 0x1p-1074, 1, 2.7e11, INFINITY };

	for (size_t i = 0; i < sizeof(xs) / sizeof(xs[0]); i++) {
		const double want = xs[i] > 0 ? 0 : xs[i];

		EXPECT_EQ(want, APE_BWD_EXPONENT(xs[i])) TH_LOG("x = %g", xs[i]);
		EXPECT_EQ((float)want, APE_BWD_EXPONENT((float)xs[i])) TH_LOG("x = %g", xs[i]);
		EXPECT_LE(exp(APE_BWD_EXPONENT(xs[i])), 1.0);
	}
	EXPECT_TRUE(isnan(APE_BWD_EXPONENT(NAN)));
	EXPECT_TRUE(isnan(APE_BWD_EXPONENT(NAN * 1.0f)));
}

/* The cutoff: weights below it are 1e-38 of the row's largest, about FLT_MIN; the log2 form is
 * the same number. */
TEST(exp_cutoff_is_where_float_turns_subnormal)
{
	EXPECT_GE(expf(APE_EXP_CUTOFF), FLT_MIN);
	EXPECT_LT(expf(APE_EXP_CUTOFF - 1), FLT_MIN);
	EXPECT_LE(fabs(APE_EXP2_CUTOFF - APE_EXP_CUTOFF / log(2.0)), 1e-5);
	EXPECT_GE(exp2f(APE_EXP2_CUTOFF), FLT_MIN);
}

/*
 * The diagnostics' running sums: keys fed one by one through the online update (rescale,
 * terms), and a row split into two partial results merged by ape_merge_entropy(), against the
 * entropy -sum P ln P and the mean distance sum P |n| in long double.
 */
TEST(diagnostics_running_sums_against_long_double)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 500; c++) {
		const int n = (int)ape_rng_range(&rng, 1, 200),
			  cut = (int)ape_rng_range(&rng, 0, n);
		double s[200], dist[200];
		long double mx = -INFINITY, z = 0, ent = 0, md = 0;
		double part_lse[2], part_ent[2], part_md[2];

		for (int j = 0; j < n; j++) {
			s[j] = ape_rng_normal(&rng) * (c % 4 + 1) * 3;
			dist[j] = (double)ape_rng_range(&rng, 0, 1000);
			mx = fmaxl(mx, s[j]);
		}
		for (int j = 0; j < n; j++)
			z += expl(s[j] - mx);
		for (int j = 0; j < n; j++) {
			const long double p = expl(s[j] - mx) / z;

			ent -= p * logl(p);
			md += p * dist[j];
		}
		/* the two sides [0, cut) and [cut, n), each online */
		for (int side = 0; side < 2; side++) {
			double m = -INFINITY, l = 0, s1 = 0, s2 = 0;

			for (int j = side ? cut : 0; j < (side ? n : cut); j++) {
				const double mn = ape_merge_max(m, s[j]);
				const double f = ape_merge_factor(m, mn);
				const double e = exp(s[j] - mn);

				s1 = ape_diag_rescale_s1(s1, l, f, m, mn);
				s2 *= f;
				l = l * f + e;
				m = mn;
				s1 += ape_diag_s1_term(e, s[j] - m, 0);
				s2 += e * dist[j];
				ASSERT_EQ((float)e * (float)(s[j] - m),
					  ape_diag_s1_term_f((float)e, (float)(s[j] - m)));
			}
			part_lse[side] = l > 0 ? m + log(l) : -INFINITY;
			part_ent[side] = ape_diag_entropy(l, s1);
			part_md[side] = ape_diag_distance(l, s2);
		}
		{
			double lm = 0, w1 = 1, w2 = 0, lw1 = 0, lw2 = -INFINITY;
			const int how =
				ape_merge_lse(part_lse[0], part_lse[1], &lm, &w1, &w2, &lw1, &lw2);

			if (how == APE_MERGE_TAKE) {
				w1 = 0;
				w2 = 1;
				lw2 = 0;
			} else if (how == APE_MERGE_KEEP) {
				w1 = 1;
				w2 = 0;
				lw1 = 0;
			}
			ASSERT_LE(fabsl(ape_merge_entropy(w1, part_ent[0], lw1, w2, part_ent[1],
							  lw2) -
					ent),
				  1e-9L * (1 + ent));
			ASSERT_LE(fabsl(w1 * part_md[0] + w2 * part_md[1] - md), 1e-9L * (1 + md));
		}
	}
	/* the float32 term, the macro and the empty cases */
	EXPECT_EQ(0.0f, ape_diag_s1_term_f(0.0f, -INFINITY));
	EXPECT_EQ(0.5f * -2.0f, ape_diag_s1_term_f(0.5f, -2.0f));
	EXPECT_EQ(0.5 * (3 + -1.5 * 2), APE_DIAG_RESCALE_S1(3.0, 2.0, 0.5, -1.5));
	EXPECT_EQ(0.0, ape_diag_rescale_s1(5, 1, 0, -INFINITY, 3));
	EXPECT_EQ(0.0, ape_diag_entropy(0, 0));
	EXPECT_EQ(0.0, ape_diag_distance(0, 0));
	EXPECT_TRUE(isnan(ape_diag_entropy(NAN, 0)));
	EXPECT_TRUE(isnan(ape_diag_distance(NAN, 1)));
	EXPECT_EQ(0.0, ape_diag_entropy(1, 1e-17)); /* rounding below 0: clamped */
	EXPECT_EQ(0.0, ape_merge_entropy(0, 1, -INFINITY, 0, 2, -INFINITY));
}

/* APE_DIAG_SKIP_TOL's claim: eta (1 + ln(1/eta)) + eta ln Lk below 4e-6 for any Lk < 2^63. */
TEST(diag_skip_tol_meets_its_claim)
{
	const long double eta = APE_DIAG_SKIP_TOL;

	EXPECT_LT(eta * (1 + logl(1 / eta)) + eta * logl(0x1p63L), 4e-6L);
	EXPECT_LT(eta, 6e-8L);
}

/* ---- gradients, against central differences of the forward terms in long double */

static long double alpha_l(long double lambda, long double sigma)
{
	return 1 + lambda / (1 + expl(sigma));
}

TEST(gradient_terms_against_finite_differences)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 2000; c++) {
		const long double h = 1e-6L;
		const double lambda = ape_rng_uniform(&rng) * 2, sigma = ape_rng_uniform(&rng) * 4;
		const double an = (double)ape_rng_range(&rng, 0, 100000);
		const double x = ape_rng_normal(&rng), y = ape_rng_normal(&rng);
		const double u = ape_rng_normal(&rng), w = ape_rng_normal(&rng);
		const double n = (double)ape_rng_range(&rng, -1000, 1000),
			     omega = ape_rng_uniform(&rng);
		const double alpha = (double)alpha_l(lambda, sigma);
		const double theta = n * omega / alpha;
		long double fd;

		fd = (alpha_l(lambda + h, sigma) - alpha_l(lambda - h, sigma)) / (2 * h);
		ASSERT_LE(fabsl(ape_grad_gate(sigma) - fd), 1e-7L);
		fd = (alpha_l(lambda, sigma + h) - alpha_l(lambda, sigma - h)) / (2 * h);
		ASSERT_LE(fabsl(ape_grad_dalpha_dsigma(lambda, sigma) - fd), 1e-7L);
		{ /* a step that keeps the truncation error below the rounding at any an */
			const long double hl = 1e-7L / (1 + an);

			fd = (1 / (1 + (lambda + hl) * (long double)an) -
			      1 / (1 + (lambda - hl) * (long double)an)) /
			     (2 * hl);
		}
		ASSERT_LE(fabsl(ape_grad_dtemp_dlambda(lambda, an) - fd), 1e-6L * (1 + fabsl(fd)));
		/* the bias is linear in delta, beta, gamma */
		ASSERT_EQ(ape_bias(1, 0, 0, an), ape_grad_dbias_ddelta(an));
		ASSERT_EQ(ape_bias(0, 1, 0, an), ape_grad_dbias_dbeta(an));
		ASSERT_EQ(ape_bias(0, 0, 1, an), ape_grad_dbias_dgamma(an));
		{ /* one pair's rotated dot, as a function of alpha */
#define PAIR_DOT(al)                                                                               \
	((x * u + y * w) * cosl(n * omega / (al)) + (x * w - y * u) * sinl(n * omega / (al)))
			fd = (PAIR_DOT(alpha + h) - PAIR_DOT(alpha - h)) / (2 * h);
#undef PAIR_DOT
			ASSERT_LE(fabsl(ape_grad_ddot_dalpha(x, y, u, w, cos(theta), sin(theta),
							     theta, alpha) -
					fd),
				  1e-5L * (1 + fabsl(fd)));
			ASSERT_EQ(ape_grad_ddot_dalpha(x, y, u, w, cos(theta), sin(theta), theta,
						       alpha),
				  APE_GRAD_DDOT_DALPHA_THETA(x, y, u, w, cos(theta), sin(theta),
							     theta) /
					  alpha);
		}
	}
	{ /* d(sigma)/d(q_d) = (q_d - mean) coef, by central differences of sigma itself */
		const int D = 6;
		double q[6] = { 0.3, -1.2, 2.0, 0.7, -0.4, 1.1 };
		long double mean = 0, ss = 0, sigma;

		for (int d = 0; d < D; d++)
			mean += q[d] / D;
		for (int d = 0; d < D; d++)
			ss += (q[d] - mean) * (q[d] - mean);
		sigma = sqrtl(ss / (D - 1));
		for (int d = 0; d < D; d++) {
			long double sp = 0, sm = 0, mp = 0, mm = 0;
			const long double h = 1e-6L;

			for (int e = 0; e < D; e++) {
				mp += (q[e] + (e == d ? h : 0)) / D;
				mm += (q[e] - (e == d ? h : 0)) / D;
			}
			for (int e = 0; e < D; e++) {
				const long double vp = q[e] + (e == d ? h : 0) - mp;
				const long double vm = q[e] - (e == d ? h : 0) - mm;

				sp += vp * vp;
				sm += vm * vm;
			}
			EXPECT_LE(fabsl(ape_grad_dsigma_coef(D, (double)sigma) * (q[d] - mean) -
					(sqrtl(sp / (D - 1)) - sqrtl(sm / (D - 1))) / (2 * h)),
				  1e-7L);
		}
		EXPECT_EQ(0.0, ape_grad_dsigma_coef(D, 0)); /* a constant row: 0 by the spec */
	}
}

TEST_HARNESS_MAIN
