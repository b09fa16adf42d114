/* SPDX-License-Identifier: MIT */
/*
 * ape-run as users run it: a subprocess in a fresh directory. Its results must match a direct
 * ape_attention_forward() call with the same parameters, and every bad argument or input file
 * must give the documented exit status, a message naming the culprit, and no output file.
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
			 "--lambda", "0.5,0,0.25", "--rope-base", "500", "--scale", "0.3",
			 "--no-causal", "--layout", "interleaved", "--q-start", "100", "--k-start",
			 "90", "--skip-tol", "0", "--device", "0"))
		TH_LOG("%s", self->err);
	ape_attn_desc_init(&desc);
	desc.delta.per_head = delta;
	desc.beta.per_head = beta;
	desc.gamma.value = 0.05f;
	desc.lambda.per_head = lambda;
	desc.rope_base = 500;
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
