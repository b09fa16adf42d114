/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_backward() on every backend (common/backend_fixture.h): one with the op against
 * the reference at the spec's tolerances, one without it APE_ENOTSUP naming the device;
 * streamed under small budgets, the buffers and the backend's declared scratch within the
 * budget, what it allocates within what it declares. (The reference itself:
 * tests/test_backward.c and tests/test_backward_api.c.)
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/problem.h"
#include "core/backend.h"

/* The backends' counters of the most scratch one backward launch allocated (declared in
 * opencl/ocl.h and cuda/cu.h, whose private structs cannot share one file). */
#ifdef APE_HAVE_OPENCL
extern atomic_uint_fast64_t ape__ocl_bwd_scratch_high;
#endif
#ifdef APE_HAVE_CUDA
extern atomic_uint_fast64_t ape__cu_bwd_scratch_high;
#endif

/* ---------------------------------------------------------------- every backend */

/* Every gradient of g within the spec's tolerance for dt (grads_tol()) of the reference's want
 * (H heads' parameters); `i` names the case in the log. */
static void expect_grads_near(struct __test_metadata *_metadata, const grads *g,
			      const grads *want, ape_dtype dt, int64_t H, int i)
{
	EXPECT_LE(grads_rel_err(&g->dq.t, &want->dq.t), grads_tol(dt)) TH_LOG("case %d", i);
	EXPECT_LE(grads_rel_err(&g->dk.t, &want->dk.t), grads_tol(dt)) TH_LOG("case %d", i);
	EXPECT_LE(grads_rel_err(&g->dv.t, &want->dv.t), grads_tol(dt)) TH_LOG("case %d", i);
	EXPECT_LE(grads_rel_err_params(g->dparams, want->dparams, H), grads_tol(dt))
		TH_LOG("case %d", i);
}

BACKEND_FIXTURE(bwd)

/*
 * Every backend: one that has the backward op against the reference at the spec's tolerances,
 * in one piece and in chunks, on every storage type; one that has not APE_ENOTSUP naming the
 * device, nothing written, no fallback to another device.
 */
TEST_F(bwd, every_backend_against_the_reference)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	const test_problem_shape small = { 1, 2, 1, 5, 7, 8 }, larger = { 2, 4, 2, 33, 47, 16 };
	const test_problem_shape *sh = self->emu || ape_test_slow() ? &small : &larger;
	const bool has_op = ape_be_caps_have(&self->dev->caps, APE_BE_CAP_BACKWARD);
	ape_device_info info;
	char label[256];
	ape_rng rng;

	ASSERT_EQ(0, ape_device_get_info(self->dev, &info));
	snprintf(label, sizeof(label), "ape_attention_backward: %s:%d %s: ", info.backend,
		 info.backend_index, info.name);
	ape_rng_init(&rng, "every_backend_against_the_reference");
	for (int t = 0; t < 3; t++) {
		bcase c;
		grads want, g, chunked;

		ASSERT_EQ(0, bcase_ready(&c, &rng, sh, types[t], t == 1, true, self->ref));
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, types[t]));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, types[t]));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		if (!has_op) {
			grads_snapshot s;

			grads_snap(&s, &g);
			EXPECT_EQ(APE_ENOTSUP, run_backward(&c, self->dev, &g, W_ALL, NULL));
			EXPECT_NE(NULL, strstr(ape_last_error(), label)) TH_LOG("%s", ape_last_error());
			EXPECT_NE(NULL, strstr(ape_last_error(), "the backward pass is not "
								 "implemented on this backend yet"));
			EXPECT_TRUE(grads_unchanged(&s, &g));
		} else {
			EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, NULL))
				TH_LOG("%s", ape_last_error());
			EXPECT_EQ(0, run_chunked(&c, self->dev, &chunked, 7, 16, NULL))
				TH_LOG("%s", ape_last_error());
			EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh->H), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&chunked.dq.t, &want.dq.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&chunked.dk.t, &want.dk.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err(&chunked.dv.t, &want.dv.t), grads_tol(types[t]));
			EXPECT_LE(grads_rel_err_params(chunked.dparams, want.dparams, sh->H),
				  grads_tol(types[t]));
		}
		grads_free(&want);
		grads_free(&g);
		grads_free(&chunked);
		bcase_free(&c);
	}
}

/*
 * A device that reads host memory and takes strided backward launches (APE_BE_CAP_BWD_VIEWS:
 * OpenCL CPU devices) reads Q, K, V, O and dO where they lie: the same gradients bit for bit as
 * with every input copied into packed chunk buffers (APE_EXEC_COPY_INPUTS: the same launches
 * on copies), on every storage type, contiguous and padded [B, L, H, D] layouts (whose NaN
 * padding a wrong stride would read), dO in float32 or in the storage type, GQA and MQA, both
 * rope layouts, in one piece and in query and key chunks (views that start mid-tensor); and
 * none of those five tensors' bytes copied to the device.
 */
TEST_F(bwd, strided_inputs_read_where_they_lie)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const test_problem_shape shapes[] = {
		{ 2, 4, 2, 21, 37, 64 }, /* GQA, a specialised D */
		{ 1, 3, 1, 9, 70, 10 }, /* MQA, a D no kernel specialises */
	};
	ape_rng rng;

	if (!ape_be_dev_has(self->dev, APE_BE_CAP_BWD_VIEWS | APE_BE_CAP_HOST_MEMORY))
		SKIP(return, "%s: no strided backward launches on host memory", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	for (int i = 0; i < 12; i++) {
		const test_problem_shape *sh = &shapes[i % 2];
		const bool strided = i / 2 % 2, dout32 = i % 3 == 1;
		const ape_dtype dt = types[i / 4];
		const uint64_t esz = ape_dtype_size(dt);
		/* Q, O, dO and K, V: what copying them moves at least */
		const uint64_t in = (uint64_t)(sh->B * sh->D) *
				    (uint64_t)(2 * sh->H * sh->Lq * esz + 2 * sh->Hkv * sh->Lk * esz +
					       sh->H * sh->Lq * (dout32 ? 4 : esz));
		ape_exec_options eo;
		ape_stats st_in, st_copy;
		bcase c;
		grads g_in, g_copy;

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, strided, i % 5 != 0));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i % 3 == 0 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i % 4 != 3;
		/* every row and key in some launch, none skipped: copies move every input */
		c.tp.desc.q_start_set = false;
		c.tp.desc.skip_tol = 0;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		if (dout32 || strided) { /* dO widened, or laid out as the others */
			test_tensor d;

			if (dout32) {
				ASSERT_EQ(0, grads_widen(&d, &c.dout));
			} else {
				ASSERT_EQ(0, test_tensor_relayout(&d, &c.dout, 3));
			}
			test_tensor_free(&c.dout);
			c.dout = d;
			if (dout32 && strided) {
				ASSERT_EQ(0, test_tensor_relayout(&d, &c.dout, 5));
				test_tensor_free(&c.dout);
				c.dout = d;
			}
		}
		ASSERT_EQ(0, grads_alloc(&g_in, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g_copy, &c, APE_F32));
		ape_stats_init(&st_in);
		ape_stats_init(&st_copy);
		eo = i % 4 >= 2 ? test_chunks(7, 16) : test_chunks(0, 0);
		EXPECT_EQ(0, run_backward_ex(&c, self->dev, &g_in, &eo, &st_in))
			TH_LOG("case %d: %s", i, ape_last_error());
		eo.flags |= APE_EXEC_COPY_INPUTS;
		EXPECT_EQ(0, run_backward_ex(&c, self->dev, &g_copy, &eo, &st_copy))
			TH_LOG("case %d: %s", i, ape_last_error());
		EXPECT_TRUE(same_grads(&g_in, &g_copy, W_ALL)) TH_LOG("case %d", i);
		EXPECT_LE(st_in.bytes_to_device + in, st_copy.bytes_to_device)
			TH_LOG("case %d: %llu bytes copied in place, %llu with copies, inputs %llu", i,
			       (unsigned long long)st_in.bytes_to_device,
			       (unsigned long long)st_copy.bytes_to_device, (unsigned long long)in);
		grads_free(&g_in);
		grads_free(&g_copy);
		bcase_free(&c);
	}
}

/*
 * Every backend with the op, on the named cases one after another against the reference:
 * GQA and MQA, D = 2, 64 and one that no kernel specialises, both layouts, causal or not,
 * offsets of 2^40, rows that see no key (their dQ exactly 0), a constant query row (sigma = 0)
 * where lambda is large, lambda = 0, negative decays, per-head and scalar parameters, with and
 * without dLSE, every storage type with dO in it or in float32; then two runs bit for bit the
 * same, and the parameter gradients alone (the others left untouched).
 */
TEST_F(bwd, every_backend_edge_cases)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 9, 13, 64 }, /* GQA, a specialised D */
		{ 2, 3, 1, 7, 10, 6 }, /* MQA */
		{ 1, 2, 2, 5, 8, 2 }, /* D = 2 */
		{ 1, 2, 1, 40, 150, 66 }, /* a D no kernel specialises; more keys than a tile */
	};
	/* on the emulator 12: every shape with every storage type */
	const int ncases = ape_test_slow() ? 8 : self->emu ? 12 : 24;
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_BACKWARD))
		SKIP(return, "%s: no backward op (every_backend_against_the_reference checks that)",
		     variant->backend);
	ape_rng_init(&rng, "every_backend_edge_cases");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % 4];
		const ape_dtype dt = types[i / 4 % 3];
		const int64_t H = sh->H;
		bcase c;
		grads want, g, again, only, untouched;

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, false, i % 3 != 0));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i % 5 != 4;
		c.tp.desc.k_start = i % 7 == 2 ? ((int64_t)1 << 40) - i : -3 + i;
		/* the first two rows see no key when causal */
		c.tp.desc.q_start = c.tp.desc.k_start - 2;
		c.tp.desc.q_start_set = true;
		if (i % 2) { /* per head: head 0 with negative decays, head 1 with lambda = 0 */
			bcase_edge_heads(&c);
		} else if (i % 4 == 2) {
			c.tp.desc.lambda = (ape_param){ 0, NULL };
		}
		for (int64_t d = 0; d < sh->D; d++) /* sigma = 0 */
			test_tensor_set(&c.tp.q.t, 0, 0, sh->Lq - 1, d, 0.5);
		if (dt != APE_F32 && i % 3 == 1) { /* dO in float32 */
			test_tensor d32;

			ASSERT_EQ(0, grads_widen(&d32, &c.dout));
			test_tensor_free(&c.dout);
			c.dout = d32;
		}
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&only, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&untouched, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->dev, &again, W_ALL, NULL));
		EXPECT_EQ(0, run_backward(&c, self->dev, &only, W_DP, NULL));
		expect_grads_near(_metadata, &g, &want, dt, H, i);
		EXPECT_LE(grads_rel_err_params(only.dparams, want.dparams, H), grads_tol(dt))
			TH_LOG("case %d", i);
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", i);
		EXPECT_TRUE(same_grads(&only, &untouched, W_ALL & ~W_DP)) TH_LOG("case %d", i);
		if (c.tp.desc.causal)
			for (int64_t d = 0; d < sh->D; d++) {
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, 0, 0, d));
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, H - 1, 1, d));
			}
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		grads_free(&only);
		grads_free(&untouched);
		bcase_free(&c);
	}
}

/*
 * The borders of a backward that splits each (batch, kv head)'s key blocks among work-items and
 * sums the splits' partial dQ and row sums afterwards (OpenCL: ape_bwd_fused, 16 keys a block
 * at D = 64 and 128, 8 otherwise, about four work-items per compute unit, so one kv head
 * gets several splits): key counts not a multiple of the block nor of the split count, fewer
 * blocks than splits, fewer keys than a block, grouped heads, both layouts, causal or not, rows
 * that see no key. Against the reference; two runs bit for bit the same (the splits' sums meet
 * in a fixed order: a reduction in the order the work-items finish would differ in the last
 * bits between runs); and each output asked alone bit for bit as with all four.
 */
TEST_F(bwd, every_backend_split_borders)
{
	static const test_problem_shape shapes[] = {
		{ 1, 2, 1, 37, 200, 64 }, /* 13 blocks of 16, the last of 8 keys */
		{ 1, 3, 1, 33, 70, 128 }, /* GQA, 5 blocks of 16, the last of 6 */
		{ 1, 2, 2, 20, 40, 64 }, /* 3 blocks: fewer than the work-items wanted */
		{ 2, 2, 1, 45, 13, 64 }, /* fewer keys than a block */
		{ 1, 2, 1, 23, 97, 10 }, /* a D no kernel specialises: 13 blocks of 8 */
	};
	static const unsigned alone[] = { W_DQ, W_DK, W_DV, W_DP };
	const int ncases = self->emu || ape_test_slow() ? 5 : 10;
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_BACKWARD))
		SKIP(return, "%s: no backward op (every_backend_against_the_reference checks that)",
		     variant->backend);
	ape_rng_init(&rng, "every_backend_split_borders");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % 5];
		bcase c;
		grads want, g, again;

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, APE_F32, false, i % 2 == 0));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i < 5;
		c.tp.desc.k_start = 5 * i;
		/* causal: the first three rows see no key, the last ones all */
		c.tp.desc.q_start = c.tp.desc.k_start - 3 + (sh->Lk > sh->Lq ? sh->Lk - sh->Lq : 0);
		c.tp.desc.q_start_set = true;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, NULL)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->dev, &again, W_ALL, NULL));
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(APE_F32)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(APE_F32)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(APE_F32)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh->H), grads_tol(APE_F32))
			TH_LOG("case %d", i);
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", i);
		for (int w = 0; w < 4; w++) {
			grads one;

			ASSERT_EQ(0, grads_alloc(&one, &c, APE_F32));
			EXPECT_EQ(0, run_backward(&c, self->dev, &one, alone[w], NULL));
			EXPECT_TRUE(same_grads(&one, &g, alone[w]))
				TH_LOG("case %d: output 0x%x alone differs", i, alone[w]);
			grads_free(&one);
		}
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		bcase_free(&c);
	}
}

/*
 * lambda = 0 on every head (per head or one value), the case the OpenCL backend sends to its
 * separable sweep (kernels/backward.cl, ape_bwd_sep: Q and K rotated once by their positions,
 * no turn per pair): GQA, a D no kernel specialises, D = 2, both layouts, causal or not, offsets
 * (one of 2^40), rows that see no key, every storage type, random decays (negative ones too)
 * and, with decays >= 0, skipping on. Against the reference at the spec's tolerances; two runs
 * bit for bit the same; each output asked alone bit for bit as with all four; on OpenCL the
 * call's path names the separable sweep ("separable+backward"), and with APE_OCL_BWD_SEP=0 the
 * general sweep ("backward") gives the same gradients within the tolerances.
 */
TEST_F(bwd, every_backend_separable)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 37, 53, 64 }, /* GQA, a specialised D, blocks of 16 */
		{ 2, 3, 1, 20, 45, 128 }, /* MQA */
		{ 1, 2, 1, 33, 70, 66 }, /* a D no kernel specialises: blocks of 8 */
		{ 1, 2, 2, 9, 13, 2 }, /* D = 2 */
	};
	static const unsigned alone[] = { W_DQ, W_DK, W_DV, W_DP };
	const bool ocl = strcmp(variant->backend, "opencl") == 0;
	const int ncases = self->emu || ape_test_slow() ? 6 : 16;
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_BACKWARD))
		SKIP(return, "%s: no backward op (every_backend_against_the_reference checks that)",
		     variant->backend);
	ape_rng_init(&rng, "every_backend_separable");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % 4];
		const ape_dtype dt = types[i / 4 % 3];
		const int64_t H = sh->H;
		const bool skip = i % 3 == 0;
		ape_stats st;
		bcase c;
		grads want, g, again, general;

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, false, i % 2 == 0));
		test_problem_random_params(&c.tp, &rng);
		for (int64_t h = 0; h < H; h++) {
			c.tp.params[3 * H + h] = 0; /* lambda, per head */
			if (skip) /* decays >= 0: the skip bound applies */
				for (int k = 0; k < 3; k++)
					c.tp.params[k * H + h] = fabsf(c.tp.params[k * H + h]);
		}
		c.tp.desc.lambda = (ape_param){ 0, i % 2 ? c.tp.params + 3 * H : NULL };
		if (skip) {
			c.tp.desc.delta = (ape_param){ fabsf(c.tp.desc.delta.value),
						       c.tp.desc.delta.per_head };
			c.tp.desc.beta = (ape_param){ fabsf(c.tp.desc.beta.value),
						      c.tp.desc.beta.per_head };
			c.tp.desc.gamma = (ape_param){ fabsf(c.tp.desc.gamma.value),
						       c.tp.desc.gamma.per_head };
		}
		c.tp.desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i % 4 != 3;
		c.tp.desc.k_start = i % 5 == 2 ? ((int64_t)1 << 40) - i : 7 * i - 20;
		/* causal: the first two rows see no key, or (i % 3 == 1) the queries end-aligned
		 * but two */
		c.tp.desc.q_start = c.tp.desc.k_start - 2 + (i % 3 == 1 ? sh->Lk - sh->Lq : 0);
		c.tp.desc.q_start_set = true;
		c.tp.desc.skip_tol = 0;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&general, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		c.tp.desc.skip_tol = skip ? 1e-4f : 0;
		ape_stats_init(&st);
		EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, &st))
			TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->dev, &again, W_ALL, NULL));
		if (ocl)
			EXPECT_STREQ("separable+backward", st.path) TH_LOG("case %d", i);
		expect_grads_near(_metadata, &g, &want, dt, H, i);
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", i);
		for (int w = 0; w < 4; w++) {
			grads one;

			ASSERT_EQ(0, grads_alloc(&one, &c, APE_F32));
			EXPECT_EQ(0, run_backward(&c, self->dev, &one, alone[w], NULL));
			EXPECT_TRUE(same_grads(&one, &g, alone[w]))
				TH_LOG("case %d: output 0x%x alone differs", i, alone[w]);
			grads_free(&one);
		}
		if (c.tp.desc.causal && i % 3 != 1) /* rows 0 and 1 see no key */
			for (int64_t d = 0; d < sh->D; d++) {
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, 0, 0, d));
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, H - 1, 1, d));
			}
		if (ocl) { /* the general sweep on the same case */
			ASSERT_EQ(0, setenv("APE_OCL_BWD_SEP", "0", 1));
			ape_stats_init(&st);
			EXPECT_EQ(0, run_backward(&c, self->dev, &general, W_ALL, &st));
			unsetenv("APE_OCL_BWD_SEP");
			EXPECT_STREQ("backward", st.path) TH_LOG("case %d", i);
			expect_grads_near(_metadata, &general, &want, dt, H, i);
		}
		TH_LOG("case %d: errors dq %.2e dk %.2e dv %.2e dparams %.2e", i,
		       grads_rel_err(&g.dq.t, &want.dq.t), grads_rel_err(&g.dk.t, &want.dk.t),
		       grads_rel_err(&g.dv.t, &want.dv.t),
		       grads_rel_err_params(g.dparams, want.dparams, H));
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		grads_free(&general);
		bcase_free(&c);
	}
}

/*
 * Skipping in the backward pass (docs/kernels.md, "Skipping in the backward pass"): with the
 * seed's parameters (delta = 2^(-4/3), beta = gamma = delta / 10, lambda = 0.1) and skip_tol =
 * 1e-4, long enough rows that whole key tiles lie far behind (causal) or on both sides (the
 * third case: grouped heads and a D no kernel specialises): every
 * gradient within the spec's float32 tolerance of the reference's dense ones, in one launch and
 * in chunks, two runs bit for bit the same; a backend that counts the pairs it computed
 * (OpenCL) computed fewer than are visible, the others at most as many.
 */
TEST_F(bwd, every_backend_skipping_within_tolerance)
{
	/* non-causal; causal; GQA with a D no kernel specialises, fewer queries than keys
	 * (end-aligned: the queries are the last 300 positions) */
	static const test_problem_shape shapes[] = {
		{ 1, 2, 1, 700, 700, 64 },
		{ 1, 2, 1, 700, 700, 64 },
		{ 1, 4, 2, 300, 900, 66 },
	};
	const bool counts = strcmp(variant->backend, "opencl") == 0;
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_BACKWARD))
		SKIP(return, "%s: no backward op (every_backend_against_the_reference checks that)",
		     variant->backend);
	if (self->emu || ape_test_slow())
		SKIP(return, "700 x 700 rows: too long for the emulated device or a slow run");
	ape_rng_init(&rng, "every_backend_skipping_within_tolerance");
	for (int causal = 0; causal < 3; causal++) {
		const test_problem_shape sh = shapes[causal];
		const float delta = (float)pow(2, -4.0 / 3);
		uint64_t visible;
		ape_stats st;
		bcase c;
		grads want, g, again, chunked;

		ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, causal == 0));
		c.tp.desc.delta = (ape_param){ delta, NULL };
		c.tp.desc.beta = c.tp.desc.gamma = (ape_param){ delta / 10, NULL };
		c.tp.desc.lambda = (ape_param){ 0.1f, NULL };
		c.tp.desc.causal = causal != 0;
		c.tp.desc.q_start_set = false; /* end-aligned */
		c.tp.desc.skip_tol = 0;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, APE_F32));
		ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_ALL, NULL));
		c.tp.desc.skip_tol = 1e-4f;
		ape_stats_init(&st);
		EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, &st)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->dev, &again, W_ALL, NULL));
		EXPECT_EQ(0, run_chunked(&c, self->dev, &chunked, 256, 200, NULL))
			TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_visible_pairs(&c.tp.desc, sh.B, sh.H, sh.Lq, sh.Lk, &visible));
		EXPECT_EQ(visible, st.pairs_visible);
		if (counts) {
			EXPECT_LT(st.pairs_computed, visible) TH_LOG("case %d", causal);
		} else {
			EXPECT_LE(st.pairs_computed, visible);
		}
		EXPECT_LT(0u, st.pairs_computed);
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(APE_F32)) TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(APE_F32)) TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(APE_F32)) TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh.H), grads_tol(APE_F32))
			TH_LOG("case %d", causal);
		EXPECT_LE(grads_rel_err(&chunked.dq.t, &want.dq.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&chunked.dk.t, &want.dk.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&chunked.dv.t, &want.dv.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err_params(chunked.dparams, want.dparams, sh.H), grads_tol(APE_F32));
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", causal);
		TH_LOG("case %d: %llu of %llu visible pairs computed; errors dq %.2e dk %.2e dv %.2e "
		       "dparams %.2e",
		       causal, (unsigned long long)st.pairs_computed, (unsigned long long)visible,
		       grads_rel_err(&g.dq.t, &want.dq.t), grads_rel_err(&g.dk.t, &want.dk.t),
		       grads_rel_err(&g.dv.t, &want.dv.t), grads_rel_err_params(g.dparams, want.dparams, sh.H));
		/* a NaN in key 0, either sign (the saved O and LSE stay finite): the bound never
		 * leaves out a key of its head, so it reaches dQ of the last row, 699 keys away,
		 * as in the reference */
		for (int sign = 0; causal == 0 && sign < 2; sign++) {
			const double nan = sign ? -NAN : NAN;

			test_tensor_set(&c.tp.k.t, 0, 0, 0, 0, nan);
			ASSERT_EQ(0, run_backward(&c, self->ref, &want, W_DQ, NULL));
			EXPECT_EQ(0, run_backward(&c, self->dev, &g, W_DQ, NULL));
			EXPECT_TRUE(isnan(test_tensor_get(&want.dq.t, 0, 0, sh.Lq - 1, 0)));
			EXPECT_TRUE(isnan(test_tensor_get(&g.dq.t, 0, 0, sh.Lq - 1, 0)))
				TH_LOG("sign %d", sign);
		}
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		grads_free(&chunked);
		bcase_free(&c);
	}
}

/* ape_attention_backward_ex() of every output of c on dev alone under `budget` device bytes. */
static int budgeted(bcase *c, ape_device *dev, grads *g, uint64_t budget, ape_stats *st)
{
	ape_exec_options eo;

	ape_exec_options_init(&eo);
	eo.max_device_bytes = budget;
	ape_stats_init(st);
	return ape_attention_backward_ex(&dev, 1, &eo, &c->tp.desc, &c->tp.q.t, &c->tp.k.t,
					 &c->tp.v.t, &c->tp.o.t, c->tp.lse, &c->dout.t, c->dlse,
					 &g->dq.t, &g->dk.t, &g->dv.t, g->dparams, st);
}

/* The most scratch one backward launch of dev's backend allocated since the last call (the
 * backends' own counters, core/backend.h attention_backward_scratch); 0 for the reference,
 * which allocates none. */
static uint64_t allocated_scratch(const ape_device *dev)
{
#ifdef APE_HAVE_OPENCL
	if (!strcmp(dev->info.backend, "opencl"))
		return atomic_exchange(&ape__ocl_bwd_scratch_high, 0);
#endif
#ifdef APE_HAVE_CUDA
	if (!strcmp(dev->info.backend, "cuda"))
		return atomic_exchange(&ape__cu_bwd_scratch_high, 0);
#endif
	(void)dev;
	return 0;
}

/* Whether dev reads host memory in place (its capabilities say so). */
static bool wraps_host_memory(const ape_device *dev)
{
	return ape_be_caps_have(&dev->caps, APE_BE_CAP_HOST_MEMORY);
}

/*
 * Every backend with the op, streamed under budgets smaller than one launch needs: the device
 * bytes held at once (every buffer, and the scratch the backend declares for each launch in
 * flight, as the wrapper counts them) stay within the budget and are the peak the statistics
 * report; what a launch allocates is at most what the backend declares for it; the gradients
 * are the one-launch ones. And the check can fail: with the declaration hidden from the core,
 * a budget that holds the buffers of one launch but not its scratch is overrun.
 *
 * The queries are end-aligned (as in rd.statistics_and_budget): with Lq <= Lk every query chunk
 * sees key 0 and every key chunk is seen by the last query, so the problem needs a launch and a
 * plan split either way launches more than one chunk pair. With random offsets the causal mask
 * may hide every pair (no launch to measure) or every pair of a split but one (st.chunks counts
 * launches, never the pairs the mask hides: ape.h), whatever the planner chose; the split itself
 * is checked on the chunk sizes the planner reports.
 *
 * The budgets are those of a device that copies its inputs (buf_wrap hidden): on one that reads
 * host memory in place (the reference, OpenCL CPU devices) one launch holds no input buffer, so
 * its peak is smaller, by the inputs, and is what the wrapper counts too; chunked calls stage.
 */
TEST_F(bwd, streamed_budget_counts_the_backend_scratch)
{
	const test_problem_shape small = { 1, 2, 1, 12, 20, 8 }, larger = { 1, 4, 2, 40, 56, 16 };
	const test_problem_shape *sh = self->emu || ape_test_slow() ? &small : &larger;
	const bool ref = !strcmp(variant->backend, "ref");
	/* chunked against one launch: CHUNK_TOL where the pair terms are float64 (the reference);
	 * the kernels compute them in float32 from rotations seeded at each tile's first key, so
	 * other chunk borders round differently and the spec's tolerance applies (the parameter
	 * sums, over every pair, showed 1e-5 of their largest on the emulated CUDA device) */
	const double ctol = ref ? CHUNK_TOL : grads_tol(APE_F32);
	const bool in_place = wraps_host_memory(self->dev);
	struct wrap_counts wc;
	uint64_t one_peak, declared, allocated, in_place_peak;
	ape_stats st;
	ape_rng rng;
	bcase c;
	grads want, g;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_BACKWARD))
		SKIP(return, "no backward pass on %s", variant->backend);
	ape_rng_init(&rng, "streamed_budget_counts_the_backend_scratch");
	ASSERT_EQ(0, bcase_make(&c, &rng, sh, APE_F32, false, true));
	test_problem_random_params(&c.tp, &rng);
	c.tp.desc.q_start_set = false; /* end-aligned: see above */
	ASSERT_EQ(0, bcase_forward(&c, self->ref));
	ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));

	/* one launch reading its inputs in place where the device can: no input buffer held */
	wrap_install(self->dev, 0);
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, self->dev, &g, W_ALL, &st)) TH_LOG("%s", ape_last_error());
	wc = wrap_get();
	in_place_peak = st.peak_device_bytes;
	EXPECT_EQ(in_place_peak, wc.peak_bytes) TH_LOG("the executor and the wrapper count apart");
	wrap_remove();

	/* one launch with copies: the peak with its scratch */
	wrap_install(self->dev, WRAP_NO_BUF_WRAP);
	allocated_scratch(self->dev);
	ape_stats_init(&st);
	ASSERT_EQ(0, run_backward(&c, self->dev, &want, W_ALL, &st)) TH_LOG("%s", ape_last_error());
	wc = wrap_get();
	one_peak = st.peak_device_bytes;
	declared = wc.bwd_scratch_max;
	allocated = allocated_scratch(self->dev);
	ASSERT_EQ(1u, st.chunks);
	ASSERT_EQ(sh->Lq, st.chunk_q);
	ASSERT_EQ(sh->Lk, st.chunk_k);
	EXPECT_EQ(one_peak, wc.peak_bytes) TH_LOG("the executor and the wrapper count apart");
	EXPECT_LE(allocated, declared) TH_LOG("the backend allocated more than it declared");
	if (ref) {
		EXPECT_EQ(0u, declared);
	} else {
		EXPECT_LT(0u, allocated) TH_LOG("no scratch seen: the counter is broken");
	}
	if (in_place) {
		EXPECT_LT(in_place_peak, one_peak) TH_LOG("inputs copied on a device that wraps");
		/* the same launch, the same bits, whether the inputs were copied or not */
		EXPECT_EQ(0, memcmp(g.dq.alloc, want.dq.alloc, g.dq.alloc_bytes));
		EXPECT_EQ(0, memcmp(g.dk.alloc, want.dk.alloc, g.dk.alloc_bytes));
		EXPECT_EQ(0, memcmp(g.dv.alloc, want.dv.alloc, g.dv.alloc_bytes));
		EXPECT_EQ(0, memcmp(g.dparams, want.dparams, sizeof(float) * 4 * sh->H));
	} else {
		EXPECT_EQ(in_place_peak, one_peak);
	}
	ksft_print_msg("%s: one launch: peak %llu bytes, scratch declared %llu, allocated %llu\n",
		       variant->backend, (unsigned long long)one_peak,
		       (unsigned long long)declared, (unsigned long long)allocated);

	for (int i = 2; i <= 4; i += 2) {
		const uint64_t budget = one_peak / (uint64_t)i;

		wrap_reset();
		ASSERT_EQ(0, budgeted(&c, self->dev, &g, budget, &st)) TH_LOG("%s", ape_last_error());
		wc = wrap_get();
		allocated = allocated_scratch(self->dev);
		EXPECT_TRUE(st.chunk_q < sh->Lq || st.chunk_k < sh->Lk) TH_LOG("not split");
		EXPECT_LT(1u, st.chunks);
		EXPECT_EQ(budget, st.device_budget);
		EXPECT_LE(st.peak_device_bytes, budget);
		EXPECT_LE(wc.peak_bytes, budget) TH_LOG("the backend held more than the budget");
		EXPECT_EQ(st.peak_device_bytes, wc.peak_bytes);
		EXPECT_LE(allocated, wc.bwd_scratch_max);
		EXPECT_EQ(wc.allocs, wc.frees);
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), ctol);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), ctol);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), ctol);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh->H), ctol)
		TH_LOG("dparams rel err %.3g", grads_rel_err_params(g.dparams, want.dparams, sh->H));
		ksft_print_msg("%s: budget %llu: chunks %lld x %lld (%llu), peak %llu, scratch "
			       "declared %llu, allocated %llu\n",
			       variant->backend, (unsigned long long)budget, (long long)st.chunk_q,
			       (long long)st.chunk_k, (unsigned long long)st.chunks,
			       (unsigned long long)st.peak_device_bytes,
			       (unsigned long long)wc.bwd_scratch_max, (unsigned long long)allocated);
	}
	fflush(stdout); /* the harness ends each test with _exit() */

	/* the budget of one launch's buffers alone, the scratch left out of the plan: one launch,
	 * over the budget by its scratch; with the scratch counted, chunks within it */
	if (declared) {
		const uint64_t budget = one_peak - declared;

		wrap_remove();
		wrap_install(self->dev, WRAP_NO_BWD_SCRATCH | WRAP_NO_BUF_WRAP);
		ASSERT_EQ(0, budgeted(&c, self->dev, &g, budget, &st)) TH_LOG("%s", ape_last_error());
		wc = wrap_get();
		EXPECT_EQ(1u, st.chunks);
		EXPECT_EQ(sh->Lq, st.chunk_q);
		EXPECT_EQ(sh->Lk, st.chunk_k);
		EXPECT_EQ(one_peak, wc.peak_bytes);
		EXPECT_GT(wc.peak_bytes, budget);
		wrap_remove();
		wrap_install(self->dev, WRAP_NO_BUF_WRAP);
		ASSERT_EQ(0, budgeted(&c, self->dev, &g, budget, &st)) TH_LOG("%s", ape_last_error());
		wc = wrap_get();
		EXPECT_TRUE(st.chunk_q < sh->Lq || st.chunk_k < sh->Lk) TH_LOG("not split");
		EXPECT_LT(1u, st.chunks);
		EXPECT_LE(wc.peak_bytes, budget);
	}

	/* too small for one row each way: the message counts the scratch */
	EXPECT_EQ(APE_ENOMEM, budgeted(&c, self->dev, &g, 64, &st));
	EXPECT_NE(NULL, strstr(ape_last_error(), " of them the backend's scratch)"))
		TH_LOG("%s", ape_last_error());
	grads_free(&want);
	grads_free(&g);
	bcase_free(&c);
}

/* ---------------------------------------------------------------- distance-bias tables */

/* The bytes of a case's table's gradient: its rows times its entries, float32. */
static size_t dbias_bytes(const bcase *c)
{
	return sizeof(float) * (size_t)(c->tp.desc.bias_table_heads * c->tp.desc.bias_table_len);
}

/* The gradient of a case's table, NaN until a call writes it. */
static float *dbias_alloc(const bcase *c)
{
	const size_t n = dbias_bytes(c) / sizeof(float);
	float *g = malloc(sizeof(float) * n);

	for (size_t i = 0; g && i < n; i++)
		g[i] = NAN;
	return g;
}

/* run_backward() (run_chunked() when cq > 0) with the table's gradient into db (NULL: none). */
static int run_table(bcase *c, ape_device *dev, grads *g, unsigned wanted, float *db, int64_t cq,
		     int64_t ck, ape_stats *st)
{
	int ret;

	c->tp.desc.dbias_table = db;
	ret = cq > 0 ? run_chunked(c, dev, g, cq, ck, st) : run_backward(c, dev, g, wanted, st);
	c->tp.desc.dbias_table = NULL;
	return ret;
}

/* A device that cannot take tables: the tests below skip (APE_ENOTSUP there is the core's). */
static bool takes_tables(const ape_device *dev)
{
	return ape_be_caps_have(&dev->caps, APE_BE_CAP_BACKWARD) &&
	       ape_be_caps_have(&dev->caps, APE_BE_CAP_BIAS_TABLE);
}

/*
 * Every backend that takes distance-bias tables, against the reference on random tables
 * (test_problem_random_table(): T5 buckets, Gaussian, rising again far away, random; per head or
 * shared; shorter or longer than the distances), the O and LSE the reference's forward saved:
 * dQ, dK, dV, the parameters' and the table's gradients at the spec's tolerances on every
 * storage type, GQA and MQA, both layouts, causal or not, D specialised or not, key counts
 * across several sweep splits, distances near 2^40, in one launch and in chunks; a shared table
 * (one row for every head: its gradient sums the heads) and a table of at most three entries
 * forced every few cases; two runs bit for bit the same; the table's gradient alone bit for bit
 * as with every output; without asking for it, the other gradients as with it; the scratch a
 * launch allocates within what the backend declares.
 */
TEST_F(bwd, every_backend_bias_table)
{
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 33, 47, 16 }, /* GQA */
		{ 1, 2, 1, 37, 200, 64 }, /* 13 blocks of 16 keys: splits */
		{ 2, 3, 1, 20, 70, 128 }, /* MQA, blocks of 16 */
		{ 1, 2, 2, 23, 97, 10 }, /* a D no kernel specialises */
	};
	const int ncases = self->emu || ape_test_slow() ? 6 : 16;
	ape_rng rng;

	if (!takes_tables(self->dev))
		SKIP(return, "%s: no backward pass with distance-bias tables", variant->backend);
	ape_rng_init(&rng, "every_backend_bias_table");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % 4];
		const ape_dtype dt = types[i / 4 % 3];
		float *want_db, *db, *again_db, *chunked_db, *alone_db;
		grads want, g, again, chunked, alone, nodb;
		bcase c;

		/* with dLSE: without it each row's dS sum to 0 (sum_j P_ij = 1), so that a table
		 * of one entry, or distances all past the last, has a gradient of rounding errors
		 * only */
		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, false, true));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i % 5 < 3;
		c.tp.desc.q_start = c.tp.desc.k_start + (i % 3) * 7 - 5;
		c.tp.desc.q_start_set = true;
		ASSERT_EQ(0, test_problem_random_table(&c.tp, &rng));
		if (i % 4 == 1) /* row 0 for every head */
			c.tp.desc.bias_table_heads = 1;
		if (i % 4 == 2 && c.tp.desc.bias_table_len > 3) /* most distances read the last */
			c.tp.desc.bias_table_len = 3;
		if (i % 8 == 5) /* every distance near 2^40: the last entry */
			c.tp.desc.q_start = c.tp.desc.k_start + ((int64_t)1 << 40);
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&alone, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&nodb, &c, APE_F32));
		want_db = dbias_alloc(&c);
		db = dbias_alloc(&c);
		again_db = dbias_alloc(&c);
		chunked_db = dbias_alloc(&c);
		alone_db = dbias_alloc(&c);
		ASSERT_TRUE(want_db && db && again_db && chunked_db && alone_db);
		ASSERT_EQ(0, run_table(&c, self->ref, &want, W_ALL, want_db, 0, 0, NULL))
			TH_LOG("%s", ape_last_error());
		/* what the launch allocates, its table's scratch included, within what it declares */
		wrap_install(self->dev, 0);
		allocated_scratch(self->dev);
		EXPECT_EQ(0, run_table(&c, self->dev, &g, W_ALL, db, 0, 0, NULL))
			TH_LOG("%s", ape_last_error());
		EXPECT_LE(allocated_scratch(self->dev), wrap_get().bwd_scratch_max) TH_LOG("case %d", i);
		wrap_remove();
		EXPECT_EQ(0, run_table(&c, self->dev, &again, W_ALL, again_db, 0, 0, NULL));
		EXPECT_EQ(0, run_table(&c, self->dev, &chunked, W_ALL, chunked_db, 7, 16, NULL))
			TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_table(&c, self->dev, &alone, 0, alone_db, 0, 0, NULL))
			TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_table(&c, self->dev, &nodb, W_ALL, NULL, 0, 0, NULL));
		expect_grads_near(_metadata, &g, &want, dt, sh->H, i);
		EXPECT_LE(bcase_dbias_rel_err(&c, db, want_db), grads_tol(dt))
			TH_LOG("case %d: dbias rel err %.3g (%lld rows of %lld)", i,
			       bcase_dbias_rel_err(&c, db, want_db), (long long)c.tp.desc.bias_table_heads,
			       (long long)c.tp.desc.bias_table_len);
		EXPECT_LE(grads_rel_err(&chunked.dq.t, &want.dq.t), grads_tol(dt)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&chunked.dk.t, &want.dk.t), grads_tol(dt)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&chunked.dv.t, &want.dv.t), grads_tol(dt)) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(chunked.dparams, want.dparams, sh->H), grads_tol(dt))
			TH_LOG("case %d", i);
		EXPECT_LE(bcase_dbias_rel_err(&c, chunked_db, want_db), grads_tol(dt))
			TH_LOG("case %d: chunked dbias rel err %.3g", i,
			       bcase_dbias_rel_err(&c, chunked_db, want_db));
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", i);
		EXPECT_EQ(0, memcmp(db, again_db, dbias_bytes(&c))) TH_LOG("case %d: reruns differ", i);
		EXPECT_EQ(0, memcmp(db, alone_db, dbias_bytes(&c))) TH_LOG("case %d: alone differs", i);
		EXPECT_TRUE(same_grads(&g, &nodb, W_ALL)) TH_LOG("case %d: without dbias differs", i);
		free(want_db);
		free(db);
		free(again_db);
		free(chunked_db);
		free(alone_db);
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		grads_free(&chunked);
		grads_free(&alone);
		grads_free(&nodb);
		bcase_free(&c);
	}
}

/*
 * Skipping with a table (every decay >= 0, skip_tol 1e-4, the seed's parameters as in
 * every_backend_skipping_within_tolerance): the bound adds the table's suffix maximum at each
 * granule's nearest distance. A table that falls (a Gaussian -n^2 / 2000): the backend that
 * counts its pairs (OpenCL) leaves keys out, and every gradient stays within the spec's
 * tolerance of the reference's; a table that rises again far away, as much as the decay takes
 * there and more (the far keys then carry most of each row's weight): within tolerance too, which
 * a bound without the table, leaving the far keys out, would miss by far. Both sides (not
 * causal), per-head and shared, in one launch and in chunks.
 */
TEST_F(bwd, every_backend_bias_table_skipping)
{
	const test_problem_shape sh = { 1, 2, 1, 400, 400, 64 };
	const bool counts = strcmp(variant->backend, "opencl") == 0;
	const float delta = (float)pow(2, -4.0 / 3);
	ape_rng rng;

	if (!takes_tables(self->dev))
		SKIP(return, "%s: no backward pass with distance-bias tables", variant->backend);
	if (self->emu || ape_test_slow())
		SKIP(return, "400 x 400 rows: too long for the emulated device or a slow run");
	ape_rng_init(&rng, "every_backend_bias_table_skipping");
	for (int kind = 0; kind < 4; kind++) {
		const int64_t M = 450, rows = kind & 1 ? 1 : sh.H;
		const bool rising = kind >= 2;
		float *table = malloc(sizeof(float) * (size_t)(rows * M));
		float *want_db, *db, *chunked_db;
		uint64_t visible;
		ape_stats st;
		grads want, g, chunked;
		bcase c;

		ASSERT_NE(NULL, table);
		for (int64_t h = 0; h < rows; h++)
			for (int64_t m = 0; m < M; m++)
				table[h * M + m] = rising ? (m < 250 ? -0.01f * (float)(m + h)
								: delta * (float)m + 3.0f)
							  : -(float)(m * m) / 2000.0f - 0.1f * (float)h;
		ASSERT_EQ(0, bcase_make(&c, &rng, &sh, APE_F32, false, kind == 0));
		c.tp.bias_table = table; /* owned by the case */
		c.tp.desc.bias_table = table;
		c.tp.desc.bias_table_len = M;
		c.tp.desc.bias_table_heads = rows;
		c.tp.desc.delta = (ape_param){ delta, NULL };
		c.tp.desc.beta = c.tp.desc.gamma = (ape_param){ delta / 10, NULL };
		c.tp.desc.lambda = (ape_param){ 0.1f, NULL };
		c.tp.desc.causal = false;
		c.tp.desc.q_start_set = false;
		c.tp.desc.skip_tol = 0;
		ASSERT_EQ(0, bcase_forward(&c, self->ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, APE_F32));
		want_db = dbias_alloc(&c);
		db = dbias_alloc(&c);
		chunked_db = dbias_alloc(&c);
		ASSERT_TRUE(want_db && db && chunked_db);
		ASSERT_EQ(0, run_table(&c, self->ref, &want, W_ALL, want_db, 0, 0, NULL));
		c.tp.desc.skip_tol = 1e-4f;
		ape_stats_init(&st);
		EXPECT_EQ(0, run_table(&c, self->dev, &g, W_ALL, db, 0, 0, &st))
			TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_table(&c, self->dev, &chunked, W_ALL, chunked_db, 256, 200, NULL))
			TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_visible_pairs(&c.tp.desc, sh.B, sh.H, sh.Lq, sh.Lk, &visible));
		if (counts && !rising)
			EXPECT_LT(st.pairs_computed, visible) TH_LOG("kind %d", kind);
		EXPECT_LE(st.pairs_computed, visible);
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), grads_tol(APE_F32)) TH_LOG("kind %d", kind);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), grads_tol(APE_F32)) TH_LOG("kind %d", kind);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), grads_tol(APE_F32)) TH_LOG("kind %d", kind);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh.H), grads_tol(APE_F32))
			TH_LOG("kind %d", kind);
		EXPECT_LE(bcase_dbias_rel_err(&c, db, want_db), grads_tol(APE_F32)) TH_LOG("kind %d", kind);
		EXPECT_LE(grads_rel_err(&chunked.dq.t, &want.dq.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&chunked.dk.t, &want.dk.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err(&chunked.dv.t, &want.dv.t), grads_tol(APE_F32));
		EXPECT_LE(grads_rel_err_params(chunked.dparams, want.dparams, sh.H), grads_tol(APE_F32));
		EXPECT_LE(bcase_dbias_rel_err(&c, chunked_db, want_db), grads_tol(APE_F32));
		TH_LOG("kind %d: %llu of %llu visible pairs computed; errors dq %.2e dk %.2e dv %.2e "
		       "dparams %.2e dbias %.2e",
		       kind, (unsigned long long)st.pairs_computed, (unsigned long long)visible,
		       grads_rel_err(&g.dq.t, &want.dq.t), grads_rel_err(&g.dk.t, &want.dk.t),
		       grads_rel_err(&g.dv.t, &want.dv.t),
		       grads_rel_err_params(g.dparams, want.dparams, sh.H),
		       bcase_dbias_rel_err(&c, db, want_db));
		free(want_db);
		free(db);
		free(chunked_db);
		grads_free(&want);
		grads_free(&g);
		grads_free(&chunked);
		bcase_free(&c);
	}
}

TEST_HARNESS_MAIN
