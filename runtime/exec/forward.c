/* SPDX-License-Identifier: MIT */
/*
 * The streamed forward call (exec/forward.h): one forward pass per device, the key norms for
 * chunk skipping, the split of query chunks by their visible pairs, and the executor's run.
 */
#include "exec/forward.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "exec/fwd_pass.h"
#include "exec/launch.h"
#include "exec/skip.h"

struct fwd_run {
	const struct ape__fwd_req *r;
	struct ape__fwd_call call;
	struct ape__kmax km;
	bool skipping; /* chunk-level skipping */
	struct ape__pass *passes[APE_MAX_DEVICES];
	struct ape__fwd pass[]; /* one per device of the call (each a few KiB: not 64 zeroed) */
};

/* Cost of a query chunk: its visible pairs, or just its rows when skipping makes every row
 * cost about the same window. */
static double chunk_cost(void *arg, int64_t i0, int64_t n)
{
	const struct fwd_run *x = arg;
	const struct ape__problem *p = x->r->p;
	struct ape__problem sub = *p;
	uint64_t pairs = 0;

	if (x->skipping || p->segs || p->pos_q)
		return (double)n; /* a ragged call: rows (their sequences' lengths vary anyway) */
	sub.Lq = n;
	sub.q_start = p->q_start + i0;
	if (ape__head_visible_pairs(&sub, &pairs))
		return (double)n * (double)p->Lk;
	return (double)pairs + 1;
}

/* The chunking is known: the skip shares, the key norms (once), each device's pass. */
static int prepare(void *arg, const struct ape__plan *plan, int d)
{
	struct fwd_run *x = arg;
	const struct ape__problem *p = x->r->p;
	int ret;

	if (d == 0) {
		ape__skip_budget(p->skip_tol, p->causal, plan->ni, false, &x->call.tol);
		/* chunk-level skipping reasons about one sequence's contiguous positions: not
		 * ragged calls nor explicit positions (their launches still skip within each
		 * segment, per key tile) */
		x->skipping = ape__skip_allowed(p) && plan->ni > 1 && !p->segs && !p->pos_q;
		if (x->skipping &&
		    (ret = ape__kmax_from_tensor(&x->km, x->r->k, p->ks, plan->ci)))
			return ape__error_prefix(ret, x->r->fn);
		x->call.kmax = x->skipping ? &x->km : NULL;
	}
	ret = ape__fwd_prepare(&x->pass[d], plan->co, plan->ci, plan->no, plan->ni,
			       plan->o_slots);
	/* the staging's messages ("out of memory for query norms") name the call too */
	return ret ? ape__error_prefix(ret, x->r->fn) : 0;
}

int ape__forward_run(const struct ape__fwd_req *r, struct ape__exec_result *res)
{
	const struct ape__problem *p = r->p;
	struct fwd_run *x = ape__calloc(1, sizeof(*x) + (size_t)r->ndev * sizeof(x->pass[0]));
	char what[128];
	int ret;

	memset(res, 0, sizeof(*res));
	if (!x)
		return ape__error(APE_ENOMEM, "%s: out of memory", r->fn);
	for (int d = 0; d < r->ndev; d++)
		if ((ret = ape__launch_supported(r->fn, r->devs[d], p))) {
			free(x);
			return ret;
		}
	x->r = r;
	x->call = (struct ape__fwd_call){
		.p = p, .q = r->q, .k = r->k, .v = r->v, .o = r->o, .lse = r->lse,
		.ent = r->ent, .md = r->md, .diag = r->ent || r->md, .want_pairs = r->want_pairs,
		.in_place = true,
	};
	ape__skip_budget(p->skip_tol, p->causal, 2, false, &x->call.tol);
	for (int d = 0; d < r->ndev; d++) {
		ape__fwd_init(&x->pass[d], &x->call, r->devs[d]);
		x->passes[d] = &x->pass[d].pass;
	}
	snprintf(what, sizeof(what), "B=%lld, H=%lld, Hkv=%lld, D=%lld, %s", (long long)p->B,
		 (long long)p->H, (long long)p->Hkv, (long long)p->D, ape_dtype_name(p->in_dtype));
	{
		const struct ape__exec_req er = {
			.fn = r->fn, .devs = r->devs, .ndev = r->ndev, .chunk_q = r->chunk_q,
			.chunk_k = r->chunk_k, .budget = r->budget, .depth = r->depth,
			.weights = r->weights, .trace_path = r->trace_path,
			.copy_inputs = r->copy_inputs, .Lq = p->Lq,
			.Lk = p->Lk, .passes = x->passes, .cost = chunk_cost, .cost_arg = x,
			.prepare = prepare, .prepare_arg = x, .what = what,
		};

		ret = ape__exec_run(&er, res);
	}
	for (int d = 0; d < r->ndev; d++) {
		res->pairs_computed += x->pass[d].pairs_computed;
		res->chunks_skipped += x->pass[d].chunks_skipped;
		ape__path_merge(&res->paths, &x->pass[d].paths);
		ape__fwd_fini(&x->pass[d]);
	}
	res->devices = r->ndev;
	if (ret && !r->staged)
		ape__error_written(ret, res->st.outer_done, res->no, res->st.in_place);
	ape__kmax_free(&x->km);
	free(x);
	return ret;
}
