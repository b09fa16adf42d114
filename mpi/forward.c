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
#include <time.h>

#include "mpi_internal.h"

#define APE_REAL double
#include "core/ape_math.h"

#define PIECE_BYTES ((size_t)1 << 30) /* MPI counts are ints: larger blocks go in pieces */
#define BWD_SUB 4096 /* the backward's query rows per piece, unless opts->chunk_q says */
#define GRAD_TAG 16 /* + the owner's local block: the gradients of its rows, going back */

/* A key block of one rank as this rank holds it: rows [c0, c1) of the global sequence. */
struct kv_block {
	int64_t c0, c1;
	ape_tensor k, v; /* [B, Hkv, c1 - c0, D], local views or a received buffer */
	void *buf; /* received rows (K then V), or NULL for local ones */
	int pieces_left;
	/* the backward: where dK and dV of these rows are summed, [B, Hkv, grows, D] each, row
	 * c0 at row goff */
	double *gk, *gv;
	int64_t grows, goff;
};

struct call {
	MPI_Comm comm;
	int rank, size;
	struct ape__mpi_geom g;
	const ape_mpi_shard_info *sh;
	ape_device *const *devs;
	int ndev;
	const ape_exec_options *opts;
	ape_attn_desc dglob; /* q_start resolved and set */
	const ape_tensor *q, *k;
	size_t esize;
	int64_t need[2][2]; /* this rank's query blocks: key rows [lo, hi) they need */
	int64_t *needs; /* [size][4]: every rank's */
	float *kall, *kglob; /* key-norm bounds: [size][2][B Hkv] gathered, [nblocks][B Hkv] */
	float *prm; /* delta, beta, gamma, lambda per head */
	double *qsum; /* one query block's largest |q| and log-denominator bound, [2][B H] */
	/* the merge: per local row (b, h, i), running max, sum and accumulator */
	double *m, *s;
	float *acc;
	float *oc, *lc; /* one piece's output */
	ape_mpi_stats st;
	uint64_t vis_remote; /* key rows of other ranks visible to this rank's rows */
	int err; /* first local failure; its message is in msg */
	char msg[APE__MPI_MSG];
	/* the backward (bwd false in the forward) */
	bool bwd;
	int want; /* APE__MPI_WANT_* */
	const ape_tensor *o, *dout;
	const float *lse, *dlse;
	double *gq; /* dQ of this rank's rows, [B, H, rows, D] */
	double *gk, *gv; /* dK, dV of this rank's key rows, [B, Hkv, rows, D] */
	double *gp; /* this rank's share of the parameter gradients, 4 H */
	float *pq, *pk, *pv, *pp, *pdl; /* one piece's gradients, and its rows of dLSE */
	int64_t pk_rows; /* rows pk and pv hold */
};

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int64_t block_off(const ape_mpi_shard_info *sh, int lb)
{
	return lb == 0 ? 0 : sh->count[0];
}

static void keep_error(struct call *c, int err)
{
	size_t cap;
	const char *m = ape__mpi_msgbuf(&cap);

	if (c->err)
		return;
	c->err = err;
	snprintf(c->msg, sizeof(c->msg), "%s", m);
}

/* ------------------------------------------------------------ local checks */

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
static int check_local(struct call *c, const ape_attn_desc *desc, const ape_mpi_shard_info *sh,
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

/* ------------------------------------------------------------ the merge */

/* Merges one piece (rows [off, off + n) of this rank, float32 O and LSE) by LSE. */
static void merge(struct call *c, int64_t off, int64_t n)
{
	const int64_t D = c->g.D, rows = c->sh->rows;

	for (int64_t bh = 0; bh < c->g.B * c->g.H; bh++)
		for (int64_t i = 0; i < n; i++) {
			const int64_t r = bh * rows + off + i;
			const double l = c->lc[bh * n + i], m = c->m[r];
			const float *oc = c->oc + (bh * n + i) * D;
			float *acc = c->acc + r * D;
			double mn, f_old, f_new;

			if (isnan(m) || l == -INFINITY)
				continue; /* already NaN, or no visible key in this piece */
			if (isnan(l) || l == INFINITY) {
				c->m[r] = NAN; /* a NaN reached the row: it stays NaN */
				continue;
			}
			/* ape_math.h's merge: an empty side (m = -inf) weighs 0, and the
			 * accumulators start at 0, so the first piece needs no case of its own */
			mn = ape_merge_max(m, l);
			f_old = ape_merge_factor(m, mn);
			f_new = ape_merge_factor(l, mn);
			for (int64_t d = 0; d < D; d++)
				acc[d] = (float)(acc[d] * f_old + oc[d] * f_new);
			c->s[r] = c->s[r] * f_old + f_new;
			c->m[r] = mn;
		}
}

/* One piece, rows [s0, s0 + ns) of query block lq of this rank against key rows [j0, j1) of kb:
 * its positions and its views of Q, K and V. */
static void piece_views(const struct call *c, int lq, int64_t s0, int64_t ns,
			const struct kv_block *kb, int64_t j0, int64_t j1, ape_attn_desc *d,
			ape_tensor *qv, ape_tensor *kv, ape_tensor *vv)
{
	*d = c->dglob;
	d->q_start = c->g.q0 + c->sh->start[lq] + s0;
	d->k_start = c->g.k0 + j0;
	ape_tensor_rows(c->q, block_off(c->sh, lq) + s0, ns, qv);
	ape_tensor_rows(&kb->k, j0 - kb->c0, j1 - j0, kv);
	ape_tensor_rows(&kb->v, j0 - kb->c0, j1 - j0, vv);
}

/* After a piece's libape call: its failure kept (named by its rows), or its statistics counted.
 * True when it succeeded. */
static bool piece_done(struct call *c, int64_t a, int64_t n, int64_t j0, int64_t j1, int ret,
		       const ape_stats *st)
{
	if (ret) {
		ape__mpi_error(ret, "%s: rows %lld..%lld against keys %lld..%lld: %s", APE__MPI_FN,
			       (long long)a, (long long)(a + n - 1), (long long)j0,
			       (long long)(j1 - 1), ape_last_error());
		keep_error(c, ret);
		return false;
	}
	c->st.local_calls++;
	c->st.pairs_computed += st->pairs_computed;
	return true;
}

/* Query block lq of this rank against key rows [j0, j1) of kb (which holds rows [kb->c0,..)). */
static void compute(struct call *c, int lq, const struct kv_block *kb, int64_t j0, int64_t j1)
{
	const int64_t off = block_off(c->sh, lq), n = c->sh->count[lq];
	ape_tensor qv, kv, vv, ov;
	ape_attn_desc d;
	ape_stats st;
	int ret;

	if (c->err || j0 >= j1 || n == 0)
		return;
	piece_views(c, lq, 0, n, kb, j0, j1, &d, &qv, &kv, &vv);
	/* half of skip_tol for the plan, half for the local calls (docs/distributed.md) */
	d.skip_tol = c->dglob.skip_tol / 2;
	ape_tensor_init(&ov, c->oc, APE_F32, c->g.B, c->g.H, n, c->g.D);
	ape_stats_init(&st);
	ret = ape_attention_forward_ex(c->devs, c->ndev, c->opts, &d, &qv, &kv, &vv, &ov, c->lc,
				       &st);
	if (piece_done(c, c->sh->start[lq], n, j0, j1, ret, &st))
		merge(c, off, n);
}

/* Adds n rows of src (float32 [B, nh, n, D]) into rows [off, off + n) of dst ([B, nh, rows, D]
 * in float64): the one order every sum of pieces takes. */
static void add_rows(const struct call *c, int64_t nh, const float *src, int64_t n, double *dst,
		     int64_t rows, int64_t off)
{
	const int64_t D = c->g.D;

	for (int64_t bh = 0; bh < c->g.B * nh; bh++)
		for (int64_t i = 0; i < n; i++)
			for (int64_t d = 0; d < D; d++)
				dst[((bh * rows) + off + i) * D + d] += src[(bh * n + i) * D + d];
}

/* The backward of rows [s0, s0 + n) of query block lq against key rows [j0, j1) of kb: one
 * ape_attention_backward_ex() with the forward's O and LSE of these rows (so P_ij is the whole
 * sequence's), its gradients added to dQ, to kb's dK and dV and to the parameter gradients. */
static void compute_bwd(struct call *c, int lq, int64_t s0, int64_t n,
			const struct kv_block *kb, int64_t j0, int64_t j1)
{
	const int64_t off = block_off(c->sh, lq) + s0, m = j1 - j0;
	const int64_t rows = c->sh->rows, nbh = c->g.B * c->g.H;
	ape_tensor qv, kv, vv, ov, dov, tq, tk, tv;
	ape_attn_desc d;
	ape_stats st;
	int ret;

	if (c->err || j0 >= j1 || n == 0)
		return;
	piece_views(c, lq, s0, n, kb, j0, j1, &d, &qv, &kv, &vv);
	ape_tensor_rows(c->o, off, n, &ov);
	ape_tensor_rows(c->dout, off, n, &dov);
	for (int64_t bh = 0; bh < nbh; bh++) {
		memcpy(c->lc + bh * n, c->lse + bh * rows + off, (size_t)n * sizeof(float));
		if (c->dlse)
			memcpy(c->pdl + bh * n, c->dlse + bh * rows + off, (size_t)n * sizeof(float));
	}
	ape_tensor_init(&tq, c->pq, APE_F32, c->g.B, c->g.H, n, c->g.D);
	ape_tensor_init(&tk, c->pk, APE_F32, c->g.B, c->g.Hkv, m, c->g.D);
	ape_tensor_init(&tv, c->pv, APE_F32, c->g.B, c->g.Hkv, m, c->g.D);
	ape_stats_init(&st);
	ret = ape_attention_backward_ex(c->devs, 1, c->opts, &d, &qv, &kv, &vv, &ov, c->lc, &dov,
					c->dlse ? c->pdl : NULL,
					c->want & APE__MPI_WANT_DQ ? &tq : NULL,
					c->want & APE__MPI_WANT_DK ? &tk : NULL,
					c->want & APE__MPI_WANT_DV ? &tv : NULL,
					c->want & APE__MPI_WANT_DP ? c->pp : NULL, &st);
	if (!piece_done(c, c->sh->start[lq] + s0, n, j0, j1, ret, &st))
		return;
	if (c->want & APE__MPI_WANT_DQ)
		add_rows(c, c->g.H, c->pq, n, c->gq, rows, off);
	if (c->want & APE__MPI_WANT_DK)
		add_rows(c, c->g.Hkv, c->pk, m, kb->gk, kb->grows, kb->goff + (j0 - kb->c0));
	if (c->want & APE__MPI_WANT_DV)
		add_rows(c, c->g.Hkv, c->pv, m, kb->gv, kb->grows, kb->goff + (j0 - kb->c0));
	for (int64_t i = 0; c->want & APE__MPI_WANT_DP && i < 4 * c->g.H; i++)
		c->gp[i] += c->pp[i];
}

/* The rows of key block [ks, ke) that a rank whose query blocks need nd[0..1], nd[2..3] wants:
 * the hull of both (one message per block). Both sides compute it from the same integers. */
static void wanted(const int64_t *nd, int64_t ks, int64_t ke, int64_t *c0, int64_t *c1)
{
	*c0 = ke;
	*c1 = ks;
	for (int i = 0; i < 2; i++) {
		int64_t lo = nd[2 * i] > ks ? nd[2 * i] : ks;
		int64_t hi = nd[2 * i + 1] < ke ? nd[2 * i + 1] : ke;

		if (lo < hi) {
			*c0 = lo < *c0 ? lo : *c0;
			*c1 = hi > *c1 ? hi : *c1;
		}
	}
	if (*c0 >= *c1)
		*c0 = *c1 = ks;
}

/*
 * The backward of query block lq against the rows of kb it needs, in sub-blocks of at most
 * opts->chunk_q rows (default BWD_SUB): each sub-block's key range is cut again by the plan's
 * bound and share (ape__mpi_needed() holds for any rows), so that, as in the forward, far keys of
 * a large block are not computed. The left-out keys of a row are then the longer of two tails
 * each proved negligible within the plan's share: no more than the plan's share in all.
 */
static void compute_bwd_block(struct call *c, int lq, const struct kv_block *kb)
{
	const int64_t n = c->sh->count[lq], nbh = c->g.B * c->g.H;
	const int64_t sub = c->opts && c->opts->chunk_q > 0 ? c->opts->chunk_q : BWD_SUB;

	for (int64_t s0 = 0; s0 < n; s0 += sub) {
		const int64_t ns = n - s0 < sub ? n - s0 : sub;
		int64_t lo = c->need[lq][0], hi = c->need[lq][1], slo, shi;

		if (c->g.can_skip && ns < n) {
			ape__mpi_query_summary(&c->g, c->q, c->k, block_off(c->sh, lq) + s0, ns,
					       c->qsum, c->qsum + nbh);
			ape__mpi_needed(&c->g, c->kglob, c->qsum, c->qsum + nbh,
					c->sh->start[lq] + s0, ns, &slo, &shi);
			lo = slo > lo ? slo : lo;
			hi = shi < hi ? shi : hi;
		}
		lo = kb->c0 > lo ? kb->c0 : lo;
		hi = kb->c1 < hi ? kb->c1 : hi;
		compute_bwd(c, lq, s0, ns, kb, lo, hi);
	}
}

/* Computes every query block of this rank against the rows of kb it needs. */
static void compute_block(struct call *c, const struct kv_block *kb)
{
	for (int lq = 0; lq < c->sh->nblocks; lq++) {
		int64_t j0 = c->need[lq][0] > kb->c0 ? c->need[lq][0] : kb->c0;
		int64_t j1 = c->need[lq][1] < kb->c1 ? c->need[lq][1] : kb->c1;

		if (c->bwd)
			compute_bwd_block(c, lq, kb);
		else
			compute(c, lq, kb, j0, j1);
	}
}

/* ------------------------------------------------------------ the exchange */

struct xfer {
	int peer, lb; /* the peer, and the sender's local block index (the message tag) */
	struct kv_block blk;
	size_t bytes;
	int first, npieces; /* its requests */
	/* the backward: the gradients of these rows in float32 (dK then dV, those wanted), going
	 * back to the owner (a received block) or coming back from the peer (a sent one) */
	float *gbuf;
	size_t gbytes;
	int gfirst, gpieces;
};

static size_t xfer_bytes(const struct call *c, int64_t rows)
{
	return 2 * (size_t)(c->g.B * c->g.Hkv * rows * c->g.D) * c->esize;
}

static int npieces(size_t bytes)
{
	return bytes == 0 ? 0 : (int)((bytes + PIECE_BYTES - 1) / PIECE_BYTES);
}

/* Rows [j0, j1) (local indices) of t into dst, as a contiguous [B, Hkv, j1 - j0, D] tensor. */
static char *pack(const struct call *c, const ape_tensor *t, int64_t j0, int64_t j1, char *dst)
{
	const size_t es = c->esize;
	int64_t s[4];

	ape_tensor_strides(t, s);
	for (int64_t b = 0; b < c->g.B; b++)
		for (int64_t h = 0; h < c->g.Hkv; h++)
			for (int64_t j = j0; j < j1; j++) {
				const char *p = (const char *)t->data +
						(size_t)(b * s[0] + h * s[1] + j * s[2]) * es;

				if (s[3] == 1) {
					memcpy(dst, p, (size_t)c->g.D * es);
					dst += (size_t)c->g.D * es;
					continue;
				}
				for (int64_t d = 0; d < c->g.D; d++, dst += es)
					memcpy(dst, p + (size_t)(d * s[3]) * es, es);
			}
	return dst;
}

static void block_views(const struct call *c, struct kv_block *kb, ape_dtype dt)
{
	const int64_t n = kb->c1 - kb->c0;

	ape_tensor_init(&kb->k, kb->buf, dt, c->g.B, c->g.Hkv, n, c->g.D);
	ape_tensor_init(&kb->v, (char *)kb->buf + xfer_bytes(c, n) / 2, dt, c->g.B, c->g.Hkv, n,
			c->g.D);
}

/* Visible key rows [0, hi) of this rank's query block lq (the mask only; 0 rows: none). */
static int64_t visible_hi(const struct call *c, int lq)
{
	const int64_t n = c->sh->count[lq];
	int64_t last;

	if (n == 0)
		return 0;
	if (!c->g.causal)
		return c->g.L;
	last = c->g.q0 - c->g.k0 + (c->sh->start[lq] + n - 1);
	return last < 0 ? 0 : last >= c->g.L ? c->g.L : last + 1;
}

/* Lists the transfers: what this rank sends (to every peer that needs rows of its blocks) and
 * what it receives, from the needs every rank published. */
static int list_xfers(struct call *c, struct xfer **out, int *nsend, int *nrecv)
{
	const int per = c->sh->nblocks;
	struct xfer *x = calloc((size_t)(2 * per * c->size) + 1, sizeof(*x));
	int n = 0;

	if (!x)
		return APE_ENOMEM;
	for (int pass = 0; pass < 2; pass++) /* sends first, then receives */
		for (int r = 0; r < c->size; r++)
			for (int lb = 0; lb < per && r != c->rank; lb++) {
				int owner = pass == 0 ? c->rank : r;
				int gb = ape__mpi_block_of(&c->g, owner, lb), o2, lb2;
				const int64_t *nd = c->needs + 4 * (pass == 0 ? r : c->rank);
				int64_t ks, kc;

				ape__mpi_block(&c->g, gb, &ks, &kc, &o2, &lb2);
				wanted(nd, ks, ks + kc, &x[n].blk.c0, &x[n].blk.c1);
				if (x[n].blk.c0 == x[n].blk.c1)
					continue;
				x[n].peer = r;
				x[n].lb = lb;
				x[n].bytes = xfer_bytes(c, x[n].blk.c1 - x[n].blk.c0);
				x[n].npieces = npieces(x[n].bytes);
				*(pass == 0 ? nsend : nrecv) += 1;
				n++;
			}
	*out = x;
	return 0;
}

/* What this rank could see of other ranks' keys but was proved not to need. */
static void count_unneeded(struct call *c)
{
	for (int r = 0; r < c->size; r++)
		for (int lb = 0; lb < c->sh->nblocks && r != c->rank; lb++) {
			int gb = ape__mpi_block_of(&c->g, r, lb), o2, lb2;
			int64_t ks, kc, vis = 0, got, c0, c1, hull[4];

			ape__mpi_block(&c->g, gb, &ks, &kc, &o2, &lb2);
			for (int lq = 0; lq < c->sh->nblocks; lq++) {
				int64_t hi = visible_hi(c, lq) < ks + kc ? visible_hi(c, lq) : ks + kc;

				vis = hi - ks > vis ? hi - ks : vis;
			}
			memcpy(hull, c->needs + 4 * c->rank, sizeof(hull));
			wanted(hull, ks, ks + kc, &c0, &c1);
			got = c1 - c0;
			if (vis > 0 && got == 0)
				c->st.blocks_unneeded++;
			c->vis_remote += (uint64_t)vis;
			if (vis > got)
				c->st.rows_unneeded += (uint64_t)(vis - got);
		}
}

/* Posts bytes of buf as npieces(bytes) non-blocking messages (sends or receives) of at most
 * PIECE_BYTES each, into req[0..]. */
static int post(const struct call *c, bool send, void *buf, size_t bytes, int peer, int tag,
		MPI_Request *req)
{
	int mret = MPI_SUCCESS;

	for (int p = 0; p < npieces(bytes) && mret == MPI_SUCCESS; p++) {
		size_t o = (size_t)p * PIECE_BYTES, len = bytes - o;

		len = len < PIECE_BYTES ? len : PIECE_BYTES;
		mret = send ? MPI_Isend((char *)buf + o, (int)len, MPI_BYTE, peer, tag, c->comm,
					&req[p])
			    : MPI_Irecv((char *)buf + o, (int)len, MPI_BYTE, peer, tag, c->comm,
					&req[p]);
	}
	return mret;
}

/* The backward's buffers of transfer i: the gradients of its rows in float32 (dK then dV, those
 * wanted), and for a received block the float64 sums they come from. */
static int grad_buffers(struct call *c, struct xfer *x, bool received)
{
	const int nw = !!(c->want & APE__MPI_WANT_DK) + !!(c->want & APE__MPI_WANT_DV);
	const int64_t m = x->blk.c1 - x->blk.c0;
	const size_t per = (size_t)(c->g.B * c->g.Hkv * m * c->g.D);

	if (received && m > c->pk_rows)
		c->pk_rows = m;
	if (!nw)
		return 0;
	x->gbytes = (size_t)nw * per * sizeof(float);
	x->gpieces = npieces(x->gbytes);
	x->gbuf = malloc(x->gbytes);
	if (!x->gbuf)
		return APE_ENOMEM;
	if (!received)
		return 0;
	x->blk.gk = calloc(2 * per + 1, sizeof(double));
	x->blk.gv = x->blk.gk ? x->blk.gk + per : NULL;
	x->blk.grows = m;
	x->blk.goff = 0;
	return x->blk.gk ? 0 : APE_ENOMEM;
}

/* dK then dV (those wanted) of a received block, as float32, into its message. */
static void grad_pack(const struct call *c, struct xfer *x)
{
	const size_t per = (size_t)(c->g.B * c->g.Hkv * (x->blk.c1 - x->blk.c0) * c->g.D);
	float *p = x->gbuf;

	for (size_t i = 0; c->want & APE__MPI_WANT_DK && i < per; i++)
		*p++ = (float)x->blk.gk[i];
	for (size_t i = 0; c->want & APE__MPI_WANT_DV && i < per; i++)
		*p++ = (float)x->blk.gv[i];
}

/* The gradients a peer sent back for the rows of this rank's block that it received: added to
 * this rank's dK and dV. */
static void grad_add(struct call *c, const struct xfer *x)
{
	const int64_t m = x->blk.c1 - x->blk.c0;
	const int64_t off = block_off(c->sh, x->lb) + (x->blk.c0 - c->sh->start[x->lb]);
	const float *p = x->gbuf;

	if (c->want & APE__MPI_WANT_DK) {
		add_rows(c, c->g.Hkv, p, m, c->gk, c->sh->rows, off);
		p += c->g.B * c->g.Hkv * m * c->g.D;
	}
	if (c->want & APE__MPI_WANT_DV)
		add_rows(c, c->g.Hkv, p, m, c->gv, c->sh->rows, off);
}

/*
 * The exchange: every transfer's buffers (agreed on by all ranks before anything moves), the
 * receives posted, the requested rows packed and sent, the local blocks computed while they
 * travel, then every received block. The forward computes a block as soon as it is complete;
 * the backward computes them in the list's order (so its sums have one order), sends the
 * gradients of each block's rows back to its owner and adds what comes back, in the list's
 * order too.
 */
static int exchange(struct call *c, const ape_tensor *k, const ape_tensor *v)
{
	struct xfer *x = NULL;
	MPI_Request *req = NULL;
	int *owner = NULL, nsend = 0, nrecv = 0, nreq = 0, nkv_send = 0, nkv_recv = 0;
	int ret, mret = MPI_SUCCESS;
	char *peers = calloc((size_t)c->size, 1);
	int64_t flag[2] = { 0, 0 }, any[2];

	ret = peers ? list_xfers(c, &x, &nsend, &nrecv) : APE_ENOMEM;
	for (int i = 0; !ret && i < nsend + nrecv; i++) {
		x[i].first = nreq;
		nreq += x[i].npieces;
		*(i < nsend ? &nkv_send : &nkv_recv) += x[i].npieces;
		x[i].blk.buf = malloc(x[i].bytes);
		if (!x[i].blk.buf)
			ret = APE_ENOMEM;
		else if (c->bwd)
			ret = grad_buffers(c, &x[i], i >= nsend);
	}
	for (int i = 0; !ret && i < nsend + nrecv; i++) {
		x[i].gfirst = nreq;
		nreq += x[i].gpieces;
	}
	if (!ret && c->bwd) {
		const size_t n = (size_t)(c->g.B * c->g.Hkv * c->pk_rows * c->g.D) + 1;

		c->pk = malloc(n * sizeof(float));
		c->pv = malloc(n * sizeof(float));
		if (!c->pk || !c->pv)
			ret = APE_ENOMEM;
	}
	if (!ret) {
		req = calloc((size_t)nreq + 1, sizeof(*req));
		owner = calloc((size_t)nreq + 1, sizeof(*owner));
		if (!req || !owner)
			ret = APE_ENOMEM;
	}
	/* Every rank must have its buffers before any message moves, or a peer would wait for a
	 * message that never comes: agree on that first (lowest failing rank). */
	flag[0] = ret ? 0 : 1;
	flag[1] = ret ? c->rank : c->size;
	mret = MPI_Allreduce(flag, any, 2, MPI_INT64_T, MPI_MIN, c->comm);
	if (mret != MPI_SUCCESS) {
		ret = ape__mpi_fail(mret, "MPI_Allreduce (buffers ready)");
		goto out;
	}
	if (!any[0]) {
		ret = ape__mpi_error(APE_ENOMEM,
				     "%s: rank %lld: out of host memory for the key rows to exchange",
				     APE__MPI_FN, (long long)any[1]);
		goto out;
	}
	for (int i = 0; i < nreq; i++)
		req[i] = MPI_REQUEST_NULL;
	/* receives first, so that sends find them posted: the gradients that will come back for
	 * the rows this rank sends, and the key rows it needs */
	for (int i = 0; i < nsend && mret == MPI_SUCCESS; i++)
		mret = post(c, false, x[i].gbuf, x[i].gbytes, x[i].peer, GRAD_TAG + x[i].lb,
			    req + x[i].gfirst);
	for (int i = nsend; i < nsend + nrecv && mret == MPI_SUCCESS; i++) {
		for (int p = 0; p < x[i].npieces; p++)
			owner[x[i].first + p] = i;
		x[i].blk.pieces_left = x[i].npieces;
		mret = post(c, false, x[i].blk.buf, x[i].bytes, x[i].peer, x[i].lb,
			    req + x[i].first);
	}
	for (int i = 0; i < nsend && mret == MPI_SUCCESS; i++) {
		const int64_t off = block_off(c->sh, x[i].lb) - c->sh->start[x[i].lb];
		char *end = pack(c, k, off + x[i].blk.c0, off + x[i].blk.c1, x[i].blk.buf);

		pack(c, v, off + x[i].blk.c0, off + x[i].blk.c1, end);
		mret = post(c, true, x[i].blk.buf, x[i].bytes, x[i].peer, x[i].lb,
			    req + x[i].first);
		c->st.messages_sent += (uint64_t)x[i].npieces;
		c->st.bytes_sent += x[i].bytes;
		c->st.blocks_sent++;
		c->st.rows_sent += (uint64_t)(x[i].blk.c1 - x[i].blk.c0);
		peers[x[i].peer] = 1;
	}
	if (mret != MPI_SUCCESS) {
		ret = ape__mpi_fail(mret, "posting the key-block transfers");
		goto out;
	}
	/* the blocks already here, while the others travel */
	for (int lb = 0; lb < c->sh->nblocks; lb++) {
		struct kv_block kb = { .c0 = c->sh->start[lb],
				       .c1 = c->sh->start[lb] + c->sh->count[lb],
				       .gk = c->gk, .gv = c->gv, .grows = c->sh->rows,
				       .goff = block_off(c->sh, lb) };

		ape_tensor_rows(k, block_off(c->sh, lb), c->sh->count[lb], &kb.k);
		ape_tensor_rows(v, block_off(c->sh, lb), c->sh->count[lb], &kb.v);
		compute_block(c, &kb);
	}
	/* then each received block as soon as its last piece is in (the forward) */
	for (int done = 0; done < nkv_recv; done++) {
		const double t = now_ms();
		int idx, i;

		/* the key rows' receives follow their sends in the array: wait on those only */
		mret = MPI_Waitany(nkv_recv, req + nkv_send, &idx, MPI_STATUS_IGNORE);
		c->st.wait_ms += now_ms() - t;
		if (mret != MPI_SUCCESS) {
			ret = ape__mpi_fail(mret, "MPI_Waitany (receiving key blocks)");
			goto out;
		}
		if (idx == MPI_UNDEFINED)
			break;
		i = owner[nkv_send + idx];
		c->st.messages_received++;
		if (--x[i].blk.pieces_left)
			continue;
		c->st.bytes_received += x[i].bytes;
		c->st.blocks_received++;
		peers[x[i].peer] = 1;
		block_views(c, &x[i].blk, c->q->dtype);
		if (!c->bwd)
			compute_block(c, &x[i].blk);
	}
	/* the backward: every received block in the list's order, its gradients sent back */
	for (int i = nsend; c->bwd && i < nsend + nrecv && mret == MPI_SUCCESS; i++) {
		compute_block(c, &x[i].blk);
		if (!x[i].gbytes)
			continue;
		grad_pack(c, &x[i]);
		mret = post(c, true, x[i].gbuf, x[i].gbytes, x[i].peer, GRAD_TAG + x[i].lb,
			    req + x[i].gfirst);
		c->st.messages_sent += (uint64_t)x[i].gpieces;
		c->st.grad_bytes_sent += x[i].gbytes;
	}
	if (mret != MPI_SUCCESS) {
		ret = ape__mpi_fail(mret, "posting the gradients of received key rows");
		goto out;
	}
	mret = MPI_Waitall(nreq, req, MPI_STATUSES_IGNORE);
	if (mret != MPI_SUCCESS) {
		ret = ape__mpi_fail(mret, c->bwd ? "MPI_Waitall (key blocks and their gradients)"
					       : "MPI_Waitall (sending key blocks)");
		goto out;
	}
	/* the gradients of this rank's rows that peers computed, in the list's order */
	for (int i = 0; c->bwd && i < nsend; i++) {
		if (!x[i].gbytes)
			continue;
		grad_add(c, &x[i]);
		c->st.messages_received += (uint64_t)x[i].gpieces;
		c->st.grad_bytes_received += x[i].gbytes;
	}
	for (int r = 0; r < c->size; r++)
		c->st.peers += peers[r];
	count_unneeded(c);
out:
	for (int i = 0; x && i < nsend + nrecv; i++) {
		free(x[i].blk.buf);
		free(x[i].gbuf);
		free(x[i].blk.gk);
	}
	free(x);
	free(req);
	free(owner);
	free(peers);
	return ret;
}

/* ------------------------------------------------------------ the call */

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

/* What a call writes on success: the forward's O and LSE, or the backward's gradients. */
struct outputs {
	ape_tensor *o;
	float *lse;
	ape_tensor *dq, *dk, *dv;
	float *dparams;
};

/*
 * The backward's own arguments, checked by libape: a call on no rows of this rank's tensors
 * validates every type, shape but the length, stride, option and the device's support of the
 * backward (it writes nothing but dparams, here a scratch copy); the lengths are checked here.
 */
static int check_local_bwd(struct call *c, const ape_tensor *q, const ape_tensor *k,
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
	ret = check_local(c, desc, shard, q, k, v, c->bwd ? c->o : out->o,
			  c->bwd ? NULL : out->lse, stats);
	if (!ret && c->bwd)
		ret = check_local_bwd(c, q, k, v, c->o, c->lse, dout, dlse, out);
	if (!ret)
		ret = alloc_call(c, q, k);
	if (ret) {
		mine.status = ret;
		snprintf(mine.msg, sizeof(mine.msg), "%s", ape__mpi_msgbuf(&cap));
	} else {
		ape__mpi_digest_fill(&mine, desc, shard, q, k, c->bwd ? c->o : out->o, c->want);
	}
	if ((ret = agree(c, &mine, all)))
		goto out;
	setup_geom(c, q, k);
	if ((ret = plan(c, q, k)) || (ret = exchange(c, k, v)))
		goto out; /* an MPI failure: the exchange cannot be trusted to agree any more */
	/* a local computation may have failed on some rank: agree again before writing */
	memset(&mine, 0, sizeof(mine));
	mine.rank = c->rank;
	mine.status = c->err;
	memcpy(mine.msg, c->msg, sizeof(mine.msg));
	if ((ret = agree(c, &mine, all)))
		goto out;
	if (c->bwd && out->dparams && (ret = reduce_params(c, out->dparams)))
		goto out;
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
