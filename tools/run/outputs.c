/* SPDX-License-Identifier: MIT */
/* ape-run's output files: checked before the run, written together after it, or none at all
 * (tools/run/run.h). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/npy.h"
#include "run/run.h"

/*
 * Refuses an output path that cannot work before any time is spent computing, and so that a
 * rename cannot fail after the other output has been renamed into place: the path must not be a
 * directory, and must lie in an existing directory under a name the system accepts.
 */
static int check_output(const char *flag, const char *path, char *msg, size_t len)
{
	const char *slash = strrchr(path, '/');
	int dirlen = slash ? (int)(slash - path + 1) : 1;
	const char *dir = slash ? path : ".";
	char dirbuf[PATH_MAX];
	struct stat st;

	if (!stat(path, &st)) {
		if (!S_ISDIR(st.st_mode))
			return 0;
		snprintf(msg, len, "%s %s: is a directory", flag, path);
		return RUN_USAGE;
	}
	if (errno != ENOENT) {
		snprintf(msg, len, "%s %s: %s", flag, path, strerror(errno));
		return RUN_USAGE;
	}
	snprintf(dirbuf, sizeof(dirbuf), "%.*s", dirlen, dir);
	if (stat(dirbuf, &st) || !S_ISDIR(st.st_mode)) {
		snprintf(msg, len, "%s %s: directory %.*s does not exist", flag, path, dirlen, dir);
		return RUN_USAGE;
	}
	return 0;
}

/* Every file the run writes, by its option; unused entries have a NULL path. */
#define NOUT 10

static void output_names(const struct run_args *a, const char *flag[NOUT],
			 const char *path[NOUT])
{
	static const char *const flags[NOUT] = { "-o", "--lse", "--entropy", "--mean-distance",
						 "--dq", "--dk", "--dv", "--dparams",
						 "--dbias-table", "--trace" };
	const char *const paths[NOUT] = { a->o, a->lse, a->ent, a->md, a->dq, a->dk, a->dv,
					   a->dparams, a->dbias_table, a->trace };

	for (int i = 0; i < NOUT; i++) {
		flag[i] = flags[i];
		path[i] = paths[i];
	}
}

int run_check_outputs(const struct run_args *a, char *msg, size_t len)
{
	const char *flag[NOUT], *path[NOUT];
	int ret = 0;

	output_names(a, flag, path);
	for (int i = 0; i < NOUT; i++)
		for (int j = i + 1; path[i] && j < NOUT; j++)
			if (path[j] && !strcmp(path[i], path[j])) {
				snprintf(msg, len, "%s and %s both name %s: each output needs a "
					 "file of its own", flag[i], flag[j], path[i]);
				return RUN_USAGE;
			}
	for (int i = 0; !ret && i < NOUT; i++)
		if (path[i])
			ret = check_output(flag[i], path[i], msg, len);
	return ret;
}

/* One .npy output: float32 data, written in `dtype` (float16 rounded once from it). */
struct out_file {
	const char *path;
	ape_dtype dtype;
	int ndim;
	int64_t shape[4];
	const float *data;
	uint64_t count;
};

static void out_like(struct out_file *f, const char *path, const struct input *in,
		     const float *data)
{
	f->path = path;
	f->dtype = in->file_dtype;
	f->ndim = in->ndim;
	memcpy(f->shape, in->shape, sizeof(f->shape));
	f->data = data;
	f->count = in->count;
}

/* Writes f to a temporary file; *conv holds its float16 copy, if any, until the caller frees. */
static int write_pending(struct npy_pending *p, const struct out_file *f, void **conv, char *msg,
			 size_t len)
{
	const void *data = f->data;

	if (f->dtype == APE_F16) {
		*conv = malloc(f->count ? f->count * 2 : 1);
		if (!*conv) {
			snprintf(msg, len, "%s: out of memory", f->path);
			return APE_ENOMEM;
		}
		ape_convert(*conv, APE_F16, f->data, APE_F32, f->count);
		data = *conv;
	}
	return npy_write_pending(p, f->path, f->dtype, f->ndim, f->shape, data, 0, msg, len);
}

/*
 * Writes every output to a temporary file, then renames them all. Should a rename fail despite
 * run_check_outputs(), the outputs already renamed are removed again: O without its LSE, or O
 * without the gradients asked for, would look like the result of a complete run.
 */
static int write_all(struct out_file *f, int n, char *msg, size_t len)
{
	struct npy_pending p[NOUT];
	int ret = 0, i, done;

	memset(p, 0, sizeof(p));
	for (i = 0; !ret && i < n; i++) {
		void *conv = NULL;

		ret = write_pending(&p[i], &f[i], &conv, msg, len);
		free(conv);
	}
	for (done = 0; !ret && done < n; done++)
		ret = npy_commit(&p[done], msg, len);
	if (ret) {
		for (i = 0; i < done - 1; i++) /* p[done - 1] failed: npy_commit() removed it */
			unlink(f[i].path);
		for (i = 0; i < n; i++)
			npy_discard(&p[i]);
	}
	return run_exit_code(ret);
}

/* A per-row output ([B, H, Lq] float32: LSE, the diagnostics) shaped after O's file f0 */
static void out_rows(struct out_file *f, const struct out_file *f0, const char *path,
		     const struct input *q, const float *data)
{
	*f = *f0;
	f->path = path;
	f->dtype = APE_F32;
	f->ndim = q->ndim - 1;
	f->data = data;
	f->count = q->count / (uint64_t)q->t.shape[3];
}

int run_write_outputs(const struct run_args *a, const struct input in[4], const float *o,
		      const float *lse, const float *ent, const float *md, const struct run_grads *g,
		      char *msg, size_t len)
{
	struct out_file f[NOUT];
	int n = 0;

	memset(f, 0, sizeof(f));
	out_like(&f[n++], a->o, &in[0], o);
	if (a->lse)
		out_rows(&f[n++], &f[0], a->lse, &in[0], lse);
	if (a->ent)
		out_rows(&f[n++], &f[0], a->ent, &in[0], ent);
	if (a->md)
		out_rows(&f[n++], &f[0], a->md, &in[0], md);
	if (a->dq)
		out_like(&f[n++], a->dq, &in[0], g->dq);
	if (a->dk)
		out_like(&f[n++], a->dk, &in[1], g->dk);
	if (a->dv)
		out_like(&f[n++], a->dv, &in[2], g->dv);
	if (a->dparams) {
		f[n].path = a->dparams;
		f[n].dtype = APE_F32;
		f[n].ndim = 2;
		f[n].shape[0] = in[0].t.shape[1];
		f[n].shape[1] = 4;
		f[n].data = g->dparams;
		f[n++].count = (uint64_t)in[0].t.shape[1] * 4;
	}
	if (a->dbias_table) {
		f[n].path = a->dbias_table;
		f[n].dtype = APE_F32;
		f[n].ndim = 2;
		f[n].shape[0] = a->table.rows;
		f[n].shape[1] = a->table.len;
		f[n].data = g->dbias;
		f[n++].count = (uint64_t)(a->table.rows * a->table.len);
	}
	return write_all(f, n, msg, len);
}
