/* SPDX-License-Identifier: MIT */
/*
 * Explicit positions and the ragged DLPack calls under failure, on the reference and on an
 * OpenCL CPU device (tests/faults/fixture.h), by the sweeps of sweep.h: each host allocation
 * of a clean run fails in turn (a fault build), then each call of every device op, then the
 * device is lost from each point on.
 *   - The dense call at explicit positions (ape_attn_desc.pos_q, .pos_k: a batch of two,
 *     positions with a gap, a repeat and a query that sees only the first run of keys, causal,
 *     GQA): ape_attention_forward_ex() as one run of the executor at the positions (a device
 *     that reads them) and per batch element as a one-sequence ragged call (the capability
 *     positions hidden, WRAP_NO_POSITIONS); ape_attention_backward_ex(), per element on
 *     every device (its kernels read no positions: hiding the capability changes nothing).
 *   - ape_attention_forward_varlen_dlpack() and ape_attention_backward_varlen_dlpack() on
 *     kDLCPU tensors (the host route; tests/dlpack_call.h's struct rag: positions with gaps,
 *     padded rows, a head-major LSE the call stages and writes back; the backward with dLSE
 *     and every gradient).
 * Every broken run returns the injected code with a message naming the call, leaves the inputs
 * (positions and, for the backward, O and LSE too) byte-identical and the outputs untouched
 * (these calls stage their outputs and publish them on success only), and the next run is
 * clean, bit for bit the clean result.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/bwdcase.h"
#include "common/testutil.h"
#include "dlpack_call.h"
#include "faults/fixture.h"
#include "faults/sweep.h"

FX_FIXTURE(pf)

/* ---------------------------------------------------------------- the dense call */

enum { B = 2, H = 2, HKV = 1, LQ = 4, LK = 5, D = 8 };
enum { NQ = B * H * LQ * D, NK = B * HKV * LK * D, NG = NQ + 2 * NK + 4 * H };

struct pins {
	float q[NQ], k[NK], v[NK], dout[NQ];
	int64_t posq[LQ], posk[LK];
};

struct pouts {
	float o[NQ], lse[B * H * LQ]; /* the forward's outputs (the backward's inputs) */
	float g[NG]; /* dq, dk, dv, dparams */
};

struct pcase {
	ape_device *dev;
	bool bwd;
	struct pins in, in0; /* what the calls read, and a copy */
	struct pouts out, clean;
	ape_attn_desc desc;
	char msg[1024];
};

static void pcase_init(struct pcase *c, ape_device *dev)
{
	/* two runs of keys (0..2, 10..11); queries at 9 (the first run only), 11 twice, 12 */
	static const int64_t pq[LQ] = { 9, 11, 11, 12 }, pk[LK] = { 0, 1, 2, 10, 11 };
	ape_rng rng;

	memset(c, 0, sizeof(*c));
	c->dev = dev;
	ape_rng_init(&rng, "dense positions");
	for (int i = 0; i < NQ; i++) {
		c->in.q[i] = (float)ape_rng_normal(&rng);
		c->in.dout[i] = (float)ape_rng_normal(&rng);
	}
	for (int i = 0; i < NK; i++) {
		c->in.k[i] = (float)ape_rng_normal(&rng);
		c->in.v[i] = (float)ape_rng_normal(&rng);
	}
	memcpy(c->in.posq, pq, sizeof(pq));
	memcpy(c->in.posk, pk, sizeof(pk));
	c->in0 = c->in;
	ape_attn_desc_init(&c->desc);
	c->desc.causal = true;
	c->desc.delta.value = 0.3f;
	c->desc.lambda.value = 0.2f;
	c->desc.skip_tol = 0;
	c->desc.pos_q = c->in.posq;
	c->desc.pos_k = c->in.posk;
}

/* The call, its outputs poisoned first; the backward reads the clean forward's O and LSE. */
static int pcase_run(void *p)
{
	struct pcase *c = p;
	struct pouts *u = &c->out;
	ape_tensor q, k, v, o, dout, dq, dk, dv;
	int ret;

	ape_tensor_init(&q, c->in.q, APE_F32, B, H, LQ, D);
	ape_tensor_init(&k, c->in.k, APE_F32, B, HKV, LK, D);
	ape_tensor_init(&v, c->in.v, APE_F32, B, HKV, LK, D);
	ape_tensor_init(&o, u->o, APE_F32, B, H, LQ, D);
	if (!c->bwd) {
		memset(u, SWEEP_POISON, offsetof(struct pouts, g));
		ret = ape_attention_forward_ex(&c->dev, 1, NULL, &c->desc, &q, &k, &v, &o, u->lse,
					       NULL);
	} else {
		memset(u->g, SWEEP_POISON, sizeof(u->g));
		ape_tensor_init(&dout, c->in.dout, APE_F32, B, H, LQ, D);
		ape_tensor_init(&dq, u->g, APE_F32, B, H, LQ, D);
		ape_tensor_init(&dk, u->g + NQ, APE_F32, B, HKV, LK, D);
		ape_tensor_init(&dv, u->g + NQ + NK, APE_F32, B, HKV, LK, D);
		ret = ape_attention_backward_ex(&c->dev, 1, NULL, &c->desc, &q, &k, &v, &o, u->lse,
						&dout, NULL, &dq, &dk, &dv, u->g + NQ + 2 * NK,
						NULL);
	}
	snprintf(c->msg, sizeof(c->msg), "%s", ret ? ape_last_error() : "");
	return ret;
}

static const char *pcase_verify(const void *p, int ret)
{
	const struct pcase *c = p;
	const size_t fwd = offsetof(struct pouts, g);

	if (memcmp(&c->in, &c->in0, sizeof(c->in)))
		return "an input changed";
	if (!c->bwd)
		return sweep_outputs_verify(&c->out, &c->clean, fwd, ret);
	if (memcmp(&c->out, &c->clean, fwd))
		return "the backward changed O or LSE";
	return sweep_outputs_verify(c->out.g, c->clean.g, sizeof(c->out.g), ret);
}

/* Sets up c (c->dev, c->bwd kept) and runs the forward, then the backward, cleanly. */
static int pcase_prepare(void *p)
{
	struct pcase *c = p;
	const bool bwd = c->bwd;
	int ret;

	pcase_init(c, c->dev);
	if ((ret = pcase_run(c)))
		return ret;
	c->clean = c->out;
	if (!bwd)
		return 0;
	c->bwd = true;
	if ((ret = pcase_run(c)))
		return ret;
	c->clean = c->out;
	return 0;
}

/* ---------------------------------------------------------------- the ragged DLPack calls */

struct lcase {
	ape_device *dev;
	bool bwd;
	struct rag x; /* q, k, v, o, lse (dlpack_call.h) */
	unsigned char *in0; /* x.in as made */
	int64_t *posq0, *posk0;
	/* the backward's: dout, dlse (and a copy of both), then dq, dk, dv, dparams (float32,
	 * compact) */
	float *bin, *g;
	size_t nbin, ng;
	int64_t shp[6][3];
	DLTensor t[6];
	/* the clean outputs: O's allocation, LSE's, the gradients */
	unsigned char *clean_out;
	float *clean_lse, *clean_g, *o0, *lse0;
	char msg[1024];
};

static void lcase_free(struct lcase *c)
{
	rag_free(&c->x);
	free(c->in0);
	free(c->posq0);
	free(c->posk0);
	free(c->bin);
	free(c->g);
	free(c->clean_out);
	free(c->clean_lse);
	free(c->clean_g);
	free(c->o0);
	free(c->lse0);
}

static void *dup_bytes(const void *p, size_t n)
{
	void *d = malloc(n + 1);

	if (d)
		memcpy(d, p, n);
	return d;
}

/* Does some query of x see some key (so that its calls do device work for the sweeps to
 * break)? Default positions: the last query of a sequence with keys sees them. */
static bool rag_sees_a_key(const struct rag *x)
{
	for (int64_t s = 0; s < x->S; s++)
		for (int64_t i = x->cuq[s]; i < x->cuq[s + 1]; i++)
			for (int64_t j = x->cuk[s]; j < x->cuk[s + 1]; j++)
				if (!x->desc.causal || !x->posq || !x->posk ||
				    x->posk[j] <= x->posq[i])
					return true;
	return false;
}

/* The batch: float32, padded rows, positions with gaps, a head-major LSE; three sequences,
 * 6 to 12 queries and 6 to 14 keys in all (small: the backward's sweeps run it thousands of
 * times), some query seeing some key (a batch whose rows see none does no device work: CI drew
 * one, and the device-failure sweep had nothing to break). */
static int lcase_make(struct lcase *c)
{
	struct rag *x = &c->x;
	ape_rng rng;

	ape_rng_init(&rng, "varlen dlpack");
	for (;;) {
		rag_make(x, &rng, APE_F32, false, true, RAG_GAPS);
		if (x->S == 3 && x->tq >= 6 && x->tq <= 12 && x->tk >= 6 && x->tk <= 14 &&
		    x->with_lse && x->strided_lse && rag_sees_a_key(x))
			break;
		rag_free(x);
	}
	x->desc.skip_tol = 0;
	c->nbin = (size_t)(2 * x->tq * x->H * x->D) + (size_t)(x->tq * x->H); /* dout, dlse */
	c->ng = (size_t)(x->tq * x->H * x->D + 2 * x->tk * x->G * x->D + 4 * x->H);
	c->bin = malloc(2 * sizeof(float) * c->nbin); /* and a copy after them */
	c->g = malloc(sizeof(float) * c->ng);
	c->in0 = dup_bytes(x->in, x->in_bytes);
	c->posq0 = dup_bytes(x->posq, sizeof(int64_t) * (size_t)x->tq);
	c->posk0 = dup_bytes(x->posk, sizeof(int64_t) * (size_t)x->tk);
	if (!c->bin || !c->g || !c->in0 || !c->posq0 || !c->posk0)
		return APE_ENOMEM;
	for (size_t i = 0; i < c->nbin; i++)
		c->bin[i] = c->bin[c->nbin + i] = (float)ape_rng_normal(&rng);
	{
		const int64_t tq = x->tq, tk = x->tk, Hq = x->H, G = x->G, Dd = x->D;
		const int64_t d3[6][3] = { { tq, Hq, Dd }, { tq, Hq, -1 }, { tq, Hq, Dd },
					   { tk, G, Dd },  { tk, G, Dd },  { Hq, 4, -1 } };
		float *at[6] = { c->bin, c->bin + tq * Hq * Dd, c->g, c->g + tq * Hq * Dd,
				 c->g + tq * Hq * Dd + tk * G * Dd,
				 c->g + tq * Hq * Dd + 2 * tk * G * Dd };

		for (int i = 0; i < 6; i++) {
			memcpy(c->shp[i], d3[i], sizeof(c->shp[i]));
			c->t[i] = (DLTensor){ .data = at[i], .device = { kDLCPU, 0 },
					      .ndim = d3[i][2] < 0 ? 2 : 3,
					      .dtype = test_dl_dtype(APE_F32), .shape = c->shp[i] };
		}
	}
	return 0;
}

static int lcase_run(void *p)
{
	struct lcase *c = p;
	struct rag *x = &c->x;
	int ret;

	if (!c->bwd) {
		memset(x->out, SWEEP_POISON, x->out_bytes);
		memset(x->lse, SWEEP_POISON, sizeof(float) * x->lse_len);
		ret = rag_run(c->dev, x, NULL);
	} else {
		memset(c->g, SWEEP_POISON, sizeof(float) * c->ng);
		ret = ape_attention_backward_varlen_dlpack(c->dev, &x->desc, &x->vl, &x->t[0],
							   &x->t[1], &x->t[2], &x->t[3], &x->t[4],
							   &c->t[0], &c->t[1], &c->t[2], &c->t[3],
							   &c->t[4], &c->t[5], NULL);
	}
	snprintf(c->msg, sizeof(c->msg), "%s", ret ? ape_last_error() : "");
	return ret;
}

static const char *lcase_verify(const void *p, int ret)
{
	const struct lcase *c = p;
	const struct rag *x = &c->x;
	const size_t nlse = sizeof(float) * x->lse_len;
	const char *bad;

	if (memcmp(x->in, c->in0, x->in_bytes) ||
	    memcmp(x->posq, c->posq0, sizeof(int64_t) * (size_t)x->tq) ||
	    memcmp(x->posk, c->posk0, sizeof(int64_t) * (size_t)x->tk) ||
	    memcmp(c->bin, c->bin + c->nbin, sizeof(float) * c->nbin))
		return "an input changed";
	if (c->bwd) {
		if (memcmp(x->out, c->o0, x->out_bytes) || memcmp(x->lse, c->lse0, nlse))
			return "the backward changed O or LSE";
		return sweep_outputs_verify(c->g, c->clean_g, sizeof(float) * c->ng, ret);
	}
	if ((bad = sweep_outputs_verify(x->out, c->clean_out, x->out_bytes, ret)))
		return bad;
	return sweep_outputs_verify(x->lse, c->clean_lse, nlse, ret);
}

/* Sets up c (c->dev, c->bwd kept) and runs the forward, then the backward, cleanly. */
static int lcase_prepare(void *p)
{
	struct lcase *c = p;
	struct rag *x = &c->x;
	ape_device *dev = c->dev;
	const bool bwd = c->bwd;
	int ret;

	lcase_free(c);
	memset(c, 0, sizeof(*c));
	c->dev = dev;
	if ((ret = lcase_make(c)) || (ret = lcase_run(c)))
		return ret;
	c->clean_out = dup_bytes(x->out, x->out_bytes);
	c->clean_lse = dup_bytes(x->lse, sizeof(float) * x->lse_len);
	if (!c->clean_out || !c->clean_lse)
		return APE_ENOMEM;
	if (!bwd)
		return 0;
	c->bwd = true;
	c->o0 = dup_bytes(x->out, x->out_bytes);
	c->lse0 = dup_bytes(x->lse, sizeof(float) * x->lse_len);
	if (!c->o0 || !c->lse0)
		return APE_ENOMEM;
	if ((ret = lcase_run(c)))
		return ret;
	c->clean_g = dup_bytes(c->g, sizeof(float) * c->ng);
	return c->clean_g ? 0 : APE_ENOMEM;
}

/* ---------------------------------------------------------------- the sweeps */

enum pmode { P_FORWARD, P_FORWARD_RUNS, P_BACKWARD, P_DLPACK, P_DLPACK_BWD, P_MODES };

static const char *const what[P_MODES] = {
	"forward at positions, one run", "forward at positions, per element",
	"backward at positions, per element",
	"varlen_dlpack forward", "varlen_dlpack backward",
};

/* What a failed run's message names. */
static const char *const names[P_MODES] = {
	"ape_attention_forward",		"ape_attention_forward",
	"ape_attention_backward",		"ape_attention_forward_varlen_dlpack",
	"ape_attention_backward_varlen_dlpack",
};

static void sweep_all(struct __test_metadata *_metadata, ape_device *dev,
		      void (*sweep)(struct __test_metadata *, const struct sweep *))
{
	for (int m = 0; m < P_MODES; m++) {
		const bool dl = m >= P_DLPACK, bwd = m == P_BACKWARD || m == P_DLPACK_BWD;
		struct pcase *dc = dl ? NULL : calloc(1, sizeof(*dc));
		struct lcase *lc = dl ? calloc(1, sizeof(*lc)) : NULL;
		struct sweep s = {
			.dev = dev, .what = what[m],
			.wrap_flags = m == P_FORWARD_RUNS ? WRAP_NO_POSITIONS : 0,
			.prepare = dl ? lcase_prepare : pcase_prepare,
			.run = dl ? lcase_run : pcase_run,
			.verify = dl ? lcase_verify : pcase_verify,
		};

		ASSERT_TRUE(dc || lc);
		if (dl) {
			*lc = (struct lcase){ .dev = dev, .bwd = bwd };
			s.c = lc;
			s.msg = lc->msg;
		} else {
			*dc = (struct pcase){ .dev = dev, .bwd = bwd };
			s.c = dc;
			s.msg = dc->msg;
		}
		s.alloc_word = s.device_word = names[m];
		sweep(_metadata, &s);
		if (lc)
			lcase_free(lc);
		free(lc);
		free(dc);
	}
	fflush(stdout);
}

TEST_F(pf, allocation_failures)
{
#ifndef APE_FAULT_INJECT
	SKIP(return, "libape built without -DAPE_FAULT_INJECT: run `make faults-ci`");
#endif
	sweep_all(_metadata, self->dev[0], alloc_sweep);
}

TEST_F(pf, device_failures)
{
	sweep_all(_metadata, self->dev[0], device_sweep);
}

TEST_HARNESS_MAIN
