/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_backward_enqueue() (include/ape/ape.h) on every backend
 * (common/backend_fixture.h: the reference, OpenCL, CUDA on its emulator):
 * - against ape_attention_backward() on the same device and tensors, bit for bit on the
 *   reference and OpenCL, within the spec's tolerance on CUDA: every storage type, GQA and MQA,
 *   causal and not, with and without dLSE, contiguous tensors used in place and padded
 *   [B, L, H, D] ones at byte offsets (gathered), gradients of 16-bit types, padding untouched;
 * - q, k and v as slices of one packed QKV buffer, outputs strided;
 * - each subset of the outputs (the others NULL: their buffers untouched), and two runs bit for
 *   bit the same;
 * - a forward enqueue then a backward enqueue on one queue with no synchronisation between;
 * - no query row or no key: zeros;
 * - query rows split under a small budget (exec/resident_bwd.c), and a budget too small for one
 *   row refused;
 * - skipping allowed (OpenCL leaves keys out) and skip_tol = 0, as the host call;
 * - every refusal with its message, nothing enqueued (the outputs keep their sentinels).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/problem.h"
#include "api/resident.h"
#include "api/validate.h"
#include "exec/resident_bwd.h"
#include "common/wrapops.h"

BACKEND_FIXTURE(rbwd);

/* ---- helpers */

/* A case with causal masking chosen, its O and LSE from the reference's forward. */
static int make_case(bcase *c, ape_rng *r, const test_problem_shape *sh, ape_dtype dt,
		     bool strided, bool with_dlse, bool causal, ape_device *ref)
{
	if (bcase_make(c, r, sh, dt, strided, with_dlse))
		return -1;
	test_problem_random_params(&c->tp, r);
	c->tp.desc.causal = causal;
	return bcase_forward(c, ref);
}

/* The enqueue's gradients against the host call's: bit for bit, or (CUDA) within tolerance. */
static void expect_like_host(struct __test_metadata *_metadata, const grads *got,
			     const grads *host, unsigned wanted, ape_dtype dt, bool exact,
			     const char *what)
{
	if (exact) {
		EXPECT_TRUE(same_grads(got, host, wanted)) TH_LOG("%s", what);
		return;
	}
	if (wanted & W_DQ)
		EXPECT_LE(grads_rel_err(&got->dq.t, &host->dq.t), grads_tol(dt)) TH_LOG("%s", what);
	if (wanted & W_DK)
		EXPECT_LE(grads_rel_err(&got->dk.t, &host->dk.t), grads_tol(dt)) TH_LOG("%s", what);
	if (wanted & W_DV)
		EXPECT_LE(grads_rel_err(&got->dv.t, &host->dv.t), grads_tol(dt)) TH_LOG("%s", what);
	if (wanted & W_DP)
		EXPECT_LE(grads_rel_err_params(got->dparams, host->dparams, got->H), grads_tol(dt))
		TH_LOG("%s", what);
}

/* The resident executor's request for case c on x's device tensors (dLSE only where c has one),
 * checked as the public call checks it, budget unlimited; p receives the problem. Returns the
 * check's code. */
static int request_of(struct ape__resident_bwd_req *r, struct ape__problem *p, ape_device *dev,
		      ape_queue *qu, const bcase *c, dcase *x)
{
	const ape_dtensor *t[T_COUNT];
	int ret;

	for (int n = 0; n < T_COUNT; n++)
		t[n] = n == T_DLSE && !c->dlse ? NULL : &x->d[n];
	memset(r, 0, sizeof(*r));
	if ((ret = ape__check_resident_bwd("test", qu, &c->tp.desc, t, p, r)))
		return ret;
	r->fn = "test";
	r->dev = dev;
	r->q = qu->q;
	r->p = p;
	r->budget = UINT64_MAX;
	return 0;
}

/* ---- results */

/*
 * Random cases across the storage types, GQA/MQA, causal and not, with and without dLSE,
 * contiguous (used in place at offset 0) and padded [B, L, H, D] at byte offsets (gathered):
 * the host call's gradients on the same device, and nothing outside the outputs written.
 */
TEST_F(rbwd, enqueue_equals_host_call)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const test_problem_shape shapes[] = {
		{ 1, 2, 1, 5, 7, 8 },	 { 2, 4, 2, 33, 47, 16 }, { 1, 3, 3, 17, 9, 64 },
		{ 2, 2, 1, 1, 40, 32 }, { 1, 4, 4, 19, 19, 24 }, { 2, 6, 2, 12, 30, 128 },
	};
	const bool exact = strcmp(variant->backend, "cuda") != 0;
	const int cases = self->emu ? 4 : ape_test_slow() ? 6 : 18;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < cases; i++) {
		const test_problem_shape *sh = &shapes[self->emu ? i % 2 : i % 6];
		const ape_dtype dt = types[i % 3];
		const bool strided = (i / 3) % 2, dlse = i % 4 != 1, causal = i % 5 < 2;
		const size_t pad = strided ? (size_t)(i % 4) * 4 : 0;
		char what[160];
		grads host, got;
		bcase c;

		snprintf(what, sizeof(what),
			 "case %d: B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld %s%s%s%s", i,
			 (long long)sh->B, (long long)sh->H, (long long)sh->Hkv, (long long)sh->Lq,
			 (long long)sh->Lk, (long long)sh->D, ape_dtype_name(dt),
			 strided ? " strided" : "", dlse ? " dlse" : "", causal ? " causal" : "");
		ASSERT_EQ(0, make_case(&c, &rng, sh, dt, strided, dlse, causal, self->ref))
		TH_LOG("%s: %s", what, ape_last_error());
		ASSERT_EQ(0, grads_alloc(&host, &c, dt));
		ASSERT_EQ(0, grads_alloc(&got, &c, dt));
		ASSERT_EQ(0, run_backward(&c, self->dev, &host, W_ALL, NULL))
		TH_LOG("%s: %s", what, ape_last_error());
		ASSERT_EQ(0, run_enqueue_backward(&c, self->dev, &got, W_ALL, pad))
		TH_LOG("%s: %s", what, ape_last_error());
		expect_like_host(_metadata, &got, &host, W_ALL, dt, exact, what);
		grads_free(&host);
		grads_free(&got);
		bcase_free(&c);
	}
}

/* With skipping allowed (decays >= 0, a large skip_tol: OpenCL leaves far keys out) and with
 * skip_tol = 0: the host call's gradients, as with the default. */
TEST_F(rbwd, skipping_as_the_host_call)
{
	const test_problem_shape sh = { 1, 4, 2, self->emu ? 9 : 40, self->emu ? 30 : 300, 32 };
	const bool exact = strcmp(variant->backend, "cuda") != 0;
	static const double tols[2] = { 1e-3, 0.0 };
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < 2; i++) {
		grads host, got;
		ape_stats st;
		bcase c;

		ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, true));
		test_problem_set_params(&c.tp, 0.8, 0.08, 0.08, 0.1);
		c.tp.desc.skip_tol = tols[i];
		c.tp.desc.causal = false;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&host, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&got, &c, APE_F32));
		ape_stats_init(&st);
		ASSERT_EQ(0, run_backward(&c, self->dev, &host, W_ALL, &st))
		TH_LOG("%s", ape_last_error());
		/* OpenCL skips here (the point of the case); the others compute every pair */
		if (!strcmp(variant->backend, "opencl") && i == 0)
			EXPECT_LT(st.pairs_computed, st.pairs_visible);
		ASSERT_EQ(0, run_enqueue_backward(&c, self->dev, &got, W_ALL, 4))
		TH_LOG("%s", ape_last_error());
		expect_like_host(_metadata, &got, &host, W_ALL, APE_F32, exact,
				 i ? "skip_tol 0" : "skip_tol 1e-3");
		grads_free(&host);
		grads_free(&got);
		bcase_free(&c);
	}
}

/* Outputs strided [B, L, H, D] with padding: the contiguous host call's values, in place, the
 * padding as it was. */
TEST_F(rbwd, strided_outputs_keep_their_padding)
{
	const test_problem_shape sh = { 2, 4, 2, 7, 10, 8 };
	const bool exact = strcmp(variant->backend, "cuda") != 0;
	grads host, g, pristine;
	ape_rng rng;
	bcase c;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, make_case(&c, &rng, &sh, APE_F16, true, true, false, self->ref));
	ASSERT_EQ(0, grads_alloc(&host, &c, APE_F16));
	ASSERT_EQ(0, run_backward(&c, self->dev, &host, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	memset(&g, 0, sizeof(g));
	memset(&pristine, 0, sizeof(pristine));
	g.H = pristine.H = sh.H;
	ASSERT_EQ(0, test_tensor_relayout(&g.dq, &host.dq, 3));
	ASSERT_EQ(0, test_tensor_relayout(&g.dk, &host.dk, 3));
	ASSERT_EQ(0, test_tensor_relayout(&g.dv, &host.dv, 3));
	ASSERT_EQ(0, test_tensor_relayout(&pristine.dq, &host.dq, 3));
	g.dparams = malloc(sizeof(float) * 4 * (size_t)sh.H);
	ASSERT_NE(NULL, g.dparams);
	test_tensor_poison(&g.dq.t);
	test_tensor_poison(&g.dk.t);
	test_tensor_poison(&g.dv.t);
	test_tensor_poison(&pristine.dq.t);
	ASSERT_EQ(0, run_enqueue_backward(&c, self->dev, &g, W_ALL, 12)) TH_LOG("%s", ape_last_error());
	if (exact) {
		EXPECT_EQ(0.0, test_max_err_o(&g.dq.t, &host.dq.t));
		EXPECT_EQ(0.0, test_max_err_o(&g.dk.t, &host.dk.t));
		EXPECT_EQ(0.0, test_max_err_o(&g.dv.t, &host.dv.t));
		EXPECT_EQ(0, memcmp(g.dparams, host.dparams, sizeof(float) * 4 * (size_t)sh.H));
	} else {
		expect_like_host(_metadata, &g, &host, W_ALL, APE_F16, false, "strided");
	}
	test_tensor_poison(&g.dq.t); /* every element NaN again: the padding must be as it was */
	EXPECT_EQ(0, memcmp(g.dq.alloc, pristine.dq.alloc, g.dq.alloc_bytes));
	test_tensor_free(&pristine.dq);
	grads_free(&g);
	grads_free(&host);
	bcase_free(&c);
}

/* q, k, v slices of one packed [B, L, 3, H, D] buffer; each gradient with the same strides in
 * a buffer of its own (gaps between its rows): the host call's values. (Three interleaved
 * outputs in one buffer are refused, as by the host call: overlaps are judged by byte spans.) */
TEST_F(rbwd, packed_qkv_slices)
{
	const int64_t B = 2, H = 3, L = self->emu ? 9 : 29, D = 16;
	const int64_t s[4] = { L * 3 * H * D, D, 3 * H * D, 1 };
	const size_t n = (size_t)(B * L * 3 * H * D), on = (size_t)(B * L * H * D);
	const bool exact = strcmp(variant->backend, "cuda") != 0;
	float *qkv = malloc(n * 4), *dqkv = malloc(3 * n * 4), *o = malloc(on * 4);
	float *dout = malloc(on * 4);
	float *hq = malloc(on * 4), *hk = malloc(on * 4), *hv = malloc(on * 4);
	float lse[2 * 3 * 29], hdp[12], ddp[12];
	ape_tensor q, k, v, to, tdo, tq, tk, tv;
	ape_dtensor dq, dk, dv, dgq, dgk, dgv, dto, dl, ddo, dp;
	ape_buffer *bx = NULL, *bg[3] = { NULL, NULL, NULL }, *bo = NULL, *bl = NULL, *bdo = NULL;
	ape_buffer *bp = NULL;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	ape_rng rng;

	ASSERT_TRUE(qkv && dqkv && o && dout && hq && hk && hv);
	ape_rng_init(&rng, _metadata->name);
	for (size_t i = 0; i < n; i++)
		qkv[i] = (float)ape_rng_normal(&rng);
	for (size_t i = 0; i < on; i++)
		dout[i] = (float)ape_rng_normal(&rng);
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.4f;
	desc.beta.value = 0.04f;
	desc.gamma.value = 0.04f;
	desc.lambda.value = 0.1f;
	desc.causal = true;
	ape_tensor_init(&q, qkv, APE_F32, B, H, L, D);
	memcpy(q.strides, s, sizeof(s));
	k = q;
	k.data = qkv + H * D;
	v = q;
	v.data = qkv + 2 * H * D;
	ape_tensor_init(&to, o, APE_F32, B, H, L, D);
	ape_tensor_init(&tdo, dout, APE_F32, B, H, L, D);
	ape_tensor_init(&tq, hq, APE_F32, B, H, L, D);
	ape_tensor_init(&tk, hk, APE_F32, B, H, L, D);
	ape_tensor_init(&tv, hv, APE_F32, B, H, L, D);
	ASSERT_EQ(0, ape_attention_forward(self->dev, &desc, &q, &k, &v, &to, lse, NULL));
	ASSERT_EQ(0, ape_attention_backward(self->dev, &desc, &q, &k, &v, &to, lse, &tdo, NULL, &tq,
					    &tk, &tv, hdp, NULL))
	TH_LOG("%s", ape_last_error());

	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, n * 4, &bx));
	for (int i = 0; i < 3; i++)
		ASSERT_EQ(0, ape_buffer_alloc(self->dev, n * 4, &bg[i]));
	ASSERT_EQ(0, ape_buffer_write(qu, bx, 0, qkv, n * 4));
	ASSERT_EQ(0, dcase_up_floats(qu, o, on, 0, &bo, &dto, B, H, L, D));
	ASSERT_EQ(0, dcase_up_floats(qu, dout, on, 0, &bdo, &ddo, B, H, L, D));
	ASSERT_EQ(0, dcase_up_floats(qu, lse, (size_t)(B * H * L), 0, &bl, &dl, B, H, L, 1));
	ASSERT_EQ(0, dcase_up_floats(qu, hdp, 12, 4, &bp, &dp, 1, 1, H, 4));
	ape_dtensor_init(&dq, bx, 0, APE_F32, B, H, L, D);
	memcpy(dq.strides, s, sizeof(s));
	dk = dq;
	dk.byte_offset = (uint64_t)(H * D) * 4;
	dv = dq;
	dv.byte_offset = (uint64_t)(2 * H * D) * 4;
	dgq = dq;
	dgq.buf = bg[0];
	dgk = dk;
	dgk.buf = bg[1];
	dgv = dv;
	dgv.buf = bg[2];
	ASSERT_EQ(0, ape_attention_backward_enqueue(qu, &desc, &dq, &dk, &dv, &dto, &dl, &ddo, NULL,
						    &dgq, &dgk, &dgv, &dp))
	TH_LOG("%s", ape_last_error());
	for (int i = 0; i < 3; i++)
		ASSERT_EQ(0, ape_buffer_read(qu, dqkv + (size_t)i * n, bg[i], 0, n * 4));
	ASSERT_EQ(0, ape_buffer_read(qu, ddp, bp, 4, sizeof(ddp)));
	ASSERT_EQ(0, ape_queue_synchronize(qu)) TH_LOG("%s", ape_last_error());
	{
		ape_tensor gq = q, gk = k, gv = v;
		double m = 1e-30, e = 0;

		gq.data = dqkv;
		gk.data = dqkv + n + H * D;
		gv.data = dqkv + 2 * n + 2 * H * D;
		if (exact) {
			EXPECT_EQ(0.0, test_max_err_o(&gq, &tq));
			EXPECT_EQ(0.0, test_max_err_o(&gk, &tk));
			EXPECT_EQ(0.0, test_max_err_o(&gv, &tv));
			EXPECT_EQ(0, memcmp(ddp, hdp, sizeof(hdp)));
		} else {
			EXPECT_LE(grads_rel_err(&gq, &tq), grads_tol(APE_F32));
			EXPECT_LE(grads_rel_err(&gk, &tk), grads_tol(APE_F32));
			EXPECT_LE(grads_rel_err(&gv, &tv), grads_tol(APE_F32));
			for (int i = 0; i < 12; i++) {
				m = fmax(m, fabs(hdp[i]));
				e = fmax(e, fabs(hdp[i] - ddp[i]));
			}
			EXPECT_LE(e / m, grads_tol(APE_F32));
		}
	}
	ape_queue_destroy(qu);
	ape_buffer_free(bx);
	for (int i = 0; i < 3; i++)
		ape_buffer_free(bg[i]);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
	ape_buffer_free(bdo);
	ape_buffer_free(bp);
	free(qkv);
	free(dqkv);
	free(o);
	free(dout);
	free(hq);
	free(hk);
	free(hv);
}

/* Each subset of the outputs: those asked for equal the host call's, the others' buffers keep
 * their NaN; two runs give the same bits. */
TEST_F(rbwd, optional_outputs_and_determinism)
{
	static const unsigned subsets[] = { W_DQ, W_DK, W_DV, W_DP, W_DK | W_DV, W_DQ | W_DP, W_ALL };
	const test_problem_shape sh = { 1, 4, 2, 13, 21, 16 };
	const bool exact = strcmp(variant->backend, "cuda") != 0;
	ape_rng rng;
	bcase c;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, make_case(&c, &rng, &sh, APE_F32, false, true, true, self->ref));
	for (size_t i = 0; i < sizeof(subsets) / sizeof(subsets[0]); i++) {
		const unsigned w = subsets[i];
		grads host, a, b, none;

		ASSERT_EQ(0, grads_alloc(&host, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&a, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&b, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&none, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->dev, &host, w, NULL));
		ASSERT_EQ(0, run_enqueue_backward(&c, self->dev, &a, w, 0)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, run_enqueue_backward(&c, self->dev, &b, w, 8)) TH_LOG("%s", ape_last_error());
		expect_like_host(_metadata, &a, &host, w, APE_F32, exact, "subset");
		EXPECT_TRUE(same_grads(&a, &b, w)) TH_LOG("outputs %#x: two runs differ", w);
		/* what was not asked for is as grads_alloc() left it: NaN */
		EXPECT_TRUE(same_grads(&a, &none, W_ALL & ~w)) TH_LOG("outputs %#x", w);
		grads_free(&host);
		grads_free(&a);
		grads_free(&b);
		grads_free(&none);
	}
	bcase_free(&c);
}

/* The forward enqueued, then the backward on the same queue with no synchronisation between:
 * the backward reads the O and LSE the forward writes, and gives the host calls' gradients. */
TEST_F(rbwd, forward_then_backward_on_one_queue)
{
	const test_problem_shape sh = { 2, 4, 2, 11, 23, 32 };
	const bool exact = strcmp(variant->backend, "cuda") != 0;
	ape_queue *qu = NULL;
	grads host, got;
	ape_rng rng;
	dcase x;
	bcase c;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, true, true));
	test_problem_random_params(&c.tp, &rng);
	ASSERT_EQ(0, bcase_forward(&c, self->dev)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, grads_alloc(&host, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&got, &c, APE_F32));
	ASSERT_EQ(0, run_backward(&c, self->dev, &host, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	/* the device's O and LSE start as NaN: only the forward enqueue can make them right */
	test_tensor_poison(&c.tp.o.t);
	for (size_t i = 0; i < c.tp.rows; i++)
		c.tp.lse[i] = NAN;
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, dcase_up(&x, qu, &c, &got, 4));
	ASSERT_EQ(0, ape_attention_enqueue(qu, &c.tp.desc, &x.d[T_Q], &x.d[T_K], &x.d[T_V],
					   &x.d[T_O], &x.d[T_LSE]))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, dcase_enqueue(&x, qu, &c, W_ALL)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, dcase_down(&x, qu, &got)) TH_LOG("%s", ape_last_error());
	expect_like_host(_metadata, &got, &host, W_ALL, APE_F32, exact, "forward then backward");
	ape_queue_destroy(qu);
	dcase_free(&x);
	grads_free(&host);
	grads_free(&got);
	bcase_free(&c);
}

/* No key: dQ and dparams 0; no query row: dK, dV and dparams 0 (written through the queue). */
TEST_F(rbwd, empty_shapes_give_zeros)
{
	static const test_problem_shape shapes[] = { { 1, 2, 1, 4, 0, 8 }, { 2, 2, 2, 0, 5, 8 } };
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < 2; i++) {
		bcase c;
		grads g;

		ASSERT_EQ(0, make_case(&c, &rng, &shapes[i], APE_BF16, i == 1, true, false,
				       self->ref));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_BF16));
		ASSERT_EQ(0, run_enqueue_backward(&c, self->dev, &g, W_ALL, 4)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0.0, test_tensor_maxabs(&g.dq.t));
		EXPECT_EQ(0.0, test_tensor_maxabs(&g.dk.t));
		EXPECT_EQ(0.0, test_tensor_maxabs(&g.dv.t));
		for (int64_t j = 0; j < 4 * g.H; j++)
			EXPECT_EQ(0.0f, g.dparams[j]);
		grads_free(&g);
		bcase_free(&c);
	}
}

/* Under a budget a few rows fit: launches of fewer query rows, in order, every key each; the
 * gradients within the spec's tolerance of one launch's, two runs bit for bit the same; a
 * budget of one byte refused before anything is enqueued. */
TEST_F(rbwd, query_rows_split_under_the_budget)
{
	const test_problem_shape sh = { 1, 4, 2, self->emu ? 13 : 45, self->emu ? 17 : 61, 16 };
	static const char *const names[T_COUNT] = { "q", "k", "v", "o", "lse", "dout", "dlse",
					       "dq", "dk", "dv", "dparams" };
	struct ape__resident_bwd_req r;
	struct ape__problem p;
	grads one, split, again;
	ape_queue *qu = NULL;
	int64_t rows = 0;
	ape_rng rng;
	dcase x;
	bcase c;

	(void)names;
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, make_case(&c, &rng, &sh, APE_F32, true, true, true, self->ref));
	ASSERT_EQ(0, grads_alloc(&one, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&split, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
	ASSERT_EQ(0, run_enqueue_backward(&c, self->dev, &one, W_ALL, 0)) TH_LOG("%s", ape_last_error());

	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, dcase_up(&x, qu, &c, &split, 0));
	ASSERT_EQ(0, request_of(&r, &p, self->dev, qu, &c, &x)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape__resident_bwd_plan(&r, &rows));
	EXPECT_EQ(sh.Lq, rows);
	r.budget = 1; /* the gathered copies alone are more */
	EXPECT_EQ(APE_ENOMEM, ape__resident_bwd_plan(&r, &rows));
	EXPECT_NE(NULL, strstr(ape_last_error(), "of 1 query row and")) TH_LOG("%s", ape_last_error());
	for (int64_t n = 1; n < sh.Lq; n = n * 3 + 1) {
		ASSERT_EQ(0, ape__resident_bwd_enqueue(&r, n)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, dcase_down(&x, qu, &split));
		ASSERT_EQ(0, ape__resident_bwd_enqueue(&r, n)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, dcase_down(&x, qu, &again));
		EXPECT_TRUE(same_grads(&split, &again, W_ALL)) TH_LOG("%lld rows: runs differ",
								     (long long)n);
		EXPECT_LE(grads_rel_err(&split.dq.t, &one.dq.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&split.dk.t, &one.dk.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&split.dv.t, &one.dv.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err_params(split.dparams, one.dparams, sh.H), grads_tol(APE_F32))
		TH_LOG("%lld rows per launch", (long long)n);
	}
	ape__problem_fini(&p);
	ape_queue_destroy(qu);
	dcase_free(&x);
	grads_free(&one);
	grads_free(&split);
	grads_free(&again);
	bcase_free(&c);
}

/*
 * On a device that takes strided backward launches (bwd_views: the reference, OpenCL), Q, K, V,
 * O and dO are read where they lie, never gathered: padded [B, L, H, D] inputs at byte offsets,
 * every storage type, in one launch and in launches of 7 query rows (views moved along L), bit
 * for bit the launches on gathered copies (the capability hidden by the wrapper), with at least
 * the gathers of K and V and of each launch's Q and O (and dO, at an offset) fewer copy_view
 * calls.
 */
TEST_F(rbwd, strided_inputs_read_where_they_lie)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	const test_problem_shape sh = { 2, 4, 2, self->emu ? 13 : 33, self->emu ? 17 : 47, 16 };
	ape_rng rng;

	if (!ape_be_dev_has(self->dev, APE_BE_CAP_BWD_VIEWS))
		SKIP(return, "%s: no strided backward launches", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < 6; i++) {
		const ape_dtype dt = types[i % 3];
		const int64_t rows = i < 3 ? sh.Lq : 7, launches = (sh.Lq + rows - 1) / rows;
		struct ape__resident_bwd_req r;
		struct ape__problem p;
		grads got[2];
		uint64_t copies[2];
		ape_queue *qu = NULL;
		dcase x;
		bcase c;

		ASSERT_EQ(0, make_case(&c, &rng, &sh, dt, true, i % 2, i % 4 < 2, self->ref));
		ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
		for (int w = 0; w < 2; w++) { /* w 0: views; w 1: gathered */
			ASSERT_EQ(0, grads_alloc(&got[w], &c, dt));
			ASSERT_EQ(0, dcase_up(&x, qu, &c, &got[w], (size_t)(i % 4) * 4));
			ASSERT_EQ(0, request_of(&r, &p, self->dev, qu, &c, &x))
			TH_LOG("%s", ape_last_error());
			wrap_install(self->dev, w ? WRAP_NO_BWD_VIEWS : 0);
			wrap_reset();
			EXPECT_EQ(0, ape__resident_bwd_enqueue(&r, rows)) TH_LOG("%s", ape_last_error());
			EXPECT_EQ(0, dcase_down(&x, qu, &got[w]));
			copies[w] = wrap_get().calls[WRAP_COPY_VIEW];
			wrap_remove();
			ape__problem_fini(&p);
			dcase_free(&x);
		}
		EXPECT_TRUE(same_grads(&got[0], &got[1], W_ALL)) TH_LOG("case %d", i);
		/* (dO, contiguous, is used in place without views too where it starts its buffer) */
		EXPECT_LE(copies[0] + 2 + (i % 4 ? 3 : 2) * (uint64_t)launches, copies[1])
		TH_LOG("case %d: %llu copies with views, %llu gathering", i,
		       (unsigned long long)copies[0], (unsigned long long)copies[1]);
		ape_queue_destroy(qu);
		grads_free(&got[0]);
		grads_free(&got[1]);
		bcase_free(&c);
	}
}

/* ---- refusals: each before anything is enqueued, its message naming the argument */

TEST_F(rbwd, refusals_name_the_argument)
{
	const test_problem_shape sh = { 1, 2, 1, 5, 6, 8 };
	ape_dtensor d[T_COUNT];
	ape_buffer *foreign = NULL;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	grads g, after;
	ape_rng rng;
	dcase x;
	bcase c;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, make_case(&c, &rng, &sh, APE_F32, false, true, false, self->ref));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&after, &c, APE_F32));
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, dcase_up(&x, qu, &c, &g, 0));
	desc = c.tp.desc;

#define RESET() (memcpy(d, x.d, sizeof(d)), desc = c.tp.desc)
#define CALL()                                                                                     \
	ape_attention_backward_enqueue(qu, &desc, &d[T_Q], &d[T_K], &d[T_V], &d[T_O], &d[T_LSE],  \
				       &d[T_DOUT], &d[T_DLSE], &d[T_DQ], &d[T_DK], &d[T_DV],      \
				       &d[T_DP])
#define REFUSED(code, text)                                                                        \
	do {                                                                                       \
		EXPECT_EQ(code, CALL());                                                           \
		EXPECT_NE(NULL, strstr(ape_last_error(), text))                                    \
		TH_LOG("want \"%s\" in \"%s\"", text, ape_last_error());                           \
		EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_backward_enqueue"));       \
		RESET();                                                                           \
	} while (0)

	RESET();
	d[T_DK].byte_offset = 64; /* runs past the end */
	REFUSED(APE_EINVAL, "dk: offset 64");
	d[T_DV].byte_offset = 2;
	REFUSED(APE_EINVAL, "dv->byte_offset = 2");
	d[T_DQ].strides[0] = 80, d[T_DQ].strides[1] = 40, d[T_DQ].strides[2] = 8;
	d[T_DQ].strides[3] = 2;
	REFUSED(APE_EINVAL, "dq->strides[3] = 2");
	d[T_DQ].dtype = APE_BF16;
	REFUSED(APE_EINVAL, "dq->dtype");
	d[T_DK].shape[2] = 5;
	REFUSED(APE_EINVAL, "dk->shape[2] = 5");
	d[T_DP].shape[3] = 3;
	REFUSED(APE_EINVAL, "dparams->shape[3] = 3");
	d[T_DP].dtype = APE_F16;
	REFUSED(APE_EINVAL, "dparams->dtype");
	d[T_DLSE].shape[2] = 4;
	REFUSED(APE_EINVAL, "dlse->shape[2] = 4");
	d[T_LSE].shape[3] = 2;
	REFUSED(APE_EINVAL, "lse->shape[3] = 2");
	d[T_DOUT].shape[1] = 3;
	REFUSED(APE_EINVAL, "dout->shape[1] = 3");
	d[T_DQ] = d[T_Q]; /* dQ over Q */
	REFUSED(APE_EINVAL, "dq overlaps q");
	d[T_DV] = d[T_DK];
	REFUSED(APE_EINVAL, "dv overlaps dk");
	d[T_DP].buf = x.b[T_DLSE];
	REFUSED(APE_EINVAL, "dparams overlaps dlse");
	d[T_Q].buf = NULL;
	REFUSED(APE_EINVAL, "q->buf = NULL");
	desc.skip_tol = -1;
	REFUSED(APE_EINVAL, "desc->skip_tol = -1");
	EXPECT_EQ(APE_EINVAL, ape_attention_backward_enqueue(NULL, &desc, &d[T_Q], &d[T_K], &d[T_V],
							     &d[T_O], &d[T_LSE], &d[T_DOUT], NULL,
							     &d[T_DQ], NULL, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "queue = NULL"));
	EXPECT_EQ(APE_EINVAL, ape_attention_backward_enqueue(qu, &desc, &d[T_Q], &d[T_K], &d[T_V],
							     &d[T_O], NULL, &d[T_DOUT], NULL,
							     &d[T_DQ], NULL, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "lse = NULL"));
	EXPECT_EQ(APE_EINVAL, ape_attention_backward_enqueue(qu, &desc, &d[T_Q], &d[T_K], &d[T_V],
							     &d[T_O], &d[T_LSE], NULL, NULL,
							     &d[T_DQ], NULL, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "dout = NULL"));
	EXPECT_EQ(APE_EINVAL, ape_attention_backward_enqueue(qu, &desc, &d[T_Q], &d[T_K], &d[T_V],
							     &d[T_O], &d[T_LSE], &d[T_DOUT], NULL,
							     NULL, NULL, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "dq, dk, dv and dparams are all NULL"));
	if (self->dev != self->ref) {
		ASSERT_EQ(0, ape_buffer_alloc(self->ref, 4096, &foreign));
		d[T_DOUT].buf = foreign;
		REFUSED(APE_EINVAL, "dout->buf is a buffer of ref:0");
	}
	/* none of it ran: the outputs still hold their NaN */
	ASSERT_EQ(0, dcase_down(&x, qu, &after));
	EXPECT_TRUE(same_grads(&after, &g, W_ALL));
#undef REFUSED
#undef CALL
#undef RESET
	ape_queue_destroy(qu);
	dcase_free(&x);
	ape_buffer_free(foreign);
	grads_free(&g);
	grads_free(&after);
	bcase_free(&c);
}

TEST_HARNESS_MAIN
