/* SPDX-License-Identifier: MIT */
/*
 * ape-run's ragged call: the offsets (--cu-seqlens-q, --cu-seqlens-k: '<i8' or '<i4', S + 1
 * entries from 0 to the packed total, never decreasing) and the positions (--positions-q,
 * --positions-k: '<i8', one a row) read and checked against the packed Q and K, each failure
 * named by its option, file and entry (tools/run/run.h).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/npy.h"
#include "run/run.h"

/* Reads one file of the batch: "FLAG: " before the reader's message (which names the file). */
static int load_ints(const char *flag, const char *path, bool allow_i4, int64_t **vals,
		     int64_t *n, char *msg, size_t len)
{
	char err[1536];
	int ret = npy_load_int64(path, allow_i4, vals, n, err, sizeof(err));

	if (!ret)
		return 0;
	snprintf(msg, len, "%s: %s", flag, err);
	return ret == APE_ENOMEM ? RUN_FAIL : RUN_USAGE;
}

/* S + 1 offsets from 0 to the total rows of `in`, never decreasing. */
static int check_offsets(const char *flag, const char *path, const int64_t *cu, int64_t n,
			 const struct input *in, const char *total, char *msg, size_t len)
{
	const int64_t rows = in->shape[0];

	if (n < 1) {
		snprintf(msg, len, "%s %s: no entries: S sequences need S + 1 offsets (0 alone for "
			 "none)", flag, path);
		return RUN_USAGE;
	}
	if (cu[0] != 0) {
		snprintf(msg, len, "%s %s: entry 0 is %" PRId64 ": the offsets start at 0", flag,
			 path, cu[0]);
		return RUN_USAGE;
	}
	for (int64_t s = 1; s < n; s++)
		if (cu[s] < cu[s - 1]) {
			snprintf(msg, len, "%s %s: entry %" PRId64 " = %" PRId64 " is less than entry "
				 "%" PRId64 " = %" PRId64 ": the offsets must not decrease", flag,
				 path, s, cu[s], s - 1, cu[s - 1]);
			return RUN_USAGE;
		}
	if (cu[n - 1] != rows) {
		snprintf(msg, len, "%s %s: the last entry, %" PRId64 ", differs from %s's %s = %"
			 PRId64 " rows: the offsets end at the packed total", flag, path, cu[n - 1],
			 in->path, total, rows);
		return RUN_USAGE;
	}
	return 0;
}

/* One position per row of `in`. */
static int check_positions(const char *flag, const char *path, int64_t n,
			   const struct input *in, const char *total, char *msg, size_t len)
{
	if (n == in->shape[0])
		return 0;
	snprintf(msg, len, "%s %s: %" PRId64 " positions, but %s has %s = %" PRId64 " rows: one "
		 "position per row", flag, path, n, in->path, total, in->shape[0]);
	return RUN_USAGE;
}

/* One file of the batch and what it is checked against. */
struct batch_file {
	const char *flag, *path; /* path NULL: not given */
	bool offsets; /* S + 1 offsets ('<i4' too), or positions */
	const struct input *in; /* its packed input */
	const char *total; /* the name of in's rows */
	int64_t **vals, n;
};

static int load_file(struct batch_file *f, char *msg, size_t len)
{
	int ret;

	if (!f->path)
		return 0;
	ret = load_ints(f->flag, f->path, f->offsets, f->vals, &f->n, msg, len);
	if (ret)
		return ret;
	if (f->offsets)
		return check_offsets(f->flag, f->path, *f->vals, f->n, f->in, f->total, msg, len);
	return check_positions(f->flag, f->path, f->n, f->in, f->total, msg, len);
}

static int load_batch(const struct run_args *a, const struct input in[4], struct run_ragged *r,
		      char *msg, size_t len)
{
	struct batch_file f[4] = {
		{ "--cu-seqlens-q", a->cu_q, true, &in[0], "total_q", &r->cu_q, 0 },
		{ "--cu-seqlens-k", a->cu_k, true, &in[1], "total_k", &r->cu_k, 0 },
		{ "--positions-q", a->pos_q, false, &in[0], "total_q", &r->pos_q, 0 },
		{ "--positions-k", a->pos_k, false, &in[1], "total_k", &r->pos_k, 0 },
	};
	int ret = 0;

	for (int i = 0; !ret && i < 4; i++) {
		ret = load_file(&f[i], msg, len);
		if (!ret && i == 1 && f[1].n != f[0].n) {
			snprintf(msg, len, "--cu-seqlens-k %s has %" PRId64 " entries (%" PRId64
				 " sequences) and --cu-seqlens-q %s has %" PRId64 " (%" PRId64 "): "
				 "one sequence count for both", a->cu_k, f[1].n, f[1].n - 1, a->cu_q,
				 f[0].n, f[0].n - 1);
			ret = RUN_USAGE;
		}
	}
	r->vl.num_seqs = f[0].n - 1;
	return ret;
}

int run_load_ragged(const struct run_args *a, const struct input in[4], struct run_ragged *r,
		    char *msg, size_t len)
{
	int ret;

	memset(r, 0, sizeof(*r));
	ape_varlen_init(&r->vl);
	if (!a->cu_q)
		return 0;
	ret = load_batch(a, in, r, msg, len);
	if (ret)
		return ret;
	r->vl.cu_seqlens_q = r->cu_q;
	r->vl.cu_seqlens_k = r->cu_k;
	r->vl.pos_q = r->pos_q;
	r->vl.pos_k = r->pos_k;
	return 0;
}

void run_ragged_free(struct run_ragged *r)
{
	free(r->cu_q);
	free(r->cu_k);
	free(r->pos_q);
	free(r->pos_k);
	memset(r, 0, sizeof(*r));
}
