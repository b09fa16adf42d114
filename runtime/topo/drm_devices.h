/* SPDX-License-Identifier: MIT */
/* DRM enumeration through libdrm: runtime/topo/drm.c is the only file that includes xf86drm.h.
 * (Not named drm.h: xf86drm.h includes <drm.h>, which -Iruntime would resolve to it.) */
#ifndef APE_RUNTIME_DRM_DEVICES_H
#define APE_RUNTIME_DRM_DEVICES_H

#include <stddef.h>

#include "topo/topology.h"

#pragma GCC visibility push(hidden)

/*
 * The kernel's DRM devices that have a render node (the node compute stacks open), as
 * sightings with api APE_API_DRM: PCI address and ids for PCI devices, the platform name for
 * others. `note` says what was found: "no DRM devices (/dev/dri absent)", "2 DRM devices, 1 with
 * a render node". *out is malloc'ed (free() it). Returns the count (0 is a normal answer), or
 * APE_ENOMEM.
 */
int ape__drm_scan(struct ape__sighting **out, char *note, size_t note_len);

#pragma GCC visibility pop
#endif
