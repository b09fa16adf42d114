/* SPDX-License-Identifier: MIT */
/*
 * The threading contract (README 'Threads', include/ape/ape.h): 8 threads share one context and
 * one device (reference, OpenCL) and run forward calls at once, one-shot and streamed, each
 * result equal bit for bit to the serial run; 8 threads create contexts, compute and destroy
 * them at once; 4 threads run two-device calls on one shared context at once (within the
 * tolerance, since which device computes which chunk varies); 8 threads run backward calls on
 * one shared device at once, one-shot and streamed, each equal bit for bit to the serial run;
 * 8 threads run ragged batches (ape_attention_forward_varlen_ex()) on one shared device at
 * once, in one launch and in chunks, each equal bit for bit to the serial run, and so do 8
 * threads of their backward (ape_attention_backward_varlen()); 8 threads each
 * drive a KV pool of their own on one shared device at once (tests/faults/kvpool_case.h:
 * create, appends, a fork, a batch append with a copy on write, a ragged attend, a decode, a
 * removal, destroy), each attend equal bit for bit to the thread's serial run; 8 threads each
 * drive a paged-attention object of their own over their own pages on one shared device at
 * once (tests/faults/kvpaged_case.h: create, a CSR plan, runs over two layers of pages in two
 * layouts, a block-table plan of decode rows, its run, destroy), each run equal bit for bit to
 * the thread's serial session.
 * `make tsan-ci` runs this under ThreadSanitizer, where any data race fails it.
 */
#include "ape_test.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#include "common/bwdcase.h"
#include "faults/faultcheck.h"
#include "faults/fixture.h"
#include "faults/kvpaged_case.h"
#include "faults/kvpool_case.h"

enum { NT = 8, ROUNDS = 3 };

struct bjob;
struct vjob;

struct job {
	fx_call *c; /* a call prepared (and run once, serially) by the main thread */
	struct bjob *b; /* backward test: its call, prepared likewise */
	struct vjob *v; /* ragged-batch test: its batch, prepared likewise */
	struct pcase *p; /* KV-pool test: its session, prepared likewise */
	struct kcase *k; /* paged-attention test: its session, prepared likewise */
	const char *backend; /* contexts test: the backend to compute on */
	const fx_call *want; /* contexts test: the serial result */
	char err[512]; /* empty when everything matched */
};

static void *run_calls(void *arg)
{
	struct job *j = arg;

	for (int r = 0; r < ROUNDS && !j->err[0]; r++) {
		int ret = fx_call_run(j->c);
		const char *bad = fx_call_verify(j->c, ret);

		if (ret || bad)
			snprintf(j->err, sizeof(j->err), "round %d: %.100s %.380s", r,
				 bad ? bad : "", j->c->msg);
	}
	return NULL;
}

/* Joins the threads and reports what any of them found. */
static void run_threads(struct __test_metadata *_metadata, struct job *jobs, int n,
			void *(*fn)(void *))
{
	pthread_t t[NT];

	for (int i = 0; i < n; i++)
		ASSERT_EQ(0, pthread_create(&t[i], NULL, fn, &jobs[i]));
	for (int i = 0; i < n; i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < n; i++) {
		EXPECT_EQ(0, jobs[i].err[0]) TH_LOG("thread %d: %s", i, jobs[i].err);
	}
}

FX_FIXTURE(th)

/* One context, one device, 8 threads; half one-shot, half streamed (3 x 3 chunks). */
TEST_F_TIMEOUT(th, shared_device, 300)
{
	fx_call c[NT];
	struct job j[NT];

	for (int i = 0; i < NT; i++) {
		ASSERT_EQ(0, fx_call_init(&c[i], self->dev, 1, false, 96, i % 2 ? 32 : 0))
			TH_LOG("%s", c[i].msg);
		j[i] = (struct job){ .c = &c[i] };
	}
	run_threads(_metadata, j, NT, run_calls);
	for (int i = 0; i < NT; i++)
		fx_call_free(&c[i]);
}

/* One context, two devices per call, 4 threads at once. */
TEST_F_TIMEOUT(th, two_devices, 300)
{
	fx_call c[NT / 2];
	struct job j[NT / 2];

	for (int i = 0; i < NT / 2; i++) {
		ASSERT_EQ(0, fx_call_init(&c[i], self->dev, 2, false, 96, 32))
			TH_LOG("%s", c[i].msg);
		j[i] = (struct job){ .c = &c[i] };
	}
	run_threads(_metadata, j, NT / 2, run_calls);
	for (int i = 0; i < NT / 2; i++)
		fx_call_free(&c[i]);
}

/* Each thread: a context of its own, a call whose result must be the serial one, destroy. */
static void *own_contexts(void *arg)
{
	struct job *j = arg;

	for (int r = 0; r < 2 && !j->err[0]; r++) {
		ape_context *ctx = test_context("ref,opencl");
		ape_device *dev = ctx ? test_device(ctx, j->backend) : NULL;
		fx_call c;
		int ret;

		if (!dev) {
			snprintf(j->err, sizeof(j->err), "no context or device: %s",
				 ape_last_error());
			ape_context_destroy(ctx);
			break;
		}
		ret = fx_call_clone(&c, j->want, dev);
		if (!ret)
			ret = fx_call_run(&c);
		if (ret || fx_call_verify(&c, ret))
			snprintf(j->err, sizeof(j->err), "not the serial result: %.100s %.380s",
				 ret ? "" : fx_call_verify(&c, ret), c.msg);
		fx_call_free(&c);
		ape_context_destroy(ctx);
	}
	return NULL;
}

TEST_F_TIMEOUT(th, contexts_created_at_once, 300)
{
	struct job j[NT];
	fx_call serial;

	ASSERT_EQ(0, fx_call_init(&serial, self->dev, 1, false, 96, 32)) TH_LOG("%s", serial.msg);
	for (int i = 0; i < NT; i++)
		j[i] = (struct job){ .backend = variant->backend, .want = &serial };
	run_threads(_metadata, j, NT, own_contexts);
	fx_call_free(&serial);
}

/* One backward call of its own, prepared and run once serially by the main thread. */
struct bjob {
	bcase c;
	grads g, serial;
	ape_device *dev;
	int64_t chunk; /* rows per chunk both ways; 0: one launch */
};

/* The call into g, its outputs poisoned first (so that a round that writes nothing shows). */
static int bjob_run(struct bjob *b)
{
	test_tensor_poison(&b->g.dq.t);
	test_tensor_poison(&b->g.dk.t);
	test_tensor_poison(&b->g.dv.t);
	for (int64_t i = 0; i < 4 * b->g.H; i++)
		b->g.dparams[i] = NAN;
	return run_chunked(&b->c, b->dev, &b->g, b->chunk, b->chunk, NULL);
}

static void *run_backward_calls(void *arg)
{
	struct job *j = arg;

	for (int r = 0; r < ROUNDS && !j->err[0]; r++) {
		int ret = bjob_run(j->b);

		if (ret)
			snprintf(j->err, sizeof(j->err), "round %d: %.400s", r, ape_last_error());
		else if (!same_grads(&j->b->g, &j->b->serial, W_ALL))
			snprintf(j->err, sizeof(j->err), "round %d: not the serial result", r);
	}
	return NULL;
}

/* One context, one device, 8 threads of backward calls; half one-shot, half streamed (chunks
 * of 16 rows both ways: 3 x 3 launches). */
TEST_F_TIMEOUT(th, shared_device_backward, 300)
{
	const test_problem_shape sh = { 1, 4, 2, 40, 48, 16 };
	static struct bjob b[NT];
	struct job j[NT];
	ape_rng rng;

	ape_rng_init(&rng, "shared_device_backward");
	for (int i = 0; i < NT; i++) {
		memset(&b[i], 0, sizeof(b[i]));
		b[i].dev = self->dev[0];
		b[i].chunk = i % 2 ? 16 : 0;
		ASSERT_EQ(0, bcase_ready(&b[i].c, &rng, &sh, APE_F32, false, i % 4 < 2,
					 self->dev[0]))
			TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&b[i].g, &b[i].c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&b[i].serial, &b[i].c, APE_F32));
		ASSERT_EQ(0, bjob_run(&b[i])) TH_LOG("%s", ape_last_error());
		memcpy(b[i].serial.dq.alloc, b[i].g.dq.alloc, b[i].g.dq.alloc_bytes);
		memcpy(b[i].serial.dk.alloc, b[i].g.dk.alloc, b[i].g.dk.alloc_bytes);
		memcpy(b[i].serial.dv.alloc, b[i].g.dv.alloc, b[i].g.dv.alloc_bytes);
		memcpy(b[i].serial.dparams, b[i].g.dparams, sizeof(float) * (size_t)(4 * sh.H));
		j[i] = (struct job){ .b = &b[i] };
	}
	run_threads(_metadata, j, NT, run_backward_calls);
	for (int i = 0; i < NT; i++) {
		bcase_free(&b[i].c);
		grads_free(&b[i].g);
		grads_free(&b[i].serial);
	}
}

/* A ragged batch of its own per thread: S sequences of random lengths (empty ones too), packed,
 * at default positions (one ragged run of the executor), its serial result kept. */
struct vjob {
	ape_device *dev;
	ape_exec_options opts; /* chunk_q, chunk_k: 0 (one launch) or a few rows */
	int64_t cu[9], tq;
	float q[160 * 4 * 16], k[160 * 2 * 16], v[160 * 2 * 16], o[160 * 4 * 16], lse[160 * 4];
	float so[160 * 4 * 16], slse[160 * 4];
	/* the backward (vjob_backward()): dO, then dQ, dK, dV, dparams, and their serial run's */
	float dout[160 * 4 * 16], g[160 * 4 * 16 + 2 * 160 * 2 * 16 + 16];
	float sg[160 * 4 * 16 + 2 * 160 * 2 * 16 + 16];
	ape_attn_desc desc;
	ape_varlen vl;
};

enum { VS = 8, VH = 4, VHKV = 2, VD = 16 };

static int vjob_run(struct vjob *j)
{
	ape_tensor q, k, v, o;

	memset(j->o, 0xff, sizeof(j->o)); /* NaN: a round that writes nothing shows */
	ape_tensor_init_packed(&q, j->q, APE_F32, j->tq, VH, VD);
	ape_tensor_init_packed(&k, j->k, APE_F32, j->tq, VHKV, VD);
	ape_tensor_init_packed(&v, j->v, APE_F32, j->tq, VHKV, VD);
	ape_tensor_init_packed(&o, j->o, APE_F32, j->tq, VH, VD);
	return ape_attention_forward_varlen_ex(&j->dev, 1, &j->opts, &j->desc, &j->vl, &q, &k, &v,
					       &o, j->lse, NULL);
}

/* The batch's gradients from its forward's o and lse (every gradient, into g; NaN first). */
static int vjob_backward(struct vjob *j)
{
	float *dq = j->g, *dk = dq + 160 * 4 * 16, *dv = dk + 160 * 2 * 16, *dp = dv + 160 * 2 * 16;
	ape_tensor q, k, v, o, dout, tq, tk, tv;

	memset(j->g, 0xff, sizeof(j->g));
	ape_tensor_init_packed(&q, j->q, APE_F32, j->tq, VH, VD);
	ape_tensor_init_packed(&k, j->k, APE_F32, j->tq, VHKV, VD);
	ape_tensor_init_packed(&v, j->v, APE_F32, j->tq, VHKV, VD);
	ape_tensor_init_packed(&o, j->so, APE_F32, j->tq, VH, VD);
	ape_tensor_init_packed(&dout, j->dout, APE_F32, j->tq, VH, VD);
	ape_tensor_init_packed(&tq, dq, APE_F32, j->tq, VH, VD);
	ape_tensor_init_packed(&tk, dk, APE_F32, j->tq, VHKV, VD);
	ape_tensor_init_packed(&tv, dv, APE_F32, j->tq, VHKV, VD);
	return ape_attention_backward_varlen(&j->dev, 1, &j->opts, &j->desc, &j->vl, &q, &k, &v,
					     &o, j->slse, &dout, NULL, &tq, &tk, &tv, dp, NULL);
}

static void vjob_init(struct vjob *j, ape_device *dev, ape_rng *rng, int64_t chunk)
{
	memset(j, 0, sizeof(*j));
	j->dev = dev;
	ape_exec_options_init(&j->opts);
	j->opts.chunk_q = j->opts.chunk_k = chunk;
	for (int s = 0; s < VS; s++)
		j->cu[s + 1] = j->cu[s] + ape_rng_range(rng, 0, 20);
	j->tq = j->cu[VS] ? j->cu[VS] : 1;
	if (!j->cu[VS])
		j->cu[VS] = 1;
	for (size_t i = 0; i < sizeof(j->q) / sizeof(float); i++)
		j->q[i] = (float)ape_rng_normal(rng);
	for (size_t i = 0; i < sizeof(j->k) / sizeof(float); i++) {
		j->k[i] = (float)ape_rng_normal(rng);
		j->v[i] = (float)ape_rng_normal(rng);
	}
	for (size_t i = 0; i < sizeof(j->dout) / sizeof(float); i++)
		j->dout[i] = (float)ape_rng_normal(rng);
	ape_attn_desc_init(&j->desc);
	j->desc.delta.value = 0.2f;
	j->desc.lambda.value = 0.1f;
	ape_varlen_init(&j->vl);
	j->vl.num_seqs = VS;
	j->vl.cu_seqlens_q = j->vl.cu_seqlens_k = j->cu;
}

static void *run_varlen_calls(void *arg)
{
	struct job *j = arg;
	struct vjob *v = j->v;

	for (int r = 0; r < ROUNDS && !j->err[0]; r++) {
		int ret = vjob_run(v);

		if (ret)
			snprintf(j->err, sizeof(j->err), "round %d: %.400s", r, ape_last_error());
		else if (memcmp(v->o, v->so, sizeof(v->o)) || memcmp(v->lse, v->slse, sizeof(v->lse)))
			snprintf(j->err, sizeof(j->err), "round %d: not the serial result", r);
	}
	return NULL;
}

static void *run_varlen_backward(void *arg)
{
	struct job *j = arg;
	struct vjob *v = j->v;

	for (int r = 0; r < ROUNDS && !j->err[0]; r++) {
		int ret = vjob_backward(v);

		if (ret)
			snprintf(j->err, sizeof(j->err), "round %d: %.400s", r, ape_last_error());
		else if (memcmp(v->g, v->sg, sizeof(v->g)))
			snprintf(j->err, sizeof(j->err), "round %d: not the serial gradients", r);
	}
	return NULL;
}

/*
 * One context, one device, 8 threads of ragged batches; half in one launch, half in chunks of
 * 7 x 11 rows (segments cut to every launch), each equal bit for bit to its serial run: of the
 * forward, or (bwd) of the backward (one run of ragged backward launches where the device takes
 * them) from the serial forward's O and LSE.
 */
static void varlen_threads(struct __test_metadata *_metadata, ape_device *dev, bool bwd)
{
	static struct vjob v[NT];
	struct job j[NT];
	ape_rng rng;

	ape_rng_init(&rng, bwd ? "shared_device_varlen_backward" : "shared_device_varlen");
	for (int i = 0; i < NT; i++) {
		vjob_init(&v[i], dev, &rng, i % 2 ? 7 : 0);
		if (i % 2)
			v[i].opts.chunk_k = 11;
		ASSERT_EQ(0, vjob_run(&v[i])) TH_LOG("%s", ape_last_error());
		memcpy(v[i].so, v[i].o, sizeof(v[i].o));
		memcpy(v[i].slse, v[i].lse, sizeof(v[i].lse));
		if (bwd) {
			ASSERT_EQ(0, vjob_backward(&v[i])) TH_LOG("%s", ape_last_error());
			memcpy(v[i].sg, v[i].g, sizeof(v[i].g));
		}
		j[i] = (struct job){ .v = &v[i] };
	}
	run_threads(_metadata, j, NT, bwd ? run_varlen_backward : run_varlen_calls);
}

TEST_F_TIMEOUT(th, shared_device_varlen, 300)
{
	varlen_threads(_metadata, self->dev[0], false);
}

TEST_F_TIMEOUT(th, shared_device_varlen_backward, 300)
{
	varlen_threads(_metadata, self->dev[0], true);
}

static void *run_pool_sessions(void *arg)
{
	struct job *j = arg;

	for (int r = 0; r < ROUNDS && !j->err[0]; r++) {
		int ret = pcase_run(j->p);
		const char *bad = pcase_verify(j->p, ret);

		if (ret || bad)
			snprintf(j->err, sizeof(j->err), "round %d: %.100s %.380s", r,
				 bad ? bad : "", j->p->msg);
	}
	return NULL;
}

/* One context, one device, 8 threads each driving a KV pool of its own (half float32, half
 * float16, each with its own data), prepared and run once serially by the main thread; every
 * round's attends equal that run's bit for bit. */
TEST_F_TIMEOUT(th, shared_device_kvpool, 300)
{
	static struct pcase p[NT];
	struct job j[NT];
	char name[64];

	for (int i = 0; i < NT; i++) {
		memset(&p[i], 0, sizeof(p[i]));
		p[i].dev = self->dev[0];
		p[i].dt = i % 2 ? APE_F16 : APE_F32;
		snprintf(name, sizeof(name), "shared_device_kvpool %d", i);
		ape_rng_init(&p[i].rng, name);
		ASSERT_EQ(0, pcase_prepare(&p[i], false)) TH_LOG("%s %s", p[i].msg, p[i].bad);
		j[i] = (struct job){ .p = &p[i] };
	}
	run_threads(_metadata, j, NT, run_pool_sessions);
}

static void *run_paged_sessions(void *arg)
{
	struct job *j = arg;

	for (int r = 0; r < ROUNDS && !j->err[0]; r++) {
		int ret = kcase_run(j->k);
		const char *bad = kcase_verify(j->k, ret);

		if (ret || bad)
			snprintf(j->err, sizeof(j->err), "round %d: %.100s %.380s", r,
				 bad ? bad : "", j->k->msg);
	}
	return NULL;
}

/* One context, one device, 8 threads each driving a paged-attention object of its own over its
 * own pages (half float32, half float16, each with its own data), prepared and run once
 * serially by the main thread; every round's runs equal that session's bit for bit. */
TEST_F_TIMEOUT(th, shared_device_kvpaged, 300)
{
	static struct kcase k[NT];
	struct job j[NT];
	char name[64];

	for (int i = 0; i < NT; i++) {
		memset(&k[i], 0, sizeof(k[i]));
		k[i].dev = self->dev[0];
		k[i].dt = i % 2 ? APE_F16 : APE_F32;
		snprintf(name, sizeof(name), "shared_device_kvpaged %d", i);
		ape_rng_init(&k[i].rng, name);
		ASSERT_EQ(0, kcase_prepare(&k[i], false)) TH_LOG("%s %s", k[i].msg, k[i].bad);
		j[i] = (struct job){ .k = &k[i] };
	}
	run_threads(_metadata, j, NT, run_paged_sessions);
	for (int i = 0; i < NT; i++)
		kcase_free(&k[i]);
}

TEST_HARNESS_MAIN
