/* SPDX-License-Identifier: MIT */
/* Argument validation of the public calls: from caller arguments to a struct ape__problem. */
#ifndef APE_RUNTIME_VALIDATE_H
#define APE_RUNTIME_VALIDATE_H

#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/*
 * Checks every argument of a forward call and resolves the defaults. On failure returns a
 * negative code with a message that starts with `fn` and names the argument; *p is then empty.
 * q, k, v, o are required; lse may be NULL.
 */
int ape__problem_init(struct ape__problem *p, const char *fn, const ape_attn_desc *desc,
		      const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
		      const ape_tensor *o, const float *lse);
void ape__problem_fini(struct ape__problem *p);
/* ape__problem_init() for the dense calls that take explicit positions (desc->pos_q, pos_k;
 * ape__problem_init() refuses them): both or neither, q_start_set false and k_start 0 with
 * them, every pair's n in int64 (APE_EOVERFLOW naming desc->pos_q and desc->pos_k); they go to
 * p->pos_q, p->pos_k (NULL without). */
int ape__problem_init_pos(struct ape__problem *p, const char *fn, const ape_attn_desc *desc,
			  const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
			  const ape_tensor *o, const float *lse);

/* desc->struct_size is one the library takes: sizeof(ape_attn_desc), APE_ATTN_DESC_V3_SIZE,
 * APE_ATTN_DESC_V2_SIZE or APE_ATTN_DESC_V1_SIZE. */
bool ape__desc_size_ok(const ape_attn_desc *d);
/* *dst = *src without reading past src's layout (its struct_size, the first layout for a size
 * the library does not take): the fields the caller did not know of are their defaults (NULL
 * positions, rope_scale 1); struct_size is the caller's. */
void ape__desc_copy(ape_attn_desc *dst, const ape_attn_desc *src);
/* desc's rope_scale, 1 for a desc of an earlier layout. */
double ape__desc_rope_scale(const ape_attn_desc *d);
/* desc's distance-bias table and its gradient's destination, NULL for a desc of an earlier
 * layout. */
void ape__desc_bias_table(const ape_attn_desc *d, const float **table, float **grad);
/* Whether desc (NULL or of a size the library does not take: false) asks for the table's
 * gradient (desc->dbias_table), for the backward calls' "no gradient is wanted" rule. */
bool ape__desc_wants_dbias(const ape_attn_desc *d);
/* desc's explicit positions, NULL for a desc of the first layout. */
void ape__desc_positions(const ape_attn_desc *d, const int64_t **pos_q, const int64_t **pos_k);

/* The diagnostics' outputs of a validated call (p from ape__problem_init() with these tensors):
 * ent and md (each NULL or B*H*Lq floats) overlap no tensor of the call, lse, or each other
 * (APE_EINVAL naming both: "<fn>: entropy overlaps o in memory: ..."). k and v may be NULL
 * (a KV-cache call: the cache's keys are on the device). */
int ape__check_diag_outputs(const char *fn, const struct ape__problem *p, const ape_tensor *q,
			    const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
			    const float *lse, const float *ent, const float *md);

/* One tensor of a KV-cache call: its dtype must be `dtype`, its shape `want` (-1: any; dims
 * name them in messages); resolves its strides into s. */
int ape__check_tensor(const char *fn, const char *name, const ape_tensor *t, ape_dtype dtype,
		      const int64_t want[4], const char *const dims[4], int64_t s[4]);
/* Every position and query-key distance of these rows fits in 64 bits. */
int ape__check_positions(const char *fn, int64_t q_start, int64_t Lq, int64_t k_start, int64_t Lk);

/*
 * One more tensor of a call, beyond the forward's q, k, v, o (the backward's dO, dQ, dK, dV):
 * its dtype must be `dtype`, or APE_F32 too when f32_ok; its shape `want` (-1: any; dims name
 * them in messages). Resolves its strides into s and the bytes it addresses into
 * [range[0], range[1]) (empty for an empty tensor). An output (is_output) must not have two
 * elements at one address.
 */
int ape__check_tensor_span(const char *fn, const char *name, const ape_tensor *t, ape_dtype dtype,
			   bool f32_ok, const int64_t want[4], const char *const dims[4],
			   bool is_output, int64_t s[4], uintptr_t range[2]);
/* APE_EINVAL ("<fn>: <out_name> overlaps <in_name> in memory: ...") when the byte ranges
 * [out[0], out[1]) and [in[0], in[1]) share a byte; empty ranges never do. */
int ape__check_disjoint(const char *fn, const char *out_name, const uintptr_t out[2],
			const char *in_name, const uintptr_t in[2]);

#pragma GCC visibility pop
#endif
