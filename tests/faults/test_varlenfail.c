/* SPDX-License-Identifier: MIT */
/*
 * Ragged batches under failure (ape_attention_forward_varlen_ex(),
 * ape_attention_backward_varlen(), ape_attention_enqueue_varlen(),
 * ape_attention_backward_enqueue_varlen()): a batch of four sequences
 * (an empty one, default positions, and positions with gaps: the forward one ragged launch with
 * explicit positions, on device tensors too; the backward runs merged by LSE), on the
 * reference and on an OpenCL CPU device; and the same batch at its default positions (the
 * forward, and the backward where the device takes ragged backward launches: one ragged run of
 * the executor, struct ape_be_seg; and the backward on device tensors, which takes default
 * positions only). Each host allocation of a clean
 * run fails in turn (a fault build), then each call of every device op, then the device is lost
 * from each point on: every broken run returns the injected code (or, where the library has a
 * fallback, succeeds with the clean result) with a message naming the call, leaves the inputs
 * byte-identical and the outputs untouched (the host calls stage everything and publish only on
 * success), and the next run is clean. The device-resident run is the whole of a caller's use
 * (queue, buffers, writes, the enqueue call, reads, synchronize): a failure of
 * the call itself names it, and leaves the device's input buffer as written (read back where
 * the device still answers); its outputs on the device are unspecified then (include/ape/ape.h),
 * so they are not read.
 */
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/testutil.h"
#include "faults/sweep.h"

enum { H = 2, HKV = 1, D = 8, TQ = 13, TK = 17, S = 4 };

enum vmode { V_FORWARD, V_BACKWARD, V_RESIDENT, V_RESIDENT_BWD };

struct vcase {
	ape_device *dev;
	enum vmode mode; /* what vcase_prepare_hook() sets up */
	bool bwd;
	/* through ape_attention_enqueue_varlen(), or with bwd ape_attention_backward_enqueue_varlen() */
	bool resident;
	bool in_call; /* the last failed resident run failed in the enqueue call */
	bool moved; /* ... and its device input buffer read back different */
	float q[TQ * H * D], k[TK * HKV * D], v[TK * HKV * D], dout[TQ * H * D];
	float o[TQ * H * D], lse[TQ * H]; /* the forward's outputs (the backward's inputs) */
	float g[TQ * H * D + 2 * TK * HKV * D + 4 * H]; /* dq, dk, dv, dparams */
	float clean[TQ * H * D + TQ * H + TQ * H * D + 2 * TK * HKV * D + 4 * H];
	unsigned char in[sizeof(float) * (2 * TQ * H * D + 2 * TK * HKV * D)]; /* q, k, v, dout */
	int64_t cuq[S + 1], cuk[S + 1], posq[TQ], posk[TK];
	ape_varlen vl;
	ape_attn_desc desc;
	char msg[1024];
};

/* The batch at its default positions (one ragged run) instead of the gapped ones. */
static bool default_positions;

static void vcase_init(struct vcase *c, ape_device *dev, bool bwd)
{
	static const int64_t lq[S] = { 0, 5, 1, 7 }, lk[S] = { 3, 6, 4, 4 };
	ape_rng rng;

	memset(c, 0, sizeof(*c));
	c->dev = dev;
	c->bwd = bwd;
	ape_rng_init(&rng, bwd ? "varlen backward" : "varlen forward");
	for (int i = 0; i < TQ * H * D; i++) {
		c->q[i] = (float)ape_rng_normal(&rng);
		c->dout[i] = (float)ape_rng_normal(&rng);
	}
	for (int i = 0; i < TK * HKV * D; i++) {
		c->k[i] = (float)ape_rng_normal(&rng);
		c->v[i] = (float)ape_rng_normal(&rng);
	}
	for (int s = 0; s < S; s++) {
		c->cuq[s + 1] = c->cuq[s] + lq[s];
		c->cuk[s + 1] = c->cuk[s] + lk[s];
	}
	/* sequence 3 has two runs of keys (a gap) and queries at one position twice */
	for (int s = 0; s < S; s++) {
		for (int64_t j = c->cuk[s]; j < c->cuk[s + 1]; j++)
			c->posk[j] = (j - c->cuk[s]) + (s == 3 && j - c->cuk[s] >= 2 ? 10 : 0);
		for (int64_t i = c->cuq[s]; i < c->cuq[s + 1]; i++)
			c->posq[i] = lk[s] + (i - c->cuq[s]) / (s == 3 ? 2 : 1) + (s == 3 ? 10 : 0);
	}
	ape_varlen_init(&c->vl);
	c->vl.num_seqs = S;
	c->vl.cu_seqlens_q = c->cuq;
	c->vl.cu_seqlens_k = c->cuk;
	c->vl.pos_q = default_positions ? NULL : c->posq;
	c->vl.pos_k = default_positions ? NULL : c->posk;
	ape_attn_desc_init(&c->desc);
	c->desc.delta.value = 0.3f;
	c->desc.lambda.value = 0.2f;
	c->desc.skip_tol = 0;
	memcpy(c->in, c->q, sizeof(c->q));
	memcpy(c->in + sizeof(c->q), c->k, sizeof(c->k));
	memcpy(c->in + sizeof(c->q) + sizeof(c->k), c->v, sizeof(c->v));
	memcpy(c->in + sizeof(c->q) + sizeof(c->k) + sizeof(c->v), c->dout, sizeof(c->dout));
}

/* A [1, heads, rows, D] device tensor of a packed [rows, heads, D] array at `off` of buf. */
static void packed_dtensor(ape_dtensor *t, ape_buffer *buf, size_t off, int64_t rows,
			   int64_t heads)
{
	ape_dtensor_init(t, buf, off, APE_F32, 1, heads, rows, D);
	t->strides[0] = 0;
	t->strides[1] = D;
	t->strides[2] = heads * D;
	t->strides[3] = 1;
}

/* After the enqueue call itself failed: its message kept, c->in_call set, and c->moved when the
 * device's input buffer bi (its first nin bytes, read into back) differs from c->in (not read
 * when the device no longer answers). */
static void call_failed(struct vcase *c, ape_queue *qu, ape_buffer *bi, size_t nin,
			unsigned char *back)
{
	c->in_call = true;
	snprintf(c->msg, sizeof(c->msg), "%s", ape_last_error());
	if (!ape_buffer_read(qu, back, bi, 0, nin) && !ape_queue_synchronize(qu))
		c->moved = memcmp(back, c->in, nin) != 0;
}

/* The forward on device tensors, as a caller runs it: q, k, v in one buffer, o and lse
 * ([total_q, H]) in two more; on success O and LSE read back into c->o and c->lse. A failure
 * of the call itself sets c->in_call, and c->moved when the input buffer, read back, differs
 * from what was written (not read when the device no longer answers). */
static int resident_run(struct vcase *c)
{
	const size_t nin = sizeof(c->q) + sizeof(c->k) + sizeof(c->v);
	const size_t nout = sizeof(c->o) + sizeof(c->lse), nback = nin > nout ? nin : nout;
	ape_buffer *bi = NULL, *bo = NULL, *bl = NULL;
	ape_dtensor q, k, v, o, l;
	ape_queue *qu = NULL;
	unsigned char *back = malloc(nback);
	int ret;

	c->in_call = c->moved = false;
	if (!back)
		return APE_ENOMEM;
	if ((ret = ape_queue_create(c->dev, &qu)) || (ret = ape_buffer_alloc(c->dev, nin, &bi)) ||
	    (ret = ape_buffer_alloc(c->dev, sizeof(c->o), &bo)) ||
	    (ret = ape_buffer_alloc(c->dev, sizeof(c->lse), &bl)) ||
	    (ret = ape_buffer_write(qu, bi, 0, c->in, nin)))
		goto out;
	packed_dtensor(&q, bi, 0, TQ, H);
	packed_dtensor(&k, bi, sizeof(c->q), TK, HKV);
	packed_dtensor(&v, bi, sizeof(c->q) + sizeof(c->k), TK, HKV);
	packed_dtensor(&o, bo, 0, TQ, H);
	ape_dtensor_init(&l, bl, 0, APE_F32, 1, H, TQ, 1);
	l.strides[1] = 1; /* [total_q, H], token-major */
	l.strides[2] = H;
	ret = ape_attention_enqueue_varlen(qu, &c->desc, &c->vl, &q, &k, &v, &o, &l);
	if (ret) {
		call_failed(c, qu, bi, nin, back);
		goto out;
	}
	/* both read back, then published together: a failed read leaves c->o and c->lse alone */
	if (!(ret = ape_buffer_read(qu, back, bo, 0, sizeof(c->o))) &&
	    !(ret = ape_buffer_read(qu, back + sizeof(c->o), bl, 0, sizeof(c->lse))) &&
	    !(ret = ape_queue_synchronize(qu))) {
		memcpy(c->o, back, sizeof(c->o));
		memcpy(c->lse, back + sizeof(c->o), sizeof(c->lse));
	}
out:
	if (ret && !c->in_call)
		snprintf(c->msg, sizeof(c->msg), "%s", ape_last_error());
	ape_queue_destroy(qu);
	ape_buffer_free(bi);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
	free(back);
	return ret;
}

/* The backward on device tensors, as a caller runs it: q, k, v, dout in one buffer, the clean
 * forward's o and lse ([total_q, H]) in another, dq, dk, dv, dparams in a third; on success the
 * gradients read back into c->g. Failures as resident_run(). */
static int resident_bwd_run(struct vcase *c)
{
	const size_t nin = sizeof(c->in), nol = sizeof(c->o) + sizeof(c->lse);
	const size_t nback = nin > sizeof(c->g) ? nin : sizeof(c->g);
	const size_t gk = sizeof(float) * TQ * H * D, gv = gk + sizeof(float) * TK * HKV * D;
	ape_buffer *bi = NULL, *bo = NULL, *bg = NULL;
	ape_dtensor q, k, v, o, l, dout, dq, dk, dv, dp;
	ape_queue *qu = NULL;
	unsigned char *back = malloc(nback);
	int ret;

	c->in_call = c->moved = false;
	if (!back)
		return APE_ENOMEM;
	if ((ret = ape_queue_create(c->dev, &qu)) || (ret = ape_buffer_alloc(c->dev, nin, &bi)) ||
	    (ret = ape_buffer_alloc(c->dev, nol, &bo)) ||
	    (ret = ape_buffer_alloc(c->dev, sizeof(c->g), &bg)) ||
	    (ret = ape_buffer_write(qu, bi, 0, c->in, nin)) ||
	    (ret = ape_buffer_write(qu, bo, 0, c->o, sizeof(c->o))) ||
	    (ret = ape_buffer_write(qu, bo, sizeof(c->o), c->lse, sizeof(c->lse))))
		goto out;
	packed_dtensor(&q, bi, 0, TQ, H);
	packed_dtensor(&k, bi, sizeof(c->q), TK, HKV);
	packed_dtensor(&v, bi, sizeof(c->q) + sizeof(c->k), TK, HKV);
	packed_dtensor(&dout, bi, sizeof(c->q) + sizeof(c->k) + sizeof(c->v), TQ, H);
	packed_dtensor(&o, bo, 0, TQ, H);
	ape_dtensor_init(&l, bo, sizeof(c->o), APE_F32, 1, H, TQ, 1);
	l.strides[1] = 1; /* [total_q, H], token-major */
	l.strides[2] = H;
	packed_dtensor(&dq, bg, 0, TQ, H);
	packed_dtensor(&dk, bg, gk, TK, HKV);
	packed_dtensor(&dv, bg, gv, TK, HKV);
	ape_dtensor_init(&dp, bg, gv + sizeof(float) * TK * HKV * D, APE_F32, 1, 1, H, 4);
	ret = ape_attention_backward_enqueue_varlen(qu, &c->desc, &c->vl, &q, &k, &v, &o, &l,
						    &dout, NULL, &dq, &dk, &dv, &dp);
	if (ret) {
		call_failed(c, qu, bi, nin, back);
		goto out;
	}
	if (!(ret = ape_buffer_read(qu, back, bg, 0, sizeof(c->g))) &&
	    !(ret = ape_queue_synchronize(qu)))
		memcpy(c->g, back, sizeof(c->g));
out:
	if (ret && !c->in_call)
		snprintf(c->msg, sizeof(c->msg), "%s", ape_last_error());
	ape_queue_destroy(qu);
	ape_buffer_free(bi);
	ape_buffer_free(bo);
	ape_buffer_free(bg);
	free(back);
	return ret;
}

/* The call, outputs poisoned first. The backward reads the forward's o and lse (computed once,
 * cleanly, before any injection) and writes g. */
static int vcase_run(struct vcase *c)
{
	ape_tensor tq, tk, tv, to, tdo, dq, dk, dv;
	int ret;

	if (c->resident) {
		if (c->bwd) {
			memset(c->g, 0x5a, sizeof(c->g));
			ret = resident_bwd_run(c);
		} else {
			memset(c->o, 0x5a, sizeof(c->o));
			memset(c->lse, 0x5a, sizeof(c->lse));
			ret = resident_run(c);
		}
		if (!ret)
			c->msg[0] = 0;
		return ret;
	}
	ape_tensor_init_packed(&tq, c->q, APE_F32, TQ, H, D);
	ape_tensor_init_packed(&tk, c->k, APE_F32, TK, HKV, D);
	ape_tensor_init_packed(&tv, c->v, APE_F32, TK, HKV, D);
	ape_tensor_init_packed(&to, c->o, APE_F32, TQ, H, D);
	if (!c->bwd) {
		memset(c->o, 0x5a, sizeof(c->o));
		memset(c->lse, 0x5a, sizeof(c->lse));
		ret = ape_attention_forward_varlen_ex(&c->dev, 1, NULL, &c->desc, &c->vl, &tq, &tk,
						      &tv, &to, c->lse, NULL);
	} else {
		memset(c->g, 0x5a, sizeof(c->g));
		ape_tensor_init_packed(&tdo, c->dout, APE_F32, TQ, H, D);
		ape_tensor_init_packed(&dq, c->g, APE_F32, TQ, H, D);
		ape_tensor_init_packed(&dk, c->g + TQ * H * D, APE_F32, TK, HKV, D);
		ape_tensor_init_packed(&dv, c->g + TQ * H * D + TK * HKV * D, APE_F32, TK, HKV, D);
		ret = ape_attention_backward_varlen(&c->dev, 1, NULL, &c->desc, &c->vl, &tq, &tk, &tv,
						    &to, c->lse, &tdo, NULL, &dq, &dk, &dv,
						    c->g + TQ * H * D + 2 * TK * HKV * D, NULL);
	}
	snprintf(c->msg, sizeof(c->msg), "%s", ret ? ape_last_error() : "");
	return ret;
}

static void keep_clean(struct vcase *c)
{
	memcpy(c->clean, c->o, sizeof(c->o));
	memcpy(c->clean + TQ * H * D, c->lse, sizeof(c->lse));
	memcpy(c->clean + TQ * H * D + TQ * H, c->g, sizeof(c->g));
}

/* NULL when the inputs are intact and the outputs are clean (ret 0) or untouched. */
static const char *vcase_verify(const struct vcase *c, int ret)
{
	const unsigned char *out = c->bwd ? (const void *)c->g : (const void *)c->o;
	const size_t n = c->bwd ? sizeof(c->g) : sizeof(c->o);
	bool in_place;

	if (memcmp(c->in, c->q, sizeof(c->q)) ||
	    memcmp(c->in + sizeof(c->q), c->k, sizeof(c->k)) ||
	    memcmp(c->in + sizeof(c->q) + sizeof(c->k), c->v, sizeof(c->v)) ||
	    memcmp(c->in + sizeof(c->q) + sizeof(c->k) + sizeof(c->v), c->dout, sizeof(c->dout)))
		return "an input changed";
	if (c->resident && c->moved)
		return "a failed call changed the device's inputs";
	if (!ret) {
		if (c->bwd)
			return memcmp(c->g, c->clean + TQ * H * D + TQ * H, sizeof(c->g))
				       ? "not the clean gradients"
				       : NULL;
		return memcmp(c->o, c->clean, sizeof(c->o)) ||
				       memcmp(c->lse, c->clean + TQ * H * D, sizeof(c->lse))
			       ? "not the clean result"
			       : NULL;
	}
	/* a forward's ragged launches wrote O in place (a device reading host memory): said so,
	 * and its LSE, staged, untouched all the same */
	in_place = !c->bwd && strstr(ape_last_error(), "computed in place and are unspecified");
	for (size_t i = 0; i < n && !in_place; i++)
		if (out[i] != 0x5a)
			return "a failed call wrote an output";
	if (!c->bwd)
		for (size_t i = 0; i < sizeof(c->lse); i++)
			if (((const unsigned char *)c->lse)[i] != 0x5a)
				return "a failed call wrote LSE";
	return NULL;
}

static int vcase_prepare(struct vcase *c, ape_device *dev, enum vmode mode)
{
	const bool bwd = mode == V_BACKWARD || mode == V_RESIDENT_BWD;
	int ret;

	vcase_init(c, dev, false);
	c->mode = mode;
	c->resident = mode == V_RESIDENT; /* the backward's forward: the host call's */
	if ((ret = vcase_run(c)))
		return ret;
	keep_clean(c);
	if (!bwd)
		return 0;
	c->bwd = true;
	c->resident = mode == V_RESIDENT_BWD;
	if ((ret = vcase_run(c)))
		return ret;
	keep_clean(c);
	return 0;
}

static const char *const what[4] = { "forward", "backward", "enqueue_varlen",
				     "backward_enqueue_varlen" };

/* A failed run's message names the call: the ragged call's name, or for the resident run one
 * that failed before or after ape_attention_enqueue_varlen() (a buffer, a copy) its own. */
static bool names_the_call(const struct vcase *c, const char *call_word)
{
	if (!c->resident)
		return strstr(c->msg, call_word) != NULL;
	return c->in_call ? strstr(c->msg, c->bwd ? "ape_attention_backward_enqueue_varlen: "
						  : "ape_attention_enqueue_varlen: ") != NULL
			  : c->msg[0] != 0;
}

/* The hooks of struct sweep (sweep.h) over a vcase. */
static int vcase_prepare_hook(void *p)
{
	struct vcase *c = p;

	return vcase_prepare(c, c->dev, c->mode);
}

static int vcase_run_hook(void *p)
{
	return vcase_run(p);
}

static const char *vcase_verify_hook(const void *p, int ret)
{
	return vcase_verify(p, ret);
}

static bool names_the_call_hook(const void *p, const char *word)
{
	return names_the_call(p, word);
}

/* One sweep (alloc_sweep or device_sweep, sweep.h) of the batch in mode on dev. */
static void vcase_sweep(struct __test_metadata *_metadata, ape_device *dev, enum vmode mode,
			void (*sweep)(struct __test_metadata *, const struct sweep *))
{
	struct vcase *c = malloc(sizeof(*c));
	struct sweep s = {
		.dev = dev, .what = what[mode], .c = c, .prepare = vcase_prepare_hook,
		.run = vcase_run_hook, .verify = vcase_verify_hook,
		.names_the_call = names_the_call_hook, .alloc_word = "_varlen",
		.device_word = "sequence",
	};

	ASSERT_NE(NULL, c);
	c->dev = dev;
	c->mode = mode;
	s.msg = c->msg;
	s.in_call = mode == V_RESIDENT || mode == V_RESIDENT_BWD ? &c->in_call : NULL;
	sweep(_metadata, &s);
	free(c);
}

struct sweep_fn {
	void (*sweep)(struct __test_metadata *, const struct sweep *);
};

static void every_case(struct __test_metadata *_metadata, ape_device *dev, void *arg)
{
	void (*sweep)(struct __test_metadata *, const struct sweep *) =
		((const struct sweep_fn *)arg)->sweep;

	default_positions = false;
	vcase_sweep(_metadata, dev, V_FORWARD, sweep);
	vcase_sweep(_metadata, dev, V_BACKWARD, sweep);
	vcase_sweep(_metadata, dev, V_RESIDENT, sweep);
	default_positions = true;
	ksft_print_msg("default positions:\n");
	vcase_sweep(_metadata, dev, V_FORWARD, sweep);
	vcase_sweep(_metadata, dev, V_BACKWARD, sweep);
	vcase_sweep(_metadata, dev, V_RESIDENT, sweep);
	/* on device tensors the backward takes positions whose pieces have no sum to make */
	vcase_sweep(_metadata, dev, V_RESIDENT_BWD, sweep);
	default_positions = false;
}

static void on_backends(struct __test_metadata *_metadata,
			void (*sweep)(struct __test_metadata *, const struct sweep *))
{
	struct sweep_fn f = { sweep };

	sweep_backends(_metadata, every_case, &f);
}

TEST(allocation_failures)
{
#ifndef APE_FAULT_INJECT
	SKIP(return, "libape built without -DAPE_FAULT_INJECT: run `make faults-ci`");
#endif
	on_backends(_metadata, alloc_sweep);
}

TEST(device_failures)
{
	on_backends(_metadata, device_sweep);
}

TEST_HARNESS_MAIN
