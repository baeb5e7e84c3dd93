#!/usr/bin/env bash
# loaded-test.sh [RUNS] [HOGS]: the whole `make test`, RUNS times in a row
# (default 5), on a fresh clone of one commit while HOGS CPU-bound
# processes (default 2, `yes > /dev/null`) run beside it: the flakiness
# check for a loaded 2-CPU CI machine.
#
# A run takes about an hour here, so a series can span sessions: the
# commit is LOADED_COMMIT (default HEAD), and each finished run is appended
# to $LOADED_LOGS/series.tsv (commit, run, verdict, seconds, date). A new
# call continues that commit's series: it counts the passes in a row since
# its last failure and runs until RUNS are reached, so an interrupted run
# (a session's end) simply runs again. Logs go to $LOADED_LOGS (default
# /tmp/tsock-loaded). It exits non-zero if a run failed.
set -u
runs=${1:-5}
hogs=${2:-2}
logs=${LOADED_LOGS:-/tmp/tsock-loaded}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse "${LOADED_COMMIT:-HEAD}") || exit 1
mkdir -p "$logs"
series=$logs/series.tsv
touch "$series"

# Passes in a row for this commit since its last failure.
in_a_row() {
  awk -F'\t' -v c="$commit" '$1 == c { n = ($3 == "PASS") ? n + 1 : 0 } END { print n + 0 }' "$series"
}

done_runs=$(in_a_row)
if [ "$done_runs" -ge "$runs" ]; then
  echo "commit ${commit:0:12}: $done_runs runs passed in a row already"
  exit 0
fi
clone=$(mktemp -d /tmp/tsock-loaded-clone.XXXXXX)
git clone -q "$repo" "$clone/tsock" && git -C "$clone/tsock" checkout -q "$commit" || exit 1
[ -d "$repo/../shared" ] && ln -s "$repo/../shared" "$clone/shared"
pids=()
for _ in $(seq "$hogs"); do yes > /dev/null & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$clone"' EXIT
status=0
while [ "$(in_a_row)" -lt "$runs" ]; do
  i=$(( $(awk -F'\t' -v c="$commit" '$1 == c' "$series" | wc -l) + 1 ))
  t0=$(date +%s)
  if (cd "$clone/tsock" && make test) > "$logs/run-${commit:0:12}-$i.log" 2>&1; then
    verdict=PASS
  else
    verdict=FAIL status=1
  fi
  took=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\t%s\t%s\n' "$commit" "$i" "$verdict" "$took" "$(date -u +%FT%TZ)" >> "$series"
  echo "run $i: $verdict in $took s ($logs/run-${commit:0:12}-$i.log)"
  [ "$verdict" = PASS ] || break
done
echo "commit ${commit:0:12}, $hogs CPU hogs beside it: $(in_a_row) passed in a row"
exit "$status"
