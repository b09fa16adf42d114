/* SPDX-License-Identifier: MIT */
/*
 * The call log (APE_VERBOSE, ape_context_options.verbose; docs/profiling.md) and the kernel
 * path a call reports (ape_stats.path):
 *
 * - each path is named as taken: the line's path and the statistics' agree, and on OpenCL the
 *   kernels the device actually ran (ape__ocl_debug_kernels()) are that path's kernels: the
 *   general kernel, the separable path, a split of heads, the decode, the backward sweep, a
 *   KV cache's attend, a device-resident enqueue;
 * - level 1 is one line per call, level 2 adds the plan, level 0 and the default are silent;
 * - JSON lines parse (a small checker) and carry the same figures;
 * - a failing call logs its error once, with the message ape_last_error() gives; a call that
 *   succeeds logs none; a bad level is refused naming opts->verbose.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/backends.h"
#include "common/bwdcase.h"
#include "common/json_check.h"
#include "common/problem.h"
#include "common/resident.h"
#include "../opencl/ocl_debug.h"

/* ------------------------------------------------------------------ capturing stderr */

struct capture {
	char path[64];
	int saved;
	char text[65536];
};

static void capture_begin(struct capture *c)
{
	int fd;

	snprintf(c->path, sizeof(c->path), "/tmp/ape-verbose-XXXXXX");
	fd = mkstemp(c->path);
	fflush(stderr);
	c->saved = dup(2);
	dup2(fd, 2);
	close(fd);
	c->text[0] = '\0';
}

/* Restores stderr; c->text holds what was written meanwhile. */
static const char *capture_end(struct capture *c)
{
	FILE *f;
	size_t n = 0;

	fflush(stderr);
	dup2(c->saved, 2);
	close(c->saved);
	f = fopen(c->path, "r");
	if (f) {
		n = fread(c->text, 1, sizeof(c->text) - 1, f);
		fclose(f);
	}
	c->text[n] = '\0';
	unlink(c->path);
	return c->text;
}

static int count_lines(const char *s, const char *prefix)
{
	int n = 0;

	for (const char *l = s; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
		n += !strncmp(l, prefix, strlen(prefix));
	return n;
}

/* The line that starts with prefix, copied into buf ("" when none). */
static const char *line_of(const char *s, const char *prefix, char *buf, size_t cap)
{
	buf[0] = '\0';
	for (const char *l = s; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
		if (!strncmp(l, prefix, strlen(prefix))) {
			const char *e = strchr(l, '\n');
			size_t n = e ? (size_t)(e - l) : strlen(l);

			if (n >= cap)
				n = cap - 1;
			memcpy(buf, l, n);
			buf[n] = '\0';
			break;
		}
	return buf;
}

/* The paths a text line names: "path: general x1 (...) separable x2 (...)" -> "general+separable"
 * in the line's order (which is ape_stats.path's). */
static void line_paths(const char *line, char *out, size_t cap)
{
	const char *p = strstr(line, " | path:");
	const char *end = p ? strstr(p + 8, " | ") : NULL;
	size_t n = 0;

	out[0] = '\0';
	if (!p)
		return;
	for (p += 8; p < (end ? end : p + strlen(p));) {
		char word[64];
		int used = 0;

		if (sscanf(p, " %63[a-z-] x%*u%n", word, &used) != 1 || !used)
			break;
		n += (size_t)snprintf(out + n, cap - n, "%s%s", n ? "+" : "", word);
		p += used;
		/* skip the reason in parentheses */
		p = strchr(p, ')');
		if (!p)
			break;
		p++;
	}
}

/* ------------------------------------------------------------------ the fixture */

FIXTURE(vb)
{
	ape_context *ctx;
	ape_device *ref, *ocl; /* ocl NULL where there is no OpenCL device */
	char why[TEST_WHY_LEN];
};

static ape_context *context_at(int level)
{
	ape_context_options o;
	ape_context *ctx = NULL;

	ape_context_options_init(&o);
	o.backends = "ref,opencl";
	o.verbose = level;
	return ape_context_create(&ctx, &o) ? NULL : ctx;
}

FIXTURE_SETUP(vb)
{
	ape_device *devs[8];
	int n;

	self->ctx = context_at(1);
	ASSERT_NE(NULL, self->ctx);
	n = ape_device_list(self->ctx, devs, 8);
	ASSERT_LT(0, n);
	self->ref = self->ocl = NULL;
	for (int i = 0; i < n; i++) {
		ape_device_info info;

		ASSERT_EQ(0, ape_device_get_info(devs[i], &info));
		if (!strcmp(info.backend, "ref") && !self->ref)
			self->ref = devs[i];
		if (!strcmp(info.backend, "opencl") && !self->ocl)
			self->ocl = devs[i];
	}
	ASSERT_NE(NULL, self->ref);
	if (!self->ocl)
		test_backend_absent(self->ctx, "opencl", self->why, sizeof(self->why));
}

FIXTURE_TEARDOWN(vb)
{
	ape_context_destroy(self->ctx);
}

/* What one case expects of each backend: the path ape_stats names, and on OpenCL a kernel that
 * must have run and one that must not have. */
struct expect {
	const char *ref_path, *ocl_path;
	const char *ocl_kernel, *ocl_not;
	const char *heads; /* what the line says of the heads with lambda != 0 */
};

/* A forward call of tp on dev under capture (with statistics or without: counting pairs for
 * them may take another path, which the line must then name): checks the line against the
 * statistics and the expectation. */
static void forward_case(struct __test_metadata *_metadata, ape_device *dev, bool is_ocl,
			 test_problem *tp, const struct expect *ex, bool with_stats, const char *what)
{
	struct capture cap;
	ape_stats st;
	char line[4096], named[128], kernels[1024];
	const char *text, *want = is_ocl ? ex->ocl_path : ex->ref_path;
	int ret;

	ape_stats_init(&st);
	if (is_ocl)
		ape__ocl_debug_kernels(dev, kernels, sizeof(kernels)); /* forget earlier ones */
	capture_begin(&cap);
	ret = test_problem_run_stats(tp, dev, with_stats ? &st : NULL);
	text = capture_end(&cap);
	ASSERT_EQ(0, ret) TH_LOG("%s: %s", what, ape_last_error());
	EXPECT_EQ(1, count_lines(text, "libape: ")) TH_LOG("%s: %s", what, text);
	line_of(text, "libape: ape_attention_forward: ", line, sizeof(line));
	ASSERT_NE('\0', line[0]) TH_LOG("%s: no line in: %s", what, text);
	line_paths(line, named, sizeof(named));
	if (with_stats) {
		EXPECT_STREQ(want, st.path) TH_LOG("%s: %s", what, line);
	} else {
		EXPECT_NE(NULL, strstr(line, "pairs ? of")) TH_LOG("%s", line);
	}
	EXPECT_STREQ(want, named) TH_LOG("%s: %s", what, line);
	EXPECT_EQ(NULL, strstr(line, "error")) TH_LOG("%s", line);
	if (ex->heads) {
		char says[96];

		snprintf(says, sizeof(says), "| lambda != 0 on heads %s |", ex->heads);
		EXPECT_NE(NULL, strstr(line, says)) TH_LOG("%s: %s", says, line);
	}
	if (is_ocl) {
		ASSERT_EQ(0, ape__ocl_debug_kernels(dev, kernels, sizeof(kernels)));
		EXPECT_NE(NULL, strstr(kernels, ex->ocl_kernel))
		TH_LOG("%s: path %s, kernels run: %s", what, st.path, kernels);
		if (ex->ocl_not) {
			EXPECT_EQ(NULL, strstr(kernels, ex->ocl_not))
			TH_LOG("%s: path %s, kernels run: %s", what, st.path, kernels);
		}
	}
}

/* ------------------------------------------------------------------ the tests */

/* Each forward path, named as taken. */
TEST_F(vb, each_forward_path_is_named_as_taken)
{
	static const float lam_split[4] = { 0, 0, 0.25f, 0.25f };
	ape_rng rng;

	ape_rng_init(&rng, "each_forward_path_is_named_as_taken");
	for (int c = 0; c < 5; c++) {
		test_problem tp;
		struct expect ex = { "reference", NULL, NULL, NULL, NULL };
		const char *what = NULL;
		const int64_t Lq = c == 3 ? 1 : 67;

		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 4, 2, Lq, 67, 64, APE_F32));
		test_problem_set_params(&tp, 0.05, 0.01, 0.01, c == 1 ? 0.0 : 0.25);
		tp.desc.causal = true;
		switch (c) {
		case 0:
			what = "lambda != 0";
			ex.heads = "0-3";
			ex.ocl_path = "general";
			ex.ocl_kernel = "ape_attention";
			ex.ocl_not = "ape_sep";
			break;
		case 1:
			what = "lambda = 0";
			ex.heads = "none";
			ex.ocl_path = "separable";
			ex.ocl_kernel = "ape_sep";
			ex.ocl_not = "ape_attention";
			break;
		case 2:
		case 4: /* the same, with statistics: their pair counts keep the split away */
			what = c == 2 ? "lambda = 0 on one kv group" : "the same, counting pairs";
			ex.heads = "2-3";
			for (int h = 0; h < 4; h++)
				tp.params[3 * 4 + h] = lam_split[h];
			tp.desc.lambda.per_head = tp.params + 3 * 4;
			ex.ocl_path = c == 2 ? "general+separable+split" : "general";
			ex.ocl_kernel = c == 2 ? "ape_sep" : "ape_attention";
			ex.ocl_not = c == 2 ? NULL : "ape_sep";
			break;
		case 3:
			what = "one query row, no skipping";
			tp.desc.skip_tol = 0;
			ex.ocl_path = "decode";
			ex.ocl_kernel = "decode";
			ex.ocl_not = "ape_attention";
			break;
		}
		forward_case(_metadata, self->ref, false, &tp, &ex, c != 2, what);
		if (self->ocl)
			forward_case(_metadata, self->ocl, true, &tp, &ex, c != 2, what);
		test_problem_free(&tp);
	}
	if (!self->ocl)
		SKIP(return, "OpenCL paths not checked: %s", self->why);
}

/* One call's line under capture: exactly one line, starting with want_prefix, naming path. */
static void one_line(struct __test_metadata *_metadata, const char *text, const char *want_prefix,
		     const char *path, const char *what)
{
	char line[4096], named[128];

	EXPECT_EQ(1, count_lines(text, "libape: ")) TH_LOG("%s: %s", what, text);
	line_of(text, want_prefix, line, sizeof(line));
	ASSERT_NE('\0', line[0]) TH_LOG("%s: no line '%s' in: %s", what, want_prefix, text);
	if (path) {
		line_paths(line, named, sizeof(named));
		EXPECT_STREQ(path, named) TH_LOG("%s: %s", what, line);
	}
}

/* The backward pass, a KV cache's append and attend, and a device-resident enqueue. */
TEST_F(vb, backward_cache_and_enqueue_are_named_as_taken)
{
	const test_problem_shape sh = { 1, 4, 2, 37, 41, 64 };
	ape_device *devs[2] = { self->ref, self->ocl };
	ape_rng rng;

	ape_rng_init(&rng, "backward_cache_and_enqueue_are_named_as_taken");
	for (int d = 0; d < 2 && devs[d]; d++) {
		ape_device *dev = devs[d];
		const bool is_ocl = d == 1;
		struct capture cap;
		char kernels[1024];
		const char *text;
		ape_stats st;
		bcase c;
		grads g;
		int ret;

		/* the backward */
		ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F32, false, true, dev));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		if (is_ocl)
			ape__ocl_debug_kernels(dev, kernels, sizeof(kernels));
		ape_stats_init(&st);
		capture_begin(&cap);
		ret = run_backward(&c, dev, &g, W_ALL, &st);
		text = capture_end(&cap);
		ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
		one_line(_metadata, text, "libape: ape_attention_backward: ",
			 is_ocl ? "backward" : "reference", "backward");
		EXPECT_STREQ(is_ocl ? "backward" : "reference", st.path);
		if (is_ocl) {
			/* a short dense problem (B 1, at most 64 rows and 64 keys) runs whole in
			 * ape_bwd_short (opencl/ocl_backward.c, bwd_dense_short()), others the
			 * fused sweep; the line says which */
			const bool shrt = c.tp.q.t.shape[0] == 1 && c.tp.q.t.shape[2] <= 64 &&
					  c.tp.k.t.shape[2] <= 64;

			ape__ocl_debug_kernels(dev, kernels, sizeof(kernels));
			EXPECT_NE(NULL, strstr(kernels, shrt ? "ape_bwd_short" : "ape_bwd_fused"))
			TH_LOG("%s", kernels);
			EXPECT_NE(NULL, strstr(text, shrt ? "(ape_bwd_short)" : "the fused sweep"))
			TH_LOG("%s", text);
		}

		/* a device-resident forward (its line: enqueued, asynchronous) */
		capture_begin(&cap);
		ret = run_resident(&c.tp, dev, 0);
		text = capture_end(&cap);
		ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
		one_line(_metadata, text, "libape: ape_attention_enqueue: ", NULL, "enqueue");
		EXPECT_NE(NULL, strstr(text, "enqueued in ")) TH_LOG("%s", text);
		EXPECT_NE(NULL, strstr(text, is_ocl ? "path: general x" : "path: reference x"))
		TH_LOG("%s", text);
		grads_free(&g);
		bcase_free(&c);

		/* a KV cache: an append, then a decode step without skipping */
		{
			ape_kv_cache_options ko;
			ape_kv_cache *kc = NULL;
			test_tensor k, v, q, o;
			ape_attn_desc desc;

			ape_kv_cache_options_init(&ko);
			ko.B = 1;
			ko.Hkv = 2;
			ko.H = 4;
			ko.D = 64;
			ko.dtype = APE_F32;
			ko.capacity_tokens = 512;
			ko.block_tokens = 64;
			ASSERT_EQ(0, ape_kv_cache_create(dev, &ko, &kc)) TH_LOG("%s", ape_last_error());
			ASSERT_EQ(0, test_tensor_random(&k, &rng, APE_F32, 1, 2, 300, 64, 1.0));
			ASSERT_EQ(0, test_tensor_random(&v, &rng, APE_F32, 1, 2, 300, 64, 1.0));
			ASSERT_EQ(0, test_tensor_random(&q, &rng, APE_F32, 1, 4, 1, 64, 1.0));
			ASSERT_EQ(0, test_tensor_random(&o, &rng, APE_F32, 1, 4, 1, 64, 1.0));
			capture_begin(&cap);
			ret = ape_kv_cache_append(kc, &k.t, &v.t);
			text = capture_end(&cap);
			ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
			one_line(_metadata, text, "libape: ape_kv_cache_append: ", NULL, "append");
			EXPECT_NE(NULL, strstr(text, "+300 tokens, 300 held of 512")) TH_LOG("%s", text);

			ape_attn_desc_init(&desc);
			desc.lambda.value = 0.25f;
			desc.skip_tol = 0;
			if (is_ocl)
				ape__ocl_debug_kernels(dev, kernels, sizeof(kernels));
			ape_stats_init(&st);
			capture_begin(&cap);
			ret = ape_kv_cache_attend(kc, &desc, &q.t, &o.t, NULL, &st);
			text = capture_end(&cap);
			ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
			one_line(_metadata, text, "libape: ape_kv_cache_attend: ", st.path, "attend");
			EXPECT_STREQ(is_ocl ? "decode-in-place" : "reference", st.path)
			TH_LOG("%s", text);
			if (is_ocl) {
				ape__ocl_debug_kernels(dev, kernels, sizeof(kernels));
				EXPECT_NE(NULL, strstr(kernels, "decode")) TH_LOG("%s", kernels);
			}
			ape_kv_cache_destroy(kc);
			test_tensor_free(&k);
			test_tensor_free(&v);
			test_tensor_free(&q);
			test_tensor_free(&o);
		}
	}
	if (!self->ocl)
		SKIP(return, "OpenCL paths not checked: %s", self->why);
}

/* Level 2 adds the plan; level 0 and the default (APE_VERBOSE unset) print nothing. */
TEST(levels)
{
	ape_rng rng;

	ape_rng_init(&rng, "levels");
	unsetenv("APE_VERBOSE");
	for (int level = -1; level <= 2; level++) {
		ape_context *ctx = context_at(level);
		ape_device *ref = NULL;
		struct capture cap;
		test_problem tp;
		const char *text;
		int ret;

		ASSERT_NE(NULL, ctx);
		{
			ape_device *devs[8];
			const int n = ape_device_list(ctx, devs, 8);

			for (int i = 0; i < n; i++) {
				ape_device_info info;

				ape_device_get_info(devs[i], &info);
				if (!strcmp(info.backend, "ref"))
					ref = devs[i];
			}
		}
		ASSERT_NE(NULL, ref);
		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 2, 9, 11, 8, APE_F32));
		capture_begin(&cap);
		ret = test_problem_run(&tp, ref);
		text = capture_end(&cap);
		ASSERT_EQ(0, ret);
		EXPECT_EQ(level > 0 ? 1 : 0, count_lines(text, "libape: ape_attention_forward: ") -
						    count_lines(text, "libape: ape_attention_forward: plan"))
		TH_LOG("level %d: %s", level, text);
		EXPECT_EQ(level > 1 ? 1 : 0, count_lines(text, "libape: ape_attention_forward: plan: "))
		TH_LOG("level %d: %s", level, text);
		EXPECT_EQ(level > 0 ? level : 0, count_lines(text, "libape: ")) TH_LOG("%s", text);
		test_problem_free(&tp);
		ape_context_destroy(ctx);
	}
}

/* Level 2 on two devices says how the outer chunks were shared: their sum is the chunks. */
TEST(level_2_says_each_devices_share)
{
	ape_context *ctx = context_at(2);
	ape_device *devs[8], *two[2] = { NULL, NULL };
	ape_exec_options eo;
	struct capture cap;
	test_problem tp;
	const char *text, *p;
	long long a = -1, b = -1;
	ape_rng rng;
	int n, ret;

	ASSERT_NE(NULL, ctx);
	n = ape_device_list(ctx, devs, 8);
	for (int i = 0; i < n; i++) {
		ape_device_info info;

		ape_device_get_info(devs[i], &info);
		if (!strcmp(info.backend, "ref"))
			two[0] = two[1] = devs[i]; /* one device listed twice: two workers */
	}
	ASSERT_NE(NULL, two[0]);
	ape_rng_init(&rng, "level_2_says_each_devices_share");
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 2, 64, 64, 8, APE_F32));
	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = 16;
	capture_begin(&cap);
	ret = ape_attention_forward_ex(two, 2, &eo, &tp.desc, &tp.q.t, &tp.k.t, &tp.v.t, &tp.o.t,
				       NULL, NULL);
	text = capture_end(&cap);
	ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
	p = strstr(text, "outer chunks per device: ");
	ASSERT_NE(NULL, p) TH_LOG("%s", text);
	ASSERT_EQ(2, sscanf(p, "outer chunks per device: %lld + %lld", &a, &b)) TH_LOG("%s", p);
	EXPECT_EQ(4, a + b) TH_LOG("64 query rows in chunks of 16: %s", text);
	/* pairs not counted (no statistics asked for): none claimed left out */
	EXPECT_NE(NULL, strstr(text, "the pairs left out inside the launches not counted"))
	TH_LOG("%s", text);
	{
		ape_stats st;
		char want[128];

		ape_stats_init(&st);
		capture_begin(&cap);
		ret = ape_attention_forward_ex(two, 2, &eo, &tp.desc, &tp.q.t, &tp.k.t, &tp.v.t,
					       &tp.o.t, NULL, &st);
		text = capture_end(&cap);
		ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
		snprintf(want, sizeof(want), " %llu pairs left out inside the launches",
			 (unsigned long long)(st.pairs_visible - st.pairs_computed));
		EXPECT_NE(NULL, strstr(text, want)) TH_LOG("%s not in %s", want, text);
	}
	test_problem_free(&tp);
	ape_context_destroy(ctx);
}

/* A failing call logs its error once, with ape_last_error()'s message; a bad level is refused
 * naming opts->verbose. */
TEST(errors_are_logged_once)
{
	ape_context_options o;
	ape_context *ctx = NULL, *bad = NULL;
	ape_device *devs[8];
	struct capture cap;
	test_problem tp;
	const char *text;
	char want[1200];
	ape_rng rng;
	int ret, n;

	ape_rng_init(&rng, "errors_are_logged_once");
	ape_context_options_init(&o);
	EXPECT_EQ(-1, o.verbose);
	for (int bad_level = -3; bad_level <= 3; bad_level += 6) {
		o.verbose = bad_level;
		EXPECT_EQ(APE_EINVAL, ape_context_create(&bad, &o));
		EXPECT_NE(NULL, strstr(ape_last_error(), "opts->verbose")) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(NULL, bad);
	}
	ctx = context_at(1);
	ASSERT_NE(NULL, ctx);
	n = ape_device_list(ctx, devs, 8);
	ASSERT_LT(0, n);
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 2, 9, 11, 8, APE_F32));
	/* the device fails validation: an odd rope base is fine, a negative lambda is not */
	tp.desc.lambda.value = -1;
	for (int h = 0; h < 2; h++)
		tp.params[3 * 2 + h] = -1;
	capture_begin(&cap);
	ret = test_problem_run(&tp, devs[n - 1]);
	text = capture_end(&cap);
	EXPECT_EQ(APE_EINVAL, ret);
	snprintf(want, sizeof(want), "libape: ape_attention_forward: error: %s\n", ape_last_error());
	EXPECT_EQ(1, count_lines(text, "libape: ")) TH_LOG("%s", text);
	EXPECT_STREQ(want, text);
	/* a NULL device: before any device is known, logged at the level a context asked for */
	capture_begin(&cap);
	ret = ape_attention_forward(NULL, &tp.desc, &tp.q.t, &tp.k.t, &tp.v.t, &tp.o.t, NULL, NULL);
	text = capture_end(&cap);
	EXPECT_EQ(APE_EINVAL, ret);
	snprintf(want, sizeof(want), "libape: ape_attention_forward: error: %s\n", ape_last_error());
	EXPECT_STREQ(want, text);
	/* calls that succeed: no error line */
	tp.desc.lambda.value = 0.5f;
	for (int h = 0; h < 2; h++)
		tp.params[3 * 2 + h] = 0.5f;
	capture_begin(&cap);
	ret = test_problem_run(&tp, devs[n - 1]);
	n = ape_device_list(ctx, devs, 8);
	text = capture_end(&cap);
	EXPECT_EQ(0, ret);
	EXPECT_EQ(NULL, strstr(text, "error")) TH_LOG("%s", text);
	test_problem_free(&tp);
	ape_context_destroy(ctx);
}

/* APE_VERBOSE and APE_VERBOSE_FORMAT=json, read once per process: in a child. Each line one
 * JSON object with the same figures as the statistics. */
TEST(json_lines_parse)
{
	pid_t pid;
	int status;
	char path[64];
	int fd;

	snprintf(path, sizeof(path), "/tmp/ape-verbose-json-XXXXXX");
	fd = mkstemp(path);
	ASSERT_LE(0, fd);
	pid = fork();
	ASSERT_LE(0, pid);
	if (pid == 0) {
		ape_context *ctx = NULL;
		ape_device *devs[8];
		test_problem tp;
		ape_rng rng;
		int n;

		ape_rng_init(&rng, "json_lines_parse"); /* (it logs its seed to stderr) */
		dup2(fd, 2);
		setenv("APE_VERBOSE", "2", 1);
		setenv("APE_VERBOSE_FORMAT", "json", 1);
		if (ape_context_create(&ctx, NULL))
			_exit(10);
		n = ape_device_list(ctx, devs, 8);
		if (test_problem_make_dims(&tp, &rng, 1, 4, 2, 33, 33, 64, APE_F32))
			_exit(11);
		test_problem_set_params(&tp, 0.1, 0.01, 0.01, 0.0);
		for (int i = 0; i < n; i++)
			if (test_problem_run(&tp, devs[i]))
				_exit(12);
		/* a failure, in JSON too */
		ape_attention_forward(NULL, &tp.desc, &tp.q.t, &tp.k.t, &tp.v.t, &tp.o.t, NULL, NULL);
		test_problem_free(&tp);
		ape_context_destroy(ctx);
		_exit(0);
	}
	ASSERT_EQ(pid, waitpid(pid, &status, 0));
	ASSERT_TRUE(WIFEXITED(status));
	ASSERT_EQ(0, WEXITSTATUS(status));
	{
		static char text[65536];
		const ssize_t got = pread(fd, text, sizeof(text) - 1, 0);
		int lines = 0, errors = 0;

		ASSERT_LT(0, got);
		text[got] = '\0';
		for (char *l = text, *e; *l; l = e + 1) {
			e = strchr(l, '\n');
			ASSERT_NE(NULL, e) TH_LOG("unterminated line: %s", l);
			*e = '\0';
			ASSERT_EQ(0, strncmp(l, "libape: {", 9)) TH_LOG("%s", l);
			EXPECT_TRUE(json_ok(l + 8)) TH_LOG("not JSON: %s", l + 8);
			if (strstr(l, "\"error\":")) {
				errors++;
				EXPECT_NE(NULL, strstr(l, "\"call\":\"ape_attention_forward\""));
				continue;
			}
			lines++;
			EXPECT_NE(NULL, strstr(l, "\"path\":\"")) TH_LOG("%s", l);
			EXPECT_NE(NULL, strstr(l, "\"chunk_q\":")) TH_LOG("level 2: %s", l);
		}
		EXPECT_LE(1, lines);
		EXPECT_EQ(1, errors);
	}
	close(fd);
	unlink(path);
}

/* The CUDA backend's paths, on the emulated driver (the real kernels run on the CPU): named in
 * the line and in the statistics alike. */
TEST(cuda_paths_are_named)
{
	char why[TEST_WHY_LEN];
	ape_context_options o;
	ape_context *ctx = NULL;
	ape_selection sel;
	ape_rng rng;

	if (test_backend_prepare("cuda", NULL, why, sizeof(why)))
		SKIP(return, "%s", why);
	ape_context_options_init(&o);
	o.backends = "cuda";
	o.verbose = 1;
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	if (ape_device_select(ctx, "cuda", 0, &sel)) {
		snprintf(why, sizeof(why), "no CUDA device: %s", ape_last_error());
		ape_context_destroy(ctx);
		SKIP(return, "%s", why);
	}
	ape_rng_init(&rng, "cuda_paths_are_named");
	for (int c = 0; c < 3; c++) {
		static const char *const want[3] = { "general", "separable", "decode" };
		struct capture cap;
		test_problem tp;
		const char *text;
		ape_stats st;
		int ret;

		/* (CUDA's separable path takes 16-bit storage) */
		ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 1, c == 2 ? 1 : 40, 40, 64,
						    APE_F16));
		test_problem_set_params(&tp, 0.05, 0.01, 0.01, c == 1 ? 0.0 : 0.25);
		tp.desc.skip_tol = 0;
		ape_stats_init(&st);
		capture_begin(&cap);
		ret = test_problem_run_stats(&tp, sel.device, &st);
		text = capture_end(&cap);
		ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
		one_line(_metadata, text, "libape: ape_attention_forward: ", want[c], want[c]);
		EXPECT_STREQ(want[c], st.path);
		test_problem_free(&tp);
	}
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
