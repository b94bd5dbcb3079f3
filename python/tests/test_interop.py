"""How arrays cross into attend and back: in place (no copies), outputs of the caller's kind,
out= written in caller memory; bad input as Python exceptions carrying attend's message;
threads and the GIL."""

import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

import attend
from attend import _attend
from conftest import assert_close, forward_tolerance, random, reference_attention


def expected_strides(array):
    if isinstance(array, torch.Tensor):
        return list(array.stride())
    return [s // array.itemsize for s in array.strides]


def address(array):
    return array.data_ptr() if isinstance(array, torch.Tensor) else \
        array.__array_interface__["data"][0]


class DLPackOnly:
    """An array library attend knows nothing of, speaking DLPack."""

    def __init__(self, tensor, device=(1, 0)):
        self.tensor, self.device = tensor, device

    def __dlpack__(self, stream=None):
        return self.tensor.__dlpack__()

    def __dlpack_device__(self):
        return self.device


@pytest.mark.parametrize("make", [
    lambda g: random(g, 2, 5, 3, 8).transpose(1, 2),          # (N, L, H, E) as (N, H, L, E)
    lambda g: random(g, 2, 3, 9, 8)[:, 1:, 2:7],               # sliced: an offset and strides
    lambda g: random(g, 1, 3, 1, 8).expand(2, 3, 4, 8),        # stride 0
    lambda g: random(g, 2, 5, 3, 8).numpy().transpose(0, 2, 1, 3),
    lambda g: random(g, 2, 3, 9, 8).numpy()[:, 1:, 2:7],
    lambda g: np.asfortranarray(random(g, 2, 3, 4, 8).numpy()),
], ids=["torch transposed", "torch sliced", "torch expanded", "numpy transposed",
        "numpy sliced", "numpy Fortran order"])
def test_inputs_are_read_in_place(generator, make):
    """attend's view of an array is the caller's memory with the caller's strides."""
    array = make(generator)
    data, shape, strides, dtype, kind = _attend.view_of(array, False)
    assert data == address(array)
    assert tuple(shape) == tuple(array.shape)
    assert strides == expected_strides(array)
    assert kind == ("torch" if isinstance(array, torch.Tensor) else "numpy")
    out = attend.scaled_dot_product_attention(array, array, array)
    assert type(out) is type(array)
    assert_close(out, reference_attention(array, array, array)[0], 1e-5)


def test_dlpack_objects_are_read_in_place(generator):
    tensor = random(generator, 2, 3, 4, 8)
    data, shape, strides, _, kind = _attend.view_of(DLPackOnly(tensor), False)
    assert (data, tuple(shape), kind) == (tensor.data_ptr(), (2, 3, 4, 8), "numpy")
    out = attend.scaled_dot_product_attention(DLPackOnly(tensor), DLPackOnly(tensor),
                                              DLPackOnly(tensor))
    assert isinstance(out, np.ndarray)  # results of an unknown kind come back as NumPy
    assert_close(out, reference_attention(tensor, tensor, tensor)[0], 1e-5)


def test_a_strided_numpy_input_is_not_copied(generator):
    """No Python-side copy of a 4 MiB strided input: NumPy's allocations during the call
    (traced by tracemalloc) stay far below its size."""
    x = random(generator, 1, 1024, 4, 3, 64).numpy()  # (N, L, H, qkv, E), 3 MiB
    q, k, v = (x[..., i, :].transpose(0, 2, 1, 3) for i in range(3))
    attend.scaled_dot_product_attention(q, k, v)  # warm up
    tracemalloc.start()
    attend.scaled_dot_product_attention(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < q.nbytes // 8, f"{peak} bytes allocated from Python for a {q.nbytes}-byte input"


def test_results_own_attends_memory(generator):
    q = random(generator, 1, 2, 3, 8)
    out = attend.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy())
    assert out.base is not None and out.flags.writeable  # a view of attend's tensor
    assert out.__array_interface__["data"][0] % 64 == 0  # attend's 64-byte aligned storage
    out_t = attend.scaled_dot_product_attention(q, q, q)
    assert out_t.data_ptr() % 64 == 0 and out_t.is_contiguous()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_is_written_in_caller_memory(generator, kind):
    """out= receives the output through its strides: (N, L, H, E) buffer written as
    (N, H, L, E), padding beside it untouched."""
    q, k, v = (random(generator, 2, 3, 5, 8) for _ in range(3))
    expected = attend.scaled_dot_product_attention(q, k, v, is_causal=True)
    buffer = torch.full((2, 5, 3, 10), 7.0)
    target = buffer[..., :8].transpose(1, 2)
    if kind == "numpy":
        q, k, v = q.numpy(), k.numpy(), v.numpy()
        buffer = buffer.numpy()
        target = buffer[..., :8].transpose(0, 2, 1, 3)
    result = attend.scaled_dot_product_attention(q, k, v, is_causal=True, out=target)
    assert result is target
    assert_close(target, expected, 0.0, "out")
    assert (buffer[..., 8:] == 7.0).all()


def fake_cuda(tensor):
    return DLPackOnly(tensor, device=(2, 0))


BAD_INPUTS = {
    "float64": (lambda q: q.double(), TypeError, "query: dtype float64 is not supported"),
    "int64 (numpy)": (lambda q: q.numpy().astype(np.int64), TypeError,
                      "query: dtype int64 is not supported"),
    "a list": (lambda q: q.tolist(), TypeError, "query: expected a NumPy array"),
    "CUDA (DLPack device 2)": (fake_cuda, ValueError, "query: data on cuda:0"),
    "a meta tensor": (lambda q: torch.empty(q.shape, device="meta"), ValueError,
                      "query: a tensor on meta"),
    "negative strides": (lambda q: q.numpy()[:, :, ::-1], ValueError,
                         "query: negative stride -8 in dimension 2"),
    "strides that are not whole elements": (
        lambda q: np.lib.stride_tricks.as_strided(np.zeros(200, np.float32), shape=(1, 2, 3, 8),
                                                  strides=(4, 4, 6, 4)),
        ValueError, "is not a whole number of 4-byte elements"),
    "big-endian": (lambda q: q.numpy().astype(">f4"), TypeError, "big-endian"),
    "a sparse tensor": (lambda q: q.to_sparse(), ValueError, "cannot be read in place"),
    "too many dimensions": (lambda q: np.zeros((1,) * 9 + (3, 8), np.float32), ValueError,
                            "9|11 dimensions"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_query(generator, name):
    make, error, message = BAD_INPUTS[name]
    q = random(generator, 1, 2, 3, 8)
    with pytest.raises(error, match=message) as raised:
        attend.scaled_dot_product_attention(make(q), q.numpy(), q.numpy())
    assert isinstance(raised.value, attend.Error)


def test_bad_arguments(generator):
    q, k = random(generator, 1, 2, 3, 8), random(generator, 1, 2, 5, 8)
    bad = {
        r"key \(1, 2, 5, 4\) does not match query": lambda: attend.scaled_dot_product_attention(
            q, k[..., :4], k[..., :4]),
        "attn_mask: dtype (torch.)?int64 is neither bool": lambda:
            attend.scaled_dot_product_attention(q, k, k, torch.ones(3, 5, dtype=torch.int64)),
        "mask .* does not broadcast": lambda: attend.scaled_dot_product_attention(
            q, k, k, torch.ones(4, 5, dtype=torch.bool)),
        "is_causal=True were both given": lambda: attend.scaled_dot_product_attention(
            q, k, k, torch.ones(3, 5, dtype=torch.bool), is_causal=True),
        "causal_alignment must be one of": lambda: attend.scaled_dot_product_attention(
            q, k, k, causal_alignment="middle"),
        "dropout must be in": lambda: attend.scaled_dot_product_attention(q, k, k,
                                                                          dropout_p=1.5),
        "window must be": lambda: attend.scaled_dot_product_attention(q, k, k, window=3),
        "sinks .* should have one value per head": lambda: attend.scaled_dot_product_attention(
            q, k, k, sinks=torch.zeros(3)),
        "output: dtype float16 should be float32": lambda: attend.scaled_dot_product_attention(
            q, k, k, out=torch.empty(1, 2, 3, 8, dtype=torch.float16)),
        "does not match the expected shape": lambda: attend.scaled_dot_product_attention(
            q, k, k, out=torch.empty(1, 2, 3, 7)),
        "overlaps the memory of query": lambda: attend.scaled_dot_product_attention(
            q, k, k, out=q),
        "out: a tensor that requires grad": lambda: attend.scaled_dot_product_attention(
            q, k, k, out=torch.empty(1, 2, 3, 8, requires_grad=True)),
    }
    for message, call in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    read_only = np.zeros((1, 2, 3, 8), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out: the array is read-only"):
        attend.scaled_dot_product_attention(q.numpy(), k.numpy(), k.numpy(), out=read_only)
    with pytest.raises(TypeError, match="dtype"):  # a TypeError, and an attend.Error
        attend.scaled_dot_product_attention(q.double(), k, k)


def test_threads_call_at_once(generator):
    """Eight Python threads calling attend at once get what calls one by one get."""
    problems = [tuple(random(generator, 2, 4, 33, 16) for _ in range(3)) for _ in range(8)]
    expected = [attend.scaled_dot_product_attention(*p, is_causal=True) for p in problems]
    results = [None] * len(problems)

    def work(i):
        for _ in range(20):
            results[i] = attend.scaled_dot_product_attention(*problems[i], is_causal=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, e) for r, e in zip(results, expected))


def test_the_gil_is_released_while_attend_computes(generator):
    """While one thread is inside a long attend call, the main thread keeps running Python:
    the longest pause it sees is a fraction of the call's duration."""
    q, k, v = (random(generator, 1, 2, 768, 64) for _ in range(3))
    duration = []

    def work():
        start = time.perf_counter()
        attend.scaled_dot_product_attention(q, k, v, backend="reference", num_threads=1)
        duration.append(time.perf_counter() - start)

    worker = threading.Thread(target=work)
    stamps = [time.perf_counter()]
    worker.start()
    while worker.is_alive():
        stamps.append(time.perf_counter())
    worker.join()
    longest_pause = max(b - a for a, b in zip(stamps, stamps[1:]))
    assert duration[0] > 0.05, "the call should be long enough to tell"
    assert longest_pause < duration[0] / 2, \
        f"main thread paused {longest_pause:.3f} s during a {duration[0]:.3f} s call"


def test_num_threads(generator):
    q, k, v = (random(generator, 2, 4, 200, 32) for _ in range(3))
    default = attend.get_num_threads()
    try:
        attend.set_num_threads(1)
        assert attend.get_num_threads() == 1
        one = attend.scaled_dot_product_attention(q, k, v)
        attend.set_num_threads(0)
        assert attend.get_num_threads() == default
    finally:
        attend.set_num_threads(0)
    two = attend.scaled_dot_product_attention(q, k, v, num_threads=2)
    assert torch.equal(one, two)
    with pytest.raises(ValueError, match="num_threads"):
        attend.set_num_threads(-1)


def test_the_comparison_can_fail(generator):
    """The tolerance check of these tests rejects an error twice its tolerance."""
    q, k, v = (random(generator, 1, 2, 6, 8) for _ in range(3))
    out = attend.scaled_dot_product_attention(q, k, v)
    expected = reference_attention(q, k, v)[0]
    tolerance = forward_tolerance(torch.float32, 8, 6, 1.0)
    assert_close(out, expected, tolerance)
    with pytest.raises(AssertionError, match=r"worst element \(0, 1, 2, 3\)"):
        perturbed = out.clone()
        perturbed[0, 1, 2, 3] += 2 * tolerance
        assert_close(perturbed, expected, tolerance)


def test_a_contiguous_torch_tensor_gets_row_major_strides(generator):
    """A torch tensor that is_contiguous() is read with the row-major strides of its shape
    (without calling stride()); torch calls a tensor contiguous whatever the strides of its
    dimensions of size 1, which address nothing: the view may differ from stride() there
    only, and the results are the same bits as on a fresh contiguous copy."""
    base = random(generator, 2, 1, 3, 8)
    stray = base.transpose(0, 1)  # (1, 2, 3, 8), strides (24, 24, 8, 1): contiguous
    assert stray.is_contiguous() and stray.stride()[0] != 48
    _, shape, strides, _, _ = _attend.view_of(stray, False)
    assert tuple(shape) == (1, 2, 3, 8) and strides == [48, 24, 8, 1]
    assert _attend.view_of(base, False)[2] == list(base.stride())
    copy = stray.contiguous()
    for q in (stray, copy):
        assert torch.equal(attend.scaled_dot_product_attention(q, q, q),
                           attend.scaled_dot_product_attention(copy, copy, copy))
    # zero elements and size-1 trailing dimensions: torch's contiguous strides
    for t in (torch.empty(0, 3), torch.empty(2, 0, 4), torch.empty(3, 1), torch.empty(1, 1)):
        assert _attend.view_of(t, False)[2] == list(t.contiguous().stride()), t.shape


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_every_protocol_reads_an_array_alike(generator, dtype):
    """An ndarray read from its fields, the same memory through the buffer protocol
    (memoryview), through DLPack and as a torch tensor: the same views, so the same bits;
    strided views included."""
    q, k, v = (random(generator, 2, 3, n, 8).numpy().astype(dtype) for n in (4, 6, 6))
    k = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # strided
    v = v[:, :, ::1, :]
    if dtype == np.float64:  # attend reads no float64: every route refuses it alike
        for wrap in (lambda a: a, memoryview, DLPackOnly, torch.from_numpy):
            with pytest.raises(TypeError, match="query: .*float64|query: dtype"):
                attend.scaled_dot_product_attention(wrap(q), k, v)
        return
    want = attend.scaled_dot_product_attention(q, k, v)
    for wrap in (memoryview, DLPackOnly, torch.from_numpy):
        got = attend.scaled_dot_product_attention(wrap(q), wrap(k), wrap(v))
        got = got.numpy() if isinstance(got, torch.Tensor) else got
        assert got.dtype == want.dtype and np.array_equal(got, want), wrap


def test_metadata_changed_in_place_is_read_again(generator):
    """Nothing about an array is remembered between calls: a shape or strides changed in place
    (ndarray.shape =, torch's transpose_, resize_, set_) is what the next call reads."""
    q, k, v = (random(generator, 1, 2, 6, 8) for _ in range(3))
    for make in (lambda t: t.numpy().copy(), lambda t: t.clone()):
        qa, ka, va = make(q), make(k), make(v)
        before = attend.scaled_dot_product_attention(qa, ka, va)
        if isinstance(qa, np.ndarray):
            qa.shape = (1, 2, 8, 6)  # the same memory, another shape
            ka.shape = va.shape = (1, 2, 8, 6)
        else:
            for t in (qa, ka, va):
                t.transpose_(2, 3)
        after = attend.scaled_dot_product_attention(qa, ka, va)
        assert after.shape == (1, 2, 8, 6) and before.shape == (1, 2, 6, 8)
        want = attend.scaled_dot_product_attention(*(np.array(a) for a in (qa, ka, va)))
        assert np.array_equal(np.asarray(after), want)
    t = q.clone()
    t.resize_(1, 2, 3, 8)
    assert attend.scaled_dot_product_attention(t, t, t).shape == (1, 2, 3, 8)
    t.set_(torch.ones(1, 1, 2, 4))
    assert torch.equal(attend.scaled_dot_product_attention(t, t, t), torch.ones(1, 1, 2, 4))
