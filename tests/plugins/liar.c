/* SPDX-License-Identifier: MIT */
/*
 * A backend plugin that states what it does not do (tests/test_ape_check.c,
 * "a_stated_capability_refused_fails"): the example plugin's table (LIAR_OF, its shared object,
 * opened here), renamed "liar", whose backward op refuses with APE_ENOTSUP although its devices
 * state APE_BE_CAP_BACKWARD, and whose forward drops the distance-bias table although they
 * state APE_BE_CAP_BIAS_TABLE (the example's capabilities, kept). Everything else is the
 * example's, so the forward computes and the backward cells run: ape-check must fail them ("the
 * device states backward, yet: ..."), and the table cells (wrong results, or the refused
 * backward), not count them as not claimed.
 */
#include <dlfcn.h>
#include <stddef.h>

#include "ape/ape_backend.h"

static struct ape_backend_plugin liar;
static void *example;
static int (*forward)(struct ape_be_queue *q, const struct ape_be_launch *l);

/* The example's forward, as if the launch had no table. */
static int liar_attention(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	struct ape_be_launch untabled = *l;

	untabled.bias_table = untabled.bias_smax = NULL;
	untabled.bias_len = untabled.bias_hstride = 0;
	return forward(q, &untabled);
}

static int liar_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	(void)q;
	(void)l;
	return ape_be_error(APE_ENOTSUP, "liar: no backward after all");
}

const struct ape_backend_plugin *ape_backend_plugin(void)
{
	ape_backend_plugin_fn entry;
	const struct ape_backend_plugin *t;
	void *sym;

	if (!example && !(example = dlopen(LIAR_OF, RTLD_NOW | RTLD_LOCAL)))
		return NULL;
	sym = dlsym(example, APE_BACKEND_PLUGIN_SYMBOL);
	if (!sym)
		return NULL;
	*(void **)&entry = sym;
	t = entry();
	if (!t || t->struct_size != sizeof(liar))
		return NULL;
	liar = *t;
	liar.name = "liar";
	forward = t->attention;
	liar.attention = liar_attention;
	liar.attention_backward = liar_backward;
	return &liar;
}
