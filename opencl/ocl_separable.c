/* SPDX-License-Identifier: MIT */
/*
 * The separable path (kernels/separable.cl): launches whose every head has lambda = 0 (any
 * delta, beta, gamma; with beta or gamma != 0 the bias per distance comes from a table). Q and K are rotated once into scratch (Q transposed per block of 16 rows, the
 * rows then being the lanes of a vector; V copied as float32),
 * key-tile norms and their prefix maxima are taken for skipping, then ape_sep_attn runs the
 * GEMM-shaped blocks. Scratch: the rotated Q and K, V in float32, the norms (ape__ocl_separable_scratch counts
 * them for the executor's budget).
 */

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "ocl_fast.h"

#define SEP_BQ 16 /* kernels/separable.cl */
#define SEP_BK 16
#define SEP_NB 4
#define SEP_GBK 16 /* the work-group shape's keys per tile (ape_sep_attn_wg) */
#define SEP_GNWI 64 /* its work-items (rows) per work-group, at most */

/*
 * The work-group shape (ape_sep_attn_wg: rows shared over a work-group, K and V tiles in local
 * memory between barriers) for devices other than CPUs; APE_OCL_SEP_SHAPE=gpu gives it to a CPU
 * device too, so that the tests run it on PoCL (as APE_OCL_TUNE does for the general kernel).
 * Returns its work-items per group (the largest power of two up to SEP_GNWI that the device
 * allows), 0 when the device's local memory cannot hold a K and a V tile (the launch then goes
 * to the general kernel), -1 when the device takes the CPU shape (ape_sep_attn).
 */
static int sep_wg_shape(const struct ape__ocl_device *od, int64_t D)
{
	const char *e = getenv("APE_OCL_SEP_SHAPE");
	int nwi = SEP_GNWI;

	if ((od->type & CL_DEVICE_TYPE_CPU) && !(e && !strcmp(e, "gpu")))
		return -1;
	while ((size_t)nwi > od->max_wg && nwi > 1)
		nwi /= 2;
	return (uint64_t)(2 * SEP_GBK * D * 4 + 64) <= od->local_mem ? nwi : 0;
}

static int64_t round_up(int64_t x, int64_t m)
{
	return (x + m - 1) / m * m;
}

/* A head has beta or gamma != 0: the kernel takes its bias from the per-distance table. */
static bool sep_tabbed(const struct ape__launch *l)
{
	for (int64_t h = 0; h < l->H; h++)
		if (l->head_params[4 * h + 1] != 0 || l->head_params[4 * h + 2] != 0)
			return true;
	return false;
}

/* The bias table's entries per head: every distance rows 0..Lqp-1 and keys 0..Lkp-1 span. */
static int64_t sep_table_len(const struct ape__launch *l)
{
	return round_up(l->Lq, SEP_BQ) + round_up(l->Lk, SEP_BK) - 1;
}

/* Rotated Q (transposed per block), rotated K and float32 V (each kt bytes), the query norms,
 * tile norms and their prefix maxima. */
static void sep_sizes(const struct ape__launch *l, size_t *qr, size_t *kt, size_t *qn,
		      size_t *tiles, size_t *pre)
{
	const int64_t Lqp = round_up(l->Lq, SEP_BQ), Lkp = round_up(l->Lk, SEP_BK);
	const int64_t bkv = l->B * l->Hkv, ntk = Lkp / SEP_BK;

	*qr = (size_t)(l->B * l->H * Lqp * l->D) * sizeof(float);
	*kt = (size_t)(bkv * Lkp * l->D) * sizeof(float);
	*qn = (size_t)(l->B * l->H * Lqp) * sizeof(float);
	*tiles = (size_t)(bkv * ntk) * sizeof(float);
	*pre = (size_t)(bkv * (ntk + 1)) * sizeof(float);
}

uint64_t ape__ocl_separable_scratch(struct ape_device *dev, const struct ape__launch *l)
{
	size_t qr, kt, qn, tiles, pre;

	(void)dev;
	if (l->D % 32 || l->D > APE_MAX_D || l->Lq < 1 || l->Lk < 1)
		return 0;
	sep_sizes(l, &qr, &kt, &qn, &tiles, &pre);
	return (uint64_t)(qr + 2 * kt + qn + tiles + pre) + 8 * (uint64_t)(l->D / 2 + 4 * l->H) +
	       8 * (uint64_t)(l->H * sep_table_len(l)); /* the bias table, when tabbed */
}

bool ape__ocl_separable_applies(struct ape_device *dev, const struct ape__launch *l)
{
	const struct ape__ocl_device *od = ape__ocl_dev(dev);
	size_t qr, kt, qn, tiles, pre;

	if (!sep_wg_shape(od, l->D) || !ape__ocl_fast_outputs(l) || l->D % 32 ||
	    l->D > APE_MAX_D || l->Lq < 1 || l->Lk < 1 || l->H % l->Hkv ||
	    l->Lk > ((int64_t)1 << 30))
		return false;
	for (int64_t h = 0; h < l->H; h++) /* lambda = 0: every head */
		if (l->head_params[4 * h + 3] != 0)
			return false;
	sep_sizes(l, &qr, &kt, &qn, &tiles, &pre);
	return qr <= od->max_alloc && kt <= od->max_alloc &&
	       (uint64_t)(l->H * sep_table_len(l)) * 8 <= od->max_alloc;
}

int ape__ocl_separable(struct ape__queue *q, const struct ape__launch *l)
{
	const struct ape__ocl_program *pr;
	const int64_t Lqp_ = round_up(l->Lq, SEP_BQ), Lkp_ = round_up(l->Lk, SEP_BK);
	const cl_int D = (cl_int)l->D, H = (cl_int)l->H, Hkv = (cl_int)l->Hkv,
		     group = (cl_int)(l->H / l->Hkv);
	const cl_long Lq = l->Lq, Lk = l->Lk, Lqp = Lqp_, Lkp = Lkp_, ntk = Lkp_ / SEP_BK;
	const cl_long rel = l->q_start - l->k_start;
	const cl_float scale = (cl_float)l->scale, tol = (cl_float)l->skip_tol;
	cl_int flags = ape__ocl_fast_flags(l);
	size_t sqr, skt, sqn, stiles, spre;
	const cl_long ne = sep_table_len(l);
	const size_t real = ape__ocl_dev(q->dev)->fp64 ? sizeof(cl_double) : sizeof(cl_float);
	cl_mem prm, qr = NULL, kt = NULL, vf = NULL, qn = NULL, tiles = NULL, pre = NULL, none = NULL;
	cl_mem tab = NULL;
	int nwi = sep_wg_shape(ape__ocl_dev(q->dev), l->D);
	struct ape__ocl_args a = { 0 };
	cl_int err;
	int ret;

	/* the far-key bound needs decays >= 0; the core passes skip_tol = 0 otherwise */
	if (l->skip_tol > 0 && l->decay_nonneg && tol > 0 && l->causal)
		flags |= APE__FD_SKIP;
	ret = ape__ocl_program_get(q->dev, l->D, &pr);
	if (ret)
		return ret;
	sep_sizes(l, &sqr, &skt, &sqn, &stiles, &spre);
	prm = ape__ocl_fast_params(q, l, &err);
	if (prm)
		qr = ape__ocl_scratch(q, sqr, NULL, &err);
	if (qr)
		kt = ape__ocl_scratch(q, skt, NULL, &err);
	if (kt)
		vf = ape__ocl_scratch(q, skt, NULL, &err);
	if (vf)
		qn = ape__ocl_scratch(q, sqn, NULL, &err);
	if (qn)
		tiles = ape__ocl_scratch(q, stiles, NULL, &err);
	if (tiles)
		pre = ape__ocl_scratch(q, spre, NULL, &err);
	if (pre && sep_tabbed(l)) {
		flags |= APE__FD_BIAS;
		tab = ape__ocl_scratch(q, (size_t)(l->H * ne) * real, NULL, &err);
	}
	if (!pre || ((flags & APE__FD_BIAS) && !tab)) {
		ret = ape__ocl_error(err, "clCreateBuffer (separable scratch)");
		goto out;
	}

	a.k = clCreateKernel(pr->prog, "ape_sep_rot_q", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->q->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg_view(&a, l, APE__T_Q);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(Lq), &Lq);
	ape__ocl_arg(&a, sizeof(Lqp), &Lqp);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(rel), &rel);
	ape__ocl_arg(&a, sizeof(scale), &scale);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	ape__ocl_arg(&a, sizeof(cl_mem), &qr);
	ape__ocl_arg(&a, sizeof(cl_mem), &qn);
	ret = ape__ocl_fast_launch(q, &a, "ape_sep_rot_q", (size_t)Lqp, 16, (size_t)(l->B * l->H));
	if (ret)
		goto out;

	a.k = clCreateKernel(pr->prog, "ape_sep_rot_k", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->k->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->v->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg_view(&a, l, APE__T_K);
	ape__ocl_arg_view(&a, l, APE__T_V);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(Lkp), &Lkp);
	ape__ocl_arg(&a, sizeof(Hkv), &Hkv);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	ape__ocl_arg(&a, sizeof(cl_mem), &kt);
	ape__ocl_arg(&a, sizeof(cl_mem), &vf);
	ape__ocl_arg(&a, sizeof(cl_mem), &tiles);
	ret = ape__ocl_fast_launch(q, &a, "ape_sep_rot_k", (size_t)ntk, 1, (size_t)(l->B * l->Hkv));
	if (ret)
		goto out;

	a.k = clCreateKernel(pr->prog, "ape_sep_kscan", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &tiles);
	ape__ocl_arg(&a, sizeof(ntk), &ntk);
	ape__ocl_arg(&a, sizeof(cl_mem), &pre);
	ret = ape__ocl_fast_launch(q, &a, "ape_sep_kscan", (size_t)(l->B * l->Hkv), 1, 1);
	if (ret)
		goto out;

	if (tab) {
		a.k = clCreateKernel(pr->prog, "ape_sep_btab", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &prm);
		ape__ocl_arg(&a, sizeof(D), &D);
		ape__ocl_arg(&a, sizeof(ne), &ne);
		ape__ocl_arg(&a, sizeof(Lkp), &Lkp);
		ape__ocl_arg(&a, sizeof(rel), &rel);
		ape__ocl_arg(&a, sizeof(cl_mem), &tab);
		/* work-groups of 64 (PoCL's cost per group dwarfs one log1p) */
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_btab", (size_t)round_up(ne, 64), 64,
					   (size_t)l->H);
		if (ret)
			goto out;
	}

	a.k = clCreateKernel(pr->prog, nwi > 0 ? "ape_sep_attn_wg" : "ape_sep_attn", &a.err);
	if (nwi > 0 && a.k) { /* the compiled kernel may allow fewer work-items than the device */
		size_t kwg = 0;

		if (clGetKernelWorkGroupInfo(a.k, ape__ocl_dev(q->dev)->id,
					     CL_KERNEL_WORK_GROUP_SIZE, sizeof(kwg), &kwg,
					     NULL) == CL_SUCCESS && kwg > 0)
			while ((size_t)nwi > kwg && nwi > 1)
				nwi /= 2;
	}
	ape__ocl_arg(&a, sizeof(cl_mem), &qr);
	ape__ocl_arg(&a, sizeof(cl_mem), &kt);
	ape__ocl_arg(&a, sizeof(cl_mem), &vf);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->o->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), l->lse ? &l->lse->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), l->pairs ? &l->pairs->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(cl_mem), &qn);
	ape__ocl_arg(&a, sizeof(cl_mem), &pre);
	ape__ocl_arg(&a, sizeof(cl_mem), tab ? &tab : &none);
	ape__ocl_arg_view(&a, l, APE__T_O);
	ape__ocl_arg_view(&a, l, APE__T_LSE);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(Lq), &Lq);
	ape__ocl_arg(&a, sizeof(Lqp), &Lqp);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(Lkp), &Lkp);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(group), &group);
	ape__ocl_arg(&a, sizeof(rel), &rel);
	ape__ocl_arg(&a, sizeof(scale), &scale);
	ape__ocl_arg(&a, sizeof(tol), &tol);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	if (nwi > 0) { /* the work-group shape's K and V tiles in local memory */
		ape__ocl_arg(&a, (size_t)(SEP_GBK * D) * sizeof(float), NULL);
		ape__ocl_arg(&a, (size_t)(SEP_GBK * D) * sizeof(float), NULL);
	}
	if (nwi > 0) /* the work-group shape: nwi rows per group */
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_attn_wg",
					   (size_t)((Lq + nwi - 1) / nwi * nwi), (size_t)nwi,
					   (size_t)(l->B * l->H));
	else
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_attn",
					   (size_t)((Lqp / SEP_BQ + SEP_NB - 1) / SEP_NB), 1,
					   (size_t)(l->B * l->H));
out:
	if (prm)
		clReleaseMemObject(prm);
	if (qr)
		clReleaseMemObject(qr);
	if (kt)
		clReleaseMemObject(kt);
	if (vf)
		clReleaseMemObject(vf);
	if (qn)
		clReleaseMemObject(qn);
	if (tiles)
		clReleaseMemObject(tiles);
	if (pre)
		clReleaseMemObject(pre);
	if (tab)
		clReleaseMemObject(tab);
	return ret;
}

bool ape__ocl_split_applies(struct ape_device *dev, const struct ape__launch *l)
{
	const struct ape__ocl_device *od = ape__ocl_dev(dev);

	/* pairs and lse_prior are contiguous [B, H, Lq]: no view cuts a run of heads out of them */
	if (!sep_wg_shape(od, l->D) || !ape__ocl_fast_outputs(l) || l->pairs ||
	    l->lse_prior || l->D % 32 ||
	    l->D > APE_MAX_D || l->Lq < 1 || l->Lk < 1 || l->Hkv < 1 || l->H % l->Hkv ||
	    l->Lk > ((int64_t)1 << 30))
		return false;
	return ape__launch_mixes_separable(l);
}

/* A homogeneous run: the separable path, or whatever the rest takes. */
static int split_run(struct ape__queue *q, const struct ape__launch *sub, bool separable)
{
	return separable ? ape__ocl_separable(q, sub) : ape__ocl_attention(q, sub);
}

int ape__ocl_split(struct ape__queue *q, const struct ape__launch *l)
{
	return ape__launch_split_runs(q, l, split_run);
}
