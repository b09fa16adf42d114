/* SPDX-License-Identifier: MIT */
/* ape-bench and ape-check end to end: their output, their numbers, their exit codes. */
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#include "ape_test.h"

static char out[1 << 16], err[1 << 16];

#define TOOL(name, ...) \
	test_run_tool(name, (const char *const[]){ __VA_ARGS__, NULL }, NULL, out, sizeof(out), err, \
		      sizeof(err))

/* Counts the occurrences of needle in hay. */
static int count(const char *hay, const char *needle)
{
	int n = 0;

	for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

TEST(bench_json_counts_pairs_and_checks_rows)
{
	char want[64];

	ASSERT_EQ(0, TOOL("ape-bench", "--backend", "ref", "-H", "2", "-D", "16", "-L", "64,100",
			  "--warmup", "0", "--repeats", "1", "--check-rows", "4", "--json", "--seed",
			  "7"))
		TH_LOG("%s", err);
	EXPECT_EQ(4, count(out, "\"L\": ")) TH_LOG("%s", out); /* 2 lengths x 2 skip tolerances */
	EXPECT_EQ(4, count(out, "\"within_tol\": true"));
	EXPECT_EQ(4, count(out, "\"rows_checked\": 4"));
	/* causal, end-aligned: H * L (L + 1) / 2 visible pairs */
	snprintf(want, sizeof(want), "\"pairs_visible\": %d,", 2 * 64 * 65 / 2);
	EXPECT_EQ(2, count(out, want));
	snprintf(want, sizeof(want), "\"pairs_visible\": %d,", 2 * 100 * 101 / 2);
	EXPECT_EQ(2, count(out, want));
	EXPECT_NE(NULL, strstr(out, "\"backend\": \"ref\""));
}

TEST(bench_table_names_device_and_columns)
{
	ASSERT_EQ(0, TOOL("ape-bench", "--backend", "ref", "-H", "1", "-D", "8", "-L", "32",
			  "--repeats", "2", "--skip-tol", "0"))
		TH_LOG("%s", err);
	EXPECT_NE(NULL, strstr(out, "ref:0"));
	EXPECT_NE(NULL, strstr(out, "Mpairs/s"));
	EXPECT_NE(NULL, strstr(out, "GFLOP/s"));
	EXPECT_NE(NULL, strstr(out, "computed"));
	EXPECT_NE(NULL, strstr(err, "ran on ref:0")) TH_LOG("%s", err);
}

TEST(bench_bad_arguments)
{
	EXPECT_EQ(2, TOOL("ape-bench", "-D", "7"));
	EXPECT_NE(NULL, strstr(err, "-D")) TH_LOG("%s", err);
	EXPECT_EQ(2, TOOL("ape-bench", "--backend", "nosuch"));
	EXPECT_NE(NULL, strstr(err, "nosuch")) TH_LOG("%s", err);
	EXPECT_EQ(2, TOOL("ape-bench", "-L", "12,abc"));
	EXPECT_EQ(2, TOOL("ape-bench", "--kv-heads", "4", "-H", "6"));
	EXPECT_EQ(2, TOOL("ape-bench", "--frobnicate"));
}

/* --stream: chunked under a budget; the peak stays under it, the rows check out, the
 * back-to-back run is there for the overlap figure. */
TEST(bench_stream_reports_budget_and_overlap)
{
	unsigned long long peak = 0, budget = 0;
	const char *p;

	ASSERT_EQ(0, TOOL("ape-bench", "--stream", "--backend", "ref", "-H", "1", "-D", "8", "-L",
			  "300", "--chunk", "64", "--max-device-mem", "64K", "--check-rows", "2",
			  "--json", "--seed", "3"))
		TH_LOG("%s", err);
	EXPECT_EQ(1, count(out, "\"L\": 300,")) TH_LOG("%s", out);
	EXPECT_EQ(1, count(out, "\"within_tol\": true")) TH_LOG("%s", out);
	EXPECT_EQ(1, count(out, "\"chunk\": 64,")) TH_LOG("%s", out);
	EXPECT_EQ(1, count(out, "\"overlap_efficiency\": "));
	EXPECT_EQ(0, count(out, "\"serial_ms\": 0,")) TH_LOG("the back-to-back run is missing");
	p = strstr(out, "\"budget_bytes\": ");
	ASSERT_NE(NULL, p);
	EXPECT_EQ(1, sscanf(p, "\"budget_bytes\": %llu", &budget));
	EXPECT_EQ(65536u, budget);
	p = strstr(out, "\"peak_device_bytes\": ");
	ASSERT_NE(NULL, p);
	EXPECT_EQ(1, sscanf(p, "\"peak_device_bytes\": %llu", &peak));
	EXPECT_GT(peak, 0u);
	EXPECT_LE(peak, budget);
	/* the table names its columns */
	ASSERT_EQ(0, TOOL("ape-bench", "--stream", "--backend", "ref", "-H", "1", "-D", "8", "-L",
			  "100", "--no-serial", "--check-rows", "0"))
		TH_LOG("%s", err);
	EXPECT_NE(NULL, strstr(out, "tokens/s")) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "peak_MiB"));
	EXPECT_EQ(2, TOOL("ape-bench", "--stream", "--max-device-mem", "lots"));
	EXPECT_NE(NULL, strstr(err, "--max-device-mem")) TH_LOG("%s", err);
	EXPECT_EQ(2, TOOL("ape-bench", "--stream", "--chunk", "0"));
}

/* --resident: inputs written to device buffers once, timed enqueue + synchronize beside the
 * host call; the resident call's own O and LSE are read back and checked. */
TEST(bench_resident_beside_the_host_call)
{
	ASSERT_EQ(0, TOOL("ape-bench", "--resident", "--backend", "ref", "-H", "2", "--kv-heads",
			  "1", "-D", "8", "-L", "32,40", "--warmup", "0", "--repeats", "2",
			  "--check-rows", "4", "--json", "--seed", "5"))
		TH_LOG("%s", err);
	EXPECT_EQ(4, count(out, "\"resident_bytes_copied\": 0,")) TH_LOG("%s", out);
	EXPECT_EQ(4, count(out, "\"host_bytes_copied\": ")) TH_LOG("%s", out);
	EXPECT_EQ(4, count(out, "\"resident_overhead_ms\": ")) TH_LOG("%s", out);
	EXPECT_EQ(4, count(out, "\"rows_checked\": 4,")) TH_LOG("%s", out);
	EXPECT_EQ(4, count(out, "\"within_tol\": true")) TH_LOG("%s", out);
	ASSERT_EQ(0, TOOL("ape-bench", "--resident", "--backend", "ref", "-H", "1", "-D", "8", "-L",
			  "16", "--repeats", "1", "--skip-tol", "0"))
		TH_LOG("%s", err);
	EXPECT_NE(NULL, strstr(out, "resident_ms")) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "res_ovh_ms"));
	EXPECT_NE(NULL, strstr(out, "kernel_ms"));
	EXPECT_EQ(2, TOOL("ape-bench", "--resident", "--stream"));
	EXPECT_NE(NULL, strstr(err, "one at a time")) TH_LOG("%s", err);
}

TEST(bench_unavailable_backend_exits_3)
{
	ape_context *ctx = test_context(NULL);
	ape_backend_info bi;
	const char *missing = NULL;

	ASSERT_NE(NULL, ctx);
	for (int b = 0, n = ape_backend_get_info(ctx, 0, NULL); b < n && !missing; b++) {
		ape_backend_get_info(ctx, b, &bi);
		if (!bi.available)
			missing = !strcmp(bi.name, "cuda") ? "cuda" : !strcmp(bi.name, "opencl") ? "opencl" : NULL;
	}
	ape_context_destroy(ctx);
	if (!missing)
		SKIP(return, "every backend is available on this machine");
	EXPECT_EQ(3, TOOL("ape-bench", "--backend", missing, "-L", "8"));
	EXPECT_NE(NULL, strstr(err, "not available")) TH_LOG("%s", err);
}

TEST(check_passes_on_every_device)
{
	int status = TOOL("ape-check", "--json");

	EXPECT_EQ(0, status) TH_LOG("%s\n%s", out, err);
	EXPECT_NE(NULL, strstr(out, "\"ok\": true")) TH_LOG("%s", out);
	/* every device that is not the reference appears, with one result per case */
	EXPECT_EQ(0, count(out, "\"ok\": false"));
}

TEST(check_bad_arguments)
{
	EXPECT_EQ(2, TOOL("ape-check", "--seed", "-4"));
	EXPECT_EQ(2, TOOL("ape-check", "--nope"));
}

/*
 * Every tool (each ape-* in the build's bin/, so a new one is covered the day it is built)
 * answers --version with the libape version it runs on and exits 0, lists it in --help, and
 * refuses a value for it.
 */
TEST(every_tool_answers_version)
{
	static const char *const known[] = { "ape-run", "ape-bench", "ape-info", "ape-check" };
	struct dirent *e;
	char want[sizeof(e->d_name) + 64];
	int tools = 0, found = 0;
	DIR *d = opendir(APE_BUILD_DIR "/bin");

	ASSERT_NE(NULL, d);
	while ((e = readdir(d))) {
		if (strncmp(e->d_name, "ape-", 4))
			continue;
		tools++;
		for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
			found += !strcmp(e->d_name, known[i]);
		snprintf(want, sizeof(want), "%s (libape) %s\n", e->d_name, ape_version_string());
		EXPECT_EQ(0, TOOL(e->d_name, "--version")) TH_LOG("%s: %s", e->d_name, err);
		EXPECT_STREQ(want, out);
		EXPECT_STREQ("", err);
		EXPECT_EQ(0, TOOL(e->d_name, "--help")) TH_LOG("%s: %s", e->d_name, err);
		EXPECT_NE(NULL, strstr(out, "--version")) TH_LOG("%s --help: %s", e->d_name, out);
		EXPECT_EQ(2, TOOL(e->d_name, "--version=1"));
		EXPECT_NE(NULL, strstr(err, "--version takes no value")) TH_LOG("%s", err);
		EXPECT_STREQ("", out);
	}
	closedir(d);
	EXPECT_EQ(4, found);
	EXPECT_LE(4, tools);
}

/* tools/gpu-check.sh, where it can run here: its usage errors, and on a machine without an
 * NVIDIA GPU the exit status 4 and the environment report, with nothing built. */
static int run_gpu_check(const char *args)
{
	char cmd[1024];
	size_t n;
	FILE *p;
	int st;

	snprintf(cmd, sizeof(cmd), "cd '%s' && tools/gpu-check.sh %s 2>&1", APE_SOURCE_DIR, args);
	p = popen(cmd, "r");
	if (!p)
		return -1;
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = '\0';
	st = pclose(p);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(gpu_check_script_without_a_gpu)
{
	char dir[] = "/tmp/ape-gpu-check-XXXXXX";

	EXPECT_EQ(2, run_gpu_check("")) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "usage: ")) TH_LOG("%s", out);
	EXPECT_EQ(2, run_gpu_check("--help")) TH_LOG("%s", out);
	if (!access("/dev/nvidiactl", F_OK))
		SKIP(return, "an NVIDIA GPU is here: the script would run the whole check");
	ASSERT_NE(NULL, mkdtemp(dir));
	EXPECT_EQ(4, run_gpu_check(dir)) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "no NVIDIA GPU here")) TH_LOG("%s", out);
	test_rmtree(dir);
}

TEST_HARNESS_MAIN
