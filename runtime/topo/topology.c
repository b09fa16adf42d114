/* SPDX-License-Identifier: MIT */
/*
 * The merge: what CUDA, OpenCL, DRM and the PCI bus scan each report becomes one entry per piece
 * of hardware. The PCI address is the identity: two identical GPUs on different buses are two
 * devices, one GPU seen by three APIs is one. The reasons written here are what a user reads when
 * a GPU sits idle, so they name the device, its address and the missing piece.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/alloc.h"
#include "topo/topology.h"

/* The slot of a sighting's logical device: its API's, or the plugins' one. */
static int sighting_slot(const struct ape__sighting *s)
{
	if (s->plugin)
		return APE__API_SLOT_PLUGIN;
	switch (s->api) {
	case APE_API_CUDA:
		return APE__API_SLOT_CUDA;
	case APE_API_OPENCL:
		return APE__API_SLOT_OPENCL;
	case APE_API_HOST:
		return APE__API_SLOT_HOST;
	}
	return -1;
}

/* Sort classes: PCI devices first, then GPUs and accelerators without an address, the CPU, the
 * reference. */
static int sort_class(const struct ape__phys *p)
{
	if (p->has_pci)
		return 0;
	switch (p->info.kind) {
	case APE_DEVICE_GPU:
	case APE_DEVICE_ACCELERATOR:
		return 1;
	case APE_DEVICE_CPU:
		return 2;
	default:
		return 3;
	}
}

/* An entry's first logical device, for a stable order among entries without an address. */
static int first_logical(const struct ape__phys *p)
{
	int best = -1;

	for (int i = 0; i < APE__API_SLOTS; i++)
		if (p->logical[i] >= 0 && (best < 0 || p->logical[i] < best))
			best = p->logical[i];
	return best < 0 ? 1 << 30 : best;
}

static int phys_cmp(const struct ape__phys *a, const struct ape__phys *b)
{
	int ca = sort_class(a), cb = sort_class(b);

	if (ca != cb)
		return ca < cb ? -1 : 1;
	if (ca == 0)
		return ape__pci_cmp(&a->pci, &b->pci);
	return (first_logical(a) > first_logical(b)) - (first_logical(a) < first_logical(b));
}

static void sort_phys(struct ape__phys *p, int n)
{
	for (int i = 1; i < n; i++) { /* insertion sort: stable, and n is small */
		struct ape__phys x = p[i];
		int j = i;

		while (j > 0 && phys_cmp(&p[j - 1], &x) > 0) {
			p[j] = p[j - 1];
			j--;
		}
		p[j] = x;
	}
	for (int i = 0; i < n; i++)
		p[i].info.index = i;
}

static void phys_init(struct ape__phys *p)
{
	memset(p, 0, sizeof(*p));
	for (int i = 0; i < APE__API_SLOTS; i++)
		p->logical[i] = -1;
	p->info.device_index = -1;
	p->info.numa_node = -1;
	p->info.staging_policy = APE_NUMA_OFF;
}

/* Names from a compute API (a plugin's included) win over the bus scan's; the first compute API
 * seen keeps them. */
static bool from_api(const struct ape__sighting *s)
{
	return s->api == APE_API_CUDA || s->api == APE_API_OPENCL || s->api == APE_API_HOST ||
	       s->plugin;
}

static void absorb(struct ape__phys *p, const struct ape__sighting *s, bool first)
{
	ape_physical_info *in = &p->info;
	int slot = sighting_slot(s);
	bool named_by_api = (in->apis & (APE_API_CUDA | APE_API_OPENCL | APE_API_HOST)) ||
			    p->logical[APE__API_SLOT_PLUGIN] >= 0;

	in->apis |= s->api;
	if (slot >= 0 && s->device_index >= 0 &&
	    (p->logical[slot] < 0 || s->device_index < p->logical[slot])) {
		p->logical[slot] = s->device_index;
		if (slot == APE__API_SLOT_PLUGIN)
			snprintf(p->plugin, sizeof(p->plugin), "%s", s->backend);
	}
	if (first || (from_api(s) && !named_by_api)) {
		if (s->name[0])
			snprintf(in->name, sizeof(in->name), "%s", s->name);
		if (s->vendor[0])
			snprintf(in->vendor, sizeof(in->vendor), "%s", s->vendor);
		in->kind = s->kind;
	}
	if (!in->pci_vendor_id && s->vendor_id) {
		in->pci_vendor_id = s->vendor_id;
		in->pci_device_id = s->device_id;
	}
	if (!in->render_node[0] && s->render_node[0])
		snprintf(in->render_node, sizeof(in->render_node), "%s", s->render_node);
	if (!in->memory_bytes)
		in->memory_bytes = s->memory_bytes;
	if (!in->compute_units)
		in->compute_units = s->compute_units;
}

static uint16_t vendor_of(const struct ape__phys *p)
{
	return p->info.pci_vendor_id ? p->info.pci_vendor_id
				     : ape__vendor_id_from_name(p->info.vendor);
}

/* Compute devices seen by no API are listed only if someone could compute on them. */
static bool worth_listing(const struct ape__phys *p)
{
	if (p->info.apis & (APE_API_CUDA | APE_API_OPENCL | APE_API_HOST) ||
	    p->logical[APE__API_SLOT_PLUGIN] >= 0)
		return true;
	return !ape__pci_display_only(vendor_of(p));
}

/*
 * An OpenCL GPU whose driver does not give its PCI address is the one PCI GPU of its vendor
 * that OpenCL does not reach otherwise, if there is exactly one such GPU and one such sighting;
 * otherwise it stays an entry of its own (better two entries than a wrong match).
 */
static int match_unaddressed(struct ape__phys *p, int n, const struct ape__sighting *s,
			     const struct ape__sighting *all, int nall)
{
	uint16_t vid = s->vendor_id ? s->vendor_id : ape__vendor_id_from_name(s->vendor);
	int found = -1, peers = 0;

	if (!vid || s->kind == APE_DEVICE_CPU || s->kind == APE_DEVICE_HOST_REFERENCE)
		return -1;
	for (int i = 0; i < nall; i++) {
		const struct ape__sighting *o = &all[i];
		uint16_t ovid = o->vendor_id ? o->vendor_id : ape__vendor_id_from_name(o->vendor);
		struct ape__pci_addr a;

		peers += o->api == s->api && ovid == vid && o->kind == s->kind &&
			 ape__pci_parse(o->pci_address, &a) != 0;
	}
	for (int i = 0; i < n; i++) {
		if (!p[i].has_pci || vendor_of(&p[i]) != vid || (p[i].info.apis & s->api))
			continue;
		if (found >= 0)
			return -1;
		found = i;
	}
	return peers == 1 ? found : -1;
}

static int backend_info(const struct ape__merge_input *in, const char *name,
			const ape_backend_info **out)
{
	for (int i = 0; i < in->nbackends; i++)
		if (!strcmp(in->backends[i].name, name)) {
			*out = &in->backends[i];
			return 0;
		}
	return -1;
}

/* "NVIDIA GPU at 0000:03:00.0", "Habana Labs accelerator at 0000:33:00.0" */
static void describe(const struct ape__phys *p, char *buf, size_t cap)
{
	const char *vname = ape__pci_vendor_name(vendor_of(p));
	const char *what = p->info.kind == APE_DEVICE_ACCELERATOR ? "accelerator"
			   : p->info.kind == APE_DEVICE_CPU	  ? "CPU"
								  : "GPU";
	const char *where = p->info.pci_address[0] ? p->info.pci_address
			    : p->info.render_node[0] ? p->info.render_node
						     : "an unknown address";

	if (vname)
		snprintf(buf, cap, "%s %s at %s", vname, what, where);
	else if (p->info.vendor[0])
		snprintf(buf, cap, "%s %s at %s", p->info.vendor, what, where);
	else
		snprintf(buf, cap, "%s at %s", what, where);
}

/* Why no logical device drives an entry whose default backend is `be`. */
static void explain_unusable(const struct ape__merge_input *in, struct ape__phys *p,
			     const char *be)
{
	const ape_backend_info *bi = NULL;
	char what[192];

	describe(p, what, sizeof(what));
	if (in->elsewhere) {
		snprintf(p->info.reason, sizeof(p->info.reason), "%s", in->elsewhere);
	} else if (backend_info(in, be, &bi) || !bi->available) {
		snprintf(p->info.reason, sizeof(p->info.reason), "%.100s but %s: %.130s", what, be,
			 bi ? bi->reason : "unknown backend");
	} else if (!strcmp(be, "cuda")) {
		snprintf(p->info.reason, sizeof(p->info.reason), "%s but cuda does not report it",
			 what);
	} else {
		snprintf(p->info.reason, sizeof(p->info.reason),
			 "%s but no OpenCL driver reports it", what);
	}
}

/* CUDA for NVIDIA, OpenCL for everything else, the reference for itself; NVIDIA falls back to
 * OpenCL (saying why) when CUDA does not reach it; a backend plugin where no built-in backend
 * drives the device (ape_device_select() picks by the devices' ranks, not by this). */
static void choose_backend(const struct ape__merge_input *in, struct ape__phys *p)
{
	const bool nvidia = vendor_of(p) == 0x10de;
	const ape_backend_info *bi = NULL;
	const char *be;
	int dev;

	if (p->logical[APE__API_SLOT_HOST] >= 0) {
		be = "ref";
		dev = p->logical[APE__API_SLOT_HOST];
	} else if (nvidia && p->logical[APE__API_SLOT_CUDA] >= 0) {
		be = "cuda";
		dev = p->logical[APE__API_SLOT_CUDA];
	} else if (p->logical[APE__API_SLOT_OPENCL] >= 0) {
		be = "opencl";
		dev = p->logical[APE__API_SLOT_OPENCL];
		if (nvidia && !backend_info(in, "cuda", &bi))
			snprintf(p->info.reason, sizeof(p->info.reason),
				 "cuda: %.200s; driven through opencl",
				 bi->available ? "does not report it" : bi->reason);
	} else if (p->logical[APE__API_SLOT_CUDA] >= 0) {
		be = "cuda";
		dev = p->logical[APE__API_SLOT_CUDA];
	} else if (p->logical[APE__API_SLOT_PLUGIN] >= 0) {
		be = p->plugin;
		dev = p->logical[APE__API_SLOT_PLUGIN];
	} else {
		be = nvidia ? "cuda" : "opencl";
		dev = -1;
	}
	snprintf(p->info.backend, sizeof(p->info.backend), "%s", be);
	p->info.device_index = dev;
	p->info.usable = dev >= 0;
	if (!p->info.usable)
		explain_unusable(in, p, be);
}

/* A name for a device no compute API named: "NVIDIA GPU [10de:2330]". */
static void default_name(struct ape__phys *p)
{
	const char *vname = ape__pci_vendor_name(p->info.pci_vendor_id);
	char vbuf[16];

	if (!vname) {
		snprintf(vbuf, sizeof(vbuf), "vendor %04x", p->info.pci_vendor_id);
		vname = vbuf;
	}
	if (!p->info.vendor[0])
		snprintf(p->info.vendor, sizeof(p->info.vendor), "%s", vname);
	if (!p->info.name[0])
		snprintf(p->info.name, sizeof(p->info.name), "%s %s [%04x:%04x]", vname,
			 p->info.kind == APE_DEVICE_ACCELERATOR ? "accelerator" : "GPU",
			 p->info.pci_vendor_id, p->info.pci_device_id);
}

/* The kind a bus scan or DRM implies: the class says accelerator or GPU. */
static ape_device_kind kind_of(const struct ape__sighting *s)
{
	if (from_api(s) || !s->pci_class)
		return s->kind;
	return (s->pci_class >> 8) == 0x03 ? APE_DEVICE_GPU : APE_DEVICE_ACCELERATOR;
}

/* Returns the entry the sighting went to. */
static int add_addressed(struct ape__phys *p, int *n, const struct ape__sighting *s,
			 const struct ape__pci_addr *a)
{
	struct ape__sighting k = *s;

	k.kind = kind_of(s);
	for (int i = 0; i < *n; i++)
		if (p[i].has_pci && !ape__pci_cmp(&p[i].pci, a)) {
			absorb(&p[i], &k, false);
			return i;
		}
	phys_init(&p[*n]);
	p[*n].id = *n;
	p[*n].has_pci = true;
	p[*n].pci = *a;
	ape__pci_format(a, p[*n].info.pci_address, sizeof(p[*n].info.pci_address));
	absorb(&p[*n], &k, true);
	return (*n)++;
}

/* CPU sightings are one CPU, whichever OpenCL platforms report it; the reference is its own. */
static int add_unaddressed(struct ape__phys *p, int *n, const struct ape__sighting *s,
			   const struct ape__merge_input *in)
{
	int target = -1;

	if (s->kind == APE_DEVICE_CPU) {
		for (int i = 0; i < *n && target < 0; i++)
			if (!p[i].has_pci && p[i].info.kind == APE_DEVICE_CPU)
				target = i;
	} else if (s->api != 0) {
		target = match_unaddressed(p, *n, s, in->sightings, in->count);
	}
	if (target >= 0) {
		absorb(&p[target], s, false);
		return target;
	}
	phys_init(&p[*n]);
	p[*n].id = *n;
	absorb(&p[*n], s, true);
	return (*n)++;
}

int ape__topology_merge(const struct ape__merge_input *in, struct ape__phys **out, int *nout,
			int *where)
{
	struct ape__phys *p;
	int *final, n = 0, kept = 0;

	*out = NULL;
	*nout = 0;
	for (int i = 0; where && i < in->count; i++)
		where[i] = -1;
	if (in->count == 0)
		return 0;
	p = ape__calloc((size_t)in->count, sizeof(*p));
	final = ape__calloc((size_t)in->count, sizeof(*final));
	if (!p || !final) {
		free(p);
		free(final);
		return ape__error(APE_ENOMEM, "out of memory merging the device list");
	}
	/* addressed sightings first, so that unaddressed ones can be matched against them */
	for (int pass = 0; pass < 2; pass++)
		for (int i = 0; i < in->count; i++) {
			const struct ape__sighting *s = &in->sightings[i];
			struct ape__pci_addr a;
			bool addressed = !ape__pci_parse(s->pci_address, &a);

			if (pass == 0 && addressed)
				final[i] = add_addressed(p, &n, s, &a);
			else if (pass == 1 && !addressed)
				final[i] = add_unaddressed(p, &n, s, in);
		}
	for (int i = 0; i < n; i++) {
		if (!worth_listing(&p[i]))
			continue;
		if (p[i].has_pci)
			default_name(&p[i]);
		choose_backend(in, &p[i]);
		p[kept++] = p[i];
	}
	sort_phys(p, kept);
	for (int i = 0; where && i < in->count; i++)
		for (int j = 0; j < kept; j++)
			if (p[j].id == final[i])
				where[i] = j;
	free(final);
	if (!kept) {
		free(p);
		p = NULL;
	}
	*out = p;
	*nout = kept;
	return 0;
}

/* ------------------------------------------------------------------ lookup and filter */

static bool all_digits(const char *s, size_t len)
{
	if (!len)
		return false;
	for (size_t i = 0; i < len; i++)
		if (s[i] < '0' || s[i] > '9')
			return false;
	return true;
}

/* One item of a device spec or list: an index or a PCI address. */
static int find_item(const struct ape__phys *p, int n, const char *item, size_t len,
		     const char *fn, const char *what)
{
	struct ape__pci_addr a;
	char buf[64];

	if (len >= sizeof(buf))
		return ape__error(APE_EINVAL, "%s: %s: \"%.*s...\" is neither a device index nor a "
				  "PCI address", fn, what, 32, item);
	memcpy(buf, item, len);
	buf[len] = '\0';
	if (all_digits(buf, len)) {
		long idx = len > 6 ? 1L << 30 : strtol(buf, NULL, 10);

		if (idx >= n)
			return ape__error(APE_ENODEV, "%s: %s: device index %s: there are %d "
					  "physical devices (see ape-info)", fn, what, buf, n);
		return (int)idx;
	}
	if (ape__pci_parse(buf, &a))
		return ape__error(APE_EINVAL, "%s: %s: \"%s\" is neither a device index nor a PCI "
				  "address (0000:03:00.0)", fn, what, buf);
	for (int i = 0; i < n; i++)
		if (p[i].has_pci && !ape__pci_cmp(&p[i].pci, &a))
			return i;
	ape__pci_format(&a, buf, sizeof(buf));
	return ape__error(APE_ENODEV, "%s: %s: no device at PCI address %s (see ape-info)", fn,
			  what, buf);
}

int ape__topology_find(const struct ape__phys *p, int n, const char *spec, const char *fn)
{
	char what[96];

	snprintf(what, sizeof(what), "spec = \"%.64s\"", spec);
	return find_item(p, n, spec, strlen(spec), fn, what);
}

int ape__topology_visible(const struct ape__phys *p, int n, const char *list, const char *fn,
			  const char *what, bool *keep)
{
	char label[320];
	const char *s = list;

	snprintf(label, sizeof(label), "%s = \"%.256s\"", what, list);
	for (int i = 0; i < n; i++)
		keep[i] = p[i].info.kind == APE_DEVICE_HOST_REFERENCE;
	while (*s) {
		const char *end = strchr(s, ',');
		size_t len = end ? (size_t)(end - s) : strlen(s);
		int idx;

		while (len && *s == ' ') { /* "0, 1" is a natural way to write it */
			s++;
			len--;
		}
		while (len && s[len - 1] == ' ')
			len--;
		idx = find_item(p, n, s, len, fn, label);
		if (idx < 0)
			return idx;
		keep[idx] = true;
		if (!end)
			break;
		s = end + 1;
	}
	return 0;
}

int ape__topology_compact(struct ape__phys *p, int n, const bool *keep)
{
	int m = 0;

	for (int i = 0; i < n; i++)
		if (keep[i]) {
			p[m] = p[i];
			p[m].info.index = m;
			m++;
		}
	return m;
}

/* ------------------------------------------------------------------ staging placement */

void ape__staging_decide(ape_numa_policy policy, const char *dev_nodes, const char *all_nodes,
			 struct ape__staging *out, char *why, size_t why_len)
{
	const int nall = ape__list_count(all_nodes);
	const char *nodes = dev_nodes;

	memset(out, 0, sizeof(*out));
	out->policy = APE_NUMA_OFF;
	if (why && why_len)
		why[0] = '\0';
	if (policy == APE_NUMA_OFF || nall == 0)
		return;
	if (policy == APE_NUMA_INTERLEAVE) {
		out->policy = APE_NUMA_INTERLEAVE;
		snprintf(out->nodes, sizeof(out->nodes), "%s", all_nodes);
		return;
	}
	if (ape__list_count(nodes) == 0 && nall == 1)
		nodes = all_nodes; /* one node: whatever the device, it is local to it */
	switch (ape__list_count(nodes)) {
	case 0:
		if (why && why_len)
			snprintf(why, why_len, "its NUMA node is unknown");
		return;
	case 1:
		out->policy = APE_NUMA_LOCAL;
		break;
	default: /* local to several nodes (a CPU device): spread over them */
		out->policy = APE_NUMA_INTERLEAVE;
		break;
	}
	snprintf(out->nodes, sizeof(out->nodes), "%s", nodes);
}
