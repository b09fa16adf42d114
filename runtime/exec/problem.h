/* SPDX-License-Identifier: MIT */
/* A validated forward call, the executor's input: every default resolved, every argument
 * checked (api/validate.h makes one). */
#ifndef APE_RUNTIME_PROBLEM_H
#define APE_RUNTIME_PROBLEM_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape.h"
#include "core/backend.h"

#pragma GCC visibility push(hidden)

struct ape__problem {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype in_dtype, out_dtype;
	int64_t qs[4], ks[4], vs[4], os[4]; /* element strides, defaults resolved */
	float *head_params; /* 4*H: delta, beta, gamma, lambda per head (owned) */
	bool decay_nonneg; /* delta, beta, gamma >= 0 in every head */
	double scale, rope_base, skip_tol;
	double rope_scale; /* position interpolation: the rotation's n is n / rope_scale (> 0) */
	bool causal;
	ape_rope_layout layout;
	int64_t q_start, k_start;
	/*
	 * NULL: one problem of B sequences at q_start, k_start. Else a ragged batch (B = 1; set by
	 * api/varlen.c or api/resident_varlen.c, not owned): nseg segments of the packed rows as
	 * core/backend.h's struct ape_be_launch.segs states them, over the whole call (q_start and
	 * k_start unused); the executor clips them to each launch's rows and keys
	 * (ape__segs_clip()).
	 */
	const struct ape_be_seg *segs;
	int64_t nseg;
	/*
	 * Both NULL: positions as above. Else explicit positions (set by api/varlen.c or
	 * api/resident_varlen.c, not owned, only when every device's capabilities say
	 * positions): pos_q[i] of query row i (Lq entries), pos_k[j] of key row j (Lk entries),
	 * as core/backend.h's struct ape_be_launch.pos_q and .pos_k state them; each launch gets
	 * the slice of its rows and of its keys. q_start, k_start and the segments' positions are
	 * then unused.
	 */
	const int64_t *pos_q, *pos_k;
	/*
	 * NULL: no distance-bias table. Else the caller's (desc->bias_table, not owned, read during
	 * the call): head h's row at bias_table + h * bias_hstride (bias_hstride 0: one row for
	 * every head), bias_len entries; bias_smax (owned) the rows' suffix maxima, same layout
	 * (struct ape_be_launch.bias_table states both). dbias_table: the caller's destination of
	 * the table's gradient (desc->dbias_table, [rows][bias_len] float), or NULL.
	 */
	const float *bias_table;
	float *bias_smax;
	int64_t bias_len, bias_hstride;
	float *dbias_table;
};

/* Rows of p's bias table: H for a per-head table, 1 for a shared one (0 without). */
static inline int64_t ape__bias_rows(const struct ape__problem *p)
{
	return !p->bias_table ? 0 : p->bias_hstride ? p->H : 1;
}

/* Visible pairs of one (b, h) head summed over its rows; -1 if the count overflows 64 bits. */
int ape__head_visible_pairs(const struct ape__problem *p, uint64_t *out);
/* The same at explicit positions (pos_q: Lq entries, pos_k: Lk; causal: key j visible to row i
 * iff pos_k[j] <= pos_q[i]): 0, APE_EOVERFLOW (the count overflows 64 bits) or APE_ENOMEM (no
 * message set either way). */
int ape__pos_visible_pairs(const int64_t *pos_q, int64_t Lq, const int64_t *pos_k, int64_t Lk,
			   bool causal, uint64_t *out);

#pragma GCC visibility pop
#endif
