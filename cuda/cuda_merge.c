/* SPDX-License-Identifier: MIT */
/* attention_merge (core/backend.h): kernels/prep.cu's ape_lmerge, one thread per row. */
#include "cu.h"

static uint64_t ptr_of(const struct ape_be_buf *b)
{
	return b ? (uint64_t)b->ptr : 0;
}

int ape__cu_attention_merge(struct ape_be_queue *q, const struct ape_be_merge *m)
{
	const struct ape_cu_lmerge_args a = {
		.o = ptr_of(m->o), .lse = ptr_of(m->lse), .pairs = ptr_of(m->pairs),
		.ent = ptr_of(m->ent), .md = ptr_of(m->md),
		.po = ptr_of(m->po), .plse = ptr_of(m->plse), .ppairs = ptr_of(m->ppairs),
		.pent = ptr_of(m->pent), .pmd = ptr_of(m->pmd),
		.rows = m->rows, .D = m->D, .pairs32 = m->pairs32,
	};

	return ape__cu_run_threads(q, APE__CU_K_LMERGE, a.rows, (void *)&a, "attention_merge");
}
