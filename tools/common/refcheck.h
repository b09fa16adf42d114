/* SPDX-License-Identifier: MIT */
/*
 * Checks a result against the reference backend on sampled rows: the reference is float64 and
 * slow, so tools recompute a few rows (each as a one-row problem with its own q_start, which the
 * spec's identity 4 makes exact) instead of the whole output.
 */
#ifndef APE_TOOLS_REFCHECK_H
#define APE_TOOLS_REFCHECK_H

#include <stdint.h>

#include "ape/ape.h"
#include "common/rng.h"

struct refcheck_result {
	int rows_checked;
	double max_err_o; /* max |O - O_ref| / max(1e-30, max|V|) over the rows checked */
	double max_err_lse; /* max |LSE - LSE_ref| / max(1, |LSE_ref|) */
	double tol_o, tol_lse; /* the spec's tolerances for the storage type */
	bool within_tol;
};

/*
 * Recomputes `nrows` rows chosen at random (always including the first and last row of the
 * tensor; every row, in order, when nrows >= B * H * Lq) on the reference device `ref` and compares them with `o` and `lse` (lse may be NULL).
 * `desc`, `q`, `k`, `v` are those of the call that produced `o`. Returns 0, or the negative code
 * of a failed reference call (with ape_last_error() set).
 */
int refcheck_sampled(ape_device *ref, const ape_attn_desc *desc, const ape_tensor *q,
		     const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
		     const float *lse, int nrows, ape_rng *rng, struct refcheck_result *res);

/* The spec's accuracy table. */
double refcheck_tol_o(ape_dtype storage);
double refcheck_tol_lse(ape_dtype storage);

#endif
