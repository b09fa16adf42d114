/* SPDX-License-Identifier: MIT */
/*
 * The struct_size values ape.h documents for the versioned structs of a forward call: ape_stats
 * takes its size or APE_STATS_V1_SIZE (then nothing past the old fields is written), from
 * ape_attention_forward() and ape_kv_cache_attend() alike; ape_exec_options takes its size only.
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

TEST_F(fwd, stats_v1_size_through_a_kv_cache)
{
	ape_kv_cache_options ko;
	ape_kv_cache *cache;
	ape_stats *st = old_stats();

	ASSERT_NE(NULL, st);
	ape_kv_cache_options_init(&ko);
	ko.B = B;
	ko.Hkv = H;
	ko.D = D;
	ko.dtype = APE_F32;
	ko.capacity_tokens = L;
	ko.max_queries = L;
	ASSERT_EQ(0, ape_kv_cache_create(self->dev, &ko, &cache)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_kv_cache_append(cache, &self->tk, &self->tv));
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

TEST_HARNESS_MAIN
