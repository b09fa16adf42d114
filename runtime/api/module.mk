# api/: the public entry points (include/ape/ape.h): contexts, device selection, forward calls,
# the KV cache; they validate every argument, then hand the problem to the executor. The registry
# of backends lives here because only context creation reads it.
LIB_SRCS += $(wildcard runtime/api/*.c)

# The plugin folder under the install prefix (api/plugins.c): where `make install` puts nothing
# but the folder itself, and where a vendor's package puts its libape-backend-NAME.so. The
# library searches the folder of the PREFIX it was built with: build and install with the same
# PREFIX (`make PREFIX=/opt/ape && make install PREFIX=/opt/ape`).
APE_PLUGIN_DIR := $(PREFIX)/lib/libape/backends
$(BUILD)/obj/runtime/api/plugins.o: CPPFLAGS += -DAPE_PLUGIN_DIR='"$(APE_PLUGIN_DIR)"'
