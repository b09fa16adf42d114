/* SPDX-License-Identifier: MIT */
/* Shards, statistics and the error message of libape_mpi. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "mpi_internal.h"

static _Thread_local char msgbuf[768];
_Thread_local const char *ape__mpi_fn = "ape_mpi_attention_forward";

int ape__mpi_error(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msgbuf, sizeof(msgbuf), fmt, ap);
	va_end(ap);
	return err;
}

char *ape__mpi_msgbuf(size_t *cap)
{
	*cap = sizeof(msgbuf);
	return msgbuf;
}

int ape__mpi_fail(int mpi_err, const char *what)
{
	char s[MPI_MAX_ERROR_STRING];
	int len = 0;

	/* MPI_Error_string itself may fail on a broken library: keep a message anyway */
	if (MPI_Error_string(mpi_err, s, &len) != MPI_SUCCESS)
		snprintf(s, sizeof(s), "MPI error %d", mpi_err);
	return ape__mpi_error(APE_EIO, "%s: %s: %s", APE__MPI_FN, what, s);
}

const char *ape_mpi_last_error(void)
{
	return msgbuf;
}

void ape_mpi_stats_init(ape_mpi_stats *st)
{
	if (!st)
		return;
	memset(st, 0, sizeof(*st));
	st->struct_size = sizeof(*st);
}

void ape__mpi_part(int64_t L, int64_t m, int64_t i, int64_t *start, int64_t *count)
{
	const int64_t q = L / m, r = L % m;

	*start = i * q + (i < r ? i : r);
	*count = q + (i < r);
}

int ape_mpi_shard(int64_t L, int nranks, int rank, ape_mpi_shard_kind kind, ape_mpi_shard_info *out)
{
	if (!out)
		return ape__mpi_error(APE_EINVAL, "ape_mpi_shard_info: out = NULL");
	memset(out, 0, sizeof(*out));
	if (L < 0)
		return ape__mpi_error(APE_EINVAL, "ape_mpi_shard_info: L = %lld: must be >= 0",
				      (long long)L);
	if (nranks < 1)
		return ape__mpi_error(APE_EINVAL, "ape_mpi_shard_info: nranks = %d: must be >= 1", nranks);
	if (rank < 0 || rank >= nranks)
		return ape__mpi_error(APE_EINVAL, "ape_mpi_shard_info: rank = %d: must be in [0, %d)",
				      rank, nranks);
	if (kind != APE_MPI_SHARD_CONTIGUOUS && kind != APE_MPI_SHARD_ZIGZAG)
		return ape__mpi_error(APE_EINVAL,
				      "ape_mpi_shard_info: kind = %d: must be APE_MPI_SHARD_CONTIGUOUS "
				      "or APE_MPI_SHARD_ZIGZAG",
				      (int)kind);
	out->L = L;
	out->nranks = nranks;
	out->rank = rank;
	out->kind = kind;
	if (kind == APE_MPI_SHARD_CONTIGUOUS) {
		out->nblocks = 1;
		ape__mpi_part(L, nranks, rank, &out->start[0], &out->count[0]);
		out->start[1] = out->start[0] + out->count[0];
	} else {
		out->nblocks = 2;
		ape__mpi_part(L, 2 * (int64_t)nranks, rank, &out->start[0], &out->count[0]);
		ape__mpi_part(L, 2 * (int64_t)nranks, 2 * (int64_t)nranks - 1 - rank,
			      &out->start[1], &out->count[1]);
	}
	out->rows = out->count[0] + out->count[1];
	return 0;
}
