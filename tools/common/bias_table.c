/* SPDX-License-Identifier: MIT */
/* A distance-bias table from a .npy file (common/bias_table.h). */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/bias_table.h"

static int refuse(struct bias_table_file *t, char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int refuse(struct bias_table_file *t, char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	bias_table_free(t);
	return APE_EFORMAT;
}

int bias_table_load(const char *flag, const char *path, int64_t H, struct bias_table_file *t,
		    char *err, size_t errlen)
{
	const struct npy_info *in = &t->arr.info;
	char shp[256], msg[1024];
	const float *v;
	int ret;

	memset(t, 0, sizeof(*t));
	ret = npy_load(path, &t->arr, msg, sizeof(msg));
	if (ret) {
		if (errlen)
			snprintf(err, errlen, "%s %s", flag, msg);
		return ret;
	}
	npy_format_shape(in->shape, in->ndim, shp, sizeof(shp));
	if (in->dtype != APE_F32)
		return refuse(t, err, errlen, "%s %s: dtype '<f2' (float16): a bias table is '<f4' "
			      "(float32)", flag, path);
	if (in->ndim != 2 || (in->shape[0] != H && in->shape[0] != 1))
		return refuse(t, err, errlen, "%s %s: shape %s: must be [H, M] = [%" PRId64
			      ", M] (a row per query head) or [1, M] (one row for every head)",
			      flag, path, shp, H);
	if (in->shape[1] < 1 || in->shape[1] > APE_BIAS_TABLE_MAX)
		return refuse(t, err, errlen, "%s %s: shape %s: M = %" PRId64 " entries per head: "
			      "must be in 1..%" PRId64, flag, path, shp, in->shape[1],
			      APE_BIAS_TABLE_MAX);
	t->rows = in->shape[0];
	t->len = in->shape[1];
	v = t->arr.data;
	for (int64_t h = 0; h < t->rows; h++)
		for (int64_t m = 0; m < t->len; m++)
			if (!isfinite(v[h * t->len + m]))
				return refuse(t, err, errlen, "%s %s: entry [%" PRId64 "][%" PRId64
					      "] = %g: must be finite", flag, path, h, m,
					      (double)v[h * t->len + m]);
	return 0;
}

void bias_table_set(const struct bias_table_file *t, ape_attn_desc *desc)
{
	desc->bias_table = t->arr.data;
	desc->bias_table_len = t->len;
	desc->bias_table_heads = t->rows;
}

void bias_table_free(struct bias_table_file *t)
{
	npy_free(&t->arr);
	t->rows = t->len = 0;
}
