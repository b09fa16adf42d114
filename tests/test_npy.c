/* SPDX-License-Identifier: MIT */
/*
 * The .npy reader and writer: round trips, the bytes NumPy writes, and every kind of malformed
 * file we can think of, each refused with APE_EFORMAT and a message that names the problem.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/npy.h"

/* ------------------------------------------------------------------ helpers */

/* A hand-made file: preamble for `major`, `dict` padded with spaces and '\n' to 64 bytes, data. */
static unsigned char *raw_npy(int major, const char *dict, const void *data, size_t n,
			      size_t *len)
{
	size_t pre = major == 1 ? 10 : 12, dl = strlen(dict);
	size_t hlen = dl + 1 + (64 - (pre + dl + 1) % 64) % 64;
	unsigned char *p = malloc(pre + hlen + n + 1);

	if (!p)
		return NULL;
	memcpy(p, "\x93NUMPY", 6);
	p[6] = (unsigned char)major;
	p[7] = 0;
	for (size_t i = 0; i < pre - 8; i++)
		p[8 + i] = (unsigned char)(hlen >> (8 * i));
	memcpy(p + pre, dict, dl);
	memset(p + pre + dl, ' ', hlen - dl - 1);
	p[pre + hlen - 1] = '\n';
	if (n)
		memcpy(p + pre + hlen, data, n);
	*len = pre + hlen + n;
	return p;
}

/* Parses `dict` (version 1, `n` bytes of zero data); returns the code, message in err. */
static int parse_dict_str(const char *dict, size_t n, struct npy_info *info, char *err,
			  size_t errlen)
{
	unsigned char zero[64] = { 0 };
	unsigned char *p;
	size_t len;
	int ret;

	p = raw_npy(1, dict, zero, n, &len);
	if (!p)
		return -1000;
	ret = npy_parse(p, len, info, err, errlen);
	free(p);
	return ret;
}

static int write_whole(const char *path, const void *p, size_t n)
{
	FILE *f = fopen(path, "wb");
	int ret;

	if (!f)
		return -1;
	ret = fwrite(p, 1, n, f) == n ? 0 : -1;
	return fclose(f) ? -1 : ret;
}

FIXTURE(tmpdir)
{
	char path[64];
};

FIXTURE_SETUP(tmpdir)
{
	snprintf(self->path, sizeof(self->path), "/tmp/ape-test-npy.XXXXXX");
	ASSERT_NE(NULL, mkdtemp(self->path));
}

FIXTURE_TEARDOWN(tmpdir)
{
	test_rmtree(self->path);
}

/* ------------------------------------------------------------------ writing */

TEST(header_is_numpys)
{
	static const char want[] = "\x93NUMPY\x01\x00\x76\x00"
				   "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
	const int64_t shape[2] = { 2, 3 };
	char buf[4096], err[256];
	size_t len;

	/* np.save(np.zeros((2, 3), np.float32)) with NumPy 1.24 starts with exactly these bytes,
	 * then spaces up to a '\n' at byte 127 */
	ASSERT_EQ(0, npy_format_header(buf, sizeof(buf), APE_F32, 2, shape, 0, &len, err,
				       sizeof(err))) TH_LOG("%s", err);
	ASSERT_EQ(128, len);
	ASSERT_EQ(0, memcmp(buf, want, sizeof(want) - 1));
	for (size_t i = sizeof(want) - 1; i < 127; i++) {
		ASSERT_EQ(' ', buf[i]);
	}
	ASSERT_EQ('\n', buf[127]);

	ASSERT_EQ(0, npy_format_header(buf, sizeof(buf), APE_F16, 0, NULL, 0, &len, err,
				       sizeof(err)));
	ASSERT_EQ(128, len);
	ASSERT_NE(NULL, memmem(buf, len, "'descr': '<f2'", 14));
	ASSERT_NE(NULL, memmem(buf, len, "'shape': (), }", 14));

	ASSERT_EQ(0, npy_format_header(buf, sizeof(buf), APE_F32, 1, shape, 2, &len, err,
				       sizeof(err)));
	ASSERT_EQ(2, buf[6]);
	ASSERT_EQ(0, len % 64);
	ASSERT_NE(NULL, memmem(buf, len, "'shape': (2,), }", 16));
	ASSERT_EQ(APE_EINVAL, npy_format_header(buf, 100, APE_F32, 1, shape, 0, &len, err,
						sizeof(err)));
}

static void fill_random(void *p, size_t count, ape_dtype dt, ape_rng *rng)
{
	for (size_t i = 0; i < count; i++) {
		float f = (float)ape_rng_normal(rng);

		if (dt == APE_F32)
			memcpy((float *)p + i, &f, sizeof(f));
		else
			ape_convert((uint16_t *)p + i, APE_F16, &f, APE_F32, 1);
	}
}

/* Saves a random array of the given shape with `version` and loads it back, both ways. */
static void round_trip(struct __test_metadata *_metadata, const char *dir, ape_dtype dt, int ndim,
		       const int64_t *shape, int version, ape_rng *rng)
{
	struct npy_pending pend;
	struct npy_array arr;
	struct npy_info info;
	char path[128], err[512];
	size_t count = 1, nbytes, len;
	unsigned char *data, *file;

	for (int i = 0; i < ndim; i++)
		count *= (size_t)shape[i];
	nbytes = count * ape_dtype_size(dt);
	data = malloc(nbytes + 1);
	ASSERT_NE(NULL, data);
	fill_random(data, count, dt, rng);
	snprintf(path, sizeof(path), "%s/a.npy", dir);
	ASSERT_EQ(0, npy_write_pending(&pend, path, dt, ndim, shape, data, version, err,
				       sizeof(err))) TH_LOG("%s", err);
	ASSERT_EQ(0, npy_commit(&pend, err, sizeof(err))) TH_LOG("%s", err);

	ASSERT_EQ(0, npy_load(path, &arr, err, sizeof(err))) TH_LOG("%s", err);
	ASSERT_EQ(version ? version : 1, arr.info.version);
	ASSERT_EQ(dt, arr.info.dtype);
	ASSERT_EQ(ndim, arr.info.ndim);
	for (int i = 0; i < ndim; i++) {
		ASSERT_EQ(shape[i], arr.info.shape[i]);
	}
	ASSERT_EQ(count, arr.info.count);
	ASSERT_EQ(nbytes, arr.info.nbytes);
	ASSERT_EQ(0, arr.info.data_offset % 64);
	ASSERT_EQ(0, memcmp(data, arr.data, nbytes));

	file = test_read_file(path, &len);
	ASSERT_NE(NULL, file);
	ASSERT_EQ(0, npy_parse(file, len, &info, err, sizeof(err))) TH_LOG("%s", err);
	ASSERT_EQ(arr.info.data_offset + nbytes, len);
	ASSERT_EQ(0, memcmp(file + info.data_offset, data, nbytes));
	free(file);
	npy_free(&arr);
	free(data);
}

TEST_F(tmpdir, round_trips)
{
	const int iters = ape_test_slow() ? 20 : 200;
	ape_rng rng;

	ape_rng_init(&rng, "round_trips");
	for (int it = 0; it < iters; it++) {
		int64_t shape[4];
		int ndim = (int)ape_rng_range(&rng, 0, 4);
		ape_dtype dt = ape_rng_range(&rng, 0, 1) ? APE_F16 : APE_F32;

		/* about one shape in six has an empty dimension */
		for (int i = 0; i < ndim; i++)
			shape[i] = ape_rng_range(&rng, 0, 6) ? ape_rng_range(&rng, 1, 7) : 0;
		round_trip(_metadata, self->path, dt, ndim, shape, (int)ape_rng_range(&rng, 0, 2),
			   &rng);
	}
}

TEST_F(tmpdir, replaces_target_with_umask_mode)
{
	const int64_t shape[1] = { 3 };
	const float a[3] = { 1, 2, 3 }, b[3] = { 4, 5, 6 };
	char path[128], err[256], name[256];
	struct npy_array arr;
	struct stat st;

	umask(027);
	snprintf(path, sizeof(path), "%s/o.npy", self->path);
	ASSERT_EQ(0, npy_save(path, APE_F32, 1, shape, a, err, sizeof(err))) TH_LOG("%s", err);
	ASSERT_EQ(0, npy_save(path, APE_F32, 1, shape, b, err, sizeof(err))) TH_LOG("%s", err);
	ASSERT_EQ(0, stat(path, &st));
	ASSERT_EQ(0640, st.st_mode & 0777);
	ASSERT_EQ(1, test_count_entries(self->path, name, sizeof(name)));
	ASSERT_STREQ("o.npy", name);
	ASSERT_EQ(0, npy_load(path, &arr, err, sizeof(err)));
	ASSERT_EQ(0, memcmp(b, arr.data, sizeof(b)));
	npy_free(&arr);
}

TEST_F(tmpdir, failed_writes_leave_nothing)
{
	const int64_t shape[2] = { 32, 32 }, bad[2] = { 2, -1 };
	static float data[32 * 32];
	char path[160], err[512];

	/* a directory that does not exist */
	snprintf(path, sizeof(path), "%s/nosuch/o.npy", self->path);
	ASSERT_EQ(APE_EIO, npy_save(path, APE_F32, 2, shape, data, err, sizeof(err)));
	ASSERT_NE(NULL, strstr(err, "nosuch/o.npy")) TH_LOG("%s", err);
	ASSERT_EQ(0, test_count_entries(self->path, NULL, 0));

	/* arguments the writer refuses before creating anything */
	snprintf(path, sizeof(path), "%s/o.npy", self->path);
	ASSERT_EQ(APE_EINVAL, npy_save(path, APE_BF16, 2, shape, data, err, sizeof(err)));
	ASSERT_EQ(APE_EINVAL, npy_save(path, APE_F32, 2, bad, data, err, sizeof(err)));
	ASSERT_EQ(APE_EINVAL, npy_save(path, APE_F32, 2, shape, NULL, err, sizeof(err)));
	ASSERT_EQ(APE_EINVAL, npy_save(path, APE_F32, NPY_MAX_DIMS + 1, shape, data, err,
				       sizeof(err)));
	snprintf(path, sizeof(path), "%s/", self->path);
	ASSERT_EQ(APE_EINVAL, npy_save(path, APE_F32, 2, shape, data, err, sizeof(err)));
	ASSERT_EQ(0, test_count_entries(self->path, NULL, 0));

	/* the target is a directory: the temporary file is written, the rename fails */
	snprintf(path, sizeof(path), "%s/d.npy", self->path);
	ASSERT_EQ(0, mkdir(path, 0755));
	ASSERT_EQ(APE_EIO, npy_save(path, APE_F32, 2, shape, data, err, sizeof(err)));
	ASSERT_NE(NULL, strstr(err, "rename")) TH_LOG("%s", err);
	ASSERT_EQ(1, test_count_entries(self->path, NULL, 0));

	/* discarding a pending file removes it */
	{
		struct npy_pending p;

		snprintf(path, sizeof(path), "%s/p.npy", self->path);
		ASSERT_EQ(0, npy_write_pending(&p, path, APE_F32, 2, shape, data, 0, err,
					       sizeof(err)));
		ASSERT_EQ(2, test_count_entries(self->path, NULL, 0));
		npy_discard(&p);
		npy_discard(&p);
		ASSERT_EQ(1, test_count_entries(self->path, NULL, 0));
	}
}

TEST_F(tmpdir, failed_write_keeps_old_target)
{
	const int64_t shape[2] = { 32, 32 };
	static float data[32 * 32];
	const char old[] = "the previous contents";
	struct rlimit rl, saved;
	char path[160], err[512], name[256];
	unsigned char *back;
	size_t len;
	int ret;

	snprintf(path, sizeof(path), "%s/o.npy", self->path);
	ASSERT_EQ(0, write_whole(path, old, sizeof(old)));
	/* this test runs in its own process: a file size limit makes the data write fail halfway */
	signal(SIGXFSZ, SIG_IGN);
	ASSERT_EQ(0, getrlimit(RLIMIT_FSIZE, &saved));
	rl = saved;
	rl.rlim_cur = 512;
	ASSERT_EQ(0, setrlimit(RLIMIT_FSIZE, &rl));
	ret = npy_save(path, APE_F32, 2, shape, data, err, sizeof(err));
	/* the log this test writes to is a file too */
	ASSERT_EQ(0, setrlimit(RLIMIT_FSIZE, &saved));
	ASSERT_EQ(APE_EIO, ret);
	ASSERT_NE(NULL, strstr(err, "write failed")) TH_LOG("%s", err);
	ASSERT_EQ(1, test_count_entries(self->path, name, sizeof(name)));
	ASSERT_STREQ("o.npy", name);
	back = test_read_file(path, &len);
	ASSERT_NE(NULL, back);
	ASSERT_EQ(sizeof(old), len);
	ASSERT_EQ(0, memcmp(back, old, len));
	free(back);
}

/* ------------------------------------------------------------------ reading: accepted */

TEST(tolerant_headers)
{
	static const struct {
		const char *dict;
		int ndim;
		int64_t d0, d1;
	} ok[] = {
		{ "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 2, 2, 3 },
		{ "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}", 2, 2, 3 },
		{ "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (6,)}", 1, 6, 0 },
		{ "  {  'descr' :'<f4','fortran_order':False,'shape':( 2 , 3 , ) , }  ", 2, 2, 3 },
		{ "{'descr': '<f4',\n 'fortran_order': False,\n\t'shape': (3L, 2L)}", 2, 3, 2 },
		{ "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 6)}", 2, 1, 6 },
		{ "{'descr': '<f2', 'fortran_order': False, 'shape': (12,)}", 1, 12, 0 },
		{ "{'descr': '<f2', 'fortran_order': False, 'shape': (0, 5)}", 2, 0, 5 },
	};
	struct npy_info info;
	char err[512];

	for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
		size_t n = strstr(ok[i].dict, "<f2") ? 2 : 4;

		n *= (size_t)(ok[i].d0 * (ok[i].ndim > 1 ? ok[i].d1 : 1));
		ASSERT_EQ(0, parse_dict_str(ok[i].dict, n, &info, err, sizeof(err)))
			TH_LOG("%s: %s", ok[i].dict, err);
		ASSERT_EQ(ok[i].ndim, info.ndim);
		ASSERT_EQ(ok[i].d0, info.shape[0]);
		if (ok[i].ndim > 1) {
			ASSERT_EQ(ok[i].d1, info.shape[1]);
		}
	}
}

TEST(version_2_and_3)
{
	const char *dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
	const float data[2] = { 1.5f, -2.5f };
	struct npy_info info;
	unsigned char *p;
	char err[512];
	size_t len;

	for (int major = 2; major <= 3; major++) {
		p = raw_npy(major, dict, data, sizeof(data), &len);
		ASSERT_NE(NULL, p);
		ASSERT_EQ(0, npy_parse(p, len, &info, err, sizeof(err))) TH_LOG("%s", err);
		ASSERT_EQ(major, info.version);
		ASSERT_EQ(0, memcmp(p + info.data_offset, data, sizeof(data)));
		free(p);
	}
	/* Python 2's 3L was never written by a version 3 (Python 3 only) writer */
	p = raw_npy(3, "{'descr': '<f4', 'fortran_order': False, 'shape': (2L,), }", data,
		    sizeof(data), &len);
	ASSERT_NE(NULL, p);
	ASSERT_EQ(APE_EFORMAT, npy_parse(p, len, &info, err, sizeof(err)));
	free(p);
}

/* ------------------------------------------------------------------ reading: refused */

/* Expects APE_EFORMAT and every one of the words in the message. */
static void check_refused(struct __test_metadata *_metadata, int ret, const char *err,
			  const char *const *words)
{
	EXPECT_EQ(APE_EFORMAT, ret) TH_LOG("%s", err);
	for (; *words; words++) {
		EXPECT_NE(NULL, strstr(err, *words)) TH_LOG("'%s' not in: %s", *words, err);
	}
}

#define EXPECT_REFUSED(ret, err, ...) \
	check_refused(_metadata, (ret), (err), (const char *const[]){ __VA_ARGS__, NULL })

TEST(bad_magic)
{
	static const unsigned char zip[] = "PK\x03\x04\x14\x00\x00\x00\x08\x00zzzzzz";
	static const unsigned char npz[] = "\x93NUMPZ\x01\x00\x10\x00";
	struct npy_info info;
	char err[512];

	EXPECT_REFUSED(npy_parse(zip, sizeof(zip), &info, err, sizeof(err)), err, "magic", ".npz");
	EXPECT_REFUSED(npy_parse(npz, sizeof(npz), &info, err, sizeof(err)), err, "magic",
		       "NUMPZ");
	EXPECT_REFUSED(npy_parse("", 0, &info, err, sizeof(err)), err, "empty");
	EXPECT_REFUSED(npy_parse(NULL, 0, &info, err, sizeof(err)), err, "empty");
}

TEST(bad_versions)
{
	static const unsigned char v[][3] = { { 0, 0 }, { 4, 0 }, { 1, 1 }, { 2, 5 }, { 255, 0 } };
	struct npy_info info;
	unsigned char p[64];
	char err[512];

	memset(p, ' ', sizeof(p));
	memcpy(p, "\x93NUMPY", 6);
	for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
		p[6] = v[i][0];
		p[7] = v[i][1];
		EXPECT_REFUSED(npy_parse(p, sizeof(p), &info, err, sizeof(err)), err,
			       "unsupported .npy format version");
	}
}

static void set_hlen(unsigned char *p, uint32_t hlen)
{
	for (int i = 0; i < 4; i++)
		p[8 + i] = (unsigned char)(hlen >> (8 * i));
}

TEST(bad_header_lengths)
{
	const char *dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
	const float data[2] = { 0 };
	struct npy_info info;
	unsigned char *p;
	char err[512];
	size_t len;

	p = raw_npy(2, dict, data, sizeof(data), &len);
	ASSERT_NE(NULL, p);
	set_hlen(p, 0xffffffffu);
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "header length", "absurd");
	set_hlen(p, NPY_MAX_HEADER_LEN + 1);
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "absurd");
	set_hlen(p, (uint32_t)len);
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "truncated header");
	/* shorter than the header is: the last byte of the claimed header is no '\n' */
	set_hlen(p, 20);
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "'\\n'");
	set_hlen(p, 0);
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "'\\n'");
	free(p);
}

/* Every proper prefix of valid files (every version, both dtypes) fails cleanly. */
TEST_F(tmpdir, every_truncation)
{
	const char *dicts[2] = { "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
				 "{'descr': '<f2', 'fortran_order': False, 'shape': (3,), }" };
	const float data[6] = { 1, 2, 3, 4, 5, 6 };
	struct npy_array arr;
	struct npy_info info;
	char err[512], path[128];
	unsigned char *p;
	size_t len;

	snprintf(path, sizeof(path), "%s/t.npy", self->path);
	for (int major = 1; major <= 3; major++)
		for (int d = 0; d < 2; d++) {
			p = raw_npy(major, dicts[d], data, d ? 6 : 24, &len);
			ASSERT_NE(NULL, p);
			ASSERT_EQ(0, npy_parse(p, len, &info, err, sizeof(err))) TH_LOG("%s", err);
			for (size_t n = 0; n < len; n++) {
				unsigned char *copy = malloc(n ? n : 1);

				/* an exact-size copy, so that ASan sees any read past the end */
				ASSERT_NE(NULL, copy);
				memcpy(copy, p, n);
				err[0] = '\0';
				ASSERT_EQ(APE_EFORMAT, npy_parse(copy, n, &info, err, sizeof(err)))
					TH_LOG("prefix of %zu bytes", n);
				ASSERT_NE(0, strlen(err));
				free(copy);
				if (major != 1 || d)
					continue;
				ASSERT_EQ(0, write_whole(path, p, n));
				ASSERT_EQ(APE_EFORMAT, npy_load(path, &arr, err, sizeof(err)));
				ASSERT_EQ(0, strncmp(err, path, strlen(path))) TH_LOG("%s", err);
				ASSERT_EQ(NULL, arr.data);
			}
			free(p);
		}
	/* one byte short of the data says how many bytes were expected and found */
	p = raw_npy(1, dicts[0], data, 24, &len);
	ASSERT_NE(NULL, p);
	EXPECT_REFUSED(npy_parse(p, len - 1, &info, err, sizeof(err)), err, "truncated data",
		       "needs 24 bytes", "only 23");
	free(p);
}

TEST(extra_data)
{
	const char *dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
	const float data[3] = { 1, 2, 3 };
	struct npy_info info;
	unsigned char *p;
	char err[512];
	size_t len;

	p = raw_npy(1, dict, data, sizeof(data), &len);
	ASSERT_NE(NULL, p);
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "4 extra bytes");
	free(p);
}

TEST(fortran_order)
{
	struct npy_info info;
	char err[512];

	EXPECT_REFUSED(parse_dict_str("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2)}",
				      16, &info, err, sizeof(err)),
		       err, "Fortran order", "np.ascontiguousarray");
	EXPECT_REFUSED(parse_dict_str("{'descr': '<f4', 'fortran_order': 1, 'shape': (2, 2)}",
				      16, &info, err, sizeof(err)),
		       err, "True or False");
}

TEST(wrong_dtypes)
{
	static const struct {
		const char *descr;
		const char *word;
	} bad[] = {
		{ "'<f8'", "'<f8'" },
		{ "'>f4'", "little-endian" },
		{ "'=f4'", "'=f4'" },
		{ "'|f2'", "'|f2'" },
		{ "'<i4'", "'<i4'" },
		{ "'<c8'", "'<c8'" },
		{ "'f4'", "'f4'" },
		{ "''", "''" },
		{ "5", "string" },
		{ "[('a', '<f4')]", "structured" },
		{ "'<f4 '", "'<f4 '" },
		{ "'\xc3\xa9'", "\\xc3" },
	};
	struct npy_info info;
	char dict[256], err[512];

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		snprintf(dict, sizeof(dict), "{'descr': %s, 'fortran_order': False, 'shape': (1,)}",
			 bad[i].descr);
		EXPECT_REFUSED(parse_dict_str(dict, 4, &info, err, sizeof(err)), err, bad[i].word);
		if (bad[i].descr[0] == '\'' && bad[i].descr[1] != '\'') {
			EXPECT_NE(NULL, strstr(err, "accepted: '<f4' (float32) and '<f2' "
						    "(float16)")) TH_LOG("%s", err);
		}
	}
}

TEST(missing_and_unknown_keys)
{
	static const struct {
		const char *dict;
		const char *word;
	} bad[] = {
		{ "{'fortran_order': False, 'shape': (1,)}", "no 'descr' key" },
		{ "{'descr': '<f4', 'shape': (1,)}", "no 'fortran_order' key" },
		{ "{'descr': '<f4', 'fortran_order': False}", "no 'shape' key" },
		{ "{}", "no 'descr' key" },
		{ "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", "key 'x'" },
		{ "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}",
		  "twice" },
	};
	struct npy_info info;
	char err[512];

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		EXPECT_REFUSED(parse_dict_str(bad[i].dict, 4, &info, err, sizeof(err)), err,
			       bad[i].word);
}

TEST(absurd_shapes)
{
	static const struct {
		const char *shape;
		const char *word;
	} bad[] = {
		{ "(-1, 3)", "negative dimension -1" },
		{ "(4611686018427387904,)", "absurd" }, /* 2^62 floats: 2^64 bytes */
		{ "(4294967296, 4294967296)", "overflows 64 bits" },
		{ "(0, 4294967296, 4294967296)", "overflows 64 bits" },
		{ "(9223372036854775808,)", "too large" },
		{ "(99999999999999999999999,)", "too large" },
		{ "(3)", "(3,)" },
		{ "[3]", "list" },
		{ "3", "tuple" },
		{ "(,)", "integer" },
		{ "(1,,2)", "integer" },
		{ "(1 2)", "',' or ')'" },
		{ "(01,)", "leading zero" },
		{ "(1.5,)", "',' or ')'" },
		{ "(1e3,)", "',' or ')'" },
		{ "(-,)", "integer" },
		{ "(1, 2", "',' or ')'" },
	};
	struct npy_info info;
	char dict[256], err[512];

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		snprintf(dict, sizeof(dict),
			 "{'descr': '<f4', 'fortran_order': False, 'shape': %s}", bad[i].shape);
		EXPECT_REFUSED(parse_dict_str(dict, 4, &info, err, sizeof(err)), err, bad[i].word);
	}
	/* 2^62 half floats fit size_t, but the file does not hold them */
	EXPECT_REFUSED(parse_dict_str("{'descr': '<f2', 'fortran_order': False, "
				      "'shape': (4611686018427387904,)}",
				      4, &info, err, sizeof(err)),
		       err, "truncated data", "needs 9223372036854775808 bytes");
}

TEST(too_many_dims)
{
	char dict[1024], err[512];
	struct npy_info info;
	int n;

	n = snprintf(dict, sizeof(dict), "{'descr': '<f4', 'fortran_order': False, 'shape': (");
	for (int i = 0; i <= NPY_MAX_DIMS; i++)
		n += snprintf(dict + n, sizeof(dict) - (size_t)n, "1, ");
	snprintf(dict + n, sizeof(dict) - (size_t)n, ")}");
	EXPECT_REFUSED(parse_dict_str(dict, 4, &info, err, sizeof(err)), err,
		       "more than 64 dimensions");
}

TEST(garbage_headers)
{
	static const char *const bad[] = {
		"",
		"{",
		"}",
		"[]",
		"descr",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} junk",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)}}",
		"{'descr' '<f4', 'fortran_order': False, 'shape': (1,)}",
		"{'descr': '<f4',, 'fortran_order': False, 'shape': (1,)}",
		"{, 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}",
		"{'descr': '<f4' 'fortran_order': False, 'shape': (1,)}",
		"{'descr': \"<f4', 'fortran_order': False, 'shape': (1,)}",
		"{'descr': '<f4, 'fortran_order': False, 'shape': (1,)}",
		"{'descr': '\\x3cf4', 'fortran_order': False, 'shape': (1,)}",
		"{'descr': '<f4', 'fortran_order': false, 'shape': (1,)}",
		"{'descr': '<f4', 'fortran_order': Falsey, 'shape': (1,)}",
		"{'descr': '<f4', 'fortran_order': None, 'shape': (1,)}",
		"{descr: '<f4', 'fortran_order': False, 'shape': (1,)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)",
		"{'descr': '<f4', 'fortran_order': False, 'shape': ((1,),)}",
		"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)}\x01",
	};
	struct npy_info info;
	char err[512];

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = '\0';
		EXPECT_EQ(APE_EFORMAT, parse_dict_str(bad[i], 4, &info, err, sizeof(err)))
			TH_LOG("%s", bad[i]);
		EXPECT_NE(0, strlen(err));
	}
}

TEST(header_bytes)
{
	static const char good[] = "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)}";
	struct npy_info info;
	unsigned char *p;
	char err[512];
	size_t len, at;

	p = raw_npy(1, good, "\0\0\0\0", 4, &len);
	ASSERT_NE(NULL, p);
	/* NUL and high bytes inside the header are just wrong bytes, never string ends */
	at = 10 + 12;
	p[at] = 0;
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "\\x00");
	p[at] = 0xff;
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "\\xff");
	p[at] = 'f';
	ASSERT_EQ(0, npy_parse(p, len, &info, err, sizeof(err))) TH_LOG("%s", err);
	/* the final '\n' missing */
	p[len - 5] = ' ';
	EXPECT_REFUSED(npy_parse(p, len, &info, err, sizeof(err)), err, "'\\n'");
	free(p);
}

TEST_F(tmpdir, load_errors)
{
	struct npy_array arr;
	char path[160], err[512];

	snprintf(path, sizeof(path), "%s/nosuch.npy", self->path);
	ASSERT_EQ(APE_EIO, npy_load(path, &arr, err, sizeof(err)));
	ASSERT_NE(NULL, strstr(err, path));
	ASSERT_NE(NULL, strstr(err, "No such file"));
	ASSERT_EQ(APE_EIO, npy_load(self->path, &arr, err, sizeof(err)));
	ASSERT_NE(NULL, strstr(err, "not a regular file")) TH_LOG("%s", err);
	ASSERT_EQ(NULL, arr.data);
	npy_free(&arr);
	npy_free(NULL);
}

/* 1-D integer arrays (offsets, positions): '<i8' as it is, '<i4' widened where allowed, the
 * rest refused with the dtype or shape named; the float reader still refuses them. */
TEST_F(tmpdir, int64_arrays)
{
	const int64_t i8[3] = { -5, 0, (int64_t)1 << 40 };
	const int32_t i4[3] = { -7, 0, 2147483647 };
	const float f4[2] = { 1, 2 };
	struct {
		const char *dict;
		const void *data;
		size_t n;
		const char *word; /* NULL: accepted */
	} cases[] = {
		{ "{'descr': '<i8', 'fortran_order': False, 'shape': (3,)}", i8, 24, NULL },
		{ "{'descr': '<i4', 'fortran_order': False, 'shape': (3,)}", i4, 12, NULL },
		{ "{'descr': '<i8', 'fortran_order': False, 'shape': (0,)}", i8, 0, NULL },
		{ "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", f4, 8,
		  "accepted: '<i8' (int64) and '<i4' (int32)" },
		{ "{'descr': '>i8', 'fortran_order': False, 'shape': (3,)}", i8, 24, "little-endian" },
		{ "{'descr': '<u8', 'fortran_order': False, 'shape': (3,)}", i8, 24, "'<u8'" },
		{ "{'descr': '<i8', 'fortran_order': False, 'shape': (3, 1)}", i8, 24, "1-D" },
		{ "{'descr': '<i8', 'fortran_order': False, 'shape': ()}", i8, 8, "1-D" },
		{ "{'descr': '<i8', 'fortran_order': False, 'shape': (4,)}", i8, 24, "truncated" },
	};
	char path[160], err[512];
	struct npy_array arr;
	int64_t *v, n;

	snprintf(path, sizeof(path), "%s/ints.npy", self->path);
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		size_t len;
		unsigned char *p = raw_npy(1, cases[c].dict, cases[c].data, cases[c].n, &len);
		int ret;

		ASSERT_NE(NULL, p);
		ASSERT_EQ(0, write_whole(path, p, len));
		free(p);
		ret = npy_load_int64(path, true, &v, &n, err, sizeof(err));
		if (cases[c].word) {
			EXPECT_EQ(APE_EFORMAT, ret) TH_LOG("%s", cases[c].dict);
			EXPECT_EQ(NULL, v);
			EXPECT_NE(NULL, strstr(err, cases[c].word)) TH_LOG("%s", err);
			EXPECT_NE(NULL, strstr(err, path)) TH_LOG("%s", err);
			continue;
		}
		ASSERT_EQ(0, ret) TH_LOG("%s", err);
		ASSERT_EQ((int64_t)(cases[c].n ? 3 : 0), n);
		for (int64_t i = 0; i < n; i++) {
			EXPECT_EQ(cases[c].data == i8 ? i8[i] : (int64_t)i4[i], v[i]);
		}
		free(v);
		/* '<i4' where only '<i8' is taken; the float reader takes neither */
		if (cases[c].data == i4) {
			EXPECT_EQ(APE_EFORMAT, npy_load_int64(path, false, &v, &n, err, sizeof(err)));
			EXPECT_NE(NULL, strstr(err, "'<i8' (int64)")) TH_LOG("%s", err);
		}
		EXPECT_EQ(APE_EFORMAT, npy_load(path, &arr, err, sizeof(err)));
		EXPECT_NE(NULL, strstr(err, "accepted: '<f4'")) TH_LOG("%s", err);
	}
}

/* Random damage to valid files: the parser answers 0 or APE_EFORMAT, never anything else, and
 * what it accepts is self-consistent. A smoke test; the real fuzzing is libFuzzer's. */
TEST(random_damage)
{
	const int iters = ape_test_slow() ? 2000 : 50000;
	const int64_t shape[3] = { 2, 1, 3 };
	const float data[6] = { 1, 2, 3, 4, 5, 6 };
	static const char syntax[] = "(),: '\"{}0123456789-LTF\n"; /* 24 characters */
	char hdr[4096], err[512];
	struct npy_info info;
	unsigned char buf[512];
	size_t hlen, len0;
	ape_rng rng;

	ape_rng_init(&rng, "random_damage");
	ASSERT_EQ(0, npy_format_header(hdr, sizeof(hdr), APE_F32, 3, shape, 0, &hlen, err,
				       sizeof(err)));
	memcpy(buf, hdr, hlen);
	memcpy(buf + hlen, data, sizeof(data));
	len0 = hlen + sizeof(data);
	for (int it = 0; it < iters; it++) {
		unsigned char copy[512];
		size_t len = len0;
		int edits = (int)ape_rng_range(&rng, 1, 4), ret;

		memcpy(copy, buf, len0);
		for (int e = 0; e < edits; e++) {
			size_t at = (size_t)ape_rng_range(&rng, 0, (int64_t)len - 1);
			int64_t kind = ape_rng_range(&rng, 0, 3);

			if (kind == 0)
				copy[at] = (unsigned char)ape_rng_next(&rng);
			else if (kind == 1)
				copy[at] = (unsigned char)syntax[ape_rng_range(&rng, 0, 23)];
			else if (kind == 2 && len > 1)
				len = at + 1;
			else if (len < sizeof(copy))
				copy[len++] = (unsigned char)ape_rng_next(&rng);
		}
		ret = npy_parse(copy, len, &info, err, sizeof(err));
		ASSERT_TRUE(ret == 0 || ret == APE_EFORMAT);
		if (ret == 0) {
			ASSERT_EQ(len, info.data_offset + info.nbytes);
		}
	}
}

TEST_HARNESS_MAIN
