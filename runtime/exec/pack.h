/* SPDX-License-Identifier: MIT */
/*
 * Moving row ranges between the caller's (possibly strided) host tensors and packed staging
 * buffers. Device tensors are contiguous [B, H, n, D]; a chunk of rows [l0, l0 + n) of every
 * (b, h) is gathered into, or scattered from, that layout.
 */
#ifndef APE_RUNTIME_PACK_H
#define APE_RUNTIME_PACK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

/* Rows [l0, l0 + n) of every (b, h) of t (element strides s) into dst as [B, H, n, D]. */
void ape__pack_rows(void *dst, const ape_tensor *t, const int64_t s[4], int64_t l0, int64_t n);

/* The reverse: src [B, H, n, D] of t's dtype into rows [l0, l0 + n) of t. */
void ape__unpack_rows(const void *src, ape_tensor *t, const int64_t s[4], int64_t l0, int64_t n);

/* Rows [l0, l0 + n) of every (b, h) of t from the same rows of src (t's shape and dtype,
 * element strides ss, ss[3] == 1): one copy when both lie alike, densely, and the rows are all
 * of them. */
void ape__copy_rows(ape_tensor *t, const int64_t s[4], const ape_tensor *src, const int64_t ss[4],
		    int64_t l0, int64_t n);

/* Rows [l0, l0 + n) of every (b, h) of t, each element set to the first bytes of `pattern`
 * (0x7fc07fc0: a quiet NaN in float32, float16 and bfloat16 alike). */
void ape__fill_rows(const ape_tensor *t, const int64_t s[4], int64_t l0, int64_t n,
		    uint32_t pattern);

/* One row (D elements of t's dtype) into element (b, h, l, 0..D-1) of t. */
void ape__store_row(ape_tensor *t, const int64_t s[4], int64_t b, int64_t h, int64_t l,
		    const void *row);

/* Element (b, h, l, 0..D-1) of t as D floats. */
void ape__load_row_f32(const ape_tensor *t, const int64_t s[4], int64_t b, int64_t h, int64_t l,
		       float *row);

/* Bytes of t from its data pointer to its last element (strides s, each >= 0, as validation
 * makes them); 0 for an empty tensor. What wrapping it where it lies covers. */
size_t ape__tensor_span_bytes(const ape_tensor *t, const int64_t s[4]);

#pragma GCC visibility pop
#endif
