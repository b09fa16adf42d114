#!/bin/sh
# SPDX-License-Identifier: MIT
#
# tools/gpu-check.sh OUT_DIR: libape's whole check on a machine with an NVIDIA GPU, in one call
# with a hard time limit (GPU_CHECK_SECONDS, default 345: under 6 minutes with the start-up).
#
#   1. what the machine has (nvidia-smi, nvcc, driver, python, torch) -> OUT_DIR/env.txt
#   2. build (WITH_CUDA=yes; hwloc and libdrm only when pkg-config finds them)
#   3. the CUDA tests on the real GPU (tests/test_resident, test_resident_diag, test_cuda_emu,
#      test_cuda_emu_separable, test_cuda_emu_varlen (ragged launches) and
#      tests/test_diag, test_diag_kernels, the diagnostics kernels, with APE_TEST_CUDA_DEVICE=1)
#   4. ape-check across every backend it finds (CUDA, OpenCL when an ICD is there, reference;
#      its ragged cells too); ape-bench --resident: device-resident calls beside host calls
#      (prefill, decode step); ape-bench --varlen: a ragged batch in one launch
#   5. the benchmark of issue 6 (bench/torch_ape.py: libape vs eager PyTorch APE vs SDPA; decode
#      bandwidth), when python3 is there
#   6. the whole test suite (make check's unit tests; on this machine the library's `auto`
#      device is the GPU), with the time left
# and prints a short table last. The GPU-specific steps come first so that a run cut short by
# the time limit still has them. Steps 3 and 6 need the Kselftest headers (`make deps` puts them
# in build/kselftest; KSFT_DIR=DIR names another place); without them they are skipped and the
# script says so. Each step's log is OUT_DIR/<step>.log; OUT_DIR/summary.txt is
# the table. Nothing is installed; the build goes to build/gpu-check (BUILD=... to change).
#
# For testing this script where there is no GPU: GPU_CHECK_ASSUME_GPU=1 skips the GPU probe
# (with APE_CUDA_LIBRARY=BUILD/tests/cuda_emu/libcuda.so.1 the CUDA backend is the emulator) and
# GPU_CHECK_QUICK=1 makes the benchmark a smoke test of small sizes.
#
# Exit status: 0 every step that ran passed; 1 a step failed or ran out of time; 2 usage;
# 4 no NVIDIA GPU here (nothing was run: the environment report only).
set -u

usage() {
	echo "usage: $0 OUT_DIR   (env: GPU_CHECK_SECONDS=345 BUILD=build/gpu-check KSFT_DIR=...)" >&2
	exit 2
}
[ $# -eq 1 ] || usage
case "$1" in -*) usage ;; esac
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 2

TOTAL=${GPU_CHECK_SECONDS:-345}
BUILD=${BUILD:-build/gpu-check}
T0=$(date +%s)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
failed=0

left() { echo $((TOTAL - ($(date +%s) - T0))); }

# note STEP RESULT DETAIL: one line of the final table
note() {
	printf '%-10s %-8s %s\n' "$1" "$2" "$3" >>"$SUMMARY"
	case "$2" in FAIL | TIMEOUT) failed=1 ;; esac
}

# run STEP MAX_SECONDS CMD...: CMD with its output in OUT/STEP.log, killed after MAX_SECONDS or
# when the whole budget (less 15 s kept for the table) is gone. Sets $rc (124: timed out).
run() {
	step=$1 max=$2
	shift 2
	lim=$(($(left) - 15))
	[ "$lim" -lt "$max" ] && max=$lim
	if [ "$max" -lt 5 ]; then
		echo "== $step: no time left" | tee -a "$OUT/$step.log"
		rc=124
		return
	fi
	echo "== $step (at most ${max}s): $*"
	timeout -k 5 "$max" "$@" >"$OUT/$step.log" 2>&1
	rc=$?
	tail -n 3 "$OUT/$step.log" | sed 's/^/   /'
}

# gputest STEP MAX_SECONDS PROGRAM WHAT: tests/PROGRAM on the GPU (APE_TEST_CUDA_DEVICE=1), noted
# with its totals (WHAT: what it compares)
gputest() {
	run "$1" "$2" env APE_TEST_CUDA_DEVICE=1 "$BUILD/tests/$3"
	last=$(grep '^# Totals' "$OUT/$1.log" | tail -n 1)
	case $rc in
	0) note "$1" ok "$3 ($4) on the real GPU: ${last#\# }" ;;
	124) note "$1" TIMEOUT "$3 on the real GPU" ;;
	*) note "$1" FAIL "$3 on the real GPU: ${last#\# }: see $1.log" ;;
	esac
}

# ---- 1. the machine
{
	echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
	echo "host: $(uname -srm), $(nproc) CPUs"
	echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
	command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1
	NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
	"$NVCC" --version 2>&1 | tail -n 2
	python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1
	for p in hwloc libdrm OpenCL; do
		pkg-config --exists "$p" 2>/dev/null && echo "pkg-config: $p yes" || echo "pkg-config: $p no"
	done
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
	gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if [ "$gpus" -eq 0 ] && ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
	gpus=1 # a device node without nvidia-smi: let the CUDA backend decide
fi
[ "${GPU_CHECK_ASSUME_GPU:-0}" = 1 ] && gpus=1
if [ "$gpus" -eq 0 ]; then
	note machine SKIP "no NVIDIA GPU here (no nvidia-smi GPU, no /dev/nvidia*): nothing run"
	echo
	cat "$SUMMARY"
	exit 4
fi
note machine ok "$gpus GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"

# ---- 2. build
JOBS=$(nproc)
hw=no drm=no
pkg-config --exists hwloc 2>/dev/null && hw=auto
pkg-config --exists libdrm 2>/dev/null && drm=auto
# one word each, split on purpose below
MAKEVARS="BUILD=$BUILD WITH_CUDA=yes WITH_HWLOC=$hw WITH_DRM=$drm"
# shellcheck disable=SC2086
run build 200 make -j"$JOBS" $MAKEVARS all
if [ "$rc" -ne 0 ]; then
	note build "$([ "$rc" -eq 124 ] && echo TIMEOUT || echo FAIL)" "make all ($MAKEVARS): see build.log"
	echo
	cat "$SUMMARY"
	exit 1
fi
# cuda/check_ptxas.sh has already failed the build on any spill in a hot kernel
note build ok "$MAKEVARS; register report $BUILD/gen/cuda/ptxas.txt"

# ---- 3. the CUDA tests on the GPU
KSFT=${KSFT_DIR:-build/kselftest}
if [ ! -f "$KSFT/kselftest_harness.h" ]; then
	for d in /usr/src/linux-*/tools/testing/selftests; do
		[ -f "$d/kselftest_harness.h" ] && KSFT=$d && break
	done
fi
have_ksft=no
[ -f "$KSFT/kselftest_harness.h" ] && [ -f "$KSFT/kselftest.h" ] && have_ksft=yes
NO_KSFT="no Kselftest headers (build/kselftest, KSFT_DIR or /usr/src/linux-*): run 'make deps' where there is network, and bring build/kselftest along"
if [ $have_ksft = yes ]; then
	# shellcheck disable=SC2086
	run gputests-build 120 make -j"$JOBS" $MAKEVARS KSFT_DIR="$KSFT" "$BUILD/tests/test_cuda_emu" \
		"$BUILD/tests/test_cuda_emu_separable" "$BUILD/tests/test_cuda_emu_varlen" \
		"$BUILD/tests/test_resident" "$BUILD/tests/test_resident_diag" \
		"$BUILD/tests/test_resident_bwd" \
		"$BUILD/tests/test_diag" "$BUILD/tests/test_diag_kernels"
	if [ "$rc" -eq 0 ]; then
		# device-resident calls (ape_attention_enqueue, KV-cache appends from device memory)
		# on the GPU, against the host calls, bit for bit
		gputest resident 60 test_resident "enqueue vs host call"
		# the diagnostics on device tensors (ape_attention_enqueue_diag) against the host call
		gputest resident-diag 60 test_resident_diag "enqueue_diag vs host call"
		# the backward pass on device tensors (ape_attention_backward_enqueue) on the GPU,
		# against the host call within the spec's tolerance
		gputest resident-bwd 90 test_resident_bwd "backward enqueue vs host call"
		run gputests 90 env APE_TEST_CUDA_DEVICE=1 "$BUILD/tests/test_cuda_emu"
		last=$(grep '^# Totals' "$OUT/gputests.log" | tail -n 1)
		case $rc in
		0) note gputests ok "test_cuda_emu on the real GPU: ${last#\# }" ;;
		4) note gputests FAIL "test_cuda_emu found no CUDA device: $(tail -n 1 "$OUT/gputests.log")" ;;
		124) note gputests TIMEOUT "test_cuda_emu on the real GPU" ;;
		*) note gputests FAIL "test_cuda_emu on the real GPU: ${last#\# }: see gputests.log" ;;
		esac
		gputest gputests-sep 60 test_cuda_emu_separable "the separable path"
		# ragged launches (many sequences in one launch: the prefill's segment table)
		gputest gputests-varlen 60 test_cuda_emu_varlen "ragged launches vs the reference"
		# the diagnostics kernels (ENT, MD: the _diag twins of prefill, decode, dmerge); the
		# other backends' variants of test_diag run too
		gputest diag 60 test_diag "entropy, mean distance"
		gputest diag-kernels 60 test_diag_kernels "every diagnostic kernel, entropy and mean distance"
	else
		note gputests FAIL "building tests/test_cuda_emu: see gputests-build.log"
	fi
else
	note gputests SKIP "$NO_KSFT"
fi

# ---- 4. ape-check, every backend
run apecheck 60 "$BUILD/bin/ape-check"
case $rc in
0) note ape-check ok "every cell within the spec's tolerance ($(grep -c . "$OUT/apecheck.log") lines: apecheck.log)" ;;
124) note ape-check TIMEOUT "see apecheck.log" ;;
*) note ape-check FAIL "status $rc: see apecheck.log" ;;
esac
grep -q '^ape-check: cuda not checked' "$OUT/apecheck.log" &&
	note ape-check FAIL "the CUDA backend was not checked: $(grep '^ape-check: cuda not checked' "$OUT/apecheck.log")"

# ---- 4b. resident against host calls: inputs already on the GPU (ape_attention_enqueue) beside
# the host call that copies them (issue 12), prefill and a decode step
run resident-bench 60 "$BUILD/bin/ape-bench" --backend cuda --resident -L 4096,16384 --repeats 5 \
	--seed 1
case $rc in
0) note resident-bench ok "ape-bench --resident (host vs resident, bytes copied, overhead): resident-bench.log" ;;
124) note resident-bench TIMEOUT "see resident-bench.log" ;;
*) note resident-bench FAIL "status $rc: see resident-bench.log" ;;
esac
run decode-bench 40 "$BUILD/bin/ape-bench" --backend cuda --resident -L 32768 --lq 1 \
	--repeats 21 --seed 1
case $rc in
0) note decode-bench ok "ape-bench --resident --lq 1 (a decode step's overhead): decode-bench.log" ;;
124) note decode-bench TIMEOUT "see decode-bench.log" ;;
*) note decode-bench FAIL "status $rc: see decode-bench.log" ;;
esac

# ragged batches: 256 sequences of 64 tokens in one call (one launch on CUDA) against a dense
# call per sequence and one dense call of the same pairs
run varlen-bench 40 "$BUILD/bin/ape-bench" --backend cuda --varlen 256 -L 64 --repeats 5 --seed 1
case $rc in
0)
	# the ragged call's launches (the fourth column of the table's rows): one per batch
	n=$(awk '$1 ~ /^[0-9]+$/ && NF >= 4 { print $4; exit }' "$OUT/varlen-bench.log")
	if [ "$n" = 1 ]; then
		note varlen-bench ok "ape-bench --varlen (ragged vs per-sequence calls, one launch): varlen-bench.log"
	else
		note varlen-bench FAIL "the ragged batch took ${n:-?} launches, not one: varlen-bench.log"
	fi
	;;
124) note varlen-bench TIMEOUT "see varlen-bench.log" ;;
*) note varlen-bench FAIL "status $rc: see varlen-bench.log" ;;
esac

# ---- 5. the benchmark
if command -v python3 >/dev/null 2>&1; then
	# at most 170 s, so that the suite below gets some time too
	budget=$(($(left) - 25))
	[ "$budget" -gt 170 ] && budget=170
	if [ "$budget" -gt 30 ]; then
		quick=
		[ "${GPU_CHECK_QUICK:-0}" = 1 ] && quick=--quick
		# shellcheck disable=SC2086
		run bench $((budget + 10)) python3 bench/torch_ape.py --build "$BUILD" --out "$OUT" \
			--budget "$budget" $quick
		case $rc in
		0) note bench ok "bench_table.txt (also bench.json)" ;;
		124) note bench TIMEOUT "partial rows in bench.json" ;;
		*) note bench FAIL "status $rc: see bench.log" ;;
		esac
	else
		note bench SKIP "out of time ($(left)s left)"
	fi
else
	note bench SKIP "no python3"
fi

# ---- 6. the whole test suite, with the time left
if [ $have_ksft = yes ]; then
	# CHECK_EXTRA= leaves out the fuzzing, fault-injection and ThreadSanitizer rounds that
	# `make check` adds after the unit tests: minutes of CPU time with nothing GPU-specific
	# shellcheck disable=SC2086
	run tests 300 make -j"$JOBS" $MAKEVARS KSFT_DIR="$KSFT" CHECK_EXTRA= check
	last=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped' "$OUT/tests.log" | tail -n 1)
	case $rc in
	0) note tests ok "make check (unit tests; no fuzz/faults/tsan rounds): $last" ;;
	124) note tests TIMEOUT "make check cut at the time limit: see tests.log for what ran" ;;
	*) note tests FAIL "make check: ${last:-no summary}: see tests.log" ;;
	esac
else
	note tests SKIP "$NO_KSFT"
fi

# ---- the table, last
echo
echo "libape gpu-check, $(($(date +%s) - T0))s, $(head -n 1 "$OUT/env.txt")"
cat "$SUMMARY"
if [ -f "$OUT/bench_table.txt" ]; then
	echo
	cat "$OUT/bench_table.txt"
fi
exit "$failed"
