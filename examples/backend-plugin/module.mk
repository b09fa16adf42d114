# The example backend plugin (examples/backend-plugin/, docs/backends.md): `make plugin-example`
# builds it with its own Makefile, the one a vendor copies, against the public headers of
# include/ only (as installed: no runtime/ on the include path) and $(BUILD)/lib/libape.so,
# into $(BUILD)/plugins/ (found there by the plugin's run path ../lib). tests/test_plugin_example.c
# loads it, so `make check` builds it too.
PLUGIN_EXAMPLE := $(BUILD)/plugins/libape-backend-example.so

$(PLUGIN_EXAMPLE): $(wildcard examples/backend-plugin/*.c examples/backend-plugin/*.h) \
		   examples/backend-plugin/Makefile include/ape/ape.h include/ape/ape_backend.h \
		   include/ape/ape_math.h $(LIBSO) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $@"
	$(Q)$(MAKE) --no-print-directory $(if $(Q),-s) -B -C examples/backend-plugin \
		APE_INCLUDE='$(CURDIR)/include' APE_LIBDIR='$(abspath $(BUILD)/lib)' \
		OUT='$(abspath $@)' RPATH_ORIGIN=../lib CC='$(CC)' \
		CFLAGS='$(OPT) -g -Werror $(SAN_FLAGS) $(CFLAGS)' LDFLAGS='$(LDFLAGS)'

plugin-example: $(PLUGIN_EXAMPLE)

TESTS_BUILD_ONLY += $(PLUGIN_EXAMPLE)

.PHONY: plugin-example
