# runtime/: the library's core and its reference backend, in layers, each folder one layer with
# its own module.mk. A file includes headers of its own layer and of the layers below it, never
# above (tools/check-layers.sh enforces it in `make check`):
#
#   api/   public entry points and argument validation        -> exec, topo, core
#   exec/  the executor: planner, streams, merge, multi-device -> topo, core
#   topo/  devices, topology, NUMA placement, host memory      -> core
#   core/  errors, allocation, the backend contract, the math shared with the kernels
#   ref/   the reference backend (a backend like opencl/ and cuda/; its backend.mk is read by
#          the top Makefile with theirs)                    -> core
APE_SOVERSION   := $(shell sed -n 's/^\#define APE_VERSION_MAJOR \([0-9]*\)/\1/p' include/ape/ape.h)
APE_VERSION_STR := $(shell sed -n 's/^\#define APE_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' include/ape/ape.h | paste -sd.)

include runtime/core/module.mk
include runtime/topo/module.mk
include runtime/exec/module.mk
include runtime/api/module.mk
