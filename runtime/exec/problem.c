/* SPDX-License-Identifier: MIT */
/* What the executor computes about a validated problem (exec/problem.h). */
#include "exec/problem.h"

/*
 * Closed form, so that absurd lengths cost nothing: row i sees clamp(a + i, 0, Lk) keys with
 * a = q_start - k_start + 1. Over the rows, x = a + i runs through [a, a + Lq - 1]; x keys are
 * seen while 1 <= x <= Lk, and Lk once x > Lk. 128-bit intermediates.
 */
int ape__head_visible_pairs(const struct ape__problem *p, uint64_t *out)
{
	__int128 a, first, last, sum = 0;

	if (!p->causal) {
		sum = (__int128)p->Lq * p->Lk;
	} else if (p->Lq > 0 && p->Lk > 0) {
		a = (__int128)p->q_start - p->k_start + 1;
		first = a > 1 ? a : 1; /* ramp: x in [first, last], counts x */
		last = a + p->Lq - 1 < p->Lk ? a + p->Lq - 1 : p->Lk;
		if (last >= first)
			sum += (first + last) * (last - first + 1) / 2;
		/* in 128 bits: Lk may be INT64_MAX (found by tests/fuzz/fuzz_problem) */
		first = a > (__int128)p->Lk + 1 ? a : (__int128)p->Lk + 1; /* saturated: counts Lk */
		last = a + p->Lq - 1;
		if (last >= first)
			sum += (last - first + 1) * p->Lk;
	}
	if (sum > (__int128)UINT64_MAX)
		return -1;
	*out = (uint64_t)sum;
	return 0;
}
