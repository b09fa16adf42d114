#!/bin/sh
# Runs Kselftest programs, shows their KTAP output and ends with one line:
#   N passed, N failed, N skipped
# A test printed "ok N name # SKIP why" is skipped, not passed; a program that exits 4 (KSFT_SKIP)
# before running anything counts as one skipped test; a program that dies without reporting a
# failure counts as one failed test. Each program's wall time follows its output, the five
# slowest come before the last line. Exits 1 if anything failed.
#
# APE_TEST_JOBS=N runs up to N programs at once (default 1): each writes its own log, and the
# logs are shown in the order the programs were given, whatever order they end in, so the
# output is the same as one at a time. The programs share nothing a test checks (temporary
# files are made per test, program caches are written whole and renamed).
# usage: tests/run-tests.sh [--valgrind] BUILD_DIR TEST...
#        (tests/run-tests.sh --run-one [--valgrind] BUILD_DIR TEST: one program, for the above)
set -u
# Programs built with AddressSanitizer (make sanitize, make faults-ci): ASan does not track the
# dynamic TLS blocks handed out by __tls_get_addr. Tracking them, LeakSanitizer's leak check met
# a dynamic-TLS entry with a garbage range ("DTLS 7 at 0x...e7e-0x...1f80") and its tracer
# crashed ("Tracer caught signal 11") in test_kvpagedfail on an AMD EPYC VM, every run, on this
# tree and on the one before (gcc 12's libasan, glibc 2.36); static TLS is still scanned, and
# the leak checks pass. Programs built without ASan ignore the variable.
export ASAN_OPTIONS="intercept_tls_get_addr=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
one=""
if [ "${1:-}" = "--run-one" ]; then
	one=1
	shift
fi
valgrind=""
wrap=""
if [ "${1:-}" = "--valgrind" ]; then
	valgrind="--valgrind"
	wrap="valgrind -q --suppressions=$(dirname "$0")/valgrind.supp --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite,indirect --show-leak-kinds=definite,indirect --track-origins=yes"
	shift
fi
build=$1
shift
log_dir="$build/test-logs"
mkdir -p "$log_dir"

# One program: its log, then its exit status and wall time in NAME.rc ("rc secs").
run_one() {
	name=$(basename "$1")
	t0=$(date +%s)
	$wrap "$1" >"$log_dir/$name.log" 2>&1
	rc=$?
	echo "$rc $(($(date +%s) - t0))" >"$log_dir/$name.rc"
}

if [ -n "$one" ]; then
	run_one "$1"
	exit 0
fi
jobs=${APE_TEST_JOBS:-1}
case "$jobs" in
'' | *[!0-9]* | 0) echo "run-tests: APE_TEST_JOBS=$jobs: expected a count >= 1" >&2; exit 2 ;;
esac
for t in "$@"; do rm -f "$log_dir/$(basename "$t").rc"; done
if [ "$jobs" -gt 1 ]; then
	# xargs keeps N programs running, each through this script's --run-one
	printf '%s\n' "$@" | xargs -P "$jobs" -I{} "$0" --run-one $valgrind "$build" {}
fi

pass=0 fail=0 skip=0
times=""
for t in "$@"; do
	name=$(basename "$t")
	log="$log_dir/$name.log"
	echo "# ---- $name"
	[ "$jobs" -gt 1 ] || run_one "$t"
	if [ -f "$log_dir/$name.rc" ]; then
		read -r rc secs <"$log_dir/$name.rc"
	else
		rc=1 secs=0
		echo "# $name: never ran" >>"$log"
	fi
	times="$times$secs $name
"
	cat "$log"
	echo "# $name: ${secs} s"
	p=$(grep -cE '^ok [0-9]+ ' "$log")
	s=$(grep -cE '^ok [0-9]+ .*# SKIP' "$log")
	f=$(grep -cE '^not ok [0-9]+ ' "$log")
	p=$((p - s))
	if [ "$rc" -eq 4 ] && [ $((p + s + f)) -eq 0 ]; then
		s=1
	elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
		echo "# $name: exited with status $rc without reporting a failed test: counted as failed"
		f=1
	fi
	pass=$((pass + p)) skip=$((skip + s)) fail=$((fail + f))
done
# where this suite's time went: its slowest programs
printf '%s' "$times" | sort -rn | head -5 | awk '{ printf "%s%s %s s", (NR > 1 ? ", " : "# slowest: "), $2, $1 } END { if (NR) print "" }'
echo "$pass passed, $fail failed, $skip skipped"
# `make check` adds every suite's counts up (tests/check-total.sh)
[ -n "${APE_TEST_SUMMARY:-}" ] && echo "$pass $fail $skip" >>"$APE_TEST_SUMMARY"
[ "$fail" -eq 0 ]
