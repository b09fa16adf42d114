/* SPDX-License-Identifier: MIT */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"

/* User text quoted in a message is cut short: it may be anything, a whole file pasted in. */
#define QUOTE_MAX 80

static int __attribute__((format(printf, 3, 4)))
fail(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return APE_EINVAL;
}

static bool name_is(const char *name, const char *arg, size_t len)
{
	return name && strlen(name) == len && !strncmp(name, arg, len);
}

/* The tool and the library it runs on: one version while tools link libape statically, two
 * should a tool ever load another libape than the header it was built with. */
static void __attribute__((noreturn)) print_version(const char *argv0)
{
	const char *slash = strrchr(argv0, '/');
	const char *name = slash ? slash + 1 : argv0;

	printf("%s (libape) %s\n", *name ? name : "ape", ape_version_string());
	if (ape_version() != APE_VERSION)
		printf("built with the libape %d.%d.%d header\n", APE_VERSION_MAJOR,
		       APE_VERSION_MINOR, APE_VERSION_PATCH);
	exit(fflush(stdout) ? 1 : 0);
}

int cli_next(int argc, char *const argv[], int *idx, const struct cli_option *opts,
	     const char **value, char *err, size_t errlen)
{
	const char *arg, *eq;
	size_t len;

	*value = NULL;
	if (*idx >= argc)
		return 0;
	arg = argv[(*idx)++];
	if (arg[0] != '-' || !arg[1])
		return fail(err, errlen, "unexpected argument '%.*s' (see --help)", QUOTE_MAX, arg);
	eq = arg[1] == '-' ? strchr(arg, '=') : NULL;
	len = eq ? (size_t)(eq - arg) : strlen(arg);
	if (name_is("--version", arg, len)) {
		if (eq)
			return fail(err, errlen, "--version takes no value");
		print_version(argc > 0 && argv[0] ? argv[0] : "");
	}
	for (const struct cli_option *o = opts; o->name; o++) {
		if (!name_is(o->name, arg, len) && !name_is(o->alias, arg, len))
			continue;
		if (!o->takes_value) {
			if (eq)
				return fail(err, errlen, "%s takes no value", o->name);
			return o->id;
		}
		if (eq) {
			*value = eq + 1;
		} else {
			if (*idx >= argc)
				return fail(err, errlen, "%s needs a value", o->name);
			*value = argv[(*idx)++];
		}
		return o->id;
	}
	return fail(err, errlen, "unknown option '%.*s' (see --help)", (int)len, arg);
}

int cli_parse_double(const char *flag, const char *text, double *out, char *err, size_t errlen)
{
	char *end;
	double v;

	/* strtod() would skip leading blanks; a quoted " 1" is more likely a mistake */
	if (!*text || isspace((unsigned char)*text))
		return fail(err, errlen, "%s: '%.*s' is not a number", flag, QUOTE_MAX, text);
	errno = 0;
	v = strtod(text, &end);
	if (end == text || *end)
		return fail(err, errlen, "%s: '%.*s' is not a number", flag, QUOTE_MAX, text);
	if (errno == ERANGE && isinf(v))
		return fail(err, errlen, "%s: '%.*s' is out of range", flag, QUOTE_MAX, text);
	*out = v;
	return 0;
}

int cli_parse_finite(const char *flag, const char *text, double *out, char *err, size_t errlen)
{
	double v;
	int ret;

	ret = cli_parse_double(flag, text, &v, err, errlen);
	if (ret)
		return ret;
	if (!isfinite(v))
		return fail(err, errlen, "%s: '%.*s' is not a finite number", flag, QUOTE_MAX,
			    text);
	*out = v;
	return 0;
}

int cli_parse_int64(const char *flag, const char *text, int64_t min, int64_t max, int64_t *out,
		    char *err, size_t errlen)
{
	char *end;
	long long v;

	if (!*text || isspace((unsigned char)*text))
		return fail(err, errlen, "%s: '%.*s' is not an integer", flag, QUOTE_MAX, text);
	errno = 0;
	v = strtoll(text, &end, 10);
	if (end == text || *end)
		return fail(err, errlen, "%s: '%.*s' is not an integer", flag, QUOTE_MAX, text);
	if (errno == ERANGE)
		return fail(err, errlen, "%s: '%.*s' is out of range (it must fit in 64 bits)",
			    flag, QUOTE_MAX, text);
	if (v < min || v > max)
		return fail(err, errlen, "%s: %lld is out of range %" PRId64 "..%" PRId64, flag, v,
			    min, max);
	*out = v;
	return 0;
}

int cli_parse_bytes(const char *flag, const char *text, uint64_t *out, char *err, size_t errlen)
{
	static const char *const units[] = { "", "K", "M", "G", "T" };
	char *end;
	unsigned long long v;
	int shift = -1;

	/* strtoull() would take a sign or a blank: neither is a size */
	if (!isdigit((unsigned char)*text))
		return fail(err, errlen, "%s: '%.*s' is not a size in bytes (e.g. 268435456, 256M)",
			    flag, QUOTE_MAX, text);
	errno = 0;
	v = strtoull(text, &end, 10);
	for (int i = 0; i < 5; i++) {
		size_t n = strlen(units[i]);

		if (strncmp(end, units[i], n))
			continue;
		/* "256M", "256MiB" and "256MB" all mean 256 x 2^20 */
		if (!end[n] || (i && (!strcmp(end + n, "iB") || !strcmp(end + n, "B"))))
			shift = 10 * i;
	}
	if (shift < 0)
		return fail(err, errlen, "%s: '%.*s' is not a size in bytes (e.g. 268435456, 256M)",
			    flag, QUOTE_MAX, text);
	if (errno == ERANGE || (shift && v > (UINT64_MAX >> shift)))
		return fail(err, errlen, "%s: '%.*s' is out of range", flag, QUOTE_MAX, text);
	if (!v)
		return fail(err, errlen, "%s: must be > 0", flag);
	*out = (uint64_t)v << shift;
	return 0;
}

/* One item of a list, copied out so that the number parsers see a terminated string. */
static int parse_list_item(const char *flag, const char *item, size_t len, size_t nth,
			   float *out, char *err, size_t errlen)
{
	char buf[128];
	double v;
	int ret;

	if (!len)
		return fail(err, errlen, "%s: value %zu of the list is empty", flag, nth + 1);
	if (len >= sizeof(buf))
		return fail(err, errlen, "%s: value %zu of the list is too long to be a number",
			    flag, nth + 1);
	memcpy(buf, item, len);
	buf[len] = '\0';
	ret = cli_parse_finite(flag, buf, &v, err, errlen);
	if (ret)
		return ret;
	*out = (float)v;
	if (isinf(*out))
		return fail(err, errlen, "%s: '%s' does not fit in a float", flag, buf);
	return 0;
}

int cli_parse_float_list(const char *flag, const char *text, float **vals, size_t *n, char *err,
			 size_t errlen)
{
	size_t count = 1;
	const char *p = text;
	float *v;

	*vals = NULL;
	*n = 0;
	for (const char *c = text; *c; c++)
		count += *c == ',';
	v = malloc(count * sizeof(*v));
	if (!v) {
		fail(err, errlen, "%s: out of memory", flag);
		return APE_ENOMEM;
	}
	for (size_t i = 0; i < count; i++) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);
		int ret = parse_list_item(flag, p, len, i, &v[i], err, errlen);

		if (ret) {
			free(v);
			return ret;
		}
		p += len + 1;
	}
	*vals = v;
	*n = count;
	return 0;
}

int cli_parse_name(const char *flag, const char *text, int (*from_name)(const char *), int *value,
		   char *err, size_t errlen)
{
	int v = from_name(text);

	if (v < 0)
		return fail(err, errlen, "%s: %s", flag, ape_last_error());
	*value = v;
	return 0;
}
