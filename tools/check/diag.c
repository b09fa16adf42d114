/* SPDX-License-Identifier: MIT */
/*
 * ape-check's diagnostics cells (tools/check/check.h): ape_attention_forward_diag() on each
 * device against the reference's, O and LSE at the spec's tolerances, each row's entropy within
 * the LSE tolerance of max(1, |LSE|) and its mean distance within it of max(1, max |n|) over the
 * row's visible keys (docs/diagnostics.md). A backend without the diagnostics answers
 * APE_ENOTSUP naming the device: not claimed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check/check.h"
#include "common/refcheck.h"

struct dcase {
	const char *name;
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dtype;
	bool causal, plain; /* plain: lambda = 0 */
	int64_t q_offset; /* q_start - (Lk - Lq) */
};

static const struct dcase dcases[] = {
	{ "diag_gqa_causal_f32", 1, 4, 2, 40, 40, 64, APE_F32, true, false, 0 },
	{ "diag_noncausal_offset_bf16", 2, 2, 1, 17, 90, 32, APE_BF16, false, false, 30 },
	{ "diag_decode_lambda0_f16", 1, 4, 1, 1, 300, 64, APE_F16, true, true, 0 },
};

#define NDCASES ((int)(sizeof(dcases) / sizeof(dcases[0])))

/* The outputs of one diagnostics call. */
struct douts {
	float *o, *lse, *ent, *md;
	ape_tensor to;
};

static void douts_free(struct douts *d)
{
	free(d->o);
	free(d->lse);
	free(d->ent);
	free(d->md);
}

static int douts_make(struct douts *d, const struct check_qkv *x)
{
	const size_t rows = (size_t)(x->B * x->H * x->Lq);

	d->o = check_nan_floats(rows * (size_t)x->D);
	d->lse = check_nan_floats(rows);
	d->ent = check_nan_floats(rows);
	d->md = check_nan_floats(rows);
	if (!d->o || !d->lse || !d->ent || !d->md)
		return APE_ENOMEM;
	ape_tensor_init(&d->to, d->o, APE_F32, x->B, x->H, x->Lq, x->D);
	return 0;
}

static int run(ape_device *dev, const ape_attn_desc *desc, struct check_qkv *x, struct douts *d)
{
	return ape_attention_forward_diag(&dev, 1, NULL, desc, &x->tq, &x->tk, &x->tv, &d->to,
					  d->lse, d->ent, d->md, NULL);
}

/* The largest |n| over the keys row i (of Lq) sees; 1 at least, 1 for a row that sees none. */
static double max_distance(const ape_attn_desc *desc, const struct check_qkv *x, int64_t i)
{
	const double pq = (double)(desc->q_start + i), k0 = (double)desc->k_start;
	const double k1 = k0 + (double)x->Lk - 1;

	if (x->Lk == 0)
		return 1;
	if (desc->causal)
		return pq >= k0 ? fmax(1, pq - k0) : 1;
	return fmax(1, fmax(fabs(pq - k0), fabs(pq - k1)));
}

/* Records the cell of d against want. */
static void compare(const struct dcase *c, int dv, const ape_attn_desc *desc,
		    const struct check_qkv *x, const struct douts *d, const struct douts *want)
{
	static const char *const labels[] = { "O", "LSE", "ENT", "MD" };
	const size_t rows = (size_t)(x->B * x->H * x->Lq);
	double err[4], tol[4];

	err[0] = check_err_abs(d->o, want->o, rows * (size_t)x->D,
			       check_max_abs(x->vf, (size_t)(x->B * x->Hkv * x->Lk * x->D)));
	err[1] = check_err_rel(d->lse, want->lse, rows);
	err[2] = err[3] = 0;
	for (size_t r = 0; r < rows; r++) {
		err[2] = fmax(err[2], check_err_one(d->ent[r], want->ent[r], want->lse[r]));
		err[3] = fmax(err[3], check_err_one(d->md[r], want->md[r],
					       max_distance(desc, x, (int64_t)r % x->Lq)));
	}
	tol[0] = refcheck_tol_o(c->dtype);
	tol[1] = tol[2] = tol[3] = refcheck_tol_lse(c->dtype);
	check_add_errors(CHECK_DIAG, c->name, dv, 4, labels, err, tol);
}

int check_diag(const struct check_env *env)
{
	for (int i = 0; i < NDCASES; i++) {
		const struct dcase *c = &dcases[i];
		struct douts want = { 0 };
		struct check_qkv x;
		ape_attn_desc desc;
		int ret = check_qkv_make(&x, env->rng, c->dtype, c->B, c->H, c->Hkv, c->Lq, c->Lk,
					 c->D);

		check_seed_desc(&desc);
		if (c->plain)
			desc.lambda.value = 0;
		desc.causal = c->causal;
		desc.q_start = c->Lk - c->Lq + c->q_offset;
		desc.q_start_set = true;
		if (!ret)
			ret = douts_make(&want, &x);
		if (!ret && (ret = run(env->ref, &desc, &x, &want)))
			fprintf(stderr, "ape-check: %s on the reference: %s\n", c->name,
				ape_last_error());
		for (int dv = 0; dv < env->ndev && !ret; dv++) {
			struct douts d = { 0 };
			int r;

			if ((ret = douts_make(&d, &x))) {
				douts_free(&d);
				break;
			}
			r = run(env->devs[dv], &desc, &x, &d);
			if (r)
				check_add_error(CHECK_DIAG, c->name, dv, env->devs[dv], r, true);
			else
				compare(c, dv, &desc, &x, &d, &want);
			douts_free(&d);
		}
		douts_free(&want);
		check_qkv_free(&x);
		if (ret == APE_ENOMEM)
			fprintf(stderr, "ape-check: out of memory\n");
		if (ret)
			return ret;
	}
	return 0;
}
