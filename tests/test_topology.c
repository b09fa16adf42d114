/* SPDX-License-Identifier: MIT */
/*
 * The physical device list as pure logic (runtime/topo/topology.c), on injected device lists: what
 * CUDA, OpenCL, DRM and the PCI bus scan report about imaginary machines, and what the merge
 * must make of it. PCI addresses, the merge identity rules, the order, the reasons a user reads
 * when a GPU sits idle, the visible-devices filter, lookup by index and address, and the staging
 * placement decision. No hardware, no hwloc, no libdrm.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "topo/topology.h"

/* A sighting; device_index matters only for those of a compute API, which always give it. */
#define SIGHT(...) ((struct ape__sighting){ __VA_ARGS__ })
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static bool has(const char *s, const char *needle)
{
	return s && needle && strstr(s, needle);
}

#define EXPECT_MSG(needle)                                                                         \
	EXPECT_TRUE(has(ape_last_error(), needle))                                                 \
	TH_LOG("last error \"%s\" does not mention \"%s\"", ape_last_error(), needle)

/* Backends of the imaginary machines. */
static const ape_backend_info no_cuda_built[] = {
	{ "cuda", false, false, 0, "not built into this libape (nvcc not found at build time)" },
	{ "opencl", true, true, 1, "" },
	{ "ref", true, true, 1, "" },
};
static const ape_backend_info no_libcuda[] = {
	{ "cuda", true, false, 0, "libcuda.so.1 not found" },
	{ "opencl", true, false, 0, "no OpenCL platform (is an ICD such as pocl-opencl-icd "
				    "installed?)" },
	{ "ref", true, true, 1, "" },
};
static const ape_backend_info all_there[] = {
	{ "cuda", true, true, 2, "" },
	{ "opencl", true, true, 3, "" },
	{ "ref", true, true, 1, "" },
};

static const struct ape__sighting ref_dev =
	SIGHT(.api = APE_API_HOST, .kind = APE_DEVICE_HOST_REFERENCE,
	      .name = "reference (plain C, float64)", .vendor = "libape", .device_index = 9,
	      .backend = "ref");

/* Merges `s` and checks the invariants every list must keep: indices, order, no duplicates. */
static struct ape__phys *merge(struct __test_metadata *_metadata, const struct ape__sighting *s,
			       int n, const ape_backend_info *be, int nbe, int *count, int *where)
{
	struct ape__merge_input in = { s, n, be, nbe, NULL };
	struct ape__phys *p = NULL;

	*count = -1;
	EXPECT_EQ(0, ape__topology_merge(&in, &p, count, where));
	for (int i = 0; i < *count; i++) {
		EXPECT_EQ(i, p[i].info.index);
		if (i && p[i].has_pci && p[i - 1].has_pci)
			EXPECT_GT(0, ape__pci_cmp(&p[i - 1].pci, &p[i].pci))
			TH_LOG("%s before %s", p[i - 1].info.pci_address, p[i].info.pci_address);
		if (i && p[i].has_pci)
			EXPECT_TRUE(p[i - 1].has_pci) TH_LOG("entry %d: PCI devices come first", i);
		EXPECT_EQ(-1, p[i].info.numa_node) TH_LOG("placement is not the merge's business");
		EXPECT_EQ(p[i].info.usable, p[i].info.device_index >= 0);
	}
	return p;
}

#define MERGE(s, be, count, where) merge(_metadata, s, N_OF(s), be, N_OF(be), count, where)

/* ---------------------------------------------------------------- PCI addresses */

TEST(pci_address_forms)
{
	static const struct {
		const char *in, *canonical;
	} ok[] = {
		{ "0000:03:00.0", "0000:03:00.0" },	{ "03:00.0", "0000:03:00.0" },
		{ "0000:C1:1F.7", "0000:c1:1f.7" },	{ "3:0.1", "0000:03:00.1" },
		{ "10000:e1:00.0", "10000:e1:00.0" }, /* Intel VMD domain */
		{ "0001:00:00.0", "0001:00:00.0" },	{ "ffff:ff:1f.7", "ffff:ff:1f.7" },
		{ "fffffff:00:00.0", "fffffff:00:00.0" },
	};
	static const char *const bad[] = {
		"", "0000:03:00", "0000:03:00.", "0000:03:20.0", "0000:03:00.8", "0000:3g:00.0",
		"0000:003:00.0", "0000:03:00.0x", " 0000:03:00.0", "0000:03:00.0 ", "-1:03:00.0",
		"0000::00.0", "12345678:00:00.0", "0000:03.00.0", "0:0:03:00.0", "03-00.0", "gpu",
		"0000:+3:00.0", "03:00.00",
	};
	struct ape__pci_addr a;
	char buf[16];

	for (int i = 0; i < N_OF(ok); i++) {
		ASSERT_EQ(0, ape__pci_parse(ok[i].in, &a)) TH_LOG("\"%s\" refused", ok[i].in);
		ape__pci_format(&a, buf, sizeof(buf));
		EXPECT_STREQ(ok[i].canonical, buf);
	}
	for (int i = 0; i < N_OF(bad); i++) {
		EXPECT_EQ(APE_EINVAL, ape__pci_parse(bad[i], &a)) TH_LOG("\"%s\" accepted", bad[i]);
	}
	EXPECT_EQ(APE_EINVAL, ape__pci_parse(NULL, &a));
}

TEST(pci_address_order)
{
	static const char *const sorted[] = { "0000:00:02.0", "0000:00:02.1", "0000:00:1f.0",
					      "0000:01:00.0", "0000:c1:00.0", "0001:00:00.0",
					      "10000:00:00.0" };
	struct ape__pci_addr a, b;

	for (int i = 0; i < N_OF(sorted); i++) {
		for (int j = 0; j < N_OF(sorted); j++) {
			ASSERT_EQ(0, ape__pci_parse(sorted[i], &a));
			ASSERT_EQ(0, ape__pci_parse(sorted[j], &b));
			EXPECT_EQ((i > j) - (i < j), ape__pci_cmp(&a, &b))
			TH_LOG("%s vs %s", sorted[i], sorted[j]);
		}
	}
}

TEST(list_sets)
{
	EXPECT_EQ(3, ape__list_count("0-1,5"));
	EXPECT_EQ(16, ape__list_count("0-7,16-23"));
	EXPECT_EQ(0, ape__list_count(""));
	EXPECT_EQ(0, ape__list_count("x"));
	EXPECT_EQ(0, ape__list_count("3-1"));
	EXPECT_EQ(0, ape__list_count("1,"));
	EXPECT_EQ(8, ape__list_first("8-15,24-31"));
	EXPECT_EQ(-1, ape__list_first(""));
	EXPECT_TRUE(ape__list_has("0-7,16-23", 17));
	EXPECT_FALSE(ape__list_has("0-7,16-23", 8));
	EXPECT_FALSE(ape__list_has(NULL, 0));
}

/* ---------------------------------------------------------------- identity */

TEST(one_gpu_through_every_api_is_one_device)
{
	const struct ape__sighting s[] = {
		SIGHT(.api = APE_API_OPENCL, .pci_address = "0000:1B:00.0", .kind = APE_DEVICE_GPU,
		      .name = "NVIDIA H100 80GB HBM3 (OpenCL)", .vendor = "NVIDIA Corporation",
		      .device_index = 2, .backend = "opencl", .compute_units = 132),
		SIGHT(.api = 0, .pci_address = "0000:1b:00.0", .vendor_id = 0x10de,
		      .device_id = 0x2330, .pci_class = 0x0302),
		SIGHT(.api = APE_API_DRM, .pci_address = "0000:1b:00.0", .vendor_id = 0x10de,
		      .device_id = 0x2330, .kind = APE_DEVICE_GPU,
		      .render_node = "/dev/dri/renderD128"),
		SIGHT(.api = APE_API_CUDA, .pci_address = "1b:00.0", .kind = APE_DEVICE_GPU,
		      .name = "NVIDIA H100 80GB HBM3", .vendor = "NVIDIA", .device_index = 0,
		      .backend = "cuda", .memory_bytes = 85520809984ull, .compute_units = 132),
		ref_dev,
	};
	int where[N_OF(s)], n;
	struct ape__phys *p = MERGE(s, all_there, &n, where);
	const ape_physical_info *g = &p[0].info;

	ASSERT_EQ(2, n);
	EXPECT_STREQ("0000:1b:00.0", g->pci_address);
	EXPECT_EQ(APE_API_CUDA | APE_API_OPENCL | APE_API_DRM, g->apis);
	EXPECT_EQ(0x10de, g->pci_vendor_id);
	EXPECT_EQ(0x2330, g->pci_device_id);
	EXPECT_EQ(APE_DEVICE_GPU, g->kind);
	EXPECT_STREQ("/dev/dri/renderD128", g->render_node);
	EXPECT_STREQ("cuda", g->backend) TH_LOG("CUDA drives NVIDIA GPUs by default");
	EXPECT_EQ(0, g->device_index);
	EXPECT_TRUE(g->usable);
	EXPECT_STREQ("", g->reason);
	EXPECT_EQ(85520809984ull, g->memory_bytes);
	EXPECT_EQ(132, g->compute_units);
	/* the first compute API to report it names it; the bus scan never overrides that */
	EXPECT_STREQ("NVIDIA H100 80GB HBM3 (OpenCL)", g->name);
	EXPECT_EQ(0, p[0].logical[APE__API_SLOT_CUDA]);
	EXPECT_EQ(2, p[0].logical[APE__API_SLOT_OPENCL]);
	for (int i = 0; i < 4; i++) {
		EXPECT_EQ(0, where[i]);
	}
	EXPECT_EQ(1, where[4]);
	EXPECT_EQ(APE_DEVICE_HOST_REFERENCE, p[1].info.kind);
	EXPECT_STREQ("ref", p[1].info.backend);
	EXPECT_EQ(9, p[1].info.device_index);
	free(p);
}

TEST(identical_gpus_on_two_buses_are_two_devices)
{
	const struct ape__sighting s[] = {
		SIGHT(.api = APE_API_CUDA, .pci_address = "0000:c3:00.0", .kind = APE_DEVICE_GPU,
		      .name = "NVIDIA A100-SXM4-80GB", .vendor = "NVIDIA", .device_index = 1,
		      .backend = "cuda"),
		SIGHT(.api = APE_API_CUDA, .pci_address = "0000:07:00.0", .kind = APE_DEVICE_GPU,
		      .name = "NVIDIA A100-SXM4-80GB", .vendor = "NVIDIA", .device_index = 0,
		      .backend = "cuda"),
		SIGHT(.api = 0, .pci_address = "0000:c3:00.0", .vendor_id = 0x10de,
		      .device_id = 0x20b2, .pci_class = 0x0302),
		SIGHT(.api = 0, .pci_address = "0000:07:00.0", .vendor_id = 0x10de,
		      .device_id = 0x20b2, .pci_class = 0x0302),
	};
	int where[N_OF(s)], n;
	struct ape__phys *p = MERGE(s, all_there, &n, where);

	ASSERT_EQ(2, n);
	EXPECT_STREQ("0000:07:00.0", p[0].info.pci_address);
	EXPECT_STREQ("0000:c3:00.0", p[1].info.pci_address);
	EXPECT_EQ(0, p[0].info.device_index);
	EXPECT_EQ(1, p[1].info.device_index);
	EXPECT_EQ(1, where[0]);
	EXPECT_EQ(0, where[1]);
	EXPECT_EQ(1, where[2]);
	EXPECT_EQ(0, where[3]);
	free(p);
}

TEST(order_pci_then_unaddressed_then_cpu_then_reference)
{
	const struct ape__sighting s[] = {
		ref_dev,
		SIGHT(.api = APE_API_OPENCL, .kind = APE_DEVICE_CPU, .name = "pthread-zen4",
		      .vendor = "AuthenticAMD", .device_index = 5, .backend = "opencl"),
		SIGHT(.api = 0, .pci_address = "0001:00:00.0", .vendor_id = 0x1002,
		      .device_id = 0x740f, .pci_class = 0x0380),
		SIGHT(.api = APE_API_OPENCL, .kind = APE_DEVICE_GPU, .name = "mystery GPU",
		      .vendor = "Acme", .device_index = 4, .backend = "opencl"),
		SIGHT(.api = 0, .pci_address = "0000:41:00.1", .vendor_id = 0x1002,
		      .device_id = 0x740f, .pci_class = 0x0380),
		SIGHT(.api = 0, .pci_address = "0000:41:00.0", .vendor_id = 0x1002,
		      .device_id = 0x740f, .pci_class = 0x0380),
		SIGHT(.api = APE_API_OPENCL, .kind = APE_DEVICE_CPU, .name = "Intel CPU runtime",
		      .vendor = "Intel(R) Corporation", .device_index = 6, .backend = "opencl"),
	};
	static const char *const order[] = { "0000:41:00.0", "0000:41:00.1", "0001:00:00.0" };
	int where[N_OF(s)], n;
	struct ape__phys *p = MERGE(s, no_cuda_built, &n, where);

	ASSERT_EQ(6, n);
	for (int i = 0; i < 3; i++) {
		EXPECT_STREQ(order[i], p[i].info.pci_address);
	}
	EXPECT_STREQ("mystery GPU", p[3].info.name);
	EXPECT_STREQ("", p[3].info.pci_address);
	/* two OpenCL platforms reporting the CPU: one CPU, driven by the preferred one */
	EXPECT_EQ(APE_DEVICE_CPU, p[4].info.kind);
	EXPECT_STREQ("pthread-zen4", p[4].info.name);
	EXPECT_EQ(5, p[4].info.device_index);
	EXPECT_EQ(4, where[1]);
	EXPECT_EQ(4, where[6]);
	EXPECT_EQ(APE_DEVICE_HOST_REFERENCE, p[5].info.kind);
	EXPECT_EQ(5, where[0]);
	free(p);
}

/* An OpenCL GPU that does not give its address is the one GPU of its vendor OpenCL does not
 * otherwise reach, when that is unambiguous; never a guess between two. */
TEST(unaddressed_opencl_gpu_matches_only_when_unambiguous)
{
	const struct ape__sighting one[] = {
		SIGHT(.api = APE_API_OPENCL, .kind = APE_DEVICE_GPU, .name = "gfx90a:sramecc+:xnack-",
		      .vendor = "Advanced Micro Devices, Inc.", .device_index = 0,
		      .backend = "opencl"),
		SIGHT(.api = 0, .pci_address = "0000:41:00.0", .vendor_id = 0x1002,
		      .device_id = 0x740f, .pci_class = 0x0380),
	};
	const struct ape__sighting two[] = {
		one[0],
		one[1],
		SIGHT(.api = 0, .pci_address = "0000:c1:00.0", .vendor_id = 0x1002,
		      .device_id = 0x740f, .pci_class = 0x0380),
	};
	int where1[N_OF(one)], where2[N_OF(two)], n;
	struct ape__phys *p = MERGE(one, no_cuda_built, &n, where1);

	ASSERT_EQ(1, n);
	EXPECT_STREQ("0000:41:00.0", p[0].info.pci_address);
	EXPECT_EQ(APE_API_OPENCL, p[0].info.apis);
	EXPECT_STREQ("gfx90a:sramecc+:xnack-", p[0].info.name);
	EXPECT_TRUE(p[0].info.usable);
	free(p);

	p = MERGE(two, no_cuda_built, &n, where2);
	ASSERT_EQ(3, n);
	EXPECT_FALSE(p[0].info.usable);
	EXPECT_FALSE(p[1].info.usable);
	EXPECT_STREQ("", p[2].info.pci_address);
	EXPECT_TRUE(p[2].info.usable);
	EXPECT_EQ(2, where2[0]);
	free(p);
}

/* ---------------------------------------------------------------- why a GPU sits idle */

static const struct ape__sighting nvidia_on_bus =
	SIGHT(.api = 0, .pci_address = "0000:03:00.0", .vendor_id = 0x10de, .device_id = 0x2330,
	      .pci_class = 0x0302);

TEST(nvidia_gpu_without_cuda_backend)
{
	const struct ape__sighting s[] = { nvidia_on_bus, ref_dev };
	int n;
	struct ape__phys *p = MERGE(s, no_cuda_built, &n, NULL);

	ASSERT_EQ(2, n);
	EXPECT_FALSE(p[0].info.usable);
	EXPECT_EQ(-1, p[0].info.device_index);
	EXPECT_STREQ("cuda", p[0].info.backend);
	EXPECT_EQ(0u, p[0].info.apis);
	EXPECT_STREQ("NVIDIA GPU [10de:2330]", p[0].info.name);
	EXPECT_STREQ("NVIDIA", p[0].info.vendor);
	EXPECT_STREQ("NVIDIA GPU at 0000:03:00.0 but cuda: not built into this libape (nvcc not "
		     "found at build time)",
		     p[0].info.reason);
	free(p);
}

TEST(nvidia_gpu_without_libcuda)
{
	const struct ape__sighting s[] = { nvidia_on_bus };
	int n;
	struct ape__phys *p = MERGE(s, no_libcuda, &n, NULL);

	ASSERT_EQ(1, n);
	EXPECT_FALSE(p[0].info.usable);
	EXPECT_STREQ("NVIDIA GPU at 0000:03:00.0 but cuda: libcuda.so.1 not found",
		     p[0].info.reason);
	free(p);
}

TEST(nvidia_gpu_cuda_does_not_report)
{
	const struct ape__sighting s[] = {
		nvidia_on_bus,
		SIGHT(.api = APE_API_CUDA, .pci_address = "0000:04:00.0", .kind = APE_DEVICE_GPU,
		      .name = "NVIDIA H100", .vendor = "NVIDIA", .device_index = 0,
		      .backend = "cuda"),
	};
	int n;
	struct ape__phys *p = MERGE(s, all_there, &n, NULL);

	ASSERT_EQ(2, n);
	EXPECT_STREQ("NVIDIA GPU at 0000:03:00.0 but cuda does not report it", p[0].info.reason);
	EXPECT_TRUE(p[1].info.usable);
	free(p);
}

TEST(nvidia_gpu_through_opencl_when_cuda_is_missing)
{
	const struct ape__sighting s[] = {
		nvidia_on_bus,
		SIGHT(.api = APE_API_OPENCL, .pci_address = "0000:03:00.0", .kind = APE_DEVICE_GPU,
		      .name = "NVIDIA H100 80GB HBM3", .vendor = "NVIDIA Corporation",
		      .device_index = 0, .backend = "opencl"),
	};
	int n;
	struct ape__phys *p = MERGE(s, no_cuda_built, &n, NULL);

	ASSERT_EQ(1, n);
	EXPECT_TRUE(p[0].info.usable);
	EXPECT_STREQ("opencl", p[0].info.backend);
	EXPECT_EQ(0, p[0].info.device_index);
	EXPECT_STREQ("cuda: not built into this libape (nvcc not found at build time); driven "
		     "through opencl",
		     p[0].info.reason);
	free(p);
}

TEST(other_vendors_and_accelerators)
{
	const struct ape__sighting s[] = {
		SIGHT(.api = 0, .pci_address = "0000:c1:00.0", .vendor_id = 0x1002,
		      .device_id = 0x740f, .pci_class = 0x0380),
		SIGHT(.api = 0, .pci_address = "0000:33:00.0", .vendor_id = 0x1da3,
		      .device_id = 0x1020, .pci_class = 0x1200),
		SIGHT(.api = 0, .pci_address = "0000:34:00.0", .vendor_id = 0x1234,
		      .device_id = 0x5678, .pci_class = 0x0b40),
		SIGHT(.api = APE_API_DRM, .kind = APE_DEVICE_GPU, .name = "arm,mali-valhall-csf",
		      .render_node = "/dev/dri/renderD129"),
	};
	int n;
	struct ape__phys *p = MERGE(s, no_cuda_built, &n, NULL);

	ASSERT_EQ(3, n) TH_LOG("QEMU's vendor id marks a display-only device: left out");
	EXPECT_STREQ("Habana Labs accelerator at 0000:33:00.0 but no OpenCL driver reports it",
		     p[0].info.reason);
	EXPECT_EQ(APE_DEVICE_ACCELERATOR, p[0].info.kind);
	EXPECT_STREQ("opencl", p[0].info.backend);
	EXPECT_STREQ("AMD GPU at 0000:c1:00.0 but no OpenCL driver reports it", p[1].info.reason);
	EXPECT_STREQ("AMD GPU [1002:740f]", p[1].info.name);
	EXPECT_EQ(APE_API_DRM, p[2].info.apis);
	EXPECT_STREQ("arm,mali-valhall-csf", p[2].info.name);
	EXPECT_STREQ("GPU at /dev/dri/renderD129 but no OpenCL driver reports it",
		     p[2].info.reason);
	free(p);

	p = MERGE(s, no_libcuda, &n, NULL);
	ASSERT_EQ(3, n);
	EXPECT_STREQ("AMD GPU at 0000:c1:00.0 but opencl: no OpenCL platform (is an ICD such as "
		     "pocl-opencl-icd installed?)",
		     p[1].info.reason);
	free(p);
}

TEST(display_controllers_are_not_compute_devices)
{
	const struct ape__sighting s[] = {
		SIGHT(.api = 0, .pci_address = "0000:02:00.0", .vendor_id = 0x1a03,
		      .device_id = 0x2000, .pci_class = 0x0300), /* ASPEED BMC */
		SIGHT(.api = APE_API_DRM, .pci_address = "0000:00:01.0", .vendor_id = 0x1af4,
		      .device_id = 0x1050, .render_node = "/dev/dri/renderD128"), /* virtio-gpu */
		ref_dev,
	};
	int where[N_OF(s)], n;
	struct ape__phys *p = MERGE(s, all_there, &n, where);

	ASSERT_EQ(1, n);
	EXPECT_EQ(APE_DEVICE_HOST_REFERENCE, p[0].info.kind);
	EXPECT_EQ(-1, where[0]);
	EXPECT_EQ(-1, where[1]);
	free(p);
}

TEST(another_machine)
{
	const struct ape__sighting s[] = { nvidia_on_bus };
	struct ape__merge_input in = { s, 1, all_there, N_OF(all_there),
				       "described by XML file x.xml: not on this machine" };
	struct ape__phys *p;
	int n;

	ASSERT_EQ(0, ape__topology_merge(&in, &p, &n, NULL));
	ASSERT_EQ(1, n);
	EXPECT_FALSE(p[0].info.usable);
	EXPECT_STREQ("cuda", p[0].info.backend);
	EXPECT_STREQ("described by XML file x.xml: not on this machine", p[0].info.reason);
	free(p);
}

TEST(empty_input)
{
	struct ape__merge_input in = { NULL, 0, all_there, N_OF(all_there), NULL };
	struct ape__phys *p = (struct ape__phys *)&in;
	int n = 7;

	ASSERT_EQ(0, ape__topology_merge(&in, &p, &n, NULL));
	EXPECT_EQ(0, n);
	EXPECT_EQ(NULL, p);
}

/* ---------------------------------------------------------------- filter and lookup */

/* Four GPUs on two sockets, the CPU, the reference: indices 0-5. */
static struct ape__phys *server(struct __test_metadata *_metadata, int *n)
{
	static const struct ape__sighting s[] = {
		SIGHT(.api = APE_API_CUDA, .pci_address = "0000:c1:00.0", .kind = APE_DEVICE_GPU,
		      .name = "GPU c1", .vendor = "NVIDIA", .device_index = 3, .backend = "cuda"),
		SIGHT(.api = APE_API_CUDA, .pci_address = "0000:41:00.0", .kind = APE_DEVICE_GPU,
		      .name = "GPU 41", .vendor = "NVIDIA", .device_index = 1, .backend = "cuda"),
		SIGHT(.api = APE_API_CUDA, .pci_address = "0000:01:00.0", .kind = APE_DEVICE_GPU,
		      .name = "GPU 01", .vendor = "NVIDIA", .device_index = 0, .backend = "cuda"),
		SIGHT(.api = APE_API_CUDA, .pci_address = "0000:81:00.0", .kind = APE_DEVICE_GPU,
		      .name = "GPU 81", .vendor = "NVIDIA", .device_index = 2, .backend = "cuda"),
		SIGHT(.api = APE_API_OPENCL, .kind = APE_DEVICE_CPU, .name = "cpu",
		      .vendor = "AuthenticAMD", .device_index = 4, .backend = "opencl"),
		SIGHT(.api = APE_API_HOST, .kind = APE_DEVICE_HOST_REFERENCE, .name = "ref",
		      .vendor = "libape", .device_index = 5, .backend = "ref"),
	};

	return merge(_metadata, s, N_OF(s), all_there, N_OF(all_there), n, NULL);
}

TEST(find_by_index_or_address)
{
	int n;
	struct ape__phys *p = server(_metadata, &n);

	ASSERT_EQ(6, n);
	EXPECT_EQ(0, ape__topology_find(p, n, "0", "t"));
	EXPECT_EQ(5, ape__topology_find(p, n, "5", "t"));
	EXPECT_EQ(2, ape__topology_find(p, n, "0000:81:00.0", "t"));
	EXPECT_STREQ("GPU 81", p[2].info.name);
	EXPECT_EQ(3, ape__topology_find(p, n, "C1:00.0", "t"));
	EXPECT_EQ(APE_ENODEV, ape__topology_find(p, n, "6", "t"));
	EXPECT_MSG("there are 6 physical devices");
	EXPECT_EQ(APE_ENODEV, ape__topology_find(p, n, "99999999999", "t"));
	EXPECT_EQ(APE_ENODEV, ape__topology_find(p, n, "0000:82:00.0", "t"));
	EXPECT_MSG("no device at PCI address 0000:82:00.0");
	EXPECT_EQ(APE_EINVAL, ape__topology_find(p, n, "0000:82:00", "t"));
	EXPECT_MSG("\"0000:82:00\" is neither a device index nor a PCI address");
	EXPECT_EQ(APE_EINVAL, ape__topology_find(p, n, "-1", "t"));
	EXPECT_EQ(APE_EINVAL, ape__topology_find(p, n, "", "t"));
	free(p);
}

TEST(visible_devices_filter)
{
	static const struct {
		const char *list;
		const char *kept; /* names, in order */
	} ok[] = {
		{ "1", "GPU 41,ref" },
		{ "0000:81:00.0,0", "GPU 01,GPU 81,ref" },
		{ " 3 , 0000:41:00.0 ", "GPU 41,GPU c1,ref" },
		{ "4", "cpu,ref" },
		{ "5", "ref" },
		{ "0,0,0000:01:00.0", "GPU 01,ref" },
	};
	static const struct {
		const char *list, *msg;
		int err;
	} bad[] = {
		{ "7", "device index 7: there are 6 physical devices", APE_ENODEV },
		{ "0000:99:00.0", "no device at PCI address 0000:99:00.0", APE_ENODEV },
		{ "gpu0", "\"gpu0\" is neither a device index nor a PCI address", APE_EINVAL },
		{ "0,,1", "\"\" is neither", APE_EINVAL },
		{ "1;2", "\"1;2\" is neither", APE_EINVAL },
	};
	bool keep[8];
	int n;

	for (int i = 0; i < N_OF(ok); i++) {
		struct ape__phys *p = server(_metadata, &n);
		char names[256] = "";
		int m;

		ASSERT_EQ(0, ape__topology_visible(p, n, ok[i].list, "fn", "APE_VISIBLE_DEVICES",
						   keep))
		TH_LOG("%s: %s", ok[i].list, ape_last_error());
		m = ape__topology_compact(p, n, keep);
		for (int j = 0; j < m; j++) {
			EXPECT_EQ(j, p[j].info.index);
			snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s%s",
				 j ? "," : "", p[j].info.name);
		}
		EXPECT_STREQ(ok[i].kept, names) TH_LOG("list \"%s\"", ok[i].list);
		free(p);
	}
	for (int i = 0; i < N_OF(bad); i++) {
		struct ape__phys *p = server(_metadata, &n);

		EXPECT_EQ(bad[i].err, ape__topology_visible(p, n, bad[i].list, "fn",
							    "APE_VISIBLE_DEVICES", keep))
		TH_LOG("list \"%s\"", bad[i].list);
		EXPECT_MSG(bad[i].msg);
		EXPECT_MSG("APE_VISIBLE_DEVICES");
		free(p);
	}
}

/* ---------------------------------------------------------------- staging placement */

TEST(staging_decisions)
{
	static const struct {
		ape_numa_policy policy;
		const char *dev_nodes, *all_nodes;
		ape_numa_policy placed;
		const char *nodes;
		bool why;
	} cases[] = {
		{ APE_NUMA_LOCAL, "1", "0-1", APE_NUMA_LOCAL, "1", false },
		{ APE_NUMA_LOCAL, "0-1", "0-1", APE_NUMA_INTERLEAVE, "0-1", false },
		{ APE_NUMA_LOCAL, "", "0-1", APE_NUMA_OFF, "", true },
		{ APE_NUMA_LOCAL, "", "0", APE_NUMA_LOCAL, "0", false },
		{ APE_NUMA_LOCAL, "0", "0", APE_NUMA_LOCAL, "0", false },
		{ APE_NUMA_INTERLEAVE, "1", "0-3", APE_NUMA_INTERLEAVE, "0-3", false },
		{ APE_NUMA_INTERLEAVE, "", "0-1", APE_NUMA_INTERLEAVE, "0-1", false },
		{ APE_NUMA_OFF, "1", "0-1", APE_NUMA_OFF, "", false },
		{ APE_NUMA_LOCAL, "1", "", APE_NUMA_OFF, "", false }, /* no topology at all */
	};

	for (int i = 0; i < N_OF(cases); i++) {
		struct ape__staging st;
		char why[128] = "x";

		ape__staging_decide(cases[i].policy, cases[i].dev_nodes, cases[i].all_nodes, &st,
				    why, sizeof(why));
		EXPECT_EQ(cases[i].placed, st.policy) TH_LOG("case %d", i);
		EXPECT_STREQ(cases[i].nodes, st.nodes) TH_LOG("case %d", i);
		EXPECT_EQ(cases[i].why, why[0] != '\0') TH_LOG("case %d: why \"%s\"", i, why);
	}
}

TEST_HARNESS_MAIN
