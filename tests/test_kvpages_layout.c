/* SPDX-License-Identifier: MIT */
/*
 * Keys read in place from pages at an awkward layout: the caller's pages (ape_paged_kv_*) in a
 * token-major layout whose rows are padded by an odd number of elements and start at odd
 * element offsets (so that no row is 16-byte aligned), scrambled across the buffer, the K and V
 * halves in one buffer; a decode step of several sequences against the reference on the
 * sequences' keys laid out contiguously. On a backend that reads pages in place the step is one
 * launch that copies no key (path decode-in-place): on CUDA (the emulator here) the decode at
 * D = 64 copies each misaligned row into its ring with plain loads instead of cp.async
 * (APE_CU_F_KV_CHECK, cuda/kernels/decode.cu). Prefill chunks of sequences longer than one key
 * chunk, each run by itself (a dense launch), with decays and skipping, every storage type: on
 * CUDA the prefill kernel reads them in place too (float32 K rows and V rows with plain loads
 * where misaligned, cuda/kernels/prefill.cu; ape_prep converts the others through the pages).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"

BACKEND_FIXTURE(pg)

/* nseq sequences of n[s] keys, lq[s] query rows each (end-aligned, causal), in storage type dt,
 * through the caller's pages laid out as above; prefill: chunks of one key chunk (32 keys) so
 * that a longer sequence runs by itself, the seed's decays and skipping. */
static void layout_case(struct __test_metadata *_metadata, FIXTURE_DATA(pg) *self, ape_dtype dt,
			int nseq, const int64_t *n, const int64_t *lq, bool prefill)
{
	enum { NSEQ = 3, NP = 48 };
	const int64_t Hkv = 2, H = 4, D = 64, P = 5, pad = 3;
	const size_t esz = ape_dtype_size(dt);
	/* [page][token][kv head][D + pad], each page one element further, K then V */
	const int64_t sh = D + pad, sr = Hkv * sh, sp = P * sr + 1;
	const int64_t koff = 5, voff = koff + NP * sp + 7, total = voff + NP * sp + 8;
	int64_t indptr[NSEQ + 1] = { 0 }, indices[NP], last[NSEQ], cu[NSEQ + 1] = { 0 }, perm[NP];
	float prm[4][8], *vals, *lse, *want_lse;
	char *host;
	test_tensor q, o, want;
	ape_paged_kv_options po;
	ape_paged_kv *pk = NULL;
	ape_page_table pt;
	ape_attn_desc desc;
	ape_buffer *buf = NULL;
	ape_queue *queue = NULL;
	ape_dtensor kd, vd;
	ape_stats st;
	ape_rng rng;
	double vmax = 1;

	ASSERT_LE(nseq, NSEQ);
	ape_rng_init(&rng, _metadata->name);
	host = calloc((size_t)total, esz);
	vals = malloc((size_t)total * sizeof(float));
	ASSERT_NE(NULL, host);
	ASSERT_NE(NULL, vals);
	for (int64_t i = 0; i < total; i++)
		vals[i] = (float)ape_rng_normal(&rng);
	ASSERT_EQ(0, ape_convert(host, dt, vals, APE_F32, (size_t)total));
	for (int64_t i = 0; i < NP; i++)
		perm[i] = i;
	for (int64_t i = NP - 1; i > 0; i--) { /* the pages scrambled */
		const int64_t j = ape_rng_range(&rng, 0, i), t = perm[i];

		perm[i] = perm[j];
		perm[j] = t;
	}
	for (int s = 0; s < nseq; s++) {
		const int64_t np = (n[s] + P - 1) / P;

		indptr[s + 1] = indptr[s] + np;
		ASSERT_LE(indptr[s + 1], NP);
		for (int64_t i = 0; i < np; i++)
			indices[indptr[s] + i] = perm[indptr[s] + i];
		last[s] = n[s] - (np - 1) * P;
		cu[s + 1] = cu[s] + lq[s];
	}

	ASSERT_EQ(0, ape_buffer_alloc(self->dev, (size_t)total * esz, &buf))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_queue_create(self->dev, &queue));
	ASSERT_EQ(0, ape_buffer_write(queue, buf, 0, host, (size_t)total * esz));
	ASSERT_EQ(0, ape_queue_synchronize(queue));
	kd = (ape_dtensor){ .buf = buf, .byte_offset = (uint64_t)koff * esz, .dtype = dt,
			    .shape = { NP, Hkv, P, D }, .strides = { sp, sh, sr, 1 } };
	vd = kd;
	vd.byte_offset = (uint64_t)voff * esz;

	ape_paged_kv_options_init(&po);
	po.Hkv = Hkv;
	po.H = H;
	po.D = D;
	po.dtype = dt;
	po.page_tokens = P;
	po.num_pages = NP;
	if (prefill)
		po.attend_chunk = 32;
	ASSERT_EQ(0, ape_paged_kv_create(self->dev, &po, &pk)) TH_LOG("%s", ape_last_error());
	ape_page_table_init(&pt);
	pt.nseq = nseq;
	pt.indptr = indptr;
	pt.indices = indices;
	pt.last_page_len = last;
	ASSERT_EQ(0, ape_paged_kv_plan(pk, &pt, cu, NULL)) TH_LOG("%s", ape_last_error());

	lse = malloc(sizeof(float) * (size_t)(cu[nseq] * H));
	want_lse = malloc(sizeof(float) * (size_t)(cu[nseq] * H));
	ASSERT_NE(NULL, lse);
	ASSERT_NE(NULL, want_lse);
	ASSERT_EQ(0, test_tensor_random(&q, &rng, dt, 1, H, cu[nseq], D, 1.0));
	ASSERT_EQ(0, test_tensor_empty(&o, dt, 1, H, cu[nseq], D));
	ASSERT_EQ(0, test_tensor_empty(&want, dt, 1, H, cu[nseq], D));
	ape_attn_desc_init(&desc);
	test_random_head_params(&desc, prm, H, &rng);
	desc.skip_tol = 0;
	if (prefill) { /* the seed's decays (a lambda above 0 on every head), skipping */
		for (int64_t h = 0; h < H; h++) {
			prm[0][h] = 0.4f;
			prm[1][h] = 0.02f;
			prm[2][h] = 0.02f;
			prm[3][h] = 0.1f;
		}
		desc.skip_tol = 1e-3;
	}
	ape_stats_init(&st);
	ASSERT_EQ(0, ape_paged_kv_run(pk, &desc, &kd, &vd, &q.t, &o.t, lse, &st))
	TH_LOG("%s", ape_last_error());

	/* the reference, each sequence's keys gathered on the host */
	for (int s = 0; s < nseq; s++) {
		test_tensor k, v;
		ape_tensor qs = test_rows(&q.t, cu[s], lq[s]);
		ape_tensor os = test_rows(&want.t, cu[s], lq[s]);
		ape_attn_desc d = desc;
		float *l = malloc(sizeof(float) * (size_t)(H * lq[s]));

		ASSERT_EQ(0, test_tensor_empty(&k, dt, 1, Hkv, n[s], D));
		ASSERT_EQ(0, test_tensor_empty(&v, dt, 1, Hkv, n[s], D));
		for (int64_t t = 0; t < n[s]; t++)
			for (int64_t h = 0; h < Hkv; h++) {
				const int64_t page = indices[indptr[s] + t / P];
				const int64_t e = page * sp + (t % P) * sr + h * sh;

				for (int64_t x = 0; x < D; x++) {
					test_tensor_set(&k.t, 0, h, t, x, vals[koff + e + x]);
					test_tensor_set(&v.t, 0, h, t, x, vals[voff + e + x]);
				}
			}
		vmax = fmax(vmax, test_tensor_maxabs(&v.t));
		ASSERT_NE(NULL, l);
		d.q_start_set = true;
		d.q_start = n[s] - lq[s];
		d.k_start = 0;
		d.skip_tol = 0;
		ASSERT_EQ(0, ape_attention_forward(self->ref, &d, &qs, &k.t, &v.t, &os, l, NULL))
		TH_LOG("%s", ape_last_error());
		for (int64_t h = 0; h < H; h++)
			for (int64_t i = 0; i < lq[s]; i++)
				want_lse[(cu[s] + i) * H + h] = l[h * lq[s] + i];
		test_tensor_free(&k);
		test_tensor_free(&v);
		free(l);
	}
	EXPECT_LE(test_max_err_o(&o.t, &want.t),
		  (test_tol_o(dt) + test_skip_tol_o(desc.skip_tol)) * vmax)
	TH_LOG("%s", ape_dtype_name(dt));
	EXPECT_LE(test_max_rel_err_lse(lse, want_lse, (size_t)(cu[nseq] * H)),
		  test_tol_lse(dt) + test_skip_tol_lse(desc.skip_tol))
	TH_LOG("%s", ape_dtype_name(dt));
	if (self->dev->be->ops->attention_pages && !prefill) {
		EXPECT_STREQ("decode-in-place", st.path);
		EXPECT_EQ(0u, st.bytes_device_to_device);
		EXPECT_EQ(1u, st.chunks);
	}
	if (prefill && !strcmp(self->dev->info.backend, "cuda")) { /* the prefill reads in place */
		EXPECT_EQ(0u, st.bytes_device_to_device) TH_LOG("%s", ape_dtype_name(dt));
	} else if (prefill && self->dev->be->ops->copy_d2d) {
		EXPECT_NE(0u, st.bytes_device_to_device) TH_LOG("%s", ape_dtype_name(dt));
	}

	ape_paged_kv_destroy(pk);
	ape_queue_destroy(queue);
	ape_buffer_free(buf);
	test_tensor_free(&q);
	test_tensor_free(&o);
	test_tensor_free(&want);
	free(vals);
	free(host);
	free(lse);
	free(want_lse);
}

TEST_F(pg, misaligned_pages_decode_equals_reference)
{
	const int64_t n[3] = { 23, 7, 41 }, lq[3] = { 1, 2, 1 };

	layout_case(_metadata, self, APE_F16, 3, n, lq, false);
}

/* Two prefill chunks (33 and 20 rows over 150 and 70 keys), each sequence by itself, GQA,
 * decays and skipping, every storage type: float32 reads K and V in place, f16 and bf16 V (K
 * through ape_prep, which reads the pages too). */
TEST_F(pg, misaligned_pages_prefill_equals_reference)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	const int64_t n[2] = { 150, 70 }, lq[2] = { 33, 20 };

	for (int t = 0; t < 3; t++)
		layout_case(_metadata, self, types[t], 2, n, lq, true);
}

TEST_HARNESS_MAIN
