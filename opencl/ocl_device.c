/* SPDX-License-Identifier: MIT */
/*
 * Probing: every platform, every device (GPU, CPU, accelerator), one context per device (or the
 * caller's context, for the device it names). A machine without an OpenCL platform is a normal
 * state: zero devices and a reason.
 */
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ocl.h"

/* Vendor queries for the PCI address, defined here because older headers lack them. */
#ifndef CL_DEVICE_PCI_BUS_INFO_KHR
#define CL_DEVICE_PCI_BUS_INFO_KHR 0x410F
#endif
#ifndef CL_DEVICE_PCI_BUS_ID_NV
#define CL_DEVICE_PCI_BUS_ID_NV 0x4008
#endif
#ifndef CL_DEVICE_PCI_SLOT_ID_NV
#define CL_DEVICE_PCI_SLOT_ID_NV 0x4009
#endif
#ifndef CL_DEVICE_PCI_DOMAIN_ID_NV
#define CL_DEVICE_PCI_DOMAIN_ID_NV 0x400A
#endif
#ifndef CL_DEVICE_TOPOLOGY_AMD
#define CL_DEVICE_TOPOLOGY_AMD 0x4037
#endif
#define OCL_TOPOLOGY_TYPE_PCIE_AMD 1
#define OCL_PLATFORM_NOT_FOUND_KHR (-1001)

/* Device ranks (core/backend.h): GPUs in the portable-GPU range, below CUDA's; CPUs and
 * accelerators in the range below, above the reference. */
enum {
	OCL_RANK_CPU = 100,
	OCL_RANK_ACCEL = 150,
	OCL_RANK_GPU = 200,
};

struct ocl_pci_bus_info_khr {
	cl_uint domain, bus, device, function;
};

union ocl_topology_amd {
	struct {
		cl_uint type;
		cl_uint data[5];
	} raw;
	struct {
		cl_uint type;
		cl_char unused[17];
		cl_char bus, device, function;
	} pcie;
};

static void ocl_str(cl_device_id id, cl_device_info what, char *buf, size_t cap)
{
	buf[0] = '\0';
	if (clGetDeviceInfo(id, what, cap - 1, buf, NULL) != CL_SUCCESS)
		buf[0] = '\0';
	buf[cap - 1] = '\0';
}

/* A device's extension string can be longer than any fixed buffer: ask for its size first. */
static int ocl_has_ext(cl_device_id id, const char *ext)
{
	size_t n = 0;
	char *s;
	int found = 0;

	if (clGetDeviceInfo(id, CL_DEVICE_EXTENSIONS, 0, NULL, &n) != CL_SUCCESS || n == 0)
		return 0;
	s = ape_be_malloc(n + 1);
	if (!s)
		return 0;
	if (clGetDeviceInfo(id, CL_DEVICE_EXTENSIONS, n, s, NULL) == CL_SUCCESS) {
		size_t len = strlen(ext);

		s[n] = '\0';
		for (const char *p = strstr(s, ext); p && !found; p = strstr(p + 1, ext))
			found = (p == s || p[-1] == ' ') && (p[len] == ' ' || p[len] == '\0');
	}
	free(s);
	return found;
}

static void ocl_pci_address(cl_device_id id, char *out, size_t cap)
{
	out[0] = '\0';
	if (ocl_has_ext(id, "cl_khr_pci_bus_info")) {
		struct ocl_pci_bus_info_khr pi;

		if (clGetDeviceInfo(id, CL_DEVICE_PCI_BUS_INFO_KHR, sizeof(pi), &pi, NULL) ==
		    CL_SUCCESS) {
			snprintf(out, cap, "%04x:%02x:%02x.%x", pi.domain & 0xffff, pi.bus & 0xff,
				 pi.device & 0x1f, pi.function & 0x7);
			return;
		}
	}
	if (ocl_has_ext(id, "cl_nv_device_attribute_query")) {
		cl_uint bus, slot, domain = 0;

		if (clGetDeviceInfo(id, CL_DEVICE_PCI_BUS_ID_NV, sizeof(bus), &bus, NULL) ==
			    CL_SUCCESS &&
		    clGetDeviceInfo(id, CL_DEVICE_PCI_SLOT_ID_NV, sizeof(slot), &slot, NULL) ==
			    CL_SUCCESS) {
			/* older drivers do not know the domain query: domain 0 then */
			if (clGetDeviceInfo(id, CL_DEVICE_PCI_DOMAIN_ID_NV, sizeof(domain), &domain,
					    NULL) != CL_SUCCESS)
				domain = 0;
			snprintf(out, cap, "%04x:%02x:%02x.%x", domain & 0xffff, bus & 0xff,
				 (slot >> 3) & 0x1f, slot & 0x7);
			return;
		}
	}
	if (ocl_has_ext(id, "cl_amd_device_attribute_query")) {
		union ocl_topology_amd t;

		if (clGetDeviceInfo(id, CL_DEVICE_TOPOLOGY_AMD, sizeof(t), &t, NULL) ==
			    CL_SUCCESS &&
		    t.raw.type == OCL_TOPOLOGY_TYPE_PCIE_AMD)
			snprintf(out, cap, "0000:%02x:%02x.%x", (unsigned char)t.pcie.bus,
				 (unsigned char)t.pcie.device & 0x1f,
				 (unsigned char)t.pcie.function & 0x7);
	}
}

static void ocl_dev_free(struct ape__ocl_device *od)
{
	for (int v = 0; v < APE__OCL_NVARIANTS; v++) {
		if (od->progs[v].prog)
			clReleaseProgram(od->progs[v].prog);
		pthread_mutex_destroy(&od->progs[v].lock);
	}
	if (od->ctx)
		clReleaseContext(od->ctx);
	pthread_mutex_destroy(&od->lock);
	free(od);
}

/* The device's mutexes; 0 or APE_ENOMEM (with od->lock and every lock it made destroyed). */
static int ocl_dev_locks(struct ape__ocl_device *od)
{
	int v;

	if (pthread_mutex_init(&od->lock, NULL))
		return APE_ENOMEM;
	for (v = 0; v < APE__OCL_NVARIANTS; v++)
		if (pthread_mutex_init(&od->progs[v].lock, NULL))
			break;
	if (v == APE__OCL_NVARIANTS)
		return 0;
	while (v-- > 0)
		pthread_mutex_destroy(&od->progs[v].lock);
	pthread_mutex_destroy(&od->lock);
	return APE_ENOMEM;
}

/* Adds one device, on a context of its own, or on `shared` (the caller's, retained) when not
 * NULL: 1 when added, 0 when it cannot be used (with a note in `why`), or a negative code (out
 * of memory). */
static int ocl_add_device(struct ape_backend *be, cl_platform_id plat, cl_device_id id,
			  cl_context shared, char *why, size_t why_len)
{
	const cl_context_properties props[] = { CL_CONTEXT_PLATFORM, (cl_context_properties)plat,
						0 };
	struct ape__ocl_device *od;
	struct ape_device_info info;
	struct ape_be_caps caps;
	cl_bool avail = CL_FALSE, compiler = CL_FALSE;
	cl_uint cu = 0;
	cl_ulong gmem = 0;
	cl_int err;
	int rank, ret;

	od = ape_be_calloc(1, sizeof(*od));
	if (!od)
		return ape_be_error(APE_ENOMEM, "opencl: out of memory probing devices");
	if (ocl_dev_locks(od)) {
		free(od);
		return ape_be_error(APE_ENOMEM, "opencl: cannot create a mutex");
	}
	od->platform = plat;
	od->id = id;
	ocl_str(id, CL_DEVICE_NAME, od->name, sizeof(od->name));
	ocl_str(id, CL_DRIVER_VERSION, od->driver, sizeof(od->driver));
	if (clGetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof(od->platform_name) - 1,
			      od->platform_name, NULL) != CL_SUCCESS)
		od->platform_name[0] = '\0';
	if (clGetPlatformInfo(plat, CL_PLATFORM_VERSION, sizeof(od->platform_version) - 1,
			      od->platform_version, NULL) != CL_SUCCESS)
		od->platform_version[0] = '\0';
	clGetDeviceInfo(id, CL_DEVICE_AVAILABLE, sizeof(avail), &avail, NULL);
	clGetDeviceInfo(id, CL_DEVICE_COMPILER_AVAILABLE, sizeof(compiler), &compiler, NULL);
	if (!avail || !compiler) {
		snprintf(why, why_len, "%s: %s", od->name,
			 !avail ? "device not available" : "no OpenCL C compiler");
		ocl_dev_free(od);
		return 0;
	}
	clGetDeviceInfo(id, CL_DEVICE_TYPE, sizeof(od->type), &od->type, NULL);
	clGetDeviceInfo(id, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof(od->max_wg), &od->max_wg, NULL);
	clGetDeviceInfo(id, CL_DEVICE_LOCAL_MEM_SIZE, sizeof(od->local_mem), &od->local_mem, NULL);
	clGetDeviceInfo(id, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof(od->max_alloc), &od->max_alloc,
			NULL);
	clGetDeviceInfo(id, CL_DEVICE_PREFERRED_VECTOR_WIDTH_FLOAT, sizeof(od->vec_float),
			&od->vec_float, NULL);
	clGetDeviceInfo(id, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(cu), &cu, NULL);
	clGetDeviceInfo(id, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof(gmem), &gmem, NULL);
	od->fp64 = ocl_has_ext(id, "cl_khr_fp64");
	/* APE_OCL_FP64=0: build the programs as if the device had no cl_khr_fp64 (APE_REAL float,
	 * the backward's compensated float32 sums), so that a device with float64 tests the path of
	 * one without it; part of the programs' options (-DAPE_FP64), so of their cache key */
	const char *fp64_env = getenv("APE_OCL_FP64");
	const int fp64_off = fp64_env && strcmp(fp64_env, "0") == 0 && od->fp64;

	if (fp64_off)
		od->fp64 = 0;

	if (shared) {
		err = clRetainContext(shared);
		od->ctx = err == CL_SUCCESS ? shared : NULL;
		od->imported = od->ctx != NULL;
	} else {
		od->ctx = clCreateContext(props, 1, &id, NULL, NULL, &err);
	}
	if (!od->ctx) {
		snprintf(why, why_len, "%s: clCreateContext: %s", od->name, ape__ocl_err_name(err));
		ocl_dev_free(od);
		return 0;
	}

	memset(&info, 0, sizeof(info));
	snprintf(info.name, sizeof(info.name), "%s", od->name);
	ocl_str(id, CL_DEVICE_VENDOR, info.vendor, sizeof(info.vendor));
	snprintf(info.driver_version, sizeof(info.driver_version), "%s", od->driver);
	info.compute_units = (int)cu;
	info.global_mem_bytes = gmem;
	ocl_pci_address(id, info.pci_address, sizeof(info.pci_address));
	if (od->type & CL_DEVICE_TYPE_GPU) {
		info.kind = APE_DEVICE_GPU;
		rank = OCL_RANK_GPU;
	} else if (od->type & CL_DEVICE_TYPE_CPU) {
		info.kind = APE_DEVICE_CPU;
		rank = OCL_RANK_CPU;
	} else {
		info.kind = APE_DEVICE_ACCELERATOR;
		rank = OCL_RANK_ACCEL;
	}
	if (!od->fp64)
		ape_be_warn("opencl %s: no float64 (cl_khr_fp64%s): rotation angles are exact only "
			  "for distances |n| < 4096",
			  od->name, fp64_off ? ", left unused: APE_OCL_FP64=0" : "");
	caps = (struct ape_be_caps){
		/* a CPU device's buffers can be host memory (CL_MEM_USE_HOST_PTR), which its
		 * kernels read where it is (ape__ocl_buf_wrap) */
		.features = ((od->type & CL_DEVICE_TYPE_CPU) ? APE_BE_CAP_HOST_MEMORY : 0) |
			    /* ENT and MD behind F_DIAG (kernels/attention.cl), strided, each
			     * optional */
			    APE_BE_CAP_DIAG | APE_BE_CAP_DIAG_VIEWS |
			    /* ocl_backward.c: with float64 or, without it, compensated float32
			     * sums finished in float64 on the host; the resident backward also
			     * needs scratch and copy_view */
			    APE_BE_CAP_BACKWARD | APE_BE_CAP_RESIDENT_BACKWARD |
			    /* profiling queues (a wrapped queue may have none: ENOTSUP) */
			    APE_BE_CAP_TIMESTAMPS |
			    /* ragged launches: the general kernel's and the separable path's
			     * segment tables; explicit positions: the general kernel's
			     * ape_attention_pos (every launch with them goes there, the fast paths
			     * take implied positions only) */
			    APE_BE_CAP_SEGMENTS | APE_BE_CAP_POSITIONS |
			    /* distance-bias tables: every forward path (general, explicit
			     * positions, ragged, separable, decode and pages) and the backward */
			    APE_BE_CAP_BIAS_TABLE |
			    /* ragged backward launches: the backward's segment tables
			     * (ocl_backward.c, kernels/bwd_layout.h) */
			    APE_BE_CAP_BWD_SEGMENTS |
			    /* strided backward launches: ape_bwd_prep, _rows, _reduce and
			     * _short read Q, K, V, O and dO through their views (BWD_AT) */
			    APE_BE_CAP_BWD_VIEWS,
		.max_alloc = od->max_alloc, /* checked in buf_alloc: some drivers fail late */
	};
	/* the programs already in the cache, now rather than in the first call */
	ape__ocl_program_preload(od);
	ret = ape_be_device_add(be, &info, &caps, rank, od);
	if (ret) {
		ocl_dev_free(od);
		return ret;
	}
	return 1;
}

/* True, with the message in buf, when the .icd file names a library by a path that does not
 * exist: a driver uninstalled without its vendor file. (A bare library name is looked up by the
 * dynamic loader; only the ICD loader knows whether that worked.) */
static bool ocl_icd_lib_missing(const char *icd, char *buf, size_t cap)
{
	FILE *f = fopen(icd, "re");
	char lib[1024];
	bool ok;

	if (!f)
		return false;
	ok = fgets(lib, (int)sizeof(lib), f) != NULL;
	fclose(f);
	if (!ok)
		return false;
	lib[strcspn(lib, "\r\n")] = '\0';
	if (lib[0] != '/' || !access(lib, F_OK))
		return false;
	/* paths cut short so that the reason (256 bytes) keeps its end */
	snprintf(buf, cap, APE__OCL_NO_PLATFORM ": %.100s names %.100s, which does not exist", icd,
		 lib);
	return true;
}

/*
 * Why the ICD loader found no platform, in words a person can act on (the loader itself says
 * nothing): reads the vendor files as ocl-icd does (OCL_ICD_VENDORS: a directory of .icd files,
 * or one .icd file; else /etc/OpenCL/vendors) and names the first whose library does not exist.
 */
static void ocl_explain_no_platform(char *buf, size_t cap)
{
	const char *env = getenv("OCL_ICD_VENDORS");
	const char *dir = env && *env ? env : "/etc/OpenCL/vendors";
	const char *via = env && *env ? " (OCL_ICD_VENDORS)" : "";
	size_t n = strlen(dir);
	char icd[4096 + 256];
	struct dirent *e;
	int files = 0;
	DIR *d = NULL;

	if (n > 4 && !strcmp(dir + n - 4, ".icd")) { /* one vendor file */
		if (!ocl_icd_lib_missing(dir, buf, cap))
			snprintf(buf, cap,
				 APE__OCL_NO_PLATFORM ": the driver %.150s names gave none%s", dir,
				 via);
		return;
	}
	d = opendir(dir);
	while (d && (e = readdir(d))) {
		n = strlen(e->d_name);
		if (n <= 4 || strcmp(e->d_name + n - 4, ".icd"))
			continue;
		files++;
		snprintf(icd, sizeof(icd), "%s/%s", dir, e->d_name);
		if (ocl_icd_lib_missing(icd, buf, cap)) {
			closedir(d);
			return;
		}
	}
	if (d)
		closedir(d);
	if (!files)
		snprintf(buf, cap,
			 APE__OCL_NO_PLATFORM
			 ": no ICD file (*.icd) in %.120s%s: install an OpenCL driver such as "
			 "pocl-opencl-icd", dir, via);
	else
		snprintf(buf, cap,
			 APE__OCL_NO_PLATFORM
			 ": the %d driver%s listed in %.120s%s failed to load or report no "
			 "platform", files, files == 1 ? "" : "s", dir, via);
}

/* A platform without devices: say which, and whether PoCL was told to show none. */
static void ocl_explain_no_device(cl_platform_id plat, char *why, size_t cap)
{
	const char *pocl = getenv("POCL_DEVICES");
	char name[128] = "";

	if (clGetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof(name) - 1, name, NULL) != CL_SUCCESS)
		snprintf(name, sizeof(name), "a platform");
	name[sizeof(name) - 1] = '\0';
	if (pocl && strstr(name, "Portable Computing Language"))
		snprintf(why, cap, "%.100s reports no device (POCL_DEVICES=%.40s)", name, pocl);
	else
		snprintf(why, cap, "%.100s reports no device", name);
}

/*
 * Is the caller's device (ape_context_options.opencl_device) one of the devices of its context
 * (opencl_context)? 0, or APE_EINVAL naming both.
 */
static int ocl_import_check(cl_context c, cl_device_id id)
{
	size_t n = 0;
	cl_device_id *devs;
	cl_int err = clGetContextInfo(c, CL_CONTEXT_DEVICES, 0, NULL, &n);
	bool found = false;

	if (err != CL_SUCCESS || n < sizeof(*devs))
		return ape_be_error(APE_EINVAL,
				  "opencl: ape_context_options.opencl_context %p: clGetContextInfo "
				  "(CL_CONTEXT_DEVICES): %s (%d)",
				  (void *)c, err ? ape__ocl_err_name(err) : "no device", (int)err);
	devs = ape_be_malloc(n);
	if (!devs)
		return ape_be_error(APE_ENOMEM, "opencl: out of memory probing devices");
	err = clGetContextInfo(c, CL_CONTEXT_DEVICES, n, devs, NULL);
	for (size_t i = 0; err == CL_SUCCESS && i < n / sizeof(*devs); i++)
		found |= devs[i] == id;
	free(devs);
	if (err != CL_SUCCESS)
		return ape_be_error(APE_EINVAL,
				  "opencl: ape_context_options.opencl_context %p: clGetContextInfo "
				  "(CL_CONTEXT_DEVICES): %s (%d)",
				  (void *)c, ape__ocl_err_name(err), (int)err);
	if (!found)
		return ape_be_error(APE_EINVAL,
				  "opencl: ape_context_options.opencl_device %p is not one of the "
				  "%zu device(s) of opencl_context %p",
				  (void *)id, n / sizeof(*devs), (void *)c);
	return 0;
}

/* The result of ocl_add_device for the caller's device: a device that cannot be used fails
 * the probe (APE_EINVAL, with why), since the caller asked for that one. */
static int ocl_import_result(int ret, cl_device_id id, const char *why)
{
	if (ret)
		return ret;
	return ape_be_error(APE_EINVAL,
			  "opencl: ape_context_options.opencl_device %p cannot be used: %s",
			  (void *)id, why);
}

/*
 * probe (core/backend.h): every device of every platform, each on a context of its own, except
 * the device named by ape_be_import() (ape_context_options.opencl_context and .opencl_device), which
 * is built on the caller's context, retained. Fails (and so fails ape_context_create()) with
 * APE_EINVAL when that device is not one of that context's devices or cannot be used, and with
 * APE_ENODEV when the ICD loader cannot be loaded although the caller has a context.
 */
int ape__ocl_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
	cl_platform_id *plats = NULL;
	void *impo[2];
	cl_context imp_ctx;
	cl_device_id imp_dev;
	bool imp_done;
	cl_uint np = 0;
	cl_int err;
	int added = 0, ret = 0;
	char why[200] = "";

	ape_be_import(be, &impo[0], &impo[1]);
	imp_ctx = impo[0];
	imp_dev = impo[1];
	imp_done = !imp_ctx;

	/* tests and tools recognise "no OpenCL platform" as "no OpenCL here", whatever the cause */
	if (ape__ocl_load(why, sizeof(why))) {
		if (imp_ctx)
			return ape_be_error(APE_ENODEV,
					  "opencl: ape_context_options.opencl_context is set, but "
					  "%s", why);
		snprintf(res->reason, sizeof(res->reason), APE__OCL_NO_PLATFORM ": %s", why);
		return 0;
	}
	if (imp_ctx && (ret = ocl_import_check(imp_ctx, imp_dev)))
		return ret;
	err = clGetPlatformIDs(0, NULL, &np);
	if (err == OCL_PLATFORM_NOT_FOUND_KHR || (err == CL_SUCCESS && np == 0)) {
		ocl_explain_no_platform(res->reason, sizeof(res->reason));
		np = 0;
		goto out_import;
	}
	if (err != CL_SUCCESS) {
		snprintf(res->reason, sizeof(res->reason), "clGetPlatformIDs: %s (%d)",
			 ape__ocl_err_name(err), (int)err);
		np = 0;
		goto out_import;
	}
	plats = ape_be_calloc(np, sizeof(*plats));
	if (!plats)
		return ape_be_error(APE_ENOMEM, "opencl: out of memory probing platforms");
	err = clGetPlatformIDs(np, plats, NULL);
	if (err != CL_SUCCESS) {
		snprintf(res->reason, sizeof(res->reason), "clGetPlatformIDs: %s (%d)",
			 ape__ocl_err_name(err), (int)err);
		goto out_import;
	}
	for (cl_uint p = 0; p < np && !ret; p++) {
		cl_uint nd = 0;
		cl_device_id *devs;

		if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_ALL, 0, NULL, &nd) != CL_SUCCESS ||
		    nd == 0) {
			if (!why[0])
				ocl_explain_no_device(plats[p], why, sizeof(why));
			continue;
		}
		devs = ape_be_calloc(nd, sizeof(*devs));
		if (!devs) {
			ret = ape_be_error(APE_ENOMEM, "opencl: out of memory probing devices");
			break;
		}
		if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_ALL, nd, devs, NULL) == CL_SUCCESS) {
			for (cl_uint d = 0; d < nd && !ret; d++) {
				const bool imp = imp_ctx && devs[d] == imp_dev;

				ret = ocl_add_device(be, plats[p], devs[d], imp ? imp_ctx : NULL,
						     why, sizeof(why));
				if (imp) {
					imp_done = true;
					ret = ocl_import_result(ret, imp_dev, why);
				}
				added += ret > 0;
				ret = ret > 0 ? 0 : ret;
			}
		}
		free(devs);
	}
out_import:
	/* the caller's device, when the platforms did not list it (a sub-device, say) */
	if (!ret && !imp_done) {
		cl_platform_id plat = NULL;

		clGetDeviceInfo(imp_dev, CL_DEVICE_PLATFORM, sizeof(plat), &plat, NULL);
		ret = ocl_import_result(ocl_add_device(be, plat, imp_dev, imp_ctx, why,
						       sizeof(why)),
					imp_dev, why);
		added += ret > 0;
		ret = ret > 0 ? 0 : ret;
	}
	if (!ret && !added && !res->reason[0])
		snprintf(res->reason, sizeof(res->reason),
			 "no usable OpenCL device on %u platform%s%s%s", np, np == 1 ? "" : "s",
			 why[0] ? ": " : "", why);
	free(plats);
	return ret;
}

void ape__ocl_device_release(struct ape_device *dev)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);

	if (!od)
		return;
	ocl_dev_free(od);
	dev->priv = NULL;
}

int ape__ocl_debug_counters(const struct ape_device *dev, struct ape__ocl_debug_counters *out)
{
	struct ape__ocl_device *od;

	if (!dev || strcmp(dev->info.backend, "opencl"))
		return -1;
	od = ape__ocl_dev(dev);
	pthread_mutex_lock(&od->lock);
	*out = od->counters;
	pthread_mutex_unlock(&od->lock);
	return 0;
}

int ape__ocl_debug_kernels(const struct ape_device *dev, char *buf, unsigned cap)
{
	struct ape__ocl_device *od;

	if (!dev || strcmp(dev->info.backend, "opencl"))
		return -1;
	od = ape__ocl_dev(dev);
	pthread_mutex_lock(&od->lock);
	snprintf(buf, cap, "%s", od->kernels);
	od->kernels[0] = '\0';
	atomic_store(&od->kernels_on, true);
	pthread_mutex_unlock(&od->lock);
	return 0;
}

uint64_t ape__ocl_debug_max_alloc(const struct ape_device *dev)
{
	if (!dev || strcmp(dev->info.backend, "opencl"))
		return 0;
	return ape__ocl_dev(dev)->max_alloc;
}
