/* SPDX-License-Identifier: MIT */
/*
 * ape-mpi-run: drives ape_mpi_attention_forward() under mpirun, for the tests and the
 * measurements (ape-run --mpi and ape-bench --mpi come later). Inputs are generated from a
 * counter-based hash of (seed, tensor, b, h, global row, d), so every rank makes its own rows and
 * the same sequence whatever the rank count. With --check each rank also runs its rows as one
 * single-process ape_attention_forward() over the whole sequence and compares.
 *
 *   mpirun -np 4 ape-mpi-run -L 262144 -H 2 -D 64 --shard zigzag          # the target run
 *   mpirun -np 3 ape-mpi-run --suite 20                                    # the tests' suite
 *   mpirun -np 4 ape-mpi-run -L 64 --check --corrupt delta --corrupt-rank 2
 *
 * Rank 0 prints one line per rank (gathered, so lines never interleave): rank=R ret=NAME and
 * key=value statistics, and for --suite one line per case and a total.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape/ape_mpi.h"
#include "common/cli.h"
#include "mpi_files.h"

#define LINE 1024

struct cfg {
	int64_t L, B, H, Hkv, D;
	ape_dtype dt, odt;
	ape_mpi_shard_kind kind;
	bool causal, per_head, strided, check;
	bool backward, with_dlse; /* --backward: the distributed backward after the forward */
	int ndev; /* devices per rank: the selected one, ndev times */
	int64_t chunk; /* --chunk: opts->chunk_q and chunk_k (0: libape's default) */
	double delta, beta, gamma, lambda, skip_tol;
	bool q_start_set;
	int64_t q_start, k_start;
	uint64_t seed;
	const char *what;
};

struct run {
	ape_mpi_shard_info sh;
	void *q, *k, *v, *o;
	float *lse, *params;
	ape_tensor tq, tk, tv, to;
	ape_attn_desc desc;
};

static int rank, nranks;
static int last_ret; /* the last case's return code (the same on every rank) */
static bool bench; /* run as ape-bench --mpi */

/* ---------------------------------------------------------------- inputs */

static uint64_t mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* N(0, 1) for element (b, h, l, d) of tensor t: the same on every rank for a global row l. */
static float gen(uint64_t seed, int t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	uint64_t x = mix(seed ^ mix((uint64_t)t << 56 ^ (uint64_t)b << 48 ^ (uint64_t)h << 36 ^
				    (uint64_t)d << 26 ^ mix((uint64_t)l)));
	double u1 = ((x >> 11) + 0.5) / 9007199254740992.0, u2 = (mix(x) >> 11) / 9007199254740992.0;

	return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

static int64_t global_row(const ape_mpi_shard_info *sh, int64_t i)
{
	return i < sh->count[0] ? sh->start[0] + i : sh->start[1] + (i - sh->count[0]);
}

/* Element (b, h, l, d) of t as a double, through its strides and type. */
static double get(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	int64_t s[4];
	size_t es = ape_dtype_size(t->dtype);
	const char *p;
	float f;

	ape_tensor_strides(t, s);
	p = (const char *)t->data + (size_t)(b * s[0] + h * s[1] + l * s[2] + d * s[3]) * es;
	ape_convert(&f, APE_F32, p, t->dtype, 1);
	return f;
}

static void set(ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d, float x)
{
	int64_t s[4];
	size_t es = ape_dtype_size(t->dtype);

	ape_tensor_strides(t, s);
	ape_convert((char *)t->data + (size_t)(b * s[0] + h * s[1] + l * s[2] + d * s[3]) * es,
		    t->dtype, &x, APE_F32, 1);
}

/* [B, H, L, D], or stored as [B, L, H, D] when strided; NULL data for no memory. */
static void *alloc_tensor(ape_tensor *t, ape_dtype dt, int64_t B, int64_t H, int64_t L, int64_t D,
			  bool strided)
{
	void *p = calloc((size_t)(B * H * L * D) + 1, ape_dtype_size(dt));

	ape_tensor_init(t, p, dt, B, H, L, D);
	if (strided) {
		t->strides[0] = L * H * D;
		t->strides[1] = D;
		t->strides[2] = H * D;
		t->strides[3] = 1;
	}
	return p;
}

static void fill(const struct cfg *c, ape_tensor *t, int id, const ape_mpi_shard_info *sh)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t i = 0; i < t->shape[2]; i++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					set(t, b, h, i, d,
					    gen(c->seed, id, b, h, sh ? global_row(sh, i) : i, d));
}

static void set_param(ape_param *p, float *store, double x, int64_t H, bool per_head)
{
	p->value = (float)x;
	p->per_head = NULL;
	if (!per_head)
		return;
	for (int64_t h = 0; h < H; h++)
		store[h] = (float)(x * (1 + 0.25 * h)); /* a different value per head */
	p->per_head = store;
}

static int setup(const struct cfg *c, struct run *r)
{
	ape_attn_desc *d = &r->desc;
	int ret;

	memset(r, 0, sizeof(*r));
	if ((ret = ape_mpi_shard(c->L, nranks, rank, c->kind, &r->sh)))
		return ret;
	r->q = alloc_tensor(&r->tq, c->dt, c->B, c->H, r->sh.rows, c->D, c->strided);
	r->k = alloc_tensor(&r->tk, c->dt, c->B, c->Hkv, r->sh.rows, c->D, c->strided);
	r->v = alloc_tensor(&r->tv, c->dt, c->B, c->Hkv, r->sh.rows, c->D, c->strided);
	r->o = alloc_tensor(&r->to, c->odt, c->B, c->H, r->sh.rows, c->D, c->strided);
	r->lse = calloc((size_t)(c->B * c->H * r->sh.rows) + 1, sizeof(float));
	r->params = calloc((size_t)(4 * c->H), sizeof(float));
	if (!r->q || !r->k || !r->v || !r->o || !r->lse || !r->params)
		return APE_ENOMEM;
	fill(c, &r->tq, 0, &r->sh);
	fill(c, &r->tk, 1, &r->sh);
	fill(c, &r->tv, 2, &r->sh);
	ape_attn_desc_init(d);
	set_param(&d->delta, r->params, c->delta, c->H, c->per_head);
	set_param(&d->beta, r->params + c->H, c->beta, c->H, c->per_head);
	set_param(&d->gamma, r->params + 2 * c->H, c->gamma, c->H, c->per_head);
	set_param(&d->lambda, r->params + 3 * c->H, c->lambda, c->H, c->per_head);
	d->causal = c->causal;
	d->skip_tol = c->skip_tol;
	d->k_start = c->k_start;
	d->q_start_set = c->q_start_set;
	d->q_start = c->q_start;
	return 0;
}

static void teardown(struct run *r)
{
	free(r->q);
	free(r->k);
	free(r->v);
	free(r->o);
	free(r->lse);
	free(r->params);
}

/* ---------------------------------------------------------------- the check */

static double tol_o(ape_dtype dt)
{
	return dt == APE_F32 ? 1e-4 : dt == APE_F16 ? 5e-3 : 2e-2;
}

static double tol_lse(ape_dtype dt)
{
	return dt == APE_F32 ? 1e-4 : dt == APE_F16 ? 1e-3 : 5e-3;
}

/*
 * This rank's rows as one single-process call over the whole sequence computes them (each block
 * of rows with its own q_start), against the distributed result. err_o in units of the spec's
 * tolerance times max|V|; err_lse in units of its tolerance times max(1, |LSE|): pass <= 1.
 */
static int check(const struct cfg *c, struct run *r, ape_device *dev, double *err_o,
		 double *err_lse)
{
	ape_tensor K, V, o1;
	void *kb, *vb, *ob = NULL;
	float *l1 = NULL;
	double M = 0;
	int ret = APE_ENOMEM;

	*err_o = *err_lse = 0;
	kb = alloc_tensor(&K, c->dt, c->B, c->Hkv, c->L, c->D, false);
	vb = alloc_tensor(&V, c->dt, c->B, c->Hkv, c->L, c->D, false);
	if (!kb || !vb)
		goto out;
	fill(c, &K, 1, NULL);
	fill(c, &V, 2, NULL);
	for (int64_t i = 0; i < c->B * c->Hkv * c->L * c->D; i++)
		M = fmax(M, fabs(get(&V, 0, 0, 0, i)));
	for (int lb = 0; lb < r->sh.nblocks; lb++) {
		const int64_t n = r->sh.count[lb], off = lb ? r->sh.count[0] : 0;
		ape_attn_desc d = r->desc;
		ape_tensor qv;

		if (n == 0)
			continue;
		free(ob);
		free(l1);
		ob = alloc_tensor(&o1, c->odt, c->B, c->H, n, c->D, false);
		l1 = calloc((size_t)(c->B * c->H * n), sizeof(float));
		ret = APE_ENOMEM;
		if (!ob || !l1)
			goto out;
		d.q_start_set = true;
		d.q_start = (c->q_start_set ? c->q_start : c->k_start) + r->sh.start[lb];
		ape_tensor_rows(&r->tq, off, n, &qv);
		if ((ret = ape_attention_forward(dev, &d, &qv, &K, &V, &o1, l1, NULL)))
			goto out;
		for (int64_t b = 0; b < c->B; b++)
			for (int64_t h = 0; h < c->H; h++)
				for (int64_t i = 0; i < n; i++) {
					double a = l1[(b * c->H + h) * n + i];
					double z = r->lse[(b * c->H + h) * r->sh.rows + off + i];
					double e = a == z ? 0 : fabs(a - z); /* two -inf agree */

					e = e == e ? e : INFINITY;
					*err_lse = fmax(*err_lse,
							e / (tol_lse(c->dt) * fmax(1, fabs(a))));
					for (int64_t dd = 0; dd < c->D; dd++) {
						e = fabs(get(&o1, b, h, i, dd) -
							 get(&r->to, b, h, off + i, dd));
						e = e == e ? e : INFINITY;
						*err_o = fmax(*err_o,
							      e / (tol_o(c->dt) * fmax(M, 1e-30)));
					}
				}
	}
	ret = 0;
out:
	free(kb);
	free(vb);
	free(ob);
	free(l1);
	return ret;
}

/* ---------------------------------------------------------------- the backward */

static double tol_grad(ape_dtype dt) /* APE-SPEC.md, "Gradients" */
{
	return dt == APE_F32 ? 1e-3 : dt == APE_F16 ? 1e-2 : 5e-2;
}

struct grads {
	void *dout, *dq, *dk, *dv;
	ape_tensor tdout, tdq, tdk, tdv;
	float *dlse, *dp, *dp_all;
	/* the single-process reference over the whole sequence (with --check) */
	void *rq, *rk, *rv, *ro, *rdout;
	ape_tensor trq, trk, trv, tro, trdout, tgq, tgk, tgv;
	float *rlse, *rdlse, *gq, *gk, *gv, rdp[4 * 64];
};

static void grads_free(struct grads *g)
{
	void *p[] = { g->dout, g->dq, g->dk, g->dv, g->dlse, g->dp, g->dp_all, g->rq, g->rk,
		      g->rv, g->ro, g->rdout, g->rlse, g->rdlse, g->gq, g->gk, g->gv };

	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		free(p[i]);
}

/* dL/dLSE of (b, h, global row l): the same on every rank. */
static float gen_dlse(const struct cfg *c, int64_t b, int64_t h, int64_t l)
{
	return 0.5f * gen(c->seed, 4, b, h, l, 0);
}

/*
 * The single-process forward and backward over the whole sequence; this rank's rows of the
 * reference O and LSE replace the distributed forward's, so that the distributed backward is
 * compared with the single-process one on the same inputs.
 */
static int reference(const struct cfg *c, struct run *r, ape_device *dev, struct grads *g)
{
	const int64_t B = c->B, H = c->H, L = c->L, rows = r->sh.rows;
	int ret;

	g->rq = alloc_tensor(&g->trq, c->dt, B, H, L, c->D, false);
	g->rk = alloc_tensor(&g->trk, c->dt, B, c->Hkv, L, c->D, false);
	g->rv = alloc_tensor(&g->trv, c->dt, B, c->Hkv, L, c->D, false);
	g->ro = alloc_tensor(&g->tro, c->odt, B, H, L, c->D, false);
	g->rdout = alloc_tensor(&g->trdout, c->dt, B, H, L, c->D, false);
	g->gq = alloc_tensor(&g->tgq, APE_F32, B, H, L, c->D, false);
	g->gk = alloc_tensor(&g->tgk, APE_F32, B, c->Hkv, L, c->D, false);
	g->gv = alloc_tensor(&g->tgv, APE_F32, B, c->Hkv, L, c->D, false);
	g->rlse = calloc((size_t)(B * H * L) + 1, sizeof(float));
	g->rdlse = calloc((size_t)(B * H * L) + 1, sizeof(float));
	if (!g->rq || !g->rk || !g->rv || !g->ro || !g->rdout || !g->gq || !g->gk || !g->gv ||
	    !g->rlse || !g->rdlse || H > 64)
		return APE_ENOMEM;
	fill(c, &g->trq, 0, NULL);
	fill(c, &g->trk, 1, NULL);
	fill(c, &g->trv, 2, NULL);
	fill(c, &g->trdout, 3, NULL);
	for (int64_t bh = 0; bh < B * H; bh++)
		for (int64_t l = 0; l < L; l++)
			g->rdlse[bh * L + l] = gen_dlse(c, bh / H, bh % H, l);
	if ((ret = ape_attention_forward(dev, &r->desc, &g->trq, &g->trk, &g->trv, &g->tro, g->rlse,
					 NULL)) ||
	    (ret = ape_attention_backward(dev, &r->desc, &g->trq, &g->trk, &g->trv, &g->tro,
					  g->rlse, &g->trdout, c->with_dlse ? g->rdlse : NULL,
					  &g->tgq, &g->tgk, &g->tgv, g->rdp, NULL)))
		return ret;
	for (int64_t b = 0; b < B; b++)
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = 0; i < rows; i++) {
				const int64_t l = global_row(&r->sh, i);

				r->lse[(b * H + h) * rows + i] = g->rlse[(b * H + h) * L + l];
				for (int64_t d = 0; d < c->D; d++)
					set(&r->to, b, h, i, d, (float)get(&g->tro, b, h, l, d));
			}
	return 0;
}

/* max |this rank's rows of t - the reference's| in units of tol * max|reference| */
static double grad_err(const struct cfg *c, const struct run *r, const ape_tensor *t,
		       const ape_tensor *ref)
{
	double M = 0, e = 0;

	for (int64_t b = 0; b < ref->shape[0]; b++)
		for (int64_t h = 0; h < ref->shape[1]; h++)
			for (int64_t l = 0; l < ref->shape[2]; l++)
				for (int64_t d = 0; d < c->D; d++)
					M = fmax(M, fabs(get(ref, b, h, l, d)));
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t i = 0; i < t->shape[2]; i++)
				for (int64_t d = 0; d < c->D; d++) {
					double x = fabs(get(t, b, h, i, d) -
							get(ref, b, h, global_row(&r->sh, i), d));

					x = x == x ? x : INFINITY;
					e = fmax(e, x == 0 ? 0 : x / (tol_grad(c->dt) * fmax(M, 1e-30)));
				}
	return e;
}

/* Each head's parameter gradients against the reference's, in units of tol * the largest of
 * that head's four. */
static double params_err(const struct cfg *c, const float *dp, const float *ref)
{
	double e = 0;

	for (int64_t h = 0; h < c->H; h++) {
		double M = 0;

		for (int p = 0; p < 4; p++)
			M = fmax(M, fabs(ref[4 * h + p]));
		for (int p = 0; p < 4; p++) {
			double x = fabs((double)dp[4 * h + p] - ref[4 * h + p]);

			x = x == x ? x : INFINITY;
			e = fmax(e, x == 0 ? 0 : x / (tol_grad(c->dt) * fmax(M, 1e-30)));
		}
	}
	return e;
}

/* The distributed backward of this rank's rows after its forward; err[0..3]: dq, dk, dv,
 * dparams against the reference (with --check); *same: dparams bit-identical on every rank;
 * *hash: FNV-1a of dparams' bytes (two runs compare it). */
static int backward_case(const struct cfg *c, struct run *r, ape_device *dev,
			 const ape_exec_options *eo, const char *corrupt_what, ape_mpi_stats *st,
			 double err[4], int *same, uint64_t *hash)
{
	const int64_t B = c->B, H = c->H, rows = r->sh.rows;
	struct grads g;
	bool no_dk = corrupt_what && !strcmp(corrupt_what, "bwd-want");
	int ret = APE_ENOMEM, mret;

	memset(&g, 0, sizeof(g));
	*same = 0;
	g.dout = alloc_tensor(&g.tdout, c->dt, B, H, rows, c->D, c->strided);
	g.dq = alloc_tensor(&g.tdq, c->odt, B, H, rows, c->D, c->strided);
	g.dk = alloc_tensor(&g.tdk, c->odt, B, c->Hkv, rows, c->D, c->strided);
	g.dv = alloc_tensor(&g.tdv, c->odt, B, c->Hkv, rows, c->D, c->strided);
	g.dlse = calloc((size_t)(B * H * rows) + 1, sizeof(float));
	g.dp = calloc((size_t)(4 * H), sizeof(float));
	g.dp_all = calloc((size_t)(4 * H * nranks), sizeof(float));
	if (!g.dout || !g.dq || !g.dk || !g.dv || !g.dlse || !g.dp || !g.dp_all)
		goto out;
	fill(c, &g.tdout, 3, &r->sh);
	for (int64_t bh = 0; bh < B * H; bh++)
		for (int64_t i = 0; i < rows; i++)
			g.dlse[bh * rows + i] = gen_dlse(c, bh / H, bh % H, global_row(&r->sh, i));
	if (c->check && (ret = reference(c, r, dev, &g)))
		goto out;
	if (corrupt_what && !strcmp(corrupt_what, "bwd-delta"))
		r->desc.delta.value += 0.25f;
	if (corrupt_what && !strcmp(corrupt_what, "bwd-dout"))
		g.tdout.strides[3] = -1;
	ape_mpi_stats_init(st);
	ret = ape_mpi_attention_backward(MPI_COMM_WORLD, dev, eo, &r->desc, &r->sh, &r->tq, &r->tk,
					 &r->tv, &r->to, r->lse, &g.tdout,
					 c->with_dlse ? g.dlse : NULL, &g.tdq, no_dk ? NULL : &g.tdk,
					 &g.tdv, g.dp, st);
	/* dparams on every rank, bit for bit */
	mret = MPI_Allgather(g.dp, (int)(4 * H), MPI_FLOAT, g.dp_all, (int)(4 * H), MPI_FLOAT,
			     MPI_COMM_WORLD);
	*same = mret == MPI_SUCCESS;
	for (int q = 0; q < nranks && *same; q++)
		*same = !memcmp(g.dp_all, g.dp_all + 4 * H * q, (size_t)(4 * H) * sizeof(float));
	*hash = 1469598103934665603ull;
	for (size_t i = 0; i < (size_t)(4 * H) * sizeof(float); i++)
		*hash = (*hash ^ ((const unsigned char *)g.dp)[i]) * 1099511628211ull;
	if (!ret && c->check) {
		err[0] = grad_err(c, r, &g.tdq, &g.tgq);
		err[1] = grad_err(c, r, &g.tdk, &g.tgk);
		err[2] = grad_err(c, r, &g.tdv, &g.tgv);
		err[3] = params_err(c, g.dp, g.rdp);
	}
out:
	grads_free(&g);
	return ret;
}

/* ---------------------------------------------------------------- one run */

static void corrupt(const char *what, struct run *r)
{
	static const int64_t bad[4] = { 1, 1, -1, 1 };

	if (!strcmp(what, "delta"))
		r->desc.delta.value += 0.25f;
	else if (!strcmp(what, "causal"))
		r->desc.causal = !r->desc.causal;
	else if (!strcmp(what, "k_start"))
		r->desc.k_start += 1;
	else if (!strcmp(what, "kind"))
		ape_mpi_shard(r->sh.L, nranks, rank, !r->sh.kind, &r->sh);
	else if (!strcmp(what, "rank"))
		r->sh.rank = (rank + 1) % nranks;
	else if (!strcmp(what, "stride"))
		memcpy(r->tk.strides, bad, sizeof(bad));
	else if (!strcmp(what, "null"))
		r->tq.data = NULL;
	else if (!strcmp(what, "L"))
		r->sh.L += 1;
}

static void describe(const struct cfg *c, char *buf, size_t len)
{
	snprintf(buf, len,
		 "%s L=%" PRId64 " B=%" PRId64 " H=%" PRId64 " Hkv=%" PRId64 " D=%" PRId64
		 " %s->%s %s %s delta=%g%s%s q_start=%s%" PRId64 " k_start=%" PRId64 "%s%s ndev=%d chunk=%" PRId64,
		 c->what ? c->what : "", c->L, c->B, c->H, c->Hkv, c->D, ape_dtype_name(c->dt),
		 ape_dtype_name(c->odt), c->kind ? "zigzag" : "contiguous",
		 c->causal ? "causal" : "non-causal", c->delta, c->per_head ? " per-head" : "",
		 c->strided ? " strided" : "", c->q_start_set ? "" : "default:",
		 c->q_start_set ? c->q_start : c->k_start, c->k_start, c->backward ? " backward" : "",
		 c->backward && c->with_dlse ? " dlse" : "", c->ndev, c->chunk);
}

/* Runs one case on every rank; rank 0 prints every rank's line. Returns 1 when the case passed
 * on every rank (ret 0, within tolerance when checked), 0 otherwise. */
static int run_case(const struct cfg *c, ape_device *dev, const char *corrupt_what,
		    int corrupt_rank, bool print_ranks)
{
	char line[LINE], *all = NULL, desc[256];
	struct run r;
	ape_mpi_stats st;
	ape_exec_options eo;
	double err_o = 0, err_lse = 0, err_g[4] = { 0, 0, 0, 0 };
	int ret, ok, all_ok, same = 1;
	uint64_t hash = 0;
	ape_device *devs[8];
	const char *mine = corrupt_what && rank == corrupt_rank ? corrupt_what : NULL;

	for (int i = 0; i < 8; i++)
		devs[i] = dev;

	ret = setup(c, &r);
	if (!ret && corrupt_what && rank == corrupt_rank)
		corrupt(corrupt_what, &r);
	ape_mpi_stats_init(&st);
	/* a budget too small for any chunk: the rank's arguments are valid, its computation fails */
	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = c->chunk;
	if (corrupt_what && rank == corrupt_rank && !strcmp(corrupt_what, "budget"))
		eo.max_device_bytes = 1000;
	if (!ret && c->ndev > 1)
		ret = ape_mpi_attention_forward_ex(MPI_COMM_WORLD, devs, c->ndev, &eo, &r.desc,
						   &r.sh, &r.tq, &r.tk, &r.tv, &r.to, r.lse, &st);
	else if (!ret)
		ret = ape_mpi_attention_forward(MPI_COMM_WORLD, dev, &eo, &r.desc, &r.sh, &r.tq,
						&r.tk, &r.tv, &r.to, r.lse, &st);
	last_ret = ret;
	ok = ret == 0;
	if (ok && c->check) {
		int cr = check(c, &r, dev, &err_o, &err_lse);

		ok = !cr && err_o <= 1 && err_lse <= 1;
	}
	/* every rank that got here calls the backward (a collective), after a forward that
	 * succeeded everywhere (ret is the same on every rank) */
	if (!ret && c->backward) {
		ret = backward_case(c, &r, dev, &eo, mine, &st, err_g, &same, &hash);
		last_ret = ret;
		ok = ok && !ret && same && (!c->check || (err_g[0] <= 1 && err_g[1] <= 1 &&
							  err_g[2] <= 1 && err_g[3] <= 1));
	}
	snprintf(line, sizeof(line),
		 "rank=%d rows=%" PRId64 " ret=%s ok=%d err_o=%.3g err_lse=%.3g bytes_sent=%" PRIu64
		 " bytes_received=%" PRIu64 " messages_sent=%" PRIu64 " messages_received=%" PRIu64
		 " blocks_sent=%" PRIu64 " rows_sent=%" PRIu64 " blocks_received=%" PRIu64
		 " blocks_unneeded=%" PRIu64 " rows_unneeded=%" PRIu64 " peers=%d full_exchange=%d"
		 " local_calls=%" PRIu64 " pairs_visible=%" PRIu64 " pairs_computed=%" PRIu64
		 " grad_bytes_sent=%" PRIu64 " grad_bytes_received=%" PRIu64 " err_dq=%.3g"
		 " err_dk=%.3g err_dv=%.3g err_dp=%.3g dp_same=%d dp_hash=%" PRIu64
		 " total_ms=%.1f wait_ms=%.1f note=\"%s\" msg=\"%s\"",
		 rank, r.sh.rows, ape_err_name(ret), ok, err_o, err_lse, st.bytes_sent, st.bytes_received,
		 st.messages_sent, st.messages_received, st.blocks_sent, st.rows_sent,
		 st.blocks_received, st.blocks_unneeded, st.rows_unneeded, st.peers,
		 st.full_exchange, st.local_calls, st.pairs_visible, st.pairs_computed,
		 st.grad_bytes_sent, st.grad_bytes_received, err_g[0], err_g[1], err_g[2], err_g[3],
		 same, hash, st.total_ms,
		 st.wait_ms, st.note, ret ? ape_mpi_last_error() : "");
	teardown(&r);
	if (bench && ret) /* every rank says why (the same message on every rank) */
		fprintf(stderr, "ape-bench --mpi: rank %d: %s\n", rank, ape_mpi_last_error());
	if (rank == 0)
		all = malloc((size_t)nranks * LINE);
	MPI_Gather(line, LINE, MPI_CHAR, all, LINE, MPI_CHAR, 0, MPI_COMM_WORLD);
	MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
	if (rank == 0) {
		describe(c, desc, sizeof(desc));
		printf("%s %s\n", all_ok ? "pass" : "FAIL", desc);
		for (int i = 0; all && i < nranks && (print_ranks || !all_ok); i++)
			printf("  %s\n", all + (size_t)i * LINE);
		fflush(stdout);
	}
	free(all);
	return all_ok;
}

/* ---------------------------------------------------------------- the suite */

static struct cfg base(uint64_t seed)
{
	const double dlt = pow(2, -4.0 / 3); /* the seed's parameters */

	return (struct cfg){ .L = 50, .B = 1, .H = 2, .Hkv = 2, .D = 16, .dt = APE_F32,
			     .odt = APE_F32, .causal = true, .delta = dlt, .beta = dlt / 10,
			     .gamma = dlt / 10, .lambda = 0.1, .skip_tol = 0x1p-24, .check = true,
			     .seed = seed, .ndev = 1 };
}

/* The cases every rank count runs: each feature of the issue at least once. */
static int builtin(uint64_t seed, struct cfg *out)
{
	struct cfg c;
	int n = 0;

#define ADD(...)                                                                                   \
	do {                                                                                       \
		c = base(seed + n);                                                                \
		__VA_ARGS__;                                                                       \
		out[n++] = c;                                                                      \
	} while (0)
	ADD(c.what = "contiguous-causal", c.L = 53);
	ADD(c.what = "zigzag-causal-gqa", c.kind = APE_MPI_SHARD_ZIGZAG, c.H = 4, c.Hkv = 2, c.L = 61);
	ADD(c.what = "contiguous-noncausal-f16", c.causal = false, c.dt = c.odt = APE_F16, c.L = 45,
	    c.Hkv = 1);
	ADD(c.what = "zigzag-noncausal-bf16", c.kind = APE_MPI_SHARD_ZIGZAG, c.causal = false,
	    c.dt = c.odt = APE_BF16, c.L = 47, c.D = 8);
	ADD(c.what = "f16-out-f32-strided", c.kind = APE_MPI_SHARD_ZIGZAG, c.dt = APE_F16,
	    c.strided = true, c.B = 2, c.L = 38);
	ADD(c.what = "ranks-without-rows", c.L = 2);
	ADD(c.what = "zigzag-blocks-without-rows", c.kind = APE_MPI_SHARD_ZIGZAG, c.L = 5);
	ADD(c.what = "empty", c.L = 0);
	ADD(c.what = "offsets", c.kind = APE_MPI_SHARD_ZIGZAG, c.q_start_set = true,
	    c.q_start = 1000, c.k_start = 990, c.L = 43);
	ADD(c.what = "queries-before-keys", c.q_start_set = true, c.q_start = -5, c.L = 40);
	ADD(c.what = "shift-2^40", c.kind = APE_MPI_SHARD_ZIGZAG, c.q_start_set = true,
	    c.q_start = (int64_t)1 << 40, c.k_start = (int64_t)1 << 40, c.L = 37);
	ADD(c.what = "noncausal-offsets", c.causal = false, c.q_start_set = true, c.q_start = 7,
	    c.k_start = -3, c.L = 41, c.dt = c.odt = APE_F16);
	ADD(c.what = "zero-decay", c.delta = c.beta = c.gamma = c.lambda = 0, c.L = 44);
	ADD(c.what = "negative-decay", c.delta = -0.05, c.kind = APE_MPI_SHARD_ZIGZAG, c.L = 44);
	ADD(c.what = "strong-decay-per-head", c.delta = 2, c.beta = 0.2, c.gamma = 0.2,
	    c.per_head = true, c.H = 3, c.Hkv = 1, c.L = 257, c.kind = APE_MPI_SHARD_ZIGZAG);
	ADD(c.what = "strong-decay-noncausal", c.delta = 1.5, c.causal = false, c.L = 203);
	ADD(c.what = "skip_tol-0", c.skip_tol = 0, c.delta = 2, c.L = 60);
#undef ADD
	return n;
}

static struct cfg random_case(uint64_t seed, int i)
{
	uint64_t x = mix(seed * 7919 + (uint64_t)i);
	struct cfg c = base(seed + 1000 + (uint64_t)i);
	static const int64_t hs[][2] = { { 1, 1 }, { 2, 1 }, { 4, 2 }, { 3, 3 } };
	int hi = (int)(x % 4);

	x = mix(x);
	c.what = "random";
	c.L = (int64_t)(x % 90);
	c.H = hs[hi][0];
	c.Hkv = hs[hi][1];
	c.D = 2 * (int64_t)(1 + (x >> 8) % 12);
	c.dt = (ape_dtype)((x >> 16) % 3);
	c.odt = (x >> 20) % 4 == 0 ? APE_F32 : c.dt;
	c.kind = (ape_mpi_shard_kind)((x >> 24) % 2);
	c.causal = (x >> 25) % 3 != 0;
	c.strided = (x >> 27) % 4 == 0;
	c.per_head = (x >> 29) % 3 == 0;
	c.delta = ((x >> 32) % 5) * 0.4;
	c.beta = c.gamma = c.delta / 10;
	c.lambda = ((x >> 36) % 3) * 0.1;
	if ((x >> 40) % 3 == 0) {
		c.q_start_set = true;
		c.q_start = (int64_t)((x >> 44) % 21) - 10;
	}
	c.k_start = (int64_t)((x >> 50) % 11) - 5;
	return c;
}

/* ---------------------------------------------------------------- main */

enum {
	OPT_SUITE = 1, OPT_L, OPT_B, OPT_H, OPT_HKV, OPT_D, OPT_DTYPE, OPT_OUT_F32, OPT_SHARD,
	OPT_NONCAUSAL, OPT_DECAY, OPT_Q_START, OPT_K_START, OPT_SKIP_TOL, OPT_BACKEND, OPT_CHECK,
	OPT_SEED, OPT_CORRUPT, OPT_CORRUPT_RANK, OPT_QUIET, OPT_HELP, OPT_BACKWARD, OPT_DLSE,
	OPT_NDEV, OPT_DELTA, OPT_BETA, OPT_GAMMA, OPT_LAMBDA, OPT_CHUNK
};

static const struct cli_option options[] = {
	/* the second names are ape-bench's: ape-bench --mpi execs ape-mpi-run with its arguments */
	{ "--suite", NULL, true, OPT_SUITE },	      { "-L", "--len", true, OPT_L },
	{ "-B", "--batch", true, OPT_B },	      { "-H", "--heads", true, OPT_H },
	{ "--hkv", "--kv-heads", true, OPT_HKV },     { "-D", "--head-dim", true, OPT_D },
	{ "--dtype", NULL, true, OPT_DTYPE },	      { "--out-f32", NULL, false, OPT_OUT_F32 },
	{ "--shard", NULL, true, OPT_SHARD },	      { "--noncausal", "--no-causal", false, OPT_NONCAUSAL },
	{ "--decay", NULL, true, OPT_DECAY },	      { "--q-start", NULL, true, OPT_Q_START },
	{ "--k-start", NULL, true, OPT_K_START },     { "--skip-tol", NULL, true, OPT_SKIP_TOL },
	{ "--backend", NULL, true, OPT_BACKEND },     { "--check", NULL, false, OPT_CHECK },
	{ "--seed", NULL, true, OPT_SEED },	      { "--corrupt", NULL, true, OPT_CORRUPT },
	{ "--corrupt-rank", NULL, true, OPT_CORRUPT_RANK },
	{ "--quiet", NULL, false, OPT_QUIET },	      { "--help", "-h", false, OPT_HELP },
	{ "--backward", NULL, false, OPT_BACKWARD },  { "--dlse", NULL, false, OPT_DLSE },
	{ "--ndev", NULL, true, OPT_NDEV },
	{ "--delta", NULL, true, OPT_DELTA },	      { "--beta", NULL, true, OPT_BETA },
	{ "--gamma", NULL, true, OPT_GAMMA },	      { "--lambda", NULL, true, OPT_LAMBDA },
	{ "--chunk", NULL, true, OPT_CHUNK },
	{ NULL, NULL, false, 0 },
};

static const char *const corruptions[] = { "delta", "causal", "k_start", "kind", "rank",
					    "stride", "null", "L", "budget", "bwd-delta",
					    "bwd-dout", "bwd-want" };

static void usage(FILE *f)
{
	fprintf(f, "usage: mpirun -np N ape-mpi-run [--suite N | options]\n"
		   "  -L N -B N -H N --hkv N -D N --dtype f32|f16|bf16 --out-f32\n"
		   "  --shard contiguous|zigzag --noncausal --decay seed|zero|DELTA\n"
		   "  --q-start N --k-start N --skip-tol X --backend ref|opencl|auto\n"
		   "  --check --seed N --corrupt delta|causal|k_start|kind|rank|stride|null|L|budget|\n"
		   "                             bwd-delta|bwd-dout|bwd-want\n"
		   "  --corrupt-rank R --quiet --help --version\n"
		   "  --backward (the distributed backward after the forward) --dlse (with dL/dLSE)\n"
		   "  --ndev N (the forward on the selected device N times, 1..8)\n"
		   "  --delta X --beta X --gamma X --lambda X (after --decay, which sets all four)\n"
		   "  --chunk N (most rows per chunk of each local call; the backward's sub-blocks)\n"
		   "ape-bench --mpi runs this with ape-bench's arguments (--len, --heads, --kv-heads,\n"
		   "--head-dim, --batch, --no-causal are the names above); ape-run --mpi runs\n"
		   "'ape-mpi-run --files ARGS' (ape-run's options on .npy files: --files --help).\n");
}

struct args {
	int suite, corrupt_rank;
	const char *backend, *corrupt_what;
	bool quiet, help;
};

/* --decay: the seed's parameters, none, or a delta with the seed's ratios */
static int parse_decay(const char *v, struct cfg *c, char *err, size_t len)
{
	double d;

	if (!strcmp(v, "seed"))
		d = pow(2, -4.0 / 3);
	else if (!strcmp(v, "zero"))
		d = 0;
	else if (cli_parse_finite("--decay", v, &d, err, len))
		return APE_EINVAL;
	c->delta = d;
	c->beta = c->gamma = d / 10;
	c->lambda = !strcmp(v, "zero") ? 0 : 0.1;
	return 0;
}

static int parse_word(const char *flag, const char *v, const char *const *words, size_t n,
		      int *out, char *err, size_t len)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(v, words[i])) {
			*out = (int)i;
			return 0;
		}
	snprintf(err, len, "%s: '%s' is not one of the choices (see --help)", flag, v);
	return APE_EINVAL;
}

static int parse_one(int id, const char *v, struct cfg *c, struct args *a, char *err, size_t len)
{
	static const char *const shards[] = { "contiguous", "zigzag" };
	int64_t *dims[] = { [OPT_L] = &c->L, [OPT_B] = &c->B, [OPT_H] = &c->H,
			    [OPT_HKV] = &c->Hkv, [OPT_D] = &c->D };
	int64_t x;
	int w;

	switch (id) {
	case OPT_L: case OPT_B: case OPT_H: case OPT_HKV: case OPT_D:
		return cli_parse_int64(options[id - 1].name, v, id == OPT_L ? 0 : 1, INT64_MAX,
				       dims[id], err, len);
	case OPT_CHUNK:
		return cli_parse_int64("--chunk", v, 1, INT64_MAX, &c->chunk, err, len);
	case OPT_NDEV:
		if (cli_parse_int64("--ndev", v, 1, 8, &x, err, len))
			return APE_EINVAL;
		c->ndev = (int)x;
		return 0;
	case OPT_SUITE:
	case OPT_CORRUPT_RANK:
		if (cli_parse_int64(options[id - 1].name, v, 0, INT32_MAX, &x, err, len))
			return APE_EINVAL;
		*(id == OPT_SUITE ? &a->suite : &a->corrupt_rank) = (int)x;
		return 0;
	case OPT_DTYPE:
		if (cli_parse_name("--dtype", v, ape_dtype_from_name, &w, err, len))
			return APE_EINVAL;
		c->dt = c->odt = (ape_dtype)w;
		return 0;
	case OPT_SHARD:
		if (parse_word("--shard", v, shards, 2, &w, err, len))
			return APE_EINVAL;
		c->kind = w ? APE_MPI_SHARD_ZIGZAG : APE_MPI_SHARD_CONTIGUOUS;
		return 0;
	case OPT_DECAY:
		return parse_decay(v, c, err, len);
	case OPT_DELTA: case OPT_BETA: case OPT_GAMMA: case OPT_LAMBDA: {
		double *p[] = { &c->delta, &c->beta, &c->gamma, &c->lambda };

		return cli_parse_finite(options[id - 1].name, v, p[id - OPT_DELTA], err, len);
	}
	case OPT_Q_START:
		c->q_start_set = true;
		return cli_parse_int64("--q-start", v, INT64_MIN, INT64_MAX, &c->q_start, err, len);
	case OPT_K_START:
		return cli_parse_int64("--k-start", v, INT64_MIN, INT64_MAX, &c->k_start, err, len);
	case OPT_SKIP_TOL:
		return cli_parse_finite("--skip-tol", v, &c->skip_tol, err, len);
	case OPT_SEED:
		if (cli_parse_int64("--seed", v, 0, INT64_MAX, &x, err, len))
			return APE_EINVAL;
		c->seed = (uint64_t)x;
		return 0;
	case OPT_CORRUPT:
		if (parse_word("--corrupt", v, corruptions, sizeof(corruptions) /
			       sizeof(corruptions[0]), &w, err, len))
			return APE_EINVAL;
		a->corrupt_what = corruptions[w];
		return 0;
	case OPT_BACKEND: a->backend = v; return 0;
	case OPT_OUT_F32: c->odt = APE_F32; return 0;
	case OPT_NONCAUSAL: c->causal = false; return 0;
	case OPT_CHECK: c->check = true; return 0;
	case OPT_BACKWARD: c->backward = true; return 0;
	case OPT_DLSE: c->with_dlse = true; return 0;
	case OPT_QUIET: a->quiet = true; return 0;
	case OPT_HELP: a->help = true; return 0;
	}
	return 0;
}

/* Every option through the tools' shared walker (--version answered there). 0, or APE_EINVAL
 * with the message in err. */
static int parse(int argc, char **argv, struct cfg *c, struct args *a, char *err, size_t len)
{
	const char *v;
	int i = 1, id;

	while ((id = cli_next(argc, argv, &i, options, &v, err, len)) > 0)
		if (parse_one(id, v, c, a, err, len))
			return APE_EINVAL;
	return id;
}

/* This process is rank 0 of its launch, as Open MPI's or a PMI launcher's environment says, or
 * was started without one. */
static bool first_rank(void)
{
	static const char *const vars[] = { "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK" };

	for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
		if (getenv(vars[i]))
			return atoi(getenv(vars[i])) == 0;
	return true;
}

int main(int argc, char **argv)
{
	struct args a = { .suite = -1, .backend = "ref" };
	struct cfg c, cases[32];
	int pass = 0, total = 0, ret, bad;
	ape_context *ctx = NULL;
	ape_selection sel;
	uint64_t seed;
	char err[256];

	/* ape-run --mpi execs ape-mpi-run --files ARGS: ape-run's options on .npy files */
	if (argc > 1 && !strcmp(argv[1], "--files")) {
		argv[1] = argv[0];
		return ape_mpi_files_main(argc - 1, argv + 1);
	}
	/* ape-bench --mpi execs ape-mpi-run --bench ARGS: this driver, named as the tool, with
	 * a message about bad input on every rank and exit status 2 for a case the library
	 * refuses (bad input) */
	if (argc > 1 && !strcmp(argv[1], "--bench")) {
		argv[1] = argv[0];
		argc--;
		argv++;
		bench = true;
	}
	/* Options are checked before MPI starts, so that --help and --version need no mpirun;
	 * they are read again below, over the defaults of the run's seed. */
	c = base(0);
	bad = parse(argc, argv, &c, &a, err, sizeof(err));
	if (!bad && a.help) {
		usage(stdout);
		return 0;
	}
	if (bad && bench) {
		/* ape-bench --mpi: every rank says it, so MPI starts first (mpirun ends the job at
		 * the first non-zero exit status: every rank prints before any exits) */
		MPI_Init(&argc, &argv);
		fprintf(stderr, "ape-bench --mpi: %s\n", err);
		MPI_Barrier(MPI_COMM_WORLD);
		MPI_Finalize();
		return 2;
	}
	if (bad) {
		/* before MPI starts (nothing to finalise, nothing of MPI's left behind); once, from
		 * the first rank as the launcher numbers them, or from a process started alone */
		if (first_rank())
			fprintf(stderr, "ape-mpi-run: %s\n", err);
		return 2;
	}
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &nranks);
	/* one seed for all ranks: rank 0's, from APE_TEST_SEED or the clock */
	seed = getenv("APE_TEST_SEED") ? strtoull(getenv("APE_TEST_SEED"), NULL, 0)
				       : (uint64_t)time(NULL);
	MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
	c = base(seed);
	c.check = false;
	c.what = "run";
	a = (struct args){ .suite = -1, .backend = "ref" };
	parse(argc, argv, &c, &a, err, sizeof(err)); /* accepted above */
	ret = ape_context_create(&ctx, NULL);
	if (!ret)
		ret = ape_device_select(ctx, a.backend, -1, &sel);
	if (ret) {
		if (rank == 0)
			fprintf(stderr, "ape-mpi-run: %s: %s\n", ape_err_name(ret), ape_last_error());
		ape_context_destroy(ctx);
		MPI_Finalize();
		return 3;
	}
	if (rank == 0)
		printf("# ape-mpi-run: %d ranks, seed %" PRIu64 ", %s\n", nranks, seed, sel.note);
	if (a.suite < 0) {
		total = 1;
		pass = run_case(&c, sel.device, a.corrupt_what, a.corrupt_rank, !a.quiet);
	} else {
		int n = builtin(seed, cases);

		for (int i = 0; i < n + a.suite; i++, total++) {
			struct cfg cc = i < n ? cases[i] : random_case(seed, i);

			cc.backward = c.backward;
			cc.with_dlse = c.with_dlse || i % 2;
			cc.ndev = c.ndev;
			cc.chunk = c.chunk;

			pass += run_case(&cc, sel.device, NULL, 0, false);
		}
	}
	if (rank == 0)
		printf("# %d of %d cases passed on %d ranks\n", pass, total, nranks);
	ape_context_destroy(ctx);
	MPI_Finalize();
	return pass == total ? 0 : bench && last_ret == APE_EINVAL ? 2 : 1;
}
