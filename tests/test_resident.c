/* SPDX-License-Identifier: MIT */
/*
 * Device-resident calls (include/ape/ape.h, "Device memory, queues and device-resident
 * tensors") on every backend: ape_attention_enqueue() on buffers the test fills, against the
 * host call on the same device, bit for bit, for random problems (every dtype, GQA, layouts,
 * causal and not, offsets) in contiguous and [B, L, H, D] layouts at byte offsets, and for one
 * slice of a packed QKV tensor; empty shapes; every refusal before anything runs (bounds,
 * offsets, strides, foreign buffers, overlaps), with its message; the buffer and queue calls'
 * own checks; host memory wrapped where the device computes on it, and host calls that then
 * copy nothing.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"
#include "api/forward.h"
#include "api/resident.h"
#include "api/validate.h"
#include "exec/resident.h"

BACKEND_FIXTURE(resident);

/* ---- helpers */

/* Bytes from t's data pointer to just past its last element. */
static size_t span_bytes(const ape_tensor *t)
{
	int64_t s[4];
	uint64_t last = 0;

	ape_tensor_strides(t, s);
	for (int d = 0; d < 4; d++) {
		if (!t->shape[d])
			return 0;
		last += (uint64_t)(t->shape[d] - 1) * (uint64_t)s[d];
	}
	return (size_t)(last + 1) * ape_dtype_size(t->dtype);
}

/* A device copy of host tensor t, `pad` bytes into a new buffer, with t's strides. */
static int upload(ape_queue *qu, const ape_tensor *t, size_t pad, ape_buffer **buf,
		  ape_dtensor *dt)
{
	const size_t n = span_bytes(t);
	int ret = ape_buffer_alloc(ape_queue_device(qu), pad + n + 64, buf);

	if (ret)
		return ret;
	ape_dtensor_init(dt, *buf, pad, t->dtype, t->shape[0], t->shape[1], t->shape[2],
			 t->shape[3]);
	ape_tensor_strides(t, dt->strides);
	return n ? ape_buffer_write(qu, *buf, pad, t->data, n) : 0;
}

/* The diagnostics' outputs of a resident run (run_resident_diag()): each wanted one is a device
 * tensor of one float per row in a buffer of its own, `pad` bytes in, laid out [B, Lq, H] with
 * a gap after each (b, l) when `gappy`, else contiguous; the buffer is NaN-poisoned first, read
 * back whole after the run into ent / md ([B, H, Lq] order), and `dirty` counts the floats
 * outside the tensor (padding, gaps) that are no longer NaN. */
struct rdiag {
	bool want_ent, want_md, gappy;
	float *ent, *md; /* tp->rows floats each, written when wanted */
	int64_t dirty;
};

/* Bytes of a row output of tp laid out as d says, `pad` bytes in, plus 4 bytes after. */
static void row_layout(const test_problem *tp, bool gappy, size_t pad, ape_dtensor *t,
		       ape_buffer *buf, size_t *bytes)
{
	const int64_t B = tp->q.t.shape[0], H = tp->q.t.shape[1], L = tp->q.t.shape[2];

	ape_dtensor_init(t, buf, pad, APE_F32, B, H, L, 1);
	if (gappy) {
		t->strides[0] = L * (H + 1);
		t->strides[1] = 1;
		t->strides[2] = H + 1;
		t->strides[3] = 1;
	}
	*bytes = pad + (size_t)(gappy ? B * L * (H + 1) : B * H * L) * 4 + 4;
}

/* A NaN-poisoned buffer for a row output (row_layout()); the write is enqueued on qu. */
static int row_buffer(ape_queue *qu, const test_problem *tp, bool gappy, size_t pad,
		      ape_buffer **buf, ape_dtensor *t)
{
	size_t bytes;
	float *nan;
	int ret;

	row_layout(tp, gappy, pad, t, NULL, &bytes);
	nan = malloc(bytes);
	if (!nan)
		return APE_ENOMEM;
	for (size_t i = 0; i < bytes / 4; i++)
		nan[i] = NAN;
	ret = ape_buffer_alloc(ape_queue_device(qu), bytes, buf);
	if (!ret)
		ret = ape_buffer_write(qu, *buf, 0, nan, bytes / 4 * 4);
	/* the write is asynchronous: its source must outlive it */
	if (!ret)
		ret = ape_queue_synchronize(qu);
	free(nan);
	t->buf = *buf;
	return ret;
}

/* Reads a row output back (whole buffer, synchronising qu) into out, [B, H, Lq] order; adds the
 * floats outside the tensor that are no longer NaN to *dirty. */
static int row_read(ape_queue *qu, const ape_dtensor *t, float *out, int64_t *dirty)
{
	const size_t bytes = ape_buffer_size(t->buf), n = bytes / 4;
	float *all = malloc(bytes);
	bool *used = calloc(n, 1);
	int64_t s[4] = { t->shape[1] * t->shape[2], t->shape[2], 1, 1 };
	int ret = all && used ? 0 : APE_ENOMEM;

	if (t->strides[0] || t->strides[1] || t->strides[2])
		memcpy(s, t->strides, sizeof(s));
	if (!ret)
		ret = ape_buffer_read(qu, all, t->buf, 0, bytes);
	if (!ret)
		ret = ape_queue_synchronize(qu);
	for (int64_t b = 0, r = 0; !ret && b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t i = 0; i < t->shape[2]; i++, r++) {
				const size_t e = t->byte_offset / 4 + (size_t)(b * s[0] + h * s[1] +
									   i * s[2]);

				out[r] = all[e];
				used[e] = true;
			}
	for (size_t e = 0; !ret && e < n; e++)
		*dirty += !used[e] && !isnan(all[e]);
	free(all);
	free(used);
	return ret;
}

/* Runs tp on dev on the device: inputs and outputs in device buffers laid out like tp's host
 * tensors, `pad` bytes in (a multiple of 4); results read back into tp. With d (not NULL) the
 * call is ape_attention_enqueue_diag() with the outputs d wants, else ape_attention_enqueue(). */
static int run_resident_diag(test_problem *tp, ape_device *dev, size_t pad, struct rdiag *d)
{
	ape_buffer *bq = NULL, *bk = NULL, *bv = NULL, *bo = NULL, *bl = NULL, *be = NULL,
		   *bm = NULL;
	ape_dtensor q, k, v, o, l, e, m;
	const size_t on = span_bytes(&tp->o.t), ln = tp->rows * sizeof(float);
	ape_queue *qu = NULL;
	int ret;

	test_tensor_poison(&tp->o.t);
	for (size_t i = 0; tp->lse && i < tp->rows; i++)
		tp->lse[i] = NAN;
	tp->q_start = tp->desc.q_start_set ? tp->desc.q_start
					   : tp->desc.k_start + tp->k.t.shape[2] - tp->q.t.shape[2];
	ret = ape_queue_create(dev, &qu);
	if (!ret)
		ret = upload(qu, &tp->q.t, pad, &bq, &q);
	if (!ret)
		ret = upload(qu, &tp->k.t, pad, &bk, &k);
	if (!ret)
		ret = upload(qu, &tp->v.t, pad, &bv, &v);
	if (!ret) /* the poisoned O goes up too: what the kernel does not write stays NaN */
		ret = upload(qu, &tp->o.t, pad, &bo, &o);
	if (!ret && tp->lse) {
		ret = ape_buffer_alloc(dev, pad + ln + 4, &bl);
		ape_dtensor_init(&l, bl, pad, APE_F32, tp->q.t.shape[0], tp->q.t.shape[1],
				 tp->q.t.shape[2], 1);
	}
	if (!ret && d && d->want_ent)
		ret = row_buffer(qu, tp, d->gappy, pad, &be, &e);
	if (!ret && d && d->want_md)
		ret = row_buffer(qu, tp, d->gappy, pad + 4, &bm, &m);
	if (!ret && d)
		ret = ape_attention_enqueue_diag(qu, &tp->desc, &q, &k, &v, &o,
						 tp->lse ? &l : NULL, be ? &e : NULL,
						 bm ? &m : NULL);
	else if (!ret)
		ret = ape_attention_enqueue(qu, &tp->desc, &q, &k, &v, &o, tp->lse ? &l : NULL);
	if (!ret && on)
		ret = ape_buffer_read(qu, tp->o.t.data, bo, pad, on);
	if (!ret && tp->lse && ln)
		ret = ape_buffer_read(qu, tp->lse, bl, pad, ln);
	if (!ret)
		ret = ape_queue_synchronize(qu);
	if (!ret && be)
		ret = row_read(qu, &e, d->ent, &d->dirty);
	if (!ret && bm)
		ret = row_read(qu, &m, d->md, &d->dirty);
	ape_queue_destroy(qu);
	ape_buffer_free(bq);
	ape_buffer_free(bk);
	ape_buffer_free(bv);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
	ape_buffer_free(be);
	ape_buffer_free(bm);
	return ret;
}

/* Runs tp on dev with ape_attention_enqueue() (run_resident_diag() without diagnostics). */
static int run_resident(test_problem *tp, ape_device *dev, size_t pad)
{
	return run_resident_diag(tp, dev, pad, NULL);
}

/* Elements of O that differ in bits (NaN equal to NaN), and LSE rows likewise. */
static int64_t differing(const test_problem *a, const test_problem *b)
{
	const ape_tensor *x = &a->o.t, *y = &b->o.t;
	int64_t bad = 0;

	for (int64_t i0 = 0; i0 < x->shape[0]; i0++)
		for (int64_t i1 = 0; i1 < x->shape[1]; i1++)
			for (int64_t i2 = 0; i2 < x->shape[2]; i2++)
				for (int64_t i3 = 0; i3 < x->shape[3]; i3++) {
					double p = test_tensor_get(x, i0, i1, i2, i3);
					double q = test_tensor_get(y, i0, i1, i2, i3);

					bad += !(p == q || (isnan(p) && isnan(q)));
				}
	for (size_t i = 0; a->lse && i < a->rows; i++)
		bad += !(a->lse[i] == b->lse[i] || (isnan(a->lse[i]) && isnan(b->lse[i])));
	return bad;
}

/* ---- results */

/* Random problems (strided [B, L, H, D] ones among them), at byte offsets, equal bit for bit to
 * the host call on the same device (on CUDA, where a strided row may take another kernel path,
 * within the spec's tolerance). */
TEST_F(resident, enqueue_equals_host_call)
{
	const int cases = self->emu ? 6 : ape_test_slow() ? 4 : 24;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		test_problem a, b;
		char what[256];
		int64_t bad;

		ASSERT_EQ(0, test_problem_random(&a, &rng, 0));
		ASSERT_EQ(0, test_problem_clone(&b, &a));
		test_problem_describe(&a, what, sizeof(what));
		ASSERT_EQ(0, test_problem_run(&a, self->dev)) TH_LOG("%s: %s", what, ape_last_error());
		ASSERT_EQ(0, run_resident(&b, self->dev, (size_t)(c % 4) * 4))
		TH_LOG("%s: %s", what, ape_last_error());
		bad = differing(&a, &b);
		if (strcmp(variant->backend, "cuda")) {
			EXPECT_EQ(0, bad)
			TH_LOG("case %d, %s: %lld elements differ", c, what, (long long)bad);
		} else if (bad) {
			/* CUDA reads rows that its 16-byte vector loads cannot take in place through
			 * a copy or its generic kernel (docs/kernels.md, "strided views"): another
			 * summation order, the same result within the spec's tolerance */
			const double vmax = fmax(test_tensor_maxabs(&a.v.t), 1e-30);

			EXPECT_LE(test_max_err_o(&a.o.t, &b.o.t) / vmax, test_tol_o(a.q.t.dtype))
			TH_LOG("case %d, %s", c, what);
			if (a.lse)
				EXPECT_LE(test_max_rel_err_lse(a.lse, b.lse, a.rows),
					  test_tol_lse(a.q.t.dtype))
				TH_LOG("case %d, %s", c, what);
		}
		if (b.strided)
			EXPECT_EQ(0, test_problem_padding_intact(&b)) TH_LOG("%s: padding written", what);
		test_problem_free(&a);
		test_problem_free(&b);
	}
}

/* q, k and v as slices of one packed [B, L, 3, H, D] tensor in one buffer, O as [B, L, H, D]:
 * nothing is copied or rearranged, and the result equals the host call on the same strides. */
TEST_F(resident, packed_qkv_slices)
{
	const int64_t B = 2, H = 3, L = self->emu ? 19 : 77, D = 32;
	const int64_t qkv_s[4] = { L * 3 * H * D, D, 3 * H * D, 1 }, o_s[4] = { L * H * D, D, H * D, 1 };
	const size_t n = (size_t)(B * L * 3 * H * D), on = (size_t)(B * L * H * D);
	float *qkv = malloc(n * sizeof(float)), *oh = malloc(on * sizeof(float));
	float *od = malloc(on * sizeof(float)), lh[2 * 3 * 77], ld[2 * 3 * 77];
	ape_tensor q, k, v, o;
	ape_dtensor dq, dk, dv, dout, dl;
	ape_buffer *buf = NULL, *ob = NULL, *lb = NULL;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	ape_rng rng;

	ASSERT_TRUE(qkv && oh && od);
	ape_rng_init(&rng, _metadata->name);
	for (size_t i = 0; i < n; i++)
		qkv[i] = (float)ape_rng_normal(&rng);
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.4f;
	desc.beta.value = 0.04f;
	desc.gamma.value = 0.04f;
	desc.lambda.value = 0.1f;
	ape_tensor_init(&q, qkv, APE_F32, B, H, L, D);
	q.strides[0] = qkv_s[0], q.strides[1] = qkv_s[1], q.strides[2] = qkv_s[2], q.strides[3] = 1;
	k = q;
	k.data = qkv + H * D;
	v = q;
	v.data = qkv + 2 * H * D;
	ape_tensor_init(&o, oh, APE_F32, B, H, L, D);
	memcpy(o.strides, o_s, sizeof(o_s));
	ASSERT_EQ(0, ape_attention_forward(self->dev, &desc, &q, &k, &v, &o, lh, NULL))
	TH_LOG("%s", ape_last_error());

	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, n * sizeof(float), &buf));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, on * sizeof(float), &ob));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, sizeof(ld), &lb));
	ASSERT_EQ(0, ape_buffer_write(qu, buf, 0, qkv, n * sizeof(float)));
	ape_dtensor_init(&dq, buf, 0, APE_F32, B, H, L, D);
	memcpy(dq.strides, qkv_s, sizeof(qkv_s));
	dk = dq;
	dk.byte_offset = (uint64_t)(H * D) * sizeof(float);
	dv = dq;
	dv.byte_offset = (uint64_t)(2 * H * D) * sizeof(float);
	ape_dtensor_init(&dout, ob, 0, APE_F32, B, H, L, D);
	memcpy(dout.strides, o_s, sizeof(o_s));
	ape_dtensor_init(&dl, lb, 0, APE_F32, B, H, L, 1);
	ASSERT_EQ(0, ape_attention_enqueue(qu, &desc, &dq, &dk, &dv, &dout, &dl))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_buffer_read(qu, od, ob, 0, on * sizeof(float)));
	ASSERT_EQ(0, ape_buffer_read(qu, ld, lb, 0, (size_t)(B * H * L) * sizeof(float)));
	ASSERT_EQ(0, ape_queue_synchronize(qu)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(oh, od, on * sizeof(float)));
	EXPECT_EQ(0, memcmp(lh, ld, (size_t)(B * H * L) * sizeof(float)));
	ape_queue_destroy(qu);
	ape_buffer_free(buf);
	ape_buffer_free(ob);
	ape_buffer_free(lb);
	free(qkv);
	free(oh);
	free(od);
}

/* No key at all: O = 0 and LSE = -inf, through the queue; no query: nothing is written. */
TEST_F(resident, empty_shapes)
{
	float in[8 * 4] = { 0 }, out[2 * 3 * 4], lse[2 * 3];
	ape_buffer *bi = NULL, *bo = NULL, *bl = NULL;
	ape_dtensor q, k, o, l;
	ape_queue *qu = NULL;
	ape_attn_desc desc;

	ape_attn_desc_init(&desc);
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, sizeof(in), &bi));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, sizeof(out), &bo));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, sizeof(lse), &bl));
	for (size_t i = 0; i < sizeof(out) / sizeof(out[0]); i++)
		out[i] = NAN;
	for (size_t i = 0; i < 6; i++)
		lse[i] = NAN;
	ASSERT_EQ(0, ape_buffer_write(qu, bo, 0, out, sizeof(out)));
	ASSERT_EQ(0, ape_buffer_write(qu, bl, 0, lse, sizeof(lse)));
	ape_dtensor_init(&q, bi, 0, APE_F32, 1, 2, 3, 4);
	ape_dtensor_init(&k, bi, 0, APE_F32, 1, 1, 0, 4);
	ape_dtensor_init(&o, bo, 0, APE_F32, 1, 2, 3, 4);
	ape_dtensor_init(&l, bl, 0, APE_F32, 1, 2, 3, 1);
	ASSERT_EQ(0, ape_attention_enqueue(qu, &desc, &q, &k, &k, &o, &l)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_buffer_read(qu, out, bo, 0, sizeof(out)));
	ASSERT_EQ(0, ape_buffer_read(qu, lse, bl, 0, sizeof(lse)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	for (int i = 0; i < 24; i++)
		EXPECT_EQ(0.0f, out[i]);
	for (int i = 0; i < 6; i++)
		EXPECT_TRUE(isinf(lse[i]) && lse[i] < 0);
	/* Lq = 0: nothing at all */
	for (int i = 0; i < 24; i++)
		out[i] = 7.0f;
	ASSERT_EQ(0, ape_buffer_write(qu, bo, 0, out, sizeof(out)));
	q.shape[2] = 0;
	o.shape[2] = 0;
	l.shape[2] = 0;
	k.shape[2] = 3;
	ASSERT_EQ(0, ape_attention_enqueue(qu, &desc, &q, &k, &k, &o, &l)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_buffer_read(qu, out, bo, 0, sizeof(out)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	for (int i = 0; i < 24; i++)
		EXPECT_EQ(7.0f, out[i]);
	ape_queue_destroy(qu);
	ape_buffer_free(bi);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
}

/* A gappy view of [B, H, L, d] elements at element `off` of a buffer: rows `gap` elements
 * apart beyond d, heads and batches a few more apart; the elements it spans. */
static int64_t gappy_view(int64_t off, int64_t H, int64_t L, int64_t d, int64_t gap,
			  int64_t B, int64_t s[4])
{
	s[3] = 1;
	s[2] = d + gap;
	s[1] = L * s[2] + 5;
	s[0] = H * s[1] + 3;
	return off + B * s[0];
}

/* Whether element e of the buffer is one of view s's at off ([B, H, L, d]). */
static bool in_view(int64_t e, int64_t off, const int64_t s[4], const int64_t shape[4])
{
	for (int64_t b = 0; b < shape[0]; b++)
		for (int64_t h = 0; h < shape[1]; h++)
			for (int64_t i = 0; i < shape[2]; i++) {
				const int64_t row = off + b * s[0] + h * s[1] + i * s[2];

				if (e >= row && e < row + shape[3])
					return true;
			}
	return false;
}

/*
 * No key (Lk = 0), every output a gappy view (O rows apart, heads and batches further, at an
 * offset; LSE, entropy and mean distance likewise, in one buffer): each element of the views
 * gets its value (O = 0 in its dtype, LSE = -inf, ENT = MD = 0) and no other byte of either
 * buffer changes. On a device with working scratch and copy_view (the capability
 * resident_backward) each output takes one strided command; without it (taken by the wrapper)
 * the rows are written one by one, to the same bytes.
 */
TEST_F(resident, empty_rows_write_only_their_elements)
{
	enum { B = 2, H = 3, L = 5, D = 8 };
	static const ape_dtype types[] = { APE_F32, APE_F16 };
	const int64_t oshape[4] = { B, H, L, D }, rshape[4] = { B, H, L, 1 };
	const bool diag = self->dev->caps.diag && self->dev->caps.diag_views;
	int64_t os[4], rs[4], roff[3];
	const int64_t on = gappy_view(11, H, L, D, 3, B, os) + 13;
	int64_t rn = 0;

	for (int t = 0; t < 3; t++) /* lse, entropy, mean_distance: one after another */
		rn = gappy_view(roff[t] = rn + 2, H, L, 1, 1, B, rs) + 1;
	for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++)
		for (int hide = 0; hide < 2; hide++) {
			const ape_dtype dt = types[ti];
			const size_t esz = ape_dtype_size(dt);
			const bool strided = self->dev->caps.resident_backward && !hide;
			unsigned char *ob = malloc((size_t)on * esz);
			float *rb = malloc((size_t)rn * sizeof(float));
			ape_buffer *bi = NULL, *bo = NULL, *br = NULL;
			ape_dtensor q, k, o, l, e, m;
			struct wrap_counts c;
			ape_queue *qu = NULL;
			ape_attn_desc desc;
			int64_t bad = 0;

			ASSERT_NE(NULL, ob);
			ASSERT_NE(NULL, rb);
			wrap_install(self->dev, hide ? WRAP_NO_RESIDENT_BWD : 0);
			ape_attn_desc_init(&desc);
			ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
			ASSERT_EQ(0, ape_buffer_alloc(self->dev, B * H * L * D * esz, &bi));
			ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)on * esz, &bo));
			ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)rn * sizeof(float), &br));
			memset(ob, 0x5a, (size_t)on * esz);
			memset(rb, 0x5a, (size_t)rn * sizeof(float));
			ASSERT_EQ(0, ape_buffer_write(qu, bo, 0, ob, (size_t)on * esz));
			ASSERT_EQ(0, ape_buffer_write(qu, br, 0, rb, (size_t)rn * sizeof(float)));
			ape_dtensor_init(&q, bi, 0, dt, B, H, L, D);
			ape_dtensor_init(&k, bi, 0, dt, B, H, 0, D);
			ape_dtensor_init(&o, bo, 11 * esz, dt, B, H, L, D);
			memcpy(o.strides, os, sizeof(os));
			ape_dtensor_init(&l, br, (uint64_t)roff[0] * 4, APE_F32, B, H, L, 1);
			memcpy(l.strides, rs, sizeof(rs));
			e = l;
			e.byte_offset = (uint64_t)roff[1] * 4;
			m = l;
			m.byte_offset = (uint64_t)roff[2] * 4;
			wrap_reset();
			ASSERT_EQ(0, ape_attention_enqueue_diag(qu, &desc, &q, &k, &k, &o, &l,
							       diag ? &e : NULL, diag ? &m : NULL))
			TH_LOG("%s", ape_last_error());
			c = wrap_get();
			ASSERT_EQ(0, ape_buffer_read(qu, ob, bo, 0, (size_t)on * esz));
			ASSERT_EQ(0, ape_buffer_read(qu, rb, br, 0, (size_t)rn * sizeof(float)));
			ASSERT_EQ(0, ape_queue_synchronize(qu)) TH_LOG("%s", ape_last_error());
			for (int64_t x = 0; x < on; x++) {
				const unsigned char *b = ob + (size_t)x * esz;
				unsigned char want = in_view(x, 11, os, oshape) ? 0 : 0x5a;

				for (size_t i = 0; i < esz; i++)
					bad += b[i] != want;
			}
			for (int64_t x = 0; x < rn; x++) {
				uint32_t bits, want = 0x5a5a5a5au;

				memcpy(&bits, &rb[x], 4);
				if (in_view(x, roff[0], rs, rshape))
					want = 0xff800000u; /* -inf */
				else if (diag && (in_view(x, roff[1], rs, rshape) ||
						  in_view(x, roff[2], rs, rshape)))
					want = 0;
				bad += bits != want;
			}
			EXPECT_EQ(0, bad) TH_LOG("%s, %s: bytes or elements wrong", ape_dtype_name(dt),
						 strided ? "strided" : "row by row");
			if (strided) { /* O, LSE, ENT, MD: one command each */
				EXPECT_EQ(diag ? 4u : 2u, c.calls[WRAP_COPY_VIEW]);
				EXPECT_EQ(0u, c.calls[WRAP_COPY_H2D]);
			} else {
				EXPECT_EQ(0u, c.calls[WRAP_COPY_VIEW]);
				EXPECT_EQ((uint64_t)(2 * B * H * L), c.calls[WRAP_COPY_H2D]);
			}
			ape_queue_destroy(qu);
			ape_buffer_free(bi);
			ape_buffer_free(bo);
			ape_buffer_free(br);
			wrap_remove();
			free(ob);
			free(rb);
		}
}

/* ---- refusals: each before anything is enqueued, its message naming the argument */

struct bad_case {
	const char *what, *msg;
};

TEST_F(resident, refusals_name_the_argument)
{
	const int64_t B = 1, H = 2, L = 5, D = 8, n = B * H * L * D;
	ape_buffer *bi = NULL, *bo = NULL, *bl = NULL, *foreign = NULL;
	ape_dtensor q, k, v, o, l, *t;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	float sentinel[40];

	ape_attn_desc_init(&desc);
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)n * 3 * sizeof(float), &bi));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)n * sizeof(float), &bo));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)(B * H * L) * sizeof(float), &bl));
	for (int i = 0; i < 40; i++)
		sentinel[i] = 5.0f;
	ASSERT_EQ(0, ape_buffer_write(qu, bo, 0, sentinel, sizeof(sentinel)));

#define RESET()                                                                                    \
	do {                                                                                       \
		ape_dtensor_init(&q, bi, 0, APE_F32, B, H, L, D);                                  \
		ape_dtensor_init(&k, bi, (uint64_t)n * 4, APE_F32, B, H, L, D);                    \
		ape_dtensor_init(&v, bi, (uint64_t)n * 8, APE_F32, B, H, L, D);                    \
		ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);                                  \
		ape_dtensor_init(&l, bl, 0, APE_F32, B, H, L, 1);                                  \
	} while (0)
#define REFUSED(code, text)                                                                        \
	do {                                                                                       \
		EXPECT_EQ(code, ape_attention_enqueue(qu, &desc, &q, &k, &v, &o, &l));             \
		EXPECT_NE(NULL, strstr(ape_last_error(), text))                                    \
		TH_LOG("want \"%s\" in \"%s\"", text, ape_last_error());                           \
		RESET();                                                                           \
	} while (0)

	RESET();
	ASSERT_EQ(0, ape_attention_enqueue(qu, &desc, &q, &k, &v, &o, &l)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	ASSERT_EQ(0, ape_buffer_write(qu, bo, 0, sentinel, sizeof(sentinel)));

	k.byte_offset = (uint64_t)n * 4 * 3 - 4; /* runs past the end */
	REFUSED(APE_EINVAL, "k: offset");
	v.byte_offset = 2; /* not a multiple of 4 */
	REFUSED(APE_EINVAL, "v->byte_offset = 2");
	q.byte_offset = (uint64_t)n * 4 * 3 + 4;
	REFUSED(APE_EINVAL, "q->byte_offset");
	q.strides[0] = n, q.strides[1] = L * D, q.strides[2] = D, q.strides[3] = 2;
	REFUSED(APE_EINVAL, "q->strides[3] = 2");
	k.strides[0] = n, k.strides[1] = L * D * 4, k.strides[2] = D, k.strides[3] = 1;
	REFUSED(APE_EINVAL, "k: offset");
	o.strides[0] = n, o.strides[1] = D, o.strides[2] = D, o.strides[3] = 1; /* rows collide */
	REFUSED(APE_EINVAL, "o->strides");
	o.buf = bi; /* O over Q */
	REFUSED(APE_EINVAL, "overlaps");
	l.buf = bo; /* LSE inside O */
	REFUSED(APE_EINVAL, "overlaps");
	l.shape[3] = 2;
	REFUSED(APE_EINVAL, "lse->shape[3]");
	l.dtype = APE_F16;
	REFUSED(APE_EINVAL, "lse->dtype");
	q.buf = NULL;
	REFUSED(APE_EINVAL, "q->buf = NULL");
	o.dtype = APE_BF16;
	REFUSED(APE_EINVAL, "o->dtype");
	v.shape[1] = 3;
	REFUSED(APE_EINVAL, "v->shape[1]");
	desc.lambda.value = -1;
	REFUSED(APE_EINVAL, "lambda");
	desc.lambda.value = 0;
	t = NULL;
	EXPECT_EQ(APE_EINVAL, ape_attention_enqueue(qu, &desc, t, &k, &v, &o, &l));
	EXPECT_NE(NULL, strstr(ape_last_error(), "q = NULL"));
	EXPECT_EQ(APE_EINVAL, ape_attention_enqueue(NULL, &desc, &q, &k, &v, &o, &l));
	EXPECT_NE(NULL, strstr(ape_last_error(), "queue = NULL"));
	if (self->dev != self->ref) {
		ASSERT_EQ(0, ape_buffer_alloc(self->ref, 4096, &foreign));
		k.buf = foreign;
		REFUSED(APE_EINVAL, "k->buf is a buffer of ref:0");
	}
	/* none of it ran: O still holds the sentinel */
	ASSERT_EQ(0, ape_buffer_read(qu, sentinel, bo, 0, sizeof(sentinel)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	for (int i = 0; i < 40; i++)
		EXPECT_EQ(5.0f, sentinel[i]);
#undef REFUSED
#undef RESET
	ape_queue_destroy(qu);
	ape_buffer_free(bi);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
	ape_buffer_free(foreign);
}

/* The buffer and queue calls check their own arguments. */
TEST_F(resident, buffer_and_queue_checks)
{
	ape_buffer *b = (ape_buffer *)1;
	ape_queue *qu = NULL;
	char host[64], src[64];
	void *c = (void *)1, *d = (void *)1;

	EXPECT_EQ(APE_EINVAL, ape_buffer_alloc(self->dev, 0, &b));
	EXPECT_EQ(NULL, b);
	EXPECT_NE(NULL, strstr(ape_last_error(), "bytes = 0"));
	EXPECT_EQ(APE_EINVAL, ape_buffer_alloc(NULL, 8, &b));
	EXPECT_EQ(APE_EINVAL, ape_buffer_alloc(self->dev, 8, NULL));
	EXPECT_EQ(APE_EINVAL, ape_buffer_wrap_host(self->dev, NULL, 8, &b));
	EXPECT_EQ(APE_EINVAL, ape_buffer_wrap_cuda(self->dev, 0, 8, &b));
	EXPECT_EQ(APE_EINVAL, ape_buffer_wrap_opencl(self->dev, NULL, &b));
	EXPECT_EQ(APE_EINVAL, ape_queue_synchronize(NULL));
	EXPECT_EQ(APE_EINVAL, ape_queue_create(self->dev, NULL));
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	EXPECT_EQ(self->dev, ape_queue_device(qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, 64, &b));
	EXPECT_EQ(64u, ape_buffer_size(b));
	EXPECT_EQ(self->dev, ape_buffer_device(b));
	EXPECT_EQ(APE_EINVAL, ape_buffer_write(qu, b, 32, host, 33));
	EXPECT_NE(NULL, strstr(ape_last_error(), "offset = 32, bytes = 33"));
	EXPECT_EQ(APE_EINVAL, ape_buffer_read(qu, host, b, 65, 0));
	EXPECT_EQ(APE_EINVAL, ape_buffer_read(NULL, host, b, 0, 1));
	EXPECT_EQ(APE_EINVAL, ape_buffer_read(qu, NULL, b, 0, 1));
	memset(src, 3, sizeof(src)); /* the write reads src until the queue is synchronised */
	memset(host, 0, sizeof(host));
	ASSERT_EQ(0, ape_buffer_write(qu, b, 0, src, sizeof(src)));
	ASSERT_EQ(0, ape_buffer_read(qu, host, b, 0, sizeof(host)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	EXPECT_EQ(3, host[63]);
	/* a queue wrapper of the wrong API */
	ape_queue_destroy(qu);
	qu = (ape_queue *)1;
	EXPECT_EQ(APE_ENOTSUP, ape_queue_wrap_cuda(self->ref, NULL, &qu));
	EXPECT_EQ(NULL, qu);
	EXPECT_EQ(0, ape_device_native(self->ref, &c, &d));
	EXPECT_EQ(NULL, c);
	EXPECT_EQ(NULL, d);
	EXPECT_EQ(APE_EINVAL, ape_device_native(NULL, &c, &d));
	ape_buffer_free(b);
	ape_queue_destroy(NULL);
	ape_buffer_free(NULL);
	EXPECT_EQ(0u, ape_buffer_size(NULL));
}

/* Where the device computes on host memory (the reference, OpenCL CPU devices), host arrays
 * are wrapped as they are, and a host call copies no input (its outputs come back once, from
 * the buffers the kernels wrote, when everything succeeded); elsewhere wrapping is refused. */
TEST_F(resident, host_memory_in_place)
{
	test_problem a, b;
	ape_buffer *w = NULL;
	ape_stats st;
	float x[16];
	ape_rng rng;
	int ret = ape_buffer_wrap_host(self->dev, x, sizeof(x), &w);

	if (ret == APE_ENOTSUP) {
		EXPECT_NE(NULL, strstr(ape_last_error(), "ape_buffer_wrap_host"));
		SKIP(return, "%s computes on its own memory: %s", variant->backend, ape_last_error());
	}
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(sizeof(x), ape_buffer_size(w));
	ape_buffer_free(w);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 6; c++) {
		char what[256];

		ASSERT_EQ(0, test_problem_random(&a, &rng, TEST_PROBLEM_NO_LSE_NULL));
		ASSERT_EQ(0, test_problem_clone(&b, &a));
		test_problem_describe(&a, what, sizeof(what));
		ape_stats_init(&st);
		ASSERT_EQ(0, test_problem_run_stats(&a, self->dev, &st)) TH_LOG("%s", ape_last_error());
		if (a.q.t.strides[3] <= 1 && a.k.t.strides[3] <= 1 && a.v.t.strides[3] <= 1) {
			const uint64_t rows = (uint64_t)a.rows;
			const uint64_t osz = ape_dtype_size(a.o.t.dtype);

			EXPECT_EQ(0u, st.bytes_to_device) TH_LOG("%s", what);
			/* O, LSE and the pair counts of the statistics, each row once */
			if (a.rows && a.k.t.shape[2])
				EXPECT_EQ(rows * ((uint64_t)a.q.t.shape[3] * osz + 4 + 8),
					  st.bytes_from_device)
			TH_LOG("%s", what);
		}
		if (a.rows && a.k.t.shape[2])
			EXPECT_EQ(1u, st.chunks);
		/* the inputs copied as a discrete device needs them: the same results */
		{
			ape_exec_options o;

			ape_exec_options_init(&o);
			o.chunk_q = 1 << 20;
			o.chunk_k = 1 << 20;
			o.flags = APE_EXEC_COPY_INPUTS;
			test_tensor_poison(&b.o.t);
			ASSERT_EQ(0, ape_attention_forward_ex(&self->dev, 1, &o, &b.desc, &b.q.t, &b.k.t,
							      &b.v.t, &b.o.t, b.lse, NULL));
			EXPECT_EQ(0, differing(&a, &b)) TH_LOG("%s", what);
		}
		test_problem_free(&a);
		test_problem_free(&b);
	}
}

/* A KV cache fed from device tensors ([B, L, Hkv, D] in one buffer, in pieces that cross block
 * borders) attends exactly as one fed the same tokens from the host. */
TEST_F(resident, kv_cache_appends_from_device)
{
	const int64_t B = 2, Hkv = 2, H = 4, D = 16, L = self->emu ? 37 : 301, Lq = 3;
	const size_t n = (size_t)(B * L * Hkv * D);
	float *kh = malloc(n * 4), *vh = malloc(n * 4), *q = malloc((size_t)(B * H * Lq * D) * 4);
	float *o1 = malloc((size_t)(B * H * Lq * D) * 4), *o2 = malloc((size_t)(B * H * Lq * D) * 4);
	ape_kv_cache *c1 = NULL, *c2 = NULL;
	ape_kv_cache_options ko;
	ape_buffer *bk = NULL, *bv = NULL;
	ape_queue *qu = NULL;
	ape_tensor tk, tv, tq, to;
	ape_attn_desc desc;
	ape_kv_cache_info info;
	ape_rng rng;
	const int64_t s[4] = { L * Hkv * D, D, Hkv * D, 1 };

	ASSERT_TRUE(kh && vh && q && o1 && o2);
	ape_rng_init(&rng, _metadata->name);
	for (size_t i = 0; i < n; i++) {
		kh[i] = (float)ape_rng_normal(&rng);
		vh[i] = (float)ape_rng_normal(&rng);
	}
	for (int64_t i = 0; i < B * H * Lq * D; i++)
		q[i] = (float)ape_rng_normal(&rng);
	ape_kv_cache_options_init(&ko);
	ko.B = B, ko.Hkv = Hkv, ko.H = H, ko.D = D, ko.dtype = APE_F32;
	ko.block_tokens = 16, ko.capacity_tokens = L, ko.append_chunk = 50;
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &c1)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &c2)) TH_LOG("%s", ape_last_error());
	ape_tensor_init(&tk, kh, APE_F32, B, Hkv, L, D);
	memcpy(tk.strides, s, sizeof(s));
	tv = tk;
	tv.data = vh;
	ASSERT_EQ(0, ape_kv_cache_append(c1, &tk, &tv)) TH_LOG("%s", ape_last_error());

	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, n * 4, &bk));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, n * 4, &bv));
	ASSERT_EQ(0, ape_buffer_write(qu, bk, 0, kh, n * 4));
	ASSERT_EQ(0, ape_buffer_write(qu, bv, 0, vh, n * 4));
	for (int64_t t0 = 0, step = 1; t0 < L; t0 += step, step = step * 3 + 1) {
		const int64_t m = L - t0 < step ? L - t0 : step;
		ape_dtensor dk, dv;

		ape_dtensor_init(&dk, bk, (uint64_t)(t0 * Hkv * D) * 4, APE_F32, B, Hkv, m, D);
		memcpy(dk.strides, s, sizeof(s));
		dv = dk;
		dv.buf = bv;
		ASSERT_EQ(0, ape_kv_cache_append_device(c2, qu, &dk, &dv)) TH_LOG("%s", ape_last_error());
	}
	ASSERT_EQ(0, ape_kv_cache_get_info(c2, &info));
	EXPECT_EQ(L, info.tokens);
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.3f;
	desc.lambda.value = 0.1f;
	ape_tensor_init(&tq, q, APE_F32, B, H, Lq, D);
	ape_tensor_init(&to, o1, APE_F32, B, H, Lq, D);
	ASSERT_EQ(0, ape_kv_cache_attend(c1, &desc, &tq, &to, NULL, NULL)) TH_LOG("%s", ape_last_error());
	to.data = o2;
	ASSERT_EQ(0, ape_kv_cache_attend(c2, &desc, &tq, &to, NULL, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(o1, o2, (size_t)(B * H * Lq * D) * 4));
	{ /* refusals */
		ape_dtensor dk;

		ape_dtensor_init(&dk, bk, n * 4 - 4, APE_F32, B, Hkv, 1, D);
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_append_device(c2, qu, &dk, &dk));
		EXPECT_NE(NULL, strstr(ape_last_error(), "k: offset"));
		ape_dtensor_init(&dk, bk, 0, APE_F16, B, Hkv, 1, D);
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_append_device(c2, qu, &dk, &dk));
		EXPECT_EQ(APE_EINVAL, ape_kv_cache_append_device(c2, NULL, &dk, &dk));
		ape_dtensor_init(&dk, bk, 0, APE_F32, B, Hkv, info.capacity_tokens - L + 1, D);
		memcpy(dk.strides, s, sizeof(s));
		EXPECT_EQ(APE_ENOMEM, ape_kv_cache_append_device(c2, qu, &dk, &dk));
		EXPECT_NE(NULL, strstr(ape_last_error(), "do not fit"));
	}
	ape_queue_destroy(qu);
	ape_buffer_free(bk);
	ape_buffer_free(bv);
	ape_kv_cache_destroy(c1);
	ape_kv_cache_destroy(c2);
	free(kh);
	free(vh);
	free(q);
	free(o1);
	free(o2);
}

/* Scratch over the budget: the executor's resident path splits the query rows into launches on
 * views moved along L (exec/resident.c), and the result is the one launch's, bit for bit; a
 * budget too small for one row is refused before anything is enqueued. */
TEST_F(resident, query_rows_split_under_the_budget)
{
	const int64_t B = 2, H = 4, Hkv = 2, L = self->emu ? 23 : 97, D = 32;
	const size_t nq = (size_t)(B * H * L * D), nk = (size_t)(B * Hkv * L * D);
	float *x = malloc((nq + 2 * nk) * 4), *o1 = malloc(nq * 4), *o2 = malloc(nq * 4);
	float l1[2 * 4 * 97], l2[2 * 4 * 97];
	ape_buffer *bin = NULL, *bo = NULL, *bl = NULL;
	ape_dtensor q, k, v, o, l;
	struct ape__resident_req r;
	struct ape__problem p;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	int64_t rows = 0;
	ape_rng rng;

	ASSERT_TRUE(x && o1 && o2);
	ape_rng_init(&rng, _metadata->name);
	for (size_t i = 0; i < nq + 2 * nk; i++)
		x[i] = (float)ape_rng_normal(&rng);
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.3f;
	desc.beta.value = 0.03f;
	desc.lambda.value = 0.1f;
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (nq + 2 * nk) * 4, &bin));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, nq * 4, &bo));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, sizeof(l1), &bl));
	ASSERT_EQ(0, ape_buffer_write(qu, bin, 0, x, (nq + 2 * nk) * 4));
	ape_dtensor_init(&q, bin, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&k, bin, nq * 4, APE_F32, B, Hkv, L, D);
	ape_dtensor_init(&v, bin, (nq + nk) * 4, APE_F32, B, Hkv, L, D);
	ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&l, bl, 0, APE_F32, B, H, L, 1);
	ASSERT_EQ(0, ape_attention_enqueue(qu, &desc, &q, &k, &v, &o, &l));
	ASSERT_EQ(0, ape_buffer_read(qu, o1, bo, 0, nq * 4));
	ASSERT_EQ(0, ape_buffer_read(qu, l1, bl, 0, (size_t)(B * H * L) * 4));
	ASSERT_EQ(0, ape_queue_synchronize(qu));

	memset(&r, 0, sizeof(r));
	ASSERT_EQ(0, ape__check_resident("test", self->dev, &desc, &q, &k, &v, &o, &l, &p, r.buf,
					 r.view));
	r.fn = "test";
	r.dev = self->dev;
	r.q = qu->q;
	r.p = &p;
	/* a budget for about a third of the rows: the plan halves until it fits */
	{
		struct ape__resident_req one = r;
		int64_t all;

		one.budget = UINT64_MAX;
		ASSERT_EQ(0, ape__resident_plan(&one, &all));
		EXPECT_EQ(L, all);
	}
	r.budget = 1; /* nothing fits, unless the backend needs no scratch (the reference) */
	if (ape__resident_plan(&r, &rows)) {
		EXPECT_NE(NULL, strstr(ape_last_error(), "of 1 query row and"))
			TH_LOG("%s", ape_last_error());
	} else {
		EXPECT_EQ(L, rows);
	}
	for (int64_t n = 1; n <= L; n = n * 3 + 1) {
		ASSERT_EQ(0, ape__resident_enqueue(&r, n)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_buffer_read(qu, o2, bo, 0, nq * 4));
		ASSERT_EQ(0, ape_buffer_read(qu, l2, bl, 0, (size_t)(B * H * L) * 4));
		ASSERT_EQ(0, ape_queue_synchronize(qu));
		/* kernels group query rows into tiles, and the tiles' key walks (the diagonal, the
		 * skip decisions) follow the rows a launch starts at: the same within the spec's
		 * tolerance, bit for bit only where a row is computed alone (the reference) */
		if (self->dev == self->ref) {
			EXPECT_EQ(0, memcmp(o1, o2, nq * 4)) TH_LOG("%lld rows", (long long)n);
			EXPECT_EQ(0, memcmp(l1, l2, (size_t)(B * H * L) * 4));
		}
		for (size_t e = 0; e < nq; e++) {
			ASSERT_LE(fabs(o1[e] - o2[e]), 8 * test_tol_o(APE_F32))
			TH_LOG("%lld rows per launch: element %zu", (long long)n, e);
		}
		for (int64_t e = 0; e < B * H * L; e++) {
			ASSERT_LE(fabs(l1[e] - l2[e]), test_tol_lse(APE_F32) * fmax(1, fabs(l1[e])));
		}
	}
	ape__problem_fini(&p);
	ape_queue_destroy(qu);
	ape_buffer_free(bin);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
	free(x);
	free(o1);
	free(o2);
}

/* ---- the diagnostics on device tensors (ape_attention_enqueue_diag()) */

/* Whether dev computes the diagnostics on device tensors (struct ape__dev_caps). */
static bool diag_on_device(const ape_device *dev)
{
	return dev->caps.diag && dev->caps.diag_views;
}

/* Floats that differ in bits (NaN equal to NaN). */
static int64_t floats_differing(const float *a, const float *b, size_t n)
{
	int64_t bad = 0;

	for (size_t i = 0; i < n; i++)
		bad += !(a[i] == b[i] || (isnan(a[i]) && isnan(b[i])));
	return bad;
}

/* The largest error of ENT and MD against tp's naive evaluation, in units of their tolerance
 * scales (docs/diagnostics.md): ENT relative to max(1, |LSE|), MD to max(1, the row's largest
 * |n|). */
static double diag_err_naive(const test_problem *tp, const float *ent, const float *md)
{
	double e = 0;

	for (size_t i = 0; i < tp->rows; i++) {
		const double l = tp->naive_lse[i];
		const double se = fmax(1, isfinite(l) ? fabs(l) : 1);
		const double sm = fmax(1, tp->naive_mdmax[i]);

		if (isnan(tp->naive_ent[i]) != isnan(ent[i]) || isnan(tp->naive_md[i]) != isnan(md[i]))
			return INFINITY;
		if (!isnan(ent[i]))
			e = fmax(e, fabs(ent[i] - tp->naive_ent[i]) / se);
		if (!isnan(md[i]))
			e = fmax(e, fabs(md[i] - tp->naive_md[i]) / sm);
	}
	return e;
}

/* "cuda:0" and such: what an APE_ENOTSUP message must name. */
static void dev_name(const ape_device *dev, char *buf, size_t len)
{
	snprintf(buf, len, "%s:%d", dev->info.backend, dev->info.backend_index);
}

/*
 * Random problems (every dtype, GQA, layouts, causal and not, offsets, strided [B, L, H, D]
 * inputs and O) at byte offsets, the diagnostics in contiguous and in gapped [B, Lq, H] layouts:
 * O, LSE, ENT and MD equal to ape_attention_forward_diag() on the same device, bit for bit on
 * the reference and OpenCL; on a backend that does not compute the diagnostics on device
 * tensors, APE_ENOTSUP naming the device; on one that does and is neither (CUDA, on the
 * emulator or a GPU), within the spec's tolerance of the naive evaluation. Asks the backend, so
 * it checks values as soon as a backend declares them.
 */
TEST_F(resident, enqueue_diag_equals_host_diag)
{
	const int cases = self->emu ? 4 : ape_test_slow() ? 4 : 20;
	const bool exact = !strcmp(variant->backend, "ref") || !strcmp(variant->backend, "opencl");
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		test_problem a, b;
		struct rdiag d = { .want_ent = true, .want_md = true, .gappy = c % 2 == 1 };
		float *ea, *ma;
		char what[256], name[64];
		int ret;

		ASSERT_EQ(0, test_problem_random(&a, &rng, 0));
		ASSERT_EQ(0, test_problem_clone(&b, &a));
		test_problem_describe(&a, what, sizeof(what));
		ea = malloc(a.rows * 4 + 4);
		ma = malloc(a.rows * 4 + 4);
		d.ent = malloc(a.rows * 4 + 4);
		d.md = malloc(a.rows * 4 + 4);
		ASSERT_TRUE(ea && ma && d.ent && d.md);
		ret = run_resident_diag(&b, self->dev, (size_t)(c % 4) * 4, &d);
		if (!diag_on_device(self->dev)) {
			dev_name(self->dev, name, sizeof(name));
			EXPECT_EQ(APE_ENOTSUP, ret);
			EXPECT_NE(NULL, strstr(ape_last_error(), name)) TH_LOG("%s", ape_last_error());
			EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue_diag"));
		} else {
			ASSERT_EQ(0, ret) TH_LOG("%s: %s", what, ape_last_error());
			EXPECT_EQ(0, d.dirty) TH_LOG("%s: written outside the outputs", what);
			if (b.strided)
				EXPECT_EQ(0, test_problem_padding_intact(&b))
				TH_LOG("%s: padding written", what);
		}
		if (diag_on_device(self->dev) && exact) {
			test_tensor_poison(&a.o.t);
			ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &a.desc, &a.q.t,
								&a.k.t, &a.v.t, &a.o.t, a.lse, ea,
								ma, NULL))
			TH_LOG("%s: %s", what, ape_last_error());
			EXPECT_EQ(0, differing(&a, &b)) TH_LOG("case %d, %s: O or LSE", c, what);
			EXPECT_EQ(0, floats_differing(ea, d.ent, a.rows)) TH_LOG("case %d, %s: ENT", c, what);
			EXPECT_EQ(0, floats_differing(ma, d.md, a.rows)) TH_LOG("case %d, %s: MD", c, what);
		} else if (diag_on_device(self->dev)) {
			ASSERT_EQ(0, test_problem_naive(&b));
			EXPECT_LE(diag_err_naive(&b, d.ent, d.md), test_tol_lse(b.q.t.dtype))
			TH_LOG("case %d, %s", c, what);
		}
		free(ea);
		free(ma);
		free(d.ent);
		free(d.md);
		test_problem_free(&a);
		test_problem_free(&b);
	}
}

/* Each output optional: entropy alone, mean distance alone, and either without LSE; the ones
 * given equal the host call's, bit for bit, in a gapped layout whose gaps stay untouched; a
 * loose skip_tol is tightened as in the host call (the same result as at 2^-24). Also Lk = 0
 * (ENT = MD = 0 in every row) and Lq = 0 (nothing written). */
TEST_F(resident, enqueue_diag_outputs_each_optional)
{
	const test_problem_shape sh = { 2, 3, 1, 37, 53, 32 };
	struct {
		bool ent, md, lse;
		double skip_tol;
	} const cases[] = {
		{ true, false, true, 0x1p-24 }, { false, true, false, 0x1p-24 },
		{ true, false, false, 1e-2 },  { true, true, false, 1e-2 },
	};
	test_problem a;
	ape_rng rng;
	float *ea, *ma;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors (the refusal: "
			     "enqueue_diag_equals_host_diag)", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&a, &rng, &sh, APE_F32, false));
	test_problem_set_params(&a, 0.4, 0.04, 0.04, 0.1); /* decays: far keys are skipped */
	ea = malloc(a.rows * 4);
	ma = malloc(a.rows * 4);
	ASSERT_TRUE(ea && ma);
	ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &a.desc, &a.q.t, &a.k.t,
						&a.v.t, &a.o.t, a.lse, ea, ma, NULL));
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		test_problem b;
		struct rdiag d = { .want_ent = cases[c].ent, .want_md = cases[c].md, .gappy = true };

		ASSERT_EQ(0, test_problem_clone(&b, &a));
		if (!cases[c].lse) {
			free(b.lse);
			b.lse = NULL;
		}
		b.desc.skip_tol = cases[c].skip_tol;
		d.ent = malloc(a.rows * 4);
		d.md = malloc(a.rows * 4);
		ASSERT_TRUE(d.ent && d.md);
		ASSERT_EQ(0, run_resident_diag(&b, self->dev, 8, &d)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, d.dirty);
		if (cases[c].ent)
			EXPECT_EQ(0, floats_differing(ea, d.ent, a.rows)) TH_LOG("case %zu: ENT", c);
		if (cases[c].md)
			EXPECT_EQ(0, floats_differing(ma, d.md, a.rows)) TH_LOG("case %zu: MD", c);
		if (b.lse)
			EXPECT_EQ(0, differing(&a, &b)) TH_LOG("case %zu: O or LSE", c);
		free(d.ent);
		free(d.md);
		test_problem_free(&b);
	}
	free(ea);
	free(ma);
	test_problem_free(&a);

	/* Lk = 0: zeros; Lq = 0: nothing */
	{
		const test_problem_shape e0 = { 1, 2, 1, 3, 0, 8 }, e1 = { 1, 2, 1, 0, 5, 8 };
		const test_problem_shape *es[2] = { &e0, &e1 };

		for (int i = 0; i < 2; i++) {
			test_problem b;
			struct rdiag d = { .want_ent = true, .want_md = true, .gappy = i == 0 };
			float ent[8], md[8];

			d.ent = ent;
			d.md = md;
			ASSERT_EQ(0, test_problem_make(&b, &rng, es[i], APE_F32, false));
			b.desc.causal = false;
			b.desc.q_start_set = true;
			b.desc.q_start = 0;
			ASSERT_EQ(0, run_resident_diag(&b, self->dev, 4, &d)) TH_LOG("%s", ape_last_error());
			for (size_t r = 0; r < b.rows; r++) {
				EXPECT_EQ(0.0f, ent[r]);
				EXPECT_EQ(0.0f, md[r]);
			}
			EXPECT_EQ(0, d.dirty);
			test_problem_free(&b);
		}
	}
}

/* Every refusal names the argument, and nothing is enqueued (the queue's call count stands
 * still) or written (O and both outputs keep their sentinel): each output outside its buffer,
 * at an odd offset, of another dtype or shape, rows colliding, in another device's buffer,
 * overlapping o, lse, an input or the other output; a backend without the diagnostics on
 * device tensors: APE_ENOTSUP naming the device, after the arguments were checked and before
 * anything was enqueued. */
TEST_F(resident, enqueue_diag_refusals)
{
	const int64_t B = 1, H = 2, L = 5, D = 8, n = B * H * L * D, rows = B * H * L;
	ape_buffer *bi = NULL, *bo = NULL, *bd = NULL, *foreign = NULL;
	ape_dtensor q, k, v, o, l, e, m;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	float sentinel[80], back[80];
	uint64_t calls;
	char name[64];

	ape_attn_desc_init(&desc);
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)n * 3 * sizeof(float), &bi));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)n * sizeof(float), &bo));
	/* lse, entropy, mean distance: one buffer, 40 bytes apart each */
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, sizeof(sentinel), &bd));
	for (int i = 0; i < 80; i++)
		sentinel[i] = 5.0f;
	ASSERT_EQ(0, ape_buffer_write(qu, bo, 0, sentinel, sizeof(sentinel)));
	ASSERT_EQ(0, ape_buffer_write(qu, bd, 0, sentinel, sizeof(sentinel)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));

#define RESET()                                                                                    \
	do {                                                                                       \
		ape_dtensor_init(&q, bi, 0, APE_F32, B, H, L, D);                                  \
		ape_dtensor_init(&k, bi, (uint64_t)n * 4, APE_F32, B, H, L, D);                    \
		ape_dtensor_init(&v, bi, (uint64_t)n * 8, APE_F32, B, H, L, D);                    \
		ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);                                  \
		ape_dtensor_init(&l, bd, 0, APE_F32, B, H, L, 1);                                  \
		ape_dtensor_init(&e, bd, (uint64_t)rows * 4, APE_F32, B, H, L, 1);                 \
		ape_dtensor_init(&m, bd, (uint64_t)rows * 8, APE_F32, B, H, L, 1);                 \
	} while (0)
#define REFUSED(code, text)                                                                        \
	do {                                                                                       \
		calls = qu->calls;                                                                 \
		EXPECT_EQ(code, ape_attention_enqueue_diag(qu, &desc, &q, &k, &v, &o, &l, &e, &m)); \
		EXPECT_NE(NULL, strstr(ape_last_error(), text))                                    \
		TH_LOG("want \"%s\" in \"%s\"", text, ape_last_error());                           \
		EXPECT_EQ(calls, qu->calls);                                                       \
		RESET();                                                                           \
	} while (0)

	RESET();
	e.byte_offset = 4 * 75; /* runs past the end */
	REFUSED(APE_EINVAL, "entropy: offset");
	m.byte_offset = 2; /* not a multiple of 4 */
	REFUSED(APE_EINVAL, "mean_distance->byte_offset = 2");
	e.dtype = APE_F16;
	REFUSED(APE_EINVAL, "entropy->dtype");
	m.shape[2] = L + 1;
	REFUSED(APE_EINVAL, "mean_distance->shape[2]");
	e.shape[3] = 2;
	REFUSED(APE_EINVAL, "entropy->shape[3]");
	m.strides[0] = rows, m.strides[1] = 1, m.strides[2] = 1, m.strides[3] = 1; /* collide */
	REFUSED(APE_EINVAL, "mean_distance->strides");
	e.buf = NULL;
	REFUSED(APE_EINVAL, "entropy->buf = NULL");
	e.buf = bo; /* inside O */
	REFUSED(APE_EINVAL, "entropy overlaps o");
	m.byte_offset = 4; /* over lse */
	REFUSED(APE_EINVAL, "mean_distance overlaps lse");
	m.byte_offset = (uint64_t)rows * 4 + 8; /* over the entropy */
	REFUSED(APE_EINVAL, "mean_distance overlaps entropy");
	e.buf = bi; /* over Q */
	REFUSED(APE_EINVAL, "entropy overlaps q");
	e.buf = bi;
	e.byte_offset = (uint64_t)n * 8; /* over V */
	REFUSED(APE_EINVAL, "entropy overlaps v");
	q.buf = NULL; /* the forward's own checks come first, with the call's name */
	REFUSED(APE_EINVAL, "ape_attention_enqueue_diag: q->buf = NULL");
	desc.lambda.value = -1;
	REFUSED(APE_EINVAL, "lambda");
	desc.lambda.value = 0;
	EXPECT_EQ(APE_EINVAL, ape_attention_enqueue_diag(NULL, &desc, &q, &k, &v, &o, &l, &e, &m));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue_diag: queue = NULL"));
	if (self->dev != self->ref) {
		ASSERT_EQ(0, ape_buffer_alloc(self->ref, 4096, &foreign));
		m.buf = foreign;
		REFUSED(APE_EINVAL, "mean_distance->buf is a buffer of ref:0");
	}
	/* a backend without them (none of libape's now): this one with the capability hidden */
	dev_name(self->dev, name, sizeof(name));
	if (diag_on_device(self->dev))
		wrap_install(self->dev, WRAP_NO_DIAG_VIEWS);
	REFUSED(APE_ENOTSUP, name);
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue_diag"))
	TH_LOG("%s", ape_last_error());
	m.buf = NULL; /* checked first: the arguments */
	REFUSED(APE_EINVAL, "mean_distance->buf = NULL");
	EXPECT_EQ(0, wrap_get().calls[WRAP_ATTENTION]);
	wrap_remove();
	/* none of it ran: O and the outputs still hold the sentinel */
	ASSERT_EQ(0, ape_buffer_read(qu, back, bo, 0, sizeof(back)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	EXPECT_EQ(0, memcmp(back, sentinel, sizeof(back)));
	ASSERT_EQ(0, ape_buffer_read(qu, back, bd, 0, sizeof(back)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	EXPECT_EQ(0, memcmp(back, sentinel, sizeof(back)));
	/* and the same arguments are accepted where the backend has them */
	if (diag_on_device(self->dev)) {
		EXPECT_EQ(0, ape_attention_enqueue_diag(qu, &desc, &q, &k, &v, &o, &l, &e, &m))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, ape_queue_synchronize(qu));
	}
#undef REFUSED
#undef RESET
	ape_queue_destroy(qu);
	ape_buffer_free(bi);
	ape_buffer_free(bo);
	ape_buffer_free(bd);
	ape_buffer_free(foreign);
}

/* Random N(0,1) float32 Q [B, H, L, D], K and V [B, Hkv, L, D] in one device buffer, written on
 * a new queue (not synchronised: later work is ordered after it), their device tensors, and a
 * desc with a decay and a temperature. */
struct dev_qkv {
	float *x; /* q, then k, then v */
	size_t nq, nk, rows;
	ape_queue *qu;
	ape_buffer *bin;
	ape_dtensor q, k, v;
	ape_attn_desc desc;
};

static int dev_qkv_make(struct dev_qkv *s, ape_device *dev, const char *seed, int64_t B,
			int64_t H, int64_t Hkv, int64_t L, int64_t D)
{
	ape_rng rng;
	int ret;

	memset(s, 0, sizeof(*s));
	s->nq = (size_t)(B * H * L * D);
	s->nk = (size_t)(B * Hkv * L * D);
	s->rows = (size_t)(B * H * L);
	s->x = malloc((s->nq + 2 * s->nk) * 4);
	if (!s->x)
		return APE_ENOMEM;
	ape_rng_init(&rng, seed);
	for (size_t i = 0; i < s->nq + 2 * s->nk; i++)
		s->x[i] = (float)ape_rng_normal(&rng);
	ape_attn_desc_init(&s->desc);
	s->desc.delta.value = 0.3f;
	s->desc.lambda.value = 0.1f;
	ret = ape_queue_create(dev, &s->qu);
	if (!ret)
		ret = ape_buffer_alloc(dev, (s->nq + 2 * s->nk) * 4, &s->bin);
	if (!ret)
		ret = ape_buffer_write(s->qu, s->bin, 0, s->x, (s->nq + 2 * s->nk) * 4);
	ape_dtensor_init(&s->q, s->bin, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&s->k, s->bin, s->nq * 4, APE_F32, B, Hkv, L, D);
	ape_dtensor_init(&s->v, s->bin, (s->nq + s->nk) * 4, APE_F32, B, Hkv, L, D);
	return ret;
}

static void dev_qkv_free(struct dev_qkv *s)
{
	ape_queue_destroy(s->qu);
	ape_buffer_free(s->bin);
	free(s->x);
}

/* Ordering on the queue, with no synchronisation between a producer and the call: one forward
 * call writes O1, which the diagnostics call takes as its Q at once, its outputs going into the
 * buffer a write enqueued just before filled with NaN; the result equals the two host calls in
 * sequence (bit for bit on the reference and OpenCL). */
TEST_F(resident, enqueue_diag_ordered_after_its_producer)
{
	const int64_t B = 1, H = 4, Hkv = 2, L = self->emu ? 19 : 71, D = 32;
	const bool exact = !strcmp(variant->backend, "ref") || !strcmp(variant->backend, "opencl");
	struct dev_qkv s;
	ape_buffer *bo1 = NULL, *bo2 = NULL, *bd = NULL;
	ape_dtensor o, o2t, e, m;
	ape_tensor hq, hk, hv, ho;
	float *o1, *o2, *ent, *md, *he, *hm, *nan;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors (the refusal: "
			     "enqueue_diag_equals_host_diag)", variant->backend);
	ASSERT_EQ(0, dev_qkv_make(&s, self->dev, _metadata->name, B, H, Hkv, L, D));
	o1 = malloc(s.nq * 4);
	o2 = malloc(s.nq * 4);
	ent = malloc(s.rows * 4);
	md = malloc(s.rows * 4);
	he = malloc(s.rows * 4);
	hm = malloc(s.rows * 4);
	nan = malloc(s.rows * 8);
	ASSERT_TRUE(o1 && o2 && ent && md && he && hm && nan);
	for (size_t i = 0; i < 2 * s.rows; i++)
		nan[i] = NAN;
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo1));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo2));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.rows * 8, &bd));
	ape_dtensor_init(&o, bo1, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&o2t, bo2, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&e, bd, 0, APE_F32, B, H, L, 1);
	ape_dtensor_init(&m, bd, s.rows * 4, APE_F32, B, H, L, 1);
	/* no synchronisation from the inputs' write to the reads */
	ASSERT_EQ(0, ape_buffer_write(s.qu, bd, 0, nan, s.rows * 8));
	ASSERT_EQ(0, ape_attention_enqueue(s.qu, &s.desc, &s.q, &s.k, &s.v, &o, NULL));
	ASSERT_EQ(0, ape_attention_enqueue_diag(s.qu, &s.desc, &o, &s.k, &s.v, &o2t, NULL, &e, &m))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_buffer_read(s.qu, o2, bo2, 0, s.nq * 4));
	ASSERT_EQ(0, ape_buffer_read(s.qu, ent, bd, 0, s.rows * 4));
	ASSERT_EQ(0, ape_buffer_read(s.qu, md, bd, s.rows * 4, s.rows * 4));
	ASSERT_EQ(0, ape_queue_synchronize(s.qu));

	/* the same on the host: O1, then the diagnostics with O1 as Q */
	ape_tensor_init(&hq, s.x, APE_F32, B, H, L, D);
	ape_tensor_init(&hk, s.x + s.nq, APE_F32, B, Hkv, L, D);
	ape_tensor_init(&hv, s.x + s.nq + s.nk, APE_F32, B, Hkv, L, D);
	ape_tensor_init(&ho, o1, APE_F32, B, H, L, D);
	ASSERT_EQ(0, ape_attention_forward(self->dev, &s.desc, &hq, &hk, &hv, &ho, NULL, NULL));
	ape_tensor_init(&hq, o1, APE_F32, B, H, L, D);
	ape_tensor_init(&ho, s.x, APE_F32, B, H, L, D); /* Q's place, no longer needed */
	ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &s.desc, &hq, &hk, &hv, &ho,
						NULL, he, hm, NULL));
	if (exact) {
		EXPECT_EQ(0, memcmp(s.x, o2, s.nq * 4));
		EXPECT_EQ(0, floats_differing(he, ent, s.rows));
		EXPECT_EQ(0, floats_differing(hm, md, s.rows));
	}
	for (size_t i = 0; i < s.rows; i++) {
		ASSERT_LE(fabs(he[i] - ent[i]), test_tol_lse(APE_F32) * 8) TH_LOG("row %zu", i);
		ASSERT_LE(fabs(hm[i] - md[i]), test_tol_lse(APE_F32) * L) TH_LOG("row %zu", i);
	}
	dev_qkv_free(&s);
	ape_buffer_free(bo1);
	ape_buffer_free(bo2);
	ape_buffer_free(bd);
	free(o1);
	free(o2);
	free(ent);
	free(md);
	free(he);
	free(hm);
	free(nan);
}

/* Query rows split into several launches under a small budget (exec/resident.c): the outputs
 * of the diagnostics, in [B, Lq, H] layouts, move along L with O and LSE, and equal the one
 * launch's (bit for bit on the reference, within the tolerance elsewhere). */
TEST_F(resident, enqueue_diag_rows_split)
{
	const int64_t B = 2, H = 4, Hkv = 2, L = self->emu ? 23 : 61, D = 32;
	struct dev_qkv s;
	ape_buffer *bo = NULL, *bd = NULL;
	ape_dtensor o, e, m;
	struct ape__resident_req r;
	struct ape__problem p;
	float *d1, *d2;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors", variant->backend);
	ASSERT_EQ(0, dev_qkv_make(&s, self->dev, _metadata->name, B, H, Hkv, L, D));
	d1 = malloc(s.rows * 8);
	d2 = malloc(s.rows * 8);
	ASSERT_TRUE(d1 && d2);
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.rows * 8, &bd));
	ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&e, bd, 0, APE_F32, B, H, L, 1);
	ape_dtensor_init(&m, bd, s.rows * 4, APE_F32, B, H, L, 1);
	e.strides[0] = m.strides[0] = L * H;
	e.strides[1] = m.strides[1] = 1;
	e.strides[2] = m.strides[2] = H;
	e.strides[3] = m.strides[3] = 1;
	ASSERT_EQ(0, ape_attention_enqueue_diag(s.qu, &s.desc, &s.q, &s.k, &s.v, &o, NULL, &e, &m));
	ASSERT_EQ(0, ape_buffer_read(s.qu, d1, bd, 0, s.rows * 8));
	ASSERT_EQ(0, ape_queue_synchronize(s.qu));

	memset(&r, 0, sizeof(r));
	ASSERT_EQ(0, ape__check_resident_diag("test", self->dev, &s.desc, &s.q, &s.k, &s.v, &o,
					      NULL, &e, &m, &p, r.buf, r.view, r.diag,
					      r.diag_view));
	ASSERT_EQ(0, ape__diag_devices("test", &self->dev, 1, true, &p));
	r.fn = "test";
	r.dev = self->dev;
	r.q = s.qu->q;
	r.p = &p;
	for (int64_t n = 1; n <= L; n = n * 3 + 1) {
		ASSERT_EQ(0, ape__resident_enqueue(&r, n)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_buffer_read(s.qu, d2, bd, 0, s.rows * 8));
		ASSERT_EQ(0, ape_queue_synchronize(s.qu));
		if (self->dev == self->ref)
			EXPECT_EQ(0, memcmp(d1, d2, s.rows * 8)) TH_LOG("%lld rows", (long long)n);
		for (size_t i = 0; i < s.rows; i++) {
			ASSERT_LE(fabs(d1[i] - d2[i]), 8 * test_tol_lse(APE_F32))
			TH_LOG("%lld rows per launch: entropy %zu", (long long)n, i);
			ASSERT_LE(fabs(d1[s.rows + i] - d2[s.rows + i]), test_tol_lse(APE_F32) * L)
			TH_LOG("%lld rows per launch: distance %zu", (long long)n, i);
		}
	}
	ape__problem_fini(&p);
	dev_qkv_free(&s);
	ape_buffer_free(bo);
	ape_buffer_free(bd);
	free(d1);
	free(d2);
}

/* A loose skip_tol is tightened to 2^-24, as in the host calls (docs/diagnostics.md, "Skipping"):
 * on a decaying, non-causal case where skipping at 1e-2 changes O (the plain call shows it),
 * the diagnostics call at 1e-2 gives the same bits as at 2^-24. A backend that skips nothing
 * cannot show it: SKIP. */
TEST_F(resident, enqueue_diag_tightens_a_loose_skip_tol)
{
	const int64_t B = 1, H = 2, Hkv = 1, L = self->emu ? 300 : 1500, D = 16;
	const double tols[2] = { 1e-2, 0x1p-24 };
	struct dev_qkv s;
	ape_buffer *bo = NULL, *bd = NULL;
	ape_dtensor o, e, m;
	float *out[2][2];
	bool differs = false;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors", variant->backend);
	ASSERT_EQ(0, dev_qkv_make(&s, self->dev, _metadata->name, B, H, Hkv, L, D));
	s.desc.delta.value = 0.05f;
	s.desc.beta.value = 0.01f;
	s.desc.gamma.value = 0.01f;
	s.desc.causal = false;
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.rows * 8, &bd));
	ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&e, bd, 0, APE_F32, B, H, L, 1);
	ape_dtensor_init(&m, bd, s.rows * 4, APE_F32, B, H, L, 1);
	for (int d = 0; d < 2; d++) { /* [0]: plain O; [1]: O, ENT and MD of the diagnostics */
		for (int t = 0; t < 2; t++) {
			out[d][t] = malloc(s.nq * 4 + s.rows * 8);
			ASSERT_NE(NULL, out[d][t]);
			s.desc.skip_tol = tols[t];
			if (d) {
				ASSERT_EQ(0, ape_attention_enqueue_diag(s.qu, &s.desc, &s.q, &s.k, &s.v,
									&o, NULL, &e, &m));
			} else {
				ASSERT_EQ(0, ape_attention_enqueue(s.qu, &s.desc, &s.q, &s.k, &s.v, &o,
								   NULL));
			}
			ASSERT_EQ(0, ape_buffer_read(s.qu, out[d][t], bo, 0, s.nq * 4));
			ASSERT_EQ(0, ape_buffer_read(s.qu, out[d][t] + s.nq, bd, 0, s.rows * 8));
			ASSERT_EQ(0, ape_queue_synchronize(s.qu));
		}
	}
	differs = memcmp(out[0][0], out[0][1], s.nq * 4) != 0;
	if (differs)
		EXPECT_EQ(0, floats_differing(out[1][0], out[1][1], s.nq + 2 * s.rows));
	dev_qkv_free(&s);
	ape_buffer_free(bo);
	ape_buffer_free(bd);
	for (int d = 0; d < 2; d++)
		for (int t = 0; t < 2; t++)
			free(out[d][t]);
	if (!differs)
		SKIP(return, "%s skips nothing more at skip_tol 1e-2 than at 2^-24 here: the "
			     "tightening cannot show", variant->backend);
}

TEST_HARNESS_MAIN
