/* SPDX-License-Identifier: MIT */
/*
 * ape-trace: merges the Chrome trace-event files libape writes (APE_TRACE's session traces, one
 * per process: the ranks of an MPI job with APE_TRACE=trace.%p.json; or ape-run --trace files)
 * into one file that Perfetto or chrome://tracing open as one timeline.
 *
 *   ape-trace merge -o ALL.json A.json B.json ...
 *
 * Each input's processes keep their names, prefixed with the input's file name, and get ids of
 * their own (input i's k-th process id becomes i * 1000 + k), so that two inputs never share a
 * track even where their processes had the same id (ranks on several machines). Times are kept:
 * session traces count from their own process's start (docs/profiling.md, "Traces").
 * The output is written to a temporary file and renamed: it appears complete or not at all.
 *
 * Exit status: 0 success; 2 bad arguments or an input that is not a libape trace; 1 anything
 * else (an input or the output could not be read or written).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape/ape.h"
#include "common/cli.h"
#include "common/json.h"

#define HEAD "{\"traceEvents\":["
#define TAIL "\n],"

enum { OPT_OUT = 1, OPT_HELP };

static const struct cli_option options[] = {
	{ "--output", "-o", true, OPT_OUT },
	{ "--help", "-h", false, OPT_HELP },
	{ NULL, NULL, false, 0 },
};

static void usage(void)
{
	printf("usage: ape-trace merge -o ALL.json TRACE.json [TRACE.json ...]\n"
	       "\n"
	       "Merges Chrome trace-event files written by libape (APE_TRACE=FILE, one per\n"
	       "process: APE_TRACE=trace.%%p.json for the ranks of an MPI job; ape-run --trace)\n"
	       "into one timeline. Each input's processes are named after the file and given ids\n"
	       "of their own. Open the result in https://ui.perfetto.dev or chrome://tracing.\n"
	       "\n"
	       "  -o, --output FILE   where to write the merged trace (required)\n"
	       "  --version           print the libape version and exit\n");
}

/* The whole of a file, NUL-terminated; NULL with errno set. */
static char *slurp(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	char *buf = NULL;
	size_t cap = 0, n = 0;

	if (!f)
		return NULL;
	for (;;) {
		if (n + 4096 + 1 > cap) {
			char *b;

			cap = cap ? 2 * cap : 65536;
			b = realloc(buf, cap);
			if (!b) {
				free(buf);
				fclose(f);
				errno = ENOMEM;
				return NULL;
			}
			buf = b;
		}
		const size_t got = fread(buf + n, 1, 4096, f);

		n += got;
		if (got < 4096)
			break;
	}
	if (ferror(f)) {
		free(buf);
		fclose(f);
		errno = EIO;
		return NULL;
	}
	fclose(f);
	buf[n] = '\0';
	*len = n;
	return buf;
}

/* The process ids of one input, in order of appearance, renumbered. */
struct pids {
	long long old[1000];
	int n;
};

static int new_pid(struct pids *p, long long old, int input)
{
	for (int i = 0; i < p->n; i++)
		if (p->old[i] == old)
			return input * 1000 + i;
	if (p->n == 1000)
		return -1;
	p->old[p->n] = old;
	return input * 1000 + p->n++;
}

/*
 * Writes input `input`'s events (the text between HEAD and TAIL: one event a line) to out with
 * their pids renumbered and their process names prefixed with `label`. 0, or 2 (a message
 * printed) when the text is not what libape writes.
 */
static int copy_events(FILE *out, const char *name, const char *label, char *ev, int input,
		       bool *first)
{
	struct pids p = { .n = 0 };

	for (char *line = ev; *line;) {
		char *end = strchr(line, '\n'), *pid;
		long long old;
		int np;

		if (end)
			*end = '\0';
		while (*line == ',' || *line == ' ')
			line++;
		/* the separator ends the line before the next event's */
		for (size_t k = strlen(line); k && (line[k - 1] == ',' || line[k - 1] == ' ' ||
						   line[k - 1] == '\r');)
			line[--k] = '\0';
		if (*line) {
			if (*line != '{') {
				fprintf(stderr, "ape-trace: %s: not a libape trace (an event line "
						"starts with '%.20s')\n",
					name, line);
				return 2;
			}
			pid = strstr(line, "\"pid\":");
			if (!pid || sscanf(pid + 6, "%lld", &old) != 1) {
				fprintf(stderr, "ape-trace: %s: not a libape trace (an event without "
						"a pid: '%.60s')\n",
					name, line);
				return 2;
			}
			np = new_pid(&p, old, input);
			if (np < 0) {
				fprintf(stderr, "ape-trace: %s: more than 1000 processes\n", name);
				return 2;
			}
			fputs(*first ? "\n" : ",\n", out);
			*first = false;
			/* up to the pid's digits, the new pid, the rest */
			fwrite(line, 1, (size_t)(pid + 6 - line), out);
			fprintf(out, "%d", np);
			{
				const char *rest = pid + 6;

				if (*rest == '-')
					rest++;
				while (*rest >= '0' && *rest <= '9')
					rest++;
				/* a process's name: "<file>: <its name>" */
				if (strstr(line, "\"name\":\"process_name\"")) {
					const char *a = strstr(rest, "\"args\":{\"name\":\"");

					if (a) {
						fwrite(rest, 1, (size_t)(a + 16 - rest), out);
						json_string_body(out, label);
						fputs(": ", out);
						rest = a + 16;
					}
				}
				fputs(rest, out);
			}
		}
		if (!end)
			break;
		line = end + 1;
	}
	return 0;
}

static int merge(const char *outpath, char *const *inputs, int n)
{
	size_t len = strlen(outpath) + 32;
	char *tmp = malloc(len);
	bool first = true;
	FILE *out;
	int ret = 0;

	if (!tmp) {
		fprintf(stderr, "ape-trace: out of memory\n");
		return 1;
	}
	snprintf(tmp, len, "%s.tmp-%d", outpath, (int)getpid());
	out = fopen(tmp, "w");
	if (!out) {
		fprintf(stderr, "ape-trace: %s: %s\n", outpath, strerror(errno));
		free(tmp);
		return 1;
	}
	fputs(HEAD, out);
	for (int i = 0; i < n && !ret; i++) {
		size_t flen = 0;
		char *text = slurp(inputs[i], &flen), *tail;
		const char *base = strrchr(inputs[i], '/');

		if (!text) {
			fprintf(stderr, "ape-trace: %s: %s\n", inputs[i], strerror(errno));
			ret = 1;
			break;
		}
		tail = strstr(text, TAIL);
		if (strncmp(text, HEAD, strlen(HEAD)) || !tail) {
			fprintf(stderr, "ape-trace: %s: not a libape trace (expected it to begin "
					"with %s and its events to end with a line \"],\")\n",
				inputs[i], HEAD);
			free(text);
			ret = 2;
			break;
		}
		*tail = '\0';
		ret = copy_events(out, inputs[i], base ? base + 1 : inputs[i],
				  text + strlen(HEAD), i, &first);
		free(text);
	}
	fprintf(out, "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"producer\":\"ape-trace "
		     "merge (libape %s)\",\"inputs\":%d}}\n",
		ape_version_string(), n);
	if (fclose(out) != 0 && !ret) {
		fprintf(stderr, "ape-trace: %s: %s\n", outpath, strerror(errno));
		ret = 1;
	}
	if (!ret && rename(tmp, outpath) != 0) {
		fprintf(stderr, "ape-trace: %s: %s\n", outpath, strerror(errno));
		ret = 1;
	}
	if (ret)
		unlink(tmp);
	free(tmp);
	return ret;
}

int main(int argc, char **argv)
{
	const char *out = NULL, *value;
	char err[256];
	char **inputs;
	int idx = 1, id, n = 0;

	inputs = calloc((size_t)argc + 1, sizeof(*inputs));
	if (!inputs)
		return 1;
	/* the command, options and inputs in any order (cli_next() answers --version) */
	while (idx < argc) {
		if (argv[idx][0] != '-') {
			inputs[n++] = argv[idx++];
			continue;
		}
		id = cli_next(argc, argv, &idx, options, &value, err, sizeof(err));
		if (id < 0) {
			fprintf(stderr, "ape-trace: %s\n", err);
			free(inputs);
			return 2;
		}
		if (id == OPT_HELP) {
			usage();
			free(inputs);
			return 0;
		}
		if (id == OPT_OUT)
			out = value;
	}
	if (!n || strcmp(inputs[0], "merge")) {
		fprintf(stderr, "ape-trace: expected the command 'merge'%s%s (see ape-trace --help)\n",
			n ? ", not " : "", n ? inputs[0] : "");
		free(inputs);
		return 2;
	}
	if (!out || !*out || n < 2) {
		fprintf(stderr, "ape-trace: merge needs -o FILE and at least one input trace\n");
		free(inputs);
		return 2;
	}
	id = merge(out, inputs + 1, n - 1);
	free(inputs);
	return id;
}
