/* SPDX-License-Identifier: MIT */
#include "testutil.h"

#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <ftw.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

bool ape_test_slow(void)
{
	const char *e = getenv("APE_TEST_VALGRIND");

	return e && *e && strcmp(e, "0");
}

int test_tensor_empty(test_tensor *tt, ape_dtype dt, int64_t d0, int64_t d1, int64_t d2,
		      int64_t d3)
{
	size_t bytes;

	memset(tt, 0, sizeof(*tt));
	bytes = (size_t)(d0 * d1 * d2 * d3) * ape_dtype_size(dt);
	tt->alloc_bytes = bytes;
	tt->alloc = malloc(bytes ? bytes : 1);
	if (!tt->alloc)
		return -1;
	ape_tensor_init(&tt->t, tt->alloc, dt, d0, d1, d2, d3);
	test_tensor_poison(&tt->t);
	return 0;
}

int test_tensor_random(test_tensor *tt, ape_rng *r, ape_dtype dt, int64_t d0, int64_t d1,
		       int64_t d2, int64_t d3, double sd)
{
	if (test_tensor_empty(tt, dt, d0, d1, d2, d3))
		return -1;
	for (int64_t b = 0; b < d0; b++)
		for (int64_t h = 0; h < d1; h++)
			for (int64_t l = 0; l < d2; l++)
				for (int64_t d = 0; d < d3; d++)
					test_tensor_set(&tt->t, b, h, l, d, sd * ape_rng_normal(r));
	return 0;
}

int test_tensor_relayout(test_tensor *dst, const test_tensor *src, int64_t pad)
{
	const int64_t *s = src->t.shape;
	const int64_t row = s[3] + pad;
	size_t esz = ape_dtype_size(src->t.dtype);
	size_t bytes = (size_t)(s[0] * s[2] * s[1] * row) * esz;

	memset(dst, 0, sizeof(*dst));
	dst->alloc_bytes = bytes;
	dst->alloc = malloc(bytes ? bytes : 1);
	if (!dst->alloc)
		return -1;
	memset(dst->alloc, 0xff, bytes); /* padding: NaN in every type, must never be read */
	dst->t = src->t;
	dst->t.data = dst->alloc;
	dst->t.strides[3] = 1;
	dst->t.strides[1] = row; /* [B, L, H, D + pad] */
	dst->t.strides[2] = s[1] * row;
	dst->t.strides[0] = s[2] * s[1] * row;
	for (int64_t b = 0; b < s[0]; b++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t l = 0; l < s[2]; l++)
				for (int64_t d = 0; d < s[3]; d++)
					test_tensor_set(&dst->t, b, h, l, d,
							test_tensor_get(&src->t, b, h, l, d));
	return 0;
}

void test_tensor_free(test_tensor *tt)
{
	free(tt->alloc);
	memset(tt, 0, sizeof(*tt));
}

static size_t offset(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	int64_t s[4];

	ape_tensor_strides(t, s);
	return (size_t)(b * s[0] + h * s[1] + l * s[2] + d * s[3]);
}

double test_tensor_get(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	size_t i = offset(t, b, h, l, d);
	float f;

	if (t->dtype == APE_F32)
		return ((const float *)t->data)[i];
	ape_convert(&f, APE_F32, (const uint16_t *)t->data + i, t->dtype, 1);
	return f;
}

void test_tensor_set(ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d, double x)
{
	size_t i = offset(t, b, h, l, d);
	float f = (float)x;

	if (t->dtype == APE_F32)
		((float *)t->data)[i] = f;
	else
		ape_convert((uint16_t *)t->data + i, t->dtype, &f, APE_F32, 1);
}

void test_tensor_poison(ape_tensor *t)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					test_tensor_set(t, b, h, l, d, NAN);
}

double test_tensor_maxabs(const ape_tensor *t)
{
	double m = 0;

	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					m = fmax(m, fabs(test_tensor_get(t, b, h, l, d)));
	return m;
}

double test_tol_o(ape_dtype storage)
{
	return storage == APE_F32 ? 1e-4 : storage == APE_F16 ? 5e-3 : 2e-2;
}

ape_exec_options test_chunks(int64_t cq, int64_t ck)
{
	ape_exec_options o;

	ape_exec_options_init(&o);
	o.chunk_q = cq;
	o.chunk_k = ck;
	return o;
}

void test_random_head_params(ape_attn_desc *d, float prm[4][8], int64_t H, ape_rng *r)
{
	for (int64_t h = 0; h < H; h++) {
		prm[0][h] = (float)(0.4 * ape_rng_uniform(r));
		prm[1][h] = (float)(0.04 * ape_rng_uniform(r));
		prm[2][h] = (float)(0.04 * ape_rng_uniform(r));
		prm[3][h] = (float)(0.3 * ape_rng_uniform(r));
	}
	d->delta.per_head = prm[0];
	d->beta.per_head = prm[1];
	d->gamma.per_head = prm[2];
	d->lambda.per_head = prm[3];
}

double test_tol_lse(ape_dtype storage)
{
	return storage == APE_F32 ? 1e-4 : storage == APE_F16 ? 1e-3 : 5e-3;
}

double test_skip_tol_o(double skip_tol)
{
	return skip_tol > 0 ? 2 * skip_tol / (1 + skip_tol) : 0;
}

double test_skip_tol_lse(double skip_tol)
{
	return skip_tol > 0 ? log1p(skip_tol) : 0;
}

static double diff(double a, double b)
{
	if (isnan(a) || isnan(b))
		return INFINITY;
	if (a == b) /* also two infinities of one sign */
		return 0;
	return fabs(a - b);
}

double test_max_err_o(const ape_tensor *a, const ape_tensor *b)
{
	double m = 0;

	for (int64_t i = 0; i < 4; i++)
		if (a->shape[i] != b->shape[i])
			return INFINITY;
	for (int64_t bb = 0; bb < a->shape[0]; bb++)
		for (int64_t h = 0; h < a->shape[1]; h++)
			for (int64_t l = 0; l < a->shape[2]; l++)
				for (int64_t d = 0; d < a->shape[3]; d++)
					m = fmax(m, diff(test_tensor_get(a, bb, h, l, d),
							 test_tensor_get(b, bb, h, l, d)));
	return m;
}

double test_max_err_lse(const float *a, const float *b, size_t n)
{
	double m = 0;

	for (size_t i = 0; i < n; i++)
		m = fmax(m, diff(a[i], b[i]));
	return m;
}

double test_max_rel_err_lse(const float *a, const float *b, size_t n)
{
	double m = 0;

	for (size_t i = 0; i < n; i++)
		m = fmax(m, diff(a[i], b[i]) / fmax(1.0, isfinite(b[i]) ? fabs(b[i]) : 1.0));
	return m;
}

ape_context *test_context(const char *backends)
{
	ape_context_options o;
	ape_context *ctx = NULL;

	ape_context_options_init(&o);
	o.backends = backends;
	o.flags = APE_CONTEXT_POISON_OUTPUTS;
	if (ape_context_create(&ctx, &o))
		fprintf(stderr, "# test_context(%s): %s\n", backends, ape_last_error());
	return ctx;
}

ape_device *test_device(ape_context *ctx, const char *backend)
{
	ape_selection sel;

	if (!ctx || ape_device_select(ctx, backend, 0, &sel)) {
		fprintf(stderr, "# test_device(%s): %s\n", backend, ape_last_error());
		return NULL;
	}
	return sel.device;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	return remove(path);
}

void test_rmtree(const char *dir)
{
	nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
}

int test_count_entries(const char *dir, char *first, size_t firstlen)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int n = 0;

	if (!d)
		return -1;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
			if (!n && first)
				snprintf(first, firstlen, "%s", e->d_name);
			n++;
		}
	closedir(d);
	return n;
}

unsigned char *test_read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	unsigned char *buf = NULL;
	long n;

	if (!f)
		return NULL;
	if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
		buf = malloc((size_t)n + 1);
		if (buf && fread(buf, 1, (size_t)n, f) == (size_t)n) {
			buf[n] = 0;
			if (len)
				*len = (size_t)n;
		} else {
			free(buf);
			buf = NULL;
		}
	}
	fclose(f);
	return buf;
}

/* Reads at most cap - 1 bytes of fd from its start. */
static void read_back(int fd, char *buf, size_t cap)
{
	ssize_t n = pread(fd, buf, cap - 1, 0);

	buf[n > 0 ? n : 0] = '\0';
}

int test_run_tool(const char *tool, const char *const *args, const char *cwd, char *out,
		  size_t outcap, char *err, size_t errcap)
{
	char path[4096], fo_name[] = "/tmp/ape-tool-out-XXXXXX", fe_name[] = "/tmp/ape-tool-err-XXXXXX";
	char *argv[64];
	int n = 0, status = -1, fo, fe;
	pid_t pid;

	snprintf(path, sizeof(path), "%s/bin/%s", APE_BUILD_DIR, tool);
	argv[n++] = path;
	while (*args && n < 63)
		argv[n++] = (char *)*args++;
	argv[n] = NULL;
	fo = mkstemp(fo_name);
	fe = mkstemp(fe_name);
	if (fo < 0 || fe < 0)
		goto out_close;
	unlink(fo_name); /* the descriptors keep them until we are done */
	unlink(fe_name);
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid < 0)
		goto out_close;
	if (pid == 0) {
		if (dup2(fo, 1) < 0 || dup2(fe, 2) < 0 || (cwd && chdir(cwd)))
			_exit(126);
		execv(argv[0], argv);
		_exit(127);
	}
	if (waitpid(pid, &status, 0) != pid) {
		status = -1;
		goto out_close;
	}
	status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	read_back(fo, out, outcap);
	read_back(fe, err, errcap);
out_close:
	if (fo >= 0)
		close(fo);
	if (fe >= 0)
		close(fe);
	return status;
}

ape_tensor test_rows(const ape_tensor *t, int64_t l0, int64_t n)
{
	ape_tensor v;

	if (ape_tensor_rows(t, l0, n, &v)) {
		fprintf(stderr, "test_rows: %s\n", ape_last_error());
		abort();
	}
	return v;
}

/* ---- documentation run as it stands */

int test_write_text(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	int ret;

	if (!f)
		return -1;
	ret = fputs(text, f) < 0 ? -1 : 0;
	return fclose(f) || ret ? -1 : 0;
}

char *test_doc_block(const char *doc, const char *needle)
{
	const char *hit = strstr(doc, needle), *start = NULL, *end;

	for (const char *p = doc; hit && (p = strstr(p, "```sh\n")) && p < hit; p += 6)
		start = p + 6;
	end = start ? strstr(start, "```") : NULL;
	if (!start || !end || end < hit)
		return NULL;
	return strndup(start, (size_t)(end - start));
}

int test_run_script(const char *dir, const char *name, const char *script,
		    const char *const *extra_env)
{
	char sh[4200], log[4200], home[4200], path[4200];
	char *const argv[] = { "sh", sh, NULL };
	char *envp[16] = { path, home };
	posix_spawn_file_actions_t fa;
	int status = -1, ret, n = 2;
	pid_t pid;

	for (; extra_env && *extra_env && n < 15; extra_env++)
		envp[n++] = (char *)*extra_env;
	envp[n] = NULL;
	snprintf(sh, sizeof(sh), "%s/%s.sh", dir, name);
	snprintf(log, sizeof(log), "%s/log", dir);
	snprintf(home, sizeof(home), "HOME=%s", dir);
	snprintf(path, sizeof(path), "PATH=%s", getenv("PATH") ? getenv("PATH") : "/usr/bin:/bin");
	if (test_write_text(sh, script) || posix_spawn_file_actions_init(&fa))
		return -1;
	ret = posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	ret = ret ? ret : posix_spawn_file_actions_adddup2(&fa, 1, 2);
	ret = ret ? ret : posix_spawnp(&pid, "sh", &fa, NULL, argv, envp);
	posix_spawn_file_actions_destroy(&fa);
	if (ret || waitpid(pid, &status, 0) != pid)
		return -1;
	return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

bool test_mapped(const char *name)
{
	FILE *f = fopen("/proc/self/maps", "r"); /* its size is 0 to stat(): read it by lines */
	char line[4096 + 256];
	bool yes = false;

	while (f && !yes && fgets(line, sizeof(line), f))
		yes = strstr(line, name) != NULL;
	if (f)
		fclose(f);
	return yes;
}
