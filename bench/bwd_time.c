/* SPDX-License-Identifier: MIT */
/*
 * Backward against forward, side by side: ape_attention_forward_ex() and
 * ape_attention_backward_ex() on the same inputs (random N(0,1) Q, K, V, dO, the seed's
 * parameters), alternating, median of the repeats, from ape_stats (kernel_ms: device time of
 * the kernels; total_ms: the whole call, copies included), and the median of each round's
 * ratio to the forward of the same round (the machine is shared: rounds differ by 2x, ratios
 * within a round much less). Also the backward with only the parameter gradients wanted
 * (frozen Q, K, V).
 *
 *   bwd_time [backend [L [H [D [repeats [causal [skip_tol]]]]]]]
 *                                             (defaults: opencl 4096 6 64 3 1 0)
 *
 * Built by `make bench-bwd` ($(BUILD)/bench/bwd_time); float32, B = 1. With skip_tol > 0 both
 * calls may skip keys (the forward's and the backward's bounds); the pairs each computed are
 * printed. The environment may set the parameters: DELTA, BETA, GAMMA, LAM (each a number;
 * unset: the seed's delta = 2^(-4/3), beta = gamma = delta / 10, lambda = 0.1), e.g. LAM=0 for
 * the separable backward (lambda = 0 on every head).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"
#include "bench_util.h"

#define MAXREP 32

/* The environment's value of name, or def when it is unset or empty */
static double env_or(const char *name, double def)
{
	const char *e = getenv(name);

	return e && *e ? atof(e) : def;
}

int main(int argc, char **argv)
{
	const char *backend = argc > 1 ? argv[1] : "opencl";
	const int64_t L = argc > 2 ? atoll(argv[2]) : 4096, H = argc > 3 ? atoll(argv[3]) : 6;
	const int64_t D = argc > 4 ? atoll(argv[4]) : 64;
	int reps = argc > 5 ? atoi(argv[5]) : 3;
	const int causal = argc > 6 ? atoi(argv[6]) : 1;
	const double skip_tol = argc > 7 ? atof(argv[7]) : 0;
	const size_t n = (size_t)(H * L * D);
	float *q, *k, *v, *o, *dout, *dq, *dk, *dv, *lse, *dparams;
	double t[3][2][MAXREP]; /* forward, backward, dparams only; kernel_ms, total_ms */
	double ratio[3][2][MAXREP]; /* the same over the forward of the same round */
	uint64_t pairs[3] = { 0, 0, 0 }, visible[3] = { 0, 0, 0 };
	ape_tensor tq, tk, tv, to, tdo, tdq, tdk, tdv;
	ape_context_options co;
	ape_context *ctx;
	ape_selection sel;
	ape_exec_options eo;
	ape_attn_desc desc;
	uint64_t seed = 12345;
	int ret;

	reps = reps < 1 ? 1 : reps > MAXREP ? MAXREP : reps;
	q = bench_randn(n, &seed), k = bench_randn(n, &seed), v = bench_randn(n, &seed), dout = bench_randn(n, &seed);
	o = malloc(n * sizeof(float)), dq = malloc(n * sizeof(float));
	dk = malloc(n * sizeof(float)), dv = malloc(n * sizeof(float));
	lse = malloc((size_t)(H * L) * sizeof(float)), dparams = malloc((size_t)(4 * H) * sizeof(float));
	if (!q || !k || !v || !dout || !o || !dq || !dk || !dv || !lse || !dparams)
		return 1;
	ape_tensor_init(&tq, q, APE_F32, 1, H, L, D);
	ape_tensor_init(&tk, k, APE_F32, 1, H, L, D);
	ape_tensor_init(&tv, v, APE_F32, 1, H, L, D);
	ape_tensor_init(&to, o, APE_F32, 1, H, L, D);
	ape_tensor_init(&tdo, dout, APE_F32, 1, H, L, D);
	ape_tensor_init(&tdq, dq, APE_F32, 1, H, L, D);
	ape_tensor_init(&tdk, dk, APE_F32, 1, H, L, D);
	ape_tensor_init(&tdv, dv, APE_F32, 1, H, L, D);
	ape_attn_desc_init(&desc);
	desc.delta.value = (float)env_or("DELTA", pow(2, -4.0 / 3));
	desc.beta.value = (float)env_or("BETA", (float)pow(2, -4.0 / 3) / 10);
	desc.gamma.value = (float)env_or("GAMMA", (float)pow(2, -4.0 / 3) / 10);
	desc.lambda.value = (float)env_or("LAM", 0.1);
	desc.causal = causal;
	desc.skip_tol = skip_tol;
	ape_exec_options_init(&eo);

	ape_context_options_init(&co);
	co.backends = backend;
	if ((ret = ape_context_create(&ctx, &co)) || (ret = ape_device_select(ctx, backend, -1, &sel))) {
		fprintf(stderr, "bwd_time: %s\n", ape_last_error());
		return 1;
	}
	/* one untimed round: program builds, first-touch */
	for (int r = -1; r < reps; r++) {
		ape_stats st[3];

		for (int x = 0; x < 3; x++)
			ape_stats_init(&st[x]);
		ret = ape_attention_forward_ex(&sel.device, 1, &eo, &desc, &tq, &tk, &tv, &to, lse,
					       &st[0]);
		if (!ret)
			ret = ape_attention_backward_ex(&sel.device, 1, &eo, &desc, &tq, &tk, &tv, &to,
							lse, &tdo, NULL, &tdq, &tdk, &tdv, dparams,
							&st[1]);
		if (!ret)
			ret = ape_attention_backward_ex(&sel.device, 1, &eo, &desc, &tq, &tk, &tv, &to,
							lse, &tdo, NULL, NULL, NULL, NULL, dparams,
							&st[2]);
		if (ret) {
			fprintf(stderr, "bwd_time: %s\n", ape_last_error());
			return 1;
		}
		for (int x = 0; r >= 0 && x < 3; x++) {
			pairs[x] = st[x].pairs_computed;
			visible[x] = st[x].pairs_visible;
			t[x][0][r] = st[x].kernel_ms;
			t[x][1][r] = st[x].total_ms;
			ratio[x][0][r] = st[x].kernel_ms / st[0].kernel_ms;
			ratio[x][1][r] = st[x].total_ms / st[0].total_ms;
		}
		fprintf(stderr, "round %d: forward %.1f ms, backward %.1f ms, dparams only %.1f ms\n",
			r, st[0].total_ms, st[1].total_ms, st[2].total_ms);
	}
	{
		static const char *const names[3] = { "forward", "backward", "backward, dparams only" };
		printf("%s, B=1 H=%lld L=%lld D=%lld f32 %s skip_tol=%g delta=%g beta=%g gamma=%g "
		       "lambda=%g, median of %d\n",
		       sel.device ? backend : "?", (long long)H, (long long)L, (long long)D,
		       causal ? "causal" : "non-causal", skip_tol, desc.delta.value, desc.beta.value,
		       desc.gamma.value, desc.lambda.value, reps);
		for (int x = 0; x < 3; x++) {
			double km = bench_median(t[x][0], reps), tm = bench_median(t[x][1], reps);

			printf("%-24s kernel_ms %9.1f  total_ms %9.1f  (x forward, per round: "
			       "%.2f kernel, %.2f total)  pairs %llu of %llu\n",
			       names[x], km, tm, bench_median(ratio[x][0], reps), bench_median(ratio[x][1], reps),
			       (unsigned long long)pairs[x], (unsigned long long)visible[x]);
		}
	}
	ape_context_destroy(ctx);
	free(q), free(k), free(v), free(o), free(dout), free(dq), free(dk), free(dv), free(lse), free(dparams);
	return 0;
}
