/* SPDX-License-Identifier: MIT */
/*
 * The reference backend against the spec: against an independent long-double evaluation on
 * hundreds of random cases, against textbook RoPE attention (identities 1 and 2), against itself
 * shifted by 2^40 (identity 3) and split into chunks (identity 4), and on the edge cases.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/naive.h"
#include "common/problem.h"

/* Allowed difference from the long-double evaluation: storing O rounds it (half an ulp of the
 * output type, relative to |O| <= max|V|); everything before that is float64. */
static double ref_tol_o(ape_dtype out)
{
	return out == APE_F32 ? 1e-6 : out == APE_F16 ? 0x1p-11 + 1e-6 : 0x1p-8 + 1e-6;
}

#define REF_TOL_LSE 1e-6

/* ref vs naive on one problem; returns 0 when within REF_TOL, else logs and returns -1. */
static int check_against_naive(struct __test_metadata *_metadata, ape_device *dev,
			       test_problem *tp, const char *what)
{
	double err_o, err_lse, m;

	if (test_problem_run(tp, dev)) {
		TH_LOG("%s: forward failed: %s", what, ape_last_error());
		return -1;
	}
	if (test_problem_naive(tp)) {
		TH_LOG("%s: naive evaluation out of memory", what);
		return -1;
	}
	m = fmax(1.0, test_tensor_maxabs(&tp->v.t));
	err_o = test_problem_err_o(tp) / m;
	err_lse = test_problem_rel_err_lse(tp);
	if (err_o > ref_tol_o(tp->o.t.dtype) || err_lse > REF_TOL_LSE) {
		char desc[512];

		test_problem_describe(tp, desc, sizeof(desc));
		TH_LOG("%s: %s: O error %.3g (x max|V|), LSE error %.3g", what, desc, err_o, err_lse);
		return -1;
	}
	return 0;
}

TEST(random_cases_match_naive)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	int ncases = ape_test_slow() ? 12 : 300, failed = 0;
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "random_cases_match_naive");
	for (int c = 0; c < ncases; c++) {
		test_problem tp;

		ASSERT_EQ(0, test_problem_random(&tp, &rng, 0));
		failed += check_against_naive(_metadata, dev, &tp, "random") != 0;
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, failed);
	ape_context_destroy(ctx);
}

/* Every storage type and both output types, strided and contiguous, explicitly. */
TEST(storage_types_and_layouts)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "storage_types_and_layouts");
	for (int t = 0; t < 3; t++)
		for (int strided = 0; strided < 2; strided++)
			for (int out_f32 = 0; out_f32 < 2; out_f32++) {
				test_problem_shape sh = { 2, 4, 2, 7, 9, 16 };
				test_problem tp;

				ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[t], strided));
				test_problem_random_params(&tp, &rng);
				if (out_f32)
					ASSERT_EQ(0, test_problem_set_out_dtype(&tp, APE_F32));
				EXPECT_EQ(0, check_against_naive(_metadata, dev, &tp, "storage"));
				if (strided)
					EXPECT_EQ(0, test_problem_padding_intact(&tp));
				test_problem_free(&tp);
			}
	ape_context_destroy(ctx);
}

/* Awkward and larger sizes: 1, 63, 4097 rows. */
TEST(awkward_sizes)
{
	static const int64_t sizes[] = { 1, 63, 4097 };
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "awkward_sizes");
	for (int i = 0; i < 3; i++) {
		int64_t L = sizes[i];
		/* 4097 keys x 4097 queries is slow in long double: sample 5 query rows */
		int64_t Lq = L > 1000 ? 5 : L;
		test_problem_shape sh = { 1, 2, 1, Lq, L, 64 };
		test_problem tp;

		if (ape_test_slow() && L > 100)
			continue;
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, 0));
		test_problem_random_params(&tp, &rng);
		tp.desc.causal = true;
		tp.desc.q_start_set = false; /* end-aligned: the last query sees all 4097 keys */
		EXPECT_EQ(0, check_against_naive(_metadata, dev, &tp, "awkward"));
		test_problem_free(&tp);
	}
	ape_context_destroy(ctx);
}

/*
 * Identities 1 and 2: with lambda = beta = gamma = 0 (and delta = 0 for identity 1) APE is RoPE
 * attention with an ALiBi-style bias, computed here the textbook way: rotate q and k by their
 * absolute positions (interpolated, p / rope_scale, as position interpolation defines it), then
 * softmax(scale q.k - delta |n|) V.
 */
static void textbook_rope(const test_problem *tp, double delta, double *o, double *lse)
{
	const ape_tensor *q = &tp->q.t, *k = &tp->k.t, *v = &tp->v.t;
	const int64_t B = q->shape[0], H = q->shape[1], Lq = q->shape[2], D = q->shape[3];
	const int64_t Hkv = k->shape[1], Lk = k->shape[2], P = D / 2;
	const bool inter = tp->desc.layout == APE_ROPE_INTERLEAVED;
	const double scale = tp->desc.scale_set ? tp->desc.scale : 1 / sqrt((double)D);
	double *kr = malloc(sizeof(double) * (size_t)(Lk * D + 1));
	double *w = malloc(sizeof(double) * (size_t)(Lk + 1));
	double qr[256];

	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++) {
			int64_t kh = h / (H / Hkv);

			for (int64_t j = 0; j < Lk; j++) /* rotate every key by pos_k */
				for (int64_t p = 0; p < P; p++) {
					int64_t a = inter ? 2 * p : p, c = inter ? 2 * p + 1 : p + P;
					double ang = (double)(tp->desc.k_start + j) /
						     tp->desc.rope_scale *
						     pow(tp->desc.rope_base, -2.0 * p / D);
					double x = naive_get(k, b, kh, j, a), y = naive_get(k, b, kh, j, c);

					kr[j * D + a] = x * cos(ang) - y * sin(ang);
					kr[j * D + c] = x * sin(ang) + y * cos(ang);
				}
			for (int64_t i = 0; i < Lq; i++) {
				int64_t row = (b * H + h) * Lq + i, pq = tp->q_start + i;
				double mx = -INFINITY, den = 0;

				for (int64_t p = 0; p < P; p++) { /* rotate the query by pos_q */
					int64_t a = inter ? 2 * p : p, c = inter ? 2 * p + 1 : p + P;
					double ang = (double)pq / tp->desc.rope_scale *
						     pow(tp->desc.rope_base, -2.0 * p / D);
					double x = naive_get(q, b, h, i, a), y = naive_get(q, b, h, i, c);

					qr[a] = x * cos(ang) - y * sin(ang);
					qr[c] = x * sin(ang) + y * cos(ang);
				}
				for (int64_t j = 0; j < Lk; j++) {
					int64_t n = pq - (tp->desc.k_start + j);
					double s = 0;

					w[j] = NAN;
					if (tp->desc.causal && n < 0)
						continue;
					for (int64_t d = 0; d < D; d++)
						s += qr[d] * kr[j * D + d];
					w[j] = scale * s - delta * fabs((double)n);
					mx = fmax(mx, w[j]);
				}
				for (int64_t j = 0; j < Lk; j++) {
					w[j] = isnan(w[j]) ? 0 : exp(w[j] - mx);
					den += w[j];
				}
				for (int64_t d = 0; d < D; d++) {
					double acc = 0;

					for (int64_t j = 0; j < Lk; j++)
						acc += w[j] ? w[j] * naive_get(v, b, kh, j, d) : 0;
					o[row * D + d] = den > 0 ? acc / den : 0;
				}
				lse[row] = den > 0 ? mx + log(den) : -INFINITY;
			}
		}
	free(kr);
	free(w);
}

static void check_identity_rope(struct __test_metadata *_metadata, bool with_delta)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	int ncases = ape_test_slow() ? 4 : 40, failed = 0;
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, with_delta ? "identity_2" : "identity_1");
	for (int c = 0; c < ncases; c++) {
		test_problem tp;
		double *o, *lse, m, err_o, err_lse;
		/* as libape will see it: parameters are float32 */
		double delta = with_delta ? (float)ape_rng_uniform(&rng) : 0;
		size_t rows;

		ASSERT_EQ(0, test_problem_random(&tp, &rng, TEST_PROBLEM_SMALL_POSITIONS));
		test_problem_set_params(&tp, delta, 0, 0, 0);
		ASSERT_EQ(0, test_problem_set_out_dtype(&tp, APE_F32));
		rows = (size_t)(tp.q.t.shape[0] * tp.q.t.shape[1] * tp.q.t.shape[2]);
		o = malloc(sizeof(double) * (rows * (size_t)tp.q.t.shape[3] + 1));
		lse = malloc(sizeof(double) * (rows + 1));
		ASSERT_NE(NULL, o);
		ASSERT_NE(NULL, lse);
		ASSERT_EQ(0, test_problem_run(&tp, dev)) TH_LOG("%s", ape_last_error());
		textbook_rope(&tp, delta, o, lse);
		m = fmax(1.0, test_tensor_maxabs(&tp.v.t));
		err_o = test_problem_err_o_vs(&tp, o) / m;
		err_lse = test_problem_rel_err_lse_vs(&tp, lse);
		if (err_o > ref_tol_o(APE_F32) || err_lse > REF_TOL_LSE) {
			char desc[512];

			test_problem_describe(&tp, desc, sizeof(desc));
			TH_LOG("%s: O error %.3g, LSE error %.3g", desc, err_o, err_lse);
			failed++;
		}
		free(o);
		free(lse);
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, failed);
	ape_context_destroy(ctx);
}

TEST(identity_1_plain_rope)
{
	check_identity_rope(_metadata, false);
}

TEST(identity_2_rope_with_linear_bias)
{
	check_identity_rope(_metadata, true);
}

/* Identity 3: shifting q_start and k_start together by up to 2^40 changes nothing. */
TEST(identity_3_position_shift)
{
	static const int64_t shifts[] = { 1, -12345, (int64_t)1 << 40, -((int64_t)1 << 40) };
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "identity_3_position_shift");
	for (int c = 0; c < (ape_test_slow() ? 2 : 20); c++) {
		test_problem a, b;

		ASSERT_EQ(0, test_problem_random(&a, &rng,
						 TEST_PROBLEM_SMALL_POSITIONS | TEST_PROBLEM_NO_LSE_NULL));
		ASSERT_EQ(0, test_problem_run(&a, dev)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_problem_clone(&b, &a));
		b.desc.q_start = a.q_start + shifts[c % 4]; /* a.q_start: resolved by the run */
		b.desc.q_start_set = true;
		b.desc.k_start = a.desc.k_start + shifts[c % 4];
		ASSERT_EQ(0, test_problem_run(&b, dev)) TH_LOG("%s", ape_last_error());
		/* the reference works from n = pos_q - pos_k only: results are bit-identical */
		EXPECT_EQ(0, test_max_err_o(&a.o.t, &b.o.t));
		EXPECT_EQ(0, test_max_err_lse(a.lse, b.lse, a.rows));
		test_problem_free(&a);
		test_problem_free(&b);
	}
	ape_context_destroy(ctx);
}

/* Identity 4: key chunks merged by LSE, and query chunks, give the unsplit result. */
TEST(identity_4_chunking)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	int failed = 0;

	ape_rng_init(&rng, "identity_4_chunking");
	for (int c = 0; c < (ape_test_slow() ? 2 : 20); c++) {
		test_problem whole;
		double err_keys, err_queries, err_lse;
		int64_t chunk = ape_rng_range(&rng, 1, 9);

		ASSERT_EQ(0, test_problem_random(&whole, &rng, 0));
		ASSERT_EQ(0, test_problem_set_out_dtype(&whole, APE_F32));
		ASSERT_EQ(0, test_problem_run(&whole, dev)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_problem_split_keys(&whole, dev, chunk, &err_keys, &err_lse))
			TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_problem_split_queries(&whole, dev, chunk, &err_queries))
			TH_LOG("%s", ape_last_error());
		/* each chunk's LSE is rounded to float32 (2^-24 |LSE| absolute), which becomes a
		 * relative error of the chunk's weight in the merge: allow 1e-5, 10x below the
		 * spec's float32 tolerance. Query chunks compute the same rows: bit-identical. */
		if (err_keys > 1e-5 || err_lse > 1e-6 || err_queries != 0) {
			char desc[512];

			test_problem_describe(&whole, desc, sizeof(desc));
			TH_LOG("%s: chunks of %lld: keys: O error %.3g, LSE error %.3g; queries: O "
			       "error %.3g",
			       desc, (long long)chunk, err_keys, err_lse, err_queries);
			failed++;
		}
		test_problem_free(&whole);
	}
	EXPECT_EQ(0, failed);
	ape_context_destroy(ctx);
}

/* Rows with no visible key: O = 0 and LSE = -inf, and the rows next to them are unaffected. */
TEST(empty_rows)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	test_problem_shape sh = { 1, 2, 2, 6, 4, 8 };
	test_problem tp;
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "empty_rows");
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, 0));
	tp.desc.causal = true;
	tp.desc.q_start_set = true;
	tp.desc.q_start = -2; /* rows 0 and 1 sit before every key */
	tp.desc.k_start = 0;
	EXPECT_EQ(0, check_against_naive(_metadata, dev, &tp, "empty rows"));
	for (int64_t h = 0; h < 2; h++)
		for (int64_t i = 0; i < 6; i++) {
			float l = tp.lse[h * 6 + i];

			if (i < 2) {
				EXPECT_TRUE(isinf(l) && l < 0);
				for (int64_t d = 0; d < 8; d++)
					EXPECT_EQ(0.0, test_tensor_get(&tp.o.t, 0, h, i, d));
			} else {
				EXPECT_TRUE(isfinite(l));
			}
		}
	test_problem_free(&tp);
	ape_context_destroy(ctx);
}

/* A NaN reaches exactly the rows that see it; the others stay finite. */
TEST(nan_reaches_only_its_rows)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	test_problem_shape sh = { 1, 1, 1, 8, 8, 4 };
	test_problem tp;
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "nan_reaches_only_its_rows");
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, 0));
	tp.desc.causal = true; /* end-aligned: query i sees keys 0..i */
	test_tensor_set(&tp.k.t, 0, 0, 5, 1, NAN); /* key 5: seen by queries 5, 6, 7 */
	test_tensor_set(&tp.q.t, 0, 0, 1, 0, INFINITY); /* query 1 itself */
	ASSERT_EQ(0, test_problem_run(&tp, dev)) TH_LOG("%s", ape_last_error());
	for (int64_t i = 0; i < 8; i++) {
		bool want_nan = i == 1 || i >= 5;

		EXPECT_EQ(want_nan, (bool)isnan(tp.lse[i])) TH_LOG("row %lld", (long long)i);
		EXPECT_EQ(want_nan, (bool)isnan(test_tensor_get(&tp.o.t, 0, 0, i, 0)));
	}
	test_problem_free(&tp);
	ape_context_destroy(ctx);
}

/* Stats: visible pairs are counted exactly and the reference computes every one of them. */
TEST(stats_count_pairs)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	ape_rng rng;

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "stats_count_pairs");
	for (int c = 0; c < 20; c++) {
		test_problem tp;
		ape_stats st;
		uint64_t want = 0;

		ASSERT_EQ(0, test_problem_random(&tp, &rng, 0));
		ape_stats_init(&st);
		ASSERT_EQ(0, test_problem_run_stats(&tp, dev, &st)) TH_LOG("%s", ape_last_error());
		for (int64_t i = 0; i < tp.q.t.shape[2]; i++)
			for (int64_t j = 0; j < tp.k.t.shape[2]; j++)
				want += !tp.desc.causal ||
					tp.desc.k_start + j <= tp.q_start + i;
		want *= (uint64_t)(tp.q.t.shape[0] * tp.q.t.shape[1]);
		EXPECT_EQ(want, st.pairs_visible);
		EXPECT_EQ(want, st.pairs_computed); /* the reference never skips */
		EXPECT_STREQ("ref", st.backend);
		test_problem_free(&tp);
	}
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
