/* SPDX-License-Identifier: MIT */
/*
 * The example backend plugin (docs/backends.md, "The example"): what its two files share.
 * example_backend.c is the ABI side (the table, the device, memory, queues, events);
 * example_kernels.c is the arithmetic (the attention and its gradients). A vendor's backend
 * keeps the same split: the first file becomes calls into its driver, the second its kernels.
 *
 * Only the installed headers are included (ape/ape_backend.h, and ape/ape_math.h in the kernels):
 * the plugin builds against `make install`'s include folder and links -lape, nothing else.
 */
#ifndef EXAMPLE_H
#define EXAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include "ape/ape_backend.h"

/*
 * Device memory. The backend defines struct ape_be_buf as it likes: the core only passes the
 * pointers around. Here a "device" allocation is host memory; a real backend keeps its
 * driver's handle here (a cl_mem, a CUdeviceptr) and never lets the core see inside.
 */
struct ape_be_buf {
	size_t size; /* bytes asked for */
	size_t held; /* bytes counted against the device's memory (size rounded up) */
	void *data; /* 64-byte aligned */
};

/* A launch's buffers as host pointers (the kernels run on the host). NULL stays NULL. */
static inline void *example_ptr(const struct ape_be_buf *b)
{
	return b ? b->data : NULL;
}

/*
 * The kernels (example_kernels.c). Each computes a whole launch on the calling thread, in
 * float64, with every visible key (nothing is skipped), and notes its path. They allocate
 * nothing and cannot fail: the ops that call them return 0.
 */
void example_attention(const struct ape_be_launch *l);
void example_attention_backward(const struct ape_be_bwd_launch *l);

#endif
