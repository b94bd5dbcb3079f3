"""attend.torch.install(): torch.nn.functional.scaled_dot_product_attention on attend, against
PyTorch 2's math path (conftest.reference_attention, float64) on PyTorch's own argument
combinations (bool and float masks, broadcast masks, is_causal, scale, enable_gqa, unbatched
inputs), gradients, dropout statistics; what attend does not take goes to the original (or,
before PyTorch 2, to sdpa_math)."""

import pytest
import torch

import attend
import attend.torch
from conftest import assert_close, backward_tolerance, forward_tolerance, random, \
    reference_attention

F = torch.nn.functional


@pytest.fixture(autouse=True)
def installed():
    before = getattr(F, "scaled_dot_product_attention", None)
    attend.torch.install()
    yield
    attend.torch.uninstall()
    assert getattr(F, "scaled_dot_product_attention", None) is before


def keep_first_key(mask):
    """Every query row keeps key 0, so that no row is fully masked (there PyTorch gives NaN
    and attend uniform weights, a documented difference)."""
    mask = mask.clone()
    mask[..., 0] = True
    return mask


# (name, query shape, key/value heads, mask kind and shape, is_causal, scale, enable_gqa);
# mask shapes broadcast against (N, H, L, S).
CASES = [
    ("plain", (2, 3, 5, 8), 3, None, False, None, False),
    ("causal-top-left", (2, 3, 5, 8), 3, None, True, None, False),
    ("causal-square", (1, 2, 6, 8), 2, None, True, None, False),
    ("scale", (2, 2, 4, 8), 2, None, False, 0.3, False),
    ("bool-LS", (2, 3, 5, 8), 3, ("bool", (5, 7)), False, None, False),
    ("bool-N1LS", (2, 3, 5, 8), 3, ("bool", (2, 1, 5, 7)), False, None, False),
    ("bool-N11S", (2, 3, 5, 8), 3, ("bool", (2, 1, 1, 7)), False, 0.5, False),
    ("float-NHLS", (2, 3, 5, 8), 3, ("float", (2, 3, 5, 7)), False, None, False),
    ("float-LS", (2, 3, 5, 8), 3, ("float", (5, 7)), False, None, False),
    ("gqa", (2, 4, 5, 8), 2, None, False, None, True),
    ("gqa-causal", (1, 6, 7, 16), 2, None, True, None, True),
    ("gqa-bool", (2, 4, 5, 8), 1, ("bool", (5, 7)), False, None, True),
    ("unbatched", (3, 5, 8), 3, ("bool", (5, 7)), False, None, False),
    ("unbatched-causal", (2, 5, 8), 2, None, True, 0.25, False),
]
S = 7


def case_inputs(generator, query_shape, kv_heads, mask, dtype=torch.float32):
    kv_shape = (*query_shape[:-3], kv_heads, S, query_shape[-1])
    q = random(generator, *query_shape, dtype=dtype)
    k = random(generator, *kv_shape, dtype=dtype)
    v = random(generator, *kv_shape, dtype=dtype)
    attn_mask = None
    if mask is not None:
        kind, shape = mask
        if kind == "bool":
            attn_mask = keep_first_key(torch.rand(shape, generator=generator) > 0.4)
        else:
            attn_mask = random(generator, *shape)
    return q, k, v, attn_mask


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_gradients(case, generator):
    _, query_shape, kv_heads, mask, is_causal, scale, gqa = case
    q, k, v, attn_mask = case_inputs(generator, query_shape, kv_heads, mask)
    routes = attend.torch.routes()
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                             scale=scale, enable_gqa=gqa)
    assert attend.torch.routes()["attend"] == routes["attend"] + 1
    expected, _ = reference_attention(q, k, v, attn_mask, is_causal=is_causal, scale=scale,
                                      enable_gqa=gqa)
    E = q.shape[-1]
    assert_close(out, expected, forward_tolerance(torch.float32, E, S, 1.0), "output")

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask_input = attn_mask.clone().requires_grad_() if float_mask else attn_mask
    out = F.scaled_dot_product_attention(*inputs, mask_input, 0.0, is_causal, scale=scale,
                                         enable_gqa=gqa)
    grad_output = random(generator, *out.shape)
    out.backward(grad_output)
    reference_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    reference_mask = attn_mask.double().requires_grad_() if float_mask else attn_mask
    expected, _ = reference_attention(*reference_inputs, reference_mask, is_causal=is_causal,
                                      scale=scale, enable_gqa=gqa)
    expected.backward(grad_output.double())
    tolerance = backward_tolerance(torch.float32, E, S, 1.0)
    for name, got, want in zip("qkv", inputs, reference_inputs):
        assert_close(got.grad, want.grad, tolerance, f"d{name}")
    if float_mask:
        assert_close(mask_input.grad, reference_mask.grad, tolerance, "d attn_mask")


def test_reduced_precision(generator):
    q, k, v, mask = case_inputs(generator, (2, 2, 5, 16), 2, ("bool", (5, 7)),
                                dtype=torch.bfloat16)
    out = F.scaled_dot_product_attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16
    expected, _ = reference_attention(q, k, v, mask)
    assert_close(out, expected, forward_tolerance(torch.bfloat16, 16, S, 1.0), "bfloat16")


def test_dropout_statistics():
    """q = k = 0: every weight 1/S; value = identity: the output is the weights after dropout,
    each 0 (probability p) or 1/(S (1 - p)). The fraction of zeros is within 5 sigma of p."""
    p, S_ = 0.3, 64
    q = torch.zeros(4, 4, 32, 8)
    k = torch.zeros(4, 4, S_, 8)
    v = torch.eye(S_).expand(4, 4, S_, S_)
    torch.manual_seed(1)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
    kept = out != 0
    n = out.numel()
    assert abs(1 - kept.double().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert_close(out[kept], torch.full((int(kept.sum()),), 1 / (S_ * (1 - p))),
                 4 * 2.0**-24 / S_, "kept weights")
    torch.manual_seed(1)  # torch's generator draws the seed: reproducible
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, dropout_p=p), out)


def test_what_attend_does_not_take_goes_to_the_original(generator):
    q, k, v, _ = case_inputs(generator, (1, 2, 4, 8), 2, None, dtype=torch.float64)
    routes = attend.torch.routes()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # float64
    assert attend.torch.routes()["original"] == routes["original"] + 1
    expected, _ = reference_attention(q, k, v, is_causal=True)
    assert_close(out, expected, 1e-12, "float64 through the original")

    class Traced(torch.Tensor):  # a subclass that dispatches through __torch_function__
        pass

    traced = q.float().as_subclass(Traced)
    F.scaled_dot_product_attention(traced, k.float(), v.float())
    assert attend.torch.routes()["original"] == routes["original"] + 2

    # attend's refusals become the original's answers (here: PyTorch's own refusal)
    mask = torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, is_causal=True)
    if attend.torch._original is None:  # PyTorch before 2.0: sdpa_math answers
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, k, v, unknown=1)


def test_sdpa_math_is_the_math_path(generator):
    q, k, v, mask = case_inputs(generator, (2, 4, 5, 8), 2, ("float", (2, 4, 5, 7)),
                                dtype=torch.float64)
    got = attend.torch.sdpa_math(q, k, v, mask, scale=0.7, enable_gqa=True)
    expected, _ = reference_attention(q, k, v, mask, scale=0.7, enable_gqa=True)
    assert_close(got, expected, 1e-12, "sdpa_math")


def test_install_uninstall_enabled():
    attend.torch.uninstall()
    before = getattr(F, "scaled_dot_product_attention", None)
    assert not attend.torch.installed()
    with attend.torch.enabled():
        assert F.scaled_dot_product_attention is attend.torch.scaled_dot_product_attention
        with attend.torch.enabled():
            pass
        assert attend.torch.installed()  # the inner block leaves it installed
        attend.torch.install()  # twice: harmless
    assert getattr(F, "scaled_dot_product_attention", None) is before
    attend.torch.install()
