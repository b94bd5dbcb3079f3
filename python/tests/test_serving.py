"""The serving bindings (attend.PagedKvCache, paged_attention, varlen_attention, Rope,
AttentionPlan) against C++ results bit for bit, and their refusals.

References are other C++ calls on the same problem, whose equality the C++ headers state:
varlen_attention is bitwise B dense calls (checked here against
attend.scaled_dot_product_attention per sequence); paged attention gives the dense call's
bits on the widened stored keys where the kernel does the same work (at most 2 queries per
sequence: the dense call's row groups; more than 16: the keys gathered, the dense call
itself), and float32 rounding apart in between. Stored keys are read back from the cache's
own memory (key_blocks, a NumPy view) and widened here the way the C++ does (bfloat16 bits
shifted, 8-bit floats decoded, scale·code in float32)."""

import threading
import time

import numpy as np
import pytest
import torch

import attend
from attend import _attend

FORMATS = ["float32", "float16", "bfloat16", "int8", "float8_e4m3", "float8_e5m2"]
HEADS, KV_HEADS, DIM = 4, 2, 16
CAUSAL = attend.ServingOptions(causal=True)


def rng(seed):
    return np.random.default_rng(seed)


def normal(shape, seed, dtype=np.float32):
    return rng(seed).standard_normal(shape).astype(dtype)


def e4m3_table():
    """The float32 value of each of the 256 E4M3 codes (1 sign, 4 exponent bits with bias 7,
    3 mantissa bits; no infinities, 0x7f and 0xff NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    value = np.where(exponent == 0, mantissa / 8 * 2.0**-6,
                     (1 + mantissa / 8) * 2.0**(exponent - 7.0))
    value = np.where((codes & 0x7f) == 0x7f, np.nan, value)
    return (sign * value).astype(np.float32)


def widen(codes, dtype):
    """The cache's stored values (bits as key_blocks shows them) as float32."""
    if dtype in ("float32", "float16"):
        return codes.astype(np.float32)
    if dtype == "bfloat16":
        return (codes.astype(np.uint32) << 16).view(np.float32)
    if dtype == "int8":
        return codes.astype(np.float32)
    if dtype == "float8_e4m3":
        return e4m3_table()[codes]
    if dtype == "float8_e5m2":  # the top byte of a float16
        return (codes.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    raise AssertionError(dtype)


def stored(cache, id):
    """Sequence id's kept keys and values (L, Hkv, D) as float32: what attention reads."""
    table, length, size = cache.block_table(id), cache.length(id), cache.block_size
    tokens = [t for t in range(length) if table[t // size] >= 0]
    where = ([table[t // size] for t in tokens], [t % size for t in tokens])
    k = widen(cache.key_blocks[where], cache.dtype)
    v = widen(cache.value_blocks[where], cache.dtype)
    if cache.key_scales is not None:  # scale·code, one float32 product
        k = cache.key_scales[where][..., None] * k
        v = cache.value_scales[where][..., None] * v
    return k, v


def dense(cache, ids, query, cu_q, options=CAUSAL):
    """varlen_attention on the sequences' widened stored keys."""
    kv = [stored(cache, i) for i in ids]
    keys = np.concatenate([k for k, _ in kv])
    values = np.concatenate([v for _, v in kv])
    cu_k = attend.cu_seqlens([len(k) for k, _ in kv])
    return attend.varlen_attention(query, keys, values, cu_q, cu_k, options=options)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_against_dense(cache, ids, q_lens, seed):
    """Each sequence's rows against the dense call: bitwise where the paths do the same work
    (more than 16 queries: the keys gathered, dequantized as `stored` does; at most 2 queries
    of an unquantized cache over more than 16 keys: the row groups read in place), float32
    rounding apart otherwise (quantized caches read in place fold the scale into the products;
    the dense call runs at most 16 keys in its short-key kernel)."""
    query = normal((sum(q_lens), HEADS, DIM), seed)
    cu_q = attend.cu_seqlens(q_lens)
    got = cache.attend(ids, query, cu_q, options=CAUSAL)
    want = dense(cache, ids, query, cu_q)
    quantized = cache.key_scales is not None
    short_keys = [cache.length(i) <= 16 for i in ids]
    for s, n in enumerate(q_lens):
        rows = slice(cu_q[s], cu_q[s + 1])
        if n > 16 or (n <= 2 and not quantized and not short_keys[s]):
            assert same_bits(got[rows], want[rows]), (s, np.abs(got[rows] - want[rows]).max())
        elif bf16_products_possible(cache, n) and not np.allclose(
                got[rows], want[rows], rtol=1e-5, atol=2e-6):
            # bfloat16 products (the grouped-query tiles where the CPU has AVX512_BF16:
            # boundary/operands.hpp, stored_kv_bf16_products): against the listing on the
            # queries rounded to bfloat16, each probability rounded to bfloat16 for P·V adds
            # at most 2^-8·max|v| (tests/error_model.hpp, paged_bf16_output_tolerance).
            want_bf16 = dense(cache, ids, round_bf16(query), cu_q)
            max_v = np.abs(stored(cache, ids[s])[1]).max()
            np.testing.assert_allclose(got[rows], want_bf16[rows], rtol=1e-5,
                                       atol=4 * 2**-8 * max_v + 2e-6)
        else:
            np.testing.assert_allclose(got[rows], want[rows], rtol=1e-5, atol=2e-6)


def round_bf16(x):
    """float32 x rounded to bfloat16 (nearest even), as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32)


def bf16_products_possible(cache, n):
    """Whether a paged call of n queries per sequence may run on bfloat16 products: int8,
    fp8 and bfloat16 caches, G·Lq >= 9 rows per K/V head with Lq <= 8 (AVX-512's grouped-query
    tiles), where the CPU has AVX512_BF16."""
    formats = ("int8", "float8_e4m3", "float8_e5m2", "bfloat16")
    return cache.dtype in formats and n <= 8 and n * (HEADS // KV_HEADS) >= 9


def test_varlen_is_bitwise_the_dense_calls():
    lengths_q, lengths_k = [3, 1, 20], [7, 5, 20]
    q = normal((24, HEADS, DIM), 1)
    k, v = normal((32, KV_HEADS, DIM), 2), normal((32, KV_HEADS, 8), 3)
    cu_q, cu_k = attend.cu_seqlens(lengths_q), attend.cu_seqlens(lengths_k)
    out, lse, _ = attend.varlen_attention(q, k, v, cu_q, cu_k, options=CAUSAL, logsumexp=True)
    assert out.shape == (24, HEADS, 8) and lse.shape == (24, HEADS)
    for s in range(3):
        rows_q, rows_k = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        # (L, H, D) -> (H, L, D) views; bottom-right causal as the serving call.
        want = attend.scaled_dot_product_attention(
            q[rows_q].transpose(1, 0, 2), k[rows_k].transpose(1, 0, 2),
            v[rows_k].transpose(1, 0, 2), is_causal=True, enable_gqa=True,
            causal_alignment="bottom_right")
        assert same_bits(out[rows_q].transpose(1, 0, 2), want), s


@pytest.mark.parametrize("dtype", FORMATS)
def test_every_cache_format_prefill_verify_decode(dtype):
    cache = attend.PagedKvCache(24, block_size=4, kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype)
    assert cache.dtype == dtype and cache.free_blocks == 24
    assert (cache.key_scales is not None) == (dtype in ("int8", "float8_e4m3", "float8_e5m2"))
    ids = [cache.add_sequence() for _ in range(3)]
    rope = attend.Rope()
    prompts = [20, 3, 18]
    key, value = normal((41, KV_HEADS, DIM), 10), normal((41, KV_HEADS, DIM), 11)
    cache.append(ids, key, value, attend.cu_seqlens(prompts), rope=rope)
    assert [cache.length(i) for i in ids] == prompts
    assert cache.free_blocks == 24 - (5 + 1 + 5)
    # Keys rotated at their positions, then stored: within the format's rounding of that.
    rotated = key.copy()
    rope.apply_at(rotated, np.concatenate([np.arange(n) for n in prompts]).astype(np.int32))
    k0, v0 = stored(cache, ids[0])
    tolerance = {"float32": 0, "float16": 2**-10, "bfloat16": 2**-7, "int8": 1 / 127,
                 "float8_e4m3": 2**-3, "float8_e5m2": 2**-2}[dtype]
    scale = np.abs(rotated[:20]).max(axis=-1, keepdims=True)
    assert np.all(np.abs(k0 - rotated[:20]) <= tolerance * scale + 1e-7)
    assert np.all(np.abs(v0 - value[:20]) <= tolerance * np.abs(value[:20]).max(-1, keepdims=True)
                  + 1e-7)
    # A prefill chunk (gathered keys) beside a verification of 2 (read in place).
    check_against_dense(cache, ids, [17, 2, 18], 12)
    # Decode steps, one call for the batch.
    for step in range(3):
        cache.append(ids, normal((3, KV_HEADS, DIM), 20 + step), normal((3, KV_HEADS, DIM), 30 + step),
                     attend.cu_seqlens([1, 1, 1]), rope=rope)
        check_against_dense(cache, ids, [1, 1, 1], 40 + step)
    # Speculative verification of 5 drafted tokens (in place, float32 rounding apart).
    cache.append(ids, normal((15, KV_HEADS, DIM), 50), normal((15, KV_HEADS, DIM), 51),
                 attend.cu_seqlens([5, 5, 5]))
    check_against_dense(cache, ids, [5, 5, 5], 52)


def test_half_precision_queries_against_a_half_cache():
    # torch bfloat16 / float16 queries of the cache's dtype: the dense call on the stored keys.
    for dtype, torch_dtype in [("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
        cache = attend.PagedKvCache(16, block_size=4, kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype)
        ids = [cache.add_sequence() for _ in range(2)]
        cache.append(ids, normal((27, KV_HEADS, DIM), 1), normal((27, KV_HEADS, DIM), 2),
                     attend.cu_seqlens([20, 7]))
        query = torch.from_numpy(normal((4, HEADS, DIM), 3)).to(torch_dtype)
        cu_q = attend.cu_seqlens([3, 1], like=query)
        got = cache.attend(ids, query, cu_q, options=CAUSAL)
        assert isinstance(got, torch.Tensor) and got.dtype == torch_dtype
        keys, values = zip(*(stored(cache, i) for i in ids))
        want = attend.varlen_attention(
            query, torch.from_numpy(np.concatenate(keys)).to(torch_dtype),
            torch.from_numpy(np.concatenate(values)).to(torch_dtype), cu_q,
            attend.cu_seqlens([20, 7], like=query), options=CAUSAL)
        assert torch.equal(got, want), dtype


def shuffled_blocks(lengths, block_size, seed, value_dim=8):
    """Caller-owned blocks (N, block_size, Hkv, D) holding sequences of `lengths` in shuffled
    blocks, the tables, and the sequences' keys and values packed."""
    generator = rng(seed)
    needed = [-(-n // block_size) for n in lengths]
    count = sum(needed) + 2
    order = generator.permutation(count)
    key_blocks = normal((count, block_size, KV_HEADS, DIM), seed + 1)
    value_blocks = normal((count, block_size, KV_HEADS, value_dim), seed + 2)
    tables = np.full((len(lengths), max(needed)), 0, dtype=np.int32)
    keys, values, at = [], [], 0
    for s, n in enumerate(lengths):
        tables[s, :needed[s]] = order[at:at + needed[s]]
        at += needed[s]
        rows = [(tables[s, t // block_size], t % block_size) for t in range(n)]
        keys += [key_blocks[b, r] for b, r in rows]
        values += [value_blocks[b, r] for b, r in rows]
    return key_blocks, value_blocks, tables, np.stack(keys), np.stack(values)


def test_paged_attention_over_caller_blocks():
    lengths, q_lens = [37, 5, 1, 60], [2, 1, 1, 20]
    kb, vb, tables, keys, values = shuffled_blocks(lengths, 4, 7)
    query = normal((24, HEADS, DIM), 8)
    cu_q, seq_lens = attend.cu_seqlens(q_lens), np.array(lengths, dtype=np.int32)
    options = attend.ServingOptions(causal=True, window=(9, 0), softcap=20.0)
    out = np.full((24, HEADS, 8), np.nan, dtype=np.float32)
    result = attend.paged_attention(query, cu_q, kb, vb, tables, seq_lens, out=out,
                                    options=options)
    assert result is out
    want = attend.varlen_attention(query, keys, values, cu_q, attend.cu_seqlens(lengths),
                                   options=options)
    assert same_bits(out, want)
    # torch tensors in and out: the same bits, the output written in place.
    t_out = torch.zeros(24, HEADS, 8)
    address = t_out.data_ptr()
    t_result = attend.paged_attention(*map(torch.from_numpy, (query, cu_q, kb, vb, tables,
                                                               seq_lens)),
                                      out=t_out, options=options)
    assert t_result is t_out and t_out.data_ptr() == address
    assert same_bits(t_out.numpy(), want)
    # Thread count does not change a bit.
    one = attend.paged_attention(query, cu_q, kb, vb, tables, seq_lens,
                                 options=attend.ServingOptions(causal=True, num_threads=1))
    two = attend.paged_attention(query, cu_q, kb, vb, tables, seq_lens,
                                 options=attend.ServingOptions(causal=True, num_threads=2))
    assert same_bits(one, two)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3", "float8_e5m2"])
def test_paged_attention_over_caller_quantized_blocks(dtype):
    """Caller blocks of a scaled format with their scales: PagedKvCache.attend's bits over the
    same storage; blocks without scales, or read as a format of another size, refused."""
    cache = attend.PagedKvCache(12, block_size=4, kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype)
    ids = [cache.add_sequence() for _ in range(2)]
    cache.append(ids, normal((19, KV_HEADS, DIM), 60), normal((19, KV_HEADS, DIM), 61),
                 attend.cu_seqlens([13, 6]))
    query, cu_q = normal((3, HEADS, DIM), 62), attend.cu_seqlens([2, 1])
    want = cache.attend(ids, query, cu_q, options=CAUSAL)
    tables = np.full((2, 4), -1, np.int32)
    for s, i in enumerate(ids):
        table = cache.block_table(i)
        tables[s, :len(table)] = table
    lens = np.array([13, 6], np.int32)
    kb, vb = cache.key_blocks, cache.value_blocks
    scales = dict(key_scales=cache.key_scales, value_scales=cache.value_scales)
    fmt = None if dtype == "int8" else dtype
    got = attend.paged_attention(query, cu_q, kb, vb, tables, lens, options=CAUSAL,
                                 kv_format=fmt, **scales)
    assert same_bits(got, want)
    with pytest.raises(attend.Error, match="needs key_scales"):
        attend.paged_attention(query, cu_q, kb, vb, tables, lens, kv_format=fmt,
                               value_scales=cache.value_scales)
    with pytest.raises(attend.Error, match="cannot be read as kv_format float16"):
        attend.paged_attention(query, cu_q, kb, vb, tables, lens, kv_format="float16", **scales)


def test_key_mass_and_logsumexp():
    lengths, q_lens = [9, 20], [3, 1]
    kb, vb, tables, keys, values = shuffled_blocks(lengths, 4, 17, value_dim=DIM)
    query = normal((4, HEADS, DIM), 18)
    cu_q = attend.cu_seqlens(q_lens)
    out, lse, mass = attend.paged_attention(query, cu_q, kb, vb, tables,
                                            np.array(lengths, np.int32), options=CAUSAL,
                                            logsumexp=True, key_mass=True)
    assert mass.shape == (2, tables.shape[1] * 4) and lse.shape == (4, HEADS)
    cu_k = attend.cu_seqlens(lengths)
    for s in range(2):
        q = query[cu_q[s]:cu_q[s + 1]].transpose(1, 0, 2)
        k = np.repeat(keys[cu_k[s]:cu_k[s + 1]].transpose(1, 0, 2), HEADS // KV_HEADS, axis=0)
        v = np.repeat(values[cu_k[s]:cu_k[s + 1]].transpose(1, 0, 2), HEADS // KV_HEADS, axis=0)
        lq, lk = q.shape[1], k.shape[1]
        visible = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq
        _, weights = attend.attention(q, k, v, np.broadcast_to(visible, (HEADS, lq, lk)))
        np.testing.assert_allclose(mass[s, :lk], weights.sum(axis=(0, 1)), atol=1e-5)
        assert np.all(mass[s, lk:] == 0)
        scores = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k) / np.sqrt(DIM)
        scores = np.where(visible, scores, -np.inf)
        want_lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + \
            scores.max(-1)
        np.testing.assert_allclose(lse[cu_q[s]:cu_q[s + 1]], want_lse.T, rtol=1e-5, atol=1e-5)


def test_bad_block_tables_lengths_and_dtypes_write_nothing():
    lengths, q_lens = [10, 6], [2, 1]
    kb, vb, tables, _, _ = shuffled_blocks(lengths, 4, 5)
    query = normal((3, HEADS, DIM), 6)
    cu_q = attend.cu_seqlens(q_lens)
    out = np.full((3, HEADS, 8), 7.0, dtype=np.float32)
    lse = np.full((3, HEADS), 7.0, dtype=np.float32)
    mass = np.full((2, tables.shape[1] * 4), 7.0, dtype=np.float32)

    def refused(tables, seq_lens, **changes):
        arguments = dict(query=query, cu_seqlens_q=cu_q, key_blocks=kb, value_blocks=vb,
                         block_tables=tables, seq_lens=seq_lens)
        arguments.update(changes)
        with pytest.raises(attend.Error) as error:
            attend.paged_attention(**arguments, out=out, logsumexp=lse, key_mass=mass)
        assert np.all(out == 7) and np.all(lse == 7) and np.all(mass == 7)
        return str(error.value)

    good = np.array(lengths, np.int32)
    widest = tables.shape[1]
    bad = tables.copy()
    bad[0, 1] = 1000
    assert f"sequence 0: block table entry 1 is 1000, outside [0, {len(kb)})" in refused(bad, good)
    bad[0, 1] = -5
    assert "entry 1 is -5" in refused(bad, good)
    bad[0, 1] = -1
    assert "only leading entries may be evicted" in refused(bad, good)
    bad[0, 1] = tables[1, 0]
    assert "listed twice" in refused(bad, good)
    assert "sequence 1: length 13 needs 4 blocks of 4 but the block table has " \
        f"{widest}" in refused(tables, np.array([10, 13], np.int32))
    assert "negative" in refused(tables, np.array([10, -1], np.int32))
    assert "sequence 1 has 1 queries but no cached keys" in \
        refused(tables, np.array([10, 0], np.int32))
    # Dtypes: attend.DTypeError (an attend.Error and a TypeError) with the C++ message.
    for name, array in [("cu_seqlens_q", cu_q.astype(np.int64)),
                        ("block_tables", tables.astype(np.float32)),
                        ("seq_lens", good.astype(np.int64))]:
        changes = {"cu_seqlens_q": array} if name == "cu_seqlens_q" else {}
        message = refused(array if name == "block_tables" else tables,
                          array if name == "seq_lens" else good, **changes)
        assert message.startswith(name) and "int32" in message, message
    message = refused(tables, good, query=query.astype(np.float64))
    assert "float64" in message
    # The good call goes through and writes.
    attend.paged_attention(query, cu_q, kb, vb, tables, good, out=out, logsumexp=lse,
                           key_mass=mass)
    assert np.all(out != 7)


def cache_state(cache):
    return (cache.key_blocks.tobytes(), cache.value_blocks.tobytes(), cache.free_blocks,
            None if cache.key_scales is None else cache.key_scales.tobytes())


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cache_refusals_write_nothing(dtype):
    cache = attend.PagedKvCache(4, block_size=4, kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype)
    ids = [cache.add_sequence(), cache.add_sequence()]
    cache.append(ids, normal((6, KV_HEADS, DIM), 1), normal((6, KV_HEADS, DIM), 2),
                 attend.cu_seqlens([5, 1]))
    before = cache_state(cache)
    query = normal((2, HEADS, DIM), 3)
    out = np.full((2, HEADS, DIM), 7.0, np.float32)

    def refused(call):
        with pytest.raises(attend.Error) as error:
            call()
        assert cache_state(cache) == before and [cache.length(i) for i in ids] == [5, 1]
        assert np.all(out == 7)
        return str(error.value)

    # 12 new tokens need 3 more blocks; 1 is free.
    message = refused(lambda: cache.append(ids, normal((12, KV_HEADS, DIM), 4),
                                           normal((12, KV_HEADS, DIM), 4),
                                           attend.cu_seqlens([6, 6])))
    assert "block" in message, message
    message = refused(lambda: cache.append(ids, np.ones((2, KV_HEADS, DIM), np.int32),
                                           np.ones((2, KV_HEADS, DIM), np.float32),
                                           attend.cu_seqlens([1, 1])))
    assert "should be floating" in message, message
    refused(lambda: cache.append(ids, normal((2, KV_HEADS, DIM + 1), 5),
                                 normal((2, KV_HEADS, DIM), 5), attend.cu_seqlens([1, 1])))
    refused(lambda: cache.attend([ids[0], 99], query, attend.cu_seqlens([1, 1]), out=out))
    refused(lambda: cache.attend(ids, query, attend.cu_seqlens([1, 1]).astype(np.int64),
                                 out=out))
    refused(lambda: cache.attend(ids, query, attend.cu_seqlens([1, 1]),
                                 out=np.zeros((2, HEADS, DIM), np.float64)))
    with pytest.raises(attend.DTypeError):
        attend.PagedKvCache(4, dtype="float64x")


def test_fork_copy_on_write_and_eviction():
    cache = attend.PagedKvCache(32, block_size=4, kv_heads=KV_HEADS, head_dim=DIM)
    parent = cache.add_sequence()
    cache.append([parent], normal((10, KV_HEADS, DIM), 1), normal((10, KV_HEADS, DIM), 2),
                 attend.cu_seqlens([10]))
    child = cache.fork(parent)
    assert cache.block_table(child) == cache.block_table(parent) and cache.free_blocks == 29
    query = normal((1, HEADS, DIM), 3)
    before = cache.attend([parent], query, attend.cu_seqlens([1]), options=CAUSAL)
    # The child's append copies the shared, partly filled last block.
    cache.append([child], normal((1, KV_HEADS, DIM), 4), normal((1, KV_HEADS, DIM), 5),
                 attend.cu_seqlens([1]))
    assert cache.block_table(child)[:2] == cache.block_table(parent)[:2]
    assert cache.block_table(child)[2] != cache.block_table(parent)[2]
    assert same_bits(cache.attend([parent], query, attend.cu_seqlens([1]), options=CAUSAL),
                     before)
    check_against_dense(cache, [parent, child], [1, 2], 6)
    # Sliding window: blocks no query of the window reads again are freed, results kept.
    window = attend.ServingOptions(causal=True, window=(4, 0))
    cache.append([child], normal((20, KV_HEADS, DIM), 7), normal((20, KV_HEADS, DIM), 8),
                 attend.cu_seqlens([20]))
    query = normal((1, HEADS, DIM), 9)
    kept = cache.attend([child], query, attend.cu_seqlens([1]), options=window)
    free = cache.free_blocks
    cache.evict_outside_window(child, 5)
    assert cache.free_blocks > free and cache.block_table(child)[0] == -1
    assert same_bits(cache.attend([child], query, attend.cu_seqlens([1]), options=window), kept)
    cache.remove_sequence(child)
    cache.remove_sequence(parent)
    assert cache.free_blocks == 32


def test_rope():
    x = normal((3, 5, 16), 1)  # (H, L, D)
    for interleaved in (False, True):
        for rotary_dim in (0, 8):
            rope = attend.Rope(base=500.0, interleaved=interleaved, rotary_dim=rotary_dim)
            got = x.copy()
            rope.apply(got, position_offset=7)
            r = rotary_dim or 16
            theta = 500.0 ** (-2 * np.arange(r // 2) / r)
            angle = (7 + np.arange(5))[:, None] * theta
            want = x.astype(np.float64)
            if interleaved:
                a, b = want[..., 0:r:2].copy(), want[..., 1:r:2].copy()
                want[..., 0:r:2] = a * np.cos(angle) - b * np.sin(angle)
                want[..., 1:r:2] = b * np.cos(angle) + a * np.sin(angle)
            else:
                a, b = want[..., :r // 2].copy(), want[..., r // 2:r].copy()
                want[..., :r // 2] = a * np.cos(angle) - b * np.sin(angle)
                want[..., r // 2:r] = b * np.cos(angle) + a * np.sin(angle)
            np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * np.abs(x).max())
            # The same rotation at explicit positions ((tokens, H, D): the transposed view).
            at = np.ascontiguousarray(x.transpose(1, 0, 2))
            rope.apply_at(at, np.arange(7, 12, dtype=np.int64))
            assert same_bits(at.transpose(1, 0, 2), got)
    # torch tensors rotate in place.
    t = torch.from_numpy(x.copy())
    attend.Rope().apply(t, 3)
    y = x.copy()
    attend.Rope().apply(y, 3)
    assert same_bits(t.numpy(), y)
    with pytest.raises(attend.Error):
        attend.Rope(rotary_dim=3).apply(x.copy())


def test_storage_views_are_the_cache_memory():
    cache = attend.PagedKvCache(4, block_size=2, kv_heads=1, head_dim=4, dtype="bfloat16")
    first, second = cache.key_blocks, cache.key_blocks
    assert first.dtype == np.uint16 and first.shape == (4, 2, 1, 4)
    assert _attend.view_of(first, False)[0] == _attend.view_of(second, False)[0]
    id = cache.add_sequence()
    cache.append([id], np.full((1, 1, 4), 1.5, np.float32), np.zeros((1, 1, 4), np.float32),
                 attend.cu_seqlens([1]))
    block = cache.block_table(id)[0]
    assert np.all(first[block, 0, 0] == 0x3fc0)  # bfloat16 1.5, seen through the old view
    del cache
    assert np.all(first[block, 0, 0] == 0x3fc0)  # the view keeps the cache alive


def test_plans_are_bitwise_the_unprepared_call():
    q, k, v = normal((2, HEADS, 1, DIM), 1), normal((2, HEADS, 40, DIM), 2), \
        normal((2, HEADS, 40, DIM), 3)
    out = np.zeros((2, HEADS, 1, DIM), np.float32)
    plan = attend.AttentionPlan(q, k, v, out, options=CAUSAL, variable_key_length=True)
    assert plan.prepared
    for length, seed in [(40, 4), (17, 5), (64, 6)]:
        q, k, v = normal(q.shape, seed), normal((2, HEADS, length, DIM), seed + 1), \
            normal((2, HEADS, length, DIM), seed + 2)
        plan.run(q, k, v, out)
        want = attend.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                   causal_alignment="bottom_right")
        assert same_bits(out, want), length
    # torch tensors, a layout that differs from the plan's: refused, out untouched.
    t_out = torch.zeros(2, HEADS, 1, DIM)
    plan.run(*map(torch.from_numpy, (q, k, v)), t_out)
    assert same_bits(t_out.numpy(), out)
    out[:] = 7
    with pytest.raises(attend.Error):
        plan.run(normal((2, HEADS, 2, DIM), 9), k, v, out)
    assert np.all(out == 7)
    fixed = attend.AttentionPlan(q, k, v, out)
    with pytest.raises(attend.Error):
        fixed.run(q, k[:, :, :10], v[:, :, :10], out)
    assert np.all(out == 7)
    lse = np.zeros((2, HEADS, 1), np.float32)
    with_lse = attend.AttentionPlan(q, k, v, out, need_logsumexp=True)
    with_lse.run(q, k, v, out, logsumexp=lse)
    assert np.all(lse != 0)


def test_bound_plans_read_the_arrays_as_they_are_now():
    q, k, v = (torch.from_numpy(normal((1, HEADS, n, DIM), seed)) for n, seed in
               [(1, 1), (30, 2), (30, 3)])
    out = torch.zeros(1, HEADS, 1, DIM)
    plan = attend.AttentionPlan(q, k, v, out)
    bound = plan.bind(q, k, v, out)
    for seed in (4, 5):
        q.copy_(torch.from_numpy(normal(tuple(q.shape), seed)))  # the loop rewrites in place
        bound()
        assert torch.equal(out, attend.scaled_dot_product_attention(q, k, v))
    # A tensor whose memory moved (set_ to new storage) is read again, not its old address.
    q.set_(torch.from_numpy(normal(tuple(q.shape), 6)))
    bound()
    assert torch.equal(out, attend.scaled_dot_product_attention(q, k, v))
    # NumPy arrays are held while bound: resize refuses (the plan's reference).
    qn, kn, vn, on = (t.numpy().copy() for t in (q, k, v, out))
    bound_numpy = plan.bind(qn, kn, vn, on)
    with pytest.raises(ValueError):
        qn.resize(2 * qn.size)
    bound_numpy()
    assert same_bits(on, out.numpy())
    wrong = plan.bind(qn, kn[:, :, :5], vn[:, :, :5], on)  # a layout other than the plan's
    on[:] = 7
    with pytest.raises(attend.Error):
        wrong()
    assert np.all(on == 7)


def test_the_gil_is_released_while_attend_works():
    cache = attend.PagedKvCache(300, block_size=16, kv_heads=4, head_dim=64)
    id = cache.add_sequence()
    cache.append([id], normal((4096, 4, 64), 1), normal((4096, 4, 64), 2),
                 attend.cu_seqlens([4096]))
    query = normal((512, 4, 64), 3)
    options = attend.ServingOptions(causal=True, num_threads=1)
    done, ticks = threading.Event(), []

    def work():
        cache.attend([id], query, attend.cu_seqlens([512]), options=options)
        done.set()

    worker = threading.Thread(target=work)
    started = time.perf_counter()
    worker.start()
    while not done.is_set():  # this thread runs Python while the worker is in C++
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    # Held, the GIL lets this thread tick about 3 times (before and after the call); released,
    # 30-60 here.
    assert len(ticks) >= 10, (len(ticks), time.perf_counter() - started)


def test_plan_run_takes_its_arguments_by_name_and_refuses_others():
    q, k, v = (normal((1, HEADS, n, DIM), seed) for n, seed in [(1, 1), (9, 2), (9, 3)])
    out, lse = np.zeros((1, HEADS, 1, DIM), np.float32), np.zeros((1, HEADS, 1), np.float32)
    plan = attend.AttentionPlan(q, k, v, out, need_logsumexp=True)
    plan.run(query=q, key=k, value=v, out=out, logsumexp=lse)
    want = out.copy()
    out[:] = 0
    plan.run(q, k, v, out, logsumexp=lse)
    assert same_bits(out, want)
    for bad in [lambda: plan.run(q, k, v), lambda: plan.run(q, k, v, out, lse),
                lambda: plan.run(q, k, v, out, logsumexp=lse, key=k),
                lambda: plan.run(q, k, v, out, log_sum_exp=lse),
                lambda: plan.bind(q, k, v, out)(out)]:
        with pytest.raises(TypeError):
            bad()
    with pytest.raises(TypeError):  # not an AttentionPlan
        attend.AttentionPlan.run(object(), q, k, v, out)
    # The plan's layout is checked on every call: an array reshaped in place is refused.
    q.shape = (1, HEADS, DIM, 1)
    out[:] = 7
    with pytest.raises(attend.Error):
        plan.run(q, k, v, out, logsumexp=lse)
    assert np.all(out == 7)
