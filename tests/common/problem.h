/* SPDX-License-Identifier: MIT */
/*
 * A random APE problem: inputs, parameters, outputs, and the operations tests apply to it (run on
 * a device, evaluate naively, split into chunks, compare). Shared by the reference tests and the
 * tests of every fast backend, so all of them draw the same kinds of cases.
 */
#ifndef APE_TEST_PROBLEM_H
#define APE_TEST_PROBLEM_H

#include "testutil.h"

typedef struct test_problem_shape {
	int64_t B, H, Hkv, Lq, Lk, D;
} test_problem_shape;

typedef struct test_problem {
	test_tensor q, k, v, o;
	bool strided; /* q, k, v, o stored as padded [B, L, H, D] */
	float *lse; /* rows floats, or NULL when the case does not ask for LSE */
	size_t rows; /* B * H * Lq */
	ape_attn_desc desc;
	float *params; /* per-head storage: delta, beta, gamma, lambda, H each */
	int64_t q_start; /* resolved after each run */
	double *naive_o, *naive_lse; /* filled by test_problem_naive() */
	/* the diagnostics' evaluation (naive_attention_diag()), also by test_problem_naive() */
	double *naive_ent, *naive_md, *naive_mdmax;
	float *bias_table; /* NULL, or the table desc.bias_table points to (owned) */
} test_problem;

/* Flags for test_problem_random(). */
#define TEST_PROBLEM_SMALL_POSITIONS (1u << 0) /* |positions| < 1000: for textbook angles */
#define TEST_PROBLEM_NO_LSE_NULL (1u << 1) /* always ask for LSE */

/* Random shape (awkward sizes, GQA), storage type, layout, parameters and positions. */
int test_problem_random(test_problem *tp, ape_rng *r, unsigned flags);
/* Given shape and type; N(0,1) inputs; default parameters (plain RoPE attention). */
int test_problem_make(test_problem *tp, ape_rng *r, const test_problem_shape *sh, ape_dtype dt,
		      bool strided);
/* Random APE parameters (per head or scalar, some negative decays), layout, causality, scale,
 * rope base, positions. */
void test_problem_random_params(test_problem *tp, ape_rng *r);
/*
 * A random distance-bias table for tp's heads into tp->bias_table and tp->desc (bias_table,
 * bias_table_len, bias_table_heads; dbias_table untouched): one of T5-style buckets
 * (log-spaced, learned-looking values), a Gaussian -c n^2, a non-monotone table that rises
 * again far away, random N(0, 1) values; shorter or longer than the distances; per head or
 * shared. -1 if out of memory.
 */
int test_problem_random_table(test_problem *tp, ape_rng *r);
/* No table (frees it). */
void test_problem_no_table(test_problem *tp);

/* Every distance's parameters as the seed notes suggest them for training. */
void test_problem_seed_params(test_problem *tp);
/* test_problem_make() of shape { B, H, Hkv, Lq, Lk, D }, contiguous. */
int test_problem_make_dims(test_problem *tp, ape_rng *r, int64_t B, int64_t H, int64_t Hkv,
			   int64_t Lq, int64_t Lk, int64_t D, ape_dtype dt);
void test_problem_set_params(test_problem *tp, double delta, double beta, double gamma,
			     double lambda);
int test_problem_set_out_dtype(test_problem *tp, ape_dtype dt);
int test_problem_clone(test_problem *dst, const test_problem *src);
void test_problem_free(test_problem *tp);
void test_problem_describe(const test_problem *tp, char *buf, size_t len);

/* Poisons the outputs, then runs; returns the forward call's code. */
int test_problem_run(test_problem *tp, ape_device *dev);
int test_problem_run_stats(test_problem *tp, ape_device *dev, ape_stats *st);

/* The independent long-double evaluation into naive_o / naive_lse; -1 if out of memory. */
int test_problem_naive(test_problem *tp);
/* max |O - naive|, and max |LSE - naive| / max(1, |naive|), over every row */
double test_problem_err_o(const test_problem *tp);
double test_problem_rel_err_lse(const test_problem *tp);
/* The same against another dense result (B*H*Lq*D and B*H*Lq doubles). */
double test_problem_err_o_vs(const test_problem *tp, const double *o);
double test_problem_rel_err_lse_vs(const test_problem *tp, const double *lse);

/*
 * Identity 4 on `dev`: runs the keys in chunks of `chunk` and merges by LSE, then compares with
 * tp's last result (err_o relative to max(1, max|V|), err_lse relative to max(1, |LSE|)).
 */
int test_problem_split_keys(const test_problem *tp, ape_device *dev, int64_t chunk, double *err_o,
			    double *err_lse);
/* Runs the queries in chunks (each with its own q_start) and compares row for row. */
int test_problem_split_queries(const test_problem *tp, ape_device *dev, int64_t chunk,
			       double *err_o);

/* For strided problems: 0 when no padding element of O was written. */
int test_problem_padding_intact(const test_problem *tp);

#endif
