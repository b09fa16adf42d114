/* SPDX-License-Identifier: MIT */
/*
 * The int64 ends of the position range (issue 24, defect 1): validation admits every query-key
 * distance that fits in 64 bits, INT64_MAX and INT64_MIN included, and every backend must give
 * the reference's answer there. Each case puts a problem's nearest or farthest pair exactly at
 * an end: causal and non-causal with the last query INT64_MAX past the first key, non-causal
 * with the first query INT64_MIN before the last key, causal there (no key visible at all).
 * The shapes reach the decode (Lq <= 16), the general prefill kernels (D = 64, 128 and
 * generic), the float16 and bfloat16 paths and, with lambda = 0, the separable one; every case
 * runs in one call and in small chunks (the executor's own walk of the key chunks).
 *
 * What the reference's answer is at |n| near 2^63: every distance a row has rounds to the same
 * double, so its scores are equal (lambda > 0 also makes temp(n) about 1e-18, so the rotation,
 * which no float arithmetic resolves there, adds nothing): with delta = 0 O is the mean of the
 * visible V. With other decays a float32 kernel that keeps the exact integer differences of the
 * distances weighs the keys differently from the double reference, legitimately; those cases
 * take a V constant along the keys, where O = V whatever the weights, and only NaN, a lost row
 * or a wrong visibility shows. The reference itself is checked against that closed form too.
 * Streamed in chunks, a call's partial results are merged by their float32 LSE; with any decay
 * the LSE there is 1e8 to 1e19, past what float32 resolves (the merge's weights become 0 or 1
 * at random: a known limit of the executor, not of the distance rules), so the chunked runs
 * take the decay-free cases, whose LSE is about ln Lk.
 * Before the fix the OpenCL kernels returned NaN at INT64_MAX (ape_visible_keys() computed
 * diag + 1) and signed overflow was undefined behaviour in several kernels' tile tables.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"

BACKEND_FIXTURE(ends)

#define P62 ((int64_t)1 << 62)
#define SEED_DELTA 0.3968502629920499 /* 2^(-4/3), the seed's delta */

enum end { END_MAX, END_MIN };

struct ends_shape {
	int64_t Lq, Lk, D;
	ape_dtype dt;
};

static const struct ends_shape shapes[] = {
	{ 1, 5, 64, APE_F32 },	 { 3, 4, 64, APE_F32 },	     { 2, 300, 64, APE_F16 },
	{ 40, 70, 64, APE_F32 }, { 33, 150, 128, APE_BF16 }, { 20, 24, 40, APE_F32 },
	{ 70, 45, 64, APE_F16 }, { 17, 1, 128, APE_F32 },
};

/* The parameter sets: what V has to be for the closed form (see the top). */
struct ends_params {
	double delta, beta, gamma, lambda;
	bool v_const, q_zero; /* q_zero: with lambda = 0 the rotation would count */
	double skip_tol;
};

static const struct ends_params params[] = {
	{ 0, 0.05, 0.02, 0.5, false, false, 0x1p-24 },
	{ SEED_DELTA, SEED_DELTA / 10, SEED_DELTA / 10, 0.1, true, false, 0x1p-24 },
	{ SEED_DELTA, 0.01, 0.01, 0.1, true, false, 0 },
	{ -0.25, 0.1, -0.1, 0.3, true, false, 0 },
	{ 0, 0.1, 0, 0, false, true, 0x1p-24 },
	{ 0.5, 0.1, 0.1, 0, true, true, 0 },
	/* no decay: LSE stays small (ln Lk), where a streamed call's merge can work (below) */
	{ 0, 0, 0, 0.5, false, false, 0x1p-24 },
	{ 0, 0, 0, 0, false, true, 0 },
};

/* Positions putting one pair of the problem at the end: the last query INT64_MAX after the
 * first key (END_MAX), or the first query INT64_MIN before the last key (END_MIN). */
static void ends_place(ape_attn_desc *d, enum end e, int64_t Lq, int64_t Lk)
{
	d->q_start_set = true;
	if (e == END_MAX) {
		d->k_start = -P62;
		d->q_start = P62 - Lq; /* last query at 2^62 - 1: 2^63 - 1 after key 0 */
	} else {
		d->q_start = -P62;
		d->k_start = P62 - (Lk - 1); /* last key at 2^62: -2^63 from query 0 */
	}
}

static int ends_make(test_problem *tp, ape_rng *rng, const struct ends_shape *s,
		     const struct ends_params *p, enum end e, bool causal)
{
	const test_problem_shape sh = { 1, 2, 1, s->Lq, s->Lk, s->D };

	if (test_problem_make(tp, rng, &sh, s->dt, false))
		return -1;
	test_problem_set_params(tp, p->delta, p->beta, p->gamma, p->lambda);
	tp->desc.causal = causal;
	tp->desc.skip_tol = p->skip_tol;
	ends_place(&tp->desc, e, s->Lq, s->Lk);
	for (int64_t h = 0; h < sh.H && p->q_zero; h++)
		for (int64_t i = 0; i < s->Lq; i++)
			for (int64_t d = 0; d < s->D; d++)
				test_tensor_set(&tp->q.t, 0, h, i, d, 0);
	for (int64_t j = 0; j < s->Lk && p->v_const; j++)
		for (int64_t d = 0; d < s->D; d++) /* exact in every storage type */
			test_tensor_set(&tp->v.t, 0, 0, j, d, (double)(d % 7) - 3);
	return 0;
}

/* The closed form of the top: O of row i is the mean of its visible V (no key: 0, LSE -inf). */
static double ends_expected_err(const test_problem *tp, const struct ends_shape *s)
{
	const int64_t H = tp->q.t.shape[1];
	const int64_t rel = tp->desc.q_start - tp->desc.k_start; /* fits: both ends within 2^62 */
	double err = 0;

	for (int64_t h = 0; h < H; h++)
		for (int64_t i = 0; i < s->Lq; i++) {
			/* causal: keys j <= rel + i; rel + i fits (it is a real distance) */
			const int64_t diag = rel + i;
			const int64_t vis = !tp->desc.causal	? s->Lk
					    : diag < 0		? 0
					    : diag >= s->Lk - 1 ? s->Lk
								: diag + 1;

			for (int64_t d = 0; d < s->D; d++) {
				double mean = 0, got = test_tensor_get(&tp->o.t, 0, h, i, d);

				for (int64_t j = 0; j < vis; j++)
					mean += test_tensor_get(&tp->v.t, 0, 0, j, d) / (double)vis;
				err = fmax(err, isnan(got) ? INFINITY : fabs(got - mean));
			}
		}
	return err;
}

static double ends_tol_o(const test_problem *tp, ape_dtype dt)
{
	return (test_tol_o(dt) + test_skip_tol_o(tp->desc.skip_tol)) *
	       fmax(1.0, test_tensor_maxabs(&tp->v.t));
}

/*
 * One case on the fixture's device: in one call and in chunks, against the reference run of the
 * same problem and against the closed form. Returns the number of failed checks.
 */
static int ends_check(struct __test_metadata *_metadata, FIXTURE_DATA(ends) * self,
		      const struct ends_shape *s, const struct ends_params *p, enum end e,
		      bool causal, ape_rng *rng)
{
	const size_t rows = (size_t)(2 * s->Lq);
	test_problem ref, dev;
	int failed = 0;
	char what[200];

	ASSERT_EQ(0, ends_make(&ref, rng, s, p, e, causal));
	ASSERT_EQ(0, test_problem_clone(&dev, &ref));
	snprintf(what, sizeof(what),
		 "%s end, %s, Lq %lld Lk %lld D %lld dtype %d, delta %g beta %g gamma %g lambda %g "
		 "skip_tol %g, q_start %lld k_start %lld",
		 e == END_MAX ? "INT64_MAX" : "INT64_MIN", causal ? "causal" : "non-causal",
		 (long long)s->Lq, (long long)s->Lk, (long long)s->D, (int)s->dt, p->delta, p->beta,
		 p->gamma, p->lambda, p->skip_tol, (long long)ref.desc.q_start,
		 (long long)ref.desc.k_start);
	ASSERT_EQ(0, test_problem_run(&ref, self->ref)) TH_LOG("reference: %s", what);
	{
		const double tol = ends_tol_o(&ref, s->dt);
		double ee = ends_expected_err(&ref, s);

		if (!(ee <= tol)) {
			TH_LOG("reference against the closed form: %g > %g: %s", ee, tol, what);
			failed++;
		}
	}
	for (int chunked = 0; chunked < 2; chunked++) {
		const ape_exec_options o = test_chunks(16, 32);
		double eo, el;
		int ret;

		if (chunked && (p->delta != 0 || p->beta != 0 || p->gamma != 0))
			break; /* the float32 merge (see the top) */
		test_tensor_poison(&dev.o.t);
		for (size_t r = 0; r < rows; r++)
			dev.lse[r] = NAN;
		ret = ape_attention_forward_ex(&self->dev, 1, chunked ? &o : NULL, &dev.desc,
					       &dev.q.t, &dev.k.t, &dev.v.t, &dev.o.t, dev.lse,
					       NULL);
		if (ret) {
			TH_LOG("%s%s: %s", chunked ? "chunked: " : "", what, ape_strerror(ret));
			failed++;
			continue;
		}
		eo = test_max_err_o(&dev.o.t, &ref.o.t);
		el = test_max_rel_err_lse(dev.lse, ref.lse, rows);
		if (!(eo <= ends_tol_o(&ref, s->dt)) ||
		    !(el <= test_tol_lse(s->dt) + test_skip_tol_lse(p->skip_tol))) {
			TH_LOG("%s%s: O error %g, LSE error %g (LSE %g here, %g in the reference)",
			       chunked ? "chunked: " : "", what, eo, el, dev.lse[rows - 1],
			       ref.lse[rows - 1]);
			failed++;
		}
	}
	test_problem_free(&dev);
	test_problem_free(&ref);
	return failed;
}

static int ends_grid(struct __test_metadata *_metadata, FIXTURE_DATA(ends) * self, bool causal,
		     enum end e)
{
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, _metadata->name);
	for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
		for (size_t p = 0; p < sizeof(params) / sizeof(params[0]); p++)
			failed += ends_check(_metadata, self, &shapes[s], &params[p], e, causal,
					     &rng);
	return failed;
}

TEST_F(ends, forward_causal_int64_max)
{
	EXPECT_EQ(0, ends_grid(_metadata, self, true, END_MAX));
}

TEST_F(ends, forward_noncausal_int64_max)
{
	EXPECT_EQ(0, ends_grid(_metadata, self, false, END_MAX));
}

TEST_F(ends, forward_noncausal_int64_min)
{
	EXPECT_EQ(0, ends_grid(_metadata, self, false, END_MIN));
}

/* No key visible to any row (every distance negative, down to INT64_MIN): empty rows. */
TEST_F(ends, forward_causal_int64_min)
{
	EXPECT_EQ(0, ends_grid(_metadata, self, true, END_MIN));
}

/*
 * The backward pass at the ends, against the reference's gradients: dV (P^T dO: the equal
 * weights of the top) to the float32 tolerance; dQ, dK and the parameter gradients only finite.
 * Those weigh each pair by theta = n omega / alpha or |n|, about 2^62, where the rotation is
 * arbitrary in double (n omega carries an error of hundreds of radians) and sums of dS |n| cancel
 * to rounding noise of 2^63's size: no two evaluations agree on them.
 */
static bool all_finite(const ape_tensor *t)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					if (!isfinite(test_tensor_get(t, b, h, l, d)))
						return false;
	return true;
}

static int bwd_check(struct __test_metadata *_metadata, FIXTURE_DATA(ends) * self,
		     const char *backend, const struct ends_shape *s, enum end e, bool causal,
		     ape_rng *rng)
{
	static const struct ends_params p = { 0, 0.05, 0.02, 0.5, false, false, 0 };
	const int64_t H = 2;
	test_problem tp;
	test_tensor dout, g[2][3];
	float dparams[2][4 * 2];
	int failed = 0, ret;
	char what[160];

	ASSERT_EQ(0, ends_make(&tp, rng, s, &p, e, causal));
	ASSERT_EQ(0, test_problem_run(&tp, self->ref));
	ASSERT_EQ(0, test_tensor_random(&dout, rng, APE_F32, 1, H, s->Lq, s->D, 1.0));
	for (int w = 0; w < 2; w++) {
		ASSERT_EQ(0, test_tensor_empty(&g[w][0], APE_F32, 1, H, s->Lq, s->D));
		ASSERT_EQ(0, test_tensor_empty(&g[w][1], APE_F32, 1, 1, s->Lk, s->D));
		ASSERT_EQ(0, test_tensor_empty(&g[w][2], APE_F32, 1, 1, s->Lk, s->D));
	}
	snprintf(what, sizeof(what), "backward, %s end, %s, Lq %lld Lk %lld D %lld",
		 e == END_MAX ? "INT64_MAX" : "INT64_MIN", causal ? "causal" : "non-causal",
		 (long long)s->Lq, (long long)s->Lk, (long long)s->D);
	for (int w = 0; w < 2; w++) {
		ret = ape_attention_backward(w ? self->dev : self->ref, &tp.desc, &tp.q.t, &tp.k.t,
					     &tp.v.t, &tp.o.t, tp.lse, &dout.t, NULL, &g[w][0].t,
					     &g[w][1].t, &g[w][2].t, dparams[w], NULL);
		if (ret == APE_ENOTSUP && w)
			goto out_free; /* a backend without a backward pass */
		ASSERT_EQ(0, ret) TH_LOG("%s on %s", what, w ? backend : "ref");
	}
	for (int t = 0; t < 3; t++) {
		const double scale = fmax(test_tensor_maxabs(&g[0][t].t), 1e-30);
		const double err = test_max_err_o(&g[1][t].t, &g[0][t].t);

		if (t < 2 ? all_finite(&g[1][t].t) : err <= 1e-3 * scale)
			continue; /* dQ, dK: finite; dV: the reference's */
		TH_LOG("%s: %s error %g (largest %g)", what,
		       t == 0	? "dQ"
		       : t == 1 ? "dK"
				: "dV",
		       err, scale);
		failed++;
	}
	for (int k = 0; k < 4 * H; k++)
		if (!isfinite(dparams[1][k]) || !isfinite(dparams[0][k])) {
			TH_LOG("%s: dparams[%d] %g (reference %g)", what, k, dparams[1][k],
			       dparams[0][k]);
			failed++;
		}
out_free:
	for (int w = 0; w < 2; w++)
		for (int t = 0; t < 3; t++)
			test_tensor_free(&g[w][t]);
	test_tensor_free(&dout);
	test_problem_free(&tp);
	return failed;
}

TEST_F(ends, backward_at_both_ends)
{
	static const struct ends_shape bs[] = {
		{ 3, 4, 64, APE_F32 },
		{ 40, 70, 64, APE_F32 },
		{ 20, 24, 40, APE_F32 },
	};
	ape_rng rng;
	int failed = 0;

	ape_rng_init(&rng, _metadata->name);
	for (size_t s = 0; s < sizeof(bs) / sizeof(bs[0]); s++) {
		failed += bwd_check(_metadata, self, variant->backend, &bs[s], END_MAX, true, &rng);
		failed +=
			bwd_check(_metadata, self, variant->backend, &bs[s], END_MAX, false, &rng);
		failed +=
			bwd_check(_metadata, self, variant->backend, &bs[s], END_MIN, false, &rng);
	}
	EXPECT_EQ(0, failed);
}

/*
 * The backward where the LSE is beyond float32's integers: queries at INT64_MAX, keys near 0,
 * the seed's decay, so |LSE| ~ 4e18 and its float32 rounds by up to 2.7e11, below a row's own
 * scores. P = exp(s - LSE) overflowed to inf and every gradient was NaN on every backend
 * (found by fuzz_varlen); P's exponent is now at most 0 (APE_BWD_EXPONENT): finite gradients.
 */
TEST_F(ends, backward_finite_where_lse_exceeds_float_integers)
{
	enum { H = 2, LQ = 2, LK = 5, D = 8 };
	float q[H * LQ * D], k[LK * D], v[LK * D], o[H * LQ * D], lse[H * LQ];
	float dq[H * LQ * D], dk[LK * D], dv[LK * D], dp[4 * H];
	ape_tensor tq, tk, tv, to, tdq, tdk, tdv;
	ape_attn_desc d;
	int ret;

	for (int i = 0; i < H * LQ * D; i++)
		q[i] = (float)((i * 7) % 11 - 5) / 4;
	for (int i = 0; i < LK * D; i++) {
		k[i] = (float)((i * 5) % 9 - 4) / 4;
		v[i] = (float)((i * 3) % 7 - 3) / 2;
	}
	ape_tensor_init(&tq, q, APE_F32, 1, H, LQ, D);
	ape_tensor_init(&tk, k, APE_F32, 1, 1, LK, D);
	ape_tensor_init(&tv, v, APE_F32, 1, 1, LK, D);
	ape_tensor_init(&to, o, APE_F32, 1, H, LQ, D);
	ape_tensor_init(&tdq, dq, APE_F32, 1, H, LQ, D);
	ape_tensor_init(&tdk, dk, APE_F32, 1, 1, LK, D);
	ape_tensor_init(&tdv, dv, APE_F32, 1, 1, LK, D);
	ape_attn_desc_init(&d);
	d.delta.value = 0.3968503f;
	d.beta.value = d.gamma.value = 0.0396850f;
	d.lambda.value = 0.1f;
	d.causal = false;
	d.skip_tol = 0;
	d.k_start = 12345;
	d.q_start_set = true;
	d.q_start = INT64_MAX - (LQ - 1);
	ASSERT_EQ(0, ape_attention_forward(self->dev, &d, &tq, &tk, &tv, &to, lse, NULL))
	TH_LOG("%s", ape_last_error());
	EXPECT_LT(lse[0], -1e18f);
	ret = ape_attention_backward(self->dev, &d, &tq, &tk, &tv, &to, lse, &to, NULL, &tdq, &tdk,
				     &tdv, dp, NULL);
	if (ret == APE_ENOTSUP)
		SKIP(return, "%s", ape_last_error());
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < H * LQ * D; i++) {
		ASSERT_TRUE(isfinite(dq[i])) TH_LOG("dq[%d] = %g", i, dq[i]);
	}
	for (int i = 0; i < LK * D; i++) {
		ASSERT_TRUE(isfinite(dk[i]) && isfinite(dv[i]))
		TH_LOG("dk[%d] = %g, dv[%d] = %g", i, dk[i], i, dv[i]);
	}
	for (int i = 0; i < 4 * H; i++) {
		ASSERT_TRUE(isfinite(dp[i])) TH_LOG("dparams[%d] = %g", i, dp[i]);
	}
}

TEST_HARNESS_MAIN
