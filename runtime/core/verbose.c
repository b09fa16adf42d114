/* SPDX-License-Identifier: MIT */
/* The call log and the scope of a public call (core/verbose.h). */
#include "core/verbose.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/nvtx.h"
#include "core/strace.h"

static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static int env_level;
static bool env_json;
static atomic_int errors_level;
/* public calls this thread is inside (a public function calling another is one call) */
static _Thread_local int depth;
static _Thread_local unsigned logged_gen;
static _Thread_local bool logged;
static _Thread_local char *span_args; /* the current call's, for the session trace */
/*
 * Whether a public call's scope has anything to do: 1 when errors are logged (APE_VERBOSE, or a
 * context's level), the session trace is on, or an NVTX tool may attach
 * (NVTX_INJECTION64_PATH, how Nsight Systems attaches); -1 until the environment was read.
 * Otherwise a scope is one relaxed load on the way in and one test on the way out, so that a
 * public call costs nothing measurable with all of it off (bench/log_off.c).
 */
static atomic_int observing = -1;

static void read_env(void)
{
	const char *v = getenv("APE_VERBOSE"), *f = getenv("APE_VERBOSE_FORMAT");

	if (v && *v) {
		char *end;
		long l = strtol(v, &end, 10);

		if (*end || l < 0 || l > APE__VERBOSE_MAX)
			ape__warn("APE_VERBOSE=\"%s\" ignored: expected 0, 1 or 2", v);
		else
			env_level = (int)l;
	}
	if (f && *f) {
		if (!strcmp(f, "json"))
			env_json = true;
		else if (strcmp(f, "text"))
			ape__warn("APE_VERBOSE_FORMAT=\"%s\" ignored: expected text or json", f);
	}
	atomic_store(&errors_level, env_level);
}

static int observing_now(void)
{
	int v = atomic_load_explicit(&observing, memory_order_relaxed);

	if (v < 0) {
		const char *nvtx = getenv("NVTX_INJECTION64_PATH");
		int want = ape__verbose_errors() > 0 || ape__strace_on();

#if defined(APE_WITH_NVTX)
		want |= nvtx && *nvtx;
#else
		(void)nvtx;
#endif
		/* a raise (a context's level) may have stored 1 meanwhile: never lower it */
		atomic_compare_exchange_strong(&observing, &v, want);
		v = atomic_load(&observing);
	}
	return v;
}

int ape__verbose_env(void)
{
	pthread_once(&env_once, read_env);
	return env_level;
}

bool ape__verbose_json(void)
{
	pthread_once(&env_once, read_env);
	return env_json;
}

int ape__verbose_errors(void)
{
	pthread_once(&env_once, read_env);
	return atomic_load(&errors_level);
}

void ape__verbose_raise(int level)
{
	int cur;

	pthread_once(&env_once, read_env);
	cur = atomic_load(&errors_level);
	while (level > cur && !atomic_compare_exchange_weak(&errors_level, &cur, level))
		;
	if (level > 0)
		atomic_store(&observing, 1);
}

void ape__vlog(const char *fmt, ...)
{
	char line[4096];
	va_list ap;
	int n;

	memcpy(line, "libape: ", 8);
	va_start(ap, fmt);
	n = vsnprintf(line + 8, sizeof(line) - 9, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	n = 8 + (n < (int)sizeof(line) - 9 ? n : (int)sizeof(line) - 10);
	line[n++] = '\n';
	/* one write of the whole line: lines of concurrent calls never interleave */
	fwrite(line, 1, (size_t)n, stderr);
}

/* The length of the well-formed UTF-8 sequence at s (RFC 3629: no overlong forms, no
 * surrogates, nothing past U+10FFFF), or 0 when the bytes there are not one. */
static int utf8_len(const unsigned char *s)
{
	const unsigned char c = s[0];
	int n;
	unsigned char lo = 0x80, hi = 0xbf;

	if (c >= 0xc2 && c <= 0xdf)
		n = 2;
	else if (c >= 0xe0 && c <= 0xef)
		n = 3, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
	else if (c >= 0xf0 && c <= 0xf4)
		n = 4, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
	else
		return 0;
	if (s[1] < lo || s[1] > hi)
		return 0;
	for (int i = 2; i < n; i++)
		if (s[i] < 0x80 || s[i] > 0xbf)
			return 0;
	return n;
}

void ape__json_escape(char *dst, unsigned long cap, const char *src)
{
	unsigned long n = 0;

	if (!cap)
		return;
	for (; src && *src; src++) {
		const unsigned char c = (unsigned char)*src;
		char esc[8];
		unsigned long k;
		int u = 0;

		if (c == '"' || c == '\\') {
			snprintf(esc, sizeof(esc), "\\%c", c);
		} else if (c < 0x20 || c == 0x7f) {
			snprintf(esc, sizeof(esc), "\\u%04x", c);
		} else if (c < 0x80) {
			esc[0] = (char)c, esc[1] = '\0';
		} else if ((u = utf8_len((const unsigned char *)src)) > 0) {
			memcpy(esc, src, (size_t)u); /* a character: copied whole */
			esc[u] = '\0';
		} else {
			snprintf(esc, sizeof(esc), "\\ufffd"); /* a byte that is not UTF-8 */
		}
		k = strlen(esc);
		if (n + k >= cap)
			break;
		memcpy(dst + n, esc, k);
		n += k;
		if (u > 1)
			src += u - 1;
	}
	dst[n] = '\0';
}

struct ape__api_scope ape__api_enter(const char *fn)
{
	struct ape__api_scope s = { fn, 0, false, false, 0 };

	if (!observing_now())
		return s;
	s.entered = true;
	s.outer = depth == 0;
	if (depth++ == 0) {
		s.gen = ape__error_gen();
		logged = false;
		if (ape__strace_on())
			s.t0 = ape__now_ms();
		ape__nvtx_push(fn);
	}
	return s;
}

void ape__api_span_args(const char *json)
{
	free(span_args);
	span_args = json ? ape__strdup(json) : NULL;
}

int ape__api_depth(void)
{
	return depth;
}

void ape__api_logged(void)
{
	logged = true;
	logged_gen = ape__error_gen();
}

void ape__api_leave(struct ape__api_scope *s)
{
	if (!s->entered || --depth > 0 || !s->outer)
		return;
	ape__nvtx_pop();
	if (s->t0 > 0) {
		char err[1200];
		const char *args = span_args;

		if (ape__error_gen() != s->gen && !args) {
			char msg[1100];

			ape__json_escape(msg, sizeof(msg), ape_last_error());
			snprintf(err, sizeof(err), "{\"error\":\"%s\"}", msg);
			args = err;
		}
		ape__strace_span(ape__strace_host(), ape__strace_thread(), s->fn, "call", s->t0,
				 ape__now_ms(), args);
		ape__api_span_args(NULL);
	}
	if (ape__error_gen() != s->gen && !(logged && logged_gen == ape__error_gen()) &&
	    ape__verbose_errors() > 0) {
		if (ape__verbose_json()) {
			char msg[2048];

			ape__json_escape(msg, sizeof(msg), ape_last_error());
			ape__vlog("{\"call\":\"%s\",\"error\":\"%s\"}", s->fn, msg);
		} else {
			ape__vlog("%s: error: %s", s->fn, ape_last_error());
		}
	}
}
