/* SPDX-License-Identifier: MIT */
/*
 * The KV cache's decode attends in place (attention_pages) where the backend can, and on CUDA
 * its prefill chunks too: equal to the reference, touching nothing outside the live keys,
 * copying no key and bit for bit the attend gathered, over work-group shapes, large slabs,
 * after releases, and with blocks in several slabs gathered. (The rest of the cache:
 * test_kvcache.c.)
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

/* ---- decode in place */

/* Fills every byte of the blocks outside the live keys (blocks released or never written,
 * rows of the last block past the newest token) with NaN: a launch reading any of them makes
 * NaN of its row. */
static int poison_dead(ape_kv_cache *c)
{
	const int64_t nbg = c->o.B * c->o.Hkv, last = (c->t_end + c->bt - 1) / c->bt;
	struct ape_be_queue *q;
	int ret = c->ops->queue_create(c->dev, &q);

	for (int64_t blk = 0; !ret && blk < c->nblocks; blk++) {
		/* the logical block living in blk, if any */
		const int64_t lb = c->lb_first + ((blk - c->lb_first % c->nblocks) + c->nblocks) %
							 c->nblocks;
		const int64_t r0 = lb >= last ? 0 : lb == last - 1 ? c->t_end - lb * c->bt : c->bt;

		for (int kv = 0; kv < 2 && !ret; kv++)
			for (int64_t bg = 0; bg < nbg && r0 < c->bt && !ret; bg++) {
				size_t off;
				struct ape_be_buf *b = ape__kv_block(c, kv, blk, &off);

				ret = c->ops->fill(q, b, off + ape__kv_blk_off(c, bg, r0), 0x7fc07fc0u,
						   (size_t)((c->bt - r0) * c->o.D) * c->esz);
			}
	}
	if (!ret)
		ret = c->ops->synchronize(q);
	c->ops->queue_destroy(q);
	return ret;
}

/* Whether the device's backend reads an attend of this shape in place: the OpenCL decode's
 * rule (opencl/ocl_decode.c: CPU devices in its CPU shape, others in its work-group shape; D a
 * multiple of 32 up to 256, at most 8 query rows, at most 16 rows per kv head with D = 64 or
 * 128, else 8), or CUDA's (cuda/cuda_attention.c, ape__cu_attention_pages(): the decode, at
 * most 16 query rows, any D; the prefill, more rows, unless the separable path may take the
 * launch: f16 or bf16, D = 64 or 128, some head with lambda = 0, cuda/cuda_separable.c). */
static bool expect_in_place(const ape_device *dev, const test_problem *tp)
{
	const int64_t *s = tp->q.t.shape, group = s[1] / tp->k.t.shape[1];

	if (dev->be->ops->attention_pages && !strcmp(dev->info.backend, "cuda")) {
		bool lambda0 = false;

		for (int64_t h = 0; h < s[1]; h++)
			lambda0 |= tp->params[3 * s[1] + h] == 0;
		return s[2] <= 16 || !(lambda0 && tp->q.t.dtype != APE_F32 &&
				       (s[3] == 64 || s[3] == 128));
	}
	return dev->be->ops->attention_pages && !strcmp(dev->info.backend, "opencl") &&
	       s[3] % 32 == 0 && s[2] <= 8 &&
	       group * s[2] <= (s[3] == 64 || s[3] == 128 ? 16 : 8);
}

/* Whether the same attend gathered runs the kernel that reads it in place (not the general
 * one): on CUDA always (its decode and its prefill take every launch of their rows, skipping in
 * place as gathered); on OpenCL with skipping off, or allowed with nothing to skip by
 * (opencl/ocl_decode.c). */
static bool gathered_decodes(const ape_device *dev, const test_problem *tp)
{
	const int64_t H = tp->q.t.shape[1];
	bool decays = false, nonneg = true;

	if (!strcmp(dev->info.backend, "cuda"))
		return true;
	for (int64_t i = 0; i < 3 * H; i++) {
		decays |= tp->params[i] != 0;
		nonneg &= tp->params[i] >= 0;
	}
	return !(tp->desc.skip_tol > 0 && nonneg && decays);
}

/*
 * Decode-shaped attends on random cases (prefill: chunks of 17 to 40 rows instead, D = 64 and
 * 128 mostly, the kernels that copy K and V rows with cp.async): awkward block sizes, many
 * blocks, a partly filled last block, GQA, both layouts, positions, every storage type,
 * 1 .. max_queries rows, skipping on and off, decays or none: equal to the reference on the
 * live keys, with everything outside them poisoned; a rerun gives the same bits; on a backend
 * that reads in place no key is copied, and the attend gathered gives the same bits.
 */
static void in_place_cases(struct __test_metadata *_metadata, FIXTURE_DATA(kv) *self,
			   const FIXTURE_VARIANT(kv) *variant, bool prefill)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const int64_t dims[] = { 32, 64, 64, 96, 128, 256 };
	static const int64_t pf_dims[] = { 64, 128, 64, 128, 96, 32 };
	static const int64_t blocks[] = { 1, 5, 7, 16, 33, 100 };
	const int cases = ape_test_slow() ? 4 : self->emu ? (prefill ? 6 : 8) : prefill ? 12 : 24;
	int in_place = 0, compared = 0;
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
		sh.D = (prefill ? pf_dims : dims)[ape_rng_range(&rng, 0, 5)];
		maxq = prefill ? 40 : ape_rng_range(&rng, 1, 10);
		sh.Lq = ape_rng_range(&rng, prefill ? 17 : 1, maxq);
		bt = blocks[ape_rng_range(&rng, 0, 5)];
		sh.Lk = ape_rng_range(&rng, prefill ? 17 : 1, self->emu ? 120 : 400);
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[ape_rng_range(&rng, 0, 2)],
					       ape_rng_uniform(&rng) < 0.3));
		test_problem_random_params(&tp, &rng);
		/* plain RoPE: no decay, lambda 0 (a prefill is then gathered on CUDA: its separable
		 * path takes it) */
		if (ape_rng_uniform(&rng) < (prefill ? 0.25 : 0.4))
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
			/* no key copied, none gathered; on a device that does not read host memory
			 * in place, only the queries went in and the call's parameter tables (float64
			 * and float32); on one that does, nothing (queries and tables read where they
			 * lie) */
			const uint64_t in = ape_be_caps_have(&self->dev->caps, APE_BE_CAP_HOST_MEMORY)
						    ? 0
						    : (uint64_t)(sh.B * sh.H * sh.Lq * sh.D) *
							      ape_dtype_size(tp.q.t.dtype) +
							      (uint64_t)(sh.D / 2 + 4 * sh.H) * (8 + 4);

			EXPECT_EQ(0u, st.bytes_device_to_device) TH_LOG("%s", what);
			EXPECT_EQ(in, st.bytes_to_device)
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
		    gathered_decodes(self->dev, &tp)) {
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
			compared++;
		}
		free(lse2);
		test_tensor_free(&o2);
		test_problem_free(&tp);
		test_problem_free(&want);
	}
	ksft_print_msg("%d of %d cases read the blocks in place, %d compared with the attend "
		       "gathered\n", in_place, cases, compared);
	fflush(stdout);
	if ((!strcmp(variant->backend, "opencl") && !prefill) || !strcmp(variant->backend, "cuda"))
		EXPECT_GT(in_place, 0);
	if (!strcmp(variant->backend, "cuda")) /* every launch in place is compared there */
		EXPECT_EQ(in_place, compared);
}

TEST_F(kv, decode_in_place_equals_reference)
{
	in_place_cases(_metadata, self, variant, false);
}

/*
 * An attend of one key chunk on a device that reads host memory, without statistics or
 * diagnostics, writes the caller's O and LSE in place: no accumulator filled, no merge, nothing
 * read back (kv_session.c); with statistics the same keys merge into the session's
 * accumulators. Both give the same bits (a merge of one chunk into the empty result is exact):
 * every storage type, LSE or none, O strided (D contiguous), GQA.
 */
TEST_F(kv, one_chunk_attend_writes_in_place)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	const bool host = ape_be_caps_have(&self->dev->caps, APE_BE_CAP_HOST_MEMORY);
	int direct = 0;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int cs = 0; cs < 9; cs++) {
		const test_problem_shape sh = { 1, 2 * (1 + cs % 2), 2, 1 + cs % 3, 37 + 11 * cs, 64 };
		const bool with_lse = cs % 2 == 0;
		ape_kv_cache_options o;
		test_problem tp;
		ape_kv_cache *cache;
		ape_stats st;
		test_tensor o2;
		struct wrap_counts merged, direct_c;
		float *lse2;
		char what[96];

		snprintf(what, sizeof(what), "case %d: H %lld Lq %lld Lk %lld %s, %s", cs,
			 (long long)sh.H, (long long)sh.Lq, (long long)sh.Lk,
			 ape_dtype_name(types[cs % 3]), with_lse ? "LSE" : "no LSE");
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[cs % 3], cs % 4 == 1));
		test_problem_random_params(&tp, &rng);
		tp.desc.skip_tol = 0;
		o = cache_options(&tp, 16, sh.Lk + 16);
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &cache)) TH_LOG("%s", ape_last_error());
		{
			ape_tensor kt = test_rows(&tp.k.t, 0, sh.Lk), vt = test_rows(&tp.v.t, 0, sh.Lk);

			ASSERT_EQ(0, ape_kv_cache_append(cache, &kt, &vt)) TH_LOG("%s", ape_last_error());
		}
		lse2 = malloc(tp.rows * sizeof(float) + 4);
		ASSERT_NE(NULL, lse2);
		ASSERT_EQ(0, test_tensor_empty(&o2, tp.o.t.dtype, sh.B, sh.H, sh.Lq, sh.D));
		wrap_install(self->dev, 0);
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &tp.q.t, &o2.t,
						 with_lse ? lse2 : NULL, &st))
			TH_LOG("%s: %s", what, ape_last_error());
		merged = wrap_get();
		wrap_reset();
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &tp.q.t, &tp.o.t,
						 with_lse ? tp.lse : NULL, NULL))
			TH_LOG("%s: %s", what, ape_last_error());
		direct_c = wrap_get();
		wrap_remove();
		EXPECT_TRUE(same_values(&tp.o.t, &o2.t)) TH_LOG("%s: O differs", what);
		if (with_lse)
			EXPECT_EQ(0, memcmp(tp.lse, lse2, tp.rows * sizeof(float))) TH_LOG("%s", what);
		if (tp.strided)
			EXPECT_EQ(0, test_problem_padding_intact(&tp)) TH_LOG("%s", what);
		if (host && merged.calls[WRAP_ATTENTION] == 1) { /* one launch: one key chunk */
			EXPECT_EQ(0u, direct_c.calls[WRAP_ATTENTION_MERGE]) TH_LOG("%s", what);
			/* an LSE nobody wants stays on the device, poisoned first in a context
			 * that poisons outputs (the tests' own) */
			EXPECT_EQ(!with_lse && (self->dev->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS)
					  ? 1u
					  : 0u,
				  direct_c.calls[WRAP_FILL])
				TH_LOG("%s", what);
			EXPECT_EQ(0u, direct_c.calls[WRAP_COPY_D2H]) TH_LOG("%s", what);
			EXPECT_EQ(0u, direct_c.calls[WRAP_COPY_H2D]) TH_LOG("%s", what);
			EXPECT_EQ(1u, direct_c.calls[WRAP_ATTENTION]) TH_LOG("%s", what);
			if (self->dev->be->ops->attention_merge)
				EXPECT_GT(merged.calls[WRAP_ATTENTION_MERGE], 0u) TH_LOG("%s", what);
			direct++;
		}
		free(lse2);
		test_tensor_free(&o2);
		ape_kv_cache_destroy(cache);
		test_problem_free(&tp);
	}
	ksft_print_msg("%d of 9 attends ran as one chunk written in place\n", direct);
	fflush(stdout);
	if (!strcmp(variant->backend, "opencl"))
		EXPECT_EQ(9, direct);
}

/* Prefill chunks: read in place on CUDA (its prefill kernel through the pages), gathered
 * elsewhere; bit for bit the attend gathered where read in place. */
TEST_F(kv, prefill_in_place_equals_reference_and_gathered)
{
	in_place_cases(_metadata, self, variant, true);
}

/* The same under APE_OCL_DEC_SHAPE=gpu: the OpenCL decode's work-group shape (GPU devices) on
 * this device, reading the blocks in place too. */
TEST_F(kv, decode_in_place_wg_shape_equals_reference)
{
	if (strcmp(variant->backend, "opencl"))
		SKIP(return, "APE_OCL_DEC_SHAPE concerns the OpenCL backend only");
	setenv("APE_OCL_DEC_SHAPE", "gpu", 1);
	in_place_cases(_metadata, self, variant, false);
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

TEST_HARNESS_MAIN
