/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL tests' comparison against the reference backend (test_opencl.c,
 * test_opencl_fast.c): both devices in one context, the spec's error units, and compare(), which
 * runs a problem on each and checks the tolerance, the backend that ran, NaN left in the
 * outputs, and (for strided problems) O's padding. Include after the Kselftest harness.
 */
#ifndef APE_TEST_OPENCL_COMPARE_H
#define APE_TEST_OPENCL_COMPARE_H

#include <math.h>
#include <string.h>

#include "common/problem.h"

struct devs {
	ape_context *ctx;
	ape_device *ocl, *ref;
};

static void devs_open(struct __test_metadata *_metadata, struct devs *d)
{
	d->ctx = test_context("ref,opencl");
	ASSERT_NE(NULL, d->ctx);
	d->ocl = test_device(d->ctx, "opencl");
	d->ref = test_device(d->ctx, "ref");
	ASSERT_NE(NULL, d->ocl) TH_LOG("no OpenCL device although PoCL should be installed");
	ASSERT_NE(NULL, d->ref);
}

/* The spec's scale for O errors: max |V| (never 0, so that an all-zero V still compares). */
static double v_scale(const test_problem *tp)
{
	return fmax(test_tensor_maxabs(&tp->v.t), 1e-30);
}

static int has_nan(const ape_tensor *t, const float *lse, size_t rows)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					if (isnan(test_tensor_get(t, b, h, l, d)))
						return 1;
	for (size_t r = 0; lse && r < rows; r++)
		if (isnan(lse[r]))
			return 1;
	return 0;
}

/*
 * Runs tp on OpenCL (results in tp; with statistics into st, which asks per-row pair counts of
 * the launches, unless st is NULL) and on the reference (a clone), and measures the error in
 * the spec's units: O relative to max|V|, LSE relative to max(1, |LSE|). Returns 0, or -1 after
 * logging when a run fails or the error exceeds the tolerance of tp's storage type.
 */
static int compare(struct __test_metadata *_metadata, const struct devs *d, test_problem *tp,
		   ape_stats *st, const char *what, double *ratio)
{
	const ape_dtype dt = tp->q.t.dtype;
	test_problem r;
	double eo, el;
	char desc[512];
	int ret = 0;

	if (test_problem_clone(&r, tp))
		return -1;
	if (st)
		ape_stats_init(st);
	test_problem_describe(tp, desc, sizeof(desc));
	if ((st ? test_problem_run_stats(tp, d->ocl, st) : test_problem_run(tp, d->ocl)) ||
	    test_problem_run(&r, d->ref)) {
		TH_LOG("%s: %s: forward failed: %s", what, desc, ape_last_error());
		test_problem_free(&r);
		return -1;
	}
	eo = test_max_err_o(&tp->o.t, &r.o.t) / v_scale(tp);
	el = tp->lse ? test_max_rel_err_lse(tp->lse, r.lse, tp->rows) : 0;
	if (ratio)
		*ratio = fmax(eo / test_tol_o(dt), el / test_tol_lse(dt));
	if (eo > test_tol_o(dt) || el > test_tol_lse(dt)) {
		TH_LOG("%s: %s: O error %.3g (x max|V|, tolerance %g), LSE error %.3g "
		       "(tolerance %g)",
		       what, desc, eo, test_tol_o(dt), el, test_tol_lse(dt));
		ret = -1;
	}
	if (st && tp->rows && tp->k.t.shape[2] && strcmp(st->backend, "opencl")) {
		TH_LOG("%s: ran on backend \"%s\", not opencl", what, st->backend);
		ret = -1;
	}
	if (!has_nan(&r.o.t, r.lse, r.rows) && has_nan(&tp->o.t, tp->lse, tp->rows)) {
		TH_LOG("%s: %s: NaN left in the outputs (an element not written?)", what, desc);
		ret = -1;
	}
	if (tp->strided && test_problem_padding_intact(tp)) {
		TH_LOG("%s: %s: wrote outside O's elements", what, desc);
		ret = -1;
	}
	test_problem_free(&r);
	return ret;
}


/*
 * The OpenCL programs' main() (test_opencl*.c): skips (exit 4) without an OpenCL platform; the
 * tests run in the order they are written; the programs they build go to a cache of their own,
 * not the user's, removed at the harness's exit() in this process (the tests' children leave
 * with _exit()).
 */
#define OPENCL_TEST_MAIN                                                                           \
	static void __attribute__((constructor)) __constructor_order_last(void)                    \
	{                                                                                          \
		if (!__constructor_order)                                                          \
			__constructor_order = _CONSTRUCTOR_ORDER_BACKWARD;                         \
	}                                                                                          \
	static char cache_dir[] = "/tmp/ape-test-opencl-XXXXXX";                                   \
	static void remove_cache_dir(void)                                                         \
	{                                                                                          \
		test_rmtree(cache_dir);                                                            \
	}                                                                                          \
	int main(int argc, char **argv)                                                            \
	{                                                                                          \
		if (test_opencl_platform_present() == 4)                                           \
			ksft_exit_skip("no OpenCL platform on this machine (make deps installs "   \
				       "PoCL)\n");                                                 \
		if (mkdtemp(cache_dir)) {                                                          \
			setenv("APE_CACHE_DIR", cache_dir, 1);                                     \
			atexit(remove_cache_dir);                                                  \
		}                                                                                  \
		return test_harness_run(argc, argv);                                               \
	}

#endif
