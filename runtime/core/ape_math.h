/* SPDX-License-Identifier: MIT */
/*
 * The small pure pieces of APE that every backend shares, written once in the common subset of
 * C11, OpenCL C 1.2 and CUDA C++: temperature, decay bias, the skip bound and the LSE merge.
 * Kernels include this file (the build embeds it ahead of each kernel source), so a formula
 * changes in one place only.
 *
 * APE_REAL selects the arithmetic: double in the reference backend, float in kernels.
 */
#ifndef APE_MATH_H
#define APE_MATH_H

#ifndef APE_REAL
#define APE_REAL float
#endif

#if defined(__CUDACC__)
#define APE_FN static __host__ __device__ __forceinline__
#elif defined(__OPENCL_VERSION__)
#define APE_FN static inline
#else
#include <math.h>
#define APE_FN static inline
#endif

typedef APE_REAL ape_real;

/* temp(n) = 1 / (1 + lambda |n|); an = |n| */
APE_FN ape_real ape_temp(ape_real lambda, ape_real an)
{
	return (ape_real)1 / ((ape_real)1 + lambda * an);
}

/* bias(n) = -delta |n| - beta ln(1 + |n|) - gamma sqrt(|n|) */
APE_FN ape_real ape_bias(ape_real delta, ape_real beta, ape_real gamma, ape_real an)
{
	return -delta * an - beta * log1p(an) - gamma * sqrt(an);
}

/* alpha = 1 + lambda sigmoid(-sigma): the per-query rotation slow-down */
APE_FN ape_real ape_alpha(ape_real lambda, ape_real sigma)
{
	return (ape_real)1 + lambda / ((ape_real)1 + exp(sigma));
}

/*
 * Upper bound of any score at distance >= an (an the smallest |n| of a set of keys), valid only
 * when delta, beta, gamma >= 0: then temp and bias both fall with |n|, and a rotation keeps norms,
 * so |dot| <= |q| max|k|.
 */
APE_FN ape_real ape_score_bound(ape_real lambda, ape_real delta, ape_real beta, ape_real gamma,
				ape_real abs_scale, ape_real qnorm, ape_real kmax, ape_real an)
{
	return ape_temp(lambda, an) * abs_scale * qnorm * kmax + ape_bias(delta, beta, gamma, an);
}

/*
 * True when `count` keys whose scores are all <= bound may be left out of a row whose computed
 * keys have running max m and denominator l = sum exp(s - m): their total weight relative to the
 * computed keys is at most count * exp(bound - m) / l <= tol. Written in log space so neither
 * side overflows; l >= 1 whenever a key was computed.
 */
APE_FN int ape_tail_negligible(ape_real bound, ape_real m, ape_real l, ape_real count, ape_real tol)
{
	if (!(tol > (ape_real)0) || !(l > (ape_real)0))
		return 0;
	return log(count) + (bound - m) <= log(tol) + log(l);
}

/*
 * How many keys a tail of `count` keys can weigh, in units of the bound at its nearest distance.
 * Skipping is only allowed with delta, beta, gamma >= 0; then the score bound falls by at least
 * delta per unit of distance (temp falls, and every decay term does), and one row has one key per
 * distance, so the tail's total weight is at most exp(U) / (1 - exp(-delta)) however many keys it
 * holds. The 1.001 absorbs the rounding of this factor.
 */
APE_FN ape_real ape_tail_count(ape_real count, ape_real delta)
{
	ape_real geo;

	if (!(delta > (ape_real)0))
		return count;
	geo = (ape_real)1.001 / -expm1(-delta);
	return geo < count ? geo : count;
}

/* Merges a partial result (m2, l2) into (m, l) and returns the factors that rescale the two
 * accumulators: acc = acc * c1 + acc2 * c2. Both maxima may be -INFINITY (no key yet). */
APE_FN ape_real ape_merge_max(ape_real m1, ape_real m2)
{
	return m1 > m2 ? m1 : m2;
}

APE_FN ape_real ape_merge_factor(ape_real m_old, ape_real m_new)
{
	/* exp(-inf - -inf) would be NaN; an empty side contributes nothing */
	return m_old == -(ape_real)INFINITY ? (ape_real)0 : exp(m_old - m_new);
}

/* ---- Gradients (APE-SPEC.md, "Gradients"): the pure per-row and per-pair pieces of the
 * backward pass. dS is the gradient of the loss with respect to one score s_ij. */

/* sigmoid(-sigma) = 1 / (1 + exp(sigma)): alpha's gate, and d(alpha)/d(lambda) */
APE_FN ape_real ape_grad_gate(ape_real sigma)
{
	return (ape_real)1 / ((ape_real)1 + exp(sigma));
}

/* d(alpha)/d(sigma) = -lambda sigmoid(-sigma) (1 - sigmoid(-sigma)) */
APE_FN ape_real ape_grad_dalpha_dsigma(ape_real lambda, ape_real sigma)
{
	ape_real g = ape_grad_gate(sigma);

	return -lambda * g * ((ape_real)1 - g);
}

/*
 * d(sigma)/d(q_d) = (q_d - mean) / ((D - 1) sigma): this returns the factor 1 / ((D - 1) sigma)
 * that multiplies (q_d - mean). 0 when sigma = 0 (a constant row), where sigma is not
 * differentiable: the spec takes the derivative as 0 there.
 */
APE_FN ape_real ape_grad_dsigma_coef(ape_real D, ape_real sigma)
{
	return sigma > (ape_real)0 ? (ape_real)1 / ((D - (ape_real)1) * sigma) : (ape_real)0;
}

/*
 * One pair's share of d(dot)/d(alpha): query pair (x, y), key pair (u, w), c = cos(theta),
 * s = sin(theta), theta = n omega / alpha, so d(theta)/d(alpha) = -theta / alpha.
 */
APE_FN ape_real ape_grad_ddot_dalpha(ape_real x, ape_real y, ape_real u, ape_real w, ape_real c,
				     ape_real s, ape_real theta, ape_real alpha)
{
	return ((x * u + y * w) * s - (x * w - y * u) * c) * theta / alpha;
}

/* d(temp)/d(lambda) = -|n| temp^2: the direct path of d_lambda (times dS scale dot) */
APE_FN ape_real ape_grad_dtemp_dlambda(ape_real lambda, ape_real an)
{
	ape_real t = ape_temp(lambda, an);

	return -an * t * t;
}

/* d(bias)/d(delta), d(bias)/d(beta), d(bias)/d(gamma) at distance an = |n| */
APE_FN ape_real ape_grad_dbias_ddelta(ape_real an)
{
	return -an;
}

APE_FN ape_real ape_grad_dbias_dbeta(ape_real an)
{
	return -log1p(an);
}

APE_FN ape_real ape_grad_dbias_dgamma(ape_real an)
{
	return -sqrt(an);
}

#endif /* APE_MATH_H */
