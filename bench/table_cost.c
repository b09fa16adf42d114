/* SPDX-License-Identifier: MIT */
/*
 * What a distance-bias table costs (issue 30's target: at most 1.05x the same call without
 * one): the same forward (and backward) with and without a table, side by side in one
 * process, alternating rounds, each shape's median per side and their ratio. Shapes: the
 * general kernel (lambda > 0) and the separable path (lambda = 0), each dense (no decay:
 * every pair computed) and with the seed's decay (skipping on); the decode step (one query
 * row against many keys); the backward with the table's gradient against the backward
 * without a table. The table: per head, T5-like buckets up to 128, the last entry beyond.
 *
 * usage: table_cost [BACKEND [L [ROUNDS]]]   (opencl, 2048, 7)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"
#include "bench_util.h"
#include "core/clock.h"

enum { H = 6, HKV = 6, D = 64, M = 129 };

struct shape {
	const char *name;
	int64_t lq, lk;
	float delta, beta, gamma, lambda;
	bool backward;
};

static double call_ms(ape_device *dev, const struct shape *s, const float *table, float *q,
		      float *k, float *v, float *o, float *lse, float *dout, float *dq, float *dk,
		      float *dv, float *dtab)
{
	ape_attn_desc d;
	ape_tensor tq, tk, tv, to, tdo, tdq, tdk, tdv;
	double t0;
	int ret;

	ape_attn_desc_init(&d);
	d.delta.value = s->delta;
	d.beta.value = s->beta;
	d.gamma.value = s->gamma;
	d.lambda.value = s->lambda;
	d.bias_table = table;
	d.bias_table_len = table ? M : 0;
	d.bias_table_heads = table ? H : 0;
	ape_tensor_init(&tq, q, APE_F32, 1, H, s->lq, D);
	ape_tensor_init(&tk, k, APE_F32, 1, HKV, s->lk, D);
	ape_tensor_init(&tv, v, APE_F32, 1, HKV, s->lk, D);
	ape_tensor_init(&to, o, APE_F32, 1, H, s->lq, D);
	if (!s->backward) {
		t0 = ape__now_ms();
		ret = ape_attention_forward(dev, &d, &tq, &tk, &tv, &to, lse, NULL);
	} else {
		ret = ape_attention_forward(dev, &d, &tq, &tk, &tv, &to, lse, NULL);
		ape_tensor_init(&tdo, dout, APE_F32, 1, H, s->lq, D);
		ape_tensor_init(&tdq, dq, APE_F32, 1, H, s->lq, D);
		ape_tensor_init(&tdk, dk, APE_F32, 1, HKV, s->lk, D);
		ape_tensor_init(&tdv, dv, APE_F32, 1, HKV, s->lk, D);
		d.dbias_table = table ? dtab : NULL;
		t0 = ape__now_ms();
		if (!ret)
			ret = ape_attention_backward(dev, &d, &tq, &tk, &tv, &to, lse, &tdo, NULL, &tdq,
						     &tdk, &tdv, NULL, NULL);
	}
	if (ret) {
		fprintf(stderr, "table_cost: %s: %s\n", s->name, ape_last_error());
		exit(1);
	}
	return ape__now_ms() - t0;
}

int main(int argc, char **argv)
{
	const char *backend = argc > 1 ? argv[1] : "opencl";
	const int64_t L = argc > 2 ? atoll(argv[2]) : 2048;
	const int rounds = argc > 3 ? atoi(argv[3]) : 7;
	const struct shape shapes[] = {
		{ "general, dense (lambda 0.3)", L, L, 0, 0, 0, 0.3f, false },
		{ "general, seed decay, skipping", L, L, 0.05f, 0.1f, 0.1f, 0.3f, false },
		{ "separable, dense (lambda 0)", L, L, 0, 0, 0, 0, false },
		{ "separable, seed decay, skipping", L, L, 0.05f, 0.1f, 0.1f, 0, false },
		{ "decode, 1 row x 8L keys, seed decay", 1, 8 * L, 0.05f, 0.1f, 0.1f, 0.3f, false },
		{ "backward + dbias (lambda 0.3)", L / 2, L / 2, 0, 0, 0, 0.3f, true },
	};
	const int nshapes = (int)(sizeof(shapes) / sizeof(shapes[0]));
	const size_t nq = (size_t)(H * L * D), nk = (size_t)(HKV * 8 * L * D);
	uint64_t seed = 42;
	float *q = bench_randn(nq, &seed), *k = bench_randn(nk, &seed), *v = bench_randn(nk, &seed);
	float *dout = bench_randn(nq, &seed), *o = malloc(nq * sizeof(float));
	float *lse = malloc((size_t)(H * L) * sizeof(float)), *dq = malloc(nq * sizeof(float));
	float *dk = malloc(nk * sizeof(float)), *dv = malloc(nk * sizeof(float));
	float table[H * M], dtab[H * M];
	double *t[2], *ratio;
	ape_context *ctx = NULL;
	ape_device *dev;
	ape_context_options co;
	ape_selection sel;

	if (!q || !k || !v || !dout || !o || !lse || !dq || !dk || !dv)
		return 1;
	for (int h = 0; h < H; h++) /* T5-like: exact to 8, then log-spaced buckets to 128 */
		for (int m = 0; m < M; m++) {
			const int b = m < 8 ? m : 8 + (int)(8 * log((double)m / 8) / log(16));

			table[h * M + m] = (float)(0.5 * sin(1.3 * b + h));
		}
	ape_context_options_init(&co);
	co.backends = backend;
	if (ape_context_create(&ctx, &co) || ape_device_select(ctx, backend, -1, &sel)) {
		fprintf(stderr, "table_cost: %s\n", ape_last_error());
		return 1;
	}
	dev = sel.device;
	t[0] = malloc(sizeof(double) * (size_t)rounds);
	t[1] = malloc(sizeof(double) * (size_t)rounds);
	ratio = malloc(sizeof(double) * (size_t)rounds);
	printf("# table_cost %s, L = %lld, H = %d, D = %d, f32, causal, table %d x %d, %d rounds "
	       "(median)\n",
	       backend, (long long)L, H, D, H, M, rounds);
	printf("| shape | without table | with table | ratio of medians | median of round ratios |\n"
	       "|---|---|---|---|---|\n");
	for (int s = 0; s < nshapes; s++) {
		double m0, m1;

		for (int w = 0; w < 2; w++) /* warm: programs built, caches filled */
			call_ms(dev, &shapes[s], w ? table : NULL, q, k, v, o, lse, dout, dq, dk, dv,
				dtab);
		for (int r = 0; r < rounds; r++)
			for (int w = 0; w < 2; w++) /* alternating, the order flipped every round */
				t[(w + r) % 2][r] = call_ms(dev, &shapes[s], (w + r) % 2 ? table : NULL, q,
							    k, v, o, lse, dout, dq, dk, dv, dtab);
		for (int r = 0; r < rounds; r++) /* each round's pair, side by side in time */
			ratio[r] = t[1][r] / t[0][r];
		m0 = bench_median(t[0], rounds);
		m1 = bench_median(t[1], rounds);
		printf("| %s | %.2f ms | %.2f ms | %.3fx | %.3fx |\n", shapes[s].name, m0, m1,
		       m1 / m0, bench_median(ratio, rounds));
		fflush(stdout);
	}
	ape_context_destroy(ctx);
	free(t[0]);
	free(t[1]);
	free(ratio);
	free(q);
	free(k);
	free(v);
	free(dout);
	free(o);
	free(lse);
	free(dq);
	free(dk);
	free(dv);
	return 0;
}
