/* SPDX-License-Identifier: MIT */
/*
 * The emulated CUDA device's tests' pieces (test_cuda_emu.c, test_cuda_emu_separable.c): the
 * CUDA device beside the reference (on the emulator, or with APE_TEST_CUDA_DEVICE=1 this
 * machine's own driver and GPU), one problem run on both and compared in units of the storage
 * type's tolerance, and the programs' main() (CUDA_EMU_MAIN). Include after the Kselftest
 * harness, with APE_HAVE_CUDA.
 */
#ifndef APE_TEST_CUDA_EMU_PAIR_H
#define APE_TEST_CUDA_EMU_PAIR_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/problem.h"

#define EMU_LIB APE_BUILD_DIR "/tests/cuda_emu/libcuda.so.1"

/* APE_TEST_CUDA_DEVICE=1: the real driver and GPU, not the emulator */
static bool real_device;

struct pair_of_devices {
	ape_context *ctx;
	ape_device *cuda, *ref;
};

static void open_devices(struct __test_metadata *_metadata, struct pair_of_devices *d)
{
	d->ctx = test_context("cuda,ref");
	ASSERT_NE(NULL, d->ctx);
	d->cuda = test_device(d->ctx, "cuda");
	d->ref = test_device(d->ctx, "ref");
	ASSERT_NE(NULL, d->cuda) TH_LOG("no CUDA device (%s)", real_device ? "real" : EMU_LIB);
	ASSERT_NE(NULL, d->ref);
}

/* What one comparison found, in units of the storage type's tolerance. */
struct verdict {
	double o_ratio, lse_ratio;
	uint64_t visible, computed;
	char path[64]; /* the CUDA call's kernel paths (ape_stats.path) */
};

/* Any NaN in O or LSE? (the poison left where nothing was written) */
static bool poisoned(const test_problem *tp)
{
	const ape_tensor *t = &tp->o.t;

	for (size_t r = 0; tp->lse && r < tp->rows; r++)
		if (isnan(tp->lse[r]))
			return true;
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t e = 0; e < t->shape[3]; e++)
					if (isnan(test_tensor_get(t, b, h, l, e)))
						return true;
	return false;
}

/*
 * Runs tp on the emulated CUDA device and a clone on the reference; fills v and returns 0 when
 * both ran, the CUDA result has no NaN where the reference has none, and O and LSE are within
 * the spec's tolerance of tp's storage type; otherwise logs why and returns -1.
 */
static inline int run_both(struct __test_metadata *_metadata, const struct pair_of_devices *d,
			   test_problem *tp, struct verdict *v)
{
	const ape_dtype dt = tp->q.t.dtype;
	const double vmax = fmax(test_tensor_maxabs(&tp->v.t), 1e-30);
	char what[512];
	test_problem ref;
	ape_stats st;
	int ret = 0;

	memset(v, 0, sizeof(*v));
	test_problem_describe(tp, what, sizeof(what));
	if (test_problem_clone(&ref, tp))
		return -1;
	ape_stats_init(&st);
	if (test_problem_run_stats(tp, d->cuda, &st)) {
		TH_LOG("%s: cuda: %s", what, ape_last_error());
		ret = -1;
	} else if (test_problem_run(&ref, d->ref)) {
		TH_LOG("%s: ref: %s", what, ape_last_error());
		ret = -1;
	}
	if (!ret) {
		v->o_ratio = test_max_err_o(&tp->o.t, &ref.o.t) / vmax / test_tol_o(dt);
		v->lse_ratio = tp->lse ? test_max_rel_err_lse(tp->lse, ref.lse, tp->rows) /
						 test_tol_lse(dt)
				       : 0;
		v->visible = st.pairs_visible;
		v->computed = st.pairs_computed;
		snprintf(v->path, sizeof(v->path), "%s", st.path);
		if (!(v->o_ratio <= 1) || !(v->lse_ratio <= 1)) {
			TH_LOG("%s: O error %.3g, LSE error %.3g (x tolerance)", what, v->o_ratio,
			       v->lse_ratio);
			ret = -1;
		}
		if (!poisoned(&ref) && poisoned(tp)) {
			TH_LOG("%s: NaN in the CUDA outputs (an element never written?)", what);
			ret = -1;
		}
		if (tp->rows && tp->k.t.shape[2] && strcmp(st.backend, "cuda")) {
			TH_LOG("%s: ran on \"%s\"", what, st.backend);
			ret = -1;
		}
	}
	test_problem_free(&ref);
	return ret;
}

/* The reason the real backend is absent, or NULL when it has a device. */
static const char *real_cuda_absent(char *why, size_t cap)
{
	ape_context *ctx = test_context("cuda");
	ape_backend_info bi;
	bool ok;

	snprintf(why, cap, "cannot create a context: %s", ape_last_error());
	ok = ctx && !ape_backend_get_info(ctx, 0, &bi) && bi.available;
	if (ctx && !ok)
		snprintf(why, cap, "%s", bi.reason);
	ape_context_destroy(ctx);
	return ok ? NULL : why;
}

#define CUDA_EMU_MAIN                                                                              \
	int main(int argc, char **argv)                                                            \
	{                                                                                          \
		const char *real = getenv("APE_TEST_CUDA_DEVICE");                                 \
		char why[300];                                                                     \
                                                                                                   \
		real_device = real && *real && strcmp(real, "0");                                  \
		unsetenv("FAKE_CUDA_MODE");                                                        \
		if (!real_device && ape_test_slow())                                               \
			ksft_exit_skip("the emulator under valgrind would take tens of minutes; "  \
				       "make sanitize runs it under ASan and UBSan\n");            \
		if (!real_device) {                                                                \
			/* every test (a forked child) drives the emulated driver,                 \
			 * whatever this machine has */                                            \
			setenv("APE_CUDA_LIBRARY", EMU_LIB, 1);                                    \
		} else if (real_cuda_absent(why, sizeof(why))) {                                   \
			ksft_exit_skip("APE_TEST_CUDA_DEVICE is set but there is no CUDA device: " \
				       "%s\n", why);                                               \
		}                                                                                  \
		return test_harness_run(argc, argv);                                               \
	}

#endif
