"""SpatialSelfAttention, PatchEmbedding, the positional encodings and embeddings, and the
safetensors reader and writer, against PyTorch's equivalents."""

import math

import numpy as np
import pytest
import torch

import attend
from conftest import assert_close, random


def test_spatial_self_attention_matches_torch(generator):
    """x + MHA(GroupNorm(x)) over the H*W positions, as torch's modules compute it."""
    N, C, H, W, heads, groups = 2, 32, 5, 6, 4, 8
    block = attend.SpatialSelfAttention(C, heads, group_norm_groups=groups, seed=1)
    parameters = block.state_dict()
    parameters["norm.weight"][...] = np.linspace(0.5, 1.5, C, dtype=np.float32)
    parameters["norm.bias"][...] = np.linspace(-0.2, 0.2, C, dtype=np.float32)
    parameters["attention.in_proj_bias"][...] = 0.1
    norm = torch.nn.GroupNorm(groups, C, eps=1e-5).double()
    attention = torch.nn.MultiheadAttention(C, heads, batch_first=True).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(parameters["norm.weight"]))
        norm.bias.copy_(torch.from_numpy(parameters["norm.bias"]))
    attention.load_state_dict({name[len("attention."):]: torch.from_numpy(value)
                               for name, value in parameters.items()
                               if name.startswith("attention.")})
    x = random(generator, N, C, H, W)
    tokens = norm(x.double()).flatten(2).transpose(1, 2)
    expected = x.double() + attention(tokens, tokens, tokens, need_weights=False)[0] \
        .transpose(1, 2).reshape(N, C, H, W)
    with torch.no_grad():
        got = block(x)
    assert isinstance(got, torch.Tensor)
    assert_close(got, expected, 1e-5, "torch input")
    assert_close(block(x.numpy()), expected, 1e-5, "NumPy input")
    assert_close(block(x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)), expected, 1e-5,
                 "channels-last strides")
    with pytest.raises(ValueError, match="no gradient"):
        block(x.requires_grad_())


def test_patch_embedding_matches_conv2d(generator):
    N, C, Hi, Wi, p, D = 2, 3, 8, 12, 4, 16
    embed = attend.PatchEmbedding(C, p, D, image_size=(Hi, Wi), seed=2)
    parameters = embed.state_dict()
    assert parameters["projection.weight"].shape == (D, C, p, p)
    assert parameters["position_embeddings"].shape == (1 + (Hi // p) * (Wi // p), D)
    conv = torch.nn.Conv2d(C, D, p, stride=p).double()
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(parameters["projection.weight"]))
        conv.bias.copy_(torch.from_numpy(parameters["projection.bias"]))
    x = random(generator, N, C, Hi, Wi)
    patches = conv(x.double()).flatten(2).transpose(1, 2)
    cls = torch.from_numpy(parameters["class_token"]).double().expand(N, 1, D)
    expected = torch.cat([cls, patches], 1) + torch.from_numpy(parameters["position_embeddings"])
    assert_close(embed(x), expected, 1e-5, "tokens")
    plain = attend.PatchEmbedding(C, p, D, class_token=False, position_embeddings=False)
    assert plain(x.numpy()).shape == (N, (Hi // p) * (Wi // p), D)
    with pytest.raises(ValueError, match="image_size"):
        attend.PatchEmbedding(C, p, D)


def test_sinusoidal_positional_encoding():
    length, dim, offset = 7, 11, 3
    table = attend.sinusoidal_positional_encoding(length, dim, offset)
    assert isinstance(table, np.ndarray) and table.shape == (length, dim)
    expected = np.zeros((length, dim))
    for pos in range(length):
        for i in range(dim):
            angle = (pos + offset) / 10000 ** (2 * (i // 2) / dim)
            expected[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    assert_close(table, expected, 1e-7, "encoding")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_add_positional_encoding_in_place(generator, kind):
    x = random(generator, 3, 5, 2, 8)[:, :, 0, :]  # (N, L, d), strided
    before = x.clone()
    table = attend.sinusoidal_positional_encoding(5, 8)
    if kind == "numpy":
        x = x.numpy()
    attend.add_positional_encoding(x, table)
    assert_close(x, before + torch.from_numpy(table), 1e-7, "x + encoding")


def test_embeddings(generator):
    tokens = attend.TokenEmbedding(10, 6, seed=4)
    ids = torch.tensor([[1, 2, 9], [0, 0, 5]])
    assert_close(tokens(ids), torch.from_numpy(tokens.weight)[ids], 0.0, "token rows")
    assert isinstance(tokens(ids.numpy()), np.ndarray)
    with pytest.raises(ValueError, match="10"):
        tokens(torch.tensor([3, 10]))
    positions = attend.PositionEmbedding(16, 4, seed=5)
    assert_close(positions(3, offset=2), positions.weight[2:5], 0.0, "position rows")
    assert abs(float(positions.weight.std()) - 0.02) < 0.01


def test_safetensors_roundtrip(tmp_path, generator):
    tensors = {"a": random(generator, 2, 3), "b": random(generator, 4).numpy().astype(np.float16),
               "c": torch.arange(6).reshape(2, 3).t()}  # strided, int64
    path = tmp_path / "t.safetensors"
    attend.save_safetensors(path, tensors, {"note": "attend"})
    loaded, metadata = attend.load_safetensors(path)
    assert metadata == {"note": "attend"}
    assert_close(loaded["a"], tensors["a"], 0.0, "a")
    assert loaded["b"].dtype == np.float16
    assert (loaded["c"] == tensors["c"].numpy()).all()
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="t.safetensors"):
        attend.load_safetensors(path)


def test_module_state_dict_roundtrip(generator):
    block = attend.SpatialSelfAttention(16, 2, group_norm_groups=4)
    other = attend.SpatialSelfAttention(16, 2, group_norm_groups=4, seed=9)
    assert not np.array_equal(block.state_dict()["attention.in_proj_weight"],
                              other.state_dict()["attention.in_proj_weight"])
    other.load_state_dict({k: torch.from_numpy(v) for k, v in block.state_dict().items()})
    x = random(generator, 1, 16, 3, 3)
    assert_close(other(x), block(x), 0.0, "same parameters, same output")
    with pytest.raises(ValueError, match="state_dict is missing 'norm.bias'"):
        other.load_state_dict({})


NUMPY_ONLY = r"""
import sys
sys.modules["torch"] = None  # as if torch were not installed
import numpy as np
import attend

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 6, 8), dtype=np.float32) for _ in range(3))
out, weights = attend.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
assert isinstance(out, np.ndarray) and np.allclose(out, weights @ v, atol=1e-5)
mha = attend.MultiheadAttention(16, 4, batch_first=True, seed=1)
assert type(mha).__mro__[1].__name__ == "_PlainModule"
x = rng.standard_normal((2, 5, 16), dtype=np.float32)
padding = np.zeros((2, 5), bool)
padding[1, 4] = True
out, weights = mha(x, x, x, key_padding_mask=padding)
bias = np.where(padding, -np.inf, 0).astype(np.float32)  # the same mask, additive
out_float, weights_float = mha(x, x, x, key_padding_mask=bias)
assert np.allclose(out, out_float, atol=1e-5) and np.allclose(weights, weights_float, atol=1e-6)
state = mha.state_dict()
other = attend.MultiheadAttention(16, 4, batch_first=True, seed=2)
other.load_state_dict({name: np.array(value) for name, value in state.items()})
assert np.array_equal(other(x, x, x)[0], mha(x, x, x)[0])
print("ok")
"""


def test_numpy_only():
    """Without torch: the functions and a plain MultiheadAttention with NumPy parameters; the
    C++ module (bool masks) and the composed path (float masks) agree."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", NUMPY_ONLY], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
