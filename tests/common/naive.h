/* SPDX-License-Identifier: MIT */
/*
 * A second evaluation of the APE spec, written independently of libape's reference backend so the
 * two can check each other: long double, two passes per row (all scores first, then the softmax),
 * the query rotated pair by pair as a 2x2 matrix, its own 16-bit float decoding.
 */
#ifndef APE_TEST_NAIVE_H
#define APE_TEST_NAIVE_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape.h"

typedef struct naive_params {
	const double *delta, *beta, *gamma, *lambda; /* H values each */
	double rope_base;
	double rope_scale; /* position interpolation: the rotation's n is n / rope_scale; 0: 1 */
	double scale; /* NAN: 1/sqrt(D) */
	bool causal;
	bool interleaved;
	int64_t q_start, k_start; /* q_start already resolved */
	/* NULL, or a position per query row (per key row), shared by the batch: n = pos_q[i] -
	 * pos_k[j] (q_start, k_start then unused for that side) */
	const int64_t *pos_q, *pos_k;
	/* NULL, or a distance-bias table: head h adds bias_table[h * bias_hstride + min(|n|,
	 * bias_len - 1)] to every score (bias_hstride 0: one row for every head) */
	const float *bias_table;
	int64_t bias_len, bias_hstride;
} naive_params;

/*
 * o: B*H*Lq*D doubles, lse: B*H*Lq doubles (row-major). Reads q, k, v through their strides.
 * Returns 0, or -1 if out of memory.
 */
int naive_attention(const naive_params *p, const ape_tensor *q, const ape_tensor *k,
		    const ape_tensor *v, double *o, double *lse);

/*
 * naive_attention() and the diagnostics (docs/diagnostics.md) by their definitions, from the
 * normalised weights P_j of pass 2: ent = -sum P ln P, md = sum P |n|, and mdmax the largest
 * visible |n| of the row (the scale of md's tolerance); 0 for a row without a visible key, NaN
 * for a NaN row. Each of ent, md, mdmax (B*H*Lq doubles) may be NULL.
 */
int naive_attention_diag(const naive_params *p, const ape_tensor *q, const ape_tensor *k,
			 const ape_tensor *v, double *o, double *lse, double *ent, double *md,
			 double *mdmax);

/* IEEE binary16 (bf16 false) or bfloat16 bits decoded arithmetically, not by moving bits. */
long double naive_decode16(uint16_t bits, bool bf16);

/* Decodes one stored element, honouring strides, without libape's converters. */
long double naive_get(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d);

#endif
