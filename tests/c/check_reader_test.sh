#!/bin/sh
# check_reader_test.sh - runs check_reader (tests/c/check_reader.c) against
# check_gen, the C generator of the same test stream.
# Usage: check_reader_test.sh CHECK_GEN CHECK_READER
set -u
gen=$1
rd=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; rm -f /dev/shm/tsock.ckr-$$-*' EXIT
failed=0

# expect NAME WANT_RC FILE: FILE's last line equals the generator's and
# check_reader exited WANT_RC.
expect() {
  if [ "$3" != "$2" ]; then
    echo "FAIL $1: check_reader exited $3, want $2"; cat "$tmp/$1.out"; failed=1; return
  fi
  if [ "$(tail -n 1 "$tmp/$1.out")" != "$(cat "$tmp/$1.gen")" ]; then
    echo "FAIL $1: got '$(tail -n 1 "$tmp/$1.out")', want '$(cat "$tmp/$1.gen")'"; failed=1; return
  fi
  echo "ok   $1: $(tail -n 1 "$tmp/$1.out")"
}

# Two readers, whole stream, epoch markers every 100 batches.
n=ckr-$$-two
"$rd" "$n" 0 > "$tmp/a.out" & a=$!
"$rd" "$n" 0 now > "$tmp/b.out" & b=$!
"$gen" "$n" 300 2 100 16 > "$tmp/a.gen" || failed=1
cp "$tmp/a.gen" "$tmp/b.gen"
wait $a; expect a 0 $?
wait $b; expect b 0 $?
grep -q 'status=TSOCK_ECLOSED' "$tmp/a.out" || { echo "FAIL a: no TSOCK_ECLOSED"; failed=1; }

# A slow reader on a 4-slot ring: the producer is back-pressured.
n=ckr-$$-slow
"$rd" "$n" 0 next 300 > "$tmp/slow.out" & s=$!
"$gen" "$n" 40 1 0 4 > "$tmp/slow.gen" || failed=1
wait $s; expect slow 0 $?

# The producer dies: the reader drains, then exits 3.
n=ckr-$$-die
"$rd" "$n" 0 > "$tmp/die.out" & d=$!
"$gen" "$n" 30 1 10 16 die > "$tmp/die.gen" || failed=1
wait $d; expect die 3 $?
grep -q 'status=TSOCK_EPRODUCER_GONE' "$tmp/die.out" || { echo "FAIL die: no TSOCK_EPRODUCER_GONE"; failed=1; }

# EXPECTED_BATCHES stops the reader early.
n=ckr-$$-stop
"$rd" "$n" 25 > "$tmp/stop.out" & e=$!
"$gen" "$n" 25 1 0 16 > "$tmp/stop.gen" || failed=1
wait $e; expect stop 0 $?
grep -q 'status=' "$tmp/stop.out" && { echo "FAIL stop: read past EXPECTED_BATCHES"; failed=1; }

exit $failed
