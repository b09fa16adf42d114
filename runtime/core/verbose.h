/* SPDX-License-Identifier: MIT */
/*
 * The call log (APE_VERBOSE; docs/profiling.md) and the scope of a public call: what every
 * public entry point does on the way in and out (the NVTX range, the error line), so that it is
 * written once. Lines go to stderr, each "libape: " and one line written at once (calls on
 * several threads never interleave inside a line).
 */
#ifndef APE_RUNTIME_VERBOSE_H
#define APE_RUNTIME_VERBOSE_H

#include <stdbool.h>

#pragma GCC visibility push(hidden)

/* The levels: 0 quiet, 1 a line per call (and every error), 2 the planner's decisions too. */
#define APE__VERBOSE_MAX 2

/* APE_VERBOSE (0, 1 or 2; unset or empty: 0; anything else: 0 with a warning), read once. */
int ape__verbose_env(void);
/* APE_VERBOSE_FORMAT=json: each line one JSON object after the "libape: " prefix; read once. */
bool ape__verbose_json(void);
/* The level failing calls are logged at: the larger of APE_VERBOSE and every level a context
 * was created with (ape_context_options.verbose): an error may come before any device is
 * known. */
int ape__verbose_errors(void);
/* A context was created with this level. */
void ape__verbose_raise(int level);

/* Writes "libape: " and the formatted text as one line to stderr. */
void ape__vlog(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/*
 * A JSON string's body: src with '"', '\\' and control characters escaped, well-formed UTF-8
 * kept, any other byte as U+FFFD, into dst (cap bytes, always terminated; cut short between
 * characters rather than overflowing), so that the text is valid JSON whatever src holds.
 */
void ape__json_escape(char *dst, unsigned long cap, const char *src);

/*
 * The scope of a public call (APE__API_CALL at the top of its body): on entry it opens an
 * NVTX range named after the call (when built with NVTX), on exit it closes it and, when the
 * call set an error message and no line reported it yet (ape__api_logged()), logs the message
 * at ape__verbose_errors() > 0; with APE_TRACE, it adds the call's span to the session trace
 * (core/strace.h), its arguments what ape__api_span_args() gave. Nested public calls (one public function calling another) are
 * one scope: the outermost.
 */
struct ape__api_scope {
	const char *fn;
	unsigned gen; /* the thread's error generation on entry (core/error.h) */
	bool entered; /* anything to do (something observes calls): the depth counts it */
	bool outer;
	double t0; /* when it began, for the session trace (core/strace.h); 0 when off */
};

struct ape__api_scope ape__api_enter(const char *fn);
void ape__api_leave(struct ape__api_scope *s);
/* The current error was reported in a call's own line: the scope does not repeat it. */
void ape__api_logged(void);
/* The arguments (a JSON object's text, copied) of the session trace's span of the current
 * outermost call: what its line says (api/stats.c). */
void ape__api_span_args(const char *json);

/* Public calls this thread is inside now (1 in a call's own code, 0 outside any). */
int ape__api_depth(void);

#define APE__API_CALL(name)                                                                        \
	struct ape__api_scope ape__scope __attribute__((cleanup(ape__api_leave), unused)) =        \
		ape__api_enter(name)

#pragma GCC visibility pop
#endif
