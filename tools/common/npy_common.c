/* SPDX-License-Identifier: MIT */
/* Messages and formatting shared by the .npy reader and writer. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "npy_internal.h"

/* ------------------------------------------------------------------ messages */

int npy__failv(int code, char *err, size_t errlen, const char *fmt, va_list ap)
{
	if (err && errlen)
		vsnprintf(err, errlen, fmt, ap);
	return code;
}

int npy__fail(int code, char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	npy__failv(code, err, errlen, fmt, ap);
	va_end(ap);
	return code;
}

void npy__sb_printf(struct sbuf *sb, const char *fmt, ...)
{
	size_t used = sb->len < sb->cap ? sb->len : sb->cap;
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(sb->p + used, sb->cap - used, fmt, ap);
	va_end(ap);
	if (n > 0)
		sb->len += (size_t)n;
}

void npy__quote_bytes(const unsigned char *s, size_t n, char *out, size_t cap)
{
	struct sbuf sb = { out, cap, 0 };
	size_t shown = n > 40 ? 40 : n;

	out[0] = '\0';
	for (size_t i = 0; i < shown; i++) {
		if (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '\\')
			npy__sb_printf(&sb, "%c", s[i]);
		else
			npy__sb_printf(&sb, "\\x%02x", s[i]);
	}
	if (shown < n)
		npy__sb_printf(&sb, "...");
}

void npy_format_shape(const int64_t *shape, int ndim, char *out, size_t cap)
{
	struct sbuf sb = { out, cap, 0 };

	npy__sb_printf(&sb, "(");
	for (int i = 0; i < ndim; i++)
		npy__sb_printf(&sb, "%s%" PRId64, i ? ", " : "", shape[i]);
	npy__sb_printf(&sb, ndim == 1 ? ",)" : ")");
}

const char *npy__descr_of(ape_dtype dt)
{
	return dt == APE_F32 ? "<f4" : dt == APE_F16 ? "<f2" : NULL;
}

const char *npy__info_descr(const struct npy_info *info)
{
	if (info->int_bytes)
		return info->int_bytes == 8 ? "<i8" : "<i4";
	return npy__descr_of(info->dtype);
}

int npy__compute_size(struct npy_info *info, char *err, size_t errlen)
{
	size_t esize = info->int_bytes ? (size_t)info->int_bytes : ape_dtype_size(info->dtype);
	uint64_t nonzero = 1;
	bool empty = false;
	char shp[256];

	npy_format_shape(info->shape, info->ndim, shp, sizeof(shp));
	/* Even with a zero dimension the others must fit NumPy's intp, as np.empty demands. */
	for (int i = 0; i < info->ndim; i++) {
		uint64_t d = (uint64_t)info->shape[i];

		if (d == 0) {
			empty = true;
			continue;
		}
		if (nonzero > (uint64_t)INT64_MAX / d)
			return npy__fail(APE_EFORMAT, err, errlen,
				    "shape %s is absurd: its element count overflows 64 bits", shp);
		nonzero *= d;
	}
	info->count = empty ? 0 : nonzero;
	if (info->count > SIZE_MAX / esize)
		return npy__fail(APE_EFORMAT, err, errlen,
			    "shape %s is absurd: %" PRIu64 " elements of '%s' need more bytes than "
			    "size_t can count", shp, info->count, npy__info_descr(info));
	info->nbytes = (size_t)info->count * esize;
	return 0;
}
