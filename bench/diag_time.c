/* SPDX-License-Identifier: MIT */
/*
 * The cost of the diagnostics (docs/diagnostics.md): ape_attention_forward_ex() and
 * ape_attention_forward_diag() (entropy and mean distance both wanted) on the same inputs
 * (random N(0,1) Q, K, V, the seed's parameters), alternating, dense (skip_tol 0) and with
 * skipping (skip_tol 2^-24); per mode the median over the rounds of each call's kernel time
 * (ape_stats.kernel_ms, device events) and total time, and the median of each round's ratio
 * diag / plain (the machine is shared: rounds differ, ratios within a round much less).
 *
 *   diag_time [backend [L [H [D [repeats]]]]]     (defaults: opencl 4096 6 64 7)
 *
 * Built by `make bench-diag` ($(BUILD)/bench/diag_time); float32, B = 1, causal. Both calls
 * go through the streaming executor with the same chunks (chunk_q = chunk_k = L given
 * explicitly: a plain call would otherwise compute in place on a device that reads host
 * memory, a path the diagnostics do not take), so they differ only by the diagnostics.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"
#include "bench_util.h"

#define MAXREP 64

int main(int argc, char **argv)
{
	const char *backend = argc > 1 ? argv[1] : "opencl";
	const int64_t L = argc > 2 ? atoll(argv[2]) : 4096, H = argc > 3 ? atoll(argv[3]) : 6;
	const int64_t D = argc > 4 ? atoll(argv[4]) : 64;
	int reps = argc > 5 ? atoi(argv[5]) : 7;
	const size_t n = (size_t)(H * L * D), rows = (size_t)(H * L);
	uint64_t seed = 7;
	float *q = bench_randn(n, &seed), *k = bench_randn(n, &seed), *v = bench_randn(n, &seed);
	float *o = malloc(n * sizeof(float)), *lse = malloc(rows * sizeof(float));
	float *ent = malloc(rows * sizeof(float)), *md = malloc(rows * sizeof(float));
	ape_context_options co;
	ape_context *ctx = NULL;
	ape_selection sel;
	ape_tensor tq, tk, tv, to;
	ape_attn_desc desc;
	ape_exec_options eo;
	int ret = 1;

	if (reps < 1 || reps > MAXREP)
		reps = 7;
	if (!q || !k || !v || !o || !lse || !ent || !md)
		goto out;
	ape_context_options_init(&co);
	co.backends = backend;
	if (ape_context_create(&ctx, &co) || ape_device_select(ctx, backend, -1, &sel)) {
		fprintf(stderr, "diag_time: %s\n", ape_last_error());
		goto out;
	}
	ape_tensor_init(&tq, q, APE_F32, 1, H, L, D);
	ape_tensor_init(&tk, k, APE_F32, 1, H, L, D);
	ape_tensor_init(&tv, v, APE_F32, 1, H, L, D);
	ape_tensor_init(&to, o, APE_F32, 1, H, L, D);
	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = L;
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.3968502629920499f;
	desc.beta.value = desc.gamma.value = 0.03968502629920499f;
	desc.lambda.value = 0.1f;
	printf("diag_time: %s, B = 1, H = %lld, L = %lld, D = %lld, causal, f32, %d rounds\n",
	       sel.note, (long long)H, (long long)L, (long long)D, reps);
	printf("| mode | plain kernel ms | diag kernel ms | ratio (median of rounds) | plain total ms "
	       "| diag total ms |\n|---|---|---|---|---|---|\n");
	for (int mode = 0; mode < 2; mode++) {
		double kp[MAXREP], kd[MAXREP], tp[MAXREP], td[MAXREP], r[MAXREP];

		desc.skip_tol = mode ? 0x1p-24 : 0;
		for (int i = -1; i < reps; i++) { /* one warm-up round */
			ape_stats a, b;

			ape_stats_init(&a);
			ape_stats_init(&b);
			if (ape_attention_forward_ex(&sel.device, 1, &eo, &desc, &tq, &tk, &tv, &to,
						     lse, &a) ||
			    ape_attention_forward_diag(&sel.device, 1, &eo, &desc, &tq, &tk, &tv,
						       &to, lse, ent, md, &b)) {
				fprintf(stderr, "diag_time: %s\n", ape_last_error());
				goto out;
			}
			if (i < 0)
				continue;
			kp[i] = a.kernel_ms;
			kd[i] = b.kernel_ms;
			tp[i] = a.total_ms;
			td[i] = b.total_ms;
			r[i] = b.kernel_ms / a.kernel_ms;
		}
		printf("| %s | %.2f | %.2f | %.3f | %.2f | %.2f |\n",
		       mode ? "skipping (2^-24)" : "dense", bench_median(kp, reps), bench_median(kd, reps),
		       bench_median(r, reps), bench_median(tp, reps), bench_median(td, reps));
	}
	ret = 0;
out:
	ape_context_destroy(ctx);
	free(q);
	free(k);
	free(v);
	free(o);
	free(lse);
	free(ent);
	free(md);
	return ret;
}
