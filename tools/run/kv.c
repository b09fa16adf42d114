/* SPDX-License-Identifier: MIT */
/*
 * ape-run --kv-cache: the queries attend in steps through an ape_kv_cache, each step's keys
 * (everything up to its last query's position) appended just before it, as a decoder runs.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "run/run.h"

/* One run through the cache: where it stands between steps. */
struct kv_run {
	const struct run_args *a;
	ape_kv_cache *cache;
	const ape_tensor *q, *k, *v;
	ape_tensor *ot;
	float *lse; /* the caller's, [B, H, Lq]; NULL: not wanted */
	float *step_lse; /* one step's, [B, H, n] */
	float *ent, *md; /* the caller's diagnostics, [B, H, Lq]; NULL: not wanted */
	float *step_ent, *step_md; /* one step's, [B, H, n] */
	int64_t q_start; /* position of query row 0 */
	int64_t appended; /* key rows in the cache */
	ape_stats *tot;
};

/* Largest Euclidean norm of a query row: the bound --kv-release promises the cache. */
static double max_query_norm(const ape_tensor *q)
{
	const int64_t *s = q->shape;
	float row[APE_MAX_D];
	double m = 0;

	for (int64_t r = 0; r < s[0] * s[1] * s[2]; r++) {
		double ss = 0;

		ape_convert(row, APE_F32, (const char *)q->data + (size_t)(r * s[3]) *
							 ape_dtype_size(q->dtype),
			    q->dtype, (size_t)s[3]);
		for (int64_t d = 0; d < s[3]; d++)
			ss += (double)row[d] * row[d];
		m = ss > m ? ss : m;
	}
	return sqrt(m) * (1 + 1e-6) + 1e-30;
}

/* The cache for the whole run: room for every key unless --kv-capacity says otherwise. */
static void kv_options(const struct run_args *a, const ape_tensor *q, const ape_tensor *k,
		       ape_kv_cache_options *o)
{
	const int64_t Lk = k->shape[2];

	ape_kv_cache_options_init(o);
	o->B = q->shape[0];
	o->H = q->shape[1];
	o->Hkv = k->shape[1];
	o->D = q->shape[3];
	o->dtype = q->dtype;
	o->block_tokens = a->kv_block;
	o->capacity_tokens = a->kv_capacity ? a->kv_capacity : Lk > 0 ? Lk : 1;
	o->k_start = a->desc.k_start;
	o->max_queries = a->kv_step;
	o->attend_chunk = a->chunk;
	o->max_device_bytes = a->max_mem;
	o->allow_release = a->kv_release;
	o->max_query_norm = max_query_norm(q);
}

/* Appends the keys at or before position `last` (key j sits at k_start + j) not yet cached. */
static int kv_append_until(struct kv_run *r, int64_t last)
{
	const int64_t Lk = r->k->shape[2];
	int64_t want = last + 1 - r->a->desc.k_start;
	ape_tensor kt, vt;
	int ret;

	want = want < 0 ? 0 : want > Lk ? Lk : want;
	if (want <= r->appended)
		return 0;
	ret = ape_tensor_rows(r->k, r->appended, want - r->appended, &kt);
	ret = ret ? ret : ape_tensor_rows(r->v, r->appended, want - r->appended, &vt);
	ret = ret ? ret : ape_kv_cache_append(r->cache, &kt, &vt);
	r->appended = want;
	return ret;
}

/* Step of n queries from row i: its keys appended, then it attends; its LSE rows copied out. */
static int kv_step(struct kv_run *r, int64_t i, int64_t n)
{
	const int64_t BH = r->q->shape[0] * r->q->shape[1], Lq = r->q->shape[2];
	ape_attn_desc d = r->a->desc;
	ape_tensor qt, o_rows;
	ape_stats st;
	int ret;

	ret = ape_tensor_rows(r->q, i, n, &qt);
	ret = ret ? ret : ape_tensor_rows(r->ot, i, n, &o_rows);
	ret = ret ? ret : kv_append_until(r, r->q_start + i + n - 1);
	if (ret)
		return ret;
	d.q_start_set = true;
	d.q_start = r->q_start + i;
	ape_stats_init(&st);
	ret = r->ent || r->md ? ape_kv_cache_attend_diag(r->cache, &d, &qt, &o_rows, r->step_lse,
							 r->step_ent, r->step_md, &st)
			      : ape_kv_cache_attend(r->cache, &d, &qt, &o_rows, r->step_lse, &st);
	if (ret)
		return ret;
	for (int64_t bh = 0; bh < BH; bh++) {
		const size_t at = (size_t)(bh * Lq + i), from = (size_t)(bh * n);

		if (r->lse)
			memcpy(r->lse + at, r->step_lse + from, (size_t)n * sizeof(float));
		if (r->ent)
			memcpy(r->ent + at, r->step_ent + from, (size_t)n * sizeof(float));
		if (r->md)
			memcpy(r->md + at, r->step_md + from, (size_t)n * sizeof(float));
	}
	run_stats_add(r->tot, &st);
	return 0;
}

int run_kv(const struct run_args *a, ape_device *dev, const struct input in[3], ape_tensor *ot,
	   float *lse, float *ent, float *md, ape_stats *tot, char *msg, size_t len)
{
	struct kv_run r = { .a = a, .q = &in[0].t, .k = &in[1].t, .v = &in[2].t, .ot = ot,
			    .lse = lse, .ent = ent, .md = md, .tot = tot };
	const int64_t Lq = r.q->shape[2], Lk = r.k->shape[2];
	struct timespec t0, t1;
	ape_kv_cache_options o;
	int ret;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	r.q_start = a->desc.q_start_set ? a->desc.q_start : a->desc.k_start + Lk - Lq;
	kv_options(a, r.q, r.k, &o);
	r.step_lse = malloc(sizeof(float) * (size_t)(o.B * o.H * a->kv_step));
	r.step_ent = malloc(sizeof(float) * (size_t)(o.B * o.H * a->kv_step));
	r.step_md = malloc(sizeof(float) * (size_t)(o.B * o.H * a->kv_step));
	if (!r.step_lse || !r.step_ent || !r.step_md) {
		free(r.step_lse);
		free(r.step_ent);
		free(r.step_md);
		snprintf(msg, len, "out of memory");
		return RUN_FAIL;
	}
	ret = ape_kv_cache_create(dev, &o, &r.cache);
	for (int64_t i = 0; !ret && i < Lq; i += a->kv_step)
		ret = kv_step(&r, i, i + a->kv_step <= Lq ? a->kv_step : Lq - i);
	if (ret)
		snprintf(msg, len, "%s", ape_last_error());
	ape_kv_cache_destroy(r.cache);
	free(r.step_lse);
	free(r.step_ent);
	free(r.step_md);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	tot->total_ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 +
			(double)(t1.tv_nsec - t0.tv_nsec) * 1e-6;
	return run_call_exit_code(a, ret);
}
