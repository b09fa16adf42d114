/* SPDX-License-Identifier: MIT */
/*
 * The on-disk program cache (see cache.h). A cache is only an accelerator: every failure here
 * degrades to "not cached", with one warning per process when the directory itself is unusable.
 */
#include "core/progcache.h"
#include "core/alloc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"

uint64_t ape__fnv1a64(const void *p, size_t n, uint64_t h)
{
	const unsigned char *b = p;

	for (size_t i = 0; i < n; i++) {
		h ^= b[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

/* Integers are stored little-endian whatever the host, so an entry means one thing. */
static void put_le(unsigned char *p, uint64_t v, int bytes)
{
	for (int i = 0; i < bytes; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes)
{
	uint64_t v = 0;

	for (int i = bytes - 1; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

size_t ape__progcache_format(void *out, size_t cap, const char *key, const void *blob, size_t len)
{
	const size_t klen = strlen(key);
	const size_t need = APE__CACHE_HEADER + klen + len;
	unsigned char *o = out;

	if (need > cap)
		return need;
	memcpy(o, APE__CACHE_MAGIC, 8);
	put_le(o + 8, APE__CACHE_VERSION, 4);
	put_le(o + 12, klen, 4);
	put_le(o + 16, len, 8);
	put_le(o + 24, ape__fnv1a64(blob, len, APE__FNV_OFFSET), 8);
	memcpy(o + APE__CACHE_HEADER, key, klen);
	if (len)
		memcpy(o + APE__CACHE_HEADER + klen, blob, len);
	return need;
}

int ape__progcache_parse(const void *file, size_t len, const char *key, const void **payload,
		     size_t *payload_len)
{
	const unsigned char *f = file;
	const size_t klen = strlen(key);
	uint64_t stored_klen, plen;

	*payload = NULL;
	*payload_len = 0;
	if (!f || len < APE__CACHE_HEADER || memcmp(f, APE__CACHE_MAGIC, 8) ||
	    get_le(f + 8, 4) != APE__CACHE_VERSION)
		return APE__CACHE_CORRUPT;
	stored_klen = get_le(f + 12, 4);
	plen = get_le(f + 16, 8);
	/* every size is checked against what is really there before it is used */
	if (stored_klen != klen || klen > len - APE__CACHE_HEADER ||
	    plen != len - APE__CACHE_HEADER - klen)
		return APE__CACHE_CORRUPT;
	if (memcmp(f + APE__CACHE_HEADER, key, klen))
		return APE__CACHE_CORRUPT;
	if (ape__fnv1a64(f + APE__CACHE_HEADER + klen, (size_t)plen, APE__FNV_OFFSET) !=
	    get_le(f + 24, 8))
		return APE__CACHE_CORRUPT;
	*payload = f + APE__CACHE_HEADER + klen;
	*payload_len = (size_t)plen;
	return APE__CACHE_HIT;
}

bool ape__progcache_trusted(const struct stat *st, uid_t uid)
{
	return st->st_uid == uid && !(st->st_mode & (S_IWGRP | S_IWOTH));
}

static bool env_set(const char *name, const char **val)
{
	const char *v = getenv(name);

	*val = v;
	return v && *v;
}

/* Creates every missing component of `path` with mode 0700 (the XDG base directory spec asks
 * 0700 for cache directories; existing components are left as they are). */
static int mkdir_parents(const char *path)
{
	char tmp[4096];
	size_t n = strlen(path);

	if (n == 0 || n >= sizeof(tmp))
		return ENAMETOOLONG;
	memcpy(tmp, path, n + 1);
	for (char *p = tmp + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(tmp, 0700) && errno != EEXIST)
			return errno;
		*p = '/';
	}
	if (mkdir(tmp, 0700) && errno != EEXIST)
		return errno;
	return 0;
}

/* Resolves, creates (when asked) and checks the directory. On failure fills `why`. */
static int cache_dir(char *buf, size_t cap, bool create, char *why, size_t why_len)
{
	const char *v;
	struct stat st;
	int n, err;

	why[0] = '\0';
	if (env_set("APE_NO_CACHE", &v) && strcmp(v, "0"))
		return APE__CACHE_DISABLED;
	if (env_set("APE_CACHE_DIR", &v))
		n = snprintf(buf, cap, "%s", v);
	else if (env_set("XDG_CACHE_HOME", &v) && v[0] == '/')
		n = snprintf(buf, cap, "%s/libape", v);
	else if (env_set("HOME", &v))
		n = snprintf(buf, cap, "%s/.cache/libape", v);
	else {
		snprintf(why, why_len, "neither APE_CACHE_DIR, XDG_CACHE_HOME nor HOME is set");
		return APE__CACHE_UNUSABLE;
	}
	if (n < 0 || (size_t)n >= cap - 64) { /* room for "/<hash>.bin" and temporary names */
		snprintf(why, why_len, "cache directory path too long");
		return APE__CACHE_UNUSABLE;
	}
	if (create && (err = mkdir_parents(buf))) {
		snprintf(why, why_len, "%s: cannot create: %s", buf, strerror(err));
		return APE__CACHE_UNUSABLE;
	}
	if (stat(buf, &st)) {
		if (!create && errno == ENOENT)
			return APE__CACHE_MISS; /* nothing stored yet: not worth a warning */
		snprintf(why, why_len, "%s: %s", buf, strerror(errno));
		return APE__CACHE_UNUSABLE;
	}
	if (!S_ISDIR(st.st_mode)) {
		snprintf(why, why_len, "%s: not a directory", buf);
		return APE__CACHE_UNUSABLE;
	}
	/* someone else's directory could hand us a binary we would then run on the device */
	if (!ape__progcache_trusted(&st, getuid())) {
		snprintf(why, why_len, "%s: %s", buf,
			 st.st_uid != getuid() ? "owned by another user"
					       : "writable by group or others");
		return APE__CACHE_UNUSABLE;
	}
	if (create && access(buf, W_OK | X_OK)) {
		snprintf(why, why_len, "%s: not writable: %s", buf, strerror(errno));
		return APE__CACHE_UNUSABLE;
	}
	return 0;
}

/* One warning per process: a broken cache slows builds down but must not flood the log. */
static void warn_unusable(const char *why)
{
	static atomic_flag warned = ATOMIC_FLAG_INIT;

	if (!atomic_flag_test_and_set(&warned))
		ape__warn("program cache not used (%s); compiling device programs from source",
			  why);
}

static int entry_path(const char *key, bool create, char *buf, size_t cap)
{
	char why[512];
	int ret = cache_dir(buf, cap, create, why, sizeof(why));
	size_t n;

	if (ret == APE__CACHE_UNUSABLE)
		warn_unusable(why);
	if (ret)
		return ret;
	n = strlen(buf);
	snprintf(buf + n, cap - n, "/%016llx.bin",
		 (unsigned long long)ape__fnv1a64(key, strlen(key), APE__FNV_OFFSET));
	return 0;
}

int ape__progcache_usable(void)
{
	char dir[4096], why[512];
	int ret = cache_dir(dir, sizeof(dir), true, why, sizeof(why));

	if (ret == APE__CACHE_UNUSABLE)
		warn_unusable(why);
	return ret;
}

int ape__progcache_path(const char *key, char *buf, size_t cap)
{
	char why[512];
	int ret = cache_dir(buf, cap, false, why, sizeof(why));
	size_t n;

	if (ret && ret != APE__CACHE_MISS)
		return ret;
	n = strlen(buf);
	snprintf(buf + n, cap - n, "/%016llx.bin",
		 (unsigned long long)ape__fnv1a64(key, strlen(key), APE__FNV_OFFSET));
	return 0;
}

static int read_all(int fd, unsigned char *buf, size_t n)
{
	size_t done = 0;

	while (done < n) {
		ssize_t r = read(fd, buf + done, n - done);

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		done += (size_t)r;
	}
	return 0;
}

int ape__progcache_used(const char *key, struct timespec *when)
{
	char path[4096];
	struct stat st;

	if (ape__progcache_path(key, path, sizeof(path)) || stat(path, &st) ||
	    !S_ISREG(st.st_mode))
		return -1;
	*when = st.st_mtim;
	return 0;
}

void ape__progcache_touch(const char *key)
{
	char path[4096];

	if (!ape__progcache_path(key, path, sizeof(path)))
		(void)utimensat(AT_FDCWD, path, NULL, AT_SYMLINK_NOFOLLOW);
}

int ape__progcache_load(const char *key, void **blob, size_t *len)
{
	char path[4096];
	unsigned char *buf;
	const void *payload;
	size_t plen;
	struct stat st;
	int fd, ret;

	*blob = NULL;
	*len = 0;
	ret = entry_path(key, false, path, sizeof(path));
	if (ret)
		return ret;
	fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT ? APE__CACHE_MISS
		       : errno == ELOOP ? APE__CACHE_UNTRUSTED
					: APE__CACHE_UNUSABLE;
	if (fstat(fd, &st) || !S_ISREG(st.st_mode) || !ape__progcache_trusted(&st, getuid())) {
		close(fd);
		return APE__CACHE_UNTRUSTED;
	}
	if (st.st_size < (off_t)APE__CACHE_HEADER || (uint64_t)st.st_size > APE__CACHE_MAX_ENTRY) {
		close(fd);
		return APE__CACHE_CORRUPT;
	}
	buf = ape__malloc((size_t)st.st_size);
	if (!buf) {
		close(fd);
		return APE__CACHE_NOMEM;
	}
	if (read_all(fd, buf, (size_t)st.st_size)) {
		close(fd);
		free(buf);
		return APE__CACHE_CORRUPT; /* shrank while we read it: treat as damaged */
	}
	close(fd);
	ret = ape__progcache_parse(buf, (size_t)st.st_size, key, &payload, &plen);
	if (ret) {
		free(buf);
		return ret;
	}
	memmove(buf, payload, plen); /* hand out the payload alone, in the same allocation */
	*blob = buf;
	*len = plen;
	return APE__CACHE_HIT;
}

static int write_all(int fd, const unsigned char *buf, size_t n)
{
	size_t done = 0;

	while (done < n) {
		ssize_t w = write(fd, buf + done, n - done);

		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		done += (size_t)w;
	}
	return 0;
}

int ape__progcache_store(const char *key, const void *blob, size_t len)
{
	char path[4096], tmp[4096 + 16];
	size_t need = ape__progcache_format(NULL, 0, key, blob, len);
	unsigned char *buf;
	int fd, ret;

	ret = entry_path(key, true, path, sizeof(path));
	if (ret)
		return ret;
	buf = ape__malloc(need);
	if (!buf)
		return APE__CACHE_NOMEM;
	ape__progcache_format(buf, need, key, blob, len);
	/* a reader sees the old entry or the new one, never half of one */
	snprintf(tmp, sizeof(tmp), "%s.XXXXXX", path);
	fd = mkstemp(tmp); /* mode 0600 */
	if (fd < 0) {
		free(buf);
		return APE__CACHE_UNUSABLE;
	}
	ret = write_all(fd, buf, need);
	free(buf);
	if (close(fd) || ret || rename(tmp, path)) {
		unlink(tmp);
		return APE__CACHE_UNUSABLE;
	}
	return 0;
}
