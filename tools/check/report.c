/* SPDX-License-Identifier: MIT */
/*
 * ape-check's record (tools/check/check.h): one cell per case and device of every group, whatever
 * matrix printed it first; the summary table and the JSON's "cells" and "summary" come from it,
 * and so does the exit status.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ape/ape_backend.h"
#include "check/check.h"
#include "common/json.h"

/* Far more than the groups make: about 70 cells per device. */
#define MAX_CELLS 8192

static struct check_cell cells[MAX_CELLS];
static int ncells, dropped;

static const char *const group_names[CHECK_NGROUPS] = {
	[CHECK_LOAD] = "load",
	[CHECK_FORWARD] = "forward",
	[CHECK_BACKWARD] = "backward",
	[CHECK_RAGGED] = "ragged",
	[CHECK_DIAG] = "diagnostics",
	[CHECK_KV] = "kv",
	[CHECK_RESIDENT] = "resident",
	[CHECK_TABLES] = "tables",
	[CHECK_DETERMINISM] = "determinism",
	[CHECK_FAILURES] = "failures",
};

const char *check_group_name(enum check_group group)
{
	return group < CHECK_NGROUPS ? group_names[group] : "?";
}

const char *check_status_name(enum check_status status)
{
	return status == CHECK_PASS ? "pass" : status == CHECK_FAIL ? "fail" : "not_claimed";
}

void check_add(enum check_group group, const char *name, int dev, enum check_status status,
	       double err, double tol, const char *fmt, ...)
{
	struct check_cell *c;
	va_list ap;

	if (ncells == MAX_CELLS) {
		dropped++;
		return;
	}
	c = &cells[ncells++];
	c->name = name;
	c->group = group;
	c->dev = dev;
	c->status = status;
	c->err = err;
	c->tol = tol;
	va_start(ap, fmt);
	vsnprintf(c->msg, sizeof(c->msg), fmt, ap);
	va_end(ap);
}

bool check_names_device(const ape_device *dev, const char *msg)
{
	ape_device_info info;
	char label[48];

	if (ape_device_get_info(dev, &info))
		return false;
	snprintf(label, sizeof(label), "%s:%d", info.backend, info.backend_index);
	return strstr(msg, label) || (info.name[0] && strstr(msg, info.name));
}

/* Whether msg says that one of the ops every backend must have failed on dev ("opencl:0 NAME:
 * attention: ...", as the core names an op's failure): APE_ENOTSUP from such an op is the
 * backend breaking its contract, not a capability it leaves out. */
static bool required_op_failed(const ape_device *dev, const char *msg)
{
	static const char *const ops[] = { "buf_alloc", "queue_create", "synchronize", "copy_h2d",
					   "copy_d2h", "fill", "event_record", "event_wait",
					   "event_elapsed", "attention" };
	ape_device_info info;
	char label[256];
	const char *p;
	int n;

	if (ape_device_get_info(dev, &info))
		return false;
	n = snprintf(label, sizeof(label), "%s:%d %s", info.backend, info.backend_index,
		     info.name);
	if (info.pci_address[0] && n >= 0 && (size_t)n < sizeof(label))
		snprintf(label + n, sizeof(label) - (size_t)n, " (%s)", info.pci_address);
	for (p = msg; (p = strstr(p, label)); p++) {
		const char *op = p + strlen(label);

		if (strncmp(op, ": ", 2))
			continue;
		for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++)
			if (!strncmp(op + 2, ops[i], strlen(ops[i])) &&
			    !strncmp(op + 2 + strlen(ops[i]), ": ", 2))
				return true;
	}
	return false;
}

bool check_not_claimed(const ape_device *dev, int ret, const char *msg, uint64_t needs)
{
	if (needs && (ape_device_capabilities(dev) & needs) == needs)
		return false;
	return ret == APE_ENOTSUP && check_names_device(dev, msg) && !required_op_failed(dev, msg);
}

uint64_t check_cell_needs(enum check_group group, const char *name)
{
	switch (group) {
	case CHECK_BACKWARD:
		return APE_BE_CAP_BACKWARD;
	case CHECK_DETERMINISM:
		return strstr(name, "backward") ? APE_BE_CAP_BACKWARD : 0;
	case CHECK_DIAG:
		return APE_BE_CAP_DIAG;
	case CHECK_RESIDENT:
		if (strstr(name, "backward"))
			return APE_BE_CAP_RESIDENT_BACKWARD;
		return strstr(name, "diag") ? APE_BE_CAP_DIAG_VIEWS : 0;
	case CHECK_TABLES:
		return APE_BE_CAP_BIAS_TABLE | (strstr(name, "backward") ? APE_BE_CAP_BACKWARD : 0);
	default:
		return 0;
	}
}

/* The capability names of `bits`, space-separated, into buf. */
static void cap_words(uint64_t bits, char *buf, size_t cap)
{
	size_t n = 0;

	buf[0] = '\0';
	for (int i = 0; i < 64 && n < cap; i++)
		if ((bits >> i) & 1)
			n += (size_t)snprintf(buf + n, cap - n, "%s%s", n ? " " : "",
					      ape_be_cap_name((uint64_t)1 << i));
}

void check_add_error(enum check_group group, const char *name, int d, ape_device *dev, int ret,
		     bool optional)
{
	const char *msg = ape_last_error();
	const uint64_t needs = check_cell_needs(group, name);
	ape_device_info info;

	ape_device_get_info(dev, &info);
	if (optional && check_not_claimed(dev, ret, msg, 0) &&
	    !check_not_claimed(dev, ret, msg, needs)) { /* refused what it states */
		char words[128];

		cap_words(needs, words, sizeof(words));
		fprintf(stderr, "ape-check: %s on %s:%d: states %s, yet: %s\n", name, info.backend,
			info.backend_index, words, msg);
		check_add(group, name, d, CHECK_FAIL, NAN, NAN, "the device states %s, yet: %s", words,
			  msg);
		return;
	}
	if (optional && check_not_claimed(dev, ret, msg, needs)) {
		fprintf(stderr, "ape-check: %s on %s:%d not claimed: %s\n", name, info.backend,
			info.backend_index, msg);
		check_add(group, name, d, CHECK_NOT_CLAIMED, NAN, NAN, "%s", msg);
		return;
	}
	fprintf(stderr, "ape-check: %s on %s:%d: %s\n", name, info.backend, info.backend_index,
		msg);
	if (optional && ret == APE_ENOTSUP && !check_names_device(dev, msg))
		check_add(group, name, d, CHECK_FAIL, NAN, NAN,
			  "%s, and the message does not name the device: %s", ape_err_name(ret),
			  msg);
	else
		check_add(group, name, d, CHECK_FAIL, NAN, NAN, "%s: %s", ape_err_name(ret), msg);
}

void check_add_errors(enum check_group group, const char *name, int d, int n,
		      const char *const *labels, const double *err, const double *tol)
{
	check_add_errors_note(group, name, d, n, labels, err, tol, NULL);
}

void check_add_errors_note(enum check_group group, const char *name, int d, int n,
			   const char *const *labels, const double *err, const double *tol,
			   const char *note)
{
	char msg[sizeof(cells[0].msg)];
	size_t len = 0;
	int worst = 0;
	bool ok = true;

	msg[0] = '\0';
	for (int i = 0; i < n; i++) {
		ok &= err[i] <= tol[i]; /* NaN: not within */
		if (!(err[i] / tol[i] <= err[worst] / tol[worst]))
			worst = i;
		if (len < sizeof(msg))
			len += (size_t)snprintf(msg + len, sizeof(msg) - len, "%s%s %.2g",
						i ? " " : "", labels[i], err[i] / tol[i]);
	}
	if (len < sizeof(msg))
		len += (size_t)snprintf(msg + len, sizeof(msg) - len, " (max error / tolerance)");
	if (note && len < sizeof(msg))
		snprintf(msg + len, sizeof(msg) - len, "; %s", note);
	check_add(group, name, d, ok ? CHECK_PASS : CHECK_FAIL, n ? err[worst] : NAN,
		  n ? tol[worst] : NAN, "%s", msg);
}

int check_count(void)
{
	return ncells;
}

const struct check_cell *check_get(int i)
{
	return &cells[i];
}

bool check_all_passed(void)
{
	for (int i = 0; i < ncells; i++)
		if (cells[i].status == CHECK_FAIL)
			return false;
	return !dropped;
}

/* The cell of `name` in `group` on device d, or NULL. */
static const struct check_cell *find(enum check_group group, const char *name, int d)
{
	for (int i = 0; i < ncells; i++)
		if (cells[i].group == group && cells[i].dev == d && !strcmp(cells[i].name, name))
			return &cells[i];
	return NULL;
}

void check_print_cells(ape_device **devs, int ndev, enum check_group first,
		       enum check_group last)
{
	for (int g = first; g <= (int)last; g++) {
		bool header = false;

		for (int i = 0; i < ncells; i++) {
			const struct check_cell *c = &cells[i];

			if ((int)c->group != g || find(c->group, c->name, c->dev) != c ||
			    (c->dev > 0 && find(c->group, c->name, 0)))
				continue; /* one line per name, at its first cell */
			if (!header) {
				printf("\n%-34s", group_names[g]);
				for (int d = 0; d < ndev; d++) {
					ape_device_info info;
					char label[40];

					ape_device_get_info(devs[d], &info);
					snprintf(label, sizeof(label), "%s:%d", info.backend,
						 info.backend_index);
					printf(" | %-24s", label);
				}
				printf("\n");
				header = true;
			}
			printf("%-34s", c->name);
			for (int d = 0; d < ndev; d++) {
				const struct check_cell *e = find(c->group, c->name, d);
				char txt[40];

				if (!e)
					snprintf(txt, sizeof(txt), "-");
				else if (e->status == CHECK_NOT_CLAIMED)
					snprintf(txt, sizeof(txt), "not claimed");
				else if (isnan(e->err))
					snprintf(txt, sizeof(txt), "%s",
						 e->status == CHECK_PASS ? "ok" : "FAIL");
				else
					snprintf(txt, sizeof(txt), "%.2g %s", e->err / e->tol,
						 e->status == CHECK_PASS ? "ok" : "FAIL");
				printf(" | %-24s", txt);
			}
			printf("\n");
		}
	}
}

/* Cells of group g (every group: CHECK_NGROUPS) with status s. */
static int tally(int g, enum check_status s)
{
	int n = 0;

	for (int i = 0; i < ncells; i++)
		n += (g == CHECK_NGROUPS || (int)cells[i].group == g) && cells[i].status == s;
	return n;
}

void check_print_summary(int ndev)
{
	int pass = tally(CHECK_NGROUPS, CHECK_PASS), fail = tally(CHECK_NGROUPS, CHECK_FAIL);
	int nc = tally(CHECK_NGROUPS, CHECK_NOT_CLAIMED);

	printf("\nsummary (cells over every device)  passed  failed  not claimed\n");
	for (int g = 0; g < CHECK_NGROUPS; g++) {
		const int p = tally(g, CHECK_PASS), f = tally(g, CHECK_FAIL);
		const int n = tally(g, CHECK_NOT_CLAIMED);

		if (p + f + n)
			printf("%-34s %7d %7d %12d%s\n", group_names[g], p, f, n,
			       !p && !f ? "  (not claimed)" : "");
	}
	printf("%-34s %7d %7d %12d\n", "total", pass, fail, nc);
	if (dropped)
		printf("%d cells not recorded: more than %d\n", dropped, MAX_CELLS);
	if (check_all_passed())
		printf("PASS: every cell claimed passed on %d device%s (%d not claimed)\n", ndev,
		       ndev == 1 ? "" : "s", nc);
	else
		printf("FAIL: %d cell%s failed\n", fail, fail == 1 ? "" : "s");
}

/* A number, or null for NaN (JSON has no NaN) and infinities. */
static void json_number(FILE *f, double x)
{
	if (isfinite(x))
		fprintf(f, "%.6g", x);
	else
		fputs("null", f);
}

void check_json_cells(FILE *f, ape_device **devs)
{
	int shown = 0;

	fprintf(f, ",\n \"cells\": [");
	for (int k = 0; k < CHECK_NGROUPS * ncells; k++) { /* by group, then as recorded */
		const struct check_cell *c = &cells[k % ncells];
		char label[48] = "";

		if ((int)c->group != k / ncells)
			continue;

		if (c->dev >= 0) {
			ape_device_info info;

			ape_device_get_info(devs[c->dev], &info);
			snprintf(label, sizeof(label), "%s:%d", info.backend, info.backend_index);
		}
		fprintf(f, "%s\n  {\"group\": \"%s\", \"cell\": ", shown++ ? "," : "",
			group_names[c->group]);
		json_string(f, c->name);
		fprintf(f, ", \"device\": ");
		json_string(f, c->dev >= 0 ? label : NULL);
		fprintf(f, ", \"status\": \"%s\", \"max_err\": ", check_status_name(c->status));
		json_number(f, c->err);
		fprintf(f, ", \"tol\": ");
		json_number(f, c->tol);
		fprintf(f, ", \"message\": ");
		json_string(f, c->msg);
		fprintf(f, "}");
	}
	fprintf(f, "\n ],\n \"summary\": {");
	for (int g = 0; g <= CHECK_NGROUPS; g++)
		fprintf(f, "%s\n  \"%s\": {\"passed\": %d, \"failed\": %d, \"not_claimed\": %d}",
			g ? "," : "", g < CHECK_NGROUPS ? group_names[g] : "total",
			tally(g, CHECK_PASS), tally(g, CHECK_FAIL), tally(g, CHECK_NOT_CLAIMED));
	fprintf(f, "\n }");
}
