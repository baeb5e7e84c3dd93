#!/bin/sh
# examples_test.sh - the README's example: one producer, a C and a C++ reader.
# Usage: examples_test.sh PRODUCER READER READER_CPP
set -u
tmp=$(mktemp -d)
name=examples-$$
trap 'rm -rf "$tmp"; rm -f /dev/shm/tsock.$name' EXIT
"$2" "$name" > "$tmp/c.out" & c=$!
"$3" "$name" > "$tmp/cpp.out" & cpp=$!
"$1" "$name" 2 3 50 > "$tmp/producer.out" || { echo "FAIL: producer"; exit 1; }
wait $c || { echo "FAIL: C reader exited $?"; exit 1; }
wait $cpp || { echo "FAIL: C++ reader exited $?"; exit 1; }
cat "$tmp/producer.out" "$tmp/c.out"
want="epoch 0: 50 batches, 1600 samples, label sum 7200
epoch 1: 50 batches, 1600 samples, label sum 7200
epoch 2: 50 batches, 1600 samples, label sum 7200"
[ "$(cat "$tmp/c.out")" = "$want" ] || { echo "FAIL: C reader printed something else"; exit 1; }
[ "$(cat "$tmp/cpp.out")" = "$want" ] || { echo "FAIL: C++ reader:"; cat "$tmp/cpp.out"; exit 1; }
echo "ok: both readers saw every batch"
