/* SPDX-License-Identifier: MIT */
#include "naive.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* n = pos_q(i) - pos_k(j): the explicit positions when given, else the offsets */
static int64_t naive_dist(const naive_params *p, int64_t i, int64_t j)
{
	return (p->pos_q ? p->pos_q[i] : p->q_start + i) - (p->pos_k ? p->pos_k[j] : p->k_start + j);
}

/* IEEE binary16 and bfloat16 decoded arithmetically, not by bit moves as libape does. */
long double naive_decode16(uint16_t bits, bool bf16)
{
	int sign = bits >> 15;
	int ebits = bf16 ? 8 : 5, mbits = bf16 ? 7 : 10;
	int bias = (1 << (ebits - 1)) - 1;
	int e = (bits >> mbits) & ((1 << ebits) - 1);
	int m = bits & ((1 << mbits) - 1);
	long double x;

	if (e == (1 << ebits) - 1)
		x = m ? NAN : INFINITY;
	else if (e == 0)
		x = ldexpl((long double)m, 1 - bias - mbits);
	else
		x = ldexpl((long double)(m + (1 << mbits)), e - bias - mbits);
	return sign ? -x : x;
}

long double naive_get(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	int64_t s3 = t->strides[3], s2 = t->strides[2], s1 = t->strides[1], s0 = t->strides[0];
	int64_t i;

	if (!s0 && !s1 && !s2 && !s3) {
		s3 = 1;
		s2 = t->shape[3];
		s1 = t->shape[2] * s2;
		s0 = t->shape[1] * s1;
	}
	i = b * s0 + h * s1 + l * s2 + d * s3;
	if (t->dtype == APE_F32) {
		float f;

		memcpy(&f, (const char *)t->data + 4 * i, 4);
		return f;
	}
	return naive_decode16(((const uint16_t *)t->data)[i], t->dtype == APE_BF16);
}

int naive_attention(const naive_params *p, const ape_tensor *q, const ape_tensor *k,
		    const ape_tensor *v, double *o, double *lse)
{
	return naive_attention_diag(p, q, k, v, o, lse, NULL, NULL, NULL);
}

int naive_attention_diag(const naive_params *p, const ape_tensor *q, const ape_tensor *k,
			 const ape_tensor *v, double *o, double *lse, double *ent, double *md,
			 double *mdmax)
{
	const int64_t B = q->shape[0], H = q->shape[1], Lq = q->shape[2], D = q->shape[3];
	const int64_t Hkv = k->shape[1], Lk = k->shape[2], half = D / 2;
	const long double scale = isnan(p->scale) ? 1.0L / sqrtl((long double)D) : p->scale;
	long double *s = malloc(sizeof(*s) * (size_t)(Lk ? Lk : 1));
	long double *qv = malloc(sizeof(*qv) * (size_t)D);

	if (!s || !qv) {
		free(s);
		free(qv);
		return -1;
	}
	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = 0; i < Lq; i++) {
				const int64_t kh = h / (H / Hkv);
				const int64_t row = (b * H + h) * Lq + i;
				long double mean = 0, var = 0, sigma, alpha, mx = -INFINITY, den = 0;
				bool any = false, bad = false;

				for (int64_t d = 0; d < D; d++) {
					qv[d] = naive_get(q, b, h, i, d);
					mean += qv[d];
				}
				mean /= D;
				for (int64_t d = 0; d < D; d++)
					var += (qv[d] - mean) * (qv[d] - mean);
				sigma = sqrtl(var / (D - 1));
				alpha = 1 + p->lambda[h] * (1 / (1 + expl(sigma)));

				/* pass 1: every score */
				for (int64_t j = 0; j < Lk; j++) {
					const int64_t n = naive_dist(p, i, j);
					const long double an = n < 0 ? -(long double)n : (long double)n;
					long double dot = 0;

					s[j] = NAN;
					if (p->causal && n < 0)
						continue;
					for (int64_t pp = 0; pp < half; pp++) {
						int64_t ia = p->interleaved ? 2 * pp : pp;
						int64_t ib = p->interleaved ? 2 * pp + 1 : pp + half;
						long double w = powl(p->rope_base, -2.0L * pp / D);
						/* position interpolation: n / s in the
						 * rotation only */
						long double th = (long double)n /
								 (p->rope_scale > 0 ? p->rope_scale : 1) *
								 w / alpha;
						long double c = cosl(th), sn = sinl(th);
						/* q rotated by +theta, then dotted with k */
						long double rx = c * qv[ia] - sn * qv[ib];
						long double ry = sn * qv[ia] + c * qv[ib];

						dot += rx * naive_get(k, b, kh, j, ia) +
						       ry * naive_get(k, b, kh, j, ib);
					}
					s[j] = scale * dot / (1 + p->lambda[h] * an) -
					       p->delta[h] * an - p->beta[h] * logl(1 + an) -
					       p->gamma[h] * sqrtl(an);
					if (p->bias_table) /* the table's entry, the last past its end */
						s[j] += p->bias_table[h * p->bias_hstride +
								      (an < p->bias_len - 1
									       ? (int64_t)an
									       : p->bias_len - 1)];
					if (!isfinite(s[j]))
						bad = true;
					else if (s[j] > mx)
						mx = s[j];
					any = true;
				}
				/* pass 2: the weights, then the weighted sum */
				for (int64_t j = 0; j < Lk; j++) {
					/* masked keys (still NaN from pass 1) get weight -1: skipped */
					s[j] = isnan(s[j]) ? -1 : isfinite(s[j]) ? expl(s[j] - mx) : 0;
					den += s[j] > 0 ? s[j] : 0;
				}
				for (int64_t d = 0; d < D; d++) {
					long double acc = 0;

					for (int64_t j = 0; j < Lk; j++)
						if (s[j] >= 0) /* visible, even if underflowed */
							acc += s[j] * naive_get(v, b, kh, j, d);
					o[row * D + d] = bad ? NAN : any ? (double)(acc / den) : 0.0;
				}
				lse[row] = bad ? NAN : any ? (double)(mx + logl(den)) : -INFINITY;
				if (ent || md || mdmax) {
					long double e = 0, m = 0, far = 0;

					for (int64_t j = 0; j < Lk; j++) {
						const int64_t n = naive_dist(p, i, j);
						const long double an = n < 0 ? -(long double)n : (long double)n;
						const long double pj = s[j] / den;

						if (s[j] < 0)
							continue; /* masked */
						far = an > far ? an : far;
						if (pj > 0) {
							e -= pj * logl(pj);
							m += pj * an;
						}
					}
					if (ent)
						ent[row] = bad ? NAN : (double)e;
					if (md)
						md[row] = bad ? NAN : (double)m;
					if (mdmax)
						mdmax[row] = (double)far;
				}
			}
	free(s);
	free(qv);
	return 0;
}
