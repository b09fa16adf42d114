/* SPDX-License-Identifier: MIT */
#include "resident.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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
int run_resident_diag(test_problem *tp, ape_device *dev, size_t pad, struct rdiag *d)
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
int run_resident(test_problem *tp, ape_device *dev, size_t pad)
{
	return run_resident_diag(tp, dev, pad, NULL);
}

/* Elements of O that differ in bits (NaN equal to NaN), and LSE rows likewise. */
int64_t bits_differing(const test_problem *a, const test_problem *b)
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
