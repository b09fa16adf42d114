/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend on the caller's memory and queues (issue 12; core/backend.h, ABI 5), through
 * the backend's ops: strided launches (a [B, L, H, D] layout, a packed QKV slice, element offsets,
 * GQA, f32/f16/bf16, both rope layouts, causal or not, with and without skipping) against
 * contiguous ones, bit for bit, writing nothing outside their views; buf_wrap of host memory
 * (computed in place) and of cl_mem objects the test makes itself; queue_wrap of the test's own
 * queues, whose order libape keeps; a context built on the test's own cl_context; and, through
 * the public API (ape_attention_enqueue() and ape_attention_backward_enqueue() on the test's
 * context, queue and cl_mem objects), the
 * same against the host call, bit for bit.
 *
 * The test links libOpenCL itself (the same ICD loader libape opens, so the objects are shared).
 * Without an OpenCL device the program skips (exit 4) with the reason.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/bwdcase.h"
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
	const struct ape__backend_ops *ops;
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
static const char *const mem_names[MEM_N] = { "buf_alloc", "buf_wrap host", "buf_wrap cl_mem" };

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
static void make_launch(struct ape__launch *l, const struct kase *c, const float *prm)
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

/* A host image of one device buffer: its bytes and, per element, whether a view covers it. */
struct image {
	unsigned char *alloc, *p; /* p = alloc + 4: a pointer that is not 8-byte aligned */
	size_t n, es; /* elements, element size */
	unsigned char *covered;
};

#define POISON_IN 0xff /* NaN in every type: an element read outside a view shows */
#define POISON_OUT 0xa5 /* what an output buffer holds where nothing may be written */

static int image_new(struct image *im, size_t n, size_t es, int fill)
{
	im->n = n;
	im->es = es;
	im->alloc = malloc(n * es + 64);
	im->covered = calloc(n, 1);
	if (!im->alloc || !im->covered)
		return -1;
	im->p = im->alloc + 4;
	memset(im->p, fill, n * es);
	return 0;
}

static void image_free(struct image *im)
{
	free(im->alloc);
	free(im->covered);
	memset(im, 0, sizeof(*im));
}

/* ---- running launches through the ops */

struct run {
	struct ape__buf *b[APE__T_COUNT]; /* q, k, v, o, lse; the same buffer may appear twice */
	cl_mem cm[APE__T_COUNT]; /* MEM_CLMEM: the test's own objects */
};

/* A buffer over image im (its whole size) in the way c->mem says, with im's bytes in it. */
static int buf_for(struct __test_metadata *_metadata, const struct dev *t,
		   struct ape__queue *q, enum mem mem, struct image *im, struct ape__buf **out,
		   cl_mem *cm)
{
	const size_t bytes = im->n * im->es;
	size_t got = 0;
	cl_int err;

	*out = NULL;
	*cm = NULL;
	if (mem == MEM_ALLOC) {
		if (t->ops->buf_alloc(t->d, bytes, out))
			return -1;
		return t->ops->copy_h2d(q, *out, 0, im->p, bytes);
	}
	if (mem == MEM_HOST) {
		if (t->ops->buf_wrap(t->d, APE__MEM_HOST, im->p, bytes, out, &got))
			return -1;
		EXPECT_EQ(bytes, got);
		return 0;
	}
	*cm = clCreateBuffer(t->cctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, bytes, im->p,
			     &err);
	if (!*cm) {
		TH_LOG("clCreateBuffer: %d", (int)err);
		return -1;
	}
	if (t->ops->buf_wrap(t->d, APE__MEM_OPENCL, *cm, 0, out, &got))
		return -1;
	EXPECT_EQ(bytes, got);
	return 0;
}

/* Brings an output image back to the host (MEM_HOST: it is there already, in place). */
static int image_back(const struct dev *t, struct ape__queue *q, enum mem mem, struct image *im,
		      struct ape__buf *b)
{
	if (mem == MEM_HOST)
		return 0;
	return t->ops->copy_d2h(q, im->p, b, 0, im->n * im->es);
}

/* The views of c: a [B, L, H, D] layout (rows padded by 3 elements) with offsets, or q, k and v
 * as slices of one packed [B, L, H + 2 Hkv, D] tensor; O as [B, L, H, D + 5] after an offset,
 * LSE as [B, L, H] after an offset. Element counts of the images in n[]. */
static void views_of(const struct kase *c, struct ape__view *v, size_t n[APE__T_COUNT])
{
	const int64_t D = c->D, H = c->H, Hkv = c->Hkv;

	if (c->packed) { /* Lq == Lk */
		const int64_t W = (H + 2 * Hkv) * D, L = c->Lq;

		v[APE__T_Q] = (struct ape__view){ c->off, L * W, D, W };
		v[APE__T_K] = (struct ape__view){ c->off + H * D, L * W, D, W };
		v[APE__T_V] = (struct ape__view){ c->off + (H + Hkv) * D, L * W, D, W };
		n[APE__T_Q] = (size_t)(c->off + c->B * L * W);
		n[APE__T_K] = n[APE__T_V] = 0; /* in q's buffer */
	} else {
		const int64_t R = D + 3;

		v[APE__T_Q] = (struct ape__view){ c->off, c->Lq * H * R, R, H * R };
		v[APE__T_K] = (struct ape__view){ c->off + 1, c->Lk * Hkv * R, R, Hkv * R };
		v[APE__T_V] = (struct ape__view){ c->off + 2, c->Lk * Hkv * R, R, Hkv * R };
		n[APE__T_Q] = (size_t)(c->off + c->B * c->Lq * H * R);
		n[APE__T_K] = (size_t)(c->off + 1 + c->B * c->Lk * Hkv * R);
		n[APE__T_V] = (size_t)(c->off + 2 + c->B * c->Lk * Hkv * R);
	}
	v[APE__T_O] = (struct ape__view){ 7, c->Lq * H * (D + 5), D + 5, H * (D + 5) };
	n[APE__T_O] = (size_t)(7 + c->B * c->Lq * H * (D + 5));
	v[APE__T_LSE] = (struct ape__view){ 3, c->Lq * H, 1, H };
	n[APE__T_LSE] = (size_t)(3 + c->B * c->Lq * H);
}

static int64_t at(const struct ape__view *v, int64_t b, int64_t h, int64_t l)
{
	return v->off + b * v->sb + h * v->sh + l * v->sl;
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
	struct ape__buf *b[APE__T_COUNT] = { 0 };
	struct ape__queue *q = NULL;
	struct ape__launch l;
	int ret;

	make_launch(&l, c, prm);
	ret = t->ops->queue_create(t->d, &q);
	for (int i = 0; i < 3 && !ret; i++) {
		ret = t->ops->buf_alloc(t->d, in->n[i] * esz(c->dt), &b[i]);
		if (!ret)
			ret = t->ops->copy_h2d(q, b[i], 0, in->x[i], in->n[i] * esz(c->dt));
	}
	if (!ret)
		ret = t->ops->buf_alloc(t->d, no * esz(c->odt), &b[APE__T_O]);
	if (!ret)
		ret = t->ops->buf_alloc(t->d, nl * 4, &b[APE__T_LSE]);
	if (!ret) {
		l.q = b[APE__T_Q];
		l.k = b[APE__T_K];
		l.v = b[APE__T_V];
		l.o = b[APE__T_O];
		l.lse = b[APE__T_LSE];
		ret = t->ops->attention(q, &l);
	}
	if (!ret)
		ret = t->ops->copy_d2h(q, o, b[APE__T_O], 0, no * esz(c->odt));
	if (!ret)
		ret = t->ops->copy_d2h(q, lse, b[APE__T_LSE], 0, nl * 4);
	if (!ret)
		ret = t->ops->synchronize(q);
	if (ret)
		TH_LOG("contiguous run: %s", ape_last_error());
	t->ops->queue_destroy(q);
	for (int i = 0; i < APE__T_COUNT; i++)
		t->ops->buf_free(t->d, b[i]);
	return ret;
}

/*
 * Runs c strided (views_of) in the memory c->mem says, and checks against the contiguous
 * results: O and LSE bit for bit, and nothing written outside their views. 0, or -1 after
 * logging.
 */
static int run_strided(struct __test_metadata *_metadata, const struct dev *t,
		       const struct kase *c, const struct inputs *in, const float *prm,
		       const void *o_ref, const float *lse_ref, const char *what)
{
	struct ape__view v[APE__T_COUNT];
	size_t n[APE__T_COUNT];
	struct image im[APE__T_COUNT];
	struct ape__buf *b[APE__T_COUNT] = { 0 };
	cl_mem cm[APE__T_COUNT] = { 0 };
	struct ape__queue *q = NULL;
	struct ape__launch l;
	const size_t ie = esz(c->dt), oe = esz(c->odt);
	int ret = 0, bad = 0;

	memset(im, 0, sizeof(im));
	views_of(c, v, n);
	make_launch(&l, c, prm);
	l.strided = true;
	memcpy(l.view, v, sizeof(v));
	/* the images: inputs scattered into their views, poison elsewhere */
	for (int i = 0; i < APE__T_COUNT && !ret; i++) {
		if (!n[i])
			continue;
		ret = image_new(&im[i], n[i], i == APE__T_LSE ? 4 : i == APE__T_O ? oe : ie,
				i >= APE__T_O ? POISON_OUT : POISON_IN);
	}
	ASSERT_EQ(0, ret);
	for (int i = 0; i < 3; i++) {
		struct image *dst = c->packed ? &im[APE__T_Q] : &im[i];
		const int64_t heads = i ? c->Hkv : c->H, rows = i ? c->Lk : c->Lq;

		for (int64_t bb = 0; bb < c->B; bb++)
			for (int64_t h = 0; h < heads; h++)
				for (int64_t r = 0; r < rows; r++) {
					const int64_t e = at(&v[i], bb, h, r);
					const size_t src = (size_t)(((bb * heads + h) * rows + r) * c->D);

					memcpy(dst->p + (size_t)e * ie, in->x[i] + src * ie,
					       (size_t)c->D * ie);
				}
	}
	for (int64_t bb = 0; bb < c->B; bb++)
		for (int64_t h = 0; h < c->H; h++)
			for (int64_t r = 0; r < c->Lq; r++) {
				memset(im[APE__T_O].covered + at(&v[APE__T_O], bb, h, r), 1,
				       (size_t)c->D);
				im[APE__T_LSE].covered[at(&v[APE__T_LSE], bb, h, r)] = 1;
			}

	ret = t->ops->queue_create(t->d, &q);
	for (int i = 0; i < APE__T_COUNT && !ret; i++)
		if (n[i])
			ret = buf_for(_metadata, t, q, c->mem, &im[i], &b[i], &cm[i]);
	if (!ret) {
		l.q = b[APE__T_Q];
		l.k = c->packed ? b[APE__T_Q] : b[APE__T_K];
		l.v = c->packed ? b[APE__T_Q] : b[APE__T_V];
		l.o = b[APE__T_O];
		l.lse = b[APE__T_LSE];
		ret = t->ops->attention(q, &l);
	}
	/* MEM_HOST: no read at all, the kernel wrote host memory in place */
	if (!ret)
		ret = image_back(t, q, c->mem, &im[APE__T_O], b[APE__T_O]);
	if (!ret)
		ret = image_back(t, q, c->mem, &im[APE__T_LSE], b[APE__T_LSE]);
	if (!ret)
		ret = t->ops->synchronize(q);
	if (ret)
		TH_LOG("%s: strided run: %s", what, ape_last_error());
	t->ops->queue_destroy(q);
	for (int i = 0; i < APE__T_COUNT; i++) {
		t->ops->buf_free(t->d, b[i]);
		if (cm[i]) { /* libape let go of it, and only of its own hold */
			EXPECT_EQ(1, refs_when(OBJ_MEM, cm[i], 1));
			clReleaseMemObject(cm[i]);
		}
	}
	for (int64_t bb = 0; !ret && bb < c->B; bb++)
		for (int64_t h = 0; h < c->H; h++)
			for (int64_t r = 0; r < c->Lq; r++) {
				const size_t ci = (size_t)((bb * c->H + h) * c->Lq + r);
				const int64_t eo = at(&v[APE__T_O], bb, h, r);
				const int64_t el = at(&v[APE__T_LSE], bb, h, r);

				if (memcmp(im[APE__T_O].p + (size_t)eo * oe,
					   (const unsigned char *)o_ref + ci * (size_t)c->D * oe,
					   (size_t)c->D * oe) ||
				    memcmp(im[APE__T_LSE].p + (size_t)el * 4, lse_ref + ci, 4)) {
					if (!bad++)
						TH_LOG("%s: b %lld h %lld row %lld differs from the "
						       "contiguous run",
						       what, (long long)bb, (long long)h,
						       (long long)r);
				}
			}
	for (int i = APE__T_O; !ret && i <= APE__T_LSE; i++)
		for (size_t e = 0; e < im[i].n; e++) {
			const unsigned char *p = im[i].p + e * im[i].es;
			bool poisoned = true;

			for (size_t k = 0; k < im[i].es; k++)
				poisoned &= p[k] == POISON_OUT;
			if (!im[i].covered[e] && !poisoned && !bad++)
				TH_LOG("%s: %s element %zu, outside the view, was written", what,
				       i == APE__T_O ? "O" : "LSE", e);
		}
	for (int i = 0; i < APE__T_COUNT; i++)
		image_free(&im[i]);
	return ret || bad ? -1 : 0;
}

static void kase_str(const struct kase *c, char *buf, size_t cap)
{
	snprintf(buf, cap,
		 "B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld %s->%s %s %s %s%s, off %lld, %s",
		 (long long)c->B, (long long)c->H, (long long)c->Hkv, (long long)c->Lq,
		 (long long)c->Lk, (long long)c->D, ape_dtype_name(c->dt), ape_dtype_name(c->odt),
		 c->causal ? "causal" : "non-causal", c->inter ? "interleaved" : "half",
		 c->packed ? "packed QKV" : "[B,L,H,D]", c->skip ? " skipping" : "",
		 (long long)c->off, mem_names[c->mem]);
}

/* One case: contiguous then strided, compared. */
static int check_case(struct __test_metadata *_metadata, const struct dev *t,
		      const struct kase *c, ape_rng *rng)
{
	const size_t no = (size_t)(c->B * c->H * c->Lq * c->D), nl = (size_t)(c->B * c->H * c->Lq);
	struct inputs in = { 0 };
	float *prm = malloc((size_t)(4 * c->H) * sizeof(float));
	void *o = malloc(no * esz(c->odt));
	float *lse = malloc(nl * sizeof(float));
	char what[256];
	int ret = -1;

	kase_str(c, what, sizeof(what));
	if (prm && o && lse && !inputs_make(&in, c, rng)) {
		head_params(prm, c->H);
		ret = run_contiguous(_metadata, t, c, &in, prm, o, lse);
		if (!ret)
			ret = run_strided(_metadata, t, c, &in, prm, o, lse, what);
	}
	inputs_free(&in);
	free(prm);
	free(o);
	free(lse);
	return ret;
}

/* ---- strided launches */

TEST(strided_views_match_contiguous_bit_for_bit)
{
	static const ape_dtype dts[] = { APE_F32, APE_F16, APE_BF16 };
	struct dev t;
	ape_rng rng;
	int failed = 0, cases = 0;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ape_rng_init(&rng, "strided_views_match_contiguous_bit_for_bit");
	for (int di = 0; di < 3; di++)
		for (int m = 0; m < 8; m++) {
			struct kase c = { 0 };
			const int64_t hkv[] = { 4, 2, 1 };

			c.dt = dts[di];
			c.odt = (m & 4) && c.dt != APE_F32 ? APE_F32 : c.dt;
			c.causal = m & 1;
			c.inter = (m >> 1) & 1;
			c.packed = (m >> 2) & 1;
			c.skip = (m + di) % 2 == 0;
			c.B = ape_rng_range(&rng, 1, 2);
			c.H = 4;
			c.Hkv = hkv[(m + di) % 3];
			c.D = (m + di) % 4 == 3 ? 24 : 64; /* the generic program and D = 64 */
			c.Lq = ape_rng_range(&rng, 1, 90);
			c.Lk = c.packed ? c.Lq : ape_rng_range(&rng, 1, 150);
			c.off = ape_rng_range(&rng, 0, 9);
			c.mem = (enum mem)((m + di) % MEM_N);
			if (c.mem == MEM_HOST && !t.cpu)
				c.mem = MEM_ALLOC;
			if (ape_test_slow() && (m + di) % 3) /* under valgrind: a third of them */
				continue;
			cases++;
			failed += check_case(_metadata, &t, &c, &rng) != 0;
		}
	TH_LOG("%d of %d strided cases bit-identical to the contiguous ones", cases - failed,
	       cases);
	EXPECT_EQ(0, failed);
	dev_close(&t);
}

/* Long enough for several key tiles and query tiles, with skipping: the pre-pass reads K and V
 * through the views too. */
TEST(strided_long_with_skipping)
{
	struct dev t;
	ape_rng rng;
	struct kase c = { .B = 1, .H = 3, .Hkv = 1, .Lq = 300, .Lk = 300, .D = 64,
			  .dt = APE_F32, .odt = APE_F32, .causal = true, .skip = true,
			  .packed = true, .off = 5, .mem = MEM_ALLOC };

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ape_rng_init(&rng, "strided_long_with_skipping");
	if (!ape_test_slow())
		c.Lq = c.Lk = 700;
	EXPECT_EQ(0, check_case(_metadata, &t, &c, &rng));
	c.dt = c.odt = APE_F16;
	c.packed = false;
	c.Lq = ape_test_slow() ? 100 : 333;
	c.causal = false;
	EXPECT_EQ(0, check_case(_metadata, &t, &c, &rng));
	dev_close(&t);
}

/* ---- buf_wrap */

TEST(wrap_host_memory_computes_in_place)
{
	struct dev t;
	ape_rng rng;
	struct kase c = { .B = 2, .H = 2, .Hkv = 1, .Lq = 50, .Lk = 50, .D = 64, .dt = APE_F32,
			  .odt = APE_F32, .causal = true, .inter = true, .packed = true,
			  .off = 1, .mem = MEM_HOST };

	ASSERT_EQ(0, dev_open(_metadata, &t));
	if (!t.cpu) {
		static float x[16];
		struct ape__buf *b = (struct ape__buf *)&x;
		size_t got = 1;

		EXPECT_EQ(APE_ENOTSUP, t.ops->buf_wrap(t.d, APE__MEM_HOST, x, sizeof(x), &b, &got));
		EXPECT_EQ(NULL, b);
		EXPECT_EQ(0, got);
		dev_close(&t);
		SKIP(return, "not a CPU device: host memory is refused, as checked");
	}
	ape_rng_init(&rng, "wrap_host_memory_computes_in_place");
	/* run_strided reads O and LSE straight from host memory: no map, no read */
	EXPECT_EQ(0, check_case(_metadata, &t, &c, &rng));
	dev_close(&t);
}

TEST(wrap_errors)
{
	struct dev t;
	struct ape__buf *b;
	size_t got;
	cl_context other;
	cl_mem mine, theirs;
	cl_int err;
	static float x[16];

	ASSERT_EQ(0, dev_open(_metadata, &t));
	mine = clCreateBuffer(t.cctx, CL_MEM_READ_WRITE, 4096, NULL, &err);
	ASSERT_NE(NULL, mine);
	/* the whole object, or a part of it from its start; not more */
	ASSERT_EQ(0, t.ops->buf_wrap(t.d, APE__MEM_OPENCL, mine, 0, &b, &got));
	EXPECT_EQ(4096, got);
	t.ops->buf_free(t.d, b);
	ASSERT_EQ(0, t.ops->buf_wrap(t.d, APE__MEM_OPENCL, mine, 1000, &b, &got));
	EXPECT_EQ(1000, got);
	t.ops->buf_free(t.d, b);
	b = (struct ape__buf *)x;
	got = 1;
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE__MEM_OPENCL, mine, 4097, &b, &got));
	EXPECT_EQ(NULL, b);
	EXPECT_EQ(0, got);
	EXPECT_NE(NULL, strstr(ape_last_error(), "4097")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE__MEM_OPENCL, NULL, 0, &b, &got));
	/* CUDA memory on an OpenCL device */
	EXPECT_EQ(APE_ENOTSUP, t.ops->buf_wrap(t.d, APE__MEM_CUDA, (void *)(uintptr_t)4096, 64,
					       &b, &got));
	EXPECT_NE(NULL, strstr(ape_last_error(), "CUDA")) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "opencl:")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(NULL, b);
	/* a cl_mem of another context: refused, naming both contexts */
	other = clCreateContext(NULL, 1, &t.cdev, NULL, NULL, &err);
	ASSERT_NE(NULL, other);
	theirs = clCreateBuffer(other, CL_MEM_READ_WRITE, 4096, NULL, &err);
	ASSERT_NE(NULL, theirs);
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE__MEM_OPENCL, theirs, 0, &b, &got));
	EXPECT_EQ(NULL, b);
	{
		char a[64], c[64];

		snprintf(a, sizeof(a), "%p", (void *)other);
		snprintf(c, sizeof(c), "%p", (void *)t.cctx);
		EXPECT_NE(NULL, strstr(ape_last_error(), a)) TH_LOG("%s", ape_last_error());
		EXPECT_NE(NULL, strstr(ape_last_error(), c)) TH_LOG("%s", ape_last_error());
		EXPECT_NE(NULL, strstr(ape_last_error(), "buf_wrap")) TH_LOG("%s",
									    ape_last_error());
	}
	clReleaseMemObject(theirs);
	clReleaseMemObject(mine);
	clReleaseContext(other);
	dev_close(&t);
}

/* ---- queue_wrap */

TEST(wrap_queue_refusals_and_no_timing)
{
	struct dev t;
	struct ape__queue *q;
	struct ape__event *e0 = NULL, *e1 = NULL;
	cl_command_queue ooo, plain, foreign;
	cl_context other;
	cl_int err;
	double ms = 1;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ooo = clCreateCommandQueue(t.cctx, t.cdev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
	if (ooo) {
		q = (struct ape__queue *)&err;
		EXPECT_EQ(APE_EINVAL, t.ops->queue_wrap(t.d, ooo, &q));
		EXPECT_EQ(NULL, q);
		EXPECT_NE(NULL, strstr(ape_last_error(), "out of order")) TH_LOG("%s",
										  ape_last_error());
		clReleaseCommandQueue(ooo);
	} else {
		TH_LOG("the device makes no out-of-order queue (%d): that refusal is unchecked",
		       (int)err);
	}
	other = clCreateContext(NULL, 1, &t.cdev, NULL, NULL, &err);
	ASSERT_NE(NULL, other);
	foreign = clCreateCommandQueue(other, t.cdev, 0, &err);
	ASSERT_NE(NULL, foreign);
	EXPECT_EQ(APE_EINVAL, t.ops->queue_wrap(t.d, foreign, &q));
	EXPECT_NE(NULL, strstr(ape_last_error(), "cl_context")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_EINVAL, t.ops->queue_wrap(t.d, NULL, &q));
	clReleaseCommandQueue(foreign);
	clReleaseContext(other);

	/* in order, no profiling: works, but says it cannot time */
	plain = clCreateCommandQueue(t.cctx, t.cdev, 0, &err);
	ASSERT_NE(NULL, plain);
	ASSERT_EQ(0, t.ops->queue_wrap(t.d, plain, &q));
	ASSERT_EQ(0, t.ops->event_record(q, &e0));
	ASSERT_EQ(0, t.ops->event_record(q, &e1));
	EXPECT_EQ(0, t.ops->synchronize(q));
	EXPECT_EQ(APE_ENOTSUP, t.ops->event_elapsed(e0, e1, &ms));
	EXPECT_EQ(0.0, ms);
	EXPECT_NE(NULL, strstr(ape_last_error(), "PROFILING")) TH_LOG("%s", ape_last_error());
	if (t.ops->event_timestamp) {
		ms = 1;
		EXPECT_EQ(APE_ENOTSUP, t.ops->event_timestamp(e1, &ms));
		EXPECT_EQ(0.0, ms);
	}
	t.ops->event_destroy(e0);
	t.ops->event_destroy(e1);
	t.ops->queue_destroy(q);
	EXPECT_EQ(1, refs_when(OBJ_QUEUE, plain, 1)); /* libape let go of it, and only of its own hold */
	clReleaseCommandQueue(plain);
	dev_close(&t);
}

/*
 * The caller's order on its own queue: the test's writes of Q, K and V are held back by a user
 * event until libape's launch is enqueued behind them; the test's read of O comes after. Were
 * libape's kernels on a queue of their own, they would read the NaN the buffers hold before.
 */
TEST(wrapped_queue_keeps_the_callers_order)
{
	struct kase c = { .B = 1, .H = 2, .Hkv = 2, .Lq = 40, .Lk = 40, .D = 64, .dt = APE_F32,
			  .odt = APE_F32, .causal = true };
	const size_t no = (size_t)(c.B * c.H * c.Lq * c.D), nl = (size_t)(c.B * c.H * c.Lq);
	struct dev t;
	struct inputs in = { 0 };
	struct ape__launch l;
	struct ape__queue *q = NULL;
	struct ape__buf *b[APE__T_COUNT] = { 0 };
	cl_mem m[APE__T_COUNT];
	cl_command_queue cq;
	cl_event gate;
	cl_int err;
	const cl_uint nan_bits = 0xffffffffu;
	float prm[8], *o = malloc(no * 4), *o_ref = malloc(no * 4), *lse = malloc(nl * 4),
		      *lse_ref = malloc(nl * 4);
	size_t got;
	ape_rng rng;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ape_rng_init(&rng, "wrapped_queue_keeps_the_callers_order");
	ASSERT_EQ(0, inputs_make(&in, &c, &rng));
	head_params(prm, c.H);
	ASSERT_EQ(0, run_contiguous(_metadata, &t, &c, &in, prm, o_ref, lse_ref));

	cq = clCreateCommandQueue(t.cctx, t.cdev, 0, &err);
	ASSERT_NE(NULL, cq);
	gate = clCreateUserEvent(t.cctx, &err);
	ASSERT_NE(NULL, gate);
	for (int i = 0; i < APE__T_COUNT; i++) {
		const size_t bytes = i < 3 ? in.n[i] * 4 : i == APE__T_O ? no * 4 : nl * 4;

		m[i] = clCreateBuffer(t.cctx, CL_MEM_READ_WRITE, bytes, NULL, &err);
		ASSERT_NE(NULL, m[i]);
		ASSERT_EQ(CL_SUCCESS, clEnqueueFillBuffer(cq, m[i], &nan_bits, 4, 0, bytes, 0, NULL,
							  NULL));
		ASSERT_EQ(CL_SUCCESS, clFinish(cq));
		ASSERT_EQ(0, t.ops->buf_wrap(t.d, APE__MEM_OPENCL, m[i], 0, &b[i], &got));
	}
	for (int i = 0; i < 3; i++)
		ASSERT_EQ(CL_SUCCESS, clEnqueueWriteBuffer(cq, m[i], CL_FALSE, 0, in.n[i] * 4,
							   in.x[i], 1, &gate, NULL));
	ASSERT_EQ(0, t.ops->queue_wrap(t.d, cq, &q));
	make_launch(&l, &c, prm);
	l.q = b[APE__T_Q];
	l.k = b[APE__T_K];
	l.v = b[APE__T_V];
	l.o = b[APE__T_O];
	l.lse = b[APE__T_LSE];
	ASSERT_EQ(0, t.ops->attention(q, &l)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[APE__T_O], CL_FALSE, 0, no * 4, o, 0, NULL,
						  NULL));
	ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[APE__T_LSE], CL_FALSE, 0, nl * 4, lse, 0,
						  NULL, NULL));
	/* libape's buffers and queue wrappers may go before the work is done */
	t.ops->queue_destroy(q);
	for (int i = 0; i < APE__T_COUNT; i++)
		t.ops->buf_free(t.d, b[i]);
	ASSERT_EQ(CL_SUCCESS, clSetUserEventStatus(gate, CL_COMPLETE));
	ASSERT_EQ(CL_SUCCESS, clFinish(cq));
	EXPECT_EQ(0, memcmp(o, o_ref, no * 4));
	EXPECT_EQ(0, memcmp(lse, lse_ref, nl * 4));
	clReleaseEvent(gate);
	for (int i = 0; i < APE__T_COUNT; i++)
		clReleaseMemObject(m[i]);
	clReleaseCommandQueue(cq);
	inputs_free(&in);
	free(o);
	free(o_ref);
	free(lse);
	free(lse_ref);
	dev_close(&t);
}

/* A long-lived queue holds the events of the commands still in flight only, while no event of
 * it is alive; with one alive, it keeps them all (the event's timing needs them). */
TEST(long_lived_queue_drops_completed_commands)
{
	struct dev t;
	struct ape__queue *q;
	struct ape__buf *b;
	struct ape__event *e;
	static float x[1024];

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, t.ops->queue_create(t.d, &q));
	ASSERT_EQ(0, t.ops->buf_alloc(t.d, sizeof(x), &b));
	for (int i = 0; i < 1000; i++) {
		ASSERT_EQ(0, t.ops->copy_h2d(q, b, 0, x, sizeof(x)));
		if (i % 100 == 99)
			ASSERT_EQ(0, t.ops->synchronize(q));
	}
	EXPECT_EQ(0, ape__ocl_debug_tracked(q));
	ASSERT_EQ(0, t.ops->event_record(q, &e));
	for (int i = 0; i < 300; i++)
		ASSERT_EQ(0, t.ops->copy_h2d(q, b, 0, x, sizeof(x)));
	ASSERT_EQ(0, t.ops->synchronize(q));
	EXPECT_EQ(300, ape__ocl_debug_tracked(q));
	t.ops->event_destroy(e);
	for (int i = 0; i < 300; i++) /* completed ones are dropped as new ones come */
		ASSERT_EQ(0, t.ops->copy_h2d(q, b, 0, x, sizeof(x)));
	EXPECT_LT(ape__ocl_debug_tracked(q), 600);
	ASSERT_EQ(0, t.ops->synchronize(q));
	EXPECT_EQ(0, ape__ocl_debug_tracked(q));
	t.ops->buf_free(t.d, b);
	t.ops->queue_destroy(q);
	dev_close(&t);
}

/* ---- the caller's cl_context */

static ape_device *device_of(ape_context *ctx, cl_device_id id, void **native_ctx)
{
	ape_device *devs[16];
	const int n = ape_device_list(ctx, devs, 16);

	for (int i = 0; i < n && i < 16; i++) {
		ape_device *d = devs[i];
		void *c = NULL, *dv = NULL;

		if (d && d->be->ops->native && !strcmp(d->info.backend, "opencl")) {
			d->be->ops->native(d, &c, &dv);
			if (dv == (void *)id) {
				*native_ctx = c;
				return d;
			}
		}
	}
	return NULL;
}

/* A cl_context of the test's own on t's device, and a libape context built on it
 * (ape_context_options.opencl_context and .opencl_device). 0, or -1 after logging. */
static int import_context(struct __test_metadata *_metadata, const struct dev *t,
			  cl_context *mine, ape_context **ctx)
{
	ape_context_options o;
	cl_int err;

	*ctx = NULL;
	*mine = clCreateContext(NULL, 1, &t->cdev, NULL, NULL, &err);
	if (!*mine) {
		TH_LOG("clCreateContext: %d", (int)err);
		return -1;
	}
	ape_context_options_init(&o);
	o.backends = "opencl";
	o.opencl_context = *mine;
	o.opencl_device = t->cdev;
	if (ape_context_create(ctx, &o)) {
		TH_LOG("ape_context_create on the test's cl_context: %s", ape_last_error());
		return -1;
	}
	return 0;
}

TEST(context_on_the_callers_cl_context)
{
	struct dev t;
	ape_context *ctx = NULL;
	ape_device *d;
	void *nctx = NULL;
	cl_context mine;
	cl_mem m;
	cl_int err;
	struct ape__buf *b;
	size_t got;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, import_context(_metadata, &t, &mine, &ctx));
	d = device_of(ctx, t.cdev, &nctx);
	ASSERT_NE(NULL, d);
	EXPECT_EQ((void *)mine, nctx);
	EXPECT_EQ(2, refs_when(OBJ_CONTEXT, mine, 2)); /* libape holds one */
	/* a cl_mem of that context is the device's; one of the first context's is not */
	m = clCreateBuffer(mine, CL_MEM_READ_WRITE, 256, NULL, &err);
	ASSERT_NE(NULL, m);
	ASSERT_EQ(0, d->be->ops->buf_wrap(d, APE__MEM_OPENCL, m, 0, &b, &got));
	EXPECT_EQ(256, got);
	d->be->ops->buf_free(d, b);
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE__MEM_OPENCL, m, 0, &b, &got));
	clReleaseMemObject(m);
	ape_context_destroy(ctx);
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, mine, 1)); /* given back, and only that */
	clReleaseContext(mine);
	dev_close(&t);
}

/*
 * A device that is not one of the context's fails ape_context_create with APE_EINVAL, naming it,
 * and leaves the context as it was. The device not in the context is a sub-device of the one
 * that is (clCreateSubDevices): the only other device a one-device machine has. (A context
 * made on a sub-device cannot be imported on PoCL 3.1, which lists the root device as that
 * context's, CL_CONTEXT_DEVICES.)
 */
TEST(context_import_of_a_device_not_in_the_context)
{
	struct dev t;
	ape_context_options o;
	ape_context *ctx = NULL;
	cl_device_id sub[64];
	cl_uint nsub = 0, cu = 0;
	cl_context root_ctx;
	cl_int err;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	clGetDeviceInfo(t.cdev, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(cu), &cu, NULL);
	{
		const cl_device_partition_property props[] = {
			CL_DEVICE_PARTITION_EQUALLY, (cl_device_partition_property)(cu > 1 ? cu / 2 : 1),
			0
		};

		err = clCreateSubDevices(t.cdev, props, 64, sub, &nsub);
	}
	if (err != CL_SUCCESS || nsub == 0) {
		dev_close(&t);
		SKIP(return, "the device makes no sub-devices (clCreateSubDevices: %d)", (int)err);
	}
	root_ctx = clCreateContext(NULL, 1, &t.cdev, NULL, NULL, &err);
	ASSERT_NE(NULL, root_ctx);
	ape_context_options_init(&o);
	o.backends = "opencl";
	o.opencl_context = root_ctx;
	o.opencl_device = sub[0];
	EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, &o));
	EXPECT_EQ(NULL, ctx);
	EXPECT_NE(NULL, strstr(ape_last_error(), "opencl_device")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, root_ctx, 1));
	if (ctx)
		ape_context_destroy(ctx);
	clReleaseContext(root_ctx);
	for (cl_uint i = 0; i < nsub && i < 64; i++)
		clReleaseDevice(sub[i]);
	dev_close(&t);
}

/* ---- through the public API */

struct gate_watch {
	cl_event gate;
	atomic_int opened_by_watchdog;
	atomic_int stop;
};

/* Opens the gate after 20 s if the test has not: a call that waited on the caller's queue
 * would otherwise wait forever. */
static void *gate_watchdog(void *arg)
{
	struct gate_watch *w = arg;

	for (int i = 0; i < 2000 && !atomic_load(&w->stop); i++)
		usleep(10000);
	if (!atomic_load(&w->stop)) {
		atomic_store(&w->opened_by_watchdog, 1);
		clSetUserEventStatus(w->gate, CL_COMPLETE);
	}
	return NULL;
}

/*
 * ape_context_options.opencl_context/opencl_device from the test's own clCreateContext: the
 * device reports that context (ape_device_native); ape_attention_enqueue() on the test's own
 * queue and cl_mem objects equals the host call bit for bit, and keeps its place in the queue:
 * the test's writes of Q, K and V, held back by a user event, come before libape's kernels, its
 * reads of O and LSE after them. ape_attention_enqueue() itself must not wait for the gate.
 */
TEST(public_api_on_the_callers_context_and_queue)
{
	const test_problem_shape sh = { 2, 4, 2, 37, 53, 64 };
	const cl_uint nan_bits = 0xffffffffu;
	struct dev t;
	ape_context *ctx = NULL;
	ape_device *devs[16], *d = NULL;
	ape_queue *qu = NULL;
	ape_buffer *bufs[5] = { 0 };
	ape_dtensor dt[5];
	cl_mem m[5];
	cl_context mine;
	cl_command_queue cq;
	struct gate_watch w = { 0 };
	pthread_t watchdog;
	test_problem a, b;
	size_t bytes[5];
	void *host[5];
	cl_int err;
	ape_rng rng;
	int n;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, import_context(_metadata, &t, &mine, &ctx));
	n = ape_device_list(ctx, devs, 16);
	for (int i = 0; i < n && i < 16 && !d; i++) {
		void *c = NULL, *dv = NULL;

		ASSERT_EQ(0, ape_device_native(devs[i], &c, &dv));
		if (dv == (void *)t.cdev) {
			EXPECT_EQ((void *)mine, c);
			d = devs[i];
		}
	}
	ASSERT_NE(NULL, d) TH_LOG("no device of the context reports the test's cl_device_id");

	ape_rng_init(&rng, "public_api_on_the_callers_context_and_queue");
	ASSERT_EQ(0, test_problem_make(&a, &rng, &sh, APE_F16, false));
	test_problem_set_params(&a, pow(2.0, -4.0 / 3.0), pow(2.0, -4.0 / 3.0) / 10,
				pow(2.0, -4.0 / 3.0) / 10, 0.1);
	ASSERT_EQ(0, test_problem_clone(&b, &a));
	ASSERT_NE(NULL, b.lse);
	ASSERT_EQ(0, test_problem_run(&a, d)) TH_LOG("host call: %s", ape_last_error());

	host[0] = b.q.t.data;
	host[1] = b.k.t.data;
	host[2] = b.v.t.data;
	host[3] = b.o.t.data;
	host[4] = b.lse;
	bytes[0] = (size_t)(sh.B * sh.H * sh.Lq * sh.D) * 2;
	bytes[1] = bytes[2] = (size_t)(sh.B * sh.Hkv * sh.Lk * sh.D) * 2;
	bytes[3] = (size_t)(sh.B * sh.H * sh.Lq * sh.D) * ape_dtype_size(b.o.t.dtype);
	bytes[4] = b.rows * sizeof(float);
	cq = clCreateCommandQueue(mine, t.cdev, 0, &err);
	ASSERT_NE(NULL, cq);
	w.gate = clCreateUserEvent(mine, &err);
	ASSERT_NE(NULL, w.gate);
	for (int i = 0; i < 5; i++) {
		m[i] = clCreateBuffer(mine, CL_MEM_READ_WRITE, bytes[i], NULL, &err);
		ASSERT_NE(NULL, m[i]);
		ASSERT_EQ(CL_SUCCESS, clEnqueueFillBuffer(cq, m[i], &nan_bits, 4, 0, bytes[i], 0,
							  NULL, NULL));
		ASSERT_EQ(CL_SUCCESS, clFinish(cq));
		ASSERT_EQ(0, ape_buffer_wrap_opencl(d, m[i], &bufs[i])) TH_LOG("%s",
										 ape_last_error());
		EXPECT_EQ(bytes[i], ape_buffer_size(bufs[i]));
	}
	for (int i = 0; i < 3; i++)
		ASSERT_EQ(CL_SUCCESS, clEnqueueWriteBuffer(cq, m[i], CL_FALSE, 0, bytes[i], host[i],
							   1, &w.gate, NULL));
	ASSERT_EQ(0, pthread_create(&watchdog, NULL, gate_watchdog, &w));
	ASSERT_EQ(0, ape_queue_wrap_opencl(d, cq, &qu)) TH_LOG("%s", ape_last_error());
	ape_dtensor_init(&dt[0], bufs[0], 0, APE_F16, sh.B, sh.H, sh.Lq, sh.D);
	ape_dtensor_init(&dt[1], bufs[1], 0, APE_F16, sh.B, sh.Hkv, sh.Lk, sh.D);
	ape_dtensor_init(&dt[2], bufs[2], 0, APE_F16, sh.B, sh.Hkv, sh.Lk, sh.D);
	ape_dtensor_init(&dt[3], bufs[3], 0, b.o.t.dtype, sh.B, sh.H, sh.Lq, sh.D);
	ape_dtensor_init(&dt[4], bufs[4], 0, APE_F32, sh.B, sh.H, sh.Lq, 1);
	EXPECT_EQ(0, ape_attention_enqueue(qu, &b.desc, &dt[0], &dt[1], &dt[2], &dt[3], &dt[4]))
	TH_LOG("%s", ape_last_error());
	for (int i = 3; i < 5; i++)
		ASSERT_EQ(CL_SUCCESS, clEnqueueReadBuffer(cq, m[i], CL_FALSE, 0, bytes[i], host[i],
							  0, NULL, NULL));
	EXPECT_EQ(0, atomic_load(&w.opened_by_watchdog))
	TH_LOG("ape_attention_enqueue waited on the caller's queue");
	atomic_store(&w.stop, 1);
	pthread_join(watchdog, NULL);
	if (!atomic_load(&w.opened_by_watchdog))
		ASSERT_EQ(CL_SUCCESS, clSetUserEventStatus(w.gate, CL_COMPLETE));
	EXPECT_EQ(0, ape_queue_synchronize(qu)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(a.o.t.data, b.o.t.data, bytes[3]));
	EXPECT_EQ(0, memcmp(a.lse, b.lse, bytes[4]));
	ape_queue_destroy(qu);
	for (int i = 0; i < 5; i++) {
		ape_buffer_free(bufs[i]);
		clReleaseMemObject(m[i]);
	}
	clReleaseEvent(w.gate);
	clReleaseCommandQueue(cq);
	test_problem_free(&a);
	test_problem_free(&b);
	ape_context_destroy(ctx);
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, mine, 1));
	clReleaseContext(mine);
	dev_close(&t);
}

/*
 * ape_attention_backward_enqueue() on the test's own cl_context, cl_command_queue and cl_mem
 * objects: the host call's gradients bit for bit, every write of the inputs (held back by a
 * user event) before libape's work and the reads of the gradients after it, and the call
 * itself not waiting for the gate (its scratch is released in queue order, never waited for).
 */
TEST(backward_on_the_callers_context_and_queue)
{
	const test_problem_shape sh = { 1, 4, 2, 19, 29, 64 }; /* D = 64: a built program */
	const cl_uint nan_bits = 0xffffffffu;
	struct dev t;
	ape_context *ctx = NULL;
	ape_device *d;
	void *nctx = NULL;
	ape_queue *qu = NULL;
	ape_buffer *bufs[11] = { 0 };
	ape_dtensor dt[11];
	cl_mem m[11] = { 0 };
	cl_context mine;
	cl_command_queue cq;
	struct gate_watch w = { 0 };
	pthread_t watchdog;
	grads host, got;
	ape_rng rng;
	cl_int err;
	bcase c;

	ASSERT_EQ(0, dev_open(_metadata, &t));
	ASSERT_EQ(0, import_context(_metadata, &t, &mine, &ctx));
	d = device_of(ctx, t.cdev, &nctx);
	ASSERT_NE(NULL, d);
	ape_rng_init(&rng, "backward_on_the_callers_context_and_queue");
	ASSERT_EQ(0, bcase_ready(&c, &rng, &sh, APE_F16, true, true, d)) TH_LOG("%s",
										  ape_last_error());
	ASSERT_EQ(0, grads_alloc(&host, &c, APE_F16));
	ASSERT_EQ(0, grads_alloc(&got, &c, APE_F16));
	ASSERT_EQ(0, run_backward(&c, d, &host, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
	cq = clCreateCommandQueue(mine, t.cdev, 0, &err);
	ASSERT_NE(NULL, cq);
	w.gate = clCreateUserEvent(mine, &err);
	ASSERT_NE(NULL, w.gate);
	{
		/* each tensor's whole host allocation in a cl_mem of its own, at its offsets */
		const test_tensor *tt[11] = { &c.tp.q, &c.tp.k, &c.tp.v, &c.tp.o, NULL, &c.dout,
					      NULL, &got.dq, &got.dk, &got.dv, NULL };
		void *data[11] = { 0 };
		size_t bytes[11];

		data[4] = c.tp.lse;
		data[6] = c.dlse;
		data[10] = got.dparams;
		for (int i = 0; i < 11; i++) {
			void *base = tt[i] ? tt[i]->alloc : data[i];
			const ape_tensor *x = tt[i] ? &tt[i]->t : NULL;

			bytes[i] = tt[i] ? tt[i]->alloc_bytes
				   : i == 10 ? (size_t)(4 * sh.H) * sizeof(float)
					     : c.tp.rows * sizeof(float);
			m[i] = clCreateBuffer(mine, CL_MEM_READ_WRITE, bytes[i], NULL, &err);
			ASSERT_NE(NULL, m[i]);
			ASSERT_EQ(CL_SUCCESS, clEnqueueFillBuffer(cq, m[i], &nan_bits, 4, 0, bytes[i],
								  0, NULL, NULL));
			ASSERT_EQ(0, ape_buffer_wrap_opencl(d, m[i], &bufs[i]))
			TH_LOG("%s", ape_last_error());
			if (x) {
				ape_dtensor_init(&dt[i], bufs[i],
						 (uint64_t)((char *)x->data - (char *)base), x->dtype,
						 x->shape[0], x->shape[1], x->shape[2], x->shape[3]);
				ape_tensor_strides(x, dt[i].strides);
			} else if (i == 10) {
				ape_dtensor_init(&dt[i], bufs[i], 0, APE_F32, 1, 1, sh.H, 4);
			} else {
				ape_dtensor_init(&dt[i], bufs[i], 0, APE_F32, sh.B, sh.H, sh.Lq, 1);
			}
		}
		ASSERT_EQ(CL_SUCCESS, clFinish(cq));
		for (int i = 0; i < 7; i++) /* the inputs, held back by the gate */
			ASSERT_EQ(CL_SUCCESS,
				  clEnqueueWriteBuffer(cq, m[i], CL_FALSE, 0, bytes[i],
						       tt[i] ? tt[i]->alloc : data[i], 1, &w.gate,
						       NULL));
		ASSERT_EQ(0, pthread_create(&watchdog, NULL, gate_watchdog, &w));
		ASSERT_EQ(0, ape_queue_wrap_opencl(d, cq, &qu)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, ape_attention_backward_enqueue(qu, &c.tp.desc, &dt[0], &dt[1], &dt[2],
							    &dt[3], &dt[4], &dt[5], &dt[6], &dt[7],
							    &dt[8], &dt[9], &dt[10]))
		TH_LOG("%s", ape_last_error());
		for (int i = 7; i < 11; i++)
			ASSERT_EQ(CL_SUCCESS,
				  clEnqueueReadBuffer(cq, m[i], CL_FALSE, 0, bytes[i],
						      tt[i] ? tt[i]->alloc : data[i], 0, NULL,
						      NULL));
	}
	EXPECT_EQ(0, atomic_load(&w.opened_by_watchdog))
	TH_LOG("ape_attention_backward_enqueue waited on the caller's queue");
	atomic_store(&w.stop, 1);
	pthread_join(watchdog, NULL);
	if (!atomic_load(&w.opened_by_watchdog))
		ASSERT_EQ(CL_SUCCESS, clSetUserEventStatus(w.gate, CL_COMPLETE));
	EXPECT_EQ(0, ape_queue_synchronize(qu)) TH_LOG("%s", ape_last_error());
	EXPECT_TRUE(same_grads(&got, &host, W_ALL));
	ape_queue_destroy(qu);
	for (int i = 0; i < 11; i++) {
		ape_buffer_free(bufs[i]);
		clReleaseMemObject(m[i]);
	}
	clReleaseEvent(w.gate);
	clReleaseCommandQueue(cq);
	grads_free(&host);
	grads_free(&got);
	bcase_free(&c);
	ape_context_destroy(ctx);
	EXPECT_EQ(1, refs_when(OBJ_CONTEXT, mine, 1));
	clReleaseContext(mine);
	dev_close(&t);
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
#endif

int main(int argc, char **argv)
{
#ifndef APE_HAVE_OPENCL
	ksft_exit_skip("the OpenCL backend is not built into this libape\n");
#else
	skip_without_device();
#endif
	return test_harness_run(argc, argv);
}
