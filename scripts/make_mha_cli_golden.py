#!/usr/bin/python3
"""Golden files for tests/mha_cli_test.cc: `attend mha` against torch.nn.MultiheadAttention.

Run from the repository root with the system Python (torch 1.13, numpy):
    /usr/bin/python3 scripts/make_mha_cli_golden.py
Writes tests/data/mha_cli/<case>.safetensors (the module's state_dict under PyTorch's names, and
the case's command-line settings in "__metadata__": heads, causal, average) and
<case>_<name>.npy: query, key and value (absent for self-attention), key_padding_mask and mask
(when used), and the expected output and weights.

Masks are saved as `attend mha` takes them, ZERO EXCLUDES (uint8, 1 = keep / real token):
PyTorch's key_padding_mask and bool attn_mask are True where a key is EXCLUDED, so they are
inverted here. No case has a fully masked row (PyTorch gives NaN there, attend the listing's
uniform weights).
"""
import os

import numpy as np
import torch

from safetensors_writer import save_safetensors

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "mha_cli")


def save_npy(case, name, array):
    np.save(os.path.join(OUT, f"{case}_{name}.npy"), np.ascontiguousarray(array))


def make_case(case, *, embed_dim=16, num_heads=4, batch=2, query_len=5, key_len=5, kdim=None,
              vdim=None, bias=True, cross=False, padding=None, causal=False, per_head_mask=False,
              average=True, half_query=False, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=True)
    with torch.no_grad():
        for p in module.parameters():  # nonzero biases too, so that they are tested
            p.uniform_(-0.5, 0.5)
    # Training mode with dropout 0 computes the same, and keeps torch 1.13 off its fast path
    # (which fails for bias=False).
    module.train()
    query = torch.randn(batch, query_len, embed_dim)
    if half_query:  # the file holds float16; torch computes in float32 from the same values
        query = query.half().float()
    if cross:
        key = torch.randn(batch, key_len, kdim or embed_dim)
        value = torch.randn(batch, key_len, vdim or embed_dim)
    else:
        key = value = query
        key_len = query_len

    kwargs = {"need_weights": True, "average_attn_weights": average}
    if padding is not None:  # padding[n] = number of padded keys at the end of batch item n
        pad = torch.zeros(batch, key_len, dtype=torch.bool)
        for n, count in enumerate(padding):
            if count:
                pad[n, key_len - count:] = True
        kwargs["key_padding_mask"] = pad
        save_npy(case, "key_padding_mask", (~pad).numpy().astype(np.uint8))
    if causal:  # attend mha --causal; torch 1.13 takes it as a bool attn_mask
        kwargs["attn_mask"] = torch.triu(torch.ones(query_len, key_len, dtype=torch.bool), 1)
    if per_head_mask:  # a random (N·heads, L, S) mask that always keeps key 0
        drop = torch.rand(batch * num_heads, query_len, key_len) < 0.3
        drop[..., 0] = False
        kwargs["attn_mask"] = drop
        save_npy(case, "mask", (~drop).numpy().astype(np.uint8))

    with torch.no_grad():
        output, weights = module(query, key, value, **kwargs)

    metadata = {"heads": str(num_heads), "causal": str(int(causal)),
                "average": str(int(average))}
    save_safetensors(os.path.join(OUT, f"{case}.safetensors"), module.state_dict(), metadata)
    save_npy(case, "query", query.numpy().astype(np.float16 if half_query else np.float32))
    if cross:
        save_npy(case, "key", key.numpy())
        save_npy(case, "value", value.numpy())
    save_npy(case, "output", output.numpy())
    save_npy(case, "weights", weights.numpy())


def main():
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        os.remove(os.path.join(OUT, name))
    make_case("self", seed=21)
    make_case("cross_kdim_vdim", cross=True, num_heads=2, kdim=12, vdim=10, query_len=3,
              key_len=6, average=False, seed=22)
    make_case("key_padding", padding=[2, 0], average=False, seed=23)
    make_case("causal", causal=True, seed=24)
    make_case("mask_and_padding", cross=True, query_len=4, key_len=6, padding=[1, 0],
              per_head_mask=True, average=False, seed=25)
    make_case("no_bias", bias=False, seed=26)
    make_case("half_query", half_query=True, causal=True, padding=[0, 1], average=False, seed=27)


if __name__ == "__main__":
    main()
