/* SPDX-License-Identifier: MIT */
/*
 * Releasing the oldest blocks of a KV cache (api/kvcache.h): the proof and the terms later
 * attends must keep are the KV stores' one (api/kv_release.c, api/kv_session.h); here, where
 * the cache's reference key and earliest later query lie.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/verbose.h"
#include "exec/pack.h"
#include "exec/skip_budget.h"
#include "api/kvcache.h"
#include "api/validate.h"

/* Logical block lb's largest key norm per (batch, kv head). */
static const float *block_norms(const void *arg, int64_t lb)
{
	const struct ape_kv_cache *c = arg;

	return c->bnorm + ape__kv_phys(c, lb) * c->o.B * c->o.Hkv;
}

int ape__kv_try_release(struct ape_kv_cache *c, const struct ape__problem *p, int64_t *released)
{
	const int64_t next = ape__kv_next_position(c), q_floor = next - c->o.max_queries;
	const int64_t ref = q_floor < next - 1 ? q_floor : next - 1;
	struct ape__skip_budget share;
	int64_t blocks;

	ape__skip_budget(p->skip_tol, p->causal, 1, true, &share);
	if (released)
		*released = 0;
	if (!c->o.allow_release)
		return 0;
	blocks = ape__kv_release(&c->rel, p, c->o.B, c->o.Hkv, c->lb_first, c->bt, c->o.k_start,
				 ref - c->o.k_start, q_floor, block_norms, c, share.release,
				 c->o.max_query_norm);
	c->lb_first += blocks;
	if (released)
		*released = blocks * c->bt;
	return 0;
}

int ape__kv_check_release_terms(const struct ape_kv_cache *c, const char *fn,
				const struct ape__problem *p, const ape_tensor *q,
				const int64_t qs[4])
{
	return ape__kv_terms_check(&c->rel, fn, "", p, q, qs, 0, p->Lq, p->q_start,
				   c->o.max_query_norm);
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
