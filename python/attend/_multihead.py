"""MultiheadAttention: torch.nn.MultiheadAttention's interface on attend's C++ module.

Parameters live in the C++ object. With torch installed the class is a torch.nn.Module whose
nn.Parameters share the C++ memory (an optimizer's in-place step or load_state_dict updates
what the C++ forward reads), differentiable with torch tensors through attend's fused
backward; without torch it is a plain object with the same methods, its parameters NumPy
views of the C++ memory.
"""

import collections
import sys
from typing import TYPE_CHECKING

import numpy as np

from . import _attend, _functional
from ._modules import _IncompatibleKeys, _PlainModule, _is_torch

try:
    import torch
except ImportError:  # NumPy only
    torch = None  # type: ignore[assignment]

if TYPE_CHECKING:  # a type checker sees the class as the torch.nn.Module it is with torch
    from torch.nn import Module as _Base
else:
    _Base = torch.nn.Module if torch is not None else _PlainModule
_multihead_call = _attend.multihead_call

if torch is not None:
    # nn.Module.__call__ calls forward() alone unless a hook is registered on the module or
    # globally (PyTorch 1.13 to 2.x: these tables) or the module was compiled (PyTorch 2).
    # Tracing is not looked at: a tracer cannot see into attend's C call either way.
    _GLOBAL_HOOKS = tuple(value for name, value in vars(torch.nn.modules.module).items()
                          if name.startswith("_global_") and isinstance(value, dict) and
                          ("forward" in name or "backward" in name))
    _COMPILABLE = hasattr(torch.nn.Module, "compile")
    # The hook tables of an instance that the C __call__ looks at, those this torch has.
    _HOOK_ATTRIBUTES = tuple(
        name for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                          "_backward_pre_hooks") if name in vars(torch.nn.Module())) + \
        (("_compiled_call_impl",) if _COMPILABLE else ())


def _swap_batch(x):
    """(L, N, E) <-> (N, L, E) as a view."""
    return x.transpose(0, 1) if _is_torch(x) else np.swapaxes(x, 0, 1)


def _split_mask(mask, name):
    """A PyTorch-polarity mask as attend's (keep, bias): bool True = excluded becomes a keep
    mask (its negation, a copy of the mask), float is added to the scores."""
    if mask is None:
        return None, None
    kind = _functional._dtype_kind(mask, name)
    if kind == "bool":
        return (torch.logical_not(mask) if _is_torch(mask) else np.logical_not(mask)), None
    if kind == "float":
        return None, mask
    raise _attend.DTypeError(f"{name}: dtype {mask.dtype} is neither bool (True: excluded) nor "
                             "floating point (added to the scores)")


class MultiheadAttention(_Base):
    """torch.nn.MultiheadAttention on attend's kernels.

    Constructor and forward take torch.nn.MultiheadAttention's arguments (add_bias_kv and
    add_zero_attn are not supported; device must be the CPU, dtype float32) plus `seed`, which
    draws the initial parameters (torch's initialization scheme, attend's generator). Inputs
    are NumPy arrays or torch tensors, float32, float16 or bfloat16; outputs come back as the
    query's kind, float32.

    forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
            average_attn_weights=True, is_causal=False) -> (output, weights or None)
      masks have PyTorch's polarity: bool True excludes (a key for key_padding_mask (N, S), a
      pair for attn_mask (L, S) or (N*num_heads, L, S)), float is added to the scores.
      is_causal without attn_mask applies the causal rule (query i sees keys
      j <= i + S - L, the lower triangle for L == S); with attn_mask the mask is used, as in
      PyTorch where is_causal is a hint that attn_mask is causal. Dropout applies in training
      mode. A query with every key excluded gets uniform weights where PyTorch gives NaN.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None, *, seed=0):
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise _attend.Error("MultiheadAttention: add_bias_kv and add_zero_attn are not "
                                "supported by attend")
        if device is not None and str(device) != "cpu":
            raise _attend.Error(f"MultiheadAttention: device {device}; attend computes on the "
                                "CPU")
        if dtype is not None and str(dtype).replace("torch.", "") not in ("float32", "float"):
            raise _attend.DTypeError(f"MultiheadAttention: dtype {dtype}; attend's parameters "
                                     "are float32")
        self._cpp = _attend.MultiHeadAttention(embed_dim, num_heads, bias, kdim or 0, vdim or 0,
                                               seed)
        self.embed_dim = embed_dim
        self.kdim = self._cpp.kdim
        self.vdim = self._cpp.vdim
        self._qkv_same_embed_dim = self._cpp.packed_in_projection
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self._views = self._cpp.parameters()  # state_dict name -> NumPy view of C++ memory
        self._names = list(self._views)
        # (name, whether under out_proj, key in its _parameters, address of the C++ memory)
        self._slots = [(name, name.startswith("out_proj."), name.rpartition(".")[2],
                        view.__array_interface__["data"][0])
                       for name, view in self._views.items()]
        # For attend._attend.multihead_call, which checks each parameter is in C++ memory.
        self._call_slots = tuple((in_out_proj, sys.intern(key), address)
                                 for _, in_out_proj, key, address in self._slots) \
            if torch is not None else ()
        if torch is not None:
            self._register_shared_parameters()
        else:
            self._set_plain_attributes()

    # -- parameters -------------------------------------------------------------------------

    def _register_shared_parameters(self):
        shared = {name: torch.nn.Parameter(torch.from_numpy(view))
                  for name, view in self._views.items()}
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                     "in_proj_bias"):
            self.register_parameter(name, shared.get(name))
        self.out_proj = torch.nn.Linear(self.embed_dim, self.embed_dim,
                                        bias="out_proj.bias" in shared, device="meta")
        self.out_proj.weight = shared["out_proj.weight"]
        if "out_proj.bias" in shared:
            self.out_proj.bias = shared["out_proj.bias"]
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False

    def _set_plain_attributes(self):
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                     "in_proj_bias"):
            setattr(self, name, self._views.get(name))
        self.out_proj = collections.namedtuple("Linear", ["weight", "bias"])(
            self._views["out_proj.weight"], self._views.get("out_proj.bias"))
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False

    def _parameter(self, name):
        if name.startswith("out_proj."):
            return self.out_proj._parameters[name[len("out_proj."):]]
        return self._parameters[name]

    def _shared_parameters(self):
        """The nn.Parameters, in the order of self._names, each backed by the C++ memory. A
        parameter that was replaced (module.in_proj_weight = nn.Parameter(...)) or re-allocated
        is copied in and re-pointed at the C++ memory, so that it stays the one autograd and
        optimizers see."""
        own, out_proj = self._parameters, self._modules["out_proj"]._parameters
        parameters = []
        for name, in_out_proj, key, address in self._slots:
            p = (out_proj if in_out_proj else own)[key]
            if p.data_ptr() != address:
                self._adopt(name, p)
            parameters.append(p)
        return parameters

    def _adopt(self, name, p):
        view = self._views[name]
        if p.device.type != "cpu" or p.dtype != torch.float32 or tuple(p.shape) != view.shape:
            raise _attend.Error(
                f"MultiheadAttention: parameter '{name}' is {p.dtype} {tuple(p.shape)} on "
                f"{p.device}; attend computes with float32 {view.shape} on the CPU")
        with torch.no_grad():
            view[...] = p.detach().numpy()
        p.data = torch.from_numpy(view)

    def load_state_dict(self, state_dict, strict=True):
        """Copies a state_dict (NumPy arrays or torch tensors under PyTorch's names) into the
        module; names not used are ignored unless strict."""
        if torch is not None:
            self._shared_parameters()
        self._cpp.load_state_dict({k: v.detach() if _is_torch(v) else v
                                   for k, v in state_dict.items() if k in self._views})
        unexpected = [k for k in state_dict if k not in self._views]
        if strict and unexpected:
            raise _attend.Error(f"MultiheadAttention: unexpected keys {unexpected}")
        return _IncompatibleKeys([], unexpected)

    @classmethod
    def from_torch(cls, module, *, seed=0, share_parameters=False):
        """An attend copy of a torch.nn.MultiheadAttention (configuration, parameters, mode).

        share_parameters=True keeps the module's own nn.Parameter objects (what
        attend.torch.patch does): their values move into attend's memory (p.data is re-pointed
        there), so optimizers, hooks and state_dict keys that name them keep working, and
        `module` itself sees every later update."""
        if module.bias_k is not None or module.add_zero_attn:
            raise _attend.Error("MultiheadAttention.from_torch: add_bias_kv and add_zero_attn "
                                "are not supported by attend")
        result = cls(module.embed_dim, module.num_heads, dropout=module.dropout,
                     bias=module.in_proj_bias is not None, kdim=module.kdim, vdim=module.vdim,
                     batch_first=module.batch_first, seed=seed)
        if share_parameters:
            result._take_parameters(module)
        else:
            result.load_state_dict(module.state_dict())
        result.train(module.training)
        return result

    def _take_parameters(self, module):
        """Registers `module`'s nn.Parameters in place of this module's, in `module`'s order
        (an optimizer's state_dict indexes parameters by position), and adopts them."""
        own = self._parameters
        self._parameters = collections.OrderedDict(
            [(name, module._parameters[name]) for name in module._parameters if name in own] +
            [(name, p) for name, p in own.items() if name not in module._parameters])
        for name in ("weight", "bias"):
            self.out_proj._parameters[name] = module.out_proj._parameters.get(name)
        self._shared_parameters()

    @classmethod
    def from_state_dict(cls, state_dict, num_heads, **kwargs):
        """A module whose sizes (embed_dim, kdim, vdim, bias) follow from the state_dict's
        shapes; kwargs as the constructor's (dropout, batch_first, ...)."""
        shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
        if "in_proj_weight" in shapes:
            embed_dim = shapes["in_proj_weight"][1]
            kdim = vdim = embed_dim
        elif "q_proj_weight" in shapes and "k_proj_weight" in shapes and \
                "v_proj_weight" in shapes:
            embed_dim = shapes["q_proj_weight"][1]
            kdim, vdim = shapes["k_proj_weight"][1], shapes["v_proj_weight"][1]
        else:
            raise _attend.Error("MultiheadAttention.from_state_dict: no in_proj_weight (or "
                                f"q/k/v_proj_weight) among {sorted(shapes)}")
        result = cls(embed_dim, num_heads, bias="in_proj_bias" in shapes, kdim=kdim, vdim=vdim,
                     **kwargs)
        result.load_state_dict(state_dict, strict=False)
        return result

    @classmethod
    def from_safetensors(cls, path, num_heads, **kwargs):
        """from_state_dict of a safetensors file holding a state_dict."""
        tensors, _ = _attend.load_safetensors(str(path))
        return cls.from_state_dict(tensors, num_heads, **kwargs)

    def load(self, path):
        """Loads a safetensors file holding a state_dict."""
        if torch is not None:
            self._shared_parameters()
        self._cpp.load(str(path))

    def save(self, path):
        """Saves the state_dict as a safetensors file (float32), atomically."""
        if torch is not None:
            self._shared_parameters()
        self._cpp.save(str(path))

    # -- forward ----------------------------------------------------------------------------

    def __call__(self, query, key, value, key_padding_mask=None, need_weights=True,
                 attn_mask=None, average_attn_weights=True, is_causal=False):
        """module(...) is forward(...), nn.Module.__call__ (hooks, tracing) only where one of
        them is there: its bookkeeping is a third of a small call's cost. The common call (no
        masks, no dropout, no gradient) is one C call (attend._attend.multihead_call). With
        torch, this method is replaced by a C one (attend._attend._install_multihead_call,
        see python/src/multihead_call.cpp) that makes the common call without running Python
        and calls this one, _call, for every other."""
        if torch is None:
            own = out_proj = None
        else:
            state = self.__dict__
            if state["_forward_hooks"] or state["_forward_pre_hooks"] or \
                    state["_backward_hooks"] or state.get("_backward_pre_hooks") or \
                    any(_GLOBAL_HOOKS) or \
                    (_COMPILABLE and state.get("_compiled_call_impl") is not None):
                return _Base.__call__(self, query, key, value, key_padding_mask=key_padding_mask,
                                      need_weights=need_weights, attn_mask=attn_mask,
                                      average_attn_weights=average_attn_weights,
                                      is_causal=is_causal)
            own, out_proj = state["_parameters"], state["_modules"]["out_proj"]._parameters
        if key_padding_mask is None and attn_mask is None and \
                not (self.dropout and self.training) and \
                type(self).forward is MultiheadAttention.forward:  # else a subclass's forward
            result = _multihead_call(self._cpp, own, out_proj, self._call_slots, query, key,
                                     value, need_weights, average_attn_weights, is_causal,
                                     self.batch_first)
            if result is not NotImplemented:
                return result
        return self.forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                            average_attn_weights, is_causal)

    _call = __call__  # the Python __call__, which the C one falls back to

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        """query (L, N, E) ((N, L, E) with batch_first, (L, E) unbatched), key (S, N, kdim),
        value (S, N, vdim) alike; key_padding_mask (N, S), attn_mask (L, S) or (N*H, L, S) with
        PyTorch's polarity -> (output like the query with E features, weights (N, L, S)
        averaged over heads or (N, H, L, S), or None without need_weights)."""
        batched = query.ndim == 3
        if batched and not self.batch_first:  # (L, N, E) read as (N, L, E), in place
            q = _swap_batch(query)
            k = q if key is query else _swap_batch(key)
            v = q if value is query else k if value is key else _swap_batch(value)
        else:
            q, k, v = query, key, value
        if key_padding_mask is None and attn_mask is None:
            padding_keep = padding_bias = attn_keep = attn_bias = None
        else:
            padding_keep, padding_bias = _split_mask(key_padding_mask, "key_padding_mask")
            attn_keep, attn_bias = _split_mask(attn_mask, "attn_mask")
        causal = bool(is_causal) and attn_mask is None
        dropout = self.dropout if self.training else 0.0
        seed = _functional._draw_seed(query) if dropout else 0
        if padding_bias is None and attn_bias is None:
            output, weights = self._forward_module(q, k, v, padding_keep, attn_keep, causal,
                                                   need_weights, average_attn_weights, dropout,
                                                   seed)
        else:
            output, weights = self._forward_composed(
                q, k, v, padding_keep, padding_bias, attn_keep, attn_bias, causal,
                need_weights, average_attn_weights, dropout, seed)
        if batched and not self.batch_first:
            output = _swap_batch(output)
        return output, weights

    def _forward_module(self, q, k, v, padding, mask, causal, need_weights, average, dropout,
                        seed):
        """The C++ module: one GEMM per distinct input, heads read through strides."""
        if torch is not None:
            parameters = self._shared_parameters()
            if torch.is_grad_enabled() and _is_torch(q) and (
                    q.requires_grad or k.requires_grad or v.requires_grad or
                    any(p.requires_grad for p in parameters)):
                # The C++ module merges inputs that are one view (self-attention); tensors that
                # are one view but distinct to autograd keep their own gradient paths.
                if k is not q and _same_view(k, q):
                    k = k.clone()
                if v is not q and v is not k and (_same_view(v, q) or _same_view(v, k)):
                    v = v.clone()
                from . import _autograd
                config = (padding, mask, causal, need_weights, average, dropout, seed, 0)
                return _autograd.multihead(self._cpp, self._names, parameters, q, k, v, config)
        output, weights, _ = _attend.multihead_forward(
            self._cpp, q, k, v, padding, mask, causal, need_weights, average, dropout, seed, 0,
            False)
        return output, weights

    def _forward_composed(self, q, k, v, padding_keep, padding_bias, attn_keep, attn_bias,
                          causal, need_weights, average, dropout, seed):
        """Float masks, which the C++ module does not take: the three steps written here with
        the caller's array library for the projections and attend for the attention (with
        the float masks as its bias), differentiable through both."""
        is_torch = _is_torch(q)
        batched = q.ndim == 3
        if not batched:
            q, k, v = q[None], k[None], v[None]
        N, L, _ = q.shape
        S = k.shape[1]
        H, D, E = self.num_heads, self.head_dim, self.embed_dim
        if is_torch:
            parameters = dict(zip(self._names, self._shared_parameters()))
        else:
            parameters = self._views
        if self._qkv_same_embed_dim:
            w = parameters["in_proj_weight"]
            w_q, w_k, w_v = w[:E], w[E:2 * E], w[2 * E:]
        else:
            w_q, w_k, w_v = (parameters[n] for n in ("q_proj_weight", "k_proj_weight",
                                                     "v_proj_weight"))
        b = parameters.get("in_proj_bias")
        b_q, b_k, b_v = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])

        def linear(x, weight, bias):
            if is_torch:
                return torch.nn.functional.linear(x.float(), weight, bias)
            y = x.astype(np.float32) @ weight.T
            return y if bias is None else y + bias

        def heads(x, length):  # (N, length, E) -> (N, H, length, D), a view
            x = x.reshape(N, length, H, D)
            return x.transpose(1, 2) if is_torch else x.transpose(0, 2, 1, 3)

        query_heads = heads(linear(q, w_q, b_q), L)
        key_heads = heads(linear(k, w_k, b_k), S)
        value_heads = heads(linear(v, w_v, b_v), S)
        keep = _combine(_padding_view(padding_keep, N, S), _attn_view(attn_keep, N, H, L, S),
                        is_torch, "and")
        bias = _combine(_padding_view(padding_bias, N, S), _attn_view(attn_bias, N, H, L, S),
                        is_torch, "add")
        flags = _attend.FLAG_NEED_WEIGHTS if need_weights else 0
        if causal:
            flags |= _attend.FLAG_CAUSAL
        attended, weights = _functional._call(query_heads, key_heads, value_heads, keep, bias,
                                              None, None, None, dropout, seed, flags, 0, None)
        attended = attended.transpose(1, 2) if is_torch else attended.transpose(0, 2, 1, 3)
        attended = attended.reshape(N, L, E)
        output = linear(attended, parameters["out_proj.weight"], parameters.get("out_proj.bias"))
        if weights is not None and average:
            weights = weights.mean(1) if is_torch else weights.mean(1, dtype=np.float32)
        if not batched:
            output = output[0]
            weights = None if weights is None else weights[0]
        return output, weights


if torch is not None:
    _attend._install_multihead_call(MultiheadAttention, MultiheadAttention._call, _GLOBAL_HOOKS,
                                    _HOOK_ATTRIBUTES)


def _same_view(a, b):
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() \
        and a.dtype == b.dtype


def _padding_view(mask, N, S):
    """key_padding_mask (N, S) or unbatched (S) as (N, 1, 1, S)."""
    return None if mask is None else mask.reshape(N, 1, 1, S)


def _attn_view(mask, N, H, L, S):
    """attn_mask (L, S) as it is, (N*H, L, S) or unbatched (H, L, S) as (N, H, L, S)."""
    if mask is None or mask.ndim == 2:
        return mask
    return mask.reshape(N, H, L, S)


def _combine(a, b, is_torch, how):
    if a is None or b is None:
        return b if a is None else a
    if how == "and":
        return a & b
    return a + b if is_torch else np.add(a, b, dtype=np.result_type(a, b))
