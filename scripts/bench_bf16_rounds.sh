#!/bin/bash
# bench_bf16_rounds.sh ATTEND ROUNDS OUT.jsonl: issue 22's five bfloat16 cases, each beside
# its float32 case, and s4-bf16-avx512 (AVX512_BF16 with AMX off), every case in its own
# process, the order reversed every other round; one JSON object per case and round on each
# line of OUT, with "round" added. Summarize with scripts/bench_bf16_rounds.py (ratios of
# process CPU time per call, for a loaded host). On a loaded host run it with
# OMP_WAIT_POLICY=passive, so that a thread waiting for its descheduled sibling sleeps
# instead of spinning on CPU time.
set -euo pipefail
ATTEND=$1 ROUNDS=${2:-5} OUT=${3:-bench_bf16_rounds.jsonl}
CASES=(s4-bf16 s4 unet-bf16 unet s4-causal-bf16 s4-causal s4-bwd-bf16 s4-bwd unet-block-bf16
  unet-block s4-bf16-avx512)
: >"$OUT"
for r in $(seq 1 "$ROUNDS"); do
  order=("${CASES[@]}")
  if [ $((r % 2)) = 0 ]; then mapfile -t order < <(printf '%s\n' "${CASES[@]}" | tac); fi
  for c in "${order[@]}"; do
    "$ATTEND" bench --case "$c" --repetitions 3 --json 2>/dev/null |
      sed "s/^{/{\"round\":$r,/" >>"$OUT"
  done
  echo "round $r done $(date -u +%H:%M:%S)" >&2
done
