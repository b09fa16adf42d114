/* SPDX-License-Identifier: MIT */
/* What the .npy reader (npy_read.c) and writer (npy_write.c) share: constants and messages. */
#ifndef APE_TOOLS_NPY_INTERNAL_H
#define APE_TOOLS_NPY_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>

#include "npy.h"

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
#define NPY_ALIGN 64
/* Spare spaces NumPy >= 1.23 leaves after the dict so that the first axis can grow in place. */
#define NPY_GROWTH_DIGITS 21
#define NPY_ACCEPTED "accepted: '<f4' (float32) and '<f2' (float16)"
#define NPY_ACCEPTED_INT "accepted: '<i8' (int64) and '<i4' (int32)"

/* Writes the message into err (when errlen > 0) and returns code. */
int npy__failv(int code, char *err, size_t errlen, const char *fmt, va_list ap);
int npy__fail(int code, char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* A bounded string builder: output is cut short, never overrun, and always terminated. */
struct sbuf {
	char *p;
	size_t cap;
	size_t len; /* what would have been written without the bound */
};

void npy__sb_printf(struct sbuf *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* File bytes shown in a message: printable ASCII as is, the rest escaped, long text cut short. */
void npy__quote_bytes(const unsigned char *s, size_t n, char *out, size_t cap);

/* "<f4" / "<f2", or NULL for a type .npy cannot hold. */
const char *npy__descr_of(ape_dtype dt);
/* The descr of what info holds: "<i8" / "<i4" for an integer array, else as npy__descr_of(). */
const char *npy__info_descr(const struct npy_info *info);

/* Fills info->count and info->nbytes from the shape; APE_EFORMAT when they overflow. */
int npy__compute_size(struct npy_info *info, char *err, size_t errlen);

#endif
