/* SPDX-License-Identifier: MIT */
/*
 * One backward launch (core/backend.h, struct ape__bwd_launch): the pre-passes (Q with dO and
 * K with V as float32 rows, the per-distance table, the per-row table), the keys sweep (dK,
 * dV), the queries sweep (dQ, the alpha path, per-row parameter sums) and the per-head float64
 * reduction of those sums, all in kernels/backward.cl, in that order on the launch's queue.
 * Only the sweeps whose outputs are wanted run.
 *
 * Scratch, released right after it is enqueued (the commands keep it alive), like the
 * forward's: the parameters, float32 copies of Q+dO and K+V (Q's rows padded to whole row
 * vectors), the row table (RI_N APE_REAL per query row), the per-row steps (2 floats per pair
 * and row), the distance table (TB_N per head and distance, H (Lq + Lk - 1)), the per-row
 * parameter sums (4 per row, with dparams only) and, with skipping, one key norm per (batch,
 * kv head): the size of the inputs, never O(Lq * Lk).
 * The core does not count it yet (struct ape__backend_ops has no backward scratch op).
 */
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "kernels/bwd_layout.h"
#include "ocl.h"

/* Keys per work-item of the keys sweep, as kernels/backward.cl's BWD_KT for the program
 * variant of D (ocl_program.c: 64 and 128 specialised, every other D up to 256 generic) */
static size_t bwd_kt(int64_t D)
{
	return D == 64 ? 32 : D == 128 ? 16 : 8;
}

/* Work-items per work-group of the sweeps: whole groups, the excess returns at once. */
#define BWD_LOCAL 16

/* omega_p (padded with zeros to npad, whole lane vectors), then delta, beta, gamma, lambda per
 * head, in float64 (the backward kernels exist only with cl_khr_fp64). */
static cl_mem bwd_params(struct ape__queue *q, const struct ape__launch *f, int npad, cl_int *err)
{
	const size_t n = (size_t)npad + 4 * (size_t)f->H;
	double *host = ape__malloc(n * sizeof(double));
	cl_mem mem;

	if (!host) {
		*err = CL_OUT_OF_HOST_MEMORY;
		return NULL;
	}
	for (size_t i = 0; i < n; i++)
		host[i] = i < (size_t)npad ? (i < (size_t)f->D / 2 ? f->omega[i] : 0.0)
					   : (double)f->head_params[i - (size_t)npad];
	mem = ape__ocl_scratch(q, n * sizeof(double), host, err);
	free(host);
	return mem;
}

/* Per (batch, kv head): the largest key norm bound, as float bits, zero until ape_bwd_prep
 * raises it (an atomic max: the result does not depend on the order). */
static cl_mem bwd_kmax(const struct ape__ocl_device *od, size_t n, cl_int *err)
{
	int *zero = ape__calloc(n, sizeof(int));
	cl_mem mem;

	if (!zero) {
		*err = CL_OUT_OF_HOST_MEMORY;
		return NULL;
	}
	mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, n * sizeof(int),
			     zero, err);
	free(zero);
	return mem;
}

static size_t round_up(size_t n, size_t m)
{
	return (n + m - 1) / m * m;
}

/* Enqueues one kernel of the program with its arguments already set in a, then releases it. */
static int bwd_run(struct ape__queue *q, struct ape__ocl_args *a, size_t n0, size_t l0, size_t n1,
		   const char *name)
{
	int ret;

	if (a->err != CL_SUCCESS)
		ret = ape__ocl_error(a->err, "setting up %s", name);
	else
		ret = ape__ocl_enqueue(q, a->k, n0, l0, n1, name);
	if (a->k)
		clReleaseKernel(a->k);
	return ret;
}

/* The arguments both sweeps take first, in kernels/backward.cl's order (BWD_SWEEP_ARGS). */
struct bwd_sweep {
	cl_mem qp, kp, prm, rinfo, step, tab;
	cl_int npad, D, H, group, flags;
	cl_long Lq, Lk, rel;
	cl_float scale;
};

static void bwd_sweep_args(struct ape__ocl_args *a, const struct bwd_sweep *w)
{
	ape__ocl_arg(a, sizeof(cl_mem), &w->qp);
	ape__ocl_arg(a, sizeof(cl_mem), &w->kp);
	ape__ocl_arg(a, sizeof(cl_mem), &w->prm);
	ape__ocl_arg(a, sizeof(w->npad), &w->npad);
	ape__ocl_arg(a, sizeof(cl_mem), &w->rinfo);
	ape__ocl_arg(a, sizeof(cl_mem), &w->step);
	ape__ocl_arg(a, sizeof(cl_mem), &w->tab);
	ape__ocl_arg(a, sizeof(w->D), &w->D);
	ape__ocl_arg(a, sizeof(w->H), &w->H);
	ape__ocl_arg(a, sizeof(w->group), &w->group);
	ape__ocl_arg(a, sizeof(w->Lq), &w->Lq);
	ape__ocl_arg(a, sizeof(w->Lk), &w->Lk);
	ape__ocl_arg(a, sizeof(w->rel), &w->rel);
	ape__ocl_arg(a, sizeof(w->scale), &w->scale);
	ape__ocl_arg(a, sizeof(w->flags), &w->flags);
}

/* One of ape_bwd_prep's float32 copies: pairs of a (first then second components), then b, for
 * nbh (batch, head) pairs of L rows each, in blocks of `lanes` rows (kernels/backward.cl). */
static int bwd_prep(struct ape__queue *q, const struct ape__ocl_program *pr, cl_mem a, cl_int dt_a,
		    cl_mem b, cl_int dt_b, size_t nbh, cl_long L, cl_int lanes, cl_int D,
		    cl_int npad, cl_int dpad, cl_int inter, size_t local, cl_mem kmax, cl_mem *out)
{
	const size_t padded = round_up((size_t)L, (size_t)lanes);
	struct ape__ocl_args args = { 0 };
	cl_int err;

	*out = ape__ocl_scratch(q, nbh * padded * (size_t)(2 * npad + dpad) * sizeof(float), NULL,
				&err);
	if (!*out)
		return ape__ocl_error(err, "clCreateBuffer (backward rows of %lld)",
				      (long long)(nbh * padded));
	args.k = clCreateKernel(pr->prog, "ape_bwd_prep", &args.err);
	ape__ocl_arg(&args, sizeof(cl_mem), &a);
	ape__ocl_arg(&args, sizeof(dt_a), &dt_a);
	ape__ocl_arg(&args, sizeof(cl_mem), &b);
	ape__ocl_arg(&args, sizeof(dt_b), &dt_b);
	ape__ocl_arg(&args, sizeof(L), &L);
	ape__ocl_arg(&args, sizeof(lanes), &lanes);
	ape__ocl_arg(&args, sizeof(D), &D);
	ape__ocl_arg(&args, sizeof(npad), &npad);
	ape__ocl_arg(&args, sizeof(dpad), &dpad);
	ape__ocl_arg(&args, sizeof(inter), &inter);
	ape__ocl_arg(&args, sizeof(cl_mem), out);
	ape__ocl_arg(&args, sizeof(cl_mem), &kmax);
	return bwd_run(q, &args, round_up(padded, local), local, nbh, "ape_bwd_prep");
}

int ape__ocl_attention_backward(struct ape__queue *q, const struct ape__bwd_launch *l)
{
	struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	const struct ape__launch *f = &l->f;
	const struct ape__ocl_program *pr;
	const cl_int D = (cl_int)f->D, H = (cl_int)f->H, group = (cl_int)(f->H / f->Hkv);
	const cl_long Lq = f->Lq, Lk = f->Lk, B = f->B, rel = f->q_start - f->k_start;
	const cl_float scale = (cl_float)f->scale;
	const size_t rows = (size_t)(f->B * f->H * f->Lq);
	const size_t local = od->max_wg >= BWD_LOCAL ? BWD_LOCAL : 1, kt = bwd_kt(f->D);
	cl_int flags = B_DTYPES((cl_int)f->in_dtype, (cl_int)f->out_dtype, (cl_int)l->dout_dtype);
	const cl_long nmin = rel - (Lk - 1), ndist = Lq + Lk - 1;
	const cl_int inter = f->layout == APE_ROPE_INTERLEAVED;
	cl_mem prm = NULL, rinfo = NULL, step = NULL, part = NULL, tab = NULL, qp = NULL, kp = NULL;
	cl_mem none = NULL, kmax = NULL;
	cl_float tol = 0;
	struct ape__ocl_args a;
	struct bwd_sweep w;
	cl_int npad, dpad, rw, err;
	size_t nblk;
	int ret;

	if (!od->fp64)
		return ape__error(APE_ENOTSUP, "the backward pass needs float64 (cl_khr_fp64, "
					       "CL_DEVICE_DOUBLE_FP_CONFIG) for its parameter "
					       "sums; this device has none");
	if (!(l->dq || l->dk || l->dv || l->dparams) || rows == 0 || f->Lk == 0)
		return 0;
	ret = ape__ocl_program_get(q->dev, f->D, &pr);
	if (ret)
		return ret;
	rw = (cl_int)pr->t.rw; /* query rows per row vector (APE_RW) */
	npad = (cl_int)round_up((size_t)f->D / 2, (size_t)rw);
	dpad = (cl_int)round_up((size_t)f->D, (size_t)rw);
	nblk = ((size_t)Lq + (size_t)rw - 1) / (size_t)rw; /* row vectors per (batch, head) */
	flags |= (f->causal ? B_CAUSAL : 0) | (f->layout == APE_ROPE_INTERLEAVED ? B_INTERLEAVED : 0);
	flags |= (l->dlse ? B_DLSE : 0) | (l->dq ? B_DQ : 0) | (l->dk ? B_DK : 0) |
		 (l->dv ? B_DV : 0) | (l->dparams ? B_DP : 0) | (f->pairs ? B_PAIRS : 0);
	/* the skip bound of docs/kernels.md: only with every decay >= 0 */
	if (f->skip_tol > 0 && f->decay_nonneg) {
		flags |= B_SKIP;
		tol = (cl_float)f->skip_tol;
		kmax = bwd_kmax(od, (size_t)(B * f->Hkv), &err);
		if (!kmax) {
			ret = ape__ocl_error(err, "clCreateBuffer (backward key norms)");
			goto out_release;
		}
	}

	prm = bwd_params(q, f, npad, &err);
	if (prm)
		rinfo = ape__ocl_scratch(q, (size_t)(B * H) * nblk * (size_t)rw * RI_N *
						    sizeof(double), NULL, &err);
	if (rinfo) /* per row vector: cos, then sin, of each pair's step */
		step = ape__ocl_scratch(q, (size_t)(B * H) * nblk * 2 * (size_t)npad * (size_t)rw *
						   sizeof(float), NULL, &err);
	if (step) /* a row vector's load of the last distances reaches rw - 1 past them */
		tab = ape__ocl_scratch(q, ((size_t)(H * ndist) * TB_N + (size_t)rw) * sizeof(double),
				       NULL, &err);
	if (tab && l->dparams)
		part = ape__ocl_scratch(q, rows * 4 * sizeof(double), NULL, &err);
	if (!tab || (l->dparams && !part)) {
		ret = ape__ocl_error(err, "clCreateBuffer (backward scratch)");
		goto out_release;
	}
	ret = bwd_prep(q, pr, f->q->mem, (cl_int)f->in_dtype, l->dout->mem, (cl_int)l->dout_dtype,
		       (size_t)(B * H), Lq, rw, D, npad, dpad, inter, local, none, &qp);
	if (!ret)
		ret = bwd_prep(q, pr, f->k->mem, (cl_int)f->in_dtype, f->v->mem,
			       (cl_int)f->in_dtype, (size_t)(B * f->Hkv), Lk, 1, D, npad, dpad,
			       inter, local, kmax, &kp);
	if (ret)
		goto out_release;

	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_bwd_dist", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(npad), &npad);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(nmin), &nmin);
	ape__ocl_arg(&a, sizeof(ndist), &ndist);
	ape__ocl_arg(&a, sizeof(cl_mem), &tab);
	ret = bwd_run(q, &a, round_up((size_t)ndist, local), local, (size_t)H, "ape_bwd_dist");
	if (ret)
		goto out_release;

	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_bwd_rows", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &qp);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->o->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->lse->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), l->dlse ? &l->dlse->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(npad), &npad);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(Lq), &Lq);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	ape__ocl_arg(&a, sizeof(cl_mem), &rinfo);
	ape__ocl_arg(&a, sizeof(cl_mem), &step);
	ape__ocl_arg(&a, sizeof(cl_mem), &kmax);
	ape__ocl_arg(&a, sizeof(group), &group);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(rel), &rel);
	ape__ocl_arg(&a, sizeof(scale), &scale);
	ape__ocl_arg(&a, sizeof(tol), &tol);
	ape__ocl_arg(&a, sizeof(cl_mem), f->pairs ? &f->pairs->mem : &none);
	/* one work-item per row vector */
	ret = bwd_run(q, &a, nblk, 1, (size_t)(B * H), "ape_bwd_rows");
	if (ret)
		goto out_release;

	w = (struct bwd_sweep){ .qp = qp, .kp = kp, .prm = prm, .rinfo = rinfo, .step = step,
				.tab = tab,
				.npad = npad, .D = D, .H = H, .group = group, .flags = flags,
				.Lq = Lq, .Lk = Lk, .rel = rel, .scale = scale };
	if (l->dk || l->dv) {
		memset(&a, 0, sizeof(a));
		a.k = clCreateKernel(pr->prog, "ape_bwd_keys", &a.err);
		bwd_sweep_args(&a, &w);
		ape__ocl_arg(&a, sizeof(cl_mem), l->dk ? &l->dk->mem : &none);
		ape__ocl_arg(&a, sizeof(cl_mem), l->dv ? &l->dv->mem : &none);
		/* one work-item per group: its accumulators are large (kernels/backward.cl) */
		ret = bwd_run(q, &a, ((size_t)Lk + kt - 1) / kt, 1, (size_t)(B * f->Hkv),
			      "ape_bwd_keys");
		if (ret)
			goto out_release;
	}

	if (l->dq || l->dparams) {
		memset(&a, 0, sizeof(a));
		a.k = clCreateKernel(pr->prog, "ape_bwd_queries", &a.err);
		bwd_sweep_args(&a, &w);
		ape__ocl_arg(&a, sizeof(cl_mem), &f->q->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), l->dq ? &l->dq->mem : &none);
		ape__ocl_arg(&a, sizeof(cl_mem), l->dparams ? &part : &none);
		/* one work-item per row vector, one per group (its private arrays are large) */
		ret = bwd_run(q, &a, nblk, 1, (size_t)(B * H),
			      "ape_bwd_queries");
		if (ret)
			goto out_release;
	}

	if (l->dparams) {
		memset(&a, 0, sizeof(a));
		a.k = clCreateKernel(pr->prog, "ape_bwd_params", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &part);
		ape__ocl_arg(&a, sizeof(B), &B);
		ape__ocl_arg(&a, sizeof(H), &H);
		ape__ocl_arg(&a, sizeof(Lq), &Lq);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->dparams->mem);
		ret = bwd_run(q, &a, (size_t)H, 0, 1, "ape_bwd_params");
	}
out_release:
	if (prm)
		clReleaseMemObject(prm);
	if (rinfo)
		clReleaseMemObject(rinfo);
	if (step)
		clReleaseMemObject(step);
	if (kmax)
		clReleaseMemObject(kmax);
	if (part)
		clReleaseMemObject(part);
	if (tab)
		clReleaseMemObject(tab);
	if (qp)
		clReleaseMemObject(qp);
	if (kp)
		clReleaseMemObject(kp);
	return ret;
}
