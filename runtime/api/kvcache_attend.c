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
#include <stdatomic.h>
#include <string.h>

#define APE_REAL double
#include "core/alloc.h"
#include "core/ape_math.h"
#include "core/clock.h"
#include "core/context.h"
#include "core/error.h"
#include "core/strace.h"
#include "core/verbose.h"
#include "exec/launch.h"
#include "exec/lse_merge.h"
#include "exec/pack.h"
#include "exec/skip_budget.h"
#include "exec/trace.h"
#include "api/forward.h"
#include "api/kvcache.h"
#include "api/stats.h"
#include "api/validate.h"

/* One gather: into dk, dv on queue q, through `bounce` (K then V, `half` bytes each) when the
 * backend has no copy_d2d. */
struct gather {
	struct ape_kv_cache *c;
	struct ape__queue *q;
	struct ape__buf *dk, *dv;
	char *bounce;
	size_t half;
	uint64_t *d2h, *d2d;
};

static int gather_seg(void *arg, const struct ape__kv_seg *sg)
{
	const struct gather *g = arg;
	const struct ape__backend_ops *ops = g->c->ops;
	size_t bo;
	struct ape__buf *sk = ape__kv_block(g->c, 0, sg->blk, &bo);
	struct ape__buf *sv = ape__kv_block(g->c, 1, sg->blk, &bo);
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
int ape__kv_load(void *arg, struct ape__queue *q, int lane, int64_t j0, int64_t n,
		 struct ape__buf *dk, struct ape__buf *dv, uint64_t *h2d, uint64_t *d2h,
		 uint64_t *d2d)
{
	struct ape_kv_cache *c = arg;
	const struct ape__backend_ops *ops = c->ops;
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
bool ape__kv_pages(void *arg, int64_t j0, int64_t n, struct ape__buf **k, struct ape__buf **v,
		   struct ape__kv_pages *pg)
{
	const struct ape_kv_cache *c = arg;
	const int64_t t = c->lb_first * c->bt + c->win + j0;

	(void)n; /* live: appended and not released */
	if (c->nslabs != 1)
		return false;
	*k = c->sk[0];
	*v = c->sv[0];
	pg->block_tokens = c->bt;
	pg->nblocks = c->nblocks;
	pg->first_block = ape__kv_phys(c, t / c->bt);
	pg->first_row = t % c->bt;
	return true;
}

/* Orders q after the appends still copying on their own queues. */
int ape__kv_wait(void *arg, struct ape__queue *q)
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
static void chunk_norms(struct ape_kv_cache *c, int64_t ck, int64_t nk)
{
	const int64_t nbg = c->o.B * c->o.Hkv, t0 = c->lb_first * c->bt + c->win;

	c->km.nk = nk;
	for (int64_t bg = 0; bg < nbg; bg++)
		for (int64_t ch = 0; ch < nk; ch++) {
			const int64_t a = t0 + ch * ck, e = a + ck < c->t_end ? a + ck : c->t_end;
			float m = 0;

			for (int64_t lb = a / c->bt; lb <= (e - 1) / c->bt; lb++)
				m = fmaxf(m, c->bnorm[ape__kv_phys(c, lb) * nbg + bg]);
			c->km.pre[bg * nk + ch] = m;
		}
	ape__kmax_scan(&c->km);
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

/* Whether the backend reads all of p's keys in place in one launch (one query chunk of at
 * most cq rows, no diagnostics): then the attend takes them as one key chunk, which nothing
 * has to hold, instead of chunks of the plan's size. */
static bool whole_in_place(struct ape_kv_cache *c, const struct ape__problem *p,
			   const struct ape__diag_req *dg, const struct ape__skip_budget *tol)
{
	struct ape__launch l;
	struct ape__kv_pages pg;
	struct ape__buf *k, *v;

	if (!c->ops->attention_pages || dg->ent || dg->md || p->Lq > c->geom.plan.co ||
	    !ape__kv_pages(c, 0, p->Lk, &k, &v, &pg))
		return false;
	ape__launch_init(&l, p, APE_F32, ape__skip_launch_tol(tol, false));
	l.Lq = p->Lq;
	l.Lk = p->Lk;
	l.q_start = p->q_start;
	l.k_start = p->k_start;
	l.pages = &pg;
	return c->ops->attention_pages(c->dev, &l);
}

/*
 * The attend's window: how many of the oldest live tokens an attend of p may leave out without
 * reading, gathering or norming them, so that a decode step under decay costs what the keys
 * within reach cost, whatever the context length. The proof is release_proved()'s
 * (kvcache_release.c) made with the rows' own norms instead of max_query_norm: take as
 * reference the newest live key at or before the earliest row's position q_start, at distance
 * n0 >= 0 from it. Every row sees it (causal or not) at some n_ref >= n0, and sees a left-out
 * key at n_ref + dn or further, dn = pos_ref - (the last left-out key's position). With
 * delta > 0, beta, gamma >= 0 and lambda >= 0 (so temp(n) <= temp(n0) for n >= n0) and
 * |dot| <= |q||k| (the rotation keeps norms):
 *   s_out - s_ref <= temp(n0) |scale| |q| (kmax_out + |k_ref|) - delta dn,
 * and the left-out keys sit one per distance (a cache's positions are consecutive), so their
 * weight is at most ape_tail_count(count, delta) times the nearest one's bound: at most `tol`
 * times the weight of one key the row computes. kmax_out and |k_ref| come from the block
 * maxima kept at append (a bound for any part of a block), |q| from each (batch, head)'s
 * largest row. Returns the count (0: nothing provably negligible, or no decay); O(blocks).
 */
static int64_t window_cut(const struct ape_kv_cache *c, const struct ape__problem *p,
			  const ape_tensor *q, double tol)
{
	const int64_t nbg = c->o.B * c->o.Hkv, group = c->o.H / c->o.Hkv;
	const int64_t first = c->lb_first * c->bt, pos_first = ape__kv_first_live_position(c);
	float pm[256], row[APE_MAX_D];
	double coef[256], lc[256];
	int64_t t_ref, best = first;
	double n0;
	const float *kref;

	if (!ape__skip_allowed(p) || !(tol > 0) || p->Lq == 0 || c->t_end <= first ||
	    p->q_start < pos_first || nbg > 256 || c->o.B * c->o.H > 256)
		return 0;
	for (int64_t h = 0; h < p->H; h++)
		if (!(p->head_params[4 * h] > 0) || !(p->head_params[4 * h + 3] >= 0))
			return 0;
	/* the reference: the newest live key at or before q_start */
	t_ref = p->q_start - pos_first < c->t_end - 1 - first ? first + (p->q_start - pos_first)
							       : c->t_end - 1;
	n0 = (double)(p->q_start - (c->o.k_start + t_ref));
	kref = c->bnorm + ape__kv_phys(c, t_ref / c->bt) * nbg;
	/* per (batch, head): need = lc + coef (kmax_out + |k_ref|), the cut's delta dn >= need,
	 * with at most t_ref - first keys left out */
	for (int64_t b = 0; b < c->o.B; b++)
		for (int64_t h = 0; h < p->H; h++) {
			const float *prm = p->head_params + 4 * h;
			float m = 0;

			for (int64_t i = 0; i < p->Lq; i++) {
				ape__load_row_f32(q, p->qs, b, h, i, row);
				m = fmaxf(m, ape__norm(row, p->D));
			}
			coef[b * p->H + h] = ape_temp(prm[3], n0) * fabs(p->scale) * m;
			lc[b * p->H + h] =
				log(ape_tail_count((double)(t_ref - first), prm[0])) - log(tol);
		}
	for (int64_t bg = 0; bg < nbg; bg++)
		pm[bg] = 0;
	/* blocks oldest first, the largest norm so far in pm; the cut may end inside a block
	 * (its maximum bounds any part of it) */
	for (int64_t lb = c->lb_first; lb * c->bt < t_ref; lb++) {
		const int64_t lo = lb * c->bt;
		const int64_t hi = (lb + 1) * c->bt < t_ref ? (lb + 1) * c->bt : t_ref;
		double allow = (double)hi;

		for (int64_t bg = 0; bg < nbg; bg++)
			pm[bg] = fmaxf(pm[bg], c->bnorm[ape__kv_phys(c, lb) * nbg + bg]);
		for (int64_t b = 0; b < c->o.B; b++)
			for (int64_t h = 0; h < p->H; h++) {
				const int64_t bg = b * c->o.Hkv + h / group, bh = b * p->H + h;
				const double need =
					lc[bh] + coef[bh] * ((double)pm[bg] + (double)kref[bg]);
				/* dn = t_ref - (cut - 1) */
				const double a =
					(double)t_ref + 1 - need / (double)p->head_params[4 * h];

				allow = isnan(a) ? -INFINITY : fmin(allow, floor(a));
			}
		if (allow > (double)lo && allow > (double)best)
			best = (int64_t)allow;
		if (allow < (double)hi)
			break; /* newer blocks only raise the maximum: no longer a cut */
	}
	return best - first;
}

/*
 * Runs the attend of p on the cache's session: its query rows in one chunk (or a few), its
 * key chunks gathered from the blocks (or read where they lie), partial results merged by LSE.
 * Adds to *res.
 */
static int run_attend(struct ape_kv_cache *c, const char *fn, const struct ape__problem *p,
		      const ape_tensor *q, ape_tensor *o, float *lse,
		      const struct ape__diag_req *dg, bool want_pairs,
		      struct ape__exec_result *res)
{
	struct ape__fwd_call fc = {
		.p = p, .q = q, .o = o, .lse = lse, .ent = dg->ent, .md = dg->md,
		.diag = dg->ent || dg->md, .want_pairs = want_pairs, .force_merge = true,
		.release = c->o.allow_release,
	};
	struct ape__stream_call call;
	struct ape__trace_dev trace = { 0 };
	struct ape__fwd f;
	atomic_bool abort_flag;
	const int64_t cq = c->geom.plan.co, nq = (p->Lq + cq - 1) / cq;
	int64_t ck = c->geom.plan.ci, nk;
	int ret;

	/* with release allowed, a share of skip_tol stays for what release may drop */
	ape__skip_budget(p->skip_tol, p->causal, (p->Lk + ck - 1) / ck, c->o.allow_release,
			 &fc.tol);
	if (whole_in_place(c, p, dg, &fc.tol)) {
		ck = p->Lk;
		ape__skip_budget(p->skip_tol, p->causal, 1, c->o.allow_release, &fc.tol);
	}
	nk = (p->Lk + ck - 1) / ck;
	if (ape__skip_allowed(p) && nk > 1) {
		chunk_norms(c, ck, nk);
		fc.kmax = &c->km;
	}
	ape__fwd_init(&f, &fc, c->dev);
	if ((ret = ape__fwd_prepare(&f, cq, ck, nq, nk, c->geom.plan.o_slots)))
		return ape__error_prefix(ret, fn);
	call = (struct ape__stream_call){
		.pass = &f.pass, .Lq = p->Lq, .Lk = p->Lk, .co = cq, .ci = ck, .no = nq, .ni = nk,
		.loader = &c->loader, .host_tables = c->dev->caps.host_memory,
		.poison = c->dev->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS,
		.wq = c->wq, .abort = &abort_flag,
	};
	atomic_init(&abort_flag, false);
	ape__workq_single(c->wq, nq);
	if (ape__strace_on()) /* the session trace: the attend's copies and kernels */
		ape__trace_label(&trace, &c->dev, 0);
	ret = ape__stream_run(c->s, &call, 0, ape__strace_on() ? &trace : NULL, &res->st);
	res->pairs_computed += f.pairs_computed;
	res->chunks_skipped += f.chunks_skipped;
	ape__path_merge(&res->paths, &f.paths);
	if (ape__strace_on()) {
		ape__path_names(trace.path, sizeof(trace.path), &f.paths);
		ape__trace_to_session(&trace);
		ape__trace_free(&trace);
	}
	ape__fwd_fini(&f);
	if (ret) /* a lost device may fail the last step, after the rows were written */
		ape__error_prefix(ape__error_written(ape__error_on(ret, c->dev),
						     res->st.outer_done, nq),
				  fn);
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

	res->cq = c->geom.plan.co;
	res->ck = c->geom.plan.ci;
	res->depth = c->geom.plan.depth;
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

		ape__skip_window(p.skip_tol, c->o.allow_release, &wtol, &rest);
		c->win = window_cut(c, &p, q, wtol);
		if (c->win) {
			w.k_start += c->win;
			w.Lk -= c->win;
			w.skip_tol = rest;
		}
		ret = run_attend(c, fn, &w, q, o, lse, dg, stats != NULL, &res);
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
