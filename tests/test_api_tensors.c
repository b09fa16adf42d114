/* SPDX-License-Identifier: MIT */
/*
 * The public API's contract, ape.h's sections "Data types and tensors", "Attention descriptor"
 * and the statistics of "Attention": what the initialisers set, the storage types' sizes and
 * names, and row views of a tensor (ape_tensor_rows()).
 */
#include <stdint.h>
#include <string.h>

#include "ape_test.h"

/* ---------------------------------------------------------------- initialisers */

TEST(attn_desc_defaults)
{
	ape_attn_desc d;

	memset(&d, 0x5a, sizeof(d));
	ape_attn_desc_init(&d);
	EXPECT_EQ(sizeof(d), d.struct_size);
	EXPECT_TRUE(d.delta.value == 0.0f && d.beta.value == 0.0f && d.gamma.value == 0.0f &&
		    d.lambda.value == 0.0f);
	EXPECT_EQ(NULL, d.delta.per_head);
	EXPECT_EQ(NULL, d.beta.per_head);
	EXPECT_EQ(NULL, d.gamma.per_head);
	EXPECT_EQ(NULL, d.lambda.per_head);
	EXPECT_TRUE(d.rope_base == 10000.0) TH_LOG("rope_base %g", d.rope_base);
	EXPECT_FALSE(d.scale_set);
	EXPECT_TRUE(d.causal);
	EXPECT_EQ(APE_ROPE_HALF, d.layout);
	EXPECT_EQ(0, d.k_start);
	EXPECT_FALSE(d.q_start_set);
	EXPECT_TRUE(d.skip_tol == 0x1p-24) TH_LOG("skip_tol %g", d.skip_tol);
}

TEST(stats_init_zeroes)
{
	ape_stats st, zero;

	memset(&st, 0x5a, sizeof(st));
	ape_stats_init(&st);
	memset(&zero, 0, sizeof(zero));
	zero.struct_size = sizeof(zero);
	EXPECT_EQ(sizeof(st), st.struct_size);
	EXPECT_EQ(0u, st.pairs_visible);
	EXPECT_EQ(0u, st.pairs_computed);
	EXPECT_TRUE(st.kernel_ms == 0 && st.total_ms == 0);
	EXPECT_EQ(0, memcmp(&zero, &st, sizeof(st)));
}

TEST(tensor_init_and_dtypes)
{
	ape_tensor t;
	float buf[4];

	memset(&t, 0x5a, sizeof(t));
	ape_tensor_init(&t, buf, APE_BF16, 2, 3, 5, 7);
	EXPECT_EQ((void *)buf, t.data);
	EXPECT_EQ(APE_BF16, t.dtype);
	EXPECT_EQ(2, t.shape[0]);
	EXPECT_EQ(3, t.shape[1]);
	EXPECT_EQ(5, t.shape[2]);
	EXPECT_EQ(7, t.shape[3]);
	for (int d = 0; d < 4; d++) {
		EXPECT_EQ(0, t.strides[d]);
	}

	EXPECT_EQ(4u, ape_dtype_size(APE_F32));
	EXPECT_EQ(2u, ape_dtype_size(APE_F16));
	EXPECT_EQ(2u, ape_dtype_size(APE_BF16));
	EXPECT_EQ(0u, ape_dtype_size((ape_dtype)7));
	EXPECT_STREQ("f32", ape_dtype_name(APE_F32));
	EXPECT_STREQ("f16", ape_dtype_name(APE_F16));
	EXPECT_STREQ("bf16", ape_dtype_name(APE_BF16));
	EXPECT_STREQ("?", ape_dtype_name((ape_dtype)7));
}

TEST(tensor_rows_view)
{
	uint16_t buf[2 * 3 * 5 * 4];
	ape_tensor t, v;

	ape_tensor_init(&t, buf, APE_F16, 2, 3, 5, 4);
	ASSERT_EQ(0, ape_tensor_rows(&t, 1, 3, &v));
	EXPECT_EQ((void *)(buf + 4), v.data);
	EXPECT_EQ(3, v.shape[2]);
	EXPECT_EQ(60, v.strides[0]);
	EXPECT_EQ(20, v.strides[1]);
	EXPECT_EQ(4, v.strides[2]);
	EXPECT_EQ(1, v.strides[3]);
	/* a view of a view keeps the parent's strides */
	ASSERT_EQ(0, ape_tensor_rows(&v, 2, 1, &v));
	EXPECT_EQ((void *)(buf + 12), v.data);
	EXPECT_EQ(20, v.strides[1]);
	/* the empty ranges at either end are views too */
	EXPECT_EQ(0, ape_tensor_rows(&t, 0, 0, &v));
	EXPECT_EQ(0, ape_tensor_rows(&t, 5, 0, &v));

	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 4, 2, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "rows [4, 4 + 2) are not inside [0, 5)"));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, -1, 1, &v));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 6, 0, &v));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 1, INT64_MAX, &v));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(NULL, 0, 1, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "t is NULL"));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 0, 1, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "out is NULL"));
	t.strides[1] = -3;
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 0, 1, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "t->strides[1] = -3"));
	t.strides[1] = 0;
	t.dtype = (ape_dtype)9;
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 0, 1, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "t->dtype = 9"));
}

TEST_HARNESS_MAIN
