#!/usr/bin/env python3
"""Medians and spread of scripts/bench_alternating.sh's output (argument: the .jsonl file)."""
import collections
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print("reduced precision: this time / float32 baseline time, same process")
reduced = collections.defaultdict(list)
for r in rows:
    if r["build"] == "new" and r.get("baseline"):
        reduced[r["case"]].append(r)
for case, rs in reduced.items():
    ratio = [r["speedup"] for r in rs]
    print(f"  {case:16s} {statistics.median(ratio):.2f}x (min {min(ratio):.2f}, max {max(ratio):.2f},"
          f" n {len(rs)}), {statistics.median(r['median_us'] for r in rs) / 1e3:.1f} ms,"
          f" {statistics.median(r['pct_peak'] for r in rs):.1f} % of the {rs[0]['peak_kind']} peak"
          f" ({statistics.median(r['peak_gflops'] for r in rs):.0f} GFLOP/s)")
print("float32: new / base time, same round")
f32 = collections.defaultdict(lambda: collections.defaultdict(dict))
for r in rows:
    if not r.get("baseline"):
        f32[r["case"]][r["round"]][r["build"]] = r
for case, rounds in f32.items():
    pairs = [v for v in rounds.values() if "new" in v and "base" in v]
    ratio = [v["new"]["median_us"] / v["base"]["median_us"] for v in pairs]
    print(f"  {case:12s} {statistics.median(ratio):.3f} (min {min(ratio):.3f}, max {max(ratio):.3f},"
          f" n {len(ratio)}), new {statistics.median(v['new']['median_us'] for v in pairs) / 1e3:.1f} ms,"
          f" base {statistics.median(v['base']['median_us'] for v in pairs) / 1e3:.1f} ms,"
          f" new {statistics.median(v['new']['pct_peak'] for v in pairs):.1f} % of the FMA peak")
    if "pct_read" in pairs[0]["new"]:  # memory-bound: % of the read probe around the case
        for b in ("new", "base"):
            pct = [v[b]["pct_read"] for v in pairs]
            print(f"  {'':12s} {b:4s} {statistics.median(pct):.1f} % of the read probe (min"
                  f" {min(pct):.1f}, max {max(pct):.1f}), {statistics.median(v[b]['gbps'] for v in pairs):.1f}"
                  f" GB/s, probe {statistics.median(v[b]['read_gbps'] for v in pairs):.1f} GB/s")
