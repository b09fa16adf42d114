/* SPDX-License-Identifier: MIT */
/*
 * The exchange of the distributed calls (mpi/mpi_call.h): from the rows every rank needs, the
 * transfers each pair of ranks agrees on without a message; non-blocking sends and receives of
 * key rows in pieces an int can count, overlapped with the local blocks; the backward's
 * gradients of received rows sent back to their owners and added there.
 */
#include <stdlib.h>
#include <string.h>

#include "mpi_call.h"

#define PIECE_BYTES ((size_t)1 << 30) /* MPI counts are ints: larger blocks go in pieces */
#define GRAD_TAG 16 /* + the owner's local block: the gradients of its rows, going back */

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
	return ape__mpi_visible_end(&c->g, c->sh->start[lq], c->sh->count[lq]);
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
		ape__mpi_add_rows(c, c->g.Hkv, p, m, c->gk, c->sh->rows, off);
		p += c->g.B * c->g.Hkv * m * c->g.D;
	}
	if (c->want & APE__MPI_WANT_DV)
		ape__mpi_add_rows(c, c->g.Hkv, p, m, c->gv, c->sh->rows, off);
}

/*
 * The exchange: every transfer's buffers (agreed on by all ranks before anything moves), the
 * receives posted, the requested rows packed and sent, the local blocks computed while they
 * travel, then every received block. The forward computes a block as soon as it is complete;
 * the backward computes them in the list's order (so its sums have one order), sends the
 * gradients of each block's rows back to its owner and adds what comes back, in the list's
 * order too.
 */
int ape__mpi_exchange(struct call *c, const ape_tensor *k, const ape_tensor *v)
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
		ape__mpi_compute_block(c, &kb);
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
			ape__mpi_compute_block(c, &x[i].blk);
	}
	/* the backward: every received block in the list's order, its gradients sent back */
	for (int i = nsend; c->bwd && i < nsend + nrecv && mret == MPI_SUCCESS; i++) {
		ape__mpi_compute_block(c, &x[i].blk);
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
