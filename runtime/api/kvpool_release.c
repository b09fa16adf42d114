/* SPDX-License-Identifier: MIT */
/*
 * Releasing a KV-pool sequence's oldest pages for good (ape_kv_pool_release_unreachable(),
 * api/kvpool.h), and the attends' check of what each release assumed. The proof and its terms
 * are the KV stores' one (api/kv_release.c): here, where a sequence's reference key and its
 * earliest later row lie, and the pages it gives back.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "core/verbose.h"
#include "exec/skip_budget.h"
#include "api/kvpool.h"
#include "api/validate.h"

struct seq_norms {
	const struct ape_kv_pool *pl;
	const struct ape__kvp_seq *s;
};

/* Logical page lb of a sequence: its largest key norm per kv head. */
static const float *seq_page_norms(const void *arg, int64_t lb)
{
	const struct seq_norms *sn = arg;

	return sn->pl->pnorm + sn->s->pages[lb] * sn->pl->o.Hkv;
}

int ape_kv_pool_release_unreachable(ape_kv_pool *pl, int64_t seq_id, const ape_attn_desc *desc,
				    int64_t *released)
{
	APE__API_CALL("ape_kv_pool_release_unreachable");
	static const char fn[] = "ape_kv_pool_release_unreachable";
	struct ape__skip_budget share;
	struct ape__kvp_seq *s;
	struct ape__problem p;
	ape_tensor qt, ot, none;
	float dummy = 0;
	int64_t next, q_floor, ref, pages, lb0;
	int ret;

	if (released)
		*released = 0;
	if (!pl)
		return ape__error(APE_EINVAL, "%s: pool = NULL", fn);
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	if (pl->ext || !(pl->o.max_query_norm > 0))
		return ape__error(APE_EINVAL,
				  "%s: the pool was created without max_query_norm (a bound on "
				  "later queries' norms, which the proof needs)",
				  fn);
	if (!(s = ape__kvp_find(pl, fn, "seq_id", seq_id)))
		return APE_EINVAL;
	/* the parameters only: a forward over no query and no key */
	ape_tensor_init(&qt, &dummy, pl->o.dtype, 1, pl->o.H, 0, pl->o.D);
	ape_tensor_init(&ot, &dummy, pl->o.dtype, 1, pl->o.H, 0, pl->o.D);
	ape_tensor_init(&none, NULL, pl->o.dtype, 1, pl->o.Hkv, 0, pl->o.D);
	if ((ret = ape__problem_init(&p, fn, desc, &qt, &none, &none, &ot, NULL)))
		return ret;
	next = s->k_start + s->n;
	q_floor = next - pl->o.max_batch_tokens;
	ref = q_floor < next - 1 ? q_floor : next - 1;
	ape__skip_budget(p.skip_tol, p.causal, 1, true, &share);
	if (s->n > 0 && !s->rel.delta &&
	    (ret = ape__kv_terms_init(&s->rel, fn, pl->o.H, pl->o.Hkv)))
		goto out;
	lb0 = s->first / pl->P;
	if (s->n > 0) {
		const struct seq_norms sn = { pl, s };

		pages = ape__kv_release(&s->rel, &p, 1, pl->o.Hkv, lb0, pl->P, s->k_start,
					ref - s->k_start, q_floor, seq_page_norms, &sn, share.release,
					pl->o.max_query_norm);
		for (int64_t lb = lb0; lb < lb0 + pages; lb++) {
			ape__kvp_page_put(pl, s->pages[lb]);
			s->pages[lb] = -1;
		}
		s->first = (lb0 + pages) * pl->P;
		if (released)
			*released = pages * pl->P;
	}
out:
	ape__problem_fini(&p);
	return ret;
}

int ape__kvp_check_terms(const struct ape_kv_pool *pl, const char *fn,
			 const struct ape__problem *p, const ape_tensor *q, int64_t nseq,
			 const int64_t *seq_ids, const int64_t *cu, const int64_t *pos_q)
{
	for (int64_t i = 0; i < nseq; i++) {
		const struct ape__kvp_seq *s = &pl->seq[seq_ids[i]];
		const int64_t q0 = cu[i], lq = cu[i + 1] - cu[i];
		int64_t qmin = s->k_start + s->n - lq;
		char where[80];
		int ret;

		if (!s->rel.released || !lq)
			continue;
		for (int64_t r = q0; pos_q && r < q0 + lq; r++)
			qmin = r == q0 || pos_q[r] < qmin ? pos_q[r] : qmin;
		snprintf(where, sizeof(where), " (batch entry %" PRId64 ", sequence %" PRId64 ")", i,
			 seq_ids[i]);
		if ((ret = ape__kv_terms_check(&s->rel, fn, where, p, q, p->qs, q0, lq, qmin,
					       pl->o.max_query_norm)))
			return ret;
	}
	return 0;
}
