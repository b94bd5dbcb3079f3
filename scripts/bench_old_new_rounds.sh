#!/bin/bash
# bench_old_new_rounds.sh OLD NEW OUT.jsonl ROUNDS CASE...: each CASE with the OLD and the NEW
# attend binary, every case in its own process (`attend bench --case C --repetitions 3
# --json`), the order reversed every other round; one JSON object per line of OUT with
# "round" and "binary" ("old" or "new") added. Compare `median_cpu_us` (process CPU time per
# call) between binaries within a round on a loaded host.
set -euo pipefail
OLD=$1 NEW=$2 OUT=$3 ROUNDS=$4
shift 4
: >"$OUT"
runs=()
for c in "$@"; do runs+=("old $c" "new $c"); done
for r in $(seq 1 "$ROUNDS"); do
  order=("${runs[@]}")
  if [ $((r % 2)) = 0 ]; then mapfile -t order < <(printf '%s\n' "${runs[@]}" | tac); fi
  for x in "${order[@]}"; do
    read -r which c <<<"$x"
    binary=$OLD
    if [ "$which" = new ]; then binary=$NEW; fi
    OMP_WAIT_POLICY=passive "$binary" bench --case "$c" --repetitions 3 --json 2>/dev/null |
      sed "s/^{/{\"round\":$r,\"binary\":\"$which\",/" >>"$OUT"
  done
done
