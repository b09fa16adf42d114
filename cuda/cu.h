/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's internal state, shared by its files (and by no one else).
 *
 * The driver (libcuda.so.1) is loaded at run time with dlopen and every entry point is resolved
 * through cuGetProcAddress (cuda_loader.c), so libape links no CUDA library and runs where no
 * NVIDIA driver is installed. The toolkit's cuda.h provides the types only.
 *
 * State: the loaded driver is per context (be->priv); per device (dev->priv) the primary context,
 * retained on first use, and the kernel module, loaded on first launch, each under the device's
 * mutex; buffers, queues and events are plain wrappers of driver handles. No global mutable state.
 *
 * Every driver call that needs a context runs between cu_enter() and cu_leave(), which push and
 * pop the device's primary context on the calling thread: the caller's own current context (an
 * application using the CUDA runtime, say) is left as it was.
 */
#ifndef APE_CUDA_CU_H
#define APE_CUDA_CU_H

#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "ape/ape_backend.h"
#include "cuda_syms.h"
#include "kernels/args.h"

#pragma GCC visibility push(hidden)

/* The driver version the embedded kernels need: the fatbin holds machine code built by this
 * toolkit (nvcc CUDA_VERSION), which a driver of the same major version loads (CUDA's minor
 * version compatibility), and compute_90 PTX, which only a driver at least as new as the
 * toolkit can compile; PTX is used only on GPUs newer than Hopper, and a driver too old for it
 * says so when the module loads (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). */
#define APE_CU_DRIVER_MIN ((CUDA_VERSION / 1000) * 1000)

/* The function types of the table, and the table itself. */
#define APE_CU_PFN(name, ver, req, params) typedef CUresult (*ape__pfn_##name) params;
APE_CUDA_SYMBOLS(APE_CU_PFN)
#undef APE_CU_PFN

struct ape__cu_driver {
	void *lib; /* dlopen handle */
	char path[256]; /* what was loaded */
	int version; /* cuDriverGetVersion: 13000 for CUDA 13.0 */
	bool pinning; /* the optional host-registration symbols are there */
	char missing_optional[256]; /* optional symbols the driver lacks, for ape-info */
#define APE_CU_FIELD(name, ver, req, params) ape__pfn_##name p_##name;
	APE_CUDA_SYMBOLS(APE_CU_FIELD)
#undef APE_CU_FIELD
};

/* The fatbins, one per kernel file, each loaded as one module. */
enum {
	APE__CU_MOD_PREP,
	APE__CU_MOD_WINDOW,
	APE__CU_MOD_DECODE,
	APE__CU_MOD_PREFILL,
	APE__CU_MOD_BACKWARD,
	APE__CU_MOD_SEPARABLE,
	APE__CU_NMODULES,
};

/* Kernels the backend launches (cuda_module.c names them). */
enum ape__cu_kernel {
	APE__CU_K_PREP,
	APE__CU_K_SCAN,
	APE__CU_K_WINDOW,
	APE__CU_K_MERGE,
	/* prefill: 4 head-size variants x 3 types, then decode likewise */
	APE__CU_K_PREFILL,
	APE__CU_K_DECODE = APE__CU_K_PREFILL + 12,
	/* the backward pass (cuda_backward.c): rows, params, reduce, then the fused sweep for
	 * each head-size variant */
	APE__CU_K_BWD_ROWS = APE__CU_K_DECODE + 12,
	APE__CU_K_BWD_PARAMS,
	APE__CU_K_BWD_REDUCE,
	APE__CU_K_BWD_FUSED,
	APE__CU_K_COPY_VIEW = APE__CU_K_BWD_FUSED + 4, /* copy_view (ABI 10) */
	/* the separable path (cuda_separable.c): the rotation, then d64 f16/bf16, d128 f16/bf16 */
	APE__CU_K_SEP_ROT,
	APE__CU_K_SEP,
	/* the forward kernels' twins that also write the diagnostics (ent, md): ape_dmerge_diag,
	 * then prefill and decode as above */
	APE__CU_K_MERGE_DIAG = APE__CU_K_SEP + 4,
	APE__CU_K_PREFILL_DIAG,
	APE__CU_K_DECODE_DIAG = APE__CU_K_PREFILL_DIAG + 12,
	/* attention_merge (ABI 11) */
	APE__CU_K_LMERGE = APE__CU_K_DECODE_DIAG + 12,
	/* the backward's distance-bias table gradient (ABI 1.1) */
	APE__CU_K_BWD_DBIAS,
	APE__CU_NKERNELS,
};

/* Head-size variants: D = 64 and 128 specialised, every other even D <= 256 generic. */
enum { APE__CU_V_D64, APE__CU_V_D128, APE__CU_V_G128, APE__CU_V_G256, APE__CU_NVARIANTS };

struct ape__cu_device {
	const struct ape__cu_driver *drv;
	CUdevice dev;
	int ordinal;
	char name[128];
	int cc_major, cc_minor;
	int sm_count;
	int smem_optin; /* CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
	bool mempools; /* cuMemAllocAsync works on it */
	size_t total_mem;
	char pci[16];

	pthread_mutex_t lock; /* guards everything below while it is being set up */
	atomic_int ctx_state; /* 0: not yet, 1: ready, < 0: failed (the libape code) */
	CUcontext ctx; /* primary context, retained once */
	CUevent epoch; /* recorded once: event_timestamp measures from it */
	atomic_int mod_state; /* like ctx_state, for the modules */
	CUmodule mod[APE__CU_NMODULES];
	CUfunction fn[APE__CU_NKERNELS];
	int fn_smem[APE__CU_NKERNELS]; /* dynamic shared memory the function was opened up to */
	char init_error[320]; /* why ctx_state or mod_state failed, repeated to later callers */
};

struct ape_be_buf {
	CUdeviceptr ptr;
	size_t size;
	bool wrapped; /* the caller's memory (buf_wrap): never freed here */
};

struct ape_be_queue {
	struct ape_device *dev; /* first, as every backend's (core/backend.h, "Objects") */
	CUstream s; /* NULL: the legacy default stream (a wrapped one only) */
	bool wrapped; /* the caller's stream (queue_wrap): never synchronised or destroyed here */
};

struct ape_be_event {
	struct ape_device *dev; /* first, likewise */
	CUevent ev;
	bool timed; /* created with timing (not on a wrapped stream) */
};

_Static_assert(offsetof(struct ape_be_queue, dev) == 0 && offsetof(struct ape_be_event, dev) == 0,
	       "core/backend.h: queues and events begin with their device");

static inline struct ape__cu_device *ape__cu_dev(const struct ape_device *dev)
{
	return dev->priv;
}

/* ---- cuda_loader.c */
/* Loads the driver (APE_CUDA_LIBRARY or libcuda.so.1) and resolves every symbol. 0, or -1 with
 * the reason ("libcuda.so.1 not found", "driver too old: ...") in why. Never aborts. */
int ape__cu_driver_load(struct ape__cu_driver *drv, char *why, size_t cap);
void ape__cu_driver_unload(struct ape__cu_driver *drv);
/* "13.0" */
void ape__cu_version_string(int version, char *buf, size_t cap);

/* ---- cuda_errors.c */
/* The libape code for a CUresult (ENOMEM, ENODEV, EDEVLOST, EBUILD or EBACKEND). */
int ape__cu_err_code(CUresult r);
/* "CUDA_ERROR_OUT_OF_MEMORY", from the driver when it knows the code, else from libape's own
 * table, else "CUresult 1234". */
const char *ape__cu_err_name(const struct ape__cu_driver *drv, CUresult r, char *buf, size_t cap);
/* Sets the message "<what>: CUDA_ERROR_NAME (code): <driver's text>" and returns the mapped
 * code; dev's driver names the error. The core's table names the op that failed and the device
 * around it (core/backend.h, "Failure"). */
int ape__cu_error(CUresult r, const struct ape_device *dev, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* ---- cuda_device.c */
int ape__cu_probe(struct ape_backend *be, struct ape_be_probe_result *res);
void ape__cu_teardown(struct ape_backend *be);
void ape__cu_device_release(struct ape_device *dev);
/* "dddd:bb:dd.0" from the driver's PCI domain, bus and device numbers. */
void ape__cu_pci_address(int domain, int bus, int device, char *buf, size_t cap);
/* Runs init(dev, cd) once per device under cd->lock and remembers the outcome in *state (1
 * ready, < 0 its code): 0, or that code with the first attempt's message, to every caller. */
int ape__cu_once(struct ape_device *dev, atomic_int *state,
		 int (*init)(struct ape_device *dev, struct ape__cu_device *cd));
/* Makes the device's primary context current on this thread (retaining it on first use). */
int ape__cu_enter(struct ape_device *dev);
void ape__cu_leave(struct ape_device *dev);
/* The native op: the primary context (retained on first use; NULL if that fails) and the
 * CUdevice as (void *)(intptr_t). */
void ape__cu_native(struct ape_device *dev, void **context, void **device);

/* ---- cuda_mem.c */
int ape__cu_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out);
void ape__cu_buf_free(struct ape_device *dev, struct ape_be_buf *buf);
int ape__cu_queue_create(struct ape_device *dev, struct ape_be_queue **out);
void ape__cu_queue_destroy(struct ape_be_queue *q);
int ape__cu_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, const void *src,
		     size_t n);
int ape__cu_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off, size_t n);
int ape__cu_copy_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
		     struct ape_be_buf *src, size_t src_off, size_t n);
int ape__cu_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, uint32_t pattern,
		 size_t n);
int ape__cu_event_record(struct ape_be_queue *q, struct ape_be_event **out);
int ape__cu_event_wait(struct ape_be_queue *q, struct ape_be_event *e);
int ape__cu_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms);
int ape__cu_event_timestamp(struct ape_be_event *e, double *ms);
void ape__cu_event_destroy(struct ape_be_event *e);
int ape__cu_synchronize(struct ape_be_queue *q);
int ape__cu_host_register(struct ape_device *dev, void *ptr, size_t bytes, void **handle);
void ape__cu_host_unregister(struct ape_device *dev, void *handle);
int ape__cu_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
		     struct ape_be_buf **out, size_t *bytes_out);
int ape__cu_queue_wrap(struct ape_device *dev, void *handle, struct ape_be_queue **out);
/* Scratch for one launch, freed in stream order after it (cuMemAllocAsync where the device has
 * memory pools; otherwise a plain allocation freed once the stream is done with it). */
int ape__cu_scratch_alloc(struct ape_be_queue *q, size_t bytes, CUdeviceptr *out);
int ape__cu_scratch_free(struct ape_be_queue *q, CUdeviceptr p);

/* ---- cuda_module.c */
/* The modules' functions, loading them on first use. The caller has entered the device. */
int ape__cu_module(struct ape_device *dev);
/* Unloads whatever modules are loaded (device release; the context current). */
void ape__cu_module_unload(struct ape__cu_device *cd);
/* Kernel index of a prefill / decode variant. */
int ape__cu_kernel_index(bool decode, int variant, int dtype, bool diag);
/* Launches kernel k over `blocks` blocks of APE_CU_THREADS threads (split into a 2-D grid when
 * more than 2^31 - 1) with `smem` bytes of dynamic shared memory; params[0] is its argument
 * struct. The caller has entered the device. */
int ape__cu_launch(struct ape_be_queue *q, int k, int64_t blocks, unsigned smem, void *args,
		   const char *what);
/* A kernel of one thread per item (copy_view, attention_merge): enters the device, loads the
 * modules and launches k over n items (nothing for n = 0); the caller has not entered. */
int ape__cu_run_threads(struct ape_be_queue *q, int k, int64_t n, void *args, const char *what);
extern const char *const ape__cu_kernel_names[APE__CU_NKERNELS];

/* ---- cuda_attention.c */
int ape__cu_attention(struct ape_be_queue *q, const struct ape_be_launch *l);
/* Tensor t's view in l (APE_BE_T_Q and the others) as the kernels' argument structs carry it. */
struct ape_cu_view ape__cu_view(const struct ape_be_launch *l, int t);
/* What ape_prep writes for a launch, in its scratch (0: not wanted): K as float32 pairs and V
 * padded, [B*Hkv*Lk][dmax] (kp, vp; kernels/args.h), each (batch, kv head)'s largest key norm
 * per tile of `tile` keys, ntile tiles (ktile), and, with ktile, ape_kscan's prefix and suffix
 * maxima over those tiles (pre, suf). */
struct ape__cu_prep {
	CUdeviceptr kp, vp, ktile, pre, suf;
	int64_t ntile, tile;
	int dmax;
};
/* Launches ape_prep over l's keys, then, when p->ktile is wanted, ape_kscan. Returns 0, or the
 * first failed launch's code (nothing after it is launched). */
int ape__cu_prep_keys(struct ape_be_queue *q, const struct ape_be_launch *l,
		      const struct ape__cu_prep *p);
uint64_t ape__cu_attention_scratch(struct ape_device *dev, const struct ape_be_launch *l);
/* attention_pages: the launches the decode reads in place (cuda_attention.c says which). */
bool ape__cu_attention_pages(struct ape_device *dev, const struct ape_be_launch *l);
/* Copies `bytes` of host memory at `copy` (ape_be_malloc()'ed: this takes it and frees it,
 * whatever happens) to dst on q's stream, which frees it once the copy has run. */
int ape__cu_upload_owned(struct ape_be_queue *q, CUdeviceptr dst, void *copy, size_t bytes,
			 const char *what);
/* More heads than an argument struct carries (APE_CU_INLINE_HEADS): l->head_params copied to
 * dst, on the queue, from a host copy the stream frees once the copy has run. */
/* Where a launch's kernels find the heads' float32 parameters: in the call's table when the core
 * uploaded one (struct ape_be_launch.params[1]), else at `slot` (ape__cu_upload_head_params()). */
CUdeviceptr ape__cu_head_params_at(const struct ape_be_launch *l, CUdeviceptr slot);
int ape__cu_upload_head_params(struct ape_be_queue *q, const struct ape_be_launch *l, CUdeviceptr dst);
/*
 * A launch's distance-bias table (l->bias_table) in device scratch: the first n entries of each
 * row, [rows][n] floats (rows H, or 1 for a shared row), then with smax the same layout's suffix
 * maxima (the skip bounds'). ape__cu_bias_entries(): the n a launch reads, entries up to its
 * largest |n| (ragged: its segments'), at most bias_len; bias_len itself without `positions`
 * (attention_scratch: the shape alone). ape__cu_bias_bytes(): their bytes; ape__cu_bias_at():
 * the kernels' view of them at dst; ape__cu_upload_bias(): copies them to dst on the queue,
 * from a host copy the stream frees once the copy has run.
 */
int64_t ape__cu_bias_entries(const struct ape_be_launch *l, bool positions);
size_t ape__cu_bias_bytes(const struct ape_be_launch *l, int64_t n, bool smax);
struct ape_cu_bias ape__cu_bias_at(const struct ape_be_launch *l, int64_t n, bool smax,
				   CUdeviceptr dst);
int ape__cu_upload_bias(struct ape_be_queue *q, const struct ape_be_launch *l, int64_t n,
			bool smax, CUdeviceptr dst);

/* ---- cuda_separable.c: launches whose every head has lambda = 0 (f16/bf16, D 64 or 128, no
 * lse_prior, no diagnostics, at most APE_CU_INLINE_HEADS heads): Q and K rotated once, then
 * tensor-core tiles. applies() is conservative; the scratch counts the shape alone (0 when no
 * launch of that shape could take the path). o_scalar: O's element pairs are not aligned for
 * one 2-element store. The caller has entered the device and loaded the modules. */
bool ape__cu_separable_applies(const struct ape_be_launch *l);
/* Whether this path may take a launch of l's shape and heads, alone or in a split (some head
 * with lambda = 0), whatever its lse_prior, diagnostics and pairs: attention_pages declines
 * such a launch, since this path reads no pages. */
bool ape__cu_separable_may_apply(const struct ape_be_launch *l);
uint64_t ape__cu_separable_scratch(const struct ape_be_launch *l);
int ape__cu_separable(struct ape_be_queue *q, const struct ape_be_launch *l, bool o_scalar);
/* Launches mixing kv groups whose heads all have lambda = 0 with others (the separable path's
 * shape, no pairs): each run of consecutive kv groups of one kind as a sub-launch of its own
 * (ape_be_launch_heads()) through ape__cu_attention(). The separable scratch of the whole launch
 * bounds each run's. */
bool ape__cu_split_applies(const struct ape_be_launch *l);
int ape__cu_split(struct ape_be_queue *q, const struct ape_be_launch *l);

/* ---- cuda_backward.c */
int ape__cu_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l);
/* ABI 10 (cuda_backward.c): queue-ordered scratch buffers and copy_view. */
int ape__cu_scratch_buf_alloc(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out);
int ape__cu_scratch_buf_free(struct ape_be_queue *q, struct ape_be_buf *buf);
int ape__cu_copy_view(struct ape_be_queue *q, const struct ape_be_copy *c);
/* attention_merge (cuda_merge.c) */
int ape__cu_attention_merge(struct ape_be_queue *q, const struct ape_be_merge *m);
uint64_t ape__cu_attention_backward_scratch(struct ape_device *dev,
					    const struct ape_be_bwd_launch *l, unsigned parts);
/* The most scratch bytes one backward launch of this process allocated: tests compare it with
 * attention_backward_scratch. */
extern atomic_uint_fast64_t ape__cu_bwd_scratch_high;

/* ---- fatbin_embed.S: the fatbins nvcc built, in APE__CU_MOD_* order */
extern const unsigned char ape__cu_fatbin_prep[];
extern const unsigned char ape__cu_fatbin_window[];
extern const unsigned char ape__cu_fatbin_decode[];
extern const unsigned char ape__cu_fatbin_prefill[];
extern const unsigned char ape__cu_fatbin_backward[];
extern const unsigned char ape__cu_fatbin_separable[];

#pragma GCC visibility pop
#endif /* APE_CUDA_CU_H */
