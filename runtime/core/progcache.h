/* SPDX-License-Identifier: MIT */
/*
 * A keyed blob store on disk for compiled device programs, independent of any driver: the OpenCL
 * backend keeps its program binaries here and a later backend can do the same.
 *
 * Where: $APE_CACHE_DIR, else $XDG_CACHE_HOME/libape, else $HOME/.cache/libape (created mode
 * 0700). APE_NO_CACHE=1 turns the store off. An unusable directory costs one warning on stderr
 * per process and nothing else: every caller must be able to work without the cache.
 *
 * An entry is one file named after a hash of its key, written atomically (temporary file in the
 * same directory, then rename). Nothing read from it is trusted until its owner, permissions,
 * header, full key, length and checksum have been checked; a file that fails any check is
 * reported so the caller rebuilds and overwrites it.
 */
#ifndef APE_RUNTIME_PROGCACHE_H
#define APE_RUNTIME_PROGCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/types.h>

#pragma GCC visibility push(hidden)

/* What a load found. Only APE__CACHE_HIT hands out a blob. */
enum ape__progcache_result {
	APE__CACHE_HIT = 0,
	APE__CACHE_MISS = 1, /* no entry for this key */
	APE__CACHE_CORRUPT = 2, /* bad header, other key, wrong length or checksum: rebuild */
	APE__CACHE_UNTRUSTED = 3, /* another owner, or writable by group/others: rebuild */
	APE__CACHE_DISABLED = 4, /* APE_NO_CACHE=1 */
	APE__CACHE_UNUSABLE = 5, /* no usable directory (warned once), or an I/O error */
	APE__CACHE_NOMEM = 6,
};

/* Entry format (all integers little-endian):
 *   "APECACHE" | u32 version | u32 key length | u64 payload length | u64 FNV-1a 64 of payload |
 *   key bytes (no terminator) | payload bytes                                                    */
#define APE__CACHE_MAGIC "APECACHE"
#define APE__CACHE_VERSION 1u
#define APE__CACHE_HEADER 32u
/* Entries larger than this are not read (a program binary is a few MiB at most). */
#define APE__CACHE_MAX_ENTRY ((size_t)256 << 20)

/* FNV-1a 64 of n bytes, continuing from h (start with APE__FNV_OFFSET). */
#define APE__FNV_OFFSET 0xcbf29ce484222325ull
uint64_t ape__fnv1a64(const void *p, size_t n, uint64_t h);

/*
 * Loads the entry for `key`. On APE__CACHE_HIT, *blob is a malloc'ed copy of the payload (free
 * it) and *len its size; otherwise *blob is NULL. Returns an enum ape__progcache_result.
 */
int ape__progcache_load(const char *key, void **blob, size_t *len);

/* 0 when a store may succeed (APE_NO_CACHE unset, directory created and trusted), else an enum
 * ape__progcache_result (DISABLED, or UNUSABLE after the one warning). Lets a caller skip work that
 * only a store needs: fetching a program binary can cost a driver seconds. */
int ape__progcache_usable(void);

/*
 * When the entry for `key` was last used: its modification time, which a store sets and
 * ape__progcache_touch() renews. 0 and *when set, or -1 when there is no such entry or no usable
 * cache (no warning, no directory created).
 */
int ape__progcache_used(const char *key, struct timespec *when);

/* Marks the entry for `key` as used now (its modification time), so that a later process can
 * tell which entries this machine's programs use (the OpenCL backend's preload). Best effort. */
void ape__progcache_touch(const char *key);

/* Stores (or atomically replaces) the entry for `key`. Returns 0 or an enum ape__progcache_result
 * saying why nothing was written (DISABLED, UNUSABLE, NOMEM). */
int ape__progcache_store(const char *key, const void *blob, size_t len);

/*
 * Pure: checks a whole entry file held in memory against `key` and, when it is valid, points
 * *payload / *payload_len into `file`. Safe on arbitrary bytes (a fuzzer may call it).
 * Returns APE__CACHE_HIT or APE__CACHE_CORRUPT.
 */
int ape__progcache_parse(const void *file, size_t len, const char *key, const void **payload,
		     size_t *payload_len);

/* Serialises an entry into out (cap bytes); returns the size needed (nothing written when it
 * exceeds cap). ape__progcache_parse() accepts exactly what this writes. */
size_t ape__progcache_format(void *out, size_t cap, const char *key, const void *blob, size_t len);

/* Pure: may a file or directory with this stat be trusted by user `uid`? (owned by uid, not
 * writable by group or others) */
bool ape__progcache_trusted(const struct stat *st, uid_t uid);

/* The file that holds `key` (for tests and messages); 0, or an enum ape__progcache_result (DISABLED,
 * UNUSABLE) when there is no usable cache directory. Does not warn. */
int ape__progcache_path(const char *key, char *buf, size_t cap);

#pragma GCC visibility pop
#endif
