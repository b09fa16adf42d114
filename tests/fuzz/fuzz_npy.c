/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the .npy reader (tools/common/npy_read.c), which ape-run points at files
 * from anywhere. The input is a whole file. Besides "no crash, no leak, no UB", it checks what
 * the reader promises: an accepted file is exactly header plus data, npy_load() (the path the
 * tools take, reading a file in pieces) agrees with npy_parse() (the whole file in memory), and
 * the header our writer formats for the accepted shape parses back to the same shape.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/npy.h"

/* One in-memory file for the whole run: npy_load() needs a path, and a file per input would
 * cost more than the parse itself. */
static int memfd = -1;
static char memfd_path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	memfd = memfd_create("fuzz_npy", MFD_CLOEXEC);
	if (memfd < 0) {
		perror("fuzz_npy: memfd_create");
		abort();
	}
	snprintf(memfd_path, sizeof(memfd_path), "/proc/self/fd/%d", memfd);
	return 0;
}

static void check(int cond, const char *what)
{
	if (!cond) {
		fprintf(stderr, "fuzz_npy: broken promise: %s\n", what);
		abort();
	}
}

/* The accepted shape, formatted by our writer and followed by the same data, must read back as
 * the same array. */
static void check_header_round_trip(const struct npy_info *info, const uint8_t *data)
{
	struct npy_info back;
	char hdr[4096], err[512];
	unsigned char *file;
	size_t len;

	/* version 3 only changes the header's encoding (UTF-8); the writer emits 1 or 2 */
	if (npy_format_header(hdr, sizeof(hdr), info->dtype, info->ndim, info->shape,
			      info->version == 1 ? 1 : 2, &len, err, sizeof(err)))
		return; /* e.g. a header the writer cannot fit in version 1 */
	file = malloc(len + info->nbytes + 1);
	check(file != NULL, "malloc for the round trip");
	memcpy(file, hdr, len);
	memcpy(file + len, data + info->data_offset, info->nbytes);
	check(npy_parse(file, len + info->nbytes, &back, err, sizeof(err)) == 0,
	      "the writer's header for an accepted array parses");
	check(back.ndim == info->ndim && back.dtype == info->dtype && back.nbytes == info->nbytes,
	      "the round trip keeps ndim, dtype and size");
	check(!memcmp(back.shape, info->shape, (size_t)info->ndim * sizeof(info->shape[0])),
	      "the round trip keeps the shape");
	free(file);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct npy_info info;
	struct npy_array arr;
	char err[512], lerr[512];
	int ret, lret;

	err[0] = '\0';
	ret = npy_parse(data, size, &info, err, sizeof(err));
	check(ret == 0 || ret == APE_EFORMAT, "npy_parse returns 0 or APE_EFORMAT");
	check(ret == 0 || err[0], "a refusal says why");
	check(memchr(err, '\0', sizeof(err)) != NULL, "the message is terminated");
	if (ret == 0) {
		check(info.data_offset <= size && size - info.data_offset == info.nbytes,
		      "an accepted file is header plus exactly nbytes of data");
		check(info.version >= 1 && info.version <= 3, "version 1..3");
		check(info.ndim >= 0 && info.ndim <= NPY_MAX_DIMS, "ndim in range");
		check(info.nbytes == info.count * ape_dtype_size(info.dtype),
		      "nbytes = count * size");
		for (int i = 0; i < info.ndim; i++)
			check(info.shape[i] >= 0, "dimensions >= 0");
		check_header_round_trip(&info, data);
	}

	/* The same bytes as a file, through the loader the tools use. */
	if (ftruncate(memfd, 0) || pwrite(memfd, data, size, 0) != (ssize_t)size) {
		perror("fuzz_npy: writing the memfd");
		abort();
	}
	lret = npy_load(memfd_path, &arr, lerr, sizeof(lerr));
	check(lret == ret, "npy_load and npy_parse agree on the verdict");
	if (lret == 0) {
		check(arr.data != NULL && arr.info.nbytes == info.nbytes &&
			      arr.info.data_offset == info.data_offset,
		      "npy_load finds the header npy_parse found");
		check(!memcmp(arr.data, data + info.data_offset, info.nbytes),
		      "npy_load returns the file's data");
	} else {
		check(arr.data == NULL, "a failed load leaves the array empty");
		check(!strncmp(lerr, memfd_path, strlen(memfd_path)),
		      "load messages start with the path");
	}
	npy_free(&arr);
	return 0;
}
