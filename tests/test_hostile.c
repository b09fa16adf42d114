/* SPDX-License-Identifier: MIT */
/*
 * A hostile environment: a cache directory that cannot be written or must not be trusted, no
 * HOME, no OpenCL driver (no ICD file, an ICD file naming a library that does not exist, PoCL
 * told to show no device), no CUDA driver. In every case libape must still start, the reference
 * backend must still compute, and the context (and ape-info) must say what is missing: each test
 * asserts the message text.
 *
 * The harness runs each test in its own process, so a test may change the environment freely;
 * OpenCL is touched only after the variables are set (ICD loaders read them once per process).
 * Ownership cases need another user: as root the test makes one (chown, setuid in a child);
 * otherwise it uses directories that root owns.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dlfcn.h>

#include "ape_test.h"
#include "core/progcache.h"

#define NOBODY 65534 /* the uid and gid Debian gives "nobody" */

static char out[1 << 16], err[1 << 16];

/* ape-info in this environment: its exit status; what it printed in out and err. */
static int ape_info(void)
{
	static const char *const no_args[] = { NULL };

	return test_run_tool("ape-info", no_args, NULL, out, sizeof(out), err, sizeof(err));
}

/* ---------------------------------------------------------------- helpers */

/* stderr of this process goes to a file from capture_begin() to capture_end(), which returns
 * what was written: libape's warnings are the behaviour under test. */
static int saved_stderr = -1, capture_fd = -1;

static void capture_begin(void)
{
	char name[] = "/tmp/ape-hostile-err-XXXXXX";

	fflush(stderr);
	capture_fd = mkstemp(name);
	unlink(name);
	saved_stderr = dup(2);
	dup2(capture_fd, 2);
}

static const char *capture_end(void)
{
	ssize_t n;

	fflush(stderr);
	dup2(saved_stderr, 2);
	close(saved_stderr);
	n = pread(capture_fd, err, sizeof(err) - 1, 0);
	err[n > 0 ? n : 0] = '\0';
	close(capture_fd);
	return err;
}

/* A fresh directory under /tmp, mode 0700. */
static void make_dir(char *buf, size_t cap)
{
	snprintf(buf, cap, "/tmp/ape-hostile-XXXXXX");
	if (!mkdtemp(buf))
		buf[0] = '\0';
}

/* Points the cache at dir (or at nothing: NULL) and makes sure nothing else chooses it. */
static void cache_env(const char *dir)
{
	unsetenv("APE_NO_CACHE");
	if (dir)
		setenv("APE_CACHE_DIR", dir, 1);
	else
		unsetenv("APE_CACHE_DIR");
}

/* The reference device of ctx computes a tiny problem: libape still works. */
static int ref_forward_works(ape_context *ctx)
{
	static float q[2 * 4 * 8], k[4 * 8], v[4 * 8], o[2 * 4 * 8];
	ape_tensor tq, tk, tv, to;
	ape_attn_desc desc;
	ape_selection sel;

	if (ape_device_select(ctx, "ref", -1, &sel))
		return -1;
	for (int i = 0; i < 4 * 8; i++)
		q[i] = q[32 + i] = k[i] = v[i] = (float)(i % 7) * 0.25f;
	ape_attn_desc_init(&desc);
	ape_tensor_init(&tq, q, APE_F32, 1, 2, 4, 8);
	ape_tensor_init(&tk, k, APE_F32, 1, 1, 4, 8);
	ape_tensor_init(&tv, v, APE_F32, 1, 1, 4, 8);
	ape_tensor_init(&to, o, APE_F32, 1, 2, 4, 8);
	return ape_attention_forward(sel.device, &desc, &tq, &tk, &tv, &to, NULL, NULL);
}

/* The backend called `name` in ctx. */
static int backend_info(ape_context *ctx, const char *name, ape_backend_info *info)
{
	int n = ape_backend_get_info(ctx, 0, NULL);

	for (int i = 0; i < n; i++)
		if (!ape_backend_get_info(ctx, i, info) && !strcmp(info->name, name))
			return 0;
	return -1;
}

/*
 * Checks the cache directory as the OpenCL backend does before it stores a program, in a child
 * process that runs as `uid` (when >= 0; needs root): returns its verdict and puts libape's
 * warning in msg.
 */
static int cache_usable_as(int uid, const char *dir, char *msg, size_t cap)
{
	int fds[2], status, ret;
	size_t len = 0;
	ssize_t n;
	pid_t pid;

	if (pipe(fds))
		return -1;
	fflush(stderr);
	pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		close(fds[0]);
		dup2(fds[1], 2);
		if (uid >= 0 && (setgid((gid_t)uid) || setuid((uid_t)uid)))
			_exit(100);
		cache_env(dir);
		ret = ape__progcache_usable();
		/* a store must refuse quietly (the one warning is already out) */
		if (ret == APE__CACHE_UNUSABLE &&
		    ape__progcache_store("k", "x", 1) != APE__CACHE_UNUSABLE)
			_exit(101);
		_exit(ret);
	}
	close(fds[1]);
	/* to the end: stderr is unbuffered, so the warning comes in pieces */
	while (len < cap - 1 && (n = read(fds[0], msg + len, cap - 1 - len)) > 0)
		len += (size_t)n;
	msg[len] = '\0';
	close(fds[0]);
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return -1;
	return WEXITSTATUS(status);
}

/* ---------------------------------------------------------------- the program cache */

TEST(cache_dir_not_writable)
{
	char dir[64], want[160], msg[1024];
	bool root = geteuid() == 0;

	make_dir(dir, sizeof(dir));
	ASSERT_NE('\0', dir[0]);
	/* root writes anywhere: then the directory belongs to nobody, and nobody checks it */
	if (root)
		ASSERT_EQ(0, chown(dir, NOBODY, NOBODY));
	ASSERT_EQ(0, chmod(dir, 0500));
	EXPECT_EQ(APE__CACHE_UNUSABLE, cache_usable_as(root ? NOBODY : -1, dir, msg, sizeof(msg)))
		TH_LOG("%s", msg);
	snprintf(want, sizeof(want), "libape: program cache not used (%s: not writable: %s)", dir,
		 strerror(EACCES));
	EXPECT_NE(NULL, strstr(msg, want)) TH_LOG("want '%s' in: %s", want, msg);
	EXPECT_NE(NULL, strstr(msg, "compiling device programs from source")) TH_LOG("%s", msg);
	/* nothing was left in it */
	EXPECT_EQ(0, test_count_entries(dir, NULL, 0));
	rmdir(dir);
}

TEST(cache_dir_foreign_owned)
{
	char dir[64], want[160], msg[1024];

	if (geteuid() == 0) {
		make_dir(dir, sizeof(dir));
		ASSERT_NE('\0', dir[0]);
		ASSERT_EQ(0, chown(dir, NOBODY, NOBODY));
	} else {
		snprintf(dir, sizeof(dir), "/"); /* root's, and we are not root */
	}
	EXPECT_EQ(APE__CACHE_UNUSABLE, cache_usable_as(-1, dir, msg, sizeof(msg)))
		TH_LOG("%s", msg);
	snprintf(want, sizeof(want), "program cache not used (%s: owned by another user)", dir);
	EXPECT_NE(NULL, strstr(msg, want)) TH_LOG("want '%s' in: %s", want, msg);
	if (strcmp(dir, "/"))
		rmdir(dir);
}

TEST(cache_dir_group_or_world_writable)
{
	static const mode_t modes[] = { 0770, 0707, 0777 };
	char dir[64], want[160], msg[1024];

	make_dir(dir, sizeof(dir));
	ASSERT_NE('\0', dir[0]);
	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		ASSERT_EQ(0, chmod(dir, modes[i]));
		EXPECT_EQ(APE__CACHE_UNUSABLE, cache_usable_as(-1, dir, msg, sizeof(msg)))
			TH_LOG("mode %o: %s", (unsigned)modes[i], msg);
		snprintf(want, sizeof(want),
			 "program cache not used (%s: writable by group or others)", dir);
		EXPECT_NE(NULL, strstr(msg, want)) TH_LOG("mode %o: %s", (unsigned)modes[i], msg);
	}
	rmdir(dir);
}

/* An entry file someone else could have written is never used, even in a trusted directory. */
TEST(cache_entry_untrusted)
{
	char dir[64], path[4096];
	void *blob;
	size_t len;

	make_dir(dir, sizeof(dir));
	ASSERT_NE('\0', dir[0]);
	cache_env(dir);
	ASSERT_EQ(0, ape__progcache_store("entry", "payload", 7));
	ASSERT_EQ(0, ape__progcache_path("entry", path, sizeof(path)));
	ASSERT_EQ(APE__CACHE_HIT, ape__progcache_load("entry", &blob, &len));
	free(blob);
	ASSERT_EQ(0, chmod(path, 0666));
	EXPECT_EQ(APE__CACHE_UNTRUSTED, ape__progcache_load("entry", &blob, &len));
	EXPECT_EQ(NULL, blob);
	if (geteuid() == 0) { /* another owner, with safe permissions */
		ASSERT_EQ(0, chmod(path, 0600));
		ASSERT_EQ(0, chown(path, NOBODY, NOBODY));
		EXPECT_EQ(APE__CACHE_UNTRUSTED, ape__progcache_load("entry", &blob, &len));
	}
	/* the next store replaces it with our own */
	EXPECT_EQ(0, ape__progcache_store("entry", "payload", 7));
	EXPECT_EQ(APE__CACHE_HIT, ape__progcache_load("entry", &blob, &len));
	free(blob);
	test_rmtree(dir);
}

TEST(no_home_no_xdg_cache_home)
{
	ape_context *ctx = NULL;
	const char *msg;
	char path[4096];

	cache_env(NULL);
	unsetenv("XDG_CACHE_HOME");
	unsetenv("HOME");
	EXPECT_EQ(APE__CACHE_UNUSABLE, ape__progcache_path("k", path, sizeof(path)));
	capture_begin();
	EXPECT_EQ(APE__CACHE_UNUSABLE, ape__progcache_usable());
	msg = capture_end();
	EXPECT_NE(NULL, strstr(msg, "program cache not used (neither APE_CACHE_DIR, XDG_CACHE_HOME "
				    "nor HOME is set)"))
		TH_LOG("%s", msg);
	/* the library starts and computes without anywhere to cache */
	ASSERT_EQ(0, ape_context_create(&ctx, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ref_forward_works(ctx)) TH_LOG("%s", ape_last_error());
	ape_context_destroy(ctx);
	EXPECT_EQ(0, ape_info()) TH_LOG("%s", err);
	EXPECT_NE(NULL, strstr(out, "ref      available")) TH_LOG("%s", out);

	/* HOME alone, or an XDG_CACHE_HOME that is not absolute (the XDG spec says to ignore it) */
	setenv("HOME", "/nonexistent-home", 1);
	ASSERT_EQ(0, ape__progcache_path("k", path, sizeof(path)));
	EXPECT_EQ(0, strncmp(path, "/nonexistent-home/.cache/libape/", 32)) TH_LOG("%s", path);
	setenv("XDG_CACHE_HOME", "relative/cache", 1);
	ASSERT_EQ(0, ape__progcache_path("k", path, sizeof(path)));
	EXPECT_EQ(0, strncmp(path, "/nonexistent-home/.cache/libape/", 32)) TH_LOG("%s", path);
}

/* ---------------------------------------------------------------- drivers */

/*
 * Creates a context in this environment and checks that it starts, the reference computes, and
 * `backend` is unavailable with a reason containing `want` (or, when the backend is not built
 * into this libape, the reason saying so). ape-info must say the same.
 */
static void expect_backend_absent(struct __test_metadata *_metadata, const char *backend,
				  const char *want)
{
	ape_context *ctx = NULL;
	ape_backend_info info;
	ape_selection sel;
	char line[512];

	ASSERT_EQ(0, ape_context_create(&ctx, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ref_forward_works(ctx)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, backend_info(ctx, backend, &info));
	EXPECT_FALSE(info.available);
	if (!info.built)
		want = "not built into this libape";
	EXPECT_NE(NULL, strstr(info.reason, want)) TH_LOG("%s: want '%s' in '%s'", backend, want,
							   info.reason);
	/* auto passes it over and says why */
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel)) TH_LOG("%s", ape_last_error());
	if (!strcmp(backend, "cuda"))
		EXPECT_NE(NULL, strstr(sel.note, info.reason)) TH_LOG("%s", sel.note);
	ape_context_destroy(ctx);

	ASSERT_EQ(0, ape_info()) TH_LOG("%s", err);
	snprintf(line, sizeof(line), "%-8s not available: %s", backend, info.reason);
	EXPECT_NE(NULL, strstr(out, line)) TH_LOG("want '%s' in:\n%s", line, out);
}

/* PoCL (or any driver) uninstalled: the ICD loader finds no vendor file at all. */
TEST(opencl_no_icd_file)
{
	char dir[64], want[160];

	make_dir(dir, sizeof(dir));
	ASSERT_NE('\0', dir[0]);
	setenv("OCL_ICD_VENDORS", dir, 1);
	snprintf(want, sizeof(want), "no OpenCL platform: no ICD file (*.icd) in %s", dir);
	expect_backend_absent(_metadata, "opencl", want);
	rmdir(dir);
}

/* An ICD file left behind by a driver that is gone. */
TEST(opencl_icd_names_missing_library)
{
	char dir[64], icd[128], want[256];
	FILE *f;

	make_dir(dir, sizeof(dir));
	ASSERT_NE('\0', dir[0]);
	snprintf(icd, sizeof(icd), "%s/gone.icd", dir);
	f = fopen(icd, "w");
	ASSERT_NE(NULL, f);
	fprintf(f, "/nonexistent/libgone-opencl.so\n");
	fclose(f);
	setenv("OCL_ICD_VENDORS", dir, 1);
	snprintf(want, sizeof(want),
		 "no OpenCL platform: %s names /nonexistent/libgone-opencl.so, which does not "
		 "exist", icd);
	expect_backend_absent(_metadata, "opencl", want);
	unlink(icd);
	rmdir(dir);
}

/* PoCL installed but told to offer no device. */
TEST(opencl_pocl_devices_none)
{
	static const char pocl_icd[] = "/etc/OpenCL/vendors/pocl.icd";

	if (access(pocl_icd, R_OK))
		SKIP(return, "PoCL is not installed (%s missing)", pocl_icd);
	setenv("OCL_ICD_VENDORS", pocl_icd, 1); /* PoCL alone, whatever else is installed */
	setenv("POCL_DEVICES", "none", 1);
	expect_backend_absent(_metadata, "opencl",
			      "no usable OpenCL device on 1 platform: Portable Computing Language "
			      "reports no device (POCL_DEVICES=none)");
}

/* The ICD loader itself (libOpenCL.so.1) is missing: here an unloadable file stands in for it,
 * found first through LD_LIBRARY_PATH. */
/* An empty file named `soname` in a new directory put first on LD_LIBRARY_PATH (read by the
 * child processes only: this one's loader took it at start). lib is left empty on failure. */
static void unloadable_lib(const char *soname, char *dir, size_t dcap, char *lib, size_t lcap)
{
	int fd;

	lib[0] = '\0';
	make_dir(dir, dcap);
	if (!dir[0])
		return;
	snprintf(lib, lcap, "%s/%s", dir, soname);
	fd = open(lib, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0) {
		lib[0] = '\0';
		return;
	}
	close(fd);
	setenv("LD_LIBRARY_PATH", dir, 1);
}

TEST(opencl_loader_missing)
{
	char dir[64], lib[128];

	unloadable_lib("libOpenCL.so.1", dir, sizeof(dir), lib, sizeof(lib));
	ASSERT_NE('\0', lib[0]);
	EXPECT_EQ(0, ape_info()) TH_LOG("ape-info did not start: %s", err);
	if (strstr(out, "opencl   not available: not built into this libape")) {
		TH_LOG("the OpenCL backend is not built here: nothing to load");
	} else {
		EXPECT_NE(NULL, strstr(out, "opencl   not available: no OpenCL platform: cannot "
					    "load libOpenCL.so.1, the ICD loader ("))
			TH_LOG("%s", out);
	}
	EXPECT_NE(NULL, strstr(out, "ref      available")) TH_LOG("%s", out);
	unlink(lib);
	rmdir(dir);
}

TEST(cuda_driver_missing)
{
	void *h;

	/* a driver named explicitly that is not there */
	setenv("APE_CUDA_LIBRARY", "/nonexistent/libcuda.so.1", 1);
	expect_backend_absent(_metadata, "cuda",
			      "APE_CUDA_LIBRARY=/nonexistent/libcuda.so.1: cannot load it");
	/* the usual case: no driver installed (on a GPU machine there is one to find) */
	unsetenv("APE_CUDA_LIBRARY");
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (h) {
		TH_LOG("libcuda.so.1 is installed here: only the APE_CUDA_LIBRARY case applies");
		dlclose(h);
		return;
	}
	expect_backend_absent(_metadata, "cuda", "libcuda.so.1 not found");
}

/* A libcuda.so.1 that is there but cannot be loaded (a broken install): not "not found", but
 * the loader's own words. An empty file stands in for it, found first through LD_LIBRARY_PATH. */
TEST(cuda_driver_broken)
{
	char dir[64], lib[128];

	unloadable_lib("libcuda.so.1", dir, sizeof(dir), lib, sizeof(lib));
	ASSERT_NE('\0', lib[0]);
	EXPECT_EQ(0, ape_info()) TH_LOG("ape-info did not start: %s", err);
	if (strstr(out, "cuda     not available: not built into this libape")) {
		TH_LOG("the CUDA backend is not built here: nothing to load");
	} else {
		EXPECT_NE(NULL, strstr(out, "cuda     not available: libcuda.so.1 cannot be "
					    "loaded: "))
			TH_LOG("%s", out);
		EXPECT_NE(NULL, strstr(out, "file too short")) TH_LOG("%s", out);
	}
	EXPECT_NE(NULL, strstr(out, "ref      available")) TH_LOG("%s", out);
	unlink(lib);
	rmdir(dir);
}

TEST_HARNESS_MAIN
