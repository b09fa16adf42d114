/* SPDX-License-Identifier: MIT */
/*
 * Command-line helpers shared by the tools: an option walker and number parsers whose messages
 * name the flag and quote the text that was wrong ("--delta: 'abc' is not a number").
 *
 * Every function returns 0 or APE_EINVAL (APE_ENOMEM for the list parser), filling `err` with
 * the message when errlen > 0.
 */
#ifndef APE_TOOLS_CLI_H
#define APE_TOOLS_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One option a tool accepts; a table of them ends with an entry whose name is NULL. */
struct cli_option {
	const char *name; /* "--delta" */
	const char *alias; /* "-q", or NULL */
	bool takes_value;
	int id; /* > 0: what cli_next() returns for it */
};

/**
 * Steps through argv from *idx (start at 1). Values are taken from "--name VALUE" or
 * "--name=VALUE". "--version" is every tool's: it prints the tool's name (from argv[0]) and the
 * libape version it runs on, and exits (0, or 1 when stdout cannot be written).
 * \param[out] value the option's value, or NULL for an option without one
 * \return the option's id; 0 when argv is exhausted; APE_EINVAL for an unknown option, a missing
 *         or unexpected value, or an argument that is not an option.
 */
int cli_next(int argc, char *const argv[], int *idx, const struct cli_option *opts,
	     const char **value, char *err, size_t errlen);

/* Any double strtod() accepts, Inf and NaN included; no surrounding blanks or trailing text. */
int cli_parse_double(const char *flag, const char *text, double *out, char *err, size_t errlen);

/* The same, refusing Inf and NaN. */
int cli_parse_finite(const char *flag, const char *text, double *out, char *err, size_t errlen);

/* A decimal integer in [min, max]; says so when it overflows 64 bits. */
int cli_parse_int64(const char *flag, const char *text, int64_t min, int64_t max, int64_t *out,
		    char *err, size_t errlen);

/* A size in bytes, > 0: digits, optionally followed by K, M, G or T (powers of 1024; "KiB" and
 * "KB" are read the same way). */
int cli_parse_bytes(const char *flag, const char *text, uint64_t *out, char *err, size_t errlen);

/**
 * Comma-separated finite numbers that fit a float: "0.1,0.2,0.3".
 * \param[out] vals a new array of *n floats (free() it); NULL on failure
 */
int cli_parse_float_list(const char *flag, const char *text, float **vals, size_t *n, char *err,
			 size_t errlen);

/**
 * A word of one of libape's name tables: \p from_name is ape_dtype_from_name() or another
 * ape_*_from_name(). The message is the flag followed by the library's, which lists the words.
 * \param[out] value what from_name returned for it (>= 0)
 */
int cli_parse_name(const char *flag, const char *text, int (*from_name)(const char *), int *value,
		   char *err, size_t errlen);

#endif
