/* SPDX-License-Identifier: MIT */
/* The OpenCL backend's entry in the registry (runtime/api/registry.c): every op, and where it lives. */
#include "ocl.h"

const struct ape__backend_ops ape__opencl_ops = {
	.abi_version = APE__BACKEND_ABI,
	.name = "opencl",
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
	.synchronize = ape__ocl_synchronize,
	.copy_d2d = ape__ocl_copy_d2d, /* ocl_mem.c */
	.event_timestamp = ape__ocl_event_timestamp,
	.max_alloc = ape__ocl_max_alloc,
};
