# Benchmark drivers in C (bench/*.c, one program each), built on request only: `make bench-bwd`
# builds $(BUILD)/bench/bwd_time, the backward pass timed side by side with the forward.
BENCH_PROGS := $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/*.c))

$(BUILD)/bench/%: bench/%.c bench/bench_util.h bench/ab_build.h $(LIBA) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(APP_CFLAGS) $(LDFLAGS) -o $@ $< $(LIBA) $(LIB_LIBS) $(LDLIBS)

bench-bwd: $(BUILD)/bench/bwd_time
# the backward on host tensors against ape_attention_backward_enqueue() (bench/RESULTS.md)
bench-bwd-resident: $(BUILD)/bench/bwd_resident
# the diagnostics' cost: forward with and without entropy and mean distance (bench/RESULTS.md)
bench-diag: $(BUILD)/bench/diag_time
# how fast the cores read memory: the ceiling of a decode step (bench/RESULTS.md)
bench-membw: $(BUILD)/bench/membw
# the call log, path notes, session trace and NVTX hooks when off: two builds side by side
bench-log-off: $(BUILD)/bench/log_off
$(BUILD)/bench/log_off: LDLIBS += -ldl
# a change's cost to the forward and the backward: two builds side by side (bench/RESULTS.md)
bench-ab-calls: $(BUILD)/bench/ab_calls
$(BUILD)/bench/ab_calls: LDLIBS += -ldl
$(BUILD)/bench/membw: APP_CFLAGS += -O3 -march=native

# what plugins cost a context's creation: none looked for, the folder searched, one loaded
# what a distance-bias table costs, with and without, side by side (issue 30's 1.05x target)
bench-table-cost: $(BUILD)/bench/table_cost
bench-plugin-context: $(BUILD)/bench/plugin_context
$(BUILD)/bench/plugin_context: bench/plugin_context.c bench/bench_util.h $(LIBSO) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(APP_CFLAGS) $(LDFLAGS) -o $@ $< -L$(BUILD)/lib -lape \
		-Wl,-rpath,$(abspath $(BUILD)/lib) $(LDLIBS)

.PHONY: bench-bwd bench-diag bench-bwd-resident bench-membw bench-log-off bench-plugin-context bench-ab-calls \
	bench-table-cost
