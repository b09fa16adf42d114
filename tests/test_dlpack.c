/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_forward_dlpack() (include/ape/ape_dlpack.h) against ape_attention_forward() on
 * the same data: kDLCPU tensors on the reference, contiguous, [B, L, H, D] with padded rows,
 * slices of one packed QKV tensor, byte offsets, strided LSE, every dtype: results bit-identical
 * and no byte outside the outputs written. Every refusal: APE_EINVAL (APE_EOVERFLOW where the
 * sizes overflow) with a message naming the tensor. kDLOpenCL tensors (cl_mem objects the test
 * creates on the device's own cl_context, with libape's queue and with the test's own
 * cl_command_queue) and kDLCPU tensors on an OpenCL CPU device (PoCL); kDLCUDA: see the last
 * tests for what runs where.
 *
 * ape_attention_backward_dlpack() likewise: kDLCPU tensors (compact and [B, L, H, D] with
 * padding, every dtype, each subset of the outputs) against ape_attention_backward() on the
 * reference, bit for bit; its refusals; kDLCUDA tensors on the emulated driver within the
 * spec's tolerance.
 *
 * Fresh random inputs each run (APE_TEST_SEED replays one).
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "ape/ape_dlpack.h"
#include "ape_test.h"
#include "common/bwdcase.h"

#ifdef APE_HAVE_OPENCL
#include <CL/cl.h>
#endif

/* ---- one call's tensors, as a framework would hand them over */

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

static const char *const tname[5] = { "q", "k", "v", "o", "lse" };

static void fill(ape_rng *r, void *dst, ape_dtype dt, size_t n)
{
	float *f = malloc(n * sizeof(float));

	for (size_t i = 0; i < n; i++)
		f[i] = (float)ape_rng_normal(r);
	ape_convert(dst, dt, f, APE_F32, n);
	free(f);
}

/* Sets tensor i: its DLTensor at data + off bytes, shape d, strides s (NULL: compact), and the
 * same view as an ape_tensor (for i < 4). */
static void set_tensor(struct dlcall *x, int i, void *data, uint64_t off, ape_dtype dt,
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

static void dlcall_free(struct dlcall *x)
{
	free(x->in);
	free(x->in2);
	free(x->out);
	free(x->out_ref);
	free(x->lse);
	free(x->lse_ref);
	memset(x, 0, sizeof(*x));
}

static void dlcall_make(struct dlcall *x, const struct dlcase *c, ape_rng *r)
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
static int dlcall_reference(ape_device *dev, struct dlcall *x)
{
	return ape_attention_forward(dev, &x->desc, &x->h[0], &x->h[1], &x->h[2], &x->h[3],
				     x->c.with_lse ? x->lse_ref : NULL, NULL);
}

static int dlcall_run(ape_device *dev, struct dlcall *x, void *stream)
{
	return ape_attention_forward_dlpack(dev, &x->desc, &x->t[0], &x->t[1], &x->t[2], &x->t[3],
					    x->c.with_lse ? &x->t[4] : NULL, stream);
}

/* O bit-identical (and every byte outside it untouched: both arenas started equal), LSE
 * bit-identical, its padding untouched. */
static void dlcall_compare(struct __test_metadata *_metadata, const struct dlcall *x)
{
	const struct dlcase *c = &x->c;

	for (size_t i = 0; i < x->out_bytes; i++) {
		ASSERT_EQ(x->out_ref[i], x->out[i])
		TH_LOG("o differs at byte %zu of %zu", i, x->out_bytes);
	}
	if (!c->with_lse)
		return;
	for (int64_t b = 0; b < c->B; b++)
		for (int64_t h = 0; h < c->H; h++)
			for (int64_t i = 0; i < (c->strided_lse ? c->Lq + 2 : c->Lq); i++) {
				const int64_t L = c->strided_lse ? c->Lq + 2 : c->Lq;
				const float got = x->lse[(b * c->H + h) * L + i];

				if (i >= c->Lq) {
					ASSERT_EQ(1234.5f, got) TH_LOG("lse padding written");
					continue;
				}
				ASSERT_EQ(0, memcmp(&got, &x->lse_ref[(b * c->H + h) * c->Lq + i], 4))
				TH_LOG("lse[%ld,%ld,%ld]: %g, host call %g", (long)b, (long)h, (long)i,
				       got, x->lse_ref[(b * c->H + h) * c->Lq + i]);
			}
}

/* ---- on the reference: results */

FIXTURE(ref)
{
	ape_context *ctx;
	ape_device *dev;
	ape_rng rng;
	struct dlcall x;
};

FIXTURE_SETUP(ref)
{
	self->ctx = test_context("ref");
	ASSERT_NE(NULL, self->ctx);
	self->dev = test_device(self->ctx, "ref");
	ASSERT_NE(NULL, self->dev);
	ape_rng_init(&self->rng, "test_dlpack");
	memset(&self->x, 0, sizeof(self->x));
}

FIXTURE_TEARDOWN(ref)
{
	dlcall_free(&self->x);
	ape_context_destroy(self->ctx);
}

static void check_case(struct __test_metadata *_metadata, FIXTURE_DATA(ref) * self,
		       const struct dlcase *c)
{
	struct dlcall *x = &self->x;
	int ret;

	dlcall_free(x);
	dlcall_make(x, c, &self->rng);
	ASSERT_EQ(0, dlcall_reference(self->dev, x)) TH_LOG("%s", ape_last_error());
	ret = dlcall_run(self->dev, x, NULL);
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	dlcall_compare(_metadata, x);
}

/* Random awkward sizes: odd lengths, GQA, D not a power of two. */
static struct dlcase random_case(ape_rng *r, enum layout layout, ape_dtype dt)
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

/* Nine random cases of one layout, three of each dtype. */
static void check_layout(struct __test_metadata *_metadata, FIXTURE_DATA(ref) * self,
			 enum layout layout)
{
	const ape_dtype dts[3] = { APE_F32, APE_F16, APE_BF16 };

	for (int i = 0; i < 9; i++) {
		struct dlcase c = random_case(&self->rng, layout, dts[i % 3]);

		check_case(_metadata, self, &c);
	}
}

TEST_F(ref, contiguous_every_dtype_bit_identical)
{
	check_layout(_metadata, self, COMPACT);
}

TEST_F(ref, blhd_strides_bit_identical)
{
	check_layout(_metadata, self, BLHD);
}

TEST_F(ref, packed_qkv_slices_and_byte_offset_bit_identical)
{
	check_layout(_metadata, self, PACKED);
}

TEST_F(ref, strided_lse_bit_identical)
{
	struct dlcase c = random_case(&self->rng, BLHD, APE_F32);

	c.with_lse = c.strided_lse = true;
	check_case(_metadata, self, &c);
}

/* The stride of an axis of one element addresses nothing: frameworks leave any value there
 * (even a negative one), and the call takes it. */
TEST_F(ref, strides_of_one_element_axes_are_ignored)
{
	struct dlcase c = random_case(&self->rng, BLHD, APE_F32);
	struct dlcall *x = &self->x;

	c.B = 1;
	c.with_lse = c.strided_lse = true;
	dlcall_make(x, &c, &self->rng);
	ASSERT_EQ(0, dlcall_reference(self->dev, x)) TH_LOG("%s", ape_last_error());
	x->str[0][0] = -7; /* B = 1 */
	x->str[3][0] = INT64_MAX;
	x->str[4][0] = -1;
	ASSERT_EQ(0, dlcall_run(self->dev, x, NULL)) TH_LOG("%s", ape_last_error());
	dlcall_compare(_metadata, x);
}

/* A sequence with no key: O = 0, LSE = -inf; k and v may then have no data at all. */
TEST_F(ref, no_keys_and_no_queries)
{
	struct dlcase c = { 2, 2, 1, 3, 0, 8, APE_F32, APE_F32, COMPACT, true, false };
	struct dlcall *x = &self->x;

	dlcall_make(x, &c, &self->rng);
	x->t[1].data = x->t[2].data = NULL;
	ASSERT_EQ(0, dlcall_run(self->dev, x, NULL)) TH_LOG("%s", ape_last_error());
	for (int64_t i = 0; i < 2 * 2 * 3 * 8; i++) {
		ASSERT_EQ(0.0f, ((float *)x->out)[i]);
	}
	for (int i = 0; i < 12; i++) {
		ASSERT_TRUE(isinf(x->lse[i]) && x->lse[i] < 0);
	}
	dlcall_free(x);
	c.Lk = 4;
	c.Lq = 0;
	dlcall_make(x, &c, &self->rng);
	x->t[0].data = x->t[3].data = x->t[4].data = NULL;
	ASSERT_EQ(0, dlcall_run(self->dev, x, NULL)) TH_LOG("%s", ape_last_error());
}

/* ---- on the reference: refusals */

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

/* A fresh valid call of that layout, changed by `change`, refused naming what fmt (with the
 * tensor's name) says; in refusals_name_the_tensor only (self, x, dev, what, i). */
#define REFUSED_AFTER(layout, change, fmt)                                                         \
	do {                                                                                       \
		fresh(self, layout);                                                               \
		change;                                                                            \
		snprintf(what, sizeof(what), fmt, tname[i]);                                       \
		EXPECT_REFUSED(APE_EINVAL, what, dlcall_run(dev, x, NULL));                         \
	} while (0)

static void fresh(FIXTURE_DATA(ref) * self, enum layout layout)
{
	struct dlcase c = { 1, 2, 2, 4, 4, 8, APE_F32, APE_F32, layout, true, false };

	dlcall_free(&self->x);
	dlcall_make(&self->x, &c, &self->rng);
}

TEST_F(ref, refusals_name_the_tensor)
{
	struct dlcall *x = &self->x;
	ape_device *dev = self->dev;
	char what[64];

	for (int i = 0; i < 5; i++) {
		const DLDataType i32 = { kDLInt, 32, 1 }, f64 = { kDLFloat, 64, 1 };
		const DLDataType f32x2 = { kDLFloat, 32, 2 };

		REFUSED_AFTER(COMPACT, x->t[i].device.device_type = kDLCUDA, "%s->device");
		REFUSED_AFTER(COMPACT, x->t[i].device.device_id = 1, "%s->device");
		REFUSED_AFTER(COMPACT, x->t[i].dtype = i32, "%s->dtype");
		REFUSED_AFTER(COMPACT, x->t[i].dtype = f64, "%s->dtype");
		REFUSED_AFTER(COMPACT, x->t[i].dtype = f32x2, "%s->dtype.lanes");
		REFUSED_AFTER(COMPACT, x->t[i].ndim = i == 4 ? 4 : 3, "%s->ndim");
		REFUSED_AFTER(COMPACT, x->t[i].shape = NULL, "%s->shape");
		/* L (lse: Lq) one longer than the others' */
		REFUSED_AFTER(COMPACT, x->shp[i][2]++, "%s");
		REFUSED_AFTER(COMPACT, x->shp[i][1] = -1, "%s->shape[1]");
		/* half an element; a misaligned pointer; none */
		REFUSED_AFTER(COMPACT, x->t[i].byte_offset += 2, "%s->byte_offset");
		REFUSED_AFTER(COMPACT, x->t[i].data = (unsigned char *)x->t[i].data + 2,
			      "%s: data + byte_offset");
		REFUSED_AFTER(COMPACT, x->t[i].data = NULL, "%s->data = NULL");

		/* strides: negative, out of range, beyond the address space */
		fresh(self, BLHD);
		if (i == 4) { /* lse: compact [B, H, Lq], given explicitly */
			x->str[4][0] = x->shp[4][1] * x->shp[4][2];
			x->str[4][1] = x->shp[4][2];
			x->str[4][2] = 1;
		}
		x->t[i].strides = x->str[i];
		x->str[i][2] = -1;
		snprintf(what, sizeof(what), "%s->strides[2]", tname[i]);
		EXPECT_REFUSED(APE_EINVAL, what, dlcall_run(dev, x, NULL));
		x->str[i][2] = INT64_MAX / 3; /* 3 steps of it: beyond any address space */
		EXPECT_REFUSED(APE_EINVAL, what, dlcall_run(dev, x, NULL));
		x->str[i][2] = INT64_MAX / 8; /* inside 64 bits, beyond the addresses at data */
		EXPECT_REFUSED(APE_EINVAL, what, dlcall_run(dev, x, NULL));
	}
	/* q, k, v, o: D not contiguous */
	for (int i = 0; i < 4; i++) {
		fresh(self, BLHD);
		x->str[i][3] = 2;
		snprintf(what, sizeof(what), "%s->strides[3]", tname[i]);
		EXPECT_REFUSED(APE_EINVAL, what, dlcall_run(dev, x, NULL));
	}
	/* strides in range of the address space but beyond the tensor's memory cannot be caught
	 * on the host (it is the caller's memory): what is checked is that an output overlaps no
	 * input and no other output */
	fresh(self, COMPACT);
	x->t[3].data = x->t[0].data; /* o over q */
	EXPECT_REFUSED(APE_EINVAL, "o overlaps q", dlcall_run(dev, x, NULL));
	fresh(self, COMPACT);
	x->t[4].data = (unsigned char *)x->t[3].data + 4 * 4; /* lse inside o */
	EXPECT_REFUSED(APE_EINVAL, "lse", dlcall_run(dev, x, NULL));
	fresh(self, BLHD);
	x->str[3][2] = 0; /* o's rows on top of each other */
	EXPECT_REFUSED(APE_EINVAL, "o", dlcall_run(dev, x, NULL));
	/* lse: float32 only, [B, H, Lq] */
	fresh(self, COMPACT);
	x->t[4].dtype = (DLDataType){ kDLFloat, 16, 1 };
	EXPECT_REFUSED(APE_EINVAL, "lse", dlcall_run(dev, x, NULL));
	fresh(self, COMPACT);
	x->shp[4][0] = 2;
	EXPECT_REFUSED(APE_EINVAL, "lse", dlcall_run(dev, x, NULL));
	/* the call: NULL tensors, a stream for CPU tensors, different devices */
	for (int i = 0; i < 4; i++) {
		const DLTensor *t[4] = { &x->t[0], &x->t[1], &x->t[2], &x->t[3] };

		fresh(self, COMPACT);
		t[i] = NULL;
		snprintf(what, sizeof(what), "%s = NULL", tname[i]);
		EXPECT_REFUSED(APE_EINVAL, what,
			       ape_attention_forward_dlpack(dev, &x->desc, t[0], t[1], t[2],
							    (DLTensor *)t[3], NULL, NULL));
	}
	fresh(self, COMPACT);
	EXPECT_REFUSED(APE_EINVAL, "stream", dlcall_run(dev, x, (void *)x));
	EXPECT_REFUSED(APE_EINVAL, "desc = NULL",
		       ape_attention_forward_dlpack(dev, NULL, &x->t[0], &x->t[1], &x->t[2],
						    &x->t[3], NULL, NULL));
	EXPECT_EQ(APE_EINVAL, ape_attention_forward_dlpack(NULL, &x->desc, &x->t[0], &x->t[1],
							   &x->t[2], &x->t[3], NULL, NULL));
	x->t[2].device.device_type = kDLOpenCL;
	EXPECT_REFUSED(APE_EINVAL, "v->device", dlcall_run(dev, x, NULL));
	x->t[2].device.device_type = kDLVulkan;
	EXPECT_REFUSED(APE_EINVAL, "v->device", dlcall_run(dev, x, NULL));
	/* the desc's own rules still apply */
	fresh(self, COMPACT);
	x->desc.rope_base = -1;
	EXPECT_REFUSED(APE_EINVAL, "rope_base", dlcall_run(dev, x, NULL));
	/* nothing was written by any refused call */
	fresh(self, COMPACT);
	x->t[1].dtype.lanes = 4;
	EXPECT_EQ(APE_EINVAL, dlcall_run(dev, x, NULL));
	for (size_t i = 0; i < x->out_bytes; i++) {
		ASSERT_EQ(0x5a, x->out[i]);
	}
}

/* ---- OpenCL */

#ifdef APE_HAVE_OPENCL
FIXTURE(ocl)
{
	ape_context *ctx;
	ape_device *dev, *ref;
	ape_rng rng;
	struct dlcall x;
	cl_context clctx;
	cl_device_id cldev;
};

FIXTURE_SETUP(ocl)
{
	self->ctx = test_context("ref,opencl");
	ASSERT_NE(NULL, self->ctx);
	self->ref = test_device(self->ctx, "ref");
	self->dev = test_device(self->ctx, "opencl");
	if (!self->dev)
		APE_SETUP_SKIP(ape_context_destroy(self->ctx), "no OpenCL device: %s",
			       ape_last_error());
	ape_rng_init(&self->rng, "test_dlpack_ocl");
	memset(&self->x, 0, sizeof(self->x));
	ASSERT_EQ(0, ape_device_native(self->dev, (void **)&self->clctx, (void **)&self->cldev));
}

FIXTURE_TEARDOWN(ocl)
{
	dlcall_free(&self->x);
	ape_context_destroy(self->ctx);
}

/* A cl_mem of the device's context holding `bytes` of host memory. */
static cl_mem cl_buffer_of(cl_context ctx, cl_command_queue cq, const void *host, size_t bytes)
{
	cl_int err;
	cl_mem m = clCreateBuffer(ctx, CL_MEM_READ_WRITE, bytes, NULL, &err);

	if (m && clEnqueueWriteBuffer(cq, m, CL_TRUE, 0, bytes, host, 0, NULL, NULL) != CL_SUCCESS) {
		clReleaseMemObject(m);
		m = NULL;
	}
	return m;
}

/* The same case as cl_mem objects (q, k, v in one, offset by byte_offset; o and lse each in
 * its own), run with libape's queue (own_queue false) or the test's own, checked against the
 * host call on the reference within the spec's tolerance (another backend: not bitwise). */
static void ocl_case(struct __test_metadata *_metadata, FIXTURE_DATA(ocl) * self,
		     const struct dlcase *c, bool own_queue)
{
	struct dlcall *x = &self->x;
	cl_int err;
	cl_command_queue cq = clCreateCommandQueue(self->clctx, self->cldev, 0, &err);
	cl_mem in, out, lse = NULL;
	void *saved[5];
	ape_buffer *probe = NULL;
	int ret;

	ASSERT_NE(NULL, cq);
	dlcall_free(x);
	dlcall_make(x, c, &self->rng);
	ASSERT_EQ(0, dlcall_reference(self->ref, x)) TH_LOG("%s", ape_last_error());
	in = cl_buffer_of(self->clctx, cq, x->in, x->in_bytes);
	out = cl_buffer_of(self->clctx, cq, x->out, x->out_bytes);
	ASSERT_NE(NULL, in);
	ASSERT_NE(NULL, out);
	if (c->with_lse) {
		lse = cl_buffer_of(self->clctx, cq, x->lse, x->lse_len * sizeof(float));
		ASSERT_NE(NULL, lse);
	}
	ret = ape_buffer_wrap_opencl(self->dev, in, &probe);
	ape_buffer_free(probe);
	if (ret == APE_ENOTSUP) {
		clReleaseMemObject(in);
		clReleaseMemObject(out);
		if (lse)
			clReleaseMemObject(lse);
		clReleaseCommandQueue(cq);
		SKIP(return, "this OpenCL backend wraps no cl_mem yet (%s)", ape_last_error());
	}
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	/* host addresses become byte offsets into the cl_mem objects */
	for (int i = 0; i < 5; i++) {
		DLTensor *t = &x->t[i];
		unsigned char *base = i < 3 ? x->in : i == 3 ? x->out : (unsigned char *)x->lse;

		saved[i] = t->data;
		if (i == 4 && !c->with_lse)
			continue;
		t->byte_offset += (uint64_t)((unsigned char *)t->data - base);
		t->data = i < 3 ? in : i == 3 ? out : lse;
		t->device = (DLDevice){ kDLOpenCL, 0 };
	}
	{
		ape_device_info info;

		ape_device_get_info(self->dev, &info);
		for (int i = 0; i < 5; i++)
			x->t[i].device.device_id = info.backend_index;
	}
	ret = dlcall_run(self->dev, x, own_queue ? cq : NULL);
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	/* with its own queue the test orders its read after libape's work on that queue */
	ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, out, CL_TRUE, 0, x->out_bytes, x->out, 0,
						  NULL, NULL));
	if (lse) {
		ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, lse, CL_TRUE, 0,
							  x->lse_len * sizeof(float), x->lse, 0,
							  NULL, NULL));
	}
	for (int i = 0; i < 5; i++)
		x->t[i].data = saved[i];
	{
		ape_tensor got = x->h[3];
		double scale = 0, err_o;

		got.data = x->out + ((unsigned char *)x->h[3].data - x->out_ref);
		for (int i = 0; i < 3; i++)
			scale = fmax(scale, test_tensor_maxabs(&x->h[2]));
		err_o = test_max_err_o(&got, &x->h[3]);
		EXPECT_LE(err_o, test_tol_o(c->dt) * fmax(scale, 1e-30));
	}
	clReleaseMemObject(in);
	clReleaseMemObject(out);
	if (lse)
		clReleaseMemObject(lse);
	clReleaseCommandQueue(cq);
}

TEST_F(ocl, cl_mem_tensors_libape_queue)
{
	if (!self->clctx)
		SKIP(return, "the OpenCL backend of this build gives no native cl_context "
			     "(ape_device_native): it cannot take cl_mem tensors yet");
	for (int i = 0; i < 3; i++) {
		struct dlcase c = random_case(&self->rng, (enum layout)i, APE_F32);

		ocl_case(_metadata, self, &c, false);
	}
}

TEST_F(ocl, cl_mem_tensors_callers_queue)
{
	if (!self->clctx)
		SKIP(return, "the OpenCL backend of this build gives no native cl_context "
			     "(ape_device_native): it cannot take cl_mem tensors yet");
	for (int i = 0; i < 3; i++) {
		struct dlcase c = random_case(&self->rng, (enum layout)i, i == 1 ? APE_F16 : APE_F32);

		ocl_case(_metadata, self, &c, true);
	}
}

/* kDLCPU tensors on an OpenCL CPU device (PoCL): computed in place, like on the reference. */
TEST_F(ocl, cpu_tensors_on_an_opencl_cpu_device)
{
	struct dlcall *x = &self->x;
	struct dlcase c = random_case(&self->rng, BLHD, APE_F32);
	ape_device_info info;
	float probe_mem[4];
	ape_buffer *probe = NULL;
	int ret = ape_buffer_wrap_host(self->dev, probe_mem, sizeof(probe_mem), &probe);

	ape_buffer_free(probe);
	ape_device_get_info(self->dev, &info);
	dlcall_make(x, &c, &self->rng);
	if (ret == APE_ENOTSUP) {
		/* a GPU, or a backend that cannot yet: the DLPack call says so, naming q */
		EXPECT_REFUSED(APE_ENOTSUP, "q", dlcall_run(self->dev, x, NULL));
		SKIP_UNLESS_FAILED("opencl:%d (%s) does not compute on host memory in place: %s",
				   info.backend_index, info.name, ape_last_error());
	}
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, dlcall_reference(self->ref, x)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, dlcall_run(self->dev, x, NULL)) TH_LOG("%s", ape_last_error());
	{
		ape_tensor got = x->h[3];

		got.data = x->out + ((unsigned char *)x->h[3].data - x->out_ref);
		EXPECT_LE(test_max_err_o(&got, &x->h[3]),
			  test_tol_o(c.dt) * fmax(test_tensor_maxabs(&x->h[2]), 1e-30));
	}
}

/* kDLOpenCL tensors with the wrong device id, or on the reference: refused naming the tensor. */
TEST_F(ocl, opencl_refusals)
{
	struct dlcall *x = &self->x;
	struct dlcase c = { 1, 2, 2, 4, 4, 8, APE_F32, APE_F32, COMPACT, true, false };
	ape_device_info info;

	ape_device_get_info(self->dev, &info);
	dlcall_make(x, &c, &self->rng);
	for (int i = 0; i < 5; i++)
		x->t[i].device = (DLDevice){ kDLOpenCL, info.backend_index + 1 };
	EXPECT_REFUSED(APE_EINVAL, "q->device.device_id", dlcall_run(self->dev, x, NULL));
	for (int i = 0; i < 5; i++)
		x->t[i].device = (DLDevice){ kDLOpenCL, 0 };
	EXPECT_REFUSED(APE_EINVAL, "q->device", dlcall_run(self->ref, x, NULL));
	for (int i = 0; i < 5; i++)
		x->t[i].device = (DLDevice){ kDLCUDA, 0 };
	EXPECT_REFUSED(APE_EINVAL, "q->device", dlcall_run(self->dev, x, NULL));
}
#endif /* APE_HAVE_OPENCL */

/* ---- CUDA, through the emulated driver (tests/fake_cuda with cuda/emu): no GPU needed */

#ifdef APE_HAVE_CUDA
#define EMU_LIB APE_BUILD_DIR "/tests/cuda_emu/libcuda.so.1"

/* The few driver calls the test makes itself, from the same libcuda.so.1 the backend loaded. */
struct cu {
	void *lib;
	int (*retain)(void **ctx, int dev);
	int (*release)(int dev);
	int (*push)(void *ctx);
	int (*pop)(void **ctx);
	int (*alloc)(unsigned long long *p, size_t n);
	int (*free)(unsigned long long p);
	int (*h2d)(unsigned long long dst, const void *src, size_t n, void *stream);
	int (*d2h)(void *dst, unsigned long long src, size_t n, void *stream);
	int (*sync)(void *stream);
};

static bool cu_open(struct cu *cu)
{
	int (*gpa)(const char *, void **, int, uint64_t);
	struct {
		const char *name;
		void **fn;
	} want[] = { { "cuDevicePrimaryCtxRetain", (void **)&cu->retain },
		     { "cuDevicePrimaryCtxRelease", (void **)&cu->release },
		     { "cuCtxPushCurrent", (void **)&cu->push },
		     { "cuCtxPopCurrent", (void **)&cu->pop },
		     { "cuMemAlloc", (void **)&cu->alloc },
		     { "cuMemFree", (void **)&cu->free },
		     { "cuMemcpyHtoDAsync", (void **)&cu->h2d },
		     { "cuMemcpyDtoHAsync", (void **)&cu->d2h },
		     { "cuStreamSynchronize", (void **)&cu->sync } };

	cu->lib = dlopen(EMU_LIB, RTLD_NOW);
	if (!cu->lib)
		return false;
	*(void **)&gpa = dlsym(cu->lib, "cuGetProcAddress");
	if (!gpa)
		return false;
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
		if (gpa(want[i].name, want[i].fn, 12000, 0))
			return false;
	return true;
}
#endif

#ifdef APE_HAVE_CUDA
/* A context of the emulated driver's CUDA device (in *dev, NULL if absent) and the reference
 * (*refdev); NULL if none could be made. */
static ape_context *emu_context(ape_device **dev, ape_device **refdev)
{
	ape_context *ctx;

	setenv("APE_CUDA_LIBRARY", EMU_LIB, 1); /* this test's child only */
	unsetenv("FAKE_CUDA_MODE");
	ctx = test_context("cuda,ref");
	*dev = ctx ? test_device(ctx, "cuda") : NULL;
	*refdev = ctx ? test_device(ctx, "ref") : NULL;
	return ctx;
}

/* The first byte of x's O arena outside O (padding, offset, slack) that is no longer 0x5a, or
 * -1: O's elements are where the layout says (see dlcall_make()). */
static long o_bytes_outside_written(const struct dlcall *x)
{
	const struct dlcase *c = &x->c;
	const size_t n = x->out_bytes / x->oesz, osz = (size_t)(c->B * c->H * c->Lq * c->D);

	for (size_t e = 0; e < n; e++) {
		bool in_o = c->layout == BLHD	 ? e < osz + (size_t)(c->B * c->H * c->Lq * 3) &&
							 e % (size_t)(c->D + 3) < (size_t)c->D
			    : c->layout == PACKED ? e >= 8 && e < 8 + osz
						  : e < osz;

		for (size_t b = 0; !in_o && b < x->oesz; b++)
			if (x->out[e * x->oesz + b] != 0x5a)
				return (long)(e * x->oesz + b);
	}
	return -1;
}

/* One case in device memory at the same offsets as in the host arenas, on the legacy default
 * stream; the first also checks the refusals that need memory. Returns the CUDA backend's
 * answer to a wrap (APE_ENOTSUP: it wraps no memory, and the call must say so). */
static int cuda_case(struct __test_metadata *_metadata, ape_device *dev, ape_device *refdev,
		     const struct cu *cu, int ordinal, const struct dlcase *c, ape_rng *rng,
		     bool refusals)
{
	unsigned long long mem[5] = { 0 };
	ape_buffer *probe = NULL;
	size_t bytes[5];
	struct dlcall x;
	int ret;

	dlcall_make(&x, c, rng);
	ret = dlcall_reference(refdev, &x);
	EXPECT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	bytes[0] = bytes[1] = bytes[2] = x.in_bytes;
	bytes[3] = x.out_bytes;
	bytes[4] = x.lse_len * sizeof(float);
	for (int i = 0; i < 5 && !ret; i++) {
		const void *host = i < 3 ? (void *)x.in : i == 3 ? (void *)x.out : (void *)x.lse;
		unsigned char *base = i < 3 ? x.in : i == 3 ? x.out : (unsigned char *)x.lse;

		ret = cu->alloc(&mem[i], bytes[i]) || cu->h2d(mem[i], host, bytes[i], NULL);
		EXPECT_EQ(0, ret) TH_LOG("the emulated driver's cuMemAlloc or copy failed");
		x.t[i].byte_offset += (uint64_t)((unsigned char *)x.t[i].data - base);
		x.t[i].data = (void *)(uintptr_t)mem[i];
		x.t[i].device = (DLDevice){ kDLCUDA, ordinal };
	}
	if (!ret)
		ret = cu->sync(NULL);
	if (!ret && refusals) {
		/* another ordinal; a kDLOpenCL tensor among them: refused, naming the tensor */
		for (int i = 0; i < 5; i++)
			x.t[i].device.device_id = ordinal + 1;
		EXPECT_REFUSED(APE_EINVAL, "q->device.device_id", dlcall_run(dev, &x, NULL));
		for (int i = 0; i < 5; i++)
			x.t[i].device.device_id = ordinal;
		x.t[3].device.device_type = kDLOpenCL;
		EXPECT_REFUSED(APE_EINVAL, "o->device", dlcall_run(dev, &x, NULL));
		x.t[3].device.device_type = kDLCUDA;
	}
	if (!ret) {
		ret = ape_buffer_wrap_cuda(dev, mem[0], bytes[0], &probe);
		ape_buffer_free(probe);
	}
	if (ret == APE_ENOTSUP) {
		EXPECT_REFUSED(APE_ENOTSUP, "q", dlcall_run(dev, &x, NULL));
	} else if (!ret) {
		ape_tensor got;
		double lse_scale = 1;

		ASSERT_EQ(0, dlcall_run(dev, &x, NULL)) TH_LOG("%s", ape_last_error());
		/* asynchronous: the legacy stream orders the reads after the work */
		ASSERT_EQ(0, cu->d2h(x.out, mem[3], bytes[3], NULL));
		ASSERT_EQ(0, cu->d2h(x.lse, mem[4], bytes[4], NULL));
		ASSERT_EQ(0, cu->sync(NULL));
		got = x.h[3];
		got.data = x.out + ((unsigned char *)x.h[3].data - x.out_ref);
		EXPECT_LE(test_max_err_o(&got, &x.h[3]),
			  test_tol_o(c->dt) * fmax(test_tensor_maxabs(&x.h[2]), 1e-30));
		for (size_t i = 0; i < x.lse_len; i++)
			lse_scale = fmax(lse_scale, fabs(x.lse_ref[i]));
		EXPECT_LE(test_max_err_lse(x.lse, x.lse_ref, x.lse_len),
			  test_tol_lse(c->dt) * lse_scale);
		/* the bytes around O (row padding, the offset before it, the end) untouched */
		EXPECT_EQ(-1, o_bytes_outside_written(&x)) TH_LOG("o: a byte outside it written");
	}
	for (int i = 0; i < 5; i++)
		if (mem[i])
			cu->free(mem[i]);
	dlcall_free(&x);
	return ret;
}
#endif

/*
 * kDLCUDA tensors in device memory of the CUDA device's primary context, on the legacy default
 * stream (stream NULL), against the reference's host call: every layout and dtype; and the
 * refusals. Until this build's CUDA backend wraps memory (buf_wrap), the call must say so
 * (APE_ENOTSUP naming q) and the computing part is skipped.
 */
TEST(cuda_tensors_on_the_emulated_driver)
{
#ifndef APE_HAVE_CUDA
	SKIP(return, "the CUDA backend is not built into this libape");
#else
	const ape_dtype dts[3] = { APE_F32, APE_F16, APE_BF16 };
	struct cu cu = { 0 };
	void *cuctx = NULL, *ordinal = NULL, *popped;
	ape_context *ctx;
	ape_device *dev, *refdev;
	ape_rng rng;
	bool retained = false;
	int ret = 0;

	if (ape_test_slow())
		SKIP(return, "the emulator under valgrind is too slow; make sanitize runs it");
	ctx = emu_context(&dev, &refdev);
	ASSERT_NE(NULL, ctx);
	ASSERT_NE(NULL, dev) TH_LOG("no CUDA device from the emulated driver %s", EMU_LIB);
	ASSERT_EQ(0, ape_device_native(dev, &cuctx, &ordinal));
	ASSERT_TRUE(cu_open(&cu)) TH_LOG("%s: %s", EMU_LIB, dlerror());
	if (!cuctx) { /* a backend without ape_device_native(): the emulator's one device */
		ASSERT_EQ(0, cu.retain(&cuctx, 0));
		retained = true;
	}
	ape_rng_init(&rng, "test_dlpack_cuda");
	ASSERT_EQ(0, cu.push(cuctx));
	for (int i = 0; i < 6 && ret != APE_ENOTSUP && _metadata->passed; i++) {
		struct dlcase c = random_case(&rng, (enum layout)(i % 3), dts[i / 2 % 3]);

		c.with_lse = true;
		c.strided_lse = false;
		ret = cuda_case(_metadata, dev, refdev, &cu, (int)(intptr_t)ordinal, &c, &rng, i == 0);
	}
	cu.pop(&popped);
	if (retained)
		cu.release(0);
	ape_context_destroy(ctx);
	if (ret == APE_ENOTSUP)
		SKIP_UNLESS_FAILED("kDLCUDA tensors are refused (APE_ENOTSUP, as they must be) by "
				   "this build's CUDA backend, which wraps no memory yet: nothing "
				   "computed");
#endif
}

/* ape_attention_forward_dlpack_diag() on kDLCPU tensors: entropy and mean distance equal the
 * host ape_attention_forward_diag() bit for bit, contiguous and as [B, Lq, H] strided views,
 * each optional; an output over another tensor refused naming it, nothing written. */
TEST_F(ref, diagnostics_twin)
{
	enum { B = 2, H = 3, L = 21, D = 16, NQ = B * H * L * D, R = B * H * L };
	static float q[NQ], k[NQ], v[NQ], o[NQ], o2[NQ], lse[R], lse2[R], ent[R], md[R];
	static float dent[R + 8], dmd[R + 8];
	int64_t s4[4] = { B, H, L, D }, s3[3] = { B, H, L }, st3[3] = { L * H, 1, H };
	DLTensor t[7];
	ape_tensor hq, hk, hv, ho;
	ape_attn_desc desc;

	fill(&self->rng, q, APE_F32, NQ);
	fill(&self->rng, k, APE_F32, NQ);
	fill(&self->rng, v, APE_F32, NQ);
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.4f;
	desc.lambda.value = 0.1f;
	ape_tensor_init(&hq, q, APE_F32, B, H, L, D);
	ape_tensor_init(&hk, k, APE_F32, B, H, L, D);
	ape_tensor_init(&hv, v, APE_F32, B, H, L, D);
	ape_tensor_init(&ho, o, APE_F32, B, H, L, D);
	ASSERT_EQ(0, ape_attention_forward_diag(&self->dev, 1, NULL, &desc, &hq, &hk, &hv, &ho, lse,
						ent, md, NULL));
	for (int strided = 0; strided < 2; strided++) {
		void *data[7] = { q, k, v, o2, lse2, dent, dmd };

		for (int i = 0; i < 7; i++)
			t[i] = (DLTensor){ .data = data[i], .device = { kDLCPU, 0 },
					   .ndim = i < 4 ? 4 : 3, .dtype = { kDLFloat, 32, 1 },
					   .shape = i < 4 ? s4 : s3,
					   .strides = i >= 5 && strided ? st3 : NULL };
		for (int i = 0; i < R + 8; i++)
			dent[i] = dmd[i] = NAN;
		ASSERT_EQ(0, ape_attention_forward_dlpack_diag(self->dev, &desc, &t[0], &t[1], &t[2],
							       &t[3], &t[4], &t[5], &t[6], NULL))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, memcmp(o, o2, sizeof(o)));
		EXPECT_EQ(0, memcmp(lse, lse2, sizeof(lse)));
		for (int b = 0; b < B; b++)
			for (int h = 0; h < H; h++)
				for (int i = 0; i < L; i++) {
					const int r = (b * H + h) * L + i;
					const int at = strided ? b * L * H + i * H + h : r;

					ASSERT_EQ(ent[r], dent[at]) TH_LOG("row %d", r);
					ASSERT_EQ(md[r], dmd[at]) TH_LOG("row %d", r);
				}
		EXPECT_TRUE(isnan(dent[R]) && isnan(dmd[R])); /* nothing past the end */
	}
	/* mean distance alone, no lse */
	for (int i = 0; i < R; i++)
		dmd[i] = NAN;
	t[6].strides = NULL;
	ASSERT_EQ(0, ape_attention_forward_dlpack_diag(self->dev, &desc, &t[0], &t[1], &t[2], &t[3],
						       NULL, NULL, &t[6], NULL))
	TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(md, dmd, sizeof(md)));
	/* the entropy over O: refused, naming both, nothing written */
	for (int i = 0; i < R; i++)
		dmd[i] = NAN;
	t[5].data = o2;
	t[5].strides = NULL;
	EXPECT_EQ(APE_EINVAL, ape_attention_forward_dlpack_diag(self->dev, &desc, &t[0], &t[1],
								&t[2], &t[3], &t[4], &t[5], &t[6],
								NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_forward_dlpack_diag: entropy"))
	TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(isnan(dmd[0]));
	/* a 4-D entropy: refused naming it */
	t[5] = t[3];
	t[5].data = dent;
	EXPECT_EQ(APE_EINVAL, ape_attention_forward_dlpack_diag(self->dev, &desc, &t[0], &t[1],
								&t[2], &t[3], NULL, &t[5], NULL,
								NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "entropy->ndim = 4")) TH_LOG("%s", ape_last_error());
}

/* ---- the backward pass on DLPack tensors */

/* kDLCPU tensors on the reference: the host call's gradients, bit for bit, in every dtype,
 * compact and padded [B, L, H, D], each subset of the outputs (the others untouched). */
TEST_F(ref, backward_kdlcpu_equals_host_call)
{
	static const ape_dtype dts[3] = { APE_F32, APE_F16, APE_BF16 };
	static const unsigned subsets[] = { W_ALL, W_DP, W_DQ | W_DK, W_DV };
	const test_problem_shape sh = { 2, 4, 2, 9, 13, 16 };
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < 6; i++) {
		const unsigned w = subsets[i % 4];
		dlbwd b;
		grads host, got;
		bcase c;

		ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, dts[i % 3], i >= 3, i % 2 == 0, self->dev));
		ASSERT_EQ(0, grads_alloc(&host, &c, dts[i % 3]));
		ASSERT_EQ(0, grads_alloc(&got, &c, dts[i % 3]));
		ASSERT_EQ(0, run_backward(&c, self->dev, &host, w, NULL)) TH_LOG("%s", ape_last_error());
		dlbwd_make(&b, &c, &got);
		ASSERT_EQ(0, dlbwd_run(self->dev, &c, &b, w, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_TRUE(same_grads(&got, &host, W_ALL)) TH_LOG("case %d, outputs %#x", i, w);
		grads_free(&host);
		grads_free(&got);
		bcase_free(&c);
	}
}

#define EXPECT_BWD_REFUSED(err, what, call)                                                        \
	EXPECT_REFUSED_BY("ape_attention_backward_dlpack", err, what, call)

/* Each refusal names the tensor; nothing is written. */
TEST_F(ref, backward_refusals_name_the_tensor)
{
	const test_problem_shape sh = { 1, 2, 1, 5, 6, 8 };
	dlbwd b;
	grads g, untouched;
	ape_rng rng;
	bcase c;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F32, false, true, self->dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&untouched, &c, APE_F32));
	dlbwd_make(&b, &c, &g);
	b.t[10].ndim = 3;
	EXPECT_BWD_REFUSED(APE_EINVAL, "dparams->ndim = 3: must be 2 ([H, 4])",
			   dlbwd_run(self->dev, &c, &b, W_ALL, NULL));
	dlbwd_make(&b, &c, &g);
	b.shp[10][1] = 3;
	EXPECT_BWD_REFUSED(APE_EINVAL, "dparams->shape[3] = 3",
			   dlbwd_run(self->dev, &c, &b, W_ALL, NULL));
	dlbwd_make(&b, &c, &g);
	b.t[7].device = (DLDevice){ kDLCUDA, 0 };
	EXPECT_BWD_REFUSED(APE_EINVAL, "dq->device", dlbwd_run(self->dev, &c, &b, W_ALL, NULL));
	dlbwd_make(&b, &c, &g);
	b.t[6].dtype = test_dl_dtype(APE_F16);
	EXPECT_BWD_REFUSED(APE_EINVAL, "dlse->dtype", dlbwd_run(self->dev, &c, &b, W_ALL, NULL));
	dlbwd_make(&b, &c, &g);
	b.t[8].data = b.t[0].data; /* dK over Q */
	EXPECT_BWD_REFUSED(APE_EINVAL, "dk overlaps q", dlbwd_run(self->dev, &c, &b, W_ALL, NULL));
	dlbwd_make(&b, &c, &g);
	EXPECT_BWD_REFUSED(APE_EINVAL, "stream", dlbwd_run(self->dev, &c, &b, W_ALL, &b));
	EXPECT_BWD_REFUSED(APE_EINVAL, "dq, dk, dv and dparams are all NULL",
			   dlbwd_run(self->dev, &c, &b, 0, NULL));
	EXPECT_BWD_REFUSED(APE_EINVAL, "lse = NULL",
			   ape_attention_backward_dlpack(self->dev, &c.tp.desc, &b.t[0], &b.t[1],
							 &b.t[2], &b.t[3], NULL, &b.t[5], NULL,
							 &b.t[7], NULL, NULL, NULL, NULL));
	EXPECT_TRUE(same_grads(&g, &untouched, W_ALL));
	grads_free(&g);
	grads_free(&untouched);
	bcase_free(&c);
}

/* kDLCUDA tensors (device memory of the emulated driver) on the legacy default stream: the
 * reference's gradients within the spec's tolerance. */
TEST(backward_cuda_tensors_on_the_emulated_driver)
{
#ifndef APE_HAVE_CUDA
	SKIP(return, "the CUDA backend is not built into this libape");
#else
	const test_problem_shape sh = { 1, 4, 2, 7, 11, 16 };
	struct cu cu = { 0 };
	void *cuctx = NULL, *ordinal = NULL, *popped;
	unsigned long long mem[11] = { 0 };
	size_t bytes[11];
	void *host[11];
	ape_context *ctx;
	ape_device *dev, *refdev;
	dlbwd b;
	grads want, got;
	ape_rng rng;
	bcase c;

	if (ape_test_slow())
		SKIP(return, "the emulator under valgrind is too slow; make sanitize runs it");
	ctx = emu_context(&dev, &refdev);
	ASSERT_NE(NULL, ctx);
	ASSERT_NE(NULL, dev) TH_LOG("no CUDA device from the emulated driver %s", EMU_LIB);
	ASSERT_EQ(0, ape_device_native(dev, &cuctx, &ordinal));
	ASSERT_NE(NULL, cuctx);
	ASSERT_TRUE(cu_open(&cu)) TH_LOG("%s: %s", EMU_LIB, dlerror());
	ape_rng_init(&rng, "backward_cuda_tensors");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F16, true, true, refdev));
	ASSERT_EQ(0, grads_alloc(&want, &c, APE_F16));
	ASSERT_EQ(0, grads_alloc(&got, &c, APE_F16));
	ASSERT_EQ(0, run_backward(&c, refdev, &want, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	dlbwd_make(&b, &c, &got);
	{ /* each tensor's whole host allocation to device memory, at the same offsets */
		const test_tensor *tt[11] = { &c.tp.q, &c.tp.k, &c.tp.v, &c.tp.o, NULL, &c.dout,
					      NULL, &got.dq, &got.dk, &got.dv, NULL };
		const size_t rows = c.tp.rows * sizeof(float);

		ASSERT_EQ(0, cu.push(cuctx));
		for (int i = 0; i < 11; i++) {
			host[i] = tt[i] ? tt[i]->alloc : b.t[i].data;
			bytes[i] = tt[i] ? tt[i]->alloc_bytes : i == 10 ? 4 * (size_t)sh.H * 4 : rows;
			ASSERT_EQ(0, cu.alloc(&mem[i], bytes[i]));
			ASSERT_EQ(0, cu.h2d(mem[i], host[i], bytes[i], NULL));
			b.t[i].byte_offset = (uint64_t)((char *)b.t[i].data - (char *)host[i]);
			b.t[i].data = (void *)(uintptr_t)mem[i];
			b.t[i].device = (DLDevice){ kDLCUDA, (int)(intptr_t)ordinal };
		}
		ASSERT_EQ(0, cu.sync(NULL));
	}
	ASSERT_EQ(0, dlbwd_run(dev, &c, &b, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	for (int i = 7; i < 11; i++) /* ordered after the work on the legacy stream */
		ASSERT_EQ(0, cu.d2h(host[i], mem[i], bytes[i], NULL));
	ASSERT_EQ(0, cu.sync(NULL));
	EXPECT_LE(grads_rel_err(&got.dq.t, &want.dq.t), grads_tol(APE_F16));
	EXPECT_LE(grads_rel_err(&got.dk.t, &want.dk.t), grads_tol(APE_F16));
	EXPECT_LE(grads_rel_err(&got.dv.t, &want.dv.t), grads_tol(APE_F16));
	EXPECT_LE(grads_rel_err_params(got.dparams, want.dparams, sh.H), grads_tol(APE_F16));
	for (int i = 0; i < 11; i++)
		if (mem[i])
			cu.free(mem[i]);
	cu.pop(&popped);
	grads_free(&want);
	grads_free(&got);
	bcase_free(&c);
	ape_context_destroy(ctx);
#endif
}

/* ---- docs/embedding.md's example */

/* The page shows docs/embed_example.c word for word. */
TEST(embedding_md_shows_embed_example_verbatim)
{
	char *doc = (char *)test_read_file(APE_SOURCE_DIR "/docs/embedding.md", NULL);
	char *example = (char *)test_read_file(APE_SOURCE_DIR "/docs/embed_example.c", NULL);

	ASSERT_NE(NULL, doc);
	ASSERT_NE(NULL, example);
	EXPECT_NE(NULL, strstr(doc, example))
	TH_LOG("docs/embedding.md's example differs from docs/embed_example.c");
	free(doc);
	free(example);
}

/* It runs: the application's own cl_context, queue and cl_mem objects, O as the host call's.
 * Exit 77: it cannot run on this machine or with this OpenCL backend (its message says why). */
TEST(embed_example_runs)
{
#ifndef APE_HAVE_OPENCL
	SKIP(return, "the OpenCL backend is not built into this libape: the example needs it");
#else
	char out[4096] = "", err[512] = "", cmd[512];
	FILE *p;
	int status;

	snprintf(cmd, sizeof(cmd), "%s/examples/embed_example 2>&1", APE_BUILD_DIR);
#ifdef __SANITIZE_ADDRESS__
	/* PoCL and LLVM keep allocations past exit (this test's child only) */
	setenv("LSAN_OPTIONS", "suppressions=" APE_SOURCE_DIR "/tests/lsan.supp", 1);
#endif
	p = popen(cmd, "r");
	ASSERT_NE(NULL, p);
	fread(out, 1, sizeof(out) - 1, p);
	status = pclose(p);
	ASSERT_TRUE(WIFEXITED(status)) TH_LOG("%s", out);
	if (WEXITSTATUS(status) == 77) {
		snprintf(err, sizeof(err), "%.500s", out);
		err[strcspn(err, "\n")] = 0;
		SKIP(return, "the example cannot run here: %s", err);
	}
	EXPECT_EQ(0, WEXITSTATUS(status)) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "max |O - host call|")) TH_LOG("%s", out);
#endif
}

TEST_HARNESS_MAIN
