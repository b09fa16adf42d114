/* SPDX-License-Identifier: MIT */
/*
 * The KV cache: decoding token by token and chunked prefill equal a full recomputation; the
 * hot path (append within capacity, attend) allocates no device memory and no staging; blocks
 * are released only when allowed and provable, and an attend that would void the proof is
 * refused; a full cache says so; the gather works without the backend's copy_d2d too; decode
 * attends read the blocks in place where the backend can (attention_pages), equal to the
 * reference, touching nothing outside the live keys, and copying no key.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"
#include "common/wrapops.h"
#include "api/kvcache.h"
#include "core/context.h"

BACKEND_FIXTURE(kv)

/* ---- helpers */

static ape_kv_cache_options cache_options(const test_problem *tp, int64_t block, int64_t cap)
{
	ape_kv_cache_options o;

	ape_kv_cache_options_init(&o);
	o.B = tp->q.t.shape[0];
	o.H = tp->q.t.shape[1];
	o.Hkv = tp->k.t.shape[1];
	o.D = tp->q.t.shape[3];
	o.dtype = tp->q.t.dtype;
	o.block_tokens = block;
	o.capacity_tokens = cap;
	o.k_start = tp->desc.k_start;
	return o;
}

/*
 * Decodes tp (causal, Lq = Lk, end-aligned) through a cache: `step` query rows at a time, each
 * step appending the keys up to its last query first; every step's rows go into tp's O and
 * LSE. Returns 0 or the failing call's code.
 */
static int decode(test_problem *tp, ape_kv_cache *c, int64_t step, ape_stats *total)
{
	const int64_t L = tp->q.t.shape[2];
	test_tensor ob;
	float *lse;
	int ret = 0;

	lse = malloc(sizeof(float) * (size_t)(tp->q.t.shape[0] * tp->q.t.shape[1] * step) + 4);
	if (!lse || test_tensor_empty(&ob, tp->o.t.dtype, tp->q.t.shape[0], tp->q.t.shape[1], step,
				      tp->q.t.shape[3])) {
		free(lse);
		return APE_ENOMEM;
	}
	for (int64_t i = 0; i < L && !ret; i += step) {
		const int64_t n = i + step <= L ? step : L - i;
		ape_tensor kt = test_rows(&tp->k.t, i, n), vt = test_rows(&tp->v.t, i, n);
		ape_tensor qt = test_rows(&tp->q.t, i, n), ot = test_rows(&tp->o.t, i, n);
		ape_stats st;

		ape_stats_init(&st);
		ret = ape_kv_cache_append(c, &kt, &vt);
		if (!ret)
			ret = ape_kv_cache_attend(c, &tp->desc, &qt, &ot, lse, total ? &st : NULL);
		for (int64_t bh = 0; !ret && bh < tp->q.t.shape[0] * tp->q.t.shape[1]; bh++)
			memcpy(tp->lse + bh * L + i, lse + bh * n, (size_t)n * sizeof(float));
		if (!ret && total) {
			total->chunks += st.chunks;
			total->chunks_skipped += st.chunks_skipped;
			total->pairs_visible += st.pairs_visible;
			total->pairs_computed += st.pairs_computed;
		}
	}
	test_tensor_free(&ob);
	free(lse);
	return ret;
}

/* O error / max|V| and LSE error of tp against want (which skips nothing), within the spec's
 * tolerance and what tp's skipping may add? */
static int close_enough(struct __test_metadata *_metadata, const test_problem *tp,
			const test_problem *want, const char *what)
{
	const ape_dtype dt = tp->q.t.dtype;
	const double s = tp->desc.skip_tol;
	const double to = test_tol_o(dt) + test_skip_tol_o(s);
	const double tl = test_tol_lse(dt) + test_skip_tol_lse(s);
	double eo = test_max_err_o(&tp->o.t, &want->o.t) /
		    fmax(test_tensor_maxabs(&tp->v.t), 1e-30);
	double el = test_max_rel_err_lse(tp->lse, want->lse, tp->rows);

	if (eo <= to && el <= tl)
		return 0;
	TH_LOG("%s: O error %.3g (tolerance %g), LSE error %.3g (tolerance %g)", what, eo, to,
	       el, tl);
	return -1;
}

/* ---- decoding equals recomputation */

TEST_F(kv, decode_step_by_step_equals_full_recomputation)
{
	static const int64_t steps[] = { 1, 3, 16 };
	/* the emulated CUDA device runs kernels on the CPU: 40 tokens */
	const int64_t L = ape_test_slow() ? 24 : self->emu ? 40 : 90;
	ape_rng rng;

	/* under valgrind every OpenCL launch is slow: one step size, one case */
	const bool few = ape_test_slow() && strcmp(variant->backend, "ref");

	ape_rng_init(&rng, _metadata->name);
	for (int s = few ? 2 : 0; s < 3; s++)
		for (int c = 0; c < (few ? 1 : 2); c++) {
			const test_problem_shape sh = { 1 + c, 4, 2, L, L, c ? 64 : 16 };
			ape_kv_cache_options o;
			test_problem tp, want;
			ape_kv_cache *cache;
			ape_stats total;

			ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, c ? APE_F16 : APE_F32, c));
			test_problem_random_params(&tp, &rng);
			tp.desc.causal = true;
			tp.desc.q_start_set = false;
			ASSERT_EQ(0, test_problem_clone(&want, &tp));
			ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());
			o = cache_options(&tp, 7, L); /* blocks of 7: every gather is ragged */
			o.attend_chunk = 20; /* several key chunks per attend, merged by LSE */
			o.max_queries = 16;
			o.append_chunk = 5;
			ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache))
				TH_LOG("%s", ape_last_error());
			test_tensor_poison(&tp.o.t);
			memset(&total, 0, sizeof(total));
			ASSERT_EQ(0, decode(&tp, cache, steps[s], &total)) TH_LOG("%s", ape_last_error());
			EXPECT_EQ(0, close_enough(_metadata, &tp, &want, "decode"))
				TH_LOG("step %lld, case %d", (long long)steps[s], c);
			EXPECT_EQ(want.rows ? 0 : 1, test_problem_padding_intact(&tp) != 0 && c);
			EXPECT_GE(total.pairs_visible, total.pairs_computed);
			ape_kv_cache_destroy(cache);
			test_problem_free(&tp);
			test_problem_free(&want);
		}
}

/* A long prompt appended in pieces, attended in chunks of max_queries, then decoded. */
TEST_F(kv, chunked_prefill_then_decode)
{
	const int64_t P = ape_test_slow() ? 40 : 150, L = P + 10;
	const test_problem_shape sh = { 1, 2, 1, L, L, 32 };
	ape_kv_cache_options o;
	test_problem tp, want;
	ape_kv_cache *cache;
	ape_kv_cache_info info;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.k_start = 1000;
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());
	o = cache_options(&tp, 32, L);
	o.max_queries = 64;
	o.attend_chunk = 48;
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
	test_tensor_poison(&tp.o.t);
	/* prefill: append everything, then attend the prompt with explicit positions */
	{
		ape_tensor kt = test_rows(&tp.k.t, 0, P), vt = test_rows(&tp.v.t, 0, P);
		float *lse = malloc(sizeof(float) * 2 * 64);

		ASSERT_NE(NULL, lse);
		ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt)) TH_LOG("%s", ape_last_error());
		for (int64_t i = 0; i < P; i += 64) {
			const int64_t n = i + 64 <= P ? 64 : P - i;
			ape_tensor qt = test_rows(&tp.q.t, i, n), ot = test_rows(&tp.o.t, i, n);
			ape_attn_desc d = tp.desc;

			d.q_start_set = true;
			d.q_start = tp.desc.k_start + i;
			ASSERT_EQ(0, ape_kv_cache_attend(cache, &d, &qt, &ot, lse, NULL))
				TH_LOG("%s", ape_last_error());
			for (int64_t h = 0; h < 2; h++)
				memcpy(tp.lse + h * L + i, lse + h * n, (size_t)n * sizeof(float));
		}
		free(lse);
	}
	ASSERT_EQ(0, ape_kv_cache_get_info(cache, &info));
	EXPECT_EQ(P, info.tokens);
	EXPECT_EQ(1000, info.first_live_position);
	EXPECT_EQ(1000 + P, info.next_position);
	/* then token by token */
	for (int64_t i = P; i < L; i++) {
		ape_tensor kt = test_rows(&tp.k.t, i, 1), vt = test_rows(&tp.v.t, i, 1);
		ape_tensor qt = test_rows(&tp.q.t, i, 1), ot = test_rows(&tp.o.t, i, 1);
		float lse[2];

		ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt));
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &ot, lse, NULL))
			TH_LOG("%s", ape_last_error());
		tp.lse[i] = lse[0];
		tp.lse[L + i] = lse[1];
	}
	EXPECT_EQ(0, close_enough(_metadata, &tp, &want, "prefill + decode"));
	ape_kv_cache_destroy(cache);
	test_problem_free(&tp);
	test_problem_free(&want);
}

/* The gather through host staging, for backends without copy_d2d, gives the same bits. */
TEST_F(kv, gather_without_copy_d2d)
{
	const int64_t L = 40;
	const test_problem_shape sh = { 1, 2, 2, L, L, 16 };
	test_problem a, b;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&a, &rng, &sh, APE_F32, false));
	test_problem_random_params(&a, &rng);
	a.desc.causal = true;
	a.desc.q_start_set = false;
	a.desc.skip_tol = 0; /* every key is gathered: the byte counts below are exact */
	ASSERT_EQ(0, test_problem_clone(&b, &a));
	for (int pass = 0; pass < 2; pass++) {
		test_problem *tp = pass ? &b : &a;
		ape_kv_cache_options o = cache_options(tp, 6, L);
		ape_kv_cache *cache;
		ape_stats st;

		if (pass)
			wrap_install(self->dev, WRAP_NO_COPY_D2D);
		o.attend_chunk = 16;
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, decode(tp, cache, 4, NULL)) TH_LOG("%s", ape_last_error());
		/* the statistics say which way the keys went */
		{
			ape_tensor qt = test_rows(&tp->q.t, L - 1, 1), ot = test_rows(&tp->o.t, L - 1, 1);

			ape_stats_init(&st);
			ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp->desc, &qt, &ot, NULL, &st));
			if (pass || !self->dev->be->ops->copy_d2d) {
				EXPECT_EQ(0u, st.bytes_device_to_device);
				EXPECT_GT(st.bytes_to_device, (uint64_t)(2 * 2 * L * 16 * 4));
			} else {
				EXPECT_EQ((uint64_t)(2 * 2 * L * 16 * 4), st.bytes_device_to_device);
			}
		}
		ape_kv_cache_destroy(cache);
		wrap_remove();
	}
	EXPECT_EQ(0, memcmp(a.o.alloc, b.o.alloc, a.o.alloc_bytes));
	EXPECT_EQ(0, memcmp(a.lse, b.lse, a.rows * sizeof(float)));
	test_problem_free(&a);
	test_problem_free(&b);
}

/* ---- the hot path allocates nothing */

TEST_F(kv, no_allocation_on_the_hot_path)
{
	const int64_t L = 64;
	const test_problem_shape sh = { 1, 4, 2, L, L, 16 };
	ape_kv_cache_options o;
	ape_kv_cache_info info;
	struct wrap_counts wc;
	ape_kv_cache *cache;
	uint64_t staged;
	test_problem tp;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_set_params(&tp, 0.2, 0.02, 0.02, 0.1);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	wrap_install(self->dev, 0);
	o = cache_options(&tp, 16, L);
	o.attend_chunk = 24;
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
	wc = wrap_get();
	EXPECT_GT(wc.allocs, 0u);
	ASSERT_EQ(0, ape_kv_cache_get_info(cache, &info));
	EXPECT_EQ(wc.live_bytes, info.device_bytes) TH_LOG("every device byte is the cache's");
	wrap_reset();
	staged = atomic_load(&self->ctx->staging_placed) + atomic_load(&self->ctx->staging_plain);
	/* prefill, then decode with stats (the pair counts come back too) */
	ASSERT_EQ(0, decode(&tp, cache, 5, NULL)) TH_LOG("%s", ape_last_error());
	{
		ape_tensor qt = test_rows(&tp.q.t, L - 1, 1), ot = test_rows(&tp.o.t, L - 1, 1);
		ape_stats st;

		ape_stats_init(&st);
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &ot, NULL, &st));
		EXPECT_GT(st.chunks, 1u);
	}
	wc = wrap_get();
	EXPECT_EQ(0u, wc.allocs) TH_LOG("buf_alloc called on the hot path");
	EXPECT_EQ(0u, wc.frees);
	EXPECT_GT(wc.attention_calls, 0u);
	EXPECT_EQ(staged, atomic_load(&self->ctx->staging_placed) +
				  atomic_load(&self->ctx->staging_plain))
		TH_LOG("a staging buffer was allocated on the hot path");
	ape_kv_cache_destroy(cache);
	wc = wrap_get();
	EXPECT_EQ(0u, wc.live_bytes) TH_LOG("destroy frees every block");
	test_problem_free(&tp);
}

/* ---- statistics as a forward call reports them */

/* A stretched device clock: every span between two events lasts STRETCH_MS longer than it did,
 * so that the copies and kernels of any call overlap in time, whatever the device really did. */
#define STRETCH_MS 1e4

static const struct ape__backend_ops *stretch_orig;

static int stretched_elapsed(struct ape__event *a, struct ape__event *b, double *ms)
{
	int ret = stretch_orig->event_elapsed(a, b, ms);

	if (!ret)
		*ms += STRETCH_MS;
	return ret;
}

/* overlap_ms, total_ms and the names, reported by an attend as by a forward call. */
TEST_F(kv, stats_as_a_forward_call_reports_them)
{
	const int64_t L = 64, n = 16;
	const test_problem_shape sh = { 1, 4, 2, L, L, 16 };
	static struct ape__backend_ops stretched;
	ape_tensor kt, vt, qt, ot;
	ape_kv_cache_options o;
	ape_stats fw, st;
	ape_kv_cache *cache;
	test_problem tp;
	ape_rng rng;

	if (!self->dev->caps.timestamps)
		SKIP(return, "the backend has no event timestamps: no overlap figure");
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	stretch_orig = self->dev->be->ops;
	stretched = *stretch_orig;
	stretched.event_elapsed = stretched_elapsed;
	self->dev->be->ops = &stretched;

	ape_stats_init(&fw);
	{ /* the streamed path (a host call on the reference computes in place: no copies) */
		ape_exec_options eo;

		ape_exec_options_init(&eo);
		eo.chunk_q = eo.chunk_k = L;
		ASSERT_EQ(0, ape_attention_forward_ex(&self->dev, 1, &eo, &tp.desc, &tp.q.t, &tp.k.t,
						      &tp.v.t, &tp.o.t, tp.lse, &fw))
			TH_LOG("%s", ape_last_error());
	}
	EXPECT_GT(fw.overlap_ms, 0.0) TH_LOG("the stretched clock makes copies and kernels overlap");

	o = cache_options(&tp, 16, L);
	o.attend_chunk = 24;
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
	kt = test_rows(&tp.k.t, 0, L);
	vt = test_rows(&tp.v.t, 0, L);
	qt = test_rows(&tp.q.t, L - n, n);
	ot = test_rows(&tp.o.t, L - n, n);
	ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt)) TH_LOG("%s", ape_last_error());
	ape_stats_init(&st);
	ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &ot, NULL, &st))
		TH_LOG("%s", ape_last_error());
	EXPECT_GT(st.chunks, 1u);
	EXPECT_GT(st.overlap_ms, 0.0) TH_LOG("the attend dropped overlap_ms");
	/* up to rounding: the intervals sit at device clock values of 1e6 ms and more */
	EXPECT_LE(st.overlap_ms, st.copy_ms * (1 + 1e-6) + 1e-6);
	EXPECT_LE(st.overlap_ms, st.kernel_ms * (1 + 1e-6) + 1e-6);
	EXPECT_GT(st.total_ms, 0.0);
	EXPECT_EQ(fw.devices, st.devices);
	EXPECT_STREQ(fw.backend, st.backend);
	EXPECT_STREQ(fw.device, st.device);
	ape_kv_cache_destroy(cache);
	self->dev->be->ops = stretch_orig;
	test_problem_free(&tp);
}

/* ---- capacity and release */

TEST_F(kv, full_cache_is_enomem_and_appends_nothing)
{
	const test_problem_shape sh = { 1, 2, 1, 30, 30, 8 };
	ape_kv_cache_options o;
	ape_kv_cache_info info;
	ape_kv_cache *cache;
	test_problem tp;
	ape_rng rng;
	int64_t rel;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	o = cache_options(&tp, 8, 20); /* 3 blocks: 24 tokens */
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache));
	{
		ape_tensor kt = test_rows(&tp.k.t, 0, 20), vt = test_rows(&tp.v.t, 0, 20);
		ape_tensor k2 = test_rows(&tp.k.t, 20, 5), v2 = test_rows(&tp.v.t, 20, 5);

		ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt));
		EXPECT_EQ(APE_ENOMEM, ape_kv_cache_append(cache, &k2, &v2));
		EXPECT_NE(NULL, strstr(ape_last_error(), "5 tokens do not fit"))
			TH_LOG("%s", ape_last_error());
		EXPECT_NE(NULL, strstr(ape_last_error(), "room for 4"));
	}
	ASSERT_EQ(0, ape_kv_cache_get_info(cache, &info));
	EXPECT_EQ(20, info.tokens);
	EXPECT_EQ(24, info.capacity_tokens);
	/* created without allow_release: asking to release is an error */
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_release_unreachable(cache, &tp.desc, &rel));
	EXPECT_NE(NULL, strstr(ape_last_error(), "allow_release"));
	ape_kv_cache_destroy(cache);
	test_problem_free(&tp);
}

/* Max |q| over every row of tp, the bound a caller would promise. */
static double max_query_norm(const test_problem *tp)
{
	const int64_t *s = tp->q.t.shape;
	double m = 0;

	for (int64_t b = 0; b < s[0]; b++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t i = 0; i < s[2]; i++) {
				double ss = 0;

				for (int64_t d = 0; d < s[3]; d++)
					ss += pow(test_tensor_get(&tp->q.t, b, h, i, d), 2);
				m = fmax(m, sqrt(ss));
			}
	return m * 1.001;
}

/* Every row of t scaled to norm r: the release bound depends on the largest norms, which
 * random data with a large spread would make arbitrary. */
static void set_norms(ape_tensor *t, double r)
{
	const int64_t *s = t->shape;

	for (int64_t b = 0; b < s[0]; b++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t i = 0; i < s[2]; i++) {
				double ss = 0;

				for (int64_t d = 0; d < s[3]; d++)
					ss += pow(test_tensor_get(t, b, h, i, d), 2);
				for (int64_t d = 0; d < s[3]; d++)
					test_tensor_set(t, b, h, i, d,
							test_tensor_get(t, b, h, i, d) * r /
								sqrt(ss));
			}
}

/*
 * With a real decay the oldest blocks can no longer reach any future query: the cache releases
 * them and reuses their room, so a sequence far longer than its capacity decodes, and still
 * equals the full recomputation. Without delta > 0, or with allow_release off, nothing goes.
 */
TEST_F(kv, release_only_when_allowed_and_provable)
{
	/* the emulated CUDA device: 160 tokens, still 4 blocks more than the capacity */
	const int64_t L = ape_test_slow() ? 120 : self->emu ? 160 : 400;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	ape_kv_cache_info info;
	test_problem tp, want;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	set_norms(&tp.q.t, 4);
	set_norms(&tp.k.t, 4);
	test_problem_set_params(&tp, 1.2, 0.05, 0.05, 0.1);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());

	/* allowed and provable: L tokens through a cache of 96 */
	{
		ape_kv_cache_options o = cache_options(&tp, 16, 96);
		ape_kv_cache *cache;

		o.allow_release = true;
		o.max_query_norm = max_query_norm(&tp);
		o.max_queries = 4;
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache));
		test_tensor_poison(&tp.o.t);
		ASSERT_EQ(0, decode(&tp, cache, 1, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, close_enough(_metadata, &tp, &want, "with release"));
		ASSERT_EQ(0, ape_kv_cache_get_info(cache, &info));
		EXPECT_EQ(L, info.tokens);
		EXPECT_GT(info.blocks_released, (L - 96) / 16);
		EXPECT_LE(info.live_tokens, 96);
		/* releases come a block at a time: the floor is where the last one was proved */
		EXPECT_GE(info.min_query_position, L - 32);
		ksft_print_msg("released %lld blocks, %lld tokens live\n",
			       (long long)info.blocks_released, (long long)info.live_tokens);
		fflush(stdout);

		/* what the proof excluded is refused, not computed wrongly */
		{
			ape_tensor qt = test_rows(&tp.q.t, L - 1, 1), ot = test_rows(&tp.o.t, L - 1, 1);
			ape_attn_desc d = tp.desc;
			test_tensor big;

			d.q_start_set = true;
			d.q_start = info.min_query_position - 1; /* earlier than promised */
			EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(cache, &d, &qt, &ot, NULL, NULL));
			EXPECT_NE(NULL, strstr(ape_last_error(), "released"));
			d = tp.desc;
			d.delta.per_head = NULL;
			d.delta.value = 0.1f; /* weaker decay */
			EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(cache, &d, &qt, &ot, NULL, NULL));
			EXPECT_NE(NULL, strstr(ape_last_error(), "delta >="));
			d = tp.desc;
			d.skip_tol = 0; /* nothing may be left out */
			EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(cache, &d, &qt, &ot, NULL, NULL));
			EXPECT_NE(NULL, strstr(ape_last_error(), "skip_tol"));
			ASSERT_EQ(0, test_tensor_random(&big, &rng, APE_F32, 1, 2, 1, 16, 100.0));
			EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(cache, &tp.desc, &big.t, &ot, NULL,
								  NULL));
			EXPECT_NE(NULL, strstr(ape_last_error(), "max_query_norm"));
			test_tensor_free(&big);
		}
		ape_kv_cache_destroy(cache);
	}

	/* allowed, but delta = 0: the bound cannot prove anything, the cache fills up */
	{
		ape_kv_cache_options o = cache_options(&tp, 16, 96);
		ape_kv_cache *cache;
		ape_tensor kt = test_rows(&tp.k.t, 0, 96), vt = test_rows(&tp.v.t, 0, 96);
		ape_tensor qt = test_rows(&tp.q.t, 95, 1), ot = test_rows(&tp.o.t, 95, 1);
		int64_t rel = -1;

		test_problem_set_params(&tp, 0.0, 0.5, 0.5, 0.1);
		o.allow_release = true;
		o.max_query_norm = max_query_norm(&tp);
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache));
		ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt));
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &ot, NULL, NULL));
		ASSERT_EQ(0, ape_kv_cache_release_unreachable(cache, &tp.desc, &rel));
		EXPECT_EQ(0, rel);
		/* nor with a negative decay somewhere */
		test_problem_set_params(&tp, 2.0, -0.01, 0.0, 0.1);
		ASSERT_EQ(0, ape_kv_cache_release_unreachable(cache, &tp.desc, &rel));
		EXPECT_EQ(0, rel);
		/* nor with skip_tol = 0 */
		test_problem_set_params(&tp, 2.0, 0.0, 0.0, 0.1);
		tp.desc.skip_tol = 0;
		ASSERT_EQ(0, ape_kv_cache_release_unreachable(cache, &tp.desc, &rel));
		EXPECT_EQ(0, rel);
		/* a strong decay proves it, explicitly asked */
		tp.desc.skip_tol = 0x1p-24;
		ASSERT_EQ(0, ape_kv_cache_release_unreachable(cache, &tp.desc, &rel));
		EXPECT_GT(rel, 0);
		EXPECT_EQ(0, rel % 16);
		ASSERT_EQ(0, ape_kv_cache_get_info(cache, &info));
		EXPECT_EQ(96 - rel, info.live_tokens);
		ape_kv_cache_destroy(cache);
	}
	test_problem_free(&tp);
	test_problem_free(&want);
}

/* ---- decode in place */

/* Fills every byte of the blocks outside the live keys (blocks released or never written,
 * rows of the last block past the newest token) with NaN: a launch reading any of them makes
 * NaN of its row. */
static int poison_dead(ape_kv_cache *c)
{
	const int64_t nbg = c->o.B * c->o.Hkv, last = (c->t_end + c->bt - 1) / c->bt;
	struct ape__queue *q;
	int ret = c->ops->queue_create(c->dev, &q);

	for (int64_t blk = 0; !ret && blk < c->nblocks; blk++) {
		/* the logical block living in blk, if any */
		const int64_t lb = c->lb_first + ((blk - c->lb_first % c->nblocks) + c->nblocks) %
							 c->nblocks;
		const int64_t r0 = lb >= last ? 0 : lb == last - 1 ? c->t_end - lb * c->bt : c->bt;

		for (int kv = 0; kv < 2 && !ret; kv++)
			for (int64_t bg = 0; bg < nbg && r0 < c->bt && !ret; bg++) {
				size_t off;
				struct ape__buf *b = ape__kv_block(c, kv, blk, &off);

				ret = c->ops->fill(q, b, off + ape__kv_blk_off(c, bg, r0), 0x7fc07fc0u,
						   (size_t)((c->bt - r0) * c->o.D) * c->esz);
			}
	}
	if (!ret)
		ret = c->ops->synchronize(q);
	c->ops->queue_destroy(q);
	return ret;
}

/* Whether the device's backend reads a decode of this shape in place: the OpenCL decode's
 * rule (opencl/ocl_decode.c: CPU devices in its CPU shape, others in its work-group shape; D a
 * multiple of 32 up to 256, at most 8 query rows, at most 16 rows per kv head with D = 64 or
 * 128, else 8). */
static bool expect_in_place(const ape_device *dev, const test_problem *tp)
{
	const int64_t *s = tp->q.t.shape, group = s[1] / tp->k.t.shape[1];

	return dev->be->ops->attention_pages && !strcmp(dev->info.backend, "opencl") &&
	       s[3] % 32 == 0 && s[2] <= 8 &&
	       group * s[2] <= (s[3] == 64 || s[3] == 128 ? 16 : 8);
}

/* Every element of a equals b's (same shape; finite values). */
static bool same_values(const ape_tensor *a, const ape_tensor *b)
{
	const int64_t *s = a->shape;

	for (int64_t bb = 0; bb < s[0]; bb++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t i = 0; i < s[2]; i++)
				for (int64_t d = 0; d < s[3]; d++)
					if (test_tensor_get(a, bb, h, i, d) !=
					    test_tensor_get(b, bb, h, i, d))
						return false;
	return true;
}

/* Whether the same attend gathered runs the decode kernel too (not the general one): skipping
 * off, or allowed with nothing to skip by (opencl/ocl_decode.c). */
static bool gathered_decodes(const test_problem *tp)
{
	const int64_t H = tp->q.t.shape[1];
	bool decays = false, nonneg = true;

	for (int64_t i = 0; i < 3 * H; i++) {
		decays |= tp->params[i] != 0;
		nonneg &= tp->params[i] >= 0;
	}
	return !(tp->desc.skip_tol > 0 && nonneg && decays);
}

/*
 * Decode-shaped attends on random cases: awkward block sizes, many blocks, a partly filled
 * last block, GQA, both layouts, positions, every storage type, 1 .. max_queries rows,
 * skipping on and off, decays or none: equal to the reference on the live keys, with
 * everything outside them poisoned; a rerun gives the same bits; on a backend that reads
 * in place no key is copied.
 */
static void in_place_cases(struct __test_metadata *_metadata, FIXTURE_DATA(kv) *self,
			   const FIXTURE_VARIANT(kv) *variant)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const int64_t dims[] = { 32, 64, 64, 96, 128, 256 };
	static const int64_t blocks[] = { 1, 5, 7, 16, 33, 100 };
	const int cases = ape_test_slow() ? 4 : self->emu ? 8 : 24;
	int in_place = 0;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int cs = 0; cs < cases; cs++) {
		test_problem_shape sh;
		ape_kv_cache_options o;
		test_problem tp, want;
		ape_kv_cache *cache;
		ape_stats st;
		test_tensor o2;
		float *lse2;
		int64_t group, maxq, bt;
		char what[160];

		sh.B = ape_rng_range(&rng, 1, 2);
		sh.Hkv = ape_rng_range(&rng, 1, 3);
		group = (int64_t[]){ 1, 2, 3, 4 }[ape_rng_range(&rng, 0, 3)];
		sh.H = sh.Hkv * group;
		sh.D = dims[ape_rng_range(&rng, 0, 5)];
		maxq = ape_rng_range(&rng, 1, 10);
		sh.Lq = ape_rng_range(&rng, 1, maxq);
		bt = blocks[ape_rng_range(&rng, 0, 5)];
		sh.Lk = ape_rng_range(&rng, 1, self->emu ? 120 : 400);
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[ape_rng_range(&rng, 0, 2)],
					       ape_rng_uniform(&rng) < 0.3));
		test_problem_random_params(&tp, &rng);
		if (ape_rng_uniform(&rng) < 0.4) /* plain RoPE: no decay, lambda 0 */
			test_problem_set_params(&tp, 0, 0, 0, 0);
		tp.desc.skip_tol = ape_rng_uniform(&rng) < 0.5 ? 0 : 1e-3;
		tp.desc.q_start_set = ape_rng_uniform(&rng) < 0.3;
		tp.desc.q_start = tp.desc.k_start + sh.Lk - sh.Lq + ape_rng_range(&rng, -4, 4);
		snprintf(what, sizeof(what),
			 "case %d: B %lld H %lld Hkv %lld Lq %lld Lk %lld D %lld %s, blocks of %lld, "
			 "skip_tol %g, q_start %s",
			 cs, (long long)sh.B, (long long)sh.H, (long long)sh.Hkv, (long long)sh.Lq,
			 (long long)sh.Lk, (long long)sh.D, ape_dtype_name(tp.q.t.dtype),
			 (long long)bt, tp.desc.skip_tol, tp.desc.q_start_set ? "set" : "end-aligned");
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());

		o = cache_options(&tp, bt, sh.Lk + ape_rng_range(&rng, 0, 2 * bt));
		o.max_queries = maxq;
		o.append_chunk = ape_rng_range(&rng, 1, 64);
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
		for (int64_t t = 0; t < sh.Lk;) { /* appends of random sizes */
			const int64_t n = ape_rng_range(&rng, 1, sh.Lk - t);
			ape_tensor kt = test_rows(&tp.k.t, t, n), vt = test_rows(&tp.v.t, t, n);

			ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt)) TH_LOG("%s", ape_last_error());
			t += n;
		}
		ASSERT_EQ(0, poison_dead(cache));
		test_tensor_poison(&tp.o.t);
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &tp.q.t, &tp.o.t, tp.lse, &st))
			TH_LOG("%s: %s", what, ape_last_error());
		EXPECT_EQ(0, close_enough(_metadata, &tp, &want, what));
		if (tp.strided)
			EXPECT_EQ(0, test_problem_padding_intact(&tp)) TH_LOG("%s", what);
		if (expect_in_place(self->dev, &tp)) {
			/* only the queries went in: no key copied, none gathered */
			EXPECT_EQ(0u, st.bytes_device_to_device) TH_LOG("%s", what);
			EXPECT_EQ((uint64_t)(sh.B * sh.H * sh.Lq * sh.D) * ape_dtype_size(tp.q.t.dtype),
				  st.bytes_to_device)
				TH_LOG("%s", what);
			EXPECT_EQ(1u, st.chunks) TH_LOG("%s", what);
			in_place++;
		} else if (self->dev->be->ops->copy_d2d) {
			EXPECT_GT(st.bytes_device_to_device, 0u) TH_LOG("%s", what);
		}
		/* the same call again: the same bits */
		lse2 = malloc(tp.rows * sizeof(float) + 4);
		ASSERT_NE(NULL, lse2);
		ASSERT_EQ(0, test_tensor_empty(&o2, tp.o.t.dtype, sh.B, sh.H, sh.Lq, sh.D));
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &tp.q.t, &o2.t, lse2, NULL));
		EXPECT_TRUE(same_values(&tp.o.t, &o2.t)) TH_LOG("%s: rerun differs", what);
		EXPECT_EQ(0, memcmp(tp.lse, lse2, tp.rows * sizeof(float))) TH_LOG("%s", what);
		ape_kv_cache_destroy(cache);
		/* in place or gathered, one launch over the same keys: the same bits
		 * (attention_pages' contract) */
		if (expect_in_place(self->dev, &tp) && sh.Lk <= o.attend_chunk &&
		    gathered_decodes(&tp)) {
			wrap_install(self->dev, WRAP_NO_PAGES);
			ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache));
			for (int64_t t = 0; t < sh.Lk; t += 50) {
				const int64_t n = sh.Lk - t < 50 ? sh.Lk - t : 50;
				ape_tensor kt = test_rows(&tp.k.t, t, n), vt = test_rows(&tp.v.t, t, n);

				ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt));
			}
			ape_stats_init(&st);
			ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &tp.q.t, &o2.t, lse2, &st));
			EXPECT_GT(st.bytes_device_to_device, 0u) TH_LOG("%s: not gathered", what);
			EXPECT_TRUE(same_values(&tp.o.t, &o2.t)) TH_LOG("%s: gathered differs", what);
			EXPECT_EQ(0, memcmp(tp.lse, lse2, tp.rows * sizeof(float))) TH_LOG("%s", what);
			ape_kv_cache_destroy(cache);
			wrap_remove();
		}
		free(lse2);
		test_tensor_free(&o2);
		test_problem_free(&tp);
		test_problem_free(&want);
	}
	ksft_print_msg("%d of %d cases read the blocks in place\n", in_place, cases);
	fflush(stdout);
	if (!strcmp(variant->backend, "opencl"))
		EXPECT_GT(in_place, 0);
}

TEST_F(kv, decode_in_place_equals_reference)
{
	in_place_cases(_metadata, self, variant);
}

/* The same under APE_OCL_DEC_SHAPE=gpu: the OpenCL decode's work-group shape (GPU devices) on
 * this device, reading the blocks in place too. */
TEST_F(kv, decode_in_place_wg_shape_equals_reference)
{
	if (strcmp(variant->backend, "opencl"))
		SKIP(return, "APE_OCL_DEC_SHAPE concerns the OpenCL backend only");
	setenv("APE_OCL_DEC_SHAPE", "gpu", 1);
	in_place_cases(_metadata, self, variant);
	unsetenv("APE_OCL_DEC_SHAPE");
}

/* Appends all of tp's keys to a new cache with options o, in chunks of 1000, and attends tp's
 * queries into o_out and lse_out with statistics st. */
static int fill_and_attend(ape_device *dev, const ape_kv_cache_options *o, test_problem *tp,
			   ape_tensor *o_out, float *lse_out, ape_stats *st)
{
	const int64_t L = tp->k.t.shape[2];
	ape_kv_cache *cache = NULL;
	int ret = ape_kv_cache_create(dev, o, &cache);

	for (int64_t t = 0; !ret && t < L; t += 1000) {
		const int64_t n = L - t < 1000 ? L - t : 1000;
		ape_tensor kt = test_rows(&tp->k.t, t, n), vt = test_rows(&tp->v.t, t, n);

		ret = ape_kv_cache_append(cache, &kt, &vt);
	}
	if (!ret)
		ret = ape_kv_cache_attend(cache, &tp->desc, &tp->q.t, o_out, lse_out, st);
	if (cache)
		ape_kv_cache_destroy(cache);
	return ret;
}

/*
 * A decode over slabs of more than 2 MiB, which the OpenCL backend on a CPU puts over host
 * memory advised for huge pages (opencl/ocl_mem.c): equal to the reference, and bit for bit
 * equal to the same cache over the driver's own buffers (APE_OCL_HUGE=0). Other backends ignore
 * the variable: the same equalities hold there.
 */
TEST_F(kv, decode_over_large_slabs_equals_reference)
{
	const test_problem_shape sh = { .B = 1, .H = 4, .Hkv = 2, .D = 64, .Lq = 1, .Lk = 5003 };
	test_problem tp, want;
	ape_kv_cache_options o;
	test_tensor o2;
	ape_stats st;
	float lse2[4];
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_set_params(&tp, 0, 0, 0, 0);
	tp.desc.skip_tol = 0;
	tp.desc.q_start_set = false;
	tp.desc.q_start = tp.desc.k_start + sh.Lk - sh.Lq;
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());
	o = cache_options(&tp, 256, sh.Lk + 117); /* K slab: 5120 x 2 x 64 x 4 B = 2.5 MiB */
	ape_stats_init(&st);
	ASSERT_EQ(0, fill_and_attend(self->dev, &o, &tp, &tp.o.t, tp.lse, &st))
		TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, close_enough(_metadata, &tp, &want, "large slabs"));
	if (expect_in_place(self->dev, &tp)) {
		EXPECT_EQ(0u, st.bytes_device_to_device);
		EXPECT_EQ(1u, st.chunks);
	}
	ASSERT_EQ(0, test_tensor_empty(&o2, APE_F32, sh.B, sh.H, sh.Lq, sh.D));
	ASSERT_EQ(0, setenv("APE_OCL_HUGE", "0", 1));
	EXPECT_EQ(0, fill_and_attend(self->dev, &o, &tp, &o2.t, lse2, NULL))
		TH_LOG("%s", ape_last_error());
	unsetenv("APE_OCL_HUGE");
	EXPECT_TRUE(same_values(&tp.o.t, &o2.t)) TH_LOG("huge pages or not: O differs");
	EXPECT_EQ(0, memcmp(tp.lse, lse2, sizeof(lse2))) TH_LOG("huge pages or not: LSE differs");
	test_tensor_free(&o2);
	test_problem_free(&tp);
	test_problem_free(&want);
}

/*
 * In place after releases: a decay releases the oldest blocks while a long sequence decodes
 * through a small cache, the ring reusing their room; every step equals the recomputation,
 * copies no key where the backend reads in place, and the released blocks, poisoned, change
 * no bit of a later attend.
 */
TEST_F(kv, decode_in_place_after_releases)
{
	const int64_t L = ape_test_slow() ? 100 : self->emu ? 140 : 300;
	const test_problem_shape sh = { 1, 4, 2, L, L, 64 };
	ape_kv_cache_options o;
	ape_kv_cache_info info;
	test_problem tp, want;
	ape_kv_cache *cache;
	ape_stats st;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_BF16, false));
	set_norms(&tp.q.t, 4);
	set_norms(&tp.k.t, 4);
	test_problem_set_params(&tp, 1.2, 0.05, 0.05, 0.1);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.layout = APE_ROPE_INTERLEAVED;
	tp.desc.k_start = -17;
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());
	o = cache_options(&tp, 11, 70); /* blocks of 11: the ring wraps in mid-block */
	o.allow_release = true;
	o.max_query_norm = max_query_norm(&tp);
	o.max_queries = 2;
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache));
	test_tensor_poison(&tp.o.t);
	for (int64_t i = 0; i < L; i++) {
		ape_tensor kt = test_rows(&tp.k.t, i, 1), vt = test_rows(&tp.v.t, i, 1);
		ape_tensor qt = test_rows(&tp.q.t, i, 1), ot = test_rows(&tp.o.t, i, 1);
		float lse[4];

		ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt)) TH_LOG("%s", ape_last_error());
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &ot, lse, &st))
			TH_LOG("step %lld: %s", (long long)i, ape_last_error());
		for (int64_t h = 0; h < 4; h++)
			tp.lse[h * L + i] = lse[h];
		if (expect_in_place(self->dev, &tp))
			ASSERT_EQ(0u, st.bytes_device_to_device) TH_LOG("step %lld", (long long)i);
	}
	EXPECT_EQ(0, close_enough(_metadata, &tp, &want, "in place, with release"));
	ASSERT_EQ(0, ape_kv_cache_get_info(cache, &info));
	EXPECT_GT(info.blocks_released, (L - 70) / 11);
	/* the released blocks and the last block's unwritten rows poisoned: the same bits */
	{
		ape_tensor qt = test_rows(&tp.q.t, L - 1, 1), ot = test_rows(&tp.o.t, L - 1, 1);
		test_tensor o2;
		float lse[4];

		ASSERT_EQ(0, poison_dead(cache));
		ASSERT_EQ(0, test_tensor_empty(&o2, APE_BF16, 1, 4, 1, 64));
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &o2.t, lse, NULL));
		EXPECT_TRUE(same_values(&ot, &o2.t));
		for (int64_t h = 0; h < 4; h++)
			EXPECT_EQ(tp.lse[h * L + L - 1], lse[h]);
		test_tensor_free(&o2);
	}
	ape_kv_cache_destroy(cache);
	test_problem_free(&tp);
	test_problem_free(&want);
}

/*
 * Blocks in several slabs (a device whose largest buffer holds three of them): the cache
 * gathers, since no launch can read blocks of several buffers in place, and still equals the
 * recomputation.
 */
TEST_F(kv, blocks_in_several_slabs_are_gathered)
{
	const int64_t L = 75;
	const test_problem_shape sh = { 1, 4, 2, L, L, 64 };
	ape_kv_cache_options o;
	ape_kv_cache_info info;
	test_problem tp, want;
	ape_kv_cache *cache;
	ape_stats st;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_set_params(&tp, 0, 0, 0, 0);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());
	o = cache_options(&tp, 10, L); /* 8 blocks of 2 * 10 * 64 floats: slabs of 3, 3 and 2 */
	o.max_queries = 1;
	wrap_install(self->dev, 0);
	wrap_max_alloc(3 * 2 * 10 * 64 * 4);
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(3, cache->nslabs);
	test_tensor_poison(&tp.o.t);
	ASSERT_EQ(0, decode(&tp, cache, 1, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, close_enough(_metadata, &tp, &want, "three slabs"));
	{
		ape_tensor qt = test_rows(&tp.q.t, L - 1, 1), ot = test_rows(&tp.o.t, L - 1, 1);

		ape_stats_init(&st);
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &ot, NULL, &st));
		if (self->dev->be->ops->copy_d2d)
			EXPECT_EQ((uint64_t)(2 * 2 * L * 64 * 4), st.bytes_device_to_device);
	}
	ASSERT_EQ(0, ape_kv_cache_get_info(cache, &info));
	EXPECT_EQ(L, info.tokens);
	ape_kv_cache_destroy(cache);
	wrap_remove();
	test_problem_free(&tp);
	test_problem_free(&want);
}

/* ---- arguments */

TEST_F(kv, arguments_are_validated)
{
	ape_kv_cache_options o;
	ape_kv_cache *cache = (ape_kv_cache *)&o;
	struct {
		const char *what;
		int field;
	} cases[] = {
		{ "opts->B = 0", 0 }, { "opts->Hkv = 0", 1 }, { "opts->H = 3", 2 },
		{ "opts->D = 7", 3 }, { "opts->capacity_tokens = 0", 4 },
		{ "opts->max_query_norm", 5 }, { "opts->struct_size", 6 }, { "opts->dtype", 7 },
	};

	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		ape_kv_cache_options_init(&o);
		o.B = 1;
		o.Hkv = 2;
		o.D = 8;
		o.capacity_tokens = 10;
		switch (cases[c].field) {
		case 0: o.B = 0; break;
		case 1: o.Hkv = 0; break;
		case 2: o.H = 3; break;
		case 3: o.D = 7; break;
		case 4: o.capacity_tokens = 0; break;
		case 5: o.allow_release = true; break;
		case 6: o.struct_size = 8; break;
		case 7: o.dtype = (ape_dtype)9; break;
		}
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_create(self->dev, &o, &cache));
		EXPECT_EQ(NULL, cache);
		EXPECT_NE(NULL, strstr(ape_last_error(), "ape_kv_cache_create: "));
		EXPECT_NE(NULL, strstr(ape_last_error(), cases[c].what))
			TH_LOG("\"%s\" does not name %s", ape_last_error(), cases[c].what);
	}
	/* sizes past 64 bits (found by fuzz_resident): refused before anything is computed */
	ape_kv_cache_options_init(&o);
	o.B = 1;
	o.Hkv = 2;
	o.D = 8;
	o.capacity_tokens = 10;
	o.block_tokens = ((int64_t)1 << 40) + 1;
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_create(self->dev, &o, &cache));
	EXPECT_NE(NULL, strstr(ape_last_error(), "opts->block_tokens = 1099511627777"))
	TH_LOG("%s", ape_last_error());
	o.block_tokens = (int64_t)1 << 40;
	o.B = (int64_t)1 << 20;
	EXPECT_EQ(APE_EOVERFLOW, ape_kv_cache_create(self->dev, &o, &cache));
	EXPECT_EQ(NULL, cache);
	EXPECT_NE(NULL, strstr(ape_last_error(), "the cache's sizes pass 64 bits"))
	TH_LOG("%s", ape_last_error());
	o.block_tokens = 0;
	o.B = 1;
	o.append_chunk = INT64_MAX;
	EXPECT_EQ(APE_EOVERFLOW, ape_kv_cache_create(self->dev, &o, &cache));
	o.append_chunk = 0;
	o.B = o.Hkv = (int64_t)1 << 32;
	EXPECT_EQ(APE_EOVERFLOW, ape_kv_cache_create(self->dev, &o, &cache));
	o.B = o.Hkv = 1;
	o.max_queries = ((int64_t)1 << 40) + 1;
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_create(self->dev, &o, &cache));
	EXPECT_NE(NULL, strstr(ape_last_error(), "opts->max_queries = 1099511627777"))
	TH_LOG("%s", ape_last_error());
	o.max_queries = 0;
	o.k_start = INT64_MIN + 1; /* the release's earliest query would lie before INT64_MIN */
	EXPECT_EQ(APE_EOVERFLOW, ape_kv_cache_create(self->dev, &o, &cache));
	EXPECT_NE(NULL, strstr(ape_last_error(), "opts->k_start = -9223372036854775807: too small"))
	TH_LOG("%s", ape_last_error());
	o.k_start = 0;
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_create(NULL, &o, &cache));
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_create(self->dev, NULL, &cache));
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_append(NULL, NULL, NULL));
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(NULL, NULL, NULL, NULL, NULL, NULL));
	ape_kv_cache_destroy(NULL);

	/* a valid cache, wrong tensors */
	ape_kv_cache_options_init(&o);
	o.B = 1;
	o.Hkv = 2;
	o.D = 8;
	o.capacity_tokens = 10;
	o.max_queries = 2;
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
	{
		float buf[3 * 2 * 8 * 2] = { 0 };
		ape_tensor k, v, q, out;
		ape_attn_desc d;

		ape_attn_desc_init(&d);
		ape_tensor_init(&k, buf, APE_F32, 1, 3, 1, 8);
		ape_tensor_init(&v, buf, APE_F32, 1, 2, 1, 8);
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_append(cache, &k, &v));
		EXPECT_NE(NULL, strstr(ape_last_error(), "k->shape[1] = 3"));
		ape_tensor_init(&k, buf, APE_F16, 1, 2, 1, 8);
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_append(cache, &k, &v));
		EXPECT_NE(NULL, strstr(ape_last_error(), "k->dtype = f16"));
		ape_tensor_init(&q, buf, APE_F32, 1, 2, 3, 8);
		ape_tensor_init(&out, buf + 48, APE_F32, 1, 2, 3, 8);
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(cache, &d, &q, &out, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "max_queries = 2"));
	}
	ape_kv_cache_destroy(cache);
}

TEST_HARNESS_MAIN
