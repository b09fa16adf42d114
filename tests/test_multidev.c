/* SPDX-License-Identifier: MIT */
/*
 * One call over several devices: the PoCL CPU device listed twice, the reference and OpenCL
 * together, four entries at once; the result equals one device's within the spec's tolerance,
 * work goes where the weights say, speeds are remembered, and a failing device fails the call.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/problem.h"
#include "common/wrapops.h"
#include "core/context.h"

struct devs {
	ape_context *ctx;
	ape_device *ocl, *ref;
};

static void devs_open(struct __test_metadata *_metadata, struct devs *d)
{
	d->ctx = test_context("ref,opencl");
	ASSERT_NE(NULL, d->ctx);
	d->ref = test_device(d->ctx, "ref");
	d->ocl = test_device(d->ctx, "opencl");
	ASSERT_NE(NULL, d->ref);
}

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

TEST(same_opencl_device_twice)
{
	struct devs d;

	devs_open(_metadata, &d);
	if (!d.ocl)
		SKIP(return, "no OpenCL device");
	{
		ape_device *set[2] = { d.ocl, d.ocl };

		compare_sets(_metadata, d.ocl, set, 2, ape_test_slow() ? 4 : 30, 100,
			     "same_opencl_device_twice");
	}
	ape_context_destroy(d.ctx);
}

TEST(reference_and_opencl_together)
{
	struct devs d;

	devs_open(_metadata, &d);
	if (!d.ocl)
		SKIP(return, "no OpenCL device");
	{
		ape_device *set[2] = { d.ref, d.ocl };

		compare_sets(_metadata, d.ref, set, 2, ape_test_slow() ? 4 : 20, 65,
			     "reference_and_opencl_together");
	}
	ape_context_destroy(d.ctx);
}

TEST(four_entries)
{
	struct devs d;

	devs_open(_metadata, &d);
	{
		ape_device *dev = d.ocl ? d.ocl : d.ref;
		ape_device *set[4] = { dev, d.ref, dev, d.ref };

		compare_sets(_metadata, dev, set, 4, ape_test_slow() ? 2 : 10, 33, "four_entries");
	}
	ape_context_destroy(d.ctx);
}

/* Weights decide the split; a trace shows one process per entry. */
TEST(weights_split_work_and_trace_shows_devices)
{
	const test_problem_shape sh = { 1, 2, 1, 256, 256, 16 };
	char dir[64], path[128], cmd[1024];
	static const double w[2] = { 1, 1e6 };
	ape_device *set[2];
	test_problem tp, one;
	ape_exec_options o;
	ape_stats st;
	struct devs d;
	ape_rng rng;

	devs_open(_metadata, &d);
	set[0] = set[1] = d.ref;
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	ASSERT_EQ(0, test_problem_clone(&one, &tp));
	snprintf(dir, sizeof(dir), "/tmp/ape-test-multi.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/t.json", dir);
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 32;
	o.device_weights = w;
	o.trace_path = path;
	ASSERT_EQ(0, run(&one, set, 1, &o, NULL)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, run(&tp, set, 2, &o, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, same_within_tol(_metadata, &tp, &one, "weights"));
	EXPECT_EQ(2, st.devices);
	EXPECT_STREQ("ref", st.backend);
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
	ape_context_destroy(d.ctx);
}

/* Each device's speed is remembered for the next call's split. */
TEST(speeds_are_remembered)
{
	const test_problem_shape sh = { 1, 2, 1, 300, 300, 32 };
	ape_device *set[2];
	test_problem tp;
	ape_exec_options o;
	struct devs d;
	ape_rng rng;

	devs_open(_metadata, &d);
	set[0] = set[1] = d.ref;
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 50;
	EXPECT_EQ(0u, (uint64_t)atomic_load(ape__device_pairs_per_s(d.ref)));
	ASSERT_EQ(0, run(&tp, set, 2, &o, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_GT((uint64_t)atomic_load(ape__device_pairs_per_s(d.ref)), 0u);
	test_problem_free(&tp);
	ape_context_destroy(d.ctx);
}

/* One device failing fails the call, with its message; the others stop. */
TEST(a_failing_device_fails_the_call)
{
	const test_problem_shape sh = { 1, 2, 1, 256, 256, 16 };
	ape_device *set[3];
	test_problem tp;
	ape_exec_options o;
	struct devs d;
	ape_rng rng;
	int ret;

	devs_open(_metadata, &d);
	set[0] = set[1] = set[2] = d.ref;
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 16;
	wrap_install(d.ref, 0);
	wrap_fail_attention(20);
	ret = run(&tp, set, 3, &o, NULL);
	EXPECT_EQ(APE_EDEVLOST, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "fails on purpose")) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "query chunks"));
	wrap_remove();
	test_problem_free(&tp);
	ape_context_destroy(d.ctx);
}

TEST_HARNESS_MAIN
