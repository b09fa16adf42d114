/* SPDX-License-Identifier: MIT */
/*
 * A program that links libape.a without exporting its symbols (tests/test_plugins.c,
 * "a_static_program_is_told"): a plugin it loads would call the libape.so its run path finds, a
 * second copy, so the loader refuses it and says why. Prints the first plugin's reason.
 *   static_host PLUGIN.so
 */
#include <stdio.h>

#include "ape/ape.h"

int main(int argc, char **argv)
{
	ape_context_options o;
	ape_context *ctx = NULL;
	ape_plugin_info pi;

	if (argc != 2)
		return 2;
	ape_context_options_init(&o);
	o.backend_path = argv[1];
	o.flags |= APE_CONTEXT_NO_PLUGIN_DIR;
	if (ape_context_create(&ctx, &o)) {
		printf("ape_context_create: %s\n", ape_last_error());
		return 1;
	}
	if (ape_plugin_get_info(ctx, 0, &pi)) {
		printf("ape_plugin_get_info: %s\n", ape_last_error());
		ape_context_destroy(ctx);
		return 1;
	}
	printf("loaded %d: %s\n", pi.loaded, pi.reason);
	ape_context_destroy(ctx);
	return 0;
}
