/* SPDX-License-Identifier: MIT */
/*
 * One-shot forward: validate, pack the caller's tensors, copy them to the device, launch, copy the
 * results back, unpack. Outputs reach the caller only after every device step has succeeded, so a
 * failing device never leaves a half-written O behind.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "context.h"
#include "error.h"
#include "hostmem.h"
#include "problem.h"

static const char fn[] = "ape_attention_forward";

void ape_stats_init(ape_stats *st)
{
	if (!st)
		return;
	memset(st, 0, sizeof(*st));
	st->struct_size = sizeof(*st);
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Calls fn(row pointer in t, row pointer in the packed buffer) for each of the B*H*L rows. */
static void copy_rows(void *packed, const ape_tensor *t, const int64_t s[4], bool to_tensor)
{
	const size_t esz = ape_dtype_size(t->dtype);
	const int64_t D = t->shape[3];
	unsigned char *pk = packed;

	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++) {
				unsigned char *row = (unsigned char *)t->data +
						     (size_t)(b * s[0] + h * s[1] + l * s[2]) * esz;

				if (s[3] == 1) {
					if (to_tensor)
						memcpy(row, pk, (size_t)D * esz);
					else
						memcpy(pk, row, (size_t)D * esz);
				} else {
					for (int64_t d = 0; d < D; d++) {
						unsigned char *e = row + (size_t)(d * s[3]) * esz;

						if (to_tensor)
							memcpy(e, pk + (size_t)d * esz, esz);
						else
							memcpy(pk + (size_t)d * esz, e, esz);
					}
				}
				pk += (size_t)D * esz;
			}
}

/* Row-major without gaps; the stride of a dimension of size 1 does not matter. */
static bool is_contiguous(const ape_tensor *t, const int64_t s[4])
{
	int64_t want = 1;

	for (int d = 3; d >= 0; d--) {
		if (t->shape[d] > 1 && s[d] != want)
			return false;
		want *= t->shape[d];
	}
	return true;
}

/* Host source of an input: the caller's memory when contiguous, else a packed copy in a staging
 * buffer on the device's NUMA node. */
static int stage_input(struct ape_device *dev, const ape_tensor *t, const int64_t s[4],
		       size_t bytes, const void **src, struct ape__hostmem *owned)
{
	int ret;

	memset(owned, 0, sizeof(*owned));
	if (is_contiguous(t, s)) {
		*src = t->data;
		return 0;
	}
	ret = ape__host_alloc(dev, bytes, owned);
	if (ret)
		return ape__error(ret, "%s: out of memory packing a strided input (%zu bytes)", fn,
				  bytes);
	copy_rows(owned->ptr, t, s, false);
	*src = owned->ptr;
	return 0;
}

struct run {
	struct ape_device *dev;
	const struct ape__backend_ops *ops;
	struct ape__queue *queue;
	struct ape__buf *q, *k, *v, *o, *lse, *pairs;
	struct ape__event *start, *end;
	/* staging buffers on the device's NUMA node (runtime/hostmem.c) */
	struct ape__hostmem q_owned, k_owned, v_owned; /* packed strided inputs */
	struct ape__hostmem o_host; /* the caller's O is written only after success */
	struct ape__hostmem lse_host, pairs_host;
};

static void run_release(struct run *r)
{
	const struct ape__backend_ops *ops = r->ops;

	ops->event_destroy(r->start);
	ops->event_destroy(r->end);
	ops->queue_destroy(r->queue); /* waits for outstanding work before buffers go */
	ops->buf_free(r->dev, r->q);
	ops->buf_free(r->dev, r->k);
	ops->buf_free(r->dev, r->v);
	ops->buf_free(r->dev, r->o);
	ops->buf_free(r->dev, r->lse);
	ops->buf_free(r->dev, r->pairs);
	ape__host_free(r->dev, &r->q_owned);
	ape__host_free(r->dev, &r->k_owned);
	ape__host_free(r->dev, &r->v_owned);
	ape__host_free(r->dev, &r->o_host);
	ape__host_free(r->dev, &r->lse_host);
	ape__host_free(r->dev, &r->pairs_host);
}

static int alloc_buf(struct run *r, size_t bytes, struct ape__buf **out, const char *what)
{
	int ret = r->ops->buf_alloc(r->dev, bytes, out);

	if (ret)
		return ape__error_prefix(ret, what);
	return 0;
}

static void fill_launch(struct ape__launch *l, const struct ape__problem *p, const struct run *r)
{
	memset(l, 0, sizeof(*l));
	l->B = p->B;
	l->H = p->H;
	l->Hkv = p->Hkv;
	l->Lq = p->Lq;
	l->Lk = p->Lk;
	l->D = p->D;
	l->in_dtype = p->in_dtype;
	l->out_dtype = p->out_dtype;
	l->q = r->q;
	l->k = r->k;
	l->v = r->v;
	l->o = r->o;
	l->lse = r->lse;
	l->pairs = r->pairs;
	l->head_params = p->head_params;
	l->decay_nonneg = p->decay_nonneg;
	l->scale = p->scale;
	l->rope_base = p->rope_base;
	for (int64_t i = 0; i < p->D / 2; i++)
		l->omega[i] = pow(p->rope_base, -2.0 * (double)i / (double)p->D);
	l->causal = p->causal;
	l->layout = p->layout;
	l->q_start = p->q_start;
	l->k_start = p->k_start;
	l->skip_tol = p->decay_nonneg ? p->skip_tol : 0.0;
}

struct sizes {
	size_t q, kv, o, rows;
};

/* Every device step, in order; any failure returns with the caller's outputs untouched. */
static int run_device(struct run *r, const struct ape__problem *p, const ape_tensor *q,
		      const ape_tensor *k, const ape_tensor *v, const struct sizes *sz,
		      bool want_pairs, ape_stats *st)
{
	const struct ape__backend_ops *ops = r->ops;
	const void *qsrc, *ksrc, *vsrc;
	struct ape__launch launch;
	double kernel_ms = 0;
	int ret;

	if ((ret = stage_input(r->dev, q, p->qs, sz->q, &qsrc, &r->q_owned)) ||
	    (ret = stage_input(r->dev, k, p->ks, sz->kv, &ksrc, &r->k_owned)) ||
	    (ret = stage_input(r->dev, v, p->vs, sz->kv, &vsrc, &r->v_owned)))
		return ret;
	if ((ret = ape__host_alloc(r->dev, sz->o, &r->o_host)) ||
	    (ret = ape__host_alloc(r->dev, sz->rows * sizeof(float), &r->lse_host)) ||
	    (want_pairs &&
	     (ret = ape__host_alloc(r->dev, sz->rows * sizeof(uint64_t), &r->pairs_host))))
		return ape__error(ret, "%s: out of host memory for the outputs", fn);

	if ((ret = ops->queue_create(r->dev, &r->queue)))
		return ape__error_prefix(ret, fn);
	if ((ret = alloc_buf(r, sz->q, &r->q, "allocating q")) ||
	    (ret = alloc_buf(r, sz->kv, &r->k, "allocating k")) ||
	    (ret = alloc_buf(r, sz->kv, &r->v, "allocating v")) ||
	    (ret = alloc_buf(r, sz->o, &r->o, "allocating o")) ||
	    (ret = alloc_buf(r, sz->rows * sizeof(float), &r->lse, "allocating lse")) ||
	    (want_pairs &&
	     (ret = alloc_buf(r, sz->rows * sizeof(uint64_t), &r->pairs, "allocating stats"))))
		return ape__error_prefix(ret, fn);

	if ((ret = ops->copy_h2d(r->queue, r->q, 0, qsrc, sz->q)) ||
	    (ret = ops->copy_h2d(r->queue, r->k, 0, ksrc, sz->kv)) ||
	    (ret = ops->copy_h2d(r->queue, r->v, 0, vsrc, sz->kv)))
		return ape__error_prefix(ret, fn);
	if (r->dev->be->ctx->flags & APE_CONTEXT_POISON_OUTPUTS) {
		/* 0x7fc00001: a quiet NaN in f32; as two halves, 0x7fc0 (NaN in f16 and bf16) */
		const uint32_t poison = 0x7fc07fc0u;

		if ((ret = ops->fill(r->queue, r->o, 0, poison, sz->o)) ||
		    (ret = ops->fill(r->queue, r->lse, 0, poison, sz->rows * sizeof(float))))
			return ape__error_prefix(ret, fn);
	}

	fill_launch(&launch, p, r);
	if ((ret = ops->event_record(r->queue, &r->start)) ||
	    (ret = ops->attention(r->queue, &launch)) ||
	    (ret = ops->event_record(r->queue, &r->end)))
		return ape__error_prefix(ret, fn);
	if ((ret = ops->copy_d2h(r->queue, r->o_host.ptr, r->o, 0, sz->o)) ||
	    (ret = ops->copy_d2h(r->queue, r->lse_host.ptr, r->lse, 0, sz->rows * sizeof(float))) ||
	    (want_pairs && (ret = ops->copy_d2h(r->queue, r->pairs_host.ptr, r->pairs, 0,
						sz->rows * sizeof(uint64_t)))))
		return ape__error_prefix(ret, fn);
	if ((ret = ops->synchronize(r->queue)) ||
	    (ret = ops->event_elapsed(r->start, r->end, &kernel_ms)))
		return ape__error_prefix(ret, fn);
	if (st) {
		st->kernel_ms = kernel_ms;
		st->bytes_to_device = sz->q + 2 * sz->kv;
		st->bytes_from_device = sz->o + sz->rows * sizeof(float);
	}
	return 0;
}

/* Rows with no key at all (Lk = 0): O = 0, LSE = -inf, no device needed. */
static void write_empty(const struct ape__problem *p, ape_tensor *o, float *lse, size_t rows)
{
	size_t bytes = rows * (size_t)p->D * ape_dtype_size(p->out_dtype);
	void *zeros = calloc(1, bytes ? bytes : 1);

	if (zeros) {
		copy_rows(zeros, o, p->os, true);
		free(zeros);
	} else { /* no memory for a block of zeros: write element by element */
		const size_t esz = ape_dtype_size(p->out_dtype);

		for (int64_t b = 0; b < p->B; b++)
			for (int64_t h = 0; h < p->H; h++)
				for (int64_t i = 0; i < p->Lq; i++)
					for (int64_t d = 0; d < p->D; d++)
						memset((unsigned char *)o->data +
							       (size_t)(b * p->os[0] + h * p->os[1] +
									i * p->os[2] + d * p->os[3]) *
								       esz,
						       0, esz);
	}
	for (size_t r = 0; lse && r < rows; r++)
		lse[r] = -INFINITY;
}

int ape_attention_forward(ape_device *dev, const ape_attn_desc *desc, const ape_tensor *q,
			  const ape_tensor *k, const ape_tensor *v, ape_tensor *o, float *lse,
			  ape_stats *stats)
{
	const double t0 = now_ms();
	struct ape__problem p;
	struct run r;
	struct sizes sz;
	ape_stats st;
	uint64_t per_head;
	int ret;

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if (stats && stats->struct_size != sizeof(*stats))
		return ape__error(APE_EINVAL,
				  "%s: stats->struct_size = %zu: expected %zu (initialise with "
				  "ape_stats_init())",
				  fn, stats->struct_size, sizeof(*stats));
	if ((ret = ape__problem_init(&p, fn, desc, q, k, v, o, lse)))
		return ret;
	if (ape__head_visible_pairs(&p, &per_head)) {
		ape__problem_fini(&p);
		return ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", fn);
	}
	sz.rows = (size_t)(p.B * p.H * p.Lq);
	sz.q = sz.rows * (size_t)p.D * ape_dtype_size(p.in_dtype);
	sz.o = sz.rows * (size_t)p.D * ape_dtype_size(p.out_dtype);
	sz.kv = (size_t)(p.B * p.Hkv * p.Lk * p.D) * ape_dtype_size(p.in_dtype);

	memset(&r, 0, sizeof(r));
	r.dev = dev;
	r.ops = dev->be->ops;
	ape_stats_init(&st);
	if (sz.rows == 0) {
		ret = 0; /* empty result: nothing to write */
	} else if (p.Lk == 0) {
		write_empty(&p, o, lse, sz.rows);
		ret = 0;
	} else {
		ret = run_device(&r, &p, q, k, v, &sz, stats != NULL, &st);
		if (!ret) {
			const uint64_t *pairs = r.pairs_host.ptr;

			copy_rows(r.o_host.ptr, o, p.os, true);
			if (lse)
				memcpy(lse, r.lse_host.ptr, sz.rows * sizeof(float));
			for (size_t i = 0; stats && i < sz.rows; i++)
				st.pairs_computed += pairs[i];
		}
		run_release(&r);
	}
	if (!ret && stats) {
		snprintf(st.backend, sizeof(st.backend), "%s", dev->info.backend);
		snprintf(st.device, sizeof(st.device), "%s", dev->info.name);
		st.pairs_visible = per_head * (uint64_t)(p.B * p.H);
		st.total_ms = now_ms() - t0;
		*stats = st;
	}
	ape__problem_fini(&p);
	return ret;
}
