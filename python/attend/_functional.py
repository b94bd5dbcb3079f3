"""scaled_dot_product_attention (PyTorch's arguments, attend's extras) and attention (the
listing). Both turn their arguments into one call of attend's C++ API, attend._attend.sdpa,
which reads every array in place and releases the GIL while it computes; with torch tensors
that require grad the call goes through attend._autograd instead."""

import sys
from typing import Any, Dict, NamedTuple, Optional

import numpy as np

from . import _attend

_sdpa = _attend.sdpa
_TOP_LEFT = _attend.FLAG_TOP_LEFT
_CAUSAL = _attend.FLAG_CAUSAL
_NEED_WEIGHTS = _attend.FLAG_NEED_WEIGHTS
_UNLESS_GRAD_NEEDED = _attend.FLAG_UNLESS_GRAD_NEEDED
_ALIGNMENTS = {"top_left": _attend.FLAG_TOP_LEFT, "bottom_right": 0}
_MASKED_ROWS = {"uniform": 0, "zero": _attend.FLAG_ZERO_MASKED_ROWS}
_BACKENDS = {"auto": 0, "fused": _attend.FLAG_BACKEND_FUSED,
             "reference": _attend.FLAG_BACKEND_REFERENCE}
_COMPUTE = {"auto": 0, "float32": _attend.FLAG_COMPUTE_FLOAT32,
            "bfloat16": _attend.FLAG_COMPUTE_BFLOAT16}

# dtype object -> "bool", "float", "integer" or "other"; filled as dtypes are seen.
_dtype_kinds: Dict[Any, str] = {}


def _dtype_kind(array, name):
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        raise _attend.DTypeError(
            f"{name}: expected a NumPy array or a torch tensor, got {type(array).__name__}")
    kind = _dtype_kinds.get(dtype)
    if kind is None:
        text = str(dtype).replace("torch.", "")
        if text == "bool":
            kind = "bool"
        elif text in ("float16", "float32", "float64", "bfloat16", "half", "float", "double"):
            kind = "float"
        elif text.startswith(("int", "uint")):
            kind = "integer"
        else:
            kind = "other"
        _dtype_kinds[dtype] = kind
    return kind


def _torch_tensor_type():
    """torch.Tensor when the caller has imported torch (attend never imports it itself)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def _draw_seed(query):
    """A dropout seed from the caller's generator: torch's (torch.manual_seed reproduces it)
    for torch tensors, NumPy's global one otherwise."""
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(query, tensor_type):
        import torch
        return int(torch.empty((), dtype=torch.int64).random_().item())
    return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))


def _option(table, value, name):
    try:
        return table[value]
    except (KeyError, TypeError):
        raise _attend.Error(
            f"{name} must be one of {', '.join(map(repr, table))}, got {value!r}") from None


def _window(window):
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise _attend.Error(
            f"window must be (left, right), each an int or None (unbounded), got {window!r}")
    return window[0], window[1]


def _segment_ids(segment_ids):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise _attend.Error(
                "segment_ids must be one array (queries and keys alike) or a pair "
                f"(query_ids, key_ids), got a sequence of {len(segment_ids)}")
        return segment_ids[0], segment_ids[1]
    return segment_ids, segment_ids


class ScoreRules(NamedTuple):
    """The score rules of one call, as attend._attend.sdpa and sdpa_backward read them: by
    name, so that a new rule is a new field, never a shifted index."""
    window_left: Optional[int] = None   # None: unbounded (both None: no window)
    window_right: Optional[int] = None
    alibi: Any = None                   # None, True (default slopes) or (H) slopes
    sinks: Any = None                   # (H) or None
    segment_ids_query: Any = None
    segment_ids_key: Any = None
    prefix: int = 0
    softcap: Optional[float] = None


def _rules(window, alibi, softcap, sinks, segment_ids, prefix):
    """The ScoreRules attend._attend.sdpa reads, or None when there are none."""
    if alibi is False:
        alibi = None
    if window is None and alibi is None and softcap is None and sinks is None and \
            segment_ids is None and not prefix:
        return None
    left, right = _window(window)
    segment_query, segment_key = _segment_ids(segment_ids)
    return ScoreRules(window_left=left, window_right=right, alibi=alibi, sinks=sinks,
                      segment_ids_query=segment_query, segment_ids_key=segment_key,
                      prefix=int(prefix), softcap=softcap)


def _call(query, key, value, mask, bias, rules, sinks, scale, dropout, seed, flags,
          num_threads, out):
    """One attend call: (output, weights or None). Differentiable when a torch input requires
    grad (query, key, value, bias, sinks) in grad mode."""
    result = _sdpa(query, key, value, mask, bias, rules, scale, dropout, seed,
                   flags | _UNLESS_GRAD_NEEDED, num_threads, out)
    if result is NotImplemented:
        return _differentiable(query, key, value, mask, bias, rules, sinks, scale, dropout, seed,
                               flags, num_threads, out)
    if flags & _NEED_WEIGHTS:
        return result[0], result[1]
    return result, None


def _differentiable(query, key, value, mask, bias, rules, sinks, scale, dropout, seed, flags,
                    num_threads, out):
    if out is not None:
        raise _attend.Error(
            "out: cannot write into caller memory while computing gradients; drop out= or "
            "call under torch.no_grad()")
    from . import _autograd
    return _autograd.sdpa(query, key, value, mask, bias, rules, sinks, scale, dropout, seed,
                          flags, num_threads)


def _rare_flags(return_weights, enable_gqa, fully_masked_rows, backend, compute_dtype="auto"):
    flags = _NEED_WEIGHTS if return_weights else 0
    if enable_gqa:
        flags |= _attend.FLAG_GROUPED_QUERY
    return flags | _option(_MASKED_ROWS, fully_masked_rows, "fully_masked_rows") | \
        _option(_BACKENDS, backend, "backend") | \
        _option(_COMPUTE, compute_dtype, "compute_dtype")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 return_weights=False, seed=None, causal_alignment="top_left",
                                 window=None, alibi=None, softcap=None, sinks=None,
                                 segment_ids=None, prefix=0, fully_masked_rows="uniform",
                                 num_threads=None, out=None, backend="auto",
                                 compute_dtype="auto"):
    """torch.nn.functional.scaled_dot_product_attention on attend's kernels.

    query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev): NumPy arrays or
    torch tensors (CPU; float32, float16 or bfloat16), read in place through their strides.
    Returns the output (..., Hq, Lq, Ev) of the query's kind and dtype; with
    return_weights=True, (output, weights) with float32 weights (..., Hq, Lq, Lk), after
    dropout.

    PyTorch's arguments mean what they mean in PyTorch 2: a bool attn_mask marks the keys
    that take part (True), a float one is added to the scores; is_causal aligns the diagonal
    top-left (query i sees keys j <= i) and excludes attn_mask; scale defaults to 1/sqrt(E);
    enable_gqa lets Hq be a multiple of Hkv (query head h reads key/value head h // (Hq/Hkv)).
    One difference: a query row with every key excluded gets uniform weights (the listing's
    masked_fill with -1e9; fully_masked_rows="zero" gives zeros) where PyTorch gives NaN.

    attend's extras (keyword only):
      return_weights     also return the weights
      seed               dropout seed (int); None draws one from torch's generator (torch
                         inputs) or NumPy's, so torch.manual_seed reproduces a run
      causal_alignment   "top_left" (PyTorch) or "bottom_right" (query i at i + Lk - Lq, as a
                         decoder over a KV cache); also aligns window and alibi
      window             (left, right): query i sees keys i - left .. i + right (None:
                         unbounded side); (left, 0) with any attn_mask is causal + window
      alibi              True (the paper's slopes) or a float32 (H) array of slopes
      softcap            cap: scores become cap * tanh(score / cap)
      sinks              float32 (H): one extra logit per head in the softmax denominator
      segment_ids        integer (..., L) documents for queries and keys, or a pair
                         (query_ids, key_ids): attention stays inside a document
      prefix             keys j < prefix are visible to every query (prefix-LM)
      fully_masked_rows  "uniform" (default) or "zero"
      num_threads        threads for this call (default: attend.set_num_threads or all cores)
      out                write the output into this array (any strides) and return it
      backend            "auto", "fused" or "reference" (the listing in float64)
      compute_dtype      precision of the two matrix products: "auto" (bfloat16 inputs in
                         bfloat16 products where the CPU has AVX512_BF16, else float32),
                         "float32", or "bfloat16" (inputs rounded to bfloat16; an error on a
                         CPU without AVX512_BF16); softmax and accumulation stay float32

    With torch tensors that require grad, the result is differentiable (query, key, value,
    a float attn_mask and sinks) through attend's fused backward; the weights are not.
    """
    # The common call (no extras) stays on a short path: Python's share of a small call's
    # overhead is most of it.
    flags = _TOP_LEFT if causal_alignment == "top_left" else \
        _option(_ALIGNMENTS, causal_alignment, "causal_alignment")
    if is_causal:
        flags |= _CAUSAL
    if return_weights or enable_gqa or fully_masked_rows != "uniform" or backend != "auto" or \
            compute_dtype != "auto":
        flags |= _rare_flags(return_weights, enable_gqa, fully_masked_rows, backend,
                             compute_dtype)
    mask = bias = rules = None
    if attn_mask is not None:
        mask, bias = _attend.split_attn_mask(attn_mask, is_causal)
    if dropout_p and seed is None:
        seed = _draw_seed(query)
    if window is not None or alibi is not None or softcap is not None or sinks is not None or \
            segment_ids is not None or prefix:
        rules = _rules(window, alibi, softcap, sinks, segment_ids, prefix)
    result = _sdpa(query, key, value, mask, bias, rules, scale, dropout_p, seed or 0,
                   flags | _UNLESS_GRAD_NEEDED, num_threads or 0, out)
    if result is NotImplemented:  # a torch input requires grad
        output, weights = _differentiable(query, key, value, mask, bias, rules, sinks, scale,
                                          dropout_p, seed or 0, flags, num_threads or 0, out)
        return (output, weights) if return_weights else output
    return result[:2] if return_weights else result


def attention(query, key, value, mask=None, dropout=0.0, seed=None, *, num_threads=None):
    """The listing of the seed documents, on attend's kernels:

        scores = query @ key.transpose(-2, -1) / sqrt(d_k)
        scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = softmax(scores, dim=-1); p_attn = dropout(p_attn)
        return p_attn @ value, p_attn

    mask: any dtype broadcastable to (..., Lq, Lk); an entry equal to 0 excludes that key (a
    float mask is compared with 0 as the listing does, which makes a bool copy of it).
    dropout: the probability p; seed as in scaled_dot_product_attention. Returns (output,
    weights), weights float32 after dropout. Differentiable like scaled_dot_product_attention.
    """
    if mask is not None and _dtype_kind(mask, "mask") == "float":
        mask = mask != 0
    if dropout and seed is None:
        seed = _draw_seed(query)
    return _call(query, key, value, mask, None, None, None, None, dropout, seed or 0,
                 _attend.FLAG_NEED_WEIGHTS, num_threads or 0, None)
