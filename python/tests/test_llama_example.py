"""examples/python/llama_block.py (PyTorch 2 code: RoPE, enable_gqa, causal masks, a KV cache
as tensors) under attend.torch.enabled(), against the same block in float64 on PyTorch's math
path: a prompt (is_causal), a chunk after the cache (a bottom-right bool mask), decode steps
(no mask); parameter gradients of the prompt."""

import pytest
import torch

import attend.torch
from conftest import assert_close, load_example

U32 = 2.0**-24
DIM = 32


@pytest.fixture(scope="module")
def llama():
    return load_example("llama_block")


def tolerance(expected, length):
    """Two float32 blocks that differ in the order of the sums inside attention: a few
    roundings per term of the DIM- and length-term sums, relative to the magnitude."""
    return float(expected.abs().max()) * 64 * (DIM + length) * U32


def chunks(block, tokens):
    """tokens (N, 12, DIM) as a prompt of 6, a chunk of 3 after it and 3 single steps: the
    outputs of each call, concatenated along the sequence."""
    outputs, cache, start = [], None, 0
    for length in (6, 3, 1, 1, 1):
        positions = torch.arange(start, start + length)
        x, cache = block(tokens[:, start:start + length], positions, cache)
        outputs.append(x)
        start += length
    return torch.cat(outputs, dim=1)


def test_llama_block_matches_the_math_path(llama):
    torch.manual_seed(11)
    block = llama.Block(dim=DIM, heads=4, kv_heads=2)
    tokens = torch.randn(2, 12, DIM)
    routes = attend.torch.routes()["attend"]
    with torch.no_grad():
        with attend.torch.enabled():
            got = chunks(block, tokens)
        assert attend.torch.routes()["attend"] == routes + 5
        reference = llama.Block(dim=DIM, heads=4, kv_heads=2).double()
        reference.load_state_dict(block.state_dict())
        expected = llama.on_math_path(chunks, reference, tokens.double())
    assert_close(got, expected, tolerance(expected, 12), "block outputs")


def test_llama_block_gradients(llama):
    torch.manual_seed(12)
    block = llama.Block(dim=DIM, heads=4, kv_heads=2)
    reference = llama.Block(dim=DIM, heads=4, kv_heads=2).double()
    reference.load_state_dict(block.state_dict())
    tokens = torch.randn(2, 8, DIM)
    weights = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(3))
    with attend.torch.enabled():
        (block(tokens, torch.arange(8))[0] * weights).sum().backward()
    llama.on_math_path(
        lambda: (reference(tokens.double(), torch.arange(8))[0] * weights).sum().backward())
    expected = dict(reference.named_parameters())
    for name, p in block.named_parameters():
        assert_close(p.grad, expected[name].grad, tolerance(expected[name].grad, 8),
                     f"gradient of {name}")
