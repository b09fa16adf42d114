/* SPDX-License-Identifier: MIT */
/*
 * libape's backend interface, a public and versioned ABI: what every backend (the reference,
 * OpenCL, CUDA, and a vendor's plugin loaded at run time) provides to the core, and the contract
 * of each op, in the manner of the kernel's `struct drm_driver`. docs/backends.md is the guide
 * (lifecycle, threading, ownership, how to certify a backend with `ape-check --plugin`).
 *
 * A backend fills one `struct ape_backend_plugin` (below) with designated initialisers. The
 * built-in backends register theirs through the same table as a plugin does; a plugin is a
 * shared object exporting
 *
 *     APE_PLUGIN_EXPORT const struct ape_backend_plugin *ape_backend_plugin(void);
 *
 * found through `APE_BACKEND_PATH`, ape_context_options.backend_path or the plugin folder under
 * the install prefix (docs/backends.md, "Loading"). It links libape (-lape) for the services
 * at the end of this file, and may include ape/ape_math.h, the formulas every kernel of libape
 * computes (plain C that OpenCL C and CUDA compile too).
 *
 * Versions: a table states the ABI it was compiled against (APE_BACKEND_ABI_MAJOR and _MINOR)
 * and its own size. A different major is refused. Within one major, minors only append ops at
 * the end of the table and capability bits: a table shorter than this header's (an older minor)
 * has the later ops absent, and the core asks the table's proc_address() for any of them by
 * name before it takes them as absent.
 *
 * Registration (when a context is created): before probing, the core checks the table (every
 * required op set, each group of ops all or none) and refuses a backend that fails, with the
 * reason ape_backend_get_info() and ape-info show; after probing, it checks each device's
 * capabilities against the ops (a capability needs the ops it names) and refuses the backend,
 * its devices released, when one claims what the ops cannot do. The core then calls the
 * backend only through a table of its own: the backend's op behind a trampoline that names the
 * device and the op in a failure's message, and the core's fallbacks where the backend leaves
 * an op out. A plugin that is refused, or whose probe fails, never breaks the rest of libape.
 *
 * Objects: struct ape_be_queue and struct ape_be_event, which each backend defines, begin with
 * `struct ape_device *dev`, the device they belong to (an event's: its queue's), so that the
 * core finds the device of any queue or event (ape_be_queue_dev(), ape_be_event_dev()). Buffers
 * are the backend's own entirely.
 *
 * Device tensors are `[B, H, L, D]` (K/V: `[B, Hkv, L, D]`). In launches the streaming executor
 * makes they are contiguous at offset 0 (the core packs and unpacks caller strides on the host);
 * in launches on the caller's memory (ape_attention_enqueue(), and host calls on devices that
 * read host memory in place) Q, K, V, O and LSE are strided views (struct ape_be_view below), and
 * the kernels read and write them where they are (a backward launch's Q, K, V, O and dO likewise,
 * on a device that says APE_BE_CAP_BWD_VIEWS).
 *
 * Ordering model: a queue executes its commands in order; commands may run asynchronously from
 * the host. Host pointers handed to copy_h2d/copy_d2h must stay valid until the queue has been
 * synchronised (or an event recorded after the copy has completed). Events order work across
 * queues of the same device.
 *
 * Threads and locks: the core holds no lock of its own while it calls an op, and an op returns
 * with no lock held. probe runs on the thread creating the context; teardown and
 * device_release on the thread destroying it (or creating it, when the topology drops a
 * device), with no other op of that backend running. Every other op may be called from several
 * threads at once, for different queues of one device or of several; a queue, and the events
 * recorded on it, are used by one thread at a time. A backend protects its own shared mutable
 * state (per-device program or module caches, say) itself.
 *
 * Ownership: what an op creates (*out of buf_alloc, queue_create, event_record; *handle of
 * host_register) belongs to the core from a successful return until the core hands it back to
 * its release op (buf_free, queue_destroy, event_destroy, host_unregister), exactly once. The
 * backend owns dev->priv and its backend state (ape_be_priv()). A plugin's shared object stays
 * loaded until the last context that loaded it is destroyed.
 *
 * Failure, for every op that returns int: 0, or a negative libape code (APE_ENOMEM when memory
 * of the device or of the host ran out, APE_EDEVLOST when the device stopped working,
 * APE_EBUILD, APE_EBACKEND, ...). A failing op
 *   - sets the thread's error message (ape_be_error()) to what failed below the op
 *     ("clEnqueueWriteBuffer (64 bytes): CL_OUT_OF_RESOURCES (-5)"), and only that: the core's
 *     table names the device and the op around it, once, for every backend
 *     ("opencl:0 NAME (0000:03:00.0): copy_h2d: clEnqueueWriteBuffer (64 bytes): ..."); the
 *     core passes it on to the caller, adding at most the public function and how much of the
 *     outputs was written;
 *   - leaves its out-parameters cleared: *out and *handle NULL, *ms 0 (so a cleanup path may
 *     release them unconditionally: buf_free, queue_destroy and event_destroy accept NULL);
 *   - leaves nothing of its own behind (no half-created object);
 *   - may leave the queue unusable after a device loss, but queue_destroy, buf_free and
 *     event_destroy still work on it and on what it used.
 * Ops that cannot fail on a backend (the reference's copies) return 0.
 */
#ifndef APE_BACKEND_H
#define APE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The ABI of this header. Major: bumped when a member of the table or of a struct it is handed
 * moves or changes meaning (a plugin of another major is refused). Minor: bumped when ops are
 * appended to struct ape_backend_plugin, or capability bits, members at the end of a struct the
 * core hands out, or launch kinds a capability gates are added; a plugin of an older minor keeps
 * working (the core reads its struct_size), one of a newer minor than the library's is refused
 * (it may rely on what this library does not do). The history of the internal interface that
 * became this ABI (its numbers 1 to 14) is in docs/backends.md.
 */
#define APE_BACKEND_ABI_MAJOR 1
#define APE_BACKEND_ABI_MINOR 3 /* 1.1: the distance-bias table (APE_BE_CAP_BIAS_TABLE); 1.2:
				* ragged backward launches (APE_BE_CAP_BWD_SEGMENTS); 1.3: strided
				* backward launches (APE_BE_CAP_BWD_VIEWS) */

/* The symbol a plugin exports, visible from its shared object whatever its default visibility. */
#if defined(__GNUC__)
#define APE_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define APE_PLUGIN_EXPORT
#endif

/* The name of that symbol, for dlsym(). */
#define APE_BACKEND_PLUGIN_SYMBOL "ape_backend_plugin"

struct ape_backend_plugin;

/* What a plugin exports (its table, valid as long as the shared object is loaded; called once
 * per context that loads it, from the thread creating the context), and its type for a
 * loader's dlsym(). */
APE_PLUGIN_EXPORT const struct ape_backend_plugin *ape_backend_plugin(void);
typedef const struct ape_backend_plugin *(*ape_backend_plugin_fn)(void);

struct ape_backend; /* a backend as loaded in one context: the core's (ape_be_priv()) */
struct ape_be_buf; /* device memory: defined by each backend */
struct ape_be_queue; /* in-order command queue / stream: defined by each backend */
struct ape_be_event; /* a point in a queue: defined by each backend */

/*
 * Where one tensor of a launch lies in its buffer: the offset of element [0, 0, 0, 0] and the
 * strides of the B, H and L axes, all in elements of the tensor's type; the D axis is
 * contiguous (LSE has none). Strides may be 0 (a broadcast input) or describe any layout the
 * core validated: every element addressed lies inside the buffer; outputs do not overlap
 * themselves or an input.
 */
struct ape_be_view {
	int64_t off, sb, sh, sl;
};

enum ape_be_tensor { APE_BE_T_Q, APE_BE_T_K, APE_BE_T_V, APE_BE_T_O, APE_BE_T_LSE, APE_BE_T_COUNT };

/*
 * Keys and values read where a KV cache keeps them (runtime/api/kvcache.h): l->k and l->v are
 * pools of `nblocks` blocks, each [B, Hkv, block_tokens, D] contiguous, block p starting at
 * element p * B * Hkv * block_tokens * D of its pool (K and V pools alike). The launch's key j
 * (0 <= j < Lk) is token first_row + j counted from the start of physical block first_block,
 * the blocks following each other as a ring: logical block lb = (first_row + j) / block_tokens
 * is physical block (first_block + lb) mod nblocks, row (first_row + j) mod block_tokens.
 * Every block a launch addresses holds written keys; blocks outside its keys may hold anything
 * (released or not yet appended) and are never read.
 *
 * Where they lie is stated as data: key row r of physical block p, batch b and
 * kv head h starts at element off + p * s_block + b * s_b + h * s_h + r * s_row of its pool
 * (off: k_off for K, v_off for V; the D elements from there contiguous). The KV cache's ring of
 * blocks above sets s_block = B * Hkv * block_tokens * D, s_b = Hkv * block_tokens * D,
 * s_h = block_tokens * D, s_row = D; the KV pool's planes and a caller's pages in any layout
 * (runtime/api/kvpool.h) set theirs. With `table` (a device buffer of int64 block numbers,
 * written before the launch runs), logical block lb is physical block table[first_block + lb]
 * instead of the ring's (first_block + lb) mod nblocks (first_block is then an index into the
 * table); a table of blocks of one token may hold element offsets (s_block 1).
 */
struct ape_be_kv_pages {
	int64_t block_tokens, nblocks; /* >= 1 */
	int64_t first_block; /* 0 <= first_block < nblocks; with a table, an index into it */
	int64_t first_row; /* 0 <= first_row < block_tokens */
	int64_t k_off, v_off; /* elements */
	int64_t s_block, s_b, s_h, s_row; /* strides in elements */
	struct ape_be_buf *table; /* NULL: the ring */
};

/*
 * One segment of a ragged launch (struct ape_be_launch.segs): the launch's query rows
 * q0 .. q0 + lq - 1 against its key rows k0 .. k0 + lk - 1 only, query row q0 + i at position
 * q_start + i and key row k0 + j at k_start + j: a dense problem of its own inside the launch's
 * tensors (n = (q_start + i) - (k_start + j) in every formula, the causal rule n >= 0).
 */
struct ape_be_seg {
	int64_t q0, lq; /* lq >= 1 */
	int64_t k0, lk; /* lk >= 0: 0, the rows see no key */
	int64_t q_start, k_start; /* every pair's distance fits in int64 (the core checked) */
};

/*
 * The kernel paths a backend can take for a launch, for the call's statistics, its
 * APE_VERBOSE line and its trace (docs/profiling.md). ape_be_path_name() gives each one's name.
 */
enum ape_be_path {
	APE_BE_PATH_REFERENCE, /* the reference backend: plain C, double accumulation */
	APE_BE_PATH_GENERAL, /* the general fused kernel (any lambda, any layout) */
	APE_BE_PATH_POSITIONS, /* the general kernel reading explicit positions */
	APE_BE_PATH_RAGGED, /* the general kernel over a ragged launch's segment table */
	APE_BE_PATH_SEPARABLE, /* lambda = 0: scores as products plus a per-distance bias */
	APE_BE_PATH_SPLIT, /* heads of both kinds: runs of heads, each on its own path */
	APE_BE_PATH_DECODE, /* a few query rows: keys split across the device, merged by LSE */
	APE_BE_PATH_PAGES, /* the decode reading a KV cache's blocks in place */
	APE_BE_PATH_EMPTY, /* no key: O 0, LSE -inf written without a kernel */
	APE_BE_PATH_BACKWARD, /* the fused backward sweep */
	APE_BE_PATH_COUNT
};

/* The paths a call's launches took, summed: the core's (runtime/core/backend.h). Backends only
 * pass it on, to ape_be_path_note(). */
struct ape_be_path_log;

/* Notes that a launch took path p, and why ("lambda = 0 on every head"; a static string). For
 * backends, from attention and attention_backward: log is the launch's path member, and may be
 * NULL (nothing is noted). Never fails. */
APE_API void ape_be_path_note(struct ape_be_path_log *log, enum ape_be_path p, const char *why);

/* The name of path p ("separable"); "?" outside the enum. */
APE_API const char *ape_be_path_name(enum ape_be_path p);

/* One attention launch on device buffers. */
struct ape_be_launch {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype in_dtype; /* q, k, v */
	ape_dtype out_dtype; /* o: in_dtype or APE_F32 */
	struct ape_be_buf *q, *k, *v; /* [B,H,Lq,D], [B,Hkv,Lk,D], [B,Hkv,Lk,D] */
	struct ape_be_buf *o; /* [B,H,Lq,D] of out_dtype */
	struct ape_be_buf *lse; /* NULL, or [B,H,Lq] float */
	struct ape_be_buf *pairs; /* NULL, or [B,H,Lq] uint64: visible pairs whose score was computed */
	/*
	 * The diagnostics (APE-SPEC.md, "Attention entropy"; docs/diagnostics.md): each NULL, or
	 * [B,H,Lq] float, contiguous at offset 0 like pairs, for every row over this launch's keys:
	 * ent the entropy LSE - sum_j P_j s_j, md the mean distance sum_j P_j |n|, both computed
	 * in the same pass as O from running sums (ape_diag_*() in ape/ape_math.h), 0 for a row
	 * without a visible key, NaN for a NaN row. The core sets them only on a device whose
	 * capabilities say diag (struct ape_be_caps), both or neither, and then lse is not NULL
	 * either (the merge needs it); except on the device-resident call's launches, on a device
	 * that says diag_views: strided (diag_view), each optional, lse optional.
	 * Keys a launch skips change them within docs/diagnostics.md's bound (the core has
	 * already tightened skip_tol to APE_DIAG_SKIP_TOL for such launches).
	 */
	struct ape_be_buf *ent, *md;
	/*
	 * NULL, or [B,H,Lq] float: for each row, the LSE of keys this launch does not see, already
	 * computed by an earlier launch (the streaming executor passes the diagonal key chunk's).
	 * Read only by the far-key bound, as weight already found: with it, a row whose keys here
	 * are all provably negligible computes none of them. Backends may ignore it (then they
	 * compute at least one key tile per row, still exact). NaN or -inf: nothing known.
	 */
	struct ape_be_buf *lse_prior;
	double prior_tol; /* the whole-launch test with lse_prior: its own share of skip_tol */
	/* per head h: head_params[4h + 0..3] = delta, beta, gamma, lambda (host memory, read during
	 * the attention call only) */
	const float *head_params;
	bool decay_nonneg; /* every head has delta, beta, gamma >= 0: skipping is allowed */
	double scale; /* resolved: never "default" */
	double rope_base;
	double omega[128]; /* omega_p = rope_base^(-2p/D) / rope_scale for p < D/2, in float64 */
	bool causal;
	ape_rope_layout layout;
	int64_t q_start, k_start; /* resolved absolute positions of row 0 */
	double skip_tol; /* 0 when skipping is not allowed for this launch */
	/*
	 * false: q, k, v, o and lse are contiguous and start at offset 0 (view[] is ignored);
	 * true: each lies where view[APE_BE_T_*] says. pairs and lse_prior are always contiguous.
	 * Backends read it through ape_be_launch_view() only. A backward launch is strided only on
	 * a device whose capabilities say APE_BE_CAP_BWD_VIEWS (struct ape_be_bwd_launch).
	 */
	bool strided;
	struct ape_be_view view[APE_BE_T_COUNT];
	/*
	 * Where ent (diag_view[0]) and md (diag_view[1]) lie when strided, in floats (the
	 * LSE's shape, no D axis). Set by the core only on a device whose capabilities say
	 * diag_views, which then reads them through ape_be_launch_diag_view(); every other device
	 * gets ent and md contiguous at offset 0 (strided false, or none at all).
	 */
	struct ape_be_view diag_view[2];
	/*
	 * NULL: k and v are as above. Else k and v are a KV cache's block pools, addressed as
	 * struct ape_be_kv_pages says (view[APE_BE_T_K] and view[APE_BE_T_V] are then ignored). The core
	 * sets it only where attention_pages accepted the launch.
	 */
	const struct ape_be_kv_pages *pages;
	/*
	 * Each NULL, or the call's parameter table on the device, uploaded by the core once
	 * per call (per KV-cache attend) rather than by the backend once per launch: omega_p for
	 * p < D/2, then delta, beta, gamma, lambda per head ([4h + 0..3]), the same values as omega[]
	 * and head_params, in float64 (params[0]) and float32 (params[1]), contiguous at offset 0.
	 * A backend reads whichever it needs; without them (launches the core did not make so) it
	 * uploads head_params itself.
	 */
	struct ape_be_buf *params[2];
	/*
	 * NULL (nseg 0): the launch is one problem of B sequences as above. Else a ragged
	 * launch of many sequences, set by the core only on a device whose capabilities say
	 * segments: B = 1, and segs[0 .. nseg-1] (host memory, read during the call only)
	 * partition the query rows 0 .. Lq-1 in order (segs[0].q0 = 0, each next q0 the previous
	 * q0 + lq, the last ending at Lq), with 0 <= k0 and k0 + lk <= Lk. Each row sees its own
	 * segment's keys only, at its positions (struct ape_be_seg); q_start and k_start are unused.
	 * A row whose segment has no visible key gets O 0, LSE -inf, pairs 0, ent and md 0, as in
	 * any launch. Every output is indexed by the launch's rows, as in any launch. lse_prior and
	 * pages are NULL; strided, views, pairs, diagnostics and skipping as in any launch (the
	 * far-key bound is per segment: a segment's keys are the only keys its rows see). Only
	 * in what attention_scratch is asked: segs NULL and nseg -1, a ragged call's launch
	 * whose segments are not known yet.
	 */
	const struct ape_be_seg *segs;
	int64_t nseg;
	/*
	 * Both NULL: positions as above (q_start + i and k_start + j, or a segment's
	 * q_start and k_start). Else explicit positions, set by the core only on a device whose
	 * capabilities say positions, both together: pos_q[i] is the position of query row i
	 * (Lq entries) and pos_k[j] that of key row j (Lk entries), in every batch and head;
	 * host memory owned by the core, read during the call only (a backend that needs them on
	 * the device uploads them itself, and the upload is scratch of its own, counted by
	 * attention_scratch). Any int64 values, any order, gaps and repeats allowed; every pair's
	 * n = pos_q[i] - pos_k[j] a launch computes (its segment's, in a ragged launch) fits in
	 * int64 (the core checked), the causal rule n >= 0 (pos_k[j] <= pos_q[i]). q_start and
	 * k_start are then unused, and so are each segment's q_start and k_start: within a
	 * segment, rows and keys are the segment's, positions are per row and per key. Allowed
	 * with segs (a ragged batch whose sequences' positions are not runs) and without (B >= 1:
	 * one dense problem at arbitrary positions). lse_prior and pages are NULL; strided, views,
	 * pairs, diagnostics and skipping as in any launch, the far-key bound taken per key tile
	 * from the tile's smallest |n| (docs/kernels.md, "Ragged launches"): several keys may sit
	 * at one distance, so the bound counts every key, never one per distance. What holds after
	 * a failure is the rule at the top of this file: the outputs hold unspecified values.
	 */
	const int64_t *pos_q, *pos_k;
	/*
	 * NULL, or the core's record of the kernel paths taken: attention (and
	 * attention_backward, through f.path) notes each path it runs with ape_be_path_note(),
	 * once per kernel path per launch (a launch split into runs of heads notes the split and
	 * each run's path), so that a call can say which kernels computed it. Written from the
	 * thread calling the op only; never read by the backend.
	 */
	struct ape_be_path_log *path;
	/* ---- ABI 1.1 */
	/*
	 * NULL: no distance-bias table. Else the call's table (ape.h, ape_attn_desc.bias_table),
	 * set by the core only on a device whose capabilities say APE_BE_CAP_BIAS_TABLE: head h
	 * of this launch adds bias_table[h * bias_hstride + ape_be_bias_index(|n|, bias_len)] to
	 * every score after the temperature, beside the decay bias (bias_hstride 0: one row for
	 * every head; else bias_len, and ape_be_launch_heads() moves the pointer with the heads).
	 * bias_smax has the same layout and holds each entry's suffix maximum, max over m' >= m of
	 * the row's entries: the far-key bounds (forward and backward) add bias_smax at the tile's
	 * nearest distance to the score bound (ape_may_skip*() and ape_bwd_may_skip() in
	 * ape/ape_math.h take it through their crow or lse argument, lowered by it), so that
	 * skipping stays a proof whatever the table's shape. Host memory owned by the core, every
	 * value finite, read during the call only: a backend that needs it on the device uploads
	 * it itself (scratch of its own, counted by attention_scratch and
	 * attention_backward_scratch). The row frame c_row stays the decay bias at the anchor
	 * distance; the table enters each score in float32 (its values are float32).
	 */
	const float *bias_table, *bias_smax;
	int64_t bias_len; /* M >= 1 entries per row */
	int64_t bias_hstride; /* 0 or bias_len */
};

/* The entry of a distance-bias table of M entries that distance an = |n| >= 0 reads: the
 * distance itself, or the last entry for every distance past the table. */
static inline int64_t ape_be_bias_index(int64_t an, int64_t M)
{
	return an < M - 1 ? an : M - 1;
}

/* Head h's table entry at distance an = |n| of launch l (host code: the reference, a plugin's
 * host path), 0 without a table. ape_be_bias_smax_at(): its suffix maximum, the far-key
 * bounds' term. */
static inline float ape_be_bias_at(const struct ape_be_launch *l, int64_t h, int64_t an)
{
	return l->bias_table ? l->bias_table[h * l->bias_hstride + ape_be_bias_index(an, l->bias_len)]
			     : 0.0f;
}

static inline float ape_be_bias_smax_at(const struct ape_be_launch *l, int64_t h, int64_t an)
{
	return l->bias_table ? l->bias_smax[h * l->bias_hstride + ape_be_bias_index(an, l->bias_len)]
			     : 0.0f;
}

/* |a - b| of two positions, exact in 64 unsigned bits whatever their values. */
static inline uint64_t ape_be_pos_gap(int64_t a, int64_t b)
{
	return a >= b ? (uint64_t)a - (uint64_t)b : (uint64_t)b - (uint64_t)a;
}

/*
 * How many entries of each distance-bias table row launch l can read: ape_be_bias_index() of
 * its farthest |n|, plus one, at most bias_len (0 without a table). A backend that uploads the
 * table uploads these (a long table's tail, never read, stays on the host). The farthest |n|:
 * of the dense problem's or each segment's corner pairs, or with explicit positions of the
 * extreme positions (a bound: the farthest pair may be masked).
 */
static inline int64_t ape_be_bias_entries(const struct ape_be_launch *l)
{
	uint64_t far = 0, a, b;

	if (!l->bias_table)
		return 0;
	if (l->pos_q && l->Lq > 0 && l->Lk > 0) {
		int64_t qlo = INT64_MAX, qhi = INT64_MIN, klo = INT64_MAX, khi = INT64_MIN;

		for (int64_t i = 0; i < l->Lq; i++) {
			qlo = l->pos_q[i] < qlo ? l->pos_q[i] : qlo;
			qhi = l->pos_q[i] > qhi ? l->pos_q[i] : qhi;
		}
		for (int64_t j = 0; j < l->Lk; j++) {
			klo = l->pos_k[j] < klo ? l->pos_k[j] : klo;
			khi = l->pos_k[j] > khi ? l->pos_k[j] : khi;
		}
		a = ape_be_pos_gap(qhi, klo);
		b = ape_be_pos_gap(qlo, khi);
		far = a > b ? a : b;
	} else if (!l->pos_q) {
		for (int64_t s = 0; s < (l->segs ? l->nseg : 1); s++) {
			const int64_t lq = l->segs ? l->segs[s].lq : l->Lq;
			const int64_t lk = l->segs ? l->segs[s].lk : l->Lk;
			const int64_t q0 = l->segs ? l->segs[s].q_start : l->q_start;
			const int64_t k0 = l->segs ? l->segs[s].k_start : l->k_start;

			if (lq < 1 || lk < 1)
				continue;
			/* the last row against the first key, the first row against the last key
			 * (positions validated to fit) */
			a = ape_be_pos_gap(q0 + (lq - 1), k0);
			b = ape_be_pos_gap(q0, k0 + (lk - 1));
			far = a > far ? a : far;
			far = b > far ? b : far;
		}
	}
	return far < (uint64_t)(l->bias_len - 1) ? (int64_t)far + 1 : l->bias_len;
}

/* The segment of a ragged launch l that holds query row i (0 <= i < l->Lq): a binary search
 * over l->segs. */
static inline const struct ape_be_seg *ape_be_launch_seg_of(const struct ape_be_launch *l, int64_t i)
{
	int64_t lo = 0, hi = l->nseg - 1;

	while (lo < hi) {
		const int64_t mid = lo + (hi - lo + 1) / 2;

		if (l->segs[mid].q0 <= i)
			lo = mid;
		else
			hi = mid - 1;
	}
	return &l->segs[lo];
}

/* The view of tensor t (enum ape_be_tensor) of launch l: its own when l->strided, else the
 * contiguous one. */
static inline struct ape_be_view ape_be_launch_view(const struct ape_be_launch *l, int t)
{
	const bool kv = t == APE_BE_T_K || t == APE_BE_T_V;
	const int64_t heads = kv ? l->Hkv : l->H, rows = kv ? l->Lk : l->Lq;
	const int64_t d = t == APE_BE_T_LSE ? 1 : l->D;
	struct ape_be_view c = { 0, heads * rows * d, rows * d, d };

	return l->strided ? l->view[t] : c;
}

/* Where ent (which 0) or md (which 1) of launch l lies: diag_view[which] when l->strided,
 * else contiguous at offset 0. */
static inline struct ape_be_view ape_be_launch_diag_view(const struct ape_be_launch *l, int which)
{
	struct ape_be_view c = { 0, l->H * l->Lq, l->Lq, 1 };

	return l->strided ? l->diag_view[which] : c;
}

/* True when every query head of kv group g of l has lambda = 0: alpha = temp = 1, so the
 * rotation separates (the backends' separable paths, docs/kernels.md). */
static inline bool ape_be_launch_group_separable(const struct ape_be_launch *l, int64_t g)
{
	const int64_t G = l->H / l->Hkv;

	for (int64_t h = g * G; h < (g + 1) * G; h++)
		if (l->head_params[4 * h + 3] != 0)
			return false;
	return true;
}

/* The sub-launch of l's kv groups g0 .. g1-1 (their query and kv heads, parameters (host; no
 * device table), and every view moved along H; strided), for a backend that runs a launch's heads in pieces. pairs,
 * lse_prior, ent and md are contiguous [B, H, Lq]: a launch with any of them cannot be cut so. */
static inline struct ape_be_launch ape_be_launch_heads(const struct ape_be_launch *l, int64_t g0,
						   int64_t g1)
{
	const int64_t G = l->H / l->Hkv;
	struct ape_be_launch sub = *l;

	sub.H = (g1 - g0) * G;
	sub.Hkv = g1 - g0;
	sub.head_params = l->head_params + 4 * g0 * G;
	if (l->bias_table) { /* the heads' rows of a per-head table */
		sub.bias_table = l->bias_table + g0 * G * l->bias_hstride;
		sub.bias_smax = l->bias_smax + g0 * G * l->bias_hstride;
	}
	/* the call's table holds every head after omega: not this piece's alone, so the backend
	 * uploads the piece's own (mixed calls only) */
	sub.params[0] = sub.params[1] = NULL;
	sub.strided = true;
	for (int t = 0; t < APE_BE_T_COUNT; t++) {
		const bool kv = t == APE_BE_T_K || t == APE_BE_T_V;

		sub.view[t] = ape_be_launch_view(l, t);
		sub.view[t].off += (kv ? g0 : g0 * G) * sub.view[t].sh;
	}
	return sub;
}

/* True when l has both kv groups whose heads all have lambda = 0 and others. */
static inline bool ape_be_launch_mixes_separable(const struct ape_be_launch *l)
{
	bool any_sep = false, any_other = false;

	for (int64_t g = 0; g < l->Hkv; g++) {
		const bool s = ape_be_launch_group_separable(l, g);

		any_sep |= s;
		any_other |= !s;
	}
	return any_sep && any_other;
}

/* Why a launch takes a general kernel rather than the separable path, for ape_be_path_note(). */
static inline const char *ape_be_launch_general_why(const struct ape_be_launch *l)
{
	for (int64_t h = 0; h < l->H; h++)
		if (l->head_params[4 * h + 3] != 0)
			return "lambda != 0";
	return "lambda = 0, but the separable path does not take this shape or these outputs";
}

/* Runs l as one sub-launch (ape_be_launch_heads()) per run of consecutive kv groups of one kind:
 * run(q, sub, separable) in order; the first failure, or 0. */
static inline int ape_be_launch_split_runs(struct ape_be_queue *q, const struct ape_be_launch *l,
					 int (*run)(struct ape_be_queue *, const struct ape_be_launch *,
						    bool))
{
	int64_t g1;

	for (int64_t g0 = 0; g0 < l->Hkv; g0 = g1) {
		const bool s = ape_be_launch_group_separable(l, g0);
		struct ape_be_launch sub;
		int ret;

		for (g1 = g0 + 1; g1 < l->Hkv && ape_be_launch_group_separable(l, g1) == s; g1++)
			;
		sub = ape_be_launch_heads(l, g0, g1);
		ret = run(q, &sub, s);
		if (ret)
			return ret;
	}
	return 0;
}

/*
 * One backward launch (APE-SPEC.md, "Gradients") on device buffers, contiguous, at offset 0
 * (its inputs strided only on a device that says APE_BE_CAP_BWD_VIEWS: dout_view below).
 * `f` holds what the forward launch held: shapes, dtypes, q, k, v, o (of f.out_dtype), the
 * parameters and positions; f.lse is required: the rows' final LSE over every key of the row,
 * not only those of this launch, so that P_ij = exp(s_ij - LSE_i) holds whatever subset of
 * keys a launch sees. f.lse_prior is NULL; f.skip_tol is the launch's share of the backward
 * bound's tolerance (docs/kernels.md, "Skipping in the backward pass"; 0 where the decays do
 * not allow skipping); f.pairs, when set, gets each row's pairs computed; f.pos_q and f.pos_k
 * are NULL (the backward pass reads no explicit positions: the core cuts a ragged batch with
 * arbitrary positions into runs of consecutive positions).
 *
 * Ragged (ABI 1.2): f.segs NULL (f.nseg 0), or, only on a device whose capabilities say
 * APE_BE_CAP_BWD_SEGMENTS, a ragged launch as a forward one (struct ape_be_launch.segs: B = 1,
 * the segments partition the query rows in order, each row sees its own segment's keys at the
 * segment's positions, a segment with lk 0 adds nothing), whose segments' key ranges
 * [k0, k0 + lk) are moreover pairwise disjoint: a key belongs to one segment, so its dK and dV
 * come from that segment's rows only. The gradients accumulate as in any launch; dparams and
 * dbias sum over every segment. In what attention_backward_scratch is asked for a ragged call,
 * f.segs is NULL and f.nseg is the most segments one launch of the call may have (>= 1), so
 * that a backend can bound what depends on the segments (padding per segment, its tables).
 *
 * The gradient buffers are accumulators: the launch ADDS its contribution to what they hold,
 * so that an executor can zero them once and run a query chunk against several key chunks
 * (dq accumulates) or a key chunk against several query chunks (dk, dv accumulate), in a
 * fixed order. Dl_i = dO_i . O_i is computed by the launch from dout and o, which must hold
 * the whole rows (every key of the row), like lse.
 */
struct ape_be_bwd_launch {
	struct ape_be_launch f;
	ape_dtype dout_dtype; /* f.in_dtype or APE_F32 */
	struct ape_be_buf *dout; /* [B,H,Lq,D] of dout_dtype */
	struct ape_be_buf *dlse; /* NULL (dLSE = 0), or [B,H,Lq] float */
	struct ape_be_buf *dq; /* NULL: not wanted, or [B,H,Lq,D] float, accumulated */
	struct ape_be_buf *dk, *dv; /* each NULL or [B,Hkv,Lk,D] float, accumulated (GQA: summed
				   * over the query heads of each kv head) */
	struct ape_be_buf *dparams; /* NULL, or [H][4] double (delta, beta, gamma, lambda), summed
				   * over batch, rows and keys of the launch, accumulated */
	/* ---- ABI 1.1 */
	/*
	 * NULL, or (only with f.bias_table, on a device whose capabilities say
	 * APE_BE_CAP_BIAS_TABLE) the table's gradient: [Ht][f.bias_len] double, contiguous at
	 * offset 0, Ht = H for a per-head table (f.bias_hstride != 0) and 1 for a shared one;
	 * entry m of row h accumulates the sum of dS over every pair of head h (every head for a
	 * shared table) whose ape_be_bias_index(|n|, bias_len) is m, over batch, rows and keys of
	 * the launch, in a fixed order like dparams. Skipping as for dparams (a left-out key's
	 * pairs add nothing; the backward bound covers them, each pair weighing 1 <= max(1, |n|)).
	 */
	struct ape_be_buf *dbias;
	/* ---- ABI 1.3 */
	/*
	 * Only on a device whose capabilities say APE_BE_CAP_BWD_VIEWS, f.strided may be true:
	 * then q, k, v and o lie where f.view[] says (ape_be_launch_view()) and dout where
	 * dout_view says (in elements of dout_dtype; ape_be_bwd_dout_view()), read where they
	 * are (a host call's tensors on a device that reads host memory, never copied); lse, dlse,
	 * f.pairs and every gradient stay contiguous at offset 0 (f.view[APE_BE_T_LSE] is
	 * ignored). Every other device gets f.strided false: all five contiguous at offset 0.
	 */
	struct ape_be_view dout_view;
};

/* Where dout of backward launch l lies: dout_view when l->f.strided, else contiguous at
 * offset 0 ([B, H, Lq, D]). */
static inline struct ape_be_view ape_be_bwd_dout_view(const struct ape_be_bwd_launch *l)
{
	const struct ape_be_launch *f = &l->f;
	struct ape_be_view c = { 0, f->H * f->Lq * f->D, f->Lq * f->D, f->D };

	return f->strided ? l->dout_view : c;
}

/*
 * The parts of a backward launch that may be absent, one bit each: what attention_backward_scratch
 * is told instead of the buffers it does not see. A backend sizes its scratch from these bits,
 * never from the buffer pointers, so that the figure and the launch agree.
 */
enum ape_be_bwd_part {
	APE_BE_BWD_DQ = 1u << 0, /* l->dq wanted */
	APE_BE_BWD_DK = 1u << 1, /* l->dk wanted */
	APE_BE_BWD_DV = 1u << 2, /* l->dv wanted */
	APE_BE_BWD_DPARAMS = 1u << 3, /* l->dparams wanted */
	APE_BE_BWD_DLSE = 1u << 4, /* l->dlse given */
	APE_BE_BWD_PAIRS = 1u << 5, /* l->f.pairs given */
	APE_BE_BWD_DBIAS = 1u << 6, /* l->dbias wanted (ABI 1.1) */
};

/* The APE_BE_BWD_* bits of a launch with its buffers. */
static inline unsigned ape_be_bwd_parts(const struct ape_be_bwd_launch *l)
{
	return (l->dq ? (unsigned)APE_BE_BWD_DQ : 0u) | (l->dk ? (unsigned)APE_BE_BWD_DK : 0u) |
	       (l->dv ? (unsigned)APE_BE_BWD_DV : 0u) |
	       (l->dparams ? (unsigned)APE_BE_BWD_DPARAMS : 0u) |
	       (l->dlse ? (unsigned)APE_BE_BWD_DLSE : 0u) |
	       (l->f.pairs ? (unsigned)APE_BE_BWD_PAIRS : 0u) |
	       (l->dbias ? (unsigned)APE_BE_BWD_DBIAS : 0u);
}

/* Element types of copy_view: the storage types (ape_dtype values), and float64 (the backward
 * pass's parameter sums). */
enum ape_be_elem { APE_BE_E_F32 = APE_F32, APE_BE_E_F16 = APE_F16, APE_BE_E_BF16 = APE_BF16, APE_BE_E_F64 = 3 };

/*
 * One copy_view command: the [B, H, L, D] elements of src, where sv says (struct ape_be_view, in
 * src_type elements), into dst where dv says (in dst_type elements), D contiguous on both
 * sides. Either src_type == dst_type (a bit copy), or src_type is APE_BE_E_F32 and dst_type
 * APE_BE_E_F16 or APE_BE_E_BF16 (rounded to nearest even, as ape_convert() does on the host; a NaN
 * stays a NaN), or src_type is APE_BE_E_F64 and dst_type APE_BE_E_F32 (rounded to nearest even).
 * The core validated both views (every element inside its buffer; dst does not overlap itself
 * or src); sv's strides may be 0 (one source element for many destinations). head_D is the
 * head size of the call it serves, for a backend that picks programs by it.
 */
struct ape_be_copy {
	int64_t B, H, L, D;
	struct ape_be_buf *dst, *src;
	int dst_type, src_type; /* enum ape_be_elem */
	struct ape_be_view dv, sv;
	int64_t head_D;
};

/*
 * One attention_merge command: a launch's partial result (po, plse, ...) folded into
 * the running result of the same rows (o, lse, ...), both over disjoint sets of keys, by
 * their LSE (docs/ape.md, identity 4). `rows` rows (B * H * n, any order, the same in every
 * buffer), contiguous at offset 0: o and po float32 [rows, D], lse and plse float32 [rows],
 * ppairs uint64 [rows] and pairs uint64 [rows], or uint32 with pairs32 (the core asks for that
 * when every count fits: fewer bytes come back), ent, md, pent, pmd float32 [rows]. lse and o are required;
 * pairs, ent and md each NULL (not kept) or given with their partial. Per row, with L1 = lse,
 * L2 = plse:
 *   - either NaN or +inf: the row becomes NaN (o, lse, ent, md all NaN);
 *   - L2 = -inf (the partial saw no key): unchanged;
 *   - L1 = -inf (nothing merged yet): the partial is copied bit for bit;
 *   - else L = max(L1, L2) + log1p(exp(-|L1 - L2|)), w_i = exp(L_i - L): o = w1 o + w2 po,
 *     lse = L, md = w1 md + w2 pmd, ent = w1 (ent - ln w1) + w2 (pent - ln w2)
 *     (docs/diagnostics.md, the merge rule);
 *   - pairs += ppairs in every case.
 * Arithmetic in float32 or better; the result is within a few float32 roundings of the exact
 * merge. Ordered like every other command of q.
 */
struct ape_be_merge {
	int64_t rows, D;
	bool pairs32; /* pairs is uint32 */
	struct ape_be_buf *o, *lse, *pairs, *ent, *md;
	struct ape_be_buf *po, *plse, *ppairs, *pent, *pmd;
};

/* Result of probing a backend's driver. */
struct ape_be_probe_result {
	char reason[256]; /* when it adds no device: why ("libcuda.so.1 not found") */
};

/*
 * The ops of one backend, grouped by topic. "Required" ops must be set (the core refuses a
 * table without one); an optional op left NULL gets the core's fallback, stated with it; ops
 * of a group ("all or none") come together or not at all. Every op follows the failure rules
 * at the top of this file. The diagnostics have no op of their own: attention computes them,
 * where a device's capabilities say APE_BE_CAP_DIAG.
 */
struct ape_backend_plugin {
	/* What the table is: these four first, in this order, in every ABI. */
	uint32_t abi_major; /* APE_BACKEND_ABI_MAJOR of the header it was compiled against */
	uint32_t abi_minor; /* APE_BACKEND_ABI_MINOR likewise */
	size_t struct_size; /* sizeof(struct ape_backend_plugin) likewise */
	const char *name; /* "ref", "opencl", "cuda", a plugin's: [a-z0-9_], 1 to 15 chars */

	/* ---- Devices */

	/*
	 * Required. Loads the driver and adds every device it can drive with ape_be_device_add().
	 * Called once per context, before any other op, from the thread creating the context.
	 * Return 0 (with zero or more devices; when zero, say why in res->reason), or a negative
	 * code only for failures that must fail the whole context (APE_ENOMEM), with a message
	 * naming the backend. A missing driver is not a failure. May set ape_be_set_priv(); devices added
	 * before a failure are released as usual (device_release, then teardown).
	 */
	int (*probe)(struct ape_backend *be, struct ape_be_probe_result *res);

	/* Optional (NULL: nothing to release). Releases be->priv; called once, after every device
	 * of the backend was released, also when probe failed. */
	void (*teardown)(struct ape_backend *be);

	/* Optional (NULL: nothing to release). Releases a device's private state (dev->priv), once
	 * per device, after everything created on it was released. */
	void (*device_release)(struct ape_device *dev);

	/* Optional (NULL: both NULL). The native context and device behind dev, as
	 * ape_device_native() returns them. Cannot fail; may be called from any thread. */
	void (*native)(struct ape_device *dev, void **context, void **device);

	/* ---- Memory */

	/*
	 * Required. Device memory of `bytes` (> 0) bytes or more, for *out. Aligned to at least
	 * 8 bytes, enough for every element type a launch uses (the reference gives 8, OpenCL
	 * CL_DEVICE_MEM_BASE_ADDR_ALIGN, at least 128 bytes; CUDA cuMemAlloc's 256). Contents are
	 * undefined (no backend clears them): the core writes every byte before anything reads it.
	 * APE_ENOMEM when it does not fit (more than max_alloc, or than the device has left).
	 */
	int (*buf_alloc)(struct ape_device *dev, size_t bytes, struct ape_be_buf **out);

	/* Required. Accepts NULL. The buffer is idle: every queue that used it was synchronised. */
	void (*buf_free)(struct ape_device *dev, struct ape_be_buf *buf);

	/*
	 * Optional (NULL: the backend wraps nothing: every kind gets APE_ENOTSUP from the core).
	 * Wraps memory the caller owns, for *out, as a buffer every other op accepts:
	 *   APE_BE_MEM_HOST    `bytes` bytes at host address `handle`, only on devices whose
	 *                    capabilities say host_memory (the reference; OpenCL CPU devices,
	 *                    through CL_MEM_USE_HOST_PTR); other devices return APE_ENOTSUP;
	 *   APE_BE_MEM_OPENCL  the cl_mem `handle`, of the device's cl_context (else APE_EINVAL
	 *                    naming both contexts); `bytes` 0 means the object's size, else must
	 *                    not exceed it; the backend retains it;
	 *   APE_BE_MEM_CUDA    `bytes` bytes at the CUdeviceptr `(CUdeviceptr)(uintptr_t)handle`,
	 *                    which must lie inside one allocation of the device's primary
	 *                    context (else APE_EINVAL).
	 * A kind the backend does not drive: APE_ENOTSUP, naming the kind and the device. *bytes_out
	 * receives the buffer's usable size. buf_free on a wrapped buffer drops the backend's hold
	 * and never frees the caller's memory; unlike an allocated one it may be called while
	 * commands using it are in flight (they keep what they need alive, or the memory is the
	 * caller's to keep alive until its queue is synchronised).
	 */
	int (*buf_wrap)(struct ape_device *dev, int kind, void *handle, size_t bytes,
			struct ape_be_buf **out, size_t *bytes_out);

	/*
	 * Optional (NULL: host memory is used as it is). Pins `bytes` at `ptr`, page-aligned host
	 * memory the core placed on the device's NUMA node (runtime/topo/placement.c), so that copies
	 * from and to it run at full speed (cuMemHostRegister, for instance). Sets *handle to
	 * whatever host_unregister needs. A backend may decline (APE_ENOTSUP) where pinning does
	 * not pay; any failure only costs speed: the core uses the memory unpinned. May be called
	 * from several threads at once.
	 */
	int (*host_register)(struct ape_device *dev, void *ptr, size_t bytes, void **handle);

	/* Optional, required with host_register. Undoes it; the memory is idle (no copy in flight). */
	void (*host_unregister)(struct ape_device *dev, void *handle);

	/* ---- Queues, copies and events */

	/* Required. An in-order queue with timing enabled, for *out. */
	int (*queue_create)(struct ape_device *dev, struct ape_be_queue **out);

	/* Required. Accepts NULL. Waits for outstanding work first, ignoring its failures. Events
	 * recorded on q may outlive it (and are destroyed later). */
	void (*queue_destroy)(struct ape_be_queue *q);

	/*
	 * Optional (NULL: APE_ENOTSUP). Wraps the caller's in-order queue for *out: a
	 * cl_command_queue of the device's context and device (else APE_EINVAL; an out-of-order
	 * queue: APE_EINVAL), retained; a CUstream of the device's primary context (NULL: the
	 * legacy default stream). Timing may be unavailable on it (event_elapsed may fail with
	 * APE_ENOTSUP). queue_destroy on a wrapped queue drops the hold without waiting: the
	 * caller's work and libape's stay ordered on it; scratch memory libape enqueued work with
	 * stays alive until that work completes.
	 */
	int (*queue_wrap)(struct ape_device *dev, void *handle, struct ape_be_queue **out);

	/* Required. Waits until everything enqueued on q has completed; reports asynchronous
	 * failures (a kernel that faulted, a device lost). Whether it fails or not, nothing
	 * enqueued on q is still running when it returns: the core frees the buffers next. */
	int (*synchronize)(struct ape_be_queue *q);

	/* Required. Asynchronous copies, n > 0 bytes, inside the buffer; see the ordering model. */
	int (*copy_h2d)(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off, const void *src,
			size_t n);

	int (*copy_d2h)(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t src_off,
			size_t n);

	/*
	 * Optional (NULL: the core bounces through host staging, d2h then h2d on the same queue).
	 * Asynchronous device-to-device copy of n > 0 bytes within or between buffers of one
	 * device; the ranges do not overlap. Ordered like every other command of q. Used by the KV
	 * cache to gather its blocks into one contiguous key chunk.
	 */
	int (*copy_d2d)(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
			struct ape_be_buf *src, size_t src_off, size_t n);

	/* Required. Fills n bytes with a repeated 4-byte pattern (dst_off and n multiples of 4). */
	int (*fill)(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off, uint32_t pattern,
		    size_t n);

	/* Required. Records an event at the current end of q, for *out. */
	int (*event_record)(struct ape_be_queue *q, struct ape_be_event **out);

	/* Required. Makes later work on q wait for e (which may belong to another queue of the
	 * same device). */
	int (*event_wait)(struct ape_be_queue *q, struct ape_be_event *e);

	/* Required. Milliseconds of device time between two completed events of one queue, in
	 * *ms (>= 0). */
	int (*event_elapsed)(struct ape_be_event *start, struct ape_be_event *end, double *ms);

	/*
	 * Optional; needed by a device whose capabilities say timestamps (without that
	 * capability the core uses the host's clock, so traces show enqueue times, and it reports
	 * no copy/compute overlap). The device time, in milliseconds, of the point e
	 * stands for, in *ms: when everything enqueued on its queue before e had completed (the
	 * end of a marker). All queues of one device must share the clock, so that times of
	 * events on different queues compare; its origin is arbitrary. e has completed (its queue
	 * was synchronised past it).
	 */
	int (*event_timestamp)(struct ape_be_event *e, double *ms);

	/* Required. Accepts NULL. */
	void (*event_destroy)(struct ape_be_event *e);

	/* ---- Attention */

	/*
	 * Required. Enqueues the attention kernel(s) for one launch. Must write every element of
	 * l->o (and l->lse, l->pairs when not NULL) for every row, including rows with no visible
	 * key (O = 0, LSE = -inf). May skip keys only as the spec's bound allows and only when
	 * l->skip_tol > 0. Scratch memory it allocates is its own, held no longer than the launch
	 * (see attention_scratch); l->head_params is read during the call only.
	 */
	int (*attention)(struct ape_be_queue *q, const struct ape_be_launch *l);

	/*
	 * Optional (NULL: the core assumes float32 copies of K and V plus skip tables, see
	 * ape__scratch_of() in runtime/exec/launch.c). Bytes of device memory the attention op
	 * allocates for launch l beyond l's own buffers, held from the attention call until the
	 * launch completes. The core counts them against the memory budget of streamed calls.
	 * Called without the buffers: only the shape, dtypes, layout and skip_tol of l count, and
	 * whether the launch is ragged: l->segs is NULL here, and l->nseg -1 for the launches of
	 * a ragged call (their segments are not known yet: at most one per query row), else 0.
	 * Cannot fail; may be called from any thread.
	 */
	uint64_t (*attention_scratch)(struct ape_device *dev, const struct ape_be_launch *l);

	/*
	 * Optional (NULL: the core copies every launch's partial O and LSE back and merges them on
	 * the host, as exec/lse_merge.c does). Enqueues the merge m (struct ape_be_merge above) on
	 * q, so that a streamed call keeps each query chunk's running result on the device and
	 * reads it back once. Fails by the rules at the top of this file
	 * (ape__op_error(ret, dev, "attention_merge")); the accumulators then hold unspecified
	 * values.
	 */
	int (*attention_merge)(struct ape_be_queue *q, const struct ape_be_merge *m);

	/* ---- Backward */

	/*
	 * Optional; needed by a device whose capabilities say backward (without that capability
	 * ape_attention_backward() on the device fails with APE_ENOTSUP naming it; the core never
	 * falls back to another backend). Enqueues
	 * the gradients of one launch (struct ape_be_bwd_launch above; its inputs read where
	 * l->f.strided and its views say, on a device that states bwd_views, else contiguous at
	 * offset 0): for every row with a visible
	 * key among the launch's keys, ADDS to l->dq, l->dk, l->dv and l->dparams (each that is
	 * not NULL; work for a NULL one is not done) this launch's contribution, the exact
	 * derivatives of the spec, path through alpha included; rows without a visible key add
	 * nothing. Touches no other byte of those buffers and writes no input. Reductions run in
	 * a fixed order (no floating-point atomics), so two runs are bit-identical; dparams sums
	 * are reduced in float64. Skipping: with l->f.skip_tol > 0 (the core passes it only when
	 * every head's delta, beta, gamma >= 0, as l->f.decay_nonneg says) a backend may leave a
	 * key out of a row only where the backward bound of docs/kernels.md ("Skipping in the
	 * backward pass", ape_bwd_may_skip() in ape/ape_math.h) proves that the row's left-out
	 * keys, each weighed by max(1, |n|), hold at most skip_tol / (1 + skip_tol) of its
	 * weight; it may also skip nothing (the reference and CUDA do). l->f.pairs, when not NULL,
	 * comes in holding each row's visible keys of the launch; a backend that skips writes
	 * there the visible pairs it computed per row, one that does not may leave it as it is.
	 * With skip_tol = 0 nothing is skipped. Device memory it allocates beyond l's buffers
	 * (scratch) is its own, held no longer than the launch, and at most what
	 * attention_backward_scratch declares for l; without that op it allocates none.
	 * Inputs are not
	 * scanned: NaN or Inf reach the gradients they touch. Fails by the rules at the top of this
	 * file; the accumulators then hold
	 * unspecified values (the core discards them and writes nothing to the caller).
	 */
	int (*attention_backward)(struct ape_be_queue *q, const struct ape_be_bwd_launch *l);

	/*
	 * Optional (NULL: attention_backward allocates no device memory beyond its launch's
	 * buffers; the core counts none). Bytes of device memory attention_backward allocates for
	 * launch l beyond l's own buffers, held from the call until the launch completes: at least
	 * what it allocates, from the same sizing as the allocation. The core counts them against
	 * the memory budget of streamed backward calls (runtime/exec/backward.c) and in their peak.
	 * Called before the buffers exist (the plan asks for chunk sizes it may not use): the op
	 * reads none of l's buffer pointers (they may be NULL); `parts` (APE_BE_BWD_* bits,
	 * ape_be_bwd_parts() of the launch to come) says which outputs are wanted and which optional
	 * inputs are given; only those, the shape, dtypes, layout and skip_tol of l count. The
	 * figure must not decrease when l->f.Lq or l->f.Lk grow (the core sizes a plan by its
	 * largest launch). Cannot fail; may be called from any thread.
	 */
	uint64_t (*attention_backward_scratch)(struct ape_device *dev,
					       const struct ape_be_bwd_launch *l, unsigned parts);

	/* ---- The caller's device memory: the backward pass on device tensors
	 * (ape_attention_backward_enqueue(), runtime/exec/resident_bwd.c). All three or none; a
	 * device whose capabilities say APE_BE_CAP_RESIDENT_BACKWARD needs them. */

	/*
	 * Optional. Device memory of `bytes` (> 0) bytes for *out, for commands enqueued on q from
	 * now on: as buf_alloc's (alignment, undefined contents), but ordered on q (a stream-ordered
	 * allocation where the device has one), so that the core never waits for it. Every op takes
	 * it as a buffer. Released only by scratch_free on the same q.
	 */
	int (*scratch_alloc)(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out);

	/*
	 * Optional, required with scratch_alloc. Releases buf (NULL: nothing) after every command
	 * enqueued on q so far, without waiting for them where the device allows it (OpenCL: the
	 * commands keep the memory alive; CUDA with memory pools: cuMemFreeAsync; without pools it
	 * waits for the stream, on a wrapped one the caller's earlier work too). The struct is
	 * freed whatever happens; a failure (a device lost) is reported as usual.
	 */
	int (*scratch_free)(struct ape_be_queue *q, struct ape_be_buf *buf);

	/*
	 * Optional, required with scratch_alloc. Enqueues the copy c (struct ape_be_copy above) on q,
	 * converting each element as stated there; touches no other byte of c->dst. Fails by the
	 * rules at the top of this file.
	 */
	int (*copy_view)(struct ape_be_queue *q, const struct ape_be_copy *c);

	/* ---- KV pages (decode in place) */

	/*
	 * Optional (NULL: the core never passes l->pages; a KV cache then gathers its blocks into
	 * contiguous key chunks with copy_d2d, or through host staging, before each launch: the
	 * reference does that). Whether attention takes launch l with l->pages set
	 * (struct ape_be_kv_pages): true only when it will read K and V in place and compute what it
	 * computes for the same keys gathered, bit for bit. false costs nothing but the gather:
	 * the core then gathers and launches without pages. Reads only l's shape, dtypes, options,
	 * positions, parameters and whether l->ent and l->md are set, never its buffers (the core
	 * may ask with them NULL, to size its key chunks). Cannot fail, sets no error; may be
	 * called from any thread. (OpenCL CPU devices: the decode of ocl_decode.c, a few query
	 * rows; CUDA: its decode, dense launches of at most 16 rows and ragged ones of at most 16
	 * a segment, and its prefill, dense launches of more rows that its separable path would
	 * not take, cuda_attention.c.)
	 */
	bool (*attention_pages)(struct ape_device *dev, const struct ape_be_launch *l);

	/* ---- Extras by name */

	/*
	 * Optional (NULL: none). The op or extra called `name` ("attention_merge", say), or NULL.
	 * The core asks it for every op of this header that lies beyond the table's struct_size (a
	 * plugin of an older minor that still provides a newer op), and for extras that belong to
	 * no table. Cannot fail; may be called from any thread, also before probe.
	 */
	void *(*proc_address)(const char *name);
};

/* The four members every table begins with, for this header's ABI: in a designated initialiser
 * (C, or C++20), `APE_BACKEND_PLUGIN_HEAD("example"), .probe = ..., ...`. */
#define APE_BACKEND_PLUGIN_HEAD(backend_name)                                                 \
	.abi_major = APE_BACKEND_ABI_MAJOR, .abi_minor = APE_BACKEND_ABI_MINOR,                \
	.struct_size = sizeof(struct ape_backend_plugin), .name = (backend_name)

/* Kinds of memory buf_wrap takes. */
enum ape_be_mem_kind { APE_BE_MEM_HOST = 1, APE_BE_MEM_OPENCL = 2, APE_BE_MEM_CUDA = 3 };

/*
 * What one device can do, stated by its backend when it adds the device (ape_be_device_add()),
 * read-only afterwards: one set of APE_BE_CAP_* bits and the device's allocation limit. The
 * core decides from these, never by calling an op to see whether it fails. A capability needs
 * the ops it names: after probe, the core refuses a backend whose device claims one without
 * them. A capability left out costs a feature (the call that needs it fails with APE_ENOTSUP
 * naming the device) or speed, never correctness. Bits this library does not know are refused.
 */
enum ape_be_cap {
	/* buf_wrap takes APE_BE_MEM_HOST and the kernels read host memory in place (the reference,
	 * OpenCL CPU devices): host calls compute on the caller's arrays, nothing staged or
	 * copied. Needs buf_wrap. */
	APE_BE_CAP_HOST_MEMORY = 1u << 0,
	/* attention writes l->ent and l->md when they are set (struct ape_be_launch): the
	 * diagnostics (ape_attention_forward_diag(), ape_kv_cache_attend_diag()). */
	APE_BE_CAP_DIAG = 1u << 1,
	/* (only with DIAG) attention also takes the device-resident call's launches with the
	 * diagnostics (ape_attention_enqueue_diag()): strided, ent and md where l->diag_view says
	 * (ape_be_launch_diag_view()), either one NULL without the other, lse possibly NULL (each
	 * such launch sees every key of its rows: nothing is merged). */
	APE_BE_CAP_DIAG_VIEWS = 1u << 2,
	/* the backward pass (ape_attention_backward()). Needs attention_backward. */
	APE_BE_CAP_BACKWARD = 1u << 3,
	/* (only with BACKWARD) the backward pass on device tensors
	 * (ape_attention_backward_enqueue()). Needs scratch_alloc, scratch_free and copy_view. */
	APE_BE_CAP_RESIDENT_BACKWARD = 1u << 4,
	/* event_timestamp gives device times: traces on the device's clock, copy/compute overlap
	 * measured. Needs event_timestamp (which may still fail with APE_ENOTSUP on a queue
	 * without timing, a wrapped one). */
	APE_BE_CAP_TIMESTAMPS = 1u << 5,
	/* attention takes ragged launches (struct ape_be_launch.segs): a batch of many sequences
	 * in one launch. Without it the core runs ragged batches as one launch per sequence. */
	APE_BE_CAP_SEGMENTS = 1u << 6,
	/* (only with SEGMENTS) attention reads explicit positions (struct ape_be_launch.pos_q and
	 * .pos_k): a ragged batch with arbitrary positions (gaps, repeats, any order) runs as one
	 * launch. Without it the core cuts such a batch into runs of consecutive positions and
	 * runs each query run against each key run it sees, merged (api/varlen.c). */
	APE_BE_CAP_POSITIONS = 1u << 7,
	/* (ABI 1.1) attention, and attention_backward where the device says BACKWARD, take a
	 * distance-bias table (struct ape_be_launch.bias_table; the backward also its gradient,
	 * struct ape_be_bwd_launch.dbias) on every launch kind the device takes. Without it, a
	 * call with a table fails with APE_ENOTSUP naming the device. */
	APE_BE_CAP_BIAS_TABLE = 1u << 8,
	/* (ABI 1.2; only with BACKWARD and SEGMENTS) attention_backward takes ragged launches
	 * (struct ape_be_bwd_launch, "Ragged"): the gradients of a batch of many sequences in one
	 * launch. Without it the core runs a ragged batch's backward as one launch per sequence
	 * (and per run of consecutive positions). */
	APE_BE_CAP_BWD_SEGMENTS = 1u << 9,
	/* (ABI 1.3; only with BACKWARD) attention_backward reads q, k, v, o and dout as strided
	 * views (struct ape_be_bwd_launch, dout_view): on a device that also says HOST_MEMORY, a
	 * host call's backward reads the caller's tensors where they lie. Without it the core
	 * copies them into contiguous chunk buffers for every launch. */
	APE_BE_CAP_BWD_VIEWS = 1u << 10,
};

/* Every APE_BE_CAP_* bit of this ABI. */
#define APE_BE_CAP_ALL ((uint64_t)0x7ff)

struct ape_be_caps {
	uint64_t features; /* APE_BE_CAP_* bits */
	/* The largest single buf_alloc the device accepts (CL_DEVICE_MAX_MEM_ALLOC_SIZE); the
	 * planner keeps every chunk below it. UINT64_MAX: no limit but the device's memory (0
	 * given to ape_be_device_add() means that too). */
	uint64_t max_alloc;
};

/* The name of capability bit `bit` ("host_memory", "diag", "diag_views", "backward",
 * "resident_backward", "timestamps", "segments", "positions", "bias_table", "bwd_segments"), or
 * NULL for anything else (0, a
 * bit this library does not know, several bits). What ape-info prints; ape_device_capabilities()
 * (ape.h) gives a device's bits. */
APE_API const char *ape_be_cap_name(uint64_t bit);

/* Whether caps says every bit of `bits`. */
static inline bool ape_be_caps_have(const struct ape_be_caps *caps, uint64_t bits)
{
	return (caps->features & bits) == bits;
}

/*
 * A device as backends see it: the public handle (ape_device) is this struct, inside a larger
 * one of the core's own (runtime/core/context.c), which backends never see. The core creates it
 * in ape_be_device_add() and frees it after device_release. (struct ape_device_info's layout,
 * from ape.h, is part of this ABI.)
 */
struct ape_device {
	struct ape_backend *be; /* the backend it belongs to (ape_be_priv(be): the backend's state) */
	void *priv; /* the backend's own state, released by device_release */
	struct ape_be_caps caps; /* as the backend stated them; read-only once added */
	struct ape_device_info info; /* read-only once the context is created */
};

/* Whether device dev says every bit of `bits` (APE_BE_CAP_*). */
static inline bool ape_be_dev_has(const struct ape_device *dev, uint64_t bits)
{
	return ape_be_caps_have(&dev->caps, bits);
}

/* The device of queue q or of event e: the first member of every backend's struct ape_be_queue
 * and struct ape_be_event (see "Objects" at the top of this file). */
static inline struct ape_device *ape_be_queue_dev(const struct ape_be_queue *q)
{
	return *(struct ape_device *const *)(const void *)q;
}

static inline struct ape_device *ape_be_event_dev(const struct ape_be_event *e)
{
	return *(struct ape_device *const *)(const void *)e;
}

/*
 * Device ranks: "auto" chooses the device of highest rank (ties: probe order, which is the
 * order of the registry: built-in backends in the order the build lists them, then plugins). Each backend states its ranks in its own files, in the
 * range of what it drives, so that the preference stays CUDA > OpenCL GPU > OpenCL
 * accelerator > OpenCL CPU > reference:
 *   [300, 400)  GPUs through their vendor's own API (cuda: 300)
 *   [200, 300)  GPUs through a portable API (opencl GPU: 200)
 *   [100, 200)  CPUs and accelerators through a portable API (opencl accelerator: 150,
 *               CPU: 100)
 *   [0, 100)    the host without a driver (ref: 0)
 * A plugin states its own, in the range of what it drives.
 */

/* ---- Services of libape to its backends (exported by libape.so: a plugin links -lape) */

/*
 * Adds a device to the context during probe, with what it can do (struct ape_be_caps) and its
 * rank (above). `info` needs name, vendor, kind, compute_units, global_mem_bytes,
 * driver_version and pci_address; the core fills backend and the indices. Returns 0, or
 * APE_ENOMEM with the message set (then priv is still the caller's to free); APE_EINVAL (the
 * backend refused, message set) when caps has bits this library does not know.
 */
APE_API int ape_be_device_add(struct ape_backend *be, const struct ape_device_info *info,
			      const struct ape_be_caps *caps, int rank, void *priv);

/* The backend's own state (NULL until set), and setting it (probe sets it; teardown releases
 * it). Never fail. */
APE_API void *ape_be_priv(const struct ape_backend *be);
APE_API void ape_be_set_priv(struct ape_backend *be, void *priv);

/* The caller's own native context and device to build a device on
 * (ape_context_options.opencl_context and .opencl_device, for the OpenCL backend), each NULL
 * when not given: read by probe. Never fails. */
APE_API void ape_be_import(const struct ape_backend *be, void **context, void **device);

/* Records the thread's error message (what ape_last_error() returns) and returns err: how an op
 * says what failed below it (see "Failure" at the top of this file). */
APE_API int ape_be_error(int err, const char *fmt, ...)
#if defined(__GNUC__)
	__attribute__((format(printf, 2, 3)))
#endif
	;

/* A one-time warning to stderr, prefixed "libape: " (the caller keeps the once-flag). */
APE_API void ape_be_warn(const char *fmt, ...)
#if defined(__GNUC__)
	__attribute__((format(printf, 1, 2)))
#endif
	;

/*
 * Host memory for a backend's own objects, as malloc(), calloc(), realloc() and
 * posix_memalign() (free it with free() or ape_be_free()): counted by libape's fault injection
 * (builds with -DAPE_FAULT_INJECT fail the n-th allocation), so that `make faults-ci` reaches a
 * backend's failure paths too.
 */
APE_API void *ape_be_malloc(size_t n);
APE_API void *ape_be_calloc(size_t n, size_t size);
APE_API void *ape_be_realloc(void *p, size_t n);
APE_API int ape_be_posix_memalign(void **p, size_t align, size_t n);
APE_API void ape_be_free(void *p);

/* The 16-bit storage types (APE_F16, APE_BF16) and float32, as every backend converts them:
 * rounded to nearest even, NaN kept a NaN, as ape_convert() does. */
APE_API float ape_be_f16_to_f32(uint16_t h);
APE_API uint16_t ape_be_f32_to_f16(float f);
APE_API float ape_be_bf16_to_f32(uint16_t b);
APE_API uint16_t ape_be_f32_to_bf16(float f);

/* CLOCK_MONOTONIC in milliseconds (event times of a backend without device timestamps). */
APE_API double ape_be_now_ms(void);

/*
 * The compiled-program cache (docs/cache.md: a folder of the user's, APE_NO_CACHE=1 disables
 * it), for a backend whose kernels are compiled at run time: entries keyed by a string the
 * backend builds from everything the binary depends on (device, driver, sources, options;
 * ape_be_hash64() hashes them: FNV-1a 64 of n bytes continuing from h, starting from
 * APE_BE_HASH64_INIT). ape_be_cache_load() returns APE_BE_CACHE_HIT with *blob (free it) and
 * *len set, APE_BE_CACHE_MISS, or APE_BE_CACHE_REJECTED (an entry was there but corrupt or not
 * trusted: rebuild and store again); *blob NULL otherwise. ape_be_cache_store() returns 0 or
 * why nothing was written (nonzero); ape_be_cache_usable() whether a store may succeed (check
 * it before expensive work only a store needs); ape_be_cache_touch() marks an entry used now,
 * ape_be_cache_used() tells when it last was (false: no entry). All best effort and thread-safe.
 */
#define APE_BE_HASH64_INIT 0xcbf29ce484222325ull
enum { APE_BE_CACHE_HIT = 0, APE_BE_CACHE_MISS = 1, APE_BE_CACHE_REJECTED = 2 };
struct timespec;
APE_API uint64_t ape_be_hash64(const void *p, size_t n, uint64_t h);
APE_API int ape_be_cache_load(const char *key, void **blob, size_t *len);
APE_API int ape_be_cache_store(const char *key, const void *blob, size_t len);
APE_API bool ape_be_cache_usable(void);
APE_API void ape_be_cache_touch(const char *key);
APE_API bool ape_be_cache_used(const char *key, struct timespec *when);

#ifdef __cplusplus
}
#endif
#endif /* APE_BACKEND_H */
