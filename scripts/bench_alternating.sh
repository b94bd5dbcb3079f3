#!/bin/bash
# bench_alternating.sh NEW_ATTEND BASE_ATTEND ROUNDS OUT.jsonl: the reduced-precision cases
# (each with its float32 baseline timed in the same process) with NEW, and the float32 cases
# with NEW and BASE (a build of the previous main) alternating, each case in its own process,
# the order reversed every other round. One JSON object per case and build on each line of
# OUT, with "build" and "round" added; summarize with scripts/bench_alternating.py.
# The environment may name other cases: REDUCED (NEW only) and F32 (NEW and BASE), e.g. the
# decode cases: REDUCED= F32="decode decode-gqa decode-int8" scripts/bench_alternating.sh ...
set -euo pipefail
NEW=$1 BASE=$2 ROUNDS=${3:-5} OUT=${4:-bench_alternating.jsonl}
REDUCED=${REDUCED-"s4-bf16 unet-bf16 s4-causal-bf16 s4-bwd-bf16 unet-block-bf16 s4-fp16"}
F32=${F32-"s4 unet s4-causal s4-bwd unet-block"}
: >"$OUT"
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="new base"; list=$REDUCED; else
    order="base new"; list=$(echo $REDUCED | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for c in $list; do
    "$NEW" bench --case "$c" --repetitions 3 --json 2>/dev/null |
      sed "s/^{/{\"build\":\"new\",\"round\":$r,/" >>"$OUT"
  done
  for c in $F32; do
    for b in $order; do
      if [ "$b" = new ]; then a=$NEW; else a=$BASE; fi
      "$a" bench --case "$c" --repetitions 3 --json 2>/dev/null |
        sed "s/^{/{\"build\":\"$b\",\"round\":$r,/" >>"$OUT"
    done
  done
  echo "round $r done $(date -u +%H:%M:%S)" >&2
done
