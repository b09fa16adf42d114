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

/* The spec's accuracy of gradients ("Gradients"): max |G - G_64| <= tol * max |G_64|. */
double refcheck_tol_grad(ape_dtype storage);

enum { REFCHECK_DQ, REFCHECK_DK, REFCHECK_DV, REFCHECK_DPARAMS, REFCHECK_NGRADS };

/*
 * The spec's bound, max |G - G_64| <= tol * max |G_64|, per gradient tensor. A gradient that is
 * exactly zero in float64 (dQ and dK where every row sees one key, whose softmax is 1, so that
 * dP_ij - dO_i . O_i cancels; every parameter gradient when all pairs have n = 0) has no scale of
 * its own: its error is measured against refcheck_tol_o(APE_F32) * D * max |dO| * max |V|,
 * float32's forward accuracy (kernels compute in float32 whatever the storage) applied to the
 * largest term dP_ij = dO_i . V_j that cancelled.
 */
struct refcheck_grads {
	/* max |G - G_ref| / max |G_ref| per gradient (dparams as one [H, 4] tensor; the scale of
	 * an all-zero G_ref as above); -1 for a gradient not given */
	double err[REFCHECK_NGRADS];
	double tol; /* refcheck_tol_grad(q->dtype) */
	bool within_tol;
};

/*
 * Recomputes every gradient of a backward call on the reference device `ref` (all of them:
 * dK and dV need every row) from the same inputs, O and LSE, and compares the ones given (dq,
 * dk, dv, dparams; NULL: not checked) with it. Returns 0, or the negative code of a failed
 * reference call (with ape_last_error() set); APE_ENOMEM for host memory.
 */
int refcheck_backward(ape_device *ref, const ape_attn_desc *desc, const ape_tensor *q,
		      const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
		      const float *lse, const ape_tensor *dout, const float *dlse,
		      const ape_tensor *dq, const ape_tensor *dk, const ape_tensor *dv,
		      const float *dparams, struct refcheck_grads *res);

#endif
