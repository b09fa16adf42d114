/* SPDX-License-Identifier: MIT */
/*
 * Local against remote staging buffers: the figure that says whether NUMA placement matters on a
 * machine. Each node's buffer is checked after the copies (the pages-on column): a number that
 * came from the wrong node would be worse than none.
 */
#include "numa_bench.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/json.h"

struct node_row {
	int node, distance, err;
	ape_copy_result res;
};

static void print_text(const ape_device_info *di, const struct node_row *rows, int n,
		       const struct node_row *local, size_t bytes, int repeats, const char *note)
{
	char node[16] = "unknown";

	if (di->numa_node >= 0)
		snprintf(node, sizeof(node), "%d", di->numa_node);
	printf("ape-bench --numa: %s:%d %s (NUMA node %s), %zu MiB copies, %d repeats\n",
	       di->backend, di->backend_index, di->name, node, bytes >> 20, repeats);
	printf("%6s %9s %9s %10s %9s %9s\n", "node", "distance", "pages on", "median_ms", "GB/s",
	       "vs local");
	for (int i = 0; i < n; i++) {
		const struct node_row *r = &rows[i];
		char ratio[16] = "-", dist[16] = "-", on[16] = "spread";

		if (r->err) {
			printf("%6d  %s\n", r->node, ape_strerror(r->err));
			continue;
		}
		if (local && !local->err && local->res.gbytes_per_s > 0)
			snprintf(ratio, sizeof(ratio), "%.2f",
				 r->res.gbytes_per_s / local->res.gbytes_per_s);
		if (r->distance > 0)
			snprintf(dist, sizeof(dist), "%d", r->distance);
		if (r->res.numa_node >= 0)
			snprintf(on, sizeof(on), "%d", r->res.numa_node);
		printf("%6d %9s %9s %10.3f %9.2f %9s%s\n", r->node, dist, on, r->res.ms,
		       r->res.gbytes_per_s, ratio, r == local ? "  (local)" : "");
	}
	if (note)
		printf("ape-bench: --numa: %s\n", note);
}

static void print_json(const ape_device_info *di, const struct node_row *rows, int n,
		       size_t bytes, int repeats, const char *note)
{
	printf("{\"device\": {\"backend\": ");
	json_string(stdout, di->backend);
	printf(", \"index\": %d, \"name\": ", di->backend_index);
	json_string(stdout, di->name);
	printf(", \"numa_node\": %d},\n \"bytes\": %zu, \"repeats\": %d, \"compared\": %s, "
	       "\"note\": ", di->numa_node, bytes, repeats, note ? "false" : "true");
	json_string(stdout, note);
	printf(",\n \"nodes\": [");
	for (int i = 0; i < n; i++) {
		const struct node_row *r = &rows[i];

		printf("%s\n  {\"node\": %d, \"local\": %s, \"distance\": %d, ", i ? "," : "",
		       r->node, r->node == di->numa_node ? "true" : "false", r->distance);
		if (r->err) {
			printf("\"error\": ");
			json_string(stdout, ape_strerror(r->err));
			printf("}");
			continue;
		}
		printf("\"pages_on\": %d, \"median_ms\": %.6g, \"gbytes_per_s\": %.6g}",
		       r->res.numa_node, r->res.ms, r->res.gbytes_per_s);
	}
	printf("\n ]}\n");
}

int numa_bench(ape_context *ctx, ape_device *dev, size_t bytes, int repeats, bool json)
{
	const char *note = NULL;
	struct node_row *rows, *local = NULL;
	ape_device_info di;
	int n = ape_numa_get_info(ctx, 0, NULL), failed = 0;

	ape_device_get_info(dev, &di);
	if (n <= 0) {
		fprintf(stderr, "ape-bench: --numa: the NUMA nodes of this machine are unknown\n");
		return 1;
	}
	rows = calloc((size_t)n, sizeof(*rows));
	if (!rows)
		return 1;
	for (int i = 0; i < n; i++) {
		ape_numa_info ni;
		struct node_row *r = &rows[i];

		ape_numa_get_info(ctx, i, &ni);
		r->node = ni.os_index;
		r->distance = di.numa_node >= 0 ? ape_numa_distance(ctx, di.numa_node, r->node) : 0;
		r->err = ape_device_measure_h2d(dev, r->node, bytes, repeats, &r->res);
		if (r->err) {
			fprintf(stderr, "ape-bench: --numa: node %d: %s\n", r->node, ape_last_error());
			failed++;
		}
		if (r->node == di.numa_node)
			local = r;
	}
	if (n == 1)
		note = "this machine has one NUMA node: there is no remote node to compare with";
	else if (!local)
		note = "the device's NUMA node is unknown (local to several, or not said): no node "
		       "is local";
	if (json)
		print_json(&di, rows, n, bytes, repeats, note);
	else
		print_text(&di, rows, n, local, bytes, repeats, note);
	free(rows);
	return failed ? 1 : 0;
}
