/* SPDX-License-Identifier: MIT */
/* What the executor computes about a validated problem (exec/problem.h). */
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "exec/problem.h"

#define APE_REAL double
#include "ape/ape_math.h"

/* The closed form of ape/ape_math.h (every backend's rule of which keys a row sees), over the
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

static int cmp_i64(const void *a, const void *b)
{
	const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

	return (x > y) - (x < y);
}

/* Causal: per row, the keys at or before its position, by binary search over the sorted key
 * positions. */
int ape__pos_visible_pairs(const int64_t *pos_q, int64_t Lq, const int64_t *pos_k, int64_t Lk,
			   bool causal, uint64_t *out)
{
	uint64_t sum = 0;
	bool over = false;
	int64_t *keys;

	if (!causal || Lq <= 0 || Lk <= 0)
		return __builtin_mul_overflow((uint64_t)(Lq > 0 ? Lq : 0),
					      (uint64_t)(Lk > 0 ? Lk : 0), out)
			       ? APE_EOVERFLOW
			       : 0;
	keys = ape__malloc((size_t)Lk * sizeof(int64_t));
	if (!keys)
		return APE_ENOMEM;
	memcpy(keys, pos_k, (size_t)Lk * sizeof(int64_t));
	qsort(keys, (size_t)Lk, sizeof(int64_t), cmp_i64);
	for (int64_t i = 0; i < Lq; i++) {
		int64_t lo = 0, hi = Lk; /* the first key after row i */

		while (lo < hi) {
			const int64_t mid = lo + (hi - lo) / 2;

			if (keys[mid] <= pos_q[i])
				lo = mid + 1;
			else
				hi = mid;
		}
		over |= __builtin_add_overflow(sum, (uint64_t)lo, &sum);
	}
	free(keys);
	if (over)
		return APE_EOVERFLOW;
	*out = sum;
	return 0;
}
