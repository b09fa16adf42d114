/* SPDX-License-Identifier: MIT */
/*
 * ape-bench --varlen S (tools/bench/bench.h): for each -L, a ragged batch of S sequences of L
 * tokens (packed [S L, H, D], default positions) as one ape_attention_forward_varlen() call,
 * against what a caller without ragged calls does, a dense call per sequence, and against one
 * dense call of about the same visible pairs; timed in alternating rounds after the warm-up. The
 * ragged result is checked against the per-sequence calls on the same device.
 */
#include <inttypes.h>
#include <math.h>
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

struct vl_row {
	int64_t L, L1; /* sequence length; the dense call's of about the same pairs */
	double skip_tol;
	double var_ms, each_ms, one_ms; /* medians */
	uint64_t pairs, pairs1; /* visible pairs: the batch's, the dense call's */
	uint64_t launches, each_launches;
	double max_diff; /* ragged against per sequence, of max|V| */
};

/* The batch's buffers: packed q, k, v, o (ragged), o2 (per sequence), and one [1, H, L1, D]
 * problem's q1, k1, v1, o1. */
struct vl_bufs {
	void *q, *k, *v, *o, *o2, *q1, *k1, *v1, *o1;
	int64_t *cu;
};

static void vl_free(struct vl_bufs *b)
{
	void *const p[] = { b->q, b->k, b->v, b->o, b->o2, b->q1, b->k1, b->v1, b->o1, b->cu };

	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* The ragged call. */
static int run_var(ape_device *dev, const ape_attn_desc *d, const ape_varlen *vl,
		   const ape_tensor *t, ape_stats *st)
{
	return ape_attention_forward_varlen(dev, d, vl, &t[0], &t[1], &t[2], (ape_tensor *)&t[3],
					    NULL, st);
}

/* One dense call per sequence, into the per-sequence output t[4]; the launches in *launches. */
static int run_each(ape_device *dev, const ape_attn_desc *d, const ape_tensor *t, int64_t S,
		    int64_t L, uint64_t *launches)
{
	*launches = 0;
	for (int64_t s = 0; s < S; s++) {
		ape_tensor q, k, v, o;
		ape_stats st;
		int ret;

		ape_stats_init(&st);
		if ((ret = ape_tensor_rows(&t[0], s * L, L, &q)) ||
		    (ret = ape_tensor_rows(&t[1], s * L, L, &k)) ||
		    (ret = ape_tensor_rows(&t[2], s * L, L, &v)) ||
		    (ret = ape_tensor_rows(&t[4], s * L, L, &o)) ||
		    (ret = ape_attention_forward(dev, d, &q, &k, &v, &o, NULL, &st)))
			return ret;
		*launches += st.chunks;
	}
	return 0;
}

static int vl_row(ape_device *dev, const struct bench_opts *o, int64_t L, double skip_tol,
		  ape_rng *rng, struct vl_row *r)
{
	const int64_t S = o->varlen, T = S * L, H = o->H, Hkv = o->Hkv, D = o->D;
	const int n = o->repeats > 1024 ? 1024 : o->repeats;
	static double tv[1024], te[1024], t1[1024];
	struct vl_bufs b;
	ape_tensor t[5], d1[4];
	ape_attn_desc desc;
	ape_varlen vl;
	ape_stats st;
	float *x = NULL, *y = NULL;
	double vmax = 0;
	int ret = 0;

	memset(r, 0, sizeof(*r));
	memset(&b, 0, sizeof(b));
	r->L = L;
	r->skip_tol = skip_tol;
	/* causal: S L (L + 1) / 2 pairs; the dense call with about as many */
	r->pairs = (uint64_t)S * (uint64_t)(o->causal ? L * (L + 1) / 2 : L * L);
	r->L1 = o->causal ? (int64_t)((sqrt(8.0 * (double)r->pairs + 1) - 1) / 2)
			  : (int64_t)sqrt((double)r->pairs);
	r->L1 = r->L1 < 1 ? 1 : r->L1;
	r->pairs1 = (uint64_t)(o->causal ? r->L1 * (r->L1 + 1) / 2 : r->L1 * r->L1);
	b.q = ape_rng_array(rng, (size_t)(T * H * D), o->dtype, NULL);
	b.k = ape_rng_array(rng, (size_t)(T * Hkv * D), o->dtype, NULL);
	b.v = ape_rng_array(rng, (size_t)(T * Hkv * D), o->dtype, NULL);
	b.o = malloc((size_t)(T * H * D) * ape_dtype_size(o->dtype) + 1);
	b.o2 = malloc((size_t)(T * H * D) * ape_dtype_size(o->dtype) + 1);
	b.q1 = ape_rng_array(rng, (size_t)(r->L1 * H * D), o->dtype, NULL);
	b.k1 = ape_rng_array(rng, (size_t)(r->L1 * Hkv * D), o->dtype, NULL);
	b.v1 = ape_rng_array(rng, (size_t)(r->L1 * Hkv * D), o->dtype, NULL);
	b.o1 = malloc((size_t)(r->L1 * H * D) * ape_dtype_size(o->dtype) + 1);
	b.cu = malloc((size_t)(S + 1) * sizeof(int64_t));
	if (!b.q || !b.k || !b.v || !b.o || !b.o2 || !b.q1 || !b.k1 || !b.v1 || !b.o1 || !b.cu) {
		vl_free(&b);
		fprintf(stderr, "ape-bench: out of memory for %" PRId64 " x %" PRId64 " tokens\n", S,
			L);
		return APE_ENOMEM;
	}
	for (int64_t s = 0; s <= S; s++)
		b.cu[s] = s * L;
	ape_tensor_init_packed(&t[0], b.q, o->dtype, T, H, D);
	ape_tensor_init_packed(&t[1], b.k, o->dtype, T, Hkv, D);
	ape_tensor_init_packed(&t[2], b.v, o->dtype, T, Hkv, D);
	ape_tensor_init_packed(&t[3], b.o, o->dtype, T, H, D);
	ape_tensor_init_packed(&t[4], b.o2, o->dtype, T, H, D);
	ape_tensor_init(&d1[0], b.q1, o->dtype, 1, H, r->L1, D);
	ape_tensor_init(&d1[1], b.k1, o->dtype, 1, Hkv, r->L1, D);
	ape_tensor_init(&d1[2], b.v1, o->dtype, 1, Hkv, r->L1, D);
	ape_tensor_init(&d1[3], b.o1, o->dtype, 1, H, r->L1, D);
	ape_varlen_init(&vl);
	vl.num_seqs = S;
	vl.cu_seqlens_q = vl.cu_seqlens_k = b.cu;
	bench_desc(o, skip_tol, &desc);
	/* warm-up (program builds), then the check: ragged against per sequence */
	for (int w = 0; w < (o->warmup > 0 ? o->warmup : 1) && !ret; w++) {
		ape_stats_init(&st);
		ret = run_var(dev, &desc, &vl, t, &st);
		if (!ret)
			ret = run_each(dev, &desc, t, S, L, &r->each_launches);
		if (!ret)
			ret = ape_attention_forward(dev, &desc, &d1[0], &d1[1], &d1[2], &d1[3], NULL,
						    NULL);
	}
	r->launches = st.chunks;
	x = malloc((size_t)(T * H * D) * sizeof(float) + 1);
	y = malloc((size_t)(T * H * D) * sizeof(float) + 1);
	if (!ret && (!x || !y))
		ret = APE_ENOMEM;
	if (!ret && !(ret = ape_convert(x, APE_F32, b.o, o->dtype, (size_t)(T * H * D))) &&
	    !(ret = ape_convert(y, APE_F32, b.o2, o->dtype, (size_t)(T * H * D)))) {
		float *vv = malloc((size_t)(T * Hkv * D) * sizeof(float) + 1);

		if (vv && !ape_convert(vv, APE_F32, b.v, o->dtype, (size_t)(T * Hkv * D)))
			for (int64_t i = 0; i < T * Hkv * D; i++)
				vmax = fmax(vmax, fabs(vv[i]));
		free(vv);
		for (int64_t i = 0; i < T * H * D; i++)
			r->max_diff = fmax(r->max_diff, x[i] == y[i] ? 0 : fabs(x[i] - y[i]));
		r->max_diff = vmax > 0 ? r->max_diff / vmax : r->max_diff;
		if (r->max_diff != r->max_diff)
			r->max_diff = INFINITY;
	}
	free(x);
	free(y);
	for (int i = 0; i < n && !ret; i++) {
		uint64_t launches;
		double t0 = now_ms();

		ret = run_var(dev, &desc, &vl, t, NULL);
		tv[i] = now_ms() - t0;
		t0 = now_ms();
		if (!ret)
			ret = run_each(dev, &desc, t, S, L, &launches);
		te[i] = now_ms() - t0;
		t0 = now_ms();
		if (!ret)
			ret = ape_attention_forward(dev, &desc, &d1[0], &d1[1], &d1[2], &d1[3], NULL,
						    NULL);
		t1[i] = now_ms() - t0;
	}
	vl_free(&b);
	if (ret)
		return ret;
	r->var_ms = bench_median(tv, n);
	r->each_ms = bench_median(te, n);
	r->one_ms = bench_median(t1, n);
	return 0;
}

int bench_varlen(ape_device *dev, const struct bench_opts *o, ape_rng *rng)
{
	static struct vl_row rows[MAX_LIST * MAX_LIST];
	const double tol = o->dtype == APE_F32 ? 1e-5 : 1e-2; /* same device, same arithmetic */
	ape_device_info info;
	int n = 0, bad = 0;

	if (ape_device_get_info(dev, &info))
		return bench_failed(APE_EINVAL);
	for (int li = 0; li < o->nL; li++)
		for (int si = 0; si < o->nskip; si++) {
			const int ret = vl_row(dev, o, o->L[li], o->skip[si], rng, &rows[n]);

			if (ret)
				return bench_failed(ret);
			bad |= !(rows[n].max_diff <= tol);
			n++;
		}
	if (o->json) {
		bench_json_head(&info, o);
		printf(" \"varlen\": %" PRId64 ",\n \"results\": [", o->varlen);
		for (int i = 0; i < n; i++) {
			const struct vl_row *r = &rows[i];

			printf("%s\n  {\"L\": %" PRId64 ", \"skip_tol\": %.9g, \"varlen_ms\": %.6g, "
			       "\"per_sequence_ms\": %.6g, \"dense_ms\": %.6g, \"dense_L\": %" PRId64
			       ", \"pairs\": %" PRIu64 ", \"dense_pairs\": %" PRIu64
			       ", \"launches\": %" PRIu64 ", \"per_sequence_launches\": %" PRIu64
			       ", \"max_diff\": %.6g, \"within_tol\": %s}",
			       i ? "," : "", r->L, r->skip_tol, r->var_ms, r->each_ms, r->one_ms, r->L1,
			       r->pairs * (uint64_t)o->H, r->pairs1 * (uint64_t)o->H, r->launches,
			       r->each_launches, r->max_diff, r->max_diff <= tol ? "true" : "false");
		}
		printf("\n ]}\n");
		return bad;
	}
	bench_table_head(" --varlen", &info, o);
	printf(", %" PRId64 " sequences per batch, default positions\n", o->varlen);
	printf("%7s %9s %11s %9s %11s %9s %11s %9s %9s %10s\n", "L", "skip_tol", "varlen_ms",
	       "launches", "per_seq_ms", "launches", "dense_ms", "dense_L", "var/seq",
	       "pairs/s %");
	for (int i = 0; i < n; i++) {
		const struct vl_row *r = &rows[i];
		const double pv = (double)r->pairs / r->var_ms, p1 = (double)r->pairs1 / r->one_ms;

		printf("%7" PRId64 " %9.3g %11.2f %9" PRIu64 " %11.2f %9" PRIu64 " %11.2f %9" PRId64
		       " %8.2fx %9.1f%%%s\n",
		       r->L, r->skip_tol, r->var_ms, r->launches, r->each_ms, r->each_launches,
		       r->one_ms, r->L1, r->var_ms / r->each_ms, 100 * pv / p1,
		       r->max_diff <= tol ? "" : "  (differs from the per-sequence calls)");
	}
	printf("var/seq: the ragged call's time over the per-sequence calls'; pairs/s %%: the ragged "
	       "call's pairs per second as a share of one dense call's (dense_L)\n");
	return bad;
}
