/* SPDX-License-Identifier: MIT */
/*
 * A change's cost to the built-in backends' calls: two builds of libape loaded side by side in
 * one process (bench/ab_build.h), alternating rounds, the same calls on the same inputs:
 *
 *   - the forward, ape_attention_forward() of L rows over L keys, causal, with LSE;
 *   - the backward, ape_attention_backward() of the same problem, every gradient.
 *
 * H = 6, D = 64 unless given, f32, the seed's parameters (lambda = 0.1).
 *
 *   ab_calls OLD/libape.so.0 NEW/libape.so.0 [backend [L [rounds [calls [H [D]]]]]]
 *                                      (defaults: opencl 1024 9 5 6 64)
 *
 * (H 2, L 64, D 16: python/examples/fine_tune_ape.py's calls, where a call's fixed cost is
 * most of its time.)
 *
 * Prints each round's median time per call of each build and their ratio (new / old), then the
 * median of the ratios. Built by `make bench-ab-calls`.
 */
#include "ab_build.h"
#include "bench_util.h"

/* The median time of n calls of which (0: forward, 1: backward) on build x, in ms; -1 on a
 * failure (said on stderr). */
static double time_calls(struct build *x, int which, int n, const ape_tensor *t, float *lse,
			 float *dparams)
{
	double ms[64];
	ape_attn_desc desc;

	x->desc_init(&desc);
	seed_params(&desc);
	for (int c = 0; c < n; c++) {
		const double t0 = now_ms();
		int ret = which ? x->backward(x->dev, &desc, &t[0], &t[1], &t[2], &t[3], lse, &t[4],
					      NULL, (ape_tensor *)&t[5], (ape_tensor *)&t[6],
					      (ape_tensor *)&t[7], dparams, NULL)
				: x->forward(x->dev, &desc, &t[0], &t[1], &t[2], (ape_tensor *)&t[3],
					     lse, NULL);

		if (ret) {
			fprintf(stderr, "ab_calls: %s: %s\n", x->path, x->last_error());
			return -1;
		}
		ms[c] = now_ms() - t0;
	}
	return bench_median(ms, n);
}

int main(int argc, char **argv)
{
	struct build b[2] = { { .path = argc > 1 ? argv[1] : NULL },
			      { .path = argc > 2 ? argv[2] : NULL } };
	const char *backend = argc > 3 ? argv[3] : "opencl";
	const int64_t L = argc > 4 ? atoll(argv[4]) : 1024, H = argc > 7 ? atoll(argv[7]) : 6,
		      D = argc > 8 ? atoll(argv[8]) : 64;
	const int rounds = argc > 5 ? atoi(argv[5]) : 9, calls = argc > 6 ? atoi(argv[6]) : 5;
	const size_t n = (size_t)(H * L * D);
	float *x[8], *lse, *dparams;
	double ratio[2][MAXR], per[2][2][MAXR];
	uint64_t state = 1;

	if (!b[0].path || !b[1].path || rounds < 1 || rounds > MAXR || calls < 1 || calls > 64 ||
	    L < 1 || H < 1 || H > 4096 || D < 2 || D > 256 || D % 2) {
		fprintf(stderr, "usage: ab_calls OLD/libape.so.0 NEW/libape.so.0 [backend [L [rounds "
				"[calls [H [D]]]]]] (rounds 1..%d, calls 1..64, H 1..4096, D even 2..256)\n",
			MAXR);
		return 2;
	}
	for (int i = 0; i < 8; i++) /* q, k, v, o, dout, dq, dk, dv */
		if (!(x[i] = bench_randn(n, &state)))
			return 1;
	lse = calloc((size_t)(H * L), sizeof(float));
	dparams = calloc((size_t)(4 * H), sizeof(float));
	if (!lse || !dparams)
		return 1;
	for (int i = 0; i < 2; i++)
		load(&b[i], backend);
	printf("backend %s: forward and backward of L = %lld, H = %lld, D = %lld, f32, causal, the "
	       "seed's parameters; median of %d calls a round\n",
	       backend, (long long)L, (long long)H, (long long)D, calls);
	printf("round  old fwd ms  new fwd ms  ratio   old bwd ms  new bwd ms  ratio\n");
	for (int r = 0; r < rounds; r++) {
		for (int s = 0; s < 2; s++) {
			const int i = (r + s) % 2; /* alternate which build goes first */
			ape_tensor t[8];

			for (int j = 0; j < 8; j++)
				b[i].tensor_init(&t[j], x[j], APE_F32, 1, H, L, D);
			/* the forward writes the O and LSE the backward reads */
			for (int w = 0; w < 2; w++) {
				if (r == 0 && time_calls(&b[i], w, 1, t, lse, dparams) < 0)
					return 1; /* warm-up: programs, buffers */
				per[w][i][r] = time_calls(&b[i], w, calls, t, lse, dparams);
				if (per[w][i][r] < 0)
					return 1;
			}
		}
		for (int w = 0; w < 2; w++)
			ratio[w][r] = per[w][1][r] / per[w][0][r];
		printf("%5d  %10.2f  %10.2f  %5.3f   %10.2f  %10.2f  %5.3f\n", r, per[0][0][r],
		       per[0][1][r], ratio[0][r], per[1][0][r], per[1][1][r], ratio[1][r]);
	}
	printf("median ratio new/old: forward %.3f, backward %.3f\n", bench_median(ratio[0], rounds),
	       bench_median(ratio[1], rounds));
	for (int i = 0; i < 2; i++)
		b[i].context_destroy(b[i].ctx);
	for (int i = 0; i < 8; i++)
		free(x[i]);
	free(lse);
	free(dparams);
	return 0;
}
