/* SPDX-License-Identifier: MIT */
/*
 * The struct_size values ape.h documents for the versioned structs of a forward call: ape_stats
 * takes its size or APE_STATS_V1_SIZE (then nothing past the old fields is written), from
 * ape_attention_forward() and ape_kv_cache_attend() alike; ape_exec_options takes its size only;
 * ape_attn_desc its size or APE_ATTN_DESC_V1_SIZE (the layout before explicit positions).
 */
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"

enum { B = 1, H = 2, L = 8, D = 8 };

FIXTURE(fwd)
{
	ape_context *ctx;
	ape_device *dev;
	float q[B * H * L * D], k[B * H * L * D], v[B * H * L * D], o[B * H * L * D];
	ape_tensor tq, tk, tv, to;
	ape_attn_desc desc;
};

FIXTURE_SETUP(fwd)
{
	for (int i = 0; i < B * H * L * D; i++)
		self->q[i] = self->k[i] = self->v[i] = (float)((i * 37) % 11) / 11.0f - 0.5f;
	self->ctx = test_context("ref");
	self->dev = test_device(self->ctx, "ref");
	ape_tensor_init(&self->tq, self->q, APE_F32, B, H, L, D);
	ape_tensor_init(&self->tk, self->k, APE_F32, B, H, L, D);
	ape_tensor_init(&self->tv, self->v, APE_F32, B, H, L, D);
	ape_tensor_init(&self->to, self->o, APE_F32, B, H, L, D);
	ape_attn_desc_init(&self->desc);
}

FIXTURE_TEARDOWN(fwd)
{
	ape_context_destroy(self->ctx);
}

/* An ape_stats of the old size inside a full-size buffer of 0xab bytes. */
static ape_stats *old_stats(void)
{
	ape_stats *st = malloc(sizeof(*st));

	if (st) {
		memset(st, 0xab, sizeof(*st));
		st->struct_size = APE_STATS_V1_SIZE;
	}
	return st;
}

static size_t written_past_v1(const ape_stats *st)
{
	size_t n = 0;

	for (size_t i = APE_STATS_V1_SIZE; i < sizeof(*st); i++)
		n += ((const unsigned char *)st)[i] != 0xab;
	return n;
}

TEST_F(fwd, stats_v1_size_gets_the_old_fields_only)
{
	ape_stats *st = old_stats();

	ASSERT_NE(NULL, st);
	ASSERT_EQ(0, ape_attention_forward(self->dev, &self->desc, &self->tq, &self->tk, &self->tv,
					   &self->to, NULL, st))
		TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_STATS_V1_SIZE, st->struct_size);
	EXPECT_EQ((uint64_t)(B * H * L * (L + 1) / 2), st->pairs_visible);
	EXPECT_STREQ("ref", st->backend);
	EXPECT_EQ(0u, written_past_v1(st));
	free(st);
}

/* A KV cache of the fixture's shape holding its keys and values; NULL on failure. */
static ape_kv_cache *filled_cache(ape_device *dev, const ape_tensor *k, const ape_tensor *v)
{
	ape_kv_cache_options ko;
	ape_kv_cache *cache;

	ape_kv_cache_options_init(&ko);
	ko.B = B;
	ko.Hkv = H;
	ko.D = D;
	ko.dtype = APE_F32;
	ko.capacity_tokens = L;
	ko.max_queries = L;
	if (ape_kv_cache_create(dev, &ko, &cache))
		return NULL;
	if (ape_kv_cache_append(cache, k, v)) {
		ape_kv_cache_destroy(cache);
		return NULL;
	}
	return cache;
}

TEST_F(fwd, stats_v1_size_through_a_kv_cache)
{
	ape_kv_cache *cache;
	ape_stats *st = old_stats();

	ASSERT_NE(NULL, st);
	cache = filled_cache(self->dev, &self->tk, &self->tv);
	ASSERT_NE(NULL, cache) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ape_kv_cache_attend(cache, &self->desc, &self->tq, &self->to, NULL, st))
		TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_STATS_V1_SIZE, st->struct_size);
	EXPECT_EQ((uint64_t)(B * H * L * (L + 1) / 2), st->pairs_visible);
	EXPECT_EQ(0u, written_past_v1(st));
	st->struct_size = APE_STATS_V1_SIZE + 8;
	EXPECT_EQ(APE_EINVAL, ape_kv_cache_attend(cache, &self->desc, &self->tq, &self->to, NULL,
						  st));
	EXPECT_NE(NULL, strstr(ape_last_error(), "stats->struct_size")) TH_LOG("%s",
									     ape_last_error());
	ape_kv_cache_destroy(cache);
	free(st);
}

TEST_F(fwd, other_stats_sizes_are_refused)
{
	const size_t sizes[] = { 0, APE_STATS_V1_SIZE - 8, APE_STATS_V1_SIZE + 8,
				 sizeof(ape_stats) - 8, sizeof(ape_stats) + 8 };
	ape_stats st;

	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		ape_stats_init(&st);
		st.struct_size = sizes[i];
		EXPECT_EQ(APE_EINVAL, ape_attention_forward(self->dev, &self->desc, &self->tq,
							    &self->tk, &self->tv, &self->to, NULL,
							    &st))
			TH_LOG("struct_size %zu", sizes[i]);
		EXPECT_NE(NULL, strstr(ape_last_error(), "stats->struct_size"));
	}
}

/* One layout so far: every size but its own is refused, the older-looking ones too. */
TEST_F(fwd, exec_options_take_their_own_size_only)
{
	const size_t sizes[] = { 0, sizeof(size_t), sizeof(ape_exec_options) - 1,
				 sizeof(ape_exec_options) - sizeof(void *),
				 sizeof(ape_exec_options) + 8 };
	ape_exec_options eo;

	ape_exec_options_init(&eo);
	EXPECT_EQ(sizeof(eo), eo.struct_size);
	EXPECT_EQ(0, ape_attention_forward_ex(&self->dev, 1, &eo, &self->desc, &self->tq,
					      &self->tk, &self->tv, &self->to, NULL, NULL))
		TH_LOG("%s", ape_last_error());
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		ape_exec_options_init(&eo);
		eo.struct_size = sizes[i];
		EXPECT_EQ(APE_EINVAL, ape_attention_forward_ex(&self->dev, 1, &eo, &self->desc,
							       &self->tq, &self->tk, &self->tv,
							       &self->to, NULL, NULL))
			TH_LOG("struct_size %zu", sizes[i]);
		EXPECT_NE(NULL, strstr(ape_last_error(), "opts->struct_size"));
	}
}

/* An ape_attn_desc of the first layout (APE_ATTN_DESC_V1_SIZE, before pos_q and pos_k) in an
 * allocation of just that size: taken by the forward, backward, pair-count, ragged and KV-cache
 * calls, the implicit positions, nothing read past it (a sanitizer build proves the last). */
TEST_F(fwd, attn_desc_v1_size_is_taken_and_read_no_further)
{
	unsigned char *buf = malloc(APE_ATTN_DESC_V1_SIZE);
	const ape_attn_desc *d = (const ape_attn_desc *)buf;
	size_t size = APE_ATTN_DESC_V1_SIZE;
	float o2[B * H * L * D], lse[2][B * H * L], dq[B * H * L * D], dp[4 * H];
	int64_t cu[2] = { 0, L };
	ape_kv_cache *cache;
	ape_varlen vl;
	ape_tensor t2, tdq;
	uint64_t pairs;

	ASSERT_NE(NULL, buf);
	memcpy(buf, &self->desc, APE_ATTN_DESC_V1_SIZE);
	memcpy(buf, &size, sizeof(size)); /* struct_size, the first field */
	ape_tensor_init(&t2, o2, APE_F32, B, H, L, D);
	ape_tensor_init(&tdq, dq, APE_F32, B, H, L, D);
	ASSERT_EQ(0, ape_attention_forward(self->dev, &self->desc, &self->tq, &self->tk,
					   &self->tv, &self->to, lse[0], NULL));
	ASSERT_EQ(0, ape_attention_forward(self->dev, d, &self->tq, &self->tk, &self->tv, &t2,
					   lse[1], NULL))
		TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(self->o, o2, sizeof(o2)));
	EXPECT_EQ(0, memcmp(lse[0], lse[1], sizeof(lse[0])));
	EXPECT_EQ(0, ape_attention_backward(self->dev, d, &self->tq, &self->tk, &self->tv, &t2,
					    lse[1], &self->tq, NULL, &tdq, NULL, NULL, dp, NULL))
		TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_visible_pairs(d, B, H, L, L, &pairs)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ((uint64_t)(B * H * L * (L + 1) / 2), pairs);
	ape_varlen_init(&vl);
	vl.num_seqs = 1;
	vl.cu_seqlens_q = cu;
	vl.cu_seqlens_k = cu;
	EXPECT_EQ(0, ape_attention_forward_varlen(self->dev, d, &vl, &self->tq, &self->tk,
						  &self->tv, &t2, NULL, NULL))
		TH_LOG("%s", ape_last_error());
	cache = filled_cache(self->dev, &self->tk, &self->tv);
	ASSERT_NE(NULL, cache) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ape_kv_cache_attend(cache, d, &self->tq, &t2, NULL, NULL))
		TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, memcmp(self->o, o2, sizeof(o2)));
	ape_kv_cache_destroy(cache);
	size += 8;
	memcpy(buf, &size, sizeof(size));
	EXPECT_EQ(APE_EINVAL, ape_attention_forward(self->dev, d, &self->tq, &self->tk, &self->tv,
						    &t2, NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "desc->struct_size"));
	free(buf);
}

TEST_HARNESS_MAIN
