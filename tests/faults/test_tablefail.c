/* SPDX-License-Identifier: MIT */
/*
 * Distance-bias tables under failure, on the reference and on an OpenCL CPU device
 * (tests/faults/fixture.h), by the sweeps of sweep.h: each host allocation of a clean run fails
 * in turn (a fault build), then each call of every device op, then the device is lost from each
 * point on. The calls: the forward with a per-head table (the suffix maxima the core builds,
 * the table the backend stages), in one launch and in key chunks of 3 (the executor's chunk
 * bound reads the maxima); the backward with the table and its gradient (desc->dbias_table,
 * staged in float64 per device and written on success only), in one launch and in chunks; the
 * ragged backward with the gradient (summed over its pieces). Every broken run returns the
 * injected code with a message naming the call, leaves the inputs (the table included)
 * byte-identical and the outputs (the gradient included) untouched, and the next run is clean,
 * bit for bit the clean result.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/testutil.h"
#include "faults/fixture.h"
#include "faults/sweep.h"

FX_FIXTURE(tf)

enum { B = 2, H = 2, HKV = 1, L = 7, D = 8, M = 5 };
enum { NQ = B * H * L * D, NK = B * HKV * L * D, NG = NQ + 2 * NK + 4 * H + H * M };

struct tins {
	float q[NQ], k[NK], v[NK], dout[NQ];
	float table[H * M];
};

struct touts {
	float o[NQ], lse[B * H * L]; /* the forward's outputs (the backward's inputs) */
	float g[NG]; /* dq, dk, dv, dparams, dbias_table */
};

enum tmode { T_FORWARD, T_FORWARD_CHUNKS, T_BACKWARD, T_BACKWARD_CHUNKS, T_VARLEN_BWD, T_MODES };

struct tcase {
	ape_device *dev;
	enum tmode m;
	struct tins in, in0; /* what the calls read, and a copy */
	struct touts out, clean;
	ape_attn_desc desc;
	char msg[1024];
};

static void tcase_init(struct tcase *c)
{
	ape_rng rng;

	memset(&c->in, 0, sizeof(c->in));
	ape_rng_init(&rng, "bias tables");
	for (int i = 0; i < NQ; i++) {
		c->in.q[i] = (float)ape_rng_normal(&rng);
		c->in.dout[i] = (float)ape_rng_normal(&rng);
	}
	for (int i = 0; i < NK; i++) {
		c->in.k[i] = (float)ape_rng_normal(&rng);
		c->in.v[i] = (float)ape_rng_normal(&rng);
	}
	for (int i = 0; i < H * M; i++) /* falls, then rises at the far end */
		c->in.table[i] = i % M == M - 1 ? 1.5f : -0.3f * (float)(i % M);
	c->in0 = c->in;
	ape_attn_desc_init(&c->desc);
	c->desc.causal = true;
	c->desc.delta.value = 0.3f;
	c->desc.beta.value = 0.1f;
	c->desc.lambda.value = 0.2f;
	c->desc.bias_table = c->in.table;
	c->desc.bias_table_len = M;
	c->desc.bias_table_heads = H;
}

/* The call, its outputs poisoned first; the backward reads the clean forward's O and LSE. */
static int tcase_run(void *p)
{
	struct tcase *c = p;
	struct touts *u = &c->out;
	ape_tensor q, k, v, o, dout, dq, dk, dv;
	ape_exec_options opts;
	int ret;

	ape_exec_options_init(&opts);
	opts.chunk_k = 3;
	opts.chunk_q = 4;
	opts.flags = APE_EXEC_ATOMIC_OUTPUTS; /* a streamed forward that fails writes nothing */
	ape_tensor_init(&q, c->in.q, APE_F32, B, H, L, D);
	ape_tensor_init(&k, c->in.k, APE_F32, B, HKV, L, D);
	ape_tensor_init(&v, c->in.v, APE_F32, B, HKV, L, D);
	ape_tensor_init(&o, u->o, APE_F32, B, H, L, D);
	if (c->m == T_FORWARD || c->m == T_FORWARD_CHUNKS) {
		memset(u, SWEEP_POISON, offsetof(struct touts, g));
		c->desc.dbias_table = NULL;
		ret = ape_attention_forward_ex(&c->dev, 1, c->m == T_FORWARD_CHUNKS ? &opts : NULL,
					       &c->desc, &q, &k, &v, &o, u->lse, NULL);
	} else if (c->m == T_VARLEN_BWD) {
		/* both batch elements as the two sequences of one packed batch: [1, H, 2L, D]
		 * over the same bytes is not the packed layout, so element 0 alone, one sequence */
		const int64_t cu[2] = { 0, L };
		ape_tensor pq, pk, pv, po, pdo, pdq, pdk, pdv;
		ape_varlen vl;
		float lse[L * H];

		memset(u->g, SWEEP_POISON, sizeof(u->g));
		ape_varlen_init(&vl);
		vl.num_seqs = 1;
		vl.cu_seqlens_q = cu;
		vl.cu_seqlens_k = cu;
		ape_tensor_init_packed(&pq, c->in.q, APE_F32, L, H, D);
		ape_tensor_init_packed(&pk, c->in.k, APE_F32, L, HKV, D);
		ape_tensor_init_packed(&pv, c->in.v, APE_F32, L, HKV, D);
		ape_tensor_init_packed(&po, u->o, APE_F32, L, H, D);
		ape_tensor_init_packed(&pdo, c->in.dout, APE_F32, L, H, D);
		ape_tensor_init_packed(&pdq, u->g, APE_F32, L, H, D);
		ape_tensor_init_packed(&pdk, u->g + NQ, APE_F32, L, HKV, D);
		ape_tensor_init_packed(&pdv, u->g + NQ + NK, APE_F32, L, HKV, D);
		for (int i = 0; i < L * H; i++) /* any finite LSE: the gradients are checked against
						 * the clean run's, not the math */
			lse[i] = u->lse[i] + 1.0f;
		c->desc.dbias_table = u->g + NQ + 2 * NK + 4 * H;
		ret = ape_attention_backward_varlen(&c->dev, 1, NULL, &c->desc, &vl, &pq, &pk, &pv,
						    &po, lse, &pdo, NULL, &pdq, &pdk, &pdv,
						    u->g + NQ + 2 * NK, NULL);
	} else {
		memset(u->g, SWEEP_POISON, sizeof(u->g));
		ape_tensor_init(&dout, c->in.dout, APE_F32, B, H, L, D);
		ape_tensor_init(&dq, u->g, APE_F32, B, H, L, D);
		ape_tensor_init(&dk, u->g + NQ, APE_F32, B, HKV, L, D);
		ape_tensor_init(&dv, u->g + NQ + NK, APE_F32, B, HKV, L, D);
		c->desc.dbias_table = u->g + NQ + 2 * NK + 4 * H;
		ret = ape_attention_backward_ex(&c->dev, 1, c->m == T_BACKWARD_CHUNKS ? &opts : NULL,
						&c->desc, &q, &k, &v, &o, u->lse, &dout, NULL, &dq,
						&dk, &dv, u->g + NQ + 2 * NK, NULL);
	}
	snprintf(c->msg, sizeof(c->msg), "%s", ret ? ape_last_error() : "");
	return ret;
}

static const char *tcase_verify(const void *p, int ret)
{
	const struct tcase *c = p;
	const size_t fwd = offsetof(struct touts, g);

	if (memcmp(&c->in, &c->in0, sizeof(c->in)))
		return "an input changed";
	if (c->m == T_FORWARD || c->m == T_FORWARD_CHUNKS)
		return sweep_outputs_verify(&c->out, &c->clean, fwd, ret);
	if (memcmp(&c->out, &c->clean, fwd))
		return "the backward changed O or LSE";
	return sweep_outputs_verify(c->out.g, c->clean.g, sizeof(c->out.g), ret);
}

/* Sets up c (c->dev, c->m kept) and runs the forward, then the backward, cleanly. */
static int tcase_prepare(void *p)
{
	struct tcase *c = p;
	const enum tmode m = c->m;
	int ret;

	tcase_init(c);
	c->m = T_FORWARD;
	if ((ret = tcase_run(c)))
		return ret;
	c->clean = c->out;
	c->m = m;
	if (m == T_FORWARD)
		return 0;
	if ((ret = tcase_run(c)))
		return ret;
	c->clean = c->out;
	return 0;
}

static const char *const what[T_MODES] = {
	"forward with a table", "forward with a table, key chunks",
	"backward with the table's gradient", "backward with the table's gradient, chunks",
	"ragged backward with the table's gradient",
};

static const char *const names[T_MODES] = {
	"ape_attention_forward", "ape_attention_forward", "ape_attention_backward",
	"ape_attention_backward", "ape_attention_backward_varlen",
};

static void sweep_all(struct __test_metadata *_metadata, ape_device *dev,
		      void (*sweep)(struct __test_metadata *, const struct sweep *))
{
	for (int m = 0; m < T_MODES; m++) {
		struct tcase *c = calloc(1, sizeof(*c));
		struct sweep s = {
			.dev = dev, .what = what[m], .prepare = tcase_prepare, .run = tcase_run,
			.verify = tcase_verify,
		};

		ASSERT_NE(NULL, c);
		*c = (struct tcase){ .dev = dev, .m = (enum tmode)m };
		s.c = c;
		s.msg = c->msg;
		s.alloc_word = s.device_word = names[m];
		sweep(_metadata, &s);
		free(c);
	}
	fflush(stdout);
}

TEST_F(tf, allocation_failures)
{
#ifndef APE_FAULT_INJECT
	SKIP(return, "libape built without -DAPE_FAULT_INJECT: run `make faults-ci`");
#endif
	sweep_all(_metadata, self->dev[0], alloc_sweep);
}

TEST_F(tf, device_failures)
{
	sweep_all(_metadata, self->dev[0], device_sweep);
}

TEST_HARNESS_MAIN
