"""A Llama-style decoder block written for PyTorch 2's API, run on attend without changing it:
RMSNorm, rotary position embeddings (RoPE), grouped-query attention through
torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True), a causal mask, a
SwiGLU feed-forward, and a KV cache kept as tensors.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/llama_block.py

attend.torch.install() makes the functional call run attend (and provides it on PyTorch 1.13,
which has none); the block itself is plain PyTorch 2 code. The script prefills a prompt, decodes
a few tokens through the cache, and compares every output with the same block on PyTorch's math
path in float64.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (dim)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim, positions, base=10000.0, dtype=torch.float32):
    """cos, sin (L, head_dim): angle position * base^(-2i / head_dim) for the pair i, repeated
    for both halves (the rotate-half layout)."""
    inverse = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inverse[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x (N, H, L, D) rotated by position: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention: `heads` query heads sharing `kv_heads` key/value heads."""

    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, positions, cache=None):
        """x (N, L, dim) at `positions` (L); cache: (keys, values) (N, kv_heads, P, head_dim)
        of the P earlier positions, or None. Returns (output (N, L, dim), the cache extended
        by these L positions)."""
        N, L, _ = x.shape
        q = self.wq(x).view(N, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(N, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(N, L, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(self.head_dim, positions, dtype=x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        S = k.shape[2]
        mask, causal = None, False
        if L == S:
            causal = True  # a prompt: is_causal's top-left diagonal is the right one
        elif L > 1:  # a chunk after a cache: query i is position S - L + i
            mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(N, L, -1)), (k, v)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """x + attention(norm(x)), then + feed_forward(norm(x)): pre-norm, as Llama."""

    def __init__(self, dim=64, heads=8, kv_heads=2, hidden=None):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden or int(8 * dim / 3))

    def forward(self, x, positions, cache=None):
        """x (N, L, dim) -> (N, L, dim), the extended cache."""
        attended, cache = self.attention(self.attention_norm(x), positions, cache)
        x = x + attended
        return x + self.feed_forward(self.ffn_norm(x)), cache


def run(block, prompt, steps):
    """Prefills `prompt` (N, P, dim) (one causal call), then feeds each output's last token
    back for `steps` decode calls through the cache. Returns the outputs, prefill first."""
    outputs = []
    x, cache = block(prompt, torch.arange(prompt.shape[1]))
    outputs.append(x)
    for step in range(steps):
        position = prompt.shape[1] + step
        x, cache = block(x[:, -1:], torch.tensor([position]), cache)
        outputs.append(x)
    return outputs


def on_math_path(function, *args):
    """function(*args) with scaled_dot_product_attention on PyTorch's math path: PyTorch 2's
    own function takes it for float64 on the CPU; PyTorch 1.13 has none, attend.torch.sdpa_math
    writes it out."""
    import attend.torch

    if hasattr(F, "scaled_dot_product_attention"):
        return function(*args)
    F.scaled_dot_product_attention = attend.torch.sdpa_math
    try:
        return function(*args)
    finally:
        del F.scaled_dot_product_attention


def main():
    import time

    import attend.torch

    torch.manual_seed(0)
    block = Block().eval()
    prompt = torch.randn(2, 16, 64)
    with torch.no_grad():
        with attend.torch.enabled():
            start = time.perf_counter()
            got = run(block, prompt, 8)
            seconds = time.perf_counter() - start
        expected = on_math_path(run, block.double(), prompt.double(), 8)
    worst = max(float((g.double() - e).abs().max()) for g, e in zip(got, expected))
    print(f"attend ran {attend.torch.routes()['attend']} attention calls (1 prefill, 8 decode "
          f"steps) in {seconds * 1e3:.2f} ms; largest difference from the float64 math path: "
          f"{worst:.2e}")


if __name__ == "__main__":
    main()
