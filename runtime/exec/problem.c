/* SPDX-License-Identifier: MIT */
/* What the executor computes about a validated problem (exec/problem.h). */
#include "exec/problem.h"

#define APE_REAL double
#include "core/ape_math.h"

/* The closed form of core/ape_math.h (every backend's rule of which keys a row sees), over the
 * rows: row 0 is q_start - k_start from key 0, a distance validation admits. */
int ape__head_visible_pairs(const struct ape__problem *p, uint64_t *out)
{
	if (p->Lq <= 0 || p->Lk <= 0) {
		*out = 0;
		return 0;
	}
	if (ape_rows_visible_pairs(p->q_start - p->k_start, p->Lq, p->Lk, p->causal, out))
		return -1;
	return 0;
}
