/* SPDX-License-Identifier: MIT */
/*
 * The streaming executor's calls as a caller sees them, on every backend (the reference,
 * OpenCL, and CUDA on the emulator where there is no GPU): what a failure leaves in the outputs
 * (finished chunks or nothing), the trace file (Chrome trace JSON), inputs read in place where
 * the device reads host memory and only where its capabilities say so, the statistics (chunks
 * and bytes), and the options and device count validated. (Streaming against one-shot calls,
 * skipping and the budget: test_stream.c.)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/problem.h"
#include "common/refcheck.h"
#include "common/wrapops.h"
#include "core/context.h"
#include "stream_case.h"

/* ---- the devices each test runs on */

BACKEND_FIXTURE(dev)
/* ---- failures */

/*
 * Launch `at` fails (at = 1, 1 + step, ... up to `launches`), 4 query chunks of L / 4 rows and
 * key chunks of ck rows: finished query chunks are written, the clean result bit for bit, and
 * the message says how many; the others are untouched, except where the launches wrote O and
 * LSE in place (one key chunk on a device that computes on host memory): their rows are then
 * unspecified and the message says so. With APE_EXEC_ATOMIC_OUTPUTS nothing is written on any
 * device, and a call that succeeds writes the same bits.
 */
static void failures_leave(struct __test_metadata *_metadata, ape_device *dev, bool emu,
			   int64_t ck_div, uint64_t launches, uint64_t step)
{
	/* the emulator: half the rows */
	const int64_t L = emu ? 128 : 256, c = L / 4, ck = L / ck_div;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	const bool host = ape_be_caps_have(&dev->caps, APE_BE_CAP_HOST_MEMORY);
	test_problem tp, want;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.skip_tol = 0;
	{
		ape_exec_options o = chunks(c, ck);

		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, run_ex(&want, &dev, 1, &o, NULL)) TH_LOG("%s", ape_last_error());
	}
	wrap_install(dev, 0);
	for (int atomic_out = 0; atomic_out < 2; atomic_out++)
		for (uint64_t at = 1; at <= launches; at += step) {
			ape_exec_options o = chunks(c, ck);
			const bool in_place = host && ck == L && !atomic_out;
			long long held = 0, of = 0;
			const char *m;
			int ret;

			o.flags = atomic_out ? APE_EXEC_ATOMIC_OUTPUTS : 0;
			wrap_fail_attention(at);
			ret = run_ex(&tp, &dev, 1, &o, NULL);
			wrap_fail_attention(0);
			ASSERT_EQ(APE_EDEVLOST, ret);
			EXPECT_NE(NULL, strstr(ape_last_error(), "fails on purpose"));
			EXPECT_EQ(in_place, strstr(ape_last_error(), "computed in place and are "
								    "unspecified") != NULL)
			TH_LOG("launch %d: %s", (int)at, ape_last_error());
			m = strstr(ape_last_error(), "O and LSE hold ");
			if (m)
				EXPECT_EQ(2, sscanf(m, "O and LSE hold %lld of %lld", &held, &of));
			if (atomic_out || at == 1)
				EXPECT_EQ(NULL, m) TH_LOG("%s", ape_last_error());
			EXPECT_LE(held, (long long)at - 1);
			for (int64_t h = 0; h < 2; h++)
				for (int64_t i = 0; i < L; i++) {
					const double got = test_tensor_get(&tp.o.t, 0, h, i, 0);

					if (i < held * c) { /* held: the clean result */
						ASSERT_EQ(test_tensor_get(&want.o.t, 0, h, i, 0), got)
						TH_LOG("launch %d: head %d row %d", (int)at, (int)h,
						       (int)i);
					} else if (!in_place) { /* the rest untouched (poisoned: NaN) */
						ASSERT_TRUE(isnan(got))
						TH_LOG("launch %d: head %d row %d written (%lld held)",
						       (int)at, (int)h, (int)i, held);
					}
				}
		}
	/* and with the flag, a successful call writes everything, the same bits */
	{
		ape_exec_options o = chunks(c, ck);

		o.flags = APE_EXEC_ATOMIC_OUTPUTS;
		EXPECT_EQ(0, run_ex(&tp, &dev, 1, &o, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, memcmp(want.o.alloc, tp.o.alloc, tp.o.alloc_bytes));
		EXPECT_EQ(0, memcmp(want.lse, tp.lse, tp.rows * sizeof(float)));
	}
	test_problem_free(&tp);
	test_problem_free(&want);
}

/* 4 x 4 chunks, merged: 1 + 2 + 3 + 4 launches; the rows come back once merged, never in
 * place */
TEST_F(dev, failure_leaves_finished_chunks_or_nothing)
{
	failures_leave(_metadata, self->dev, self->emu, 4, 10, 3);
}

/* 4 x 1 chunks: one launch per query chunk, writing in place where the device reads host
 * memory */
TEST_F(dev, launches_writing_in_place_say_so)
{
	failures_leave(_metadata, self->dev, self->emu, 1, 4, 1);
}

/* ---- the trace */

static int python_check(const char *path, const char *script)
{
	char cmd[8192];

	if (access("/usr/bin/python3", X_OK))
		return -2;
	snprintf(cmd, sizeof(cmd), "/usr/bin/python3 -c '%s' %s", script, path);
	return system(cmd);
}

/* Valid JSON, Chrome's trace-event format: named processes and lanes, complete events with
 * microsecond times, copies and kernels of every chunk. */
static const char trace_script[] =
	"import json,sys\n"
	"d = json.load(open(sys.argv[1]))\n"
	"ev = d[\"traceEvents\"]\n"
	"x = [e for e in ev if e[\"ph\"] == \"X\"]\n"
	"names = set(e[\"name\"].split(\" \")[0] + \" \" + e[\"name\"].split(\" \")[1] for e in x)\n"
	"assert any(e[\"ph\"] == \"M\" and e[\"name\"] == \"process_name\" for e in ev)\n"
	"assert any(e[\"ph\"] == \"M\" and e[\"name\"] == \"thread_name\" for e in ev)\n"
	"assert all(e[\"ts\"] >= 0 and e[\"dur\"] >= 0 and \"pid\" in e and \"tid\" in e for e in x)\n"
	"k = [e for e in x if e[\"cat\"] == \"kernel\"]\n"
	"c = [e for e in x if e[\"cat\"] == \"copy\"]\n"
	"assert len(k) == int(sys.argv[2]), (len(k), sys.argv[2])\n"
	"assert any(e[\"name\"].startswith(\"h2d K/V\") for e in c)\n"
	"assert any(e[\"name\"].startswith(\"h2d Q\") for e in c)\n"
	"assert any(e[\"name\"].startswith(\"d2h O/LSE\") for e in c)\n"
	"print(\"trace:\", len(x), \"events;\", d[\"otherData\"][\"clock\"])\n";

TEST_F(dev, trace_is_chrome_trace_json)
{
	/* the emulator: 2 x 2 chunks */
	const int64_t L = self->emu ? 100 : 200;
	const test_problem_shape sh = { 1, 2, 1, L, L, 16 };
	char dir[64], path[128], arg[160], first[256];
	test_problem tp;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	snprintf(dir, sizeof(dir), "/tmp/ape-test-trace.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/t.json", dir);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	for (int fallback = 0; fallback < 2; fallback++) {
		ape_exec_options o = chunks(64, 64);
		ape_stats st;
		int ret;

		o.flags = APE_EXEC_COPY_INPUTS; /* copies of every kind in the trace */
		if (fallback) /* no device timestamps: still a valid trace, on the host's clock */
			wrap_install(self->dev, WRAP_NO_TIMESTAMP);
		o.trace_path = path;
		ape_stats_init(&st);
		ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, &st)) TH_LOG("%s", ape_last_error());
		snprintf(arg, sizeof(arg), "%s %llu", path, (unsigned long long)st.chunks);
		ret = python_check(arg, trace_script);
		if (ret == -2)
			SKIP(break, "no /usr/bin/python3 to read the trace");
		EXPECT_EQ(0, ret) TH_LOG("the trace %s is not what Perfetto reads", path);
		/* written through a temporary file: nothing else is left next to it */
		EXPECT_EQ(1, test_count_entries(dir, first, sizeof(first)));
		EXPECT_STREQ("t.json", first);
		wrap_remove();
	}
	/* a directory that does not exist is refused before any work */
	{
		ape_exec_options o = chunks(64, 64);

		o.trace_path = "/nonexistent-dir/t.json";
		EXPECT_EQ(APE_EINVAL, run_ex(&tp, &self->dev, 1, &o, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "opts->trace_path"));
		EXPECT_TRUE(isnan(test_tensor_get(&tp.o.t, 0, 0, 0, 0)));
	}
	test_problem_free(&tp);
	test_rmtree(dir);
}

/*
 * A device whose kernels read host memory (the reference, OpenCL CPU devices) reads the inputs
 * where they lie at every chunking: nothing is copied to it and inputs count nothing against
 * the budget; APE_EXEC_COPY_INPUTS copies them as a discrete device needs. Both within the
 * tolerance of the reference, strided inputs included.
 */
TEST_F(dev, inputs_in_place_where_the_device_reads_host_memory)
{
	const int64_t L = self->emu ? 96 : 300;
	const test_problem_shape sh = { 2, 4, 2, L, L + 20, 16 };
	static float probe;
	ape_buffer *b = NULL;
	test_problem tp, want;
	bool host_memory;
	ape_rng rng;

	host_memory = ape_buffer_wrap_host(self->dev, &probe, sizeof(probe), &b) == 0;
	ape_buffer_free(b);
	ape_rng_init(&rng, _metadata->name);
	for (int layout = 0; layout < 2; layout++) {
		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, layout == 1));
		test_problem_random_params(&tp, &rng);
		ASSERT_EQ(0, one_shot(&want, &tp, self->ref));
		for (int copy = 0; copy < 2; copy++) {
			ape_exec_options o = chunks(64, 128);
			ape_stats st;

			o.flags = copy ? APE_EXEC_COPY_INPUTS : 0;
			ape_stats_init(&st);
			EXPECT_EQ(0, check_stream(_metadata, &tp, &want, self->dev, &o,
						  copy ? "copied" : "in place", &st));
			if (host_memory && !copy) {
				EXPECT_EQ(0u, st.bytes_to_device);
			} else {
				EXPECT_GE(st.bytes_to_device,
					  (uint64_t)(sh.B * (sh.H * sh.Lq + 2 * sh.Hkv * sh.Lk) * sh.D *
						     4));
			}
			/* in place or not, the results come back once per query chunk or less */
			EXPECT_GT(st.bytes_from_device, 0u);
		}
		test_problem_free(&tp);
		test_problem_free(&want);
	}
}

/*
 * ape.h: a call whose queries fit one chunk writes its outputs only when it succeeds, except
 * where its launch computed them in place (a device that reads host memory: the message then
 * ends "computed in place and are unspecified"); with APE_EXEC_ATOMIC_OUTPUTS, on every path.
 * A device lost at any point leaves O and LSE as they were unless the message says so.
 */
TEST_F(dev, one_chunk_call_writes_nothing_when_it_fails)
{
	const bool host = ape_be_caps_have(&self->dev->caps, APE_BE_CAP_HOST_MEMORY);
	ape_exec_options eo;
	const test_problem_shape sh = { 1, 2, 1, 40, 60, 16 };
	test_problem tp;
	unsigned char *before;
	float lse_before[2 * 40];
	ape_rng rng;
	int failures = 0;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	ASSERT_NE(NULL, tp.lse);
	before = malloc(tp.o.alloc_bytes);
	ASSERT_NE(NULL, before);
	memset(tp.o.alloc, 0x5a, tp.o.alloc_bytes);
	memcpy(before, tp.o.alloc, tp.o.alloc_bytes);
	for (int i = 0; i < 2 * 40; i++)
		tp.lse[i] = lse_before[i] = (float)i;
	wrap_install(self->dev, 0);
	ape_exec_options_init(&eo);
	for (int atomic = 0; atomic < 2; atomic++) {
		int said = 0;

		eo.flags = atomic ? APE_EXEC_ATOMIC_OUTPUTS : 0;
		failures = 0;
		for (uint64_t k = 1; k < 64; k++) {
			int ret;

			wrap_lose_device(k);
			ret = ape_attention_forward_ex(&self->dev, 1, &eo, &tp.desc, &tp.q.t, &tp.k.t,
						       &tp.v.t, &tp.o.t, tp.lse, NULL);
			wrap_lose_device(0);
			if (!ret)
				break; /* k is past the call's last op */
			failures++;
			if (strstr(ape_last_error(), "computed in place and are unspecified")) {
				EXPECT_TRUE(host && !atomic) TH_LOG("%s", ape_last_error());
				said++;
				memcpy(tp.o.alloc, before, tp.o.alloc_bytes);
				memcpy(tp.lse, lse_before, sizeof(lse_before));
				continue;
			}
			EXPECT_EQ(0, memcmp(before, tp.o.alloc, tp.o.alloc_bytes))
			TH_LOG("device lost at op %llu: O was written (%s)",
			       (unsigned long long)k, ape_last_error());
			EXPECT_EQ(0, memcmp(lse_before, tp.lse, sizeof(lse_before)))
			TH_LOG("device lost at op %llu: LSE was written", (unsigned long long)k);
		}
		EXPECT_GT(failures, 2);
		/* in place exactly where the device reads host memory and the call is not atomic:
		 * the launch and what follows it fail after O's rows were handed to the kernel */
		EXPECT_EQ(host && !atomic, said > 0) TH_LOG("atomic %d: %d failures said so", atomic,
							  said);
		if (atomic)
			break;
		memcpy(tp.o.alloc, before, tp.o.alloc_bytes);
		memcpy(tp.lse, lse_before, sizeof(lse_before));
	}
	/* ... and it does write them when nothing fails */
	EXPECT_NE(0, memcmp(before, tp.o.alloc, tp.o.alloc_bytes));
	free(before);
	test_problem_free(&tp);
}

/* ---- statistics */

TEST_F(dev, stats_count_chunks_and_bytes)
{
	const int64_t L = 100, H = 2, Hkv = 1, D = 16;
	const test_problem_shape sh = { 1, H, Hkv, L, L, D };
	ape_exec_options o = chunks(32, 32);
	test_problem tp;
	ape_stats st, *old;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	tp.desc.causal = true;
	tp.desc.q_start_set = false;
	tp.desc.skip_tol = 0;
	o.flags = APE_EXEC_COPY_INPUTS; /* every input copied, as to a discrete device */
	ape_stats_init(&st);
	ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, &st)) TH_LOG("%s", ape_last_error());
	/* 4 x 4 chunks, causal and end-aligned: query chunk i sees key chunks 0..i */
	EXPECT_EQ(10u, st.chunks);
	EXPECT_EQ(0u, st.chunks_skipped);
	EXPECT_EQ(32, st.chunk_q);
	EXPECT_EQ(32, st.chunk_k);
	EXPECT_EQ(3, st.pipeline_depth);
	EXPECT_EQ(1, st.devices);
	/* every key chunk stays resident (no budget to speak of): each is copied once, and the
	 * parameter tables once (omega and four per head, in float64 and float32) */
	EXPECT_EQ((uint64_t)((H * L + 2 * Hkv * L) * D * 4 + (D / 2 + 4 * H) * 12),
		  st.bytes_to_device);
	/* each query chunk's merged O (float32), LSE and pair counts come back once, whatever
	 * its key chunks (the device merges them): at most 1.1x O and LSE (issue 24's target;
	 * merged on the host, as before, every launch's partial O, LSE and counts came back: 208
	 * row-launches for 100 rows, 2.3x here) */
	EXPECT_GT(st.bytes_from_device, (uint64_t)(H * L * D * 4));
	EXPECT_LE((double)st.bytes_from_device, 1.1 * (double)(H * L * (D + 1) * 4))
	TH_LOG("%llu bytes back for %lld of O and LSE", (unsigned long long)st.bytes_from_device,
	       (long long)(H * L * (D + 1) * 4));
	EXPECT_GE(st.kernel_ms, 0.0);
	EXPECT_GE(st.copy_ms, 0.0);
	EXPECT_GE(st.overlap_ms, 0.0);
	/* up to rounding: the intervals sit at device clock values of 1e6 ms and more */
	EXPECT_LE(st.overlap_ms, st.copy_ms * (1 + 1e-6) + 1e-6);
	EXPECT_STREQ(variant->backend, st.backend);

	/* a caller built against libape 0.1 passes the old size and gets the old fields only */
	old = malloc(sizeof(*old));
	ASSERT_NE(NULL, old);
	memset(old, 0xab, sizeof(*old));
	old->struct_size = APE_STATS_V1_SIZE;
	ASSERT_EQ(0, run_ex(&tp, &self->dev, 1, &o, old)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(st.pairs_visible, old->pairs_visible);
	{
		size_t written = 0;

		for (size_t i = APE_STATS_V1_SIZE; i < sizeof(*old); i++)
			written += ((unsigned char *)old)[i] != 0xab;
		EXPECT_EQ(0u, written) TH_LOG("bytes past the old size were written");
	}
	free(old);
	test_problem_free(&tp);
}

/*
 * Whether a host call computes on the caller's arrays in place is the device's capability
 * host_memory (struct ape_be_caps), stated at probe, not found by trying buf_wrap: with the
 * capability taken away and buf_wrap kept, the call stages and copies, and asks buf_wrap
 * nothing; a device without it is never asked either.
 */
TEST_F(dev, in_place_only_where_the_capability_says)
{
	const test_problem_shape sh = { 1, 2, 1, 24, 24, 16 };
	const bool capable = ape_be_caps_have(&self->dev->caps, APE_BE_CAP_HOST_MEMORY);
	test_problem tp, want;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	ASSERT_EQ(0, one_shot(&want, &tp, self->ref)) TH_LOG("%s", ape_last_error());
	for (int hide = 0; hide < 2; hide++) {
		const bool in_place = capable && !hide;
		struct wrap_counts c;
		ape_stats st;
		double eo, el;

		wrap_install(self->dev, hide ? WRAP_NO_HOST_MEMORY : 0);
		ape_stats_init(&st);
		EXPECT_EQ(0, run_ex(&tp, &self->dev, 1, NULL, &st)) TH_LOG("%s", ape_last_error());
		c = wrap_get();
		wrap_remove();
		errors(&tp, &want, &eo, &el);
		EXPECT_LE(eo, test_tol_o(APE_F32));
		EXPECT_LE(el, test_tol_lse(APE_F32));
		if (in_place) {
			EXPECT_EQ(0u, c.h2d_calls) TH_LOG("computed in place: nothing to copy in");
			EXPECT_LT(0u, c.calls[WRAP_BUF_WRAP]);
		} else {
			EXPECT_LT(0u, c.h2d_calls) TH_LOG("hide %d: not staged", hide);
			EXPECT_EQ(0u, c.calls[WRAP_BUF_WRAP]) TH_LOG("hide %d: buf_wrap was tried", hide);
		}
	}
	test_problem_free(&want);
	test_problem_free(&tp);
}

/* ---- arguments */

TEST_F(dev, options_are_validated)
{
	const test_problem_shape sh = { 1, 2, 1, 8, 8, 8 };
	static const double bad_weight[2] = { 1, 0 };
	test_problem tp;
	ape_rng rng;
	struct {
		const char *what;
		void (*change)(ape_exec_options *o);
	} cases[] = {
		{ "opts->struct_size", NULL }, { "opts->chunk_q = -1", NULL },
		{ "opts->chunk_k = -5", NULL }, { "opts->pipeline_depth = 4", NULL },
		{ "opts->flags = 0x7: unknown flags 0x4", NULL }, { "opts->device_weights[1] = 0", NULL },
		{ "opts->trace_path = \"\"", NULL },
	};
	ape_device *two[2] = { self->dev, NULL };

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		ape_exec_options o;

		ape_exec_options_init(&o);
		switch (c) {
		case 0: o.struct_size--; break;
		case 1: o.chunk_q = -1; break;
		case 2: o.chunk_k = -5; break;
		case 3: o.pipeline_depth = 4; break;
		case 4: o.flags = 0x7; break;
		case 5: o.device_weights = bad_weight; break;
		case 6: o.trace_path = ""; break;
		}
		two[1] = self->dev;
		EXPECT_EQ(APE_EINVAL, run_ex(&tp, two, c == 5 ? 2 : 1, &o, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_forward_ex: "));
		EXPECT_NE(NULL, strstr(ape_last_error(), cases[c].what))
			TH_LOG("\"%s\" does not name %s", ape_last_error(), cases[c].what);
		EXPECT_TRUE(isnan(test_tensor_get(&tp.o.t, 0, 0, 0, 0))) TH_LOG("O written");
	}
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, NULL, 1, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "devs = NULL"));
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, two, 0, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "ndev = 0"));
	two[1] = NULL;
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, two, 2, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "devs[1] = NULL"));
	/* NULL options: the defaults */
	EXPECT_EQ(0, run_ex(&tp, &self->dev, 1, NULL, NULL)) TH_LOG("%s", ape_last_error());
	test_problem_free(&tp);
}

/* APE_MAX_DEVICES device entries are taken (here one device listed that often), one more is
 * refused before any work, naming ndev and the limit. */
TEST_F(dev, device_count_limit_is_ape_max_devices)
{
	const test_problem_shape sh = { 1, 2, 1, 40, 40, 8 };
	ape_device *devs[APE_MAX_DEVICES + 1];
	char want[64];
	ape_exec_options o = chunks(4, 40);
	test_problem tp;
	ape_stats st;
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	for (int i = 0; i <= APE_MAX_DEVICES; i++)
		devs[i] = self->dev;
	snprintf(want, sizeof(want), "ndev = %d: must be 1..%d", APE_MAX_DEVICES + 1,
		 APE_MAX_DEVICES);
	EXPECT_EQ(APE_EINVAL, run_ex(&tp, devs, APE_MAX_DEVICES + 1, &o, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), want)) TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(isnan(test_tensor_get(&tp.o.t, 0, 0, 0, 0))) TH_LOG("O written");
	ape_stats_init(&st);
	ASSERT_EQ(0, run_ex(&tp, devs, APE_MAX_DEVICES, &o, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_MAX_DEVICES, st.devices);
	EXPECT_EQ(10u, st.chunks) TH_LOG("10 query chunks of 4 rows, one key chunk each");
	test_problem_free(&tp);
}

TEST_HARNESS_MAIN
