/* SPDX-License-Identifier: MIT */
/*
 * The CUDA-on-the-caller's-memory tests' pieces (test_cuda_resident.c,
 * test_cuda_resident_wrap.c): the emulated CUDA device beside the reference, a case's layout
 * kind, its logical inputs and launch built by the core's own builders, and the programs' main()
 * (CUDA_RESIDENT_MAIN). Include after the Kselftest harness, with APE_HAVE_CUDA.
 */
#ifndef APE_TEST_CUDA_RESIDENT_CASE_H
#define APE_TEST_CUDA_RESIDENT_CASE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/problem.h"
#include "api/validate.h"
#include "exec/launch.h"

#define EMU_LIB APE_BUILD_DIR "/tests/cuda_emu/libcuda.so.1"

/* the tensors' layouts */
enum kind {
	K_CONTIG_OFF, /* [B, H, L, D] at an aligned nonzero offset */
	K_BLHD, /* [B, L, H, D], rows padded by 8 elements, O and LSE [B, L, H] likewise */
	K_PACKED, /* Q, K, V: slices of one [B, L, H + 2 Hkv, D] tensor (Lq == Lk) */
	K_ODD, /* odd offsets and odd row strides: nothing 16-byte (or pair-) aligned */
};

/* ------------------------------------------------------------------ cases */

/* the cases' shorthand */
#define F32 APE_F32
#define F16 APE_F16
#define BF16 APE_BF16
#define HALF APE_ROPE_HALF
#define INTER APE_ROPE_INTERLEAVED

struct scase {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dt, odt;
	ape_rope_layout layout;
	bool causal, lse, skip;
	enum kind kind;
};

struct devs {
	ape_context *ctx;
	ape_device *cuda, *ref;
};

static void open_devs(struct __test_metadata *_metadata, struct devs *d)
{
	d->ctx = test_context("cuda,ref");
	ASSERT_NE(NULL, d->ctx);
	d->cuda = test_device(d->ctx, "cuda");
	d->ref = test_device(d->ctx, "ref");
	ASSERT_NE(NULL, d->cuda) TH_LOG("no emulated CUDA device (%s)", EMU_LIB);
	ASSERT_NE(NULL, d->ref);
}

/* The logical inputs of a case, contiguous, and its launch, built by the core's own builders
 * (validation, then ape__launch_init()). */
struct inputs {
	test_problem tp;
	struct ape__problem p;
	struct ape_be_launch l; /* no buffers yet, not strided */
};

static void inputs_free(struct inputs *in)
{
	ape__problem_fini(&in->p);
	test_problem_free(&in->tp);
}

static int make_inputs(struct inputs *in, ape_rng *rng, const struct scase *c)
{
	const test_problem_shape sh = { c->B, c->H, c->Hkv, c->Lq, c->Lk, c->D };

	memset(in, 0, sizeof(*in));
	if (test_problem_make(&in->tp, rng, &sh, c->dt, false))
		return -1;
	if (c->skip) /* a real decay: far keys are provably negligible */
		test_problem_set_params(&in->tp, pow(2.0, -4.0 / 3.0), 0.04, 0.04, 0.1);
	else
		test_problem_random_params(&in->tp, rng);
	in->tp.desc.causal = c->causal;
	in->tp.desc.layout = c->layout;
	if (test_problem_set_out_dtype(&in->tp, c->odt) ||
	    ape__problem_init(&in->p, "test", &in->tp.desc, &in->tp.q.t, &in->tp.k.t, &in->tp.v.t,
			      &in->tp.o.t, in->tp.lse)) {
		test_problem_free(&in->tp);
		return -1;
	}
	ape__launch_init(&in->l, &in->p, c->odt, c->skip ? in->p.skip_tol : 0.0);
	in->l.Lq = c->Lq;
	in->l.Lk = c->Lk;
	in->l.q_start = in->p.q_start;
	in->l.k_start = in->p.k_start;
	return 0;
}


/* every test (a forked child) drives the emulated driver */
#define CUDA_RESIDENT_MAIN                                                                         \
	int main(int argc, char **argv)                                                            \
	{                                                                                          \
		unsetenv("FAKE_CUDA_MODE");                                                        \
		if (ape_test_slow())                                                               \
			ksft_exit_skip("the emulator under valgrind would take tens of minutes; "  \
				       "make sanitize runs it under ASan and UBSan\n");            \
		setenv("APE_CUDA_LIBRARY", EMU_LIB, 1);                                            \
		return test_harness_run(argc, argv);                                               \
	}

#endif
