/* SPDX-License-Identifier: MIT */
/* Internal error reporting: every public entry point that fails records a message naming the
 * function, the argument and the value, then returns the negative code. */
#ifndef APE_RUNTIME_ERROR_H
#define APE_RUNTIME_ERROR_H

#include <stdint.h>

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

/* Records the thread's last-error message and returns err, so callers write
 * `return ape__error(APE_EINVAL, "%s: q->shape[3] = %lld: must be even", fn, d);`. */
int ape__error(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The thread's error generation: changes whenever ape__error() sets a new message (the call
 * log's test that a call failed; core/verbose.h). */
unsigned ape__error_gen(void);

/* Prefixes the current message with "ctx: " (used when a lower layer already explained). */
int ape__error_prefix(int err, const char *ctx);

struct ape_device;
/* Prefixes the current message with the device ("opencl:0 NAME: ") unless it already names it:
 * a caller of a multi-device call, or of a cache on one of several devices, must learn which
 * device failed, whichever layer below reported it. */
int ape__error_on(int err, const struct ape_device *dev);

/*
 * For the core's table of a backend's ops (runtime/core/ops.c; backends never call it): reports
 * that `op` failed on dev. Prefixes the thread's message, which the failing step below the op
 * set ("clFinish: CL_OUT_OF_RESOURCES (-5)"), with the device and the op:
 * "opencl:0 NAME (0000:03:00.0): synchronize: clFinish: ...". Returns err; 0 passes through
 * untouched, so that a trampoline may end `return ape__op_error(ret, dev, "x");`.
 */
int ape__op_error(int err, const struct ape_device *dev, const char *op);

/* Appends to the current message how much of O and LSE a failed call of `of` query chunks
 * had already written ("; O and LSE hold 3 of 8 query chunks, the rest untouched"; nothing
 * when done == 0). in_place: launches wrote O or LSE where they lie, so the rows of chunks
 * not done are unspecified ("...the others were computed in place and are unspecified").
 * All done (a failure after the work, such as the trace file's): "...hold 8 of 8 query chunks". */
int ape__error_written(int err, int64_t done, int64_t of, bool in_place);

/* Appends `text` to the current message; returns err. */
int ape__error_suffix(int err, const char *text);

/* One-time warnings go to stderr with the "libape: " prefix; the caller keeps the once-flag. */
void ape__warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#pragma GCC visibility pop
#endif
