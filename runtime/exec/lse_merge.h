/* SPDX-License-Identifier: MIT */
/*
 * Host-side merge of partial results by their LSE (docs/ape.md, identity 4): the key chunks of
 * one query chunk each give (O_c, LSE_c); the merged row is
 *     LSE = logsumexp_c LSE_c,   O = sum_c exp(LSE_c - LSE) O_c,
 * kept as a running maximum m, a sum s = sum exp(LSE_c - m) and an accumulator.
 */
#ifndef APE_RUNTIME_MERGE_H
#define APE_RUNTIME_MERGE_H

#include <stdint.h>

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

struct ape__acc {
	int64_t rows, D; /* rows = B * H * n, as [B, H, n] */
	float *o; /* rows x D */
	double *m; /* -inf: nothing merged; NaN: the row is NaN */
	double *s;
};

/* Buffers for up to `rows` rows of D; the caller frees them with ape__acc_free(). */
int ape__acc_alloc(struct ape__acc *a, int64_t rows, int64_t D);
void ape__acc_free(struct ape__acc *a);
/* Starts over with `rows` rows (<= the allocated count): nothing merged. */
void ape__acc_reset(struct ape__acc *a, int64_t rows);
/* Merges one partial result: o_c float32 [rows, D], lse_c [rows]. */
void ape__acc_add(struct ape__acc *a, const float *o_c, const float *lse_c);
/* The merged LSE of a row so far (-inf when nothing was visible, NaN for a NaN row). */
double ape__acc_lse(const struct ape__acc *a, int64_t row);

/*
 * Writes the merged rows into rows [l0, l0 + n) of every (b, h) of o (element strides os,
 * its dtype, rounding to nearest even) and of lse ([B, H, Lq] contiguous; NULL: not wanted).
 * Rows with nothing visible get O = 0 and LSE = -inf; NaN rows NaN.
 */
void ape__acc_store(const struct ape__acc *a, ape_tensor *o, const int64_t os[4], float *lse,
		    int64_t Lq, int64_t l0, int64_t n);

/* O = 0 and LSE = -inf for rows [l0, l0 + n): query rows that see no key. */
void ape__store_empty_rows(ape_tensor *o, const int64_t os[4], float *lse, int64_t Lq,
			   int64_t l0, int64_t n);

#pragma GCC visibility pop
#endif
