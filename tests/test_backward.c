/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_backward() on the reference backend against the spec ("Gradients"):
 *
 * - every gradient (q, k, v, delta, beta, gamma, lambda) against central finite differences of
 *   the loss sum(dO . O) + sum(dLSE . LSE), with O and LSE from tests/common/naive.c, the
 *   independent long-double evaluation of the forward (the reference's own forward stores O in
 *   float32, too coarse to difference; test_ref.c checks it against naive.c). Inputs and
 *   parameters are multiples of 2^-10 and 2^-12, so that x +- h is exact in float32;
 * - on small random cases across what the forward supports: GQA and MQA, both layouts, causal
 *   and not, offsets up to 2^40, rows with no visible key, constant query rows (sigma = 0),
 *   lambda = 0, negative decay, per-head and scalar parameters, with and without dLSE;
 * - 16-bit storage against the same values stored as float32, within the spec's tolerances;
 * - strided tensors against contiguous ones, bit for bit, padding untouched;
 * - optional outputs left NULL, two runs bit-identical, the shapes that need no device;
 * - every invalid argument: its code, its message, nothing written; APE_ENOMEM over the
 *   budget;
 * - every backend (common/backend_fixture.h): one with the op against the reference at the
 *   spec's tolerances, one without it APE_ENOTSUP naming the device; streamed under small
 *   budgets, the buffers and the backend's declared scratch within the budget, what it
 *   allocates within what it declares.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/naive.h"
#include "common/problem.h"
#include "core/backend.h"

/* The backends' counters of the most scratch one backward launch allocated (declared in
 * opencl/ocl.h and cuda/cu.h, whose private structs cannot share one file). */
#ifdef APE_HAVE_OPENCL
extern atomic_uint_fast64_t ape__ocl_bwd_scratch_high;
#endif
#ifdef APE_HAVE_CUDA
extern atomic_uint_fast64_t ape__cu_bwd_scratch_high;
#endif

#define APE_REAL double
#include "core/ape_math.h"

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

static double quantize(double x, double step)
{
	return nearbyint(x / step) * step;
}

static void quantize_tensor(ape_tensor *t, double step)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					test_tensor_set(t, b, h, l, d,
							quantize(test_tensor_get(t, b, h, l, d),
								 step));
}

/* Exact in float32 for finite differences: inputs multiples of 2^-10, parameters of 2^-12. */
static void bcase_quantize(bcase *c)
{
	test_problem *tp = &c->tp;
	const int64_t H = tp->q.t.shape[1];

	quantize_tensor(&tp->q.t, 0x1p-10);
	quantize_tensor(&tp->k.t, 0x1p-10);
	quantize_tensor(&tp->v.t, 0x1p-10);
	for (int64_t i = 0; i < 4 * H; i++)
		tp->params[i] = (float)quantize(tp->params[i], 0x1p-12);
	tp->desc.delta.value = (float)quantize(tp->desc.delta.value, 0x1p-12);
	tp->desc.beta.value = (float)quantize(tp->desc.beta.value, 0x1p-12);
	tp->desc.gamma.value = (float)quantize(tp->desc.gamma.value, 0x1p-12);
	tp->desc.lambda.value = (float)quantize(tp->desc.lambda.value, 0x1p-12);
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

/* The reference device, for the tests of the reference itself and of the API. */
FIXTURE(rd)
{
	ape_context *ctx;
	ape_device *dev;
};

FIXTURE_SETUP(rd)
{
	self->ctx = test_context("ref");
	self->dev = test_device(self->ctx, "ref");
	ASSERT_NE(NULL, self->dev);
}

FIXTURE_TEARDOWN(rd)
{
	ape_context_destroy(self->ctx);
}

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

/* The shared gradient pieces of core/ape_math.h against central differences of the forward
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

/* ---------------------------------------------------------------- determinism and options */

/* Chunked against one launch: the same float64 terms, summed over chunks in float32 (dK, dV
 * on the device) or in float64 from float32 partials (dQ). */
#define CHUNK_TOL 1e-5

/* Each subset of the outputs: the wanted ones bit for bit as with all four, the others
 * untouched; and two runs give the same bits. */
TEST_F(rd, optional_outputs_and_determinism)
{
	const test_problem_shape sh = { 2, 4, 2, 9, 11, 8 };
	ape_device *dev = self->dev;
	ape_rng rng;
	bcase c;
	grads full, again;

	ape_rng_init(&rng, "optional_outputs_and_determinism");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F32, false, true, dev));
	ASSERT_EQ(0, grads_alloc(&full, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
	ASSERT_EQ(0, run_backward(&c, dev, &full, W_ALL, NULL));
	ASSERT_EQ(0, run_backward(&c, dev, &again, W_ALL, NULL));
	EXPECT_TRUE(same_grads(&full, &again, W_ALL));
	for (unsigned w = 1; w < W_ALL; w++) {
		grads g, untouched;

		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&untouched, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, dev, &g, w, NULL));
		EXPECT_TRUE(same_grads(&g, &full, w));
		/* NaN-poisoned: bits equal only if never written */
		EXPECT_TRUE(same_grads(&g, &untouched, W_ALL & ~w)) TH_LOG("wanted 0x%x", w);
		grads_free(&g);
		grads_free(&untouched);
	}
	grads_free(&full);
	grads_free(&again);
	bcase_free(&c);
}

/* ---------------------------------------------------------------- storage and layouts */

/* The same values as a contiguous tensor's, stored as float32 (widening is exact). */
static int widen(test_tensor *dst, const test_tensor *src)
{
	const int64_t *s = src->t.shape;

	if (test_tensor_empty(dst, APE_F32, s[0], s[1], s[2], s[3]))
		return -1;
	return ape_convert(dst->t.data, APE_F32, src->t.data, src->t.dtype,
			   (size_t)(s[0] * s[1] * s[2] * s[3]));
}

/* f16 and bf16 storage (gradients in the storage type and in float32) against the same
 * values stored as float32, within the spec's tolerances. */
TEST_F(rd, storage_types)
{
	static const ape_dtype types[] = { APE_F16, APE_BF16 };
	const test_problem_shape sh = { 1, 4, 2, 13, 17, 16 };
	ape_device *dev = self->dev;
	ape_rng rng;

	ape_rng_init(&rng, "storage_types");
	for (int t = 0; t < 2; t++)
		for (int out_f32 = 0; out_f32 < 2; out_f32++) {
			ape_dtype gt = out_f32 ? APE_F32 : types[t];
			test_tensor q32, k32, v32, o32, dout32;
			grads g16, g32;
			bcase c;

			ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, types[t], false, true, dev));
			ASSERT_EQ(0, widen(&q32, &c.tp.q));
			ASSERT_EQ(0, widen(&k32, &c.tp.k));
			ASSERT_EQ(0, widen(&v32, &c.tp.v));
			ASSERT_EQ(0, widen(&o32, &c.tp.o));
			ASSERT_EQ(0, widen(&dout32, &c.dout));
			ASSERT_EQ(0, grads_alloc(&g16, &c, gt));
			ASSERT_EQ(0, grads_alloc(&g32, &c, APE_F32));
			ASSERT_EQ(0, run_backward(&c, dev, &g16, W_ALL, NULL));
			ASSERT_EQ(0, ape_attention_backward(dev, &c.tp.desc, &q32.t, &k32.t, &v32.t,
							    &o32.t, c.tp.lse, &dout32.t, c.dlse,
							    &g32.dq.t, &g32.dk.t, &g32.dv.t,
							    g32.dparams, NULL));
			EXPECT_LE(grads_rel_err(&g16.dq.t, &g32.dq.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g16.dk.t, &g32.dk.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g16.dv.t, &g32.dv.t), grads_tol(types[t]));
			/* the same float64 computation: only the storing of the outputs differs */
			EXPECT_EQ(0, memcmp(g16.dparams, g32.dparams, sizeof(float) * 4 * sh.H));
			if (out_f32) /* nothing rounds differently at all */
				EXPECT_TRUE(same_grads(&g16, &g32, W_ALL));
			test_tensor_free(&q32);
			test_tensor_free(&k32);
			test_tensor_free(&v32);
			test_tensor_free(&o32);
			test_tensor_free(&dout32);
			grads_free(&g16);
			grads_free(&g32);
			bcase_free(&c);
		}
}

/* Padded [B, L, H, D] storage for a gradient: NaN where written, 0xff in the padding. */
static int strided_like(test_tensor *dst, const test_tensor *dense)
{
	return test_tensor_relayout(dst, dense, 3);
}

/* Strided inputs and outputs give the contiguous call's bits and leave the padding alone. */
TEST_F(rd, strided_tensors)
{
	const test_problem_shape sh = { 2, 4, 2, 7, 10, 8 };
	ape_device *dev = self->dev;
	test_tensor sdq, sdk, sdv, pristine;
	ape_rng rng;
	bcase c, cs;
	grads g;
	float *dp;

	ape_rng_init(&rng, "strided_tensors");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F32, false, true, dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, run_backward(&c, dev, &g, W_ALL, NULL));
	/* the same case with every tensor strided */
	memset(&cs, 0, sizeof(cs));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.q, &c.tp.q, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.k, &c.tp.k, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.v, &c.tp.v, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.tp.o, &c.tp.o, 3));
	ASSERT_EQ(0, test_tensor_relayout(&cs.dout, &c.dout, 3));
	ASSERT_EQ(0, strided_like(&sdq, &g.dq));
	ASSERT_EQ(0, strided_like(&sdk, &g.dk));
	ASSERT_EQ(0, strided_like(&sdv, &g.dv));
	ASSERT_EQ(0, strided_like(&pristine, &g.dq));
	dp = malloc(sizeof(float) * 4 * sh.H);
	ASSERT_NE(NULL, dp);
	test_tensor_poison(&sdq.t);
	test_tensor_poison(&sdk.t);
	test_tensor_poison(&sdv.t);
	test_tensor_poison(&pristine.t);
	ASSERT_EQ(0, ape_attention_backward(dev, &c.tp.desc, &cs.tp.q.t, &cs.tp.k.t, &cs.tp.v.t,
					    &cs.tp.o.t, c.tp.lse, &cs.dout.t, c.dlse, &sdq.t,
					    &sdk.t, &sdv.t, dp, NULL));
	EXPECT_EQ(0.0, test_max_err_o(&sdq.t, &g.dq.t));
	EXPECT_EQ(0.0, test_max_err_o(&sdk.t, &g.dk.t));
	EXPECT_EQ(0.0, test_max_err_o(&sdv.t, &g.dv.t));
	EXPECT_EQ(0, memcmp(dp, g.dparams, sizeof(float) * 4 * sh.H));
	/* every element NaN again: the whole allocation is then as it was, padding included */
	test_tensor_poison(&sdq.t);
	EXPECT_EQ(0, memcmp(sdq.alloc, pristine.alloc, sdq.alloc_bytes));
	test_tensor_free(&sdq);
	test_tensor_free(&sdk);
	test_tensor_free(&sdv);
	test_tensor_free(&pristine);
	test_tensor_free(&cs.tp.q);
	test_tensor_free(&cs.tp.k);
	test_tensor_free(&cs.tp.v);
	test_tensor_free(&cs.tp.o);
	test_tensor_free(&cs.dout);
	free(dp);
	grads_free(&g);
	bcase_free(&c);
}

/* ---------------------------------------------------------------- shapes without work */

static bool all_zero(const ape_tensor *t)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					if (test_tensor_get(t, b, h, l, d) != 0.0)
						return false;
	return true;
}

/* No keys, no queries, or no visible key at all: every gradient is exactly 0. */
TEST_F(rd, empty_and_invisible)
{
	static const test_problem_shape shapes[] = {
		{ 1, 2, 1, 5, 0, 4 }, /* Lk = 0 */
		{ 2, 2, 2, 0, 6, 4 }, /* Lq = 0 */
		{ 1, 2, 1, 4, 6, 4 }, /* every query before every key (causal) */
	};
	ape_device *dev = self->dev;
	ape_rng rng;

	ape_rng_init(&rng, "empty_and_invisible");
	for (int i = 0; i < 3; i++) {
		bcase c;
		grads g;
		ape_stats st;

		ASSERT_EQ(0, bcase_make(&c, &rng, &shapes[i], APE_F32, i == 2, true));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.causal = true;
		c.tp.desc.k_start = 100;
		c.tp.desc.q_start = 0;
		c.tp.desc.q_start_set = true;
		ASSERT_EQ(0, bcase_forward(&c, dev));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ape_stats_init(&st);
		ASSERT_EQ(0, run_backward(&c, dev, &g, W_ALL, &st));
		EXPECT_TRUE(all_zero(&g.dq.t));
		EXPECT_TRUE(all_zero(&g.dk.t));
		EXPECT_TRUE(all_zero(&g.dv.t));
		for (int64_t x = 0; x < 4 * shapes[i].H; x++)
			EXPECT_EQ(0.0f, g.dparams[x]);
		EXPECT_EQ(0u, st.pairs_visible);
		grads_free(&g);
		bcase_free(&c);
	}
}

/* ---------------------------------------------------------------- statistics and budget */

TEST_F(rd, statistics_and_budget)
{
	const test_problem_shape sh = { 1, 4, 2, 12, 20, 8 };
	ape_device *dev = self->dev;
	ape_exec_options eo;
	uint64_t visible, in_place_peak;
	ape_stats st;
	ape_rng rng;
	bcase c;
	grads g, fresh;

	ape_rng_init(&rng, "statistics_and_budget");
	ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, false));
	test_problem_random_params(&c.tp, &rng);
	c.tp.desc.q_start_set = false; /* end-aligned: some pair is visible, causal or not */
	ASSERT_EQ(0, bcase_forward(&c, dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&fresh, &c, APE_F32));
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, dev, &g, W_ALL, &st));
	ASSERT_EQ(0, ape_visible_pairs(&c.tp.desc, sh.B, sh.H, sh.Lq, sh.Lk, &visible));
	EXPECT_EQ(visible, st.pairs_visible);
	EXPECT_EQ(visible, st.pairs_computed);
	EXPECT_STREQ("ref", st.backend);
	EXPECT_EQ(1, st.devices);
	EXPECT_EQ(1u, st.chunks);
	/* one chunk each way: the reference reads the inputs where they lie (buf_wrap), so at most
	 * the pair counts go to the device */
	EXPECT_GE((uint64_t)(sh.B * sh.H * sh.Lq) * sizeof(uint64_t), st.bytes_to_device);
	EXPECT_LT(0u, st.bytes_from_device);
	EXPECT_LT(0u, st.peak_device_bytes);
	in_place_peak = st.peak_device_bytes;

	/* a budget too small for one row each way: refused before any work, saying what it
	 * needs; nothing written */
	ape_exec_options_init(&eo);
	eo.max_device_bytes = 100;
	EXPECT_EQ(APE_ENOMEM,
		  ape_attention_backward_ex(&dev, 1, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
					    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t, NULL,
					    &fresh.dq.t, &fresh.dk.t, &fresh.dv.t, fresh.dparams,
					    NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_backward_ex: ref:0 "));
	EXPECT_NE(NULL, strstr(ape_last_error(), "budget 100 bytes cannot hold the backward "
						 "pass's chunk of 1 query row and 1 key row"));
	for (int64_t i = 0; i < 4 * sh.H; i++)
		EXPECT_TRUE(isnan(fresh.dparams[i]));
	/* one byte short of the one-launch peak of a device that copies (buf_wrap hidden: in place,
	 * one launch holds only dparams and the pair counts): smaller chunks, within the budget */
	wrap_install(dev, WRAP_NO_BUF_WRAP);
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, dev, &fresh, W_ALL, &st));
	EXPECT_LT(in_place_peak, st.peak_device_bytes) TH_LOG("the inputs were copied before");
	eo.max_device_bytes = st.peak_device_bytes - 1;
	ape_stats_init(&st);
	EXPECT_EQ(0, ape_attention_backward_ex(&dev, 1, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
					       &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t, NULL,
					       &fresh.dq.t, &fresh.dk.t, &fresh.dv.t,
					       fresh.dparams, &st));
	wrap_remove();
	EXPECT_LT(1u, st.chunks);
	EXPECT_LE(st.peak_device_bytes, eo.max_device_bytes);
	EXPECT_EQ(eo.max_device_bytes, st.device_budget);
	EXPECT_LE(grads_rel_err(&fresh.dq.t, &g.dq.t), CHUNK_TOL);
	EXPECT_LE(grads_rel_err(&fresh.dk.t, &g.dk.t), CHUNK_TOL);
	EXPECT_LE(grads_rel_err(&fresh.dv.t, &g.dv.t), CHUNK_TOL);
	EXPECT_LE(grads_rel_err_params(fresh.dparams, g.dparams, sh.H), CHUNK_TOL);
	grads_free(&g);
	grads_free(&fresh);
	bcase_free(&c);
}

/* Chunks of every size across the borders of the rows give the one-launch result, the same
 * bits twice, and launch only the chunk pairs the mask lets through. */
TEST_F(rd, chunked_matches_one_launch)
{
	static const int64_t sizes[][2] = { { 1, 1 }, { 3, 5 }, { 4, 4 }, { 7, 16 }, { 13, 2 } };
	const test_problem_shape sh = { 2, 4, 2, 13, 17, 8 };
	ape_device *dev = self->dev;
	ape_rng rng;

	ape_rng_init(&rng, "chunked_matches_one_launch");
	for (int i = 0; i < 5; i++) {
		const int64_t cq = sizes[i][0], ck = sizes[i][1];
		int64_t pairs = 0;
		ape_stats st;
		bcase c;
		grads one, g, again;

		ASSERT_EQ(0, bcase_make(&c, &rng, &sh, i == 3 ? APE_BF16 : APE_F32, i % 2,
					i != 2));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.causal = i != 4;
		ASSERT_EQ(0, bcase_forward(&c, dev));
		ASSERT_EQ(0, grads_alloc(&one, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, dev, &one, W_ALL, NULL));
		ape_stats_init(&st);
		ASSERT_EQ(0, run_chunked(&c, dev, &g, cq, ck, &st));
		ASSERT_EQ(0, run_chunked(&c, dev, &again, cq, ck, NULL));
		EXPECT_TRUE(same_grads(&g, &again, W_ALL));
		EXPECT_LE(grads_rel_err(&g.dq.t, &one.dq.t), CHUNK_TOL);
		EXPECT_LE(grads_rel_err(&g.dk.t, &one.dk.t), CHUNK_TOL);
		EXPECT_LE(grads_rel_err(&g.dv.t, &one.dv.t), CHUNK_TOL);
		EXPECT_LE(grads_rel_err_params(g.dparams, one.dparams, sh.H), CHUNK_TOL);
		/* chunk pairs with a visible (query, key) pair */
		for (int64_t i0 = 0; i0 < sh.Lq; i0 += cq)
			for (int64_t j0 = 0; j0 < sh.Lk; j0 += ck) {
				int64_t last = i0 + cq < sh.Lq ? i0 + cq - 1 : sh.Lq - 1;

				pairs += !c.tp.desc.causal ||
					 c.tp.q_start + last >= c.tp.desc.k_start + j0;
			}
		EXPECT_EQ((uint64_t)pairs, st.chunks);
		EXPECT_EQ(cq, st.chunk_q);
		EXPECT_EQ(ck, st.chunk_k);
		grads_free(&one);
		grads_free(&g);
		grads_free(&again);
		bcase_free(&c);
	}
}

/* ---------------------------------------------------------------- invalid arguments */

/* The arguments of one call, each replaceable. */
typedef struct bargs {
	ape_device *dev;
	const ape_attn_desc *desc;
	const ape_tensor *q, *k, *v, *o, *dout;
	const float *lse, *dlse;
	ape_tensor *dq, *dk, *dv;
	float *dparams;
	ape_stats *stats;
} bargs;

static int call(const bargs *a)
{
	return ape_attention_backward(a->dev, a->desc, a->q, a->k, a->v, a->o, a->lse, a->dout,
				      a->dlse, a->dq, a->dk, a->dv, a->dparams, a->stats);
}

/* Byte copies of the four outputs, to prove nothing was written. */
typedef struct snapshot {
	void *b[4];
	size_t n[4];
} snapshot;

static void snap(snapshot *s, const grads *g)
{
	const void *src[4] = { g->dq.alloc, g->dk.alloc, g->dv.alloc, g->dparams };
	const size_t n[4] = { g->dq.alloc_bytes, g->dk.alloc_bytes, g->dv.alloc_bytes,
			      sizeof(float) * (size_t)(4 * g->H) };

	for (int i = 0; i < 4; i++) {
		s->n[i] = n[i];
		s->b[i] = malloc(n[i] + 1);
		memcpy(s->b[i], src[i], n[i]);
	}
}

static bool unchanged(const snapshot *s, const grads *g)
{
	const void *cur[4] = { g->dq.alloc, g->dk.alloc, g->dv.alloc, g->dparams };
	bool same = true;

	for (int i = 0; i < 4; i++) {
		same &= !memcmp(s->b[i], cur[i], s->n[i]);
		free(s->b[i]);
	}
	return same;
}

#define EXPECT_REFUSED(args, code, text)                                                           \
	do {                                                                                       \
		snapshot snap_;                                                                    \
		snap(&snap_, &g);                                                                  \
		EXPECT_EQ(code, call(&(args)));                                                    \
		EXPECT_NE(NULL, strstr(ape_last_error(), text)) TH_LOG("%s", ape_last_error());   \
		EXPECT_TRUE(unchanged(&snap_, &g));                                                \
	} while (0)

TEST_F(rd, invalid_arguments)
{
	const test_problem_shape sh = { 1, 4, 2, 6, 8, 8 };
	ape_device *dev = self->dev;
	ape_tensor bad;
	ape_attn_desc d;
	ape_stats st;
	ape_rng rng;
	bcase c;
	grads g;
	bargs ok, a;
	float neg = -1.0f;

	ape_rng_init(&rng, "invalid_arguments");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F16, false, true, dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F16));
	ok = (bargs){ dev,     &c.tp.desc, &c.tp.q.t, &c.tp.k.t, &c.tp.v.t, &c.tp.o.t,
		      &c.dout.t, c.tp.lse,  c.dlse,    &g.dq.t,   &g.dk.t,   &g.dv.t,
		      g.dparams, NULL };

	a = ok, a.dev = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: dev = NULL");
	a = ok, a.desc = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: desc = NULL");
	d = c.tp.desc, d.lambda.per_head = NULL, d.lambda.value = neg;
	a = ok, a.desc = &d;
	EXPECT_REFUSED(a, APE_EINVAL, "desc->lambda.value = -1: must be >= 0");
	a = ok, a.q = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: q = NULL");
	a = ok, a.o = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: o = NULL");
	a = ok, a.lse = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "lse = NULL: the backward pass needs the forward's LSE");
	a = ok, a.dout = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "ape_attention_backward: dout = NULL");
	a = ok, a.dq = NULL, a.dk = NULL, a.dv = NULL, a.dparams = NULL;
	EXPECT_REFUSED(a, APE_EINVAL, "dq, dk, dv and dparams are all NULL");

	bad = g.dq.t, bad.shape[2] = sh.Lq + 1;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq->shape[2] = 7: must equal Lq = 6");
	bad = g.dk.t, bad.shape[1] = 4;
	a = ok, a.dk = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dk->shape[1] = 4: must equal Hkv = 2");
	bad = g.dv.t, bad.dtype = APE_BF16;
	a = ok, a.dv = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dv->dtype = bf16: must be f16 or f32");
	bad = c.dout.t, bad.dtype = (ape_dtype)7;
	a = ok, a.dout = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dout->dtype = 7: not a libape storage type");
	bad = c.dout.t, bad.shape[3] = 4;
	a = ok, a.dout = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dout->shape[3] = 4: must equal D = 8");
	bad = g.dq.t, bad.strides[0] = 1, bad.strides[1] = 1, bad.strides[2] = 1,
	bad.strides[3] = 1;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq->strides[");
	EXPECT_NE(NULL, strstr(ape_last_error(), "output elements would overlap"));
	bad = g.dq.t, bad.data = NULL;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq->data = NULL");

	/* outputs overlapping inputs or each other */
	bad = g.dk.t, bad.data = c.tp.k.t.data;
	a = ok, a.dk = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dk overlaps k in memory");
	bad = g.dq.t, bad.data = c.dout.t.data;
	a = ok, a.dq = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dq overlaps dout in memory");
	bad = g.dv.t, bad.data = g.dk.t.data;
	a = ok, a.dv = &bad;
	EXPECT_REFUSED(a, APE_EINVAL, "dv overlaps dk in memory");
	a = ok, a.dparams = c.tp.lse;
	EXPECT_REFUSED(a, APE_EINVAL, "dparams overlaps lse in memory");
	a = ok, a.dparams = c.dlse + 1;
	EXPECT_REFUSED(a, APE_EINVAL, "dparams overlaps dlse in memory");
	a = ok, a.dparams = (float *)g.dq.t.data;
	EXPECT_REFUSED(a, APE_EINVAL, "dparams overlaps dq in memory");

	/* the stats and the _ex options */
	ape_stats_init(&st);
	st.struct_size = 3;
	a = ok, a.stats = &st;
	EXPECT_REFUSED(a, APE_EINVAL, "stats->struct_size = 3");
	{
		ape_device *two[2] = { dev, dev };
		ape_exec_options eo;
		snapshot s;

		ape_exec_options_init(&eo);
		snap(&s, &g);
		/* several devices are validated as the forward's are */
		eo.device_weights = (const double[]){ 1, 0 };
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 2, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(),
				       "ape_attention_backward_ex: opts->device_weights[1] = 0: "
				       "must be finite and > 0"))
			TH_LOG("%s", ape_last_error());
		eo.device_weights = NULL;
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 0, NULL, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "ndev = 0"));
		eo.trace_path = "/nonexistent-dir-of-ape/x.json";
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 2, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(),
				       "opts->trace_path = \"/nonexistent-dir-of-ape/x.json\": "
				       "directory /nonexistent-dir-of-ape/ does not exist"))
			TH_LOG("%s", ape_last_error());
		eo.trace_path = NULL;
		eo.pipeline_depth = 9;
		EXPECT_EQ(APE_EINVAL,
			  ape_attention_backward_ex(two, 1, &eo, &c.tp.desc, &c.tp.q.t, &c.tp.k.t,
						    &c.tp.v.t, &c.tp.o.t, c.tp.lse, &c.dout.t,
						    NULL, &g.dq.t, NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "opts->pipeline_depth = 9"));
		EXPECT_TRUE(unchanged(&s, &g));
	}
	/* and the valid call, for contrast */
	EXPECT_EQ(0, call(&ok)) TH_LOG("%s", ape_last_error());
	grads_free(&g);
	bcase_free(&c);
}

/* ---------------------------------------------------------------- every backend */

BACKEND_FIXTURE(bwd)

/*
 * Every backend: one that has the backward op against the reference at the spec's tolerances,
 * in one piece and in chunks, on every storage type; one that has not APE_ENOTSUP naming the
 * device, nothing written, no fallback to another device.
 */
TEST_F(bwd, every_backend_against_the_reference)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	const test_problem_shape small = { 1, 2, 1, 5, 7, 8 }, larger = { 2, 4, 2, 33, 47, 16 };
	const test_problem_shape *sh = self->emu || ape_test_slow() ? &small : &larger;
	const bool has_op = self->dev->caps.backward;
	ape_device_info info;
	char label[256];
	ape_rng rng;

	ASSERT_EQ(0, ape_device_get_info(self->dev, &info));
	snprintf(label, sizeof(label), "ape_attention_backward: %s:%d %s: ", info.backend,
		 info.backend_index, info.name);
	ape_rng_init(&rng, "every_backend_against_the_reference");
	for (int t = 0; t < 3; t++) {
		bcase c;
		grads want, g, chunked;

		ASSERT_EQ(0, bcase_ready(&c, &rng, sh, types[t], t == 1, true, self->ref));
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, types[t]));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, types[t]));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		if (!has_op) {
			snapshot s;

			snap(&s, &g);
			EXPECT_EQ(APE_ENOTSUP, run_backward(&c, self->dev, &g, W_ALL, NULL));
			EXPECT_NE(NULL, strstr(ape_last_error(), label)) TH_LOG("%s", ape_last_error());
			EXPECT_NE(NULL, strstr(ape_last_error(), "the backward pass is not "
								 "implemented on this backend yet"));
			EXPECT_TRUE(unchanged(&s, &g));
		} else {
			EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, NULL))
				TH_LOG("%s", ape_last_error());
			EXPECT_EQ(0, run_chunked(&c, self->dev, &chunked, 7, 16, NULL))
				TH_LOG("%s", ape_last_error());
			EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh->H), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&chunked.dq.t, &want.dq.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&chunked.dk.t, &want.dk.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&chunked.dv.t, &want.dv.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err_params(chunked.dparams, want.dparams, sh->H),
				  grads_tol(types[t]));
		}
		grads_free(&want);
		grads_free(&g);
		grads_free(&chunked);
		bcase_free(&c);
	}
}

/*
 * Every backend with the op, on the named cases one after another against the reference:
 * GQA and MQA, D = 2, 64 and one that no kernel specialises, both layouts, causal or not,
 * offsets of 2^40, rows that see no key (their dQ exactly 0), a constant query row (sigma = 0)
 * where lambda is large, lambda = 0, negative decays, per-head and scalar parameters, with and
 * without dLSE, every storage type with dO in it or in float32; then two runs bit for bit the
 * same, and the parameter gradients alone (the others left untouched).
 */
TEST_F(bwd, every_backend_edge_cases)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 9, 13, 64 }, /* GQA, a specialised D */
		{ 2, 3, 1, 7, 10, 6 }, /* MQA */
		{ 1, 2, 2, 5, 8, 2 }, /* D = 2 */
		{ 1, 2, 1, 40, 150, 66 }, /* a D no kernel specialises; more keys than a tile */
	};
	/* on the emulator 12: every shape with every storage type */
	const int ncases = ape_test_slow() ? 8 : self->emu ? 12 : 24;
	ape_rng rng;

	if (!self->dev->caps.backward)
		SKIP(return, "%s: no backward op (every_backend_against_the_reference checks that)",
		     variant->backend);
	ape_rng_init(&rng, "every_backend_edge_cases");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % 4];
		const ape_dtype dt = types[i / 4 % 3];
		const int64_t H = sh->H;
		bcase c;
		grads want, g, again, only, untouched;

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, false, i % 3 != 0));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i % 5 != 4;
		c.tp.desc.k_start = i % 7 == 2 ? ((int64_t)1 << 40) - i : -3 + i;
		/* the first two rows see no key when causal */
		c.tp.desc.q_start = c.tp.desc.k_start - 2;
		c.tp.desc.q_start_set = true;
		if (i % 2) { /* per head: head 0 with negative decays, head 1 with lambda = 0 */
			bcase_edge_heads(&c);
		} else if (i % 4 == 2) {
			c.tp.desc.lambda = (ape_param){ 0, NULL };
		}
		for (int64_t d = 0; d < sh->D; d++) /* sigma = 0 */
			test_tensor_set(&c.tp.q.t, 0, 0, sh->Lq - 1, d, 0.5);
		if (dt != APE_F32 && i % 3 == 1) { /* dO in float32 */
			test_tensor d32;

			ASSERT_EQ(0, widen(&d32, &c.dout));
			test_tensor_free(&c.dout);
			c.dout = d32;
		}
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&only, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&untouched, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->dev, &again, W_ALL, NULL));
		EXPECT_EQ(0, run_backward(&c, self->dev, &only, W_DP, NULL));
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(dt)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(dt)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(dt)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, H), grads_tol(dt))
			TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(only.dparams, want.dparams, H), grads_tol(dt))
			TH_LOG("case %d", i);
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", i);
		EXPECT_TRUE(same_grads(&only, &untouched, W_ALL & ~W_DP)) TH_LOG("case %d", i);
		if (c.tp.desc.causal)
			for (int64_t d = 0; d < sh->D; d++) {
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, 0, 0, d));
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, H - 1, 1, d));
			}
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		grads_free(&only);
		grads_free(&untouched);
		bcase_free(&c);
	}
}

/*
 * The borders of a backward that splits each (batch, kv head)'s key blocks among work-items and
 * sums the splits' partial dQ and row sums afterwards (OpenCL: ape_bwd_fused, 64 keys a block
 * at D = 64, 16 at D = 128, 8 otherwise, about four work-items per compute unit, so one kv head
 * gets several splits): key counts not a multiple of the block nor of the split count, fewer
 * blocks than splits, fewer keys than a block, grouped heads, both layouts, causal or not, rows
 * that see no key. Against the reference; two runs bit for bit the same (the splits' sums meet
 * in a fixed order: a reduction in the order the work-items finish would differ in the last
 * bits between runs); and each output asked alone bit for bit as with all four.
 */
TEST_F(bwd, every_backend_split_borders)
{
	static const test_problem_shape shapes[] = {
		{ 1, 2, 1, 37, 200, 64 }, /* 4 blocks of 64, the last of 8 keys */
		{ 1, 3, 1, 33, 70, 128 }, /* GQA, 5 blocks of 16, the last of 6 */
		{ 1, 2, 2, 20, 100, 64 }, /* 2 blocks: fewer than the work-items wanted */
		{ 2, 2, 1, 45, 19, 64 }, /* fewer keys than a block */
		{ 1, 2, 1, 23, 97, 10 }, /* a D no kernel specialises: 13 blocks of 8 */
	};
	static const unsigned alone[] = { W_DQ, W_DK, W_DV, W_DP };
	const int ncases = self->emu || ape_test_slow() ? 5 : 10;
	ape_rng rng;

	if (!self->dev->caps.backward)
		SKIP(return, "%s: no backward op (every_backend_against_the_reference checks that)",
		     variant->backend);
	ape_rng_init(&rng, "every_backend_split_borders");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % 5];
		bcase c;
		grads want, g, again;

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, APE_F32, false, i % 2 == 0));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i < 5;
		c.tp.desc.k_start = 5 * i;
		/* causal: the first three rows see no key, the last ones all */
		c.tp.desc.q_start = c.tp.desc.k_start - 3 + (sh->Lk > sh->Lq ? sh->Lk - sh->Lq : 0);
		c.tp.desc.q_start_set = true;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->dev, &again, W_ALL, NULL));
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(APE_F32)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(APE_F32)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(APE_F32)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh->H), grads_tol(APE_F32))
			TH_LOG("case %d", i);
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", i);
		for (int w = 0; w < 4; w++) {
			grads one;

			ASSERT_EQ(0, grads_alloc(&one, &c, APE_F32));
			EXPECT_EQ(0, run_backward(&c, self->dev, &one, alone[w], NULL));
			EXPECT_TRUE(same_grads(&one, &g, alone[w]))
				TH_LOG("case %d: output 0x%x alone differs", i, alone[w]);
			grads_free(&one);
		}
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		bcase_free(&c);
	}
}

/*
 * Skipping in the backward pass (docs/kernels.md, "Skipping in the backward pass"): with the
 * seed's parameters (delta = 2^(-4/3), beta = gamma = delta / 10, lambda = 0.1) and skip_tol =
 * 1e-4, long enough rows that whole key tiles lie far behind (causal) or on both sides (the
 * third case: grouped heads and a D no kernel specialises): every
 * gradient within the spec's float32 tolerance of the reference's dense ones, in one launch and
 * in chunks, two runs bit for bit the same; a backend that counts the pairs it computed
 * (OpenCL) computed fewer than are visible, the others at most as many.
 */
TEST_F(bwd, every_backend_skipping_within_tolerance)
{
	/* non-causal; causal; GQA with a D no kernel specialises, fewer queries than keys
	 * (end-aligned: the queries are the last 300 positions) */
	static const test_problem_shape shapes[] = {
		{ 1, 2, 1, 700, 700, 64 },
		{ 1, 2, 1, 700, 700, 64 },
		{ 1, 4, 2, 300, 900, 66 },
	};
	const bool counts = strcmp(variant->backend, "opencl") == 0;
	ape_rng rng;

	if (!self->dev->caps.backward)
		SKIP(return, "%s: no backward op (every_backend_against_the_reference checks that)",
		     variant->backend);
	if (self->emu || ape_test_slow())
		SKIP(return, "700 x 700 rows: too long for the emulated device or a slow run");
	ape_rng_init(&rng, "every_backend_skipping_within_tolerance");
	for (int causal = 0; causal < 3; causal++) {
		const test_problem_shape sh = shapes[causal];
		const float delta = (float)pow(2, -4.0 / 3);
		uint64_t visible;
		ape_stats st;
		bcase c;
		grads want, g, again, chunked;

		ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, causal == 0));
		c.tp.desc.delta = (ape_param){ delta, NULL };
		c.tp.desc.beta = c.tp.desc.gamma = (ape_param){ delta / 10, NULL };
		c.tp.desc.lambda = (ape_param){ 0.1f, NULL };
		c.tp.desc.causal = causal != 0;
		c.tp.desc.q_start_set = false; /* end-aligned */
		c.tp.desc.skip_tol = 0;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		c.tp.desc.skip_tol = 1e-4f;
		ape_stats_init(&st);
		EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, &st)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->dev, &again, W_ALL, NULL));
		EXPECT_EQ(0, run_chunked(&c, self->dev, &chunked, 256, 200, NULL))
			TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_visible_pairs(&c.tp.desc, sh.B, sh.H, sh.Lq, sh.Lk, &visible));
		EXPECT_EQ(visible, st.pairs_visible);
		if (counts) {
			EXPECT_LT(st.pairs_computed, visible) TH_LOG("case %d", causal);
		} else {
			EXPECT_LE(st.pairs_computed, visible);
		}
		EXPECT_LT(0u, st.pairs_computed);
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(APE_F32)) TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(APE_F32)) TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(APE_F32)) TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh.H), grads_tol(APE_F32))
			TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err(&chunked.dq.t, &want.dq.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&chunked.dk.t, &want.dk.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&chunked.dv.t, &want.dv.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err_params(chunked.dparams, want.dparams, sh.H), grads_tol(APE_F32));
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", causal);
		TH_LOG("case %d: %llu of %llu visible pairs computed; errors dq %.2e dk %.2e dv %.2e "
		       "dparams %.2e",
		       causal, (unsigned long long)st.pairs_computed, (unsigned long long)visible,
		       grads_rel_err(&g.dq.t, &want.dq.t), grads_rel_err(&g.dk.t, &want.dk.t),
		       grads_rel_err(&g.dv.t, &want.dv.t), grads_rel_err_params(g.dparams, want.dparams, sh.H));
		/* a NaN in key 0, either sign (the saved O and LSE stay finite): the bound never
		 * leaves out a key of its head, so it reaches dQ of the last row, 699 keys away,
		 * as in the reference */
		for (int sign = 0; causal == 0 && sign < 2; sign++) {
			const double nan = sign ? -NAN : NAN;

			test_tensor_set(&c.tp.k.t, 0, 0, 0, 0, nan);
			ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_DQ, NULL));
			EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_DQ, NULL));
			EXPECT_TRUE(isnan(test_tensor_get(&want.dq.t, 0, 0, sh.Lq - 1, 0)));
			EXPECT_TRUE(isnan(test_tensor_get(&g.dq.t, 0, 0, sh.Lq - 1, 0)))
				TH_LOG("sign %d", sign);
		}
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		grads_free(&chunked);
		bcase_free(&c);
	}
}

/* ape_attention_backward_ex() of every output of c on dev alone under `budget` device bytes. */
static int budgeted(bcase *c, ape_device *dev, grads *g, uint64_t budget, ape_stats *st)
{
	ape_exec_options eo;

	ape_exec_options_init(&eo);
	eo.max_device_bytes = budget;
	ape_stats_init(st);
	return ape_attention_backward_ex(&dev, 1, &eo, &c->tp.desc, &c->tp.q.t, &c->tp.k.t,
					 &c->tp.v.t, &c->tp.o.t, c->tp.lse, &c->dout.t, c->dlse,
					 &g->dq.t, &g->dk.t, &g->dv.t, g->dparams, st);
}

/* The most scratch one backward launch of dev's backend allocated since the last call (the
 * backends' own counters, core/backend.h attention_backward_scratch); 0 for the reference,
 * which allocates none. */
static uint64_t allocated_scratch(const ape_device *dev)
{
#ifdef APE_HAVE_OPENCL
	if (!strcmp(dev->info.backend, "opencl"))
		return atomic_exchange(&ape__ocl_bwd_scratch_high, 0);
#endif
#ifdef APE_HAVE_CUDA
	if (!strcmp(dev->info.backend, "cuda"))
		return atomic_exchange(&ape__cu_bwd_scratch_high, 0);
#endif
	(void)dev;
	return 0;
}

/* Whether dev reads host memory in place (its capabilities say so). */
static bool wraps_host_memory(const ape_device *dev)
{
	return dev->caps.host_memory;
}

/*
 * Every backend with the op, streamed under budgets smaller than one launch needs: the device
 * bytes held at once (every buffer, and the scratch the backend declares for each launch in
 * flight, as the wrapper counts them) stay within the budget and are the peak the statistics
 * report; what a launch allocates is at most what the backend declares for it; the gradients
 * are the one-launch ones. And the check can fail: with the declaration hidden from the core,
 * a budget that holds the buffers of one launch but not its scratch is overrun.
 *
 * The queries are end-aligned (as in rd.statistics_and_budget): with Lq <= Lk every query chunk
 * sees key 0 and every key chunk is seen by the last query, so the problem needs a launch and a
 * plan split either way launches more than one chunk pair. With random offsets the causal mask
 * may hide every pair (no launch to measure) or every pair of a split but one (st.chunks counts
 * launches, never the pairs the mask hides: ape.h), whatever the planner chose; the split itself
 * is checked on the chunk sizes the planner reports.
 *
 * The budgets are those of a device that copies its inputs (buf_wrap hidden): on one that reads
 * host memory in place (the reference, OpenCL CPU devices) one launch holds no input buffer, so
 * its peak is smaller, by the inputs, and is what the wrapper counts too; chunked calls stage.
 */
TEST_F(bwd, streamed_budget_counts_the_backend_scratch)
{
	const test_problem_shape small = { 1, 2, 1, 12, 20, 8 }, larger = { 1, 4, 2, 40, 56, 16 };
	const test_problem_shape *sh = self->emu || ape_test_slow() ? &small : &larger;
	const bool ref = !strcmp(variant->backend, "ref");
	/* chunked against one launch: CHUNK_TOL where the pair terms are float64 (the reference);
	 * the kernels compute them in float32 from rotations seeded at each tile's first key, so
	 * other chunk borders round differently and the spec's tolerance applies (the parameter
	 * sums, over every pair, showed 1e-5 of their largest on the emulated CUDA device) */
	const double ctol = ref ? CHUNK_TOL : grads_tol(APE_F32);
	const bool in_place = wraps_host_memory(self->dev);
	struct wrap_counts wc;
	uint64_t one_peak, declared, allocated, in_place_peak;
	ape_stats st;
	ape_rng rng;
	bcase c;
	grads want, g;

	if (!self->dev->caps.backward)
		SKIP(return, "no backward pass on %s", variant->backend);
	ape_rng_init(&rng, "streamed_budget_counts_the_backend_scratch");
	ASSERT_EQ(0, bcase_make(&c, &rng, sh, APE_F32, false, true));
	test_problem_random_params(&c.tp, &rng);
	c.tp.desc.q_start_set = false; /* end-aligned: see above */
	ASSERT_EQ(0, bcase_forward(&c, self->ref));
	ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));

	/* one launch reading its inputs in place where the device can: no input buffer held */
	wrap_install(self->dev, 0);
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, &st)) TH_LOG("%s", ape_last_error());
	wc = wrap_get();
	in_place_peak = st.peak_device_bytes;
	EXPECT_EQ(in_place_peak, wc.peak_bytes) TH_LOG("the executor and the wrapper count apart");
	wrap_remove();

	/* one launch with copies: the peak with its scratch */
	wrap_install(self->dev, WRAP_NO_BUF_WRAP);
	allocated_scratch(self->dev);
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, self->dev, &want, W_ALL, &st)) TH_LOG("%s", ape_last_error());
	wc = wrap_get();
	one_peak = st.peak_device_bytes;
	declared = wc.bwd_scratch_max;
	allocated = allocated_scratch(self->dev);
	ASSERT_EQ(1u, st.chunks);
	ASSERT_EQ(sh->Lq, st.chunk_q);
	ASSERT_EQ(sh->Lk, st.chunk_k);
	EXPECT_EQ(one_peak, wc.peak_bytes) TH_LOG("the executor and the wrapper count apart");
	EXPECT_LE(allocated, declared) TH_LOG("the backend allocated more than it declared");
	if (ref) {
		EXPECT_EQ(0u, declared);
	} else {
		EXPECT_LT(0u, allocated) TH_LOG("no scratch seen: the counter is broken");
	}
	if (in_place) {
		EXPECT_LT(in_place_peak, one_peak) TH_LOG("inputs copied on a device that wraps");
		/* the same launch, the same bits, whether the inputs were copied or not */
		EXPECT_EQ(0, memcmp(g.dq.alloc, want.dq.alloc, g.dq.alloc_bytes));
		EXPECT_EQ(0, memcmp(g.dk.alloc, want.dk.alloc, g.dk.alloc_bytes));
		EXPECT_EQ(0, memcmp(g.dv.alloc, want.dv.alloc, g.dv.alloc_bytes));
		EXPECT_EQ(0, memcmp(g.dparams, want.dparams, sizeof(float) * 4 * sh->H));
	} else {
		EXPECT_EQ(in_place_peak, one_peak);
	}
	ksft_print_msg("%s: one launch: peak %llu bytes, scratch declared %llu, allocated %llu\n",
		       variant->backend, (unsigned long long)one_peak,
		       (unsigned long long)declared, (unsigned long long)allocated);

	for (int i = 2; i <= 4; i += 2) {
		const uint64_t budget = one_peak / (uint64_t)i;

		wrap_reset();
		ASSERT_EQ(0, budgeted(&c, self->dev, &g, budget, &st)) TH_LOG("%s", ape_last_error());
		wc = wrap_get();
		allocated = allocated_scratch(self->dev);
		EXPECT_TRUE(st.chunk_q < sh->Lq || st.chunk_k < sh->Lk) TH_LOG("not split");
		EXPECT_LT(1u, st.chunks);
		EXPECT_EQ(budget, st.device_budget);
		EXPECT_LE(st.peak_device_bytes, budget);
		EXPECT_LE(wc.peak_bytes, budget) TH_LOG("the backend held more than the budget");
		EXPECT_EQ(st.peak_device_bytes, wc.peak_bytes);
		EXPECT_LE(allocated, wc.bwd_scratch_max);
		EXPECT_EQ(wc.allocs, wc.frees);
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), ctol);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), ctol);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), ctol);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh->H), ctol)
		TH_LOG("dparams rel err %.3g", grads_rel_err_params(g.dparams, want.dparams, sh->H));
		ksft_print_msg("%s: budget %llu: chunks %lld x %lld (%llu), peak %llu, scratch "
			       "declared %llu, allocated %llu\n",
			       variant->backend, (unsigned long long)budget, (long long)st.chunk_q,
			       (long long)st.chunk_k, (unsigned long long)st.chunks,
			       (unsigned long long)st.peak_device_bytes,
			       (unsigned long long)wc.bwd_scratch_max, (unsigned long long)allocated);
	}
	fflush(stdout); /* the harness ends each test with _exit() */

	/* the budget of one launch's buffers alone, the scratch left out of the plan: one launch,
	 * over the budget by its scratch; with the scratch counted, chunks within it */
	if (declared) {
		const uint64_t budget = one_peak - declared;

		wrap_remove();
		wrap_install(self->dev, WRAP_NO_BWD_SCRATCH | WRAP_NO_BUF_WRAP);
		ASSERT_EQ(0, budgeted(&c, self->dev, &g, budget, &st)) TH_LOG("%s", ape_last_error());
		wc = wrap_get();
		EXPECT_EQ(1u, st.chunks);
		EXPECT_EQ(sh->Lq, st.chunk_q);
		EXPECT_EQ(sh->Lk, st.chunk_k);
		EXPECT_EQ(one_peak, wc.peak_bytes);
		EXPECT_GT(wc.peak_bytes, budget);
		wrap_remove();
		wrap_install(self->dev, WRAP_NO_BUF_WRAP);
		ASSERT_EQ(0, budgeted(&c, self->dev, &g, budget, &st)) TH_LOG("%s", ape_last_error());
		wc = wrap_get();
		EXPECT_TRUE(st.chunk_q < sh->Lq || st.chunk_k < sh->Lk) TH_LOG("not split");
		EXPECT_LT(1u, st.chunks);
		EXPECT_LE(wc.peak_bytes, budget);
	}

	/* too small for one row each way: the message counts the scratch */
	EXPECT_EQ(APE_ENOMEM, budgeted(&c, self->dev, &g, 64, &st));
	EXPECT_NE(NULL, strstr(ape_last_error(), " of them the backend's scratch)"))
		TH_LOG("%s", ape_last_error());
	grads_free(&want);
	grads_free(&g);
	bcase_free(&c);
}

TEST_HARNESS_MAIN
