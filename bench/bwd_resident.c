/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on host tensors against its device-resident twin, side by side:
 * ape_attention_backward() (pack, copy, launch, copy back, dQ summed on the host) and
 * ape_attention_backward_enqueue() on device buffers holding the same inputs, then
 * ape_queue_synchronize() (gather into scratch, launch, copy out), alternating A, B in each
 * round, wall-clock time of each call; the median of each and of each round's ratio B / A (the
 * machine is shared: rounds differ, ratios within a round much less). Every gradient wanted.
 *
 *   bwd_resident [backend [L [H [D [repeats]]]]]      (defaults: opencl 4096 6 64 5)
 *
 * Built by `make bench-bwd-resident` ($(BUILD)/bench/bwd_resident); float32, B = 1, causal,
 * the seed's parameters, skip_tol = 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ape/ape.h"
#include "bench_util.h"

#define MAXREP 32

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int main(int argc, char **argv)
{
	const char *backend = argc > 1 ? argv[1] : "opencl";
	const int64_t L = argc > 2 ? atoll(argv[2]) : 4096, H = argc > 3 ? atoll(argv[3]) : 6;
	const int64_t D = argc > 4 ? atoll(argv[4]) : 64;
	int reps = argc > 5 ? atoi(argv[5]) : 5;
	const size_t n = (size_t)(H * L * D), rows = (size_t)(H * L);
	/* q, k, v, o, lse, dout, dlse (unused), dq, dk, dv, dparams: elements of each */
	const size_t count[11] = { n, n, n, n, rows, n, rows, n, n, n, (size_t)(4 * H) };
	float *host[11];
	double th[MAXREP], tr[MAXREP], ratio[MAXREP];
	ape_tensor t[11];
	ape_dtensor d[11];
	ape_buffer *buf[11] = { NULL };
	ape_context_options co;
	ape_context *ctx = NULL;
	ape_selection sel;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	uint64_t seed = 12345;
	int ret;

	reps = reps < 1 ? 1 : reps > MAXREP ? MAXREP : reps;
	for (int i = 0; i < 11; i++) {
		host[i] = bench_randn(count[i], &seed);
		if (!host[i])
			return 1;
		if (i == 4 || i == 6)
			ape_tensor_init(&t[i], host[i], APE_F32, 1, H, L, 1);
		else
			ape_tensor_init(&t[i], host[i], APE_F32, 1, H, L, D);
	}
	ape_attn_desc_init(&desc);
	desc.delta.value = (float)pow(2, -4.0 / 3);
	desc.beta.value = desc.gamma.value = desc.delta.value / 10;
	desc.lambda.value = 0.1f;
	desc.causal = true;
	desc.skip_tol = 0;
	ape_context_options_init(&co);
	co.backends = backend;
	if ((ret = ape_context_create(&ctx, &co)) ||
	    (ret = ape_device_select(ctx, backend, -1, &sel)) ||
	    (ret = ape_attention_forward(sel.device, &desc, &t[0], &t[1], &t[2], &t[3], host[4],
					 NULL)) ||
	    (ret = ape_queue_create(sel.device, &qu)))
		goto fail;
	for (int i = 0; i < 11; i++) {
		if ((ret = ape_buffer_alloc(sel.device, count[i] * sizeof(float), &buf[i])) ||
		    (ret = ape_buffer_write(qu, buf[i], 0, host[i], count[i] * sizeof(float))))
			goto fail;
		if (i == 10)
			ape_dtensor_init(&d[i], buf[i], 0, APE_F32, 1, 1, H, 4);
		else
			ape_dtensor_init(&d[i], buf[i], 0, APE_F32, 1, H, L, i == 4 || i == 6 ? 1 : D);
	}
	if ((ret = ape_queue_synchronize(qu)))
		goto fail;
	/* one untimed round: program builds, first-touch */
	for (int r = -1; r < reps; r++) {
		const double t0 = now_ms();
		double t1, t2;

		if ((ret = ape_attention_backward(sel.device, &desc, &t[0], &t[1], &t[2], &t[3],
						  host[4], &t[5], NULL, &t[7], &t[8], &t[9], host[10],
						  NULL)))
			goto fail;
		t1 = now_ms();
		if ((ret = ape_attention_backward_enqueue(qu, &desc, &d[0], &d[1], &d[2], &d[3], &d[4],
							  &d[5], NULL, &d[7], &d[8], &d[9],
							  &d[10])) ||
		    (ret = ape_queue_synchronize(qu)))
			goto fail;
		t2 = now_ms();
		fprintf(stderr, "round %d: host call %.1f ms, enqueue + synchronize %.1f ms\n", r,
			t1 - t0, t2 - t1);
		if (r >= 0) {
			th[r] = t1 - t0;
			tr[r] = t2 - t1;
			ratio[r] = tr[r] / th[r];
		}
	}
	printf("%s, B=1 H=%lld L=%lld D=%lld f32 causal skip_tol=0, median of %d: host call "
	       "%.1f ms, enqueue + synchronize %.1f ms, per-round ratio %.3f\n",
	       backend, (long long)H, (long long)L, (long long)D, reps, bench_median(th, reps),
	       bench_median(tr, reps), bench_median(ratio, reps));
	goto out;
fail:
	fprintf(stderr, "bwd_resident: %s\n", ape_last_error());
out:
	ape_queue_destroy(qu);
	for (int i = 0; i < 11; i++) {
		ape_buffer_free(buf[i]);
		free(host[i]);
	}
	ape_context_destroy(ctx);
	return ret ? 1 : 0;
}
