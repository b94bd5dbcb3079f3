#!/usr/bin/python3
"""Golden outputs and gradients of the score rules for tests/score_rules_golden_test.cc, by
PyTorch autograd of the listing in float64 with each rule written as a dense tensor.

Run from the repository root with the system Python (torch 1.13, numpy):
    /usr/bin/python3 scripts/make_rules_grad_golden.py [OUT_DIR]
OUT_DIR defaults to tests/data/rules_grad. It receives cases.txt (one case a line: its name,
then key=value options as attend's AttentionOptions names them) and for every case NAME:
  NAME_query.npy, NAME_key.npy, NAME_value.npy, NAME_grad_out.npy   inputs, float32
  NAME_sinks.npy                                                    sinks (H), float32
  NAME_output.npy, NAME_grad_query.npy, NAME_grad_key.npy,          expected, float64
  NAME_grad_value.npy, NAME_grad_sinks.npy

For batch index (b, h), query i, key j, with i' = i + Lk - Lq (bottom) or i (top):
  s = q.k * scale; s = cap * tanh(s / cap); s += slope_h * (j - i')        softcap, ALiBi
  visible = (causal: j <= i') and (window: i' - left <= j <= i' + right), or j < prefix;
            and same document
  s = s.masked_fill(~visible, -1e9); softmax over [s, sink_h] (the sink has no value)
"""
import math
import os
import sys

import numpy as np
import torch


def alibi_slopes(heads):
    """The ALiBi paper's slopes (its reference get_slopes)."""
    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]
    closest = 2 ** int(math.floor(math.log2(heads)))
    slopes = power_of_two(closest)
    if closest < heads:
        slopes += power_of_two(2 * closest)[0::2][: heads - closest]
    return np.array(slopes, dtype=np.float32)


def listing(q, k, v, grad_out, sinks, options):
    q, k, v = (torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v))
    heads, query_len, key_len = q.shape[-3], q.shape[-2], k.shape[-2]
    offset = key_len - query_len if options.get("align", "bottom") == "bottom" else 0
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if "softcap" in options:
        cap = float(options["softcap"])
        scores = cap * torch.tanh(scores / cap)
    i = torch.arange(query_len)[:, None] + offset
    j = torch.arange(key_len)[None, :]
    if options.get("alibi"):
        slopes = torch.tensor(alibi_slopes(heads).astype(np.float64))[:, None, None]
        scores = scores + slopes * (j - i)
    visible = torch.ones(query_len, key_len, dtype=torch.bool)
    if options.get("causal"):
        visible &= j <= i
    if "window" in options:
        left, right = (int(x) for x in options["window"].split(","))
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    if int(options.get("prefix", 0)) > 0:
        visible |= j < int(options["prefix"])
    if "docs" in options:
        ends = [int(x) for x in options["docs"].split(",")]
        document = np.searchsorted(np.array(ends), np.arange(key_len), side="right")
        query_document = document[np.clip(np.arange(query_len) + offset, 0, key_len - 1)]
        visible &= torch.tensor(query_document[:, None] == document[None, :])
    scores = scores.masked_fill(~visible, -1e9)
    sink_tensor = None
    if sinks is not None:
        sink_tensor = torch.tensor(sinks.astype(np.float64), requires_grad=True)
        column = sink_tensor[:, None, None].expand(scores.shape[:-1] + (1,))
        weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :key_len]
    else:
        weights = torch.softmax(scores, dim=-1)
    output = torch.matmul(weights, v)
    output.backward(torch.tensor(grad_out.astype(np.float64)))
    result = {"output": output, "grad_query": q.grad, "grad_key": k.grad, "grad_value": v.grad}
    if sink_tensor is not None:
        result["grad_sinks"] = sink_tensor.grad
    return {name: t.detach().numpy() for name, t in result.items()}


def make_case(out_dir, name, options, *, batch=2, heads=3, query_len=7, key_len=9, dim=8,
              data_seed=0):
    generator = np.random.default_rng(data_seed)
    shape_q, shape_k = (batch, heads, query_len, dim), (batch, heads, key_len, dim)
    inputs = {
        "query": (generator.standard_normal(shape_q) * 1.5).astype(np.float32),
        "key": (generator.standard_normal(shape_k) * 1.5).astype(np.float32),
        "value": generator.standard_normal(shape_k).astype(np.float32),
        "grad_out": generator.standard_normal(shape_q).astype(np.float32),
    }
    sinks = None
    if options.get("sinks"):
        sinks = generator.standard_normal(heads).astype(np.float32)
        inputs["sinks"] = sinks
    expected = listing(inputs["query"], inputs["key"], inputs["value"], inputs["grad_out"], sinks,
                       options)
    for part, array in list(inputs.items()) + list(expected.items()):
        np.save(os.path.join(out_dir, f"{name}_{part}.npy"), np.ascontiguousarray(array))
    return " ".join([name] + [f"{key}={value}" for key, value in options.items()])


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if old.endswith(".npy") or old == "cases.txt":
            os.remove(os.path.join(out_dir, old))
    lines = [
        make_case(out_dir, "causal_top_left", {"causal": 1, "align": "top"}, data_seed=1),
        make_case(out_dir, "window_causal", {"causal": 1, "window": "2,0"}, data_seed=2),
        make_case(out_dir, "window_both_top", {"window": "1,2", "align": "top"}, query_len=9,
                  key_len=6, data_seed=3),
        make_case(out_dir, "alibi", {"alibi": 1, "causal": 1}, data_seed=4),
        make_case(out_dir, "alibi_six_heads", {"alibi": 1}, heads=6, data_seed=5),
        make_case(out_dir, "softcap", {"softcap": 2.5}, data_seed=6),
        make_case(out_dir, "sinks", {"sinks": 1}, data_seed=7),
        make_case(out_dir, "sinks_rows_excluded", {"sinks": 1, "causal": 1}, query_len=9,
                  key_len=4, data_seed=8),
        make_case(out_dir, "documents", {"docs": "3,7", "causal": 1}, query_len=9, data_seed=9),
        make_case(out_dir, "prefix", {"prefix": 3, "causal": 1}, data_seed=10),
        make_case(out_dir, "everything", {"causal": 1, "window": "4,0", "alibi": 1,
                                          "softcap": 3, "sinks": 1, "docs": "4", "prefix": 1},
                  query_len=8, key_len=10, data_seed=11),
    ]
    with open(os.path.join(out_dir, "cases.txt"), "w") as cases:
        cases.write("# Written by scripts/make_rules_grad_golden.py: a case name, then its\n"
                    "# score rules. Its inputs and expected results are NAME_<part>.npy.\n")
        for line in lines:
            cases.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                      "rules_grad"))
