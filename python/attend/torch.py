"""attend inside existing PyTorch models, without editing them.

    import attend.torch
    report = attend.torch.patch(model)     # every nn.MultiheadAttention runs attend
    print(report)                          # what was replaced, what was left and why
    attend.torch.unpatch(model)            # the original modules again

patch() keeps the model's nn.Parameter objects: optimizers built before it, state_dict keys,
named_parameters and hooks keep working. PyTorch's fused encoder path (an
nn.TransformerEncoderLayer in eval mode reads its attention's weights and never calls it) is
turned off for the layers whose attention attend took, so that attend runs there too.
"""

import collections
import dataclasses

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


__all__ = ["PatchReport", "patch", "unpatch"]
