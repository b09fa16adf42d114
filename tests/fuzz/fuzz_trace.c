/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: what profiling writes from names it does not choose (docs/profiling.md).
 * ape_range_push() takes any caller's name, and call lines and traces quote device names from
 * drivers: every such text goes through ape__json_escape() into the JSON of APE_VERBOSE_FORMAT
 * and APE_TRACE. The input's first byte is the room of the escape's buffer, the rest the text.
 * Besides "no crash, no leak, no UB" it checks what the escape promises: the result is
 * terminated inside the room, and between quotes it is one JSON string (the strict checker of
 * the tests); and that the session trace, with a range of that name added, is still one JSON
 * document (checked every 2048 inputs: the file holds every span so far).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape/ape.h"
#include "common/json_check.c" /* the checker itself: the fuzz build links no test objects */
#include "core/strace.h"
#include "core/verbose.h"

static char trace_path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv);

static void remove_trace(void)
{
	unlink(trace_path);
}
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	snprintf(trace_path, sizeof(trace_path), "/tmp/fuzz_trace.%d.json", (int)getpid());
	setenv("APE_TRACE", trace_path, 1);
	/* registered before the trace's own flush at exit, so it runs after it */
	atexit(remove_trace);
	return 0;
}

static void check(int cond, const char *what)
{
	if (!cond) {
		fprintf(stderr, "fuzz_trace: broken promise: %s\n", what);
		abort();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static unsigned long inputs;
	char *text, *out, *quoted;
	size_t cap;

	if (size < 1)
		return 0;
	cap = (size_t)data[0] + 1;
	text = malloc(size);
	out = malloc(cap + 16);
	quoted = malloc(cap + 3);
	check(text && out && quoted, "memory");
	memcpy(text, data + 1, size - 1);
	text[size - 1] = '\0';
	/* the room after it must stay untouched */
	memset(out, 0x5a, cap + 16);
	ape__json_escape(out, cap, text);
	check(memchr(out, '\0', cap) != NULL, "the escaped text is terminated inside the room");
	for (size_t i = cap; i < cap + 16; i++)
		check(out[i] == 0x5a, "nothing written past the room");
	snprintf(quoted, cap + 3, "\"%s\"", out);
	check(json_ok(quoted), "the escaped text is one JSON string between quotes");
	/* the same text as a caller's range, into the session trace */
	ape_range_push(text);
	ape_range_pop();
	if (++inputs % 2048 == 0) {
		char *file;

		ape__strace_flush();
		file = json_read_file(trace_path);
		check(file != NULL, "the session trace was written");
		check(json_ok(file), "the session trace is one JSON document");
		free(file);
	}
	free(text);
	free(out);
	free(quoted);
	return 0;
}
