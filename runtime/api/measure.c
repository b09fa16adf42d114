/* SPDX-License-Identifier: MIT */
/*
 * ape_device_measure_h2d(): host-to-device bandwidth from a buffer on a chosen NUMA node,
 * through the same allocation, pinning and copy path as real staging buffers, so that
 * `ape-bench --numa` measures what ape_attention_forward() gets.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/context.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "topo/placement.h"
#include "topo/numa.h"
#include "topo/topology.h"

static const char fn[] = "ape_device_measure_h2d";

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static int check_args(ape_device *dev, int numa_node, size_t bytes, int repeats,
		      ape_copy_result *res)
{
	struct ape_context *ctx;

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if (!res)
		return ape__error(APE_EINVAL, "%s: res = NULL", fn);
	if (bytes == 0)
		return ape__error(APE_EINVAL, "%s: bytes = 0: must be > 0", fn);
	if (repeats < 1 || repeats > 100000)
		return ape__error(APE_EINVAL, "%s: repeats = %d: must be in 1..100000", fn, repeats);
	ctx = dev->be->ctx;
	if (!ctx->numa || ctx->elsewhere)
		return ape__error(APE_ENOTSUP, "%s: the context's topology is %s: nothing can be "
				  "placed", fn, ctx->topo.source);
	if (numa_node < -1 || (numa_node >= 0 && ape__numa_distance(ctx->numa, numa_node,
								     numa_node) < 0))
		return ape__error(APE_EINVAL, "%s: numa_node = %d: no such NUMA node", fn,
				  numa_node);
	return 0;
}

static int alloc_source(ape_device *dev, int numa_node, size_t bytes, struct ape__hostmem *m)
{
	char nodes[16];
	int ret;

	if (numa_node < 0) {
		ret = ape__host_alloc(dev, bytes, m);
		return ret ? ape__error_prefix(ret, fn) : 0;
	}
	snprintf(nodes, sizeof(nodes), "%d", numa_node);
	ret = ape__host_alloc_placed(dev, bytes, APE_NUMA_LOCAL, nodes, m);
	if (ret == APE_ENOMEM)
		return ape__error(ret, "%s: out of memory for %zu bytes on node %d", fn, bytes,
				  numa_node);
	if (ret)
		return ape__error(APE_ENOTSUP, "%s: cannot bind memory to node %d: %s", fn,
				  numa_node, ret > -4000 ? strerror(-ret) : ape_strerror(ret));
	return 0;
}

/* One warm-up copy of `bytes` from m (which may be larger: a cached staging buffer), then
 * `repeats` timed ones, each synchronised. */
static int time_copies(ape_device *dev, const struct ape__hostmem *m, size_t bytes, int repeats,
		       double *ms)
{
	const struct ape_backend_plugin *ops = dev->be->ops;
	struct ape_be_queue *q = NULL;
	struct ape_be_buf *buf = NULL;
	int ret;

	ret = ops->queue_create(dev, &q);
	if (!ret)
		ret = ops->buf_alloc(dev, bytes, &buf);
	for (int i = -1; !ret && i < repeats; i++) {
		double t0 = ape__now_ms();

		ret = ops->copy_h2d(q, buf, 0, m->ptr, bytes);
		if (!ret)
			ret = ops->synchronize(q);
		if (i >= 0)
			ms[i] = ape__now_ms() - t0;
	}
	ops->queue_destroy(q);
	ops->buf_free(dev, buf);
	return ret ? ape__error_prefix(ret, fn) : 0;
}

int ape_device_measure_h2d(ape_device *dev, int numa_node, size_t bytes, int repeats,
			   ape_copy_result *res)
{
	APE__API_CALL("ape_device_measure_h2d");
	struct ape__hostmem m;
	char where[64];
	double *ms;
	int ret;

	ret = check_args(dev, numa_node, bytes, repeats, res);
	if (ret)
		return ret;
	ms = ape__calloc((size_t)repeats, sizeof(*ms));
	if (!ms)
		return ape__error(APE_ENOMEM, "%s: out of memory", fn);
	ret = alloc_source(dev, numa_node, bytes, &m);
	if (ret)
		goto out_free_ms;
	memset(m.ptr, 0x5a, bytes); /* every page exists before the first copy */
	ret = time_copies(dev, &m, bytes, repeats, ms);
	if (ret)
		goto out_free_buf;
	qsort(ms, (size_t)repeats, sizeof(*ms), cmp_double);
	memset(res, 0, sizeof(*res));
	res->ms = repeats % 2 ? ms[repeats / 2] : 0.5 * (ms[repeats / 2 - 1] + ms[repeats / 2]);
	res->gbytes_per_s = res->ms > 0 ? (double)bytes / (res->ms * 1e6) : 0;
	res->numa_node = -1;
	if (!ape__numa_area_nodes(dev->be->ctx->numa, m.ptr, bytes, where, sizeof(where)) &&
	    ape__list_count(where) == 1)
		res->numa_node = ape__list_first(where);
out_free_buf:
	ape__host_free(dev, &m);
out_free_ms:
	free(ms);
	return ret;
}
