/* SPDX-License-Identifier: MIT */
/*
 * What the libFuzzer targets of libape's calls share (fuzz_problem.c, fuzz_resident.c): the
 * reference device they run on, the check of a promise, and the reading of the input as
 * little-endian fields (zeros once it is exhausted) and as the sizes, strides and positions a
 * call takes, mostly small, sometimes at the edges of int64. Define FUZZ_NAME (the target's
 * name, for messages) before including it, and FUZZ_BACKENDS ("ref" unless defined: the
 * context's backends, e.g. "ref,opencl" for a target that also runs where OpenCL is built in).
 */
#ifndef APE_FUZZ_INPUT_H
#define APE_FUZZ_INPUT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "ape/ape.h"
#include "say.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#ifndef FUZZ_BACKENDS
#define FUZZ_BACKENDS "ref"
#endif

static ape_context *ctx;
static ape_device *ref;

static void check(int cond, const char *what)
{
	if (!cond) {
		fprintf(stderr, FUZZ_NAME ": broken promise: %s (last error: %s)\n", what,
			ape_last_error());
		abort();
	}
}

/* One context with the reference backend only (or FUZZ_BACKENDS), for the whole run. */
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	ape_context_options o;
	ape_selection sel;

	(void)argc;
	(void)argv;
	ape_context_options_init(&o);
	o.backends = FUZZ_BACKENDS;
	o.numa = APE_NUMA_OFF;
	check(ape_context_create(&ctx, &o) == 0, "ape_context_create");
	check(ape_device_select(ctx, "ref", -1, &sel) == 0, "ape_device_select(ref)");
	ref = sel.device;
	return 0;
}

struct in {
	const uint8_t *p;
	size_t n;
};

static uint64_t take(struct in *in, int bytes) /* little-endian; zeros once exhausted */
{
	uint64_t v = 0;

	for (int i = 0; i < bytes && in->n; i++, in->n--)
		v |= (uint64_t)*in->p++ << (8 * i);
	return v;
}

/* Sizes, strides and positions: mostly small, sometimes at the edges of int64. */
static int64_t take_int(struct in *in)
{
	static const int64_t edge[16] = {
		-1, INT64_MIN, INT64_MAX, INT64_MAX - 1, (int64_t)1 << 31, (int64_t)1 << 32,
		(int64_t)1 << 62, ((int64_t)1 << 62) + 1, 255, 256, 257, 258, -2, INT64_MIN + 1,
		(int64_t)1 << 40, 3037000500 /* sqrt(2^63) */,
	};
	unsigned c = (unsigned)take(in, 1);

	switch (c >> 5) {
	case 5:
		return (int64_t)take(in, 8);
	case 6:
		return edge[c & 15];
	case 7:
		return (int64_t)take(in, 2);
	default:
		return c & 31;
	}
}

/* Elements of a tensor of nd dims from the first addressed to the last, +1 (0: no element, a
 * negative stride, or beyond 2^40): what a block backing it must hold. */
static __attribute__((unused)) uint64_t span_elems(const int64_t *shape, const int64_t *strides,
						   int nd)
{
	uint64_t last = 0;

	for (int d = 0; d < nd; d++) {
		if (shape[d] <= 0 || strides[d] < 0)
			return 0;
		if (shape[d] > 1) {
			if ((uint64_t)strides[d] > (1ull << 40) / (uint64_t)shape[d])
				return 0;
			last += (uint64_t)(shape[d] - 1) * (uint64_t)strides[d];
			if (last > (1ull << 40))
				return 0;
		}
	}
	return last + 1;
}

#endif
