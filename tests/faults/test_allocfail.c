/* SPDX-License-Identifier: MIT */
/*
 * Allocation-failure injection: for a device enumeration, forward calls (one-shot and streamed,
 * reference and OpenCL, one and two devices), a KV-cache session, the device-resident path
 * (buffers, queue, ape_attention_enqueue), the DLPack call and the diagnostics calls
 * (ape_attention_forward_diag, ape_kv_cache_attend_diag, ape_attention_enqueue_diag,
 * ape_attention_forward_dlpack_diag) and a copy-bandwidth measurement (ape_device_measure_h2d),
 * counts the library's host allocations of a clean run, then fails each one in turn. Every
 * broken run must return APE_ENOMEM with a message (or, where the library has a fallback,
 * succeed with the clean result), leave the inputs byte-identical and the outputs as README
 * promises; the context must serve the next call; LeakSanitizer (make faults-ci builds with
 * ASan) finds no leak. Needs a build with -DAPE_FAULT_INJECT (runtime/core/alloc.h); other
 * builds skip.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ape_test.h"

#include "core/alloc.h"
#include "faults/faultcheck.h"
#include "faults/fixture.h"
#include "common/json_check.h"

#ifndef APE_FAULT_INJECT
int main(void)
{
	ksft_print_header();
	ksft_exit_skip("libape built without -DAPE_FAULT_INJECT: run `make faults-ci`\n");
}
#else

FX_FIXTURE(af)

/* Fails each allocation of one run of c in turn (c's clean run came first, so lazily built state,
 * the OpenCL program for one, is in place and every run allocates the same way). */
static void sweep(struct __test_metadata *_metadata, fx_call *c, const char *what)
{
	uint64_t total, errors = 0, recovered = 0;
	const char *bad;
	int ret;

	ape__fault_alloc_arm(0);
	ASSERT_EQ(0, fx_call_run(c)) TH_LOG("%s", c->msg);
	total = ape__fault_alloc_count();
	ASSERT_GT(total, 0u);
	for (uint64_t n = 1; n <= total; n++) {
		ape__fault_alloc_arm(n);
		ret = fx_call_run(c);
		ape__fault_alloc_arm(0);
		if (ret) {
			errors++;
			EXPECT_EQ(APE_ENOMEM, ret) TH_LOG("%s: allocation %llu: %s", what,
							  (unsigned long long)n, c->msg);
		} else {
			recovered++;
		}
		bad = fx_call_verify(c, ret);
		EXPECT_EQ(NULL, bad) TH_LOG("%s: allocation %llu: %s (%s)", what,
					    (unsigned long long)n, bad, c->msg);
	}
	/* the context serves the next call, with the clean result */
	EXPECT_EQ(0, fx_call_run(c)) TH_LOG("%s", c->msg);
	EXPECT_EQ(NULL, fx_call_verify(c, 0));
	ksft_print_msg("%s: %llu allocations failed in turn: %llu errors, %llu runs recovered\n",
		       what, (unsigned long long)total, (unsigned long long)errors,
		       (unsigned long long)recovered);
	fflush(stdout); /* the harness ends each test with _exit() */
}

/* Prepares the call (its clean run first) and sweeps it. */
static void run_case(struct __test_metadata *_metadata, ape_device **devs, int ndev,
		     enum fx_mode mode, int64_t L, int64_t chunk, const char *what)
{
	fx_call c;

	ASSERT_EQ(0, fx_call_init(&c, devs, ndev, mode, L, chunk)) TH_LOG("%s", c.msg);
	sweep(_metadata, &c, what);
	fx_call_free(&c);
}

TEST_F_TIMEOUT(af, one_shot, 300)
{
	run_case(_metadata, self->dev, 1, FX_FORWARD, 64, 0, "one-shot forward");
}

TEST_F_TIMEOUT(af, streamed, 300)
{
	run_case(_metadata, self->dev, 1, FX_FORWARD, 192, 64, "streamed forward, 3x3 chunks");
}

TEST_F_TIMEOUT(af, two_devices, 300)
{
	run_case(_metadata, self->dev, 2, FX_FORWARD, 192, 64, "forward over two devices");
}

TEST_F_TIMEOUT(af, kv_cache, 300)
{
	run_case(_metadata, self->dev, 1, FX_KV, 80, 0, "KV cache create, append, attend");
}

/* The second append from device buffers (ape_kv_cache_append_device), then
 * ape_kv_cache_release_unreachable, then the attend. */
TEST_F_TIMEOUT(af, kv_cache_device_append, 300)
{
	run_case(_metadata, self->dev, 1, FX_KV_DEVICE, 80, 0,
		 "KV cache, ape_kv_cache_append_device, release, attend");
}

/* The device-resident path: queue, five buffers, three writes, ape_attention_enqueue, two reads,
 * a synchronisation. */
TEST_F_TIMEOUT(af, enqueue, 300)
{
	run_case(_metadata, self->dev, 1, FX_ENQUEUE, 64, 0, "resident buffers and enqueue");
}

/* The DLPack call on kDLCPU tensors: wrappers, a queue, the enqueue, all released. */
TEST_F_TIMEOUT(af, dlpack, 300)
{
	const char *why = fx_no_host_memory(self->dev[0]);

	if (why)
		SKIP(return, "kDLCPU tensors need a device computing on host memory: %s", why);
	run_case(_metadata, self->dev, 1, FX_DLPACK, 64, 0, "DLPack call on kDLCPU tensors");
}

/* ape_attention_forward_dlpack_diag() on kDLCPU tensors: entropy and mean distance too. */
TEST_F_TIMEOUT(af, dlpack_diag, 300)
{
	const char *why = fx_no_host_memory(self->dev[0]);

	if (why)
		SKIP(return, "kDLCPU tensors need a device computing on host memory: %s", why);
	run_case(_metadata, self->dev, 1, FX_DLPACK_DIAG, 64, 0,
		 "ape_attention_forward_dlpack_diag on kDLCPU tensors");
}

/* The diagnostics calls (docs/diagnostics.md): the streamed forward, the KV cache's attend and
 * the resident call with entropy and mean distance, whose rows follow O's. */
TEST_F_TIMEOUT(af, diag_streamed, 300)
{
	run_case(_metadata, self->dev, 1, FX_DIAG, 192, 64,
		 "ape_attention_forward_diag, 3x3 chunks");
}

TEST_F_TIMEOUT(af, diag_kv_cache, 300)
{
	run_case(_metadata, self->dev, 1, FX_KV_DIAG, 80, 0, "KV cache, ape_kv_cache_attend_diag");
}

TEST_F_TIMEOUT(af, diag_enqueue, 300)
{
	run_case(_metadata, self->dev, 1, FX_ENQUEUE_DIAG, 64, 0,
		 "resident buffers and ape_attention_enqueue_diag");
}

/* ape_device_measure_h2d(): a NUMA-placed, pinned host buffer, a device buffer, a queue, timed
 * copies; each allocation failed in turn gives APE_ENOMEM with a message, or a measurement (a
 * fallback: plain memory), and the next measurement works. */
TEST_F_TIMEOUT(af, measure_h2d, 300)
{
	uint64_t total, errors = 0;
	ape_copy_result res;
	int ret;

	ape__fault_alloc_arm(0);
	ASSERT_EQ(0, ape_device_measure_h2d(self->dev[0], -1, 1 << 16, 2, &res))
	TH_LOG("%s", ape_last_error());
	total = ape__fault_alloc_count();
	if (!total)
		SKIP(return, "ape_device_measure_h2d() made no counted allocation on %s",
		     self->dev[0]->info.name);
	for (uint64_t n = 1; n <= total; n++) {
		ape__fault_alloc_arm(n);
		ret = ape_device_measure_h2d(self->dev[0], -1, 1 << 16, 2, &res);
		ape__fault_alloc_arm(0);
		if (ret) {
			errors++;
			EXPECT_EQ(APE_ENOMEM, ret) TH_LOG("allocation %llu: %s", (unsigned long long)n,
							  ape_last_error());
			EXPECT_NE(0, ape_last_error()[0]);
		}
	}
	EXPECT_EQ(0, ape_device_measure_h2d(self->dev[0], -1, 1 << 16, 2, &res))
	TH_LOG("%s", ape_last_error());
	ksft_print_msg("measure_h2d: %llu allocations failed in turn: %llu errors\n",
		       (unsigned long long)total, (unsigned long long)errors);
	fflush(stdout);
}

/* Creating a context enumerates every device (drivers, DRM, hwloc, the merge into physical
 * devices): each allocation failed in turn gives APE_ENOMEM and no context, or the same devices. */
FIXTURE(enumeration)
{
	int unused;
};

FIXTURE_SETUP(enumeration)
{
}

FIXTURE_TEARDOWN(enumeration)
{
}

TEST_F_TIMEOUT(enumeration, context_create, 300)
{
	uint64_t total, errors = 0;
	ape_context_options o;
	ape_context *ctx;
	int clean, ret;

	ape_context_options_init(&o);
	o.backends = "ref,opencl";
	ape__fault_alloc_arm(0);
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	clean = ape_device_list(ctx, NULL, 0);
	ape_context_destroy(ctx);
	total = ape__fault_alloc_count();
	for (uint64_t n = 1; n <= total; n++) {
		ape__fault_alloc_arm(n);
		ret = ape_context_create(&ctx, &o);
		ape__fault_alloc_arm(0);
		if (ret) {
			errors++;
			EXPECT_EQ(APE_ENOMEM, ret) TH_LOG("allocation %llu: %s",
							  (unsigned long long)n, ape_last_error());
			EXPECT_NE(0, ape_last_error()[0]);
			EXPECT_EQ(NULL, ctx);
			continue;
		}
		EXPECT_EQ(clean, ape_device_list(ctx, NULL, 0))
			TH_LOG("allocation %llu failed silently: a device went missing",
			       (unsigned long long)n);
		ape_context_destroy(ctx);
	}
	ksft_print_msg("context create: %llu allocations failed in turn: %llu errors\n",
		       (unsigned long long)total, (unsigned long long)errors);
	fflush(stdout);
}

/*
 * The call log (APE_VERBOSE at level 2, JSON) and the session trace (APE_TRACE) on, a streamed
 * forward and a KV-cache session: allocations of the log's and the trace's own (the spans, their
 * copies of each call's figures) fail in turn with the call's, and none may fail a call that
 * would have succeeded or change its result (a trace is a diagnostic: out of memory, it drops
 * the span and says it is incomplete); the trace written at the end is still JSON. Its own
 * process: both are read once per process.
 */
TEST(traced_and_logged)
{
	static const struct {
		enum fx_mode mode;
		int64_t L, chunk;
		const char *what;
	} cases[] = {
		{ FX_FORWARD, 192, 64, "streamed forward, logged and traced" },
		{ FX_KV, 80, 0, "KV cache, logged and traced" },
	};
	char trace[] = "/tmp/ape-faults-trace-XXXXXX";
	ape_context_options o;
	ape_context *ctx = NULL;
	ape_device *dev;
	int fd = mkstemp(trace), saved = dup(2), devnull = open("/dev/null", O_WRONLY);
	char *text;

	ASSERT_LE(0, fd);
	close(fd);
	setenv("APE_TRACE", trace, 1);
	setenv("APE_VERBOSE_FORMAT", "json", 1);
	ape_context_options_init(&o);
	o.backends = "ref";
	o.verbose = 2;
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	dev = test_device(ctx, "ref");
	ASSERT_NE(NULL, dev);
	dup2(devnull, 2); /* the lines themselves: the JSON tests check them */
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		fx_call c;

		ASSERT_EQ(0, fx_call_init(&c, &dev, 1, cases[i].mode, cases[i].L, cases[i].chunk))
		TH_LOG("%s", c.msg);
		sweep(_metadata, &c, cases[i].what);
		fx_call_free(&c);
	}
	/* a caller's range (ape_range_push(): its name's copy, its span), each allocation failed
	 * in turn: the range is dropped, nothing else happens (it returns nothing to fail) */
	{
		uint64_t total;

		ape__fault_alloc_arm(0);
		ape_range_push("a caller's range with a new name");
		ape_range_pop();
		total = ape__fault_alloc_count();
		EXPECT_LT(0u, total) TH_LOG("a range allocates its name and its span");
		for (uint64_t k = 1; k <= total; k++) {
			ape__fault_alloc_arm(k);
			ape_range_push("a caller's range, broken");
			ape_range_pop();
			ape__fault_alloc_arm(0);
		}
		ape_range_push("a caller's range after the sweep");
		ape_range_pop();
	}
	ape_context_destroy(ctx); /* writes the trace */
	dup2(saved, 2);
	close(saved);
	close(devnull);
	text = json_read_file(trace);
	ASSERT_NE(NULL, text);
	EXPECT_TRUE(json_ok(text)) TH_LOG("the trace after the sweeps is not JSON");
	EXPECT_NE(NULL, strstr(text, "\"name\":\"ape_kv_cache_attend\",\"cat\":\"call\""));
	EXPECT_NE(NULL, strstr(text, "\"name\":\"a caller's range after the sweep\","
				     "\"cat\":\"range\""));
	free(text);
	unlink(trace);
}

TEST_HARNESS_MAIN
#endif
