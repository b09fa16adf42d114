/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_backward() on the reference backend against the spec ("Gradients"), by finite
 * differences:
 *
 * - every gradient (q, k, v, delta, beta, gamma, lambda) against central finite differences of
 *   the loss sum(dO . O) + sum(dLSE . LSE), with O and LSE from tests/common/naive.c, the
 *   independent long-double evaluation of the forward (the reference's own forward stores O in
 *   float32, too coarse to difference; test_ref.c checks it against naive.c). Inputs and
 *   parameters are multiples of 2^-10 and 2^-12, so that x +- h is exact in float32;
 * - on small random cases across what the forward supports: GQA and MQA, both layouts, causal
 *   and not, offsets up to 2^40, rows with no visible key, constant query rows (sigma = 0),
 *   lambda = 0, negative decay, per-head and scalar parameters, with and without dLSE;
 * - the shared gradient pieces of ape/ape_math.h, and the skipping bound of the tail.
 *
 * The API's side of the call (storage types, layouts, options, statistics, invalid arguments)
 * is tests/test_backward_api.c; every backend against the reference tests/test_backward_backends.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/naive.h"
#include "common/positions.h"
#include "common/problem.h"

#define APE_REAL double
#include "ape/ape_math.h"

/*
 * The reference against finite differences, relative to max |G|. The float32 O and LSE the
 * API takes limit the reference to a few float32 ulps of the terms a gradient sums, which is
 * far below any formula error but not always below 1e-5 of the gradient itself: a gradient
 * can be a small difference of large terms (the sum over j of dS_ij is 0 without dLSE, so the
 * parameter gradients are such differences; with every key of a row far, the rounding of O in
 * Dl_i = dO_i . O_i is multiplied by |n|, which kernels inherit). So each comparison also
 * allows twice the first-order bound of what that rounding can do (fd_rounding()), and the
 * cases keep their keys within a few rows of the queries. Nor is the finite difference exact:
 * each element's comparison first takes off the difference's own error (fd_diff()), which
 * does not shrink with the gradient (a small scale makes dQ small, not the loss' rounding).
 */
#define FD_TOL 1e-5

/* Exact in float32 for finite differences: inputs multiples of 2^-10, parameters of 2^-12. */
static void bcase_quantize(bcase *c)
{
	test_problem *tp = &c->tp;
	const int64_t H = tp->q.t.shape[1];

	test_tensor_quantize(&tp->q.t, 0x1p-10);
	test_tensor_quantize(&tp->k.t, 0x1p-10);
	test_tensor_quantize(&tp->v.t, 0x1p-10);
	for (int64_t i = 0; i < 4 * H; i++)
		tp->params[i] = (float)test_quant(tp->params[i], 0x1p-12);
	tp->desc.delta.value = (float)test_quant(tp->desc.delta.value, 0x1p-12);
	tp->desc.beta.value = (float)test_quant(tp->desc.beta.value, 0x1p-12);
	tp->desc.gamma.value = (float)test_quant(tp->desc.gamma.value, 0x1p-12);
	tp->desc.lambda.value = (float)test_quant(tp->desc.lambda.value, 0x1p-12);
}

/* ---------------------------------------------------------------- finite differences */

/* The loss whose gradient the call returns: sum dO . O + sum dLSE . LSE, forward in long
 * double (rows with no visible key have LSE = -inf and depend on nothing: left out), summed in
 * long double; *labs: the sum of the terms' absolute values, which bounds its rounding
 * (fd_diff()). */
static long double fd_loss(bcase *c, double *labs)
{
	test_problem *tp = &c->tp;
	const int64_t *s = tp->q.t.shape;
	long double L = 0, A = 0;

	*labs = 0;
	if (test_problem_naive(tp))
		return NAN;
	for (int64_t b = 0; b < s[0]; b++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t i = 0; i < s[2]; i++) {
				const int64_t row = (b * s[1] + h) * s[2] + i;

				for (int64_t d = 0; d < s[3]; d++) {
					long double t = (long double)test_tensor_get(&c->dout.t, b,
										     h, i, d) *
							tp->naive_o[row * s[3] + d];

					L += t;
					A += fabsl(t);
				}
				if (c->dlse && isfinite(tp->naive_lse[row])) {
					long double t = (long double)c->dlse[row] *
							tp->naive_lse[row];

					L += t;
					A += fabsl(t);
				}
			}
	*labs = (double)A;
	return L;
}

/* What a finite difference moves: one float (x), or element (b, h, l, d) of a float32 tensor. */
typedef struct {
	float *x;
	ape_tensor *t;
	int64_t b, h, l, d;
} fd_input;

static double fd_get(const fd_input *in)
{
	return in->x ? *in->x : test_tensor_get(in->t, in->b, in->h, in->l, in->d);
}

static void fd_put(const fd_input *in, double v)
{
	if (in->x)
		*in->x = (float)v;
	else
		test_tensor_set(in->t, in->b, in->h, in->l, in->d, v);
}

/* (L(x0 + h) - L(x0 - h)) / 2h, x0 restored after; *labs: the larger sum of |terms|. */
static double fd_central(bcase *c, const fd_input *in, double x0, double h, double *labs)
{
	long double lp, lm;
	double ap, am;

	fd_put(in, x0 + h);
	lp = fd_loss(c, &ap);
	fd_put(in, x0 - h);
	lm = fd_loss(c, &am);
	fd_put(in, x0);
	*labs = fmax(ap, am);
	return (double)((lp - lm) / (2 * h));
}

/*
 * The derivative of the loss along one input by a central difference D(h) (x +- h, 2h, 4h exact
 * in float32: see bcase_quantize()), and *err, an estimate of the difference's own error,
 * which the tolerance on the gradient does not cover, since it does not shrink with the
 * gradient:
 * - truncation: D(h) = f' + C h^2 + ... where the loss is smooth: |D(h) - D(2h)|, three times
 *   the error. At a kink (a constant query row: sigma = 0 moves by |h|, fd_tensor()) D(h) =
 *   f' + K h + C h^2 + ...: the derivative is R(h) = 2 D(h) - D(2h) = f' - 2 C h^2 + ..., and
 *   |R(h) - R(2h)| three times its error;
 * - rounding: each loss is within 2^-52 of its sum of |terms| (the naive O and LSE rounded to
 *   double, 2^-53; the long-double sum of a few hundred terms far below), so D(h) is within
 *   2^-52 sum|terms| / h, R(h) within 2.5 times that. Left out, this failed the test now and
 *   then when the kink was met with a step of 2^-22 and a double sum: a constant row and a
 *   small scale (|scale| < 1e-3 makes dQ ~ 1e-4 and its tolerance ~ 1e-9, not the loss'
 *   rounding), dQ errors of 1e-9 to 6e-9.
 */
static double fd_diff(bcase *c, const fd_input *in, double h, bool kink, double *err)
{
	const double x0 = fd_get(in);
	double a1, a2, a4, d1 = fd_central(c, in, x0, h, &a1), d2 = fd_central(c, in, x0, 2 * h, &a2);
	double r1, r2;

	if (!kink) {
		*err = fabs(d1 - d2) + 0x1p-52 * a1 / h;
		return d1;
	}
	r1 = 2 * d1 - d2;
	r2 = 2 * d2 - fd_central(c, in, x0, 4 * h, &a4);
	*err = fabs(r1 - r2) + 2.5 * 0x1p-52 * fmax(a1, a2) / h;
	return r1;
}

/* A query row whose components are all equal: sigma = 0. */
static bool row_constant(const ape_tensor *t, int64_t b, int64_t h, int64_t l)
{
	for (int64_t d = 1; d < t->shape[3]; d++)
		if (test_tensor_get(t, b, h, l, d) != test_tensor_get(t, b, h, l, 0))
			return false;
	return true;
}

/* Over one gradient tensor: max of |G - FD| beyond the difference's own error (fd_diff()),
 * max |FD|, and the largest such own error. */
static void fd_tensor(bcase *c, ape_tensor *in, const ape_tensor *grad, bool is_q, double *err,
		      double *scale, double *fderr)
{
	*err = *scale = *fderr = 0;
	for (int64_t b = 0; b < in->shape[0]; b++)
		for (int64_t h = 0; h < in->shape[1]; h++)
			for (int64_t l = 0; l < in->shape[2]; l++) {
				/* at sigma = 0 the difference is off by O(h): extrapolated */
				const bool kink = is_q && row_constant(in, b, h, l);

				for (int64_t d = 0; d < in->shape[3]; d++) {
					const fd_input at = { NULL, in, b, h, l, d };
					double e, fd = fd_diff(c, &at, 0x1p-16, kink, &e);
					double g = test_tensor_get(grad, b, h, l, d);

					*err = fmax(*err, isnan(g) ? INFINITY : fabs(g - fd) - e);
					*scale = fmax(*scale, fabs(fd));
					*fderr = fmax(*fderr, e);
				}
			}
}

/* Adds |a - b| / div, element by element, into acc ([B, H, L, D] row-major). */
static void add_change(double *acc, const ape_tensor *a, const ape_tensor *b, double div)
{
	const int64_t *s = a->shape;
	int64_t e = 0;

	for (int64_t i = 0; i < s[0]; i++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t l = 0; l < s[2]; l++)
				for (int64_t d = 0; d < s[3]; d++, e++)
					acc[e] += fabs(test_tensor_get(a, i, h, l, d) -
						       test_tensor_get(b, i, h, l, d)) /
						  div;
}

/* One float32 step of x, 64 times over (0: x is exact at 0, nothing to move). */
static float steps64(float x)
{
	return x == 0 ? x : x + 64 * (nextafterf(fabsf(x), INFINITY) - fabsf(x));
}

/*
 * How far the float32 rounding of the O and LSE the reference is given can move each gradient,
 * to first order: every element of O and every finite LSE moved alone by 64 float32 steps
 * (so that the rounding of the float32 gradients is small against the change), the changes of
 * each gradient element summed in absolute value, divided by 64 and halved (a rounding moves an
 * element by at most half a step). noise[0..2]: the largest over dq, dk, dv; noise[3 + x]: over
 * the heads' parameter x, or for a scalar parameter over the sum of the heads'.
 */
static int fd_rounding(bcase *c, ape_device *dev, const grads *g, double noise[7])
{
	test_problem *tp = &c->tp;
	const int64_t *s = tp->o.t.shape, H = s[1];
	const size_t nq = (size_t)(s[0] * s[1] * s[2] * s[3]);
	const size_t nk = (size_t)(g->dk.t.shape[0] * g->dk.t.shape[1] * g->dk.t.shape[2] * s[3]);
	double *acc = calloc(nq + 2 * nk + 8 * (size_t)H, sizeof(double));
	double *aq = acc, *ak = acc + nq, *av = ak + nk, *ap = av + nk, *asum = ap + 4 * H;
	const ape_param *prm[4] = { &tp->desc.delta, &tp->desc.beta, &tp->desc.gamma,
				    &tp->desc.lambda };
	size_t moves = nq + tp->rows;
	grads gn;
	int ret = -1;

	memset(&gn, 0, sizeof(gn));
	if (!acc || grads_alloc(&gn, c, APE_F32))
		goto out;
	for (size_t m = 0; m < moves; m++) {
		const int64_t e = (int64_t)m, row = e / s[3];
		float *lse = m >= nq ? &tp->lse[m - nq] : NULL, x;

		if (lse) {
			x = *lse;
			if (!isfinite(x))
				continue;
			*lse = steps64(x);
		} else {
			x = (float)test_tensor_get(&tp->o.t, row / (H * s[2]), row / s[2] % H,
						   row % s[2], e % s[3]);
			test_tensor_set(&tp->o.t, row / (H * s[2]), row / s[2] % H, row % s[2],
					e % s[3], steps64(x));
		}
		if (run_backward(c, dev, &gn, W_ALL, NULL))
			goto out;
		if (lse)
			*lse = x;
		else
			test_tensor_set(&tp->o.t, row / (H * s[2]), row / s[2] % H, row % s[2],
					e % s[3], x);
		add_change(aq, &gn.dq.t, &g->dq.t, 128);
		add_change(ak, &gn.dk.t, &g->dk.t, 128);
		add_change(av, &gn.dv.t, &g->dv.t, 128);
		for (int64_t x4 = 0; x4 < 4 * H; x4++)
			ap[x4] += fabs((double)gn.dparams[x4] - g->dparams[x4]) / 128;
		for (int x4 = 0; x4 < 4; x4++) {
			double d = 0;

			for (int64_t h = 0; h < H; h++)
				d += (double)gn.dparams[4 * h + x4] - g->dparams[4 * h + x4];
			asum[x4] += fabs(d) / 128;
		}
	}
	for (int x = 0; x < 7; x++)
		noise[x] = 0;
	for (size_t e = 0; e < nq; e++)
		noise[0] = fmax(noise[0], aq[e]);
	for (size_t e = 0; e < nk; e++) {
		noise[1] = fmax(noise[1], ak[e]);
		noise[2] = fmax(noise[2], av[e]);
	}
	for (int x4 = 0; x4 < 4; x4++)
		for (int64_t h = 0; h < H; h++)
			noise[3 + x4] = fmax(noise[3 + x4], prm[x4]->per_head ? ap[4 * h + x4]
									 : asum[x4]);
	ret = 0;
out:
	grads_free(&gn);
	free(acc);
	return ret;
}

/* Every gradient of case c against finite differences; returns how many were off (-1: the
 * rounding bound could not be run). */
static int check_fd(struct __test_metadata *_metadata, bcase *c, ape_device *dev, const grads *g,
		    const char *what)
{
	test_problem *tp = &c->tp;
	ape_param *prm[4] = { &tp->desc.delta, &tp->desc.beta, &tp->desc.gamma, &tp->desc.lambda };
	static const char *const pname[4] = { "delta", "beta", "gamma", "lambda" };
	const int64_t H = tp->q.t.shape[1];
	double err[7], scale[7], noise[7], fderr[7];
	int bad = 0;
	char desc[512];

	fd_tensor(c, &tp->q.t, &g->dq.t, true, &err[0], &scale[0], &fderr[0]);
	fd_tensor(c, &tp->k.t, &g->dk.t, false, &err[1], &scale[1], &fderr[1]);
	fd_tensor(c, &tp->v.t, &g->dv.t, false, &err[2], &scale[2], &fderr[2]);
	for (int x = 0; x < 4; x++) {
		err[3 + x] = scale[3 + x] = fderr[3 + x] = 0;
		if (prm[x]->per_head) {
			for (int64_t h = 0; h < H; h++) {
				const fd_input at = { &tp->params[x * H + h], NULL, 0, 0, 0, 0 };
				double e, fd = fd_diff(c, &at, 0x1p-16, false, &e);
				double gv = g->dparams[4 * h + x];

				err[3 + x] = fmax(err[3 + x],
						  isnan(gv) ? INFINITY : fabs(gv - fd) - e);
				scale[3 + x] = fmax(scale[3 + x], fabs(fd));
				fderr[3 + x] = fmax(fderr[3 + x], e);
			}
		} else { /* one value for every head: its gradient is the sum over heads */
			const fd_input at = { &prm[x]->value, NULL, 0, 0, 0, 0 };
			double e, fd = fd_diff(c, &at, 0x1p-16, false, &e), sum = 0;

			for (int64_t h = 0; h < H; h++)
				sum += g->dparams[4 * h + x];
			err[3 + x] = isnan(sum) ? INFINITY : fmax(0, fabs(sum - fd) - e);
			scale[3 + x] = fabs(fd);
			fderr[3 + x] = e;
		}
	}
	if (fd_rounding(c, dev, g, noise))
		return -1;
	test_problem_describe(tp, desc, sizeof(desc));
	for (int x = 0; x < 7; x++) {
		static const char *const names[3] = { "dq", "dk", "dv" };

		if (err[x] <= FD_TOL * scale[x] + 2 * noise[x] + 1e-12)
			continue;
		TH_LOG("%s: %s%s: %s error %.3g beyond the finite difference's own error (up to "
		       "%.3g), max |finite difference| %.3g, rounding noise %.3g",
		       what, desc, c->dlse ? " dlse" : "", x < 3 ? names[x] : pname[x - 3], err[x],
		       fderr[x], scale[x], noise[x]);
		bad++;
	}
	return bad;
}
REF_FIXTURE(rd)

/* One small random case: shape, parameters, a constant row now and then. */
static int fd_case(struct __test_metadata *_metadata, ape_device *dev, ape_rng *r,
		   const test_problem_shape *sh, int variant, const char *what)
{
	bcase c;
	grads g;
	int bad = -1;

	if (bcase_make(&c, r, sh, APE_F32, variant & 1, ape_rng_uniform(r) < 0.6))
		goto out;
	test_problem_random_params(&c.tp, r);
	/* keys near the queries (see FD_TOL): rows see some keys, not others, or none */
	c.tp.desc.q_start_set = true;
	c.tp.desc.q_start = c.tp.desc.k_start + ape_rng_range(r, -3, sh->Lk - sh->Lq + 3);
	if (variant & 2) { /* far from the origin: distances stay small, angles exact */
		c.tp.desc.k_start += (int64_t)1 << 40;
		c.tp.desc.q_start += (int64_t)1 << 40;
	}
	if (variant & 4) /* lambda = 0: alpha = 1 and temp = 1, but d_lambda is not 0 */
		for (int64_t h = 0; h < sh->H; h++)
			c.tp.params[3 * sh->H + h] = c.tp.desc.lambda.value = 0;
	bcase_quantize(&c);
	if (variant & 8) /* a constant query row: sigma = 0 */
		for (int64_t d = 0; d < sh->D; d++)
			test_tensor_set(&c.tp.q.t, 0, sh->H - 1, sh->Lq / 2, d, 0.5);
	if (bcase_forward(&c, dev) || grads_alloc(&g, &c, APE_F32)) {
		TH_LOG("%s: forward failed: %s", what, ape_last_error());
		goto out_free;
	}
	if (run_backward(&c, dev, &g, W_ALL, NULL)) {
		TH_LOG("%s: backward failed: %s", what, ape_last_error());
		goto out_grads;
	}
	bad = check_fd(_metadata, &c, dev, &g, what);
out_grads:
	grads_free(&g);
out_free:
	bcase_free(&c);
out:
	return bad;
}

/* Random small cases, each variant (strided, 2^40, lambda = 0, constant row) in turn. */
TEST_F(rd, reference_matches_finite_differences)
{
	static const test_problem_shape shapes[] = {
		{ 1, 2, 2, 5, 7, 4 }, /* one kv head per query head */
		{ 2, 4, 2, 4, 6, 6 }, /* GQA */
		{ 1, 3, 1, 6, 5, 8 }, /* MQA */
		{ 1, 2, 1, 3, 9, 2 }, /* D = 2: sigma over two components */
	};
	ape_device *dev = self->dev;
	int ncases = ape_test_slow() ? 4 : 24, failed = 0;
	ape_rng rng;

	ape_rng_init(&rng, "reference_matches_finite_differences");
	for (int i = 0; i < ncases; i++)
		failed += fd_case(_metadata, dev, &rng, &shapes[i % 4], i % 16, "random") != 0;
	EXPECT_EQ(0, failed);
}

/* The named edge cases, each made sure of rather than left to chance. */
TEST_F(rd, finite_differences_edge_cases)
{
	const test_problem_shape sh = { 1, 4, 2, 5, 6, 6 };
	ape_device *dev = self->dev;
	ape_rng rng;

	ape_rng_init(&rng, "finite_differences_edge_cases");
	for (int layout = 0; layout < 2; layout++)
		for (int causal = 0; causal < 2; causal++) {
			bcase c;
			grads g;

			ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, true));
			test_problem_random_params(&c.tp, &rng);
			/* per-head parameters, one head with negative decays, one with
			 * lambda = 0, and queries placed so that the first rows see no key
			 * (causal) */
			c.tp.desc.delta.per_head = c.tp.params;
			c.tp.desc.beta.per_head = c.tp.params + sh.H;
			c.tp.desc.gamma.per_head = c.tp.params + 2 * sh.H;
			c.tp.desc.lambda.per_head = c.tp.params + 3 * sh.H;
			c.tp.params[0] = -0.25f;
			c.tp.params[sh.H] = -0.5f;
			c.tp.params[2 * sh.H] = -0.125f;
			c.tp.params[3 * sh.H + 1] = 0;
			c.tp.params[3 * sh.H + 2] = 1.75f;
			c.tp.desc.layout = layout ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
			c.tp.desc.causal = causal;
			c.tp.desc.k_start = 10;
			c.tp.desc.q_start = 8;
			c.tp.desc.q_start_set = true;
			bcase_quantize(&c);
			for (int64_t d = 0; d < sh.D; d++) /* sigma = 0 where lambda is large */
				test_tensor_set(&c.tp.q.t, 0, 2, 4, d, -0.5);
			ASSERT_EQ(0, bcase_forward(&c, dev));
			ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
			ASSERT_EQ(0, run_backward(&c, dev, &g, W_ALL, NULL));
			EXPECT_EQ(0, check_fd(_metadata, &c, dev, &g, "edge"));
			if (causal) /* rows 0 and 1 see no key: nothing flows back to them */
				for (int64_t d = 0; d < sh.D; d++) {
					EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, 0, 0, d));
					EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, 3, 1, d));
				}
			grads_free(&g);
			bcase_free(&c);
		}
}

/* The shared gradient pieces of ape/ape_math.h against central differences of the forward
 * pieces they differentiate, in float64. */
#define EXPECT_NEAR(a, b, tol) EXPECT_LE(fabs((double)(a) - (double)(b)), (double)(tol))

TEST(math_pieces)
{
	const double h = 1e-6;
	ape_rng rng;

	ape_rng_init(&rng, "math_pieces");
	for (int c = 0; c < 500; c++) {
		double lambda = ape_rng_uniform(&rng) * 2, sigma = ape_rng_uniform(&rng) * 3 + 0.01;
		double an = (double)ape_rng_range(&rng, 0, 200), alpha = ape_alpha(lambda, sigma);
		double x = ape_rng_normal(&rng), y = ape_rng_normal(&rng);
		double u = ape_rng_normal(&rng), w = ape_rng_normal(&rng);
		double nw = (double)ape_rng_range(&rng, -300, 300) * ape_rng_uniform(&rng);
		double fd, th = nw / alpha;
		double q[6], mean = 0, ss = 0, sig, qp[6];

#define PAIR_DOT(a) ((x * u + y * w) * cos(nw / (a)) + (x * w - y * u) * sin(nw / (a)))
		fd = (ape_alpha(lambda, sigma + h) - ape_alpha(lambda, sigma - h)) / (2 * h);
		EXPECT_NEAR(fd, ape_grad_dalpha_dsigma(lambda, sigma), 1e-8);
		fd = (ape_alpha(lambda + h, sigma) - ape_alpha(lambda - h, sigma)) / (2 * h);
		EXPECT_NEAR(fd, ape_grad_gate(sigma), 1e-8);
		fd = (ape_temp(lambda + h, an) - ape_temp(lambda - h, an)) / (2 * h);
		EXPECT_NEAR(fd, ape_grad_dtemp_dlambda(lambda, an), 1e-6 * fmax(1, fabs(fd)));
		fd = (PAIR_DOT(alpha + h) - PAIR_DOT(alpha - h)) / (2 * h);
		EXPECT_NEAR(fd, ape_grad_ddot_dalpha(x, y, u, w, cos(th), sin(th), th, alpha),
			    1e-5 * fmax(1, fabs(fd)));
#undef PAIR_DOT
		EXPECT_NEAR(ape_bias(1 + h, 0, 0, an) - ape_bias(1 - h, 0, 0, an),
			    2 * h * ape_grad_dbias_ddelta(an), 1e-9 * fmax(1, an));
		EXPECT_NEAR(ape_bias(0, 1 + h, 0, an) - ape_bias(0, 1 - h, 0, an),
			    2 * h * ape_grad_dbias_dbeta(an), 1e-12 * fmax(1, an));
		EXPECT_NEAR(ape_bias(0, 0, 1 + h, an) - ape_bias(0, 0, 1 - h, an),
			    2 * h * ape_grad_dbias_dgamma(an), 1e-12 * fmax(1, an));
		/* d(sigma)/d(q_0) = (q_0 - mean) * coef, sigma over 6 components */
		for (int d = 0; d < 6; d++)
			mean += (q[d] = ape_rng_normal(&rng)) / 6;
		for (int d = 0; d < 6; d++)
			ss += (q[d] - mean) * (q[d] - mean);
		sig = sqrt(ss / 5);
		for (int sgn = -1; sgn <= 1; sgn += 2) {
			double m2 = 0, s2 = 0;

			for (int d = 0; d < 6; d++)
				qp[d] = q[d] + (d == 0 ? sgn * h : 0);
			for (int d = 0; d < 6; d++)
				m2 += qp[d] / 6;
			for (int d = 0; d < 6; d++)
				s2 += (qp[d] - m2) * (qp[d] - m2);
			fd = sgn < 0 ? -sqrt(s2 / 5) : fd + sqrt(s2 / 5);
		}
		EXPECT_NEAR(fd / (2 * h), (q[0] - mean) * ape_grad_dsigma_coef(6, sig), 1e-7);
	}
	EXPECT_EQ(0.0, ape_grad_dsigma_coef(6, 0)); /* a constant row: 0 by the spec */
}

/* The backward's tail count against the sum it bounds, term by term: never below it, and
 * close to it (the geometric closed form, or the exact sum when that is smaller). */
TEST(backward_tail_count_bounds_the_sum)
{
	static const double deltas[] = { 0, 1e-3, 0.05, 0.397, 2 };
	static const double ans[] = { 0, 1, 7, 300, 5000 };
	static const double counts[] = { 1, 2, 64, 1000 };

	for (int a = 0; a < 5; a++)
		for (int b = 0; b < 5; b++)
			for (int k = 0; k < 4; k++) {
				double sum = 0, flat = 0, bound;

				for (double j = 0; j < counts[k]; j++) {
					sum += fmax(1, ans[b] + j) * exp(-deltas[a] * j);
					flat += ans[b] + 1 + j;
				}
				bound = ape_bwd_tail_count(counts[k], ans[b], deltas[a]);
				EXPECT_LE(sum, bound) TH_LOG("delta %g an %g count %g", deltas[a],
							     ans[b], counts[k]);
				/* never more than every key at its factor, plus one */
				EXPECT_LE(bound, flat * (1 + 1e-12)) TH_LOG("delta %g an %g count %g",
									    deltas[a], ans[b],
									    counts[k]);
				/* a long tail of a real decay: the sum, give or take one per
				 * key's worth of weight (max(1, x) <= x + 1) */
				if (deltas[a] >= 0.05 && counts[k] >= 1000)
					EXPECT_LE(bound, 1.002 * sum + 1.01 / -expm1(-deltas[a]))
						TH_LOG("delta %g an %g", deltas[a], ans[b]);
			}
	/* nothing to skip; no tolerance; a row without a finite LSE */
	EXPECT_TRUE(ape_bwd_may_skip(0.1, 0.4, 0.04, 0.04, 0.125, 8, 8, 10, 0, 0, 1e-4));
	EXPECT_FALSE(ape_bwd_may_skip(0.1, 0.4, 0.04, 0.04, 0.125, 8, 8, 1000, 64, 0, 0));
	EXPECT_FALSE(ape_bwd_may_skip(0.1, 0.4, 0.04, 0.04, 0.125, 8, 8, 1000, 64, NAN, 1e-4));
	EXPECT_FALSE(ape_bwd_may_skip(0.1, 0.4, 0.04, 0.04, 0.125, 8, 8, 1000, 64, -INFINITY, 1e-4));
	/* far keys of the seed's decay: negligible; near ones not */
	EXPECT_TRUE(ape_bwd_may_skip(0.1, 0.4, 0.04, 0.04, 0.125, 8, 8, 200, 64, 0, 1e-4));
	EXPECT_FALSE(ape_bwd_may_skip(0.1, 0.4, 0.04, 0.04, 0.125, 8, 8, 5, 64, 0, 1e-4));
}

TEST_HARNESS_MAIN
