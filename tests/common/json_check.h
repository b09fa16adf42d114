/* SPDX-License-Identifier: MIT */
/*
 * Whether a text is one JSON value and nothing else (RFC 8259's grammar: objects, arrays,
 * strings with their escapes, numbers, true, false, null), for the tests of what libape writes
 * as JSON: APE_VERBOSE_FORMAT=json lines, traces.
 */
#ifndef APE_TEST_JSON_CHECK_H
#define APE_TEST_JSON_CHECK_H

#include <stdbool.h>

bool json_ok(const char *s);

/* A whole file, NUL-terminated (to check what libape wrote), or NULL; the caller frees it. */
char *json_read_file(const char *path);

#endif
