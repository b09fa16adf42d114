/* SPDX-License-Identifier: MIT */
/* Internal error reporting: every public entry point that fails records a message naming the
 * function, the argument and the value, then returns the negative code. */
#ifndef APE_RUNTIME_ERROR_H
#define APE_RUNTIME_ERROR_H

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

/* Records the thread's last-error message and returns err, so callers write
 * `return ape__error(APE_EINVAL, "%s: q->shape[3] = %lld: must be even", fn, d);`. */
int ape__error(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prefixes the current message with "ctx: " (used when a lower layer already explained). */
int ape__error_prefix(int err, const char *ctx);

/* One-time warnings go to stderr with the "libape: " prefix; the caller keeps the once-flag. */
void ape__warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#pragma GCC visibility pop
#endif
