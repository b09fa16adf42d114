/* SPDX-License-Identifier: MIT */
/*
 * The core's side of the backend contract (core/backend.h, "Registration"): the checks a
 * backend's table and its devices pass before the core uses them, and the core's own table over
 * the backend's ops (runtime/core/ops.c). The context loads backends through it; backends never
 * include it.
 */
#ifndef APE_RUNTIME_OPS_H
#define APE_RUNTIME_OPS_H

#include <stddef.h>

#include "core/backend.h"

#pragma GCC visibility push(hidden)

/*
 * Checks raw (a name; every required op set; each group all or none; none of the core's own
 * members set) and, when it passes, makes it be's: be->raw = raw, and be->ops the core's table
 * over it, rebuilt in place in be->table (so that a pointer to be->ops stays valid). Returns 0;
 * or APE_EBACKEND with the reason in why ("refused: ..."), be untouched. The context calls it
 * before probe; a test wrapper that puts itself between the core and a backend
 * (tests/common/wrapops.c) calls it again with its own table, and with the backend's when it
 * leaves. No op of be may be running meanwhile. Sets no thread message: a refused backend is
 * a state of the context, not a failed call.
 */
int ape__backend_bind(struct ape_backend *be, const struct ape_backend_plugin *raw, char *why,
		      size_t cap);

/*
 * Checks the capabilities dev's backend stated for it (struct ape_be_caps) against that
 * backend's ops: each capability needs the ops it names there. Returns 0; or APE_EBACKEND with
 * the reason in why ("refused: device NAME: ..."). Sets no thread message.
 */
int ape__device_check(const struct ape_device *dev, char *why, size_t cap);

#pragma GCC visibility pop
#endif /* APE_RUNTIME_OPS_H */
