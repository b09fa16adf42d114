/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend on the caller's memory and streams (issue 12), with no GPU: the fake driver
 * of tests/fake_cuda built with the emulator (cuda/emu) runs the real kernels on the CPU and logs
 * what reaches cuLaunchKernel (fake_cuda.h).
 *
 *   strided launches   Q, K, V, O and LSE where struct ape_be_view puts them ([B, L, H, D] with
 *                      padded rows, one slice each of a packed QKV tensor, nonzero and odd
 *                      element offsets, odd strides) against the same launch on contiguous
 *                      buffers: bit-identical where the same kernels run (every prefill; every
 *                      decode whose K and V rows are 16-byte aligned), and within the spec's
 *                      tolerance of the reference backend always. The gaps between a view's
 *                      elements hold NaN in the inputs (a kernel reading one would spread it)
 *                      and a sentinel in the outputs (a kernel writing one would change it).
 *   (buf_wrap, queue_wrap, native, two GPUs and the public API: test_cuda_resident_wrap.c)
 *
 * Most launches go through the backend's ops directly (the core's public API over them is
 * tested in tests/test_resident.c on every backend); the reference runs the same launch,
 * contiguous, through its own ops.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/problem.h"

#ifdef APE_HAVE_CUDA
#include "../cuda/cu.h"
#include "core/error.h"
#include "core/half.h"
#include "api/validate.h"
#include "exec/launch.h"
#include "fake_cuda/fake_cuda.h"
#include "cuda_resident_case.h"

/* ------------------------------------------------------------------ host-side elements */

static double el_get(const void *base, int64_t i, ape_dtype dt)
{
	if (dt == APE_F16)
		return ape__f16_to_f32(((const uint16_t *)base)[i]);
	if (dt == APE_BF16)
		return ape__bf16_to_f32(((const uint16_t *)base)[i]);
	return ((const float *)base)[i];
}

static void el_set(void *base, int64_t i, ape_dtype dt, double x)
{
	if (dt == APE_F16)
		((uint16_t *)base)[i] = ape__f32_to_f16((float)x);
	else if (dt == APE_BF16)
		((uint16_t *)base)[i] = ape__f32_to_bf16((float)x);
	else
		((float *)base)[i] = (float)x;
}

/* the raw bits of element i (for bit-identity) */
static uint32_t el_bits(const void *base, int64_t i, size_t esz)
{
	uint32_t u = 0;

	memcpy(&u, (const unsigned char *)base + (size_t)i * esz, esz);
	return u;
}

/* ------------------------------------------------------------------ layouts */
static const char *const kind_names[] = { "contiguous+offset", "BLHD", "packed-QKV", "odd" };

/* A view of `heads` x `rows` rows of `d` elements (d = 1: LSE) for layout k; returns the
 * elements its buffer needs. `slot`: 0 q, 1 k, 2 v (packed: the slice), 3 o, 4 lse. */
static int64_t make_view(enum kind k, int slot, int64_t B, int64_t heads, int64_t rows, int64_t d,
			 int64_t H, int64_t Hkv, struct ape_be_view *v)
{
	switch (k) {
	case K_CONTIG_OFF:
		*v = (struct ape_be_view){ 16, heads * rows * d, rows * d, d };
		break;
	case K_BLHD: {
		const int64_t dp = d == 1 ? 1 : d + 8;

		*v = (struct ape_be_view){ 8, rows * heads * dp, dp, heads * dp };
		break;
	}
	case K_PACKED:
		if (slot <= 2) {
			const int64_t w = (H + 2 * Hkv) * d;
			const int64_t off = slot == 0 ? 0 : slot == 1 ? H * d : (H + Hkv) * d;

			*v = (struct ape_be_view){ off, rows * w, d, w };
		} else { /* O and LSE: [B, L, H, D] */
			*v = (struct ape_be_view){ 0, rows * heads * d, d, heads * d };
		}
		break;
	case K_ODD: {
		const int64_t sl = d == 1 ? 3 : d + 1, sh = rows * sl + 1;

		*v = (struct ape_be_view){ 3, heads * sh + 5, sh, sl };
		break;
	}
	}
	return v->off + (B - 1) * v->sb + (heads - 1) * v->sh + (rows - 1) * v->sl + d + 5;
}
/* What one run left in O and LSE, as logical contiguous [B,H,Lq,D] / [B,H,Lq] arrays. */
struct outputs {
	void *o; /* of the output type */
	float *lse;
	bool gaps_intact; /* strided runs: every byte outside the views unchanged */
};

static void outputs_free(struct outputs *o)
{
	free(o->o);
	free(o->lse);
	memset(o, 0, sizeof(*o));
}

#define SENTINEL 0xa5u

/*
 * Runs the case on dev: contiguous buffers at offset 0 (strided false), or the views of c->kind
 * in buffers whose gaps hold NaN (inputs) or SENTINEL bytes (outputs). 0, or -1 with the reason
 * logged.
 */
static int run_case(struct __test_metadata *_metadata, ape_device *dev, const struct inputs *in,
		    const struct scase *c, bool strided, struct outputs *out)
{
	const struct ape_backend_plugin *ops = dev->be->ops;
	const size_t ie = ape_dtype_size(c->dt), oe = ape_dtype_size(c->odt);
	const int64_t heads[5] = { c->H, c->Hkv, c->Hkv, c->H, c->H };
	const int64_t rows[5] = { c->Lq, c->Lk, c->Lk, c->Lq, c->Lq };
	const int64_t dd[5] = { c->D, c->D, c->D, c->D, 1 };
	const size_t es[5] = { ie, ie, ie, oe, 4 };
	const void *src[3] = { in->tp.q.t.data, in->tp.k.t.data, in->tp.v.t.data };
	struct ape_be_launch l = in->l;
	struct ape_be_view v[5];
	int64_t n[5]; /* elements of each tensor's buffer */
	unsigned char *host[5] = { NULL };
	struct ape_be_buf *buf[5] = { NULL };
	struct ape_be_queue *q = NULL;
	const bool packed = strided && c->kind == K_PACKED;
	int nt = c->lse ? 5 : 4, ret = -1;

	memset(out, 0, sizeof(*out));
	for (int t = 0; t < nt; t++) {
		if (strided) {
			n[t] = make_view(c->kind, t, c->B, heads[t], rows[t], dd[t], c->H, c->Hkv, &v[t]);
		} else {
			v[t] = (struct ape_be_view){ 0, heads[t] * rows[t] * dd[t], rows[t] * dd[t], dd[t] };
			n[t] = c->B * heads[t] * rows[t] * dd[t];
		}
		n[t] = n[t] < 16 ? 16 : n[t]; /* K and V of a launch without keys: some bytes */
		if (packed && t <= 2) /* one buffer: the largest extent of the three slices */
			n[0] = n[t] > n[0] ? n[t] : n[0];
	}
	for (int t = 0; t < nt; t++) {
		if (packed && (t == 1 || t == 2))
			continue;
		host[t] = malloc((size_t)n[t] * es[t]);
		if (!host[t])
			goto out;
		if (t <= 2) /* NaN in every gap */
			for (int64_t i = 0; i < n[t]; i++)
				el_set(host[t], i, c->dt, NAN);
		else
			memset(host[t], SENTINEL, (size_t)n[t] * es[t]);
	}
	for (int t = 0; t < 3; t++) { /* the inputs where their views say */
		unsigned char *h = host[packed ? 0 : t];

		for (int64_t b = 0; b < c->B; b++)
			for (int64_t hh = 0; hh < heads[t]; hh++)
				for (int64_t r = 0; r < rows[t]; r++)
					memcpy(h + (size_t)(v[t].off + b * v[t].sb + hh * v[t].sh +
							    r * v[t].sl) * ie,
					       (const unsigned char *)src[t] +
						       (size_t)(((b * heads[t] + hh) * rows[t] + r) * c->D) * ie,
					       (size_t)c->D * ie);
	}
	if (ops->queue_create(dev, &q)) {
		TH_LOG("queue_create: %s", ape_last_error());
		goto out;
	}
	for (int t = 0; t < nt; t++) {
		if (!host[t])
			continue;
		if (ops->buf_alloc(dev, (size_t)n[t] * es[t], &buf[t]) ||
		    ops->copy_h2d(q, buf[t], 0, host[t], (size_t)n[t] * es[t])) {
			TH_LOG("buffers: %s", ape_last_error());
			goto out;
		}
	}
	l.q = buf[0];
	l.k = buf[packed ? 0 : 1];
	l.v = buf[packed ? 0 : 2];
	l.o = buf[3];
	l.lse = c->lse ? buf[4] : NULL;
	l.strided = strided;
	for (int t = 0; t < 5; t++)
		l.view[t] = t < nt ? v[t] : (struct ape_be_view){ 0, 0, 0, 0 };
	if (ops->attention(q, &l) || ops->synchronize(q)) {
		TH_LOG("attention (%s): %s", strided ? "strided" : "contiguous", ape_last_error());
		goto out;
	}
	for (int t = 3; t < nt; t++)
		if (ops->copy_d2h(q, host[t], buf[t], 0, (size_t)n[t] * es[t]))
			goto out;
	if (ops->synchronize(q))
		goto out;

	/* gather the outputs, and check the gaps */
	out->o = malloc((size_t)(c->B * c->H * c->Lq * c->D) * oe);
	out->lse = malloc((size_t)(c->B * c->H * c->Lq) * 4 + 4);
	if (!out->o || !out->lse)
		goto out;
	out->gaps_intact = true;
	for (int t = 3; t < nt; t++) {
		unsigned char *seen = calloc((size_t)n[t], 1);

		if (!seen)
			goto out;
		for (int64_t b = 0; b < c->B; b++)
			for (int64_t hh = 0; hh < c->H; hh++)
				for (int64_t r = 0; r < c->Lq; r++) {
					const int64_t at = v[t].off + b * v[t].sb + hh * v[t].sh + r * v[t].sl;
					const int64_t lin = (b * c->H + hh) * c->Lq + r;

					memcpy(t == 3 ? (unsigned char *)out->o + (size_t)(lin * c->D) * oe
						      : (unsigned char *)out->lse + (size_t)lin * 4,
					       host[t] + (size_t)at * es[t], (size_t)dd[t] * es[t]);
					memset(seen + at, 1, (size_t)dd[t]);
				}
		for (int64_t i = 0; i < n[t]; i++)
			for (size_t k = 0; !seen[i] && k < es[t]; k++)
				out->gaps_intact &= host[t][(size_t)i * es[t] + k] == SENTINEL;
		free(seen);
	}
	ret = 0;
out:
	if (ret)
		outputs_free(out);
	for (int t = 0; t < 5; t++) {
		ops->buf_free(dev, buf[t]);
		free(host[t]);
	}
	ops->queue_destroy(q);
	return ret;
}

static void describe(const struct scase *c, char *buf, size_t cap)
{
	static const char *const dn[] = { "f32", "f16", "bf16" };

	snprintf(buf, cap, "%s B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld %s->%s %s %s%s%s",
		 kind_names[c->kind], (long long)c->B, (long long)c->H, (long long)c->Hkv,
		 (long long)c->Lq, (long long)c->Lk, (long long)c->D, dn[c->dt], dn[c->odt],
		 c->layout == APE_ROPE_INTERLEAVED ? "interleaved" : "half",
		 c->causal ? "causal" : "non-causal", c->lse ? " lse" : "", c->skip ? " skip" : "");
}

/* |x - ref| / den, +inf when only one of them is NaN (fmax() would drop a NaN) */
static double err(double x, double ref, double den)
{
	if (isnan(x) || isnan(ref))
		return isnan(x) && isnan(ref) ? 0.0 : INFINITY;
	if (isinf(x) || isinf(ref))
		return x == ref ? 0.0 : INFINITY;
	return fabs(x - ref) / den;
}

/* Do the strided and the contiguous launch run the same kernels (so bit-identical results)? Only
 * the decode at D = 64 and 128 changes variant, when K or V rows are not 16-byte aligned. */
static bool same_kernels(const struct scase *c)
{
	return c->Lq > APE_DC_MAX_LQ || (c->D != 64 && c->D != 128) || c->kind != K_ODD;
}

/*
 * One case: strided on CUDA, contiguous on CUDA and on the reference. Returns the number of
 * failed checks (each logged).
 */
static int check_case(struct __test_metadata *_metadata, const struct devs *d, ape_rng *rng,
		      const struct scase *c)
{
	const size_t oe = ape_dtype_size(c->odt);
	const int64_t no = c->B * c->H * c->Lq * c->D, nl = c->B * c->H * c->Lq;
	struct outputs s, k, r;
	struct inputs in;
	char what[200];
	int fails = 0;

	describe(c, what, sizeof(what));
	if (make_inputs(&in, rng, c)) {
		TH_LOG("%s: out of memory", what);
		return 1;
	}
	if (run_case(_metadata, d->cuda, &in, c, true, &s) ||
	    run_case(_metadata, d->cuda, &in, c, false, &k) ||
	    run_case(_metadata, d->ref, &in, c, false, &r)) {
		TH_LOG("%s: a run failed", what);
		inputs_free(&in);
		return 1;
	}
	if (!s.gaps_intact) {
		TH_LOG("%s: the strided launch wrote outside its O or LSE view", what);
		fails++;
	}
	if (same_kernels(c)) {
		int64_t diff = 0;

		for (int64_t i = 0; i < no; i++)
			diff += el_bits(s.o, i, oe) != el_bits(k.o, i, oe);
		for (int64_t i = 0; c->lse && i < nl; i++)
			diff += el_bits(s.lse, i, 4) != el_bits(k.lse, i, 4);
		if (diff) {
			TH_LOG("%s: %lld elements differ from the contiguous launch's", what,
			       (long long)diff);
			fails++;
		}
	}
	/* both against the reference, within the spec's tolerance */
	{
		double vmax = 1e-30, eo_s = 0, eo_k = 0, el_s = 0, el_k = 0;

		for (int64_t i = 0; i < c->B * c->Hkv * c->Lk * c->D; i++)
			vmax = fmax(vmax, fabs(el_get(in.tp.v.t.data, i, c->dt)));
		for (int64_t i = 0; i < no; i++) {
			const double ref = el_get(r.o, i, c->odt);

			eo_s = fmax(eo_s, err(el_get(s.o, i, c->odt), ref, 1.0));
			eo_k = fmax(eo_k, err(el_get(k.o, i, c->odt), ref, 1.0));
		}
		for (int64_t i = 0; c->lse && i < nl; i++) {
			const double ref = r.lse[i], den = fmax(1.0, fabs(ref));

			el_s = fmax(el_s, err(s.lse[i], ref, den));
			el_k = fmax(el_k, err(k.lse[i], ref, den));
		}
		eo_s /= vmax * test_tol_o(c->dt);
		eo_k /= vmax * test_tol_o(c->dt);
		el_s /= test_tol_lse(c->dt);
		el_k /= test_tol_lse(c->dt);
		if (!(eo_s <= 1) || !(el_s <= 1) || !(eo_k <= 1) || !(el_k <= 1)) {
			TH_LOG("%s: error x tolerance: strided O %.3g LSE %.3g, contiguous O %.3g "
			       "LSE %.3g",
			       what, eo_s, el_s, eo_k, el_k);
			fails++;
		}
	}
	outputs_free(&s);
	outputs_free(&k);
	outputs_free(&r);
	inputs_free(&in);
	return fails;
}

static int run_cases(struct __test_metadata *_metadata, const struct scase *cs, size_t n)
{
	struct devs d;
	ape_rng rng;
	int fails = 0;

	open_devs(_metadata, &d);
	ape_rng_init(&rng, "cuda_resident");
	for (size_t i = 0; i < n; i++)
		fails += check_case(_metadata, &d, &rng, &cs[i]);
	ape_context_destroy(d.ctx);
	return fails;
}

/* B, H, Hkv, Lq, Lk, D, in, out, rope layout, causal, lse, skip, layout of the tensors */
TEST(prefill_strided_matches_contiguous)
{
	static const struct scase cs[] = {
		{ 2, 4, 2, 37, 70, 64, F16, F16, HALF, true, true, false, K_BLHD },
		{ 1, 2, 1, 20, 33, 64, BF16, F32, INTER, false, true, false, K_BLHD },
		/* float32 K in the half layout, aligned: the kernel reads K in place */
		{ 2, 2, 2, 40, 40, 64, F32, F32, HALF, true, true, false, K_PACKED },
		{ 1, 4, 1, 24, 24, 128, F16, F16, INTER, true, true, false, K_PACKED },
		/* misaligned: K and V through ape_prep, O element by element */
		{ 2, 2, 1, 18, 40, 64, F32, F32, HALF, false, true, false, K_ODD },
		{ 1, 2, 2, 17, 30, 40, BF16, BF16, HALF, true, true, false, K_ODD },
		{ 1, 3, 1, 21, 45, 48, F16, F32, INTER, true, false, false, K_CONTIG_OFF },
		{ 1, 2, 1, 40, 260, 64, F16, F16, HALF, true, true, true, K_BLHD },
	};

	EXPECT_EQ(0, run_cases(_metadata, cs, sizeof(cs) / sizeof(cs[0])));
}

TEST(decode_strided_matches_contiguous)
{
	static const struct scase cs[] = {
		{ 2, 4, 2, 1, 90, 64, F16, F16, HALF, true, true, false, K_BLHD },
		{ 1, 2, 1, 3, 50, 128, F32, F32, INTER, false, true, false, K_BLHD },
		/* misaligned K and V: the generic-D decode kernel */
		{ 1, 2, 1, 1, 70, 64, F16, F16, HALF, true, true, false, K_ODD },
		{ 1, 2, 2, 2, 33, 128, BF16, F32, INTER, false, true, false, K_ODD },
		{ 2, 2, 1, 9, 9, 64, BF16, BF16, HALF, true, true, false, K_PACKED },
		{ 1, 2, 1, 5, 40, 48, F32, F32, INTER, true, true, false, K_CONTIG_OFF },
		/* skipping: the window kernel reads Q and K through the views too */
		{ 1, 2, 1, 1, 600, 64, F16, F16, HALF, true, true, true, K_BLHD },
		{ 1, 2, 2, 2, 500, 64, F32, F32, INTER, false, true, true, K_ODD },
	};

	EXPECT_EQ(0, run_cases(_metadata, cs, sizeof(cs) / sizeof(cs[0])));
}

/* No key at all: O = 0 and LSE = -inf through the views (no fill can reach them). */
TEST(strided_launch_without_keys)
{
	static const struct scase cs[] = {
		{ 1, 2, 1, 20, 0, 64, F16, F16, HALF, true, true, false, K_BLHD },
		{ 2, 2, 2, 1, 0, 40, F32, F32, HALF, false, true, false, K_ODD },
	};

	EXPECT_EQ(0, run_cases(_metadata, cs, sizeof(cs) / sizeof(cs[0])));
}

CUDA_RESIDENT_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the CUDA backend is not built into this libape")
#endif /* APE_HAVE_CUDA */
