/* SPDX-License-Identifier: MIT */
#include "bwdcase.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Inputs and upstream gradients; the caller sets the parameters, then bcase_forward(). */
int bcase_make(bcase *c, ape_rng *r, const test_problem_shape *sh, ape_dtype dt, bool strided,
	       bool with_dlse)
{
	const size_t rows = (size_t)(sh->B * sh->H * sh->Lq);

	memset(c, 0, sizeof(*c));
	if (test_problem_make(&c->tp, r, sh, dt, strided))
		return -1;
	if (test_tensor_random(&c->dout, r, dt, sh->B, sh->H, sh->Lq, sh->D, 1.0))
		goto out_free;
	if (with_dlse) {
		c->dlse = malloc(sizeof(float) * (rows + 1));
		if (!c->dlse)
			goto out_free;
		for (size_t i = 0; i < rows; i++)
			c->dlse[i] = (float)ape_rng_normal(r);
	}
	return 0;
out_free:
	test_problem_free(&c->tp);
	test_tensor_free(&c->dout);
	return -1;
}

void bcase_free(bcase *c)
{
	test_problem_free(&c->tp);
	test_tensor_free(&c->dout);
	free(c->dlse);
	memset(c, 0, sizeof(*c));
}

/* The saved O and LSE, from the reference's forward. */
int bcase_forward(bcase *c, ape_device *dev)
{
	return test_problem_run(&c->tp, dev);
}

int bcase_ready(bcase *c, ape_rng *r, const test_problem_shape *sh, ape_dtype dt, bool strided,
		bool with_dlse, ape_device *dev)
{
	if (bcase_make(c, r, sh, dt, strided, with_dlse))
		return -1;
	test_problem_random_params(&c->tp, r);
	return bcase_forward(c, dev);
}

int bcase_ready_visible(bcase *c, ape_rng *r, const test_problem_shape *sh, ape_dtype dt,
			bool strided, bool with_dlse, ape_device *dev)
{
	if (bcase_make(c, r, sh, dt, strided, with_dlse))
		return -1;
	test_problem_random_params(&c->tp, r);
	c->tp.desc.q_start_set = false;
	return bcase_forward(c, dev);
}

void bcase_edge_heads(bcase *c)
{
	ape_attn_desc *d = &c->tp.desc;
	float *prm = c->tp.params;
	const int64_t H = c->tp.q.t.shape[1];

	d->delta.per_head = prm;
	d->beta.per_head = prm + H;
	d->gamma.per_head = prm + 2 * H;
	d->lambda.per_head = prm + 3 * H;
	prm[0] = -0.25f;
	prm[H] = -0.5f;
	prm[2 * H] = -0.125f;
	if (H > 1) /* a second head, if any, at lambda = 0 */
		prm[3 * H + 1] = 0;
	prm[3 * H] = 1.75f;
}

int grads_alloc(grads *g, const bcase *c, ape_dtype dt)
{
	const int64_t *qs = c->tp.q.t.shape, *ks = c->tp.k.t.shape;

	memset(g, 0, sizeof(*g));
	g->H = qs[1];
	g->dparams = malloc(sizeof(float) * (size_t)(4 * g->H));
	if (!g->dparams || test_tensor_empty(&g->dq, dt, qs[0], qs[1], qs[2], qs[3]) ||
	    test_tensor_empty(&g->dk, dt, ks[0], ks[1], ks[2], ks[3]) ||
	    test_tensor_empty(&g->dv, dt, ks[0], ks[1], ks[2], ks[3]))
		return -1;
	for (int64_t i = 0; i < 4 * g->H; i++)
		g->dparams[i] = NAN;
	return 0;
}

void grads_free(grads *g)
{
	test_tensor_free(&g->dq);
	test_tensor_free(&g->dk);
	test_tensor_free(&g->dv);
	free(g->dparams);
	memset(g, 0, sizeof(*g));
}

/* The backward call of case c into the outputs of g that `wanted` names. */
int run_backward(bcase *c, ape_device *dev, grads *g, unsigned wanted, ape_stats *st)
{
	test_problem *tp = &c->tp;

	return ape_attention_backward(dev, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t, &tp->o.t,
				      tp->lse, &c->dout.t, c->dlse, wanted & W_DQ ? &g->dq.t : NULL,
				      wanted & W_DK ? &g->dk.t : NULL,
				      wanted & W_DV ? &g->dv.t : NULL,
				      wanted & W_DP ? g->dparams : NULL, st);
}

double grads_tol(ape_dtype storage)
{
	return storage == APE_F32 ? 1e-3 : storage == APE_F16 ? 1e-2 : 5e-2;
}

double grads_rel_err(const ape_tensor *a, const ape_tensor *b)
{
	return test_max_err_o(a, b) / fmax(test_tensor_maxabs(b), 1e-30);
}

double grads_rel_err_params(const float *a, const float *b, int64_t H)
{
	double err = 0, m = 1e-30;

	for (int64_t i = 0; i < 4 * H; i++) {
		err = fmax(err, isnan(a[i]) ? INFINITY : fabs((double)a[i] - b[i]));
		m = fmax(m, fabs((double)b[i]));
	}
	return err / m;
}

bool same_bits(const test_tensor *a, const test_tensor *b)
{
	return a->alloc_bytes == b->alloc_bytes && !memcmp(a->alloc, b->alloc, a->alloc_bytes);
}

bool same_grads(const grads *a, const grads *b, unsigned wanted)
{
	return (!(wanted & W_DQ) || same_bits(&a->dq, &b->dq)) &&
	       (!(wanted & W_DK) || same_bits(&a->dk, &b->dk)) &&
	       (!(wanted & W_DV) || same_bits(&a->dv, &b->dv)) &&
	       (!(wanted & W_DP) ||
		!memcmp(a->dparams, b->dparams, sizeof(float) * (size_t)(4 * a->H)));
}

int run_backward_ex(bcase *c, ape_device *dev, grads *g, const ape_exec_options *eo,
		    ape_stats *st)
{
	test_problem *tp = &c->tp;

	return ape_attention_backward_ex(&dev, 1, eo, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t,
					 &tp->o.t, tp->lse, &c->dout.t, c->dlse, &g->dq.t, &g->dk.t,
					 &g->dv.t, g->dparams, st);
}

int run_chunked(bcase *c, ape_device *dev, grads *g, int64_t cq, int64_t ck, ape_stats *st)
{
	ape_exec_options eo;

	ape_exec_options_init(&eo);
	eo.chunk_q = cq;
	eo.chunk_k = ck;
	return run_backward_ex(c, dev, g, &eo, st);
}

/* The same values as a contiguous tensor's, stored as float32 (widening is exact). */
int grads_widen(test_tensor *dst, const test_tensor *src)
{
	const int64_t *s = src->t.shape;

	if (test_tensor_empty(dst, APE_F32, s[0], s[1], s[2], s[3]))
		return -1;
	return ape_convert(dst->t.data, APE_F32, src->t.data, src->t.dtype,
			   (size_t)(s[0] * s[1] * s[2] * s[3]));
}

void grads_snap(grads_snapshot *s, const grads *g)
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

bool grads_unchanged(const grads_snapshot *s, const grads *g)
{
	const void *cur[4] = { g->dq.alloc, g->dk.alloc, g->dv.alloc, g->dparams };
	bool same = true;

	for (int i = 0; i < 4; i++) {
		same &= !memcmp(s->b[i], cur[i], s->n[i]);
		free(s->b[i]);
	}
	return same;
}

/* ---------------------------------------------------------------- on device tensors */

/* A device copy of t's whole allocation, `pad` bytes into a new buffer; *d views t in it. */
static int up(ape_queue *qu, const test_tensor *t, size_t pad, ape_buffer **b, ape_dtensor *d)
{
	const size_t off = (size_t)((const char *)t->t.data - (const char *)t->alloc);
	int ret = ape_buffer_alloc(ape_queue_device(qu), pad + t->alloc_bytes + 8, b);

	if (ret)
		return ret;
	ape_dtensor_init(d, *b, pad + off, t->t.dtype, t->t.shape[0], t->t.shape[1],
			 t->t.shape[2], t->t.shape[3]);
	ape_tensor_strides(&t->t, d->strides);
	return ape_buffer_write(qu, *b, pad, t->alloc, t->alloc_bytes);
}

/* n floats to a new buffer, `pad` bytes in, viewed as [d0, d1, d2, d3]. */
int dcase_up_floats(ape_queue *qu, const float *x, size_t n, size_t pad, ape_buffer **b,
		     ape_dtensor *d, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
	int ret = ape_buffer_alloc(ape_queue_device(qu), pad + n * 4 + 8, b);

	if (ret)
		return ret;
	ape_dtensor_init(d, *b, pad, APE_F32, d0, d1, d2, d3);
	return n ? ape_buffer_write(qu, *b, pad, x, n * 4) : 0;
}

void dcase_free(dcase *x)
{
	for (int i = 0; i < T_COUNT; i++)
		ape_buffer_free(x->b[i]);
	memset(x, 0, sizeof(*x));
}

/* Uploads case c and the (poisoned) outputs of g, `pad` bytes into each buffer. */
int dcase_up(dcase *x, ape_queue *qu, const bcase *c, const grads *g, size_t pad)
{
	const test_problem *tp = &c->tp;
	const int64_t B = tp->q.t.shape[0], H = tp->q.t.shape[1], Lq = tp->q.t.shape[2];
	const size_t rows = (size_t)(B * H * Lq);
	int ret;

	memset(x, 0, sizeof(*x));
	x->pad = pad;
	if ((ret = up(qu, &tp->q, pad, &x->b[T_Q], &x->d[T_Q])) ||
	    (ret = up(qu, &tp->k, pad, &x->b[T_K], &x->d[T_K])) ||
	    (ret = up(qu, &tp->v, pad, &x->b[T_V], &x->d[T_V])) ||
	    (ret = up(qu, &tp->o, pad, &x->b[T_O], &x->d[T_O])) ||
	    (ret = dcase_up_floats(qu, tp->lse, rows, pad, &x->b[T_LSE], &x->d[T_LSE], B, H, Lq, 1)) ||
	    (ret = up(qu, &c->dout, pad, &x->b[T_DOUT], &x->d[T_DOUT])) ||
	    (c->dlse && (ret = dcase_up_floats(qu, c->dlse, rows, pad, &x->b[T_DLSE], &x->d[T_DLSE], B,
					 H, Lq, 1))) ||
	    (ret = up(qu, &g->dq, pad, &x->b[T_DQ], &x->d[T_DQ])) ||
	    (ret = up(qu, &g->dk, pad, &x->b[T_DK], &x->d[T_DK])) ||
	    (ret = up(qu, &g->dv, pad, &x->b[T_DV], &x->d[T_DV])) ||
	    (ret = dcase_up_floats(qu, g->dparams, (size_t)(4 * g->H), pad, &x->b[T_DP], &x->d[T_DP],
			     1, 1, g->H, 4)))
		return ret;
	return 0;
}

/* The enqueue of the outputs `wanted` names (W_*). */
int dcase_enqueue(dcase *x, ape_queue *qu, const bcase *c, unsigned wanted)
{
	return ape_attention_backward_enqueue(
		qu, &c->tp.desc, &x->d[T_Q], &x->d[T_K], &x->d[T_V], &x->d[T_O], &x->d[T_LSE],
		&x->d[T_DOUT], c->dlse ? &x->d[T_DLSE] : NULL, wanted & W_DQ ? &x->d[T_DQ] : NULL,
		wanted & W_DK ? &x->d[T_DK] : NULL, wanted & W_DV ? &x->d[T_DV] : NULL,
		wanted & W_DP ? &x->d[T_DP] : NULL);
}

/* Reads every output buffer back into g's allocations (padding included), and synchronises. */
int dcase_down(dcase *x, ape_queue *qu, grads *g)
{
	int ret;

	if ((ret = ape_buffer_read(qu, g->dq.alloc, x->b[T_DQ], x->pad, g->dq.alloc_bytes)) ||
	    (ret = ape_buffer_read(qu, g->dk.alloc, x->b[T_DK], x->pad, g->dk.alloc_bytes)) ||
	    (ret = ape_buffer_read(qu, g->dv.alloc, x->b[T_DV], x->pad, g->dv.alloc_bytes)) ||
	    (ret = ape_buffer_read(qu, g->dparams, x->b[T_DP], x->pad,
				   (size_t)(4 * g->H) * sizeof(float))))
		return ret;
	return ape_queue_synchronize(qu);
}

/* Case c enqueued on dev into g (outputs `wanted`), everything `pad` bytes into its buffer. */
int run_enqueue_backward(const bcase *c, ape_device *dev, grads *g, unsigned wanted, size_t pad)
{
	ape_queue *qu = NULL;
	dcase x;
	int ret = ape_queue_create(dev, &qu);

	memset(&x, 0, sizeof(x));
	if (!ret)
		ret = dcase_up(&x, qu, c, g, pad);
	if (!ret)
		ret = dcase_enqueue(&x, qu, c, wanted);
	if (!ret)
		ret = dcase_down(&x, qu, g);
	ape_queue_destroy(qu);
	dcase_free(&x);
	return ret;
}

/* ---------------------------------------------------------------- on DLPack tensors */

DLDataType test_dl_dtype(ape_dtype dt)
{
	DLDataType d = { kDLFloat, 32, 1 };

	if (dt == APE_F16)
		d.bits = 16;
	else if (dt == APE_BF16)
		d = (DLDataType){ kDLBfloat, 16, 1 };
	return d;
}

/* DLTensor i over tensor tt (its own data and strides), ndim 4; or over n floats of x as
 * [d0, d1(, d2)] when tt is NULL. */
static void dl_over(dlbwd *b, int i, const ape_tensor *tt, float *x, int ndim,
		    int64_t d0, int64_t d1, int64_t d2)
{
	DLTensor *t = &b->t[i];

	memset(t, 0, sizeof(*t));
	t->device = (DLDevice){ kDLCPU, 0 };
	t->shape = b->shp[i];
	if (tt) {
		t->data = tt->data;
		t->ndim = 4;
		t->dtype = test_dl_dtype(tt->dtype);
		memcpy(b->shp[i], tt->shape, sizeof(tt->shape));
		ape_tensor_strides(tt, b->str[i]);
		t->strides = b->str[i];
	} else {
		t->data = x;
		t->ndim = ndim;
		t->dtype = test_dl_dtype(APE_F32);
		b->shp[i][0] = d0;
		b->shp[i][1] = d1;
		b->shp[i][2] = d2;
	}
}

/* See bwdcase.h. */
void dlbwd_make(dlbwd *b, bcase *c, grads *g)
{
	test_problem *tp = &c->tp;
	const int64_t B = tp->q.t.shape[0], H = tp->q.t.shape[1], Lq = tp->q.t.shape[2];

	dl_over(b, 0, &tp->q.t, NULL, 4, 0, 0, 0);
	dl_over(b, 1, &tp->k.t, NULL, 4, 0, 0, 0);
	dl_over(b, 2, &tp->v.t, NULL, 4, 0, 0, 0);
	dl_over(b, 3, &tp->o.t, NULL, 4, 0, 0, 0);
	dl_over(b, 4, NULL, tp->lse, 3, B, H, Lq);
	dl_over(b, 5, &c->dout.t, NULL, 4, 0, 0, 0);
	dl_over(b, 6, NULL, c->dlse, 3, B, H, Lq);
	dl_over(b, 7, &g->dq.t, NULL, 4, 0, 0, 0);
	dl_over(b, 8, &g->dk.t, NULL, 4, 0, 0, 0);
	dl_over(b, 9, &g->dv.t, NULL, 4, 0, 0, 0);
	dl_over(b, 10, NULL, g->dparams, 2, H, 4, 0);
}

int dlbwd_run(ape_device *dev, const bcase *c, dlbwd *b, unsigned wanted,
		     void *stream)
{
	return ape_attention_backward_dlpack(dev, &c->tp.desc, &b->t[0], &b->t[1], &b->t[2],
					     &b->t[3], &b->t[4], &b->t[5],
					     c->dlse ? &b->t[6] : NULL,
					     wanted & W_DQ ? &b->t[7] : NULL,
					     wanted & W_DK ? &b->t[8] : NULL,
					     wanted & W_DV ? &b->t[9] : NULL,
					     wanted & W_DP ? &b->t[10] : NULL, stream);
}

double bcase_dbias_rel_err(const bcase *c, const float *a, const float *b)
{
	const ape_attn_desc *d = &c->tp.desc;
	const int64_t B = c->tp.q.t.shape[0], H = c->tp.q.t.shape[1], Lq = c->tp.q.t.shape[2];
	const size_t n = (size_t)(d->bias_table_heads * d->bias_table_len);
	double err = 0, m = 1e-30;

	for (size_t i = 0; i < n; i++) {
		err = fmax(err, isnan(a[i]) ? INFINITY : fabs((double)a[i] - b[i]));
		m = fmax(m, fabs((double)b[i]));
	}
	if (d->bias_table_len == 1 && c->dlse) /* entry e: heads e (one row: every head) */
		for (int64_t e = 0; e < d->bias_table_heads; e++) {
			double s = 0;

			for (int64_t x = 0; x < B; x++)
				for (int64_t h = 0; h < H; h++)
					for (int64_t i = 0; i < Lq && (d->bias_table_heads == 1 || h == e);
					     i++)
						s += fabs(c->dlse[(x * H + h) * Lq + i]);
			m = fmax(m, s);
		}
	return err / m;
}
