/* SPDX-License-Identifier: MIT */
/*
 * ape-check's KV cells (tools/check/check.h): the same sequence of appends, forks and attends on
 * each device and on the reference, every attend's O and LSE compared at the spec's tolerances:
 * a KV cache (a chunked prefill, then decode steps, then the diagnostics over the cache), a KV
 * pool (sequences at their own positions in awkward pages, a fork whose shared page is copied on
 * write, a batch append, an attend of the fork alone and one ragged attend of every sequence),
 * and the caller's pages (ape_paged_kv over device buffers through a CSR page table whose
 * sequences share a page). A call the device cannot do (the pool's ragged attend needs ragged
 * launches, the caller's pages strided device copies, the diagnostics their capability)
 * answers APE_ENOTSUP naming the device: not claimed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check/check.h"
#include "common/refcheck.h"

/* An attend's outputs, float32, and their comparison with the reference's. */
struct kv_out {
	float *o, *lse, *ent, *md;
};

static void kv_out_free(struct kv_out *x)
{
	free(x->o);
	free(x->lse);
	free(x->ent);
	free(x->md);
	memset(x, 0, sizeof(*x));
}

static int kv_out_make(struct kv_out *x, size_t rows, int64_t D)
{
	x->o = check_nan_floats(rows * (size_t)D);
	x->lse = check_nan_floats(rows);
	x->ent = check_nan_floats(rows);
	x->md = check_nan_floats(rows);
	return x->o && x->lse && x->ent && x->md ? 0 : APE_ENOMEM;
}

/* The errors of O and LSE (of `rows` rows of D) against want's, folded into err[0..1]. */
static void kv_errors(const struct kv_out *got, const struct kv_out *want, size_t rows,
		      int64_t D, double vmax, double err[2])
{
	err[0] = fmax(err[0], check_err_abs(got->o, want->o, rows * (size_t)D, vmax));
	err[1] = fmax(err[1], check_err_rel(got->lse, want->lse, rows));
}

/* ------------------------------------------------------------------ the KV cache */

#define KC_B 2
#define KC_HKV 2
#define KC_H 4
#define KC_D 64
#define KC_T 94 /* tokens: a prefill of 90 in two appends, then 4 decode steps */
#define KC_PREFILL 90
#define KC_CHUNK 13 /* the prefill's last rows attended as a chunk */
#define KC_DIAG_ROWS 3

/* Every attend of the case on one device: the prefill chunk, each decode step, and the
 * diagnostics (diag_ret: their call's code). out[0] the chunk, out[1..4] the steps, out[5] the
 * diagnostics. Returns the first failure of the plain calls. */
static int kc_run(ape_device *dev, ape_dtype dt, const ape_tensor *k, const ape_tensor *v,
		  void *const *qs, struct kv_out *out, int *diag_ret)
{
	const int64_t rows[6] = { KC_CHUNK, 1, 1, 1, 1, KC_DIAG_ROWS };
	ape_kv_cache_options opts;
	ape_kv_cache *cache;
	ape_tensor kr, vr, q, o;
	ape_attn_desc desc;
	int ret;

	ape_kv_cache_options_init(&opts);
	opts.B = KC_B;
	opts.Hkv = KC_HKV;
	opts.H = KC_H;
	opts.D = KC_D;
	opts.dtype = dt;
	opts.block_tokens = 16;
	opts.capacity_tokens = 128;
	opts.append_chunk = 40; /* an append of 57 tokens staged in two steps */
	opts.attend_chunk = 48; /* the prefill's keys in two launches */
	check_seed_desc(&desc);
	*diag_ret = 0;
	if ((ret = ape_kv_cache_create(dev, &opts, &cache)))
		return ret;
	ret = ape_tensor_rows(k, 0, 57, &kr) || ape_tensor_rows(v, 0, 57, &vr)
		      ? APE_EINVAL
		      : ape_kv_cache_append(cache, &kr, &vr);
	if (!ret)
		ret = ape_tensor_rows(k, 57, KC_PREFILL - 57, &kr) ||
				      ape_tensor_rows(v, 57, KC_PREFILL - 57, &vr)
			      ? APE_EINVAL
			      : ape_kv_cache_append(cache, &kr, &vr);
	for (int s = 0; s < 6 && !ret; s++) {
		if (s >= 1 && s <= 4) { /* a decode step: its own token first */
			ret = ape_tensor_rows(k, KC_PREFILL + s - 1, 1, &kr) ||
					      ape_tensor_rows(v, KC_PREFILL + s - 1, 1, &vr)
				      ? APE_EINVAL
				      : ape_kv_cache_append(cache, &kr, &vr);
			if (ret)
				break;
		}
		ape_tensor_init(&q, qs[s], dt, KC_B, KC_H, rows[s], KC_D);
		ape_tensor_init(&o, out[s].o, APE_F32, KC_B, KC_H, rows[s], KC_D);
		if (s < 5)
			ret = ape_kv_cache_attend(cache, &desc, &q, &o, out[s].lse, NULL);
		else
			*diag_ret = ape_kv_cache_attend_diag(cache, &desc, &q, &o, out[s].lse,
							     out[s].ent, out[s].md, NULL);
	}
	ape_kv_cache_destroy(cache);
	return ret;
}

static int check_kv_cache(const struct check_env *env)
{
	static const char *const diag_labels[] = { "O", "LSE", "ENT", "MD" };
	const ape_dtype dt = APE_F16;
	const size_t nk = (size_t)KC_B * KC_HKV * KC_T * KC_D;
	const int64_t rows[6] = { KC_CHUNK, 1, 1, 1, 1, KC_DIAG_ROWS };
	struct kv_out want[6] = { 0 }, got[6] = { 0 };
	void *qs[6] = { 0 }, *kd = ape_rng_array(env->rng, nk, dt, NULL);
	void *vd = ape_rng_array(env->rng, nk, dt, NULL);
	float *vf = kd && vd ? check_to_f32(vd, dt, nk) : NULL;
	ape_tensor k, v;
	int ret = vf ? 0 : APE_ENOMEM, dret = 0;

	for (int s = 0; s < 6 && !ret; s++) {
		const size_t n = (size_t)(KC_B * KC_H * rows[s]);

		qs[s] = ape_rng_array(env->rng, n * KC_D, dt, NULL);
		if (!qs[s] || kv_out_make(&want[s], n, KC_D))
			ret = APE_ENOMEM;
	}
	ape_tensor_init(&k, kd, dt, KC_B, KC_HKV, KC_T, KC_D);
	ape_tensor_init(&v, vd, dt, KC_B, KC_HKV, KC_T, KC_D);
	if (!ret && ((ret = kc_run(env->ref, dt, &k, &v, qs, want, &dret)) || (ret = dret)))
		fprintf(stderr, "ape-check: kv_cache on the reference: %s\n", ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		const double vmax = check_max_abs(vf, nk);
		double err[4] = { 0 }, tol[4];
		int r = 0;

		for (int s = 0; s < 6 && !r; s++)
			r = kv_out_make(&got[s], (size_t)(KC_B * KC_H * rows[s]), KC_D);
		if (r) {
			ret = r;
			break;
		}
		tol[0] = refcheck_tol_o(dt);
		tol[1] = tol[2] = tol[3] = refcheck_tol_lse(dt);
		r = kc_run(env->devs[d], dt, &k, &v, qs, got, &dret);
		if (r) {
			check_add_error(CHECK_KV, "kv_cache_prefill_decode_f16", d, env->devs[d], r,
					true);
		} else {
			for (int s = 0; s < 5; s++)
				kv_errors(&got[s], &want[s], (size_t)(KC_B * KC_H * rows[s]), KC_D,
					  vmax, err);
			check_add_errors(CHECK_KV, "kv_cache_prefill_decode_f16", d, 2, diag_labels,
					 err, tol);
		}
		if (!r && dret) {
			check_add_error(CHECK_DIAG, "diag_kv_cache_f16", d, env->devs[d], dret,
					true);
		} else if (!r) {
			const size_t n = (size_t)(KC_B * KC_H * KC_DIAG_ROWS);
			const struct kv_out *g = &got[5], *w = &want[5];

			err[0] = err[1] = err[2] = err[3] = 0;
			kv_errors(g, w, n, KC_D, vmax, err);
			for (size_t i = 0; i < n; i++) {
				/* rows at the end of the cache: positions T - 3 .. T - 1, keys 0 on */
				const double maxn = KC_T - KC_DIAG_ROWS + (double)(i % KC_DIAG_ROWS);

				err[2] = fmax(err[2], check_err_one(g->ent[i], w->ent[i], w->lse[i]));
				err[3] = fmax(err[3], check_err_one(g->md[i], w->md[i], maxn));
			}
			check_add_errors(CHECK_DIAG, "diag_kv_cache_f16", d, 4, diag_labels, err,
					 tol);
		} else { /* as the plain calls went */
			const struct check_cell *plain = check_get(check_count() - 1);

			check_add(CHECK_DIAG, "diag_kv_cache_f16", d, plain->status, NAN, NAN,
				  "not run: kv_cache_prefill_decode_f16 %s: %s",
				  plain->status == CHECK_FAIL ? "failed" : "is not claimed",
				  plain->msg);
		}
		for (int s = 0; s < 6; s++)
			kv_out_free(&got[s]);
	}
	for (int s = 0; s < 6; s++) {
		kv_out_free(&want[s]);
		free(qs[s]);
	}
	free(kd);
	free(vd);
	free(vf);
	return ret;
}

/* ------------------------------------------------------------------ the KV pool */

#define KP_HKV 1
#define KP_H 2
#define KP_D 32
#define KP_ROWS 6 /* query rows of the attend */

/* Tokens appended, in order: 40 to A, 23 to B, 1 to C, 5 to D (A's fork), then 1 to each of
 * A, B, C, D in one batch. */
static const int64_t kp_appends[4] = { 40, 23, 1, 5 };
#define KP_TOKENS (40 + 23 + 1 + 5 + 4)

static int kp_append(ape_kv_pool *pool, int64_t id, const void *k, const void *v, int64_t first,
		     int64_t n, ape_dtype dt)
{
	const size_t off = (size_t)(first * KP_HKV * KP_D) * ape_dtype_size(dt);
	ape_tensor tk, tv;

	ape_tensor_init_packed(&tk, (char *)k + off, dt, n, KP_HKV, KP_D);
	ape_tensor_init_packed(&tv, (char *)v + off, dt, n, KP_HKV, KP_D);
	return ape_kv_pool_append(pool, id, &tk, &tv);
}

/*
 * The pool's operations on dev, then two attends: two rows of the fork D alone (one sequence:
 * any device), into out[0], and the ragged batch of every sequence, into out[1], whose code
 * goes to *batch_ret (a device without ragged launches answers APE_ENOTSUP). Returns the first
 * failure of the rest.
 */
static int kp_run(ape_device *dev, ape_dtype dt, const void *k, const void *v, void *q,
		  struct kv_out *out, int *batch_ret)
{
	static const int64_t k_start[3] = { 0, 100, -5 };
	ape_kv_pool_options opts;
	ape_kv_pool *pool;
	int64_t id[4], used = 0, cu_app[5] = { 0, 1, 2, 3, 4 };
	int64_t cu_q[5] = { 0, 1, 4, 5, 6 }, cu_one[2] = { 0, 2 }, order[4];
	ape_attn_desc desc;
	ape_tensor tk, tv, tq, to;
	int ret;

	ape_kv_pool_options_init(&opts);
	opts.Hkv = KP_HKV;
	opts.H = KP_H;
	opts.D = KP_D;
	opts.dtype = dt;
	opts.page_tokens = 7;
	opts.capacity_tokens = 256;
	opts.max_batch_tokens = 16;
	check_seed_desc(&desc);
	*batch_ret = 0;
	if ((ret = ape_kv_pool_create(dev, &opts, &pool)))
		return ret;
	for (int s = 0; s < 3 && !ret; s++)
		ret = ape_kv_pool_add_sequence(pool, k_start[s], &id[s]);
	for (int s = 0; s < 3 && !ret; s++) {
		ret = kp_append(pool, id[s], k, v, used, kp_appends[s], dt);
		used += kp_appends[s];
	}
	if (!ret) /* the fork shares A's last page, part full: its append copies it */
		ret = ape_kv_pool_fork(pool, id[0], &id[3]);
	if (!ret)
		ret = kp_append(pool, id[3], k, v, used, kp_appends[3], dt);
	used += kp_appends[3];
	if (!ret) {
		const size_t off = (size_t)(used * KP_HKV * KP_D) * ape_dtype_size(dt);

		ape_tensor_init_packed(&tk, (char *)k + off, dt, 4, KP_HKV, KP_D);
		ape_tensor_init_packed(&tv, (char *)v + off, dt, 4, KP_HKV, KP_D);
		ret = ape_kv_pool_append_batch(pool, 4, id, cu_app, &tk, &tv);
	}
	ape_tensor_init_packed(&tq, q, dt, 2, KP_H, KP_D);
	ape_tensor_init_packed(&to, out[0].o, APE_F32, 2, KP_H, KP_D);
	if (!ret)
		ret = ape_kv_pool_attend(pool, &desc, 1, &id[3], cu_one, NULL, &tq, &to, out[0].lse,
					 NULL);
	/* one row of A, three of B (a chunked prefill's), one of the fork D, one of C */
	order[0] = id[0];
	order[1] = id[1];
	order[2] = id[3];
	order[3] = id[2];
	ape_tensor_init_packed(&tq, q, dt, KP_ROWS, KP_H, KP_D);
	ape_tensor_init_packed(&to, out[1].o, APE_F32, KP_ROWS, KP_H, KP_D);
	if (!ret)
		*batch_ret = ape_kv_pool_attend(pool, &desc, 4, order, cu_q, NULL, &tq, &to,
						out[1].lse, NULL);
	ape_kv_pool_destroy(pool);
	return ret;
}

static int check_kv_pool(const struct check_env *env)
{
	static const char *const labels[] = { "O", "LSE" };
	static const char *const names[2] = { "kv_pool_pages_fork_bf16", "kv_pool_ragged_bf16" };
	const ape_dtype dt = APE_BF16;
	const size_t nk = (size_t)KP_TOKENS * KP_HKV * KP_D;
	const size_t rows[2] = { 2 * KP_H, (size_t)KP_ROWS * KP_H };
	void *k = ape_rng_array(env->rng, nk, dt, NULL), *v = ape_rng_array(env->rng, nk, dt, NULL);
	void *q = ape_rng_array(env->rng, rows[1] * KP_D, dt, NULL);
	float *vf = k && v && q ? check_to_f32(v, dt, nk) : NULL;
	struct kv_out want[2] = { 0 };
	int ret = vf ? 0 : APE_ENOMEM, bret;

	for (int i = 0; i < 2 && !ret; i++)
		ret = kv_out_make(&want[i], rows[i], KP_D);
	if (!ret && ((ret = kp_run(env->ref, dt, k, v, q, want, &bret)) || (ret = bret)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", names[0], ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		struct kv_out got[2] = { 0 };
		const double tol[2] = { refcheck_tol_o(dt), refcheck_tol_lse(dt) };
		int r = kv_out_make(&got[0], rows[0], KP_D);

		if (!r)
			r = kv_out_make(&got[1], rows[1], KP_D);
		if (r) {
			ret = r;
		} else if ((r = kp_run(env->devs[d], dt, k, v, q, got, &bret))) {
			check_add_error(CHECK_KV, names[0], d, env->devs[d], r, true);
			check_add_error(CHECK_KV, names[1], d, env->devs[d], r, true);
		} else {
			for (int i = 0; i < 2; i++) {
				double err[2] = { 0 };

				if (i && bret) {
					check_add_error(CHECK_KV, names[1], d, env->devs[d], bret, true);
					continue;
				}
				kv_errors(&got[i], &want[i], rows[i], KP_D, check_max_abs(vf, nk), err);
				check_add_errors(CHECK_KV, names[i], d, 2, labels, err, tol);
			}
		}
		kv_out_free(&got[0]);
		kv_out_free(&got[1]);
	}
	kv_out_free(&want[0]);
	kv_out_free(&want[1]);
	free(k);
	free(v);
	free(q);
	free(vf);
	return ret;
}

/* ------------------------------------------------------------------ the caller's pages */

#define PK_HKV 2
#define PK_H 4
#define PK_D 16
#define PK_PAGE 5
#define PK_PAGES 12
#define PK_ROWS 3

/* The caller's pages on dev: K and V page buffers written from host, the CSR table of two
 * sequences sharing page 3, one decode row and two prefill rows. */
static int pk_run(ape_device *dev, const float *k, const float *v, const float *q,
		  struct kv_out *out)
{
	static const int64_t indptr[3] = { 0, 3, 5 }, indices[5] = { 3, 7, 1, 3, 9 };
	static const int64_t last[2] = { 2, 5 }, cu_q[3] = { 0, 1, 3 };
	const size_t bytes = (size_t)PK_PAGES * PK_HKV * PK_PAGE * PK_D * sizeof(float);
	ape_paged_kv_options opts;
	ape_paged_kv *pk = NULL;
	ape_buffer *kb = NULL, *vb = NULL;
	ape_queue *queue = NULL;
	ape_page_table pt;
	ape_dtensor kt, vt;
	ape_tensor tq, to;
	ape_attn_desc desc;
	int ret;

	ape_paged_kv_options_init(&opts);
	opts.Hkv = PK_HKV;
	opts.H = PK_H;
	opts.D = PK_D;
	opts.dtype = APE_F32;
	opts.page_tokens = PK_PAGE;
	opts.num_pages = PK_PAGES;
	opts.max_batch_tokens = 8;
	check_seed_desc(&desc);
	ret = ape_paged_kv_create(dev, &opts, &pk);
	if (!ret)
		ret = ape_queue_create(dev, &queue);
	if (!ret)
		ret = ape_buffer_alloc(dev, bytes, &kb);
	if (!ret)
		ret = ape_buffer_alloc(dev, bytes, &vb);
	if (!ret)
		ret = ape_buffer_write(queue, kb, 0, k, bytes);
	if (!ret)
		ret = ape_buffer_write(queue, vb, 0, v, bytes);
	if (!ret)
		ret = ape_queue_synchronize(queue);
	ape_page_table_init(&pt);
	pt.nseq = 2;
	pt.indptr = indptr;
	pt.indices = indices;
	pt.last_page_len = last;
	if (!ret)
		ret = ape_paged_kv_plan(pk, &pt, cu_q, NULL);
	ape_dtensor_init(&kt, kb, 0, APE_F32, PK_PAGES, PK_HKV, PK_PAGE, PK_D);
	ape_dtensor_init(&vt, vb, 0, APE_F32, PK_PAGES, PK_HKV, PK_PAGE, PK_D);
	ape_tensor_init_packed(&tq, (void *)q, APE_F32, PK_ROWS, PK_H, PK_D);
	ape_tensor_init_packed(&to, out->o, APE_F32, PK_ROWS, PK_H, PK_D);
	if (!ret)
		ret = ape_paged_kv_run(pk, &desc, &kt, &vt, &tq, &to, out->lse, NULL);
	ape_paged_kv_destroy(pk);
	ape_buffer_free(kb);
	ape_buffer_free(vb);
	ape_queue_destroy(queue);
	return ret;
}

static int check_paged(const struct check_env *env)
{
	static const char *const labels[] = { "O", "LSE" };
	static const char name[] = "paged_kv_csr_shared_f32";
	const size_t nk = (size_t)PK_PAGES * PK_HKV * PK_PAGE * PK_D, rows = PK_ROWS * PK_H;
	float *k = malloc(nk * sizeof(float)), *v = malloc(nk * sizeof(float));
	float *q = malloc(rows * PK_D * sizeof(float));
	struct kv_out want = { 0 };
	int ret = k && v && q ? kv_out_make(&want, rows, PK_D) : APE_ENOMEM;

	for (size_t i = 0; !ret && i < nk; i++) {
		k[i] = (float)ape_rng_normal(env->rng);
		v[i] = (float)ape_rng_normal(env->rng);
	}
	for (size_t i = 0; !ret && i < rows * PK_D; i++)
		q[i] = (float)ape_rng_normal(env->rng);
	if (!ret && (ret = pk_run(env->ref, k, v, q, &want)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		struct kv_out got = { 0 };
		double err[2] = { 0 };
		const double tol[2] = { refcheck_tol_o(APE_F32), refcheck_tol_lse(APE_F32) };
		int r = kv_out_make(&got, rows, PK_D);

		if (r) {
			ret = r;
		} else if ((r = pk_run(env->devs[d], k, v, q, &got))) {
			check_add_error(CHECK_KV, name, d, env->devs[d], r, true);
		} else {
			kv_errors(&got, &want, rows, PK_D, check_max_abs(v, nk), err);
			check_add_errors(CHECK_KV, name, d, 2, labels, err, tol);
		}
		kv_out_free(&got);
	}
	kv_out_free(&want);
	free(k);
	free(v);
	free(q);
	return ret;
}

int check_kv(const struct check_env *env)
{
	int ret = check_kv_cache(env);

	if (!ret)
		ret = check_kv_pool(env);
	if (!ret)
		ret = check_paged(env);
	if (ret == APE_ENOMEM)
		fprintf(stderr, "ape-check: out of memory\n");
	return ret;
}
