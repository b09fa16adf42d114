/* SPDX-License-Identifier: MIT */
#include "core/error.h"

#include "core/backend.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Per-thread so that concurrent calls never see each other's messages; with the generation
 * (bumped by every new message) and core/verbose.c's call depth, the only thread-local state
 * in the library. */
static _Thread_local char last_error[1024];
static _Thread_local unsigned error_gen;

unsigned ape__error_gen(void)
{
	return error_gen;
}

const char *ape_strerror(int err)
{
	switch (err) {
	case 0:
		return "success";
#define APE__ERR_TEXT(name, value, text)                                                           \
	case value:                                                                                \
		return text;
		APE_ERRNO_MAP(APE__ERR_TEXT)
#undef APE__ERR_TEXT
	}
	return "unknown error"; /* static: unlike uv_strerror, never allocates for unknown codes */
}

const char *ape_err_name(int err)
{
	switch (err) {
	case 0:
		return "APE_OK";
#define APE__ERR_NAME(name, value, text)                                                           \
	case value:                                                                                \
		return "APE_" #name;
		APE_ERRNO_MAP(APE__ERR_NAME)
#undef APE__ERR_NAME
	}
	return "APE_EUNKNOWN";
}

const char *ape_last_error(void)
{
	return last_error;
}

/* Formats into a copy first: an argument may be the current message itself (a caller adding
 * context around what failed below it, ape_last_error() passed to "%s"). */
static int verror(int err, const char *fmt, va_list ap)
{
	char tmp[sizeof(last_error)];

	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	memcpy(last_error, tmp, sizeof(last_error));
	error_gen++;
	return err;
}

int ape__error(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	err = verror(err, fmt, ap);
	va_end(ap);
	return err;
}

/* The same, for backends (ape/ape_backend.h): exported, so that a plugin sets it too. */
int ape_be_error(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	err = verror(err, fmt, ap);
	va_end(ap);
	return err;
}

int ape__error_prefix(int err, const char *ctx)
{
	char tmp[sizeof(last_error)];
	size_t n;

	memcpy(tmp, last_error, sizeof(tmp));
	error_gen++; /* a failure reported from below (an op's own message): this call's */
	n = (size_t)snprintf(last_error, sizeof(last_error), "%s: ", ctx);
	if (n < sizeof(last_error))
		snprintf(last_error + n, sizeof(last_error) - n, "%s",
			 tmp[0] ? tmp : ape_strerror(err));
	return err;
}

/* "opencl:0 NAME" or, where the device has a PCI address, "cuda:0 NAME (0000:42:00.0)". */
static void device_label(const struct ape_device *dev, char *buf, size_t cap)
{
	int n = snprintf(buf, cap, "%s:%d %s", dev->info.backend, dev->info.backend_index,
			 dev->info.name);

	if (dev->info.pci_address[0] && n >= 0 && (size_t)n < cap)
		snprintf(buf + n, cap - (size_t)n, " (%s)", dev->info.pci_address);
}

int ape__error_on(int err, const struct ape_device *dev)
{
	char label[sizeof(dev->info.backend) + sizeof(dev->info.name) +
		   sizeof(dev->info.pci_address) + 16];

	if (strstr(last_error, dev->info.name))
		return err;
	device_label(dev, label, sizeof(label));
	return ape__error_prefix(err, label);
}

int ape__op_error(int err, const struct ape_device *dev, const char *op)
{
	char label[sizeof(dev->info.backend) + sizeof(dev->info.name) +
		   sizeof(dev->info.pci_address) + 48];
	size_t n;

	if (!err)
		return 0;
	device_label(dev, label, sizeof(label));
	n = strlen(label);
	snprintf(label + n, sizeof(label) - n, ": %s", op);
	return ape__error_prefix(err, label);
}

int ape__error_written(int err, int64_t done, int64_t of, bool in_place)
{
	size_t n = strlen(last_error);

	if (of > 0 && done >= of)
		snprintf(last_error + n, sizeof(last_error) - n,
			 "; O and LSE hold %" PRId64 " of %" PRId64 " query chunks", done, of);
	else if (in_place && done > 0)
		snprintf(last_error + n, sizeof(last_error) - n,
			 "; O and LSE hold %" PRId64 " of %" PRId64 " query chunks, the others were "
			 "computed in place and are unspecified", done, of);
	else if (in_place)
		snprintf(last_error + n, sizeof(last_error) - n,
			 "; O and LSE were computed in place and are unspecified");
	else if (done > 0)
		snprintf(last_error + n, sizeof(last_error) - n,
			 "; O and LSE hold %" PRId64 " of %" PRId64 " query chunks, the rest untouched",
			 done, of);
	return err;
}

int ape__error_suffix(int err, const char *text)
{
	size_t n = strlen(last_error);

	snprintf(last_error + n, sizeof(last_error) - n, "%s", text);
	return err;
}

static void vwarn(const char *fmt, va_list ap)
{
	fputs("libape: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
}

void ape__warn(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vwarn(fmt, ap);
	va_end(ap);
}

void ape_be_warn(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vwarn(fmt, ap);
	va_end(ap);
}
