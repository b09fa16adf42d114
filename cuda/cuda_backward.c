/* SPDX-License-Identifier: MIT */
/*
 * One backward launch (core/backend.h, struct ape__bwd_launch) on the queue's stream, in the
 * order of cuda/kernels/backward.cu: the row table (ape_bwd_rows), the keys sweep (dK, dV; only
 * when one of them is wanted), the queries sweep (dQ, the alpha path and the per-block parameter
 * sums; only when dQ or dparams is wanted) and the per-head float64 reduction of those sums
 * (ape_bwd_params; only with dparams). Frozen Q, K, V with only dparams wanted ("tune APE only")
 * runs the row table, the queries sweep without its dQ work, and the reduction.
 *
 * Scratch, one stream-ordered allocation freed in stream order after the last kernel: the row
 * table (24 bytes per query row), the queries sweep's per-block parameter sums (32 bytes per
 * block of APE_BW_ROWS query rows) and, past APE_CU_INLINE_HEADS heads, their parameters: a
 * few bytes per query row, never O(Lq * Lk) nor O(L * D). The core does not count it yet
 * (struct ape__backend_ops has no backward scratch op), as for the OpenCL backend.
 */
#include <string.h>

#include "core/error.h"
#include "cu.h"
#include "kernels/bwd_args.h"

/* Head-size variants, as the forward's (cuda_attention.c): D = 64 and 128 specialised, every
 * other even D up to 128 and up to 256 generic. */
static int bwd_variant(int64_t D, int *dmax)
{
	const int v = D == 64 ? APE__CU_V_D64 : D == 128 ? APE__CU_V_D128 : D <= 128 ? APE__CU_V_G128
											: APE__CU_V_G256;

	*dmax = v == APE__CU_V_D64 ? 64 : v == APE__CU_V_G256 ? 256 : 128;
	return v;
}

static int bwd_check(const struct ape_device *dev, const struct ape__bwd_launch *l)
{
	const struct ape__launch *f = &l->f;

	if (f->D < 2 || f->D > 256 || f->D % 2 || f->B < 1 || f->H < 1 || f->Hkv < 1 ||
	    f->H % f->Hkv || f->Lq < 0 || f->Lk < 0 || (unsigned)f->in_dtype > APE_BF16 ||
	    (f->out_dtype != f->in_dtype && f->out_dtype != APE_F32) ||
	    (l->dout_dtype != f->in_dtype && l->dout_dtype != APE_F32) || !f->lse || !f->o ||
	    !l->dout)
		return ape__error(APE_EINVAL,
				  "cuda %s: backward launch B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld "
				  "D=%lld (or its types, or a missing o, lse or dout) is not one the "
				  "kernels take",
				  dev->info.name, (long long)f->B, (long long)f->H, (long long)f->Hkv,
				  (long long)f->Lq, (long long)f->Lk, (long long)f->D);
	if (f->Lq > INT32_MAX || f->Lk > INT32_MAX || f->B * f->H > INT32_MAX)
		return ape__error(APE_EINVAL,
				  "cuda %s: Lq=%lld, Lk=%lld: more rows than one launch takes "
				  "(2^31 - 1); use smaller chunks",
				  dev->info.name, (long long)f->Lq, (long long)f->Lk);
	return 0;
}

static uint64_t ptr_of(const struct ape__buf *b)
{
	return b ? (uint64_t)b->ptr : 0;
}

/* The arguments every backward kernel takes, scratch offsets aside. */
static void bwd_args(const struct ape__bwd_launch *l, int dmax, struct ape_cu_bwd_args *a)
{
	const struct ape__launch *f = &l->f;
	const int64_t rows = APE_BW_ROWS(dmax);

	*a = (struct ape_cu_bwd_args){
		.q = ptr_of(f->q), .k = ptr_of(f->k), .v = ptr_of(f->v), .o = ptr_of(f->o),
		.lse = ptr_of(f->lse), .dout = ptr_of(l->dout), .dlse = ptr_of(l->dlse),
		.dq = ptr_of(l->dq), .dk = ptr_of(l->dk), .dv = ptr_of(l->dv),
		.dparams = ptr_of(l->dparams),
		.Lq = f->Lq, .Lk = f->Lk, .rel = f->q_start - f->k_start,
		.nqt = (f->Lq + rows - 1) / rows, .nkt = (f->Lk + rows - 1) / rows,
		.scale = f->scale,
		.B = (int32_t)f->B, .H = (int32_t)f->H, .Hkv = (int32_t)f->Hkv, .D = (int32_t)f->D,
		.dt_in = (int32_t)f->in_dtype, .dt_out = (int32_t)f->out_dtype,
		.dt_do = (int32_t)l->dout_dtype,
		.flags = (f->causal ? APE_CU_F_CAUSAL : 0) |
			 (f->layout == APE_ROPE_INTERLEAVED ? APE_CU_F_INTERLEAVED : 0) |
			 (l->dlse ? APE_BW_F_DLSE : 0) | (l->dq ? APE_BW_F_DQ : 0) |
			 (l->dk ? APE_BW_F_DK : 0) | (l->dv ? APE_BW_F_DV : 0) |
			 (l->dparams ? APE_BW_F_DP : 0),
	};
	memcpy(a->omega, f->omega, (size_t)(f->D / 2) * sizeof(double));
	if (f->H <= APE_CU_INLINE_HEADS)
		memcpy(a->hp, f->head_params, (size_t)f->H * 4 * sizeof(float));
}

/* The four kernels, in order, on the queue; scratch holds the row table at offset 0, then the
 * block sums at part_off, then the heads' parameters at hp_off (0: inline). */
static int bwd_run(struct ape__queue *q, const struct ape__bwd_launch *l, int variant, int dmax,
		   struct ape_cu_bwd_args *a, CUdeviceptr scratch, size_t part_off, size_t hp_off)
{
	const struct ape__launch *f = &l->f;
	const int64_t rows = f->B * f->H * f->Lq;
	const unsigned smem = APE_BW_SMEM(dmax);
	int ret = 0;

	a->rinfo = scratch;
	a->part = l->dparams ? scratch + part_off : 0;
	a->hparams = hp_off ? scratch + hp_off : 0;
	if (hp_off)
		ret = ape__cu_upload_head_params(q, f, scratch + hp_off);
	if (!ret)
		ret = ape__cu_launch(q, APE__CU_K_BWD_ROWS,
				     (rows + APE_BW_ROWS_PER_BLOCK - 1) / APE_BW_ROWS_PER_BLOCK, 0, a,
				     "ape_bwd_rows");
	if (!ret && (l->dk || l->dv))
		ret = ape__cu_launch(q, APE__CU_K_BWD_KEYS + variant, a->nkt * f->B * f->Hkv, smem, a,
				     "backward keys sweep");
	if (!ret && (l->dq || l->dparams))
		ret = ape__cu_launch(q, APE__CU_K_BWD_QUERIES + variant, a->nqt * f->B * f->H, smem,
				     a, "backward queries sweep");
	if (!ret && l->dparams)
		ret = ape__cu_launch(q, APE__CU_K_BWD_PARAMS,
				     (f->H + APE_CU_THREADS - 1) / APE_CU_THREADS, 0, a,
				     "ape_bwd_params");
	return ret;
}

static size_t align256(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

int ape__cu_attention_backward(struct ape__queue *q, const struct ape__bwd_launch *l)
{
	const struct ape__launch *f = &l->f;
	struct ape_cu_bwd_args a;
	CUdeviceptr scratch = 0;
	size_t part_off, hp_off, total;
	int variant, dmax, ret, ret2;

	ret = bwd_check(q->dev, l);
	if (ret || !(l->dq || l->dk || l->dv || l->dparams) || f->B * f->H * f->Lq == 0 ||
	    f->Lk == 0)
		return ret; /* no row sees a key: nothing to add */
	variant = bwd_variant(f->D, &dmax);
	bwd_args(l, dmax, &a);
	part_off = align256((size_t)(f->B * f->H * f->Lq) * APE_BW_RI_N * sizeof(double));
	hp_off = part_off + align256((size_t)(f->B * f->H * a.nqt) * 4 * sizeof(double));
	total = hp_off + (f->H > APE_CU_INLINE_HEADS ? (size_t)f->H * 4 * sizeof(float) : 0);
	if (f->H <= APE_CU_INLINE_HEADS)
		hp_off = 0;

	ret = ape__cu_enter(q->dev);
	if (ret)
		return ret;
	ret = ape__cu_module(q->dev);
	if (!ret)
		ret = ape__cu_scratch_alloc(q, total, &scratch);
	if (ret)
		goto out_leave;
	ret = bwd_run(q, l, variant, dmax, &a, scratch, part_off, hp_off);
	ret2 = ape__cu_scratch_free(q, scratch);
	ret = ret ? ret : ret2;
out_leave:
	ape__cu_leave(q->dev);
	return ret;
}
