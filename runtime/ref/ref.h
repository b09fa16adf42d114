/* SPDX-License-Identifier: MIT */
/* The reference evaluation of APE: plain C, float64, one row at a time. */
#ifndef APE_REF_H
#define APE_REF_H

#include "core/backend.h"

#pragma GCC visibility push(hidden)

/*
 * Computes rows [row_begin, row_end) of the flattened [B*H*Lq] output of launch `l` from contiguous
 * host tensors. Extra memory is O(D) per row; no key is ever skipped.
 */
void ape__ref_rows(const struct ape__launch *l, const void *q, const void *k, const void *v,
		   void *o, float *lse, uint64_t *pairs, int64_t row_begin, int64_t row_end);

#pragma GCC visibility pop
#endif
