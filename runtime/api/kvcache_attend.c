/* SPDX-License-Identifier: MIT */
/*
 * KV-cache attends (api/kvcache.h): the desc and queries checked against the cache and against
 * what an earlier release assumed, then the streaming executor run on the session made at
 * creation, with one query chunk and key chunks gathered from the blocks on the device
 * (copy_d2d, or through host staging when the backend lacks it) after the appends still in
 * flight; the statistics as a forward call reports them.
 */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#define APE_REAL double
#include "core/alloc.h"
#include "ape/ape_math.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "exec/launch.h"
#include "exec/lse_merge.h"
#include "exec/pack.h"
#include "exec/skip_budget.h"
#include "api/forward.h"
#include "api/kvcache.h"
#include "api/stats.h"
#include "api/validate.h"

/* One gather: into dk, dv on queue q, through `bounce` (K then V, `half` bytes each) when the
 * backend has no copy_d2d. */
struct gather {
	struct ape_kv_cache *c;
	struct ape_be_queue *q;
	struct ape_be_buf *dk, *dv;
	char *bounce;
	size_t half;
	uint64_t *d2h, *d2d;
};

static int gather_seg(void *arg, const struct ape__kv_seg *sg)
{
	const struct gather *g = arg;
	const struct ape_backend_plugin *ops = g->c->ops;
	size_t bo;
	struct ape_be_buf *sk = ape__kv_block(g->c, 0, sg->blk, &bo);
	struct ape_be_buf *sv = ape__kv_block(g->c, 1, sg->blk, &bo);
	const size_t at = bo + sg->blk_off;
	int ret;

	if (ops->copy_d2d) {
		ret = ops->copy_d2d(g->q, g->dk, sg->off, sk, at, sg->bytes);
		if (!ret)
			ret = ops->copy_d2d(g->q, g->dv, sg->off, sv, at, sg->bytes);
		*g->d2d += 2 * sg->bytes;
	} else { /* through host staging; the queue keeps it in order */
		ret = ops->copy_d2h(g->q, g->bounce + sg->off, sk, at, sg->bytes);
		if (!ret)
			ret = ops->copy_d2h(g->q, g->bounce + g->half + sg->off, sv, at, sg->bytes);
		*g->d2h += 2 * sg->bytes;
	}
	return ret;
}

/* Gathers live tokens [j0, j0 + n) (counted from the oldest live one) into dk, dv. */
int ape__kv_load(void *arg, struct ape_be_queue *q, int lane, int64_t j0, int64_t n,
		 struct ape_be_buf *dk, struct ape_be_buf *dv, uint64_t *h2d, uint64_t *d2h,
		 uint64_t *d2d)
{
	struct ape_kv_cache *c = arg;
	const struct ape_backend_plugin *ops = c->ops;
	struct gather g = {
		.c = c, .q = q, .dk = dk, .dv = dv, .bounce = c->bounce[lane].ptr,
		.half = (size_t)(c->o.B * c->o.Hkv * n * c->o.D) * c->esz, .d2h = d2h, .d2d = d2d,
	};
	int ret = ape__kv_wait(c, q);

	if (!ret)
		ret = ape__kv_each_seg(c, c->lb_first * c->bt + c->win + j0, n, gather_seg, &g);
	if (!ret && !ops->copy_d2d) {
		ret = ops->copy_h2d(q, dk, 0, g.bounce, g.half);
		if (!ret)
			ret = ops->copy_h2d(q, dv, 0, g.bounce + g.half, g.half);
		*h2d += 2 * g.half;
	}
	return ret;
}

/* The attend session's loader, in place: live tokens [j0, j0 + n) where the blocks hold them,
 * when they all lie in one slab. */
bool ape_be_kv_pages(void *arg, int64_t j0, int64_t n, struct ape_be_buf **k, struct ape_be_buf **v,
		   struct ape_be_kv_pages *pg)
{
	const struct ape_kv_cache *c = arg;
	const int64_t t = c->lb_first * c->bt + c->win + j0;

	(void)n; /* live: appended and not released */
	if (c->nslabs != 1)
		return false;
	*k = c->sk[0];
	*v = c->sv[0];
	memset(pg, 0, sizeof(*pg)); /* blocks in a ring */
	pg->block_tokens = c->bt;
	pg->nblocks = c->nblocks;
	pg->first_block = ape__kv_phys(c, t / c->bt);
	pg->first_row = t % c->bt;
	pg->s_h = c->bt * c->o.D;
	pg->s_b = c->o.Hkv * pg->s_h;
	pg->s_block = c->o.B * pg->s_b;
	pg->s_row = c->o.D;
	return true;
}

/* Orders q after the appends still copying on their own queues. */
int ape__kv_wait(void *arg, struct ape_be_queue *q)
{
	struct ape_kv_cache *c = arg;
	int ret = 0;

	for (int i = 0; i < 2 && !ret; i++)
		if (c->alast[i])
			ret = c->ops->event_wait(q, c->alast[i]);
	return ret;
}

/* Largest key norm per (batch, kv head) and key chunk of an attend, from the block maxima
 * (a chunk's blocks may hold a few keys outside it: still a bound). */
static void chunk_norms(void *arg, struct ape__kmax *km, int64_t ck, int64_t nk)
{
	const struct ape_kv_cache *c = arg;
	const int64_t nbg = c->o.B * c->o.Hkv, t0 = c->lb_first * c->bt + c->win;

	for (int64_t bg = 0; bg < nbg; bg++)
		for (int64_t ch = 0; ch < nk; ch++) {
			const int64_t a = t0 + ch * ck, e = a + ck < c->t_end ? a + ck : c->t_end;
			float m = 0;

			for (int64_t lb = a / c->bt; lb <= (e - 1) / c->bt; lb++)
				m = fmaxf(m, c->bnorm[ape__kv_phys(c, lb) * nbg + bg]);
			km->pre[bg * nk + ch] = m;
		}
}

/* Block lb's key-norm maxima, one per (batch, kv head) (struct ape__kv_keys.norms). */
static const float *block_norms(const void *arg, int64_t lb)
{
	const struct ape_kv_cache *c = arg;

	return c->bnorm + ape__kv_phys(c, lb) * c->o.B * c->o.Hkv;
}

/* The problem of an attend: the desc checked as a forward call over zero keys, then the
 * cache's keys put in. */
static int attend_problem(struct ape_kv_cache *c, const char *fn, const ape_attn_desc *desc,
			  const ape_tensor *q, const ape_tensor *o, const float *lse,
			  const struct ape__diag_req *dg, struct ape__problem *p)
{
	static const char *const dims[4] = { "B", "H", "Lq", "D" };
	const int64_t want[4] = { c->o.B, c->o.H, -1, c->o.D };
	ape_tensor none;
	ape_attn_desc d;
	int64_t s[4];
	int ret;

	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	if ((ret = ape__check_tensor(fn, "q", q, c->o.dtype, want, dims, s)))
		return ret;
	if (q->shape[2] > c->o.max_queries)
		return ape__error(APE_EINVAL,
				  "%s: q->shape[2] = %" PRId64 ": more than max_queries = %" PRId64,
				  fn, q->shape[2], c->o.max_queries);
	ape__desc_copy(&d, desc);
	if (ape__desc_size_ok(&d)) {
		d.k_start = ape__kv_first_live_position(c);
		if (!d.q_start_set)
			d.q_start = ape__kv_next_position(c) - q->shape[2];
		d.q_start_set = true;
	}
	ape_tensor_init(&none, NULL, c->o.dtype, c->o.B, c->o.Hkv, 0, c->o.D);
	if ((ret = ape__problem_init(p, fn, &d, q, &none, &none, o, lse)))
		return ret;
	p->Lk = ape__kv_live_tokens(c);
	ret = ape__check_positions(fn, p->q_start, p->Lq, p->k_start, p->Lk);
	if (!ret)
		ret = ape__check_diag_outputs(fn, p, q, NULL, NULL, o, lse, dg->ent, dg->md);
	if (!ret) /* tightens skip_tol first: the release proof is checked against it */
		ret = ape__diag_prepare(fn, &c->dev, 1, p, dg);
	if (!ret)
		ret = ape__kv_check_release_terms(c, fn, p, q, p->qs);
	if (ret)
		ape__problem_fini(p);
	return ret;
}

/* The statistics of an attend: the session's plan, the cache's budget, and the blocks counted
 * in the peak with the session's buffers. */
static void report(const struct ape_kv_cache *c, const char *fn, const struct ape__problem *p,
		   int ret, struct ape__exec_result *res, uint64_t pairs_visible, double t0,
		   ape_stats *stats)
{
	const struct ape__call_report rep = {
		.fn = fn,
		.p = p,
		.ret = ret,
		.pairs_uncounted = !stats && p->Lq > 0 && p->Lk > 0,
		.res = res,
		.devs = &c->dev,
		.ndev = 1,
		.devices = 1,
		.pairs_visible = pairs_visible,
		.t0 = t0,
	};

	res->cq = c->ks.geom.plan.co;
	res->ck = c->ks.geom.plan.ci;
	res->depth = c->ks.geom.plan.depth;
	res->budget = c->o.max_device_bytes ? c->o.max_device_bytes : UINT64_MAX;
	res->st.peak_bytes += c->mem.cur;
	ape__call_done(stats, &rep);
}

static int attend(ape_kv_cache *c, const char *fn, const ape_attn_desc *desc,
		  const ape_tensor *q, ape_tensor *o, float *lse, const struct ape__diag_req *dg,
		  ape_stats *stats)
{
	const double t0 = ape__now_ms();
	struct ape__exec_result res;
	struct ape__problem p;
	uint64_t per_head = 0;
	int ret;

	if (!c)
		return ape__error(APE_EINVAL, "%s: cache = NULL", fn);
	if ((ret = ape__stats_check(fn, stats)))
		return ret;
	if ((ret = attend_problem(c, fn, desc, q, o, lse, dg, &p)))
		return ret;
	memset(&res, 0, sizeof(res));
	ape__head_visible_pairs(&p, &per_head); /* validated: no overflow */
	if (p.Lq == 0)
		ret = 0;
	else if (p.Lk == 0)
		ape__store_empty_rows(o, p.os, lse, dg->ent, dg->md, p.Lq, 0, p.Lq);
	else {
		/* the window: p less its oldest keys, proved negligible with a share of skip_tol */
		struct ape__problem w = p;
		double wtol, rest;

		const struct ape__kv_keys kk = {
			.first = c->lb_first * c->bt, .t_end = c->t_end, .k_start = c->o.k_start,
			.bt = c->bt, .nbg = c->o.B * c->o.Hkv, .norms = block_norms, .arg = c,
		};
		const struct ape__kv_run run = {
			.p = &w, .q = q, .o = o, .lse = lse, .dg = dg, .want_pairs = stats != NULL,
			.release = c->o.allow_release, .loader = &c->loader,
			.chunk_norms = chunk_norms, .norms_arg = c,
		};

		ape__skip_window(p.skip_tol, c->o.allow_release, &wtol, &rest);
		c->win = ape__kv_window_cut(&kk, &p, q, 0, p.Lq, p.q_start, wtol);
		if (c->win) {
			w.k_start += c->win;
			w.Lk -= c->win;
			w.skip_tol = rest;
		}
		ret = ape__kv_session_run(&c->ks, fn, &run, &res);
		c->win = 0;
	}
	if (!ret && c->o.allow_release)
		ape__kv_try_release(c, &p, NULL);
	if (stats || ape__call_logs(&c->dev, 1))
		report(c, fn, &p, ret, &res, per_head * (uint64_t)(p.B * p.H), t0, stats);
	ape__problem_fini(&p);
	return ret;
}

int ape_kv_cache_attend(ape_kv_cache *c, const ape_attn_desc *desc, const ape_tensor *q,
			ape_tensor *o, float *lse, ape_stats *stats)
{
	APE__API_CALL("ape_kv_cache_attend");
	const struct ape__diag_req none = { NULL, NULL };

	return attend(c, "ape_kv_cache_attend", desc, q, o, lse, &none, stats);
}

int ape_kv_cache_attend_diag(ape_kv_cache *c, const ape_attn_desc *desc, const ape_tensor *q,
			     ape_tensor *o, float *lse, float *entropy, float *mean_distance,
			     ape_stats *stats)
{
	APE__API_CALL("ape_kv_cache_attend_diag");
	const struct ape__diag_req dg = { entropy, mean_distance };

	return attend(c, "ape_kv_cache_attend_diag", desc, q, o, lse, &dg, stats);
}
