/* SPDX-License-Identifier: MIT */
/*
 * The attend session of the KV stores (api/kv_session.h): made once at a store's creation,
 * run on each attend with the store's key loader; and the window proof of an attend.
 */
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "core/context.h"
#include "core/error.h"
#include "core/strace.h"
#include "exec/fwd_pass.h"
#include "exec/launch.h"
#include "exec/pack.h"
#include "exec/skip_budget.h"
#include "exec/trace.h"
#include "exec/workq.h"
#include "api/kv_session.h"

/* ------------------------------------------------------------------ options */

int ape__kv_check_shape(const char *fn, int64_t Hkv, int64_t H, int64_t D, ape_dtype dtype,
			int64_t capacity)
{
	if (Hkv < 1)
		return ape__error(APE_EINVAL, "%s: opts->Hkv = %" PRId64 ": must be >= 1", fn, Hkv);
	if (H < 0 || (H && H % Hkv))
		return ape__error(APE_EINVAL,
				  "%s: opts->H = %" PRId64 ": must be a multiple of Hkv = %" PRId64
				  " (0: Hkv)",
				  fn, H, Hkv);
	if (D < 2 || D > APE_MAX_D || D % 2)
		return ape__error(APE_EINVAL, "%s: opts->D = %" PRId64 ": must be even and in 2..%d",
				  fn, D, APE_MAX_D);
	if (!ape_dtype_size(dtype))
		return ape__error(APE_EINVAL, "%s: opts->dtype = %d: not a libape storage type", fn,
				  (int)dtype);
	if (capacity < 1 || capacity > ((int64_t)1 << 40))
		return ape__error(APE_EINVAL,
				  "%s: opts->capacity_tokens = %" PRId64 ": must be in 1..2^40", fn,
				  capacity);
	return 0;
}

/* ------------------------------------------------------------------ the session */

/* The plan's pass: a forward pass of the store's shape at its largest (every query row, every
 * key, pair counts, the diagnostics where the backend computes them, partial results in float32
 * whatever the length), priced with skip tables. */
struct shell {
	struct ape__problem p;
	struct ape__fwd_call call;
	struct ape__fwd f;
	struct ape_device *dev;
};

static void shell_bytes(void *arg, int64_t co, int64_t ci, int64_t no, int64_t ni,
			struct ape__plan_bytes *b)
{
	struct shell *sh = arg;

	sh->f.pass.ops->shape(&sh->f, sh->dev, no, ni);
	ape__pass_bytes(&sh->f.pass, false, 0, sh->p.Lq, sh->p.Lk, co, ci, b);
}

static uint64_t shell_scratch(void *arg, int64_t co, int64_t ci)
{
	struct shell *sh = arg;

	return sh->f.pass.ops->scratch(&sh->f, sh->dev, co, ci);
}

int ape__kv_session_make(struct ape__kv_session *ks, struct ape_device *dev, const char *fn,
			 const struct ape__problem *shape, int64_t max_ci, uint64_t budget)
{
	struct shell sh = {
		.p = { .B = shape->B, .H = shape->H, .Hkv = shape->Hkv, .D = shape->D,
		       .Lq = shape->Lq, .Lk = shape->Lk, .in_dtype = shape->in_dtype,
		       .out_dtype = APE_F32, .decay_nonneg = true, .skip_tol = 1 },
		.dev = dev,
	};
	struct ape__plan_req r = {
		.Lo = shape->Lq, .Li = shape->Lk, .max_co = shape->Lq, .max_ci = max_ci,
		.depth = APE__KV_DEPTH, .budget = budget, .max_inner_slots = APE__KV_DEPTH,
		.max_buffer = dev->caps.max_alloc, .bytes = shell_bytes, .scratch = shell_scratch,
		.arg = &sh, .what = ape_dtype_name(shape->in_dtype),
	};
	int ret;

	memset(ks, 0, sizeof(*ks));
	ks->dev = dev;
	/* room for the attends with diagnostics: two floats per query row, on backends that
	 * compute them */
	sh.call = (struct ape__fwd_call){ .p = &sh.p, .want_pairs = true, .force_merge = true,
					  .diag = ape_be_caps_have(&dev->caps, APE_BE_CAP_DIAG) };
	ape__fwd_init(&sh.f, &sh.call, dev);
	if ((ret = ape__plan_make(&r, fn, &ks->geom.plan)))
		return ret;
	sh.f.pass.ops->shape(&sh.f, dev, ks->geom.plan.no, ks->geom.plan.ni);
	ks->geom.shape = sh.f.pass;
	ks->geom.shape.self = NULL; /* the shape only: every attend brings its own pass */
	ks->geom.budget = budget;
	/* the layers below name the device and what failed, not the call (fuzz_resident) */
	if ((ret = ape__stream_create(dev, &ks->geom, &ks->s)) ||
	    (ret = ape__stream_reserve(ks->s)) ||
	    (ret = ape__kmax_alloc(&ks->km, shape->B * shape->Hkv, ks->geom.plan.ni)) ||
	    (ret = ape__workq_create(&ks->wq)))
		return ape__error_prefix(ret, fn);
	return 0;
}

void ape__kv_session_free(struct ape__kv_session *ks)
{
	ape__stream_destroy(ks->s);
	ape__kmax_free(&ks->km);
	ape__workq_destroy(ks->wq);
	ks->s = NULL;
	ks->wq = NULL;
}

/* Whether the backend reads all of p's keys in place in one launch (one query chunk of at
 * most cq rows, no diagnostics): then the attend takes them as one key chunk, which nothing
 * has to hold, instead of chunks of the plan's size. */
static bool whole_in_place(const struct ape__kv_session *ks, const struct ape__kv_run *r,
			   const struct ape__skip_budget *tol)
{
	const struct ape__problem *p = r->p;
	struct ape_be_launch l;
	struct ape_be_kv_pages pg;
	struct ape_be_buf *k, *v;

	if (!ks->dev->be->ops->attention_pages || r->dg->ent || r->dg->md ||
	    p->Lq > ks->geom.plan.co || !r->loader->pages ||
	    !r->loader->pages(r->loader->arg, 0, p->Lk, &k, &v, &pg))
		return false;
	ape__launch_init(&l, p, APE_F32, ape__skip_launch_tol(tol, false));
	l.Lq = p->Lq;
	l.Lk = p->Lk;
	l.q_start = p->q_start;
	l.k_start = p->k_start;
	l.segs = p->segs; /* a ragged problem: every segment in the one launch */
	l.nseg = p->segs ? p->nseg : 0;
	l.pages = &pg;
	return ks->dev->be->ops->attention_pages(ks->dev, &l);
}

/*
 * Whether every output a launch of pass x brings back is written in place instead (each a
 * JOB_OUT wrapped over the caller's memory): the session's staging was planned for the
 * merged results of its geometry, not for a direct pass's rows coming back.
 */
static bool direct_in_place(const struct ape__pass *x, const struct ape_device *dev)
{
	for (int t = 0; t < x->nt; t++) {
		const struct ape__pass_tensor *pt = &x->t[t];

		if ((pt->role == APE__ROLE_JOB_OUT && pt->row_bytes && pt->back &&
		     !ape__pass_wraps(x, t, true, dev->caps.max_alloc, 0, 0)) ||
		    (pt->role == APE__ROLE_JOB_IN && pt->row_bytes))
			return false;
	}
	return true;
}

int ape__kv_session_run(struct ape__kv_session *ks, const char *fn, const struct ape__kv_run *r,
			struct ape__exec_result *res)
{
	const struct ape__problem *p = r->p;
	struct ape__fwd_call fc = {
		.p = p, .q = r->q, .o = r->o, .lse = r->lse, .ent = r->dg->ent, .md = r->dg->md,
		.diag = r->dg->ent || r->dg->md, .want_pairs = r->want_pairs, .force_merge = true,
		.release = r->release,
	};
	struct ape__stream_call call;
	struct ape__trace_dev trace = { 0 };
	struct ape__fwd f;
	atomic_bool abort_flag;
	const int64_t cq = ks->geom.plan.co, nq = (p->Lq + cq - 1) / cq;
	const bool host = ape_be_caps_have(&ks->dev->caps, APE_BE_CAP_HOST_MEMORY);
	int64_t ck = ks->geom.plan.ci, nk;
	int ret;

	if ((ret = ape__launch_supported(fn, ks->dev, p)))
		return ret;
	/* with release allowed, a share of skip_tol stays for what release may drop */
	ape__skip_budget(p->skip_tol, p->causal, (p->Lk + ck - 1) / ck, r->release, &fc.tol);
	if (whole_in_place(ks, r, &fc.tol)) {
		ck = p->Lk;
		ape__skip_budget(p->skip_tol, p->causal, 1, r->release, &fc.tol);
	}
	nk = (p->Lk + ck - 1) / ck;
	if (ape__skip_allowed(p) && nk > 1 && r->chunk_norms) {
		ks->km.nk = nk;
		r->chunk_norms(r->norms_arg, &ks->km, ck, nk);
		ape__kmax_scan(&ks->km);
		fc.kmax = &ks->km;
	}
	/* one key chunk on a device that reads host memory: the launches write the caller's O
	 * (and LSE) in place, with no accumulators to fill, merge into and read back */
	fc.in_place = host && nk == 1 && !fc.want_pairs && !fc.diag && p->os[3] == 1;
	fc.force_merge = !fc.in_place;
	ape__fwd_init(&f, &fc, ks->dev);
	ret = ape__fwd_prepare(&f, cq, ck, nq, nk, ks->geom.plan.o_slots);
	if (!ret && fc.in_place && !direct_in_place(&f.pass, ks->dev)) {
		ape__fwd_fini(&f);
		fc.in_place = false;
		fc.force_merge = true;
		ape__fwd_init(&f, &fc, ks->dev);
		ret = ape__fwd_prepare(&f, cq, ck, nq, nk, ks->geom.plan.o_slots);
	}
	if (ret)
		return ape__error_prefix(ret, fn);
	call = (struct ape__stream_call){
		.pass = &f.pass, .Lq = p->Lq, .Lk = p->Lk, .co = cq, .ci = ck, .no = nq, .ni = nk,
		.loader = r->loader,
		/* on a device that reads host memory, the attend's queries are read where they
		 * lie (no copy in: one command fewer per decode step), as the per-run tables */
		.in_place = host, .host_tables = host,
		.poison = ks->dev->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS,
		.wq = ks->wq, .abort = &abort_flag,
	};
	atomic_init(&abort_flag, false);
	ape__workq_single(ks->wq, nq);
	if (ape__strace_on()) /* the session trace: the attend's copies and kernels */
		ape__trace_label(&trace, &ks->dev, 0);
	ret = ape__stream_run(ks->s, &call, 0, ape__strace_on() ? &trace : NULL, &res->st);
	res->pairs_computed += f.pairs_computed;
	res->chunks_skipped += f.chunks_skipped;
	ape__path_merge(&res->paths, &f.paths);
	res->cq = cq;
	res->ck = ks->geom.plan.ci;
	res->depth = ks->geom.plan.depth;
	if (ape__strace_on()) {
		ape__path_names(trace.path, sizeof(trace.path), &f.paths);
		ape__trace_to_session(&trace);
		ape__trace_free(&trace);
	}
	ape__fwd_fini(&f);
	if (ret) /* a lost device may fail the last step, after the rows were written */
		ape__error_prefix(ape__error_written(ape__error_on(ret, ks->dev),
						     res->st.outer_done, nq, res->st.in_place),
				  fn);
	return ret;
}

/* ------------------------------------------------------------------ the window */

/*
 * The proof is the release proof's (kvcache_release.c) made with the rows' own norms instead
 * of a bound on every future query: take as reference the newest key at or before the earliest
 * row's position q_start, at distance n0 >= 0 from it. Every row sees it (causal or not) at
 * some n_ref >= n0, and sees a left-out key at n_ref + dn or further, dn = pos_ref - (the last
 * left-out key's position). With delta > 0, beta, gamma >= 0 and lambda >= 0 (so
 * temp(n) <= temp(n0) for n >= n0) and |dot| <= |q||k| (the rotation keeps norms):
 *   s_out - s_ref <= temp(n0) |scale| |q| (kmax_out + |k_ref|) - delta dn,
 * and the left-out keys sit one per distance (a sequence's positions are consecutive), so
 * their weight is at most ape_tail_count(count, delta) times the nearest one's bound: at most
 * `tol` times the weight of one key the row computes. kmax_out and |k_ref| come from the block
 * maxima kept at append, |q| from each (batch, head)'s largest row.
 */
/* How far a cut may reach (the first token kept, at most `cap`) when the left-out keys' norms
 * are at most pm[bg]: the smallest allowance over every (batch, head). */
static double cut_allow(const struct ape__kv_keys *kk, const struct ape__problem *p,
			const float *pm, const float *kref, const double *coef, const double *lc,
			int64_t t_ref, double cap)
{
	const int64_t group = p->H / p->Hkv;
	double allow = cap;

	(void)kk;
	for (int64_t b = 0; b < p->B; b++)
		for (int64_t h = 0; h < p->H; h++) {
			const int64_t bg = b * p->Hkv + h / group, bh = b * p->H + h;
			const double need = lc[bh] + coef[bh] * ((double)pm[bg] + (double)kref[bg]);
			/* dn = t_ref - (cut - 1) */
			const double a = (double)t_ref + 1 - need / (double)p->head_params[4 * h];

			allow = isnan(a) ? -INFINITY : fmin(allow, floor(a));
		}
	return allow;
}

int64_t ape__kv_window_cut(const struct ape__kv_keys *kk, const struct ape__problem *p,
			   const ape_tensor *q, int64_t q0, int64_t lq, int64_t q_start, double tol)
{
	const int64_t nbg = kk->nbg, B = p->B;
	const int64_t first = kk->first, pos_first = kk->k_start + kk->first;
	float pm[256], row[APE_MAX_D];
	double coef[256], lc[256];
	int64_t t_ref, best = first;
	double n0;
	const float *kref;

	/* a distance-bias table: no cut (the proof compares one key with another by the decay
	 * alone; the kernels' own bound, which counts the table, still skips within the attend) */
	if (!ape__skip_allowed(p) || !(tol > 0) || lq == 0 || kk->t_end <= first ||
	    q_start < pos_first || nbg > 256 || B * p->H > 256 || p->bias_table)
		return 0;
	for (int64_t h = 0; h < p->H; h++)
		if (!(p->head_params[4 * h] > 0) || !(p->head_params[4 * h + 3] >= 0))
			return 0;
	/* the reference: the newest key at or before q_start */
	/* q_start >= pos_first, but their difference may pass int64 (a row near INT64_MAX over
	 * keys near -2^62: the callers check positions afterwards); in uint64 it cannot */
	t_ref = (uint64_t)q_start - (uint64_t)pos_first < (uint64_t)(kk->t_end - 1 - first)
			? first + (int64_t)((uint64_t)q_start - (uint64_t)pos_first)
			: kk->t_end - 1;
	n0 = (double)((uint64_t)q_start - (uint64_t)(kk->k_start + t_ref));
	kref = kk->norms(kk->arg, t_ref / kk->bt);
	/* per (batch, head): need = lc + coef (kmax_out + |k_ref|), the cut's delta dn >= need,
	 * with at most t_ref - first keys left out */
	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < p->H; h++) {
			const float *prm = p->head_params + 4 * h;
			float m = 0;

			for (int64_t i = q0; i < q0 + lq; i++) {
				ape__load_row_f32(q, p->qs, b, h, i, row);
				m = fmaxf(m, ape__norm(row, p->D));
			}
			coef[b * p->H + h] = ape_temp(prm[3], n0) * fabs(p->scale) * m;
			lc[b * p->H + h] =
				log(ape_tail_count((double)(t_ref - first), prm[0])) - log(tol);
		}
	if (kk->prefix) {
		/* the first block that is no longer a whole cut, by bisection: allow() falls and
		 * the block's end rises with lb (the running maximum only grows) */
		int64_t lo = first / kk->bt, hi = (t_ref - 1) / kk->bt + 1;

		if (t_ref <= first)
			return 0;
		while (lo < hi) {
			const int64_t mid = lo + (hi - lo) / 2;
			const int64_t end = (mid + 1) * kk->bt < t_ref ? (mid + 1) * kk->bt : t_ref;

			if (cut_allow(kk, p, kk->prefix(kk->arg, mid), kref, coef, lc, t_ref, end) <
			    (double)end)
				hi = mid;
			else
				lo = mid + 1;
		}
		/* lo: that block (or one past the last): everything before it goes, and of it
		 * what its own allowance says */
		if (lo * kk->bt >= t_ref)
			return t_ref - first;
		{
			const double a = cut_allow(kk, p, kk->prefix(kk->arg, lo), kref, coef, lc,
						   t_ref, (double)t_ref);
			const int64_t start = lo * kk->bt > first ? lo * kk->bt : first;

			best = a > (double)start ? (int64_t)a : start;
		}
		return best - first;
	}
	for (int64_t bg = 0; bg < nbg; bg++)
		pm[bg] = 0;
	/* blocks oldest first, the largest norm so far in pm; the cut may end inside a block
	 * (its maximum bounds any part of it) */
	for (int64_t lb = first / kk->bt; lb * kk->bt < t_ref; lb++) {
		const int64_t lo = lb * kk->bt;
		const int64_t hi = (lb + 1) * kk->bt < t_ref ? (lb + 1) * kk->bt : t_ref;
		const float *bn = kk->norms(kk->arg, lb);
		double allow;

		for (int64_t bg = 0; bg < nbg; bg++)
			pm[bg] = fmaxf(pm[bg], bn[bg]);
		allow = cut_allow(kk, p, pm, kref, coef, lc, t_ref, (double)hi);
		if (allow > (double)lo && allow > (double)best)
			best = (int64_t)allow;
		if (allow < (double)hi)
			break; /* newer blocks only raise the maximum: no longer a cut */
	}
	return best - first;
}
