/* SPDX-License-Identifier: MIT */
/*
 * Argument validation of ape_attention_forward(), one change to a small valid problem per case.
 *
 * An invalid argument must give its own error code and a message that names the function, the
 * argument (with the head, for per-head arrays) and the value, and must leave every buffer and the
 * stats exactly as they were. The valid edge cases next to them must succeed and write exactly
 * what the spec says: each is checked against the independent long-double evaluation in
 * tests/common/naive.c, and every byte around the outputs must still hold its sentinel.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/naive.h"

/* The baseline: grouped-query attention (two query heads per kv head), Lk > Lq, f32. */
enum { BASE_B = 1, BASE_H = 4, BASE_HKV = 2, BASE_LQ = 5, BASE_LK = 6, BASE_D = 8 };

/* Elements of the baseline tensors, for the cases that place pointers next to or inside them. */
#define Q_ELEMS (BASE_B * BASE_H * BASE_LQ * BASE_D)
#define KV_ELEMS (BASE_B * BASE_HKV * BASE_LK * BASE_D)
#define LSE_ROWS (BASE_B * BASE_H * BASE_LQ)

/*
 * Every buffer is far larger than the baseline needs, so that a change the library wrongly
 * accepts reads and writes memory we own: the byte comparison then reports it as a failure
 * instead of a crash.
 */
#define BUF_BYTES (64 * 1024)
#define BUF_FLOATS (BUF_BYTES / sizeof(float))
#define MAX_H 64

enum { BQ, BK, BV, BO, BL, NBUF };
static const char *const buf_names[NBUF] = { "q", "k", "v", "o", "lse" };

/* The arguments of one call; a case changes some of them. */
struct call {
	ape_device *dev;
	const ape_attn_desc *descp;
	ape_attn_desc desc;
	ape_tensor q, k, v, o;
	const ape_tensor *qp, *kp, *vp;
	ape_tensor *op;
	float *lse;
	ape_stats st;
	ape_stats *stp;
	float ph[BASE_H]; /* a per-head array for whichever parameter a case gives one */
	unsigned char *buf[NBUF];
};

static bool has(const char *s, const char *needle)
{
	return s && needle && strstr(s, needle);
}

/* ---------------------------------------------------------------- changes the cases make */

static void set_strides(ape_tensor *t, int64_t s0, int64_t s1, int64_t s2, int64_t s3)
{
	t->strides[0] = s0;
	t->strides[1] = s1;
	t->strides[2] = s2;
	t->strides[3] = s3;
}

static void set_B(struct call *c, int64_t n)
{
	c->q.shape[0] = c->k.shape[0] = c->v.shape[0] = c->o.shape[0] = n;
}

static void set_Hkv(struct call *c, int64_t n)
{
	c->k.shape[1] = c->v.shape[1] = n;
}

static void set_Lq(struct call *c, int64_t n)
{
	c->q.shape[2] = c->o.shape[2] = n;
}

static void set_Lk(struct call *c, int64_t n)
{
	c->k.shape[2] = c->v.shape[2] = n;
}

static void set_D(struct call *c, int64_t n)
{
	c->q.shape[3] = c->k.shape[3] = c->v.shape[3] = c->o.shape[3] = n;
}

static void set_q_start(struct call *c, int64_t q_start)
{
	c->desc.q_start_set = true;
	c->desc.q_start = q_start;
}

/* Gives `p` the per-head array with head h set to x (the other heads keep valid values). */
static void set_head(struct call *c, ape_param *p, int h, float x)
{
	p->per_head = c->ph;
	c->ph[h] = x;
}

/* Stores q, k and v (their whole buffers) as `dt`. */
static void retype_inputs(struct call *c, ape_dtype dt)
{
	uint16_t *tmp = malloc(BUF_FLOATS * sizeof(*tmp));

	if (!tmp)
		abort();
	for (int i = BQ; i <= BV; i++) {
		ape_convert(tmp, dt, c->buf[i], APE_F32, BUF_FLOATS);
		memcpy(c->buf[i], tmp, BUF_FLOATS * sizeof(*tmp));
	}
	c->q.dtype = c->k.dtype = c->v.dtype = dt;
	free(tmp);
}

/* B and H of 2^40 each: 2^80 rows, with tiny buffers behind them. */
static void set_huge_batch_and_heads(struct call *c)
{
	set_B(c, 1ll << 40);
	c->q.shape[1] = c->o.shape[1] = 1ll << 40;
}

static float *f32_at(void *base, int64_t i)
{
	return (float *)base + i;
}

/* V moved to start right where O ends, in O's buffer: touching is not overlapping. */
static void move_v_after_o(struct call *c)
{
	float *dst = f32_at(c->o.data, Q_ELEMS);

	memcpy(dst, c->v.data, KV_ELEMS * sizeof(float));
	c->v.data = dst;
}

/* ---------------------------------------------------------------- the fixture */

FIXTURE_VARIANT(forward)
{
	void (*change)(struct call *c);
	int expect; /* 0 or the APE_E* code */
	const char *arg; /* on failure the message names this ... */
	const char *value; /* ... and this, unless NULL */
};

FIXTURE(forward)
{
	ape_context *ctx;
	struct call c;
};

FIXTURE_SETUP(forward)
{
	struct call *c = &self->c;
	ape_rng rng;

	self->ctx = test_context("ref");
	c->dev = test_device(self->ctx, "ref");
	ASSERT_NE(NULL, c->dev);
	for (int i = 0; i < NBUF; i++) {
		c->buf[i] = malloc(BUF_BYTES);
		ASSERT_NE(NULL, c->buf[i]);
	}
	ape_rng_seed(&rng, 0x5eed); /* fixed: the inputs only need to be ordinary numbers */
	for (int i = BQ; i <= BV; i++)
		for (size_t j = 0; j < BUF_FLOATS; j++)
			*f32_at(c->buf[i], (int64_t)j) = (float)ape_rng_normal(&rng);
	/* all-ones bytes are NaN in every type: an element left unwritten cannot pass for output */
	memset(c->buf[BO], 0xff, BUF_BYTES);
	memset(c->buf[BL], 0xff, BUF_BYTES);

	ape_attn_desc_init(&c->desc);
	c->desc.delta.value = 0.05f;
	c->desc.beta.value = 0.1f;
	c->desc.gamma.value = 0.02f;
	c->desc.lambda.value = 0.3f;
	c->desc.k_start = 3;
	for (int h = 0; h < BASE_H; h++)
		c->ph[h] = 0.1f * (float)(h + 1);
	ape_tensor_init(&c->q, c->buf[BQ], APE_F32, BASE_B, BASE_H, BASE_LQ, BASE_D);
	ape_tensor_init(&c->k, c->buf[BK], APE_F32, BASE_B, BASE_HKV, BASE_LK, BASE_D);
	ape_tensor_init(&c->v, c->buf[BV], APE_F32, BASE_B, BASE_HKV, BASE_LK, BASE_D);
	ape_tensor_init(&c->o, c->buf[BO], APE_F32, BASE_B, BASE_H, BASE_LQ, BASE_D);
	c->descp = &c->desc;
	c->qp = &c->q;
	c->kp = &c->k;
	c->vp = &c->v;
	c->op = &c->o;
	c->lse = (float *)c->buf[BL];
	ape_stats_init(&c->st);
	c->stp = &c->st;
}

FIXTURE_TEARDOWN(forward)
{
	for (int i = 0; i < NBUF; i++)
		free(self->c.buf[i]);
	ape_context_destroy(self->ctx);
}

/* ---------------------------------------------------------------- checking a success */

static size_t elem_index(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	int64_t s[4];

	ape_tensor_strides(t, s);
	return (size_t)(b * s[0] + h * s[1] + l * s[2] + d * s[3]);
}

/* What a successful call must have written, and where. */
struct expected {
	int64_t q_start; /* resolved */
	const double *o, *lse; /* the long-double evaluation, row-major */
	double tol_o, tol_lse;
	unsigned char *written[NBUF]; /* per byte of the o and lse buffers: part of an output */
	int bad;
};

/* Records that [p, p + n) is output; false when it lies outside both output buffers. */
static bool mark_written(const struct call *c, struct expected *e, const void *p, size_t n)
{
	const unsigned char *u = p;

	for (int i = BO; i <= BL; i++) {
		if (u >= c->buf[i] && u + n <= c->buf[i] + BUF_BYTES) {
			memset(e->written[i] + (u - c->buf[i]), 1, n);
			return true;
		}
	}
	return false;
}

/*
 * Does row (b, h, i) see a NaN or an infinity, in its query or in a key the mask lets through?
 * Then the spec wants the whole row NaN. Worked out here rather than taken from the long-double
 * evaluation, whose non-finite arithmetic valgrind does not emulate faithfully.
 */
static bool row_reaches_nonfinite(const struct call *c, int64_t q_start, int64_t b, int64_t h,
				  int64_t i)
{
	const ape_tensor *q = &c->q, *k = &c->k;
	const int64_t kh = h / (q->shape[1] / k->shape[1]), D = q->shape[3];

	for (int64_t d = 0; d < D; d++)
		if (!isfinite(test_tensor_get(q, b, h, i, d)))
			return true;
	for (int64_t j = 0; j < k->shape[2]; j++) {
		if (c->desc.causal && c->desc.k_start + j > q_start + i)
			continue;
		for (int64_t d = 0; d < D; d++)
			if (!isfinite(test_tensor_get(k, b, kh, j, d)))
				return true;
	}
	return false;
}

/* Keys of query row i that the mask lets through. */
static int64_t row_visible_keys(const struct call *c, int64_t q_start, int64_t i)
{
	int64_t n = 0;

	for (int64_t j = 0; j < c->k.shape[2]; j++)
		n += !c->desc.causal || c->desc.k_start + j <= q_start + i;
	return n;
}

/* One row of O and its LSE: NaN when it reaches a non-finite input, 0 and -inf when it sees no
 * key, else within the spec's tolerance of the long-double evaluation. */
static void check_row(struct __test_metadata *_metadata, const struct call *c,
		      struct expected *e, int64_t b, int64_t h, int64_t i)
{
	const ape_tensor *o = &c->o;
	const int64_t H = o->shape[1], Lq = o->shape[2], D = o->shape[3];
	const size_t r = (size_t)((b * H + h) * Lq + i), esz = ape_dtype_size(o->dtype);
	const bool nan = row_reaches_nonfinite(c, e->q_start, b, h, i);
	const bool empty = !nan && !row_visible_keys(c, e->q_start, i);

	for (int64_t d = 0; d < D; d++) {
		const double want = e->o[r * (size_t)D + (size_t)d];
		const double got = test_tensor_get(o, b, h, i, d);
		const void *at = (const unsigned char *)o->data + elem_index(o, b, h, i, d) * esz;
		bool ok;

		ASSERT_TRUE(mark_written(c, e, at, esz))
		TH_LOG("O(%lld,%lld,%lld,%lld) lies outside the buffers", (long long)b,
		       (long long)h, (long long)i, (long long)d);
		if (nan)
			ok = isnan(got);
		else if (empty)
			ok = got == 0;
		else
			ok = fabs(got - want) <= e->tol_o;
		if (!ok && e->bad++ < 5)
			TH_LOG("O(%lld,%lld,%lld,%lld) = %.9g, want %.9g", (long long)b,
			       (long long)h, (long long)i, (long long)d, got, want);
	}
	if (c->lse) {
		const double want = e->lse[r], got = c->lse[r];
		bool ok;

		ASSERT_TRUE(mark_written(c, e, &c->lse[r], sizeof(float)));
		if (nan)
			ok = isnan(got);
		else if (empty)
			ok = got == -INFINITY;
		else
			ok = fabs(got - want) <= e->tol_lse * fmax(1, fabs(want));
		if (!ok && e->bad++ < 5)
			TH_LOG("LSE(%lld,%lld,%lld) = %.9g, want %.9g", (long long)b, (long long)h,
			       (long long)i, got, want);
	}
}

static void resolve_param(const ape_param *p, int64_t H, double *out)
{
	for (int64_t h = 0; h < H; h++)
		out[h] = p->per_head ? p->per_head[h] : p->value;
}

/*
 * A successful call: inputs untouched, every row as check_row() wants it, every other byte of the
 * output buffers untouched (padding, tails, neighbours), and the stats filled in.
 */
static void check_success(struct __test_metadata *_metadata, struct call *c,
			  unsigned char *const snap[NBUF])
{
	const ape_tensor *q = &c->q, *k = &c->k, *v = &c->v;
	const int64_t B = q->shape[0], H = q->shape[1], Lq = q->shape[2], D = q->shape[3];
	const size_t rows = (size_t)(B * H * Lq);
	double delta[MAX_H], beta[MAX_H], gamma[MAX_H], lambda[MAX_H], *ro, *rl;
	struct expected e = { 0 };
	naive_params np;

	for (int i = BQ; i <= BV; i++) {
		EXPECT_EQ(0, memcmp(snap[i], c->buf[i], BUF_BYTES))
		TH_LOG("input %s was written", buf_names[i]);
	}
	ASSERT_GE(MAX_H, H);
	resolve_param(&c->desc.delta, H, delta);
	resolve_param(&c->desc.beta, H, beta);
	resolve_param(&c->desc.gamma, H, gamma);
	resolve_param(&c->desc.lambda, H, lambda);
	e.q_start = c->desc.q_start_set ? c->desc.q_start : c->desc.k_start + k->shape[2] - Lq;
	np = (naive_params){
		.delta = delta,
		.beta = beta,
		.gamma = gamma,
		.lambda = lambda,
		.rope_base = c->desc.rope_base,
		.rope_scale = c->desc.rope_scale,
		.scale = c->desc.scale_set ? c->desc.scale : NAN,
		.causal = c->desc.causal,
		.interleaved = c->desc.layout == APE_ROPE_INTERLEAVED,
		.q_start = e.q_start,
		.k_start = c->desc.k_start,
	};
	ro = malloc((rows * (size_t)D + 1) * sizeof(*ro));
	rl = malloc((rows + 1) * sizeof(*rl));
	e.written[BO] = calloc(1, BUF_BYTES);
	e.written[BL] = calloc(1, BUF_BYTES);
	ASSERT_TRUE(ro && rl && e.written[BO] && e.written[BL]);
	ASSERT_EQ(0, naive_attention(&np, q, k, v, ro, rl));
	e.o = ro;
	e.lse = rl;
	e.tol_o = test_tol_o(q->dtype) * test_tensor_maxabs(v);
	e.tol_lse = test_tol_lse(q->dtype);

	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = 0; i < Lq; i++)
				check_row(_metadata, c, &e, b, h, i);
	EXPECT_EQ(0, e.bad);

	for (int i = BO; i <= BL; i++) {
		size_t stray = 0, first = 0;

		for (size_t j = 0; j < BUF_BYTES; j++)
			if (!e.written[i][j] && c->buf[i][j] != snap[i][j] && !stray++)
				first = j;
		EXPECT_EQ(0u, stray)
		TH_LOG("%zu bytes of the %s buffer written outside the outputs, the first at %zu",
		       stray, buf_names[i], first);
	}

	if (c->stp) {
		uint64_t want = 0;

		ASSERT_EQ(0, ape_visible_pairs(&c->desc, B, H, Lq, k->shape[2], &want))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(sizeof(ape_stats), c->st.struct_size);
		EXPECT_EQ(want, c->st.pairs_visible);
		EXPECT_GE(c->st.pairs_visible, c->st.pairs_computed);
		EXPECT_STREQ("ref", c->st.backend);
	}
	free(ro);
	free(rl);
	free(e.written[BO]);
	free(e.written[BL]);
}

TEST_F(forward, check)
{
	struct call *c = &self->c;
	unsigned char *snap[NBUF];
	ape_stats st_before;
	char msg[1024];
	int ret;

	variant->change(c);
	for (int i = 0; i < NBUF; i++) {
		snap[i] = malloc(BUF_BYTES);
		ASSERT_NE(NULL, snap[i]);
		memcpy(snap[i], c->buf[i], BUF_BYTES);
	}
	memcpy(&st_before, &c->st, sizeof(st_before));

	ret = ape_attention_forward(c->dev, c->descp, c->qp, c->kp, c->vp, c->op, c->lse, c->stp);
	snprintf(msg, sizeof(msg), "%s", ape_last_error());
	EXPECT_EQ(variant->expect, ret) TH_LOG("returned %s, last error \"%s\"", ape_err_name(ret),
					       msg);
	if (variant->expect) {
		EXPECT_TRUE(has(msg, "ape_attention_forward")) TH_LOG("message \"%s\"", msg);
		EXPECT_TRUE(has(msg, variant->arg))
		TH_LOG("message \"%s\" does not name \"%s\"", msg, variant->arg);
		if (variant->value) {
			EXPECT_TRUE(has(msg, variant->value))
			TH_LOG("message \"%s\" does not say \"%s\"", msg, variant->value);
		}
		for (int i = 0; i < NBUF; i++) {
			EXPECT_EQ(0, memcmp(snap[i], c->buf[i], BUF_BYTES))
			TH_LOG("the %s buffer changed on failure", buf_names[i]);
		}
		EXPECT_EQ(0, memcmp(&st_before, &c->st, sizeof(st_before)))
		TH_LOG("stats changed on failure");
	} else if (ret == 0) {
		check_success(_metadata, c, snap);
	}
	for (int i = 0; i < NBUF; i++)
		free(snap[i]);
}

/* ---------------------------------------------------------------- the cases */

/* One case: its name, the expected code, what the message must name, and the change. */
#define CASE(id, err, argname, val, ...)                                                           \
	static void change_##id(struct call *c)                                                    \
	{                                                                                          \
		__VA_ARGS__;                                                                       \
	}                                                                                          \
	FIXTURE_VARIANT_ADD(forward, id)                                                           \
	{                                                                                          \
		.change = change_##id, .expect = (err), .arg = (argname), .value = (val),          \
	}

#define VALID(id, ...) CASE(id, 0, NULL, NULL, __VA_ARGS__)

VALID(baseline, (void)c);

/* handles and struct sizes */
CASE(dev_null, APE_EINVAL, "dev = NULL", NULL, c->dev = NULL);
CASE(desc_null, APE_EINVAL, "desc = NULL", NULL, c->descp = NULL);
CASE(desc_struct_size_zero, APE_EINVAL, "desc->struct_size", "= 0", c->desc.struct_size = 0);
CASE(desc_struct_size_small, APE_EINVAL, "desc->struct_size", NULL, c->desc.struct_size -= 4);
CASE(desc_struct_size_large, APE_EINVAL, "desc->struct_size", NULL, c->desc.struct_size += 8);
CASE(stats_struct_size_zero, APE_EINVAL, "stats->struct_size", "= 0", c->st.struct_size = 0);
CASE(stats_struct_size_small, APE_EINVAL, "stats->struct_size", NULL, c->st.struct_size -= 8);
CASE(q_null, APE_EINVAL, "q = NULL", NULL, c->qp = NULL);
CASE(k_null, APE_EINVAL, "k = NULL", NULL, c->kp = NULL);
CASE(v_null, APE_EINVAL, "v = NULL", NULL, c->vp = NULL);
CASE(o_null, APE_EINVAL, "o = NULL", NULL, c->op = NULL);
VALID(lse_null, c->lse = NULL);
VALID(stats_null, c->stp = NULL);

/* storage types: q, k, v alike; o like q or f32 */
CASE(q_dtype_7, APE_EINVAL, "q->dtype", "7", c->q.dtype = (ape_dtype)7);
CASE(q_dtype_negative, APE_EINVAL, "q->dtype", "-1", c->q.dtype = (ape_dtype)-1);
CASE(k_dtype_7, APE_EINVAL, "k->dtype", "7", c->k.dtype = (ape_dtype)7);
CASE(v_dtype_7, APE_EINVAL, "v->dtype", "7", c->v.dtype = (ape_dtype)7);
CASE(o_dtype_7, APE_EINVAL, "o->dtype", "7", c->o.dtype = (ape_dtype)7);
CASE(k_dtype_f16_q_f32, APE_EINVAL, "k->dtype", "f16", c->k.dtype = APE_F16);
CASE(v_dtype_bf16_q_f32, APE_EINVAL, "v->dtype", "bf16", c->v.dtype = APE_BF16);
CASE(k_dtype_f32_q_f16, APE_EINVAL, "k->dtype", "f32", retype_inputs(c, APE_F16);
     c->k.dtype = APE_F32);
CASE(v_dtype_f16_q_bf16, APE_EINVAL, "v->dtype", "f16", retype_inputs(c, APE_BF16);
     c->v.dtype = APE_F16);
CASE(o_dtype_f16_q_f32, APE_EINVAL, "o->dtype", "f16", c->o.dtype = APE_F16);
CASE(o_dtype_bf16_q_f32, APE_EINVAL, "o->dtype", "bf16", c->o.dtype = APE_BF16);
CASE(o_dtype_bf16_q_f16, APE_EINVAL, "o->dtype", "bf16", retype_inputs(c, APE_F16);
     c->o.dtype = APE_BF16);
CASE(o_dtype_f16_q_bf16, APE_EINVAL, "o->dtype", "f16", retype_inputs(c, APE_BF16);
     c->o.dtype = APE_F16);
VALID(f16_in_f32_out, retype_inputs(c, APE_F16));
VALID(f16_in_f16_out, retype_inputs(c, APE_F16); c->o.dtype = APE_F16);
VALID(bf16_in_f32_out, retype_inputs(c, APE_BF16));
VALID(bf16_in_bf16_out, retype_inputs(c, APE_BF16); c->o.dtype = APE_BF16);

/* shapes */
CASE(q_shape0_negative, APE_EINVAL, "q->shape[0] = -1", NULL, c->q.shape[0] = -1);
CASE(q_shape2_negative, APE_EINVAL, "q->shape[2] = -1", NULL, c->q.shape[2] = -1);
CASE(q_shape3_negative, APE_EINVAL, "q->shape[3] = -8", NULL, c->q.shape[3] = -8);
CASE(k_shape1_negative, APE_EINVAL, "k->shape[1] = -2", NULL, c->k.shape[1] = -2);
CASE(k_shape2_negative, APE_EINVAL, "k->shape[2] = -1", NULL, c->k.shape[2] = -1);
CASE(v_shape2_negative, APE_EINVAL, "v->shape[2] = -6", NULL, c->v.shape[2] = -6);
CASE(o_shape1_negative, APE_EINVAL, "o->shape[1] = -4", NULL, c->o.shape[1] = -4);
CASE(o_shape2_negative, APE_EINVAL, "o->shape[2] = -5", NULL, c->o.shape[2] = -5);
CASE(batch_zero, APE_EINVAL, "q->shape[0] = 0", NULL, set_B(c, 0));
CASE(heads_zero, APE_EINVAL, "q->shape[1] = 0", NULL, c->q.shape[1] = c->o.shape[1] = 0);
CASE(d_1, APE_EINVAL, "q->shape[3] = 1", NULL, set_D(c, 1));
CASE(d_odd, APE_EINVAL, "q->shape[3] = 7", NULL, set_D(c, 7));
CASE(d_zero, APE_EINVAL, "q->shape[3] = 0", NULL, set_D(c, 0));
CASE(d_258, APE_EINVAL, "q->shape[3] = 258", NULL, set_D(c, 258));
VALID(d_2, set_D(c, 2));
VALID(d_256, set_D(c, 256));
CASE(k_batch_mismatch, APE_EINVAL, "k->shape[0] = 2", NULL, c->k.shape[0] = c->v.shape[0] = 2);
CASE(k_dim_mismatch, APE_EINVAL, "k->shape[3] = 6", NULL, c->k.shape[3] = c->v.shape[3] = 6);
CASE(hkv_zero, APE_EINVAL, "k->shape[1] = 0", NULL, set_Hkv(c, 0));
CASE(hkv_3, APE_EINVAL, "k->shape[1] = 3", "H = 4", set_Hkv(c, 3));
CASE(hkv_8, APE_EINVAL, "k->shape[1] = 8", "H = 4", set_Hkv(c, 8));
VALID(hkv_1, set_Hkv(c, 1));
VALID(hkv_4, set_Hkv(c, 4));
CASE(v_shape0_mismatch, APE_EINVAL, "v->shape[0] = 2", NULL, c->v.shape[0] = 2);
CASE(v_shape1_mismatch, APE_EINVAL, "v->shape[1] = 1", NULL, c->v.shape[1] = 1);
CASE(v_shape2_mismatch, APE_EINVAL, "v->shape[2] = 7", NULL, c->v.shape[2] = 7);
CASE(v_shape3_mismatch, APE_EINVAL, "v->shape[3] = 6", NULL, c->v.shape[3] = 6);
CASE(o_shape0_mismatch, APE_EINVAL, "o->shape[0] = 2", NULL, c->o.shape[0] = 2);
CASE(o_shape1_mismatch, APE_EINVAL, "o->shape[1] = 2", NULL, c->o.shape[1] = 2);
CASE(o_shape2_mismatch, APE_EINVAL, "o->shape[2] = 4", NULL, c->o.shape[2] = 4);
CASE(o_shape3_mismatch, APE_EINVAL, "o->shape[3] = 6", NULL, c->o.shape[3] = 6);
VALID(batch_2, set_B(c, 2));
VALID(lq_1, set_Lq(c, 1));
VALID(lq_above_lk, set_Lk(c, 3)); /* end-aligned: the first two rows see no key */
/* empty sequences: Lq = 0 writes nothing; Lk = 0 gives O = 0 and LSE = -inf; no data needed */
VALID(lq_0, set_Lq(c, 0));
VALID(lq_0_without_data, set_Lq(c, 0); c->q.data = NULL; c->o.data = NULL);
VALID(lk_0, set_Lk(c, 0));
VALID(lk_0_without_data, set_Lk(c, 0); c->k.data = NULL; c->v.data = NULL);

/*
 * strides: all four 0 (contiguous), or >= 1 where a dimension is stepped along (0 is fine along a
 * dimension of size 1, and anywhere in an empty tensor); outputs must not overlap themselves,
 * inputs may
 */
CASE(q_stride_negative, APE_EINVAL, "q->strides[3] = -1", NULL, set_strides(&c->q, 160, 40, 8, -1));
CASE(q_stride_zero_mixed, APE_EINVAL, "q->strides[1] = 0", NULL, set_strides(&c->q, 160, 0, 8, 1));
CASE(k_stride_zero_mixed, APE_EINVAL, "k->strides[1] = 0", NULL, set_strides(&c->k, 96, 0, 8, 1));
CASE(v_stride_zero_mixed, APE_EINVAL, "v->strides[3] = 0", NULL, set_strides(&c->v, 96, 48, 8, 0));
CASE(o_stride_negative, APE_EINVAL, "o->strides[1] = -40", NULL,
     set_strides(&c->o, 160, -40, 8, 1));
CASE(o_stride_zero_mixed, APE_EINVAL, "o->strides[2] = 0", NULL, set_strides(&c->o, 160, 40, 0, 1));
CASE(o_rows_overlap, APE_EINVAL, "o->strides[2] = 4", "overlap", set_strides(&c->o, 160, 40, 4, 1));
CASE(o_heads_alias_rows, APE_EINVAL, "o->strides[", "overlap", set_strides(&c->o, 160, 8, 8, 1));
CASE(o_elements_spread_into_next_row, APE_EINVAL, "o->strides[2] = 8", "overlap",
     set_strides(&c->o, 160, 40, 8, 2));
VALID(contiguous_strides_spelled_out, set_strides(&c->q, 160, 40, 8, 1);
      set_strides(&c->k, 96, 48, 8, 1); set_strides(&c->v, 96, 48, 8, 1);
      set_strides(&c->o, 160, 40, 8, 1));
VALID(q_blhd, set_strides(&c->q, 160, 8, 32, 1));
VALID(k_blhd_padded, set_strides(&c->k, 120, 10, 20, 1));
VALID(o_blhd, set_strides(&c->o, 160, 8, 32, 1));
VALID(o_padded_rows, set_strides(&c->o, 220, 55, 11, 1)); /* the padding keeps its sentinel */
VALID(o_column_major, set_strides(&c->o, 160, 40, 1, 5));
VALID(o_batch_stride_of_size_1_dim, set_strides(&c->o, 1, 40, 8, 1));
VALID(o_zero_stride_of_size_1_dim, set_strides(&c->o, 0, 40, 8, 1));
VALID(k_zero_stride_of_size_1_dim, set_strides(&c->k, 0, 48, 8, 1));
VALID(lq_0_any_strides, set_Lq(c, 0); set_strides(&c->q, 7, 0, 0, 3);
      set_strides(&c->o, 0, 0, 0, 1));
VALID(k_rows_overlap, set_strides(&c->k, 96, 48, 4, 1));
VALID(kv_all_strides_1, set_strides(&c->k, 1, 1, 1, 1); set_strides(&c->v, 1, 1, 1, 1));
VALID(v_column_major, set_strides(&c->v, 96, 48, 1, 6));

/* data pointers and aliasing */
CASE(q_data_null, APE_EINVAL, "q->data = NULL", NULL, c->q.data = NULL);
CASE(k_data_null, APE_EINVAL, "k->data = NULL", NULL, c->k.data = NULL);
CASE(v_data_null, APE_EINVAL, "v->data = NULL", NULL, c->v.data = NULL);
CASE(o_data_null, APE_EINVAL, "o->data = NULL", NULL, c->o.data = NULL);
CASE(o_is_q, APE_EINVAL, "o overlaps q", NULL, c->o.data = c->q.data);
CASE(o_inside_k, APE_EINVAL, "o overlaps k", NULL, c->o.data = f32_at(c->k.data, 50));
CASE(v_starts_on_last_o_element, APE_EINVAL, "o overlaps v", NULL,
     c->v.data = f32_at(c->o.data, Q_ELEMS - 1));
CASE(lse_is_o, APE_EINVAL, "lse overlaps o", NULL, c->lse = c->o.data);
CASE(lse_on_last_o_element, APE_EINVAL, "lse overlaps o", NULL,
     c->lse = f32_at(c->o.data, Q_ELEMS - 1));
CASE(lse_is_q, APE_EINVAL, "lse overlaps q", NULL, c->lse = c->q.data);
CASE(lse_on_last_k_element, APE_EINVAL, "lse overlaps k", NULL,
     c->lse = f32_at(c->k.data, KV_ELEMS - 1));
VALID(lse_right_after_o, c->lse = f32_at(c->o.data, Q_ELEMS));
VALID(o_right_after_lse, c->o.data = f32_at(c->lse, LSE_ROWS));
VALID(v_right_after_o, move_v_after_o(c));

/* sizes that overflow: rejected from the shapes alone, long before any allocation */
CASE(q_shape_overflows, APE_EOVERFLOW, "q:", "overflow", set_huge_batch_and_heads(c));
CASE(q_element_count_overflows, APE_EOVERFLOW, "q:", "overflow", set_huge_batch_and_heads(c);
     set_strides(&c->q, 1, 1, 1, 1));
CASE(k_span_beyond_memory, APE_EOVERFLOW, "k:", "memory", set_Lk(c, 1ll << 58));
CASE(k_strides_beyond_64_bits, APE_EOVERFLOW, "k:", "64 bits",
     set_strides(&c->k, 1, INT64_MAX, 8, 1));
CASE(o_span_beyond_memory, APE_EOVERFLOW, "o:", "memory", set_strides(&c->o, 1, 1ll << 61, 8, 1));

/* positions: every position and every distance must fit in 64 bits */
CASE(default_q_start_overflows, APE_EOVERFLOW, "desc->k_start = 9223372036854775807", "q_start",
     c->desc.k_start = INT64_MAX);
CASE(default_q_start_underflows, APE_EOVERFLOW, "desc->k_start = -9223372036854775808", "q_start",
     c->desc.k_start = INT64_MIN; set_Lk(c, 3));
CASE(last_query_overflows, APE_EOVERFLOW, "q_start = 9223372036854775804", "query",
     set_q_start(c, INT64_MAX - 3));
CASE(last_key_overflows, APE_EOVERFLOW, "desc->k_start = 9223372036854775804", "key",
     set_q_start(c, 0); c->desc.k_start = INT64_MAX - 3);
CASE(distance_overflows_up, APE_EOVERFLOW, "k_start = -10", "9223372036854775797",
     set_q_start(c, INT64_MAX - 10); c->desc.k_start = -10);
CASE(distance_overflows_down, APE_EOVERFLOW, "q_start = -9223372036854775808", "k_start = 10",
     set_q_start(c, INT64_MIN); c->desc.k_start = 10);
/* the last query is still in reach of the first key; the first query is not of the last key */
CASE(distance_overflows_down_last_key, APE_EOVERFLOW, "q_start = -9223372036854775808",
     "k_start = 0", set_q_start(c, INT64_MIN); c->desc.k_start = 0);
VALID(positions_end_at_int64_max, set_q_start(c, INT64_MAX - 4); c->desc.k_start = INT64_MAX - 5);
VALID(positions_start_at_int64_min, c->desc.k_start = INT64_MIN);
VALID(queries_far_before_keys, set_q_start(c, -1000000)); /* every row empty */
VALID(queries_far_after_keys, set_q_start(c, 1ll << 40));
VALID(not_causal, c->desc.causal = false);
VALID(not_causal_queries_before_keys, c->desc.causal = false; set_q_start(c, -1000));

/* per-head parameters: finite; lambda >= 0 */
CASE(delta_nan, APE_EINVAL, "desc->delta.value", "nan", c->desc.delta.value = NAN);
CASE(delta_inf, APE_EINVAL, "desc->delta.value", "inf", c->desc.delta.value = INFINITY);
CASE(delta_minus_inf, APE_EINVAL, "desc->delta.value", "-inf", c->desc.delta.value = -INFINITY);
CASE(delta_head3_nan, APE_EINVAL, "desc->delta.per_head[3]", "nan",
     set_head(c, &c->desc.delta, 3, NAN));
CASE(delta_head3_inf, APE_EINVAL, "desc->delta.per_head[3]", "inf",
     set_head(c, &c->desc.delta, 3, INFINITY));
CASE(delta_head3_minus_inf, APE_EINVAL, "desc->delta.per_head[3]", "-inf",
     set_head(c, &c->desc.delta, 3, -INFINITY));
CASE(delta_head0_nan, APE_EINVAL, "desc->delta.per_head[0]", "nan",
     set_head(c, &c->desc.delta, 0, NAN));
CASE(beta_nan, APE_EINVAL, "desc->beta.value", "nan", c->desc.beta.value = NAN);
CASE(beta_inf, APE_EINVAL, "desc->beta.value", "inf", c->desc.beta.value = INFINITY);
CASE(beta_minus_inf, APE_EINVAL, "desc->beta.value", "-inf", c->desc.beta.value = -INFINITY);
CASE(beta_head3_nan, APE_EINVAL, "desc->beta.per_head[3]", "nan",
     set_head(c, &c->desc.beta, 3, NAN));
CASE(beta_head3_inf, APE_EINVAL, "desc->beta.per_head[3]", "inf",
     set_head(c, &c->desc.beta, 3, INFINITY));
CASE(beta_head3_minus_inf, APE_EINVAL, "desc->beta.per_head[3]", "-inf",
     set_head(c, &c->desc.beta, 3, -INFINITY));
CASE(gamma_nan, APE_EINVAL, "desc->gamma.value", "nan", c->desc.gamma.value = NAN);
CASE(gamma_inf, APE_EINVAL, "desc->gamma.value", "inf", c->desc.gamma.value = INFINITY);
CASE(gamma_minus_inf, APE_EINVAL, "desc->gamma.value", "-inf", c->desc.gamma.value = -INFINITY);
CASE(gamma_head3_nan, APE_EINVAL, "desc->gamma.per_head[3]", "nan",
     set_head(c, &c->desc.gamma, 3, NAN));
CASE(gamma_head3_inf, APE_EINVAL, "desc->gamma.per_head[3]", "inf",
     set_head(c, &c->desc.gamma, 3, INFINITY));
CASE(gamma_head3_minus_inf, APE_EINVAL, "desc->gamma.per_head[3]", "-inf",
     set_head(c, &c->desc.gamma, 3, -INFINITY));
CASE(lambda_negative, APE_EINVAL, "desc->lambda.value", "-0.5", c->desc.lambda.value = -0.5f);
CASE(lambda_head3_negative, APE_EINVAL, "desc->lambda.per_head[3]", "-0.5",
     set_head(c, &c->desc.lambda, 3, -0.5f));
CASE(lambda_head1_tiny_negative, APE_EINVAL, "desc->lambda.per_head[1]", "-1e-30",
     set_head(c, &c->desc.lambda, 1, -1e-30f));
CASE(lambda_nan, APE_EINVAL, "desc->lambda.value", "nan", c->desc.lambda.value = NAN);
CASE(lambda_inf, APE_EINVAL, "desc->lambda.value", "inf", c->desc.lambda.value = INFINITY);
CASE(lambda_head3_nan, APE_EINVAL, "desc->lambda.per_head[3]", "nan",
     set_head(c, &c->desc.lambda, 3, NAN));
CASE(lambda_head3_inf, APE_EINVAL, "desc->lambda.per_head[3]", "inf",
     set_head(c, &c->desc.lambda, 3, INFINITY));
VALID(lambda_zero, c->desc.lambda.value = 0);
VALID(lambda_minus_zero, c->desc.lambda.value = -0.0f);
VALID(lambda_per_head, set_head(c, &c->desc.lambda, 0, 0); c->ph[3] = 4);
/* negative decays are valid: they only turn far-key skipping off */
VALID(delta_negative, c->desc.delta.value = -0.5f);
VALID(beta_head2_negative, set_head(c, &c->desc.beta, 2, -0.3f));
VALID(gamma_negative, c->desc.gamma.value = -0.2f);
VALID(every_parameter_per_head, c->desc.delta.per_head = c->desc.beta.per_head = c->ph;
      c->desc.gamma.per_head = c->desc.lambda.per_head = c->ph);
VALID(value_ignored_with_per_head, c->desc.delta.value = NAN; c->desc.delta.per_head = c->ph);

/* scalar parameters */
CASE(rope_scale_zero, APE_EINVAL, "desc->rope_scale", "= 0", c->desc.rope_scale = 0);
CASE(rope_scale_negative, APE_EINVAL, "desc->rope_scale", "-2", c->desc.rope_scale = -2);
CASE(rope_scale_nan, APE_EINVAL, "desc->rope_scale", "nan", c->desc.rope_scale = NAN);
CASE(rope_scale_inf, APE_EINVAL, "desc->rope_scale", "inf", c->desc.rope_scale = INFINITY);
VALID(rope_scale_4, c->desc.rope_scale = 4);
/* a caller of the second layout: rope_scale, past its struct, is never read (1) */
VALID(desc_struct_size_v2, c->desc.struct_size = APE_ATTN_DESC_V2_SIZE;
      c->desc.rope_scale = NAN);
CASE(rope_base_zero, APE_EINVAL, "desc->rope_base", "= 0", c->desc.rope_base = 0);
CASE(rope_base_negative, APE_EINVAL, "desc->rope_base", "-10000", c->desc.rope_base = -10000);
CASE(rope_base_nan, APE_EINVAL, "desc->rope_base", "nan", c->desc.rope_base = NAN);
CASE(rope_base_inf, APE_EINVAL, "desc->rope_base", "inf", c->desc.rope_base = INFINITY);
CASE(rope_base_minus_inf, APE_EINVAL, "desc->rope_base", "-inf", c->desc.rope_base = -INFINITY);
VALID(rope_base_1, c->desc.rope_base = 1);
CASE(scale_nan, APE_EINVAL, "desc->scale", "nan", c->desc.scale_set = true;
     c->desc.scale = NAN);
CASE(scale_inf, APE_EINVAL, "desc->scale", "inf", c->desc.scale_set = true;
     c->desc.scale = INFINITY);
CASE(scale_minus_inf, APE_EINVAL, "desc->scale", "-inf", c->desc.scale_set = true;
     c->desc.scale = -INFINITY);
VALID(scale_nan_not_set, c->desc.scale = NAN);
VALID(scale_zero, c->desc.scale_set = true; c->desc.scale = 0);
VALID(scale_negative, c->desc.scale_set = true; c->desc.scale = -0.7);
CASE(skip_tol_negative, APE_EINVAL, "desc->skip_tol", "-0.001", c->desc.skip_tol = -1e-3);
CASE(skip_tol_nan, APE_EINVAL, "desc->skip_tol", "nan", c->desc.skip_tol = NAN);
CASE(skip_tol_inf, APE_EINVAL, "desc->skip_tol", "inf", c->desc.skip_tol = INFINITY);
VALID(skip_tol_zero, c->desc.skip_tol = 0);
CASE(layout_5, APE_EINVAL, "desc->layout", "5", c->desc.layout = (ape_rope_layout)5);
VALID(layout_interleaved, c->desc.layout = APE_ROPE_INTERLEAVED);

/* inputs are not scanned: NaN or Inf gives NaN in the rows it reaches, and only there */
VALID(nan_in_q, *f32_at(c->q.data, ((0 * BASE_H + 1) * BASE_LQ + 2) * BASE_D + 3) = NAN);
VALID(inf_in_k, *f32_at(c->k.data, ((0 * BASE_HKV + 1) * BASE_LK + 4) * BASE_D + 0) = INFINITY);

TEST_HARNESS_MAIN
