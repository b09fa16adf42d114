/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on one device (exec/backward.h). The same path as a forward launch: pack
 * strided host tensors (exec/pack.c), count every device buffer against the budget
 * (exec/devmem.c), copy, launch, copy back. Everything the call could run out of (host
 * staging, device buffers) is taken before the launch and the caller's outputs are written
 * only after the final synchronisation, so that a failure writes nothing.
 *
 * Not chunked yet. The backend op is an accumulator (core/backend.h) so that a later executor
 * can run query chunks x key chunks in a fixed order; this one zeroes the accumulators and runs
 * the whole call as one launch, which must fit the budget.
 */
#include "exec/backward.h"

#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "exec/devmem.h"
#include "exec/pack.h"
#include "exec/stream.h"

enum { IN_Q, IN_K, IN_V, IN_O, IN_DOUT, IN_LSE, IN_DLSE, N_IN };
enum { OUT_DQ, OUT_DK, OUT_DV, N_OUT };

/* An input on its way to the device: the caller's memory when it is contiguous already, else
 * a packed copy. */
struct upload {
	const char *what;
	const void *host;
	void *packed; /* owned, or NULL */
	uint64_t bytes; /* 0: not sent (dlse not given) */
	struct ape__buf *buf;
};

/* A gradient on its way back: a float32 accumulator on the device, its float32 host copy and,
 * for a 16-bit tensor, the converted rows. */
struct download {
	const char *what;
	ape_tensor *t; /* NULL: not wanted */
	const int64_t *s;
	uint64_t elems;
	struct ape__buf *buf;
	float *host;
	void *conv; /* t->dtype != APE_F32 only */
};

struct bwd_run {
	const struct ape__bwd_req *r;
	struct ape__devmem mem;
	struct ape__queue *queue;
	struct ape__event *ev[2];
	struct upload in[N_IN];
	struct download out[N_OUT];
	struct ape__buf *dparams_buf;
	double *dparams_host;
	uint64_t dparams_bytes;
};

static uint64_t elems_of(const ape_tensor *t)
{
	return (uint64_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]);
}

static void set_upload(struct upload *u, const char *what, const ape_tensor *t,
		       const int64_t s[4])
{
	u->what = what;
	u->host = t->data;
	u->bytes = elems_of(t) * ape_dtype_size(t->dtype);
	if (!ape__is_contiguous(t, s))
		u->host = NULL; /* packed in prepare_host() */
}

static void set_download(struct download *d, const char *what, ape_tensor *t, const int64_t *s)
{
	d->what = what;
	d->t = t;
	d->s = s;
	d->elems = t ? elems_of(t) : 0;
}

/* The sizes of the one launch, and whether they fit the budget and the largest buffer. */
static int check_fit(struct bwd_run *x, uint64_t budget)
{
	const struct ape__bwd_req *r = x->r;
	struct ape_device *dev = r->dev;
	uint64_t total = x->dparams_bytes, largest = x->dparams_bytes, max_buf;

	for (int i = 0; i < N_IN; i++) {
		total += x->in[i].bytes;
		largest = x->in[i].bytes > largest ? x->in[i].bytes : largest;
	}
	for (int i = 0; i < N_OUT; i++) {
		total += x->out[i].elems * sizeof(float);
		largest = x->out[i].elems * sizeof(float) > largest ? x->out[i].elems * sizeof(float)
								     : largest;
	}
	if (total > budget)
		return ape__error(APE_ENOMEM,
				  "%s: %s:%d %s: the backward pass runs as one launch (it is not "
				  "streamed in chunks yet) and needs %" PRIu64
				  " bytes of device memory for its inputs and gradients, over the "
				  "budget of %" PRIu64 " bytes",
				  r->fn, dev->info.backend, dev->info.backend_index, dev->info.name,
				  total, budget);
	max_buf = dev->be->ops->max_alloc ? dev->be->ops->max_alloc(dev) : UINT64_MAX;
	if (largest > max_buf)
		return ape__error(APE_ENOMEM,
				  "%s: %s:%d %s: the backward pass runs as one launch (it is not "
				  "streamed in chunks yet) and needs a buffer of %" PRIu64
				  " bytes, over the device's largest allocation of %" PRIu64 " bytes",
				  r->fn, dev->info.backend, dev->info.backend_index, dev->info.name,
				  largest, max_buf);
	return 0;
}

/* Host memory, all of it before any device work: packed inputs and gradient staging. */
static int prepare_host(struct bwd_run *x)
{
	const struct ape__bwd_req *r = x->r;
	const ape_tensor *ts[IN_LSE] = { r->q, r->k, r->v, r->o, r->dout };
	const int64_t *ss[IN_LSE] = { r->p->qs, r->p->ks, r->p->vs, r->p->os, r->dout_s };

	for (int i = 0; i < IN_LSE; i++) {
		struct upload *u = &x->in[i];

		if (u->host)
			continue;
		u->packed = ape__malloc((size_t)u->bytes);
		if (!u->packed)
			goto out_nomem;
		ape__pack_rows(u->packed, ts[i], ss[i], 0, ts[i]->shape[2]);
		u->host = u->packed;
	}
	for (int i = 0; i < N_OUT; i++) {
		struct download *d = &x->out[i];

		if (!d->t)
			continue;
		d->host = ape__malloc((size_t)d->elems * sizeof(float));
		if (!d->host)
			goto out_nomem;
		if (d->t->dtype != APE_F32) {
			d->conv = ape__malloc((size_t)d->elems * ape_dtype_size(d->t->dtype));
			if (!d->conv)
				goto out_nomem;
		}
	}
	if (r->dparams) {
		x->dparams_host = ape__malloc((size_t)x->dparams_bytes);
		if (!x->dparams_host)
			goto out_nomem;
	}
	return 0;
out_nomem:
	return ape__error(APE_ENOMEM, "%s: out of host memory staging the backward pass", r->fn);
}

/* Device buffers, copies in, zeroed accumulators, the launch, copies back, synchronised. */
static int run_device(struct bwd_run *x, struct ape__bwd_result *res)
{
	const struct ape__bwd_req *r = x->r;
	const struct ape__backend_ops *ops = r->dev->be->ops;
	const struct ape__problem *p = r->p;
	struct ape__bwd_launch l;
	int ret;

	if ((ret = ops->queue_create(r->dev, &x->queue)))
		return ret;
	for (int i = 0; i < N_IN; i++) {
		struct upload *u = &x->in[i];

		if (!u->bytes)
			continue;
		if ((ret = ape__devmem_alloc(&x->mem, u->bytes, &u->buf, u->what)) ||
		    (ret = ops->copy_h2d(x->queue, u->buf, 0, u->host, (size_t)u->bytes)))
			return ret;
		res->h2d += u->bytes;
	}
	for (int i = 0; i < N_OUT; i++) {
		struct download *d = &x->out[i];

		if (!d->t)
			continue;
		if ((ret = ape__devmem_alloc(&x->mem, d->elems * sizeof(float), &d->buf,
					     d->what)) ||
		    (ret = ops->fill(x->queue, d->buf, 0, 0, (size_t)d->elems * sizeof(float))))
			return ret;
	}
	if (r->dparams &&
	    ((ret = ape__devmem_alloc(&x->mem, x->dparams_bytes, &x->dparams_buf, "dparams")) ||
	     (ret = ops->fill(x->queue, x->dparams_buf, 0, 0, (size_t)x->dparams_bytes))))
		return ret;

	memset(&l, 0, sizeof(l));
	l.f.B = p->B;
	l.f.H = p->H;
	l.f.Hkv = p->Hkv;
	l.f.Lq = p->Lq;
	l.f.Lk = p->Lk;
	l.f.D = p->D;
	l.f.in_dtype = p->in_dtype;
	l.f.out_dtype = p->out_dtype;
	l.f.q = x->in[IN_Q].buf;
	l.f.k = x->in[IN_K].buf;
	l.f.v = x->in[IN_V].buf;
	l.f.o = x->in[IN_O].buf;
	l.f.lse = x->in[IN_LSE].buf;
	l.f.head_params = p->head_params;
	l.f.decay_nonneg = p->decay_nonneg;
	l.f.scale = p->scale;
	l.f.rope_base = p->rope_base;
	for (int64_t i = 0; i < p->D / 2; i++)
		l.f.omega[i] = pow(p->rope_base, -2.0 * (double)i / (double)p->D);
	l.f.causal = p->causal;
	l.f.layout = p->layout;
	l.f.q_start = p->q_start;
	l.f.k_start = p->k_start;
	l.f.skip_tol = 0; /* no skip bound for the backward yet */
	l.dout_dtype = r->dout->dtype;
	l.dout = x->in[IN_DOUT].buf;
	l.dlse = x->in[IN_DLSE].buf;
	l.dq = x->out[OUT_DQ].buf;
	l.dk = x->out[OUT_DK].buf;
	l.dv = x->out[OUT_DV].buf;
	l.dparams = x->dparams_buf;

	if ((ret = ops->event_record(x->queue, &x->ev[0])) ||
	    (ret = ops->attention_backward(x->queue, &l)) ||
	    (ret = ops->event_record(x->queue, &x->ev[1])))
		return ret;
	for (int i = 0; i < N_OUT; i++) {
		struct download *d = &x->out[i];

		if (d->t && (ret = ops->copy_d2h(x->queue, d->host, d->buf, 0,
						 (size_t)d->elems * sizeof(float))))
			return ret;
		res->d2h += d->elems * sizeof(float);
	}
	if (r->dparams && (ret = ops->copy_d2h(x->queue, x->dparams_host, x->dparams_buf, 0,
					       (size_t)x->dparams_bytes)))
		return ret;
	res->d2h += r->dparams ? x->dparams_bytes : 0;
	if ((ret = ops->synchronize(x->queue)))
		return ret;
	return ops->event_elapsed(x->ev[0], x->ev[1], &res->kernel_ms);
}

/* Only after everything succeeded: the caller's outputs, converted and laid out. */
static void write_outputs(struct bwd_run *x)
{
	const struct ape__bwd_req *r = x->r;

	for (int i = 0; i < N_OUT; i++) {
		struct download *d = &x->out[i];

		if (!d->t)
			continue;
		if (d->conv) {
			ape_convert(d->conv, d->t->dtype, d->host, APE_F32, (size_t)d->elems);
			ape__unpack_rows(d->conv, d->t, d->s, 0, d->t->shape[2]);
		} else {
			ape__unpack_rows(d->host, d->t, d->s, 0, d->t->shape[2]);
		}
	}
	for (int64_t i = 0; r->dparams && i < 4 * r->p->H; i++)
		r->dparams[i] = (float)x->dparams_host[i];
}

static void release(struct bwd_run *x)
{
	const struct ape__backend_ops *ops = x->r->dev->be->ops;

	ops->queue_destroy(x->queue); /* waits for what is still in flight */
	for (int i = 0; i < 2; i++)
		ops->event_destroy(x->ev[i]);
	for (int i = 0; i < N_IN; i++) {
		ape__devmem_free(&x->mem, &x->in[i].buf, x->in[i].bytes);
		free(x->in[i].packed);
	}
	for (int i = 0; i < N_OUT; i++) {
		ape__devmem_free(&x->mem, &x->out[i].buf, x->out[i].elems * sizeof(float));
		free(x->out[i].host);
		free(x->out[i].conv);
	}
	ape__devmem_free(&x->mem, &x->dparams_buf, x->dparams_bytes);
	free(x->dparams_host);
}

int ape__backward_supported(const char *fn, const struct ape_device *dev)
{
	if (dev->be->ops->attention_backward)
		return 0;
	return ape__error(APE_ENOTSUP,
			  "%s: %s:%d %s: the backward pass is not implemented on this backend yet",
			  fn, dev->info.backend, dev->info.backend_index, dev->info.name);
}

int ape__exec_backward(const struct ape__bwd_req *r, struct ape__bwd_result *res)
{
	struct ape_device *dev = r->dev;
	const struct ape__problem *p = r->p;
	const uint64_t rows = (uint64_t)(p->B * p->H * p->Lq);
	struct bwd_run x;
	int ret;

	memset(res, 0, sizeof(*res));
	if ((ret = ape__backward_supported(r->fn, dev)))
		return ret;
	memset(&x, 0, sizeof(x));
	x.r = r;
	res->budget = r->budget ? r->budget : ape__default_budget(dev);
	ape__devmem_init(&x.mem, dev, res->budget);
	set_upload(&x.in[IN_Q], "q", r->q, p->qs);
	set_upload(&x.in[IN_K], "k", r->k, p->ks);
	set_upload(&x.in[IN_V], "v", r->v, p->vs);
	set_upload(&x.in[IN_O], "o", r->o, p->os);
	set_upload(&x.in[IN_DOUT], "dout", r->dout, r->dout_s);
	x.in[IN_LSE] = (struct upload){ "lse", r->lse, NULL, rows * sizeof(float), NULL };
	x.in[IN_DLSE] = (struct upload){ "dlse", r->dlse, NULL, r->dlse ? rows * sizeof(float) : 0,
					 NULL };
	set_download(&x.out[OUT_DQ], "dq", r->dq, r->dq_s);
	set_download(&x.out[OUT_DK], "dk", r->dk, r->dk_s);
	set_download(&x.out[OUT_DV], "dv", r->dv, r->dv_s);
	x.dparams_bytes = r->dparams ? (uint64_t)p->H * 4 * sizeof(double) : 0;

	ret = check_fit(&x, res->budget);
	if (!ret)
		ret = prepare_host(&x);
	if (!ret) {
		ret = run_device(&x, res);
		if (ret)
			ret = ape__error_prefix(ape__error_on(ret, dev), r->fn);
	}
	if (!ret)
		write_outputs(&x);
	res->peak = x.mem.peak;
	release(&x);
	return ret;
}
