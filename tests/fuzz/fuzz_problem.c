/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: validation of forward calls (runtime/api/validate.c) through the internal entry
 * point and the public ape_attention_forward() on the reference backend. The input describes a
 * call: shapes (small, huge, negative, overflowing), strides (contiguous, padded, arbitrary),
 * dtypes, every descriptor field (NaN, Inf, denormals, raw bit patterns), positions, aliasing.
 *
 * Promises checked:
 * - a refused call returns a libape code with a message that names the function, and
 *   ape_attention_forward() refuses it too, with the same code, before touching memory: the
 *   tensors then point at addresses that are never mapped, so any access would crash;
 * - an accepted call that is small enough to run in microseconds runs on the reference backend
 *   over buffers exactly as large as the resolved strides address (AddressSanitizer catches a
 *   read or write outside them) and succeeds, in one piece and streamed in chunks of a few rows
 *   (ape_attention_forward_ex) under an arbitrary memory budget;
 * - the backward pass (ape_attention_backward) refuses what the forward refuses, without
 *   touching memory, and runs every accepted tiny call, in one piece and streamed;
 * - the distance rules every kernel uses (ape/ape_math.h, here compiled as host C: visible
 *   keys, anchor distance, a key range's smallest |n| and pairs, a head's pairs), at the
 *   accepted call's rows (any size, the int64 ends of the distances included) and at the
 *   padding rows and key tiles past its ends that kernels evaluate, against an exact 128-bit
 *   evaluation, with UBSan watching every signed operation;
 * - the diagnostics call (ape_attention_forward_diag) refuses what the forward refuses, with the
 *   same code; its entropy and mean-distance outputs, placed anywhere (unmapped, inside an
 *   input, O or LSE, over each other), are refused exactly where ape__check_diag_outputs()
 *   refuses them, before anything is touched; an accepted tiny call runs, in one piece and
 *   streamed, every row written with an entropy in [0, ln Lk] (or NaN) and a distance >= 0;
 * - calls at explicit positions (desc->pos_q, desc->pos_k; check_positions()): 0.. end-aligned,
 *   small or any int64, one of them NULL, q_start_set and k_start as fuzzed. A refusal by
 *   ape__problem_init_pos() (EINVAL or EOVERFLOW) is ape_attention_forward()'s too, with the
 *   same code, and the backward's, before the (unmapped) tensors are touched; an accepted tiny
 *   call runs, its O and LSE bit for bit those of each batch element as a one-sequence ragged
 *   call at the same positions and, at 0.. end-aligned, the implicit call's; so are its
 *   backward's dQ, dK, dV those of the ragged backward per element;
 * - distance-bias tables (desc->bias_table: any length and row count, any entries, NaN and
 *   Inf included): refused by validation exactly as by the public calls, before anything is
 *   touched; an accepted tiny call's forward and backward (with the table's gradient into a
 *   buffer exactly its size) run.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"
#include "api/validate.h"
#define APE_REAL double
#include "ape/ape_math.h"
#include "exec/problem.h"

#define FUZZ_NAME "fuzz_problem"
#include "fuzz/fuzz_input.h"

/* ---------------------------------------------------------------- reading the input */

static float take_float(struct in *in)
{
	static const float special[16] = {
		0.0f, 0.1f, 0.397f, -0.5f, 1.0f, 1e30f, -1e30f, FLT_MAX, -FLT_MAX, FLT_MIN,
		1e-45f /* denormal */, 100.0f, -0.0f, 2.0f, 0.01f, 88.0f,
	};
	unsigned c = (unsigned)take(in, 1);
	uint32_t bits;
	float f;

	if (c < 0xC0)
		return special[c & 15];
	if (c < 0xE0)
		return c & 1 ? NAN : (c & 2 ? -INFINITY : INFINITY);
	bits = (uint32_t)take(in, 4);
	memcpy(&f, &bits, sizeof(f));
	return f;
}

static double take_double(struct in *in)
{
	uint64_t bits;
	double d;

	if (take(in, 1) & 1)
		return take_float(in);
	bits = take(in, 8);
	memcpy(&d, &bits, sizeof(d));
	return d;
}

static ape_dtype take_dtype(struct in *in)
{
	unsigned c = (unsigned)take(in, 1);

	return c < 0xF0 ? (ape_dtype)(c % 3) : (ape_dtype)(int)(int8_t)c;
}

/* ---------------------------------------------------------------- building the call */

#define MAX_PER_HEAD 64

struct call {
	ape_attn_desc desc;
	ape_tensor t[4]; /* q, k, v, o */
	float per_head[4][MAX_PER_HEAD];
	bool want_lse;
	bool positions; /* the call at explicit positions (check_positions()) */
	float table[4 * 70]; /* desc->bias_table's entries, when fuzzed */
};

static void take_strides(struct in *in, ape_tensor *t)
{
	unsigned mode = (unsigned)take(in, 1) & 3;
	uint64_t row;
	int64_t pad;

	if (mode == 0)
		return; /* contiguous */
	if (mode == 1) {
		for (int d = 0; d < 4; d++)
			t->strides[d] = take_int(in);
		return;
	}
	/* the layouts real models use: [B, L, H, D] rows with padding, or padded [B, H, L, D] */
	/* in uint64_t: absurd shapes wrap here (as a careless caller's would) instead of being
	 * undefined behaviour in the harness */
	pad = take_int(in);
	row = (uint64_t)t->shape[3] + (uint64_t)pad;
	t->strides[3] = 1;
	if (mode == 2) {
		t->strides[1] = (int64_t)row;
		t->strides[2] = (int64_t)((uint64_t)t->shape[1] * row);
	} else {
		t->strides[2] = (int64_t)row;
		t->strides[1] = (int64_t)((uint64_t)t->shape[2] * row);
	}
	t->strides[0] = (int64_t)((uint64_t)t->shape[1] * (uint64_t)t->shape[2] * row);
}

static void take_param(struct in *in, ape_param *prm, float *arr, int64_t H)
{
	prm->value = take_float(in);
	if (H >= 1 && H <= MAX_PER_HEAD && (take(in, 1) & 1)) {
		for (int64_t h = 0; h < H; h++)
			arr[h] = take_float(in);
		prm->per_head = arr;
	}
}

static void take_call(struct in *in, struct call *c)
{
	int64_t B, H, Hkv, Lq, Lk, D;
	unsigned flags, which;
	ape_dtype dt;

	B = take_int(in);
	H = take_int(in);
	Hkv = take_int(in);
	Lq = take_int(in);
	Lk = take_int(in);
	/* D is even in every valid call: stay mostly there */
	D = (int64_t)((uint64_t)take_int(in) * 2);
	dt = take_dtype(in);
	ape_tensor_init(&c->t[0], NULL, dt, B, H, Lq, D);
	ape_tensor_init(&c->t[1], NULL, dt, B, Hkv, Lk, D);
	ape_tensor_init(&c->t[2], NULL, dt, B, Hkv, Lk, D);
	ape_tensor_init(&c->t[3], NULL, take(in, 1) & 1 ? APE_F32 : dt, B, H, Lq, D);
	/* one field anywhere, any value: mismatched shapes, dtypes */
	which = (unsigned)take(in, 1);
	if (which & 0x80)
		c->t[(which >> 4) & 3].shape[which & 3] = take_int(in);
	if (which & 0x40)
		c->t[(which >> 2) & 3].dtype = take_dtype(in);
	for (int i = 0; i < 4; i++)
		take_strides(in, &c->t[i]);

	ape_attn_desc_init(&c->desc);
	take_param(in, &c->desc.delta, c->per_head[0], H);
	take_param(in, &c->desc.beta, c->per_head[1], H);
	take_param(in, &c->desc.gamma, c->per_head[2], H);
	take_param(in, &c->desc.lambda, c->per_head[3], H);
	flags = (unsigned)take(in, 2);
	c->desc.causal = flags & 1;
	c->desc.q_start_set = flags & 2;
	c->desc.scale_set = flags & 4;
	c->want_lse = flags & 8;
	if (flags & 16)
		c->desc.layout = APE_ROPE_INTERLEAVED;
	if (flags & 32)
		c->desc.layout = (ape_rope_layout)(int)take_int(in);
	if (flags & 64)
		c->desc.rope_base = take_double(in);
	if (flags & 128)
		c->desc.skip_tol = take_double(in);
	if (flags & 256)
		c->desc.k_start = take_int(in);
	if (flags & 512)
		c->desc.q_start = take_int(in);
	if (c->desc.scale_set)
		c->desc.scale = take_double(in);
	if (flags & 1024)
		c->desc.struct_size = (size_t)take_int(in);
	c->positions = flags & 2048;
	if (flags & 4096) /* position interpolation: any double, refused unless finite and > 0 */
		c->desc.rope_scale = take_double(in);
	if (flags & 8192) { /* a distance-bias table: any length and rows, any entries (NaN too) */
		const int64_t len = (int64_t)(take(in, 1) % 72) - 2, rows = (int64_t)(take(in, 1) % 5);

		for (int64_t i = 0; i < len * rows && i < 4 * 70; i++)
			c->table[i] = take_float(in);
		c->desc.bias_table = c->table;
		/* a length past APE_BIAS_TABLE_MAX (refused before any entry is read) or the
		 * entries given */
		c->desc.bias_table_len = take(in, 1) == 0xff ? ((int64_t)1 << 24) + 1 : len;
		c->desc.bias_table_heads = rows;
	}
}

/* ---------------------------------------------------------------- running it */

/* Elements addressed by tensor t with resolved strides s (0 when it has no element). */
static uint64_t span_of(const ape_tensor *t, const int64_t s[4])
{
	uint64_t span = 1;

	for (int d = 0; d < 4; d++) {
		if (t->shape[d] == 0)
			return 0;
		span += (uint64_t)(t->shape[d] - 1) * (uint64_t)s[d];
	}
	return span;
}

/*
 * The backward pass of an accepted tiny call, over its O and LSE: dO from what the input has
 * left, every gradient wanted, each in the inputs' type or float32, contiguous; in one piece
 * and, with eo, streamed under the fuzzed budget over 1 to 3 entries of the reference device
 * (the key chunks split between them). ASan sees every buffer's bounds.
 */
static void run_backward(const struct call *c, const struct ape__problem *p, ape_tensor t[4],
			 struct in *in, const ape_exec_options *eo)
{
	const size_t rows = (size_t)(p->B * p->H * p->Lq);
	const size_t nq = rows * (size_t)p->D, nk = (size_t)(p->B * p->Hkv * p->Lk * p->D);
	const ape_dtype gt = take(in, 1) & 1 ? APE_F32 : p->in_dtype;
	const int ndev = 1 + (int)(take(in, 1) % 3);
	ape_device *const devs[3] = { ref, ref, ref };
	const size_t esz = ape_dtype_size(p->in_dtype), gsz = ape_dtype_size(gt);
	float *lse = malloc((rows + 1) * sizeof(float)), dparams[4 * 16], dbias[4 * 70];
	ape_attn_desc d = c->desc; /* with the table's gradient wanted when there is a table */
	void *dout = malloc(nq * esz + 1), *dq = malloc(nq * gsz + 1);
	void *dk = malloc(nk * gsz + 1), *dv = malloc(nk * gsz + 1);
	ape_tensor tdo, tdq, tdk, tdv;
	int ret;

	check(lse && dout && dq && dk && dv, "malloc");
	for (size_t b = 0; b < nq * esz; b++)
		((uint8_t *)dout)[b] = (uint8_t)take(in, 1);
	ape_tensor_init(&tdo, dout, p->in_dtype, p->B, p->H, p->Lq, p->D);
	ape_tensor_init(&tdq, dq, gt, p->B, p->H, p->Lq, p->D);
	ape_tensor_init(&tdk, dk, gt, p->B, p->Hkv, p->Lk, p->D);
	ape_tensor_init(&tdv, dv, gt, p->B, p->Hkv, p->Lk, p->D);
	ret = ape_attention_forward(ref, &c->desc, &t[0], &t[1], &t[2], &t[3], lse, NULL);
	check(ret == 0, "the forward of an accepted small call runs");
	d.dbias_table = d.bias_table ? dbias : NULL;
	ret = ape_attention_backward(ref, &d, &t[0], &t[1], &t[2], &t[3], lse, &tdo, NULL, &tdq,
				     &tdk, &tdv, dparams, NULL);
	check(ret == 0, "the backward of an accepted small call runs on the reference backend");
	if (eo) {
		ret = ape_attention_backward_ex(devs, ndev, eo, &d, &t[0], &t[1], &t[2],
						&t[3], lse, &tdo, lse, &tdq, &tdk, &tdv, dparams,
						NULL);
		check(ret == 0 || (ret == APE_ENOMEM && eo->max_device_bytes),
		      "a streamed backward succeeds, or says the budget is too small");
	}
	free(lse);
	free(dout);
	free(dq);
	free(dk);
	free(dv);
}

static void run_diag(const struct call *c, const struct ape__problem *p, ape_tensor t[4],
		     float *lse, const ape_exec_options *eo);

/* The tensors of an accepted call over buffers exactly as large as their resolved strides
 * address, filled from what the input has left (raw bit patterns, NaN included), then zeros:
 * t[i] over buf[i] (malloc'ed), its size in bytes[i] (bytes NULL: not wanted). */
static void take_buffers(const struct call *c, const struct ape__problem *p, struct in *in,
			 ape_tensor t[4], void *buf[4], size_t *bytes)
{
	const int64_t *s[4] = { p->qs, p->ks, p->vs, p->os };

	for (int i = 0; i < 4; i++) {
		const size_t n = span_of(&c->t[i], s[i]) * ape_dtype_size(c->t[i].dtype);

		t[i] = c->t[i];
		buf[i] = malloc(n ? n : 1);
		check(buf[i] != NULL, "malloc");
		for (size_t b = 0; b < n; b++)
			((uint8_t *)buf[i])[b] = (uint8_t)take(in, 1);
		t[i].data = buf[i];
		if (bytes)
			bytes[i] = n;
	}
}

/* Accepted and tiny: run it for real, over buffers exactly as large as the strides address. */
static void run_accepted(const struct call *c, const struct ape__problem *p, struct in *in)
{
	ape_tensor t[4];
	void *buf[4] = { NULL };
	float *lse = NULL;
	size_t lse_n = (size_t)(p->B * p->H * p->Lq);
	ape_exec_options eo;
	bool stream;
	int ret;

	/* read before the data, which takes the rest of the input */
	ape_exec_options_init(&eo);
	stream = take(in, 1) & 1;
	eo.chunk_q = take(in, 1) & 31;
	eo.chunk_k = take(in, 1) & 31;
	eo.pipeline_depth = (int)(take(in, 1) & 3);
	eo.flags = take(in, 1) & 1 ? APE_EXEC_ATOMIC_OUTPUTS : 0;
	eo.max_device_bytes = take(in, 1) & 1 ? take(in, 3) : 0;

	take_buffers(c, p, in, t, buf, NULL);
	if (c->want_lse) {
		lse = malloc((lse_n ? lse_n : 1) * sizeof(float));
		check(lse != NULL, "malloc");
	}
	ret = ape_attention_forward(ref, &c->desc, &t[0], &t[1], &t[2], &t[3], lse, NULL);
	check(ret == 0, "an accepted small call runs on the reference backend");
	if (stream) {
		/* the same call streamed in chunks of a few rows, under a budget */
		ret = ape_attention_forward_ex(&ref, 1, &eo, &c->desc, &t[0], &t[1], &t[2], &t[3],
					       lse, NULL);
		check(ret == 0 || (ret == APE_ENOMEM && eo.max_device_bytes),
		      "a streamed call succeeds, or says the budget is too small");
	}
	run_diag(c, p, t, lse, stream ? &eo : NULL);
	run_backward(c, p, t, in, stream ? &eo : NULL);
	for (int i = 0; i < 4; i++)
		free(buf[i]);
	free(lse);
}

/*
 * The diagnostics' outputs of a validated call (its tensors at unmapped addresses), placed by
 * the input: apart, inside q, k, v, o or lse at a fuzzed offset, or the mean distance over the
 * entropy. ape_attention_forward_diag() must give ape__check_diag_outputs()'s verdict, without
 * touching memory: a placement it accepts is then run with an invalid desc (rope_base -1,
 * found before any work) so that nothing is written either. False when the placement was
 * refused (the call is done with).
 */
static bool check_diag_placement(struct call *c, const struct ape__problem *p, float *lse,
				 struct in *in)
{
	float *out[2] = { (float *)(uintptr_t)0x7ff400000000ull,
			  (float *)(uintptr_t)0x7ff600000000ull };
	unsigned how = (unsigned)take(in, 1);
	ape_attn_desc bad = c->desc;
	int ret, fret;

	for (int j = 0; j < 2; j++, how >>= 3) {
		const unsigned w = how & 7;
		uint8_t *at = w < 4 ? (uint8_t *)c->t[w].data : w == 4 ? (uint8_t *)lse : NULL;

		if (at)
			out[j] = (float *)(at + (take(in, 2) & ~(uint64_t)3));
		else if (w == 5 && j == 1 && out[0])
			out[1] = out[0] + (take(in, 1) & 15);
		else if (w == 6)
			out[j] = NULL;
	}
	ret = ape__check_diag_outputs("fuzz", p, &c->t[0], &c->t[1], &c->t[2], &c->t[3], lse,
				      out[0], out[1]);
	check(ret == 0 || ret == APE_EINVAL, "the diagnostics' placement: 0 or EINVAL");
	bad.rope_base = -1;
	fret = ape_attention_forward_diag(&ref, 1, NULL, ret ? &c->desc : &bad, &c->t[0],
					  &c->t[1], &c->t[2], &c->t[3], lse, out[0], out[1], NULL);
	if (ret) {
		check(fret == ret, "ape_attention_forward_diag refuses a placement validation refuses");
		check(strstr(ape_last_error(), "overlaps") != NULL, "the message says what overlaps");
		return false;
	}
	check(fret == APE_EINVAL && strstr(ape_last_error(), "rope_base"),
	      "an accepted placement with a bad desc is refused for the desc alone");
	return true;
}

/* An accepted tiny call with both diagnostics, in one piece and streamed (eo): every row's
 * entropy within [0, ln Lk] (NaN rows aside: NaN or Inf inputs) and its distance >= 0. */
static void run_diag(const struct call *c, const struct ape__problem *p, ape_tensor t[4],
		     float *lse, const ape_exec_options *eo)
{
	const size_t rows = (size_t)(p->B * p->H * p->Lq);
	float *ent = malloc(rows * sizeof(float) + 4), *md = malloc(rows * sizeof(float) + 4);
	const double emax = p->Lk > 1 ? log((double)p->Lk) + 1e-3 : 1e-3;
	int ret;

	check(ent && md, "malloc");
	for (int pass = 0; pass < (eo ? 2 : 1); pass++) {
		for (size_t r = 0; r < rows; r++)
			ent[r] = md[r] = -1.0f; /* every row must be written */
		ret = ape_attention_forward_diag(&ref, 1, pass ? eo : NULL, &c->desc, &t[0], &t[1],
						 &t[2], &t[3], lse, ent, md, NULL);
		if (pass && ret == APE_ENOMEM && eo->max_device_bytes)
			break; /* the budget is too small, and it said so */
		check(ret == 0, "an accepted small diagnostics call runs on the reference backend");
		for (size_t r = 0; r < rows; r++) {
			check(isnan(ent[r]) || (ent[r] >= -1e-3 && ent[r] <= emax),
			      "entropy in [0, ln Lk] or NaN");
			check(isnan(md[r]) || md[r] >= 0, "mean distance >= 0 or NaN");
		}
	}
	free(ent);
	free(md);
}

/* ---------------------------------------------------------------- the kernels' rules */

typedef __int128 i128;

static i128 sat64(i128 x)
{
	return x < INT64_MIN ? INT64_MIN : x > INT64_MAX ? INT64_MAX : x;
}

/* Exact: keys j0..j1-1 (j0 < j1) of a row at diag, the smallest |n| (saturated at 2^63 - 1). */
static i128 min_abs128(i128 diag, i128 j0, i128 j1)
{
	const i128 lo = diag - (j1 - 1), hi = diag - j0;

	return sat64(lo > 0 ? lo : hi < 0 ? -hi : 0);
}

/* Exact: how many of keys j0..j1-1 a row at diag sees. */
static i128 pairs128(i128 diag, i128 j0, i128 j1, bool causal)
{
	const i128 e = !causal ? j1 : diag + 1 < j0 ? j0 : diag + 1 > j1 ? j1 : diag + 1;

	return j1 > j0 && e > j0 ? e - j0 : 0;
}

/*
 * One row (a real one, or a padding row past the end at diag saturated, as kernels form it)
 * against keys 0..Lk-1 and the tile [j0, j1) the input picks: every rule of ape_math.h against
 * the exact value, by brute force over the keys when there are few.
 */
static void check_row_rules(int64_t diag, bool real, int64_t Lk, int64_t j0, int64_t j1,
			    bool causal)
{
	const int64_t vis = ape_visible_keys(diag, Lk, causal);
	const int64_t an = ape_anchor_distance(diag, Lk, causal);
	const int64_t pr = ape_row_visible_pairs(diag, j0, j1, causal);

	check(vis >= 0 && vis <= Lk && an >= 0 && pr >= 0 && pr <= (j1 > j0 ? j1 - j0 : 0),
	      "the distance rules stay in range at any row");
	if (j1 > j0)
		check(ape_keys_min_abs(diag, j0, j1) >= 0, "a key range's smallest |n| is >= 0");
	if (!real)
		return; /* a padding row's values are never used */
	check(vis == pairs128(diag, 0, Lk, causal), "ape_visible_keys is exact");
	check(pr == pairs128(diag, j0, j1, causal), "ape_row_visible_pairs is exact");
	check(an == (vis ? (causal ? min_abs128(diag, 0, vis) : min_abs128(diag, 0, Lk)) : 0),
	      "ape_anchor_distance is the nearest visible |n|");
	if (j1 > j0)
		check(ape_keys_min_abs(diag, j0, j1) == min_abs128(diag, j0, j1),
		      "ape_keys_min_abs is exact");
	if (Lk <= 64) { /* and the keys one by one */
		i128 cnt = 0, mn = -1;

		for (int64_t j = 0; j < Lk; j++) {
			const i128 n = (i128)diag - j, a = n < 0 ? -n : n;

			if (causal && n < 0)
				continue;
			cnt++;
			mn = mn < 0 || a < mn ? a : mn;
		}
		check(vis == cnt && an == (cnt ? sat64(mn) : 0),
		      "the rules agree with brute force");
	}
}

/* The rules at an accepted call's rows (first, middle, last) and at the padding rows a tile
 * adds past the last, over key tiles of 16 and 64 (the first, the last, the last row's
 * diagonal); and the head's pairs in closed form against the 128-bit one. Takes no input, so
 * that the corpus keeps its meaning for what follows. */
static void check_rules(const struct ape__problem *p)
{
	const int64_t rel = p->q_start - p->k_start; /* row 0 to key 0: validated to fit */
	const int64_t rows[3] = { 0, p->Lq / 2, p->Lq - 1 };
	uint64_t pairs;

	if (p->Lq <= 0 || p->Lk <= 0)
		return;
	for (int64_t tile = 16; tile <= 64; tile *= 4) {
		const int64_t dl = rel + (p->Lq - 1); /* the last row's diagonal key, if any */
		const int64_t dk = dl < 0 ? 0 : dl >= p->Lk ? p->Lk - 1 : dl;
		const int64_t starts[3] = { 0, (p->Lk - 1) / tile * tile, dk / tile * tile };

		for (int s = 0; s < 3; s++) {
			const int64_t j0 = starts[s], j1 = j0 + tile < p->Lk ? j0 + tile : p->Lk;

			for (int r = 0; r < 3; r++)
				check_row_rules(rel + rows[r], true, p->Lk, j0, j1, p->causal);
			/* past the last row: saturated, as kernels form them */
			for (int64_t r = 1; r <= 64; r += 21)
				check_row_rules(ape_sat_add(dl, r), false, p->Lk, j0, j1,
						p->causal);
		}
	}
	{
		/* rows x = rel + 1 .. rel + Lq see clamp(x, 0, Lk) keys (causal) */
		const i128 a = (i128)rel + 1, last = a + p->Lq - 1;
		i128 want = 0, f, l;

		if (!p->causal) {
			want = (i128)p->Lq * p->Lk;
		} else {
			f = a > 1 ? a : 1;
			l = last < p->Lk ? last : p->Lk;
			if (l >= f)
				want += (f + l) * (l - f + 1) / 2;
			f = a > (i128)p->Lk + 1 ? a : (i128)p->Lk + 1;
			if (last >= f)
				want += (last - f + 1) * p->Lk;
		}
		if (ape_rows_visible_pairs(rel, p->Lq, p->Lk, p->causal, &pairs))
			check(want > (i128)UINT64_MAX && pairs == UINT64_MAX,
			      "a head's pairs overflow only past 2^64 - 1");
		else
			check(want == (i128)pairs, "ape_rows_visible_pairs is exact");
		check(ape__head_visible_pairs(p, &pairs) == (want > (i128)UINT64_MAX ? -1 : 0),
		      "the executor's count is the shared rule's");
	}
}

/* ---------------------------------------------------------------- explicit positions */

enum { MAXP = 64 };

/* Batch element b of t (resolved strides st) as a [1, H, L, D] tensor. */
static ape_tensor element_of(const ape_tensor *t, const int64_t st[4], int64_t b)
{
	ape_tensor x = *t;

	x.data = (uint8_t *)t->data + (size_t)(b * st[0]) * ape_dtype_size(t->dtype);
	x.shape[0] = 1;
	memcpy(x.strides, st, sizeof(x.strides));
	return x;
}

/*
 * An accepted tiny call at explicit positions: the forward runs; each batch element as a
 * one-sequence ragged call at the same positions (desc without them) gives the same O and LSE
 * bit for bit; positions 0.., queries end-aligned (dflt) give the implicit call's, bit for bit;
 * the backward at the positions runs, its dQ, dK, dV bit for bit those of each batch element's
 * one-sequence ragged backward.
 */
static void run_positions(const struct call *c, const struct ape__problem *p, struct in *in,
			  bool dflt)
{
	const size_t rows = (size_t)(p->B * p->H * p->Lq);
	const int64_t cuq[2] = { 0, p->Lq }, cuk[2] = { 0, p->Lk };
	float *lse = malloc((rows + 1) * sizeof(float)), *lse2 = malloc((rows + 1) * sizeof(float));
	float *lr = malloc((rows + 1) * sizeof(float)), dparams[4 * 16];
	ape_attn_desc d = c->desc;
	ape_tensor t[4], o2, g[3];
	void *buf[4], *obuf, *o0, *gbuf[3];
	size_t bytes[4];
	ape_varlen vl;
	int ret;

	check(lse && lse2 && lr, "malloc");
	take_buffers(c, p, in, t, buf, bytes);
	obuf = malloc(bytes[3] + 1);
	o0 = malloc(bytes[3] + 1);
	check(obuf && o0, "malloc");
	memcpy(obuf, buf[3], bytes[3]);
	memcpy(o0, buf[3], bytes[3]); /* O's bytes before any call */
	o2 = t[3];
	o2.data = obuf;
	ret = ape_attention_forward(ref, &c->desc, &t[0], &t[1], &t[2], &t[3], lse, NULL);
	check(ret == 0, "an accepted small call at explicit positions runs on the reference");
	/* per batch element: a one-sequence ragged batch at the same positions */
	d.pos_q = d.pos_k = NULL;
	ape_varlen_init(&vl);
	vl.num_seqs = 1;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	vl.pos_q = c->desc.pos_q;
	vl.pos_k = c->desc.pos_k;
	for (int64_t b = 0; b < p->B; b++) {
		ape_tensor e[4] = { element_of(&t[0], p->qs, b), element_of(&t[1], p->ks, b),
				    element_of(&t[2], p->vs, b), element_of(&o2, p->os, b) };

		ret = ape_attention_forward_varlen(ref, &d, &vl, &e[0], &e[1], &e[2], &e[3], lr,
						   NULL);
		check(ret == 0, "each batch element runs as a one-sequence ragged call");
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = 0; i < p->Lq; i++)
				lse2[(b * p->H + h) * p->Lq + i] = lr[i * p->H + h];
	}
	check(!memcmp(obuf, buf[3], bytes[3]), "O at positions is the ragged calls', bit for bit");
	check(!memcmp(lse, lse2, rows * sizeof(float)),
	      "LSE at positions is the ragged calls', bit for bit");
	if (dflt) { /* 0.., end-aligned: the implicit call */
		memcpy(obuf, o0, bytes[3]);
		d.q_start_set = false;
		d.k_start = 0;
		ret = ape_attention_forward(ref, &d, &t[0], &t[1], &t[2], &o2, lse2, NULL);
		check(ret == 0, "the implicit call runs");
		check(!memcmp(lse, lse2, rows * sizeof(float)) && !memcmp(obuf, buf[3], bytes[3]),
		      "positions 0.., end-aligned, are the implicit call, bit for bit");
	}
	/* the backward at the positions, dO = Q (of the inputs' type and shape) */
	for (int i = 0; i < 3; i++) {
		const ape_tensor *x = &t[i ? 1 : 0];
		const size_t n = (size_t)(x->shape[0] * x->shape[1] * x->shape[2] * x->shape[3]);

		gbuf[i] = malloc(n * sizeof(float) + 1);
		check(gbuf[i] != NULL, "malloc");
		ape_tensor_init(&g[i], gbuf[i], APE_F32, x->shape[0], x->shape[1], x->shape[2],
				x->shape[3]);
	}
	ret = ape_attention_backward(ref, &c->desc, &t[0], &t[1], &t[2], &t[3], lse, &t[0], NULL,
				     &g[0], &g[1], &g[2], dparams, NULL);
	check(ret == 0, "the backward of an accepted small call at positions runs");
	/* per batch element, the one-sequence ragged backward: dQ, dK, dV bit for bit */
	for (int64_t b = 0; b < p->B; b++) {
		const int64_t *st[4] = { p->qs, p->ks, p->vs, p->os };
		const size_t nq = (size_t)(p->H * p->Lq * p->D), nk = (size_t)(p->Hkv * p->Lk * p->D);
		float *gr = malloc((nq + 2 * nk + 1) * sizeof(float)), dpr[4 * 16];
		ape_tensor e[4], ge[3];

		check(gr != NULL, "malloc");
		for (int i = 0; i < 4; i++)
			e[i] = element_of(&t[i], st[i], b);
		ape_tensor_init(&ge[0], gr, APE_F32, 1, p->H, p->Lq, p->D);
		ape_tensor_init(&ge[1], gr + nq, APE_F32, 1, p->Hkv, p->Lk, p->D);
		ape_tensor_init(&ge[2], gr + nq + nk, APE_F32, 1, p->Hkv, p->Lk, p->D);
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = 0; i < p->Lq; i++)
				lr[i * p->H + h] = lse[(b * p->H + h) * p->Lq + i];
		ret = ape_attention_backward_varlen(&ref, 1, NULL, &d, &vl, &e[0], &e[1], &e[2],
						    &e[3], lr, &e[0], NULL, &ge[0], &ge[1], &ge[2],
						    dpr, NULL);
		check(ret == 0, "each batch element's ragged backward runs");
		check(!memcmp(gr, (float *)gbuf[0] + (size_t)b * nq, nq * sizeof(float)) &&
			      !memcmp(gr + nq, (float *)gbuf[1] + (size_t)b * nk, nk * sizeof(float)) &&
			      !memcmp(gr + nq + nk, (float *)gbuf[2] + (size_t)b * nk,
				      nk * sizeof(float)),
		      "the backward at positions is the ragged calls', bit for bit");
		free(gr);
	}
	for (int i = 0; i < 3; i++)
		free(gbuf[i]);
	for (int i = 0; i < 4; i++)
		free(buf[i]);
	free(obuf);
	free(o0);
	free(lse);
	free(lse2);
	free(lr);
}

/*
 * The call at explicit positions read from the input (Lq, Lk <= 64): 0.. end-aligned plus a
 * base, small values around a base, or any int64 (the ends of the range: distances that
 * overflow); one array or both NULL; q_start_set and k_start as fuzzed. Validation
 * (ape__problem_init_pos()) refuses with EINVAL or EOVERFLOW, and then the public forward and
 * backward refuse it too, with the same code, before touching the tensors (unmapped), their
 * messages naming them; or it accepts, and a tiny call runs (run_positions()).
 */
static void check_positions(struct call *c, struct in *in)
{
	static int64_t pq[MAXP], pk[MAXP];
	const int64_t Lq = c->t[0].shape[2], Lk = c->t[1].shape[2];
	const unsigned how = (unsigned)take(in, 1);
	const uint64_t base = how & 4 ? (uint64_t)take_int(in) : 0;
	float *lse = c->want_lse ? (float *)(uintptr_t)0x7ff000000000ull : NULL;
	struct ape__problem p;
	uint64_t work;
	int ret, fret;

	if (Lq < 0 || Lk < 0 || Lq > MAXP || Lk > MAXP || c->t[3].shape[2] > MAXP)
		return;
	/* in uint64_t: a base near the ends wraps, as a careless caller's would */
	for (int64_t j = 0; j < Lk; j++)
		pk[j] = (how & 3) == 0 ? (int64_t)(base + (uint64_t)j)
			: (how & 3) == 1 ? (int64_t)(base + take(in, 1) % 40)
					 : take_int(in);
	for (int64_t i = 0; i < Lq; i++)
		pq[i] = (how & 3) == 0 ? (int64_t)(base + (uint64_t)(Lk - Lq + i))
			: (how & 3) == 1 ? (int64_t)(base + take(in, 1) % 40)
					 : take_int(in);
	c->desc.pos_q = how & 8 ? NULL : pq;
	c->desc.pos_k = how & 16 ? NULL : pk;
	for (int i = 0; i < 4; i++)
		c->t[i].data = (void *)(uintptr_t)(0x7f0000000000ull + ((uint64_t)i << 36));
	ret = ape__problem_init_pos(&p, "fuzz", &c->desc, &c->t[0], &c->t[1], &c->t[2], &c->t[3],
				    lse);
	if (ret) {
		ape_tensor tdo = c->t[0];

		check(ret == APE_EINVAL || ret == APE_EOVERFLOW,
		      "validation at positions fails with EINVAL or EOVERFLOW");
		fret = ape_attention_forward(ref, &c->desc, &c->t[0], &c->t[1], &c->t[2], &c->t[3],
					     lse, NULL);
		check(fret == ret, "ape_attention_forward refuses positions validation refuses");
		check(!strncmp(ape_last_error(), "ape_attention_forward: ", 23),
		      "the public message names ape_attention_forward");
		tdo.data = (void *)(uintptr_t)0x7f4000000000ull;
		fret = ape_attention_backward(ref, &c->desc, &c->t[0], &c->t[1], &c->t[2], &c->t[3],
					      (float *)(uintptr_t)0x7ff000000000ull, &tdo, NULL,
					      NULL, NULL, NULL,
					      (float *)(uintptr_t)0x7ffc00000000ull, NULL);
		check(fret == APE_EINVAL || fret == APE_EOVERFLOW,
		      "ape_attention_backward refuses it with EINVAL or EOVERFLOW");
		check(!strncmp(ape_last_error(), "ape_attention_backward: ", 24),
		      "the public message names ape_attention_backward");
		return;
	}
	check((p.pos_q != NULL) == (p.pos_k != NULL), "positions both or neither");
	work = (uint64_t)p.B * (uint64_t)p.H * ((uint64_t)p.Lq + 1) * ((uint64_t)p.Lk + 1) *
	       (uint64_t)p.D;
	if (p.pos_q && p.B <= 4 && p.H <= 16 && work <= (1u << 15) &&
	    span_of(&c->t[0], p.qs) <= (1u << 16) && span_of(&c->t[1], p.ks) <= (1u << 16) &&
	    span_of(&c->t[2], p.vs) <= (1u << 16) && span_of(&c->t[3], p.os) <= (1u << 16))
		run_positions(c, &p, in, (how & 3) == 0 && base == 0);
	ape__problem_fini(&p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = { data, size };
	struct ape__problem p;
	struct call c;
	uint64_t pairs, work;
	float *lse;
	int ret, fret;

	memset(&c, 0, sizeof(c));
	take_call(&in, &c);
	if (c.positions) {
		if (c.t[0].shape[1] <= (1 << 16))
			check_positions(&c, &in);
		return 0;
	}
	/* The pure pair count takes the same descriptor and any sizes. */
	ret = ape_visible_pairs(&c.desc, c.t[0].shape[0], c.t[0].shape[1], c.t[0].shape[2],
				c.t[1].shape[2], &pairs);
	check(ret == 0 || ret == APE_EINVAL || ret == APE_EOVERFLOW, "ape_visible_pairs' codes");

	/* The per-head parameters are materialised (4 floats a head) before anything runs: a call
	 * claiming millions of heads legitimately allocates that much, which is not what this
	 * target is after. Every other field may be anything. */
	if (c.t[0].shape[1] > (1 << 16))
		return 0;

	/* Addresses no one maps (the top of the lower half), distinct per tensor unless the input
	 * asks for aliasing: validation must refuse or accept without touching them. */
	for (int i = 0; i < 4; i++)
		c.t[i].data = (void *)(uintptr_t)(0x7f0000000000ull + ((uint64_t)i << 36));
	if (take(&in, 1) & 1)
		c.t[3].data = (uint8_t *)c.t[(size_t)take(&in, 1) % 3].data + take(&in, 2);
	if (take(&in, 1) & 1)
		c.t[take(&in, 1) & 3].data = NULL;

	lse = c.want_lse ? (float *)(uintptr_t)0x7ff000000000ull : NULL;
	ret = ape__problem_init(&p, "fuzz", &c.desc, &c.t[0], &c.t[1], &c.t[2], &c.t[3], lse);
	if (ret) {
		check(ret == APE_EINVAL || ret == APE_EOVERFLOW,
		      "validation fails with EINVAL or EOVERFLOW");
		check(!strncmp(ape_last_error(), "fuzz: ", 6), "the message names the function");
		fret = ape_attention_forward(ref, &c.desc, &c.t[0], &c.t[1], &c.t[2], &c.t[3], lse,
					     NULL);
		check(fret == ret, "ape_attention_forward refuses what validation refuses");
		check(!strncmp(ape_last_error(), "ape_attention_forward: ", 23),
		      "the public message names ape_attention_forward");
		fret = ape_attention_forward_diag(&ref, 1, NULL, &c.desc, &c.t[0], &c.t[1], &c.t[2],
						  &c.t[3], lse, (float *)(uintptr_t)0x7ff400000000ull,
						  (float *)(uintptr_t)0x7ff600000000ull, NULL);
		check(fret == ret, "ape_attention_forward_diag refuses what validation refuses");
		check(!strncmp(ape_last_error(), "ape_attention_forward_diag: ", 28),
		      "the public message names ape_attention_forward_diag");
		/* the backward validates q, k, v, o and desc by the same rules, and dO, a gradient
		 * and dLSE (unmapped too) besides: refused as well, nothing touched */
		{
			ape_tensor tdo = c.t[0], tdq = c.t[0];

			tdo.data = (void *)(uintptr_t)0x7f4000000000ull;
			tdq.data = (void *)(uintptr_t)0x7f5000000000ull;
			fret = ape_attention_backward(ref, &c.desc, &c.t[0], &c.t[1], &c.t[2],
						      &c.t[3], (float *)(uintptr_t)0x7ff000000000ull,
						      &tdo, (float *)(uintptr_t)0x7ff800000000ull,
						      take(&in, 1) & 1 ? &tdq : NULL, NULL, NULL,
						      (float *)(uintptr_t)0x7ffc00000000ull, NULL);
			check(fret == APE_EINVAL || fret == APE_EOVERFLOW,
			      "ape_attention_backward refuses it with EINVAL or EOVERFLOW");
			check(!strncmp(ape_last_error(), "ape_attention_backward: ", 24),
			      "the public message names ape_attention_backward");
		}
		return 0;
	}
	check_rules(&p);
	/* Small enough to run in microseconds on the float64 reference. */
	work = (uint64_t)p.B * (uint64_t)p.H * ((uint64_t)p.Lq + 1) * ((uint64_t)p.Lk + 1) *
	       (uint64_t)p.D;
	if (check_diag_placement(&c, &p, lse, &in) &&
	    p.B <= 4 && p.H <= 16 && p.Lq <= 64 && p.Lk <= 64 && work <= (1u << 15) &&
	    span_of(&c.t[0], p.qs) <= (1u << 16) && span_of(&c.t[1], p.ks) <= (1u << 16) &&
	    span_of(&c.t[2], p.vs) <= (1u << 16) && span_of(&c.t[3], p.os) <= (1u << 16))
		run_accepted(&c, &p, &in);
	ape__problem_fini(&p);
	return 0;
}
