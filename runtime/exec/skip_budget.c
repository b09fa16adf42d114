/* SPDX-License-Identifier: MIT */
/* The shares of skip_tol (exec/skip_budget.h): the reasons they add up are written there. */
#include "exec/skip_budget.h"

#include <math.h>

void ape__skip_budget(double skip_tol, bool causal, int64_t nk, bool release,
		      struct ape__skip_budget *out)
{
	const double base = release ? skip_tol / 2 : skip_tol;

	out->release = release ? skip_tol / 2 : 0;
	out->kernel = nk > 1 ? base / 2 : base;
	out->chunk = causal ? base / 2 : base / 4;
}

void ape__skip_window(double skip_tol, bool release, double *window, double *rest)
{
	*window = (release ? skip_tol / 2 : skip_tol) / 4;
	*rest = skip_tol * 3 / 4;
}

double ape__skip_launch_tol(const struct ape__skip_budget *b, bool prior)
{
	return prior ? b->kernel / 2 : b->kernel;
}

double ape__skip_prior_tol(double launch_tol, int64_t dist)
{
	return ldexp(launch_tol, dist < 1000 ? -(int)dist : -1000);
}
