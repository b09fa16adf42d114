/* SPDX-License-Identifier: MIT */
/*
 * Explicit positions for the tests of the ragged and dense calls at arbitrary positions
 * (tests/test_varlen.c, tests/test_dense_positions.c): the kinds of position sequences, the
 * errors against the oracle as both measure them, and the quantisation their finite differences
 * need.
 */
#ifndef APE_TEST_POSITIONS_H
#define APE_TEST_POSITIONS_H

#include <stdint.h>

#include "ape/ape.h"
#include "common/rng.h"

/* default (0.. from the library: base + i here), shifted (base + i), gaps (increasing, some
 * steps of up to 40), repeats (non-decreasing), shuffled (drawn over base..base + 3n), decreasing
 * (non-increasing, steps of 0..2) */
enum pos_mode { POS_DEFAULT, POS_SHIFTED, POS_GAPS, POS_REPEATS, POS_SHUFFLED, POS_DECREASING,
		POS_MODES };

extern const char *const pos_mode_names[POS_MODES];

/* n positions of mode m from base into p. */
void test_positions(ape_rng *r, enum pos_mode m, int64_t *p, int64_t n, int64_t base);

/* The error of one LSE against the oracle's, relative to max(1, |want|) (an infinity on either
 * side: 0 when both are the same, else infinite), max'ed into *err; NaN counts as infinite. */
void test_lse_err(double got, double want, double *err);

/* desc initialised with a random causal flag, skip_tol (0 or the default) and rope_scale (1 or
 * 4), and random per-head
 * parameters prm[0..3][0..H) (delta < 0.4, beta and gamma < 0.04, lambda < 0.3; H <= 8). */
void test_random_desc(ape_rng *r, ape_attn_desc *desc, float prm[4][8], int64_t H);

/* x rounded to a multiple of step. */
double test_quant(double x, double step);
/* Every element of t (strides honoured) rounded to a multiple of step. */
void test_tensor_quantize(ape_tensor *t, double step);
/* For finite differences: q, k, v multiples of 2^-10 and the parameters prm[0..3][0..H) of
 * 2^-12, so that x +- one step is exact in float32. */
void test_quantize_inputs(ape_tensor *q, ape_tensor *k, ape_tensor *v, float prm[4][8],
			  int64_t H);

/*
 * dloss/dx at *x (a parameter quantised by test_quantize_inputs()) by Richardson's extrapolation
 * of two central differences, steps h = 2^-12 and h/2 (both exact in float32): (4 D(h/2) - D(h)) / 3,
 * whose error is O(h^4). A plain central difference's O(h^2) error reaches 1e-3 of lambda's
 * derivative at the distances of gapped positions (hundreds), more than the tests' tolerance.
 * *x is restored before the call returns.
 */
long double test_fd_param(float *x, long double (*loss)(const void *ctx), const void *ctx);

#endif
