/* SPDX-License-Identifier: MIT */
/* A small JSON checker for the tests of libape's JSON output (tests/common/json_check.h). */
#include "json_check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *json_value(const char *s);

static const char *json_ws(const char *s)
{
	while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')
		s++;
	return s;
}

/* A string: no raw control characters, known escapes (\u with four hex digits), and
 * well-formed UTF-8 (RFC 3629) */
static const char *json_string(const char *s)
{
	if (*s != '"')
		return NULL;
	for (s++; *s && *s != '"'; s++) {
		const unsigned char c = (unsigned char)*s;

		if (c < 0x20)
			return NULL;
		if (c == '\\') {
			s++;
			if (!*s || !strchr("\"\\/bfnrtu", *s))
				return NULL;
			if (*s == 'u')
				for (int i = 0; i < 4; i++)
					if (!*++s || !strchr("0123456789abcdefABCDEF", *s))
						return NULL;
		} else if (c >= 0x80) {
			const unsigned char *u = (const unsigned char *)s;
			int n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3
						    : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
			const unsigned char lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
			const unsigned char hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;

			if (!n || u[1] < lo || u[1] > hi)
				return NULL;
			for (int i = 2; i < n; i++)
				if (u[i] < 0x80 || u[i] > 0xbf)
					return NULL;
			s += n - 1;
		}
	}
	return *s == '"' ? s + 1 : NULL;
}

/* RFC 8259's number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? (no NaN, no Infinity) */
static const char *json_number(const char *s)
{
	if (*s == '-')
		s++;
	if (*s == '0')
		s++;
	else if (*s >= '1' && *s <= '9')
		while (*s >= '0' && *s <= '9')
			s++;
	else
		return NULL;
	if (*s == '.') {
		if (!(*++s >= '0' && *s <= '9'))
			return NULL;
		while (*s >= '0' && *s <= '9')
			s++;
	}
	if (*s == 'e' || *s == 'E') {
		s++;
		if (*s == '+' || *s == '-')
			s++;
		if (!(*s >= '0' && *s <= '9'))
			return NULL;
		while (*s >= '0' && *s <= '9')
			s++;
	}
	return s;
}

static const char *json_value(const char *s)
{
	s = json_ws(s);
	if (*s == '{' || *s == '[') {
		const char close = *s == '{' ? '}' : ']';

		s = json_ws(s + 1);
		if (*s == close)
			return s + 1;
		for (;;) {
			if (close == '}') {
				s = json_string(json_ws(s));
				if (!s || *(s = json_ws(s)) != ':')
					return NULL;
				s++;
			}
			s = json_value(s);
			if (!s)
				return NULL;
			s = json_ws(s);
			if (*s == close)
				return s + 1;
			if (*s != ',')
				return NULL;
			s++;
		}
	}
	if (*s == '"')
		return json_string(s);
	if (!strncmp(s, "true", 4) || !strncmp(s, "null", 4))
		return s + 4;
	if (!strncmp(s, "false", 5))
		return s + 5;
	return json_number(s);
}

bool json_ok(const char *s)
{
	const char *e = json_value(s);

	return e && *json_ws(e) == '\0';
}

char *json_read_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	char *buf;
	long n;

	if (!f)
		return NULL;
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fseek(f, 0, SEEK_SET);
	buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
	if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
		free(buf);
		buf = NULL;
	}
	if (buf)
		buf[n] = '\0';
	fclose(f);
	return buf;
}
