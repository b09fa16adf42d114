#!/bin/sh
# SPDX-License-Identifier: MIT
# Reads ptxas -v output (nvcc -Xptxas -v, on stderr) and fails when a hot kernel spills registers
# or keeps an array in local memory (a stack frame): both turn the inner loops' register traffic
# into memory traffic. Other kernels are reported, not failed. Prints one line per kernel and
# target: name, target, registers, stack frame, spill stores, spill loads.
# usage: cuda/check_ptxas.sh PTXAS_LOG
set -u
log=$1

# The kernels whose inner loops carry the time: the fused attention kernels with the head sizes
# that are specialised (D = 64, 128) for every storage type, prefill and decode (and their _diag
# twins, which also keep the diagnostics), and the backward's
# fused sweep (cuda/kernels/backward.cu) of every head-size variant.
HOT='^(ape_(prefill|decode)_d(64|128)_(f32|f16|bf16)(_diag)?|ape_sep_d(64|128)_(f16|bf16)|ape_bwd_fused_(d64|d128|g128|g256))$'

awk -v hot="$HOT" -v log_name="$log" '
/Compiling entry function/ {
	name = $0; sub(/.*function .\047?/, "", name); sub(/\047.*/, "", name)
	arch = $0; sub(/.*for .\047?/, "", arch); sub(/\047.*/, "", arch)
}
/bytes stack frame/ { stack = $1; sst = $5; sld = $9 }
/Used [0-9]+ registers/ {
	for (i = 1; i <= NF; i++) if ($i == "Used") regs = $(i + 1)
	bad = (stack + 0 > 0 || sst + 0 > 0 || sld + 0 > 0)
	ishot = name ~ hot
	printf "ptxas: %-24s %-7s %3s registers, %4s bytes stack, %4s/%-4s bytes spilled%s\n", \
		name, arch, regs, stack, sst, sld, bad ? (ishot ? "  <- HOT KERNEL SPILLS" : "  (not a hot kernel)") : ""
	if (bad && ishot) fails++
	seen++
}
END {
	if (!seen) { printf "check_ptxas: no ptxas -v report in %s\n", log_name; exit 1 }
	if (fails) { printf "check_ptxas: %d hot kernel build(s) spill or use a stack frame (see above)\n", fails; exit 1 }
}' "$log"
