#!/usr/bin/env python3
"""The table of scripts/bench_bf16_rounds.sh's output (argument: the .jsonl file): for each
bfloat16 case, its float32 case's CPU time per call over its own in the same round (median,
min-max over the rounds), the wall ratios beside it, the peak the case is measured against
and its share of that peak per CPU-second."""
import collections
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
rounds = collections.defaultdict(dict)
for r in rows:
    rounds[r["round"]][r["case"]] = r
PAIRS = [("s4-bf16", "s4", ">= 1.7x (issue 26: >= 3x)"), ("unet-bf16", "unet", ">= 1.5x"),
         ("s4-causal-bf16", "s4-causal", ">= 1.5x"),
         ("s4-bwd-bf16", "s4-bwd", ">= 1.5x (issue 26: >= 2x)"),
         ("unet-block-bf16", "unet-block", ">= 1.4x"),
         ("s4-bf16-avx512", "s4", "- (AVX512_BF16, AMX off)")]
median = statistics.median


def share_of_peak(r):
    """% of the case's peak, FLOPs per CPU-second of each thread (as the probes count)."""
    seconds = r["median_cpu_us"] / r["threads"] * 1e-6
    return 100 * r["flops"] / seconds / 1e9 / r["peak_gflops"]


print("| case | CPU per call | float32 case, CPU per call | vs float32, CPU time: median (min-max)"
      " | wall, separate processes | wall, one process | target | peak | % of it (CPU) |")
print("|---|---|---|---|---|---|---|---|---|")
for case, base, target in PAIRS:
    both = [c for c in rounds.values() if case in c and base in c]
    if not both:
        continue
    cpu = [c[base]["median_cpu_us"] / c[case]["median_cpu_us"] for c in both]
    wall = [c[base]["median_us"] / c[case]["median_us"] for c in both]
    print(f"| {case} | {median(c[case]['median_cpu_us'] for c in both) / 1e3:.1f} ms"
          f" | {median(c[base]['median_cpu_us'] for c in both) / 1e3:.1f} ms"
          f" | **{median(cpu):.2f}x** ({min(cpu):.2f}-{max(cpu):.2f}), n {len(cpu)}"
          f" | {median(wall):.2f}x ({min(wall):.2f}-{max(wall):.2f})"
          f" | {median(c[case]['speedup'] for c in both):.2f}x | {target}"
          f" | {both[0][case]['peak_kind']} {median(c[case]['peak_gflops'] for c in both):.0f}"
          f" GFLOP/s | {median(share_of_peak(c[case]) for c in both):.1f} |")
print()
for base in ["s4", "unet", "s4-causal", "s4-bwd", "unet-block"]:
    runs = [c[base] for c in rounds.values() if base in c]
    if runs:
        print(f"- {base}: {median(r['median_cpu_us'] for r in runs) / 1e3:.1f} ms CPU per call,"
              f" FMA peak {median(r['peak_gflops'] for r in runs):.0f} GFLOP/s,"
              f" {median(share_of_peak(r) for r in runs):.0f} % of it")
