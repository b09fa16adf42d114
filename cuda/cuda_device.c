/* SPDX-License-Identifier: MIT */
/*
 * Probing: load the driver, initialise it, list the devices the kernels can run on. A machine
 * without the driver or without a GPU is a normal state: zero devices and a reason.
 *
 * The primary context of a device is retained on its first use, not here: creating a context
 * costs a few hundred milliseconds, which a context that never computes on CUDA should not pay.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cu.h"

/* A GPU through its vendor's own API: chosen before any OpenCL device (ranks: core/backend.h). */
#define CU_RANK 300

/* The kernels use cp.async, ldmatrix and bf16 mma: compute capability 8.0 or newer. */
#define CC_MIN_MAJOR 8

struct cu_backend {
	struct ape__cu_driver drv;
};

void ape__cu_pci_address(int domain, int bus, int device, char *buf, size_t cap)
{
	snprintf(buf, cap, "%04x:%02x:%02x.0", (unsigned)domain & 0xffffu, (unsigned)bus & 0xffu,
		 (unsigned)device & 0x1fu);
}

static int attr(const struct ape__cu_driver *drv, CUdevice d, CUdevice_attribute a, int dflt)
{
	int v = 0;

	return drv->p_cuDeviceGetAttribute(&v, a, d) == CUDA_SUCCESS ? v : dflt;
}

static void cu_dev_free(struct ape__cu_device *cd)
{
	pthread_mutex_destroy(&cd->lock);
	free(cd);
}

/* Adds device `ordinal`: 1 when added, 0 when it cannot be used (with a note in `why`), or a
 * negative code (out of memory). */
static int cu_add_device(struct ape_backend *be, const struct ape__cu_driver *drv, int ordinal,
			 char *why, size_t why_len)
{
	struct ape__cu_device *cd;
	struct ape_device_info info;
	struct ape_be_caps caps;
	char nbuf[32], ver[16];
	CUresult res;
	int ret;

	cd = ape_be_calloc(1, sizeof(*cd));
	if (!cd)
		return ape_be_error(APE_ENOMEM, "cuda: out of memory probing devices");
	if (pthread_mutex_init(&cd->lock, NULL)) {
		free(cd);
		return ape_be_error(APE_ENOMEM, "cuda: cannot create a mutex");
	}
	cd->drv = drv;
	cd->ordinal = ordinal;
	res = drv->p_cuDeviceGet(&cd->dev, ordinal);
	if (res == CUDA_SUCCESS)
		res = drv->p_cuDeviceGetName(cd->name, (int)sizeof(cd->name) - 1, cd->dev);
	if (res == CUDA_SUCCESS)
		res = drv->p_cuDeviceTotalMem(&cd->total_mem, cd->dev);
	if (res != CUDA_SUCCESS) {
		snprintf(why, why_len, "device %d: %s", ordinal,
			 ape__cu_err_name(drv, res, nbuf, sizeof(nbuf)));
		cu_dev_free(cd);
		return 0;
	}
	cd->cc_major = attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0);
	cd->cc_minor = attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0);
	cd->sm_count = attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 1);
	cd->smem_optin = attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
			      48 * 1024);
	cd->mempools = attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0) != 0;
	ape__cu_pci_address(attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 0),
			    attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0),
			    attr(drv, cd->dev, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 0), cd->pci,
			    sizeof(cd->pci));
	if (cd->cc_major < CC_MIN_MAJOR) {
		snprintf(why, why_len,
			 "%.80s (%s): compute capability %d.%d: libape's CUDA kernels need %d.0 or "
			 "newer",
			 cd->name, cd->pci, cd->cc_major, cd->cc_minor, CC_MIN_MAJOR);
		cu_dev_free(cd);
		return 0;
	}

	memset(&info, 0, sizeof(info));
	snprintf(info.name, sizeof(info.name), "%s", cd->name);
	snprintf(info.vendor, sizeof(info.vendor), "NVIDIA Corporation");
	ape__cu_version_string(drv->version, ver, sizeof(ver));
	snprintf(info.driver_version, sizeof(info.driver_version), "CUDA %s, sm_%d%d", ver,
		 cd->cc_major, cd->cc_minor);
	info.kind = APE_DEVICE_GPU;
	info.compute_units = cd->sm_count;
	info.global_mem_bytes = cd->total_mem;
	snprintf(info.pci_address, sizeof(info.pci_address), "%s", cd->pci);
	caps = (struct ape_be_caps){
		/* ENT and MD: the _diag kernels (cuda_attention.c), strided, each optional;
		 * cuda_backward.c, with scratch and copy_view; timestamps against the device's
		 * epoch event (cuda_mem.c); a ragged batch in one launch: the prefill kernel's
		 * segment table (cuda_attention.c); explicit positions not read: the core cuts
		 * runs; no host memory: kernels read device memory only; distance-bias tables
		 * on every forward launch (uploaded with their suffix maxima per launch) and
		 * backward (their gradient by ape_bwd_dbias); ragged backward launches: the
		 * backward kernels' segment table (cuda_backward.c) */
		.features = APE_BE_CAP_DIAG | APE_BE_CAP_DIAG_VIEWS | APE_BE_CAP_BACKWARD |
			    APE_BE_CAP_RESIDENT_BACKWARD | APE_BE_CAP_TIMESTAMPS | APE_BE_CAP_SEGMENTS |
			    APE_BE_CAP_BIAS_TABLE | APE_BE_CAP_BWD_SEGMENTS,
		/* one buffer may take it all */
		.max_alloc = cd->total_mem,
	};
	ret = ape_be_device_add(be, &info, &caps, CU_RANK, cd);
	if (ret) {
		cu_dev_free(cd);
		return ret;
	}
	return 1;
}

int ape__cu_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
	struct cu_backend *cb = ape_be_calloc(1, sizeof(*cb));
	struct ape__cu_driver *drv;
	char why[200] = "", nbuf[32], ver[16];
	const char *text = NULL;
	int n = 0, added = 0, ret = 0;
	CUresult r;

	if (!cb)
		return ape_be_error(APE_ENOMEM, "cuda: out of memory loading the driver");
	drv = &cb->drv;
	if (ape__cu_driver_load(drv, res->reason, sizeof(res->reason))) {
		free(cb);
		return 0;
	}
	ape_be_set_priv(be, cb);
	ape__cu_version_string(drv->version, ver, sizeof(ver));
	r = drv->p_cuInit(0);
	if (r == CUDA_ERROR_NO_DEVICE) {
		snprintf(res->reason, sizeof(res->reason), "no CUDA device (driver CUDA %s, %.150s)",
			 ver, drv->path);
		return 0;
	}
	if (r == CUDA_ERROR_STUB_LIBRARY) {
		snprintf(res->reason, sizeof(res->reason),
			 "%.150s is the CUDA toolkit's link stub (CUDA_ERROR_STUB_LIBRARY), not a driver",
			 drv->path);
		return 0;
	}
	if (r == CUDA_SUCCESS)
		r = drv->p_cuDeviceGetCount(&n);
	if (r != CUDA_SUCCESS) {
		if (drv->p_cuGetErrorString(r, &text) != CUDA_SUCCESS)
			text = NULL;
		snprintf(res->reason, sizeof(res->reason), "cuInit: %s%s%.80s (driver CUDA %s, %.100s)",
			 ape__cu_err_name(drv, r, nbuf, sizeof(nbuf)), text ? ": " : "",
			 text ? text : "", ver, drv->path);
		return 0;
	}
	if (n == 0) {
		snprintf(res->reason, sizeof(res->reason), "no CUDA device (driver CUDA %s, %.150s)",
			 ver, drv->path);
		return 0;
	}
	for (int d = 0; d < n && !ret; d++) {
		ret = cu_add_device(be, drv, d, why, sizeof(why));
		added += ret > 0;
		ret = ret > 0 ? 0 : ret;
	}
	if (!ret && !added)
		snprintf(res->reason, sizeof(res->reason), "no usable CUDA device among %d: %s", n,
			 why);
	if (!ret && added && drv->missing_optional[0])
		ape_be_warn("cuda: driver CUDA %s lacks %s:%s%s%s", ver, drv->missing_optional,
			  drv->pinning ? "" : " host memory is not pinned;",
			  drv->p_cuMemGetAddressRange ? "" : " device memory cannot be wrapped;",
			  drv->p_cuPointerGetAttribute && drv->p_cuStreamGetCtx
				  ? ""
				  : " wrapped pointers and streams are not checked against the device");
	return ret;
}

void ape__cu_teardown(struct ape_backend *be)
{
	struct cu_backend *cb = ape_be_priv(be);

	if (!cb)
		return;
	ape__cu_driver_unload(&cb->drv);
	free(cb);
	ape_be_set_priv(be, NULL);
}

void ape__cu_device_release(struct ape_device *dev)
{
	struct ape__cu_device *cd = ape__cu_dev(dev);
	const struct ape__cu_driver *drv;
	CUcontext prev;

	if (!cd)
		return;
	drv = cd->drv;
	if (atomic_load(&cd->ctx_state) == 1) {
		if (drv->p_cuCtxPushCurrent(cd->ctx) == CUDA_SUCCESS) {
			ape__cu_module_unload(cd);
			if (cd->epoch)
				drv->p_cuEventDestroy(cd->epoch);
			drv->p_cuCtxPopCurrent(&prev);
		}
		drv->p_cuDevicePrimaryCtxRelease(cd->dev);
	}
	cu_dev_free(cd);
	dev->priv = NULL;
}

/* Retains the primary context and records the epoch event; under cd->lock. */
static int cu_context_init(struct ape_device *dev, struct ape__cu_device *cd)
{
	const struct ape__cu_driver *drv = cd->drv;
	CUcontext prev;
	CUstream s = NULL;
	CUresult r;
	int ret;

	r = drv->p_cuDevicePrimaryCtxRetain(&cd->ctx, cd->dev);
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, dev, "cuDevicePrimaryCtxRetain");
	r = drv->p_cuCtxPushCurrent(cd->ctx);
	if (r != CUDA_SUCCESS) {
		ret = ape__cu_error(r, dev, "cuCtxPushCurrent");
		goto out_release;
	}
	/* the origin of event_timestamp: one event every later one is measured against */
	r = drv->p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
	if (r == CUDA_SUCCESS)
		r = drv->p_cuEventCreate(&cd->epoch, CU_EVENT_DEFAULT);
	if (r == CUDA_SUCCESS)
		r = drv->p_cuEventRecord(cd->epoch, s);
	if (r == CUDA_SUCCESS)
		r = drv->p_cuStreamSynchronize(s);
	if (s)
		drv->p_cuStreamDestroy(s);
	if (r != CUDA_SUCCESS) {
		ret = ape__cu_error(r, dev, "creating the timing epoch");
		if (cd->epoch)
			drv->p_cuEventDestroy(cd->epoch);
		cd->epoch = NULL;
		drv->p_cuCtxPopCurrent(&prev);
		goto out_release;
	}
	drv->p_cuCtxPopCurrent(&prev);
	return 0;

out_release:
	drv->p_cuDevicePrimaryCtxRelease(cd->dev);
	return ret;
}

int ape__cu_once(struct ape_device *dev, atomic_int *state,
		 int (*init)(struct ape_device *dev, struct ape__cu_device *cd))
{
	struct ape__cu_device *cd = ape__cu_dev(dev);
	int st = atomic_load_explicit(state, memory_order_acquire);

	if (st == 0) {
		pthread_mutex_lock(&cd->lock);
		st = atomic_load(state);
		if (st == 0) {
			int ret = init(dev, cd);

			/* a failure is final: later callers get the same code and message without
			 * paying for the attempt again */
			if (ret)
				snprintf(cd->init_error, sizeof(cd->init_error), "%s",
					 ape_last_error());
			st = ret ? ret : 1;
			atomic_store_explicit(state, st, memory_order_release);
		}
		pthread_mutex_unlock(&cd->lock);
	}
	return st < 0 ? ape_be_error(st, "%s", cd->init_error) : 0;
}

int ape__cu_enter(struct ape_device *dev)
{
	struct ape__cu_device *cd = ape__cu_dev(dev);
	int ret = ape__cu_once(dev, &cd->ctx_state, cu_context_init);
	CUresult r;

	if (ret)
		return ret;
	r = cd->drv->p_cuCtxPushCurrent(cd->ctx);
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, dev, "cuCtxPushCurrent");
	return 0;
}

void ape__cu_leave(struct ape_device *dev)
{
	CUcontext prev;

	ape__cu_dev(dev)->drv->p_cuCtxPopCurrent(&prev);
}

void ape__cu_native(struct ape_device *dev, void **context, void **device)
{
	struct ape__cu_device *cd = ape__cu_dev(dev);

	if (device)
		*device = (void *)(intptr_t)cd->dev;
	if (context)
		*context = ape__cu_once(dev, &cd->ctx_state, cu_context_init) ? NULL : cd->ctx;
}
