# The core and the reference backend: always built.
APE_SOVERSION   := $(shell sed -n 's/^\#define APE_VERSION_MAJOR \([0-9]*\)/\1/p' include/ape/ape.h)
APE_VERSION_STR := $(shell sed -n 's/^\#define APE_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' include/ape/ape.h | paste -sd.)

LIB_SRCS += $(wildcard runtime/*.c) $(wildcard runtime/ref/*.c)

CPPFLAGS += $(if $(HAVE_OPENCL),-DAPE_HAVE_OPENCL,-DAPE_OPENCL_NOT_BUILT='"not built into this libape ($(OPENCL_WHY))"')
CPPFLAGS += $(if $(HAVE_CUDA),-DAPE_HAVE_CUDA,-DAPE_CUDA_NOT_BUILT='"not built into this libape ($(CUDA_WHY))"')

# Optional dependencies, found with pkg-config and announced by the Makefile: hwloc (topology,
# NUMA placement) and libdrm (DRM device enumeration). Only runtime/numa.c includes hwloc.h and
# only runtime/drm.c xf86drm.h; without them, numa_none.c and drm_none.c stand in (no placement,
# no DRM listing, and the context says why). WITH_HWLOC / WITH_DRM = yes makes them required.
LIB_SRCS := $(filter-out runtime/numa.c runtime/numa_none.c runtime/drm.c runtime/drm_none.c,$(LIB_SRCS))
LIB_SRCS += $(if $(HAVE_HWLOC),runtime/numa.c,runtime/numa_none.c)
LIB_SRCS += $(if $(HAVE_DRM),runtime/drm.c,runtime/drm_none.c)
CPPFLAGS += $(if $(HAVE_HWLOC),-DAPE_HAVE_HWLOC) $(if $(HAVE_DRM),-DAPE_HAVE_DRM)

$(BUILD)/obj/runtime/numa.o: CPPFLAGS += $(HWLOC_CFLAGS)
$(BUILD)/obj/runtime/drm.o: CPPFLAGS += $(DRM_CFLAGS)
LIB_LIBS += $(if $(HAVE_HWLOC),$(HWLOC_LIBS)) $(if $(HAVE_DRM),$(DRM_LIBS))
