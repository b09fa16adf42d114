/* SPDX-License-Identifier: MIT */
#include "exec/lse_merge.h"
#include "core/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "core/error.h"
#include "core/limits.h"
#include "exec/pack.h"

int ape__acc_alloc(struct ape__acc *a, int64_t rows, int64_t D, bool diag)
{
	memset(a, 0, sizeof(*a));
	a->D = D; /* 0: the LSE alone (o_c NULL in ape__acc_add()) */
	a->o = ape__malloc((size_t)(rows * D) * sizeof(float) + 1);
	a->m = ape__malloc((size_t)rows * sizeof(double) + 1);
	a->s = ape__malloc((size_t)rows * sizeof(double) + 1);
	if (diag) {
		a->s1 = ape__malloc((size_t)rows * sizeof(double) + 1);
		a->s2 = ape__malloc((size_t)rows * sizeof(double) + 1);
	}
	if (!a->o || !a->m || !a->s || (diag && (!a->s1 || !a->s2))) {
		ape__acc_free(a);
		return ape__error(APE_ENOMEM, "out of host memory merging %lld rows",
				  (long long)rows);
	}
	return 0;
}

void ape__acc_free(struct ape__acc *a)
{
	free(a->o);
	free(a->m);
	free(a->s);
	free(a->s1);
	free(a->s2);
	a->o = NULL;
	a->m = a->s = a->s1 = a->s2 = NULL;
}

void ape__acc_reset(struct ape__acc *a, int64_t rows)
{
	a->rows = rows;
	for (int64_t r = 0; r < rows; r++) {
		a->m[r] = -INFINITY;
		a->s[r] = 0;
		if (a->s1)
			a->s1[r] = a->s2[r] = 0;
	}
}

void ape__acc_add(struct ape__acc *a, const float *o_c, const float *lse_c, const float *ent_c,
		  const float *md_c)
{
	const int64_t D = a->D;

	for (int64_t r = 0; r < a->rows; r++) {
		const double l = lse_c[r], m = a->m[r];
		float *acc = a->o + r * D;
		/* o_c is NULL for the LSE alone (D = 0): no arithmetic on it, even by 0 (UB) */
		const float *oc = D ? o_c + r * D : o_c;
		double mn, c_old, c_new;

		if (isnan(m) || l == -INFINITY)
			continue; /* already NaN, or nothing visible in this chunk */
		if (isnan(l) || l == INFINITY) {
			a->m[r] = NAN; /* a NaN reached the row: it stays NaN */
			continue;
		}
		if (m == -INFINITY) { /* first contribution: no accumulator to rescale */
			a->m[r] = l;
			a->s[r] = 1;
			if (D)
				memcpy(acc, oc, (size_t)D * sizeof(float));
			if (a->s1 && ent_c) {
				a->s1[r] = ape_diag_s1_term(1, 0, ent_c[r]);
				a->s2[r] = md_c[r];
			}
			continue;
		}
		mn = ape_merge_max(m, l);
		c_old = ape_merge_factor(m, mn);
		c_new = ape_merge_factor(l, mn);
		for (int64_t d = 0; d < D; d++)
			acc[d] = (float)(acc[d] * c_old + oc[d] * c_new);
		if (a->s1 && ent_c) {
			a->s1[r] = ape_diag_rescale_s1(a->s1[r], a->s[r], c_old, m, mn) +
				   ape_diag_s1_term(c_new, l - mn, ent_c[r]);
			a->s2[r] = a->s2[r] * c_old + c_new * md_c[r];
		}
		a->s[r] = a->s[r] * c_old + c_new;
		a->m[r] = mn;
	}
}

double ape__acc_lse(const struct ape__acc *a, int64_t row)
{
	const double m = a->m[row];

	return isnan(m) || m == -INFINITY ? m : m + log(a->s[row]);
}

void ape__acc_store(const struct ape__acc *a, ape_tensor *o, const int64_t os[4], float *lse,
		    float *ent, float *md, int64_t Lq, int64_t l0, int64_t n)
{
	const int64_t H = o->shape[1], D = a->D;
	float row[APE_MAX_D];
	uint16_t row16[APE_MAX_D];

	for (int64_t r = 0; r < a->rows; r++) {
		const int64_t bh = r / n, i = r % n, b = bh / H, h = bh % H;
		const double m = a->m[r];
		const float *acc = a->o + r * D;

		if (isnan(m)) {
			for (int64_t d = 0; d < D; d++)
				row[d] = NAN;
		} else if (m == -INFINITY) {
			memset(row, 0, (size_t)D * sizeof(float));
		} else {
			const double inv = 1.0 / a->s[r];

			for (int64_t d = 0; d < D; d++)
				row[d] = (float)(acc[d] * inv);
		}
		if (o->dtype == APE_F32) {
			ape__store_row(o, os, b, h, l0 + i, row);
		} else {
			ape_convert(row16, o->dtype, row, APE_F32, (size_t)D);
			ape__store_row(o, os, b, h, l0 + i, row16);
		}
		if (lse)
			lse[bh * Lq + l0 + i] = (float)ape__acc_lse(a, r);
		if (ent || md) {
			/* m NaN: a NaN row; -inf: nothing visible (s = 0 gives 0) */
			const double sr = isnan(m) ? NAN : m == -INFINITY ? 0 : a->s[r];

			if (ent)
				ent[bh * Lq + l0 + i] = (float)ape_diag_entropy(sr, a->s1[r]);
			if (md)
				md[bh * Lq + l0 + i] = (float)ape_diag_distance(sr, a->s2[r]);
		}
	}
}

void ape__store_empty_rows(ape_tensor *o, const int64_t os[4], float *lse, float *ent,
			   float *md, int64_t Lq, int64_t l0, int64_t n)
{
	const int64_t B = o->shape[0], H = o->shape[1];
	static const float zeros[APE_MAX_D];

	/* zero bits are 0.0 in every storage type */
	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = l0; i < l0 + n; i++) {
				ape__store_row(o, os, b, h, i, zeros);
				if (lse)
					lse[(b * H + h) * Lq + i] = -INFINITY;
				if (ent)
					ent[(b * H + h) * Lq + i] = 0;
				if (md)
					md[(b * H + h) * Lq + i] = 0;
			}
}

void ape__store_rows_f32(const float *src, ape_tensor *o, const int64_t os[4], int64_t l0,
			 int64_t n)
{
	const int64_t B = o->shape[0], H = o->shape[1], D = o->shape[3];
	uint16_t row16[APE_MAX_D];

	if (o->dtype == APE_F32) {
		ape__unpack_rows(src, o, os, l0, n);
		return;
	}
	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = 0; i < n; i++) {
				ape_convert(row16, o->dtype, src + ((b * H + h) * n + i) * D, APE_F32,
					    (size_t)D);
				ape__store_row(o, os, b, h, l0 + i, row16);
			}
}
