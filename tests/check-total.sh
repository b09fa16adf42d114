#!/bin/sh
# Adds up the "pass fail skip" lines that tests/run-tests.sh and tests/fuzz/run-fuzz.sh append to
# FILE when APE_TEST_SUMMARY names it, and prints the total as `make check`'s last line, in the
# suites' own format, after each suite's wall time when TIMES (tests/timed.sh's lines) is given.
# Exits 1 if anything failed.
# usage: tests/check-total.sh FILE [TIMES]
set -u
if [ -n "${2:-}" ] && [ -f "$2" ]; then
	echo "# wall time per suite:"
	awk '{ printf "#   %-14s %5d s\n", $1, $2; t += $2 } END { printf "#   %-14s %5d s\n", "all", t }' "$2"
fi
awk '{ p += $1; f += $2; s += $3 }
     END { print "# all suites:"; printf "%d passed, %d failed, %d skipped\n", p, f, s; exit f > 0 }' "$1"
