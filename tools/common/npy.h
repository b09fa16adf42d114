/* SPDX-License-Identifier: MIT */
/*
 * NumPy .npy files of float32 ('<f4') and float16 ('<f2') arrays: a strict reader that never
 * trusts the file (it is fuzzed) and an atomic writer; and 1-D integer arrays ('<i8', '<i4':
 * offsets, positions), read by the same reader.
 *
 * Every function fills `err` (when errlen > 0) with a message for people on failure and returns a
 * negative libape code: APE_EFORMAT (the bytes are not an array we accept), APE_EIO (the system
 * refused a read or write), APE_ENOMEM, or APE_EINVAL (a bad argument from the caller).
 */
#ifndef APE_TOOLS_NPY_H
#define APE_TOOLS_NPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"

/* NumPy 2 allows 64 dimensions (NumPy 1: 32); no file of ours needs more. */
#define NPY_MAX_DIMS 64
/* Headers longer than this are refused before anything is allocated for them. */
#define NPY_MAX_HEADER_LEN (1u << 20)

/* What a header says, checked against the size of the data that follows it. */
struct npy_info {
	int version; /* major format version: 1, 2 or 3 */
	ape_dtype dtype; /* APE_F32 for '<f4', APE_F16 for '<f2'; unused where int_bytes is set */
	int int_bytes; /* 0: a float array; 8 or 4: '<i8' or '<i4' (npy_load_int64() only) */
	int ndim;
	int64_t shape[NPY_MAX_DIMS];
	uint64_t count; /* elements: the product of the shape (1 for 0-D) */
	size_t nbytes; /* bytes of data: count * element size */
	size_t data_offset; /* where the data starts: preamble plus header */
};

/**
 * Parses a whole .npy file held in memory. Accepts format versions 1.0, 2.0 and 3.0, C order,
 * descr '<f4' or '<f2', and exactly data_offset + nbytes bytes in all. On success the data are
 * the nbytes bytes at buf + info->data_offset (not necessarily aligned for float access).
 * \return 0, or APE_EFORMAT with the reason in err (which names no file).
 */
int npy_parse(const void *buf, size_t len, struct npy_info *info, char *err, size_t errlen);

/* A loaded array: the header and its data in their own (suitably aligned) allocation. */
struct npy_array {
	struct npy_info info;
	void *data; /* info.nbytes bytes; never NULL after a successful load; see npy_free() */
};

/**
 * Reads and checks the file at \p path. Memory is bounded by what the file really holds: the
 * header is read first (at most NPY_MAX_HEADER_LEN), and data is allocated only once the file's
 * size has been found to match the header exactly. Messages start with the path.
 * \return 0; APE_EFORMAT, APE_EIO (cannot open or read; not a regular file), APE_ENOMEM.
 *         On failure \p arr is empty (safe to pass to npy_free()).
 */
int npy_load(const char *path, struct npy_array *arr, char *err, size_t errlen);

/**
 * Reads the 1-D integer array at \p path: '<i8' (int64) or, with \p allow_i4, '<i4' (int32,
 * widened to int64). Checked as strictly as npy_load(); messages start with the path and say
 * what is wrong (the dtype found and the ones accepted, a shape that is not 1-D).
 * \param[out] vals *n values, to free(); NULL on failure
 * \return 0; APE_EFORMAT, APE_EIO, APE_ENOMEM as npy_load().
 */
int npy_load_int64(const char *path, bool allow_i4, int64_t **vals, int64_t *n, char *err,
		   size_t errlen);

/* Writes a shape as Python shows it, "(2, 3)", "(5,)" or "()", cut short to fit \p cap. */
void npy_format_shape(const int64_t *shape, int ndim, char *out, size_t cap);

/* Releases the data of \p arr and empties it. Accepts NULL and empty arrays. */
void npy_free(struct npy_array *arr);

/**
 * Formats the preamble and header NumPy (>= 1.23) writes for a C-order array, byte for byte:
 * padded with spaces and a final '\n' to a multiple of 64 bytes in all.
 * \param version 1 or 2, or 0 for the oldest that can hold the header (always 1 in practice:
 *        a header with NPY_MAX_DIMS dimensions is far below version 1's 65535-byte limit)
 * \param[out] len bytes written to buf
 * \return 0, or APE_EINVAL (dtype other than f32/f16, bad ndim or dimension, version that cannot
 *         hold the header, buf too small: 4096 bytes are always enough).
 */
int npy_format_header(char *buf, size_t cap, ape_dtype dtype, int ndim, const int64_t *shape,
		      int version, size_t *len, char *err, size_t errlen);

/*
 * A file written under a temporary name in its target's directory and not yet renamed into
 * place, so that several outputs can appear together or not at all.
 */
struct npy_pending {
	char *path; /* the target */
	char *tmp; /* the temporary file; NULL when nothing is pending */
};

/**
 * Writes the array to a new temporary file next to \p path (created with the permissions np.save
 * would give it) and flushes it to disk. Nothing named \p path is touched.
 * \param version as for npy_format_header()
 * \param data count * element size bytes; may be NULL when the shape has no elements
 * \return 0 with \p p pending; or APE_EINVAL, APE_EIO, APE_ENOMEM with no temporary file left.
 */
int npy_write_pending(struct npy_pending *p, const char *path, ape_dtype dtype, int ndim,
		      const int64_t *shape, const void *data, int version, char *err,
		      size_t errlen);

/**
 * Renames the temporary file over the target (atomically replacing any file of that name).
 * \return 0; or APE_EIO, in which case the temporary file has been removed. Either way \p p is
 *         no longer pending.
 */
int npy_commit(struct npy_pending *p, char *err, size_t errlen);

/* Removes the temporary file, if any, and forgets it. Accepts a never-used (zeroed) \p p. */
void npy_discard(struct npy_pending *p);

/**
 * npy_write_pending() followed by npy_commit(): the target either gets the whole new file or
 * keeps what it had.
 */
int npy_save(const char *path, ape_dtype dtype, int ndim, const int64_t *shape, const void *data,
	     char *err, size_t errlen);

#endif
