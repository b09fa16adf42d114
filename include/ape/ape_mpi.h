/* SPDX-License-Identifier: MIT */
/**
 * \file ape_mpi.h
 * \brief libape_mpi: context-parallel APE attention over MPI (one sequence sharded over ranks).
 *
 * A separate library on top of libape (which never depends on MPI). Every rank of a
 * communicator holds some rows of one sequence: its rows of Q, K and V as host tensors. A call
 * computes O and LSE for each rank's own rows as one single-process ape_attention_forward() over
 * the whole sequence would, within the spec's tolerance. Before anything moves, the ranks agree on
 * the call (one allgather of a digest), exchange per-block key-norm bounds (one allgather) and
 * plan which rows of which key block each rank needs: with a real decay the skip bound proves
 * everything else negligible, so only rows near block borders travel. The transfers are
 * non-blocking and overlap the computation of the blocks already present; partial results are
 * merged by their LSE (docs/ape.md, identity 4). docs/distributed.md has the design and the
 * proof.
 *
 * Threading: a call is collective over its communicator; like any MPI collective, concurrent
 * calls on the same communicator from several threads are not allowed. The last-error message
 * (ape_mpi_last_error()) is per thread.
 */
#ifndef APE_APE_MPI_H
#define APE_APE_MPI_H

#include <mpi.h>

#include "ape/ape.h"

#ifdef __cplusplus
extern "C" {
#endif

/** How the rows of the sequence are split over the ranks. */
typedef enum ape_mpi_shard_kind {
	/** Rank r holds one contiguous block, the r-th of nranks nearly equal blocks (the first
	 *  L mod nranks blocks have one row more). */
	APE_MPI_SHARD_CONTIGUOUS = 0,
	/** The sequence is cut into 2 * nranks nearly equal chunks; rank r holds chunks r and
	 *  2 * nranks - 1 - r, in that order (ring-flash-attention's zigzag): with causal
	 *  attention every rank then has about the same number of visible pairs. */
	APE_MPI_SHARD_ZIGZAG = 1,
} ape_mpi_shard_kind;

/** The rows one rank holds (see ape_mpi_shard()). */
typedef struct ape_mpi_shard_info {
	int64_t L; /**< rows of the whole sequence */
	int nranks; /**< ranks of the communicator */
	int rank; /**< the rank this shard describes */
	ape_mpi_shard_kind kind;
	int nblocks; /**< blocks this rank holds: 1 (contiguous) or 2 (zigzag) */
	/** First global row of each block: local row 0 is global row start[0]; local rows of
	 *  block 1 follow those of block 0. */
	int64_t start[2];
	int64_t count[2]; /**< rows of each block (0 for a block with no rows) */
	int64_t rows; /**< count[0] + count[1]: the local length of Q, K, V, O */
} ape_mpi_shard_info;

/**
 * \brief Which rows of a sequence of \p L rows rank \p rank of \p nranks holds.
 *
 * Positions follow: local row i of block b sits at global row start[b] + i, i.e. at position
 * q_start + start[b] + i for queries and k_start + start[b] + i for keys. L < nranks (or
 * < 2 * nranks for the zigzag split) leaves some ranks, or some blocks, without rows.
 * \param[out] out the shard; zeroed on failure
 * \return 0; APE_EINVAL (out NULL, L < 0, nranks < 1, rank outside [0, nranks), unknown kind).
 *         Thread-safe; needs no MPI.
 */
APE_API int ape_mpi_shard(int64_t L, int nranks, int rank, ape_mpi_shard_kind kind,
			  ape_mpi_shard_info *out);

/** Statistics of one ape_mpi_attention_forward() or ape_mpi_attention_backward() call, for this
 *  rank (the backward: the same K and V transfers, its own calls and pairs, and the gradients
 *  returned). */
typedef struct ape_mpi_stats {
	size_t struct_size; /**< set by ape_mpi_stats_init() */
	uint64_t bytes_sent; /**< bytes of K and V this rank sent */
	uint64_t bytes_received; /**< bytes of K and V this rank received */
	uint64_t messages_sent; /**< point-to-point messages sent (a block over 1 GiB takes several;
				  *  the backward counts its gradient messages too) */
	uint64_t messages_received;
	uint64_t blocks_sent; /**< (key block, destination rank) transfers, whole or in part */
	uint64_t rows_sent; /**< key rows sent, summed over destinations */
	uint64_t blocks_received; /**< key blocks received, whole or in part */
	/** Remote key blocks with keys visible to this rank's queries that the skip bound proved
	 *  negligible as a whole: never sent here. */
	uint64_t blocks_unneeded;
	/** Key rows of other ranks visible to this rank's queries that were proved negligible. */
	uint64_t rows_unneeded;
	int peers; /**< distinct ranks this rank sent to or received from */
	/** True when the plan could not leave anything out (skip_tol = 0, a negative or all-zero
	 *  decay): every visible block travels, as in a ring; note says why. */
	bool full_exchange;
	char note[192]; /**< what the plan did, in words */
	uint64_t local_calls; /**< ape_attention_forward_ex() (backward_ex) calls this rank made */
	uint64_t pairs_visible; /**< pairs the mask lets through for this rank's rows */
	uint64_t pairs_computed; /**< pairs computed by those calls (after their own skipping) */
	/** Backward only: bytes of dK and dV (float32) this rank sent back to the owners of the
	 *  key rows it received, and received for the rows it sent; 0 in the forward. */
	uint64_t grad_bytes_sent;
	uint64_t grad_bytes_received;
	double total_ms; /**< wall time of the call on this rank */
	double wait_ms; /**< time this rank spent waiting for data it had nothing else to do for */
} ape_mpi_stats;

/** \brief Zeroes \p st and sets struct_size. Never fails. */
APE_API void ape_mpi_stats_init(ape_mpi_stats *st);

/**
 * \brief APE attention of one sequence sharded over the ranks of \p comm (collective).
 *
 * Every rank passes its own rows: \p q `[B, H, rows, D]`, \p k and \p v `[B, Hkv, rows, D]`, \p o
 * `[B, H, rows, D]`, with rows = shard->rows (0 is fine: the rank still takes part). The global
 * problem has Lq = Lk = shard->L; desc->k_start is the position of global key row 0, and
 * desc->q_start (when q_start_set; else equal to k_start) that of global query row 0. Every rank
 * must pass the same shapes, types, shard kind and parameters; they are checked together.
 *
 * The call works on a duplicate of \p comm with MPI_ERRORS_RETURN, so it never aborts and its
 * messages do not mix with the caller's.
 *
 * \param comm the ranks that share the sequence; every rank of it must call
 * \param dev the device local computations run on (any libape device)
 * \param opts NULL, or options for every local ape_attention_forward_ex() call (chunking,
 *        budget); a trace_path is rewritten by each of them
 * \param desc the parameters, as for ape_attention_forward()
 * \param shard this rank's rows, from ape_mpi_shard(shard->L, size of comm, rank in comm, ...)
 * \param q,k,v this rank's rows of the inputs; read only
 * \param o this rank's rows of the output; float32 or the inputs' type; written only on success
 * \param lse NULL, or B*H*rows floats (contiguous `[B, H, rows]`), written only on success
 * \param stats NULL, or this rank's statistics (initialise with ape_mpi_stats_init()); written
 *        only on success
 * \return 0 on every rank, or the same code on every rank:
 *         APE_EINVAL (an invalid argument on some rank, or ranks that disagree on a shape,
 *         type, parameter or the shard: the message names the rank and the field, on every
 *         rank); APE_EOVERFLOW (positions or sizes overflow); APE_ENOMEM (host memory on some
 *         rank); APE_EIO (an MPI call failed: the message has MPI's error string); device
 *         errors of a local computation (APE_EBACKEND, APE_EDEVLOST, ...), named with the rank.
 * \note On failure o and lse are untouched on every rank. Arguments that are wrong on one rank
 *       only (a NULL pointer, a bad stride, a shard of another rank) are caught before any
 *       transfer and reported by all ranks, never a hang. An MPI failure inside the exchange is
 *       reported by the rank that saw it; whether its peers can still complete is up to the
 *       MPI library.
 * \note Inputs are not scanned: NaN or Inf give NaN in the rows they reach, and a key block
 *       holding one is never proved negligible.
 */
APE_API int ape_mpi_attention_forward(MPI_Comm comm, ape_device *dev, const ape_exec_options *opts,
				      const ape_attn_desc *desc, const ape_mpi_shard_info *shard,
				      const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
				      ape_tensor *o, float *lse, ape_mpi_stats *stats);

/**
 * \brief ape_mpi_attention_forward() with several devices per rank.
 *
 * Each local computation (a query block against a range of key rows) is one
 * ape_attention_forward_ex() call on \p devs, which splits it over those devices as it does in
 * one process (one device may appear more than once; opts->device_weights, when set, has \p ndev
 * entries). ape_mpi_attention_forward(comm, dev, ...) is this call with (&dev, 1). The device list
 * is this rank's own: ranks may pass different lists (and different counts).
 *
 * \param devs,ndev this rank's devices, 1..APE_MAX_DEVICES; the rest as
 *        ape_mpi_attention_forward()
 * \return as ape_mpi_attention_forward(); APE_EINVAL also for a bad device list (NULL, ndev out
 *         of range, a NULL entry), reported by every rank with the rank that has it.
 */
APE_API int ape_mpi_attention_forward_ex(MPI_Comm comm, ape_device *const *devs, int ndev,
					 const ape_exec_options *opts, const ape_attn_desc *desc,
					 const ape_mpi_shard_info *shard, const ape_tensor *q,
					 const ape_tensor *k, const ape_tensor *v, ape_tensor *o,
					 float *lse, ape_mpi_stats *stats);

/**
 * \brief The gradients of ape_mpi_attention_forward() (collective): ape_attention_backward() of
 *        one sequence sharded over the ranks of \p comm.
 *
 * Every rank passes its own rows, as in the forward: \p q, \p o, \p dout `[B, H, rows, D]`,
 * \p k, \p v `[B, Hkv, rows, D]`, \p lse (and \p dlse) B*H*rows floats (contiguous
 * `[B, H, rows]`), where o and lse are the forward's results for these rows. It receives dQ for
 * its rows and dK, dV for its key rows (summed over every rank's queries and, for grouped-query
 * attention, over the query heads that share a kv head), and the parameter gradients of the
 * whole sequence, summed over every rank in a fixed order: every rank gets bit-identical
 * dparams, and two calls give bit-identical results.
 *
 * The plan is the forward's (the same key-norm bounds and the same proof: the call computes it
 * again from the same inputs, so it is the same plan): the key rows a rank's queries need are
 * fetched from their owners, the gradients of those rows are computed where the queries are and
 * sent back to the owners, and nothing else moves. Pairs the plan proved negligible in the
 * forward (a relative weight of at most skip_tol / 2 per row) are left out of the gradients too,
 * and each sub-block of at most opts->chunk_q query rows (default 4096) has its key range cut
 * again by the same bound and share (as the forward's local calls skip far keys), so the call
 * equals the single-process backward within the spec's gradient tolerance
 * (docs/distributed.md, "The backward"); with skip_tol = 0 or no decay every visible pair is
 * computed. Each local piece is one ape_attention_backward_ex() on \p dev (the reference
 * backend today; another gives APE_ENOTSUP on every rank).
 *
 * \param comm,dev,opts,desc,shard as ape_mpi_attention_forward() (opts->trace_path must be NULL)
 * \param q,k,v,o,lse this rank's rows of the forward's inputs and results; read only
 * \param dout dL/dO for this rank's rows, shaped like q; read only
 * \param dlse NULL (dL/dLSE = 0 for this rank's rows), or B*H*rows floats; read only
 * \param[out] dq,dk,dv NULL or this rank's rows (shaped like q, k, v; q->dtype or APE_F32)
 * \param[out] dparams NULL or 4*H floats, the same on every rank
 * \param stats NULL or this rank's statistics, as in the forward; grad_bytes_sent and
 *        grad_bytes_received count the gradients returned
 * \return 0 on every rank, or the same code on every rank, as ape_mpi_attention_forward(); every
 *         rank must want the same gradients (which of dq, dk, dv, dparams are NULL).
 * \note On failure nothing is written on any rank.
 */
APE_API int ape_mpi_attention_backward(MPI_Comm comm, ape_device *dev,
				       const ape_exec_options *opts, const ape_attn_desc *desc,
				       const ape_mpi_shard_info *shard, const ape_tensor *q,
				       const ape_tensor *k, const ape_tensor *v,
				       const ape_tensor *o, const float *lse,
				       const ape_tensor *dout, const float *dlse, ape_tensor *dq,
				       ape_tensor *dk, ape_tensor *dv, float *dparams,
				       ape_mpi_stats *stats);

/**
 * \brief Message describing the last failure of an ape_mpi_ call on the calling thread ("rank 2:
 *        desc->delta = 0.5, but 0.397 on rank 0"). Never NULL; "" before any failure.
 */
APE_API const char *ape_mpi_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* APE_APE_MPI_H */
