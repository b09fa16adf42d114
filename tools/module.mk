# Command-line tools (tools/ape-*.c, one program each) and the helpers they share
# (tools/common/: .npy files, argument parsing, reference checks on sampled rows).
TOOLS_LIB_SRCS := $(wildcard tools/common/*.c)
TOOLS_LIB      := $(BUILD)/lib/libapetools.a
TOOLS          := $(patsubst tools/%.c,$(BUILD)/bin/%,$(wildcard tools/ape-*.c))

$(BUILD)/tools-obj/%.o: %.c $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) -Itools $(APP_CFLAGS) -c $< -o $@

$(TOOLS_LIB): $(TOOLS_LIB_SRCS:%.c=$(BUILD)/tools-obj/%.o)
	@mkdir -p $(dir $@)
	@echo "  AR      $@"
	$(Q)rm -f $@ && $(AR) rcs $@ $^

# Each links libape.a and exports its API to the backend plugins it loads (PLUGIN_HOST_LDFLAGS).
$(BUILD)/bin/%: $(BUILD)/tools-obj/tools/%.o $(TOOLS_LIB) $(LIBA) tools/plugin-host.dynlist
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(LDFLAGS) $(PLUGIN_HOST_LDFLAGS) -o $@ $(filter %.o,$^) $(TOOLS_LIB) $(LIBA) \
		$(LIB_LIBS) $(LDLIBS)

# A tool split by concern keeps its other files in a folder of its own, linked into it alone:
# tools/run/ (the options, the devices, the input and output files, the KV-cache and backward
# modes, the statistics) for ape-run, tools/bench/ (the options, the inputs, the --resident,
# --stream, --varlen and --pool modes) for ape-bench, tools/check/ (the conformance suite's
# groups beyond the dense cases, the comparisons, the record every cell goes to, the summary and
# the JSON) for ape-check. A folder's header (run/run.h, bench/bench.h, check/check.h) declares
# what crosses its files.
$(BUILD)/bin/ape-run: $(patsubst %.c,$(BUILD)/tools-obj/%.o,$(wildcard tools/run/*.c))
$(BUILD)/bin/ape-bench: $(patsubst %.c,$(BUILD)/tools-obj/%.o,$(wildcard tools/bench/*.c))
$(BUILD)/bin/ape-check: $(patsubst %.c,$(BUILD)/tools-obj/%.o,$(wildcard tools/check/*.c))
