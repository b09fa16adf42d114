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

/* One tensor of a KV-cache call: its dtype must be `dtype`, its shape `want` (-1: any; dims
 * name them in messages); resolves its strides into s. */
int ape__check_tensor(const char *fn, const char *name, const ape_tensor *t, ape_dtype dtype,
		      const int64_t want[4], const char *const dims[4], int64_t s[4]);
/* Every position and query-key distance of these rows fits in 64 bits. */
int ape__check_positions(const char *fn, int64_t q_start, int64_t Lq, int64_t k_start, int64_t Lk);

#pragma GCC visibility pop
#endif
