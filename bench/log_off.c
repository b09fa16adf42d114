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
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape/ape.h"
#include "bench_util.h"

#define MAXR 64

struct build {
	const char *path;
	void *h;
	int (*context_create)(ape_context **, const ape_context_options *);
	void (*context_destroy)(ape_context *);
	int (*device_list)(ape_context *, ape_device **, int);
	int (*device_get_info)(const ape_device *, ape_device_info *);
	void (*desc_init)(ape_attn_desc *);
	void (*tensor_init)(ape_tensor *, void *, ape_dtype, int64_t, int64_t, int64_t, int64_t);
	int (*forward)(ape_device *, const ape_attn_desc *, const ape_tensor *, const ape_tensor *,
		       const ape_tensor *, ape_tensor *, float *, ape_stats *);
	const char *(*last_error)(void);
	ape_context *ctx;
	ape_device *dev;
};

static void *sym(struct build *b, const char *name)
{
	void *p = dlsym(b->h, name);

	if (!p) {
		fprintf(stderr, "log_off: %s: no %s\n", b->path, name);
		exit(1);
	}
	return p;
}

static void load(struct build *b, const char *backend)
{
	ape_device *devs[16];
	int n;

	b->h = dlopen(b->path, RTLD_NOW | RTLD_LOCAL);
	if (!b->h) {
		fprintf(stderr, "log_off: %s\n", dlerror());
		exit(1);
	}
	b->context_create = sym(b, "ape_context_create");
	b->context_destroy = sym(b, "ape_context_destroy");
	b->device_list = sym(b, "ape_device_list");
	b->device_get_info = sym(b, "ape_device_get_info");
	b->desc_init = sym(b, "ape_attn_desc_init");
	b->tensor_init = sym(b, "ape_tensor_init");
	b->forward = sym(b, "ape_attention_forward");
	b->last_error = sym(b, "ape_last_error");
	if (b->context_create(&b->ctx, NULL)) {
		fprintf(stderr, "log_off: %s: %s\n", b->path, b->last_error());
		exit(1);
	}
	n = b->device_list(b->ctx, devs, 16);
	for (int i = 0; i < n && !b->dev; i++) {
		ape_device_info info;

		b->device_get_info(devs[i], &info);
		if (!strcmp(info.backend, backend))
			b->dev = devs[i];
	}
	if (!b->dev) {
		fprintf(stderr, "log_off: %s: no %s device\n", b->path, backend);
		exit(1);
	}
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* The seed's parameters (ape-run's defaults): delta = 2^(-4/3), beta = gamma = delta / 10,
 * lambda = 0.1. */
static void seed_params(ape_attn_desc *d)
{
	d->delta.value = 0.3968502629920499f;
	d->beta.value = d->gamma.value = 0.03968502629920499f;
	d->lambda.value = 0.1f;
}

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
