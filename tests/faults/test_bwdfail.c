/* SPDX-License-Identifier: MIT */
/*
 * Failures in the backward pass, on the reference, for a call run as one launch, one
 * streamed in 3 x 3 chunks, and one streamed in 3 x 3 chunks over two entries of the device
 * (two threads, the key chunks split between them):
 * - every host allocation of a clean call failed in turn (builds with -DAPE_FAULT_INJECT, that
 *   is `make faults-ci`; other builds skip that test): APE_ENOMEM with a message;
 * - every fallible device op failed at each of its occurrences, then the device lost from each
 *   point of the run on (the wrapper backend of tests/common/wrapops.c): the injected error,
 *   with a message naming the device and the operation;
 * - each backward launch failed in turn on every backend with the op (OpenCL's holds scratch):
 *   the same, and afterwards no device memory held, no buffer left allocated.
 * Every broken run writes no output and leaves the inputs byte-identical; the next call gives
 * the clean result; ASan/LSan (make faults-ci) see no leak.
 *
 * The same call on device tensors (ape_attention_backward_enqueue(), common/bwdcase.h's dcase):
 * every host allocation in turn (fault-injection builds), then each scratch_alloc, copy_view,
 * fill and attention_backward of a clean call failed in turn, then the device lost from each
 * point on: the injected code (from the enqueue, or from ape_queue_synchronize()), a message
 * naming the device, every queue-ordered scratch buffer released, the next call clean. (Its
 * outputs are the caller's device memory, unspecified after a failure, as documented.)
 *
 * The same call on kDLCPU DLPack tensors (ape_attention_backward_dlpack(), common/bwdcase.h's
 * dlbwd), on the reference and on an OpenCL CPU device: every host allocation in turn
 * (fault-injection builds: nothing written), then every fallible op of a clean call (buf_wrap,
 * queue_create, scratch_alloc, fill, copy_view, attention_backward, synchronize: whichever it
 * makes) failed at each of its occurrences, then the device lost from each point on: the
 * injected code, a message naming the function (and, for a device failure, the device and the
 * operation), the inputs byte-identical, no device memory or scratch left, the next call clean.
 * Its outputs are the caller's memory, computed in place and unspecified after a failure (as
 * documented): the gradients are copied into them one by one after the launch, and the final
 * synchronisation can fail after all of them; each must still be untouched or the clean
 * result, and the test counts the broken runs that wrote any.
 */
#include "ape_test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/bwdcase.h"
#include "common/wrapops.h"
#ifdef APE_FAULT_INJECT
#include "core/alloc.h"
#endif

/* One backward call, its clean result and a copy of every input byte. */
struct bcall {
	bcase c;
	grads g, clean, poisoned;
	ape_device *dev;
	int ndev; /* dev listed ndev times: the key chunks split over as many threads */
	int64_t chunk; /* rows per chunk both ways; 0: the default (one launch here) */
	bool dlpack; /* ape_attention_backward_dlpack() on kDLCPU tensors instead (ndev 1) */
	unsigned char *in;
	size_t in_bytes;
	char msg[1024];
};

static void inputs(struct bcall *b, const void *ptr[7], size_t n[7])
{
	const test_problem *tp = &b->c.tp;

	ptr[0] = tp->q.alloc, n[0] = tp->q.alloc_bytes;
	ptr[1] = tp->k.alloc, n[1] = tp->k.alloc_bytes;
	ptr[2] = tp->v.alloc, n[2] = tp->v.alloc_bytes;
	ptr[3] = tp->o.alloc, n[3] = tp->o.alloc_bytes;
	ptr[4] = b->c.dout.alloc, n[4] = b->c.dout.alloc_bytes;
	ptr[5] = tp->lse, n[5] = tp->rows * sizeof(float);
	ptr[6] = b->c.dlse, n[6] = tp->rows * sizeof(float);
}

/* Every element of g NaN. */
static void poison(grads *g)
{
	test_tensor_poison(&g->dq.t);
	test_tensor_poison(&g->dk.t);
	test_tensor_poison(&g->dv.t);
	for (int64_t i = 0; i < 4 * g->H; i++)
		g->dparams[i] = NAN;
}

static int bcall_run(struct bcall *b)
{
	int ret;

	poison(&b->g);
	if (b->dlpack) {
		dlbwd d;

		dlbwd_make(&d, &b->c, &b->g);
		ret = dlbwd_run(b->dev, &b->c, &d, W_ALL, NULL);
	} else if (b->ndev == 1) {
		ret = run_chunked(&b->c, b->dev, &b->g, b->chunk, b->chunk, NULL);
	} else {
		ape_device *devs[2] = { b->dev, b->dev };
		const test_problem *tp = &b->c.tp;
		ape_exec_options eo;

		ape_exec_options_init(&eo);
		eo.chunk_q = eo.chunk_k = b->chunk;
		ret = ape_attention_backward_ex(devs, b->ndev, &eo, &tp->desc, &tp->q.t, &tp->k.t,
						&tp->v.t, &tp->o.t, tp->lse, &b->c.dout.t,
						b->c.dlse, &b->g.dq.t, &b->g.dk.t, &b->g.dv.t,
						b->g.dparams, NULL);
	}
	snprintf(b->msg, sizeof(b->msg), "%s", ret ? ape_last_error() : "");
	return ret;
}

/* The outputs after a failed DLPack call, which are the caller's memory computed in place and
 * unspecified by ape_attention_backward_dlpack() once the work was launched (the gradients are
 * copied into them one by one, and the final synchronisation can fail after all of them):
 * each of dq, dk, dv and dparams must still be untouched or the clean result, never a mix or
 * garbage. */
static bool each_untouched_or_clean(const struct bcall *b)
{
	const size_t np = sizeof(float) * (size_t)(4 * b->g.H);

	return (same_bits(&b->g.dq, &b->poisoned.dq) || same_bits(&b->g.dq, &b->clean.dq)) &&
	       (same_bits(&b->g.dk, &b->poisoned.dk) || same_bits(&b->g.dk, &b->clean.dk)) &&
	       (same_bits(&b->g.dv, &b->poisoned.dv) || same_bits(&b->g.dv, &b->clean.dv)) &&
	       (!memcmp(b->g.dparams, b->poisoned.dparams, np) ||
		!memcmp(b->g.dparams, b->clean.dparams, np));
}

/* NULL when the inputs are intact and the outputs are the clean result (ret == 0) or untouched
 * (ret != 0; the DLPack call: see each_untouched_or_clean()); otherwise what is wrong. */
static const char *bcall_verify(struct bcall *b, int ret)
{
	const void *ptr[7];
	size_t n[7], off = 0;

	inputs(b, ptr, n);
	for (int i = 0; i < 7; i++) {
		if (memcmp(b->in + off, ptr[i], n[i]))
			return "an input changed";
		off += n[i];
	}
	if (!ret)
		return same_grads(&b->g, &b->clean, W_ALL) ? NULL : "not the clean result";
	if (b->dlpack)
		return each_untouched_or_clean(b) ? NULL
						  : "a failed call left an output neither untouched "
						    "nor clean";
	return same_grads(&b->g, &b->poisoned, W_ALL) ? NULL : "a failed call wrote an output";
}

/* The call on dev (ndev entries of it; dlpack: the DLPack call, ndev 1, chunk 0), run once
 * cleanly: 0, or -1 (its message in b->msg when the clean run failed). */
static int bcall_init(struct bcall *b, ape_device *dev, int ndev, int64_t chunk, bool dlpack)
{
	const test_problem_shape sh = { 1, 4, 2, 12, 12, 8 };
	const void *ptr[7];
	size_t n[7], off = 0;
	ape_rng rng;

	memset(b, 0, sizeof(*b));
	b->dev = dev;
	b->ndev = ndev;
	b->chunk = chunk;
	b->dlpack = dlpack;
	ape_rng_init(&rng, "bwdfail");
	if (bcase_make(&b->c, &rng, &sh, APE_F16, true, true))
		return -1;
	test_problem_random_params(&b->c.tp, &rng);
	b->c.tp.desc.q_start_set = false; /* end-aligned: every query row sees keys */
	if (bcase_forward(&b->c, dev) || grads_alloc(&b->g, &b->c, APE_F16) ||
	    grads_alloc(&b->clean, &b->c, APE_F16) || grads_alloc(&b->poisoned, &b->c, APE_F16))
		return -1;
	inputs(b, ptr, n);
	for (int i = 0; i < 7; i++)
		b->in_bytes += n[i];
	b->in = malloc(b->in_bytes + 1);
	if (!b->in)
		return -1;
	for (int i = 0; i < 7; i++) {
		memcpy(b->in + off, ptr[i], n[i]);
		off += n[i];
	}
	if (bcall_run(b))
		return -1;
	memcpy(b->clean.dq.alloc, b->g.dq.alloc, b->g.dq.alloc_bytes);
	memcpy(b->clean.dk.alloc, b->g.dk.alloc, b->g.dk.alloc_bytes);
	memcpy(b->clean.dv.alloc, b->g.dv.alloc, b->g.dv.alloc_bytes);
	memcpy(b->clean.dparams, b->g.dparams, sizeof(float) * (size_t)(4 * b->g.H));
	return 0;
}

static void bcall_free(struct bcall *b)
{
	bcase_free(&b->c);
	grads_free(&b->g);
	grads_free(&b->clean);
	grads_free(&b->poisoned);
	free(b->in);
}

#ifdef APE_FAULT_INJECT
static void alloc_sweep(struct __test_metadata *_metadata, const char *backend, int ndev,
			int64_t chunk, bool dlpack, const char *what)
{
	ape_context *ctx = test_context(backend);
	ape_device *dev = test_device(ctx, backend);
	struct bcall b;
	uint64_t total, recovered = 0;
	int ret;

	if (!dev) {
		ksft_print_msg("%s: no %s device, not tested\n", what, backend);
		ape_context_destroy(ctx);
		return;
	}
	ASSERT_EQ(0, bcall_init(&b, dev, ndev, chunk, dlpack)) TH_LOG("%s", b.msg);
	ape__fault_alloc_arm(0);
	ASSERT_EQ(0, bcall_run(&b));
	total = ape__fault_alloc_count();
	ASSERT_GT(total, 0u);
	for (uint64_t n = 1; n <= total; n++) {
		ape__fault_alloc_arm(n);
		ret = bcall_run(&b);
		ape__fault_alloc_arm(0);
		/* where the library has a fallback (a statistic dropped, fewer key chunks kept
		 * resident) the run succeeds: then with the clean result */
		EXPECT_EQ(NULL, bcall_verify(&b, ret)) TH_LOG("%s: allocation %llu", what,
							      (unsigned long long)n);
		if (!ret) {
			recovered++;
			continue;
		}
		EXPECT_EQ(APE_ENOMEM, ret) TH_LOG("%s: allocation %llu: %s", what,
						  (unsigned long long)n, b.msg);
		EXPECT_NE(0, b.msg[0]);
		if (dlpack) { /* every host allocation comes before the launch: nothing written */
			EXPECT_NE(NULL, strstr(b.msg, "ape_attention_backward_dlpack"))
			TH_LOG("%s: allocation %llu: the message does not name the call: %s", what,
			       (unsigned long long)n, b.msg);
			EXPECT_TRUE(same_grads(&b.g, &b.poisoned, W_ALL))
			TH_LOG("%s: allocation %llu: a failed call wrote an output", what,
			       (unsigned long long)n);
		}
	}
	EXPECT_LT(recovered, total) TH_LOG("%s: no allocation failure reached the caller", what);
	EXPECT_EQ(0, bcall_run(&b)) TH_LOG("%s", b.msg);
	EXPECT_EQ(NULL, bcall_verify(&b, 0));
	ksft_print_msg("%s: %llu allocations failed in turn, %llu runs recovered\n", what,
		       (unsigned long long)total, (unsigned long long)recovered);
	fflush(stdout); /* the harness ends each test with _exit() */
	bcall_free(&b);
	ape_context_destroy(ctx);
}
#endif

TEST(allocation_failures)
{
#ifdef APE_FAULT_INJECT
	alloc_sweep(_metadata, "ref", 1, 0, false, "backward, one launch");
	alloc_sweep(_metadata, "ref", 1, 4, false, "backward, 3 x 3 chunks");
	alloc_sweep(_metadata, "ref", 2, 4, false, "backward, 3 x 3 chunks, two devices");
#else
	SKIP(return, "libape built without -DAPE_FAULT_INJECT: run `make faults-ci`");
#endif
}

/* ape_attention_backward_dlpack() on kDLCPU tensors (wrappers, a queue, scratch, the launch), on
 * the reference and on an OpenCL CPU device. */
TEST(dlpack_allocation_failures)
{
#ifdef APE_FAULT_INJECT
	alloc_sweep(_metadata, "ref", 1, 0, true, "backward on DLPack tensors, ref");
	alloc_sweep(_metadata, "opencl", 1, 0, true, "backward on DLPack tensors, opencl");
#else
	SKIP(return, "libape built without -DAPE_FAULT_INJECT: run `make faults-ci`");
#endif
}

/* One broken run: the injected code, a message naming the device and the operation, nothing
 * written, and the next call clean; or, for a device buffer the executor can do without (a key
 * chunk it would have kept resident: *absorbed counts them), success with the clean result. */
static void judge(struct __test_metadata *_metadata, struct bcall *b, int ret, int expect,
		  const char *op, const char *what, uint64_t n, uint64_t *absorbed)
{
	if (!ret && absorbed) {
		(*absorbed)++;
		EXPECT_EQ(NULL, bcall_verify(b, 0)) TH_LOG("%s: %s #%llu absorbed: %s", what, op,
							   (unsigned long long)n,
							   bcall_verify(b, 0));
		return;
	}
	EXPECT_EQ(expect, ret) TH_LOG("%s #%llu: %s", what, (unsigned long long)n, b->msg);
	EXPECT_NE(NULL, strstr(b->msg, b->dev->info.name)) TH_LOG("%s: %s", what, b->msg);
	EXPECT_NE(NULL, strstr(b->msg, "fails on purpose")) TH_LOG("%s: %s", what, b->msg);
	if (op)
		EXPECT_NE(NULL, strstr(b->msg, op)) TH_LOG("%s: %s", what, b->msg);
	if (b->dlpack) {
		const struct wrap_counts c = wrap_get();

		EXPECT_NE(NULL, strstr(b->msg, "ape_attention_backward_dlpack"))
		TH_LOG("%s: the message does not name the call: %s", what, b->msg);
		/* wrappers hold no device memory (LSan sees their host side) */
		EXPECT_EQ(0u, c.live_bytes) TH_LOG("%s #%llu: device memory or scratch left", what,
						   (unsigned long long)n);
	}
	EXPECT_EQ(NULL, bcall_verify(b, ret)) TH_LOG("%s: %s #%llu: %s", what, op ? op : "",
						     (unsigned long long)n, bcall_verify(b, ret));
	EXPECT_EQ(0, bcall_run(b)) TH_LOG("after %s #%llu: %s", what, (unsigned long long)n,
					  b->msg);
	EXPECT_EQ(NULL, bcall_verify(b, 0));
}

/* On the backend's device (the wrapper installed with wflags): the ops of ops[] (dlpack: every
 * op the clean call makes) failed at each occurrence in turn, then the device lost from each
 * point on. A host call that copies nothing (inputs read where they lie: bwd_views) skips
 * copy_h2d. */
static void device_sweep(struct __test_metadata *_metadata, const char *backend, int ndev,
			 int64_t chunk, bool dlpack, unsigned wflags, const char *what)
{
	static const enum wrap_op host_ops[] = { WRAP_BUF_ALLOC,	     WRAP_QUEUE_CREATE,
					    WRAP_COPY_H2D,	     WRAP_COPY_D2H,
					    WRAP_FILL,		     WRAP_EVENT_RECORD,
					    WRAP_EVENT_ELAPSED,	     WRAP_SYNCHRONIZE,
					    WRAP_ATTENTION_BACKWARD };
	/* what the DLPack call must make at least (the others it makes are failed too) */
	static const enum wrap_op dlpack_ops[] = { WRAP_BUF_WRAP, WRAP_QUEUE_CREATE,
						   WRAP_ATTENTION_BACKWARD, WRAP_SYNCHRONIZE };
	ape_context *ctx = test_context(backend);
	ape_device *dev = test_device(ctx, backend);
	struct wrap_counts clean;
	uint64_t total = 0, runs = 0, wrote = 0, absorbed = 0;
	enum wrap_op ops[WRAP_NOPS];
	size_t nops = 0;
	struct bcall b;

	if (!dev) {
		ksft_print_msg("%s: no %s device, not tested\n", what, backend);
		ape_context_destroy(ctx);
		return;
	}
	wrap_install(dev, wflags);
	ASSERT_EQ(0, bcall_init(&b, dev, ndev, chunk, dlpack)) TH_LOG("%s", b.msg);
	wrap_reset();
	ASSERT_EQ(0, bcall_run(&b));
	clean = wrap_get();
	if (dlpack) {
		for (size_t i = 0; i < sizeof(dlpack_ops) / sizeof(dlpack_ops[0]); i++) {
			ASSERT_LT(0u, clean.calls[dlpack_ops[i]])
			TH_LOG("%s: no %s", what, wrap_op_name(dlpack_ops[i]));
		}
		for (int op = 0; op < WRAP_NOPS; op++)
			if (clean.calls[op]) {
				ops[nops++] = (enum wrap_op)op;
				ksft_print_msg("%s: %s x %llu\n", what, wrap_op_name((enum wrap_op)op),
					       (unsigned long long)clean.calls[op]);
			}
	} else {
		for (size_t i = 0; i < sizeof(host_ops) / sizeof(host_ops[0]); i++)
			if (host_ops[i] != WRAP_COPY_H2D || clean.calls[WRAP_COPY_H2D] ||
			    !ape_be_dev_has(dev, APE_BE_CAP_BWD_VIEWS | APE_BE_CAP_HOST_MEMORY))
				ops[nops++] = host_ops[i];
	}
	for (size_t i = 0; i < nops; i++) {
		ASSERT_LT(0u, clean.calls[ops[i]]) TH_LOG("%s: no %s", what, wrap_op_name(ops[i]));
		for (uint64_t n = 1; n <= clean.calls[ops[i]]; n++, runs++) {
			int ret;

			wrap_fail_op(ops[i], n);
			ret = bcall_run(&b);
			wrap_fail_op(ops[i], 0);
			wrote += ret && !same_grads(&b.g, &b.poisoned, W_ALL);
			judge(_metadata, &b, ret,
			      ops[i] == WRAP_BUF_ALLOC || ops[i] == WRAP_BUF_WRAP ||
					      ops[i] == WRAP_SCRATCH_ALLOC
				      ? APE_ENOMEM
				      : APE_EDEVLOST,
			      wrap_op_name(ops[i]), what, n,
			      ops[i] == WRAP_BUF_ALLOC ? &absorbed : NULL);
		}
		total += clean.calls[ops[i]];
	}
	for (uint64_t k = 1; k <= total; k++, runs++) { /* lost from call k on */
		int ret;

		wrap_lose_device(k);
		ret = bcall_run(&b);
		wrap_lose_device(0);
		wrote += ret && !same_grads(&b.g, &b.poisoned, W_ALL);
		judge(_metadata, &b, ret, APE_EDEVLOST, "device lost", what, k, NULL);
	}
	EXPECT_LT(absorbed, runs);
	ksft_print_msg("%s: %llu broken runs, %llu of them after outputs were written, %llu "
		       "buffer failures absorbed\n",
		       what, (unsigned long long)runs, (unsigned long long)wrote,
		       (unsigned long long)absorbed);
	fflush(stdout);
	bcall_free(&b);
	wrap_remove();
	ape_context_destroy(ctx);
}

TEST(device_failures)
{
	/* one launch reads the inputs where they lie (bwd_views), or packs copies of them */
	device_sweep(_metadata, "ref", 1, 0, false, 0, "backward, one launch");
	device_sweep(_metadata, "ref", 1, 0, false, WRAP_NO_BWD_VIEWS,
		     "backward, one launch, inputs copied");
	device_sweep(_metadata, "ref", 1, 4, false, 0, "backward, 3 x 3 chunks");
	/* the two threads' calls interleave: the n-th call of an op falls in either */
	device_sweep(_metadata, "ref", 2, 4, false, 0, "backward, 3 x 3 chunks, two devices");
}

/* ape_attention_backward_dlpack() on kDLCPU tensors, on the reference and on an OpenCL CPU
 * device (both compute on host memory): each op of wrapping, queue, scratch, launch and
 * synchronisation failed in turn, then the device lost from each point on. */
TEST(dlpack_device_failures)
{
	device_sweep(_metadata, "ref", 1, 0, true, 0, "backward on DLPack tensors, ref");
	device_sweep(_metadata, "opencl", 1, 0, true, 0, "backward on DLPack tensors, opencl");
}

/* Launch n of a streamed call fails, for each n, on the reference and OpenCL. */
TEST(backward_launch_failures_on_every_backend)
{
	static const char *const backends[] = { "ref", "opencl" };
	ape_context *ctx = test_context("ref,opencl");

	ASSERT_NE(NULL, ctx);
	for (size_t i = 0; i < sizeof(backends) / sizeof(backends[0]); i++) {
		ape_device *dev = test_device(ctx, backends[i]);
		struct wrap_counts clean, after;
		struct bcall b;

		if (!dev) {
			ksft_print_msg("%s: no device, not tested\n", backends[i]);
			continue;
		}
		wrap_install(dev, 0);
		ASSERT_EQ(0, bcall_init(&b, dev, 1, 4, false)) TH_LOG("%s: %s", backends[i], b.msg);
		wrap_reset();
		ASSERT_EQ(0, bcall_run(&b));
		clean = wrap_get();
		ASSERT_LT(1u, clean.calls[WRAP_ATTENTION_BACKWARD]);
		for (uint64_t n = 1; n <= clean.calls[WRAP_ATTENTION_BACKWARD]; n++) {
			int ret;

			wrap_fail_op(WRAP_ATTENTION_BACKWARD, n);
			ret = bcall_run(&b);
			wrap_fail_op(WRAP_ATTENTION_BACKWARD, 0);
			judge(_metadata, &b, ret, APE_EDEVLOST, "attention_backward", backends[i], n, NULL);
		}
		after = wrap_get();
		EXPECT_EQ(0u, after.live_bytes) TH_LOG("%s: device memory still held", backends[i]);
		EXPECT_EQ(after.allocs, after.frees) TH_LOG("%s", backends[i]);
		ksft_print_msg("%s: %llu launches failed in turn, %llu bytes of scratch declared "
			       "per launch at most\n",
			       backends[i], (unsigned long long)clean.calls[WRAP_ATTENTION_BACKWARD],
			       (unsigned long long)after.bwd_scratch_max);
		fflush(stdout);
		bcall_free(&b);
		wrap_remove();
	}
	ape_context_destroy(ctx);
}

/* ---------------------------------------------------------------- on device tensors */

/* One resident call of b's case into b->g (poisoned first); its message in b->msg. */
static int rcall_run(struct bcall *b)
{
	int ret;

	poison(&b->g);
	ret = run_enqueue_backward(&b->c, b->dev, &b->g, W_ALL, 4);
	snprintf(b->msg, sizeof(b->msg), "%s", ret ? ape_last_error() : "");
	return ret;
}

/* A broken resident run: the code, the device named, every buffer and scratch released (the
 * test's own buffers too: run_enqueue_backward() frees them), then a clean run. */
static void rjudge(struct __test_metadata *_metadata, struct bcall *b, int ret, int expect,
		   const char *op, uint64_t n)
{
	const struct wrap_counts c = wrap_get();

	EXPECT_EQ(expect, ret) TH_LOG("%s #%llu: %s", op, (unsigned long long)n, b->msg);
	EXPECT_NE(NULL, strstr(b->msg, b->dev->info.name)) TH_LOG("%s: %s", op, b->msg);
	EXPECT_NE(NULL, strstr(b->msg, "fails on purpose")) TH_LOG("%s: %s", op, b->msg);
	EXPECT_NE(NULL, strstr(b->msg, op)) TH_LOG("%s: %s", op, b->msg);
	EXPECT_EQ(c.allocs, c.frees) TH_LOG("%s #%llu: device memory left", op,
					     (unsigned long long)n);
	EXPECT_EQ(0, rcall_run(b)) TH_LOG("after %s #%llu: %s", op, (unsigned long long)n, b->msg);
	EXPECT_TRUE(same_grads(&b->g, &b->clean, W_ALL)) TH_LOG("after %s #%llu", op,
								(unsigned long long)n);
}

TEST(resident_device_failures)
{
	static const enum wrap_op ops[] = { WRAP_SCRATCH_ALLOC, WRAP_COPY_VIEW, WRAP_FILL,
					    WRAP_ATTENTION_BACKWARD };
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	struct wrap_counts clean;
	uint64_t runs = 0, total = 0;
	struct bcall b;

	wrap_install(dev, 0);
	ASSERT_EQ(0, bcall_init(&b, dev, 1, 0, false)) TH_LOG("%s", b.msg);
	/* the host call's gradients are the resident call's on the reference */
	wrap_reset();
	ASSERT_EQ(0, rcall_run(&b)) TH_LOG("%s", b.msg);
	EXPECT_TRUE(same_grads(&b.g, &b.clean, W_ALL));
	clean = wrap_get();
	EXPECT_EQ(clean.allocs, clean.frees);
	for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
		ASSERT_LT(0u, clean.calls[ops[i]]) TH_LOG("no %s", wrap_op_name(ops[i]));
		for (uint64_t n = 1; n <= clean.calls[ops[i]]; n++, runs++) {
			int ret;

			wrap_fail_op(ops[i], n);
			ret = rcall_run(&b);
			wrap_fail_op(ops[i], 0);
			rjudge(_metadata, &b, ret,
			       ops[i] == WRAP_SCRATCH_ALLOC ? APE_ENOMEM : APE_EDEVLOST,
			       wrap_op_name(ops[i]), n);
		}
	}
	for (int op = 0; op < WRAP_NOPS; op++)
		total += clean.calls[op];
	for (uint64_t k = 1; k <= total; k++, runs++) { /* lost from fallible call k on */
		int ret;

		wrap_lose_device(k);
		ret = rcall_run(&b);
		wrap_lose_device(0);
		rjudge(_metadata, &b, ret, APE_EDEVLOST, "device lost", k);
	}
	ksft_print_msg("resident backward: %llu broken runs\n", (unsigned long long)runs);
	fflush(stdout);
	bcall_free(&b);
	wrap_remove();
	ape_context_destroy(ctx);
}

TEST(resident_allocation_failures)
{
#ifdef APE_FAULT_INJECT
	ape_context *ctx = test_context("ref");
	struct bcall b;
	uint64_t total;
	int ret;

	ASSERT_EQ(0, bcall_init(&b, test_device(ctx, "ref"), 1, 0, false)) TH_LOG("%s", b.msg);
	ape__fault_alloc_arm(0);
	ASSERT_EQ(0, rcall_run(&b));
	total = ape__fault_alloc_count();
	ASSERT_GT(total, 0u);
	for (uint64_t n = 1; n <= total; n++) {
		ape__fault_alloc_arm(n);
		ret = rcall_run(&b);
		ape__fault_alloc_arm(0);
		EXPECT_EQ(APE_ENOMEM, ret) TH_LOG("allocation %llu: %s", (unsigned long long)n, b.msg);
		EXPECT_NE(0, b.msg[0]);
	}
	EXPECT_EQ(0, rcall_run(&b)) TH_LOG("%s", b.msg);
	EXPECT_TRUE(same_grads(&b.g, &b.clean, W_ALL));
	ksft_print_msg("resident backward: %llu allocations failed in turn\n",
		       (unsigned long long)total);
	fflush(stdout);
	bcall_free(&b);
	ape_context_destroy(ctx);
#else
	SKIP(return, "libape built without -DAPE_FAULT_INJECT: run `make faults-ci`");
#endif
}

TEST_HARNESS_MAIN
