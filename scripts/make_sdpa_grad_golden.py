#!/usr/bin/python3
"""Golden gradients for tests/sdpa_grad_cli_test.cc: the listing's backward pass by PyTorch autograd.

Run from the repository root with the system Python (torch 1.13, numpy):
    /usr/bin/python3 scripts/make_sdpa_grad_golden.py [OUT_DIR]
OUT_DIR defaults to tests/data/sdpa_grad. It receives cases.txt (one case a line: its name, then
the extra `attend sdpa` options it runs with) and for every case NAME:

  NAME_query.npy, NAME_key.npy, NAME_value.npy   inputs, float32 (float16 for half cases)
  NAME_mask.npy, NAME_bias.npy                   when the case has them
  NAME_grad_out.npy                              dO, the dtype of the query
  NAME_output.npy                                expected O (..., Lq, Ev), float64
  NAME_weights.npy                               expected weights after dropout, float64
  NAME_probabilities.npy                         softmax before dropout, float64 (error model)
  NAME_grad_query.npy, NAME_grad_key.npy,        expected dQ, dK, dV (and dBias, in the
  NAME_grad_value.npy, NAME_grad_bias.npy        bias's own shape), float64

Everything is computed in float64 from the values the files hold, by the listing:
  scores = q·kᵀ·scale + bias; scores.masked_fill(excluded, -1e9); softmax; dropout; weights·v
and autograd with output.backward(dO). Excluded: mask == 0, or causal (key j visible to query i
iff j <= i + Lk - Lq). Fully excluded rows keep the listing's uniform weights 1/Lk unless the
case passes --zero-masked-rows (then those rows are zeroed after the softmax).

Dropout reproduces attend's draws exactly (src/dropout.hpp): Philox-4x32-10 keyed by the seed,
counter (key // 4, query, batch low 32 bits, batch high 32 bits), word key % 4, keep iff
word >= min(floor(p·2^32), 2^32 − 1), kept weights scaled by 1/(1 − p). The batch index is the
row-major flat index over all leading batch dimensions.
"""
import math
import os
import sys

import numpy as np
import torch

MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(seed, c0, c1, c2, c3):
    """Philox-4x32-10 on arrays of 32-bit counters held in uint64; returns the four words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & MASK32 for c in (c0, c1, c2, c3))
    k0 = np.uint64(seed & 0xFFFFFFFF)
    k1 = np.uint64((seed >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0  # < 2^64: both factors are below 2^32
        p1 = np.uint64(0xCD9E8D57) * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + np.uint64(0x9E3779B9)) & MASK32
        k1 = (k1 + np.uint64(0xBB67AE85)) & MASK32
    return c0, c1, c2, c3


def check_philox():
    """Random123's published known answers (the same vectors as tests/dropout_test.cc)."""
    vectors = [
        ((0, 0, 0, 0), 0, (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
        ((0xffffffff,) * 4, 0xffffffffffffffff, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
        ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), 0x299f31d0a4093822,
         (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
    ]
    for counter, seed, expected in vectors:
        words = tuple(int(w) for w in philox4x32_10(seed, *counter))
        assert words == expected, f"Philox known answer: got {words}, expected {expected}"


def dropout_keep(seed, p, batch_shape, query_len, key_len):
    """Keep mask (*batch_shape, Lq, Lk) bool, as attend draws it."""
    threshold = min(math.floor(p * 4294967296.0), 4294967295)
    batch = int(np.prod(batch_shape, dtype=np.int64))
    b, i, j = np.meshgrid(np.arange(batch, dtype=np.uint64), np.arange(query_len, dtype=np.uint64),
                          np.arange(key_len, dtype=np.uint64), indexing="ij")
    words = np.stack(philox4x32_10(seed, j // np.uint64(4), i, b & MASK32, b >> np.uint64(32)))
    word = np.take_along_axis(words, (j % np.uint64(4)).astype(np.int64)[None], axis=0)[0]
    return (word >= np.uint64(threshold)).reshape(tuple(batch_shape) + (query_len, key_len))


def listing(q, k, v, grad_out, *, mask=None, bias=None, causal=False, scale=None, dropout=0.0,
            seed=0, zero_masked_rows=False):
    """The listing in float64 and its autograd gradients. All arguments are numpy arrays."""
    q, k, v = (torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v))
    query_len, key_len, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., Lq, Lk)
    bias_tensor = None
    if bias is not None:
        bias_tensor = torch.tensor(bias.astype(np.float64), requires_grad=True)
        scores = scores + bias_tensor  # broadcast; autograd sums dBias back to bias's shape
    excluded = torch.zeros(scores.shape, dtype=torch.bool)
    if mask is not None:
        excluded = excluded | (torch.tensor(mask) == 0)
    if causal:
        i = torch.arange(query_len)[:, None]
        j = torch.arange(key_len)[None, :]
        excluded = excluded | (j > i + (key_len - query_len))
    scores = scores.masked_fill(excluded, -1e9)
    probabilities = torch.softmax(scores, dim=-1)
    if zero_masked_rows:
        probabilities = probabilities * (~excluded.all(dim=-1, keepdim=True))
    weights = probabilities
    if dropout > 0.0:
        keep = dropout_keep(seed, dropout, scores.shape[:-2], query_len, key_len)
        weights = weights * torch.tensor(keep, dtype=torch.float64) / (1.0 - dropout)
    output = torch.matmul(weights, v)
    output.backward(torch.tensor(grad_out.astype(np.float64)))
    result = {"output": output, "weights": weights, "probabilities": probabilities,
              "grad_query": q.grad, "grad_key": k.grad, "grad_value": v.grad}
    if bias_tensor is not None:
        result["grad_bias"] = bias_tensor.grad
    return {name: t.detach().numpy() for name, t in result.items()}


def random(generator, shape, dtype=np.float32, spread=1.0):
    return (generator.standard_normal(shape) * spread).astype(dtype)


def make_case(out_dir, name, *, batch=(2,), query_len=5, key_len=6, head_dim=8, value_dim=None,
              dtype=np.float32, mask=None, bias_shape=None, bias_dtype=None, causal=False,
              scale=None, dropout=0.0, seed=0, zero_masked_rows=False, data_seed=0):
    """Writes one case's files; returns its line of cases.txt."""
    value_dim = head_dim if value_dim is None else value_dim
    generator = np.random.default_rng(data_seed)
    batch = tuple(batch)
    inputs = {
        "query": random(generator, batch + (query_len, head_dim), dtype, 1.5),
        "key": random(generator, batch + (key_len, head_dim), dtype, 1.5),
        "value": random(generator, batch + (key_len, value_dim), dtype),
        "grad_out": random(generator, batch + (query_len, value_dim), dtype),
    }
    if mask is not None:
        inputs["mask"] = mask
    if bias_shape is not None:
        inputs["bias"] = random(generator, bias_shape, bias_dtype or dtype)
    expected = listing(inputs["query"], inputs["key"], inputs["value"], inputs["grad_out"],
                       mask=inputs.get("mask"), bias=inputs.get("bias"), causal=causal,
                       scale=scale, dropout=dropout, seed=seed, zero_masked_rows=zero_masked_rows)
    for part, array in list(inputs.items()) + list(expected.items()):
        np.save(os.path.join(out_dir, f"{name}_{part}.npy"), np.ascontiguousarray(array))

    flags = []
    if causal:
        flags.append("--causal")
    if scale is not None:
        flags += ["--scale", repr(scale)]
    if dropout > 0.0:
        flags += ["--dropout", repr(dropout), "--seed", str(seed)]
    if zero_masked_rows:
        flags.append("--zero-masked-rows")
    return " ".join([name] + flags)


def main(out_dir):
    check_philox()
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if old.endswith(".npy") or old == "cases.txt":
            os.remove(os.path.join(out_dir, old))

    bool_mask = np.ones((2, 5, 6), dtype=np.bool_)
    bool_mask[0, 2, :] = False  # a fully masked row
    bool_mask[1, :, 4] = False
    bool_mask[1, 3, 0:3] = False
    int_mask = np.array([[1, 0, 3, 1, 0, 7, 1]], dtype=np.int32)  # (1, Lk): zeros exclude

    lines = [
        make_case(out_dir, "plain", data_seed=1),
        make_case(out_dir, "bool_mask_fully_masked_row", mask=bool_mask, value_dim=4, data_seed=2),
        make_case(out_dir, "bool_mask_zero_masked_rows", mask=bool_mask, value_dim=4,
                  zero_masked_rows=True, data_seed=3),
        make_case(out_dir, "int_mask_broadcast", key_len=7, mask=int_mask, data_seed=4),
        make_case(out_dir, "causal_short_query", query_len=3, key_len=7, causal=True,
                  data_seed=5),
        make_case(out_dir, "causal_long_query", query_len=7, key_len=4, causal=True, data_seed=6),
        make_case(out_dir, "bias_full", bias_shape=(2, 5, 6), data_seed=7),
        make_case(out_dir, "bias_heads_broadcast", batch=(2, 3), query_len=4, key_len=5,
                  head_dim=4, bias_shape=(3, 1, 5), causal=True, data_seed=8),
        make_case(out_dir, "dropout", batch=(2,), query_len=6, key_len=9, dropout=0.3,
                  seed=1234, data_seed=9),
        make_case(out_dir, "dropout_batch_dims_mask", batch=(2, 3), query_len=4, key_len=6,
                  head_dim=4, mask=bool_mask[0, 1:5], dropout=0.3, seed=0x9E3779B97F4A7C15,
                  data_seed=10),
        make_case(out_dir, "odd_head_dims", query_len=5, key_len=7, head_dim=5, value_dim=7,
                  data_seed=11),
        make_case(out_dir, "batch_dims", batch=(2, 3), query_len=4, key_len=5, head_dim=6,
                  value_dim=3, data_seed=12),
        make_case(out_dir, "custom_scale_bias_mask", mask=bool_mask, bias_shape=(1, 6),
                  scale=0.37, data_seed=13),
        make_case(out_dir, "float16", query_len=5, key_len=6, dtype=np.float16,
                  bias_shape=(1, 5, 6), mask=bool_mask, data_seed=14),
        make_case(out_dir, "float32_bias_half", bias_shape=(6,), bias_dtype=np.float16,
                  data_seed=15),
    ]
    with open(os.path.join(out_dir, "cases.txt"), "w") as cases:
        cases.write("# Written by scripts/make_sdpa_grad_golden.py: a case name, then the extra\n"
                    "# `attend sdpa` options it runs with. Its inputs are NAME_<part>.npy.\n")
        for line in lines:
            cases.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                      "sdpa_grad"))
