/* SPDX-License-Identifier: MIT */
/*
 * The trace file. Device clocks have arbitrary origins, so each device's events are shifted
 * to start where its worker started on the host clock: lanes of one device are exact relative
 * to each other, devices are aligned to within the start-up of their workers.
 */
#include "exec/trace.h"
#include "core/alloc.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape/ape.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/strace.h"
#include "core/verbose.h"

void ape__trace_add(struct ape__trace_dev *t, const char *what, int lane, double t0, double t1,
		    double enq, int64_t qc, int64_t kc, uint64_t bytes)
{
	if (t->n == t->cap) {
		size_t cap = t->cap ? 2 * t->cap : 256;
		struct ape__trace_ev *e = ape__realloc(t->ev, cap * sizeof(*e));

		if (!e) {
			t->failed = true;
			return;
		}
		t->ev = e;
		t->cap = cap;
	}
	t->ev[t->n++] = (struct ape__trace_ev){ what, lane, t0, t1 > t0 ? t1 : t0, enq, qc, kc, bytes };
}

void ape__trace_label(struct ape__trace_dev *t, struct ape_device *const *devs, int d)
{
	const struct ape_device *dev = devs[d];
	int dup = 0;

	for (int i = 0; i < d; i++)
		dup += devs[i] == dev;
	snprintf(t->label, sizeof(t->label), "%s:%d %s%s", dev->info.backend,
		 dev->info.backend_index, dev->info.name, dup ? " (again)" : "");
}

void ape__trace_free(struct ape__trace_dev *t)
{
	free(t->ev);
	t->ev = NULL;
	t->n = t->cap = 0;
}

/* A JSON string: device names come from drivers and may hold anything (core/verbose.h's escape,
 * the one every JSON libape writes goes through). Labels are at most 200 bytes. */
static void json_str(FILE *f, const char *s)
{
	char esc[1600];

	ape__json_escape(esc, sizeof(esc), s);
	fprintf(f, "\"%s\"", esc);
}

static const char *lane_name(int lane, char *buf, size_t len)
{
	if (lane == APE__LANE_KERNEL)
		return "kernels";
	if (lane >= APE__LANE_D2H)
		snprintf(buf, len, "d2h copies #%d", lane - APE__LANE_D2H);
	else if (lane >= APE__LANE_H2D_KV)
		snprintf(buf, len, "h2d K/V copies #%d", lane - APE__LANE_H2D_KV);
	else
		snprintf(buf, len, "h2d Q copies #%d", lane - APE__LANE_H2D_Q);
	return buf;
}

static void write_meta(FILE *f, int pid, const struct ape__trace_dev *t, bool *first)
{
	bool seen[64] = { false };
	char buf[64];

	fprintf(f, "%s\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":",
		*first ? "" : ",", pid);
	json_str(f, t->label);
	fprintf(f, "}}");
	*first = false;
	for (size_t i = 0; i < t->n; i++) {
		int lane = t->ev[i].lane;

		if (lane < 0 || lane >= 64 || seen[lane])
			continue;
		seen[lane] = true;
		fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
			   "\"args\":{\"name\":\"%s\"}}",
			pid, lane, lane_name(lane, buf, sizeof(buf)));
		fprintf(f, ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
			   "\"args\":{\"sort_index\":%d}}",
			pid, lane, lane);
	}
}

static void write_events(FILE *f, int pid, const struct ape__trace_dev *t)
{
	double origin = INFINITY;

	for (size_t i = 0; i < t->n; i++)
		origin = fmin(origin, t->ev[i].t0);
	for (size_t i = 0; i < t->n; i++) {
		const struct ape__trace_ev *e = &t->ev[i];
		double ts = (e->t0 - origin + t->host_start_ms) * 1e3, dur = (e->t1 - e->t0) * 1e3;

		fprintf(f, ",\n{\"name\":\"%s", e->what);
		if (e->qc >= 0)
			fprintf(f, " q%lld", (long long)e->qc);
		if (e->kc >= 0)
			fprintf(f, " k%lld", (long long)e->kc);
		fprintf(f, "\",\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,"
			   "\"tid\":%d,\"args\":{\"query_chunk\":%lld,\"key_chunk\":%lld,"
			   "\"bytes\":%llu",
			e->lane == APE__LANE_KERNEL ? "kernel" : "copy", ts, dur, pid, e->lane,
			(long long)e->qc, (long long)e->kc, (unsigned long long)e->bytes);
		if (e->lane == APE__LANE_KERNEL && t->path[0])
			fprintf(f, ",\"path\":\"%s\"", t->path);
		fprintf(f, "}}");
	}
}

void ape__trace_to_session(const struct ape__trace_dev *t)
{
	double shift = t->device_clock ? -INFINITY : 0;
	char lane[64], name[96], args[256];

	for (size_t i = 0; t->device_clock && i < t->n; i++)
		shift = fmax(shift, t->ev[i].enq - t->ev[i].t0);
	for (size_t i = 0; i < t->n; i++) {
		const struct ape__trace_ev *e = &t->ev[i];
		const double t0 = e->t0 + shift;
		int n = snprintf(name, sizeof(name), "%s", e->what);

		if (e->qc >= 0 && n >= 0 && (size_t)n < sizeof(name))
			n += snprintf(name + n, sizeof(name) - (size_t)n, " q%lld", (long long)e->qc);
		if (e->kc >= 0 && n >= 0 && (size_t)n < sizeof(name))
			snprintf(name + n, sizeof(name) - (size_t)n, " k%lld", (long long)e->kc);
		snprintf(args, sizeof(args),
			 "{\"query_chunk\":%lld,\"key_chunk\":%lld,\"bytes\":%llu%s%s%s}",
			 (long long)e->qc, (long long)e->kc, (unsigned long long)e->bytes,
			 e->lane == APE__LANE_KERNEL && t->path[0] ? ",\"path\":\"" : "",
			 e->lane == APE__LANE_KERNEL ? t->path : "",
			 e->lane == APE__LANE_KERNEL && t->path[0] ? "\"" : "");
		ape__strace_span(t->label, lane_name(e->lane, lane, sizeof(lane)), name,
				 e->lane == APE__LANE_KERNEL ? "kernel" : "copy", t0,
				 t0 + (e->t1 - e->t0), args);
	}
}

static int write_all(FILE *f, struct ape__trace_dev *devs, int n)
{
	bool first = true, device_clock = true, failed = false;

	fprintf(f, "{\"traceEvents\":[");
	for (int d = 0; d < n; d++) {
		write_meta(f, d, &devs[d], &first);
		write_events(f, d, &devs[d]);
		device_clock &= devs[d].device_clock;
		failed |= devs[d].failed;
	}
	fprintf(f, "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"producer\":\"libape %s\","
		   "\"clock\":\"%s\",\"complete\":%s}}\n",
		ape_version_string(),
		device_clock ? "device event timestamps"
			     : "host clock at enqueue (the backend has no event timestamps)",
		failed ? "false" : "true");
	return ferror(f) ? -1 : 0;
}

int ape__trace_write(const char *path, const char *fn, struct ape__trace_dev *devs, int n)
{
	size_t len = strlen(path) + 48;
	char *tmp = ape__malloc(len);
	FILE *f;
	int fd, err;

	if (!tmp)
		return ape__error(APE_ENOMEM, "%s: out of memory writing the trace %s", fn, path);
	/* O_EXCL with a name of this thread's own: the umask applies as to any file the user
	 * creates, and a concurrent call never writes into ours */
	snprintf(tmp, len, "%s.tmp-%d-%d", path, (int)getpid(), (int)gettid());
	fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
	if (fd < 0) {
		err = errno;
		free(tmp);
		return ape__error(APE_EIO, "%s: trace %s: cannot create a temporary file: %s", fn,
				  path, strerror(err));
	}
	f = fdopen(fd, "w");
	if (!f) {
		err = errno;
		close(fd);
		goto out_unlink;
	}
	errno = 0;
	if (write_all(f, devs, n) || fflush(f) || fsync(fileno(f))) {
		err = errno ? errno : EIO;
		fclose(f);
		goto out_unlink;
	}
	if (fclose(f)) {
		err = errno;
		goto out_unlink;
	}
	if (rename(tmp, path)) {
		err = errno;
		goto out_unlink;
	}
	free(tmp);
	return 0;

out_unlink:
	unlink(tmp);
	free(tmp);
	return ape__error(APE_EIO, "%s: writing the trace %s: %s", fn, path, strerror(err));
}
