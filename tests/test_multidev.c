/* SPDX-License-Identifier: MIT */
/*
 * One call over several devices, on every backend (common/backend_fixture.h: the reference,
 * OpenCL, CUDA on the emulator where there is no GPU): one device listed twice, four entries at
 * once; and devices of different backends together (the reference, OpenCL and CUDA in pairs, two
 * emulated CUDA devices). The result equals one device's within the spec's tolerance, work goes
 * where the weights say, speeds are remembered, and a failing device fails the call.
 *
 * The backward pass over the same sets: gradients within the spec's tolerance of one device's,
 * the same bits twice, key chunks where the weights say (the trace shows it), each device under
 * the budget, a failing device failing the call with nothing written.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
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

/*
 * The trace at `path` checked by the Python lines `body` (0: they hold), with `ev` its events,
 * `k` its kernel spans, and two processes (devices) asserted; 1 when they fail, -1 without
 * /usr/bin/python3.
 */
static int check_trace(const char *path, const char *body)
{
	char cmd[2048];

	if (access("/usr/bin/python3", X_OK))
		return -1;
	snprintf(cmd, sizeof(cmd),
		 "/usr/bin/python3 -c 'import json,sys\n"
		 "ev = json.load(open(sys.argv[1]))[\"traceEvents\"]\n"
		 "pids = set(e[\"pid\"] for e in ev if e[\"ph\"] == \"M\" and "
		 "e[\"name\"] == \"process_name\")\n"
		 "k = [e for e in ev if e[\"ph\"] == \"X\" and e[\"cat\"] == \"kernel\"]\n"
		 "assert pids == {0, 1}, pids\n"
		 "%s' %s",
		 body, path);
	return system(cmd) ? 1 : 0;
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

/* Weights decide the split; a trace shows one process per entry. The queries are end-aligned:
 * with Lq = Lk every query chunk sees its diagonal key chunk and has a kernel in the trace (with
 * random offsets the causal mask may hide a whole query chunk, which is never launched). */
TEST_F(multi, weights_split_work_and_trace_shows_devices)
{
	/* 8 x 8 chunks; the emulator: half the rows */
	const int64_t L = self->emu ? 128 : 256;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	char dir[64], path[128];
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
	tp.desc.q_start_set = false; /* end-aligned: every query chunk is launched */
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
	/* device 1 (weight 10^6) starts with every query chunk and takes them from the front;
	 * device 0 has none of its own and takes from the back: whatever the timing, each chunk is
	 * computed once and device 0's chunks all follow device 1's */
	EXPECT_NE(1, check_trace(path,
		"q = [set(e[\"args\"][\"query_chunk\"] for e in k if e[\"pid\"] == p) for p in (0, 1)]\n"
		"assert not (q[0] & q[1]) and (q[0] | q[1]) == set(range(8)), q\n"
		"assert not q[0] or not q[1] or min(q[0]) > max(q[1]), q\n"));
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

/* ---- the backward pass over several devices */

/* Every gradient of case c, on devs, into g (fresh from grads_alloc(): all NaN). */
static int run_bwd(bcase *c, ape_device *const *devs, int n, const ape_exec_options *o, grads *g,
		   ape_stats *st)
{
	const test_problem *tp = &c->tp;

	if (st)
		ape_stats_init(st);
	return ape_attention_backward_ex(devs, n, o, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t,
					 &tp->o.t, tp->lse, &c->dout.t, c->dlse, &g->dq.t, &g->dk.t,
					 &g->dv.t, g->dparams, st);
}

/* Two devices' gradients, each within the spec's tolerance of float64: within twice that of
 * each other. */
static int grads_close(struct __test_metadata *_metadata, const grads *a, const grads *b,
		       ape_dtype dt, const char *what)
{
	const double tol = 2 * grads_tol(dt);
	const double e[4] = { grads_rel_err(&a->dq.t, &b->dq.t), grads_rel_err(&a->dk.t, &b->dk.t),
			      grads_rel_err(&a->dv.t, &b->dv.t),
			      grads_rel_err_params(a->dparams, b->dparams, a->H) };

	if (e[0] <= tol && e[1] <= tol && e[2] <= tol && e[3] <= tol)
		return 0;
	TH_LOG("%s (%s): errors dQ %.3g, dK %.3g, dV %.3g, dparams %.3g (tolerance %.3g)", what,
	       ape_dtype_name(dt), e[0], e[1], e[2], e[3], tol);
	return -1;
}

/*
 * Backward cases on a set of devices against `single` alone: every storage type, GQA, random
 * parameters, layouts, causality and offsets (test_problem_random_params()), small chunks so
 * that every device has several key chunks, weights in every third case. Each set's result is
 * run twice: the same bits. `alike`: every device of the set has single's backend, so the
 * pairs computed are the same (backends skip keys differently). Returns 1 (with *why) when
 * single has no backward pass.
 */
static int compare_backward(struct __test_metadata *_metadata, ape_device *single,
			    ape_device *const *set, int n, bool alike, int ncases, bool emu,
			    const char *what, char *why, size_t len)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const test_problem_shape big[] = {
		{ 1, 4, 2, 37, 45, 16 }, { 2, 2, 1, 26, 31, 8 }, { 1, 3, 3, 40, 23, 32 } };
	static const test_problem_shape small[] = { { 1, 2, 1, 12, 15, 8 },
						    { 1, 2, 2, 9, 13, 16 } };
	const test_problem_shape *shapes = emu ? small : big;
	const int nshapes = emu ? 2 : 3;
	static const double w[4] = { 1, 3, 2, 1 };
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, what);
	for (int c = 0; c < ncases; c++) {
		const ape_dtype dt = types[c % 3];
		const test_problem_shape *sh = &shapes[c % nshapes];
		grads one, many, again;
		ape_exec_options o;
		ape_stats st, st1;
		bcase bc;
		int ret;

		ASSERT_EQ(0, bcase_ready(&bc, &rng, sh, dt, c % 2, c % 2 == 0, single));
		ASSERT_EQ(0, grads_alloc(&one, &bc, dt));
		ASSERT_EQ(0, grads_alloc(&many, &bc, dt));
		ASSERT_EQ(0, grads_alloc(&again, &bc, dt));
		ape_exec_options_init(&o);
		o.chunk_q = 3 + c % 5;
		o.chunk_k = 2 + c % 3;
		ret = run_bwd(&bc, &single, 1, &o, &one, &st1);
		if (ret == APE_ENOTSUP) {
			snprintf(why, len, "%s", ape_last_error());
			failed = -1;
		} else {
			ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
			o.device_weights = c % 3 == 2 ? w : NULL;
			ASSERT_EQ(0, run_bwd(&bc, set, n, &o, &many, &st))
				TH_LOG("%s", ape_last_error());
			ASSERT_EQ(0, run_bwd(&bc, set, n, &o, &again, NULL))
				TH_LOG("%s", ape_last_error());
			failed += grads_close(_metadata, &many, &one, dt, what) != 0;
			EXPECT_TRUE(same_grads(&many, &again, W_ALL))
				TH_LOG("%s: case %d", what, c);
			/* at least 4 key chunks: in equal shares each device has some (weights
			 * give all to the heavier device when the first key chunk, seen by the
			 * most queries, outweighs the lighter one's share); the same launches as
			 * one device's (none when the offsets hide every key) */
			if (o.device_weights) {
				EXPECT_LE(1, st.devices);
				EXPECT_GE(n, st.devices);
			} else {
				EXPECT_EQ(n, st.devices);
			}
			EXPECT_EQ(st1.chunks, st.chunks);
			EXPECT_EQ(st1.pairs_visible, st.pairs_visible);
			if (alike) {
				EXPECT_EQ(st1.pairs_computed, st.pairs_computed);
			} else {
				EXPECT_LE(st.pairs_computed, st.pairs_visible);
			}
		}
		grads_free(&one);
		grads_free(&many);
		grads_free(&again);
		bcase_free(&bc);
		if (failed < 0)
			return 1;
	}
	EXPECT_EQ(0, failed);
	return 0;
}

TEST_F(multi, backward_same_device_twice)
{
	ape_device *set[2] = { self->dev, self->dev };
	char why[512];

	if (compare_backward(_metadata, self->dev, set, 2, true,
			     ape_test_slow() ? 3 : self->emu ? 3 : 9, self->emu,
			     "backward_same_device_twice", why, sizeof(why)) == 1)
		SKIP(return, "%s", why);
}

TEST_F(mixed, backward_together_match_one_device)
{
	ape_device *set[2] = { self->a, self->b };
	char why[512];

	if (compare_backward(_metadata, self->a, set, 2, !strcmp(variant->a, variant->b),
			     ape_test_slow() ? 3 : self->emu ? 3 : 9,
			     self->emu, "backward_together_match_one_device", why,
			     sizeof(why)) == 1)
		SKIP(return, "%s", why);
}

/*
 * Weights decide which key chunks each device owns (contiguous, in order), each device stays
 * under the budget, and the trace has one process per entry with its launches and copies.
 */
TEST_F(multi, backward_weights_budget_and_trace)
{
	/* 8 key chunks; the emulator: fewer rows */
	const int64_t L = self->emu ? 24 : 64;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	static const double w[2] = { 1, 3 };
	ape_device *set[2] = { self->dev, self->dev };
	char dir[64], path[128];
	grads one, many, small;
	struct wrap_counts wc;
	ape_exec_options o;
	ape_stats st, st1;
	ape_rng rng;
	bcase bc;
	int ret;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, bcase_make(&bc, &rng, &sh, APE_F32, false, true));
	test_problem_random_params(&bc.tp, &rng);
	bc.tp.desc.causal = false; /* every key chunk seen by every query chunk */
	bc.tp.desc.skip_tol = 0;
	ASSERT_EQ(0, bcase_forward(&bc, self->dev));
	ASSERT_EQ(0, grads_alloc(&one, &bc, APE_F32));
	ASSERT_EQ(0, grads_alloc(&many, &bc, APE_F32));
	ASSERT_EQ(0, grads_alloc(&small, &bc, APE_F32));
	snprintf(dir, sizeof(dir), "/tmp/ape-test-multi.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/b.json", dir);
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = L / 8;
	ret = run_bwd(&bc, set, 1, &o, &one, &st1);
	if (ret == APE_ENOTSUP) {
		test_rmtree(dir);
		SKIP(goto out, "%s", ape_last_error());
	}
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	o.device_weights = w;
	o.trace_path = path;
	ASSERT_EQ(0, run_bwd(&bc, set, 2, &o, &many, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, grads_close(_metadata, &many, &one, APE_F32, "weights"));
	EXPECT_EQ(2, st.devices);
	EXPECT_EQ(64u, st.chunks);
	EXPECT_EQ(st1.pairs_computed, st.pairs_computed);
	/* the same copies but one more device's parameter sums (H = 2); none of them on a device
	 * that reads host memory, whose sums are written where the host reads them */
	EXPECT_EQ(st1.bytes_from_device,
		  st.bytes_from_device -
			  (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_HOST_MEMORY)
				   ? 0
				   : 2 * 4 * sizeof(double)));
	EXPECT_LT(0.0, st.kernel_ms);
	/* device 1 (weight 3) owns the last 6 key chunks, device 0 the first 2; every launch of a
	 * key chunk on its owner, each of the 8 x 8 once; copies on their lanes (the pipeline's:
	 * query rows up, key rows up, results back; each kind on one of its slots' queues) */
	EXPECT_NE(1, check_trace(path,
		"assert all(e[\"name\"].startswith(\"attention backward\") for e in k)\n"
		"own = [set(e[\"args\"][\"key_chunk\"] for e in k if e[\"pid\"] == p) for p in (0, 1)]\n"
		"assert own == [set(range(2)), set(range(2, 8))], own\n"
		"pairs = sorted((e[\"args\"][\"query_chunk\"], e[\"args\"][\"key_chunk\"]) for e in k)\n"
		"assert pairs == [(q, c) for q in range(8) for c in range(8)], pairs\n"
		"lanes = set(e[\"tid\"] for e in ev if e[\"ph\"] == \"X\" and e[\"cat\"] == \"copy\")\n"
		"kinds = [set(range(10, 13)), set(range(20, 23)), set(range(30, 36))]\n"
		"assert lanes <= set().union(*kinds), lanes\n"
		"assert all(lanes & kind for kind in kinds), lanes\n"));
	/* one byte under the peak of one device: smaller chunks, each device within the budget;
	 * the wrapper counts both entries' bytes (buffers and declared scratch) together */
	o.trace_path = NULL;
	o.chunk_q = o.chunk_k = 0;
	o.max_device_bytes = st.peak_device_bytes - 1;
	wrap_install(self->dev, 0);
	ASSERT_EQ(0, run_bwd(&bc, set, 2, &o, &small, &st1)) TH_LOG("%s", ape_last_error());
	wc = wrap_get();
	wrap_remove();
	EXPECT_LE(st1.peak_device_bytes, o.max_device_bytes);
	EXPECT_EQ(o.max_device_bytes, st1.device_budget);
	EXPECT_LE(wc.peak_bytes, 2 * o.max_device_bytes);
	EXPECT_LE(st1.peak_device_bytes, wc.peak_bytes);
	EXPECT_EQ(wc.allocs, wc.frees);
	if (strcmp(variant->backend, "ref")) { /* OpenCL and CUDA declare backward scratch */
		EXPECT_LT(0u, wc.bwd_scratch_max);
	}
	EXPECT_EQ(0, grads_close(_metadata, &small, &one, APE_F32, "budget"));
	test_rmtree(dir);
out:
	grads_free(&one);
	grads_free(&many);
	grads_free(&small);
	bcase_free(&bc);
}

/* A device failing in the middle fails the call, with its message, and writes nothing. */
TEST_F(multi, backward_a_failing_device_fails_the_call)
{
	const test_problem_shape sh = { 1, 2, 1, 24, 24, 8 };
	ape_device *set[3] = { self->dev, self->dev, self->dev };
	grads g, fresh;
	ape_exec_options o;
	ape_rng rng;
	bcase bc;
	int ret;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_BACKWARD))
		SKIP(return, "%s has no backward pass", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	/* end-aligned: random positions may hide all but a few pairs: fewer than 5 launches */
	ASSERT_EQ(0, bcase_ready_visible(&bc, &rng, &sh, APE_F32, false, true, self->dev));
	ASSERT_EQ(0, grads_alloc(&g, &bc, APE_F32));
	ASSERT_EQ(0, grads_alloc(&fresh, &bc, APE_F32));
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 4;
	wrap_install(self->dev, 0);
	wrap_fail_op(WRAP_ATTENTION_BACKWARD, 5);
	ret = run_bwd(&bc, set, 3, &o, &g, NULL);
	EXPECT_EQ(APE_EDEVLOST, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_backward_ex: "))
		TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "fails on purpose")) TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(same_grads(&g, &fresh, W_ALL));
	wrap_remove();
	grads_free(&g);
	grads_free(&fresh);
	bcase_free(&bc);
}

/* b lost from its first op: the call fails naming b, nothing written; a alone still works. */
TEST_F(mixed, backward_one_backend_failing_fails_the_call)
{
	const test_problem_shape sh = { 1, 2, 1, 16, 16, 8 };
	ape_device *set[2] = { self->a, self->b };
	struct wrap_counts wc;
	ape_device_info info;
	ape_stats st;
	grads g, fresh;
	ape_exec_options o;
	const char *name;
	ape_rng rng;
	bcase bc;

	if (!ape_be_caps_have(&self->a->caps, APE_BE_CAP_BACKWARD) || !ape_be_caps_have(&self->b->caps, APE_BE_CAP_BACKWARD))
		SKIP(return, "no backward pass on %s or %s", variant->a, variant->b);
	ape_rng_init(&rng, _metadata->name);
	/* end-aligned: random positions may hide every pair, and then nothing is launched and
	 * the peak below holds none of b's scratch */
	ASSERT_EQ(0, bcase_ready_visible(&bc, &rng, &sh, APE_F32, false, false, self->a));
	ASSERT_EQ(0, grads_alloc(&g, &bc, APE_F32));
	ASSERT_EQ(0, grads_alloc(&fresh, &bc, APE_F32));
	ASSERT_EQ(0, ape_device_get_info(self->b, &info));
	name = strcmp(variant->a, variant->b) ? info.name : variant->b;
	ape_exec_options_init(&o);
	o.chunk_q = o.chunk_k = 4;
	/* a budget one byte under what the pair took: b's bytes as the wrapper counts them
	 * (buffers and declared scratch) stay within it */
	ASSERT_EQ(0, run_bwd(&bc, set, 2, &o, &g, &st)) TH_LOG("%s", ape_last_error());
	o.chunk_q = 0; /* key chunks stay 4 rows: b has 2 of them */
	o.max_device_bytes = st.peak_device_bytes - 1;
	wrap_install(self->b, 0);
	ASSERT_EQ(0, run_bwd(&bc, set, 2, &o, &g, &st)) TH_LOG("%s", ape_last_error());
	wc = wrap_get();
	EXPECT_LE(st.peak_device_bytes, o.max_device_bytes);
	EXPECT_LT(0u, wc.peak_bytes);
	/* two CUDA devices: the wrapper counts both */
	EXPECT_LE(wc.peak_bytes, (strcmp(variant->a, variant->b) ? 1 : 2) * o.max_device_bytes);
	wrap_remove();
	grads_free(&g);
	ASSERT_EQ(0, grads_alloc(&g, &bc, APE_F32));
	o.max_device_bytes = 0;
	o.chunk_q = o.chunk_k = 4;
	/* the split is fixed: b owns key chunks, whatever the timing */
	wrap_install(self->b, 0);
	wrap_lose_device(1);
	EXPECT_EQ(APE_EDEVLOST, run_bwd(&bc, set, 2, &o, &g, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "fails on purpose")) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), name))
		TH_LOG("\"%s\" does not name %s", ape_last_error(), name);
	EXPECT_TRUE(same_grads(&g, &fresh, W_ALL));
	wrap_remove();
	EXPECT_EQ(0, run_bwd(&bc, &self->a, 1, &o, &g, NULL)) TH_LOG("%s", ape_last_error());
	grads_free(&g);
	grads_free(&fresh);
	bcase_free(&bc);
}

TEST_HARNESS_MAIN
