/* SPDX-License-Identifier: MIT */
/*
 * The pure pieces of the streaming executor, without a device: chunk planning under a budget,
 * the walk over key chunks, the chunk-level skip bound, the LSE merge, the work split.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "exec/lse_merge.h"
#include "exec/plan.h"
#include "exec/skip.h"
#include "exec/stream.h"

/* A forward-like pass of B = 1, H = 4, Hkv = 2, D = 64, float32 with pair counts: Q in the
 * outer slots, K and V in the inner ones, O, LSE and pair counts per job; `prior`: the merged
 * LSE each outer slot keeps when there are several inner chunks. */
struct shape {
	bool prior;
	uint64_t (*scratch)(void *arg, int64_t co, int64_t ci);
};

static void bytes_fn(void *arg, int64_t co, int64_t ci, int64_t no, int64_t ni,
		     struct ape__plan_bytes *b)
{
	const struct shape *sh = arg;
	const uint64_t H = 4, Hkv = 2, D = 64;

	(void)no;
	b->outer = (uint64_t)co * H * D * 4 + (sh->prior && ni > 1 ? (uint64_t)co * H * 4 : 0);
	b->inner = 2 * (uint64_t)ci * Hkv * D * 4;
	b->job = (uint64_t)co * H * (D * 4 + 4 + 8);
	b->call = 0;
	b->largest = (uint64_t)co * H * D * 4;
	if ((uint64_t)ci * Hkv * D * 4 > b->largest)
		b->largest = (uint64_t)ci * Hkv * D * 4;
}

static uint64_t scratch_of(void *arg, int64_t co, int64_t ci)
{
	const struct shape *sh = arg;

	return sh->scratch ? sh->scratch(NULL, co, ci) : 0;
}

static struct shape plain;

static struct ape__plan_req req(int64_t L, uint64_t budget)
{
	return (struct ape__plan_req){
		.Lo = L, .Li = L, .max_co = APE__CHUNK_DEFAULT, .max_ci = APE__CHUNK_DEFAULT,
		.depth = 3, .budget = budget, .max_buffer = UINT64_MAX, .bytes = bytes_fn,
		.scratch = scratch_of, .arg = &plain, .what = "B=1, H=4, Hkv=2, D=64, f32",
	};
}

/* What the plan says it holds, recomputed from its parts. */
static uint64_t recount(const struct ape__plan *p)
{
	uint64_t jobs = (uint64_t)(p->no * p->ni);

	return (uint64_t)p->o_slots * p->b.outer +
	       (jobs < (uint64_t)p->depth ? jobs : (uint64_t)p->depth) * (p->b.job + p->scratch) +
	       (uint64_t)p->i_slots * p->b.inner + p->b.call;
}

TEST(small_problem_is_one_chunk_pair)
{
	struct ape__plan_req r = req(1000, UINT64_MAX);
	struct ape__plan p;

	ASSERT_EQ(0, ape__plan_make(&r, "t", &p));
	EXPECT_EQ(1000, p.co);
	EXPECT_EQ(1000, p.ci);
	EXPECT_EQ(1, p.no);
	EXPECT_EQ(1, p.ni);
	EXPECT_EQ(1, p.o_slots);
	EXPECT_EQ(1, p.i_slots);
	/* exactly what a one-shot call holds: Q, K, V, O, LSE, pair counts */
	EXPECT_EQ((uint64_t)(4 * 1000 * 64 * 4 * 2 + 2 * 2 * 1000 * 64 * 4 + 4 * 1000 * 12),
		  p.peak);
}

TEST(default_chunks_are_4096)
{
	struct ape__plan_req r = req(10000, UINT64_MAX);
	struct ape__plan p;

	ASSERT_EQ(0, ape__plan_make(&r, "t", &p));
	EXPECT_EQ(4096, p.co);
	EXPECT_EQ(4096, p.ci);
	EXPECT_EQ(3, p.no);
	EXPECT_EQ(3, p.ni);
	EXPECT_EQ(3, p.depth);
	EXPECT_EQ(2, p.o_slots);
	EXPECT_EQ(3, p.i_slots); /* every key chunk resident: no budget */
	EXPECT_EQ(recount(&p), p.peak);
}

TEST(budget_shrinks_chunks_then_depth)
{
	uint64_t budgets[] = { 64u << 20, 8u << 20, 1u << 20, 200000, 40000, 5000 };
	struct ape__plan prev = { 0 };

	for (size_t i = 0; i < sizeof(budgets) / sizeof(budgets[0]); i++) {
		struct ape__plan_req r = req(1 << 20, budgets[i]);
		struct ape__plan p;

		ASSERT_EQ(0, ape__plan_make(&r, "t", &p)) TH_LOG("budget %llu: %s",
								  (unsigned long long)budgets[i],
								  ape_last_error());
		EXPECT_LE(p.peak, budgets[i]);
		EXPECT_EQ(recount(&p), p.peak);
		EXPECT_GE(p.i_slots, p.depth < p.ni ? p.depth : p.ni);
		if (i) { /* a smaller budget never gives larger chunks or more depth */
			EXPECT_LE(p.co, prev.co);
			EXPECT_LE(p.ci, prev.ci);
			EXPECT_LE(p.depth, prev.depth);
		}
		/* chunks stay >= 256 rows while the depth is 3 */
		if (p.depth == 3)
			EXPECT_TRUE(p.co >= 256 || p.ci >= 256);
		prev = p;
	}
	EXPECT_EQ(1, prev.depth); /* 5000 bytes: one row each way, nothing in flight */
}

TEST(budget_too_small_says_what_it_needs)
{
	struct ape__plan_req r = req(100, 1000);
	struct ape__plan p;

	EXPECT_EQ(APE_ENOMEM, ape__plan_make(&r, "fn", &p));
	EXPECT_NE(NULL, strstr(ape_last_error(),
			       "fn: budget 1000 bytes cannot hold one chunk of 1 query row and 1 key "
			       "row (B=1, H=4, Hkv=2, D=64, f32): that needs "))
		TH_LOG("%s", ape_last_error());
	/* a pass whose outer axis is the keys says the same, query rows first */
	r.outer_is_key = true;
	r.chunk = "the backward pass's chunk";
	EXPECT_EQ(APE_ENOMEM, ape__plan_make(&r, "fn", &p));
	EXPECT_NE(NULL, strstr(ape_last_error(), "cannot hold the backward pass's chunk of 1 query "
						 "row and 1 key row"))
		TH_LOG("%s", ape_last_error());
}

TEST(largest_buffer_bounds_chunks)
{
	struct ape__plan_req r = req(10000, UINT64_MAX);
	struct ape__plan p;

	r.max_buffer = 100000; /* bytes: fewer than 4096 rows of 4 heads x 64 floats */
	ASSERT_EQ(0, ape__plan_make(&r, "t", &p));
	EXPECT_LE(p.b.largest, r.max_buffer);
	EXPECT_LE((uint64_t)p.co * 4 * 64 * 4, r.max_buffer);
	EXPECT_LE((uint64_t)p.ci * 2 * 64 * 4, r.max_buffer);
	r.max_buffer = 100; /* not even one row */
	EXPECT_EQ(APE_ENOMEM, ape__plan_make(&r, "t", &p));
	EXPECT_NE(NULL, strstr(ape_last_error(), "more than the device's largest"));
}

static uint64_t scratch_fn(void *arg, int64_t lq, int64_t lk)
{
	(void)arg;
	return (uint64_t)(lq + lk) * 1000;
}

TEST(backend_scratch_is_counted)
{
	struct ape__plan_req r = req(10000, 50u << 20);
	struct shape sh = { .scratch = scratch_fn };
	struct ape__plan p, q;

	ASSERT_EQ(0, ape__plan_make(&r, "t", &p));
	r.arg = &sh;
	ASSERT_EQ(0, ape__plan_make(&r, "t", &q));
	EXPECT_EQ((uint64_t)(q.co + q.ci) * 1000, q.scratch);
	EXPECT_LE(q.peak, r.budget);
	EXPECT_EQ(recount(&q), q.peak);
	EXPECT_LT(q.i_slots * q.b.inner, p.i_slots * p.b.inner + 1);
}

/* What the pass holds per outer slot is counted once per slot, and may depend on the inner
 * chunk count (the forward's merged LSE, kept only with several key chunks). */
TEST(outer_slot_bytes_are_counted_per_slot)
{
	struct ape__plan_req r = req(10000, UINT64_MAX);
	struct shape sh = { .prior = true };
	struct ape__plan p, q;

	ASSERT_EQ(0, ape__plan_make(&r, "t", &p));
	r.arg = &sh;
	ASSERT_EQ(0, ape__plan_make(&r, "t", &q));
	EXPECT_EQ(p.peak + 2 * (uint64_t)q.co * 4 * 4, q.peak);
	EXPECT_EQ(recount(&q), q.peak);
	r = req(1000, UINT64_MAX);
	r.arg = &sh;
	ASSERT_EQ(0, ape__plan_make(&r, "t", &q));
	EXPECT_EQ((uint64_t)q.co * 4 * 64 * 4, q.b.outer);
	/* under a budget it fits as everything else does */
	r = req(10000, 50u << 20);
	r.arg = &sh;
	ASSERT_EQ(0, ape__plan_make(&r, "t", &q));
	EXPECT_LE(q.peak, r.budget);
	EXPECT_EQ(recount(&q), q.peak);
}

/* A resident call's launches see every key: only the outer chunk shrinks. */
TEST(inner_whole_shrinks_only_the_outer_chunk)
{
	struct ape__plan_req r = req(5000, 8u << 20);
	struct ape__plan p;

	r.inner_whole = true;
	r.depth = 1;
	ASSERT_EQ(0, ape__plan_make(&r, "t", &p));
	EXPECT_EQ(5000, p.ci);
	EXPECT_EQ(1, p.ni);
	EXPECT_LT(p.co, 5000);
	EXPECT_LE(p.peak, r.budget);
	r.budget = 1000; /* not even one query row against every key */
	EXPECT_EQ(APE_ENOMEM, ape__plan_make(&r, "t", &p));
	EXPECT_NE(NULL, strstr(ape_last_error(), "1 query row and 5000 key rows"))
		TH_LOG("%s", ape_last_error());
}

/* ---- the walk */

static int walk_all(int64_t pos_first, int64_t pos_last, int64_t Lk, int64_t ck, int64_t k_start,
		    bool causal, int64_t *order, int *dirs)
{
	struct ape__walk w;
	int n = 0, dir;
	int64_t c;

	ape__walk_init(&w, pos_first, pos_last, Lk, ck, k_start, causal, false);
	while (ape__walk_next(&w, &c, &dir)) {
		order[n] = c;
		dirs[n++] = dir;
	}
	return n;
}

TEST(walk_causal_goes_back_from_the_diagonal)
{
	int64_t order[64];
	int dirs[64];
	int n = walk_all(130, 190, 1000, 64, 0, true, order, dirs);

	/* the last row sits at 190: chunk 2 [128, 192); chunks after it are invisible */
	ASSERT_EQ(3, n);
	EXPECT_EQ(2, order[0]);
	EXPECT_EQ(0, dirs[0]);
	EXPECT_EQ(1, order[1]);
	EXPECT_EQ(-1, dirs[1]);
	EXPECT_EQ(0, order[2]);
	/* queries before every key: nothing to walk */
	EXPECT_EQ(0, walk_all(-50, -1, 1000, 64, 0, true, order, dirs));
	/* ... unless the whole call is one chunk pair */
	{
		struct ape__walk w;
		int64_t c;
		int dir;

		ape__walk_init(&w, -50, -1, 10, 64, 0, true, true);
		EXPECT_TRUE(ape__walk_next(&w, &c, &dir));
		EXPECT_EQ(0, c);
		EXPECT_FALSE(ape__walk_next(&w, &c, &dir));
	}
}

TEST(walk_noncausal_alternates_and_closes)
{
	int64_t order[64];
	int dirs[64];
	int n = walk_all(300, 340, 640, 64, 0, false, order, dirs);
	struct ape__walk w;
	int64_t c;
	int dir;

	/* middle row 320: chunk 5 first, then 4, 6, 3, 7, 2, 8, 1, 9, 0 */
	ASSERT_EQ(10, n);
	EXPECT_EQ(5, order[0]);
	EXPECT_EQ(4, order[1]);
	EXPECT_EQ(6, order[2]);
	EXPECT_EQ(9, order[8]);
	EXPECT_EQ(0, order[9]);

	ape__walk_init(&w, 300, 340, 640, 64, 0, false, false);
	ASSERT_TRUE(ape__walk_next(&w, &c, &dir)); /* 5 */
	ASSERT_TRUE(ape__walk_next(&w, &c, &dir)); /* 4, backward */
	EXPECT_EQ(5, ape__walk_close(&w, dir, c)); /* 4, 3, 2, 1, 0 */
	for (int64_t want = 6; want < 10; want++) {
		ASSERT_TRUE(ape__walk_next(&w, &c, &dir));
		EXPECT_EQ(want, c);
		EXPECT_EQ(1, dir);
	}
	EXPECT_FALSE(ape__walk_next(&w, &c, &dir));
}

/* ---- the skip bound */

struct skip_case {
	float params[4]; /* delta, beta, gamma, lambda */
	struct ape__kmax km;
	float qn[8];
	double m[8], s[8];
	struct ape__skip_ctx ctx;
	struct ape__skip_rows rows;
};

static void skip_case(struct skip_case *k, float delta, float kmax)
{
	memset(k, 0, sizeof(*k));
	k->params[0] = delta;
	if (ape__kmax_alloc(&k->km, 1, 4))
		abort();
	for (int c = 0; c < 4; c++)
		k->km.pre[c] = kmax;
	ape__kmax_scan(&k->km);
	for (int i = 0; i < 8; i++) {
		k->qn[i] = 8;
		k->m[i] = 0;
		k->s[i] = 1;
	}
	k->ctx = (struct ape__skip_ctx){ .B = 1, .H = 1, .Hkv = 1, .Lk = 256, .ck = 64,
					 .k_start = 0, .causal = true, .abs_scale = 0.125,
					 .head_params = k->params, .km = &k->km, .tol = 0x1p-25 };
	k->rows = (struct ape__skip_rows){ .n = 8, .pos0 = 248, .qnorm = k->qn, .m = k->m,
					   .s = k->s };
}

TEST(skip_bound_needs_decay_and_distance)
{
	struct skip_case k;

	skip_case(&k, 1.0f, 8);
	/* chunk 2 [128, 192) and everything before it: >= 56 positions away at delta 1 */
	EXPECT_TRUE(ape__skip_tail(&k.ctx, &k.rows, 2, -1));
	/* chunk 3 holds the rows' own positions: never */
	EXPECT_FALSE(ape__skip_tail(&k.ctx, &k.rows, 3, -1));
	ape__kmax_free(&k.km);

	skip_case(&k, 0.01f, 8); /* weak decay: the bound cannot prove it */
	EXPECT_FALSE(ape__skip_tail(&k.ctx, &k.rows, 2, -1));
	ape__kmax_free(&k.km);

	skip_case(&k, 1.0f, INFINITY); /* a NaN or Inf key somewhere back there */
	EXPECT_FALSE(ape__skip_tail(&k.ctx, &k.rows, 2, -1));
	ape__kmax_free(&k.km);

	skip_case(&k, 1.0f, 8);
	k.m[3] = -INFINITY; /* a row with nothing computed yet: nothing to compare with */
	EXPECT_FALSE(ape__skip_tail(&k.ctx, &k.rows, 2, -1));
	k.m[3] = NAN;
	EXPECT_FALSE(ape__skip_tail(&k.ctx, &k.rows, 2, -1));
	ape__kmax_free(&k.km);
}

TEST(norms_turn_nan_into_infinity)
{
	float x[4] = { 3, 4, 0, 0 };

	EXPECT_GE(ape__norm(x, 4), 5.0f);
	EXPECT_LT(ape__norm(x, 4), 5.0001f);
	x[2] = NAN;
	EXPECT_EQ(INFINITY, ape__norm(x, 4));
	x[2] = -INFINITY;
	EXPECT_EQ(INFINITY, ape__norm(x, 4));
}

/* ---- the merge */

TEST(merge_by_lse_is_identity_4)
{
	/* one row, D = 2: keys split in two chunks with known partial results */
	struct ape__acc a;
	const float o1[2] = { 1, 2 }, o2[2] = { 3, -1 };
	const float l1 = 0.5f, l2 = 2.0f;
	float out[2], lse;
	ape_tensor t;
	int64_t s[4];
	double w1, w2;

	ASSERT_EQ(0, ape__acc_alloc(&a, 1, 2, false));
	ape__acc_reset(&a, 1);
	ape__acc_add(&a, o1, &l1, NULL, NULL);
	ape__acc_add(&a, o2, &l2, NULL, NULL);
	ape_tensor_init(&t, out, APE_F32, 1, 1, 1, 2);
	ape_tensor_strides(&t, s);
	ape__acc_store(&a, &t, s, &lse, NULL, NULL, 1, 0, 1);
	w1 = exp(l1) / (exp(l1) + exp(l2));
	w2 = 1 - w1;
	EXPECT_LT(fabs(out[0] - (w1 * 1 + w2 * 3)), 1e-6);
	EXPECT_LT(fabs(out[1] - (w1 * 2 - w2 * 1)), 1e-6);
	EXPECT_LT(fabs(lse - log(exp(l1) + exp(l2))), 1e-6);

	/* -inf contributes nothing; a row that never sees a key is 0 / -inf; NaN sticks */
	ape__acc_reset(&a, 1);
	{
		const float ninf = -INFINITY, nan = NAN;

		ape__acc_add(&a, o1, &ninf, NULL, NULL);
		ape__acc_store(&a, &t, s, &lse, NULL, NULL, 1, 0, 1);
		EXPECT_EQ(0.0f, out[0]);
		EXPECT_TRUE(isinf(lse) && lse < 0);
		ape__acc_add(&a, o1, &l1, NULL, NULL);
		ape__acc_add(&a, o2, &nan, NULL, NULL);
		ape__acc_add(&a, o2, &l2, NULL, NULL);
		ape__acc_store(&a, &t, s, &lse, NULL, NULL, 1, 0, 1);
		EXPECT_TRUE(isnan(out[0]));
		EXPECT_TRUE(isnan(lse));
	}
	ape__acc_free(&a);
}

/* ---- the work split */

TEST(work_queue_steals_from_the_busiest)
{
	const int64_t bounds[3] = { 0, 1, 6 };
	struct ape__workq *w;

	ASSERT_EQ(0, ape__workq_create(&w));
	ape__workq_single(w, 5);
	for (int i = 0; i < 5; i++)
		EXPECT_EQ(i, ape__workq_next(w, 0));
	EXPECT_EQ(-1, ape__workq_next(w, 0));

	/* worker 0 has chunk 0, worker 1 chunks 1..5: once 0 is done, it takes from the far
	 * end of the other's range, which keeps the chunks next to its own */
	ape__workq_set(w, 2, bounds, true);
	EXPECT_EQ(0, ape__workq_next(w, 0));
	EXPECT_EQ(1, ape__workq_next(w, 1));
	EXPECT_EQ(5, ape__workq_next(w, 0));
	EXPECT_EQ(4, ape__workq_next(w, 0));
	EXPECT_EQ(2, ape__workq_next(w, 1));
	EXPECT_EQ(3, ape__workq_next(w, 1));
	EXPECT_EQ(-1, ape__workq_next(w, 0));
	EXPECT_EQ(-1, ape__workq_next(w, 1));

	/* a fixed split: each worker its own range only */
	ape__workq_set(w, 2, bounds, false);
	EXPECT_EQ(0, ape__workq_next(w, 0));
	EXPECT_EQ(-1, ape__workq_next(w, 0));
	for (int i = 1; i < 6; i++)
		EXPECT_EQ(i, ape__workq_next(w, 1));
	EXPECT_EQ(-1, ape__workq_next(w, 1));
	ape__workq_destroy(w);
}

TEST_HARNESS_MAIN
