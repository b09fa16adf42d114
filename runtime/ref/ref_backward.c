/* SPDX-License-Identifier: MIT */
/*
 * The reference backward pass: the formulas of APE-SPEC.md's "Gradients" section term by term,
 * in float64, every visible key, no shortcut. Other backends' gradients are tested against this
 * file, so, like ref_attention.c, it favours being obviously right over being fast.
 *
 * It has the shape the fused kernels will have, without their tiles: one pass with the keys
 * outer (dK and dV of a key summed over every row that sees it, then added once), one with the
 * rows outer (dQ, the alpha path A_i and the parameter sums of a row, then added once). Each
 * pass recomputes the scores from q, k and the saved LSE; nothing of size Lq * Lk exists. A pass
 * whose outputs are not wanted is not run: with only dparams wanted (frozen Q, K, V), the keys
 * pass is skipped and the rows pass computes no dQ vector.
 */
#include <inttypes.h>
#include <math.h> /* sincos: a GNU extension, _GNU_SOURCE comes from the Makefile */
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "ref.h"

/* What each row needs, computed once: sigma, alpha and Dl_i = dO_i . O_i over the whole row. */
struct row_info {
	double mean, sigma, alpha, lse, Dl, dlse;
};

/* One launch, decoded. */
struct bwd {
	const struct ape_be_bwd_launch *l;
	const void *q, *k, *v, *o, *dout;
	struct ape_be_view vq, vk, vv, vo, vdo; /* where they lie (contiguous unless strided) */
	const float *lse, *dlse;
	float *dq, *dk, *dv;
	double *dparams;
	double *dbias; /* the bias table's gradient: [rows][M] */
	int64_t D, P, group;
	int64_t ia[APE_MAX_D / 2], ib[APE_MAX_D / 2]; /* components of pair p */
	struct row_info *rows;
};

/* One (row, key) pair: the score's pieces and the gradient of the loss with respect to it. */
struct pair {
	double cs[APE_MAX_D / 2], sn[APE_MAX_D / 2]; /* cos and sin of theta_p */
	double dot, ddot_dalpha, an, t, P, dS;
};

/* Row `row` ((b * heads + h) * L + i) of a tensor of `heads` heads of L rows of D elements at
 * base, where view v says it lies. */
static void load_row(double *dst, const void *base, ape_dtype t, struct ape_be_view v,
		     int64_t heads, int64_t L, int64_t row, int64_t D)
{
	const int64_t bh = row / L, at = v.off + bh / heads * v.sb + bh % heads * v.sh +
					 row % L * v.sl;

	for (int64_t d = 0; d < D; d++)
		dst[d] = ape__ref_load(base, t, at + d);
}

/* Query row `row` of Q, O or dO (tensor base of type t, view v) */
static void query_row(const struct bwd *c, double *dst, const void *base, ape_dtype t,
		      struct ape_be_view v, int64_t row)
{
	load_row(dst, base, t, v, c->l->f.H, c->l->f.Lq, row, c->D);
}

/* Key row `row` of K or V */
static void key_row(const struct bwd *c, double *dst, const void *base, struct ape_be_view v,
		    int64_t row)
{
	load_row(dst, base, c->l->f.in_dtype, v, c->l->f.Hkv, c->l->f.Lk, row, c->D);
}

static double dot_d(const double *a, const double *b, int64_t D)
{
	double s = 0;

	for (int64_t d = 0; d < D; d++)
		s += a[d] * b[d];
	return s;
}

static void row_info(struct bwd *c, int64_t row)
{
	const struct ape_be_launch *f = &c->l->f;
	const int64_t D = c->D, h = row / f->Lq % f->H;
	struct row_info *ri = &c->rows[row];
	double q[APE_MAX_D], o[APE_MAX_D], dout[APE_MAX_D], ss = 0;

	query_row(c, q, c->q, f->in_dtype, c->vq, row);
	query_row(c, o, c->o, f->out_dtype, c->vo, row);
	query_row(c, dout, c->dout, c->l->dout_dtype, c->vdo, row);
	ri->mean = 0;
	for (int64_t d = 0; d < D; d++)
		ri->mean += q[d];
	ri->mean /= (double)D;
	for (int64_t d = 0; d < D; d++)
		ss += (q[d] - ri->mean) * (q[d] - ri->mean);
	ri->sigma = sqrt(ss / (double)(D - 1));
	ri->alpha = ape_alpha(f->head_params[4 * h + 3], ri->sigma);
	ri->lse = c->lse[row];
	ri->Dl = dot_d(dout, o, D);
	ri->dlse = c->dlse ? c->dlse[row] : 0.0;
}

/*
 * Score, probability and dS of query row `row` (components q, upstream gradient dout) against
 * key row `krow` (components k, values v) at distance n, with every per-pair sin and cos kept
 * for the derivatives. `alpha_path` asks for d(dot)/d(alpha) too.
 */
static void pair_eval(const struct bwd *c, int64_t row, const double *q, const double *dout,
		      const double *k, const double *v, int64_t n, bool alpha_path,
		      struct pair *pr)
{
	const struct ape_be_launch *f = &c->l->f;
	const struct row_info *ri = &c->rows[row];
	const float *prm = f->head_params + 4 * (row / f->Lq % f->H);
	double s;

	pr->dot = pr->ddot_dalpha = 0;
	for (int64_t p = 0; p < c->P; p++) {
		const double x = q[c->ia[p]], y = q[c->ib[p]], u = k[c->ia[p]], w = k[c->ib[p]];
		const double theta = (double)n * f->omega[p] / ri->alpha;

		sincos(theta, &pr->sn[p], &pr->cs[p]);
		pr->dot += (x * u + y * w) * pr->cs[p] + (x * w - y * u) * pr->sn[p];
		if (alpha_path)
			pr->ddot_dalpha += ape_grad_ddot_dalpha(x, y, u, w, pr->cs[p], pr->sn[p],
								theta, ri->alpha);
	}
	pr->an = fabs((double)n);
	pr->t = ape_temp(prm[3], pr->an);
	s = pr->t * f->scale * pr->dot + ape_bias(prm[0], prm[1], prm[2], pr->an) +
	    (double)ape_be_bias_at(f, row / f->Lq % f->H, ape_abs_dist(n));
	pr->P = exp(APE_BWD_EXPONENT(s - ri->lse));
	pr->dS = pr->P * (dot_d(dout, v, c->D) - ri->Dl + ri->dlse);
}

/*
 * The keys query row i (of every batch and head) may see, [*j0, *j1), and the positions of row i
 * and of key *j0: the whole launch's keys, or in a ragged launch (core/backend.h, struct
 * ape_be_bwd_launch, "Ragged") its segment's.
 */
static void row_keys(const struct ape_be_launch *f, int64_t i, int64_t *j0, int64_t *j1,
		     int64_t *qpos, int64_t *kpos)
{
	const struct ape_be_seg *sg = f->segs ? ape_be_launch_seg_of(f, i) : NULL;

	*j0 = sg ? sg->k0 : 0;
	*j1 = sg ? sg->k0 + sg->lk : f->Lk;
	*qpos = sg ? sg->q_start + (i - sg->q0) : f->q_start + i;
	*kpos = sg ? sg->k_start : f->k_start;
}

/* Distance of (row, key j) and whether the mask lets it through; qpos, kpos: row_keys()'s. */
static bool visible(const struct ape_be_launch *f, int64_t qpos, int64_t kpos, int64_t j0,
		    int64_t j, int64_t *n)
{
	*n = qpos - (kpos + (j - j0)); /* validated: no overflow */
	return !f->causal || *n >= 0;
}

/* The query rows that see key j: every row, or in a ragged launch the rows of the one segment
 * whose keys hold j (their key ranges are disjoint), [*i0, *i1) ([0, 0) when none). */
static void key_rows(const struct ape_be_launch *f, int64_t j, int64_t *i0, int64_t *i1)
{
	*i0 = 0;
	*i1 = f->segs ? 0 : f->Lq;
	for (int64_t s = 0; f->segs && s < f->nseg; s++)
		if (j >= f->segs[s].k0 && j < f->segs[s].k0 + f->segs[s].lk) {
			*i0 = f->segs[s].q0;
			*i1 = f->segs[s].q0 + f->segs[s].lq;
			return;
		}
}

/* Keys outer: dV_j = sum_i P_ij dO_i and dK_j = sum_i dS_ij t c d(dot)/d(k_j), over every row of
 * every query head sharing key j's kv head, summed in float64, then added to the accumulators. */
static void keys_pass(struct bwd *c)
{
	const struct ape_be_launch *f = &c->l->f;
	const int64_t D = c->D;
	double k[APE_MAX_D], v[APE_MAX_D], q[APE_MAX_D], dout[APE_MAX_D];
	double dk[APE_MAX_D], dv[APE_MAX_D];
	struct pair pr;

	for (int64_t bk = 0; bk < f->B * f->Hkv; bk++) { /* (b, kv head) */
		const int64_t b = bk / f->Hkv, kh = bk % f->Hkv;

		for (int64_t j = 0; j < f->Lk; j++) {
			const int64_t krow = bk * f->Lk + j;
			int64_t i0, i1;

			key_rows(f, j, &i0, &i1);
			if (i0 == i1)
				continue; /* a key no row sees: nothing to add */
			key_row(c, k, c->k, c->vk, krow);
			key_row(c, v, c->v, c->vv, krow);
			memset(dk, 0, sizeof(dk));
			memset(dv, 0, sizeof(dv));
			for (int64_t h = kh * c->group; h < (kh + 1) * c->group; h++)
				for (int64_t i = i0; i < i1; i++) {
					const int64_t row = (b * f->H + h) * f->Lq + i;
					int64_t j0, j1, qpos, kpos, n;
					double g;

					row_keys(f, i, &j0, &j1, &qpos, &kpos);
					if (!visible(f, qpos, kpos, j0, j, &n))
						continue;
					query_row(c, q, c->q, f->in_dtype, c->vq, row);
					query_row(c, dout, c->dout, c->l->dout_dtype, c->vdo,
						  row);
					pair_eval(c, row, q, dout, k, v, n, false, &pr);
					for (int64_t d = 0; d < D; d++)
						dv[d] += pr.P * dout[d];
					g = pr.dS * pr.t * f->scale;
					/* d(dot)/d(u, w): q's pair rotated by +theta */
					for (int64_t p = 0; p < c->P; p++) {
						const double x = q[c->ia[p]], y = q[c->ib[p]];

						dk[c->ia[p]] += g * (x * pr.cs[p] - y * pr.sn[p]);
						dk[c->ib[p]] += g * (y * pr.cs[p] + x * pr.sn[p]);
					}
				}
			for (int64_t d = 0; c->dk && d < D; d++)
				c->dk[krow * D + d] += (float)dk[d];
			for (int64_t d = 0; c->dv && d < D; d++)
				c->dv[krow * D + d] += (float)dv[d];
		}
	}
}

/* Rows outer: dQ_i (rotation and alpha paths) and the parameter gradients of row i. */
static void rows_pass(struct bwd *c)
{
	const struct ape_be_launch *f = &c->l->f;
	const int64_t D = c->D;
	double q[APE_MAX_D], dout[APE_MAX_D], k[APE_MAX_D], v[APE_MAX_D], dq[APE_MAX_D];
	struct pair pr;

	for (int64_t row = 0; row < f->B * f->H * f->Lq; row++) {
		const int64_t b = row / (f->H * f->Lq), h = row / f->Lq % f->H;
		const int64_t kvbase = (b * f->Hkv + h / c->group) * f->Lk;
		const struct row_info *ri = &c->rows[row];
		const double lambda = f->head_params[4 * h + 3];
		double A = 0, dp[4] = { 0, 0, 0, 0 }, coef;
		/* the table's gradient: dS into the row's entry for the pair's distance */
		double *db = c->dbias ? c->dbias + (f->bias_hstride ? h * f->bias_len : 0) : NULL;
		bool any = false;
		int64_t j0, j1, qpos, kpos;

		row_keys(f, row % f->Lq, &j0, &j1, &qpos, &kpos);
		query_row(c, q, c->q, f->in_dtype, c->vq, row);
		query_row(c, dout, c->dout, c->l->dout_dtype, c->vdo, row);
		memset(dq, 0, sizeof(dq));
		for (int64_t j = j0; j < j1; j++) {
			double g;
			int64_t n;

			if (!visible(f, qpos, kpos, j0, j, &n))
				continue;
			any = true;
			key_row(c, k, c->k, c->vk, kvbase + j);
			key_row(c, v, c->v, c->vv, kvbase + j);
			pair_eval(c, row, q, dout, k, v, n, true, &pr);
			g = pr.dS * pr.t * f->scale;
			A += g * pr.ddot_dalpha;
			dp[0] += pr.dS * ape_grad_dbias_ddelta(pr.an);
			dp[1] += pr.dS * ape_grad_dbias_dbeta(pr.an);
			dp[2] += pr.dS * ape_grad_dbias_dgamma(pr.an);
			dp[3] += pr.dS * f->scale * pr.dot * ape_grad_dtemp_dlambda(lambda, pr.an);
			if (db)
				db[ape_be_bias_index(ape_abs_dist(n), f->bias_len)] += pr.dS;
			if (!c->dq)
				continue;
			/* d(dot)/d(x, y): k's pair rotated by -theta */
			for (int64_t p = 0; p < c->P; p++) {
				const double u = k[c->ia[p]], w = k[c->ib[p]];

				dq[c->ia[p]] += g * (u * pr.cs[p] + w * pr.sn[p]);
				dq[c->ib[p]] += g * (w * pr.cs[p] - u * pr.sn[p]);
			}
		}
		if (!any)
			continue; /* no visible key here: the row contributes nothing */
		dp[3] += A * ape_grad_gate(ri->sigma); /* d(alpha)/d(lambda) */
		if (c->dparams)
			for (int x = 0; x < 4; x++)
				c->dparams[4 * h + x] += dp[x];
		if (!c->dq)
			continue;
		/* the path through alpha_i: A_i d(alpha)/d(sigma) d(sigma)/d(q) */
		coef = A * ape_grad_dalpha_dsigma(lambda, ri->sigma) *
		       ape_grad_dsigma_coef((double)D, ri->sigma);
		for (int64_t d = 0; d < D; d++)
			c->dq[row * D + d] += (float)(dq[d] + coef * (q[d] - ri->mean));
	}
}

int ape__ref_backward(const struct ape_be_bwd_launch *l, const struct ape__ref_bwd_io *io)
{
	const struct ape_be_launch *f = &l->f;
	const int64_t nrows = f->B * f->H * f->Lq;
	struct bwd c = {
		.l = l,
		.q = io->q, .k = io->k, .v = io->v, .o = io->o, .dout = io->dout,
		.vq = ape_be_launch_view(f, APE_BE_T_Q), .vk = ape_be_launch_view(f, APE_BE_T_K),
		.vv = ape_be_launch_view(f, APE_BE_T_V), .vo = ape_be_launch_view(f, APE_BE_T_O),
		.vdo = ape_be_bwd_dout_view(l),
		.lse = io->lse, .dlse = io->dlse,
		.dq = io->dq, .dk = io->dk, .dv = io->dv, .dparams = io->dparams,
		.dbias = io->dbias,
		.D = f->D, .P = f->D / 2, .group = f->H / f->Hkv,
	};

	if (!c.dq && !c.dk && !c.dv && !c.dparams && !c.dbias)
		return 0;
	for (int64_t p = 0; p < c.P; p++) {
		c.ia[p] = f->layout == APE_ROPE_HALF ? p : 2 * p;
		c.ib[p] = f->layout == APE_ROPE_HALF ? p + c.P : 2 * p + 1;
	}
	c.rows = ape_be_malloc(sizeof(*c.rows) * (size_t)(nrows ? nrows : 1));
	if (!c.rows)
		return ape_be_error(APE_ENOMEM, "out of host memory for the row table of %" PRId64
					      " rows", nrows);
	for (int64_t row = 0; row < nrows; row++)
		row_info(&c, row);
	if (c.dk || c.dv)
		keys_pass(&c);
	if (c.dq || c.dparams || c.dbias)
		rows_pass(&c);
	free(c.rows);
	return 0;
}
