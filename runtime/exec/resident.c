/* SPDX-License-Identifier: MIT */
/* Forward launches on device views (exec/resident.h). */
#include "exec/resident.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/context.h"
#include "core/error.h"
#include "exec/launch.h"
#include "exec/multidev.h"
#include "exec/plan.h"
#include "exec/skip_budget.h"

/* The launch template of the call: every key, views as given, no rows yet. */
static void template_of(const struct ape__resident_req *r, struct ape_be_launch *l)
{
	const struct ape__problem *p = r->p;
	struct ape__skip_budget tol;

	/* one launch sees every key of its rows: the whole skip_tol is the kernel's */
	ape__skip_budget(p->skip_tol, p->causal, 1, false, &tol);
	ape__launch_init(l, p, p->out_dtype, tol.kernel);
	l->Lk = p->Lk;
	l->k_start = p->k_start;
	l->pos_q = p->pos_q; /* explicit positions: the launch's rows' slice (below), every key */
	l->pos_k = p->pos_k;
	l->q = r->buf[APE_BE_T_Q];
	l->k = r->buf[APE_BE_T_K];
	l->v = r->buf[APE_BE_T_V];
	l->o = r->buf[APE_BE_T_O];
	l->lse = r->buf[APE_BE_T_LSE];
	l->strided = true;
	for (int t = 0; t < APE_BE_T_COUNT; t++)
		l->view[t] = r->view[t];
	l->ent = r->diag[0];
	l->md = r->diag[1];
	l->diag_view[0] = r->diag_view[0];
	l->diag_view[1] = r->diag_view[1];
}

/* The backend's scratch for launches of `rows` query rows. */
static uint64_t scratch_bytes(const struct ape__resident_req *r, int64_t rows)
{
	struct ape_be_launch l;

	template_of(r, &l);
	l.Lq = rows;
	l.nseg = r->p->segs ? -1 : 0; /* ragged launches, segments unknown (core/backend.h) */
	return ape__scratch_of(r->dev, &l);
}

static void plan_bytes(void *arg, int64_t co, int64_t ci, int64_t no, int64_t ni,
		       struct ape__plan_bytes *b)
{
	(void)arg;
	(void)co;
	(void)ci;
	(void)no;
	(void)ni;
	memset(b, 0, sizeof(*b)); /* the caller's buffers hold every tensor */
}

static uint64_t plan_scratch(void *arg, int64_t co, int64_t ci)
{
	(void)ci;
	return scratch_bytes(arg, co);
}

int ape__resident_plan(const struct ape__resident_req *r, int64_t *rows_per_launch)
{
	const int unsupported = ape__launch_supported(r->fn, r->dev, r->p);
	const struct ape__plan_req q = {
		.Lo = r->p->Lq, .Li = r->p->Lk, .max_co = r->p->Lq, .max_ci = r->p->Lk,
		.inner_whole = true, .depth = 1,
		.budget = r->budget ? r->budget : ape__default_budget(r->dev),
		.max_buffer = UINT64_MAX, .bytes = plan_bytes, .scratch = plan_scratch,
		.arg = (void *)r, .what = r->dev->info.name, .chunk = "one launch",
	};
	struct ape__plan plan = { 0 };
	int ret = unsupported ? unsupported : ape__plan_make(&q, r->fn, &plan);

	*rows_per_launch = plan.co;
	return ret;
}

int ape__resident_enqueue(const struct ape__resident_req *r, int64_t rows)
{
	const struct ape__problem *p = r->p;
	struct ape_be_seg *clip = NULL;
	struct ape_be_launch l;
	int ret = 0;

	template_of(r, &l);
	l.pairs = rows == p->Lq ? r->pairs : NULL;
	/* a ragged call: each launch takes the segments of its rows (every key stays in view) */
	if (p->segs && !(clip = ape__malloc((size_t)p->nseg * sizeof(*clip))))
		return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " segments",
				  r->fn, p->nseg);
	for (int64_t i0 = 0; i0 < p->Lq && !ret; i0 += rows) {
		const int64_t n = p->Lq - i0 < rows ? p->Lq - i0 : rows;

		/* rows [i0, i0 + n) of Q, O and LSE: the same views, moved along L */
		l.Lq = n;
		l.q_start = p->q_start + i0;
		if (p->pos_q)
			l.pos_q = p->pos_q + i0;
		l.view[APE_BE_T_Q].off = r->view[APE_BE_T_Q].off + i0 * r->view[APE_BE_T_Q].sl;
		l.view[APE_BE_T_O].off = r->view[APE_BE_T_O].off + i0 * r->view[APE_BE_T_O].sl;
		l.view[APE_BE_T_LSE].off = r->view[APE_BE_T_LSE].off + i0 * r->view[APE_BE_T_LSE].sl;
		for (int d = 0; d < 2; d++)
			l.diag_view[d].off = r->diag_view[d].off + i0 * r->diag_view[d].sl;
		if (clip) {
			l.segs = clip;
			l.nseg = ape__segs_clip(p->segs, p->nseg, i0, n, 0, p->Lk, clip);
		}
		l.path = r->paths;
		ret = r->dev->be->ops->attention(r->q, &l);
	}
	free(clip);
	return ret;
}
