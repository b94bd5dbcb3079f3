"""examples/python/decode_loop.py: it runs (briefly) and prints tokens/s with every block
returned, and its decoder through the paged cache, batched with other requests, gives the
logits of the same decoder recomputed densely over the whole sequence at every step."""

import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import attend
from conftest import EXAMPLES, load_example

EXAMPLE = EXAMPLES / "decode_loop.py"


@pytest.fixture(scope="module")
def example():
    return load_example("decode_loop")


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_script_runs_and_prints_tokens_per_second(dtype):
    package = pathlib.Path(attend.__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(EXAMPLE), "--requests", "6", "--concurrency", "3",
                          "--prompt-max", "20", "--output-max", "5", "--dtype", dtype],
                         capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(package), "OMP_NUM_THREADS": "1",
                              "OPENBLAS_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    assert re.fullmatch(rf"6 requests, concurrency 3, cache {dtype}: \d+ tokens in \d+ steps, "
                        r"[0-9.]+ s, [0-9.]+ tokens/s\n", run.stdout), run.stdout


def dense_logits(model, example, tokens):
    """The decoder over the whole sequence without a cache: attend's dense call, causal."""
    length, d = len(tokens), model.head_dim
    x = model.embedding[tokens]
    for w in model.layers:
        h = example.rms_norm(x)
        q = (h @ w["wq"]).reshape(length, model.heads, d).transpose(1, 0, 2).copy()
        k = (h @ w["wk"]).reshape(length, model.kv_heads, d).transpose(1, 0, 2).copy()
        v = (h @ w["wv"]).reshape(length, model.kv_heads, d).transpose(1, 0, 2)
        model.rope.apply(q)
        model.rope.apply(k)
        attention = attend.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                        enable_gqa=True)  # (H, L, D)
        x = x + attention.transpose(1, 0, 2).reshape(length, -1) @ w["wo"]
        x = x + example.gelu(example.rms_norm(x) @ w["w1"]) @ w["w2"]
    return example.rms_norm(x[-1:]) @ model.embedding.T


def test_cache_steps_equal_the_dense_decoder(example):
    model = example.TinyDecoder(layers=2, width=64, heads=4, kv_heads=2, cache_blocks=32,
                                block_size=4, seed=3)
    prompts = [np.arange(11) % 256, (np.arange(6) * 5) % 256]
    a, b = model.add_sequence(), model.add_sequence()
    history = [list(prompts[0]), list(prompts[1])]
    logits = model.forward([a, b], np.concatenate(prompts), [11, 6])
    for step in range(4):
        for s in range(2):
            want = dense_logits(model, example, np.array(history[s]))
            np.testing.assert_allclose(logits[s:s + 1], want, rtol=1e-4, atol=1e-4)
        nxt = [int(np.argmax(row)) for row in logits]
        for s in range(2):
            history[s].append(nxt[s])
        logits = model.forward([a, b], np.array(nxt), [1, 1])
    model.remove_sequence(a)
    model.remove_sequence(b)
    assert model.free_blocks() == 32
