/* SPDX-License-Identifier: MIT */
/*
 * The diagnostics in the tools, as users run them (subprocesses in a fresh directory):
 * ape-run --entropy / --mean-distance against ape_attention_forward_diag() (one call and the KV
 * cache), refused options with no output left behind; ape-curve's figures against the same
 * figures computed from ape-run's outputs on a small grid, its formats and its refusals.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/npy.h"

#define SEED_DELTA 0.3968502629920499

FIXTURE(tools)
{
	char work[64];
	char out[65536];
	char err[16384];
	int ninputs;
	ape_rng rng;
	test_tensor q, k, v;
};

FIXTURE_SETUP(tools)
{
	snprintf(self->work, sizeof(self->work), "/tmp/ape-test-diag.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(self->work));
	ape_rng_init(&self->rng, _metadata->name);
}

FIXTURE_TEARDOWN(tools)
{
	test_tensor_free(&self->q);
	test_tensor_free(&self->k);
	test_tensor_free(&self->v);
	test_rmtree(self->work);
}

static int run_tool(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self,
		    const char *tool, const char *const *args)
{
	int status = test_run_tool(tool, args, self->work, self->out, sizeof(self->out), self->err,
				   sizeof(self->err));

	ASSERT_LE(0, status) TH_LOG("could not start %s", tool);
	return status;
}

#define RUN(...) run_tool(_metadata, self, "ape-run", (const char *const[]){ __VA_ARGS__, NULL })
#define CURVE(...)                                                                                 \
	run_tool(_metadata, self, "ape-curve", (const char *const[]){ __VA_ARGS__, NULL })
#define FILES "-q", "Q.npy", "-k", "K.npy", "-v", "V.npy", "-o", "O.npy"

/* Saves the first L rows of t as work/name ([B, H, L, D], float32). */
static void save_rows(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self,
		      const char *name, const test_tensor *t, int64_t L)
{
	const int64_t *s = t->t.shape, shape[4] = { s[0], s[1], L, s[3] };
	float *buf = malloc(sizeof(float) * (size_t)(s[0] * s[1] * L * s[3]) + 1);
	char path[160], err[512];
	size_t n = 0;

	ASSERT_NE(NULL, buf);
	for (int64_t b = 0; b < s[0]; b++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t i = 0; i < L; i++)
				for (int64_t d = 0; d < s[3]; d++)
					buf[n++] = (float)test_tensor_get(&t->t, b, h, i, d);
	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, npy_save(path, APE_F32, 4, shape, buf, err, sizeof(err))) TH_LOG("%s", err);
	free(buf);
	self->ninputs = test_count_entries(self->work, NULL, 0);
}

static void inputs(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self, int64_t H,
		   int64_t Hkv, int64_t L, int64_t D)
{
	ASSERT_EQ(0, test_tensor_random(&self->q, &self->rng, APE_F32, 1, H, L, D, 1.0));
	ASSERT_EQ(0, test_tensor_random(&self->k, &self->rng, APE_F32, 1, Hkv, L, D, 1.0));
	ASSERT_EQ(0, test_tensor_random(&self->v, &self->rng, APE_F32, 1, Hkv, L, D, 1.0));
	save_rows(_metadata, self, "Q.npy", &self->q, L);
	save_rows(_metadata, self, "K.npy", &self->k, L);
	save_rows(_metadata, self, "V.npy", &self->v, L);
}

/* work/name as floats (n of them, checked), in a new array */
static float *load(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self,
		   const char *name, size_t n)
{
	struct npy_array arr;
	char path[160], err[512];
	float *x;

	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	if (npy_load(path, &arr, err, sizeof(err))) {
		TH_LOG("%s", err);
		return NULL;
	}
	if (arr.info.dtype != APE_F32 || arr.info.count != n) {
		TH_LOG("%s: %zu elements of %s, expected %zu float32", name,
		       (size_t)arr.info.count, ape_dtype_name(arr.info.dtype), n);
		npy_free(&arr);
		return NULL;
	}
	x = malloc(n * sizeof(float) + 1);
	if (x)
		memcpy(x, arr.data, n * sizeof(float));
	npy_free(&arr);
	return x;
}

/* The library's diagnostics for the fixture's inputs (first L rows) with desc. */
static void library(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self,
		    const ape_attn_desc *desc, int64_t L, float *ent, float *md)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	const int64_t *s = self->q.t.shape;
	ape_tensor q, k, v;
	test_tensor o;

	ASSERT_NE(NULL, dev);
	ASSERT_EQ(0, ape_tensor_rows(&self->q.t, 0, L, &q));
	ASSERT_EQ(0, ape_tensor_rows(&self->k.t, 0, L, &k));
	ASSERT_EQ(0, ape_tensor_rows(&self->v.t, 0, L, &v));
	ASSERT_EQ(0, test_tensor_empty(&o, APE_F32, s[0], s[1], L, s[3]));
	ASSERT_EQ(0, ape_attention_forward_diag(&dev, 1, NULL, desc, &q, &k, &v, &o.t, NULL, ent,
						md, NULL))
	TH_LOG("%s", ape_last_error());
	test_tensor_free(&o);
	ape_context_destroy(ctx);
}

static void seed_desc(ape_attn_desc *d)
{
	ape_attn_desc_init(d);
	d->delta.value = (float)SEED_DELTA;
	d->beta.value = (float)(SEED_DELTA / 10);
	d->gamma.value = (float)(SEED_DELTA / 10);
	d->lambda.value = 0.1f;
}

static double max_diff(const float *a, const float *b, size_t n)
{
	double w = 0;

	for (size_t i = 0; i < n; i++)
		w = fmax(w, a[i] == b[i] ? 0 : isnan(a[i]) || isnan(b[i]) ? INFINITY
									: fabs(a[i] - b[i]));
	return w;
}

/* work/name holds n float32 values within tol of want */
static void expect_file(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self,
			const char *name, const float *want, size_t n, double tol)
{
	float *got = load(_metadata, self, name, n);

	ASSERT_NE(NULL, got);
	EXPECT_LE(max_diff(got, want, n), tol) TH_LOG("%s", name);
	free(got);
}

/* ---- ape-run */

TEST_F(tools, ape_run_writes_the_library_figures)
{
	const int64_t H = 4, L = 40, rows = H * L;
	float ent[160], md[160], *lse;
	ape_attn_desc desc;

	inputs(_metadata, self, H, 2, L, 16);
	seed_desc(&desc);
	library(_metadata, self, &desc, L, ent, md);
	ASSERT_EQ(0, RUN(FILES, "--lse", "LSE.npy", "--entropy", "E.npy", "--mean-distance",
			 "M.npy", "--backend", "ref"))
	TH_LOG("%s", self->err);
	expect_file(_metadata, self, "E.npy", ent, (size_t)rows, 1e-6);
	expect_file(_metadata, self, "M.npy", md, (size_t)rows, 1e-6 * L);
	lse = load(_metadata, self, "LSE.npy", (size_t)rows); /* written with them */
	ASSERT_NE(NULL, lse);
	free(lse);
	/* only one of them, streamed in chunks of 7; then on the KV cache, 3 tokens a step */
	ASSERT_EQ(0, RUN(FILES, "--mean-distance", "M2.npy", "--chunk", "7", "--backend", "ref"))
	TH_LOG("%s", self->err);
	expect_file(_metadata, self, "M2.npy", md, (size_t)rows, 1e-4 * L);
	ASSERT_EQ(0, RUN(FILES, "--entropy", "E3.npy", "--mean-distance", "M3.npy", "--kv-cache",
			 "3", "--backend", "ref"))
	TH_LOG("%s", self->err);
	expect_file(_metadata, self, "E3.npy", ent, (size_t)rows, 1e-4);
	expect_file(_metadata, self, "M3.npy", md, (size_t)rows, 1e-4 * L);
}

static void expect_refused(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self, int got,
			   int status, const char *word)
{
	EXPECT_EQ(status, got) TH_LOG("stderr: %s", self->err);
	EXPECT_NE(NULL, strstr(self->err, word)) TH_LOG("'%s' not in: %s", word, self->err);
	EXPECT_EQ(self->ninputs, test_count_entries(self->work, NULL, 0))
	TH_LOG("outputs or temporary files left behind");
}

TEST_F(tools, ape_run_refuses_bad_diagnostic_options)
{
	inputs(_metadata, self, 2, 1, 8, 8);
	expect_refused(_metadata, self, RUN(FILES, "--entropy", "O.npy", "--backend", "ref"), 2,
		       "-o and --entropy both name O.npy");
	expect_refused(_metadata, self,
		       RUN(FILES, "--entropy", "E.npy", "--mean-distance", "E.npy", "--backend",
			   "ref"),
		       2, "--entropy and --mean-distance both name E.npy");
	expect_refused(_metadata, self,
		       RUN(FILES, "--lse", "L.npy", "--mean-distance", "L.npy", "--backend", "ref"),
		       2, "--lse and --mean-distance both name L.npy");
	expect_refused(_metadata, self,
		       RUN(FILES, "--mean-distance", "nodir/M.npy", "--backend", "ref"), 2,
		       "--mean-distance nodir/M.npy: directory nodir/ does not exist");
	expect_refused(_metadata, self, RUN(FILES, "--entropy"), 2, "--entropy");
	/* O, LSE and M are complete before E's temporary file cannot be created: none stays */
	expect_refused(_metadata, self,
		       RUN(FILES, "--lse", "L.npy", "--mean-distance", "M.npy", "--entropy",
			   "/proc/E.npy", "--backend", "ref"),
		       1, "/proc/E.npy");
}

/* ---- ape-curve */

/* The figures of one CSV row: set, L, head -> ent_mean, ent_last, md_mean. */
static int csv_find(const char *csv, const char *set, long L, long head, double f[3])
{
	const char *line = strchr(csv, '\n'); /* past the header */

	while (line && *++line) {
		char name[64];
		double p[4];
		long l, h;

		if (sscanf(line, "\"%63[^\"]\",%lf,%lf,%lf,%lf,%ld,%ld,%lf,%lf,%lf", name, &p[0],
			   &p[1], &p[2], &p[3], &l, &h, &f[0], &f[1], &f[2]) == 10 &&
		    !strcmp(name, set) && l == L && h == head)
			return 0;
		line = strchr(line, '\n');
	}
	return -1;
}

TEST_F(tools, ape_curve_equals_ape_run_on_a_small_grid)
{
	static const long lengths[2] = { 9, 24 };
	const int64_t H = 2, Lmax = 24;
	char csv[65536];

	inputs(_metadata, self, H, 1, Lmax, 8);
	ASSERT_EQ(0, CURVE("-q", "Q.npy", "-k", "K.npy", "-v", "V.npy", "--lengths", "9,24",
			   "--params", "ape", "--params", "rope", "--params", "0.1,0.2,0,0.5",
			   "--csv", "--backend", "ref"))
	TH_LOG("%s", self->err);
	snprintf(csv, sizeof(csv), "%s", self->out);
	EXPECT_NE(NULL, strstr(self->err, "[6/6]")) TH_LOG("progress: %s", self->err);
	for (int li = 0; li < 2; li++) {
		const long L = lengths[li];

		save_rows(_metadata, self, "Qp.npy", &self->q, L);
		save_rows(_metadata, self, "Kp.npy", &self->k, L);
		save_rows(_metadata, self, "Vp.npy", &self->v, L);
		for (int si = 0; si < 3; si++) {
			static const char *const sets[3] = { "ape", "rope", "0.1,0.2,0,0.5" };
			float *fe, *fm;
			int st;

			if (si == 0)
				st = RUN("-q", "Qp.npy", "-k", "Kp.npy", "-v", "Vp.npy", "-o", "O.npy",
					 "--entropy", "E.npy", "--mean-distance", "M.npy",
					 "--backend", "ref");
			else if (si == 1)
				st = RUN("-q", "Qp.npy", "-k", "Kp.npy", "-v", "Vp.npy", "-o", "O.npy",
					 "--entropy", "E.npy", "--mean-distance", "M.npy",
					 "--backend", "ref", "--delta", "0", "--beta", "0",
					 "--gamma", "0", "--lambda", "0");
			else
				st = RUN("-q", "Qp.npy", "-k", "Kp.npy", "-v", "Vp.npy", "-o", "O.npy",
					 "--entropy", "E.npy", "--mean-distance", "M.npy",
					 "--backend", "ref", "--delta", "0.1", "--beta", "0.2",
					 "--gamma", "0", "--lambda", "0.5");
			ASSERT_EQ(0, st) TH_LOG("%s", self->err);
			fe = load(_metadata, self, "E.npy", (size_t)(H * L));
			fm = load(_metadata, self, "M.npy", (size_t)(H * L));
			ASSERT_NE(NULL, fe);
			ASSERT_NE(NULL, fm);
			for (long h = 0; h < H; h++) {
				double f[3], se = 0, sm = 0;

				ASSERT_EQ(0, csv_find(csv, sets[si], L, h, f))
				TH_LOG("no row for %s L %ld head %ld in:\n%s", sets[si], L, h, csv);
				for (long i = 0; i < L; i++) {
					se += fe[h * L + i];
					sm += fm[h * L + i];
				}
				EXPECT_LE(fabs(f[0] - se / L), 1e-6 * fmax(1, f[0]));
				EXPECT_LE(fabs(f[1] - fe[h * L + L - 1]), 1e-6 * fmax(1, f[1]));
				EXPECT_LE(fabs(f[2] - sm / L), 1e-6 * fmax(1, f[2]));
			}
			free(fe);
			free(fm);
		}
	}
}

TEST_F(tools, ape_curve_formats_and_refusals)
{
	inputs(_metadata, self, 2, 2, 16, 8);
	/* random inputs, the table and JSON */
	ASSERT_EQ(0, CURVE("--lengths", "8,16", "--heads", "3", "--dim", "8", "--seed", "5",
			   "--backend", "ref", "--quiet"))
	TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->out, "ent_mean"));
	EXPECT_NE(NULL, strstr(self->out, "alibi"));
	EXPECT_EQ('\0', self->err[0]) TH_LOG("--quiet printed: %s", self->err);
	ASSERT_EQ(0, CURVE("--lengths", "8", "--params", "rope", "--json", "--backend", "ref",
			   "-H", "1", "-D", "4"))
	TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->out, "\"rows\": [")) TH_LOG("%s", self->out);
	EXPECT_NE(NULL, strstr(self->out, "\"set\": \"rope\""));
	/* a length's figures do not depend on the other lengths asked for */
	{
		static char one[sizeof(self->out)];
		double f1[3], f2[3];

		ASSERT_EQ(0, CURVE("--lengths", "8", "--params", "ape", "--csv", "--backend", "ref",
				   "-H", "2", "-D", "8", "--seed", "3"));
		snprintf(one, sizeof(one), "%s", self->out);
		ASSERT_EQ(0, CURVE("--lengths", "8,20", "--params", "ape", "--csv", "--backend",
				   "ref", "-H", "2", "-D", "8", "--seed", "3"));
		for (long h = 0; h < 2; h++) {
			ASSERT_EQ(0, csv_find(one, "ape", 8, h, f1));
			ASSERT_EQ(0, csv_find(self->out, "ape", 8, h, f2));
			EXPECT_EQ(0, memcmp(f1, f2, sizeof(f1)));
		}
		/* and another seed gives other inputs */
		ASSERT_EQ(0, CURVE("--lengths", "8", "--params", "ape", "--csv", "--backend", "ref",
				   "-H", "2", "-D", "8", "--seed", "4"));
		ASSERT_EQ(0, csv_find(self->out, "ape", 8, 0, f2));
		EXPECT_NE(f1[0], f2[0]);
	}
	ASSERT_EQ(0, CURVE("--help"));
	EXPECT_NE(NULL, strstr(self->out, "usage: ape-curve"));
	/* refusals: exit 2, a message naming the option */
	EXPECT_EQ(2, CURVE("--params", "1,2,3", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "--params 1,2,3")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("--params", "0,0,0,-1", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "lambda")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("--lengths", "8,0", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "--lengths")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("--lengths", "8,,16", "--backend", "ref"));
	EXPECT_EQ(2, CURVE("--csv", "--json", "--backend", "ref"));
	EXPECT_EQ(2, CURVE("--dim", "7", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "even")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("-q", "Q.npy", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "-k")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("-q", "Q.npy", "-k", "K.npy", "-v", "V.npy", "--lengths", "17",
			   "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "longer than the files")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("-q", "nosuch.npy", "-k", "K.npy", "-v", "V.npy", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "nosuch.npy")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("--frobnicate"));
	EXPECT_EQ(2, CURVE("--backend", "nosuch"));
	EXPECT_EQ(self->ninputs, test_count_entries(self->work, NULL, 0));
}

/* A table saved as work/name, float32 [rows, M]. */
static void save_table(struct __test_metadata *_metadata, FIXTURE_DATA(tools) *self,
		       const char *name, int64_t rows, int64_t M, const float *vals)
{
	const int64_t shape[2] = { rows, M };
	char path[160], err[512];

	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, npy_save(path, APE_F32, 2, shape, vals, err, sizeof(err))) TH_LOG("%s", err);
	self->ninputs = test_count_entries(self->work, NULL, 0);
}

/* ape-curve --bias-table: a table joins the --params set before it ("ape+T") or makes a set of
 * its own ("G": plain RoPE plus the table); the figures are those of ape-run --bias-table's
 * diagnostics; JSON names the file; a table that does not fit is refused before anything is
 * computed. */
TEST_F(tools, ape_curve_draws_a_bias_table)
{
	static const char *const sets[2] = { "ape+T", "G" };
	const int64_t H = 2, L = 20;
	float t[12], g[32];
	char csv[65536];

	for (int i = 0; i < 12; i++)
		t[i] = (float)(2 * ape_rng_uniform(&self->rng) - 1);
	for (int m = 0; m < 32; m++)
		g[m] = -0.02f * (float)(m * m);
	inputs(_metadata, self, H, 1, L, 8);
	save_table(_metadata, self, "T.npy", 2, 6, t);
	save_table(_metadata, self, "G.npy", 1, 32, g);
	ASSERT_EQ(0, CURVE("-q", "Q.npy", "-k", "K.npy", "-v", "V.npy", "--lengths", "20",
			   "--params", "ape", "--bias-table", "T.npy", "-b", "G.npy",
			   "--rope-scale", "2", "--csv", "--backend", "ref", "--quiet"))
	TH_LOG("%s", self->err);
	snprintf(csv, sizeof(csv), "%s", self->out);
	for (int si = 0; si < 2; si++) {
		float *fe, *fm;

		int st;

		if (si == 0)
			st = RUN(FILES, "--entropy", "E.npy", "--mean-distance", "M.npy",
				 "--backend", "ref", "--bias-table", "T.npy", "--rope-scale", "2");
		else
			st = RUN(FILES, "--entropy", "E.npy", "--mean-distance", "M.npy",
				 "--backend", "ref", "--bias-table", "G.npy", "--rope-scale", "2",
				 "--delta", "0", "--beta", "0", "--gamma", "0", "--lambda", "0");
		ASSERT_EQ(0, st) TH_LOG("%s", self->err);
		fe = load(_metadata, self, "E.npy", (size_t)(H * L));
		fm = load(_metadata, self, "M.npy", (size_t)(H * L));
		ASSERT_NE(NULL, fe);
		ASSERT_NE(NULL, fm);
		for (long h = 0; h < H; h++) {
			double f[3], se = 0, sm = 0;

			ASSERT_EQ(0, csv_find(csv, sets[si], L, h, f))
			TH_LOG("no row for %s head %ld in:\n%s", sets[si], h, csv);
			for (long i = 0; i < L; i++) {
				se += fe[h * L + i];
				sm += fm[h * L + i];
			}
			EXPECT_LE(fabs(f[0] - se / L), 1e-6 * fmax(1, f[0]));
			EXPECT_LE(fabs(f[1] - fe[h * L + L - 1]), 1e-6 * fmax(1, f[1]));
			EXPECT_LE(fabs(f[2] - sm / L), 1e-6 * fmax(1, f[2]));
		}
		free(fe);
		free(fm);
	}
	/* JSON names the table's file, null for a set without one */
	ASSERT_EQ(0, CURVE("--lengths", "8", "-H", "1", "-D", "8", "--params", "rope", "-b", "G.npy",
			   "-p", "ape", "--json", "--backend", "ref", "--quiet"))
	TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->out, "\"set\": \"rope+G\"")) TH_LOG("%s", self->out);
	EXPECT_NE(NULL, strstr(self->out, "\"bias_table\": \"G.npy\"")) TH_LOG("%s", self->out);
	EXPECT_NE(NULL, strstr(self->out, "\"bias_table\": null")) TH_LOG("%s", self->out);
	/* refusals: exit 2 naming the option and the file, nothing on stdout */
	self->ninputs = test_count_entries(self->work, NULL, 0);
	EXPECT_EQ(2, CURVE("--lengths", "8", "-H", "3", "-D", "8", "-b", "T.npy", "--backend",
			   "ref"));
	EXPECT_NE(NULL, strstr(self->err, "--bias-table T.npy: shape (2, 6)")) TH_LOG("%s", self->err);
	EXPECT_EQ('\0', self->out[0]) TH_LOG("%s", self->out);
	EXPECT_EQ(2, CURVE("--lengths", "8", "-b", "nosuch.npy", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "--bias-table nosuch.npy")) TH_LOG("%s", self->err);
	EXPECT_EQ(2, CURVE("--lengths", "8", "--rope-scale", "0", "--backend", "ref"));
	EXPECT_NE(NULL, strstr(self->err, "--rope-scale")) TH_LOG("%s", self->err);
	EXPECT_EQ(self->ninputs, test_count_entries(self->work, NULL, 0));
}

TEST_HARNESS_MAIN
