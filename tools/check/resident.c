/* SPDX-License-Identifier: MIT */
/*
 * ape-check's device-resident cells (tools/check/check.h): the calls on device tensors, each on
 * a queue of its own with buffers written from host memory and read back, against the
 * reference's host call: ape_attention_enqueue() (GQA, interleaved layout, float16),
 * ape_attention_enqueue_varlen() (a ragged batch of packed tensors, empty and one-token
 * sequences), ape_attention_enqueue_diag() and ape_attention_backward_enqueue() (every gradient
 * against the reference's). Outputs start as NaN (every byte 0xff) so a kernel that misses an
 * element is caught. A backend without a call answers APE_ENOTSUP naming the device: not claimed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check/check.h"
#include "common/refcheck.h"

/* A queue and what was made on it, released together. */
struct io {
	ape_device *dev;
	ape_queue *queue;
	ape_buffer *bufs[16];
	void *host[16]; /* sources of writes in flight */
	int nbufs, nhost;
};

static int io_open(struct io *io, ape_device *dev)
{
	memset(io, 0, sizeof(*io));
	io->dev = dev;
	return ape_queue_create(dev, &io->queue);
}

static void io_close(struct io *io)
{
	if (io->queue)
		ape_queue_synchronize(io->queue);
	for (int i = 0; i < io->nbufs; i++)
		ape_buffer_free(io->bufs[i]);
	for (int i = 0; i < io->nhost; i++)
		free(io->host[i]);
	ape_queue_destroy(io->queue);
	memset(io, 0, sizeof(*io));
}

/* A new buffer of `bytes` holding a copy of `src` (NULL: every byte 0xff, NaN in every type). */
static int io_buffer(struct io *io, const void *src, size_t bytes, ape_buffer **out)
{
	void *copy = malloc(bytes);
	int ret;

	if (!copy || io->nbufs == 16 || io->nhost == 16) {
		free(copy);
		return APE_ENOMEM;
	}
	if (src)
		memcpy(copy, src, bytes);
	else
		memset(copy, 0xff, bytes);
	io->host[io->nhost++] = copy;
	if ((ret = ape_buffer_alloc(io->dev, bytes, out)))
		return ret;
	io->bufs[io->nbufs++] = *out;
	return ape_buffer_write(io->queue, *out, 0, copy, bytes);
}

/* A contiguous device tensor of a new buffer holding `src` (NULL: NaN). */
static int io_tensor(struct io *io, const void *src, ape_dtype dt, int64_t d0, int64_t d1,
		     int64_t d2, int64_t d3, ape_dtensor *t)
{
	const size_t bytes = (size_t)(d0 * d1 * d2 * d3) * ape_dtype_size(dt);
	ape_buffer *b;
	int ret = io_buffer(io, src, bytes, &b);

	if (!ret)
		ape_dtensor_init(t, b, 0, dt, d0, d1, d2, d3);
	return ret;
}

/* The case's Q, K and V on io's device, in dt. */
static int io_qkv(struct io *io, const struct check_qkv *x, ape_dtype dt, ape_dtensor *q,
		  ape_dtensor *k, ape_dtensor *v)
{
	int r = io_tensor(io, x->q, dt, x->B, x->H, x->Lq, x->D, q);

	if (!r)
		r = io_tensor(io, x->k, dt, x->B, x->Hkv, x->Lk, x->D, k);
	if (!r)
		r = io_tensor(io, x->v, dt, x->B, x->Hkv, x->Lk, x->D, v);
	return r;
}

/* Reads t's buffer, all of it, into host memory `dst`: there once io_close() returned. */
static int io_read(struct io *io, const ape_dtensor *t, void *dst)
{
	return ape_buffer_read(io->queue, dst, t->buf, 0, ape_buffer_size(t->buf));
}

/* ------------------------------------------------------------------ the forward */

static void add_result(const char *name, int d, ape_device *dev, int ret, int n,
		       const char *const *labels, const double *err, const double *tol)
{
	if (ret)
		check_add_error(CHECK_RESIDENT, name, d, dev, ret, true);
	else
		check_add_errors(CHECK_RESIDENT, name, d, n, labels, err, tol);
}

static int resident_forward(const struct check_env *env)
{
	static const char *const labels[] = { "O", "LSE" };
	static const char name[] = "enqueue_gqa_interleaved_f16";
	const ape_dtype dt = APE_F16;
	struct check_qkv x;
	ape_attn_desc desc;
	ape_tensor to;
	size_t rows, no;
	void *oref = NULL, *o = NULL;
	float *lref = NULL, *lse = NULL, *of = NULL, *oreff = NULL;
	int ret = check_qkv_make(&x, env->rng, dt, 2, 4, 2, 33, 33, 32);

	if (ret)
		return ret;
	rows = (size_t)(x.B * x.H * x.Lq);
	no = rows * (size_t)x.D;
	check_seed_desc(&desc);
	desc.layout = APE_ROPE_INTERLEAVED;
	oref = malloc(no * ape_dtype_size(dt));
	o = malloc(no * ape_dtype_size(dt));
	lref = malloc(rows * sizeof(float));
	lse = malloc(rows * sizeof(float));
	if (!oref || !o || !lref || !lse)
		ret = APE_ENOMEM;
	ape_tensor_init(&to, oref, dt, x.B, x.H, x.Lq, x.D);
	if (!ret && (ret = ape_attention_forward(env->ref, &desc, &x.tq, &x.tk, &x.tv, &to, lref,
						 NULL)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	if (!ret && !(oreff = check_to_f32(oref, dt, no)))
		ret = APE_ENOMEM;
	for (int d = 0; d < env->ndev && !ret; d++) {
		ape_dtensor q, k, v, ot, lt;
		double err[2] = { 0 }, tol[2] = { refcheck_tol_o(dt), refcheck_tol_lse(dt) };
		struct io io;
		int r = io_open(&io, env->devs[d]);

		if (!r)
			r = io_qkv(&io, &x, dt, &q, &k, &v);
		if (!r)
			r = io_tensor(&io, NULL, dt, x.B, x.H, x.Lq, x.D, &ot);
		if (!r)
			r = io_tensor(&io, NULL, APE_F32, x.B, x.H, x.Lq, 1, &lt);
		if (!r)
			r = ape_attention_enqueue(io.queue, &desc, &q, &k, &v, &ot, &lt);
		if (!r)
			r = io_read(&io, &ot, o);
		if (!r)
			r = io_read(&io, &lt, lse);
		if (!r)
			r = ape_queue_synchronize(io.queue);
		io_close(&io);
		if (!r && !(of = check_to_f32(o, dt, no))) {
			ret = APE_ENOMEM;
			break;
		}
		if (!r) {
			const size_t nk = (size_t)(x.B * x.Hkv * x.Lk * x.D);

			err[0] = check_err_abs(of, oreff, no, check_max_abs(x.vf, nk));
			err[1] = check_err_rel(lse, lref, rows);
		}
		free(of);
		of = NULL;
		add_result(name, d, env->devs[d], r, 2, labels, err, tol);
	}
	free(oref);
	free(o);
	free(oreff);
	free(lref);
	free(lse);
	check_qkv_free(&x);
	return ret;
}

/* ------------------------------------------------------------------ a ragged batch */

#define RV_S 4
#define RV_H 4
#define RV_HKV 1
#define RV_D 64

static int resident_varlen(const struct check_env *env)
{
	static const char *const labels[] = { "O", "LSE" };
	static const char name[] = "enqueue_varlen_f32";
	/* a whole sequence, a one-token one, a chunked prefill, an empty one */
	static const int64_t cuq[RV_S + 1] = { 0, 17, 18, 23, 23 };
	static const int64_t cuk[RV_S + 1] = { 0, 17, 18, 58, 58 };
	const int64_t tq = cuq[RV_S], tk = cuk[RV_S];
	const size_t nq = (size_t)(tq * RV_H * RV_D), nk = (size_t)(tk * RV_HKV * RV_D);
	float *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float));
	float *v = malloc(nk * sizeof(float)), *oref = check_nan_floats(nq);
	float *lref = check_nan_floats((size_t)(tq * RV_H)), *o = malloc(nq * sizeof(float));
	float *lse = malloc((size_t)(tq * RV_H) * sizeof(float));
	ape_tensor hq, hk, hv, ho;
	ape_attn_desc desc;
	ape_varlen vl;
	int ret = q && k && v && oref && lref && o && lse ? 0 : APE_ENOMEM;

	for (size_t i = 0; !ret && i < nq; i++)
		q[i] = (float)ape_rng_normal(env->rng);
	for (size_t i = 0; !ret && i < nk; i++) {
		k[i] = (float)ape_rng_normal(env->rng);
		v[i] = (float)ape_rng_normal(env->rng);
	}
	check_seed_desc(&desc);
	ape_varlen_init(&vl);
	vl.num_seqs = RV_S;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	ape_tensor_init_packed(&hq, q, APE_F32, tq, RV_H, RV_D);
	ape_tensor_init_packed(&hk, k, APE_F32, tk, RV_HKV, RV_D);
	ape_tensor_init_packed(&hv, v, APE_F32, tk, RV_HKV, RV_D);
	ape_tensor_init_packed(&ho, oref, APE_F32, tq, RV_H, RV_D);
	if (!ret && (ret = ape_attention_forward_varlen(env->ref, &desc, &vl, &hq, &hk, &hv, &ho,
							lref, NULL)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		ape_dtensor dq, dk, dv, dov, dl;
		double err[2] = { 0 };
		const double tol[2] = { refcheck_tol_o(APE_F32), refcheck_tol_lse(APE_F32) };
		struct io io;
		int r = io_open(&io, env->devs[d]);

		/* packed [total, heads, D] as [1, heads, total, D]; LSE token-major [total, H] */
		if (!r)
			r = io_tensor(&io, q, APE_F32, 1, RV_H, tq, RV_D, &dq);
		if (!r)
			r = io_tensor(&io, k, APE_F32, 1, RV_HKV, tk, RV_D, &dk);
		if (!r)
			r = io_tensor(&io, v, APE_F32, 1, RV_HKV, tk, RV_D, &dv);
		if (!r)
			r = io_tensor(&io, NULL, APE_F32, 1, RV_H, tq, RV_D, &dov);
		if (!r)
			r = io_tensor(&io, NULL, APE_F32, 1, RV_H, tq, 1, &dl);
		if (!r) {
			const int64_t sq[4] = { 0, RV_D, RV_H * RV_D, 1 };
			const int64_t sk[4] = { 0, RV_D, RV_HKV * RV_D, 1 };
			const int64_t sl[4] = { 0, 1, RV_H, 1 };

			memcpy(dq.strides, sq, sizeof(sq));
			memcpy(dov.strides, sq, sizeof(sq));
			memcpy(dk.strides, sk, sizeof(sk));
			memcpy(dv.strides, sk, sizeof(sk));
			memcpy(dl.strides, sl, sizeof(sl));
			r = ape_attention_enqueue_varlen(io.queue, &desc, &vl, &dq, &dk, &dv, &dov,
							 &dl);
		}
		if (!r)
			r = io_read(&io, &dov, o);
		if (!r)
			r = io_read(&io, &dl, lse);
		if (!r)
			r = ape_queue_synchronize(io.queue);
		io_close(&io);
		if (!r) {
			err[0] = check_err_abs(o, oref, nq, check_max_abs(v, nk));
			err[1] = check_err_rel(lse, lref, (size_t)(tq * RV_H));
		}
		add_result(name, d, env->devs[d], r, 2, labels, err, tol);
	}
	free(q);
	free(k);
	free(v);
	free(oref);
	free(lref);
	free(o);
	free(lse);
	return ret;
}

/* ------------------------------------------------------------------ the diagnostics */

static int resident_diag(const struct check_env *env)
{
	static const char *const labels[] = { "O", "LSE", "ENT", "MD" };
	static const char name[] = "enqueue_diag_bf16";
	const ape_dtype dt = APE_BF16;
	struct check_qkv x;
	ape_attn_desc desc;
	ape_tensor to;
	float *w[4] = { 0 }, *g[4] = { 0 }; /* O, LSE, ENT, MD: the reference's, the device's */
	size_t rows, n[4];
	int ret = check_qkv_make(&x, env->rng, dt, 1, 2, 1, 50, 50, 32);

	if (ret)
		return ret;
	rows = (size_t)(x.B * x.H * x.Lq);
	n[0] = rows * (size_t)x.D;
	n[1] = n[2] = n[3] = rows;
	for (int i = 0; i < 4; i++)
		if (!(w[i] = check_nan_floats(n[i])) || !(g[i] = check_nan_floats(n[i])))
			ret = APE_ENOMEM;
	check_seed_desc(&desc);
	ape_tensor_init(&to, w[0], APE_F32, x.B, x.H, x.Lq, x.D);
	if (!ret && (ret = ape_attention_forward_diag(&env->ref, 1, NULL, &desc, &x.tq, &x.tk,
						      &x.tv, &to, w[1], w[2], w[3], NULL)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		ape_dtensor q, k, v, t[4];
		double err[4] = { 0 }, tol[4] = { 1, 1, 1, 1 };
		struct io io;
		int r = io_open(&io, env->devs[d]);

		if (!r)
			r = io_qkv(&io, &x, dt, &q, &k, &v);
		for (int i = 0; i < 4 && !r; i++)
			r = io_tensor(&io, NULL, APE_F32, x.B, x.H, x.Lq, i ? 1 : x.D, &t[i]);
		if (!r)
			r = ape_attention_enqueue_diag(io.queue, &desc, &q, &k, &v, &t[0], &t[1],
						       &t[2], &t[3]);
		for (int i = 0; i < 4 && !r; i++)
			r = io_read(&io, &t[i], g[i]);
		if (!r)
			r = ape_queue_synchronize(io.queue);
		io_close(&io);
		tol[0] = refcheck_tol_o(dt);
		tol[1] = tol[2] = tol[3] = refcheck_tol_lse(dt);
		if (!r) {
			const size_t nk = (size_t)(x.B * x.Hkv * x.Lk * x.D);

			err[0] = check_err_abs(g[0], w[0], n[0], check_max_abs(x.vf, nk));
			err[1] = check_err_rel(g[1], w[1], rows);
			for (size_t i = 0; i < rows; i++) {
				/* causal, end-aligned, Lq = Lk: row i's farthest key is i back */
				const double maxn = (double)(i % (size_t)x.Lq);

				err[2] = fmax(err[2], check_err_one(g[2][i], w[2][i], w[1][i]));
				err[3] = fmax(err[3], check_err_one(g[3][i], w[3][i], maxn));
			}
		}
		add_result(name, d, env->devs[d], r, 4, labels, err, tol);
	}
	for (int i = 0; i < 4; i++) {
		free(w[i]);
		free(g[i]);
	}
	check_qkv_free(&x);
	return ret;
}

/* ------------------------------------------------------------------ the backward */

static int resident_backward(const struct check_env *env)
{
	static const char *const labels[] = { "dQ", "dK", "dV", "dP" };
	static const char name[] = "backward_enqueue_f32";
	const ape_dtype dt = APE_F32;
	struct check_qkv x;
	ape_attn_desc desc;
	ape_tensor to, tdo, tg[3];
	float *o = NULL, *lse = NULL, *dout = NULL, *gq = NULL, *gk = NULL, *gv = NULL;
	float *gp = NULL;
	size_t rows, nq, nk;
	int ret = check_qkv_make(&x, env->rng, dt, 1, 4, 2, 24, 24, 32);

	if (ret)
		return ret;
	rows = (size_t)(x.B * x.H * x.Lq);
	nq = rows * (size_t)x.D;
	nk = (size_t)(x.B * x.Hkv * x.Lk * x.D);
	check_seed_desc(&desc);
	o = malloc(nq * sizeof(float));
	lse = malloc(rows * sizeof(float));
	dout = ape_rng_array(env->rng, nq, dt, NULL);
	gq = malloc(nq * sizeof(float));
	gk = malloc(nk * sizeof(float));
	gv = malloc(nk * sizeof(float));
	gp = malloc((size_t)(4 * x.H) * sizeof(float));
	if (!o || !lse || !dout || !gq || !gk || !gv || !gp)
		ret = APE_ENOMEM;
	ape_tensor_init(&to, o, dt, x.B, x.H, x.Lq, x.D);
	ape_tensor_init(&tdo, dout, dt, x.B, x.H, x.Lq, x.D);
	ape_tensor_init(&tg[0], gq, dt, x.B, x.H, x.Lq, x.D);
	ape_tensor_init(&tg[1], gk, dt, x.B, x.Hkv, x.Lk, x.D);
	ape_tensor_init(&tg[2], gv, dt, x.B, x.Hkv, x.Lk, x.D);
	/* the forward's O and LSE, from the reference: the backward's inputs */
	if (!ret && (ret = ape_attention_forward(env->ref, &desc, &x.tq, &x.tk, &x.tv, &to, lse,
						 NULL)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		ape_dtensor q, k, v, ot, lt, dot, g[4];
		struct refcheck_grads res;
		double err[4] = { 0 }, tol[4] = { 1, 1, 1, 1 };
		struct io io;
		int r = io_open(&io, env->devs[d]);

		if (!r)
			r = io_qkv(&io, &x, dt, &q, &k, &v);
		if (!r)
			r = io_tensor(&io, o, dt, x.B, x.H, x.Lq, x.D, &ot);
		if (!r)
			r = io_tensor(&io, lse, APE_F32, x.B, x.H, x.Lq, 1, &lt);
		if (!r)
			r = io_tensor(&io, dout, dt, x.B, x.H, x.Lq, x.D, &dot);
		if (!r)
			r = io_tensor(&io, NULL, dt, x.B, x.H, x.Lq, x.D, &g[0]);
		if (!r)
			r = io_tensor(&io, NULL, dt, x.B, x.Hkv, x.Lk, x.D, &g[1]);
		if (!r)
			r = io_tensor(&io, NULL, dt, x.B, x.Hkv, x.Lk, x.D, &g[2]);
		if (!r)
			r = io_tensor(&io, NULL, APE_F32, 1, 1, x.H, 4, &g[3]);
		if (!r)
			r = ape_attention_backward_enqueue(io.queue, &desc, &q, &k, &v, &ot, &lt,
							   &dot, NULL, &g[0], &g[1], &g[2], &g[3]);
		if (!r)
			r = io_read(&io, &g[0], gq);
		if (!r)
			r = io_read(&io, &g[1], gk);
		if (!r)
			r = io_read(&io, &g[2], gv);
		if (!r)
			r = io_read(&io, &g[3], gp);
		if (!r)
			r = ape_queue_synchronize(io.queue);
		io_close(&io);
		if (!r && (ret = refcheck_backward(env->ref, &desc, &x.tq, &x.tk, &x.tv, &to, lse,
						   &tdo, NULL, &tg[0], &tg[1], &tg[2], gp, &res))) {
			fprintf(stderr, "ape-check: %s on the reference: %s\n", name,
				ape_last_error());
			break;
		}
		for (int i = 0; i < 4 && !r; i++) {
			err[i] = res.err[i];
			tol[i] = res.tol;
		}
		add_result(name, d, env->devs[d], r, 4, labels, err, tol);
	}
	free(o);
	free(lse);
	free(dout);
	free(gq);
	free(gk);
	free(gv);
	free(gp);
	check_qkv_free(&x);
	return ret;
}

int check_resident(const struct check_env *env)
{
	int ret = resident_forward(env);

	if (!ret)
		ret = resident_varlen(env);
	if (!ret)
		ret = resident_diag(env);
	if (!ret)
		ret = resident_backward(env);
	if (ret == APE_ENOMEM)
		fprintf(stderr, "ape-check: out of memory\n");
	return ret;
}
