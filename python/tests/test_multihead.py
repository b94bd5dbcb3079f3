"""attend.MultiheadAttention against torch.nn.MultiheadAttention (PyTorch 1.13, float64 copy
of the same parameters): outputs, weights, input and parameter gradients, masks of either
polarity and kind, both layouts; construction from a module, a state dict or safetensors."""

import itertools

import numpy as np
import pytest
import torch

import attend
from conftest import assert_close

E, HEADS = 32, 4


def torch_module(generator, kdim=None, vdim=None, bias=True, batch_first=False):
    torch.manual_seed(int(torch.randint(0, 1000, (1,), generator=generator)))
    module = torch.nn.MultiheadAttention(E, HEADS, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=batch_first)
    with torch.no_grad():  # non-zero biases, so that they are tested
        for name, p in module.named_parameters():
            if "bias" in name:
                p.uniform_(-0.5, 0.5)
    return module.eval()


def canonical_mask(key_padding_mask, attn_mask, N, L, S):
    """PyTorch 2's merge of both masks into one float (N*H, L, S) mask: bool True -> -inf,
    float added. PyTorch 1.13 takes this one mask in all the cases it takes."""
    total = torch.zeros(N * HEADS, L, S, dtype=torch.float64)
    for mask, expand in ((key_padding_mask, lambda m: m.reshape(N, 1, 1, S)
                          .expand(N, HEADS, L, S).reshape(N * HEADS, L, S)),
                         (attn_mask, lambda m: m.expand(N * HEADS, L, S))):
        if mask is None:
            continue
        mask = expand(mask)
        total = total.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool \
            else total + mask.double()
    return total


def expected_forward(module, query, key, value, key_padding_mask=None, attn_mask=None,
                     need_weights=True, average_attn_weights=True):
    """torch's module in float64, its masks merged as PyTorch 2 merges them."""
    reference = torch.nn.MultiheadAttention(E, HEADS, bias=module.in_proj_bias is not None,
                                            kdim=module.kdim, vdim=module.vdim,
                                            batch_first=module.batch_first).double().eval()
    reference.load_state_dict(module.state_dict())
    batched = query.dim() == 3
    N = query.shape[0 if module.batch_first else 1] if batched else 1
    L = query.shape[-2 if not (batched and not module.batch_first) else 0]
    S = key.shape[-2 if not (batched and not module.batch_first) else 0]
    mask = None
    if key_padding_mask is not None or attn_mask is not None:
        mask = canonical_mask(key_padding_mask, attn_mask, N, L, S)
        if not batched:
            mask = mask[:HEADS]
    output, weights = reference(query.double(), key.double(), value.double(),
                                attn_mask=mask, need_weights=need_weights,
                                average_attn_weights=average_attn_weights)
    return output, weights


def inputs(generator, kind, N, L, S, kdim, vdim, batch_first):
    def make(length, features):
        shape = (N, length, features) if batch_first else (length, N, features)
        return torch.rand(shape, generator=generator) * 2 - 1
    query = make(L, E)
    if kind == "self":
        return query, query, query
    memory = make(S, kdim or E)
    if kind == "memory":
        return query, memory, memory
    return query, memory, make(S, vdim or E)


def mask_pair(generator, kind, N, L, S):
    """(key_padding_mask, attn_mask) with PyTorch's polarity; every query keeps key 0."""
    padding = torch.rand(N, S, generator=generator) > 0.7
    padding[:, 0] = False
    pair = torch.rand(L, S, generator=generator) > 0.7
    pair[:, 0] = False
    per_head = torch.rand(N * HEADS, L, S, generator=generator) > 0.7
    per_head[..., 0] = False
    return {
        "none": (None, None),
        "padding": (padding, None),
        "pair": (None, pair),
        "padding + per-head": (padding, per_head),
        "float padding": (torch.zeros(N, S).masked_fill(padding, float("-inf")), None),
        "float pair": (None, torch.rand(L, S, generator=generator) - 0.5),
        "float + bool": (padding, torch.rand(N * HEADS, L, S, generator=generator) - 0.5),
        "both float": (torch.rand(N, S, generator=generator), torch.rand(L, S,
                                                                         generator=generator)),
    }[kind]


MASK_KINDS = ["none", "padding", "pair", "padding + per-head", "float padding", "float pair",
              "float + bool", "both float"]


@pytest.mark.parametrize("masks", MASK_KINDS)
@pytest.mark.parametrize("kind", ["self", "memory", "separate"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_forward_matches_torch(generator, masks, kind, batch_first):
    N, L, S = 2, 5, 5 if kind == "self" else 7
    kdim = vdim = None if kind != "separate" else 24
    module = torch_module(generator, kdim, vdim, batch_first=batch_first)
    ours = attend.MultiheadAttention.from_torch(module)
    query, key, value = inputs(generator, kind, N, L, S, kdim, vdim, batch_first)
    padding, attn = mask_pair(generator, masks, N, L, S)
    for need_weights, average in [(True, True), (True, False), (False, True)]:
        with torch.no_grad():
            out, weights = ours(query, key, value, key_padding_mask=padding, attn_mask=attn,
                                need_weights=need_weights, average_attn_weights=average)
        expected, expected_weights = expected_forward(module, query, key, value, padding, attn,
                                                      need_weights, average)
        assert out.shape == expected.shape
        assert_close(out, expected, 2e-5, f"output ({masks}, {kind})")
        if need_weights:
            assert_close(weights, expected_weights, 2e-6, "weights")
        else:
            assert weights is None


def test_bias_free_unbatched_and_numpy(generator):
    module = torch_module(generator, bias=False)
    ours = attend.MultiheadAttention.from_torch(module)
    assert ours.in_proj_bias is None and ours.out_proj.bias is None
    x = torch.rand(6, E, generator=generator)
    padding = torch.tensor([False, False, True, False, False, True])
    out, weights = ours(x, x, x, key_padding_mask=padding)
    expected, expected_weights = expected_forward(module, x, x, x, padding)
    assert_close(out, expected, 2e-5, "unbatched output")
    assert_close(weights, expected_weights, 2e-6, "unbatched weights")
    out_np, weights_np = ours(x.numpy(), x.numpy(), x.numpy(), key_padding_mask=padding.numpy())
    assert isinstance(out_np, np.ndarray) and isinstance(weights_np, np.ndarray)
    assert_close(out_np, expected, 2e-5, "NumPy output")


def test_is_causal(generator):
    """is_causal without attn_mask: the lower triangle (PyTorch 2 needs the mask as well, and
    then uses the mask, as attend does)."""
    module = torch_module(generator, batch_first=True)
    ours = attend.MultiheadAttention.from_torch(module)
    x = torch.rand(2, 6, E, generator=generator)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    expected, expected_weights = expected_forward(module, x, x, x, attn_mask=causal)
    for attn_mask in (None, causal):
        with torch.no_grad():
            out, weights = ours(x, x, x, attn_mask=attn_mask, is_causal=True)
        assert_close(out, expected, 2e-5, "causal output")
        assert_close(weights, expected_weights, 2e-6, "causal weights")


@pytest.mark.parametrize("masks", ["none", "padding + per-head", "float + bool"])
@pytest.mark.parametrize("kind", ["self", "memory", "separate"])
def test_gradients_match_torch(generator, masks, kind):
    """Input and parameter gradients equal torch autograd of torch's module (float64)."""
    N, L, S = 2, 5, 5 if kind == "self" else 6
    kdim = vdim = None if kind != "separate" else 24
    module = torch_module(generator, kdim, vdim)
    ours = attend.MultiheadAttention.from_torch(module)
    reference = torch.nn.MultiheadAttention(E, HEADS, kdim=kdim, vdim=vdim).double()
    reference.load_state_dict(module.state_dict())
    query, key, value = inputs(generator, kind, N, L, S, kdim, vdim, False)
    padding, attn = mask_pair(generator, masks, N, L, S)
    grad_output = torch.rand(L, N, E, generator=generator)

    distinct = list({id(t): t for t in (query, key, value)}.values())
    ours_inputs = [t.clone().requires_grad_() for t in distinct]
    theirs_inputs = [t.double().requires_grad_() for t in distinct]

    def pick(tensors):
        by_id = {id(t): i for i, t in enumerate(distinct)}
        return [tensors[by_id[id(t)]] for t in (query, key, value)]

    out, _ = ours(*pick(ours_inputs), key_padding_mask=padding, attn_mask=attn,
                  need_weights=False)
    out.backward(grad_output)
    mask = canonical_mask(padding, attn, N, L, S) if masks != "none" else None
    expected, _ = reference(*pick(theirs_inputs), attn_mask=mask, need_weights=False)
    expected.backward(grad_output.double())
    for i, (a, b) in enumerate(zip(ours_inputs, theirs_inputs)):
        assert_close(a.grad, b.grad, 1e-5 * float(b.grad.abs().max()) + 1e-7, f"input {i}")
    theirs = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        expected_grad = theirs[name].grad
        assert_close(p.grad, expected_grad, 1e-5 * float(expected_grad.abs().max()) + 1e-7,
                     f"d{name}")


def test_training_dropout_is_reproducible(generator):
    module = torch_module(generator, batch_first=True)
    module.dropout = 0.3
    ours = attend.MultiheadAttention.from_torch(module).train()
    x = torch.rand(2, 8, E, generator=generator)
    torch.manual_seed(1)
    first, weights = ours(x, x, x, average_attn_weights=False)
    torch.manual_seed(1)
    second, _ = ours(x, x, x, average_attn_weights=False)
    assert torch.equal(first, second)
    assert (weights == 0).any()
    ours.eval()
    out, _ = ours(x, x, x)
    assert_close(out, expected_forward(module, x, x, x)[0], 2e-5, "eval: no dropout")


def test_parameters_share_the_cpp_memory(generator):
    """An optimizer step or load_state_dict changes what the C++ forward reads; a replaced
    parameter is adopted."""
    module = torch_module(generator, batch_first=True)
    ours = attend.MultiheadAttention.from_torch(module)
    x = torch.rand(1, 4, E, generator=generator)
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.1)
    out, _ = ours(x, x, x)
    out.square().sum().backward()
    optimizer.step()
    module.load_state_dict(ours.state_dict())
    assert_close(ours(x, x, x)[0], expected_forward(module, x, x, x)[0], 2e-5, "after a step")
    ours.out_proj.weight = torch.nn.Parameter(torch.eye(E))
    module.out_proj.weight.data = torch.eye(E)
    assert_close(ours(x, x, x)[0], expected_forward(module, x, x, x)[0], 2e-5, "replaced")
    assert ours.out_proj.weight.data_ptr() == ours._views["out_proj.weight"].ctypes.data


def test_state_dict_and_safetensors(tmp_path, generator):
    module = torch_module(generator, kdim=20, vdim=12, batch_first=True)
    x = torch.rand(2, 3, E, generator=generator)
    memory_k, memory_v = torch.rand(2, 5, 20, generator=generator), torch.rand(2, 5, 12)
    expected = expected_forward(module, x, memory_k, memory_v)[0]
    from_dict = attend.MultiheadAttention.from_state_dict(module.state_dict(), HEADS,
                                                          batch_first=True)
    assert_close(from_dict(x, memory_k, memory_v)[0], expected, 2e-5, "from_state_dict")
    path = tmp_path / "mha.safetensors"
    from_dict.save(path)
    loaded = attend.MultiheadAttention.from_safetensors(path, HEADS, batch_first=True)
    assert_close(loaded(x, memory_k, memory_v)[0], expected, 2e-5, "from_safetensors")
    tensors, _ = attend.load_safetensors(path)
    assert sorted(tensors) == sorted(module.state_dict())
    fresh = attend.MultiheadAttention(E, HEADS, kdim=20, vdim=12, batch_first=True, seed=3)
    fresh.load(path)
    assert_close(fresh(x, memory_k, memory_v)[0], expected, 2e-5, "load")
    with pytest.raises(ValueError, match="in_proj_bias.*shape"):
        fresh.load_state_dict({**module.state_dict(), "in_proj_bias": torch.zeros(5)})


def test_errors(generator):
    with pytest.raises(ValueError, match="add_bias_kv"):
        attend.MultiheadAttention(E, HEADS, add_bias_kv=True)
    with pytest.raises(ValueError, match="not divisible"):
        attend.MultiheadAttention(30, 4)
    ours = attend.MultiheadAttention(E, HEADS)
    x = torch.rand(3, 2, E)
    with pytest.raises(ValueError, match="embed_dim"):
        ours(torch.rand(3, 2, E + 1), x, x)
    with pytest.raises(TypeError, match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="attn_mask: shape"):
        ours(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool))


def test_self_attention_views_keep_their_gradients(generator):
    """key a detached view of query's memory: attend merges one view, autograd must not."""
    module = torch_module(generator, batch_first=True)
    ours = attend.MultiheadAttention.from_torch(module)
    x = torch.rand(1, 4, E, generator=generator, requires_grad=True)
    out, _ = ours(x, x.detach(), x.detach())
    out.sum().backward()
    reference = torch.nn.MultiheadAttention(E, HEADS, batch_first=True).double()
    reference.load_state_dict(module.state_dict())
    x64 = x.detach().double().requires_grad_()
    reference(x64, x64.detach(), x64.detach())[0].sum().backward()
    assert_close(x.grad, x64.grad, 1e-5, "query-only gradient")


def test_a_grid_of_options_runs(generator):
    """Every combination of layout, weights and masks gives the shape torch gives."""
    for batch_first, need_weights, average, masks in itertools.product(
            [False, True], [False, True], [False, True], ["none", "padding", "float pair"]):
        module = torch_module(generator, batch_first=batch_first)
        ours = attend.MultiheadAttention.from_torch(module)
        query, key, value = inputs(generator, "memory", 2, 3, 4, None, None, batch_first)
        padding, attn = mask_pair(generator, masks, 2, 3, 4)
        out, weights = ours(query, key, value, padding, need_weights, attn, average)
        expected, expected_weights = module(query, key, value, padding, need_weights,
                                            None if attn is None else attn, average) \
            if masks != "float pair" else expected_forward(module, query, key, value, padding,
                                                           attn, need_weights, average)
        assert out.shape == expected.shape
        assert (weights is None) == (expected_weights is None)
        if weights is not None:
            assert weights.shape == expected_weights.shape


def test_the_common_call_sees_replaced_memory_and_hooks(generator):
    """The common call (no masks, no gradient) is one C call that checks each parameter is the
    C++ memory; a parameter whose .data was re-pointed goes through forward(), which adopts
    it. Hooks, global ones included, run through nn.Module.__call__."""
    module = torch_module(generator, batch_first=False)
    ours = attend.MultiheadAttention.from_torch(module)
    x = torch.rand(3, 2, E, generator=generator)  # (L, N, E)
    with torch.no_grad():
        assert_close(ours(x, x, x)[0], expected_forward(module, x, x, x)[0], 2e-5, "(L, N, E)")
        ours.in_proj_weight.data = torch.full_like(ours.in_proj_weight, 0.01)
        module.in_proj_weight.data = torch.full_like(module.in_proj_weight, 0.01)
        assert_close(ours(x, x, x, need_weights=False)[0], expected_forward(module, x, x, x)[0],
                     2e-5, "re-pointed .data")
        seen = []
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, i, o: seen.append(type(m).__name__))
        try:
            ours(x, x, x)
        finally:
            handle.remove()
        assert seen == ["MultiheadAttention"]


def test_the_c_call_is_the_python_call(generator):
    """MultiheadAttention.__call__ is a C method (python/src/multihead_call.cpp) that makes the
    common call without Python and hands every other to the Python one (_call): both give
    the same results, bit for bit, on each route; hooks on the module, masks, dropout in
    training, gradients, a subclass and wrong arguments take the Python one."""
    assert type(attend.MultiheadAttention.__dict__["__call__"]).__name__ == "method_descriptor"
    for batch_first, kind, unbatched in itertools.product([False, True],
                                                          ["self", "memory", "distinct"],
                                                          [False, True]):
        module = torch_module(generator, kdim=None if kind == "self" else 24,
                              vdim={"self": None, "memory": 24, "distinct": 16}[kind],
                              batch_first=batch_first)
        ours = attend.MultiheadAttention.from_torch(module)
        q, k, v = inputs(generator, kind, 2, 3, 5, module.kdim, module.vdim, batch_first)
        if unbatched:
            q, k, v = (t[0] if batch_first else t[:, 0] for t in (q, k, v))
            if kind == "self":
                k = v = q
        mask = torch.rand(3, 5 if kind != "self" else 3, generator=generator) > 0.8
        mask[:, 0] = False
        calls = [((q, k, v), {}), ((q, k, v), {"need_weights": False}),
                 ((q, k, v, None, True, None, False), {}), ((q, k, v), {"is_causal": True}),
                 ((q,), {"key": k, "value": v, "average_attn_weights": False}),
                 ((q, k, v), {"attn_mask": mask})]
        with torch.no_grad():
            for args, kwargs in calls:
                got, expected = ours(*args, **kwargs), ours._call(*args, **kwargs)
                for a, b in zip(got, expected):
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert torch.equal(a, b), (batch_first, kind, unbatched, kwargs)
    # NumPy inputs, a subclass and gradients: the Python route, same results.
    x = torch.rand(2, 3, E, generator=generator)
    module = torch_module(generator, batch_first=True)
    ours = attend.MultiheadAttention.from_torch(module)
    with torch.no_grad():
        expected = ours._call(x, x, x)[0]
        assert np.array_equal(ours(x.numpy(), x.numpy(), x.numpy())[0], expected.numpy())

    class Sub(attend.MultiheadAttention):
        def forward(self, *args, **kwargs):
            output, weights = super().forward(*args, **kwargs)
            return output * 2, weights

    sub = Sub.from_torch(module)
    with torch.no_grad():
        assert torch.equal(sub(x, x, x)[0], 2 * expected)
    xg = x.clone().requires_grad_()
    out = ours(xg, xg, xg)[0]
    assert out.grad_fn is not None and torch.allclose(out, expected, atol=2e-6)
    with pytest.raises(TypeError):
        ours(x, x)
    with pytest.raises(TypeError):
        ours(x, x, x, no_such_argument=1)
    # A hook on the module runs.
    seen = []
    handle = ours.register_forward_pre_hook(lambda m, i: seen.append(len(i)))
    with torch.no_grad():
        ours(x, x, x)
    handle.remove()
    assert seen == [3]
    # Dropout in training mode goes to forward(), which draws it.
    ours.dropout = 0.5
    ours.train()
    with torch.no_grad():
        assert not torch.equal(ours(x, x, x)[0], expected)
        ours.eval()
        assert torch.equal(ours(x, x, x)[0], expected)
