/* SPDX-License-Identifier: MIT */
/*
 * A streamed call over one or more devices: one plan per device (each under its own budget,
 * all with the same chunking so that query chunks are interchangeable), one work queue of
 * query chunks split by device speed, one worker per device. With several devices each worker
 * is a thread bound to its device's local CPUs; with one, the calling thread does the work
 * (binding it would change the caller's affinity for good).
 *
 * Speeds come from earlier calls (query x key rows launched per second, kept per device as an
 * exponential average): no calibration run, and no global state. Until a device has been
 * measured it gets the average share; at the end, idle workers take chunks from busy ones, so
 * a wrong weight costs balance at the tail only.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/context.h"
#include "core/error.h"
#include "core/limits.h"
#include "exec/launch.h"
#include "exec/multidev.h"
#include "topo/placement.h"

/* ------------------------------------------------------------------ planning */

/* What the planner prices a launch of one device with: the call's template, with rows. */
struct scratch_arg {
	struct ape_device *dev;
	const struct ape__launch *tmpl;
};

static uint64_t plan_scratch(void *arg, int64_t lq, int64_t lk)
{
	const struct scratch_arg *a = arg;
	struct ape__launch l = *a->tmpl;

	l.Lq = lq;
	l.Lk = lk;
	return ape__scratch_of(a->dev, &l);
}

static uint64_t default_budget(const struct ape_device *dev)
{
	/* a quarter stays for the driver, other users and the backend's own needs */
	return dev->info.global_mem_bytes ? dev->info.global_mem_bytes / 4 * 3 : UINT64_MAX;
}

/* Plans every device with the same chunking: the smallest any device needs. */
static int plan_all(const struct ape__exec_req *r, struct ape__plan *plans, uint64_t *budgets,
		    struct scratch_arg *sa)
{
	const struct ape__problem *p = r->p;
	int64_t cq = r->chunk_q, ck = r->chunk_k;
	bool changed = true;
	int ret;

	while (changed) {
		int64_t ncq = cq, nck = ck;

		for (int d = 0; d < r->ndev; d++) {
			struct ape_device *dev = r->devs[d];
			struct ape__plan_req q = {
				.B = p->B, .H = p->H, .Hkv = p->Hkv, .Lq = p->Lq, .Lk = p->Lk,
				.D = p->D, .esz = ape_dtype_size(p->in_dtype),
				.out_esz = ape_dtype_size(p->out_dtype),
				.dtype_name = ape_dtype_name(p->in_dtype),
				.pairs = r->want_pairs, .diag = r->ent || r->md,
				.max_cq = cq, .max_ck = ck,
				.depth = r->depth, .budget = budgets[d],
				.max_buffer = dev->be->ops->max_alloc ? dev->be->ops->max_alloc(dev)
								      : UINT64_MAX,
				.scratch = plan_scratch, .scratch_arg = &sa[d],
				.prior = ape__skip_allowed(p) && dev->be->ops->copy_d2d,
			};
			char fn[160];

			snprintf(fn, sizeof(fn), "%s: %s:%d", r->fn, dev->info.backend,
				 dev->info.backend_index);
			ret = ape__plan_make(&q, fn, &plans[d]);
			if (ret)
				return ret;
			ncq = plans[d].cq < ncq ? plans[d].cq : ncq;
			nck = plans[d].ck < nck ? plans[d].ck : nck;
		}
		changed = ncq != cq || nck != ck;
		for (int d = 0; d < r->ndev; d++)
			changed |= plans[d].cq != ncq || plans[d].ck != nck;
		cq = ncq;
		ck = nck;
	}
	return 0;
}

/* ------------------------------------------------------------------ the split */

/* Cost of a query chunk: its visible pairs, or just its rows when skipping makes every row
 * cost about the same window. */
static double chunk_cost(const struct ape__problem *p, int64_t i0, int64_t n, bool skipping)
{
	struct ape__problem sub = *p;
	uint64_t pairs = 0;

	if (skipping)
		return (double)n;
	sub.Lq = n;
	sub.q_start = p->q_start + i0;
	if (ape__head_visible_pairs(&sub, &pairs))
		return (double)n * (double)p->Lk;
	return (double)pairs + 1;
}

void ape__split_ranges(const double *weight, int ndev, const double *cost, int64_t n,
		       int64_t *bounds)
{
	double bound[APE_MAX_DEVICES], wsum = 0, total = 0, acc = 0, share = 0;
	int d = 0;

	for (int i = 0; i < ndev; i++)
		wsum += weight[i];
	for (int64_t c = 0; c < n; c++)
		total += cost[c];
	/* device d's range ends where the cumulative cost passes its cumulative share */
	for (int i = 0; i < ndev; i++) {
		share += weight[i];
		bound[i] = total * share / wsum;
	}
	bounds[0] = 0;
	for (int64_t c = 0; c < n; c++) {
		while (d < ndev - 1 && acc + cost[c] / 2 > bound[d])
			bounds[++d] = c;
		acc += cost[c];
	}
	while (++d <= ndev) /* the last range, and empty ones after it */
		bounds[d] = n;
}

static int split_work(const struct ape__exec_req *r, int64_t cq, int64_t nq, bool skipping,
		      struct ape__workq *w)
{
	double weight[APE_MAX_DEVICES], known = 0;
	int64_t bounds[APE_MAX_DEVICES + 1];
	double *cost;
	int nknown = 0;

	if (r->ndev == 1) {
		ape__workq_single(w, nq);
		return 0;
	}
	for (int i = 0; i < r->ndev; i++) {
		weight[i] = r->weights ? r->weights[i]
				       : (double)atomic_load(ape__device_pairs_per_s(r->devs[i]));
		if (weight[i] > 0) {
			known += weight[i];
			nknown++;
		}
	}
	for (int i = 0; i < r->ndev; i++)
		if (!(weight[i] > 0)) /* not measured yet: the average of those that were */
			weight[i] = nknown ? known / nknown : 1.0;
	cost = ape__malloc((size_t)nq * sizeof(double) + 1);
	if (!cost)
		return ape__error(APE_ENOMEM, "%s: out of memory splitting the work", r->fn);
	for (int64_t c = 0; c < nq; c++) {
		int64_t i0 = c * cq, n = i0 + cq < r->p->Lq ? cq : r->p->Lq - i0;

		cost[c] = chunk_cost(r->p, i0, n, skipping);
	}
	/* contiguous ranges: consecutive query chunks share key chunks */
	ape__split_ranges(weight, r->ndev, cost, nq, bounds);
	ape__workq_set(w, r->ndev, bounds);
	free(cost);
	return 0;
}

/* ------------------------------------------------------------------ workers */

struct shared {
	const struct ape__exec_req *r;
	struct ape__stream_call call;
	atomic_bool abort;
	double t0;
};

struct worker {
	struct shared *sh;
	int who;
	struct ape__stream_geom geom;
	struct ape__stream_stats st;
	struct ape__trace_dev trace;
	bool tracing;
	int ret;
	char msg[1024];
	double ms; /* wall time of its run */
	pthread_t thread;
};

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct shared *sh = w->sh;
	struct ape_device *dev = sh->r->devs[w->who];
	struct ape__stream *s = NULL;
	double t0 = ape__now_ms();

	w->trace.host_start_ms = t0 - sh->t0;
	w->ret = ape__stream_create(dev, &w->geom, &s);
	if (!w->ret)
		w->ret = ape__stream_run(s, &sh->call, w->who, w->tracing ? &w->trace : NULL,
					 &w->st);
	ape__stream_destroy(s);
	w->ms = ape__now_ms() - t0;
	if (w->ret < 0) {
		ape__error_on(w->ret, dev);
		snprintf(w->msg, sizeof(w->msg), "%s", ape_last_error());
		atomic_store(&sh->abort, true);
	}
	return NULL;
}

/* Remembers how fast each device went, for the next call's split. */
static void note_speeds(const struct ape__exec_req *r, const struct worker *w)
{
	for (int d = 0; d < r->ndev; d++) {
		atomic_uint_fast64_t *slot = ape__device_pairs_per_s(r->devs[d]);
		uint64_t old, rate;

		if (w[d].ret || w[d].ms < 1 || !w[d].st.work)
			continue; /* too short to say anything */
		rate = (uint64_t)((double)w[d].st.work / (w[d].ms * 1e-3));
		old = atomic_load(slot);
		atomic_store(slot, old ? old / 2 + rate / 2 : rate);
	}
}

static void sum_stats(struct ape__stream_stats *to, const struct ape__stream_stats *from)
{
	to->pairs_computed += from->pairs_computed;
	to->chunks += from->chunks;
	to->chunks_skipped += from->chunks_skipped;
	to->work += from->work;
	to->h2d += from->h2d;
	to->d2h += from->d2h;
	to->d2d += from->d2d;
	to->kernel_ms += from->kernel_ms;
	to->copy_ms += from->copy_ms;
	to->overlap_ms += from->overlap_ms;
	to->qchunks_done += from->qchunks_done;
	if (from->peak_bytes > to->peak_bytes)
		to->peak_bytes = from->peak_bytes;
}

/* One thread of ape__run_per_device(). */
struct per_device {
	void (*body)(void *arg, int d);
	void *arg;
	int d;
	struct ape_device *dev;
	pthread_t thread;
};

static void *per_device_main(void *arg)
{
	struct per_device *t = arg;

	ape__bind_thread(t->dev);
	t->body(t->arg, t->d);
	return NULL;
}

int ape__run_per_device(const char *fn, ape_device *const *devs, int ndev,
			void (*body)(void *arg, int d), void *arg, atomic_bool *abort)
{
	struct per_device t[APE_MAX_DEVICES];
	int started = 0, ret = 0;

	if (ndev == 1) {
		body(arg, 0);
		return 0;
	}
	for (; started < ndev; started++) {
		t[started] = (struct per_device){ body, arg, started, devs[started], 0 };
		if (pthread_create(&t[started].thread, NULL, per_device_main, &t[started])) {
			atomic_store(abort, true);
			ret = ape__error(APE_ENOMEM, "%s: cannot start a thread for device %d", fn,
					 started);
			break;
		}
	}
	for (int d = 0; d < started; d++)
		pthread_join(t[d].thread, NULL);
	return ret;
}

static void worker_body(void *arg, int d)
{
	worker_main(&((struct worker *)arg)[d]);
}

static int run_workers(struct shared *sh, struct worker *w)
{
	const struct ape__exec_req *r = sh->r;
	int ret = ape__run_per_device(r->fn, r->devs, r->ndev, worker_body, w, &sh->abort);

	for (int d = 0; d < r->ndev && !ret; d++)
		if (w[d].ret < 0) { /* the first failure, in device order */
			ret = ape__error(w[d].ret, "%s", w[d].msg);
			break;
		}
	return ret;
}

/* ------------------------------------------------------------------ the call */

static void setup_call(struct shared *sh, const struct ape__plan *plan, const struct ape__kmax *km,
		       struct ape__workq *wq)
{
	const struct ape__exec_req *r = sh->r;
	const struct ape__problem *p = r->p;

	memset(&sh->call, 0, sizeof(sh->call));
	sh->call.p = p;
	sh->call.q = r->q;
	sh->call.k = r->k;
	sh->call.v = r->v;
	sh->call.o = r->o;
	sh->call.lse = r->lse;
	sh->call.ent = r->ent;
	sh->call.md = r->md;
	sh->call.cq = plan->cq;
	sh->call.ck = plan->ck;
	sh->call.nq = plan->nq;
	sh->call.nk = plan->nk;
	sh->call.merge = plan->merge;
	sh->call.kmax = km->pre ? km : NULL;
	ape__skip_budget(p->skip_tol, p->causal, plan->nk, false, &sh->call.tol);
	sh->call.want_pairs = r->want_pairs;
	sh->call.poison = r->devs[0]->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS;
	sh->call.wq = wq;
	sh->call.abort = &sh->abort;
}

static int finish(const struct ape__exec_req *r, struct worker *w, struct ape__exec_result *res,
		  int ret)
{
	for (int d = 0; d < r->ndev; d++)
		sum_stats(&res->st, &w[d].st);
	res->st.device_clock = w[0].st.device_clock;
	if (ret && !r->staged)
		ape__error_written(ret, res->st.qchunks_done, res->nq);
	if (!ret) {
		note_speeds(r, w);
		if (r->trace_path) {
			struct ape__trace_dev *t = ape__malloc(sizeof(*t) * (size_t)r->ndev);

			if (!t)
				return ape__error(APE_ENOMEM, "%s: out of memory writing the trace",
						  r->fn);
			for (int d = 0; d < r->ndev; d++)
				t[d] = w[d].trace;
			ret = ape__trace_write(r->trace_path, r->fn, t, r->ndev);
			free(t);
		}
	}
	return ret;
}

int ape__exec_run(const struct ape__exec_req *r, struct ape__exec_result *res)
{
	struct ape__plan plans[APE_MAX_DEVICES];
	uint64_t budgets[APE_MAX_DEVICES];
	struct scratch_arg sa[APE_MAX_DEVICES];
	struct ape__kmax km = { 0 };
	struct ape__skip_budget tol;
	struct ape__launch tmpl;
	struct ape__workq wq;
	struct shared sh;
	struct worker *w;
	bool skipping;
	int ret;

	memset(res, 0, sizeof(*res));
	w = ape__calloc((size_t)r->ndev, sizeof(*w));
	if (!w)
		return ape__error(APE_ENOMEM, "%s: out of memory", r->fn);
	/* launches are priced with the kernels' share of skip_tol when there are several key
	 * chunks (a launch with skipping needs the most scratch) */
	ape__skip_budget(r->p->skip_tol, r->p->causal, 2, false, &tol);
	ape__launch_init(&tmpl, r->p, APE_F32, tol.kernel);
	res->budget = UINT64_MAX;
	for (int d = 0; d < r->ndev; d++) {
		budgets[d] = r->budget ? r->budget : default_budget(r->devs[d]);
		res->budget = budgets[d] < res->budget ? budgets[d] : res->budget;
		sa[d] = (struct scratch_arg){ r->devs[d], &tmpl };
	}
	ret = plan_all(r, plans, budgets, sa);
	if (ret)
		goto out_free;
	res->cq = plans[0].cq;
	res->ck = plans[0].ck;
	res->nq = plans[0].nq;
	res->depth = plans[0].depth;
	skipping = ape__skip_allowed(r->p) && plans[0].nk > 1;
	if (skipping) {
		ret = ape__kmax_from_tensor(&km, r->k, r->p->ks, plans[0].ck);
		if (ret)
			goto out_free;
	}
	ape__workq_init(&wq);
	ret = split_work(r, plans[0].cq, plans[0].nq, skipping, &wq);
	if (ret)
		goto out_fini_wq;

	memset(&sh, 0, sizeof(sh));
	sh.r = r;
	sh.t0 = ape__now_ms();
	atomic_init(&sh.abort, false);
	setup_call(&sh, &plans[0], &km, &wq);
	for (int d = 0; d < r->ndev; d++) {
		w[d].sh = &sh;
		w[d].who = d;
		w[d].tracing = r->trace_path != NULL;
		ape__trace_label(&w[d].trace, r->devs, d);
		w[d].geom = (struct ape__stream_geom){
			.B = r->p->B, .H = r->p->H, .Hkv = r->p->Hkv, .D = r->p->D,
			.in_dtype = r->p->in_dtype, .plan = plans[d], .host_kv = true,
			.budget = budgets[d],
		};
		res->depth = plans[d].depth < res->depth ? plans[d].depth : res->depth;
	}
	ret = run_workers(&sh, w);
	ret = finish(r, w, res, ret);
	for (int d = 0; d < r->ndev; d++)
		ape__trace_free(&w[d].trace);
out_fini_wq:
	ape__workq_fini(&wq);
	ape__kmax_free(&km);
out_free:
	free(w);
	return ret;
}

uint64_t ape__default_budget(const struct ape_device *dev)
{
	return default_budget(dev);
}
