/* SPDX-License-Identifier: MIT */
/*
 * The KV cache: decoding token by token and chunked prefill equal a full recomputation; the
 * hot path (append within capacity, attend) allocates no device memory and no staging; blocks
 * are released only when allowed and provable, and an attend that would void the proof is
 * refused; a full cache says so; the gather works without the backend's copy_d2d too; decode
 * attends read the blocks in place where the backend can (attention_pages), equal to the
 * reference, touching nothing outside the live keys, and copying no key (those:
 * test_kvcache_inplace.c); the arguments are validated.
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

#include "kvcache_case.h"

BACKEND_FIXTURE(kv)

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

/* The gather through host staging, for backends without copy_d2d, gives the same bits (the
 * keys gathered both times: attention_pages hidden). */
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

		wrap_install(self->dev, WRAP_NO_PAGES | (pass ? WRAP_NO_COPY_D2D : 0));
		o.attend_chunk = 16;
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, decode(tp, cache, 4, NULL)) TH_LOG("%s", ape_last_error());
		/* the statistics say which way the keys went */
		{
			ape_tensor qt = test_rows(&tp->q.t, L - 1, 1), ot = test_rows(&tp->o.t, L - 1, 1);

			ape_stats_init(&st);
			ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp->desc, &qt, &ot, NULL, &st));
			if (pass || !self->dev->be->ops->copy_d2d) {
				/* the keys and values through host staging (and the query and
				 * tables where the device does not read them in place) */
				EXPECT_EQ(0u, st.bytes_device_to_device);
				if (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_HOST_MEMORY)) {
					EXPECT_EQ(st.bytes_to_device, (uint64_t)(2 * 2 * L * 16 * 4));
				} else {
					EXPECT_GT(st.bytes_to_device, (uint64_t)(2 * 2 * L * 16 * 4));
				}
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
	/* the keys gathered in several key chunks (a decode in place is one launch that gathers
	 * nothing) */
	wrap_install(self->dev, WRAP_NO_PAGES);
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

static const struct ape_backend_plugin *stretch_orig;

static int stretched_elapsed(struct ape_be_event *a, struct ape_be_event *b, double *ms)
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
	static struct ape_backend_plugin stretched;
	ape_tensor kt, vt, qt, ot;
	ape_kv_cache_options o;
	ape_stats fw, st;
	ape_kv_cache *cache;
	test_problem tp;
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_TIMESTAMPS))
		SKIP(return, "the backend has no event timestamps: no overlap figure");
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	stretch_orig = self->dev->be->ops;
	stretched = *stretch_orig;
	stretched.event_elapsed = stretched_elapsed;
	/* the keys gathered in several key chunks: copies and kernels to overlap */
	stretched.attention_pages = NULL;
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

/* ---- under decay, an attend reads only the keys within reach */

/* Fills K and V of tokens [t0, t1) (counted from the first appended) with NaN behind the
 * cache's back: the block maxima still say those keys are small. */
struct poison_arg {
	ape_kv_cache *c;
	struct ape_be_queue *q;
};

static int poison_seg(void *arg, const struct ape__kv_seg *sg)
{
	const struct poison_arg *a = arg;
	int ret = 0;

	for (int kv = 0; kv < 2 && !ret; kv++) {
		size_t off;
		struct ape_be_buf *b = ape__kv_block(a->c, kv, sg->blk, &off);

		ret = a->c->ops->fill(a->q, b, off + sg->blk_off, 0x7fc07fc0u, sg->bytes);
	}
	return ret;
}

static int poison_tokens(ape_kv_cache *c, int64_t t0, int64_t t1)
{
	struct poison_arg a = { c, NULL };
	int ret = c->ops->queue_create(c->dev, &a.q);

	if (!ret)
		ret = ape__kv_each_seg(c, t0, t1 - t0, poison_seg, &a);
	if (!ret)
		ret = c->ops->synchronize(a.q);
	if (a.q)
		c->ops->queue_destroy(a.q);
	return ret;
}

/*
 * A long sequence decoded under the seed's decay (every step equal to the recomputation); then
 * every key but the newest 256 is poisoned behind the cache's back, and the last step gives the
 * same bits, computing fewer than 256 keys a head: the attend proved the old keys negligible
 * from the block maxima and never read, gathered or normed them (api/kvcache_attend.c,
 * window_cut()). Without decay the same poison reaches the output: the old keys are read
 * there, so the check above can fail.
 */
TEST_F(kv, decode_under_decay_reads_only_keys_within_reach)
{
	const int64_t L = ape_test_slow() ? 400 : self->emu ? 500 : 1500;
	const test_problem_shape sh = { 1, 4, 2, L, L, 64 };
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int decay = 1; decay >= 0; decay--) {
		ape_kv_cache_options o;
		test_problem tp, want;
		ape_kv_cache *cache;
		ape_tensor qt, ot;
		test_tensor o2;
		ape_stats st;
		float lse[4];
		bool nan = false;

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
		set_norms(&tp.q.t, 4);
		set_norms(&tp.k.t, 4);
		if (decay) /* the seed's parameters */
			test_problem_set_params(&tp, 0.3968502629920499, 0.03968502629920499,
						0.03968502629920499, 0.1);
		else
			test_problem_set_params(&tp, 0, 0, 0, 0);
		tp.desc.causal = true;
		tp.desc.q_start_set = false;
		tp.desc.skip_tol = 0x1p-24;
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, self->ref)) TH_LOG("%s", ape_last_error());
		o = cache_options(&tp, 16, L);
		o.max_queries = 1;
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache))
			TH_LOG("%s", ape_last_error());
		test_tensor_poison(&tp.o.t);
		if (decay) {
			ASSERT_EQ(0, decode(&tp, cache, 1, NULL)) TH_LOG("%s", ape_last_error());
			EXPECT_EQ(0, close_enough(_metadata, &tp, &want, "decay"));
		} else {
			ape_tensor kt = test_rows(&tp.k.t, 0, L), vt = test_rows(&tp.v.t, 0, L);

			ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt))
				TH_LOG("%s", ape_last_error());
		}
		qt = test_rows(&tp.q.t, L - 1, 1);
		ot = test_rows(&tp.o.t, L - 1, 1);
		if (!decay)
			ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &ot, lse, NULL));
		ASSERT_EQ(0, poison_tokens(cache, 0, L - 256));
		ASSERT_EQ(0, test_tensor_empty(&o2, APE_F32, 1, 4, 1, 64));
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &qt, &o2.t, lse, &st))
			TH_LOG("%s", ape_last_error());
		for (int64_t h = 0; h < 4; h++)
			for (int64_t d = 0; d < 64; d++)
				nan |= isnan(test_tensor_get(&o2.t, 0, h, 0, d));
		if (decay) {
			EXPECT_TRUE(same_values(&ot, &o2.t));
			for (int64_t h = 0; h < 4; h++) {
				EXPECT_EQ(tp.lse[h * L + L - 1], lse[h]);
			}
			EXPECT_LT(st.pairs_computed, 4u * 256u);
			EXPECT_EQ((uint64_t)(4 * L), st.pairs_visible);
		} else {
			EXPECT_TRUE(nan)
			TH_LOG("the poisoned keys did not reach the output without decay");
		}
		test_tensor_free(&o2);
		ape_kv_cache_destroy(cache);
		test_problem_free(&tp);
		test_problem_free(&want);
	}
}

TEST_HARNESS_MAIN
