/* SPDX-License-Identifier: MIT */
/* The session trace (core/strace.h). */
#include "core/strace.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>

#include "ape/ape.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/nvtx.h"
#include "core/verbose.h"

struct track {
	char *process, *thread;
	int pid, tid;
};

static struct {
	pthread_mutex_t lock;
	char path[4096];
	bool on, failed, warned;
	char **ev; /* each span's JSON object but pid and tid, which are filled at write */
	int *track; /* its track */
	double *ts;
	size_t n, cap;
	struct track *tracks;
	int ntracks, nproc;
	char **procs;
	double origin;
} S = { .lock = PTHREAD_MUTEX_INITIALIZER };

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void at_exit(void)
{
	ape__strace_flush();
}

static void read_env(void)
{
	const char *v = getenv("APE_TRACE");
	size_t n = 0;

	if (!v || !*v)
		return;
	/* "%p": the process id (one file per rank of an MPI job) */
	for (const char *s = v; *s && n < sizeof(S.path) - 24; s++) {
		if (s[0] == '%' && s[1] == 'p') {
			n += (size_t)snprintf(S.path + n, sizeof(S.path) - n, "%d", (int)getpid());
			s++;
		} else {
			S.path[n++] = *s;
		}
	}
	S.path[n] = '\0';
	S.origin = ape__now_ms();
	S.on = true;
	atexit(at_exit);
}

bool ape__strace_on(void)
{
	pthread_once(&once, read_env);
	return S.on;
}

const char *ape__strace_host(void)
{
	static char label[64];

	if (!label[0]) /* (the same text from any thread that writes it first) */
		snprintf(label, sizeof(label), "libape calls, pid %d", (int)getpid());
	return label;
}

const char *ape__strace_thread(void)
{
	static _Thread_local char label[32];

	if (!label[0])
		snprintf(label, sizeof(label), "thread %d", (int)gettid());
	return label;
}

/* The track of (process, thread), made on first use; -1 out of memory. Lock held. */
static int track_of(const char *process, const char *thread)
{
	struct track *t;
	int pid = -1;

	for (int i = 0; i < S.ntracks; i++) {
		if (strcmp(S.tracks[i].process, process))
			continue;
		pid = S.tracks[i].pid;
		if (!strcmp(S.tracks[i].thread, thread))
			return i;
	}
	t = ape__realloc(S.tracks, sizeof(*t) * (size_t)(S.ntracks + 1));
	if (!t)
		return -1;
	S.tracks = t;
	t = &S.tracks[S.ntracks];
	t->process = ape__strdup(process);
	t->thread = ape__strdup(thread);
	if (!t->process || !t->thread) {
		free(t->process);
		free(t->thread);
		return -1;
	}
	/* process ids apart from any other process's file: getpid() * 100 + its index */
	t->pid = pid >= 0 ? pid : (int)getpid() % 20000000 * 100 + S.nproc++;
	t->tid = 0;
	for (int i = 0; i < S.ntracks; i++)
		if (S.tracks[i].pid == t->pid && S.tracks[i].tid >= t->tid)
			t->tid = S.tracks[i].tid + 1;
	return S.ntracks++;
}

void ape__strace_span(const char *process, const char *thread, const char *name, const char *cat,
		      double t0, double t1, const char *args)
{
	char nm[512], *e;
	int tr, len;

	if (!ape__strace_on())
		return;
	ape__json_escape(nm, sizeof(nm), name);
	pthread_mutex_lock(&S.lock);
	if (S.n >= APE__STRACE_MAX || (tr = track_of(process, thread)) < 0) {
		S.failed = true;
		goto out;
	}
	if (S.n == S.cap) {
		const size_t cap = S.cap ? 2 * S.cap : 1024;
		char **ev = ape__realloc(S.ev, cap * sizeof(*ev));
		int *track = ev ? ape__realloc(S.track, cap * sizeof(*track)) : NULL;
		double *ts = track ? ape__realloc(S.ts, cap * sizeof(*ts)) : NULL;

		if (ev)
			S.ev = ev;
		if (track)
			S.track = track;
		if (!ts) {
			S.failed = true;
			goto out;
		}
		S.ts = ts;
		S.cap = cap;
	}
	len = snprintf(NULL, 0, "\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"dur\":%.3f%s%s", nm,
		       cat, (t1 > t0 ? t1 - t0 : 0) * 1e3, args ? ",\"args\":" : "",
		       args ? args : "");
	e = ape__malloc((size_t)len + 1);
	if (!e) {
		S.failed = true;
		goto out;
	}
	snprintf(e, (size_t)len + 1, "\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"dur\":%.3f%s%s", nm,
		 cat, (t1 > t0 ? t1 - t0 : 0) * 1e3, args ? ",\"args\":" : "", args ? args : "");
	S.ev[S.n] = e;
	S.track[S.n] = tr;
	S.ts[S.n] = t0;
	S.n++;
out:
	pthread_mutex_unlock(&S.lock);
}

/* ape_range_push(): the thread's open ranges */
#define RANGE_DEPTH 64
static _Thread_local struct {
	char *name;
	double t0;
} ranges[RANGE_DEPTH];
static _Thread_local int nranges;

void ape_range_push(const char *name)
{
	const int k = nranges++;

	if (!name)
		name = "";
	ape__nvtx_push(name);
	if (k >= RANGE_DEPTH || !ape__strace_on())
		return;
	ranges[k].name = ape__strdup(name);
	ranges[k].t0 = ape__now_ms();
}

void ape_range_pop(void)
{
	int k;

	if (nranges <= 0)
		return;
	k = --nranges;
	ape__nvtx_pop();
	if (k >= RANGE_DEPTH || !ranges[k].name)
		return;
	ape__strace_span(ape__strace_host(), ape__strace_thread(), ranges[k].name, "range",
			 ranges[k].t0, ape__now_ms(), NULL);
	free(ranges[k].name);
	ranges[k].name = NULL;
}

static int write_file(FILE *f)
{
	const char *sep = "";
	char esc[1024];

	fprintf(f, "{\"traceEvents\":[");
	for (int i = 0; i < S.ntracks; i++) {
		const struct track *t = &S.tracks[i];
		bool first_of_proc = true;

		for (int j = 0; j < i; j++)
			first_of_proc &= S.tracks[j].pid != t->pid;
		if (first_of_proc) {
			ape__json_escape(esc, sizeof(esc), t->process);
			fprintf(f, "%s\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,"
				   "\"args\":{\"name\":\"%s\"}}",
				sep, t->pid, esc);
			sep = ",";
		}
		ape__json_escape(esc, sizeof(esc), t->thread);
		fprintf(f, "%s\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
			   "\"args\":{\"name\":\"%s\"}}",
			sep, t->pid, t->tid, esc);
		sep = ",";
	}
	/* ts from the session's start, which every span follows (microseconds) */
	for (size_t i = 0; i < S.n; i++) {
		fprintf(f, "%s\n{%s,\"pid\":%d,\"tid\":%d,\"ts\":%.3f}", sep, S.ev[i],
			S.tracks[S.track[i]].pid, S.tracks[S.track[i]].tid,
			(S.ts[i] - S.origin) * 1e3);
		sep = ",";
	}
	fprintf(f, "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"producer\":\"libape %s\","
		   "\"clock\":\"host monotonic; device spans placed from their worker's start\","
		   "\"pid\":%d,\"complete\":%s}}\n",
		ape_version_string(), (int)getpid(), S.failed ? "false" : "true");
	return ferror(f) ? -1 : 0;
}

void ape__strace_flush(void)
{
	char tmp[4200];
	FILE *f;
	int fd, bad;

	if (!ape__strace_on())
		return;
	pthread_mutex_lock(&S.lock);
	snprintf(tmp, sizeof(tmp), "%s.tmp-%d", S.path, (int)getpid());
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
	f = fd >= 0 ? fdopen(fd, "w") : NULL;
	if (!f) {
		if (fd >= 0)
			close(fd);
		bad = 1;
	} else {
		bad = write_file(f);
		bad |= fclose(f) != 0;
		bad = bad || rename(tmp, S.path) != 0;
	}
	if (bad) {
		unlink(tmp);
		if (!S.warned)
			ape__warn("APE_TRACE=%s: the trace could not be written (%s)", S.path,
				  strerror(errno));
		S.warned = true;
	}
	pthread_mutex_unlock(&S.lock);
}
