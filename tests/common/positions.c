/* SPDX-License-Identifier: MIT */
#include <math.h>

#include "common/positions.h"
#include "common/testutil.h"

const char *const pos_mode_names[POS_MODES] = { "default", "shifted", "gaps", "repeats",
						 "shuffled", "decreasing" };

void test_positions(ape_rng *r, enum pos_mode m, int64_t *p, int64_t n, int64_t base)
{
	int64_t x = base;

	for (int64_t i = 0; i < n; i++) {
		switch (m) {
		case POS_DEFAULT:
		case POS_SHIFTED:
			p[i] = base + i;
			break;
		case POS_GAPS:
			x += 1 + ape_rng_range(r, 0, 1) * ape_rng_range(r, 1, 40);
			p[i] = x;
			break;
		case POS_REPEATS:
			x += ape_rng_range(r, 0, 1);
			p[i] = x;
			break;
		case POS_DECREASING:
			x -= ape_rng_range(r, 0, 2);
			p[i] = x;
			break;
		default:
			p[i] = base + ape_rng_range(r, 0, 3 * n);
			break;
		}
	}
}

void test_lse_err(double got, double want, double *err)
{
	double e;

	if (isinf(want) || isinf(got))
		e = want == got ? 0 : INFINITY;
	else
		e = fabs(got - want) / fmax(1, fabs(want));
	*err = fmax(*err, e != e ? INFINITY : e);
}

void test_random_desc(ape_rng *r, ape_attn_desc *desc, float prm[4][8], int64_t H)
{
	ape_attn_desc_init(desc);
	desc->causal = ape_rng_range(r, 0, 3) > 0;
	desc->skip_tol = ape_rng_range(r, 0, 1) ? 0 : desc->skip_tol;
	desc->rope_scale = ape_rng_range(r, 0, 2) ? 1.0 : 4.0; /* position interpolation too */
	test_random_head_params(desc, prm, H, r);
}

double test_quant(double x, double step)
{
	return nearbyint(x / step) * step;
}

void test_tensor_quantize(ape_tensor *t, double step)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					test_tensor_set(t, b, h, l, d,
							test_quant(test_tensor_get(t, b, h, l, d),
								   step));
}

long double test_fd_param(float *x, long double (*loss)(const void *ctx), const void *ctx)
{
	const float keep = *x;
	long double d[2];

	for (int i = 0; i < 2; i++) {
		const float h = i ? 0x1p-13f : 0x1p-12f;
		long double lp, lm;

		*x = keep + h;
		lp = loss(ctx);
		*x = keep - h;
		lm = loss(ctx);
		d[i] = (lp - lm) / (2 * (long double)h);
	}
	*x = keep;
	return (4 * d[1] - d[0]) / 3;
}

void test_quantize_inputs(ape_tensor *q, ape_tensor *k, ape_tensor *v, float prm[4][8],
			  int64_t H)
{
	test_tensor_quantize(q, 0x1p-10);
	test_tensor_quantize(k, 0x1p-10);
	test_tensor_quantize(v, 0x1p-10);
	for (int i = 0; i < 4; i++)
		for (int64_t h = 0; h < H; h++)
			prm[i][h] = (float)test_quant(prm[i][h], 0x1p-12);
}
