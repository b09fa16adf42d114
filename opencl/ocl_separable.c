/* SPDX-License-Identifier: MIT */
#include "ocl_fast.h"

bool ape__ocl_separable_applies(struct ape_device *dev, const struct ape__launch *l)
{
	(void)dev;
	(void)l;
	return false;
}

int ape__ocl_separable(struct ape__queue *q, const struct ape__launch *l)
{
	(void)q;
	(void)l;
	return APE_ENOTSUP;
}

uint64_t ape__ocl_separable_scratch(struct ape_device *dev, const struct ape__launch *l)
{
	(void)dev;
	(void)l;
	return 0;
}
