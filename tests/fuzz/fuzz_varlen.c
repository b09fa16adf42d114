/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: ragged batches (ape_attention_forward_varlen(),
 * ape_attention_backward_varlen()) on the reference device, with the batch read from the input:
 * the sequence count, both offset arrays (short, decreasing, past the totals, not starting at
 * 0), positions absent or any int64 (gaps, repeats, the ends of the range: distances that
 * overflow), causal or not, small tensors.
 *
 * Promises checked: every call returns 0, APE_EINVAL or APE_EOVERFLOW, never crashes or reads
 * outside its arrays (ASan); a refused call writes nothing (O, LSE and the gradients keep their
 * poison) and names a vl field, desc or a sequence; an accepted one writes every row: O a
 * convex combination of V rows (|O| <= max |V| + 1e-4 for finite inputs), LSE finite or -inf,
 * and -inf exactly for rows no key reaches; its backward succeeds with finite gradients.
 *
 * The same batch also goes through ape_attention_enqueue_varlen() on the host arrays wrapped as
 * buffers of the reference (ape_buffer_wrap_host(), one queue): it returns what the host call
 * returned (the reference reads explicit positions, so nothing is refused there that the host
 * call takes), a refusal writes nothing, and an accepted call's O and LSE (token-major, as the
 * host call writes it) are the host call's bit for bit.
 *
 * The backward goes through ape_attention_backward_enqueue_varlen() on the wrapped arrays too: the
 * host backward's code (or APE_ENOTSUP naming vl->pos_k or vl->pos_q for explicit positions the
 * device-tensor call leaves to the host call), a refusal writing nothing, accepted gradients
 * the host call's bit for bit.
 *
 * And through ape_attention_forward_varlen_dlpack() and ape_attention_backward_varlen_dlpack()
 * on kDLCPU DLTensors over the same arrays (packed [total, heads, D], LSE [total_q, H],
 * dparams [H, 4]): the host calls' codes, a refusal writing nothing and naming the DLPack
 * function, an accepted call's O, LSE and gradients the host calls' bit for bit.
 */
#define FUZZ_NAME "fuzz_varlen"
#include "fuzz_input.h"

#include <math.h>
#include <string.h>

#include "ape/ape_dlpack.h"

enum { MAXS = 6, MAXT = 24, H = 2, HKV = 1, D = 4 };

static bool sees_a_key(const ape_varlen *vl, int64_t i, bool causal)
{
	for (int64_t s = 0; s < vl->num_seqs; s++) {
		if (i < vl->cu_seqlens_q[s] || i >= vl->cu_seqlens_q[s + 1])
			continue;
		for (int64_t j = vl->cu_seqlens_k[s]; j < vl->cu_seqlens_k[s + 1]; j++) {
			const int64_t lq = vl->cu_seqlens_q[s + 1] - vl->cu_seqlens_q[s];
			const int64_t lk = vl->cu_seqlens_k[s + 1] - vl->cu_seqlens_k[s];
			const int64_t pq = vl->pos_q ? vl->pos_q[i]
						     : lk - lq + (i - vl->cu_seqlens_q[s]);
			const int64_t pk = vl->pos_k ? vl->pos_k[j] : j - vl->cu_seqlens_k[s];

			if (!causal || pk <= pq)
				return true;
		}
		return false;
	}
	return false;
}

/* A [1, heads, rows, D] device tensor over the packed [rows, heads, D] host array of buf. */
static void packed_dtensor(ape_dtensor *t, ape_buffer *buf, int64_t rows, int64_t heads)
{
	ape_dtensor_init(t, buf, 0, APE_F32, 1, heads, rows, D);
	t->strides[0] = 0;
	t->strides[1] = D;
	t->strides[2] = heads * D;
	t->strides[3] = 1;
}

/* The batch through ape_attention_enqueue_varlen() on the host arrays q, k, v (wrapped), into
 * o2 and lse2 (poisoned here): the host call's code, and where it succeeded, its o and lse. */
static void resident_same(const ape_attn_desc *desc, const ape_varlen *vl, int64_t tq, int64_t tk,
			  float *q, float *k, float *v, size_t nq, size_t nk, const float *o,
			  const float *lse, int host_ret)
{
	static float o2[MAXT * H * D], lse2[MAXT * H];
	static ape_queue *queue;
	ape_buffer *b[5] = { NULL };
	ape_dtensor tq_d, tk_d, tv_d, to_d, tl_d;
	int ret;

	if (!queue)
		check(ape_queue_create(ref, &queue) == 0, "ape_queue_create(ref)");
	memset(o2, 0x5a, sizeof(o2));
	memset(lse2, 0x5a, sizeof(lse2));
	check(ape_buffer_wrap_host(ref, q, nq, &b[0]) == 0 &&
		      ape_buffer_wrap_host(ref, k, nk, &b[1]) == 0 &&
		      ape_buffer_wrap_host(ref, v, nk, &b[2]) == 0 &&
		      ape_buffer_wrap_host(ref, o2, sizeof(o2), &b[3]) == 0 &&
		      ape_buffer_wrap_host(ref, lse2, sizeof(lse2), &b[4]) == 0,
	      "ape_buffer_wrap_host(ref)");
	packed_dtensor(&tq_d, b[0], tq, H);
	packed_dtensor(&tk_d, b[1], tk, HKV);
	packed_dtensor(&tv_d, b[2], tk, HKV);
	packed_dtensor(&to_d, b[3], tq, H);
	ape_dtensor_init(&tl_d, b[4], 0, APE_F32, 1, H, tq, 1);
	tl_d.strides[0] = 0; /* [total_q, H], token-major */
	tl_d.strides[1] = 1;
	tl_d.strides[2] = H;
	ret = ape_attention_enqueue_varlen(queue, desc, vl, &tq_d, &tk_d, &tv_d, &to_d, &tl_d);
	check(ret == host_ret, "enqueue_varlen returns what the host call returns");
	check(ape_queue_synchronize(queue) == 0, "and its work runs");
	if (ret) {
		for (size_t i = 0; i < sizeof(o2); i++)
			check(((uint8_t *)o2)[i] == 0x5a, "a refused enqueue_varlen writes no O");
		for (size_t i = 0; i < sizeof(lse2); i++)
			check(((uint8_t *)lse2)[i] == 0x5a,
			      "a refused enqueue_varlen writes no LSE");
	} else {
		check(!memcmp(o2, o, (size_t)(tq * H * D) * sizeof(float)),
		      "enqueue_varlen's O is the host call's, bit for bit");
		check(!memcmp(lse2, lse, (size_t)(tq * H) * sizeof(float)),
		      "enqueue_varlen's LSE is the host call's, bit for bit");
	}
	for (int i = 0; i < 5; i++)
		ape_buffer_free(b[i]);
}

/* The backward through ape_attention_backward_enqueue_varlen() on the host arrays (wrapped), dO = O,
 * against the host backward's code bwd_ret and gradients g (dq, dk, dv, dparams at the offsets
 * LLVMFuzzerTestOneInput() uses). */
static void resident_bwd_same(const ape_attn_desc *desc, const ape_varlen *vl, int64_t tq,
			      int64_t tk, float *q, float *k, float *v, size_t nq, size_t nk,
			      float *o, float *lse, const float *g, int bwd_ret)
{
	static float g2[MAXT * H * D + 2 * MAXT * HKV * D + 4 * H];
	float *const gk = g2 + MAXT * H * D, *const gv = gk + MAXT * HKV * D, *const gp = gv + MAXT * HKV * D;
	static ape_queue *queue;
	ape_buffer *b[6] = { NULL };
	ape_dtensor tq_d, tk_d, tv_d, to_d, tl_d, dq_d, dk_d, dv_d, dp_d;
	int ret;

	if (!queue)
		check(ape_queue_create(ref, &queue) == 0, "ape_queue_create(ref)");
	memset(g2, 0x5a, sizeof(g2));
	check(ape_buffer_wrap_host(ref, q, nq, &b[0]) == 0 &&
		      ape_buffer_wrap_host(ref, k, nk, &b[1]) == 0 &&
		      ape_buffer_wrap_host(ref, v, nk, &b[2]) == 0 &&
		      ape_buffer_wrap_host(ref, o, nq, &b[3]) == 0 &&
		      ape_buffer_wrap_host(ref, lse, MAXT * H * sizeof(float), &b[4]) == 0 &&
		      ape_buffer_wrap_host(ref, g2, sizeof(g2), &b[5]) == 0,
	      "ape_buffer_wrap_host(ref)");
	packed_dtensor(&tq_d, b[0], tq, H);
	packed_dtensor(&tk_d, b[1], tk, HKV);
	packed_dtensor(&tv_d, b[2], tk, HKV);
	packed_dtensor(&to_d, b[3], tq, H);
	ape_dtensor_init(&tl_d, b[4], 0, APE_F32, 1, H, tq, 1);
	tl_d.strides[0] = 0; /* [total_q, H], token-major */
	tl_d.strides[1] = 1;
	tl_d.strides[2] = H;
	packed_dtensor(&dq_d, b[5], tq, H);
	packed_dtensor(&dk_d, b[5], tk, HKV);
	dk_d.byte_offset = (uint64_t)((char *)gk - (char *)g2);
	packed_dtensor(&dv_d, b[5], tk, HKV);
	dv_d.byte_offset = (uint64_t)((char *)gv - (char *)g2);
	ape_dtensor_init(&dp_d, b[5], (uint64_t)((char *)gp - (char *)g2), APE_F32, 1, 1, H, 4);
	ret = ape_attention_backward_enqueue_varlen(queue, desc, vl, &tq_d, &tk_d, &tv_d, &to_d,
						    &tl_d, &to_d, NULL, &dq_d, &dk_d, &dv_d, &dp_d);
	check(ret == bwd_ret ||
		      (ret == APE_ENOTSUP && !bwd_ret && (vl->pos_q || vl->pos_k) &&
		       (strstr(ape_last_error(), "vl->pos_k") || strstr(ape_last_error(), "vl->pos_q"))),
	      "backward_enqueue_varlen returns what the host call returns (or leaves explicit "
	      "positions to it, naming them)");
	check(ape_queue_synchronize(queue) == 0, "and its work runs");
	if (ret) {
		for (size_t i = 0; i < sizeof(g2); i++)
			check(((uint8_t *)g2)[i] == 0x5a, "a refused backward_enqueue_varlen writes nothing");
	} else {
		check(!memcmp(g2, g, (size_t)(tq * H * D) * sizeof(float)) &&
			      !memcmp(gk, g + MAXT * H * D, (size_t)(tk * HKV * D) * sizeof(float)) &&
			      !memcmp(gv, g + MAXT * H * D + MAXT * HKV * D,
				      (size_t)(tk * HKV * D) * sizeof(float)) &&
			      !memcmp(gp, g + MAXT * H * D + 2 * MAXT * HKV * D, 4 * H * sizeof(float)),
		      "backward_enqueue_varlen's gradients are the host call's, bit for bit");
	}
	for (int i = 0; i < 6; i++)
		ape_buffer_free(b[i]);
}

/* A kDLCPU float32 DLTensor over data: [n0, n1, n2] (n2 < 0: [n0, n1]), compact. */
static DLTensor dl_host(void *data, int64_t *shape, int64_t n0, int64_t n1, int64_t n2)
{
	shape[0] = n0;
	shape[1] = n1;
	shape[2] = n2;
	return (DLTensor){ .data = data, .device = { kDLCPU, 0 }, .ndim = n2 < 0 ? 2 : 3,
			   .dtype = { kDLFloat, 32, 1 }, .shape = shape };
}

/* What a refused DLPack call must leave: n bytes at p all 0x5a, the message naming fn. */
static void refused_untouched(const void *p, size_t n, const char *fn)
{
	for (size_t i = 0; i < n; i++)
		check(((const uint8_t *)p)[i] == 0x5a, "a refused DLPack call writes nothing");
	check(strstr(ape_last_error(), fn) != NULL, "the DLPack refusal names its function");
}

/* The ragged DLPack calls on kDLCPU tensors over q, k, v: the forward into o2, lse2 (host_ret,
 * o, lse: the host forward's); then the backward with dO = O, the host backward's code bwd_ret
 * and gradients g (dq, dk, dv, dparams at the offsets LLVMFuzzerTestOneInput() uses). */
static void dlpack_same(const ape_attn_desc *desc, const ape_varlen *vl, int64_t tq,
			int64_t tk, float *q, float *k, float *v, const float *o,
			const float *lse, int host_ret, const float *g, int bwd_ret)
{
	static float o2[MAXT * H * D], lse2[MAXT * H];
	static float g2[MAXT * H * D + 2 * MAXT * HKV * D + 4 * H];
	float *const dk = g2 + MAXT * H * D, *const dv = dk + MAXT * HKV * D;
	float *const dp = dv + MAXT * HKV * D;
	int64_t sh[11][3];
	DLTensor t[11] = {
		dl_host(q, sh[0], tq, H, D),	    dl_host(k, sh[1], tk, HKV, D),
		dl_host(v, sh[2], tk, HKV, D),	    dl_host(o2, sh[3], tq, H, D),
		dl_host(lse2, sh[4], tq, H, -1),    dl_host(g2, sh[5], tq, H, D),
		dl_host(dk, sh[6], tk, HKV, D),	    dl_host(dv, sh[7], tk, HKV, D),
		dl_host(dp, sh[8], H, 4, -1),	    dl_host((float *)o, sh[9], tq, H, D),
		dl_host((float *)lse, sh[10], tq, H, -1),
	};
	int ret;

	memset(o2, 0x5a, sizeof(o2));
	memset(lse2, 0x5a, sizeof(lse2));
	ret = ape_attention_forward_varlen_dlpack(ref, desc, vl, &t[0], &t[1], &t[2], &t[3], &t[4],
						  NULL);
	check(ret == host_ret, "forward_varlen_dlpack returns what the host call returns");
	if (ret) {
		refused_untouched(o2, sizeof(o2), "ape_attention_forward_varlen_dlpack");
		refused_untouched(lse2, sizeof(lse2), "ape_attention_forward_varlen_dlpack");
	} else {
		check(!memcmp(o2, o, (size_t)(tq * H * D) * sizeof(float)) &&
			      !memcmp(lse2, lse, (size_t)(tq * H) * sizeof(float)),
		      "forward_varlen_dlpack's O and LSE are the host call's, bit for bit");
	}
	/* the backward over the host forward's O and LSE (poisoned after a refusal) */
	memset(g2, 0x5a, sizeof(g2));
	ret = ape_attention_backward_varlen_dlpack(ref, desc, vl, &t[0], &t[1], &t[2], &t[9],
						   &t[10], &t[9], NULL, &t[5], &t[6], &t[7], &t[8],
						   NULL);
	check(ret == bwd_ret, "backward_varlen_dlpack returns what the host call returns");
	if (ret) {
		refused_untouched(g2, sizeof(g2), "ape_attention_backward_varlen_dlpack");
		return;
	}
	check(!memcmp(g2, g, (size_t)(tq * H * D) * sizeof(float)) &&
		      !memcmp(dk, g + MAXT * H * D, (size_t)(tk * HKV * D) * sizeof(float)) &&
		      !memcmp(dv, g + MAXT * H * D + MAXT * HKV * D,
			      (size_t)(tk * HKV * D) * sizeof(float)) &&
		      !memcmp(dp, g + MAXT * H * D + 2 * MAXT * HKV * D, 4 * H * sizeof(float)),
	      "backward_varlen_dlpack's gradients are the host call's, bit for bit");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = { data, size };
	static float q[MAXT * H * D], k[MAXT * HKV * D], v[MAXT * HKV * D], o[MAXT * H * D];
	static float lse[MAXT * H], g[MAXT * H * D + 2 * MAXT * HKV * D + 4 * H];
	int64_t cuq[MAXS + 1], cuk[MAXS + 1], posq[MAXT], posk[MAXT];
	const int64_t S = (int64_t)(take(&in, 1) % (MAXS + 1));
	const unsigned flags = (unsigned)take(&in, 1);
	const int64_t tq = (int64_t)(take(&in, 1) % (MAXT + 1)), tk = (int64_t)(take(&in, 1) % (MAXT + 1));
	ape_tensor tq_t, tk_t, tv_t, to_t, dq, dk, dv;
	ape_attn_desc desc;
	ape_varlen vl;
	float vmax = 0;
	int ret, bret;

	/* offsets: mostly a valid batch (cumulative small lengths), sometimes raw values */
	cuq[0] = cuk[0] = 0;
	for (int64_t s = 1; s <= S; s++) {
		cuq[s] = flags & 1 ? take_int(&in) : cuq[s - 1] + (int64_t)(take(&in, 1) % 6);
		cuk[s] = flags & 2 ? take_int(&in) : cuk[s - 1] + (int64_t)(take(&in, 1) % 6);
	}
	if (flags & 4)
		cuq[0] = take_int(&in);
	for (int64_t i = 0; i < MAXT; i++) {
		posq[i] = flags & 64 ? take_int(&in) : (int64_t)(take(&in, 1) % 40);
		posk[i] = flags & 64 ? take_int(&in) : (int64_t)(take(&in, 1) % 40);
	}
	for (int i = 0; i < MAXT * H * D; i++)
		q[i] = (float)((int)take(&in, 1) - 128) / 64;
	for (int i = 0; i < MAXT * HKV * D; i++) {
		k[i] = (float)((int)take(&in, 1) - 128) / 64;
		v[i] = (float)((int)take(&in, 1) - 128) / 64;
		vmax = fmaxf(vmax, fabsf(v[i]));
	}
	ape_varlen_init(&vl);
	vl.num_seqs = S;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	vl.pos_q = flags & 8 ? posq : NULL;
	vl.pos_k = flags & 16 ? posk : NULL;
	if (flags & 128)
		vl.num_seqs = -1 - (int64_t)take(&in, 1);
	ape_attn_desc_init(&desc);
	desc.causal = flags & 32;
	desc.delta.value = (float)(take(&in, 1) % 8) / 16;
	desc.lambda.value = (float)(take(&in, 1) % 8) / 16;
	ape_tensor_init_packed(&tq_t, q, APE_F32, tq, H, D);
	ape_tensor_init_packed(&tk_t, k, APE_F32, tk, HKV, D);
	ape_tensor_init_packed(&tv_t, v, APE_F32, tk, HKV, D);
	ape_tensor_init_packed(&to_t, o, APE_F32, tq, H, D);
	memset(o, 0x5a, sizeof(o));
	memset(lse, 0x5a, sizeof(lse));
	ret = ape_attention_forward_varlen(ref, &desc, &vl, &tq_t, &tk_t, &tv_t, &to_t, lse, NULL);
	check(ret == 0 || ret == APE_EINVAL || ret == APE_EOVERFLOW,
	      "a ragged call returns 0, EINVAL or EOVERFLOW");
	resident_same(&desc, &vl, tq, tk, q, k, v, sizeof(q), sizeof(k), o, lse, ret);
	ape_tensor_init_packed(&dq, g, APE_F32, tq, H, D);
	ape_tensor_init_packed(&dk, g + MAXT * H * D, APE_F32, tk, HKV, D);
	ape_tensor_init_packed(&dv, g + MAXT * H * D + MAXT * HKV * D, APE_F32, tk, HKV, D);
	if (ret) {
		const char *m = ape_last_error();

		for (size_t i = 0; i < sizeof(o); i++)
			check(((uint8_t *)o)[i] == 0x5a, "a refused call writes no O");
		for (size_t i = 0; i < sizeof(lse); i++)
			check(((uint8_t *)lse)[i] == 0x5a, "a refused call writes no LSE");
		check(strstr(m, "vl") || strstr(m, "sequence") || strstr(m, "desc"),
		      "the refusal names the batch");
		/* the backward refuses the batch too (its code, for the DLPack calls to match) */
		bret = ape_attention_backward_varlen(&ref, 1, NULL, &desc, &vl, &tq_t, &tk_t, &tv_t,
						     &to_t, lse, &to_t, NULL, &dq, &dk, &dv,
						     g + MAXT * H * D + 2 * MAXT * HKV * D, NULL);
		check(bret != 0, "the backward refuses what the forward refuses");
		resident_bwd_same(&desc, &vl, tq, tk, q, k, v, sizeof(q), sizeof(k), o, lse, g, bret);
		dlpack_same(&desc, &vl, tq, tk, q, k, v, o, lse, ret, g, bret);
		return 0;
	}
	for (int64_t i = 0; i < tq; i++)
		for (int64_t h = 0; h < H; h++) {
			const float l = lse[i * H + h];
			const bool seen = sees_a_key(&vl, i, desc.causal);

			check(seen ? isfinite(l) : (isinf(l) && l < 0),
			      "LSE finite where a key is seen, -inf elsewhere");
			for (int64_t d = 0; d < D; d++) {
				const float x = o[(i * H + h) * D + d];

				check(isfinite(x) && fabsf(x) <= vmax + 1e-4f,
				      "O a convex combination of V");
				check(seen || x == 0, "O = 0 where no key is seen");
			}
		}
	/* the backward of the accepted call, dO = O */
	ret = ape_attention_backward_varlen(&ref, 1, NULL, &desc, &vl, &tq_t, &tk_t, &tv_t, &to_t,
					    lse, &to_t, NULL, &dq, &dk, &dv,
					    g + MAXT * H * D + 2 * MAXT * HKV * D, NULL);
	check(ret == 0, "the backward of an accepted ragged call succeeds");
	for (int64_t i = 0; i < tq * H * D; i++)
		check(isfinite(g[i]), "finite dQ");
	for (int64_t i = 0; i < tk * HKV * D; i++)
		check(isfinite(g[MAXT * H * D + i]) && isfinite(g[MAXT * H * D + MAXT * HKV * D + i]),
		      "finite dK and dV");
	resident_bwd_same(&desc, &vl, tq, tk, q, k, v, sizeof(q), sizeof(k), o, lse, g, 0);
	dlpack_same(&desc, &vl, tq, tk, q, k, v, o, lse, 0, g, 0);
	return 0;
}
