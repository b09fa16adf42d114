/* SPDX-License-Identifier: MIT */
/*
 * What the call log, the kernel-path notes, the session trace and the NVTX hooks cost when they
 * are off (docs/profiling.md: "zero cost when off"): two builds of libape loaded side by side in
 * one process (dlopen, RTLD_LOCAL), alternating rounds, the same calls on the same inputs:
 *
 *   - a decode step, ape_attention_forward() of one query row against Lk keys (H = 6, D = 64,
 *     f32, the seed's parameters), the call whose fixed costs show most;
 *   - ape_device_get_info(), the cheapest public call (the cost of a public call's scope).
 *
 *   log_off OLD/libape.so.0 NEW/libape.so.0 [backend [Lk [rounds [calls]]]]
 *                                      (defaults: opencl 4096 9 200)
 *
 * Prints each round's median per-call time of each build and their ratio (new / old), then the
 * median of the ratios. Built by `make bench-log-off`. APE_VERBOSE, APE_TRACE must be unset.
 */
#include "ab_build.h"
#include "bench_util.h"

int main(int argc, char **argv)
{
	struct build b[2] = { { .path = argc > 1 ? argv[1] : NULL },
			      { .path = argc > 2 ? argv[2] : NULL } };
	const char *backend = argc > 3 ? argv[3] : "opencl";
	const int64_t Lk = argc > 4 ? atoll(argv[4]) : 4096, H = 6, D = 64;
	const int rounds = argc > 5 ? atoi(argv[5]) : 9, calls = argc > 6 ? atoi(argv[6]) : 200;
	float *q, *k, *v, *o;
	double ratio[2][MAXR], per[2][2][MAXR];
	uint64_t state = 1;

	if (!b[0].path || !b[1].path || rounds < 1 || rounds > MAXR || calls < 1) {
		fprintf(stderr, "usage: log_off OLD/libape.so.0 NEW/libape.so.0 [backend [Lk [rounds "
				"[calls]]]] (rounds 1..%d)\n",
			MAXR);
		return 2;
	}
	if (getenv("APE_VERBOSE") || getenv("APE_TRACE")) {
		fprintf(stderr, "log_off: unset APE_VERBOSE and APE_TRACE: this measures them off\n");
		return 2;
	}
	q = bench_randn((size_t)(H * D), &state);
	k = bench_randn((size_t)(H * Lk * D), &state);
	v = bench_randn((size_t)(H * Lk * D), &state);
	o = calloc((size_t)(H * D), sizeof(float));
	for (int i = 0; i < 2; i++)
		load(&b[i], backend);
	printf("backend %s, decode step: H = %lld, D = %lld, Lk = %lld, f32, the seed's parameters; "
	       "%d calls a round\n",
	       backend, (long long)H, (long long)D, (long long)Lk, calls);
	printf("round  old us/step  new us/step  ratio   old ns/info  new ns/info  ratio\n");
	for (int r = 0; r < rounds; r++) {
		for (int s = 0; s < 2; s++) {
			const int i = (r + s) % 2; /* alternate which build goes first */
			struct build *x = &b[i];
			ape_attn_desc desc;
			ape_tensor tq, tk, tv, to;
			ape_device_info info;
			double t0, t1;

			x->desc_init(&desc);
			seed_params(&desc);
			x->tensor_init(&tq, q, APE_F32, 1, H, 1, D);
			x->tensor_init(&tk, k, APE_F32, 1, H, Lk, D);
			x->tensor_init(&tv, v, APE_F32, 1, H, Lk, D);
			x->tensor_init(&to, o, APE_F32, 1, H, 1, D);
			if (r == 0 && x->forward(x->dev, &desc, &tq, &tk, &tv, &to, NULL, NULL)) {
				fprintf(stderr, "log_off: %s\n", x->last_error());
				return 1;
			}
			t0 = now_ms();
			for (int c = 0; c < calls; c++)
				if (x->forward(x->dev, &desc, &tq, &tk, &tv, &to, NULL, NULL))
					return 1;
			t1 = now_ms();
			per[0][i][r] = (t1 - t0) * 1e3 / calls;
			t0 = now_ms();
			for (int c = 0; c < 1000 * calls; c++)
				x->device_get_info(x->dev, &info);
			t1 = now_ms();
			per[1][i][r] = (t1 - t0) * 1e6 / (1000.0 * calls);
		}
		ratio[0][r] = per[0][1][r] / per[0][0][r];
		ratio[1][r] = per[1][1][r] / per[1][0][r];
		printf("%5d  %11.1f  %11.1f  %5.3f   %11.1f  %11.1f  %5.3f\n", r, per[0][0][r],
		       per[0][1][r], ratio[0][r], per[1][0][r], per[1][1][r], ratio[1][r]);
	}
	printf("median ratio new/old: decode step %.3f, ape_device_get_info %.3f\n",
	       bench_median(ratio[0], rounds), bench_median(ratio[1], rounds));
	for (int i = 0; i < 2; i++)
		b[i].context_destroy(b[i].ctx);
	free(q);
	free(k);
	free(v);
	free(o);
	return 0;
}
