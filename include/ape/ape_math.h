/* SPDX-License-Identifier: MIT */
/*
 * The small pure pieces of APE that every backend shares, written once in the common subset of
 * C11, OpenCL C 1.2 and CUDA C++: the query statistics (sigma, alpha, the norm slack),
 * temperature and decay bias (and their float32 differences), a row's anchor distance, the
 * exact-seed sincos of the rotation, the skip bound and test (with an earlier launch's LSE) and
 * the LSE merge. Kernels include this file (the build embeds it ahead of each kernel source), so
 * a formula changes in one place only; kernels keep their own tiling and loops around it.
 * Installed with ape/ape_backend.h: a backend plugin's kernels include it too (docs/backends.md),
 * so that every backend computes the operation from the same formulas.
 *
 * APE_REAL selects the arithmetic: double in the reference backend and the CUDA kernels' per-row
 * work, float or double in the OpenCL kernel (double when the device has cl_khr_fp64).
 * APE_RW > 1 (OpenCL only): the kernel carries that many query rows in the lanes of a vector;
 * the lane functions (ape_seed_sincos) then take such vectors.
 */
#ifndef APE_MATH_H
#define APE_MATH_H

/* no default: a host file that forgot it would silently compute in float */
#ifndef APE_REAL
#error "define APE_REAL (double on the host, float or double in kernels) first"
#endif

#if defined(__CUDACC__)
#include <stdint.h>
#define APE_FN static __host__ __device__ __forceinline__
#elif defined(__OPENCL_VERSION__)
/* always inlined: PoCL compiles with -Dinline=, and a call passes vector arguments through
 * memory (a fifth slower when the seed sincos stayed a call) */
#define APE_FN static inline __attribute__((always_inline))
#else
#include <math.h>
#include <stdint.h>
#define APE_FN static inline
#endif

/* float32 builtins (float32 arithmetic in C too): OpenCL C overloads the plain names, on vectors
 * as well; C and CUDA have the f-suffixed ones */
#if defined(__OPENCL_VERSION__)
typedef long ape_long;
typedef ulong ape_ulong;
#define APE_LONG_MAX LONG_MAX
#define APE_LONG_MIN LONG_MIN
#define APE_ULONG_MAX ULONG_MAX
#define APE_FMAF fma
#define APE_SQRTF sqrt
#define APE_LOG1PF log1p
#else
typedef int64_t ape_long;
typedef uint64_t ape_ulong;
#define APE_LONG_MAX INT64_MAX
#define APE_LONG_MIN INT64_MIN
#define APE_ULONG_MAX UINT64_MAX
#define APE_FMAF fmaf
#define APE_SQRTF sqrtf
#define APE_LOG1PF log1pf
#endif

/* APE_REAL_BITS: 64 when APE_REAL is double (for constants that depend on the precision) */
#define APE_REAL_BITS_double 64
#define APE_REAL_BITS_float 32
#define APE_REAL_BITS_(t) APE_REAL_BITS_##t
#define APE_REAL_BITS__(t) APE_REAL_BITS_(t)
#define APE_REAL_BITS APE_REAL_BITS__(APE_REAL)

typedef APE_REAL ape_real;

/* Lane types: one query row's value, or APE_RW rows' in the lanes of an OpenCL vector. */
#if defined(__OPENCL_VERSION__) && defined(APE_RW) && APE_RW > 1
#define APE_CAT_(a, b) a##b
#define APE_CAT(a, b) APE_CAT_(a, b)
typedef APE_CAT(float, APE_RW) ape_vfloat;
typedef APE_CAT(int, APE_RW) ape_vint;
typedef APE_CAT(APE_REAL, APE_RW) ape_vreal;
#define APE_V_FLOAT(x) APE_CAT(convert_float, APE_RW)(x)
#define APE_V_INT(x) APE_CAT(convert_int, APE_RW)(x)
#define APE_V_SELECT(a, b, c) select((a), (b), (c)) /* c ? b : a, per lane */
#else
typedef float ape_vfloat;
typedef int ape_vint;
typedef ape_real ape_vreal;
#define APE_V_FLOAT(x) ((float)(x))
#define APE_V_INT(x) ((int)(x))
#define APE_V_SELECT(a, b, c) ((c) ? (b) : (a))
#endif

/*
 * sigma, the unbiased standard deviation of a query's D components, from ss = sum (q_d - mean)^2
 * (two passes, mean first, in APE_REAL: alpha's error becomes an angle error proportional to |n|)
 */
APE_FN ape_real ape_sigma(ape_real ss, int D)
{
	return sqrt(ss / (ape_real)(D - 1));
}

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

/* 1 / alpha from ss as in ape_sigma(): the factor of the per-key step omega_p / alpha */
APE_FN ape_real ape_inv_alpha(ape_real lambda, ape_real ss, int D)
{
	return (ape_real)1 / ape_alpha(lambda, ape_sigma(ss, D));
}

/* An upper bound of |x| from x . x: the root rounded up by 2^-20 (far more than the rounding of
 * the sum and the root), so that the skip bound stays a bound. */
APE_FN ape_real ape_norm_bound(ape_real sumsq)
{
	return sqrt(sumsq) * ((ape_real)1 + (ape_real)0x1p-20f);
}

/* The same slack on a float32 norm (the largest key norm of a tile) */
APE_FN float ape_norm_bound_f(float norm)
{
	return norm * (1.0f + 0x1p-20f);
}

/* ---- Distances and visibility (APE-SPEC.md, "Shapes and positions"). A row's keys are
 * j = 0..Lk-1 at distances n = diag - j, diag the distance of key 0 (pos_q(i) - k_start).
 * Validation admits every distance of a real (row, key) pair that fits in int64, INT64_MIN and
 * INT64_MAX included, and no more: so nothing here computes a value one past a real distance
 * (diag + 1 overflows at diag = INT64_MAX), and each rule is total: defined, without signed
 * overflow, for every int64 input, since tiles also evaluate rows and keys past the problem's
 * ends (whose results they discard). Every backend, host code and kernel uses these. */

/* a + b and a - b saturated at the int64 ends: exact wherever the result fits (the distance of
 * every real pair); a tile's entry past the problem's end gets a defined, meaningless value. */
APE_FN ape_long ape_sat_add(ape_long a, ape_long b)
{
	if (b > 0 && a > APE_LONG_MAX - b)
		return APE_LONG_MAX;
	if (b < 0 && a < APE_LONG_MIN - b)
		return APE_LONG_MIN;
	return a + b;
}

APE_FN ape_long ape_sat_sub(ape_long a, ape_long b)
{
	if (b < 0 && a > APE_LONG_MAX + b)
		return APE_LONG_MAX;
	if (b > 0 && a < APE_LONG_MIN + b)
		return APE_LONG_MIN;
	return a - b;
}

/* |n|, saturated: |INT64_MIN| = 2^63 becomes INT64_MAX, whose value in double and in float is
 * 2^63 too, so the terms of the distance (bias, temperature) are those of the exact |n|. */
APE_FN ape_long ape_abs_dist(ape_long n)
{
	return n >= 0 ? n : n == APE_LONG_MIN ? APE_LONG_MAX : -n;
}

/* The entry of a distance-bias table of M >= 1 entries that distance an = |n| >= 0 reads: the
 * distance itself, or the last entry for every distance past the table (ape_be_bias_index()
 * in ape/ape_backend.h, for the kernels). */
APE_FN ape_long ape_bias_index(ape_long an, ape_long M)
{
	return an < M - 1 ? an : M - 1;
}

/* Smallest |n| over the distances lo..hi (lo <= hi), saturated as ape_abs_dist() */
APE_FN ape_long ape_min_abs(ape_long lo, ape_long hi)
{
	return lo > 0 ? lo : hi < 0 ? ape_abs_dist(hi) : 0;
}

/* Smallest |n| of a row over its keys j0..j1-1 (j0 < j1) */
APE_FN ape_long ape_keys_min_abs(ape_long diag, ape_long j0, ape_long j1)
{
	return ape_min_abs(ape_sat_sub(diag, j1 - 1), ape_sat_sub(diag, j0));
}

/*
 * A query row's anchor distance: its nearest visible |n| (0 when it sees no key). The bias there
 * is the row's largest when the decays are >= 0: it is the row's score frame c_row
 * (docs/kernels.md), subtracted in APE_REAL so that float32 keeps the fine differences between
 * the scores that matter at any |n|.
 */
APE_FN ape_long ape_anchor_distance(ape_long diag, ape_long Lk, int causal)
{
	if (Lk <= 0)
		return 0;
	if (causal)
		return diag < 0 ? 0 : diag - (diag < Lk - 1 ? diag : Lk - 1);
	return ape_keys_min_abs(diag, 0, Lk);
}

/* How many keys a row sees, keys 0..Lk-1 (causal: those with n >= 0, a prefix): also the end of
 * its visible keys, so that keys 0..jend-1 of them are ape_visible_keys(diag, jend, causal). */
APE_FN ape_long ape_visible_keys(ape_long diag, ape_long Lk, int causal)
{
	if (Lk <= 0)
		return 0;
	if (!causal)
		return Lk;
	return diag < 0 ? 0 : diag >= Lk - 1 ? Lk : diag + 1;
}

/* How many of the keys jbeg..jend-1 (0 <= jbeg) a row sees: the pairs it computes there */
APE_FN ape_long ape_row_visible_pairs(ape_long diag, ape_long jbeg, ape_long jend, int causal)
{
	const ape_long v = ape_visible_keys(diag, jend, causal);

	return v > jbeg ? v - jbeg : 0;
}

/* a b in 64 bits: 0, or 1 with *p saturated when the product exceeds 2^64 - 1 */
APE_FN int ape_mul_u64(ape_ulong a, ape_ulong b, ape_ulong *p)
{
	if (a != 0 && b > APE_ULONG_MAX / a) {
		*p = APE_ULONG_MAX;
		return 1;
	}
	*p = a * b;
	return 0;
}

/*
 * The visible pairs of nrows consecutive rows, the first at diag0, against keys 0..Lk-1: the sum
 * of ape_visible_keys(diag0 + r, Lk, causal), r < nrows, in closed form so that absurd lengths
 * cost nothing. Returns 0 with the sum in *pairs, or 1 when it exceeds 2^64 - 1 (*pairs then
 * saturated). The rows' distances must fit (diag0 + nrows - 1 <= INT64_MAX, as validated).
 */
APE_FN int ape_rows_visible_pairs(ape_long diag0, ape_long nrows, ape_long Lk, int causal,
				  ape_ulong *pairs)
{
	ape_long dlast, r0, r1, f0;
	ape_ulong ramp = 0, full = 0, x, y;
	int over = 0;

	*pairs = 0;
	if (nrows <= 0 || Lk <= 0)
		return 0;
	if (!causal)
		return ape_mul_u64((ape_ulong)nrows, (ape_ulong)Lk, pairs);
	dlast = diag0 + (nrows - 1);
	/* rows 0 <= diag <= Lk - 2 see diag + 1 keys: the ramp r0..r1, whose sum is
	 * (r0 + r1 + 2)(r1 - r0 + 1) / 2 (one factor is even: they add up to an odd number) */
	r0 = diag0 > 0 ? diag0 : 0;
	r1 = dlast < Lk - 2 ? dlast : Lk - 2;
	if (r1 >= r0) {
		x = (ape_ulong)r0 + (ape_ulong)r1 + 2; /* < 2^64: both below 2^63 - 1 */
		y = (ape_ulong)(r1 - r0) + 1;
		if (x % 2 == 0)
			x /= 2;
		else
			y /= 2;
		over |= ape_mul_u64(x, y, &ramp);
	}
	/* rows at diag >= Lk - 1 see all Lk */
	f0 = diag0 > Lk - 1 ? diag0 : Lk - 1;
	if (dlast >= f0)
		over |= ape_mul_u64((ape_ulong)dlast - (ape_ulong)f0 + 1, (ape_ulong)Lk, &full);
	if (over || ramp > APE_ULONG_MAX - full) {
		*pairs = APE_ULONG_MAX;
		return 1;
	}
	*pairs = ramp + full;
	return 0;
}

/*
 * The distance terms in float32, for per-distance tables: scale * temp(|n|) with scale folded
 * in, and bias(a) - bias(aref), accurate to float32 rounding of the difference even where the
 * bias itself is large: -delta d - beta log1p(d / (1 + aref)) - gamma d / (sqrt a + sqrt aref)
 * with d = a - aref exact.
 */
APE_FN float ape_temp_f(float scale, float lambda, ape_long an)
{
	return scale / APE_FMAF(lambda, (float)an, 1.0f);
}

APE_FN float ape_bias_diff_f(float delta, float beta, float gamma, ape_long a, ape_long aref)
{
	const float d = (float)(a - aref), af = (float)a, rf = (float)aref;
	const float den = APE_SQRTF(af) + APE_SQRTF(rf);
	const float g = den > 0.0f ? d / den : 0.0f;

	return -(delta * d + beta * APE_LOG1PF(d / (1.0f + rf)) + gamma * g);
}

/*
 * sin and cos of a seed angle a (APE_REAL, any size): reduced by pi/2 in APE_REAL with a
 * two-part constant (exact for the angles of distances up to ~2^30 tokens at omega = 1 in
 * double), then Cephes' float polynomials on [-pi/4, pi/4] (error about 1 ulp there) and the
 * quadrant's swap and signs. Every backend seeds its rotation recurrence with this one, so they
 * round alike; a builtin float sincos took a quarter of the OpenCL kernel's time on PoCL (it
 * reduces every argument again, large ones included), this is a dozen fmas.
 */
APE_FN ape_vfloat ape_seed_sincos(ape_vreal a, ape_vfloat *cosine)
{
	/* Past the exact range (|a| beyond about 2^50 in double: distances near the int64 ends),
	 * k is not the nearest quadrant and rr can leave [-pi/4, pi/4] by thousands, where the
	 * polynomials grow without bound: clamped to 0.79 (untouched inside the range), the result
	 * stays a rotation, an arbitrary one as from any float arithmetic at such angles, so that
	 * norms (and the skip bound, which assumes them kept) hold. */
#if APE_REAL_BITS == 64
	const ape_vreal k = rint(a * 0.6366197723675814);
	const ape_vreal rr = fmin(fmax(fma(-k, 6.123233995736766e-17,
					    fma(-k, 1.5707963267948966, a)),
				       (ape_vreal)-0.79),
				  (ape_vreal)0.79);
#else
	const ape_vreal k = rint(a * 0.63661977236f);
	const ape_vreal rr = fmin(fmax(fma(-k, -4.371139e-8f, fma(-k, 1.5707963705f, a)),
				       (ape_vreal)-0.79f),
				  (ape_vreal)0.79f);
#endif
	const ape_vint q = APE_V_INT(k - (ape_real)4 * floor(k * (ape_real)0.25)); /* k mod 4 */
	const ape_vfloat r = APE_V_FLOAT(rr), r2 = r * r;
	const ape_vfloat sr = APE_FMAF(r * r2,
				       APE_FMAF(r2, APE_FMAF(r2, -1.9515295891e-4f, 8.3321608736e-3f),
						-1.6666654611e-1f),
				       r);
	const ape_vfloat cr = APE_FMAF(r2 * r2,
				       APE_FMAF(r2,
						APE_FMAF(r2, 2.443315711809948e-5f,
							 -1.388731625493765e-3f),
						4.166664568298827e-2f),
				       APE_FMAF(r2, -0.5f, 1.0f));
	const ape_vint odd = (q & 1) != 0;
	const ape_vfloat s = APE_V_SELECT(sr, cr, odd), c = APE_V_SELECT(cr, sr, odd);

	*cosine = APE_V_SELECT(c, -c, ((q + 1) & 2) != 0); /* negative in quadrants 1 and 2 */
	return APE_V_SELECT(s, -s, (q & 2) != 0); /* negative in quadrants 2 and 3 */
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

/*
 * ape_may_skip() with the tail's weight given in units of the bound at its nearest distance an
 * (`weight` > 0): ape_tail_count() where the keys sit one per distance, the key count itself
 * where several may share one (explicit positions with repeats: the per-tile bound of
 * docs/kernels.md, "Ragged launches").
 */
APE_FN int ape_may_skip_weighed(ape_real lambda, ape_real delta, ape_real beta, ape_real gamma,
				ape_real abs_scale, ape_real qnorm, ape_real kmax, ape_real an,
				ape_real weight, ape_real crow, ape_real m, ape_real l,
				ape_real prior, ape_real tol)
{
	ape_real u;

	if (prior > m) {
		l = l * exp(m - prior) + (ape_real)1;
		m = prior;
	} else if (prior > -(ape_real)INFINITY) {
		l += exp(prior - m);
	}
	u = ape_score_bound(lambda, delta, beta, gamma, abs_scale, qnorm, kmax, an) - crow;
	return ape_tail_negligible(u, m, l, weight, tol);
}

/*
 * May a row leave out `count` keys, none nearer than distance an, whose norms are at most kmax
 * (the bound of docs/kernels.md)? The row's own computed keys have maximum m and denominator l,
 * in natural-log units and in the row's frame shifted by crow (c_row: scores minus crow); prior
 * is the LSE that earlier launches found over other keys (lse_prior), in the same frame: -inf
 * or NaN when nothing is known, and then unused. Both kinds of weight found count against the
 * tail. Only valid with delta, beta, gamma >= 0.
 */
APE_FN int ape_may_skip(ape_real lambda, ape_real delta, ape_real beta, ape_real gamma,
			ape_real abs_scale, ape_real qnorm, ape_real kmax, ape_real an,
			ape_real count, ape_real crow, ape_real m, ape_real l, ape_real prior,
			ape_real tol)
{
	if (count <= (ape_real)0)
		return 1;
	return ape_may_skip_weighed(lambda, delta, beta, gamma, abs_scale, qnorm, kmax, an,
				    ape_tail_count(count, delta), crow, m, l, prior, tol);
}

/*
 * The backward pass's tail count (docs/kernels.md, "Skipping in the backward pass"): an upper
 * bound of sum_k max(1, an + k) exp(-delta k) over `count` keys at distances an, an + 1, ...
 * (one key per distance, as in one row): the keys' weight, each key weighed by its distance
 * (the parameter gradients and the alpha path weigh a pair by up to |n|), in units of the
 * weight bound at the nearest distance an. The smaller of the plain sum of the factors and,
 * with delta > 0, the geometric series' closed form (an + 1) / (1 - e^-delta) +
 * e^-delta / (1 - e^-delta)^2; the 1.001 absorbs its rounding.
 */
APE_FN ape_real ape_bwd_tail_count(ape_real count, ape_real an, ape_real delta)
{
	const ape_real a1 = an + (ape_real)1;
	const ape_real flat = count * a1 + count * (count - (ape_real)1) / (ape_real)2;
	ape_real q, geo;

	if (!(delta > (ape_real)0))
		return flat;
	q = -expm1(-delta);
	geo = (ape_real)1.001 * (a1 / q + exp(-delta) / (q * q));
	return geo < flat ? geo : flat;
}

/*
 * May the backward pass leave out, for one row, `count` keys at distances an, an + 1, ...,
 * whose norms are at most kmax (qnorm: the row's |q| bound, lse: its saved LSE)? True when
 * their weights P_ij = exp(s_ij - LSE_i), each weighed by max(1, |n|), add up to at most
 * tol / (1 + tol) of the row's whole weight (1): then every gradient's share of those keys is at
 * most tol times what the row's computed keys carry (the bound and its proof: docs/kernels.md).
 * Only valid with delta, beta, gamma >= 0 and lambda >= 0. A row whose LSE is not finite (no
 * key, NaN) never skips.
 */
APE_FN int ape_bwd_may_skip(ape_real lambda, ape_real delta, ape_real beta, ape_real gamma,
			    ape_real abs_scale, ape_real qnorm, ape_real kmax, ape_real an,
			    ape_real count, ape_real lse, ape_real tol)
{
	ape_real u;

	if (count <= (ape_real)0)
		return 1;
	if (!(tol > (ape_real)0) || !(lse > -(ape_real)INFINITY) || !(lse < (ape_real)INFINITY) ||
	    !(lambda >= (ape_real)0))
		return 0;
	u = ape_score_bound(lambda, delta, beta, gamma, abs_scale, qnorm, kmax, an) - lse;
	return u + log(ape_bwd_tail_count(count, an, delta)) <= log(tol) - log1p(tol);
}

/* Merges a partial result (m2, l2) into (m, l) and returns the factors that rescale the two
 * accumulators: acc = acc * c1 + acc2 * c2. Both maxima may be -INFINITY (no key yet). */
APE_FN ape_real ape_merge_max(ape_real m1, ape_real m2)
{
	return m1 > m2 ? m1 : m2;
}

/*
 * The backward's exponent s_ij - LSE_i of P_ij = exp(s_ij - LSE_i), at most 0: P <= 1 holds
 * for the exact LSE, but the LSE a caller passes is float32, and beyond |LSE| = 2^24 (decay at
 * distances past about 1e7 / delta) it can round below a row's own score by up to 2^-24 |LSE|:
 * exp would overflow to inf and the gradients turn NaN. NaN stays NaN. Every backward kernel
 * takes its exponent through this rule (APE_BWD_EXPONENT for scalars of any type; OpenCL's
 * vectors the same test through APE_V_SELECT).
 */
#define APE_BWD_EXPONENT(x) ((x) > 0 ? 0 : (x))

/*
 * The online softmax's underflow cutoff, in natural-log units: every kernel takes a weight
 * exp(x), x = score - running max, below it as an exact zero (e^-87 = 1.6e-38, about FLT_MIN:
 * below, float32 exp turns subnormal, which devices flush or keep differently, and a weight
 * that small cannot change a row's float32 result). APE_EXP2_CUTOFF is the same in log2 units,
 * for kernels that keep scores times log2(e) (CUDA's ex2()).
 */
#define APE_EXP_CUTOFF (-87.0f)
#define APE_EXP2_CUTOFF (APE_EXP_CUTOFF * 1.44269504f)

APE_FN ape_real ape_merge_factor(ape_real m_old, ape_real m_new)
{
	/* exp(-inf - -inf) would be NaN; an empty side contributes nothing */
	return m_old == -(ape_real)INFINITY ? (ape_real)0 : exp(m_old - m_new);
}

/*
 * The merge of two partial results of one row over disjoint keys (struct ape_be_merge in
 * core/backend.h: what attention_merge does on a device), by their LSE l1 and l2: returns
 * APE_MERGE_BOTH with the merged LSE in *l and each side's weight w_i = exp(l_i - *l) and its
 * log lw_i = l_i - *l (w1 + w2 = 1 to rounding at any |l_i|); APE_MERGE_KEEP when the second side saw no key (l2 = -inf),
 * APE_MERGE_TAKE when only it did (l1 = -inf), APE_MERGE_NAN when either is NaN or +inf.
 */
#define APE_MERGE_BOTH 0
#define APE_MERGE_KEEP 1
#define APE_MERGE_TAKE 2
#define APE_MERGE_NAN 3

APE_FN int ape_merge_lse(ape_real l1, ape_real l2, ape_real *l, ape_real *w1, ape_real *w2,
			 ape_real *lw1, ape_real *lw2)
{
	ape_real m, d, t;

	if (l1 != l1 || l2 != l2 || l1 == (ape_real)INFINITY || l2 == (ape_real)INFINITY)
		return APE_MERGE_NAN;
	if (l2 == -(ape_real)INFINITY)
		return APE_MERGE_KEEP;
	if (l1 == -(ape_real)INFINITY)
		return APE_MERGE_TAKE;
	/*
	 * The weights come from the difference d alone, never from l_i - *l: at |LSE| beyond
	 * 2^53 (decay at distances near 2^62) *l rounds to the larger side, l_i - *l would give
	 * both sides weight 1 and the merged row would sum to 2. t = ln(1 + e^d) is in [0, ln 2].
	 */
	m = l1 > l2 ? l1 : l2;
	d = l1 > l2 ? l2 - l1 : l1 - l2; /* <= 0 */
	t = log1p(exp(d));
	*l = m + t;
	*lw1 = l1 > l2 ? -t : d - t;
	*lw2 = l1 > l2 ? d - t : -t;
	*w1 = exp(*lw1);
	*w2 = exp(*lw2);
	return APE_MERGE_BOTH;
}

/* The merged entropy of two sides (docs/diagnostics.md, the merge rule): sum_i w_i (ENT_i -
 * ln w_i); a side of weight 0 adds nothing (its ln w is -inf). */
APE_FN ape_real ape_merge_entropy(ape_real w1, ape_real e1, ape_real lw1, ape_real w2,
				  ape_real e2, ape_real lw2)
{
	return (w1 > (ape_real)0 ? w1 * (e1 - lw1) : (ape_real)0) +
	       (w2 > (ape_real)0 ? w2 * (e2 - lw2) : (ape_real)0);
}

/* ---- Diagnostics (APE-SPEC.md, "Attention entropy"; docs/diagnostics.md): the row's entropy
 * ENT = LSE - sum_j P_j s_j and mean distance MD = sum_j P_j |n_j|, from two running sums kept
 * beside the softmax denominator l = sum_j exp(x_j), x_j = s_j - m (m the running maximum):
 *     S1 = sum_j exp(x_j) x_j,   S2 = sum_j exp(x_j) |n_j|,
 * so that ENT = ln l - S1 / l and MD = S2 / l (the frame m cancels: both stay O(ln L) and
 * O(|n|) whatever the scores' size). One rule serves keys and partial results alike: a partial
 * result (LSE_c, ENT_c, MD_c) of a set of keys enters as one "key" of score LSE_c that carries
 * its own entropy, adding exp(x_c) (x_c - ENT_c) to S1 and exp(x_c) MD_c to S2, x_c = LSE_c - m
 * (a single key is the case ENT_c = 0, MD_c = |n|). That is the merge rule
 *     ENT = sum_c w_c (ENT_c - ln w_c),  MD = sum_c w_c MD_c,  w_c = exp(LSE_c - LSE). */

/* S1 when the maximum moves from m_old to m_new >= m_old, with c = ape_merge_factor(m_old,
 * m_new) and l the denominator before the move: exp(x - m_new) (x - m_new) summed = c (S1 +
 * (m_old - m_new) l). S2 rescales like l (times c). Nothing yet (c = 0): 0, never NaN.
 * APE_DIAG_RESCALE_S1 is the formula for any arithmetic type (the OpenCL kernel's vectors,
 * which guard c = 0 and m_old = m_new themselves). */
#define APE_DIAG_RESCALE_S1(s1, l, c, dm) ((c) * ((s1) + (dm) * (l))) /* any type; dm finite */

APE_FN ape_real ape_diag_rescale_s1(ape_real s1, ape_real l, ape_real c, ape_real m_old,
				    ape_real m_new)
{
	return c > (ape_real)0 ? APE_DIAG_RESCALE_S1(s1, l, c, m_old - m_new) : (ape_real)0;
}

/* One term of S1: weight e = exp(x) of a key (ent = 0) or partial result (ent = ENT_c) at
 * x = score - m. */
APE_FN ape_real ape_diag_s1_term(ape_real e, ape_real x, ape_real ent)
{
	return e > (ape_real)0 ? e * (x - ent) : (ape_real)0;
}

/* ape_diag_s1_term() of a key (ent = 0) in float32, for kernels that keep the sums in float
 * (the CUDA kernels, in log2 units: the term is linear in x, so S1 scales with the units) */
APE_FN float ape_diag_s1_term_f(float e, float x)
{
	return e > 0.0f ? e * x : 0.0f;
}

/* ENT = ln l - S1 / l, 0 without a visible key (l = 0); never below 0 (it is an entropy: only
 * rounding could take it there). */
APE_FN ape_real ape_diag_entropy(ape_real l, ape_real s1)
{
	ape_real e;

	if (!(l > (ape_real)0))
		return l == l ? (ape_real)0 : l;
	e = log(l) - s1 / l;
	return e > (ape_real)0 ? e : e == e ? (ape_real)0 : e;
}

/* MD = S2 / l, 0 without a visible key */
APE_FN ape_real ape_diag_distance(ape_real l, ape_real s2)
{
	return l > (ape_real)0 ? s2 / l : l == l ? (ape_real)0 : l;
}

/*
 * The skip_tol a call with diagnostics runs under (docs/diagnostics.md, "Skipping"): keys of
 * total weight eta <= tol left out change ENT by at most eta (1 + ln(1/eta)) + eta ln Lk and MD
 * by at most eta max|n|; at tol = 2^-24 that is below 4e-6 in ENT for any Lk < 2^63 (a
 * twenty-fifth of the float32 LSE tolerance 1e-4) and 6e-8 max|n| in MD. A caller's larger
 * skip_tol is tightened to this for calls that want diagnostics.
 */
#define APE_DIAG_SKIP_TOL 0x1p-24

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
 * APE_GRAD_DDOT_DALPHA_THETA is the share times alpha, for any arithmetic type (the OpenCL
 * kernel evaluates it on vectors of pairs and divides the row's sum by alpha once).
 */
#define APE_GRAD_DDOT_DALPHA_THETA(x, y, u, w, c, s, theta)                                       \
	((((x) * (u) + (y) * (w)) * (s) - ((x) * (w) - (y) * (u)) * (c)) * (theta))

APE_FN ape_real ape_grad_ddot_dalpha(ape_real x, ape_real y, ape_real u, ape_real w, ape_real c,
				     ape_real s, ape_real theta, ape_real alpha)
{
	return APE_GRAD_DDOT_DALPHA_THETA(x, y, u, w, c, s, theta) / alpha;
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
