/* SPDX-License-Identifier: MIT */
/*
 * The transfer plan: which key rows each query block needs, proved with the spec's skip bound
 * from per-block norm bounds (docs/distributed.md has the proof). Pure functions on host data;
 * every rank computes only its own needs, and the ranks exchange the resulting row ranges, so
 * sender and receiver never depend on rounding agreeing between machines.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_internal.h"

#define APE_REAL double
#include "ape/ape_math.h"

void ape__mpi_block(const struct ape__mpi_geom *g, int b, int64_t *start, int64_t *count,
		    int *owner, int *lb)
{
	ape__mpi_part(g->L, g->nblocks, b, start, count);
	if (g->kind == APE_MPI_SHARD_CONTIGUOUS || b < g->nranks) {
		*owner = b;
		*lb = 0;
	} else {
		*owner = g->nblocks - 1 - b;
		*lb = 1;
	}
}

int ape__mpi_block_of(const struct ape__mpi_geom *g, int r, int lb)
{
	return lb == 0 ? r : g->nblocks - 1 - r;
}

/* Row l of (b, h) of t, as floats; the strides are t's own or row-major. */
static void load_row(const ape_tensor *t, int64_t b, int64_t h, int64_t l, float *row)
{
	const int64_t D = t->shape[3];
	const size_t es = ape_dtype_size(t->dtype);
	int64_t s[4];
	uint16_t tmp[APE_MAX_D];
	const char *p;

	ape_tensor_strides(t, s);
	p = (const char *)t->data + (size_t)(b * s[0] + h * s[1] + l * s[2]) * es;
	for (int64_t d = 0; d < D; d++) {
		if (t->dtype == APE_F32)
			memcpy(row + d, p + (size_t)(d * s[3]) * es, sizeof(float));
		else
			memcpy(tmp + d, p + (size_t)(d * s[3]) * es, sizeof(uint16_t));
	}
	if (t->dtype != APE_F32)
		ape_convert(row, APE_F32, tmp, t->dtype, (size_t)D);
}

/* Euclidean norm in double; NaN or Inf anywhere gives +inf, never a norm that looks small. */
static double norm(const float *x, int64_t D)
{
	double ss = 0;

	for (int64_t d = 0; d < D; d++)
		ss += (double)x[d] * x[d];
	return ss < INFINITY ? sqrt(ss) : INFINITY;
}

int ape__mpi_key_max(const struct ape__mpi_geom *g, const ape_tensor *k, int64_t off, int64_t n,
		     float *kmax)
{
	float row[APE_MAX_D];

	for (int64_t b = 0; b < g->B; b++)
		for (int64_t h = 0; h < g->Hkv; h++) {
			double m = 0;

			for (int64_t i = 0; i < n; i++) {
				load_row(k, b, h, off + i, row);
				m = fmax(m, norm(row, g->D));
			}
			/* rounded up: the float still bounds every norm */
			kmax[b * g->Hkv + h] = m < INFINITY ? nextafterf((float)m, INFINITY)
							     : INFINITY;
		}
	return 0;
}

int ape__mpi_query_summary(const struct ape__mpi_geom *g, const ape_tensor *q,
			   const ape_tensor *k, int64_t off, int64_t n, double *qmax,
			   double *lse_lb)
{
	/* Row i's own key (the same global row) is always on this rank: its score bounds the
	 * row's log-denominator from below, with no computation. d = its distance. It is always
	 * computed: a tail holding it weighs at least exp(LB), so it can never be proved to weigh
	 * below tol * exp(LB) with tol < 1. */
	const int64_t d = g->q0 - g->k0, group = g->H / g->Hkv;
	const bool visible = !g->causal || d >= 0;
	const double an = fabs((double)d);
	float qr[APE_MAX_D], kr[APE_MAX_D];

	for (int64_t b = 0; b < g->B; b++)
		for (int64_t h = 0; h < g->H; h++) {
			const float *p = g->prm + 4 * h;
			double qm = 0, lb = n > 0 && visible ? INFINITY : -INFINITY;

			for (int64_t i = 0; i < n; i++) {
				double qn, s;

				load_row(q, b, h, off + i, qr);
				load_row(k, b, h / group, off + i, kr);
				qn = norm(qr, g->D);
				qm = fmax(qm, qn);
				if (!visible)
					continue;
				s = -ape_temp(p[3], an) * g->abs_scale * qn * norm(kr, g->D) +
				    ape_bias(p[0], p[1], p[2], an);
				lb = s == s ? fmin(lb, s) : -INFINITY; /* NaN proves nothing */
			}
			qmax[b * g->H + h] = qm;
			lse_lb[b * g->H + h] = lb;
		}
	return 0;
}

static int64_t clamp(int64_t x, int64_t L)
{
	return x < 0 ? 0 : x > L ? L : x;
}

int64_t ape__mpi_visible_end(const struct ape__mpi_geom *g, int64_t a, int64_t n)
{
	/* the last row's key index, rel + (a + n - 1), fits: distances were validated */
	return n > 0 ? ape_visible_keys(g->q0 - g->k0 + (a + n - 1), g->L, g->causal) : 0;
}

/* Largest key norm per (batch, kv head) over the blocks that hold rows of [j0, j1). */
static void tail_kmax(const struct ape__mpi_geom *g, const float *kmax, int64_t j0, int64_t j1,
		      float *out)
{
	const int64_t nbg = g->B * g->Hkv;

	for (int64_t i = 0; i < nbg; i++)
		out[i] = 0;
	for (int b = 0; b < g->nblocks; b++) {
		int64_t s, c;
		int owner, lb;

		ape__mpi_block(g, b, &s, &c, &owner, &lb);
		if (c == 0 || s + c <= j0 || s >= j1)
			continue;
		for (int64_t i = 0; i < nbg; i++)
			out[i] = fmaxf(out[i], kmax[(int64_t)b * nbg + i]);
	}
}

/*
 * True when the keys [j0, j1), all on one side of every query of the block, at distance >= nmin
 * from each, weigh at most tol of every row's denominator: for every (batch, head),
 *   ape_tail_count(keys, delta) * exp(bound(nmin) - lse_lb) <= tol.
 */
static bool tail_ok(const struct ape__mpi_geom *g, const float *kmax, const double *qmax,
		    const double *lse_lb, int64_t j0, int64_t j1, double nmin, double tol,
		    float *km)
{
	const int64_t group = g->H / g->Hkv;

	if (j0 >= j1)
		return true;
	tail_kmax(g, kmax, j0, j1, km);
	for (int64_t b = 0; b < g->B; b++)
		for (int64_t h = 0; h < g->H; h++) {
			const float *p = g->prm + 4 * h;
			const int64_t bh = b * g->H + h;
			double bound = ape_score_bound(p[3], p[0], p[1], p[2], g->abs_scale, qmax[bh],
						       km[b * g->Hkv + h / group], nmin);
			double count = ape_tail_count((double)(j1 - j0), p[0]);

			if (!ape_tail_negligible(bound, lse_lb[bh], 1.0, count, tol))
				return false;
		}
	return true;
}

void ape__mpi_needed(const struct ape__mpi_geom *g, const float *kmax, const double *qmax,
		     const double *lse_lb, int64_t a, int64_t n, int64_t *lo, int64_t *hi)
{
	/* key index of the position of query row a: rel + a (fits: distances were validated) */
	const int64_t rel = g->q0 - g->k0, qa = rel + a, qz = rel + (a + n - 1);
	const int64_t vis_hi = g->causal ? ape_visible_keys(qz, g->L, 1) : g->L;
	const int64_t pmax = clamp(qa, g->L), pmin = ape_visible_keys(qz, g->L, 1);
	const double tol = g->causal ? g->tol_plan : g->tol_plan / 2;
	float *km;
	int64_t l, h, mid;

	*lo = 0;
	*hi = vis_hi;
	if (n == 0) {
		*hi = 0;
		return;
	}
	km = malloc((size_t)(g->B * g->Hkv) * sizeof(float) + 1);
	if (!g->can_skip || !km) { /* no memory for the proof: keep everything, still exact */
		free(km);
		return;
	}
	/* backward: the largest p in [0, pmax] whose tail [0, p) is negligible; the tails
	 * shrink with p, and so does their bound, so the test is monotone */
	l = 0;
	h = pmax;
	if (tail_ok(g, kmax, qmax, lse_lb, 0, h, (double)qa - (double)(h - 1), tol, km)) {
		l = h;
	} else {
		while (h - l > 1) { /* ok(l), !ok(h) */
			mid = l + (h - l) / 2;
			if (tail_ok(g, kmax, qmax, lse_lb, 0, mid, (double)qa - (double)(mid - 1),
				    tol, km))
				l = mid;
			else
				h = mid;
		}
	}
	*lo = l;
	if (!g->causal) {
		/* forward: the smallest p in [pmin, L] whose tail [p, L) is negligible */
		l = pmin;
		h = g->L;
		if (tail_ok(g, kmax, qmax, lse_lb, l, g->L, (double)l - (double)qz, tol, km)) {
			h = l;
		} else {
			while (h - l > 1) { /* !ok(l), ok(h) */
				mid = l + (h - l) / 2;
				if (tail_ok(g, kmax, qmax, lse_lb, mid, g->L,
					    (double)mid - (double)qz, tol, km))
					h = mid;
				else
					l = mid;
			}
		}
		*hi = h;
	}
	free(km);
}
