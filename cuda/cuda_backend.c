/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's entry in the registry (runtime/api/registry.c): every op, and where it
 * lives. Each op sets the message of whatever failed below it (a driver call, the context or
 * the modules on first use, a host allocation); the core's table names the device and the op
 * around it (core/backend.h, "Failure").
 */
#include "cu.h"

_Static_assert(APE_BACKEND_ABI_MAJOR == 1, "cuda: written for backend ABI 1: review the changes of "
	       "ape/ape_backend.h's contract, then this backend");

const struct ape_backend_plugin ape__cuda_ops = {
	APE_BACKEND_PLUGIN_HEAD("cuda"),
	.probe = ape__cu_probe, /* cuda_device.c */
	.teardown = ape__cu_teardown,
	.device_release = ape__cu_device_release,
	.buf_alloc = ape__cu_buf_alloc, /* cuda_mem.c */
	.buf_free = ape__cu_buf_free,
	.queue_create = ape__cu_queue_create,
	.queue_destroy = ape__cu_queue_destroy,
	.copy_h2d = ape__cu_copy_h2d,
	.copy_d2h = ape__cu_copy_d2h,
	.fill = ape__cu_fill,
	.event_record = ape__cu_event_record,
	.event_wait = ape__cu_event_wait,
	.event_elapsed = ape__cu_event_elapsed,
	.event_destroy = ape__cu_event_destroy,
	.attention = ape__cu_attention, /* cuda_attention.c */
	.synchronize = ape__cu_synchronize, /* cuda_mem.c */
	.host_register = ape__cu_host_register,
	.host_unregister = ape__cu_host_unregister,
	.copy_d2d = ape__cu_copy_d2d,
	.event_timestamp = ape__cu_event_timestamp,
	.attention_scratch = ape__cu_attention_scratch, /* cuda_attention.c */
	.attention_backward = ape__cu_attention_backward, /* cuda_backward.c */
	.attention_backward_scratch = ape__cu_attention_backward_scratch,
	.buf_wrap = ape__cu_buf_wrap, /* cuda_mem.c */
	.queue_wrap = ape__cu_queue_wrap,
	.native = ape__cu_native, /* cuda_device.c */
	.scratch_alloc = ape__cu_scratch_buf_alloc, /* cuda_backward.c */
	.scratch_free = ape__cu_scratch_buf_free,
	.copy_view = ape__cu_copy_view,
	.attention_merge = ape__cu_attention_merge, /* cuda_merge.c */
	/* the decode reading a KV cache's or pool's pages in place: dense launches of a few rows
	 * and ragged ones of a few rows per segment (cuda_attention.c) */
	.attention_pages = ape__cu_attention_pages,
	/* the diagnostics (the _diag kernels, strided and each optional) and the rest of what a
	 * device can do: its capabilities (cuda_device.c) */
};
