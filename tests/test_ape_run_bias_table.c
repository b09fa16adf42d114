/* SPDX-License-Identifier: MIT */
/*
 * ape-run --bias-table (a distance-bias table, docs/ape.md "Distance-bias tables") and, with
 * --backward, --dbias-table (its gradient), as users run them: a subprocess in a fresh
 * directory. The outputs must match direct library calls with the same table (per head and
 * shared, shorter and longer than the distances, with --rope-scale, through the KV cache);
 * every bad table file must exit 2 with a message naming --bias-table and the file, leaving no
 * output; a device that does not compute tables exits 3.
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

/* A table of rows x M values saved as work/name ('<f4' unless dt says otherwise). */
static void write_table(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			const char *name, ape_dtype dt, int ndim, const int64_t *shape,
			const float *vals)
{
	char path[160], err[512];
	uint64_t n = 1;
	void *data = (void *)vals;
	uint16_t *half = NULL;

	for (int i = 0; i < ndim; i++)
		n *= (uint64_t)shape[i];
	if (dt == APE_F16) {
		half = malloc(n * 2 + 2);
		ASSERT_NE(NULL, half);
		ape_convert(half, APE_F16, vals, APE_F32, n);
		data = half;
	}
	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, npy_save(path, dt, ndim, shape, data, err, sizeof(err))) TH_LOG("%s", err);
	free(half);
	self->ninputs = test_count_entries(self->work, NULL, 0);
}

/* Random [rows, M] values in [-1.5, 1.5). */
static float *random_table(FIXTURE_DATA(run) *self, int64_t rows, int64_t M)
{
	float *t = malloc((size_t)(rows * M) * sizeof(float));

	for (int64_t i = 0; t && i < rows * M; i++)
		t[i] = (float)(3 * ape_rng_uniform(&self->rng) - 1.5);
	return t;
}

static void with_table(ape_attn_desc *desc, const float *t, int64_t rows, int64_t M)
{
	desc->bias_table = t;
	desc->bias_table_heads = rows;
	desc->bias_table_len = M;
}

/* O and LSE of the run in work against the library's, within tol (relative to max|V|). */
static void expect_near(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
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

/* ------------------------------------------------------------------ results */

TEST_F(run, bias_table_matches_the_library)
{
	const int64_t per_head[2] = { 4, 9 }, shared[2] = { 1, 64 };
	float *t = random_table(self, 4, 9), gauss[64];
	ape_attn_desc desc;

	ASSERT_NE(NULL, t);
	for (int m = 0; m < 64; m++)
		gauss[m] = -0.01f * (float)(m * m);
	write_inputs(_metadata, self, APE_F32, 2, 4, 2, 13, 29, 16, false);
	/* a random table per head, shorter than the distances */
	write_table(_metadata, self, "T.npy", APE_F32, 2, per_head, t);
	ASSERT_EQ(0, RUN(BASIC, "--bias-table", "T.npy")) TH_LOG("%s", self->err);
	seed_desc(&desc);
	with_table(&desc, t, 4, 9);
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F32, false);
	/* a Gaussian -lambda n^2 shared by every head, longer than the distances, with position
	 * interpolation and a decay of the caller's */
	write_table(_metadata, self, "G.npy", APE_F32, 2, shared, gauss);
	ASSERT_EQ(0, RUN(BASIC, "--bias-table", "G.npy", "--rope-scale", "2.5", "--delta", "0.1"))
		TH_LOG("%s", self->err);
	seed_desc(&desc);
	desc.delta.value = 0.1f;
	desc.rope_scale = 2.5;
	with_table(&desc, gauss, 1, 64);
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F32, false);
	/* the same through the KV cache, token by token */
	ASSERT_EQ(0, RUN(BASIC, "--bias-table", "G.npy", "--rope-scale", "2.5", "--delta", "0.1",
			 "--kv-cache", "1", "--kv-block", "4"))
		TH_LOG("%s", self->err);
	expect_near(_metadata, self, &desc, 1e-5);
	free(t);
}

TEST_F(run, dbias_table_matches_the_library)
{
	const int64_t shape[2] = { 1, 7 }, ds[4] = { 1, 2, 11, 8 };
	float *t = random_table(self, 1, 7), *want = malloc(7 * sizeof(float)), *lse;
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	test_tensor o, dout = { 0 };
	ape_attn_desc desc;

	ASSERT_NE(NULL, t);
	ASSERT_NE(NULL, want);
	ASSERT_NE(NULL, dev);
	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 11, 11, 8, false);
	write_input(_metadata, self, "DO.npy", &dout, APE_F32, ds, false);
	write_table(_metadata, self, "T.npy", APE_F32, 2, shape, t);
	ASSERT_EQ(0, RUN(BASIC, "--bias-table", "T.npy", "--backward", "DO.npy", "--dbias-table",
			 "DT.npy"))
		TH_LOG("%s", self->err);
	/* the library's: forward, then the backward asked for the table's gradient alone */
	seed_desc(&desc);
	with_table(&desc, t, 1, 7);
	lse = malloc(2 * 11 * sizeof(float));
	ASSERT_NE(NULL, lse);
	ASSERT_EQ(0, test_tensor_empty(&o, APE_F32, 1, 2, 11, 8));
	ASSERT_EQ(0, ape_attention_forward(dev, &desc, &self->q.t, &self->k.t, &self->v.t, &o.t,
					   lse, NULL))
		TH_LOG("%s", ape_last_error());
	desc.dbias_table = want;
	ASSERT_EQ(0, ape_attention_backward(dev, &desc, &self->q.t, &self->k.t, &self->v.t, &o.t,
					    lse, &dout.t, NULL, NULL, NULL, NULL, NULL, NULL))
		TH_LOG("%s", ape_last_error());
	expect_npy(_metadata, self, "DT.npy", APE_F32, 2, shape, want, 0);
	/* O and LSE as without --backward */
	desc.dbias_table = NULL;
	expect_outputs(_metadata, self, &desc, APE_F32, APE_F32, false);
	test_tensor_free(&o);
	test_tensor_free(&dout);
	free(lse);
	free(want);
	free(t);
	ape_context_destroy(ctx);
}

/* ------------------------------------------------------------------ refusals */

TEST_F(run, bad_tables_are_refused_naming_the_option)
{
	const int64_t s3[2] = { 3, 5 }, s1[1] = { 5 }, s0[2] = { 4, 0 }, s4[2] = { 4, 5 };
	const int64_t qs[4] = { 1, 4, 6, 8 }, s40[2] = { 4, 40 };
	static const float zeros[160];
	float vals[20] = { 0 };
	test_tensor dout = { 0 };

	write_inputs(_metadata, self, APE_F32, 1, 4, 2, 6, 6, 8, false);
	write_table(_metadata, self, "T3.npy", APE_F32, 2, s3, vals);
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "T3.npy"), 2,
		       WORDS("--bias-table T3.npy", "shape (3, 5)", "[H, M] = [4, M]"));
	write_table(_metadata, self, "T1.npy", APE_F32, 1, s1, vals);
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "T1.npy"), 2,
		       WORDS("--bias-table T1.npy", "shape (5,)"));
	write_table(_metadata, self, "T0.npy", APE_F32, 2, s0, vals);
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "T0.npy"), 2,
		       WORDS("--bias-table T0.npy", "M = 0"));
	write_table(_metadata, self, "TH.npy", APE_F16, 2, s4, vals);
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "TH.npy"), 2,
		       WORDS("--bias-table TH.npy", "'<f2'", "'<f4'"));
	vals[7] = NAN;
	write_table(_metadata, self, "TN.npy", APE_F32, 2, s4, vals);
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "TN.npy"), 2,
		       WORDS("--bias-table TN.npy", "entry [1][2] = nan", "finite"));
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "none.npy"), 2,
		       WORDS("--bias-table none.npy"));
	write_table(_metadata, self, "TI.npy", APE_F32, 2, s40, zeros);
	patch_file(_metadata, self, "TI.npy", "'<f4'", "'<i4'");
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "TI.npy"), 2,
		       WORDS("--bias-table TI.npy", "'<i4'"));
	/* the gradient: needs --backward and the table */
	vals[7] = 0;
	write_table(_metadata, self, "T.npy", APE_F32, 2, s4, vals);
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "T.npy", "--dbias-table",
					    "DT.npy"),
		       2, WORDS("--dbias-table DT.npy needs --backward"));
	write_input(_metadata, self, "DO.npy", &dout, APE_F32, qs, false);
	expect_refused(_metadata, self, RUN(BASIC, "--backward", "DO.npy", "--dbias-table",
					    "DT.npy"),
		       2, WORDS("--dbias-table DT.npy needs --bias-table"));
	expect_refused(_metadata, self, RUN(BASIC, "--bias-table", "T.npy", "--backward", "DO.npy",
					    "--dbias-table", "O.npy"),
		       2, WORDS("-o and --dbias-table both name O.npy"));
	test_tensor_free(&dout);
}

/* Every other device: the library's figures, or exit 3 saying it computes no tables. */
TEST_F(run, other_devices_compute_tables_or_exit_3)
{
	static const char *const backends[] = { "opencl", "cuda" };
	const int64_t shape[2] = { 2, 12 };
	float *t = random_table(self, 2, 12);
	ape_attn_desc desc;

	ASSERT_NE(NULL, t);
	write_inputs(_metadata, self, APE_F32, 1, 2, 1, 20, 20, 16, false);
	write_table(_metadata, self, "T.npy", APE_F32, 2, shape, t);
	seed_desc(&desc);
	with_table(&desc, t, 2, 12);
	for (int i = 0; i < 2; i++) {
		ape_context *ctx = test_context(backends[i]);
		bool have = test_device(ctx, backends[i]) != NULL;
		int st;

		ape_context_destroy(ctx);
		if (!have)
			continue;
		st = RUN(FILES, "--bias-table", "T.npy", "--backend", backends[i]);
		if (st == 3) {
			EXPECT_NE(NULL, strstr(self->err, "distance-bias tables")) TH_LOG("%s", self->err);
			EXPECT_EQ(self->ninputs, test_count_entries(self->work, NULL, 0));
			continue;
		}
		ASSERT_EQ(0, st) TH_LOG("%s: %s", backends[i], self->err);
		expect_near(_metadata, self, &desc, 1e-4);
	}
	free(t);
}

TEST_HARNESS_MAIN
