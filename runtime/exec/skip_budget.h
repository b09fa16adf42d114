/* SPDX-License-Identifier: MIT */
/*
 * How one call's skip_tol is shared among everything that may leave keys out, so that all of
 * it together stays within skip_tol. The one place that decides the shares; the executor, the
 * KV cache's attends and its release proof only read them.
 */
#ifndef APE_RUNTIME_SKIP_BUDGET_H
#define APE_RUNTIME_SKIP_BUDGET_H

#include <stdbool.h>
#include <stdint.h>

#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/* May any key of p be left out? Only with skip_tol > 0 and every head's delta, beta,
 * gamma >= 0 (the bounds assume scores fall with distance). */
static inline bool ape__skip_allowed(const struct ape__problem *p)
{
	return p->decay_nonneg && p->skip_tol > 0;
}

struct ape__skip_budget {
	double release; /* the KV cache's release proof: weight the freed blocks may carry */
	double chunk; /* whole key chunks left out, per direction of a query chunk's walk */
	double kernel; /* skip_tol of every launch: its own tiles, and its prior test if any */
};

/*
 * The shares of `skip_tol` for a call whose query chunks have `nk` key chunks (causal or not),
 * with `release` when the call is a KV cache's that may release blocks (or is that release).
 *
 * Every mechanism leaves out keys only when it has proved their weight at most its share times
 * weight the row has computed (never more than the row's whole weight), so the relative
 * errors of all mechanisms add, and the shares are chosen to add up to skip_tol:
 *   - release: half of skip_tol goes to the release proof, once and for all future attends;
 *     the attends share the other half ("base"). Without release, base = skip_tol.
 *   - one key chunk (nk = 1): its launch is the whole walk and keeps all of base.
 *   - several: half of base for the launches (each leaves out at most that share of the
 *     weight it computes, so together at most that share of the row's), half for whole key
 *     chunks, split over the walk's directions: a causal walk has one (base / 2), a
 *     non-causal one two (base / 4 each).
 * The launch's share is split once more inside, when it has a prior (ape__skip_launch_tol()).
 */
void ape__skip_budget(double skip_tol, bool causal, int64_t nk, bool release,
		      struct ape__skip_budget *out);

/*
 * A KV cache attend that leaves its oldest keys out before it runs, unread (its window,
 * api/kvcache_attend.c): a quarter of the attend's base (skip_tol, or half of it with release)
 * goes to that cut (*window), and the attend runs as if its skip_tol were 3/4 of skip_tol
 * (*rest: ape__skip_budget() of it gives the launches, the chunks and, unspent by the attend,
 * the release its shares), so that cut and attend together spend at most base.
 */
void ape__skip_window(double skip_tol, bool release, double *window, double *rest);

/*
 * A launch's skip_tol from the kernels' share: all of it, or, when launches after the diagonal
 * test their keys against the diagonal's LSE (`prior`), half, the other half going to that test
 * (ape__skip_prior_tol()).
 */
double ape__skip_launch_tol(const struct ape__skip_budget *b, bool prior);

/*
 * The prior test's tolerance for the launch `dist` >= 1 key chunks from the diagonal, given
 * the launch's skip_tol: 2^-dist of it, so that the tests of one direction add up to at most
 * the half of the kernels' share that ape__skip_launch_tol() set aside, however many chunks
 * the direction has.
 */
double ape__skip_prior_tol(double launch_tol, int64_t dist);

#pragma GCC visibility pop
#endif
