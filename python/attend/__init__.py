"""attend: scaled dot-product attention on the CPU for NumPy and PyTorch users.

    import attend
    out = attend.scaled_dot_product_attention(q, k, v, is_causal=True)   # as torch's
    out, weights = attend.attention(q, k, v, mask)                       # the listing
    mha = attend.MultiheadAttention.from_torch(torch_module)             # as nn.MultiheadAttention
    cache = attend.PagedKvCache(256, kv_heads=2, head_dim=64)            # serving: attend.serving

Arrays are read in place (NumPy through the buffer protocol, torch tensors through DLPack,
anything else through __dlpack__), strides honoured; results come back as the query's kind.
The GIL is released while attend computes. Errors are attend.Error (a ValueError) or, for a
wrong dtype or argument type, attend.DTypeError (also a TypeError), with attend's message.
"""

from ._attend import (DTypeError, Error, active_simd_target, bf16_compute_path,
                      compiled_simd_targets, fp16_compute_path, get_num_threads,
                      set_max_simd_target, set_num_threads, supported_simd_targets, version)
from ._functional import attention
from .serving import (AttentionPlan, PagedKvCache, Rope, ServingOptions, cu_seqlens,
                      paged_attention, varlen_attention)
from ._modules import (PatchEmbedding, PositionEmbedding, SpatialSelfAttention, TokenEmbedding,
                       add_positional_encoding, load_safetensors, save_safetensors,
                       sinusoidal_positional_encoding)

__version__ = version()


def _entry():
    """attend.scaled_dot_product_attention: the C entry (PyTorch's arguments without Python
    in the way) with the Python implementation's signature and docstring; it hands every call
    it does not handle itself to that implementation."""
    import inspect

    from . import _attend, _functional
    python = _functional.scaled_dot_product_attention
    _attend.set_entry_doc(f"scaled_dot_product_attention{inspect.signature(python)}\n--\n\n"
                          f"{inspect.getdoc(python)}")
    return _attend.scaled_dot_product_attention


scaled_dot_product_attention = _entry()

__all__ = [
    "AttentionPlan", "DTypeError", "Error", "MultiheadAttention", "PagedKvCache", "Rope",
    "ServingOptions", "cu_seqlens", "paged_attention", "varlen_attention", "PatchEmbedding", "PositionEmbedding",
    "SpatialSelfAttention", "TokenEmbedding", "active_simd_target", "add_positional_encoding",
    "attention", "bf16_compute_path", "compiled_simd_targets", "fp16_compute_path", "get_num_threads", "load_safetensors",
    "save_safetensors", "scaled_dot_product_attention", "set_max_simd_target",
    "set_num_threads", "sinusoidal_positional_encoding", "supported_simd_targets", "version",
]


def __getattr__(name):
    # MultiheadAttention is a torch.nn.Module when torch is installed: loaded on first use, so
    # that `import attend` does not import torch.
    if name == "MultiheadAttention":
        from ._multihead import MultiheadAttention
        globals()[name] = MultiheadAttention
        return MultiheadAttention
    if name == "torch":  # attend.torch: patch(), install() (imports torch)
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'attend' has no attribute {name!r}")
