/* SPDX-License-Identifier: MIT */
/*
 * ape_mpi_attention_forward(): agree, plan, exchange only the needed key rows (non-blocking,
 * overlapped with the local blocks), compute every piece with libape's public
 * ape_attention_forward_ex() and merge the pieces by their LSE (identity 4).
 *
 * ape_mpi_attention_backward(): the same agreement, plan and exchange of key rows; every piece
 * is one ape_attention_backward_ex() with the forward's O and LSE of its rows (so its P_ij are
 * the whole sequence's), dQ summed over the pieces, dK and dV of received rows summed and sent
 * back to their owners, parameter gradients summed in a fixed order (pieces, then ranks).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_call.h"

/* Row i of head (b, h) of t from D floats, converted to t's type. */
static void store_row(ape_tensor *t, const int64_t *s, int64_t b, int64_t h, int64_t i,
		      const float *row, int64_t D)
{
	const size_t es = ape_dtype_size(t->dtype);
	char *p = (char *)t->data + (size_t)(b * s[0] + h * s[1] + i * s[2]) * es;
	uint16_t row16[APE_MAX_D];

	if (t->dtype != APE_F32)
		ape_convert(row16, t->dtype, row, APE_F32, (size_t)D);
	for (int64_t d = 0; d < D; d++)
		memcpy(p + (size_t)(d * s[3]) * es,
		       t->dtype == APE_F32 ? (const void *)(row + d) : (const void *)(row16 + d),
		       es);
}

static void store(const struct call *c, ape_tensor *o, float *lse)
{
	const int64_t D = c->g.D, rows = c->sh->rows;
	int64_t s[4];
	float row[APE_MAX_D];

	ape_tensor_strides(o, s);
	for (int64_t bh = 0; bh < c->g.B * c->g.H; bh++)
		for (int64_t i = 0; i < rows; i++) {
			const int64_t r = bh * rows + i;
			const double m = c->m[r];

			for (int64_t d = 0; d < D; d++)
				row[d] = isnan(m) ? NAN
					 : m == -INFINITY ? 0.0f
							  : (float)(c->acc[r * D + d] / c->s[r]);
			store_row(o, s, bh / c->g.H, bh % c->g.H, i, row, D);
			if (lse)
				lse[r] = isnan(m) || m == -INFINITY ? (float)m
								    : (float)(m + log(c->s[r]));
		}
}

/* A gradient of this rank's rows ([B, nh, rows, D] float64 sums) into t (NULL: not wanted). */
static void store_grad(const struct call *c, ape_tensor *t, const double *g)
{
	const int64_t D = c->g.D, rows = c->sh->rows;
	int64_t s[4];
	float row[APE_MAX_D];

	if (!t)
		return;
	ape_tensor_strides(t, s);
	for (int64_t bh = 0; bh < c->g.B * t->shape[1]; bh++)
		for (int64_t i = 0; i < rows; i++) {
			for (int64_t d = 0; d < D; d++)
				row[d] = (float)g[(bh * rows + i) * D + d];
			store_row(t, s, bh / t->shape[1], bh % t->shape[1], i, row, D);
		}
}

/* Host memory the call needs, sized from this rank's own arguments (before the agreement, so a
 * failure is reported by every rank). */
static int alloc_call(struct call *c, const ape_tensor *q, const ape_tensor *k)
{
	const int64_t B = q->shape[0], H = q->shape[1], Hkv = k->shape[1], D = q->shape[3];
	const int64_t rows = c->sh->rows, nq = c->sh->count[0] > c->sh->count[1]
							? c->sh->count[0] : c->sh->count[1];
	const size_t nr = (size_t)(B * H * rows), nk = (size_t)(B * Hkv * rows);
	bool ok;

	c->lc = malloc((size_t)(B * H * nq) * sizeof(float) + 1);
	c->needs = malloc((size_t)c->size * 4 * sizeof(int64_t));
	c->kall = malloc((size_t)c->size * 2 * (size_t)(B * Hkv) * sizeof(float) + 1);
	c->kglob = malloc((size_t)c->size * 2 * (size_t)(B * Hkv) * sizeof(float) + 1);
	c->prm = malloc((size_t)H * 4 * sizeof(float));
	c->qsum = malloc((size_t)(2 * B * H) * 2 * sizeof(double));
	ok = c->lc && c->needs && c->kall && c->kglob && c->prm && c->qsum;
	if (!c->bwd) {
		c->m = malloc(nr * sizeof(double) + 1);
		c->s = malloc(nr * sizeof(double) + 1);
		c->acc = calloc(nr * (size_t)D + 1, sizeof(float));
		c->oc = malloc((size_t)(B * H * nq * D) * sizeof(float) + 1);
		ok = ok && c->m && c->s && c->acc && c->oc;
	} else {
		/* float64 sums of this rank's gradients, one piece's float32 gradients */
		c->gq = c->want & APE__MPI_WANT_DQ ? calloc(nr * (size_t)D + 1, sizeof(double))
						   : NULL;
		c->gk = c->want & APE__MPI_WANT_DK ? calloc(nk * (size_t)D + 1, sizeof(double))
						   : NULL;
		c->gv = c->want & APE__MPI_WANT_DV ? calloc(nk * (size_t)D + 1, sizeof(double))
						   : NULL;
		c->gp = calloc((size_t)(4 * H), sizeof(double));
		c->pq = malloc((size_t)(B * H * nq * D) * sizeof(float) + 1);
		c->pp = malloc((size_t)(4 * H) * sizeof(float));
		c->pdl = malloc((size_t)(B * H * nq) * sizeof(float) + 1);
		c->pk_rows = nq;
		ok = ok && c->gp && c->pq && c->pp && c->pdl &&
		     (c->gq || !(c->want & APE__MPI_WANT_DQ)) &&
		     (c->gk || !(c->want & APE__MPI_WANT_DK)) &&
		     (c->gv || !(c->want & APE__MPI_WANT_DV));
	}
	if (!ok)
		return ape__mpi_error(APE_ENOMEM, "%s: out of host memory for %lld rows",
				      APE__MPI_FN, (long long)rows);
	for (size_t r = 0; !c->bwd && r < nr; r++) {
		c->m[r] = -INFINITY;
		c->s[r] = 0;
	}
	return 0;
}

static void free_call(struct call *c)
{
	void *p[] = { c->m,  c->s,  c->acc, c->oc, c->lc, c->needs, c->kall, c->kglob, c->prm,
		      c->qsum, c->gq, c->gk, c->gv, c->gp, c->pq, c->pk, c->pv, c->pp, c->pdl };

	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

static float head_value(const ape_param *p, int64_t h)
{
	return p->per_head ? p->per_head[h] : p->value;
}

static bool all_zero(const float *prm, int64_t H)
{
	for (int64_t i = 0; i < 4 * H; i++)
		if (i % 4 != 3 && prm[i] != 0)
			return false;
	return true;
}

static void setup_geom(struct call *c, const ape_tensor *q, const ape_tensor *k)
{
	struct ape__mpi_geom *g = &c->g;
	const ape_attn_desc *d = &c->dglob;
	bool nonneg = true;

	g->L = c->sh->L;
	g->B = q->shape[0];
	g->H = q->shape[1];
	g->Hkv = k->shape[1];
	g->D = q->shape[3];
	g->nranks = c->size;
	g->kind = c->sh->kind;
	g->nblocks = c->sh->kind == APE_MPI_SHARD_ZIGZAG ? 2 * c->size : c->size;
	g->q0 = d->q_start;
	g->k0 = d->k_start;
	g->causal = d->causal;
	g->abs_scale = fabs(d->scale_set ? d->scale : 1.0 / sqrt((double)g->D));
	for (int64_t h = 0; h < g->H; h++) {
		c->prm[4 * h + 0] = head_value(&d->delta, h);
		c->prm[4 * h + 1] = head_value(&d->beta, h);
		c->prm[4 * h + 2] = head_value(&d->gamma, h);
		c->prm[4 * h + 3] = head_value(&d->lambda, h);
		for (int i = 0; i < 3; i++)
			nonneg = nonneg && c->prm[4 * h + i] >= 0;
	}
	g->prm = c->prm;
	g->can_skip = nonneg && d->skip_tol > 0;
	/* the proof needs tol < 1 (docs/distributed.md) */
	g->tol_plan = fmin(d->skip_tol / 2, 0.5);
	c->esize = ape_dtype_size(q->dtype);
	if (nonneg && all_zero(c->prm, g->H)) {
		g->can_skip = false;
		snprintf(c->st.note, sizeof(c->st.note),
			 "full exchange: delta = beta = gamma = 0 in every head, so no key can be "
			 "proved negligible");
	} else if (!(d->skip_tol > 0))
		snprintf(c->st.note, sizeof(c->st.note),
			 "full exchange: skip_tol = 0 (never skip)");
	else if (!nonneg)
		snprintf(c->st.note, sizeof(c->st.note),
			 "full exchange: a head has a negative delta, beta or gamma, so no key "
			 "can be proved negligible");
}

/* The plan: key-norm bounds of every block (one allgather), this rank's needs, everyone's
 * needs (one allgather). */
static int plan(struct call *c, const ape_tensor *q, const ape_tensor *k)
{
	const int64_t nbg = c->g.B * c->g.Hkv, nbh = c->g.B * c->g.H;
	int mret;

	memset(c->kglob, 0, (size_t)c->size * 2 * (size_t)nbg * sizeof(float));
	for (int lb = 0; lb < 2; lb++) {
		float *mine = c->kglob + lb * nbg; /* staging for the allgather */

		if (lb < c->sh->nblocks)
			ape__mpi_key_max(&c->g, k, block_off(c->sh, lb), c->sh->count[lb], mine);
	}
	mret = MPI_Allgather(c->kglob, (int)(2 * nbg), MPI_FLOAT, c->kall, (int)(2 * nbg),
			     MPI_FLOAT, c->comm);
	if (mret != MPI_SUCCESS)
		return ape__mpi_fail(mret, "MPI_Allgather (key-norm bounds)");
	for (int r = 0; r < c->size; r++)
		for (int lb = 0; lb < c->sh->nblocks; lb++)
			memcpy(c->kglob + (int64_t)ape__mpi_block_of(&c->g, r, lb) * nbg,
			       c->kall + ((int64_t)r * 2 + lb) * nbg, (size_t)nbg * sizeof(float));
	memset(c->need, 0, sizeof(c->need));
	for (int lb = 0; lb < c->sh->nblocks; lb++) {
		double *qmax = c->qsum, *lse_lb = c->qsum + nbh;

		ape__mpi_query_summary(&c->g, q, k, block_off(c->sh, lb), c->sh->count[lb], qmax,
				       lse_lb);
		ape__mpi_needed(&c->g, c->kglob, qmax, lse_lb, c->sh->start[lb], c->sh->count[lb],
				&c->need[lb][0], &c->need[lb][1]);
	}
	mret = MPI_Allgather(c->need, 4, MPI_INT64_T, c->needs, 4, MPI_INT64_T, c->comm);
	if (mret != MPI_SUCCESS)
		return ape__mpi_fail(mret, "MPI_Allgather (the rows each rank needs)");
	return 0;
}

static void pairs_visible(struct call *c)
{
	for (int lb = 0; lb < c->sh->nblocks; lb++) {
		ape_attn_desc d = c->dglob;
		uint64_t n = 0;

		d.q_start = c->g.q0 + c->sh->start[lb];
		if (!ape_visible_pairs(&d, c->g.B, c->g.H, c->sh->count[lb], c->g.L, &n))
			c->st.pairs_visible += n;
	}
}

static void note(struct call *c)
{
	ape_mpi_stats *st = &c->st;

	if (st->note[0]) /* set by setup_geom(): skipping was impossible from the start */
		st->full_exchange = true;
	else if (c->vis_remote == 0)
		snprintf(st->note, sizeof(st->note),
			 "no key row of another rank is visible to this rank's rows");
	else if (st->rows_unneeded == 0)
		snprintf(st->note, sizeof(st->note),
			 "full exchange: the skip bound proved none of the %llu visible key rows "
			 "of other ranks negligible",
			 (unsigned long long)c->vis_remote);
	else
		snprintf(st->note, sizeof(st->note),
			 "planned: %llu of %llu visible key rows of other ranks proved negligible",
			 (unsigned long long)st->rows_unneeded, (unsigned long long)c->vis_remote);
	st->full_exchange = st->full_exchange || !strncmp(st->note, "full", 4);
}

/* One allgather of every rank's status: the same verdict everywhere. */
static int agree(struct call *c, struct ape__mpi_digest *mine, struct ape__mpi_digest *all)
{
	int mret = MPI_Allgather(mine, (int)sizeof(*mine), MPI_BYTE, all, (int)sizeof(*mine),
				 MPI_BYTE, c->comm);

	if (mret != MPI_SUCCESS)
		return ape__mpi_fail(mret, "MPI_Allgather (agreement)");
	return ape__mpi_verdict(all, c->size);
}

/* The parameter gradients of the whole sequence: every rank's float64 share, gathered, summed
 * in rank order, the same on every rank (an MPI_Allreduce may sum in any order). */
static int reduce_params(struct call *c, float *dparams)
{
	const int64_t n = 4 * c->g.H;
	double *all = malloc((size_t)(c->size * n) * sizeof(double) + 1);
	int mret;

	if (!all)
		return ape__mpi_error(APE_ENOMEM, "%s: out of host memory", APE__MPI_FN);
	mret = MPI_Allgather(c->gp, (int)n, MPI_DOUBLE, all, (int)n, MPI_DOUBLE, c->comm);
	if (mret != MPI_SUCCESS) {
		free(all);
		return ape__mpi_fail(mret, "MPI_Allgather (parameter gradients)");
	}
	for (int64_t i = 0; i < n; i++) {
		double sum = 0;

		for (int r = 0; r < c->size; r++)
			sum += all[(int64_t)r * n + i];
		dparams[i] = (float)sum;
	}
	free(all);
	return 0;
}

/* Either call: agree, plan, exchange, agree again, write. */
/* A profiler's range around one step of the call (ape_range_push(): NVTX, and APE_TRACE's
 * session trace, one file per rank): "ape_mpi exchange (rank 1 of 4)". */
static void range_push(const struct call *c, const char *step)
{
	char name[160];

	snprintf(name, sizeof(name), "ape_mpi %s (rank %d of %d)", step, c->rank, c->size);
	ape_range_push(name);
}

/* ret, after closing the innermost range */
static int range_pop(int ret)
{
	ape_range_pop();
	return ret;
}

static int run(struct call *c, MPI_Comm comm, const ape_attn_desc *desc,
	       const ape_mpi_shard_info *shard, const ape_tensor *q, const ape_tensor *k,
	       const ape_tensor *v, const ape_tensor *dout, const float *dlse,
	       const struct outputs *out, ape_mpi_stats *stats)
{
	const double t0 = now_ms();
	struct ape__mpi_digest mine, *all = NULL;
	int flag = 0, mret, ret;
	size_t cap;

	c->q = q;
	c->k = k;
	c->sh = shard;
	ape_mpi_stats_init(&c->st);
	if (MPI_Initialized(&flag) != MPI_SUCCESS || !flag)
		return ape__mpi_error(APE_EINVAL, "%s: MPI is not initialised (MPI_Init first)",
				      APE__MPI_FN);
	if (comm == MPI_COMM_NULL)
		return ape__mpi_error(APE_EINVAL, "%s: comm = MPI_COMM_NULL", APE__MPI_FN);
	mret = MPI_Comm_dup(comm, &c->comm);
	if (mret != MPI_SUCCESS)
		return ape__mpi_fail(mret, "MPI_Comm_dup");
	mret = MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
	if (mret == MPI_SUCCESS)
		mret = MPI_Comm_rank(c->comm, &c->rank);
	if (mret == MPI_SUCCESS)
		mret = MPI_Comm_size(c->comm, &c->size);
	if (mret != MPI_SUCCESS) {
		ret = ape__mpi_fail(mret, "setting up the duplicate communicator");
		goto out_comm;
	}
	all = calloc((size_t)c->size, sizeof(*all));
	if (!all) { /* cannot even take part in the agreement: nothing sensible is left */
		ret = ape__mpi_error(APE_ENOMEM, "%s: out of host memory for %d digests",
				     APE__MPI_FN, c->size);
		goto out_comm;
	}
	memset(&mine, 0, sizeof(mine));
	mine.rank = c->rank;
	ret = ape__mpi_check_local(c, desc, shard, q, k, v, c->bwd ? c->o : out->o,
				   c->bwd ? NULL : out->lse, stats);
	if (!ret && c->bwd)
		ret = ape__mpi_check_local_bwd(c, q, k, v, c->o, c->lse, dout, dlse, out);
	if (!ret)
		ret = alloc_call(c, q, k);
	if (ret) {
		mine.status = ret;
		snprintf(mine.msg, sizeof(mine.msg), "%s", ape__mpi_msgbuf(&cap));
	} else {
		ape__mpi_digest_fill(&mine, desc, shard, q, k, c->bwd ? c->o : out->o, c->want);
	}
	range_push(c, c->bwd ? "backward" : "forward");
	range_push(c, "agree");
	if ((ret = range_pop(agree(c, &mine, all))))
		goto out;
	setup_geom(c, q, k);
	range_push(c, "plan");
	if ((ret = range_pop(plan(c, q, k))))
		goto out;
	range_push(c, "exchange and compute");
	if ((ret = range_pop(ape__mpi_exchange(c, k, v))))
		goto out; /* an MPI failure: the exchange cannot be trusted to agree any more */
	/* a local computation may have failed on some rank: agree again before writing */
	memset(&mine, 0, sizeof(mine));
	mine.rank = c->rank;
	mine.status = c->err;
	memcpy(mine.msg, c->msg, sizeof(mine.msg));
	range_push(c, "agree");
	if ((ret = range_pop(agree(c, &mine, all))))
		goto out;
	if (c->bwd && out->dparams) {
		range_push(c, "reduce parameter gradients");
		if ((ret = range_pop(reduce_params(c, out->dparams))))
			goto out;
	}
	if (c->bwd) {
		store_grad(c, out->dq, c->gq);
		store_grad(c, out->dk, c->gk);
		store_grad(c, out->dv, c->gv);
	} else {
		store(c, out->o, out->lse);
	}
	if (stats) {
		pairs_visible(c);
		note(c);
		c->st.total_ms = now_ms() - t0;
		*stats = c->st;
	}
out:
	ape_range_pop(); /* the call's */
	free_call(c);
	free(all);
out_comm:
	MPI_Comm_free(&c->comm);
	return ret;
}

int ape_mpi_attention_forward_ex(MPI_Comm comm, ape_device *const *devs, int ndev,
				 const ape_exec_options *opts, const ape_attn_desc *desc,
				 const ape_mpi_shard_info *shard, const ape_tensor *q,
				 const ape_tensor *k, const ape_tensor *v, ape_tensor *o,
				 float *lse, ape_mpi_stats *stats)
{
	const struct outputs out = { .o = o, .lse = lse };
	struct call c;

	ape__mpi_fn = "ape_mpi_attention_forward";
	memset(&c, 0, sizeof(c));
	c.devs = devs;
	c.ndev = ndev;
	c.opts = opts;
	return run(&c, comm, desc, shard, q, k, v, NULL, NULL, &out, stats);
}

int ape_mpi_attention_forward(MPI_Comm comm, ape_device *dev, const ape_exec_options *opts,
			      const ape_attn_desc *desc, const ape_mpi_shard_info *shard,
			      const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
			      ape_tensor *o, float *lse, ape_mpi_stats *stats)
{
	return ape_mpi_attention_forward_ex(comm, &dev, 1, opts, desc, shard, q, k, v, o, lse,
					    stats);
}

int ape_mpi_attention_backward(MPI_Comm comm, ape_device *dev, const ape_exec_options *opts,
			       const ape_attn_desc *desc, const ape_mpi_shard_info *shard,
			       const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
			       const ape_tensor *o, const float *lse, const ape_tensor *dout,
			       const float *dlse, ape_tensor *dq, ape_tensor *dk, ape_tensor *dv,
			       float *dparams, ape_mpi_stats *stats)
{
	const struct outputs out = { .dq = dq, .dk = dk, .dv = dv, .dparams = dparams };
	struct call c;

	ape__mpi_fn = "ape_mpi_attention_backward";
	memset(&c, 0, sizeof(c));
	c.devs = &dev;
	c.ndev = 1;
	c.opts = opts;
	c.bwd = true;
	c.want = (dq ? APE__MPI_WANT_DQ : 0) | (dk ? APE__MPI_WANT_DK : 0) |
		 (dv ? APE__MPI_WANT_DV : 0) | (dparams ? APE__MPI_WANT_DP : 0);
	c.o = o;
	c.lse = lse;
	c.dout = dout;
	c.dlse = dlse;
	return run(&c, comm, desc, shard, q, k, v, dout, dlse, &out, stats);
}
