#!/bin/sh
# Runs libFuzzer targets one after another for a bounded time each and ends with one line:
#   fuzz: N targets, N executions, N findings
# Each target starts from the committed seeds (tests/fuzz/corpus/<target>/, read only: regression
# inputs live there too) plus what earlier runs found ($FUZZ_DIR/corpus/<target>/). A crash, hang
# (-timeout), leak, out-of-memory or sanitizer report is a finding: its input is kept under
# $FUZZ_DIR/artifacts/<target>/, the report is shown, and the script exits 1.
# FUZZ_JOBS=N runs N targets at once (each single-threaded, each for SECONDS); the reports come
# in the targets' order either way.
# usage: tests/fuzz/run-fuzz.sh FUZZ_DIR SRC_DIR SECONDS TARGET...
#        (tests/fuzz/run-fuzz.sh --run-one FUZZ_DIR SRC_DIR SECONDS TARGET: one, for the above)
set -u
one=""
if [ "${1:-}" = "--run-one" ]; then
	one=1
	shift
fi
fuzz_dir=$1 src=$2 secs=$3
shift 3
total=0 findings=0 n=0
# halt on the first UBSan report (the build already makes them fatal) and show where it came from
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
# One target: its log, then "rc seconds" in $fuzz_dir/logs/<target>.rc.
run_one() {
	t=$1
	bin="$fuzz_dir/bin/fuzz_$t"
	work="$fuzz_dir/corpus/$t"
	art="$fuzz_dir/artifacts/$t/"
	log="$fuzz_dir/logs/$t.log"
	mkdir -p "$work" "$art" "$(dirname "$log")"
	dict=""
	[ -f "$src/$t.dict" ] && dict="-dict=$src/$t.dict"
	start=$(date +%s)
	# shellcheck disable=SC2086 # $dict is one option or nothing
	"$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
		-artifact_prefix="$art" $dict "$work" "$src/corpus/$t" >"$log" 2>&1
	echo "$? $(($(date +%s) - start))" >"$fuzz_dir/logs/$t.rc"
}

if [ -n "$one" ]; then
	run_one "$1"
	exit 0
fi
jobs=${FUZZ_JOBS:-1}
case "$jobs" in
'' | *[!0-9]* | 0) echo "run-fuzz: FUZZ_JOBS=$jobs: expected a count >= 1" >&2; exit 2 ;;
esac
mkdir -p "$fuzz_dir/logs"
for t in "$@"; do rm -f "$fuzz_dir/logs/$t.rc"; done
if [ "$jobs" -gt 1 ]; then
	printf '%s\n' "$@" | xargs -P "$jobs" -I{} "$0" --run-one "$fuzz_dir" "$src" "$secs" {}
fi
for t in "$@"; do
	n=$((n + 1))
	[ "$jobs" -gt 1 ] || run_one "$t"
	bin="$fuzz_dir/bin/fuzz_$t"
	art="$fuzz_dir/artifacts/$t/"
	log="$fuzz_dir/logs/$t.log"
	if [ -f "$fuzz_dir/logs/$t.rc" ]; then
		read -r rc took <"$fuzz_dir/logs/$t.rc"
	else
		rc=1 took=0
	fi
	execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
	execs=${execs:-0}
	total=$((total + execs))
	if [ "$rc" -ne 0 ]; then
		findings=$((findings + 1))
		echo "fuzz: $t: FINDING (exit status $rc) after $execs executions in $took s; report:"
		grep -E 'ERROR|SUMMARY|runtime error|==[0-9]+==|#[0-9]+ 0x|Test unit written|timeout|leak' "$log" |
			head -n 40 | sed 's/^/  /'
		echo "  full log: $log; reproduce: $bin $art<file>"
	else
		echo "fuzz: $t: $execs executions in $took s, no finding"
	fi
done
echo "fuzz: $n targets, $total executions, $findings findings"
# for `make check`'s total: each target one test, passed without a finding
[ -n "${APE_TEST_SUMMARY:-}" ] && echo "$((n - findings)) $findings 0" >>"$APE_TEST_SUMMARY"
[ "$findings" -eq 0 ]
