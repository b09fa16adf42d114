/* SPDX-License-Identifier: MIT */
/*
 * The kernels: one fatbin built by nvcc at build time (cuda/module.mk: sm_80 and sm_90a machine
 * code, compute_90 PTX for newer GPUs) and embedded in the library (fatbin_embed.S). Each device
 * loads it with cuModuleLoadData on its first launch, under the device's mutex, and keeps the
 * functions for the context's life; the driver picks the machine code for the GPU or compiles
 * the PTX.
 */
#include <string.h>

#include "cu.h"

/* the 12 kernels of one kind: head-size variant x storage type, names ending in suf */
#define VARIANTS_(kind, suf)                                                                       \
	"ape_" kind "_d64_f32" suf, "ape_" kind "_d64_f16" suf, "ape_" kind "_d64_bf16" suf,       \
		"ape_" kind "_d128_f32" suf, "ape_" kind "_d128_f16" suf,                          \
		"ape_" kind "_d128_bf16" suf, "ape_" kind "_g128_f32" suf,                         \
		"ape_" kind "_g128_f16" suf, "ape_" kind "_g128_bf16" suf,                         \
		"ape_" kind "_g256_f32" suf, "ape_" kind "_g256_f16" suf, "ape_" kind "_g256_bf16" suf
#define VARIANTS(kind) VARIANTS_(kind, "")

const char *const ape__cu_kernel_names[APE__CU_NKERNELS] = {
	"ape_prep", "ape_kscan", "ape_dwindow", "ape_dmerge", VARIANTS("prefill"), VARIANTS("decode"),
	"ape_bwd_rows", "ape_bwd_params", "ape_bwd_reduce", "ape_bwd_fused_d64", "ape_bwd_fused_d128",
	"ape_bwd_fused_g128", "ape_bwd_fused_g256", "ape_copy_view", "ape_sep_rot", "ape_sep_d64_f16",
	"ape_sep_d64_bf16", "ape_sep_d128_f16", "ape_sep_d128_bf16", "ape_dmerge_diag",
	VARIANTS_("prefill", "_diag"), VARIANTS_("decode", "_diag"), "ape_lmerge", "ape_bwd_dbias",
};

int ape__cu_kernel_index(bool decode, int variant, int dtype, bool diag)
{
	const int base = diag ? (decode ? APE__CU_K_DECODE_DIAG : APE__CU_K_PREFILL_DIAG)
			      : (decode ? APE__CU_K_DECODE : APE__CU_K_PREFILL);

	return base + 3 * variant + dtype;
}

static int cu_kernel_module(int k)
{
	if (k == APE__CU_K_LMERGE)
		return APE__CU_MOD_PREP;
	if (k == APE__CU_K_BWD_DBIAS)
		return APE__CU_MOD_BACKWARD;
	if (k == APE__CU_K_MERGE_DIAG || k >= APE__CU_K_DECODE_DIAG)
		return APE__CU_MOD_DECODE;
	if (k >= APE__CU_K_PREFILL_DIAG)
		return APE__CU_MOD_PREFILL;
	if (k >= APE__CU_K_SEP_ROT)
		return APE__CU_MOD_SEPARABLE;
	if (k >= APE__CU_K_BWD_ROWS)
		return APE__CU_MOD_BACKWARD;
	if (k == APE__CU_K_PREP || k == APE__CU_K_SCAN)
		return APE__CU_MOD_PREP;
	if (k == APE__CU_K_WINDOW)
		return APE__CU_MOD_WINDOW;
	if (k == APE__CU_K_MERGE || k >= APE__CU_K_DECODE)
		return APE__CU_MOD_DECODE;
	return APE__CU_MOD_PREFILL;
}

static const unsigned char *const cu_images[APE__CU_NMODULES] = {
	ape__cu_fatbin_prep,
	ape__cu_fatbin_window,
	ape__cu_fatbin_decode,
	ape__cu_fatbin_prefill,
	ape__cu_fatbin_backward,
	ape__cu_fatbin_separable,
};

static void cu_modules_unload(struct ape__cu_device *cd)
{
	for (int m = 0; m < APE__CU_NMODULES; m++)
		if (cd->mod[m]) {
			cd->drv->p_cuModuleUnload(cd->mod[m]);
			cd->mod[m] = NULL;
		}
}

/* Loads the modules and looks up every function; under cd->lock, the device entered. */
static int cu_module_load(struct ape_device *dev, struct ape__cu_device *cd)
{
	const struct ape__cu_driver *drv = cd->drv;
	CUresult r;

	for (int m = 0; m < APE__CU_NMODULES; m++) {
		r = drv->p_cuModuleLoadData(&cd->mod[m], cu_images[m]);
		if (r != CUDA_SUCCESS) {
			int ret = ape__cu_error(
				r, dev,
				"cuModuleLoadData (libape's kernels for sm_80, sm_90a and compute_90 "
				"PTX, built with CUDA %d.%d; this GPU is sm_%d%d, the driver CUDA %d.%d)",
				CUDA_VERSION / 1000, CUDA_VERSION % 1000 / 10, cd->cc_major,
				cd->cc_minor, drv->version / 1000, drv->version % 1000 / 10);

			cd->mod[m] = NULL;
			cu_modules_unload(cd);
			return ret;
		}
	}
	for (int k = 0; k < APE__CU_NKERNELS; k++) {
		r = drv->p_cuModuleGetFunction(&cd->fn[k], cd->mod[cu_kernel_module(k)],
					       ape__cu_kernel_names[k]);
		if (r != CUDA_SUCCESS) {
			int ret = ape__cu_error(r, dev, "cuModuleGetFunction (%s)",
						ape__cu_kernel_names[k]);

			cu_modules_unload(cd);
			return ret;
		}
	}
	return 0;
}

void ape__cu_module_unload(struct ape__cu_device *cd)
{
	cu_modules_unload(cd);
}

int ape__cu_module(struct ape_device *dev)
{
	return ape__cu_once(dev, &ape__cu_dev(dev)->mod_state, cu_module_load);
}

/* Opens function k up to `smem` bytes of dynamic shared memory (beyond the default 48 KB a
 * kernel must ask for it), once per size. */
static int cu_smem(struct ape_device *dev, int k, unsigned smem)
{
	struct ape__cu_device *cd = ape__cu_dev(dev);
	CUresult r = CUDA_SUCCESS;

	if (smem <= 48 * 1024)
		return 0;
	if ((int)smem > cd->smem_optin)
		return ape_be_error(APE_ENOMEM,
				  "%s needs %u bytes of shared memory per block, the GPU offers %d",
				  ape__cu_kernel_names[k], smem, cd->smem_optin);
	pthread_mutex_lock(&cd->lock);
	if (cd->fn_smem[k] < (int)smem) {
		r = cd->drv->p_cuFuncSetAttribute(cd->fn[k],
						   CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
						   (int)smem);
		if (r == CUDA_SUCCESS)
			cd->fn_smem[k] = (int)smem;
	}
	pthread_mutex_unlock(&cd->lock);
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, dev, "cuFuncSetAttribute (%s, %u bytes of shared memory)",
				     ape__cu_kernel_names[k], smem);
	return 0;
}

int ape__cu_launch(struct ape_be_queue *q, int k, int64_t blocks, unsigned smem, void *args,
		   const char *what)
{
	const struct ape__cu_device *cd = ape__cu_dev(q->dev);
	/* x up to 2^31 - 1, y up to 65535: blocks past the count return at once */
	const int64_t xmax = 0x7fffffff;
	const int64_t gy = (blocks + xmax - 1) / xmax, gx = (blocks + gy - 1) / gy;
	void *params[1] = { args };
	CUresult r;
	int ret;

	if (blocks <= 0)
		return 0;
	if (gy > 65535)
		return ape_be_error(APE_EINVAL, "%s: %lld blocks are more than one launch takes",
				  what, (long long)blocks);
	ret = cu_smem(q->dev, k, smem);
	if (ret)
		return ret;
	r = cd->drv->p_cuLaunchKernel(cd->fn[k], (unsigned)gx, (unsigned)gy, 1, APE_CU_THREADS, 1, 1,
				      smem, q->s, params, NULL);
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, q->dev, "cuLaunchKernel (%s, %s, %lld blocks, %u bytes of "
				     "shared memory)",
				     ape__cu_kernel_names[k], what, (long long)blocks, smem);
	return 0;
}

int ape__cu_run_threads(struct ape_be_queue *q, int k, int64_t n, void *args, const char *what)
{
	int ret;

	if (!n)
		return 0;
	ret = ape__cu_enter(q->dev);
	if (ret)
		return ret;
	ret = ape__cu_module(q->dev);
	if (!ret)
		ret = ape__cu_launch(q, k, (n + APE_CU_THREADS - 1) / APE_CU_THREADS, 0, args, what);
	ape__cu_leave(q->dev);
	return ret;
}
