/* SPDX-License-Identifier: MIT */
/*
 * One call over several devices, on every backend (common/backend_fixture.h: the reference,
 * OpenCL, CUDA on the emulator where there is no GPU): one device listed twice, four entries at
 * once; and devices of different backends together (the reference, OpenCL and CUDA in pairs, two
 * emulated CUDA devices). The result equals one device's within the spec's tolerance, work goes
 * where the weights say, speeds are remembered, and a failing device fails the call.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"
#include "common/wrapops.h"
#include "core/context.h"

static int run(test_problem *tp, ape_device *const *devs, int ndev, const ape_exec_options *o,
	       ape_stats *st)
{
	test_tensor_poison(&tp->o.t);
	for (size_t i = 0; tp->lse && i < tp->rows; i++)
		tp->lse[i] = NAN;
	if (st)
		ape_stats_init(st);
	return ape_attention_forward_ex(devs, ndev, o, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t,
					&tp->o.t, tp->lse, st);
}

static int same_within_tol(struct __test_metadata *_metadata, const test_problem *a,
			   const test_problem *b, const char *what)
{
	const ape_dtype dt = a->q.t.dtype;
	double eo = test_max_err_o(&a->o.t, &b->o.t) / fmax(test_tensor_maxabs(&a->v.t), 1e-30);
	double el = a->lse ? test_max_rel_err_lse(a->lse, b->lse, a->rows) : 0;

	if (eo <= test_tol_o(dt) && el <= test_tol_lse(dt))
		return 0;
	TH_LOG("%s: O error %.3g, LSE error %.3g", what, eo, el);
	return -1;
}

/* Several entries against one: random problems, chunked so that every device gets work. */
static void compare_sets(struct __test_metadata *_metadata, ape_device *single,
			 ape_device *const *set, int n, int ncases, int64_t maxlen, const char *what)
{
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, what);
	for (int c = 0; c < ncases; c++) {
		test_problem one, many;
		ape_exec_options o;
		ape_stats st;

		ASSERT_EQ(0, test_problem_random(&one, &rng, TEST_PROBLEM_NO_LSE_NULL));
		if (one.q.t.shape[2] > maxlen || one.k.t.shape[2] > maxlen) {
			test_problem_free(&one);
			c--;
			continue;
		}
		ape_exec_options_init(&o);
		o.chunk_q = 1 + c % 16;
		o.chunk_k = 1 + (c * 7) % 32;
		ASSERT_EQ(0, test_problem_clone(&many, &one));
		ASSERT_EQ(0, run(&one, &single, 1, &o, NULL)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, run(&many, set, n, &o, &st)) TH_LOG("%s", ape_last_error());
		failed += same_within_tol(_metadata, &many, &one, what) != 0;
		if (many.rows && many.k.t.shape[2])
			EXPECT_EQ(n, st.devices);
		test_problem_free(&one);
		test_problem_free(&many);
	}
	EXPECT_EQ(0, failed);
}

/* ---- one backend's device, listed several times */

BACKEND_FIXTURE(multi)

/*
 * The emulator runs kernels on the CPU, one fiber per GPU thread, and each launch costs it
 * milliseconds: fewer cases, at most 16 rows (the first case, in one-row chunks, launches once
 * per query and key).
 */
TEST_F(multi, same_device_twice)
{
	ape_device *set[2] = { self->dev, self->dev };

	compare_sets(_metadata, self->dev, set, 2, ape_test_slow() ? 4 : self->emu ? 6 : 30,
		     self->emu ? 16 : 100, "same_device_twice");
}

TEST_F(multi, four_entries)
{
	ape_device *set[4] = { self->dev, self->ref, self->dev, self->ref };

	compare_sets(_metadata, self->dev, set, 4, ape_test_slow() ? 2 : self->emu ? 4 : 10,
		     self->emu ? 16 : 33, "four_entries");
}

/* ---- devices of different backends together */

FIXTURE(mixed)
{
	ape_context *ctx;
	ape_device *a, *b;
	bool emu;
};

FIXTURE_VARIANT(mixed)
{
	const char *a, *b; /* the backends; a's device also runs each call alone */
	int b_index; /* b's device among its backend's */
	const char *fake_mode; /* FAKE_CUDA_MODE of the emulated driver */
};

FIXTURE_VARIANT_ADD(mixed, ref_opencl){ .a = "ref", .b = "opencl" };
FIXTURE_VARIANT_ADD(mixed, ref_cuda){ .a = "ref", .b = "cuda" };
FIXTURE_VARIANT_ADD(mixed, opencl_cuda){ .a = "opencl", .b = "cuda" };
/* two CUDA devices: the emulated driver's two-device mode, or a machine with two GPUs */
FIXTURE_VARIANT_ADD(mixed, cuda_two_devices){ .a = "cuda", .b = "cuda", .b_index = 1,
					      .fake_mode = "two-devices" };

FIXTURE_SETUP(mixed)
{
	const bool same = !strcmp(variant->a, variant->b);
	char why[TEST_WHY_LEN], names[32];
	ape_selection sel;

	if (test_backend_prepare(variant->a, variant->fake_mode, why, sizeof(why)) ||
	    test_backend_prepare(variant->b, variant->fake_mode, why, sizeof(why)))
		APE_SETUP_SKIP((void)0, "%s", why);
	snprintf(names, sizeof(names), "%s%s%s", variant->a, same ? "" : ",",
		 same ? "" : variant->b);
	self->ctx = test_context(names);
	ASSERT_NE(NULL, self->ctx);
	self->a = test_device(self->ctx, variant->a);
	if (!self->a) {
		test_backend_absent(self->ctx, variant->a, why, sizeof(why));
		APE_SETUP_SKIP(ape_context_destroy(self->ctx), "%s", why);
	}
	if (ape_device_select(self->ctx, variant->b, variant->b_index, &sel)) {
		if (variant->b_index)
			snprintf(why, sizeof(why), "no %s device %d: %s", variant->b,
				 variant->b_index, ape_last_error());
		else
			test_backend_absent(self->ctx, variant->b, why, sizeof(why));
		APE_SETUP_SKIP(ape_context_destroy(self->ctx), "%s", why);
	}
	self->b = sel.device;
	self->emu = (!strcmp(variant->a, "cuda") || !strcmp(variant->b, "cuda")) &&
		    test_cuda_emulated();
}

FIXTURE_TEARDOWN(mixed)
{
	wrap_remove();
	ape_context_destroy(self->ctx);
}

/* The pair equals a's device alone (the emulator: fewer and shorter cases, as above). */
TEST_F(mixed, together_match_one_device)
{
	ape_device *set[2] = { self->a, self->b };

	compare_sets(_metadata, self->a, set, 2, ape_test_slow() ? 4 : self->emu ? 6 : 20,
		     self->emu ? 16 : 65, "together_match_one_device");
}

/*
 * b failing fails the whole call, with its message. b is given every query chunk first (weight
 * 10^6) and a takes from the back, so b's first chunk is its own whatever the timing: with
 * every key chunk visible (not causal, no skipping), its third launch is in that chunk.
 */
TEST_F(mixed, one_backend_failing_fails_the_call)
{
	const test_problem_shape sh = { 1, 2, 1, 128, 128, 16 };
	static const double w[2] = { 1, 1e6 };
	ape_device *set[2] = { self->a, self->b };
	ape_device_info info;
	const char *name;
	test_problem tp;
	ape_exec_options o;
	ape_rng rng;
	int ret;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = false;
	tp.desc.skip_tol = 0;
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 16;
	o.device_weights = w;
	ASSERT_EQ(0, ape_device_get_info(self->b, &info));
	/* the wrapper fails any device of b's backend: two CUDA devices, either */
	name = strcmp(variant->a, variant->b) ? info.name : variant->b;
	/* a idles and takes b's query chunks (exec/workq.h), and may take all of them before b
	 * launches anything: so b fails at its first call of any op (its session's first
	 * allocation, whatever work it gets), as a device lost at the start would */
	wrap_install(self->b, 0);
	wrap_lose_device(1);
	ret = run(&tp, set, 2, &o, NULL);
	EXPECT_EQ(APE_EDEVLOST, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "fails on purpose")) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), name))
		TH_LOG("\"%s\" does not name %s", ape_last_error(), name);
	wrap_remove();
	test_problem_free(&tp);
}

/* Weights decide the split; a trace shows one process per entry. */
TEST_F(multi, weights_split_work_and_trace_shows_devices)
{
	/* 8 x 8 chunks; the emulator: half the rows */
	const int64_t L = self->emu ? 128 : 256;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	char dir[64], path[128], cmd[1024];
	static const double w[2] = { 1, 1e6 };
	ape_device *set[2];
	test_problem tp, one;
	ape_exec_options o;
	ape_stats st;
	ape_rng rng;

	set[0] = set[1] = self->dev;
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	ASSERT_EQ(0, test_problem_clone(&one, &tp));
	snprintf(dir, sizeof(dir), "/tmp/ape-test-multi.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/t.json", dir);
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = L / 8;
	o.device_weights = w;
	o.trace_path = path;
	ASSERT_EQ(0, run(&one, set, 1, &o, NULL)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, run(&tp, set, 2, &o, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, same_within_tol(_metadata, &tp, &one, "weights"));
	EXPECT_EQ(2, st.devices);
	EXPECT_STREQ(variant->backend, st.backend);
	if (!access("/usr/bin/python3", X_OK)) {
		/* device 1 (weight 10^6) starts with every query chunk and takes them from the
		 * front; device 0 has none of its own and takes from the back: whatever the timing,
		 * each chunk is computed once and device 0's chunks all follow device 1's */
		snprintf(cmd, sizeof(cmd),
			 "/usr/bin/python3 -c 'import json,sys\n"
			 "ev = json.load(open(sys.argv[1]))[\"traceEvents\"]\n"
			 "pids = set(e[\"pid\"] for e in ev if e[\"ph\"] == \"M\" and e[\"name\"] == \"process_name\")\n"
			 "k = [e for e in ev if e[\"ph\"] == \"X\" and e[\"cat\"] == \"kernel\"]\n"
			 "assert pids == {0, 1}, pids\n"
			 "q = [set(e[\"args\"][\"query_chunk\"] for e in k if e[\"pid\"] == p) for p in (0, 1)]\n"
			 "assert not (q[0] & q[1]) and (q[0] | q[1]) == set(range(8)), q\n"
			 "assert not q[0] or not q[1] or min(q[0]) > max(q[1]), q\n"
			 "' %s",
			 path);
		EXPECT_EQ(0, system(cmd));
	}
	test_rmtree(dir);
	test_problem_free(&tp);
	test_problem_free(&one);
}

/* Each device's speed is remembered for the next call's split. */
TEST_F(multi, speeds_are_remembered)
{
	/* the emulator: 2 x 2 chunks */
	const int64_t L = self->emu ? 100 : 300;
	const test_problem_shape sh = { 1, 2, 1, L, L, 32 };
	ape_device *set[2];
	test_problem tp;
	ape_exec_options o;
	ape_rng rng;

	set[0] = set[1] = self->dev;
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 50;
	EXPECT_EQ(0u, (uint64_t)atomic_load(ape__device_pairs_per_s(self->dev)));
	ASSERT_EQ(0, run(&tp, set, 2, &o, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_GT((uint64_t)atomic_load(ape__device_pairs_per_s(self->dev)), 0u);
	test_problem_free(&tp);
}

/* One device failing fails the call, with its message; the others stop. */
TEST_F(multi, a_failing_device_fails_the_call)
{
	const test_problem_shape sh = { 1, 2, 1, 256, 256, 16 };
	ape_device *set[3];
	test_problem tp;
	ape_exec_options o;
	ape_rng rng;
	int ret;

	set[0] = set[1] = set[2] = self->dev;
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 16;
	wrap_install(self->dev, 0);
	wrap_fail_attention(20);
	ret = run(&tp, set, 3, &o, NULL);
	EXPECT_EQ(APE_EDEVLOST, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "fails on purpose")) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "query chunks"));
	wrap_remove();
	test_problem_free(&tp);
}

TEST_HARNESS_MAIN
