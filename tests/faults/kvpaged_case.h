/* SPDX-License-Identifier: MIT */
/*
 * A paged-attention session over the caller's pages (ape_paged_kv_*) that the fault and thread
 * tests share (test_kvpagedfail.c, test_threads.c; include after the Kselftest harness). The
 * caller's pages of two layers are made once, on the device, by kcase_setup(): layer 0 in vLLM's
 * layout ([num_pages, page_tokens, Hkv, D] in two buffers: heads interleaved, the keys gathered
 * by strided copies), layer 1 as FlashInfer's K and V halves of one [num_pages, 2, Hkv,
 * page_tokens, D] buffer (rows one run per head: plain copies). A session (kcase_run()):
 *
 * - create (H 4, Hkv 2, D 32, pages of 4 tokens, 12 pages, max_batch_tokens 12, attend_chunk
 *   8);
 * - plan A, a CSR table: a sequence of 10 tokens on pages {5, 2, 7} (more keys than a chunk:
 *   it runs by itself, in chunks), one of 5 sharing its first page {5, 9}, one of no page (its
 *   row sees no key) and one of 3 on page {0} at k_start -5; 2, 1, 1 and 5 rows at the default
 *   positions (the last sequence's first rows see no key with causal);
 * - run A over layer 0, then over layer 1 with its diagnostics (ape_paged_kv_run_diag());
 * - plan B, a block table (stride 4, the rest of each row not read): the same pages read
 *   further (11, 6 and 4 tokens), one decode row each at explicit positions (after the keys,
 *   among them, past a gap);
 * - run B over layer 0 through ape_paged_kv_run_dlpack(): its pages as kDLCPU DLTensors over
 *   their host copies (vLLM's layout is DLPack's compact [num_pages, page_tokens, Hkv, D]),
 *   the queries and outputs too; destroy.
 *
 * On OpenCL the decode-shaped sequences are read in place through the page table and the
 * others (5 rows) gathered; on the reference every key is gathered.
 *
 * Each call is judged as it returns: a failed create must leave *out NULL. A failed call is
 * made again (under host-allocation faults it must return APE_ENOMEM): after a failed plan,
 * a run must first be refused ("no plan"); the plan stays after a failed run. The call made
 * again must succeed, the session then ending with the clean result; where it fails again with
 * an injected device failure (the device lost for good), the session ends there, and the
 * object must still plan (host memory only) and be destroyed. Run outputs are kept only from
 * runs that succeeded, so a session cut short leaves the rest poisoned.
 */
#ifndef APE_TEST_FAULTS_KVPAGED_CASE_H
#define APE_TEST_FAULTS_KVPAGED_CASE_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape_dlpack.h"
#include "common/bwdcase.h"
#include "common/naive.h"
#include "common/positions.h"
#include "common/testutil.h"

enum { KC_H = 4, KC_HKV = 2, KC_D = 32, KC_P = 4, KC_NP = 12, KC_QA = 9, KC_QB = 3,
       KC_PAGE = KC_HKV * KC_P * KC_D, KC_OA = KC_QA * KC_H * KC_D, KC_OB = KC_QB * KC_H * KC_D };

/* plan A: CSR */
static const int64_t kc_indptr[5] = { 0, 3, 5, 5, 6 }, kc_indices[6] = { 5, 2, 7, 5, 9, 0 };
static const int64_t kc_last[4] = { 2, 1, 0, 3 }, kc_ks_a[4] = { 3, 3, 0, -5 };
static const int64_t kc_cu_a[5] = { 0, 2, 3, 4, 9 };
/* plan B: a block table of stride 4 (entries past a sequence's pages: never read) */
static const int64_t kc_bt[12] = { 5, 2, 7, -1, 5, 9, INT64_MIN, 99, 0, -7, 12, 5 };
static const int64_t kc_lens[3] = { 11, 6, 4 }, kc_ks_b[3] = { 3, 3, -5 };
static const int64_t kc_cu_b[4] = { 0, 1, 2, 3 }, kc_pos_b[3] = { 14, 7, 20 };

struct kcase {
	ape_device *dev;
	ape_rng rng; /* kcase_setup()'s random data */
	ape_dtype dt;
	bool host_faults; /* a run of the allocation sweep: a failed call returns APE_ENOMEM */
	/* the caller's pages of the two layers (kcase_setup()), their host copies */
	ape_buffer *buf[3]; /* layer 0's keys, its values; layer 1's both */
	void *host[3];
	ape_dtensor k[2], v[2];
	/* the queries (packed [rows, H, D] of dt), the parameters */
	void *qa, *qb;
	ape_attn_desc desc;
	float prm[4][8];
	/* the three runs' outputs (float32 [rows, H, D], LSE [rows, H]), the clean run's */
	float oa[2][KC_OA], la[2][KC_QA * KC_H], ob[KC_OB], lb[KC_QB * KC_H];
	float clean[2 * (KC_OA + KC_QA * KC_H) + KC_OB + KC_QB * KC_H];
	/* a run's staging outputs (a failed run's content is unspecified) */
	float o_run[KC_OA], l_run[KC_QA * KC_H];
	float e_run[KC_QA * KC_H], m_run[KC_QA * KC_H]; /* the diagnostics of layer 1's run */
	/* the last session: its first failure (code, call, message), and what it broke */
	int ret;
	bool cut; /* the session ended at a call that failed again (a device lost for good) */
	const char *failed;
	char msg[1024], bad[256];
	double err_o, err_lse; /* the clean session against the oracle (kcase_check()) */
};

static void kcase_bad(struct kcase *c, const char *fn, const char *what)
{
	if (!c->bad[0])
		snprintf(c->bad, sizeof(c->bad), "%s: %s", fn, what);
}

/* Element (page p, head g, row r, component 0) of layer l's keys (v: values) in its buffer. */
static int64_t kcase_elem(int l, bool v, int64_t p, int64_t g, int64_t r)
{
	if (l == 0) /* vLLM: [num_pages, page_tokens, Hkv, D] */
		return p * KC_PAGE + r * KC_HKV * KC_D + g * KC_D;
	/* FlashInfer HND halves: [num_pages, 2, Hkv, page_tokens, D] */
	return p * 2 * KC_PAGE + (v ? KC_PAGE : 0) + g * KC_P * KC_D + r * KC_D;
}

static void kcase_strides(ape_dtensor *t, int64_t page, int64_t head, int64_t row)
{
	t->strides[0] = page;
	t->strides[1] = head;
	t->strides[2] = row;
	t->strides[3] = 1;
}

/* The pages of both layers on c->dev, the queries and the parameters, from c->rng. 0 or the
 * failed call's code. */
static int kcase_setup(struct kcase *c)
{
	const size_t esz = ape_dtype_size(c->dt);
	const size_t n[3] = { KC_NP * KC_PAGE, KC_NP * KC_PAGE, 2 * KC_NP * KC_PAGE };
	ape_queue *q = NULL;
	ape_rng r = c->rng;
	int ret;

	for (int i = 0; i < 3; i++)
		if (!(c->host[i] = ape_rng_array(&r, n[i], c->dt, NULL)))
			return APE_ENOMEM;
	c->qa = ape_rng_array(&r, KC_QA * KC_H * KC_D, c->dt, NULL);
	c->qb = ape_rng_array(&r, KC_QB * KC_H * KC_D, c->dt, NULL);
	if (!c->qa || !c->qb)
		return APE_ENOMEM;
	test_random_desc(&r, &c->desc, c->prm, KC_H);
	if ((ret = ape_queue_create(c->dev, &q)))
		return ret;
	for (int i = 0; i < 3 && !ret; i++)
		if (!(ret = ape_buffer_alloc(c->dev, n[i] * esz, &c->buf[i])))
			ret = ape_buffer_write(q, c->buf[i], 0, c->host[i], n[i] * esz);
	if (!ret)
		ret = ape_queue_synchronize(q);
	ape_queue_destroy(q);
	if (ret)
		return ret;
	/* layer 0: vLLM's strides; layer 1: the two halves of one buffer */
	ape_dtensor_init(&c->k[0], c->buf[0], 0, c->dt, KC_NP, KC_HKV, KC_P, KC_D);
	ape_dtensor_init(&c->v[0], c->buf[1], 0, c->dt, KC_NP, KC_HKV, KC_P, KC_D);
	ape_dtensor_init(&c->k[1], c->buf[2], 0, c->dt, KC_NP, KC_HKV, KC_P, KC_D);
	ape_dtensor_init(&c->v[1], c->buf[2], (uint64_t)KC_PAGE * esz, c->dt, KC_NP, KC_HKV, KC_P,
			 KC_D);
	kcase_strides(&c->k[0], KC_PAGE, KC_D, KC_HKV * KC_D);
	kcase_strides(&c->v[0], KC_PAGE, KC_D, KC_HKV * KC_D);
	kcase_strides(&c->k[1], 2 * KC_PAGE, KC_P * KC_D, KC_D);
	kcase_strides(&c->v[1], 2 * KC_PAGE, KC_P * KC_D, KC_D);
	return 0;
}

static void kcase_free(struct kcase *c)
{
	for (int i = 0; i < 3; i++) {
		ape_buffer_free(c->buf[i]);
		free(c->host[i]);
	}
	free(c->qa);
	free(c->qb);
}

/* A call returned ret: 0 go on, 1 make it again, -1 end the session. */
static int kcase_judge(struct kcase *c, const char *fn, int ret)
{
	if (!ret)
		return 0;
	if (c->ret) { /* made again: fails only on a device lost for good */
		if (c->host_faults || !strstr(ape_last_error(), "fails on purpose"))
			kcase_bad(c, fn, "failed again when made again");
		return -1;
	}
	c->ret = ret;
	c->failed = fn;
	snprintf(c->msg, sizeof(c->msg), "%s", ape_last_error());
	if (c->host_faults && ret != APE_ENOMEM)
		kcase_bad(c, fn, "a failed host allocation did not return APE_ENOMEM");
	return 1;
}

/* Makes `call` (an int expression) until kcase_judge() says go on (`again`, a statement, runs
 * before a call made again); ends the session at `out` when it says so. */
#define KCASE_CALL(c, fn, call, again)                                                             \
	do {                                                                                       \
		int r_;                                                                            \
                                                                                                   \
		while ((r_ = kcase_judge((c), (fn), (call))) > 0) {                                \
			again;                                                                     \
		}                                                                                  \
		if (r_ < 0) {                                                                      \
			(c)->cut = true;                                                           \
			goto out;                                                                  \
		}                                                                                  \
	} while (0)

/* The CSR table of plan A, the block table of plan B. */
static void kcase_tables(ape_page_table *a, ape_page_table *b)
{
	ape_page_table_init(a);
	a->nseq = 4;
	a->indptr = kc_indptr;
	a->indices = kc_indices;
	a->last_page_len = kc_last;
	a->k_start = kc_ks_a;
	ape_page_table_init(b);
	b->nseq = 3;
	b->block_table = kc_bt;
	b->block_table_stride = 4;
	b->seq_lens = kc_lens;
	b->k_start = kc_ks_b;
}

/* A kDLCPU DLTensor over p of `nd` axes sh (compact). */
static DLTensor kcase_dl(void *p, ape_dtype dt, int nd, int64_t *sh)
{
	return (DLTensor){ .data = p, .device = { kDLCPU, 0 }, .ndim = nd,
			   .dtype = test_dl_dtype(dt), .shape = sh };
}

/* Layer 0 through ape_paged_kv_run_dlpack(): its pages' host copies, q, o and lse as kDLCPU
 * DLTensors. */
static int kcase_dlpack(struct kcase *c, ape_paged_kv *pk, void *q, int64_t rows)
{
	int64_t ps[4] = { KC_NP, KC_P, KC_HKV, KC_D }, qs[3] = { rows, KC_H, KC_D };
	int64_t ls[2] = { rows, KC_H };
	DLTensor k = kcase_dl(c->host[0], c->dt, 4, ps), v = kcase_dl(c->host[1], c->dt, 4, ps);
	DLTensor qt = kcase_dl(q, c->dt, 3, qs), ot = kcase_dl(c->o_run, APE_F32, 3, qs);
	DLTensor lt = kcase_dl(c->l_run, APE_F32, 2, ls);

	return ape_paged_kv_run_dlpack(pk, &c->desc, &k, &v, &qt, &ot, &lt);
}

/* Runs the plan in force over layer l (2: layer 0 through ape_paged_kv_run_dlpack()), the
 * queries q of `rows` rows; on success the outputs into o and lse. */
static int kcase_layer(struct kcase *c, ape_paged_kv *pk, int l, void *q, int64_t rows, float *o,
		       float *lse)
{
	ape_tensor qt, ot;
	int ret;

	memset(c->o_run, 0xff, sizeof(c->o_run));
	memset(c->l_run, 0xff, sizeof(c->l_run));
	ape_tensor_init_packed(&qt, q, c->dt, rows, KC_H, KC_D);
	ape_tensor_init_packed(&ot, c->o_run, APE_F32, rows, KC_H, KC_D);
	if (l == 2)
		ret = kcase_dlpack(c, pk, q, rows);
	else if (l == 1) /* the second layer with its diagnostics */
		ret = ape_paged_kv_run_diag(pk, &c->desc, &c->k[l], &c->v[l], &qt, &ot, c->l_run,
					    c->e_run, c->m_run, NULL);
	else
		ret = ape_paged_kv_run(pk, &c->desc, &c->k[l], &c->v[l], &qt, &ot, c->l_run, NULL);
	if (!ret) {
		memcpy(o, c->o_run, sizeof(float) * (size_t)(rows * KC_H * KC_D));
		memcpy(lse, c->l_run, sizeof(float) * (size_t)(rows * KC_H));
	}
	return ret;
}

/* After a failed plan: a run is refused, naming the missing plan. */
static void kcase_no_plan(struct kcase *c, ape_paged_kv *pk)
{
	ape_tensor qt, ot;
	int ret;

	ape_tensor_init_packed(&qt, c->qa, c->dt, KC_QA, KC_H, KC_D);
	ape_tensor_init_packed(&ot, c->o_run, APE_F32, KC_QA, KC_H, KC_D);
	ret = ape_paged_kv_run(pk, &c->desc, &c->k[0], &c->v[0], &qt, &ot, c->l_run, NULL);
	if (ret != APE_EINVAL || !strstr(ape_last_error(), "no plan"))
		kcase_bad(c, "ape_paged_kv_run", "a run after a failed plan was not refused");
}

/* The object of the session: a failed create must leave *out NULL. */
static int kcase_create(struct kcase *c, ape_paged_kv **pk)
{
	ape_paged_kv_options o;
	int ret;

	ape_paged_kv_options_init(&o);
	o.Hkv = KC_HKV;
	o.H = KC_H;
	o.D = KC_D;
	o.dtype = c->dt;
	o.page_tokens = KC_P;
	o.num_pages = KC_NP;
	o.max_batch_tokens = 12;
	o.attend_chunk = 8;
	*pk = (ape_paged_kv *)(uintptr_t)1;
	ret = ape_paged_kv_create(c->dev, &o, pk);
	if (ret && *pk)
		kcase_bad(c, "ape_paged_kv_create", "a failed create left *out set");
	if (ret)
		*pk = NULL;
	return ret;
}

/* One session (see the file's comment); c->ret: its first failure's code (0: none). */
static int kcase_run(struct kcase *c)
{
	ape_paged_kv *pk = NULL;
	ape_page_table ta, tb;

	c->ret = 0;
	c->cut = false;
	c->failed = NULL;
	c->msg[0] = c->bad[0] = 0;
	memset(c->oa, 0xff, sizeof(c->oa)); /* NaN: kept only from runs that succeeded */
	memset(c->la, 0xff, sizeof(c->la));
	memset(c->ob, 0xff, sizeof(c->ob));
	memset(c->lb, 0xff, sizeof(c->lb));
	kcase_tables(&ta, &tb);
	KCASE_CALL(c, "ape_paged_kv_create", kcase_create(c, &pk), (void)0);
	KCASE_CALL(c, "ape_paged_kv_plan", ape_paged_kv_plan(pk, &ta, kc_cu_a, NULL),
		   kcase_no_plan(c, pk));
	KCASE_CALL(c, "ape_paged_kv_run", kcase_layer(c, pk, 0, c->qa, KC_QA, c->oa[0], c->la[0]),
		   (void)0);
	KCASE_CALL(c, "ape_paged_kv_run_diag",
		   kcase_layer(c, pk, 1, c->qa, KC_QA, c->oa[1], c->la[1]),
		   (void)0);
	KCASE_CALL(c, "ape_paged_kv_plan", ape_paged_kv_plan(pk, &tb, kc_cu_b, kc_pos_b),
		   kcase_no_plan(c, pk));
	KCASE_CALL(c, "ape_paged_kv_run_dlpack",
		   kcase_layer(c, pk, 2, c->qb, KC_QB, c->ob, c->lb), (void)0);
out:
	if (c->ret && pk && !c->host_faults && ape_paged_kv_plan(pk, &tb, kc_cu_b, kc_pos_b))
		kcase_bad(c, "ape_paged_kv_plan", "refused after a device failure (host memory only)");
	ape_paged_kv_destroy(pk);
	return c->ret;
}

/* The oracle: each row of plan A's run over layer l (B: plan B's over layer 0) against
 * naive_attention() over its sequence's keys gathered from the host copies; the largest errors
 * (O over max |V|, LSE relative) max'ed into *eo, *el. -1 when out of memory. */
static int kcase_check_run(const struct kcase *c, bool b, int l, const float *o, const float *lse,
			   double *eo, double *el)
{
	const size_t esz = ape_dtype_size(c->dt), row = KC_D * esz;
	const int64_t ns = b ? 3 : 4, *cu = b ? kc_cu_b : kc_cu_a;
	const uint8_t *hk = c->host[l ? 2 : 0], *hv = c->host[l ? 2 : 1];
	ape_tensor qt, ot;

	ape_tensor_init_packed(&qt, b ? c->qb : c->qa, c->dt, cu[ns], KC_H, KC_D);
	ape_tensor_init_packed(&ot, (void *)o, APE_F32, cu[ns], KC_H, KC_D);
	for (int64_t s = 0; s < ns; s++) {
		const int64_t q0 = cu[s], lq = cu[s + 1] - q0;
		const int64_t n = b ? kc_lens[s] : kc_indptr[s + 1] == kc_indptr[s] ? 0 :
				  (kc_indptr[s + 1] - kc_indptr[s] - 1) * KC_P + kc_last[s];
		const int64_t k0 = b ? kc_ks_b[s] : kc_ks_a[s];
		const int64_t *pages = b ? kc_bt + 4 * s : kc_indices + kc_indptr[s];
		uint8_t *kk = malloc(row * (size_t)(KC_HKV * n) + 1);
		uint8_t *vv = malloc(row * (size_t)(KC_HKV * n) + 1);
		int64_t *pq = malloc(sizeof(int64_t) * (size_t)(lq + 1));
		int64_t *pk = malloc(sizeof(int64_t) * (size_t)(n + 1));
		double *oo = calloc((size_t)(KC_H * lq * KC_D) + 1, sizeof(double));
		double *ll = malloc(sizeof(double) * (size_t)(KC_H * lq + 1));
		double prm[4][8], vmax = 1e-30;
		naive_params np = {
			.rope_base = c->desc.rope_base, .rope_scale = c->desc.rope_scale,
			.scale = NAN, .causal = c->desc.causal, .pos_q = pq, .pos_k = pk,
		};
		ape_tensor kt, vt, qs = test_rows(&qt, q0, lq);
		int ret = kk && vv && pq && pk && oo && ll ? 0 : -1;

		for (int64_t t = 0; !ret && t < n; t++) {
			pk[t] = k0 + t;
			for (int64_t g = 0; g < KC_HKV; g++) {
				const int64_t p = pages[t / KC_P], r = t % KC_P;

				memcpy(kk + (size_t)(t * KC_HKV + g) * row,
				       hk + (size_t)kcase_elem(l, false, p, g, r) * esz, row);
				memcpy(vv + (size_t)(t * KC_HKV + g) * row,
				       hv + (size_t)kcase_elem(l, true, p, g, r) * esz, row);
			}
		}
		for (int64_t i = 0; !ret && i < lq; i++)
			pq[i] = b ? kc_pos_b[q0 + i] : k0 + n - lq + i;
		for (int i = 0; i < 4; i++)
			for (int h = 0; h < KC_H; h++)
				prm[i][h] = c->prm[i][h];
		np.delta = prm[0];
		np.beta = prm[1];
		np.gamma = prm[2];
		np.lambda = prm[3];
		if (!ret) {
			ape_tensor_init_packed(&kt, kk, c->dt, n, KC_HKV, KC_D);
			ape_tensor_init_packed(&vt, vv, c->dt, n, KC_HKV, KC_D);
			if (lq && n && naive_attention(&np, &qs, &kt, &vt, oo, ll))
				ret = -1;
			for (int64_t r = 0; !n && r < KC_H * lq; r++)
				ll[r] = -INFINITY;
			for (int64_t t = 0; t < n; t++)
				for (int64_t g = 0; g < KC_HKV; g++)
					for (int64_t d = 0; d < KC_D; d++)
						vmax = fmax(vmax, fabs(test_tensor_get(&vt, 0, g, t, d)));
		}
		for (int64_t h = 0; !ret && h < KC_H; h++)
			for (int64_t i = 0; i < lq; i++) {
				test_lse_err(lse[(q0 + i) * KC_H + h], ll[h * lq + i], el);
				for (int64_t d = 0; d < KC_D; d++) {
					const double x = test_tensor_get(&ot, 0, h, q0 + i, d);
					const double e = fabs(x - oo[(h * lq + i) * KC_D + d]) / vmax;

					*eo = fmax(*eo, e != e ? INFINITY : e);
				}
			}
		free(kk);
		free(vv);
		free(pq);
		free(pk);
		free(oo);
		free(ll);
		if (ret)
			return ret;
	}
	return 0;
}

/* The pages, a clean session, its outputs kept as the clean result and (oracle) checked into
 * c->err_o, c->err_lse. 0, or the error. */
static int kcase_prepare(struct kcase *c, bool oracle)
{
	float *w = c->clean;
	int ret;

	if ((ret = kcase_setup(c)))
		return ret;
	ret = kcase_run(c);
	if (ret || c->bad[0])
		return ret ? ret : APE_EINVAL;
	memcpy(w, c->oa, sizeof(c->oa));
	memcpy(w + 2 * KC_OA, c->la, sizeof(c->la));
	memcpy(w + 2 * (KC_OA + KC_QA * KC_H), c->ob, sizeof(c->ob));
	memcpy(w + 2 * (KC_OA + KC_QA * KC_H) + KC_OB, c->lb, sizeof(c->lb));
	c->err_o = c->err_lse = 0;
	if (oracle && (kcase_check_run(c, false, 0, c->oa[0], c->la[0], &c->err_o, &c->err_lse) ||
		       kcase_check_run(c, false, 1, c->oa[1], c->la[1], &c->err_o, &c->err_lse) ||
		       kcase_check_run(c, true, 0, c->ob, c->lb, &c->err_o, &c->err_lse)))
		c->err_o = -1;
	return 0;
}

/* NULL when the last session kept every promise: the clean outputs after a session that went
 * to its end (its failed call made again), else those of the runs that succeeded (the clean
 * ones) and the rest poisoned. */
static const char *kcase_verify(const struct kcase *c, int ret)
{
	const float *w = c->clean, *la = w + 2 * KC_OA, *ob = la + 2 * KC_QA * KC_H;
	const void *got[6] = { c->oa[0], c->oa[1], c->la[0], c->la[1], c->ob, c->lb };
	const void *want[6] = { w, w + KC_OA, la, la + KC_QA * KC_H, ob, ob + KC_OB };
	const size_t len[6] = { sizeof(c->oa[0]), sizeof(c->oa[1]), sizeof(c->la[0]),
				sizeof(c->la[1]), sizeof(c->ob), sizeof(c->lb) };
	static const char *const what[6] = {
		"plan A's run over layer 0: O", "plan A's run over layer 1: O",
		"plan A's run over layer 0: LSE", "plan A's run over layer 1: LSE",
		"plan B's run: O", "plan B's run: LSE",
	};

	if (c->bad[0])
		return c->bad;
	if (ret != c->ret)
		return "the session's code is not its first failure's";
	for (int i = 0; i < 6; i++) {
		const unsigned char *b = got[i];
		bool poisoned = true;

		for (size_t j = 0; j < len[i]; j++)
			poisoned &= b[j] == 0xff;
		if (memcmp(got[i], want[i], len[i]) && (!c->cut || !poisoned)) {
			static __thread char why[160];

			snprintf(why, sizeof(why), "%s: not the clean result%s", what[i],
				 c->cut ? ", nor untouched" : "");
			return why;
		}
	}
	return NULL;
}

#endif
