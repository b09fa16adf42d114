/* SPDX-License-Identifier: MIT */
/* ape-check's comparisons of a device's results with the reference's (tools/check/check.h). */
#include <math.h>
#include <stdlib.h>

#include "check/check.h"
#include "common/seed.h"

float *check_to_f32(const void *p, ape_dtype dtype, size_t n)
{
	float *x = malloc(n * sizeof(float) + 1);

	if (x)
		ape_convert(x, APE_F32, p, dtype, n);
	return x;
}

/* |a - b|, with NaN or Inf on one side only infinite and equal values (infinities too) 0. */
static double diff(double a, double b)
{
	if (a == b || (isnan(a) && isnan(b)))
		return 0;
	if (!isfinite(a) || !isfinite(b))
		return INFINITY;
	return fabs(a - b);
}

double check_err_abs(const float *got, const float *want, size_t n, double scale)
{
	double e = 0;

	for (size_t i = 0; i < n; i++)
		e = fmax(e, diff(got[i], want[i]) / scale);
	return e;
}

double check_err_rel(const float *got, const float *want, size_t n)
{
	double e = 0;

	for (size_t i = 0; i < n; i++)
		e = fmax(e, check_err_one(got[i], want[i], want[i]));
	return e;
}

double check_err_one(double got, double want, double scale)
{
	return diff(got, want) / fmax(1.0, isfinite(scale) ? fabs(scale) : 1);
}

double check_err_grad(const float *got, const float *want, size_t n)
{
	return check_err_abs(got, want, n, check_max_abs(want, n));
}

double check_max_abs(const float *x, size_t n)
{
	double m = 1e-30;

	for (size_t i = 0; i < n; i++)
		m = fmax(m, fabs(x[i]));
	return m;
}

void check_seed_desc(ape_attn_desc *desc)
{
	ape_attn_desc_init(desc);
	desc->delta.value = (float)SEED_DELTA;
	desc->beta.value = (float)SEED_BETA;
	desc->gamma.value = (float)SEED_GAMMA;
	desc->lambda.value = (float)SEED_LAMBDA;
}

int check_qkv_make(struct check_qkv *x, ape_rng *rng, ape_dtype dtype, int64_t B, int64_t H,
		   int64_t Hkv, int64_t Lq, int64_t Lk, int64_t D)
{
	const size_t nq = (size_t)(B * H * Lq * D), nk = (size_t)(B * Hkv * Lk * D);

	*x = (struct check_qkv){ .B = B, .H = H, .Hkv = Hkv, .Lq = Lq, .Lk = Lk, .D = D,
				 .dtype = dtype };
	x->vf = malloc(nk * sizeof(float) + 1);
	x->q = ape_rng_array(rng, nq, dtype, NULL);
	x->k = ape_rng_array(rng, nk, dtype, NULL);
	x->v = ape_rng_array(rng, nk, dtype, NULL);
	if (!x->vf || !x->q || !x->k || !x->v) {
		check_qkv_free(x);
		return APE_ENOMEM;
	}
	ape_convert(x->vf, APE_F32, x->v, dtype, nk); /* the stored values */
	ape_tensor_init(&x->tq, x->q, dtype, B, H, Lq, D);
	ape_tensor_init(&x->tk, x->k, dtype, B, Hkv, Lk, D);
	ape_tensor_init(&x->tv, x->v, dtype, B, Hkv, Lk, D);
	return 0;
}

void check_qkv_free(struct check_qkv *x)
{
	free(x->q);
	free(x->k);
	free(x->v);
	free(x->vf);
	x->q = x->k = x->v = NULL;
	x->vf = NULL;
}

float *check_nan_floats(size_t n)
{
	float *x = malloc(n * sizeof(float) + 1);

	for (size_t i = 0; x && i < n; i++)
		x[i] = NAN;
	return x;
}
