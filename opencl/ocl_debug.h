/* SPDX-License-Identifier: MIT */
/*
 * Internal hooks of the OpenCL backend that tests observe (tests link the static library, where
 * hidden symbols resolve). No OpenCL header needed.
 */
#ifndef APE_OPENCL_OCL_DEBUG_H
#define APE_OPENCL_OCL_DEBUG_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

struct ape_device;
struct ape_be_queue;

/* How a probe that finds no OpenCL platform at all starts its reason: tests skip on it. */
#define APE__OCL_NO_PLATFORM "no OpenCL platform"

/* How this device's programs came to be, since the context was created. */
struct ape__ocl_debug_counters {
	unsigned builds; /* compiled from source */
	unsigned cache_hits; /* loaded from the program cache and built from the binary */
	unsigned cache_writes; /* entries written to the program cache */
	unsigned cache_rejects; /* entries found but not used (corrupt, untrusted, or failed) */
	unsigned preloads; /* of cache_hits, those loaded at device open (ape_context_create) */
};

/* 0, or -1 when dev is not an OpenCL device. */
int ape__ocl_debug_counters(const struct ape_device *dev, struct ape__ocl_debug_counters *out);
/* The kernels enqueued on dev since the last call, space-separated in order ("ape_kmax
 * ape_attention"; cut short past 1 KiB), into buf; then forgets them. The first call starts the
 * recording (until then nothing is recorded: "" the first time), so that no other process pays
 * for it. -1 when dev is not an OpenCL device. For tests that check the kernel path a call says
 * it took. */
int ape__ocl_debug_kernels(const struct ape_device *dev, char *buf, unsigned cap);
/* CL_DEVICE_MAX_MEM_ALLOC_SIZE, or 0 when dev is not an OpenCL device. */
uint64_t ape__ocl_debug_max_alloc(const struct ape_device *dev);
/* Commands whose events the queue holds (its timeline, ocl.h): bounded on a long-lived queue
 * while no event of it is alive (0 after a synchronize then). */
unsigned long ape__ocl_debug_tracked(const struct ape_be_queue *q);
/* The program cache key of variant D on dev ("" when dev is not an OpenCL device). */
void ape__ocl_debug_cache_key(const struct ape_device *dev, int64_t D, char *buf, unsigned cap);

#pragma GCC visibility pop
#endif
