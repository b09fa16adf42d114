/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend on the caller's queues and context (issue 12; core/backend.h, ABI 5):
 * queue_wrap of the test's own queues, whose order libape keeps; a context built on the test's
 * own cl_context; and, through the public API (ape_attention_enqueue() and
 * ape_attention_backward_enqueue() on the test's context, queue and cl_mem objects), the same
 * against the host call, bit for bit. (Strided launches and buf_wrap: test_opencl_interop.c;
 * the shared pieces: opencl_interop.h.)
 *
 * The test links libOpenCL itself (the same ICD loader libape opens, so the objects are shared).
 * Without an OpenCL device the program skips (exit 4) with the reason.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"
#include "../opencl/ocl_debug.h"
#include "common/bwdcase.h"
#include "common/problem.h"

#include "opencl_interop.h"

#ifdef APE_HAVE_OPENCL

/* ---- queue_wrap */

TEST(wrap_queue_refusals_and_no_timing)
{
	struct dev t;
	struct ape_be_queue *q;
	struct ape_be_event *e0 = NULL, *e1 = NULL;
	cl_command_queue ooo, plain, foreign;
	cl_context other;
	cl_int err;
	double ms = 1;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ooo = clCreateCommandQueue(t.cctx, t.cdev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
	if (ooo) {
		q = (struct ape_be_queue *)&err;
		EXPECT_EQ(APE_EINVAL, t.ops->queue_wrap(t.d, ooo, &q));
		EXPECT_EQ(NULL, q);
		EXPECT_NE(NULL, strstr(ape_last_error(), "out of order")) TH_LOG("%s",
										  ape_last_error());
		clReleaseCommandQueue(ooo);
	} else {
		TH_LOG("the device makes no out-of-order queue (%d): that refusal is unchecked",
		       (int)err);
	}
	other = clCreateContext(NULL, 1, &t.cdev, NULL, NULL, &err);
	ASSERT_NE(NULL, other);
	foreign = clCreateCommandQueue(other, t.cdev, 0, &err);
	ASSERT_NE(NULL, foreign);
	EXPECT_EQ(APE_EINVAL, t.ops->queue_wrap(t.d, foreign, &q));
	EXPECT_NE(NULL, strstr(ape_last_error(), "cl_context")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_EINVAL, t.ops->queue_wrap(t.d, NULL, &q));
	clReleaseCommandQueue(foreign);
	clReleaseContext(other);

	/* in order, no profiling: works, but says it cannot time */
	plain = clCreateCommandQueue(t.cctx, t.cdev, 0, &err);
	ASSERT_NE(NULL, plain);
	ASSERT_EQ(0, t.ops->queue_wrap(t.d, plain, &q));
	ASSERT_EQ(0, t.ops->event_record(q, &e0));
	ASSERT_EQ(0, t.ops->event_record(q, &e1));
	EXPECT_EQ(0, t.ops->synchronize(q));
	EXPECT_EQ(APE_ENOTSUP, t.ops->event_elapsed(e0, e1, &ms));
	EXPECT_EQ(0.0, ms);
	EXPECT_NE(NULL, strstr(ape_last_error(), "PROFILING")) TH_LOG("%s", ape_last_error());
	if (t.ops->event_timestamp) {
		ms = 1;
		EXPECT_EQ(APE_ENOTSUP, t.ops->event_timestamp(e1, &ms));
		EXPECT_EQ(0.0, ms);
	}
	t.ops->event_destroy(e0);
	t.ops->event_destroy(e1);
	t.ops->queue_destroy(q);
	EXPECT_EQ(1, refs_when(OBJ_QUEUE, plain, 1)); /* libape let go of it, and only of its own hold */
	clReleaseCommandQueue(plain);
	dev_close(&t);
}

/*
 * The caller's order on its own queue: the test's writes of Q, K and V are held back by a user
 * event until libape's launch is enqueued behind them; the test's read of O comes after. Were
 * libape's kernels on a queue of their own, they would read the NaN the buffers hold before.
 */
TEST(wrapped_queue_keeps_the_callers_order)
{
	struct kase c = { .B = 1, .H = 2, .Hkv = 2, .Lq = 40, .Lk = 40, .D = 64, .dt = APE_F32,
			  .odt = APE_F32, .causal = true };
	const size_t no = (size_t)(c.B * c.H * c.Lq * c.D), nl = (size_t)(c.B * c.H * c.Lq);
	struct dev t;
	struct inputs in = { 0 };
	struct ape_be_launch l;
	struct ape_be_queue *q = NULL;
	struct ape_be_buf *b[APE_BE_T_COUNT] = { 0 };
	cl_mem m[APE_BE_T_COUNT];
	cl_command_queue cq;
	cl_event gate;
	cl_int err;
	const cl_uint nan_bits = 0xffffffffu;
	float prm[8], *o = malloc(no * 4), *o_ref = malloc(no * 4), *lse = malloc(nl * 4),
		      *lse_ref = malloc(nl * 4);
	size_t got;
	ape_rng rng;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ape_rng_init(&rng, "wrapped_queue_keeps_the_callers_order");
	ASSERT_EQ(0, inputs_make(&in, &c, &rng));
	head_params(prm, c.H);
	ASSERT_EQ(0, run_contiguous(_metadata, &t, &c, &in, prm, o_ref, lse_ref));

	cq = clCreateCommandQueue(t.cctx, t.cdev, 0, &err);
	ASSERT_NE(NULL, cq);
	gate = clCreateUserEvent(t.cctx, &err);
	ASSERT_NE(NULL, gate);
	for (int i = 0; i < APE_BE_T_COUNT; i++) {
		const size_t bytes = i < 3 ? in.n[i] * 4 : i == APE_BE_T_O ? no * 4 : nl * 4;

		m[i] = clCreateBuffer(t.cctx, CL_MEM_READ_WRITE, bytes, NULL, &err);
		ASSERT_NE(NULL, m[i]);
		ASSERT_EQ(CL_SUCCESS, clEnqueueFillBuffer(cq, m[i], &nan_bits, 4, 0, bytes, 0, NULL,
							  NULL));
		ASSERT_EQ(CL_SUCCESS, clFinish(cq));
		ASSERT_EQ(0, t.ops->buf_wrap(t.d, APE_BE_MEM_OPENCL, m[i], 0, &b[i], &got));
	}
	for (int i = 0; i < 3; i++)
		ASSERT_EQ(CL_SUCCESS, clEnqueueWriteBuffer(cq, m[i], CL_FALSE, 0, in.n[i] * 4,
							   in.x[i], 1, &gate, NULL));
	ASSERT_EQ(0, t.ops->queue_wrap(t.d, cq, &q));
	make_launch(&l, &c, prm);
	l.q = b[APE_BE_T_Q];
	l.k = b[APE_BE_T_K];
	l.v = b[APE_BE_T_V];
	l.o = b[APE_BE_T_O];
	l.lse = b[APE_BE_T_LSE];
	ASSERT_EQ(0, t.ops->attention(q, &l)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[APE_BE_T_O], CL_FALSE, 0, no * 4, o, 0, NULL,
						  NULL));
	ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[APE_BE_T_LSE], CL_FALSE, 0, nl * 4, lse, 0,
						  NULL, NULL));
	/* libape's buffers and queue wrappers may go before the work is done */
	t.ops->queue_destroy(q);
	for (int i = 0; i < APE_BE_T_COUNT; i++)
		t.ops->buf_free(t.d, b[i]);
	ASSERT_EQ(CL_SUCCESS, clSetUserEventStatus(gate, CL_COMPLETE));
	ASSERT_EQ(CL_SUCCESS, clFinish(cq));
	EXPECT_EQ(0, memcmp(o, o_ref, no * 4));
	EXPECT_EQ(0, memcmp(lse, lse_ref, nl * 4));
	clReleaseEvent(gate);
	for (int i = 0; i < APE_BE_T_COUNT; i++)
		clReleaseMemObject(m[i]);
	clReleaseCommandQueue(cq);
	inputs_free(&in);
	free(o);
	free(o_ref);
	free(lse);
	free(lse_ref);
	dev_close(&t);
}

/* A long-lived queue holds the events of the commands still in flight only, while no event of
 * it is alive; with one alive, it keeps them all (the event's timing needs them). */
TEST(long_lived_queue_drops_completed_commands)
{
	struct dev t;
	struct ape_be_queue *q;
	struct ape_be_buf *b;
	struct ape_be_event *e;
	static float x[1024];

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, t.ops->queue_create(t.d, &q));
	ASSERT_EQ(0, t.ops->buf_alloc(t.d, sizeof(x), &b));
	for (int i = 0; i < 1000; i++) {
		ASSERT_EQ(0, t.ops->copy_h2d(q, b, 0, x, sizeof(x)));
		if (i % 100 == 99)
			ASSERT_EQ(0, t.ops->synchronize(q));
	}
	EXPECT_EQ(0, ape__ocl_debug_tracked(q));
	ASSERT_EQ(0, t.ops->event_record(q, &e));
	for (int i = 0; i < 300; i++)
		ASSERT_EQ(0, t.ops->copy_h2d(q, b, 0, x, sizeof(x)));
	ASSERT_EQ(0, t.ops->synchronize(q));
	EXPECT_EQ(300, ape__ocl_debug_tracked(q));
	t.ops->event_destroy(e);
	for (int i = 0; i < 300; i++) /* completed ones are dropped as new ones come */
		ASSERT_EQ(0, t.ops->copy_h2d(q, b, 0, x, sizeof(x)));
	EXPECT_LT(ape__ocl_debug_tracked(q), 600);
	ASSERT_EQ(0, t.ops->synchronize(q));
	EXPECT_EQ(0, ape__ocl_debug_tracked(q));
	t.ops->buf_free(t.d, b);
	t.ops->queue_destroy(q);
	dev_close(&t);
}

/* ---- the caller's cl_context */

static ape_device *device_of(ape_context *ctx, cl_device_id id, void **native_ctx)
{
	ape_device *devs[16];
	const int n = ape_device_list(ctx, devs, 16);

	for (int i = 0; i < n && i < 16; i++) {
		ape_device *d = devs[i];
		void *c = NULL, *dv = NULL;

		if (d && d->be->ops->native && !strcmp(d->info.backend, "opencl")) {
			d->be->ops->native(d, &c, &dv);
			if (dv == (void *)id) {
				*native_ctx = c;
				return d;
			}
		}
	}
	return NULL;
}

/* A cl_context of the test's own on t's device, and a libape context built on it
 * (ape_context_options.opencl_context and .opencl_device). 0, or -1 after logging. */
static int import_context(struct __test_metadata *_metadata, const struct dev *t,
			  cl_context *mine, ape_context **ctx)
{
	ape_context_options o;
	cl_int err;

	*ctx = NULL;
	*mine = clCreateContext(NULL, 1, &t->cdev, NULL, NULL, &err);
	if (!*mine) {
		TH_LOG("clCreateContext: %d", (int)err);
		return -1;
	}
	ape_context_options_init(&o);
	o.backends = "opencl";
	o.opencl_context = *mine;
	o.opencl_device = t->cdev;
	if (ape_context_create(ctx, &o)) {
		TH_LOG("ape_context_create on the test's cl_context: %s", ape_last_error());
		return -1;
	}
	return 0;
}

TEST(context_on_the_callers_cl_context)
{
	struct dev t;
	ape_context *ctx = NULL;
	ape_device *d;
	void *nctx = NULL;
	cl_context mine;
	cl_mem m;
	cl_int err;
	struct ape_be_buf *b;
	struct ape__ocl_debug_counters cnt;
	size_t got;
	int held;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, import_context(_metadata, &t, &mine, &ctx));
	d = device_of(ctx, t.cdev, &nctx);
	ASSERT_NE(NULL, d);
	EXPECT_EQ((void *)mine, nctx);
	/* libape holds one; each program the context loaded from the cache when it was created
	 * (APE_OCL_PRELOAD) holds one too, as every cl_program holds its cl_context */
	ASSERT_EQ(0, ape__ocl_debug_counters(d, &cnt));
	held = 2 + (int)cnt.preloads;
	EXPECT_EQ(held, refs_when(OBJ_CONTEXT, mine, held));
	/* a cl_mem of that context is the device's; one of the first context's is not */
	m = clCreateBuffer(mine, CL_MEM_READ_WRITE, 256, NULL, &err);
	ASSERT_NE(NULL, m);
	ASSERT_EQ(0, d->be->ops->buf_wrap(d, APE_BE_MEM_OPENCL, m, 0, &b, &got));
	EXPECT_EQ(256, got);
	d->be->ops->buf_free(d, b);
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE_BE_MEM_OPENCL, m, 0, &b, &got));
	clReleaseMemObject(m);
	ape_context_destroy(ctx);
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, mine, 1)); /* given back, and only that */
	clReleaseContext(mine);
	dev_close(&t);
}

/*
 * A device that is not one of the context's fails ape_context_create with APE_EINVAL, naming it,
 * and leaves the context as it was. The device not in the context is a sub-device of the one
 * that is (clCreateSubDevices): the only other device a one-device machine has. (A context
 * made on a sub-device cannot be imported on PoCL 3.1, which lists the root device as that
 * context's, CL_CONTEXT_DEVICES.)
 */
TEST(context_import_of_a_device_not_in_the_context)
{
	struct dev t;
	ape_context_options o;
	ape_context *ctx = NULL;
	cl_device_id sub[64];
	cl_uint nsub = 0, cu = 0;
	cl_context root_ctx;
	cl_int err;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	clGetDeviceInfo(t.cdev, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(cu), &cu, NULL);
	{
		const cl_device_partition_property props[] = {
			CL_DEVICE_PARTITION_EQUALLY, (cl_device_partition_property)(cu > 1 ? cu / 2 : 1),
			0
		};

		err = clCreateSubDevices(t.cdev, props, 64, sub, &nsub);
	}
	if (err != CL_SUCCESS || nsub == 0) {
		dev_close(&t);
		SKIP(return, "the device makes no sub-devices (clCreateSubDevices: %d)", (int)err);
	}
	root_ctx = clCreateContext(NULL, 1, &t.cdev, NULL, NULL, &err);
	ASSERT_NE(NULL, root_ctx);
	ape_context_options_init(&o);
	o.backends = "opencl";
	o.opencl_context = root_ctx;
	o.opencl_device = sub[0];
	EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, &o));
	EXPECT_EQ(NULL, ctx);
	EXPECT_NE(NULL, strstr(ape_last_error(), "opencl_device")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, root_ctx, 1));
	if (ctx)
		ape_context_destroy(ctx);
	clReleaseContext(root_ctx);
	for (cl_uint i = 0; i < nsub && i < 64; i++)
		clReleaseDevice(sub[i]);
	dev_close(&t);
}

/* ---- through the public API */

struct gate_watch {
	cl_event gate;
	atomic_int opened_by_watchdog;
	atomic_int stop;
};

/* Opens the gate after 20 s if the test has not: a call that waited on the caller's queue
 * would otherwise wait forever. */
static void *gate_watchdog(void *arg)
{
	struct gate_watch *w = arg;

	for (int i = 0; i < 2000 && !atomic_load(&w->stop); i++)
		usleep(10000);
	if (!atomic_load(&w->stop)) {
		atomic_store(&w->opened_by_watchdog, 1);
		clSetUserEventStatus(w->gate, CL_COMPLETE);
	}
	return NULL;
}

/*
 * ape_context_options.opencl_context/opencl_device from the test's own clCreateContext: the
 * device reports that context (ape_device_native); ape_attention_enqueue() on the test's own
 * queue and cl_mem objects equals the host call bit for bit, and keeps its place in the queue:
 * the test's writes of Q, K and V, held back by a user event, come before libape's kernels, its
 * reads of O and LSE after them. ape_attention_enqueue() itself must not wait for the gate.
 */
TEST(public_api_on_the_callers_context_and_queue)
{
	const test_problem_shape sh = { 2, 4, 2, 37, 53, 64 };
	const cl_uint nan_bits = 0xffffffffu;
	struct dev t;
	ape_context *ctx = NULL;
	ape_device *devs[16], *d = NULL;
	ape_queue *qu = NULL;
	ape_buffer *bufs[5] = { 0 };
	ape_dtensor dt[5];
	cl_mem m[5];
	cl_context mine;
	cl_command_queue cq;
	struct gate_watch w = { 0 };
	pthread_t watchdog;
	test_problem a, b;
	size_t bytes[5];
	void *host[5];
	cl_int err;
	ape_rng rng;
	int n;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, import_context(_metadata, &t, &mine, &ctx));
	n = ape_device_list(ctx, devs, 16);
	for (int i = 0; i < n && i < 16 && !d; i++) {
		void *c = NULL, *dv = NULL;

		ASSERT_EQ(0, ape_device_native(devs[i], &c, &dv));
		if (dv == (void *)t.cdev) {
			EXPECT_EQ((void *)mine, c);
			d = devs[i];
		}
	}
	ASSERT_NE(NULL, d) TH_LOG("no device of the context reports the test's cl_device_id");

	ape_rng_init(&rng, "public_api_on_the_callers_context_and_queue");
	ASSERT_EQ(0, test_problem_make(&a, &rng, &sh, APE_F16, false));
	test_problem_set_params(&a, pow(2.0, -4.0 / 3.0), pow(2.0, -4.0 / 3.0) / 10,
				pow(2.0, -4.0 / 3.0) / 10, 0.1);
	ASSERT_EQ(0, test_problem_clone(&b, &a));
	ASSERT_NE(NULL, b.lse);
	ASSERT_EQ(0, test_problem_run(&a, d)) TH_LOG("host call: %s", ape_last_error());

	host[0] = b.q.t.data;
	host[1] = b.k.t.data;
	host[2] = b.v.t.data;
	host[3] = b.o.t.data;
	host[4] = b.lse;
	bytes[0] = (size_t)(sh.B * sh.H * sh.Lq * sh.D) * 2;
	bytes[1] = bytes[2] = (size_t)(sh.B * sh.Hkv * sh.Lk * sh.D) * 2;
	bytes[3] = (size_t)(sh.B * sh.H * sh.Lq * sh.D) * ape_dtype_size(b.o.t.dtype);
	bytes[4] = b.rows * sizeof(float);
	cq = clCreateCommandQueue(mine, t.cdev, 0, &err);
	ASSERT_NE(NULL, cq);
	w.gate = clCreateUserEvent(mine, &err);
	ASSERT_NE(NULL, w.gate);
	for (int i = 0; i < 5; i++) {
		m[i] = clCreateBuffer(mine, CL_MEM_READ_WRITE, bytes[i], NULL, &err);
		ASSERT_NE(NULL, m[i]);
		ASSERT_EQ(CL_SUCCESS, clEnqueueFillBuffer(cq, m[i], &nan_bits, 4, 0, bytes[i], 0,
							  NULL, NULL));
		ASSERT_EQ(CL_SUCCESS, clFinish(cq));
		ASSERT_EQ(0, ape_buffer_wrap_opencl(d, m[i], &bufs[i])) TH_LOG("%s",
										 ape_last_error());
		EXPECT_EQ(bytes[i], ape_buffer_size(bufs[i]));
	}
	for (int i = 0; i < 3; i++)
		ASSERT_EQ(CL_SUCCESS, clEnqueueWriteBuffer(cq, m[i], CL_FALSE, 0, bytes[i], host[i],
							   1, &w.gate, NULL));
	ASSERT_EQ(0, pthread_create(&watchdog, NULL, gate_watchdog, &w));
	ASSERT_EQ(0, ape_queue_wrap_opencl(d, cq, &qu)) TH_LOG("%s", ape_last_error());
	ape_dtensor_init(&dt[0], bufs[0], 0, APE_F16, sh.B, sh.H, sh.Lq, sh.D);
	ape_dtensor_init(&dt[1], bufs[1], 0, APE_F16, sh.B, sh.Hkv, sh.Lk, sh.D);
	ape_dtensor_init(&dt[2], bufs[2], 0, APE_F16, sh.B, sh.Hkv, sh.Lk, sh.D);
	ape_dtensor_init(&dt[3], bufs[3], 0, b.o.t.dtype, sh.B, sh.H, sh.Lq, sh.D);
	ape_dtensor_init(&dt[4], bufs[4], 0, APE_F32, sh.B, sh.H, sh.Lq, 1);
	EXPECT_EQ(0, ape_attention_enqueue(qu, &b.desc, &dt[0], &dt[1], &dt[2], &dt[3], &dt[4]))
	TH_LOG("%s", ape_last_error());
	for (int i = 3; i < 5; i++)
		ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[i], CL_FALSE, 0, bytes[i], host[i],
							  0, NULL, NULL));
	EXPECT_EQ(0, atomic_load(&w.opened_by_watchdog))
	TH_LOG("ape_attention_enqueue waited on the caller's queue");
	atomic_store(&w.stop, 1);
	pthread_join(watchdog, NULL);
	if (!atomic_load(&w.opened_by_watchdog))
		ASSERT_EQ(CL_SUCCESS, clSetUserEventStatus(w.gate, CL_COMPLETE));
	EXPECT_EQ(0, ape_queue_synchronize(qu)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(a.o.t.data, b.o.t.data, bytes[3]));
	EXPECT_EQ(0, memcmp(a.lse, b.lse, bytes[4]));
	ape_queue_destroy(qu);
	for (int i = 0; i < 5; i++) {
		ape_buffer_free(bufs[i]);
		clReleaseMemObject(m[i]);
	}
	clReleaseEvent(w.gate);
	clReleaseCommandQueue(cq);
	test_problem_free(&a);
	test_problem_free(&b);
	ape_context_destroy(ctx);
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, mine, 1));
	clReleaseContext(mine);
	dev_close(&t);
}

/*
 * ape_attention_backward_enqueue() on the test's own cl_context, cl_command_queue and cl_mem
 * objects: the host call's gradients bit for bit, every write of the inputs (held back by a
 * user event) before libape's work and the reads of the gradients after it, and the call
 * itself not waiting for the gate (its scratch is released in queue order, never waited for).
 */
TEST(backward_on_the_callers_context_and_queue)
{
	const test_problem_shape sh = { 1, 4, 2, 19, 29, 64 }; /* D = 64: a built program */
	const cl_uint nan_bits = 0xffffffffu;
	struct dev t;
	ape_context *ctx = NULL;
	ape_device *d;
	void *nctx = NULL;
	ape_queue *qu = NULL;
	ape_buffer *bufs[11] = { 0 };
	ape_dtensor dt[11];
	cl_mem m[11] = { 0 };
	cl_context mine;
	cl_command_queue cq;
	struct gate_watch w = { 0 };
	pthread_t watchdog;
	grads host, got;
	ape_rng rng;
	cl_int err;
	bcase c;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, import_context(_metadata, &t, &mine, &ctx));
	d = device_of(ctx, t.cdev, &nctx);
	ASSERT_NE(NULL, d);
	ape_rng_init(&rng, "backward_on_the_callers_context_and_queue");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F16, true, true, d)) TH_LOG("%s",
										  ape_last_error());
	ASSERT_EQ(0, grads_alloc(&host, &c, APE_F16));
	ASSERT_EQ(0, grads_alloc(&got, &c, APE_F16));
	ASSERT_EQ(0, run_backward(&c, d, &host, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	cq = clCreateCommandQueue(mine, t.cdev, 0, &err);
	ASSERT_NE(NULL, cq);
	w.gate = clCreateUserEvent(mine, &err);
	ASSERT_NE(NULL, w.gate);
	{
		/* each tensor's whole host allocation in a cl_mem of its own, at its offsets */
		const test_tensor *tt[11] = { &c.tp.q, &c.tp.k, &c.tp.v, &c.tp.o, NULL, &c.dout,
					      NULL, &got.dq, &got.dk, &got.dv, NULL };
		void *data[11] = { 0 };
		size_t bytes[11];

		data[4] = c.tp.lse;
		data[6] = c.dlse;
		data[10] = got.dparams;
		for (int i = 0; i < 11; i++) {
			void *base = tt[i] ? tt[i]->alloc : data[i];
			const ape_tensor *x = tt[i] ? &tt[i]->t : NULL;

			bytes[i] = tt[i] ? tt[i]->alloc_bytes
				   : i == 10 ? (size_t)(4 * sh.H) * sizeof(float)
					     : c.tp.rows * sizeof(float);
			m[i] = clCreateBuffer(mine, CL_MEM_READ_WRITE, bytes[i], NULL, &err);
			ASSERT_NE(NULL, m[i]);
			ASSERT_EQ(CL_SUCCESS, clEnqueueFillBuffer(cq, m[i], &nan_bits, 4, 0, bytes[i],
								  0, NULL, NULL));
			ASSERT_EQ(0, ape_buffer_wrap_opencl(d, m[i], &bufs[i]))
			TH_LOG("%s", ape_last_error());
			if (x) {
				ape_dtensor_init(&dt[i], bufs[i],
						 (uint64_t)((char *)x->data - (char *)base), x->dtype,
						 x->shape[0], x->shape[1], x->shape[2], x->shape[3]);
				ape_tensor_strides(x, dt[i].strides);
			} else if (i == 10) {
				ape_dtensor_init(&dt[i], bufs[i], 0, APE_F32, 1, 1, sh.H, 4);
			} else {
				ape_dtensor_init(&dt[i], bufs[i], 0, APE_F32, sh.B, sh.H, sh.Lq, 1);
			}
		}
		ASSERT_EQ(CL_SUCCESS, clFinish(cq));
		for (int i = 0; i < 7; i++) /* the inputs, held back by the gate */
			ASSERT_EQ(CL_SUCCESS,
				  clEnqueueWriteBuffer(cq, m[i], CL_FALSE, 0, bytes[i],
						       tt[i] ? tt[i]->alloc : data[i], 1, &w.gate,
						       NULL));
		ASSERT_EQ(0, pthread_create(&watchdog, NULL, gate_watchdog, &w));
		ASSERT_EQ(0, ape_queue_wrap_opencl(d, cq, &qu)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, ape_attention_backward_enqueue(qu, &c.tp.desc, &dt[0], &dt[1], &dt[2],
							    &dt[3], &dt[4], &dt[5], &dt[6], &dt[7],
							    &dt[8], &dt[9], &dt[10]))
		TH_LOG("%s", ape_last_error());
		for (int i = 7; i < 11; i++)
			ASSERT_EQ(CL_SUCCESS,
				  clEnqueueReadBuffer(cq, m[i], CL_FALSE, 0, bytes[i],
						      tt[i] ? tt[i]->alloc : data[i], 0, NULL,
						      NULL));
	}
	EXPECT_EQ(0, atomic_load(&w.opened_by_watchdog))
	TH_LOG("ape_attention_backward_enqueue waited on the caller's queue");
	atomic_store(&w.stop, 1);
	pthread_join(watchdog, NULL);
	if (!atomic_load(&w.opened_by_watchdog))
		ASSERT_EQ(CL_SUCCESS, clSetUserEventStatus(w.gate, CL_COMPLETE));
	EXPECT_EQ(0, ape_queue_synchronize(qu)) TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(same_grads(&got, &host, W_ALL));
	ape_queue_destroy(qu);
	for (int i = 0; i < 11; i++) {
		ape_buffer_free(bufs[i]);
		clReleaseMemObject(m[i]);
	}
	clReleaseEvent(w.gate);
	clReleaseCommandQueue(cq);
	grads_free(&host);
	grads_free(&got);
	bcase_free(&c);
	ape_context_destroy(ctx);
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, mine, 1));
	clReleaseContext(mine);
	dev_close(&t);
}
#endif

OPENCL_INTEROP_MAIN
