/* SPDX-License-Identifier: MIT */
/*
 * The session trace (docs/profiling.md, "Traces"): with APE_TRACE=FILE, every public call of
 * the process, and the copies and kernels of the calls that run through the executor, on one
 * timeline in one Chrome trace-event file, rewritten whole (a temporary file, then a rename)
 * whenever a context is destroyed and at exit. "%p" in the name becomes the process id, so
 * that the ranks of an MPI job write a file each; their process ids keep them apart when the
 * files are merged (ape-trace-merge).
 *
 * Times are the host's monotonic clock (ape__now_ms()), in milliseconds; the executor places a
 * device's spans on it from where its worker started (exec/trace.c). Spans are kept in host
 * memory until the process ends (at most APE__STRACE_MAX of them: beyond, the file says it is
 * incomplete).
 */
#ifndef APE_RUNTIME_STRACE_H
#define APE_RUNTIME_STRACE_H

#include <stdbool.h>

#pragma GCC visibility push(hidden)

#define APE__STRACE_MAX (1 << 20)

/* APE_TRACE is set (read once). */
bool ape__strace_on(void);

/*
 * Adds a complete span ("ph":"X") from t0 to t1 (ape__now_ms() values) on thread `thread` of
 * process `process` (labels; each distinct pair becomes a track), named `name`, of category
 * `cat`, with `args` a JSON object's text or NULL. Copies what it keeps; never fails (out of
 * memory, the span is dropped and the file says it is incomplete).
 */
void ape__strace_span(const char *process, const char *thread, const char *name, const char *cat,
		      double t0, double t1, const char *args);

/* The process label of the host's spans ("libape calls, pid 1234"). */
const char *ape__strace_host(void);

/* The host's thread label of the calling thread ("thread 1234"). */
const char *ape__strace_thread(void);

/* Rewrites the file with every span so far. Never fails: a file that cannot be written is
 * reported once on stderr. */
void ape__strace_flush(void);

#pragma GCC visibility pop
#endif
