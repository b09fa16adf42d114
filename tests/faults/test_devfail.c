/* SPDX-License-Identifier: MIT */
/*
 * Device-failure injection: a wrapper backend (tests/common/wrapops.c) in front of the
 * reference or the OpenCL backend fails each fallible op at each of its occurrences in turn,
 * then loses the device for good from each point of the run on, for a one-shot call, a streamed
 * call (3 x 3 chunks, pipelined), a call over two devices (the wrapped one failing, the other
 * healthy), a KV-cache session, the device-resident path (buffers, queue,
 * ape_attention_enqueue), the DLPack call, and the diagnostics calls
 * (ape_attention_forward_diag, ape_kv_cache_attend_diag, ape_attention_enqueue_diag,
 * ape_attention_forward_dlpack_diag), a copy-bandwidth measurement (ape_device_measure_h2d);
 * and a device lost between ape_attention_enqueue() and ape_queue_synchronize(). Every broken
 * run must return the injected error with a message that names the device and the operation,
 * leave the inputs byte-identical and the outputs as README's 'Outputs on failure' says, and
 * must not hang; the context must then serve the next call, on this device and the other one,
 * with the clean result; ASan/LSan (make faults-ci) see no leak.
 */
#include "ape_test.h"

#include <string.h>

#include "common/wrapops.h"
#include "faults/faultcheck.h"
#include "faults/fixture.h"

FX_FIXTURE(df)

/* Ops whose failure the library may absorb, because it has a fallback that only costs speed:
 * pinning (plain memory works), a device buffer beyond the first key/value slots (fewer key
 * chunks stay resident, runtime/exec/stream.c). The result must still be the clean one. */
static bool absorbable(enum wrap_op op)
{
	return op == WRAP_HOST_REGISTER || op == WRAP_BUF_ALLOC;
}

struct tally {
	uint64_t points, errors, absorbed;
};

/* One broken run of c just happened (ret); `op` failed in it unless injected == 0 (-1: any op,
 * the device was lost). Checks the report, the buffers, and that the next call works. */
static void judge(struct __test_metadata *_metadata, fx_call *c, ape_device *healthy, int ret,
		  int op, uint64_t injected, const char *what, uint64_t n, struct tally *t)
{
	const char *name = c->devs[0]->info.name, *bad;

	if (!injected) {
		EXPECT_EQ(0, ret) TH_LOG("%s #%llu: nothing injected, yet %s", what,
					 (unsigned long long)n, c->msg);
		return;
	}
	t->points++;
	if (!ret) {
		t->absorbed++;
		EXPECT_TRUE(op >= 0 && absorbable((enum wrap_op)op))
			TH_LOG("%s #%llu: a failure was swallowed", what, (unsigned long long)n);
	} else {
		t->errors++;
		EXPECT_EQ(op == WRAP_BUF_ALLOC || op == WRAP_BUF_WRAP ? APE_ENOMEM : APE_EDEVLOST,
			  ret)
			TH_LOG("%s #%llu: %s", what, (unsigned long long)n, c->msg);
		EXPECT_NE(NULL, strstr(c->msg, name))
			TH_LOG("%s #%llu: the message does not name the device: %s", what,
			       (unsigned long long)n, c->msg);
		EXPECT_NE(NULL, strstr(c->msg, "fails on purpose"))
			TH_LOG("%s #%llu: the message does not name the operation: %s", what,
			       (unsigned long long)n, c->msg);
		if (op >= 0)
			EXPECT_NE(NULL, strstr(c->msg, wrap_op_name((enum wrap_op)op)))
				TH_LOG("%s #%llu: %s", what, (unsigned long long)n, c->msg);
	}
	bad = fx_call_verify(c, ret);
	EXPECT_EQ(NULL, bad) TH_LOG("%s #%llu: %s (%s)", what, (unsigned long long)n, bad, c->msg);
	/* the context and the device serve the next call, and so does the other device */
	EXPECT_EQ(0, fx_call_run(c)) TH_LOG("after %s #%llu: %s", what, (unsigned long long)n,
					    c->msg);
	EXPECT_EQ(NULL, fx_call_verify(c, 0));
	if (healthy && c->ndev == 1 && n == 1) { /* once per op: the other backend is slow */
		ape_device *keep = c->devs[0];

		c->devs[0] = healthy;
		c->exact = false; /* another backend: the clean result within tolerance */
		EXPECT_EQ(0, fx_call_run(c)) TH_LOG("other device after %s: %s", what, c->msg);
		EXPECT_EQ(NULL, fx_call_verify(c, 0));
		c->devs[0] = keep;
		c->exact = true;
	}
}

/* Every op at every occurrence, then the device lost from every point on. */
static void sweep(struct __test_metadata *_metadata, fx_call *c, ape_device *healthy,
		  const char *what)
{
	struct tally t = { 0 };
	struct wrap_counts wc;
	uint64_t total = 0;
	char label[128];
	int ret;

	wrap_install(c->devs[0], 0);
	wrap_reset();
	ASSERT_EQ(0, fx_call_run(c)) TH_LOG("%s", c->msg);
	wc = wrap_get();
	for (int op = 0; op < WRAP_NOPS; op++) {
		total += wc.calls[op];
		snprintf(label, sizeof(label), "%s: %s", what, wrap_op_name((enum wrap_op)op));
		for (uint64_t n = 1; n <= wc.calls[op]; n++) {
			uint64_t before = wrap_get().failed;

			wrap_fail_op((enum wrap_op)op, n);
			ret = fx_call_run(c);
			wrap_fail_op((enum wrap_op)op, 0);
			judge(_metadata, c, healthy, ret, op, wrap_get().failed - before, label, n,
			      &t);
		}
	}
	snprintf(label, sizeof(label), "%s: device lost at op", what);
	for (uint64_t k = 1; k <= total; k++) {
		uint64_t before = wrap_get().failed;

		wrap_lose_device(k);
		ret = fx_call_run(c);
		wrap_lose_device(0);
		judge(_metadata, c, healthy, ret, -1, wrap_get().failed - before, label, k, &t);
	}
	wrap_remove();
	ksft_print_msg("%s: %llu failure points (%llu ops per clean run): %llu errors, %llu "
		       "absorbed\n", what, (unsigned long long)t.points, (unsigned long long)total,
		       (unsigned long long)t.errors, (unsigned long long)t.absorbed);
	fflush(stdout); /* the harness ends each test with _exit() */
}

/* Prepares the call (its clean run first) and sweeps it. */
static void run_case(struct __test_metadata *_metadata, ape_device **devs, int ndev,
		     enum fx_mode mode, int64_t L, int64_t chunk, ape_device *healthy,
		     const char *what)
{
	fx_call c;

	ASSERT_EQ(0, fx_call_init(&c, devs, ndev, mode, L, chunk)) TH_LOG("%s", c.msg);
	sweep(_metadata, &c, healthy, what);
	fx_call_free(&c);
}

TEST_F_TIMEOUT(df, one_shot, 600)
{
	run_case(_metadata, self->dev, 1, FX_FORWARD, 64, 0, self->dev[1], "one-shot");
}

TEST_F_TIMEOUT(df, streamed, 600)
{
	run_case(_metadata, self->dev, 1, FX_FORWARD, 192, 64, self->dev[1], "streamed 3x3");
}

/* The wrapped device fails, the other one is healthy: the call fails (no redistribution: the
 * design stops every worker at the first failure) and names the failing device. */
TEST_F_TIMEOUT(df, two_devices, 600)
{
	run_case(_metadata, self->dev, 2, FX_FORWARD, 192, 64, NULL, "two devices");
}

TEST_F_TIMEOUT(df, kv_cache, 600)
{
	run_case(_metadata, self->dev, 1, FX_KV, 80, 0, self->dev[1], "KV cache");
}

/* The second append from device buffers (ape_kv_cache_append_device), then
 * ape_kv_cache_release_unreachable, then the attend. */
TEST_F_TIMEOUT(df, kv_cache_device_append, 600)
{
	run_case(_metadata, self->dev, 1, FX_KV_DEVICE, 80, 0, self->dev[1],
		 "KV cache, device append");
}

/* The device-resident path: each op of queue, buffers, writes, enqueue, reads and
 * synchronisation failed in turn, then the device lost from each point on. */
TEST_F_TIMEOUT(df, enqueue, 600)
{
	run_case(_metadata, self->dev, 1, FX_ENQUEUE, 64, 0, self->dev[1], "resident");
}

/* The DLPack call on kDLCPU tensors (wrappers of host memory, libape's queue). */
TEST_F_TIMEOUT(df, dlpack, 600)
{
	const char *why = fx_no_host_memory(self->dev[0]);

	if (why)
		SKIP(return, "kDLCPU tensors need a device computing on host memory: %s", why);
	run_case(_metadata, self->dev, 1, FX_DLPACK, 64, 0, NULL, "DLPack");
}

/* ape_attention_forward_dlpack_diag() on kDLCPU tensors: entropy and mean distance too. */
TEST_F_TIMEOUT(df, dlpack_diag, 600)
{
	const char *why = fx_no_host_memory(self->dev[0]);

	if (why)
		SKIP(return, "kDLCPU tensors need a device computing on host memory: %s", why);
	run_case(_metadata, self->dev, 1, FX_DLPACK_DIAG, 64, 0, NULL, "DLPack diag");
}

/* The diagnostics calls (docs/diagnostics.md): one-shot and streamed forward, over two devices,
 * the KV cache's attend and the resident call, each op failed in turn and the device lost from
 * each point on; the entropy and mean distance rows follow O's (written and clean, or
 * untouched). */
TEST_F_TIMEOUT(df, diag_one_shot, 600)
{
	run_case(_metadata, self->dev, 1, FX_DIAG, 64, 0, self->dev[1], "diag one-shot");
}

TEST_F_TIMEOUT(df, diag_streamed, 600)
{
	run_case(_metadata, self->dev, 1, FX_DIAG, 192, 64, self->dev[1], "diag streamed 3x3");
}

TEST_F_TIMEOUT(df, diag_two_devices, 600)
{
	run_case(_metadata, self->dev, 2, FX_DIAG, 192, 64, NULL, "diag two devices");
}

TEST_F_TIMEOUT(df, diag_kv_cache, 600)
{
	run_case(_metadata, self->dev, 1, FX_KV_DIAG, 80, 0, self->dev[1], "diag KV cache");
}

TEST_F_TIMEOUT(df, diag_enqueue, 600)
{
	run_case(_metadata, self->dev, 1, FX_ENQUEUE_DIAG, 64, 0, self->dev[1], "diag resident");
}

/*
 * ape_device_measure_h2d(): each op of its buffers, queue, copies, events and synchronisation
 * failed in turn, then the device lost from each point on: the injected code with a message
 * naming the device and the operation (or, for a failed pinning, a measurement from plain
 * memory), no device memory left, and the next measurement works.
 */
TEST_F_TIMEOUT(df, measure_h2d, 600)
{
	ape_device *dev = self->dev[0];
	uint64_t total = 0, points = 0;
	struct wrap_counts wc;
	ape_copy_result res;
	int ret;

	wrap_install(dev, 0);
	wrap_reset();
	ASSERT_EQ(0, ape_device_measure_h2d(dev, -1, 1 << 16, 2, &res)) TH_LOG("%s",
										 ape_last_error());
	wc = wrap_get();
	for (int op = 0; op < WRAP_NOPS; op++)
		total += wc.calls[op];
	for (int op = 0; op <= WRAP_NOPS; op++) {
		/* op WRAP_NOPS: the device lost from each fallible call on */
		const bool lost = op == WRAP_NOPS;
		const char *what = lost ? "device lost" : wrap_op_name((enum wrap_op)op);

		for (uint64_t n = 1; n <= (lost ? total : wc.calls[op]); n++, points++) {
			const char *m;

			if (lost)
				wrap_lose_device(n);
			else
				wrap_fail_op((enum wrap_op)op, n);
			ret = ape_device_measure_h2d(dev, -1, 1 << 16, 2, &res);
			if (lost)
				wrap_lose_device(0);
			else
				wrap_fail_op((enum wrap_op)op, 0);
			m = ape_last_error();
			if (!ret) {
				EXPECT_TRUE(!lost && absorbable((enum wrap_op)op))
				TH_LOG("%s #%llu: a failure was swallowed", what, (unsigned long long)n);
			} else {
				EXPECT_EQ(op == WRAP_BUF_ALLOC || op == WRAP_BUF_WRAP ? APE_ENOMEM
										       : APE_EDEVLOST,
					  ret)
				TH_LOG("%s #%llu: %s", what, (unsigned long long)n, m);
				EXPECT_NE(NULL, strstr(m, dev->info.name)) TH_LOG("%s", m);
				EXPECT_NE(NULL, strstr(m, "fails on purpose")) TH_LOG("%s", m);
				if (!lost)
					EXPECT_NE(NULL, strstr(m, what)) TH_LOG("%s", m);
			}
			EXPECT_EQ(0u, wrap_get().live_bytes)
			TH_LOG("%s #%llu: device memory left", what, (unsigned long long)n);
			EXPECT_EQ(0, ape_device_measure_h2d(dev, -1, 1 << 16, 2, &res))
			TH_LOG("after %s #%llu: %s", what, (unsigned long long)n, ape_last_error());
		}
	}
	wrap_remove();
	ksft_print_msg("measure_h2d: %llu failure points (%llu ops per clean run)\n",
		       (unsigned long long)points, (unsigned long long)total);
	fflush(stdout);
}

/*
 * The device is lost after ape_attention_enqueue() returned: the failure comes out of the next
 * ape_queue_synchronize(), naming the device and the call that enqueued the work; the buffers
 * and the queue are still released, and the device serves the next call once it works again.
 */
TEST_F_TIMEOUT(df, lost_after_enqueue_reported_at_synchronize, 600)
{
	ape_device *dev = self->dev[0];
	const char *name = dev->info.name;
	ape_buffer *b[4] = { NULL };
	ape_dtensor t[4];
	ape_queue *q = NULL;
	fx_call c;
	int ret;

	ASSERT_EQ(0, fx_call_init(&c, self->dev, 1, FX_ENQUEUE, 32, 0)) TH_LOG("%s", c.msg);
	wrap_install(dev, 0);
	ASSERT_EQ(0, ape_queue_create(dev, &q)) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < 4; i++) {
		const ape_tensor *h = i == 0 ? &c.tp.q.t : i == 1 ? &c.tp.k.t : i == 2 ? &c.tp.v.t
										: &c.tp.o.t;
		const size_t bytes = (size_t)(h->shape[0] * h->shape[1] * h->shape[2] * h->shape[3]) *
				     sizeof(float);

		ASSERT_EQ(0, ape_buffer_alloc(dev, bytes, &b[i])) TH_LOG("%s", ape_last_error());
		ape_dtensor_init(&t[i], b[i], 0, APE_F32, h->shape[0], h->shape[1], h->shape[2],
				 h->shape[3]);
		if (i < 3)
			ASSERT_EQ(0, ape_buffer_write(q, b[i], 0, h->data, bytes));
	}
	ASSERT_EQ(0, ape_queue_synchronize(q)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_attention_enqueue(q, &c.tp.desc, &t[0], &t[1], &t[2], &t[3], NULL))
	TH_LOG("%s", ape_last_error());
	wrap_lose_device(1); /* from the next fallible op on */
	ret = ape_queue_synchronize(q);
	EXPECT_EQ(APE_EDEVLOST, ret);
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_queue_synchronize")) TH_LOG("%s",
										    ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue #4"))
	TH_LOG("the message does not name the call: %s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), name))
	TH_LOG("the message does not name the device: %s", ape_last_error());
	/* a lost device fails every later op too; release still works */
	EXPECT_EQ(APE_EDEVLOST, ape_attention_enqueue(q, &c.tp.desc, &t[0], &t[1], &t[2], &t[3],
						      NULL));
	ape_queue_destroy(q);
	for (int i = 0; i < 4; i++)
		ape_buffer_free(b[i]);
	wrap_lose_device(0);
	EXPECT_EQ(0, wrap_get().live_bytes) TH_LOG("device buffers leaked");
	EXPECT_EQ(0, fx_call_run(&c)) TH_LOG("%s", c.msg);
	EXPECT_EQ(NULL, fx_call_verify(&c, 0));
	wrap_remove();
	fx_call_free(&c);
}

TEST_HARNESS_MAIN
