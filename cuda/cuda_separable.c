/* SPDX-License-Identifier: MIT */
/*
 * The separable path (kernels/separable.cu): launches whose every head has lambda = 0, in f16 or
 * bf16, at D = 64 or 128. ape_sep_rot rotates Q and K once into scratch (V copied beside them),
 * with skipping ape_prep and ape_kscan take the key-tile norms, then ape_sep_<d>_<type> runs the
 * tensor-core tiles. The predicate is conservative: a launch it does not serve in full (float32,
 * other head sizes, few query rows, lse_prior, the diagnostics ent and md, more heads than the
 * argument struct carries) goes to the general kernels (cuda_attention.c).
 */
#include <string.h>

#include "cu.h"
#include "kernels/sep_args.h"

struct sep_plan {
	size_t qr, kr, vr, qn, qf, kf, ktile, pre, suf, bias, total;
	int64_t ntk;
	int64_t tlen; /* the distance-bias table's entries per row uploaded (bias) */
	bool skip;
};

static size_t sep_take(struct sep_plan *p, size_t bytes)
{
	const size_t off = p->total;

	p->total += (bytes + 255) & ~(size_t)255;
	return off;
}

/* The shape alone (attention_scratch knows no parameters): f16/bf16, D 64 or 128, a dense
 * prefill (a ragged launch takes the general kernels: docs/kernels.md, "Ragged launches"). */
static bool sep_shape(const struct ape_be_launch *l)
{
	return (l->in_dtype == APE_F16 || l->in_dtype == APE_BF16) && (l->D == 64 || l->D == 128) &&
	       l->Lq > APE_DC_MAX_LQ && l->Lk >= 1 && l->H <= APE_CU_INLINE_HEADS && l->Hkv >= 1 &&
	       l->H % l->Hkv == 0 && !l->lse_prior && !l->ent && !l->md && !l->segs;
}

/* positions: l's positions are those of the launch to run (not the scratch figure's shape) */
static void sep_plan(const struct ape_be_launch *l, bool positions, struct sep_plan *p)
{
	const size_t esz = 2, nq = (size_t)(l->B * l->H * l->Lq), nk = (size_t)(l->B * l->Hkv * l->Lk);
	const size_t nbkv = (size_t)(l->B * l->Hkv);

	memset(p, 0, sizeof(*p));
	p->total = 256; /* no region at offset 0 */
	p->ntk = (l->Lk + APE_SEP_BK - 1) / APE_SEP_BK;
	p->skip = l->causal && l->skip_tol > 0 && l->decay_nonneg;
	p->qr = sep_take(p, nq * 2 * (size_t)l->D * esz); /* hi and lo */
	p->kr = sep_take(p, nk * 2 * (size_t)l->D * esz);
	p->vr = sep_take(p, nk * (size_t)l->D * esz);
	p->qn = sep_take(p, nq * sizeof(double));
	p->qf = sep_take(p, nq * sizeof(float)); /* the f16 range's factors (sep_args.h) */
	p->kf = sep_take(p, nbkv * (size_t)p->ntk * sizeof(float));
	if (p->skip) {
		p->ktile = sep_take(p, nbkv * (size_t)p->ntk * 4);
		p->pre = sep_take(p, nbkv * (size_t)(p->ntk + 1) * 4);
		p->suf = sep_take(p, nbkv * (size_t)(p->ntk + 1) * 4);
	}
	if (l->bias_table) { /* the entries it reads, and the skip bound's suffix maxima */
		p->tlen = ape__cu_bias_entries(l, positions);
		p->bias = sep_take(p, ape__cu_bias_bytes(l, p->tlen, p->skip));
	}
}

bool ape__cu_separable_applies(const struct ape_be_launch *l)
{
	if (!sep_shape(l))
		return false;
	for (int64_t h = 0; h < l->H; h++)
		if (l->head_params[4 * h + 3] != 0) /* lambda: alpha = temp = 1 only at 0 */
			return false;
	return true;
}

bool ape__cu_separable_may_apply(const struct ape_be_launch *l)
{
	struct ape_be_launch x = *l;

	x.lse_prior = NULL;
	x.ent = x.md = NULL;
	if (!sep_shape(&x))
		return false;
	for (int64_t h = 0; h < l->H; h++)
		if (l->head_params[4 * h + 3] == 0)
			return true;
	return false;
}

uint64_t ape__cu_separable_scratch(const struct ape_be_launch *l)
{
	struct sep_plan p;

	if (!sep_shape(l))
		return 0;
	sep_plan(l, false, &p);
	return p.total;
}

static int sep_run(struct ape_be_queue *q, const struct ape_be_launch *l, const struct sep_plan *p,
		   CUdeviceptr scratch, bool o_scalar)
{
	struct ape_cu_sep_rot_args r;
	struct ape_cu_sep_args a;
	const int64_t nq = l->B * l->H * l->Lq, nbkv = l->B * l->Hkv;
	const int64_t wpb = APE_CU_THREADS / 32;
	const int variant = (l->D == 128 ? 2 : 0) + (l->in_dtype == APE_BF16);
	int ret;

	memset(&r, 0, sizeof(r));
	r.q = l->q->ptr;
	r.k = l->k->ptr;
	r.v = l->v->ptr;
	r.qr = scratch + p->qr;
	r.kr = scratch + p->kr;
	r.vr = scratch + p->vr;
	r.qn = scratch + p->qn;
	r.qf = scratch + p->qf;
	r.kf = scratch + p->kf;
	r.rel = l->q_start - l->k_start;
	r.Lq = l->Lq;
	r.Lk = l->Lk;
	r.nq = nq;
	r.nqb = (nq + wpb - 1) / wpb;
	r.nbkv = nbkv;
	r.ntk = p->ntk;
	for (int i = 0; i < l->D / 2; i++)
		r.omega[i] = l->omega[i];
	r.vq = ape__cu_view(l, APE_BE_T_Q);
	r.vk = ape__cu_view(l, APE_BE_T_K);
	r.vv = ape__cu_view(l, APE_BE_T_V);
	r.H = (int32_t)l->H;
	r.Hkv = (int32_t)l->Hkv;
	r.D = (int32_t)l->D;
	r.dt = (int32_t)l->in_dtype;
	r.interleaved = l->layout == APE_ROPE_INTERLEAVED;
	ret = ape__cu_launch(q, APE__CU_K_SEP_ROT, r.nqb + nbkv * p->ntk, 0, &r, "ape_sep_rot");
	if (ret)
		return ret;

	if (p->skip) { /* the key-tile norms and their prefix maxima, as the prefill takes them */
		const struct ape__cu_prep pp = {
			.ktile = scratch + p->ktile,
			.pre = scratch + p->pre,
			.suf = scratch + p->suf,
			.ntile = p->ntk,
			.tile = APE_SEP_BK,
			.dmax = (int)l->D,
		};

		ret = ape__cu_prep_keys(q, l, &pp);
		if (ret)
			return ret;
	}

	memset(&a, 0, sizeof(a));
	a.qr = r.qr;
	a.kr = r.kr;
	a.vr = r.vr;
	a.qn = r.qn;
	a.qf = r.qf;
	a.kf = r.kf;
	a.pre = p->skip ? scratch + p->pre : 0;
	a.o = l->o->ptr;
	a.lse = l->lse ? l->lse->ptr : 0;
	a.pairs = l->pairs ? l->pairs->ptr : 0;
	a.Lq = l->Lq;
	a.Lk = l->Lk;
	a.rel = r.rel;
	a.nqt = (l->Lq + APE_SEP_BQ - 1) / APE_SEP_BQ;
	a.ntk = p->ntk;
	a.scale = l->scale;
	a.tol = p->skip ? l->skip_tol : 0.0;
	a.vo = ape__cu_view(l, APE_BE_T_O);
	a.vlse = ape__cu_view(l, APE_BE_T_LSE);
	if (p->bias) {
		ret = ape__cu_upload_bias(q, l, p->tlen, p->skip, scratch + p->bias);
		if (ret)
			return ret;
		a.bias = ape__cu_bias_at(l, p->tlen, p->skip, scratch + p->bias);
	}
	a.B = (int32_t)l->B;
	a.H = (int32_t)l->H;
	a.Hkv = (int32_t)l->Hkv;
	a.D = (int32_t)l->D;
	a.dt_out = (int32_t)l->out_dtype;
	a.flags = (l->causal ? APE_CU_F_CAUSAL : 0) | (l->lse ? APE_CU_F_LSE : 0) |
		  (l->pairs ? APE_CU_F_PAIRS : 0) | (p->skip ? APE_CU_F_SKIP : 0) |
		  (o_scalar ? APE_CU_F_O_SCALAR : 0);
	memcpy(a.hp, l->head_params, (size_t)l->H * 4 * sizeof(float));
	return ape__cu_launch(q, APE__CU_K_SEP + variant, a.nqt * l->B * l->H,
			      (unsigned)APE_SEP_SMEM(l->D), &a, "separable");
}

int ape__cu_separable(struct ape_be_queue *q, const struct ape_be_launch *l, bool o_scalar)
{
	CUdeviceptr scratch = 0;
	struct sep_plan p;
	int ret, ret2;

	sep_plan(l, true, &p);
	ret = ape__cu_scratch_alloc(q, p.total, &scratch);
	if (ret)
		return ret;
	ret = sep_run(q, l, &p, scratch, o_scalar);
	ret2 = ape__cu_scratch_free(q, scratch);
	return ret ? ret : ret2;
}

bool ape__cu_split_applies(const struct ape_be_launch *l)
{
	/* pairs is contiguous [B, H, Lq]: no view cuts a run of heads out of it */
	return sep_shape(l) && !l->pairs && ape_be_launch_mixes_separable(l);
}

/* A homogeneous run: the separable path, or the general kernels, as for any launch. */
static int split_run(struct ape_be_queue *q, const struct ape_be_launch *sub, bool separable)
{
	(void)separable;
	return ape__cu_attention(q, sub);
}

int ape__cu_split(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	return ape_be_launch_split_runs(q, l, split_run);
}
