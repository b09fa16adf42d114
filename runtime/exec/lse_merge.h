/* SPDX-License-Identifier: MIT */
/*
 * Host-side merge of partial results by their LSE (docs/ape.md, identity 4): the key chunks of
 * one query chunk each give (O_c, LSE_c); the merged row is
 *     LSE = logsumexp_c LSE_c,   O = sum_c exp(LSE_c - LSE) O_c,
 * kept as a running maximum m, a sum s = sum exp(LSE_c - m) and an accumulator. With the
 * diagnostics (docs/diagnostics.md) each chunk also gives ENT_c and MD_c, merged as
 *     ENT = sum_c w_c (ENT_c - ln w_c),   MD = sum_c w_c MD_c,   w_c = exp(LSE_c - LSE),
 * through the running sums of ape/ape_math.h (ape_diag_*()): a chunk is one "key" of score
 * LSE_c carrying its own entropy and distance.
 */
#ifndef APE_RUNTIME_MERGE_H
#define APE_RUNTIME_MERGE_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

struct ape__acc {
	int64_t rows, D; /* rows = B * H * n, as [B, H, n] */
	float *o; /* rows x D */
	double *m; /* -inf: nothing merged; NaN: the row is NaN */
	double *s;
	double *s1, *s2; /* the diagnostics' running sums; NULL: not kept */
};

/* Buffers for up to `rows` rows of D (and the diagnostics' sums when `diag`); the caller frees
 * them with ape__acc_free(). D = 0 keeps the LSE alone (ape__acc_add() with o_c NULL). */
int ape__acc_alloc(struct ape__acc *a, int64_t rows, int64_t D, bool diag);
void ape__acc_free(struct ape__acc *a);
/* Starts over with `rows` rows (<= the allocated count): nothing merged. */
void ape__acc_reset(struct ape__acc *a, int64_t rows);
/* Merges one partial result: o_c float32 [rows, D], lse_c [rows]; ent_c and md_c [rows] when
 * the accumulator keeps the diagnostics and the call wants them (NULL: not wanted). */
void ape__acc_add(struct ape__acc *a, const float *o_c, const float *lse_c, const float *ent_c,
		  const float *md_c);
/* The merged LSE of a row so far (-inf when nothing was visible, NaN for a NaN row). */
double ape__acc_lse(const struct ape__acc *a, int64_t row);

/*
 * Writes the merged rows into rows [l0, l0 + n) of every (b, h) of o (element strides os,
 * its dtype, rounding to nearest even) and of lse ([B, H, Lq] contiguous; NULL: not wanted).
 * Rows with nothing visible get O = 0 and LSE = -inf; NaN rows NaN. ent and md (laid out as lse;
 * each NULL: not wanted; only with an accumulator that keeps the diagnostics) get the merged
 * entropy and mean distance: 0 for rows with nothing visible.
 */
void ape__acc_store(const struct ape__acc *a, ape_tensor *o, const int64_t os[4], float *lse,
		    float *ent, float *md, int64_t Lq, int64_t l0, int64_t n);

/* Rows [l0, l0 + n) of every (b, h) of o from src, float32 [B, H, n, D] packed, converted to
 * o's type (rounding to nearest even). */
void ape__store_rows_f32(const float *src, ape_tensor *o, const int64_t os[4], int64_t l0,
			 int64_t n);

/* O = 0, LSE = -inf and ENT = MD = 0 for rows [l0, l0 + n): query rows that see no key (lse,
 * ent, md each NULL: not wanted). */
void ape__store_empty_rows(ape_tensor *o, const int64_t os[4], float *lse, float *ent,
			   float *md, int64_t Lq, int64_t l0, int64_t n);

#pragma GCC visibility pop
#endif
