/* SPDX-License-Identifier: MIT */
/*
 * The local pieces of the distributed calls (mpi/mpi_call.h): each (query block, key rows) piece
 * one libape call, ape_attention_forward_ex() merged by LSE (identity 4) into the rank's running
 * max, sum and accumulator, or ape_attention_backward_ex() added to the float64 sums of the
 * gradients, always in one order.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "mpi_call.h"

#define APE_REAL double
#include "ape/ape_math.h"

#define BWD_SUB 4096 /* the backward's query rows per piece, unless opts->chunk_q says */

static void keep_error(struct call *c, int err)
{
	size_t cap;
	const char *m = ape__mpi_msgbuf(&cap);

	if (c->err)
		return;
	c->err = err;
	snprintf(c->msg, sizeof(c->msg), "%s", m);
}

/* Merges one piece (rows [off, off + n) of this rank, float32 O and LSE) by LSE. */
static void merge(struct call *c, int64_t off, int64_t n)
{
	const int64_t D = c->g.D, rows = c->sh->rows;

	for (int64_t bh = 0; bh < c->g.B * c->g.H; bh++)
		for (int64_t i = 0; i < n; i++) {
			const int64_t r = bh * rows + off + i;
			const double l = c->lc[bh * n + i], m = c->m[r];
			const float *oc = c->oc + (bh * n + i) * D;
			float *acc = c->acc + r * D;
			double mn, f_old, f_new;

			if (isnan(m) || l == -INFINITY)
				continue; /* already NaN, or no visible key in this piece */
			if (isnan(l) || l == INFINITY) {
				c->m[r] = NAN; /* a NaN reached the row: it stays NaN */
				continue;
			}
			/* ape_math.h's merge: an empty side (m = -inf) weighs 0, and the
			 * accumulators start at 0, so the first piece needs no case of its own */
			mn = ape_merge_max(m, l);
			f_old = ape_merge_factor(m, mn);
			f_new = ape_merge_factor(l, mn);
			for (int64_t d = 0; d < D; d++)
				acc[d] = (float)(acc[d] * f_old + oc[d] * f_new);
			c->s[r] = c->s[r] * f_old + f_new;
			c->m[r] = mn;
		}
}

/* One piece, rows [s0, s0 + ns) of query block lq of this rank against key rows [j0, j1) of kb:
 * its positions and its views of Q, K and V. */
static void piece_views(const struct call *c, int lq, int64_t s0, int64_t ns,
			const struct kv_block *kb, int64_t j0, int64_t j1, ape_attn_desc *d,
			ape_tensor *qv, ape_tensor *kv, ape_tensor *vv)
{
	*d = c->dglob;
	d->q_start = c->g.q0 + c->sh->start[lq] + s0;
	d->k_start = c->g.k0 + j0;
	ape_tensor_rows(c->q, block_off(c->sh, lq) + s0, ns, qv);
	ape_tensor_rows(&kb->k, j0 - kb->c0, j1 - j0, kv);
	ape_tensor_rows(&kb->v, j0 - kb->c0, j1 - j0, vv);
}

/* After a piece's libape call: its failure kept (named by its rows), or its statistics counted.
 * True when it succeeded. */
static bool piece_done(struct call *c, int64_t a, int64_t n, int64_t j0, int64_t j1, int ret,
		       const ape_stats *st)
{
	if (ret) {
		ape__mpi_error(ret, "%s: rows %lld..%lld against keys %lld..%lld: %s", APE__MPI_FN,
			       (long long)a, (long long)(a + n - 1), (long long)j0,
			       (long long)(j1 - 1), ape_last_error());
		keep_error(c, ret);
		return false;
	}
	c->st.local_calls++;
	c->st.pairs_computed += st->pairs_computed;
	return true;
}

/* Query block lq of this rank against key rows [j0, j1) of kb (which holds rows [kb->c0,..)). */
static void compute(struct call *c, int lq, const struct kv_block *kb, int64_t j0, int64_t j1)
{
	const int64_t off = block_off(c->sh, lq), n = c->sh->count[lq];
	ape_tensor qv, kv, vv, ov;
	ape_attn_desc d;
	ape_stats st;
	int ret;

	if (c->err || j0 >= j1 || n == 0)
		return;
	piece_views(c, lq, 0, n, kb, j0, j1, &d, &qv, &kv, &vv);
	/* half of skip_tol for the plan, half for the local calls (docs/distributed.md) */
	d.skip_tol = c->dglob.skip_tol / 2;
	ape_tensor_init(&ov, c->oc, APE_F32, c->g.B, c->g.H, n, c->g.D);
	ape_stats_init(&st);
	ret = ape_attention_forward_ex(c->devs, c->ndev, c->opts, &d, &qv, &kv, &vv, &ov, c->lc,
				       &st);
	if (piece_done(c, c->sh->start[lq], n, j0, j1, ret, &st))
		merge(c, off, n);
}

void ape__mpi_add_rows(const struct call *c, int64_t nh, const float *src, int64_t n, double *dst,
		       int64_t rows, int64_t off)
{
	const int64_t D = c->g.D;

	for (int64_t bh = 0; bh < c->g.B * nh; bh++)
		for (int64_t i = 0; i < n; i++)
			for (int64_t d = 0; d < D; d++)
				dst[((bh * rows) + off + i) * D + d] += src[(bh * n + i) * D + d];
}

/* The backward of rows [s0, s0 + n) of query block lq against key rows [j0, j1) of kb: one
 * ape_attention_backward_ex() with the forward's O and LSE of these rows (so P_ij is the whole
 * sequence's), its gradients added to dQ, to kb's dK and dV and to the parameter gradients. */
static void compute_bwd(struct call *c, int lq, int64_t s0, int64_t n,
			const struct kv_block *kb, int64_t j0, int64_t j1)
{
	const int64_t off = block_off(c->sh, lq) + s0, m = j1 - j0;
	const int64_t rows = c->sh->rows, nbh = c->g.B * c->g.H;
	ape_tensor qv, kv, vv, ov, dov, tq, tk, tv;
	ape_attn_desc d;
	ape_stats st;
	int ret;

	if (c->err || j0 >= j1 || n == 0)
		return;
	piece_views(c, lq, s0, n, kb, j0, j1, &d, &qv, &kv, &vv);
	ape_tensor_rows(c->o, off, n, &ov);
	ape_tensor_rows(c->dout, off, n, &dov);
	for (int64_t bh = 0; bh < nbh; bh++) {
		memcpy(c->lc + bh * n, c->lse + bh * rows + off, (size_t)n * sizeof(float));
		if (c->dlse)
			memcpy(c->pdl + bh * n, c->dlse + bh * rows + off, (size_t)n * sizeof(float));
	}
	ape_tensor_init(&tq, c->pq, APE_F32, c->g.B, c->g.H, n, c->g.D);
	ape_tensor_init(&tk, c->pk, APE_F32, c->g.B, c->g.Hkv, m, c->g.D);
	ape_tensor_init(&tv, c->pv, APE_F32, c->g.B, c->g.Hkv, m, c->g.D);
	ape_stats_init(&st);
	ret = ape_attention_backward_ex(c->devs, 1, c->opts, &d, &qv, &kv, &vv, &ov, c->lc, &dov,
					c->dlse ? c->pdl : NULL,
					c->want & APE__MPI_WANT_DQ ? &tq : NULL,
					c->want & APE__MPI_WANT_DK ? &tk : NULL,
					c->want & APE__MPI_WANT_DV ? &tv : NULL,
					c->want & APE__MPI_WANT_DP ? c->pp : NULL, &st);
	if (!piece_done(c, c->sh->start[lq] + s0, n, j0, j1, ret, &st))
		return;
	if (c->want & APE__MPI_WANT_DQ)
		ape__mpi_add_rows(c, c->g.H, c->pq, n, c->gq, rows, off);
	if (c->want & APE__MPI_WANT_DK)
		ape__mpi_add_rows(c, c->g.Hkv, c->pk, m, kb->gk, kb->grows,
				  kb->goff + (j0 - kb->c0));
	if (c->want & APE__MPI_WANT_DV)
		ape__mpi_add_rows(c, c->g.Hkv, c->pv, m, kb->gv, kb->grows,
				  kb->goff + (j0 - kb->c0));
	for (int64_t i = 0; c->want & APE__MPI_WANT_DP && i < 4 * c->g.H; i++)
		c->gp[i] += c->pp[i];
}

/*
 * The backward of query block lq against the rows of kb it needs, in sub-blocks of at most
 * opts->chunk_q rows (default BWD_SUB): each sub-block's key range is cut again by the plan's
 * bound and share (ape__mpi_needed() holds for any rows), so that, as in the forward, far keys of
 * a large block are not computed. The left-out keys of a row are then the longer of two tails
 * each proved negligible within the plan's share: no more than the plan's share in all.
 */
static void compute_bwd_block(struct call *c, int lq, const struct kv_block *kb)
{
	const int64_t n = c->sh->count[lq], nbh = c->g.B * c->g.H;
	const int64_t sub = c->opts && c->opts->chunk_q > 0 ? c->opts->chunk_q : BWD_SUB;

	for (int64_t s0 = 0; s0 < n; s0 += sub) {
		const int64_t ns = n - s0 < sub ? n - s0 : sub;
		int64_t lo = c->need[lq][0], hi = c->need[lq][1], slo, shi;

		if (c->g.can_skip && ns < n) {
			ape__mpi_query_summary(&c->g, c->q, c->k, block_off(c->sh, lq) + s0, ns,
					       c->qsum, c->qsum + nbh);
			ape__mpi_needed(&c->g, c->kglob, c->qsum, c->qsum + nbh,
					c->sh->start[lq] + s0, ns, &slo, &shi);
			lo = slo > lo ? slo : lo;
			hi = shi < hi ? shi : hi;
		}
		lo = kb->c0 > lo ? kb->c0 : lo;
		hi = kb->c1 < hi ? kb->c1 : hi;
		compute_bwd(c, lq, s0, ns, kb, lo, hi);
	}
}

void ape__mpi_compute_block(struct call *c, const struct kv_block *kb)
{
	for (int lq = 0; lq < c->sh->nblocks; lq++) {
		int64_t j0 = c->need[lq][0] > kb->c0 ? c->need[lq][0] : kb->c0;
		int64_t j1 = c->need[lq][1] < kb->c1 ? c->need[lq][1] : kb->c1;

		if (c->bwd)
			compute_bwd_block(c, lq, kb);
		else
			compute(c, lq, kb, j0, j1);
	}
}
