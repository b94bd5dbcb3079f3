"""What the Python tests share: the reference (PyTorch 2's math path in float64, with
attend's score rules written out), tolerances from an error model, and a comparison that
names the worst element."""

import importlib.util
import math
import pathlib

import numpy as np
import pytest
import torch


torch.set_num_threads(1)  # the reference is small; leave the cores to attend and ctest -j

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8,
                 np.float32: 2.0**-24, np.float16: 2.0**-11}


def unit_roundoff(dtype):
    return UNIT_ROUNDOFF[dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype).type]


def forward_tolerance(dtype, head_dim, key_len, magnitude):
    """|attend - float64 reference| for an output of `magnitude` (max |V|): the output's own
    rounding (2u of its dtype) plus float32 accumulation over the E terms of a score and the
    Lk terms of weights @ V, each contributing a few float32 roundings relative to the
    magnitude."""
    u32 = 2.0**-24
    return magnitude * (2 * unit_roundoff(dtype) + 8 * (head_dim + key_len) * u32) + 1e-30


def backward_tolerance(dtype, head_dim, key_len, magnitude):
    """Gradients add two more products (dS = P (dP - D), then dS @ K or dS^T @ Q) to the
    forward's error chain: the same model with a larger constant."""
    u32 = 2.0**-24
    return magnitude * (4 * unit_roundoff(dtype) + 64 * (head_dim + key_len) * u32) + 1e-30


def to_torch64(x):
    """A torch float64 tensor (integer and bool tensors as they are), keeping autograd's
    graph so that the reference can be differentiated."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.to(torch.float64) if x.is_floating_point() else x


def assert_close(got, expected, tolerance, what="result"):
    """Fails with the worst element: index, got, expected, tolerance."""
    got = to_torch64(got).detach()
    expected = to_torch64(expected).detach()
    assert tuple(got.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    both_nan = torch.isnan(got) & torch.isnan(expected)
    error = torch.where(both_nan, torch.zeros_like(got), (got - expected).abs())
    error = torch.nan_to_num(error, nan=math.inf)
    if error.numel() == 0:
        return
    worst = int(error.flatten().argmax())
    index = np.unravel_index(worst, tuple(error.shape))
    assert float(error.flatten()[worst]) <= tolerance, (
        f"{what}: worst element {tuple(int(i) for i in index)}: got "
        f"{float(got.flatten()[worst])!r}, expected {float(expected.flatten()[worst])!r}, "
        f"tolerance {tolerance:.3g}")


def reference_attention(query, key, value, attn_mask=None, is_causal=False, scale=None,
                        enable_gqa=False, causal_alignment="top_left", window=None, alibi=None,
                        softcap=None, sinks=None, segment_ids=None, prefix=0,
                        fully_masked_rows="uniform", keep=None):
    """(output, weights) in float64: PyTorch 2's math path for its arguments (GQA as
    repeat_interleave of K and V), attend's score rules in the order of
    include/attend/score_rules.hpp, excluded scores set to -1e9 as the listing's masked_fill.
    `keep`: an extra bool mask (True keeps), for attend.attention's listing."""
    q, k, v = to_torch64(query), to_torch64(key), to_torch64(value)
    if enable_gqa:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    E = q.shape[-1]
    Lq, Lk = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(E))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = to_torch64(attn_mask)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    offset = 0 if causal_alignment == "top_left" else Lk - Lq
    i = torch.arange(Lq).reshape(Lq, 1) + offset
    j = torch.arange(Lk).reshape(1, Lk)
    if alibi is not None and alibi is not False:
        H = q.shape[-3] if q.dim() >= 3 else 1
        slopes = torch.tensor(default_alibi_slopes(H)) if alibi is True else to_torch64(alibi)
        s = s + slopes.reshape(H, 1, 1).double() * (j - i)
    visible = torch.ones(Lq, Lk, dtype=torch.bool)
    if is_causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            visible &= j >= i - left
        if right is not None:
            visible &= j <= i + right
    if prefix:
        visible |= j < prefix
    visible = visible.expand(s.shape)
    if segment_ids is not None:
        sq, sk = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        sq, sk = to_torch64(sq), to_torch64(sk)
        visible = visible & (sq.unsqueeze(-1) == sk.unsqueeze(-2))
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & mask
    if keep is not None:
        visible = visible & to_torch64(keep).bool()
    s = s.masked_fill(~visible, -1e9)
    if sinks is not None:
        sink = to_torch64(sinks).reshape(-1, 1, 1).expand(*s.shape[:-1], 1)
        weights = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(s, dim=-1)
    if fully_masked_rows == "zero":
        weights = weights * visible.any(-1, keepdim=True)
    return weights @ v, weights


def default_alibi_slopes(heads):
    """ALiBi's slopes as the paper's code (and attend::default_alibi_slopes)."""
    def power_of_two(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]
    n = 2 ** math.floor(math.log2(heads))
    slopes = power_of_two(n)
    if n < heads:
        slopes += power_of_two(2 * n)[0::2][: heads - n]
    return slopes


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(20261130)


def random(generator, *shape, dtype=torch.float32):
    return torch.rand(shape, generator=generator, dtype=torch.float32).mul(2).sub(1).to(dtype)


EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"


def load_example(name):
    """examples/python/<name>.py imported as a module (its main() not run)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
