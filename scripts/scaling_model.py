#!/usr/bin/env python3
"""The scaling model of docs/SCALING.md: ring attention (contiguous and zigzag) and head
parallelism (Ulysses) over N ranks, from a rank's attention throughput F, a link's bandwidth
and latency, and the problem's sizes. Plain Python 3, no NumPy.

  python3 scripts/scaling_model.py                      # the tables of docs/SCALING.md
  python3 scripts/scaling_model.py --check F BW T1 L H E   # one 2-rank loopback prediction

Per ring step on each rank, with S = L / N the shard length, s the bytes of an element:
  compute   C = 4·B·H·S²·E / F                 (non-causal; a causal zigzag step: C / 2)
  transfer  X = α + B·H_kv·S·(E + Ev)·s / BW   (the next K/V shard)
  T_N = (N − 1)·max(C_step, X) + C_step        (the last step sends nothing)
  efficiency = T_1 / (N·T_N),  T_1 = N²·C (non-causal), N²·C/2 (causal)
A causal ring with contiguous shards steps at the pace of its busiest rank (a full block
every step after the first): T_N = (N − 1)·max(C, X) + C/2, efficiency N / (2N − 1).
Head parallelism: two all-to-alls (Q, K, V in; O out), each rank sending (N − 1)/N of its
shard, not overlapped: T_N = T_1 / N + B·S·(N − 1)/N·(2H·E + 2H_kv·E)·s / BW + 2α.
Kernel efficiency at smaller blocks and the merge are left out: the model is the link's
share only (docs/SCALING.md states what the measurements add).
"""
import argparse


def ring(F, BW, alpha, B, H, Hkv, E, L, N, s, causal, zigzag=True):
    S = L / N
    C = 4 * B * H * S * S * E / F
    X = alpha + B * Hkv * S * 2 * E * s / BW
    if not causal:
        t1, step, first = N * N * C, C, C
    elif zigzag:
        t1, step, first = N * N * C / 2, C / 2, C / 2
    else:
        t1, step, first = N * N * C / 2, C, C / 2
    tn = (N - 1) * max(step, X) + first if N > 1 else first
    return t1 / (N * tn), step, X


def ulysses(F, BW, alpha, B, H, Hkv, E, L, N, s, causal):
    if N > H:
        return None
    S = L / N
    t1 = 4 * B * H * L * L * E / F / (2 if causal else 1)
    x = 2 * alpha + B * S * (N - 1) / N * (2 * H * E + 2 * Hkv * E) * s / BW
    return (t1 / N) / (t1 / N + x)


def hidden_shard(F, BW, H, Hkv, s, causal):
    """Shard length from which a step's compute covers its transfer (α left out)."""
    return F * s * Hkv / ((1 if causal else 2) * BW * H)


def tables():
    F = 2e12  # one rank: a CPU node computing attention at 2 TFLOP/s (float32)
    B, H, Hkv, E, L, s = 1, 32, 32, 128, 1 << 20, 4
    links = [("InfiniBand 25 GB/s", 25e9, 2e-6), ("InfiniBand 50 GB/s", 50e9, 2e-6),
             ("100 GbE (12.5 GB/s)", 12.5e9, 10e-6)]
    print(f"Problem: B={B}, H={H} (K/V heads {Hkv}), E={E}, L={L}, float32; F = {F/1e12:g} TFLOP/s per rank\n")
    print("Shard length from which transfers are hidden (S*):\n")
    print("| link | non-causal | causal (zigzag) | memory per rank at S* (forward) |")
    print("|---|---|---|---|")
    for name, bw, _ in links:
        a, c = hidden_shard(F, bw, H, Hkv, s, False), hidden_shard(F, bw, H, Hkv, s, True)
        print(f"| {name} | {a:.0f} | {c:.0f} | {memory(B, H, Hkv, E, c, s) / 2**20:.1f} MiB |")
    gpu = 300e12  # for comparison: a GPU at 300 TFLOP/s (bf16, s = 2), 50 GB/s
    print(f"| (a GPU rank: 300 TFLOP/s, bf16, 50 GB/s) | {hidden_shard(gpu, 50e9, H, Hkv, 2, False):.0f} | "
          f"{hidden_shard(gpu, 50e9, H, Hkv, 2, True):.0f} | |")
    print()
    for name, bw, alpha in links:
        print(f"Predicted efficiency, {name}, α = {alpha * 1e6:g} µs:\n")
        print("| ranks | shard S | step compute (non-causal) | transfer | ring non-causal | ring causal zigzag | ring causal contiguous | Ulysses causal | memory per rank |")
        print("|---|---|---|---|---|---|---|---|---|")
        for N in [2, 4, 8, 16, 64, 256, 1024]:
            e_nc, C, X = ring(F, bw, alpha, B, H, Hkv, E, L, N, s, False)
            e_z, _, _ = ring(F, bw, alpha, B, H, Hkv, E, L, N, s, True)
            e_c, _, _ = ring(F, bw, alpha, B, H, Hkv, E, L, N, s, True, zigzag=False)
            u = ulysses(F, bw, alpha, B, H, Hkv, E, L, N, s, True)
            print(f"| {N} | {L // N} | {C:.3g} s | {X * 1e3:.3g} ms | {100 * e_nc:.1f} % | "
                  f"{100 * e_z:.1f} % | {100 * e_c:.1f} % | {'—' if u is None else f'{100 * u:.1f} %'} | "
                  f"{memory(B, H, Hkv, E, L // N, s) / 2**30:.2f} GiB |")
        print()
    print("Where the link decides: a small problem, L = 65536, H = 8, E = 64:\n")
    print("| ranks | shard S | ring causal zigzag, 25 GB/s | 100 GbE | Ulysses causal, 25 GB/s |")
    print("|---|---|---|---|---|")
    for N in [2, 8, 64, 256, 1024]:
        z25 = ring(F, 25e9, 2e-6, 1, 8, 8, 64, 65536, N, 4, True)[0]
        z12 = ring(F, 12.5e9, 10e-6, 1, 8, 8, 64, 65536, N, 4, True)[0]
        u = ulysses(F, 25e9, 2e-6, 1, 8, 8, 64, 65536, N, 4, True)
        print(f"| {N} | {65536 // N} | {100 * z25:.1f} % | {100 * z12:.1f} % | "
              f"{'—' if u is None else f'{100 * u:.1f} %'} |")


def memory(B, H, Hkv, E, S, s):
    """Forward, per rank: Q and O shards, K/V (own + two in flight), float32 accumulator and
    one block's output and log-sum-exp."""
    return (B * H * S * 2 * E * s + 3 * B * Hkv * S * 2 * E * s + 2 * B * H * S * (E + 1) * 4)


def check(F, BW, T1, L, H, E):
    """2 ranks on loopback: predicted ring time and efficiency from the measured F (one rank's
    GFLOP/s), BW (GB/s) and T_1 (s)."""
    for causal in (False, True):
        e, step, X = ring(F * 1e9, BW * 1e9, 0.0, 1, H, H, E, L, 2, 4, causal)
        t1 = T1 if not causal else T1 / 2
        print(f"{'causal zigzag' if causal else 'non-causal'}: step compute {step * 1e3:.1f} ms, "
              f"transfer {X * 1e3:.1f} ms, predicted efficiency {100 * e:.1f} %, "
              f"ring time {t1 / (2 * e):.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", nargs=6, type=float, metavar=("F", "BW", "T1", "L", "H", "E"))
    args = parser.parse_args()
    if args.check:
        F, BW, T1, L, H, E = args.check
        check(F, BW, T1, int(L), int(H), int(E))
    else:
        tables()
