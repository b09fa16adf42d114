/* SPDX-License-Identifier: MIT */
/*
 * Argument validation for forward calls. Every check names the argument, the head and the value,
 * because the person reading the message has a model with 32 heads and needs to know which one.
 * Nothing here touches the outputs.
 */
#include "api/validate.h"
#include "core/alloc.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/limits.h"
#include "core/verbose.h"

/* ---------------------------------------------------------------- tensors */

static int check_dtype(const char *fn, const char *name, ape_dtype dt)
{
	if (!ape_dtype_size(dt))
		return ape__error(APE_EINVAL, "%s: %s->dtype = %d: not a libape storage type", fn,
				  name, (int)dt);
	return 0;
}

static int check_shape(const char *fn, const char *name, const ape_tensor *t,
		       const int64_t want[4], const char *const dims[4])
{
	for (int d = 0; d < 4; d++) {
		if (t->shape[d] < 0)
			return ape__error(APE_EINVAL, "%s: %s->shape[%d] = %" PRId64 ": must be >= 0",
					  fn, name, d, t->shape[d]);
		if (want[d] >= 0 && t->shape[d] != want[d])
			return ape__error(APE_EINVAL,
					  "%s: %s->shape[%d] = %" PRId64 ": must equal %s = %" PRId64,
					  fn, name, d, t->shape[d], dims[d], want[d]);
	}
	return 0;
}

/* Resolves strides (all zero = contiguous) and checks that the addressed span fits in memory. */
static int resolve_strides(const char *fn, const char *name, const ape_tensor *t, int64_t s[4],
			   uint64_t *span_bytes)
{
	bool all_zero = true;
	int64_t span = 1, elems = 1;
	size_t esz = ape_dtype_size(t->dtype);

	for (int d = 0; d < 4; d++)
		all_zero &= t->strides[d] == 0;
	if (all_zero) {
		int64_t acc = 1;

		for (int d = 3; d >= 0; d--) {
			s[d] = acc;
			if (t->shape[d] && __builtin_mul_overflow(acc, t->shape[d], &acc))
				return ape__error(APE_EOVERFLOW, "%s: %s: shape overflows 64 bits",
						  fn, name);
		}
	} else {
		/* A dimension of size 0 or 1 is never stepped along, so its stride may be anything
		 * >= 0 (PyTorch gives such dimensions arbitrary strides); so may every stride of an
		 * empty tensor. */
		bool empty = !t->shape[0] || !t->shape[1] || !t->shape[2] || !t->shape[3];

		for (int d = 0; d < 4; d++) {
			if (t->strides[d] < 0 ||
			    (t->strides[d] == 0 && t->shape[d] > 1 && !empty))
				return ape__error(APE_EINVAL,
						  "%s: %s->strides[%d] = %" PRId64
						  ": must be >= 1 (0 only along a dimension of size 0 "
						  "or 1; all four 0 means contiguous)",
						  fn, name, d, t->strides[d]);
			s[d] = t->strides[d];
		}
	}
	for (int d = 0; d < 4; d++) {
		int64_t ext;

		if (__builtin_mul_overflow(t->shape[d], elems, &elems))
			return ape__error(APE_EOVERFLOW, "%s: %s: element count overflows 64 bits", fn,
					  name);
		if (t->shape[d] == 0)
			continue;
		if (__builtin_mul_overflow(t->shape[d] - 1, s[d], &ext) ||
		    __builtin_add_overflow(span, ext, &span))
			return ape__error(APE_EOVERFLOW, "%s: %s: strides address beyond 64 bits", fn,
					  name);
	}
	if (elems == 0) {
		*span_bytes = 0;
		return 0;
	}
	/* Inputs may have overlapping rows, so the element count can exceed the span: the packed
	 * copy the core makes must fit too. */
	if ((uint64_t)elems > SIZE_MAX / esz || (uint64_t)elems > (uint64_t)INT64_MAX / esz)
		return ape__error(APE_EOVERFLOW, "%s: %s: %" PRId64 " elements do not fit in memory",
				  fn, name, elems);
	if ((uint64_t)span > SIZE_MAX / esz || (uint64_t)span > (uint64_t)INT64_MAX / esz)
		return ape__error(APE_EOVERFLOW, "%s: %s: %" PRId64 " elements do not fit in memory",
				  fn, name, span);
	if (!t->data)
		return ape__error(APE_EINVAL, "%s: %s->data = NULL with %" PRId64 " elements", fn, name,
				  elems);
	*span_bytes = (uint64_t)span * esz;
	return 0;
}

/* An output written by several rows at once must not have two elements at one address:
 * sorted by stride, each stride must step over everything the smaller ones address. */
static int check_no_self_overlap(const char *fn, const char *name, const ape_tensor *t,
				 const int64_t s[4])
{
	int order[4] = { 0, 1, 2, 3 };
	int64_t reach = 1; /* elements addressed by the dimensions sorted so far */

	if (!t->shape[0] || !t->shape[1] || !t->shape[2] || !t->shape[3])
		return 0; /* nothing is written */
	for (int i = 1; i < 4; i++)
		for (int j = i; j > 0 && s[order[j - 1]] > s[order[j]]; j--) {
			int tmp = order[j];

			order[j] = order[j - 1];
			order[j - 1] = tmp;
		}
	for (int i = 0; i < 4; i++) {
		int d = order[i];

		if (t->shape[d] <= 1)
			continue;
		if (s[d] < reach)
			return ape__error(APE_EINVAL,
					  "%s: %s->strides[%d] = %" PRId64
					  ": output elements would overlap (need >= %" PRId64 ")",
					  fn, name, d, s[d], reach);
		reach = s[d] * t->shape[d]; /* no overflow: bounded by the checked span */
	}
	return 0;
}

struct range {
	const char *name;
	uintptr_t lo, hi; /* [lo, hi) */
};

static int check_disjoint(const char *fn, const struct range *out, const struct range *in)
{
	if (out->lo == out->hi || in->lo == in->hi)
		return 0;
	if (out->lo < in->hi && in->lo < out->hi)
		return ape__error(APE_EINVAL, "%s: %s overlaps %s in memory: outputs must not alias inputs",
				  fn, out->name, in->name);
	return 0;
}

/* ---------------------------------------------------------------- parameters */

static int resolve_param(const char *fn, const char *name, const ape_param *prm, int64_t H,
			 bool nonneg, float *dst /* stride 4 */)
{
	for (int64_t h = 0; h < H; h++) {
		float x = prm->per_head ? prm->per_head[h] : prm->value;

		if (!isfinite(x)) {
			if (prm->per_head)
				return ape__error(APE_EINVAL,
						  "%s: desc->%s.per_head[%" PRId64 "] = %g: must be finite",
						  fn, name, h, (double)x);
			return ape__error(APE_EINVAL, "%s: desc->%s.value = %g: must be finite", fn,
					  name, (double)x);
		}
		if (nonneg && x < 0) {
			if (prm->per_head)
				return ape__error(APE_EINVAL,
						  "%s: desc->%s.per_head[%" PRId64 "] = %g: must be >= 0",
						  fn, name, h, (double)x);
			return ape__error(APE_EINVAL, "%s: desc->%s.value = %g: must be >= 0", fn, name,
					  (double)x);
		}
		dst[4 * h] = x;
	}
	return 0;
}

static int check_scalars(const char *fn, const ape_attn_desc *d)
{
	const double rope_scale = ape__desc_rope_scale(d);

	if (!isfinite(d->rope_base) || !(d->rope_base > 0))
		return ape__error(APE_EINVAL, "%s: desc->rope_base = %g: must be finite and > 0", fn,
				  d->rope_base);
	if (!isfinite(rope_scale) || !(rope_scale > 0))
		return ape__error(APE_EINVAL, "%s: desc->rope_scale = %g: must be finite and > 0",
				  fn, rope_scale);
	if (d->scale_set && !isfinite(d->scale))
		return ape__error(APE_EINVAL, "%s: desc->scale = %g: must be finite", fn, d->scale);
	if (!isfinite(d->skip_tol) || d->skip_tol < 0)
		return ape__error(APE_EINVAL, "%s: desc->skip_tol = %g: must be finite and >= 0", fn,
				  d->skip_tol);
	if (d->layout != APE_ROPE_HALF && d->layout != APE_ROPE_INTERLEAVED)
		return ape__error(APE_EINVAL,
				  "%s: desc->layout = %d: must be APE_ROPE_HALF or APE_ROPE_INTERLEAVED",
				  fn, (int)d->layout);
	return 0;
}

/*
 * Resolves q_start and checks that every position and every distance n = pos_q - pos_k fits in
 * 64 bits, so kernels can use int64 arithmetic without overflow checks.
 */
static int resolve_positions(const char *fn, const ape_attn_desc *d, int64_t Lq, int64_t Lk,
			     int64_t *q_start)
{
	int64_t qs, q_last, k_last, t;

	if (d->q_start_set) {
		qs = d->q_start;
	} else if (__builtin_add_overflow(d->k_start, Lk - Lq, &qs)) {
		return ape__error(APE_EOVERFLOW,
				  "%s: desc->k_start = %" PRId64 ": default q_start overflows", fn,
				  d->k_start);
	}
	if (__builtin_add_overflow(qs, Lq > 0 ? Lq - 1 : 0, &q_last))
		return ape__error(APE_EOVERFLOW,
				  "%s: q_start = %" PRId64 ": last query position overflows", fn, qs);
	if (__builtin_add_overflow(d->k_start, Lk > 0 ? Lk - 1 : 0, &k_last))
		return ape__error(APE_EOVERFLOW,
				  "%s: desc->k_start = %" PRId64 ": last key position overflows", fn,
				  d->k_start);
	if (__builtin_sub_overflow(q_last, d->k_start, &t) ||
	    __builtin_sub_overflow(qs, k_last, &t))
		return ape__error(APE_EOVERFLOW,
				  "%s: q_start = %" PRId64 ", k_start = %" PRId64
				  ": query-key distances overflow 64 bits",
				  fn, qs, d->k_start);
	*q_start = qs;
	return 0;
}

/* ---------------------------------------------------------------- the whole call */

bool ape__desc_size_ok(const ape_attn_desc *d)
{
	return d->struct_size == sizeof(*d) || d->struct_size == APE_ATTN_DESC_V3_SIZE ||
	       d->struct_size == APE_ATTN_DESC_V2_SIZE || d->struct_size == APE_ATTN_DESC_V1_SIZE;
}

/* The bytes of d the library may read: its layout's, the first one's for any other size. */
static size_t desc_bytes(const ape_attn_desc *d)
{
	return d->struct_size == sizeof(*d)		   ? sizeof(*d)
	       : d->struct_size == APE_ATTN_DESC_V3_SIZE ? APE_ATTN_DESC_V3_SIZE
	       : d->struct_size == APE_ATTN_DESC_V2_SIZE ? APE_ATTN_DESC_V2_SIZE
							 : APE_ATTN_DESC_V1_SIZE;
}

void ape__desc_copy(ape_attn_desc *dst, const ape_attn_desc *src)
{
	memset(dst, 0, sizeof(*dst));
	memcpy(dst, src, desc_bytes(src));
	if (desc_bytes(src) <= APE_ATTN_DESC_V2_SIZE)
		dst->rope_scale = 1.0;
}

double ape__desc_rope_scale(const ape_attn_desc *d)
{
	return desc_bytes(d) > APE_ATTN_DESC_V2_SIZE ? d->rope_scale : 1.0;
}

bool ape__desc_wants_dbias(const ape_attn_desc *d)
{
	const float *t;
	float *g;

	if (!d || !ape__desc_size_ok(d))
		return false;
	ape__desc_bias_table(d, &t, &g);
	return g != NULL;
}

void ape__desc_bias_table(const ape_attn_desc *d, const float **table, float **grad)
{
	const bool has = desc_bytes(d) > APE_ATTN_DESC_V3_SIZE;

	*table = has ? d->bias_table : NULL;
	*grad = has ? d->dbias_table : NULL;
}

/*
 * desc's distance-bias table for H heads into p (bias_table, bias_len, bias_hstride, and
 * bias_smax, the suffix maxima, allocated here and freed by ape__problem_fini()), and its
 * gradient's destination into p->dbias_table: every value finite, M in 1..APE_BIAS_TABLE_MAX,
 * heads H or 1. Nothing set without a table.
 */
static int resolve_bias_table(struct ape__problem *p, const char *fn, const ape_attn_desc *d)
{
	const float *t;
	float *g;
	int64_t M, rows;

	ape__desc_bias_table(d, &t, &g);
	if (!t) {
		if (g)
			return ape__error(APE_EINVAL,
					  "%s: desc->dbias_table = %p without desc->bias_table: the "
					  "gradient needs the table",
					  fn, (void *)g);
		return 0;
	}
	M = d->bias_table_len;
	rows = d->bias_table_heads;
	if (M < 1 || M > APE_BIAS_TABLE_MAX)
		return ape__error(APE_EINVAL,
				  "%s: desc->bias_table_len = %" PRId64 ": must be in 1..%" PRId64,
				  fn, M, APE_BIAS_TABLE_MAX);
	if (rows != 1 && rows != p->H)
		return ape__error(APE_EINVAL,
				  "%s: desc->bias_table_heads = %" PRId64 ": must be H = %" PRId64
				  " (a row per head) or 1 (one row for every head)",
				  fn, rows, p->H);
	if ((uint64_t)rows * (uint64_t)M > SIZE_MAX / sizeof(float))
		return ape__error(APE_EOVERFLOW, "%s: desc->bias_table: %" PRId64 " x %" PRId64
				  " entries do not fit", fn, rows, M);
	for (int64_t h = 0; h < rows; h++)
		for (int64_t m = 0; m < M; m++)
			if (!isfinite(t[h * M + m]))
				return ape__error(APE_EINVAL,
						  "%s: desc->bias_table[%" PRId64 "][%" PRId64
						  "] = %g: must be finite",
						  fn, h, m, (double)t[h * M + m]);
	if (g) {
		const uintptr_t gb = (uintptr_t)g, ge = gb + (uintptr_t)(rows * M) * sizeof(float);
		const uintptr_t tb = (uintptr_t)t, te = tb + (uintptr_t)(rows * M) * sizeof(float);

		if (gb < te && tb < ge)
			return ape__error(APE_EINVAL,
					  "%s: desc->dbias_table overlaps desc->bias_table in memory: "
					  "outputs must not alias inputs",
					  fn);
	}
	p->bias_smax = ape__malloc((size_t)(rows * M) * sizeof(float));
	if (!p->bias_smax)
		return ape__error(APE_ENOMEM, "%s: out of memory for a %" PRId64 " x %" PRId64
				  " bias table's maxima", fn, rows, M);
	for (int64_t h = 0; h < rows; h++) {
		float mx = -INFINITY;

		for (int64_t m = M - 1; m >= 0; m--) {
			mx = t[h * M + m] > mx ? t[h * M + m] : mx;
			p->bias_smax[h * M + m] = mx;
		}
	}
	p->bias_table = t;
	p->bias_len = M;
	p->bias_hstride = rows == 1 ? 0 : M;
	p->dbias_table = g;
	return 0;
}

void ape__desc_positions(const ape_attn_desc *d, const int64_t **pos_q, const int64_t **pos_k)
{
	/* the first layout has no positions */
	const bool has = desc_bytes(d) > APE_ATTN_DESC_V1_SIZE;

	*pos_q = has ? d->pos_q : NULL;
	*pos_k = has ? d->pos_k : NULL;
}

static int check_desc(const char *fn, const ape_attn_desc *desc)
{
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	if (!ape__desc_size_ok(desc))
		return ape__error(APE_EINVAL,
				  "%s: desc->struct_size = %zu: expected %zu (initialise with "
				  "ape_attn_desc_init()), APE_ATTN_DESC_V3_SIZE = %zu, "
				  "APE_ATTN_DESC_V2_SIZE = %zu or APE_ATTN_DESC_V1_SIZE = %zu",
				  fn, desc->struct_size, sizeof(*desc), APE_ATTN_DESC_V3_SIZE,
				  APE_ATTN_DESC_V2_SIZE, APE_ATTN_DESC_V1_SIZE);
	return check_scalars(fn, desc);
}

/*
 * desc's explicit positions for Lq queries and Lk keys into *pos_q, *pos_k (both NULL without):
 * both or neither, q_start_set false and k_start 0 with them, every pair's n in int64. desc is
 * checked (check_desc()).
 */
static int check_desc_positions(const char *fn, const ape_attn_desc *desc, int64_t Lq,
				int64_t Lk, const int64_t **pos_q, const int64_t **pos_k)
{
	int64_t lo[2] = { INT64_MAX, INT64_MAX }, hi[2] = { INT64_MIN, INT64_MIN };

	ape__desc_positions(desc, pos_q, pos_k);
	if (!*pos_q && !*pos_k)
		return 0;
	if (!*pos_q || !*pos_k)
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = NULL but desc->%s is set: explicit positions take "
				  "both (or neither)",
				  fn, *pos_q ? "pos_k" : "pos_q", *pos_q ? "pos_q" : "pos_k");
	if (desc->q_start_set || desc->k_start != 0)
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = %" PRId64 ": with explicit positions (desc->pos_q, "
				  "desc->pos_k) q_start_set must be false and k_start 0",
				  fn, desc->q_start_set ? "q_start" : "k_start",
				  desc->q_start_set ? desc->q_start : desc->k_start);
	if (!Lq || !Lk)
		return 0;
	for (int side = 0; side < 2; side++)
		for (int64_t i = 0; i < (side ? Lk : Lq); i++) {
			const int64_t x = (side ? *pos_k : *pos_q)[i];

			lo[side] = x < lo[side] ? x : lo[side];
			hi[side] = x > hi[side] ? x : hi[side];
		}
	if ((__int128)hi[0] - lo[1] > INT64_MAX || (__int128)lo[0] - hi[1] < INT64_MIN)
		return ape__error(APE_EOVERFLOW,
				  "%s: desc->pos_q = %" PRId64 "..%" PRId64 " and desc->pos_k = %" PRId64
				  "..%" PRId64 ": a distance pos_q - pos_k does not fit in 64 bits",
				  fn, lo[0], hi[0], lo[1], hi[1]);
	return 0;
}

static int check_tensors(struct ape__problem *p, const char *fn, const ape_tensor *q,
			 const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
			 const float *lse)
{
	static const char *const qdims[4] = { "B", "H", "Lq", "D" };
	static const char *const kdims[4] = { "B", "Hkv", "Lk", "D" };
	const int64_t any[4] = { -1, -1, -1, -1 };
	int64_t kwant[4], owant[4];
	uint64_t qb, kb, vb, ob;
	int ret;

	if (!q || !k || !v || !o)
		return ape__error(APE_EINVAL, "%s: %s = NULL", fn,
				  !q ? "q" : !k ? "k" : !v ? "v" : "o");
	if ((ret = check_dtype(fn, "q", q->dtype)) || (ret = check_dtype(fn, "k", k->dtype)) ||
	    (ret = check_dtype(fn, "v", v->dtype)) || (ret = check_dtype(fn, "o", o->dtype)))
		return ret;
	if (k->dtype != q->dtype || v->dtype != q->dtype)
		return ape__error(APE_EINVAL, "%s: %s->dtype = %s: must equal q->dtype = %s", fn,
				  k->dtype != q->dtype ? "k" : "v",
				  ape_dtype_name(k->dtype != q->dtype ? k->dtype : v->dtype),
				  ape_dtype_name(q->dtype));
	if (o->dtype != q->dtype && o->dtype != APE_F32)
		return ape__error(APE_EINVAL, "%s: o->dtype = %s: must be q->dtype (%s) or f32", fn,
				  ape_dtype_name(o->dtype), ape_dtype_name(q->dtype));
	if ((ret = check_shape(fn, "q", q, any, qdims)))
		return ret;
	p->B = q->shape[0];
	p->H = q->shape[1];
	p->Lq = q->shape[2];
	p->D = q->shape[3];
	if (p->B < 1 || p->H < 1)
		return ape__error(APE_EINVAL, "%s: q->shape[%d] = %" PRId64 ": %s must be >= 1", fn,
				  p->B < 1 ? 0 : 1, p->B < 1 ? p->B : p->H, p->B < 1 ? "B" : "H");
	if (p->D < 2 || p->D > APE_MAX_D || p->D % 2)
		return ape__error(APE_EINVAL,
				  "%s: q->shape[3] = %" PRId64 ": D must be even and in 2..%d", fn,
				  p->D, APE_MAX_D);
	kwant[0] = p->B;
	kwant[1] = -1;
	kwant[2] = -1;
	kwant[3] = p->D;
	if ((ret = check_shape(fn, "k", k, kwant, qdims)))
		return ret;
	p->Hkv = k->shape[1];
	p->Lk = k->shape[2];
	if (p->Hkv < 1)
		return ape__error(APE_EINVAL, "%s: k->shape[1] = %" PRId64 ": Hkv must be >= 1", fn,
				  p->Hkv);
	if (p->H % p->Hkv)
		return ape__error(APE_EINVAL,
				  "%s: k->shape[1] = %" PRId64 ": H = %" PRId64
				  " is not divisible by Hkv",
				  fn, p->Hkv, p->H);
	memcpy(kwant, k->shape, sizeof(kwant));
	if ((ret = check_shape(fn, "v", v, kwant, kdims)))
		return ret;
	memcpy(owant, q->shape, sizeof(owant));
	if ((ret = check_shape(fn, "o", o, owant, qdims)))
		return ret;
	p->in_dtype = q->dtype;
	p->out_dtype = o->dtype;
	if ((ret = resolve_strides(fn, "q", q, p->qs, &qb)) ||
	    (ret = resolve_strides(fn, "k", k, p->ks, &kb)) ||
	    (ret = resolve_strides(fn, "v", v, p->vs, &vb)) ||
	    (ret = resolve_strides(fn, "o", o, p->os, &ob)))
		return ret;
	if ((ret = check_no_self_overlap(fn, "o", o, p->os)))
		return ret;
	{
		uint64_t nrows = (uint64_t)p->B * (uint64_t)p->H * (uint64_t)p->Lq;
		struct range ro = { "o", (uintptr_t)o->data, (uintptr_t)o->data + ob };
		struct range rl = { "lse", (uintptr_t)lse, (uintptr_t)lse + (lse ? nrows * 4 : 0) };
		const struct range in[3] = {
			{ "q", (uintptr_t)q->data, (uintptr_t)q->data + qb },
			{ "k", (uintptr_t)k->data, (uintptr_t)k->data + kb },
			{ "v", (uintptr_t)v->data, (uintptr_t)v->data + vb },
		};

		if (nrows > SIZE_MAX / 4)
			return ape__error(APE_EOVERFLOW, "%s: lse: %" PRIu64 " rows do not fit", fn,
					  nrows);
		if (!lse)
			rl.lo = rl.hi = 0;
		for (int i = 0; i < 3; i++)
			if ((ret = check_disjoint(fn, &ro, &in[i])) ||
			    (ret = check_disjoint(fn, &rl, &in[i])))
				return ret;
		if ((ret = check_disjoint(fn, &rl, &ro)))
			return ret;
	}
	return 0;
}

int ape__problem_init(struct ape__problem *p, const char *fn, const ape_attn_desc *desc,
		      const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
		      const ape_tensor *o, const float *lse)
{
	int ret;

	memset(p, 0, sizeof(*p));
	if ((ret = check_desc(fn, desc)))
		return ret;
	ape__desc_positions(desc, &p->pos_q, &p->pos_k);
	if (p->pos_q || p->pos_k) {
		const bool q_set = p->pos_q != NULL;

		p->pos_q = p->pos_k = NULL;
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = %p: explicit positions are taken by "
				  "ape_attention_forward*() and ape_attention_backward*() on host "
				  "tensors only",
				  fn, q_set ? "pos_q" : "pos_k",
				  q_set ? (const void *)desc->pos_q : (const void *)desc->pos_k);
	}
	if ((ret = check_tensors(p, fn, q, k, v, o, lse)))
		return ret;
	if ((ret = resolve_positions(fn, desc, p->Lq, p->Lk, &p->q_start)))
		return ret;
	if ((uint64_t)p->H > SIZE_MAX / (4 * sizeof(float)))
		return ape__error(APE_EOVERFLOW, "%s: H = %" PRId64 ": too many heads", fn, p->H);
	p->head_params = ape__malloc((size_t)p->H * 4 * sizeof(float));
	if (!p->head_params)
		return ape__error(APE_ENOMEM, "%s: out of memory for %" PRId64 " heads", fn, p->H);
	if ((ret = resolve_param(fn, "delta", &desc->delta, p->H, false, p->head_params + 0)) ||
	    (ret = resolve_param(fn, "beta", &desc->beta, p->H, false, p->head_params + 1)) ||
	    (ret = resolve_param(fn, "gamma", &desc->gamma, p->H, false, p->head_params + 2)) ||
	    (ret = resolve_param(fn, "lambda", &desc->lambda, p->H, true, p->head_params + 3))) {
		ape__problem_fini(p);
		return ret;
	}
	p->decay_nonneg = true;
	for (int64_t i = 0; i < 4 * p->H; i++)
		if (i % 4 != 3 && p->head_params[i] < 0)
			p->decay_nonneg = false;
	p->k_start = desc->k_start;
	p->scale = desc->scale_set ? desc->scale : 1.0 / sqrt((double)p->D);
	p->rope_base = desc->rope_base;
	p->rope_scale = ape__desc_rope_scale(desc);
	p->skip_tol = desc->skip_tol;
	p->causal = desc->causal;
	p->layout = desc->layout;
	if ((ret = resolve_bias_table(p, fn, desc))) {
		ape__problem_fini(p);
		return ret;
	}
	return 0;
}

int ape__problem_init_pos(struct ape__problem *p, const char *fn, const ape_attn_desc *desc,
			  const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
			  const ape_tensor *o, const float *lse)
{
	const int64_t *pq, *pk;
	ape_attn_desc d;
	int ret;

	if ((ret = check_desc(fn, desc)))
		return ret;
	ape__desc_positions(desc, &pq, &pk);
	if (!pq && !pk)
		return ape__problem_init(p, fn, desc, q, k, v, o, lse);
	if ((ret = check_desc_positions(fn, desc, 0, 0, &pq, &pk)))
		return ret;
	ape__desc_copy(&d, desc);
	d.pos_q = d.pos_k = NULL;
	if ((ret = ape__problem_init(p, fn, &d, q, k, v, o, lse)))
		return ret;
	if ((ret = check_desc_positions(fn, desc, p->Lq, p->Lk, &pq, &pk))) {
		ape__problem_fini(p);
		return ret;
	}
	p->pos_q = pq;
	p->pos_k = pk;
	return 0;
}

void ape__problem_fini(struct ape__problem *p)
{
	free(p->head_params);
	p->head_params = NULL;
	free(p->bias_smax);
	p->bias_smax = NULL;
	p->bias_table = NULL;
	p->dbias_table = NULL;
}

void ape_attn_desc_init(ape_attn_desc *desc)
{
	if (!desc)
		return;
	memset(desc, 0, sizeof(*desc));
	desc->struct_size = sizeof(*desc);
	desc->rope_base = 10000.0;
	desc->rope_scale = 1.0;
	desc->causal = true;
	desc->layout = APE_ROPE_HALF;
	desc->skip_tol = 0x1p-24;
}

int ape_visible_pairs(const ape_attn_desc *desc, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
		      uint64_t *out)
{
	APE__API_CALL("ape_visible_pairs");
	static const char fn[] = "ape_visible_pairs";
	struct ape__problem p = { 0 };
	uint64_t per_head, total;
	int ret;

	if (!out)
		return ape__error(APE_EINVAL, "%s: out = NULL", fn);
	if ((ret = check_desc(fn, desc)))
		return ret;
	if (B < 0 || H < 0 || Lq < 0 || Lk < 0)
		return ape__error(APE_EINVAL,
				  "%s: B = %" PRId64 ", H = %" PRId64 ", Lq = %" PRId64
				  ", Lk = %" PRId64 ": sizes must be >= 0",
				  fn, B, H, Lq, Lk);
	if ((ret = check_desc_positions(fn, desc, Lq, Lk, &p.pos_q, &p.pos_k)) ||
	    (ret = resolve_positions(fn, desc, Lq, Lk, &p.q_start)))
		return ret;
	p.Lq = Lq;
	p.Lk = Lk;
	p.k_start = desc->k_start;
	p.causal = desc->causal;
	if (B == 0 || H == 0) {
		*out = 0; /* no head at all, however long the sequences */
		return 0;
	}
	if (p.pos_q && (ret = ape__pos_visible_pairs(p.pos_q, Lq, p.pos_k, Lk, p.causal,
						     &per_head)) == APE_ENOMEM)
		return ape__error(ret, "%s: out of host memory counting pairs", fn);
	if ((p.pos_q ? ret : ape__head_visible_pairs(&p, &per_head)) ||
	    __builtin_mul_overflow(per_head, (uint64_t)B, &total) ||
	    __builtin_mul_overflow(total, (uint64_t)H, &total))
		return ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", fn);
	*out = total;
	return 0;
}

void ape_tensor_strides(const ape_tensor *t, int64_t s[4])
{
	if (t->strides[0] || t->strides[1] || t->strides[2] || t->strides[3]) {
		memcpy(s, t->strides, 4 * sizeof(s[0]));
		return;
	}
	s[3] = 1;
	s[2] = t->shape[3];
	s[1] = t->shape[2] * s[2];
	s[0] = t->shape[1] * s[1];
}

int ape_tensor_rows(const ape_tensor *t, int64_t first, int64_t count, ape_tensor *out)
{
	APE__API_CALL("ape_tensor_rows");
	ape_tensor v;
	size_t esize;

	if (!t || !out)
		return ape__error(APE_EINVAL, "ape_tensor_rows: %s is NULL", t ? "out" : "t");
	for (int i = 0; i < 4; i++)
		if (t->shape[i] < 0 || t->strides[i] < 0)
			return ape__error(APE_EINVAL,
					  "ape_tensor_rows: t->%s[%d] = %" PRId64 " is negative",
					  t->shape[i] < 0 ? "shape" : "strides", i,
					  t->shape[i] < 0 ? t->shape[i] : t->strides[i]);
	if (first < 0 || count < 0 || first > t->shape[2] || count > t->shape[2] - first)
		return ape__error(APE_EINVAL,
				  "ape_tensor_rows: rows [%" PRId64 ", %" PRId64 " + %" PRId64
				  ") are not inside [0, %" PRId64 ")",
				  first, first, count, t->shape[2]);
	esize = ape_dtype_size(t->dtype);
	if (!esize)
		return ape__error(APE_EINVAL, "ape_tensor_rows: t->dtype = %d is not a storage type",
				  (int)t->dtype);
	v = *t;
	ape_tensor_strides(t, v.strides);
	/* in range: first <= L and the stride fit the caller's own allocation */
	v.data = t->data ? (char *)t->data + (size_t)first * (size_t)v.strides[2] * esize : NULL;
	v.shape[2] = count;
	*out = v;
	return 0;
}

void ape_tensor_init(ape_tensor *t, void *data, ape_dtype dtype, int64_t d0, int64_t d1,
		     int64_t d2, int64_t d3)
{
	if (!t)
		return;
	memset(t, 0, sizeof(*t));
	t->data = data;
	t->dtype = dtype;
	t->shape[0] = d0;
	t->shape[1] = d1;
	t->shape[2] = d2;
	t->shape[3] = d3;
}

int ape__check_tensor(const char *fn, const char *name, const ape_tensor *t, ape_dtype dtype,
		      const int64_t want[4], const char *const dims[4], int64_t s[4])
{
	uintptr_t range[2];

	return ape__check_tensor_span(fn, name, t, dtype, false, want, dims, false, s, range);
}

int ape__check_positions(const char *fn, int64_t q_start, int64_t Lq, int64_t k_start, int64_t Lk)
{
	ape_attn_desc d;
	int64_t qs;

	ape_attn_desc_init(&d);
	d.q_start_set = true;
	d.q_start = q_start;
	d.k_start = k_start;
	return resolve_positions(fn, &d, Lq, Lk, &qs);
}

int ape__check_tensor_span(const char *fn, const char *name, const ape_tensor *t, ape_dtype dtype,
			   bool f32_ok, const int64_t want[4], const char *const dims[4],
			   bool is_output, int64_t s[4], uintptr_t range[2])
{
	uint64_t span;
	int ret;

	if (!t)
		return ape__error(APE_EINVAL, "%s: %s = NULL", fn, name);
	if ((ret = check_dtype(fn, name, t->dtype)))
		return ret;
	if (t->dtype != dtype && !(f32_ok && t->dtype == APE_F32))
		return ape__error(APE_EINVAL, "%s: %s->dtype = %s: must be %s%s", fn, name,
				  ape_dtype_name(t->dtype), ape_dtype_name(dtype),
				  f32_ok && dtype != APE_F32 ? " or f32" : "");
	if ((ret = check_shape(fn, name, t, want, dims)) ||
	    (ret = resolve_strides(fn, name, t, s, &span)))
		return ret;
	if (is_output && (ret = check_no_self_overlap(fn, name, t, s)))
		return ret;
	range[0] = (uintptr_t)t->data;
	range[1] = (uintptr_t)t->data + (uintptr_t)span;
	return 0;
}

int ape__check_disjoint(const char *fn, const char *out_name, const uintptr_t out[2],
			const char *in_name, const uintptr_t in[2])
{
	const struct range o = { out_name, out[0], out[1] }, i = { in_name, in[0], in[1] };

	return check_disjoint(fn, &o, &i);
}

/* ---------------------------------------------------------------- diagnostics */

int ape__check_diag_outputs(const char *fn, const struct ape__problem *p, const ape_tensor *q,
			    const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
			    const float *lse, const float *ent, const float *md)
{
	const uint64_t bytes = (uint64_t)p->B * (uint64_t)p->H * (uint64_t)p->Lq * 4;
	const ape_tensor *t[4] = { q, k, v, o };
	static const char *const names[4] = { "q", "k", "v", "o" };
	struct range other[6], mine[2];
	int n = 0, ret;

	for (int i = 0; i < 4; i++) {
		int64_t s[4];
		uint64_t span;

		if (!t[i])
			continue;
		if ((ret = resolve_strides(fn, names[i], t[i], s, &span)))
			return ret;
		other[n++] = (struct range){ names[i], (uintptr_t)t[i]->data,
					     (uintptr_t)t[i]->data + (t[i]->data ? span : 0) };
	}
	other[n++] = (struct range){ "lse", (uintptr_t)lse, (uintptr_t)lse + (lse ? bytes : 0) };
	mine[0] = (struct range){ "entropy", (uintptr_t)ent, (uintptr_t)ent + (ent ? bytes : 0) };
	mine[1] = (struct range){ "mean_distance", (uintptr_t)md,
				  (uintptr_t)md + (md ? bytes : 0) };
	for (int j = 0; j < 2; j++)
		for (int i = 0; i < n; i++)
			if ((ret = check_disjoint(fn, &mine[j], &other[i])))
				return ret;
	return check_disjoint(fn, &mine[1], &mine[0]);
}
