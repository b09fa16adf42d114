/* SPDX-License-Identifier: MIT */
/*
 * ape-info: what libape sees on this machine (or in an hwloc XML file): the physical devices,
 * the APIs that reach each one, the backend libape uses for it and why a device sits unused,
 * NUMA placement, each backend's availability, every backend plugin found (loaded, or why not),
 * and with --topology a device-by-device and device-by-node matrix in the spirit of
 * `nvidia-smi topo -m`.
 *
 * Exit status: 0 success; 2 bad arguments or topology file; 1 anything else.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"
#include "ape/ape_backend.h"
#include "common/cli.h"
#include "common/json.h"

enum { OPT_JSON = 1, OPT_TOPOLOGY, OPT_XML, OPT_NUMA, OPT_BACKENDS, OPT_BACKEND_PATH, OPT_HELP };

static const struct cli_option options[] = {
	{ "--json", NULL, false, OPT_JSON },
	{ "--topology", NULL, false, OPT_TOPOLOGY },
	{ "--topology-xml", NULL, true, OPT_XML },
	{ "--numa", NULL, true, OPT_NUMA },
	{ "--backends", NULL, true, OPT_BACKENDS },
	{ "--backend-path", NULL, true, OPT_BACKEND_PATH },
	{ "--help", "-h", false, OPT_HELP },
	{ NULL, NULL, false, 0 },
};

struct info_args {
	bool json, topology;
	const char *xml, *backends, *backend_path;
	ape_numa_policy numa;
};

/* Everything the context says, gathered once. */
struct machine {
	ape_context *ctx;
	ape_topology_info topo;
	int nphys, nnodes, nbackends, nplugins;
	ape_physical_info *phys;
	ape_numa_info *nodes;
	ape_backend_info *backends;
	ape_plugin_info *plugins;
};

static void usage(void)
{
	printf("usage: ape-info [--json] [--topology] [--topology-xml FILE] [--numa POLICY]\n"
	       "                [--backends LIST] [--backend-path PATH]\n"
	       "\n"
	       "Lists the physical devices libape sees: GPUs and accelerators (by PCI address),\n"
	       "the CPU and the reference; the APIs that reach each (CUDA, OpenCL, DRM), the\n"
	       "backend libape uses for it and, when none can, why; its NUMA node and local CPUs;\n"
	       "then each backend's availability, every backend plugin found (its file, whether\n"
	       "it loaded and why not) and the DRM status.\n"
	       "\n"
	       "  --topology           also print how devices connect to each other and to the\n"
	       "                       NUMA nodes, and where staging buffers go\n"
	       "  --topology-xml FILE  describe the machine in an hwloc XML file (lstopo --of xml)\n"
	       "                       instead of this one: its GPUs, their NUMA nodes and CPUs\n"
	       "  --numa POLICY        local, interleave, off, or default: APE_NUMA, else local\n"
	       "                       (the default)\n"
	       "  --backends LIST      load only these backends (cuda,opencl,ref, a plugin's name)\n"
	       "  --backend-path PATH  backend plugins to load: ':'-separated files and folders\n"
	       "                       (libape-backend-*.so in a folder); default APE_BACKEND_PATH\n"
	       "  --json               one JSON object instead of the text\n"
	       "  -h, --help           print this text\n"
	       "  --version            print the libape version and exit\n"
	       "\n"
	       "APE_VISIBLE_DEVICES, APE_NUMA and APE_BACKEND_PATH apply as they do to every\n"
	       "libape program.\n"
	       "Exit status: 0 success; 2 bad arguments or topology file; 1 any other failure.\n");
}

static int parse_args(int argc, char **argv, struct info_args *a, char *msg, size_t len)
{
	const char *val;
	int i = 1, id, word;

	memset(a, 0, sizeof(*a));
	while ((id = cli_next(argc, argv, &i, options, &val, msg, len)) > 0) {
		switch (id) {
		case OPT_JSON:
			a->json = true;
			break;
		case OPT_TOPOLOGY:
			a->topology = true;
			break;
		case OPT_XML:
			a->xml = val;
			break;
		case OPT_BACKENDS:
			a->backends = val;
			break;
		case OPT_BACKEND_PATH:
			a->backend_path = val;
			break;
		case OPT_NUMA:
			if (cli_parse_name("--numa", val, ape_numa_policy_from_name, &word, msg, len))
				return 2;
			a->numa = (ape_numa_policy)word;
			break;
		case OPT_HELP:
			return -1;
		}
	}
	return id < 0 ? 2 : 0;
}

/* ------------------------------------------------------------------ gathering */

static void machine_free(struct machine *m)
{
	free(m->phys);
	free(m->nodes);
	free(m->backends);
	free(m->plugins);
	ape_context_destroy(m->ctx);
}

static int gather(struct machine *m)
{
	int ret = 0;

	ape_topology_get_info(m->ctx, &m->topo);
	m->nphys = ape_physical_get_info(m->ctx, 0, NULL);
	m->nnodes = ape_numa_get_info(m->ctx, 0, NULL);
	m->nbackends = ape_backend_get_info(m->ctx, 0, NULL);
	m->nplugins = ape_plugin_get_info(m->ctx, 0, NULL);
	if (m->nphys < 0 || m->nnodes < 0 || m->nbackends < 0 || m->nplugins < 0)
		return APE_EINVAL;
	m->phys = calloc((size_t)m->nphys + 1, sizeof(*m->phys));
	m->nodes = calloc((size_t)m->nnodes + 1, sizeof(*m->nodes));
	m->backends = calloc((size_t)m->nbackends + 1, sizeof(*m->backends));
	m->plugins = calloc((size_t)m->nplugins + 1, sizeof(*m->plugins));
	if (!m->phys || !m->nodes || !m->backends || !m->plugins)
		return APE_ENOMEM;
	for (int i = 0; i < m->nphys && !ret; i++)
		ret = ape_physical_get_info(m->ctx, i, &m->phys[i]);
	for (int i = 0; i < m->nnodes && !ret; i++)
		ret = ape_numa_get_info(m->ctx, i, &m->nodes[i]);
	for (int i = 0; i < m->nbackends && !ret; i++)
		ret = ape_backend_get_info(m->ctx, i, &m->backends[i]);
	for (int i = 0; i < m->nplugins && !ret; i++)
		ret = ape_plugin_get_info(m->ctx, i, &m->plugins[i]);
	return ret;
}

/* ------------------------------------------------------------------ words */

/* "cuda,opencl,drm"; "-" when only the bus scan found it. */
static void apis_text(unsigned apis, char *buf, size_t len)
{
	size_t n = 0;

	buf[0] = '\0';
	for (unsigned api = 1; api <= APE_API_HOST; api <<= 1)
		if (apis & api)
			n += (size_t)snprintf(buf + n, n < len ? len - n : 0, "%s%s", n ? "," : "",
					      ape_api_name(api));
	if (!buf[0])
		snprintf(buf, len, "-");
}

static void bytes_text(uint64_t b, char *buf, size_t len)
{
	if (!b)
		snprintf(buf, len, "-");
	else if (b >= (1ull << 30))
		snprintf(buf, len, "%.1f GiB", (double)b / (double)(1ull << 30));
	else
		snprintf(buf, len, "%.0f MiB", (double)b / (double)(1ull << 20));
}

static void staging_text(const ape_physical_info *p, char *buf, size_t len)
{
	if (p->staging_policy == APE_NUMA_LOCAL)
		snprintf(buf, len, "bound to node %s", p->staging_nodes);
	else if (p->staging_policy == APE_NUMA_INTERLEAVE)
		snprintf(buf, len, "interleaved over %s", p->staging_nodes);
	else
		snprintf(buf, len, "plain");
}

/* ------------------------------------------------------------------ text */

static void print_header(const struct machine *m)
{
	const ape_topology_info *t = &m->topo;

	printf("libape %s: %s", ape_version_string(), t->source);
	if (t->numa_nodes)
		printf(": %d package%s, %d cores, %d PUs, %d NUMA node%s", t->packages,
		       t->packages == 1 ? "" : "s", t->cores, t->pus, t->numa_nodes,
		       t->numa_nodes == 1 ? "" : "s");
	printf("\nNUMA policy %s\n", t->numa_note);
	if (t->visible_devices[0])
		printf("filtered by %s\n", t->visible_devices);
}

/* Several devices, all unusable for the same reason. */
static bool same_reason(const struct machine *m)
{
	for (int i = 0; i < m->nphys; i++)
		if (m->phys[i].usable || strcmp(m->phys[i].reason, m->phys[0].reason))
			return false;
	return m->nphys > 1;
}

static void print_devices(const struct machine *m)
{
	printf("\n%3s  %-34s %-14s %-12s  %-15s %-7s %4s  %-16s %9s %4s\n", "#", "name", "vendor",
	       "PCI address", "APIs", "backend", "NUMA", "local CPUs", "memory", "CUs");
	for (int i = 0; i < m->nphys; i++) {
		const ape_physical_info *p = &m->phys[i];
		char apis[32], mem[24], node[64], cus[12];

		apis_text(p->apis, apis, sizeof(apis));
		bytes_text(p->memory_bytes, mem, sizeof(mem));
		if (p->numa_node >= 0)
			snprintf(node, sizeof(node), "%d", p->numa_node);
		else
			snprintf(node, sizeof(node), "%s", p->numa_nodes[0] ? p->numa_nodes : "?");
		if (p->compute_units)
			snprintf(cus, sizeof(cus), "%d", p->compute_units);
		else
			snprintf(cus, sizeof(cus), "-");
		printf("%3d  %-34.34s %-14.14s %-12s  %-15s %-7s %4.8s  %-16.16s %9s %4s\n", p->index,
		       p->name, p->vendor, p->pci_address[0] ? p->pci_address : "-", apis,
		       p->backend, node, p->cpuset[0] ? p->cpuset : "?", mem, cus);
	}
	if (same_reason(m)) { /* a topology file: one reason for all */
		printf("%3s  none usable here: %s\n", "", m->phys[0].reason);
		return;
	}
	for (int i = 0; i < m->nphys; i++)
		if (m->phys[i].reason[0])
			printf("%3d  %s: %s\n", i, m->phys[i].usable ? "note" : "unusable",
			       m->phys[i].reason);
}

/* The driver version of the first device `backend` drives ("" when none says). */
static void backend_driver(const struct machine *m, const char *backend, char *out, size_t cap)
{
	ape_device *devs[64];
	int n = ape_device_list(m->ctx, devs, 64);
	ape_device_info info;

	out[0] = '\0';
	for (int i = 0; i < n; i++)
		if (!ape_device_get_info(devs[i], &info) && !strcmp(info.backend, backend) &&
		    info.driver_version[0]) {
			snprintf(out, cap, ", driver %s", info.driver_version);
			return;
		}
}

static void print_backends(const struct machine *m)
{
	char drv[96];

	printf("\nbackends%s:\n", m->topo.this_machine ? "" : " (of this machine)");
	for (int i = 0; i < m->nbackends; i++) {
		const ape_backend_info *b = &m->backends[i];

		backend_driver(m, b->name, drv, sizeof(drv));
		if (b->available)
			printf("  %-8s available: %d device%s%s\n", b->name, b->device_count,
			       b->device_count == 1 ? "" : "s", drv);
		else
			printf("  %-8s not available: %s\n", b->name, b->reason);
	}
}

/* Every plugin found, in the order found: its file, then its name, whether it loaded (with its
 * devices) and the ABI it states, or why it did not load. */
static void print_plugins(const struct machine *m)
{
	if (!m->nplugins) {
		printf("plugins: none found\n");
		return;
	}
	printf("plugins:\n");
	for (int i = 0; i < m->nplugins; i++) {
		const ape_plugin_info *p = &m->plugins[i];
		char abi[32] = "";

		if (p->abi_major || p->abi_minor)
			snprintf(abi, sizeof(abi), " (ABI %u.%u)", p->abi_major, p->abi_minor);
		printf("  %s\n", p->path);
		if (p->loaded)
			printf("    %-8s loaded%s: %d device%s\n", p->name, abi, p->device_count,
			       p->device_count == 1 ? "" : "s");
		else
			printf("    %-8s not loaded%s: %s\n", p->name[0] ? p->name : "-", abi,
			       p->reason);
	}
}

/* Is x in a list-format set ("0-3,8")? */
static bool numa_member(const char *list, int x)
{
	const char *p = list;

	while (*p) {
		char *end;
		long lo = strtol(p, &end, 10), hi = lo;

		if (end == p)
			return false;
		if (*end == '-')
			hi = strtol(end + 1, &end, 10);
		if (x >= lo && x <= hi)
			return true;
		if (*end != ',')
			return false;
		p = end + 1;
	}
	return false;
}

static int distance(const struct machine *m, int from, int to)
{
	int d = ape_numa_distance(m->ctx, from, to);

	return d > 0 ? d : 0;
}

static void print_links(const struct machine *m)
{
	printf("\ndevice to device:\n%6s", "");
	for (int j = 0; j < m->nphys; j++) {
		char head[16];

		snprintf(head, sizeof(head), "D%d", j);
		printf(" %5s", head);
	}
	printf("  %-18s %s\n", "CPU affinity", "NUMA");
	for (int i = 0; i < m->nphys; i++) {
		printf("D%-5d", i);
		for (int j = 0; j < m->nphys; j++)
			printf(" %5s", ape_link_name(ape_physical_link(m->ctx, i, j)));
		printf("  %-18s %s\n", m->phys[i].cpuset[0] ? m->phys[i].cpuset : "?",
		       m->phys[i].numa_nodes[0] ? m->phys[i].numa_nodes : "?");
	}
	printf("\n  X    = the same device\n"
	       "  SYS  = across NUMA nodes, over the SMP interconnect (UPI, Infinity Fabric)\n"
	       "  NODE = between PCIe host bridges within one NUMA node\n"
	       "  PHB  = through a PCIe host bridge (the CPU's root complex)\n"
	       "  PXB  = through several PCIe bridges, no host bridge\n"
	       "  PIX  = through at most one PCIe bridge or switch\n"
	       "  -    = not both on the PCI bus\n");
}

/* Distances from a device's own nodes to every node: * marks its nodes. */
static void print_nodes(const struct machine *m)
{
	printf("\ndevice to NUMA node (distance; * = local)%s:\n%6s",
	       m->nnodes && !distance(m, m->nodes[0].os_index, m->nodes[0].os_index)
		       ? " (no distance table)"
		       : "",
	       "");
	for (int k = 0; k < m->nnodes; k++) {
		char head[16];

		snprintf(head, sizeof(head), "N%d", m->nodes[k].os_index);
		printf(" %6s", head);
	}
	printf("  staging buffers\n");
	for (int i = 0; i < m->nphys; i++) {
		const ape_physical_info *p = &m->phys[i];
		char st[96];

		printf("D%-5d", i);
		for (int k = 0; k < m->nnodes; k++) {
			int to = m->nodes[k].os_index, best = 0;
			char cell[16];

			for (int k2 = 0; k2 < m->nnodes; k2++) {
				int from = m->nodes[k2].os_index, d = distance(m, from, to);

				if (numa_member(p->numa_nodes, from) && d && (!best || d < best))
					best = d;
			}
			if (!p->numa_nodes[0])
				snprintf(cell, sizeof(cell), "?");
			else if (best)
				snprintf(cell, sizeof(cell), "%d%s", best,
					 numa_member(p->numa_nodes, to) ? "*" : "");
			else
				snprintf(cell, sizeof(cell), "%s",
					 numa_member(p->numa_nodes, to) ? "*" : "-");
			printf(" %6s", cell);
		}
		staging_text(p, st, sizeof(st));
		printf("  %s\n", st);
	}
}

/* The capabilities device d states ("diag backward ..."; "-" when none), into buf. */
static void caps_text(const ape_device *d, char *buf, size_t len)
{
	const uint64_t caps = ape_device_capabilities(d);
	size_t n = 0;

	buf[0] = '\0';
	for (int i = 0; i < 64 && n < len; i++)
		if ((caps >> i) & 1)
			n += (size_t)snprintf(buf + n, len - n, "%s%s", n ? " " : "",
					      ape_be_cap_name((uint64_t)1 << i) ?
						      ape_be_cap_name((uint64_t)1 << i) :
						      "?");
	if (!buf[0])
		snprintf(buf, len, "-");
}

/* What each device of the context can do, as its backend states it (ape_device_capabilities()). */
static void print_capabilities(const struct machine *m)
{
	ape_device *devs[64];
	const int n = ape_device_list(m->ctx, devs, 64);

	printf("capabilities:\n");
	for (int i = 0; i < n; i++) {
		ape_device_info info;
		char spec[48], caps[256];

		if (ape_device_get_info(devs[i], &info))
			continue;
		snprintf(spec, sizeof(spec), "%s:%d", info.backend, info.backend_index);
		caps_text(devs[i], caps, sizeof(caps));
		printf("  %-10s %s\n", spec, caps);
	}
}

static void print_text(const struct machine *m, bool topology)
{
	print_header(m);
	print_devices(m);
	if (topology) {
		print_links(m);
		print_nodes(m);
	}
	print_backends(m);
	print_plugins(m);
	print_capabilities(m);
	printf("DRM: %s\n", m->topo.drm_note);
}

/* ------------------------------------------------------------------ JSON */

static void json_kv(const char *key, const char *val, bool last)
{
	printf("\"%s\": ", key);
	json_string(stdout, val);
	printf("%s", last ? "" : ", ");
}

static void json_machine(const struct machine *m)
{
	const ape_topology_info *t = &m->topo;

	printf(" \"machine\": {");
	json_kv("source", t->source, false);
	printf("\"this_machine\": %s, \"packages\": %d, \"cores\": %d, \"pus\": %d, "
	       "\"numa_nodes\": %d, ", t->this_machine ? "true" : "false", t->packages, t->cores,
	       t->pus, t->numa_nodes);
	json_kv("numa_policy", ape_numa_policy_name(t->numa_policy), false);
	json_kv("numa_note", t->numa_note, false);
	json_kv("drm", t->drm_note, false);
	json_kv("visible_devices", t->visible_devices, true);
	printf("},\n \"numa_nodes\": [");
	for (int i = 0; i < m->nnodes; i++) {
		const ape_numa_info *n = &m->nodes[i];

		printf("%s\n  {\"index\": %d, \"os_index\": %d, \"memory_bytes\": %" PRIu64 ", ",
		       i ? "," : "", n->index, n->os_index, n->memory_bytes);
		json_kv("cpuset", n->cpuset, false);
		printf("\"distances\": [");
		for (int k = 0; k < m->nnodes; k++)
			printf("%s%d", k ? ", " : "", distance(m, n->os_index, m->nodes[k].os_index));
		printf("]}");
	}
	printf("\n ],\n");
}

static void json_device(const struct machine *m, const ape_physical_info *p)
{
	printf("  {\"index\": %d, ", p->index);
	json_kv("name", p->name, false);
	json_kv("vendor", p->vendor, false);
	printf("\"pci_vendor_id\": %u, \"pci_device_id\": %u, ", p->pci_vendor_id,
	       p->pci_device_id);
	json_kv("pci_address", p->pci_address, false);
	json_kv("kind", ape_device_kind_name(p->kind), false);
	printf("\"apis\": [");
	for (unsigned api = 1, n = 0; api <= APE_API_HOST; api <<= 1)
		if (p->apis & api)
			printf("%s\"%s\"", n++ ? ", " : "", ape_api_name(api));
	printf("], ");
	json_kv("render_node", p->render_node, false);
	printf("\"usable\": %s, ", p->usable ? "true" : "false");
	json_kv("reason", p->reason, false);
	printf("\"device_index\": %d, ", p->device_index);
	json_kv("backend", p->backend, false);
	printf("\"numa_node\": %d, ", p->numa_node);
	json_kv("numa_nodes", p->numa_nodes, false);
	json_kv("cpuset", p->cpuset, false);
	printf("\"staging\": {");
	json_kv("policy", ape_numa_policy_name(p->staging_policy), false);
	json_kv("nodes", p->staging_nodes, true);
	printf("}, \"memory_bytes\": %" PRIu64 ", \"compute_units\": %d, \"links\": [",
	       p->memory_bytes, p->compute_units);
	for (int j = 0; j < m->nphys; j++)
		printf("%s\"%s\"", j ? ", " : "", ape_link_name(ape_physical_link(m->ctx, p->index, j)));
	printf("]}");
}

static void print_json(const struct machine *m)
{
	printf("{\"libape\": \"%s\",\n", ape_version_string());
	json_machine(m);
	printf(" \"devices\": [\n");
	for (int i = 0; i < m->nphys; i++) {
		json_device(m, &m->phys[i]);
		printf("%s\n", i + 1 < m->nphys ? "," : "");
	}
	printf(" ],\n \"backends\": [");
	for (int i = 0; i < m->nbackends; i++) {
		const ape_backend_info *b = &m->backends[i];

		printf("%s\n  {", i ? "," : "");
		json_kv("name", b->name, false);
		printf("\"built\": %s, \"available\": %s, \"device_count\": %d, ",
		       b->built ? "true" : "false", b->available ? "true" : "false", b->device_count);
		json_kv("reason", b->reason, true);
		printf("}");
	}
	printf("\n ],\n \"plugins\": [");
	for (int i = 0; i < m->nplugins; i++) {
		const ape_plugin_info *p = &m->plugins[i];

		printf("%s\n  {", i ? "," : "");
		json_kv("path", p->path, false);
		json_kv("name", p->name, false);
		printf("\"loaded\": %s, \"device_count\": %d, \"abi_major\": %u, \"abi_minor\": %u, ",
		       p->loaded ? "true" : "false", p->device_count, p->abi_major, p->abi_minor);
		json_kv("reason", p->reason, true);
		printf("}");
	}
	printf("\n ],\n \"capabilities\": [");
	{
		ape_device *devs[64];
		const int n = ape_device_list(m->ctx, devs, 64);

		for (int i = 0; i < n; i++) {
			ape_device_info info;
			const uint64_t caps = ape_device_capabilities(devs[i]);
			char spec[48];

			if (ape_device_get_info(devs[i], &info))
				continue;
			snprintf(spec, sizeof(spec), "%s:%d", info.backend, info.backend_index);
			printf("%s\n  {", i ? "," : "");
			json_kv("device", spec, false);
			printf("\"capabilities\": [");
			for (int b = 0, k = 0; b < 64; b++)
				if ((caps >> b) & 1) {
					const char *name = ape_be_cap_name((uint64_t)1 << b);

					printf("%s", k++ ? ", " : "");
					json_string(stdout, name ? name : "?");
				}
			printf("]}");
		}
	}
	printf("\n ]}\n");
}

/* ------------------------------------------------------------------ main */

static int exit_code(int err)
{
	return err == APE_EINVAL || err == APE_EIO || err == APE_EFORMAT || err == APE_ENODEV ? 2
											       : 1;
}

int main(int argc, char **argv)
{
	struct info_args a;
	struct machine m;
	ape_context_options opts;
	char msg[512] = "";
	int ret;

	ret = parse_args(argc, argv, &a, msg, sizeof(msg));
	if (ret < 0) {
		usage();
		return fflush(stdout) ? 1 : 0;
	}
	if (ret) {
		fprintf(stderr, "ape-info: %s\n", msg);
		return ret;
	}
	memset(&m, 0, sizeof(m));
	ape_context_options_init(&opts);
	opts.topology_xml = a.xml;
	opts.numa = a.numa;
	opts.backends = a.backends;
	opts.backend_path = a.backend_path;
	ret = ape_context_create(&m.ctx, &opts);
	if (ret) {
		fprintf(stderr, "ape-info: %s\n", ape_last_error());
		return exit_code(ret);
	}
	ret = gather(&m);
	if (ret) {
		fprintf(stderr, "ape-info: %s\n", ape_last_error());
		machine_free(&m);
		return 1;
	}
	if (a.json)
		print_json(&m);
	else
		print_text(&m, a.topology);
	machine_free(&m);
	return fflush(stdout) ? 1 : 0;
}
