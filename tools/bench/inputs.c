/* SPDX-License-Identifier: MIT */
/* What ape-bench's modes share (tools/bench/bench.h): inputs, timed host calls, rows, reports. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"

double bench_median(double *x, int n)
{
	for (int i = 1; i < n; i++) /* insertion sort: n is small */
		for (int j = i; j > 0 && x[j - 1] > x[j]; j--) {
			double t = x[j];

			x[j] = x[j - 1];
			x[j - 1] = t;
		}
	return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

void bench_free_inputs(struct inputs *in)
{
	void *const held[] = { in->q,	 in->k,	 in->v,	 in->o,	 in->lse,
			       in->dout, in->dq, in->dk, in->dv, in->dparams };

	for (size_t i = 0; i < sizeof(held) / sizeof(held[0]); i++)
		free(held[i]);
}

static int fill_random(void *dst, ape_dtype dt, size_t n, ape_rng *rng)
{
	float buf[1024];

	for (size_t i = 0; i < n; i += 1024) {
		size_t m = n - i < 1024 ? n - i : 1024;

		for (size_t j = 0; j < m; j++)
			buf[j] = (float)ape_rng_normal(rng);
		if (ape_convert((char *)dst + i * ape_dtype_size(dt), dt, buf, APE_F32, m))
			return -1;
	}
	return 0;
}

/* A [B, heads, L, D] tensor of the storage type, uninitialised; NULL data when out of memory. */
static void *new_tensor(ape_tensor *t, const struct bench_opts *o, int64_t heads, int64_t L)
{
	void *p = malloc((size_t)(o->B * heads * L * o->D) * ape_dtype_size(o->dtype) + 1);

	ape_tensor_init(t, p, o->dtype, o->B, heads, L, o->D);
	return p;
}

static int fill_tensor(const ape_tensor *t, ape_rng *rng)
{
	const int64_t *s = t->shape;

	return fill_random(t->data, t->dtype, (size_t)(s[0] * s[1] * s[2] * s[3]), rng);
}

/* --backward: a random dO and room for every gradient. */
static int make_grads(const struct bench_opts *o, int64_t L, int64_t Lq, ape_rng *rng,
		      struct inputs *in)
{
	in->dout = new_tensor(&in->tdout, o, o->H, Lq);
	in->dq = new_tensor(&in->tdq, o, o->H, Lq);
	in->dk = new_tensor(&in->tdk, o, o->Hkv, L);
	in->dv = new_tensor(&in->tdv, o, o->Hkv, L);
	in->dparams = malloc(sizeof(float) * 4 * (size_t)o->H);
	if (!in->dout || !in->dq || !in->dk || !in->dv || !in->dparams ||
	    fill_tensor(&in->tdout, rng)) {
		bench_free_inputs(in);
		return APE_ENOMEM;
	}
	return 0;
}

int bench_make_inputs(const struct bench_opts *o, int64_t L, int64_t Lq, ape_rng *rng,
		      struct inputs *in)
{
	memset(in, 0, sizeof(*in));
	in->q = new_tensor(&in->tq, o, o->H, Lq);
	in->k = new_tensor(&in->tk, o, o->Hkv, L);
	in->v = new_tensor(&in->tv, o, o->Hkv, L);
	in->o = new_tensor(&in->to, o, o->H, Lq);
	in->lse = malloc(sizeof(float) * (size_t)(o->B * o->H * Lq) + 1);
	if (!in->q || !in->k || !in->v || !in->o || !in->lse || fill_tensor(&in->tq, rng) ||
	    fill_tensor(&in->tk, rng) || fill_tensor(&in->tv, rng)) {
		bench_free_inputs(in);
		return APE_ENOMEM;
	}
	return o->backward ? make_grads(o, L, Lq, rng, in) : 0;
}

void bench_desc(const struct bench_opts *o, double skip_tol, ape_attn_desc *desc)
{
	ape_attn_desc_init(desc);
	desc->delta.value = o->delta;
	desc->beta.value = o->beta;
	desc->gamma.value = o->gamma;
	desc->lambda.value = o->lambda;
	desc->causal = o->causal;
	desc->skip_tol = skip_tol;
}

/*
 * Every (L, skip_tol) of o in order through `one`, into rows of `size` bytes each whose
 * refcheck_result lies at byte `check_at`; *bad counts the rows out of tolerance; `done` (or
 * NULL) sees each row as it comes. 0, or the first failure (*n rows done before it).
 */
static int run_rows(ape_device *dev, ape_device *ref, const struct bench_opts *o, ape_rng *rng,
		    row_fn one, void *rows, size_t size, size_t check_at,
		    void (*done)(const struct bench_opts *o, const void *row), int *n, int *bad)
{
	int ret = 0;

	*n = *bad = 0;
	for (int i = 0; i < o->nL && !ret; i++)
		for (int j = 0; j < o->nskip && !ret; j++) {
			char *row = (char *)rows + (size_t)*n * size;
			const struct refcheck_result *c = (const void *)(row + check_at);

			ret = one(dev, ref, o, o->L[i], o->skip[j], rng, row);
			if (ret)
				break;
			*bad += c->rows_checked && !c->within_tol;
			if (done)
				done(o, row);
			(*n)++;
		}
	return ret;
}

void bench_summarize(double *t, int n, double *med, double *min, double *max)
{
	*med = bench_median(t, n);
	*min = t[0];
	*max = t[n - 1];
}

static int time_host_calls(ape_device *dev, const struct bench_opts *o, const ape_attn_desc *desc,
			   struct inputs *in, struct host_times *ht)
{
	const int n = o->repeats > 1024 ? 1024 : o->repeats;
	double times[1024], kernel[1024], btimes[1024], bkernel[1024], ratio[1024];
	int ret = 0;

	memset(ht, 0, sizeof(*ht));
	for (int i = 0; i < o->warmup + n && !ret; i++) {
		ape_stats_init(&ht->last);
		ape_stats_init(&ht->bwd_last);
		ret = ape_attention_forward(dev, desc, &in->tq, &in->tk, &in->tv, &in->to, in->lse,
					    &ht->last);
		if (!ret && o->backward)
			ret = ape_attention_backward(dev, desc, &in->tq, &in->tk, &in->tv, &in->to,
						     in->lse, &in->tdout, NULL, &in->tdq, &in->tdk,
						     &in->tdv, in->dparams, &ht->bwd_last);
		if (!ret && i >= o->warmup) {
			times[i - o->warmup] = ht->last.total_ms;
			kernel[i - o->warmup] = ht->last.kernel_ms;
			btimes[i - o->warmup] = ht->bwd_last.total_ms;
			bkernel[i - o->warmup] = ht->bwd_last.kernel_ms;
			ratio[i - o->warmup] = ht->last.total_ms > 0
						       ? ht->bwd_last.total_ms / ht->last.total_ms
						       : 0;
		}
	}
	if (ret)
		return ret;
	bench_summarize(times, n, &ht->median_ms, &ht->min_ms, &ht->max_ms);
	ht->kernel_ms = bench_median(kernel, n);
	if (o->backward) {
		bench_summarize(btimes, n, &ht->bwd_median_ms, &ht->bwd_min_ms, &ht->bwd_max_ms);
		ht->bwd_kernel_ms = bench_median(bkernel, n);
		ht->ratio = bench_median(ratio, n);
	}
	return 0;
}

int bench_host_row(ape_device *dev, const struct bench_opts *o, int64_t L, double skip_tol,
		   ape_rng *rng, struct row_key *key, struct inputs *in, ape_attn_desc *desc,
		   struct host_times *ht)
{
	const int64_t Lq = o->Lq && o->Lq < L ? o->Lq : L;
	int ret = bench_make_inputs(o, L, Lq, rng, in);

	if (ret)
		return ret;
	*key = (struct row_key){ L, Lq, skip_tol };
	bench_desc(o, skip_tol, desc);
	ret = time_host_calls(dev, o, desc, in, ht);
	if (ret)
		bench_free_inputs(in);
	return ret;
}

int bench_mode_run(ape_device *dev, ape_device *ref, const struct bench_opts *o, ape_rng *rng,
		   const struct bench_mode *m, void *rows)
{
	ape_device_info info;
	int n, bad, ret;

	ape_device_get_info(dev, &info);
	ret = run_rows(dev, ref, o, rng, m->one, rows, m->row_size, m->check_at,
		       o->json ? NULL : m->done, &n, &bad);
	if (ret)
		return bench_failed(ret);
	(o->json ? m->json : m->table)(&info, o, rows, n);
	return bad ? 1 : 0;
}

void bench_table_head(const char *mode, const ape_device_info *info, const struct bench_opts *o)
{
	printf("ape-bench%s: %s:%d %s (%s)\n", mode, info->backend, info->backend_index,
	       info->name, info->driver_version);
	printf("shape B=%" PRId64 " H=%" PRId64 " Hkv=%" PRId64 " D=%" PRId64 " %s %s", o->B, o->H,
	       o->Hkv, o->D, ape_dtype_name(o->dtype), o->causal ? "causal" : "non-causal");
}

void bench_json_head(const ape_device_info *info, const struct bench_opts *o)
{
	printf("{\"device\": {\"backend\": \"%s\", \"index\": %d, \"name\": \"%s\", \"driver\": "
	       "\"%s\"},\n",
	       info->backend, info->backend_index, info->name, info->driver_version);
	printf(" \"shape\": {\"B\": %" PRId64 ", \"H\": %" PRId64 ", \"Hkv\": %" PRId64
	       ", \"D\": %" PRId64 ", \"dtype\": \"%s\", \"causal\": %s},\n",
	       o->B, o->H, o->Hkv, o->D, ape_dtype_name(o->dtype), o->causal ? "true" : "false");
}

void bench_print_check(const struct refcheck_result *c, int width)
{
	if (c->rows_checked)
		printf(" %*.2e %*.2e", width, c->max_err_o, width, c->max_err_lse);
	else
		printf(" %*s %*s", width, "-", width, "-");
}

const char *bench_tol_note(const struct refcheck_result *c)
{
	return !c->rows_checked || c->within_tol ? "" : "  OUT OF TOLERANCE";
}

const char *bench_json_within_tol(const struct refcheck_result *c)
{
	return c->within_tol || !c->rows_checked ? "true" : "false";
}

int bench_failed(int ret)
{
	fprintf(stderr, "ape-bench: %s\n", ape_last_error());
	return ret == APE_EINVAL || ret == APE_EOVERFLOW ? 2 : ret == APE_ENOTSUP ? 3 : 1;
}
