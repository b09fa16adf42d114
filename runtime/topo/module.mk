# topo/: the machine. Every API's devices merged into one physical list by PCI address, hwloc's
# topology, NUMA placement of host staging memory and of the threads that feed devices.
#
# Optional dependencies, found with pkg-config and announced by the Makefile: hwloc (topology,
# NUMA placement) and libdrm (DRM device enumeration). Only topo/numa.c includes hwloc.h and only
# topo/drm.c xf86drm.h; without them, numa_none.c and drm_none.c stand in (no placement, no DRM
# listing, and the context says why). WITH_HWLOC / WITH_DRM = yes makes them required.
TOPO_OPTIONAL := runtime/topo/numa.c runtime/topo/numa_none.c runtime/topo/drm.c runtime/topo/drm_none.c
LIB_SRCS += $(filter-out $(TOPO_OPTIONAL),$(wildcard runtime/topo/*.c))
LIB_SRCS += $(if $(HAVE_HWLOC),runtime/topo/numa.c,runtime/topo/numa_none.c)
LIB_SRCS += $(if $(HAVE_DRM),runtime/topo/drm.c,runtime/topo/drm_none.c)
CPPFLAGS += $(if $(HAVE_HWLOC),-DAPE_HAVE_HWLOC) $(if $(HAVE_DRM),-DAPE_HAVE_DRM)

$(BUILD)/obj/runtime/topo/numa.o: CPPFLAGS += $(HWLOC_CFLAGS)
$(BUILD)/obj/runtime/topo/drm.o: CPPFLAGS += $(DRM_CFLAGS)
LIB_LIBS += $(if $(HAVE_HWLOC),$(HWLOC_LIBS)) $(if $(HAVE_DRM),$(DRM_LIBS))
