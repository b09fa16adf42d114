/* SPDX-License-Identifier: MIT */
/*
 * Staging memory and feeding threads, placed by the context's NUMA policy. Placement is an
 * optimisation, never a condition: when it cannot be done the context says so once, on stderr,
 * and the work goes on with plain memory and unbound threads.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/context.h"
#include "core/alloc.h"
#include "core/error.h"
#include "topo/placement.h"
#include "topo/numa.h"
#include "topo/topology.h"

static const struct ape__phys *phys_of(const struct ape_device *dev)
{
	const struct ape_context *ctx = dev->be->ctx;
	int i = dev->info.physical_index;

	return i >= 0 && i < ctx->nphys ? &ctx->phys[i] : NULL;
}

static const char *err_text(int err)
{
	return err < 0 && err > -4000 ? strerror(-err) : ape_strerror(err);
}

/* Pinning is the backend's business and only ever a speed-up. */
static void pin(struct ape_device *dev, struct ape__hostmem *m)
{
	const struct ape_backend_plugin *ops = dev->be->ops;
	int ret;

	if (!ops->host_register || !ops->host_unregister)
		return;
	ret = ops->host_register(dev, m->ptr, m->bytes, &m->pin);
	if (ret) {
		m->pin = NULL;
		if (ret != APE_ENOTSUP)
			ape__warn_once(&dev->be->ctx->warned_pinning,
				       "%s: cannot pin staging buffers (%s): copies run unpinned",
				       dev->info.name, err_text(ret));
	}
}

/* ape__host_alloc_placed() less the fault-injection point, which its callers place */
static int place(struct ape_device *dev, size_t bytes, ape_numa_policy policy, const char *nodes,
		 struct ape__hostmem *m)
{
	struct ape_context *ctx = dev->be->ctx;
	int ret;

	memset(m, 0, sizeof(*m));
	if (!ctx->numa || ctx->elsewhere)
		return APE_ENOTSUP;
	ret = ape__numa_alloc(ctx->numa, bytes, policy, nodes, &m->ptr);
	if (ret)
		return ret;
	m->bytes = bytes;
	m->hwloc = true;
	m->placed = policy;
	snprintf(m->nodes, sizeof(m->nodes), "%s", nodes);
	pin(dev, m);
	return 0;
}

int ape__host_alloc_placed(struct ape_device *dev, size_t bytes, ape_numa_policy policy,
			   const char *nodes, struct ape__hostmem *m)
{
	memset(m, 0, sizeof(*m));
	if (ape__fault_alloc_hit()) /* a test build failing this allocation (core/alloc.h) */
		return APE_ENOMEM;
	return place(dev, bytes, policy, nodes, m);
}

/* Why a staging buffer for `dev` will be plain; NULL when it can be placed (or the policy is
 * off, which needs no explanation). */
static const char *why_plain(const struct ape_device *dev, char *buf, size_t len)
{
	const struct ape_context *ctx = dev->be->ctx;
	const struct ape__phys *p = phys_of(dev);

	if (ctx->numa_policy == APE_NUMA_OFF)
		return NULL;
	if (!ctx->numa)
		snprintf(buf, len, "the topology of this machine is unknown (%s)",
			 ctx->topo.source);
	else if (ctx->elsewhere)
		snprintf(buf, len, "this context describes %s, not this machine", ctx->topo.source);
	else if (!p || p->info.staging_policy == APE_NUMA_OFF)
		snprintf(buf, len, "the NUMA node of %s is unknown", dev->info.name);
	else
		return NULL;
	return buf;
}

struct ape__staging_cache {
	pthread_mutex_t lock;
	int n;
	struct {
		struct ape_device *dev;
		struct ape__hostmem m;
	} slot[APE__STAGING_CACHE_SLOTS]; /* [0, n), oldest first */
};

int ape__staging_cache_create(struct ape_context *ctx)
{
	struct ape__staging_cache *c = ape__calloc(1, sizeof(*c));

	if (!c || pthread_mutex_init(&c->lock, NULL)) {
		free(c);
		return APE_ENOMEM;
	}
	ctx->staging = c;
	return 0;
}

int ape__staging_cache_held(struct ape_context *ctx, size_t *bytes)
{
	struct ape__staging_cache *c = ctx->staging;
	size_t sum = 0;
	int n = 0;

	if (c) {
		pthread_mutex_lock(&c->lock);
		n = c->n;
		for (int i = 0; i < n; i++)
			sum += c->slot[i].m.bytes;
		pthread_mutex_unlock(&c->lock);
	}
	if (bytes)
		*bytes = sum;
	return n;
}

/* frees for good, whatever the cache would say */
static void host_release(struct ape_device *dev, struct ape__hostmem *m)
{
	if (m->pin)
		dev->be->ops->host_unregister(dev, m->pin);
	if (m->hwloc)
		ape__numa_free(dev->be->ctx->numa, m->ptr, m->bytes);
	else
		free(m->ptr);
	memset(m, 0, sizeof(*m));
}

void ape__staging_cache_destroy(struct ape_context *ctx)
{
	struct ape__staging_cache *c = ctx->staging;

	if (!c)
		return;
	for (int i = 0; i < c->n; i++)
		host_release(c->slot[i].dev, &c->slot[i].m);
	pthread_mutex_destroy(&c->lock);
	free(c);
	ctx->staging = NULL;
}

/* The smallest kept buffer of dev that holds `bytes` without wasting much (at most 4x, or any
 * up to 64 KiB), taken out of the cache into *m; false when none. */
static bool cache_take(struct ape_device *dev, size_t bytes, struct ape__hostmem *m)
{
	struct ape__staging_cache *c = dev->be->ctx->staging;
	int best = -1;

	if (!c)
		return false;
	pthread_mutex_lock(&c->lock);
	for (int i = 0; i < c->n; i++) {
		const size_t have = c->slot[i].m.bytes;

		if (c->slot[i].dev == dev && have >= bytes &&
		    (have / 4 <= bytes || have <= ((size_t)64 << 10)) &&
		    (best < 0 || have < c->slot[best].m.bytes))
			best = i;
	}
	if (best >= 0) {
		*m = c->slot[best].m;
		memmove(&c->slot[best], &c->slot[best + 1],
			(size_t)(c->n - best - 1) * sizeof(c->slot[0]));
		c->n--;
	}
	pthread_mutex_unlock(&c->lock);
	return best >= 0;
}

/* Keeps *m for the next call (the oldest kept buffer makes room when the cache is full, freed
 * outside the lock); false when it is not for keeping. */
static bool cache_give(struct ape_device *dev, struct ape__hostmem *m)
{
	struct ape__staging_cache *c = dev->be->ctx->staging;
	struct ape__hostmem old = { 0 };
	struct ape_device *old_dev = NULL;

	if (!c || !m->cacheable || m->bytes > APE__STAGING_CACHE_MAX)
		return false;
	pthread_mutex_lock(&c->lock);
	if (c->n == APE__STAGING_CACHE_SLOTS) {
		old = c->slot[0].m;
		old_dev = c->slot[0].dev;
		memmove(&c->slot[0], &c->slot[1], (size_t)(c->n - 1) * sizeof(c->slot[0]));
		c->n--;
	}
	c->slot[c->n].dev = dev;
	c->slot[c->n].m = *m;
	c->n++;
	pthread_mutex_unlock(&c->lock);
	if (old_dev)
		host_release(old_dev, &old);
	memset(m, 0, sizeof(*m));
	return true;
}

int ape__host_alloc(struct ape_device *dev, size_t bytes, struct ape__hostmem *m)
{
	struct ape_context *ctx = dev->be->ctx;
	const struct ape__phys *p = phys_of(dev);
	char why[384];
	long page = sysconf(_SC_PAGESIZE);
	int ret;

	memset(m, 0, sizeof(*m));
	if (cache_take(dev, bytes, m)) {
		/* a failure point per buffer handed out, as for a fresh one */
		if (ape__fault_alloc_hit()) {
			cache_give(dev, m);
			return ape__error(APE_ENOMEM,
					  "out of host memory for a %zu-byte staging buffer", bytes);
		}
		atomic_fetch_add(m->placed == APE_NUMA_OFF ? &ctx->staging_plain
							   : &ctx->staging_placed, 1);
		return 0;
	}
	if (ctx->numa_policy != APE_NUMA_OFF && !why_plain(dev, why, sizeof(why))) {
		/*
		 * A placement the system refuses falls back to a plain allocation (below), so the
		 * fault-injection point of a staging buffer is here, as a hard failure: one point
		 * per buffer, placed or plain, and the same sweep on a NUMA machine as on others.
		 */
		if (ape__fault_alloc_hit())
			return ape__error(APE_ENOMEM,
					  "out of host memory for a %zu-byte staging buffer", bytes);
		ret = place(dev, bytes, p->info.staging_policy, p->info.staging_nodes, m);
		if (!ret) {
			m->cacheable = true;
			atomic_fetch_add(&ctx->staging_placed, 1);
			return 0;
		}
		ape__warn_once(&ctx->warned_placement,
			       "NUMA placement off: binding memory to node%s %s failed (%s): staging "
			       "buffers are plain allocations",
			       ape__list_count(p->info.staging_nodes) > 1 ? "s" : "",
			       p->info.staging_nodes, err_text(ret));
	} else if (ctx->numa_policy != APE_NUMA_OFF) {
		ape__warn_once(&ctx->warned_placement,
			       "NUMA placement off: %s: staging buffers are plain allocations", why);
	}
	/* page-aligned like placed memory, so that a backend can pin either */
	if (ape__posix_memalign(&m->ptr, page > 0 ? (size_t)page : 4096, bytes)) {
		m->ptr = NULL;
		return ape__error(APE_ENOMEM, "out of host memory for a %zu-byte staging buffer",
				  bytes);
	}
	m->bytes = bytes;
	m->placed = APE_NUMA_OFF;
	m->cacheable = true;
	atomic_fetch_add(&ctx->staging_plain, 1);
	pin(dev, m);
	return 0;
}

void ape__host_free(struct ape_device *dev, struct ape__hostmem *m)
{
	if (!m->ptr)
		return;
	if (!cache_give(dev, m))
		host_release(dev, m);
}

int ape__bind_thread(struct ape_device *dev)
{
	struct ape_context *ctx;
	const struct ape__phys *p;
	char why[384];
	int ret;

	if (!dev)
		return ape__error(APE_EINVAL, "ape__bind_thread: dev = NULL");
	ctx = dev->be->ctx;
	p = phys_of(dev);
	if (ctx->numa_policy != APE_NUMA_LOCAL)
		return 0;
	if (why_plain(dev, why, sizeof(why)) || !p->info.cpuset[0]) {
		if (p && !p->info.cpuset[0])
			snprintf(why, sizeof(why), "the local CPUs of %s are unknown",
				 dev->info.name);
		ape__warn_once(&ctx->warned_binding, "threads feeding devices are not bound: %s",
			       why);
		return 0;
	}
	ret = ape__numa_bind_thread(ctx->numa, p->info.cpuset);
	if (ret == -EXDEV) {
		ape__warn_once(&ctx->warned_binding,
			       "threads feeding devices are not bound: the local CPUs of %s (%s) are "
			       "all outside the thread's affinity", dev->info.name, p->info.cpuset);
		return 0;
	}
	if (ret) {
		ape__warn_once(&ctx->warned_binding,
			       "threads feeding devices are not bound: binding to CPUs %s failed (%s)",
			       p->info.cpuset, err_text(ret));
		return 0;
	}
	return 1;
}
