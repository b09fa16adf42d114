/* SPDX-License-Identifier: MIT */
/*
 * A distance-bias table (ape_attn_desc.bias_table, docs/ape.md "Distance-bias tables") from a
 * NumPy .npy file, as the tools' --bias-table option takes it: '<f4', [H, M] (a row per query
 * head) or [1, M] (one row for every head). Shared by ape-run and ape-curve.
 */
#ifndef APE_TOOLS_BIAS_TABLE_H
#define APE_TOOLS_BIAS_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"
#include "common/npy.h"

/* A loaded table: the file's array and its two dimensions. */
struct bias_table_file {
	struct npy_array arr;
	int64_t rows; /* bias_table_heads: H or 1 */
	int64_t len; /* bias_table_len: M */
};

/**
 * Reads \p path, given to option \p flag, as the table of a call with \p H query heads: '<f4',
 * 2-D [H, M] or [1, M] with 1 <= M <= APE_BIAS_TABLE_MAX, every value finite (the library's
 * rules, checked here so that the message names the option, the file and the entry).
 * \return 0; APE_EFORMAT (a file that is not such a table), APE_EIO, APE_ENOMEM, as npy_load().
 *         On failure \p t is empty (safe to pass to bias_table_free()).
 */
int bias_table_load(const char *flag, const char *path, int64_t H, struct bias_table_file *t,
		    char *err, size_t errlen);

/* Points desc at the table: bias_table, bias_table_len, bias_table_heads. */
void bias_table_set(const struct bias_table_file *t, ape_attn_desc *desc);

/* Releases the table and empties it. Accepts an empty (zeroed) one. */
void bias_table_free(struct bias_table_file *t);

#endif
