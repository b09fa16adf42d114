/* SPDX-License-Identifier: MIT */
/* ape_stats: its initialiser, its check and its one builder (api/stats.h). */
#include "api/stats.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/clock.h"
#include "core/context.h"
#include "core/error.h"
#include "core/strace.h"
#include "core/verbose.h"


void ape_stats_init(ape_stats *st)
{
	if (!st)
		return;
	memset(st, 0, sizeof(*st));
	st->struct_size = sizeof(*st);
}

int ape__stats_check(const char *fn, const ape_stats *stats)
{
	if (stats && stats->struct_size != sizeof(*stats) &&
	    stats->struct_size != APE_STATS_V1_SIZE && stats->struct_size != APE_STATS_V2_SIZE)
		return ape__error(APE_EINVAL,
				  "%s: stats->struct_size = %zu: expected %zu (initialise with "
				  "ape_stats_init())",
				  fn, stats->struct_size, sizeof(*stats));
	return 0;
}

/* Backends and device names, each once, in device order. */
static void names(ape_stats *st, ape_device *const *devs, int ndev)
{
	size_t nb = 0, nd = 0;

	st->backend[0] = st->device[0] = '\0';
	for (int i = 0; i < ndev; i++) {
		bool seen_be = false, seen_dev = false;

		for (int j = 0; j < i; j++) {
			seen_be |= !strcmp(devs[j]->info.backend, devs[i]->info.backend);
			seen_dev |= devs[j] == devs[i];
		}
		if (!seen_be && nb < sizeof(st->backend))
			nb += (size_t)snprintf(st->backend + nb, sizeof(st->backend) - nb, "%s%s",
					       nb ? "+" : "", devs[i]->info.backend);
		if (!seen_dev && nd < sizeof(st->device))
			nd += (size_t)snprintf(st->device + nd, sizeof(st->device) - nd, "%s%s",
					       nd ? " + " : "", devs[i]->info.name);
	}
}

void ape__stats_report(ape_stats *stats, const struct ape__call_report *r)
{
	const struct ape__exec_result *res = r->res;
	ape_stats st;

	ape_stats_init(&st);
	st.pairs_visible = r->pairs_visible;
	st.pairs_computed = res->pairs_computed;
	st.kernel_ms = res->st.kernel_ms;
	st.bytes_to_device = res->st.h2d;
	st.bytes_from_device = res->st.d2h;
	st.bytes_device_to_device = res->st.d2d;
	names(&st, r->devs, r->ndev);
	st.chunks = res->st.chunks;
	st.chunks_skipped = res->chunks_skipped;
	st.chunk_q = res->cq;
	st.chunk_k = res->ck;
	st.pipeline_depth = res->depth;
	st.devices = r->devices;
	st.device_budget = res->budget;
	st.peak_device_bytes = res->st.peak_bytes;
	st.copy_ms = res->st.copy_ms;
	st.overlap_ms = res->st.overlap_ms;
	ape__path_names(st.path, sizeof(st.path), &res->paths);
	st.total_ms = ape__now_ms() - r->t0;
	/* what the caller's version of ape_stats has room for */
	st.struct_size = stats->struct_size;
	memcpy(stats, &st, stats->struct_size);
}

/* ------------------------------------------------------------------ the call log */


bool ape__call_logs(ape_device *const *devs, int ndev)
{
	if (ape__strace_on())
		return true;
	for (int d = 0; d < ndev; d++)
		if (ape__dev_verbose(devs[d]) > 0)
			return true;
	return false;
}

static int call_level(ape_device *const *devs, int ndev)
{
	int level = 0;

	for (int d = 0; d < ndev; d++)
		if (ape__dev_verbose(devs[d]) > level)
			level = ape__dev_verbose(devs[d]);
	return level;
}

/* The heads whose lambda is not 0 (what keeps them off the separable path), as ranges:
 * "0-5", "2, 4-7", or "none". */
static void lambda_heads(const struct ape__problem *p, char *buf, size_t cap)
{
	size_t n = 0;

	buf[0] = '\0';
	for (int64_t h = 0; h < p->H && n < cap;) {
		int64_t e = h;
		int k;

		if (p->head_params[4 * h + 3] == 0) {
			h++;
			continue;
		}
		while (e + 1 < p->H && p->head_params[4 * (e + 1) + 3] != 0)
			e++;
		k = e > h ? snprintf(buf + n, cap - n, "%s%lld-%lld", n ? ", " : "", (long long)h,
				     (long long)e)
			  : snprintf(buf + n, cap - n, "%s%lld", n ? ", " : "", (long long)h);
		n = k < 0 ? cap : n + (size_t)k;
		h = e + 1;
	}
	if (!buf[0])
		snprintf(buf, cap, "none");
}

/* Why skipping is on or off for the call's problem. */
static const char *skip_why(const struct ape__problem *p)
{
	if (!(p->skip_tol > 0))
		return "off: skip_tol = 0";
	if (!p->decay_nonneg)
		return "off: a head has delta, beta or gamma < 0 (the far-key bound needs them >= 0)";
	return "on: the far-key bound (delta, beta, gamma >= 0 on every head)";
}

/* A growing line (the call log's): appends as snprintf does, never past cap. */
struct line {
	char buf[3072];
	size_t n;
};

static void put(struct line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct line *l, const char *fmt, ...)
{
	va_list ap;
	int k;

	if (l->n >= sizeof(l->buf) - 1)
		return;
	va_start(ap, fmt);
	k = vsnprintf(l->buf + l->n, sizeof(l->buf) - l->n, fmt, ap);
	va_end(ap);
	if (k > 0)
		l->n = l->n + (size_t)k < sizeof(l->buf) ? l->n + (size_t)k : sizeof(l->buf) - 1;
}

static void device_names(struct line *l, const struct ape__call_log *r, bool json)
{
	for (int d = 0; d < r->ndev; d++) {
		char name[256], esc[512];

		snprintf(name, sizeof(name), "%s:%d %s", r->devs[d]->info.backend,
			 r->devs[d]->info.backend_index, r->devs[d]->info.name);
		if (json) {
			ape__json_escape(esc, sizeof(esc), name);
			put(l, "%s\"%s\"", d ? "," : "", esc);
		} else {
			put(l, "%s%s", d ? " + " : "", name);
		}
	}
}

static void log_text(const struct ape__call_log *r, int level)
{
	const struct ape__problem *p = r->p;
	const ape_stats *st = r->st;
	const struct ape_be_path_log *pl = r->paths;
	struct line l = { .n = 0 };

	put(&l, "%s: ", r->fn);
	device_names(&l, r, false);
	if (p)
		put(&l, " | B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld %s->%s%s",
		    (long long)p->B, (long long)p->H, (long long)p->Hkv, (long long)p->Lq,
		    (long long)p->Lk, (long long)p->D, ape_dtype_name(p->in_dtype),
		    ape_dtype_name(p->out_dtype), p->causal ? " causal" : "");
	if (r->ret) {
		put(&l, " | error: %s", ape_last_error());
		ape__vlog("%s", l.buf);
		ape__api_logged();
		return;
	}
	put(&l, " | path:");
	if (!st->path[0])
		put(&l, " none (no kernel ran)");
	else if (!pl)
		put(&l, " %s", st->path);
	for (int i = 0; pl && i < APE_BE_PATH_COUNT; i++)
		if (pl->launches[i])
			put(&l, " %s x%u (%s)", ape_be_path_name((enum ape_be_path)i), pl->launches[i],
			    pl->why[i] ? pl->why[i] : "");
	if (p && p->head_params) {
		char heads[128];

		lambda_heads(p, heads, sizeof(heads));
		put(&l, " | lambda != 0 on heads %s", heads);
	}
	if (p)
		put(&l, " | skip %s", skip_why(p));
	if (r->async) {
		put(&l, " | enqueued in %.3f ms (asynchronous: the kernels run after the call)",
		    st->total_ms);
		ape__vlog("%s", l.buf);
		return;
	}
	if (r->pairs_uncounted)
		put(&l, " | pairs ? of %llu (counted only for calls that ask for statistics)",
		    (unsigned long long)st->pairs_visible);
	else
		put(&l, " | pairs %llu of %llu (%.1f%%)", (unsigned long long)st->pairs_computed,
		    (unsigned long long)st->pairs_visible,
		    st->pairs_visible
			    ? 100.0 * (double)st->pairs_computed / (double)st->pairs_visible
			    : 0.0);
	put(&l, " | chunks %llu, %llu skipped | %.3f ms wall, %.3f ms kernel",
	    (unsigned long long)st->chunks, (unsigned long long)st->chunks_skipped, st->total_ms,
	    st->kernel_ms);
	ape__vlog("%s", l.buf);
	if (level < 2)
		return;
	l.n = 0;
	put(&l, "%s: plan: chunks of %lld x %lld rows, %d in flight, %d device(s) took part; "
		"budget ",
	    r->fn, (long long)st->chunk_q, (long long)st->chunk_k, st->pipeline_depth,
	    st->devices);
	if (st->device_budget == UINT64_MAX)
		put(&l, "none");
	else
		put(&l, "%llu bytes", (unsigned long long)st->device_budget);
	put(&l, ", peak %llu bytes; copied %llu bytes in, %llu out, %llu within (%.3f ms, %.3f ms "
		"overlapping kernels)",
	    (unsigned long long)st->peak_device_bytes, (unsigned long long)st->bytes_to_device,
	    (unsigned long long)st->bytes_from_device,
	    (unsigned long long)st->bytes_device_to_device, st->copy_ms, st->overlap_ms);
	for (int d = 0; r->shares && d < r->ndev; d++)
		put(&l, "%s%lld", d ? " + " : "; outer chunks per device: ",
		    (long long)r->shares[d]);
	if (p && r->pairs_uncounted) /* visible - 0 would claim every pair left out */
		put(&l, "; skip_tol %g: %llu chunk pairs left out whole by the far-key bound, the "
			"pairs left out inside the launches not counted",
		    p->skip_tol, (unsigned long long)st->chunks_skipped);
	else if (p)
		put(&l, "; skip_tol %g: %llu chunk pairs left out whole by the far-key bound, %llu "
			"pairs left out inside the launches",
		    p->skip_tol, (unsigned long long)st->chunks_skipped,
		    (unsigned long long)(st->pairs_visible - st->pairs_computed));
	ape__vlog("%s", l.buf);
}

/* The call's JSON object (the line's text at APE_VERBOSE_FORMAT=json, and the session trace's
 * span arguments) into l. */
static void build_json(struct line *l, const struct ape__call_log *r, int level);

static void log_json(const struct ape__call_log *r, int level)
{
	struct line l = { .n = 0 };

	build_json(&l, r, level);
	ape__vlog("%s", l.buf);
	if (r->ret)
		ape__api_logged();
}

static void build_json(struct line *out, const struct ape__call_log *r, int level)
{
	const struct ape__problem *p = r->p;
	const ape_stats *st = r->st;
	const struct ape_be_path_log *pl = r->paths;
	struct line *l = out;
	bool first = true;

	put(l, "{\"call\":\"%s\",\"devices\":[", r->fn);
	device_names(l, r, true);
	put(l, "]");
	if (p)
		put(l, ",\"B\":%lld,\"H\":%lld,\"Hkv\":%lld,\"Lq\":%lld,\"Lk\":%lld,\"D\":%lld,"
			"\"dtype\":\"%s\",\"out_dtype\":\"%s\",\"causal\":%s",
		    (long long)p->B, (long long)p->H, (long long)p->Hkv, (long long)p->Lq,
		    (long long)p->Lk, (long long)p->D, ape_dtype_name(p->in_dtype),
		    ape_dtype_name(p->out_dtype), p->causal ? "true" : "false");
	if (r->ret) {
		char msg[2048];

		ape__json_escape(msg, sizeof(msg), ape_last_error());
		put(l, ",\"error\":\"%s\",\"code\":\"%s\"}", msg, ape_err_name(r->ret));
		return;
	}
	put(l, ",\"path\":\"%s\",\"paths\":[", st->path);
	for (int i = 0; pl && i < APE_BE_PATH_COUNT; i++) {
		char why[256];

		if (!pl->launches[i])
			continue;
		ape__json_escape(why, sizeof(why), pl->why[i] ? pl->why[i] : "");
		put(l, "%s{\"path\":\"%s\",\"launches\":%u,\"why\":\"%s\"}", first ? "" : ",",
		    ape_be_path_name((enum ape_be_path)i), pl->launches[i], why);
		first = false;
	}
	put(l, "]");
	if (p && p->head_params) {
		char heads[128];

		lambda_heads(p, heads, sizeof(heads));
		put(l, ",\"lambda_nonzero_heads\":\"%s\"", heads);
	}
	if (p)
		put(l, ",\"skip\":\"%s\",\"skip_tol\":%.17g", skip_why(p), p->skip_tol);
	if (r->async) {
		put(l, ",\"async\":true,\"enqueue_ms\":%.6f}", st->total_ms);
		return;
	}
	put(l, ",\"pairs_visible\":%llu", (unsigned long long)st->pairs_visible);
	if (r->pairs_uncounted)
		put(l, ",\"pairs_computed\":null");
	else
		put(l, ",\"pairs_computed\":%llu", (unsigned long long)st->pairs_computed);
	put(l, ",\"chunks\":%llu,\"chunks_skipped\":%llu,\"wall_ms\":%.6f,\"kernel_ms\":%.6f",
	    (unsigned long long)st->chunks, (unsigned long long)st->chunks_skipped, st->total_ms,
	    st->kernel_ms);
	if (level >= 2) {
		put(l, ",\"chunk_q\":%lld,\"chunk_k\":%lld,\"pipeline_depth\":%d,\"devices_used\":%d",
		    (long long)st->chunk_q, (long long)st->chunk_k, st->pipeline_depth,
		    st->devices);
		if (st->device_budget == UINT64_MAX)
			put(l, ",\"budget\":null");
		else
			put(l, ",\"budget\":%llu", (unsigned long long)st->device_budget);
		put(l, ",\"peak_device_bytes\":%llu,\"bytes_to_device\":%llu,"
			"\"bytes_from_device\":%llu,\"bytes_device_to_device\":%llu,\"copy_ms\":%.6f,"
			"\"overlap_ms\":%.6f",
		    (unsigned long long)st->peak_device_bytes,
		    (unsigned long long)st->bytes_to_device,
		    (unsigned long long)st->bytes_from_device,
		    (unsigned long long)st->bytes_device_to_device, st->copy_ms, st->overlap_ms);
		for (int d = 0; r->shares && d < r->ndev; d++)
			put(l, "%s%lld", d ? "," : ",\"outer_chunks_per_device\":[",
			    (long long)r->shares[d]);
		if (r->shares && r->ndev > 0)
			put(l, "]");
	}
	put(l, "}");
}

void ape__call_log(const struct ape__call_log *r)
{
	const int level = call_level(r->devs, r->ndev);

	if (ape__strace_on() && ape__api_depth() <= 1) { /* the call's span says what it did */
		struct line l = { .n = 0 };

		build_json(&l, r, 2);
		ape__api_span_args(l.buf);
	}
	/* a public call inside another (a ragged call's pieces) is the outer call's detail */
	if (level <= 0 || (ape__api_depth() > 1 && level < 2))
		return;
	if (ape__verbose_json())
		log_json(r, level);
	else
		log_text(r, level);
}

void ape__call_log_async(const char *fn, ape_device *dev, const struct ape__problem *p,
			 int ret, const struct ape_be_path_log *paths, double t0)
{
	ape_stats st;

	if (!ape__call_logs(&dev, 1))
		return;
	ape_stats_init(&st);
	ape__path_names(st.path, sizeof(st.path), paths);
	st.total_ms = ape__now_ms() - t0;
	{
		const struct ape__call_log lg = {
			.fn = fn, .devs = &dev, .ndev = 1, .p = p, .ret = ret, .st = &st,
			.paths = paths, .async = true,
		};

		ape__call_log(&lg);
	}
}

void ape__call_done(ape_stats *stats, const struct ape__call_report *r)
{
	ape_stats st;

	if (!r->ret && stats)
		ape__stats_report(stats, r);
	if (!r->fn || !ape__call_logs(r->devs, r->ndev))
		return;
	ape_stats_init(&st);
	if (!r->ret)
		ape__stats_report(&st, r);
	{
		const struct ape__call_log lg = {
			.fn = r->fn, .devs = r->devs, .ndev = r->ndev, .p = r->p, .ret = r->ret,
			.st = &st, .paths = r->res ? &r->res->paths : NULL,
			.pairs_uncounted = r->pairs_uncounted,
			.shares = r->res && r->ndev > 1 ? r->res->outer_by_dev : NULL,
		};

		ape__call_log(&lg);
	}
}
