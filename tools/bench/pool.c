/* SPDX-License-Identifier: MIT */
/*
 * ape-bench --pool S (tools/bench/bench.h): for each -L, S sequences of lengths from 256 (or L
 * when shorter) to L, in geometric or even steps (--spread), ascending, all appended to one
 * ape_kv_pool of --page-tokens pages; then one decode step of all of them, one query row per
 * sequence at the end of its keys, as one ape_kv_pool_attend() call, against the same step as
 * S ape_kv_cache_attend() calls, one cache per sequence holding the same keys (what a serving
 * loop does without a pool); timed in alternating rounds after the warm-up. The pool's rows are
 * checked against the caches'.
 *
 * A decode step is a read of the keys and values in reach: its figure of merit is the bytes it
 * must read, 2 * keys * Hkv * D * dtype size over the keys its attends computed (pairs_computed
 * of the warm-up's ape_stats over the H / Hkv query heads that share a key head: under decay
 * with skipping, the keys out of reach are never read and not counted), per second of step.
 */
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench.h"

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

struct pool_row {
	int64_t L, lo, tokens; /* the longest and shortest sequence, their keys in all */
	double skip_tol;
	double pool_ms, pool_min, pool_max, each_ms, each_min, each_max; /* the step's times */
	uint64_t pairs, each_pairs; /* pairs computed by a step: the pool's, the caches' */
	uint64_t pool_dev, each_dev; /* device bytes held: the pool, the caches together */
	int64_t pages_used;
	double max_diff; /* the pool's rows against the caches', of max|V| */
	bool said; /* a failure of the row's own, already reported */
};

/* A row's state: the packed keys, values (len[s] rows of sequence s from cu[s]), queries (row s
 * of sequence s), the two outputs, the pool and the caches. */
struct pool_bufs {
	void *k, *v, *q, *o, *o2;
	int64_t *len, *cu, *ids;
	ape_kv_pool *pool;
	ape_kv_cache **caches;
	int64_t S;
};

static void pool_free(struct pool_bufs *b)
{
	void *const p[] = { b->k, b->v, b->q, b->o, b->o2, b->len, b->cu, b->ids };

	ape_kv_pool_destroy(b->pool);
	for (int64_t s = 0; b->caches && s < b->S; s++)
		ape_kv_cache_destroy(b->caches[s]);
	free(b->caches);
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* S lengths from lo to L, ascending: geometric or even steps; their offsets into cu. */
static void pool_lengths(const struct bench_opts *o, int64_t L, int64_t lo, int64_t *len,
			 int64_t *cu)
{
	const int64_t S = o->pool;

	cu[0] = 0;
	for (int64_t s = 0; s < S; s++) {
		const double f = S > 1 ? (double)s / (double)(S - 1) : 1;

		const double x = o->spread_even ? (double)lo + f * (double)(L - lo)
						: (double)lo * pow((double)L / (double)lo, f);

		len[s] = (int64_t)llround(x);
		len[s] = len[s] < lo ? lo : len[s] > L ? L : len[s];
		cu[s + 1] = cu[s] + len[s];
	}
}

/* The pool and the caches, every sequence's keys and values appended to both. */
static int pool_fill(ape_device *dev, const struct bench_opts *o, const ape_tensor *t,
		     struct pool_bufs *b)
{
	const int64_t S = o->pool, pt = o->page_tokens ? o->page_tokens : 16;
	ape_kv_pool_options po;
	int64_t cap = 0;
	int ret;

	for (int64_t s = 0; s < S; s++)
		cap += (b->len[s] + pt - 1) / pt * pt;
	ape_kv_pool_options_init(&po);
	po.Hkv = o->Hkv;
	po.H = o->H;
	po.D = o->D;
	po.dtype = o->dtype;
	po.page_tokens = pt;
	po.capacity_tokens = cap;
	po.max_batch_tokens = S > 256 ? S : 256;
	if ((ret = ape_kv_pool_create(dev, &po, &b->pool)))
		return ret;
	for (int64_t s = 0; s < S; s++) {
		ape_kv_cache_options co;
		ape_tensor k, v;

		ape_kv_cache_options_init(&co);
		co.B = 1;
		co.Hkv = o->Hkv;
		co.H = o->H;
		co.D = o->D;
		co.dtype = o->dtype;
		co.capacity_tokens = b->len[s];
		if ((ret = ape_tensor_rows(&t[0], b->cu[s], b->len[s], &k)) ||
		    (ret = ape_tensor_rows(&t[1], b->cu[s], b->len[s], &v)) ||
		    (ret = ape_kv_pool_add_sequence(b->pool, 0, &b->ids[s])) ||
		    (ret = ape_kv_pool_append(b->pool, b->ids[s], &k, &v)) ||
		    (ret = ape_kv_cache_create(dev, &co, &b->caches[s])) ||
		    (ret = ape_kv_cache_append(b->caches[s], &k, &v)))
			return ret;
	}
	return 0;
}

/* The step through the pool: one query row per sequence, each at the end of its keys. */
static int run_pool(const struct pool_bufs *b, const ape_attn_desc *d, const ape_tensor *t,
		    ape_stats *st)
{
	int64_t *cq = b->cu + b->S + 1; /* 0, 1, ..., S */

	return ape_kv_pool_attend(b->pool, d, b->S, b->ids, cq, NULL, &t[2], (ape_tensor *)&t[3],
				  NULL, st);
}

/* The same step as one attend per cache, into t[4]; their pairs computed into *pairs (NULL:
 * not counted). */
static int run_each(const struct pool_bufs *b, const ape_attn_desc *d, const ape_tensor *t,
		    uint64_t *pairs)
{
	for (int64_t s = 0; s < b->S; s++) {
		ape_tensor q, o;
		ape_stats st;
		int ret;

		ape_stats_init(&st);
		if ((ret = ape_tensor_rows(&t[2], s, 1, &q)) ||
		    (ret = ape_tensor_rows(&t[4], s, 1, &o)) ||
		    (ret = ape_kv_cache_attend(b->caches[s], d, &q, &o, NULL, pairs ? &st : NULL)))
			return ret;
		if (pairs)
			*pairs += st.pairs_computed;
	}
	return 0;
}

/* The pool's rows against the caches', as a share of max|V| (INFINITY for a NaN). */
static double pool_diff(const struct bench_opts *o, const struct pool_bufs *b, int64_t T)
{
	const size_t n = (size_t)(b->S * o->H * o->D), nv = (size_t)(T * o->Hkv * o->D);
	float *x = malloc(n * sizeof(float) + 1), *y = malloc(n * sizeof(float) + 1);
	float *vv = malloc(nv * sizeof(float) + 1);
	double diff = INFINITY, vmax = 0;

	if (x && y && vv && !ape_convert(x, APE_F32, b->o, o->dtype, n) &&
	    !ape_convert(y, APE_F32, b->o2, o->dtype, n) &&
	    !ape_convert(vv, APE_F32, b->v, o->dtype, nv)) {
		diff = 0;
		for (size_t i = 0; i < nv; i++)
			vmax = fmax(vmax, fabs(vv[i]));
		for (size_t i = 0; i < n; i++)
			diff = fmax(diff, x[i] == y[i] ? 0 : fabs(x[i] - y[i]));
		diff = vmax > 0 ? diff / vmax : diff;
		diff = diff != diff ? INFINITY : diff;
	}
	free(x);
	free(y);
	free(vv);
	return diff;
}

static int pool_row(ape_device *dev, const struct bench_opts *o, int64_t L, double skip_tol,
		    ape_rng *rng, struct pool_row *r)
{
	const int64_t S = o->pool, H = o->H, Hkv = o->Hkv, D = o->D;
	const int n = o->repeats > 1024 ? 1024 : o->repeats;
	static double tp[1024], te[1024];
	struct pool_bufs b;
	ape_tensor t[5];
	ape_attn_desc desc;
	ape_kv_pool_info pi;
	ape_stats st;
	int64_t T;
	int ret = 0;

	memset(r, 0, sizeof(*r));
	memset(&b, 0, sizeof(b));
	r->L = L;
	r->lo = L < 256 ? L : 256;
	r->skip_tol = skip_tol;
	b.S = S;
	b.len = malloc((size_t)S * sizeof(int64_t));
	b.cu = malloc((size_t)(2 * S + 2) * sizeof(int64_t)); /* offsets of keys, then of rows */
	b.ids = malloc((size_t)S * sizeof(int64_t));
	b.caches = calloc((size_t)S, sizeof(*b.caches));
	r->said = true;
	if (!b.len || !b.cu || !b.ids || !b.caches) {
		pool_free(&b);
		fprintf(stderr, "ape-bench: out of memory for %" PRId64 " sequences\n", S);
		return APE_ENOMEM;
	}
	pool_lengths(o, L, r->lo, b.len, b.cu);
	for (int64_t s = 0; s <= S; s++)
		b.cu[S + 1 + s] = s;
	T = r->tokens = b.cu[S];
	if ((double)T * (double)(Hkv * D) * (double)ape_dtype_size(o->dtype) > 0x1p62) {
		pool_free(&b);
		fprintf(stderr, "ape-bench: --pool %" PRId64 " -L %" PRId64 ": %" PRId64
			" tokens in all, too many\n", S, L, T);
		return APE_EOVERFLOW;
	}
	b.k = ape_rng_array(rng, (size_t)(T * Hkv * D), o->dtype, NULL);
	b.v = ape_rng_array(rng, (size_t)(T * Hkv * D), o->dtype, NULL);
	b.q = ape_rng_array(rng, (size_t)(S * H * D), o->dtype, NULL);
	b.o = malloc((size_t)(S * H * D) * ape_dtype_size(o->dtype) + 1);
	b.o2 = malloc((size_t)(S * H * D) * ape_dtype_size(o->dtype) + 1);
	if (!b.k || !b.v || !b.q || !b.o || !b.o2) {
		pool_free(&b);
		fprintf(stderr, "ape-bench: out of memory for %" PRId64 " tokens\n", T);
		return APE_ENOMEM;
	}
	r->said = false;
	ape_tensor_init_packed(&t[0], b.k, o->dtype, T, Hkv, D);
	ape_tensor_init_packed(&t[1], b.v, o->dtype, T, Hkv, D);
	ape_tensor_init_packed(&t[2], b.q, o->dtype, S, H, D);
	ape_tensor_init_packed(&t[3], b.o, o->dtype, S, H, D);
	ape_tensor_init_packed(&t[4], b.o2, o->dtype, S, H, D);
	ape_stats_init(&st);
	ret = pool_fill(dev, o, t, &b);
	bench_desc(o, skip_tol, &desc);
	/* warm-up (program builds), counting the pairs each computes; then the check */
	for (int w = 0; w < (o->warmup > 0 ? o->warmup : 1) && !ret; w++) {
		ape_stats_init(&st);
		r->each_pairs = 0;
		ret = run_pool(&b, &desc, t, &st);
		if (!ret)
			ret = run_each(&b, &desc, t, &r->each_pairs);
	}
	r->pairs = st.pairs_computed;
	if (!ret)
		r->max_diff = pool_diff(o, &b, T);
	if (!ret && !(ret = ape_kv_pool_get_info(b.pool, &pi))) {
		r->pool_dev = pi.device_bytes;
		r->pages_used = pi.pages_used;
		for (int64_t s = 0; s < S && !ret; s++) {
			ape_kv_cache_info ci;

			ret = ape_kv_cache_get_info(b.caches[s], &ci);
			r->each_dev += ci.device_bytes;
		}
	}
	for (int i = 0; i < n && !ret; i++) {
		double t0 = now_ms();

		ret = run_pool(&b, &desc, t, NULL);
		tp[i] = now_ms() - t0;
		t0 = now_ms();
		if (!ret)
			ret = run_each(&b, &desc, t, NULL);
		te[i] = now_ms() - t0;
	}
	pool_free(&b);
	if (ret)
		return ret;
	bench_summarize(tp, n, &r->pool_ms, &r->pool_min, &r->pool_max);
	bench_summarize(te, n, &r->each_ms, &r->each_min, &r->each_max);
	return 0;
}

/* The K/V bytes a step read, from the pairs it computed (one per query head and key). */
static double kv_bytes(const struct bench_opts *o, uint64_t pairs)
{
	return 2.0 * (double)pairs / (double)(o->H / o->Hkv) * (double)o->D *
	       (double)ape_dtype_size(o->dtype);
}

static void pool_json(const ape_device_info *info, const struct bench_opts *o,
		      const struct pool_row *rows, int n, double tol)
{
	bench_json_head(info, o);
	printf(" \"pool\": %" PRId64 ", \"page_tokens\": %" PRId64 ", \"spread\": \"%s\", "
	       "\"membw_gbps\": ",
	       o->pool, o->page_tokens ? o->page_tokens : 16,
	       o->spread_even ? "even" : "geometric");
	if (o->membw > 0)
		printf("%.6g,\n", o->membw);
	else
		printf("null,\n");
	printf(" \"results\": [");
	for (int i = 0; i < n; i++) {
		const struct pool_row *r = &rows[i];
		const double bp = kv_bytes(o, r->pairs), be = kv_bytes(o, r->each_pairs);
		const double gp = bp / (r->pool_ms * 1e6), ge = be / (r->each_ms * 1e6);

		printf("%s\n  {\"L\": %" PRId64 ", \"shortest\": %" PRId64
		       ", \"sequences\": %" PRId64 ", \"tokens\": %" PRId64
		       ", \"skip_tol\": %.9g, \"step_ms\": %.6g, \"min_ms\": %.6g, "
		       "\"max_ms\": %.6g, \"tokens_per_s\": %.6g, \"pairs_computed\": %" PRIu64
		       ", \"kv_bytes_read\": %.17g, \"read_gbps\": %.6g",
		       i ? "," : "", r->L, r->lo, o->pool, r->tokens, r->skip_tol, r->pool_ms,
		       r->pool_min, r->pool_max, (double)o->pool / (r->pool_ms * 1e-3), r->pairs,
		       bp, gp);
		if (o->membw > 0)
			printf(", \"membw_fraction\": %.6g", gp / o->membw);
		printf(", \"pages_used\": %" PRId64 ", \"device_bytes\": %" PRIu64 ",\n   "
		       "\"caches\": {\"step_ms\": %.6g, \"min_ms\": %.6g, \"max_ms\": %.6g, "
		       "\"tokens_per_s\": %.6g, \"pairs_computed\": %" PRIu64
		       ", \"kv_bytes_read\": %.17g, \"read_gbps\": %.6g",
		       r->pages_used, r->pool_dev, r->each_ms, r->each_min, r->each_max,
		       (double)o->pool / (r->each_ms * 1e-3), r->each_pairs, be, ge);
		if (o->membw > 0)
			printf(", \"membw_fraction\": %.6g", ge / o->membw);
		printf(", \"device_bytes\": %" PRIu64 "},\n   \"pool_over_caches\": %.6g, "
		       "\"max_diff\": %.6g, \"within_tol\": %s}",
		       r->each_dev, r->pool_ms / r->each_ms, r->max_diff,
		       r->max_diff <= tol ? "true" : "false");
	}
	printf("\n ]}\n");
}

static void pool_table(const ape_device_info *info, const struct bench_opts *o,
		       const struct pool_row *rows, int n, double tol)
{
	bench_table_head(" --pool", info, o);
	printf("; delta=%g beta=%g gamma=%g lambda=%g\n", (double)o->delta, (double)o->beta,
	       (double)o->gamma, (double)o->lambda);
	printf("%" PRId64 " sequences, lengths from 256 (or L) to L in %s steps, in pages of "
	       "%" PRId64 " tokens; one query row each; %d repeats\n",
	       o->pool, o->spread_even ? "even" : "geometric",
	       o->page_tokens ? o->page_tokens : 16, o->repeats);
	printf("%7s %9s %10s %10s %10s %9s %8s", "L", "skip_tol", "tokens", "step_ms", "tokens/s",
	       "read_MiB", "GB/s");
	if (o->membw > 0)
		printf(" %7s", "membw%");
	printf(" %10s %10s %8s", "caches_ms", "tokens/s", "GB/s");
	if (o->membw > 0)
		printf(" %7s", "membw%");
	printf(" %9s %9s %9s\n", "pool/cch", "pool_MiB", "cache_MiB");
	for (int i = 0; i < n; i++) {
		const struct pool_row *r = &rows[i];
		const double bp = kv_bytes(o, r->pairs), be = kv_bytes(o, r->each_pairs);
		const double gp = bp / (r->pool_ms * 1e6), ge = be / (r->each_ms * 1e6);

		printf("%7" PRId64 " %9.3g %10" PRId64 " %10.3f %10.0f %9.1f %8.2f", r->L,
		       r->skip_tol, r->tokens, r->pool_ms, (double)o->pool / (r->pool_ms * 1e-3),
		       bp / 1048576, gp);
		if (o->membw > 0)
			printf(" %6.1f%%", 100 * gp / o->membw);
		printf(" %10.3f %10.0f %8.2f", r->each_ms, (double)o->pool / (r->each_ms * 1e-3),
		       ge);
		if (o->membw > 0)
			printf(" %6.1f%%", 100 * ge / o->membw);
		printf(" %8.2fx %9.1f %9.1f%s\n", r->pool_ms / r->each_ms,
		       (double)r->pool_dev / 1048576, (double)r->each_dev / 1048576,
		       r->max_diff <= tol ? "" : "  (differs from the caches)");
	}
	printf("tokens: keys of all sequences; tokens/s: sequences decoded per second (S / step)\n"
	       "read_MiB: K/V bytes the step reads (2 x keys computed x Hkv x D x %zu bytes)\n"
	       "GB/s: those bytes per second of step (10^9 B/s)\n"
	       "caches: the same step as one ape_kv_cache attend per sequence\n"
	       "pool/cch: step_ms / caches_ms; pool_MiB, cache_MiB: device memory held by the "
	       "pool,\nby the caches together%s\n",
	       ape_dtype_size(o->dtype),
	       o->membw > 0 ? "; membw%: GB/s as a share of --membw" : "");
}

int bench_pool(ape_device *dev, const struct bench_opts *o, ape_rng *rng)
{
	static struct pool_row rows[MAX_LIST * MAX_LIST];
	const double tol = o->dtype == APE_F32 ? 1e-5 : 1e-2; /* same device, same arithmetic */
	ape_device_info info;
	int n = 0, bad = 0;

	if (ape_device_get_info(dev, &info))
		return bench_failed(APE_EINVAL);
	for (int li = 0; li < o->nL; li++)
		for (int si = 0; si < o->nskip; si++) {
			const int ret = pool_row(dev, o, o->L[li], o->skip[si], rng, &rows[n]);

			if (ret && rows[n].said)
				return ret == APE_EOVERFLOW ? 2 : 1;
			if (ret)
				return bench_failed(ret);
			bad |= !(rows[n].max_diff <= tol);
			n++;
		}
	if (o->json)
		pool_json(&info, o, rows, n, tol);
	else
		pool_table(&info, o, rows, n, tol);
	return bad;
}
