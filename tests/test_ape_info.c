/* SPDX-License-Identifier: MIT */
/*
 * ape-info as users run it: a subprocess. What it prints must be what the library says: every
 * physical device with its NUMA node and CPUs (the OpenCL CPU device too, when there is one),
 * every absent backend with its reason, the DRM status; the same as JSON that parses; a
 * topology file described instead of this machine; bad arguments refused with status 2.
 * Also `ape-bench --numa`, the other tool of the device topology: it measures from every node
 * and says when there is nothing to compare.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape_test.h"
#include "ape/ape_backend.h"

#define FIXTURE_DIR APE_SOURCE_DIR "/tests/fixtures/"
#define PYTHON "/usr/bin/python3"

struct result {
	int status;
	char out[65536];
	char err[8192];
};

/* Runs ape-info with `args` (NULL-terminated). */
static void run_info(struct result *r, const char *const *args)
{
	r->status = test_run_tool("ape-info", args, NULL, r->out, sizeof(r->out), r->err,
				  sizeof(r->err));
}

#define ARGS(...) ((const char *const[]){ __VA_ARGS__, NULL })

/* The (first) line of `text` holding `needle`, copied into `line`; false if none. A needle that
 * starts with a newline matches at the start of a line. */
/* Whether `line` holds `word` between spaces (or at its end). */
static bool has_word(const char *line, const char *word)
{
	const size_t n = strlen(word);

	for (const char *p = line; (p = strstr(p, word)); p++)
		if (p > line && p[-1] == ' ' && (p[n] == ' ' || p[n] == '\0'))
			return true;
	return false;
}

static bool line_with(const char *text, const char *needle, char *line, size_t cap)
{
	const char *at = strstr(text, needle), *start, *end;

	if (!at)
		return false;
	if (needle[0] == '\n')
		at++;
	for (start = at; start > text && start[-1] != '\n'; start--)
		;
	end = strchr(at, '\n');
	snprintf(line, cap, "%.*s", (int)(end ? end - start : (long)strlen(start)), start);
	return true;
}

static ape_context *machine(void)
{
	ape_context *ctx = NULL;

	if (ape_context_create(&ctx, NULL))
		fprintf(stderr, "# %s\n", ape_last_error());
	return ctx;
}

TEST(lists_devices_backends_and_drm)
{
	static struct result r;
	ape_context *ctx = machine();
	ape_topology_info t;
	char line[512], want[300];
	int np, nb;

	ASSERT_NE(NULL, ctx);
	run_info(&r, ARGS("--topology"));
	ASSERT_EQ(0, r.status) TH_LOG("stderr: %s", r.err);
	ASSERT_EQ(0, ape_topology_get_info(ctx, &t));
	EXPECT_TRUE(strstr(r.out, t.source) != NULL) TH_LOG("%s", r.out);
	snprintf(want, sizeof(want), "DRM: %s", t.drm_note);
	EXPECT_TRUE(strstr(r.out, want) != NULL) TH_LOG("'%s' not in: %s", want, r.out);
	EXPECT_TRUE(strstr(r.out, "device to device:") && strstr(r.out, "device to NUMA node"));

	np = ape_physical_get_info(ctx, 0, NULL);
	for (int i = 0; i < np; i++) {
		ape_physical_info p;
		char name[40], node[16];

		ASSERT_EQ(0, ape_physical_get_info(ctx, i, &p));
		/* the row starts with the index; its name is checked too, except under valgrind,
		 * whose CPU PoCL sees as another model than the tool (run natively) does */
		snprintf(name, sizeof(name), "\n%3d  ", i);
		ASSERT_TRUE(line_with(r.out, name, line, sizeof(line))) TH_LOG("no row %d", i);
		snprintf(name, sizeof(name), "%.34s", p.name);
		if (!ape_test_slow()) {
			EXPECT_TRUE(strstr(line, name) != NULL) TH_LOG("%s not in: %s", name, line);
		}
		snprintf(node, sizeof(node), " %d ", p.numa_node);
		if (p.numa_node >= 0) {
			EXPECT_TRUE(strstr(line, node) != NULL) TH_LOG("node %d: %s", p.numa_node, line);
		}
		if (p.cpuset[0]) {
			EXPECT_TRUE(strstr(line, p.cpuset) != NULL) TH_LOG("CPUs %s: %s", p.cpuset, line);
		}
		EXPECT_TRUE(strstr(line, p.backend) != NULL) TH_LOG("%s", line);
		if (p.reason[0]) {
			EXPECT_TRUE(strstr(r.out, p.reason) != NULL) TH_LOG("reason \"%s\"", p.reason);
		}
		if (p.kind == APE_DEVICE_CPU) { /* PoCL: its node, unless it spans several */
			EXPECT_TRUE(strstr(line, "opencl") != NULL) TH_LOG("%s", line);
			if (t.numa_nodes == 1) {
				EXPECT_LE(0, p.numa_node);
			}
		}
	}
	nb = ape_backend_get_info(ctx, 0, NULL);
	for (int i = 0; i < nb; i++) {
		ape_backend_info b;

		ASSERT_EQ(0, ape_backend_get_info(ctx, i, &b));
		if (b.available)
			snprintf(line, sizeof(line), "%-8s available: %d device", b.name,
				 b.device_count);
		else
			snprintf(line, sizeof(line), "%-8s not available: %s", b.name, b.reason);
		EXPECT_TRUE(strstr(r.out, line) != NULL) TH_LOG("'%s' not in: %s", line, r.out);
	}
	/* what each device states it can do, in the capabilities' own words */
	EXPECT_TRUE(strstr(r.out, "\ncapabilities:\n") != NULL) TH_LOG("%s", r.out);
	{
		ape_device *devs[16];
		const int nd = ape_device_list(ctx, devs, 16);

		for (int i = 0; i < nd; i++) {
			ape_device_info di;
			char spec[48];
			const uint64_t caps = ape_device_capabilities(devs[i]);

			ASSERT_EQ(0, ape_device_get_info(devs[i], &di));
			snprintf(spec, sizeof(spec), "\n  %s:%d ", di.backend, di.backend_index);
			ASSERT_TRUE(line_with(r.out, spec, line, sizeof(line))) TH_LOG("%s", spec);
			for (int b = 0; b < 64; b++) {
				const char *w = ape_be_cap_name((uint64_t)1 << b);

				if (w)
					EXPECT_EQ((caps >> b) & 1, has_word(line, w))
					TH_LOG("%s: %s", w, line);
			}
		}
	}
	ape_context_destroy(ctx);
}

TEST(json_parses_and_agrees)
{
	static struct result r;
	static const char path[] = "/tmp/ape-test-info.json";
	ape_context *ctx = machine();
	char cmd[512], expect[64];
	FILE *p;
	char got[256] = "";
	int n;

	if (!APE_TEST_HAVE_HWLOC)
		SKIP(return, APE_TEST_NO_HWLOC);
	ASSERT_NE(NULL, ctx);
	FILE *f;

	run_info(&r, ARGS("--json"));
	ASSERT_EQ(0, r.status) TH_LOG("stderr: %s", r.err);
	EXPECT_TRUE(strstr(r.out, "\"devices\"") != NULL);
	if (access(PYTHON, X_OK)) {
		ape_context_destroy(ctx);
		SKIP(return, "no %s to parse the JSON with", PYTHON);
	}
	f = fopen(path, "w");
	ASSERT_NE(NULL, f);
	fputs(r.out, f);
	ASSERT_EQ(0, fclose(f));
	snprintf(cmd, sizeof(cmd),
		 PYTHON " -c \"import json; d = json.load(open('%s')); "
			"print(len(d['devices']), len(d['backends']), d['machine']['this_machine'])\"",
		 path);
	p = popen(cmd, "r");
	ASSERT_NE(NULL, p);
	if (!fgets(got, sizeof(got), p))
		got[0] = '\0';
	EXPECT_EQ(0, pclose(p)) TH_LOG("the JSON does not parse: %s", r.out);
	n = ape_physical_get_info(ctx, 0, NULL);
	snprintf(expect, sizeof(expect), "%d %d True\n", n, ape_backend_get_info(ctx, 0, NULL));
	EXPECT_STREQ(expect, got);
	unlink(path);
	ape_context_destroy(ctx);
}

TEST(describes_a_topology_file)
{
	static struct result r;
	static const char *const gpus[] = { "0000:1b:00.0", "0000:43:00.0", "0000:52:00.0",
					    "0000:61:00.0", "0000:9d:00.0", "0000:c3:00.0",
					    "0000:d1:00.0", "0000:df:00.0" };
	char line[512];

	if (!APE_TEST_HAVE_HWLOC)
		SKIP(return, APE_TEST_NO_HWLOC);
	run_info(&r, ARGS("--topology", "--topology-xml", FIXTURE_DIR "dual-socket-8gpu.xml"));
	ASSERT_EQ(0, r.status) TH_LOG("stderr: %s", r.err);
	EXPECT_TRUE(strstr(r.out, "2 packages, 16 cores, 32 PUs, 2 NUMA nodes") != NULL)
	TH_LOG("%s", r.out);
	for (int i = 0; i < 8; i++) {
		ASSERT_TRUE(line_with(r.out, gpus[i], line, sizeof(line))) TH_LOG("%s", gpus[i]);
		EXPECT_TRUE(strstr(line, i < 4 ? "0-7,16-23" : "8-15,24-31") != NULL)
		TH_LOG("%s", line);
		EXPECT_TRUE(strstr(line, "cuda") != NULL) TH_LOG("%s", line);
	}
	EXPECT_TRUE(line_with(r.out, "D0    ", line, sizeof(line)));
	EXPECT_TRUE(strstr(r.out, "D0         X  NODE  NODE  NODE   SYS   SYS   SYS   SYS"))
	TH_LOG("%s", r.out);
	EXPECT_TRUE(strstr(r.out, "bound to node 1") != NULL);
	EXPECT_TRUE(strstr(r.out, "none usable here: described by XML file") != NULL);
	EXPECT_TRUE(strstr(r.out, "ASPEED") == NULL) TH_LOG("the BMC's VGA is no compute device");

	run_info(&r, ARGS("--topology", "--numa", "interleave", "--topology-xml",
			  FIXTURE_DIR "pcie-switch.xml"));
	ASSERT_EQ(0, r.status) TH_LOG("stderr: %s", r.err);
	EXPECT_TRUE(strstr(r.out, "interleaved over 0-1") != NULL);
	EXPECT_TRUE(strstr(r.out, " PIX ") && strstr(r.out, " PXB ")) TH_LOG("%s", r.out);
}

TEST(refuses_bad_arguments)
{
	static struct result r;

	run_info(&r, ARGS("--topology-xml", "/nonexistent/box.xml"));
	EXPECT_EQ(APE_TEST_HAVE_HWLOC ? 2 : 1, r.status); /* without hwloc: not supported */
	EXPECT_TRUE(strstr(r.err, "/nonexistent/box.xml") != NULL) TH_LOG("%s", r.err);
	run_info(&r, ARGS("--numa", "nearest"));
	EXPECT_EQ(2, r.status);
	EXPECT_TRUE(strstr(r.err, "--numa") != NULL) TH_LOG("%s", r.err);
	run_info(&r, ARGS("--frobnicate"));
	EXPECT_EQ(2, r.status);
	run_info(&r, ARGS("--help"));
	EXPECT_EQ(0, r.status);
	EXPECT_TRUE(strstr(r.out, "usage: ape-info") != NULL);
	ASSERT_EQ(0, setenv("APE_VISIBLE_DEVICES", "0000:fe:1f.7", 1));
	run_info(&r, ARGS("--json"));
	EXPECT_EQ(2, r.status);
	EXPECT_TRUE(strstr(r.err, "APE_VISIBLE_DEVICES") != NULL) TH_LOG("%s", r.err);
	EXPECT_STREQ("", r.out);
}

/* --numa takes the library's words for policies; "default" is what no --numa does: APE_NUMA. */
TEST(numa_policy_words)
{
	static struct result r;

	ASSERT_EQ(0, setenv("APE_NUMA", "off", 1));
	run_info(&r, ARGS("--json", "--backends", "ref", "--numa", "default"));
	EXPECT_EQ(0, r.status) TH_LOG("%s", r.err);
	EXPECT_TRUE(strstr(r.out, "\"numa_policy\": \"off\"") != NULL) TH_LOG("%s", r.out);
	run_info(&r, ARGS("--json", "--backends", "ref", "--numa", "interleave"));
	EXPECT_EQ(0, r.status) TH_LOG("%s", r.err);
	EXPECT_TRUE(strstr(r.out, "\"numa_policy\": \"interleave\"") != NULL) TH_LOG("%s", r.out);
	unsetenv("APE_NUMA");
	run_info(&r, ARGS("--numa", "Local"));
	EXPECT_EQ(2, r.status);
	EXPECT_TRUE(strstr(r.err, "--numa: ape_numa_policy_from_name: name = \"Local\": must be "
			       "default, local, interleave or off") != NULL) TH_LOG("%s", r.err);
	EXPECT_STREQ("", r.out);
}

TEST(bench_numa_measures_every_node)
{
	static struct result r;
	ape_context *ctx = machine();
	char want[64];
	int n;

	if (!APE_TEST_HAVE_HWLOC)
		SKIP(return, APE_TEST_NO_HWLOC);
	ASSERT_NE(NULL, ctx);
	n = ape_numa_get_info(ctx, 0, NULL);
	ape_context_destroy(ctx);
	r.status = test_run_tool("ape-bench", ARGS("--numa", "--backend", "ref", "--copy-mib", "8",
						   "--repeats", "2", "--json"),
				 NULL, r.out, sizeof(r.out), r.err, sizeof(r.err));
	ASSERT_EQ(0, r.status) TH_LOG("stderr: %s", r.err);
	for (int i = 0; i < n; i++) {
		/* each node's buffer really was on that node */
		snprintf(want, sizeof(want), "{\"node\": %d, ", i);
		EXPECT_TRUE(strstr(r.out, want) != NULL) TH_LOG("%s", r.out);
		snprintf(want, sizeof(want), "\"pages_on\": %d,", i);
		EXPECT_TRUE(strstr(r.out, want) != NULL) TH_LOG("%s", r.out);
	}
	if (n == 1) {
		EXPECT_TRUE(strstr(r.out, "\"compared\": false") != NULL);
		EXPECT_TRUE(strstr(r.out, "one NUMA node") != NULL) TH_LOG("%s", r.out);
	}
	r.status = test_run_tool("ape-bench", ARGS("--numa", "--backend", "ref", "--copy-mib", "1",
						   "--repeats", "1"),
				 NULL, r.out, sizeof(r.out), r.err, sizeof(r.err));
	ASSERT_EQ(0, r.status) TH_LOG("stderr: %s", r.err);
	EXPECT_TRUE(strstr(r.out, "(local)") != NULL) TH_LOG("%s", r.out);
}

TEST_HARNESS_MAIN
