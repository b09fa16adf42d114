/* SPDX-License-Identifier: MIT */
/*
 * Each rank's own arguments, checked by libape itself before the ranks agree (mpi/mpi_call.h):
 * libape_mpi accepts exactly what ape_attention_forward_ex() and _backward_ex() do.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_call.h"

static int lib_error(int err, const char *what)
{
	return ape__mpi_error(err, "%s: %s: %s", APE__MPI_FN, what, ape_last_error());
}

static int check_shard(const struct call *c, const ape_mpi_shard_info *sh)
{
	ape_mpi_shard_info want;

	if (sh->nranks != c->size)
		return ape__mpi_error(APE_EINVAL,
				      "%s: shard->nranks = %d, but the communicator has %d ranks",
				      APE__MPI_FN, sh->nranks, c->size);
	if (sh->rank != c->rank)
		return ape__mpi_error(APE_EINVAL, "%s: shard->rank = %d, but this is rank %d",
				      APE__MPI_FN, sh->rank, c->rank);
	if (ape_mpi_shard(sh->L, sh->nranks, sh->rank, sh->kind, &want))
		return ape__mpi_error(APE_EINVAL, "%s: shard: %s", APE__MPI_FN,
				      ape_mpi_last_error());
	if (want.nblocks != sh->nblocks || want.rows != sh->rows ||
	    memcmp(want.start, sh->start, sizeof(want.start)) ||
	    memcmp(want.count, sh->count, sizeof(want.count)))
		return ape__mpi_error(APE_EINVAL,
				      "%s: shard: not what ape_mpi_shard(L = %lld, %d, %d, kind %d) "
				      "gives",
				      APE__MPI_FN, (long long)sh->L, sh->nranks, sh->rank,
				      (int)sh->kind);
	return 0;
}

/*
 * Every argument of this rank, checked by libape itself: a call whose positions are made to
 * overflow validates every tensor, stride, type and option and then fails with APE_EOVERFLOW
 * before any work (libape validates everything before it writes); a call with no rows validates
 * every head's parameters. So libape_mpi accepts exactly what ape_attention_forward_ex() does.
 */
int ape__mpi_check_local(struct call *c, const ape_attn_desc *desc, const ape_mpi_shard_info *sh,
			 const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
			 const ape_tensor *o, float *lse, const ape_mpi_stats *stats)
{
	ape_tensor q0, k0, v0, o0;
	ape_attn_desc d;
	uint64_t pairs;
	int ret;

	if (stats && stats->struct_size != sizeof(*stats))
		return ape__mpi_error(APE_EINVAL,
				      "%s: stats->struct_size = %zu: expected %zu (initialise with "
				      "ape_mpi_stats_init())",
				      APE__MPI_FN, stats->struct_size, sizeof(*stats));
	if (!c->devs || (c->ndev == 1 && !c->devs[0]) || !desc || !sh || !q || !k || !v || !o)
		return ape__mpi_error(APE_EINVAL, "%s: %s = NULL", APE__MPI_FN,
				      !c->devs ? "devs" : c->ndev == 1 && !c->devs[0] ? "dev"
				      : !desc ? "desc"
				      : !sh ? "shard" : !q ? "q" : !k ? "k" : !v ? "v" : "o");
	if ((ret = check_shard(c, sh)))
		return ret;
	if (desc->struct_size != sizeof(*desc))
		return ape__mpi_error(APE_EINVAL,
				      "%s: desc->struct_size = %zu: expected %zu (initialise with "
				      "ape_attn_desc_init())",
				      APE__MPI_FN, desc->struct_size, sizeof(*desc));
	if (desc->pos_q || desc->pos_k)
		return ape__mpi_error(APE_EINVAL,
				      "%s: desc->%s = %p: explicit positions are not taken by the "
				      "distributed call (each shard's rows are at its own positions)",
				      APE__MPI_FN, desc->pos_q ? "pos_q" : "pos_k",
				      desc->pos_q ? (const void *)desc->pos_q
						  : (const void *)desc->pos_k);
	if (desc->bias_table || desc->dbias_table)
		return ape__mpi_error(APE_EINVAL,
				      "%s: desc->%s = %p: the distributed call takes no distance-bias "
				      "table yet (its chunk bounds do not count one)",
				      APE__MPI_FN, desc->bias_table ? "bias_table" : "dbias_table",
				      desc->bias_table ? (const void *)desc->bias_table
						       : (const void *)desc->dbias_table);
	c->dglob = *desc;
	c->dglob.q_start_set = true;
	c->dglob.q_start = desc->q_start_set ? desc->q_start : desc->k_start;
	if ((ret = ape_visible_pairs(&c->dglob, 1, 1, sh->L, sh->L, &pairs)))
		return lib_error(ret, "the whole sequence");
	d = c->dglob;
	d.q_start = INT64_MAX;
	d.k_start = INT64_MIN;
	/* (const dropped for the check only: the call fails before it writes anything) */
	ret = ape_attention_forward_ex(c->devs, c->ndev, c->opts, &d, q, k, v, (ape_tensor *)o, lse,
				       NULL);
	if (ret != APE_EOVERFLOW)
		return ret ? lib_error(ret, "this rank's tensors")
			   : ape__mpi_error(APE_EINVAL, "%s: validation ran a call", APE__MPI_FN);
	if (q->shape[2] != sh->rows)
		return ape__mpi_error(APE_EINVAL,
				      "%s: q->shape[2] = %lld, but this rank's shard holds %lld rows",
				      APE__MPI_FN, (long long)q->shape[2], (long long)sh->rows);
	if (k->shape[2] != sh->rows)
		return ape__mpi_error(APE_EINVAL,
				      "%s: k->shape[2] = %lld, but this rank's shard holds %lld rows",
				      APE__MPI_FN, (long long)k->shape[2], (long long)sh->rows);
	if (ape_tensor_rows(q, 0, 0, &q0) || ape_tensor_rows(k, 0, 0, &k0) ||
	    ape_tensor_rows(v, 0, 0, &v0) || ape_tensor_rows(o, 0, 0, &o0))
		return lib_error(APE_EINVAL, "a tensor");
	if ((ret = ape_attention_forward_ex(c->devs, c->ndev, c->opts, &c->dglob, &q0, &k0, &v0,
					    &o0, NULL, NULL)))
		return lib_error(ret, "desc");
	return 0;
}

/*
 * The backward's own arguments, checked by libape: a call on no rows of this rank's tensors
 * validates every type, shape but the length, stride, option and the device's support of the
 * backward (it writes nothing but dparams, here a scratch copy); the lengths are checked here.
 */
int ape__mpi_check_local_bwd(struct call *c, const ape_tensor *q, const ape_tensor *k,
			     const ape_tensor *v, const ape_tensor *o, const float *lse,
			     const ape_tensor *dout, const float *dlse, const struct outputs *out)
{
	const ape_tensor *ts[4] = { dout, out->dq, out->dk, out->dv };
	static const char *const names[4] = { "dout", "dq", "dk", "dv" };
	const ape_tensor *in[8] = { q, k, v, o, dout, out->dq, out->dk, out->dv };
	ape_tensor z[8];
	float one = 0, *scratch;
	int ret;

	if (!lse)
		return ape__mpi_error(APE_EINVAL, "%s: lse = NULL: the backward needs the forward's "
				      "LSE of this rank's rows", APE__MPI_FN);
	if (!dout)
		return ape__mpi_error(APE_EINVAL, "%s: dout = NULL", APE__MPI_FN);
	if (!c->want)
		return ape__mpi_error(APE_EINVAL, "%s: dq, dk, dv and dparams are all NULL: no "
				      "gradient is wanted", APE__MPI_FN);
	for (int i = 0; i < 4; i++)
		if (ts[i] && ts[i]->shape[2] != c->sh->rows)
			return ape__mpi_error(APE_EINVAL,
					      "%s: %s->shape[2] = %lld, but this rank's shard holds "
					      "%lld rows",
					      APE__MPI_FN, names[i], (long long)ts[i]->shape[2],
					      (long long)c->sh->rows);
	for (int i = 0; i < 8; i++)
		if (in[i] && ape_tensor_rows(in[i], 0, 0, &z[i]))
			return ape__mpi_error(APE_EINVAL, "%s: %s: %s", APE__MPI_FN,
					      i < 4 ? "q, k, v or o" : names[i - 4],
					      ape_last_error());
	scratch = malloc((size_t)(4 * q->shape[1]) * sizeof(float));
	if (!scratch)
		return ape__mpi_error(APE_ENOMEM, "%s: out of host memory", APE__MPI_FN);
	ret = ape_attention_backward_ex(c->devs, 1, c->opts, &c->dglob, &z[0], &z[1], &z[2], &z[3],
					&one, &z[4], dlse ? &one : NULL, out->dq ? &z[5] : NULL,
					out->dk ? &z[6] : NULL, out->dv ? &z[7] : NULL,
					out->dparams ? scratch : NULL, NULL);
	free(scratch);
	return ret ? lib_error(ret, "this rank's gradients") : 0;
}
