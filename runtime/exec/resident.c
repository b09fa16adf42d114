/* SPDX-License-Identifier: MIT */
/* Forward launches on device views (exec/resident.h). */
#include "exec/resident.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/context.h"
#include "core/error.h"
#include "exec/launch.h"
#include "exec/multidev.h"
#include "exec/skip_budget.h"

/* The launch template of the call: every key, views as given, no rows yet. */
static void template_of(const struct ape__resident_req *r, struct ape__launch *l)
{
	const struct ape__problem *p = r->p;
	struct ape__skip_budget tol;

	/* one launch sees every key of its rows: the whole skip_tol is the kernel's */
	ape__skip_budget(p->skip_tol, p->causal, 1, false, &tol);
	ape__launch_init(l, p, p->out_dtype, tol.kernel);
	l->Lk = p->Lk;
	l->k_start = p->k_start;
	l->q = r->buf[APE__T_Q];
	l->k = r->buf[APE__T_K];
	l->v = r->buf[APE__T_V];
	l->o = r->buf[APE__T_O];
	l->lse = r->buf[APE__T_LSE];
	l->strided = true;
	for (int t = 0; t < APE__T_COUNT; t++)
		l->view[t] = r->view[t];
	l->ent = r->diag[0];
	l->md = r->diag[1];
	l->diag_view[0] = r->diag_view[0];
	l->diag_view[1] = r->diag_view[1];
}

/* The backend's scratch for launches of `rows` query rows. */
static uint64_t scratch_bytes(const struct ape__resident_req *r, int64_t rows)
{
	struct ape__launch l;

	template_of(r, &l);
	l.Lq = rows;
	return ape__scratch_of(r->dev, &l);
}

int ape__resident_plan(const struct ape__resident_req *r, int64_t *rows_per_launch)
{
	const uint64_t budget = r->budget ? r->budget : ape__default_budget(r->dev);
	int64_t rows = r->p->Lq;

	for (;;) {
		if (scratch_bytes(r, rows) <= budget)
			break;
		if (rows == 1)
			return ape__error(APE_ENOMEM,
					  "%s: %s: one query row against %" PRId64
					  " keys needs %" PRIu64 " bytes of scratch memory, over the "
					  "budget of %" PRIu64,
					  r->fn, r->dev->info.name, r->p->Lk,
					  scratch_bytes(r, 1), budget);
		rows = (rows + 1) / 2;
	}
	*rows_per_launch = rows;
	return 0;
}

int ape__resident_enqueue(const struct ape__resident_req *r, int64_t rows)
{
	const struct ape__problem *p = r->p;
	struct ape__launch l;

	template_of(r, &l);
	l.pairs = rows == p->Lq ? r->pairs : NULL;
	for (int64_t i0 = 0; i0 < p->Lq; i0 += rows) {
		const int64_t n = p->Lq - i0 < rows ? p->Lq - i0 : rows;
		int ret;

		/* rows [i0, i0 + n) of Q, O and LSE: the same views, moved along L */
		l.Lq = n;
		l.q_start = p->q_start + i0;
		l.view[APE__T_Q].off = r->view[APE__T_Q].off + i0 * r->view[APE__T_Q].sl;
		l.view[APE__T_O].off = r->view[APE__T_O].off + i0 * r->view[APE__T_O].sl;
		l.view[APE__T_LSE].off = r->view[APE__T_LSE].off + i0 * r->view[APE__T_LSE].sl;
		for (int d = 0; d < 2; d++)
			l.diag_view[d].off = r->diag_view[d].off + i0 * r->diag_view[d].sl;
		ret = r->dev->be->ops->attention(r->q, &l);
		if (ret)
			return ret;
	}
	return 0;
}

/* ------------------------------------------------------------------ host memory in place */

/* Bytes of t from its data pointer to its last element (strides s, all >= 0). */
static size_t span_of(const ape_tensor *t, const int64_t s[4])
{
	uint64_t last = 0;

	for (int d = 0; d < 4; d++)
		last += (uint64_t)(t->shape[d] - 1) * (uint64_t)s[d];
	return (size_t)(last + 1) * ape_dtype_size(t->dtype);
}

/* APE_CONTEXT_POISON_OUTPUTS where the device's memory is the caller's: NaN in every element of
 * O and LSE the kernel must write, so that one it misses shows. */
static void poison_host(const struct ape__problem *p, ape_tensor *o, float *lse)
{
	const size_t esz = ape_dtype_size(p->out_dtype);
	const uint16_t half = p->out_dtype == APE_F16 ? 0x7e00 : 0x7fc0;
	const float nan = NAN;

	for (int64_t b = 0; b < p->B; b++)
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = 0; i < p->Lq; i++) {
				unsigned char *row = (unsigned char *)o->data +
						     (size_t)(b * p->os[0] + h * p->os[1] +
							      i * p->os[2]) * esz;

				for (int64_t d = 0; d < p->D; d++)
					memcpy(row + (size_t)d * esz,
					       esz == 4 ? (const void *)&nan : (const void *)&half,
					       esz);
			}
	for (int64_t i = 0; lse && i < p->B * p->H * p->Lq; i++)
		lse[i] = nan;
}

int ape__resident_host_run(const char *fn, struct ape_device *dev, const struct ape__problem *p,
			   uint64_t budget, const ape_tensor *q, const ape_tensor *k,
			   const ape_tensor *v, ape_tensor *o, float *lse, bool want_pairs,
			   struct ape__exec_result *res)
{
	const struct ape__backend_ops *ops = dev->be->ops;
	const ape_tensor *t[4] = { q, k, v, o };
	const int64_t *s[4] = { p->qs, p->ks, p->vs, p->os };
	const size_t rows = (size_t)(p->B * p->H * p->Lq);
	struct ape__resident_req r = { .fn = fn, .dev = dev, .p = p, .budget = budget };
	struct ape__event *e0 = NULL, *e1 = NULL;
	uint64_t *pairs = NULL;
	int64_t per_launch;
	bool touched = false;
	size_t got;
	int ret = 0;

	if (!ops->buf_wrap)
		return 1;
	for (int i = 0; i < 4; i++)
		if (s[i][3] != 1)
			return 1;
	for (int i = 0; i < 4; i++)
		r.view[i] = (struct ape__view){ 0, s[i][0], s[i][1], s[i][2] };
	r.view[APE__T_LSE] = (struct ape__view){ 0, p->H * p->Lq, p->Lq, 1 };
	ret = ape__resident_plan(&r, &per_launch);
	if (ret || per_launch < p->Lq) {
		ape__error(0, "%s", ""); /* the streaming executor plans again, and says */
		return 1;
	}
	for (int i = 0; i < 4 && !ret; i++) {
		ret = ops->buf_wrap(dev, APE__MEM_HOST, t[i]->data, span_of(t[i], s[i]), &r.buf[i],
				    &got);
		if (ret == APE_ENOTSUP && i == 0) {
			ape__error(0, "%s", "");
			return 1; /* this device copies: the streaming executor does that */
		}
	}
	if (!ret && lse)
		ret = ops->buf_wrap(dev, APE__MEM_HOST, lse, rows * sizeof(float),
				    &r.buf[APE__T_LSE], &got);
	if (!ret && want_pairs) {
		pairs = calloc(rows, sizeof(*pairs));
		ret = pairs ? ops->buf_wrap(dev, APE__MEM_HOST, pairs, rows * sizeof(*pairs),
					    &r.pairs, &got)
			    : ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	}
	if (!ret)
		ret = ops->queue_create(dev, &r.q);
	if (!ret)
		ret = ops->event_record(r.q, &e0);
	if (!ret) { /* from here on the caller's O and LSE are the device's */
		touched = true;
		if (dev->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS)
			poison_host(p, o, lse);
		ret = ape__resident_enqueue(&r, p->Lq);
	}
	if (!ret)
		ret = ops->event_record(r.q, &e1);
	if (r.q) {
		int sret = ops->synchronize(r.q);

		ret = ret ? ret : sret;
	}
	if (!ret) {
		memset(res, 0, sizeof(*res));
		ret = ops->event_elapsed(e0, e1, &res->st.kernel_ms);
		if (ret == APE_ENOTSUP)
			ret = 0;
		res->st.chunks = 1;
		res->st.work = (uint64_t)p->Lq * (uint64_t)p->Lk;
		res->st.qchunks_done = 1;
		res->st.peak_bytes = scratch_bytes(&r, p->Lq);
		res->cq = p->Lq;
		res->ck = p->Lk;
		res->nq = 1;
		res->depth = 1;
		res->budget = budget ? budget : ape__default_budget(dev);
		for (size_t i = 0; pairs && i < rows; i++)
			res->st.pairs_computed += pairs[i];
	}
	ops->event_destroy(e0);
	ops->event_destroy(e1);
	ops->queue_destroy(r.q);
	for (int i = 0; i < APE__T_COUNT; i++)
		ops->buf_free(dev, r.buf[i]);
	ops->buf_free(dev, r.pairs);
	free(pairs);
	if (ret && touched)
		ape__error_suffix(ret, "; O and LSE were computed in place and are unspecified "
				       "(APE_EXEC_ATOMIC_OUTPUTS stages them)");
	return ret ? ape__error_on(ret, dev) : 0;
}
