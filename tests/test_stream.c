/* SPDX-License-Identifier: MIT */
/*
 * The streaming executor against one-shot calls: every chunk size (1, 7, 64, 4096) on awkward
 * lengths, causal and not, grouped-query attention, skipping on and off, shifted positions, on
 * every backend (the reference, OpenCL, and CUDA, on the emulator where there is no GPU: it runs
 * kernels on the CPU, one fiber per GPU thread, so the cases that say so give it fewer launches
 * or shorter sequences); chunk-level skipping that really leaves chunks uncopied, and never
 * where it may not; the memory budget, counted by the executor and by a wrapper around the
 * backend (what a failure leaves in the outputs, the trace file, inputs in place, the statistics
 * and the arguments: test_stream_calls.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"
#include "common/refcheck.h"
#include "common/wrapops.h"
#include "core/context.h"
#include "stream_case.h"

/* ---- the devices each test runs on */

BACKEND_FIXTURE(dev)

/* ---- streaming equals one-shot */

/* A random case small enough for chunk size c: at most ~`launches` launches. */
static int random_case(test_problem *tp, ape_rng *rng, int64_t c, int64_t launches)
{

	for (;;) {
		if (test_problem_random(tp, rng, 0))
			return -1;
		if (tp->q.t.shape[2] * tp->k.t.shape[2] <= launches * c * c &&
		    tp->q.t.shape[0] * tp->q.t.shape[1] <= (c == 1 ? 4 : 12))
			return 0;
		test_problem_free(tp);
	}
}

TEST_F(dev, every_chunk_size_matches_one_shot)
{
	static const int64_t sizes[] = { 1, 7, 64, 4096 };
	const int ncases = ape_test_slow() ? 2 : self->emu ? 4 : 12;
	const int64_t launches = ape_test_slow() ? 20 : self->emu ? 40 : 300;
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, _metadata->name);
	for (int si = 0; si < 4; si++)
		for (int c = 0; c < ncases; c++) {
			const int64_t cs = sizes[si];
			/* both directions, or one of them chunked */
			const ape_exec_options o = c % 3 == 0 ? chunks(cs, 4096)
						   : c % 3 == 1 ? chunks(4096, cs)
								: chunks(cs, cs);
			test_problem tp, want;
			ape_stats st;

			ASSERT_EQ(0, random_case(&tp, &rng, cs, launches));
			if (c % 4 == 3)
				tp.desc.skip_tol = 0;
			ASSERT_EQ(0, one_shot(&want, &tp, self->ref)) TH_LOG("%s", ape_last_error());
			ape_stats_init(&st);
			failed += check_stream(_metadata, &tp, &want, self->dev, &o, "random", &st);
			if (tp.desc.skip_tol == 0 || !tp.rows)
				EXPECT_EQ(0, st.chunks_skipped);
			EXPECT_LE(st.pairs_computed, st.pairs_visible);
			test_problem_free(&tp);
			test_problem_free(&want);
		}
	EXPECT_EQ(0, failed);
}

/* Lengths 1, 7, 63 and 4097 with chunks that do not divide them, causal and not, GQA. */
TEST_F(dev, awkward_lengths)
{
	static const int64_t lens[] = { 1, 7, 63, 4097 };
	static const int64_t sizes[] = { 1, 7, 64, 4096 };
	const bool ref = !strcmp(variant->backend, "ref");
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, _metadata->name);
	for (int li = 0; li < 4; li++)
		for (int si = 0; si < 4; si++)
			for (int causal = 0; causal < 2; causal++) {
				const int64_t L = lens[li], cs = sizes[si];
				/* 4097 keys: a few query rows, and no one-row chunks (4097^2
				 * launches); the emulator: 2 heads on 1, and one row for 63 keys in
				 * one-row chunks (each launch costs it about 10 ms) */
				const bool few = ref || self->emu || ape_test_slow();
				const int64_t Lq = L > 1000 ? (few ? 5 : 300)
							    : self->emu && cs == 1 && L > 7 ? 1 : L;
				const int64_t Hkv = self->emu ? 1 : 2;
				const test_problem_shape sh = { 1, 2 * Hkv, Hkv, Lq, L, 32 };
				ape_exec_options o = chunks(cs, cs);
				test_problem tp, want;
				ape_stats st;

				if ((L > 1000 && cs < 64) || (ape_test_slow() && L > 100 && cs < 4096))
					continue;
				ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, li == 2));
				test_problem_random_params(&tp, &rng);
				tp.desc.causal = causal;
				tp.desc.q_start_set = false;
				ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
				failed += check_stream(_metadata, &tp, &want, self->dev, &o, "awkward",
						       &st);
				if (tp.strided)
					EXPECT_EQ(0, test_problem_padding_intact(&tp));
				test_problem_free(&tp);
				test_problem_free(&want);
			}
	EXPECT_EQ(0, failed);
}

/* Every storage type, both output types, both layouts, far positions. */
TEST_F(dev, types_layouts_positions)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, _metadata->name);
	for (int t = 0; t < 3; t++)
		for (int v = 0; v < 4; v++) {
			/* the emulator: half the lengths */
			const int64_t n = self->emu ? 2 : 1;
			const test_problem_shape sh = { 2, 2, 1, 40 / n, 70 / n, 16 };
			ape_exec_options o = chunks(16, 9);
			test_problem tp, want;
			ape_stats st;

			ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[t], v & 1));
			test_problem_random_params(&tp, &rng);
			tp.desc.layout = v & 2 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
			if (v == 3)
				ASSERT_EQ(0, test_problem_set_out_dtype(&tp, APE_F32));
			if (v == 2) { /* far from the origin, queries before and after the keys */
				tp.desc.k_start += (int64_t)1 << 40;
				tp.desc.q_start = tp.desc.k_start + ape_rng_range(&rng, -60, 90);
				tp.desc.q_start_set = true;
			}
			ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
			failed += check_stream(_metadata, &tp, &want, self->dev, &o, "types", &st);
			test_problem_free(&tp);
			test_problem_free(&want);
		}
	EXPECT_EQ(0, failed);
}

/*
 * Rows whose every key is far away under a real decay: the bias of the nearest key enters the
 * LSE (about -0.3 |n| here), and the chunks' float32 LSEs then weigh the chunks with a relative
 * error of up to about 2^-24 |LSE| (docs/ape.md, "Storage and accuracy"). A streamed call stays
 * within the table's tolerance plus test_merge_tol_o() of the one-shot reference at |LSE| up to
 * 3e5 (distances 10^3 to 10^6): queries after the keys with lambda 0, before them with 0.2.
 */
TEST_F(dev, merged_chunks_of_rows_far_from_every_key)
{
	static const int64_t gaps[] = { 1000, 30000, 1000000 };
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, _metadata->name);
	for (int g = 0; g < 3; g++)
		for (int v = 0; v < 2; v++) {
			const ape_exec_options o = chunks(5, 9);
			test_problem tp, want;
			double eo, el, lmax = 0;
			ape_stats st;

			ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 1, 7, self->emu ? 20 : 40,
							   16, APE_F32));
			test_problem_set_params(&tp, 0.3, 0.05, 0.05, v ? 0.2 : 0);
			tp.desc.causal = false;
			tp.desc.k_start = ape_rng_range(&rng, 0, 1 << 20);
			tp.desc.q_start = tp.desc.k_start + (v ? -gaps[g] : gaps[g] + 40);
			tp.desc.q_start_set = true;
			ASSERT_EQ(0, one_shot(&want, &tp, self->ref)) TH_LOG("%s", ape_last_error());
			for (size_t r = 0; r < want.rows; r++)
				lmax = fmax(lmax, fabs(want.lse[r]));
			ape_stats_init(&st);
			ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, &st)) TH_LOG("%s", ape_last_error());
			EXPECT_GT(st.chunks, 4); /* merged: several key chunks per row */
			errors(&tp, &want, &eo, &el);
			TH_LOG("gap %lld, lambda %s: |LSE| up to %.3g, O error %.3g M (%.3g of "
			       "2^-24 |LSE| M), LSE error %.3g", (long long)gaps[g], v ? "0.2" : "0",
			       lmax, eo, eo / (0x1p-24 * lmax), el);
			EXPECT_GT(lmax, 0.25 * (double)gaps[g]); /* the case is what it says */
			if (eo > test_tol_o(APE_F32) + test_merge_tol_o(lmax) ||
			    el > test_tol_lse(APE_F32)) {
				TH_LOG("  over the tolerance %.3g", test_tol_o(APE_F32) +
									  test_merge_tol_o(lmax));
				failed++;
			}
			test_problem_free(&tp);
			test_problem_free(&want);
		}
	EXPECT_EQ(0, failed);
}

/* The same chunks whatever the depth: copies and kernels back to back, or overlapped. */
TEST_F(dev, pipeline_depths_agree_bit_for_bit)
{
	/* the emulator: 3 x 3 chunks */
	const int64_t L = self->emu ? 96 : 150;
	const test_problem_shape sh = { 1, 2, 2, L, L, 32 };
	test_problem tp, first;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	tp.desc.skip_tol = 0; /* what is skipped may depend on timing; what is computed not */
	for (int depth = 1; depth <= 3; depth++) {
		ape_exec_options o = chunks(32, 32);
		ape_stats st;

		o.pipeline_depth = depth;
		ape_stats_init(&st);
		ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, &st)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(depth, st.pipeline_depth);
		if (depth == 1) {
			ASSERT_EQ(0, test_problem_clone(&first, &tp));
			memcpy(first.lse, tp.lse, tp.rows * sizeof(float)); /* clones copy inputs */
			continue;
		}
		EXPECT_EQ(0, memcmp(first.o.alloc, tp.o.alloc, tp.o.alloc_bytes))
			TH_LOG("depth %d differs from depth 1", depth);
		EXPECT_EQ(0, memcmp(first.lse, tp.lse, tp.rows * sizeof(float)));
	}
	test_problem_free(&first);
	test_problem_free(&tp);
}

/* ---- chunk-level skipping */

static void strong_decay(test_problem *tp)
{
	test_problem_set_params(tp, 0.5, 0.05, 0.05, 0.1);
}

/*
 * Queries at the end of a long sequence (as in chunked prefill): with a real decay only the key
 * chunks near them are ever copied. Never with skip_tol = 0 or any negative decay.
 */
TEST_F(dev, skipping_avoids_copies_and_only_when_allowed)
{
	/* also under valgrind: smaller, the ratios below do not hold; the emulator: half the keys
	 * in 16 chunks still, 8 queries */
	const int64_t L = self->emu ? 512 : 1024, c = L / 16;
	const test_problem_shape sh = { 1, 2, 1, self->emu ? 8 : 100, L, 16 };
	ape_exec_options o = chunks(c, c);
	test_problem tp, want;
	ape_stats on, off, neg;
	ape_rng rng;

	o.flags = APE_EXEC_COPY_INPUTS; /* what is copied is what this counts */
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.q_start_set = false; /* end-aligned */
	for (int causal = 1; causal >= 0; causal--) {
		tp.desc.causal = causal;
		tp.desc.skip_tol = 0x1p-24;
		strong_decay(&tp);
		ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
		EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o, "skip on", &on));
		/* skip_tol = 0: everything visible is copied and computed */
		tp.desc.skip_tol = 0;
		EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o, "skip off", &off));
		EXPECT_EQ(0, off.chunks_skipped);
		EXPECT_EQ(off.pairs_visible, off.pairs_computed);
		EXPECT_GT(on.chunks_skipped, 0);
		EXPECT_LT(on.chunks * 3, off.chunks);
		EXPECT_LT(on.bytes_to_device * 3, off.bytes_to_device)
			TH_LOG("skipping copied %llu bytes, not skipping %llu",
			       (unsigned long long)on.bytes_to_device,
			       (unsigned long long)off.bytes_to_device);
		EXPECT_LT(on.pairs_computed * 3, off.pairs_computed);
		/* one negative decay in one head: nothing may be skipped at all */
		tp.desc.skip_tol = 0x1p-24;
		for (int which = 0; which < 3; which++) {
			strong_decay(&tp);
			tp.params[which * 2 + 1] = -0.001f;
			tp.desc.delta.per_head = tp.params;
			tp.desc.beta.per_head = tp.params + 2;
			tp.desc.gamma.per_head = tp.params + 4;
			tp.desc.lambda.per_head = tp.params + 6;
			test_problem_free(&want);
			ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
			EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o, "negative",
						  &neg));
			EXPECT_EQ(0, neg.chunks_skipped);
			EXPECT_EQ(off.bytes_to_device, neg.bytes_to_device);
			EXPECT_EQ(neg.pairs_visible, neg.pairs_computed);
		}
		tp.desc.delta.per_head = tp.desc.beta.per_head = NULL;
		tp.desc.gamma.per_head = tp.desc.lambda.per_head = NULL;
		test_problem_free(&want);
	}
	test_problem_free(&tp);
}

/*
 * A key chunk next to the diagonal is computed in a launch of its own, which takes the query
 * chunk's merged LSE so far as weight already found (lse_prior, kept on the device by
 * attention_merge): rows far from the chunk then compute none of it, and a chunked call
 * computes about as few pairs as a one-shot one. Without attention_merge (the wrapper hides
 * it; partial results then merge on the host) there is no prior: each row scores at least the
 * tile nearest to it in every launch, still exact.
 */
TEST(neighbour_chunks_start_from_the_diagonal_weight)
{
	ape_context *ctx = test_context("ref,opencl");
	ape_device *ref = ctx ? test_device(ctx, "ref") : NULL;
	ape_device *dev = ctx ? test_device(ctx, "opencl") : NULL;

	/* chunks of 256: most rows of a query chunk lie well beyond the reach of the seed's decay
	 * into the key chunk behind it (with chunks of one 64-key tile, none would) */
	const int64_t c = 256, L = ape_test_slow() ? 4 * c : 8 * c;
	const test_problem_shape sh = { 1, 2, 1, L, L, 32 };
	const ape_exec_options one = chunks(L, L), o = chunks(c, c);
	test_problem tp, want;
	ape_stats st1, with, without;
	ape_rng rng;

	ASSERT_NE(NULL, ref);
	if (!dev) { /* the reference never skips: this is about the kernels */
		ape_context_destroy(ctx);
		SKIP(return, "no OpenCL device");
	}
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.skip_tol = 0x1p-24;
	test_problem_set_params(&tp, 0.39685, 0.039685, 0.039685, 0.1); /* the seed's */
	ASSERT_EQ(0, one_shot(&want, &tp, ref));
	EXPECT_EQ(0, check_stream(_metadata, &tp, &want, dev, &one, "one shot", &st1));
	EXPECT_EQ(0, check_stream(_metadata, &tp, &want, dev, &o, "prior", &with));
	wrap_install(dev, WRAP_NO_MERGE);
	EXPECT_EQ(0, check_stream(_metadata, &tp, &want, dev, &o, "no prior", &without));
	wrap_remove();
	/* the chunked call visits L / c diagonal launches and the ones next to them, each of which
	 * would cost every row a tile without the prior */
	EXPECT_GT(with.chunks, (uint64_t)(L / c));
	EXPECT_LE(with.pairs_computed, st1.pairs_computed + st1.pairs_computed / 5)
		TH_LOG("pairs computed: one shot %llu, chunked %llu",
		       (unsigned long long)st1.pairs_computed,
		       (unsigned long long)with.pairs_computed);
	EXPECT_LT(with.pairs_computed + (uint64_t)(L / 2) * 2 * 32, without.pairs_computed)
		TH_LOG("pairs computed: with the prior %llu, without %llu",
		       (unsigned long long)with.pairs_computed,
		       (unsigned long long)without.pairs_computed);
	test_problem_free(&tp);
	test_problem_free(&want);
	ape_context_destroy(ctx);
}

/* Square problems under a budget that keeps only a few key chunks on the device: without
 * skipping, key chunks are copied again for every query chunk; with it, about once. */
TEST_F(dev, skipping_saves_recopies_under_a_budget)
{
	/* also under valgrind: smaller, every chunk stays resident; the emulator: 3/8 of the rows
	 * in 16 chunks still, the budget in proportion */
	const int64_t L = self->emu ? 384 : 1024, c = L / 16;
	const test_problem_shape sh = { 1, 1, 1, L, L, 16 };
	ape_exec_options o = chunks(c, c);
	test_problem tp, want;
	ape_stats on, off;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	strong_decay(&tp);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	o.max_device_bytes = (uint64_t)c << 10;
	o.flags = APE_EXEC_COPY_INPUTS; /* what is copied is what this counts */
	ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
	EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o, "skip on", &on));
	tp.desc.skip_tol = 0;
	EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o, "skip off", &off));
	EXPECT_LE(on.peak_device_bytes, o.max_device_bytes);
	EXPECT_LE(off.peak_device_bytes, o.max_device_bytes);
	EXPECT_LT(on.bytes_to_device * 3, off.bytes_to_device)
		TH_LOG("skipping copied %llu bytes, not skipping %llu",
		       (unsigned long long)on.bytes_to_device,
		       (unsigned long long)off.bytes_to_device);
	test_problem_free(&tp);
	test_problem_free(&want);
}

/* A NaN or Inf key is never skipped, however far: its rows are NaN, as without chunks. */
TEST_F(dev, nan_keys_are_never_skipped)
{
	const int64_t L = ape_test_slow() || self->emu ? 300 : 600;
	const test_problem_shape sh = { 1, 1, 1, L, L, 16 };
	ape_exec_options o = chunks(64, 64);
	test_problem tp, want;
	ape_stats st;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 2; c++) {
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
		strong_decay(&tp);
		tp.desc.causal = true;
		test_tensor_set(&tp.k.t, 0, 0, 3, 2, c ? INFINITY : NAN);
		ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
		EXPECT_TRUE(isnan(want.lse[L - 1])) TH_LOG("the reference sees it from row 3 on");
		ape_stats_init(&st);
		EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o, "nan", &st));
		test_problem_free(&tp);
		test_problem_free(&want);
	}
}

/* ---- the memory budget */

TEST_F(dev, budget_is_respected_and_counted)
{
	const bool ref = !strcmp(variant->backend, "ref");
	static const uint64_t budgets[] = { 48 << 10, 160 << 10, 1 << 20 };
	/* the emulator: 32 queries, 750 keys (each run computes at most 48000 pairs) */
	const test_problem_shape sh = { 1, 2, 2, self->emu ? 32 : ape_test_slow() ? 300 : 1500,
					self->emu ? 750 : 1500, 32 };
	test_problem tp, want;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
	wrap_install(self->dev, 0);
	for (size_t i = 0; i < sizeof(budgets) / sizeof(budgets[0]); i++) {
		ape_exec_options o = chunks(0, 0);
		struct wrap_counts wc;
		ape_stats st;

		o.max_device_bytes = budgets[i];
		o.flags = APE_EXEC_COPY_INPUTS; /* every chunk buffer counted, as on a GPU */
		wrap_reset();
		ape_stats_init(&st);
		EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o, "budget", &st));
		wc = wrap_get();
		EXPECT_EQ(budgets[i], st.device_budget);
		EXPECT_LE(st.peak_device_bytes, budgets[i]);
		EXPECT_GT(st.peak_device_bytes, 0);
		EXPECT_LE(wc.peak_bytes, budgets[i]) TH_LOG("the backend saw more than the budget");
		EXPECT_EQ(wc.allocs, wc.frees);
		if (ref) /* no backend scratch: the executor's count is the backend's */
			EXPECT_EQ(wc.peak_bytes, st.peak_device_bytes);
		EXPECT_LT(st.chunk_q, 1500);
		ksft_print_msg("budget %llu: chunks %lld x %lld, depth %d, peak %llu\n",
			       (unsigned long long)budgets[i], (long long)st.chunk_q,
			       (long long)st.chunk_k, st.pipeline_depth,
			       (unsigned long long)st.peak_device_bytes);
		fflush(stdout); /* the harness ends each test with _exit() */
	}
	/* too small for even one row each way: a clear ENOMEM, outputs untouched */
	{
		ape_exec_options o = chunks(0, 0);
		unsigned char *before = malloc(tp.o.alloc_bytes);

		ASSERT_NE(NULL, before);
		o.max_device_bytes = 1000;
		o.flags = APE_EXEC_COPY_INPUTS; /* inputs read in place would not count */
		memcpy(before, tp.o.alloc, tp.o.alloc_bytes);
		EXPECT_EQ(APE_ENOMEM, ape_attention_forward_ex(&self->dev, 1, &o, &tp.desc, &tp.q.t,
							       &tp.k.t, &tp.v.t, &tp.o.t, tp.lse,
							       NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(),
				       "budget 1000 bytes cannot hold one chunk of 1 query row and "
				       "1 key row"))
			TH_LOG("%s", ape_last_error());
		EXPECT_NE(NULL, strstr(ape_last_error(), "that needs"));
		EXPECT_EQ(0, memcmp(before, tp.o.alloc, tp.o.alloc_bytes));
		free(before);
	}
	test_problem_free(&tp);
	test_problem_free(&want);
}

/* A long sequence under a small budget, skipping on: sampled rows against the reference. */
TEST_F(dev, long_sequence_small_budget)
{
	const bool ref = !strcmp(variant->backend, "ref");
	/* the emulator: the last 8 queries of 16384 tokens, far enough to skip key chunks */
	const int64_t L = ref || ape_test_slow() ? 3000 : self->emu ? 16384 : 65536;
	const test_problem_shape sh = { 1, 1, 1, ref || self->emu ? 8 : L, L, 64 };
	ape_exec_options o = chunks(2048, 2048);
	struct refcheck_result rc;
	test_problem tp;
	ape_stats st;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_set_params(&tp, 0.3968502629920499, 0.03968502629920499,
				0.03968502629920499, 0.1); /* the seed's */
	tp.desc.causal = true;
	o.max_device_bytes = 4 << 20;
	ape_stats_init(&st);
	ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_LE(st.peak_device_bytes, o.max_device_bytes);
	if (!ref)
		EXPECT_GT(st.chunks_skipped, 0);
	ksft_print_msg("L=%lld: %llu chunks, %llu skipped, %llu bytes copied in, peak %llu\n",
		       (long long)L, (unsigned long long)st.chunks,
		       (unsigned long long)st.chunks_skipped,
		       (unsigned long long)st.bytes_to_device,
		       (unsigned long long)st.peak_device_bytes);
	fflush(stdout);
	ASSERT_EQ(0, refcheck_sampled(self->ref, &tp.desc, &tp.q.t, &tp.k.t, &tp.v.t, &tp.o.t,
				      tp.lse, 6, &rng, &rc))
		TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(rc.within_tol) TH_LOG("O error %.3g, LSE error %.3g", rc.max_err_o,
					  rc.max_err_lse);
	test_problem_free(&tp);
}

TEST_HARNESS_MAIN
