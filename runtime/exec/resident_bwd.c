/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on device views (exec/resident_bwd.h). The backend's attention_backward
 * takes contiguous buffers at offset 0 and adds into float32 (dQ, dK, dV) and float64
 * (dparams) accumulators (core/backend.h); the caller's tensors are strided views of any
 * storage type. So, on the caller's queue, in this order:
 *   1. queue-ordered scratch (scratch_alloc) for every tensor that is not already what the
 *      launch takes: an input dense at offset 0 (and, on the query side, a call of one launch)
 *      is used where it is, a float32 output likewise, and on a device that takes strided
 *      backward launches (APE_BE_CAP_BWD_VIEWS) Q, K, V, O and dO are read through their views
 *      whatever their strides; the others get a contiguous copy (inputs, by copy_view) or an
 *      accumulator (outputs);
 *   2. the key side's accumulators zeroed (dK, dV, dparams), K and V gathered;
 *   3. per launch of `rows` query rows, in row order: Q, O, dO, LSE, dLSE of those rows
 *      gathered, dQ's accumulator zeroed, the launch against every key, dQ's rows copied out
 *      (converted to dq's type);
 *   4. dK, dV and dparams copied out (float32 to dk's and dv's types, float64 to float32);
 *   5. the scratch released in queue order (scratch_free), never waited for.
 * Every sum has a fixed order (one launch per query chunk, in order; the backend's own fixed
 * order inside), so two calls give the same bits; with one launch the figures are those of
 * ape_attention_backward() (whose dQ, summed in float64 over one key chunk, rounds to the same
 * float32).
 *
 * A ragged problem (p->segs: ape_attention_backward_enqueue_varlen()) runs the same way over
 * the packed tensors: each launch is given the segments of its rows, clipped to them
 * (ape__segs_clip(), every key), their key ranges disjoint (the caller checked); a launch
 * whose rows see no key is not made (their dQ rows stay the zeroed accumulator's).
 */
#include "exec/resident_bwd.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/context.h"
#include "core/error.h"
#include "exec/backward.h"
#include "exec/launch.h"
#include "exec/multidev.h"
#include "exec/plan.h"

static bool query_side(int t)
{
	return t == APE__RB_Q || t == APE__RB_O || t == APE__RB_LSE || t == APE__RB_DOUT ||
	       t == APE__RB_DLSE || t == APE__RB_DQ;
}

static bool is_output(int t)
{
	return t >= APE__RB_DQ;
}

/* Tensor t's shape with `rows` query rows. */
static void shape_of(const struct ape__problem *p, int t, int64_t rows, int64_t sh[4])
{
	const bool one = t == APE__RB_LSE || t == APE__RB_DLSE;

	if (t == APE__RB_DPARAMS) {
		sh[0] = sh[1] = 1;
		sh[2] = p->H;
		sh[3] = 4;
	} else if (query_side(t)) {
		sh[0] = p->B;
		sh[1] = p->H;
		sh[2] = rows;
		sh[3] = one ? 1 : p->D;
	} else {
		sh[0] = p->B;
		sh[1] = p->Hkv;
		sh[2] = p->Lk;
		sh[3] = p->D;
	}
}

/* The element type the launch takes for t (enum ape_be_elem). */
static int launch_type(const struct ape__resident_bwd_req *r, int t)
{
	if (t == APE__RB_DPARAMS)
		return APE_BE_E_F64;
	return is_output(t) ? APE_BE_E_F32 : (int)r->dtype[t];
}

static size_t elem_size(int e)
{
	return e == APE_BE_E_F64 ? 8 : e == APE_BE_E_F32 ? 4 : 2;
}

static struct ape_be_view dense_view(const int64_t sh[4])
{
	return (struct ape_be_view){ 0, sh[1] * sh[2] * sh[3], sh[2] * sh[3], sh[3] };
}

/* Whether the launches read input t through its view (struct ape_be_bwd_launch, ABI 1.3). */
static bool viewed(const struct ape__resident_bwd_req *r, int t)
{
	return (t == APE__RB_Q || t == APE__RB_K || t == APE__RB_V || t == APE__RB_O ||
		t == APE__RB_DOUT) &&
	       ape_be_dev_has(r->dev, APE_BE_CAP_BWD_VIEWS);
}

/* Whether the caller's tensor t is already what a launch of `rows` query rows takes. */
static bool direct(const struct ape__resident_bwd_req *r, int t, int64_t rows)
{
	const struct ape_be_view *v = &r->view[t];
	int64_t sh[4];
	struct ape_be_view c;

	if (viewed(r, t))
		return true;
	if (query_side(t) && rows != r->p->Lq)
		return false;
	if (launch_type(r, t) != (int)r->dtype[t] || t == APE__RB_DPARAMS)
		return false;
	shape_of(r->p, t, rows, sh);
	c = dense_view(sh);
	return v->off == 0 && (sh[0] <= 1 || v->sb == c.sb) && (sh[1] <= 1 || v->sh == c.sh) &&
	       (sh[2] <= 1 || v->sl == c.sl);
}

/* Bytes of scratch tensor t takes with launches of `rows` query rows (0: none). */
static uint64_t scratch_of(const struct ape__resident_bwd_req *r, int t, int64_t rows)
{
	int64_t sh[4];

	if (!r->buf[t] || direct(r, t, rows))
		return 0;
	shape_of(r->p, t, rows, sh);
	return (uint64_t)(sh[0] * sh[1] * sh[2] * sh[3]) * elem_size(launch_type(r, t));
}

/* The launch of query rows [i0, i0 + rows), every key, without buffers. */
static void launch_of(const struct ape__resident_bwd_req *r, struct ape_be_bwd_launch *l,
		      int64_t i0, int64_t rows)
{
	ape__bwd_launch_shape(r->p, r->dtype[APE__RB_DOUT], 1, l, i0, rows, 0, r->p->Lk);
}

static unsigned parts_of(const struct ape__resident_bwd_req *r)
{
	return (r->buf[APE__RB_DQ] ? APE_BE_BWD_DQ : 0u) | (r->buf[APE__RB_DK] ? APE_BE_BWD_DK : 0u) |
	       (r->buf[APE__RB_DV] ? APE_BE_BWD_DV : 0u) |
	       (r->buf[APE__RB_DPARAMS] ? APE_BE_BWD_DPARAMS : 0u) |
	       (r->buf[APE__RB_DLSE] ? APE_BE_BWD_DLSE : 0u);
}

/* What a call with launches of co query rows holds: the query side's copies per row, the key
 * side's for every key (the planner's bytes callback, exec/plan.h). */
static void plan_bytes(void *arg, int64_t co, int64_t ci, int64_t no, int64_t ni,
		       struct ape__plan_bytes *b)
{
	const struct ape__resident_bwd_req *r = arg;

	(void)ci;
	(void)no;
	(void)ni;
	memset(b, 0, sizeof(*b));
	for (int t = 0; t < APE__RB_COUNT; t++) {
		const uint64_t n = scratch_of(r, t, co);

		if (query_side(t))
			b->outer += n;
		else
			b->call += n;
		b->largest = n > b->largest ? n : b->largest;
	}
}

/* The backend's own scratch for a launch of co query rows against every key. */
static uint64_t plan_scratch(void *arg, int64_t co, int64_t ci)
{
	const struct ape__resident_bwd_req *r = arg;
	const struct ape_backend_plugin *ops = r->dev->be->ops;
	struct ape_be_bwd_launch l;

	(void)ci;
	if (!ops->attention_backward_scratch)
		return 0;
	launch_of(r, &l, 0, co);
	/* a ragged call: each launch's segments not known yet, at most the call's */
	l.f.nseg = r->p->segs ? r->p->nseg : 0;
	return ops->attention_backward_scratch(r->dev, &l, parts_of(r));
}

int ape__resident_bwd_plan(const struct ape__resident_bwd_req *r, int64_t *rows_per_launch)
{
	const int unsupported = ape__launch_supported(r->fn, r->dev, r->p);
	const int64_t Lq = r->p->Lq > 0 ? r->p->Lq : 1, Lk = r->p->Lk > 0 ? r->p->Lk : 1;
	const struct ape__plan_req q = {
		.Lo = Lq, .Li = Lk, .max_co = Lq, .max_ci = Lk, .inner_whole = true, .depth = 1,
		.budget = r->budget ? r->budget : ape__default_budget(r->dev),
		.max_buffer = UINT64_MAX, .bytes = plan_bytes, .scratch = plan_scratch,
		.arg = (void *)r, .what = r->dev->info.name,
		.chunk = "the backward pass's launch (its copies and accumulators included)",
	};
	struct ape__plan plan = { 0 };
	int ret = unsupported ? unsupported : ape__plan_make(&q, r->fn, &plan);

	*rows_per_launch = plan.co;
	return ret;
}

/* One call's state: the buffer each tensor has in the launches, and the scratch behind it. */
struct rb_run {
	const struct ape__resident_bwd_req *r;
	const struct ape_backend_plugin *ops;
	struct ape_be_buf *scratch[APE__RB_COUNT];
	struct ape_be_buf *use[APE__RB_COUNT];
	int64_t rows;
	struct ape_be_seg *segs; /* a ragged call: one launch's segments (room for p->nseg) */
};

/* Copies rows [i0, i0 + n) of tensor t between the caller's view and the launch's buffer
 * (inputs in, outputs out); nothing for a tensor used where it is. */
static int move_rows(struct rb_run *x, int t, int64_t i0, int64_t n)
{
	const struct ape__resident_bwd_req *r = x->r;
	const int lt = launch_type(r, t);
	struct ape_be_view user = r->view[t];
	struct ape_be_copy c;
	int64_t sh[4];

	if (!x->scratch[t])
		return 0;
	shape_of(r->p, t, n, sh);
	if (query_side(t))
		user.off += i0 * user.sl;
	memset(&c, 0, sizeof(c));
	c.B = sh[0];
	c.H = sh[1];
	c.L = sh[2];
	c.D = sh[3];
	c.head_D = r->p->D;
	if (is_output(t)) {
		c.dst = r->buf[t];
		c.dst_type = (int)r->dtype[t];
		c.dv = user;
		c.src = x->scratch[t];
		c.src_type = lt;
		c.sv = dense_view(sh);
	} else {
		c.dst = x->scratch[t];
		c.dst_type = lt;
		c.dv = dense_view(sh);
		c.src = r->buf[t];
		c.src_type = lt;
		c.sv = user;
	}
	return x->ops->copy_view(r->q, &c);
}

/* Zeroes accumulator t for launches of n query rows. */
static int zero_acc(struct rb_run *x, int t, int64_t n)
{
	int64_t sh[4];

	if (!x->use[t])
		return 0;
	shape_of(x->r->p, t, n, sh);
	return x->ops->fill(x->r->q, x->use[t], 0, 0,
			    (size_t)(sh[0] * sh[1] * sh[2] * sh[3]) *
				    elem_size(launch_type(x->r, t)));
}

static int launch(struct rb_run *x, int64_t i0, int64_t n)
{
	struct ape_be_bwd_launch l;
	int ret;

	for (int t = APE__RB_Q; t <= APE__RB_DLSE; t++)
		if (query_side(t) && (ret = move_rows(x, t, i0, n)))
			return ret;
	if ((ret = zero_acc(x, APE__RB_DQ, n)))
		return ret;
	launch_of(x->r, &l, i0, n);
	if (x->r->p->segs) { /* a ragged call: the segments of these rows, every key */
		int64_t seen = 0;

		l.f.segs = x->segs;
		l.f.nseg = ape__segs_clip(x->r->p->segs, x->r->p->nseg, i0, n, 0, x->r->p->Lk,
					  x->segs);
		for (int64_t s = 0; s < l.f.nseg; s++)
			seen |= l.f.segs[s].lk;
		if (!seen) /* no row of the launch sees a key: dQ's rows are the zeros */
			return move_rows(x, APE__RB_DQ, i0, n);
	}
	l.f.q = x->use[APE__RB_Q];
	l.f.k = x->use[APE__RB_K];
	l.f.v = x->use[APE__RB_V];
	l.f.o = x->use[APE__RB_O];
	l.f.lse = x->use[APE__RB_LSE];
	l.dout = x->use[APE__RB_DOUT];
	l.dlse = x->use[APE__RB_DLSE];
	l.dq = x->use[APE__RB_DQ];
	l.dk = x->use[APE__RB_DK];
	l.dv = x->use[APE__RB_DV];
	l.dparams = x->use[APE__RB_DPARAMS];
	if (viewed(x->r, APE__RB_Q)) { /* every one of the five where it lies, rows from i0 */
		const struct ape_be_view *v = x->r->view;

		l.f.strided = true;
		l.f.view[APE_BE_T_Q] = v[APE__RB_Q];
		l.f.view[APE_BE_T_Q].off += i0 * v[APE__RB_Q].sl;
		l.f.view[APE_BE_T_K] = v[APE__RB_K];
		l.f.view[APE_BE_T_V] = v[APE__RB_V];
		l.f.view[APE_BE_T_O] = v[APE__RB_O];
		l.f.view[APE_BE_T_O].off += i0 * v[APE__RB_O].sl;
		l.dout_view = v[APE__RB_DOUT];
		l.dout_view.off += i0 * v[APE__RB_DOUT].sl;
	}
	l.f.path = x->r->paths;
	if ((ret = x->ops->attention_backward(x->r->q, &l)))
		return ret;
	return move_rows(x, APE__RB_DQ, i0, n);
}

static int run(struct rb_run *x)
{
	const struct ape__resident_bwd_req *r = x->r;
	const struct ape__problem *p = r->p;
	int ret;

	for (int t = 0; t < APE__RB_COUNT; t++) {
		const uint64_t bytes = scratch_of(r, t, x->rows);

		if (bytes && (ret = x->ops->scratch_alloc(r->q, (size_t)bytes, &x->scratch[t])))
			return ret;
		x->use[t] = bytes ? x->scratch[t] : r->buf[t];
	}
	if ((ret = zero_acc(x, APE__RB_DK, 0)) || (ret = zero_acc(x, APE__RB_DV, 0)) ||
	    (ret = zero_acc(x, APE__RB_DPARAMS, 0)) || (ret = move_rows(x, APE__RB_K, 0, 0)) ||
	    (ret = move_rows(x, APE__RB_V, 0, 0)))
		return ret;
	for (int64_t i0 = 0; i0 < p->Lq; i0 += x->rows)
		if ((ret = launch(x, i0, p->Lq - i0 < x->rows ? p->Lq - i0 : x->rows)))
			return ret;
	if ((ret = move_rows(x, APE__RB_DK, 0, 0)) || (ret = move_rows(x, APE__RB_DV, 0, 0)) ||
	    (ret = move_rows(x, APE__RB_DPARAMS, 0, 0)))
		return ret;
	return 0;
}

/* No query row or no key: every gradient is 0, copied from zeros (a view of strides 0). */
static int write_zeros(struct rb_run *x)
{
	const struct ape__resident_bwd_req *r = x->r;
	struct ape_be_buf *zero = NULL;
	int ret = x->ops->scratch_alloc(r->q, 256 * sizeof(float), &zero);

	if (!ret)
		ret = x->ops->fill(r->q, zero, 0, 0, 256 * sizeof(float));
	for (int t = APE__RB_DQ; t < APE__RB_COUNT && !ret; t++) {
		struct ape_be_copy c = { .dst = r->buf[t], .dst_type = (int)r->dtype[t],
				       .dv = r->view[t], .src = zero, .src_type = APE_BE_E_F32,
				       .head_D = r->p->D };
		int64_t sh[4];

		if (!r->buf[t])
			continue;
		shape_of(r->p, t, r->p->Lq, sh);
		c.B = sh[0];
		c.H = sh[1];
		c.L = sh[2];
		c.D = sh[3];
		if (c.B * c.H * c.L * c.D != 0)
			ret = x->ops->copy_view(r->q, &c);
	}
	if (zero) {
		const int fret = x->ops->scratch_free(r->q, zero);

		ret = ret ? ret : fret;
	}
	return ret;
}

int ape__resident_bwd_enqueue(const struct ape__resident_bwd_req *r, int64_t rows)
{
	struct rb_run x = { .r = r, .ops = r->dev->be->ops, .rows = rows };
	int ret;

	if (r->p->B * r->p->H * r->p->Lq == 0 || r->p->Lk == 0)
		return write_zeros(&x);
	if (r->p->segs && !(x.segs = ape__malloc((size_t)r->p->nseg * sizeof(*x.segs))))
		return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " segments",
				  r->fn, r->p->nseg);
	ret = run(&x);
	free(x.segs);
	for (int t = 0; t < APE__RB_COUNT; t++) {
		const int fret = x.scratch[t] ? x.ops->scratch_free(r->q, x.scratch[t]) : 0;

		ret = ret ? ret : fret;
	}
	return ret;
}
