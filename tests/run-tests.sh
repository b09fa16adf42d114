#!/bin/sh
# Runs Kselftest programs, shows their KTAP output and ends with one line:
#   N passed, N failed, N skipped
# A test printed "ok N name # SKIP why" is skipped, not passed; a program that exits 4 (KSFT_SKIP)
# before running anything counts as one skipped test; a program that dies without reporting a
# failure counts as one failed test. Each program's wall time follows its output, the five
# slowest come before the last line. Exits 1 if anything failed.
# usage: tests/run-tests.sh [--valgrind] BUILD_DIR TEST...
set -u
wrap=""
if [ "${1:-}" = "--valgrind" ]; then
	wrap="valgrind -q --suppressions=$(dirname "$0")/valgrind.supp --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite,indirect --show-leak-kinds=definite,indirect --track-origins=yes"
	shift
fi
build=$1
shift
log_dir="$build/test-logs"
mkdir -p "$log_dir"
pass=0 fail=0 skip=0
times=""
for t in "$@"; do
	name=$(basename "$t")
	log="$log_dir/$name.log"
	echo "# ---- $name"
	t0=$(date +%s)
	$wrap "$t" >"$log" 2>&1
	rc=$?
	secs=$(($(date +%s) - t0))
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
