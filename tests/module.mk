# Kselftest programs: tests/test_*.c, each linked with the static library (so internal pieces can
# be tested too), the tools' helpers and tests/common/.
TEST_SRCS        := $(wildcard tests/test_*.c)
TEST_COMMON_SRCS := $(wildcard tests/common/*.c)
TESTS            := $(TEST_SRCS:tests/%.c=$(BUILD)/tests/%)
TEST_CFLAGS       = -isystem $(KSFT_DIR) -Itests -Itools $(APP_CFLAGS) -Wno-missing-prototypes

$(KSFT_DIR)/kselftest_harness.h:
	@echo "The Kselftest headers are missing from $(KSFT_DIR): run 'make deps' first." >&2
	@exit 1

$(BUILD)/tests-obj/%.o: %.c $(CONFIG_STAMP) | $(KSFT_DIR)/kselftest_harness.h
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(TEST_CFLAGS) -c $< -o $@

$(BUILD)/tests/%: $(BUILD)/tests-obj/tests/%.o $(TEST_COMMON_SRCS:%.c=$(BUILD)/tests-obj/%.o) \
		  $(TOOLS_LIB) $(LIBA) tools/plugin-host.dynlist
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(LDFLAGS) $(PLUGIN_HOST_LDFLAGS) -o $@ $(filter %.o,$^) $(TOOLS_LIB) $(LIBA) \
		$(LIB_LIBS) $(LDLIBS)

# Tests find the source tree (fixtures, README) and the build tree (tools, example) through these.
TEST_CFLAGS += -DAPE_SOURCE_DIR='"$(CURDIR)"' -DAPE_BUILD_DIR='"$(abspath $(BUILD))"'

# docs/example.c is the README's example: built and run by tests/test_example.c.
EXAMPLE := $(BUILD)/examples/example
$(EXAMPLE): docs/example.c $(LIBA) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(APP_CFLAGS) $(LDFLAGS) -o $@ $< $(LIBA) $(LIB_LIBS) $(LDLIBS)
$(BUILD)/tests/test_example: $(EXAMPLE)
# It also runs `make install` on this very tree, passing on the variables this make was given
# (BUILD=..., SANITIZE=1, ...: the install must neither reconfigure nor rebuild the tree), made
# safe for a C string in a shell word.
$(BUILD)/tests-obj/tests/test_example.o: TEST_CFLAGS += \
	-DAPE_MAKE_OVERRIDES='"$(subst ',,$(subst ",\",$(subst \,\\,$(MAKEOVERRIDES))))"'

# tests/test_plugin_example.c loads the example backend plugin (examples/backend-plugin/module.mk)
# with dlopen(); -rdynamic exports this program's libape (the static library) to it, so that the
# services the plugin calls (ape_be_*) are this libape's, not those of the libape.so its run path
# also loads.
$(BUILD)/tests/test_plugin_example: $(PLUGIN_EXAMPLE)
$(BUILD)/tests/test_plugin_example: private LDFLAGS += -rdynamic
# It also builds the plugin as docs/backends.md says, against `make install` of this tree (with
# this make's variables, as test_example does).
$(BUILD)/tests-obj/tests/test_plugin_example.o: TEST_CFLAGS += \
	-DAPE_MAKE_OVERRIDES='"$(subst ',,$(subst ",\",$(subst \,\\,$(MAKEOVERRIDES))))"'

# The public headers (ape.h, ape_dlpack.h, ape_backend.h) must compile as C++ (warnings as errors,
# pedantic).
CXX ?= g++
CXX_HEADER_CHECK := $(BUILD)/tests-obj/cxx_header.o
$(CXX_HEADER_CHECK): tests/cxx_header.cc include/ape/ape.h include/ape/ape_dlpack.h \
		     include/ape/ape_backend.h $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CXX     $<"
	$(Q)$(CXX) -std=c++11 -Wall -Wextra -Werror -pedantic -Iinclude -c $< -o $@
TESTS_BUILD_ONLY += $(CXX_HEADER_CHECK) $(EXAMPLE)

# The executor suites run on every backend (tests/common/backend_fixture.h), CUDA through the
# emulated driver where the build has the CUDA backend.
TESTS_ON_EVERY_BACKEND := $(BUILD)/tests/test_stream $(BUILD)/tests/test_stream_calls \
                          $(BUILD)/tests/test_kvcache \
                          $(BUILD)/tests/test_kvcache_inplace $(BUILD)/tests/test_kvpool \
                          $(BUILD)/tests/test_diag $(BUILD)/tests/test_diag_kernels \
                          $(BUILD)/tests/test_multidev \
                          $(BUILD)/tests/test_ends $(BUILD)/tests/test_varlen \
                          $(BUILD)/tests/test_dense_positions $(BUILD)/tests/test_bias_table
ifeq ($(HAVE_CUDA),yes)
$(TESTS_ON_EVERY_BACKEND): $(CUDA_EMU)
endif

# tests/test_dlpack_devices.c makes its own cl_mem objects and queues on the device's cl_context;
# tests/test_dlpack.c runs docs/embed_example.c (docs/embedding.md's example: an application's
# own OpenCL context).
ifeq ($(HAVE_OPENCL),yes)
EMBED_EXAMPLE := $(BUILD)/examples/embed_example
$(EMBED_EXAMPLE): docs/embed_example.c $(LIBA) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(APP_CFLAGS) $(LDFLAGS) -o $@ $< $(LIBA) $(LIB_LIBS) $(LDLIBS) -lOpenCL
$(BUILD)/tests/test_dlpack $(BUILD)/tests/test_dlpack_devices: LDLIBS += -lOpenCL
$(BUILD)/tests/test_dlpack: $(EMBED_EXAMPLE)
$(BUILD)/tests-obj/tests/test_dlpack.o $(BUILD)/tests-obj/tests/test_dlpack_devices.o: \
	TEST_CFLAGS += -DCL_TARGET_OPENCL_VERSION=120
TESTS_BUILD_ONLY += $(EMBED_EXAMPLE)
endif
# ... and test_dlpack_devices.c drives the CUDA backend through the emulated driver (kDLCUDA
# tensors)
ifeq ($(HAVE_CUDA),yes)
$(BUILD)/tests/test_dlpack $(BUILD)/tests/test_dlpack_devices: $(CUDA_EMU)
$(BUILD)/tests/test_dlpack $(BUILD)/tests/test_dlpack_devices: LDLIBS += -ldl
endif
# The tools' tests run the tools on the emulated CUDA device too, where a backward pass is not
# implemented yet: ape-run, ape-bench and ape-check must say so (exit 3, or SKIP cells).
ifeq ($(HAVE_CUDA),yes)
$(BUILD)/tests/test_tools $(BUILD)/tests/test_ape_run $(BUILD)/tests/test_ape_run_backward \
	$(BUILD)/tests/test_ape_run_bias_table: $(CUDA_EMU)
endif

# The OpenCL interop tests make their own cl_context, queues and buffers: they link the ICD
# loader (libape itself opens it at run time, the same library, so the objects are shared).
OPENCL_INTEROP_TESTS := test_opencl_interop test_opencl_interop_queues
ifeq ($(HAVE_OPENCL),yes)
$(OPENCL_INTEROP_TESTS:%=$(BUILD)/tests/%): LDLIBS += -lOpenCL
$(OPENCL_INTEROP_TESTS:%=$(BUILD)/tests-obj/tests/%.o): TEST_CFLAGS += -DCL_TARGET_OPENCL_VERSION=120
endif

# tests/test_nvtx.c: a fake NVTX tool (tests/nvtx_inject.c, a shared library next to the test)
# that NVTX's init loads through NVTX_INJECTION64_PATH; it reads the nvtx3 headers the Makefile
# found. Without them the test skips and the tool is not built. The CUDA variant runs on the
# emulated driver.
ifeq ($(HAVE_NVTX),yes)
NVTX_INJECT := $(BUILD)/tests/libnvtx_inject.so
$(NVTX_INJECT): tests/nvtx_inject.c $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(NVTX_CPPFLAGS) $(APP_CFLAGS) -fPIC -shared $(LDFLAGS) -o $@ $< -lpthread
$(BUILD)/tests/test_nvtx: $(NVTX_INJECT)
endif
ifeq ($(HAVE_CUDA),yes)
$(BUILD)/tests/test_nvtx: $(CUDA_EMU)
endif

# Backend plugins (tests/plugins/fixture.c, one shared object per variant, named as a plugin
# folder names them) for tests/test_plugins.c, tests/faults/test_pluginfail.c and
# tests/faults/test_pluginthreads.c: linked with -lape like a vendor's plugin (the tests export
# libape's API, so the plugins call the test's own copy), built with this build's sanitizers.
PLUGIN_FIXTURE_DIR := $(BUILD)/tests/plugins
PLUGIN_FIXTURE_FLAGS_a         :=
PLUGIN_FIXTURE_FLAGS_b         := -DFIXTURE_NAME='"plug_b"'
PLUGIN_FIXTURE_FLAGS_badcaps   := -DFIXTURE_NAME='"badcaps"' -DFIXTURE_BAD_CAPS
PLUGIN_FIXTURE_FLAGS_clash     := -DFIXTURE_NAME='"ref"'
PLUGIN_FIXTURE_FLAGS_major     := -DFIXTURE_NAME='"major"' -DFIXTURE_MAJOR
PLUGIN_FIXTURE_FLAGS_noattn    := -DFIXTURE_NAME='"noattn"' -DFIXTURE_NO_ATTENTION
PLUGIN_FIXTURE_FLAGS_nodev     := -DFIXTURE_NAME='"nodev"' -DFIXTURE_NO_DEVICE
PLUGIN_FIXTURE_FLAGS_null      := -DFIXTURE_NULL_TABLE
PLUGIN_FIXTURE_FLAGS_nosym     := -DFIXTURE_NO_SYMBOL
PLUGIN_FIXTURE_FLAGS_probefail := -DFIXTURE_NAME='"probefail"' -DFIXTURE_PROBE_FAILS
PLUGIN_FIXTURE_FLAGS_short     := -DFIXTURE_NAME='"short"' -DFIXTURE_SHORT
PLUGIN_FIXTURES := $(patsubst PLUGIN_FIXTURE_FLAGS_%,$(PLUGIN_FIXTURE_DIR)/libape-backend-%.so,\
		     $(filter PLUGIN_FIXTURE_FLAGS_%,$(.VARIABLES)))

$(PLUGIN_FIXTURE_DIR)/libape-backend-%.so: tests/plugins/fixture.c include/ape/ape_backend.h \
					   include/ape/ape.h $(LIBSO) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $@"
	$(Q)$(CC) $(CSTD) $(OPT) -g $(WARN) -fPIC -Iinclude $(SAN_FLAGS) $(CFLAGS) \
		$(PLUGIN_FIXTURE_FLAGS_$*) -shared $(LDFLAGS) -o $@ $< \
		-L$(BUILD)/lib -lape -Wl,-rpath,$(abspath $(BUILD)/lib)
# A program linked with libape.a exporting nothing: the loader refuses the plugins it loads
PLUGIN_STATIC_HOST := $(PLUGIN_FIXTURE_DIR)/static_host
$(PLUGIN_STATIC_HOST): tests/plugins/static_host.c $(LIBA) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $@"
	$(Q)$(CC) $(CPPFLAGS) $(APP_CFLAGS) $(LDFLAGS) -o $@ $< $(LIBA) $(LIB_LIBS) $(LDLIBS)
# ... and the example plugin (examples/backend-plugin/module.mk), through its folder and ape-run
$(BUILD)/tests/test_plugins: $(PLUGIN_FIXTURES) $(PLUGIN_EXAMPLE) $(BUILD)/bin/ape-info \
			     $(BUILD)/bin/ape-run $(PLUGIN_STATIC_HOST)

# tests/test_ape_check.c certifies the example backend plugin with `ape-check --plugin`, and
# fails a fixture that computes nothing (the emulated CUDA device runs the same suite in
# tests/test_tools.c).
# ... and a plugin that states the backward and distance-bias tables, refuses the one and drops
# the other (tests/plugins/liar.c): it fails
PLUGIN_LIAR := $(PLUGIN_FIXTURE_DIR)/liar/libape-backend-liar.so
$(BUILD)/tests/test_ape_check: $(PLUGIN_EXAMPLE) $(PLUGIN_FIXTURES) $(PLUGIN_LIAR)
$(PLUGIN_LIAR): tests/plugins/liar.c include/ape/ape_backend.h $(PLUGIN_EXAMPLE) $(LIBSO) \
		$(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $@"
	$(Q)$(CC) $(CSTD) $(OPT) -g $(WARN) -fPIC -Iinclude $(SAN_FLAGS) $(CFLAGS) \
		-DLIAR_OF='"$(abspath $(PLUGIN_EXAMPLE))"' -shared $(LDFLAGS) -o $@ $< \
		-L$(BUILD)/lib -lape -ldl -Wl,-rpath,$(abspath $(BUILD)/lib)
