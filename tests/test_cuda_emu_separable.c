/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's separable path (cuda/kernels/separable.cu: every head with lambda = 0)
 * against the reference backend, with no GPU: the fake driver of tests/fake_cuda built with the
 * emulator (cuda/emu) runs every launch on the CPU (test_cuda_emu.c says what that proves). The
 * predicates that choose it, random separable cases, mixed heads split, skipping and NaN, f16
 * inputs near their largest value.
 *
 * Fresh random inputs each run (APE_TEST_SEED replays one). With APE_TEST_CUDA_DEVICE=1 the same
 * tests run on this machine's own driver and GPU instead (tools/gpu-check.sh does that; the
 * program exits 4 when there is no CUDA device).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/bwdcase.h"
#include "common/problem.h"
#include "common/wrapops.h"

#ifdef APE_HAVE_CUDA
#include "../cuda/cu.h" /* ape__cu_separable_applies() */
#endif

#ifdef APE_HAVE_CUDA
#include "cuda_emu_pair.h"

/* ---- the separable path (cuda/kernels/separable.cu): every head with lambda = 0 */

/* What the separable predicates read of the launch the core makes for tp in one piece (no
 * pairs asked). */
static void sep_launch(const test_problem *tp, float *hp, struct ape_be_launch *lp)
{
	struct ape_be_launch l;
	const int64_t H = tp->q.t.shape[1];

	memset(&l, 0, sizeof(l));
	l.B = tp->q.t.shape[0];
	l.H = H;
	l.Hkv = tp->k.t.shape[1];
	l.Lq = tp->q.t.shape[2];
	l.Lk = tp->k.t.shape[2];
	l.D = tp->q.t.shape[3];
	l.in_dtype = tp->q.t.dtype;
	for (int64_t h = 0; h < H; h++)
		for (int p = 0; p < 4; p++) {
			const ape_param *pp = p == 0 ? &tp->desc.delta : p == 1 ? &tp->desc.beta
								 : p == 2 ? &tp->desc.gamma
									  : &tp->desc.lambda;

			hp[4 * h + p] = pp->per_head ? pp->per_head[h] : pp->value;
		}
	l.head_params = hp;
	*lp = l;
}

static bool takes_separable(const test_problem *tp, float *hp)
{
	struct ape_be_launch l;

	sep_launch(tp, hp, &l);
	return ape__cu_separable_applies(&l);
}

/* lambda = 0 on every head; delta, beta, gamma per head of either sign or 0 (kind 0: plain
 * RoPE, 1: ALiBi-like, 2: all three >= 0, 3: any signs). */
static void separable_params(test_problem *tp, ape_rng *rng, int kind)
{
	const int64_t H = tp->q.t.shape[1];

	for (int64_t h = 0; h < H; h++) {
		const double u = ape_rng_uniform(rng), w = ape_rng_uniform(rng);
		const double z = ape_rng_uniform(rng);

		tp->params[h] = kind == 0 ? 0.0f : kind == 1 ? (float)(0.02 + u) : (float)(0.3 * u);
		tp->params[H + h] = kind < 2 ? 0.0f : kind == 2 ? (float)w : (float)(2 * w - 1);
		tp->params[2 * H + h] = kind < 2 ? 0.0f : kind == 2 ? (float)(0.5 * z) : (float)(z - 0.5);
		if (kind == 3 && u < 0.3)
			tp->params[h] = -0.05f;
		tp->params[3 * H + h] = 0.0f;
	}
	tp->desc.delta = (ape_param){ 0, tp->params };
	tp->desc.beta = (ape_param){ 0, tp->params + H };
	tp->desc.gamma = (ape_param){ 0, tp->params + 2 * H };
	tp->desc.lambda = (ape_param){ 0, tp->params + 3 * H };
}

/*
 * Random separable launches (f16 and bf16, D = 64 and 128, GQA, both layouts, causal or not,
 * positions near 2^40 or rows before every key, LSE or not, f32 output, strided tensors,
 * skipping on or off)
 * within tolerance of the reference, each taking the separable path (its predicate asked); and
 * launches mixing lambda = 0 heads with others, which (asking pair counts here) take the general
 * kernel as a whole and match too.
 */
TEST(separable_matches_reference)
{
	static const ape_dtype types[] = { APE_F16, APE_BF16 };
	static const int64_t dims[] = { 64, 128 };
	const int ncases = 16;
	struct pair_of_devices d;
	double worst = 0;
	int fails = 0, taken = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_separable");
	for (int c = 0; c < ncases; c++) {
		const int64_t D = dims[(c / 4) % 2]; /* x 2 types x skipping on and off */
		const int64_t Hkv = ape_rng_range(&rng, 1, 2), H = Hkv * ape_rng_range(&rng, 1, 2);
		const int64_t Lq = ape_rng_range(&rng, 17, D == 128 ? 150 : 260);
		const int64_t Lk = ape_rng_range(&rng, 1, D == 128 ? 150 : 260);
		const bool mixed = c >= ncases - 3;
		test_problem tp;
		struct verdict v;
		float hp[4 * 8];

		const test_problem_shape sh = { 1 + (c % 5 == 0), H, Hkv, Lq, Lk, D };

		/* every fourth strided: padded [B, L, H, D] views */
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[(c / 2) % 2], c % 4 == 3));
		test_problem_random_params(&tp, &rng);
		separable_params(&tp, &rng, c % 4);
		if (c % 3 == 0) { /* far from the origin, distances small */
			tp.desc.k_start += ((int64_t)1 << 40) - ape_rng_range(&rng, 0, 1000);
			tp.desc.q_start_set = true;
			tp.desc.q_start = tp.desc.k_start + ape_rng_range(&rng, -40, 100);
		}
		if (c % 4 == 1 && test_problem_set_out_dtype(&tp, APE_F32))
			ASSERT_TRUE(false);
		if (c % 6 == 5) {
			free(tp.lse);
			tp.lse = NULL;
		}
		tp.desc.skip_tol = c % 2 ? 0 : 0x1p-20;
		if (mixed) /* one head is not separable: the general kernel takes the launch */
			tp.params[3 * H + ape_rng_range(&rng, 0, H - 1)] = 0.5f;
		EXPECT_EQ(!mixed, takes_separable(&tp, hp));
		taken += takes_separable(&tp, hp);
		fails += run_both(_metadata, &d, &tp, &v) != 0;
		EXPECT_LE(v.computed, v.visible);
		if (tp.desc.skip_tol == 0)
			EXPECT_EQ(v.visible, v.computed);
		worst = fmax(worst, fmax(v.o_ratio, v.lse_ratio));
		test_problem_free(&tp);
	}
	TH_LOG("%d cases (%d separable), worst error %.3g of the tolerance", ncases, taken, worst);
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/*
 * Launches mixing kv groups whose heads all have lambda = 0 with others: without pair counts
 * they run as sub-launches per run of kv groups (the separable path and the general kernel, the
 * views moved along H), within tolerance of the reference.
 */
TEST(separable_mixed_heads_split)
{
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_separable_mixed");
	for (int c = 0; c < 4; c++) {
		const int64_t Hkv = 3, H = Hkv * (1 + c % 2), D = c < 2 ? 64 : 128;
		const ape_dtype dt = c % 2 ? APE_BF16 : APE_F16;
		test_problem tp, r;
		struct ape_be_launch l;
		float hp[4 * 6];
		double eo, el;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1 + c / 3, H, Hkv, ape_rng_range(&rng, 17, 140),
					 ape_rng_range(&rng, 1, 140), D, dt));
		test_problem_random_params(&tp, &rng);
		separable_params(&tp, &rng, 2 + c % 2);
		/* the middle kv group (or the outer ones) is not separable */
		for (int64_t h = 0; h < H; h++)
			if ((h / (H / Hkv) == 1) == (c < 2))
				tp.params[3 * H + h] = 0.3f;
		sep_launch(&tp, hp, &l);
		EXPECT_TRUE(ape__cu_split_applies(&l));
		EXPECT_FALSE(ape__cu_separable_applies(&l));
		ASSERT_EQ(0, test_problem_clone(&r, &tp));
		ASSERT_EQ(0, test_problem_run(&tp, d.cuda)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_problem_run(&r, d.ref)) TH_LOG("%s", ape_last_error());
		eo = test_max_err_o(&tp.o.t, &r.o.t) / fmax(test_tensor_maxabs(&tp.v.t), 1e-30);
		el = tp.lse ? test_max_rel_err_lse(tp.lse, r.lse, tp.rows) : 0;
		if (!(eo <= test_tol_o(dt)) || !(el <= test_tol_lse(dt))) {
			TH_LOG("case %d: O error %.3g, LSE error %.3g", c, eo, el);
			fails++;
		}
		test_problem_free(&tp);
		test_problem_free(&r);
	}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* Causal, a decay: skipping computes fewer pairs than a dense run and stays within tolerance;
 * a NaN in V reaches exactly the rows that see its key, also in a tile the diagonal cuts. */
TEST(separable_skipping_and_nan)
{
	struct pair_of_devices d;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_separable_skip");
	for (int c = 0; c < 2; c++) {
		test_problem tp, dense;
		struct verdict v, vd;
		float hp[4];

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 1, 1, 300, 300, 64, c ? APE_BF16 : APE_F16));
		test_problem_set_params(&tp, 0.5, c ? 0.8 : 0, c ? 0.4 : 0, 0);
		tp.desc.causal = true;
		tp.desc.skip_tol = 0x1p-24;
		ASSERT_TRUE(takes_separable(&tp, hp));
		ASSERT_EQ(0, test_problem_clone(&dense, &tp));
		dense.desc.skip_tol = 0;
		EXPECT_EQ(0, run_both(_metadata, &d, &tp, &v));
		EXPECT_EQ(0, run_both(_metadata, &d, &dense, &vd));
		EXPECT_EQ(vd.visible, vd.computed);
		EXPECT_LT(v.computed, v.visible) TH_LOG("case %d: a decay of 0.5: far keys skipped", c);
		TH_LOG("case %d: %llu of %llu visible pairs computed", c,
		       (unsigned long long)v.computed, (unsigned long long)v.visible);
		test_problem_free(&tp);
		test_problem_free(&dense);
	}
	{
		/* rows 0..99 at q_start = 0 see keys 0..i: key 70's V NaN reaches rows 70.. only,
		 * row 70 and its neighbours sit in a tile the diagonal cuts */
		test_problem tp, r;
		float hp[4];

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 1, 1, 100, 100, 64, APE_F16));
		tp.desc.causal = true;
		tp.desc.skip_tol = 0;
		tp.desc.q_start_set = true;
		tp.desc.q_start = tp.desc.k_start = 0;
		test_tensor_set(&tp.v.t, 0, 0, 70, 5, NAN);
		ASSERT_TRUE(takes_separable(&tp, hp));
		ASSERT_EQ(0, test_problem_clone(&r, &tp));
		ASSERT_EQ(0, test_problem_run(&tp, d.cuda)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_problem_run(&r, d.ref)) TH_LOG("%s", ape_last_error());
		for (int64_t i = 0; i < 100; i++)
			for (int64_t e = 0; e < 64; e++) {
				const double a = test_tensor_get(&tp.o.t, 0, 0, i, e);
				const double w = test_tensor_get(&r.o.t, 0, 0, i, e);

				EXPECT_EQ(isnan(w) != 0, isnan(a) != 0) TH_LOG("row %lld col %lld",
									    (long long)i, (long long)e);
				if (!isnan(w))
					EXPECT_LE(fabs(a - w), test_tol_o(APE_F16) * 5);
			}
		test_problem_free(&tp);
		test_problem_free(&r);
	}
	ape_context_destroy(d.ctx);
}

/* f16's largest finite magnitude */
#define F16_MAX 65504.0

/*
 * Fills t (f16) with rows of two kinds, random signs: "near the top", a quarter of the elements
 * exactly 65504 and the others in [46400, 65504] (every pair's norm above 65504: a rotation
 * takes it past f16's range at some angle), and "just below", all in [30000, 46300] (every
 * pair's norm below 65504). Row l is near the top with probability 1/2, and, when
 * tile_parity >= 0, only in the tiles of 64 rows (the separable path's key tiles) whose index
 * has that parity: halved and plain rows, and tiles, meet in one launch.
 */
static void fill_near_f16_max(ape_tensor *t, ape_rng *rng, int tile_parity)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++) {
				const bool top = ape_rng_uniform(rng) < 0.5 &&
						 (tile_parity < 0 || (l / 64) % 2 == tile_parity);

				for (int64_t e = 0; e < t->shape[3]; e++) {
					const double u = ape_rng_uniform(rng), w = ape_rng_uniform(rng);
					const double m = !top	   ? 30000 + w * 16300
							 : u < 0.25 ? F16_MAX
								    : 46400 + w * (F16_MAX - 46400);

					test_tensor_set(t, b, h, l, e, ape_rng_uniform(rng) < 0.5 ? m : -m);
				}
			}
}

/*
 * f16 Q and K with components at and near +-65504 (a rotated pair then exceeds f16's range by
 * up to sqrt(2)) in some rows and key tiles, just below the guard's threshold in the others,
 * both layouts, causal or not, GQA, skipping on or off, D = 64 and 128: the separable path
 * within tolerance of the reference, no NaN or Inf. The scale keeps |scale| |q| |k| at a few
 * units, the range where the spec's tolerance holds (docs/ape.md).
 */
TEST(separable_f16_near_max_matches_reference)
{
	struct pair_of_devices d;
	double worst = 0;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_separable_f16_max");
	for (int c = 0; c < 8; c++) {
		const int64_t D = c < 4 ? 64 : 128, Hkv = 1 + c % 2, H = 2 * Hkv;
		test_problem tp;
		struct verdict v;
		float hp[4 * 4];

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, H, Hkv, ape_rng_range(&rng, 17, 140),
					 ape_rng_range(&rng, c % 4 ? 65 : 1, 160), D, APE_F16));
		test_problem_random_params(&tp, &rng);
		separable_params(&tp, &rng, c % 4);
		tp.desc.layout = c % 2 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		tp.desc.causal = (c / 2) % 2;
		tp.desc.skip_tol = c % 3 ? 0x1p-20 : 0;
		tp.desc.scale_set = true;
		tp.desc.scale = (ape_rng_uniform(&rng) < 0.5 ? -1 : 1) * (1 + 3 * ape_rng_uniform(&rng)) /
				((double)D * F16_MAX * F16_MAX);
		fill_near_f16_max(&tp.q.t, &rng, -1);
		fill_near_f16_max(&tp.k.t, &rng, c % 2);
		ASSERT_TRUE(takes_separable(&tp, hp));
		fails += run_both(_metadata, &d, &tp, &v) != 0;
		worst = fmax(worst, fmax(v.o_ratio, v.lse_ratio));
		test_problem_free(&tp);
	}
	TH_LOG("8 cases, worst error %.3g of the tolerance", worst);
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}


CUDA_EMU_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the CUDA backend is not built into this libape")
#endif /* APE_HAVE_CUDA */
