/* SPDX-License-Identifier: MIT */
/* The call log and the scope of a public call (core/verbose.h). */
#include "core/verbose.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>

#include "core/error.h"
#include "core/nvtx.h"

static once_flag env_once = ONCE_FLAG_INIT;
static int env_level;
static bool env_json;
static atomic_int errors_level;
/* public calls this thread is inside (a public function calling another is one call) */
static _Thread_local int depth;
static _Thread_local unsigned logged_gen;
static _Thread_local bool logged;

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

int ape__verbose_env(void)
{
	call_once(&env_once, read_env);
	return env_level;
}

bool ape__verbose_json(void)
{
	call_once(&env_once, read_env);
	return env_json;
}

int ape__verbose_errors(void)
{
	call_once(&env_once, read_env);
	return atomic_load(&errors_level);
}

void ape__verbose_raise(int level)
{
	int cur;

	call_once(&env_once, read_env);
	cur = atomic_load(&errors_level);
	while (level > cur && !atomic_compare_exchange_weak(&errors_level, &cur, level))
		;
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

void ape__json_escape(char *dst, unsigned long cap, const char *src)
{
	unsigned long n = 0;

	if (!cap)
		return;
	for (; src && *src; src++) {
		const unsigned char c = (unsigned char)*src;
		char esc[8];
		unsigned long k;

		if (c == '"' || c == '\\')
			snprintf(esc, sizeof(esc), "\\%c", c);
		else if (c < 0x20)
			snprintf(esc, sizeof(esc), "\\u%04x", c);
		else
			esc[0] = (char)c, esc[1] = '\0';
		k = strlen(esc);
		if (n + k >= cap)
			break;
		memcpy(dst + n, esc, k);
		n += k;
	}
	dst[n] = '\0';
}

struct ape__api_scope ape__api_enter(const char *fn)
{
	struct ape__api_scope s = { fn, 0, depth == 0 };

	if (depth++ == 0) {
		s.gen = ape__error_gen();
		logged = false;
		ape__nvtx_push(fn);
	}
	return s;
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
	if (--depth > 0 || !s->outer)
		return;
	ape__nvtx_pop();
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
