/* SPDX-License-Identifier: MIT */
/*
 * The example's kernels: APE attention (docs/ape.md, "Definition") and its exact gradients
 * ("Gradients"), one query row at a time, in float64, every visible key, every formula taken
 * from ape/ape_math.h so that the results agree with every other backend's. Written to be read,
 * not to be fast: a vendor replaces these two functions with launches of its own kernels, which
 * include ape/ape_math.h in the same way (it is plain C that OpenCL C and CUDA compile too).
 *
 * What the core hands these (struct ape_be_launch in ape/ape_backend.h) depends on the
 * capabilities the device states. This one states neither segments, positions, diag nor
 * host_memory, and has no attention_pages op, so a launch is always one dense problem at
 * q_start/k_start, with no diagnostics and no KV pages; its tensors are contiguous, or strided
 * views on the caller's device buffers (ape_attention_enqueue()), read through
 * ape_be_launch_view() either way. lse and pairs may be NULL; lse_prior, skip_tol and the
 * device parameter tables params[] are ignored (nothing is skipped; head_params is read).
 */
#include <math.h>
#include <stdbool.h>
#include <string.h>

#define APE_REAL double /* the formulas' arithmetic (ape/ape_math.h): float64 on the host */
#include "ape/ape_math.h"
#include "example.h"

/* ---- storage types: float32, float16, bfloat16 (O also float32; dO in either) */

static float f16_to_float(uint16_t h)
{
	const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
	uint32_t u;
	float f;

	if (e == 0) /* zero or subnormal: m 2^-24, exact */
		return (sign ? -1.0f : 1.0f) * ldexpf((float)m, -24);
	u = sign | (e == 0x1f ? 0x7f800000u : (e + 112) << 23) | m << 13; /* Inf, NaN or normal */
	memcpy(&f, &u, sizeof(f));
	return f;
}

/* Rounded to nearest even; overflow gives Inf, a NaN stays a NaN. */
static uint16_t float_to_f16(float f)
{
	uint32_t u, sign, mag;

	memcpy(&u, &f, sizeof(u));
	sign = (u >> 16) & 0x8000u;
	mag = u & 0x7fffffffu;
	if (mag > 0x7f800000u) /* NaN: quiet, the payload's top bits kept */
		return (uint16_t)(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
	if (mag >= 0x477ff000u) /* rounds to 65520 or more: Inf */
		return (uint16_t)(sign | 0x7c00u);
	if (mag >= 0x38800000u) { /* a normal half: rebias 127 -> 15, round the 13 bits dropped */
		mag -= 0x38000000u;
		return (uint16_t)(sign | ((mag + 0xfffu + ((mag >> 13) & 1u)) >> 13));
	}
	/* subnormal or zero: |f| 2^24 is exact, and rint() rounds it to nearest even */
	return (uint16_t)(sign | (uint32_t)rintf(fabsf(f) * 0x1p24f));
}

static float bf16_to_float(uint16_t h)
{
	const uint32_t u = (uint32_t)h << 16;
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static uint16_t float_to_bf16(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
	return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a tensor of type t, as a double (exact for every storage type). */
static double load(const void *base, ape_dtype t, int64_t i)
{
	switch (t) {
	case APE_F16:
		return f16_to_float(((const uint16_t *)base)[i]);
	case APE_BF16:
		return bf16_to_float(((const uint16_t *)base)[i]);
	default:
		return ((const float *)base)[i];
	}
}

/* Stores x as type t: rounded to float32, then to the 16-bit type (as the reference does). */
static void store(void *base, ape_dtype t, int64_t i, double x)
{
	switch (t) {
	case APE_F16:
		((uint16_t *)base)[i] = float_to_f16((float)x);
		break;
	case APE_BF16:
		((uint16_t *)base)[i] = float_to_bf16((float)x);
		break;
	default:
		((float *)base)[i] = (float)x;
	}
}

static void load_row(double *dst, const void *base, ape_dtype t, int64_t at, int64_t D)
{
	for (int64_t d = 0; d < D; d++)
		dst[d] = load(base, t, at + d);
}

/* Where row (b, h, i) of tensor t (APE_BE_T_*) of l begins, in elements of its type. */
static int64_t row_at(const struct ape_be_launch *l, int t, int64_t b, int64_t h, int64_t i)
{
	const struct ape_be_view v = ape_be_launch_view(l, t);

	return v.off + b * v.sb + h * v.sh + i * v.sl;
}

/* ---- the pieces of a score */

/* sigma_i of a query row (ape_sigma(): the mean first, then the squares), its mean in *mean */
static double row_sigma(const double *q, int64_t D, double *mean)
{
	double m = 0, ss = 0;

	for (int64_t d = 0; d < D; d++)
		m += q[d];
	m /= (double)D;
	for (int64_t d = 0; d < D; d++)
		ss += (q[d] - m) * (q[d] - m);
	*mean = m;
	return ape_sigma(ss, (int)D);
}

/* The components of rotation pair p: (p, p + D/2) in the half layout, (2p, 2p + 1) interleaved. */
static void pair_of(const struct ape_be_launch *l, int64_t p, int64_t *a, int64_t *b)
{
	*a = l->layout == APE_ROPE_HALF ? p : 2 * p;
	*b = l->layout == APE_ROPE_HALF ? p + l->D / 2 : 2 * p + 1;
}

/*
 * The rotated dot product of query q and key k at distance n (docs/ape.md): pair p turns by
 * theta_p = n omega_p / alpha. For the gradients, each of cs, sn (the pairs' cos and sin) and
 * ddot_dalpha (d(dot)/d(alpha)) is filled when not NULL.
 */
static double rotated_dot(const struct ape_be_launch *l, const double *q, const double *k,
			  int64_t n, double alpha, double *cs, double *sn, double *ddot_dalpha)
{
	double dot = 0, dd = 0;

	for (int64_t p = 0; p < l->D / 2; p++) {
		const double theta = (double)n * l->omega[p] / alpha;
		const double c = cos(theta), s = sin(theta);
		double x, y, u, w;
		int64_t a, b;

		pair_of(l, p, &a, &b);
		x = q[a];
		y = q[b];
		u = k[a];
		w = k[b];
		dot += (x * u + y * w) * c + (x * w - y * u) * s;
		if (ddot_dalpha)
			dd += ape_grad_ddot_dalpha(x, y, u, w, c, s, theta, alpha);
		if (cs) {
			cs[p] = c;
			sn[p] = s;
		}
	}
	if (ddot_dalpha)
		*ddot_dalpha = dd;
	return dot;
}

/* ---- forward */

/*
 * Query row (b, h, i): O_i = softmax(s_i.) V over its visible keys, with an online softmax
 * (running maximum m, denominator sum, accumulator acc, all float64). A row without a visible
 * key gets O 0 and LSE -inf; a non-finite score (NaN or Inf in an input) makes the row NaN.
 */
static void forward_row(const struct ape_be_launch *l, int64_t b, int64_t h, int64_t i)
{
	const int64_t D = l->D, hk = h / (l->H / l->Hkv), pos = l->q_start + i;
	const float *prm = l->head_params + 4 * h; /* delta, beta, gamma, lambda */
	const int64_t kat = row_at(l, APE_BE_T_K, b, hk, 0), vat = row_at(l, APE_BE_T_V, b, hk, 0);
	const int64_t ksl = ape_be_launch_view(l, APE_BE_T_K).sl;
	const int64_t vsl = ape_be_launch_view(l, APE_BE_T_V).sl;
	double q[APE_MAX_D] = { 0 }, k[APE_MAX_D], acc[APE_MAX_D];
	double mean, alpha, m = -INFINITY, sum = 0;
	float *lse = example_ptr(l->lse);
	uint64_t *pairs = example_ptr(l->pairs), seen = 0;
	bool bad = false;

	load_row(q, example_ptr(l->q), l->in_dtype, row_at(l, APE_BE_T_Q, b, h, i), D);
	alpha = ape_alpha(prm[3], row_sigma(q, D, &mean));
	memset(acc, 0, sizeof(acc));
	for (int64_t j = 0; j < l->Lk; j++) {
		const int64_t n = pos - (l->k_start + j); /* the core validated that it fits */
		const double an = fabs((double)n);
		double dot, s, w;

		if (l->causal && n < 0)
			continue;
		seen++;
		load_row(k, example_ptr(l->k), l->in_dtype, kat + j * ksl, D);
		dot = rotated_dot(l, q, k, n, alpha, NULL, NULL, NULL);
		/* plus the caller's distance-bias table, when the launch has one (ABI 1.1) */
		s = ape_temp(prm[3], an) * l->scale * dot + ape_bias(prm[0], prm[1], prm[2], an) +
		    ape_be_bias_at(l, h, ape_abs_dist(n));
		if (!isfinite(s)) {
			bad = true;
			continue;
		}
		if (s > m) { /* a new maximum: rescale what was summed so far */
			const double c = ape_merge_factor(m, s);

			sum *= c;
			for (int64_t d = 0; d < D; d++)
				acc[d] *= c;
			m = s;
		}
		w = exp(s - m);
		sum += w;
		for (int64_t d = 0; d < D; d++)
			acc[d] += w * load(example_ptr(l->v), l->in_dtype, vat + j * vsl + d);
	}
	for (int64_t d = 0; d < D; d++)
		store(example_ptr(l->o), l->out_dtype, row_at(l, APE_BE_T_O, b, h, i) + d,
		      bad ? NAN : sum > 0 ? acc[d] / sum : 0.0);
	if (lse)
		lse[row_at(l, APE_BE_T_LSE, b, h, i)] = bad ? NAN : sum > 0 ? (float)(m + log(sum))
								 : -INFINITY;
	if (pairs) /* contiguous [B, H, Lq] whatever the views: the visible pairs computed */
		pairs[(b * l->H + h) * l->Lq + i] = seen;
}

void example_attention(const struct ape_be_launch *l)
{
	ape_be_path_note(l->path, APE_BE_PATH_GENERAL, "example plugin: plain C, float64");
	for (int64_t b = 0; b < l->B; b++)
		for (int64_t h = 0; h < l->H; h++)
			for (int64_t i = 0; i < l->Lq; i++)
				forward_row(l, b, h, i);
}

/* ---- backward (APE-SPEC.md, "Gradients"; docs/ape.md: how it is computed) */

/* What the gradients need of one query row, from the launch's inputs (contiguous, as every
 * backward launch is). */
struct grad_row {
	double q[APE_MAX_D], dout[APE_MAX_D];
	double mean, sigma, alpha; /* of q */
	double lse; /* the saved LSE_i, over every key of the row */
	double dl; /* Dl_i - dLSE_i, Dl_i = dO_i . O_i: dS_ij = P_ij (dO_i . V_j - dl) */
	const float *prm; /* delta, beta, gamma, lambda of its head */
	int64_t h; /* its head */
	int64_t pos; /* its position */
};

static void grad_row_load(const struct ape_be_bwd_launch *l, int64_t row, struct grad_row *r)
{
	const struct ape_be_launch *f = &l->f;
	const float *lse = example_ptr(f->lse), *dlse = example_ptr(l->dlse);
	double o[APE_MAX_D], dl = 0;

	load_row(r->q, example_ptr(f->q), f->in_dtype, row * f->D, f->D);
	load_row(r->dout, example_ptr(l->dout), l->dout_dtype, row * f->D, f->D);
	load_row(o, example_ptr(f->o), f->out_dtype, row * f->D, f->D);
	for (int64_t d = 0; d < f->D; d++)
		dl += r->dout[d] * o[d];
	r->dl = dl - (dlse ? dlse[row] : 0.0);
	r->h = row / f->Lq % f->H;
	r->prm = f->head_params + 4 * r->h;
	r->sigma = row_sigma(r->q, f->D, &r->mean);
	r->alpha = ape_alpha(r->prm[3], r->sigma);
	r->lse = lse[row];
	r->pos = f->q_start + row % f->Lq;
}

/* One visible (row, key) pair: the score's pieces, P_ij = exp(s_ij - LSE_i) and dS_ij. */
struct grad_pair {
	double cs[APE_MAX_D / 2], sn[APE_MAX_D / 2]; /* every rotation pair's cos and sin */
	double dot, ddot_dalpha, an, temp, p, ds;
};

static void grad_pair_eval(const struct ape_be_launch *f, const struct grad_row *r,
			   const double *k, const double *v, int64_t n, struct grad_pair *g)
{
	double s, dov = 0;

	g->an = fabs((double)n);
	g->temp = ape_temp(r->prm[3], g->an);
	g->dot = rotated_dot(f, r->q, k, n, r->alpha, g->cs, g->sn, &g->ddot_dalpha);
	s = g->temp * f->scale * g->dot + ape_bias(r->prm[0], r->prm[1], r->prm[2], g->an) +
	    ape_be_bias_at(f, r->h, ape_abs_dist(n));
	g->p = exp(APE_BWD_EXPONENT(s - r->lse));
	for (int64_t d = 0; d < f->D; d++)
		dov += r->dout[d] * v[d];
	g->ds = g->p * (dov - r->dl);
}

/*
 * Key j of kv head hk, batch b: dV_j = sum_i P_ij dO_i and dK_j = sum_i dS_ij temp scale
 * d(dot)/d(k_j) over every visible row of the query heads that share hk, summed in float64
 * in a fixed order, then added to the accumulators once. (Each row's terms are loaded again
 * for every key: simple, and no memory beyond the stack; a kernel keeps them per tile.)
 */
static void grad_key(const struct ape_be_bwd_launch *l, int64_t b, int64_t hk, int64_t j)
{
	const struct ape_be_launch *f = &l->f;
	const int64_t D = f->D, G = f->H / f->Hkv, krow = (b * f->Hkv + hk) * f->Lk + j;
	float *dk = example_ptr(l->dk), *dv = example_ptr(l->dv);
	double k[APE_MAX_D], v[APE_MAX_D], sk[APE_MAX_D], sv[APE_MAX_D];
	struct grad_row r;
	struct grad_pair g;

	load_row(k, example_ptr(f->k), f->in_dtype, krow * D, D);
	load_row(v, example_ptr(f->v), f->in_dtype, krow * D, D);
	memset(sk, 0, sizeof(sk));
	memset(sv, 0, sizeof(sv));
	for (int64_t h = hk * G; h < (hk + 1) * G; h++)
		for (int64_t i = 0; i < f->Lq; i++) {
			const int64_t n = (f->q_start + i) - (f->k_start + j);
			double c;

			if (f->causal && n < 0)
				continue;
			grad_row_load(l, (b * f->H + h) * f->Lq + i, &r);
			grad_pair_eval(f, &r, k, v, n, &g);
			for (int64_t d = 0; d < D; d++)
				sv[d] += g.p * r.dout[d];
			c = g.ds * g.temp * f->scale;
			for (int64_t p = 0; p < D / 2; p++) { /* q's pair turned by +theta */
				int64_t a, e;

				pair_of(f, p, &a, &e);
				sk[a] += c * (r.q[a] * g.cs[p] - r.q[e] * g.sn[p]);
				sk[e] += c * (r.q[e] * g.cs[p] + r.q[a] * g.sn[p]);
			}
		}
	for (int64_t d = 0; dk && d < D; d++)
		dk[krow * D + d] += (float)sk[d];
	for (int64_t d = 0; dv && d < D; d++)
		dv[krow * D + d] += (float)sv[d];
}

/*
 * Row `row`: dQ_i (through the rotation, and through alpha_i: A_i d(alpha)/d(sigma)
 * d(sigma)/d(q)) and its share of the parameter gradients, summed over its visible keys in
 * float64, then added once. A row without a visible key adds nothing.
 */
static void grad_query(const struct ape_be_bwd_launch *l, int64_t row)
{
	const struct ape_be_launch *f = &l->f;
	const int64_t D = f->D, b = row / (f->H * f->Lq);
	const int64_t kv0 = (b * f->Hkv + row / f->Lq % f->H / (f->H / f->Hkv)) * f->Lk;
	float *dq = example_ptr(l->dq);
	double *dparams = example_ptr(l->dparams);
	/* the table's gradient: this row's head's entries (a shared table's one row) */
	double *dbias = l->dbias ? (double *)example_ptr(l->dbias) +
					   (f->bias_hstride ? (row / f->Lq % f->H) * f->bias_len : 0)
				 : NULL;
	double k[APE_MAX_D], v[APE_MAX_D], sq[APE_MAX_D], A = 0, dp[4] = { 0, 0, 0, 0 }, coef;
	struct grad_row r;
	struct grad_pair g;
	bool any = false;

	grad_row_load(l, row, &r);
	memset(sq, 0, sizeof(sq));
	for (int64_t j = 0; j < f->Lk; j++) {
		const int64_t n = r.pos - (f->k_start + j);
		double c;

		if (f->causal && n < 0)
			continue;
		any = true;
		load_row(k, example_ptr(f->k), f->in_dtype, (kv0 + j) * D, D);
		load_row(v, example_ptr(f->v), f->in_dtype, (kv0 + j) * D, D);
		grad_pair_eval(f, &r, k, v, n, &g);
		c = g.ds * g.temp * f->scale;
		A += c * g.ddot_dalpha;
		dp[0] += g.ds * ape_grad_dbias_ddelta(g.an);
		dp[1] += g.ds * ape_grad_dbias_dbeta(g.an);
		dp[2] += g.ds * ape_grad_dbias_dgamma(g.an);
		dp[3] += g.ds * f->scale * g.dot * ape_grad_dtemp_dlambda(r.prm[3], g.an);
		if (dbias) /* in key order: deterministic */
			dbias[ape_be_bias_index(ape_abs_dist(n), f->bias_len)] += g.ds;
		for (int64_t p = 0; dq && p < D / 2; p++) { /* k's pair turned by -theta */
			int64_t a, e;

			pair_of(f, p, &a, &e);
			sq[a] += c * (k[a] * g.cs[p] + k[e] * g.sn[p]);
			sq[e] += c * (k[e] * g.cs[p] - k[a] * g.sn[p]);
		}
	}
	if (!any)
		return;
	dp[3] += A * ape_grad_gate(r.sigma); /* lambda's path through alpha_i */
	for (int x = 0; dparams && x < 4; x++)
		dparams[4 * (row / f->Lq % f->H) + x] += dp[x];
	coef = A * ape_grad_dalpha_dsigma(r.prm[3], r.sigma) *
	       ape_grad_dsigma_coef((double)D, r.sigma);
	for (int64_t d = 0; dq && d < D; d++)
		dq[row * D + d] += (float)(sq[d] + coef * (r.q[d] - r.mean));
}

void example_attention_backward(const struct ape_be_bwd_launch *l)
{
	const struct ape_be_launch *f = &l->f;

	ape_be_path_note(f->path, APE_BE_PATH_BACKWARD, "example plugin: plain C, float64");
	if (l->dk || l->dv) /* keys outer: dK, dV */
		for (int64_t b = 0; b < f->B; b++)
			for (int64_t hk = 0; hk < f->Hkv; hk++)
				for (int64_t j = 0; j < f->Lk; j++)
					grad_key(l, b, hk, j);
	if (l->dq || l->dparams || l->dbias) /* rows outer: dQ, the parameters, the table */
		for (int64_t row = 0; row < f->B * f->H * f->Lq; row++)
			grad_query(l, row);
}
