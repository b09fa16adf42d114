/* SPDX-License-Identifier: MIT */
/*
 * ape-check's ragged cells (tools/check/check.h): ragged batches
 * (ape_attention_forward_varlen()) on each device against the same batch on the reference,
 * whose own ragged call tests/test_varlen.c checks against an independent per-sequence oracle;
 * then the backward of the same batch (ape_attention_backward_varlen()) on each device against
 * the reference's, both from the reference's O and LSE with the same random dO (of the storage
 * type) and dLSE: dQ, dK, dV (of the storage type) and dparams against the spec's "Gradients"
 * tolerance (refcheck_tol_grad()), each relative to max |reference gradient|. Whichever way
 * the backward runs the batch (one executor run with ragged launches where every device
 * states bwd_segments, else a dense backward per piece), the cell is the same. A device that
 * refuses the backward with APE_ENOTSUP naming it, and does not state APE_BE_CAP_BACKWARD, has
 * it skipped (said in the cell's message), no failure. Fresh random data every run; every row
 * of every sequence and every gradient value compared.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape_backend.h"
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
	/* the backward: dO (storage type), dLSE; the device's gradients (storage type) and the
	 * reference's (float32), dparams [H, 4] */
	void *dout, *gq, *gk, *gv;
	float *dlse, *gp, *rq, *rk, *rv, *rp;
	ape_varlen vl;
	ape_attn_desc desc;
};

static void vdata_free(struct vdata *d)
{
	void *const p[] = { d->cuq, d->cuk, d->posq, d->posk, d->q, d->k, d->v, d->o,
			    d->oref, d->lse, d->lseref, d->vf, d->dout, d->gq, d->gk, d->gv,
			    d->dlse, d->gp, d->rq, d->rk, d->rv, d->rp };

	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* The backward's inputs dO, dLSE (random) and its gradients' buffers. Returns 0 or -1. */
static int vdata_make_bwd(const struct vcase *c, ape_rng *rng, struct vdata *d)
{
	const size_t nq = (size_t)(d->tq * c->H * c->D), nk = (size_t)(d->tk * c->Hkv * c->D);
	const size_t esz = ape_dtype_size(c->dtype), rows = (size_t)(d->tq * c->H);

	d->dout = ape_rng_array(rng, nq, c->dtype, NULL);
	d->dlse = malloc(rows * sizeof(float) + 1);
	d->gq = malloc(nq * esz + 1);
	d->gk = malloc(nk * esz + 1);
	d->gv = malloc(nk * esz + 1);
	d->gp = malloc((size_t)(4 * c->H) * sizeof(float));
	d->rq = malloc(nq * sizeof(float) + 1);
	d->rk = malloc(nk * sizeof(float) + 1);
	d->rv = malloc(nk * sizeof(float) + 1);
	d->rp = malloc((size_t)(4 * c->H) * sizeof(float));
	if (!d->dout || !d->dlse || !d->gq || !d->gk || !d->gv || !d->gp || !d->rq || !d->rk ||
	    !d->rv || !d->rp)
		return -1;
	for (size_t i = 0; i < rows; i++)
		d->dlse[i] = (float)ape_rng_normal(rng);
	return 0;
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
	if (vdata_make_bwd(c, rng, d))
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

/* The backward of the batch on dev from the reference's O and LSE, into gradients of type gt
 * (the storage type, or float32 for the reference's own). */
static int vbwd(ape_device *dev, const struct vcase *c, struct vdata *d, ape_dtype gt, void *gq,
		void *gk, void *gv, float *gp, ape_stats *st)
{
	ape_tensor q, k, v, o, dout, dq, dk, dv;

	ape_tensor_init_packed(&q, d->q, c->dtype, d->tq, c->H, c->D);
	ape_tensor_init_packed(&k, d->k, c->dtype, d->tk, c->Hkv, c->D);
	ape_tensor_init_packed(&v, d->v, c->dtype, d->tk, c->Hkv, c->D);
	ape_tensor_init_packed(&o, d->oref, c->dtype, d->tq, c->H, c->D);
	ape_tensor_init_packed(&dout, d->dout, c->dtype, d->tq, c->H, c->D);
	ape_tensor_init_packed(&dq, gq, gt, d->tq, c->H, c->D);
	ape_tensor_init_packed(&dk, gk, gt, d->tk, c->Hkv, c->D);
	ape_tensor_init_packed(&dv, gv, gt, d->tk, c->Hkv, c->D);
	return ape_attention_backward_varlen(&dev, 1, NULL, &d->desc, &d->vl, &q, &k, &v, &o,
					     d->lseref, &dout, d->dlse, &dq, &dk, &dv, gp, st);
}

/* The device's gradients against the reference's, each over max |reference gradient|. */
static void compare_bwd(const struct vcase *c, const struct vdata *d, struct vcell *cell)
{
	const size_t n[3] = { (size_t)(d->tq * c->H * c->D), (size_t)(d->tk * c->Hkv * c->D),
			      (size_t)(d->tk * c->Hkv * c->D) };
	const void *const got[3] = { d->gq, d->gk, d->gv };
	const float *const want[3] = { d->rq, d->rk, d->rv };

	cell->tol_grad = refcheck_tol_grad(c->dtype);
	for (int g = 0; g < 3; g++) { /* REFCHECK_DQ, REFCHECK_DK, REFCHECK_DV */
		float *x = check_to_f32(got[g], c->dtype, n[g]);

		if (!x) {
			cell->bwd_err = APE_ENOMEM;
			snprintf(cell->bwd_msg, sizeof(cell->bwd_msg), "out of host memory");
			return;
		}
		cell->max_err_grad[g] = check_err_grad(x, want[g], n[g]);
		free(x);
	}
	cell->max_err_grad[REFCHECK_DPARAMS] = check_err_grad(d->gp, d->rp, (size_t)(4 * c->H));
}

/* n values of type t, every one NaN: a gradient the call leaves unwritten stays NaN, an
 * infinite error, rather than the previous device's. */
static void fill_nan(void *p, ape_dtype t, size_t n)
{
	const float x = NAN;
	const size_t esz = ape_dtype_size(t);
	char one[8];

	ape_convert(one, t, &x, APE_F32, 1);
	for (size_t i = 0; i < n; i++)
		memcpy((char *)p + i * esz, one, esz);
}

/* The backward's part of a cell on dev whose forward passed on to it. */
static void run_bwd(ape_device *dev, const struct vcase *c, struct vdata *d, struct vcell *cell)
{
	const size_t nq = (size_t)(d->tq * c->H * c->D), nk = (size_t)(d->tk * c->Hkv * c->D);
	ape_stats st;

	cell->bwd_ran = true;
	fill_nan(d->gq, c->dtype, nq);
	fill_nan(d->gk, c->dtype, nk);
	fill_nan(d->gv, c->dtype, nk);
	fill_nan(d->gp, APE_F32, (size_t)(4 * c->H));
	ape_stats_init(&st);
	cell->bwd_err = vbwd(dev, c, d, c->dtype, d->gq, d->gk, d->gv, d->gp, &st);
	if (cell->bwd_err) {
		const char *msg = ape_last_error();

		cell->bwd_not_claimed = check_not_claimed(dev, cell->bwd_err, msg,
							   APE_BE_CAP_BACKWARD);
		/* not claimed but for the capability the device states: a failure, said so */
		snprintf(cell->bwd_msg, sizeof(cell->bwd_msg), "%s%s",
			 !cell->bwd_not_claimed && check_not_claimed(dev, cell->bwd_err, msg, 0)
				 ? "the device states backward, yet: "
				 : "",
			 msg);
		return;
	}
	cell->bwd_launches = st.chunks;
	compare_bwd(c, d, cell);
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
	bool ok = !c->err && c->max_err_o <= c->tol_o && c->max_err_lse <= c->tol_lse;

	if (!c->bwd_not_claimed) {
		ok &= c->bwd_ran && !c->bwd_err;
		for (int g = 0; g < REFCHECK_NGRADS; g++)
			ok &= c->max_err_grad[g] <= c->tol_grad; /* NaN: not within */
	}
	return ok;
}

/* The cell's record: O, LSE and the four gradients against their tolerances; a backward not
 * claimed is said in the message, O and LSE alone measured. */
static void record(const struct vcell *cell, int dv)
{
	static const char *const labels[] = { "O", "LSE", "dQ", "dK", "dV", "dP" };
	const double *g = cell->max_err_grad, t = cell->tol_grad;
	const double err[6] = { cell->max_err_o, cell->max_err_lse, g[0], g[1], g[2], g[3] };
	const double tol[6] = { cell->tol_o, cell->tol_lse, t, t, t, t };
	char note[sizeof(cell->bwd_msg) + 32];

	if (cell->err) { /* out of host memory in compare() */
		check_add(CHECK_RAGGED, cell->name, dv, CHECK_FAIL, NAN, NAN, "%s",
			  ape_err_name(cell->err));
	} else if (cell->bwd_not_claimed) {
		snprintf(note, sizeof(note), "backward not claimed: %s", cell->bwd_msg);
		check_add_errors_note(CHECK_RAGGED, cell->name, dv, 2, labels, err, tol, note);
	} else if (cell->bwd_err) {
		check_add(CHECK_RAGGED, cell->name, dv, CHECK_FAIL, NAN, NAN,
			  "O %.2g LSE %.2g (max error / tolerance); backward: %s: %s",
			  err[0] / tol[0], err[1] / tol[1], ape_err_name(cell->bwd_err),
			  cell->bwd_msg);
	} else {
		snprintf(note, sizeof(note), "%" PRIu64 " forward, %" PRIu64 " backward launches",
			 cell->launches, cell->bwd_launches);
		check_add_errors_note(CHECK_RAGGED, cell->name, dv, 6, labels, err, tol, note);
	}
}

/* A backward that failed, or is not claimed, said on stderr (not claimed: once per device). */
static void say_bwd(ape_device *dev, const struct vcell *cell, bool *said)
{
	ape_device_info info;

	if (!cell->bwd_err || (cell->bwd_not_claimed && *said))
		return;
	ape_device_get_info(dev, &info);
	if (cell->bwd_not_claimed)
		fprintf(stderr, "ape-check: ragged backward on %s:%d not claimed: %s\n",
			info.backend, info.backend_index, cell->bwd_msg);
	else
		fprintf(stderr, "ape-check: %s: backward on %s:%d: %s\n", cell->name, info.backend,
			info.backend_index, cell->bwd_msg);
	*said |= cell->bwd_not_claimed;
}

int check_varlen(ape_device **devs, int ndev, ape_device *ref, ape_rng *rng, bool quick,
		 struct vcell (*cells)[CHECK_MAX_DEVICES], int *ncases)
{
	bool said[CHECK_MAX_DEVICES] = { false };
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
		if (!ret) /* the gradients every device's are measured against */
			ret = vbwd(ref, c, &d, APE_F32, d.rq, d.rk, d.rv, d.rp, NULL);
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
			if (!cell->err)
				run_bwd(devs[dv], c, &d, cell);
			say_bwd(devs[dv], cell, &said[dv]);
			cell->ok = vcell_ok(cell);
			record(cell, dv);
		}
		vdata_free(&d);
		n++;
	}
	*ncases = n;
	return 0;
}
