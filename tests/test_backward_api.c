/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_backward() on the reference backend, the API's side of the call (the gradients
 * themselves against finite differences: tests/test_backward.c):
 *
 * - 16-bit storage against the same values stored as float32, within the spec's tolerances;
 * - strided tensors against contiguous ones, bit for bit, padding untouched;
 * - optional outputs left NULL, two runs bit-identical, the shapes that need no device;
 * - the statistics, the budget, chunked calls against one launch;
 * - every invalid argument: its code, its message, nothing written; APE_ENOMEM over the
 *   budget.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/problem.h"

REF_FIXTURE(rd)

/* ---------------------------------------------------------------- determinism and options */

/* Each subset of the outputs: the wanted ones bit for bit as with all four, the others
 * untouched; and two runs give the same bits. */
TEST_F(rd, optional_outputs_and_determinism)
{
	const test_problem_shape sh = { 2, 4, 2, 9, 11, 8 };
	ape_device *dev = self->dev;
	ape_rng rng;
	bcase c;
	grads full, again;

	ape_rng_init(&rng, "optional_outputs_and_determinism");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F32, false, true, dev));
	ASSERT_EQ(0, grads_alloc(&full, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
	ASSERT_EQ(0, run_backward(&c, dev, &full, W_ALL, NULL));
	ASSERT_EQ(0, run_backward(&c, dev, &again, W_ALL, NULL));
	EXPECT_TRUE(same_grads(&full, &again, W_ALL));
	for (unsigned w = 1; w < W_ALL; w++) {
		grads g, untouched;

		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&untouched, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, dev, &g, w, NULL));
		EXPECT_TRUE(same_grads(&g, &full, w));
		/* NaN-poisoned: bits equal only if never written */
		EXPECT_TRUE(same_grads(&g, &untouched, W_ALL & ~w)) TH_LOG("wanted 0x%x", w);
		grads_free(&g);
		grads_free(&untouched);
	}
	grads_free(&full);
	grads_free(&again);
	bcase_free(&c);
}

/* ---------------------------------------------------------------- storage and layouts */

/* f16 and bf16 storage (gradients in the storage type and in float32) against the same
 * values stored as float32, within the spec's tolerances. */
TEST_F(rd, storage_types)
{
	static const ape_dtype types[] = { APE_F16, APE_BF16 };
	const test_problem_shape sh = { 1, 4, 2, 13, 17, 16 };
	ape_device *dev = self->dev;
	ape_rng rng;

	ape_rng_init(&rng, "storage_types");
	for (int t = 0; t < 2; t++)
		for (int out_f32 = 0; out_f32 < 2; out_f32++) {
			ape_dtype gt = out_f32 ? APE_F32 : types[t];
			test_tensor q32, k32, v32, o32, dout32;
			grads g16, g32;
			bcase c;

			ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, types[t], false, true, dev));
			ASSERT_EQ(0, grads_widen(&q32, &c.tp.q));
			ASSERT_EQ(0, grads_widen(&k32, &c.tp.k));
			ASSERT_EQ(0, grads_widen(&v32, &c.tp.v));
			ASSERT_EQ(0, grads_widen(&o32, &c.tp.o));
			ASSERT_EQ(0, grads_widen(&dout32, &c.dout));
			ASSERT_EQ(0, grads_alloc(&g16, &c, gt));
			ASSERT_EQ(0, grads_alloc(&g32, &c, APE_F32));
			ASSERT_EQ(0, run_backward(&c, dev, &g16, W_ALL, NULL));
			ASSERT_EQ(0, ape_attention_backward(dev, &c.tp.desc, &q32.t, &k32.t, &v32.t,
							    &o32.t, c.tp.lse, &dout32.t, c.dlse,
							    &g32.dq.t, &g32.dk.t, &g32.dv.t,
							    g32.dparams, NULL));
			EXPECT_LE(grads_rel_err(&g16.dq.t, &g32.dq.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g16.dk.t, &g32.dk.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g16.dv.t, &g32.dv.t), grads_tol(types[t]));
			/* the same float64 computation: only the storing of the outputs differs */
			EXPECT_EQ(0, memcmp(g16.dparams, g32.dparams, sizeof(float) * 4 * sh.H));
			if (out_f32) /* nothing rounds differently at all */
				EXPECT_TRUE(same_grads(&g16, &g32, W_ALL));
			test_tensor_free(&q32);
			test_tensor_free(&k32);
			test_tensor_free(&v32);
			test_tensor_free(&o32);
			test_tensor_free(&dout32);
			grads_free(&g16);
			grads_free(&g32);
			bcase_free(&c);
		}
}

/* Padded [B, L, H, D] storage for a gradient: NaN where written, 0xff in the padding. */
static int strided_like(test_tensor *dst, const test_tensor *dense)
{
	return test_tensor_relayout(dst, dense, 3);
}

/* Strided inputs and outputs give the contiguous call's bits and leave the padding alone. */
TEST_F(rd, strided_tensors)
{
	const test_problem_shape sh = { 2, 4, 2, 7, 10, 8 };
	ape_device *dev = self->dev;
	test_tensor sdq, sdk, sdv, pristine;
	ape_rng rng;
	bcase c, cs;
	grads g;
	float *dp;

	ape_rng_init(&rng, "strided_tensors");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F32, false, true, dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, run_backward(&c, dev, &g, W_ALL, NULL));
	/* the same case with every tensor strided */
	memset(&cs, 0, sizeof(cs));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.q, &c.tp.q, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.k, &c.tp.k, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.v, &c.tp.v, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.o, &c.tp.o, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.dout, &c.dout, 3));
	ASSERT_EQ(0, strided_like(&sdq, &g.dq));
	ASSERT_EQ(0, strided_like(&sdk, &g.dk));
	ASSERT_EQ(0, strided_like(&sdv, &g.dv));
	ASSERT_EQ(0, strided_like(&pristine, &g.dq));
	dp = malloc(sizeof(float) * 4 * sh.H);
	ASSERT_NE(NULL, dp);
	test_tensor_poison(&sdq.t);
	test_tensor_poison(&sdk.t);
	test_tensor_poison(&sdv.t);
	test_tensor_poison(&pristine.t);
	ASSERT_EQ(0, ape_attention_backward(dev, &c.tp.desc, &cs.tp.q.t, &cs.tp.k.t, &cs.tp.v.t,
					    &cs.tp.o.t, c.tp.lse, &cs.dout.t, c.dlse, &sdq.t,
					    &sdk.t, &sdv.t, dp, NULL));
	EXPECT_EQ(0.0, test_max_err_o(&sdq.t, &g.dq.t));
	EXPECT_EQ(0.0, test_max_err_o(&sdk.t, &g.dk.t));
	EXPECT_EQ(0.0, test_max_err_o(&sdv.t, &g.dv.t));
	EXPECT_EQ(0, memcmp(dp, g.dparams, sizeof(float) * 4 * sh.H));
	/* every element NaN again: the whole allocation is then as it was, padding included */
	test_tensor_poison(&sdq.t);
	EXPECT_EQ(0, memcmp(sdq.alloc, pristine.alloc, sdq.alloc_bytes));
	test_tensor_free(&sdq);
	test_tensor_free(&sdk);
	test_tensor_free(&sdv);
	test_tensor_free(&pristine);
	test_tensor_free(&cs.tp.q);
	test_tensor_free(&cs.tp.k);
	test_tensor_free(&cs.tp.v);
	test_tensor_free(&cs.tp.o);
	test_tensor_free(&cs.dout);
	free(dp);
	grads_free(&g);
	bcase_free(&c);
}

/* ---------------------------------------------------------------- shapes without work */

static bool all_zero(const ape_tensor *t)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					if (test_tensor_get(t, b, h, l, d) != 0.0)
						return false;
	return true;
}

/* No keys, no queries, or no visible key at all: every gradient is exactly 0. */
TEST_F(rd, empty_and_invisible)
{
	static const test_problem_shape shapes[] = {
		{ 1, 2, 1, 5, 0, 4 }, /* Lk = 0 */
		{ 2, 2, 2, 0, 6, 4 }, /* Lq = 0 */
		{ 1, 2, 1, 4, 6, 4 }, /* every query before every key (causal) */
	};
	ape_device *dev = self->dev;
	ape_rng rng;

	ape_rng_init(&rng, "empty_and_invisible");
	for (int i = 0; i < 3; i++) {
		bcase c;
		grads g;
		ape_stats st;

		ASSERT_EQ(0, bcase_make(&c, &rng, &shapes[i], APE_F32, i == 2, true));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.causal = true;
		c.tp.desc.k_start = 100;
		c.tp.desc.q_start = 0;
		c.tp.desc.q_start_set = true;
		ASSERT_EQ(0, bcase_forward(&c, dev));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ape_stats_init(&st);
		ASSERT_EQ(0, run_backward(&c, dev, &g, W_ALL, &st));
		EXPECT_TRUE(all_zero(&g.dq.t));
		EXPECT_TRUE(all_zero(&g.dk.t));
		EXPECT_TRUE(all_zero(&g.dv.t));
		for (int64_t x = 0; x < 4 * shapes[i].H; x++)
			EXPECT_EQ(0.0f, g.dparams[x]);
		EXPECT_EQ(0u, st.pairs_visible);
		grads_free(&g);
		bcase_free(&c);
	}
}

/* ---------------------------------------------------------------- statistics and budget */

TEST_F(rd, statistics_and_budget)
{
	const test_problem_shape sh = { 1, 4, 2, 12, 20, 8 };
	ape_device *dev = self->dev;
	ape_exec_options eo;
	uint64_t visible, in_place_peak;
	ape_stats st;
	ape_rng rng;
	bcase c;
	grads g, fresh;

	ape_rng_init(&rng, "statistics_and_budget");
	ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, false));
	test_problem_random_params(&c.tp, &rng);
	c.tp.desc.q_start_set = false; /* end-aligned: some pair is visible, causal or not */
	ASSERT_EQ(0, bcase_forward(&c, dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&fresh, &c, APE_F32));
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, dev, &g, W_ALL, &st));
	ASSERT_EQ(0, ape_visible_pairs(&c.tp.desc, sh.B, sh.H, sh.Lq, sh.Lk, &visible));
	EXPECT_EQ(visible, st.pairs_visible);
	EXPECT_EQ(visible, st.pairs_computed);
	EXPECT_STREQ("ref", st.backend);
	EXPECT_EQ(1, st.devices);
	EXPECT_EQ(1u, st.chunks);
	/* one chunk each way: the reference reads the inputs where they lie (buf_wrap), so at most
	 * the pair counts go to the device */
	EXPECT_GE((uint64_t)(sh.B * sh.H * sh.Lq) * sizeof(uint64_t), st.bytes_to_device);
	EXPECT_LT(0u, st.bytes_from_device);
	EXPECT_LT(0u, st.peak_device_bytes);
	in_place_peak = st.peak_device_bytes;

	/* a budget too small for one row each way: refused before any work, saying what it
	 * needs; nothing written */
	ape_exec_options_init(&eo);
	eo.max_device_bytes = 100;
	EXPECT_EQ(APE_ENOMEM,
		  ape_attention_backward_ex(&dev, 1, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
					    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t, NULL,
					    &fresh.dq.t, &fresh.dk.t, &fresh.dv.t, fresh.dparams,
					    NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_backward_ex: ref:0 "));
	EXPECT_NE(NULL, strstr(ape_last_error(), "budget 100 bytes cannot hold the backward "
						 "pass's chunk of 1 query row and 1 key row"));
	for (int64_t i = 0; i < 4 * sh.H; i++)
		EXPECT_TRUE(isnan(fresh.dparams[i]));
	/* one byte short of the one-launch peak of a device that copies (buf_wrap hidden: in place,
	 * one launch holds only dparams and the pair counts): smaller chunks, within the budget */
	wrap_install(dev, WRAP_NO_BUF_WRAP);
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, dev, &fresh, W_ALL, &st));
	EXPECT_LT(in_place_peak, st.peak_device_bytes) TH_LOG("the inputs were copied before");
	eo.max_device_bytes = st.peak_device_bytes - 1;
	ape_stats_init(&st);
	EXPECT_EQ(0, ape_attention_backward_ex(&dev, 1, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
					       &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t, NULL,
					       &fresh.dq.t, &fresh.dk.t, &fresh.dv.t,
					       fresh.dparams, &st));
	wrap_remove();
	EXPECT_LT(1u, st.chunks);
	EXPECT_LE(st.peak_device_bytes, eo.max_device_bytes);
	EXPECT_EQ(eo.max_device_bytes, st.device_budget);
	EXPECT_LE(grads_rel_err(&fresh.dq.t, &g.dq.t), CHUNK_TOL);
	EXPECT_LE(grads_rel_err(&fresh.dk.t, &g.dk.t), CHUNK_TOL);
	EXPECT_LE(grads_rel_err(&fresh.dv.t, &g.dv.t), CHUNK_TOL);
	EXPECT_LE(grads_rel_err_params(fresh.dparams, g.dparams, sh.H), CHUNK_TOL);
	grads_free(&g);
	grads_free(&fresh);
	bcase_free(&c);
}

/* Chunks of every size across the borders of the rows give the one-launch result, the same
 * bits twice, and launch only the chunk pairs the mask lets through. */
TEST_F(rd, chunked_matches_one_launch)
{
	static const int64_t sizes[][2] = { { 1, 1 }, { 3, 5 }, { 4, 4 }, { 7, 16 }, { 13, 2 } };
	const test_problem_shape sh = { 2, 4, 2, 13, 17, 8 };
	ape_device *dev = self->dev;
	ape_rng rng;

	ape_rng_init(&rng, "chunked_matches_one_launch");
	for (int i = 0; i < 5; i++) {
		const int64_t cq = sizes[i][0], ck = sizes[i][1];
		int64_t pairs = 0;
		ape_stats st;
		bcase c;
		grads one, g, again;

		ASSERT_EQ(0, bcase_make(&c, &rng, &sh, i == 3 ? APE_BF16 : APE_F32, i % 2,
					i != 2));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.causal = i != 4;
		ASSERT_EQ(0, bcase_forward(&c, dev));
		ASSERT_EQ(0, grads_alloc(&one, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, dev, &one, W_ALL, NULL));
		ape_stats_init(&st);
		ASSERT_EQ(0, run_chunked(&c, dev, &g, cq, ck, &st));
		ASSERT_EQ(0, run_chunked(&c, dev, &again, cq, ck, NULL));
		EXPECT_TRUE(same_grads(&g, &again, W_ALL));
		EXPECT_LE(grads_rel_err(&g.dq.t, &one.dq.t), CHUNK_TOL);
		EXPECT_LE(grads_rel_err(&g.dk.t, &one.dk.t), CHUNK_TOL);
		EXPECT_LE(grads_rel_err(&g.dv.t, &one.dv.t), CHUNK_TOL);
		EXPECT_LE(grads_rel_err_params(g.dparams, one.dparams, sh.H), CHUNK_TOL);
		/* chunk pairs with a visible (query, key) pair */
		for (int64_t i0 = 0; i0 < sh.Lq; i0 += cq)
			for (int64_t j0 = 0; j0 < sh.Lk; j0 += ck) {
				int64_t last = i0 + cq < sh.Lq ? i0 + cq - 1 : sh.Lq - 1;

				pairs += !c.tp.desc.causal ||
					 c.tp.q_start + last >= c.tp.desc.k_start + j0;
			}
		EXPECT_EQ((uint64_t)pairs, st.chunks);
		EXPECT_EQ(cq, st.chunk_q);
		EXPECT_EQ(ck, st.chunk_k);
		grads_free(&one);
		grads_free(&g);
		grads_free(&again);
		bcase_free(&c);
	}
}

/* ---------------------------------------------------------------- invalid arguments */

/* The arguments of one call, each replaceable. */
typedef struct bargs {
	ape_device *dev;
	const ape_attn_desc *desc;
	const ape_tensor *q, *k, *v, *o, *dout;
	const float *lse, *dlse;
	ape_tensor *dq, *dk, *dv;
	float *dparams;
	ape_stats *stats;
} bargs;

static int call(const bargs *a)
{
	return ape_attention_backward(a->dev, a->desc, a->q, a->k, a->v, a->o, a->lse, a->dout,
				      a->dlse, a->dq, a->dk, a->dv, a->dparams, a->stats);
}

#define EXPECT_REFUSED(args, code, text)                                                           \
	do {                                                                                       \
		grads_snapshot snap_;                                                              \
		grads_snap(&snap_, &g);                                                            \
		EXPECT_EQ(code, call(&(args)));                                                    \
		EXPECT_NE(NULL, strstr(ape_last_error(), text)) TH_LOG("%s", ape_last_error());    \
		EXPECT_TRUE(grads_unchanged(&snap_, &g));                                          \
	} while (0)

TEST_F(rd, invalid_arguments)
{
	const test_problem_shape sh = { 1, 4, 2, 6, 8, 8 };
	ape_device *dev = self->dev;
	ape_tensor bad;
	ape_attn_desc d;
	ape_stats st;
	ape_rng rng;
	bcase c;
	grads g;
	bargs ok, a;
	float neg = -1.0f;

	ape_rng_init(&rng, "invalid_arguments");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F16, false, true, dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F16));
	ok = (bargs){ dev,     &c.tp.desc, &c.tp.q.t, &c.tp.k.t, &c.tp.v.t, &c.tp.o.t,
		      &c.dout.t, c.tp.lse,  c.dlse,    &g.dq.t,   &g.dk.t,   &g.dv.t,
		      g.dparams, NULL };

	a = ok, a.dev = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: dev = NULL");
	a = ok, a.desc = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: desc = NULL");
	d = c.tp.desc, d.lambda.per_head = NULL, d.lambda.value = neg;
	a = ok, a.desc = &d;
	EXPECT_REFUSED(a, APE_EINVAL, "desc->lambda.value = -1: must be >= 0");
	a = ok, a.q = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: q = NULL");
	a = ok, a.o = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: o = NULL");
	a = ok, a.lse = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "lse = NULL: the backward pass needs the forward's LSE");
	a = ok, a.dout = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: dout = NULL");
	a = ok, a.dq = NULL, a.dk = NULL, a.dv = NULL, a.dparams = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "dq, dk, dv, dparams and desc->dbias_table are all NULL");

	bad = g.dq.t, bad.shape[2] = sh.Lq + 1;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq->shape[2] = 7: must equal Lq = 6");
	bad = g.dk.t, bad.shape[1] = 4;
	a = ok, a.dk = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dk->shape[1] = 4: must equal Hkv = 2");
	bad = g.dv.t, bad.dtype = APE_BF16;
	a = ok, a.dv = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dv->dtype = bf16: must be f16 or f32");
	bad = c.dout.t, bad.dtype = (ape_dtype)7;
	a = ok, a.dout = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dout->dtype = 7: not a libape storage type");
	bad = c.dout.t, bad.shape[3] = 4;
	a = ok, a.dout = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dout->shape[3] = 4: must equal D = 8");
	bad = g.dq.t, bad.strides[0] = 1, bad.strides[1] = 1, bad.strides[2] = 1,
	bad.strides[3] = 1;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq->strides[");
	EXPECT_NE(NULL, strstr(ape_last_error(), "output elements would overlap"));
	bad = g.dq.t, bad.data = NULL;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq->data = NULL");

	/* outputs overlapping inputs or each other */
	bad = g.dk.t, bad.data = c.tp.k.t.data;
	a = ok, a.dk = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dk overlaps k in memory");
	bad = g.dq.t, bad.data = c.dout.t.data;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq overlaps dout in memory");
	bad = g.dv.t, bad.data = g.dk.t.data;
	a = ok, a.dv = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dv overlaps dk in memory");
	a = ok, a.dparams = c.tp.lse;
	EXPECT_REFUSED(a, APE_EINVAL, "dparams overlaps lse in memory");
	a = ok, a.dparams = c.dlse + 1;
	EXPECT_REFUSED(a, APE_EINVAL, "dparams overlaps dlse in memory");
	a = ok, a.dparams = (float *)g.dq.t.data;
	EXPECT_REFUSED(a, APE_EINVAL, "dparams overlaps dq in memory");

	/* the stats and the _ex options */
	ape_stats_init(&st);
	st.struct_size = 3;
	a = ok, a.stats = &st;
	EXPECT_REFUSED(a, APE_EINVAL, "stats->struct_size = 3");
	{
		ape_device *two[2] = { dev, dev };
		ape_exec_options eo;
		grads_snapshot s;

		ape_exec_options_init(&eo);
		grads_snap(&s, &g);
		/* several devices are validated as the forward's are */
		eo.device_weights = (const double[]){ 1, 0 };
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 2, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(),
				       "ape_attention_backward_ex: opts->device_weights[1] = 0: "
				       "must be finite and > 0"))
			TH_LOG("%s", ape_last_error());
		eo.device_weights = NULL;
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 0, NULL, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "ndev = 0"));
		eo.trace_path = "/nonexistent-dir-of-ape/x.json";
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 2, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(),
				       "opts->trace_path = \"/nonexistent-dir-of-ape/x.json\": "
				       "directory /nonexistent-dir-of-ape/ does not exist"))
			TH_LOG("%s", ape_last_error());
		eo.trace_path = NULL;
		eo.pipeline_depth = 9;
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 1, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "opts->pipeline_depth = 9"));
		EXPECT_TRUE(grads_unchanged(&s, &g));
	}
	/* and the valid call, for contrast */
	EXPECT_EQ(0, call(&ok)) TH_LOG("%s", ape_last_error());
	grads_free(&g);
	bcase_free(&c);
}

TEST_HARNESS_MAIN
