# The core and the reference backend: always built.
APE_SOVERSION   := $(shell sed -n 's/^\#define APE_VERSION_MAJOR \([0-9]*\)/\1/p' include/ape/ape.h)
APE_VERSION_STR := $(shell sed -n 's/^\#define APE_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' include/ape/ape.h | paste -sd.)

LIB_SRCS += $(wildcard runtime/*.c) $(wildcard runtime/ref/*.c)

CPPFLAGS += $(if $(HAVE_OPENCL),-DAPE_HAVE_OPENCL,-DAPE_OPENCL_NOT_BUILT='"not built into this libape ($(OPENCL_WHY))"')
CPPFLAGS += $(if $(HAVE_CUDA),-DAPE_HAVE_CUDA,-DAPE_CUDA_NOT_BUILT='"not built into this libape ($(CUDA_WHY))"')
