/* SPDX-License-Identifier: MIT */
/* The CUDA backend's entry in the registry (runtime/api/registry.c): every op, and where it lives. */
#include "cu.h"

const struct ape__backend_ops ape__cuda_ops = {
	.abi_version = APE__BACKEND_ABI,
	.name = "cuda",
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
	.synchronize = ape__cu_synchronize,
	.host_register = ape__cu_host_register,
	.host_unregister = ape__cu_host_unregister,
	.copy_d2d = ape__cu_copy_d2d,
	.event_timestamp = ape__cu_event_timestamp,
	.attention_scratch = ape__cu_attention_scratch,
	.max_alloc = ape__cu_max_alloc,
};
