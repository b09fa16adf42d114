/* SPDX-License-Identifier: MIT */
/*
 * ape-run --backward as users run it: a subprocess in a fresh directory. Its gradients must
 * match a direct ape_attention_backward() call with the same parameters (on the reference, and
 * on OpenCL and CUDA where they are), only what is asked is written, all or nothing, and every
 * bad argument or input file must give the documented exit status, a message naming the
 * culprit, and no output file. (The forward: test_ape_run.c.)
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

/* ------------------------------------------------------------------ --backward */

/* dO (Q's shape) and dLSE ([B, H, Lq]) as random files DO.npy and DLSE.npy. */
struct bwd_files {
	test_tensor dout, dlse;
};

static void write_bwd_inputs(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			     struct bwd_files *f, ape_dtype dt, bool three_d)
{
	const int64_t *s = self->q.t.shape;
	const int64_t ls[4] = { 1, s[0], s[1], s[2] };
	char path[160], err[512];

	write_input(_metadata, self, "DO.npy", &f->dout, dt, s, three_d);
	test_tensor_free(&f->dlse);
	ASSERT_EQ(0, test_tensor_random(&f->dlse, &self->rng, APE_F32, 1, s[0], s[1], s[2], 1.0));
	snprintf(path, sizeof(path), "%s/DLSE.npy", self->work);
	ASSERT_EQ(0, npy_save(path, APE_F32, three_d ? 2 : 3, ls + 1 + three_d, f->dlse.t.data,
			      err, sizeof(err))) TH_LOG("%s", err);
	self->ninputs = test_count_entries(self->work, NULL, 0);
}

/* The gradients of the library's own forward + backward calls, float32. */
struct grads {
	test_tensor dq, dk, dv;
	float *dparams;
};

static void grads_free(struct grads *g)
{
	test_tensor_free(&g->dq);
	test_tensor_free(&g->dk);
	test_tensor_free(&g->dv);
	free(g->dparams);
}

static void direct_backward_on(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			       const char *backend, const ape_attn_desc *desc, ape_dtype storage,
			       struct bwd_files *f, bool with_dlse, struct grads *g)
{
	const int64_t *s = self->q.t.shape, *ks = self->k.t.shape;
	ape_context *ctx = test_context(backend);
	ape_device *dev = test_device(ctx, backend);
	test_tensor q, k, v, dout, o;
	float *lse = malloc(sizeof(float) * (size_t)(s[0] * s[1] * s[2]) + 1);

	ASSERT_NE(NULL, dev);
	ASSERT_NE(NULL, lse);
	convert_copy(_metadata, &q, &self->q, storage);
	convert_copy(_metadata, &k, &self->k, storage);
	convert_copy(_metadata, &v, &self->v, storage);
	convert_copy(_metadata, &dout, &f->dout, storage);
	ASSERT_EQ(0, test_tensor_empty(&o, APE_F32, s[0], s[1], s[2], s[3]));
	ASSERT_EQ(0, test_tensor_empty(&g->dq, APE_F32, s[0], s[1], s[2], s[3]));
	ASSERT_EQ(0, test_tensor_empty(&g->dk, APE_F32, ks[0], ks[1], ks[2], ks[3]));
	ASSERT_EQ(0, test_tensor_empty(&g->dv, APE_F32, ks[0], ks[1], ks[2], ks[3]));
	g->dparams = malloc(sizeof(float) * 4 * (size_t)s[1]);
	ASSERT_NE(NULL, g->dparams);
	ASSERT_EQ(0, ape_attention_forward(dev, desc, &q.t, &k.t, &v.t, &o.t, lse, NULL))
		TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_attention_backward(dev, desc, &q.t, &k.t, &v.t, &o.t, lse, &dout.t,
					    with_dlse ? f->dlse.t.data : NULL, &g->dq.t,
					    &g->dk.t, &g->dv.t, g->dparams, NULL))
		TH_LOG("%s", ape_last_error());
	test_tensor_free(&q);
	test_tensor_free(&k);
	test_tensor_free(&v);
	test_tensor_free(&dout);
	test_tensor_free(&o);
	free(lse);
	ape_context_destroy(ctx);
}

static void direct_backward(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			    const ape_attn_desc *desc, ape_dtype storage, struct bwd_files *f,
			    bool with_dlse, struct grads *g)
{
	direct_backward_on(_metadata, self, "ref", desc, storage, f, with_dlse, g);
}

/* A float32 gradient as the tool writes it: rounded once to float16 for an '<f2' file. */
static void round_like_file(test_tensor *t, ape_dtype file_dt)
{
	size_t n = (size_t)(t->t.shape[0] * t->t.shape[1] * t->t.shape[2] * t->t.shape[3]);

	for (size_t i = 0; file_dt == APE_F16 && i < n; i++) {
		uint16_t h;

		ape_convert(&h, APE_F16, (float *)t->t.data + i, APE_F32, 1);
		ape_convert((float *)t->t.data + i, APE_F32, &h, APE_F16, 1);
	}
}

/* Every gradient file named (NULL: must not exist) against the library's. */
static void expect_grads(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			 struct grads *g, ape_dtype file_dt, bool three_d, const char *dq,
			 const char *dk, const char *dv, const char *dp)
{
	const char *names[3] = { dq, dk, dv };
	test_tensor *want[3] = { &g->dq, &g->dk, &g->dv };
	const int64_t dps[2] = { self->q.t.shape[1], 4 };

	for (int i = 0; i < 3; i++) {
		char path[160];

		if (!names[i])
			continue;
		snprintf(path, sizeof(path), "%s/%s", self->work, names[i]);
		round_like_file(want[i], file_dt);
		/* the same reference computation: equal but for float32 rounding */
		expect_npy(_metadata, self, names[i], file_dt, three_d ? 3 : 4,
			   want[i]->t.shape + three_d, want[i]->t.data,
			   1e-6 * fmax(1, test_tensor_maxabs(&want[i]->t)));
	}
	if (dp)
		expect_npy(_metadata, self, dp, APE_F32, 2, dps, g->dparams, 0);
}

TEST_F(run, backward_matches_the_library)
{
	struct bwd_files f = { 0 };
	struct grads g = { 0 };
	ape_attn_desc desc;
	float lam[4] = { 0.1f, 0.0f, 0.3f, 0.05f };

	/* GQA, more keys than queries, per-head lambda, interleaved pairs, dLSE */
	write_inputs(_metadata, self, APE_F32, 2, 4, 2, 5, 9, 8, false);
	write_bwd_inputs(_metadata, self, &f, APE_F32, false);
	ASSERT_EQ(0, RUN(BASIC, "--lambda", "0.1,0,0.3,0.05", "--layout", "interleaved",
			 "--backward", "DO.npy", "--dlse", "DLSE.npy", "--dq", "DQ.npy", "--dk",
			 "DK.npy", "--dv", "DV.npy", "--dparams", "DP.npy"))
		TH_LOG("stderr: %s", self->err);
	seed_desc(&desc);
	desc.lambda.per_head = lam;
	desc.layout = APE_ROPE_INTERLEAVED;
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F32, false);
	direct_backward(_metadata, self, &desc, APE_F32, &f, true, &g);
	expect_grads(_metadata, self, &g, APE_F32, false, "DQ.npy", "DK.npy", "DV.npy", "DP.npy");
	grads_free(&g);

	/* without --dlse: dL/dLSE = 0; no -o file asked for beyond the required one */
	ASSERT_EQ(0, RUN(BASIC, "--lambda", "0.1,0,0.3,0.05", "--layout", "interleaved",
			 "--backward", "DO.npy", "--dparams", "DP.npy", "--dv", "DV2.npy"))
		TH_LOG("stderr: %s", self->err);
	direct_backward(_metadata, self, &desc, APE_F32, &f, false, &g);
	expect_grads(_metadata, self, &g, APE_F32, false, NULL, NULL, "DV2.npy", "DP.npy");

	/* --chunk and --max-device-mem reach the backward: chunks of 3 rows, summed in another
	 * order than one launch's, equal within float32 rounding */
	ASSERT_EQ(0, RUN(BASIC, "--lambda", "0.1,0,0.3,0.05", "--layout", "interleaved",
			 "--backward", "DO.npy", "--dq", "DQ3.npy", "--chunk", "3",
			 "--max-device-mem", "1M", "--stats"))
		TH_LOG("stderr: %s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "ape-run: backward: chunks computed "))
		TH_LOG("stderr: %s", self->err);
	EXPECT_NE(NULL, strstr(strstr(self->err, "backward: chunks") ?: "", "(3 x 3 rows"))
		TH_LOG("stderr: %s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "backward: peak device memory "));
	expect_npy(_metadata, self, "DQ3.npy", APE_F32, 4, g.dq.t.shape, g.dq.t.data,
		   1e-5 * test_tensor_maxabs(&g.dq.t));

	/* --devices reach the backward: the key chunks (3 of 3 rows) split over both entries, each
	 * pipelined as the forward is */
	ASSERT_EQ(0, RUN(BASIC, "--lambda", "0.1,0,0.3,0.05", "--layout", "interleaved",
			 "--backward", "DO.npy", "--dq", "DQ4.npy", "--chunk", "3", "--devices",
			 "ref:0,ref", "--stats"))
		TH_LOG("stderr: %s", self->err);
	EXPECT_NE(NULL, strstr(strstr(self->err, "backward: chunks") ?: "", "(3 x 3 rows, 3 in "
								       "flight, 2 devices)"))
		TH_LOG("stderr: %s", self->err);
	expect_npy(_metadata, self, "DQ4.npy", APE_F32, 4, g.dq.t.shape, g.dq.t.data,
		   1e-5 * test_tensor_maxabs(&g.dq.t));
	grads_free(&g);
	test_tensor_free(&f.dout);
	test_tensor_free(&f.dlse);
}

TEST_F(run, backward_f16_three_d_only_what_is_asked)
{
	struct bwd_files f = { 0 };
	struct grads g = { 0 };
	ape_attn_desc desc;

	write_inputs(_metadata, self, APE_F16, 1, 2, 1, 6, 6, 16, true);
	write_bwd_inputs(_metadata, self, &f, APE_F16, true);
	ASSERT_EQ(0, RUN(BASIC, "--no-causal", "--backward", "DO.npy", "--dk", "DK.npy",
			 "--dparams", "DP.npy", "--stats"))
		TH_LOG("stderr: %s", self->err);
	/* only the files asked for: Q, K, V, DO, DLSE, O, LSE, DK, DP */
	EXPECT_EQ(self->ninputs + 4, test_count_entries(self->work, NULL, 0));
	EXPECT_NE(NULL, strstr(self->err, "ape-run: pairs visible 72,"));
	EXPECT_NE(NULL, strstr(self->err, "ape-run: backward: pairs visible 72,"))
		TH_LOG("stderr: %s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "ape-run: backward: time total_ms"));
	seed_desc(&desc);
	desc.causal = false;
	direct_backward(_metadata, self, &desc, APE_F16, &f, false, &g);
	expect_grads(_metadata, self, &g, APE_F16, true, NULL, "DK.npy", NULL, "DP.npy");
	grads_free(&g);

	/* --dtype bf16 on '<f2' files: computed in bf16, written as '<f2' */
	ASSERT_EQ(0, RUN(BASIC, "--no-causal", "--dtype", "bf16", "--backward", "DO.npy", "--dq",
			 "DQ.npy"))
		TH_LOG("stderr: %s", self->err);
	direct_backward(_metadata, self, &desc, APE_BF16, &f, false, &g);
	expect_grads(_metadata, self, &g, APE_F16, true, "DQ.npy", NULL, NULL, NULL);
	grads_free(&g);
	test_tensor_free(&f.dout);
	test_tensor_free(&f.dlse);
}

TEST_F(run, backward_bad_arguments_and_files)
{
	const int64_t do_bad[4] = { 1, 2, 5, 8 }, dlse_bad[3] = { 1, 2, 5 };
	struct bwd_files f = { 0 };
	char path[160], err[256];
	test_tensor t = { 0 };

#define BWD BASIC, "--backward", "DO.npy"
	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	write_bwd_inputs(_metadata, self, &f, APE_F32, false);
	expect_refused(_metadata, self, RUN(BASIC, "--dq", "DQ.npy"), 2,
		       WORDS("--dq DQ.npy", "needs --backward"));
	expect_refused(_metadata, self, RUN(BASIC, "--dlse", "DLSE.npy"), 2,
		       WORDS("--dlse DLSE.npy", "needs --backward"));
	expect_refused(_metadata, self, RUN(BASIC, "--dparams", "DP.npy"), 2,
		       WORDS("--dparams DP.npy", "needs --backward"));
	expect_refused(_metadata, self, RUN(BWD), 2,
		       WORDS("--backward DO.npy", "--dq, --dk, --dv, --dparams"));
	expect_refused(_metadata, self, RUN(BWD, "--dlse", "DLSE.npy"), 2,
		       WORDS("--backward DO.npy", "name the gradients"));
	expect_refused(_metadata, self, RUN(BWD, "--dq", "DQ.npy", "--kv-cache", "1"), 2,
		       WORDS("--backward DO.npy", "--kv-cache"));
	expect_refused(_metadata, self, RUN(BWD, "--dq", "O.npy"), 2,
		       WORDS("-o and --dq both name O.npy"));
	expect_refused(_metadata, self, RUN(BWD, "--dq", "D.npy", "--dk", "D.npy"), 2,
		       WORDS("--dq and --dk both name D.npy"));
	expect_refused(_metadata, self, RUN(BWD, "--dv", "LSE.npy"), 2,
		       WORDS("--lse and --dv both name LSE.npy"));
	expect_refused(_metadata, self, RUN(BWD, "--dparams", "nosuch/DP.npy"), 2,
		       WORDS("--dparams nosuch/DP.npy", "directory nosuch/ does not exist"));
	expect_refused(_metadata, self, RUN(BWD, "--dk", "."), 2, WORDS("--dk .", "directory"));
	expect_refused(_metadata, self, RUN(BASIC, "--backward", "missing.npy", "--dq", "DQ.npy"),
		       2, WORDS("missing.npy", "No such file"));
	expect_refused(_metadata, self, RUN(BASIC, "--backward", "DO.npy", "--dq", "DQ.npy",
					    "--dlse", "missing.npy"),
		       2, WORDS("missing.npy", "No such file"));

	/* dO not of Q's shape */
	write_input(_metadata, self, "DO.npy", &t, APE_F32, do_bad, false);
	expect_refused(_metadata, self, RUN(BWD, "--dq", "DQ.npy"), 2,
		       WORDS("--backward DO.npy", "(1, 2, 5, 8)", "Q.npy", "(1, 2, 4, 8)"));
	write_input(_metadata, self, "DO.npy", &t, APE_F32, do_bad, true);
	expect_refused(_metadata, self, RUN(BWD, "--dq", "DQ.npy"), 2,
		       WORDS("--backward DO.npy", "(2, 5, 8)", "(1, 2, 4, 8)"));
	write_bwd_inputs(_metadata, self, &f, APE_F32, false);

	/* dLSE not of LSE's shape, or not float32 */
	snprintf(path, sizeof(path), "%s/DLSE.npy", self->work);
	ASSERT_EQ(0, npy_save(path, APE_F32, 3, dlse_bad, f.dout.t.data, err, sizeof(err)));
	expect_refused(_metadata, self, RUN(BWD, "--dq", "DQ.npy", "--dlse", "DLSE.npy"), 2,
		       WORDS("--dlse DLSE.npy", "(1, 2, 5)", "LSE's (1, 2, 4)"));
	ASSERT_EQ(0, npy_save(path, APE_F16, 3, dlse_bad, f.dout.t.data, err, sizeof(err)));
	expect_refused(_metadata, self, RUN(BWD, "--dq", "DQ.npy", "--dlse", "DLSE.npy"), 2,
		       WORDS("--dlse DLSE.npy", "'<f2'", "'<f4'"));
	patch_file(_metadata, self, "DO.npy", "'<f4'", "'<i4'");
	expect_refused(_metadata, self, RUN(BWD, "--dq", "DQ.npy"), 2, WORDS("DO.npy", "'<i4'"));
	/* bad parameters are still refused before any work */
	write_bwd_inputs(_metadata, self, &f, APE_F32, false);
	expect_refused(_metadata, self, RUN(BWD, "--dq", "DQ.npy", "--lambda", "-1"), 2,
		       WORDS("lambda"));
	test_tensor_free(&t);
	test_tensor_free(&f.dout);
	test_tensor_free(&f.dlse);
#undef BWD
}

/* The OpenCL backward through the tool gives the library's own gradients on that device. */
TEST_F(run, backward_on_opencl_matches_the_library)
{
	struct bwd_files f = { 0 };
	struct grads g = { 0 };
	ape_context *ctx = test_context("opencl");
	ape_attn_desc desc;
	bool have = test_device(ctx, "opencl") != NULL;

	ape_context_destroy(ctx);
	if (!have)
		SKIP(return, "no OpenCL device here");
	write_inputs(_metadata, self, APE_F16, 1, 4, 1, 37, 70, 64, false);
	write_bwd_inputs(_metadata, self, &f, APE_F16, false);
	ASSERT_EQ(0, RUN(FILES, "--backend", "opencl", "--backward", "DO.npy", "--dlse",
			 "DLSE.npy", "--dq", "DQ.npy", "--dk", "DK.npy", "--dv", "DV.npy",
			 "--dparams", "DP.npy"))
		TH_LOG("stderr: %s", self->err);
	seed_desc(&desc);
	direct_backward_on(_metadata, self, "opencl", &desc, APE_F16, &f, true, &g);
	expect_grads(_metadata, self, &g, APE_F16, false, "DQ.npy", "DK.npy", "DV.npy", "DP.npy");
	grads_free(&g);
	test_tensor_free(&f.dout);
	test_tensor_free(&f.dlse);
}

/* The CUDA backward (on the emulated device) through the tool gives the library's own
 * gradients on that device. Small: the emulator is slow. */
TEST_F(run, backward_on_cuda_matches_the_library)
{
	const char *emu = APE_BUILD_DIR "/tests/cuda_emu/libcuda.so.1";
	struct bwd_files f = { 0 };
	struct grads g = { 0 };
	ape_attn_desc desc;

	if (access(emu, F_OK))
		SKIP(return, "this build has no CUDA backend, so no emulated device");
	write_inputs(_metadata, self, APE_F16, 1, 2, 1, 9, 12, 16, false);
	write_bwd_inputs(_metadata, self, &f, APE_F16, false);
	ASSERT_EQ(0, setenv("APE_CUDA_LIBRARY", emu, 1));
	EXPECT_EQ(0, RUN(FILES, "--backend", "cuda", "--backward", "DO.npy", "--dlse", "DLSE.npy",
			 "--dq", "DQ.npy", "--dk", "DK.npy", "--dv", "DV.npy", "--dparams",
			 "DP.npy"))
		TH_LOG("stderr: %s", self->err);
	seed_desc(&desc);
	direct_backward_on(_metadata, self, "cuda", &desc, APE_F16, &f, true, &g);
	unsetenv("APE_CUDA_LIBRARY");
	expect_grads(_metadata, self, &g, APE_F16, false, "DQ.npy", "DK.npy", "DV.npy", "DP.npy");
	grads_free(&g);
	test_tensor_free(&f.dout);
	test_tensor_free(&f.dlse);
}

/* All or nothing: the last output failing leaves none of the others behind, old files intact. */
TEST_F(run, backward_outputs_all_or_nothing)
{
	static const char old[] = "an earlier result";
	struct bwd_files f = { 0 };
	char path[160], buf[64];
	FILE *fp;

	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 4, 4, 8, false);
	write_bwd_inputs(_metadata, self, &f, APE_F32, false);
	snprintf(path, sizeof(path), "%s/DK.npy", self->work);
	fp = fopen(path, "w");
	ASSERT_NE(NULL, fp);
	fputs(old, fp);
	ASSERT_EQ(0, fclose(fp));
	self->ninputs++;
	/* every temporary file is complete before DP's cannot be created */
	expect_refused(_metadata, self, RUN(BASIC, "--backward", "DO.npy", "--dq", "DQ.npy", "--dk",
					    "DK.npy", "--dv", "DV.npy", "--dparams",
					    "/proc/DP.npy", "--trace", "T.json"),
		       1, WORDS("/proc/DP.npy", "temporary file"));
	fp = fopen(path, "r");
	ASSERT_NE(NULL, fp);
	ASSERT_NE(NULL, fgets(buf, sizeof(buf), fp));
	fclose(fp);
	EXPECT_STREQ(old, buf);
	test_tensor_free(&f.dout);
	test_tensor_free(&f.dlse);
}

TEST_HARNESS_MAIN
