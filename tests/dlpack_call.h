/* SPDX-License-Identifier: MIT */
/*
 * One forward call's DLPack tensors, as a framework would hand them over, for the DLPack tests
 * (test_dlpack.c, test_dlpack_devices.c): a case (sizes, dtypes, layout), its host data laid out
 * as the layout says with the DLTensors over it, the host call on the same data, random
 * awkward cases, and the refusal checks; likewise a ragged batch's packed tensors (struct rag).
 * Include after the Kselftest harness.
 */
#ifndef APE_TEST_DLPACK_CALL_H
#define APE_TEST_DLPACK_CALL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape_dlpack.h"
#include "common/problem.h"


/* Not every includer uses every helper (a build without OpenCL, the fault tests). */
#define RAG_FN static __attribute__((unused))

enum layout {
	COMPACT, /* [B, H, L, D], strides NULL */
	BLHD, /* [B, L, H, D + 3]: explicit strides, 3 unused elements after each row */
	PACKED, /* q, k, v slices of one [B, L, 3, H, D] tensor, o at a byte offset */
};

struct dlcase {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dt, odt;
	enum layout layout;
	bool with_lse, strided_lse;
};

struct dlcall {
	struct dlcase c;
	size_t esz, oesz;
	unsigned char *in, *in2; /* inputs (PACKED: one arena for q, k and v) */
	size_t in_bytes;
	unsigned char *out, *out_ref; /* o: the DLPack call's and the host call's */
	size_t out_bytes;
	float *lse, *lse_ref; /* lse: the DLPack call's (maybe strided) and the host call's */
	size_t lse_len;
	int64_t shp[5][4], str[5][4];
	DLTensor t[5]; /* q, k, v, o, lse */
	ape_tensor h[4]; /* q, k, v, o(ref) for ape_attention_forward() */
	ape_attn_desc desc;
};

RAG_FN void fill(ape_rng *r, void *dst, ape_dtype dt, size_t n)
{
	float *f = malloc(n * sizeof(float));

	for (size_t i = 0; i < n; i++)
		f[i] = (float)ape_rng_normal(r);
	ape_convert(dst, dt, f, APE_F32, n);
	free(f);
}

/* Sets tensor i: its DLTensor at data + off bytes, shape d, strides s (NULL: compact), and the
 * same view as an ape_tensor (for i < 4). */
RAG_FN void set_tensor(struct dlcall *x, int i, void *data, uint64_t off, ape_dtype dt,
		       const int64_t d[4], const int64_t *s)
{
	DLTensor *t = &x->t[i];
	const int nd = i == 4 ? 3 : 4;

	memcpy(x->shp[i], d, sizeof(x->shp[i]));
	if (s)
		memcpy(x->str[i], s, sizeof(x->str[i]));
	*t = (DLTensor){ .data = data,
			 .device = { kDLCPU, 0 },
			 .ndim = nd,
			 .dtype = test_dl_dtype(dt),
			 .shape = x->shp[i],
			 .strides = s ? x->str[i] : NULL,
			 .byte_offset = off };
	if (i < 4) {
		ape_tensor_init(&x->h[i], (unsigned char *)data + off, dt, d[0], d[1], d[2], d[3]);
		if (s)
			memcpy(x->h[i].strides, s, sizeof(x->h[i].strides));
	}
}

RAG_FN void dlcall_free(struct dlcall *x)
{
	free(x->in);
	free(x->in2);
	free(x->out);
	free(x->out_ref);
	free(x->lse);
	free(x->lse_ref);
	memset(x, 0, sizeof(*x));
}

RAG_FN void dlcall_make(struct dlcall *x, const struct dlcase *c, ape_rng *r)
{
	const int64_t B = c->B, H = c->H, G = c->Hkv, Lq = c->Lq, Lk = c->Lk, D = c->D;
	const int64_t qd[4] = { B, H, Lq, D }, kd[4] = { B, G, Lk, D }, od[4] = { B, H, Lq, D };
	const int64_t ld[4] = { B, H, Lq, 0 };
	size_t esz, oesz, osz;

	memset(x, 0, sizeof(*x));
	x->c = *c;
	esz = x->esz = ape_dtype_size(c->dt);
	oesz = x->oesz = ape_dtype_size(c->odt);
	ape_attn_desc_init(&x->desc);
	x->desc.delta.value = (float)(0.05 * ape_rng_uniform(r));
	x->desc.lambda.value = (float)(0.5 * ape_rng_uniform(r));
	x->desc.causal = ape_rng_range(r, 0, 1);
	if (c->layout == PACKED) {
		/* [B, L, 3, H, D]: H == Hkv, Lq == Lk */
		const int64_t s[4] = { Lq * 3 * H * D, D, 3 * H * D, 1 };

		x->in_bytes = (size_t)(B * Lq * 3 * H * D) * esz;
		x->in = malloc(x->in_bytes);
		fill(r, x->in, c->dt, x->in_bytes / esz);
		set_tensor(x, 0, x->in, 0, c->dt, qd, s);
		set_tensor(x, 1, x->in, (uint64_t)(H * D) * esz, c->dt, kd, s);
		set_tensor(x, 2, x->in + (size_t)(2 * H * D) * esz, 0, c->dt, kd, s);
	} else {
		const int64_t P = c->layout == BLHD ? D + 3 : D;
		const size_t qn = (size_t)(B * H * Lq * P), kn = (size_t)(B * G * Lk * P);
		const int64_t qs[4] = { Lq * H * P, P, H * P, 1 }, ks[4] = { Lk * G * P, P, G * P, 1 };

		x->in_bytes = (qn + 2 * kn) * esz;
		x->in = malloc(x->in_bytes + 1);
		fill(r, x->in, c->dt, x->in_bytes / esz);
		set_tensor(x, 0, x->in, 0, c->dt, qd, c->layout == BLHD ? qs : NULL);
		set_tensor(x, 1, x->in + qn * esz, 0, c->dt, kd, c->layout == BLHD ? ks : NULL);
		set_tensor(x, 2, x->in, (qn + kn) * esz, c->dt, kd, c->layout == BLHD ? ks : NULL);
	}
	/* O: compact, or [B, L, H, D] (BLHD), or compact 8 elements into its allocation (PACKED) */
	osz = (size_t)(B * H * Lq * D);
	x->out_bytes = (osz + 8 + (c->layout == BLHD ? (size_t)(B * H * Lq * 3) : 0)) * oesz;
	x->out = malloc(x->out_bytes);
	x->out_ref = malloc(x->out_bytes);
	memset(x->out, 0x5a, x->out_bytes);
	memset(x->out_ref, 0x5a, x->out_bytes);
	if (c->layout == BLHD) {
		const int64_t os[4] = { Lq * H * (D + 3), D + 3, H * (D + 3), 1 };

		set_tensor(x, 3, x->out, 0, c->odt, od, os);
	} else {
		set_tensor(x, 3, x->out, c->layout == PACKED ? 8 * oesz : 0, c->odt, od, NULL);
	}
	x->h[3] = x->h[3]; /* the reference's O: the same view of out_ref */
	x->h[3].data = x->out_ref + ((unsigned char *)x->h[3].data - x->out);
	if (c->with_lse) {
		const int64_t ls[4] = { H * (Lq + 2), Lq + 2, 1, 0 };

		x->lse_len = (size_t)(B * H * (c->strided_lse ? Lq + 2 : Lq));
		x->lse = malloc((x->lse_len + 1) * sizeof(float));
		x->lse_ref = malloc((size_t)(B * H * Lq + 1) * sizeof(float));
		for (size_t i = 0; i < x->lse_len; i++)
			x->lse[i] = 1234.5f;
		set_tensor(x, 4, x->lse, 0, APE_F32, ld, c->strided_lse ? ls : NULL);
	}
}

/* The host call's result on the same data. */
RAG_FN int dlcall_reference(ape_device *dev, struct dlcall *x)
{
	return ape_attention_forward(dev, &x->desc, &x->h[0], &x->h[1], &x->h[2], &x->h[3],
				     x->c.with_lse ? x->lse_ref : NULL, NULL);
}

RAG_FN int dlcall_run(ape_device *dev, struct dlcall *x, void *stream)
{
	return ape_attention_forward_dlpack(dev, &x->desc, &x->t[0], &x->t[1], &x->t[2], &x->t[3],
					    x->c.with_lse ? &x->t[4] : NULL, stream);
}
/* Random awkward sizes: odd lengths, GQA, D not a power of two. */
RAG_FN struct dlcase random_case(ape_rng *r, enum layout layout, ape_dtype dt)
{
	struct dlcase c = { 0 };

	c.B = ape_rng_range(r, 1, 3);
	c.Hkv = ape_rng_range(r, 1, 3);
	c.H = layout == PACKED ? c.Hkv : c.Hkv * ape_rng_range(r, 1, 3);
	c.Lk = ape_rng_range(r, 1, 37);
	c.Lq = layout == PACKED ? c.Lk : ape_rng_range(r, 1, 19);
	c.D = 2 * ape_rng_range(r, 1, 24);
	c.dt = dt;
	c.odt = ape_rng_range(r, 0, 1) ? APE_F32 : dt;
	c.layout = layout;
	c.with_lse = ape_rng_range(r, 0, 3) != 0;
	c.strided_lse = c.with_lse && ape_rng_range(r, 0, 1);
	return c;
}
/* ---- a ragged batch (ape_attention_forward_varlen_dlpack(), _backward_) */

enum { RAG_MAXS = 6 };
enum rag_pos { RAG_DEFAULT, RAG_SHIFTED, RAG_GAPS };

/*
 * A ragged batch's packed DLPack tensors over host memory, and the host call's ape_tensor views
 * of the same data, built apart from the library's reader: q, k, v compact [total, H, D],
 * with padded rows (strided), or slices of one packed [T, 3, H, D] QKV buffer (qkv: H == Hkv,
 * the same sequence lengths); O compact at a byte offset or with padded rows; LSE [total_q, H]
 * compact or head-major with padding (strided_lse: the library stages it).
 */
struct rag {
	int64_t S, H, G, D, tq, tk;
	int64_t cuq[RAG_MAXS + 1], cuk[RAG_MAXS + 1];
	int64_t *posq, *posk;
	ape_varlen vl;
	ape_dtype dt, odt;
	bool qkv, strided, with_lse, strided_lse;
	size_t esz, oesz;
	unsigned char *in, *out, *out_ref;
	size_t in_bytes, out_bytes;
	float *lse, *lse_ref;
	size_t lse_len;
	int64_t shp[5][3], str[5][3];
	DLTensor t[5]; /* q, k, v, o, lse */
	ape_tensor h[4]; /* q, k, v, o (over out_ref) */
	ape_attn_desc desc;
};

RAG_FN void rag_free(struct rag *x)
{
	free(x->posq);
	free(x->posk);
	free(x->in);
	free(x->out);
	free(x->out_ref);
	free(x->lse);
	free(x->lse_ref);
	memset(x, 0, sizeof(*x));
}

/* DLTensor i: [n0, n1, n2] (n2 < 0: 2-D) at data + off, strides s (NULL: compact). */
RAG_FN void rag_dl(struct rag *x, int i, void *data, uint64_t off, ape_dtype dt, int64_t n0,
		   int64_t n1, int64_t n2, const int64_t *s)
{
	const int nd = n2 < 0 ? 2 : 3;

	x->shp[i][0] = n0;
	x->shp[i][1] = n1;
	x->shp[i][2] = n2;
	if (s)
		memcpy(x->str[i], s, (size_t)nd * sizeof(*s));
	x->t[i] = (DLTensor){ .data = data, .device = { kDLCPU, 0 }, .ndim = nd,
			      .dtype = test_dl_dtype(dt), .shape = x->shp[i],
			      .strides = s ? x->str[i] : NULL, .byte_offset = off };
}

/* The host call's view of a [total, H, D] tensor at p with token stride ts, head stride hs. */
RAG_FN void rag_view(ape_tensor *h, void *p, ape_dtype dt, int64_t total, int64_t H, int64_t D,
		     int64_t ts, int64_t hs)
{
	ape_tensor_init(h, p, dt, 1, H, total, D);
	h->strides[0] = 0;
	h->strides[1] = hs;
	h->strides[2] = ts;
	h->strides[3] = 1;
}

RAG_FN void rag_make(struct rag *x, ape_rng *r, ape_dtype dt, bool qkv, bool strided,
		     enum rag_pos pos)
{
	int64_t H, G, D, P;
	size_t esz;

	memset(x, 0, sizeof(*x));
	x->dt = dt;
	x->odt = ape_rng_range(r, 0, 1) ? APE_F32 : dt;
	x->qkv = qkv;
	x->strided = strided;
	x->S = ape_rng_range(r, 0, RAG_MAXS);
	G = x->G = ape_rng_range(r, 1, 2);
	H = x->H = qkv ? G : G * ape_rng_range(r, 1, 3);
	D = x->D = 2 * ape_rng_range(r, 1, 12);
	esz = x->esz = ape_dtype_size(dt);
	x->oesz = ape_dtype_size(x->odt);
	for (int64_t s = 0; s < x->S; s++) {
		const int64_t lq = ape_rng_range(r, 0, 3) ? ape_rng_range(r, 1, 9) : 0;
		const int64_t lk = qkv ? lq : ape_rng_range(r, 0, 3) ? ape_rng_range(r, 1, 11) : 0;

		x->cuq[s + 1] = x->cuq[s] + lq;
		x->cuk[s + 1] = x->cuk[s] + lk;
	}
	x->tq = x->cuq[x->S];
	x->tk = x->cuk[x->S];
	ape_varlen_init(&x->vl);
	x->vl.num_seqs = x->S;
	x->vl.cu_seqlens_q = x->cuq;
	x->vl.cu_seqlens_k = x->cuk;
	if (pos != RAG_DEFAULT) {
		x->posq = malloc(sizeof(int64_t) * (size_t)(x->tq + 1));
		x->posk = malloc(sizeof(int64_t) * (size_t)(x->tk + 1));
		for (int64_t s = 0; s < x->S; s++) {
			const int64_t lq = x->cuq[s + 1] - x->cuq[s], lk = x->cuk[s + 1] - x->cuk[s];
			int64_t at = ape_rng_range(r, -100, 100);

			for (int64_t j = 0; j < lk; j++) {
				/* gaps: the second key always leaves one, so a sequence with two
				 * keys has two runs of consecutive positions */
				at += pos != RAG_GAPS ? 1 : ape_rng_range(r, j == 1 ? 2 : 1, 5);
				x->posk[x->cuk[s] + j] = at;
			}
			for (int64_t i = 0; i < lq; i++)
				x->posq[x->cuq[s] + i] = at - lq + 1 + i + (pos == RAG_GAPS ? 2 : 0);
		}
		x->vl.pos_q = x->posq;
		x->vl.pos_k = x->posk;
	}
	ape_attn_desc_init(&x->desc);
	x->desc.delta.value = (float)(0.05 * ape_rng_uniform(r));
	x->desc.lambda.value = (float)(0.5 * ape_rng_uniform(r));
	x->desc.causal = ape_rng_range(r, 0, 1);
	if (qkv) {
		const int64_t s[3] = { 3 * H * D, D, 1 };

		x->in_bytes = (size_t)(x->tq * 3 * H * D) * esz;
		x->in = malloc(x->in_bytes + 1);
		fill(r, x->in, dt, x->in_bytes / esz);
		rag_dl(x, 0, x->in, 0, dt, x->tq, H, D, s);
		rag_dl(x, 1, x->in, (uint64_t)(H * D) * esz, dt, x->tk, G, D, s);
		rag_dl(x, 2, x->in + (size_t)(2 * H * D) * esz, 0, dt, x->tk, G, D, s);
		for (int i = 0; i < 3; i++)
			rag_view(&x->h[i], x->in + (size_t)(i * H * D) * esz, dt, x->tq, H, D,
				 3 * H * D, D);
	} else {
		const size_t qn = (size_t)(x->tq * H * (D + 2)), kn = (size_t)(x->tk * G * (D + 2));
		const int64_t qs[3] = { H * (D + 2), D + 2, 1 }, ks[3] = { G * (D + 2), D + 2, 1 };

		P = strided ? D + 2 : D;
		x->in_bytes = (qn + 2 * kn) * esz;
		x->in = malloc(x->in_bytes + 1);
		fill(r, x->in, dt, x->in_bytes / esz);
		rag_dl(x, 0, x->in, 0, dt, x->tq, H, D, strided ? qs : NULL);
		rag_dl(x, 1, x->in + qn * esz, 0, dt, x->tk, G, D, strided ? ks : NULL);
		rag_dl(x, 2, x->in, (qn + kn) * esz, dt, x->tk, G, D, strided ? ks : NULL);
		rag_view(&x->h[0], x->in, dt, x->tq, H, D, H * P, P);
		rag_view(&x->h[1], x->in + qn * esz, dt, x->tk, G, D, G * P, P);
		rag_view(&x->h[2], x->in + (qn + kn) * esz, dt, x->tk, G, D, G * P, P);
	}
	/* O: compact 8 elements into its allocation, or with 3 unused elements after each row */
	P = strided ? D + 3 : D;
	x->out_bytes = (size_t)(x->tq * H * P + 8) * x->oesz;
	x->out = malloc(x->out_bytes);
	x->out_ref = malloc(x->out_bytes);
	memset(x->out, 0x5a, x->out_bytes);
	memset(x->out_ref, 0x5a, x->out_bytes);
	if (strided) {
		const int64_t os[3] = { H * P, P, 1 };

		rag_dl(x, 3, x->out, 0, x->odt, x->tq, H, D, os);
		rag_view(&x->h[3], x->out_ref, x->odt, x->tq, H, D, H * P, P);
	} else {
		rag_dl(x, 3, x->out, 8 * x->oesz, x->odt, x->tq, H, D, NULL);
		rag_view(&x->h[3], x->out_ref + 8 * x->oesz, x->odt, x->tq, H, D, H * D, D);
	}
	x->with_lse = ape_rng_range(r, 0, 3) != 0;
	x->strided_lse = x->with_lse && ape_rng_range(r, 0, 1);
	{
		const int64_t ls[2] = { 1, x->tq + 2 }; /* head-major, 2 unused after each head */

		x->lse_len = (size_t)(x->strided_lse ? H * (x->tq + 2) : x->tq * H);
		x->lse = malloc((x->lse_len + 1) * sizeof(float));
		x->lse_ref = malloc((size_t)(x->tq * H + 1) * sizeof(float));
		for (size_t i = 0; i < x->lse_len; i++)
			x->lse[i] = 1234.5f;
		rag_dl(x, 4, x->lse, 0, APE_F32, x->tq, H, -1, x->strided_lse ? ls : NULL);
	}
}

RAG_FN int rag_reference(ape_device *dev, struct rag *x)
{
	return ape_attention_forward_varlen(dev, &x->desc, &x->vl, &x->h[0], &x->h[1], &x->h[2],
					    &x->h[3], x->with_lse ? x->lse_ref : NULL, NULL);
}

RAG_FN int rag_run(ape_device *dev, struct rag *x, void *stream)
{
	return ape_attention_forward_varlen_dlpack(dev, &x->desc, &x->vl, &x->t[0], &x->t[1],
						   &x->t[2], &x->t[3],
						   x->with_lse ? &x->t[4] : NULL, stream);
}

/* x->lse's element (row t, head h) as the layout places it. */
RAG_FN float *rag_lse_at(const struct rag *x, int64_t t, int64_t h)
{
	return x->strided_lse ? &x->lse[h * (x->tq + 2) + t] : &x->lse[t * x->H + h];
}

/* SKIP after checks: the harness's SKIP() marks the test passed, so a failed check before it
 * would be hidden; this reports the failure instead. */
#define SKIP_UNLESS_FAILED(fmt, ...)                                                              \
	do {                                                                                       \
		if (!_metadata->passed)                                                            \
			return;                                                                    \
		SKIP(return, fmt, ##__VA_ARGS__);                                                  \
	} while (0)

/* The call fails with `err`, its message naming `what` (e.g. "k->dtype"). */
/* call returns err, its message naming `what` and the function fn */
#define EXPECT_REFUSED_BY(fn, err, what, call)                                                     \
	do {                                                                                       \
		int ret_ = (call);                                                                 \
		EXPECT_EQ(err, ret_) TH_LOG("%s: %s", what, ape_last_error());                     \
		EXPECT_NE(NULL, strstr(ape_last_error(), what))                                   \
		TH_LOG("message lacks \"%s\": %s", what, ape_last_error());                        \
		EXPECT_NE(NULL, strstr(ape_last_error(), fn));                                     \
	} while (0)
#define EXPECT_REFUSED(err, what, call)                                                            \
	EXPECT_REFUSED_BY("ape_attention_forward_dlpack", err, what, call)

#endif
