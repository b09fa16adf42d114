/* SPDX-License-Identifier: MIT */
/*
 * ape-check's ragged cells (tools/check/check.h): ragged batches
 * (ape_attention_forward_varlen()) on each device against the same batch on the reference,
 * whose own ragged call tests/test_varlen.c checks against an independent per-sequence oracle.
 * Fresh random data every run; every row of every sequence compared.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check/check.h"
#include "common/refcheck.h"
#include "common/seed.h"

enum pos_kind { POS_DEFAULT, POS_GAPS };

struct vcase {
	const char *name;
	int64_t S, lmin, lmax; /* sequences, each of lmin..lmax keys */
	int64_t H, Hkv, D;
	ape_dtype dtype;
	bool causal;
	int lq_kind; /* 0: Lq = Lk; 1: Lq <= Lk (chunked prefill); 2: decode rows (Lq = 1) */
	enum pos_kind pos;
	bool plain; /* lambda = delta = beta = gamma = 0 (plain RoPE): the separable paths */
};

static const struct vcase vcases[] = {
	{ "ragged_mixed_prefill_f32", 7, 0, 90, 4, 2, 64, APE_F32, true, 1, POS_DEFAULT, false },
	{ "ragged_tiny_1000_f16", 1000, 1, 4, 2, 1, 32, APE_F16, true, 0, POS_DEFAULT, false },
	{ "ragged_rope_bf16_d128", 9, 1, 70, 2, 2, 128, APE_BF16, true, 0, POS_DEFAULT, true },
	{ "ragged_decode_rows_f32", 16, 1, 300, 4, 1, 64, APE_F32, true, 2, POS_DEFAULT, false },
	{ "ragged_gapped_noncausal", 5, 1, 40, 3, 1, 64, APE_F32, false, 1, POS_GAPS, false },
};

#define NVCASES ((int)(sizeof(vcases) / sizeof(vcases[0])))

struct vdata {
	int64_t S, tq, tk;
	int64_t *cuq, *cuk, *posq, *posk;
	void *q, *k, *v, *o, *oref;
	float *lse, *lseref, *vf;
	ape_varlen vl;
	ape_attn_desc desc;
};

static void vdata_free(struct vdata *d)
{
	void *const p[] = { d->cuq, d->cuk, d->posq, d->posk, d->q, d->k, d->v, d->o,
			    d->oref, d->lse, d->lseref, d->vf };

	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

static int vdata_make(const struct vcase *c, ape_rng *rng, struct vdata *d)
{
	int64_t lk[1000], lq[1000];

	memset(d, 0, sizeof(*d));
	d->S = c->S;
	for (int64_t s = 0; s < c->S; s++) {
		lk[s] = ape_rng_range(rng, c->lmin, c->lmax);
		lq[s] = c->lq_kind == 2 ? (lk[s] > 0) : c->lq_kind == 1 ? ape_rng_range(rng, 0, lk[s])
									 : lk[s];
		d->tq += lq[s];
		d->tk += lk[s];
	}
	d->cuq = calloc((size_t)c->S + 1, sizeof(int64_t));
	d->cuk = calloc((size_t)c->S + 1, sizeof(int64_t));
	d->posq = malloc((size_t)d->tq * sizeof(int64_t) + 1);
	d->posk = malloc((size_t)d->tk * sizeof(int64_t) + 1);
	d->vf = malloc((size_t)(d->tk * c->Hkv * c->D) * sizeof(float) + 1);
	if (!d->cuq || !d->cuk || !d->posq || !d->posk || !d->vf)
		return APE_ENOMEM;
	for (int64_t s = 0; s < c->S; s++) {
		d->cuq[s + 1] = d->cuq[s] + lq[s];
		d->cuk[s + 1] = d->cuk[s] + lk[s];
		/* gaps: keys in two runs 7 apart, queries at the second run's end, two at one
		 * position */
		for (int64_t j = 0; j < lk[s]; j++)
			d->posk[d->cuk[s] + j] = j + (c->pos == POS_GAPS && j >= lk[s] / 2 ? 7 : 0);
		for (int64_t i = 0; i < lq[s]; i++)
			d->posq[d->cuq[s] + i] = (c->pos == POS_GAPS ? 7 + lk[s] - lq[s] + i / 2 * 2
								     : lk[s] - lq[s] + i);
	}
	d->q = ape_rng_array(rng, (size_t)(d->tq * c->H * c->D), c->dtype, NULL);
	d->k = ape_rng_array(rng, (size_t)(d->tk * c->Hkv * c->D), c->dtype, NULL);
	d->v = ape_rng_array(rng, (size_t)(d->tk * c->Hkv * c->D), c->dtype, d->vf);
	d->o = malloc((size_t)(d->tq * c->H * c->D) * ape_dtype_size(c->dtype) + 1);
	d->oref = malloc((size_t)(d->tq * c->H * c->D) * ape_dtype_size(c->dtype) + 1);
	d->lse = malloc((size_t)(d->tq * c->H) * sizeof(float) + 1);
	d->lseref = malloc((size_t)(d->tq * c->H) * sizeof(float) + 1);
	if (!d->q || !d->k || !d->v || !d->o || !d->oref || !d->lse || !d->lseref)
		return APE_ENOMEM;
	/* the stored V, for the error's scale */
	ape_convert(d->vf, APE_F32, d->v, c->dtype, (size_t)(d->tk * c->Hkv * c->D));
	ape_varlen_init(&d->vl);
	d->vl.num_seqs = c->S;
	d->vl.cu_seqlens_q = d->cuq;
	d->vl.cu_seqlens_k = d->cuk;
	if (c->pos == POS_GAPS) {
		d->vl.pos_q = d->posq;
		d->vl.pos_k = d->posk;
	}
	ape_attn_desc_init(&d->desc);
	d->desc.causal = c->causal;
	if (!c->plain) {
		d->desc.delta.value = (float)SEED_DELTA;
		d->desc.beta.value = (float)SEED_BETA;
		d->desc.gamma.value = (float)SEED_GAMMA;
		d->desc.lambda.value = (float)SEED_LAMBDA;
	}
	return 0;
}

static int vcall(ape_device *dev, const struct vcase *c, struct vdata *d, void *o, float *lse,
		 ape_stats *st)
{
	ape_tensor q, k, v, to;

	ape_tensor_init_packed(&q, d->q, c->dtype, d->tq, c->H, c->D);
	ape_tensor_init_packed(&k, d->k, c->dtype, d->tk, c->Hkv, c->D);
	ape_tensor_init_packed(&v, d->v, c->dtype, d->tk, c->Hkv, c->D);
	ape_tensor_init_packed(&to, o, c->dtype, d->tq, c->H, c->D);
	return ape_attention_forward_varlen(dev, &d->desc, &d->vl, &q, &k, &v, &to, lse, st);
}

/* Every row of d->o, d->lse against the reference's. */
static void compare(const struct vcase *c, const struct vdata *d, struct vcell *cell)
{
	const size_t n = (size_t)(d->tq * c->H * c->D);
	float *x = malloc(n * sizeof(float) + 1), *y = malloc(n * sizeof(float) + 1);
	double vmax = 0;

	cell->tol_o = refcheck_tol_o(c->dtype);
	cell->tol_lse = refcheck_tol_lse(c->dtype);
	if (!x || !y) {
		cell->err = APE_ENOMEM;
		free(x);
		free(y);
		return;
	}
	ape_convert(x, APE_F32, d->o, c->dtype, n);
	ape_convert(y, APE_F32, d->oref, c->dtype, n);
	for (int64_t i = 0; i < d->tk * c->Hkv * c->D; i++)
		vmax = fmax(vmax, fabs(d->vf[i]));
	for (size_t i = 0; i < n; i++) {
		const double e = x[i] == y[i] ? 0 : fabs((double)x[i] - y[i]) / fmax(vmax, 1e-30);

		cell->max_err_o = fmax(cell->max_err_o, e != e ? INFINITY : e);
	}
	for (int64_t i = 0; i < d->tq * c->H; i++) {
		const double a = d->lse[i], b = d->lseref[i];
		const double e = a == b ? 0
				 : isinf(a) || isinf(b) ? INFINITY
							 : fabs(a - b) / fmax(1, fabs(b));

		cell->max_err_lse = fmax(cell->max_err_lse, e != e ? INFINITY : e);
	}
	cell->rows = d->tq * c->H;
	free(x);
	free(y);
}

static bool vcell_ok(const struct vcell *c)
{
	return !c->err && c->max_err_o <= c->tol_o && c->max_err_lse <= c->tol_lse;
}

/* The cell's record: O and LSE against their tolerances. */
static void record(const struct vcell *cell, int dv)
{
	static const char *const labels[] = { "O", "LSE" };
	const double err[2] = { cell->max_err_o, cell->max_err_lse };
	const double tol[2] = { cell->tol_o, cell->tol_lse };

	if (cell->err) /* out of host memory in compare() */
		check_add(CHECK_RAGGED, cell->name, dv, CHECK_FAIL, NAN, NAN, "%s",
			  ape_err_name(cell->err));
	else
		check_add_errors(CHECK_RAGGED, cell->name, dv, 2, labels, err, tol);
}

int check_varlen(ape_device **devs, int ndev, ape_device *ref, ape_rng *rng, bool quick,
		 struct vcell (*cells)[CHECK_MAX_DEVICES], int *ncases)
{
	int n = 0;

	for (int i = 0; i < NVCASES; i++) {
		const struct vcase *c = &vcases[i];
		struct vdata d;
		int ret;

		if (quick && c->S > 100)
			continue;
		ret = vdata_make(c, rng, &d);
		if (!ret)
			ret = vcall(ref, c, &d, d.oref, d.lseref, NULL);
		if (ret) {
			fprintf(stderr, "ape-check: %s on the reference: %s\n", c->name,
				ret == APE_ENOMEM ? "out of memory" : ape_last_error());
			vdata_free(&d);
			return ret;
		}
		for (int dv = 0; dv < ndev; dv++) {
			struct vcell *cell = &cells[n][dv];
			ape_stats st;

			memset(cell, 0, sizeof(*cell));
			cell->name = c->name;
			cell->dtype = c->dtype;
			ape_stats_init(&st);
			cell->err = vcall(devs[dv], c, &d, d.o, d.lse, &st);
			if (cell->err) {
				snprintf(cell->msg, sizeof(cell->msg), "%s", ape_last_error());
				check_add_error(CHECK_RAGGED, c->name, dv, devs[dv], cell->err,
						true);
				continue;
			}
			cell->launches = st.chunks;
			compare(c, &d, cell);
			cell->ok = vcell_ok(cell);
			record(cell, dv);
		}
		vdata_free(&d);
		n++;
	}
	*ncases = n;
	return 0;
}
