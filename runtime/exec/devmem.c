/* SPDX-License-Identifier: MIT */
#include "exec/devmem.h"

#include <inttypes.h>

#include "core/error.h"

void ape__devmem_init(struct ape__devmem *m, struct ape_device *dev, uint64_t budget)
{
	m->dev = dev;
	m->budget = budget;
	m->cur = m->peak = m->allocs = 0;
}

static void count(struct ape__devmem *m, uint64_t bytes)
{
	m->cur += bytes;
	if (m->cur > m->peak)
		m->peak = m->cur;
}

int ape__devmem_alloc(struct ape__devmem *m, uint64_t bytes, struct ape_be_buf **out,
		      const char *what)
{
	int ret;

	*out = NULL;
	/* the plan keeps below the budget; this only catches a plan that did not */
	if (bytes > m->budget || m->cur > m->budget - bytes)
		return ape__error(APE_ENOMEM,
				  "%s (%" PRIu64 " bytes) would take device memory to %" PRIu64
				  " bytes, over the budget of %" PRIu64,
				  what, bytes, m->cur + bytes, m->budget);
	if (bytes > SIZE_MAX)
		return ape__error(APE_ENOMEM, "%s: %" PRIu64 " bytes do not fit in memory", what,
				  bytes);
	m->allocs++;
	ret = m->dev->be->ops->buf_alloc(m->dev, (size_t)(bytes ? bytes : 1), out);
	if (ret) {
		*out = NULL;
		return ape__error_prefix(ret, what);
	}
	count(m, bytes);
	return 0;
}

void ape__devmem_free(struct ape__devmem *m, struct ape_be_buf **b, uint64_t bytes)
{
	if (!*b)
		return;
	m->dev->be->ops->buf_free(m->dev, *b);
	*b = NULL;
	m->cur -= bytes;
}

void ape__devmem_hold(struct ape__devmem *m, uint64_t bytes)
{
	count(m, bytes);
}

void ape__devmem_drop(struct ape__devmem *m, uint64_t bytes)
{
	m->cur -= bytes;
}
