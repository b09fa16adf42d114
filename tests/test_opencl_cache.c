/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend's program cache (core/progcache.h): built then loaded, corrupt, refused and
 * untrusted entries rebuilt or not used, the trust rules, disabled, an unusable directory, the
 * directory's resolution, malformed entries.
 *
 * `make deps` installs PoCL, so an OpenCL device is expected: every test fails when the backend
 * cannot run. Only a machine with no OpenCL platform at all (or a libape built without the
 * backend) skips the whole program, with exit code 4.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/opencl_present.h"
#include "common/problem.h"

#ifdef APE_HAVE_OPENCL
#include "../opencl/ocl_debug.h"
#include "core/backend.h"
#include "core/progcache.h"
#include "opencl_compare.h"

/* ---- the program cache */

/* A fresh, empty cache directory for this test (the harness forks: the environment is ours). */
static void cache_dir_fresh(char *dir, size_t cap)
{
	snprintf(dir, cap, "/tmp/ape-test-cache-%d-XXXXXX", (int)getpid());
	if (!mkdtemp(dir))
		dir[0] = '\0';
	chmod(dir, 0700);
	setenv("APE_CACHE_DIR", dir, 1);
	unsetenv("APE_NO_CACHE");
}

/* The cache entry of the D = 64 program of the device used below: its key and its file. */
static char entry_key[1024], entry_path[4096];

/* One forward at head dimension D on a new context; returns its device counters (in *opened
 * too, when not NULL, as they were once the context was created, before the call) and fills
 * entry_key and entry_path with D = 64's. */
static int forward_counted_d(struct ape__ocl_debug_counters *cnt, int D,
			     struct ape__ocl_debug_counters *opened)
{
	ape_context *ctx = test_context("opencl");
	ape_device *dev = test_device(ctx, "opencl");
	test_problem tp;
	ape_rng rng;
	int ret = -1;

	if (!dev)
		goto out;
	if (opened && ape__ocl_debug_counters(dev, opened))
		goto out;
	ape_rng_seed(&rng, 42);
	if (test_problem_make_dims(&tp, &rng, 1, 2, 1, 33, 33, D, APE_F32))
		goto out;
	ret = test_problem_run(&tp, dev);
	test_problem_free(&tp);
	if (!ret)
		ret = ape__ocl_debug_counters(dev, cnt);
	if (!ret) {
		ape__ocl_debug_cache_key(dev, 64, entry_key, sizeof(entry_key));
		if (ape__progcache_path(entry_key, entry_path, sizeof(entry_path)))
			entry_path[0] = '\0'; /* no usable cache: tests that need one check this */
	}
out:
	ape_context_destroy(ctx);
	return ret;
}

/* One forward at D = 64 (forward_counted_d). */
static int forward_counted(struct ape__ocl_debug_counters *cnt)
{
	return forward_counted_d(cnt, 64, NULL);
}

/* The entry file holds a valid entry for entry_key. */
static int cache_entry_valid(void)
{
	size_t len, plen;
	unsigned char *f = test_read_file(entry_path, &len);
	const void *payload;
	int ret;

	if (!f)
		return 0;
	ret = ape__progcache_parse(f, len, entry_key, &payload, &plen) == APE__CACHE_HIT && plen > 0;
	free(f);
	return ret;
}

TEST(cache_build_then_load)
{
	struct ape__ocl_debug_counters c;
	char dir[256];
	struct stat st;

	cache_dir_fresh(dir, sizeof(dir));
	ASSERT_NE(0, dir[0]);
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, c.builds);
	EXPECT_EQ(0, c.cache_hits);
	EXPECT_EQ(1, c.cache_writes);
	ASSERT_EQ(0, stat(entry_path, &st)) TH_LOG("no cache entry at %s", entry_path);
	EXPECT_EQ(0600, st.st_mode & 0777);
	EXPECT_TRUE(cache_entry_valid());
	EXPECT_EQ(1, test_count_entries(dir, NULL, 0)); /* no temporary file left behind */

	/* a second context loads it instead of compiling */
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, c.builds);
	EXPECT_EQ(1, c.cache_hits);
	EXPECT_EQ(0, c.cache_writes);
	test_rmtree(dir);
}

static void corrupt_file(const char *path, int how)
{
	size_t len;
	unsigned char *f = test_read_file(path, &len);
	int fd;

	if (!f)
		return;
	switch (how) {
	case 0: /* a payload byte: the checksum catches it */
		f[len - 100] ^= 0x5a;
		break;
	case 1: /* the magic */
		f[0] ^= 0xff;
		break;
	case 2: /* the key */
		f[40] ^= 0x01;
		break;
	case 3: /* truncated */
		len /= 2;
		break;
	case 4: /* empty */
		len = 0;
		break;
	}
	fd = open(path, O_WRONLY | O_TRUNC);
	if (fd >= 0) {
		if (write(fd, f, len) != (ssize_t)len)
			len = 0;
		close(fd);
	}
	free(f);
}

TEST(cache_corrupt_entry_is_rebuilt)
{
	struct ape__ocl_debug_counters c;
	char dir[256];

	cache_dir_fresh(dir, sizeof(dir));
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	for (int how = 0; how < 5; how++) {
		corrupt_file(entry_path, how);
		EXPECT_FALSE(cache_entry_valid()) TH_LOG("corruption %d", how);
		ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(1, c.builds) TH_LOG("corruption %d", how);
		EXPECT_EQ(0, c.cache_hits) TH_LOG("corruption %d", how);
		EXPECT_EQ(1, c.cache_writes) TH_LOG("corruption %d", how);
		EXPECT_TRUE(cache_entry_valid()) TH_LOG("corruption %d: not rewritten", how);
	}
	test_rmtree(dir);
}

/* A well-formed entry whose binary the driver refuses is rebuilt from source and replaced. */
TEST(cache_refused_binary_is_rebuilt)
{
	static const char junk[] = "not a program binary";
	struct ape__ocl_debug_counters c;
	char dir[256];
	size_t len;
	unsigned char *f;

	cache_dir_fresh(dir, sizeof(dir));
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape__progcache_store(entry_key, junk, sizeof(junk)));
	ASSERT_TRUE(cache_entry_valid());
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, c.cache_rejects);
	EXPECT_EQ(1, c.builds);
	EXPECT_EQ(0, c.cache_hits);
	EXPECT_EQ(1, c.cache_writes);
	f = test_read_file(entry_path, &len);
	ASSERT_NE(NULL, f);
	EXPECT_GT(len, APE__CACHE_HEADER + strlen(entry_key) + sizeof(junk)); /* the real binary */
	free(f);
	test_rmtree(dir);
}

TEST(cache_untrusted_entry_is_not_used)
{
	struct ape__ocl_debug_counters c;
	char dir[256];
	struct stat st;

	cache_dir_fresh(dir, sizeof(dir));
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());

	ASSERT_EQ(0, chmod(entry_path, 0620)); /* group-writable */
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, c.builds);
	EXPECT_EQ(0, c.cache_hits);
	EXPECT_EQ(1, c.cache_rejects);
	ASSERT_EQ(0, stat(entry_path, &st));
	EXPECT_EQ(0600, st.st_mode & 0777); /* replaced by a private one */

	if (geteuid() == 0) { /* only root can hand a file to someone else */
		ASSERT_EQ(0, chown(entry_path, 12345, 12345));
		ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(1, c.builds);
		EXPECT_EQ(0, c.cache_hits);
		ASSERT_EQ(0, stat(entry_path, &st));
		EXPECT_EQ(getuid(), st.st_uid);
	} else {
		ksft_print_msg("cache_untrusted_entry_is_not_used: not root, foreign owner checked "
			       "through ape__progcache_trusted() only\n");
		fflush(stdout);
	}

	/* a directory others may write to is not used at all (and says so) */
	ASSERT_EQ(0, chmod(dir, 0770));
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, c.builds);
	EXPECT_EQ(0, c.cache_hits);
	EXPECT_EQ(0, c.cache_writes);
	chmod(dir, 0700);
	test_rmtree(dir);
}

/*
 * A program already in the cache is loaded when the context is created, not in the first call
 * (a fresh process's first call paid about 45 ms of PoCL's binary load inside total_ms): by
 * default the variant used last (its entry's time, renewed at each load), with
 * APE_OCL_PRELOAD=all every cached variant, with a list of head dimensions those, with 0 none.
 */
TEST(cache_loaded_at_context_creation)
{
	struct ape__ocl_debug_counters c, o;
	char dir[256];

	cache_dir_fresh(dir, sizeof(dir));
	ASSERT_NE(0, dir[0]);
	unsetenv("APE_OCL_PRELOAD");
	/* an empty cache: nothing to load at creation, built by the call */
	ASSERT_EQ(0, forward_counted_d(&c, 64, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, o.cache_hits + o.builds + o.preloads);
	EXPECT_EQ(1, c.builds);

	/* the entry is loaded by ape_context_create(); the call loads nothing more */
	ASSERT_EQ(0, forward_counted_d(&c, 64, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, o.cache_hits);
	EXPECT_EQ(1, o.preloads);
	EXPECT_EQ(0, o.builds);
	EXPECT_EQ(1, c.cache_hits);
	EXPECT_EQ(1, c.preloads);
	EXPECT_EQ(0, c.builds);

	/* a second variant (D = 6, the generic program), built by its call: now the one used
	 * last, so the next context loads it alone, and D = 64 is loaded by its call */
	ASSERT_EQ(0, forward_counted_d(&c, 6, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, o.preloads); /* D = 64 still the last used */
	EXPECT_EQ(1, c.builds);
	ASSERT_EQ(0, forward_counted_d(&c, 64, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, o.preloads);
	EXPECT_EQ(1, o.cache_hits);
	EXPECT_EQ(2, c.cache_hits); /* the generic one preloaded, D = 64 loaded by the call */
	EXPECT_EQ(0, c.builds);
	/* ... which makes D = 64 the last used again */
	ASSERT_EQ(0, forward_counted_d(&c, 64, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, o.preloads);
	EXPECT_EQ(1, c.cache_hits);

	setenv("APE_OCL_PRELOAD", "all", 1);
	ASSERT_EQ(0, forward_counted_d(&c, 64, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(2, o.preloads);
	EXPECT_EQ(2, c.cache_hits);
	setenv("APE_OCL_PRELOAD", "6", 1);
	ASSERT_EQ(0, forward_counted_d(&c, 64, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, o.preloads);
	EXPECT_EQ(2, c.cache_hits); /* D = 6's preloaded, D = 64's by the call */
	setenv("APE_OCL_PRELOAD", "0", 1);
	ASSERT_EQ(0, forward_counted_d(&c, 64, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, o.preloads + o.cache_hits);
	EXPECT_EQ(1, c.cache_hits); /* lazily, as before */
	EXPECT_EQ(0, c.preloads);
	unsetenv("APE_OCL_PRELOAD");
	test_rmtree(dir);
}

TEST(cache_trust_rules)
{
	struct stat st;

	memset(&st, 0, sizeof(st));
	st.st_uid = 1000;
	st.st_mode = S_IFREG | 0600;
	EXPECT_TRUE(ape__progcache_trusted(&st, 1000));
	EXPECT_FALSE(ape__progcache_trusted(&st, 1001)); /* another owner */
	st.st_mode = S_IFREG | 0644;
	EXPECT_TRUE(ape__progcache_trusted(&st, 1000)); /* readable by others is fine */
	st.st_mode = S_IFREG | 0620;
	EXPECT_FALSE(ape__progcache_trusted(&st, 1000));
	st.st_mode = S_IFREG | 0602;
	EXPECT_FALSE(ape__progcache_trusted(&st, 1000));
	st.st_mode = S_IFDIR | 0777;
	EXPECT_FALSE(ape__progcache_trusted(&st, 1000));
}

TEST(cache_disabled_writes_nothing)
{
	struct ape__ocl_debug_counters c;
	char dir[256];

	cache_dir_fresh(dir, sizeof(dir));
	setenv("APE_NO_CACHE", "1", 1);
	ASSERT_EQ(0, forward_counted(&c)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, c.builds);
	EXPECT_EQ(0, c.cache_writes);
	EXPECT_EQ(0, test_count_entries(dir, NULL, 0));
	unsetenv("APE_NO_CACHE");
	test_rmtree(dir);
}

/* An unusable directory: one warning on stderr, results as always. */
TEST(cache_unusable_directory)
{
	char log[] = "/tmp/ape-test-stderr-XXXXXX";
	int fd = mkstemp(log), saved;
	struct devs d;
	ape_rng rng;
	test_problem tp;
	ape_stats st;
	unsigned char *text;

	ASSERT_GE(fd, 0);
	setenv("APE_CACHE_DIR", "/proc/nonexistent/libape", 1);
	unsetenv("APE_NO_CACHE");
	fflush(stderr);
	saved = dup(2);
	dup2(fd, 2);
	devs_open(_metadata, &d);
	ape_rng_init(&rng, "cache_unusable_directory");
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 2, 50, 50, 64, APE_F32));
	test_problem_random_params(&tp, &rng);
	EXPECT_EQ(0, compare(_metadata, &d, &tp, &st, "unusable cache", NULL));
	test_problem_free(&tp);
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 2, 50, 50, 6, APE_F32)); /* a second program */
	EXPECT_EQ(0, compare(_metadata, &d, &tp, &st, "unusable cache", NULL));
	test_problem_free(&tp);
	ape_context_destroy(d.ctx);
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	close(fd);
	text = test_read_file(log, NULL);
	unlink(log);
	ASSERT_NE(NULL, text);
	EXPECT_NE(NULL, strstr((char *)text, "libape: program cache not used"))
		TH_LOG("stderr was: %s", text);
	/* once, not once per program */
	EXPECT_EQ(NULL, strstr(strstr((char *)text, "libape: program cache") + 1,
			       "libape: program cache"));
	free(text);
}

/* Where entries go: APE_CACHE_DIR, else $XDG_CACHE_HOME/libape, else $HOME/.cache/libape. */
TEST(cache_directory_resolution)
{
	char path[4096];

	unsetenv("APE_NO_CACHE");
	setenv("APE_CACHE_DIR", "/nonexistent/ape-a", 1);
	setenv("XDG_CACHE_HOME", "/nonexistent/ape-b", 1);
	setenv("HOME", "/nonexistent/ape-c", 1);
	ASSERT_EQ(0, ape__progcache_path("k", path, sizeof(path)));
	EXPECT_EQ(0, strncmp(path, "/nonexistent/ape-a/", 19)) TH_LOG("%s", path);
	unsetenv("APE_CACHE_DIR");
	ASSERT_EQ(0, ape__progcache_path("k", path, sizeof(path)));
	EXPECT_EQ(0, strncmp(path, "/nonexistent/ape-b/libape/", 26)) TH_LOG("%s", path);
	setenv("XDG_CACHE_HOME", "relative/is/ignored", 1); /* as the XDG spec says */
	ASSERT_EQ(0, ape__progcache_path("k", path, sizeof(path)));
	EXPECT_EQ(0, strncmp(path, "/nonexistent/ape-c/.cache/libape/", 33)) TH_LOG("%s", path);
	unsetenv("XDG_CACHE_HOME");
	unsetenv("HOME");
	EXPECT_EQ(APE__CACHE_UNUSABLE, ape__progcache_path("k", path, sizeof(path)));
	setenv("APE_CACHE_DIR", "/nonexistent/ape-a", 1);
	setenv("APE_NO_CACHE", "1", 1);
	EXPECT_EQ(APE__CACHE_DISABLED, ape__progcache_path("k", path, sizeof(path)));
	setenv("APE_NO_CACHE", "0", 1); /* "0" does not disable */
	EXPECT_EQ(0, ape__progcache_path("k", path, sizeof(path)));
}

/* The pure parser on malformed entries: every truncation, every flipped byte, other keys. */
TEST(cache_parse_malformed)
{
	static const char key[] = "libape test key\nline two";
	unsigned char payload[200], *f, *g;
	const void *p;
	size_t n, plen;

	for (size_t i = 0; i < sizeof(payload); i++)
		payload[i] = (unsigned char)(i * 7 + 1);
	n = ape__progcache_format(NULL, 0, key, payload, sizeof(payload));
	ASSERT_EQ(APE__CACHE_HEADER + strlen(key) + sizeof(payload), n);
	f = malloc(n + 1);
	ASSERT_NE(NULL, f);
	ASSERT_EQ(n, ape__progcache_format(f, n, key, payload, sizeof(payload)));
	ASSERT_EQ(APE__CACHE_HIT, ape__progcache_parse(f, n, key, &p, &plen));
	ASSERT_EQ(sizeof(payload), plen);
	EXPECT_EQ(0, memcmp(p, payload, plen));

	/* every truncation point, each in an allocation of exactly that size (ASan would see an
	 * overread) */
	for (size_t len = 0; len < n; len++) {
		g = malloc(len ? len : 1);
		ASSERT_NE(NULL, g);
		memcpy(g, f, len);
		EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(g, len, key, &p, &plen))
			TH_LOG("truncated to %zu bytes", len);
		EXPECT_EQ(NULL, p);
		free(g);
	}
	f[n] = 0; /* trailing garbage */
	EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(f, n + 1, key, &p, &plen));
	for (size_t i = 0; i < n; i++) {
		f[i] ^= 0x10;
		EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(f, n, key, &p, &plen))
			TH_LOG("byte %zu flipped", i);
		f[i] ^= 0x10;
	}
	EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(f, n, "libape test key", &p, &plen));
	EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(f, n, "", &p, &plen));
	EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(NULL, 0, key, &p, &plen));
	/* sizes that would overflow if trusted */
	memset(f + 16, 0xff, 8);
	EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(f, n, key, &p, &plen));
	memset(f + 12, 0xff, 4);
	EXPECT_EQ(APE__CACHE_CORRUPT, ape__progcache_parse(f, n, key, &p, &plen));
	free(f);

	/* an empty payload is a valid entry */
	n = ape__progcache_format(NULL, 0, key, NULL, 0);
	f = malloc(n);
	ASSERT_NE(NULL, f);
	ape__progcache_format(f, n, key, NULL, 0);
	EXPECT_EQ(APE__CACHE_HIT, ape__progcache_parse(f, n, key, &p, &plen));
	EXPECT_EQ(0, plen);
	free(f);
}


OPENCL_TEST_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the OpenCL backend is not built into this libape")
#endif /* APE_HAVE_OPENCL */
