/* SPDX-License-Identifier: MIT */
/*
 * The public API's contract, ape_visible_pairs() (ape.h, "Attention"): against brute force on
 * random small cases, exact or APE_EOVERFLOW on huge ones (a closed form: no time), no pairs
 * without heads, and the errors.
 */
#include <stdint.h>
#include <time.h>

#include "ape_test.h"
#include "common/apitest.h"

/* ---------------------------------------------------------------- visible pairs */

static uint64_t brute_pairs(bool causal, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t qs,
			    int64_t ks)
{
	uint64_t n = 0;

	for (int64_t i = 0; i < Lq; i++)
		for (int64_t j = 0; j < Lk; j++)
			n += !causal || ks + j <= qs + i;
	return n * (uint64_t)B * (uint64_t)H;
}

TEST(visible_pairs_brute_force)
{
	const int iters = ape_test_slow() ? 2000 : 20000;
	ape_rng rng;
	int bad = 0;

	ape_rng_init(&rng, "visible_pairs_brute_force");
	for (int it = 0; it < iters; it++) {
		ape_attn_desc d;
		int64_t B = ape_rng_range(&rng, 0, 3), H = ape_rng_range(&rng, 0, 3);
		int64_t Lq = ape_rng_range(&rng, 0, 40), Lk = ape_rng_range(&rng, 0, 40), qs;
		uint64_t got = 0xdeadbeef, want;
		int ret;

		ape_attn_desc_init(&d);
		d.causal = ape_rng_next(&rng) & 1;
		/* small positions mostly, sometimes far from 0 (only differences matter) */
		d.k_start = ape_rng_range(&rng, -50, 50);
		if (ape_rng_next(&rng) % 4 == 0)
			d.k_start += (int64_t)(ape_rng_next(&rng) % (1ull << 60)) - (1ll << 59);
		d.q_start_set = ape_rng_next(&rng) & 1;
		/* offsets reach far before (no key visible) and far after (every key visible) */
		d.q_start = d.k_start + ape_rng_range(&rng, -100, 100);
		qs = d.q_start_set ? d.q_start : d.k_start + Lk - Lq;
		want = brute_pairs(d.causal, B, H, Lq, Lk, qs, d.k_start);
		ret = ape_visible_pairs(&d, B, H, Lq, Lk, &got);
		if ((ret || got != want) && bad++ < 5)
			TH_LOG("causal %d B %lld H %lld Lq %lld Lk %lld q_start %lld k_start %lld: "
			       "ret %d, %llu pairs, want %llu (%s)",
			       d.causal, (long long)B, (long long)H, (long long)Lq, (long long)Lk,
			       (long long)qs, (long long)d.k_start, ret, (unsigned long long)got,
			       (unsigned long long)want, ape_last_error());
	}
	EXPECT_EQ(0, bad);
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct huge_case {
	bool causal, q_set;
	int64_t B, H, Lq, Lk, q_start, k_start;
	int ret;
	uint64_t pairs;
};

TEST(visible_pairs_huge)
{
	const int64_t T40 = 1ll << 40, T32 = 1ll << 32, T31 = 1ll << 31;
	const struct huge_case cases[] = {
		/* full causal square of 2^40: about 2^79 pairs */
		{ true, false, 1, 1, T40, T40, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 1, 1, T40, T40, 0, 0, APE_EOVERFLOW, 0 },
		{ true, false, 1, 1, T32 - 1, T32 - 1, 0, 0, 0,
		  (uint64_t)(T32 - 1) * (uint64_t)T31 },
		{ true, false, 1, 1, 2 * T32, 2 * T32, 0, 0, APE_EOVERFLOW, 0 },
		/* exactly 2^64 - 1, then exactly 2^64 */
		{ false, false, 1, 1, T32 - 1, T32 + 1, 0, 0, 0, UINT64_MAX },
		{ false, false, 1, 1, T32, T32, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 3, 1, T31, T31, 0, 0, 0, 3ull << 62 },
		{ false, false, 4, 1, T31, T31, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 2, 2, T31, T31, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 1, 3, T31, T31, 0, 0, 0, 3ull << 62 },
		/* queries entirely before the keys, entirely after, and touching at one pair */
		{ true, true, 1, 1, T40, T40, -2 * T40, 0, 0, 0 },
		{ true, true, 1, 1, T40, 4, 10, 0, 0, 4 * (uint64_t)T40 },
		{ true, true, 1, 1, T40, T40, -T40 + 1, 0, 0, 1 },
		{ true, false, 1, 1, 1, T40, 0, 0, 0, (uint64_t)T40 },
		/* end-aligned: only the last Lk rows see keys, a triangle */
		{ true, false, 7, 5, T40, 1 << 20, 0, 0, 0, 35 * ((1ull << 39) + (1ull << 19)) },
		/* far positions: fine while the ends fit, EOVERFLOW when they do not */
		{ true, false, 1, 1, T40, T40, 0, INT64_MAX - T40, APE_EOVERFLOW, 0 },
		{ true, false, 1, 1, T31, T31, 0, INT64_MAX - T31 + 1, 0,
		  (uint64_t)T31 * (uint64_t)(T31 + 1) / 2 },
		{ true, false, 1, 1, 5, 6, 0, INT64_MAX - 2, APE_EOVERFLOW, 0 },
		{ true, true, 1, 1, 5, 6, INT64_MIN, 10, APE_EOVERFLOW, 0 },
		{ false, true, 1, 1, 1, 1, INT64_MAX, INT64_MIN, APE_EOVERFLOW, 0 },
	};
	double t0 = now_s();

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct huge_case *c = &cases[i];
		ape_attn_desc d;
		uint64_t got = 0xdeadbeef;
		int ret;

		ape_attn_desc_init(&d);
		d.causal = c->causal;
		d.q_start_set = c->q_set;
		d.q_start = c->q_start;
		d.k_start = c->k_start;
		ret = ape_visible_pairs(&d, c->B, c->H, c->Lq, c->Lk, &got);
		EXPECT_EQ(c->ret, ret) TH_LOG("case %zu: %s", i, ape_last_error());
		if (c->ret == 0 && ret == 0) {
			EXPECT_EQ(c->pairs, got) TH_LOG("case %zu", i);
		}
		if (c->ret) {
			EXPECT_EQ(0xdeadbeefu, got) TH_LOG("case %zu: *out written on failure", i);
			EXPECT_MSG("ape_visible_pairs");
		}
	}
	/* a closed form: absurd lengths must cost nothing */
	EXPECT_GT(2.0, now_s() - t0);
}

/* With no batch or no head there is no pair at all, however long the sequences. */
TEST(visible_pairs_zero_heads_do_not_overflow)
{
	const int64_t T40 = 1ll << 40;
	ape_attn_desc d;
	uint64_t got = 0xdeadbeef;

	ape_attn_desc_init(&d);
	d.causal = false;
	EXPECT_EQ(0, ape_visible_pairs(&d, 0, 1, T40, T40, &got)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0u, got);
	got = 0xdeadbeef;
	EXPECT_EQ(0, ape_visible_pairs(&d, 1 << 20, 0, 1ll << 31, 1ll << 31, &got))
	TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0u, got);
}

TEST(visible_pairs_errors)
{
	static const int64_t sizes[][4] = {
		{ -1, 1, 1, 1 }, { 1, -1, 1, 1 }, { 1, 1, -1, 1 },
		{ 1, 1, 1, -1 }, { INT64_MIN, 1, 1, 1 },
	};
	ape_attn_desc d;
	uint64_t got = 0xdeadbeef;

	ape_attn_desc_init(&d);
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		EXPECT_EQ(APE_EINVAL, ape_visible_pairs(&d, sizes[i][0], sizes[i][1], sizes[i][2],
							sizes[i][3], &got))
		TH_LOG("sizes %zu", i);
		EXPECT_MSG("ape_visible_pairs");
	}
	EXPECT_EQ(APE_EINVAL, ape_visible_pairs(NULL, 1, 1, 1, 1, &got));
	EXPECT_MSG("desc");
	EXPECT_EQ(APE_EINVAL, ape_visible_pairs(&d, 1, 1, 1, 1, NULL));
	EXPECT_MSG("out");
	d.struct_size = 0;
	EXPECT_EQ(APE_EINVAL, ape_visible_pairs(&d, 1, 1, 1, 1, &got));
	EXPECT_MSG("struct_size");
	EXPECT_EQ(0xdeadbeefu, got);

	ape_attn_desc_init(&d);
	EXPECT_EQ(0, ape_visible_pairs(&d, 0, 0, 0, 0, &got));
	EXPECT_EQ(0u, got);
}

TEST_HARNESS_MAIN
