"""Property-based tests (Hypothesis, Debian's python3-hypothesis): attend.scaled_dot_product_attention
on drawn shapes, strides, masks, dtypes and options either matches PyTorch's math path (the
float64 listing of conftest.reference_attention) within the error model, or raises
attend.Error / attend.DTypeError; it never crashes, raises anything else, or returns NaN where
the listing has none. Arguments that must be refused (a head dimension that differs between
query and key) are drawn too, and must raise attend.Error.

CI runs a fixed number of examples, derandomized (the "ci" profile); the soak runs many more:
ATTEND_HYPOTHESIS_PROFILE=soak (scripts/soak.sh)."""

import math
import os

import pytest
import torch

# Skipped where Hypothesis is not installed, except in CI (scripts/test.sh sets
# ATTEND_REQUIRE_HYPOTHESIS=1), where a missing package must fail the test, not pass it unrun.
if os.environ.get("ATTEND_REQUIRE_HYPOTHESIS") == "1":
    import hypothesis  # noqa: F401
else:
    hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attend  # noqa: E402
from conftest import forward_tolerance, reference_attention  # noqa: E402

settings.register_profile("ci", max_examples=300, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], database=None)
settings.register_profile("soak", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], database=None)
settings.load_profile(os.environ.get("ATTEND_HYPOTHESIS_PROFILE", "ci"))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def problems(draw):
    """One call's arguments: (query, key, value, kwargs, refused), refused when the
    arguments are wrong on purpose."""
    dtype = draw(st.sampled_from(DTYPES))
    outer = draw(st.lists(st.integers(1, 2), min_size=0, max_size=1))
    kv_heads = draw(st.integers(1, 3))
    gqa = draw(st.booleans())
    heads = kv_heads * (draw(st.integers(2, 3)) if gqa else 1)
    lq, lk = draw(st.integers(0, 24)), draw(st.integers(0, 40))
    e, ev = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    layout = draw(st.sampled_from(["contiguous", "blhd", "strided"]))
    seed = draw(st.integers(0, 2**31 - 1))
    refused = draw(st.integers(0, 9)) == 0  # one in ten: key with another head dimension
    generator = torch.Generator().manual_seed(seed)

    def tensor(h, length, width):
        """(outer..., h, length, width) of `dtype` in the drawn layout."""
        shape = [*outer, h, length, width]
        if layout == "blhd":  # stored (outer..., length, h, width)
            t = torch.randn(*outer, length, h, width, generator=generator)
            t = t.transpose(-3, -2)
        elif layout == "strided":  # every other element of the last two dimensions
            t = torch.randn(*outer, h, 2 * length, 2 * width, generator=generator)
            t = t[..., ::2, ::2]
        else:
            t = torch.randn(*shape, generator=generator)
        return t.to(dtype)

    query = tensor(heads, lq, e)
    key = tensor(kv_heads, lk, e + 1 if refused else e)
    value = tensor(kv_heads, lk, ev)
    kwargs = {}
    mask = draw(st.sampled_from(["none", "none", "bool", "float", "causal"]))
    if mask == "bool":
        shape = draw(st.sampled_from([(lq, lk), (1, lk), (heads, lq, lk)]))
        kwargs["attn_mask"] = torch.rand(*shape, generator=generator) < 0.7
    elif mask == "float":
        kwargs["attn_mask"] = torch.randn(lq, lk, generator=generator).to(dtype)
    elif mask == "causal":
        kwargs["is_causal"] = True
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.05, 2.0))
    if gqa:
        kwargs["enable_gqa"] = True
    if draw(st.integers(0, 3)) == 0:
        kwargs["num_threads"] = draw(st.integers(1, 4))
    return query, key, value, kwargs, refused


@given(problems())
def test_matches_the_math_path_or_refuses(problem):
    query, key, value, kwargs, refused = problem
    try:
        got = attend.scaled_dot_product_attention(query, key, value, **kwargs)
    except (attend.Error, attend.DTypeError) as e:
        assert str(e), "an attend error without a message"
        event("refused" + (" (wrong on purpose)" if refused else f": {str(e)[:60]}"))
        return  # refused with attend's own error: allowed (and required when `refused`)
    assert not refused, "a key of another head dimension was accepted"
    reference_kwargs = {k: v for k, v in kwargs.items() if k != "num_threads"}
    expected, _ = reference_attention(query, key, value, **reference_kwargs)
    assert got.dtype == query.dtype and tuple(got.shape) == tuple(expected.shape)
    got64 = got.to(torch.float64)
    assert not torch.isnan(got64).any() or torch.isnan(expected).any(), \
        "NaN where the math path has none"
    if got.numel() == 0:
        event("empty result")
        return
    event(f"compared with the math path ({query.dtype})")
    magnitude = float(value.to(torch.float64).abs().max()) if value.numel() else 0.0
    tolerance = forward_tolerance(query.dtype, query.shape[-1], key.shape[-2], magnitude)
    if query.dtype == torch.bfloat16:
        # bfloat16 products round each weight to bfloat16 before weights @ V (2^-9 relative).
        tolerance += 2 * 2.0**-9 * magnitude
    error = float((got64 - expected).abs().max())
    assert error <= tolerance, f"error {error:.3g} above the tolerance {tolerance:.3g}"


def test_the_profile_is_bounded():
    """CI's profile is a fixed count of derandomized examples (no time-based budget)."""
    profile = settings.get_profile(os.environ.get("ATTEND_HYPOTHESIS_PROFILE", "ci"))
    assert profile.max_examples < math.inf and profile.deadline is None
