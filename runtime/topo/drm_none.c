/* SPDX-License-Identifier: MIT */
/* Built instead of runtime/topo/drm.c when libdrm is not available at build time (WITH_DRM=no, or auto
 * without it): DRM devices are not listed, and the context says why. */
#include <stdio.h>

#include "topo/drm_devices.h"

int ape__drm_scan(struct ape__sighting **out, char *note, size_t note_len)
{
	*out = NULL;
	snprintf(note, note_len, "not scanned: libdrm is not built into this libape");
	return 0;
}
