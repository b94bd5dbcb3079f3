"""Gradients of attend.scaled_dot_product_attention (attend's fused backward through
torch.autograd) against torch autograd of the float64 reference (PyTorch's math path)."""

import pytest
import torch

import attend
from conftest import assert_close, backward_tolerance, random, reference_attention


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def gradients(output, inputs, grad_output):
    return torch.autograd.grad(output, inputs, grad_output, allow_unused=True)


def check_gradients(got, expected, names, E, Lk, dtype=torch.float32):
    for g, e, name in zip(got, expected, names):
        if e is None:
            assert g is None, f"{name}: a gradient where the reference has none"
            continue
        tolerance = backward_tolerance(dtype, E, Lk, float(e.abs().max()))
        assert_close(g, e, tolerance, f"d{name}")


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.3),
    "bool mask": dict(mask="bool"),
    "float mask (bias)": dict(mask="float"),
    "broadcast float mask (Lq, Lk)": dict(mask="float2d"),
    "gqa": dict(kv_heads=2),
    "gqa + causal + bias": dict(kv_heads=1, mask="float"),
    "softcap + window": dict(softcap=1.0, window=(3, 2)),
    "alibi + bottom-right causal": dict(alibi=True, is_causal=True,
                                        causal_alignment="bottom_right"),
    "sinks": dict(sinks=True),
    "segment ids + prefix": dict(segment_ids=torch.tensor([0] * 5 + [1] * 6), prefix=2,
                                 is_causal=True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(2, 4, 11, 11, 16), (1, 4, 7, 19, 24)], ids=str)
def test_gradients_match_autograd_of_the_math_path(generator, name, shape):
    case = dict(CASES[name])
    B, H, Lq, Lk, E = shape
    kv_heads = case.pop("kv_heads", H)
    mask_kind = case.pop("mask", None)
    q = random(generator, B, H, Lq, E)
    k, v = random(generator, B, kv_heads, Lk, E), random(generator, B, kv_heads, Lk, E)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, H, Lq, Lk, generator=generator) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = random(generator, B, H, Lq, Lk)
    elif mask_kind == "float2d":
        mask = random(generator, Lq, Lk)
    if case.get("segment_ids") is not None and Lq != Lk:
        case["segment_ids"] = (case["segment_ids"][:Lq], torch.arange(Lk) % 2)
    sinks = random(generator, H) if case.pop("sinks", False) else None
    grad_output = random(generator, B, H, Lq, E)
    differentiable = [q, k, v] + ([mask] if mask is not None and mask.is_floating_point()
                                  else []) + ([sinks] if sinks is not None else [])
    ours = leaves(*differentiable)
    theirs = [t.detach().double().requires_grad_() for t in differentiable]

    def arguments(tensors):
        q, k, v, *rest = tensors
        m = rest.pop(0) if mask is not None and mask.is_floating_point() else mask
        s = rest.pop(0) if sinks is not None else None
        return q, k, v, m, s

    q1, k1, v1, m1, s1 = arguments(ours)
    out = attend.scaled_dot_product_attention(q1, k1, v1, m1, sinks=s1,
                                              enable_gqa=kv_heads != H, **case)
    q2, k2, v2, m2, s2 = arguments(theirs)
    expected, _ = reference_attention(q2, k2, v2, m2, sinks=s2, enable_gqa=kv_heads != H,
                                      **case)
    assert out.grad_fn is not None
    names = ["query", "key", "value", "mask", "sinks"][:len(ours)]
    if sinks is not None and len(ours) == 4:
        names = ["query", "key", "value", "sinks"]
    check_gradients(gradients(out, ours, grad_output), gradients(expected, theirs, grad_output),
                    names, E, Lk)


def test_dropout_gradients(generator):
    """With dropout the backward regenerates the forward's draw: the gradient equals autograd
    of P * Z / (1 - p) @ V with Z the draw the returned weights show."""
    B, H, L, E, p = 2, 3, 16, 8, 0.25
    q, k, v = (random(generator, B, H, L, E) for _ in range(3))
    grad_output = random(generator, B, H, L, E)
    ours = leaves(q, k, v)
    out, weights = attend.scaled_dot_product_attention(*ours, dropout_p=p, seed=11,
                                                       return_weights=True)
    assert not weights.requires_grad
    keep = (weights != 0).double()
    theirs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, probabilities = reference_attention(*theirs)
    expected = (probabilities * keep / (1 - p)) @ theirs[2]
    assert_close(out, expected, 1e-5, "output")
    check_gradients(gradients(out, ours, grad_output), gradients(expected, theirs, grad_output),
                    ["query", "key", "value"], E, L)


def test_gradients_are_deterministic(generator):
    """The same call gives the same gradient bits, at any thread count."""
    q, k, v = (random(generator, 2, 4, 150, 32) for _ in range(3))
    bias = random(generator, 150, 150)
    grad_output = random(generator, 2, 4, 150, 32)
    results = []
    for threads in (1, 2, 2, 3):
        tensors = leaves(q, k, v, bias)
        out = attend.scaled_dot_product_attention(*tensors, is_causal=False, dropout_p=0.1,
                                                  seed=5, num_threads=threads)
        results.append(gradients(out, tensors, grad_output))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_only_what_requires_grad_is_computed(generator):
    q, k, v = (random(generator, 1, 2, 5, 8) for _ in range(3))
    bias = random(generator, 5, 5)
    q.requires_grad_()
    out = attend.scaled_dot_product_attention(q, k, v, bias)
    (d_query,) = torch.autograd.grad(out.sum(), [q])
    assert d_query.shape == q.shape
    with torch.no_grad():
        assert attend.scaled_dot_product_attention(q, k, v).grad_fn is None


def test_listing_is_differentiable(generator):
    q, k, v = leaves(*(random(generator, 2, 5, 8) for _ in range(3)))
    mask = torch.tensor([1, 1, 1, 0, 1])
    out, _ = attend.attention(q, k, v, mask)
    theirs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _ = reference_attention(*theirs, keep=mask.bool())
    grad_output = random(generator, 2, 5, 8)
    check_gradients(gradients(out, [q, k, v], grad_output),
                    gradients(expected, theirs, grad_output), ["query", "key", "value"], 8, 5)


def test_half_precision_gradients(generator):
    """bfloat16 tensors get bfloat16 gradients, as close as bfloat16 rounding allows."""
    q, k, v = (random(generator, 1, 2, 9, 16, dtype=torch.bfloat16) for _ in range(3))
    grad_output = random(generator, 1, 2, 9, 16, dtype=torch.bfloat16)
    ours = leaves(q, k, v)
    out = attend.scaled_dot_product_attention(*ours, is_causal=True)
    theirs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _ = reference_attention(*theirs, is_causal=True)
    got = gradients(out, ours, grad_output)
    assert all(g.dtype == torch.bfloat16 for g in got)
    check_gradients(got, gradients(expected, theirs, grad_output.double()),
                    ["query", "key", "value"], 16, 9, dtype=torch.bfloat16)


def test_out_refused_with_gradients(generator):
    q = random(generator, 1, 2, 3, 4).requires_grad_()
    with pytest.raises(ValueError, match="out"):
        attend.scaled_dot_product_attention(q, q, q, out=torch.empty(1, 2, 3, 4))
