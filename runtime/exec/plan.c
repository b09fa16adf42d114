/* SPDX-License-Identifier: MIT */
/*
 * Chunk planning. The budget counts every device buffer the executor holds at once:
 *
 *   q_slots x query chunk                          (2 when there is a next query chunk to load)
 * + min(depth, jobs) x (partial O + LSE + pairs + entropy + distance + backend scratch)
 * + kv_slots x (key chunk + value chunk)           (at least min(depth, nk))
 *
 * Large chunks keep kernels efficient, depth hides copies, resident key/value chunks save
 * copies when a key chunk serves several query chunks; the budget is spent in that order.
 */
#include "exec/plan.h"

#include <inttypes.h>

#include "core/error.h"

static uint64_t sat_mul(uint64_t a, uint64_t b)
{
	uint64_t r;

	return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t sat_add(uint64_t a, uint64_t b)
{
	uint64_t r;

	return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

static int64_t ceil_div(int64_t a, int64_t b)
{
	return a / b + (a % b != 0);
}

static int64_t min64(int64_t a, int64_t b)
{
	return a < b ? a : b;
}

void ape__plan_sizes(const struct ape__plan_req *r, int64_t cq, int64_t ck, int depth,
		     struct ape__plan *p)
{
	const uint64_t rows = sat_mul(sat_mul((uint64_t)r->B, (uint64_t)r->H), (uint64_t)cq);
	uint64_t jobs, per_job;

	p->cq = cq;
	p->ck = ck;
	p->nq = ceil_div(r->Lq, cq);
	p->nk = ceil_div(r->Lk, ck);
	p->depth = depth;
	p->merge = r->force_merge || p->nk > 1;
	p->q_bytes = sat_mul(sat_mul(rows, (uint64_t)r->D), r->esz);
	p->kv_bytes = sat_mul(sat_mul(sat_mul(sat_mul((uint64_t)r->B, (uint64_t)r->Hkv),
						  (uint64_t)ck),
					  (uint64_t)r->D),
				  r->esz);
	p->o_bytes = sat_mul(sat_mul(rows, (uint64_t)r->D), p->merge ? 4 : r->out_esz);
	p->lse_bytes = sat_mul(rows, 4);
	p->pairs_bytes = r->pairs ? sat_mul(rows, 8) : 0;
	p->diag_bytes = r->diag ? p->lse_bytes : 0;
	p->out_bytes = sat_add(sat_add(sat_add(p->o_bytes, p->lse_bytes), p->pairs_bytes),
			       sat_mul(2, p->diag_bytes));
	p->scratch = r->scratch ? r->scratch(r->scratch_arg, cq, ck) : 0;
	p->q_slots = p->nq > 1 && depth > 1 ? 2 : 1;
	p->prior_bytes = r->prior && p->nk > 1 ? p->lse_bytes : 0;
	jobs = sat_mul((uint64_t)p->nq, (uint64_t)p->nk);
	per_job = sat_add(p->out_bytes, p->scratch);
	p->fixed = sat_add(sat_mul((uint64_t)p->q_slots, sat_add(p->q_bytes, p->prior_bytes)),
			   sat_mul(jobs < (uint64_t)depth ? jobs : (uint64_t)depth, per_job));
	p->kv_slots = (int)min64(depth, p->nk);
	p->peak = sat_add(p->fixed, sat_mul((uint64_t)p->kv_slots, sat_mul(2, p->kv_bytes)));
}

static bool fits(const struct ape__plan_req *r, const struct ape__plan *p)
{
	return p->peak <= r->budget && p->q_bytes <= r->max_buffer &&
	       p->kv_bytes <= r->max_buffer && p->o_bytes <= r->max_buffer &&
	       p->out_bytes != UINT64_MAX;
}

/* The next smaller candidate, or false when (1, 1, depth 1) was the last. */
static bool shrink(int64_t *cq, int64_t *ck, int *depth)
{
	int64_t big = *cq > *ck ? *cq : *ck;

	if (big > APE__CHUNK_PREFERRED_MIN || (big > 1 && *depth <= 2)) {
		if (*cq >= *ck)
			*cq = ceil_div(*cq, 2);
		else
			*ck = ceil_div(*ck, 2);
		return true;
	}
	if (*depth > 2 || (*depth > 1 && big == 1)) {
		(*depth)--;
		return true;
	}
	return false;
}

int ape__plan_make(const struct ape__plan_req *r, const char *fn, struct ape__plan *p)
{
	int64_t cq = min64(r->max_cq, r->Lq), ck = min64(r->max_ck, r->Lk);
	int depth = r->depth, cap;
	uint64_t room, more;

	for (;;) {
		ape__plan_sizes(r, cq, ck, depth, p);
		if (fits(r, p))
			break;
		if (!shrink(&cq, &ck, &depth)) {
			if (p->peak <= r->budget)
				return ape__error(APE_ENOMEM,
						  "%s: one chunk of 1 query row and 1 key row (B=%" PRId64
						  ", H=%" PRId64 ", Hkv=%" PRId64 ", D=%" PRId64
						  ", %s) needs a buffer of %" PRIu64
						  " bytes, more than the device's largest (%" PRIu64 ")",
						  fn, r->B, r->H, r->Hkv, r->D, r->dtype_name,
						  p->q_bytes > p->o_bytes ? p->q_bytes : p->o_bytes,
						  r->max_buffer);
			return ape__error(APE_ENOMEM,
					  "%s: budget %" PRIu64 " bytes cannot hold one chunk of 1 query "
					  "row and 1 key row (B=%" PRId64 ", H=%" PRId64 ", Hkv=%" PRId64
					  ", D=%" PRId64 ", %s): that needs %" PRIu64 " bytes",
					  fn, r->budget, r->B, r->H, r->Hkv, r->D, r->dtype_name, p->peak);
		}
	}
	/* what is left keeps key/value chunks resident for later query chunks */
	cap = (int)min64(p->nk, r->max_kv_slots > 0 ? r->max_kv_slots : APE__MAX_KV_SLOTS);
	if (cap < p->kv_slots)
		cap = p->kv_slots;
	room = r->budget - p->peak;
	more = p->kv_bytes ? room / sat_mul(2, p->kv_bytes) : 0;
	if (more > (uint64_t)(cap - p->kv_slots))
		more = (uint64_t)(cap - p->kv_slots);
	p->kv_slots += (int)more;
	p->peak = sat_add(p->fixed, sat_mul((uint64_t)p->kv_slots, sat_mul(2, p->kv_bytes)));
	return 0;
}
