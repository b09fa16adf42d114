# libape build. `make help` lists the targets.
#
# Optional backends are detected and announced; override with WITH_OPENCL=yes|no|auto and
# WITH_CUDA=yes|no|auto ("yes" makes a missing toolchain an error instead of a notice).
# Every directory contributes through its own module.mk, so adding a backend edits no other rules.

# `make deps check` on a fresh machine: what deps installs changes what the build detects (the
# OpenCL loader, hwloc, libdrm), so the other goals run in a new make once deps has finished.
ifneq ($(and $(filter deps,$(MAKECMDGOALS)),$(filter-out deps,$(MAKECMDGOALS))),)
REST_GOALS := $(filter-out deps,$(MAKECMDGOALS))
.PHONY: deps $(REST_GOALS)
deps:
	@$(MAKE) --no-print-directory deps DEPS_GOALS="$(REST_GOALS)"
	@$(MAKE) --no-print-directory $(REST_GOALS)
$(REST_GOALS): deps
	@:
else

.DEFAULT_GOAL := all
.SUFFIXES:
.DELETE_ON_ERROR:
.SECONDARY:

BUILD      ?= build
PREFIX     ?= /usr/local
KSFT_DIR   ?= build/kselftest
PYTHON     ?= /usr/bin/python3
CC         ?= cc
AR         ?= ar
WITH_OPENCL ?= auto
WITH_CUDA   ?= auto
WITH_MPI    ?= auto
SANITIZE   ?=
V          ?= 0

ifeq ($(origin CC),default)
CC := cc
endif

Q := $(if $(filter 1,$(V)),,@)

# ------------------------------------------------------------------ flags
WARN      := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla
OPT       ?= -O2
CSTD      := -std=gnu11
CPPFLAGS  += -Iinclude -Iruntime -I$(BUILD)/gen -D_GNU_SOURCE
LIB_CFLAGS = $(CSTD) $(OPT) -g $(WARN) -fPIC -fvisibility=hidden -DAPE_BUILDING_LIBRARY \
             -MMD -MP $(SAN_FLAGS) $(CFLAGS)
APP_CFLAGS = $(CSTD) $(OPT) -g $(WARN) -MMD -MP $(SAN_FLAGS) $(CFLAGS)
LDLIBS    += -lm -lpthread -ldl

ifeq ($(SANITIZE),1)
SAN_FLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS   += -fsanitize=address,undefined
endif

# ------------------------------------------------------------------ optional backends
# OpenCL: the ICD loader and its headers.
OPENCL_PROBE := $(shell $(CC) opencl/probe.c -o /dev/null -lOpenCL >/dev/null 2>&1 && echo yes)
ifeq ($(WITH_OPENCL),no)
HAVE_OPENCL :=
OPENCL_WHY  := disabled at build time (WITH_OPENCL=no)
else ifeq ($(OPENCL_PROBE),yes)
HAVE_OPENCL := $(if $(wildcard opencl/backend.mk),yes,)
OPENCL_WHY  := $(if $(HAVE_OPENCL),,the OpenCL backend is not part of this source tree yet)
else ifeq ($(WITH_OPENCL),yes)
$(error WITH_OPENCL=yes but the OpenCL headers or ICD loader are missing: run `make deps`)
else
HAVE_OPENCL :=
OPENCL_WHY  := OpenCL headers or ICD loader (libOpenCL) not found at build time
endif

# CUDA: nvcc builds the kernels; the driver (libcuda.so.1) is loaded at run time, never linked.
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
ifeq ($(WITH_CUDA),no)
HAVE_CUDA :=
CUDA_WHY  := disabled at build time (WITH_CUDA=no)
else ifneq ($(and $(NVCC),$(wildcard $(dir $(NVCC))../include/cuda.h)),)
HAVE_CUDA := $(if $(wildcard cuda/backend.mk),yes,)
CUDA_WHY  := $(if $(HAVE_CUDA),,the CUDA backend is not part of this source tree yet)
else ifeq ($(WITH_CUDA),yes)
$(error WITH_CUDA=yes but nvcc (or cuda.h next to it) was not found; set NVCC=/path/to/nvcc)
else
HAVE_CUDA :=
CUDA_WHY  := nvcc not found at build time
endif

# NVTX v3 (docs/profiling.md, "NVTX ranges"): header-only, shipped with the CUDA toolkit. With it,
# every public call and kernel launch is an NVTX range, free until a tool attaches (NVTX's init
# then dlopens the tool: -ldl is in LDLIBS already). Only runtime/core/nvtx.c and the fake tool
# of tests/test_nvtx.c read the headers; APE_WITH_NVTX tells the rest.
WITH_NVTX ?= auto
nvtx_uniq  = $(if $1,$(firstword $1) $(call nvtx_uniq,$(filter-out $(firstword $1),$1)))
NVTX_DIRS := $(call nvtx_uniq,$(if $(NVCC),$(abspath $(dir $(NVCC))../include)) \
               $(abspath $(CUDA_HOME)/include) /usr/local/cuda/include /usr/include)
NVTX_INC  := $(firstword $(foreach d,$(NVTX_DIRS),$(if $(wildcard $(d)/nvtx3/nvToolsExt.h),$(d))))
ifeq ($(WITH_NVTX),no)
HAVE_NVTX :=
NVTX_WHY  := disabled at build time (WITH_NVTX=no)
else ifneq ($(NVTX_INC),)
HAVE_NVTX := yes
CPPFLAGS  += -DAPE_WITH_NVTX
NVTX_CPPFLAGS := $(if $(filter /usr/include,$(NVTX_INC)),,-isystem $(NVTX_INC))
$(BUILD)/obj/runtime/core/nvtx.o: CPPFLAGS += $(NVTX_CPPFLAGS)
else ifeq ($(WITH_NVTX),yes)
$(error WITH_NVTX=yes but nvtx3/nvToolsExt.h is in none of $(NVTX_DIRS); set CUDA_HOME)
else
HAVE_NVTX :=
NVTX_WHY  := no nvtx3/nvToolsExt.h in $(NVTX_DIRS) at build time
endif

# hwloc (topology, NUMA placement) and libdrm (DRM device listing), through pkg-config.
PKG_CONFIG  ?= pkg-config
WITH_HWLOC  ?= auto
WITH_DRM    ?= auto
HWLOC_CFLAGS := $(shell $(PKG_CONFIG) --cflags hwloc 2>/dev/null)
HWLOC_LIBS   := $(shell $(PKG_CONFIG) --libs hwloc 2>/dev/null)
DRM_CFLAGS   := $(shell $(PKG_CONFIG) --cflags libdrm 2>/dev/null)
DRM_LIBS     := $(shell $(PKG_CONFIG) --libs libdrm 2>/dev/null)
ifeq ($(WITH_HWLOC),no)
HWLOC_WHY := disabled at build time (WITH_HWLOC=no)
else ifneq ($(HWLOC_LIBS),)
HAVE_HWLOC := yes
else ifeq ($(WITH_HWLOC),yes)
$(error WITH_HWLOC=yes but pkg-config finds no hwloc (Debian: libhwloc-dev): run `make deps`)
else
HWLOC_WHY := hwloc not found by pkg-config at build time
endif
ifeq ($(WITH_DRM),no)
DRM_WHY := disabled at build time (WITH_DRM=no)
else ifneq ($(DRM_LIBS),)
HAVE_DRM := yes
else ifeq ($(WITH_DRM),yes)
$(error WITH_DRM=yes but pkg-config finds no libdrm (Debian: libdrm-dev): run `make deps`)
else
DRM_WHY := libdrm not found by pkg-config at build time
endif

# Rebuild everything when the configuration changes.
CONFIG := cc=$(CC) opt=$(OPT) san=$(SANITIZE) opencl=$(HAVE_OPENCL) cuda=$(HAVE_CUDA) nvcc=$(NVCC) hwloc=$(HAVE_HWLOC) drm=$(HAVE_DRM) nvtx=$(HAVE_NVTX) cflags=$(CFLAGS)
CONFIG_STAMP := $(BUILD)/config.stamp
$(shell mkdir -p $(BUILD) && { test -f $(CONFIG_STAMP) && test "$$(cat $(CONFIG_STAMP))" = '$(CONFIG)' || echo '$(CONFIG)' > $(CONFIG_STAMP); })

# Announce the configuration for every goal that builds ("make", "make deps check", ...).
ifneq ($(if $(MAKECMDGOALS),$(filter-out deps help clean distclean,$(MAKECMDGOALS)),all),)
ifeq ($(MAKELEVEL),0)
$(info libape: OpenCL backend: $(if $(HAVE_OPENCL),yes,no ($(OPENCL_WHY))))
$(info libape: CUDA backend:   $(if $(HAVE_CUDA),yes ($(NVCC)),no ($(CUDA_WHY))))
$(info libape: hwloc (NUMA):   $(if $(HAVE_HWLOC),yes,no ($(HWLOC_WHY))))
$(info libape: libdrm:         $(if $(HAVE_DRM),yes,no ($(DRM_WHY))))
$(info libape: NVTX ranges:    $(if $(HAVE_NVTX),yes ($(NVTX_INC)),no ($(NVTX_WHY))))
endif
endif

# ------------------------------------------------------------------ modules
LIB_SRCS :=
LIB_ASM  :=
LIB_LIBS :=
TOOLS    :=
TESTS    :=

# Paths used in the modules' prerequisite lists: defined before the modules are read.
LIBA     = $(BUILD)/lib/libape.a
LIBSO    = $(BUILD)/lib/libape.so.$(APE_SOVERSION)
# A program linked with libape.a that may load backend plugins exports libape's API to them
# (tools/plugin-host.dynlist): the tools and the tests link with it.
PLUGIN_HOST_LDFLAGS := -Wl,--dynamic-list=tools/plugin-host.dynlist

include runtime/module.mk
# The backends: every folder with a backend.mk (the reference's: runtime/ref/backend.mk). Each
# adds its sources to LIB_SRCS and itself to APE_BACKENDS, from which the build generates the
# registry ($(BUILD)/gen/ape_backends.h, read by runtime/api/registry.c): a backend added to the
# tree edits its own folder only.
APE_BACKENDS :=
include runtime/ref/backend.mk
include $(sort $(wildcard */backend.mk))
include runtime/api/backends.mk
include tools/module.mk
include examples/backend-plugin/module.mk
include bench/module.mk
include tests/module.mk
# Hardening (issue 7): fuzz targets, fault injection, ThreadSanitizer. Each module appends the
# goals 'make check' runs after the unit tests to CHECK_EXTRA (each prints its own summary line).
CHECK_EXTRA :=
-include tests/fuzz/module.mk
-include tests/faults/module.mk
include python/module.mk
-include mpi/module.mk

LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/obj/%.o) $(LIB_ASM:%.S=$(BUILD)/obj/%.o)

$(BUILD)/obj/%.o: %.c $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(LIB_CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.S $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  AS      $<"
	$(Q)$(CC) $(CPPFLAGS) -c $< -o $@

$(LIBA): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	@echo "  AR      $@"
	$(Q)rm -f $@ && $(AR) rcs $@ $^

$(LIBSO): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -Wl,-soname,libape.so.$(APE_SOVERSION) -Wl,--no-undefined $(LDFLAGS) \
		-o $@ $^ $(LIB_LIBS) $(LDLIBS)
	$(Q)ln -sf libape.so.$(APE_SOVERSION) $(BUILD)/lib/libape.so

all: $(LIBA) $(LIBSO) $(TOOLS)

# ------------------------------------------------------------------ set-up, tests, the main job
DEB_PACKAGES := build-essential pkg-config xz-utils ocl-icd-opencl-dev opencl-c-headers \
                pocl-opencl-icd clinfo libhwloc-dev libhwloc-plugins libdrm-dev python3-numpy \
                python3-venv valgrind clang-14 libclang-rt-14-dev libopenmpi-dev openmpi-bin libdlpack-dev

# The Python test environment (pytest and PyTorch from PyPI: a few GB) only for the goals that
# run the Python suite: `make deps run` installs what the library, its tools and the main job
# need; `make deps check`, `make deps-python` and `make deps` alone add it.
DEPS_GOALS ?=
DEPS_PYTHON_GOALS := check python-check deps-python
deps:
	$(Q)tools/deps.sh "$(KSFT_DIR)" $(DEB_PACKAGES)
ifneq ($(and $(DEPS_GOALS),$(if $(filter $(DEPS_PYTHON_GOALS),$(DEPS_GOALS)),,no)),)
	@echo "deps: no Python test environment for '$(DEPS_GOALS)' (make deps-python, or make deps check, adds it)"
else
	$(Q)tools/deps-python.sh $(VENV) $(PY_PACKAGES)
endif

deps-python:
	$(Q)tools/deps-python.sh $(VENV) $(PY_PACKAGES)

# Each suite prints its own line; the last line adds them all up (fuzz targets count as tests).
# Each suite's wall time goes to $(CHECK_TIMES) (tests/timed.sh) and is printed before the last line.
CHECK_SUMMARY = $(abspath $(BUILD))/check-summary
CHECK_TIMES = $(abspath $(BUILD))/check-times
# Test programs TEST_JOBS at once (tests/run-tests.sh's APE_TEST_JOBS: the unit and the fault
# suites; tests/fuzz/run-fuzz.sh's FUZZ_JOBS: the fuzz targets): the cores' count by default
# (bench/RESULTS.md, 2026-12-06: the suites' wall time).
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 1)
check: all $(TESTS) $(TESTS_BUILD_ONLY)
	$(Q)tools/check-layers.sh --self-test
	$(Q)tools/check-layers.sh
	$(Q)rm -f $(CHECK_SUMMARY) $(CHECK_TIMES)
	$(Q)APE_TEST_SUMMARY=$(CHECK_SUMMARY) APE_TEST_TIMES=$(CHECK_TIMES) APE_TEST_JOBS=$(TEST_JOBS) \
		tests/timed.sh unit tests/run-tests.sh $(BUILD) $(TESTS)
	$(Q)$(foreach g,$(CHECK_EXTRA),APE_TEST_SUMMARY=$(CHECK_SUMMARY) APE_TEST_TIMES=$(CHECK_TIMES) \
		tests/timed.sh $(g) $(MAKE) --no-print-directory $(g) &&) true
	$(Q)$(if $(CHECK_EXTRA),tests/check-total.sh $(CHECK_SUMMARY) $(CHECK_TIMES),true)

sanitize:
	$(Q)$(MAKE) --no-print-directory BUILD=$(BUILD)/asan SANITIZE=1 OPT=-O1 check

valgrind: all $(TESTS)
	$(Q)APE_TEST_VALGRIND=1 tests/run-tests.sh --valgrind $(BUILD) $(TESTS)

run: all
	$(Q)$(BUILD)/bin/ape-bench -L 1024 --warmup 1 --repeats 3 --check-rows 32

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include/ape $(DESTDIR)$(PREFIX)/bin \
		$(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 $(LIBA) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(LIBSO) $(DESTDIR)$(PREFIX)/lib/
	ln -sf libape.so.$(APE_SOVERSION) $(DESTDIR)$(PREFIX)/lib/libape.so
	install -m 644 include/ape/ape.h include/ape/ape_dlpack.h include/ape/ape_backend.h \
		include/ape/ape_math.h $(DESTDIR)$(PREFIX)/include/ape/
	install -m 755 $(TOOLS) $(DESTDIR)$(PREFIX)/bin/
	install -d $(DESTDIR)$(PREFIX)/lib/libape/backends
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(APE_VERSION_STR)|' \
		-e 's|@LIBS_PRIVATE@|$(LIB_LIBS) $(LDLIBS)|' libape.pc.in \
		> $(DESTDIR)$(PREFIX)/lib/pkgconfig/libape.pc

clean:
	rm -rf $(BUILD)/obj $(BUILD)/lib $(BUILD)/bin $(BUILD)/tests $(BUILD)/gen $(BUILD)/asan \
		$(BUILD)/fuzz $(BUILD)/faults $(BUILD)/tsan $(BUILD)/plugins $(BUILD)/config.stamp

distclean:
	rm -rf $(BUILD)

help:
	@echo "make deps       install the Debian packages and the Kselftest headers (root), and the"
	@echo "                Python test environment unless the other goals need none (make deps run)"
	@echo "make deps-python  the Python test environment alone (build/venv: pytest, PyTorch)"
	@echo "make            library (static and shared) and tools"
	@echo "make run        the main job: APE on a seed-sized input, checked against the reference"
	@echo "make bench-bwd  bench/bwd_time: backward against forward, side by side (bench/RESULTS.md)"
	@echo "make bench-log-off  bench/log_off: the call log, traces and NVTX when off (two builds)"
	@echo "make check      build and run every test; ends with 'N passed, N failed, N skipped'"
	@echo "                (the unit and fault suites and the fuzz targets TEST_JOBS at once: the cores)"
	@echo "make sanitize   the tests under AddressSanitizer and UBSan"
	@echo "make valgrind   the tests under valgrind memcheck (leaks are errors)"
	@echo "make fuzz       each libFuzzer target for FUZZ_SECONDS (300); 'make check' runs a short pass"
	@echo "make faults-ci  allocation- and device-failure injection under ASan (part of 'make check')"
	@echo "make tsan-ci    the concurrency tests under ThreadSanitizer (part of 'make check')"
	@echo "make install PREFIX=/usr/local"
	@echo "make plugin-example  the example backend plugin (docs/backends.md), built against"
	@echo "                the public headers only: build/plugins/libape-backend-example.so"
	@echo "make mpi-ci     the MPI tests (libape_mpi over mpirun; part of 'make check')"
	@echo "options: WITH_OPENCL, WITH_CUDA, WITH_HWLOC, WITH_DRM, WITH_MPI, WITH_NVTX = yes|no|auto; V=1 OPT=-O2 BUILD=build"

.PHONY: all deps deps-python check sanitize valgrind run install clean distclean help

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

endif # deps with other goals
