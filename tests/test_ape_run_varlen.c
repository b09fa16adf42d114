/* SPDX-License-Identifier: MIT */
/*
 * ape-run's ragged call (--cu-seqlens-q/-k, --positions-q/-k) as users run it: a subprocess in a
 * fresh directory. A packed batch must give what ape-run gives each sequence on its own (O, LSE
 * and, with --backward, the gradients), explicit default positions the very same bytes, and
 * every bad offset, position or option exit 2 with a message naming it and no output file.
 * (The dense call: test_ape_run.c, test_ape_run_backward.c.)
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

#define NH 4
#define NKV 2
#define DIM 16
#define NSEQ 3
/* three sequences, the middle one empty; the first's queries end-aligned to more keys */
static const int64_t cu_q[NSEQ + 1] = { 0, 5, 5, 12 };
static const int64_t cu_k[NSEQ + 1] = { 0, 9, 9, 16 };
#define TOTAL_Q 12
#define TOTAL_K 16

#define PACKED FILES, "--backend", "ref", "--cu-seqlens-q", "CQ.npy", "--cu-seqlens-k", "CK.npy"

/* A 1-D (or, with rows > 0, [rows, n / rows]) integer file of descr '<i8' or '<i4'. */
static void write_ints(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
		       const char *name, const char *descr, const int64_t *vals, int64_t n,
		       int64_t rows)
{
	const int64_t shape[2] = { rows ? rows : n, rows ? n / rows : 0 };
	char path[160], hdr[4096], err[256], *at;
	size_t hlen = 0, esz = descr[2] == '8' ? 8 : 4;
	FILE *f;

	/* the header of a float32 array of the same shape, its descr replaced (same length) */
	ASSERT_EQ(0, npy_format_header(hdr, sizeof(hdr), APE_F32, rows ? 2 : 1, shape, 0, &hlen,
				       err, sizeof(err))) TH_LOG("%s", err);
	at = memmem(hdr, hlen, "<f4", 3);
	ASSERT_NE(NULL, at);
	memcpy(at, descr, 3);
	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	f = fopen(path, "wb");
	ASSERT_NE(NULL, f);
	ASSERT_EQ(hlen, fwrite(hdr, 1, hlen, f));
	for (int64_t i = 0; i < n; i++) {
		int32_t v4 = (int32_t)vals[i];

		ASSERT_EQ(esz, fwrite(esz == 8 ? (const void *)&vals[i] : (const void *)&v4, 1, esz,
				      f));
	}
	ASSERT_EQ(0, fclose(f));
	self->ninputs = test_count_entries(self->work, NULL, 0);
}

/* Packed Q [TOTAL_Q, NH, DIM], K and V [TOTAL_K, NKV, DIM] (Q.npy, K.npy, V.npy), CQ.npy (int32)
 * and CK.npy (int64). */
static void write_packed(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self)
{
	const int64_t qs[4] = { 1, TOTAL_Q, NH, DIM }, ks[4] = { 1, TOTAL_K, NKV, DIM };

	write_input(_metadata, self, "Q.npy", &self->q, APE_F32, qs, true);
	write_input(_metadata, self, "K.npy", &self->k, APE_F32, ks, true);
	write_input(_metadata, self, "V.npy", &self->v, APE_F32, ks, true);
	write_ints(_metadata, self, "CQ.npy", "<i4", cu_q, NSEQ + 1, 0);
	write_ints(_metadata, self, "CK.npy", "<i8", cu_k, NSEQ + 1, 0);
}

/* Rows [from, from + n) of a packed [total, h, DIM] float32 array, as a dense [h, n, DIM] file. */
static void save_slice(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
		       const char *name, const float *packed, int64_t from, int64_t n, int64_t h)
{
	const int64_t shape[3] = { h, n, DIM };
	float *out = malloc((size_t)(h * n * DIM) * sizeof(float) + 1);
	char path[160], err[512];

	ASSERT_NE(NULL, out);
	for (int64_t i = 0; i < n; i++)
		for (int64_t j = 0; j < h; j++)
			memcpy(out + (j * n + i) * DIM, packed + ((from + i) * h + j) * DIM,
			       DIM * sizeof(float));
	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, npy_save(path, APE_F32, 3, shape, out, err, sizeof(err))) TH_LOG("%s", err);
	free(out);
}

static void load(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self, const char *name,
		 struct npy_array *arr)
{
	char path[160], err[512];

	snprintf(path, sizeof(path), "%s/%s", self->work, name);
	ASSERT_EQ(0, npy_load(path, arr, err, sizeof(err))) TH_LOG("%s", err);
	ASSERT_EQ(APE_F32, arr->info.dtype);
}

/* Largest difference between rows [from, from + n) of a packed [total, h, w] array and the
 * dense [h, n, w] file `name` (two -inf equal). */
static double slice_err(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			const char *name, const float *packed, int64_t from, int64_t n, int64_t h,
			int64_t w)
{
	struct npy_array arr;
	double worst = 0;

	load(_metadata, self, name, &arr);
	EXPECT_EQ((uint64_t)(h * n * w), arr.info.count) TH_LOG("%s", name);
	for (int64_t i = 0; i < n && arr.info.count == (uint64_t)(h * n * w); i++)
		for (int64_t j = 0; j < h; j++)
			for (int64_t c = 0; c < w; c++) {
				float a = packed[((from + i) * h + j) * w + c];
				float b = ((const float *)arr.data)[(j * n + i) * w + c];

				if (a != b)
					worst = fmax(worst, isnan(a - b) ? INFINITY : fabs(a - b));
			}
	npy_free(&arr);
	return worst;
}

/* The packed run's O and LSE (and, with dout, dQ, dK, dV and dparams) against ape-run on each
 * non-empty sequence alone: the dense call with the sequence's rows. */
static void expect_per_sequence(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
				const float *dout)
{
	struct npy_array o, lse, dq, dk, dv, dp;
	float dp_sum[NH * 4] = { 0 };
	double tol = 1e-5 * fmax(1, test_tensor_maxabs(&self->v.t));

	load(_metadata, self, "O.npy", &o);
	ASSERT_EQ(3, o.info.ndim);
	EXPECT_EQ(TOTAL_Q, o.info.shape[0]);
	EXPECT_EQ(NH, o.info.shape[1]);
	EXPECT_EQ(DIM, o.info.shape[2]);
	load(_metadata, self, "LSE.npy", &lse);
	ASSERT_EQ(2, lse.info.ndim);
	EXPECT_EQ(TOTAL_Q, lse.info.shape[0]);
	EXPECT_EQ(NH, lse.info.shape[1]);
	if (dout) {
		load(_metadata, self, "DQ.npy", &dq);
		load(_metadata, self, "DK.npy", &dk);
		load(_metadata, self, "DV.npy", &dv);
		load(_metadata, self, "DP.npy", &dp);
	}
	for (int s = 0; s < NSEQ; s++) {
		const int64_t q0 = cu_q[s], nq = cu_q[s + 1] - q0, k0 = cu_k[s];
		const int64_t nk = cu_k[s + 1] - k0;
		struct npy_array p;

		if (!nq)
			continue;
		save_slice(_metadata, self, "Qs.npy", self->q.t.data, q0, nq, NH);
		save_slice(_metadata, self, "Ks.npy", self->k.t.data, k0, nk, NKV);
		save_slice(_metadata, self, "Vs.npy", self->v.t.data, k0, nk, NKV);
		if (dout) {
			save_slice(_metadata, self, "DOs.npy", dout, q0, nq, NH);
			ASSERT_EQ(0, RUN("-q", "Qs.npy", "-k", "Ks.npy", "-v", "Vs.npy", "-o",
					 "Os.npy", "--lse", "LSEs.npy", "--backend", "ref",
					 "--backward", "DOs.npy", "--dq", "DQs.npy", "--dk",
					 "DKs.npy", "--dv", "DVs.npy", "--dparams", "DPs.npy"))
				TH_LOG("%s", self->err);
		} else {
			ASSERT_EQ(0, RUN("-q", "Qs.npy", "-k", "Ks.npy", "-v", "Vs.npy", "-o",
					 "Os.npy", "--lse", "LSEs.npy", "--backend", "ref"))
				TH_LOG("%s", self->err);
		}
		EXPECT_LE(slice_err(_metadata, self, "Os.npy", o.data, q0, nq, NH, DIM), tol)
			TH_LOG("sequence %d: O", s);
		EXPECT_LE(slice_err(_metadata, self, "LSEs.npy", lse.data, q0, nq, NH, 1), 1e-5)
			TH_LOG("sequence %d: LSE", s);
		if (!dout)
			continue;
		EXPECT_LE(slice_err(_metadata, self, "DQs.npy", dq.data, q0, nq, NH, DIM), 1e-4)
			TH_LOG("sequence %d: dQ", s);
		EXPECT_LE(slice_err(_metadata, self, "DKs.npy", dk.data, k0, nk, NKV, DIM), 1e-4)
			TH_LOG("sequence %d: dK", s);
		EXPECT_LE(slice_err(_metadata, self, "DVs.npy", dv.data, k0, nk, NKV, DIM), 1e-4)
			TH_LOG("sequence %d: dV", s);
		load(_metadata, self, "DPs.npy", &p);
		for (int i = 0; i < NH * 4; i++)
			dp_sum[i] += ((const float *)p.data)[i];
		npy_free(&p);
	}
	if (dout) {
		/* the parameters' gradients: the sequences' added up */
		for (int i = 0; i < NH * 4; i++) {
			EXPECT_LE(fabs(((const float *)dp.data)[i] - dp_sum[i]),
				  1e-4 * fmax(1, fabs(dp_sum[i]))) TH_LOG("dparams[%d]", i);
		}
		npy_free(&dq);
		npy_free(&dk);
		npy_free(&dv);
		npy_free(&dp);
	}
	/* the empty sequence's rows are none; every packed row was compared */
	npy_free(&o);
	npy_free(&lse);
}

TEST_F(run, packed_batch_matches_each_sequence_alone)
{
	write_packed(_metadata, self);
	ASSERT_EQ(0, RUN(PACKED, "--stats")) TH_LOG("%s", self->err);
	EXPECT_NE(NULL, strstr(self->err, "pairs visible")) TH_LOG("%s", self->err);
	expect_per_sequence(_metadata, self, NULL);
}

TEST_F(run, packed_backward_matches_each_sequence_alone)
{
	const int64_t qs[4] = { 1, TOTAL_Q, NH, DIM };
	test_tensor dout = { 0 };

	write_packed(_metadata, self);
	write_input(_metadata, self, "DO.npy", &dout, APE_F32, qs, true);
	ASSERT_EQ(0, RUN(PACKED, "--backward", "DO.npy", "--dq", "DQ.npy", "--dk", "DK.npy",
			 "--dv", "DV.npy", "--dparams", "DP.npy"))
		TH_LOG("%s", self->err);
	expect_per_sequence(_metadata, self, dout.t.data);
	test_tensor_free(&dout);
}

/* Files that compare equal byte for byte. */
static void expect_same_file(struct __test_metadata *_metadata, FIXTURE_DATA(run) *self,
			     const char *a, const char *b)
{
	struct npy_array x, y;

	load(_metadata, self, a, &x);
	load(_metadata, self, b, &y);
	ASSERT_EQ(x.info.nbytes, y.info.nbytes);
	EXPECT_EQ(0, memcmp(x.data, y.data, x.info.nbytes)) TH_LOG("%s and %s differ", a, b);
	npy_free(&x);
	npy_free(&y);
}

TEST_F(run, explicit_default_positions_change_nothing)
{
	int64_t pq[TOTAL_Q], pk[TOTAL_K];

	/* the defaults: keys 0, 1, ... in each sequence, queries end-aligned to them */
	for (int s = 0; s < NSEQ; s++) {
		const int64_t nq = cu_q[s + 1] - cu_q[s], nk = cu_k[s + 1] - cu_k[s];

		for (int64_t i = 0; i < nk; i++)
			pk[cu_k[s] + i] = i;
		for (int64_t i = 0; i < nq; i++)
			pq[cu_q[s] + i] = nk - nq + i;
	}
	write_packed(_metadata, self);
	ASSERT_EQ(0, RUN(PACKED)) TH_LOG("%s", self->err);
	write_ints(_metadata, self, "PQ.npy", "<i8", pq, TOTAL_Q, 0);
	write_ints(_metadata, self, "PK.npy", "<i8", pk, TOTAL_K, 0);
	ASSERT_EQ(0, RUN(FILES, "--backend", "ref", "--cu-seqlens-q", "CQ.npy", "--cu-seqlens-k",
			 "CK.npy", "--positions-q", "PQ.npy", "--positions-k", "PK.npy", "-o",
			 "O2.npy", "--lse", "LSE2.npy"))
		TH_LOG("%s", self->err);
	expect_same_file(_metadata, self, "O.npy", "O2.npy");
	expect_same_file(_metadata, self, "LSE.npy", "LSE2.npy");
	/* one side given, the other its default */
	ASSERT_EQ(0, RUN(FILES, "--backend", "ref", "--cu-seqlens-q", "CQ.npy", "--cu-seqlens-k",
			 "CK.npy", "--positions-k", "PK.npy", "-o", "O3.npy", "--lse", "LSE3.npy"))
		TH_LOG("%s", self->err);
	expect_same_file(_metadata, self, "O.npy", "O3.npy");
}

TEST_F(run, one_offsets_file_stands_for_both)
{
	const int64_t qs[4] = { 1, TOTAL_Q, NH, DIM }, ks[4] = { 1, TOTAL_Q, NKV, DIM };

	write_input(_metadata, self, "Q.npy", &self->q, APE_F32, qs, true);
	write_input(_metadata, self, "K.npy", &self->k, APE_F32, ks, true);
	write_input(_metadata, self, "V.npy", &self->v, APE_F32, ks, true);
	write_ints(_metadata, self, "CQ.npy", "<i8", cu_q, NSEQ + 1, 0);
	ASSERT_EQ(0, RUN(FILES, "--backend", "ref", "--cu-seqlens-q", "CQ.npy", "--cu-seqlens-k",
			 "CQ.npy"))
		TH_LOG("%s", self->err);
	ASSERT_EQ(0, RUN(FILES, "--backend", "ref", "--cu-seqlens-k", "CQ.npy", "-o", "O2.npy",
			 "--lse", "LSE2.npy"))
		TH_LOG("%s", self->err);
	expect_same_file(_metadata, self, "O.npy", "O2.npy");
	ASSERT_EQ(0, RUN(FILES, "--backend", "ref", "--cu-seqlens-q", "CQ.npy", "-o", "O3.npy",
			 "--lse", "LSE3.npy"))
		TH_LOG("%s", self->err);
	expect_same_file(_metadata, self, "O.npy", "O3.npy");
}

TEST_F(run, bad_offsets_and_positions)
{
	static const int64_t down[4] = { 0, 5, 3, 12 }, short_end[4] = { 0, 5, 5, 11 };
	static const int64_t from1[4] = { 1, 5, 5, 12 }, two[2] = { 0, 16 };
	int64_t pos[TOTAL_K] = { 0 };

	write_packed(_metadata, self);
	expect_refused(_metadata, self, RUN(BASIC, "--positions-q", "CQ.npy"), 2,
		       WORDS("--positions-q", "CQ.npy", "--cu-seqlens-q"));
	expect_refused(_metadata, self, RUN(BASIC, "--positions-k", "CK.npy"), 2,
		       WORDS("--positions-k", "--cu-seqlens"));

	write_ints(_metadata, self, "BAD.npy", "<i8", down, 4, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-q", "BAD.npy"), 2,
		       WORDS("--cu-seqlens-q BAD.npy", "entry 2 = 3", "entry 1 = 5", "decrease"));
	write_ints(_metadata, self, "BAD.npy", "<i4", short_end, 4, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-q", "BAD.npy"), 2,
		       WORDS("--cu-seqlens-q BAD.npy", "last entry, 11", "total_q = 12"));
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-k", "CQ.npy"), 2,
		       WORDS("--cu-seqlens-k CQ.npy", "last entry, 12", "K.npy", "total_k = 16"));
	write_ints(_metadata, self, "BAD.npy", "<i8", from1, 4, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-q", "BAD.npy"), 2,
		       WORDS("--cu-seqlens-q BAD.npy", "entry 0 is 1", "start at 0"));
	write_ints(_metadata, self, "BAD.npy", "<i8", two, 2, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-k", "BAD.npy"), 2,
		       WORDS("--cu-seqlens-k BAD.npy", "1 sequences", "CQ.npy", "(3)"));
	write_ints(_metadata, self, "BAD.npy", "<i8", two, 0, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-q", "BAD.npy"), 2,
		       WORDS("--cu-seqlens-q BAD.npy", "no entries"));
	write_ints(_metadata, self, "BAD.npy", "<i8", cu_q, 4, 2);
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-q", "BAD.npy"), 2,
		       WORDS("--cu-seqlens-q", "BAD.npy", "(2, 2)", "1-D"));
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-q", "Q.npy"), 2,
		       WORDS("--cu-seqlens-q", "Q.npy", "'<f4'", "'<i8' (int64)", "'<i4'"));
	write_ints(_metadata, self, "BAD.npy", "<u8", cu_q, 4, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--cu-seqlens-q", "BAD.npy"), 2,
		       WORDS("--cu-seqlens-q", "BAD.npy", "'<u8'"));

	write_ints(_metadata, self, "PK.npy", "<i8", pos, TOTAL_K - 1, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--positions-k", "PK.npy"), 2,
		       WORDS("--positions-k PK.npy", "15 positions", "K.npy", "total_k = 16"));
	write_ints(_metadata, self, "PQ.npy", "<i8", pos, TOTAL_Q + 1, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--positions-q", "PQ.npy"), 2,
		       WORDS("--positions-q PQ.npy", "13 positions", "total_q = 12"));
	write_ints(_metadata, self, "PK.npy", "<i8", pos, TOTAL_K, 0); /* 256 bytes */
	patch_file(_metadata, self, "PK.npy", "'<i8'", "'>i8'");
	expect_refused(_metadata, self, RUN(PACKED, "--positions-k", "PK.npy"), 2,
		       WORDS("--positions-k", "PK.npy", "'>i8'", "little-endian"));
	write_ints(_metadata, self, "PQ.npy", "<i4", pos, TOTAL_Q, 0);
	expect_refused(_metadata, self, RUN(PACKED, "--positions-q", "PQ.npy"), 2,
		       WORDS("--positions-q", "PQ.npy", "'<i4'", "'<i8'"));
	expect_refused(_metadata, self, RUN(PACKED, "--positions-q", "missing.npy"), 2,
		       WORDS("--positions-q", "missing.npy", "No such file"));
}

TEST_F(run, packed_files_and_options_the_ragged_call_refuses)
{
	const int64_t q4[4] = { 1, NH, TOTAL_Q, DIM }, kd[4] = { 1, TOTAL_K, NKV, 8 };
	test_tensor t = { 0 };

	write_packed(_metadata, self);
	write_input(_metadata, self, "Q4.npy", &t, APE_F32, q4, false);
	expect_refused(_metadata, self, RUN(PACKED, "-q", "Q4.npy"), 2,
		       WORDS("Q4.npy", "(1, 4, 12, 16)", "3-D", "[total_q, H, D]"));
	write_input(_metadata, self, "K8.npy", &t, APE_F32, kd, true);
	expect_refused(_metadata, self, RUN(PACKED, "-k", "K8.npy"), 2,
		       WORDS("K8.npy", "D = 8", "Q.npy", "D = 16"));
	expect_refused(_metadata, self, RUN(PACKED, "--entropy", "E.npy"), 2,
		       WORDS("--entropy", "--cu-seqlens", "diagnostics"));
	expect_refused(_metadata, self, RUN(PACKED, "--mean-distance", "M.npy"), 2,
		       WORDS("--mean-distance"));
	expect_refused(_metadata, self, RUN(PACKED, "--trace", "T.json"), 2,
		       WORDS("--trace", "trace"));
	expect_refused(_metadata, self, RUN(PACKED, "--kv-cache", "1"), 2, WORDS("--kv-cache"));
	expect_refused(_metadata, self, RUN(PACKED, "--q-start", "3"), 2,
		       WORDS("--q-start", "--positions-q"));
	expect_refused(_metadata, self, RUN(PACKED, "--k-start", "0"), 2,
		       WORDS("--k-start", "--positions-k"));
	/* dL/dLSE has the packed LSE's shape */
	expect_refused(_metadata, self, RUN(PACKED, "--backward", "Q.npy", "--dq", "DQ.npy",
					    "--dlse", "Q.npy"),
		       2, WORDS("--dlse Q.npy", "(12, 4)"));
	test_tensor_free(&t);
	/* and --help says how */
	ASSERT_EQ(0, RUN("--help"));
	EXPECT_NE(NULL, strstr(self->out, "--cu-seqlens-q FILE"));
	EXPECT_NE(NULL, strstr(self->out, "--positions-k FILE"));
}

/* Without offsets a 3-D file keeps its meaning, [H, L, D]: the dense call, as before. */
TEST_F(run, without_offsets_three_d_files_are_one_sequence)
{
	ape_attn_desc d;

	write_inputs(_metadata, self, APE_F32, 1, NH, NKV, 5, 9, DIM, true);
	ASSERT_EQ(0, RUN(BASIC)) TH_LOG("%s", self->err);
	seed_desc(&d);
	expect_outputs(_metadata, self, &d, APE_F32, APE_F32, true);
}

TEST_HARNESS_MAIN
