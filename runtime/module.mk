# The core and the reference backend: always built.
APE_SOVERSION   := $(shell sed -n 's/^\#define APE_VERSION_MAJOR \([0-9]*\)/\1/p' include/ape/ape.h)
APE_VERSION_STR := $(shell sed -n 's/^\#define APE_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' include/ape/ape.h | paste -sd.)

LIB_SRCS += $(wildcard runtime/*.c) $(wildcard runtime/ref/*.c)

CPPFLAGS += $(if $(HAVE_OPENCL),-DAPE_HAVE_OPENCL,-DAPE_OPENCL_NOT_BUILT='"not built into this libape ($(OPENCL_WHY))"')
CPPFLAGS += $(if $(HAVE_CUDA),-DAPE_HAVE_CUDA,-DAPE_CUDA_NOT_BUILT='"not built into this libape ($(CUDA_WHY))"')

# Required dependencies, found with pkg-config: hwloc (topology, NUMA placement) and libdrm (DRM
# device enumeration). Only runtime/numa.c includes hwloc.h and only runtime/drm.c xf86drm.h, so
# only they get the include flags. Targets that install them or clean up must work without them.
PKG_CONFIG ?= pkg-config
HWLOC_CFLAGS := $(shell $(PKG_CONFIG) --cflags hwloc 2>/dev/null)
HWLOC_LIBS   := $(shell $(PKG_CONFIG) --libs hwloc 2>/dev/null)
DRM_CFLAGS   := $(shell $(PKG_CONFIG) --cflags libdrm 2>/dev/null)
DRM_LIBS     := $(shell $(PKG_CONFIG) --libs libdrm 2>/dev/null)
ifeq ($(filter deps help clean distclean,$(MAKECMDGOALS)),)
ifeq ($(HWLOC_LIBS),)
$(error hwloc not found by $(PKG_CONFIG) (Debian: libhwloc-dev, libhwloc-plugins): run `make deps`)
endif
ifeq ($(DRM_LIBS),)
$(error libdrm not found by $(PKG_CONFIG) (Debian: libdrm-dev): run `make deps`)
endif
endif

$(BUILD)/obj/runtime/numa.o: CPPFLAGS += $(HWLOC_CFLAGS)
$(BUILD)/obj/runtime/drm.o: CPPFLAGS += $(DRM_CFLAGS)
LIB_LIBS += $(HWLOC_LIBS) $(DRM_LIBS)
