/* SPDX-License-Identifier: MIT */
#include "refcheck.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double refcheck_tol_o(ape_dtype storage)
{
	return storage == APE_F32 ? 1e-4 : storage == APE_F16 ? 5e-3 : 2e-2;
}

double refcheck_tol_lse(ape_dtype storage)
{
	return storage == APE_F32 ? 1e-4 : storage == APE_F16 ? 1e-3 : 5e-3;
}

double refcheck_tol_grad(ape_dtype storage)
{
	return storage == APE_F32 ? 1e-3 : storage == APE_F16 ? 1e-2 : 5e-2;
}

static float get(const ape_tensor *t, const int64_t s[4], int64_t b, int64_t h, int64_t l,
		 int64_t d)
{
	size_t i = (size_t)(b * s[0] + h * s[1] + l * s[2] + d * s[3]);
	float f;

	ape_convert(&f, APE_F32, (const char *)t->data + i * ape_dtype_size(t->dtype), t->dtype, 1);
	return f;
}

/* A view of one (b, h) slice, rows [l0, l0 + n), as a [1, 1, n, D] tensor. */
static ape_tensor view(const ape_tensor *t, const int64_t s[4], int64_t b, int64_t h, int64_t l0,
		       int64_t n)
{
	ape_tensor v = *t;

	v.data = (char *)t->data + (size_t)(b * s[0] + h * s[1] + l0 * s[2]) * ape_dtype_size(t->dtype);
	v.shape[0] = v.shape[1] = 1;
	v.shape[2] = n;
	memcpy(v.strides, s, sizeof(v.strides));
	return v;
}

static double max_abs_v(const ape_tensor *v, const int64_t s[4])
{
	double m = 0;

	for (int64_t b = 0; b < v->shape[0]; b++)
		for (int64_t h = 0; h < v->shape[1]; h++)
			for (int64_t l = 0; l < v->shape[2]; l++)
				for (int64_t d = 0; d < v->shape[3]; d++)
					m = fmax(m, fabs(get(v, s, b, h, l, d)));
	return m;
}

/* The parameters of head h alone: a one-head problem reads per_head[0]. */
static void one_head(ape_param *p, int64_t h)
{
	if (p->per_head)
		p->per_head += h;
}

int refcheck_sampled(ape_device *ref, const ape_attn_desc *desc, const ape_tensor *q,
		     const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
		     const float *lse, int nrows, ape_rng *rng, struct refcheck_result *res)
{
	const int64_t B = q->shape[0], H = q->shape[1], Lq = q->shape[2], D = q->shape[3];
	const int64_t Hkv = k->shape[1], Lk = k->shape[2], total = B * H * Lq;
	int64_t qs[4], ks[4], vs[4], os[4];
	const int64_t q_start = desc->q_start_set ? desc->q_start : desc->k_start + Lk - Lq;
	double vmax;

	memset(res, 0, sizeof(*res));
	res->tol_o = refcheck_tol_o(q->dtype);
	res->tol_lse = refcheck_tol_lse(q->dtype);
	res->within_tol = true;
	if (total == 0)
		return 0;
	ape_tensor_strides(q, qs);
	ape_tensor_strides(k, ks);
	ape_tensor_strides(v, vs);
	ape_tensor_strides(o, os);
	vmax = fmax(1e-30, max_abs_v(v, vs));
	for (int r = 0; r < nrows && r < total; r++) {
		/* every row when they are few; else the first and last (the edges are where tiles
		 * go wrong) and random ones */
		int64_t row = nrows >= total ? r
			      : r == 0	     ? 0
			      : r == 1	     ? total - 1
					     : ape_rng_range(rng, 0, total - 1);
		int64_t b = row / (H * Lq), h = row / Lq % H, i = row % Lq, kh = h / (H / Hkv);
		ape_tensor qv = view(q, qs, b, h, i, 1), kv = view(k, ks, b, kh, 0, Lk);
		ape_tensor vv = view(v, vs, b, kh, 0, Lk), ov;
		ape_attn_desc d = *desc;
		float o_ref[APE_MAX_D], lse_ref;
		int ret;

		one_head(&d.delta, h);
		one_head(&d.beta, h);
		one_head(&d.gamma, h);
		one_head(&d.lambda, h);
		d.q_start = q_start + i;
		d.q_start_set = true;
		ape_tensor_init(&ov, o_ref, APE_F32, 1, 1, 1, D);
		ret = ape_attention_forward(ref, &d, &qv, &kv, &vv, &ov, &lse_ref, NULL);
		if (ret)
			return ret;
		for (int64_t dd = 0; dd < D; dd++) {
			double got = get(o, os, b, h, i, dd), want = o_ref[dd];
			double e = isnan(got) || isnan(want) ? (isnan(got) && isnan(want) ? 0 : INFINITY)
							     : fabs(got - want);

			res->max_err_o = fmax(res->max_err_o, e / vmax);
		}
		if (lse) {
			double got = lse[row], want = lse_ref, e;

			if (isnan(got) || isnan(want))
				e = isnan(got) && isnan(want) ? 0 : INFINITY;
			else
				e = got == want ? 0 : fabs(got - want) / fmax(1.0, fabs(want));
			res->max_err_lse = fmax(res->max_err_lse, e);
		}
		res->rows_checked++;
	}
	res->within_tol = res->max_err_o <= res->tol_o && res->max_err_lse <= res->tol_lse;
	return 0;
}

/* NaN anywhere the reference has none counts as an infinite error. */
static double abs_err(double got, double want)
{
	if (isnan(got) || isnan(want))
		return isnan(got) && isnan(want) ? 0 : INFINITY;
	return fabs(got - want);
}

/* max |got - want| / max |want|, or / zero_scale where want is 0 everywhere (refcheck.h). */
static double scaled(double err, double max_want, double zero_scale)
{
	return err / (max_want > 0 ? max_want : zero_scale);
}

/* max |t - want| over max |want| (scaled()); want is a contiguous float32 tensor of t's shape. */
static double rel_err(const ape_tensor *t, const float *want, double zero_scale)
{
	const int64_t *n = t->shape;
	double err = 0, m = 0;
	int64_t s[4];
	size_t i = 0;

	ape_tensor_strides(t, s);
	for (int64_t b = 0; b < n[0]; b++)
		for (int64_t h = 0; h < n[1]; h++)
			for (int64_t l = 0; l < n[2]; l++)
				for (int64_t d = 0; d < n[3]; d++, i++) {
					err = fmax(err, abs_err(get(t, s, b, h, l, d), want[i]));
					m = fmax(m, fabs(want[i]));
				}
	return scaled(err, m, zero_scale);
}

static size_t count4(const ape_tensor *t)
{
	return (size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]);
}

int refcheck_backward(ape_device *ref, const ape_attn_desc *desc, const ape_tensor *q,
		      const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
		      const float *lse, const ape_tensor *dout, const float *dlse,
		      const ape_tensor *dq, const ape_tensor *dk, const ape_tensor *dv,
		      const float *dparams, struct refcheck_grads *res)
{
	const int64_t *qn = q->shape, *kn = k->shape, H = q->shape[1];
	const size_t nq = count4(q), nk = count4(k);
	float *buf = malloc(sizeof(float) * (nq + 2 * nk + 4 * (size_t)H) + 1);
	float *rq = buf, *rk = buf + nq, *rv = rk + nk, *rp = rv + nk;
	ape_tensor tq, tk, tv;
	double m = 0, err = 0, zero_scale;
	int64_t s[4];
	int ret;

	for (int i = 0; i < REFCHECK_NGRADS; i++)
		res->err[i] = -1;
	res->tol = refcheck_tol_grad(q->dtype);
	res->within_tol = false;
	if (!buf)
		return APE_ENOMEM;
	ape_tensor_init(&tq, rq, APE_F32, qn[0], qn[1], qn[2], qn[3]);
	ape_tensor_init(&tk, rk, APE_F32, kn[0], kn[1], kn[2], kn[3]);
	ape_tensor_init(&tv, rv, APE_F32, kn[0], kn[1], kn[2], kn[3]);
	ret = ape_attention_backward(ref, desc, q, k, v, o, lse, dout, dlse, &tq, &tk, &tv, rp,
				     NULL);
	if (ret) {
		free(buf);
		return ret;
	}
	/* the scale of a gradient that is exactly zero (see refcheck.h) */
	ape_tensor_strides(dout, s);
	zero_scale = max_abs_v(dout, s);
	ape_tensor_strides(v, s);
	zero_scale = fmax(1e-30, refcheck_tol_o(APE_F32) * (double)q->shape[3] * zero_scale *
					 max_abs_v(v, s));
	if (dq)
		res->err[REFCHECK_DQ] = rel_err(dq, rq, zero_scale);
	if (dk)
		res->err[REFCHECK_DK] = rel_err(dk, rk, zero_scale);
	if (dv)
		res->err[REFCHECK_DV] = rel_err(dv, rv, zero_scale);
	if (dparams) {
		for (int64_t i = 0; i < 4 * H; i++) {
			err = fmax(err, abs_err(dparams[i], rp[i]));
			m = fmax(m, fabs(rp[i]));
		}
		res->err[REFCHECK_DPARAMS] = scaled(err, m, zero_scale);
	}
	res->within_tol = true;
	for (int i = 0; i < REFCHECK_NGRADS; i++)
		res->within_tol &= res->err[i] <= res->tol; /* -1: not given */
	free(buf);
	return 0;
}
