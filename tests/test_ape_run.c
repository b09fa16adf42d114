/* SPDX-License-Identifier: MIT */
/*
 * ape-run as users run it: a subprocess in a fresh directory. Its results must match a direct
 * ape_attention_forward() call with the same parameters, and every bad argument or input file
 * must give the documented exit status, a message naming the culprit, and no output file.
 * must give the documented exit status, a message naming the culprit, and no output file. The
 * same for --backward: test_ape_run_backward.c.
 */
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/npy.h"
#include "ape_run_fixture.h"

/* ------------------------------------------------------------------ helpers */

static void shorten_file(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			 const char *name, off_t by)
{
	char path[160];
	struct stat st;

	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, stat(path, &st));
	ASSERT_EQ(0, truncate(path, st.st_size - by));
}

/* A backend this machine does not have, or NULL when it has them all. */
static const char *unavailable_backend(void)
{
	static const char *const names[] = { "cuda", "opencl" };
	const char *found = NULL;
	ape_context *ctx = NULL;
	ape_backend_info info;
	int n;

	if (ape_context_create(&ctx, NULL))
		return NULL;
	n = ape_backend_get_info(ctx, 0, NULL);
	for (int i = 0; i < n && !found; i++)
		if (!ape_backend_get_info(ctx, i, &info) && !info.available)
			for (int j = 0; j < 2; j++)
				if (!strcmp(info.name, names[j]))
					found = names[j];
	ape_context_destroy(ctx);
	return found;
}

/* ------------------------------------------------------------------ results */

TEST_F(run, matches_the_library_with_seed_defaults)
{
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F32, 2, 4, 2, 5, 9, 16, false);
	ASSERT_EQ(0, RUN(BASIC)) TH_LOG("%s", self->err);
	EXPECT_STREQ("", self->err);
	EXPECT_EQ(self->ninputs + 2, test_count_entries(self->work, NULL, 0));
	seed_desc(&desc);
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F32, false);
}

TEST_F(run, three_d_inputs)
{
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 7, 7, 8, true);
	ASSERT_EQ(0, RUN(BASIC)) TH_LOG("%s", self->err);
	seed_desc(&desc);
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F32, true);
}

TEST_F(run, per_head_lists_and_every_flag)
{
	static const float delta[3] = { 0.1f, 0.2f, 0.3f }, beta[3] = { 0, 0.01f, -0.02f };
	static const float lambda[3] = { 0.5f, 0, 0.25f };
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F32, 1, 3, 3, 6, 8, 8, false);
	ASSERT_EQ(0, RUN(BASIC, "--delta", "0.1,0.2,0.3", "--beta=0,0.01,-0.02", "--gamma", "0.05",
			 "--lambda", "0.5,0,0.25", "--rope-base", "500", "--rope-scale", "2.5",
			 "--scale", "0.3",
			 "--no-causal", "--layout", "interleaved", "--q-start", "100", "--k-start",
			 "90", "--skip-tol", "0", "--device", "0"))
		TH_LOG("%s", self->err);
	ape_attn_desc_init(&desc);
	desc.delta.per_head = delta;
	desc.beta.per_head = beta;
	desc.gamma.value = 0.05f;
	desc.lambda.per_head = lambda;
	desc.rope_base = 500;
	desc.rope_scale = 2.5;
	desc.scale = 0.3;
	desc.scale_set = true;
	desc.causal = false;
	desc.layout = APE_ROPE_INTERLEAVED;
	desc.q_start = 100;
	desc.q_start_set = true;
	desc.k_start = 90;
	desc.skip_tol = 0;
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F32, false);
}

TEST_F(run, f16_in_f16_out)
{
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F16, 1, 2, 2, 4, 6, 8, false);
	ASSERT_EQ(0, RUN(BASIC)) TH_LOG("%s", self->err);
	seed_desc(&desc);
	expect_outputs(_metadata, self, &desc, APE_F16, APE_F16, false);

	/* computed in f32 from the same f16 files: O is still '<f2' */
	ASSERT_EQ(0, RUN(BASIC, "--dtype", "f32")) TH_LOG("%s", self->err);
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F16, false);
}

TEST_F(run, dtype_converts_f32_input)
{
	static const char *const names[2] = { "bf16", "f16" };
	static const ape_dtype types[2] = { APE_BF16, APE_F16 };
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 5, 5, 8, false);
	seed_desc(&desc);
	for (int i = 0; i < 2; i++) {
		ASSERT_EQ(0, RUN(BASIC, "--dtype", names[i])) TH_LOG("%s", self->err);
		expect_outputs(_metadata, self, &desc, types[i], APE_F32, false);
	}
}

TEST_F(run, stats_and_help)
{
	char want[64];
	ape_attn_desc desc;
	uint64_t pairs;

	write_inputs(_metadata, self, APE_F32, 1, 2, 2, 4, 6, 8, false);
	ASSERT_EQ(0, RUN(BASIC, "--stats")) TH_LOG("%s", self->err);
	seed_desc(&desc);
	ASSERT_EQ(0, ape_visible_pairs(&desc, 1, 2, 4, 6, &pairs));
	snprintf(want, sizeof(want), "pairs visible %llu,", (unsigned long long)pairs);
	EXPECT_NE(NULL, strstr(self->err, "backend ref")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, want)) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "computed")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "total_ms")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "kernel_ms")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "pairs/s")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "chosen by request")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "kernel path reference")) TH_LOG("%s", self->err);

	EXPECT_EQ(0, RUN("--help"));
	EXPECT_NE(NULL, strstr(self->out, "usage: ape-run"));
	EXPECT_NE(NULL, strstr(self->out, "0.3968502629920499"));
	EXPECT_NE(NULL, strstr(self->out, "ape_attn_desc_init"));
	EXPECT_STREQ("", self->err);
}

TEST_F(run, auto_never_falls_back_silently)
{
	ape_context *ctx = NULL;
	ape_selection sel;

	write_inputs(_metadata, self, APE_F32, 1, 1, 1, 3, 3, 4, false);
	unsetenv("APE_BACKEND");
	ASSERT_EQ(0, ape_context_create(&ctx, NULL));
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel));
	ape_context_destroy(ctx);
	ASSERT_EQ(0, RUN(FILES)) TH_LOG("%s", self->err);
	self->ninputs = test_count_entries(self->work, NULL, 0);
	if (sel.passed_over) {
		EXPECT_NE(NULL, strstr(self->err, "passed over")) TH_LOG("%s", self->err);
	}
	/* APE_BACKEND chooses for auto */
	setenv("APE_BACKEND", "ref", 1);
	ASSERT_EQ(0, RUN(FILES, "--stats")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "by APE_BACKEND")) TH_LOG("%s", self->err);
	setenv("APE_BACKEND", "nosuch", 1);
	expect_refused(_metadata, self, RUN(FILES), 2, WORDS("nosuch"));
	unsetenv("APE_BACKEND");
}

/* ------------------------------------------------------------------ refusals */

TEST_F(run, bad_files)
{
	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	patch_file(_metadata, self, "K.npy", "\x93NUMPY", "\x93NUMPZ");
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("K.npy", "magic"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	patch_file(_metadata, self, "Q.npy", "False", "True ");
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("Q.npy", "Fortran"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	patch_file(_metadata, self, "V.npy", "'<f4'", "'<i4'");
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("V.npy", "'<i4'", "'<f4'"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	patch_file(_metadata, self, "V.npy", "'<f4'", "'<f8'");
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("V.npy", "'<f8'"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	shorten_file(_metadata, self, "K.npy", 10);
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("K.npy", "truncated", "needs 128"));

	/* the last -v wins */
	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	expect_refused(_metadata, self, RUN(BASIC, "-v", "missing.npy"), 2,
		       WORDS("missing.npy", "No such file"));
	expect_refused(_metadata, self, RUN(BASIC, "-k", "."), 2, WORDS("not a regular file"));
}

TEST_F(run, files_that_do_not_fit_together)
{
	const int64_t kv16[4] = { 1, 1, 4, 16 }, kv_b2[4] = { 2, 1, 4, 8 };
	const int64_t v_l5[4] = { 1, 1, 5, 8 }, kv8[4] = { 1, 1, 4, 8 }, q2d[4] = { 1, 1, 4, 8 };

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	write_input(_metadata, self, "K.npy", &self->k, APE_F32, kv16, false);
	write_input(_metadata, self, "V.npy", &self->v, APE_F32, kv16, false);
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("K.npy", "D = 16", "Q.npy", "D = 8"));

	write_input(_metadata, self, "K.npy", &self->k, APE_F32, kv_b2, false);
	write_input(_metadata, self, "V.npy", &self->v, APE_F32, kv_b2, false);
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("K.npy", "batch size B = 2"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	write_input(_metadata, self, "V.npy", &self->v, APE_F32, v_l5, false);
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("V.npy", "Lk = 5", "K.npy"));

	write_inputs(_metadata, self, APE_F32, 1, 3, 2, 4, 4, 8, false);
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("H = 3", "Hkv = 2", "multiple"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 7, false);
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("Q.npy", "D = 7", "odd"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	write_input(_metadata, self, "K.npy", &self->k, APE_F16, kv8, false);
	expect_refused(_metadata, self, RUN(BASIC), 2,
		       WORDS("K.npy", "'<f2' (float16)", "'<f4' (float32)"));

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	{
		char path[160], err[256];

		snprintf(path, sizeof(path), "%s/Q.npy", self->work);
		ASSERT_EQ(0, npy_save(path, APE_F32, 2, q2d + 2, self->q.t.data, err,
				      sizeof(err)));
	}
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("Q.npy", "(4, 8)", "4-D"));
}

TEST_F(run, bad_arguments)
{
	write_inputs(_metadata, self, APE_F32, 1, 4, 2, 4, 4, 8, false);
	expect_refused(_metadata, self, RUN(BASIC, "--frobnicate"), 2, WORDS("--frobnicate"));
	expect_refused(_metadata, self, RUN(BASIC, "extra"), 2, WORDS("'extra'"));
	expect_refused(_metadata, self, RUN(BASIC, "--delta", "abc"), 2,
		       WORDS("--delta", "'abc'", "not a number"));
	expect_refused(_metadata, self, RUN(BASIC, "--delta", "nan"), 2,
		       WORDS("--delta", "'nan'", "finite"));
	expect_refused(_metadata, self, RUN(BASIC, "--gamma", "1e39"), 2,
		       WORDS("--gamma", "float"));
	expect_refused(_metadata, self, RUN(BASIC, "--beta", "0.1,,0.2,0.3"), 2,
		       WORDS("--beta", "empty"));
	expect_refused(_metadata, self, RUN(BASIC, "--lambda", "0.1,0.2"), 2,
		       WORDS("--lambda", "2 values", "H = 4"));
	expect_refused(_metadata, self, RUN(BASIC, "--lambda", "-0.5"), 2, WORDS("lambda", "-0.5"));
	expect_refused(_metadata, self, RUN(BASIC, "--rope-base", "0"), 2, WORDS("rope_base"));
	expect_refused(_metadata, self, RUN(BASIC, "--rope-scale", "0"), 2, WORDS("rope_scale", "= 0"));
	expect_refused(_metadata, self, RUN(BASIC, "--rope-scale", "x"), 2, WORDS("--rope-scale"));
	expect_refused(_metadata, self, RUN(BASIC, "--scale", "inf"), 2, WORDS("--scale"));
	expect_refused(_metadata, self, RUN(BASIC, "--q-start", "1.5"), 2,
		       WORDS("--q-start", "integer"));
	expect_refused(_metadata, self, RUN(BASIC, "--k-start", "99999999999999999999"), 2,
		       WORDS("--k-start", "64 bits"));
	expect_refused(_metadata, self, RUN(BASIC, "--layout", "diagonal"), 2,
		       WORDS("--layout", "\"diagonal\"", "half or interleaved"));
	expect_refused(_metadata, self, RUN(BASIC, "--dtype", "f64"), 2,
		       WORDS("--dtype", "\"f64\"", "f32, f16 or bf16"));
	expect_refused(_metadata, self, RUN(BASIC, "--device", "-1"), 2, WORDS("--device"));
	expect_refused(_metadata, self, RUN(BASIC, "--device"), 2, WORDS("--device", "value"));
	expect_refused(_metadata, self, RUN(BASIC, "--stats=yes"), 2, WORDS("--stats"));
	expect_refused(_metadata, self, RUN("-q", "Q.npy", "-k", "K.npy", "-v", "V.npy"), 2,
		       WORDS("missing -o"));
	expect_refused(_metadata, self, RUN(BASIC, "--lse", "O.npy"), 2, WORDS("O.npy"));
	expect_refused(_metadata, self, RUN(BASIC, "--backend", "nosuch"), 2, WORDS("nosuch"));
}

TEST_F(run, unavailable_backend_or_device)
{
	const char *missing = unavailable_backend();

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	expect_refused(_metadata, self, RUN(BASIC, "--device", "99"), 3, WORDS("index = 99"));
	if (!missing)
		SKIP(return, "every backend is available here");
	expect_refused(_metadata, self, RUN(FILES, "--backend", missing), 3,
		       WORDS(missing, "not available"));
}

/* --device takes a PCI address or "backend:N" too; the reference has no address here. */
TEST_F(run, device_by_spec)
{
	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	ASSERT_EQ(0, RUN(FILES, "--device", "ref:0")) TH_LOG("stderr: %s", self->err);
	ASSERT_EQ(0, RUN(FILES, "--backend", "ref", "--device", "0")) TH_LOG("%s", self->err);
	for (int i = 0; i < 2; i++) { /* the refusals below must leave only the inputs */
		char path[160];

		snprintf(path, sizeof(path), "%s/%s", self->work, i ? "LSE.npy" : "O.npy");
		ASSERT_EQ(0, unlink(path));
	}
	expect_refused(_metadata, self, RUN(FILES, "--device", "0000:fe:1f.7"), 3,
		       WORDS("no device at PCI address 0000:fe:1f.7"));
	expect_refused(_metadata, self, RUN(BASIC, "--device", "0000:fe:1f.7"), 3,
		       WORDS("0000:fe:1f.7"));
	expect_refused(_metadata, self, RUN(FILES, "--device", "0000:zz:00.0"), 2,
		       WORDS("0000:zz:00.0", "PCI address"));
	expect_refused(_metadata, self, RUN(FILES, "--device", "ref:7"), 3, WORDS("index = 7"));
}

/* ------------------------------------------------------------------ streaming */

/* O and LSE as files against the direct one-shot call, within `tol` (chunks are merged by
 * their LSE: equal to rounding, not bit for bit). */
static void expect_outputs_near(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
				const ape_attn_desc *desc, double tol)
{
	const int64_t *s = self->q.t.shape;
	float *lse = malloc((size_t)(s[0] * s[1] * s[2]) * sizeof(float) + 1);
	test_tensor o;

	ASSERT_NE(NULL, lse);
	direct(_metadata, self, desc, APE_F32, &o, lse);
	expect_npy(_metadata, self, "O.npy", APE_F32, 4, s, o.t.data,
		   tol * fmax(1, test_tensor_maxabs(&self->v.t)));
	expect_npy(_metadata, self, "LSE.npy", APE_F32, 3, s, lse, tol);
	test_tensor_free(&o);
	free(lse);
}

TEST_F(run, chunks_budget_trace_and_stats)
{
	char cmd[512];
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 50, 50, 8, false);
	seed_desc(&desc);
	ASSERT_EQ(0, RUN(BASIC, "--chunk", "7", "--max-device-mem", "64K", "--trace", "T.json",
			 "--stats"))
		TH_LOG("%s", self->err);
	expect_outputs_near(_metadata, self, &desc, 1e-5);
	EXPECT_NE(NULL, strstr(self->err, "(7 x 7 rows")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "chunks computed ")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "bytes copied to device ")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "peak device memory ")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "(a budget of 65536 bytes)")) TH_LOG("%s", self->err);
	if (!access("/usr/bin/python3", X_OK)) {
		snprintf(cmd, sizeof(cmd),
			 "/usr/bin/python3 -c 'import json,sys; d = json.load(open(sys.argv[1])); "
			 "assert any(e[\"ph\"] == \"X\" for e in d[\"traceEvents\"])' %s/T.json",
			 self->work);
		EXPECT_EQ(0, system(cmd)) TH_LOG("T.json is not a trace");
	}
	/* several devices: the reference twice */
	ASSERT_EQ(0, RUN(FILES, "--devices", "ref:0,ref", "--chunk", "16", "--stats"))
		TH_LOG("%s", self->err);
	expect_outputs_near(_metadata, self, &desc, 1e-5);
	EXPECT_NE(NULL, strstr(self->err, "2 devices)")) TH_LOG("%s", self->err);
}

TEST_F(run, kv_cache_decoding_matches)
{
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F32, 1, 4, 2, 40, 40, 8, false);
	seed_desc(&desc);
	ASSERT_EQ(0, RUN(BASIC, "--kv-cache", "1", "--kv-block", "5", "--stats"))
		TH_LOG("%s", self->err);
	expect_outputs_near(_metadata, self, &desc, 1e-5);
	EXPECT_NE(NULL, strstr(self->err, "chunks computed 40,")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "kernel path reference")) TH_LOG("%s", self->err);
	ASSERT_EQ(0, RUN(BASIC, "--kv-cache", "16", "--chunk", "9")) TH_LOG("%s", self->err);
	expect_outputs_near(_metadata, self, &desc, 1e-5);
	/* a strong decay: the oldest blocks go, and 40 tokens pass through a cache of 24 */
	desc.delta.value = 4.0f;
	ASSERT_EQ(0, RUN(BASIC, "--kv-cache", "1", "--kv-block", "4", "--kv-capacity", "24",
			 "--kv-release", "--delta", "4"))
		TH_LOG("%s", self->err);
	expect_outputs_near(_metadata, self, &desc, 1e-5);
	/* no decay, no release: the cache fills up */
	self->ninputs = test_count_entries(self->work, NULL, 0);
	expect_refused(_metadata, self,
		       RUN(BASIC, "--kv-cache", "1", "--kv-block", "4", "--kv-capacity", "24",
			   "--kv-release", "--delta", "0", "--beta", "0", "--gamma", "0"),
		       1, WORDS("do not fit"));
}

TEST_F(run, streaming_bad_values)
{
	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 8, 8, 8, false);
	expect_refused(_metadata, self, RUN(BASIC, "--chunk", "0"), 2, WORDS("--chunk"));
	expect_refused(_metadata, self, RUN(BASIC, "--chunk", "x"), 2, WORDS("--chunk", "'x'"));
	expect_refused(_metadata, self, RUN(BASIC, "--max-device-mem", "0"), 2,
		       WORDS("--max-device-mem", "> 0"));
	expect_refused(_metadata, self, RUN(BASIC, "--max-device-mem", "12Q"), 2,
		       WORDS("--max-device-mem", "'12Q'"));
	expect_refused(_metadata, self, RUN(BASIC, "--max-device-mem", "-5"), 2,
		       WORDS("--max-device-mem"));
	expect_refused(_metadata, self, RUN(BASIC, "--max-device-mem", "99999999999999T"), 2,
		       WORDS("--max-device-mem", "out of range"));
	expect_refused(_metadata, self, RUN(BASIC, "--trace", "nodir/T.json"), 2,
		       WORDS("--trace", "does not exist"));
	expect_refused(_metadata, self, RUN(BASIC, "--trace", "O.npy"), 2, WORDS("--trace"));
	expect_refused(_metadata, self, RUN(BASIC, "--kv-cache", "0"), 2, WORDS("--kv-cache"));
	expect_refused(_metadata, self, RUN(BASIC, "--kv-cache", "2", "--no-causal"), 2,
		       WORDS("--kv-cache", "causal"));
	expect_refused(_metadata, self, RUN(BASIC, "--kv-block", "8"), 2,
		       WORDS("--kv-block", "needs --kv-cache"));
	expect_refused(_metadata, self, RUN(BASIC, "--devices", "ref,,ref"), 2,
		       WORDS("--devices", "empty"));
	expect_refused(_metadata, self, RUN(BASIC, "--devices", "ref", "--device", "0"), 2,
		       WORDS("--devices"));
	/* a budget too small for one row each way: the library says what it needs */
	expect_refused(_metadata, self, RUN(BASIC, "--max-device-mem", "100"), 1,
		       WORDS("budget 100 bytes cannot hold one chunk", "needs"));
}

TEST_F(run, failures_do_not_clobber_outputs)
{
	static const char old[] = "an earlier result";
	char path[160], buf[64];
	FILE *f;

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	snprintf(path, sizeof(path), "%s/O.npy", self->work);
	f = fopen(path, "w");
	ASSERT_NE(NULL, f);
	fputs(old, f);
	ASSERT_EQ(0, fclose(f));
	self->ninputs++;

	expect_refused(_metadata, self, RUN(BASIC, "--lambda", "-1"), 2, WORDS("lambda"));
	expect_refused(_metadata, self, RUN(BASIC, "--lse", "nosuch/LSE.npy"), 2,
		       WORDS("--lse nosuch/LSE.npy", "directory nosuch/ does not exist"));
	/* O's temporary file is complete before LSE's cannot be created */
	expect_refused(_metadata, self, RUN(BASIC, "--lse", "/proc/LSE.npy"), 1,
		       WORDS("/proc/LSE.npy", "temporary file"));
	expect_refused(_metadata, self, RUN(BASIC, "--lse", "O.npy/LSE.npy"), 2,
		       WORDS("--lse O.npy/LSE.npy", "Not a directory"));
	snprintf(path, sizeof(path), "%s/LSE.npy", self->work);
	ASSERT_EQ(0, mkdir(path, 0755));
	self->ninputs++;
	expect_refused(_metadata, self, RUN(BASIC), 2, WORDS("LSE.npy", "directory"));

	snprintf(path, sizeof(path), "%s/O.npy", self->work);
	f = fopen(path, "r");
	ASSERT_NE(NULL, f);
	ASSERT_NE(NULL, fgets(buf, sizeof(buf), f));
	fclose(f);
	EXPECT_STREQ(old, buf);
}

TEST_HARNESS_MAIN
