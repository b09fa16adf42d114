/* SPDX-License-Identifier: MIT */
/*
 * The attention diagnostics (docs/diagnostics.md): per-row entropy and mean distance from
 * ape_attention_forward_diag() and ape_kv_cache_attend_diag(), on every backend, against the
 * long-double evaluation of their definitions (tests/common/naive.c: -sum P ln P, sum P |n|) at
 * the LSE tolerance of the storage type; the same across chunk sizes, device lists and the
 * atomic-output path; with and without skipping, including a caller's loose skip_tol that the
 * call must tighten; the merge rule on its own; bad arguments; a backend without them (any
 * backend, its capability diag hidden by tests/common/wrapops). Every kernel a diagnostic launch
 * can take, and two CUDA devices: test_diag_kernels.c.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"

#define APE_REAL double
#include "ape/ape_math.h"
#include "exec/lse_merge.h"
#include "diag_case.h"

BACKEND_FIXTURE(dev)

/* The same between two results of one problem (scales from the naive evaluation). */
static void err_vs(const test_problem *tp, const struct diag *a, const struct diag *b, double *ee,
		   double *em)
{
	*ee = *em = 0;
	for (size_t i = 0; i < tp->rows; i++) {
		const double l = tp->naive_lse[i];

		*ee = fmax(*ee, rel(a->ent[i], b->ent[i], fmax(1, isfinite(l) ? fabs(l) : 1)));
		*em = fmax(*em, rel(a->md[i], b->md[i], fmax(1, tp->naive_mdmax[i])));
	}
}

static int small_case(test_problem *tp, ape_rng *rng, int64_t max_work)
{
	for (;;) {
		if (test_problem_random(tp, rng, 0))
			return -1;
		if (tp->q.t.shape[0] * tp->q.t.shape[1] * tp->q.t.shape[2] * tp->k.t.shape[2] *
			    tp->q.t.shape[3] <=
		    max_work)
			return test_problem_naive(tp);
		test_problem_free(tp);
	}
}


/* ---- against the definitions */

TEST_F(dev, random_cases_match_the_definitions)
{
	const int ncases = ape_test_slow() ? 4 : self->emu ? 6 : 40;
	ape_rng rng;
	int failed = 0;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics (see unsupported_backend_says_so)",
		     variant->backend);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < ncases; c++) {
		test_problem tp;
		struct diag d;
		double ee, em;
		char desc[256];

		ASSERT_EQ(0, small_case(&tp, &rng, self->emu ? 20000 : 200000));
		ASSERT_EQ(0, diag_alloc(&d, tp.rows));
		ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d)) TH_LOG("%s", ape_last_error());
		err_naive(&tp, &d, &ee, &em);
		if (ee > tol_of(&tp) || em > tol_of(&tp)) {
			test_problem_describe(&tp, desc, sizeof(desc));
			TH_LOG("case %d %s: ENT error %.3g, MD error %.3g (tolerance %.3g)", c, desc,
			       ee, em, tol_of(&tp));
			failed++;
		}
		diag_free(&d);
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, failed);
}

/* Rows with one visible key have ENT = 0 and MD = |n| of that key; rows with none 0 and 0;
 * Lk = 0 writes zeros too. */
/* The shapes the OpenCL fast paths take (docs/kernels.md): plain RoPE (separable: lambda = beta =
 * gamma = 0), a delta-only mix, and decode (a few query rows over many keys); and CUDA's
 * separable path (lambda = 0, D = 64 or 128, f16 or bf16, Lq > 16). With diagnostics asked
 * for, they must still be computed, by whichever kernel can. */
TEST_F(dev, fast_path_shapes_still_give_diagnostics)
{
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 96, 96, 64 }, /* prefill, separable when every lambda, beta, gamma is 0 */
		{ 1, 4, 2, 1, 300, 64 }, /* decode */
		{ 2, 2, 1, 5, 160, 32 }, /* decode, several rows */
		{ 1, 2, 1, 40, 70, 64 }, /* CUDA's separable shape, in f16 */
		{ 1, 2, 2, 24, 40, 128 }, /* ... and in bf16 */
	};
	static const ape_dtype types[] = { APE_F32, APE_F32, APE_F32, APE_F16, APE_BF16 };
	static const double params[][4] = { { 0, 0, 0, 0 }, { 0.2, 0, 0, 0 } };

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
		for (size_t c = 0; c < 2; c++) {
			test_problem tp;
			struct diag d;
			double ee, em;

			ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &shapes[s], types[s]));
			test_problem_set_params(&tp, params[c][0], params[c][1], params[c][2],
						params[c][3]);
			ASSERT_EQ(0, test_problem_naive(&tp));
			ASSERT_EQ(0, diag_alloc(&d, tp.rows));
			ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d))
			TH_LOG("%s", ape_last_error());
			err_naive(&tp, &d, &ee, &em);
			EXPECT_LE(ee, tol_of(&tp)) TH_LOG("shape %zu params %zu: entropy", s, c);
			EXPECT_LE(em, tol_of(&tp)) TH_LOG("shape %zu params %zu: distance", s, c);
			diag_free(&d);
			test_problem_free(&tp);
		}
}

TEST_F(dev, one_key_and_empty_rows)
{
	const test_problem_shape sh = { 1, 2, 1, 5, 3, 8 };
	test_problem tp;
	struct diag d;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F32));
	test_problem_set_params(&tp, 0.1, 0.01, 0.01, 0.1);
	/* queries at positions -2..2 against keys 0..2, causal: rows 0, 1 see nothing, row 2 one
	 * key */
	tp.desc.causal = true;
	tp.desc.q_start = -2;
	tp.desc.q_start_set = true;
	ASSERT_EQ(0, test_problem_naive(&tp));
	ASSERT_EQ(0, diag_alloc(&d, tp.rows));
	ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d)) TH_LOG("%s", ape_last_error());
	for (int h = 0; h < 2; h++) {
		EXPECT_EQ(0.0f, d.ent[h * 5 + 0]);
		EXPECT_EQ(0.0f, d.md[h * 5 + 0]);
		EXPECT_EQ(0.0f, d.ent[h * 5 + 1]);
		EXPECT_EQ(0.0f, d.md[h * 5 + 1]);
		EXPECT_EQ(0.0f, d.ent[h * 5 + 2]); /* one key at n = 0 */
		EXPECT_EQ(0.0f, d.md[h * 5 + 2]);
		EXPECT_GT(d.ent[h * 5 + 4], 0.0f);
	}
	{
		double ee, em;

		err_naive(&tp, &d, &ee, &em);
		EXPECT_LE(ee, tol_of(&tp));
		EXPECT_LE(em, tol_of(&tp));
	}
	diag_free(&d);
	test_problem_free(&tp);

	/* no keys at all */
	{
		const test_problem_shape s0 = { 1, 1, 1, 3, 0, 4 };

		ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &s0, APE_F16));
		ASSERT_EQ(0, diag_alloc(&d, tp.rows));
		ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d));
		for (int i = 0; i < 3; i++) {
			EXPECT_EQ(0.0f, d.ent[i]);
			EXPECT_EQ(0.0f, d.md[i]);
		}
		diag_free(&d);
		test_problem_free(&tp);
	}
}

/* A NaN in a key reaches ENT and MD of the rows that see it, and only those. */
TEST_F(dev, nan_rows)
{
	const test_problem_shape sh = { 1, 1, 1, 6, 6, 8 };
	test_problem tp;
	struct diag d;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F32));
	tp.desc.causal = true;
	test_tensor_set(&tp.k.t, 0, 0, 3, 1, NAN);
	ASSERT_EQ(0, diag_alloc(&d, tp.rows));
	ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d)) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < 6; i++) {
		EXPECT_EQ(i >= 3, isnan(d.ent[i])) TH_LOG("row %d: ENT %g", i, d.ent[i]);
		EXPECT_EQ(i >= 3, isnan(d.md[i])) TH_LOG("row %d: MD %g", i, d.md[i]);
	}
	diag_free(&d);
	test_problem_free(&tp);
}

TEST_F(dev, chunk_sizes_and_devices_agree)
{
	static const int64_t sizes[] = { 1, 7, 64 };
	const int ncases = ape_test_slow() ? 2 : self->emu ? 3 : 10;
	ape_rng rng;
	int failed = 0;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < ncases; c++) {
		test_problem tp;
		struct diag one, d;
		ape_device *two[2] = { self->dev, self->ref };

		ASSERT_EQ(0, small_case(&tp, &rng, self->emu ? 8000 : 60000));
		ASSERT_EQ(0, diag_alloc(&one, tp.rows));
		ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &one));
		for (int si = 0; si < 3; si++) {
			const int64_t cs = sizes[si];
			ape_exec_options o = si == 0 ? chunks(4096, cs) : chunks(cs, cs);
			double ee, em, ne, nm;

			if (tp.q.t.shape[2] * tp.k.t.shape[2] > 400 * cs * cs)
				continue; /* too many launches for this chunk size */
			o.flags = c % 2 ? APE_EXEC_ATOMIC_OUTPUTS : 0;
			ASSERT_EQ(0, diag_alloc(&d, tp.rows));
			/* every other case on two devices: the device and the reference */
			ASSERT_EQ(0, run_diag(&tp, two, c % 3 == 2 ? 2 : 1, &o, &d))
			TH_LOG("%s", ape_last_error());
			err_vs(&tp, &d, &one, &ee, &em);
			err_naive(&tp, &d, &ne, &nm);
			if (ee > tol_of(&tp) || em > tol_of(&tp) || ne > tol_of(&tp) ||
			    nm > tol_of(&tp)) {
				TH_LOG("case %d chunks %lld: vs one-shot ENT %.3g MD %.3g, vs naive "
				       "ENT %.3g MD %.3g",
				       c, (long long)cs, ee, em, ne, nm);
				failed++;
			}
			diag_free(&d);
		}
		diag_free(&one);
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, failed);
}

/* ---- skipping */

/*
 * Strong decay: far keys carry little weight. With skip_tol 0 nothing is skipped; with the
 * default, and with a loose 1e-2 that the call must tighten to 2^-24 (at 1e-2 the skipped keys
 * would move ENT by ~1e-2), ENT and MD stay within the tolerance of the definitions, and key
 * chunks really are skipped.
 */
TEST_F(dev, skipping_stays_within_the_bound)
{
	static const double tols[] = { 0, 0x1p-24, 1e-2 };
	const int64_t L = self->emu ? 300 : 1500;
	/* the emulator's 300 keys: CUDA skips whole 64-key tiles or chunks, and at delta 0.05 a
	 * key's weight falls below 2^-24 only ~330 keys away (OpenCL's smaller tiles skip some) */
	const double delta = self->emu ? 0.15 : 0.05;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	test_problem tp;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F32));
	test_problem_set_params(&tp, delta, 0.01, 0.01, 0.1);
	tp.desc.causal = false;
	ASSERT_EQ(0, test_problem_naive(&tp));
	for (int t = 0; t < 3; t++) {
		const ape_exec_options o = chunks(64, 64); /* far chunks for the executor too */
		struct diag d;
		ape_stats st;
		double ee, em;

		tp.desc.skip_tol = tols[t];
		ASSERT_EQ(0, diag_alloc(&d, tp.rows));
		ape_stats_init(&st);
		test_tensor_poison(&tp.o.t);
		ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, &o, &tp.desc, &tp.q.t,
							&tp.k.t, &tp.v.t, &tp.o.t, tp.lse, d.ent,
							d.md, &st))
		TH_LOG("%s", ape_last_error());
		err_naive(&tp, &d, &ee, &em);
		EXPECT_LE(ee, tol_of(&tp)) TH_LOG("skip_tol %g: ENT error %g", tols[t], ee);
		EXPECT_LE(em, tol_of(&tp)) TH_LOG("skip_tol %g: MD error %g", tols[t], em);
		if (t == 0) {
			EXPECT_EQ(st.pairs_computed, st.pairs_visible);
		} else {
			EXPECT_LT(st.pairs_computed, st.pairs_visible);
		}
		diag_free(&d);
	}
	test_problem_free(&tp);
}

/* ---- the KV cache */

TEST_F(dev, kv_cache_attend_matches_the_forward_call)
{
	const int64_t n = self->emu ? 100 : 700, Lq = 4;
	const test_problem_shape sh = { 1, 4, 2, Lq, n, 16 };
	ape_kv_cache_options ko;
	ape_kv_cache *kc = NULL;
	test_problem tp;
	struct diag d, f;
	double ee, em;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F16));
	test_problem_set_params(&tp, 0.01, 0.02, 0.01, 0.1);
	ASSERT_EQ(0, test_problem_naive(&tp));
	kv_options(&ko, &sh, APE_F16);
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &kc)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_kv_cache_append(kc, &tp.k.t, &tp.v.t));
	ASSERT_EQ(0, diag_alloc(&d, tp.rows));
	ASSERT_EQ(0, diag_alloc(&f, tp.rows));
	ASSERT_EQ(0, ape_kv_cache_attend_diag(kc, &tp.desc, &tp.q.t, &tp.o.t, tp.lse, d.ent,
					      d.md, NULL))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &f));
	err_naive(&tp, &d, &ee, &em);
	EXPECT_LE(ee, tol_of(&tp));
	EXPECT_LE(em, tol_of(&tp));
	err_vs(&tp, &d, &f, &ee, &em);
	EXPECT_LE(ee, tol_of(&tp));
	EXPECT_LE(em, tol_of(&tp));
	/* only one of the two asked for */
	ASSERT_EQ(0, ape_kv_cache_attend_diag(kc, &tp.desc, &tp.q.t, &tp.o.t, NULL, NULL, d.md,
					      NULL));
	/* the plain attend still works after a diagnostic one */
	ASSERT_EQ(0, ape_kv_cache_attend(kc, &tp.desc, &tp.q.t, &tp.o.t, tp.lse, NULL));
	ape_kv_cache_destroy(kc);
	diag_free(&d);
	diag_free(&f);
	test_problem_free(&tp);
}

/*
 * The same attend twice, on one cache and on a fresh one, gives the same bits: O, LSE, entropy
 * and mean distance (several key chunks merged, skip_tol 0; the fault tests compare the runs of
 * one call bit for bit, so a path that reads what an earlier call left behind shows there).
 */
TEST_F(dev, kv_cache_attend_diag_repeats_bit_for_bit)
{
	const int64_t n = 80, Lq = 4;
	const test_problem_shape sh = { 1, 2, 1, Lq, n, 32 };
	ape_kv_cache_options ko;
	ape_kv_cache *kc[2] = { NULL, NULL };
	test_problem tp;
	struct diag d[3];
	float *o[3], *lse[3];
	const size_t on = (size_t)(2 * Lq * 32);

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F32));
	test_problem_set_params(&tp, 0.3, 0.02, 0.02, 0.1);
	tp.desc.skip_tol = 0;
	ASSERT_EQ(0, test_problem_naive(&tp));
	kv_options(&ko, &sh, APE_F32);
	ko.capacity_tokens = n + 16;
	ko.block_tokens = 16;
	ko.attend_chunk = 32;
	ko.max_queries = Lq;
	for (int c = 0; c < 2; c++) {
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &kc[c])) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_kv_cache_append(kc[c], &tp.k.t, &tp.v.t)) TH_LOG("%s", ape_last_error());
	}
	for (int r = 0; r < 3; r++) {
		ASSERT_EQ(0, diag_alloc(&d[r], tp.rows));
		o[r] = malloc(on * sizeof(float));
		lse[r] = malloc(tp.rows * sizeof(float));
		ASSERT_TRUE(o[r] && lse[r]);
		ASSERT_EQ(0, ape_kv_cache_attend_diag(kc[r == 2], &tp.desc, &tp.q.t, &tp.o.t, tp.lse,
						      d[r].ent, d[r].md, NULL))
		TH_LOG("%s", ape_last_error());
		memcpy(o[r], tp.o.t.data, on * sizeof(float));
		memcpy(lse[r], tp.lse, tp.rows * sizeof(float));
	}
	{
		struct diag got = d[0];
		double ee, em;

		err_naive(&tp, &got, &ee, &em); /* NaN bits repeat too: the values first */
		EXPECT_LE(ee, tol_of(&tp)) TH_LOG("entropy error %g", ee);
		EXPECT_LE(em, tol_of(&tp)) TH_LOG("mean distance error %g", em);
	}
	for (int r = 1; r < 3; r++) {
		EXPECT_EQ(0, memcmp(o[0], o[r], on * sizeof(float))) TH_LOG("O of run %d", r);
		EXPECT_EQ(0, memcmp(lse[0], lse[r], tp.rows * sizeof(float))) TH_LOG("LSE of run %d", r);
		EXPECT_EQ(0, memcmp(d[0].ent, d[r].ent, tp.rows * sizeof(float)))
		TH_LOG("entropy of run %d", r);
		EXPECT_EQ(0, memcmp(d[0].md, d[r].md, tp.rows * sizeof(float)))
		TH_LOG("mean distance of run %d", r);
	}
	for (int r = 0; r < 3; r++) {
		diag_free(&d[r]);
		free(o[r]);
		free(lse[r]);
	}
	ape_kv_cache_destroy(kc[0]);
	ape_kv_cache_destroy(kc[1]);
	test_problem_free(&tp);
}

/*
 * A cache that releases its oldest blocks: at the default skip_tol the diagnostics of a decoding
 * run match the forward call over all keys (the released keys are within the bound); after a
 * release proved at a looser skip_tol, the diagnostic attend (which runs at 2^-24) is refused
 * by the release check, naming skip_tol, and writes nothing.
 */
TEST_F(dev, kv_cache_release_and_the_tightened_tolerance)
{
	const int64_t n = 96, D = 8;
	const test_problem_shape sh = { 1, 2, 2, n, n, D };
	ape_kv_cache_options ko;
	ape_kv_cache *kc = NULL;
	test_problem tp;
	struct diag d;
	ape_kv_cache_info info;
	double worst_e = 0, worst_m = 0;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F32));
	test_problem_set_params(&tp, 4.0, 0.0, 0.0, 0.0);
	ASSERT_EQ(0, test_problem_naive(&tp));
	ape_kv_cache_options_init(&ko);
	ko.B = 1;
	ko.Hkv = ko.H = 2;
	ko.D = D;
	ko.dtype = APE_F32;
	ko.block_tokens = 4;
	ko.capacity_tokens = 40;
	ko.max_queries = 1;
	ko.allow_release = true;
	ko.max_query_norm = 0;
	for (int64_t h = 0; h < 2; h++) /* the bound on |q| the release proof needs */
		for (int64_t i = 0; i < n; i++) {
			double ss = 0;

			for (int64_t e = 0; e < D; e++)
				ss += pow(test_tensor_get(&tp.q.t, 0, h, i, e), 2);
			ko.max_query_norm = fmax(ko.max_query_norm, sqrt(ss) * 1.001);
		}
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &kc)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, diag_alloc(&d, 2));
	for (int64_t i = 0; i < n; i++) {
		ape_tensor kt, vt, qt, ot;
		float lse[2];

		ASSERT_EQ(0, ape_tensor_rows(&tp.k.t, i, 1, &kt));
		ASSERT_EQ(0, ape_tensor_rows(&tp.v.t, i, 1, &vt));
		ASSERT_EQ(0, ape_tensor_rows(&tp.q.t, i, 1, &qt));
		ASSERT_EQ(0, ape_tensor_rows(&tp.o.t, i, 1, &ot));
		ASSERT_EQ(0, ape_kv_cache_append(kc, &kt, &vt)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_kv_cache_attend_diag(kc, &tp.desc, &qt, &ot, lse, d.ent, d.md, NULL))
		TH_LOG("token %lld: %s", (long long)i, ape_last_error());
		for (int h = 0; h < 2; h++) {
			const size_t row = (size_t)(h * n + i);
			const double l = tp.naive_lse[row];

			worst_e = fmax(worst_e, fabs(d.ent[h] - tp.naive_ent[row]) /
							fmax(1, fabs(l)));
			worst_m = fmax(worst_m, fabs(d.md[h] - tp.naive_md[row]) /
							fmax(1, tp.naive_mdmax[row]));
		}
	}
	ASSERT_EQ(0, ape_kv_cache_get_info(kc, &info));
	EXPECT_GT(info.blocks_released, 0); /* the 96 tokens went through a cache of 40 */
	EXPECT_LE(worst_e, tol_of(&tp));
	EXPECT_LE(worst_m, tol_of(&tp));
	ape_kv_cache_destroy(kc);
	/* a release proved at a looser tolerance: the diagnostic attend is refused */
	{
		ape_tensor qt, ot;
		float lse[2];
		int64_t released = 0;

		ko.capacity_tokens = n;
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &kc));
		ASSERT_EQ(0, ape_kv_cache_append(kc, &tp.k.t, &tp.v.t));
		tp.desc.skip_tol = 1e-3;
		ASSERT_EQ(0, ape_tensor_rows(&tp.q.t, n - 1, 1, &qt));
		ASSERT_EQ(0, ape_tensor_rows(&tp.o.t, n - 1, 1, &ot));
		ASSERT_EQ(0, ape_kv_cache_release_unreachable(kc, &tp.desc, &released));
		ASSERT_GT(released, 0);
		d.ent[0] = NAN;
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend_diag(kc, &tp.desc, &qt, &ot, lse, d.ent,
							       d.md, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "skip_tol")) TH_LOG("%s", ape_last_error());
		EXPECT_TRUE(isnan(d.ent[0]));
		/* the plain attend at that tolerance still runs */
		EXPECT_EQ(0, ape_kv_cache_attend(kc, &tp.desc, &qt, &ot, lse, NULL))
		TH_LOG("%s", ape_last_error());
	}
	ape_kv_cache_destroy(kc);
	diag_free(&d);
	test_problem_free(&tp);
}
/* ---- bad arguments and backends without the diagnostics */

TEST_F(dev, bad_arguments)
{
	const test_problem_shape sh = { 1, 2, 1, 8, 8, 8 };
	test_problem tp;
	struct diag d;
	int ret;

	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F32));
	ASSERT_EQ(0, diag_alloc(&d, tp.rows));
	/* entropy inside o */
	ret = ape_attention_forward_diag(&self->ref, 1, NULL, &tp.desc, &tp.q.t, &tp.k.t,
					 &tp.v.t, &tp.o.t, tp.lse, (float *)tp.o.t.data, d.md,
					 NULL);
	EXPECT_EQ(APE_EINVAL, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "entropy overlaps o")) TH_LOG("%s",
									       ape_last_error());
	/* both outputs in one array */
	ret = ape_attention_forward_diag(&self->ref, 1, NULL, &tp.desc, &tp.q.t, &tp.k.t,
					 &tp.v.t, &tp.o.t, tp.lse, d.ent, d.ent + 1, NULL);
	EXPECT_EQ(APE_EINVAL, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "mean_distance overlaps entropy"))
	TH_LOG("%s", ape_last_error());
	/* overlapping lse, an input */
	ret = ape_attention_forward_diag(&self->ref, 1, NULL, &tp.desc, &tp.q.t, &tp.k.t,
					 &tp.v.t, &tp.o.t, tp.lse, d.ent, tp.lse, NULL);
	EXPECT_EQ(APE_EINVAL, ret);
	ret = ape_attention_forward_diag(&self->ref, 1, NULL, &tp.desc, &tp.q.t, &tp.k.t,
					 &tp.v.t, &tp.o.t, tp.lse, (float *)tp.k.t.data, NULL,
					 NULL);
	EXPECT_EQ(APE_EINVAL, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "entropy overlaps k"));
	/* nothing was written on those failures */
	for (size_t i = 0; i < tp.rows; i++)
		ASSERT_TRUE(isnan(d.md[i]));
	/* a bad device list and a bad desc are named as in ape_attention_forward_ex() */
	EXPECT_EQ(APE_EINVAL, ape_attention_forward_diag(NULL, 1, NULL, &tp.desc, &tp.q.t,
							 &tp.k.t, &tp.v.t, &tp.o.t, tp.lse,
							 d.ent, d.md, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_forward_diag: devs = NULL"));
	tp.desc.rope_base = NAN;
	EXPECT_EQ(APE_EINVAL, ape_attention_forward_diag(&self->dev, 1, NULL, &tp.desc, &tp.q.t,
							 &tp.k.t, &tp.v.t, &tp.o.t, tp.lse,
							 d.ent, d.md, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "rope_base"));
	diag_free(&d);
	test_problem_free(&tp);
}

/* A device whose capabilities lack diag (every backend has it: the wrapper hides it):
 * APE_ENOTSUP naming the device, before any work, and nothing written; also in a list with a
 * device that has them. */
TEST_F(dev, unsupported_backend_says_so)
{
	const test_problem_shape sh = { 1, 1, 1, 4, 4, 8 };
	ape_device *devs[2] = { self->ref, self->dev };
	test_problem tp;
	struct diag d;
	char name[64];

	wrap_install(self->dev, WRAP_NO_DIAG);
	ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F32));
	ASSERT_EQ(0, diag_alloc(&d, tp.rows));
	snprintf(name, sizeof(name), "%s:%d", self->dev->info.backend,
		 self->dev->info.backend_index);
	EXPECT_EQ(APE_ENOTSUP, run_diag(&tp, devs, 2, NULL, &d));
	EXPECT_NE(NULL, strstr(ape_last_error(), name)) TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(isnan(d.ent[0]));
	diag_free(&d);
	test_problem_free(&tp);
}

/* ---- the merge rule alone (exec/lse_merge.c): rows split into key chunks in every way
 * merge to the unsplit row's ENT and MD */

TEST(merge_rule_equals_the_unsplit_row)
{
	enum { N = 40 };
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 200; c++) {
		double s[N], an[N], m = -INFINITY, l = 0, ent = 0, md = 0, lse;
		const int n = (int)ape_rng_range(&rng, 1, N);
		const int cuts = (int)ape_rng_range(&rng, 1, 5);
		struct ape__acc a;
		float o = 0, lse_c, ent_c, md_c, lse_out, ent_out, md_out;
		ape_tensor ot;
		int64_t os[4] = { 1, 1, 1, 1 };
		int j0 = 0;

		for (int j = 0; j < n; j++) {
			s[j] = 10 * (ape_rng_uniform(&rng) - 0.5) * (c % 3 ? 1 : 20);
			an[j] = (double)ape_rng_range(&rng, 0, 5000);
			m = fmax(m, s[j]);
		}
		for (int j = 0; j < n; j++)
			l += exp(s[j] - m);
		lse = m + log(l);
		for (int j = 0; j < n; j++) {
			const double p = exp(s[j] - lse);

			ent -= p > 0 ? p * log(p) : 0;
			md += p * an[j];
		}
		ASSERT_EQ(0, ape__acc_alloc(&a, 1, 1, true));
		ape__acc_reset(&a, 1);
		for (int k = 0; k < cuts && j0 < n; k++) {
			const int j1 = k == cuts - 1 ? n : (int)ape_rng_range(&rng, j0 + 1, n);
			double mc = -INFINITY, lc = 0, s1 = 0, s2 = 0;

			/* one chunk's partial result with the running sums, keys in order */
			for (int j = j0; j < j1; j++) {
				if (s[j] > mc) {
					const double f = ape_merge_factor(mc, s[j]);

					s1 = ape_diag_rescale_s1(s1, lc, f, mc, s[j]);
					s2 *= f;
					lc *= f;
					mc = s[j];
				}
				{
					const double w = ape_merge_factor(s[j], mc);

					lc += w;
					s1 += ape_diag_s1_term(w, s[j] - mc, 0);
					s2 += w * an[j];
				}
			}
			lse_c = (float)(mc + log(lc));
			ent_c = (float)ape_diag_entropy(lc, s1);
			md_c = (float)ape_diag_distance(lc, s2);
			ape__acc_add(&a, &o, &lse_c, &ent_c, &md_c);
			j0 = j1;
		}
		ape_tensor_init(&ot, &o, APE_F32, 1, 1, 1, 1);
		ape__acc_store(&a, &ot, os, &lse_out, &ent_out, &md_out, 1, 0, 1);
		EXPECT_LE(fabs(ent_out - ent), 1e-5 * fmax(1, fabs(lse)))
		TH_LOG("case %d: %d keys: ENT %.9g, want %.9g", c, n, ent_out, ent);
		EXPECT_LE(fabs(md_out - md), 1e-5 * fmax(1, md));
		ape__acc_free(&a);
	}
}

TEST_HARNESS_MAIN
