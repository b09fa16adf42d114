/* SPDX-License-Identifier: MIT */
/*
 * Backend plugins (api/plugins.h): finding them (the caller's path or APE_BACKEND_PATH, then
 * the plugin folder), opening them (dlopen, then the entry point ape_backend_plugin()),
 * registering them after the built-in backends through the same checks and probe
 * (ape__backend_bind(), ape__backend_probe()), and what the public API says about them
 * (ape_plugin_get_info(), ape_backend_get_proc()). A plugin that cannot be loaded, for
 * whatever reason, is listed with the reason and never fails the context; only running out of
 * host memory does, as it does for the built-in backends.
 *
 * Nothing here costs a context without plugins more than a getenv() and one stat() of the
 * plugin folder.
 */
#include "api/plugins.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/alloc.h"
#include "core/error.h"
#include "core/ops.h"
#include "core/verbose.h"

#ifndef APE_PLUGIN_DIR
#define APE_PLUGIN_DIR "/usr/local/lib/libape/backends"
#endif

const char *ape__plugin_folder = APE_PLUGIN_DIR;

/*
 * Held around dlopen(), dlsym() and dlclose() (and the dlerror() that follows them): the
 * dynamic loader serialises them already, with a lock of its own that ThreadSanitizer does not
 * see, so that contexts loading plugins on several threads would look like a race inside
 * ld.so's allocations to `make tsan-ci`. Of a plugin's own code, only its constructors and
 * destructors run under it (the loader runs them); recursive, as the loader's own lock is, so
 * that one of them may create a context.
 */
static pthread_mutex_t dl_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

/* What a folder's plugins are called: libape-backend-NAME.so. */
static const char plugin_prefix[] = "libape-backend-";
static const char plugin_suffix[] = ".so";

/* ------------------------------------------------------------------ the list */

/* A new entry at the end of ctx->plugins for `path` (its bytes [0, len)), not opened yet (slot
 * -1); NULL when out of memory (message set). */
static struct ape__plugin *plugin_add(struct ape_context *ctx, const char *path, size_t len,
				      const char *from)
{
	struct ape__plugin *list, *p;
	const int n = ctx->nplugins;

	/* room for a power of two of entries, doubled when full: a path of thousands of entries
	 * (fuzz_plugins) would otherwise copy the list once per entry, quadratic */
	list = n & (n - 1) ? ctx->plugins
			   : ape__realloc(ctx->plugins, (n ? 2 * (size_t)n : 1) * sizeof(*list));
	if (!list) {
		ape__error(APE_ENOMEM, "ape_context_create: out of memory listing the plugins of %s",
			   from);
		return NULL;
	}
	ctx->plugins = list;
	p = &list[ctx->nplugins++];
	memset(p, 0, sizeof(*p));
	p->slot = -1;
	snprintf(p->info.path, sizeof(p->info.path), "%.*s", (int)len, path);
	if (len >= sizeof(p->info.path))
		snprintf(p->info.reason, sizeof(p->info.reason),
			 "not loaded: the path is longer than %zu bytes", sizeof(p->info.path) - 1);
	return p;
}

/* Whether name is a backend name as a table may state it: [a-z0-9_], 1 to 15 characters (read
 * no further than the 16th). */
static bool plain_name(const char *name)
{
	size_t n = 0;

	for (; n < 16 && name[n]; n++)
		if (!((name[n] >= 'a' && name[n] <= 'z') || (name[n] >= '0' && name[n] <= '9') ||
		      name[n] == '_'))
			return false;
	return n > 0 && n < 16;
}

/* The ABI and, where this library can read it, the name the table states: for the listing, and
 * for opts->backends, before the table is checked. */
static void read_head(struct ape__plugin *p)
{
	const struct ape_backend_plugin *t = p->table;
	const size_t head = offsetof(struct ape_backend_plugin, name) + sizeof(t->name);

	p->info.abi_major = t->abi_major;
	p->info.abi_minor = t->abi_minor;
	if (t->abi_major == APE_BACKEND_ABI_MAJOR && t->struct_size >= head && t->name &&
	    plain_name(t->name))
		snprintf(p->info.name, sizeof(p->info.name), "%s", t->name);
}

/*
 * Whether the plugin opened as `handle` binds libape's services to this copy of libape: the
 * definition it gets is the global scope's first (a program that links libape.a and exports its
 * symbols, or libape.so loaded globally), else its own dependencies' (libape.so.0 it links, which
 * is this library when this library is libape.so.0, even loaded RTLD_LOCAL, as Python does). A
 * program that links libape.a without exporting it would have the plugin pull in libape.so as a
 * second copy, whose error messages, fault counters and contexts are not this one's. A plugin
 * that does not call libape at all binds nothing: fine. Called with dl_lock held.
 */
static bool same_services(void *handle)
{
	void *mine = (void *)ape_be_device_add, *theirs;

	theirs = dlsym(RTLD_DEFAULT, "ape_be_device_add");
	if (!theirs)
		theirs = dlsym(handle, "ape_be_device_add");
	dlerror();
	return !theirs || theirs == mine;
}

/* Opens p's shared object and calls its entry point; what fails goes to p's reason. */
static void plugin_open(struct ape__plugin *p)
{
	ape_backend_plugin_fn entry;
	char local[sizeof(p->info.path) + 2];
	const char *file = p->info.path;
	void *sym;

	if (p->info.reason[0])
		return;
	/* a name without a '/' is a file here, not one for the loader to search for */
	if (!strchr(file, '/')) {
		snprintf(local, sizeof(local), "./%s", file);
		file = local;
	}
	pthread_mutex_lock(&dl_lock);
	dlerror();
	p->handle = dlopen(file, RTLD_NOW | RTLD_LOCAL);
	if (!p->handle) {
		const char *e = dlerror();

		snprintf(p->info.reason, sizeof(p->info.reason), "dlopen: %s",
			 e ? e : "failed without a message");
		pthread_mutex_unlock(&dl_lock);
		return;
	}
	dlerror();
	sym = dlsym(p->handle, APE_BACKEND_PLUGIN_SYMBOL);
	if (!sym) {
		const char *e = dlerror();

		snprintf(p->info.reason, sizeof(p->info.reason),
			 "not a libape backend: no symbol " APE_BACKEND_PLUGIN_SYMBOL " (%s)",
			 e ? e : "dlsym found it NULL");
		pthread_mutex_unlock(&dl_lock);
		return;
	}
	if (!same_services(p->handle)) {
		snprintf(p->info.reason, sizeof(p->info.reason),
			 "refused: its calls to libape (ape_be_device_add, ...) would reach another "
			 "copy of libape than this program's (a program linked with libape.a "
			 "must export libape's symbols: -Wl,--dynamic-list=tools/plugin-host.dynlist, "
			 "or link libape.so)");
		pthread_mutex_unlock(&dl_lock);
		return;
	}
	pthread_mutex_unlock(&dl_lock);
	memcpy(&entry, &sym, sizeof(entry)); /* POSIX: a function's address in a void * */
	p->table = entry();
	if (!p->table) {
		snprintf(p->info.reason, sizeof(p->info.reason),
			 "refused: " APE_BACKEND_PLUGIN_SYMBOL "() returned NULL");
		return;
	}
	read_head(p);
}

/* Closes p's shared object, if open: after its backend, if any, was torn down. */
static void plugin_close(struct ape__plugin *p)
{
	p->table = NULL;
	if (p->handle) {
		pthread_mutex_lock(&dl_lock);
		dlclose(p->handle);
		pthread_mutex_unlock(&dl_lock);
	}
	p->handle = NULL;
}

/* ------------------------------------------------------------------ finding */

/* Whether a path that does not exist names a file (a plugin the caller asked for by name, listed
 * as missing) rather than a folder (nothing, silently): its last component ends in ".so" or
 * holds ".so.". */
static bool names_a_file(const char *path, size_t len)
{
	const char *base = path;

	for (size_t i = 0; i < len; i++)
		if (path[i] == '/')
			base = path + i + 1;
	len -= (size_t)(base - path);
	if (len >= 3 && !memcmp(base + len - 3, ".so", 3))
		return true;
	for (size_t i = 0; i + 4 <= len; i++)
		if (!memcmp(base + i, ".so.", 4))
			return true;
	return false;
}

/* Whether a folder's entry is named as a plugin: libape-backend-*.so. */
static bool plugin_file_name(const char *name)
{
	const size_t n = strlen(name), np = sizeof(plugin_prefix) - 1;
	const size_t ns = sizeof(plugin_suffix) - 1;

	return n > np + ns && !strncmp(name, plugin_prefix, np) &&
	       !strcmp(name + n - ns, plugin_suffix);
}

static int name_cmp(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every libape-backend-*.so of folder `dir` (its bytes [0, len)) that is a file, in name order,
 * added and opened. A folder that cannot be read adds nothing. */
static int find_in_folder(struct ape_context *ctx, const char *dir, size_t len, const char *from)
{
	char folder[4096], path[4096 + 256];
	char **names = NULL;
	size_t n = 0, cap = 0;
	struct dirent *e;
	DIR *d;
	int ret = 0;

	if (len >= sizeof(folder))
		return 0;
	snprintf(folder, sizeof(folder), "%.*s", (int)len, dir);
	d = opendir(folder);
	if (!d)
		return 0;
	while ((e = readdir(d))) {
		char *copy;

		if (!plugin_file_name(e->d_name))
			continue;
		if (n == cap) {
			size_t c = cap ? 2 * cap : 8;
			char **more = ape__realloc(names, c * sizeof(*names));

			if (!more)
				break;
			names = more;
			cap = c;
		}
		copy = ape__strdup(e->d_name);
		if (!copy)
			break;
		names[n++] = copy;
	}
	if (e) /* the loop broke: out of memory */
		ret = ape__error(APE_ENOMEM,
				 "ape_context_create: out of memory listing the plugins of %s "
				 "folder \"%.200s\"",
				 from, folder);
	closedir(d);
	if (!ret && n > 1)
		qsort(names, n, sizeof(*names), name_cmp);
	for (size_t i = 0; i < n && !ret; i++) {
		struct ape__plugin *p;
		struct stat st;

		snprintf(path, sizeof(path), "%s%s%s", folder,
			 len && folder[len - 1] == '/' ? "" : "/", names[i]);
		if (stat(path, &st) || !S_ISREG(st.st_mode))
			continue;
		p = plugin_add(ctx, path, strlen(path), from);
		if (!p)
			ret = APE_ENOMEM;
		else
			plugin_open(p);
	}
	for (size_t i = 0; i < n; i++)
		free(names[i]);
	free(names);
	return ret;
}

/* One entry of a path (its bytes [0, len)): a folder, a file, or nothing there (listed when it
 * names a file). */
static int find_entry(struct ape_context *ctx, const char *entry, size_t len, const char *from)
{
	char file[4096];
	struct stat st;
	struct ape__plugin *p;
	int missing = 0;

	if (len < sizeof(file)) {
		snprintf(file, sizeof(file), "%.*s", (int)len, entry);
		if (!stat(file, &st) && S_ISDIR(st.st_mode))
			return find_in_folder(ctx, entry, len, from);
		if (access(file, F_OK)) {
			missing = errno;
			if (!names_a_file(entry, len))
				return 0; /* a folder that is not there */
		}
	}
	p = plugin_add(ctx, entry, len, from);
	if (!p)
		return APE_ENOMEM;
	if (missing && !p->info.reason[0])
		snprintf(p->info.reason, sizeof(p->info.reason), "not found: %s", strerror(missing));
	plugin_open(p);
	return 0;
}

int ape__plugins_find(struct ape_context *ctx, const char *path, const char *from, bool no_folder)
{
	int ret = 0;

	for (const char *s = path ? path : ""; *s && !ret;) {
		const char *end = strchr(s, ':');
		size_t len = end ? (size_t)(end - s) : strlen(s);

		if (len)
			ret = find_entry(ctx, s, len, from);
		s += len + (end ? 1 : 0);
	}
	if (!ret && !no_folder && ape__plugin_folder && *ape__plugin_folder)
		ret = find_in_folder(ctx, ape__plugin_folder, strlen(ape__plugin_folder),
				     "the plugin folder");
	return ret;
}

/* ------------------------------------------------------------------ names */

bool ape__plugins_have_name(const struct ape_context *ctx, const char *name, size_t len)
{
	for (int i = 0; i < ctx->nplugins; i++) {
		const char *pn = ctx->plugins[i].info.name;

		if (pn[0] && strlen(pn) == len && !strncmp(pn, name, len))
			return true;
	}
	return false;
}

void ape__plugins_names(const struct ape_context *ctx, char *buf, size_t cap, size_t *n)
{
	for (int i = 0; i < ctx->nplugins && *n < cap; i++) {
		const char *pn = ctx->plugins[i].info.name;
		bool seen = false;

		for (int j = 0; j < i && !seen; j++)
			seen = !strcmp(ctx->plugins[j].info.name, pn);
		if (pn[0] && !seen)
			*n += (size_t)snprintf(buf + *n, cap - *n, "%s%s", *n ? ", " : "", pn);
	}
}

const struct ape__plugin *ape__plugins_unloaded(const struct ape_context *ctx, const char *name)
{
	for (int i = ctx->nplugins - 1; i >= 0; i--)
		if (!ctx->plugins[i].info.loaded && !strcmp(ctx->plugins[i].info.name, name))
			return &ctx->plugins[i];
	return NULL;
}

/* ------------------------------------------------------------------ registering */

/* The backend of slot cb, probed or not, given up: its devices from `before` on released, its
 * teardown run if it probed, the slot cleared for the next plugin. */
static void slot_release(struct ape_context *ctx, struct ape__ctx_backend *cb, int before)
{
	for (int i = before; i < ctx->ndevices; i++)
		ape__device_free(ctx->devices[i]);
	ctx->ndevices = before;
	if (cb->probed && cb->be.ops->teardown)
		cb->be.ops->teardown(&cb->be);
	memset(cb, 0, sizeof(*cb));
}

/* Why p's name cannot be a backend name of ctx: "" when it can. */
static void name_taken(const struct ape_context *ctx, const struct ape__plugin *p,
		       const struct ape__registry_entry *reg, int nreg, char *why, size_t cap)
{
	const char *name = p->table->name;

	why[0] = '\0';
	for (int i = 0; i < nreg; i++)
		if (!strcmp(reg[i].name, name)) {
			snprintf(why, cap,
				 "refused: the backend name \"%s\" is taken by the built-in backend "
				 "%s",
				 name, reg[i].name);
			return;
		}
	for (const struct ape__plugin *q = ctx->plugins; q < p; q++)
		if (q->info.loaded && !strcmp(q->info.name, name)) {
			snprintf(why, cap,
				 "refused: the backend name \"%s\" is taken by the plugin %.400s",
				 name, q->info.path);
			return;
		}
}

/* Registers one plugin whose table it read (p->table): see ape__plugins_register(). */
static void plugin_register(struct ape_context *ctx, struct ape__plugin *p,
			    const struct ape__registry_entry *reg, int nreg, const char *only,
			    int *err)
{
	ape_plugin_info *pi = &p->info;
	struct ape__ctx_backend *cb;
	int before = ctx->ndevices, ret;

	if (ctx->nbackends >= APE__MAX_BACKENDS) {
		snprintf(pi->reason, sizeof(pi->reason),
			 "refused: a context loads at most %d backends, built-in ones included",
			 APE__MAX_BACKENDS);
		return;
	}
	cb = &ctx->backends[ctx->nbackends];
	memset(cb, 0, sizeof(*cb));
	cb->be.ctx = ctx;
	/* the table first: nothing of a plugin the core refuses runs, not even its probe */
	if (ape__backend_bind(&cb->be, p->table, pi->reason, sizeof(pi->reason))) {
		memset(cb, 0, sizeof(*cb));
		return;
	}
	snprintf(pi->name, sizeof(pi->name), "%s", p->table->name);
	name_taken(ctx, p, reg, nreg, pi->reason, sizeof(pi->reason));
	if (!pi->reason[0] && only && !ape__names_have(only, pi->name))
		snprintf(pi->reason, sizeof(pi->reason),
			 "not loaded: left out by ape_context_options.backends");
	if (pi->reason[0]) {
		memset(cb, 0, sizeof(*cb));
		return;
	}
	snprintf(cb->info.name, sizeof(cb->info.name), "%s", pi->name);
	cb->info.built = true;
	ret = ape__backend_probe(cb);
	if (ret == APE_ENOMEM) {
		/* fails the context, as for a built-in backend: the slot kept, its devices and
		 * teardown to ape_context_destroy(), the shared object closed after them */
		p->slot = ctx->nbackends++;
		*err = ret;
		return;
	}
	if (ret < 0)
		snprintf(pi->reason, sizeof(pi->reason), "refused: probe failed (%s): %s",
			 ape_err_name(ret), ape_last_error());
	else if (!cb->info.available && !strncmp(cb->info.reason, "refused: ", 9))
		snprintf(pi->reason, sizeof(pi->reason), "%s", cb->info.reason); /* its devices */
	else if (!cb->info.available && strcmp(cb->info.reason, "no device found"))
		snprintf(pi->reason, sizeof(pi->reason), "no device found: %s", cb->info.reason);
	else if (!cb->info.available)
		snprintf(pi->reason, sizeof(pi->reason), "no device found");
	if (pi->reason[0]) {
		slot_release(ctx, cb, before);
		return;
	}
	pi->loaded = true;
	pi->device_count = cb->info.device_count;
	p->slot = ctx->nbackends++;
}

void ape__plugins_register(struct ape_context *ctx, const struct ape__registry_entry *reg,
			   int nreg, const char *only, int *err)
{
	for (int i = 0; i < ctx->nplugins && !*err; i++) {
		struct ape__plugin *p = &ctx->plugins[i];

		if (p->table)
			plugin_register(ctx, p, reg, nreg, only, err);
		if (p->slot < 0)
			plugin_close(p);
	}
}

void ape__plugins_close(struct ape_context *ctx)
{
	for (int i = ctx->nplugins - 1; i >= 0; i--)
		plugin_close(&ctx->plugins[i]);
	free(ctx->plugins);
	ctx->plugins = NULL;
	ctx->nplugins = 0;
}

/* ------------------------------------------------------------------ the public API */

int ape_plugin_get_info(const ape_context *ctx, int index, ape_plugin_info *info)
{
	APE__API_CALL("ape_plugin_get_info");
	if (!ctx)
		return ape__error(APE_EINVAL, "ape_plugin_get_info: ctx = NULL");
	if (!info)
		return ctx->nplugins;
	if (index < 0 || index >= ctx->nplugins)
		return ape__error(APE_EINVAL,
				  "ape_plugin_get_info: index = %d: out of range 0..%d (%d plugin%s "
				  "found)",
				  index, ctx->nplugins - 1, ctx->nplugins,
				  ctx->nplugins == 1 ? "" : "s");
	*info = ctx->plugins[index].info;
	return 0;
}

void *ape_backend_get_proc(const ape_context *ctx, const char *backend, const char *name)
{
	APE__API_CALL("ape_backend_get_proc");
	if (!ctx || !backend || !name)
		return NULL;
	for (int i = 0; i < ctx->nbackends; i++) {
		const struct ape__ctx_backend *cb = &ctx->backends[i];
		const struct ape_backend_plugin *raw = cb->be.raw;

		if (!strcmp(cb->info.name, backend))
			return raw && raw->proc_address ? raw->proc_address(name) : NULL;
	}
	return NULL;
}
