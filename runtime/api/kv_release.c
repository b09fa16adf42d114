/* SPDX-License-Identifier: MIT */
/*
 * Releasing the oldest keys of a sequence for good (api/kv_session.h): the KV cache's blocks
 * (kvcache_release.c) and the KV pool's pages (kvpool_release.c) by one proof, and the terms
 * every later attend must keep for it to hold.
 *
 * With delta > 0 in every head, a key at distance n + dn from a query weighs at most
 * exp(-delta dn + ...) of one at distance n. The proof bounds the weight of the whole released
 * prefix against one kept key (the newest key at or before the earliest later query) for every
 * later query position at once; see proved(). It holds only while later attends keep its
 * assumptions, which ape__kv_terms_check() enforces.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "core/alloc.h"
#include "core/error.h"
#include "exec/pack.h"
#include "api/kv_session.h"

int ape__kv_terms_init(struct ape__kv_terms *t, const char *fn, int64_t H, int64_t nbg)
{
	memset(t, 0, sizeof(*t));
	t->delta = ape__calloc((size_t)H, sizeof(float));
	t->lambda = ape__calloc((size_t)H, sizeof(float));
	t->kmax = ape__calloc((size_t)nbg, sizeof(float));
	if (!t->delta || !t->lambda || !t->kmax) {
		ape__kv_terms_free(t);
		return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	}
	return 0;
}

void ape__kv_terms_free(struct ape__kv_terms *t)
{
	free(t->delta);
	free(t->lambda);
	free(t->kmax);
	memset(t, 0, sizeof(*t));
}

void ape__kv_terms_copy(struct ape__kv_terms *dst, const struct ape__kv_terms *src, int64_t H,
			int64_t nbg)
{
	dst->released = src->released;
	dst->q_floor = src->q_floor;
	dst->scale = src->scale;
	dst->tol = src->tol;
	memcpy(dst->delta, src->delta, (size_t)H * sizeof(float));
	memcpy(dst->lambda, src->lambda, (size_t)H * sizeof(float));
	memcpy(dst->kmax, src->kmax, (size_t)nbg * sizeof(float));
}

/*
 * Can every later query (position >= q_floor) give the released prefix, tokens [0, t_rel),
 * at most `tol` of the weight it gives the reference key t_ref (>= t_rel)?
 *
 * For such a query at distance n_ref >= n0 = q_floor - pos(t_ref) from the reference, every
 * released key is at distance >= n_ref + dn, dn = t_ref - (t_rel - 1). With delta, beta,
 * gamma >= 0, temp <= temp(n0) and |dot| <= |q||k|:
 *   s_released <= temp(n0) |scale| Q kmax_R + bias(n_ref + dn)
 *   s_ref      >= -temp(n0) |scale| Q |k_ref| + bias(n_ref)
 *   bias(n_ref + dn) - bias(n_ref) <= -delta dn     (beta and gamma only add to the gap)
 * and the released keys sit one per distance, each bound delta below the previous, so the
 * prefix weighs at most min(t_rel, 1 / (1 - exp(-delta))) exp(temp(n0) |scale| Q (kmax_R +
 * |k_ref|) - delta dn) times the reference, for every n_ref >= n0 at once. Only delta > 0 makes
 * that small.
 */
static bool proved(const struct ape__problem *p, int64_t B, int64_t Hkv, int64_t t_rel,
		   int64_t t_ref, int64_t n0, const float *kmax_r, const float *kref, double tol,
		   double max_qnorm)
{
	const int64_t group = p->H / Hkv;
	const double dn = (double)(t_ref - (t_rel - 1));

	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < p->H; h++) {
			const float *prm = p->head_params + 4 * h;
			const int64_t bg = b * Hkv + h / group;
			double lhs;

			if (!(prm[0] > 0) || prm[1] < 0 || prm[2] < 0)
				return false;
			/* one released key per distance, each bound delta lower than the last */
			lhs = log(ape_tail_count((double)t_rel, prm[0])) +
			      ape_temp(prm[3], (double)n0) * fabs(p->scale) * max_qnorm *
				      ((double)kmax_r[bg] + (double)kref[bg]) -
			      (double)prm[0] * dn;
			if (!(lhs <= log(tol)))
				return false;
		}
	return true;
}

int64_t ape__kv_release(struct ape__kv_terms *t, const struct ape__problem *p, int64_t B,
			int64_t Hkv, int64_t lb_first, int64_t bt, int64_t k_start, int64_t t_ref,
			int64_t q_floor, const float *(*norms)(const void *arg, int64_t lb),
			const void *arg, double tol, double max_qnorm)
{
	const int64_t nbg = B * Hkv;
	const int64_t n0 = q_floor - (k_start + t_ref);
	float kmax[256], *kr = nbg <= 256 ? kmax : NULL;
	int64_t lb = lb_first;

	/* a distance-bias table: no proof yet (its entries could favour the released distances) */
	if (!p->decay_nonneg || !(tol > 0) || t_ref < lb_first * bt || n0 < 0 || p->bias_table)
		return 0;
	if (!kr && !(kr = ape__malloc((size_t)nbg * sizeof(float))))
		return 0; /* releasing is an optimisation: never fail over it */
	/* whole blocks before the reference key, oldest first; each proof covers the whole
	 * released prefix, so the last one made is the one attends must keep true */
	while ((lb + 1) * bt - 1 < t_ref) {
		const float *bn = norms(arg, lb), *ref = norms(arg, t_ref / bt);

		for (int64_t bg = 0; bg < nbg; bg++)
			kr[bg] = fmaxf(t->kmax[bg], bn[bg]);
		if (!proved(p, B, Hkv, (lb + 1) * bt, t_ref, n0, kr, ref, tol, max_qnorm))
			break;
		memcpy(t->kmax, kr, (size_t)nbg * sizeof(float));
		lb++;
	}
	if (lb > lb_first) {
		t->q_floor = !t->released || q_floor > t->q_floor ? q_floor : t->q_floor;
		t->released = true;
		for (int64_t h = 0; h < p->H; h++) {
			t->delta[h] = p->head_params[4 * h];
			t->lambda[h] = p->head_params[4 * h + 3];
		}
		t->scale = fabs(p->scale);
		t->tol = p->skip_tol;
	}
	if (kr != kmax)
		free(kr);
	return lb - lb_first;
}

int ape__kv_terms_check(const struct ape__kv_terms *t, const char *fn, const char *where,
			const struct ape__problem *p, const ape_tensor *q, const int64_t qs[4],
			int64_t q0, int64_t lq, int64_t q_min, double max_qnorm)
{
	float row[APE_MAX_D];

	if (!t->released)
		return 0;
	if (p->bias_table)
		return ape__error(APE_EINVAL,
				  "%s: desc->bias_table = %p: blocks were released by a proof that "
				  "assumes no distance-bias table%s",
				  fn, (const void *)p->bias_table, where);
	if (q_min < t->q_floor)
		return ape__error(APE_EINVAL,
				  "%s: q_start = %" PRId64 ": blocks were released for queries at "
				  "positions >= %" PRId64 "%s",
				  fn, q_min, t->q_floor, where);
	if (!(p->skip_tol >= t->tol) || fabs(p->scale) > t->scale)
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = %g: blocks were released assuming %s %g%s", fn,
				  !(p->skip_tol >= t->tol) ? "skip_tol" : "scale",
				  !(p->skip_tol >= t->tol) ? p->skip_tol : p->scale,
				  !(p->skip_tol >= t->tol) ? "skip_tol >=" : "|scale| <=",
				  !(p->skip_tol >= t->tol) ? t->tol : t->scale, where);
	for (int64_t h = 0; h < p->H; h++) {
		const float *prm = p->head_params + 4 * h;

		if (prm[0] < t->delta[h] || prm[1] < 0 || prm[2] < 0 || prm[3] < t->lambda[h])
			return ape__error(APE_EINVAL,
					  "%s: head %" PRId64 ": delta %g, beta %g, gamma %g, lambda %g: "
					  "blocks were released assuming delta >= %g, beta, gamma >= 0, "
					  "lambda >= %g%s",
					  fn, h, (double)prm[0], (double)prm[1], (double)prm[2],
					  (double)prm[3], (double)t->delta[h], (double)t->lambda[h],
					  where);
	}
	for (int64_t b = 0; b < p->B; b++)
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = q0; i < q0 + lq; i++) {
				float nq;

				ape__load_row_f32(q, qs, b, h, i, row);
				nq = ape__norm(row, p->D);
				if (!(nq <= max_qnorm))
					return ape__error(APE_EINVAL,
							  "%s: q row (b %" PRId64 ", h %" PRId64
							  ", %" PRId64 ") has norm %g, above "
							  "max_query_norm = %g that released blocks "
							  "rely on%s",
							  fn, b, h, i, (double)nq, max_qnorm, where);
			}
	return 0;
}
