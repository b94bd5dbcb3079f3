#!/usr/bin/python3
"""attend from Python beside the same call in C++ and beside PyTorch 1.13's own CPU attention,
in one process, on the same tensors (BENCHMARKS.md, section Python).

    PYTHONPATH=build/python /usr/bin/python3 bench/python_bench.py [--threads T]
        [--case overhead,phrase-mha,plan-decode,unet,s3,s4,s4-causal] [--repetitions R] [--min-time S]
        [--json]

Per case and pass, three callers, measured in turns (one repetition of each, R times):
  C++      attend's C++ API on the arrays Python holds, timed in C++ (attend._attend.cpp_*):
           scaled_dot_product_attention (and _backward), allocating their results
  attend   the Python call: attend.scaled_dot_product_attention on torch tensors (forward
           under torch.no_grad(); forward+backward through torch.autograd with
           torch.autograd.grad), attend.MultiheadAttention
  PyTorch  torch.nn.functional._scaled_dot_product_attention (1.13's CPU path: the listing's
           math, materializing Lq x Lk), torch.nn.MultiheadAttention
A repetition repeats the call until it has lasted --min-time seconds (default 0.2); the
median over repetitions (default 5) is reported (for the overhead also the best: the
difference of the fastest repetitions); attend/C++ is the median of the per-repetition
ratios, C++ and attend having run back to back. `overhead`: the phrase (1, 8, 4, 4, 32) on
one thread, Python minus C++ (NumPy and torch inputs, with and without out=), in the calling
thread's CPU time (time.thread_time, CLOCK_THREAD_CPUTIME_ID), which time spent descheduled
on a shared machine does not inflate; the other cases in wall time. `phrase-mha` also times the C call the module makes
(attend._attend.multihead_call) alone: the Python around it is the difference. `plan-decode`: a prepared
call on a decode step (1, 8, 1, 128, 64), one thread, against the C++ loop of
AttentionPlan::run on the same arrays, thread CPU time: plan.run(q, k, v, out) and the bound
plan (plan.bind(q, k, v, out), then bound() per step), NumPy and torch.
On a loaded machine, many short repetitions (--repetitions 300 --min-time 0.001: about a
millisecond of calls each, in turns) make "best" the difference of the least disturbed ones.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attend
from attend import _attend

# (B, H, Lq, Lk, E, causal), as src/bench/cases.cc.
SHAPES = {
    "phrase": (1, 8, 4, 4, 32, False),
    "unet": (1, 4, 4096, 4096, 32, False),
    "s3": (1, 8, 1024, 1024, 64, False),
    "s4": (1, 16, 2048, 2048, 128, False),
    "s4-causal": (1, 16, 2048, 2048, 128, True),
}
CASES = ["overhead", "phrase-mha", "plan-decode", "unet", "s3", "s4", "s4-causal"]
# A decode step: one query per head over a cache of 128 keys, (B, H, Lq, Lk, E).
DECODE = (1, 8, 1, 128, 64)


def forward_flops(B, H, Lq, Lk, E, causal):
    """attend::attention_flops: 4*B*H*Lq*Lk*E, halved for causal."""
    flops = 4.0 * B * H * Lq * Lk * E
    return flops / 2 if causal else flops


def repeat(call, min_time, clock=time.perf_counter):
    """Seconds per call: batches of calls, growing until one lasts min_time (of `clock`);
    the clock is read around a batch, not per call (reading the thread's CPU time is a system
    call of about a microsecond)."""
    batch = 1
    while True:
        start = clock()
        for _ in range(batch):
            call()
        elapsed = clock() - start
        if elapsed >= min_time:
            return elapsed / batch
        batch = 2 * batch if elapsed < min_time / 8 else int(1.2 * batch * min_time / elapsed) + 1


def repeat_cpp(timer, min_time):
    """timer(calls) -> seconds per call, timed in C++; calls chosen to last min_time."""
    estimate = timer(1)
    return timer(max(1, int(min_time / max(estimate, 1e-9))))


def run_in_turns(variants, repetitions, min_time, clock=time.perf_counter):
    """({name: median seconds per call}, {name: best}): each repetition measures every
    variant once, so that a busy minute on the shared machine touches all of them alike.
    A variant that is None (PyTorch with --skip-pytorch) reads NaN."""
    skipped = [name for name, v in variants.items() if v is None]
    variants = {name: v for name, v in variants.items() if v is not None}
    samples = {name: [] for name in variants}
    for name, (kind, call) in variants.items():  # warm-up: allocations, thread pools
        call(1) if kind == "cpp" else call()
    for _ in range(repetitions):
        for name, (kind, call) in variants.items():
            seconds = repeat_cpp(call, min_time) if kind == "cpp" else \
                repeat(call, min_time, clock)
            samples[name].append(seconds)
    nan = {name: float("nan") for name in skipped}
    medians = {**{name: statistics.median(s) for name, s in samples.items()}, **nan}
    best = {**{name: min(s) for name, s in samples.items()}, **nan}
    if "attend" in samples and "C++" in samples:  # measured back to back in each repetition
        medians["attend/C++"] = statistics.median(
            a / c for a, c in zip(samples["attend"], samples["C++"]))
    return medians, best


def pytorch(args, call):
    return None if args.skip_pytorch else ("py", call)


def tensors(shape, generator, requires_grad=False):
    B, H, Lq, Lk, E, _ = shape
    def make(L):
        t = torch.rand(B, H, L, E, generator=generator) * 2 - 1
        return t.requires_grad_(requires_grad)
    return make(Lq), make(Lk), make(Lk)


def overhead_case(args, generator):
    shape = SHAPES["phrase"]
    causal = shape[5]
    q, k, v = tensors(shape, generator)
    out = torch.empty_like(q)
    qn, kn, vn, outn = (t.numpy() for t in (q, k, v, out))
    sdpa = attend.scaled_dot_product_attention
    variants = {
        "C++": ("cpp", lambda n: _attend.cpp_sdpa_seconds(q, k, v, None, causal, n, 1, True)),
        "C++ into": ("cpp", lambda n: _attend.cpp_sdpa_seconds(q, k, v, out, causal, n, 1,
                                                               True)),
        "NumPy": ("py", lambda: sdpa(qn, kn, vn, num_threads=1)),
        "NumPy out=": ("py", lambda: sdpa(qn, kn, vn, num_threads=1, out=outn)),
        "torch": ("py", lambda: sdpa(q, k, v, num_threads=1)),
        "torch out=": ("py", lambda: sdpa(q, k, v, num_threads=1, out=out)),
        "PyTorch 1.13": pytorch(args, lambda: F._scaled_dot_product_attention(q, k, v)),
    }
    with torch.no_grad():  # the calling thread's CPU time: one thread, a shared machine
        t, best = run_in_turns(variants, args.repetitions, args.min_time, time.thread_time)
    rows = []
    for name, baseline in [("NumPy", "C++"), ("NumPy out=", "C++ into"), ("torch", "C++"),
                           ("torch out=", "C++ into")]:
        rows.append({"case": "overhead", "pass": name, "cpp_us": t[baseline] * 1e6,
                     "attend_us": t[name] * 1e6,
                     "overhead_us": (t[name] - t[baseline]) * 1e6,
                     "best_overhead_us": (best[name] - best[baseline]) * 1e6,
                     "pytorch_us": t["PyTorch 1.13"] * 1e6, "threads": 1})
    return rows


def multihead_case(args, generator):
    """The phrase through a whole MultiheadAttention(256, 8 heads, batch_first), one thread,
    need_weights=False (torch's fast path), under torch.no_grad(), in the calling thread's
    CPU time."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    ours = attend.MultiheadAttention.from_torch(module)
    x = torch.rand(1, 4, 256, generator=generator)
    # The C call the module makes (attend._attend.multihead_call), alone: what the Python
    # around it costs is the difference.
    c_call = (_attend.multihead_call, ours._cpp, ours._parameters, ours.out_proj._parameters,
              ours._call_slots)
    variants = {
        "C++": ("cpp", lambda n: _attend.cpp_multihead_seconds(ours._cpp, x, n, 1, True)),
        "attend": ("py", lambda: ours(x, x, x, need_weights=False)),
        "C call": ("py", lambda: c_call[0](*c_call[1:], x, x, x, False, True, False, True)),
        "PyTorch 1.13": pytorch(args, lambda: module(x, x, x, need_weights=False)),
    }
    attend.set_num_threads(1)
    try:
        with torch.no_grad():  # one thread: its CPU time, as the overhead case
            t, best = run_in_turns(variants, args.repetitions, args.min_time, time.thread_time)
    finally:
        attend.set_num_threads(0)
        torch.set_num_threads(args.threads)
    return [{"case": "phrase-mha", "pass": "forward", "cpp_us": t["C++"] * 1e6,
             "attend_us": t["attend"] * 1e6, "attend_over_cpp": t["attend/C++"],
             "overhead_us": (t["attend"] - t["C++"]) * 1e6,
             "best_overhead_us": (best["attend"] - best["C++"]) * 1e6,
             "pytorch_us": t["PyTorch 1.13"] * 1e6,
             "threads": 1},
            {"case": "phrase-mha", "pass": "forward, C call", "cpp_us": t["C++"] * 1e6,
             "attend_us": t["C call"] * 1e6, "overhead_us": (t["C call"] - t["C++"]) * 1e6,
             "best_overhead_us": (best["C call"] - best["C++"]) * 1e6,
             "pytorch_us": float("nan"), "threads": 1}]


def plan_decode_case(args, generator):
    """A planned decode call from Python against the same plan run in a C++ loop."""
    q, k, v = tensors(DECODE + (False,), generator)
    out = torch.empty_like(q)
    plan = attend.AttentionPlan(q, k, v, out, options=attend.ServingOptions(num_threads=1))
    assert plan.prepared
    qn, kn, vn, outn = (t.numpy() for t in (q, k, v, out))
    bound_numpy, bound_torch = plan.bind(qn, kn, vn, outn), plan.bind(q, k, v, out)
    variants = {
        "C++": ("cpp", lambda n: _attend.cpp_plan_seconds(plan, q, k, v, out, n, True)),
        "run NumPy": ("py", lambda: plan.run(qn, kn, vn, outn)),
        "run torch": ("py", lambda: plan.run(q, k, v, out)),
        "bound NumPy": ("py", bound_numpy),
        "bound torch": ("py", bound_torch),
    }
    t, best = run_in_turns(variants, args.repetitions, args.min_time, time.thread_time)
    return [{"case": "plan-decode", "pass": name, "cpp_us": t["C++"] * 1e6,
             "attend_us": t[name] * 1e6, "overhead_us": (t[name] - t["C++"]) * 1e6,
             "best_overhead_us": (best[name] - best["C++"]) * 1e6,
             "pytorch_us": float("nan"), "threads": 1}
            for name in ("run NumPy", "run torch", "bound NumPy", "bound torch")]


def attention_case(name, args, generator):
    shape = SHAPES[name]
    causal = shape[5]
    threads = args.threads
    q, k, v = tensors(shape, generator)
    rows = []
    forward = {
        "C++": ("cpp", lambda n: _attend.cpp_sdpa_seconds(q, k, v, None, causal, n, threads,
                                                          False)),
        "attend": ("py", lambda: attend.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                     num_threads=threads)),
        "PyTorch 1.13": pytorch(args, lambda: F._scaled_dot_product_attention(
            q, k, v, is_causal=causal)),
    }
    with torch.no_grad():
        rows.append(("forward", run_in_turns(forward, args.repetitions, args.min_time)[0]))
    del forward
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grad_output = torch.rand_like(q)

    def attend_step():
        out = attend.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                  num_threads=threads)
        torch.autograd.grad(out, (qg, kg, vg), grad_output)

    def torch_step():
        out, _ = F._scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        torch.autograd.grad(out, (qg, kg, vg), grad_output)

    backward = {
        "C++": ("cpp", lambda n: _attend.cpp_sdpa_forward_backward_seconds(
            q, k, v, grad_output, causal, n, threads)),
        "attend": ("py", attend_step),
        "PyTorch 1.13": pytorch(args, torch_step),
    }
    rows.append(("forward+backward",
                 run_in_turns(backward, args.repetitions, args.min_time)[0]))
    flops = forward_flops(*shape)
    result = []
    for kind, t in rows:
        pass_flops = flops * (3.5 if kind == "forward+backward" else 1.0)  # backward: 2.5x
        result.append({"case": name, "pass": kind, "cpp_us": t["C++"] * 1e6,
                       "attend_us": t["attend"] * 1e6, "attend_over_cpp": t["attend/C++"],
                       "pytorch_us": t["PyTorch 1.13"] * 1e6,
                       "attend_gflops": pass_flops / t["attend"] / 1e9, "threads": threads})
    return result


def print_table(rows):
    print(f"{'case':<11} {'pass':<17} {'C++':>11} {'attend':>11} {'attend/C++':>10} "
          f"{'PyTorch 1.13':>13} {'PyTorch/attend':>14} {'GFLOP/s':>8}")
    for r in rows:
        extra = f"{r['attend_gflops']:8.1f}" if "attend_gflops" in r else \
            f"  +{r['overhead_us']:.2f} us (best +{r['best_overhead_us']:.2f})" \
            if "overhead_us" in r else ""
        ratio = r.get("attend_over_cpp", r["attend_us"] / r["cpp_us"])
        print(f"{r['case']:<11} {r['pass']:<17} {fmt(r['cpp_us']):>11} {fmt(r['attend_us']):>11} "
              f"{ratio:>10.3f} {fmt(r['pytorch_us']):>13} "
              f"{r['pytorch_us'] / r['attend_us']:>13.1f}x {extra}".replace("nanx", "   -"))


def fmt(us):
    if us != us:  # NaN: not measured
        return "-"
    return f"{us:.2f} us" if us < 100 else f"{us / 1000:.2f} ms"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=attend.get_num_threads())
    parser.add_argument("--case", default=",".join(CASES))
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.2)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--skip-pytorch", action="store_true",
                        help="C++ and attend only (PyTorch's math path takes minutes for s4)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name in args.case.split(","):
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        if name == "overhead":
            rows += overhead_case(args, generator)
        elif name == "phrase-mha":
            rows += multihead_case(args, generator)
        elif name == "plan-decode":
            rows += plan_decode_case(args, generator)
        elif name in SHAPES:
            rows += attention_case(name, args, generator)
        else:
            parser.error(f"unknown case {name!r} (cases: {', '.join(CASES)})")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print_table(rows)
        print(f"\n{args.threads} threads ({attend.active_simd_target()}), torch "
              f"{torch.__version__} on {torch.get_num_threads()} threads; medians of "
              f"{args.repetitions} repetitions of >= {args.min_time} s")


if __name__ == "__main__":
    main()
