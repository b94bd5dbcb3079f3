#!/usr/bin/python3
"""Per-call instructions of attend's Python entry points under callgrind (BENCHMARKS.md,
"Python per-call cost, round 3"): sets up, makes 5 warm-up calls, prints "ready", waits
until FLAG exists, then makes N calls (one thread, torch.no_grad()). Python's and torch's
imports need not be simulated: start callgrind with instrumentation off and switch it on at
"ready" (then FLAG):

    ATTEND_MAX_SIMD=AVX2 PYTHONPATH=build/python valgrind --tool=callgrind \\
        --instr-atstart=no [--cache-sim=yes] --callgrind-out-file=cg.out \\
        /usr/bin/python3 bench/python_callgrind_driver.py MODE N FLAG > cg.log 2>&1 &
    until grep -q ready cg.log; do sleep 1; done
    callgrind_control -i on $!; touch FLAG; wait
    callgrind_annotate --inclusive=yes cg.out | grep -E 'plan_run_fastcall|module_call|...'

MODE: plan (AttentionPlan.run on the plan-decode tensors (1, 8, 1|128, 64), torch), module
(attend.MultiheadAttention(256, 8, batch_first) on the phrase (1, 4, 256), self-attention,
need_weights=False), plan-cpp / module-cpp (the same N calls in the C++ loops of
attend._attend.cpp_plan_seconds / cpp_multihead_seconds). Valgrind 3.19 stops at libhwy's
rdtscp: see BENCHMARKS.md, "Python per-call instructions", for the patched copy.
"""

import os
import sys
import time

import torch

import attend
from attend import _attend


def main():
    mode, calls, flag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    attend.set_num_threads(1)
    torch.manual_seed(0)
    module = attend.MultiheadAttention.from_torch(
        torch.nn.MultiheadAttention(256, 8, batch_first=True).eval())
    x = torch.rand(1, 4, 256)
    q, k, v = torch.rand(1, 8, 1, 64), torch.rand(1, 8, 128, 64), torch.rand(1, 8, 128, 64)
    out = torch.empty_like(q)
    plan = attend.AttentionPlan(q, k, v, out, options=attend.ServingOptions(num_threads=1))
    python_calls = {"module": lambda: module(x, x, x, need_weights=False),
                    "plan": lambda: plan.run(q, k, v, out)}
    cpp_loops = {"module": lambda n: _attend.cpp_multihead_seconds(module._cpp, x, n, 1, True),
                 "plan": lambda n: _attend.cpp_plan_seconds(plan, q, k, v, out, n, True)}
    kind, _, variant = mode.partition("-")
    with torch.no_grad():
        if variant == "cpp":
            cpp_loops[kind](5)
        else:
            for _ in range(5):
                python_calls[kind]()
        print("ready", flush=True)
        while not os.path.exists(flag):
            time.sleep(0.02)
        if variant == "cpp":
            cpp_loops[kind](calls)
        else:
            call = python_calls[kind]
            for _ in range(calls):
                call()


if __name__ == "__main__":
    main()
