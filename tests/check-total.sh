#!/bin/sh
# Adds up the "pass fail skip" lines that tests/run-tests.sh and tests/fuzz/run-fuzz.sh append to
# FILE when APE_TEST_SUMMARY names it, and prints the total as `make check`'s last line, in the
# suites' own format. Exits 1 if anything failed.
# usage: tests/check-total.sh FILE
set -u
awk '{ p += $1; f += $2; s += $3 }
     END { print "# all suites:"; printf "%d passed, %d failed, %d skipped\n", p, f, s; exit f > 0 }' "$1"
