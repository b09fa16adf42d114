# libFuzzer targets (issue 7): the .npy reader, forward-call validation, the program-cache reader,
# the device-resident calls (ape_attention_enqueue, buffers, the DLPack call; issue 12), the KV
# pool's calls (ape_kv_pool_*; issue 26), paged attention over the caller's pages
# (ape_paged_kv_*), the plugin loader's calls (ape_context_options.backend_path and
# APE_BACKEND_PATH, ape_plugin_get_info, ape_backend_get_proc).
#
#   make fuzz [FUZZ_SECONDS=300]   each target for FUZZ_SECONDS, building on the corpus found so far
#   make fuzz-ci                   what `make check` runs: about a minute in all (FUZZ_CI_SECONDS each)
#
# The targets and the library sources they exercise are compiled by clang with
# -fsanitize=fuzzer,address,undefined into $(BUILD)/fuzz, apart from the gcc build. Any crash,
# hang (-timeout), leak or sanitizer report fails; tests/fuzz/run-fuzz.sh prints one summary line.
# Without clang and libFuzzer, fuzz-ci prints a SKIP line with the reason; FUZZ=yes (the default
# under CI=true, where `make deps` has installed clang) makes that an error instead.
FUZZ_CC          ?= $(shell command -v clang-14 2>/dev/null || command -v clang 2>/dev/null)
FUZZ             ?= $(if $(CI),yes,auto)
FUZZ_SECONDS     ?= 300
FUZZ_CI_SECONDS  ?= 20
FUZZ_TARGETS     := npy problem cache resident varlen trace kvpool kvpaged plugins
# FUZZ_OPENCL=yes: the fuzz library with the OpenCL backend too (where this build has it), in
# $(BUILD)/fuzz-opencl, so that the targets that can (fuzz_kvpaged) also run on an OpenCL device
# (a bit of each input picks it). Off by default: PoCL compiles each kernel variant a fuzzed
# shape asks for (seconds each) and keeps allocations past exit (run the targets with
# LSAN_OPTIONS=suppressions=tests/lsan.supp:fast_unwind_on_malloc=0, the full stacks the
# suppressions match).
FUZZ_OPENCL      ?= no
FUZZ_OCL         := $(and $(filter yes,$(FUZZ_OPENCL)),$(filter yes,$(HAVE_OPENCL)))
FUZZ_DIR         := $(BUILD)/fuzz$(if $(FUZZ_OCL),-opencl)
FUZZ_BINS        := $(FUZZ_TARGETS:%=$(FUZZ_DIR)/bin/fuzz_%)

# Link a trivial fuzz target once: the clang package alone lacks the libFuzzer runtime
# (Debian ships it in libclang-rt-14-dev).
# Only for the goals that need it: every other make would pay for a link it does not use.
ifneq ($(filter fuzz fuzz-ci fuzz-build $(FUZZ_DIR)/%,$(MAKECMDGOALS)),)
FUZZ_PROBE := $(if $(FUZZ_CC),$(shell printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return (int)(n && !d); }\n' | \
		$(FUZZ_CC) -x c -fsanitize=fuzzer,address,undefined - -o /dev/null >/dev/null 2>&1 && echo yes))
endif
FUZZ_WHY := $(if $(FUZZ_CC),$(FUZZ_CC) cannot link -fsanitize=fuzzer (libFuzzer runtime missing: run 'make deps'; Debian: libclang-rt-14-dev),clang not found (run 'make deps'; Debian: clang-14 libclang-rt-14-dev))

# The core and the reference backend only: the device backends add nothing these targets reach
# and would pull nvcc into every fuzz build. The registry then reports them as not built.
# FUZZ_OPENCL=yes adds the OpenCL backend (its sources and embedded kernels; never CUDA).
FUZZ_LIB_SRCS := $(filter runtime/%,$(LIB_SRCS)) $(if $(FUZZ_OCL),$(OPENCL_SRCS))
FUZZ_LIB_ASM  := $(if $(FUZZ_OCL),$(filter opencl/%,$(LIB_ASM)))
FUZZ_TOOL_SRCS := tools/common/npy_read.c tools/common/npy_write.c tools/common/npy_common.c
# ... and its own registry (runtime/api/backends.mk), found before the build's: the reference
# built, OpenCL with FUZZ_OPENCL=yes, every other backend "not built".
FUZZ_BUILT     := ref $(if $(FUZZ_OCL),opencl)
fuzz_backend_line = $(if $(filter $(1),$(FUZZ_BUILT)),APE_BACKEND_BUILT($(1), $(APE_BACKEND_$(1)_OPS)),APE_BACKEND_NOT_BUILT($(1), "not built into the library of the fuzz targets"))
ifneq ($(filter fuzz fuzz-ci fuzz-build $(FUZZ_DIR)/%,$(MAKECMDGOALS)),)
$(call ape_backends_gen,$(FUZZ_DIR)/gen/ape_backends.h,fuzz_backend_line)
endif
FUZZ_CPPFLAGS  = -I$(FUZZ_DIR)/gen $(filter-out -DAPE_HAVE_OPENCL -DAPE_HAVE_CUDA,$(CPPFLAGS)) $(HWLOC_CFLAGS) $(DRM_CFLAGS) \
		 $(if $(FUZZ_OCL),-DAPE_HAVE_OPENCL -DCL_TARGET_OPENCL_VERSION=120)
FUZZ_SAN      := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_CFLAGS    = $(CSTD) -O1 -g $(WARN) $(FUZZ_SAN) -fsanitize=fuzzer-no-link -DAPE_BUILDING_LIBRARY
FUZZ_LIBS      = $(if $(HAVE_HWLOC),$(HWLOC_LIBS)) $(if $(HAVE_DRM),$(DRM_LIBS)) $(LDLIBS)
FUZZ_LIBA     := $(FUZZ_DIR)/lib/libape-fuzz.a

$(FUZZ_DIR)/obj/%.o: %.c $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CLANG   $<"
	$(Q)$(FUZZ_CC) $(FUZZ_CPPFLAGS) -Itools -Itests $(FUZZ_CFLAGS) -MMD -MP -c $< -o $@

$(FUZZ_DIR)/obj/%.o: %.S $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  AS      $<"
	$(Q)$(FUZZ_CC) $(FUZZ_CPPFLAGS) -c $< -o $@

$(FUZZ_LIBA): $(FUZZ_LIB_SRCS:%.c=$(FUZZ_DIR)/obj/%.o) $(FUZZ_LIB_ASM:%.S=$(FUZZ_DIR)/obj/%.o) \
	      $(FUZZ_TOOL_SRCS:%.c=$(FUZZ_DIR)/obj/%.o)
	@mkdir -p $(dir $@)
	@echo "  AR      $@"
	$(Q)rm -f $@ && $(AR) rcs $@ $^

$(FUZZ_DIR)/bin/fuzz_%: $(FUZZ_DIR)/obj/tests/fuzz/fuzz_%.o $(FUZZ_LIBA)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(FUZZ_CC) -fsanitize=fuzzer $(FUZZ_SAN) -o $@ $< $(FUZZ_LIBA) $(FUZZ_LIBS)

fuzz-build: $(if $(FUZZ_PROBE),$(FUZZ_BINS))
	$(Q)$(if $(FUZZ_PROBE),true,$(if $(filter yes,$(FUZZ)),echo "fuzz: FAIL: $(FUZZ_WHY); FUZZ=yes requires it" >&2; exit 1,true))

# TEST_JOBS targets at once (the top Makefile's: the cores' count), each for its seconds
FUZZ_RUN = FUZZ_JOBS=$(TEST_JOBS) tests/fuzz/run-fuzz.sh $(FUZZ_DIR) tests/fuzz $(1) $(FUZZ_TARGETS)

fuzz-ci: fuzz-build
	$(Q)$(if $(FUZZ_PROBE),$(call FUZZ_RUN,$(FUZZ_CI_SECONDS)),echo "fuzz: SKIP: $(FUZZ_WHY)")

fuzz: fuzz-build
	$(Q)$(if $(FUZZ_PROBE),$(call FUZZ_RUN,$(FUZZ_SECONDS)),echo "fuzz: SKIP: $(FUZZ_WHY)")

CHECK_EXTRA += fuzz-ci
.PHONY: fuzz fuzz-ci fuzz-build
