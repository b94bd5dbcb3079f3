#!/usr/bin/python3
"""Golden gradients for tests/multihead_backward_test.cc: torch.nn.MultiheadAttention
(batch_first=True) and autograd, in float64.

Run from the repository root with the system Python (torch 1.13, numpy):
    /usr/bin/python3 scripts/make_mha_grad_golden.py
Writes one tests/data/mha_grad/<case>.safetensors per case, holding
  - the module's state_dict under its own names (so MultiHeadAttention::load reads it),
  - "query", "key", "value" (a missing key means key = query; a missing value, value = key),
  - "key_padding_mask" / "attn_mask" in attend's convention, ZERO EXCLUDES (1 = keep, stored
    as float32 0/1 because the writer only writes floats): PyTorch's bool masks are True where
    a key is EXCLUDED, so they are inverted,
  - "grad_output" G (random), "output", and the gradients of loss = Σ output ⊙ G:
    "grad.query" ("grad.key", "grad.value" when they are separate tensors) and
    "grad.<parameter name>",
and the case's settings in "__metadata__".

Every input and parameter is rounded to float32 first, so the float64 gradients are the exact
ones for the float32 data the C++ test reads (then rounded to float32 when saved).
No case has a fully masked row (PyTorch fills with -inf, attend with -1e9; they differ there).
"""
import os

import torch

from safetensors_writer import save_safetensors

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "mha_grad")


def float32_exact(tensor):
    """A float64 tensor holding float32 values exactly."""
    return tensor.float().double()


def make_case(case, *, embed_dim=8, num_heads=2, batch=2, query_len=5, key_len=5, kdim=None,
              vdim=None, bias=True, self_attention=True, shared_memory=False, padding=None,
              causal=False, attn_mask_3d=False, unbatched=False, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=True).double()
    with torch.no_grad():
        for p in module.parameters():  # nonzero biases too, so that their gradients matter
            p.uniform_(-0.5, 0.5)
            p.copy_(float32_exact(p))
    kdim = kdim or embed_dim
    vdim = vdim or embed_dim
    lead = () if unbatched else (batch,)

    def leaf(*shape):
        return float32_exact(torch.randn(*shape)).requires_grad_()

    query = leaf(*lead, query_len, embed_dim)
    if self_attention:
        key = value = query
        key_len = query_len
    else:
        key = leaf(*lead, key_len, kdim)
        value = key if shared_memory else leaf(*lead, key_len, vdim)

    tensors = {}
    kwargs = {"need_weights": False}
    if padding is not None:  # padding[n] = number of padded keys at the end of batch item n
        pad = torch.zeros(batch, key_len, dtype=torch.bool)
        for n, count in enumerate(padding):
            if count:
                pad[n, key_len - count:] = True
        kwargs["key_padding_mask"] = pad[0] if unbatched else pad
        tensors["key_padding_mask"] = (~kwargs["key_padding_mask"]).float()
    if causal:  # attend's causal flag: key j visible to query i when j <= i + (S - L)
        kwargs["attn_mask"] = torch.triu(torch.ones(query_len, key_len, dtype=torch.bool),
                                         1 + key_len - query_len)
    if attn_mask_3d:  # a random per-head mask that always keeps key 0
        heads = num_heads if unbatched else batch * num_heads
        drop = torch.rand(heads, query_len, key_len) < 0.3
        drop[..., 0] = False
        kwargs["attn_mask"] = drop
        tensors["attn_mask"] = (~drop).float()

    output, _ = module(query, key, value, **kwargs)
    grad_output = float32_exact(torch.randn(output.shape))
    loss = (output * grad_output).sum()
    loss.backward()

    tensors.update(module.state_dict())
    tensors["query"] = query
    if not self_attention:
        tensors["key"] = key
        if not shared_memory:
            tensors["value"] = value
    tensors["grad_output"] = grad_output
    tensors["output"] = output
    tensors["grad.query"] = query.grad
    if not self_attention:
        tensors["grad.key"] = key.grad
        if not shared_memory:
            tensors["grad.value"] = value.grad
    for name, parameter in module.named_parameters():
        tensors["grad." + name] = parameter.grad
    metadata = {"num_heads": str(num_heads), "kdim": str(kdim), "vdim": str(vdim),
                "bias": str(int(bias)), "causal": str(int(causal))}
    save_safetensors(os.path.join(OUT, f"{case}.safetensors"), tensors, metadata)


def main():
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        os.remove(os.path.join(OUT, name))
    make_case("self_packed", seed=1)
    make_case("cross", self_attention=False, query_len=3, key_len=6, seed=2)
    make_case("cross_shared_memory", self_attention=False, shared_memory=True, query_len=3,
              key_len=6, padding=[0, 2], seed=3)
    make_case("kdim_vdim", self_attention=False, kdim=6, vdim=5, query_len=3, key_len=6,
              seed=4)
    make_case("key_padding", padding=[2, 0], seed=5)
    make_case("causal", causal=True, seed=6)
    make_case("causal_cross_kdim", self_attention=False, causal=True, kdim=6, vdim=6,
              query_len=3, key_len=5, padding=[1, 0], seed=7)
    make_case("attn_mask_per_head", attn_mask_3d=True, padding=[1, 0], seed=8)
    make_case("unbatched", unbatched=True, self_attention=False, query_len=4, key_len=6,
              seed=9)
    make_case("unbatched_self_no_bias", unbatched=True, bias=False, causal=True, seed=10)
    make_case("no_bias", bias=False, self_attention=False, query_len=4, key_len=7, seed=11)


if __name__ == "__main__":
    main()
