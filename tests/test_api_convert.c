/* SPDX-License-Identifier: MIT */
/*
 * The public API's contract, ape_convert() (ape.h, "Data types and tensors"): every 16-bit
 * pattern round-trips, narrowing rounds to nearest even (checked at every midpoint and on random
 * floats against a long double search), NaN stays NaN, f16 <-> bf16 rounds once, and the errors.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/apitest.h"
#include "common/naive.h"

/* ---------------------------------------------------------------- storage conversion */

static bool is_nan16(uint16_t bits, bool bf16)
{
	uint16_t exp = bf16 ? 0x7f80 : 0x7c00;

	return (bits & exp) == exp && (bits & (uint16_t)~(exp | 0x8000));
}

static uint32_t f32_bits(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

static float bits_f32(uint32_t u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static uint16_t to16(float f, ape_dtype dt)
{
	uint16_t h = 0x1234;

	ape_convert(&h, dt, &f, APE_F32, 1);
	return h;
}

/* Every 16-bit pattern widens exactly and narrows back to itself; NaN stays NaN. */
static void check_roundtrip(struct __test_metadata *_metadata, ape_dtype dt)
{
	const bool bf16 = dt == APE_BF16;
	uint16_t *h = malloc(65536 * sizeof(*h)), *back = malloc(65536 * sizeof(*back));
	float *f = malloc(65536 * sizeof(*f));
	int bad_value = 0, bad_back = 0;

	ASSERT_TRUE(h && back && f);
	for (uint32_t i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	ASSERT_EQ(0, ape_convert(f, APE_F32, h, dt, 65536));
	ASSERT_EQ(0, ape_convert(back, dt, f, APE_F32, 65536));
	for (uint32_t i = 0; i < 65536; i++) {
		long double want = naive_decode16(h[i], bf16);

		if (is_nan16(h[i], bf16)) {
			bad_value += !isnan(f[i]);
			bad_back += !is_nan16(back[i], bf16);
			continue;
		}
		if ((long double)f[i] != want || !signbit(f[i]) != !signbit(want)) {
			if (bad_value++ < 5)
				TH_LOG("%s 0x%04x widened to %a, want %La", ape_dtype_name(dt), i,
				       (double)f[i], want);
		}
		if (back[i] != h[i] && bad_back++ < 5)
			TH_LOG("%s 0x%04x came back as 0x%04x", ape_dtype_name(dt), i, back[i]);
	}
	EXPECT_EQ(0, bad_value);
	EXPECT_EQ(0, bad_back);
	free(h);
	free(back);
	free(f);
}

TEST(convert_f16_roundtrip_exhaustive)
{
	check_roundtrip(_metadata, APE_F16);
}

TEST(convert_bf16_roundtrip_exhaustive)
{
	check_roundtrip(_metadata, APE_BF16);
}

/*
 * The exact midpoint between every two adjacent finite values (subnormals included) must round to
 * the one with the even pattern, and the floats just beside it to the nearer one. The last pair
 * is the largest finite value and the first power of two past it: its midpoint overflows.
 */
static void check_ties(struct __test_metadata *_metadata, ape_dtype dt)
{
	const bool bf16 = dt == APE_BF16;
	const uint16_t max_finite = bf16 ? 0x7f7f : 0x7bff, inf = bf16 ? 0x7f80 : 0x7c00;
	int bad = 0;

	for (uint32_t lo = 0; lo <= max_finite; lo++) {
		const uint16_t hi = (uint16_t)(lo + 1);
		long double a = naive_decode16((uint16_t)lo, bf16);
		long double b = hi == inf ? ldexpl(1, bf16 ? 128 : 16) : naive_decode16(hi, bf16);
		long double mid = (a + b) / 2;
		float m = (float)mid, below = nextafterf(m, 0), above = nextafterf(m, INFINITY);
		uint16_t even = (lo & 1) ? hi : (uint16_t)lo;
		uint16_t got_m = to16(m, dt), got_below = to16(below, dt);
		uint16_t got_above = to16(above, dt), got_neg = to16(-m, dt);

		ASSERT_TRUE((long double)m == mid) TH_LOG("midpoint %La is not a float", mid);
		if (got_m != even || got_below != lo || got_above != hi ||
		    got_neg != (even | 0x8000)) {
			if (bad++ < 5)
				TH_LOG("%s: between 0x%04x and 0x%04x: %a -> 0x%04x (want 0x%04x), "
				       "below -> 0x%04x, above -> 0x%04x, negated -> 0x%04x",
				       ape_dtype_name(dt), lo, hi, (double)m, got_m, even,
				       got_below, got_above, got_neg);
		}
	}
	EXPECT_EQ(0, bad);
}

TEST(convert_f16_ties_to_even)
{
	check_ties(_metadata, APE_F16);
	/* the overflow threshold, spelled out */
	EXPECT_EQ(0x7c00, to16(65520.0f, APE_F16));
	EXPECT_EQ(0x7bff, to16(65519.99f, APE_F16));
	EXPECT_EQ(0x7bff, to16(65504.0f, APE_F16));
	EXPECT_EQ(0xfc00, to16(-65520.0f, APE_F16));
	EXPECT_EQ(0x7c00, to16(1e6f, APE_F16));
	EXPECT_EQ(0x7c00, to16(FLT_MAX, APE_F16));
	EXPECT_EQ(0x7c00, to16(INFINITY, APE_F16));
	EXPECT_EQ(0xfc00, to16(-INFINITY, APE_F16));
	/* below half the smallest subnormal (2^-25): zero, sign kept; 2^-25 itself ties to 0 */
	EXPECT_EQ(0x0000, to16(0x1p-25f, APE_F16));
	EXPECT_EQ(0x8000, to16(-0x1p-25f, APE_F16));
	EXPECT_EQ(0x0001, to16(nextafterf(0x1p-25f, 1), APE_F16));
	EXPECT_EQ(0x0000, to16(nextafterf(0x1p-25f, 0), APE_F16));
	EXPECT_EQ(0x0000, to16(0x1p-26f, APE_F16));
	EXPECT_EQ(0x0000, to16(FLT_MIN, APE_F16));
	EXPECT_EQ(0x0000, to16(0x1p-149f, APE_F16));
	EXPECT_EQ(0x8000, to16(-0x1p-149f, APE_F16));
	EXPECT_EQ(0x0000, to16(0.0f, APE_F16));
	EXPECT_EQ(0x8000, to16(-0.0f, APE_F16));
	/* 1.5 * 2^-24 ties between subnormals 1 and 2: even is 2 */
	EXPECT_EQ(0x0002, to16(0x1.8p-24f, APE_F16));
	/* the smallest normal half, reached from below by rounding */
	EXPECT_EQ(0x0400, to16(nextafterf(0x1p-14f, 0), APE_F16));
}

TEST(convert_bf16_ties_to_even)
{
	check_ties(_metadata, APE_BF16);
	EXPECT_EQ(0x7f80, to16(FLT_MAX, APE_BF16));
	EXPECT_EQ(0x7f80, to16(INFINITY, APE_BF16));
	EXPECT_EQ(0xff80, to16(-INFINITY, APE_BF16));
	EXPECT_EQ(0x0000, to16(0x1p-134f, APE_BF16));
	EXPECT_EQ(0x0000, to16(0x1p-149f, APE_BF16));
	EXPECT_EQ(0x8000, to16(-0x1p-149f, APE_BF16));
	EXPECT_EQ(0x0000, to16(0.0f, APE_BF16));
	EXPECT_EQ(0x8000, to16(-0.0f, APE_BF16));
	EXPECT_EQ(0x3f80, to16(1.0f, APE_BF16));
}

TEST(convert_nan_stays_nan)
{
	static const uint32_t nans[] = { 0x7f800001u, 0x7fc00000u, 0xffc00000u, 0x7f802000u,
					 0x7f801fffu, 0xffffffffu, 0x7fbfffffu, 0xff800001u };

	for (size_t i = 0; i < sizeof(nans) / sizeof(nans[0]); i++) {
		float f = bits_f32(nans[i]);

		EXPECT_TRUE(is_nan16(to16(f, APE_F16), false))
		TH_LOG("0x%08x -> f16 0x%04x", nans[i], to16(f, APE_F16));
		EXPECT_TRUE(is_nan16(to16(f, APE_BF16), true))
		TH_LOG("0x%08x -> bf16 0x%04x", nans[i], to16(f, APE_BF16));
	}
}

/* Sorted positive finite values of a 16-bit type; pattern i is value i. */
static long double *value_table(bool bf16, uint32_t *count)
{
	uint32_t n = (bf16 ? 0x7f7fu : 0x7bffu) + 1;
	long double *v = malloc(n * sizeof(*v));

	for (uint32_t i = 0; v && i < n; i++)
		v[i] = naive_decode16((uint16_t)i, bf16);
	*count = n;
	return v;
}

/* The nearest value by search, ties to the even pattern, overflow past the last midpoint. */
static uint16_t nearest16(const long double *v, uint32_t n, bool bf16, float x)
{
	long double ax = fabsl((long double)x), next = ldexpl(1, bf16 ? 128 : 16);
	uint16_t sign = signbit(x) ? 0x8000 : 0, pick;
	uint32_t lo = 0, hi = n - 1;

	while (lo < hi) { /* largest i with v[i] <= ax */
		uint32_t mid = lo + (hi - lo + 1) / 2;

		if (v[mid] <= ax)
			lo = mid;
		else
			hi = mid - 1;
	}
	{
		long double a = v[lo], b = lo + 1 < n ? v[lo + 1] : next;
		long double da = ax - a, db = b - ax;

		if (da < db)
			pick = (uint16_t)lo;
		else if (db < da)
			pick = (uint16_t)(lo + 1);
		else
			pick = (uint16_t)((lo & 1) ? lo + 1 : lo);
	}
	return sign | pick; /* lo + 1 == n is the infinity pattern */
}

static float random_float(ape_rng *r, bool bf16)
{
	uint64_t x = ape_rng_next(r);
	uint32_t u = (uint32_t)x, sign = u & 0x80000000u;

	switch ((x >> 32) % 3) {
	case 0: /* any pattern: every exponent equally likely */
		break;
	case 1: { /* exponents around the type's range, where the rounding happens */
		int lo = bf16 ? 127 - 135 : 127 - 27, hi = bf16 ? 127 + 128 : 127 + 17;
		int e = (int)ape_rng_range(r, lo < 0 ? 0 : lo, hi > 254 ? 254 : hi);

		u = sign | ((uint32_t)e << 23) | (u & 0x7fffffu);
		break;
	}
	default: { /* a few ulps around a midpoint of two adjacent 16-bit values */
		uint32_t m = (uint32_t)ape_rng_range(r, 0, bf16 ? 0x7f7e : 0x7bfe);
		long double a = naive_decode16((uint16_t)m, bf16), b = naive_decode16((uint16_t)(m + 1), bf16);
		float f = (float)((a + b) / 2);

		u = f32_bits(f) + (uint32_t)ape_rng_range(r, -3, 3);
		u = sign | (u & 0x7fffffffu);
		break;
	}
	}
	if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu))
		u &= ~0x7fffffu; /* NaN: tested elsewhere; use the infinity */
	return bits_f32(u);
}

static void check_random_vs_reference(struct __test_metadata *_metadata, ape_dtype dt)
{
	const bool bf16 = dt == APE_BF16;
	const size_t n = ape_test_slow() ? 20000 : 300000;
	float *x = malloc(n * sizeof(*x));
	uint16_t *got = malloc(n * sizeof(*got));
	uint32_t nv;
	long double *v = value_table(bf16, &nv);
	ape_rng rng;
	int bad = 0;

	ASSERT_TRUE(x && got && v);
	ape_rng_init(&rng, bf16 ? "convert_bf16_random" : "convert_f16_random");
	for (size_t i = 0; i < n; i++)
		x[i] = random_float(&rng, bf16);
	ASSERT_EQ(0, ape_convert(got, dt, x, APE_F32, n));
	for (size_t i = 0; i < n; i++) {
		uint16_t want = nearest16(v, nv, bf16, x[i]);

		if (got[i] != want && bad++ < 5)
			TH_LOG("%s: %a (0x%08x) -> 0x%04x, nearest is 0x%04x", ape_dtype_name(dt),
			       (double)x[i], f32_bits(x[i]), got[i], want);
	}
	EXPECT_EQ(0, bad);
	free(x);
	free(got);
	free(v);
}

TEST(convert_f16_random_vs_long_double)
{
	check_random_vs_reference(_metadata, APE_F16);
}

TEST(convert_bf16_random_vs_long_double)
{
	check_random_vs_reference(_metadata, APE_BF16);
}

/* f16 <-> bf16 directly rounds once, like going through f32; in place works for equal sizes. */
TEST(convert_between_16bit_types)
{
	uint16_t *h = malloc(65536 * 2), *direct = malloc(65536 * 2), *two = malloc(65536 * 2);
	float *f = malloc(65536 * sizeof(float));
	int bad = 0;

	ASSERT_TRUE(h && direct && two && f);
	for (uint32_t i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	for (int pass = 0; pass < 2; pass++) {
		ape_dtype from = pass ? APE_BF16 : APE_F16, to = pass ? APE_F16 : APE_BF16;

		ASSERT_EQ(0, ape_convert(direct, to, h, from, 65536));
		ASSERT_EQ(0, ape_convert(f, APE_F32, h, from, 65536));
		ASSERT_EQ(0, ape_convert(two, to, f, APE_F32, 65536));
		for (uint32_t i = 0; i < 65536; i++) {
			bool nan = is_nan16(h[i], from == APE_BF16);

			if (nan ? !is_nan16(direct[i], to == APE_BF16) : direct[i] != two[i])
				if (bad++ < 5)
					TH_LOG("%s 0x%04x -> %s 0x%04x, via f32 0x%04x",
					       ape_dtype_name(from), i, ape_dtype_name(to),
					       direct[i], two[i]);
		}
		memcpy(two, h, 65536 * 2);
		ASSERT_EQ(0, ape_convert(two, to, two, from, 65536));
		EXPECT_EQ(0, memcmp(direct, two, 65536 * 2)) TH_LOG("in place differs");
	}
	EXPECT_EQ(0, bad);

	/* same type: a copy, and a no-op in place */
	for (uint32_t i = 0; i < 1024; i++)
		f[i] = (float)i * 0.37f - 100;
	memcpy(two, f, 1024 * sizeof(float));
	ASSERT_EQ(0, ape_convert(f + 2048, APE_F32, f, APE_F32, 1024));
	EXPECT_EQ(0, memcmp(f, f + 2048, 1024 * sizeof(float)));
	ASSERT_EQ(0, ape_convert(f, APE_F32, f, APE_F32, 1024));
	EXPECT_EQ(0, memcmp(f, two, 1024 * sizeof(float)));
	free(h);
	free(direct);
	free(two);
	free(f);
}

TEST(convert_errors)
{
	float src[4] = { 1, 2, 3, 4 };
	uint16_t dst[4] = { 0xaaaa, 0xaaaa, 0xaaaa, 0xaaaa };

	EXPECT_EQ(APE_EINVAL, ape_convert(dst, (ape_dtype)7, src, APE_F32, 4));
	EXPECT_MSG("ape_convert");
	EXPECT_MSG("dst_type");
	EXPECT_EQ(APE_EINVAL, ape_convert(dst, APE_F16, src, (ape_dtype)7, 4));
	EXPECT_MSG("src_type");
	EXPECT_EQ(APE_EINVAL, ape_convert(dst, APE_F16, src, (ape_dtype)-1, 4));
	EXPECT_EQ(APE_EINVAL, ape_convert(NULL, APE_F16, src, APE_F32, 4));
	EXPECT_MSG("dst");
	EXPECT_EQ(APE_EINVAL, ape_convert(dst, APE_F16, NULL, APE_F32, 4));
	EXPECT_MSG("src");
	EXPECT_EQ(APE_EINVAL, ape_convert(NULL, APE_F32, NULL, APE_F32, 1));
	for (int i = 0; i < 4; i++) {
		EXPECT_EQ(0xaaaa, dst[i]) TH_LOG("a failed conversion wrote element %d", i);
	}
	/* nothing to convert: NULL is fine */
	EXPECT_EQ(0, ape_convert(NULL, APE_F16, NULL, APE_F32, 0));
	EXPECT_EQ(0, ape_convert(NULL, APE_BF16, NULL, APE_F16, 0));
}

TEST_HARNESS_MAIN
