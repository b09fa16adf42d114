/* SPDX-License-Identifier: MIT */
/*
 * Placement decisions on realistic servers, read from the hwloc XML files in tests/fixtures/
 * (made by gen-fixtures.py): for every device of every fixture the NUMA node, the local CPUs,
 * where a staging buffer would be placed under each policy, and how devices connect. The tables
 * below were written from the machines' descriptions, not from libape's output.
 *
 * A context reading an XML file describes another machine: the tests also check that nothing is
 * ever bound for real then, and that bad files are refused with a message naming them.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/pages.h"
#include "core/context.h"
#include "topo/placement.h"
#include "topo/topology.h"

#define FIXTURE_DIR APE_SOURCE_DIR "/tests/fixtures/"
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static bool has(const char *s, const char *needle)
{
	return s && needle && strstr(s, needle);
}

#define EXPECT_MSG(needle)                                                                         \
	EXPECT_TRUE(has(ape_last_error(), needle))                                                 \
	TH_LOG("last error \"%s\" does not mention \"%s\"", ape_last_error(), needle)

struct want_dev {
	const char *pci, *name, *vendor;
	ape_device_kind kind;
	const char *backend;
	int node;
	const char *nodes, *cpus;
	ape_numa_policy staging; /* under APE_NUMA_LOCAL */
	const char *staging_nodes;
};

struct want_machine {
	const char *file;
	int nodes, packages, cores, pus;
	const char *all_nodes;
	int ndev;
	const struct want_dev *dev;
	const char *const *links; /* one row per device: link names separated by spaces */
	int d01; /* distance between nodes 0 and 1 (0: none, or one node) */
};

#define H100(pci, node, cpus)                                                                      \
	{ pci, "GH100 [H100 SXM5 80GB]", "NVIDIA Corporation", APE_DEVICE_GPU, "cuda", node, #node, \
	  cpus, APE_NUMA_LOCAL, #node }

static const struct want_dev dgx_dev[] = {
	H100("0000:1b:00.0", 0, "0-7,16-23"),  H100("0000:43:00.0", 0, "0-7,16-23"),
	H100("0000:52:00.0", 0, "0-7,16-23"),  H100("0000:61:00.0", 0, "0-7,16-23"),
	H100("0000:9d:00.0", 1, "8-15,24-31"), H100("0000:c3:00.0", 1, "8-15,24-31"),
	H100("0000:d1:00.0", 1, "8-15,24-31"), H100("0000:df:00.0", 1, "8-15,24-31"),
};
static const char *const dgx_links[] = {
	"X NODE NODE NODE SYS SYS SYS SYS", "NODE X NODE NODE SYS SYS SYS SYS",
	"NODE NODE X NODE SYS SYS SYS SYS", "NODE NODE NODE X SYS SYS SYS SYS",
	"SYS SYS SYS SYS X NODE NODE NODE", "SYS SYS SYS SYS NODE X NODE NODE",
	"SYS SYS SYS SYS NODE NODE X NODE", "SYS SYS SYS SYS NODE NODE NODE X",
};

static const struct want_dev two_vendor_dev[] = {
	{ "0000:41:00.0", "AMD GPU [1002:740f]", "AMD", APE_DEVICE_GPU, "opencl", 0, "0", "0-7",
	  APE_NUMA_LOCAL, "0" },
	{ "0000:c1:00.0", "NVIDIA GPU [10de:26b9]", "NVIDIA", APE_DEVICE_GPU, "cuda", 1, "1",
	  "8-15", APE_NUMA_LOCAL, "1" },
};
static const char *const two_vendor_links[] = { "X SYS", "SYS X" };

static const struct want_dev switch_dev[] = {
	{ "0000:03:00.0", "AMD accelerator [1002:74a1]", "AMD", APE_DEVICE_ACCELERATOR, "opencl",
	  0, "0", "0-15", APE_NUMA_LOCAL, "0" },
	{ "0000:06:00.0", "AMD accelerator [1002:74a1]", "AMD", APE_DEVICE_ACCELERATOR, "opencl",
	  0, "0", "0-15", APE_NUMA_LOCAL, "0" },
	{ "0000:83:00.0", "NVIDIA GPU [10de:20b5]", "NVIDIA", APE_DEVICE_GPU, "cuda", 1, "1",
	  "16-31", APE_NUMA_LOCAL, "1" },
	{ "0000:84:00.0", "NVIDIA GPU [10de:20b5]", "NVIDIA", APE_DEVICE_GPU, "cuda", 1, "1",
	  "16-31", APE_NUMA_LOCAL, "1" },
	{ "0000:91:00.0", "Habana Labs accelerator [1da3:1020]", "Habana Labs",
	  APE_DEVICE_ACCELERATOR, "opencl", 1, "1", "16-31", APE_NUMA_LOCAL, "1" },
	/* the firmware does not say where this host bridge is: local to the whole machine, its
	 * staging buffers spread over both nodes */
	{ "0000:a0:00.0", "Intel GPU [8086:56c0]", "Intel", APE_DEVICE_GPU, "opencl", -1, "0-1",
	  "0-31", APE_NUMA_INTERLEAVE, "0-1" },
};
static const char *const switch_links[] = {
	"X PXB SYS SYS SYS SYS", "PXB X SYS SYS SYS SYS",   "SYS SYS X PIX NODE SYS",
	"SYS SYS PIX X NODE SYS", "SYS SYS NODE NODE X SYS", "SYS SYS SYS SYS SYS X",
};

static const struct want_dev laptop_dev[] = {
	{ "0000:00:02.0", "Intel GPU [8086:7d55]", "Intel", APE_DEVICE_GPU, "opencl", 0, "0", "0-7",
	  APE_NUMA_LOCAL, "0" },
	{ "0000:00:0b.0", "Intel accelerator [8086:7d1d]", "Intel", APE_DEVICE_ACCELERATOR,
	  "opencl", 0, "0", "0-7", APE_NUMA_LOCAL, "0" },
	{ "0000:01:00.0", "NVIDIA GPU [10de:28e0]", "NVIDIA", APE_DEVICE_GPU, "cuda", 0, "0", "0-7",
	  APE_NUMA_LOCAL, "0" },
};
static const char *const laptop_links[] = { "X PHB PHB", "PHB X PHB", "PHB PHB X" };

static const struct want_machine machines[] = {
	{ "dual-socket-8gpu.xml", 2, 2, 16, 32, "0-1", N_OF(dgx_dev), dgx_dev, dgx_links, 21 },
	{ "two-vendors.xml", 2, 2, 8, 16, "0-1", N_OF(two_vendor_dev), two_vendor_dev,
	  two_vendor_links, 32 },
	{ "pcie-switch.xml", 2, 1, 16, 32, "0-1", N_OF(switch_dev), switch_dev, switch_links, 12 },
	{ "laptop.xml", 1, 1, 4, 8, "0", N_OF(laptop_dev), laptop_dev, laptop_links, 0 },
};

static ape_context *xml_context(const char *file, ape_numa_policy numa, const char *visible)
{
	ape_context_options o;
	ape_context *ctx = NULL;
	char path[512];

	snprintf(path, sizeof(path), "%s%s", FIXTURE_DIR, file);
	ape_context_options_init(&o);
	o.backends = "ref";
	o.topology_xml = path;
	o.numa = numa;
	o.visible_devices = visible;
	if (ape_context_create(&ctx, &o))
		fprintf(stderr, "# %s: %s\n", file, ape_last_error());
	return ctx;
}

/* ---------------------------------------------------------------- every device, every policy */

static void check_device(struct __test_metadata *_metadata, const struct want_machine *w,
			 const struct want_dev *d, const ape_physical_info *p, ape_numa_policy pol)
{
	char reason[640];

	EXPECT_STREQ(d->pci, p->pci_address);
	EXPECT_STREQ(d->name, p->name);
	EXPECT_STREQ(d->vendor, p->vendor);
	EXPECT_EQ(d->kind, p->kind);
	EXPECT_STREQ(d->backend, p->backend);
	EXPECT_EQ(d->node, p->numa_node);
	EXPECT_STREQ(d->nodes, p->numa_nodes);
	EXPECT_STREQ(d->cpus, p->cpuset);
	EXPECT_EQ(0u, p->apis) TH_LOG("no API of this machine reaches %s", d->pci);
	EXPECT_FALSE(p->usable);
	EXPECT_EQ(-1, p->device_index);
	snprintf(reason, sizeof(reason), "described by XML file %s%s: not on this machine",
		 FIXTURE_DIR, w->file);
	EXPECT_STREQ(reason, p->reason);
	switch (pol) {
	case APE_NUMA_LOCAL:
		EXPECT_EQ(d->staging, p->staging_policy);
		EXPECT_STREQ(d->staging_nodes, p->staging_nodes);
		break;
	case APE_NUMA_INTERLEAVE:
		EXPECT_EQ(APE_NUMA_INTERLEAVE, p->staging_policy);
		EXPECT_STREQ(w->all_nodes, p->staging_nodes);
		break;
	default:
		EXPECT_EQ(APE_NUMA_OFF, p->staging_policy);
		EXPECT_STREQ("", p->staging_nodes);
	}
}

static void check_machine(struct __test_metadata *_metadata, const struct want_machine *w,
			  ape_numa_policy pol)
{
	ape_context *ctx = xml_context(w->file, pol, NULL);
	ape_topology_info t;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(0, ape_topology_get_info(ctx, &t));
	EXPECT_FALSE(t.this_machine);
	EXPECT_TRUE(has(t.source, w->file)) TH_LOG("source \"%s\"", t.source);
	EXPECT_EQ(w->nodes, t.numa_nodes);
	EXPECT_EQ(w->packages, t.packages);
	EXPECT_EQ(w->cores, t.cores);
	EXPECT_EQ(w->pus, t.pus);
	EXPECT_EQ(pol, t.numa_policy);
	EXPECT_TRUE(has(t.drm_note, "not scanned")) TH_LOG("DRM of this machine is not that one");
	ASSERT_EQ(w->ndev, ape_physical_get_info(ctx, 0, NULL));
	for (int i = 0; i < w->ndev; i++) {
		ape_physical_info p;

		ASSERT_EQ(0, ape_physical_get_info(ctx, i, &p));
		EXPECT_EQ(i, p.index);
		check_device(_metadata, w, &w->dev[i], &p, pol);
	}
	ape_context_destroy(ctx);
}

TEST(every_device_every_policy)
{
	static const ape_numa_policy pols[] = { APE_NUMA_LOCAL, APE_NUMA_INTERLEAVE, APE_NUMA_OFF };

	for (int m = 0; m < N_OF(machines); m++) {
		for (int k = 0; k < N_OF(pols); k++) {
			check_machine(_metadata, &machines[m], pols[k]);
		}
	}
}

TEST(policy_from_environment)
{
	ape_context *ctx;
	ape_physical_info p;

	ASSERT_EQ(0, setenv("APE_NUMA", "interleave", 1));
	ctx = xml_context("dual-socket-8gpu.xml", APE_NUMA_DEFAULT, NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(0, ape_physical_get_info(ctx, 7, &p));
	EXPECT_EQ(APE_NUMA_INTERLEAVE, p.staging_policy);
	EXPECT_STREQ("0-1", p.staging_nodes);
	ape_context_destroy(ctx);
	/* the option wins over the environment */
	ctx = xml_context("dual-socket-8gpu.xml", APE_NUMA_LOCAL, NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(0, ape_physical_get_info(ctx, 7, &p));
	EXPECT_EQ(APE_NUMA_LOCAL, p.staging_policy);
	EXPECT_STREQ("1", p.staging_nodes);
	ape_context_destroy(ctx);
}

/* ---------------------------------------------------------------- connections */

TEST(device_links)
{
	for (int m = 0; m < N_OF(machines); m++) {
		const struct want_machine *w = &machines[m];
		ape_context *ctx = xml_context(w->file, APE_NUMA_DEFAULT, NULL);

		ASSERT_NE(NULL, ctx);
		for (int i = 0; i < w->ndev; i++) {
			char row[256] = "";

			for (int j = 0; j < w->ndev; j++) {
				int link = ape_physical_link(ctx, i, j);

				EXPECT_EQ(link, ape_physical_link(ctx, j, i)) TH_LOG("symmetric");
				snprintf(row + strlen(row), sizeof(row) - strlen(row), "%s%s",
					 j ? " " : "", ape_link_name(link));
			}
			EXPECT_STREQ(w->links[i], row) TH_LOG("%s, device %d", w->file, i);
		}
		ape_context_destroy(ctx);
	}
}

TEST(numa_nodes_and_distances)
{
	for (int m = 0; m < N_OF(machines); m++) {
		const struct want_machine *w = &machines[m];
		ape_context *ctx = xml_context(w->file, APE_NUMA_DEFAULT, NULL);
		ape_numa_info ni;

		ASSERT_NE(NULL, ctx);
		ASSERT_EQ(w->nodes, ape_numa_get_info(ctx, 0, NULL));
		for (int i = 0; i < w->nodes; i++) {
			ASSERT_EQ(0, ape_numa_get_info(ctx, i, &ni));
			EXPECT_EQ(i, ni.index);
			EXPECT_EQ(i, ni.os_index);
			EXPECT_LT(0, ni.memory_bytes);
			EXPECT_EQ(w->pus / w->nodes, ape__list_count(ni.cpuset)) TH_LOG("%s", ni.cpuset);
		}
		EXPECT_EQ(APE_EINVAL, ape_numa_get_info(ctx, w->nodes, &ni));
		if (w->nodes == 2) {
			EXPECT_EQ(10, ape_numa_distance(ctx, 0, 0));
			EXPECT_EQ(w->d01, ape_numa_distance(ctx, 0, 1));
			EXPECT_EQ(w->d01, ape_numa_distance(ctx, 1, 0));
		} else {
			EXPECT_EQ(0, ape_numa_distance(ctx, 0, 0)) TH_LOG("no distance table");
		}
		EXPECT_EQ(APE_EINVAL, ape_numa_distance(ctx, 0, 9));
		EXPECT_MSG("no such NUMA node");
		ape_context_destroy(ctx);
	}
}

/* ---------------------------------------------------------------- choosing on a fixture */

TEST(visible_devices_and_selection)
{
	ape_context *ctx = xml_context("dual-socket-8gpu.xml", APE_NUMA_DEFAULT,
				       "0000:9d:00.0, 2");
	ape_physical_info p;
	ape_selection sel;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(2, ape_physical_get_info(ctx, 0, NULL));
	ASSERT_EQ(0, ape_physical_get_info(ctx, 0, &p));
	EXPECT_STREQ("0000:52:00.0", p.pci_address) TH_LOG("still ordered by PCI address");
	EXPECT_EQ(0, p.index);
	ASSERT_EQ(0, ape_physical_get_info(ctx, 1, &p));
	EXPECT_STREQ("0000:9d:00.0", p.pci_address);
	EXPECT_EQ(1, p.numa_node);
	EXPECT_EQ(APE_ENOBACKEND, ape_device_select_spec(ctx, "0000:9d:00.0", &sel));
	EXPECT_MSG("described by XML file");
	EXPECT_EQ(APE_ENOBACKEND, ape_device_select_spec(ctx, "1", &sel));
	EXPECT_EQ(APE_ENODEV, ape_device_select_spec(ctx, "0000:1b:00.0", &sel))
	TH_LOG("hidden by the filter");
	EXPECT_MSG("no device at PCI address 0000:1b:00.0");
	EXPECT_EQ(APE_ENODEV, ape_device_select_spec(ctx, "2", &sel));
	/* the context still computes on this machine's devices */
	ASSERT_EQ(0, ape_device_select_spec(ctx, "ref", &sel)) TH_LOG("%s", ape_last_error());
	ape_context_destroy(ctx);

	ctx = (ape_context *)&sel;
	EXPECT_EQ(APE_ENODEV, ape_context_create(&ctx, &(ape_context_options){
		.struct_size = sizeof(ape_context_options), .backends = "ref",
		.topology_xml = FIXTURE_DIR "laptop.xml", .visible_devices = "3" }));
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG("ape_context_create");
	EXPECT_MSG("ape_context_options.visible_devices");
	EXPECT_MSG("device index 3: there are 3 physical devices");
}

/* ---------------------------------------------------------------- nothing becomes real */

static int capture_stderr(int *saved)
{
	char path[] = "/tmp/ape-test-stderr.XXXXXX";
	int fd = mkstemp(path);

	if (fd < 0)
		return -1;
	unlink(path);
	fflush(stderr);
	*saved = dup(2);
	dup2(fd, 2);
	return fd;
}

static void restore_stderr(int fd, int saved, char *buf, size_t cap)
{
	ssize_t n;

	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	n = pread(fd, buf, cap - 1, 0);
	buf[n > 0 ? n : 0] = '\0';
	close(fd);
}

static int count(const char *s, const char *needle)
{
	int n = 0;

	for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle))
		n++;
	return n;
}

struct bind_try {
	ape_device *dev;
	int ret;
	char before[256], after[256];
};

static void *try_bind(void *arg)
{
	struct bind_try *b = arg;

	test_affinity_list(b->before, sizeof(b->before));
	b->ret = ape__bind_thread(b->dev);
	test_affinity_list(b->after, sizeof(b->after));
	return NULL;
}

TEST(xml_context_never_binds)
{
	ape_context *ctx = xml_context("dual-socket-8gpu.xml", APE_NUMA_LOCAL, NULL);
	struct ape__hostmem m1, m2;
	struct bind_try b = { 0 };
	ape_copy_result res;
	ape_device_info di;
	char err[4096];
	pthread_t t;
	uint64_t mask;
	int mode, fd, saved;

	ASSERT_NE(NULL, ctx);
	b.dev = test_device(ctx, "ref");
	ASSERT_NE(NULL, b.dev);
	ASSERT_EQ(0, ape_device_get_info(b.dev, &di));
	EXPECT_EQ(-1, di.physical_index) TH_LOG("this machine's reference is not in that file");
	EXPECT_EQ(-1, di.numa_node);
	EXPECT_STREQ("", di.cpuset);

	fd = capture_stderr(&saved);
	ASSERT_LE(0, fd);
	ASSERT_EQ(0, ape__host_alloc(b.dev, 1 << 20, &m1));
	ASSERT_EQ(0, ape__host_alloc(b.dev, 1 << 16, &m2));
	restore_stderr(fd, saved, err, sizeof(err));
	EXPECT_EQ(APE_NUMA_OFF, m1.placed);
	EXPECT_FALSE(m1.hwloc);
	EXPECT_EQ(1, count(err, "libape: NUMA placement off")) TH_LOG("stderr: %s", err);
	EXPECT_TRUE(has(err, "dual-socket-8gpu.xml")) TH_LOG("stderr: %s", err);
	memset(m1.ptr, 1, m1.bytes);
	ASSERT_EQ(0, test_page_policy(m1.ptr, &mode, &mask));
	EXPECT_EQ(TEST_MPOL_DEFAULT, mode) TH_LOG("a plain allocation, bound to nothing");
	EXPECT_EQ(2u, (unsigned)atomic_load(&ctx->staging_plain));
	EXPECT_EQ(0u, (unsigned)atomic_load(&ctx->staging_placed));
	ape__host_free(b.dev, &m1);
	ape__host_free(b.dev, &m2);
	ape__host_free(b.dev, &m2); /* freeing twice is harmless */

	fd = capture_stderr(&saved);
	ASSERT_LE(0, fd);
	ASSERT_EQ(0, pthread_create(&t, NULL, try_bind, &b));
	ASSERT_EQ(0, pthread_join(t, NULL));
	restore_stderr(fd, saved, err, sizeof(err));
	EXPECT_EQ(0, b.ret);
	EXPECT_STREQ(b.before, b.after);
	EXPECT_EQ(1, count(err, "not bound")) TH_LOG("stderr: %s", err);

	EXPECT_EQ(APE_ENOTSUP, ape_device_measure_h2d(b.dev, 0, 4096, 1, &res));
	EXPECT_MSG("dual-socket-8gpu.xml");
	ape_context_destroy(ctx);
}

/* ---------------------------------------------------------------- bad files */

TEST(bad_topology_files)
{
	char dir[] = "/tmp/ape-test-xml.XXXXXX", path[128];
	ape_context_options o;
	ape_context *ctx;
	FILE *f;

	ASSERT_NE(NULL, mkdtemp(dir));
	ape_context_options_init(&o);
	o.backends = "ref";

	snprintf(path, sizeof(path), "%s/missing.xml", dir);
	o.topology_xml = path;
	ctx = (ape_context *)&o;
	EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, &o));
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG("ape_context_create");
	EXPECT_MSG(path);
	EXPECT_MSG("No such file");

	o.topology_xml = dir;
	EXPECT_EQ(APE_EIO, ape_context_create(&ctx, &o));
	EXPECT_MSG(dir);
	EXPECT_MSG("not a regular file");

	snprintf(path, sizeof(path), "%s/garbage.xml", dir);
	f = fopen(path, "w");
	ASSERT_NE(NULL, f);
	fputs("<topology version=\"2.0\"><object type=\"Machine\" os_index=\"0\"", f);
	fclose(f);
	o.topology_xml = path;
	EXPECT_EQ(APE_EFORMAT, ape_context_create(&ctx, &o));
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG(path);
	EXPECT_MSG("not an hwloc topology");

	f = fopen(path, "w");
	ASSERT_NE(NULL, f);
	fclose(f);
	EXPECT_EQ(APE_EFORMAT, ape_context_create(&ctx, &o)) TH_LOG("an empty file");
	test_rmtree(dir);
}

TEST(getters_refuse_bad_arguments)
{
	ape_context *ctx = xml_context("laptop.xml", APE_NUMA_DEFAULT, NULL);
	ape_physical_info p;
	ape_topology_info t;

	ASSERT_NE(NULL, ctx);
	EXPECT_EQ(APE_EINVAL, ape_physical_get_info(NULL, 0, &p));
	EXPECT_MSG("ape_physical_get_info: ctx = NULL");
	EXPECT_EQ(APE_EINVAL, ape_physical_get_info(ctx, 3, &p));
	EXPECT_MSG("index = 3");
	EXPECT_EQ(APE_EINVAL, ape_physical_get_info(ctx, -1, &p));
	EXPECT_EQ(APE_EINVAL, ape_physical_link(ctx, 0, 3));
	EXPECT_EQ(APE_EINVAL, ape_physical_link(NULL, 0, 0));
	EXPECT_EQ(APE_EINVAL, ape_topology_get_info(ctx, NULL));
	EXPECT_EQ(APE_EINVAL, ape_topology_get_info(NULL, &t));
	EXPECT_EQ(APE_EINVAL, ape_numa_get_info(NULL, 0, NULL));
	EXPECT_EQ(APE_EINVAL, ape_numa_distance(NULL, 0, 0));
	EXPECT_STREQ("X", ape_link_name(APE_LINK_SELF));
	EXPECT_STREQ("SYS", ape_link_name(APE_LINK_SYS));
	EXPECT_STREQ("-", ape_link_name(APE_LINK_UNKNOWN));
	EXPECT_STREQ("?", ape_link_name(-3));
	EXPECT_STREQ("?", ape_link_name(7));
	ape_context_destroy(ctx);
}

APE_TEST_MAIN_SKIP_UNLESS(APE_TEST_HAVE_HWLOC, APE_TEST_NO_HWLOC)
