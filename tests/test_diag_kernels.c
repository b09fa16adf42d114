/* SPDX-License-Identifier: MIT */
/*
 * The attention diagnostics (docs/diagnostics.md) on every backend, over every kernel a
 * diagnostic launch can take: on CUDA (the emulator, or a GPU with APE_TEST_CUDA_DEVICE=1) the
 * grid of kernel_shapes_every_dtype reaches the prefill (tensor-core P V for f16/bf16, CUDA
 * cores for f32; D = 64, 128 and generic), the decode kernel with its splits merged by
 * ape_dmerge_diag, the no-key fills and ape_dmerge_diag over zero splits (elsewhere the same
 * grid), against the long-double evaluation of their definitions; two_cuda_devices runs on two
 * of them. (The rest of the diagnostics: test_diag.c.)
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

/* ---- every kernel a diagnostic launch can take (CUDA: docs/cuda.md; elsewhere the same grid) */

struct kshape {
	int64_t B, H, Hkv, Lq, Lk, D;
	bool strided;
};

/*
 * Decode-shaped launches (Lq 1..4 over a long cache: CUDA's decode kernel with several splits,
 * merged by ape_dmerge_diag), prefill ones (D = 64 and 128 specialised, 40 and 130 generic;
 * tensor-core P V for f16 and bf16, CUDA cores for f32), GQA, strided and contiguous, each in
 * every storage type, with random parameters, layouts, causality and offsets; then rows that
 * see no key or one key in a prefill launch, and a strided launch without keys.
 */
TEST_F(dev, kernel_shapes_every_dtype)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	const int64_t lk = self->emu ? 700 : 2000;
	const struct kshape shapes[] = {
		{ 1, 4, 2, 1, lk, 64, false },	{ 2, 2, 1, 2, lk / 2, 128, true },
		{ 1, 4, 2, 3, lk, 40, false },	{ 1, 2, 2, 4, lk, 64, true },
		{ 1, 4, 2, 40, 70, 64, false }, { 1, 2, 1, 33, 50, 128, true },
		{ 1, 2, 2, 37, 45, 40, false }, { 1, 1, 1, 20, 24, 130, false },
	};
	ape_rng rng;
	int failed = 0, runs = 0;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
		for (size_t t = 0; t < 3; t++) {
			const struct kshape *k = &shapes[s];
			const test_problem_shape sh = { k->B, k->H, k->Hkv, k->Lq, k->Lk, k->D };
			test_problem tp;
			struct diag d;
			double ee, em;
			char desc[256];

			ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[t], k->strided));
			test_problem_random_params(&tp, &rng);
			ASSERT_EQ(0, test_problem_naive(&tp));
			ASSERT_EQ(0, diag_alloc(&d, tp.rows));
			ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d))
			TH_LOG("%s", ape_last_error());
			err_naive(&tp, &d, &ee, &em);
			if (!(ee <= tol_of(&tp)) || !(em <= tol_of(&tp))) {
				test_problem_describe(&tp, desc, sizeof(desc));
				TH_LOG("shape %zu %s: ENT error %.3g, MD error %.3g (tolerance %.3g)",
				       s, desc, ee, em, tol_of(&tp));
				failed++;
			}
			runs++;
			diag_free(&d);
			test_problem_free(&tp);
		}
	EXPECT_EQ(0, failed) TH_LOG("%d of %d cases", failed, runs);

	/* a prefill launch (Lq > 16) whose first rows see nothing, the next one key */
	{
		const test_problem_shape sh = { 1, 2, 1, 40, 30, 64 };
		test_problem tp;
		struct diag d;
		double ee, em;

		ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &sh, APE_F16));
		test_problem_set_params(&tp, 0.1, 0.01, 0.01, 0.1);
		tp.desc.causal = true;
		tp.desc.q_start = -10; /* rows 0..9: no key; row 10: key 0 at n = 0 */
		tp.desc.q_start_set = true;
		ASSERT_EQ(0, test_problem_naive(&tp));
		ASSERT_EQ(0, diag_alloc(&d, tp.rows));
		ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d)) TH_LOG("%s", ape_last_error());
		for (int h = 0; h < 2; h++) {
			for (int i = 0; i <= 10; i++) {
				EXPECT_EQ(0.0f, d.ent[h * 40 + i]) TH_LOG("head %d row %d", h, i);
				EXPECT_EQ(0.0f, d.md[h * 40 + i]) TH_LOG("head %d row %d", h, i);
			}
			EXPECT_GT(d.ent[h * 40 + 39], 0.0f);
			EXPECT_GT(d.md[h * 40 + 39], 0.0f);
		}
		err_naive(&tp, &d, &ee, &em);
		EXPECT_LE(ee, tol_of(&tp));
		EXPECT_LE(em, tol_of(&tp));
		diag_free(&d);
		test_problem_free(&tp);
	}
	/* strided, no key: O and LSE through the kernels (CUDA: ape_dmerge_diag, zero splits) */
	{
		const test_problem_shape sh = { 1, 2, 1, 3, 0, 8 };
		test_problem tp;
		struct diag d;

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_BF16, true));
		ASSERT_EQ(0, diag_alloc(&d, tp.rows));
		ASSERT_EQ(0, run_diag(&tp, &self->dev, 1, NULL, &d)) TH_LOG("%s", ape_last_error());
		for (size_t i = 0; i < tp.rows; i++) {
			EXPECT_EQ(0.0f, d.ent[i]);
			EXPECT_EQ(0.0f, d.md[i]);
		}
		diag_free(&d);
		test_problem_free(&tp);
	}
}

/*
 * Two CUDA devices (the emulated driver's two-device mode, or two GPUs): a streamed call over
 * both, in chunks, and the KV cache on the second one, against the definitions.
 */
TEST(two_cuda_devices)
{
	const test_problem_shape sh = { 1, 4, 2, 48, 48, 32 };
	char why[TEST_WHY_LEN];
	ape_selection s0, s1;
	ape_device *devs[2];
	ape_context *ctx;
	test_problem tp;
	struct diag d;
	double ee, em;
	ape_rng rng;

	if (test_backend_prepare("cuda", "two-devices", why, sizeof(why)))
		SKIP(return, "%s", why);
	ctx = test_context("cuda");
	ASSERT_NE(NULL, ctx);
	if (ape_device_select(ctx, "cuda", 0, &s0) || ape_device_select(ctx, "cuda", 1, &s1)) {
		snprintf(why, sizeof(why), "no two CUDA devices: %s", ape_last_error());
		ape_context_destroy(ctx);
		SKIP(return, "%s", why);
	}
	devs[0] = s0.device;
	devs[1] = s1.device;
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 2; c++) {
		ape_exec_options o = chunks(16, 16);

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, c ? APE_BF16 : APE_F32, false));
		test_problem_random_params(&tp, &rng);
		ASSERT_EQ(0, test_problem_naive(&tp));
		ASSERT_EQ(0, diag_alloc(&d, tp.rows));
		ASSERT_EQ(0, run_diag(&tp, devs, 2, &o, &d)) TH_LOG("%s", ape_last_error());
		err_naive(&tp, &d, &ee, &em);
		EXPECT_LE(ee, tol_of(&tp)) TH_LOG("case %d: ENT", c);
		EXPECT_LE(em, tol_of(&tp)) TH_LOG("case %d: MD", c);
		diag_free(&d);
		test_problem_free(&tp);
	}
	/* the KV cache on device 1: two decode rows over several key chunks */
	{
		const test_problem_shape kv = { 1, 4, 2, 2, 300, 32 };
		ape_kv_cache_options ko;
		ape_kv_cache *kc = NULL;

		ASSERT_EQ(0, fixed_case(&tp, _metadata->name, &kv, APE_F16));
		test_problem_set_params(&tp, 0.01, 0.02, 0.01, 0.1);
		ASSERT_EQ(0, test_problem_naive(&tp));
		kv_options(&ko, &kv, APE_F16);
		ASSERT_EQ(0, ape_kv_cache_create(devs[1], &ko, &kc)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_kv_cache_append(kc, &tp.k.t, &tp.v.t));
		ASSERT_EQ(0, diag_alloc(&d, tp.rows));
		ASSERT_EQ(0, ape_kv_cache_attend_diag(kc, &tp.desc, &tp.q.t, &tp.o.t, tp.lse, d.ent,
						      d.md, NULL))
		TH_LOG("%s", ape_last_error());
		err_naive(&tp, &d, &ee, &em);
		EXPECT_LE(ee, tol_of(&tp));
		EXPECT_LE(em, tol_of(&tp));
		ape_kv_cache_destroy(kc);
		diag_free(&d);
		test_problem_free(&tp);
	}
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
