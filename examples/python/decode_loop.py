"""A tiny decoder served through attend's paged KV cache by continuous batching, in NumPy.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/decode_loop.py \
        [--requests 32] [--concurrency 8] [--dtype float32|float16|bfloat16|int8|float8_e4m3|...]

Requests with seeded prompt and output lengths wait in a queue. Each step admits waiting
requests while fewer than --concurrency run and the cache has blocks for them, then runs one
forward pass over a packed batch that mixes the new requests' whole prompts (prefill) with one
token of every running request (decode): per layer the keys and values are appended to that
layer's cache (keys rotated by RoPE as they are written), and one cache.attend call computes
the whole batch. A request leaves, freeing its blocks, once it has its output. Prints the
generated tokens per second.

The model (random weights, seeded): token embedding (vocab 256, width W), per layer RMSNorm,
Q/K/V projections with H query heads and Hkv key/value heads of dimension D, RoPE on queries
and keys, causal attention over the cache, output projection, RMSNorm, a GELU MLP; logits
through the tied embedding, greedy decoding.
"""

import argparse
import time

import numpy as np

import attend


class TinyDecoder:
    """Weights and one paged KV cache per layer. Shapes: tokens (T,) int, x (T, W)."""

    def __init__(self, layers=2, width=128, heads=8, kv_heads=2, vocab=256, cache_blocks=256,
                 block_size=16, dtype="float32", seed=0):
        generator = np.random.default_rng(seed)

        def weight(rows, cols):
            return (generator.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.embedding = weight(vocab, width) * np.float32(np.sqrt(vocab / width))
        self.layers = [{
            "wq": weight(width, width), "wk": weight(width, kv_heads * self.head_dim),
            "wv": weight(width, kv_heads * self.head_dim), "wo": weight(width, width),
            "w1": weight(width, 4 * width), "w2": weight(4 * width, width),
        } for _ in range(layers)]
        self.caches = [attend.PagedKvCache(cache_blocks, block_size=block_size, kv_heads=kv_heads,
                                           head_dim=self.head_dim, dtype=dtype)
                       for _ in range(layers)]
        self.rope = attend.Rope()
        self.options = attend.ServingOptions(causal=True)

    def add_sequence(self):
        """A new sequence in every layer's cache; returns its ids, one per layer."""
        return [cache.add_sequence() for cache in self.caches]

    def remove_sequence(self, ids):
        for cache, id in zip(self.caches, ids):
            cache.remove_sequence(id)

    def free_blocks(self):
        return min(cache.free_blocks for cache in self.caches)

    def forward(self, sequences, tokens, lengths):
        """One packed step: sequences[s] (ids per layer) gets tokens[cu[s]:cu[s+1]], appended
        after its cached ones. Returns the logits of each sequence's last token (B, vocab)."""
        cu = attend.cu_seqlens(lengths)
        positions = np.concatenate([np.arange(self.caches[0].length(ids[0]),
                                              self.caches[0].length(ids[0]) + n)
                                    for ids, n in zip(sequences, lengths)]).astype(np.int32)
        total, d = len(tokens), self.head_dim
        x = self.embedding[tokens]
        for layer, (w, cache) in enumerate(zip(self.layers, self.caches)):
            ids = [s[layer] for s in sequences]
            h = rms_norm(x)
            q = (h @ w["wq"]).reshape(total, self.heads, d)
            k = (h @ w["wk"]).reshape(total, self.kv_heads, d)
            v = (h @ w["wv"]).reshape(total, self.kv_heads, d)
            self.rope.apply_at(q, positions)                  # queries rotated in place
            cache.append(ids, k, v, cu, rope=self.rope)       # keys rotated as they are stored
            attention = cache.attend(ids, q, cu, options=self.options)  # (total, H, D)
            x = x + attention.reshape(total, self.heads * d) @ w["wo"]
            x = x + gelu(rms_norm(x) @ w["w1"]) @ w["w2"]
        return rms_norm(x[cu[1:] - 1]) @ self.embedding.T


def rms_norm(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


def gelu(x):
    return np.float32(0.5) * x * (1 + np.tanh(np.float32(0.7978845608) *
                                              (x + np.float32(0.044715) * x * x * x)))


def serve(model, requests, concurrency):
    """Continuous batching of `requests` [(prompt tokens, output length)]. Returns the outputs
    (one token list per request), the generated token count and the steps taken."""
    block_size = model.caches[0].block_size
    waiting = list(range(len(requests)))
    running = {}  # request -> {"ids", "last", "output"}
    outputs = [None] * len(requests)
    reserved, generated, steps = 0, 0, 0

    def blocks_of(r):  # the blocks request r may fill by its end
        prompt, count = requests[r]
        return -(-(len(prompt) + count) // block_size)

    while waiting or running:
        admitted = []
        while waiting and len(running) + len(admitted) < concurrency and \
                reserved + blocks_of(waiting[0]) <= model.caches[0].num_blocks:
            r = waiting.pop(0)
            reserved += blocks_of(r)
            admitted.append(r)
        order = list(running) + admitted
        sequences, tokens, lengths = [], [], []
        for r in running:  # decodes: one token each
            sequences.append(running[r]["ids"])
            tokens.append([running[r]["last"]])
            lengths.append(1)
        for r in admitted:  # prefills: the whole prompt
            running[r] = {"ids": model.add_sequence(), "output": []}
            sequences.append(running[r]["ids"])
            tokens.append(requests[r][0])
            lengths.append(len(requests[r][0]))
        logits = model.forward(sequences, np.concatenate(tokens), lengths)
        steps += 1
        for r, row in zip(order, logits):
            state = running[r]
            state["last"] = int(np.argmax(row))
            state["output"].append(state["last"])
            generated += 1
            if len(state["output"]) == requests[r][1]:
                outputs[r] = state["output"]
                model.remove_sequence(state["ids"])
                reserved -= blocks_of(r)
                del running[r]
    return outputs, generated, steps


def make_requests(count, prompt_max, output_max, seed, vocab=256):
    generator = np.random.default_rng(seed)
    return [(generator.integers(0, vocab, generator.integers(1, prompt_max + 1)),
             int(generator.integers(1, output_max + 1))) for _ in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-max", type=int, default=64)
    parser.add_argument("--output-max", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    requests = make_requests(args.requests, args.prompt_max, args.output_max, args.seed)
    longest = max(len(p) + n for p, n in requests)
    model = TinyDecoder(layers=args.layers, width=args.width, block_size=args.block_size,
                        dtype=args.dtype, seed=args.seed,
                        cache_blocks=args.concurrency * -(-longest // args.block_size))
    start = time.perf_counter()
    outputs, generated, steps = serve(model, requests, args.concurrency)
    seconds = time.perf_counter() - start
    assert all(len(o) == n for o, (_, n) in zip(outputs, requests))
    assert model.free_blocks() == model.caches[0].num_blocks  # every block returned
    print(f"{len(requests)} requests, concurrency {args.concurrency}, cache {args.dtype}: "
          f"{generated} tokens in {steps} steps, {seconds:.3f} s, "
          f"{generated / seconds:.1f} tokens/s")


if __name__ == "__main__":
    main()
