/* SPDX-License-Identifier: MIT */
/*
 * ape-check's conduct cells (tools/check/check.h), what no comparison with the reference shows:
 *
 * - determinism: the same call twice on one device gives the same bits: a forward streamed in
 *   chunks whose partial results merge, a backward (every gradient), a ragged batch;
 * - failures: a call with a bad argument fails with APE_EINVAL, its message naming the call and
 *   the argument, and writes nothing (outputs hold a sentinel before, and still do); a full KV
 *   cache refuses an append and keeps what it held; a device op that fails (an allocation no
 *   device can make) names the call, the device and the op; and after all that the device
 *   still computes the right answer.
 */
#include <ctype.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check/check.h"
#include "common/refcheck.h"

#define SENTINEL 0x5a

/* ------------------------------------------------------------------ determinism */

/* Records the cell of two runs' outputs a[i], b[i] of bytes[i] each (n of them). */
static void same_bits(const char *name, int d, int n, void *const *a, void *const *b,
		      const size_t *bytes, const char *const *labels)
{
	for (int i = 0; i < n; i++) {
		if (memcmp(a[i], b[i], bytes[i])) {
			size_t at = 0;

			while (((unsigned char *)a[i])[at] == ((unsigned char *)b[i])[at])
				at++;
			check_add(CHECK_DETERMINISM, name, d, CHECK_FAIL, NAN, NAN,
				  "%s differs between two identical calls (first at byte %zu of %zu)",
				  labels[i], at, bytes[i]);
			return;
		}
	}
	check_add(CHECK_DETERMINISM, name, d, CHECK_PASS, NAN, NAN,
		  "two identical calls gave the same bits");
}

/* A forward in 128 x 96 chunks (3 x 4 of them, merged by their LSE), twice. */
static int same_bits_forward(const struct check_env *env)
{
	static const char name[] = "same_bits_forward_streamed_bf16";
	static const char *const labels[] = { "O", "LSE" };
	const ape_dtype dt = APE_BF16;
	struct check_qkv x;
	ape_exec_options opts;
	ape_attn_desc desc;
	int ret = check_qkv_make(&x, env->rng, dt, 1, 4, 2, 300, 300, 64);
	const size_t rows = (size_t)(4 * 300), bytes[2] = { rows * 64 * 2, rows * sizeof(float) };
	void *a[2] = { malloc(bytes[0]), malloc(bytes[1]) }, *b[2] = { malloc(bytes[0]),
								    malloc(bytes[1]) };

	if (!ret && (!a[0] || !a[1] || !b[0] || !b[1]))
		ret = APE_ENOMEM;
	check_seed_desc(&desc);
	ape_exec_options_init(&opts);
	opts.chunk_q = 128;
	opts.chunk_k = 96;
	for (int d = 0; d < env->ndev && !ret; d++) {
		ape_tensor oa, ob;
		int r;

		ape_tensor_init(&oa, a[0], dt, 1, 4, 300, 64);
		ape_tensor_init(&ob, b[0], dt, 1, 4, 300, 64);
		r = ape_attention_forward_ex(&env->devs[d], 1, &opts, &desc, &x.tq, &x.tk, &x.tv,
					     &oa, a[1], NULL);
		if (!r)
			r = ape_attention_forward_ex(&env->devs[d], 1, &opts, &desc, &x.tq, &x.tk,
						     &x.tv, &ob, b[1], NULL);
		if (r)
			check_add_error(CHECK_DETERMINISM, name, d, env->devs[d], r, false);
		else
			same_bits(name, d, 2, a, b, bytes, labels);
	}
	for (int i = 0; i < 2; i++) {
		free(a[i]);
		free(b[i]);
	}
	check_qkv_free(&x);
	return ret;
}

/* Every gradient of a GQA backward with dLSE, twice. */
static int same_bits_backward(const struct check_env *env)
{
	static const char name[] = "same_bits_backward_f16";
	static const char *const labels[] = { "dQ", "dK", "dV", "dparams" };
	const ape_dtype dt = APE_F16;
	const int64_t H = 2, Hkv = 1, L = 70, D = 32;
	const size_t nq = (size_t)(H * L * D), nk = (size_t)(Hkv * L * D), rows = (size_t)(H * L);
	const size_t bytes[4] = { nq * 2, nk * 2, nk * 2, (size_t)(4 * H) * sizeof(float) };
	struct check_qkv x;
	ape_attn_desc desc;
	ape_tensor to, tdo;
	void *a[4] = { 0 }, *b[4] = { 0 }, *o = malloc(nq * 2), *dout = NULL;
	float *lse = malloc(rows * sizeof(float)), *dlse = malloc(rows * sizeof(float));
	int ret = check_qkv_make(&x, env->rng, dt, 1, H, Hkv, L, L, D);

	for (int i = 0; i < 4; i++)
		if (!(a[i] = malloc(bytes[i])) || !(b[i] = malloc(bytes[i])))
			ret = ret ? ret : APE_ENOMEM;
	if (!ret && (!o || !lse || !dlse || !(dout = ape_rng_array(env->rng, nq, dt, NULL))))
		ret = APE_ENOMEM;
	for (size_t i = 0; !ret && i < rows; i++)
		dlse[i] = (float)ape_rng_normal(env->rng);
	check_seed_desc(&desc);
	ape_tensor_init(&to, o, dt, 1, H, L, D);
	ape_tensor_init(&tdo, dout, dt, 1, H, L, D);
	if (!ret && (ret = ape_attention_forward(env->ref, &desc, &x.tq, &x.tk, &x.tv, &to, lse,
						 NULL)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		ape_tensor g[2][3];
		int r = 0;

		for (int run = 0; run < 2; run++) {
			void *const *p = run ? b : a;

			ape_tensor_init(&g[run][0], p[0], dt, 1, H, L, D);
			ape_tensor_init(&g[run][1], p[1], dt, 1, Hkv, L, D);
			ape_tensor_init(&g[run][2], p[2], dt, 1, Hkv, L, D);
			if (!r)
				r = ape_attention_backward(env->devs[d], &desc, &x.tq, &x.tk, &x.tv,
							   &to, lse, &tdo, dlse, &g[run][0],
							   &g[run][1], &g[run][2], p[3], NULL);
		}
		if (r)
			check_add_error(CHECK_DETERMINISM, name, d, env->devs[d], r, true);
		else
			same_bits(name, d, 4, a, b, bytes, labels);
	}
	for (int i = 0; i < 4; i++) {
		free(a[i]);
		free(b[i]);
	}
	free(o);
	free(dout);
	free(lse);
	free(dlse);
	check_qkv_free(&x);
	return ret;
}

/* A ragged batch of three sequences (one of them empty of queries), twice. */
static int same_bits_ragged(const struct check_env *env)
{
	static const char name[] = "same_bits_ragged_f16";
	static const char *const labels[] = { "O", "LSE" };
	static const int64_t cuq[4] = { 0, 30, 30, 37 }, cuk[4] = { 0, 30, 42, 101 };
	const ape_dtype dt = APE_F16;
	const int64_t H = 4, Hkv = 2, D = 64, tq = cuq[3], tk = cuk[3];
	const size_t bytes[2] = { (size_t)(tq * H * D) * 2, (size_t)(tq * H) * sizeof(float) };
	void *q = ape_rng_array(env->rng, (size_t)(tq * H * D), dt, NULL);
	void *k = ape_rng_array(env->rng, (size_t)(tk * Hkv * D), dt, NULL);
	void *v = ape_rng_array(env->rng, (size_t)(tk * Hkv * D), dt, NULL);
	void *a[2] = { malloc(bytes[0]), malloc(bytes[1]) }, *b[2] = { malloc(bytes[0]),
								    malloc(bytes[1]) };
	ape_tensor hq, hk, hv, oa, ob;
	ape_attn_desc desc;
	ape_varlen vl;
	int ret = q && k && v && a[0] && a[1] && b[0] && b[1] ? 0 : APE_ENOMEM;

	check_seed_desc(&desc);
	ape_varlen_init(&vl);
	vl.num_seqs = 3;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	ape_tensor_init_packed(&hq, q, dt, tq, H, D);
	ape_tensor_init_packed(&hk, k, dt, tk, Hkv, D);
	ape_tensor_init_packed(&hv, v, dt, tk, Hkv, D);
	ape_tensor_init_packed(&oa, a[0], dt, tq, H, D);
	ape_tensor_init_packed(&ob, b[0], dt, tq, H, D);
	for (int d = 0; d < env->ndev && !ret; d++) {
		int r = ape_attention_forward_varlen(env->devs[d], &desc, &vl, &hq, &hk, &hv, &oa,
						     a[1], NULL);

		if (!r)
			r = ape_attention_forward_varlen(env->devs[d], &desc, &vl, &hq, &hk, &hv, &ob,
							 b[1], NULL);
		if (r)
			check_add_error(CHECK_DETERMINISM, name, d, env->devs[d], r, true);
		else
			same_bits(name, d, 2, a, b, bytes, labels);
	}
	for (int i = 0; i < 2; i++) {
		free(a[i]);
		free(b[i]);
	}
	free(q);
	free(k);
	free(v);
	return ret;
}

int check_determinism(const struct check_env *env)
{
	int ret = same_bits_forward(env);

	if (!ret)
		ret = same_bits_backward(env);
	if (!ret)
		ret = same_bits_ragged(env);
	if (ret == APE_ENOMEM)
		fprintf(stderr, "ape-check: out of memory\n");
	return ret;
}

/* ------------------------------------------------------------------ failures */

/* Whether `word` occurs in msg as a name of its own (not inside a longer identifier). */
static bool names(const char *msg, const char *word)
{
	const size_t n = strlen(word);

	for (const char *p = msg; (p = strstr(p, word)); p++) {
		const bool before = p == msg || !(isalnum((unsigned char)p[-1]) || p[-1] == '_');
		const bool after = !(isalnum((unsigned char)p[n]) || p[n] == '_');

		if (before && after)
			return true;
	}
	return false;
}

/* Whether n bytes at p all hold the sentinel. */
static bool untouched(const void *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (((const unsigned char *)p)[i] != SENTINEL)
			return false;
	return true;
}

/* Host outputs of a failing call, filled with the sentinel: out[i] of bytes[i]. */
struct sentinel {
	void *out[4];
	size_t bytes[4];
	int n;
};

/*
 * Records the cell of a call that should have failed with `want` naming `call` and `arg`,
 * leaving every output of s untouched; msg is its message. APE_ENOTSUP naming the device makes it
 * not claimed where `optional`.
 */
static void expect_refusal(const char *name, int d, ape_device *dev, int ret, const char *msg,
			   int want, const char *call, const char *arg, const struct sentinel *s,
			   bool optional)
{

	if (optional && check_not_claimed(dev, ret, msg, 0)) {
		check_add(CHECK_FAILURES, name, d, CHECK_NOT_CLAIMED, NAN, NAN, "%s", msg);
		return;
	}
	if (ret != want) {
		check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
			  "%s returned %s, not %s%s%s", call, ret ? ape_err_name(ret) : "0",
			  ape_err_name(want), ret ? ": " : "", ret ? msg : "");
		return;
	}
	if (!names(msg, call) || (arg && !names(msg, arg))) {
		check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
			  "the message does not name %s%s%s: %s", call, arg ? " and " : "",
			  arg ? arg : "", msg);
		return;
	}
	for (int i = 0; s && i < s->n; i++) {
		if (!untouched(s->out[i], s->bytes[i])) {
			check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
				  "%s failed (%s) but wrote output %d", call, ape_err_name(ret), i);
			return;
		}
	}
	check_add(CHECK_FAILURES, name, d, CHECK_PASS, NAN, NAN, "%s: %s", ape_err_name(ret), msg);
}

static void fill(struct sentinel *s)
{
	for (int i = 0; i < s->n; i++)
		memset(s->out[i], SENTINEL, s->bytes[i]);
}

#define FB 1
#define FH 2
#define FHKV 1
#define FL 8
#define FD 16

/* The host calls' argument checks, on a small float32 problem. */
static int refusals(const struct check_env *env, const struct check_qkv *x)
{
	static const int64_t cuq[3] = { 0, 5, 3 }, cuk[3] = { 0, 4, 8 };
	const size_t nq = FB * FH * FL * FD, nk = FB * FHKV * FL * FD, rows = FB * FH * FL;
	float *buf = malloc((2 * nq + 2 * rows + 2 * nk + 4 * FH + nq) * sizeof(float));
	float *o = buf, *lse = o + nq, *dq = lse + rows, *dk = dq + nq, *dv = dk + nk;
	float *dp = dv + nk, *dlse = dp + 4 * FH, *dout = dlse + rows;
	struct sentinel fwd = { { o, lse }, { nq * 4, rows * 4 }, 2 };
	struct sentinel bwd = { { dq, dk, dv, dp }, { nq * 4, nk * 4, nk * 4, 4 * FH * 4 }, 4 };
	ape_tensor to, tk, tdq, tdk, tdv, tdo, hq, hk, hv;
	ape_attn_desc desc;
	ape_varlen vl;

	if (!buf)
		return APE_ENOMEM;
	for (size_t i = 0; i < nq; i++)
		dout[i] = (float)ape_rng_normal(env->rng);
	for (size_t i = 0; i < rows; i++)
		dlse[i] = 0;
	ape_tensor_init(&to, o, APE_F32, FB, FH, FL, FD);
	ape_tensor_init(&tdq, dq, APE_F32, FB, FH, FL + 1, FD); /* one row too many */
	ape_tensor_init(&tdk, dk, APE_F32, FB, FHKV, FL, FD);
	ape_tensor_init(&tdv, dv, APE_F32, FB, FHKV, FL, FD);
	ape_tensor_init(&tdo, dout, APE_F32, FB, FH, FL, FD);
	ape_varlen_init(&vl);
	vl.num_seqs = 2;
	vl.cu_seqlens_q = cuq; /* decreasing */
	vl.cu_seqlens_k = cuk;
	ape_tensor_init_packed(&hq, x->q, APE_F32, 5, FH, FD);
	ape_tensor_init_packed(&hk, x->k, APE_F32, 8, FHKV, FD);
	ape_tensor_init_packed(&hv, x->v, APE_F32, 8, FHKV, FD);
	for (int d = 0; d < env->ndev; d++) {
		ape_device *dev = env->devs[d];
		ape_tensor o5;
		int r;

		check_seed_desc(&desc);
		fill(&fwd);
		r = ape_attention_forward(dev, &desc, NULL, &x->tk, &x->tv, &to, lse, NULL);
		expect_refusal("forward_null_q", d, dev, r, ape_last_error(), APE_EINVAL,
			       "ape_attention_forward", "q", &fwd, false);

		tk = x->tk;
		tk.shape[3] = FD - 2; /* k's D not q's */
		fill(&fwd);
		r = ape_attention_forward(dev, &desc, &x->tq, &tk, &x->tv, &to, lse, NULL);
		expect_refusal("forward_k_shape_mismatch", d, dev, r, ape_last_error(), APE_EINVAL,
			       "ape_attention_forward", "k", &fwd, false);

		desc.lambda.value = -1; /* lambda >= 0 */
		fill(&fwd);
		r = ape_attention_forward(dev, &desc, &x->tq, &x->tk, &x->tv, &to, lse, NULL);
		expect_refusal("forward_negative_lambda", d, dev, r, ape_last_error(), APE_EINVAL,
			       "ape_attention_forward", "lambda", &fwd, false);

		check_seed_desc(&desc);
		fill(&bwd);
		r = ape_attention_backward(dev, &desc, &x->tq, &x->tk, &x->tv, &to, lse, &tdo, dlse,
					   &tdq, &tdk, &tdv, dp, NULL);
		expect_refusal("backward_dq_shape_mismatch", d, dev, r, ape_last_error(), APE_EINVAL,
			       "ape_attention_backward", "dq", &bwd, true);

		fill(&fwd);
		ape_tensor_init_packed(&o5, o, APE_F32, 5, FH, FD);
		r = ape_attention_forward_varlen(dev, &desc, &vl, &hq, &hk, &hv, &o5, lse, NULL);
		expect_refusal("varlen_decreasing_offsets", d, dev, r, ape_last_error(), APE_EINVAL,
			       "ape_attention_forward_varlen", "cu_seqlens_q", &fwd, false);
	}
	free(buf);
	return 0;
}

/* The refusal of an enqueue whose outputs are bo and bl: named, and nothing enqueued (their
 * sentinel still there once the queue is synchronised: s holds their host copies). */
static void check_enqueue_refusal(const char *name, int d, ape_device *dev, ape_queue *queue,
				  ape_buffer *bo, ape_buffer *bl, struct sentinel *s)
{
	char msg[512];
	int r;

	snprintf(msg, sizeof(msg), "%s", ape_last_error());
	memset(s->out[0], 0, s->bytes[0]);
	memset(s->out[1], 0, s->bytes[1]);
	r = ape_buffer_read(queue, s->out[0], bo, 0, ape_buffer_size(bo));
	if (!r)
		r = ape_buffer_read(queue, s->out[1], bl, 0, ape_buffer_size(bl));
	if (!r)
		r = ape_queue_synchronize(queue);
	if (r) {
		check_add_error(CHECK_FAILURES, name, d, dev, r, false);
		return;
	}
	memset((char *)s->out[0] + ape_buffer_size(bo), SENTINEL,
	       s->bytes[0] - ape_buffer_size(bo)); /* past the buffer */
	expect_refusal(name, d, dev, APE_EINVAL, msg, APE_EINVAL, "ape_attention_enqueue", "o", s,
		       false);
}

/* A device tensor one element past its buffer: refused before anything is enqueued, so the
 * output buffer keeps its sentinel. */
static void outside_buffer(const struct check_env *env, const struct check_qkv *x, int d)
{
	static const char name[] = "enqueue_tensor_outside_buffer";
	const size_t nq = FB * FH * FL * FD, nk = FB * FHKV * FL * FD, rows = FB * FH * FL;
	ape_device *dev = env->devs[d];
	ape_buffer *bq = NULL, *bk = NULL, *bv = NULL, *bo = NULL, *bl = NULL;
	unsigned char *host = malloc(nq * 4 + rows * 4);
	struct sentinel s = { { host, host + nq * 4 }, { nq * 4, rows * 4 }, 2 };
	ape_dtensor q, k, v, o, l;
	ape_queue *queue = NULL;
	ape_attn_desc desc;
	int r = host ? ape_queue_create(dev, &queue) : APE_ENOMEM;

	if (!r)
		r = ape_buffer_alloc(dev, nq * 4, &bq);
	if (!r)
		r = ape_buffer_alloc(dev, nk * 4, &bk);
	if (!r)
		r = ape_buffer_alloc(dev, nk * 4, &bv);
	if (!r)
		r = ape_buffer_alloc(dev, nq * 4 - 4, &bo); /* one element short */
	if (!r)
		r = ape_buffer_alloc(dev, rows * 4, &bl);
	if (host)
		fill(&s);
	if (!r)
		r = ape_buffer_write(queue, bq, 0, x->q, nq * 4);
	if (!r)
		r = ape_buffer_write(queue, bk, 0, x->k, nk * 4);
	if (!r)
		r = ape_buffer_write(queue, bv, 0, x->v, nk * 4);
	if (!r)
		r = ape_buffer_write(queue, bo, 0, host, nq * 4 - 4);
	if (!r)
		r = ape_buffer_write(queue, bl, 0, host + nq * 4, rows * 4);
	if (!r)
		r = ape_queue_synchronize(queue);
	if (r) {
		check_add_error(CHECK_FAILURES, name, d, dev, r, false);
	} else {
		check_seed_desc(&desc);
		ape_dtensor_init(&q, bq, 0, APE_F32, FB, FH, FL, FD);
		ape_dtensor_init(&k, bk, 0, APE_F32, FB, FHKV, FL, FD);
		ape_dtensor_init(&v, bv, 0, APE_F32, FB, FHKV, FL, FD);
		ape_dtensor_init(&o, bo, 0, APE_F32, FB, FH, FL, FD);
		ape_dtensor_init(&l, bl, 0, APE_F32, FB, FH, FL, 1);
		r = ape_attention_enqueue(queue, &desc, &q, &k, &v, &o, &l);
		if (r == APE_EINVAL)
			check_enqueue_refusal(name, d, dev, queue, bo, bl, &s);
		else
			expect_refusal(name, d, dev, r, ape_last_error(), APE_EINVAL,
				       "ape_attention_enqueue", "o", NULL, true);
		if (!r)
			ape_queue_synchronize(queue);
	}
	ape_buffer_free(bq);
	ape_buffer_free(bk);
	ape_buffer_free(bv);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
	ape_queue_destroy(queue);
	free(host);
}

/* A KV cache of 16 tokens holding 10 refuses 10 more with APE_ENOMEM, keeps its 10, and still
 * attends. */
static void full_cache(const struct check_env *env, const struct check_qkv *x, int d)
{
	static const char name[] = "kv_cache_full_keeps_tokens";
	ape_device *dev = env->devs[d];
	ape_kv_cache_options opts;
	ape_kv_cache_info info;
	ape_kv_cache *cache;
	ape_attn_desc desc;
	ape_tensor k, v, q, o;
	float out[FB * FH * FD], lse[FB * FH];
	char msg[512];
	int r, ra;

	ape_kv_cache_options_init(&opts);
	opts.B = FB;
	opts.Hkv = FHKV;
	opts.H = FH;
	opts.D = FD;
	opts.dtype = APE_F32;
	opts.block_tokens = 16;
	opts.capacity_tokens = 16;
	check_seed_desc(&desc);
	if ((r = ape_kv_cache_create(dev, &opts, &cache))) {
		check_add_error(CHECK_FAILURES, name, d, dev, r, true);
		return;
	}
	ape_tensor_init(&k, x->k, APE_F32, FB, FHKV, 10, FD);
	ape_tensor_init(&v, x->v, APE_F32, FB, FHKV, 10, FD);
	k.strides[0] = v.strides[0] = FHKV * FL * FD; /* rows of the [FB, FHKV, FL, FD] arrays */
	k.strides[1] = v.strides[1] = FL * FD;
	k.strides[2] = v.strides[2] = FD;
	k.strides[3] = v.strides[3] = 1;
	k.shape[2] = v.shape[2] = 5; /* 10 tokens: 5 and 5 */
	r = ape_kv_cache_append(cache, &k, &v);
	if (!r)
		r = ape_kv_cache_append(cache, &k, &v);
	if (r) {
		check_add_error(CHECK_FAILURES, name, d, dev, r, true);
		ape_kv_cache_destroy(cache);
		return;
	}
	k.shape[2] = v.shape[2] = 7; /* 17 > 16 */
	r = ape_kv_cache_append(cache, &k, &v);
	snprintf(msg, sizeof(msg), "%s", ape_last_error());
	ape_kv_cache_get_info(cache, &info);
	ape_tensor_init(&q, x->q, APE_F32, FB, FH, 1, FD);
	ape_tensor_init(&o, out, APE_F32, FB, FH, 1, FD);
	if (r == APE_ENOMEM && info.tokens != 10)
		check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
			  "a refused append changed the cache: %" PRId64 " tokens, not 10",
			  info.tokens);
	else if (r == APE_ENOMEM && (ra = ape_kv_cache_attend(cache, &desc, &q, &o, lse, NULL)))
		check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
			  "the attend after a refused append: %s: %s", ape_err_name(ra),
			  ape_last_error());
	else
		expect_refusal(name, d, dev, r, msg, APE_ENOMEM, "ape_kv_cache_append", NULL, NULL,
			       false);
	ape_kv_cache_destroy(cache);
}

/* An allocation no device can make: the backend's buf_alloc fails, and the message names the
 * call, the device and the op. */
static void failing_op(const struct check_env *env, int d)
{
	static const char name[] = "device_op_failure_named";
	ape_device *dev = env->devs[d];
	ape_buffer *b = (ape_buffer *)&b; /* set to NULL by the call */
	int r = ape_buffer_alloc(dev, (size_t)1 << 62, &b);
	const char *msg = ape_last_error();

	if (!r) {
		ape_buffer_free(b);
		check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
			  "ape_buffer_alloc of 2^62 bytes succeeded");
	} else if (b) {
		check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
			  "ape_buffer_alloc failed (%s) but left *out set", ape_err_name(r));
	} else if (!names(msg, "ape_buffer_alloc") || !check_names_device(dev, msg) ||
		   !names(msg, "buf_alloc")) {
		check_add(CHECK_FAILURES, name, d, CHECK_FAIL, NAN, NAN,
			  "the message does not name the call, the device and the op (buf_alloc): "
			  "%s",
			  msg);
	} else {
		check_add(CHECK_FAILURES, name, d, CHECK_PASS, NAN, NAN, "%s: %s", ape_err_name(r),
			  msg);
	}
}

/* After every failure above: the device still gives the reference's answer. */
static int still_right(const struct check_env *env, const struct check_qkv *x)
{
	static const char *const labels[] = { "O", "LSE" };
	static const char name[] = "right_after_failures";
	const size_t nq = FB * FH * FL * FD, rows = FB * FH * FL;
	float want[FB * FH * FL * FD], wl[FB * FH * FL], got[FB * FH * FL * FD], gl[FB * FH * FL];
	ape_attn_desc desc;
	ape_tensor o;
	int ret;

	check_seed_desc(&desc);
	ape_tensor_init(&o, want, APE_F32, FB, FH, FL, FD);
	if ((ret = ape_attention_forward(env->ref, &desc, &x->tq, &x->tk, &x->tv, &o, wl, NULL))) {
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
		return ret;
	}
	ape_tensor_init(&o, got, APE_F32, FB, FH, FL, FD);
	for (int d = 0; d < env->ndev; d++) {
		double err[2], tol[2] = { refcheck_tol_o(APE_F32), refcheck_tol_lse(APE_F32) };
		int r = ape_attention_forward(env->devs[d], &desc, &x->tq, &x->tk, &x->tv, &o, gl,
					      NULL);

		if (r) {
			check_add_error(CHECK_FAILURES, name, d, env->devs[d], r, false);
			continue;
		}
		err[0] = check_err_abs(got, want, nq, check_max_abs(x->vf, FB * FHKV * FL * FD));
		err[1] = check_err_rel(gl, wl, rows);
		check_add_errors(CHECK_FAILURES, name, d, 2, labels, err, tol);
	}
	return 0;
}

int check_failures(const struct check_env *env)
{
	struct check_qkv x;
	int ret = check_qkv_make(&x, env->rng, APE_F32, FB, FH, FHKV, FL, FL, FD);

	if (!ret)
		ret = refusals(env, &x);
	for (int d = 0; d < env->ndev && !ret; d++) {
		outside_buffer(env, &x, d);
		full_cache(env, &x, d);
		failing_op(env, d);
	}
	if (!ret)
		ret = still_right(env, &x);
	check_qkv_free(&x);
	if (ret == APE_ENOMEM)
		fprintf(stderr, "ape-check: out of memory\n");
	return ret;
}
