/* SPDX-License-Identifier: MIT */
/* The public buffer and queue objects (runtime/api/resident.c), and what the DLPack call and
 * the host path share with ape_attention_enqueue(). */
#ifndef APE_RUNTIME_API_RESIDENT_H
#define APE_RUNTIME_API_RESIDENT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

struct ape_buffer {
	struct ape_device *dev;
	struct ape__buf *b;
	size_t size; /* bytes every access is checked against */
	bool wrapped; /* the caller's memory: never freed by libape */
};

struct ape_queue {
	struct ape_device *dev;
	struct ape__queue *q;
	bool wrapped; /* the caller's queue: never destroyed or waited for by libape */
	uint64_t calls; /* calls that enqueued work, numbered from 1 */
	char last_call[64]; /* "ape_attention_enqueue #3": named when a synchronisation fails */
};

/* A wrapper of the caller's memory (enum ape__mem_kind) as a public buffer; messages start with
 * fn. dev is not NULL. */
int ape__buffer_wrap(const char *fn, ape_device *dev, int kind, void *handle, size_t bytes,
		     ape_buffer **out);
/* A wrapper of the caller's queue; `api` is the backend that must drive dev ("opencl",
 * "cuda"), else APE_ENOTSUP. */
int ape__queue_wrap(const char *fn, ape_device *dev, const char *api, void *handle,
		    ape_queue **out);

/* One device tensor of dev: of `dtype`, shaped `want` (-1: any; dims name them), D contiguous,
 * inside its buffer; its element view in *v. */
int ape__check_dtensor(const char *fn, const char *name, const ape_dtensor *t,
		       const ape_device *dev, ape_dtype dtype, const int64_t want[4],
		       const char *const dims[4], struct ape__view *v);

/*
 * Validates a forward call on device tensors (lse may be NULL) for dev: the host call's rules
 * (api/validate.h) plus every buffer dev's, offsets multiples of the element size, D
 * contiguous, every addressed element inside its buffer. Fills *p (release with
 * ape__problem_fini()), the backend buffers and the element views. Messages start with fn.
 */
int ape__check_resident(const char *fn, const ape_device *dev, const ape_attn_desc *desc,
			const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
			const ape_dtensor *o, const ape_dtensor *lse, struct ape__problem *p,
			struct ape__buf *buf[APE__T_COUNT], struct ape__view view[APE__T_COUNT]);

/* ape_attention_enqueue() with its messages starting with fn (the DLPack call's). */
int ape__attention_enqueue(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
			   const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
			   const ape_dtensor *o, const ape_dtensor *lse);

/* ape__check_resident() plus the diagnostics' outputs ent and md (each NULL, or [B,H,Lq,1]
 * float32 like lse: in their buffers, of dev, sharing no byte with q, k, v, o, lse or each
 * other); their backend buffers and element views in dbuf and dview (NULL and zero when not
 * wanted). Messages start with fn and name them "entropy" and "mean_distance". */
int ape__check_resident_diag(const char *fn, const ape_device *dev, const ape_attn_desc *desc,
			     const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
			     const ape_dtensor *o, const ape_dtensor *lse, const ape_dtensor *ent,
			     const ape_dtensor *md, struct ape__problem *p,
			     struct ape__buf *buf[APE__T_COUNT], struct ape__view view[APE__T_COUNT],
			     struct ape__buf *dbuf[2], struct ape__view dview[2]);

/* ape_attention_enqueue_diag() with its messages starting with fn (the DLPack call's). */
int ape__attention_enqueue_diag(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
				const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
				const ape_dtensor *o, const ape_dtensor *lse,
				const ape_dtensor *ent, const ape_dtensor *md);

#pragma GCC visibility pop
#endif
