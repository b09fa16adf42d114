/* SPDX-License-Identifier: MIT */
/*
 * Distance-bias tables on the CUDA backend (struct ape_be_launch.bias_table; the backward's
 * dbias) against the reference backend, with no GPU: the fake driver of tests/fake_cuda built
 * with the emulator (cuda/emu) runs every launch on the CPU (test_cuda_emu.c says what that
 * proves and what it cannot). Every launch kind the CUDA device takes, each with tables:
 *   - the general prefill and the decode (every head-size variant, f32/f16/bf16, GQA, random
 *     tables of test_problem_random_table(): shorter or longer than the distances, shared or
 *     per head, rising again far away);
 *   - skipping (prefill, decode through ape_dwindow, separable) with a table that jumps up far
 *     away, which the suffix maxima must keep in the bound, and one that falls, which must still
 *     let far keys go;
 *   - the separable path (lambda = 0 everywhere) and launches mixing it with the general kernel
 *     (sub-launches whose table rows move with their heads);
 *   - the diagnostics' twins; chunked calls (lse_prior between launches); keys read in place
 *     from a KV cache (pages); device-resident calls on strided views;
 *   - the backward: dQ, dK, dV, dparams and the table's gradient against the reference, the
 *     gradient bit for bit the same alone or with every other output, and chunked.
 * Ragged launches with tables: test_cuda_emu_varlen.c.
 *
 * Fresh random inputs each run (APE_TEST_SEED replays one); small shapes for the emulator's
 * speed. With APE_TEST_CUDA_DEVICE=1 the same tests run on this machine's own driver and GPU.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/bwdcase.h"
#include "common/problem.h"
#include "common/resident.h"

#ifdef APE_HAVE_CUDA
#include "../cuda/cu.h" /* ape__cu_separable_applies() */
#include "cuda_emu_pair.h"

static const ape_dtype all_types[] = { APE_F32, APE_F16, APE_BF16 };

/* How set_table() shapes a table: far entries far above the near ones, or a falling Gaussian. */
enum table_kind { TABLE_JUMP, TABLE_FALL };

/*
 * A table of M = Lq + Lk entries on tp, one row per head or (shared) one: TABLE_JUMP is 0 up to
 * distance `at`, then `up` (per head h, up + h): with the seed's decays, keys past `at` outweigh
 * the near ones, which only a bound with the table's suffix maxima sees; TABLE_FALL is
 * -0.01 m^2, which a bound keeps letting far keys go.
 */
static int set_table(test_problem *tp, enum table_kind kind, bool shared, int64_t at, double up)
{
	const int64_t H = tp->q.t.shape[1], M = tp->q.t.shape[2] + tp->k.t.shape[2];
	const int64_t rows = shared ? 1 : H;
	float *t = malloc(sizeof(float) * (size_t)(rows * M));

	if (!t)
		return -1;
	for (int64_t h = 0; h < rows; h++)
		for (int64_t m = 0; m < M; m++)
			t[h * M + m] = kind == TABLE_JUMP ? (m < at ? 0.0f : (float)(up + (double)h))
							  : (float)(-0.01 * (double)m * (double)m);
	free(tp->bias_table);
	tp->bias_table = t;
	tp->desc.bias_table = t;
	tp->desc.bias_table_len = M;
	tp->desc.bias_table_heads = rows;
	return 0;
}

/* ---- the forward: general prefill and decode */

/*
 * Every head-size variant (D = 64, 128; 40 through the generic 128 path, 130 through the
 * generic 256 one), decode rows (1, 7) and prefill ones (63, 150), the types rotating, every
 * other case strided, random parameters and random tables.
 */
TEST(random_tables_match_reference)
{
	static const int64_t dims[] = { 64, 128, 40, 130 };
	static const int64_t lens[] = { 1, 7, 63, 150 };
	struct pair_of_devices d;
	double worst = 0;
	int fails = 0, runs = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_random");
	for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
		for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
			const int64_t D = dims[di], Lq = lens[li];
			const int64_t Lk = Lq <= 16 ? ape_rng_range(&rng, Lq, 500) : Lq;
			const bool big = Lq > 100 || D > 128;
			const int64_t Hkv = big ? 1 : ape_rng_range(&rng, 1, 2);
			const int64_t H = Hkv * (big ? 1 : ape_rng_range(&rng, 1, 3));
			test_problem tp;
			struct verdict v;

			const test_problem_shape sh = { 1, H, Hkv, Lq, Lk, D };

			/* every other case strided: padded [B, L, H, D] views */
			ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, all_types[(di + li) % 3],
						       (di + li) % 2));
			test_problem_random_params(&tp, &rng);
			ASSERT_EQ(0, test_problem_random_table(&tp, &rng));
			fails += run_both(_metadata, &d, &tp, &v) != 0;
			worst = fmax(worst, fmax(v.o_ratio, v.lse_ratio));
			EXPECT_STREQ(Lq <= 16 ? "decode" : "general", v.path);
			runs++;
			test_problem_free(&tp);
		}
	TH_LOG("%d cases, worst error %.3g of the tolerance", runs, worst);
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

struct skip_spec {
	int64_t Lq, Lk, D;
	ape_dtype dt;
	bool causal;
};

/* Prefill (Lq > 16) and decode (through ape_dwindow) launches that skip with the seed's decays. */
static const struct skip_spec skips[] = {
	{ 400, 400, 64, APE_F32, true },  { 300, 300, 128, APE_F16, false },
	{ 1, 1500, 128, APE_F16, true }, { 9, 1500, 64, APE_BF16, false },
};

/*
 * Skipping with tables (the seed's decays, skipping on): one that jumps by 45 at distance 100
 * (the decay bias there is about -40, so the keys beyond weigh more than the near ones: a bound
 * without the table's suffix maxima would drop them), per head, and a falling one, shared;
 * both within tolerance of the reference, and the falling one still leaves far keys out.
 */
TEST(skipping_bounds_take_the_table)
{
	struct pair_of_devices d;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_skip");
	for (size_t i = 0; i < sizeof(skips) / sizeof(skips[0]); i++)
		for (int kind = TABLE_JUMP; kind <= TABLE_FALL; kind++) {
			const struct skip_spec *c = &skips[i];
			test_problem tp;
			struct verdict v;

			ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 1, c->Lq, c->Lk, c->D,
							    c->dt));
			test_problem_seed_params(&tp);
			tp.desc.causal = c->causal;
			ASSERT_EQ(0, set_table(&tp, (enum table_kind)kind, kind == TABLE_FALL, 100,
					       45.0));
			EXPECT_EQ(0, run_both(_metadata, &d, &tp, &v));
			TH_LOG("Lq=%lld Lk=%lld D=%lld %s, %s table: %llu of %llu visible pairs "
			       "computed",
			       (long long)c->Lq, (long long)c->Lk, (long long)c->D,
			       c->causal ? "causal" : "non-causal",
			       kind == TABLE_JUMP ? "jumping" : "falling",
			       (unsigned long long)v.computed, (unsigned long long)v.visible);
			EXPECT_LE(v.computed, v.visible);
			if (kind == TABLE_FALL)
				EXPECT_LT(v.computed, c->causal ? v.visible / 2 : v.visible * 2 / 3);
			test_problem_free(&tp);
		}
	ape_context_destroy(d.ctx);
}

/*
 * The _diag kernels with tables (decode over several splits, prefill, generic D; random
 * parameters, or the seed's with skipping): O and LSE bit for bit those of the same call
 * without the diagnostics, ENT and MD within tolerance of the independent evaluation.
 */
TEST(diagnostics_with_tables)
{
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 3, 900, 64 },
		{ 1, 2, 1, 70, 90, 128 },
		{ 1, 2, 2, 20, 40, 40 },
	};
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_diag");
	for (size_t c = 0; c < 2 * sizeof(shapes) / sizeof(shapes[0]); c++) {
		const size_t rows = (size_t)(shapes[c / 2].B * shapes[c / 2].H * shapes[c / 2].Lq);
		float *lse2 = malloc(sizeof(float) * rows), *ent = malloc(sizeof(float) * rows);
		float *md = malloc(sizeof(float) * rows);
		test_problem tp;
		ape_exec_options o;
		ape_tensor o2;
		void *obuf;
		char what[512];

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &shapes[c / 2], all_types[c % 3], false));
		if (c % 2) {
			test_problem_seed_params(&tp); /* skipping on */
			ASSERT_EQ(0, set_table(&tp, TABLE_JUMP, true, 30, 8.0));
		} else {
			test_problem_random_params(&tp, &rng);
			ASSERT_EQ(0, test_problem_random_table(&tp, &rng));
		}
		ASSERT_EQ(0, test_problem_naive(&tp));
		test_problem_describe(&tp, what, sizeof(what));
		obuf = malloc(tp.o.alloc_bytes); /* contiguous: data is the allocation */
		ASSERT_TRUE(obuf && lse2 && ent && md);
		o2 = tp.o.t;
		o2.data = obuf;
		ape_exec_options_init(&o);
		ASSERT_EQ(0, ape_attention_forward_ex(&d.cuda, 1, &o, &tp.desc, &tp.q.t, &tp.k.t,
						      &tp.v.t, &tp.o.t, tp.lse, NULL))
			TH_LOG("%s: %s", what, ape_last_error());
		ASSERT_EQ(0, ape_attention_forward_diag(&d.cuda, 1, &o, &tp.desc, &tp.q.t, &tp.k.t,
							&tp.v.t, &o2, lse2, ent, md, NULL))
			TH_LOG("%s: %s", what, ape_last_error());
		if (memcmp(obuf, tp.o.t.data, tp.o.alloc_bytes) ||
		    memcmp(lse2, tp.lse, sizeof(float) * rows)) {
			TH_LOG("%s: O or LSE differ with the diagnostics", what);
			fails++;
		}
		for (size_t r = 0; r < rows; r++) {
			const double l = tp.naive_lse[r];
			const double ee = fabs(ent[r] - tp.naive_ent[r]) /
					  fmax(1, isfinite(l) ? fabs(l) : 1);
			const double em = fabs(md[r] - tp.naive_md[r]) / fmax(1, tp.naive_mdmax[r]);

			if (!(ee <= test_tol_lse(tp.q.t.dtype)) ||
			    !(em <= test_tol_lse(tp.q.t.dtype))) {
				TH_LOG("%s: row %zu: ENT %.9g (want %.9g), MD %.9g (want %.9g)", what,
				       r, ent[r], tp.naive_ent[r], md[r], tp.naive_md[r]);
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

/* ---- the separable path */

/* What the separable predicate reads of the launch the core makes for tp in one piece. */
static bool takes_separable(const test_problem *tp)
{
	const int64_t H = tp->q.t.shape[1];
	struct ape_be_launch l;
	float hp[4 * 8];

	memset(&l, 0, sizeof(l));
	l.B = tp->q.t.shape[0];
	l.H = H;
	l.Hkv = tp->k.t.shape[1];
	l.Lq = tp->q.t.shape[2];
	l.Lk = tp->k.t.shape[2];
	l.D = tp->q.t.shape[3];
	l.in_dtype = tp->q.t.dtype;
	for (int64_t h = 0; h < H; h++) {
		const ape_param *pp[4] = { &tp->desc.delta, &tp->desc.beta, &tp->desc.gamma,
					   &tp->desc.lambda };

		for (int p = 0; p < 4; p++)
			hp[4 * h + p] = pp[p]->per_head ? pp[p]->per_head[h] : pp[p]->value;
	}
	l.head_params = hp;
	return ape__cu_separable_applies(&l);
}

/*
 * lambda = 0 on every head (f16 and bf16, D = 64 and 128): random tables (cases 0, 1); a decay
 * of 0.5, causal, skipping, with a table that jumps by 55 at distance 100 (case 2: the keys
 * beyond outweigh the near ones) or falls (case 3: far keys still left out); launches mixing a
 * lambda != 0 kv group with separable ones (cases 4, 5; no pair counts: sub-launches per run of
 * kv groups, each with its heads' table rows). All within tolerance of the reference.
 */
TEST(separable_with_tables)
{
	struct pair_of_devices d;
	double worst = 0;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_separable");
	for (int c = 0; c < 6; c++) {
		const bool skip = c == 2 || c == 3, mixed = c >= 4;
		const int64_t D = c % 2 && !skip ? 128 : 64;
		const int64_t L = skip ? 300 : D == 128 ? 100 : 170;
		const int64_t Hkv = mixed ? 2 : 1 + c % 2, H = Hkv * 2;
		test_problem tp;
		struct verdict v;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, H, Hkv, L, skip ? L : L - 7 * c, D,
						    c % 3 ? APE_BF16 : APE_F16));
		if (skip) {
			test_problem_set_params(&tp, 0.5, 0, 0, 0);
			tp.desc.causal = true;
			ASSERT_EQ(0, set_table(&tp, c == 2 ? TABLE_JUMP : TABLE_FALL, c == 3, 100,
					       55.0));
		} else {
			test_problem_random_params(&tp, &rng);
			for (int64_t h = 0; h < H; h++) /* per head, lambda = 0 */
				for (int p = 0; p < 4; p++) {
					const ape_param *pp = p == 0   ? &tp.desc.delta
							      : p == 1 ? &tp.desc.beta
							      : p == 2 ? &tp.desc.gamma
								       : &tp.desc.lambda;

					tp.params[p * H + h] =
						p == 3 ? 0.0f : pp->per_head ? pp->per_head[h] : pp->value;
				}
			tp.desc.delta = (ape_param){ 0, tp.params };
			tp.desc.beta = (ape_param){ 0, tp.params + H };
			tp.desc.gamma = (ape_param){ 0, tp.params + 2 * H };
			tp.desc.lambda = (ape_param){ 0, tp.params + 3 * H };
			if (mixed) { /* the last kv group's heads are not separable */
				tp.params[3 * H + H - 1] = 0.25f;
				tp.params[3 * H + H - 2] = 0.5f;
			}
			ASSERT_EQ(0, test_problem_random_table(&tp, &rng));
		}
		EXPECT_EQ(!mixed, takes_separable(&tp));
		if (mixed) { /* without pair counts (ape_stats), which keep a launch whole */
			test_problem r;
			double eo, el;

			ASSERT_EQ(0, test_problem_clone(&r, &tp));
			ASSERT_EQ(0, test_problem_run(&tp, d.cuda)) TH_LOG("%s", ape_last_error());
			ASSERT_EQ(0, test_problem_run(&r, d.ref)) TH_LOG("%s", ape_last_error());
			eo = test_max_err_o(&tp.o.t, &r.o.t) / fmax(test_tensor_maxabs(&tp.v.t), 1e-30) /
			     test_tol_o(tp.q.t.dtype);
			el = test_max_rel_err_lse(tp.lse, r.lse, tp.rows) / test_tol_lse(tp.q.t.dtype);
			if (!(eo <= 1) || !(el <= 1)) {
				TH_LOG("case %d (mixed): O error %.3g, LSE error %.3g (x tolerance)",
				       c, eo, el);
				fails++;
			}
			worst = fmax(worst, fmax(eo, el));
			test_problem_free(&r);
		} else {
			fails += run_both(_metadata, &d, &tp, &v) != 0;
			worst = fmax(worst, fmax(v.o_ratio, v.lse_ratio));
			TH_LOG("case %d: %llu of %llu visible pairs computed", c,
			       (unsigned long long)v.computed, (unsigned long long)v.visible);
			EXPECT_STREQ("separable", v.path);
			if (c == 3)
				EXPECT_LT(v.computed, v.visible);
		}
		test_problem_free(&tp);
	}
	TH_LOG("worst error %.3g of the tolerance", worst);
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* ---- chunked calls and keys read in place */

/*
 * One call in chunks of 128 query rows and keys on the CUDA device (each launch a slice of the
 * distances, lse_prior from the chunks before, merged by LSE) against the reference's one
 * launch: a jumping table with skipping, and a random one, within tolerance.
 */
TEST(chunked_calls_with_tables)
{
	struct pair_of_devices d;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_chunks");
	for (int c = 0; c < 2; c++) {
		test_problem tp, want;
		ape_exec_options o;
		ape_stats st;
		double eo, el;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 1, 384, 384, 64,
						    c ? APE_F16 : APE_F32));
		if (c) {
			test_problem_random_params(&tp, &rng);
			ASSERT_EQ(0, test_problem_random_table(&tp, &rng));
		} else {
			test_problem_seed_params(&tp);
			tp.desc.causal = true;
			ASSERT_EQ(0, set_table(&tp, TABLE_JUMP, false, 150, 60.0));
		}
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, d.ref)) TH_LOG("%s", ape_last_error());
		ape_exec_options_init(&o);
		o.chunk_q = o.chunk_k = 128;
		test_tensor_poison(&tp.o.t);
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_attention_forward_ex(&d.cuda, 1, &o, &tp.desc, &tp.q.t, &tp.k.t,
						      &tp.v.t, &tp.o.t, tp.lse, &st))
			TH_LOG("%s", ape_last_error());
		eo = test_max_err_o(&tp.o.t, &want.o.t) / fmax(test_tensor_maxabs(&tp.v.t), 1e-30);
		el = test_max_rel_err_lse(tp.lse, want.lse, tp.rows);
		TH_LOG("case %d: %llu launches, %llu of %llu pairs, O error %.3g, LSE error %.3g",
		       c, (unsigned long long)st.chunks, (unsigned long long)st.pairs_computed,
		       (unsigned long long)st.pairs_visible, eo, el);
		EXPECT_STREQ("cuda", st.backend);
		EXPECT_LE(eo, test_tol_o(tp.q.t.dtype) + test_skip_tol_o(tp.desc.skip_tol));
		EXPECT_LE(el, test_tol_lse(tp.q.t.dtype) + test_skip_tol_lse(tp.desc.skip_tol));
		test_problem_free(&want);
		test_problem_free(&tp);
	}
	ape_context_destroy(d.ctx);
}

/*
 * Decode rows attending a KV cache on the CUDA device (keys read where the cache keeps them, in
 * blocks of 16 tokens) with a table, against the reference's plain call: a random table without
 * skipping, the seed's decays with a falling table and with one that jumps far away, skipping
 * (ape_dwindow over the pages).
 */
TEST(kv_cache_attend_with_tables)
{
	struct pair_of_devices d;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_kv");
	for (int c = 0; c < 3; c++) {
		const int64_t Lq = c ? 3 : 1, Lk = 700;
		test_problem tp, want;
		ape_kv_cache_options o;
		ape_kv_cache *cache;
		ape_stats st;
		double eo, el;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 4, 2, Lq, Lk, 64,
						    c ? APE_BF16 : APE_F16));
		if (c) {
			test_problem_seed_params(&tp);
			ASSERT_EQ(0, set_table(&tp, c == 1 ? TABLE_FALL : TABLE_JUMP, false, 100, 45.0));
		} else {
			test_problem_random_params(&tp, &rng);
			ASSERT_EQ(0, test_problem_random_table(&tp, &rng));
			tp.desc.skip_tol = 0;
		}
		tp.desc.causal = true;
		tp.desc.q_start_set = false; /* end-aligned: the cache's default */
		tp.desc.k_start = 0;
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, d.ref)) TH_LOG("%s", ape_last_error());
		ape_kv_cache_options_init(&o);
		o.B = 1;
		o.H = 4;
		o.Hkv = 2;
		o.D = 64;
		o.dtype = tp.q.t.dtype;
		o.block_tokens = 16;
		o.capacity_tokens = Lk;
		o.k_start = tp.desc.k_start;
		ASSERT_EQ(0, ape_kv_cache_create(d.cuda, &o, &cache)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_kv_cache_append(cache, &tp.k.t, &tp.v.t)) TH_LOG("%s", ape_last_error());
		test_tensor_poison(&tp.o.t);
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_kv_cache_attend(cache, &tp.desc, &tp.q.t, &tp.o.t, tp.lse, &st))
			TH_LOG("%s", ape_last_error());
		EXPECT_STREQ("decode-in-place", st.path);
		eo = test_max_err_o(&tp.o.t, &want.o.t) / fmax(test_tensor_maxabs(&tp.v.t), 1e-30);
		el = test_max_rel_err_lse(tp.lse, want.lse, tp.rows);
		EXPECT_LE(eo, test_tol_o(tp.q.t.dtype) + test_skip_tol_o(tp.desc.skip_tol))
			TH_LOG("case %d", c);
		EXPECT_LE(el, test_tol_lse(tp.q.t.dtype) + test_skip_tol_lse(tp.desc.skip_tol))
			TH_LOG("case %d", c);
		ape_kv_cache_destroy(cache);
		test_problem_free(&want);
		test_problem_free(&tp);
	}
	ape_context_destroy(d.ctx);
}

/*
 * Device-resident calls (ape_attention_enqueue(): the launches' tensors where the caller's
 * buffers keep them, strided or not) with random tables, prefill and decode, against the
 * reference.
 */
TEST(resident_calls_with_tables)
{
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_resident");
	for (int c = 0; c < 4; c++) {
		const test_problem_shape sh = { 1, 4, 2, c < 2 ? 70 : 5, c < 2 ? 90 : 400, 64 };
		test_problem tp, want;
		double eo, el;

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, all_types[c % 3], c % 2));
		test_problem_random_params(&tp, &rng);
		ASSERT_EQ(0, test_problem_random_table(&tp, &rng));
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, d.ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, run_resident(&tp, d.cuda, 64)) TH_LOG("%s", ape_last_error());
		eo = test_max_err_o(&tp.o.t, &want.o.t) / fmax(test_tensor_maxabs(&tp.v.t), 1e-30) /
		     test_tol_o(tp.q.t.dtype);
		el = test_max_rel_err_lse(tp.lse, want.lse, tp.rows) / test_tol_lse(tp.q.t.dtype);
		if (!(eo <= 1) || !(el <= 1)) {
			TH_LOG("case %d: O error %.3g, LSE error %.3g (x tolerance)", c, eo, el);
			fails++;
		}
		test_problem_free(&want);
		test_problem_free(&tp);
	}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* ---- the backward */

/* max |a - b| / max |b| over n entries (a NaN in a counts as infinite). */
static double rel_err(const float *a, const float *b, int64_t n)
{
	double err = 0, m = 1e-30;

	for (int64_t i = 0; i < n; i++) {
		err = fmax(err, isnan(a[i]) ? INFINITY : fabs((double)a[i] - b[i]));
		m = fmax(m, fabs((double)b[i]));
	}
	return err / m;
}

/*
 * Backward launches with tables (the fused sweep's shapes: every head-size variant, GQA, two
 * batches, several splits over the key tiles, positions near 2^40), causal or not, the types
 * rotating, random tables (shared or per head): dQ, dK, dV, dparams and the table's gradient
 * within the spec's tolerance of the reference's; the gradient alone (no other output) bit for
 * bit the one computed beside the others, and again the same on a rerun; every other case also
 * chunked (16 query rows, 64 keys per launch), its gradient within tolerance.
 */
TEST(backward_with_tables)
{
	static const test_problem_shape shapes[] = {
		{ 1, 1, 1, 66, 65, 64 },  { 1, 2, 1, 33, 40, 128 }, { 2, 2, 2, 33, 20, 40 },
		{ 1, 1, 1, 17, 20, 130 }, { 1, 2, 2, 21, 150, 130 }, { 1, 2, 1, 9, 300, 64 },
	};
	const int ncases = sizeof(shapes) / sizeof(shapes[0]);
	struct pair_of_devices d;
	double worst = 0;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_table_backward");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i];
		const ape_dtype dt = all_types[i % 3];
		const double tol = grads_tol(dt);
		const bool tail = sh->Lk > 4 * sh->Lq;
		grads want, g, chunked;
		float *db[4];
		int64_t nt;
		double e[6];
		char what[512];
		bcase c;

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, false, i % 2 == 0));
		test_problem_random_params(&c.tp, &rng);
		/* a one-entry table's gradient is sum dS = sum dLSE (softmax ignores a shift): 0
		 * without dLSE, rounding noise with nothing to measure it against */
		do {
			ASSERT_EQ(0, test_problem_random_table(&c.tp, &rng));
		} while (!c.dlse && c.tp.desc.bias_table_len == 1);
		c.tp.desc.causal = i % 3 != 2;
		c.tp.desc.k_start = i % 3 == 1 ? ((int64_t)1 << 40) + i : i - 5;
		c.tp.desc.q_start = c.tp.desc.k_start + (tail ? sh->Lk - sh->Lq : -2);
		c.tp.desc.q_start_set = true;
		ASSERT_EQ(0, bcase_forward(&c, d.ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, APE_F32));
		nt = c.tp.desc.bias_table_heads * c.tp.desc.bias_table_len;
		for (int x = 0; x < 4; x++) {
			db[x] = malloc(sizeof(float) * (size_t)nt);
			ASSERT_NE(NULL, db[x]);
		}
		test_problem_describe(&c.tp, what, sizeof(what));
		c.tp.desc.dbias_table = db[0];
		ASSERT_EQ(0, run_backward(&c, d.ref, &want, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		c.tp.desc.dbias_table = db[1];
		EXPECT_EQ(0, run_backward(&c, d.cuda, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		c.tp.desc.dbias_table = db[2]; /* the table's gradient alone */
		EXPECT_EQ(0, run_backward(&c, d.cuda, &g, 0, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, memcmp(db[1], db[2], sizeof(float) * (size_t)nt))
			TH_LOG("case %d: %s: the gradient alone differs", i, what);
		e[0] = grads_rel_err(&g.dq.t, &want.dq.t);
		e[1] = grads_rel_err(&g.dk.t, &want.dk.t);
		e[2] = grads_rel_err(&g.dv.t, &want.dv.t);
		e[3] = grads_rel_err_params(g.dparams, want.dparams, sh->H);
		e[4] = rel_err(db[1], db[0], nt);
		e[5] = 0;
		if (i % 2) { /* chunked: several launches, each adding to the gradient */
			c.tp.desc.dbias_table = db[3];
			EXPECT_EQ(0, run_chunked(&c, d.cuda, &chunked, 16, 64, NULL))
				TH_LOG("%s", ape_last_error());
			e[5] = rel_err(db[3], db[0], nt);
		} else { /* a rerun: the same bits */
			c.tp.desc.dbias_table = db[3];
			EXPECT_EQ(0, run_backward(&c, d.cuda, &chunked, 0, NULL));
			EXPECT_EQ(0, memcmp(db[1], db[3], sizeof(float) * (size_t)nt))
				TH_LOG("case %d: %s: reruns differ", i, what);
		}
		for (int x = 0; x < 6; x++) {
			static const char *const names[6] = { "dq", "dk", "dv", "dparams", "dbias",
							      "chunked dbias" };

			worst = fmax(worst, e[x] / tol);
			if (!(e[x] <= tol)) {
				TH_LOG("case %d: %s: %s error %.3g of max |G| (tolerance %.3g)", i,
				       what, names[x], e[x], tol);
				fails++;
			}
		}
		c.tp.desc.dbias_table = NULL;
		for (int x = 0; x < 4; x++)
			free(db[x]);
		grads_free(&want);
		grads_free(&g);
		grads_free(&chunked);
		bcase_free(&c);
	}
	TH_LOG("%d cases, worst error %.3g of the tolerance", ncases, worst);
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

CUDA_EMU_MAIN
#else
TEST_HARNESS_MAIN
#endif
