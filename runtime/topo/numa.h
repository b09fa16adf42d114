/* SPDX-License-Identifier: MIT */
/*
 * The machine's topology through hwloc: runtime/topo/numa.c is the only file that includes hwloc.h.
 * Everything crosses this boundary as plain C: PCI addresses and list-format sets ("0-7,16-23",
 * OS indices), so the rest of libape neither sees nor links hwloc's types.
 */
#ifndef APE_RUNTIME_NUMA_H
#define APE_RUNTIME_NUMA_H

#include <stdbool.h>
#include <stddef.h>

#include "ape/ape.h"
#include "topo/topology.h"

#pragma GCC visibility push(hidden)

struct ape__numa;

/*
 * Loads a topology: this machine's when `xml` is NULL (or the file HWLOC_XMLFILE names), else
 * the XML file's. PCI devices and bridges are kept; hwloc's own CUDA, OpenCL and vendor plugins
 * are not run (libape asks the APIs itself, and they must not be loaded behind its back).
 * Returns 0, or for an XML file APE_EINVAL (missing), APE_EIO (unreadable), APE_EFORMAT (not a
 * topology), APE_ENOMEM, with a message prefixed by `fn` that names the file. For this machine
 * a failure returns APE_EIO with the reason in `note` (the caller carries on without it).
 */
int ape__numa_open(const char *xml, const char *fn, struct ape__numa **out, char *note,
		   size_t note_len);
void ape__numa_close(struct ape__numa *nm);

/* Is binding real: this machine, loaded from the OS (or an XML asserted to be this system) and
 * not an explicit topology file? */
bool ape__numa_is_real(const struct ape__numa *nm);
/* "this machine", "XML file FILE", "XML file FILE (HWLOC_XMLFILE)" */
const char *ape__numa_source(const struct ape__numa *nm);

/* Counts of NUMA nodes, packages, cores and PUs (allowed ones). */
void ape__numa_counts(const struct ape__numa *nm, int *nodes, int *packages, int *cores,
		      int *pus);
/* Every node, and every allowed CPU, in list format. */
void ape__numa_all(const struct ape__numa *nm, char *nodes, size_t nodes_len, char *cpus,
		   size_t cpus_len);
/* Node `index` (0..count-1, OS order). */
int ape__numa_node(const struct ape__numa *nm, int index, ape_numa_info *info);
/* Distance between nodes (OS indices) from the firmware table; 0 when there is none, -1 for an
 * unknown node. */
int ape__numa_distance(const struct ape__numa *nm, int from, int to);

/* GPUs, accelerators and co-processors on the PCI bus, as sightings with api 0. *out is
 * malloc'ed (free() it). Returns the count or APE_ENOMEM. */
int ape__numa_pci_scan(const struct ape__numa *nm, struct ape__sighting **out);

/* The nodes and CPUs a PCI device is local to. Returns 0, or APE_ENODEV when the topology does
 * not have the device (nodes and cpus are then ""). */
int ape__numa_pci_locality(const struct ape__numa *nm, const struct ape__pci_addr *a,
			   char *nodes, size_t nodes_len, char *cpus, size_t cpus_len);
/* How two PCI devices connect (ape_link); APE_LINK_UNKNOWN when either is not in the topology. */
int ape__numa_pci_link(const struct ape__numa *nm, const struct ape__pci_addr *a,
		       const struct ape__pci_addr *b);

/*
 * `bytes` of page-aligned memory bound to `nodes` (APE_NUMA_LOCAL) or interleaved over them
 * (APE_NUMA_INTERLEAVE), strictly: returns 0, or a negative errno-style code (APE_ENOMEM, or
 * -EPERM / -ENOSYS / -EXDEV / -EINVAL when the binding cannot be done). Only for a real topology.
 */
int ape__numa_alloc(struct ape__numa *nm, size_t bytes, ape_numa_policy policy, const char *nodes,
		    void **out);
void ape__numa_free(struct ape__numa *nm, void *p, size_t bytes);

/* Binds the calling thread to those of `cpus` its current affinity allows. Returns 0, -EXDEV
 * when its affinity holds none of them, or another negative errno-style code. Only for a real
 * topology. */
int ape__numa_bind_thread(struct ape__numa *nm, const char *cpus);

/* The nodes holding the pages of [p, p + len) (touched ones only), in list format. Returns 0 or
 * a negative errno-style code. */
int ape__numa_area_nodes(struct ape__numa *nm, const void *p, size_t len, char *nodes,
			 size_t nodes_len);

#pragma GCC visibility pop
#endif
