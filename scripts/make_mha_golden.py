#!/usr/bin/python3
"""Golden files for tests/multihead_test.cc: torch.nn.MultiheadAttention(batch_first=True).

Run from the repository root with the system Python (torch 1.13, numpy):
    /usr/bin/python3 scripts/make_mha_golden.py
Writes tests/data/mha/<case>.safetensors (the module's state_dict, plus the case's settings in
"__metadata__") and <case>_<name>.npy (query, key, value, masks, output, weights). A missing
key file means key = query (self-attention); a missing value file means value = key.

Masks are saved in attend's convention, ZERO EXCLUDES (uint8, 1 = keep): PyTorch's
key_padding_mask and bool attn_mask are True where a key is EXCLUDED, so they are inverted.
No golden case has a fully masked row (PyTorch fills with -inf, attend with -1e9; they differ
only there).
"""
import os

import numpy as np
import torch

from safetensors_writer import save_safetensors

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "mha")

_DTYPES = {"F32": (torch.float32, "<f4"), "F16": (torch.float16, "<f2")}


def save_npy(case, name, array):
    np.save(os.path.join(OUT, f"{case}_{name}.npy"), np.ascontiguousarray(array))


def make_case(case, *, embed_dim=16, num_heads=4, batch=2, query_len=5, key_len=5, kdim=None,
              vdim=None, bias=True, self_attention=True, shared_memory=False, padding=None,
              causal=False, attn_mask_3d=False, average=True, unbatched=False,
              param_dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=True)
    with torch.no_grad():
        for p in module.parameters():  # nonzero biases too, so that they are tested
            p.uniform_(-0.5, 0.5)
            p.copy_(p.to(param_dtype).float())  # what the file holds, exactly
    module.eval()
    kdim = kdim or embed_dim
    vdim = vdim or embed_dim
    lead = () if unbatched else (batch,)
    query = torch.randn(*lead, query_len, embed_dim)
    if self_attention:
        key = value = query
        key_len = query_len
    else:
        key = torch.randn(*lead, key_len, kdim)
        value = key if shared_memory else torch.randn(*lead, key_len, vdim)

    kwargs = {"need_weights": True, "average_attn_weights": average}
    if padding is not None:  # padding[n] = number of padded keys at the end of batch item n
        pad = torch.zeros(batch, key_len, dtype=torch.bool)
        for n, count in enumerate(padding):
            if count:
                pad[n, key_len - count:] = True
        kwargs["key_padding_mask"] = pad[0] if unbatched else pad
        save_npy(case, "key_padding_mask", (~kwargs["key_padding_mask"]).numpy().astype(np.uint8))
    if causal:
        kwargs["attn_mask"] = torch.triu(torch.ones(query_len, key_len, dtype=torch.bool), 1)
    if attn_mask_3d:  # a random per-head mask that always keeps key 0
        heads = num_heads if unbatched else batch * num_heads
        drop = torch.rand(heads, query_len, key_len) < 0.3
        drop[..., 0] = False
        kwargs["attn_mask"] = drop
        save_npy(case, "attn_mask", (~drop).numpy().astype(np.uint8))

    with torch.no_grad():
        output, weights = module(query, key, value, **kwargs)

    state = {name: t.to(param_dtype) for name, t in module.state_dict().items()}
    metadata = {"num_heads": str(num_heads), "kdim": str(kdim), "vdim": str(vdim),
                "bias": str(int(bias)), "causal": str(int(causal)),
                "average": str(int(average))}
    save_safetensors(os.path.join(OUT, f"{case}.safetensors"), state, metadata)
    save_npy(case, "query", query.numpy())
    if not self_attention:
        save_npy(case, "key", key.numpy())
        if not shared_memory:
            save_npy(case, "value", value.numpy())
    save_npy(case, "output", output.numpy())
    save_npy(case, "weights", weights.numpy())


def main():
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        os.remove(os.path.join(OUT, name))
    make_case("self", seed=1)
    make_case("self_per_head", average=False, seed=2)
    make_case("cross", self_attention=False, query_len=3, key_len=6, seed=3)
    make_case("cross_shared_memory", self_attention=False, shared_memory=True, query_len=3,
              key_len=6, padding=[0, 2], seed=4)
    make_case("key_padding", padding=[2, 0], seed=5)
    make_case("causal", causal=True, average=False, seed=6)
    make_case("causal_and_padding", causal=True, padding=[0, 1], seed=7)
    make_case("attn_mask_per_head", attn_mask_3d=True, padding=[1, 0], average=False, seed=8)
    make_case("kdim_vdim", self_attention=False, kdim=12, vdim=10, query_len=3, key_len=6,
              seed=9)
    make_case("no_bias", bias=False, self_attention=False, query_len=4, key_len=7, seed=10)
    make_case("unbatched", unbatched=True, self_attention=False, query_len=4, key_len=6,
              seed=11)
    make_case("unbatched_per_head", unbatched=True, average=False, padding=[1], seed=12)
    make_case("float16_params", param_dtype=torch.float16, seed=13)
    make_case("bfloat16_params", param_dtype=torch.bfloat16, self_attention=False, kdim=12,
              vdim=10, query_len=3, key_len=6, seed=14)
    make_case("wide_heads", embed_dim=64, num_heads=2, query_len=9, key_len=11,
              self_attention=False, seed=15)


if __name__ == "__main__":
    main()
