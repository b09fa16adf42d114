/* SPDX-License-Identifier: MIT */
/*
 * Releasing the oldest blocks of a KV cache (api/kvcache.h), and what a release requires of
 * every later attend.
 *
 * With delta > 0 in every head, a key at distance n + dn from a query weighs at most
 * exp(-delta dn + ...) of one at distance n. The proof below bounds the weight of the whole
 * released prefix against one kept key (the newest key at or before the earliest future query)
 * for every future query position at once; see release_proved(). It holds only while later
 * attends keep its assumptions, which ape__kv_check_release_terms() enforces.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "core/ape_math.h"
#include "core/alloc.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/verbose.h"
#include "exec/pack.h"
#include "exec/skip_budget.h"
#include "api/kvcache.h"
#include "api/validate.h"

/*
 * Can every future query (position >= q_floor) give the released prefix, tokens [0, t_rel),
 * at most `tol` of the weight it gives the reference key at token t_ref (>= t_rel)?
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
static bool release_proved(const struct ape_kv_cache *c, const struct ape__problem *p,
			   int64_t t_rel, int64_t t_ref, int64_t n0, const float *kmax_r,
			   double tol)
{
	const int64_t nbg = c->o.B * c->o.Hkv, group = c->o.H / c->o.Hkv;
	const double dn = (double)(t_ref - (t_rel - 1));
	/* the block maximum >= |k_ref| */
	const float *kref = c->bnorm + ape__kv_phys(c, t_ref / c->bt) * nbg;

	for (int64_t b = 0; b < c->o.B; b++)
		for (int64_t h = 0; h < c->o.H; h++) {
			const float *prm = p->head_params + 4 * h;
			const int64_t bg = b * c->o.Hkv + h / group;
			double lhs;

			if (!(prm[0] > 0) || prm[1] < 0 || prm[2] < 0)
				return false;
			/* one released key per distance, each bound delta lower than the last */
			lhs = log(ape_tail_count((double)t_rel, prm[0])) +
			      ape_temp(prm[3], (double)n0) * fabs(p->scale) * c->o.max_query_norm *
				      ((double)kmax_r[bg] + (double)kref[bg]) -
			      (double)prm[0] * dn;
			if (!(lhs <= log(tol)))
				return false;
		}
	return true;
}

int ape__kv_try_release(struct ape_kv_cache *c, const struct ape__problem *p, int64_t *released)
{
	const int64_t nbg = c->o.B * c->o.Hkv;
	const int64_t next = ape__kv_next_position(c), q_floor = next - c->o.max_queries;
	const int64_t ref = q_floor < next - 1 ? q_floor : next - 1;
	const int64_t t_ref = ref - c->o.k_start;
	float kmax[256], *kr = nbg <= 256 ? kmax : NULL;
	struct ape__skip_budget share;
	int64_t freed = 0;
	double tol;

	ape__skip_budget(p->skip_tol, p->causal, 1, true, &share);
	tol = share.release;
	if (released)
		*released = 0;
	if (!c->o.allow_release || !p->decay_nonneg || !(tol > 0) || t_ref < c->lb_first * c->bt)
		return 0;
	if (!kr && !(kr = ape__malloc((size_t)nbg * sizeof(float))))
		return 0; /* releasing is an optimisation: never fail over it */
	/* whole blocks before the reference key, oldest first; each proof covers the whole
	 * released prefix, so the last one made is the one attends must keep true */
	while ((c->lb_first + 1) * c->bt - 1 < t_ref) {
		const int64_t lb = c->lb_first;

		for (int64_t bg = 0; bg < nbg; bg++)
			kr[bg] = fmaxf(c->rel_kmax[bg], c->bnorm[ape__kv_phys(c, lb) * nbg + bg]);
		if (!release_proved(c, p, (lb + 1) * c->bt, t_ref, q_floor - ref, kr, tol))
			break;
		memcpy(c->rel_kmax, kr, (size_t)nbg * sizeof(float));
		c->lb_first++;
		freed += c->bt;
	}
	if (freed) {
		c->released = true;
		c->q_floor = q_floor > c->q_floor ? q_floor : c->q_floor;
		for (int64_t h = 0; h < p->H; h++) {
			c->rel_delta[h] = p->head_params[4 * h];
			c->rel_lambda[h] = p->head_params[4 * h + 3];
		}
		c->rel_scale = fabs(p->scale);
		c->rel_tol = p->skip_tol;
	}
	if (kr != kmax)
		free(kr);
	if (released)
		*released = freed;
	return 0;
}

int ape__kv_check_release_terms(const struct ape_kv_cache *c, const char *fn,
				const struct ape__problem *p, const ape_tensor *q,
				const int64_t qs[4])
{
	float row[APE_MAX_D];

	if (!c->released)
		return 0;
	if (p->q_start < c->q_floor)
		return ape__error(APE_EINVAL,
				  "%s: q_start = %" PRId64 ": blocks were released for queries at "
				  "positions >= %" PRId64,
				  fn, p->q_start, c->q_floor);
	if (!(p->skip_tol >= c->rel_tol) || fabs(p->scale) > c->rel_scale)
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = %g: blocks were released assuming %s %g", fn,
				  !(p->skip_tol >= c->rel_tol) ? "skip_tol" : "scale",
				  !(p->skip_tol >= c->rel_tol) ? p->skip_tol : p->scale,
				  !(p->skip_tol >= c->rel_tol) ? "skip_tol >=" : "|scale| <=",
				  !(p->skip_tol >= c->rel_tol) ? c->rel_tol : c->rel_scale);
	for (int64_t h = 0; h < p->H; h++) {
		const float *prm = p->head_params + 4 * h;

		if (prm[0] < c->rel_delta[h] || prm[1] < 0 || prm[2] < 0 ||
		    prm[3] < c->rel_lambda[h])
			return ape__error(APE_EINVAL,
					  "%s: head %" PRId64 ": delta %g, beta %g, gamma %g, lambda %g: "
					  "blocks were released assuming delta >= %g, beta, gamma >= 0, "
					  "lambda >= %g",
					  fn, h, (double)prm[0], (double)prm[1], (double)prm[2],
					  (double)prm[3], (double)c->rel_delta[h],
					  (double)c->rel_lambda[h]);
	}
	for (int64_t b = 0; b < p->B; b++)
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = 0; i < p->Lq; i++) {
				float nq;

				ape__load_row_f32(q, qs, b, h, i, row);
				nq = ape__norm(row, p->D);
				if (!(nq <= c->o.max_query_norm))
					return ape__error(APE_EINVAL,
							  "%s: q row (b %" PRId64 ", h %" PRId64
							  ", %" PRId64 ") has norm %g, above "
							  "max_query_norm = %g that released blocks "
							  "rely on",
							  fn, b, h, i, (double)nq, c->o.max_query_norm);
			}
	return 0;
}

int ape_kv_cache_release_unreachable(ape_kv_cache *c, const ape_attn_desc *desc,
				     int64_t *released)
{
	APE__API_CALL("ape_kv_cache_release_unreachable");
	static const char fn[] = "ape_kv_cache_release_unreachable";
	struct ape__problem p;
	ape_tensor qt, ot, none;
	float dummy = 0;
	int ret;

	if (released)
		*released = 0;
	if (!c)
		return ape__error(APE_EINVAL, "%s: cache = NULL", fn);
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	if (!c->o.allow_release)
		return ape__error(APE_EINVAL,
				  "%s: the cache was created without allow_release", fn);
	/* the parameters only: a forward over no query and no key */
	ape_tensor_init(&qt, &dummy, c->o.dtype, c->o.B, c->o.H, 0, c->o.D);
	ape_tensor_init(&ot, &dummy, c->o.dtype, c->o.B, c->o.H, 0, c->o.D);
	ape_tensor_init(&none, NULL, c->o.dtype, c->o.B, c->o.Hkv, 0, c->o.D);
	if ((ret = ape__problem_init(&p, fn, desc, &qt, &none, &none, &ot, NULL)))
		return ret;
	ret = ape__kv_try_release(c, &p, released);
	ape__problem_fini(&p);
	return ret;
}
