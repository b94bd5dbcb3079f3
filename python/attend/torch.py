"""attend inside existing PyTorch models, without editing them.

    import attend.torch
    report = attend.torch.patch(model)     # every nn.MultiheadAttention runs attend
    print(report)                          # what was replaced, what was left and why
    attend.torch.unpatch(model)            # the original modules again

    attend.torch.install()                 # torch.nn.functional.scaled_dot_product_attention
    attend.torch.uninstall()               #   runs attend for CPU tensors, and back
    with attend.torch.enabled():           # the same for a block of code
        ...

patch() keeps the model's nn.Parameter objects: optimizers built before it, state_dict keys,
named_parameters and hooks keep working. PyTorch's fused encoder path (an
nn.TransformerEncoderLayer in eval mode reads its attention's weights and never calls it) is
turned off for the layers whose attention attend took, so that attend runs there too.

install() replaces the function in torch.nn.functional, where model code written for PyTorch 2
looks it up at each call (Hugging Face's "sdpa" attention, nn.MultiheadAttention's own
functional path in PyTorch 2); code that copied the function out before install() (`from
torch.nn.functional import scaled_dot_product_attention` at import) keeps the copy. On a
PyTorch without the function (before 2.0), install() provides it.
"""

import contextlib
import dataclasses
import math

import torch

from . import _attend
from ._multihead import MultiheadAttention

# Keys of the module's __dict__ under which patch() keeps what unpatch() restores.
_ORIGINAL = "_attend_original"        # on an attend module: the nn.MultiheadAttention it took
_SAVED = "_attend_saved_attributes"   # on an encoder (layer): {attribute: value before patch}


@dataclasses.dataclass
class PatchReport:
    """What patch() did. Names are the modules' qualified names in the model (as
    model.named_modules() gives them; "" is the model itself).

    replaced       names of the nn.MultiheadAttention modules attend took
    left           name -> why that nn.MultiheadAttention was left as it is
    fast_path_off  names of the nn.TransformerEncoder(Layer)s whose fused path was turned off
                   so that they call their attention (attend)
    """

    replaced: list = dataclasses.field(default_factory=list)
    left: dict = dataclasses.field(default_factory=dict)
    fast_path_off: list = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"attend.torch.patch: {len(self.replaced)} MultiheadAttention replaced, "
                 f"{len(self.left)} left"]
        lines += [f"  replaced {name or '(model)'}" for name in self.replaced]
        lines += [f"  left     {name or '(model)'}: {why}" for name, why in self.left.items()]
        lines += [f"  fused encoder path off in {name or '(model)'}"
                  for name in self.fast_path_off]
        return "\n".join(lines)


def _why_not(module):
    """Why attend cannot take this nn.MultiheadAttention, or None when it can."""
    if type(module).forward is not torch.nn.MultiheadAttention.forward:
        return f"{type(module).__name__} overrides forward()"
    if module.bias_k is not None:
        return "add_bias_kv=True (attend has no learned extra key/value)"
    if module.add_zero_attn:
        return "add_zero_attn=True (attend has no zero key/value column)"
    if (module.in_proj_bias is None) != (module.out_proj.bias is None):
        return "only one of in_proj_bias and out_proj.bias is present"
    for name, p in module.named_parameters():
        if p.device.type != "cpu" or p.dtype != torch.float32:
            return f"parameter {name} is {p.dtype} on {p.device}; attend takes float32 on the CPU"
    return None


# Attributes of nn.Module that hold hooks: the replacement shares these dicts with the
# original, so hooks registered on either run on whichever is in the model.
def _hook_attributes(module):
    return [name for name, value in vars(module).items()
            if "hooks" in name and isinstance(value, dict)]


def _replacement(module):
    result = MultiheadAttention.from_torch(module, share_parameters=True)
    for name in _hook_attributes(module):
        result.__dict__[name] = module.__dict__[name]
    result.__dict__[_ORIGINAL] = module
    return result


def _set_saved(module, attribute, value):
    """module.attribute = value, the old value kept for unpatch() (only the first time)."""
    saved = module.__dict__.setdefault(_SAVED, {})
    saved.setdefault(attribute, getattr(module, attribute))
    setattr(module, attribute, value)


def _turn_off_fused_path(model, report):
    """PyTorch's fused encoder path never calls self_attn. An encoder layer takes it only with
    activation_relu_or_gelu set (relu or gelu), which nothing else reads: 0 sends the layer
    down its module path, which calls self_attn with the same activation. An encoder turns
    padded batches into nested tensors for that path (enable_nested_tensor; PyTorch 2:
    use_nested_tensor, decided at construction): off too."""
    names = {id(m): name for name, m in model.named_modules()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.TransformerEncoderLayer) and \
                isinstance(module.self_attn, MultiheadAttention):
            if getattr(module, "activation_relu_or_gelu", 0):
                _set_saved(module, "activation_relu_or_gelu", 0)
                report.fast_path_off.append(name)
        elif isinstance(module, torch.nn.TransformerEncoder) and any(
                isinstance(m, MultiheadAttention) for m in module.modules()):
            turned = False
            for attribute in ("enable_nested_tensor", "use_nested_tensor"):
                if getattr(module, attribute, False):
                    _set_saved(module, attribute, False)
                    turned = True
            if turned:
                report.fast_path_off.append(names[id(module)])
    report.fast_path_off.sort()


def patch(model):
    """Replaces every torch.nn.MultiheadAttention in `model` (an nn.Module) by an
    attend.MultiheadAttention over the same nn.Parameter objects, in place, and turns off
    PyTorch's fused encoder path where it would bypass attend. Returns a PatchReport.

    Inputs and outputs keep nn.MultiheadAttention's shapes: query (L, N, E) or (N, L, E)
    with batch_first, key and value (S, N, kdim / vdim) alike, output like the query.
    Left in place, with the reason in the report: add_bias_kv, add_zero_attn, subclasses
    that override forward(), parameters that are not float32 on the CPU. Modules met more
    than once (shared) are replaced by one attend module. Patching twice is harmless."""
    if not isinstance(model, torch.nn.Module):
        raise _attend.DTypeError(f"attend.torch.patch: expected a torch.nn.Module, got "
                                 f"{type(model).__name__}")
    report = PatchReport()
    if isinstance(model, torch.nn.MultiheadAttention):
        report.left[""] = ("the model is itself the MultiheadAttention; use "
                           "attend.MultiheadAttention.from_torch(model, share_parameters=True)")
        return report
    replacements = {}  # id(original) -> replacement, for modules met more than once
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if not isinstance(child, torch.nn.MultiheadAttention):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) not in replacements:
                why = _why_not(child)
                if why is not None:
                    report.left[name] = why
                    continue
                replacements[id(child)] = _replacement(child)
            parent._modules[child_name] = replacements[id(child)]
            report.replaced.append(name)
    _turn_off_fused_path(model, report)
    return report


def unpatch(model):
    """Undoes patch(model): the original nn.MultiheadAttention modules return, holding the
    same nn.Parameters with their current values (in memory of their own again), and the
    encoders' fused path is as it was. Returns the names of the modules restored."""
    restored = []
    for parent_name, parent in list(model.named_modules()):
        for attribute, value in parent.__dict__.pop(_SAVED, {}).items():
            setattr(parent, attribute, value)
        for child_name, child in list(parent._modules.items()):
            original = child.__dict__.get(_ORIGINAL) if child is not None else None
            if original is None:
                continue
            original.train(child.training)
            with torch.no_grad():
                for p in original.parameters():  # out of attend's memory, values kept
                    p.data = p.data.clone()
            parent._modules[child_name] = original
            restored.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return restored


# -- the functional route -------------------------------------------------------------------

_functional = torch.nn.functional
_MISSING = object()
_original = _MISSING  # what torch.nn.functional held before install(); None: nothing
_attend_sdpa = _attend.scaled_dot_product_attention
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # subclasses may dispatch elsewhere
_routes = {"attend": 0, "original": 0}


def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """PyTorch 2's scaled_dot_product_attention written out with torch operations (its math
    path), for any dtype and device; what install() falls back to on a PyTorch without the
    function. Shapes: query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev),
    attn_mask broadcastable to (..., Hq, L, S) (bool: True takes part; float: added); returns
    (..., Hq, L, Ev). is_causal: query i sees keys j <= i. enable_gqa: Hq a multiple of Hkv,
    query head h reading key/value head h // (Hq / Hkv)."""
    L, S = query.size(-2), key.size(-2)
    if is_causal and attn_mask is not None:
        raise RuntimeError("scaled_dot_product_attention: attn_mask and is_causal=True were "
                           "both given")
    if enable_gqa and query.dim() >= 3 and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scores = query @ key.transpose(-2, -1) * (1 / math.sqrt(query.size(-1)) if scale is None
                                              else scale)
    if is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = torch.dropout(weights, dropout_p, True)
    return weights @ value


def _to_original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, others):
    _routes["original"] += 1
    if _original is None or _original is _MISSING:
        if others:
            raise TypeError(f"scaled_dot_product_attention() got unexpected keyword arguments "
                            f"{sorted(others)}")
        return sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # Only the arguments that differ from their defaults: a PyTorch 2.0 has no scale, a 2.1
    # to 2.4 no enable_gqa.
    if scale is not None:
        others["scale"] = scale
    if enable_gqa:
        others["enable_gqa"] = enable_gqa
    return _original(query, key, value, attn_mask, dropout_p, is_causal, **others)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, **others):
    """torch.nn.functional.scaled_dot_product_attention as install() leaves it: attend for
    CPU tensors, PyTorch 2's signature and semantics (see attend.scaled_dot_product_attention
    for attend's reading of them); CUDA, nested and tensor-subclass inputs, keywords attend
    does not know and calls attend refuses go to the function install() replaced (on PyTorch
    before 2.0: sdpa_math), which then answers with its own result or error.

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev), attn_mask
    broadcastable to (..., Hq, L, S) -> (..., Hq, L, Ev) in the query's dtype."""
    if not others and type(query) in _PLAIN_TENSORS and query.is_cpu and not query.is_nested:
        try:
            result = _attend_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                  enable_gqa)
        except _attend.Error:  # DTypeError too
            pass
        else:
            _routes["attend"] += 1
            return result
    return _to_original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        others)


def install():
    """Makes torch.nn.functional.scaled_dot_product_attention run attend (see
    scaled_dot_product_attention in this module); provides it on PyTorch before 2.0.
    Installing twice is harmless."""
    global _original
    current = getattr(_functional, "scaled_dot_product_attention", None)
    if current is scaled_dot_product_attention:
        return
    _original = current
    _functional.scaled_dot_product_attention = scaled_dot_product_attention


def uninstall():
    """Puts back what install() replaced (on PyTorch before 2.0: removes the function)."""
    global _original
    if _original is _MISSING:
        return
    if _original is None:
        if getattr(_functional, "scaled_dot_product_attention", None) is not None:
            del _functional.scaled_dot_product_attention
    else:
        _functional.scaled_dot_product_attention = _original
    _original = _MISSING


def installed():
    """Whether torch.nn.functional.scaled_dot_product_attention is attend's."""
    return getattr(_functional, "scaled_dot_product_attention", None) is \
        scaled_dot_product_attention


@contextlib.contextmanager
def enabled():
    """install() for the block, then back to how it was (nests)."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def routes():
    """{"attend": calls attend computed, "original": calls passed on} since the import."""
    return dict(_routes)


__all__ = ["PatchReport", "enabled", "install", "installed", "patch", "routes",
           "scaled_dot_product_attention", "sdpa_math", "uninstall", "unpatch"]
