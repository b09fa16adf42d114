/* SPDX-License-Identifier: MIT */
/*
 * ape-check as the conformance suite that certifies a backend: its summary table, its JSON (on
 * stdout and through --report), --plugin (a missing file and bad usage exit 2, a file that is no
 * plugin fails with the loader's reason, the example plugin passes), the built-in backends
 * passing the same suite, and the distance-bias table cells: passed where a device states
 * bias_table, not claimed where it does not, failed on a plugin that states it and ignores the
 * table; that plugin's refused backward fails its backward cells and its ragged cells' backward
 * (never not claimed), and the example plugin's ragged cells measure the backward of each batch.
 * tests/test_tools.c has the dense, backward and ragged cells.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape/ape_backend.h"
#include "ape_test.h"

#define PYTHON "/usr/bin/python3"
#define EXAMPLE_PLUGIN APE_BUILD_DIR "/plugins/libape-backend-example.so"

static char out[1 << 18], err[1 << 16];

#define TOOL(...)                                                                                 \
	test_run_tool("ape-check", (const char *const[]){ __VA_ARGS__, NULL }, NULL, out,         \
		      sizeof(out), err, sizeof(err))

static int count(const char *hay, const char *needle)
{
	int n = 0;

	for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

/* The JSON's cells of `group` whose status is `status` ("pass", "fail", "not_claimed"). */
static int cells_of(const char *json, const char *group, const char *status)
{
	char g[64], st[64];
	int n = 0;

	snprintf(g, sizeof(g), "{\"group\": \"%s\", ", group);
	snprintf(st, sizeof(st), "\"status\": \"%s\"", status);
	for (const char *p = json; (p = strstr(p, g)); p += strlen(g)) {
		const char *s = strstr(p, "\"status\": ");

		n += s && !strncmp(s, st, strlen(st));
	}
	return n;
}

/* The table cells of a run without the long cases (--quick, --plugin), in their order. */
static const char *const table_cells[] = {
	"table_t5_gqa_causal_f32",   "table_t5_noncausal_both_sides_f16",
	"table_shared_longer_bf16",  "table_gauss_far_band_l1024_f32",
	"table_kv_cache_decode_f16", "table_ragged_t5_f32",
	"table_backward_t5_gqa_f32", "table_backward_shared_f16",
	"same_bits_backward_table_f16",
};

#define NTABLE_CELLS ((int)(sizeof(table_cells) / sizeof(table_cells[0])))

/*
 * Checks the JSON object in `file` with Python: every cell has its fields, the summary counts
 * what the cells say per group and in total, "ok" is whether none failed. Prints "cells
 * PASSED FAILED NOT_CLAIMED" into got. Returns pclose()'s status (0: it all held).
 */
static int check_json(const char *file, char *got, size_t len)
{
	static const char script[] =
		"import json, sys\n"
		"d = json.load(open(sys.argv[1]))\n"
		"groups = ['load', 'forward', 'backward', 'ragged', 'diagnostics', 'kv', 'resident',\n"
		"          'tables', 'determinism', 'failures']\n"
		"keys = {'group', 'cell', 'device', 'status', 'max_err', 'tol', 'message'}\n"
		"n = {g: {'passed': 0, 'failed': 0, 'not_claimed': 0} for g in groups + ['total']}\n"
		"word = {'pass': 'passed', 'fail': 'failed', 'not_claimed': 'not_claimed'}\n"
		"for c in d['cells']:\n"
		"    assert set(c) == keys, c\n"
		"    assert c['group'] in groups, c\n"
		"    n[c['group']][word[c['status']]] += 1\n"
		"    n['total'][word[c['status']]] += 1\n"
		"    assert c['status'] != 'pass' or c['max_err'] is None or c['max_err'] <= c['tol'], c\n"
		"assert d['summary'] == n, (d['summary'], n)\n"
		"assert d['ok'] == (n['total']['failed'] == 0)\n"
		"t = n['total']\n"
		"print(len(d['cells']), t['passed'], t['failed'], t['not_claimed'])\n";
	char cmd[2048];
	FILE *p;

	/* the script through a here-document, the file as argv[1] */
	snprintf(cmd, sizeof(cmd), "%s - '%s' 2>&1 <<'EOF'\n%sEOF\n", PYTHON, file, script);
	p = popen(cmd, "r");
	if (!p)
		return -1;
	if (!fgets(got, (int)len, p))
		got[0] = '\0';
	while (fgetc(p) != EOF)
		;
	return pclose(p);
}

/* The reference checked against itself passes every group, and the report file holds what
 * stdout printed: counts that match, cell by cell. */
TEST(json_report_parses_and_counts_match)
{
	char dir[] = "/tmp/ape-check-XXXXXX", path[64], got[256], want[64];
	FILE *f;
	size_t n;
	char *file = NULL;
	int cells;

	if (access(PYTHON, X_OK))
		SKIP(return, "no %s to parse the JSON with", PYTHON);
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/report.json", dir);
	ASSERT_EQ(0, TOOL("--backend", "ref", "--quick", "--json", "--seed", "5", "--report", path))
		TH_LOG("%s\n%s", out, err);
	f = fopen(path, "r");
	ASSERT_NE(NULL, f);
	file = calloc(1, sizeof(out));
	ASSERT_NE(NULL, file);
	n = fread(file, 1, sizeof(out) - 1, f);
	fclose(f);
	EXPECT_LT(0, n);
	EXPECT_STREQ(out, file); /* the same object on stdout and in the file */
	free(file);
	ASSERT_EQ(0, check_json(path, got, sizeof(got))) TH_LOG("%s", got);
	cells = count(out, "{\"group\": ");
	snprintf(want, sizeof(want), "%d %d 0 0\n", cells, cells);
	EXPECT_STREQ(want, got);
	/* every group but the plugin's loading, on the one device */
	for (const char *const *g = (const char *const[]){ "forward", "backward", "ragged",
							    "diagnostics", "kv", "resident",
							    "tables", "determinism", "failures",
							    NULL };
	     *g; g++) {
		char key[64];

		snprintf(key, sizeof(key), "{\"group\": \"%s\", ", *g);
		EXPECT_LT(0, count(out, key)) TH_LOG("no %s cell", *g);
	}
	EXPECT_EQ(0, count(out, "{\"group\": \"load\""));
	EXPECT_NE(NULL, strstr(out, "\"plugin\": null"));
	EXPECT_NE(NULL, strstr(out, "\"seed\": 5,"));
	EXPECT_NE(NULL, strstr(out, "\"long_cases\": false"));
	/* no temporary file left beside it */
	EXPECT_EQ(0, unlink(path));
	EXPECT_EQ(0, rmdir(dir));
}

/* The text ends with the summary table, one line per group with cells, and the verdict. */
TEST(text_ends_with_the_summary)
{
	const char *s;

	ASSERT_EQ(0, TOOL("--backend", "ref", "--quick", "--seed", "6")) TH_LOG("%s\n%s", out, err);
	s = strstr(out, "\nsummary (cells over every device)  passed  failed  not claimed\n");
	ASSERT_NE(NULL, s) TH_LOG("%s", out);
	for (const char *const *g = (const char *const[]){ "forward", "backward", "ragged",
							    "diagnostics", "kv", "resident", "tables",
							    "determinism", "failures", "total", NULL };
	     *g; g++) {
		char key[64];

		snprintf(key, sizeof(key), "\n%s ", *g);
		EXPECT_NE(NULL, strstr(s, key)) TH_LOG("no line for %s: %s", *g, s);
	}
	EXPECT_NE(NULL, strstr(s, "\nPASS: every cell claimed passed on 1 device")) TH_LOG("%s", s);
	/* the new groups' matrices, one line per cell */
	EXPECT_NE(NULL, strstr(out, "\nforward_null_q "));
	EXPECT_NE(NULL, strstr(out, "\nkv_pool_pages_fork_bf16 "));
	EXPECT_NE(NULL, strstr(out, "\nsame_bits_backward_f16 "));
	for (int i = 0; i < NTABLE_CELLS; i++) {
		char key[64];

		snprintf(key, sizeof(key), "\n%s ", table_cells[i]);
		EXPECT_NE(NULL, strstr(out, key)) TH_LOG("no line for %s", table_cells[i]);
	}
}

/* Whether the devices of `backend` state bias_table (the first of them; false: none). */
static bool states_tables(ape_context *ctx, const char *backend)
{
	ape_device *devs[32];
	const int n = ape_device_list(ctx, devs, 32);

	for (int d = 0; d < n; d++) {
		ape_device_info info;

		if (!ape_device_get_info(devs[d], &info) && !strcmp(info.backend, backend))
			return ape_device_capabilities(devs[d]) & APE_BE_CAP_BIAS_TABLE;
	}
	return false;
}

/* Every built-in backend available here passes the suite, the reference in --quick (its long
 * cases take more than a minute). */
TEST(builtin_backends_pass)
{
	ape_context *ctx = test_context(NULL);
	ape_backend_info bi;
	int checked = 0;

	ASSERT_NE(NULL, ctx);
	for (int b = 0, n = ape_backend_get_info(ctx, 0, NULL); b < n; b++) {
		bool ref;

		ape_backend_get_info(ctx, b, &bi);
		if (!bi.available)
			continue;
		ref = !strcmp(bi.name, "ref");
		EXPECT_EQ(0, ref ? TOOL("--backend", bi.name, "--json", "--quick")
				 : TOOL("--backend", bi.name, "--json"))
			TH_LOG("%s: %s\n%s", bi.name, out, err);
		EXPECT_NE(NULL, strstr(out, "\"ok\": true")) TH_LOG("%s", bi.name);
		EXPECT_EQ(0, count(out, "\"status\": \"fail\"")) TH_LOG("%s: %s", bi.name, out);
		EXPECT_EQ(!ref, strstr(out, "\"long_cases\": true") != NULL);
		/* the table cells: claimed where the backend's devices state bias_table */
		EXPECT_LT(0, count(out, "{\"group\": \"tables\", ")) TH_LOG("%s", bi.name);
		EXPECT_EQ(0, cells_of(out, "tables", states_tables(ctx, bi.name) ? "not_claimed"
										 : "pass"))
			TH_LOG("%s: %s", bi.name, out);
		checked++;
	}
	ape_context_destroy(ctx);
	EXPECT_LE(1, checked);
}

/* Bad usage exits 2 with a message naming the option and the value, and prints nothing else;
 * --report leaves no file behind. */
TEST(usage_errors)
{
	char dir[] = "/tmp/ape-check-XXXXXX", path[64];

	EXPECT_EQ(2, TOOL("--plugin", "/nonexistent.so"));
	EXPECT_NE(NULL, strstr(err, "--plugin /nonexistent.so: No such file")) TH_LOG("%s", err);
	EXPECT_STREQ("", out);
	EXPECT_EQ(2, TOOL("--plugin", APE_BUILD_DIR));
	EXPECT_NE(NULL, strstr(err, "a folder")) TH_LOG("%s", err);
	EXPECT_EQ(2, TOOL("--plugin", "/bin/true", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(err, "give one of them")) TH_LOG("%s", err);
	EXPECT_EQ(2, TOOL("--plugin"));
	EXPECT_EQ(2, TOOL("--report", "/nonexistent-folder/report.json"));
	EXPECT_NE(NULL, strstr(err, "--report /nonexistent-folder/report.json: ")) TH_LOG("%s", err);
	EXPECT_STREQ("", out);
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/", dir);
	EXPECT_EQ(2, TOOL("--report", path));
	EXPECT_NE(NULL, strstr(err, "not a file name")) TH_LOG("%s", err);
	snprintf(path, sizeof(path), "%s/r.json", dir);
	EXPECT_EQ(2, TOOL("--report", path, "--seed", "x"));
	EXPECT_NE(0, access(path, F_OK));
	EXPECT_EQ(0, rmdir(dir)); /* empty: nothing was written */
}

/* A file that is no plugin (libape itself: no ape_backend_plugin) is refused by the loader: the
 * certification fails (exit 1) with the reason, in the text and in the JSON. */
TEST(refused_plugin_fails_with_the_reason)
{
	const char *so = APE_BUILD_DIR "/lib/libape.so.0";

	if (access(so, F_OK))
		SKIP(return, "no %s in this build", so);
	EXPECT_EQ(1, TOOL("--plugin", so)) TH_LOG("%s\n%s", out, err);
	EXPECT_NE(NULL, strstr(err, "--plugin " APE_BUILD_DIR "/lib/libape.so.0: not loaded: "))
		TH_LOG("%s", err);
	EXPECT_NE(NULL, strstr(out, "\nFAIL: 1 cell failed")) TH_LOG("%s", out);
	EXPECT_EQ(1, TOOL("--plugin", so, "--json"));
	EXPECT_NE(NULL, strstr(out, "\"ok\": false")) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "\"loaded\": false")) TH_LOG("%s", out);
	EXPECT_EQ(1, count(out, "{\"group\": \"load\", \"cell\": \"plugin_loads\", \"device\": null, "
				"\"status\": \"fail\""))
		TH_LOG("%s", out);
	EXPECT_EQ(0, count(out, "{\"group\": \"forward\""));
	/* an executable is no plugin either */
	EXPECT_EQ(1, TOOL("--plugin", "/bin/true"));
	EXPECT_NE(NULL, strstr(err, "not loaded: ")) TH_LOG("%s", err);
}

/* A plugin that loads but computes nothing (the loader's fixture, whose attention answers
 * APE_ENOTSUP) fails: the forward is every backend's, and each failure names its device. */
TEST(plugin_that_computes_nothing_fails)
{
	const char *so = APE_BUILD_DIR "/tests/plugins/libape-backend-a.so";

	if (access(so, F_OK))
		SKIP(return, "no fixture plugin %s (tests/plugins/fixture.c)", so);
	EXPECT_EQ(1, TOOL("--plugin", so, "--json", "--quick")) TH_LOG("%s\n%s", out, err);
	EXPECT_NE(NULL, strstr(out, "\"ok\": false"));
	EXPECT_EQ(1, count(out, "\"cell\": \"plugin_loads\", \"device\": null, \"status\": \"pass\""))
		TH_LOG("%s", out);
	EXPECT_LT(0, count(out, "{\"group\": \"forward\", \"cell\": \"one_row_d64_f32\", "
				"\"device\": \"plug_a:0\", \"status\": \"fail\""))
		TH_LOG("%s", out);
	EXPECT_EQ(0, count(out, "{\"group\": \"forward\", \"cell\": \"one_row_d64_f32\", "
				"\"device\": \"plug_a:0\", \"status\": \"pass\""));
	EXPECT_NE(NULL, strstr(err, "one_row_d64_f32 on plug_a:0: ")) TH_LOG("%s", err);
}

/* A plugin whose devices state the backward pass and whose backward op refuses it
 * (tests/plugins/liar.c, the example's table otherwise): its backward cells fail, named so,
 * rather than count as not claimed. */
TEST(a_stated_capability_refused_fails)
{
	const char *so = APE_BUILD_DIR "/tests/plugins/liar/libape-backend-liar.so";

	if (access(so, F_OK))
		SKIP(return, "no %s (tests/plugins/liar.c)", so);
	EXPECT_EQ(1, TOOL("--plugin", so, "--json", "--quick", "--seed", "3"))
		TH_LOG("%s\n%s", out, err);
	EXPECT_EQ(1, count(out, "{\"group\": \"backward\", \"cell\": \"one_row_d64_f32\", "
				"\"device\": \"liar:0\", \"status\": \"fail\""))
		TH_LOG("%s", out);
	EXPECT_EQ(0, count(out, "{\"group\": \"backward\", \"cell\": \"one_row_d64_f32\", "
				"\"device\": \"liar:0\", \"status\": \"not_claimed\""))
		TH_LOG("%s", out);
	/* the backward's determinism cell too, with the rule's own words */
	EXPECT_EQ(1, count(out, "\"cell\": \"same_bits_backward_f16\", \"device\": \"liar:0\", "
				"\"status\": \"fail\""))
		TH_LOG("%s", out);
	EXPECT_LT(0, count(out, "the device states backward, yet: ")) TH_LOG("%s", out);
	/* the ragged cells' backward too: each fails, none is not claimed */
	EXPECT_LT(0, cells_of(out, "ragged", "fail")) TH_LOG("%s", out);
	EXPECT_EQ(cells_of(out, "ragged", "fail"), count(out, "\"bwd_status\": \"fail\""));
	EXPECT_EQ(0, cells_of(out, "ragged", "not_claimed"));
	EXPECT_EQ(0, count(out, "{\"group\": \"forward\", \"cell\": \"one_row_d64_f32\", "
				"\"device\": \"liar:0\", \"status\": \"fail\""))
		TH_LOG("%s", out);
	/* its forward drops the table although it states bias_table: every table cell fails,
	 * none is not claimed */
	for (int i = 0; i < NTABLE_CELLS; i++) {
		char key[160];

		snprintf(key, sizeof(key), "{\"group\": \"tables\", \"cell\": \"%s\", "
			 "\"device\": \"liar:0\", \"status\": \"fail\"", table_cells[i]);
		EXPECT_EQ(1, count(out, key)) TH_LOG("%s: %s", table_cells[i], out);
	}
	EXPECT_EQ(NTABLE_CELLS, cells_of(out, "tables", "fail"));
	EXPECT_EQ(0, cells_of(out, "tables", "not_claimed"));
	EXPECT_LT(0, count(out, "the device states backward bias_table, yet: ")) TH_LOG("%s", out);
}

/* The example plugin (make plugin-example) passes: every cell it claims, on its devices alone. */
TEST(example_plugin_passes)
{
	char got[256];

	if (access(EXAMPLE_PLUGIN, F_OK))
		SKIP(return, "no %s: make plugin-example builds it", EXAMPLE_PLUGIN);
	ASSERT_EQ(0, TOOL("--plugin", EXAMPLE_PLUGIN, "--json", "--seed", "8"))
		TH_LOG("%s\n%s", out, err);
	EXPECT_NE(NULL, strstr(out, "\"ok\": true"));
	EXPECT_NE(NULL, strstr(out, "\"loaded\": true")) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "\"devices\": [{\"backend\": \"example\", ")) TH_LOG("%s", out);
	EXPECT_EQ(0, count(out, "\"backend\": \"ref\""));
	EXPECT_EQ(1, count(out, "\"cell\": \"plugin_loads\", \"device\": null, \"status\": \"pass\""));
	EXPECT_EQ(0, count(out, "\"status\": \"fail\"")) TH_LOG("%s", out);
	/* at least the forward and the backward, claimed and passed */
	EXPECT_LT(0, count(out, "{\"group\": \"forward\", "));
	EXPECT_LT(0, count(out, "{\"group\": \"backward\", "));
	EXPECT_EQ(0, count(out, "\"group\": \"forward\", \"cell\": \"l4097"));
	/* it computes tables: every table cell claimed and passed (the long row of 1024, as
	 * --quick has it) */
	for (int i = 0; i < NTABLE_CELLS; i++) {
		char key[160];

		snprintf(key, sizeof(key), "{\"group\": \"tables\", \"cell\": \"%s\", "
			 "\"device\": \"example:0\", \"status\": \"pass\"", table_cells[i]);
		EXPECT_EQ(1, count(out, key)) TH_LOG("%s: %s", table_cells[i], out);
	}
	EXPECT_EQ(NTABLE_CELLS, cells_of(out, "tables", "pass")) TH_LOG("%s", out);
	/* its ragged cells: each batch's forward and backward (a dense backward per piece: it
	 * takes no ragged launches), every gradient measured */
	EXPECT_LT(0, cells_of(out, "ragged", "pass")) TH_LOG("%s", out);
	EXPECT_EQ(cells_of(out, "ragged", "pass"), count(out, "\"bwd_status\": \"ok\""))
		TH_LOG("%s", out);
	EXPECT_EQ(cells_of(out, "ragged", "pass"), count(out, "\"bwd_max_err_dparams\": "));
	if (!access(PYTHON, X_OK)) {
		char path[] = "/tmp/ape-check-example-XXXXXX";
		int fd = mkstemp(path);
		FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;

		ASSERT_NE(NULL, f);
		fputs(out, f);
		fclose(f);
		EXPECT_EQ(0, check_json(path, got, sizeof(got))) TH_LOG("%s", got);
		unlink(path);
	}
}

TEST_HARNESS_MAIN
