/* SPDX-License-Identifier: MIT */
/*
 * The ranks agree before anything moves: each contributes its local status (a failed local check
 * and its message) and the fields every rank must share; one allgather gives every rank the same
 * array, so every rank reaches the same verdict and returns the same code and message.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "mpi_internal.h"

enum field_kind { F_INT, F_REAL, F_HEADS };

static const struct {
	const char *name;
	enum field_kind kind;
} fields[] = {
	{ "shard->nranks", F_INT },    { "shard->L", F_INT },
	{ "shard->kind", F_INT },      { "B (q->shape[0])", F_INT },
	{ "H (q->shape[1])", F_INT },  { "Hkv (k->shape[1])", F_INT },
	{ "D (q->shape[3])", F_INT },  { "q->dtype", F_INT },
	{ "o->dtype", F_INT },         { "desc->causal", F_INT },
	{ "desc->layout", F_INT },     { "desc->k_start", F_INT },
	{ "q_start (desc->q_start, or k_start)", F_INT }, { "scale (desc->scale, or 1/sqrt(D))", F_REAL },
	{ "desc->rope_base", F_REAL }, { "desc->skip_tol", F_REAL },
	{ "desc->delta", F_HEADS },    { "desc->beta", F_HEADS },
	{ "desc->gamma", F_HEADS },    { "desc->lambda", F_HEADS },
	{ "the gradients wanted (dq 1, dk 2, dv 4, dparams 8)", F_INT },
	{ "desc->rope_scale", F_REAL },
};
_Static_assert(sizeof(fields) / sizeof(fields[0]) ==
		       sizeof(((struct ape__mpi_digest *)0)->field) / sizeof(int64_t),
	       "one name per digest field");
#define NFIELDS ((int)(sizeof(fields) / sizeof(fields[0])))

static int64_t real_bits(double x)
{
	int64_t b;

	memcpy(&b, &x, sizeof(b));
	return b;
}

/* FNV-1a over the H values a parameter resolves to: one value for all heads and the same value
 * given per head digest alike. */
static int64_t heads_hash(const ape_param *p, int64_t H)
{
	uint64_t h = 1469598103934665603ull;

	for (int64_t i = 0; i < H; i++) {
		float x = p->per_head ? p->per_head[i] : p->value;
		uint32_t b;

		memcpy(&b, &x, sizeof(b));
		for (int j = 0; j < 4; j++) {
			h ^= (b >> (8 * j)) & 0xff;
			h *= 1099511628211ull;
		}
	}
	return (int64_t)h;
}

void ape__mpi_digest_fill(struct ape__mpi_digest *dg, const ape_attn_desc *desc,
			  const ape_mpi_shard_info *sh, const ape_tensor *q, const ape_tensor *k,
			  const ape_tensor *o, int want)
{
	const int64_t H = q->shape[1];
	int64_t *f = dg->field;

	f[0] = sh->nranks;
	f[1] = sh->L;
	f[2] = sh->kind;
	f[3] = q->shape[0];
	f[4] = H;
	f[5] = k->shape[1];
	f[6] = q->shape[3];
	f[7] = q->dtype;
	f[8] = o->dtype;
	f[9] = desc->causal;
	f[10] = desc->layout;
	f[11] = desc->k_start;
	f[12] = desc->q_start_set ? desc->q_start : desc->k_start;
	f[13] = real_bits(desc->scale_set ? desc->scale : 1.0 / sqrt((double)q->shape[3]));
	f[14] = real_bits(desc->rope_base);
	f[15] = real_bits(desc->skip_tol);
	f[16] = heads_hash(&desc->delta, H);
	f[17] = heads_hash(&desc->beta, H);
	f[18] = heads_hash(&desc->gamma, H);
	f[19] = heads_hash(&desc->lambda, H);
	f[20] = want;
	/* a desc of an earlier layout (struct_size) has no rope_scale: 1 */
	f[21] = real_bits(desc->struct_size == sizeof(*desc) ? desc->rope_scale : 1.0);
}

static void show(char *buf, size_t len, int i, int64_t v)
{
	double x;

	if (fields[i].kind == F_REAL) {
		memcpy(&x, &v, sizeof(x));
		snprintf(buf, len, "%.17g", x);
	} else {
		snprintf(buf, len, "%" PRId64, v);
	}
}

/* The rank that differs in field i, and the rank whose value the others share; -1 if none. */
static int odd_one(const struct ape__mpi_digest *all, int n, int i, int *ref)
{
	int first = -1, others_agree = 1;

	for (int r = 1; r < n; r++) {
		if (all[r].field[i] != all[0].field[i] && first < 0)
			first = r;
		if (all[r].field[i] != all[1].field[i])
			others_agree = 0;
	}
	*ref = 0;
	if (first == 1 && n >= 3 && others_agree) { /* rank 0 is the odd one */
		*ref = 1;
		return 0;
	}
	return first;
}

int ape__mpi_verdict(const struct ape__mpi_digest *all, int n)
{
	char a[40], b[40];
	int ref;

	for (int r = 0; r < n; r++) {
		const char *m = all[r].msg;
		const size_t pre = strlen(APE__MPI_FN) + 2;

		if (!all[r].status)
			continue;
		if (!strncmp(m, APE__MPI_FN, pre - 2) && !strncmp(m + pre - 2, ": ", 2))
			m += pre; /* the function is named once, before the rank */
		return ape__mpi_error(all[r].status, "%s: rank %d: %.*s", APE__MPI_FN, r,
				      (int)strnlen(m, APE__MPI_MSG - pre), m);
	}
	for (int i = 0; i < NFIELDS; i++) {
		int odd = odd_one(all, n, i, &ref);

		if (odd < 0)
			continue;
		if (fields[i].kind == F_HEADS)
			return ape__mpi_error(APE_EINVAL,
					      "%s: rank %d: %s differs from rank %d's (the values "
					      "of its heads); every rank must pass the same",
					      APE__MPI_FN, odd, fields[i].name, ref);
		show(a, sizeof(a), i, all[odd].field[i]);
		show(b, sizeof(b), i, all[ref].field[i]);
		return ape__mpi_error(APE_EINVAL,
				      "%s: rank %d: %s = %s, but %s on rank %d; every rank must pass "
				      "the same",
				      APE__MPI_FN, odd, fields[i].name, a, b, ref);
	}
	return 0;
}
