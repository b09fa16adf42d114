/* SPDX-License-Identifier: MIT */
/*
 * A pass over one or more devices: one plan per device (each under its own budget, all with
 * the same chunking so that outer chunks are interchangeable), one work queue of outer chunks
 * split by device speed (or fixed shares), one worker per device. With several devices each
 * worker is a thread bound to its device's local CPUs; with one, the calling thread does the
 * work (binding it would change the caller's affinity for good).
 *
 * Speeds come from earlier forward calls (outer x inner rows launched per second, kept per
 * device as an exponential average): no calibration run, and no global state. Until a device
 * has been measured it gets the average share; at the end, idle workers take chunks from busy
 * ones, so a wrong weight costs balance at the tail only. A fixed split (the backward) has no
 * such tail: the same devices always compute the same chunks.
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
#include "core/strace.h"
#include "core/limits.h"
#include "exec/multidev.h"
#include "topo/placement.h"

uint64_t ape__default_budget(const struct ape_device *dev)
{
	/* a quarter stays for the driver, other users and the backend's own needs */
	return dev->info.global_mem_bytes ? dev->info.global_mem_bytes / 4 * 3 : UINT64_MAX;
}

/* ------------------------------------------------------------------ planning */

/* What the planner prices a device's candidates with. */
struct plan_arg {
	const struct ape__exec_req *r;
	struct ape_device *dev;
	struct ape__pass *pass;
	bool in_place;
};

static void plan_bytes(void *arg, int64_t co, int64_t ci, int64_t no, int64_t ni,
		       struct ape__plan_bytes *b)
{
	const struct plan_arg *a = arg;
	const bool q_outer = a->pass->outer == APE__AXIS_Q;

	a->pass->ops->shape(a->pass->self, a->dev, no, ni);
	ape__pass_bytes(a->pass, a->in_place, a->dev->caps.max_alloc,
			q_outer ? a->r->Lq : a->r->Lk, q_outer ? a->r->Lk : a->r->Lq, co, ci, b);
}

static uint64_t plan_scratch(void *arg, int64_t co, int64_t ci)
{
	const struct plan_arg *a = arg;

	return a->pass->ops->scratch(a->pass->self, a->dev, co, ci);
}

/* Plans every device with the same chunking: the smallest any device needs (a plan only
 * shrinks, so the passes settle). */
static int plan_all(const struct ape__exec_req *r, struct ape__plan *plans,
		    const uint64_t *budgets, struct plan_arg *pa)
{
	const bool q_outer = r->passes[0]->outer == APE__AXIS_Q;
	int64_t co = q_outer ? r->chunk_q : r->chunk_k, ci = q_outer ? r->chunk_k : r->chunk_q;
	bool changed = true;
	int ret;

	while (changed) {
		int64_t nco = co, nci = ci;

		for (int d = 0; d < r->ndev; d++) {
			struct ape_device *dev = r->devs[d];
			const struct ape__plan_req q = {
				.Lo = q_outer ? r->Lq : r->Lk, .Li = q_outer ? r->Lk : r->Lq,
				.max_co = co, .max_ci = ci, .depth = r->depth, .budget = budgets[d],
				.max_buffer = dev->caps.max_alloc,
				.bytes = plan_bytes, .scratch = plan_scratch, .arg = &pa[d],
				.what = r->what, .chunk = r->chunk_name, .outer_is_key = !q_outer,
			};
			char fn[160];

			snprintf(fn, sizeof(fn), "%s: %s:%d %s", r->fn, dev->info.backend,
				 dev->info.backend_index, dev->info.name);
			if ((ret = ape__plan_make(&q, fn, &plans[d])))
				return ret;
			nco = plans[d].co < nco ? plans[d].co : nco;
			nci = plans[d].ci < nci ? plans[d].ci : nci;
		}
		changed = nco != co || nci != ci;
		for (int d = 0; d < r->ndev; d++)
			changed |= plans[d].co != nco || plans[d].ci != nci;
		co = nco;
		ci = nci;
	}
	/* the plan chosen is the shape each pass runs with */
	for (int d = 0; d < r->ndev; d++)
		r->passes[d]->ops->shape(r->passes[d]->self, r->devs[d], plans[d].no, plans[d].ni);
	return 0;
}

/* ------------------------------------------------------------------ the split */

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

static int split_work(const struct ape__exec_req *r, const struct ape__plan *plan,
		      struct ape__workq *w)
{
	const int64_t Lo = r->passes[0]->outer == APE__AXIS_Q ? r->Lq : r->Lk;
	double weight[APE_MAX_DEVICES], known = 0;
	int64_t bounds[APE_MAX_DEVICES + 1];
	double *cost;
	int nknown = 0;

	if (r->ndev == 1) {
		ape__workq_single(w, plan->no);
		return 0;
	}
	for (int i = 0; i < r->ndev; i++) {
		weight[i] = r->weights	       ? r->weights[i]
			    : r->fixed_split ? 1.0
					     : (double)atomic_load(ape__device_pairs_per_s(r->devs[i]));
		if (weight[i] > 0) {
			known += weight[i];
			nknown++;
		}
	}
	for (int i = 0; i < r->ndev; i++)
		if (!(weight[i] > 0)) /* not measured yet: the average of those that were */
			weight[i] = nknown ? known / nknown : 1.0;
	cost = ape__malloc((size_t)plan->no * sizeof(double) + 1);
	if (!cost)
		return ape__error(APE_ENOMEM, "%s: out of memory splitting the work", r->fn);
	for (int64_t c = 0; c < plan->no; c++) {
		const int64_t r0 = c * plan->co, n = r0 + plan->co < Lo ? plan->co : Lo - r0;

		cost[c] = r->cost(r->cost_arg, r0, n);
	}
	/* contiguous ranges: consecutive outer chunks share inner chunks */
	ape__split_ranges(weight, r->ndev, cost, plan->no, bounds);
	ape__workq_set(w, r->ndev, bounds, !r->fixed_split);
	free(cost);
	return 0;
}

/* ------------------------------------------------------------------ workers */

struct shared {
	const struct ape__exec_req *r;
	atomic_bool abort;
	double t0;
};

struct worker {
	struct shared *sh;
	int who;
	struct ape__stream_geom geom;
	struct ape__stream_call call;
	struct ape__stream_stats st;
	struct ape__trace_dev trace;
	bool tracing;
	int ret;
	char msg[1024];
	double ms; /* wall time of its run */
};

static void worker_body(void *arg, int d)
{
	struct worker *w = &((struct worker *)arg)[d];
	struct shared *sh = w->sh;
	struct ape_device *dev = sh->r->devs[w->who];
	struct ape__stream *s = NULL;
	double t0 = ape__now_ms();

	w->trace.host_start_ms = t0 - sh->t0;
	w->ret = ape__stream_create(dev, &w->geom, &s);
	if (!w->ret)
		w->ret = ape__stream_run(s, &w->call, w->who, w->tracing ? &w->trace : NULL,
					 &w->st);
	ape__stream_destroy(s);
	w->ms = ape__now_ms() - t0;
	if (w->ret < 0) {
		ape__error_prefix(ape__error_on(w->ret, dev), sh->r->fn);
		snprintf(w->msg, sizeof(w->msg), "%s", ape_last_error());
		atomic_store(&sh->abort, true);
	}
}

/* Remembers how fast each device went, for the next call's split. */
static void note_speeds(const struct ape__exec_req *r, const struct worker *w)
{
	for (int d = 0; d < r->ndev && !r->fixed_split; d++) {
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
	to->chunks += from->chunks;
	to->work += from->work;
	to->h2d += from->h2d;
	to->d2h += from->d2h;
	to->d2d += from->d2d;
	to->kernel_ms += from->kernel_ms;
	to->copy_ms += from->copy_ms;
	to->overlap_ms += from->overlap_ms;
	to->outer_done += from->outer_done;
	to->in_place |= from->in_place;
	if (from->peak_bytes > to->peak_bytes)
		to->peak_bytes = from->peak_bytes;
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

static int write_trace(const struct ape__exec_req *r, struct worker *w)
{
	struct ape__trace_dev *t = ape__malloc(sizeof(*t) * (size_t)r->ndev);
	int ret;

	if (!t)
		return ape__error(APE_ENOMEM, "%s: out of memory writing the trace", r->fn);
	for (int d = 0; d < r->ndev; d++)
		t[d] = w[d].trace;
	ret = ape__trace_write(r->trace_path, r->fn, t, r->ndev);
	free(t);
	return ret;
}

/* ------------------------------------------------------------------ one thread per device */

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

/* ------------------------------------------------------------------ the call */

int ape__exec_run(const struct ape__exec_req *r, struct ape__exec_result *res)
{
	struct ape__plan plans[APE_MAX_DEVICES];
	uint64_t budgets[APE_MAX_DEVICES];
	struct plan_arg pa[APE_MAX_DEVICES];
	struct ape__workq wq;
	struct shared sh;
	struct worker *w;
	int ret;

	memset(res, 0, sizeof(*res));
	w = ape__calloc((size_t)r->ndev, sizeof(*w));
	if (!w)
		return ape__error(APE_ENOMEM, "%s: out of memory", r->fn);
	res->budget = UINT64_MAX;
	for (int d = 0; d < r->ndev; d++) {
		budgets[d] = r->budget ? r->budget : ape__default_budget(r->devs[d]);
		res->budget = budgets[d] < res->budget ? budgets[d] : res->budget;
		pa[d] = (struct plan_arg){ r, r->devs[d], r->passes[d],
					   !r->copy_inputs && ape_be_caps_have(&r->devs[d]->caps, APE_BE_CAP_HOST_MEMORY) };
	}
	if ((ret = plan_all(r, plans, budgets, pa)))
		goto out_free;
	for (int d = 0; d < r->ndev && !ret; d++)
		ret = r->prepare ? r->prepare(r->prepare_arg, &plans[d], d) : 0;
	if (ret)
		goto out_free;
	res->cq = r->passes[0]->outer == APE__AXIS_Q ? plans[0].co : plans[0].ci;
	res->ck = r->passes[0]->outer == APE__AXIS_Q ? plans[0].ci : plans[0].co;
	res->no = plans[0].no;
	res->depth = plans[0].depth;
	ape__workq_init(&wq);
	if ((ret = split_work(r, &plans[0], &wq)))
		goto out_fini_wq;

	memset(&sh, 0, sizeof(sh));
	sh.r = r;
	sh.t0 = ape__now_ms();
	atomic_init(&sh.abort, false);
	for (int d = 0; d < r->ndev; d++) {
		w[d].sh = &sh;
		w[d].who = d;
		w[d].tracing = r->trace_path != NULL || ape__strace_on();
		ape__trace_label(&w[d].trace, r->devs, d);
		w[d].geom = (struct ape__stream_geom){
			.plan = plans[d], .shape = *r->passes[d], .budget = budgets[d],
		};
		w[d].call = (struct ape__stream_call){
			.pass = r->passes[d], .Lq = r->Lq, .Lk = r->Lk,
			.co = plans[d].co, .ci = plans[d].ci, .no = plans[d].no,
			.ni = plans[d].ni, .in_place = pa[d].in_place,
			.host_tables = pa[d].in_place,
			.poison = r->devs[d]->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS,
			.wq = &wq, .abort = &sh.abort,
		};
		res->depth = plans[d].depth < res->depth ? plans[d].depth : res->depth;
	}
	ret = run_workers(&sh, w);
	for (int d = 0; d < r->ndev; d++) {
		sum_stats(&res->st, &w[d].st);
		res->devices += w[d].st.outer_done > 0;
		res->outer_by_dev[d] = w[d].st.outer_done;
	}
	res->st.device_clock = w[0].st.device_clock;
	for (int d = 0; d < r->ndev; d++) /* the kernel paths, for the traces' kernel spans */
		if (r->passes[d]->paths)
			ape__path_names(w[d].trace.path, sizeof(w[d].trace.path),
					r->passes[d]->paths);
	if (ape__strace_on()) /* the session trace: what ran, failed or not */
		for (int d = 0; d < r->ndev; d++)
			ape__trace_to_session(&w[d].trace);
	if (!ret) {
		note_speeds(r, w);
		if (r->trace_path)
			ret = write_trace(r, w);
	}
	for (int d = 0; d < r->ndev; d++)
		ape__trace_free(&w[d].trace);
out_fini_wq:
	ape__workq_fini(&wq);
out_free:
	free(w);
	return ret;
}
