/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL interop tests' shared pieces (test_opencl_interop.c, test_opencl_interop_queues.c):
 * the OpenCL device with its cl_context and cl_device_id, the reference counts of the test's own
 * objects, the launch cases with their host data, one contiguous run through the backend's ops,
 * and the skip without a device (OPENCL_INTEROP_MAIN). Include after the Kselftest harness.
 */
#ifndef APE_TEST_OPENCL_INTEROP_H
#define APE_TEST_OPENCL_INTEROP_H

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/problem.h"

#ifdef APE_HAVE_OPENCL
#include <CL/cl.h>

#include "../opencl/ocl_debug.h"
#include "core/backend.h"
#include "core/half.h"
#include "exec/launch.h"

/* ---- the device */

struct dev {
	ape_context *ctx;
	ape_device *d;
	const struct ape_backend_plugin *ops;
	cl_context cctx;
	cl_device_id cdev;
	bool cpu;
};

static int dev_open(struct __test_metadata *_metadata, struct dev *t)
{
	ape_device_info info;

	memset(t, 0, sizeof(*t));
	t->ctx = test_context("opencl");
	if (!t->ctx)
		return -1;
	t->d = test_device(t->ctx, "opencl");
	if (!t->d) {
		TH_LOG("no OpenCL device");
		return -1;
	}
	t->ops = t->d->be->ops;
	if (!t->ops->native || !t->ops->buf_wrap || !t->ops->queue_wrap) {
		TH_LOG("the OpenCL backend lacks native, buf_wrap or queue_wrap");
		return -1;
	}
	t->ops->native(t->d, (void **)&t->cctx, (void **)&t->cdev);
	if (!t->cctx || !t->cdev) {
		TH_LOG("native gave no cl_context or cl_device_id");
		return -1;
	}
	if (ape_device_get_info(t->d, &info))
		return -1;
	t->cpu = info.kind == APE_DEVICE_CPU;
	return 0;
}

static void dev_close(struct dev *t)
{
	ape_context_destroy(t->ctx);
}

/*
 * The reference count of one of the test's own objects (a cl_mem, a cl_command_queue or a
 * cl_context, as `kind` says) once libape let go: the driver may drop the holds of completed
 * commands a little later (PoCL frees an event, and its hold on its queue and buffers, on a
 * thread of its own), so the count is read until it reaches `want`, for 2 s.
 */
enum obj_kind { OBJ_MEM, OBJ_QUEUE, OBJ_CONTEXT };

static cl_uint refs_when(enum obj_kind kind, void *obj, cl_uint want)
{
	cl_uint refs = 0;

	for (int i = 0; i < 2000; i++) {
		if (kind == OBJ_MEM)
			clGetMemObjectInfo(obj, CL_MEM_REFERENCE_COUNT, sizeof(refs), &refs, NULL);
		else if (kind == OBJ_QUEUE)
			clGetCommandQueueInfo(obj, CL_QUEUE_REFERENCE_COUNT, sizeof(refs), &refs,
					      NULL);
		else
			clGetContextInfo(obj, CL_CONTEXT_REFERENCE_COUNT, sizeof(refs), &refs, NULL);
		if (refs == want)
			break;
		usleep(1000);
	}
	return refs;
}

/* ---- cases and their host data */

enum mem { MEM_ALLOC, MEM_HOST, MEM_CLMEM, MEM_N };

struct kase {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dt, odt;
	bool causal, inter, skip, packed;
	enum mem mem;
	int64_t off; /* element offset of the first input in its buffer (more for the others) */
};

static size_t esz(ape_dtype dt)
{
	return dt == APE_F32 ? 4 : 2;
}

static void put(void *base, int64_t i, ape_dtype dt, float x)
{
	if (dt == APE_F32) {
		memcpy((float *)base + i, &x, 4);
	} else {
		uint16_t h = dt == APE_F16 ? ape__f32_to_f16(x) : ape__f32_to_bf16(x);

		memcpy((uint16_t *)base + i, &h, 2);
	}
}

static float rnd(ape_rng *r, double sd)
{
	return (float)(sd * ape_rng_normal(r));
}

/* Per head: the seed's parameters (decays >= 0, so that skipping may run), varied by head. */
static void head_params(float *prm, int64_t H)
{
	for (int64_t h = 0; h < H; h++) {
		const double delta = pow(2.0, -4.0 / 3.0) * (1.0 + 0.1 * (double)h);

		prm[4 * h + 0] = (float)delta;
		prm[4 * h + 1] = (float)(delta / 10);
		prm[4 * h + 2] = (float)(delta / 10);
		prm[4 * h + 3] = 0.1f;
	}
}

/* The launch of c, contiguous, buffers not set. */
static void make_launch(struct ape_be_launch *l, const struct kase *c, const float *prm)
{
	struct ape__problem p;

	memset(&p, 0, sizeof(p));
	p.B = c->B;
	p.H = c->H;
	p.Hkv = c->Hkv;
	p.D = c->D;
	p.in_dtype = c->dt;
	p.out_dtype = c->odt;
	p.head_params = (float *)prm;
	p.decay_nonneg = true;
	p.scale = 1.0 / sqrt((double)c->D);
	p.rope_base = 10000;
	p.causal = c->causal;
	p.layout = c->inter ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
	ape__launch_init(l, &p, c->odt, c->skip ? ldexp(1.0, -24) : 0.0);
	l->Lq = c->Lq;
	l->Lk = c->Lk;
	l->q_start = c->Lk - c->Lq; /* end-aligned */
	l->k_start = 0;
}

/* Contiguous inputs of c (dtype bytes, [B, H(kv), L, D]). */
struct inputs {
	unsigned char *x[3];
	size_t n[3];
};

static int inputs_make(struct inputs *in, const struct kase *c, ape_rng *r)
{
	const int64_t rows[3] = { c->B * c->H * c->Lq, c->B * c->Hkv * c->Lk,
				  c->B * c->Hkv * c->Lk };

	for (int t = 0; t < 3; t++) {
		in->n[t] = (size_t)(rows[t] * c->D);
		in->x[t] = malloc(in->n[t] * esz(c->dt));
		if (!in->x[t])
			return -1;
		for (size_t i = 0; i < in->n[t]; i++)
			put(in->x[t], (int64_t)i, c->dt, rnd(r, 1.0));
	}
	return 0;
}

static void inputs_free(struct inputs *in)
{
	for (int t = 0; t < 3; t++)
		free(in->x[t]);
}

/* Runs c contiguous (buf_alloc, copies): O [B, H, Lq, D] of c->odt and LSE into o and lse. */
static int run_contiguous(struct __test_metadata *_metadata, const struct dev *t,
			  const struct kase *c, const struct inputs *in, const float *prm,
			  void *o, float *lse)
{
	const size_t no = (size_t)(c->B * c->H * c->Lq * c->D), nl = (size_t)(c->B * c->H * c->Lq);
	struct ape_be_buf *b[APE_BE_T_COUNT] = { 0 };
	struct ape_be_queue *q = NULL;
	struct ape_be_launch l;
	int ret;

	make_launch(&l, c, prm);
	ret = t->ops->queue_create(t->d, &q);
	for (int i = 0; i < 3 && !ret; i++) {
		ret = t->ops->buf_alloc(t->d, in->n[i] * esz(c->dt), &b[i]);
		if (!ret)
			ret = t->ops->copy_h2d(q, b[i], 0, in->x[i], in->n[i] * esz(c->dt));
	}
	if (!ret)
		ret = t->ops->buf_alloc(t->d, no * esz(c->odt), &b[APE_BE_T_O]);
	if (!ret)
		ret = t->ops->buf_alloc(t->d, nl * 4, &b[APE_BE_T_LSE]);
	if (!ret) {
		l.q = b[APE_BE_T_Q];
		l.k = b[APE_BE_T_K];
		l.v = b[APE_BE_T_V];
		l.o = b[APE_BE_T_O];
		l.lse = b[APE_BE_T_LSE];
		ret = t->ops->attention(q, &l);
	}
	if (!ret)
		ret = t->ops->copy_d2h(q, o, b[APE_BE_T_O], 0, no * esz(c->odt));
	if (!ret)
		ret = t->ops->copy_d2h(q, lse, b[APE_BE_T_LSE], 0, nl * 4);
	if (!ret)
		ret = t->ops->synchronize(q);
	if (ret)
		TH_LOG("contiguous run: %s", ape_last_error());
	t->ops->queue_destroy(q);
	for (int i = 0; i < APE_BE_T_COUNT; i++)
		t->ops->buf_free(t->d, b[i]);
	return ret;
}

/*
 * Skip (exit 4) with the reason when there is no OpenCL device. Asked in a child process: a
 * driver started in this one (PoCL's worker threads) would not survive the fork of each test.
 */
static void skip_without_device(void)
{
	int fd[2], status = 0;
	char why[300] = "";
	pid_t pid;

	if (pipe(fd))
		return;
	pid = fork();
	if (pid == 0) {
		ape_context *ctx = test_context("opencl");
		ape_backend_info bi;
		int n = ctx ? ape_backend_get_info(ctx, -1, NULL) : 0;

		snprintf(why, sizeof(why), "the OpenCL backend is not loaded");
		for (int i = 0; i < n; i++)
			if (!ape_backend_get_info(ctx, i, &bi) && !strcmp(bi.name, "opencl")) {
				if (bi.available)
					_exit(0);
				snprintf(why, sizeof(why), "no OpenCL device: %s", bi.reason);
			}
		if (write(fd[1], why, strlen(why)) < 0)
			_exit(2);
		_exit(4);
	}
	close(fd[1]);
	if (pid > 0 && read(fd[0], why, sizeof(why) - 1) < 0)
		why[0] = '\0';
	close(fd[0]);
	if (pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
	    WEXITSTATUS(status) == 4)
		ksft_exit_skip("%s\n", why);
}

/* The programs' main(): skips (exit 4) without an OpenCL device, or without the backend. */
#define OPENCL_INTEROP_MAIN                                                                        \
	int main(int argc, char **argv)                                                            \
	{                                                                                          \
		skip_without_device();                                                             \
		return test_harness_run(argc, argv);                                               \
	}
#else
#define OPENCL_INTEROP_MAIN                                                                        \
	int main(int argc, char **argv)                                                            \
	{                                                                                          \
		ksft_exit_skip("the OpenCL backend is not built into this libape\n");              \
		return test_harness_run(argc, argv);                                               \
	}
#endif

#endif
