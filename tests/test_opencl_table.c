/* SPDX-License-Identifier: MIT */
/*
 * Distance-bias tables (ape_attn_desc.bias_table) on every forward launch kind of the OpenCL
 * backend, against the reference backend: the general kernel (contiguous positions, explicit
 * positions, ragged segments at default and explicit positions), the separable path in both
 * shapes (ape_sep_attn, ape_sep_attn_wg under APE_OCL_SEP_SHAPE=gpu, the tiny segments of
 * ape_sep_small, launches mixing separable heads with others), the split-K decode in both shapes
 * (APE_OCL_DEC_SHAPE=gpu) and ragged, a KV cache's and a KV pool's pages read in place, the
 * diagnostics, strided host tensors and strided device views. Random tables of every kind
 * (tests/common/problem.c: T5 buckets, a Gaussian, tables that rise again far away, random
 * values; shorter and longer than the distances; per head or shared), every storage type, GQA,
 * both layouts, causal or not, skipping allowed in half the cases; then skipping against tables
 * built to break a bound that ignores them (a rise far away that outweighs the near keys: every
 * path keeps those keys) and a falling table (the paths still skip). Each case asserts the
 * kernels the call enqueued (ape__ocl_debug_kernels()), so that a change which sends a kind
 * elsewhere fails here instead of passing untested.
 *
 * SKIP only where there is no OpenCL platform at all (or libape lacks the backend).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/opencl_present.h"
#include "common/positions.h"
#include "common/problem.h"
#include "common/resident.h"

#ifdef APE_HAVE_OPENCL
#include "../opencl/ocl_debug.h"
#include "opencl_compare.h"
/* decode() and close_enough() of the KV-cache tests' pieces (the rest is theirs) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "kvcache_case.h"
#pragma GCC diagnostic pop

static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };

/* devs_open(), and the recording of the kernels enqueued started. */
static void open_recording(struct __test_metadata *_metadata, struct devs *d)
{
	char buf[8];

	devs_open(_metadata, d);
	ASSERT_EQ(0, ape__ocl_debug_kernels(d->ocl, buf, sizeof(buf)));
}

/* The kernels enqueued on the OpenCL device since the last look, space-separated, into buf. */
static void kernels(const struct devs *d, char *buf, unsigned cap)
{
	if (ape__ocl_debug_kernels(d->ocl, buf, cap))
		buf[0] = 0;
}

/* Does the list name kernel `name`? */
static bool has(const char *list, const char *name)
{
	const size_t n = strlen(name);

	for (const char *p = list; *p;) {
		const size_t w = strcspn(p, " ");

		if (w == n && !strncmp(p, name, n))
			return true;
		p += w + (p[w] == ' ');
	}
	return false;
}

/* Only a CPU device takes the decode's and the separable path's CPU shapes (ocl_fast.h). */
static bool ocl_is_cpu(const struct devs *d)
{
	ape_device_info info;

	return !ape_device_get_info(d->ocl, &info) && info.kind == APE_DEVICE_CPU;
}

/*
 * A case of shape sh (strided host tensors in a third of them), random storage type, layout,
 * causality, scale and positions, per-head parameters: lambda 0 on every head when sep (the
 * separable path), else in [0.05, 0.55); decays >= 0 (skipping allowed) when nonneg, else some
 * negative; and a random table. 0, or -1 out of memory.
 */
static int table_case(test_problem *tp, ape_rng *r, const test_problem_shape *sh, bool sep,
		      bool nonneg)
{
	const int64_t H = sh->H;

	if (test_problem_make(tp, r, sh, types[ape_rng_range(r, 0, 2)], ape_rng_uniform(r) < 0.3))
		return -1;
	test_problem_random_params(tp, r);
	for (int64_t h = 0; h < H; h++) {
		const double u = ape_rng_uniform(r);

		tp->params[h] = (float)(nonneg ? 0.2 * u : 0.4 * (u - 0.3));
		tp->params[H + h] = (float)(nonneg ? 0.5 * ape_rng_uniform(r)
						   : ape_rng_uniform(r) - 0.3);
		tp->params[2 * H + h] = (float)(0.3 * ape_rng_uniform(r));
		tp->params[3 * H + h] = sep ? 0.0f : (float)(0.05 + 0.5 * ape_rng_uniform(r));
	}
	tp->desc.delta = (ape_param){ 0, tp->params };
	tp->desc.beta = (ape_param){ 0, tp->params + H };
	tp->desc.gamma = (ape_param){ 0, tp->params + 2 * H };
	tp->desc.lambda = (ape_param){ 0, tp->params + 3 * H };
	tp->desc.skip_tol = nonneg ? 0x1p-24 : 0;
	if (ape_rng_uniform(r) < 0.3 && test_problem_set_out_dtype(tp, APE_F32))
		return -1;
	return test_problem_random_table(tp, r);
}

/* A random shape: B 1..2, Hkv 1..3 heads shared by 1..group query heads each, Lq and Lk from
 * lens (Lq from lq when lq > 0), D 32 (the generic program) or 64 (a specialised one), at most
 * `most` pairs of the whole problem. */
static test_problem_shape random_shape(ape_rng *r, int64_t lq, int64_t group, int64_t most)
{
	static const int64_t lens[] = { 1, 2, 7, 16, 17, 31, 33, 63, 64, 65, 100, 129, 300 };
	test_problem_shape sh;

	do {
		sh.B = ape_rng_range(r, 1, 2);
		sh.Hkv = ape_rng_range(r, 1, 3);
		sh.H = sh.Hkv * ape_rng_range(r, 1, group);
		sh.Lq = lq > 0 ? lq : lens[ape_rng_range(r, 2, 12)];
		sh.Lk = lens[ape_rng_range(r, 0, 12)];
		sh.D = ape_rng_uniform(r) < 0.5 ? 32 : 64;
	} while (sh.B * sh.H * sh.Lq * sh.Lk > most);
	return sh;
}

/* ---- the general kernel */

/* Contiguous positions (some near 2^40), every type, strided host tensors, GQA, skipping in
 * half the cases: the general kernel, against the reference. */
TEST(general_kernel)
{
	const int ncases = ape_test_slow() ? 6 : 40;
	int failed = 0, took = 0;
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "general_kernel");
	for (int c = 0; c < ncases; c++) {
		/* more than the decode's 8 rows: the general kernel's */
		const test_problem_shape sh = random_shape(&rng, 9 + ape_rng_range(&rng, 0, 120),
							   3, 400000);
		test_problem tp;
		ape_stats st;
		char k[1024];

		ASSERT_EQ(0, table_case(&tp, &rng, &sh, false, c % 2 == 0));
		failed += compare(_metadata, &d, &tp, &st, "general", NULL) != 0;
		kernels(&d, k, sizeof(k));
		took += has(k, "ape_attention");
		EXPECT_LE(st.pairs_computed, st.pairs_visible);
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, failed);
	EXPECT_EQ(ncases, took) TH_LOG("cases not on the general kernel");
	ape_context_destroy(d.ctx);
}

/* Explicit positions (ape_attention_pos): shifted, gapped, repeated, shuffled and decreasing
 * ones, skipping allowed in half the cases (the per-tile bound). */
TEST(explicit_positions)
{
	const int ncases = ape_test_slow() ? 5 : 30;
	int failed = 0, took = 0;
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "explicit_positions");
	for (int c = 0; c < ncases; c++) {
		const test_problem_shape sh = random_shape(&rng, -1, 3, 300000);
		const enum pos_mode m = (enum pos_mode)ape_rng_range(&rng, POS_SHIFTED, POS_MODES - 1);
		const int64_t base = ape_rng_range(&rng, -1000, 1000);
		int64_t *pq = malloc(sizeof(int64_t) * (size_t)sh.Lq);
		int64_t *pk = malloc(sizeof(int64_t) * (size_t)sh.Lk);
		test_problem tp;
		ape_stats st;
		char k[1024];

		ASSERT_TRUE(pq && pk);
		ASSERT_EQ(0, table_case(&tp, &rng, &sh, c % 3 == 0, c % 2 == 0));
		test_positions(&rng, m, pk, sh.Lk, base);
		test_positions(&rng, m, pq, sh.Lq,
			       (m == POS_DECREASING ? base : base + sh.Lk - sh.Lq) +
				       ape_rng_range(&rng, -3, 3));
		tp.desc.q_start_set = false;
		tp.desc.k_start = 0;
		tp.desc.pos_q = pq;
		tp.desc.pos_k = pk;
		failed += compare(_metadata, &d, &tp, &st, pos_mode_names[m], NULL) != 0;
		kernels(&d, k, sizeof(k));
		took += has(k, "ape_attention_pos");
		test_problem_free(&tp);
		free(pq);
		free(pk);
	}
	EXPECT_EQ(0, failed);
	EXPECT_EQ(ncases, took) TH_LOG("cases not on ape_attention_pos");
	ape_context_destroy(d.ctx);
}

/* ---- the fast paths */

/*
 * The separable path (lambda = 0 on every head) in both shapes, skipping in half the cases (the
 * path skips causal launches); every fourth case mixes in a head with lambda != 0, which splits
 * the launch by kv groups (the separable runs and the general kernel's each see their heads'
 * rows of the table).
 */
TEST(separable_path_both_shapes)
{
	const int ncases = ape_test_slow() ? 4 : 24;
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "separable_path_both_shapes");
	for (int shape = 0; shape < 2; shape++) {
		const char *sep = shape || !ocl_is_cpu(&d) ? "ape_sep_attn_wg" : "ape_sep_attn";
		int failed = 0, took = 0, split = 0, mixes = 0;

		if (shape)
			setenv("APE_OCL_SEP_SHAPE", "gpu", 1);
		for (int c = 0; c < ncases; c++) {
			/* PoCL compiles the work-group kernel's barriers slowly: small shapes */
			const test_problem_shape sh =
				random_shape(&rng, 9 + ape_rng_range(&rng, 0, 100), 3,
					     shape ? 60000 : 400000);
			const bool mix = c % 4 == 3 && sh.Hkv > 1;
			test_problem tp;
			ape_stats st;
			char k[1024];

			ASSERT_EQ(0, table_case(&tp, &rng, &sh, true, c % 2 == 0));
			if (mix) /* one kv group is not separable: runs of kv groups */
				tp.params[3 * sh.H + ape_rng_range(&rng, 0, sh.H - 1)] = 0.5f;
			failed += compare(_metadata, &d, &tp, mix ? NULL : &st, sep, NULL) != 0;
			kernels(&d, k, sizeof(k));
			mixes += mix;
			if (mix)
				split += has(k, sep) && has(k, "ape_attention");
			else
				took += has(k, sep);
			test_problem_free(&tp);
		}
		ksft_print_msg("%s: %d of %d cases, %d of %d mixed ones split\n", sep, took,
			       ncases - mixes, split, mixes);
		fflush(stdout);
		EXPECT_EQ(0, failed);
		EXPECT_EQ(ncases - mixes, took) TH_LOG("cases not on %s", sep);
		EXPECT_EQ(mixes, split) TH_LOG("mixed cases not split");
	}
	unsetenv("APE_OCL_SEP_SHAPE");
	ape_context_destroy(d.ctx);
}

/* The split-K decode in both shapes: 1..8 rows (a query head's rows per kv head within the
 * kernels' 8 or 16), many keys; where skipping is allowed no head has a decay (the decode takes
 * such launches: it skips nothing). */
TEST(decode_both_shapes)
{
	static const int64_t lks[] = { 1, 5, 63, 64, 65, 300, 1000, 2500 };
	const int ncases = ape_test_slow() ? 4 : 30;
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "decode_both_shapes");
	for (int shape = 0; shape < 2; shape++) {
		const char *dec = shape || !ocl_is_cpu(&d) ? "ape_decode_wg" : "ape_decode";
		int failed = 0, took = 0;

		if (shape)
			setenv("APE_OCL_DEC_SHAPE", "gpu", 1);
		for (int c = 0; c < ncases; c++) {
			test_problem_shape sh = random_shape(&rng, ape_rng_range(&rng, 1, 8), 1,
							     1 << 30);
			test_problem tp;
			ape_stats st;
			char k[1024];

			sh.Lk = lks[ape_rng_range(&rng, 0, 7)];
			sh.H = sh.Hkv * (sh.Lq <= 4 ? ape_rng_range(&rng, 1, 2) : 1);
			ASSERT_EQ(0, table_case(&tp, &rng, &sh, c % 4 == 1, c % 2 == 0));
			if (c % 2 == 0) /* skipping allowed: no decays */
				for (int64_t x = 0; x < 3 * sh.H; x++)
					tp.params[x] = 0.0f;
			failed += compare(_metadata, &d, &tp, &st, dec, NULL) != 0;
			kernels(&d, k, sizeof(k));
			took += has(k, dec) && has(k, "ape_decode_merge");
			EXPECT_EQ(st.pairs_visible, st.pairs_computed);
			test_problem_free(&tp);
		}
		EXPECT_EQ(0, failed);
		EXPECT_EQ(ncases, took) TH_LOG("cases not on the decode (%s)", dec);
	}
	unsetenv("APE_OCL_DEC_SHAPE");
	ape_context_destroy(d.ctx);
}

/* ---- ragged batches */

/* tp (B = 1) as a ragged batch of vl's sequences on dev, results into tp (LSE [total_q, H]). */
static int run_varlen(test_problem *tp, ape_device *dev, const ape_varlen *vl)
{
	test_tensor_poison(&tp->o.t);
	for (size_t i = 0; i < tp->rows; i++)
		tp->lse[i] = NAN;
	return ape_attention_forward_varlen(dev, &tp->desc, vl, &tp->q.t, &tp->k.t, &tp->v.t,
					    &tp->o.t, tp->lse, NULL);
}

/*
 * Ragged batches of S sequences of lq[s] rows and lk[s] keys (positions from pos_q, pos_k when
 * not NULL): the packed batch on OpenCL against the reference, and the kernels named in `want`
 * (a NULL-terminated list) among those enqueued. sep: lambda 0 on every head; skip: skipping
 * allowed (decays >= 0). 0 or -1 (logged).
 */
static int ragged_case(struct __test_metadata *_metadata, const struct devs *d, ape_rng *r,
		       int S, const int64_t *lq, const int64_t *lk, const int64_t *pos_q,
		       const int64_t *pos_k, int64_t group, int64_t D, bool sep, bool skip,
		       const char *const *want)
{
	int64_t cuq[17] = { 0 }, cuk[17] = { 0 };
	test_problem_shape sh;
	test_problem tp, ref;
	ape_varlen vl;
	char k[1024];
	double eo, el;
	int ret = 0;

	for (int s = 0; s < S; s++) {
		cuq[s + 1] = cuq[s] + lq[s];
		cuk[s + 1] = cuk[s] + lk[s];
	}
	sh = (test_problem_shape){ 1, 2 * group, 2, cuq[S], cuk[S], D };
	if (table_case(&tp, r, &sh, sep, true))
		return -1;
	if (!skip)
		tp.desc.skip_tol = 0;
	tp.desc.q_start_set = false;
	tp.desc.k_start = 0;
	ape_varlen_init(&vl);
	vl.num_seqs = S;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	vl.pos_q = pos_q;
	vl.pos_k = pos_k;
	if (test_problem_clone(&ref, &tp)) {
		test_problem_free(&tp);
		return -1;
	}
	if (run_varlen(&tp, d->ocl, &vl) || run_varlen(&ref, d->ref, &vl)) {
		TH_LOG("ragged: %s", ape_last_error());
		ret = -1;
		goto out;
	}
	kernels(d, k, sizeof(k));
	eo = test_max_err_o(&tp.o.t, &ref.o.t) / v_scale(&tp);
	el = test_max_rel_err_lse(tp.lse, ref.lse, tp.rows);
	if (eo > test_tol_o(tp.q.t.dtype) || el > test_tol_lse(tp.q.t.dtype)) {
		TH_LOG("ragged (%d sequences, %s): O error %.3g, LSE error %.3g", S,
		       ape_dtype_name(tp.q.t.dtype), eo, el);
		ret = -1;
	}
	for (int w = 0; want[w]; w++)
		if (!has(k, want[w])) {
			TH_LOG("ragged (%d sequences): no %s among \"%s\"", S, want[w], k);
			ret = -1;
		}
out:
	test_problem_free(&tp);
	test_problem_free(&ref);
	return ret;
}

/* The general kernel's segment tables, at default and explicit positions; the separable path's
 * (its tiny segments on ape_sep_small in the CPU shape); the decode's. */
TEST(ragged_batches)
{
	const int rounds = ape_test_slow() ? 1 : 4;
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "ragged_batches");
	for (int c = 0; c < rounds; c++) {
		const bool cpu = ocl_is_cpu(&d);
		static const char *const general[] = { "ape_attention", NULL };
		static const char *const positions[] = { "ape_attention_pos", NULL };
		static const char *const sep_cpu[] = { "ape_sep_attn", "ape_sep_small", NULL };
		static const char *const sep_wg[] = { "ape_sep_attn_wg", NULL };
		static const char *const decode[] = { "ape_decode_merge", NULL };
		int64_t lq[6], lk[6], pq[256], pk[512], nq = 0, nk = 0;

		/* general: a segment of more than 8 rows (not the decode's), one without keys */
		for (int s = 0; s < 5; s++) {
			lq[s] = s == 0 ? 40 : ape_rng_range(&rng, 1, 30);
			lk[s] = s == 3 ? 0 : ape_rng_range(&rng, 1, 90);
		}
		EXPECT_EQ(0, ragged_case(_metadata, &d, &rng, 5, lq, lk, NULL, NULL, 2, 64, false,
					 true, general));
		/* the same at explicit positions: each sequence's own gaps */
		for (int s = 0; s < 5; s++) {
			test_positions(&rng, POS_GAPS, pk + nk, lk[s], 0);
			test_positions(&rng, POS_GAPS, pq + nq, lq[s],
				       lk[s] ? pk[nk + lk[s] - 1] - lq[s] + 2 : 0);
			nq += lq[s];
			nk += lk[s];
		}
		EXPECT_EQ(0, ragged_case(_metadata, &d, &rng, 5, lq, lk, pq, pk, 2, 32, c % 2,
					 true, positions));
		/* separable: long segments and ones of at most a key tile */
		for (int s = 0; s < 6; s++) {
			lq[s] = s < 2 ? ape_rng_range(&rng, 9, 60) : ape_rng_range(&rng, 1, 16);
			lk[s] = s < 2 ? ape_rng_range(&rng, 17, 120) : ape_rng_range(&rng, 1, 16);
		}
		EXPECT_EQ(0, ragged_case(_metadata, &d, &rng, 6, lq, lk, NULL, NULL, 2, 64, true,
					 true, cpu ? sep_cpu : sep_wg));
		/* decode: a row or two per sequence against many keys (skipping off: the decode
		 * takes no launch that could skip by a decay) */
		for (int s = 0; s < 6; s++) {
			lq[s] = ape_rng_range(&rng, 1, 2);
			lk[s] = ape_rng_range(&rng, 1, 700);
		}
		if (cpu)
			EXPECT_EQ(0, ragged_case(_metadata, &d, &rng, 6, lq, lk, NULL, NULL, 2, 64,
						 c % 2, false, decode));
	}
	ape_context_destroy(d.ctx);
}

/* ---- skipping */

/*
 * Causal, every head delta = 0.5 (the decay alone makes keys past a few dozen negligible), one
 * shared table: `rise` adds 0.5 |n| + 1 from distance 300 on (the score's bias there 1 above
 * the nearest key's: the far keys carry most of the weight; a bound that ignored the table
 * would leave them out), else the table falls, -0.1 |n| (skipping must go on). lambda as
 * given: 0 takes the separable path.
 */
static int skip_problem(test_problem *tp, ape_rng *r, int64_t L, float lambda, bool rise)
{
	const test_problem_shape sh = { 1, 2, 2, L, L, 64 };
	float *t = malloc(sizeof(float) * (size_t)(L + 1));

	if (!t || test_problem_make(tp, r, &sh, APE_F32, false)) {
		free(t);
		return -1;
	}
	test_problem_set_params(tp, 0.5, 0, 0, lambda);
	tp->desc.causal = true;
	tp->desc.skip_tol = 0x1p-24;
	for (int64_t m = 0; m <= L; m++)
		t[m] = rise ? (m < 300 ? 0.0f : 0.5f * (float)m + 1.0f) : -0.1f * (float)m;
	free(tp->bias_table);
	tp->bias_table = t;
	tp->desc.bias_table = t;
	tp->desc.bias_table_len = L + 1;
	tp->desc.bias_table_heads = 1;
	return 0;
}

/* The general kernel, explicit positions and the separable path (both shapes), each under a
 * table that rises far away (within tolerance of the reference: no far key left out) and one
 * that falls (fewer pairs computed than visible, still within tolerance). */
TEST(skipping_takes_the_table)
{
	const int64_t L = ape_test_slow() ? 400 : 700;
	static const char *const paths[] = { "ape_attention", "ape_attention_pos", "ape_sep_attn",
					     "ape_sep_attn_wg" };
	int64_t *pos = malloc(sizeof(int64_t) * (size_t)L);
	struct devs d;
	ape_rng rng;

	ASSERT_NE(NULL, pos);
	for (int64_t i = 0; i < L; i++)
		pos[i] = i;
	open_recording(_metadata, &d);
	ape_rng_init(&rng, "skipping_takes_the_table");
	for (int p = 0; p < 4; p++)
		for (int rise = 0; rise < 2; rise++) {
			const char *path = p == 2 && !ocl_is_cpu(&d) ? paths[3] : paths[p];
			test_problem tp;
			ape_stats st;
			char k[1024];

			if (p == 3)
				setenv("APE_OCL_SEP_SHAPE", "gpu", 1);
			ASSERT_EQ(0, skip_problem(&tp, &rng, L, p >= 2 ? 0.0f : 0.2f, rise));
			if (p == 1) {
				tp.desc.pos_q = tp.desc.pos_k = pos;
				tp.desc.k_start = 0;
				tp.desc.q_start_set = false;
			}
			EXPECT_EQ(0, compare(_metadata, &d, &tp, &st, path, NULL))
			TH_LOG("%s, the table %s", path, rise ? "rising" : "falling");
			kernels(&d, k, sizeof(k));
			EXPECT_TRUE(has(k, path)) TH_LOG("%s not among \"%s\"", path, k);
			ksft_print_msg("%s, %s table: %llu of %llu visible pairs computed\n", path,
				       rise ? "rising" : "falling",
				       (unsigned long long)st.pairs_computed,
				       (unsigned long long)st.pairs_visible);
			fflush(stdout);
			if (!rise)
				EXPECT_LT(st.pairs_computed, st.pairs_visible / 2)
			TH_LOG("%s: a falling table, delta 0.5 over %lld keys", path, (long long)L);
			test_problem_free(&tp);
			unsetenv("APE_OCL_SEP_SHAPE");
		}
	free(pos);
	ape_context_destroy(d.ctx);
}

/* ---- pages, diagnostics, device views */

/* A KV cache decoded a token at a time and three at a time (its blocks read in place by the
 * decode), against the reference's dense call. */
TEST(kv_cache_pages)
{
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "kv_cache_pages");
	for (int c = 0; c < 4; c++) {
		const test_problem_shape sh = { 1, 4, 2, 150, 150, c % 2 ? 32 : 64 };
		test_problem tp, ref;
		ape_kv_cache *kc = NULL;
		ape_kv_cache_options o;
		char k[1024];

		ASSERT_EQ(0, table_case(&tp, &rng, &sh, c == 3, c < 2));
		tp.desc.causal = true;
		tp.desc.q_start_set = false;
		if (tp.strided) { /* the cache takes contiguous appends only in this helper */
			test_problem_free(&tp);
			c--;
			continue;
		}
		ASSERT_EQ(0, test_problem_clone(&ref, &tp));
		ASSERT_EQ(0, test_problem_run(&ref, d.ref)) TH_LOG("%s", ape_last_error());
		o = cache_options(&tp, 16, sh.Lk);
		ASSERT_EQ(0, ape_kv_cache_create(d.ocl, &o, &kc)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, decode(&tp, kc, c % 2 ? 3 : 1, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, close_enough(_metadata, &tp, &ref, "KV cache"));
		kernels(&d, k, sizeof(k));
		EXPECT_TRUE(has(k, "ape_decode_merge")) TH_LOG("no decode among \"%s\"", k);
		ape_kv_cache_destroy(kc);
		test_problem_free(&tp);
		test_problem_free(&ref);
	}
	ape_context_destroy(d.ctx);
}

/* A KV pool of three sequences at their own positions, one attend of a ragged batch of rows
 * (1, 3 and 2) over their pages: OpenCL's pool against the reference's. */
TEST(kv_pool_pages)
{
	const int64_t Hkv = 2, H = 4, D = 64, n[3] = { 40, 200, 77 }, ks[3] = { 0, 1000, -20 };
	const int64_t cuq[4] = { 0, 1, 4, 6 };
	ape_kv_pool *pool[2] = { NULL, NULL };
	int64_t seq[2][3];
	float *o[2], *lse[2], *q, *kb, *vb;
	ape_kv_pool_options opts;
	ape_tensor qt, kt, vt, ot;
	test_problem tp;
	struct devs d;
	ape_rng rng;
	char k[1024] = "";
	double eo = 0, el = 0;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "kv_pool_pages");
	/* a case's parameters and table (its tensors unused); skipping allowed */
	ASSERT_EQ(0, table_case(&tp, &rng, &(test_problem_shape){ 1, H, Hkv, 1, 1, D }, false,
				true));
	tp.desc.q_start_set = false;
	tp.desc.k_start = 0;
	q = malloc(sizeof(float) * (size_t)(6 * H * D));
	kb = malloc(sizeof(float) * (size_t)(200 * Hkv * D));
	vb = malloc(sizeof(float) * (size_t)(200 * Hkv * D));
	ASSERT_TRUE(q && kb && vb);
	for (int x = 0; x < 2; x++) {
		o[x] = malloc(sizeof(float) * (size_t)(6 * H * D));
		lse[x] = malloc(sizeof(float) * (size_t)(6 * H));
		ASSERT_TRUE(o[x] && lse[x]);
	}
	for (int64_t x = 0; x < 6 * H * D; x++)
		q[x] = (float)ape_rng_normal(&rng);
	ape_kv_pool_options_init(&opts);
	opts.Hkv = Hkv;
	opts.H = H;
	opts.D = D;
	opts.dtype = APE_F32;
	opts.capacity_tokens = 512;
	for (int x = 0; x < 2; x++)
		ASSERT_EQ(0, ape_kv_pool_create(x ? d.ref : d.ocl, &opts, &pool[x]))
		TH_LOG("%s", ape_last_error());
	for (int s = 0; s < 3; s++) {
		for (int64_t x = 0; x < n[s] * Hkv * D; x++) {
			kb[x] = (float)ape_rng_normal(&rng);
			vb[x] = (float)ape_rng_normal(&rng);
		}
		ape_tensor_init_packed(&kt, kb, APE_F32, n[s], Hkv, D);
		ape_tensor_init_packed(&vt, vb, APE_F32, n[s], Hkv, D);
		for (int x = 0; x < 2; x++) {
			ASSERT_EQ(0, ape_kv_pool_add_sequence(pool[x], ks[s], &seq[x][s]));
			ASSERT_EQ(0, ape_kv_pool_append(pool[x], seq[x][s], &kt, &vt))
			TH_LOG("%s", ape_last_error());
		}
	}
	ape_tensor_init_packed(&qt, q, APE_F32, 6, H, D);
	for (int x = 0; x < 2; x++) {
		ape_tensor_init_packed(&ot, o[x], APE_F32, 6, H, D);
		ASSERT_EQ(0, ape_kv_pool_attend(pool[x], &tp.desc, 3, seq[x], cuq, NULL, &qt, &ot,
						lse[x], NULL))
		TH_LOG("%s", ape_last_error());
		if (x == 0)
			kernels(&d, k, sizeof(k));
	}
	for (int64_t x = 0; x < 6 * H * D; x++)
		eo = fmax(eo, fabs(o[0][x] - o[1][x]));
	for (int64_t x = 0; x < 6 * H; x++)
		el = fmax(el, fabs(lse[0][x] - lse[1][x]) / fmax(1.0, fabs(lse[1][x])));
	EXPECT_LE(eo, test_tol_o(APE_F32) + test_skip_tol_o(tp.desc.skip_tol))
	TH_LOG("O error %.3g", eo);
	EXPECT_LE(el, test_tol_lse(APE_F32) + test_skip_tol_lse(tp.desc.skip_tol))
	TH_LOG("LSE error %.3g", el);
	EXPECT_TRUE(has(k, "ape_decode_merge")) TH_LOG("no decode among \"%s\"", k);
	for (int x = 0; x < 2; x++) {
		ape_kv_pool_destroy(pool[x]);
		free(o[x]);
		free(lse[x]);
	}
	free(q);
	free(kb);
	free(vb);
	test_problem_free(&tp);
	ape_context_destroy(d.ctx);
}

/* The diagnostics (entropy and mean distance over the full scores, the table's included) with
 * skipping allowed, as host tensors and as device tensors with gappy diagnostics' views. */
TEST(diagnostics)
{
	const int ncases = ape_test_slow() ? 3 : 12;
	double worst_e = 0, worst_m = 0;
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "diagnostics");
	for (int c = 0; c < ncases; c++) {
		const test_problem_shape sh = random_shape(&rng, -1, 2, 200000);
		struct rdiag dg[2] = { { .want_ent = true, .want_md = true, .gappy = c % 2 },
				       { .want_ent = true, .want_md = true } };
		test_problem tp, ref;
		char k[1024];

		ASSERT_EQ(0, table_case(&tp, &rng, &sh, c % 3 == 0, c % 2 == 0));
		ASSERT_EQ(0, test_problem_clone(&ref, &tp));
		for (int x = 0; x < 2; x++) {
			dg[x].ent = malloc(sizeof(float) * (tp.rows + 1));
			dg[x].md = malloc(sizeof(float) * (tp.rows + 1));
			ASSERT_TRUE(dg[x].ent && dg[x].md);
		}
		ASSERT_EQ(0, run_resident_diag(&tp, d.ocl, 64, &dg[0])) TH_LOG("%s", ape_last_error());
		kernels(&d, k, sizeof(k));
		EXPECT_TRUE(has(k, "ape_attention")) TH_LOG("not the general kernel: \"%s\"", k);
		EXPECT_EQ(0, dg[0].dirty);
		ASSERT_EQ(0, run_resident_diag(&ref, d.ref, 64, &dg[1])) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, close_enough(_metadata, &tp, &ref, "diagnostics"));
		for (size_t i = 0; i < tp.rows; i++) {
			worst_e = fmax(worst_e, fabs(dg[0].ent[i] - dg[1].ent[i]));
			/* relative to the farthest key's distance, at most the mean's and
			 * the problem's span */
			worst_m = fmax(worst_m, fabs(dg[0].md[i] - dg[1].md[i]) /
							(fabs(dg[1].md[i]) + (double)(sh.Lq + sh.Lk)));
		}
		for (int x = 0; x < 2; x++) {
			free(dg[x].ent);
			free(dg[x].md);
		}
		test_problem_free(&tp);
		test_problem_free(&ref);
	}
	ksft_print_msg("diagnostics: entropy within %.3g, mean distance within %.3g\n", worst_e,
		       worst_m);
	fflush(stdout);
	/* float32 kernels: a few 1e-4 in entropy; mean distance relative to the farthest key */
	EXPECT_LE(worst_e, 2e-3);
	EXPECT_LE(worst_m, 2e-3);
	ape_context_destroy(d.ctx);
}

/* Device tensors laid out like strided host ones ([B, L, H, D] padded) through
 * ape_attention_enqueue: the general kernel, the separable path and the decode read the views
 * and the table. */
TEST(device_views)
{
	const int ncases = ape_test_slow() ? 3 : 12;
	int failed = 0;
	struct devs d;
	ape_rng rng;

	open_recording(_metadata, &d);
	ape_rng_init(&rng, "device_views");
	for (int c = 0; c < ncases; c++) {
		const int kind = c % 3; /* general, separable, decode */
		const test_problem_shape sh =
			random_shape(&rng, kind == 2 ? ape_rng_range(&rng, 1, 4)
						     : 9 + ape_rng_range(&rng, 0, 100),
				     kind == 2 ? 1 : 3, 300000);
		static const char *const want[] = { "ape_attention", "ape_sep_attn",
						    "ape_decode_merge" };
		test_problem tp, ref;
		char k[1024];

		ASSERT_EQ(0, table_case(&tp, &rng, &sh, kind == 1, kind != 2));
		if (!tp.strided) {
			test_problem_free(&tp);
			c--;
			continue;
		}
		ASSERT_EQ(0, test_problem_clone(&ref, &tp));
		ASSERT_EQ(0, run_resident(&tp, d.ocl, 64)) TH_LOG("%s", ape_last_error());
		kernels(&d, k, sizeof(k));
		ASSERT_EQ(0, test_problem_run(&ref, d.ref)) TH_LOG("%s", ape_last_error());
		failed += close_enough(_metadata, &tp, &ref, want[kind]) != 0;
		if (ocl_is_cpu(&d))
			EXPECT_TRUE(has(k, want[kind])) TH_LOG("%s not among \"%s\"", want[kind], k);
		test_problem_free(&tp);
		test_problem_free(&ref);
	}
	EXPECT_EQ(0, failed);
	ape_context_destroy(d.ctx);
}

OPENCL_TEST_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the OpenCL backend is not built into this libape")
#endif /* APE_HAVE_OPENCL */
