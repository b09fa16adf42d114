/* SPDX-License-Identifier: MIT */
/*
 * ape-mpi-run --backward (mpi/driver/driver.h): the distributed backward after a case's forward,
 * checked against one single-process forward and backward over the whole sequence.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

static double tol_grad(ape_dtype dt) /* APE-SPEC.md, "Gradients" */
{
	return dt == APE_F32 ? 1e-3 : dt == APE_F16 ? 1e-2 : 5e-2;
}

struct grads {
	void *dout, *dq, *dk, *dv;
	ape_tensor tdout, tdq, tdk, tdv;
	float *dlse, *dp, *dp_all;
	/* the single-process reference over the whole sequence (with --check) */
	void *rq, *rk, *rv, *ro, *rdout;
	ape_tensor trq, trk, trv, tro, trdout, tgq, tgk, tgv;
	float *rlse, *rdlse, *gq, *gk, *gv, rdp[4 * 64];
};

static void grads_free(struct grads *g)
{
	void *p[] = { g->dout, g->dq, g->dk, g->dv, g->dlse, g->dp, g->dp_all, g->rq, g->rk,
		      g->rv, g->ro, g->rdout, g->rlse, g->rdlse, g->gq, g->gk, g->gv };

	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* dL/dLSE of (b, h, global row l): the same on every rank. */
static float gen_dlse(const struct cfg *c, int64_t b, int64_t h, int64_t l)
{
	return 0.5f * driver_gen(c->seed, 4, b, h, l, 0);
}

/*
 * The single-process forward and backward over the whole sequence; this rank's rows of the
 * reference O and LSE replace the distributed forward's, so that the distributed backward is
 * compared with the single-process one on the same inputs.
 */
static int reference(const struct cfg *c, struct run *r, ape_device *dev, struct grads *g)
{
	const int64_t B = c->B, H = c->H, L = c->L, rows = r->sh.rows;
	int ret;

	g->rq = driver_alloc_tensor(&g->trq, c->dt, B, H, L, c->D, false);
	g->rk = driver_alloc_tensor(&g->trk, c->dt, B, c->Hkv, L, c->D, false);
	g->rv = driver_alloc_tensor(&g->trv, c->dt, B, c->Hkv, L, c->D, false);
	g->ro = driver_alloc_tensor(&g->tro, c->odt, B, H, L, c->D, false);
	g->rdout = driver_alloc_tensor(&g->trdout, c->dt, B, H, L, c->D, false);
	g->gq = driver_alloc_tensor(&g->tgq, APE_F32, B, H, L, c->D, false);
	g->gk = driver_alloc_tensor(&g->tgk, APE_F32, B, c->Hkv, L, c->D, false);
	g->gv = driver_alloc_tensor(&g->tgv, APE_F32, B, c->Hkv, L, c->D, false);
	g->rlse = calloc((size_t)(B * H * L) + 1, sizeof(float));
	g->rdlse = calloc((size_t)(B * H * L) + 1, sizeof(float));
	if (!g->rq || !g->rk || !g->rv || !g->ro || !g->rdout || !g->gq || !g->gk || !g->gv ||
	    !g->rlse || !g->rdlse || H > 64)
		return APE_ENOMEM;
	driver_fill(c, &g->trq, 0, NULL);
	driver_fill(c, &g->trk, 1, NULL);
	driver_fill(c, &g->trv, 2, NULL);
	driver_fill(c, &g->trdout, 3, NULL);
	for (int64_t bh = 0; bh < B * H; bh++)
		for (int64_t l = 0; l < L; l++)
			g->rdlse[bh * L + l] = gen_dlse(c, bh / H, bh % H, l);
	if ((ret = ape_attention_forward(dev, &r->desc, &g->trq, &g->trk, &g->trv, &g->tro, g->rlse,
					 NULL)) ||
	    (ret = ape_attention_backward(dev, &r->desc, &g->trq, &g->trk, &g->trv, &g->tro,
					  g->rlse, &g->trdout, c->with_dlse ? g->rdlse : NULL,
					  &g->tgq, &g->tgk, &g->tgv, g->rdp, NULL)))
		return ret;
	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = 0; i < rows; i++) {
				const int64_t l = driver_global_row(&r->sh, i);

				r->lse[(b * H + h) * rows + i] = g->rlse[(b * H + h) * L + l];
				for (int64_t d = 0; d < c->D; d++)
					driver_set(&r->to, b, h, i, d,
						   (float)driver_get(&g->tro, b, h, l, d));
			}
	return 0;
}

/* max |this rank's rows of t - the reference's| in units of tol * max|reference| */
static double grad_err(const struct cfg *c, const struct run *r, const ape_tensor *t,
		       const ape_tensor *ref)
{
	double M = 0, e = 0;

	for (int64_t b = 0; b < ref->shape[0]; b++)
		for (int64_t h = 0; h < ref->shape[1]; h++)
			for (int64_t l = 0; l < ref->shape[2]; l++)
				for (int64_t d = 0; d < c->D; d++)
					M = fmax(M, fabs(driver_get(ref, b, h, l, d)));
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t i = 0; i < t->shape[2]; i++)
				for (int64_t d = 0; d < c->D; d++) {
					const int64_t l = driver_global_row(&r->sh, i);
					double x = fabs(driver_get(t, b, h, i, d) -
							driver_get(ref, b, h, l, d));

					x = x == x ? x : INFINITY;
					e = fmax(e, x == 0 ? 0 : x / (tol_grad(c->dt) * fmax(M, 1e-30)));
				}
	return e;
}

/* Each head's parameter gradients against the reference's, in units of tol * the largest of
 * that head's four. */
static double params_err(const struct cfg *c, const float *dp, const float *ref)
{
	double e = 0;

	for (int64_t h = 0; h < c->H; h++) {
		double M = 0;

		for (int p = 0; p < 4; p++)
			M = fmax(M, fabs(ref[4 * h + p]));
		for (int p = 0; p < 4; p++) {
			double x = fabs((double)dp[4 * h + p] - ref[4 * h + p]);

			x = x == x ? x : INFINITY;
			e = fmax(e, x == 0 ? 0 : x / (tol_grad(c->dt) * fmax(M, 1e-30)));
		}
	}
	return e;
}

/* The distributed backward of this rank's rows after its forward; err[0..3]: dq, dk, dv,
 * dparams against the reference (with --check); *same: dparams bit-identical on every rank;
 * *hash: FNV-1a of dparams' bytes (two runs compare it). */
int driver_backward_case(const struct cfg *c, struct run *r, ape_device *dev,
			 const ape_exec_options *eo, const char *corrupt_what, ape_mpi_stats *st,
			 double err[4], int *same, uint64_t *hash)
{
	const int64_t B = c->B, H = c->H, rows = r->sh.rows;
	struct grads g;
	bool no_dk = corrupt_what && !strcmp(corrupt_what, "bwd-want");
	int ret = APE_ENOMEM, mret;

	memset(&g, 0, sizeof(g));
	*same = 0;
	g.dout = driver_alloc_tensor(&g.tdout, c->dt, B, H, rows, c->D, c->strided);
	g.dq = driver_alloc_tensor(&g.tdq, c->odt, B, H, rows, c->D, c->strided);
	g.dk = driver_alloc_tensor(&g.tdk, c->odt, B, c->Hkv, rows, c->D, c->strided);
	g.dv = driver_alloc_tensor(&g.tdv, c->odt, B, c->Hkv, rows, c->D, c->strided);
	g.dlse = calloc((size_t)(B * H * rows) + 1, sizeof(float));
	g.dp = calloc((size_t)(4 * H), sizeof(float));
	g.dp_all = calloc((size_t)(4 * H * driver_nranks), sizeof(float));
	if (!g.dout || !g.dq || !g.dk || !g.dv || !g.dlse || !g.dp || !g.dp_all)
		goto out;
	driver_fill(c, &g.tdout, 3, &r->sh);
	for (int64_t bh = 0; bh < B * H; bh++)
		for (int64_t i = 0; i < rows; i++)
			g.dlse[bh * rows + i] =
				gen_dlse(c, bh / H, bh % H, driver_global_row(&r->sh, i));
	if (c->check && (ret = reference(c, r, dev, &g)))
		goto out;
	if (corrupt_what && !strcmp(corrupt_what, "bwd-delta"))
		r->desc.delta.value += 0.25f;
	if (corrupt_what && !strcmp(corrupt_what, "bwd-dout"))
		g.tdout.strides[3] = -1;
	ape_mpi_stats_init(st);
	ret = ape_mpi_attention_backward(MPI_COMM_WORLD, dev, eo, &r->desc, &r->sh, &r->tq, &r->tk,
					 &r->tv, &r->to, r->lse, &g.tdout,
					 c->with_dlse ? g.dlse : NULL, &g.tdq, no_dk ? NULL : &g.tdk,
					 &g.tdv, g.dp, st);
	/* dparams on every rank, bit for bit */
	mret = MPI_Allgather(g.dp, (int)(4 * H), MPI_FLOAT, g.dp_all, (int)(4 * H), MPI_FLOAT,
			     MPI_COMM_WORLD);
	*same = mret == MPI_SUCCESS;
	for (int q = 0; q < driver_nranks && *same; q++)
		*same = !memcmp(g.dp_all, g.dp_all + 4 * H * q, (size_t)(4 * H) * sizeof(float));
	*hash = 1469598103934665603ull;
	for (size_t i = 0; i < (size_t)(4 * H) * sizeof(float); i++)
		*hash = (*hash ^ ((const unsigned char *)g.dp)[i]) * 1099511628211ull;
	if (!ret && c->check) {
		err[0] = grad_err(c, r, &g.tdq, &g.tgq);
		err[1] = grad_err(c, r, &g.tdk, &g.tgk);
		err[2] = grad_err(c, r, &g.tdv, &g.tgv);
		err[3] = params_err(c, g.dp, g.rdp);
	}
out:
	grads_free(&g);
	return ret;
}
