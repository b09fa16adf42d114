/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend's entry in the registry (runtime/api/registry.c): every op, and where it
 * lives. Each op sets the message of whatever failed below it (a driver call, a host
 * allocation, the program build); the core's table names the device and the op around it
 * (core/backend.h, "Failure").
 */
#include "ocl.h"
#include "ocl_fast.h"

_Static_assert(APE_BACKEND_ABI_MAJOR == 1, "opencl: written for backend ABI 1: review the changes of "
	       "ape/ape_backend.h's contract, then this backend");

const struct ape_backend_plugin ape__opencl_ops = {
	APE_BACKEND_PLUGIN_HEAD("opencl"),
	.probe = ape__ocl_probe, /* ocl_device.c */
	.device_release = ape__ocl_device_release,
	.buf_alloc = ape__ocl_buf_alloc, /* ocl_mem.c */
	.buf_free = ape__ocl_buf_free,
	.queue_create = ape__ocl_queue_create,
	.queue_destroy = ape__ocl_queue_destroy,
	.copy_h2d = ape__ocl_copy_h2d,
	.copy_d2h = ape__ocl_copy_d2h,
	.fill = ape__ocl_fill,
	.event_record = ape__ocl_event_record,
	.event_wait = ape__ocl_event_wait,
	.event_elapsed = ape__ocl_event_elapsed,
	.event_destroy = ape__ocl_event_destroy,
	.attention = ape__ocl_attention, /* ocl_attention.c */
	.synchronize = ape__ocl_synchronize, /* ocl_mem.c */
	.copy_d2d = ape__ocl_copy_d2d,
	.event_timestamp = ape__ocl_event_timestamp,
	.attention_scratch = ape__ocl_attention_scratch, /* ocl_decode.c */
	.attention_backward = ape__ocl_attention_backward, /* ocl_backward.c */
	.attention_backward_scratch = ape__ocl_attention_backward_scratch,
	.buf_wrap = ape__ocl_buf_wrap, /* ocl_mem.c */
	.queue_wrap = ape__ocl_queue_wrap,
	.native = ape__ocl_native,
	.attention_pages = ape__ocl_decode_pages, /* ocl_decode.c */
	.scratch_alloc = ape__ocl_scratch_alloc, /* ocl_backward.c */
	.scratch_free = ape__ocl_scratch_free,
	.copy_view = ape__ocl_copy_view,
	.attention_merge = ape__ocl_attention_merge, /* ocl_merge.c */
	/* the diagnostics (ENT and MD behind F_DIAG, kernels/attention.cl, strided and each
	 * optional) and the rest of what a device can do: its capabilities (ocl_device.c) */
};
