/* SPDX-License-Identifier: MIT */
/*
 * The backend contract (runtime/core/backend.h), op by op, on the backends built here and on the
 * test wrapper (tests/common/wrapops.c): a failing op returns a negative code, names the device
 * ("ref:0 NAME") and the op ("buf_alloc") in the thread's message, and leaves its out-parameters
 * cleared (*out NULL, *ms 0). Real failures where a backend has them (more memory than the device
 * takes, copies the driver rejects, and, in the fault build of `make faults-ci`, every host
 * allocation inside an op), injected ones for every op kind through the wrapper.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "api/registry.h"
#include "common/bwdcase.h"
#include "common/wrapops.h"
#include "core/alloc.h"
#include "core/backend.h"
#include "core/error.h"

/* Something no op returns: an out-parameter still holding it was not cleared. */
static int sentinel;
#define STALE ((void *)&sentinel)

FIXTURE(be)
{
	ape_context *ctx;
	ape_device *dev;
	const struct ape_backend_plugin *ops;
	char label[256]; /* "ref:0 NAME": how a failing op names the device */
};

FIXTURE_VARIANT(be)
{
	const char *backend;
};

FIXTURE_VARIANT_ADD(be, ref)
{
	.backend = "ref",
};

FIXTURE_VARIANT_ADD(be, opencl)
{
	.backend = "opencl",
};

FIXTURE_SETUP(be)
{
	self->ctx = test_context(variant->backend);
	self->dev = test_device(self->ctx, variant->backend);
	if (!self->dev)
		APE_SETUP_SKIP(ape_context_destroy(self->ctx), "no %s device", variant->backend);
	self->ops = self->dev->be->ops;
	snprintf(self->label, sizeof(self->label), "%s:%d %s", self->dev->info.backend,
		 self->dev->info.backend_index, self->dev->info.name);
}

FIXTURE_TEARDOWN(be)
{
	ape_context_destroy(self->ctx);
}

/* The message after a failed `op`: it names the device and the op. */
static void expect_named(struct __test_metadata *_metadata, const char *label, const char *op)
{
	char want[64];

	snprintf(want, sizeof(want), ": %s: ", op);
	EXPECT_NE(NULL, strstr(ape_last_error(), label))
		TH_LOG("%s: the message does not name the device (%s): %s", op, label,
		       ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), want))
		TH_LOG("%s: the message does not name the op: %s", op, ape_last_error());
}

/* More than the device takes: APE_ENOMEM from the backend itself, *out cleared. */
TEST_F(be, buf_alloc_beyond_the_device)
{
	const uint64_t max = self->dev->caps.max_alloc;
	size_t bytes = max < SIZE_MAX / 2 ? (size_t)max + 4096 : SIZE_MAX - 16;
	struct ape_be_buf *buf = STALE;

	ape__error(0, "stale");
	EXPECT_EQ(APE_ENOMEM, self->ops->buf_alloc(self->dev, bytes, &buf));
	EXPECT_EQ(NULL, buf);
	expect_named(_metadata, self->label, "buf_alloc");
	if (buf != STALE)
		self->ops->buf_free(self->dev, buf);
}

/* Copies and fills the driver rejects (outside the buffer): each names its op. The reference's
 * copies are memcpy and cannot fail, so there is nothing to provoke there. */
TEST_F(be, rejected_copies_name_their_op)
{
	struct ape_be_buf *buf = NULL, *other = NULL;
	struct ape_be_queue *q = NULL;
	char host[64] = { 0 };

	if (!strcmp(variant->backend, "ref"))
		SKIP(return, "the reference's copies cannot fail");
	ASSERT_EQ(0, self->ops->buf_alloc(self->dev, 256, &buf)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, self->ops->buf_alloc(self->dev, 256, &other)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, self->ops->queue_create(self->dev, &q)) TH_LOG("%s", ape_last_error());

	EXPECT_GT(0, self->ops->copy_h2d(q, buf, 4096, host, sizeof(host)));
	expect_named(_metadata, self->label, "copy_h2d");
	EXPECT_GT(0, self->ops->copy_d2h(q, host, buf, 4096, sizeof(host)));
	expect_named(_metadata, self->label, "copy_d2h");
	EXPECT_GT(0, self->ops->fill(q, buf, 4096, 0, sizeof(host)));
	expect_named(_metadata, self->label, "fill");
	if (self->ops->copy_d2d) {
		EXPECT_GT(0, self->ops->copy_d2d(q, other, 0, buf, 4096, sizeof(host)));
		expect_named(_metadata, self->label, "copy_d2d");
	}
	/* nothing was enqueued: the queue still works */
	EXPECT_EQ(0, self->ops->copy_h2d(q, buf, 0, host, sizeof(host)));
	EXPECT_EQ(0, self->ops->synchronize(q)) TH_LOG("%s", ape_last_error());
	self->ops->queue_destroy(q);
	self->ops->buf_free(self->dev, other);
	self->ops->buf_free(self->dev, buf);
}

/*
 * Events order queues (the ordering model): work a queue waits for through an event has
 * completed before the queue's later work starts, also where the event's queue itself waited on
 * a third queue (an event stands for everything before it, waits included), and a wait on an
 * event of the same queue or on one that has completed is harmless. OpenCL's event_record takes
 * the last command's event where that stands for the same point (a barrier since it, or an idle
 * queue, takes a marker): the second wait below fails if a record after a wait forgets it.
 * Large copies and fills (tens of milliseconds on a CPU device), so that a missing wait shows as
 * the old bytes read back.
 */
TEST_F(be, events_order_queues)
{
	const size_t n = (size_t)32 << 20, words = n / 4;
	const struct ape_backend_plugin *ops = self->ops;
	struct ape_be_buf *a = NULL, *b = NULL, *c = NULL;
	struct ape_be_queue *qa = NULL, *qb = NULL, *qc = NULL;
	struct ape_be_event *ea = NULL, *ec = NULL, *ea2 = NULL, *eb = NULL, *e0 = NULL;
	uint32_t *src = malloc(n), *dst = malloc(n);
	double ms = -1, t0 = 0, t1 = 0;
	size_t bad = 0;

	ASSERT_NE(NULL, src);
	ASSERT_NE(NULL, dst);
	for (size_t i = 0; i < words; i++)
		src[i] = 0x9e3779b9u * (uint32_t)(i + 1);
	ASSERT_EQ(0, ops->buf_alloc(self->dev, n, &a)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ops->buf_alloc(self->dev, n, &b)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ops->buf_alloc(self->dev, n, &c)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ops->queue_create(self->dev, &qa));
	ASSERT_EQ(0, ops->queue_create(self->dev, &qb));
	ASSERT_EQ(0, ops->queue_create(self->dev, &qc));
	ASSERT_EQ(0, ops->fill(qb, a, 0, 0, n));
	ASSERT_EQ(0, ops->fill(qb, b, 0, 0, n));
	ASSERT_EQ(0, ops->synchronize(qb));

	/* 1. qb reads what qa wrote, waiting only for qa's event */
	ASSERT_EQ(0, ops->event_record(qa, &e0)); /* an idle queue's point */
	for (int i = 0; i < 6; i++) /* work ahead of the copy: a reader not waiting reads zeros */
		ASSERT_EQ(0, ops->fill(qa, c, 0, (uint32_t)i, n));
	ASSERT_EQ(0, ops->copy_h2d(qa, a, 0, src, n));
	ASSERT_EQ(0, ops->event_record(qa, &ea)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ops->event_wait(qb, ea)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ops->copy_d2h(qb, dst, a, 0, n));
	ASSERT_EQ(0, ops->synchronize(qb)) TH_LOG("%s", ape_last_error());
	for (size_t i = 0; i < words; i++)
		bad += dst[i] != src[i];
	EXPECT_EQ(0, bad) TH_LOG("a copy waited for through an event: %zu of %zu words stale",
				 bad, words);

	/* 2. through a queue that waited: qc fills b; qa waits for it and records; qb waits for
	 * qa's point only */
	for (int i = 0; i < 6; i++)
		ASSERT_EQ(0, ops->fill(qc, c, 0, (uint32_t)i, n));
	ASSERT_EQ(0, ops->fill(qc, b, 0, 0x5a5a5a5au, n));
	ASSERT_EQ(0, ops->event_record(qc, &ec));
	ASSERT_EQ(0, ops->event_wait(qa, ec));
	ASSERT_EQ(0, ops->event_record(qa, &ea2));
	ASSERT_EQ(0, ops->event_wait(qb, ea2));
	ASSERT_EQ(0, ops->copy_d2h(qb, dst, b, 0, n));
	ASSERT_EQ(0, ops->synchronize(qb)) TH_LOG("%s", ape_last_error());
	bad = 0;
	for (size_t i = 0; i < words; i++)
		bad += dst[i] != 0x5a5a5a5au;
	EXPECT_EQ(0, bad) TH_LOG("a fill waited for through a queue that waited on it: %zu of %zu "
				 "words stale", bad, words);

	/* 3. waits on the queue's own event and on completed ones: no effect, no failure */
	ASSERT_EQ(0, ops->synchronize(qa));
	ASSERT_EQ(0, ops->synchronize(qc));
	ASSERT_EQ(0, ops->copy_h2d(qb, a, 0, src, 4096));
	ASSERT_EQ(0, ops->event_record(qb, &eb));
	EXPECT_EQ(0, ops->event_wait(qb, eb)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ops->event_wait(qb, ea)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ops->event_wait(qa, eb)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ops->synchronize(qb)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ops->synchronize(qa)) TH_LOG("%s", ape_last_error());

	/* 4. timing between the idle queue's point and the copy's: the fills' and the copy's
	 * time, ordered */
	EXPECT_EQ(0, ops->event_elapsed(e0, ea, &ms)) TH_LOG("%s", ape_last_error());
	EXPECT_GT(ms, 0.0);
	if (ops->event_timestamp) {
		EXPECT_EQ(0, ops->event_timestamp(e0, &t0)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, ops->event_timestamp(ea, &t1)) TH_LOG("%s", ape_last_error());
		EXPECT_GE(t1 - t0, ms * 0.999) TH_LOG("the copy's %.3f ms between points %.3f ms "
						       "apart", ms, t1 - t0);
	}
	/* events outlive their queues */
	ops->queue_destroy(qa);
	ops->queue_destroy(qb);
	ops->queue_destroy(qc);
	EXPECT_EQ(0, ops->event_elapsed(e0, ea, &ms)) TH_LOG("%s", ape_last_error());
	ops->event_destroy(e0);
	ops->event_destroy(ea);
	ops->event_destroy(ea2);
	ops->event_destroy(ec);
	ops->event_destroy(eb);
	ops->buf_free(self->dev, a);
	ops->buf_free(self->dev, b);
	ops->buf_free(self->dev, c);
	free(src);
	free(dst);
}

/* One copy_view (ABI 10) inside buf: 4 float32 from element 0 to element 16, for the program of
 * head size 2 (the one hm_backward() builds). */
static int copy_view_in(const struct ape_backend_plugin *ops, struct ape_be_queue *q,
			struct ape_be_buf *buf)
{
	const struct ape_be_copy c = { .B = 1, .H = 1, .L = 1, .D = 4, .dst = buf, .src = buf,
				     .dst_type = APE_BE_E_F32, .src_type = APE_BE_E_F32,
				     .dv = { 16, 4, 4, 4 }, .sv = { 0, 4, 4, 4 }, .head_D = 2 };

	return ops->copy_view ? ops->copy_view(q, &c) : 0;
}

#ifdef APE_FAULT_INJECT
/* The ops that allocate host memory in some backend (the first command of an OpenCL queue
 * starts its timeline: an allocation; the reference's backward pass its row table). */
enum {
	HM_BUF_ALLOC,
	HM_QUEUE_CREATE,
	HM_EVENT_RECORD,
	HM_COPY_H2D,
	HM_COPY_D2H,
	HM_FILL,
	HM_ATTENTION_BACKWARD,
	HM_SCRATCH_ALLOC,
	HM_COPY_VIEW,
	HM_N
};

static const char *const hm_names[HM_N] = {
	[HM_BUF_ALLOC] = "buf_alloc",	    [HM_QUEUE_CREATE] = "queue_create",
	[HM_EVENT_RECORD] = "event_record", [HM_COPY_H2D] = "copy_h2d",
	[HM_COPY_D2H] = "copy_d2h",	    [HM_FILL] = "fill",
	[HM_ATTENTION_BACKWARD] = "attention_backward",
	[HM_SCRATCH_ALLOC] = "scratch_alloc",	[HM_COPY_VIEW] = "copy_view",
};

/* A backward launch of one row and one key, every tensor in buf (its contents do not matter
 * here, only the failure path). */
static int hm_backward(const struct ape_backend_plugin *ops, struct ape_be_queue *q,
		       struct ape_be_buf *buf)
{
	static const float params[4] = { 0 };
	struct ape_be_bwd_launch l;

	if (!ops->attention_backward)
		return 0; /* optional: nothing to fail */
	memset(&l, 0, sizeof(l));
	l.f.B = l.f.H = l.f.Hkv = l.f.Lq = l.f.Lk = 1;
	l.f.D = 2;
	l.f.in_dtype = l.f.out_dtype = l.dout_dtype = APE_F32;
	l.f.q = l.f.k = l.f.v = l.f.o = l.f.lse = l.dout = buf;
	l.f.head_params = params;
	l.f.scale = l.f.omega[0] = 1;
	l.f.rope_base = 10000;
	l.dq = l.dparams = buf;
	return ops->attention_backward(q, &l);
}

/* Calls op once on q, a fresh queue; releases what it made; says whether a failure cleared
 * the out-parameter. */
static int hm_call(const struct ape_backend_plugin *ops, ape_device *dev, int op,
		   struct ape_be_queue *q, struct ape_be_buf *buf, bool *cleared)
{
	static char host[64];
	struct ape_be_buf *b = STALE;
	struct ape_be_queue *nq = STALE;
	struct ape_be_event *e = STALE;
	int ret = 0;

	*cleared = true;
	switch (op) {
	case HM_BUF_ALLOC:
		ret = ops->buf_alloc(dev, 64, &b);
		*cleared = ret ? b == NULL : true;
		if (!ret)
			ops->buf_free(dev, b);
		break;
	case HM_QUEUE_CREATE:
		ret = ops->queue_create(dev, &nq);
		*cleared = ret ? nq == NULL : true;
		if (!ret)
			ops->queue_destroy(nq);
		break;
	case HM_EVENT_RECORD:
		ret = ops->event_record(q, &e);
		*cleared = ret ? e == NULL : true;
		if (!ret)
			ops->event_destroy(e);
		break;
	case HM_COPY_H2D:
		ret = ops->copy_h2d(q, buf, 0, host, sizeof(host));
		break;
	case HM_COPY_D2H:
		ret = ops->copy_d2h(q, host, buf, 0, sizeof(host));
		break;
	case HM_FILL:
		ret = ops->fill(q, buf, 0, 0, sizeof(host));
		break;
	case HM_ATTENTION_BACKWARD:
		ret = hm_backward(ops, q, buf);
		break;
	case HM_SCRATCH_ALLOC:
		if (!ops->scratch_alloc)
			break;
		ret = ops->scratch_alloc(q, 64, &b);
		*cleared = ret ? b == NULL : true;
		if (!ret)
			ret = ops->scratch_free(q, b);
		break;
	case HM_COPY_VIEW:
		ret = copy_view_in(ops, q, buf);
		break;
	}
	return ret;
}

/* Host memory running out inside an op: APE_ENOMEM, the out-parameter cleared, the message
 * naming the device and the op, for each allocation of each op that makes any. */
TEST_F(be, ops_out_of_host_memory_name_themselves)
{
	const struct ape_backend_plugin *ops = self->ops;
	struct ape_be_buf *buf = NULL;
	int points = 0;

	ASSERT_EQ(0, ops->buf_alloc(self->dev, 256, &buf)) TH_LOG("%s", ape_last_error());
	for (int op = 0; op < HM_N; op++) {
		bool fired = true;

		if (op == HM_ATTENTION_BACKWARD) {
			/* built programs first, as in any context that ran a launch: a failed
			 * allocation in the program cache's lookup is a cache miss (the program
			 * is built instead), not a failure of the op */
			struct ape_be_queue *q = NULL;
			bool cleared;

			ASSERT_EQ(0, ops->queue_create(self->dev, &q)) TH_LOG("%s", ape_last_error());
			EXPECT_EQ(0, hm_call(ops, self->dev, op, q, buf, &cleared))
				TH_LOG("%s", ape_last_error());
			ops->synchronize(q);
			ops->queue_destroy(q);
		}
		for (uint64_t n = 1; fired; n++) {
			struct ape_be_queue *q = NULL;
			bool cleared;
			int ret;

			ASSERT_EQ(0, ops->queue_create(self->dev, &q)) TH_LOG("%s", ape_last_error());
			ape__error(0, "stale");
			ape__fault_alloc_arm(n);
			ret = hm_call(ops, self->dev, op, q, buf, &cleared);
			fired = ape__fault_alloc_fired();
			ape__fault_alloc_arm(0);
			if (fired) {
				points++;
				EXPECT_EQ(APE_ENOMEM, ret) TH_LOG("%s, allocation %llu: %s",
								  hm_names[op], (unsigned long long)n,
								  ape_last_error());
				EXPECT_TRUE(cleared) TH_LOG("%s: *out left set", hm_names[op]);
				expect_named(_metadata, self->label, hm_names[op]);
			} else {
				EXPECT_EQ(0, ret) TH_LOG("%s: %s", hm_names[op], ape_last_error());
			}
			EXPECT_EQ(0, ops->synchronize(q)) TH_LOG("%s", ape_last_error());
			ops->queue_destroy(q);
		}
	}
	/* buf_alloc, queue_create and event_record allocate in every backend here */
	EXPECT_GE(points, 3);
	ksft_print_msg("%s: %d host allocations inside ops failed in turn\n", variant->backend,
		       points);
	fflush(stdout); /* the harness ends each test with _exit() */
	ops->buf_free(self->dev, buf);
}
#else
TEST_F(be, ops_out_of_host_memory_name_themselves)
{
	SKIP(return, "needs the fault build (make faults-ci: -DAPE_FAULT_INJECT)");
}
#endif

/*
 * Calls op once through the ops in place (the wrapper, set to fail it); returns its result and
 * whether its out-parameters were cleared. NOT_THERE: the backend does not have the op.
 */
#define NOT_THERE 1

static int call_op(const struct ape_backend_plugin *ops, ape_device *dev, enum wrap_op op,
		   struct ape_be_queue *q, struct ape_be_buf *buf, struct ape_be_event *e, bool *cleared)
{
	static char host[64];
	struct ape_be_launch l;
	struct ape_be_buf *b = STALE;
	struct ape_be_queue *nq = STALE;
	struct ape_be_event *ne = STALE;
	void *handle = STALE;
	double ms = -1;
	int ret;

	memset(&l, 0, sizeof(l));
	*cleared = true;
	switch (op) {
	case WRAP_BUF_ALLOC:
		ret = ops->buf_alloc(dev, 64, &b);
		*cleared = b == NULL;
		return ret;
	case WRAP_QUEUE_CREATE:
		ret = ops->queue_create(dev, &nq);
		*cleared = nq == NULL;
		return ret;
	case WRAP_COPY_H2D:
		return ops->copy_h2d(q, buf, 0, host, sizeof(host));
	case WRAP_COPY_D2H:
		return ops->copy_d2h(q, host, buf, 0, sizeof(host));
	case WRAP_COPY_D2D:
		return ops->copy_d2d ? ops->copy_d2d(q, buf, 0, buf, 64, 64) : NOT_THERE;
	case WRAP_FILL:
		return ops->fill(q, buf, 0, 0, 64);
	case WRAP_EVENT_RECORD:
		ret = ops->event_record(q, &ne);
		*cleared = ne == NULL;
		return ret;
	case WRAP_EVENT_WAIT:
		return ops->event_wait(q, e);
	case WRAP_EVENT_ELAPSED:
		ret = ops->event_elapsed(e, e, &ms);
		*cleared = ms == 0;
		return ret;
	case WRAP_EVENT_TIMESTAMP:
		if (!ops->event_timestamp)
			return NOT_THERE;
		ret = ops->event_timestamp(e, &ms);
		*cleared = ms == 0;
		return ret;
	case WRAP_ATTENTION: /* fails before the backend sees the (empty) launch */
		return ops->attention(q, &l);
	case WRAP_ATTENTION_BACKWARD: { /* likewise */
		struct ape_be_bwd_launch bl;

		if (!ops->attention_backward)
			return NOT_THERE;
		memset(&bl, 0, sizeof(bl));
		return ops->attention_backward(q, &bl);
	}
	case WRAP_SCRATCH_ALLOC: /* fails before the backend allocates */
		if (!ops->scratch_alloc)
			return NOT_THERE;
		ret = ops->scratch_alloc(q, 64, &b);
		*cleared = b == NULL;
		return ret;
	case WRAP_COPY_VIEW:
		return ops->copy_view ? copy_view_in(ops, q, buf) : NOT_THERE;
	case WRAP_ATTENTION_MERGE: { /* fails before the backend sees the (empty) merge */
		struct ape_be_merge m;

		if (!ops->attention_merge)
			return NOT_THERE;
		memset(&m, 0, sizeof(m));
		return ops->attention_merge(q, &m);
	}
	case WRAP_SYNCHRONIZE:
		return ops->synchronize(q);
	case WRAP_HOST_REGISTER:
		if (!ops->host_register)
			return NOT_THERE;
		ret = ops->host_register(dev, host, sizeof(host), &handle);
		*cleared = handle == NULL;
		return ret;
	case WRAP_BUF_WRAP: {
		size_t got = 1;

		if (!ops->buf_wrap)
			return NOT_THERE;
		ret = ops->buf_wrap(dev, APE_BE_MEM_HOST, host, sizeof(host), &b, &got);
		*cleared = b == NULL && got == 0;
		return ret;
	}
	case WRAP_QUEUE_WRAP: /* fails before the backend sees the handle */
		if (!ops->queue_wrap)
			return NOT_THERE;
		ret = ops->queue_wrap(dev, NULL, &nq);
		*cleared = nq == NULL;
		return ret;
	case WRAP_NOPS:
		break;
	}
	return NOT_THERE;
}

/* Every op kind the wrapper can fail, failed once: the code, the message, the out-parameters. */
TEST_F(be, every_failing_op_names_itself)
{
	struct ape_be_buf *buf = NULL;
	struct ape_be_queue *q = NULL;
	struct ape_be_event *e = NULL;
	int tried = 0;

	wrap_install(self->dev, 0);
	ASSERT_EQ(0, self->dev->be->ops->queue_create(self->dev, &q)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, self->dev->be->ops->buf_alloc(self->dev, 256, &buf));
	ASSERT_EQ(0, self->dev->be->ops->event_record(q, &e));
	ASSERT_EQ(0, self->dev->be->ops->synchronize(q));
	for (int op = 0; op < WRAP_NOPS; op++) {
		bool cleared;
		int ret;

		wrap_fail_op((enum wrap_op)op, 1);
		ape__error(0, "stale");
		ret = call_op(self->dev->be->ops, self->dev, (enum wrap_op)op, q, buf, e, &cleared);
		wrap_fail_op((enum wrap_op)op, 0);
		if (ret == NOT_THERE)
			continue;
		tried++;
		EXPECT_EQ(op == WRAP_BUF_ALLOC || op == WRAP_BUF_WRAP || op == WRAP_SCRATCH_ALLOC
				  ? APE_ENOMEM
				  : APE_EDEVLOST,
			  ret)
		TH_LOG("%s: %s", wrap_op_name((enum wrap_op)op), ape_last_error());
		EXPECT_TRUE(cleared) TH_LOG("%s: an out-parameter was left set",
					    wrap_op_name((enum wrap_op)op));
		expect_named(_metadata, self->label, wrap_op_name((enum wrap_op)op));
	}
	/* the required ops at least: every op kind but the optional ones (copy_d2d,
	 * event_timestamp, host_register, buf_wrap, queue_wrap, scratch_alloc, copy_view,
	 * attention_merge) */
	EXPECT_GE(tried, WRAP_NOPS - 8);
	EXPECT_EQ(0, self->dev->be->ops->synchronize(q)) TH_LOG("%s", ape_last_error());
	self->dev->be->ops->event_destroy(e);
	self->dev->be->ops->queue_destroy(q);
	self->dev->be->ops->buf_free(self->dev, buf);
	wrap_remove();
}

/* ---------------------------------------------------------------- registration */

/* The compiled-in reference backend's table: a complete one, to break piece by piece. */
static const struct ape__registry_entry *ref_entry(void)
{
	int n;
	const struct ape__registry_entry *reg = ape__registry(&n);

	for (int i = 0; i < n; i++)
		if (!strcmp(reg[i].name, "ref"))
			return &reg[i];
	return NULL;
}

static int probes; /* calls of counting_probe() */

static int counting_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
	probes++;
	return ref_entry()->ops->probe(be, res);
}

/* Ops a broken table sets where it must not, or without their pair; never called. */
static int lone_host_register(struct ape_device *dev, void *ptr, size_t bytes, void **handle)
{
	(void)dev;
	(void)ptr;
	(void)bytes;
	*handle = NULL;
	return APE_ENOTSUP;
}

/*
 * A context over a table made of ref's with `t` first, registered as "broken": its backend
 * info (the first entry), and whether the reference beside it still works.
 */
static void load_broken(struct __test_metadata *_metadata, const struct ape_backend_plugin *t,
			ape_backend_info *info)
{
	const struct ape__registry_entry reg[2] = { { "broken", t, NULL }, *ref_entry() };
	ape_context *ctx = NULL;

	ASSERT_EQ(0, ape__context_create(&ctx, NULL, reg, 2)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_backend_get_info(ctx, 0, info));
	/* a refused backend never breaks the rest */
	EXPECT_NE(NULL, test_device(ctx, "ref"));
	ape_context_destroy(ctx);
}

/* Each way a table can be incomplete: refused before its probe runs, with the reason
 * ape_backend_get_info() and ape-info show; the complete table, loaded. */
TEST(registration_checks_the_table)
{
	static const struct {
		const char *breaks, *reason;
	} cases[] = {
		{ "none", NULL },
		{ "queue_create", "refused: required op queue_create is missing" },
		{ "attention", "refused: required op attention is missing" },
		{ "scratch_free", "refused: scratch_alloc, scratch_free and copy_view come all or "
				  "none: scratch_free is missing" },
		{ "host_register", "refused: host_register and host_unregister come both or "
				   "neither: host_unregister is missing" },
		{ "major", "refused: backend ABI 2.0: this libape takes major 1 only" },
		{ "minor", "refused: backend ABI 1.4 is newer than this libape's 1.3" },
		{ "struct_size", "refused: struct_size 20 is shorter than the 24 bytes every table "
				 "begins with" },
		{ "older minor", NULL },
		{ "bad name", "refused: backend name \"Broken\": must be 1 to 15 characters of "
			      "[a-z0-9_]" },
		{ "name", "refused: backend name \"\": must be 1 to 15 characters" },
		{ "long name", "refused: backend name \"sixteen-letters!\": must be 1 to 15" },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct ape_backend_plugin t = *ref_entry()->ops;
		const char *b = cases[i].breaks;
		ape_backend_info info;

		t.name = "broken";
		t.probe = counting_probe;
		if (!strcmp(b, "queue_create"))
			t.queue_create = NULL;
		else if (!strcmp(b, "attention"))
			t.attention = NULL;
		else if (!strcmp(b, "scratch_free"))
			t.scratch_free = NULL;
		else if (!strcmp(b, "host_register"))
			t.host_register = lone_host_register;
		else if (!strcmp(b, "major"))
			t.abi_major = APE_BACKEND_ABI_MAJOR + 1, t.abi_minor = 0;
		else if (!strcmp(b, "minor"))
			t.abi_minor = APE_BACKEND_ABI_MINOR + 1;
		else if (!strcmp(b, "struct_size"))
			t.struct_size = 20;
		else if (!strcmp(b, "older minor")) /* ends before attention_pages */
			t.struct_size = offsetof(struct ape_backend_plugin, attention_pages);
		else if (!strcmp(b, "bad name"))
			t.name = "Broken";
		else if (!strcmp(b, "name"))
			t.name = "";
		else if (!strcmp(b, "long name"))
			t.name = "sixteen-letters!";
		probes = 0;
		load_broken(_metadata, &t, &info);
		if (!cases[i].reason) {
			EXPECT_TRUE(info.available) TH_LOG("%s", info.reason);
			EXPECT_EQ(1, probes);
			continue;
		}
		EXPECT_TRUE(info.built);
		EXPECT_FALSE(info.available) TH_LOG("%s: loaded", b);
		EXPECT_EQ(0, info.device_count);
		EXPECT_EQ(0, probes) TH_LOG("%s: probed", b);
		EXPECT_EQ(0, strncmp(info.reason, cases[i].reason, strlen(cases[i].reason)))
		TH_LOG("%s: \"%s\"", b, info.reason);
	}
}

/* What claimant_probe() states, and what the backend saw released. */
static struct ape_be_caps claimed;
static int released, torn_down;

static int claimant_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
	struct ape_device_info info;

	(void)res;
	memset(&info, 0, sizeof(info));
	snprintf(info.name, sizeof(info.name), "claimant");
	info.kind = APE_DEVICE_CPU;
	info.compute_units = 1;
	return ape_be_device_add(be, &info, &claimed, 0, NULL);
}

static void claimant_release(struct ape_device *dev)
{
	(void)dev;
	released++;
}

static void claimant_teardown(struct ape_backend *be)
{
	(void)be;
	torn_down++;
}

/* A device claiming a capability its backend's ops cannot back: the backend refused after
 * its probe, the device released and the backend torn down; the capability backed, loaded. */
TEST(registration_checks_the_capabilities)
{
	static const struct {
		struct ape_be_caps claims;
		bool ops; /* every op the capabilities name (else the backward op only for a case
			   * about the scratch, none for the rest) */
		const char *reason; /* NULL: loaded */
	} cases[] = {
		{ { .max_alloc = 0 }, false, NULL },
		{ { .features = APE_BE_CAP_HOST_MEMORY }, false,
		  "capability host_memory without buf_wrap" },
		{ { .features = APE_BE_CAP_DIAG_VIEWS }, false, "capability diag_views without diag" },
		{ { .features = APE_BE_CAP_BACKWARD }, false,
		  "capability backward without attention_backward" },
		{ { .features = APE_BE_CAP_RESIDENT_BACKWARD }, false,
		  "capability resident_backward without backward" },
		{ { .features = APE_BE_CAP_BACKWARD | APE_BE_CAP_RESIDENT_BACKWARD }, false,
		  "capability resident_backward without scratch_alloc, scratch_free and copy_view" },
		{ { .features = APE_BE_CAP_TIMESTAMPS }, false,
		  "capability timestamps without event_timestamp" },
		{ { .features = APE_BE_CAP_POSITIONS }, true, "capability positions without segments" },
		{ { .features = 1u << 20 }, true, "capability bits 0x100000 unknown to this libape" },
		{ { .features = APE_BE_CAP_HOST_MEMORY | APE_BE_CAP_DIAG | APE_BE_CAP_DIAG_VIEWS |
				APE_BE_CAP_BACKWARD | APE_BE_CAP_RESIDENT_BACKWARD |
				APE_BE_CAP_TIMESTAMPS },
		  true, NULL },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct ape_backend_plugin t = *ref_entry()->ops;
		const struct ape_be_caps *c = &cases[i].claims;
		ape_backend_info info;

		t.name = "broken";
		t.probe = claimant_probe;
		t.device_release = claimant_release;
		t.teardown = claimant_teardown;
		if (!cases[i].ops) {
			t.buf_wrap = NULL;
			if (!ape_be_caps_have(c, APE_BE_CAP_RESIDENT_BACKWARD))
				t.attention_backward = NULL;
			t.scratch_alloc = NULL;
			t.scratch_free = NULL;
			t.copy_view = NULL;
			t.event_timestamp = NULL;
		}
		claimed = *c;
		released = torn_down = 0;
		load_broken(_metadata, &t, &info);
		EXPECT_EQ(1, released) TH_LOG("case %zu: the device was not released once", i);
		EXPECT_EQ(1, torn_down) TH_LOG("case %zu: the backend was not torn down once", i);
		if (!cases[i].reason) {
			EXPECT_TRUE(info.available) TH_LOG("case %zu: %s", i, info.reason);
			EXPECT_EQ(1, info.device_count);
			continue;
		}
		EXPECT_FALSE(info.available) TH_LOG("case %zu: loaded", i);
		EXPECT_EQ(0, info.device_count);
		EXPECT_EQ(0, strncmp(info.reason, "refused: device claimant: ", 26))
		TH_LOG("case %zu: \"%s\"", i, info.reason);
		EXPECT_NE(NULL, strstr(info.reason, cases[i].reason))
		TH_LOG("case %zu: \"%s\"", i, info.reason);
	}
}

/* The devices of the backends built here state their capabilities. */
TEST_F(be, capabilities_as_stated)
{
	const struct ape_be_caps *c = &self->dev->caps;

	EXPECT_NE(0u, c->max_alloc);
	EXPECT_EQ(0u, c->features & ~APE_BE_CAP_ALL);
	EXPECT_EQ(self->dev->info.kind != APE_DEVICE_GPU,
		  ape_be_caps_have(c, APE_BE_CAP_HOST_MEMORY));
	EXPECT_TRUE(ape_be_caps_have(c, APE_BE_CAP_DIAG | APE_BE_CAP_DIAG_VIEWS));
	/* OpenCL: both need float64 */
	EXPECT_EQ(ape_be_caps_have(c, APE_BE_CAP_BACKWARD),
		  ape_be_caps_have(c, APE_BE_CAP_RESIDENT_BACKWARD));
	EXPECT_TRUE(ape_be_caps_have(c, APE_BE_CAP_TIMESTAMPS));
	if (!strcmp(variant->backend, "ref")) {
		EXPECT_EQ(UINT64_MAX, c->max_alloc);
		EXPECT_EQ(APE_BE_CAP_ALL, c->features);
	}
	/* the public query says the same; every bit has its name, nothing else has one */
	EXPECT_EQ(c->features, ape_device_capabilities(self->dev));
	EXPECT_EQ(0u, ape_device_capabilities(NULL));
	for (int i = 0; i < 64; i++) {
		EXPECT_EQ((APE_BE_CAP_ALL >> i) & 1, ape_be_cap_name((uint64_t)1 << i) != NULL)
		TH_LOG("bit %d", i);
	}
	EXPECT_STREQ("diag_views", ape_be_cap_name(APE_BE_CAP_DIAG_VIEWS));
	EXPECT_EQ(NULL, ape_be_cap_name(0));
	EXPECT_EQ(NULL, ape_be_cap_name(APE_BE_CAP_DIAG | APE_BE_CAP_BACKWARD));
}

/* ---------------------------------------------------------------- ABI 1.0 backends */

/* ABI 1.0's backward launch, as a backend built against 1.0 declares it: 1.0's forward launch
 * (every member before bias_table), then the backward's members without dbias. */
struct bwd_launch_1_0 {
	_Alignas(struct ape_be_launch) unsigned char f[offsetof(struct ape_be_launch, bias_table)];
	ape_dtype dout_dtype;
	struct ape_be_buf *dout, *dlse, *dq, *dk, *dv, *dparams;
};

static int old_calls;

/* A 1.0 backend's attention_backward: reads its launch in 1.0's layout, then computes it as
 * the reference does (the launch rebuilt in this header's layout, no table). */
static int old_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	const struct bwd_launch_1_0 *o = (const void *)l;
	struct ape_be_bwd_launch n;

	memset(&n, 0, sizeof(n));
	memcpy(&n.f, o->f, sizeof(o->f));
	n.dout_dtype = o->dout_dtype;
	n.dout = o->dout;
	n.dlse = o->dlse;
	n.dq = o->dq;
	n.dk = o->dk;
	n.dv = o->dv;
	n.dparams = o->dparams;
	old_calls++;
	return ref_entry()->ops->attention_backward(q, &n);
}

/* A backend of ABI 1.0 (the reference's table stating minor 0): its devices lose the
 * capability 1.0 did not have (bias_table: it gets no table, the call with one is refused
 * naming the device), and its backward launches come in 1.0's layout (runtime/core/ops.c
 * converts them), so its gradients are the reference's bit for bit. */
TEST(abi_1_0_backends_get_1_0_launches)
{
	struct ape_backend_plugin t = *ref_entry()->ops;
	const struct ape__registry_entry reg[2] = { { "old", &t, NULL }, *ref_entry() };
	const test_problem_shape sh = { 2, 4, 2, 9, 13, 8 };
	ape_context *ctx = NULL;
	ape_device *old, *ref;
	ape_rng rng;
	bcase c;
	grads g[2];

	t.name = "old";
	t.abi_minor = 0;
	t.attention_backward = old_attention_backward;
	ASSERT_EQ(0, ape__context_create(&ctx, NULL, reg, 2)) TH_LOG("%s", ape_last_error());
	old = test_device(ctx, "old");
	ref = test_device(ctx, "ref");
	ASSERT_NE(NULL, old);
	ASSERT_NE(NULL, ref);
	EXPECT_EQ(0u, ape_device_capabilities(old) & APE_BE_CAP_BIAS_TABLE);
	EXPECT_EQ(APE_BE_CAP_ALL & ~(uint64_t)(APE_BE_CAP_BIAS_TABLE | APE_BE_CAP_BWD_SEGMENTS |
					       APE_BE_CAP_BWD_VIEWS),
		  ape_device_capabilities(old));
	ape_rng_init(&rng, "abi_1_0_backends_get_1_0_launches");
	/* end-aligned queries: every row sees keys, so the old backend launches */
	ASSERT_EQ(0, bcase_ready_visible(&c, &rng, &sh, APE_F32, false, true, ref));
	for (int w = 0; w < 2; w++) {
		ASSERT_EQ(0, grads_alloc(&g[w], &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, w ? ref : old, &g[w], W_ALL, NULL))
		TH_LOG("%s", ape_last_error());
	}
	EXPECT_GT(old_calls, 0);
	EXPECT_TRUE(same_grads(&g[0], &g[1], W_ALL));
	/* a table: refused on the 1.0 device, naming it */
	ASSERT_EQ(0, test_problem_random_table(&c.tp, &rng));
	EXPECT_EQ(APE_ENOTSUP, test_problem_run(&c.tp, old));
	EXPECT_NE(NULL, strstr(ape_last_error(), "old:0")) TH_LOG("%s", ape_last_error());
	for (int w = 0; w < 2; w++)
		grads_free(&g[w]);
	bcase_free(&c);
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
