/* SPDX-License-Identifier: MIT */
/*
 * The ape-run tests' fixture and helpers (test_ape_run.c, test_ape_run_backward.c): a fresh
 * directory per test, ape-run run there as a subprocess, its input files written, the direct
 * library call it must match, and the checks of its outputs and refusals. Include after the
 * Kselftest harness.
 */
#ifndef APE_TEST_APE_RUN_FIXTURE_H
#define APE_TEST_APE_RUN_FIXTURE_H

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

/* What ape-run uses when not told: the seed's delta = 2^(-4/3), beta = gamma = delta / 10. */
#define SEED_DELTA 0.3968502629920499
#define SEED_LAMBDA 0.1

FIXTURE(run)
{
	char base[64]; /* ours: the tool's captured stdout and stderr */
	char work[96]; /* the tool's working directory: inputs and outputs only */
	char tool[PATH_MAX];
	char out[16384];
	char err[16384];
	int ninputs; /* files in work before the tool runs */
	ape_rng rng;
	test_tensor q, k, v;
};

FIXTURE_SETUP(run)
{
	char exe[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);

	/* this test is BUILD/tests/test_ape_run; the tool is BUILD/bin/ape-run */
	ASSERT_GT(n, 0);
	exe[n] = '\0';
	*strrchr(exe, '/') = '\0';
	ASSERT_LT(strlen(exe) + 16, sizeof(self->tool));
	snprintf(self->tool, sizeof(self->tool), "%.*s/../bin/ape-run", PATH_MAX - 16, exe);
	ASSERT_EQ(0, access(self->tool, X_OK)) TH_LOG("%s is not built", self->tool);
	snprintf(self->base, sizeof(self->base), "/tmp/ape-test-run.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(self->base));
	snprintf(self->work, sizeof(self->work), "%s/work", self->base);
	ASSERT_EQ(0, mkdir(self->work, 0755));
	ape_rng_init(&self->rng, _metadata->name);
}

FIXTURE_TEARDOWN(run)
{
	test_tensor_free(&self->q);
	test_tensor_free(&self->k);
	test_tensor_free(&self->v);
	test_rmtree(self->base);
}

/* ------------------------------------------------------------------ helpers */

/* Runs ape-run with args (NULL-terminated) in self->work; returns its exit status. */
static int run_tool(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
		    const char *const *args)
{
	int status = test_run_tool("ape-run", args, self->work, self->out, sizeof(self->out),
				   self->err, sizeof(self->err));

	ASSERT_LE(0, status) TH_LOG("could not start %s", self->tool);
	return status;
}

#define RUN(...) run_tool(_metadata, self, (const char *const[]){ __VA_ARGS__, NULL })
#define WORDS(...) ((const char *const[]){ __VA_ARGS__, NULL })
#define FILES "-q", "Q.npy", "-k", "K.npy", "-v", "V.npy", "-o", "O.npy", "--lse", "LSE.npy"
#define BASIC FILES, "--backend", "ref"

static void write_input(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			const char *name, test_tensor *t, ape_dtype dt, const int64_t s[4],
			bool three_d)
{
	char path[160], err[512];

	test_tensor_free(t);
	ASSERT_EQ(0, test_tensor_random(t, &self->rng, dt, s[0], s[1], s[2], s[3], 1.0));
	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, npy_save(path, dt, three_d ? 3 : 4, s + three_d, t->t.data, err,
			      sizeof(err))) TH_LOG("%s", err);
	self->ninputs = test_count_entries(self->work, NULL, 0);
}

/* Q [B, H, Lq, D], K and V [B, Hkv, Lk, D], random, saved as Q.npy, K.npy and V.npy. */
static void write_inputs(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			 ape_dtype dt, int64_t B, int64_t H, int64_t Hkv, int64_t Lq, int64_t Lk,
			 int64_t D, bool three_d)
{
	const int64_t qs[4] = { B, H, Lq, D }, ks[4] = { B, Hkv, Lk, D };

	write_input(_metadata, self, "Q.npy", &self->q, dt, qs, three_d);
	write_input(_metadata, self, "K.npy", &self->k, dt, ks, three_d);
	write_input(_metadata, self, "V.npy", &self->v, dt, ks, three_d);
}

static void seed_desc(ape_attn_desc *d)
{
	ape_attn_desc_init(d);
	d->delta.value = (float)SEED_DELTA;
	d->beta.value = (float)(SEED_DELTA / 10);
	d->gamma.value = (float)(SEED_DELTA / 10);
	d->lambda.value = (float)SEED_LAMBDA;
}

static void convert_copy(struct __test_metadata *_metadata, test_tensor *dst,
			 const test_tensor *src, ape_dtype dt)
{
	const int64_t *s = src->t.shape;

	ASSERT_EQ(0, test_tensor_empty(dst, dt, s[0], s[1], s[2], s[3]));
	ASSERT_EQ(0, ape_convert(dst->t.data, dt, src->t.data, src->t.dtype,
				 (size_t)(s[0] * s[1] * s[2] * s[3])));
}

/* O (float32) and LSE from the library itself, on the inputs stored as `storage`. */
static void direct(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
		   const ape_attn_desc *desc, ape_dtype storage, test_tensor *o, float *lse)
{
	const int64_t *s = self->q.t.shape;
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	test_tensor q, k, v;

	ASSERT_NE(NULL, dev);
	convert_copy(_metadata, &q, &self->q, storage);
	convert_copy(_metadata, &k, &self->k, storage);
	convert_copy(_metadata, &v, &self->v, storage);
	ASSERT_EQ(0, test_tensor_empty(o, APE_F32, s[0], s[1], s[2], s[3]));
	ASSERT_EQ(0, ape_attention_forward(dev, desc, &q.t, &k.t, &v.t, &o->t, lse, NULL))
		TH_LOG("%s", ape_last_error());
	test_tensor_free(&q);
	test_tensor_free(&k);
	test_tensor_free(&v);
	ape_context_destroy(ctx);
}

/* Loads work/name and checks its dtype, shape and values (within tol) against want. */
static void expect_npy(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
		       const char *name, ape_dtype dt, int ndim, const int64_t *shape,
		       const float *want, double tol)
{
	struct npy_array arr;
	char path[160], err[512];
	double worst = 0;

	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, npy_load(path, &arr, err, sizeof(err))) TH_LOG("%s", err);
	EXPECT_EQ(dt, arr.info.dtype);
	ASSERT_EQ(ndim, arr.info.ndim);
	for (int i = 0; i < ndim; i++) {
		ASSERT_EQ(shape[i], arr.info.shape[i]);
	}
	for (size_t i = 0; i < arr.info.count; i++) {
		float got;

		ape_convert(&got, APE_F32, (const char *)arr.data + i * ape_dtype_size(dt), dt, 1);
		if (got != want[i])
			worst = fmax(worst, isnan(got) ? INFINITY : fabs(got - want[i]));
	}
	EXPECT_LE(worst, tol) TH_LOG("%s: largest difference %g", name, worst);
	npy_free(&arr);
}

/* O and LSE as files must match the direct call. */
static void expect_outputs(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			   const ape_attn_desc *desc, ape_dtype storage, ape_dtype file_dt,
			   bool three_d)
{
	const int64_t *s = self->q.t.shape;
	const size_t rows = (size_t)(s[0] * s[1] * s[2]), n = rows * (size_t)s[3];
	test_tensor o;
	float *lse = malloc(rows * sizeof(float) + 1);

	ASSERT_NE(NULL, lse);
	direct(_metadata, self, desc, storage, &o, lse);
	/* the tool writes O rounded to the file's type, once */
	if (file_dt == APE_F16)
		for (size_t i = 0; i < n; i++) {
			uint16_t h;

			ape_convert(&h, APE_F16, (float *)o.t.data + i, APE_F32, 1);
			ape_convert((float *)o.t.data + i, APE_F32, &h, APE_F16, 1);
		}
	expect_npy(_metadata, self, "O.npy", file_dt, three_d ? 3 : 4, s + three_d, o.t.data,
		   1e-6 * fmax(1, test_tensor_maxabs(&self->v.t)));
	expect_npy(_metadata, self, "LSE.npy", APE_F32, three_d ? 2 : 3, s + three_d, lse, 1e-6);
	test_tensor_free(&o);
	free(lse);
}

/* The exit status, the words in the message, and nothing new in the directory. */
static void expect_refused(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self, int got,
			   int status, const char *const *words)
{
	EXPECT_EQ(status, got) TH_LOG("stderr: %s", self->err);
	for (; *words; words++) {
		EXPECT_NE(NULL, strstr(self->err, *words)) TH_LOG("'%s' not in: %s", *words,
								  self->err);
	}
	EXPECT_EQ(self->ninputs, test_count_entries(self->work, NULL, 0))
		TH_LOG("outputs or temporary files left behind");
}

static void patch_file(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
		       const char *name, const char *from, const char *to)
{
	char path[160], buf[256];
	size_t len = strlen(from);
	FILE *f;
	char *at;

	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	f = fopen(path, "r+b");
	ASSERT_NE(NULL, f);
	ASSERT_EQ(sizeof(buf), fread(buf, 1, sizeof(buf), f));
	at = memmem(buf, sizeof(buf), from, len);
	ASSERT_NE(NULL, at);
	ASSERT_EQ(0, fseek(f, at - buf, SEEK_SET));
	ASSERT_EQ(len, fwrite(to, 1, len, f));
	ASSERT_EQ(0, fclose(f));
}

#endif
