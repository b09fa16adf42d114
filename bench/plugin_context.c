/* SPDX-License-Identifier: MIT */
/*
 * What backend plugins cost a context's creation (issue 27's targets): ape_context_create() and
 * ape_context_destroy(), timed in one process, alternating rounds, in three modes:
 *
 *   none    ape_context_options.backend_path = "" with APE_CONTEXT_NO_PLUGIN_DIR: nothing is
 *           looked for (what a context cost before plugins existed);
 *   search  the defaults with APE_BACKEND_PATH unset: the plugin folder under the install
 *           prefix is looked for (absent here), the case of every program that loads no plugin;
 *   plugin  backend_path = PLUGIN: the plugin is loaded and probed beside the built-ins.
 *
 *   plugin_context PLUGIN.so NAME [BACKENDS [rounds [creates]]]   (defaults: all 9 20)
 *
 * BACKENDS is ape_context_options.backends for every mode ("all": NULL, every backend; with a
 * list, NAME is added to it in the plugin mode so that the plugin is loaded). Prints each
 * round's median time per create+destroy of each mode, then the medians of the rounds and the
 * differences against `none`. Built by `make bench-plugin-context`; links libape.so (a plugin
 * binds to the shared library).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape/ape.h"
#include "bench_util.h"

#define MAXR 64

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* The median time of n creates+destroys with opts, in ms; -1 when a create fails. */
static double time_creates(const ape_context_options *o, int n)
{
	double t[256];

	for (int i = 0; i < n; i++) {
		ape_context *ctx = NULL;
		const double t0 = now_ms();

		if (ape_context_create(&ctx, o)) {
			fprintf(stderr, "plugin_context: ape_context_create: %s\n", ape_last_error());
			return -1;
		}
		ape_context_destroy(ctx);
		t[i] = now_ms() - t0;
	}
	return bench_median(t, n);
}

int main(int argc, char **argv)
{
	const char *plugin, *name, *backends;
	char with_plugin[256];
	int rounds, creates;
	double r[3][MAXR];
	ape_context_options o[3];
	static const char *const mode[3] = { "none", "search", "plugin" };

	if (argc < 3) {
		fprintf(stderr, "usage: plugin_context PLUGIN.so NAME [BACKENDS [rounds [creates]]]\n");
		return 2;
	}
	plugin = argv[1];
	name = argv[2];
	backends = argc > 3 && strcmp(argv[3], "all") ? argv[3] : NULL;
	rounds = argc > 4 ? atoi(argv[4]) : 9;
	creates = argc > 5 ? atoi(argv[5]) : 20;
	if (rounds < 1 || rounds > MAXR || creates < 1 || creates > 256) {
		fprintf(stderr, "plugin_context: rounds 1..%d, creates 1..256\n", MAXR);
		return 2;
	}
	unsetenv("APE_BACKEND_PATH");
	snprintf(with_plugin, sizeof(with_plugin), "%s,%s", backends ? backends : "", name);
	for (int m = 0; m < 3; m++) {
		ape_context_options_init(&o[m]);
		o[m].backends = backends;
	}
	o[0].backend_path = "";
	o[0].flags |= APE_CONTEXT_NO_PLUGIN_DIR;
	o[2].backend_path = plugin;
	if (backends)
		o[2].backends = with_plugin;
	/* the plugin must load, or the figure means nothing */
	{
		ape_context *ctx = NULL;
		ape_plugin_info pi;

		if (ape_context_create(&ctx, &o[2]) || ape_plugin_get_info(ctx, 0, &pi) ||
		    !pi.loaded) {
			fprintf(stderr, "plugin_context: %s not loaded: %s\n", plugin,
				ctx ? pi.reason : ape_last_error());
			ape_context_destroy(ctx);
			return 1;
		}
		ape_context_destroy(ctx);
	}
	for (int m = 0; m < 3; m++) /* warm-up: the drivers' first load */
		if (time_creates(&o[m], 2) < 0)
			return 1;
	printf("backends %s, %d rounds of %d creates+destroys per mode, alternating\n",
	       backends ? backends : "(all)", rounds, creates);
	printf("round  none_ms  search_ms  plugin_ms\n");
	for (int i = 0; i < rounds; i++) {
		for (int k = 0; k < 3; k++) {
			const int m = (i + k) % 3; /* rotate the order from round to round */

			r[m][i] = time_creates(&o[m], creates);
			if (r[m][i] < 0)
				return 1;
		}
		printf("%5d  %7.3f  %9.3f  %9.3f\n", i, r[0][i], r[1][i], r[2][i]);
	}
	{
		double med[3];

		for (int m = 0; m < 3; m++)
			med[m] = bench_median(r[m], rounds);
		for (int m = 0; m < 3; m++)
			printf("median %-6s %8.3f ms  (%+.3f ms against none)\n", mode[m], med[m],
			       med[m] - med[0]);
	}
	return 0;
}
