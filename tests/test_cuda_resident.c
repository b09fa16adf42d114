/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend on the caller's memory and streams (issue 12), with no GPU: the fake driver
 * of tests/fake_cuda built with the emulator (cuda/emu) runs the real kernels on the CPU and logs
 * what reaches cuLaunchKernel (fake_cuda.h).
 *
 *   strided launches   Q, K, V, O and LSE where struct ape__view puts them ([B, L, H, D] with
 *                      padded rows, one slice each of a packed QKV tensor, nonzero and odd
 *                      element offsets, odd strides) against the same launch on contiguous
 *                      buffers: bit-identical where the same kernels run (every prefill; every
 *                      decode whose K and V rows are 16-byte aligned), and within the spec's
 *                      tolerance of the reference backend always. The gaps between a view's
 *                      elements hold NaN in the inputs (a kernel reading one would spread it)
 *                      and a sentinel in the outputs (a kernel writing one would change it).
 *   buf_wrap           a device pointer inside one allocation, refused outside one, never
 *                      freed by buf_free; host and OpenCL memory refused with APE_ENOTSUP.
 *   queue_wrap         every launch runs on the caller's stream (NULL: the legacy default
 *                      stream) in the device's primary context; queue_destroy neither
 *                      synchronises nor destroys it; events on it carry no timing.
 *   native             the primary context and the CUdevice.
 *   two GPUs           memory and streams of one device refused by the other.
 *   public API         ape_buffer_wrap_cuda(), ape_queue_wrap_cuda() and ape_attention_enqueue()
 *                      on a caller's arena and stream: the host call's result bit for bit, and
 *                      every launch on the caller's stream.
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

#define EMU_LIB APE_BUILD_DIR "/tests/cuda_emu/libcuda.so.1"

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

enum kind {
	K_CONTIG_OFF, /* [B, H, L, D] at an aligned nonzero offset */
	K_BLHD, /* [B, L, H, D], rows padded by 8 elements, O and LSE [B, L, H] likewise */
	K_PACKED, /* Q, K, V: slices of one [B, L, H + 2 Hkv, D] tensor (Lq == Lk) */
	K_ODD, /* odd offsets and odd row strides: nothing 16-byte (or pair-) aligned */
};

static const char *const kind_names[] = { "contiguous+offset", "BLHD", "packed-QKV", "odd" };

/* A view of `heads` x `rows` rows of `d` elements (d = 1: LSE) for layout k; returns the
 * elements its buffer needs. `slot`: 0 q, 1 k, 2 v (packed: the slice), 3 o, 4 lse. */
static int64_t make_view(enum kind k, int slot, int64_t B, int64_t heads, int64_t rows, int64_t d,
			 int64_t H, int64_t Hkv, struct ape__view *v)
{
	switch (k) {
	case K_CONTIG_OFF:
		*v = (struct ape__view){ 16, heads * rows * d, rows * d, d };
		break;
	case K_BLHD: {
		const int64_t dp = d == 1 ? 1 : d + 8;

		*v = (struct ape__view){ 8, rows * heads * dp, dp, heads * dp };
		break;
	}
	case K_PACKED:
		if (slot <= 2) {
			const int64_t w = (H + 2 * Hkv) * d;
			const int64_t off = slot == 0 ? 0 : slot == 1 ? H * d : (H + Hkv) * d;

			*v = (struct ape__view){ off, rows * w, d, w };
		} else { /* O and LSE: [B, L, H, D] */
			*v = (struct ape__view){ 0, rows * heads * d, d, heads * d };
		}
		break;
	case K_ODD: {
		const int64_t sl = d == 1 ? 3 : d + 1, sh = rows * sl + 1;

		*v = (struct ape__view){ 3, heads * sh + 5, sh, sl };
		break;
	}
	}
	return v->off + (B - 1) * v->sb + (heads - 1) * v->sh + (rows - 1) * v->sl + d + 5;
}

/* ------------------------------------------------------------------ cases */

struct scase {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dt, odt;
	ape_rope_layout layout;
	bool causal, lse, skip;
	enum kind kind;
};

struct devs {
	ape_context *ctx;
	ape_device *cuda, *ref;
};

static void open_devs(struct __test_metadata *_metadata, struct devs *d)
{
	d->ctx = test_context("cuda,ref");
	ASSERT_NE(NULL, d->ctx);
	d->cuda = test_device(d->ctx, "cuda");
	d->ref = test_device(d->ctx, "ref");
	ASSERT_NE(NULL, d->cuda) TH_LOG("no emulated CUDA device (%s)", EMU_LIB);
	ASSERT_NE(NULL, d->ref);
}

/* The logical inputs of a case, contiguous, and its launch, built by the core's own builders
 * (validation, then ape__launch_init()). */
struct inputs {
	test_problem tp;
	struct ape__problem p;
	struct ape__launch l; /* no buffers yet, not strided */
};

static void inputs_free(struct inputs *in)
{
	ape__problem_fini(&in->p);
	test_problem_free(&in->tp);
}

static int make_inputs(struct inputs *in, ape_rng *rng, const struct scase *c)
{
	const test_problem_shape sh = { c->B, c->H, c->Hkv, c->Lq, c->Lk, c->D };

	memset(in, 0, sizeof(*in));
	if (test_problem_make(&in->tp, rng, &sh, c->dt, false))
		return -1;
	if (c->skip) /* a real decay: far keys are provably negligible */
		test_problem_set_params(&in->tp, pow(2.0, -4.0 / 3.0), 0.04, 0.04, 0.1);
	else
		test_problem_random_params(&in->tp, rng);
	in->tp.desc.causal = c->causal;
	in->tp.desc.layout = c->layout;
	if (test_problem_set_out_dtype(&in->tp, c->odt) ||
	    ape__problem_init(&in->p, "test", &in->tp.desc, &in->tp.q.t, &in->tp.k.t, &in->tp.v.t,
			      &in->tp.o.t, in->tp.lse)) {
		test_problem_free(&in->tp);
		return -1;
	}
	ape__launch_init(&in->l, &in->p, c->odt, c->skip ? in->p.skip_tol : 0.0);
	in->l.Lq = c->Lq;
	in->l.Lk = c->Lk;
	in->l.q_start = in->p.q_start;
	in->l.k_start = in->p.k_start;
	return 0;
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
	const struct ape__backend_ops *ops = dev->be->ops;
	const size_t ie = ape_dtype_size(c->dt), oe = ape_dtype_size(c->odt);
	const int64_t heads[5] = { c->H, c->Hkv, c->Hkv, c->H, c->H };
	const int64_t rows[5] = { c->Lq, c->Lk, c->Lk, c->Lq, c->Lq };
	const int64_t dd[5] = { c->D, c->D, c->D, c->D, 1 };
	const size_t es[5] = { ie, ie, ie, oe, 4 };
	const void *src[3] = { in->tp.q.t.data, in->tp.k.t.data, in->tp.v.t.data };
	struct ape__launch l = in->l;
	struct ape__view v[5];
	int64_t n[5]; /* elements of each tensor's buffer */
	unsigned char *host[5] = { NULL };
	struct ape__buf *buf[5] = { NULL };
	struct ape__queue *q = NULL;
	const bool packed = strided && c->kind == K_PACKED;
	int nt = c->lse ? 5 : 4, ret = -1;

	memset(out, 0, sizeof(*out));
	for (int t = 0; t < nt; t++) {
		if (strided) {
			n[t] = make_view(c->kind, t, c->B, heads[t], rows[t], dd[t], c->H, c->Hkv, &v[t]);
		} else {
			v[t] = (struct ape__view){ 0, heads[t] * rows[t] * dd[t], rows[t] * dd[t], dd[t] };
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
		l.view[t] = t < nt ? v[t] : (struct ape__view){ 0, 0, 0, 0 };
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

#define F32 APE_F32
#define F16 APE_F16
#define BF16 APE_BF16
#define HALF APE_ROPE_HALF
#define INTER APE_ROPE_INTERLEAVED

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

/* ------------------------------------------------------------------ wrapping */

struct fake_fns {
	fake_cuda_log_fn log;
	fake_cuda_log_clear_fn clear;
	fake_cuda_stream_calls_fn stream_calls;
	CUresult (*stream_create)(CUstream *s, unsigned flags);
	CUresult (*stream_destroy)(CUstream s);
	CUresult (*push)(CUcontext c);
	CUresult (*pop)(CUcontext *c);
	CUresult (*mem_alloc)(CUdeviceptr *p, size_t n);
	CUresult (*mem_free)(CUdeviceptr p);
};

/* The fake driver libape loaded, and its entry points. */
static void fake_fns(struct __test_metadata *_metadata, struct fake_fns *f)
{
	void *lib = dlopen(EMU_LIB, RTLD_NOW | RTLD_NOLOAD);
	CUresult (*gpa)(const char *, void **, int, cuuint64_t);

	ASSERT_NE(NULL, lib) TH_LOG("%s is not loaded", EMU_LIB);
	f->log = (fake_cuda_log_fn)dlsym(lib, "fake_cuda_log");
	f->clear = (fake_cuda_log_clear_fn)dlsym(lib, "fake_cuda_log_clear");
	f->stream_calls = (fake_cuda_stream_calls_fn)dlsym(lib, "fake_cuda_stream_calls");
	*(void **)&gpa = dlsym(lib, "cuGetProcAddress");
	ASSERT_NE(NULL, f->log);
	ASSERT_NE(NULL, f->clear);
	ASSERT_NE(NULL, f->stream_calls);
	ASSERT_NE(NULL, gpa);
	ASSERT_EQ(CUDA_SUCCESS, gpa("cuStreamCreate", (void **)&f->stream_create, 2000, 0));
	ASSERT_EQ(CUDA_SUCCESS, gpa("cuStreamDestroy", (void **)&f->stream_destroy, 4000, 0));
	ASSERT_EQ(CUDA_SUCCESS, gpa("cuCtxPushCurrent", (void **)&f->push, 4000, 0));
	ASSERT_EQ(CUDA_SUCCESS, gpa("cuCtxPopCurrent", (void **)&f->pop, 4000, 0));
	ASSERT_EQ(CUDA_SUCCESS, gpa("cuMemAlloc", (void **)&f->mem_alloc, 3020, 0));
	ASSERT_EQ(CUDA_SUCCESS, gpa("cuMemFree", (void **)&f->mem_free, 3020, 0));
	dlclose(lib); /* libape still holds it */
}

TEST(native_gives_the_primary_context_and_device)
{
	struct devs d;
	void *ctx = NULL, *dev = (void *)1;

	open_devs(_metadata, &d);
	ASSERT_NE(NULL, d.cuda->be->ops->native);
	d.cuda->be->ops->native(d.cuda, &ctx, &dev);
	EXPECT_NE(NULL, ctx);
	EXPECT_EQ(ctx, (void *)ape__cu_dev(d.cuda)->ctx);
	EXPECT_EQ(0, (int)(intptr_t)dev);
	ape_context_destroy(d.ctx);
}

TEST(buf_wrap_checks_the_range_and_never_frees)
{
	const struct ape__backend_ops *ops;
	struct ape__buf *own = NULL, *w = NULL;
	struct ape__queue *q = NULL;
	unsigned char data[512], back[512];
	size_t got = 0;
	struct devs d;
	int ret;

	open_devs(_metadata, &d);
	ops = d.cuda->be->ops;
	ASSERT_EQ(0, ops->buf_alloc(d.cuda, 4096, &own));
	ASSERT_EQ(0, ops->queue_create(d.cuda, &q));

	/* inside: a window of the allocation, usable by every op */
	ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE__MEM_CUDA, (void *)(uintptr_t)(own->ptr + 1024), 512,
				   &w, &got)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(512u, got);
	EXPECT_EQ(own->ptr + 1024, w->ptr);
	for (int i = 0; i < 512; i++)
		data[i] = (unsigned char)(i * 7 + 1);
	EXPECT_EQ(0, ops->copy_h2d(q, w, 0, data, sizeof(data)));
	EXPECT_EQ(0, ops->copy_d2h(q, back, own, 1024, sizeof(back)));
	EXPECT_EQ(0, ops->synchronize(q));
	EXPECT_EQ(0, memcmp(data, back, sizeof(data)));
	ops->buf_free(d.cuda, w);

	/* the whole allocation wrapped and dropped: the allocation stays */
	ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE__MEM_CUDA, (void *)(uintptr_t)own->ptr, 4096, &w,
				   &got));
	ops->buf_free(d.cuda, w);
	memset(back, 0, sizeof(back));
	EXPECT_EQ(0, ops->copy_d2h(q, back, own, 1024, sizeof(back))) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ops->synchronize(q));
	EXPECT_EQ(0, memcmp(data, back, sizeof(data)));

	/* past the end: refused, with the addresses */
	w = (struct ape__buf *)1;
	ret = ops->buf_wrap(d.cuda, APE__MEM_CUDA, (void *)(uintptr_t)(own->ptr + 4000), 97, &w, &got);
	EXPECT_EQ(APE_EINVAL, ret);
	EXPECT_EQ(NULL, w);
	EXPECT_EQ(0u, got);
	TH_LOG("past the end: %s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "runs past its allocation"));
	EXPECT_NE(NULL, strstr(ape_last_error(), "buf_wrap"));
	/* not device memory at all */
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(d.cuda, APE__MEM_CUDA, (void *)data, 16, &w, &got));
	TH_LOG("host pointer: %s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "not device memory"));
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(d.cuda, APE__MEM_CUDA, NULL, 16, &w, &got));
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(d.cuda, APE__MEM_CUDA, (void *)(uintptr_t)own->ptr, 0,
					    &w, &got));
	/* kinds a CUDA device does not drive */
	EXPECT_EQ(APE_ENOTSUP, ops->buf_wrap(d.cuda, APE__MEM_HOST, data, 16, &w, &got));
	TH_LOG("host kind: %s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "host memory"));
	EXPECT_NE(NULL, strstr(ape_last_error(), d.cuda->info.name));
	EXPECT_EQ(APE_ENOTSUP, ops->buf_wrap(d.cuda, APE__MEM_OPENCL, data, 16, &w, &got));
	EXPECT_NE(NULL, strstr(ape_last_error(), "OpenCL memory"));
	EXPECT_EQ(NULL, w);

	ops->queue_destroy(q);
	ops->buf_free(d.cuda, own);
	ape_context_destroy(d.ctx);
}

/* Without cuMemGetAddressRange nothing can be checked, so nothing is wrapped. */
TEST(buf_wrap_without_the_driver_symbol)
{
	struct ape__buf *own = NULL, *w = NULL;
	size_t got;
	struct devs d;

	setenv("FAKE_CUDA_MODE", "missing-optional", 1);
	open_devs(_metadata, &d);
	ASSERT_EQ(0, d.cuda->be->ops->buf_alloc(d.cuda, 256, &own));
	EXPECT_EQ(APE_ENOTSUP, d.cuda->be->ops->buf_wrap(d.cuda, APE__MEM_CUDA,
							 (void *)(uintptr_t)own->ptr, 256, &w,
							 &got));
	EXPECT_NE(NULL, strstr(ape_last_error(), "cuMemGetAddressRange"));
	d.cuda->be->ops->buf_free(d.cuda, own);
	ape_context_destroy(d.ctx);
}

/*
 * A strided launch on a wrapped stream and wrapped buffers: every launch the fake receives runs
 * on that stream, in device 0's context, with the wrapped pointers and the view offsets in its
 * arguments; queue_destroy then neither synchronises nor destroys the stream.
 */
static void wrapped_launch(struct __test_metadata *_metadata, bool null_stream, bool mempools)
{
	const struct scase c = { 1, 2, 1, 24, 40, 64, F16, F16, HALF, true, true, false, K_BLHD };
	const struct ape__backend_ops *ops;
	struct ape__buf *own[4] = { NULL }, *w[4] = { NULL };
	const struct fake_launch_rec *log;
	struct ape__queue *wq = NULL;
	struct ape__event *e0 = NULL, *e1 = NULL;
	struct ape__launch l;
	struct inputs in;
	struct fake_fns f;
	CUstream s = NULL;
	CUcontext prev;
	size_t n = 0, got;
	int destroyed, synced, attention = 0;
	double ms = -1;
	struct devs d;
	ape_rng rng;
	void *ctx = NULL, *devh;

	if (!mempools)
		setenv("FAKE_CUDA_MODE", "no-mempool", 1);
	open_devs(_metadata, &d);
	fake_fns(_metadata, &f);
	ops = d.cuda->be->ops;
	ops->native(d.cuda, &ctx, &devh);
	ASSERT_NE(NULL, ctx);
	if (!null_stream) { /* the caller's stream, in the primary context */
		ASSERT_EQ(CUDA_SUCCESS, f.push((CUcontext)ctx));
		ASSERT_EQ(CUDA_SUCCESS, f.stream_create(&s, CU_STREAM_NON_BLOCKING));
		f.pop(&prev);
	}
	ASSERT_EQ(0, ops->queue_wrap(d.cuda, s, &wq)) TH_LOG("%s", ape_last_error());

	ape_rng_init(&rng, "cuda_resident_wrap");
	ASSERT_EQ(0, make_inputs(&in, &rng, &c));
	l = in.l;
	/* q, k, v, o each in its own allocation, wrapped at 256 bytes in, as [B, L, H, D]
	 * tensors at element offset 8 (contents do not matter here: the fake checks the range) */
	for (int t = 0; t < 4; t++) {
		const bool kv = t == 1 || t == 2;
		const size_t bytes = 2 * (size_t)(8 + (kv ? c.Lk * c.Hkv : c.Lq * c.H) * c.D);

		ASSERT_EQ(0, ops->buf_alloc(d.cuda, bytes + 512, &own[t]));
		ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE__MEM_CUDA,
					   (void *)(uintptr_t)(own[t]->ptr + 256), bytes, &w[t], &got));
		ASSERT_EQ(0, ops->fill(wq, w[t], 0, 0u, bytes & ~(size_t)3));
		l.view[t] = (struct ape__view){ 8, 0, c.D, (kv ? c.Hkv : c.H) * c.D };
	}
	l.q = w[0];
	l.k = w[1];
	l.v = w[2];
	l.o = w[3];
	l.lse = NULL;
	l.strided = true;
	f.clear();
	ASSERT_EQ(0, ops->event_record(wq, &e0));
	ASSERT_EQ(0, ops->attention(wq, &l)) TH_LOG("%s", ape_last_error());
	/* the scratch: freed in stream order (cuMemFreeAsync), or after waiting for the stream */
	f.stream_calls(s, &destroyed, &synced);
	EXPECT_EQ(0, destroyed);
	if (mempools) {
		EXPECT_EQ(0, synced);
	} else {
		EXPECT_LE(1, synced);
	}
	ASSERT_EQ(0, ops->event_record(wq, &e1));
	EXPECT_EQ(0, ops->synchronize(wq));
	/* events of a wrapped stream only order work */
	EXPECT_EQ(APE_ENOTSUP, ops->event_elapsed(e0, e1, &ms));
	EXPECT_EQ(0.0, ms);
	EXPECT_EQ(0, ops->event_wait(wq, e1));

	log = f.log(&n);
	EXPECT_LT(0u, n);
	for (size_t i = 0; i < n; i++) {
		EXPECT_EQ(s, log[i].stream) TH_LOG("%s ran on stream %p", log[i].name,
						   (void *)log[i].stream);
		EXPECT_EQ(0, log[i].ctx_ordinal);
		if (!strncmp(log[i].name, "ape_prefill_", 12)) {
			struct ape_cu_prefill_args a;

			memcpy(&a, log[i].args, sizeof(a));
			attention++;
			EXPECT_EQ(own[0]->ptr + 256, a.c.q);
			EXPECT_EQ(own[1]->ptr + 256, a.c.k);
			EXPECT_EQ(own[2]->ptr + 256, a.c.v);
			EXPECT_EQ(own[3]->ptr + 256, a.c.o);
			EXPECT_EQ(8, a.c.vq.off);
			EXPECT_EQ(c.H * c.D, a.c.vq.sl);
			EXPECT_EQ(c.Hkv * c.D, a.c.vk.sl);
			EXPECT_EQ(c.D, a.c.vo.sh);
			/* 16-byte-aligned float16 rows: V is read in place, K converted */
			EXPECT_EQ(own[2]->ptr + 256, a.vp);
			EXPECT_EQ(a.c.vv.off, a.vvp.off);
		}
	}
	EXPECT_EQ(1, attention);

	ops->event_destroy(e0);
	ops->event_destroy(e1);
	f.clear();
	ops->queue_destroy(wq);
	EXPECT_EQ(0, f.stream_calls(s, &destroyed, &synced) ? destroyed + synced : 0);
	for (int t = 0; t < 4; t++) {
		ops->buf_free(d.cuda, w[t]);
		ops->buf_free(d.cuda, own[t]);
	}
	if (!null_stream) { /* still the caller's, alive */
		ASSERT_EQ(CUDA_SUCCESS, f.push((CUcontext)ctx));
		EXPECT_EQ(CUDA_SUCCESS, f.stream_destroy(s));
		f.pop(&prev);
	}
	inputs_free(&in);
	ape_context_destroy(d.ctx);
}

TEST(queue_wrap_runs_on_the_callers_stream)
{
	wrapped_launch(_metadata, false, true);
}

TEST(queue_wrap_null_is_the_legacy_default_stream)
{
	wrapped_launch(_metadata, true, true);
}

/* Without memory pools, the scratch of a launch on a wrapped stream is freed after the stream
 * was synchronised: the launch is correct, the call not asynchronous. */
TEST(queue_wrap_without_memory_pools)
{
	wrapped_launch(_metadata, false, false);
}

TEST(queue_wrap_refuses_a_bad_stream)
{
	struct ape__queue *q = (struct ape__queue *)1;
	struct devs d;

	open_devs(_metadata, &d);
	EXPECT_EQ(APE_EINVAL, d.cuda->be->ops->queue_wrap(d.cuda, (void *)(uintptr_t)0x1234, &q));
	EXPECT_EQ(NULL, q);
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "queue_wrap"));
	ape_context_destroy(d.ctx);
}

/* A wrapped pointer that is not aligned to its elements: APE_EINVAL naming the tensor, before
 * any kernel runs. */
TEST(misaligned_elements_are_refused)
{
	const struct scase c = { 1, 2, 1, 20, 30, 64, F32, F32, HALF, true, false, false, K_BLHD };
	const struct ape__backend_ops *ops;
	struct ape__buf *own = NULL, *w = NULL;
	struct ape__queue *q = NULL;
	struct fake_fns f;
	struct inputs in;
	size_t got, nlog = 1;
	struct devs d;
	ape_rng rng;

	open_devs(_metadata, &d);
	fake_fns(_metadata, &f);
	ops = d.cuda->be->ops;
	ape_rng_init(&rng, "cuda_resident_align");
	ASSERT_EQ(0, make_inputs(&in, &rng, &c));
	ASSERT_EQ(0, ops->queue_create(d.cuda, &q));
	ASSERT_EQ(0, ops->buf_alloc(d.cuda, 65536, &own));
	ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE__MEM_CUDA, (void *)(uintptr_t)(own->ptr + 2), 60000,
				   &w, &got));
	in.l.q = in.l.k = in.l.v = own;
	in.l.o = w; /* float32 O two bytes off */
	for (int t = 0; t < 4; t++)
		in.l.view[t] = ape__launch_view(&in.l, t); /* the contiguous views */
	in.l.strided = true;
	in.l.view[APE__T_O].off = 64;
	f.clear();
	EXPECT_EQ(APE_EINVAL, ops->attention(q, &in.l));
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "o at 0x"));
	EXPECT_NE(NULL, strstr(ape_last_error(), "not aligned to its 4-byte elements"));
	f.log(&nlog);
	EXPECT_EQ(0u, nlog);
	ops->buf_free(d.cuda, w);
	ops->buf_free(d.cuda, own);
	ops->queue_destroy(q);
	inputs_free(&in);
	ape_context_destroy(d.ctx);
}

/* Two GPUs: memory and streams of one are refused by the other. */
TEST(wraps_of_another_device_are_refused)
{
	ape_device *devs[8], *g[2] = { NULL, NULL };
	const struct ape__backend_ops *ops;
	struct ape__buf *own = NULL, *w = (struct ape__buf *)1;
	struct ape__queue *q = (struct ape__queue *)1;
	struct fake_fns f;
	CUstream s = NULL;
	CUcontext prev;
	void *ctx1 = NULL, *dev1 = NULL;
	ape_context *ctx;
	size_t got;
	int n, k = 0;

	setenv("FAKE_CUDA_MODE", "two-devices", 1);
	ctx = test_context("cuda");
	ASSERT_NE(NULL, ctx);
	n = ape_device_list(ctx, devs, 8);
	for (int i = 0; i < n && k < 2; i++)
		if (!strcmp(devs[i]->info.backend, "cuda"))
			g[k++] = devs[i];
	ASSERT_EQ(2, k);
	fake_fns(_metadata, &f);
	ops = g[0]->be->ops;
	ops->native(g[1], &ctx1, &dev1);
	ASSERT_NE(NULL, ctx1);
	EXPECT_EQ(1, (int)(intptr_t)dev1);

	ASSERT_EQ(0, ops->buf_alloc(g[1], 1024, &own));
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(g[0], APE__MEM_CUDA, (void *)(uintptr_t)own->ptr, 1024,
					    &w, &got));
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "memory of CUDA device 1, not of device 0"));
	EXPECT_EQ(NULL, w);
	EXPECT_EQ(0, ops->buf_wrap(g[1], APE__MEM_CUDA, (void *)(uintptr_t)own->ptr, 1024, &w, &got));
	ops->buf_free(g[1], w);

	ASSERT_EQ(CUDA_SUCCESS, f.push((CUcontext)ctx1));
	ASSERT_EQ(CUDA_SUCCESS, f.stream_create(&s, 0));
	f.pop(&prev);
	EXPECT_EQ(APE_EINVAL, ops->queue_wrap(g[0], s, &q));
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "not to the device's primary context"));
	EXPECT_EQ(NULL, q);
	EXPECT_EQ(0, ops->queue_wrap(g[1], s, &q));
	ops->queue_destroy(q);
	ASSERT_EQ(CUDA_SUCCESS, f.push((CUcontext)ctx1));
	EXPECT_EQ(CUDA_SUCCESS, f.stream_destroy(s));
	f.pop(&prev);
	ops->buf_free(g[1], own);
	ape_context_destroy(ctx);
}

/* ------------------------------------------------------------------ through the public API */

/* Elements a host tensor's view spans, from its data pointer. */
static size_t span_elems(const ape_tensor *t)
{
	int64_t st[4];
	size_t last = 0;

	ape_tensor_strides(t, st);
	for (int d = 0; d < 4; d++)
		last += (size_t)((t->shape[d] - 1) * st[d]);
	return last + 1;
}

/*
 * What a framework does: its own allocation (cuMemAlloc in the primary context) holding Q, K,
 * V, O and LSE at offsets as padded [B, L, H, D] tensors, its own stream; libape wraps both
 * (ape_buffer_wrap_cuda, ape_queue_wrap_cuda) and enqueues there. The result equals the host
 * call's on the same device bit for bit; every launch ran on the caller's stream; destroying
 * libape's queue left the stream alone.
 */
TEST(public_api_on_the_callers_memory_and_stream)
{
	static const struct {
		int64_t B, H, Hkv, Lq, Lk, D;
		ape_dtype dt;
	} cs[] = { { 2, 4, 2, 33, 57, 64, APE_F16 }, { 1, 2, 1, 1, 70, 128, APE_BF16 },
		   { 1, 3, 3, 5, 20, 40, APE_F32 } };
	struct fake_fns f;
	struct devs d;
	void *ctx = NULL, *devh = NULL;
	CUcontext prev;
	ape_rng rng;

	open_devs(_metadata, &d);
	fake_fns(_metadata, &f);
	ASSERT_EQ(0, ape_device_native(d.cuda, &ctx, &devh));
	ASSERT_NE(NULL, ctx);
	EXPECT_EQ(0, (int)(intptr_t)devh);
	ape_rng_init(&rng, "cuda_resident_api");
	for (size_t c = 0; c < sizeof(cs) / sizeof(cs[0]); c++) {
		const test_problem_shape sh = { cs[c].B, cs[c].H, cs[c].Hkv, cs[c].Lq, cs[c].Lk, cs[c].D };
		const size_t esz = ape_dtype_size(cs[c].dt);
		test_problem a, b;
		const ape_tensor *ht[4];
		ape_buffer *buf[5] = { NULL };
		ape_dtensor dt[5];
		size_t at[5], n[5], total = 0, nl;
		CUdeviceptr mem = 0;
		CUstream s = NULL;
		ape_queue *wq = NULL;
		const struct fake_launch_rec *log;
		size_t nlog = 0;
		int destroyed = 0, synced = 0, on_s = 0;
		int64_t bad = 0;

		ASSERT_EQ(0, test_problem_make(&a, &rng, &sh, cs[c].dt, true));
		test_problem_random_params(&a, &rng);
		if (!a.lse) { /* always ask for LSE here */
			a.lse = calloc(a.rows, sizeof(float));
			ASSERT_NE(NULL, a.lse);
		}
		ASSERT_EQ(0, test_problem_clone(&b, &a));
		ASSERT_EQ(0, test_problem_run(&a, d.cuda)) TH_LOG("%s", ape_last_error());

		/* the framework's arena: each tensor 64 bytes past a 256-byte boundary */
		ht[0] = &b.q.t;
		ht[1] = &b.k.t;
		ht[2] = &b.v.t;
		ht[3] = &b.o.t;
		nl = b.rows;
		for (int t = 0; t < 5; t++) {
			n[t] = t < 4 ? span_elems(ht[t]) * (t == 3 ? ape_dtype_size(b.o.t.dtype) : esz)
				     : nl * sizeof(float);
			at[t] = total + 64;
			total = (at[t] + n[t] + 255) & ~(size_t)255;
		}
		ASSERT_EQ(CUDA_SUCCESS, f.push((CUcontext)ctx));
		ASSERT_EQ(CUDA_SUCCESS, f.mem_alloc(&mem, total));
		ASSERT_EQ(CUDA_SUCCESS, f.stream_create(&s, CU_STREAM_NON_BLOCKING));
		f.pop(&prev);

		ASSERT_EQ(0, ape_queue_wrap_cuda(d.cuda, s, &wq)) TH_LOG("%s", ape_last_error());
		for (int t = 0; t < 5; t++) {
			/* Q whole at its pointer; the others wrapped 16 bytes early, at byte offset 16 */
			const size_t early = t ? 16 : 0;

			ASSERT_EQ(0, ape_buffer_wrap_cuda(d.cuda, mem + at[t] - early, n[t] + early,
							  &buf[t]))
				TH_LOG("%s", ape_last_error());
			if (t < 4) {
				const ape_tensor *h = ht[t];

				ape_dtensor_init(&dt[t], buf[t], early, h->dtype, h->shape[0], h->shape[1],
						 h->shape[2], h->shape[3]);
				ape_tensor_strides(h, dt[t].strides);
				ASSERT_EQ(0, ape_buffer_write(wq, buf[t], early, h->data, n[t]));
			} else {
				ape_dtensor_init(&dt[t], buf[t], early, APE_F32, sh.B, sh.H, sh.Lq, 1);
			}
		}
		f.clear();
		ASSERT_EQ(0, ape_attention_enqueue(wq, &b.desc, &dt[0], &dt[1], &dt[2], &dt[3], &dt[4]))
			TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_buffer_read(wq, b.o.t.data, buf[3], 16, n[3]));
		ASSERT_EQ(0, ape_buffer_read(wq, b.lse, buf[4], 16, n[4]));
		ASSERT_EQ(0, ape_queue_synchronize(wq)) TH_LOG("%s", ape_last_error());

		log = f.log(&nlog);
		for (size_t i = 0; i < nlog; i++)
			on_s += log[i].stream == s && log[i].ctx_ordinal == 0;
		EXPECT_LT(0u, nlog);
		EXPECT_EQ((int)nlog, on_s);
		f.clear();
		ape_queue_destroy(wq);
		f.stream_calls(s, &destroyed, &synced);
		EXPECT_EQ(0, destroyed + synced);
		for (int t = 0; t < 5; t++)
			ape_buffer_free(buf[t]);

		for (int64_t i0 = 0; i0 < sh.B; i0++)
			for (int64_t i1 = 0; i1 < sh.H; i1++)
				for (int64_t i2 = 0; i2 < sh.Lq; i2++)
					for (int64_t i3 = 0; i3 < sh.D; i3++) {
						const double x = test_tensor_get(&a.o.t, i0, i1, i2, i3);
						const double y = test_tensor_get(&b.o.t, i0, i1, i2, i3);

						bad += !(x == y || (isnan(x) && isnan(y)));
					}
		for (size_t i = 0; i < nl; i++)
			bad += memcmp(&a.lse[i], &b.lse[i], sizeof(float)) != 0;
		EXPECT_EQ(0, bad) TH_LOG("case %zu: %lld elements differ from the host call's", c,
					 (long long)bad);

		/* the caller's stream and memory are still the caller's */
		ASSERT_EQ(CUDA_SUCCESS, f.push((CUcontext)ctx));
		EXPECT_EQ(CUDA_SUCCESS, f.stream_destroy(s));
		EXPECT_EQ(CUDA_SUCCESS, f.mem_free(mem));
		f.pop(&prev);
		test_problem_free(&a);
		test_problem_free(&b);
	}
	ape_context_destroy(d.ctx);
}

#endif /* APE_HAVE_CUDA */

int main(int argc, char **argv)
{
#ifndef APE_HAVE_CUDA
	ksft_exit_skip("the CUDA backend is not built into this libape\n");
#else
	unsetenv("FAKE_CUDA_MODE");
	if (ape_test_slow())
		ksft_exit_skip("the emulator under valgrind would take tens of minutes; "
			       "make sanitize runs it under ASan and UBSan\n");
	/* every test (a forked child) drives the emulated driver */
	setenv("APE_CUDA_LIBRARY", EMU_LIB, 1);
#endif
	return test_harness_run(argc, argv);
}
