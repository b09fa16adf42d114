/* SPDX-License-Identifier: MIT */
/*
 * The oracle. Every formula is written the way docs/ape.md states it, in float64, with no
 * shortcut: a sin and a cos per (query, key, pair), every visible key, an online softmax. Other
 * backends are tested against this file, so it favours being obviously right over being fast.
 */
#include <math.h> /* sincos: a GNU extension, _GNU_SOURCE comes from the Makefile */
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "ref.h"

static void store(void *base, ape_dtype t, int64_t i, double x)
{
	switch (t) {
	case APE_F16:
		((uint16_t *)base)[i] = ape_be_f32_to_f16((float)x);
		return;
	case APE_BF16:
		((uint16_t *)base)[i] = ape_be_f32_to_bf16((float)x);
		return;
	case APE_F32:
		break;
	}
	((float *)base)[i] = (float)x;
}

/* Component indices of pair p: (p, p + D/2) for the half layout, (2p, 2p + 1) interleaved. */
static void pair_index(ape_rope_layout layout, int64_t D, int64_t p, int64_t *a, int64_t *b)
{
	if (layout == APE_ROPE_HALF) {
		*a = p;
		*b = p + D / 2;
	} else {
		*a = 2 * p;
		*b = 2 * p + 1;
	}
}

/* sigma = unbiased standard deviation of the D components of q (ape_sigma()). */
static double row_sigma(const double *q, int64_t D)
{
	double mean = 0, ss = 0;

	for (int64_t d = 0; d < D; d++)
		mean += q[d];
	mean /= (double)D;
	for (int64_t d = 0; d < D; d++)
		ss += (q[d] - mean) * (q[d] - mean);
	return ape_sigma(ss, (int)D);
}

/* The rotated dot product of the spec for one (query, key) pair at distance n. */
static double rotated_dot(const struct ape_be_launch *l, const double *q, const void *kbase,
			  int64_t krow, double n, double alpha)
{
	double dot = 0;

	for (int64_t p = 0; p < l->D / 2; p++) {
		int64_t a, b;
		double x, y, u, w, s, c;

		pair_index(l->layout, l->D, p, &a, &b);
		x = q[a];
		y = q[b];
		u = ape__ref_load(kbase, l->in_dtype, krow + a);
		w = ape__ref_load(kbase, l->in_dtype, krow + b);
		sincos(n * l->omega[p] / alpha, &s, &c);
		dot += (x * u + y * w) * c + (x * w - y * u) * s;
	}
	return dot;
}

void ape__ref_rows(const struct ape_be_launch *l, const void *q, const void *k, const void *v,
		   void *o, float *lse, uint64_t *pairs, float *ent, float *md, int64_t row_begin,
		   int64_t row_end)
{
	const int64_t D = l->D, group = l->H / l->Hkv;
	const struct ape_be_view qv = ape_be_launch_view(l, APE_BE_T_Q), kv = ape_be_launch_view(l, APE_BE_T_K);
	const struct ape_be_view vv = ape_be_launch_view(l, APE_BE_T_V), ov = ape_be_launch_view(l, APE_BE_T_O);
	const struct ape_be_view lv = ape_be_launch_view(l, APE_BE_T_LSE);
	const struct ape_be_view ev = ape_be_launch_diag_view(l, 0), mv = ape_be_launch_diag_view(l, 1);
	double qrow[APE_MAX_D], acc[APE_MAX_D];

	for (int64_t row = row_begin; row < row_end; row++) {
		const int64_t i = row % l->Lq, bh = row / l->Lq;
		const int64_t b = bh / l->H, h = bh % l->H, hk = h / group;
		const int64_t qbase = qv.off + b * qv.sb + h * qv.sh + i * qv.sl;
		const int64_t obase = ov.off + b * ov.sb + h * ov.sh + i * ov.sl;
		const int64_t kbase = kv.off + b * kv.sb + hk * kv.sh;
		const int64_t vbase = vv.off + b * vv.sb + hk * vv.sh;
		const double delta = l->head_params[4 * h + 0], beta = l->head_params[4 * h + 1];
		const double gamma = l->head_params[4 * h + 2], lambda = l->head_params[4 * h + 3];
		/* a ragged launch: the row's segment's keys at its positions; explicit positions:
		 * each row's and key's own (core/backend.h) */
		const struct ape_be_seg *sg = l->segs ? ape_be_launch_seg_of(l, i) : NULL;
		const int64_t pos_q = l->pos_q ? l->pos_q[i]
				      : sg   ? sg->q_start + (i - sg->q0)
					     : l->q_start + i;
		const int64_t j0 = sg ? sg->k0 : 0, j1 = sg ? sg->k0 + sg->lk : l->Lk;
		const int64_t k_start = sg ? sg->k_start : l->k_start; /* key j0's position */
		double alpha, m = -INFINITY, sum = 0, s1 = 0, s2 = 0;
		bool bad = false;
		uint64_t seen = 0;

		for (int64_t d = 0; d < D; d++)
			qrow[d] = ape__ref_load(q, l->in_dtype, qbase + d);
		alpha = ape_alpha(lambda, row_sigma(qrow, D));
		memset(acc, 0, sizeof(acc));

		for (int64_t j = j0; j < j1; j++) {
			/* validated: fits */
			const int64_t n = pos_q - (l->pos_k ? l->pos_k[j] : k_start + (j - j0));
			const double an = fabs((double)n);
			double s, scale_old, w;

			if (l->causal && n < 0)
				continue;
			s = ape_temp(lambda, an) * l->scale *
				    rotated_dot(l, qrow, k, kbase + j * kv.sl, (double)n, alpha) +
			    ape_bias(delta, beta, gamma, an) +
			    (double)ape_be_bias_at(l, h, ape_abs_dist(n));
			seen++;
			if (!isfinite(s)) {
				bad = true; /* NaN/Inf input: the whole row becomes NaN */
				continue;
			}
			if (s > m) {
				scale_old = ape_merge_factor(m, s);
				for (int64_t d = 0; d < D; d++)
					acc[d] *= scale_old;
				s1 = ape_diag_rescale_s1(s1, sum, scale_old, m, s);
				s2 *= scale_old;
				sum *= scale_old;
				m = s;
			}
			w = ape_merge_factor(s, m);
			sum += w;
			s1 += ape_diag_s1_term(w, s - m, 0);
			s2 += w * an;
			for (int64_t d = 0; d < D; d++)
				acc[d] += w * ape__ref_load(v, l->in_dtype, vbase + j * vv.sl + d);
		}

		for (int64_t d = 0; d < D; d++) {
			double x = bad ? NAN : sum > 0 ? acc[d] / sum : 0.0;

			store(o, l->out_dtype, obase + d, x);
		}
		if (lse)
			lse[lv.off + b * lv.sb + h * lv.sh + i * lv.sl] = bad ? NAN : sum > 0 ? (float)(m + log(sum)) : -INFINITY;
		if (pairs)
			pairs[row] = seen;
		if (ent)
			ent[ev.off + b * ev.sb + h * ev.sh + i * ev.sl] =
				bad ? NAN : (float)ape_diag_entropy(sum, s1);
		if (md)
			md[mv.off + b * mv.sb + h * mv.sh + i * mv.sl] =
				bad ? NAN : (float)ape_diag_distance(sum, s2);
	}
}
