/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the plugin loader's public calls (runtime/api/plugins.c, include/ape/ape.h
 * "ape_context_options.backend_path"): where a context finds its backend plugins, what it lists
 * of them, and what it hands out of their tables. The input describes one ape_context_create():
 *
 * - its plugin path: ':'-joined entries, each one of the files of a folder the target makes
 *   once under /tmp (removed at exit): libape-backend-a.so (text, not ELF), -b.so (empty),
 *   other.so, libape-backend-.so and -c.so.1 (not plugin names), a folder named like a plugin,
 *   symlinks (to a file, dangling, to itself), a subfolder sub/ holding a bare ELF header, a
 *   symlink to -b.so and one to the C library (an ELF object that is no plugin), missing files
 *   and folders; or the folder itself (with or without a trailing '/'); or a name of the
 *   input's bytes inside it; or raw bytes (':', '/' and all, NUL left out); or empty entries;
 *   or paths around 4096 bytes (a folder of 4095 whose files' paths are longer, entries of
 *   4096 and past); or names without a '/' (relative to the working directory: the loader
 *   must not search for them);
 * - given as ape_context_options.backend_path, as "" (none), or as APE_BACKEND_PATH with
 *   backend_path NULL (or NULL with the variable unset);
 * - APE_CONTEXT_NO_PLUGIN_DIR or not, the plugin folder (ape__plugin_folder, as the tests set
 *   it) sub/, the whole folder, NULL, "", missing, a file, 4095 or 4096 bytes long;
 * - ape_context_options.backends NULL, "ref", "ref,NAME" or "NAME" (NAME of the input's bytes);
 * - then ape_plugin_get_info() at every index, out of range (-1, the count, INT_MIN, INT_MAX, a
 *   raw int) and with NULL arguments, and ape_backend_get_proc() with names of the input's
 *   bytes, "ref" and NULL arguments.
 *
 * Promises checked:
 * - ape_context_create() fails exactly when opts->backends names a backend the registry does
 *   not have (no plugin here states a name): APE_EINVAL, *out NULL, the message naming the
 *   call and, where the list leaves room in the message, the unknown name; or APE_ENOMEM;
 * - a context lists exactly the plugins the documentation promises, in order (checked against
 *   an independent walk of the same path: each entry's folder's libape-backend-*.so that are
 *   files, in name order; a file; a missing entry when its name is a shared object's; paths
 *   of 4096 bytes or more as such), each with its path (cut at 4095 bytes), NUL-terminated
 *   fields, no name, no ABI, not loaded, no device, and the reason its kind gives ("not
 *   found: ", "dlopen: ", "not a libape backend: ", "not loaded: the path is longer ...");
 *   and no backend beyond the registry's;
 * - ape_plugin_get_info() out of range, or with ctx NULL, is APE_EINVAL naming the call and
 *   writes nothing; with info NULL it is the count;
 * - ape_backend_get_proc() returns NULL for every name here (the reference backend has no
 *   proc_address; no plugin loads) and for NULL arguments.
 *
 * FUZZ_TRACE=1 prints each input's path, options and outcome.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <link.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape/ape.h"
#include "api/plugins.h"
#include "api/registry.h"
#include "say.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define PATH_CAP 4096 /* ape_plugin_info.path, and what the loader stats */

static char dir[64]; /* the folder of test files, /tmp/ape-fuzz-plugins-XXXXXX */
static char *long_folder[2]; /* "////...DIR/sub": 4095 and 4096 bytes */
static char *env_str; /* "APE_BACKEND_PATH=..." while it is in the environment */
static const struct ape__registry_entry *reg;
static int nreg;

static void check(int cond, const char *what)
{
	if (!cond) {
		fprintf(stderr, "fuzz_plugins: broken promise: %s (last error: %s)\n", what,
			ape_last_error());
		abort();
	}
}


/* ---------------------------------------------------------------- the folder of test files */

/* Entries of the folder, after DIR: what each is is set up in LLVMFuzzerInitialize(). */
static const char *const fixed[16] = {
	"",				/* the folder */
	"/",				/* the folder, with a trailing '/' */
	"/libape-backend-a.so",		/* text */
	"/libape-backend-b.so",		/* empty */
	"/other.so",			/* text, not a plugin's name */
	"/libape-backend-.so",		/* text, a name too short for a plugin's */
	"/libape-backend-c.so.1",	/* text, not a plugin's name */
	"/libape-backend-d.so",		/* an empty folder */
	"/libape-backend-e.so",		/* a symlink to libape-backend-a.so */
	"/libape-backend-f.so",		/* a dangling symlink */
	"/libape-backend-g.so",		/* a symlink to itself */
	"/loop",			/* a symlink to itself */
	"/sub",				/* a folder */
	"/sub/libape-backend-libc.so",	/* a symlink to the C library: ELF, no plugin */
	"/gone.so",			/* missing, a file's name */
	"/gone",			/* missing, a folder's name */
};

/* Names without a '/': files of the working directory (the repository's root under make fuzz),
 * not ones for the dynamic loader to search for. */
static const char *const relative[6] = {
	"Makefile", ".", "libape-backend-a.so", "nowhere", "x.so.1", "README.md",
};

static void make_file(const char *name, const void *bytes, size_t n)
{
	char path[256];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "w");
	check(f != NULL, "creating a test file");
	check(fwrite(bytes, 1, n, f) == n && fclose(f) == 0, "writing a test file");
}

static void make_text(const char *name, const char *text)
{
	make_file(name, text, strlen(text));
}

static void make_link(const char *target, const char *name)
{
	char path[256];

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	check(symlink(target, path) == 0, "creating a test symlink");
}

static int find_libc(struct dl_phdr_info *info, size_t size, void *out)
{
	(void)size;
	if (info->dlpi_name && strstr(info->dlpi_name, "/libc.so")) {
		snprintf(out, PATH_CAP, "%s", info->dlpi_name);
		return 1;
	}
	return 0;
}

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	remove(path);
	return 0;
}

/* libFuzzer ends with exit(): leave no folder behind. */
static void remove_dir(void)
{
	nftw(dir, remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* "/" repeated, then DIR and tail: `len` bytes (or DIR and tail as they are, if longer). */
static char *padded(const char *tail, size_t len)
{
	size_t n = strlen(dir) + strlen(tail), pad = len > n ? len - n : 0;
	char *s = malloc(pad + n + 1);

	check(s != NULL, "malloc");
	memset(s, '/', pad);
	snprintf(s + pad, n + 1, "%s%s", dir, tail);
	return s;
}

static void free_long(void)
{
	free(long_folder[0]);
	free(long_folder[1]);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	/* an ELF header's identification (64-bit, little-endian, version 1), nothing after it */
	static const char elf[64] = { 0x7f, 'E', 'L', 'F', 2, 1, 1 };
	char libc[PATH_CAP] = "";
	char path[256];

	(void)argc;
	(void)argv;
	/* a raw entry naming /dev/stdin would have dlopen() wait for a terminal */
	check(freopen("/dev/null", "r", stdin) != NULL, "stdin from /dev/null");
	snprintf(dir, sizeof(dir), "/tmp/ape-fuzz-plugins-XXXXXX");
	check(mkdtemp(dir) != NULL, "mkdtemp");
	atexit(remove_dir);
	make_text("libape-backend-a.so", "A text file named as a plugin, not an ELF object: "
					 "longer than an ELF header, the loader reads it.\n");
	make_text("libape-backend-b.so", "");
	make_text("other.so", "not an ELF file either\n");
	make_text("libape-backend-.so", "a name too short\n");
	make_text("libape-backend-c.so.1", "versioned\n");
	snprintf(path, sizeof(path), "%s/libape-backend-d.so", dir);
	check(mkdir(path, 0700) == 0, "mkdir");
	make_link("libape-backend-a.so", "libape-backend-e.so");
	make_link("gone.so", "libape-backend-f.so");
	make_link("libape-backend-g.so", "libape-backend-g.so");
	make_link("loop", "loop");
	snprintf(path, sizeof(path), "%s/sub", dir);
	check(mkdir(path, 0700) == 0, "mkdir");
	make_file("sub/libape-backend-s.so", elf, sizeof(elf));
	make_link("../libape-backend-b.so", "sub/libape-backend-t.so");
	dl_iterate_phdr(find_libc, libc);
	/* without it, a text file in its place: still listed, only the reason differs */
	if (libc[0])
		make_link(libc, "sub/libape-backend-libc.so");
	else
		make_text("sub/libape-backend-libc.so", "no C library found\n");
	long_folder[0] = padded("/sub", PATH_CAP - 1);
	long_folder[1] = padded("/sub", PATH_CAP);
	atexit(free_long);
	unsetenv("APE_BACKEND_PATH");
	reg = ape__registry(&nreg);
	return 0;
}

/* ---------------------------------------------------------------- reading the input */

struct in {
	const uint8_t *p;
	size_t n;
};

static unsigned take(struct in *in) /* one byte; 0 once exhausted */
{
	if (!in->n)
		return 0;
	in->n--;
	return *in->p++;
}

struct buf {
	char *p;
	size_t n, cap;
};

static void put(struct buf *b, const void *s, size_t n)
{
	if (b->n + n + 1 > b->cap) {
		size_t cap = 2 * (b->n + n + 1);
		char *p = realloc(b->p, cap);

		check(p != NULL, "realloc");
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->n, s, n);
	b->n += n;
	b->p[b->n] = '\0';
}

static void put_str(struct buf *b, const char *s)
{
	put(b, s, strlen(s));
}

/* A length byte, then as many bytes of the input (NUL left out). */
static void put_raw(struct buf *b, struct in *in)
{
	unsigned n = take(in);

	for (unsigned i = 0; i < n && in->n; i++) {
		char c = (char)take(in);

		if (c)
			put(b, &c, 1);
	}
}

/* One entry of the plugin path: a kind byte (low 3 bits) and what the kind reads. */
static void put_entry(struct buf *b, struct in *in)
{
	unsigned k = take(in), param = k >> 3;

	switch (k & 7) {
	case 0:
	case 1:
		put_str(b, dir);
		put_str(b, fixed[param & 15]);
		break;
	case 2: /* a name of the input's inside the folder */
		put_str(b, dir);
		put_str(b, "/");
		put_raw(b, in);
		break;
	case 3:
		put_raw(b, in);
		break;
	case 4:
		break; /* an empty entry */
	case 5: { /* one of the folder's, '/'-padded to 4080..4111 bytes */
		char *s = padded(fixed[take(in) & 15], PATH_CAP - 16 + param);

		put_str(b, s);
		free(s);
		break;
	}
	case 6:
		put_str(b, relative[param % 6]);
		break;
	case 7: { /* raw bytes repeated to 4080..4111 bytes, or to 8192 */
		size_t start = b->n, len = param == 31 ? 8192 : PATH_CAP - 16 + param, n;
		char unit[256];

		put_raw(b, in);
		if (b->n == start)
			put_str(b, "a");
		n = b->n - start;
		memcpy(unit, b->p + start, n); /* put() may move b->p */
		while (b->n - start < len)
			put(b, unit, n < len - (b->n - start) ? n : len - (b->n - start));
		break;
	}
	}
}

/* ---------------------------------------------------------------- what the context must list */

enum kind { PRESENT, MISSING, TOO_LONG };

struct want {
	char *path;
	enum kind kind;
};

struct wants {
	struct want *w;
	int n, cap;
};

static void want(struct wants *ws, const char *path, size_t len, enum kind kind)
{
	if (ws->n == ws->cap) {
		int cap = ws->cap ? 2 * ws->cap : 16;
		struct want *w = realloc(ws->w, (size_t)cap * sizeof(*w));

		check(w != NULL, "realloc");
		ws->w = w;
		ws->cap = cap;
	}
	ws->w[ws->n].path = strndup(path, len);
	check(ws->w[ws->n].path != NULL, "strndup");
	ws->w[ws->n++].kind = len >= PATH_CAP ? TOO_LONG : kind;
}

static void forget(struct wants *ws)
{
	for (int i = 0; i < ws->n; i++)
		free(ws->w[i].path);
	free(ws->w);
}

/* Named as a plugin in a folder: libape-backend-NAME.so, NAME not empty. */
static bool plugin_name(const char *s)
{
	static const char pre[] = "libape-backend-", suf[] = ".so";
	size_t n = strlen(s);

	return n >= strlen(pre) + 1 + strlen(suf) && !strncmp(s, pre, strlen(pre)) &&
	       !strcmp(s + n - strlen(suf), suf);
}

/* A shared object's name, as the documentation has it: the last component ends in ".so" or
 * holds ".so.". */
static bool file_name(const char *path)
{
	const char *base = strrchr(path, '/');
	size_t n;

	base = base ? base + 1 : path;
	n = strlen(base);
	return (n >= 3 && !strcmp(base + n - 3, ".so")) || strstr(base, ".so.");
}

static int by_name(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The plugins of a folder (a path shorter than 4096 bytes): its libape-backend-*.so that are
 * files (after symlinks), in name order. */
static void want_folder(struct wants *ws, const char *folder)
{
	char *names[64];
	int n = 0;
	struct dirent *e;
	DIR *d = opendir(folder);

	if (!d)
		return;
	while ((e = readdir(d)))
		if (plugin_name(e->d_name)) {
			check(n < 64, "a folder of at most 64 plugins (the harness's limit)");
			names[n] = strdup(e->d_name);
			check(names[n++] != NULL, "strdup");
		}
	closedir(d);
	qsort(names, (size_t)n, sizeof(*names), by_name);
	for (int i = 0; i < n; i++) {
		size_t len = strlen(folder);
		char *path = malloc(len + strlen(names[i]) + 2);
		struct stat st;

		check(path != NULL, "malloc");
		sprintf(path, "%s%s%s", folder, len && folder[len - 1] == '/' ? "" : "/", names[i]);
		if (!stat(path, &st) && S_ISREG(st.st_mode))
			want(ws, path, strlen(path), PRESENT);
		free(path);
		free(names[i]);
	}
}

/* What one entry of the path (its bytes [0, len)) must list. */
static void want_entry(struct wants *ws, const char *entry, size_t len)
{
	char path[PATH_CAP];
	struct stat st;

	if (len >= PATH_CAP) {
		want(ws, entry, len, TOO_LONG);
		return;
	}
	memcpy(path, entry, len);
	path[len] = '\0';
	if (!stat(path, &st) && S_ISDIR(st.st_mode))
		want_folder(ws, path);
	else if (!access(path, F_OK))
		want(ws, path, len, PRESENT);
	else if (file_name(path))
		want(ws, path, len, MISSING);
}

/* ---------------------------------------------------------------- the calls */

/* The first name of a backends list that the registry does not have (its length in *len), or
 * NULL: no plugin here states a name, so only the registry's are known. */
static const char *unknown_name(const char *list, size_t *len)
{
	for (const char *p = list; *p;) {
		const char *end = strchr(p, ',');
		size_t n = end ? (size_t)(end - p) : strlen(p);
		bool known = false;

		for (int i = 0; i < nreg && !known; i++)
			known = strlen(reg[i].name) == n && !strncmp(p, reg[i].name, n);
		if (!known) {
			*len = n;
			return p;
		}
		p += n + (end ? 1 : 0);
	}
	return NULL;
}

static void set_env(const char *path)
{
	size_t n = strlen(path) + sizeof("APE_BACKEND_PATH=");
	char *s = malloc(n);

	check(s != NULL, "malloc");
	snprintf(s, n, "APE_BACKEND_PATH=%s", path);
	check(putenv(s) == 0, "putenv");
	free(env_str); /* no longer in the environment */
	env_str = s;
}

static void unset_env(void)
{
	unsetenv("APE_BACKEND_PATH");
	free(env_str);
	env_str = NULL;
}

static bool has_nul(const char *field, size_t cap)
{
	return memchr(field, '\0', cap) != NULL;
}

static void check_listing(ape_context *ctx, const struct wants *ws)
{
	ape_plugin_info info;
	int n = ape_plugin_get_info(ctx, 0, NULL);

	check(n == ws->n, "the plugins listed are the ones the path names");
	check(ape_backend_get_info(ctx, 0, NULL) == nreg, "no backend beyond the registry's");
	for (int i = 0; i < n; i++) {
		const struct want *w = &ws->w[i];

		memset(&info, 0xa5, sizeof(info));
		check(ape_plugin_get_info(ctx, i, &info) == 0, "ape_plugin_get_info in range");
		check(has_nul(info.path, sizeof(info.path)) &&
			      has_nul(info.name, sizeof(info.name)) &&
			      has_nul(info.reason, sizeof(info.reason)),
		      "ape_plugin_info's strings are NUL-terminated");
		trace("  %.200s: %s", info.path, info.reason);
		check(!strncmp(info.path, w->path, PATH_CAP - 1) &&
			      strlen(info.path) == (strlen(w->path) < PATH_CAP ? strlen(w->path)
									 : PATH_CAP - 1),
		      "each plugin's path, in the order found (cut at 4095 bytes)");
		check(!info.name[0] && !info.loaded && !info.device_count && !info.abi_major &&
			      !info.abi_minor,
		      "no name, ABI, device read from these files; none loaded");
		switch (w->kind) {
		case TOO_LONG:
			check(!strcmp(info.reason,
				      "not loaded: the path is longer than 4095 bytes"),
			      "a path of 4096 bytes or more: its reason");
			break;
		case MISSING:
			check(!strncmp(info.reason, "not found: ", 11) && info.reason[11],
			      "a missing file: its reason");
			break;
		case PRESENT:
			check(!strncmp(info.reason, "dlopen: ", 8) ||
				      !strncmp(info.reason, "not a libape backend: no symbol "
							    "ape_backend_plugin",
					       50),
			      "a file that is no plugin: its reason");
			break;
		}
	}
}

static void check_refusals(ape_context *ctx, int n, int raw)
{
	const int bad[] = { -1, n, n + 1, INT_MIN, INT_MAX, raw };
	ape_plugin_info info, before;

	memset(&before, 0x5a, sizeof(before));
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		if (bad[i] >= 0 && bad[i] < n)
			continue;
		info = before;
		check(ape_plugin_get_info(ctx, bad[i], &info) == APE_EINVAL,
		      "ape_plugin_get_info out of range: APE_EINVAL");
		check(!strncmp(ape_last_error(), "ape_plugin_get_info: index = ", 29),
		      "its message names the call and the index");
		check(!memcmp(&info, &before, sizeof(info)), "a refused call writes nothing");
	}
	info = before;
	check(ape_plugin_get_info(NULL, 0, &info) == APE_EINVAL &&
		      strstr(ape_last_error(), "ape_plugin_get_info") &&
		      !memcmp(&info, &before, sizeof(info)),
	      "ape_plugin_get_info(NULL ctx): APE_EINVAL naming it, nothing written");
	check(ape_plugin_get_info(NULL, 0, NULL) == APE_EINVAL,
	      "ape_plugin_get_info(NULL ctx, NULL info): APE_EINVAL");
}

static void check_procs(ape_context *ctx, const char *backend, const char *fn)
{
	check(!ape_backend_get_proc(ctx, backend, fn), "get_proc: no plugin offers a function");
	check(!ape_backend_get_proc(ctx, "ref", fn) && !ape_backend_get_proc(ctx, "ref", "") &&
		      !ape_backend_get_proc(ctx, "ref", "attention"),
	      "get_proc: the reference has no proc_address");
	check(!ape_backend_get_proc(ctx, fn, backend), "get_proc: names swapped");
	check(!ape_backend_get_proc(NULL, backend, fn) && !ape_backend_get_proc(ctx, NULL, fn) &&
		      !ape_backend_get_proc(ctx, backend, NULL) &&
		      !ape_backend_get_proc(NULL, NULL, NULL),
	      "get_proc with NULL arguments: NULL");
}

/*
 * The input: a flags byte (1: APE_CONTEXT_NO_PLUGIN_DIR; 2-3: the path as backend_path, "",
 * APE_BACKEND_PATH, or neither; 4-5: backends NULL, "ref", "ref,NAME", "NAME"; 6-8: the plugin
 * folder), the count of entries (low 5 bits), the entries (put_entry()), NAME, the names for
 * ape_backend_get_proc(), a raw index (4 bytes) and, for the long plugin folders, a byte
 * picking 4095 or 4096 bytes. tests/fuzz/make-seeds.py writes inputs in this encoding.
 */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = { data, size };
	struct buf path = { 0 }, list = { 0 }, backend = { 0 }, fn = { 0 };
	struct wants ws = { 0 };
	unsigned flags = take(&in), nentries = take(&in) & 31, src = (flags >> 1) & 3;
	unsigned mode = (flags >> 3) & 3;
	char folder[80], gone[80], file[80], sub[80];
	const char *used = NULL, *unknown;
	ape_context_options o;
	static char not_set;
	ape_context *ctx = (ape_context *)&not_set; /* must be NULL after a failure */
	size_t ulen = 0;
	uint32_t raw = 0;
	int ret;

	put_str(&path, "");
	for (unsigned i = 0; i < nentries; i++) {
		if (i)
			put_str(&path, ":");
		put_entry(&path, &in);
	}
	put_str(&list, mode == 2 ? "ref," : mode == 1 ? "ref" : "");
	if (mode >= 2)
		put_raw(&list, &in);
	put_str(&backend, "");
	put_raw(&backend, &in);
	put_str(&fn, "");
	put_raw(&fn, &in);
	for (int i = 0; i < 4; i++)
		raw |= (uint32_t)take(&in) << (8 * i);

	snprintf(folder, sizeof(folder), "%s", dir);
	snprintf(sub, sizeof(sub), "%s/sub", dir);
	snprintf(gone, sizeof(gone), "%s/gone", dir);
	snprintf(file, sizeof(file), "%s/libape-backend-a.so", dir);
	switch (flags >> 5) {
	case 0:
	case 1:
		ape__plugin_folder = sub;
		break;
	case 2:
		ape__plugin_folder = folder;
		break;
	case 3:
		ape__plugin_folder = NULL;
		break;
	case 4:
		ape__plugin_folder = "";
		break;
	case 5:
		ape__plugin_folder = gone;
		break;
	case 6:
		ape__plugin_folder = file;
		break;
	case 7:
		ape__plugin_folder = long_folder[take(&in) & 1];
		break;
	}

	ape_context_options_init(&o);
	o.flags = flags & 1 ? APE_CONTEXT_NO_PLUGIN_DIR : 0;
	o.numa = APE_NUMA_OFF;
	o.verbose = 0;
	o.backends = mode ? list.p : NULL;
	unset_env();
	switch (src) {
	case 0:
		o.backend_path = used = path.p;
		break;
	case 1:
		o.backend_path = "";
		break;
	case 2:
		set_env(path.p);
		used = path.p;
		break;
	}

	/* what the documentation promises, walked independently */
	for (const char *s = used ? used : ""; *s;) {
		const char *end = strchr(s, ':');
		size_t len = end ? (size_t)(end - s) : strlen(s);

		if (len)
			want_entry(&ws, s, len);
		s += len + (end ? 1 : 0);
	}
	if (!(o.flags & APE_CONTEXT_NO_PLUGIN_DIR) && ape__plugin_folder && *ape__plugin_folder &&
	    strlen(ape__plugin_folder) < PATH_CAP)
		want_folder(&ws, ape__plugin_folder);
	unknown = o.backends ? unknown_name(o.backends, &ulen) : NULL;

	ret = ape_context_create(&ctx, &o);
	trace("fuzz_plugins: path (%s, %zu bytes) \"%.300s\", folder %.80s%s, backends %s%.80s%s: "
	      "%s, %d plugins wanted",
	      src == 0 ? "backend_path" : src == 1 ? "\"\"" : src == 2 ? "env" : "none", path.n,
	      path.p, ape__plugin_folder ? ape__plugin_folder : "NULL",
	      o.flags ? " (not searched)" : "", o.backends ? "\"" : "",
	      o.backends ? o.backends : "NULL", o.backends ? "\"" : "", ape_err_name(ret), ws.n);
	if (ret) {
		check(ret == APE_EINVAL || ret == APE_ENOMEM,
		      "ape_context_create fails with APE_EINVAL or APE_ENOMEM only");
		check(ctx == NULL, "a failed ape_context_create leaves *out NULL");
		check(!strncmp(ape_last_error(), "ape_context_create: ", 20),
		      "ape_context_create's message names it");
		if (ret == APE_EINVAL) {
			char named[64];

			check(unknown != NULL, "APE_EINVAL only for an unknown name in backends");
			snprintf(named, sizeof(named), "unknown backend \"%.*s\"", (int)ulen,
				 unknown);
			/* the message holds the whole list first: a long one leaves no room */
			check(strlen(o.backends) > 400 || ulen > 40 ||
				      strstr(ape_last_error(), named),
			      "the message names the unknown backend");
		}
	} else {
		check(unknown == NULL, "a backends list with an unknown name is refused");
		check_listing(ctx, &ws);
		check_refusals(ctx, ws.n, (int)raw);
		check_procs(ctx, backend.p, fn.p);
		ape_context_destroy(ctx);
	}
	check(!ape_backend_get_proc(NULL, backend.p, fn.p), "get_proc(NULL ctx): NULL");
	unset_env();
	forget(&ws);
	free(path.p);
	free(list.p);
	free(backend.p);
	free(fn.p);
	return 0;
}
