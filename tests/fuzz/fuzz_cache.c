/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the program-cache entry reader (runtime/core/progcache.c). A cache file may be damaged
 * or planted, and what it hands out is run on a device, so the reader must refuse anything that
 * is not exactly an entry for the key asked. The input is the bytes of one entry file, checked
 * two ways: in memory (ape__progcache_parse) and from disk through the loader the OpenCL backend
 * uses (ape__progcache_load, with APE_CACHE_DIR pointing at a private directory). Promises checked:
 * both agree, a hit is exactly what ape__progcache_format would write for that payload, and
 * anything stored loads back unchanged.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/progcache.h"

/* A key shaped like the OpenCL backend's (device, driver, options, source hash). */
static const char key[] =
	"opencl|pthread-fuzz|PoCL 3.1|-cl-std=CL1.2 -DAPE_D=64|src=0123456789abcdef";
static char dir[64];
static char entry[4096];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(int cond, const char *what)
{
	if (!cond) {
		fprintf(stderr, "fuzz_cache: broken promise: %s\n", what);
		abort();
	}
}

/* libFuzzer ends with exit(): leave no directory behind. */
static void remove_dir(void)
{
	unlink(entry);
	rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	/* tmpfs where there is one: a rename on a disk file system costs more than the parse */
	snprintf(dir, sizeof(dir), "/dev/shm/ape-fuzz-cache-XXXXXX");
	if (!mkdtemp(dir)) {
		snprintf(dir, sizeof(dir), "/tmp/ape-fuzz-cache-XXXXXX");
		check(mkdtemp(dir) != NULL, "mkdtemp");
	}
	setenv("APE_CACHE_DIR", dir, 1);
	unsetenv("APE_NO_CACHE");
	check(ape__progcache_path(key, entry, sizeof(entry)) == 0, "ape__progcache_path");
	atexit(remove_dir);
	return 0;
}

static void write_entry(const uint8_t *data, size_t size)
{
	int fd = open(entry, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

	check(fd >= 0 && write(fd, data, size) == (ssize_t)size && close(fd) == 0,
	      "writing the entry file");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const void *payload;
	size_t plen, llen;
	void *blob;
	int ret, lret;

	ret = ape__progcache_parse(data, size, key, &payload, &plen);
	check(ret == APE__CACHE_HIT || ret == APE__CACHE_CORRUPT, "parse: HIT or CORRUPT");
	if (ret == APE__CACHE_HIT) {
		unsigned char *again = malloc(size ? size : 1);

		check((const uint8_t *)payload >= data && plen <= size &&
			      (const uint8_t *)payload + plen == data + size,
		      "the payload lies inside the entry and ends it");
		check(again && ape__progcache_format(again, size, key, payload, plen) == size &&
			      !memcmp(again, data, size),
		      "a hit is byte for byte what ape__progcache_format writes");
		free(again);
	} else {
		check(payload == NULL && plen == 0, "a refusal hands out nothing");
	}

	write_entry(data, size);
	lret = ape__progcache_load(key, &blob, &llen);
	check(lret == ret, "ape__progcache_load agrees with ape__progcache_parse");
	check(lret == APE__CACHE_HIT ? llen == plen && (!plen || !memcmp(blob, payload, plen))
				     : blob == NULL,
	      "the loaded payload is the parsed one");
	free(blob);

	/* The input as a payload: the writer's entry must load back unchanged (it replaces the
	 * file atomically, so the reader never sees half of it). */
	check(ape__progcache_store(key, data, size) == 0, "ape__progcache_store");
	check(ape__progcache_load(key, &blob, &llen) == APE__CACHE_HIT && llen == size &&
		      (!size || !memcmp(blob, data, size)),
	      "a stored payload loads back");
	free(blob);
	return 0;
}
