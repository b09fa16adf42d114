/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend on the caller's memory and streams (issue 12), with no GPU: the fake driver
 * of tests/fake_cuda built with the emulator (cuda/emu) runs the real kernels on the CPU and logs
 * what reaches cuLaunchKernel (fake_cuda.h).
 *
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
 *   (strided launches: test_cuda_resident.c)
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
	const struct ape_backend_plugin *ops;
	struct ape_be_buf *own = NULL, *w = NULL;
	struct ape_be_queue *q = NULL;
	unsigned char data[512], back[512];
	size_t got = 0;
	struct devs d;
	int ret;

	open_devs(_metadata, &d);
	ops = d.cuda->be->ops;
	ASSERT_EQ(0, ops->buf_alloc(d.cuda, 4096, &own));
	ASSERT_EQ(0, ops->queue_create(d.cuda, &q));

	/* inside: a window of the allocation, usable by every op */
	ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA, (void *)(uintptr_t)(own->ptr + 1024), 512,
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
	ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA, (void *)(uintptr_t)own->ptr, 4096, &w,
				   &got));
	ops->buf_free(d.cuda, w);
	memset(back, 0, sizeof(back));
	EXPECT_EQ(0, ops->copy_d2h(q, back, own, 1024, sizeof(back))) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ops->synchronize(q));
	EXPECT_EQ(0, memcmp(data, back, sizeof(data)));

	/* past the end: refused, with the addresses */
	w = (struct ape_be_buf *)1;
	ret = ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA, (void *)(uintptr_t)(own->ptr + 4000), 97, &w, &got);
	EXPECT_EQ(APE_EINVAL, ret);
	EXPECT_EQ(NULL, w);
	EXPECT_EQ(0u, got);
	TH_LOG("past the end: %s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "runs past its allocation"));
	EXPECT_NE(NULL, strstr(ape_last_error(), "buf_wrap"));
	/* not device memory at all */
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA, (void *)data, 16, &w, &got));
	TH_LOG("host pointer: %s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "not device memory"));
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA, NULL, 16, &w, &got));
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA, (void *)(uintptr_t)own->ptr, 0,
					    &w, &got));
	/* kinds a CUDA device does not drive */
	EXPECT_EQ(APE_ENOTSUP, ops->buf_wrap(d.cuda, APE_BE_MEM_HOST, data, 16, &w, &got));
	TH_LOG("host kind: %s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "host memory"));
	EXPECT_NE(NULL, strstr(ape_last_error(), d.cuda->info.name));
	EXPECT_EQ(APE_ENOTSUP, ops->buf_wrap(d.cuda, APE_BE_MEM_OPENCL, data, 16, &w, &got));
	EXPECT_NE(NULL, strstr(ape_last_error(), "OpenCL memory"));
	EXPECT_EQ(NULL, w);

	ops->queue_destroy(q);
	ops->buf_free(d.cuda, own);
	ape_context_destroy(d.ctx);
}

/* Without cuMemGetAddressRange nothing can be checked, so nothing is wrapped. */
TEST(buf_wrap_without_the_driver_symbol)
{
	struct ape_be_buf *own = NULL, *w = NULL;
	size_t got;
	struct devs d;

	setenv("FAKE_CUDA_MODE", "missing-optional", 1);
	open_devs(_metadata, &d);
	ASSERT_EQ(0, d.cuda->be->ops->buf_alloc(d.cuda, 256, &own));
	EXPECT_EQ(APE_ENOTSUP, d.cuda->be->ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA,
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
	const struct ape_backend_plugin *ops;
	struct ape_be_buf *own[4] = { NULL }, *w[4] = { NULL };
	const struct fake_launch_rec *log;
	struct ape_be_queue *wq = NULL;
	struct ape_be_event *e0 = NULL, *e1 = NULL;
	struct ape_be_launch l;
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
		ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA,
					   (void *)(uintptr_t)(own[t]->ptr + 256), bytes, &w[t], &got));
		ASSERT_EQ(0, ops->fill(wq, w[t], 0, 0u, bytes & ~(size_t)3));
		l.view[t] = (struct ape_be_view){ 8, 0, c.D, (kv ? c.Hkv : c.H) * c.D };
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
	struct ape_be_queue *q = (struct ape_be_queue *)1;
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
	const struct ape_backend_plugin *ops;
	struct ape_be_buf *own = NULL, *w = NULL;
	struct ape_be_queue *q = NULL;
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
	ASSERT_EQ(0, ops->buf_wrap(d.cuda, APE_BE_MEM_CUDA, (void *)(uintptr_t)(own->ptr + 2), 60000,
				   &w, &got));
	in.l.q = in.l.k = in.l.v = own;
	in.l.o = w; /* float32 O two bytes off */
	for (int t = 0; t < 4; t++)
		in.l.view[t] = ape_be_launch_view(&in.l, t); /* the contiguous views */
	in.l.strided = true;
	in.l.view[APE_BE_T_O].off = 64;
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
	const struct ape_backend_plugin *ops;
	struct ape_be_buf *own = NULL, *w = (struct ape_be_buf *)1;
	struct ape_be_queue *q = (struct ape_be_queue *)1;
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
	EXPECT_EQ(APE_EINVAL, ops->buf_wrap(g[0], APE_BE_MEM_CUDA, (void *)(uintptr_t)own->ptr, 1024,
					    &w, &got));
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "memory of CUDA device 1, not of device 0"));
	EXPECT_EQ(NULL, w);
	EXPECT_EQ(0, ops->buf_wrap(g[1], APE_BE_MEM_CUDA, (void *)(uintptr_t)own->ptr, 1024, &w, &got));
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

CUDA_RESIDENT_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the CUDA backend is not built into this libape")
#endif /* APE_HAVE_CUDA */
