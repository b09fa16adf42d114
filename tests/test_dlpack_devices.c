/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_forward_dlpack() on device tensors (include/ape/ape_dlpack.h), against the
 * host call on the same data: kDLOpenCL tensors (cl_mem objects the test creates on the
 * device's own cl_context, with libape's queue and with the test's own cl_command_queue) and
 * kDLCPU tensors on an OpenCL CPU device (PoCL); kDLCUDA tensors on the emulated driver (see
 * the tests for what runs where), and ape_attention_backward_dlpack() on them within the
 * spec's tolerance. The ragged forms on OpenCL: cl_mem tensors (packed, padded, QKV slices,
 * both queues) against the host ragged call within the tolerance, kDLCPU tensors bit for bit,
 * the ragged backward on cl_mem tensors against the host call, its refusal of gapped keys. (kDLCPU tensors on the reference:
 * test_dlpack.c.)
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
#include "core/backend.h"
#include "common/bwdcase.h"

#ifdef APE_HAVE_OPENCL
#include <CL/cl.h>
#endif

#include "dlpack_call.h"

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

/* ---- ragged batches on OpenCL (struct rag: dlpack_call.h) */

/* x's tensors moved into cl_mem objects (q, k, v one; o, lse each their own, poisoned as x's),
 * kDLOpenCL with their byte offsets; m[3] the objects. */
static int rag_to_cl(FIXTURE_DATA(ocl) * self, struct rag *x, cl_command_queue cq, cl_mem m[3])
{
	unsigned char *base[5] = { x->in, x->in, x->in, x->out, (unsigned char *)x->lse };
	ape_device_info info;

	ape_device_get_info(self->dev, &info);
	m[0] = cl_buffer_of(self->clctx, cq, x->in, x->in_bytes + 1);
	m[1] = cl_buffer_of(self->clctx, cq, x->out, x->out_bytes);
	m[2] = cl_buffer_of(self->clctx, cq, x->lse, (x->lse_len + 1) * sizeof(float));
	if (!m[0] || !m[1] || !m[2])
		return -1;
	for (int i = 0; i < 5; i++) {
		DLTensor *t = &x->t[i];

		t->byte_offset += (uint64_t)((unsigned char *)t->data - base[i]);
		t->data = m[i < 3 ? 0 : i - 2];
		t->device = (DLDevice){ kDLOpenCL, info.backend_index };
	}
	return 0;
}

static void rag_cl_free(cl_mem m[3])
{
	for (int i = 0; i < 3; i++)
		if (m[i])
			clReleaseMemObject(m[i]);
}

/*
 * Random batches (default, shifted and gapped positions; compact, padded and QKV slices; GQA; f32,
 * f16) as cl_mem tensors, with libape's queue and with the caller's: the host ragged call on
 * the same device within the spec's tolerance (another route: ape_attention_enqueue_varlen()),
 * no byte of O's allocation outside it written, LSE likewise (staged or not).
 */
TEST_F(ocl, varlen_cl_mem_tensors)
{
	cl_int err;
	cl_command_queue cq;

	if (!self->clctx)
		SKIP(return, "no native cl_context: no cl_mem tensors");
	cq = clCreateCommandQueue(self->clctx, self->cldev, 0, &err);
	ASSERT_NE(NULL, cq);
	for (int i = 0; i < 8; i++) {
		struct rag x;
		cl_mem m[3] = { NULL };
		unsigned char *poison;

		rag_make(&x, &self->rng, i % 4 == 3 ? APE_F16 : APE_F32, i % 3 == 1, i % 2 == 0,
			 (enum rag_pos)(i % 3));
		poison = malloc(x.out_bytes);
		memcpy(poison, x.out, x.out_bytes);
		ASSERT_EQ(0, rag_reference(self->dev, &x)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, rag_to_cl(self, &x, cq, m));
		ASSERT_EQ(0, rag_run(self->dev, &x, i % 2 ? cq : NULL))
		TH_LOG("case %d: %s", i, ape_last_error());
		ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[1], CL_TRUE, 0, x.out_bytes, x.out,
							  0, NULL, NULL));
		ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[2], CL_TRUE, 0,
							  x.lse_len * sizeof(float), x.lse, 0,
							  NULL, NULL));
		{
			ape_tensor got = x.h[3];
			const int64_t P = x.strided ? x.D + 3 : x.D;

			got.data = x.out + ((unsigned char *)x.h[3].data - x.out_ref);
			EXPECT_LE(test_max_err_o(&got, &x.h[3]),
				  test_tol_o(x.dt) * fmax(test_tensor_maxabs(&x.h[2]), 1e-30))
			TH_LOG("case %d", i);
			for (size_t b = 0; b < x.out_bytes; b++) {
				const size_t e = b / x.oesz;
				const bool in_o = x.strided ? (int64_t)(e % (size_t)P) < x.D : e >= 8;

				if (!in_o)
					ASSERT_EQ(poison[b], x.out[b]) TH_LOG("byte %zu written", b);
			}
		}
		for (int64_t t = 0; x.with_lse && t < x.tq; t++)
			for (int64_t h = 0; h < x.H; h++) {
				const float got = *rag_lse_at(&x, t, h), want = x.lse_ref[t * x.H + h];

				EXPECT_LE(test_max_err_lse(&got, &want, 1),
					  test_tol_lse(x.dt) * fmax(1, fabs(want)))
				TH_LOG("lse[%ld, %ld]: %g, host call %g", (long)t, (long)h, got, want);
			}
		for (int64_t h = 0; x.strided_lse && h < x.H; h++)
			ASSERT_EQ(1234.5f, x.lse[h * (x.tq + 2) + x.tq]);
		rag_cl_free(m);
		free(poison);
		rag_free(&x);
	}
	clReleaseCommandQueue(cq);
}

/* kDLCPU tensors on the OpenCL device: the host ragged call there, bit for bit, gaps too. */
TEST_F(ocl, varlen_cpu_tensors_on_opencl)
{
	for (int i = 0; i < 3; i++) {
		struct rag x;

		rag_make(&x, &self->rng, APE_F32, i == 1, i == 2, (enum rag_pos)i);
		ASSERT_EQ(0, rag_reference(self->dev, &x)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, rag_run(self->dev, &x, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, memcmp(x.out, x.out_ref, x.out_bytes));
		for (int64_t t = 0; x.with_lse && t < x.tq; t++)
			for (int64_t h = 0; h < x.H; h++)
				ASSERT_EQ(0, memcmp(rag_lse_at(&x, t, h), &x.lse_ref[t * x.H + h], 4));
		rag_free(&x);
	}
}

/*
 * The ragged backward on cl_mem tensors (ape_attention_backward_varlen_dlpack() ->
 * ape_attention_backward_enqueue_varlen()): q, k, v, o and lse as the forward's cl_mem tensors
 * holding the host forward's O and LSE; dout (q's type), dlse, and float32 dq, dk, dv and
 * dparams in one more cl_mem at their offsets; libape's queue and the caller's. Default and
 * shifted positions: the host call ape_attention_backward_varlen() on the same device within
 * the spec's tolerance. Gapped key positions: refused naming vl->pos_k (APE_ENOTSUP), nothing
 * written.
 */
TEST_F(ocl, varlen_backward_cl_mem_tensors)
{
	cl_int err;
	cl_command_queue cq;

	if (!self->clctx)
		SKIP(return, "no native cl_context: no cl_mem tensors");
	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_RESIDENT_BACKWARD))
		SKIP(return, "%s has no backward pass on device tensors (no float64)",
		     self->dev->info.name);
	cq = clCreateCommandQueue(self->clctx, self->cldev, 0, &err);
	ASSERT_NE(NULL, cq);
	for (int i = 0; i < 9; i++) {
		const enum rag_pos pos = (enum rag_pos)(i % 3);
		struct rag x;
		cl_mem m[3] = { NULL }, gm;
		int64_t H, G, D, tq, tk;
		size_t nd, nq, nk, at[6], bytes;
		unsigned char *g, *back;
		float *ref;
		DLTensor t[6]; /* dout, dlse, dq, dk, dv, dparams */
		int64_t shp[6][3];
		ape_tensor hq, hk, hv, hd, gq, gk, gv;
		int ret;

		do {
			rag_make(&x, &self->rng, i % 4 == 3 ? APE_F16 : APE_F32, i % 3 == 1,
				 i % 2 == 0, pos);
			bool gapped = pos != RAG_GAPS;

			/* RAG_GAPS must give a query run that sees a gap: the call refuses it */
			for (int64_t s = 0; s < x.S && !gapped; s++)
				gapped = x.cuq[s + 1] > x.cuq[s] && x.cuk[s + 1] - x.cuk[s] >= 2;
			if (x.tq > 0 && x.tk > 0 && x.H <= 8 && gapped)
				break;
			rag_free(&x);
		} while (1);
		H = x.H, G = x.G, D = x.D, tq = x.tq, tk = x.tk;
		x.with_lse = true;
		if (pos == RAG_GAPS)
			x.desc.causal = false; /* every query sees its sequence's gapped keys */
		ASSERT_EQ(0, rag_reference(self->dev, &x)) TH_LOG("%s", ape_last_error());
		memcpy(x.out, x.out_ref, x.out_bytes); /* the forward's O and LSE, the inputs */
		for (int64_t r = 0; r < tq; r++)
			for (int64_t h = 0; h < H; h++)
				*rag_lse_at(&x, r, h) = x.lse_ref[r * H + h];
		/* one allocation: dout | dlse | dq | dk | dv | dparams, then the reference's */
		nd = (size_t)(tq * H * D) * x.esz;
		nq = (size_t)(tq * H * D) * 4;
		nk = (size_t)(tk * G * D) * 4;
		at[0] = 0;
		at[1] = (nd + 15) & ~(size_t)15;
		at[2] = at[1] + (size_t)(tq * H) * 4;
		at[3] = at[2] + nq;
		at[4] = at[3] + nk;
		at[5] = at[4] + nk;
		bytes = at[5] + (size_t)(4 * H) * 4;
		g = malloc(bytes + 1);
		back = malloc(bytes + 1);
		ref = malloc(bytes + 1);
		ASSERT_TRUE(g && back && ref);
		memset(g, 0xff, bytes); /* NaN gradients until written */
		fill(&self->rng, g, x.dt, (size_t)(tq * H * D));
		fill(&self->rng, g + at[1], APE_F32, (size_t)(tq * H));
		{
			const int64_t d3[6][3] = { { tq, H, D }, { tq, H, -1 }, { tq, H, D },
						   { tk, G, D }, { tk, G, D }, { H, 4, -1 } };

			for (int k = 0; k < 6; k++) {
				memcpy(shp[k], d3[k], sizeof(shp[k]));
				t[k] = (DLTensor){ .device = { kDLCPU, 0 },
						   .ndim = d3[k][2] < 0 ? 2 : 3,
						   .dtype = test_dl_dtype(k == 0 ? x.dt : APE_F32),
						   .shape = shp[k], .byte_offset = at[k] };
			}
		}
		/* the host call on the same device, into ref's dq, dk, dv, dparams */
		memcpy(ref, g, bytes);
		ape_tensor_init_packed(&hd, g, x.dt, tq, H, D);
		ape_tensor_init_packed(&hq, (unsigned char *)ref + at[2], APE_F32, tq, H, D);
		ape_tensor_init_packed(&hk, (unsigned char *)ref + at[3], APE_F32, tk, G, D);
		ape_tensor_init_packed(&hv, (unsigned char *)ref + at[4], APE_F32, tk, G, D);
		if (pos != RAG_GAPS)
			ASSERT_EQ(0, ape_attention_backward_varlen(
					     &self->dev, 1, NULL, &x.desc, &x.vl, &x.h[0], &x.h[1],
					     &x.h[2], &x.h[3], x.lse_ref, &hd,
					     (float *)(g + at[1]), &hq, &hk, &hv,
					     (float *)((unsigned char *)ref + at[5]), NULL))
			TH_LOG("the host call: %s", ape_last_error());
		ASSERT_EQ(0, rag_to_cl(self, &x, cq, m));
		gm = cl_buffer_of(self->clctx, cq, g, bytes);
		ASSERT_NE(NULL, gm);
		{
			ape_device_info info;

			ape_device_get_info(self->dev, &info);
			for (int k = 0; k < 6; k++) {
				t[k].data = gm;
				t[k].device = (DLDevice){ kDLOpenCL, info.backend_index };
			}
		}
		ret = ape_attention_backward_varlen_dlpack(self->dev, &x.desc, &x.vl, &x.t[0],
							   &x.t[1], &x.t[2], &x.t[3], &x.t[4],
							   &t[0], &t[1], &t[2], &t[3], &t[4],
							   &t[5], i % 2 ? cq : NULL);
		ASSERT_EQ(CL_SUCCESS, clFinish(cq));
		ASSERT_EQ(CL_SUCCESS,
			  clEnqueueReadBuffer(cq, gm, CL_TRUE, 0, bytes, back, 0, NULL, NULL));
		if (pos == RAG_GAPS) {
			EXPECT_EQ(APE_ENOTSUP, ret) TH_LOG("%s", ape_last_error());
			EXPECT_NE(NULL, strstr(ape_last_error(),
					       "ape_attention_backward_varlen_dlpack: vl->pos_k"))
			TH_LOG("%s", ape_last_error());
			EXPECT_EQ(0, memcmp(back, g, bytes)) TH_LOG("case %d: written", i);
		} else {
			ASSERT_EQ(0, ret) TH_LOG("case %d: %s", i, ape_last_error());
			ape_tensor_init_packed(&gq, back + at[2], APE_F32, tq, H, D);
			ape_tensor_init_packed(&gk, back + at[3], APE_F32, tk, G, D);
			ape_tensor_init_packed(&gv, back + at[4], APE_F32, tk, G, D);
			EXPECT_LE(grads_rel_err(&gq, &hq), grads_tol(x.dt)) TH_LOG("case %d: dq", i);
			EXPECT_LE(grads_rel_err(&gk, &hk), grads_tol(x.dt)) TH_LOG("case %d: dk", i);
			EXPECT_LE(grads_rel_err(&gv, &hv), grads_tol(x.dt)) TH_LOG("case %d: dv", i);
			EXPECT_LE(grads_rel_err_params((const float *)(back + at[5]),
						       (const float *)((unsigned char *)ref + at[5]),
						       H),
				  grads_tol(x.dt))
			TH_LOG("case %d: dparams", i);
			/* dout and dlse are inputs: untouched */
			EXPECT_EQ(0, memcmp(back, g, at[2])) TH_LOG("case %d: inputs written", i);
		}
		clReleaseMemObject(gm);
		rag_cl_free(m);
		free(g);
		free(back);
		free(ref);
		rag_free(&x);
	}
	clReleaseCommandQueue(cq);
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

TEST_HARNESS_MAIN
