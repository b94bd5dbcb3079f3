"""attend.scaled_dot_product_attention and attend.attention against PyTorch: PyTorch 1.13's
own torch.nn.functional._scaled_dot_product_attention where it has the argument, and the
float64 reference (PyTorch 2's math path, conftest.reference_attention) for the rest."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attend
from conftest import (assert_close, default_alibi_slopes, forward_tolerance, random,
                      reference_attention)

# (B, H, Lq, Lk, E, Ev): the phrase, odd sizes, more queries than keys, one query.
SHAPES = [(1, 8, 4, 4, 32, 32), (2, 3, 17, 33, 40, 24), (1, 2, 29, 13, 16, 16),
          (2, 4, 1, 70, 64, 64)]
MASKS = ["none", "bool (Lq, Lk)", "bool padding (B, 1, 1, Lk)", "bool (B, H, Lq, Lk)",
         "float (Lq, Lk)", "float -inf (B, 1, Lq, Lk)", "float (B, H, Lq, Lk)"]


def make_mask(kind, generator, B, H, Lq, Lk, dtype=torch.float32):
    """A PyTorch attn_mask; bool masks keep at least one key per query (a row with none is
    the one place where attend and PyTorch differ, tested on its own)."""
    if kind == "none":
        return None
    if kind.startswith("bool"):
        shape = {"bool (Lq, Lk)": (Lq, Lk), "bool padding (B, 1, 1, Lk)": (B, 1, 1, Lk),
                 "bool (B, H, Lq, Lk)": (B, H, Lq, Lk)}[kind]
        mask = torch.rand(shape, generator=generator) > 0.3
        mask[..., 0] = True
        return mask
    if kind == "float (Lq, Lk)":
        return random(generator, Lq, Lk, dtype=dtype)
    if kind == "float (B, H, Lq, Lk)":
        return random(generator, B, H, Lq, Lk, dtype=dtype) * 3
    mask = torch.zeros(B, 1, Lq, Lk, dtype=dtype)
    mask[torch.rand(B, 1, Lq, Lk, generator=generator) > 0.6] = float("-inf")
    mask[..., 0] = 0.0
    return mask


def check(query, key, value, expected, got, what="output"):
    magnitude = float(torch.as_tensor(np.asarray(value, dtype=np.float32)
                                      if isinstance(value, np.ndarray) else value.float())
                      .abs().max())
    tolerance = forward_tolerance(query.dtype, query.shape[-1], key.shape[-2], magnitude)
    assert_close(got, expected, tolerance, what)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_pytorch_1_13(generator, shape, mask_kind, is_causal):
    """Output and weights equal torch 1.13's _scaled_dot_product_attention (top-left causal,
    bool masks keep True, float masks are added), and the float64 reference."""
    B, H, Lq, Lk, E, Ev = shape
    if is_causal and (mask_kind != "none" or Lq > Lk):
        pytest.skip("PyTorch takes no mask with is_causal; Lq > Lk leaves rows with no key")
    q, k, v = random(generator, B, H, Lq, E), random(generator, B, H, Lk, E), \
        random(generator, B, H, Lk, Ev)
    mask = make_mask(mask_kind, generator, B, H, Lq, Lk)
    out, weights = attend.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal,
                                                       return_weights=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    torch_out, torch_weights = F._scaled_dot_product_attention(
        q, k, v, mask, need_attn_weights=True, is_causal=is_causal)
    check(q, k, v, torch_out, out, "output vs torch 1.13")
    assert_close(weights, torch_weights, 8 * (E + Lk) * 2.0**-24, "weights vs torch 1.13")
    expected, expected_weights = reference_attention(q, k, v, mask, is_causal=is_causal)
    check(q, k, v, expected, out, "output vs float64 reference")
    assert_close(weights, expected_weights, 8 * (E + Lk) * 2.0**-24, "weights vs reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "bool (B, H, Lq, Lk)", "float (Lq, Lk)"])
def test_dtypes(generator, dtype, mask_kind):
    """float16 and bfloat16 come back in their dtype, as close as their rounding allows; a
    float mask may have the query's dtype."""
    B, H, Lq, Lk, E = 2, 3, 9, 21, 24
    q, k, v = (random(generator, B, H, L, E, dtype=dtype) for L in (Lq, Lk, Lk))
    mask = make_mask(mask_kind, generator, B, H, Lq, Lk, dtype=dtype)
    out = attend.scaled_dot_product_attention(q, k, v, mask)
    assert out.dtype == dtype
    check(q, k, v, reference_attention(q, k, v, mask)[0], out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_in_numpy_out(generator, dtype):
    q, k, v = (random(generator, 2, 3, L, 16).numpy().astype(dtype) for L in (5, 7, 7))
    mask = np.random.default_rng(1).random((5, 7)) > 0.3
    mask[:, 0] = True
    out, weights = attend.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    assert isinstance(out, np.ndarray) and out.dtype == dtype
    assert isinstance(weights, np.ndarray) and weights.dtype == np.float32
    expected, expected_weights = reference_attention(q, k, v, torch.from_numpy(mask))
    check(q, k, v, expected, out)
    assert_close(weights, expected_weights, 1e-5, "weights")


@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 3), (2, 2, 3), (1, 2, 2, 3)], ids=str)
def test_batch_ranks(generator, batch_shape):
    q, k, v = (random(generator, *batch_shape, L, 8) for L in (6, 5, 5))
    out = attend.scaled_dot_product_attention(q, k, v, is_causal=False)
    check(q, k, v, reference_attention(q, k, v)[0], out)


@pytest.mark.parametrize("scale", [None, 0.05, 1.0, -0.3])
@pytest.mark.parametrize("is_causal", [False, True])
def test_scale(generator, scale, is_causal):
    """PyTorch 2's scale multiplies Q.K^T (1.13 has no such argument: the reference)."""
    q, k, v = (random(generator, 2, 4, L, 32) for L in (11, 11, 11))
    out = attend.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    check(q, k, v, reference_attention(q, k, v, is_causal=is_causal, scale=scale)[0], out)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("mask_kind", ["none", "bool (B, H, Lq, Lk)", "float (Lq, Lk)",
                                       "bool padding (B, 1, 1, Lk)"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_enable_gqa(generator, kv_heads, mask_kind, is_causal):
    """enable_gqa equals attention over K and V repeat_interleave'd to the query's heads."""
    if is_causal and mask_kind != "none":
        pytest.skip("PyTorch takes no mask with is_causal")
    B, H, Lq, Lk, E = 2, 8, 7, 12, 16
    q = random(generator, B, H, Lq, E)
    k, v = random(generator, B, kv_heads, Lk, E), random(generator, B, kv_heads, Lk, E)
    mask = make_mask(mask_kind, generator, B, H, Lq, Lk)
    out, weights = attend.scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, enable_gqa=True, return_weights=True)
    groups = H // kv_heads
    k_full, v_full = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    torch_out, torch_weights = F._scaled_dot_product_attention(
        q, k_full, v_full, mask, need_attn_weights=True, is_causal=is_causal)
    check(q, k, v, torch_out, out, "output vs torch 1.13 on repeat_interleave'd K, V")
    assert_close(weights, torch_weights, 1e-5, "weights")


def test_enable_gqa_numpy_and_bad_groups(generator):
    q = random(generator, 6, 3, 8).numpy()
    k = random(generator, 2, 5, 8).numpy()
    out = attend.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    expected = reference_attention(q, k, k, enable_gqa=True)[0]
    check(q, k, k, expected, out)
    k4 = random(generator, 4, 5, 8).numpy()
    with pytest.raises(ValueError, match="not a multiple"):
        attend.scaled_dot_product_attention(q, k4, k4, enable_gqa=True)
    # ALiBi and sinks count the query's heads: the same as K and V repeated per query head.
    k_full = np.repeat(k, 3, axis=0)  # query head h reads K/V head h // 3
    for extra in (dict(alibi=True), dict(sinks=np.linspace(-1, 1, 6, dtype=np.float32))):
        out = attend.scaled_dot_product_attention(q, k, k, enable_gqa=True, **extra)
        expected = attend.scaled_dot_product_attention(q, k_full, k_full, **extra)
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="batch dimension"):  # without enable_gqa
        attend.scaled_dot_product_attention(q, k, k)


EXTRAS = {
    "window": dict(window=(3, 1)),
    "window left only": dict(window=(2, None)),
    "causal + window": dict(is_causal=True, window=(4, None)),
    "alibi": dict(alibi=True),
    "alibi slopes": dict(alibi=torch.tensor([0.5, 0.25, 0.125, 1.0])),
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=torch.tensor([0.3, -1.0, 2.0, 0.0])),
    "segment ids": dict(segment_ids=torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])),
    "segment ids pair": dict(segment_ids=(torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 2]),
                                          torch.tensor([0, 1, 1, 1, 1, 1, 2, 2, 2, 2]))),
    "prefix + causal": dict(prefix=4, is_causal=True),
    "bottom-right causal": dict(is_causal=True, causal_alignment="bottom_right"),
    "everything": dict(is_causal=True, window=(5, None), alibi=True, softcap=2.0,
                       sinks=torch.tensor([0.3, -1.0, 2.0, 0.0]), prefix=2,
                       segment_ids=torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])),
}


@pytest.mark.parametrize("name", list(EXTRAS))
@pytest.mark.parametrize("mask_kind", ["none", "float (Lq, Lk)", "bool padding (B, 1, 1, Lk)"])
def test_score_rules(generator, name, mask_kind):
    """attend's extras against the reference's formulas, alone and with PyTorch's masks."""
    extras = dict(EXTRAS[name])
    is_causal = extras.pop("is_causal", False)
    if is_causal and mask_kind != "none":
        mask_kind = "none"
    B, H, L, E = 2, 4, 10, 16
    q, k, v = (random(generator, B, H, L, E) for _ in range(3))
    mask = make_mask(mask_kind, generator, B, H, L, L)
    out, weights = attend.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal,
                                                       return_weights=True, **extras)
    expected, expected_weights = reference_attention(q, k, v, mask, is_causal=is_causal,
                                                     **extras)
    check(q, k, v, expected, out)
    assert_close(weights, expected_weights, 1e-5, "weights")


def test_bottom_right_alignment_differs_from_top_left(generator):
    q, k, v = random(generator, 1, 2, 3, 8), random(generator, 1, 2, 6, 8), \
        random(generator, 1, 2, 6, 8)
    top = attend.scaled_dot_product_attention(q, k, v, is_causal=True)
    bottom = attend.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 causal_alignment="bottom_right")
    check(q, k, v, reference_attention(q, k, v, is_causal=True)[0], top)
    check(q, k, v, reference_attention(q, k, v, is_causal=True,
                                       causal_alignment="bottom_right")[0], bottom)
    assert not torch.allclose(top, bottom)


def test_fully_masked_rows(generator):
    """A query whose every key is excluded by a bool mask: PyTorch gives NaN, attend the
    listing's uniform weights (mean of V), or zeros with fully_masked_rows="zero". Every
    other row matches PyTorch."""
    q, k, v = (random(generator, 1, 2, 4, 8) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    out, weights = attend.scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    torch_out, _ = F._scaled_dot_product_attention(q, k, v, mask, need_attn_weights=True)
    assert torch.isnan(torch_out[:, :, 1]).all()
    assert_close(weights[:, :, 1], torch.full((1, 2, 4), 0.25), 1e-7, "uniform weights")
    assert_close(out[:, :, 1], v.mean(2), 1e-6, "mean of V")
    rows = [0, 2, 3]
    assert_close(out[:, :, rows], torch_out[:, :, rows], 1e-6, "other rows")
    zero = attend.scaled_dot_product_attention(q, k, v, mask, fully_masked_rows="zero")
    assert (zero[:, :, 1] == 0).all()
    assert_close(zero[:, :, rows], torch_out[:, :, rows], 1e-6, "other rows (zero)")
    # A float mask of -inf everywhere in a row gives NaN in both.
    bias = torch.zeros(4, 4)
    bias[1] = float("-inf")
    assert torch.isnan(attend.scaled_dot_product_attention(q, k, v, bias)[:, :, 1]).all()


def test_attention_is_the_listing(generator):
    """attend.attention(q, k, v, mask) is the seed listing: mask == 0 -> -1e9, returns
    (output, weights); any mask dtype."""
    q, k, v = (random(generator, 2, 3, 6, 8) for _ in range(3))
    for mask in [None, torch.rand(6, 6, generator=generator) > 0.4,
                 (torch.rand(2, 1, 6, 6, generator=generator) > 0.4).to(torch.int64),
                 (torch.rand(6, 6, generator=generator) > 0.4).float()]:
        out, weights = attend.attention(q, k, v, mask)
        d_k = q.size(-1)
        scores = q.double() @ k.double().transpose(-2, -1) / d_k**0.5
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = scores.softmax(-1)
        check(q, k, v, p_attn @ v.double(), out)
        assert_close(weights, p_attn, 1e-6, "weights")
    out, weights = attend.attention(q.numpy(), k.numpy(), v.numpy())
    assert isinstance(out, np.ndarray) and isinstance(weights, np.ndarray)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout(generator, p):
    """Dropout: each weight is zeroed with probability p, the rest scaled by 1/(1-p); the
    output is the dropped weights times V; a seed reproduces the draw, torch.manual_seed
    reproduces a call without one."""
    B, H, L, E = 2, 4, 64, 16
    q, k, v = (random(generator, B, H, L, E) for _ in range(3))
    plain = attend.scaled_dot_product_attention(q, k, v, return_weights=True)[1]
    out, weights = attend.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=7,
                                                       return_weights=True)
    kept = weights != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02
    assert_close(weights[kept], plain[kept] / (1 - p), 1e-5, "kept weights")
    assert_close(out, weights.double() @ v.double(), 1e-5, "output = dropped weights @ V")
    again = attend.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=7)
    assert torch.equal(again, out)
    other = attend.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=8)
    assert not torch.equal(other, out)
    torch.manual_seed(3)
    first = attend.scaled_dot_product_attention(q, k, v, dropout_p=p)
    torch.manual_seed(3)
    assert torch.equal(attend.scaled_dot_product_attention(q, k, v, dropout_p=p), first)
    listing_out, listing_weights = attend.attention(q, k, v, dropout=p, seed=7)
    assert torch.equal(listing_weights, weights) and torch.equal(listing_out, out)


def test_strided_inputs(generator):
    """(N, L, H, E) buffers read as (N, H, L, E) through strides; sliced and transposed
    views; a stride-0 (expanded) key."""
    x = random(generator, 2, 9, 4, 3, 16)  # (N, L, H, qkv, E)
    q, k, v = (x[..., i, :].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out = attend.scaled_dot_product_attention(q, k, v, is_causal=True)
    check(q, k, v, reference_attention(q, k, v, is_causal=True)[0], out)
    k_shared = random(generator, 2, 1, 9, 16).expand(2, 4, 9, 16)
    out = attend.scaled_dot_product_attention(q, k_shared, v)
    check(q, k, v, reference_attention(q, k_shared, v)[0], out)
    qn = np.asfortranarray(q.numpy())
    out = attend.scaled_dot_product_attention(qn, k.numpy(), v.numpy()[:, :, ::1, :])
    check(q, k, v, reference_attention(q, k, v)[0], out)


def test_every_backend_and_thread_count_agree(generator):
    q, k, v = (random(generator, 2, 3, 37, 24) for _ in range(3))
    mask = make_mask("bool (B, H, Lq, Lk)", generator, 2, 3, 37, 37)
    results = [attend.scaled_dot_product_attention(q, k, v, mask, num_threads=t)
               for t in (1, 2, 3)]
    assert all(torch.equal(results[0], r) for r in results[1:])
    reference = attend.scaled_dot_product_attention(q, k, v, mask, backend="reference")
    check(q, k, v, reference, results[0])


def test_argument_combinations_against_reference(generator):
    """A sweep over PyTorch's arguments together (mask kind x causal x scale x gqa x dtype),
    each against the float64 reference."""
    B, Hq, Lq, Lk, E = 1, 4, 6, 9, 8
    for mask_kind, is_causal, scale, kv_heads, dtype in itertools.product(
            ["none", "bool (B, H, Lq, Lk)", "float (B, H, Lq, Lk)"], [False, True],
            [None, 0.7], [4, 2], [torch.float32, torch.bfloat16]):
        if is_causal and mask_kind != "none":
            continue
        q = random(generator, B, Hq, Lq, E, dtype=dtype)
        k, v = (random(generator, B, kv_heads, Lk, E, dtype=dtype) for _ in range(2))
        mask = make_mask(mask_kind, generator, B, Hq, Lq, Lk, dtype=dtype)
        out = attend.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal,
                                                  scale=scale, enable_gqa=kv_heads != Hq)
        expected = reference_attention(q, k, v, mask, is_causal=is_causal, scale=scale,
                                       enable_gqa=kv_heads != Hq)[0]
        check(q, k, v, expected, out,
              f"output ({mask_kind}, causal {is_causal}, scale {scale}, Hkv {kv_heads}, "
              f"{dtype})")


def test_default_alibi_slopes_match_the_library():
    q = torch.zeros(1, 6, 1, 4)
    k = torch.zeros(1, 6, 2, 4)
    v = torch.stack([torch.zeros(6, 4), torch.ones(6, 4)], 1).unsqueeze(0)  # (1, 6, 2, 4)
    # One query (position 0, top-left) over keys 0 and 1: scores 0 and slope_h, so the weight
    # of key 1, and the output (V is 0 at key 0, 1 at key 1), is sigmoid(slope_h).
    out = attend.scaled_dot_product_attention(q, k, v, alibi=True)
    slopes = torch.tensor(default_alibi_slopes(6))
    assert_close(out[0, :, 0, 0], torch.sigmoid(slopes), 1e-6, "ALiBi slopes")


def test_compute_dtype(generator):
    """compute_dtype picks the products' precision: bfloat16 inputs in "float32" give the
    bits of the widened inputs; "bfloat16" rounds float32 inputs (an error where the CPU has
    no AVX512_BF16)."""
    q = random(generator, 2, 4, 40, 32)
    k = random(generator, 2, 4, 50, 32)
    v = random(generator, 2, 4, 50, 32)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    wide = attend.scaled_dot_product_attention(qb.float(), kb.float(), vb.float())
    forced = attend.scaled_dot_product_attention(qb, kb, vb, compute_dtype="float32")
    assert forced.dtype == torch.bfloat16
    assert torch.equal(forced, wide.bfloat16())
    path = attend.bf16_compute_path()
    if "no AVX512_BF16" in path or "capped below" in path:
        with pytest.raises(attend.Error, match="AVX512_BF16"):
            attend.scaled_dot_product_attention(q, k, v, compute_dtype="bfloat16")
        return
    rounded = attend.scaled_dot_product_attention(q, k, v, compute_dtype="bfloat16")
    if not path.startswith("bfloat16"):
        return  # the default takes float32 products on this CPU (Intel without AMX tiles)
    automatic = attend.scaled_dot_product_attention(qb, kb, vb)
    assert torch.equal(rounded.bfloat16(), automatic)
    assert not torch.equal(automatic, forced)
    with pytest.raises(attend.Error, match="compute_dtype"):
        attend.scaled_dot_product_attention(q, k, v, compute_dtype="half")
