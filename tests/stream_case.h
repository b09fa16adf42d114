/* SPDX-License-Identifier: MIT */
/*
 * The streaming executor tests' helpers (test_stream.c, test_stream_calls.c): a problem run
 * through ape_attention_forward_ex() with chunk options, its errors against another, the check
 * of a streamed run against the one-shot call. Include after the Kselftest harness.
 */
#ifndef APE_TEST_STREAM_CASE_H
#define APE_TEST_STREAM_CASE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/problem.h"
#include "common/refcheck.h"

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

#endif
