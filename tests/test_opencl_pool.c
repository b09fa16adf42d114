/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend's scratch pool (opencl/ocl_pool.c): a launch's read-write scratch is
 * reused by later launches, on the same queue at once, on any queue once its queue is idle.
 *
 * - With APE_OCL_POOL_POISON=1 every reused buffer is filled with all-ones bits (NaN) first: a
 *   kernel that read scratch it had not written would then differ from a run without the pool
 *   (APE_OCL_POOL_MB=0). Forward (general, separable, decode, explicit positions) and backward
 *   calls of several shapes (one in chunks: launches of one queue reusing each other's scratch
 *   before the queue is idle), interleaved so that each reuses buffers the others left, give
 *   the same bits either way, and so does the device tensors' backward.
 * - A repeated call takes all its scratch from the pool (the counters of ape__ocl_debug_pool).
 * - APE_OCL_POOL_MB bounds the idle bytes; 0 turns the pool off (no counter moves).
 *
 * The concurrency of several threads sharing one device's pool is tests/faults/test_threads.c's
 * (under ThreadSanitizer in `make check`). SKIP only where there is no OpenCL platform at all
 * (or libape lacks the backend).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/bwdcase.h"
#include "common/opencl_present.h"
#include "common/problem.h"
#include "core/backend.h"

#ifdef APE_HAVE_OPENCL
#include "../opencl/ocl_debug.h"
/* devs_open() and the OPENCL_TEST_MAIN of the OpenCL tests (not their forward comparison) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "opencl_compare.h"
#pragma GCC diagnostic pop

/* A context whose OpenCL device's pool is `mb` MiB (NULL: the default), poisoned or not. */
static void open_pool(struct __test_metadata *_metadata, struct devs *d, const char *mb,
		      bool poison)
{
	if (mb) {
		ASSERT_EQ(0, setenv("APE_OCL_POOL_MB", mb, 1));
	} else {
		ASSERT_EQ(0, unsetenv("APE_OCL_POOL_MB"));
	}
	ASSERT_EQ(0, setenv("APE_OCL_POOL_POISON", poison ? "1" : "0", 1));
	devs_open(_metadata, d);
}

static struct ape__ocl_debug_pool pool_of(struct __test_metadata *_metadata, const struct devs *d)
{
	struct ape__ocl_debug_pool p;

	memset(&p, 0, sizeof(p));
	EXPECT_EQ(0, ape__ocl_debug_pool(d->ocl, &p));
	return p;
}

/* The cases: a kind of launch each (see make_case). */
enum { C_GENERAL, C_SEPARABLE, C_DECODE, C_POSITIONS, C_BACKWARD, C_SEP_BACKWARD, C_CHUNKED,
       C_NCASES };

static const test_problem_shape shapes[C_NCASES] = {
	{ 1, 4, 2, 70, 129, 64 }, /* general kernel, GQA, a skip pre-pass */
	{ 2, 3, 3, 45, 45, 16 }, /* separable path (lambda 0) */
	{ 1, 6, 2, 1, 300, 64 }, /* decode */
	{ 1, 2, 1, 33, 57, 128 }, /* explicit positions */
	{ 1, 6, 2, 70, 150, 64 }, /* backward, several splits */
	{ 2, 2, 1, 37, 53, 16 }, /* backward, lambda 0 */
	{ 1, 4, 2, 96, 96, 64 }, /* backward in chunks of 32 x 32: launches of one queue reusing
				  * each other's scratch before it is idle */
};

/* Case i: inputs from the seed (the same for the same seed), parameters for its path. */
static int make_case(bcase *c, int i, uint64_t seed)
{
	static int64_t pq[33], pk[57];
	ape_rng rng;

	ape_rng_seed(&rng, seed * 31 + (uint64_t)i);
	if (bcase_make(c, &rng, &shapes[i], i == C_SEPARABLE ? APE_F16 : APE_F32, i == C_GENERAL,
		       true))
		return -1;
	test_problem_random_params(&c->tp, &rng);
	c->tp.desc.q_start_set = false; /* end-aligned: every row sees keys */
	if (i == C_SEPARABLE || i == C_SEP_BACKWARD)
		test_problem_set_params(&c->tp, 0.3, 0.0, 0.0, 0.0);
	if (i == C_POSITIONS) {
		for (int r = 0; r < 33; r++)
			pq[r] = 1000 + 3 * r - (r % 5); /* gaps and repeats */
		for (int r = 0; r < 57; r++)
			pk[r] = 900 + 2 * r;
		c->tp.desc.pos_q = pq;
		c->tp.desc.pos_k = pk;
		c->tp.desc.k_start = 0;
		c->tp.desc.causal = false;
	}
	return 0;
}

static bool backward_case(int i)
{
	return i == C_BACKWARD || i == C_SEP_BACKWARD || i == C_CHUNKED;
}

/* One round of every case on d: the cases (with the forwards' O and LSE) and the backwards'
 * gradients. */
struct round {
	bcase c[C_NCASES];
	grads g[C_NCASES];
};

static void run_round(struct __test_metadata *_metadata, const struct devs *d, uint64_t seed,
		      struct round *out)
{
	memset(out, 0, sizeof(*out));
	/* interleaved: each case takes buffers the ones before it gave back */
	for (int i = 0; i < C_NCASES; i++) {
		bcase *c = &out->c[i];

		ASSERT_EQ(0, make_case(c, i, seed));
		ASSERT_EQ(0, bcase_forward(c, d->ocl)) TH_LOG("case %d: %s", i, ape_last_error());
		if (!backward_case(i))
			continue;
		ASSERT_EQ(0, grads_alloc(&out->g[i], c, APE_F32));
		ASSERT_EQ(0, i == C_CHUNKED ? run_chunked(c, d->ocl, &out->g[i], 32, 32, NULL)
					    : run_backward(c, d->ocl, &out->g[i], W_ALL, NULL))
		TH_LOG("case %d: %s", i, ape_last_error());
	}
}

static void round_free(struct round *r)
{
	for (int i = 0; i < C_NCASES; i++) {
		if (backward_case(i))
			grads_free(&r->g[i]);
		bcase_free(&r->c[i]);
	}
}

static void expect_same(struct __test_metadata *_metadata, const struct round *a,
			const struct round *b, const char *what)
{
	for (int i = 0; i < C_NCASES; i++) {
		const test_problem *x = &a->c[i].tp, *y = &b->c[i].tp;

		EXPECT_TRUE(same_bits(&x->o, &y->o)) TH_LOG("%s: case %d: O differs", what, i);
		EXPECT_EQ(0, memcmp(x->lse, y->lse, x->rows * sizeof(float)))
		TH_LOG("%s: case %d: LSE differs", what, i);
		if (backward_case(i)) {
			EXPECT_TRUE(same_grads(&a->g[i], &b->g[i], W_ALL))
			TH_LOG("%s: case %d: gradients differ", what, i);
		}
	}
}

/* Poisoned reuse gives the bits of no pool at all, round after round (each reusing what the
 * one before left, with other inputs in between). */
TEST(poisoned_reuse_same_bits)
{
	struct round off[2], on[3];
	struct ape__ocl_debug_pool p;
	struct devs d;

	open_pool(_metadata, &d, "0", false);
	for (int s = 0; s < 2; s++)
		run_round(_metadata, &d, 7 + (uint64_t)s, &off[s]);
	p = pool_of(_metadata, &d);
	EXPECT_EQ(0, p.limit);
	EXPECT_EQ(0, p.hits + p.misses + p.idle_buffers); /* off: nothing kept */
	ape_context_destroy(d.ctx);

	open_pool(_metadata, &d, NULL, true);
	for (int s = 0; s < 3; s++)
		run_round(_metadata, &d, 7 + (uint64_t)(s % 2), &on[s]);
	p = pool_of(_metadata, &d);
	EXPECT_GT(p.limit, 0);
	EXPECT_GT(p.hits, 0) TH_LOG("nothing was reused: the poison tested nothing");
	ape_context_destroy(d.ctx);

	expect_same(_metadata, &off[0], &on[0], "round 1");
	expect_same(_metadata, &off[1], &on[1], "round 2");
	expect_same(_metadata, &off[0], &on[2], "round 3 (round 1's inputs)");
	for (int s = 0; s < 2; s++)
		round_free(&off[s]);
	for (int s = 0; s < 3; s++)
		round_free(&on[s]);
}

/* The same call again takes every scratch buffer from the pool: no new one. */
TEST(repeat_call_reuses_everything)
{
	struct ape__ocl_debug_pool a, b;
	struct devs d;
	grads g;
	bcase c;

	open_pool(_metadata, &d, NULL, false);
	ASSERT_EQ(0, make_case(&c, C_BACKWARD, 3));
	ASSERT_EQ(0, bcase_forward(&c, d.ocl));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, run_backward(&c, d.ocl, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	a = pool_of(_metadata, &d);
	EXPECT_GT(a.misses, 0);
	EXPECT_GT(a.idle_buffers, 0) TH_LOG("the call's scratch did not reach the pool");
	ASSERT_EQ(0, bcase_forward(&c, d.ocl));
	ASSERT_EQ(0, run_backward(&c, d.ocl, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	b = pool_of(_metadata, &d);
	EXPECT_EQ(a.misses, b.misses) TH_LOG("the repeat made %lu new buffers",
					     b.misses - a.misses);
	EXPECT_GT(b.hits, a.hits);
	EXPECT_EQ(a.idle_bytes, b.idle_bytes); /* all given back */
	EXPECT_LE(b.idle_bytes, b.limit);
	grads_free(&g);
	bcase_free(&c);
	ape_context_destroy(d.ctx);
}

/* APE_OCL_POOL_MB bounds what stays idle: with 1 MiB the backward's larger buffers are
 * released, the idle bytes never pass the limit, and the results do not change. */
TEST(limit_bounds_idle_bytes)
{
	struct round r[2];
	struct ape__ocl_debug_pool p;
	struct devs d;

	open_pool(_metadata, &d, "1", true);
	for (int s = 0; s < 2; s++) {
		run_round(_metadata, &d, 11, &r[s]);
		p = pool_of(_metadata, &d);
		EXPECT_EQ((unsigned long)1 << 20, p.limit);
		EXPECT_LE(p.idle_bytes, p.limit);
	}
	expect_same(_metadata, &r[0], &r[1], "1 MiB pool");
	ape_context_destroy(d.ctx);
	for (int s = 0; s < 2; s++)
		round_free(&r[s]);
}

/* The device tensors' backward (ape_attention_backward_enqueue() on a queue of the caller's, made
 * by ape_queue_create()): the second call reuses the first's scratch, which the first's queue
 * gave to the pool at its synchronize; the same bits as without a pool. */
TEST(resident_queue_reuse)
{
	grads want, g1, g2;
	struct devs d;
	bcase c;

	open_pool(_metadata, &d, "0", false);
	ASSERT_EQ(0, make_case(&c, C_BACKWARD, 5));
	ASSERT_EQ(0, bcase_forward(&c, d.ocl));
	ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
	ASSERT_EQ(0, run_enqueue_backward(&c, d.ocl, &want, W_ALL, 0)) TH_LOG("%s", ape_last_error());
	ape_context_destroy(d.ctx);
	bcase_free(&c);

	open_pool(_metadata, &d, NULL, true);
	ASSERT_EQ(0, make_case(&c, C_BACKWARD, 5));
	ASSERT_EQ(0, bcase_forward(&c, d.ocl));
	ASSERT_EQ(0, grads_alloc(&g1, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&g2, &c, APE_F32));
	ASSERT_EQ(0, run_enqueue_backward(&c, d.ocl, &g1, W_ALL, 0)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, run_enqueue_backward(&c, d.ocl, &g2, W_ALL, 0)) TH_LOG("%s", ape_last_error());
	EXPECT_GT(pool_of(_metadata, &d).hits, 0);
	EXPECT_TRUE(same_grads(&want, &g1, W_ALL));
	EXPECT_TRUE(same_grads(&want, &g2, W_ALL));
	grads_free(&want);
	grads_free(&g1);
	grads_free(&g2);
	bcase_free(&c);
	ape_context_destroy(d.ctx);
}

OPENCL_TEST_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the OpenCL backend is not built into this libape")
#endif /* APE_HAVE_OPENCL */
