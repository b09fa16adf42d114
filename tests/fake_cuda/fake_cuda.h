/* SPDX-License-Identifier: MIT */
/*
 * What the fake CUDA driver (fake_libcuda.c) tells tests beyond the driver API: a log of the
 * kernel launches it received, so that a test can check which stream, which context and which
 * argument values (device pointers, views) reached cuLaunchKernel. Tests find the functions
 * with dlsym() in the loaded fake (dlopen(path, RTLD_NOLOAD)).
 */
#ifndef APE_FAKE_CUDA_H
#define APE_FAKE_CUDA_H

#include <cuda.h>
#include <stddef.h>

#define FAKE_LOG_MAX 256 /* launches kept: the oldest are dropped */
#define FAKE_ARGS_MAX 4096 /* bytes of the argument struct kept */

struct fake_launch_rec {
	char name[64]; /* the kernel */
	CUstream stream; /* as passed */
	int ctx_ordinal; /* the device of the context current at the launch */
	size_t args_size; /* bytes of args: the kernel's argument struct (args.h) */
	unsigned char args[FAKE_ARGS_MAX];
};

/* fake_cuda_log(&n): the launches since the last fake_cuda_log_clear(), n of them (at most
 * FAKE_LOG_MAX, the latest). */
typedef const struct fake_launch_rec *(*fake_cuda_log_fn)(size_t *n);
typedef void (*fake_cuda_log_clear_fn)(void);
/* Streams the fake has destroyed or synchronised, by handle, since the log was cleared. */
typedef int (*fake_cuda_stream_calls_fn)(CUstream s, int *destroyed, int *synchronised);

#endif /* APE_FAKE_CUDA_H */
