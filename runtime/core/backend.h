/* SPDX-License-Identifier: MIT */
/*
 * The core's side of the backend interface. The interface itself, what every backend (built in
 * or a plugin) sees, is the public include/ape/ape_backend.h; this header adds what only the
 * core reads: a backend as loaded in one context (the core's table of trampolines around the
 * backend's own), and the record of the kernel paths a call took.
 */
#ifndef APE_RUNTIME_BACKEND_H
#define APE_RUNTIME_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"
#include "ape/ape_backend.h"

#pragma GCC visibility push(hidden)

/* A backend as loaded in one context. */
struct ape_backend {
	/*
	 * The core's table (runtime/core/ops.c), what the core calls: every op raw has, the
	 * fallible ones behind a trampoline that names the device and the op when they fail, and
	 * NULL where raw has none. Points at table.
	 */
	const struct ape_backend_plugin *ops;
	/* The backend's own table, as registered and checked: own, the core's copy of it,
	 * completed to this library's size. Only the core's table calls it. */
	const struct ape_backend_plugin *raw;
	struct ape_context *ctx;
	void *priv; /* the backend's own state (ape_be_priv()) */
	/* The caller's own native context and device to build a device on
	 * (ape_context_options.opencl_context, .opencl_device, for the OpenCL backend), or NULL:
	 * set before probe, read by it (ape_be_import()). */
	struct {
		void *context, *device;
	} import;
	struct ape_backend_plugin table; /* the storage of *ops: the core's, never the backend's */
	struct ape_backend_plugin own; /* the storage of *raw */
};

/*
 * The paths a call's launches took, summed (the core owns it; one per device worker, merged
 * by the core): launches[p] counts the launches that noted path p, why[p] is the reason the
 * last of them gave (a static string).
 */
struct ape_be_path_log {
	uint32_t launches[APE_BE_PATH_COUNT];
	const char *why[APE_BE_PATH_COUNT];
};

/* The paths noted in log, each once, joined by '+' in the enum's order (ape_stats.path), into
 * buf (cap bytes, terminated; "" when none). */
void ape__path_names(char *buf, size_t cap, const struct ape_be_path_log *log);

/* Adds src's counts to dst (why: src's where it has one). */
void ape__path_merge(struct ape_be_path_log *dst, const struct ape_be_path_log *src);

#pragma GCC visibility pop
#endif /* APE_RUNTIME_BACKEND_H */
