/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_forward_dlpack() (include/ape/ape_dlpack.h) against ape_attention_forward() on
 * the same data: kDLCPU tensors on the reference, contiguous, [B, L, H, D] with padded rows,
 * slices of one packed QKV tensor, byte offsets, strided LSE, every dtype: results bit-identical
 * and no byte outside the outputs written. Every refusal: APE_EINVAL (APE_EOVERFLOW where the
 * sizes overflow) with a message naming the tensor. The diagnostics' twin likewise. (kDLOpenCL
 * and kDLCUDA tensors: test_dlpack_devices.c.)
 *
 * ape_attention_backward_dlpack() likewise: kDLCPU tensors (compact and [B, L, H, D] with
 * padding, every dtype, each subset of the outputs) against ape_attention_backward() on the
 * reference, bit for bit; its refusals. And docs/embedding.md's example, built and run.
 *
 * The ragged forms (ape_attention_forward_varlen_dlpack(), _backward_) on packed [total, H, D]
 * kDLCPU tensors (compact, padded rows, slices of one [T, 3, H, D] QKV buffer; GQA, empty
 * sequences, default, shifted and gapped positions, every dtype, LSE and dparams compact or
 * staged) against the host ragged calls on views built apart from the reader, bit for bit;
 * their refusals naming the tensor, nothing written. (kDLOpenCL: test_dlpack_devices.c.)
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

#include "dlpack_call.h"

static const char *const tname[5] = { "q", "k", "v", "o", "lse" };
/* O's allocations byte for byte (false, the first difference reported, when they differ). */
static bool same_o_bytes(struct __test_metadata *_metadata, const unsigned char *got,
			 const unsigned char *want, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		EXPECT_EQ(want[i], got[i]) TH_LOG("o differs at byte %zu of %zu", i, n);
		if (want[i] != got[i])
			return false;
	}
	return true;
}

/* O bit-identical (and every byte outside it untouched: both arenas started equal), LSE
 * bit-identical, its padding untouched. */
static void dlcall_compare(struct __test_metadata *_metadata, const struct dlcall *x)
{
	const struct dlcase *c = &x->c;

	if (!same_o_bytes(_metadata, x->out, x->out_ref, x->out_bytes))
		return;
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
/* ---- ragged batches: ape_attention_forward_varlen_dlpack(), _backward_ (struct rag:
 * dlpack_call.h) */

/* O bit-identical and every other byte of its allocation as it was; LSE bit-identical, its
 * padding untouched. */
static void rag_compare(struct __test_metadata *_metadata, const struct rag *x)
{
	if (!same_o_bytes(_metadata, x->out, x->out_ref, x->out_bytes))
		return;
	if (!x->with_lse)
		return;
	for (int64_t t = 0; t < x->tq; t++)
		for (int64_t h = 0; h < x->H; h++) {
			ASSERT_EQ(0, memcmp(rag_lse_at(x, t, h), &x->lse_ref[t * x->H + h], 4))
			TH_LOG("lse[%ld, %ld]: %g, host call %g", (long)t, (long)h,
			       *rag_lse_at(x, t, h), x->lse_ref[t * x->H + h]);
		}
	for (int64_t h = 0; x->strided_lse && h < x->H; h++) {
		ASSERT_EQ(1234.5f, x->lse[h * (x->tq + 2) + x->tq]) TH_LOG("lse padding written");
	}
}

/* Random batches of every dtype and layout, positions default, shifted and with gaps: the
 * host ragged call's results on the same data, bit for bit. */
static void rag_forward_cases(struct __test_metadata *_metadata, ape_device *dev, ape_rng *rng)
{
	static const ape_dtype dts[3] = { APE_F32, APE_F16, APE_BF16 };
	struct rag x;

	for (int i = 0; i < 18; i++) {
		rag_make(&x, rng, dts[i % 3], i % 3 == 1, i % 2 == 0, (enum rag_pos)(i / 2 % 3));
		ASSERT_EQ(0, rag_reference(dev, &x)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, rag_run(dev, &x, NULL)) TH_LOG("case %d: %s", i, ape_last_error());
		rag_compare(_metadata, &x);
		rag_free(&x);
	}
}

TEST_F(ref, varlen_forward_equals_host_call)
{
	rag_forward_cases(_metadata, self->dev, &self->rng);
}

/* The gradients of batch x (its forward done: O and LSE the host call's) by both calls: every
 * dtype, dQ, dK, dV float32 compact or dK with padded rows, dparams compact or head-minor
 * (staged), LSE as x's (maybe staged), dLSE or none; bit for bit, nothing else written. */
static void rag_backward_case(struct __test_metadata *_metadata, ape_device *dev, ape_rng *rng,
			      struct rag *x, bool strided, bool with_dlse)
{
	const int64_t H = x->H, G = x->G, D = x->D, tq = x->tq, tk = x->tk;
	const int64_t P = strided ? D + 2 : D;
	const size_t nq = (size_t)(tq * H * D), nk = (size_t)(tk * G * P);
	const size_t bytes = (nq + 2 * nk + 4 * (size_t)H + 8) * sizeof(float);
	float *g = malloc(bytes), *g_ref = malloc(bytes), *dlse = malloc((size_t)(tq * H + 1) * 4);
	unsigned char *dout = malloc((size_t)(tq * H * D + 1) * x->esz);
	const int64_t ks[3] = { G * P, P, 1 }, ps[2] = { 1, H };
	ape_tensor hd, hq, hk, hv;
	int64_t shp[6][3], str[6][3];
	DLTensor t[6]; /* dout, dlse, dq, dk, dv, dparams */

	ASSERT_NE(NULL, g);
	memset(g, 0x5a, bytes);
	memset(g_ref, 0x5a, bytes);
	fill(rng, dout, x->dt, (size_t)(tq * H * D));
	fill(rng, dlse, APE_F32, (size_t)(tq * H));
	ape_tensor_init_packed(&hd, dout, x->dt, tq, H, D);
	rag_view(&hq, g_ref, APE_F32, tq, H, D, H * D, D);
	rag_view(&hk, g_ref + nq, APE_F32, tk, G, D, G * P, P);
	rag_view(&hv, g_ref + nq + nk, APE_F32, tk, G, D, G * P, P);
	{
		const int64_t d3[6][3] = { { tq, H, D }, { tq, H, -1 }, { tq, H, D },
					   { tk, G, D }, { tk, G, D }, { H, 4, -1 } };
		void *at[6] = { dout, dlse, g, g + nq, g + nq + nk, g + nq + 2 * nk };
		const int64_t *s[6] = { NULL, NULL, NULL, strided ? ks : NULL, strided ? ks : NULL,
					strided ? ps : NULL };

		for (int i = 0; i < 6; i++) {
			memcpy(shp[i], d3[i], sizeof(shp[i]));
			if (s[i])
				memcpy(str[i], s[i], (d3[i][2] < 0 ? 2 : 3) * sizeof(int64_t));
			t[i] = (DLTensor){ .data = at[i], .device = { kDLCPU, 0 },
					   .ndim = d3[i][2] < 0 ? 2 : 3,
					   .dtype = test_dl_dtype(i == 0 ? x->dt : APE_F32),
					   .shape = shp[i], .strides = s[i] ? str[i] : NULL };
		}
	}
	ASSERT_EQ(0, ape_attention_backward_varlen(&dev, 1, NULL, &x->desc, &x->vl, &x->h[0],
						   &x->h[1], &x->h[2], &x->h[3], x->lse_ref, &hd,
						   with_dlse ? dlse : NULL, &hq, &hk, &hv,
						   g_ref + nq + 2 * nk, NULL))
	TH_LOG("%s", ape_last_error());
	/* dparams of the reference written head-minor: the layout the strided call's has */
	if (strided) {
		float tmp[4 * 8];

		ASSERT_LE(H, 8);
		memcpy(tmp, g_ref + nq + 2 * nk, (size_t)(4 * H) * sizeof(float));
		for (int64_t h = 0; h < H; h++)
			for (int c = 0; c < 4; c++)
				g_ref[nq + 2 * nk + (size_t)(c * H + h)] = tmp[h * 4 + c];
	}
	ASSERT_EQ(0, ape_attention_backward_varlen_dlpack(dev, &x->desc, &x->vl, &x->t[0],
							  &x->t[1], &x->t[2], &x->t[3], &x->t[4],
							  &t[0], with_dlse ? &t[1] : NULL, &t[2],
							  &t[3], &t[4], &t[5], NULL))
	TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(g, g_ref, bytes)) TH_LOG("gradients differ from the host call's");
	free(g);
	free(g_ref);
	free(dlse);
	free(dout);
}

TEST_F(ref, varlen_backward_equals_host_call)
{
	static const ape_dtype dts[3] = { APE_F32, APE_F16, APE_BF16 };
	struct rag x;

	for (int i = 0; i < 12; i++) {
		rag_make(&x, &self->rng, dts[i % 3], i % 4 == 1, i % 2 == 0,
			 (enum rag_pos)(i % 3));
		x.with_lse = true;
		ASSERT_EQ(0, rag_reference(self->dev, &x)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, rag_run(self->dev, &x, NULL)) TH_LOG("%s", ape_last_error());
		rag_compare(_metadata, &x);
		rag_backward_case(_metadata, self->dev, &self->rng, &x, i % 2 == 1, i % 3 != 2);
		rag_free(&x);
	}
}

#define EXPECT_VL_REFUSED(err, what, call)                                                         \
	EXPECT_REFUSED_BY("ape_attention_forward_varlen_dlpack", err, what, call)

/* A fixed valid batch (2 sequences, one of them empty in its queries, GQA), compact, LSE
 * compact or head-major. */
static void rag_fixed(struct rag *x, ape_rng *r, bool strided_lse)
{
	do {
		rag_make(x, r, APE_F32, false, false, RAG_DEFAULT);
		if (x->S >= 2 && x->tq >= 3 && x->tk >= 2 && x->H >= 2)
			break;
		rag_free(x);
	} while (1);
	x->with_lse = true;
	if (strided_lse != x->strided_lse) {
		const int64_t ls[2] = { 1, x->tq + 2 };

		x->strided_lse = strided_lse;
		free(x->lse);
		x->lse_len = (size_t)(strided_lse ? x->H * (x->tq + 2) : x->tq * x->H);
		x->lse = malloc((x->lse_len + 1) * sizeof(float));
		for (size_t i = 0; i < x->lse_len; i++)
			x->lse[i] = 1234.5f;
		rag_dl(x, 4, x->lse, 0, APE_F32, x->tq, x->H, -1, strided_lse ? ls : NULL);
	}
}

/* Each refusal names the argument and the value; nothing is written. */
TEST_F(ref, varlen_refusals_name_the_tensor)
{
	const DLDataType i32 = { kDLInt, 32, 1 }, f16 = { kDLFloat, 16, 1 };
	struct rag x;

#define VL_REFUSED(strided_lse, change, what)                                                      \
	do {                                                                                       \
		rag_fixed(&x, &self->rng, strided_lse);                                            \
		change;                                                                            \
		EXPECT_VL_REFUSED(APE_EINVAL, what, rag_run(self->dev, &x, NULL));                 \
		for (size_t i_ = 0; i_ < x.out_bytes; i_++)                                        \
			ASSERT_EQ(0x5a, x.out[i_]) TH_LOG("%s: o written", what);                  \
		for (size_t i_ = 0; i_ < x.lse_len; i_++)                                          \
			ASSERT_EQ(1234.5f, x.lse[i_]) TH_LOG("%s: lse written", what);             \
		rag_free(&x);                                                                      \
	} while (0)

	VL_REFUSED(false, x.t[0].ndim = 4, "q->ndim = 4: must be 3 ([total, H, D])");
	VL_REFUSED(false, x.t[3].ndim = 2, "o->ndim = 2: must be 3");
	VL_REFUSED(false, x.t[4].ndim = 3, "lse->ndim = 3: must be 2 ([total_q, H])");
	VL_REFUSED(false, x.shp[3][0]++, "o->shape[0] = ");
	VL_REFUSED(false, x.shp[3][1]++, "o->shape[1] = ");
	VL_REFUSED(false, x.shp[3][2] += 2, "o->shape[2] = ");
	VL_REFUSED(false, x.shp[1][2] += 2, "k->shape[2] = ");
	VL_REFUSED(false, x.shp[2][0]++, "v->shape[0] = ");
	VL_REFUSED(false, x.shp[2][1]++, "v->shape[1] = ");
	VL_REFUSED(false, x.shp[4][0]--, "lse->shape[0] = ");
	VL_REFUSED(true, x.shp[4][1]++, "lse->shape[1] = ");
	VL_REFUSED(false, x.t[4].dtype = f16, "lse->dtype = f16: must be float32");
	VL_REFUSED(false, x.t[0].dtype = i32, "q->dtype");
	VL_REFUSED(false, x.t[2].device.device_type = kDLCUDA, "v->device");
	VL_REFUSED(false, x.t[4].device.device_id = 1, "lse->device");
	VL_REFUSED(false, x.t[1].byte_offset += 2, "k->byte_offset");
	VL_REFUSED(false, x.cuq[x.S]++, "vl->cu_seqlens_q");
	VL_REFUSED(false, x.t[3].data = x.t[0].data, "o overlaps q");
	/* a staged LSE: its own checks, since the host call sees the stage */
	VL_REFUSED(true, x.str[4][1] = 0, "lse->strides[1]");
	VL_REFUSED(true, x.t[4].data = x.in, "lse overlaps q");
	VL_REFUSED(false, x.desc.k_start = 3, "desc->k_start");
	/* the packed problem's own checks name the [1, H, total, D] view's axes, and say so */
	VL_REFUSED(false, for (int i_ = 0; i_ < 4; i_++) x.shp[i_][2] = 3,
		   "q->shape[3] = 3: D must be even");
	VL_REFUSED(false, for (int i_ = 0; i_ < 4; i_++) x.shp[i_][2] = 3,
		   "view of a packed [total, H, D] tensor: 2 is total, 3 is D");
	rag_fixed(&x, &self->rng, false);
	EXPECT_VL_REFUSED(APE_EINVAL, "stream", rag_run(self->dev, &x, &x));
	EXPECT_VL_REFUSED(APE_EINVAL, "k = NULL",
			  ape_attention_forward_varlen_dlpack(self->dev, &x.desc, &x.vl, &x.t[0],
							      NULL, &x.t[2], &x.t[3], NULL, NULL));
	EXPECT_VL_REFUSED(APE_EINVAL, "vl = NULL",
			  ape_attention_forward_varlen_dlpack(self->dev, &x.desc, NULL, &x.t[0],
							      &x.t[1], &x.t[2], &x.t[3], NULL,
							      NULL));
	rag_free(&x);
#undef VL_REFUSED
}

#define EXPECT_VLB_REFUSED(what, call)                                                             \
	EXPECT_REFUSED_BY("ape_attention_backward_varlen_dlpack", APE_EINVAL, what, call)

/* The backward's refusals name the tensor; nothing is written. */
TEST_F(ref, varlen_backward_refusals_name_the_tensor)
{
	struct rag x;
	float *g, *dp;
	int64_t sh[6][3], st[2] = { 1, 0 };
	DLTensor t[6]; /* dout (x's q), dlse (x's lse), dq, dk, dv, dparams */

	rag_fixed(&x, &self->rng, false);
	ASSERT_EQ(0, rag_run(self->dev, &x, NULL)) TH_LOG("%s", ape_last_error());
	g = calloc((size_t)((x.tq * x.H + 2 * x.tk * x.G) * x.D), sizeof(float));
	dp = calloc((size_t)(4 * x.H), sizeof(float));
	memcpy(sh[2], x.shp[0], sizeof(sh[2]));
	memcpy(sh[3], x.shp[1], sizeof(sh[3]));
	memcpy(sh[4], x.shp[1], sizeof(sh[4]));
	sh[5][0] = x.H;
	sh[5][1] = 4;
	t[0] = x.t[0];
	t[1] = x.t[4];
	for (int i = 2; i < 6; i++)
		t[i] = (DLTensor){ .device = { kDLCPU, 0 }, .ndim = i == 5 ? 2 : 3,
				   .dtype = { kDLFloat, 32, 1 }, .shape = sh[i] };
	t[2].data = g;
	t[3].data = g + x.tq * x.H * x.D;
	t[4].data = g + (x.tq * x.H + x.tk * x.G) * x.D;
	t[5].data = dp;
#define VLB_CALL                                                                                   \
	ape_attention_backward_varlen_dlpack(self->dev, &x.desc, &x.vl, &x.t[0], &x.t[1],         \
					     &x.t[2], &x.t[3], &x.t[4], &t[0], &t[1], &t[2],       \
					     &t[3], &t[4], &t[5], NULL)
	t[5].ndim = 3;
	EXPECT_VLB_REFUSED("dparams->ndim = 3: must be 2 ([H, 4])", VLB_CALL);
	t[5].ndim = 2;
	sh[5][1] = 3;
	EXPECT_VLB_REFUSED("dparams->shape[1] = 3: must be 4", VLB_CALL);
	sh[5][1] = 4;
	sh[2][0]++;
	EXPECT_VLB_REFUSED("dq->shape[0] = ", VLB_CALL);
	sh[2][0]--;
	sh[3][1]++;
	EXPECT_VLB_REFUSED("dk->shape[1] = ", VLB_CALL);
	sh[3][1]--;
	t[1].dtype = (DLDataType){ kDLFloat, 16, 1 };
	EXPECT_VLB_REFUSED("dlse->dtype", VLB_CALL);
	t[1].dtype = (DLDataType){ kDLFloat, 32, 1 };
	t[4].data = g; /* dV over dQ */
	EXPECT_VLB_REFUSED("dv overlaps dq", VLB_CALL);
	t[4].data = g + (x.tq * x.H + x.tk * x.G) * x.D;
	t[5].strides = st; /* a staged dparams over dK */
	t[5].data = t[3].data;
	st[1] = x.H;
	EXPECT_VLB_REFUSED("dparams overlaps dk", VLB_CALL);
	t[5].data = dp;
	st[1] = 0; /* two heads' gradients at one address */
	EXPECT_VLB_REFUSED("dparams->strides[1]", VLB_CALL);
	t[5].strides = NULL;
	EXPECT_VLB_REFUSED("lse = NULL",
			   ape_attention_backward_varlen_dlpack(self->dev, &x.desc, &x.vl, &x.t[0],
								&x.t[1], &x.t[2], &x.t[3], NULL,
								&t[0], NULL, &t[2], NULL, NULL,
								NULL, NULL));
	EXPECT_VLB_REFUSED("dq, dk, dv and dparams are all NULL",
			   ape_attention_backward_varlen_dlpack(self->dev, &x.desc, &x.vl, &x.t[0],
								&x.t[1], &x.t[2], &x.t[3], &x.t[4],
								&t[0], NULL, NULL, NULL, NULL,
								NULL, NULL));
	for (int64_t i = 0; i < (x.tq * x.H + 2 * x.tk * x.G) * x.D; i++)
		ASSERT_EQ(0.0f, g[i]) TH_LOG("a gradient was written");
	for (int64_t i = 0; i < 4 * x.H; i++)
		ASSERT_EQ(0.0f, dp[i]) TH_LOG("dparams was written");
	/* and the valid call writes them */
	ASSERT_EQ(0, VLB_CALL) TH_LOG("%s", ape_last_error());
#undef VLB_CALL
	free(g);
	free(dp);
	rag_free(&x);
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
