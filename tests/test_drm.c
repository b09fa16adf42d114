/* SPDX-License-Identifier: MIT */
/*
 * DRM enumeration on this machine, whatever it has: no /dev/dri at all must read as "no DRM
 * devices (/dev/dri absent)", never as an error; devices that are there must come out well formed
 * and reach the context's physical list. (The merge of DRM sightings with the other APIs is
 * tested on injected lists in test_topology.c.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape_test.h"
#include "topo/drm_devices.h"
#include "topo/topology.h"

TEST(scan_this_machine)
{
	struct ape__sighting *s = (struct ape__sighting *)&s;
	struct stat st;
	char note[256] = "";
	int n;

	if (!APE_TEST_HAVE_DRM)
		SKIP(return, APE_TEST_NO_DRM);
	n = ape__drm_scan(&s, note, sizeof(note));
	ASSERT_LE(0, n) TH_LOG("%s", ape_last_error());
	TH_LOG("DRM here: %s", note);
	if (stat("/dev/dri", &st)) {
		EXPECT_EQ(0, n);
		EXPECT_EQ(NULL, s);
		EXPECT_STREQ("no DRM devices (/dev/dri absent)", note);
		return;
	}
	EXPECT_NE('\0', note[0]);
	EXPECT_EQ(n == 0, s == NULL);
	for (int i = 0; i < n; i++) {
		struct ape__pci_addr a;
		char canon[16];

		EXPECT_EQ(APE_API_DRM, s[i].api);
		EXPECT_EQ(APE_DEVICE_GPU, s[i].kind);
		EXPECT_EQ(-1, s[i].device_index);
		EXPECT_EQ(0, strncmp(s[i].render_node, "/dev/dri/renderD", 16))
		TH_LOG("render node \"%s\"", s[i].render_node);
		EXPECT_EQ(0, access(s[i].render_node, F_OK)) TH_LOG("%s", s[i].render_node);
		if (s[i].pci_address[0]) {
			ASSERT_EQ(0, ape__pci_parse(s[i].pci_address, &a));
			ape__pci_format(&a, canon, sizeof(canon));
			EXPECT_STREQ(canon, s[i].pci_address);
			EXPECT_NE(0, s[i].vendor_id);
		}
	}
	free(s);
}

TEST(status_and_devices_reach_the_context)
{
	struct ape__sighting *s;
	ape_topology_info t;
	ape_context_options o;
	ape_context *ctx = NULL;
	char note[256];
	int n = ape__drm_scan(&s, note, sizeof(note)), np;

	ASSERT_LE(0, n);
	ape_context_options_init(&o);
	o.backends = "ref";
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_topology_get_info(ctx, &t));
	EXPECT_STREQ(note, t.drm_note);
	np = ape_physical_get_info(ctx, 0, NULL);
	for (int i = 0; i < n; i++) {
		bool found = false;

		if (ape__pci_display_only(s[i].vendor_id))
			continue;
		for (int j = 0; j < np; j++) {
			ape_physical_info p;

			ASSERT_EQ(0, ape_physical_get_info(ctx, j, &p));
			found |= !strcmp(p.render_node, s[i].render_node) && (p.apis & APE_API_DRM);
		}
		EXPECT_TRUE(found) TH_LOG("%s is not in the physical list", s[i].render_node);
	}
	free(s);
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
