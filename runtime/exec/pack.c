/* SPDX-License-Identifier: MIT */
#include "exec/pack.h"

#include <string.h>

static unsigned char *elem(const ape_tensor *t, const int64_t s[4], int64_t b, int64_t h,
			   int64_t l)
{
	return (unsigned char *)t->data +
	       (size_t)(b * s[0] + h * s[1] + l * s[2]) * ape_dtype_size(t->dtype);
}

/* Copies one row between the tensor and a packed row, element by element when D is strided. */
static void move_row(unsigned char *row, int64_t stride, unsigned char *packed, int64_t D,
		     size_t esz, bool to_tensor)
{
	if (stride == 1) {
		if (to_tensor)
			memcpy(row, packed, (size_t)D * esz);
		else
			memcpy(packed, row, (size_t)D * esz);
		return;
	}
	for (int64_t d = 0; d < D; d++) {
		unsigned char *e = row + (size_t)(d * stride) * esz;

		if (to_tensor)
			memcpy(e, packed + (size_t)d * esz, esz);
		else
			memcpy(packed + (size_t)d * esz, e, esz);
	}
}

static void move_rows(unsigned char *pk, const ape_tensor *t, const int64_t s[4], int64_t l0,
		      int64_t n, bool to_tensor)
{
	const size_t esz = ape_dtype_size(t->dtype);
	const int64_t D = t->shape[3];

	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++) {
			/* contiguous rows of one head: one copy for the whole range */
			if (s[3] == 1 && s[2] == D) {
				unsigned char *row = elem(t, s, b, h, l0);

				if (to_tensor)
					memcpy(row, pk, (size_t)(n * D) * esz);
				else
					memcpy(pk, row, (size_t)(n * D) * esz);
				pk += (size_t)(n * D) * esz;
				continue;
			}
			for (int64_t l = l0; l < l0 + n; l++) {
				move_row(elem(t, s, b, h, l), s[3], pk, D, esz, to_tensor);
				pk += (size_t)D * esz;
			}
		}
}

void ape__pack_rows(void *dst, const ape_tensor *t, const int64_t s[4], int64_t l0, int64_t n)
{
	move_rows(dst, t, s, l0, n, false);
}

void ape__unpack_rows(const void *src, ape_tensor *t, const int64_t s[4], int64_t l0, int64_t n)
{
	move_rows((unsigned char *)src, t, s, l0, n, true);
}

/* Whether t's elements fill its span without gaps (strides as validation makes them: no
 * element twice). */
static bool dense(const ape_tensor *t, const int64_t s[4])
{
	uint64_t n = ape_dtype_size(t->dtype);

	for (int d = 0; d < 4; d++)
		n *= (uint64_t)t->shape[d];
	return n && ape__tensor_span_bytes(t, s) == n;
}

void ape__copy_rows(ape_tensor *t, const int64_t s[4], const ape_tensor *src, const int64_t ss[4],
		    int64_t l0, int64_t n)
{
	const size_t esz = ape_dtype_size(t->dtype);
	const int64_t D = t->shape[3];

	if (l0 == 0 && n == t->shape[2] && !memcmp(s, ss, 4 * sizeof(*s)) && dense(t, s)) {
		memcpy(t->data, src->data, ape__tensor_span_bytes(t, s));
		return;
	}
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = l0; l < l0 + n; l++)
				move_row(elem(t, s, b, h, l), s[3], elem(src, ss, b, h, l), D, esz,
					 true);
}

void ape__fill_rows(const ape_tensor *t, const int64_t s[4], int64_t l0, int64_t n,
		    uint32_t pattern)
{
	const size_t esz = ape_dtype_size(t->dtype);
	unsigned char e[4];

	memcpy(e, &pattern, sizeof(e));
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = l0; l < l0 + n; l++) {
				unsigned char *r = elem(t, s, b, h, l);

				for (int64_t d = 0; d < t->shape[3]; d++)
					memcpy(r + (size_t)(d * s[3]) * esz, e, esz);
			}
}

void ape__store_row(ape_tensor *t, const int64_t s[4], int64_t b, int64_t h, int64_t l,
		    const void *row)
{
	move_row(elem(t, s, b, h, l), s[3], (unsigned char *)row, t->shape[3],
		 ape_dtype_size(t->dtype), true);
}

void ape__load_row_f32(const ape_tensor *t, const int64_t s[4], int64_t b, int64_t h, int64_t l,
		       float *row)
{
	const int64_t D = t->shape[3];
	const unsigned char *r = elem(t, s, b, h, l);
	const size_t esz = ape_dtype_size(t->dtype);

	if (s[3] == 1) {
		ape_convert(row, APE_F32, r, t->dtype, (size_t)D);
		return;
	}
	for (int64_t d = 0; d < D; d++)
		ape_convert(row + d, APE_F32, r + (size_t)(d * s[3]) * esz, t->dtype, 1);
}

size_t ape__tensor_span_bytes(const ape_tensor *t, const int64_t s[4])
{
	uint64_t last = 0;

	for (int d = 0; d < 4; d++) {
		if (!t->shape[d])
			return 0;
		last += (uint64_t)(t->shape[d] - 1) * (uint64_t)s[d];
	}
	return (size_t)(last + 1) * ape_dtype_size(t->dtype);
}
