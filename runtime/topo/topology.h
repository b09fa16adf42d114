/* SPDX-License-Identifier: MIT */
/*
 * The physical device list, as pure logic: PCI addresses, the merge of what each API reports
 * into one entry per piece of hardware, the visible-devices filter, lookup by index or address,
 * and the staging placement decision. Nothing here touches hwloc, libdrm or a backend: callers
 * hand in "sightings", so tests can inject any machine they like.
 */
#ifndef APE_RUNTIME_TOPOLOGY_H
#define APE_RUNTIME_TOPOLOGY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ PCI addresses */

/* Domains beyond 16 bits exist (Intel VMD uses 0x10000 and up); the canonical form must still
 * fit ape_device_info.pci_address. */
#define APE__PCI_DOMAIN_MAX 0x0fffffffu

struct ape__pci_addr {
	uint32_t domain;
	uint8_t bus, dev, func;
};

/* "0000:03:00.0" or "03:00.0" (domain 0), hex digits of either case, nothing around them.
 * Returns 0 or APE_EINVAL (no message set: callers name the argument). */
int ape__pci_parse(const char *s, struct ape__pci_addr *out);
/* The canonical form, "0000:03:00.0" (lower case, domain at least four digits). */
void ape__pci_format(const struct ape__pci_addr *a, char *buf, size_t cap);
/* Orders by domain, bus, device, function. */
int ape__pci_cmp(const struct ape__pci_addr *a, const struct ape__pci_addr *b);

/* ------------------------------------------------------------------ vendors and classes */

/* Short vendor name ("NVIDIA", "AMD"), or NULL for an id libape does not know. */
const char *ape__pci_vendor_name(uint16_t vendor_id);
/* A PCI vendor id from a driver's vendor string ("NVIDIA Corporation" -> 0x10de); 0 if none. */
uint16_t ape__vendor_id_from_name(const char *vendor);
/* Display controllers of BMCs and virtual machines (ASPEED, Matrox, QEMU, virtio, ...): on the
 * bus as VGA devices, but nothing computes on them. */
bool ape__pci_display_only(uint16_t vendor_id);
/* Class codes of devices worth listing: display (0x03xx), processing accelerator (0x12xx),
 * co-processor (0x0b40). `class_id` is class << 8 | subclass. */
bool ape__pci_compute_class(uint16_t class_id);

/* ------------------------------------------------------------------ node and CPU lists */

/* Members of a list-format set ("0-3,8"): count, first (-1 when empty), membership. A malformed
 * list counts as empty. */
int ape__list_count(const char *list);
int ape__list_first(const char *list);
bool ape__list_has(const char *list, int x);

/* ------------------------------------------------------------------ the merge */

/* One API's (or the bus scan's) view of one device. */
struct ape__sighting {
	unsigned api; /* one APE_API_* flag; 0 for the PCI bus scan */
	char pci_address[16]; /* as reported; "" when none */
	uint16_t vendor_id, device_id; /* 0 when unknown */
	uint16_t pci_class; /* class << 8 | subclass; 0 when unknown */
	ape_device_kind kind;
	char name[128];
	char vendor[64];
	char render_node[64];
	uint64_t memory_bytes;
	int compute_units;
	int device_index; /* the logical device (ape_device_list() index), -1 for none */
	char backend[16]; /* the logical device's backend */
	/* a logical device of a backend plugin (api 0: no APE_API_* flag names a plugin's API) */
	bool plugin;
};

struct ape__merge_input {
	const struct ape__sighting *sightings;
	int count;
	/* The context's backends, to explain why a device is unusable. */
	const ape_backend_info *backends;
	int nbackends;
	/* Non-NULL when the list describes another machine (topology XML): every entry is then
	 * unusable for this reason. */
	const char *elsewhere;
};

/* Logical devices reaching a physical device, per API; backend plugins share one slot. */
enum {
	APE__API_SLOT_CUDA,
	APE__API_SLOT_OPENCL,
	APE__API_SLOT_HOST,
	APE__API_SLOT_PLUGIN,
	APE__API_SLOTS
};

struct ape__phys {
	ape_physical_info info; /* placement fields are filled by the caller */
	struct ape__pci_addr pci;
	bool has_pci;
	int logical[APE__API_SLOTS]; /* most preferred logical device per API, -1 */
	char plugin[16]; /* the backend of logical[APE__API_SLOT_PLUGIN], when there is one */
	int id; /* position before sorting: lets ape__topology_merge() report where sightings went */
};

/*
 * Merges sightings into the physical list, sorted (PCI address; then devices without one:
 * GPUs and accelerators, the CPU, the reference), indices set, default backend, usability and
 * reason decided. Placement fields are left "unknown" (-1, ""). *out is calloc'ed (free() it);
 * it is NULL when *n is 0. `where`, when not NULL, has in->count slots and receives the entry
 * each sighting went to (-1 for one left out). Returns 0 or APE_ENOMEM.
 */
int ape__topology_merge(const struct ape__merge_input *in, struct ape__phys **out, int *n,
			int *where);

/*
 * Which entries `list` (APE_VISIBLE_DEVICES syntax) keeps: keep[i] for each of the n entries.
 * The reference is always kept. `what` names the list in messages ("APE_VISIBLE_DEVICES").
 * Returns 0, APE_EINVAL (malformed item) or APE_ENODEV (no such device), with a message
 * prefixed by `fn`.
 */
int ape__topology_visible(const struct ape__phys *p, int n, const char *list, const char *fn,
			  const char *what, bool *keep);

/* Drops the entries keep[] does not keep and renumbers info.index; returns the new count. */
int ape__topology_compact(struct ape__phys *p, int n, const bool *keep);

/*
 * The entry a device spec names: a decimal physical index or a PCI address. Returns the index,
 * or APE_EINVAL (neither) or APE_ENODEV (no such entry), with a message prefixed by `fn`.
 */
int ape__topology_find(const struct ape__phys *p, int n, const char *spec, const char *fn);

/* ------------------------------------------------------------------ staging placement */

struct ape__staging {
	ape_numa_policy policy; /* LOCAL (bind), INTERLEAVE, or OFF (plain) */
	char nodes[64]; /* list format; "" when OFF */
};

/*
 * Where staging buffers for a device go. `dev_nodes` are the nodes it is local to ("" when
 * unknown), `all_nodes` the machine's. On a one-node machine every device is local to that
 * node. Sets `why` (may be NULL) when the policy asked for placement but the node is unknown.
 */
void ape__staging_decide(ape_numa_policy policy, const char *dev_nodes, const char *all_nodes,
			 struct ape__staging *out, char *why, size_t why_len);

#pragma GCC visibility pop
#endif
