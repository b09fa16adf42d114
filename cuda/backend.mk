# The CUDA backend: contributes only when the Makefile found nvcc and cuda.h (HAVE_CUDA=yes; it
# then defines APE_HAVE_CUDA everywhere, for the tests). Its registry entry (runtime/api/backends.mk)
# either way: probed first.
#
# The host code includes the toolkit's cuda.h for types only and loads libcuda.so.1 at run time
# (cuda_loader.c): the library links -ldl, never -lcuda, and runs where no driver is installed.
# The kernels (cuda/kernels/*.cu) are compiled by nvcc into one fatbin per file, for sm_80 and
# sm_90a machine code plus compute_90 PTX, and embedded with .incbin (fatbin_embed.S). Every
# build compiles them with warnings as errors, and cuda/check_ptxas.sh fails the build when a hot
# kernel spills registers or uses a local-memory stack frame (report: $(CUDA_GEN)/ptxas.txt).
APE_BACKENDS += 10:cuda
APE_BACKEND_cuda_OPS := $(if $(filter yes,$(HAVE_CUDA)),ape__cuda_ops)
APE_BACKEND_cuda_WHY := $(CUDA_WHY)
ifeq ($(HAVE_CUDA),yes)
CPPFLAGS += -DAPE_HAVE_CUDA
CUDA_INC   := $(abspath $(dir $(NVCC))../include)
CUDA_GEN   := $(BUILD)/gen/cuda
CUDA_SRCS  := $(wildcard cuda/cuda_*.c)
CUDA_KERNELS := prep window decode prefill backward separable
CUDA_FATBINS := $(CUDA_KERNELS:%=$(CUDA_GEN)/%.fatbin)
CUDA_KHDRS := cuda/kernels/common.cuh cuda/kernels/args.h cuda/kernels/bwd_args.h \
              cuda/kernels/sep_args.h \
              include/ape/ape_math.h

LIB_SRCS += $(CUDA_SRCS)
LIB_ASM  += cuda/fatbin_embed.S

# Machine code for Ampere (sm_80; runs on sm_86/87/89 too) and Hopper with its arch-specific
# features (sm_90a), PTX for anything newer. -t 0: the three targets compile in parallel.
NVCC_GENCODE := -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
                -gencode=arch=compute_90,code=compute_90
NVCC_FLAGS   ?= -O3
NVCC_ALL     := -std=c++17 $(NVCC_FLAGS) $(NVCC_GENCODE) -t 0 -Xptxas -v -Werror all-warnings \
                -Iinclude -Iruntime -Icuda/kernels

# Rebuild the fatbins when nvcc or its flags change (not for host-only changes: they are slow).
CUDA_STAMP := $(CUDA_GEN)/nvcc.stamp
CUDA_CONFIG := $(NVCC) $(NVCC_ALL)
$(shell mkdir -p $(CUDA_GEN) && { test -f $(CUDA_STAMP) && test "$$(cat $(CUDA_STAMP))" = '$(CUDA_CONFIG)' || echo '$(CUDA_CONFIG)' > $(CUDA_STAMP); })

$(CUDA_GEN)/%.fatbin: cuda/kernels/%.cu $(CUDA_KHDRS) $(CUDA_STAMP)
	@mkdir -p $(dir $@)
	@echo "  NVCC    $<"
	$(Q)$(NVCC) $(NVCC_ALL) -fatbin $< -o $@ 2> $@.log || { cat $@.log >&2; rm -f $@; exit 1; }
	$(Q)sh cuda/check_ptxas.sh $@.log || { rm -f $@; exit 1; }

# all four reports in one file, for people
$(CUDA_GEN)/ptxas.txt: $(CUDA_FATBINS)
	$(Q)cat $(CUDA_FATBINS:%=%.log) > $@

# .incbin is invisible to -MMD: the fatbins are explicit prerequisites, found through -Wa,-I.
$(BUILD)/obj/cuda/fatbin_embed.o: $(CUDA_FATBINS) $(CUDA_GEN)/ptxas.txt
$(BUILD)/obj/cuda/fatbin_embed.o: CPPFLAGS += -Wa,-I$(CUDA_GEN)
$(CUDA_SRCS:%.c=$(BUILD)/obj/%.o): CPPFLAGS += -I$(CUDA_INC)

# ---- tests without a GPU (tests/test_cuda_loader.c, tests/test_cuda_emu.c,
# tests/test_cuda_emu_separable.c, tests/test_cuda_emu_varlen.c, tests/test_cuda_emu_table.c,
# tests/test_cuda_resident.c, tests/test_cuda_resident_wrap.c)
# A fake libcuda.so.1, host C compiler only, whose behaviour FAKE_CUDA_MODE chooses; a variant
# without cuGetProcAddress; and the same fake running the real kernels on the CPU (cuda/emu).
FAKE_CUDA_DIR  := $(BUILD)/tests/fake_cuda
FAKE_CUDA      := $(FAKE_CUDA_DIR)/libcuda.so.1
FAKE_CUDA_NOPA := $(FAKE_CUDA_DIR)/noproc/libcuda.so.1
CUDA_EMU       := $(BUILD)/tests/cuda_emu/libcuda.so.1
FAKE_CUDA_SRCS := tests/fake_cuda/fake_libcuda.c tests/fake_cuda/fake_memory.c \
                  tests/fake_cuda/fake_launch.c
FAKE_CUDA_HDRS := tests/fake_cuda/fake_cuda.h tests/fake_cuda/fake_state.h cuda/kernels/args.h
FAKE_CFLAGS     = $(CSTD) $(OPT) -g $(WARN) -fPIC -I$(CUDA_INC) -Icuda $(SAN_FLAGS) $(CFLAGS)
EMU_CXXFLAGS    = -std=c++17 $(OPT) -g -Wall -Wextra -Werror -Wno-unknown-pragmas -fPIC \
                  -DAPE_CUDA_EMU -Iinclude -Iruntime -Icuda/kernels -I$(CUDA_INC) $(SAN_FLAGS)

$(FAKE_CUDA): $(FAKE_CUDA_SRCS) $(FAKE_CUDA_HDRS) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $@"
	$(Q)$(CC) $(FAKE_CFLAGS) -shared -o $@ $(FAKE_CUDA_SRCS) -lpthread

$(FAKE_CUDA_NOPA): $(FAKE_CUDA_SRCS) $(FAKE_CUDA_HDRS) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $@"
	$(Q)$(CC) $(FAKE_CFLAGS) -DFAKE_CUDA_NO_PROCADDRESS -shared -o $@ $(FAKE_CUDA_SRCS) -lpthread

$(BUILD)/tests-obj/cuda_emu/%.o: cuda/kernels/%.cu $(CUDA_KHDRS) cuda/emu/emu.h runtime/core/half.h \
				  $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CXX     $< (CPU emulation)"
	$(Q)$(CXX) $(EMU_CXXFLAGS) -x c++ -c $< -o $@

$(BUILD)/tests-obj/cuda_emu/emu.o: cuda/emu/emu.cc cuda/emu/emu.h cuda/emu/emu_api.h $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CXX     $<"
	$(Q)$(CXX) $(EMU_CXXFLAGS) -c $< -o $@

# libape's 16-bit conversions, hidden inside the emulated driver
$(BUILD)/tests-obj/cuda_emu/half.o: runtime/core/half.c runtime/core/half.h $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $< (for the emulator)"
	$(Q)$(CC) $(FAKE_CFLAGS) -fvisibility=hidden -Iinclude -Iruntime -c $< -o $@

FAKE_CUDA_EMU_OBJS := $(FAKE_CUDA_SRCS:tests/fake_cuda/%.c=$(BUILD)/tests-obj/cuda_emu/%.o)
$(FAKE_CUDA_EMU_OBJS): $(BUILD)/tests-obj/cuda_emu/%.o: tests/fake_cuda/%.c $(FAKE_CUDA_HDRS) \
					     $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $< (with the emulator)"
	$(Q)$(CC) $(FAKE_CFLAGS) -DFAKE_CUDA_EMU -Icuda/emu -c $< -o $@

$(CUDA_EMU): $(FAKE_CUDA_EMU_OBJS) $(BUILD)/tests-obj/cuda_emu/emu.o \
	     $(BUILD)/tests-obj/cuda_emu/half.o \
	     $(CUDA_KERNELS:%=$(BUILD)/tests-obj/cuda_emu/%.o)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CXX) -shared $(SAN_FLAGS) -o $@ $^ -lpthread

# the CUDA tests look inside the backend (cuda/cu.h), which needs the toolkit's cuda.h
$(BUILD)/tests-obj/tests/test_cuda_%.o: CPPFLAGS += -I$(CUDA_INC)
$(BUILD)/tests/test_cuda_loader: $(FAKE_CUDA) $(FAKE_CUDA_NOPA)
$(BUILD)/tests/test_cuda_emu $(BUILD)/tests/test_cuda_emu_separable: $(CUDA_EMU)
$(BUILD)/tests/test_cuda_emu_varlen $(BUILD)/tests/test_cuda_emu_table: $(CUDA_EMU)
$(BUILD)/tests/test_cuda_resident $(BUILD)/tests/test_cuda_resident_wrap: $(CUDA_EMU)
TESTS_BUILD_ONLY += $(FAKE_CUDA) $(FAKE_CUDA_NOPA) $(CUDA_EMU)
endif
