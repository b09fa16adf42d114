/* SPDX-License-Identifier: MIT */
/* Chunk planning (exec/plan.h). */
#include "exec/plan.h"

#include <inttypes.h>
#include <stdio.h>

#include "core/error.h"

static int64_t ceil_div(int64_t a, int64_t b)
{
	return a / b + (a % b != 0);
}

static int64_t min64(int64_t a, int64_t b)
{
	return a < b ? a : b;
}

void ape__plan_sizes(const struct ape__plan_req *r, int64_t co, int64_t ci, int depth,
		     struct ape__plan *p)
{
	uint64_t jobs, per_job, inflight;

	p->co = co;
	p->ci = ci;
	p->no = ceil_div(r->Lo, co);
	p->ni = ceil_div(r->Li, ci);
	p->depth = depth;
	r->bytes(r->arg, co, ci, p->no, p->ni, &p->b);
	p->scratch = r->scratch ? r->scratch(r->arg, co, ci) : 0;
	p->o_slots = p->no > 1 && depth > 1 ? 2 : 1;
	jobs = ape__sat_mul((uint64_t)p->no, (uint64_t)p->ni);
	per_job = ape__sat_add(p->b.job, p->scratch);
	inflight = jobs < (uint64_t)depth ? jobs : (uint64_t)depth;
	p->fixed = ape__sat_add(ape__sat_add(ape__sat_mul((uint64_t)p->o_slots, p->b.outer),
					     ape__sat_mul(inflight, per_job)),
				p->b.call);
	p->i_slots = (int)min64(depth, p->ni);
	p->peak = ape__sat_add(p->fixed, ape__sat_mul((uint64_t)p->i_slots, p->b.inner));
}

static bool fits(const struct ape__plan_req *r, const struct ape__plan *p)
{
	return p->peak <= r->budget && p->peak != UINT64_MAX && p->b.largest <= r->max_buffer;
}

/* The smallest candidate does not fit: say what it needs, in query and key rows. */
static int too_small(const struct ape__plan_req *r, const char *fn, const struct ape__plan *p)
{
	const int64_t nq = r->outer_is_key ? p->ci : p->co, nk = r->outer_is_key ? p->co : p->ci;
	const char *chunk = r->chunk ? r->chunk : "one chunk";
	char rows[96];

	snprintf(rows, sizeof(rows), "%" PRId64 " query row%s and %" PRId64 " key row%s", nq,
		 nq == 1 ? "" : "s", nk, nk == 1 ? "" : "s");
	if (p->peak <= r->budget && p->peak != UINT64_MAX)
		return ape__error(APE_ENOMEM,
				  "%s: %s of %s (%s) needs a buffer of %" PRIu64
				  " bytes, more than the device's largest (%" PRIu64 ")",
				  fn, chunk, rows, r->what, p->b.largest, r->max_buffer);
	return ape__error(APE_ENOMEM,
			  "%s: budget %" PRIu64 " bytes cannot hold %s of %s (%s): that needs %" PRIu64
			  " bytes (%" PRIu64 " of them the backend's scratch)",
			  fn, r->budget, chunk, rows, r->what, p->peak, p->scratch);
}

/* The next smaller candidate, or false when (1, 1, depth 1) was the last. */
static bool shrink(const struct ape__plan_req *r, int64_t *co, int64_t *ci, int *depth)
{
	const int64_t big = r->inner_whole || *co > *ci ? *co : *ci;

	if (big > APE__CHUNK_PREFERRED_MIN || (big > 1 && *depth <= 2)) {
		if (r->inner_whole || *co >= *ci)
			*co = ceil_div(*co, 2);
		else
			*ci = ceil_div(*ci, 2);
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
	int64_t co = min64(r->max_co, r->Lo), ci = r->inner_whole ? r->Li : min64(r->max_ci, r->Li);
	int depth = r->depth, cap;
	uint64_t room, more;

	for (;;) {
		ape__plan_sizes(r, co, ci, depth, p);
		if (fits(r, p))
			break;
		if (!shrink(r, &co, &ci, &depth))
			return too_small(r, fn, p);
	}
	/* what is left keeps inner chunks resident for later outer chunks */
	cap = (int)min64(p->ni, r->max_inner_slots > 0 ? r->max_inner_slots : APE__MAX_KV_SLOTS);
	if (cap < p->i_slots)
		cap = p->i_slots;
	room = r->budget - p->peak;
	more = p->b.inner ? room / p->b.inner : 0;
	if (more > (uint64_t)(cap - p->i_slots))
		more = (uint64_t)(cap - p->i_slots);
	p->i_slots += (int)more;
	p->peak = ape__sat_add(p->fixed, ape__sat_mul((uint64_t)p->i_slots, p->b.inner));
	return 0;
}
