/* SPDX-License-Identifier: MIT */
/*
 * The session trace (APE_TRACE=FILE; docs/profiling.md, "Traces") and ape-trace merge:
 *
 * - one process's file holds a span for each public call (forward, the diagnostics, backward,
 *   a ragged batch, a KV cache's append and attend, a device-resident enqueue, a failing call
 *   with its error), the device's copies and kernels of the calls that run through the
 *   executor with their kernel path as an argument, a KV cache's append copies, and a caller's
 *   own ranges (ape_range_push()) around the calls they hold, on the host's clock;
 * - the file is valid JSON (a strict checker), written whole at context destroy;
 * - "%p" becomes the process id, and ape-trace merge keeps two processes' tracks apart;
 * - a file that cannot be written costs a warning, never a call.
 *
 * Each case runs in a child process: APE_TRACE is read once per process.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/bwdcase.h"
#include "common/json_check.h"
#include "common/problem.h"
#include "common/resident.h"

/* The line of the first span named `name` (and of category cat, when not NULL) holding
 * `also` (when not NULL): its ts and dur (microseconds). False when there is none. */
static bool span(const char *text, const char *name, const char *cat, const char *also,
		 double *ts, double *dur)
{
	char key[256];

	snprintf(key, sizeof(key), "{\"name\":\"%s\",\"cat\":\"%s", name, cat ? cat : "");
	for (const char *p = strstr(text, key); p; p = strstr(p + 1, key)) {
		const char *e = strchr(p, '\n');
		size_t n = e ? (size_t)(e - p) : strlen(p);
		char line[8192];
		const char *t, *d;

		if (n >= sizeof(line))
			n = sizeof(line) - 1;
		memcpy(line, p, n);
		line[n] = '\0';
		if (also && !strstr(line, also))
			continue;
		t = strstr(line, "\"ts\":");
		d = strstr(line, "\"dur\":");
		if (!t || !d)
			return false;
		*ts = strtod(t + 5, NULL);
		*dur = strtod(d + 6, NULL);
		return true;
	}
	return false;
}

/* Runs body(arg) in a child with APE_TRACE=trace; the child's exit status. */
static int in_child(const char *trace, int (*body)(void *), void *arg)
{
	pid_t pid = fork();
	int status;

	if (pid == 0) {
		int devnull = open("/dev/null", O_WRONLY);

		if (devnull >= 0) /* the harness's own lines stay out of the way */
			dup2(devnull, 1);
		setenv("APE_TRACE", trace, 1);
		unsetenv("APE_VERBOSE");
		_exit(body(arg));
	}
	if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return -1;
	return WEXITSTATUS(status);
}

/* Every kind of call, on the reference and (where there is one) an OpenCL device. */
static int every_call(void *arg)
{
	const test_problem_shape sh = { 1, 4, 2, 29, 31, 16 };
	ape_context *ctx = NULL;
	ape_device *devs[8];
	ape_rng rng;
	int n, failures = 0;

	(void)arg;
	ape_rng_init(&rng, "every_call");
	if (ape_context_create(&ctx, NULL))
		return 10;
	n = ape_device_list(ctx, devs, 8);
	for (int d = 0; d < n; d++) {
		ape_device_info info;
		bcase c;
		grads g;

		ape_device_get_info(devs[d], &info);
		if (strcmp(info.backend, "ref") && strcmp(info.backend, "opencl"))
			continue;
		ape_range_push("my phase");
		if (bcase_ready(&c, &rng, &sh, APE_F32, false, false, devs[d]))
			return 11;
		ape_range_pop();
		if (grads_alloc(&g, &c, APE_F32) || run_backward(&c, devs[d], &g, W_ALL, NULL))
			return 12;
		if (run_resident(&c.tp, devs[d], 0))
			return 13;
		{ /* the diagnostics */
			float *ent = malloc(c.tp.rows * sizeof(float)), *md = malloc(c.tp.rows * 4);
			float *lse = malloc(c.tp.rows * sizeof(float));

			if (ape_attention_forward_diag(&devs[d], 1, NULL, &c.tp.desc, &c.tp.q.t,
						       &c.tp.k.t, &c.tp.v.t, &c.tp.o.t, lse, ent, md,
						       NULL))
				failures++;
			free(ent);
			free(md);
			free(lse);
		}
		{ /* a KV cache */
			ape_kv_cache_options ko;
			ape_kv_cache *kc = NULL;
			ape_attn_desc desc;
			test_tensor k, v, q, o;

			ape_kv_cache_options_init(&ko);
			ko.B = 1;
			ko.Hkv = 2;
			ko.H = 4;
			ko.D = 16;
			ko.dtype = APE_F32;
			ko.capacity_tokens = 128;
			if (ape_kv_cache_create(devs[d], &ko, &kc) ||
			    test_tensor_random(&k, &rng, APE_F32, 1, 2, 40, 16, 1.0) ||
			    test_tensor_random(&v, &rng, APE_F32, 1, 2, 40, 16, 1.0) ||
			    test_tensor_random(&q, &rng, APE_F32, 1, 4, 1, 16, 1.0) ||
			    test_tensor_random(&o, &rng, APE_F32, 1, 4, 1, 16, 1.0))
				return 14;
			ape_attn_desc_init(&desc);
			if (ape_kv_cache_append(kc, &k.t, &v.t) ||
			    ape_kv_cache_attend(kc, &desc, &q.t, &o.t, NULL, NULL))
				failures++;
			ape_kv_cache_destroy(kc);
			test_tensor_free(&k);
			test_tensor_free(&v);
			test_tensor_free(&q);
			test_tensor_free(&o);
		}
		{ /* a ragged batch of two sequences */
			const int64_t cu[3] = { 0, 10, 29 }, cuk[3] = { 0, 12, 31 };
			ape_varlen vl;
			ape_tensor pq, pk, pv, po;
			ape_attn_desc vd;

			ape_attn_desc_init(&vd);
			ape_varlen_init(&vl);
			vl.num_seqs = 2;
			vl.cu_seqlens_q = cu;
			vl.cu_seqlens_k = cuk;
			/* the case's tensors, [1, H, L, D], seen as packed [L, H, D] */
			ape_tensor_init_packed(&pq, c.tp.q.t.data, APE_F32, 29, 4, 16);
			ape_tensor_init_packed(&pk, c.tp.k.t.data, APE_F32, 31, 2, 16);
			ape_tensor_init_packed(&pv, c.tp.v.t.data, APE_F32, 31, 2, 16);
			ape_tensor_init_packed(&po, c.tp.o.t.data, APE_F32, 29, 4, 16);
			if (ape_attention_forward_varlen(devs[d], &vd, &vl, &pq, &pk, &pv, &po, NULL,
							 NULL))
				failures++;
		}
		grads_free(&g);
		bcase_free(&c);
	}
	/* a failing call: its span carries the error */
	ape_attention_forward(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
	ape_context_destroy(ctx);
	return failures ? 20 : 0;
}

TEST(a_session_trace_covers_every_call)
{
	char dir[] = "/tmp/ape-strace-XXXXXX", path[128], *text;
	double ts, dur, rts, rdur;

	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/s.json", dir);
	ASSERT_EQ(0, in_child(path, every_call, NULL));
	text = json_read_file(path);
	ASSERT_NE(NULL, text) TH_LOG("no trace at %s", path);
	EXPECT_TRUE(json_ok(text)) TH_LOG("not JSON: %.2000s", text);
	EXPECT_NE(NULL, strstr(text, "\"complete\":true"));
	/* the calls */
	static const char *const calls[] = {
		"ape_context_create",	  "ape_attention_forward",	"ape_attention_backward",
		"ape_attention_enqueue",  "ape_attention_forward_diag", "ape_kv_cache_append",
		"ape_kv_cache_attend",	  "ape_attention_forward_varlen", "ape_queue_synchronize",
	};
	for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); i++) {
		EXPECT_TRUE(span(text, calls[i], "call", NULL, &ts, &dur)) TH_LOG("%s", calls[i]);
	}
	/* what a call did, as its span's arguments */
	EXPECT_TRUE(span(text, "ape_attention_backward", "call", "\"path\":\"reference\"", &ts,
			 &dur));
	EXPECT_TRUE(span(text, "ape_attention_forward", "call", "\"error\":\"", &ts, &dur))
	TH_LOG("the failing call's span names its error");
	/* the device's side: the reference's kernels and copies, with their path */
	EXPECT_TRUE(span(text, "attention q0 k0", "kernel", "\"path\":\"reference\"", &ts, &dur));
	EXPECT_TRUE(span(text, "attention backward q0 k0", "kernel", "\"path\":\"reference\"", &ts,
			 &dur));
	EXPECT_NE(NULL, strstr(text, "\"cat\":\"copy\""));
	/* a KV cache's append: its copies, on the device's track */
	EXPECT_TRUE(span(text, "h2d K/V append", "copy", "\"bytes\":", &ts, &dur));
	EXPECT_NE(NULL, strstr(text, "\"name\":\"ref:0 reference")) TH_LOG("a track per device");
	/* the caller's range holds the forward call it made */
	ASSERT_TRUE(span(text, "my phase", "range", NULL, &rts, &rdur));
	ASSERT_TRUE(span(text, "ape_attention_forward", "call", "\"Lq\":29", &ts, &dur));
	EXPECT_LE(rts, ts);
	EXPECT_LE(ts + dur, rts + rdur + 1e-3);
	if (strstr(text, "\"name\":\"opencl:")) {
		EXPECT_TRUE(span(text, "attention backward q0 k0", "kernel", "\"path\":\"backward\"",
				 &ts, &dur));
		EXPECT_TRUE(span(text, "ape_kv_cache_attend", "call", "\"devices\":[\"opencl:", &ts,
				 &dur))
		TH_LOG("the KV cache's attend on OpenCL: %s", path);
		EXPECT_TRUE(span(text, "ape_attention_forward_varlen", "call", "\"path\":\"ragged\"",
				 &ts, &dur))
		TH_LOG("the ragged batch in one launch on OpenCL: %s", path);
	}
	free(text);
	if (!_metadata->passed)
		return; /* keep the trace for a look */
	unlink(path);
	rmdir(dir);
}

static int one_forward(void *arg)
{
	ape_context *ctx = NULL;
	ape_device *devs[8];
	test_problem tp;
	ape_rng rng;
	int n, ret;

	(void)arg;
	ape_rng_init(&rng, "one_forward");
	if (ape_context_create(&ctx, NULL))
		return 10;
	n = ape_device_list(ctx, devs, 8);
	if (n < 1 || test_problem_make_dims(&tp, &rng, 1, 2, 2, 9, 9, 8, APE_F32))
		return 11;
	ret = test_problem_run(&tp, devs[n - 1]);
	test_problem_free(&tp);
	ape_context_destroy(ctx);
	return ret ? 12 : 0;
}

/* "%p" and ape-trace merge: two processes' files in one timeline, their tracks apart. */
TEST(two_processes_merge)
{
	char dir[] = "/tmp/ape-strace-XXXXXX", pattern[128], cmd[1024], merged[160], *text;
	char names[2][256];
	int found = 0;

	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(pattern, sizeof(pattern), "%s/rank.%%p.json", dir);
	ASSERT_EQ(0, in_child(pattern, one_forward, NULL));
	ASSERT_EQ(0, in_child(pattern, one_forward, NULL));
	{ /* the two files, each named after its process */
		FILE *ls;

		snprintf(cmd, sizeof(cmd), "ls %s/rank.*.json", dir);
		ls = popen(cmd, "r");
		ASSERT_NE(NULL, ls);
		while (found < 2 && fgets(names[found], sizeof(names[found]), ls)) {
			names[found][strcspn(names[found], "\n")] = '\0';
			found++;
		}
		pclose(ls);
	}
	ASSERT_EQ(2, found);
	EXPECT_STRNE(names[0], names[1]);
	snprintf(merged, sizeof(merged), "%s/all.json", dir);
	snprintf(cmd, sizeof(cmd), "%s/bin/ape-trace merge -o %s %s %s", APE_BUILD_DIR, merged,
		 names[0], names[1]);
	ASSERT_EQ(0, system(cmd));
	text = json_read_file(merged);
	ASSERT_NE(NULL, text);
	EXPECT_TRUE(json_ok(text)) TH_LOG("%.3000s", text);
	/* the first input's processes are 0.., the second's 1000..; names say which file */
	EXPECT_NE(NULL, strstr(text, "\"pid\":0,"));
	EXPECT_NE(NULL, strstr(text, "\"pid\":1000,"));
	EXPECT_NE(NULL, strstr(text, ".json: libape calls, pid "));
	{
		int calls = 0;

		for (const char *p = strstr(text, "\"name\":\"ape_attention_forward\",\"cat\":\"call\"");
		     p; p = strstr(p + 1, "\"name\":\"ape_attention_forward\",\"cat\":\"call\""))
			calls++;
		EXPECT_EQ(2, calls);
	}
	free(text);
	/* not a trace: exit 2, and nothing written */
	snprintf(cmd, sizeof(cmd), "%s/bin/ape-trace merge -o %s/bad.json %s/bin/ape-trace 2>/dev/null",
		 APE_BUILD_DIR, dir, APE_BUILD_DIR);
	EXPECT_EQ(2, WEXITSTATUS(system(cmd)));
	snprintf(cmd, sizeof(cmd), "%s/bad.json", dir);
	EXPECT_NE(0, access(cmd, F_OK));
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	EXPECT_EQ(0, system(cmd));
}

/* A trace that cannot be written: the calls succeed, stderr says so once. */
TEST(an_unwritable_trace_costs_a_warning)
{
	char err[] = "/tmp/ape-strace-err-XXXXXX", *text;
	int fd = mkstemp(err), saved;

	ASSERT_LE(0, fd);
	fflush(stderr);
	saved = dup(2);
	dup2(fd, 2);
	EXPECT_EQ(0, in_child("/nonexistent-dir/t.json", one_forward, NULL));
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	close(fd);
	text = json_read_file(err);
	ASSERT_NE(NULL, text);
	EXPECT_NE(NULL, strstr(text, "APE_TRACE=/nonexistent-dir/t.json: the trace could not be "
				     "written"))
	TH_LOG("%s", text);
	{
		int n = 0;

		for (const char *p = strstr(text, "could not be written"); p;
		     p = strstr(p + 1, "could not be written"))
			n++;
		EXPECT_EQ(1, n) TH_LOG("%s", text);
	}
	free(text);
	unlink(err);
}

TEST_HARNESS_MAIN
