/* SPDX-License-Identifier: MIT */
/*
 * hwloc: the only file that includes hwloc.h (see numa.h for why everything leaves it as text).
 *
 * A device's locality is found from its PCI address in hwloc's own PCI tree, never through
 * hwloc's CUDA or OpenCL helpers: those would make libape link the APIs it loads at run time,
 * and they could not describe a machine read from an XML file.
 */
#include <errno.h>
#include <fcntl.h>
#include <hwloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/alloc.h"
#include "topo/numa.h"

struct ape__numa {
	hwloc_topology_t topo;
	bool real;
	char source[320];
	/* distances between nodes, copied at load so that readers never call into hwloc's
	 * distance code concurrently: dist[i * nnodes + j] for nodes os[i], os[j]; NULL if none */
	int nnodes;
	int *os;
	uint64_t *dist;
};

/*
 * Discovery components libape does not want. cuda, nvml, opencl, rsmi, levelzero and gl would
 * load CUDA, OpenCL, NVML, ROCm SMI, Level Zero or an X server into the process while it merely
 * reads the topology. pci (libpciaccess) finds nothing the linux component does not read from
 * sysfs itself; it would only add names from pci.ids, at the price of reading every device's
 * config space and of state it never frees.
 */
static const char *const unwanted_components[] = { "cuda", "nvml", "opencl", "rsmi", "levelzero",
						   "gl", "pci" };

/* An explicit XML file must exist and be readable before hwloc sees it, so that the message
 * can say which of the two it is. */
static int check_xml_file(const char *xml, const char *fn)
{
	struct stat st;
	int fd = open(xml, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return ape__error(errno == ENOENT || errno == ENOTDIR ? APE_EINVAL : APE_EIO,
				  "%s: topology XML file \"%s\": %s", fn, xml, strerror(errno));
	if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
		close(fd);
		return ape__error(APE_EIO, "%s: topology XML file \"%s\": not a regular file", fn,
				  xml);
	}
	close(fd);
	return 0;
}

static void describe_source(struct ape__numa *nm, const char *xml)
{
	const char *envxml = getenv("HWLOC_XMLFILE"), *synth = getenv("HWLOC_SYNTHETIC");

	if (xml)
		snprintf(nm->source, sizeof(nm->source), "XML file %s", xml);
	else if (nm->real && envxml && *envxml)
		snprintf(nm->source, sizeof(nm->source), "this machine (XML file %s)", envxml);
	else if (nm->real)
		snprintf(nm->source, sizeof(nm->source), "this machine");
	else if (envxml && *envxml)
		snprintf(nm->source, sizeof(nm->source), "XML file %s (HWLOC_XMLFILE)", envxml);
	else if (synth && *synth)
		snprintf(nm->source, sizeof(nm->source),
			 "synthetic topology \"%s\" (HWLOC_SYNTHETIC)", synth);
	else
		snprintf(nm->source, sizeof(nm->source),
			 "a topology hwloc says is not this machine");
}

static hwloc_obj_t node_obj(const struct ape__numa *nm, int i)
{
	return hwloc_get_obj_by_type(nm->topo, HWLOC_OBJ_NUMANODE, (unsigned)i);
}

static void load_distances(struct ape__numa *nm)
{
	struct hwloc_distances_s *d[4];
	unsigned nr = 4, pick = 0;
	int n = hwloc_get_nbobjs_by_type(nm->topo, HWLOC_OBJ_NUMANODE);

	nm->nnodes = n > 0 ? n : 0;
	if (n <= 0 || !(nm->os = ape__calloc((size_t)n, sizeof(*nm->os))))
		return;
	for (int i = 0; i < n; i++)
		nm->os[i] = (int)node_obj(nm, i)->os_index;
	if (hwloc_distances_get_by_type(nm->topo, HWLOC_OBJ_NUMANODE, &nr, d, 0, 0) || nr == 0)
		return;
	if (nr > 4)
		nr = 4;
	for (unsigned k = 0; k < nr; k++) /* latency (the firmware's SLIT) rather than bandwidth */
		if (d[k]->kind & HWLOC_DISTANCES_KIND_MEANS_LATENCY) {
			pick = k;
			break;
		}
	nm->dist = ape__calloc((size_t)n * (size_t)n, sizeof(*nm->dist));
	for (int i = 0; nm->dist && i < n; i++)
		for (int j = 0; j < n; j++) {
			int ia = hwloc_distances_obj_index(d[pick], node_obj(nm, i));
			int ib = hwloc_distances_obj_index(d[pick], node_obj(nm, j));

			if (ia >= 0 && ib >= 0)
				nm->dist[i * n + j] = d[pick]->values[ia * d[pick]->nbobjs + ib];
		}
	for (unsigned k = 0; k < nr; k++)
		hwloc_distances_release(nm->topo, d[k]);
}

static int load(struct ape__numa *nm, const char *xml, const char *fn, char *note, size_t len)
{
	if (hwloc_topology_init(&nm->topo)) {
		nm->topo = NULL;
		snprintf(note, len, "hwloc_topology_init: %s", strerror(errno));
		return xml ? ape__error(APE_ENOMEM, "%s: %s", fn, note) : APE_EIO;
	}
	/* PCI devices and the bridges above them, which carry each device's locality; no OS
	 * devices (disks, NICs), which would only cost time */
	hwloc_topology_set_io_types_filter(nm->topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
	hwloc_topology_set_type_filter(nm->topo, HWLOC_OBJ_OS_DEVICE, HWLOC_TYPE_FILTER_KEEP_NONE);
	for (size_t i = 0; i < sizeof(unwanted_components) / sizeof(unwanted_components[0]); i++)
		hwloc_topology_set_components(nm->topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST,
					      unwanted_components[i]); /* -1: not installed */
	/* hwloc parses the file in set_xml already, or in load: either way it is no topology */
	if ((xml && hwloc_topology_set_xml(nm->topo, xml)) || hwloc_topology_load(nm->topo)) {
		snprintf(note, len, "hwloc cannot load the topology: %s", strerror(errno));
		if (xml)
			return ape__error(APE_EFORMAT,
					  "%s: topology XML file \"%s\": not an hwloc topology "
					  "(lstopo --of xml FILE writes one)", fn, xml);
		return APE_EIO;
	}
	/* never trust an explicit file to be this machine, whatever HWLOC_THISSYSTEM says:
	 * binding calls on it would bind for real */
	nm->real = !xml && hwloc_topology_is_thissystem(nm->topo);
	describe_source(nm, xml);
	load_distances(nm);
	return 0;
}

int ape__numa_open(const char *xml, const char *fn, struct ape__numa **out, char *note,
		   size_t note_len)
{
	struct ape__numa *nm;
	int ret;

	*out = NULL;
	note[0] = '\0';
	if (xml && (ret = check_xml_file(xml, fn)))
		return ret;
	nm = ape__calloc(1, sizeof(*nm));
	if (!nm) {
		snprintf(note, note_len, "out of memory");
		return ape__error(APE_ENOMEM, "%s: out of memory loading the topology", fn);
	}
	ret = load(nm, xml, fn, note, note_len);
	if (ret) {
		ape__numa_close(nm);
		return ret;
	}
	*out = nm;
	return 0;
}

void ape__numa_close(struct ape__numa *nm)
{
	if (!nm)
		return;
	if (nm->topo)
		hwloc_topology_destroy(nm->topo);
	free(nm->os);
	free(nm->dist);
	free(nm);
}

bool ape__numa_is_real(const struct ape__numa *nm)
{
	return nm && nm->real;
}

const char *ape__numa_source(const struct ape__numa *nm)
{
	return nm ? nm->source : "";
}

void ape__numa_counts(const struct ape__numa *nm, int *nodes, int *packages, int *cores, int *pus)
{
	*nodes = hwloc_get_nbobjs_by_type(nm->topo, HWLOC_OBJ_NUMANODE);
	*packages = hwloc_get_nbobjs_by_type(nm->topo, HWLOC_OBJ_PACKAGE);
	*cores = hwloc_get_nbobjs_by_type(nm->topo, HWLOC_OBJ_CORE);
	*pus = hwloc_get_nbobjs_by_type(nm->topo, HWLOC_OBJ_PU);
}

void ape__numa_all(const struct ape__numa *nm, char *nodes, size_t nodes_len, char *cpus,
		   size_t cpus_len)
{
	hwloc_bitmap_list_snprintf(nodes, nodes_len, hwloc_topology_get_allowed_nodeset(nm->topo));
	hwloc_bitmap_list_snprintf(cpus, cpus_len, hwloc_topology_get_allowed_cpuset(nm->topo));
}

int ape__numa_node(const struct ape__numa *nm, int index, ape_numa_info *info)
{
	hwloc_obj_t o = hwloc_get_obj_by_type(nm->topo, HWLOC_OBJ_NUMANODE, (unsigned)index);

	if (!o)
		return APE_EINVAL;
	memset(info, 0, sizeof(*info));
	info->index = index;
	info->os_index = (int)o->os_index;
	info->memory_bytes = o->attr ? o->attr->numanode.local_memory : 0;
	if (o->cpuset && !hwloc_bitmap_iszero(o->cpuset))
		hwloc_bitmap_list_snprintf(info->cpuset, sizeof(info->cpuset), o->cpuset);
	return 0;
}

static int node_pos(const struct ape__numa *nm, int os)
{
	for (int i = 0; i < nm->nnodes; i++)
		if (nm->os[i] == os)
			return i;
	return -1;
}

int ape__numa_distance(const struct ape__numa *nm, int from, int to)
{
	int a = node_pos(nm, from), b = node_pos(nm, to);

	if (a < 0 || b < 0)
		return -1;
	return nm->dist ? (int)nm->dist[a * nm->nnodes + b] : 0;
}

static void info_str(hwloc_obj_t o, const char *name, char *buf, size_t len)
{
	const char *v = hwloc_obj_get_info_by_name(o, name);

	if (v)
		snprintf(buf, len, "%s", v);
}

int ape__numa_pci_scan(const struct ape__numa *nm, struct ape__sighting **out)
{
	struct ape__sighting *s = NULL;
	hwloc_obj_t o = NULL;
	int n = 0, cap = 0;

	*out = NULL;
	while ((o = hwloc_get_next_pcidev(nm->topo, o))) {
		const struct hwloc_pcidev_attr_s *pa = &o->attr->pcidev;
		struct ape__pci_addr a = { pa->domain, pa->bus, pa->dev, pa->func };
		struct ape__sighting *x;

		if (!ape__pci_compute_class(pa->class_id))
			continue;
		if (n == cap) {
			cap = cap ? 2 * cap : 8;
			x = ape__realloc(s, (size_t)cap * sizeof(*s));
			if (!x) {
				free(s);
				return ape__error(APE_ENOMEM, "out of memory scanning the PCI bus");
			}
			s = x;
		}
		x = &s[n++];
		memset(x, 0, sizeof(*x));
		x->device_index = -1;
		ape__pci_format(&a, x->pci_address, sizeof(x->pci_address));
		x->vendor_id = pa->vendor_id;
		x->device_id = pa->device_id;
		x->pci_class = pa->class_id;
		x->kind = (pa->class_id >> 8) == 0x03 ? APE_DEVICE_GPU : APE_DEVICE_ACCELERATOR;
		/* names exist only when hwloc had the PCI id database (or the XML carries them) */
		info_str(o, "PCIDevice", x->name, sizeof(x->name));
		info_str(o, "PCIVendor", x->vendor, sizeof(x->vendor));
	}
	*out = s;
	return n;
}

static hwloc_obj_t pcidev(const struct ape__numa *nm, const struct ape__pci_addr *a)
{
	return hwloc_get_pcidev_by_busid(nm->topo, a->domain, a->bus, a->dev, a->func);
}

int ape__numa_pci_locality(const struct ape__numa *nm, const struct ape__pci_addr *a,
			   char *nodes, size_t nodes_len, char *cpus, size_t cpus_len)
{
	hwloc_obj_t o = pcidev(nm, a), anc;

	nodes[0] = cpus[0] = '\0';
	if (!o)
		return APE_ENODEV;
	anc = hwloc_get_non_io_ancestor_obj(nm->topo, o);
	if (!anc || !anc->nodeset || !anc->cpuset)
		return APE_ENODEV;
	hwloc_bitmap_list_snprintf(nodes, nodes_len, anc->nodeset);
	hwloc_bitmap_list_snprintf(cpus, cpus_len, anc->cpuset);
	return 0;
}

/* Bridges strictly between `o` and its ancestor `anc`. */
static int bridges_between(hwloc_obj_t o, hwloc_obj_t anc)
{
	int n = 0;

	for (o = o->parent; o && o != anc; o = o->parent)
		n += o->type == HWLOC_OBJ_BRIDGE;
	return n;
}

/* hwloc_get_common_ancestor_obj() compares depths, which I/O objects do not have in a way it
 * can use: walk the parents instead. */
static hwloc_obj_t common_ancestor(hwloc_obj_t a, hwloc_obj_t b)
{
	for (hwloc_obj_t x = a; x; x = x->parent)
		for (hwloc_obj_t y = b; y; y = y->parent)
			if (x == y)
				return x;
	return NULL;
}

int ape__numa_pci_link(const struct ape__numa *nm, const struct ape__pci_addr *a,
		       const struct ape__pci_addr *b)
{
	hwloc_obj_t oa = pcidev(nm, a), ob = pcidev(nm, b), anc, na, nb;

	if (!oa || !ob)
		return APE_LINK_UNKNOWN;
	if (oa == ob)
		return APE_LINK_SELF;
	anc = common_ancestor(oa, ob);
	if (!anc)
		return APE_LINK_UNKNOWN;
	if (anc->type == HWLOC_OBJ_BRIDGE) {
		if (anc->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST)
			return APE_LINK_PHB;
		/* a switch is an upstream port over downstream ports: one bridge per side */
		return bridges_between(oa, anc) <= 1 && bridges_between(ob, anc) <= 1
			       ? APE_LINK_PIX
			       : APE_LINK_PXB;
	}
	if (anc->type == HWLOC_OBJ_PCI_DEVICE)
		return APE_LINK_PIX;
	na = hwloc_get_non_io_ancestor_obj(nm->topo, oa);
	nb = hwloc_get_non_io_ancestor_obj(nm->topo, ob);
	if (na && nb && na->nodeset && nb->nodeset &&
	    hwloc_bitmap_isequal(na->nodeset, nb->nodeset))
		return APE_LINK_NODE;
	return APE_LINK_SYS;
}

static int neg_errno(int fallback)
{
	return errno > 0 ? -errno : fallback;
}

int ape__numa_alloc(struct ape__numa *nm, size_t bytes, ape_numa_policy policy, const char *nodes,
		    void **out)
{
	hwloc_bitmap_t set = hwloc_bitmap_alloc();
	hwloc_membind_policy_t how =
		policy == APE_NUMA_INTERLEAVE ? HWLOC_MEMBIND_INTERLEAVE : HWLOC_MEMBIND_BIND;
	int ret = 0;

	*out = NULL;
	if (!set)
		return APE_ENOMEM;
	if (hwloc_bitmap_list_sscanf(set, nodes) || hwloc_bitmap_iszero(set)) {
		hwloc_bitmap_free(set);
		return APE_EINVAL;
	}
	errno = 0;
	/* strict: a binding hwloc cannot enforce must fail here, not become a silent malloc */
	*out = hwloc_alloc_membind(nm->topo, bytes, set, how,
				   HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_STRICT);
	if (!*out)
		ret = neg_errno(APE_ENOMEM);
	hwloc_bitmap_free(set);
	return ret;
}

void ape__numa_free(struct ape__numa *nm, void *p, size_t bytes)
{
	if (p)
		hwloc_free(nm->topo, p, bytes);
}

int ape__numa_bind_thread(struct ape__numa *nm, const char *cpus)
{
	hwloc_bitmap_t set = hwloc_bitmap_alloc(), cur = hwloc_bitmap_alloc();
	int ret = 0;

	if (!set || !cur) {
		ret = APE_ENOMEM;
		goto out_free;
	}
	if (hwloc_bitmap_list_sscanf(set, cpus) || hwloc_bitmap_iszero(set)) {
		ret = APE_EINVAL;
		goto out_free;
	}
	/* stay within the affinity the thread was given (taskset, a launcher's pinning): narrow
	 * it to the device's CPUs, never widen it */
	if (!hwloc_get_cpubind(nm->topo, cur, HWLOC_CPUBIND_THREAD))
		hwloc_bitmap_and(set, set, cur);
	if (hwloc_bitmap_iszero(set))
		ret = -EXDEV;
	else if (hwloc_set_cpubind(nm->topo, set, HWLOC_CPUBIND_THREAD))
		ret = neg_errno(APE_EINVAL);
out_free:
	hwloc_bitmap_free(set);
	hwloc_bitmap_free(cur);
	return ret;
}

int ape__numa_area_nodes(struct ape__numa *nm, const void *p, size_t len, char *nodes,
			 size_t nodes_len)
{
	hwloc_bitmap_t set = hwloc_bitmap_alloc();
	int ret = 0;

	nodes[0] = '\0';
	if (!set)
		return APE_ENOMEM;
	if (hwloc_get_area_memlocation(nm->topo, p, len, set, HWLOC_MEMBIND_BYNODESET))
		ret = neg_errno(APE_EINVAL);
	else
		hwloc_bitmap_list_snprintf(nodes, nodes_len, set);
	hwloc_bitmap_free(set);
	return ret;
}
