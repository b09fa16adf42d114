/* SPDX-License-Identifier: MIT */
/*
 * The KV-cache tests' pieces (test_kvcache.c, test_kvcache_inplace.c): a cache's options for a
 * test problem, decoding a problem through a cache, the comparison against the recomputation,
 * and the query norms the release bound depends on. Include after the Kselftest harness.
 */
#ifndef APE_TEST_KVCACHE_CASE_H
#define APE_TEST_KVCACHE_CASE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/problem.h"

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

#endif
