/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's real kernels (the .cu files of cuda/kernels) against the reference backend,
 * with no GPU: the fake driver of tests/fake_cuda built with the emulator (cuda/emu) runs every
 * launch on the CPU, fiber per thread, with the PTX semantics of the warp collectives, ldmatrix,
 * mma and cp.async. What this proves and what it cannot (timing, memory ordering between real
 * warps, the hardware's own rounding of ex2 and mma) is in docs/cuda.md.
 *
 * Fresh random inputs each run (APE_TEST_SEED replays one): awkward sizes, D = 64, 128 and
 * generic ones, GQA, both rope layouts, causal or not, q_start/k_start offsets, f32/f16/bf16,
 * LSE, the prefill (Lq > 16) and the decode kernels (Lq 1..16, split keys merged by LSE),
 * skipping on (fewer pairs, error within tolerance) and off (every visible pair). Outputs are
 * poisoned before each launch (the context's APE_CONTEXT_POISON_OUTPUTS and
 * test_problem_run()), so an element no kernel wrote shows as NaN.
 *
 * Sizes are chosen for the emulator's speed: the whole program took 14 to 22 s on a loaded
 * 2-core machine (docs/cuda.md), the lse_prior tests (the streaming executor, OpenCL alongside)
 * a third to a half of it. The separable path: test_cuda_emu_separable.c.
 *
 * With APE_TEST_CUDA_DEVICE=1 the same tests run on this machine's own driver and GPU instead
 * (tools/gpu-check.sh does that; the program exits 4 when there is no CUDA device), except the
 * ones that need the fake driver's fault injection.
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

static const ape_dtype all_types[] = { APE_F32, APE_F16, APE_BF16 };

/* ---- random cases over the kernels' shapes */

/*
 * Every head-size variant (D = 64, 128 specialised; 40 and 96 through the generic 128 path,
 * 130 through the generic 256 one), query lengths that hit the decode kernel (1, 7) and the
 * prefill (63, and one longer length drawn from 130..300 per run), the storage types rotating
 * over that grid, random parameters, layouts, causality and offsets.
 */
TEST(random_shapes_match_reference)
{
	static const int64_t dims[] = { 64, 128, 40, 96, 130 };
	const int64_t lens[] = { 1, 7, 63, 0 };
	struct pair_of_devices d;
	double worst = 0;
	int fails = 0, runs = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_random");
	for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
		for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
			const int64_t D = dims[di];
			const int64_t Lq = lens[li] ? lens[li] : ape_rng_range(&rng, 130, 300);
			/* decode rows read a longer cache; prefill is square */
			const int64_t Lk = Lq <= 16 ? ape_rng_range(&rng, Lq, 600) : Lq;
			const int64_t Hkv = ape_rng_range(&rng, 1, 2), H = Hkv * ape_rng_range(&rng, 1, 3);
			const ape_dtype dt = all_types[(di + li) % 3];
			/* the longer lengths cost most: one head there */
			const bool big = Lq > 100 || D > 128;
			test_problem tp;
			struct verdict v;

			ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, big ? 1 : H, big ? 1 : Hkv, Lq, Lk, D,
						 dt));
			test_problem_random_params(&tp, &rng);
			if (ape_rng_uniform(&rng) < 0.3)
				ASSERT_EQ(0, test_problem_set_out_dtype(&tp, APE_F32));
			fails += run_both(_metadata, &d, &tp, &v) != 0;
			worst = fmax(worst, fmax(v.o_ratio, v.lse_ratio));
			runs++;
			test_problem_free(&tp);
		}
	TH_LOG("%d cases, worst error %.3g of the tolerance", runs, worst);
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* test_problem_random()'s own mix (strided tensors, tiny and empty shapes, every D it draws). */
TEST(problem_generator_cases_match_reference)
{
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_generator");
	for (int n = 0; n < 12; n++) {
		test_problem tp;
		struct verdict v;

		ASSERT_EQ(0, test_problem_random(&tp, &rng, 0));
		fails += run_both(_metadata, &d, &tp, &v) != 0;
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* ---- the decode kernel: every query count, GQA groups, a cache longer than one split */

TEST(decode_rows_1_to_16)
{
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_decode");
	for (int64_t Lq = 1; Lq <= 16; Lq += (Lq < 4 ? 1 : 5)) {
		const int64_t D = Lq % 2 ? 64 : 128;
		test_problem tp;
		struct verdict v;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 2, 4, 2, Lq, ape_rng_range(&rng, 700, 1100), D,
					 all_types[Lq % 3]));
		test_problem_random_params(&tp, &rng);
		tp.desc.skip_tol = 0; /* every visible pair, every split */
		fails += run_both(_metadata, &d, &tp, &v) != 0;
		EXPECT_EQ(v.visible, v.computed);
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* ---- skipping far keys: on, with a real decay; off, by tolerance 0 or a negative decay */

/* How a skip case sets skipping: on (the default tolerance, a real decay), or off. */
enum skip_mode { SKIP_ON, SKIP_TOL_0, SKIP_NEG_DECAY };

struct skip_spec {
	int64_t Lq, Lk, D;
	ape_dtype dt;
	bool causal;
	enum skip_mode mode;
};

/* Prefill (Lq > 16) and decode (Lq <= 16, through ape_dwindow) cases. */
static const struct skip_spec prefill_skips[] = {
	{ 400, 400, 64, APE_F32, true, SKIP_ON },
	{ 300, 300, 128, APE_F16, false, SKIP_ON },
	{ 200, 200, 64, APE_BF16, true, SKIP_TOL_0 },
	{ 200, 200, 64, APE_F32, false, SKIP_NEG_DECAY },
};

static const struct skip_spec decode_skips[] = {
	{ 1, 3000, 128, APE_F16, true, SKIP_ON },
	{ 9, 3000, 64, APE_F32, false, SKIP_ON },
	{ 4, 1500, 64, APE_BF16, true, SKIP_TOL_0 },
	{ 4, 1500, 64, APE_F32, true, SKIP_NEG_DECAY },
};

/* Skipping on: fewer pairs, error within tolerance; off: every visible pair. */
static void skip_cases(struct __test_metadata *_metadata, const struct skip_spec *cs, size_t n,
		       const char *rng_name)
{
	static const char *const mode_names[] = { "skip on", "skip_tol 0", "a negative decay" };
	struct pair_of_devices d;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, rng_name);
	for (const struct skip_spec *c = cs; c < cs + n; c++) {
		test_problem tp;
		struct verdict v;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 1, c->Lq, c->Lk, c->D, c->dt));
		test_problem_seed_params(&tp);
		tp.desc.causal = c->causal;
		if (c->mode == SKIP_TOL_0)
			tp.desc.skip_tol = 0;
		if (c->mode == SKIP_NEG_DECAY) /* one negative decay turns skipping off */
			test_problem_set_params(&tp, pow(2.0, -4.0 / 3.0), -0.01, 0.02, 0.1);
		EXPECT_EQ(0, run_both(_metadata, &d, &tp, &v));
		TH_LOG("Lq=%lld Lk=%lld D=%lld %s, %s: %llu of %llu visible pairs computed",
		       (long long)c->Lq, (long long)c->Lk, (long long)c->D,
		       c->causal ? "causal" : "non-causal", mode_names[c->mode],
		       (unsigned long long)v.computed, (unsigned long long)v.visible);
		if (c->mode == SKIP_ON) {
			/* causal rows reach back about one tile; non-causal ones one each side */
			EXPECT_LT(v.computed, c->causal ? v.visible / 2 : v.visible * 2 / 3);
		} else {
			EXPECT_EQ(v.visible, v.computed);
		}
		test_problem_free(&tp);
	}
	ape_context_destroy(d.ctx);
}

TEST(prefill_skipping_on_and_off)
{
	skip_cases(_metadata, prefill_skips, sizeof(prefill_skips) / sizeof(prefill_skips[0]),
		   "cuda_emu_skip_prefill");
}

TEST(decode_skipping_on_and_off)
{
	skip_cases(_metadata, decode_skips, sizeof(decode_skips) / sizeof(decode_skips[0]),
		   "cuda_emu_skip_decode");
}

/* ---- the streaming executor's lse_prior */

/* Streams tp on dev in square chunks of c rows and keys (poisoned outputs first); 0 when it ran
 * and O and LSE are within the tolerance of the reference's one-shot result `want`. */
static int stream_chunks(struct __test_metadata *_metadata, test_problem *tp,
			 const test_problem *want, ape_device *dev, int64_t c, const char *what,
			 ape_stats *st)
{
	const ape_dtype dt = tp->q.t.dtype;
	const double vmax = fmax(test_tensor_maxabs(&tp->v.t), 1e-30);
	ape_exec_options o;
	double eo, el;

	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = c;
	test_tensor_poison(&tp->o.t);
	for (size_t r = 0; r < tp->rows; r++)
		tp->lse[r] = NAN;
	ape_stats_init(st);
	if (ape_attention_forward_ex(&dev, 1, &o, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t,
				     &tp->o.t, tp->lse, st)) {
		TH_LOG("%s: %s", what, ape_last_error());
		return -1;
	}
	eo = test_max_err_o(&tp->o.t, &want->o.t) / vmax / test_tol_o(dt);
	el = test_max_rel_err_lse(tp->lse, want->lse, tp->rows) / test_tol_lse(dt);
	if (!(eo <= 1) || !(el <= 1) || poisoned(tp)) {
		TH_LOG("%s: O error %.3g, LSE error %.3g (x tolerance)%s", what, eo, el,
		       poisoned(tp) ? ", NaN in the outputs" : "");
		return -1;
	}
	return 0;
}

/*
 * The launches of test_stream.c's neighbour_chunks_start_from_the_diagonal_weight: causal,
 * chunks of 256, the seed's parameters, so that each key chunk next to the diagonal gets the
 * query chunk's merged LSE so far as lse_prior. The CUDA kernels read it: on the launches that get
 * a prior (counted by the wrapper) the emulated CUDA prefill computes no more pairs than the
 * OpenCL kernel, and the whole call computes fewer pairs than without the prior (no
 * attention_merge), by more than a key tile per row of half the rows.
 */
TEST(prefill_honours_lse_prior)
{
	const int64_t c = 256, L = 4 * c;
	const test_problem_shape sh = { 1, 2, 1, L, L, 32 };
	ape_context *ctx = test_context("cuda,opencl,ref");
	ape_device *cuda = ctx ? test_device(ctx, "cuda") : NULL;
	ape_device *ocl = ctx ? test_device(ctx, "opencl") : NULL;
	ape_device *ref = ctx ? test_device(ctx, "ref") : NULL;
	struct wrap_counts wc_cuda, wc_ocl;
	ape_stats with, without, st_ocl;
	test_problem tp, want;
	ape_rng rng;

	ASSERT_NE(NULL, ref);
	ASSERT_NE(NULL, cuda) TH_LOG("no CUDA device (%s)", real_device ? "real" : EMU_LIB);
	if (!ocl) {
		ape_context_destroy(ctx);
		SKIP(return, "no OpenCL device to compare with");
	}
	ape_rng_init(&rng, "cuda_emu_prior");
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.skip_tol = 0x1p-24;
	test_problem_set_params(&tp, 0.39685, 0.039685, 0.039685, 0.1); /* the seed's */
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, ref));
	wrap_install(ocl, 0);
	EXPECT_EQ(0, stream_chunks(_metadata, &tp, &want, ocl, c, "opencl", &st_ocl));
	wc_ocl = wrap_get();
	wrap_remove();
	wrap_install(cuda, 0);
	EXPECT_EQ(0, stream_chunks(_metadata, &tp, &want, cuda, c, "cuda", &with));
	wc_cuda = wrap_get();
	wrap_remove();
	wrap_install(cuda, WRAP_NO_MERGE); /* no merge on the device: no prior */
	EXPECT_EQ(0, stream_chunks(_metadata, &tp, &want, cuda, c, "cuda, no prior", &without));
	wrap_remove();

	TH_LOG("launches with a prior: cuda %llu computing %llu pairs, opencl %llu computing %llu; "
	       "whole call: cuda %llu pairs, %llu without the prior, opencl %llu",
	       (unsigned long long)wc_cuda.prior_launches, (unsigned long long)wc_cuda.prior_pairs,
	       (unsigned long long)wc_ocl.prior_launches, (unsigned long long)wc_ocl.prior_pairs,
	       (unsigned long long)with.pairs_computed,
	       (unsigned long long)without.pairs_computed,
	       (unsigned long long)st_ocl.pairs_computed);
	/* the same launches got a prior on both (chunk-level skipping is the executor's) */
	EXPECT_GE(wc_cuda.prior_launches, (uint64_t)(L / c - 1));
	EXPECT_EQ(wc_ocl.prior_launches, wc_cuda.prior_launches);
	EXPECT_LE(wc_cuda.prior_pairs, wc_ocl.prior_pairs);
	EXPECT_LT(with.pairs_computed + (uint64_t)(L / 2) * 2 * 64, without.pairs_computed);
	test_problem_free(&tp);
	test_problem_free(&want);
	ape_context_destroy(ctx);
}

/* The decode path with a prior (the window kernel reads it): 16 rows next to a key chunk
 * boundary, not causal, so that the chunk after the diagonal one is launched with the diagonal
 * launch's LSE; the result stays within tolerance. */
TEST(decode_with_lse_prior)
{
	const int64_t c = 256;
	const test_problem_shape sh = { 1, 4, 2, 16, 4 * c, 64 };
	struct pair_of_devices d;
	struct wrap_counts wc;
	test_problem tp, want;
	ape_stats st;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_prior_decode");
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = false;
	tp.desc.q_start_set = true;
	tp.desc.q_start = 2 * c - 12;
	tp.desc.skip_tol = 0x1p-24;
	test_problem_seed_params(&tp);
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, d.ref));
	wrap_install(d.cuda, 0);
	EXPECT_EQ(0, stream_chunks(_metadata, &tp, &want, d.cuda, c, "cuda", &st));
	wc = wrap_get();
	wrap_remove();
	EXPECT_GE(wc.prior_launches, 1);
	TH_LOG("%llu launches, %llu with a prior; %llu of %llu visible pairs computed",
	       (unsigned long long)st.chunks, (unsigned long long)wc.prior_launches,
	       (unsigned long long)st.pairs_computed, (unsigned long long)st.pairs_visible);
	test_problem_free(&tp);
	test_problem_free(&want);
	ape_context_destroy(d.ctx);
}

/* ---- the launch's plumbing */

/* Through the normal API: the registry lists the backend and "auto" prefers it. */
TEST(auto_selection_prefers_cuda)
{
	ape_context *ctx = test_context(NULL);
	ape_device_info info;
	ape_selection sel;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_device_get_info(sel.device, &info));
	EXPECT_STREQ("cuda", info.backend) TH_LOG("auto chose %s (%s)", info.name, sel.note);
	ape_context_destroy(ctx);
}

/* More heads than the argument struct carries inline (their parameters go through scratch). */
TEST(many_heads_parameters_through_scratch)
{
	struct pair_of_devices d;
	test_problem tp;
	struct verdict v;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_heads");
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 72, 8, 3, 40, 64, APE_F16));
	test_problem_random_params(&tp, &rng);
	EXPECT_EQ(0, run_both(_metadata, &d, &tp, &v));
	test_problem_free(&tp);
	ape_context_destroy(d.ctx);
}

/* ---- the diagnostics' kernel twins (docs/diagnostics.md, "CUDA") */

/*
 * The _diag twins of the prefill, decode and merge kernels change nothing but the two extra
 * outputs: the same call with and without entropy and mean distance gives bit-identical O and
 * LSE (the same launches; the twins' softmax, P V and merge are the plain kernels' code), on
 * the prefill and the decode kernel, every storage type, skipping on (the seed's decay, at the
 * default 2^-24 that diagnostics keep) and off; and the diagnostics are within the spec's
 * tolerance of the long-double evaluation.
 */
TEST(diag_twins_leave_o_and_lse_bit_identical)
{
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 3, 900, 64 }, /* decode, several splits */
		{ 1, 2, 1, 70, 90, 128 }, /* prefill */
		{ 1, 2, 2, 20, 40, 40 }, /* prefill, generic D */
	};
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_diag");
	for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
		for (int t = 0; t < 3; t++) {
			test_problem tp;
			ape_exec_options o;
			ape_tensor o2;
			float *lse2 = NULL, *ent = NULL, *md = NULL;
			void *obuf = NULL;
			size_t ob;
			char what[512];

			ASSERT_EQ(0, test_problem_make(&tp, &rng, &shapes[s], all_types[t], false));
			if (t == 1)
				test_problem_seed_params(&tp); /* skipping on */
			else
				test_problem_random_params(&tp, &rng);
			tp.desc.skip_tol = 0x1p-24;
			ASSERT_EQ(0, test_problem_naive(&tp));
			test_problem_describe(&tp, what, sizeof(what));
			ob = tp.o.alloc_bytes; /* contiguous: data is the allocation */
			obuf = malloc(ob);
			lse2 = malloc(sizeof(float) * tp.rows);
			ent = malloc(sizeof(float) * tp.rows);
			md = malloc(sizeof(float) * tp.rows);
			ASSERT_TRUE(obuf && lse2 && ent && md);
			o2 = tp.o.t;
			o2.data = obuf;
			memset(obuf, 0xff, ob);
			ape_exec_options_init(&o);
			ASSERT_EQ(0, ape_attention_forward_ex(&d.cuda, 1, &o, &tp.desc, &tp.q.t,
							      &tp.k.t, &tp.v.t, &tp.o.t, tp.lse, NULL))
			TH_LOG("%s: %s", what, ape_last_error());
			ASSERT_EQ(0, ape_attention_forward_diag(&d.cuda, 1, &o, &tp.desc, &tp.q.t,
								&tp.k.t, &tp.v.t, &o2, lse2, ent, md,
								NULL))
			TH_LOG("%s: %s", what, ape_last_error());
			if (memcmp(obuf, tp.o.t.data, ob) ||
			    memcmp(lse2, tp.lse, sizeof(float) * tp.rows)) {
				TH_LOG("%s: O or LSE differ with the diagnostics", what);
				fails++;
			}
			for (size_t r = 0; r < tp.rows; r++) {
				const double l = tp.naive_lse[r];
				const double ee = fabs(ent[r] - tp.naive_ent[r]) /
						  fmax(1, isfinite(l) ? fabs(l) : 1);
				const double em = fabs(md[r] - tp.naive_md[r]) /
						  fmax(1, tp.naive_mdmax[r]);

				if (!(ee <= test_tol_lse(tp.q.t.dtype)) ||
				    !(em <= test_tol_lse(tp.q.t.dtype))) {
					TH_LOG("%s: row %zu: ENT %.9g (want %.9g), MD %.9g (want %.9g)",
					       what, r, ent[r], tp.naive_ent[r], md[r], tp.naive_md[r]);
					fails++;
					break;
				}
			}
			free(obuf);
			free(lse2);
			free(ent);
			free(md);
			test_problem_free(&tp);
		}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* ---- the backward pass (cuda/kernels/backward.cu) */

/*
 * The backward kernels against the reference backend at the spec's tolerances (APE-SPEC.md,
 * "Gradients"): every head-size variant (64 and 128 specialised, 40, 130 and 256 generic), lengths
 * across the fused sweep's key tile and stage borders (bwd_args.h: tiles of 64, 32, 32 and 16
 * keys, stages of 32, 32, 32 and 16 rows), more key tiles than splits (a split walks several,
 * its slices written, then added to), GQA, MQA and
 * more heads than travel inline (their parameters through scratch), both layouts, causal or
 * not, offsets up to 2^40 with rows that see no key (their dQ untouched: exactly 0 here),
 * per-head parameters with negative decays and lambda = 0, with and without dLSE, the storage
 * types rotating, O saved in float32 from 16-bit inputs. Every other case runs twice (bit-identical), the others once more with a
 * subset of the outputs (dparams alone, dq, dk, dv, dq and dk): those bit for bit as with all
 * four, the others never written. 12 to 16 s on the emulator (2 cores, load average 7).
 */
TEST(backward_matches_reference)
{
	static const test_problem_shape shapes[] = {
		{ 1, 1, 1, 66, 65, 64 }, /* d64: two row blocks, two stages of 64 */
		{ 1, 2, 1, 33, 40, 128 }, /* d128, GQA: borders at 32 */
		{ 2, 2, 2, 33, 20, 40 }, /* g128 */
		{ 1, 1, 1, 17, 20, 130 }, /* g256: borders at 16 */
		{ 1, 2, 2, 17, 18, 256 }, /* g256 at its full width */
		{ 1, 66, 2, 5, 7, 8 }, /* groups of 33 heads, their parameters through scratch */
		/* 10 key tiles of 16, at most 8 splits (bwd_nsplit()): two tiles for a split */
		{ 1, 2, 2, 21, 150, 130 },
		/* one (batch, kv head): 16 splits (4 per emulated multiprocessor, over OpenCL's 8)
		 * of 19 key tiles, three splits walking two */
		{ 1, 1, 1, 9, 300, 130 },
	};
	const int nshapes = sizeof(shapes) / sizeof(shapes[0]);
	const int ncases = real_device ? 6 * nshapes : 2 * nshapes;
	struct pair_of_devices d;
	double worst = 0;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_backward");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % nshapes];
		const ape_dtype dt = all_types[(i + i / nshapes) % 3]; /* each shape, two types */
		const double tol = grads_tol(dt);
		bcase c;
		grads want, g, again, only, untouched;
		grads *const all[5] = { &want, &g, &again, &only, &untouched };
		/* every other case, a subset of the outputs: those bit for bit as with all four */
		static const unsigned subsets[5] = { W_DP, W_DQ, W_DK, W_DV, W_DQ | W_DK };
		const unsigned w = subsets[i / 2 % 5];
		const bool tail = sh->Lk > 4 * sh->Lq;
		double e[4];
		char what[512];

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, false, i % 2 == 0));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i / 2 % 2 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i % 4 != 3;
		c.tp.desc.k_start = i % 3 == 1 ? ((int64_t)1 << 40) + i : i - 5;
		/* causal: the first rows see no key; with many more keys than rows, the rows at
		 * the keys' end instead, so that they see every tile */
		c.tp.desc.q_start = c.tp.desc.k_start + (tail ? sh->Lk - sh->Lq : -2);
		c.tp.desc.q_start_set = true;
		if (i % 5 == 2 || tail) /* tail: negative decays, so that far tiles weigh */
			bcase_edge_heads(&c);
		if (dt != APE_F32 && i % 4 == 1) /* O saved in float32 */
			ASSERT_EQ(0, test_problem_set_out_dtype(&c.tp, APE_F32));
		ASSERT_EQ(0, bcase_forward(&c, d.ref)) TH_LOG("%s", ape_last_error());
		for (int x = 0; x < 5; x++)
			ASSERT_EQ(0, grads_alloc(all[x], &c, APE_F32));
		test_problem_describe(&c.tp, what, sizeof(what));
		ASSERT_EQ(0, run_backward(&c, d.ref, &want, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, d.cuda, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		/* the emulator is slow: the rerun and the subset on every other case */
		EXPECT_EQ(0, run_backward(&c, d.cuda, i % 2 ? &again : &only, i % 2 ? W_ALL : w, NULL));
		e[0] = grads_rel_err(&g.dq.t, &want.dq.t);
		e[1] = grads_rel_err(&g.dk.t, &want.dk.t);
		e[2] = grads_rel_err(&g.dv.t, &want.dv.t);
		e[3] = grads_rel_err_params(g.dparams, want.dparams, sh->H);
		for (int x = 0; x < 4; x++) {
			static const char *const names[4] = { "dq", "dk", "dv", "dparams" };

			worst = fmax(worst, e[x] / tol);
			if (!(e[x] <= tol)) {
				TH_LOG("case %d: %s: %s error %.3g of max |G| (tolerance %.3g)", i,
				       what, names[x], e[x], tol);
				fails++;
			}
		}
		if (i % 2) {
			EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: %s: reruns differ",
									 i, what);
		} else {
			EXPECT_TRUE(same_grads(&only, &g, w)) TH_LOG("case %d: wanted 0x%x", i, w);
			EXPECT_TRUE(same_grads(&only, &untouched, W_ALL & ~w)) TH_LOG("case %d", i);
		}
		if (c.tp.desc.causal && !tail) /* row 0 sees no key */
			for (int64_t dd = 0; dd < sh->D; dd++)
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, sh->H - 1, 0, dd));
		for (int x = 0; x < 5; x++)
			grads_free(all[x]);
		bcase_free(&c);
	}
	TH_LOG("%d cases, worst error %.3g of the tolerance", ncases, worst);
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* Where NaN lands in a gradient tensor matches: NaN in a exactly where in b. */
static bool same_nans(const ape_tensor *a, const ape_tensor *b)
{
	for (int64_t i = 0; i < a->shape[0]; i++)
		for (int64_t h = 0; h < a->shape[1]; h++)
			for (int64_t l = 0; l < a->shape[2]; l++)
				for (int64_t e = 0; e < a->shape[3]; e++)
					if (isnan(test_tensor_get(a, i, h, l, e)) !=
					    isnan(test_tensor_get(b, i, h, l, e)))
						return false;
	return true;
}

/*
 * Inputs are not scanned: a NaN in the last key's V reaches, through Dl_i = dO_i . O_i, the rows
 * that see that key (causal: the last ones) and the keys those rows see, and nothing else: the
 * rows before it keep finite gradients, as in the reference (a masked pair adds nothing, not
 * 0 * NaN). Several query blocks and key blocks, so that masked pairs sit inside the tiles.
 */
TEST(backward_nan_reaches_only_what_it_touches)
{
	const test_problem_shape sh = { 1, 2, 1, 40, 40, 40 };
	struct pair_of_devices d;
	grads want, g;
	bcase c;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_backward_nan");
	ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, false));
	test_problem_random_params(&c.tp, &rng);
	c.tp.desc.causal = true;
	c.tp.desc.q_start_set = false; /* aligned to the end: row i sees keys 0..i */
	test_tensor_set(&c.tp.v.t, 0, 0, sh.Lk - 1, 3, NAN);
	ASSERT_EQ(0, bcase_forward(&c, d.ref)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, run_backward(&c, d.ref, &want, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, run_backward(&c, d.cuda, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(isnan(test_tensor_get(&want.dq.t, 0, 1, sh.Lq - 1, 0)));
	EXPECT_FALSE(isnan(test_tensor_get(&want.dq.t, 0, 1, sh.Lq - 2, 0)));
	EXPECT_TRUE(same_nans(&g.dq.t, &want.dq.t));
	EXPECT_TRUE(same_nans(&g.dk.t, &want.dk.t));
	EXPECT_TRUE(same_nans(&g.dv.t, &want.dv.t));
	grads_free(&want);
	grads_free(&g);
	bcase_free(&c);
	ape_context_destroy(d.ctx);
}

/* The devices with the fake driver in its fault mode: every kernel launch faults (sticky). */
static void open_faulting_devices(struct __test_metadata *_metadata, struct pair_of_devices *d)
{
	setenv("FAKE_CUDA_MODE", "fault", 1);
	open_devices(_metadata, d);
}

/* A kernel that faults: the call fails with APE_EDEVLOST naming the CUDA error, no abort. */
TEST(device_fault_is_devlost)
{
	struct pair_of_devices d;
	test_problem tp;
	ape_rng rng;
	int ret;

	if (real_device)
		SKIP(return, "fault injection needs the fake driver");
	open_faulting_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_fault");
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 2, 20, 20, 64, APE_F32));
	ret = test_problem_run(&tp, d.cuda);
	EXPECT_EQ(APE_EDEVLOST, ret) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "CUDA_ERROR_ILLEGAL_ADDRESS"))
	TH_LOG("%s", ape_last_error());
	test_problem_free(&tp);
	ape_context_destroy(d.ctx);
}

/* A backward kernel that faults: APE_EDEVLOST naming the call, the device and the CUDA error;
 * nothing written. */
TEST(backward_fault_is_devlost)
{
	const test_problem_shape sh = { 1, 2, 1, 9, 9, 16 };
	struct pair_of_devices d;
	grads g, untouched;
	bcase c;
	ape_rng rng;

	if (real_device)
		SKIP(return, "fault injection needs the fake driver");
	open_faulting_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_backward_fault");
	/* random positions may hide every pair from the causal mask: then no kernel is
	 * launched, nothing faults and the call rightly succeeds */
	ASSERT_EQ(0, bcase_ready_visible(&c, &rng, &sh, APE_F32, false, true, d.ref));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&untouched, &c, APE_F32));
	EXPECT_EQ(APE_EDEVLOST, run_backward(&c, d.cuda, &g, W_ALL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_backward: cuda:0"))
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "CUDA_ERROR_ILLEGAL_ADDRESS"))
	TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(same_grads(&g, &untouched, W_ALL));
	grads_free(&g);
	grads_free(&untouched);
	bcase_free(&c);
	ape_context_destroy(d.ctx);
}


CUDA_EMU_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the CUDA backend is not built into this libape")
#endif /* APE_HAVE_CUDA */
