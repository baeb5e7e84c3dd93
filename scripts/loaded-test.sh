#!/usr/bin/env bash
# loaded-test.sh [RUNS] [HOGS]: the whole `make test`, RUNS times in a row
# (default 5), on a fresh clone of HEAD while HOGS CPU-bound processes
# (default 2, `yes > /dev/null`) run beside it: the flakiness check for a
# loaded 2-CPU CI machine. Logs go to $LOADED_LOGS (default /tmp/tsock-loaded);
# it ends with "N passed, N failed" and exits non-zero if any run failed.
set -u
runs=${1:-5}
hogs=${2:-2}
logs=${LOADED_LOGS:-/tmp/tsock-loaded}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
clone=$(mktemp -d /tmp/tsock-loaded-clone.XXXXXX)
mkdir -p "$logs"
git clone -q "$repo" "$clone/tsock" || exit 1
[ -d "$repo/../shared" ] && ln -s "$repo/../shared" "$clone/shared"
pids=()
for _ in $(seq "$hogs"); do yes > /dev/null & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
pass=0 fail=0
for i in $(seq "$runs"); do
  t0=$(date +%s)
  if (cd "$clone/tsock" && make test) > "$logs/run-$i.log" 2>&1; then
    pass=$((pass + 1)); verdict=PASS
  else
    fail=$((fail + 1)); verdict=FAIL
  fi
  echo "run $i: $verdict in $(( $(date +%s) - t0 )) s ($logs/run-$i.log)"
done
echo "commit $(git -C "$clone/tsock" rev-parse --short HEAD), $hogs CPU hogs beside it"
echo "$pass passed, $fail failed"
rm -rf "$clone"
[ "$fail" -eq 0 ]
