/* SPDX-License-Identifier: MIT */
/* attention_merge (core/backend.h): kernels/attention.cl's ape_merge, one work-item per row. */
#include <string.h>

#include "ocl.h"

int ape__ocl_attention_merge(struct ape_be_queue *q, const struct ape_be_merge *m)
{
	struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	const cl_mem none = NULL;
	const cl_long rows = m->rows, D = m->D;
	const cl_int flags = (m->pairs ? 1 : 0) | (m->ent ? 2 : 0) | (m->pairs && m->pairs32 ? 4 : 0);
	const size_t local = od->max_wg >= 64 ? 64 : 1;
	const struct ape__ocl_program *pr;
	struct ape__ocl_args a;
	int ret;

	if (!rows)
		return 0;
	if ((ret = ape__ocl_program_get(q->dev, m->D, &pr)))
		return ret;
	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_merge", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &m->o->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &m->lse->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), m->pairs ? &m->pairs->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), m->ent ? &m->ent->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), m->md ? &m->md->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), &m->po->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &m->plse->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), m->pairs ? &m->ppairs->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), m->ent ? &m->pent->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), m->md ? &m->pmd->mem : &none);
	ape__ocl_arg(&a, sizeof(rows), &rows);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	if (a.err != CL_SUCCESS)
		ret = ape__ocl_error(a.err, "setting up ape_merge");
	else /* rows rounded up: the kernel ignores the excess; PoCL wants whole work-groups */
		ret = ape__ocl_enqueue(q, a.k, ((size_t)rows + local - 1) / local * local, local, 1,
				       "ape_merge");
	if (a.k)
		clReleaseKernel(a.k);
	return ret;
}
