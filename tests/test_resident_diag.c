/* SPDX-License-Identifier: MIT */
/*
 * The diagnostics on device tensors (ape_attention_enqueue_diag()) on every backend: against
 * ape_attention_forward_diag() on the same device, bit for bit, every output optional, every
 * refusal, ordered after its producer on the queue, rows split under the budget, a loose skip
 * tolerance tightened. (ape_attention_enqueue() itself: tests/test_resident.c.)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"
#include "common/resident.h"
#include "api/forward.h"
#include "api/resident.h"
#include "api/validate.h"
#include "exec/resident.h"

BACKEND_FIXTURE(resident);

/* ---- the diagnostics on device tensors (ape_attention_enqueue_diag()) */

/* Whether dev computes the diagnostics on device tensors (struct ape_be_caps). */
static bool diag_on_device(const ape_device *dev)
{
	return ape_be_caps_have(&dev->caps, APE_BE_CAP_DIAG) && ape_be_caps_have(&dev->caps, APE_BE_CAP_DIAG_VIEWS);
}

/* Floats that differ in bits (NaN equal to NaN). */
static int64_t floats_differing(const float *a, const float *b, size_t n)
{
	int64_t bad = 0;

	for (size_t i = 0; i < n; i++)
		bad += !(a[i] == b[i] || (isnan(a[i]) && isnan(b[i])));
	return bad;
}

/* The largest error of ENT and MD against tp's naive evaluation, in units of their tolerance
 * scales (docs/diagnostics.md): ENT relative to max(1, |LSE|), MD to max(1, the row's largest
 * |n|). */
static double diag_err_naive(const test_problem *tp, const float *ent, const float *md)
{
	double e = 0;

	for (size_t i = 0; i < tp->rows; i++) {
		const double l = tp->naive_lse[i];
		const double se = fmax(1, isfinite(l) ? fabs(l) : 1);
		const double sm = fmax(1, tp->naive_mdmax[i]);

		if (isnan(tp->naive_ent[i]) != isnan(ent[i]) || isnan(tp->naive_md[i]) != isnan(md[i]))
			return INFINITY;
		if (!isnan(ent[i]))
			e = fmax(e, fabs(ent[i] - tp->naive_ent[i]) / se);
		if (!isnan(md[i]))
			e = fmax(e, fabs(md[i] - tp->naive_md[i]) / sm);
	}
	return e;
}

/* "cuda:0" and such: what an APE_ENOTSUP message must name. */
static void dev_name(const ape_device *dev, char *buf, size_t len)
{
	snprintf(buf, len, "%s:%d", dev->info.backend, dev->info.backend_index);
}

/*
 * Random problems (every dtype, GQA, layouts, causal and not, offsets, strided [B, L, H, D]
 * inputs and O) at byte offsets, the diagnostics in contiguous and in gapped [B, Lq, H] layouts:
 * O, LSE, ENT and MD equal to ape_attention_forward_diag() on the same device, bit for bit on
 * the reference and OpenCL; on a backend that does not compute the diagnostics on device
 * tensors, APE_ENOTSUP naming the device; on one that does and is neither (CUDA, on the
 * emulator or a GPU), within the spec's tolerance of the naive evaluation. Asks the backend, so
 * it checks values as soon as a backend declares them.
 */
TEST_F(resident, enqueue_diag_equals_host_diag)
{
	const int cases = self->emu ? 4 : ape_test_slow() ? 4 : 20;
	const bool exact = !strcmp(variant->backend, "ref") || !strcmp(variant->backend, "opencl");
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		test_problem a, b;
		struct rdiag d = { .want_ent = true, .want_md = true, .gappy = c % 2 == 1 };
		float *ea, *ma;
		char what[256], name[64];
		int ret;

		ASSERT_EQ(0, test_problem_random(&a, &rng, 0));
		ASSERT_EQ(0, test_problem_clone(&b, &a));
		test_problem_describe(&a, what, sizeof(what));
		ea = malloc(a.rows * 4 + 4);
		ma = malloc(a.rows * 4 + 4);
		d.ent = malloc(a.rows * 4 + 4);
		d.md = malloc(a.rows * 4 + 4);
		ASSERT_TRUE(ea && ma && d.ent && d.md);
		ret = run_resident_diag(&b, self->dev, (size_t)(c % 4) * 4, &d);
		if (!diag_on_device(self->dev)) {
			dev_name(self->dev, name, sizeof(name));
			EXPECT_EQ(APE_ENOTSUP, ret);
			EXPECT_NE(NULL, strstr(ape_last_error(), name)) TH_LOG("%s", ape_last_error());
			EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue_diag"));
		} else {
			ASSERT_EQ(0, ret) TH_LOG("%s: %s", what, ape_last_error());
			EXPECT_EQ(0, d.dirty) TH_LOG("%s: written outside the outputs", what);
			if (b.strided)
				EXPECT_EQ(0, test_problem_padding_intact(&b))
				TH_LOG("%s: padding written", what);
		}
		if (diag_on_device(self->dev) && exact) {
			test_tensor_poison(&a.o.t);
			ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &a.desc, &a.q.t,
								&a.k.t, &a.v.t, &a.o.t, a.lse, ea,
								ma, NULL))
			TH_LOG("%s: %s", what, ape_last_error());
			EXPECT_EQ(0, bits_differing(&a, &b)) TH_LOG("case %d, %s: O or LSE", c, what);
			EXPECT_EQ(0, floats_differing(ea, d.ent, a.rows)) TH_LOG("case %d, %s: ENT", c, what);
			EXPECT_EQ(0, floats_differing(ma, d.md, a.rows)) TH_LOG("case %d, %s: MD", c, what);
		} else if (diag_on_device(self->dev)) {
			ASSERT_EQ(0, test_problem_naive(&b));
			EXPECT_LE(diag_err_naive(&b, d.ent, d.md), test_tol_lse(b.q.t.dtype))
			TH_LOG("case %d, %s", c, what);
		}
		free(ea);
		free(ma);
		free(d.ent);
		free(d.md);
		test_problem_free(&a);
		test_problem_free(&b);
	}
}

/* Each output optional: entropy alone, mean distance alone, and either without LSE; the ones
 * given equal the host call's, bit for bit, in a gapped layout whose gaps stay untouched; a
 * loose skip_tol is tightened as in the host call (the same result as at 2^-24). Also Lk = 0
 * (ENT = MD = 0 in every row) and Lq = 0 (nothing written). */
TEST_F(resident, enqueue_diag_outputs_each_optional)
{
	const test_problem_shape sh = { 2, 3, 1, 37, 53, 32 };
	struct {
		bool ent, md, lse;
		double skip_tol;
	} const cases[] = {
		{ true, false, true, 0x1p-24 }, { false, true, false, 0x1p-24 },
		{ true, false, false, 1e-2 },  { true, true, false, 1e-2 },
	};
	test_problem a;
	ape_rng rng;
	float *ea, *ma;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors (the refusal: "
			     "enqueue_diag_equals_host_diag)", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&a, &rng, &sh, APE_F32, false));
	test_problem_set_params(&a, 0.4, 0.04, 0.04, 0.1); /* decays: far keys are skipped */
	ea = malloc(a.rows * 4);
	ma = malloc(a.rows * 4);
	ASSERT_TRUE(ea && ma);
	ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &a.desc, &a.q.t, &a.k.t,
						&a.v.t, &a.o.t, a.lse, ea, ma, NULL));
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		test_problem b;
		struct rdiag d = { .want_ent = cases[c].ent, .want_md = cases[c].md, .gappy = true };

		ASSERT_EQ(0, test_problem_clone(&b, &a));
		if (!cases[c].lse) {
			free(b.lse);
			b.lse = NULL;
		}
		b.desc.skip_tol = cases[c].skip_tol;
		d.ent = malloc(a.rows * 4);
		d.md = malloc(a.rows * 4);
		ASSERT_TRUE(d.ent && d.md);
		ASSERT_EQ(0, run_resident_diag(&b, self->dev, 8, &d)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, d.dirty);
		if (cases[c].ent)
			EXPECT_EQ(0, floats_differing(ea, d.ent, a.rows)) TH_LOG("case %zu: ENT", c);
		if (cases[c].md)
			EXPECT_EQ(0, floats_differing(ma, d.md, a.rows)) TH_LOG("case %zu: MD", c);
		if (b.lse)
			EXPECT_EQ(0, bits_differing(&a, &b)) TH_LOG("case %zu: O or LSE", c);
		free(d.ent);
		free(d.md);
		test_problem_free(&b);
	}
	free(ea);
	free(ma);
	test_problem_free(&a);

	/* Lk = 0: zeros; Lq = 0: nothing */
	{
		const test_problem_shape e0 = { 1, 2, 1, 3, 0, 8 }, e1 = { 1, 2, 1, 0, 5, 8 };
		const test_problem_shape *es[2] = { &e0, &e1 };

		for (int i = 0; i < 2; i++) {
			test_problem b;
			struct rdiag d = { .want_ent = true, .want_md = true, .gappy = i == 0 };
			float ent[8], md[8];

			d.ent = ent;
			d.md = md;
			ASSERT_EQ(0, test_problem_make(&b, &rng, es[i], APE_F32, false));
			b.desc.causal = false;
			b.desc.q_start_set = true;
			b.desc.q_start = 0;
			ASSERT_EQ(0, run_resident_diag(&b, self->dev, 4, &d)) TH_LOG("%s", ape_last_error());
			for (size_t r = 0; r < b.rows; r++) {
				EXPECT_EQ(0.0f, ent[r]);
				EXPECT_EQ(0.0f, md[r]);
			}
			EXPECT_EQ(0, d.dirty);
			test_problem_free(&b);
		}
	}
}

/* Every refusal names the argument, and nothing is enqueued (the queue's call count stands
 * still) or written (O and both outputs keep their sentinel): each output outside its buffer,
 * at an odd offset, of another dtype or shape, rows colliding, in another device's buffer,
 * overlapping o, lse, an input or the other output; a backend without the diagnostics on
 * device tensors: APE_ENOTSUP naming the device, after the arguments were checked and before
 * anything was enqueued. */
TEST_F(resident, enqueue_diag_refusals)
{
	const int64_t B = 1, H = 2, L = 5, D = 8, n = B * H * L * D, rows = B * H * L;
	ape_buffer *bi = NULL, *bo = NULL, *bd = NULL, *foreign = NULL;
	ape_dtensor q, k, v, o, l, e, m;
	ape_queue *qu = NULL;
	ape_attn_desc desc;
	float sentinel[80], back[80];
	uint64_t calls;
	char name[64];

	ape_attn_desc_init(&desc);
	ASSERT_EQ(0, ape_queue_create(self->dev, &qu));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)n * 3 * sizeof(float), &bi));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)n * sizeof(float), &bo));
	/* lse, entropy, mean distance: one buffer, 40 bytes apart each */
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, sizeof(sentinel), &bd));
	for (int i = 0; i < 80; i++)
		sentinel[i] = 5.0f;
	ASSERT_EQ(0, ape_buffer_write(qu, bo, 0, sentinel, sizeof(sentinel)));
	ASSERT_EQ(0, ape_buffer_write(qu, bd, 0, sentinel, sizeof(sentinel)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));

#define RESET()                                                                                    \
	do {                                                                                       \
		ape_dtensor_init(&q, bi, 0, APE_F32, B, H, L, D);                                  \
		ape_dtensor_init(&k, bi, (uint64_t)n * 4, APE_F32, B, H, L, D);                    \
		ape_dtensor_init(&v, bi, (uint64_t)n * 8, APE_F32, B, H, L, D);                    \
		ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);                                  \
		ape_dtensor_init(&l, bd, 0, APE_F32, B, H, L, 1);                                  \
		ape_dtensor_init(&e, bd, (uint64_t)rows * 4, APE_F32, B, H, L, 1);                 \
		ape_dtensor_init(&m, bd, (uint64_t)rows * 8, APE_F32, B, H, L, 1);                 \
	} while (0)
#define REFUSED(code, text)                                                                        \
	do {                                                                                       \
		calls = qu->calls;                                                                 \
		EXPECT_EQ(code, ape_attention_enqueue_diag(qu, &desc, &q, &k, &v, &o, &l, &e, &m)); \
		EXPECT_NE(NULL, strstr(ape_last_error(), text))                                    \
		TH_LOG("want \"%s\" in \"%s\"", text, ape_last_error());                           \
		EXPECT_EQ(calls, qu->calls);                                                       \
		RESET();                                                                           \
	} while (0)

	RESET();
	e.byte_offset = 4 * 75; /* runs past the end */
	REFUSED(APE_EINVAL, "entropy: offset");
	m.byte_offset = 2; /* not a multiple of 4 */
	REFUSED(APE_EINVAL, "mean_distance->byte_offset = 2");
	e.dtype = APE_F16;
	REFUSED(APE_EINVAL, "entropy->dtype");
	m.shape[2] = L + 1;
	REFUSED(APE_EINVAL, "mean_distance->shape[2]");
	e.shape[3] = 2;
	REFUSED(APE_EINVAL, "entropy->shape[3]");
	m.strides[0] = rows, m.strides[1] = 1, m.strides[2] = 1, m.strides[3] = 1; /* collide */
	REFUSED(APE_EINVAL, "mean_distance->strides");
	e.buf = NULL;
	REFUSED(APE_EINVAL, "entropy->buf = NULL");
	e.buf = bo; /* inside O */
	REFUSED(APE_EINVAL, "entropy overlaps o");
	m.byte_offset = 4; /* over lse */
	REFUSED(APE_EINVAL, "mean_distance overlaps lse");
	m.byte_offset = (uint64_t)rows * 4 + 8; /* over the entropy */
	REFUSED(APE_EINVAL, "mean_distance overlaps entropy");
	e.buf = bi; /* over Q */
	REFUSED(APE_EINVAL, "entropy overlaps q");
	e.buf = bi;
	e.byte_offset = (uint64_t)n * 8; /* over V */
	REFUSED(APE_EINVAL, "entropy overlaps v");
	q.buf = NULL; /* the forward's own checks come first, with the call's name */
	REFUSED(APE_EINVAL, "ape_attention_enqueue_diag: q->buf = NULL");
	desc.lambda.value = -1;
	REFUSED(APE_EINVAL, "lambda");
	desc.lambda.value = 0;
	EXPECT_EQ(APE_EINVAL, ape_attention_enqueue_diag(NULL, &desc, &q, &k, &v, &o, &l, &e, &m));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue_diag: queue = NULL"));
	if (self->dev != self->ref) {
		ASSERT_EQ(0, ape_buffer_alloc(self->ref, 4096, &foreign));
		m.buf = foreign;
		REFUSED(APE_EINVAL, "mean_distance->buf is a buffer of ref:0");
	}
	/* a backend without them (none of libape's now): this one with the capability hidden */
	dev_name(self->dev, name, sizeof(name));
	if (diag_on_device(self->dev))
		wrap_install(self->dev, WRAP_NO_DIAG_VIEWS);
	REFUSED(APE_ENOTSUP, name);
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue_diag"))
	TH_LOG("%s", ape_last_error());
	m.buf = NULL; /* checked first: the arguments */
	REFUSED(APE_EINVAL, "mean_distance->buf = NULL");
	EXPECT_EQ(0, wrap_get().calls[WRAP_ATTENTION]);
	wrap_remove();
	/* none of it ran: O and the outputs still hold the sentinel */
	ASSERT_EQ(0, ape_buffer_read(qu, back, bo, 0, sizeof(back)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	EXPECT_EQ(0, memcmp(back, sentinel, sizeof(back)));
	ASSERT_EQ(0, ape_buffer_read(qu, back, bd, 0, sizeof(back)));
	ASSERT_EQ(0, ape_queue_synchronize(qu));
	EXPECT_EQ(0, memcmp(back, sentinel, sizeof(back)));
	/* and the same arguments are accepted where the backend has them */
	if (diag_on_device(self->dev)) {
		EXPECT_EQ(0, ape_attention_enqueue_diag(qu, &desc, &q, &k, &v, &o, &l, &e, &m))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, ape_queue_synchronize(qu));
	}
#undef REFUSED
#undef RESET
	ape_queue_destroy(qu);
	ape_buffer_free(bi);
	ape_buffer_free(bo);
	ape_buffer_free(bd);
	ape_buffer_free(foreign);
}

/* Random N(0,1) float32 Q [B, H, L, D], K and V [B, Hkv, L, D] in one device buffer, written on
 * a new queue (not synchronised: later work is ordered after it), their device tensors, and a
 * desc with a decay and a temperature. */
struct dev_qkv {
	float *x; /* q, then k, then v */
	size_t nq, nk, rows;
	ape_queue *qu;
	ape_buffer *bin;
	ape_dtensor q, k, v;
	ape_attn_desc desc;
};

static int dev_qkv_make(struct dev_qkv *s, ape_device *dev, const char *seed, int64_t B,
			int64_t H, int64_t Hkv, int64_t L, int64_t D)
{
	ape_rng rng;
	int ret;

	memset(s, 0, sizeof(*s));
	s->nq = (size_t)(B * H * L * D);
	s->nk = (size_t)(B * Hkv * L * D);
	s->rows = (size_t)(B * H * L);
	s->x = malloc((s->nq + 2 * s->nk) * 4);
	if (!s->x)
		return APE_ENOMEM;
	ape_rng_init(&rng, seed);
	for (size_t i = 0; i < s->nq + 2 * s->nk; i++)
		s->x[i] = (float)ape_rng_normal(&rng);
	ape_attn_desc_init(&s->desc);
	s->desc.delta.value = 0.3f;
	s->desc.lambda.value = 0.1f;
	ret = ape_queue_create(dev, &s->qu);
	if (!ret)
		ret = ape_buffer_alloc(dev, (s->nq + 2 * s->nk) * 4, &s->bin);
	if (!ret)
		ret = ape_buffer_write(s->qu, s->bin, 0, s->x, (s->nq + 2 * s->nk) * 4);
	ape_dtensor_init(&s->q, s->bin, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&s->k, s->bin, s->nq * 4, APE_F32, B, Hkv, L, D);
	ape_dtensor_init(&s->v, s->bin, (s->nq + s->nk) * 4, APE_F32, B, Hkv, L, D);
	return ret;
}

static void dev_qkv_free(struct dev_qkv *s)
{
	ape_queue_destroy(s->qu);
	ape_buffer_free(s->bin);
	free(s->x);
}

/* Ordering on the queue, with no synchronisation between a producer and the call: one forward
 * call writes O1, which the diagnostics call takes as its Q at once, its outputs going into the
 * buffer a write enqueued just before filled with NaN; the result equals the two host calls in
 * sequence (bit for bit on the reference and OpenCL). */
TEST_F(resident, enqueue_diag_ordered_after_its_producer)
{
	const int64_t B = 1, H = 4, Hkv = 2, L = self->emu ? 19 : 71, D = 32;
	const bool exact = !strcmp(variant->backend, "ref") || !strcmp(variant->backend, "opencl");
	struct dev_qkv s;
	ape_buffer *bo1 = NULL, *bo2 = NULL, *bd = NULL;
	ape_dtensor o, o2t, e, m;
	ape_tensor hq, hk, hv, ho;
	float *o1, *o2, *ent, *md, *he, *hm, *nan;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors (the refusal: "
			     "enqueue_diag_equals_host_diag)", variant->backend);
	ASSERT_EQ(0, dev_qkv_make(&s, self->dev, _metadata->name, B, H, Hkv, L, D));
	o1 = malloc(s.nq * 4);
	o2 = malloc(s.nq * 4);
	ent = malloc(s.rows * 4);
	md = malloc(s.rows * 4);
	he = malloc(s.rows * 4);
	hm = malloc(s.rows * 4);
	nan = malloc(s.rows * 8);
	ASSERT_TRUE(o1 && o2 && ent && md && he && hm && nan);
	for (size_t i = 0; i < 2 * s.rows; i++)
		nan[i] = NAN;
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo1));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo2));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.rows * 8, &bd));
	ape_dtensor_init(&o, bo1, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&o2t, bo2, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&e, bd, 0, APE_F32, B, H, L, 1);
	ape_dtensor_init(&m, bd, s.rows * 4, APE_F32, B, H, L, 1);
	/* no synchronisation from the inputs' write to the reads */
	ASSERT_EQ(0, ape_buffer_write(s.qu, bd, 0, nan, s.rows * 8));
	ASSERT_EQ(0, ape_attention_enqueue(s.qu, &s.desc, &s.q, &s.k, &s.v, &o, NULL));
	ASSERT_EQ(0, ape_attention_enqueue_diag(s.qu, &s.desc, &o, &s.k, &s.v, &o2t, NULL, &e, &m))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_buffer_read(s.qu, o2, bo2, 0, s.nq * 4));
	ASSERT_EQ(0, ape_buffer_read(s.qu, ent, bd, 0, s.rows * 4));
	ASSERT_EQ(0, ape_buffer_read(s.qu, md, bd, s.rows * 4, s.rows * 4));
	ASSERT_EQ(0, ape_queue_synchronize(s.qu));

	/* the same on the host: O1, then the diagnostics with O1 as Q */
	ape_tensor_init(&hq, s.x, APE_F32, B, H, L, D);
	ape_tensor_init(&hk, s.x + s.nq, APE_F32, B, Hkv, L, D);
	ape_tensor_init(&hv, s.x + s.nq + s.nk, APE_F32, B, Hkv, L, D);
	ape_tensor_init(&ho, o1, APE_F32, B, H, L, D);
	ASSERT_EQ(0, ape_attention_forward(self->dev, &s.desc, &hq, &hk, &hv, &ho, NULL, NULL));
	ape_tensor_init(&hq, o1, APE_F32, B, H, L, D);
	ape_tensor_init(&ho, s.x, APE_F32, B, H, L, D); /* Q's place, no longer needed */
	ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &s.desc, &hq, &hk, &hv, &ho,
						NULL, he, hm, NULL));
	if (exact) {
		EXPECT_EQ(0, memcmp(s.x, o2, s.nq * 4));
		EXPECT_EQ(0, floats_differing(he, ent, s.rows));
		EXPECT_EQ(0, floats_differing(hm, md, s.rows));
	}
	for (size_t i = 0; i < s.rows; i++) {
		ASSERT_LE(fabs(he[i] - ent[i]), test_tol_lse(APE_F32) * 8) TH_LOG("row %zu", i);
		ASSERT_LE(fabs(hm[i] - md[i]), test_tol_lse(APE_F32) * L) TH_LOG("row %zu", i);
	}
	dev_qkv_free(&s);
	ape_buffer_free(bo1);
	ape_buffer_free(bo2);
	ape_buffer_free(bd);
	free(o1);
	free(o2);
	free(ent);
	free(md);
	free(he);
	free(hm);
	free(nan);
}

/* Query rows split into several launches under a small budget (exec/resident.c): the outputs
 * of the diagnostics, in [B, Lq, H] layouts, move along L with O and LSE, and equal the one
 * launch's (bit for bit on the reference, within the tolerance elsewhere). */
TEST_F(resident, enqueue_diag_rows_split)
{
	const int64_t B = 2, H = 4, Hkv = 2, L = self->emu ? 23 : 61, D = 32;
	struct dev_qkv s;
	ape_buffer *bo = NULL, *bd = NULL;
	ape_dtensor o, e, m;
	struct ape__resident_req r;
	struct ape__problem p;
	float *d1, *d2;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors", variant->backend);
	ASSERT_EQ(0, dev_qkv_make(&s, self->dev, _metadata->name, B, H, Hkv, L, D));
	d1 = malloc(s.rows * 8);
	d2 = malloc(s.rows * 8);
	ASSERT_TRUE(d1 && d2);
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.rows * 8, &bd));
	ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&e, bd, 0, APE_F32, B, H, L, 1);
	ape_dtensor_init(&m, bd, s.rows * 4, APE_F32, B, H, L, 1);
	e.strides[0] = m.strides[0] = L * H;
	e.strides[1] = m.strides[1] = 1;
	e.strides[2] = m.strides[2] = H;
	e.strides[3] = m.strides[3] = 1;
	ASSERT_EQ(0, ape_attention_enqueue_diag(s.qu, &s.desc, &s.q, &s.k, &s.v, &o, NULL, &e, &m));
	ASSERT_EQ(0, ape_buffer_read(s.qu, d1, bd, 0, s.rows * 8));
	ASSERT_EQ(0, ape_queue_synchronize(s.qu));

	memset(&r, 0, sizeof(r));
	ASSERT_EQ(0, ape__check_resident_diag("test", self->dev, &s.desc, &s.q, &s.k, &s.v, &o,
					      NULL, &e, &m, &p, r.buf, r.view, r.diag,
					      r.diag_view));
	ASSERT_EQ(0, ape__diag_devices("test", &self->dev, 1, true, &p));
	r.fn = "test";
	r.dev = self->dev;
	r.q = s.qu->q;
	r.p = &p;
	for (int64_t n = 1; n <= L; n = n * 3 + 1) {
		ASSERT_EQ(0, ape__resident_enqueue(&r, n)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_buffer_read(s.qu, d2, bd, 0, s.rows * 8));
		ASSERT_EQ(0, ape_queue_synchronize(s.qu));
		if (self->dev == self->ref)
			EXPECT_EQ(0, memcmp(d1, d2, s.rows * 8)) TH_LOG("%lld rows", (long long)n);
		for (size_t i = 0; i < s.rows; i++) {
			ASSERT_LE(fabs(d1[i] - d2[i]), 8 * test_tol_lse(APE_F32))
			TH_LOG("%lld rows per launch: entropy %zu", (long long)n, i);
			ASSERT_LE(fabs(d1[s.rows + i] - d2[s.rows + i]), test_tol_lse(APE_F32) * L)
			TH_LOG("%lld rows per launch: distance %zu", (long long)n, i);
		}
	}
	ape__problem_fini(&p);
	dev_qkv_free(&s);
	ape_buffer_free(bo);
	ape_buffer_free(bd);
	free(d1);
	free(d2);
}

/* A loose skip_tol is tightened to 2^-24, as in the host calls (docs/diagnostics.md, "Skipping"):
 * on a decaying, non-causal case where skipping at 1e-2 changes O (the plain call shows it),
 * the diagnostics call at 1e-2 gives the same bits as at 2^-24. A backend that skips nothing
 * cannot show it: SKIP. */
TEST_F(resident, enqueue_diag_tightens_a_loose_skip_tol)
{
	const int64_t B = 1, H = 2, Hkv = 1, L = self->emu ? 300 : 1500, D = 16;
	const double tols[2] = { 1e-2, 0x1p-24 };
	struct dev_qkv s;
	ape_buffer *bo = NULL, *bd = NULL;
	ape_dtensor o, e, m;
	float *out[2][2];
	bool differs = false;

	if (!diag_on_device(self->dev))
		SKIP(return, "%s computes no diagnostics on device tensors", variant->backend);
	ASSERT_EQ(0, dev_qkv_make(&s, self->dev, _metadata->name, B, H, Hkv, L, D));
	s.desc.delta.value = 0.05f;
	s.desc.beta.value = 0.01f;
	s.desc.gamma.value = 0.01f;
	s.desc.causal = false;
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.nq * 4, &bo));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, s.rows * 8, &bd));
	ape_dtensor_init(&o, bo, 0, APE_F32, B, H, L, D);
	ape_dtensor_init(&e, bd, 0, APE_F32, B, H, L, 1);
	ape_dtensor_init(&m, bd, s.rows * 4, APE_F32, B, H, L, 1);
	for (int d = 0; d < 2; d++) { /* [0]: plain O; [1]: O, ENT and MD of the diagnostics */
		for (int t = 0; t < 2; t++) {
			out[d][t] = malloc(s.nq * 4 + s.rows * 8);
			ASSERT_NE(NULL, out[d][t]);
			s.desc.skip_tol = tols[t];
			if (d) {
				ASSERT_EQ(0, ape_attention_enqueue_diag(s.qu, &s.desc, &s.q, &s.k, &s.v,
									&o, NULL, &e, &m));
			} else {
				ASSERT_EQ(0, ape_attention_enqueue(s.qu, &s.desc, &s.q, &s.k, &s.v, &o,
								   NULL));
			}
			ASSERT_EQ(0, ape_buffer_read(s.qu, out[d][t], bo, 0, s.nq * 4));
			ASSERT_EQ(0, ape_buffer_read(s.qu, out[d][t] + s.nq, bd, 0, s.rows * 8));
			ASSERT_EQ(0, ape_queue_synchronize(s.qu));
		}
	}
	differs = memcmp(out[0][0], out[0][1], s.nq * 4) != 0;
	if (differs)
		EXPECT_EQ(0, floats_differing(out[1][0], out[1][1], s.nq + 2 * s.rows));
	dev_qkv_free(&s);
	ape_buffer_free(bo);
	ape_buffer_free(bd);
	for (int d = 0; d < 2; d++)
		for (int t = 0; t < 2; t++)
			free(out[d][t]);
	if (!differs)
		SKIP(return, "%s skips nothing more at skip_tol 1e-2 than at 2^-24 here: the "
			     "tightening cannot show", variant->backend);
}

TEST_HARNESS_MAIN
