/* SPDX-License-Identifier: MIT */
/* The public buffer and queue objects (runtime/api/resident.c), and what the DLPack call and
 * the host path share with ape_attention_enqueue(). */
#ifndef APE_RUNTIME_API_RESIDENT_H
#define APE_RUNTIME_API_RESIDENT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"
#include "exec/problem.h"
#include "exec/resident_bwd.h"

#pragma GCC visibility push(hidden)

struct ape_buffer {
	struct ape_device *dev;
	struct ape_be_buf *b;
	size_t size; /* bytes every access is checked against */
	bool wrapped; /* the caller's memory: never freed by libape */
};

struct ape_queue {
	struct ape_device *dev;
	struct ape_be_queue *q;
	bool wrapped; /* the caller's queue: never destroyed or waited for by libape */
	uint64_t calls; /* calls that enqueued work, numbered from 1 */
	char last_call[64]; /* "ape_attention_enqueue #3": named when a synchronisation fails */
};

/* Counts a call that enqueues work on queue, for the message of a failed synchronisation
 * ("<fn> #3"). */
void ape__queue_note_call(ape_queue *queue, const char *fn);

/* A wrapper of the caller's memory (enum ape_be_mem_kind) as a public buffer; messages start with
 * fn. dev is not NULL. */
int ape__buffer_wrap(const char *fn, ape_device *dev, int kind, void *handle, size_t bytes,
		     ape_buffer **out);
/* A wrapper of the caller's queue; `api` is the backend that must drive dev ("opencl",
 * "cuda"), else APE_ENOTSUP. */
int ape__queue_wrap(const char *fn, ape_device *dev, const char *api, void *handle,
		    ape_queue **out);

/*
 * What the host rules need of device tensor t (not NULL) of a call on dev: its buffer is dev's,
 * its type a storage type, its offset a multiple of the element size inside the buffer, D
 * contiguous; then *host is t at a synthetic address (each buffer of the call 2^44 bytes of its
 * own: bufs lists the call's buffers, t's among them, the first occurrence naming the slot),
 * so that api/validate.h's overlap rules apply within a buffer and never across two.
 */
int ape__dtensor_host(const char *fn, const char *name, const ape_dtensor *t,
		      const ape_device *dev, const ape_buffer *const *bufs, ape_tensor *host);
/* The element view of t once the host rules resolved its strides s; APE_EINVAL when an
 * addressed element lies beyond its buffer. */
int ape__dtensor_view(const char *fn, const char *name, const ape_dtensor *t, const int64_t s[4],
		      struct ape_be_view *v);

/* One device tensor of dev: of `dtype`, shaped `want` (-1: any; dims name them), D contiguous,
 * inside its buffer; its element view in *v. */
int ape__check_dtensor(const char *fn, const char *name, const ape_dtensor *t,
		       const ape_device *dev, ape_dtype dtype, const int64_t want[4],
		       const char *const dims[4], struct ape_be_view *v);

/*
 * Validates a forward call on device tensors (lse may be NULL) for dev: the host call's rules
 * (api/validate.h) plus every buffer dev's, offsets multiples of the element size, D
 * contiguous, every addressed element inside its buffer. Fills *p (release with
 * ape__problem_fini()), the backend buffers and the element views. Messages start with fn.
 */
int ape__check_resident(const char *fn, const ape_device *dev, const ape_attn_desc *desc,
			const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
			const ape_dtensor *o, const ape_dtensor *lse, struct ape__problem *p,
			struct ape_be_buf *buf[APE_BE_T_COUNT], struct ape_be_view view[APE_BE_T_COUNT]);

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
			     struct ape_be_buf *buf[APE_BE_T_COUNT], struct ape_be_view view[APE_BE_T_COUNT],
			     struct ape_be_buf *dbuf[2], struct ape_be_view dview[2]);

/* The outputs of a call without keys (p->Lk = 0): O = 0, LSE = -inf, the diagnostics 0, where
 * r's views say, enqueued on queue (each in one strided command where the device has
 * queue-ordered scratch and copy_view, else row by row). Returns 0 or the backend's code. */
struct ape__resident_req;
int ape__resident_write_empty(ape_queue *queue, const struct ape__problem *p,
			      const struct ape__resident_req *r);

/* ape_attention_enqueue_varlen() with its messages starting with fn (the DLPack call's). */
int ape__attention_enqueue_varlen(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
				  const ape_varlen *vl, const ape_dtensor *q, const ape_dtensor *k,
				  const ape_dtensor *v, const ape_dtensor *o,
				  const ape_dtensor *lse);

/* ape_attention_enqueue_diag() with its messages starting with fn (the DLPack call's). */
int ape__attention_enqueue_diag(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
				const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
				const ape_dtensor *o, const ape_dtensor *lse,
				const ape_dtensor *ent, const ape_dtensor *md);


/* A backward call's tensors (t in enum ape__rb_tensor order, of any type: only NULL or not is
 * read) present where required: q .. dout, and at least one gradient. Messages start with fn. */
int ape__check_bwd_present(const char *fn, const void *const t[APE__RB_COUNT]);

/*
 * Every check of ape_attention_backward_enqueue() (runtime/api/resident_bwd.c), before anything
 * is enqueued: t holds its tensors in enum ape__rb_tensor order (NULL where absent). Fills *p
 * (release with ape__problem_fini()) and r's buffers, views and types; the caller sets r's fn,
 * dev, q and budget. Messages start with fn.
 */
int ape__check_resident_bwd(const char *fn, const struct ape_queue *queue,
			    const ape_attn_desc *desc, const ape_dtensor *const t[APE__RB_COUNT],
			    struct ape__problem *p, struct ape__resident_bwd_req *r);

/* ape_attention_backward_enqueue() with its messages starting with fn (the DLPack call's); t in
 * enum ape__rb_tensor order. */
int ape__attention_backward_enqueue(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
				    const ape_dtensor *const t[APE__RB_COUNT]);

/* ape_attention_backward_enqueue_varlen() (runtime/api/resident_varlen_bwd.c) with its messages
 * starting with fn (the DLPack call's); t in enum ape__rb_tensor order. */
int ape__attention_backward_enqueue_varlen(const char *fn, ape_queue *queue,
					   const ape_attn_desc *desc, const ape_varlen *vl,
					   const ape_dtensor *const t[APE__RB_COUNT]);

#pragma GCC visibility pop
#endif
