/* SPDX-License-Identifier: MIT */
#include "ape_test.h"

TEST(ref_runs)
{
	ape_context *ctx = test_context("ref");
	ape_device *dev = test_device(ctx, "ref");
	ape_attn_desc desc;
	test_tensor q, k, v, o;
	ape_rng rng;
	float lse[8];

	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "ref_runs");
	ape_attn_desc_init(&desc);
	ASSERT_EQ(0, test_tensor_random(&q, &rng, APE_F32, 1, 2, 4, 8, 1.0));
	ASSERT_EQ(0, test_tensor_random(&k, &rng, APE_F32, 1, 1, 4, 8, 1.0));
	ASSERT_EQ(0, test_tensor_random(&v, &rng, APE_F32, 1, 1, 4, 8, 1.0));
	ASSERT_EQ(0, test_tensor_empty(&o, APE_F32, 1, 2, 4, 8));
	ASSERT_EQ(0, ape_attention_forward(dev, &desc, &q.t, &k.t, &v.t, &o.t, lse, NULL))
		TH_LOG("%s", ape_last_error());
	test_tensor_free(&q);
	test_tensor_free(&k);
	test_tensor_free(&v);
	test_tensor_free(&o);
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
