/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend on the caller's memory (issue 12; core/backend.h, ABI 5), through the
 * backend's ops: strided launches (a [B, L, H, D] layout, a packed QKV slice, element offsets,
 * GQA, f32/f16/bf16, both rope layouts, causal or not, with and without skipping) against
 * contiguous ones, bit for bit, writing nothing outside their views; buf_wrap of host memory
 * (computed in place) and of cl_mem objects the test makes itself. The caller's queues, its
 * cl_context and the public API on them: test_opencl_interop_queues.c (the shared pieces:
 * opencl_interop.h).
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

#include "opencl_interop.h"

#ifdef APE_HAVE_OPENCL

static const char *const mem_names[MEM_N] = { "buf_alloc", "buf_wrap host", "buf_wrap cl_mem" };

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
	struct ape_be_buf *b[APE_BE_T_COUNT]; /* q, k, v, o, lse; the same buffer may appear twice */
	cl_mem cm[APE_BE_T_COUNT]; /* MEM_CLMEM: the test's own objects */
};

/* A buffer over image im (its whole size) in the way c->mem says, with im's bytes in it. */
static int buf_for(struct __test_metadata *_metadata, const struct dev *t,
		   struct ape_be_queue *q, enum mem mem, struct image *im, struct ape_be_buf **out,
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
		if (t->ops->buf_wrap(t->d, APE_BE_MEM_HOST, im->p, bytes, out, &got))
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
	if (t->ops->buf_wrap(t->d, APE_BE_MEM_OPENCL, *cm, 0, out, &got))
		return -1;
	EXPECT_EQ(bytes, got);
	return 0;
}

/* Brings an output image back to the host (MEM_HOST: it is there already, in place). */
static int image_back(const struct dev *t, struct ape_be_queue *q, enum mem mem, struct image *im,
		      struct ape_be_buf *b)
{
	if (mem == MEM_HOST)
		return 0;
	return t->ops->copy_d2h(q, im->p, b, 0, im->n * im->es);
}

/* The views of c: a [B, L, H, D] layout (rows padded by 3 elements) with offsets, or q, k and v
 * as slices of one packed [B, L, H + 2 Hkv, D] tensor; O as [B, L, H, D + 5] after an offset,
 * LSE as [B, L, H] after an offset. Element counts of the images in n[]. */
static void views_of(const struct kase *c, struct ape_be_view *v, size_t n[APE_BE_T_COUNT])
{
	const int64_t D = c->D, H = c->H, Hkv = c->Hkv;

	if (c->packed) { /* Lq == Lk */
		const int64_t W = (H + 2 * Hkv) * D, L = c->Lq;

		v[APE_BE_T_Q] = (struct ape_be_view){ c->off, L * W, D, W };
		v[APE_BE_T_K] = (struct ape_be_view){ c->off + H * D, L * W, D, W };
		v[APE_BE_T_V] = (struct ape_be_view){ c->off + (H + Hkv) * D, L * W, D, W };
		n[APE_BE_T_Q] = (size_t)(c->off + c->B * L * W);
		n[APE_BE_T_K] = n[APE_BE_T_V] = 0; /* in q's buffer */
	} else {
		const int64_t R = D + 3;

		v[APE_BE_T_Q] = (struct ape_be_view){ c->off, c->Lq * H * R, R, H * R };
		v[APE_BE_T_K] = (struct ape_be_view){ c->off + 1, c->Lk * Hkv * R, R, Hkv * R };
		v[APE_BE_T_V] = (struct ape_be_view){ c->off + 2, c->Lk * Hkv * R, R, Hkv * R };
		n[APE_BE_T_Q] = (size_t)(c->off + c->B * c->Lq * H * R);
		n[APE_BE_T_K] = (size_t)(c->off + 1 + c->B * c->Lk * Hkv * R);
		n[APE_BE_T_V] = (size_t)(c->off + 2 + c->B * c->Lk * Hkv * R);
	}
	v[APE_BE_T_O] = (struct ape_be_view){ 7, c->Lq * H * (D + 5), D + 5, H * (D + 5) };
	n[APE_BE_T_O] = (size_t)(7 + c->B * c->Lq * H * (D + 5));
	v[APE_BE_T_LSE] = (struct ape_be_view){ 3, c->Lq * H, 1, H };
	n[APE_BE_T_LSE] = (size_t)(3 + c->B * c->Lq * H);
}

static int64_t at(const struct ape_be_view *v, int64_t b, int64_t h, int64_t l)
{
	return v->off + b * v->sb + h * v->sh + l * v->sl;
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
	struct ape_be_view v[APE_BE_T_COUNT];
	size_t n[APE_BE_T_COUNT];
	struct image im[APE_BE_T_COUNT];
	struct ape_be_buf *b[APE_BE_T_COUNT] = { 0 };
	cl_mem cm[APE_BE_T_COUNT] = { 0 };
	struct ape_be_queue *q = NULL;
	struct ape_be_launch l;
	const size_t ie = esz(c->dt), oe = esz(c->odt);
	int ret = 0, bad = 0;

	memset(im, 0, sizeof(im));
	views_of(c, v, n);
	make_launch(&l, c, prm);
	l.strided = true;
	memcpy(l.view, v, sizeof(v));
	/* the images: inputs scattered into their views, poison elsewhere */
	for (int i = 0; i < APE_BE_T_COUNT && !ret; i++) {
		if (!n[i])
			continue;
		ret = image_new(&im[i], n[i], i == APE_BE_T_LSE ? 4 : i == APE_BE_T_O ? oe : ie,
				i >= APE_BE_T_O ? POISON_OUT : POISON_IN);
	}
	ASSERT_EQ(0, ret);
	for (int i = 0; i < 3; i++) {
		struct image *dst = c->packed ? &im[APE_BE_T_Q] : &im[i];
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
				memset(im[APE_BE_T_O].covered + at(&v[APE_BE_T_O], bb, h, r), 1,
				       (size_t)c->D);
				im[APE_BE_T_LSE].covered[at(&v[APE_BE_T_LSE], bb, h, r)] = 1;
			}

	ret = t->ops->queue_create(t->d, &q);
	for (int i = 0; i < APE_BE_T_COUNT && !ret; i++)
		if (n[i])
			ret = buf_for(_metadata, t, q, c->mem, &im[i], &b[i], &cm[i]);
	if (!ret) {
		l.q = b[APE_BE_T_Q];
		l.k = c->packed ? b[APE_BE_T_Q] : b[APE_BE_T_K];
		l.v = c->packed ? b[APE_BE_T_Q] : b[APE_BE_T_V];
		l.o = b[APE_BE_T_O];
		l.lse = b[APE_BE_T_LSE];
		ret = t->ops->attention(q, &l);
	}
	/* MEM_HOST: no read at all, the kernel wrote host memory in place */
	if (!ret)
		ret = image_back(t, q, c->mem, &im[APE_BE_T_O], b[APE_BE_T_O]);
	if (!ret)
		ret = image_back(t, q, c->mem, &im[APE_BE_T_LSE], b[APE_BE_T_LSE]);
	if (!ret)
		ret = t->ops->synchronize(q);
	if (ret)
		TH_LOG("%s: strided run: %s", what, ape_last_error());
	t->ops->queue_destroy(q);
	for (int i = 0; i < APE_BE_T_COUNT; i++) {
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
				const int64_t eo = at(&v[APE_BE_T_O], bb, h, r);
				const int64_t el = at(&v[APE_BE_T_LSE], bb, h, r);

				if (memcmp(im[APE_BE_T_O].p + (size_t)eo * oe,
					   (const unsigned char *)o_ref + ci * (size_t)c->D * oe,
					   (size_t)c->D * oe) ||
				    memcmp(im[APE_BE_T_LSE].p + (size_t)el * 4, lse_ref + ci, 4)) {
					if (!bad++)
						TH_LOG("%s: b %lld h %lld row %lld differs from the "
						       "contiguous run",
						       what, (long long)bb, (long long)h,
						       (long long)r);
				}
			}
	for (int i = APE_BE_T_O; !ret && i <= APE_BE_T_LSE; i++)
		for (size_t e = 0; e < im[i].n; e++) {
			const unsigned char *p = im[i].p + e * im[i].es;
			bool poisoned = true;

			for (size_t k = 0; k < im[i].es; k++)
				poisoned &= p[k] == POISON_OUT;
			if (!im[i].covered[e] && !poisoned && !bad++)
				TH_LOG("%s: %s element %zu, outside the view, was written", what,
				       i == APE_BE_T_O ? "O" : "LSE", e);
		}
	for (int i = 0; i < APE_BE_T_COUNT; i++)
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
		struct ape_be_buf *b = (struct ape_be_buf *)&x;
		size_t got = 1;

		EXPECT_EQ(APE_ENOTSUP, t.ops->buf_wrap(t.d, APE_BE_MEM_HOST, x, sizeof(x), &b, &got));
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
	struct ape_be_buf *b;
	size_t got;
	cl_context other;
	cl_mem mine, theirs;
	cl_int err;
	static float x[16];

	ASSERT_EQ(0, dev_open(_metadata, &t));
	mine = clCreateBuffer(t.cctx, CL_MEM_READ_WRITE, 4096, NULL, &err);
	ASSERT_NE(NULL, mine);
	/* the whole object, or a part of it from its start; not more */
	ASSERT_EQ(0, t.ops->buf_wrap(t.d, APE_BE_MEM_OPENCL, mine, 0, &b, &got));
	EXPECT_EQ(4096, got);
	t.ops->buf_free(t.d, b);
	ASSERT_EQ(0, t.ops->buf_wrap(t.d, APE_BE_MEM_OPENCL, mine, 1000, &b, &got));
	EXPECT_EQ(1000, got);
	t.ops->buf_free(t.d, b);
	b = (struct ape_be_buf *)x;
	got = 1;
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE_BE_MEM_OPENCL, mine, 4097, &b, &got));
	EXPECT_EQ(NULL, b);
	EXPECT_EQ(0, got);
	EXPECT_NE(NULL, strstr(ape_last_error(), "4097")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE_BE_MEM_OPENCL, NULL, 0, &b, &got));
	/* CUDA memory on an OpenCL device */
	EXPECT_EQ(APE_ENOTSUP, t.ops->buf_wrap(t.d, APE_BE_MEM_CUDA, (void *)(uintptr_t)4096, 64,
					       &b, &got));
	EXPECT_NE(NULL, strstr(ape_last_error(), "CUDA")) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "opencl:")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(NULL, b);
	/* a cl_mem of another context: refused, naming both contexts */
	other = clCreateContext(NULL, 1, &t.cdev, NULL, NULL, &err);
	ASSERT_NE(NULL, other);
	theirs = clCreateBuffer(other, CL_MEM_READ_WRITE, 4096, NULL, &err);
	ASSERT_NE(NULL, theirs);
	EXPECT_EQ(APE_EINVAL, t.ops->buf_wrap(t.d, APE_BE_MEM_OPENCL, theirs, 0, &b, &got));
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

#endif

OPENCL_INTEROP_MAIN
