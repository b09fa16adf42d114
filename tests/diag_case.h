/* SPDX-License-Identifier: MIT */
/*
 * The diagnostics tests' pieces (test_diag.c, test_diag_kernels.c): a result's entropy and mean
 * distance rows, one forward_diag call, the tolerance and the errors against the naive
 * evaluation, fixed cases, a KV cache's options. Include after the Kselftest harness.
 */
#ifndef APE_TEST_DIAG_CASE_H
#define APE_TEST_DIAG_CASE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/problem.h"

struct diag {
	float *ent, *md;
	size_t rows;
};

static int diag_alloc(struct diag *d, size_t rows)
{
	d->rows = rows;
	d->ent = malloc(sizeof(float) * (rows + 1));
	d->md = malloc(sizeof(float) * (rows + 1));
	for (size_t i = 0; d->ent && d->md && i < rows; i++)
		d->ent[i] = d->md[i] = NAN; /* poison: every row must be written */
	return d->ent && d->md ? 0 : -1;
}

static void diag_free(struct diag *d)
{
	free(d->ent);
	free(d->md);
}

static int run_diag(test_problem *tp, ape_device *const *devs, int ndev,
		    const ape_exec_options *o, struct diag *d)
{
	test_tensor_poison(&tp->o.t);
	return ape_attention_forward_diag(devs, ndev, o, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t,
					  &tp->o.t, tp->lse, d->ent, d->md, NULL);
}

static double tol_of(const test_problem *tp)
{
	return test_tol_lse(tp->q.t.dtype);
}

/* NaN must meet NaN; else |a - b| / scale */
static double rel(double a, double b, double scale)
{
	if (isnan(a) || isnan(b))
		return isnan(a) && isnan(b) ? 0 : INFINITY;
	return fabs(a - b) / scale;
}

/* Largest error of d against the naive evaluation, in units of the tolerance's scale:
 * ENT relative to max(1, |LSE|), MD relative to max(1, the row's largest |n|). */
static void err_naive(const test_problem *tp, const struct diag *d, double *ee, double *em)
{
	*ee = *em = 0;
	for (size_t i = 0; i < tp->rows; i++) {
		const double l = tp->naive_lse[i];
		const double se = fmax(1, isfinite(l) ? fabs(l) : 1);

		*ee = fmax(*ee, rel(d->ent[i], tp->naive_ent[i], se));
		*em = fmax(*em, rel(d->md[i], tp->naive_md[i], fmax(1, tp->naive_mdmax[i])));
	}
}

/* A case of shape sh and storage dt, N(0,1) inputs, plain RoPE parameters, seeded by `name` */
static int fixed_case(test_problem *tp, const char *name, const test_problem_shape *sh,
		      ape_dtype dt)
{
	ape_rng rng;

	ape_rng_init(&rng, name);
	return test_problem_make(tp, &rng, sh, dt, false);
}
/* A cache for problem shape sh (its Lk keys) in blocks of 64 tokens, attended in chunks of 128
 * keys (several key chunks: the merge runs). */
static void kv_options(ape_kv_cache_options *ko, const test_problem_shape *sh, ape_dtype dt)
{
	ape_kv_cache_options_init(ko);
	ko->B = sh->B;
	ko->Hkv = sh->Hkv;
	ko->H = sh->H;
	ko->D = sh->D;
	ko->dtype = dt;
	ko->capacity_tokens = sh->Lk;
	ko->block_tokens = 64;
	ko->attend_chunk = 128;
}

/* the tests' chunk options (common/testutil.h) */
#define chunks test_chunks

#endif
