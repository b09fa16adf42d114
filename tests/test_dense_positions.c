/* SPDX-License-Identifier: MIT */
/*
 * Explicit positions in the dense call (ape_attn_desc.pos_q, .pos_k: Lq and Lk positions shared
 * by the batch), on every backend: B = 3, GQA, causal or not, both rotation layouts, every
 * storage type, contiguous and [B, L, H, D] strides, positions shifted, with gaps, repeated,
 * shuffled and decreasing; the forward against tests/common/naive.c's independent evaluation at
 * those positions, in one launch (a device that reads positions), in chunks, and in runs of
 * consecutive positions (the capability hidden); the backward against central differences of
 * that evaluation and, for shifted positions, against the dense backward at q_start, k_start;
 * positions 0.. given explicitly are the implicit call bit for bit on the reference; a desc of
 * the first layout (APE_ATTN_DESC_V1_SIZE) still works; bad positions and the calls that take
 * none (ragged, diagnostics, KV cache, device tensors) are refused naming the field, writing
 * nothing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "core/backend.h"
#include "core/error.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/naive.h"
#include "common/positions.h"
#include "common/problem.h"
#include "common/resident.h"
#include "common/testutil.h"

BACKEND_FIXTURE(dev)

enum { NB = 3 };

struct pcase {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dt, odt;
	bool blhd;
	enum pos_mode m;
	int64_t *pq, *pk;
	test_tensor q, k, v, o;
	float *lse;
	float prm[4][8];
	ape_attn_desc desc;
	char what[256];
};

/* One of q, k, v stored [B, L, H, D] with padding after each row (strides of another layout). */
static int to_blhd(test_tensor *t)
{
	test_tensor x;

	if (test_tensor_relayout(&x, t, 3))
		return -1;
	test_tensor_free(t);
	*t = x;
	return 0;
}

/* A random case of B = nb at positions of mode m: storage type dt (-1: drawn), queries and
 * keys of at most maxq and maxk rows. */
static int case_make(struct pcase *c, ape_rng *r, enum pos_mode m, int64_t nb, int dt,
		     int64_t maxq, int64_t maxk)
{
	static const ape_dtype dts[3] = { APE_F32, APE_F16, APE_BF16 };
	static const int64_t Ds[3] = { 8, 16, 32 };
	int64_t base;

	memset(c, 0, sizeof(*c));
	c->B = nb;
	c->m = m;
	c->Hkv = ape_rng_range(r, 1, 2);
	c->H = c->Hkv * ape_rng_range(r, 1, 3);
	c->D = Ds[ape_rng_range(r, 0, 2)];
	c->dt = dt >= 0 ? (ape_dtype)dt : dts[ape_rng_range(r, 0, 2)];
	c->odt = ape_rng_range(r, 0, 1) ? APE_F32 : c->dt;
	c->Lq = ape_rng_range(r, 1, maxq);
	c->Lk = ape_rng_range(r, 1, maxk);
	c->blhd = ape_rng_range(r, 0, 2) == 0;
	c->pq = malloc(sizeof(int64_t) * (size_t)c->Lq);
	c->pk = malloc(sizeof(int64_t) * (size_t)c->Lk);
	c->lse = malloc(sizeof(float) * (size_t)(c->B * c->H * c->Lq));
	if (!c->pq || !c->pk || !c->lse)
		return -1;
	base = ape_rng_range(r, -1000, 1000);
	test_positions(r, m, c->pk, c->Lk, base);
	/* queries around the keys' end (their start when decreasing): some see every key, some
	 * few, some none */
	test_positions(r, m, c->pq, c->Lq,
		  (m == POS_DECREASING ? base : base + c->Lk - c->Lq) + ape_rng_range(r, -3, 3));
	if (test_tensor_random(&c->q, r, c->dt, c->B, c->H, c->Lq, c->D, 1.0) ||
	    test_tensor_random(&c->k, r, c->dt, c->B, c->Hkv, c->Lk, c->D, 1.0) ||
	    test_tensor_random(&c->v, r, c->dt, c->B, c->Hkv, c->Lk, c->D, 1.0) ||
	    test_tensor_empty(&c->o, c->odt, c->B, c->H, c->Lq, c->D))
		return -1;
	if (c->blhd && (to_blhd(&c->q) || to_blhd(&c->k) || to_blhd(&c->v)))
		return -1;
	test_random_desc(r, &c->desc, c->prm, c->H);
	c->desc.layout = ape_rng_range(r, 0, 1) ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
	c->desc.pos_q = c->pq;
	c->desc.pos_k = c->pk;
	snprintf(c->what, sizeof(c->what),
		 "B %lld, Lq %lld, Lk %lld, H %lld/%lld, D %lld, %s -> %s, %s, %s, %s, positions %s, "
		 "skip_tol %g",
		 (long long)c->B, (long long)c->Lq, (long long)c->Lk, (long long)c->H,
		 (long long)c->Hkv, (long long)c->D, ape_dtype_name(c->dt), ape_dtype_name(c->odt),
		 c->blhd ? "[B, L, H, D]" : "contiguous", c->desc.causal ? "causal" : "not causal",
		 ape_rope_layout_name(c->desc.layout), pos_mode_names[m], c->desc.skip_tol);
	return 0;
}

static void case_free(struct pcase *c)
{
	free(c->pq);
	free(c->pk);
	free(c->lse);
	test_tensor_free(&c->q);
	test_tensor_free(&c->k);
	test_tensor_free(&c->v);
	test_tensor_free(&c->o);
}

/* The case by naive_attention() at its positions: o [B, H, Lq, D], lse [B, H, Lq] (malloc'ed,
 * the caller frees them); -1 out of memory. */
static int case_naive(const struct pcase *c, double **o, double **lse)
{
	double prm[4][8];
	naive_params np = {
		.rope_base = c->desc.rope_base, .rope_scale = c->desc.rope_scale, .scale = NAN,
		.causal = c->desc.causal,
		.interleaved = c->desc.layout == APE_ROPE_INTERLEAVED,
		.pos_q = c->pq, .pos_k = c->pk,
	};

	for (int i = 0; i < 4; i++)
		for (int h = 0; h < c->H; h++)
			prm[i][h] = c->prm[i][h];
	np.delta = prm[0];
	np.beta = prm[1];
	np.gamma = prm[2];
	np.lambda = prm[3];
	*o = calloc((size_t)(c->B * c->H * c->Lq * c->D) + 1, sizeof(double));
	*lse = malloc(sizeof(double) * (size_t)(c->B * c->H * c->Lq + 1));
	if (*o && *lse && !naive_attention(&np, &c->q.t, &c->k.t, &c->v.t, *o, *lse))
		return 0;
	free(*o);
	free(*lse);
	return -1;
}

/* The call's O and LSE against the oracle (errors into *eo, *el as test_varlen.c measures
 * them), the visible pairs into *pairs. */
static int case_check(const struct pcase *c, double *eo, double *el, uint64_t *pairs)
{
	const double vmax = test_tensor_maxabs(&c->v.t);
	double *o, *lse;

	if (case_naive(c, &o, &lse))
		return -1;
	*eo = *el = 0;
	*pairs = 0;
	for (int64_t b = 0; b < c->B; b++)
		for (int64_t h = 0; h < c->H; h++)
			for (int64_t i = 0; i < c->Lq; i++) {
				const int64_t row = (b * c->H + h) * c->Lq + i;
				test_lse_err(c->lse[row], lse[row], el);
				for (int64_t d = 0; d < c->D; d++) {
					const double e = fabs(test_tensor_get(&c->o.t, b, h, i, d) -
							      o[row * c->D + d]) /
							 fmax(vmax, 1e-30);

					*eo = fmax(*eo, e != e ? INFINITY : e);
				}
				for (int64_t j = 0; j < c->Lk; j++)
					*pairs += !c->desc.causal || c->pk[j] <= c->pq[i];
			}
	free(o);
	free(lse);
	return 0;
}

/* The forward of case c on dev (opts NULL: ape_attention_forward()) against the oracle. */
static void run_checked(struct __test_metadata *_metadata, ape_device *dev,
			const ape_exec_options *opts, struct pcase *c)
{
	ape_stats st;
	double eo, el;
	uint64_t pairs;

	int ret;

	ape_stats_init(&st);
	ret = opts ? ape_attention_forward_ex(&dev, 1, opts, &c->desc, &c->q.t, &c->k.t, &c->v.t,
					      &c->o.t, c->lse, &st)
		   : ape_attention_forward(dev, &c->desc, &c->q.t, &c->k.t, &c->v.t, &c->o.t,
					   c->lse, &st);
	ASSERT_EQ(0, ret) TH_LOG("%s: %s", c->what, ape_last_error());
	ASSERT_EQ(0, case_check(c, &eo, &el, &pairs));
	EXPECT_LE(eo, test_tol_o(c->dt) + test_skip_tol_o(c->desc.skip_tol))
	TH_LOG("%s: O error %g of max|V|", c->what, eo);
	EXPECT_LE(el, test_tol_lse(c->dt) + test_skip_tol_lse(c->desc.skip_tol))
	TH_LOG("%s: LSE error %g", c->what, el);
	EXPECT_EQ(pairs, st.pairs_visible) TH_LOG("%s", c->what);
	if (!opts && ape_be_caps_have(&dev->caps, APE_BE_CAP_POSITIONS)) { /* every batch element in the one launch */
		EXPECT_EQ(1u, st.chunks) TH_LOG("%s: launches", c->what);
	}
}

static void run_cases(struct __test_metadata *_metadata, ape_device *dev, int cases,
		      const ape_exec_options *opts)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < cases; i++) {
		struct pcase c;

		ASSERT_EQ(0, case_make(&c, &rng, (enum pos_mode)(i % POS_MODES), NB, -1, 20, 24));
		run_checked(_metadata, dev, opts, &c);
		case_free(&c);
	}
}

/* Every mode, type, layout: one launch on a device that reads positions, runs elsewhere. */
TEST_F(dev, forward_equals_the_oracle_at_its_positions)
{
	run_cases(_metadata, self->dev, self->emu ? 10 : 30, NULL);
}

/* In chunks of a few rows and keys: each launch gets its rows' and keys' slice of the
 * positions, every batch element's rows the same ones. */
TEST_F(dev, forward_in_small_chunks)
{
	const ape_exec_options opts = test_chunks(5, 7);

	run_cases(_metadata, self->dev, self->emu ? 5 : 15, &opts);
}

/* A device whose kernels do not read positions (as CUDA's): each batch element is cut into runs
 * of consecutive positions, merged by LSE. */
TEST_F(dev, forward_in_runs_where_the_kernels_read_no_positions)
{
	self->dev->caps.features &= ~(uint64_t)APE_BE_CAP_POSITIONS;
	run_cases(_metadata, self->dev, self->emu ? 10 : 25, NULL);
}

/* Positions 0.. (queries end-aligned) given explicitly: the implicit call, bit for bit on the
 * reference, in one launch and in runs. */
TEST_F(dev, explicit_default_positions_are_the_implicit_call_bit_for_bit)
{
	ape_rng rng;

	if (strcmp(variant->backend, "ref"))
		SKIP(return, "bit for bit on the reference only");
	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < 8; i++) {
		struct pcase c;
		test_tensor o2;
		float *lse2;

		ASSERT_EQ(0, case_make(&c, &rng, POS_SHIFTED, NB, -1, 20, 24));
		for (int64_t j = 0; j < c.Lk; j++)
			c.pk[j] = j;
		for (int64_t r = 0; r < c.Lq; r++)
			c.pq[r] = c.Lk - c.Lq + r;
		self->dev->caps.features = (self->dev->caps.features & ~(uint64_t)APE_BE_CAP_POSITIONS) |
					  (i % 2 == 0 ? APE_BE_CAP_POSITIONS : 0);
		ASSERT_EQ(0, test_tensor_empty(&o2, c.odt, c.B, c.H, c.Lq, c.D));
		lse2 = malloc(sizeof(float) * (size_t)(c.B * c.H * c.Lq));
		ASSERT_NE(NULL, lse2);
		ASSERT_EQ(0, ape_attention_forward(self->dev, &c.desc, &c.q.t, &c.k.t, &c.v.t,
						   &c.o.t, c.lse, NULL))
		TH_LOG("%s: %s", c.what, ape_last_error());
		c.desc.pos_q = c.desc.pos_k = NULL;
		ASSERT_EQ(0, ape_attention_forward(self->dev, &c.desc, &c.q.t, &c.k.t, &c.v.t,
						   &o2.t, lse2, NULL));
		EXPECT_EQ(0, memcmp(c.o.alloc, o2.alloc, c.o.alloc_bytes)) TH_LOG("%s", c.what);
		EXPECT_EQ(0, memcmp(c.lse, lse2, sizeof(float) * (size_t)(c.B * c.H * c.Lq)))
		TH_LOG("%s", c.what);
		/* a caller of the first layout (and of the second): the fields past its struct are
		 * not read, rope_scale is 1 */
		for (int v = 1; v <= 2; v++) {
			c.desc.struct_size = sizeof(c.desc);
			c.desc.rope_scale = 1;
			ASSERT_EQ(0, ape_attention_forward(self->dev, &c.desc, &c.q.t, &c.k.t, &c.v.t,
							   &c.o.t, c.lse, NULL));
			c.desc.struct_size = v == 1 ? APE_ATTN_DESC_V1_SIZE : APE_ATTN_DESC_V2_SIZE;
			c.desc.pos_q = v == 1 ? (const int64_t *)(uintptr_t)1 : NULL;
			c.desc.pos_k = NULL;
			c.desc.rope_scale = NAN;
			test_tensor_poison(&o2.t);
			ASSERT_EQ(0, ape_attention_forward(self->dev, &c.desc, &c.q.t, &c.k.t, &c.v.t,
							   &o2.t, lse2, NULL))
			TH_LOG("layout %d: %s", v, ape_last_error());
			EXPECT_EQ(0, memcmp(c.o.alloc, o2.alloc, c.o.alloc_bytes))
			TH_LOG("layout %d: %s", v, c.what);
			c.desc.pos_q = c.desc.pos_k = NULL;
		}
		test_tensor_free(&o2);
		free(lse2);
		case_free(&c);
	}
}

/* ---------------------------------------------------------------- the backward */

/* sum dO . O + sum dLSE . LSE by the oracle (rows that see no key left out). */
static long double case_loss(const struct pcase *c, const test_tensor *dout, const float *dlse)
{
	long double sum = 0;
	double *o, *lse;

	if (case_naive(c, &o, &lse))
		abort();
	for (int64_t b = 0; b < c->B; b++)
		for (int64_t h = 0; h < c->H; h++)
			for (int64_t i = 0; i < c->Lq; i++) {
				const int64_t row = (b * c->H + h) * c->Lq + i;

				if (isinf(lse[row]))
					continue;
				sum += (long double)dlse[row] * lse[row];
				for (int64_t d = 0; d < c->D; d++)
					sum += (long double)test_tensor_get(&dout->t, b, h, i, d) *
					       o[row * c->D + d];
			}
	free(o);
	free(lse);
	return sum;
}

/* case_loss() as test_fd_param() calls it. */
struct loss_at {
	const struct pcase *c;
	const test_tensor *dout;
	const float *dlse;
};

static long double case_loss_at(const void *ctx)
{
	const struct loss_at *at = ctx;

	return case_loss(at->c, at->dout, at->dlse);
}

/* <G, u> against the central difference along u = +-1 step on every element of input x. */
static void check_direction(struct __test_metadata *_metadata, ape_rng *r, struct pcase *c,
			    ape_tensor *x, const ape_tensor *g, const test_tensor *dout,
			    const float *dlse, const char *name)
{
	const int64_t n = x->shape[0] * x->shape[1] * x->shape[2] * x->shape[3];
	float *u = malloc(sizeof(float) * (size_t)n);
	long double dot = 0, scale = 0, l[2];
	int64_t e = 0;

	ASSERT_NE(NULL, u);
	for (int64_t b = 0; b < x->shape[0]; b++)
		for (int64_t h = 0; h < x->shape[1]; h++)
			for (int64_t i = 0; i < x->shape[2]; i++)
				for (int64_t d = 0; d < x->shape[3]; d++, e++) {
					const double gv = test_tensor_get(g, b, h, i, d);

					u[e] = ape_rng_range(r, 0, 1) ? 1.0f : -1.0f;
					dot += gv * u[e];
					scale += fabsl((long double)gv);
				}
	for (int side = 0; side < 3; side++) { /* +, -, back to the point */
		const double step = side == 0 ? 0x1p-10 : side == 1 ? -0x1p-9 : 0x1p-10;

		e = 0;
		for (int64_t b = 0; b < x->shape[0]; b++)
			for (int64_t h = 0; h < x->shape[1]; h++)
				for (int64_t i = 0; i < x->shape[2]; i++)
					for (int64_t d = 0; d < x->shape[3]; d++, e++)
						test_tensor_set(x, b, h, i, d,
								test_tensor_get(x, b, h, i, d) +
									step * u[e]);
		if (side < 2)
			l[side] = case_loss(c, dout, dlse);
	}
	EXPECT_LE(fabsl((l[0] - l[1]) / (2 * 0x1p-10L) - dot), 1e-3L * fmaxl(scale, 1e-3L))
	TH_LOG("%s: %s: finite difference %Lg, gradient %Lg", c->what, name,
	       (l[0] - l[1]) / (2 * 0x1p-10L), dot);
	free(u);
}

/* The dense backward at explicit positions of case c: the gradients into dq, dk, dv (float32,
 * fresh) and dp; returns the call's code. */
static int case_backward(struct pcase *c, ape_device *dev, const test_tensor *dout,
			 const float *dlse, test_tensor g[3], float *dp, ape_stats *st)
{
	if (test_tensor_empty(&g[0], APE_F32, c->B, c->H, c->Lq, c->D) ||
	    test_tensor_empty(&g[1], APE_F32, c->B, c->Hkv, c->Lk, c->D) ||
	    test_tensor_empty(&g[2], APE_F32, c->B, c->Hkv, c->Lk, c->D))
		return APE_ENOMEM;
	if (st)
		ape_stats_init(st);
	return ape_attention_backward(dev, &c->desc, &c->q.t, &c->k.t, &c->v.t, &c->o.t, c->lse,
				      &dout->t, dlse, &g[0].t, &g[1].t, &g[2].t, dp, st);
}

/* The case's forward (its O and LSE), upstream gradients dO (of type dt, N(0, 1)) and dLSE
 * (malloc'ed, N(0, 1)); returns the forward's code (-1 out of memory). */
static int backward_ready(struct pcase *c, ape_device *dev, ape_rng *r, ape_dtype dt,
			  test_tensor *dout, float **dlse)
{
	const int ret = ape_attention_forward(dev, &c->desc, &c->q.t, &c->k.t, &c->v.t, &c->o.t,
					      c->lse, NULL);

	*dlse = malloc(sizeof(float) * (size_t)(c->B * c->H * c->Lq));
	if (ret || !*dlse || test_tensor_random(dout, r, dt, c->B, c->H, c->Lq, c->D, 1.0))
		return ret ? ret : -1;
	for (int64_t i = 0; i < c->B * c->H * c->Lq; i++)
		(*dlse)[i] = (float)ape_rng_normal(r);
	return 0;
}

static void backward_free(struct pcase *c, test_tensor *dout, float *dlse, test_tensor g[3])
{
	for (int t = 0; t < 3; t++)
		test_tensor_free(&g[t]);
	test_tensor_free(dout);
	free(dlse);
	case_free(c);
}

/*
 * Every gradient at explicit positions (each mode, causal or not, GQA, with dLSE, B = 3)
 * against central differences of the oracle along a random direction, as test_varlen.c checks
 * the ragged backward: for q, k and v +-1 step on every element, for each parameter of each
 * head one step; <G, u> within 1e-3 of its scale.
 */
TEST_F(dev, backward_against_finite_differences)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < (self->emu ? 3 : 10); i++) {
		struct pcase c;
		test_tensor dout, g[3];
		float dp[32], *dlse;
		int ret;

		ASSERT_EQ(0, case_make(&c, &rng, (enum pos_mode)(i % POS_MODES), NB, APE_F32, 6, 8));
		c.odt = APE_F32; /* float32 throughout: the differences need exact steps */
		test_tensor_free(&c.o);
		ASSERT_EQ(0, test_tensor_empty(&c.o, APE_F32, c.B, c.H, c.Lq, c.D));
		c.desc.skip_tol = 0;
		test_quantize_inputs(&c.q.t, &c.k.t, &c.v.t, c.prm, c.H);
		ASSERT_EQ(0, backward_ready(&c, self->dev, &rng, APE_F32, &dout, &dlse))
		TH_LOG("%s: %s", c.what, ape_last_error());
		ret = case_backward(&c, self->dev, &dout, dlse, g, dp, NULL);
		if (ret == APE_ENOTSUP) {
			ksft_print_msg("%s\n", ape_last_error());
		} else {
			ASSERT_EQ(0, ret) TH_LOG("%s: %s", c.what, ape_last_error());
			check_direction(_metadata, &rng, &c, &c.q.t, &g[0].t, &dout, dlse, "dq");
			check_direction(_metadata, &rng, &c, &c.k.t, &g[1].t, &dout, dlse, "dk");
			check_direction(_metadata, &rng, &c, &c.v.t, &g[2].t, &dout, dlse, "dv");
			for (int p = 0; p < 4; p++)
				for (int h = 0; h < c.H; h++) {
					const struct loss_at at = { &c, &dout, dlse };
					const long double fd =
						test_fd_param(&c.prm[p][h], case_loss_at, &at);

					EXPECT_LE(fabsl(fd - dp[4 * h + p]),
						  1e-3L * fmaxl(fabsl(fd), 1e-2L))
					TH_LOG("%s: dparams[%d] of head %d: finite difference %Lg, "
					       "gradient %g",
					       c.what, p, h, fd, dp[4 * h + p]);
				}
		}
		backward_free(&c, &dout, dlse, g);
		if (ret == APE_ENOTSUP)
			SKIP(return, "this device has no backward pass (the message above says why)");
	}
}

/* Shifted positions (one run of queries and one of keys) in every storage type: the dense
 * backward at q_start = pos_q[0], k_start = pos_k[0], within rounding. */
TEST_F(dev, backward_of_shifted_positions_is_the_dense_backward)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < (self->emu ? 3 : 9); i++) {
		struct pcase c;
		test_tensor dout, g[3], w[3];
		float dp[2][32], *dlse;
		ape_stats st[2];
		int ret;

		ASSERT_EQ(0, case_make(&c, &rng, POS_SHIFTED, NB, i % 3, 20, 24));
		ASSERT_EQ(0, backward_ready(&c, self->dev, &rng, c.dt, &dout, &dlse))
		TH_LOG("%s: %s", c.what, ape_last_error());
		ret = case_backward(&c, self->dev, &dout, dlse, g, dp[0], &st[0]);
		if (ret != APE_ENOTSUP) {
			ASSERT_EQ(0, ret) TH_LOG("%s: %s", c.what, ape_last_error());
			c.desc.pos_q = c.desc.pos_k = NULL;
			c.desc.q_start_set = true;
			c.desc.q_start = c.pq[0];
			c.desc.k_start = c.pk[0];
			ASSERT_EQ(0, case_backward(&c, self->dev, &dout, dlse, w, dp[1], &st[1]))
			TH_LOG("%s: %s", c.what, ape_last_error());
			for (int t = 0; t < 3; t++) {
				EXPECT_LE(grads_rel_err(&g[t].t, &w[t].t), CHUNK_TOL)
				TH_LOG("%s: gradient %d", c.what, t);
			}
			EXPECT_LE(grads_rel_err_params(dp[0], dp[1], c.H), CHUNK_TOL) TH_LOG("%s",
											c.what);
			EXPECT_EQ(st[1].pairs_visible, st[0].pairs_visible) TH_LOG("%s", c.what);
			EXPECT_EQ(st[1].pairs_computed, st[0].pairs_computed) TH_LOG("%s", c.what);
			for (int t = 0; t < 3; t++)
				test_tensor_free(&w[t]);
		}
		backward_free(&c, &dout, dlse, g);
		if (ret == APE_ENOTSUP)
			SKIP(return, "%s", ape_last_error());
	}
}

/* ---------------------------------------------------------------- refusals */

/*
 * One positions array NULL, q_start_set or k_start with positions, distances past int64: the
 * named error, forward and backward, outputs untouched. ape_visible_pairs() counts at the
 * positions; the calls that take none refuse them naming desc->pos_q.
 */
TEST_F(dev, bad_positions_are_refused_and_write_nothing)
{
	static const int64_t huge_q[2] = { INT64_MAX, 0 }, neg_k[3] = { -1, 0, 1 };
	struct {
		const char *what;
		int code;
		const char *want;
	} cases[] = {
		{ "pos_k NULL", APE_EINVAL, "desc->pos_k = NULL" },
		{ "pos_q NULL", APE_EINVAL, "desc->pos_q = NULL" },
		{ "q_start_set", APE_EINVAL, "desc->q_start = 5" },
		{ "k_start", APE_EINVAL, "desc->k_start = 2" },
		{ "overflow", APE_EOVERFLOW, "desc->pos_q = 0..9223372036854775807" },
	};
	ape_rng rng;
	struct pcase c;
	test_tensor dout, g[3];
	float dp[32];
	unsigned char *snap;
	uint64_t pairs;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, case_make(&c, &rng, POS_GAPS, NB, APE_F32, 2, 3));
	/* exactly two queries and three keys, for the overflowing positions */
	case_free(&c);
	do {
		ASSERT_EQ(0, case_make(&c, &rng, POS_GAPS, NB, APE_F32, 2, 3));
		if (c.Lq == 2 && c.Lk == 3 && c.odt == APE_F32)
			break;
		case_free(&c);
	} while (1);
	ASSERT_EQ(0, test_tensor_random(&dout, &rng, APE_F32, c.B, c.H, c.Lq, c.D, 1.0));
	ASSERT_EQ(0, test_tensor_empty(&g[0], APE_F32, c.B, c.H, c.Lq, c.D));
	ASSERT_EQ(0, test_tensor_empty(&g[1], APE_F32, c.B, c.Hkv, c.Lk, c.D));
	ASSERT_EQ(0, test_tensor_empty(&g[2], APE_F32, c.B, c.Hkv, c.Lk, c.D));
	for (int64_t r = 0; r < c.B * c.H * c.Lq; r++)
		c.lse[r] = 0.5f;
	snap = malloc(c.o.alloc_bytes);
	ASSERT_NE(NULL, snap);
	memcpy(snap, c.o.alloc, c.o.alloc_bytes);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		ape_attn_desc d = c.desc;
		int ret;

		if (i == 0)
			d.pos_k = NULL;
		if (i == 1)
			d.pos_q = NULL;
		if (i == 2) {
			d.q_start_set = true;
			d.q_start = 5;
		}
		if (i == 3)
			d.k_start = 2;
		if (i == 4) {
			d.pos_q = huge_q;
			d.pos_k = neg_k;
		}
		for (int bwd = 0; bwd < 2; bwd++) {
			ret = bwd ? ape_attention_backward(self->dev, &d, &c.q.t, &c.k.t, &c.v.t,
							   &c.o.t, c.lse, &dout.t, NULL, &g[0].t,
							   &g[1].t, &g[2].t, dp, NULL)
				  : ape_attention_forward(self->dev, &d, &c.q.t, &c.k.t, &c.v.t,
							  &c.o.t, c.lse, NULL);
			if (bwd && ret == APE_ENOTSUP)
				continue;
			EXPECT_EQ(cases[i].code, ret) TH_LOG("%s (%s)", cases[i].what,
							      bwd ? "backward" : "forward");
			EXPECT_NE(NULL, strstr(ape_last_error(), cases[i].want))
			TH_LOG("%s: %s", cases[i].what, ape_last_error());
			EXPECT_EQ(0, memcmp(snap, c.o.alloc, c.o.alloc_bytes)) TH_LOG("%s wrote O",
										     cases[i].what);
			for (int64_t r = 0; r < c.B * c.H * c.Lq; r++)
				ASSERT_EQ(0.5f, c.lse[r]) TH_LOG("%s wrote LSE", cases[i].what);
			for (int t = 0; t < 3; t++) {
				const int64_t *sh = g[t].t.shape;

				for (int64_t e = 0; e < sh[0] * sh[1] * sh[2] * sh[3]; e++)
					ASSERT_TRUE(isnan(((float *)g[t].alloc)[e]))
					TH_LOG("%s wrote gradient %d", cases[i].what, t);
			}
		}
		ret = ape_visible_pairs(&d, c.B, c.H, c.Lq, c.Lk, &pairs);
		EXPECT_EQ(cases[i].code, ret) TH_LOG("%s (ape_visible_pairs)", cases[i].what);
	}
	/* the pair count at the positions */
	{
		uint64_t want = 0;

		for (int64_t i = 0; i < c.Lq; i++)
			for (int64_t j = 0; j < c.Lk; j++)
				want += !c.desc.causal || c.pk[j] <= c.pq[i];
		ASSERT_EQ(0, ape_visible_pairs(&c.desc, c.B, c.H, c.Lq, c.Lk, &pairs))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(want * (uint64_t)(c.B * c.H), pairs);
	}
	/* the calls that take no positions */
	{
		ape_varlen vl;
		const int64_t cuq[2] = { 0, c.Lq }, cuk[2] = { 0, c.Lk };
		ape_kv_cache_options ko;
		ape_kv_cache *cache;
		ape_tensor qb = c.q.t, kb = c.k.t, vb = c.v.t, ob = c.o.t;
		float ent[64], md[64];

		ape_varlen_init(&vl);
		vl.num_seqs = 1;
		vl.cu_seqlens_q = cuq;
		vl.cu_seqlens_k = cuk;
		qb.shape[0] = kb.shape[0] = vb.shape[0] = ob.shape[0] = 1;
		EXPECT_EQ(APE_EINVAL, ape_attention_forward_varlen(self->dev, &c.desc, &vl, &qb, &kb,
								   &vb, &ob, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "desc->pos_q")) TH_LOG("%s",
									 ape_last_error());
		ASSERT_LE(c.B * c.H * c.Lq, 64);
		EXPECT_EQ(APE_EINVAL, ape_attention_forward_diag(&self->dev, 1, NULL, &c.desc, &c.q.t,
								 &c.k.t, &c.v.t, &c.o.t, NULL, ent,
								 md, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "desc->pos_q")) TH_LOG("%s",
									 ape_last_error());
		ape_kv_cache_options_init(&ko);
		ko.B = c.B;
		ko.Hkv = c.Hkv;
		ko.H = c.H;
		ko.D = c.D;
		ko.dtype = APE_F32;
		ko.capacity_tokens = 16;
		ko.max_queries = 16;
		if (c.blhd) {
			ape_tensor_init(&kb, NULL, APE_F32, c.B, c.Hkv, 0, c.D);
			vb = kb;
		} else {
			kb = c.k.t;
			vb = c.v.t;
		}
		ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &cache)) TH_LOG("%s",
										ape_last_error());
		ASSERT_EQ(0, ape_kv_cache_append(cache, &kb, &vb)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(cache, &c.desc, &c.q.t, &c.o.t, NULL,
							  NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "desc->pos_q")) TH_LOG("%s",
									 ape_last_error());
		ape_kv_cache_destroy(cache);
		EXPECT_EQ(0, memcmp(snap, c.o.alloc, c.o.alloc_bytes));
	}
	/* run in pieces (positions the kernels do not read): no trace yet */
	{
		const bool had = ape_be_caps_have(&self->dev->caps, APE_BE_CAP_POSITIONS);
		ape_exec_options opts;

		ape_exec_options_init(&opts);
		opts.trace_path = "/tmp/ape-dense-positions-trace.json";
		self->dev->caps.features &= ~(uint64_t)APE_BE_CAP_POSITIONS;
		EXPECT_EQ(APE_EINVAL, ape_attention_forward_ex(&self->dev, 1, &opts, &c.desc, &c.q.t,
							       &c.k.t, &c.v.t, &c.o.t, c.lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "opts->trace_path")) TH_LOG("%s",
									      ape_last_error());
		self->dev->caps.features = (self->dev->caps.features & ~(uint64_t)APE_BE_CAP_POSITIONS) |
					  (had ? APE_BE_CAP_POSITIONS : 0);
		EXPECT_EQ(0, memcmp(snap, c.o.alloc, c.o.alloc_bytes));
	}
	/* device tensors (ape_attention_enqueue()) */
	{
		test_problem tp;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, c.B, c.H, c.Hkv, c.Lq, c.Lk, c.D,
						    APE_F32));
		tp.desc.pos_q = c.pq;
		tp.desc.pos_k = c.pk;
		EXPECT_EQ(APE_EINVAL, run_resident(&tp, self->dev, 0));
		EXPECT_NE(NULL, strstr(ape_last_error(), "desc->pos_q")) TH_LOG("%s",
									 ape_last_error());
		test_problem_free(&tp);
	}
	for (int t = 0; t < 3; t++)
		test_tensor_free(&g[t]);
	test_tensor_free(&dout);
	free(snap);
	case_free(&c);
}

TEST_HARNESS_MAIN
