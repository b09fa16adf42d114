/* SPDX-License-Identifier: MIT */
/*
 * DRM devices through libdrm. Device nodes are never opened: drmGetDevices2() reads sysfs, and
 * opening a render node would wake a sleeping laptop GPU just to list it. Without the
 * DRM_DEVICE_GET_PCI_REVISION flag libdrm does not read PCI config space either, for the same
 * reason.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xf86drm.h>

#include "topo/drm_devices.h"
#include "core/alloc.h"
#include "core/error.h"

static void fill(struct ape__sighting *s, const drmDevice *d)
{
	memset(s, 0, sizeof(*s));
	s->api = APE_API_DRM;
	s->kind = APE_DEVICE_GPU;
	s->device_index = -1;
	snprintf(s->render_node, sizeof(s->render_node), "%s", d->nodes[DRM_NODE_RENDER]);
	if (d->bustype == DRM_BUS_PCI && d->businfo.pci && d->deviceinfo.pci) {
		struct ape__pci_addr a = { d->businfo.pci->domain, d->businfo.pci->bus,
					   d->businfo.pci->dev, d->businfo.pci->func };

		ape__pci_format(&a, s->pci_address, sizeof(s->pci_address));
		s->vendor_id = d->deviceinfo.pci->vendor_id;
		s->device_id = d->deviceinfo.pci->device_id;
		s->pci_class = 0; /* DRM does not say; the bus scan does */
	} else if (d->bustype == DRM_BUS_PLATFORM && d->deviceinfo.platform &&
		   d->deviceinfo.platform->compatible && d->deviceinfo.platform->compatible[0]) {
		snprintf(s->name, sizeof(s->name), "%s", d->deviceinfo.platform->compatible[0]);
	}
	if (!s->name[0])
		snprintf(s->name, sizeof(s->name), "DRM device %s", s->render_node);
}

int ape__drm_scan(struct ape__sighting **out, char *note, size_t note_len)
{
	struct ape__sighting *s;
	drmDevicePtr *devs;
	struct stat st;
	int n, m = 0;

	*out = NULL;
	if (stat("/dev/dri", &st)) {
		snprintf(note, note_len, "no DRM devices (/dev/dri absent)");
		return 0;
	}
	n = drmGetDevices2(0, NULL, 0);
	if (n == -ENOENT || n == 0) { /* libdrm's answer when /dev/dri holds no device */
		snprintf(note, note_len, "no DRM devices (/dev/dri has none)");
		return 0;
	}
	if (n < 0) {
		snprintf(note, note_len, "no DRM devices listed: drmGetDevices2: %s", strerror(-n));
		return 0;
	}
	devs = ape__calloc((size_t)n, sizeof(*devs));
	s = ape__calloc((size_t)n, sizeof(*s));
	if (!devs || !s) {
		free(devs);
		free(s);
		return ape__error(APE_ENOMEM, "out of memory listing DRM devices");
	}
	n = drmGetDevices2(0, devs, n); /* devices may come and go in between */
	for (int i = 0; i < n; i++)
		if (devs[i]->available_nodes & (1 << DRM_NODE_RENDER))
			fill(&s[m++], devs[i]);
	if (n > 0)
		drmFreeDevices(devs, n);
	free(devs);
	snprintf(note, note_len, "%d DRM device%s, %d with a render node", n > 0 ? n : 0,
		 n == 1 ? "" : "s", m);
	if (!m) {
		free(s);
		s = NULL;
	}
	*out = s;
	return m;
}
