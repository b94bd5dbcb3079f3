"""attend.serving: the serving API from Python, the C++ one (attend/kv_cache.hpp, varlen.hpp,
rope.hpp, plan.hpp) bound in python/src/serving_bindings.cpp.

    cache = attend.PagedKvCache(num_blocks=256, block_size=16, kv_heads=2, head_dim=64,
                                dtype="bfloat16")
    ids = [cache.add_sequence() for _ in prompts]
    cache.append(ids, k, v, cu_seqlens(lengths), rope=attend.Rope())   # k (total, Hkv, D)
    out = cache.attend(ids, q, cu_seqlens(query_lengths),                # q (total_q, H, D)
                       options=attend.ServingOptions(causal=True))

Arrays (NumPy or torch, any strides the C++ call takes) are read in place and the GIL is
released while attend works; outputs are written into `out=` when given. Errors are
attend.Error with the C++ message, raised before anything is written.
"""

import sys

import numpy as np

from ._attend import (AttentionPlan, BoundPlan, Error, PagedKvCache, Rope, ServingOptions, paged_attention,
                      varlen_attention)

__all__ = ["AttentionPlan", "BoundPlan", "PagedKvCache", "Rope", "ServingOptions", "cu_seqlens",
           "paged_attention", "varlen_attention"]


def cu_seqlens(lengths, like=None):
    """The int32 offsets (B + 1) packing B sequences of `lengths` (B): [0, l0, l0 + l1, ...].
    A torch tensor when `like` is one (its device ignored: attend is on the CPU), else a NumPy
    array."""
    totals = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if totals.size and (totals.max() > np.iinfo(np.int32).max or np.min(lengths) < 0):
        raise Error(f"cu_seqlens: lengths must be >= 0 and total below 2**31, got {lengths}")
    offsets = np.zeros(len(totals) + 1, dtype=np.int32)
    offsets[1:] = totals
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        return torch.from_numpy(offsets)
    return offsets
