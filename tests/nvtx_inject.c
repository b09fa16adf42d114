/* SPDX-License-Identifier: MIT */
/*
 * A fake NVTX tool for tests/test_nvtx.c: the injection library NVTX's own init loads when
 * NVTX_INJECTION64_PATH names it (nvtx3/nvtxDetail/nvtxInit.h), as Nsight Systems' is loaded.
 * InitializeInjectionNvtx2() asks the program's NVTX instance for its callback tables
 * (NVTX_ETID_CALLBACKS, GetModuleFunctionTable) and writes its own functions into the slots of
 * the domain API (CORE2: DomainCreateA, DomainRangePushEx, DomainRangePop) and of the plain
 * one (CORE: RangePushA, RangePushEx, RangePop), so that a push outside any domain shows too.
 *
 * Every event is one line appended to the file APE_TEST_NVTX_LOG names, written at once:
 *   init
 *   TID domain NAME
 *   TID push DEPTH DOMAIN NAME      DEPTH: the thread's depth in that domain after the push (1:
 *                                   outermost); DOMAIN "-" for NVTX's default domain
 *   TID pop DEPTH DOMAIN            DEPTH: before the pop (the push's); 0: a pop with none open
 * Depths are counted per thread and per domain, as NVTX's stacks are.
 */
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_DOMAINS 16

/* A domain's handle is a pointer to its slot here. */
struct domain {
	char name[64];
};

static struct domain domains[MAX_DOMAINS];
static int ndomains;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int log_fd = -1;
/* per thread: depth in the default domain (0) and in each created one (1 + its index) */
static _Thread_local int depth[1 + MAX_DOMAINS];

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void emit(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	int n = snprintf(line, sizeof(line), "%ld ", (long)syscall(SYS_gettid));

	va_start(ap, fmt);
	n += vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(line) - 2)
		n = (int)sizeof(line) - 2;
	line[n++] = '\n';
	if (log_fd >= 0 && write(log_fd, line, (size_t)n) != n)
		abort(); /* a lost line would pass for a missing range */
}

static int slot_of(nvtxDomainHandle_t d)
{
	return d ? 1 + (int)((struct domain *)(void *)d - domains) : 0;
}

static const char *name_of(nvtxDomainHandle_t d)
{
	return d ? ((struct domain *)(void *)d)->name : "-";
}

static const char *message_of(const nvtxEventAttributes_t *a)
{
	if (!a)
		return "(no attributes)";
	switch (a->messageType) {
	case NVTX_MESSAGE_TYPE_ASCII:
		return a->message.ascii ? a->message.ascii : "(null)";
	case NVTX_MESSAGE_UNKNOWN:
		return "(no message)";
	default:
		return "(not ascii)";
	}
}

static nvtxDomainHandle_t NVTX_API domain_create(const char *name)
{
	struct domain *d = NULL;

	pthread_mutex_lock(&lock);
	if (ndomains < MAX_DOMAINS) {
		d = &domains[ndomains++];
		snprintf(d->name, sizeof(d->name), "%s", name ? name : "(null)");
	}
	pthread_mutex_unlock(&lock);
	if (d)
		emit("domain %s", d->name);
	return (nvtxDomainHandle_t)(void *)d;
}

static int push(nvtxDomainHandle_t d, const char *msg)
{
	const int s = slot_of(d);

	emit("push %d %s %s", ++depth[s], name_of(d), msg);
	return depth[s] - 1;
}

static int pop(nvtxDomainHandle_t d)
{
	const int s = slot_of(d);

	emit("pop %d %s", depth[s], name_of(d));
	if (depth[s] == 0)
		return -1;
	return --depth[s];
}

static int NVTX_API domain_push_ex(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a)
{
	return push(d, message_of(a));
}

static int NVTX_API domain_pop(nvtxDomainHandle_t d)
{
	return pop(d);
}

static int NVTX_API plain_push_a(const char *msg)
{
	return push(NULL, msg ? msg : "(null)");
}

static int NVTX_API plain_push_ex(const nvtxEventAttributes_t *a)
{
	return push(NULL, message_of(a));
}

static int NVTX_API plain_pop(void)
{
	return pop(NULL);
}

/* Writes fn into slot id of a module's table; 0 when the program's NVTX has no such slot. */
static int hook(const NvtxExportTableCallbacks *cb, NvtxCallbackModule module, unsigned id,
		NvtxFunctionPointer fn)
{
	NvtxFunctionTable table = NULL;
	unsigned size = 0;

	if (!cb->GetModuleFunctionTable(module, &table, &size) || !table || id >= size ||
	    !table[id])
		return 0;
	*table[id] = fn;
	return 1;
}

#define FN(f) ((NvtxFunctionPointer)(void (*)(void))(f))

__attribute__((visibility("default"))) int NVTX_API
InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table);

int NVTX_API InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table)
{
	const NvtxExportTableCallbacks *cb;
	const char *path = getenv("APE_TEST_NVTX_LOG");

	if (!path || !get_export_table)
		return 0;
	cb = (const NvtxExportTableCallbacks *)get_export_table(NVTX_ETID_CALLBACKS);
	if (!cb || cb->struct_size < sizeof(*cb) || !cb->GetModuleFunctionTable)
		return 0;
	log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (log_fd < 0)
		return 0;
	if (!hook(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainCreateA, FN(domain_create)) ||
	    !hook(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePushEx,
		  FN(domain_push_ex)) ||
	    !hook(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePop, FN(domain_pop)) ||
	    !hook(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushA, FN(plain_push_a)) ||
	    !hook(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushEx, FN(plain_push_ex)) ||
	    !hook(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePop, FN(plain_pop))) {
		close(log_fd);
		log_fd = -1;
		return 0;
	}
	/* the pid, so a test can tell its own process's log from a leftover */
	emit("init %ld", (long)getpid());
	return 1;
}
