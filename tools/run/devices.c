/* SPDX-License-Identifier: MIT */
/* ape-run's devices: --backend, --device, --devices, and the exit status of a libape error
 * (tools/run/run.h). */
#include <stdio.h>
#include <string.h>

#include "run/run.h"

int run_exit_code(int err)
{
	switch (err) {
	case 0:
		return RUN_OK;
	case APE_EINVAL:
	case APE_EOVERFLOW:
	case APE_EFORMAT:
		return RUN_USAGE;
	case APE_ENOBACKEND:
	case APE_ENODEV:
		return RUN_NODEV;
	default:
		return RUN_FAIL;
	}
}

int run_call_exit_code(const struct run_args *a, int err)
{
	/* the core refuses a table on a device that states no APE_BE_CAP_BIAS_TABLE */
	return err == APE_ENOTSUP && a->bias_table ? RUN_NODEV : run_exit_code(err);
}

/* Each comma-separated spec of --devices, through ape_device_select_spec(). */
static int select_list(const struct run_args *a, ape_context *ctx, ape_device **devs, int *ndev,
		       char *msg, size_t len)
{
	const char *p = a->devices;

	*ndev = 0;
	while (*p) {
		const char *comma = strchr(p, ',');
		int n = comma ? (int)(comma - p) : (int)strlen(p);
		ape_selection sel;
		char spec[128];
		int ret;

		if (n && *ndev == APE_MAX_DEVICES) {
			snprintf(msg, len, "--devices %s: more than %d devices", a->devices,
				 APE_MAX_DEVICES);
			return RUN_USAGE;
		}
		if (!n || n >= (int)sizeof(spec)) {
			snprintf(msg, len, "--devices %s: %s", a->devices,
				 !n ? "an empty entry" : "an entry too long");
			return RUN_USAGE;
		}
		snprintf(spec, sizeof(spec), "%.*s", n, p);
		ret = ape_device_select_spec(ctx, spec, &sel);
		if (ret) {
			snprintf(msg, len, "--devices: %s", ape_last_error());
			return run_exit_code(ret);
		}
		devs[(*ndev)++] = sel.device;
		if (a->stats)
			fprintf(stderr, "ape-run: device %d: %s\n", *ndev - 1, sel.note);
		p += n + (comma ? 1 : 0);
	}
	if (!*ndev) {
		snprintf(msg, len, "--devices: no device given");
		return RUN_USAGE;
	}
	return 0;
}

int run_open_devices(const struct run_args *a, ape_context **ctx, ape_device **devs, int *ndev,
		     char *msg, size_t len)
{
	ape_context_options opts;
	ape_selection sel;
	int ret;

	ape_context_options_init(&opts);
	/* A named backend is the only one probed: `--backend ref` need not start GPU drivers. */
	if (strcmp(a->backend, "auto"))
		opts.backends = a->backend;
	ret = ape_context_create(ctx, &opts);
	if (ret) {
		snprintf(msg, len, "--backend %s: %s", a->backend, ape_last_error());
		return run_exit_code(ret);
	}
	if (a->devices) {
		ret = select_list(a, *ctx, devs, ndev, msg, len);
		if (ret) {
			ape_context_destroy(*ctx);
			*ctx = NULL;
		}
		return ret;
	}
	if (a->device_spec) {
		char spec[128];

		/* "--backend opencl --device 0000:03:00.0": that GPU through OpenCL */
		snprintf(spec, sizeof(spec), "%s%s%s", strcmp(a->backend, "auto") ? a->backend : "",
			 strcmp(a->backend, "auto") ? ":" : "", a->device_spec);
		ret = ape_device_select_spec(*ctx, spec, &sel);
	} else {
		ret = ape_device_select(*ctx, a->backend, a->device, &sel);
	}
	if (ret) {
		snprintf(msg, len, "%s", ape_last_error());
		ape_context_destroy(*ctx);
		*ctx = NULL;
		return run_exit_code(ret);
	}
	/* auto never falls back silently */
	if (a->stats || sel.passed_over)
		fprintf(stderr, "ape-run: device: %s\n", sel.note);
	devs[0] = sel.device;
	*ndev = 1;
	return 0;
}
