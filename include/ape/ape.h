/* SPDX-License-Identifier: MIT */
/**
 * \file ape.h
 * \brief libape: fused APE (adaptive positional encoding) attention on any accelerator.
 *
 * The operation is defined in docs/ape.md. In short, for head h, query row i and visible key row j,
 * with n = pos_q(i) - pos_k(j):
 *
 *     alpha_i = 1 + lambda_h * sigmoid(-std(q_i))
 *     dot     = sum_p rotate(k_j pair p, by n * rope_base^(-2p/D) / alpha_i) . q_i pair p
 *     s_ij    = scale * dot / (1 + lambda_h |n|) - delta_h |n| - beta_h ln(1+|n|) - gamma_h sqrt(|n|)
 *     O_i     = softmax_j(s_ij) V,   LSE_i = ln sum_j exp(s_ij)
 *
 * ## Error model
 * Every function that can fail returns a negative `APE_E*` code (0 or a count on success). The code
 * says what kind of failure it was; `ape_last_error()` gives a message for people that names the
 * function, the argument, the head and the value ("ape_attention_forward: desc->lambda.per_head[3] =
 * -0.5: must be >= 0"). Nothing aborts: a missing driver or a failing device is reported, never fatal.
 * On failure, outputs are left untouched unless the function's documentation says otherwise.
 *
 * ## Threading
 * libape has no global mutable state. The last-error message is per thread. A context may be used
 * from several threads at once: `ape_device_list()`, `ape_device_get_info()`, `ape_backend_get_info()`,
 * `ape_device_select()`, `ape_device_select_spec()`, the physical-device and topology queries
 * (`ape_physical_get_info()`, `ape_physical_link()`, `ape_topology_get_info()`,
 * `ape_numa_get_info()`, `ape_numa_distance()`), `ape_device_measure_h2d()` and
 * `ape_attention_forward()` and `ape_attention_forward_ex()` are thread-safe, including several
 * concurrent forward calls on the same device; so are `ape_attention_backward()` and
 * `ape_attention_backward_ex()`. A KV cache (`ape_kv_cache_*`) is used by one
 * thread at a time. `ape_context_create()` may be called concurrently;
 * `ape_context_destroy()` must not race with any other call on the same context.
 * The pure helpers (`ape_strerror()`, `ape_convert()`, the enum name functions `ape_*_name()` and
 * `ape_*_from_name()`, descriptor init functions) are thread-safe.
 */
#ifndef APE_APE_H
#define APE_APE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(APE_BUILDING_LIBRARY) && defined(__GNUC__)
#define APE_API __attribute__((visibility("default")))
#else
#define APE_API
#endif

/** \name Version
 * Releases with the same major number are ABI compatible. */
/**@{*/
#define APE_VERSION_MAJOR 0
#define APE_VERSION_MINOR 1
#define APE_VERSION_PATCH 0
/** The version this header describes, as one comparable number. */
#define APE_VERSION ((APE_VERSION_MAJOR << 16) | (APE_VERSION_MINOR << 8) | APE_VERSION_PATCH)

/** \brief Version of the library actually loaded, encoded like `APE_VERSION`. */
APE_API unsigned ape_version(void);
/** \brief The loaded library's version as a string, e.g. "0.1.0". */
APE_API const char *ape_version_string(void);
/**@}*/

/** \name Errors
 * One table generates the codes, their names and their descriptions. Codes that match an errno
 * value are that value negated; libape's own codes live in -4000..-4099. Codes are never renumbered.
 */
/**@{*/
#define APE_ERRNO_MAP(XX)                                                                          \
	XX(EIO, -5, "input/output error")                                                          \
	XX(ENOMEM, -12, "out of memory")                                                           \
	XX(EBUSY, -16, "resource busy")                                                            \
	XX(ENODEV, -19, "no such device")                                                          \
	XX(EINVAL, -22, "invalid argument")                                                        \
	XX(ERANGE, -34, "value out of range")                                                      \
	XX(EOVERFLOW, -75, "size or position overflows")                                           \
	XX(ENOTSUP, -95, "operation not supported")                                                \
	XX(EBACKEND, -4000, "backend driver error")                                                \
	XX(EDEVLOST, -4001, "device lost")                                                         \
	XX(EBUILD, -4002, "kernel build failed")                                                   \
	XX(ENOBACKEND, -4003, "backend not available")                                             \
	XX(EFORMAT, -4004, "malformed input file")

typedef enum ape_status {
	APE_OK = 0,
#define APE__ERR_ENUM(name, value, text) APE_##name = (value),
	APE_ERRNO_MAP(APE__ERR_ENUM)
#undef APE__ERR_ENUM
} ape_status;

/** \brief Short description of an error code ("invalid argument"); "unknown error" for codes not
 *  in the table. Never NULL, never allocates. */
APE_API const char *ape_strerror(int err);
/** \brief Symbolic name of an error code ("APE_EINVAL"); "APE_EUNKNOWN" for unknown codes. */
APE_API const char *ape_err_name(int err);
/**
 * \brief Message describing the last failure of a libape call on the calling thread.
 *
 * Set whenever a function returns a negative code; not cleared by successful calls. The string is
 * owned by the library and valid until the next libape call on this thread. Never NULL.
 */
APE_API const char *ape_last_error(void);
/**@}*/

/** \name Data types and tensors */
/**@{*/
typedef enum ape_dtype {
	APE_F32 = 0, /**< IEEE binary32 */
	APE_F16 = 1, /**< IEEE binary16 */
	APE_BF16 = 2, /**< bfloat16: the upper half of a binary32 */
} ape_dtype;

/** \brief Bytes per element of \p dt, or 0 for an unknown type. */
APE_API size_t ape_dtype_size(ape_dtype dt);
/** \brief "f32", "f16", "bf16", or "?" for an unknown type. Never NULL, never allocates. */
APE_API const char *ape_dtype_name(ape_dtype dt);
/**
 * \brief The storage type ape_dtype_name() calls \p name ("f32", "f16", "bf16"; exact,
 * case-sensitive).
 * \return the ape_dtype (>= 0), or APE_EINVAL (NULL or unknown name; the message lists the
 *         names). Thread-safe.
 */
APE_API int ape_dtype_from_name(const char *name);

/**
 * \brief Converts \p n elements between storage types, rounding to nearest even.
 *
 * Widening conversions are exact. \p dst and \p src must not overlap unless they are equal and the
 * types have the same size.
 * \return 0, or APE_EINVAL (unknown type, NULL pointer with n > 0).
 */
APE_API int ape_convert(void *dst, ape_dtype dst_type, const void *src, ape_dtype src_type, size_t n);

/**
 * \brief A host tensor: pointer, storage type, 4-D shape and strides.
 *
 * Shapes are `[B, H, L, D]` for Q and O and `[B, Hkv, L, D]` for K and V. Strides are in elements;
 * if all four are 0 the tensor is contiguous row-major. Otherwise every stride must be >= 1, except
 * along a dimension of size 0 or 1 (never stepped along), where 0 is accepted too. Strides may
 * describe, for instance, a `[B, L, H, D]` buffer or one slice of a packed QKV tensor; input rows
 * may even overlap. An output must not overlap an input, and its own elements must be provably
 * distinct: sorted by stride, each stride must reach past everything the smaller ones address
 * (a conservative rule that rejects a few exotic non-overlapping layouts).
 */
typedef struct ape_tensor {
	void *data;
	ape_dtype dtype;
	int64_t shape[4];
	int64_t strides[4];
} ape_tensor;

/** \brief Fills \p t as a contiguous tensor of the given shape. Never fails. */
APE_API void ape_tensor_init(ape_tensor *t, void *data, ape_dtype dtype, int64_t d0, int64_t d1,
			     int64_t d2, int64_t d3);

/** \brief The element strides libape uses for \p t: its own, or the row-major ones when all four
 *  are 0. Does not validate them. Never fails. */
APE_API void ape_tensor_strides(const ape_tensor *t, int64_t strides[4]);

/**
 * \brief A view of rows [\p first, \p first + \p count) of \p t along its sequence axis (axis 2):
 * the same storage, explicit strides. For feeding a long sequence piece by piece (a KV cache's
 * appends, chunked prefill) without copying.
 * \return 0, or APE_EINVAL (t or out NULL, a shape or stride < 0, or the rows outside [0, L)).
 *         Thread-safe.
 */
APE_API int ape_tensor_rows(const ape_tensor *t, int64_t first, int64_t count, ape_tensor *out);
/**@}*/

/** \name Attention descriptor */
/**@{*/
typedef enum ape_rope_layout {
	APE_ROPE_HALF = 0, /**< pairs (p, p + D/2): GPT-NeoX / LLaMA */
	APE_ROPE_INTERLEAVED = 1, /**< pairs (2p, 2p + 1): GPT-J */
} ape_rope_layout;

/** \brief "half", "interleaved", or "?" for another value. Never NULL, never allocates. */
APE_API const char *ape_rope_layout_name(ape_rope_layout layout);
/**
 * \brief The layout ape_rope_layout_name() calls \p name (exact, case-sensitive).
 * \return the ape_rope_layout (>= 0), or APE_EINVAL (NULL or unknown name; the message lists
 *         the names). Thread-safe.
 */
APE_API int ape_rope_layout_from_name(const char *name);

/** \brief A per-head parameter: one value for every head, or an array of H values. */
typedef struct ape_param {
	float value; /**< used when per_head is NULL */
	const float *per_head; /**< H values, read during the call only; NULL for one value */
} ape_param;

/** The largest head dimension D (the last dimension of q, k, v and o, and ape_kv_cache_opts.D)
 *  any call takes: D is even and in 2..APE_MAX_D (APE-SPEC.md, "Shapes and positions"). One row
 *  of a head, D values, fits in an array of APE_MAX_D. */
#define APE_MAX_D 256

/**
 * \brief Every parameter of the operation. Start from ape_attn_desc_init(), then change fields.
 */
typedef struct ape_attn_desc {
	size_t struct_size; /**< set by ape_attn_desc_init(); lets later versions grow the struct */
	ape_param delta; /**< linear decay; finite */
	ape_param beta; /**< log decay; finite */
	ape_param gamma; /**< square-root decay; finite */
	ape_param lambda; /**< rotation and temperature adaptivity; finite, >= 0 */
	double rope_base; /**< default 10000; finite, > 0 */
	double scale; /**< used when scale_set; finite */
	bool scale_set; /**< false: scale = 1/sqrt(D) (the default) */
	bool causal; /**< default true: key j visible to query i iff pos_k(j) <= pos_q(i) */
	ape_rope_layout layout; /**< default APE_ROPE_HALF */
	int64_t k_start; /**< position of key row 0; default 0 */
	int64_t q_start; /**< position of query row 0; used when q_start_set */
	bool q_start_set; /**< false: q_start = k_start + Lk - Lq (queries end-aligned) */
	double skip_tol; /**< far-key skipping tolerance; default 2^-24; 0 = never skip; finite, >= 0 */
	/* ---- added after the first layout (APE_ATTN_DESC_V1_SIZE) with explicit positions */
	/**
	 * Both NULL (the default): query row i is at q_start + i and key row j at k_start + j. Else
	 * both set: explicit positions, pos_q[i] of query row i (Lq entries) and pos_k[j] of key
	 * row j (Lk entries), shared by every batch element and head, so that n = pos_q[i] -
	 * pos_k[j] (causal: key j visible to query i iff pos_k[j] <= pos_q[i]). Any int64 values in
	 * any order, with gaps and repeats, as long as every pair's n fits in int64 (else
	 * APE_EOVERFLOW naming desc->pos_q). q_start_set must then be false and k_start 0. Read
	 * during the call only. Taken by ape_attention_forward(), ape_attention_forward_ex(),
	 * ape_attention_backward(), ape_attention_backward_ex() and ape_visible_pairs(); every
	 * other call that takes a desc (the KV cache, device tensors and DLPack, the ragged and
	 * diagnostics calls, libape_mpi) refuses them with APE_EINVAL naming desc->pos_q. See
	 * "Explicit positions in the dense call" in docs/ape.md.
	 */
	const int64_t *pos_q;
	const int64_t *pos_k; /**< see pos_q */
	/* ---- added after the second layout (APE_ATTN_DESC_V2_SIZE) with position interpolation */
	/**
	 * Position interpolation (progressive length scaling, p' = p / s): the rotation turns by
	 * n / rope_scale where it turned by n, theta_p = (n / rope_scale) omega_p / alpha_i, while
	 * the bias and the temperature keep the true n. Default 1 (no scaling); finite, > 0 (else
	 * APE_EINVAL naming desc->rope_scale). A model trained at length L runs at s L with
	 * rope_scale = s. Every call that takes a desc honours it, the gradients included (the
	 * parameter gradients are those of the scaled rotation); see "Position interpolation" in
	 * docs/ape.md.
	 */
	double rope_scale;
	/* ---- added after the third layout (APE_ATTN_DESC_V3_SIZE) with the distance-bias table */
	/**
	 * A per-head distance-bias table (docs/ape.md, "Distance-bias tables"): NULL (the default)
	 * for none. Else float32 `[bias_table_heads, bias_table_len]`, row-major, read during the
	 * call only: every score of head h gets `bias_table[h * M + min(|n|, M - 1)]` added after
	 * the temperature, beside the decay bias (M = bias_table_len; a distance past the table
	 * takes its last entry; with bias_table_heads 1, row 0 serves every head). T5's buckets,
	 * a Gaussian -lambda n^2, a learned relative bias: each is a table the caller expands once.
	 * Every value finite (else APE_EINVAL naming desc->bias_table[h][m] and the value). Taken
	 * by every call that takes a desc except libape_mpi's; on a device whose backend does
	 * not compute tables, APE_ENOTSUP naming the device. Skipping stays exact: the far-key
	 * bound adds the table's largest value at or beyond each tile's nearest distance.
	 */
	const float *bias_table;
	int64_t bias_table_len; /**< M: 1 .. APE_BIAS_TABLE_MAX entries per head (with bias_table) */
	int64_t bias_table_heads; /**< rows of bias_table: H (one per head) or 1 (shared) */
	/**
	 * NULL, or float32 `[bias_table_heads, bias_table_len]`: the table's gradient dL/dT, written
	 * by ape_attention_backward(), ape_attention_backward_ex() and
	 * ape_attention_backward_varlen() on success (entry m: the sum of dL/ds over every pair
	 * whose min(|n|, M - 1) is m, over the batch, and over the heads for a shared table; in a
	 * fixed order: bit-identical from run to run) and untouched on failure. Needs bias_table
	 * and must not overlap it (APE_EINVAL naming desc->dbias_table); nor should it overlap
	 * the call's other arrays. Forward calls ignore it; the device-resident backward refuses
	 * it (APE_EINVAL naming desc->dbias_table).
	 */
	float *dbias_table;
} ape_attn_desc;

/** The largest bias_table_len a call takes (2^24 entries per head). */
#define APE_BIAS_TABLE_MAX ((int64_t)1 << 24)

/** The size of ape_attn_desc before pos_q and pos_k were added: a caller built against that
 *  layout passes it as struct_size (the library then reads no field past skip_tol: the
 *  positions are NULL, rope_scale 1). ape_attn_desc_init() sets sizeof(ape_attn_desc). */
#define APE_ATTN_DESC_V1_SIZE offsetof(ape_attn_desc, pos_q)
/** The size of ape_attn_desc before rope_scale was added (the library reads no field past
 *  pos_k: rope_scale is 1). */
#define APE_ATTN_DESC_V2_SIZE offsetof(ape_attn_desc, rope_scale)
/** The size of ape_attn_desc before the distance-bias table was added (the library reads no
 *  field past rope_scale: no table). */
#define APE_ATTN_DESC_V3_SIZE offsetof(ape_attn_desc, bias_table)

/**
 * \brief Sets the defaults: all four decay/adaptivity parameters 0 (plain RoPE attention),
 * rope_base 10000, rope_scale 1, scale 1/sqrt(D), causal, half layout, end-aligned queries,
 * skip_tol 2^-24.
 * Never fails.
 */
APE_API void ape_attn_desc_init(ape_attn_desc *desc);
/**@}*/

/** \name Contexts, backends and devices */
/**@{*/
typedef struct ape_context ape_context;
typedef struct ape_device ape_device;

/**
 * \brief Where host staging buffers and feeding threads of a device go (see "Devices and
 * topology" in the README).
 */
typedef enum ape_numa_policy {
	/** From the environment variable `APE_NUMA` (local, interleave or off); local when unset. */
	APE_NUMA_DEFAULT = 0,
	/** Staging buffers on the device's NUMA node, feeding threads on its local CPUs. A device
	 *  local to several nodes (a CPU device) gets its buffers interleaved over them. */
	APE_NUMA_LOCAL = 1,
	/** Staging buffers interleaved over every node; threads not bound. */
	APE_NUMA_INTERLEAVE = 2,
	/** No placement: plain allocations, threads not bound. */
	APE_NUMA_OFF = 3,
} ape_numa_policy;

/** \brief "default", "local", "interleave", "off" (the last three are what `APE_NUMA` takes),
 *  or "?" for another value. Also names ape_physical_info.staging_policy. Never NULL, never
 *  allocates. */
APE_API const char *ape_numa_policy_name(ape_numa_policy policy);
/**
 * \brief The policy ape_numa_policy_name() calls \p name (exact, case-sensitive).
 * \return the ape_numa_policy (>= 0; "default" gives APE_NUMA_DEFAULT), or APE_EINVAL (NULL or
 *         unknown name; the message lists the names). Thread-safe.
 * \note `APE_NUMA` itself takes only local, interleave and off.
 */
APE_API int ape_numa_policy_from_name(const char *name);

/** Options for ape_context_create(). Fields are only ever added at the end; struct_size tells
 *  the library which ones the caller knows of. */
typedef struct ape_context_options {
	size_t struct_size; /**< set by ape_context_options_init() */
	/** Comma-separated backends to load ("ref,opencl", a plugin's name among them), or NULL for
	 *  every backend built in and every plugin found. */
	const char *backends;
	/** APE_CONTEXT_* flags. */
	unsigned flags;
	/**
	 * An hwloc XML topology file (`lstopo --of xml`), or NULL for this machine. The context then
	 * describes the machine in that file: its physical device list holds the GPUs and
	 * accelerators on that file's PCI bus with their NUMA nodes and local CPUs, none of them
	 * usable. Backends are still probed, so the context still computes on this machine's
	 * devices, but nothing is ever bound: buffers are plain allocations. For planning a
	 * deployment and for tests.
	 */
	const char *topology_xml;
	/** Placement policy; APE_NUMA_DEFAULT reads `APE_NUMA`. */
	ape_numa_policy numa;
	/**
	 * Physical devices this context may use, as `APE_VISIBLE_DEVICES` takes them: comma-separated
	 * physical indices (as listed without any filter) or PCI addresses, "1,0000:c1:00.0". NULL
	 * reads `APE_VISIBLE_DEVICES`; NULL or "" with the variable unset or empty means every
	 * device. The reference device is always visible.
	 */
	const char *visible_devices;
	/**
	 * Interop with the caller's OpenCL objects: a `cl_context` and one `cl_device_id` of it, or
	 * both NULL. The OpenCL device libape lists for that cl_device_id is then built on the
	 * caller's context (retained, never released beyond that), so that `cl_mem` objects and
	 * command queues of it can be wrapped (ape_buffer_wrap_opencl(), ape_queue_wrap_opencl()).
	 * ape_device_native() tells which device that is. APE_EINVAL when only one is set or the
	 * device is not one of the context's; APE_ENODEV when the OpenCL backend is not loaded.
	 */
	void *opencl_context;
	void *opencl_device; /**< see opencl_context */
	/**
	 * The call log of this context's calls (docs/profiling.md): -1 (what
	 * ape_context_options_init() sets) reads `APE_VERBOSE`; 0 quiet; 1 one line per call to
	 * stderr, prefixed "libape:", naming the call, the devices, the shape, the kernel path
	 * and why, pairs and times, and every failing call's error; 2 the planner's decisions
	 * as well. `APE_VERBOSE_FORMAT=json` makes each line a JSON object. A failure before any
	 * device is known is logged at the largest level any context asked for. APE_EINVAL
	 * outside -1..2. Layouts up to opencl_device (without this field) are still accepted
	 * and read `APE_VERBOSE`.
	 */
	int verbose;
	/**
	 * Backend plugins to load (docs/backends.md): `:`-separated shared objects or folders
	 * (every `libape-backend-*.so` in a folder, in name order), or NULL to read
	 * `APE_BACKEND_PATH` instead. The plugin folder under the install prefix
	 * (`$(PREFIX)/lib/libape/backends/`, the PREFIX libape was built with) is searched after
	 * these unless the APE_CONTEXT_NO_PLUGIN_DIR flag is set. "" loads none from the path;
	 * empty entries and folders that do not exist are nothing. Plugins register after the
	 * built-in backends, in the order found; a plugin's backend name then works wherever one
	 * is taken (ape_context_options.backends, ape_device_select(), `APE_BACKEND`, device
	 * specs). A plugin that cannot be loaded (a file named here that is not there, a `dlopen`
	 * error, no entry point, wrong ABI, a missing op, a name already taken, a failed probe, no
	 * device) is listed with the reason by ape_plugin_get_info() and never fails the context;
	 * only host memory running out does (APE_ENOMEM). Each context opens its plugins and
	 * closes them when destroyed. Layouts up to `verbose` (without this field) read
	 * `APE_BACKEND_PATH`. A program linked with the static libape exports its API to the
	 * plugins (`-Wl,--dynamic-list` of `ape_*`; docs/backends.md).
	 */
	const char *backend_path;
} ape_context_options;

/** Fill every device output buffer with NaN before each kernel runs, so a kernel that misses an
 *  element is caught by tests. Costs one extra fill per call. */
#define APE_CONTEXT_POISON_OUTPUTS (1u << 0)
/** Search no plugin folder under the install prefix: only ape_context_options.backend_path (or
 *  `APE_BACKEND_PATH`). */
#define APE_CONTEXT_NO_PLUGIN_DIR (1u << 1)

/** \brief Sets the defaults (every built backend, no flags, this machine, APE_NUMA_DEFAULT, the
 *  visible devices from the environment). Never fails. */
APE_API void ape_context_options_init(ape_context_options *opts);

/**
 * \brief Creates a context: loads the backends, probes their drivers and lists their devices.
 *
 * A backend whose driver is missing or which finds no device is not an error: it is recorded as
 * unavailable with the reason (see ape_backend_get_info()), and the context has fewer devices.
 * It also reads the machine's topology with hwloc (or opts->topology_xml), enumerates DRM
 * devices, and merges every device into the physical device list (ape_physical_get_info()).
 * \param[out] out the new context; set to NULL on failure
 * \param opts NULL for the defaults
 * \return 0; APE_EINVAL (NULL out, unknown backend name in opts->backends, bad struct_size or
 *         numa policy, malformed `APE_NUMA` or visible-devices list, opts->topology_xml missing);
 *         APE_ENODEV (the visible-devices list names a device that does not exist); APE_EIO
 *         (opts->topology_xml cannot be read); APE_EFORMAT (it is not an hwloc XML topology);
 *         APE_ENOMEM. Messages name the option or variable and the file.
 */
APE_API int ape_context_create(ape_context **out, const ape_context_options *opts);
/** \brief Releases the context, its devices and their resources. Accepts NULL. */
APE_API void ape_context_destroy(ape_context *ctx);

typedef struct ape_backend_info {
	char name[16]; /**< "ref", "opencl", "cuda", or a loaded plugin's name */
	bool built; /**< compiled into this library (a loaded plugin: true) */
	bool available; /**< built, driver loaded, and at least one device found */
	int device_count;
	char reason[256]; /**< why it is not available ("libcuda.so.1 not found"); "" when it is */
} ape_backend_info;

/**
 * \brief Number of backends libape knows of (built or not, then the plugins the context loaded,
 * in the order found), when \p info is NULL; otherwise fills \p info for backend \p index.
 * \return the count, 0 when filled, or APE_EINVAL (NULL ctx, index out of range).
 */
APE_API int ape_backend_get_info(const ape_context *ctx, int index, ape_backend_info *info);

/** One backend plugin the context found (docs/backends.md), loaded or not. */
typedef struct ape_plugin_info {
	char path[4096]; /**< the shared object, as found (in a folder: FOLDER/libape-backend-X.so) */
	char name[16]; /**< the backend name its table gives; "" when none was read */
	bool loaded; /**< registered as a backend (its name is a backend name of the context) */
	int device_count; /**< devices it added (0 when not loaded) */
	unsigned abi_major, abi_minor; /**< the backend ABI its table states; 0 when none was read */
	/** why it is not loaded ("not found: No such file or directory", "dlopen: ...: cannot open
	 *  shared object file", "not a libape backend: no symbol ape_backend_plugin (...)",
	 *  "refused: backend ABI 2.0: ...", "refused: required op attention is missing",
	 *  "refused: the backend name \"ref\" is taken by the built-in backend ref", "refused:
	 *  probe failed (APE_EBACKEND): ...", "not loaded: left out by
	 *  ape_context_options.backends", "no device found: ..."); "" when it is */
	char reason[512];
} ape_plugin_info;

/**
 * \brief Number of plugins the context found (from ape_context_options.backend_path or
 * `APE_BACKEND_PATH`, and the plugin folder), when \p info is NULL; otherwise fills \p info for
 * plugin \p index, in the order they were found.
 * \return the count, 0 when filled, or APE_EINVAL (NULL ctx, index out of range).
 */
APE_API int ape_plugin_get_info(const ape_context *ctx, int index, ape_plugin_info *info);

/**
 * \brief A backend's extra function called \p name, as its table's proc_address gives it
 * (ape/ape_backend.h): how a vendor's plugin offers calls of its own to the programs that load
 * it, in the manner of ggml's `get_proc_address`.
 * \return the function, or NULL (NULL ctx or names, backend not loaded in ctx, no such
 *         function). Thread-safe.
 */
APE_API void *ape_backend_get_proc(const ape_context *ctx, const char *backend, const char *name);

/**
 * \brief Count-then-fill enumeration of the context's devices.
 *
 * With \p devs NULL, returns the number of devices. Otherwise stores up to \p cap device handles
 * (owned by the context, valid until it is destroyed) and returns how many were stored.
 * Devices are ordered by backend preference (CUDA, OpenCL GPUs, OpenCL CPUs, reference), then
 * in the order their driver reports them; the order is stable for a given machine and build.
 * \return a count >= 0, or APE_EINVAL (NULL ctx).
 */
APE_API int ape_device_list(ape_context *ctx, ape_device **devs, int cap);

typedef enum ape_device_kind {
	APE_DEVICE_CPU = 0,
	APE_DEVICE_GPU = 1,
	APE_DEVICE_ACCELERATOR = 2,
	APE_DEVICE_HOST_REFERENCE = 3, /**< the plain-C reference; float64 accumulation; slow */
} ape_device_kind;

/** \brief "cpu", "gpu", "accelerator", "reference", or "?" for another value. Never NULL, never
 *  allocates. */
APE_API const char *ape_device_kind_name(ape_device_kind kind);
/**
 * \brief The kind ape_device_kind_name() calls \p name (exact, case-sensitive).
 * \return the ape_device_kind (>= 0), or APE_EINVAL (NULL or unknown name; the message lists
 *         the names). Thread-safe.
 */
APE_API int ape_device_kind_from_name(const char *name);

typedef struct ape_device_info {
	char name[128];
	char vendor[64];
	char backend[16]; /**< backend that drives the device */
	char driver_version[64];
	ape_device_kind kind;
	int index; /**< position in ape_device_list() */
	int backend_index; /**< position among the devices of its backend */
	int compute_units;
	uint64_t global_mem_bytes; /**< 0 if unknown */
	char pci_address[16]; /**< "0000:03:00.0", or "" when the device has none or does not say */
	/** Position of the physical device it runs on in ape_physical_get_info(); -1 when the
	 *  context describes another machine (topology XML). */
	int physical_index;
	int numa_node; /**< OS index of its NUMA node; -1 when unknown or local to several */
	char cpuset[256]; /**< its local CPUs (OS indices), list format "0-7,16-23"; "" unknown */
} ape_device_info;

/** \brief Describes \p dev. \return 0 or APE_EINVAL (NULL argument). */
APE_API int ape_device_get_info(const ape_device *dev, ape_device_info *info);

/**
 * \brief What device \p dev can do, as its backend states it: the APE_BE_CAP_* bits of
 * ape/ape_backend.h (the diagnostics, on device tensors too; the backward pass, on device tensors
 * too; ragged launches; explicit positions; host memory in place; device timestamps).
 * ape_be_cap_name() names each bit. A call that needs a capability the device does not state
 * fails with APE_ENOTSUP naming the device, or runs through the core's fallback where there is
 * one (ragged batches as one launch per sequence, positions as runs); what a device states, it
 * must do (`ape-check` holds a backend to it).
 * \return the bits; 0 for NULL. Thread-safe.
 */
APE_API uint64_t ape_device_capabilities(const ape_device *dev);

/** Result of ape_device_select(). */
typedef struct ape_selection {
	ape_device *device; /**< the device chosen */
	/** True when a backend preferred over the chosen one was not available; `note` says why. */
	bool passed_over;
	/** Which backend was chosen and why the preferred ones were not: "ran on opencl:0 (...);
	 *  passed over cuda: not built into this libape (nvcc not found at build time)". */
	char note[768];
} ape_selection;

/**
 * \brief Chooses a device by backend name and index, never falling back silently.
 *
 * \param backend "ref", "opencl", "cuda", a loaded plugin's name, or "auto"/NULL. For "auto"
 *        the environment variable `APE_BACKEND`, when set and not "auto", names the backend to
 *        use; otherwise the most preferred available device is chosen.
 * \param index device index among that backend's devices (or, for "auto" without APE_BACKEND,
 *        among all devices in ape_device_list() order); -1 for the first.
 * \param[out] sel the device and an explanation
 * \return 0; APE_EINVAL (unknown backend name, NULL pointer); APE_ENOBACKEND (the backend named
 *         is not built or not available, or is a plugin found that did not load; the message
 *         says why); APE_ENODEV (index out of range, or no device at all).
 */
APE_API int ape_device_select(ape_context *ctx, const char *backend, int index, ape_selection *sel);

/**
 * \brief Chooses a device from a text specification, as `ape-run --device` takes it.
 *
 * \param spec one of:
 *   - NULL, "" or "auto": as ape_device_select(ctx, "auto", -1, sel);
 *   - a PCI address, "0000:03:00.0" or "03:00.0": that physical device, through its default
 *     backend (ape_physical_info.backend);
 *   - a number N: physical device N (ape_physical_get_info() order, by PCI address);
 *   - a backend name, "opencl": as ape_device_select(ctx, "opencl", -1, sel);
 *   - "BACKEND:N": device N of that backend, as ape_device_select(ctx, BACKEND, N, sel);
 *   - "BACKEND:ADDRESS": the device at that PCI address through that backend, overriding its
 *     default ("opencl:0000:03:00.0" runs an NVIDIA GPU through OpenCL).
 * \param[out] sel the device and an explanation
 * \return 0; APE_EINVAL (NULL ctx or sel, malformed spec or address, unknown backend);
 *         APE_ENODEV (no such device or index); APE_ENOBACKEND (the device exists but no backend
 *         of this context drives it, or not the one named; the message says why).
 */
APE_API int ape_device_select_spec(ape_context *ctx, const char *spec, ape_selection *sel);
/**@}*/

/** \name Physical devices, NUMA placement and topology
 *
 * A physical device is one piece of hardware: a GPU, an accelerator, the CPU, or the reference.
 * A logical device (ape_device) is a physical device as one backend drives it. One GPU seen by
 * CUDA, OpenCL and DRM is one physical device; two identical GPUs on different buses are two.
 * Physical indices are stable: PCI devices ordered by PCI address (domain, bus, device,
 * function), then devices without an address (GPUs whose driver does not say, then the CPU),
 * then the reference.
 */
/**@{*/

/** \name API flags of ape_physical_info.apis */
/**@{*/
#define APE_API_CUDA (1u << 0) /**< the CUDA driver reports it */
#define APE_API_OPENCL (1u << 1) /**< an OpenCL platform reports it */
#define APE_API_DRM (1u << 2) /**< the kernel's DRM has a render node for it */
#define APE_API_HOST (1u << 3) /**< libape's own host code (the reference) */
/**@}*/

/** \brief "cuda", "opencl", "drm", "host" for one APE_API_* flag; "?" for 0, several flags or
 *  an unknown one. Never NULL, never allocates. */
APE_API const char *ape_api_name(unsigned api);
/**
 * \brief The APE_API_* flag ape_api_name() calls \p name (exact, case-sensitive).
 * \return the flag (> 0), or APE_EINVAL (NULL or unknown name; the message lists the names).
 *         Thread-safe.
 */
APE_API int ape_api_from_name(const char *name);

/** One physical device. */
typedef struct ape_physical_info {
	int index; /**< position in the physical list */
	char name[128]; /**< from the driver, or "NVIDIA GPU [10de:2330]" when none reports it */
	char vendor[64];
	uint16_t pci_vendor_id; /**< 0 when unknown (not on PCI, or no one says) */
	uint16_t pci_device_id; /**< 0 when unknown */
	char pci_address[16]; /**< "0000:03:00.0", or "" when not on PCI or unknown */
	ape_device_kind kind;
	unsigned apis; /**< APE_API_* flags: what sees it; 0 for a device found only on the bus */
	char render_node[64]; /**< "/dev/dri/renderD128", or "" */
	/** A backend of this context drives it: ape_device_select_spec() can choose it. */
	bool usable;
	/**
	 * Why it is not usable ("NVIDIA GPU at 0000:03:00.0 but cuda: libcuda.so.1 not found",
	 * "AMD GPU at 0000:c1:00.0 but no OpenCL driver reports it"); for a usable device driven by
	 * another backend than its vendor's preferred one, why ("cuda: ...; driven through
	 * opencl"); otherwise "".
	 */
	char reason[256];
	/** ape_device_list() index of the logical device used by default, or -1 when unusable. */
	int device_index;
	/** The default backend: "cuda" for NVIDIA GPUs CUDA reaches, "opencl" for other GPUs,
	 *  accelerators and CPUs, "ref" for the reference; for an unusable device the backend that
	 *  would drive it. */
	char backend[16];
	int numa_node; /**< OS index of its NUMA node; -1 when unknown or local to several */
	char numa_nodes[64]; /**< every node it is local to, list format ("0", "0-1"); "" unknown */
	char cpuset[256]; /**< its local CPUs (OS indices), list format "0-7,16-23"; "" unknown */
	/** How host staging buffers for it are placed under the context's policy: APE_NUMA_LOCAL
	 *  (bound to staging_nodes), APE_NUMA_INTERLEAVE (interleaved over staging_nodes) or
	 *  APE_NUMA_OFF (a plain allocation: the node is unknown, or the policy is off). For a
	 *  topology XML context, where they would be placed on that machine. */
	ape_numa_policy staging_policy;
	char staging_nodes[64]; /**< list format; "" for APE_NUMA_OFF */
	uint64_t memory_bytes; /**< device memory; 0 when unknown */
	int compute_units; /**< 0 when unknown */
} ape_physical_info;

/**
 * \brief Count-then-fill enumeration of the physical devices: with \p info NULL, returns how
 * many there are; otherwise fills \p info for physical device \p index.
 *
 * The list holds every device some API reports and every GPU or accelerator found on the PCI
 * bus (display controllers of BMCs and virtual machines excepted), usable or not, less those
 * `APE_VISIBLE_DEVICES` hides.
 * \return the count, 0 when filled, or APE_EINVAL (NULL ctx, index out of range).
 */
APE_API int ape_physical_get_info(const ape_context *ctx, int index, ape_physical_info *info);

/** How two physical devices are connected, in the words of `nvidia-smi topo -m`. */
typedef enum ape_link {
	APE_LINK_SELF = 0, /**< "X": the same device */
	APE_LINK_PIX = 1, /**< "PIX": through at most one PCIe bridge or switch */
	APE_LINK_PXB = 2, /**< "PXB": through several PCIe bridges, no host bridge */
	APE_LINK_PHB = 3, /**< "PHB": through a PCIe host bridge (the CPU's root complex) */
	APE_LINK_NODE = 4, /**< "NODE": between host bridges of one NUMA node */
	APE_LINK_SYS = 5, /**< "SYS": across NUMA nodes, over the SMP interconnect */
	APE_LINK_UNKNOWN = 6, /**< "-": not both on the PCI bus hwloc sees */
} ape_link;

/**
 * \brief The connection between physical devices \p a and \p b.
 * \return an ape_link (>= 0), or APE_EINVAL (NULL ctx, index out of range).
 */
APE_API int ape_physical_link(const ape_context *ctx, int a, int b);

/** \brief "X", "PIX", "PXB", "PHB", "NODE", "SYS", "-" for \p link; "?" for other values.
 *  Never NULL, never allocates. */
APE_API const char *ape_link_name(int link);
/**
 * \brief The link ape_link_name() calls \p name (exact, case-sensitive: "PIX", "-").
 * \return the ape_link (>= 0), or APE_EINVAL (NULL or unknown name; the message lists the
 *         names). Thread-safe.
 */
APE_API int ape_link_from_name(const char *name);

/** The machine a context describes. */
typedef struct ape_topology_info {
	/** The topology is this machine's: placement and binding are real. False for a topology
	 *  XML file, or when hwloc could not read the machine. */
	bool this_machine;
	/** "this machine", "XML file FILE", or what went wrong ("this machine: hwloc: ...") */
	char source[320];
	int numa_nodes; /**< 0 when unknown */
	int packages, cores, pus; /**< 0 when unknown */
	ape_numa_policy numa_policy; /**< the policy in effect: LOCAL, INTERLEAVE or OFF */
	/** How the policy plays out: "one NUMA node: every buffer is local", "APE_NUMA=off", ... */
	char numa_note[256];
	/** DRM enumeration: "2 DRM devices", "no DRM devices (/dev/dri absent)", "not scanned: ..." */
	char drm_note[256];
	/** The visible-devices filter in effect ("" for none) and where it came from. */
	char visible_devices[256];
} ape_topology_info;

/** \brief Describes the machine \p ctx sees. \return 0 or APE_EINVAL (NULL argument). */
APE_API int ape_topology_get_info(const ape_context *ctx, ape_topology_info *info);

/** One NUMA node. */
typedef struct ape_numa_info {
	int index; /**< position among the nodes */
	int os_index; /**< the number Linux gives it (numactl, /sys), used everywhere else */
	uint64_t memory_bytes; /**< 0 when unknown */
	char cpuset[256]; /**< its CPUs, list format; "" for a CPU-less node */
} ape_numa_info;

/**
 * \brief Count-then-fill enumeration of the NUMA nodes: with \p info NULL, returns how many
 * there are (0 when unknown); otherwise fills \p info for node \p index.
 * \return the count, 0 when filled, or APE_EINVAL (NULL ctx, index out of range).
 */
APE_API int ape_numa_get_info(const ape_context *ctx, int index, ape_numa_info *info);

/**
 * \brief Relative memory access cost between NUMA nodes \p from and \p to (OS indices), as the
 * firmware's table gives it (10 for a node to itself, 20 or more across sockets).
 * \return the distance (> 0), 0 when the topology has no distance table, or APE_EINVAL (NULL
 *         ctx, no such node).
 */
APE_API int ape_numa_distance(const ape_context *ctx, int from, int to);

/** Result of ape_device_measure_h2d(). */
typedef struct ape_copy_result {
	double ms; /**< median wall time of one copy, synchronised */
	double gbytes_per_s; /**< bytes per median copy time, in 10^9 bytes per second */
	/** OS index of the node the buffer's pages were found on after the copies, checked with
	 *  the kernel; -1 when they were spread over several or the kernel does not say. */
	int numa_node;
} ape_copy_result;

/**
 * \brief Measures host-to-device copy bandwidth from a host buffer placed on one NUMA node,
 * allocated and pinned the way libape's staging buffers are.
 *
 * \param numa_node OS index of the node to place the buffer on; -1 for the device's staging
 *        placement under the context's policy
 * \param bytes buffer size, > 0
 * \param repeats timed copies, >= 1 (one untimed copy comes first)
 * \return 0; APE_EINVAL (NULL argument, bad size or count, no such node); APE_ENOTSUP (the
 *         context describes another machine, or memory cannot be bound here); APE_ENOMEM;
 *         device errors.
 */
APE_API int ape_device_measure_h2d(ape_device *dev, int numa_node, size_t bytes, int repeats,
				   ape_copy_result *res);
/**@}*/

/** \name Attention */
/**@{*/

/**
 * Statistics of one forward call (or KV-cache call, or backward call, whose `chunks` counts
 * its launches). Fields are only ever added at the end.
 * struct_size is sizeof(ape_stats) (ape_stats_init() sets it) or APE_STATS_V1_SIZE, the first
 * layout, which ended at `device`: such a caller gets those fields only, and nothing past them
 * is written. Any other value is refused with APE_EINVAL.
 */
typedef struct ape_stats {
	size_t struct_size; /**< set by ape_stats_init() */
	uint64_t pairs_visible; /**< (query, key) pairs the mask lets through, all batches and heads */
	uint64_t pairs_computed; /**< pairs whose score was computed (visible minus skipped) */
	double kernel_ms; /**< device time of the attention kernels (device events), all devices */
	double total_ms; /**< wall time of the whole call, copies included */
	uint64_t bytes_to_device; /**< bytes copied host to device: every chunk of Q, K, V */
	uint64_t bytes_from_device; /**< bytes copied back: partial O, LSE and pair counts */
	char backend[16]; /**< "opencl"; several devices: their backends joined by '+' */
	char device[128]; /**< the device's name; several: joined by " + " */
	/* ---- added after the first layout (APE_STATS_V1_SIZE) with streaming execution; the
	 * version number did not change: both layouts are libape 0.1.0's */
	uint64_t chunks; /**< (query chunk, key chunk) pairs computed, i.e. kernel launches */
	/** Chunk pairs never copied nor computed because the skip bound proved their weight
	 *  negligible (chunks the causal mask hides are not counted anywhere). */
	uint64_t chunks_skipped;
	int64_t chunk_q; /**< query rows per chunk the planner chose */
	int64_t chunk_k; /**< key rows per chunk the planner chose */
	int pipeline_depth; /**< chunks in flight per device (1: no overlap) */
	int devices; /**< devices that took part */
	/** The device-memory budget each device ran under, in bytes; UINT64_MAX: none. */
	uint64_t device_budget;
	/** Most device memory the call held at once on one device (the largest over the devices):
	 *  every buffer the executor allocated plus the scratch the backend declares per launch in
	 *  flight. Never above device_budget. */
	uint64_t peak_device_bytes;
	uint64_t bytes_device_to_device; /**< bytes copied within a device (KV-cache gathers) */
	double copy_ms; /**< device time of the copies, both directions, summed over queues */
	/** Device time during which copies and kernels ran at once, summed over devices; 0 when
	 *  the backend cannot timestamp its events. */
	double overlap_ms;
	/* ---- added with the call log (APE_STATS_V2_SIZE ends before it) */
	/** The kernel paths the call's launches took, each once, joined by '+' in a fixed order:
	 *  "reference", "general", "positions" (explicit positions), "ragged", "separable",
	 *  "split" (heads of both kinds), "decode", "decode-in-place" (a KV cache's blocks or a KV
	 *  pool's pages read where they are), "empty", "backward" (a backward launch; with
	 *  lambda = 0 on every head OpenCL's reads "separable+backward"; docs/profiling.md); ""
	 *  when no kernel ran. */
	char path[64];
} ape_stats;

/** struct_size of the first ape_stats layout (up to `device`), still accepted. */
#define APE_STATS_V1_SIZE offsetof(ape_stats, chunks)
/** struct_size of the second layout (up to `overlap_ms`), still accepted. */
#define APE_STATS_V2_SIZE offsetof(ape_stats, path)

/** \brief Zeroes \p st and sets struct_size. Never fails. */
APE_API void ape_stats_init(ape_stats *st);

/**
 * \brief Opens a range named \p name on the calling thread, for profilers (docs/profiling.md):
 * an NVTX range in the "libape" domain (when libape was built with NVTX and a tool is
 * attached), and, with `APE_TRACE` set, a span of the session trace on the thread's track,
 * beside libape's own calls. For a caller's own phases (a model layer, a decode step) and for
 * libape_mpi's exchanges. Ranges nest, up to 64 deep per thread (deeper ones are not
 * recorded); close each with ape_range_pop() on the same thread. \p name is copied; NULL is
 * taken as "". Never fails; costs a few loads when neither NVTX nor the trace is on.
 */
APE_API void ape_range_push(const char *name);
/** \brief Closes the calling thread's innermost range (ape_range_push()); nothing when none is
 *  open. */
APE_API void ape_range_pop(void);

/**
 * \brief Computes APE attention O (and optionally LSE) on \p dev from host tensors.
 *
 * Everything is validated before any work: shapes (`q` `[B,H,Lq,D]`, `k` and `v` `[B,Hkv,Lk,D]`,
 * `o` `[B,H,Lq,D]`, H % Hkv == 0, D even in 2..APE_MAX_D), storage types (q, k, v the same; o
 * the same or APE_F32), strides, every parameter and every head's value. A failure names the
 * argument.
 *
 * \param dev a device of a live context
 * \param desc the parameters (see ape_attn_desc_init()); with desc->pos_q and desc->pos_k
 *        set, query row i of every batch element is at pos_q[i] and key row j at pos_k[j]
 *        (explicit positions: any values, order, gaps, repeats; docs/ape.md, "Explicit
 *        positions in the dense call"): one launch as without them where the device reads
 *        positions (the reference, OpenCL), else each batch element cut into runs of
 *        consecutive positions merged by LSE, its outputs staged and written on success;
 *        APE_EINVAL when only one is set or with q_start_set or k_start != 0, APE_EOVERFLOW
 *        (naming desc->pos_q and desc->pos_k) when a pair's distance overflows int64
 * \param q,k,v inputs; read only
 * \param o output; written only when the call succeeds, except on a device that computes on
 *        host memory (below)
 * \param lse NULL, or B*H*Lq floats (contiguous `[B,H,Lq]`), written only on success (the
 *        same exception): ln of the softmax denominator per row; -inf for rows with no
 *        visible key
 * \param stats NULL, or statistics of the call (initialise with ape_stats_init())
 * \return 0; APE_EINVAL (bad argument; outputs untouched); APE_EOVERFLOW (sizes or positions
 *         overflow 64 bits); APE_ENOMEM; APE_EBACKEND, APE_EDEVLOST, APE_EBUILD (device failures).
 * \note Inputs are not scanned: NaN or Inf in q, k or v gives NaN in the rows it reaches.
 * \note This is ape_attention_forward_ex() on one device with default options: a problem
 *       longer than 4096 queries or keys is streamed in chunks, and on a device failure the
 *       query chunks already finished may have been written (see there). A problem of at most
 *       4096 queries is one query chunk: its outputs are written only on success, except on a
 *       device that computes on host memory (the reference, OpenCL CPU devices: capability
 *       host_memory), whose kernel writes O and LSE where they lie, nothing copied: a device
 *       failure after the launch then leaves them unspecified, and the message ends
 *       "computed in place and are unspecified". ape_attention_forward_ex() with
 *       APE_EXEC_ATOMIC_OUTPUTS keeps them untouched.
 */
APE_API int ape_attention_forward(ape_device *dev, const ape_attn_desc *desc, const ape_tensor *q,
				  const ape_tensor *k, const ape_tensor *v, ape_tensor *o, float *lse,
				  ape_stats *stats);

/** Options of ape_attention_forward_ex(). Fields are only ever added at the end. There is one
 *  layout so far: struct_size must be sizeof(ape_exec_options), as ape_exec_options_init()
 *  sets it; any other value is refused with APE_EINVAL (naming opts->struct_size). */
typedef struct ape_exec_options {
	size_t struct_size; /**< set by ape_exec_options_init() */
	/** Most query rows per chunk (>= 0); 0: 4096. The planner may choose fewer to fit the
	 *  memory budget. */
	int64_t chunk_q;
	/** Most key rows per chunk (>= 0); 0: 4096 (a ragged call's ragged launches: every key,
	 *  each launch seeing only its rows' sequences' keys; the planner halves it to fit the
	 *  budget). */
	int64_t chunk_k;
	/**
	 * Device memory the call may hold at once on each device, in bytes: chunk buffers for
	 * queries, keys and values, partial outputs, and the scratch the backend declares per
	 * launch. 0: three quarters of the device's memory (no limit when the device does not
	 * say, as the reference does not). With several devices (or one device listed twice)
	 * each gets this budget.
	 */
	uint64_t max_device_bytes;
	/** Chunks in flight per device: 1 (copies and kernels strictly back to back), 2 or 3;
	 *  0: 3. The planner lowers it when the budget is tight. */
	int pipeline_depth;
	unsigned flags; /**< APE_EXEC_* */
	/**
	 * NULL, or a file to write a Chrome trace-event JSON to when the call succeeds: every
	 * chunk's copies and kernels with device timestamps, one process per device and one
	 * thread per queue (open it in https://ui.perfetto.dev or chrome://tracing). Written to a
	 * temporary file next to it and renamed, so it appears complete or not at all. Its
	 * directory must exist.
	 */
	const char *trace_path;
	/** NULL: split query chunks over the devices by the speed each reached in earlier calls
	 *  (equal shares until measured); else ndev relative speeds, each finite and > 0. Idle
	 *  devices take chunks from busy ones at the end either way. */
	const double *device_weights;
} ape_exec_options;

/** Keep the caller's outputs untouched unless the whole call succeeds, by staging all of O and
 *  LSE in host memory first (costs one more copy of O in memory). Without it, a streamed call
 *  writes each query chunk's rows as soon as they are final, and on a device that computes on
 *  host memory its launches write them in place (a failure leaves the rows of unfinished
 *  query chunks unspecified). */
#define APE_EXEC_ATOMIC_OUTPUTS (1u << 0)

/** Copy the inputs into device buffers even on a device whose kernels read host memory in place
 *  (the reference; OpenCL CPU devices), as a discrete GPU needs: the chunks, copies and
 *  statistics a discrete device would see, for measuring transfers and testing the copy path.
 *  Without it, such a device reads q, k and v where they lie (no staging, no copy; they count
 *  nothing against max_device_bytes), at every chunking. Results are the same either way. */
#define APE_EXEC_COPY_INPUTS (1u << 1)

/** The most devices one ape_attention_forward_ex() call takes (`ndev`), counting a device
 *  listed more than once each time: size device arrays passed to it by this. */
#define APE_MAX_DEVICES 64

/** \brief Sets the defaults: 4096-row chunks, 3/4 of device memory, depth 3, no flags, no
 *  trace, measured device speeds. Never fails. */
APE_API void ape_exec_options_init(ape_exec_options *opts);

/**
 * \brief ape_attention_forward() on host tensors of any length, streamed through one or more
 *        devices in chunks under a device-memory budget.
 *
 * The call is planned as query chunks x key chunks (opts->chunk_q x opts->chunk_k rows, fewer
 * when the budget demands). Each device takes query chunks and walks their key chunks from the
 * diagonal outward; chunks move host to device through NUMA-local pinned staging buffers while
 * the previous chunk computes (opts->pipeline_depth in flight), and the partial results of a
 * query chunk are merged by their LSE (docs/ape.md, identity 4). A key chunk that no query of a
 * query chunk can see (causal) is never copied, nor is one whose total weight the skip bound
 * proves below desc->skip_tol (only when every head's delta, beta, gamma >= 0). Results equal
 * ape_attention_forward() within the spec's tolerance for every chunk size and device set.
 *
 * \param devs ndev devices (1..APE_MAX_DEVICES) of live contexts; one device may appear more
 *        than once (it then runs several pipelines at once). With several devices, one worker
 *        thread per device, bound to the device's local CPUs by the context's NUMA policy,
 *        feeds it.
 * \param opts NULL for the defaults (see ape_exec_options_init())
 * \param desc,q,k,v,o,lse,stats as ape_attention_forward(), explicit positions included (on
 *        devices that do not all read them the call runs in pieces, which write no trace yet:
 *        opts->trace_path is then refused with APE_EINVAL)
 * \return 0; APE_EINVAL (bad argument, naming it; outputs untouched); APE_EOVERFLOW;
 *         APE_ENOMEM (host memory, or a budget too small for one chunk of one query row and one
 *         key row: the message says how many bytes that needs; outputs untouched); APE_EIO
 *         (the trace file could not be written; outputs complete); device failures.
 * \note On a device failure, query chunks already finished have been written to o and lse,
 *       the others are untouched, and the message says how many were written ("O and LSE
 *       hold 3 of 8 query chunks, the rest untouched"). On a device that computes on host
 *       memory (the reference, OpenCL CPU devices), launches that see every key of their
 *       query chunk write O and LSE in place, nothing copied back, so the rows of unfinished
 *       chunks are unspecified instead ("...the others were computed in place and are
 *       unspecified"; with one query chunk: "O and LSE were computed in place and are
 *       unspecified"). Use APE_EXEC_ATOMIC_OUTPUTS to write nothing unless the call succeeds
 *       (on such a device, its staging is what the launches write in place).
 * \note Thread-safe like ape_attention_forward().
 */
APE_API int ape_attention_forward_ex(ape_device *const *devs, int ndev,
				     const ape_exec_options *opts, const ape_attn_desc *desc,
				     const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
				     ape_tensor *o, float *lse, ape_stats *stats);

/**
 * \brief ape_attention_forward_ex() that also returns the attention diagnostics of every row,
 *        computed in the same pass as O (docs/diagnostics.md; APE-SPEC.md, "Attention entropy").
 *
 * - entropy: `ENT_i = -sum_j P_ij ln P_ij = LSE_i - sum_j P_ij s_ij` (natural log), within
 *   the spec's LSE tolerance of the storage type (`1e-4 * max(1, |LSE_i|)` for float32) of the
 *   float64 value;
 * - mean_distance: `MD_i = sum_j P_ij |n|`, `n = pos_q(i) - pos_k(j)`, within the same
 *   relative tolerance of `max(1, max |n|)` over the row's visible keys.
 * Both are 0 for a row with one visible key (ENT) or none (both), NaN for a row a NaN reaches.
 * Long calls are streamed and several devices split them as for ape_attention_forward_ex():
 * partial results merge by their LSE (ENT = sum_c w_c (ENT_c - ln w_c), MD = sum_c w_c MD_c,
 * w_c = exp(LSE_c - LSE)), so results do not depend on the chunk sizes or devices beyond the
 * tolerance. Skipping far keys stays allowed, but the call runs under
 * `min(desc->skip_tol, 2^-24)`, where the bound of docs/diagnostics.md keeps both within the
 * tolerance (so O may be slightly more exact than a plain call with a larger skip_tol).
 *
 * \param entropy NULL, or B*H*Lq floats (contiguous `[B,H,Lq]`), written as lse is
 * \param mean_distance NULL, or B*H*Lq floats (contiguous `[B,H,Lq]`), written as lse is
 * \param devs,ndev,opts,desc,q,k,v,o,lse,stats as ape_attention_forward_ex() (both NULL: the
 *        same call)
 * \return as ape_attention_forward_ex(); APE_EINVAL also when entropy or mean_distance
 *         overlaps q, k, v, o, lse or each other (naming both); APE_ENOTSUP when a device's
 *         backend does not compute the diagnostics (the message names the device; the
 *         reference, OpenCL and CUDA backends all do).
 * \note On failure the same rules as for o and lse apply (APE_EXEC_ATOMIC_OUTPUTS: untouched).
 */
APE_API int ape_attention_forward_diag(ape_device *const *devs, int ndev,
				       const ape_exec_options *opts, const ape_attn_desc *desc,
				       const ape_tensor *q, const ape_tensor *k,
				       const ape_tensor *v, ape_tensor *o, float *lse,
				       float *entropy, float *mean_distance, ape_stats *stats);

/**
 * \brief Number of (query, key) pairs the mask lets through for these shapes and positions.
 *
 * Visible pairs are the throughput unit of benchmarks (dense-equivalent FLOPs are 4*D per pair).
 * With explicit positions (desc->pos_q: Lq entries, desc->pos_k: Lk entries) they are counted at
 * those positions, checked as ape_attention_forward() checks them.
 * \return 0 and \p *out; APE_EINVAL (NULL argument, negative size, bad desc); APE_EOVERFLOW (the
 *         count, or a position, does not fit in 64 bits).
 */
APE_API int ape_visible_pairs(const ape_attn_desc *desc, int64_t B, int64_t H, int64_t Lq,
			      int64_t Lk, uint64_t *out);
/**@}*/

/** \name Ragged batches
 *
 * Many sequences of different lengths in one call (packed training batches, a serving step's
 * prefill chunks and decodes), each with its own positions. APE's bias and temperature are not
 * linear in the distance n, so every pair must see its true positions: a call here gives each
 * pair n = pos_q(i) - pos_k(j) of its own sequence, never a shifted one.
 *
 * Q, K, V and O are packed along the token axis: every sequence's rows one after another, as
 * `[total, H, D]` arrays (ape_tensor_init_packed(); a slice of a packed QKV buffer is such a
 * tensor with other strides) or any other strided `[1, H, total, D]` ape_tensor.
 */
/**@{*/

/** A ragged batch of num_seqs sequences over packed tensors. Start from ape_varlen_init(). */
typedef struct ape_varlen {
	size_t struct_size; /**< set by ape_varlen_init(); must be sizeof(ape_varlen) */
	int64_t num_seqs; /**< S >= 0 */
	/** S + 1 row offsets into the packed queries: sequence s has query rows
	 *  [cu_seqlens_q[s], cu_seqlens_q[s + 1]); non-decreasing, from 0 to total_q (empty
	 *  sequences allowed). Read during the call only. */
	const int64_t *cu_seqlens_q;
	/** S + 1 row offsets into the packed keys and values, likewise, from 0 to total_k. */
	const int64_t *cu_seqlens_k;
	/** NULL, or total_q positions of the query rows: any int64 values, any order, gaps and
	 *  repeats allowed. NULL: sequence s's keys at 0, 1, ... and its queries end-aligned to
	 *  them (positions Lk_s - Lq_s, ...), as the dense call places them. */
	const int64_t *pos_q;
	/** NULL, or total_k positions of the key rows (NULL: 0, 1, ... in every sequence). */
	const int64_t *pos_k;
} ape_varlen;

/** \brief Sets struct_size and an empty batch (no sequences, default positions). Never
 *  fails. */
APE_API void ape_varlen_init(ape_varlen *vl);

/** \brief Fills \p t as a packed `[total, H, D]` array of \p dtype at \p data (row-major:
 *  token, head, component), described as the `[1, H, total, D]` tensor the ragged calls take.
 *  Never fails. */
APE_API void ape_tensor_init_packed(ape_tensor *t, void *data, ape_dtype dtype, int64_t total,
				    int64_t H, int64_t D);

/**
 * \brief APE attention over a ragged batch: query i of sequence s sees the keys of sequence s
 *        only (with desc->causal, those with pos_k <= pos_q), at n = pos_q(i) - pos_k(j).
 *
 * Everything is validated before any work: the batch (struct_size, num_seqs, each offset, named
 * with its index and value: "vl->cu_seqlens_q[3] = 5 < vl->cu_seqlens_q[2] = 7"), the tensors
 * (`q` and `o` `[1, H, total_q, D]`, `k` and `v` `[1, Hkv, total_k, D]`, the storage types,
 * strides and overlaps of ape_attention_forward()), the parameters, and every sequence's
 * distances (APE_EOVERFLOW, naming the sequence, when a pair's n does not fit in int64). The
 * positions come from \p vl alone: desc->q_start_set must be false and desc->k_start 0.
 *
 * Positions that run in steps of 1 within each sequence (the default, and Hugging Face style
 * position_ids restarting per document) make the whole batch one run of the executor: each
 * launch serves every sequence of its rows at its own positions (on devices that take ragged
 * launches: the reference, OpenCL and CUDA; a device that does not runs each sequence as its
 * own dense call), long sequences chunked under the device budget like a dense call. Other
 * positions (gaps, repeats, any order) are one such run too on devices that read explicit
 * positions (the reference and OpenCL); elsewhere (CUDA) they split a sequence into its runs of
 * consecutive positions, each run against each key run a dense call, whose partial results
 * merge by their LSE (docs/ape.md, identity 4). Results
 * equal a dense call per sequence within the spec's tolerance (bit for bit for a one-sequence
 * batch of default positions).
 *
 * \param devs,ndev,opts as ape_attention_forward_ex(); opts->trace_path must be NULL;
 *        opts->chunk_k 0 means one key chunk of every key for ragged launches (no partial
 *        results to merge where a query chunk's sequences fit the budget);
 *        APE_EXEC_ATOMIC_OUTPUTS keeps o untouched on every failure (below)
 * \param desc the parameters; per-head values as for the dense call
 * \param vl the batch
 * \param q,k,v packed inputs; read only
 * \param o packed output `[1, H, total_q, D]`, q's storage type or APE_F32 (0 for rows that
 *        see no key); written only on success, except where the batch runs as ragged
 *        launches on a device that computes on host memory (the reference, OpenCL CPU
 *        devices) without APE_EXEC_ATOMIC_OUTPUTS: those write o in place, and a device
 *        failure then leaves it unspecified ("computed in place and are unspecified")
 * \param lse NULL, or total_q * H floats, `[total_q, H]` (token-major, as the packed tensors),
 *        written only on success; -inf for rows that see no key
 * \param stats NULL, or the call's statistics (summed over its pieces when it has several;
 *        `chunks` counts launches: 1 for a batch that fits one launch)
 * \return 0; APE_EINVAL (naming the argument); APE_EOVERFLOW; APE_ENOMEM; device failures
 *         (the message names the sequence). On any failure lse is untouched, and so is o
 *         unless the message says it was computed in place (see o).
 * \note LSE is staged in host memory, and so is O where the batch runs as dense calls per
 *       run of positions, or with APE_EXEC_ATOMIC_OUTPUTS: one more copy of it.
 * \note Batches whose positions have gaps or repeats among a sequence's keys on devices that
 *       do not read explicit positions (CUDA), and batches on devices without ragged launches,
 *       cost a dense call per run of consecutive positions (docs/ape.md, "Ragged batches").
 */
APE_API int ape_attention_forward_varlen_ex(ape_device *const *devs, int ndev,
					    const ape_exec_options *opts,
					    const ape_attn_desc *desc, const ape_varlen *vl,
					    const ape_tensor *q, const ape_tensor *k,
					    const ape_tensor *v, ape_tensor *o, float *lse,
					    ape_stats *stats);

/**
 * \brief The gradients of ape_attention_forward_varlen_ex(): dQ, dK, dV and every head's
 *        dparams of a ragged batch, given the forward's O and LSE and dL/dO (and dL/dLSE).
 *
 * Validated before any work like the forward (the batch, the tensors, the positions) and like
 * ape_attention_backward() (dout, dq shaped like q; dk, dv like k; each of q's storage type or
 * APE_F32; no output overlapping an input or another output). Where every device takes ragged
 * backward launches (ape_device_capabilities(): "bwd_segments"; the reference, OpenCL and
 * CUDA) and
 * each run of consecutive query positions sees one run of keys of its own (default positions,
 * position_ids restarting per document), the batch is one run of the backward executor, each
 * launch serving every sequence of its rows (the statistics' chunks: one per query and key
 * chunk, not per sequence). Otherwise each sequence's pieces are the dense backward of their
 * rows with the whole row's O and LSE. Either way the gradients are those of the ragged call
 * exactly (within the backward's tolerances), summed in a fixed order: deterministic. Keys no
 * query sees get zero gradients.
 *
 * \param devs,ndev,opts as ape_attention_backward_ex()
 * \param desc,vl,q,k,v the forward call's; read only
 * \param o the forward's O, `[1, H, total_q, D]`; read only
 * \param lse the forward's LSE, total_q * H floats `[total_q, H]`; required; read only
 * \param dout dL/dO, shaped like q; read only
 * \param dlse NULL, or total_q * H floats `[total_q, H]`; read only
 * \param[out] dq,dk,dv,dparams as ape_attention_backward(): each NULL or overwritten on success
 *        (at least one wanted)
 * \param stats NULL, or the call's statistics (the one run's, or the pieces' summed)
 * \return as ape_attention_backward(); the message of a failing piece names the sequence, that
 *         of the one run the number of sequences.
 * \note On failure nothing is written. The gradients are staged in float32 host memory.
 */
APE_API int ape_attention_backward_varlen(ape_device *const *devs, int ndev,
					  const ape_exec_options *opts, const ape_attn_desc *desc,
					  const ape_varlen *vl, const ape_tensor *q,
					  const ape_tensor *k, const ape_tensor *v,
					  const ape_tensor *o, const float *lse,
					  const ape_tensor *dout, const float *dlse, ape_tensor *dq,
					  ape_tensor *dk, ape_tensor *dv, float *dparams,
					  ape_stats *stats);

/** \brief ape_attention_forward_varlen_ex() on one device with default options. */
APE_API int ape_attention_forward_varlen(ape_device *dev, const ape_attn_desc *desc,
					 const ape_varlen *vl, const ape_tensor *q,
					 const ape_tensor *k, const ape_tensor *v, ape_tensor *o,
					 float *lse, ape_stats *stats);
/**@}*/

/** \name KV cache
 *
 * Keys and values of one sequence (and batch) kept on a device in fixed-size blocks, for
 * decoding and chunked prefill: ape_kv_cache_append() adds tokens, ape_kv_cache_attend() runs
 * new queries against everything cached. All device memory and host staging is allocated by
 * ape_kv_cache_create(); appending within the capacity and attending allocate none.
 * A cache is used by one thread at a time; different caches are independent.
 */
/**@{*/
typedef struct ape_kv_cache ape_kv_cache;

/** Options of ape_kv_cache_create(). Fields are only ever added at the end. */
typedef struct ape_kv_cache_options {
	size_t struct_size; /**< set by ape_kv_cache_options_init() */
	int64_t B; /**< batch, >= 1 */
	int64_t Hkv; /**< key/value heads, >= 1 */
	int64_t H; /**< query heads of attends, a multiple of Hkv; 0: Hkv */
	int64_t D; /**< head dimension: even, 2..APE_MAX_D */
	ape_dtype dtype; /**< storage of keys, values and queries */
	int64_t block_tokens; /**< tokens per block (1..2^40); 0: 256 */
	/** Tokens the cache holds at once (>= 1), rounded up to whole blocks. Appending more
	 *  fails with APE_ENOMEM unless released blocks made room. */
	int64_t capacity_tokens;
	int64_t k_start; /**< position of the first token appended, in [-2^62, 2^62); default 0 */
	int64_t max_queries; /**< most query rows of one attend (1..2^40); 0: 16 */
	int64_t append_chunk; /**< tokens staged per host-to-device step of an append; 0: 1024.
				   Longer appends are split, never refused. */
	int64_t attend_chunk; /**< keys per kernel launch of an attend; 0: 4096 */
	/** Device memory the cache may hold (blocks, chunk buffers, partial outputs), bytes;
	 *  0: no limit but the device's. */
	uint64_t max_device_bytes;
	/**
	 * Let the cache drop its oldest blocks once the skip bound proves that no future query can
	 * give them weight above skip_tol / 2 of the weight it gives the newest keys. Possible only
	 * when every head's delta > 0 and beta, gamma >= 0, and only with max_query_norm. After a
	 * release, an attend whose queries, parameters or norms would void that proof fails with
	 * APE_EINVAL instead of computing a wrong answer.
	 */
	bool allow_release;
	/** With allow_release: a bound on |q| (the Euclidean norm of each query row, as stored)
	 *  of every future query; finite, > 0. Attends check it. */
	double max_query_norm;
} ape_kv_cache_options;

/** \brief Defaults: block 256 tokens, max_queries 16, append_chunk 1024, attend_chunk 4096,
 *  no budget, no release; B, Hkv, D, dtype and capacity_tokens must be set. Never fails. */
APE_API void ape_kv_cache_options_init(ape_kv_cache_options *opts);

/**
 * \brief Creates an empty cache on \p dev, allocating every device block, chunk buffer and
 *        staging buffer it will ever use.
 * \return 0; APE_EINVAL (NULL argument, bad option, naming it); APE_EOVERFLOW (sizes from B,
 *         Hkv, block_tokens, append_chunk, D past 64 bits, naming them); APE_ENOMEM (device or
 *         host memory, or max_device_bytes too small: the message says what is needed); device
 *         errors. *out is NULL on failure.
 */
APE_API int ape_kv_cache_create(ape_device *dev, const ape_kv_cache_options *opts,
				ape_kv_cache **out);

/** \brief Destroys the cache after its device work has finished. Accepts NULL. */
APE_API void ape_kv_cache_destroy(ape_kv_cache *cache);

/**
 * \brief Appends n tokens: keys \p k and values \p v, host tensors `[B, Hkv, n, D]` of the
 *        cache's dtype (strides allowed, n >= 0). They sit at the positions after the cached
 *        ones. The copies run asynchronously; the tensors may be reused when this returns.
 * \return 0; APE_EINVAL (bad tensor, naming it); APE_ENOMEM (the cache is full: nothing was
 *         appended; the message says how many tokens fit); device errors (the cache is then
 *         unusable: destroy it).
 */
APE_API int ape_kv_cache_append(ape_kv_cache *cache, const ape_tensor *k, const ape_tensor *v);

struct ape_queue;
struct ape_dtensor;
/**
 * \brief Appends n tokens from device tensors \p k and \p v (`[B, Hkv, n, D]` of the cache's
 *        dtype, D contiguous, in buffers of the cache's device), copied within the device, after
 *        the work already enqueued on \p queue (which wrote them, say).
 *
 * The cache keeps each block's largest key norm on the host for skipping and release, so the
 * appended keys (B * Hkv * n * D elements, not the values) are also read back; the call returns
 * when the tokens are in the cache, and k and v may then be overwritten.
 * \return as ape_kv_cache_append(); APE_EINVAL also for a queue or buffer of another device or
 *         a tensor outside its buffer (naming it); APE_ENOTSUP on a backend without
 *         device-to-device copies.
 */
APE_API int ape_kv_cache_append_device(ape_kv_cache *cache, struct ape_queue *queue,
				       const struct ape_dtensor *k, const struct ape_dtensor *v);

/**
 * \brief Attention of new queries over every cached token: as ape_attention_forward() with
 *        the cache's keys and values.
 *
 * \p q is `[B, H, Lq, D]` with 1 <= Lq <= max_queries (Lq = 0 is an empty call), of the cache's
 * dtype; \p o as in ape_attention_forward(). Key positions are the cache's; desc->k_start is
 * ignored. Queries default to the end of the cache (q_start = position after the last cached
 * token - Lq, so with causal masking each query sees itself and everything before it, as in
 * decoding when its own key was appended first); desc->q_start_set places them explicitly.
 * With decay (delta > 0, beta, gamma, lambda >= 0 in every head) and skip_tol > 0, the oldest
 * keys that the block maxima prove negligible for these queries (within a quarter of the
 * attend's share of skip_tol) are left out before the attend runs, never read: a decode step
 * costs what the keys within reach cost, whatever the context length (docs/streaming.md, "The
 * KV cache"); ape_stats.pairs_computed counts only the keys computed.
 * When the cache allows release, blocks the bound proves unreachable are released afterwards.
 * \return as ape_attention_forward(); APE_EINVAL also when released blocks would be visible
 *         to these queries (earlier positions, weaker decay, smaller skip_tol, larger norm).
 */
APE_API int ape_kv_cache_attend(ape_kv_cache *cache, const ape_attn_desc *desc,
				const ape_tensor *q, ape_tensor *o, float *lse, ape_stats *stats);

/**
 * \brief ape_kv_cache_attend() that also returns each query row's entropy and mean attention
 *        distance over the cached keys, as ape_attention_forward_diag() defines them.
 *
 * \param entropy,mean_distance each NULL, or B*H*Lq floats (contiguous `[B,H,Lq]`)
 * \return as ape_kv_cache_attend(); APE_EINVAL also for an output overlapping another (naming
 *         both); APE_ENOTSUP on a backend without the diagnostics. The call runs under
 *         `min(desc->skip_tol, 2^-24)`: with released blocks, a larger skip_tol the release was
 *         proved for fails with APE_EINVAL as a smaller one would in ape_kv_cache_attend().
 */
APE_API int ape_kv_cache_attend_diag(ape_kv_cache *cache, const ape_attn_desc *desc,
				     const ape_tensor *q, ape_tensor *o, float *lse,
				     float *entropy, float *mean_distance, ape_stats *stats);

/**
 * \brief Releases the oldest blocks that the skip bound proves no future query can reach
 *        (see ape_kv_cache_options.allow_release), as if future queries used \p desc.
 *
 * Future queries are assumed to sit at or after the earliest position a default attend of
 * max_queries rows could have now; earlier ones are refused afterwards.
 * \param[out] released NULL, or the number of tokens released by this call
 * \return 0 (also when nothing could be proved); APE_EINVAL (NULL cache or desc, bad desc, or
 *         the cache was created without allow_release).
 */
APE_API int ape_kv_cache_release_unreachable(ape_kv_cache *cache, const ape_attn_desc *desc,
					     int64_t *released);

/** State of a cache. */
typedef struct ape_kv_cache_info {
	int64_t tokens; /**< tokens appended since creation */
	int64_t live_tokens; /**< tokens still held (tokens minus those released) */
	int64_t first_live_position; /**< position of the oldest token held */
	int64_t next_position; /**< position the next appended token gets */
	int64_t capacity_tokens; /**< tokens it can hold at once (whole blocks) */
	int64_t block_tokens;
	int64_t blocks_live; /**< blocks holding live tokens */
	int64_t blocks_released; /**< blocks released since creation */
	/** Earliest position an attend may place a query at (after releases); INT64_MIN: any. */
	int64_t min_query_position;
	uint64_t device_bytes; /**< device memory the cache holds, all of it allocated at creation */
} ape_kv_cache_info;

/** \brief Describes \p cache. \return 0 or APE_EINVAL (NULL argument). */
APE_API int ape_kv_cache_get_info(const ape_kv_cache *cache, ape_kv_cache_info *info);
/**@}*/

/** \name KV pool: many sequences in fixed-size pages, for serving
 *
 * Keys and values of many sequences of different lengths on one device, in pages of
 * `page_tokens` tokens taken from one pool allocated at creation (continuous batching: requests
 * join and leave every step). A sequence is an id (ape_kv_pool_add_sequence()); it holds a list
 * of pages, its tokens at consecutive positions from its `k_start`. ape_kv_pool_fork() gives a
 * new sequence the pages of another, shared and reference-counted: a shared page is copied once,
 * when either sequence first appends into it (copy on write: parallel sampling, beam search,
 * prefix reuse). ape_kv_pool_attend() runs one ragged batch of query rows, each run of rows
 * against the keys of its own sequence, in one run of the executor (docs/serving.md).
 *
 * Memory: every page, chunk buffer and staging buffer on the device is allocated at creation;
 * appends, forks and attends within the capacity allocate no device memory (the host tables of
 * sequences grow with their number). A pool is used by one thread at a time; different pools
 * are independent.
 */
/**@{*/
typedef struct ape_kv_pool ape_kv_pool;

/** Options of ape_kv_pool_create(). Fields are only ever added at the end. */
typedef struct ape_kv_pool_options {
	size_t struct_size; /**< set by ape_kv_pool_options_init() */
	int64_t Hkv; /**< key/value heads, >= 1 */
	int64_t H; /**< query heads of attends, a multiple of Hkv; 0: Hkv */
	int64_t D; /**< head dimension: even, 2..APE_MAX_D */
	ape_dtype dtype; /**< storage of keys, values and queries */
	int64_t page_tokens; /**< tokens per page, 1..65536; 0: 16 */
	/** Tokens the pool holds at once over all sequences (>= 1, at most 2^40), rounded up to
	 *  whole pages. */
	int64_t capacity_tokens;
	/** Most query rows of one attend, and most tokens staged per host-to-device step of an
	 *  append (longer appends are split, never refused); 1..2^20; 0: 256. */
	int64_t max_batch_tokens;
	int64_t attend_chunk; /**< keys per kernel launch of an attend; 0: 4096 */
	/** Device memory the pool may hold (pages, chunk buffers, partial outputs), bytes; 0: no
	 *  limit but the device's. */
	uint64_t max_device_bytes;
	/** A bound on |q| (the Euclidean norm of each query row, as stored) of every attend after
	 *  a release: > 0 (finite) allows ape_kv_pool_release_unreachable(); 0: no release. */
	double max_query_norm;
} ape_kv_pool_options;

/** \brief Defaults: pages of 16 tokens, max_batch_tokens 256, attend_chunk 4096, no budget;
 *  Hkv, D, dtype and capacity_tokens must be set. Never fails. */
APE_API void ape_kv_pool_options_init(ape_kv_pool_options *opts);

/**
 * \brief Creates an empty pool on \p dev, allocating every page, chunk buffer and staging buffer
 *        it will ever use on the device.
 * \return 0; APE_EINVAL (NULL argument, bad option, naming it); APE_EOVERFLOW (sizes past 64
 *         bits, naming the options); APE_ENOMEM (device or host memory, or max_device_bytes
 *         too small: the message says what is needed); device errors. *out is NULL on failure.
 */
APE_API int ape_kv_pool_create(ape_device *dev, const ape_kv_pool_options *opts,
			       ape_kv_pool **out);

/** \brief Destroys the pool after its device work has finished. Accepts NULL. */
APE_API void ape_kv_pool_destroy(ape_kv_pool *pool);

/**
 * \brief Adds an empty sequence whose first token will sit at position \p k_start.
 * \param k_start in [-2^62, 2^62)
 * \param[out] seq_id the new sequence's id (>= 0; ids of removed sequences are not reused)
 * \return 0; APE_EINVAL (NULL argument); APE_EOVERFLOW (k_start out of range); APE_ENOMEM
 *         (host memory). Takes no page: the first append does.
 */
APE_API int ape_kv_pool_add_sequence(ape_kv_pool *pool, int64_t k_start, int64_t *seq_id);

/**
 * \brief Removes a sequence: its id becomes unknown, and each of its pages returns to the pool
 *        once no other sequence shares it.
 * \return 0; APE_EINVAL (NULL pool, or an unknown \p seq_id, naming it).
 */
APE_API int ape_kv_pool_remove_sequence(ape_kv_pool *pool, int64_t seq_id);

/**
 * \brief A new sequence holding the same tokens as \p seq_id, at the same positions, sharing
 *        its pages: no copy now, and a shared page is copied once, when either sequence first
 *        appends into it.
 * \param[out] new_id the new sequence's id
 * \return 0; APE_EINVAL (NULL argument, unknown seq_id); APE_ENOMEM (host memory: nothing
 *         forked).
 */
APE_API int ape_kv_pool_fork(ape_kv_pool *pool, int64_t seq_id, int64_t *new_id);

/**
 * \brief Appends n tokens to one sequence: keys \p k and values \p v, host tensors
 *        `[1, Hkv, n, D]` of the pool's dtype (strides free: a packed `[n, Hkv, D]` array from
 *        ape_tensor_init_packed(), or a slice of a packed QKV buffer), at the positions after
 *        the sequence's tokens. The copies run asynchronously; the tensors may be reused when
 *        this returns.
 * \return 0; APE_EINVAL (unknown seq_id, bad tensor, naming it); APE_EOVERFLOW (a tensor whose
 *         size passes 64 bits); APE_ENOMEM (the pool has too few free pages, or host memory ran
 *         out: nothing was appended; the message says how many pages were needed and free);
 *         device errors (nothing was appended either, but the pool is then unusable: destroy
 *         it).
 */
APE_API int ape_kv_pool_append(ape_kv_pool *pool, int64_t seq_id, const ape_tensor *k,
			       const ape_tensor *v);

/**
 * \brief Appends to many sequences in one call (one decode step of every request): sequence
 *        \p seq_ids[i] gets the tokens [cu_seqlens[i], cu_seqlens[i + 1]) of the packed \p k
 *        and \p v (`[1, Hkv, total, D]`, as ape_kv_pool_append() takes them).
 * \param nseq the number of sequences (>= 0); ids distinct and known
 * \param cu_seqlens nseq + 1 offsets, non-decreasing, from 0 to total
 * \return as ape_kv_pool_append(), naming the index and value of a bad id or offset. Either
 *         every sequence gets its tokens or (on any error but a device failure) none does.
 */
APE_API int ape_kv_pool_append_batch(ape_kv_pool *pool, int64_t nseq, const int64_t *seq_ids,
				     const int64_t *cu_seqlens, const ape_tensor *k,
				     const ape_tensor *v);

/**
 * \brief Attention of a ragged batch of query rows over the pool: rows
 *        [cu_seqlens_q[i], cu_seqlens_q[i + 1]) belong to sequence \p seq_ids[i] and see that
 *        sequence's keys only (with desc->causal, those at positions <= their own).
 *
 * \p q is `[1, H, total_q, D]` of the pool's dtype (a packed `[total_q, H, D]` array from
 * ape_tensor_init_packed(), strides free), 0 <= total_q <= max_batch_tokens; \p o likewise, of
 * the pool's dtype or APE_F32. Positions: \p pos_q NULL places each sequence's rows at the end
 * of its keys (the last row at the position of its newest token, as a decode step whose own
 * token was appended first; a chunked prefill's rows before it), else \p pos_q gives every
 * row's position (any int64 values: runs of consecutive positions, draft rows sharing one, gaps).
 * desc->q_start_set must be false and desc->k_start 0 (positions come from the pool). With
 * decay (delta > 0, beta, gamma, lambda >= 0 on every head) and skip_tol > 0, each sequence's
 * oldest keys that its pages' key-norm maxima prove negligible for its rows are left out before
 * the attend runs, never read: a decode step costs what the keys within reach cost.
 *
 * \param nseq sequences in the batch (>= 0); ids distinct and known
 * \param cu_seqlens_q nseq + 1 offsets, non-decreasing, from 0 to total_q
 * \param pos_q NULL, or total_q positions
 * \param[out] o `[1, H, total_q, D]`: 0 for rows that see no key
 * \param[out] lse NULL, or total_q * H floats `[total_q, H]` (token-major); -inf for rows that
 *        see no key
 * \param stats NULL, or the call's statistics
 * \return 0; APE_EINVAL (naming the argument, index and value); APE_EOVERFLOW (a distance
 *         past int64, naming the sequence); APE_ENOMEM; device errors. On an error found by
 *         the checks nothing is written; after a device failure o and lse hold unspecified
 *         values.
 */
APE_API int ape_kv_pool_attend(ape_kv_pool *pool, const ape_attn_desc *desc, int64_t nseq,
			       const int64_t *seq_ids, const int64_t *cu_seqlens_q,
			       const int64_t *pos_q, const ape_tensor *q, ape_tensor *o,
			       float *lse, ape_stats *stats);

/**
 * \brief ape_kv_pool_attend() that also returns each query row's attention entropy and mean
 *        attention distance over its sequence's keys, as ape_attention_forward_diag() defines
 *        them (docs/diagnostics.md), computed in the same fused pass.
 *
 * \param entropy,mean_distance each NULL (not wanted), or total_q * H floats `[total_q, H]`
 *        (token-major, as lse); a row that sees no key gets 0 in both, a NaN row NaN
 * \return as ape_kv_pool_attend(); APE_EINVAL also for an output overlapping another (naming
 *         both); APE_ENOTSUP on a backend without the diagnostics. The call runs under
 *         `min(desc->skip_tol, 2^-24)`, where the diagnostics stay within the spec's tolerance
 *         (windows are cut under that tolerance too). Keys are gathered, not read in place.
 */
APE_API int ape_kv_pool_attend_diag(ape_kv_pool *pool, const ape_attn_desc *desc, int64_t nseq,
				    const int64_t *seq_ids, const int64_t *cu_seqlens_q,
				    const int64_t *pos_q, const ape_tensor *q, ape_tensor *o,
				    float *lse, float *entropy, float *mean_distance,
				    ape_stats *stats);

/**
 * \brief Releases the oldest whole pages of sequence \p seq_id that the skip bound proves no
 *        later query can reach (as ape_kv_cache_release_unreachable() does for a cache's
 *        blocks), as if later attends used \p desc: each page returns to the pool once no other
 *        sequence holds it.
 *
 * Later rows of the sequence are assumed at or after the earliest position a default attend of
 * max_batch_tokens rows could have now, with |q| <= opts.max_query_norm, every head's delta,
 * lambda at least \p desc's (beta, gamma >= 0), |scale| at most and skip_tol at least its:
 * afterwards an attend of the sequence that breaks one of these is refused with APE_EINVAL
 * (naming the batch entry and the sequence) instead of answering wrongly. A fork inherits them.
 * The sequence keeps its positions: ape_kv_pool_sequence_info() still counts every token
 * appended.
 * \param[out] released NULL, or the number of tokens released by this call
 * \return 0 (also when nothing could be proved: no decay, skip_tol 0); APE_EINVAL (NULL pool or
 *         desc, bad desc, unknown seq_id, or a pool created without max_query_norm).
 */
APE_API int ape_kv_pool_release_unreachable(ape_kv_pool *pool, int64_t seq_id,
					    const ape_attn_desc *desc, int64_t *released);

/** State of a pool. */
typedef struct ape_kv_pool_info {
	int64_t page_tokens;
	int64_t pages_total; /**< pages of the pool */
	int64_t pages_used; /**< pages held by at least one sequence */
	int64_t pages_free;
	int64_t pages_shared; /**< pages held by more than one sequence */
	int64_t sequences; /**< live sequences */
	int64_t tokens; /**< tokens held over all sequences (a shared token counted once per
			  *  holder; released ones not counted) */
	int64_t pages_copied; /**< shared pages copied on write since creation */
	uint64_t device_bytes; /**< device memory the pool holds, all of it allocated at creation */
} ape_kv_pool_info;

/** \brief Describes \p pool. \return 0 or APE_EINVAL (NULL argument). */
APE_API int ape_kv_pool_get_info(const ape_kv_pool *pool, ape_kv_pool_info *info);

/**
 * \brief Tokens and first position of one sequence.
 * \param[out] tokens,k_start each NULL or set: its tokens (every token appended, released ones
 *        included), the position of its first
 * \return 0; APE_EINVAL (NULL pool, unknown seq_id).
 */
APE_API int ape_kv_pool_sequence_info(const ape_kv_pool *pool, int64_t seq_id, int64_t *tokens,
				      int64_t *k_start);
/**@}*/

/** \name Device memory, queues and device-resident tensors
 *
 * For callers that already hold their tensors on a device and order their own work on a queue
 * (frameworks, inference engines): libape computes on memory where it is, on the caller's
 * queue, without copies to or from the host and without waiting. See docs/embedding.md.
 *
 * Lifetimes: a buffer or queue belongs to its device's context and must be freed or destroyed
 * before the context. libape never frees or destroys what it wraps; it holds a reference
 * (OpenCL retain) while the wrapper lives. Threads: a queue is used by one thread at a time;
 * buffers may be shared by queues of one device, ordered by the caller.
 */
/**@{*/
typedef struct ape_buffer ape_buffer;
typedef struct ape_queue ape_queue;

/**
 * \brief Allocates \p bytes (> 0) of device memory on \p dev, for *out. Contents undefined.
 * \return 0; APE_EINVAL (NULL argument, bytes 0); APE_ENOMEM (the device has not that much,
 *         or more than its largest single allocation). Thread-safe.
 */
APE_API int ape_buffer_alloc(ape_device *dev, size_t bytes, ape_buffer **out);
/**
 * \brief Wraps \p bytes of host memory at \p ptr as a buffer of \p dev, without copying: for the
 * reference device and OpenCL CPU devices, which compute on host memory in place.
 * \return 0; APE_EINVAL (NULL argument, bytes 0); APE_ENOTSUP (a device that cannot read host
 *         memory in place: a GPU). The memory stays the caller's; keep it alive until the
 *         wrapper is freed and every queue that used it was synchronised.
 */
APE_API int ape_buffer_wrap_host(ape_device *dev, void *ptr, size_t bytes, ape_buffer **out);
/**
 * \brief Wraps the caller's OpenCL buffer (`cl_mem`) as a buffer of \p dev, which must be built on
 * the cl_mem's context (ape_context_options.opencl_context). Its size is the cl_mem's.
 * \return 0; APE_EINVAL (NULL argument, a cl_mem of another context, naming both);
 *         APE_ENOTSUP (\p dev is not an OpenCL device).
 */
APE_API int ape_buffer_wrap_opencl(ape_device *dev, void *cl_mem, ape_buffer **out);
/**
 * \brief Wraps \p bytes of CUDA device memory at \p dptr (a `CUdeviceptr`, from cuMemAlloc,
 * cudaMalloc or a framework's allocator in the device's primary context) as a buffer of \p dev.
 * \return 0; APE_EINVAL (NULL out, dptr 0, bytes 0, or a range outside one allocation of the
 *         device); APE_ENOTSUP (\p dev is not a CUDA device).
 */
APE_API int ape_buffer_wrap_cuda(ape_device *dev, uint64_t dptr, size_t bytes, ape_buffer **out);
/** \brief Frees a buffer libape allocated (idle: every queue that used it synchronised), or
 *  drops libape's hold on a wrapped one (which may still be in use). Accepts NULL. */
APE_API void ape_buffer_free(ape_buffer *buf);
/** \brief The buffer's size in bytes (0 for NULL). Thread-safe. */
APE_API size_t ape_buffer_size(const ape_buffer *buf);
/** \brief The buffer's device (NULL for NULL). Thread-safe. */
APE_API ape_device *ape_buffer_device(const ape_buffer *buf);

/**
 * \brief Enqueues a copy of \p bytes from host memory \p src into \p dst at byte \p offset.
 * Asynchronous: \p src must stay valid until the queue is synchronised.
 * \return 0; APE_EINVAL (NULL argument, a buffer of another device, a range outside the
 *         buffer, naming offset, bytes and size); device failures.
 */
APE_API int ape_buffer_write(ape_queue *queue, ape_buffer *dst, size_t offset, const void *src,
			     size_t bytes);
/** \brief Enqueues a copy of \p bytes from \p src at byte \p offset to host memory \p dst;
 *  \p dst holds them once the queue is synchronised. Errors as ape_buffer_write(). */
APE_API int ape_buffer_read(ape_queue *queue, void *dst, ape_buffer *src, size_t offset,
			    size_t bytes);

/** \brief A new in-order queue of \p dev, for *out. \return 0, APE_EINVAL, APE_ENOMEM, device
 *  failures. */
APE_API int ape_queue_create(ape_device *dev, ape_queue **out);
/**
 * \brief Wraps the caller's in-order `cl_command_queue`, of \p dev's context and device: libape
 * enqueues its work there, after what the caller enqueued before and before what it enqueues
 * after. \return 0; APE_EINVAL (NULL, another context or device, an out-of-order queue);
 * APE_ENOTSUP (not an OpenCL device).
 */
APE_API int ape_queue_wrap_opencl(ape_device *dev, void *cl_command_queue, ape_queue **out);
/**
 * \brief Wraps the caller's `CUstream` (of \p dev's primary context; NULL: the legacy default
 * stream). \return 0; APE_EINVAL; APE_ENOTSUP (not a CUDA device).
 */
APE_API int ape_queue_wrap_cuda(ape_device *dev, void *cu_stream, ape_queue **out);
/** \brief Destroys a queue libape created (waiting for its work first), or drops libape's hold
 *  on a wrapped one, without waiting. Accepts NULL. */
APE_API void ape_queue_destroy(ape_queue *queue);
/**
 * \brief Waits until everything enqueued on \p queue has completed.
 * \return 0, or the first failure that happened on the device since the last synchronisation,
 *         its message naming the device and the call that enqueued the work
 *         ("ape_attention_enqueue #3 on opencl:0 ..."); the queue may then be unusable.
 */
APE_API int ape_queue_synchronize(ape_queue *queue);
/** \brief The queue's device (NULL for NULL). Thread-safe. */
APE_API ape_device *ape_queue_device(const ape_queue *queue);

/**
 * \brief The native objects behind \p dev, to build the caller's own on: for an OpenCL device
 * its `cl_context` and `cl_device_id`; for a CUDA device its primary `CUcontext` and its
 * `CUdevice` (an int, as `(void *)(intptr_t)`); NULL and NULL for the reference.
 * \return 0, or APE_EINVAL (NULL dev). Either pointer may be NULL. Thread-safe.
 */
APE_API int ape_device_native(const ape_device *dev, void **context, void **device);

/**
 * \brief A tensor in a buffer: the byte offset of element [0,0,0,0], the dtype, the shape and the
 * strides in elements. Q, K, V and O are `[B, H, L, D]` (K, V: `[B, Hkv, L, D]`) with the D axis
 * contiguous (strides[3] = 1); strides of B, H and L are free, so a `[B, L, H, D]` tensor or one
 * slice of a packed QKV tensor is used as it is. All four strides 0: contiguous row-major.
 * LSE is `[B, H, Lq, 1]` float32. The same overlap rules as ape_tensor.
 */
typedef struct ape_dtensor {
	ape_buffer *buf;
	uint64_t byte_offset; /**< a multiple of the element size */
	ape_dtype dtype;
	int64_t shape[4];
	int64_t strides[4];
} ape_dtensor;

/** \brief Fills \p t as a contiguous tensor of the given shape at \p byte_offset of \p buf.
 *  Never fails. */
APE_API void ape_dtensor_init(ape_dtensor *t, ape_buffer *buf, uint64_t byte_offset,
			      ape_dtype dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3);

/**
 * \brief The forward pass on device tensors, enqueued on \p queue: asynchronous, no copy to or
 * from the host, no wait on the queue.
 *
 * Every argument is checked before anything is enqueued, by the rules of
 * ape_attention_forward(), and also: every buffer belongs to the queue's device; every element
 * a tensor addresses lies inside its buffer (offset, shape and strides against the buffer's
 * size); o and lse overlap no input. Sequences whose scratch memory would not fit run as
 * several launches over query rows, on the device. A failure on the device is reported by the
 * next ape_queue_synchronize() on \p queue, naming the device and this call.
 *
 * \param queue a queue of the device to run on
 * \param desc,q,k,v as ape_attention_forward(), as device tensors
 * \param[out] o `[B, H, Lq, D]`, of q->dtype or APE_F32: written when the work completes
 * \param[out] lse NULL, or `[B, H, Lq, 1]` APE_F32
 * \return 0 (enqueued); APE_EINVAL (naming the argument and what is wrong); APE_EOVERFLOW;
 *         APE_ENOMEM; APE_ENOTSUP; device failures met while enqueueing.
 * \note On a validation error nothing is enqueued. Host memory the call reads (desc's
 *       per-head parameters) is read before it returns.
 */
APE_API int ape_attention_enqueue(ape_queue *queue, const ape_attn_desc *desc,
				  const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
				  const ape_dtensor *o, const ape_dtensor *lse);

/**
 * \brief ape_attention_enqueue() that also writes each row's attention entropy and mean
 * attention distance (docs/diagnostics.md), computed in the same fused pass: the device-resident
 * twin of ape_attention_forward_diag().
 *
 * Asynchronous like ape_attention_enqueue(): no copy, no wait. The outputs are device tensors
 * laid out like lse, strides free; each is checked by lse's rules (in its buffer, a buffer of
 * the queue's device, offset a multiple of 4, no two rows at one address) and must overlap no
 * other tensor of the call: q, k, v, o, lse and each other (APE_EINVAL,
 * "ape_attention_enqueue_diag: entropy overlaps o in memory: ..."). As in
 * ape_attention_forward_diag(), the call runs under `min(desc->skip_tol, 2^-24)`, where the
 * diagnostics stay within the spec's tolerance. Every row is written: a row without a visible
 * key (and every row when Lk = 0) gets 0 in both, a NaN row NaN. The results equal those of
 * ape_attention_forward_diag() on the same device and inputs.
 *
 * \param queue,desc,q,k,v,o,lse as ape_attention_enqueue()
 * \param[out] entropy NULL (not wanted), or `[B, H, Lq, 1]` APE_F32: `-sum_j P_ij ln P_ij`
 * \param[out] mean_distance NULL (not wanted), or `[B, H, Lq, 1]` APE_F32: `sum_j P_ij |n|`
 * \return as ape_attention_enqueue(); APE_ENOTSUP, naming the device, on a backend that does
 *         not compute the diagnostics on device tensors (the reference, OpenCL and CUDA
 *         backends all do), before anything is enqueued. With both NULL it is ape_attention_enqueue().
 * \note On any error returned, nothing is enqueued except after a device failure while
 *       enqueueing (outputs then unspecified, as for ape_attention_enqueue()).
 */
APE_API int ape_attention_enqueue_diag(ape_queue *queue, const ape_attn_desc *desc,
				       const ape_dtensor *q, const ape_dtensor *k,
				       const ape_dtensor *v, const ape_dtensor *o,
				       const ape_dtensor *lse, const ape_dtensor *entropy,
				       const ape_dtensor *mean_distance);

/**
 * \brief A ragged batch (ape_attention_forward_varlen()) on device tensors, enqueued on \p
 * queue: asynchronous, no copy to or from the host, no wait on the queue.
 *
 * Everything is checked before anything is enqueued: the batch and desc by the rules of
 * ape_attention_forward_varlen() (the same messages), the tensors by those of
 * ape_attention_enqueue(). q and o are `[1, H, total_q, D]`, k and v `[1, Hkv, total_k, D]`
 * device tensors, strides free (a packed `[total, H, D]` array has strides
 * `{0, D, H * D, 1}`; a slice of a packed QKV buffer is used as it is); lse NULL or
 * `[1, H, total_q, 1]` APE_F32, strides free (token-major `[total_q, H]`, as the host call
 * writes it: strides `{0, 1, H, 1}`). vl's arrays are host memory, read before the call
 * returns.
 *
 * On a device that takes ragged launches (the reference, OpenCL and CUDA) the batch is one call
 * of the device-resident executor: each launch serves every sequence of its rows, query rows
 * split under the budget like ape_attention_enqueue(). Explicit positions of any kind (gaps,
 * repeats, any order) are one such call too on a device that also reads explicit positions
 * (the reference and OpenCL): a segment per sequence, each launch given the positions of its
 * rows and of every key, as the host call's one launch takes them. On a device that does not
 * (CUDA) each run of consecutive positions is a segment of its own, and positions that give a
 * query run several runs of consecutive key positions are refused (below). Results equal
 * ape_attention_forward_varlen()'s on the same device within the spec's tolerance (bit for bit
 * on the reference; bit for bit everywhere for a one-sequence batch of default positions,
 * which is ape_attention_enqueue() itself).
 *
 * \param queue a queue of the device to run on
 * \param desc,vl as ape_attention_forward_varlen()
 * \param q,k,v packed inputs; read by the work
 * \param[out] o packed output, of q->dtype or APE_F32: written when the work completes (0 for
 *        rows that see no key)
 * \param[out] lse NULL, or the rows' LSE (-inf for rows that see no key)
 * \return 0 (enqueued); APE_EINVAL (naming the argument, the sequence and the value);
 *         APE_EOVERFLOW; APE_ENOMEM; APE_ENOTSUP, naming vl->pos_k and the device, for
 *         positions that give a query run several runs of consecutive key positions (gaps or
 *         repeats among a sequence's keys) on a device that reads no explicit positions (the
 *         host call takes them everywhere); device failures met while enqueueing.
 * \note On an error found by the checks nothing is enqueued. After any other failure (host
 *       memory, or a device failure while enqueueing) the call returns its code with a
 *       message, q, k, v, vl and desc are untouched, launches enqueued before it may run and
 *       o and lse hold unspecified values, as for ape_attention_enqueue().
 */
APE_API int ape_attention_enqueue_varlen(ape_queue *queue, const ape_attn_desc *desc,
					 const ape_varlen *vl, const ape_dtensor *q,
					 const ape_dtensor *k, const ape_dtensor *v,
					 const ape_dtensor *o, const ape_dtensor *lse);
/**@}*/

/** \name Paged attention over the caller's pages
 *
 * For engines that manage pages themselves (vLLM's block tables, FlashInfer's CSR page tables):
 * libape attends over the caller's key and value page buffers, device tensors in any layout,
 * through the caller's page table, with APE's true positions (docs/serving.md, "The caller's
 * pages"). A plan (ape_paged_kv_plan()) checks a step's table and query batch once, from
 * host-side lengths, without touching the device; every layer of the step then runs it
 * (ape_paged_kv_run()) with its own page buffers and parameters. The object holds the plan,
 * the page table's device copy and the executor's session, allocated at creation; it is used
 * by one thread at a time.
 */
/**@{*/
typedef struct ape_paged_kv ape_paged_kv;

/** Options of ape_paged_kv_create(). Fields are only ever added at the end. */
typedef struct ape_paged_kv_options {
	size_t struct_size; /**< set by ape_paged_kv_options_init() */
	int64_t Hkv; /**< key/value heads of the pages, >= 1 */
	int64_t H; /**< query heads, a multiple of Hkv; 0: Hkv */
	int64_t D; /**< head dimension: even, 2..APE_MAX_D */
	ape_dtype dtype; /**< storage of the pages, queries and (or APE_F32) outputs */
	int64_t page_tokens; /**< tokens per page of the caller's buffers, 1..65536 (required) */
	int64_t num_pages; /**< pages of each buffer, >= 1; num_pages * page_tokens <= 2^40 */
	int64_t max_batch_tokens; /**< most query rows of one plan, 1..2^20; 0: 256 */
	int64_t attend_chunk; /**< keys per kernel launch; 0: 4096 */
	/** Device memory the object may hold (page table, chunk buffers, partial outputs), bytes;
	 *  0: no limit but the device's. */
	uint64_t max_device_bytes;
} ape_paged_kv_options;

/** \brief Defaults: max_batch_tokens 256, attend_chunk 4096, no budget; Hkv, D, dtype,
 *  page_tokens and num_pages must be set. Never fails. */
APE_API void ape_paged_kv_options_init(ape_paged_kv_options *opts);

/**
 * \brief Makes the object on \p dev: the page table's device copy and the attend session, all
 *        its device memory.
 * \return 0; APE_EINVAL (NULL argument, bad option, naming it); APE_EOVERFLOW; APE_ENOMEM;
 *         APE_ENOTSUP (a backend without strided device copies); device errors. *out is NULL
 *         on failure.
 */
APE_API int ape_paged_kv_create(ape_device *dev, const ape_paged_kv_options *opts,
				ape_paged_kv **out);

/** \brief Destroys the object after its device work has finished. Accepts NULL. */
APE_API void ape_paged_kv_destroy(ape_paged_kv *pk);

/**
 * A caller's page table over `nseq` sequences, in one of two forms (host memory, read by
 * ape_paged_kv_plan() only):
 * - FlashInfer's CSR form: sequence s holds pages indices[indptr[s]] .. indices[indptr[s+1] -
 *   1] in order, every one full but the last, which holds last_page_len[s] tokens (1 ..
 *   page_tokens; 0 for a sequence of no page);
 * - a vLLM block table: sequence s holds seq_lens[s] tokens in its first
 *   ceil(seq_lens[s] / page_tokens) pages block_table[s * block_table_stride + i] (the rest of
 *   its row is not read).
 * Page numbers lie in 0 .. num_pages - 1; sequences may share pages (prefix sharing, forks); a
 * sequence may not hold one page twice. Token t of sequence s sits at position k_start[s] + t
 * (k_start NULL: t).
 */
typedef struct ape_page_table {
	size_t struct_size; /**< set by ape_page_table_init() */
	int64_t nseq; /**< sequences, >= 0 */
	const int64_t *indptr; /**< CSR: nseq + 1 offsets into indices, from 0, non-decreasing */
	const int64_t *indices; /**< CSR: indptr[nseq] page numbers */
	const int64_t *last_page_len; /**< CSR: nseq counts */
	const int64_t *block_table; /**< block table: nseq rows of block_table_stride */
	int64_t block_table_stride; /**< block table: entries per row, >= 0 */
	const int64_t *seq_lens; /**< block table: nseq token counts, >= 0 */
	const int64_t *k_start; /**< NULL, or nseq first positions in [-2^62, 2^62) */
} ape_page_table;

/** \brief An empty table (nseq 0, every pointer NULL). Never fails. */
APE_API void ape_page_table_init(ape_page_table *pt);

/**
 * \brief Plans one step: the caller's page table \p pt and the query rows of each of its
 *        sequences, rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) belonging to sequence s.
 *
 * Everything is checked here, once per step, from host memory: the table's form and every
 * entry, the rows, the positions (by ape_kv_pool_attend()'s rules: \p pos_q NULL places each
 * sequence's rows at the end of its keys, else every row's position). The plan keeps copies;
 * the arrays may be reused when this returns. It replaces the previous plan.
 *
 * \param cu_seqlens_q pt->nseq + 1 offsets, from 0, non-decreasing, the last at most
 *        max_batch_tokens (the total of query rows, total_q)
 * \param pos_q NULL, or total_q positions
 * \return 0; APE_EINVAL naming the argument, index and value (both forms or neither, a page
 *         out of range or held twice by one sequence, last_page_len 0 or past the page, too few
 *         block table entries, ...); APE_EOVERFLOW (a position past the range, naming the
 *         sequence); APE_ENOMEM (host memory). On failure the object has no plan: runs fail
 *         until a plan succeeds.
 */
APE_API int ape_paged_kv_plan(ape_paged_kv *pk, const ape_page_table *pt,
			      const int64_t *cu_seqlens_q, const int64_t *pos_q);

/**
 * \brief Runs the plan with one layer's pages and parameters: the attention of each planned
 *        row over its sequence's keys (with desc->causal, those at positions <= its own).
 *
 * \p k_pages and \p v_pages are device tensors of the object's device and dtype, shaped
 * `[num_pages, Hkv, page_tokens, D]`, strides free with D contiguous (vLLM's
 * `[num_pages, page_tokens, Hkv, D]` has strides `{page_tokens * Hkv * D, D, Hkv * D, 1}`;
 * FlashInfer's K and V halves of one `[num_pages, 2, ...]` buffer are two tensors of it, at
 * two offsets), both with the same strides; every element inside its buffer. They must hold
 * their keys when the call is made (the caller's own writes to them completed); they are only
 * read. q is `[1, H, total_q, D]` host memory of the dtype (a packed `[total_q, H, D]` array,
 * strides free), total_q the plan's; o likewise, of the dtype or APE_F32; lse NULL or total_q
 * * H floats (`[total_q, H]`). desc->q_start_set must be false and desc->k_start 0 (positions
 * come from the plan). The caller's pages carry no key-norm maxima: no key is left out unread;
 * the kernels' own skipping applies as in any call. Results equal those of ape_kv_pool_attend()
 * over a pool holding the same sequences bit for bit on the same device wherever the pool
 * leaves no key out either (skip_tol 0, or no decay; tested): the two share one code path.
 *
 * \return 0; APE_EINVAL (no plan, or a bad argument, naming it); APE_ENOMEM; device errors. On
 *         an error found by the checks nothing is written; after a device failure o and lse
 *         hold unspecified values. The plan stays for the next run.
 */
APE_API int ape_paged_kv_run(ape_paged_kv *pk, const ape_attn_desc *desc,
			     const ape_dtensor *k_pages, const ape_dtensor *v_pages,
			     const ape_tensor *q, ape_tensor *o, float *lse, ape_stats *stats);

/**
 * \brief ape_paged_kv_run() that also returns each row's attention entropy and mean attention
 *        distance, as ape_kv_pool_attend_diag() does (the same layout and rules).
 */
APE_API int ape_paged_kv_run_diag(ape_paged_kv *pk, const ape_attn_desc *desc,
				  const ape_dtensor *k_pages, const ape_dtensor *v_pages,
				  const ape_tensor *q, ape_tensor *o, float *lse, float *entropy,
				  float *mean_distance, ape_stats *stats);
/**@}*/

/** \name Training: the backward pass
 *
 * The gradients of APE attention (docs/ape.md, "Gradients"; APE-SPEC.md, "Gradients"): given
 * the forward's inputs, its saved O and LSE, the upstream gradient dO and optionally dLSE, the
 * exact derivatives of the loss with respect to Q, K, V and every head's delta, beta, gamma and
 * lambda. Each output is optional: NULL means not wanted, and its work is not done (frozen Q,
 * K and V with only `dparams` wanted, the seed's "tune APE only" recipe, costs one pass over
 * the pairs and computes no gradient vector).
 *
 * Today only the reference backend implements it (float64, every visible key); on a device of
 * another backend the call fails with APE_ENOTSUP naming the device, and never falls back to
 * another one. Long sequences are streamed as the forward's are, under the same device budget:
 * key chunks x query chunks (at most 4096 rows each by default), dK and dV summed over the
 * query chunks on the device, dQ over the key chunks on the host in float64, all in a fixed
 * order; the chunks run one after another on one device (no pipelining, no multi-device split
 * yet). Skipping: with desc->skip_tol > 0 and every head's delta, beta, gamma >= 0 (lambda
 * >= 0), a backend may leave out keys whose weights, each weighed by its distance, the
 * backward's own bound proves below skip_tol of the row's computed weight (docs/kernels.md,
 * "Skipping in the backward pass"): every gradient then differs from the dense one by at most
 * skip_tol times that weight's share; OpenCL does, and counts the pairs it computed in
 * ape_stats; the reference and CUDA compute every visible key. skip_tol = 0 skips nothing.
 */
/**@{*/

/**
 * \brief The gradients of ape_attention_forward() on \p dev, from host tensors.
 *
 * The loss L is any function of O (and of LSE); the call returns its gradients with respect to
 * the inputs of the forward call given dO = dL/dO (and dLSE = dL/dLSE):
 * - dq = dL/dQ, including the path through alpha_i (0 through sigma_i for a constant row);
 * - dk = dL/dK and dv = dL/dV, for grouped-query attention summed over the query heads that
 *   share each kv head;
 * - dparams[4h + 0..3] = dL/d(delta_h, beta_h, gamma_h, lambda_h), summed over the batch, the
 *   rows and the keys. A parameter given once for every head (ape_param.per_head NULL) has the
 *   sum over h of its entries as its gradient.
 * Rows with no visible key contribute nothing. The result is deterministic: two calls give
 * bit-identical gradients.
 *
 * Everything is validated before any work, as for ape_attention_forward() (q, k, v, o and desc
 * are checked by the same rules, messages name the argument), and also: dout, dq shaped like q,
 * dk and dv like k, each of q->dtype or APE_F32, strided like any tensor; no output overlapping
 * any input or another output.
 *
 * \param dev a device of a live context
 * \param desc the forward call's parameters, explicit positions (desc->pos_q, desc->pos_k)
 *        included, checked as ape_attention_forward() checks them; with them each batch
 *        element is cut into runs of consecutive positions (the backward's kernels read no
 *        positions), one dense backward per pair of runs, every output staged and written on
 *        success, dparams summed over the batch elements
 * \param q,k,v the forward call's inputs; read only
 * \param o the forward's output O (q->dtype or APE_F32); read only
 * \param lse the forward's LSE, B*H*Lq floats (contiguous `[B,H,Lq]`); required; read only
 * \param dout dL/dO, shaped like q, of q->dtype or APE_F32; read only
 * \param dlse NULL (dL/dLSE = 0), or B*H*Lq floats; read only
 * \param[out] dq NULL, or shaped like q, of q->dtype or APE_F32: overwritten on success
 * \param[out] dk,dv each NULL, or shaped like k, of q->dtype or APE_F32: overwritten on success
 * \param[out] dparams NULL, or 4*H floats: per head h, dparams[4h + 0..3] = the gradients of
 *        delta, beta, gamma, lambda, overwritten on success
 * \param stats NULL, or statistics of the call (initialise with ape_stats_init()): the pairs
 *        visible and computed, launches (`chunks`) and chunk sizes, bytes moved, kernel and
 *        total time, the budget and the peak device memory. On a device that reads host
 *        memory in place (the reference, OpenCL CPU devices), a contiguous input that one chunk
 *        covers is read where it lies and the gradients of one chunk accumulate in the call's
 *        host copies: no bytes moved and no device memory for them (docs/streaming.md)
 * \return 0; APE_EINVAL (bad argument, naming it; also when dq, dk, dv and dparams are all
 *         NULL: nothing to compute); APE_EOVERFLOW (sizes or positions overflow 64 bits);
 *         APE_ENOTSUP (the device cannot run the backward pass: its backend has none, or an
 *         OpenCL device lacks float64; the message names the device); APE_ENOMEM (host memory: the call keeps float32 copies of the gradients, and
 *         dQ's sum in float64, until it succeeds); APE_EBACKEND, APE_EDEVLOST (device failures).
 * \note On failure nothing is written: dq, dk, dv and dparams are untouched.
 * \note Inputs are not scanned: NaN or Inf in an input reaches the gradients it touches. An
 *       \p o or \p lse that is not the forward's gives gradients of nothing in particular.
 * \note Thread-safe like ape_attention_forward().
 */
APE_API int ape_attention_backward(ape_device *dev, const ape_attn_desc *desc,
				   const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
				   const ape_tensor *o, const float *lse, const ape_tensor *dout,
				   const float *dlse, ape_tensor *dq, ape_tensor *dk,
				   ape_tensor *dv, float *dparams, ape_stats *stats);

/**
 * \brief ape_attention_backward() with execution options.
 *
 * opts->chunk_q and chunk_k are the most rows per chunk (0: 4096) and opts->max_device_bytes
 * the budget of each device (0: three quarters of its memory), as for
 * ape_attention_forward_ex(): the planner halves chunks until they fit every device's budget,
 * and all devices use the same chunk sizes.
 *
 * Several devices (of one backend or several, as for ape_attention_forward_ex()) share the
 * key chunks: each device owns a contiguous range of them, computes their dK and dV over every
 * query chunk that sees them, and returns its dQ partials and parameter sums, which the host
 * adds in float64 in device order (that is, key-chunk order). The split is fixed before any
 * work: opts->device_weights gives each device's share (NULL: equal shares; measured speeds
 * are not used, and idle devices do not take work from busy ones), so two calls with the same
 * devices and options give bit-identical gradients; another device set gives the same
 * gradients within rounding. A device that fails fails the call (the first failing device in
 * list order names itself in the message) and the others stop. opts->trace_path writes the
 * Chrome trace of the call as the forward does (one process per device: the launches, the
 * copies of the query and key sides, the copies back), once the call succeeded, and only
 * when there is device work (Lq, Lk >= 1). pipeline_depth is validated but not
 * used: on each device the chunks run one after another, copies not overlapped with launches.
 * APE_EXEC_ATOMIC_OUTPUTS is what the call does anyway.
 *
 * \param devs,ndev the devices (1..APE_MAX_DEVICES; one may be listed more than once);
 *        each must have a backward pass
 * \param opts NULL for the defaults (see ape_exec_options_init())
 * \param desc,q,k,v,o,lse,dout,dlse,dq,dk,dv,dparams as ape_attention_backward() (with
 *        explicit positions the call runs in pieces, which write no trace yet: opts->trace_path
 *        is then refused with APE_EINVAL)
 * \param stats as ape_attention_backward(), over every device: bytes and times summed,
 *        `devices` those that were given key chunks, peak_device_bytes the largest of one
 *        device, device_budget the smallest
 * \return as ape_attention_backward(); APE_EINVAL also for a bad option (naming it) or device
 *         list; APE_ENOTSUP also when any device has no backward pass (naming it);
 *         APE_ENOMEM also for a budget too small for one chunk of 1 query row and 1 key row
 *         on a device (the message names it and says what that needs); APE_EIO when the
 *         trace cannot be written.
 * \note On failure nothing is written.
 */
APE_API int ape_attention_backward_ex(ape_device *const *devs, int ndev,
				      const ape_exec_options *opts, const ape_attn_desc *desc,
				      const ape_tensor *q, const ape_tensor *k,
				      const ape_tensor *v, const ape_tensor *o, const float *lse,
				      const ape_tensor *dout, const float *dlse, ape_tensor *dq,
				      ape_tensor *dk, ape_tensor *dv, float *dparams,
				      ape_stats *stats);

/**
 * \brief The gradients of ape_attention_forward() on device tensors, enqueued on \p queue:
 * the device-resident twin of ape_attention_backward() (and of ape_attention_enqueue()).
 * Asynchronous: no copy to or from the host, no wait on the queue; work enqueued on \p queue
 * before it (an ape_attention_enqueue() that writes o and lse, say) is ordered before it.
 *
 * The gradients, their rules and every check are ape_attention_backward()'s (messages name the
 * argument), plus ape_attention_enqueue()'s for device tensors: every buffer belongs to the
 * queue's device, every element a tensor addresses lies inside its buffer, offsets are
 * multiples of the element size, the D axis is contiguous; overlaps are judged within one
 * buffer (two buffers never overlap). All checks run before anything is enqueued; on a
 * validation error nothing is enqueued.
 *
 * How it runs: the backend's launches take contiguous buffers and float32/float64
 * accumulators, so the call enqueues, in order, on \p queue: copies of the inputs into
 * contiguous device scratch (none for an input already dense at offset 0), the zeroed
 * accumulators (none for a float32 output dense at offset 0), the launches, and copies of the
 * accumulators into the outputs, converted to their types (rounded to nearest even). The
 * scratch is allocated and released in queue order (stream-ordered memory on CUDA with memory
 * pools; without pools the release waits for the stream). Its size, with the backend's own
 * scratch, is kept under the device's default budget (three quarters of its memory) by
 * running several launches of fewer query rows, each against every key, in row order (dK, dV
 * and dparams accumulate over them in that fixed order); when even one query row does not fit
 * the call fails with APE_ENOMEM saying what one row needs. Deterministic: two calls give
 * bit-identical gradients; with one launch they are those of ape_attention_backward() on the
 * same device and tensors (bit for bit on the reference and OpenCL).
 *
 * \param queue a queue of the device to run on (the device needs the backward pass on device
 *        tensors, the capability resident_backward of core/backend.h: the reference, OpenCL
 *        with float64, CUDA)
 * \param desc,q,k,v,o as ape_attention_backward(), as device tensors; read only
 * \param lse the forward's LSE, `[B, H, Lq, 1]` APE_F32; required; read only
 * \param dout dL/dO, shaped like q, of q->dtype or APE_F32; read only
 * \param dlse NULL (dL/dLSE = 0), or `[B, H, Lq, 1]` APE_F32; read only
 * \param[out] dq NULL, or shaped like q, of q->dtype or APE_F32
 * \param[out] dk,dv each NULL, or shaped like k, of q->dtype or APE_F32
 * \param[out] dparams NULL, or a `[1, 1, H, 4]` APE_F32 device tensor (an `[H, 4]` array:
 *        per head h, the gradients of delta, beta, gamma, lambda), strides free but the last
 * \return 0 (enqueued); APE_EINVAL (naming the argument and what is wrong; also when dq, dk,
 *         dv and dparams are all NULL); APE_EOVERFLOW; APE_ENOMEM (one query row's scratch
 *         over the budget, or the device's memory); APE_ENOTSUP (the backend cannot run it,
 *         naming the device); device failures met while enqueueing.
 * \note Outputs are written when the work completes; a failure on the device is reported by
 *       the next ape_queue_synchronize() on \p queue, naming the device and this call, and
 *       leaves the outputs unspecified. Host memory the call reads (desc's per-head
 *       parameters) is read before it returns.
 */
APE_API int ape_attention_backward_enqueue(ape_queue *queue, const ape_attn_desc *desc,
					   const ape_dtensor *q, const ape_dtensor *k,
					   const ape_dtensor *v, const ape_dtensor *o,
					   const ape_dtensor *lse, const ape_dtensor *dout,
					   const ape_dtensor *dlse, const ape_dtensor *dq,
					   const ape_dtensor *dk, const ape_dtensor *dv,
					   const ape_dtensor *dparams);

/**
 * \brief The gradients of a ragged batch (ape_attention_backward_varlen()) on device tensors,
 * enqueued on \p queue: the device-resident twin of ape_attention_backward_varlen() (and the
 * backward of ape_attention_enqueue_varlen()). Asynchronous: no copy to or from the host, no
 * wait on the queue.
 *
 * Everything is checked before anything is enqueued: the batch and desc by the rules of
 * ape_attention_backward_varlen() (the same messages), the tensors by those of
 * ape_attention_backward_enqueue(). q, o, dout and dq are `[1, H, total_q, D]`, k, v, dk and
 * dv `[1, Hkv, total_k, D]` device tensors, strides free (a packed `[total, H, D]` array has
 * strides `{0, D, H * D, 1}`); lse (required) and dlse (NULL: dL/dLSE = 0) `[1, H, total_q,
 * 1]` APE_F32, strides free (token-major `[total_q, H]`, as the forward writes it: strides
 * `{0, 1, H, 1}`); dparams NULL or `[1, 1, H, 4]` APE_F32. dq, dk, dv, dparams each
 * optional (all four NULL: APE_EINVAL). vl's arrays are host memory, read before the call
 * returns.
 *
 * The batch is one run of ape_attention_backward_enqueue()'s path (the same gathers,
 * accumulators and query-row launches split under the device's budget), each launch serving
 * every sequence of its rows (ragged backward launches). Sequences without keys get zero
 * gradients. Deterministic: two calls give the same bits; a one-sequence batch over every key
 * is ape_attention_backward_enqueue() of the same tensors, bit for bit.
 *
 * Positions: the default ones, or explicit positions under which each query run of
 * consecutive positions sees one run of consecutive key positions of its own (position_ids
 * that restart per document, shifted sequences). Positions that give a query run several key
 * runs (gaps or repeats among a sequence's keys), or two query runs of one sequence the same
 * keys, need partial gradients summed across pieces, which only the host call does: they are
 * refused with APE_ENOTSUP naming vl->pos_k (or vl->pos_q); ape_attention_backward_varlen()
 * takes any positions. desc->dbias_table is refused (APE_EINVAL) as by
 * ape_attention_backward_enqueue().
 *
 * \param queue a queue of the device to run on (it needs the backward pass on device tensors
 *        and ragged backward launches: the reference, OpenCL with float64, CUDA)
 * \param desc,vl as ape_attention_backward_varlen()
 * \param q,k,v,o,lse,dout,dlse packed inputs; read by the work
 * \param[out] dq,dk,dv,dparams each NULL, or written when the work completes (of q->dtype or
 *        APE_F32; dparams float32 `[H, 4]`: per head the gradients of delta, beta, gamma,
 *        lambda)
 * \return 0 (enqueued); APE_EINVAL (naming the argument, the sequence and the value);
 *         APE_EOVERFLOW; APE_ENOMEM; APE_ENOTSUP (positions as above; a device without ragged
 *         backward launches or without the backward pass on device tensors, naming it);
 *         device failures met while enqueueing.
 * \note On an error found by the checks nothing is enqueued. After a device failure while
 *       enqueueing, launches enqueued before it may run and the outputs hold unspecified
 *       values, as for ape_attention_backward_enqueue(); a failure on the device is reported
 *       by the next ape_queue_synchronize() on \p queue.
 */
APE_API int ape_attention_backward_enqueue_varlen(
	ape_queue *queue, const ape_attn_desc *desc, const ape_varlen *vl, const ape_dtensor *q,
	const ape_dtensor *k, const ape_dtensor *v, const ape_dtensor *o, const ape_dtensor *lse,
	const ape_dtensor *dout, const ape_dtensor *dlse, const ape_dtensor *dq,
	const ape_dtensor *dk, const ape_dtensor *dv, const ape_dtensor *dparams);
/**@}*/

#ifdef __cplusplus
}
#endif
#endif /* APE_APE_H */
