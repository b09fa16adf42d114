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

#endif /* APE_MATH_H */
