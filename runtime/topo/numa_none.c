/* SPDX-License-Identifier: MIT */
/*
 * Built instead of runtime/topo/numa.c when hwloc is not available at build time (WITH_HWLOC=no, or
 * auto without it): libape then knows nothing of the machine's topology. Staging buffers are
 * plain page-aligned allocations, threads are not bound, and a topology XML file cannot be read.
 * Every function accepts the NULL topology that ape__numa_open() leaves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/error.h"
#include "topo/numa.h"

#define WHY "hwloc is not built into this libape"

int ape__numa_open(const char *xml, const char *fn, struct ape__numa **out, char *note,
		   size_t note_len)
{
	*out = NULL;
	if (xml)
		return ape__error(APE_ENOTSUP, "%s: topology XML file \"%s\": %s (rebuild with "
				  "WITH_HWLOC=yes)", fn, xml, WHY);
	snprintf(note, note_len, "%s", WHY);
	return APE_ENOTSUP; /* a build choice, not a failure: no placement, and no warning */
}

void ape__numa_close(struct ape__numa *nm)
{
	(void)nm;
}

bool ape__numa_is_real(const struct ape__numa *nm)
{
	(void)nm;
	return false;
}

const char *ape__numa_source(const struct ape__numa *nm)
{
	(void)nm;
	return "this machine (" WHY ")";
}

void ape__numa_counts(const struct ape__numa *nm, int *nodes, int *packages, int *cores, int *pus)
{
	(void)nm;
	*nodes = *packages = *cores = *pus = 0;
}

void ape__numa_all(const struct ape__numa *nm, char *nodes, size_t nodes_len, char *cpus,
		   size_t cpus_len)
{
	(void)nm;
	snprintf(nodes, nodes_len, "%s", "");
	snprintf(cpus, cpus_len, "%s", "");
}

int ape__numa_node(const struct ape__numa *nm, int index, ape_numa_info *info)
{
	(void)nm;
	(void)index;
	(void)info;
	return APE_EINVAL; /* there are no nodes to describe */
}

int ape__numa_distance(const struct ape__numa *nm, int from, int to)
{
	(void)nm;
	(void)from;
	(void)to;
	return -1;
}

int ape__numa_pci_scan(const struct ape__numa *nm, struct ape__sighting **out)
{
	(void)nm;
	*out = NULL;
	return 0;
}

int ape__numa_pci_locality(const struct ape__numa *nm, const struct ape__pci_addr *a,
			   char *nodes, size_t nodes_len, char *cpus, size_t cpus_len)
{
	(void)nm;
	(void)a;
	snprintf(nodes, nodes_len, "%s", "");
	snprintf(cpus, cpus_len, "%s", "");
	return APE_ENODEV;
}

int ape__numa_pci_link(const struct ape__numa *nm, const struct ape__pci_addr *a,
		       const struct ape__pci_addr *b)
{
	(void)nm;
	(void)a;
	(void)b;
	return APE_LINK_UNKNOWN;
}

/* Never reached with a NULL topology (callers place memory only on a real one); kept page
 * aligned like the real thing in case that changes. */
int ape__numa_alloc(struct ape__numa *nm, size_t bytes, ape_numa_policy policy, const char *nodes,
		    void **out)
{
	void *p;

	(void)nm;
	(void)policy;
	(void)nodes;
	p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return APE_ENOMEM;
	*out = p;
	return 0;
}

void ape__numa_free(struct ape__numa *nm, void *p, size_t bytes)
{
	(void)nm;
	if (p)
		munmap(p, bytes);
}

int ape__numa_bind_thread(struct ape__numa *nm, const char *cpus)
{
	(void)nm;
	(void)cpus;
	return APE_ENOTSUP;
}

int ape__numa_area_nodes(struct ape__numa *nm, const void *p, size_t len, char *nodes,
			 size_t nodes_len)
{
	(void)nm;
	(void)p;
	(void)len;
	snprintf(nodes, nodes_len, "%s", "");
	return APE_ENOTSUP;
}
