"""attend's modules without gradients: SpatialSelfAttention and PatchEmbedding (the U-Net
block and the vision transformer's front), PositionEmbedding and TokenEmbedding, the
sinusoidal encoding and the safetensors reader and writer; and what MultiheadAttention
(_multihead.py) shares with them. Parameters live in the C++ objects and are shown as
writable NumPy views of their memory (torch.from_numpy(view) shares it too)."""

import collections
import sys

import numpy as np

from . import _attend, _functional

# What load_state_dict returns, as torch.nn.Module.load_state_dict's (missing, unexpected).
_IncompatibleKeys = collections.namedtuple("_IncompatibleKeys",
                                           ["missing_keys", "unexpected_keys"])


def _is_torch(x):
    tensor_type = _functional._torch_tensor_type()
    return tensor_type is not None and isinstance(x, tensor_type)


def _as_numpy(value, name):
    if _is_torch(value):
        return value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise _attend.DTypeError(f"{name}: expected a NumPy array or a torch tensor, got "
                                 f"{type(value).__name__}")
    return value


def _check_no_grad(x, module):
    if _is_torch(x) and x.requires_grad and sys.modules["torch"].is_grad_enabled():
        raise _attend.Error(
            f"{module} has no gradient in attend; call it under torch.no_grad() or on a "
            "tensor that does not require grad")


def _load_views(views, state_dict, module):
    """Copies state_dict's arrays into the parameter views (all checked first)."""
    arrays = {}
    for name, view in views.items():
        if name not in state_dict:
            raise _attend.Error(f"{module}: state_dict is missing '{name}' (shape {view.shape})")
        array = _as_numpy(state_dict[name], name)
        if array.shape != view.shape:
            raise _attend.Error(f"{module}: '{name}' has shape {tuple(array.shape)}, expected "
                                f"{tuple(view.shape)}")
        if array.dtype.kind != "f":
            raise _attend.DTypeError(f"{module}: '{name}' has dtype {array.dtype}, expected a "
                                     "floating dtype")
        arrays[name] = array
    for name, array in arrays.items():
        views[name][...] = array


class _PlainModule:
    """What the modules share without torch: train/eval, __call__, state_dict."""

    training = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def train(self, mode=True):
        self.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self):
        """name -> writable NumPy view of the parameter (not a copy)."""
        return dict(self._views)

    def named_parameters(self):
        return iter(self._views.items())

    def parameters(self):
        return iter(self._views.values())

    def load_state_dict(self, state_dict, strict=True):
        _load_views(self._views, state_dict, type(self).__name__)
        unexpected = [k for k in state_dict if k not in self._views]
        if strict and unexpected:
            raise _attend.Error(f"{type(self).__name__}: unexpected keys {unexpected}")
        return _IncompatibleKeys([], unexpected)



class _ParameterModule(_PlainModule):
    """A C++ module without gradients; parameters are writable NumPy views of its memory."""

    def _check_input(self, x):
        _check_no_grad(x, type(self).__name__)


class SpatialSelfAttention(_ParameterModule):
    """The attention block of a denoising U-Net on (N, C, H, W) feature maps:
    x + MHA(GroupNorm(x) flattened to (N, H*W, C)) mapped back to (N, C, H, W).

    Parameters: norm.weight, norm.bias (C) (without group_norm_groups=0) and attention.<name>
    for the MultiheadAttention(channels, num_heads, batch_first=True) inside.
    forward(x, num_threads=None): x (N, C, H, W), any strides; float32 result, x's kind."""

    def __init__(self, channels, num_heads, group_norm_groups=32, eps=1e-5, *, seed=0):
        self._cpp = _attend.SpatialSelfAttention(channels, num_heads, group_norm_groups, eps, seed)
        self._views = self._cpp.parameters()
        self.channels = channels

    def forward(self, x, num_threads=None):
        """x (N, C, H, W), any strides -> float32 (N, C, H, W) of x's kind."""
        self._check_input(x)
        return self._cpp.forward(x, num_threads or 0)


class PatchEmbedding(_ParameterModule):
    """The front of a vision transformer: (N, C, H, W) -> (N, [1 +] P, D) tokens, P patches of
    patch_size x patch_size in row-major order (a Conv2d with kernel = stride = patch_size),
    with an optional class token and learned position embeddings (for image_size (H, W)).

    Parameters: projection.weight (D, C, p, p), projection.bias (D), class_token (D),
    position_embeddings ([1 +] P, D)."""

    def __init__(self, in_channels, patch_size, embed_dim, class_token=True,
                 position_embeddings=True, image_size=None, *, seed=0):
        if position_embeddings and image_size is None:
            raise _attend.Error("PatchEmbedding: position_embeddings needs image_size=(H, W)")
        height, width = image_size if image_size is not None else (0, 0)
        self._cpp = _attend.PatchEmbedding(in_channels, patch_size, embed_dim, class_token,
                                           position_embeddings, height, width, seed)
        self._views = self._cpp.parameters()

    def forward(self, x, num_threads=None):
        """x (N, C, H, W) -> float32 tokens (N, [1 +] P, D) of x's kind."""
        self._check_input(x)
        return self._cpp.forward(x, num_threads or 0)


class PositionEmbedding(_ParameterModule):
    """A learned (max_length, dim) table, N(0, 0.02^2) from `seed`; forward(length, offset=0)
    returns rows [offset, offset + length) as a NumPy array. Parameter: weight."""

    def __init__(self, max_length, dim, *, seed=0):
        self._cpp = _attend.PositionEmbedding(max_length, dim, seed)
        self._views = self._cpp.parameters()
        self.weight = self._views["weight"]

    def forward(self, length, offset=0):
        """Rows [offset, offset + length) of the table: a float32 NumPy array (length, dim)."""
        return self._cpp.forward(length, offset)


class TokenEmbedding(_ParameterModule):
    """A (vocab_size, dim) table, N(0, 1) from `seed` (as torch.nn.Embedding); forward(ids)
    maps integer ids (..., L) to float32 (..., L, dim) of the ids' kind. Parameter: weight."""

    def __init__(self, vocab_size, dim, *, seed=0):
        self._cpp = _attend.TokenEmbedding(vocab_size, dim, seed)
        self._views = self._cpp.parameters()
        self.weight = self._views["weight"]

    def forward(self, ids):
        """Integer ids (..., L) -> float32 (..., L, dim) of the ids' kind."""
        return self._cpp.forward(ids)


def sinusoidal_positional_encoding(length, dim, offset=0):
    """PE(pos, 2i) = sin(pos / 10000^(2i/dim)), PE(pos, 2i+1) = cos(...) for positions
    [offset, offset + length): a float32 NumPy array (length, dim)."""
    return _attend.sinusoidal_positional_encoding(length, dim, offset)


def add_positional_encoding(x, encoding):
    """x += encoding in place, broadcast over the batch: x float32 (N, L, d) or (L, d) (NumPy
    or torch, any strides), encoding float32 (L, d)."""
    _check_no_grad(x, "add_positional_encoding")
    _attend.add_positional_encoding(x, encoding)


def load_safetensors(path):
    """(tensors, metadata): name -> NumPy array, and the file's __metadata__ strings."""
    return _attend.load_safetensors(str(path))


def save_safetensors(path, tensors, metadata=None):
    """Writes name -> array (NumPy or torch, any strides) atomically."""
    _attend.save_safetensors(str(path), {k: v.detach() if _is_torch(v) else v
                                         for k, v in tensors.items()}, metadata or {})
