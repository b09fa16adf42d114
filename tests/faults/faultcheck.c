/* SPDX-License-Identifier: MIT */
#include "faultcheck.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape_dlpack.h"

static bool diag_mode(enum fx_mode m)
{
	return m == FX_DIAG || m == FX_KV_DIAG || m == FX_ENQUEUE_DIAG || m == FX_DLPACK_DIAG;
}

static void poison(fx_call *c)
{
	test_problem *tp = &c->tp;

	test_tensor_poison(&tp->o.t);
	for (size_t i = 0; tp->lse && i < tp->rows; i++)
		tp->lse[i] = NAN;
	for (size_t i = 0; c->ent && i < tp->rows; i++)
		c->ent[i] = c->md[i] = NAN;
}

/* The tokens [from, from + n) of a contiguous [1, Hkv, L, D] tensor (B = Hkv = 1 here). */
static ape_tensor slice(const ape_tensor *t, int64_t from, int64_t n)
{
	ape_tensor s;

	ape_tensor_init(&s, (float *)t->data + from * t->shape[3], t->dtype, 1, 1, n, t->shape[3]);
	return s;
}

/* ape_kv_cache_append_device() of the host tensors k and v (contiguous, [1, 1, n, D] float32):
 * written to two buffers of dev on a queue of its own, appended, everything released. */
static int append_device(ape_kv_cache *cache, ape_device *dev, const ape_tensor *k,
			 const ape_tensor *v)
{
	const ape_tensor *h[2] = { k, v };
	const size_t bytes = (size_t)(k->shape[2] * k->shape[3]) * sizeof(float);
	ape_buffer *b[2] = { NULL, NULL };
	ape_dtensor dt[2];
	ape_queue *q = NULL;
	int ret = ape_queue_create(dev, &q);

	for (int i = 0; i < 2 && !ret; i++) {
		ret = ape_buffer_alloc(dev, bytes, &b[i]);
		if (!ret)
			ret = ape_buffer_write(q, b[i], 0, h[i]->data, bytes);
		ape_dtensor_init(&dt[i], b[i], 0, APE_F32, 1, 1, k->shape[2], k->shape[3]);
	}
	if (!ret)
		ret = ape_kv_cache_append_device(cache, q, &dt[0], &dt[1]);
	ape_queue_destroy(q); /* waits for what was enqueued, before the buffers go */
	ape_buffer_free(b[0]);
	ape_buffer_free(b[1]);
	return ret;
}

static int run_kv(fx_call *c)
{
	test_problem *tp = &c->tp;
	int64_t L = tp->k.t.shape[2], first = L * 3 / 5;
	ape_kv_cache_options ko;
	ape_kv_cache *cache = NULL;
	ape_tensor k, v;
	int ret;

	ape_kv_cache_options_init(&ko);
	ko.B = 1;
	ko.H = tp->q.t.shape[1];
	ko.Hkv = 1;
	ko.D = tp->q.t.shape[3];
	ko.dtype = APE_F32;
	ko.block_tokens = 16; /* several blocks, gathered into several key chunks */
	ko.capacity_tokens = L + 16;
	ko.max_queries = tp->q.t.shape[2];
	ko.append_chunk = 32;
	ko.attend_chunk = 32;
	if (c->mode == FX_KV_DEVICE) { /* releases nothing here: skip_tol is 0 */
		ko.allow_release = true;
		ko.max_query_norm = 1e30;
	}
	ret = ape_kv_cache_create(c->devs[0], &ko, &cache);
	if (ret)
		return ret;
	k = slice(&tp->k.t, 0, first);
	v = slice(&tp->v.t, 0, first);
	ret = ape_kv_cache_append(cache, &k, &v);
	if (!ret) {
		k = slice(&tp->k.t, first, L - first);
		v = slice(&tp->v.t, first, L - first);
		ret = c->mode == FX_KV_DEVICE ? append_device(cache, c->devs[0], &k, &v)
					      : ape_kv_cache_append(cache, &k, &v);
	}
	if (!ret && c->mode == FX_KV_DEVICE)
		ret = ape_kv_cache_release_unreachable(cache, &tp->desc, NULL);
	if (!ret && c->ent)
		ret = ape_kv_cache_attend_diag(cache, &tp->desc, &tp->q.t, &tp->o.t, tp->lse,
					       c->ent, c->md, NULL);
	else if (!ret)
		ret = ape_kv_cache_attend(cache, &tp->desc, &tp->q.t, &tp->o.t, tp->lse, NULL);
	ape_kv_cache_destroy(cache);
	return ret;
}

/* The resident path: the inputs written to device buffers, the call enqueued, O and LSE (and
 * the diagnostics) read back, then one synchronisation; everything released whatever failed. */
static int run_enqueue(fx_call *c)
{
	test_problem *tp = &c->tp;
	const ape_tensor *t[4] = { &tp->q.t, &tp->k.t, &tp->v.t, &tp->o.t };
	float *diag[2] = { c->ent, c->md };
	ape_buffer *b[7] = { NULL };
	ape_dtensor dt[7];
	ape_queue *q = NULL;
	size_t bytes[7];
	const int nb = c->ent ? 7 : 5;
	int ret = ape_queue_create(c->devs[0], &q);

	for (int i = 0; i < nb && !ret; i++) {
		const int64_t *d = i < 4 ? t[i]->shape : tp->o.t.shape;

		bytes[i] = (size_t)(d[0] * d[1] * d[2] * (i < 4 ? d[3] : 1)) * sizeof(float);
		ret = ape_buffer_alloc(c->devs[0], bytes[i], &b[i]);
		if (!ret)
			ape_dtensor_init(&dt[i], b[i], 0, APE_F32, d[0], d[1], d[2],
					 i < 4 ? d[3] : 1);
		if (!ret && i < 3)
			ret = ape_buffer_write(q, b[i], 0, t[i]->data, bytes[i]);
	}
	if (!ret && c->ent)
		ret = ape_attention_enqueue_diag(q, &tp->desc, &dt[0], &dt[1], &dt[2], &dt[3],
						 tp->lse ? &dt[4] : NULL, &dt[5], &dt[6]);
	else if (!ret)
		ret = ape_attention_enqueue(q, &tp->desc, &dt[0], &dt[1], &dt[2], &dt[3],
					    tp->lse ? &dt[4] : NULL);
	if (!ret)
		ret = ape_buffer_read(q, tp->o.t.data, b[3], 0, bytes[3]);
	if (!ret && tp->lse)
		ret = ape_buffer_read(q, tp->lse, b[4], 0, bytes[4]);
	for (int i = 5; i < nb && !ret; i++)
		ret = ape_buffer_read(q, diag[i - 5], b[i], 0, bytes[i]);
	if (!ret)
		ret = ape_queue_synchronize(q);
	ape_queue_destroy(q); /* waits for what was enqueued, before the buffers go */
	for (int i = 0; i < nb; i++)
		ape_buffer_free(b[i]);
	return ret;
}

/* The DLPack call on the problem's host tensors (contiguous: strides NULL); with entropy and
 * mean distance (ape_attention_forward_dlpack_diag(), [B, H, Lq] like LSE) when c has them. */
static int run_dlpack(fx_call *c)
{
	test_problem *tp = &c->tp;
	ape_tensor *t[4] = { &tp->q.t, &tp->k.t, &tp->v.t, &tp->o.t };
	void *rows[3] = { tp->lse, c->ent, c->md };
	DLTensor dl[7];

	/* q, k, v, o; then LSE, entropy, mean distance, each over o's first three dimensions */
	for (int i = 0; i < 7; i++)
		dl[i] = (DLTensor){ .data = i < 4 ? t[i]->data : rows[i - 4],
				    .device = { kDLCPU, 0 },
				    .ndim = i < 4 ? 4 : 3,
				    .dtype = { kDLFloat, 32, 1 },
				    .shape = t[i < 4 ? i : 3]->shape };
	if (c->ent)
		return ape_attention_forward_dlpack_diag(c->devs[0], &tp->desc, &dl[0], &dl[1],
							 &dl[2], &dl[3], tp->lse ? &dl[4] : NULL,
							 &dl[5], &dl[6], NULL);
	return ape_attention_forward_dlpack(c->devs[0], &tp->desc, &dl[0], &dl[1], &dl[2], &dl[3],
					    tp->lse ? &dl[4] : NULL, NULL);
}

int fx_call_run(fx_call *c)
{
	int ret;

	poison(c);
	c->msg[0] = 0;
	if (c->kv)
		ret = run_kv(c);
	else if (c->mode == FX_ENQUEUE || c->mode == FX_ENQUEUE_DIAG)
		ret = run_enqueue(c);
	else if (c->mode == FX_DLPACK || c->mode == FX_DLPACK_DIAG)
		ret = run_dlpack(c);
	else if (c->mode == FX_DIAG)
		ret = ape_attention_forward_diag(c->devs, c->ndev, &c->eo, &c->tp.desc, &c->tp.q.t,
						 &c->tp.k.t, &c->tp.v.t, &c->tp.o.t, c->tp.lse,
						 c->ent, c->md, NULL);
	else
		ret = ape_attention_forward_ex(c->devs, c->ndev, &c->eo, &c->tp.desc, &c->tp.q.t,
					       &c->tp.k.t, &c->tp.v.t, &c->tp.o.t, c->tp.lse, NULL);
	if (ret)
		snprintf(c->msg, sizeof(c->msg), "%s", ape_last_error());
	return ret;
}

/* The four arrays of the diagnostics modes, rows floats each. -1 when out of memory. */
static int diag_alloc(fx_call *c, size_t rows)
{
	float **a[4] = { &c->ent, &c->md, &c->want_ent, &c->want_md };
	int ret = 0;

	for (int i = 0; i < 4; i++) {
		*a[i] = malloc(rows * sizeof(float) + 4);
		ret |= *a[i] ? 0 : -1;
	}
	return ret;
}

int fx_call_init(fx_call *c, ape_device *const *devs, int ndev, enum fx_mode mode, int64_t L,
		 int64_t chunk)
{
	const bool kv = mode == FX_KV || mode == FX_KV_DIAG || mode == FX_KV_DEVICE;
	/* KV: a few decode-like queries after the cache (D = 32: where the OpenCL decode reads
	 * the blocks in place); forward: a square problem */
	const test_problem_shape sh = { 1, 2, kv ? 2 : 1, kv ? 4 : L, L, kv ? 32 : 16 };
	ape_rng rng;
	int ret;

	memset(c, 0, sizeof(*c));
	c->ndev = ndev;
	c->kv = kv;
	c->mode = mode;
	c->exact = ndev == 1;
	for (int d = 0; d < ndev; d++)
		c->devs[d] = devs[d];
	ape_exec_options_init(&c->eo);
	c->eo.chunk_q = c->eo.chunk_k = chunk;
	c->cq = chunk && !kv ? chunk : sh.Lq;
	ape_rng_init(&rng, "faults");
	if (kv) /* the cache keeps one key head */
		ret = test_problem_make(&c->tp, &rng,
					&(test_problem_shape){ 1, 2, 1, sh.Lq, L, sh.D }, APE_F32,
					false);
	else
		ret = test_problem_make(&c->tp, &rng, &sh, APE_F32, false);
	if (ret)
		return APE_ENOMEM;
	test_problem_set_params(&c->tp, 0.3, 0.02, 0.02, 0.1);
	c->tp.desc.skip_tol = 0; /* every chunk pair is launched: the most operations to break */
	if (test_problem_clone(&c->inputs, &c->tp))
		return APE_ENOMEM;
	if (diag_mode(mode) && diag_alloc(c, c->tp.rows))
		return APE_ENOMEM;
	ret = fx_call_run(c);
	if (ret)
		return ret;
	if (test_problem_clone(&c->want, &c->tp))
		return APE_ENOMEM;
	if (c->tp.lse) /* the clone allocates LSE without copying it */
		memcpy(c->want.lse, c->tp.lse, c->tp.rows * sizeof(float));
	if (c->ent) {
		memcpy(c->want_ent, c->ent, c->tp.rows * sizeof(float));
		memcpy(c->want_md, c->md, c->tp.rows * sizeof(float));
	}
	return 0;
}

int fx_call_clone(fx_call *dst, const fx_call *src, ape_device *dev)
{
	*dst = *src;
	dst->devs[0] = dev;
	memset(&dst->want, 0, sizeof(dst->want));
	memset(&dst->inputs, 0, sizeof(dst->inputs));
	if (test_problem_clone(&dst->tp, &src->tp) || test_problem_clone(&dst->want, &src->want) ||
	    test_problem_clone(&dst->inputs, &src->inputs))
		return APE_ENOMEM;
	if (src->want.lse) /* the clone allocates LSE without copying it */
		memcpy(dst->want.lse, src->want.lse, src->want.rows * sizeof(float));
	if (src->ent) {
		if (diag_alloc(dst, src->tp.rows))
			return APE_ENOMEM;
		memcpy(dst->want_ent, src->want_ent, src->tp.rows * sizeof(float));
		memcpy(dst->want_md, src->want_md, src->tp.rows * sizeof(float));
	}
	return 0;
}

const char *fx_no_host_memory(ape_device *dev)
{
	static _Thread_local char why[512];
	float x[4];
	ape_buffer *b = NULL;
	int ret = ape_buffer_wrap_host(dev, x, sizeof(x), &b);

	ape_buffer_free(b);
	if (!ret)
		return NULL;
	snprintf(why, sizeof(why), "%s", ape_last_error());
	return why;
}

void fx_call_free(fx_call *c)
{
	test_problem_free(&c->tp);
	test_problem_free(&c->want);
	test_problem_free(&c->inputs);
	free(c->ent);
	free(c->md);
	free(c->want_ent);
	free(c->want_md);
}

/* -1: every value of the row is NaN (untouched); 1: it equals the clean row; 0: neither. */
static int row_state(const fx_call *c, int64_t h, int64_t i)
{
	const ape_tensor *o = &c->tp.o.t, *w = &c->want.o.t;
	size_t r = (size_t)(h * o->shape[2] + i);
	double scale = fmax(test_tensor_maxabs(&c->tp.v.t), 1e-30);
	bool all_nan = true, same = true;

	for (int64_t d = 0; d < o->shape[3]; d++) {
		double got = test_tensor_get(o, 0, h, i, d), want = test_tensor_get(w, 0, h, i, d);

		all_nan &= isnan(got);
		same &= c->exact ? got == want : fabs(got - want) <= test_tol_o(APE_F32) * scale;
	}
	if (c->ent) { /* the diagnostics (clean rows: no NaN) at LSE's tolerance, MD's scale L */
		const double tol = test_tol_lse(APE_F32);

		all_nan &= isnan(c->ent[r]) && isnan(c->md[r]);
		same &= c->exact ? c->ent[r] == c->want_ent[r] && c->md[r] == c->want_md[r]
				 : fabs(c->ent[r] - c->want_ent[r]) <= tol * 16 &&
					   fabs(c->md[r] - c->want_md[r]) <=
						   tol * (double)c->tp.k.t.shape[2];
	}
	if (!c->tp.lse)
		return all_nan ? -1 : same ? 1 : 0;
	all_nan &= isnan(c->tp.lse[r]);
	same &= c->exact ? c->tp.lse[r] == c->want.lse[r]
			 : fabs(c->tp.lse[r] - c->want.lse[r]) <=
				   test_tol_lse(APE_F32) * fmax(1, fabs(c->want.lse[r]));
	return all_nan ? -1 : same ? 1 : 0;
}

const char *fx_call_verify(fx_call *c, int ret)
{
	static _Thread_local char why[256];
	const test_tensor *now[3] = { &c->tp.q, &c->tp.k, &c->tp.v };
	const test_tensor *then[3] = { &c->inputs.q, &c->inputs.k, &c->inputs.v };
	int64_t H = c->tp.o.t.shape[1], Lq = c->tp.o.t.shape[2];
	long long held = 0, of = 0, written = 0;
	bool in_place;
	const char *m;

	for (int i = 0; i < 3; i++)
		if (memcmp(now[i]->alloc, then[i]->alloc, now[i]->alloc_bytes))
			return "an input changed";
	if (ret && !c->msg[0])
		return "an error without a message";
	if (ret && (c->mode == FX_ENQUEUE || c->mode == FX_ENQUEUE_DIAG || c->mode == FX_DLPACK ||
		    c->mode == FX_DLPACK_DIAG))
		return NULL; /* O and LSE unspecified after a failure */
	/* a device computing on host memory wrote O and LSE in place: the chunks the message says
	 * are held must be clean, the others may hold anything */
	in_place = ret && strstr(c->msg, "computed in place and are unspecified");
	m = ret ? strstr(c->msg, "O and LSE hold ") : NULL;
	if (m && sscanf(m, "O and LSE hold %lld of %lld", &held, &of) != 2)
		return "unreadable 'O and LSE hold' message";
	for (int64_t q0 = 0; q0 < Lq; q0 += c->cq) {
		int state = row_state(c, 0, q0);

		if (in_place) { /* a clean chunk: every row of it */
			for (int64_t h = 0; h < H && state == 1; h++)
				for (int64_t i = q0; i < q0 + c->cq && i < Lq && state == 1; i++)
					state = row_state(c, h, i);
			written += state == 1;
			continue;
		}
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = q0; i < q0 + c->cq && i < Lq; i++)
				if (row_state(c, h, i) != state || state == 0) {
					snprintf(why, sizeof(why),
						 "head %lld row %lld: %s", (long long)h,
						 (long long)i, state ? "a query chunk partly written"
								     : "a row neither clean nor untouched");
					return why;
				}
		written += state == 1;
	}
	if (!ret && written * c->cq < Lq)
		return "a successful call left rows unwritten";
	if (in_place && written < held) {
		snprintf(why, sizeof(why), "%lld query chunks clean, the message says %lld held",
			 written, held);
		return why;
	}
	if (ret && !in_place && written != held) {
		snprintf(why, sizeof(why), "%lld query chunks written, the message says %lld",
			 written, held);
		return why;
	}
	return NULL;
}
