/* SPDX-License-Identifier: MIT */
/*
 * The streaming executor against one-shot calls: every chunk size (1, 7, 64, 4096) on awkward
 * lengths, causal and not, grouped-query attention, skipping on and off, shifted positions, on
 * every backend (the reference, OpenCL, and CUDA, on the emulator where there is no GPU: it runs
 * kernels on the CPU, one fiber per GPU thread, so the cases that say so give it fewer launches
 * or shorter sequences); chunk-level skipping that really leaves chunks uncopied, and never
 * where it may not; the memory budget, counted by the executor and by a wrapper around the
 * backend; what a failure leaves in the outputs; the trace file; the statistics.
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

/* ---- helpers */

static double v_scale(const test_problem *tp)
{
	return fmax(test_tensor_maxabs(&tp->v.t), 1e-30);
}

static void poison(test_problem *tp)
{
	test_tensor_poison(&tp->o.t);
	for (size_t i = 0; tp->lse && i < tp->rows; i++)
		tp->lse[i] = NAN;
}

static int run_ex(test_problem *tp, ape_device *const *devs, int ndev, const ape_exec_options *o,
		  ape_stats *st)
{
	poison(tp);
	tp->q_start = tp->desc.q_start_set ? tp->desc.q_start
					   : tp->desc.k_start + tp->k.t.shape[2] - tp->q.t.shape[2];
	return ape_attention_forward_ex(devs, ndev, o, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t,
					&tp->o.t, tp->lse, st);
}

static ape_exec_options chunks(int64_t cq, int64_t ck)
{
	return test_chunks(cq, ck);
}

/* O error in units of max|V| and LSE error relative to max(1, |LSE|), a against b; NaN must
 * sit in the same places. */
static void errors(const test_problem *a, const test_problem *b, double *eo, double *el)
{
	const int64_t *s = a->q.t.shape;
	double mo = 0, ml = 0;

	for (int64_t x = 0; x < s[0]; x++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t i = 0; i < s[2]; i++)
				for (int64_t d = 0; d < s[3]; d++) {
					double p = test_tensor_get(&a->o.t, x, h, i, d);
					double q = test_tensor_get(&b->o.t, x, h, i, d);

					if (isnan(p) != isnan(q))
						mo = INFINITY;
					else if (!isnan(p))
						mo = fmax(mo, fabs(p - q));
				}
	for (size_t r = 0; a->lse && r < a->rows; r++) {
		double p = a->lse[r], q = b->lse[r];

		if (isnan(p) != isnan(q) || ((isinf(p) || isinf(q)) && p != q))
			ml = INFINITY;
		else if (isfinite(p))
			ml = fmax(ml, fabs(p - q) / fmax(1, fabs(q)));
	}
	*eo = mo / v_scale(a);
	*el = ml;
}

/* Streams tp on dev with options o and checks it against the reference's one-shot result in
 * `want`. Returns 0 or -1 after logging. */
static int check_stream(struct __test_metadata *_metadata, test_problem *tp,
			const test_problem *want, ape_device *dev, const ape_exec_options *o,
			const char *what, ape_stats *st)
{
	const ape_dtype dt = tp->q.t.dtype;
	double eo, el;
	char desc[512];

	test_problem_describe(tp, desc, sizeof(desc));
	ape_stats_init(st);
	if (run_ex(tp, &dev, 1, o, st)) {
		TH_LOG("%s: %s: chunks %lld x %lld: %s", what, desc, (long long)o->chunk_q,
		       (long long)o->chunk_k, ape_last_error());
		return -1;
	}
	errors(tp, want, &eo, &el);
	if (eo > test_tol_o(dt) || el > test_tol_lse(dt)) {
		TH_LOG("%s: %s: chunks %lld x %lld: O error %.3g (tolerance %g), LSE error %.3g",
		       what, desc, (long long)o->chunk_q, (long long)o->chunk_k, eo, test_tol_o(dt),
		       el);
		return -1;
	}
	return 0;
}

/* The reference's one-shot result of tp, in a clone. */
static int one_shot(test_problem *want, const test_problem *tp, ape_device *ref)
{
	if (test_problem_clone(want, tp))
		return -1;
	return test_problem_run(want, ref);
}

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

/* ---- failures */

/* A launch fails: finished query chunks are written, the others untouched, and the message
 * says how many; with APE_EXEC_ATOMIC_OUTPUTS nothing is written. */
TEST_F(dev, failure_leaves_finished_chunks_or_nothing)
{
	/* 4 x 4 chunks; the emulator: half the rows */
	const int64_t L = self->emu ? 128 : 256, c = L / 4;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	test_problem tp, want;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.skip_tol = 0; /* 1 + 2 + 3 + 4 launches */
	{
		ape_exec_options o = chunks(c, c);

		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, run_ex(&want, &self->dev, 1, &o, NULL)) TH_LOG("%s", ape_last_error());
	}
	wrap_install(self->dev, 0);
	for (int atomic_out = 0; atomic_out < 2; atomic_out++)
		for (uint64_t at = 1; at <= 10; at += 3) {
			ape_exec_options o = chunks(c, c);
			long long held = 0, of = 0;
			const char *m;
			int ret;

			o.flags = atomic_out ? APE_EXEC_ATOMIC_OUTPUTS : 0;
			wrap_fail_attention(at);
			ret = run_ex(&tp, &self->dev, 1, &o, NULL);
			wrap_fail_attention(0);
			EXPECT_EQ(APE_EDEVLOST, ret);
			m = strstr(ape_last_error(), "O and LSE hold ");
			EXPECT_NE(NULL, strstr(ape_last_error(), "fails on purpose"));
			if (m)
				EXPECT_EQ(2, sscanf(m, "O and LSE hold %lld of %lld", &held, &of));
			if (atomic_out || at == 1)
				EXPECT_EQ(NULL, m) TH_LOG("%s", ape_last_error());
			for (int64_t h = 0; h < 2; h++)
				for (int64_t i = 0; i < L; i++) {
					double got = test_tensor_get(&tp.o.t, 0, h, i, 0);
					bool written = i < held * c;

					EXPECT_EQ(written, !isnan(got))
						TH_LOG("launch %d fails: row %lld (%lld chunks held)",
						       (int)at, (long long)i, held);
					if (written)
						EXPECT_EQ(test_tensor_get(&want.o.t, 0, h, i, 0), got);
					if (!written || isnan(got))
						break;
				}
		}
	/* and with the flag, a successful call writes everything, the same bits */
	{
		ape_exec_options o = chunks(c, c);

		o.flags = APE_EXEC_ATOMIC_OUTPUTS;
		EXPECT_EQ(0, run_ex(&tp, &self->dev, 1, &o, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, memcmp(want.o.alloc, tp.o.alloc, tp.o.alloc_bytes));
		EXPECT_EQ(0, memcmp(want.lse, tp.lse, tp.rows * sizeof(float)));
	}
	test_problem_free(&tp);
	test_problem_free(&want);
}

/* ---- the trace */

static int python_check(const char *path, const char *script)
{
	char cmd[8192];

	if (access("/usr/bin/python3", X_OK))
		return -2;
	snprintf(cmd, sizeof(cmd), "/usr/bin/python3 -c '%s' %s", script, path);
	return system(cmd);
}

/* Valid JSON, Chrome's trace-event format: named processes and lanes, complete events with
 * microsecond times, copies and kernels of every chunk. */
static const char trace_script[] =
	"import json,sys\n"
	"d = json.load(open(sys.argv[1]))\n"
	"ev = d[\"traceEvents\"]\n"
	"x = [e for e in ev if e[\"ph\"] == \"X\"]\n"
	"names = set(e[\"name\"].split(\" \")[0] + \" \" + e[\"name\"].split(\" \")[1] for e in x)\n"
	"assert any(e[\"ph\"] == \"M\" and e[\"name\"] == \"process_name\" for e in ev)\n"
	"assert any(e[\"ph\"] == \"M\" and e[\"name\"] == \"thread_name\" for e in ev)\n"
	"assert all(e[\"ts\"] >= 0 and e[\"dur\"] >= 0 and \"pid\" in e and \"tid\" in e for e in x)\n"
	"k = [e for e in x if e[\"cat\"] == \"kernel\"]\n"
	"c = [e for e in x if e[\"cat\"] == \"copy\"]\n"
	"assert len(k) == int(sys.argv[2]), (len(k), sys.argv[2])\n"
	"assert any(e[\"name\"].startswith(\"h2d K/V\") for e in c)\n"
	"assert any(e[\"name\"].startswith(\"h2d Q\") for e in c)\n"
	"assert any(e[\"name\"].startswith(\"d2h O/LSE\") for e in c)\n"
	"print(\"trace:\", len(x), \"events;\", d[\"otherData\"][\"clock\"])\n";

TEST_F(dev, trace_is_chrome_trace_json)
{
	/* the emulator: 2 x 2 chunks */
	const int64_t L = self->emu ? 100 : 200;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	char dir[64], path[128], arg[160], first[256];
	test_problem tp;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	snprintf(dir, sizeof(dir), "/tmp/ape-test-trace.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/t.json", dir);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	for (int fallback = 0; fallback < 2; fallback++) {
		ape_exec_options o = chunks(64, 64);
		ape_stats st;
		int ret;

		o.flags = APE_EXEC_COPY_INPUTS; /* copies of every kind in the trace */
		if (fallback) /* no device timestamps: still a valid trace, on the host's clock */
			wrap_install(self->dev, WRAP_NO_TIMESTAMP);
		o.trace_path = path;
		ape_stats_init(&st);
		ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, &st)) TH_LOG("%s", ape_last_error());
		snprintf(arg, sizeof(arg), "%s %llu", path, (unsigned long long)st.chunks);
		ret = python_check(arg, trace_script);
		if (ret == -2)
			SKIP(break, "no /usr/bin/python3 to read the trace");
		EXPECT_EQ(0, ret) TH_LOG("the trace %s is not what Perfetto reads", path);
		/* written through a temporary file: nothing else is left next to it */
		EXPECT_EQ(1, test_count_entries(dir, first, sizeof(first)));
		EXPECT_STREQ("t.json", first);
		wrap_remove();
	}
	/* a directory that does not exist is refused before any work */
	{
		ape_exec_options o = chunks(64, 64);

		o.trace_path = "/nonexistent-dir/t.json";
		EXPECT_EQ(APE_EINVAL, run_ex(&tp, &self->dev, 1, &o, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "opts->trace_path"));
		EXPECT_TRUE(isnan(test_tensor_get(&tp.o.t, 0, 0, 0, 0)));
	}
	test_problem_free(&tp);
	test_rmtree(dir);
}

/*
 * A device whose kernels read host memory (the reference, OpenCL CPU devices) reads the inputs
 * where they lie at every chunking: nothing is copied to it and inputs count nothing against
 * the budget; APE_EXEC_COPY_INPUTS copies them as a discrete device needs. Both within the
 * tolerance of the reference, strided inputs included.
 */
TEST_F(dev, inputs_in_place_where_the_device_reads_host_memory)
{
	const int64_t L = self->emu ? 96 : 300;
	const test_problem_shape sh = { 2, 4, 2, L, L + 20, 16 };
	static float probe;
	ape_buffer *b = NULL;
	test_problem tp, want;
	bool host_memory;
	ape_rng rng;

	host_memory = ape_buffer_wrap_host(self->dev, &probe, sizeof(probe), &b) == 0;
	ape_buffer_free(b);
	ape_rng_init(&rng, _metadata->name);
	for (int layout = 0; layout < 2; layout++) {
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, layout == 1));
		test_problem_random_params(&tp, &rng);
		ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
		for (int copy = 0; copy < 2; copy++) {
			ape_exec_options o = chunks(64, 128);
			ape_stats st;

			o.flags = copy ? APE_EXEC_COPY_INPUTS : 0;
			ape_stats_init(&st);
			EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o,
						  copy ? "copied" : "in place", &st));
			if (host_memory && !copy) {
				EXPECT_EQ(0u, st.bytes_to_device);
			} else {
				EXPECT_GE(st.bytes_to_device,
					  (uint64_t)(sh.B * (sh.H * sh.Lq + 2 * sh.Hkv * sh.Lk) * sh.D *
						     4));
			}
			/* in place or not, the results come back once per query chunk or less */
			EXPECT_GT(st.bytes_from_device, 0u);
		}
		test_problem_free(&tp);
		test_problem_free(&want);
	}
}

/*
 * ape.h: a call whose queries fit one chunk writes its outputs only when it succeeds, on every
 * path (inputs read in place on devices that read host memory, copied on the others): a device
 * lost at any point, or any one op failing, leaves O and LSE as they were.
 */
TEST_F(dev, one_chunk_call_writes_nothing_when_it_fails)
{
	const test_problem_shape sh = { 1, 2, 1, 40, 60, 16 };
	test_problem tp;
	unsigned char *before;
	float lse_before[2 * 40];
	ape_rng rng;
	int failures = 0;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	ASSERT_NE(NULL, tp.lse);
	before = malloc(tp.o.alloc_bytes);
	ASSERT_NE(NULL, before);
	memset(tp.o.alloc, 0x5a, tp.o.alloc_bytes);
	memcpy(before, tp.o.alloc, tp.o.alloc_bytes);
	for (int i = 0; i < 2 * 40; i++)
		tp.lse[i] = lse_before[i] = (float)i;
	wrap_install(self->dev, 0);
	for (uint64_t k = 1; k < 64; k++) {
		int ret;

		wrap_lose_device(k);
		ret = ape_attention_forward(self->dev, &tp.desc, &tp.q.t, &tp.k.t, &tp.v.t, &tp.o.t,
					    tp.lse, NULL);
		wrap_lose_device(0);
		if (!ret)
			break; /* k is past the call's last op */
		failures++;
		EXPECT_EQ(0, memcmp(before, tp.o.alloc, tp.o.alloc_bytes))
			TH_LOG("device lost at op %llu: O was written (%s)", (unsigned long long)k,
			       ape_last_error());
		EXPECT_EQ(0, memcmp(lse_before, tp.lse, sizeof(lse_before)))
			TH_LOG("device lost at op %llu: LSE was written", (unsigned long long)k);
	}
	EXPECT_GT(failures, 2);
	/* ... and it does write them when nothing fails */
	EXPECT_NE(0, memcmp(before, tp.o.alloc, tp.o.alloc_bytes));
	free(before);
	test_problem_free(&tp);
}

/* ---- statistics */

TEST_F(dev, stats_count_chunks_and_bytes)
{
	const int64_t L = 100, H = 2, Hkv = 1, D = 16;
	const test_problem_shape sh = { 1, H, Hkv, L, L, D };
	ape_exec_options o = chunks(32, 32);
	test_problem tp;
	ape_stats st, *old;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.skip_tol = 0;
	o.flags = APE_EXEC_COPY_INPUTS; /* every input copied, as to a discrete device */
	ape_stats_init(&st);
	ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, &st)) TH_LOG("%s", ape_last_error());
	/* 4 x 4 chunks, causal and end-aligned: query chunk i sees key chunks 0..i */
	EXPECT_EQ(10u, st.chunks);
	EXPECT_EQ(0u, st.chunks_skipped);
	EXPECT_EQ(32, st.chunk_q);
	EXPECT_EQ(32, st.chunk_k);
	EXPECT_EQ(3, st.pipeline_depth);
	EXPECT_EQ(1, st.devices);
	/* every key chunk stays resident (no budget to speak of): each is copied once, and the
	 * parameter tables once (omega and four per head, in float64 and float32) */
	EXPECT_EQ((uint64_t)((H * L + 2 * Hkv * L) * D * 4 + (D / 2 + 4 * H) * 12),
		  st.bytes_to_device);
	/* per launch: O in float32, LSE, pair counts */
	EXPECT_GT(st.bytes_from_device, (uint64_t)(H * L * D * 4));
	EXPECT_GE(st.kernel_ms, 0.0);
	EXPECT_GE(st.copy_ms, 0.0);
	EXPECT_GE(st.overlap_ms, 0.0);
	/* up to rounding: the intervals sit at device clock values of 1e6 ms and more */
	EXPECT_LE(st.overlap_ms, st.copy_ms * (1 + 1e-6) + 1e-6);
	EXPECT_STREQ(variant->backend, st.backend);

	/* a caller built against libape 0.1 passes the old size and gets the old fields only */
	old = malloc(sizeof(*old));
	ASSERT_NE(NULL, old);
	memset(old, 0xab, sizeof(*old));
	old->struct_size = APE_STATS_V1_SIZE;
	ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, old)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(st.pairs_visible, old->pairs_visible);
	{
		size_t written = 0;

		for (size_t i = APE_STATS_V1_SIZE; i < sizeof(*old); i++)
			written += ((unsigned char *)old)[i] != 0xab;
		EXPECT_EQ(0u, written) TH_LOG("bytes past the old size were written");
	}
	free(old);
	test_problem_free(&tp);
}

/*
 * Whether a host call computes on the caller's arrays in place is the device's capability
 * host_memory (struct ape__dev_caps), stated at probe, not found by trying buf_wrap: with the
 * capability taken away and buf_wrap kept, the call stages and copies, and asks buf_wrap
 * nothing; a device without it is never asked either.
 */
TEST_F(dev, in_place_only_where_the_capability_says)
{
	const test_problem_shape sh = { 1, 2, 1, 24, 24, 16 };
	const bool capable = self->dev->caps.host_memory;
	test_problem tp, want;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	ASSERT_EQ(0, one_shot(&want, &tp, self->ref)) TH_LOG("%s", ape_last_error());
	for (int hide = 0; hide < 2; hide++) {
		const bool in_place = capable && !hide;
		struct wrap_counts c;
		ape_stats st;
		double eo, el;

		wrap_install(self->dev, hide ? WRAP_NO_HOST_MEMORY : 0);
		ape_stats_init(&st);
		EXPECT_EQ(0, run_ex(&tp, &self->dev, 1, NULL, &st)) TH_LOG("%s", ape_last_error());
		c = wrap_get();
		wrap_remove();
		errors(&tp, &want, &eo, &el);
		EXPECT_LE(eo, test_tol_o(APE_F32));
		EXPECT_LE(el, test_tol_lse(APE_F32));
		if (in_place) {
			EXPECT_EQ(0u, c.h2d_calls) TH_LOG("computed in place: nothing to copy in");
			EXPECT_LT(0u, c.calls[WRAP_BUF_WRAP]);
		} else {
			EXPECT_LT(0u, c.h2d_calls) TH_LOG("hide %d: not staged", hide);
			EXPECT_EQ(0u, c.calls[WRAP_BUF_WRAP]) TH_LOG("hide %d: buf_wrap was tried", hide);
		}
	}
	test_problem_free(&want);
	test_problem_free(&tp);
}

/* ---- arguments */

TEST_F(dev, options_are_validated)
{
	const test_problem_shape sh = { 1, 2, 1, 8, 8, 8 };
	static const double bad_weight[2] = { 1, 0 };
	test_problem tp;
	ape_rng rng;
	struct {
		const char *what;
		void (*change)(ape_exec_options *o);
	} cases[] = {
		{ "opts->struct_size", NULL }, { "opts->chunk_q = -1", NULL },
		{ "opts->chunk_k = -5", NULL }, { "opts->pipeline_depth = 4", NULL },
		{ "opts->flags = 0x7: unknown flags 0x4", NULL }, { "opts->device_weights[1] = 0", NULL },
		{ "opts->trace_path = \"\"", NULL },
	};
	ape_device *two[2] = { self->dev, NULL };

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		ape_exec_options o;

		ape_exec_options_init(&o);
		switch (c) {
		case 0: o.struct_size--; break;
		case 1: o.chunk_q = -1; break;
		case 2: o.chunk_k = -5; break;
		case 3: o.pipeline_depth = 4; break;
		case 4: o.flags = 0x7; break;
		case 5: o.device_weights = bad_weight; break;
		case 6: o.trace_path = ""; break;
		}
		two[1] = self->dev;
		EXPECT_EQ(APE_EINVAL, run_ex(&tp, two, c == 5 ? 2 : 1, &o, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_forward_ex: "));
		EXPECT_NE(NULL, strstr(ape_last_error(), cases[c].what))
			TH_LOG("\"%s\" does not name %s", ape_last_error(), cases[c].what);
		EXPECT_TRUE(isnan(test_tensor_get(&tp.o.t, 0, 0, 0, 0))) TH_LOG("O written");
	}
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, NULL, 1, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "devs = NULL"));
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, two, 0, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ndev = 0"));
	two[1] = NULL;
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, two, 2, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "devs[1] = NULL"));
	/* NULL options: the defaults */
	EXPECT_EQ(0, run_ex(&tp, &self->dev, 1, NULL, NULL)) TH_LOG("%s", ape_last_error());
	test_problem_free(&tp);
}

/* APE_MAX_DEVICES device entries are taken (here one device listed that often), one more is
 * refused before any work, naming ndev and the limit. */
TEST_F(dev, device_count_limit_is_ape_max_devices)
{
	const test_problem_shape sh = { 1, 2, 1, 40, 40, 8 };
	ape_device *devs[APE_MAX_DEVICES + 1];
	char want[64];
	ape_exec_options o = chunks(4, 40);
	test_problem tp;
	ape_stats st;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	for (int i = 0; i <= APE_MAX_DEVICES; i++)
		devs[i] = self->dev;
	snprintf(want, sizeof(want), "ndev = %d: must be 1..%d", APE_MAX_DEVICES + 1,
		 APE_MAX_DEVICES);
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, devs, APE_MAX_DEVICES + 1, &o, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), want)) TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(isnan(test_tensor_get(&tp.o.t, 0, 0, 0, 0))) TH_LOG("O written");
	ape_stats_init(&st);
	ASSERT_EQ(0, run_ex(&tp, devs, APE_MAX_DEVICES, &o, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_MAX_DEVICES, st.devices);
	EXPECT_EQ(10u, st.chunks) TH_LOG("10 query chunks of 4 rows, one key chunk each");
	test_problem_free(&tp);
}

TEST_HARNESS_MAIN
