/* SPDX-License-Identifier: MIT */
/*
 * Distance-bias tables (ape_attn_desc.bias_table, docs/ape.md "Distance-bias tables") on every
 * backend: the forward against tests/common/naive.c's independent evaluation on random tables
 * (T5 buckets, a Gaussian, tables that fall and rise again far away, random values; shorter
 * and longer than the distances; per head and shared), every storage type, GQA, causal and
 * not, both layouts, in one launch and in small chunks; skipping stays exact when a table
 * rises far away and still skips under a flat one; a shared [1, M] table is its per-head copy
 * bit for bit; the diagnostics, the KV cache, ragged batches and device tensors see the table;
 * the backward (dq, dk, dv, dparams and the table's gradient) against the reference, and the
 * reference's table gradient against central differences of the long-double evaluation; bad
 * tables refused naming the field, writing nothing; a desc of the third layout reads no table.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/naive.h"
#include "common/problem.h"
#include "common/resident.h"
#include "common/testutil.h"
/* decode() and cache_options() of the KV-cache tests' pieces (the rest is theirs) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "kvcache_case.h"
#pragma GCC diagnostic pop

BACKEND_FIXTURE(dev)

/* tp on dev against the oracle; 0 or -1 (logged). */
static int check_naive(struct __test_metadata *_metadata, ape_device *dev, test_problem *tp,
		       const char *what)
{
	double eo, el;
	char desc[512];

	if (test_problem_run(tp, dev)) {
		TH_LOG("%s: forward failed: %s", what, ape_last_error());
		return -1;
	}
	if (test_problem_naive(tp)) {
		TH_LOG("%s: out of memory", what);
		return -1;
	}
	eo = test_problem_err_o(tp) / fmax(1.0, test_tensor_maxabs(&tp->v.t));
	el = test_problem_rel_err_lse(tp);
	if (eo <= test_tol_o(tp->q.t.dtype) + test_skip_tol_o(tp->desc.skip_tol) &&
	    el <= test_tol_lse(tp->q.t.dtype) + test_skip_tol_lse(tp->desc.skip_tol))
		return 0;
	test_problem_describe(tp, desc, sizeof(desc));
	TH_LOG("%s: %s, table %lld x %lld: O error %.3g, LSE error %.3g", what, desc,
	       (long long)tp->desc.bias_table_heads, (long long)tp->desc.bias_table_len, eo, el);
	return -1;
}

/* tp's O and LSE (already computed) against the oracle at tp's resolved positions. */
static int check_result(struct __test_metadata *_metadata, test_problem *tp, const char *what)
{
	double eo, el;

	tp->q_start = tp->desc.q_start_set ? tp->desc.q_start
					   : tp->desc.k_start + tp->k.t.shape[2] - tp->q.t.shape[2];
	if (test_problem_naive(tp))
		return -1;
	eo = test_problem_err_o(tp) / fmax(1.0, test_tensor_maxabs(&tp->v.t));
	el = tp->lse ? test_problem_rel_err_lse(tp) : 0;
	if (eo <= test_tol_o(tp->q.t.dtype) + test_skip_tol_o(tp->desc.skip_tol) &&
	    el <= test_tol_lse(tp->q.t.dtype) + test_skip_tol_lse(tp->desc.skip_tol))
		return 0;
	TH_LOG("%s: O error %.3g, LSE error %.3g", what, eo, el);
	return -1;
}

/* A random problem (small on the emulator) with a random table. */
static int table_problem(test_problem *tp, ape_rng *r, bool emu)
{
	if (emu) {
		const test_problem_shape sh = { 1, 2, 1, ape_rng_range(r, 1, 40),
						ape_rng_range(r, 1, 70), 2 * ape_rng_range(r, 1, 40) };

		if (test_problem_make(tp, r, &sh, ape_rng_range(r, 0, 1) ? APE_F16 : APE_F32, false))
			return -1;
		test_problem_random_params(tp, r);
	} else if (test_problem_random(tp, r, 0)) {
		return -1;
	}
	return test_problem_random_table(tp, r);
}

TEST_F(dev, forward_equals_the_oracle)
{
	const int cases = self->emu || ape_test_slow() ? 8 : 60;
	int failed = 0;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		test_problem tp;

		ASSERT_EQ(0, table_problem(&tp, &rng, self->emu));
		failed += check_naive(_metadata, self->dev, &tp, "one call") != 0;
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, failed);
}

/* Small key and query chunks: the streaming executor's launches and merges, each with the
 * table at its own distances. */
TEST_F(dev, forward_in_small_chunks)
{
	const int cases = self->emu || ape_test_slow() ? 3 : 12;
	int failed = 0;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		test_problem tp;
		ape_exec_options opts;

		ASSERT_EQ(0, table_problem(&tp, &rng, self->emu));
		ape_exec_options_init(&opts);
		opts.chunk_q = ape_rng_range(&rng, 1, 17);
		opts.chunk_k = ape_rng_range(&rng, 1, 23);
		ASSERT_EQ(0, ape_attention_forward_ex(&self->dev, 1, &opts, &tp.desc, &tp.q.t,
						      &tp.k.t, &tp.v.t, &tp.o.t, tp.lse, NULL))
		TH_LOG("%s", ape_last_error());
		failed += check_result(_metadata, &tp, "chunks") != 0;
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, failed);
}

/* A decayed problem of one query row per position and many keys; rise: the table's far end
 * (distances >= far) in units of the decay there (0: a flat zero table). */
static int far_problem(test_problem *tp, ape_rng *r, int64_t Lq, int64_t Lk, double rise)
{
	const test_problem_shape sh = { 1, 2, 1, Lq, Lk, 32 };
	const int64_t M = Lk + 1, far = Lk * 3 / 4;
	float *t = malloc(sizeof(float) * (size_t)(2 * M));

	if (!t || test_problem_make(tp, r, &sh, APE_F32, false)) {
		free(t);
		return -1;
	}
	test_problem_set_params(tp, 0.4, 0.1, 0.1, 0.3);
	tp->desc.skip_tol = 0x1p-24;
	for (int64_t h = 0; h < 2; h++)
		for (int64_t m = 0; m < M; m++) /* makes the far keys outweigh the near ones */
			t[h * M + m] = m >= far ? (float)(rise * (0.4 * (double)m + 3)) : 0.0f;
	tp->bias_table = t;
	tp->desc.bias_table = t;
	tp->desc.bias_table_len = M;
	tp->desc.bias_table_heads = 2;
	return 0;
}

TEST_F(dev, skipping_stays_exact_when_a_table_rises_far_away)
{
	const int64_t Lq = self->emu ? 2 : 5, Lk = self->emu ? 300 : 1500;
	ape_rng rng;
	test_problem tp;
	ape_stats st, none;
	ape_exec_options opts;

	ape_rng_init(&rng, _metadata->name);
	/* flat: the decay alone decides; the table leaves the skipping as it is without one */
	ASSERT_EQ(0, far_problem(&tp, &rng, Lq, Lk, 0.0));
	ape_stats_init(&st);
	ASSERT_EQ(0, test_problem_run_stats(&tp, self->dev, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, check_naive(_metadata, self->dev, &tp, "flat table"));
	tp.desc.bias_table = NULL;
	ape_stats_init(&none);
	ASSERT_EQ(0, test_problem_run_stats(&tp, self->dev, &none)) TH_LOG("%s", ape_last_error());
	EXPECT_LE(st.pairs_computed, none.pairs_computed + none.pairs_computed / 20)
	TH_LOG("a flat table: %llu pairs computed, without it %llu (of %llu)",
	       (unsigned long long)st.pairs_computed, (unsigned long long)none.pairs_computed,
	       (unsigned long long)st.pairs_visible);
	test_problem_free(&tp);
	/* rising: the far keys dominate; a bound without the table's maximum would drop them */
	ASSERT_EQ(0, far_problem(&tp, &rng, Lq, Lk, 1.0));
	EXPECT_EQ(0, check_naive(_metadata, self->dev, &tp, "rising table"));
	/* in key chunks: the executor's own chunk bound (exec/skip.c) must count it too */
	ape_exec_options_init(&opts);
	opts.chunk_k = 64;
	ASSERT_EQ(0, ape_attention_forward_ex(&self->dev, 1, &opts, &tp.desc, &tp.q.t, &tp.k.t,
					      &tp.v.t, &tp.o.t, tp.lse, NULL))
	TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, check_result(_metadata, &tp, "rising table, key chunks of 64"));
	test_problem_free(&tp);
}

TEST_F(dev, a_shared_table_is_its_per_head_copy)
{
	ape_rng rng;
	test_problem a, b;
	float *rows;
	int64_t M, H;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, table_problem(&a, &rng, self->emu));
	/* one row, then the same row for every head */
	a.desc.bias_table_heads = 1;
	M = a.desc.bias_table_len;
	H = a.q.t.shape[1];
	ASSERT_EQ(0, test_problem_clone(&b, &a));
	rows = malloc(sizeof(float) * (size_t)(H * M));
	ASSERT_NE(NULL, rows);
	for (int64_t h = 0; h < H; h++)
		memcpy(rows + h * M, a.bias_table, sizeof(float) * (size_t)M);
	free(b.bias_table);
	b.bias_table = rows;
	b.desc.bias_table = rows;
	b.desc.bias_table_heads = H;
	ASSERT_EQ(0, test_problem_run(&a, self->dev)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, test_problem_run(&b, self->dev)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, bits_differing(&a, &b));
	test_problem_free(&a);
	test_problem_free(&b);
}

TEST_F(dev, diagnostics_see_the_table)
{
	ape_rng rng;
	test_problem tp;
	float *ent, *md;
	double worst_e = 0, worst_m = 0;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, table_problem(&tp, &rng, self->emu));
	if (!tp.lse) {
		tp.lse = malloc(sizeof(float) * (tp.rows + 1));
		ASSERT_NE(NULL, tp.lse);
	}
	ent = malloc(sizeof(float) * (tp.rows + 1));
	md = malloc(sizeof(float) * (tp.rows + 1));
	ASSERT_NE(NULL, ent);
	ASSERT_NE(NULL, md);
	ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &tp.desc, &tp.q.t, &tp.k.t,
						&tp.v.t, &tp.o.t, tp.lse, ent, md, NULL))
	TH_LOG("%s", ape_last_error());
	tp.q_start = tp.desc.q_start_set ? tp.desc.q_start
					 : tp.desc.k_start + tp.k.t.shape[2] - tp.q.t.shape[2];
	ASSERT_EQ(0, test_problem_naive(&tp));
	for (size_t i = 0; i < tp.rows; i++) {
		worst_e = fmax(worst_e, fabs(ent[i] - tp.naive_ent[i]));
		worst_m = fmax(worst_m, fabs(md[i] - tp.naive_md[i]) / fmax(1.0, tp.naive_mdmax[i]));
	}
	/* float32 kernels: a few 1e-4 in entropy; mean distance relative to the farthest key */
	EXPECT_LE(worst_e, 2e-3);
	EXPECT_LE(worst_m, 2e-3);
	free(ent);
	free(md);
	test_problem_free(&tp);
}

TEST_F(dev, kv_cache_decode_sees_the_table)
{
	const test_problem_shape sh = { 1, 4, 2, self->emu ? 24 : 90, self->emu ? 24 : 90, 32 };
	ape_rng rng;
	test_problem tp;
	ape_kv_cache *c = NULL;
	ape_kv_cache_options o;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_set_params(&tp, 0.05, 0.2, 0.1, 0.4);
	tp.desc.causal = true;
	ASSERT_EQ(0, test_problem_random_table(&tp, &rng));
	o = cache_options(&tp, 16, sh.Lk);
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &c)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, decode(&tp, c, 1, NULL)) TH_LOG("%s", ape_last_error());
	tp.q_start = tp.desc.k_start;
	ASSERT_EQ(0, test_problem_naive(&tp));
	EXPECT_LE(test_problem_err_o(&tp) / fmax(1.0, test_tensor_maxabs(&tp.v.t)),
		  test_tol_o(APE_F32) + test_skip_tol_o(tp.desc.skip_tol));
	ape_kv_cache_destroy(c);
	test_problem_free(&tp);
}

/*
 * Decode under strong decay with a table that favours the oldest keys: the KV cache's and the
 * pool's window (the oldest pages proved negligible by the decay alone, left out before the
 * attend) must keep them. One query row, the newest, against every key.
 */
TEST_F(dev, decode_windows_keep_far_keys_a_table_favours)
{
	const int64_t L = self->emu ? 160 : 640, M = L + 1;
	const test_problem_shape sh = { 1, 2, 1, L, L, 32 };
	ape_rng rng;
	test_problem tp;
	float *t = malloc(sizeof(float) * (size_t)(2 * M));
	ape_kv_cache *c = NULL;
	ape_kv_cache_options o;

	ASSERT_NE(NULL, t);
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_set_params(&tp, 0.4, 0.0, 0.0, 0.0);
	tp.desc.causal = true;
	for (int64_t h = 0; h < 2; h++) /* the oldest tenth of the keys outweighs the decay */
		for (int64_t m = 0; m < M; m++)
			t[h * M + m] = m >= L - L / 10 ? (float)(0.4 * (double)m + 2) : 0.0f;
	tp.bias_table = t;
	tp.desc.bias_table = t;
	tp.desc.bias_table_len = M;
	tp.desc.bias_table_heads = 2;
	/* the cache: blocks of 16, the keys in chunks, then every row decoded in steps */
	o = cache_options(&tp, 16, L);
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &o, &c)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, decode(&tp, c, 16, NULL)) TH_LOG("%s", ape_last_error());
	tp.q_start = tp.desc.k_start;
	ASSERT_EQ(0, test_problem_naive(&tp));
	EXPECT_LE(test_problem_err_o(&tp) / fmax(1.0, test_tensor_maxabs(&tp.v.t)),
		  test_tol_o(APE_F32) + test_skip_tol_o(tp.desc.skip_tol))
	TH_LOG("the KV cache");
	ape_kv_cache_destroy(c);
	/* the pool: one sequence of every key, its newest row attended */
	{
		const int64_t cu[2] = { 0, 1 };
		ape_kv_pool_options po;
		ape_kv_pool *pool = NULL;
		ape_tensor qt, ot, kt, vt;
		float orow[2 * 32], lse[2];
		int64_t sid;
		double err = 0;

		ape_kv_pool_options_init(&po);
		po.Hkv = 1;
		po.H = 2;
		po.D = 32;
		po.dtype = APE_F32;
		po.capacity_tokens = L;
		ASSERT_EQ(0, ape_kv_pool_create(self->dev, &po, &pool)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_kv_pool_add_sequence(pool, 0, &sid));
		kt = test_rows(&tp.k.t, 0, L);
		vt = test_rows(&tp.v.t, 0, L);
		ASSERT_EQ(0, ape_kv_pool_append(pool, sid, &kt, &vt)) TH_LOG("%s", ape_last_error());
		/* the newest row as a packed [1, H, D] token: q is [1, H, L, D], so copy it */
		{
			float qrow[2 * 32];

			for (int64_t h = 0; h < 2; h++)
				for (int64_t d = 0; d < 32; d++)
					qrow[h * 32 + d] = (float)test_tensor_get(&tp.q.t, 0, h, L - 1, d);
			ape_tensor_init_packed(&qt, qrow, APE_F32, 1, 2, 32);
			ape_tensor_init_packed(&ot, orow, APE_F32, 1, 2, 32);
			ASSERT_EQ(0, ape_kv_pool_attend(pool, &tp.desc, 1, &sid, cu, NULL, &qt, &ot, lse,
							NULL))
			TH_LOG("%s", ape_last_error());
		}
		for (int64_t h = 0; h < 2; h++)
			for (int64_t d = 0; d < 32; d++)
				err = fmax(err, fabs(orow[h * 32 + d] -
						     tp.naive_o[((size_t)h * L + (size_t)(L - 1)) * 32 + d]));
		EXPECT_LE(err / fmax(1.0, test_tensor_maxabs(&tp.v.t)),
			  test_tol_o(APE_F32) + test_skip_tol_o(tp.desc.skip_tol))
		TH_LOG("the pool");
		ape_kv_pool_destroy(pool);
	}
	test_problem_free(&tp);
}

/* Three sequences of different lengths packed: each one's rows are the dense call's on it. */
TEST_F(dev, ragged_batches_see_the_table)
{
	const int64_t H = 2, D = 16, lq[3] = { 5, 1, 17 }, lk[3] = { 9, 30, 17 };
	int64_t cuq[4] = { 0 }, cuk[4] = { 0 };
	float *q, *k, *v, *o, *od, *lse, *lsed;
	ape_tensor qt, kt, vt, ot;
	ape_attn_desc d;
	ape_varlen vl;
	ape_rng rng;
	float table[2 * 12];

	ape_rng_init(&rng, _metadata->name);
	for (int s = 0; s < 3; s++) {
		cuq[s + 1] = cuq[s] + lq[s];
		cuk[s + 1] = cuk[s] + lk[s];
	}
	q = malloc(sizeof(float) * (size_t)(cuq[3] * H * D));
	k = malloc(sizeof(float) * (size_t)(cuk[3] * H * D));
	v = malloc(sizeof(float) * (size_t)(cuk[3] * H * D));
	o = malloc(sizeof(float) * (size_t)(cuq[3] * H * D));
	od = malloc(sizeof(float) * (size_t)(cuq[3] * H * D));
	lse = malloc(sizeof(float) * (size_t)(cuq[3] * H));
	lsed = malloc(sizeof(float) * (size_t)(cuq[3] * H));
	ASSERT_TRUE(q && k && v && o && od && lse && lsed);
	for (int64_t i = 0; i < cuq[3] * H * D; i++)
		q[i] = (float)ape_rng_normal(&rng);
	for (int64_t i = 0; i < cuk[3] * H * D; i++) {
		k[i] = (float)ape_rng_normal(&rng);
		v[i] = (float)ape_rng_normal(&rng);
	}
	for (int i = 0; i < 24; i++)
		table[i] = (float)ape_rng_normal(&rng);
	ape_attn_desc_init(&d);
	d.delta.value = 0.1f;
	d.lambda.value = 0.5f;
	d.bias_table = table;
	d.bias_table_len = 12;
	d.bias_table_heads = H;
	ape_varlen_init(&vl);
	vl.num_seqs = 3;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	ape_tensor_init_packed(&qt, q, APE_F32, cuq[3], H, D);
	ape_tensor_init_packed(&kt, k, APE_F32, cuk[3], H, D);
	ape_tensor_init_packed(&vt, v, APE_F32, cuk[3], H, D);
	ape_tensor_init_packed(&ot, o, APE_F32, cuq[3], H, D);
	ASSERT_EQ(0, ape_attention_forward_varlen(self->dev, &d, &vl, &qt, &kt, &vt, &ot, lse, NULL))
	TH_LOG("%s", ape_last_error());
	for (int s = 0; s < 3; s++) {
		ape_tensor qs, ks, vs, os;
		float *ls = malloc(sizeof(float) * (size_t)(H * lq[s]));

		ASSERT_NE(NULL, ls);
		ape_tensor_init_packed(&qs, q + cuq[s] * H * D, APE_F32, lq[s], H, D);
		ape_tensor_init_packed(&ks, k + cuk[s] * H * D, APE_F32, lk[s], H, D);
		ape_tensor_init_packed(&vs, v + cuk[s] * H * D, APE_F32, lk[s], H, D);
		ape_tensor_init_packed(&os, od + cuq[s] * H * D, APE_F32, lq[s], H, D);
		ASSERT_EQ(0, ape_attention_forward(self->ref, &d, &qs, &ks, &vs, &os, ls, NULL))
		TH_LOG("%s", ape_last_error());
		for (int64_t h = 0; h < H; h++) /* [H, L] to packed [L, H] */
			for (int64_t i = 0; i < lq[s]; i++)
				lsed[(cuq[s] + i) * H + h] = ls[h * lq[s] + i];
		free(ls);
	}
	{
		double eo = 0, el = 0;

		for (int64_t x = 0; x < cuq[3] * H * D; x++)
			eo = fmax(eo, fabs(o[x] - od[x]));
		for (int64_t x = 0; x < cuq[3] * H; x++)
			el = fmax(el, fabs(lse[x] - lsed[x]) / fmax(1.0, fabs(lsed[x])));
		EXPECT_LE(eo, 1e-4);
		EXPECT_LE(el, 1e-4);
	}
	free(q);
	free(k);
	free(v);
	free(o);
	free(od);
	free(lse);
	free(lsed);
}

TEST_F(dev, device_tensors_see_the_table)
{
	const int cases = self->emu ? 2 : 6;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		test_problem tp;

		ASSERT_EQ(0, table_problem(&tp, &rng, self->emu));
		ASSERT_EQ(0, run_resident(&tp, self->dev, 64)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, check_result(_metadata, &tp, "device tensors"));
		test_problem_free(&tp);
	}
}

/* ---- the backward pass */

/* A backward case with a random table, its forward on the reference (so that every device's
 * backward reads the same O and LSE). */
static int bwd_case(bcase *c, ape_rng *r, bool emu, ape_device *ref)
{
	const test_problem_shape sh = { emu ? 1 : ape_rng_range(r, 1, 2), 4, 2,
					emu ? ape_rng_range(r, 1, 24) : ape_rng_range(r, 1, 70),
					emu ? ape_rng_range(r, 1, 30) : ape_rng_range(r, 1, 90),
					2 * ape_rng_range(r, 1, emu ? 16 : 40) };
	const ape_dtype dts[] = { APE_F32, APE_F16, APE_BF16 };

	/* with dLSE always: without it a row's dS sum to 0, and a table whose every distance
	 * reads one entry has a gradient of rounding noise alone (no relative error exists) */
	if (bcase_make(c, r, &sh, dts[ape_rng_range(r, 0, 2)], ape_rng_uniform(r) < 0.3, true))
		return -1;
	test_problem_random_params(&c->tp, r);
	if (test_problem_random_table(&c->tp, r))
		return -1;
	return bcase_forward(c, ref);
}

/* Rows of tp's table times its length: the gradient's size. */
static size_t table_size(const test_problem *tp)
{
	return (size_t)(tp->desc.bias_table_heads * tp->desc.bias_table_len);
}

/* max |a - b| / max |b| over n floats (a NaN in a counts as infinite). */
static double rel_err(const float *a, const float *b, size_t n)
{
	double e = 0, m = 1e-30;

	for (size_t i = 0; i < n; i++) {
		e = isnan(a[i]) ? INFINITY : fmax(e, fabs((double)a[i] - b[i]));
		m = fmax(m, fabs(b[i]));
	}
	return e / m;
}

TEST_F(dev, backward_equals_the_reference)
{
	const int cases = self->emu || ape_test_slow() ? 3 : 16;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		bcase bc;
		grads g[2];
		float *db[2];
		size_t nt;

		ASSERT_EQ(0, bwd_case(&bc, &rng, self->emu, self->ref)) TH_LOG("%s", ape_last_error());
		nt = table_size(&bc.tp);
		for (int w = 0; w < 2; w++) {
			ASSERT_EQ(0, grads_alloc(&g[w], &bc, APE_F32));
			db[w] = malloc(sizeof(float) * nt);
			ASSERT_NE(NULL, db[w]);
			for (size_t i = 0; i < nt; i++)
				db[w][i] = NAN;
			bc.tp.desc.dbias_table = db[w];
			ASSERT_EQ(0, run_backward(&bc, w ? self->ref : self->dev, &g[w], W_ALL, NULL))
			TH_LOG("%s", ape_last_error());
		}
		{
			const double tol = grads_tol(bc.tp.q.t.dtype);
			char desc[512];

			test_problem_describe(&bc.tp, desc, sizeof(desc));
			EXPECT_LE(grads_rel_err(&g[0].dq.t, &g[1].dq.t), tol) TH_LOG("dq: %s", desc);
			EXPECT_LE(grads_rel_err(&g[0].dk.t, &g[1].dk.t), tol) TH_LOG("dk: %s", desc);
			EXPECT_LE(grads_rel_err(&g[0].dv.t, &g[1].dv.t), tol) TH_LOG("dv: %s", desc);
			EXPECT_LE(grads_rel_err_params(g[0].dparams, g[1].dparams, g[0].H), tol)
			TH_LOG("dparams: %s", desc);
			EXPECT_LE(rel_err(db[0], db[1], nt), tol)
			TH_LOG("dbias_table (%lld x %lld): %s", (long long)bc.tp.desc.bias_table_heads,
			       (long long)bc.tp.desc.bias_table_len, desc);
		}
		for (int w = 0; w < 2; w++) {
			grads_free(&g[w]);
			free(db[w]);
		}
		bcase_free(&bc);
	}
}

/* The table's gradient alone, twice: the same bits (fixed-order sums); and with a shared table
 * it is the per-head gradients summed over the heads. */
TEST_F(dev, table_gradient_is_deterministic_and_sums_shared_rows)
{
	ape_rng rng;
	bcase bc;
	grads g;
	float *a, *b, *per_head;
	int64_t H, M;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, bwd_case(&bc, &rng, self->emu, self->ref)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, grads_alloc(&g, &bc, APE_F32));
	H = bc.tp.q.t.shape[1];
	M = bc.tp.desc.bias_table_len;
	/* a shared table: row 0 for every head */
	bc.tp.desc.bias_table_heads = 1;
	ASSERT_EQ(0, bcase_forward(&bc, self->ref));
	a = malloc(sizeof(float) * (size_t)M);
	b = malloc(sizeof(float) * (size_t)M);
	per_head = malloc(sizeof(float) * (size_t)(H * M));
	ASSERT_TRUE(a && b && per_head);
	bc.tp.desc.dbias_table = a;
	ASSERT_EQ(0, run_backward(&bc, self->dev, &g, 0, NULL)) TH_LOG("%s", ape_last_error());
	bc.tp.desc.dbias_table = b;
	ASSERT_EQ(0, run_backward(&bc, self->dev, &g, 0, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(a, b, sizeof(float) * (size_t)M));
	/* the same row copied per head: each head's own gradient */
	{
		float *rows = malloc(sizeof(float) * (size_t)(H * M));
		double e = 0, m = 1e-30;

		ASSERT_NE(NULL, rows);
		for (int64_t h = 0; h < H; h++)
			memcpy(rows + h * M, bc.tp.bias_table, sizeof(float) * (size_t)M);
		bc.tp.desc.bias_table = rows;
		bc.tp.desc.bias_table_heads = H;
		bc.tp.desc.dbias_table = per_head;
		ASSERT_EQ(0, run_backward(&bc, self->dev, &g, 0, NULL))
		TH_LOG("%s", ape_last_error());
		for (int64_t x = 0; x < M; x++) {
			double sum = 0;

			for (int64_t h = 0; h < H; h++)
				sum += per_head[h * M + x];
			e = fmax(e, fabs(sum - a[x]));
			m = fmax(m, fabs(a[x]));
		}
		EXPECT_LE(e / m, 1e-5);
		bc.tp.desc.bias_table = bc.tp.bias_table;
		free(rows);
	}
	free(a);
	free(b);
	free(per_head);
	grads_free(&g);
	bcase_free(&bc);
}

/* The loss sum(dO . O) + sum(dLSE . LSE) from the long-double evaluation. */
static long double naive_loss(bcase *c)
{
	const test_problem *tp = &c->tp;
	const int64_t D = tp->q.t.shape[3];
	long double l = 0;

	if (test_problem_naive(&c->tp))
		return NAN;
	for (size_t row = 0; row < tp->rows; row++) {
		for (int64_t d = 0; d < D; d++)
			l += (long double)naive_get(&c->dout.t, (int64_t)row / (tp->q.t.shape[1] *
										 tp->q.t.shape[2]),
						    (int64_t)row / tp->q.t.shape[2] % tp->q.t.shape[1],
						    (int64_t)row % tp->q.t.shape[2], d) *
			     tp->naive_o[row * (size_t)D + (size_t)d];
		if (c->dlse && isfinite(tp->naive_lse[row]))
			l += (long double)c->dlse[row] * tp->naive_lse[row];
	}
	return l;
}

/* The reference's dbias_table against central differences of the long-double loss: every
 * entry of a table shorter than the distances (its last entry gathers every far pair), per
 * head and shared. */
TEST(table_gradient_matches_finite_differences)
{
	ape_context *ctx = test_context("ref");
	ape_device *ref = test_device(ctx, "ref");
	ape_rng rng;

	ASSERT_NE(NULL, ref);
	ape_rng_init(&rng, "table_gradient_matches_finite_differences");
	for (int shared = 0; shared < 2; shared++) {
		const test_problem_shape sh = { 2, 2, 1, 9, 13, 8 };
		bcase bc;
		grads g;
		float *db;
		int64_t M;
		double worst = 0, m = 1e-30;

		ASSERT_EQ(0, bcase_make(&bc, &rng, &sh, APE_F32, false, true));
		test_problem_set_params(&bc.tp, 0.1, 0.2, 0.05, 0.7);
		bc.tp.desc.causal = shared == 0;
		bc.tp.desc.q_start_set = true;
		bc.tp.desc.q_start = 4;
		ASSERT_EQ(0, test_problem_random_table(&bc.tp, &rng));
		if (shared) { /* row 0's first five entries: most pairs share the last one */
			bc.tp.desc.bias_table_heads = 1;
			if (bc.tp.desc.bias_table_len > 5)
				bc.tp.desc.bias_table_len = 5;
		}
		M = bc.tp.desc.bias_table_len;
		ASSERT_EQ(0, bcase_forward(&bc, ref));
		ASSERT_EQ(0, grads_alloc(&g, &bc, APE_F32));
		db = malloc(sizeof(float) * table_size(&bc.tp));
		ASSERT_NE(NULL, db);
		bc.tp.desc.dbias_table = db;
		ASSERT_EQ(0, run_backward(&bc, ref, &g, 0, NULL)) TH_LOG("%s", ape_last_error());
		for (size_t x = 0; x < table_size(&bc.tp); x++) {
			const float t0 = bc.tp.bias_table[x];
			const float up = t0 + 1e-2f, dn = t0 - 1e-2f;
			long double lu, ld;

			bc.tp.bias_table[x] = up;
			lu = naive_loss(&bc);
			bc.tp.bias_table[x] = dn;
			ld = naive_loss(&bc);
			bc.tp.bias_table[x] = t0;
			worst = fmax(worst, fabs((double)((lu - ld) / ((long double)up - dn)) - db[x]));
			m = fmax(m, fabs(db[x]));
		}
		/* central differences: O(h^2) of the loss's curvature, far below 1e-4 here */
		EXPECT_LE(worst / m, 1e-4) TH_LOG("%g: %s table of %lld entries", worst / m, shared ? "shared" : "per-head",
						  (long long)M);
		free(db);
		grads_free(&g);
		bcase_free(&bc);
	}
	ape_context_destroy(ctx);
}

/* The explicit-positions backward (per batch element, through the ragged backward) returns the table's
 * gradient of the implicit call when its positions are the implicit ones: summed over the
 * batch in another order, equal to rounding. */
TEST_F(dev, explicit_positions_backward_returns_the_table_gradient)
{
	const test_problem_shape sh = { 2, 2, 1, self->emu ? 6 : 19, self->emu ? 9 : 33, 8 };
	ape_rng rng;
	bcase bc;
	grads g;
	int64_t *pq, *pk;
	float *want, *got;
	size_t nt;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, bcase_make(&bc, &rng, &sh, APE_F32, false, true));
	test_problem_set_params(&bc.tp, 0.05, 0.1, 0.1, 0.6);
	bc.tp.desc.q_start_set = false;
	bc.tp.desc.k_start = 0;
	ASSERT_EQ(0, test_problem_random_table(&bc.tp, &rng));
	ASSERT_EQ(0, bcase_forward(&bc, self->ref));
	ASSERT_EQ(0, grads_alloc(&g, &bc, APE_F32));
	nt = table_size(&bc.tp);
	want = malloc(sizeof(float) * nt);
	got = malloc(sizeof(float) * nt);
	pq = malloc(sizeof(int64_t) * (size_t)sh.Lq);
	pk = malloc(sizeof(int64_t) * (size_t)sh.Lk);
	ASSERT_TRUE(want && got && pq && pk);
	bc.tp.desc.dbias_table = want;
	ASSERT_EQ(0, run_backward(&bc, self->dev, &g, W_DQ, NULL)) TH_LOG("%s", ape_last_error());
	for (int64_t i = 0; i < sh.Lq; i++)
		pq[i] = sh.Lk - sh.Lq + i;
	for (int64_t j = 0; j < sh.Lk; j++)
		pk[j] = j;
	bc.tp.desc.pos_q = pq;
	bc.tp.desc.pos_k = pk;
	bc.tp.desc.dbias_table = got;
	ASSERT_EQ(0, run_backward(&bc, self->dev, &g, W_DQ, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_LE(rel_err(got, want, nt), 1e-5);
	free(want);
	free(got);
	free(pq);
	free(pk);
	grads_free(&g);
	bcase_free(&bc);
}

/* ---- bad input */

/* The forward of tp with desc d on dev: the code, the message in msg; O and LSE compared with
 * their poisoned bytes (untouched: *written false). */
static int refused(test_problem *tp, ape_device *dev, const ape_attn_desc *d, char *msg,
		   size_t cap, bool *written)
{
	const size_t ob = (size_t)(tp->o.t.shape[0] * tp->o.t.shape[1] * tp->o.t.shape[2] *
				   tp->o.t.shape[3]) * ape_dtype_size(tp->o.t.dtype);
	unsigned char *snap = malloc(ob + 1);
	int ret;

	if (!snap)
		return APE_ENOMEM;
	memset(tp->o.t.data, 0x7f, ob);
	memcpy(snap, tp->o.t.data, ob);
	ret = ape_attention_forward(dev, d, &tp->q.t, &tp->k.t, &tp->v.t, &tp->o.t, tp->lse, NULL);
	snprintf(msg, cap, "%s", ape_last_error());
	*written = memcmp(snap, tp->o.t.data, ob) != 0;
	free(snap);
	return ret;
}

TEST(bad_tables_are_refused_naming_the_field)
{
	const test_problem_shape sh = { 1, 2, 1, 6, 8, 8 };
	ape_context *ctx = test_context("ref");
	ape_device *ref = test_device(ctx, "ref");
	float table[2 * 5], grad[2 * 5];
	test_problem tp;
	ape_attn_desc d;
	ape_rng rng;
	char msg[512];
	bool written;
	const struct {
		const char *what, *want;
		int64_t len, heads;
		int poison; /* 1: NaN at [1][2]; 2: +inf at [0][4] */
		int grad; /* 1: dbias_table without a table; 2: overlapping the table */
	} cases[] = {
		{ "M = 0", "desc->bias_table_len = 0", 0, 2, 0, 0 },
		{ "M = -3", "desc->bias_table_len = -3", -3, 2, 0, 0 },
		{ "M past the largest", "desc->bias_table_len = 16777217", APE_BIAS_TABLE_MAX + 1, 2, 0, 0 },
		{ "three rows for two heads", "desc->bias_table_heads = 3", 5, 3, 0, 0 },
		{ "no rows", "desc->bias_table_heads = 0", 5, 0, 0, 0 },
		{ "NaN", "desc->bias_table[1][2] = nan", 5, 2, 1, 0 },
		{ "inf", "desc->bias_table[0][4] = inf", 5, 2, 2, 0 },
		{ "a gradient without a table", "desc->dbias_table", 5, 2, 0, 1 },
		{ "the gradient over the table", "desc->dbias_table overlaps desc->bias_table", 5, 2, 0, 2 },
	};

	ASSERT_NE(NULL, ref);
	ape_rng_init(&rng, "bad_tables_are_refused_naming_the_field");
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		for (int i = 0; i < 10; i++)
			table[i] = 0.1f * (float)i;
		if (cases[c].poison == 1)
			table[1 * 5 + 2] = NAN;
		if (cases[c].poison == 2)
			table[0 * 5 + 4] = INFINITY;
		d = tp.desc;
		d.bias_table = cases[c].grad == 1 ? NULL : table;
		d.bias_table_len = cases[c].len;
		d.bias_table_heads = cases[c].heads;
		d.dbias_table = cases[c].grad == 1 ? grad : cases[c].grad == 2 ? table + 3 : NULL;
		EXPECT_EQ(APE_EINVAL, refused(&tp, ref, &d, msg, sizeof(msg), &written))
		TH_LOG("%s", cases[c].what);
		EXPECT_NE(NULL, strstr(msg, cases[c].want)) TH_LOG("%s: \"%s\"", cases[c].what, msg);
		EXPECT_FALSE(written) TH_LOG("%s: O written", cases[c].what);
	}
	test_problem_free(&tp);
	ape_context_destroy(ctx);
}

/* A caller built against the third layout (no table fields) passes APE_ATTN_DESC_V3_SIZE:
 * whatever lies past it is never read. */
TEST(a_desc_of_the_third_layout_reads_no_table)
{
	const test_problem_shape sh = { 1, 2, 2, 7, 11, 8 };
	ape_context *ctx = test_context("ref");
	ape_device *ref = test_device(ctx, "ref");
	test_problem a, b;
	ape_rng rng;

	ASSERT_NE(NULL, ref);
	ape_rng_init(&rng, "a_desc_of_the_third_layout_reads_no_table");
	ASSERT_EQ(0, test_problem_make(&a, &rng, &sh, APE_F32, false));
	test_problem_set_params(&a, 0.1, 0.1, 0.1, 0.5);
	ASSERT_EQ(0, test_problem_clone(&b, &a));
	ASSERT_EQ(0, test_problem_run(&a, ref));
	b.desc.struct_size = APE_ATTN_DESC_V3_SIZE;
	b.desc.bias_table = (const float *)(uintptr_t)0x10; /* would crash if read */
	b.desc.bias_table_len = -1;
	b.desc.bias_table_heads = 99;
	b.desc.dbias_table = (float *)(uintptr_t)0x20;
	ASSERT_EQ(0, test_problem_run(&b, ref)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, bits_differing(&a, &b));
	b.desc.bias_table = NULL; /* not the test problem's to free */
	test_problem_free(&a);
	test_problem_free(&b);
	ape_context_destroy(ctx);
}

/* The backward on device tensors computes no table gradient: asked for one, it says so. */
TEST(the_device_tensor_backward_refuses_the_table_gradient)
{
	const test_problem_shape sh = { 1, 2, 1, 5, 9, 8 };
	ape_context *ctx = test_context("ref");
	ape_device *ref = test_device(ctx, "ref");
	ape_queue *qu = NULL;
	ape_rng rng;
	bcase bc;
	grads g;
	dcase x;
	float db[64];

	ASSERT_NE(NULL, ref);
	ape_rng_init(&rng, "the_device_tensor_backward_refuses_the_table_gradient");
	ASSERT_EQ(0, bcase_make(&bc, &rng, &sh, APE_F32, false, false));
	ASSERT_EQ(0, test_problem_random_table(&bc.tp, &rng));
	ASSERT_EQ(0, bcase_forward(&bc, ref));
	ASSERT_EQ(0, grads_alloc(&g, &bc, APE_F32));
	ASSERT_EQ(0, ape_queue_create(ref, &qu));
	memset(&x, 0, sizeof(x));
	ASSERT_EQ(0, dcase_up(&x, qu, &bc, &g, 0));
	/* with the table alone it runs (the table in the scores) */
	EXPECT_EQ(0, dcase_enqueue(&x, qu, &bc, W_ALL)) TH_LOG("%s", ape_last_error());
	bc.tp.desc.dbias_table = db;
	EXPECT_EQ(APE_EINVAL, dcase_enqueue(&x, qu, &bc, W_ALL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "desc->dbias_table")) TH_LOG("%s", ape_last_error());
	dcase_free(&x);
	ape_queue_destroy(qu);
	grads_free(&g);
	bcase_free(&bc);
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
