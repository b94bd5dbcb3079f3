"""attend.torch.patch on models nobody here wrote (torchvision's VisionTransformer, PyTorch's
nn.Transformer, nn.TransformerEncoder, a pre-norm nn.TransformerDecoder), against the same
models unpatched: outputs in eval, gradients in training (dropout 0), one optimizer step built
before the patch, the forward after it; attend's C entries are counted to prove it ran. Models
are tiny: what is tested is the plumbing, the kernels have their own tests."""

import copy

import pytest
import torch

import attend
import attend.torch
from conftest import assert_close

try:
    import torchvision
except ImportError:  # Debian: python3-torchvision (scripts/install-deps.sh)
    torchvision = None

# PyTorch's own fused path, run by the unpatched reference, warns about nested tensors.
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

E = 16  # model width everywhere; 2 heads of 8
U32 = 2.0**-24


def tolerance(expected, layers, length):
    """|patched - unpatched| for float32 models that differ only in the order of the sums
    inside attention: a few roundings of each E- and length-term sum per layer, relative to
    the magnitude, growing with depth (LayerNorm renormalizes between layers)."""
    magnitude = float(expected.abs().max()) + 1e-30
    return magnitude * layers * 64 * (E + length) * U32


@pytest.fixture
def attend_calls(monkeypatch):
    """counter[0]: attention computed by attend's C entries (one per attention forward; a
    call that declines because gradients are needed, and goes to the autograd route, is not
    counted). MultiheadAttention's calls take its Python __call__ here, which makes the same
    C calls as the C one that replaces it (test_multihead.py compares the two routes), so
    that each is counted."""
    counter = [0]
    monkeypatch.setattr(attend.MultiheadAttention, "__call__", attend.MultiheadAttention._call)

    def counting(function):
        def wrapper(*args, **kwargs):
            result = function(*args, **kwargs)
            counter[0] += result is not NotImplemented
            return result
        return wrapper

    monkeypatch.setattr(attend._attend, "multihead_forward",
                        counting(attend._attend.multihead_forward))
    monkeypatch.setattr(attend._attend, "sdpa", counting(attend._attend.sdpa))
    monkeypatch.setattr(attend._functional, "_sdpa", counting(attend._functional._sdpa))
    monkeypatch.setattr(attend._multihead, "_multihead_call",
                        counting(attend._multihead._multihead_call))
    return counter


def projection(output, seed=7):
    """A fixed random linear functional of the output: its gradient reaches every element
    (a sum of squares after LayerNorm would be constant)."""
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed))
    return (output * weights).sum()


def vision_transformer():
    if torchvision is None:
        pytest.skip("torchvision is not installed (Debian: python3-torchvision)")
    model = torchvision.models.VisionTransformer(
        image_size=8, patch_size=4, num_layers=2, num_heads=2, hidden_dim=E, mlp_dim=32,
        num_classes=3)
    images = torch.randn(2, 3, 8, 8)
    return model, (images,), {}, 2, 2, 5


def transformer():
    model = torch.nn.Transformer(d_model=E, nhead=2, num_encoder_layers=2,
                                 num_decoder_layers=2, dim_feedforward=32, dropout=0.0,
                                 batch_first=True)
    src, tgt = torch.randn(2, 6, E), torch.randn(2, 5, E)
    src_padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    tgt_padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    kwargs = dict(src_key_padding_mask=src_padding, memory_key_padding_mask=src_padding,
                  tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(5),
                  tgt_key_padding_mask=tgt_padding)
    return model, (src, tgt), kwargs, 6, 4, 6


def encoder_float_mask():
    layer = torch.nn.TransformerEncoderLayer(E, 2, dim_feedforward=32, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, num_layers=2)
    src = torch.randn(7, 2, E)  # (L, N, E): batch_first=False
    mask = torch.randn(7, 7, generator=torch.Generator().manual_seed(3))
    return model, (src,), dict(mask=mask), 2, 2, 7


def prenorm_decoder():
    layer = torch.nn.TransformerDecoderLayer(E, 2, dim_feedforward=32, dropout=0.0,
                                             norm_first=True)
    model = torch.nn.TransformerDecoder(layer, num_layers=2, norm=torch.nn.LayerNorm(E))
    tgt, memory = torch.randn(5, 2, E), torch.randn(6, 2, E)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    return model, (tgt, memory), dict(tgt_mask=causal), 4, 2, 6


MODELS = [vision_transformer, transformer, encoder_float_mask, prenorm_decoder]


def build(make):
    """(unpatched, to patch, args, kwargs, attention calls per forward, layers, length)."""
    torch.manual_seed(20261201)
    model, args, kwargs, calls, layers, length = make()
    return model, copy.deepcopy(model), args, kwargs, calls, layers, length


@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_eval_outputs(make, attend_calls):
    reference, model, args, kwargs, calls, layers, length = build(make)
    report = attend.torch.patch(model)
    assert len(report.replaced) == calls and not report.left, str(report)
    reference.eval(), model.eval()
    with torch.no_grad():  # where PyTorch's fused encoder path would run
        expected = reference(*args, **kwargs)
        attend_calls[0] = 0
        got = model(*args, **kwargs)
    assert attend_calls[0] == calls
    assert_close(got, expected, tolerance(expected, layers, length), "eval output")


@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_training_step(make, attend_calls):
    reference, model, args, kwargs, calls, layers, length = build(make)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # before the patch
    parameters = list(model.named_parameters())
    keys = list(model.state_dict())
    attend.torch.patch(model)
    assert [(n, id(p)) for n, p in model.named_parameters()] == \
        [(n, id(p)) for n, p in parameters]
    assert list(model.state_dict()) == keys
    reference.train(), model.train()

    expected = reference(*args, **kwargs)
    attend_calls[0] = 0
    got = model(*args, **kwargs)
    assert attend_calls[0] == calls
    assert_close(got, expected, tolerance(expected, layers, length), "training output")
    projection(expected).backward()
    projection(got).backward()
    references = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        expected_grad = references[name].grad
        assert_close(p.grad, expected_grad, tolerance(expected_grad, 2 * layers, length),
                     f"gradient of {name}")

    reference_optimizer.step()
    optimizer.step()
    for name, p in model.named_parameters():
        assert_close(p, references[name], tolerance(references[name], 2 * layers, length),
                     f"{name} after one step")
    with torch.no_grad():  # attend reads the stepped parameters
        expected = reference(*args, **kwargs)
        got = model(*args, **kwargs)
    assert_close(got, expected, tolerance(expected, 2 * layers, length), "output after a step")


def test_encoder_padding_fast_path(attend_calls):
    """nn.TransformerEncoder in eval with a padding mask: PyTorch's fused path (nested
    tensors) would read the weights and never call the module; after patch() attend runs.
    The fused path writes zeros at padded positions, the module path values nobody reads:
    only unpadded positions are compared."""
    torch.manual_seed(5)
    layer = torch.nn.TransformerEncoderLayer(E, 2, dim_feedforward=32, batch_first=True)
    reference = torch.nn.TransformerEncoder(layer, num_layers=2).eval()
    model = copy.deepcopy(reference)
    report = attend.torch.patch(model)
    assert report.fast_path_off == ["", "layers.0", "layers.1"], str(report)
    src = torch.randn(3, 6, E)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = padding[2, 2:] = True
    with torch.no_grad():
        expected = reference(src, src_key_padding_mask=padding)
        got = model(src, src_key_padding_mask=padding)
    assert attend_calls[0] == 2
    keep = ~padding
    assert_close(got[keep], expected[keep], tolerance(expected, 2, 6), "unpadded outputs")

    attend.torch.unpatch(model)
    assert model.enable_nested_tensor and model.layers[0].activation_relu_or_gelu == 1
    with torch.no_grad():
        assert_close(model(src, src_key_padding_mask=padding), expected, 0.0, "unpatched")


def test_unpatch_restores():
    reference, model, args, kwargs, _, layers, length = build(transformer)
    originals = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    parameters = [id(p) for p in model.parameters()]
    attend.torch.patch(model)
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    with torch.no_grad():
        for p in model.parameters():  # an update made while patched survives the unpatch
            p.mul_(0.5)
        for p in reference.parameters():
            p.mul_(0.5)
    restored = attend.torch.unpatch(model)
    assert len(restored) == 6
    assert [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)] == \
        originals
    assert [id(p) for p in model.parameters()] == parameters
    reference.eval(), model.eval()
    with torch.no_grad():
        assert_close(model(*args, **kwargs), reference(*args, **kwargs), 0.0, "unpatched")
    assert attend.torch.unpatch(model) == []


def test_left_with_reasons():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.taken = torch.nn.MultiheadAttention(E, 2, kdim=8, vdim=4)
            self.bias_kv = torch.nn.MultiheadAttention(E, 2, add_bias_kv=True)
            self.zero_attn = torch.nn.MultiheadAttention(E, 2, add_zero_attn=True)
            self.double = torch.nn.MultiheadAttention(E, 2).double()
            self.shared = self.taken

    model = Model()
    report = attend.torch.patch(model)
    assert report.replaced == ["taken", "shared"]
    assert model.taken is model.shared and isinstance(model.taken, attend.MultiheadAttention)
    assert sorted(report.left) == ["bias_kv", "double", "zero_attn"]
    assert "add_bias_kv" in report.left["bias_kv"]
    assert "add_zero_attn" in report.left["zero_attn"]
    assert "float64" in report.left["double"]
    assert "left     bias_kv" in str(report)
    assert attend.torch.patch(model).replaced == []  # patching twice changes nothing

    alone = torch.nn.MultiheadAttention(E, 2)
    assert list(attend.torch.patch(alone).left) == [""]
    with pytest.raises(TypeError):
        attend.torch.patch(object())


def test_hooks_follow():
    model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(E, 2, 32, batch_first=True))
    seen = []
    model[0].self_attn.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    attend.torch.patch(model)
    model(torch.randn(1, 3, E))
    assert seen == ["MultiheadAttention"] and \
        isinstance(model[0].self_attn, attend.MultiheadAttention)
