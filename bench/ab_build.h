/* SPDX-License-Identifier: MIT */
/*
 * Two builds of libape loaded side by side in one process (dlopen, RTLD_LOCAL), for the A/B
 * drivers of bench/ (log_off.c, ab_calls.c): each build's entry points, a context and the first
 * device of a backend; the clock; the seed's parameters.
 */
#ifndef APE_BENCH_AB_BUILD_H
#define APE_BENCH_AB_BUILD_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape/ape.h"

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
	int (*backward)(ape_device *, const ape_attn_desc *, const ape_tensor *, const ape_tensor *,
			const ape_tensor *, const ape_tensor *, const float *, const ape_tensor *,
			const float *, ape_tensor *, ape_tensor *, ape_tensor *, float *,
			ape_stats *);
	const char *(*last_error)(void);
	ape_context *ctx;
	ape_device *dev;
};

static inline void *sym(struct build *b, const char *name)
{
	void *p = dlsym(b->h, name);

	if (!p) {
		fprintf(stderr, "ab_build: %s: no %s\n", b->path, name);
		exit(1);
	}
	return p;
}

static inline void load(struct build *b, const char *backend)
{
	ape_device *devs[16];
	int n;

	b->h = dlopen(b->path, RTLD_NOW | RTLD_LOCAL);
	if (!b->h) {
		fprintf(stderr, "ab_build: %s\n", dlerror());
		exit(1);
	}
	b->context_create = sym(b, "ape_context_create");
	b->context_destroy = sym(b, "ape_context_destroy");
	b->device_list = sym(b, "ape_device_list");
	b->device_get_info = sym(b, "ape_device_get_info");
	b->desc_init = sym(b, "ape_attn_desc_init");
	b->tensor_init = sym(b, "ape_tensor_init");
	b->forward = sym(b, "ape_attention_forward");
	b->backward = sym(b, "ape_attention_backward");
	b->last_error = sym(b, "ape_last_error");
	if (b->context_create(&b->ctx, NULL)) {
		fprintf(stderr, "ab_build: %s: %s\n", b->path, b->last_error());
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
		fprintf(stderr, "ab_build: %s: no %s device\n", b->path, backend);
		exit(1);
	}
}

static inline double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* The seed's parameters (ape-run's defaults): delta = 2^(-4/3), beta = gamma = delta / 10,
 * lambda = 0.1. */
static inline void seed_params(ape_attn_desc *d)
{
	d->delta.value = 0.3968502629920499f;
	d->beta.value = d->gamma.value = 0.03968502629920499f;
	d->lambda.value = 0.1f;
}

#endif
