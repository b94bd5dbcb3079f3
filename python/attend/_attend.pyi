"""Type stubs for attend._attend, the compiled module (python/src). Arrays are NumPy arrays,
torch tensors or objects with __dlpack__ (`Array`), read in place; results come back as the
query's kind. python/tests/test_packaging.py checks these names against the module."""

from typing import Any, Dict, List, Optional, Tuple, Union

Array = Any  # numpy.ndarray | torch.Tensor | an object with __dlpack__


class Error(ValueError):
    """attend's errors, with the library's message."""


class DTypeError(Error, TypeError):
    """A wrong dtype or argument type."""


FLAG_CAUSAL: int
FLAG_TOP_LEFT: int
FLAG_NEED_WEIGHTS: int
FLAG_NEED_LOGSUMEXP: int
FLAG_ZERO_MASKED_ROWS: int
FLAG_GROUPED_QUERY: int
FLAG_BACKEND_FUSED: int
FLAG_BACKEND_REFERENCE: int
FLAG_UNLESS_GRAD_NEEDED: int
FLAG_COMPUTE_FLOAT32: int
FLAG_COMPUTE_BFLOAT16: int


# -- the machine and the build ------------------------------------------------------------

def version() -> str:
    """attend's version, as `attend info` prints it."""
def compiled_simd_targets() -> List[str]:
    """The SIMD targets this build holds kernels for."""
def supported_simd_targets() -> List[str]:
    """The compiled SIMD targets this CPU runs."""
def active_simd_target() -> str:
    """The SIMD target calls use now (capped by ATTEND_MAX_SIMD or set_max_simd_target)."""
def set_max_simd_target(name: str) -> None:
    """Caps the SIMD target for this process; attend.Error for an unknown name."""
def bf16_compute_path() -> str:
    """How bfloat16 products are computed on this CPU."""
def fp16_compute_path() -> str:
    """How float16 products are computed on this CPU."""
def runtime_report() -> str:
    """What `attend info` prints."""
def set_num_threads(num_threads: int) -> None:
    """Threads for calls that do not name num_threads; 0 restores the default."""
def get_num_threads() -> int:
    """Threads a call uses when it does not name num_threads."""


# -- attention ------------------------------------------------------------------------------

def scaled_dot_product_attention(
        query: Array, key: Array, value: Array, attn_mask: Optional[Array] = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, return_weights: bool = False, seed: Optional[int] = None,
        causal_alignment: str = "top_left", window: Optional[Tuple[Optional[int],
                                                                    Optional[int]]] = None,
        alibi: Union[None, bool, Array] = None, softcap: Optional[float] = None,
        sinks: Optional[Array] = None, segment_ids: Union[None, Array, Tuple[Array, Array]] = None,
        prefix: int = 0, fully_masked_rows: str = "uniform", num_threads: Optional[int] = None,
        out: Optional[Array] = None, backend: str = "auto", compute_dtype: str = "auto",
) -> Union[Array, Tuple[Array, Array]]:
    """query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev) -> output
    (..., Hq, Lq, Ev) (and float32 weights (..., Hq, Lq, Lk) with return_weights)."""


def sdpa(query: Array, key: Array, value: Array, mask: Optional[Array], bias: Optional[Array],
         rules: Optional[Any], scale: Optional[float], dropout: float, seed: int, flags: int,
         num_threads: int, out: Optional[Array]) -> Any:
    """The call under scaled_dot_product_attention: output, or (output, weights or None,
    logsumexp or None) with FLAG_NEED_WEIGHTS / FLAG_NEED_LOGSUMEXP, or NotImplemented with
    FLAG_UNLESS_GRAD_NEEDED when a torch input requires grad."""


def sdpa_backward(grad_output: Array, query: Array, key: Array, value: Array, output: Array,
                  logsumexp: Array, mask: Optional[Array], bias: Optional[Array],
                  rules: Optional[Any], scale: Optional[float], dropout: float, seed: int,
                  flags: int, num_threads: int, want_bias: bool, want_sinks: bool
                  ) -> Tuple[Array, Array, Array, Optional[Array], Optional[Array]]:
    """grad_output (..., Hq, Lq, Ev), query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value
    (..., Hkv, Lk, Ev), output, logsumexp (..., Hq, Lq) of sdpa's call -> (d_query, d_key,
    d_value, d_bias or None, d_sinks or None), shapes of the inputs."""


def split_attn_mask(attn_mask: Array, is_causal: bool) -> Tuple[Optional[Array],
                                                                 Optional[Array]]:
    """PyTorch's attn_mask (broadcastable to (..., Hq, Lq, Lk)) as attend's (mask, bias): bool
    -> (mask, None), float -> (None, mask)."""


def set_entry_doc(doc: str) -> None:
    """Sets scaled_dot_product_attention's docstring (once, at import)."""


# -- modules --------------------------------------------------------------------------------

def _install_multihead_call(cls: type, fallback: Any, global_hooks: tuple,
                            hook_attributes: tuple) -> None:
    """cls.__call__ becomes the C method of python/src/multihead_call.cpp."""


class MultiHeadTape:
    """What multihead_forward keeps for MultiHeadAttention.backward; opaque."""


class MultiHeadAttention:
    """attend::MultiHeadAttention: the parameters live in C++ memory (parameters() views
    them); attend.MultiheadAttention (attend/_multihead.py) is the torch module over it."""
    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, kdim: int = 0,
                 vdim: int = 0, seed: int = 0) -> None: ...
    @property
    def embed_dim(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def kdim(self) -> int: ...
    @property
    def vdim(self) -> int: ...
    @property
    def has_bias(self) -> bool: ...
    @property
    def packed_in_projection(self) -> bool: ...
    def parameters(self) -> Dict[str, Any]:
        """state_dict name -> writable NumPy view of the C++ memory: in_proj_weight (3E, E)
        (or q/k/v_proj_weight (E, E/kdim/vdim)), in_proj_bias (3E), out_proj.weight (E, E),
        out_proj.bias (E)."""
    def load_state_dict(self, state: Dict[str, Array]) -> None:
        """Copies name -> array (the shapes of parameters()) into the module."""
    def load(self, path: str) -> None:
        """Loads a safetensors file holding a state_dict."""
    def save(self, path: str) -> None:
        """Saves the state_dict as a safetensors file."""
    def backward(self, grad_output: Array, query: Array, key: Array, value: Array,
                 tape: MultiHeadTape, key_padding_mask: Optional[Array],
                 attn_mask: Optional[Array], causal: bool, dropout: float, seed: int,
                 num_threads: int) -> Tuple[Array, Optional[Array], Optional[Array],
                                            Dict[str, Array]]:
        """grad_output (N, L, E) -> (d_query (N, L, E), d_key (N, S, kdim) or None, d_value
        (N, S, vdim) or None, {name: d_parameter}); None where key or value is the query."""


def multihead_forward(module: MultiHeadAttention, query: Array, key: Array, value: Array,
                      key_padding_mask: Optional[Array], attn_mask: Optional[Array],
                      causal: bool, need_weights: bool, average: bool, dropout: float,
                      seed: int, num_threads: int, want_tape: bool
                      ) -> Tuple[Array, Optional[Array], Optional[MultiHeadTape]]:
    """query (N, L, E) or (L, E), key (N, S, kdim), value (N, S, vdim); masks nonzero keeps:
    key_padding_mask (N, S), attn_mask (L, S) or (N*H, L, S) -> (output (N, L, E), weights
    (N, L, S) averaged or (N, H, L, S), or None; tape)."""


def multihead_call(module: MultiHeadAttention, parameters: Optional[dict],
                   out_proj_parameters: Optional[dict], slots: tuple, query: Array, key: Array,
                   value: Array, need_weights: bool, average: bool, is_causal: bool,
                   batch_first: bool) -> Any:
    """attend.MultiheadAttention's common call (no masks, no dropout, no gradient): (output,
    weights or None) in nn.MultiheadAttention's layout, or NotImplemented."""


class SpatialSelfAttention:
    """attend::SpatialSelfAttention (attend.SpatialSelfAttention is the Python class)."""
    def __init__(self, channels: int, num_heads: int, groups: int, eps: float,
                 seed: int) -> None: ...
    @property
    def channels(self) -> int: ...
    def parameters(self) -> Dict[str, Any]:
        """name -> writable NumPy view: norm.weight, norm.bias (C), attention.<name>."""
    def forward(self, x: Array, num_threads: int) -> Array:
        """x (N, C, H, W) -> (N, C, H, W)."""


class PatchEmbedding:
    """attend::PatchEmbedding (attend.PatchEmbedding is the Python class)."""
    def __init__(self, in_channels: int, patch_size: int, embed_dim: int, class_token: bool,
                 position_embeddings: bool, image_height: int, image_width: int,
                 seed: int) -> None: ...
    def parameters(self) -> Dict[str, Any]:
        """name -> writable NumPy view: projection.weight (D, C, p, p), projection.bias (D),
        class_token (1, 1, D), position_embeddings (1, [1 +] P, D)."""
    def forward(self, x: Array, num_threads: int) -> Array:
        """x (N, C, H, W) -> (N, [1 +] P, D)."""


class PositionEmbedding:
    """attend::PositionEmbedding: a learned (max_length, dim) table."""
    def __init__(self, max_length: int, dim: int, seed: int) -> None: ...
    def parameters(self) -> Dict[str, Any]:
        """{"weight": writable NumPy view (max_length, dim)}."""
    def forward(self, length: int, offset: int) -> Any:
        """-> (length, dim) rows [offset, offset + length)."""


class TokenEmbedding:
    """attend::TokenEmbedding: a (vocab_size, dim) table."""
    def __init__(self, vocab_size: int, dim: int, seed: int) -> None: ...
    def parameters(self) -> Dict[str, Any]:
        """{"weight": writable NumPy view (vocab_size, dim)}."""
    def forward(self, ids: Array) -> Array:
        """ids (..., L) integers -> (..., L, dim) float32."""


def sinusoidal_positional_encoding(length: int, dim: int, offset: int) -> Any:
    """-> float32 (length, dim)."""


def add_positional_encoding(x: Array, encoding: Array) -> None:
    """x (N, L, d) or (L, d) += encoding (L, d), in place."""


def load_safetensors(path: str) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """-> ({name: NumPy array of the stored shape}, {metadata key: value})."""
def save_safetensors(path: str, tensors: Dict[str, Array], metadata: Dict[str, str]) -> None:
    """Writes name -> array (any shape, any strides) and metadata strings, atomically."""


# -- benchmarks and tests -------------------------------------------------------------------

def view_of(array: Array, writable: bool) -> tuple:
    """(address, shape, strides, ...) of the view attend reads."""


def cpp_sdpa_seconds(query: Array, key: Array, value: Array, out: Optional[Array],
                     causal: bool, calls: int, num_threads: int,
                     thread_cpu_time: bool) -> float:
    """Seconds per C++ call on query (..., H, Lq, E), key, value (..., H, Lk, E/Ev)."""
def cpp_sdpa_forward_backward_seconds(query: Array, key: Array, value: Array,
                                      grad_output: Array, causal: bool, calls: int,
                                      num_threads: int) -> float:
    """Seconds per C++ forward and backward; grad_output (..., H, Lq, Ev)."""
def cpp_multihead_seconds(module: MultiHeadAttention, x: Array, calls: int, num_threads: int,
                          thread_cpu_time: bool) -> float:
    """Seconds per C++ MultiHeadAttention forward on x (N, L, E)."""


# -- serving (python/src/serving_bindings.cpp): the paged KV cache, ragged batches, RoPE,
# prepared calls. cu_seqlens, block tables and lengths are int32 arrays.

class ServingOptions:
    """Score rules of serving calls, made once: causal (bottom-right by default), window
    (left, right), alibi (True or (H) slopes), softcap, sinks (H), prefix, scale, masked_rows,
    compute ("auto", "float32", "bfloat16"), num_threads."""
    @property
    def causal(self) -> bool: ...
    @property
    def scale(self) -> Optional[float]: ...
    @property
    def num_threads(self) -> int: ...
    def __init__(self, *, causal: bool = False, causal_alignment: str = "bottom_right",
                 window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                 alibi: Union[None, bool, Array] = None, softcap: Optional[float] = None,
                 sinks: Optional[Array] = None, prefix: int = 0, scale: Optional[float] = None,
                 masked_rows: str = "uniform", compute: str = "auto",
                 num_threads: int = 0) -> None: ...


def paged_attention(query: Array, cu_seqlens_q: Array, key_blocks: Array, value_blocks: Array,
                    block_tables: Array, seq_lens: Array, *, out: Optional[Array] = None,
                    options: Optional[ServingOptions] = None,
                    logsumexp: Union[None, bool, Array] = None,
                    key_mass: Union[None, bool, Array] = None,
                    key_scales: Optional[Array] = None, value_scales: Optional[Array] = None,
                    kv_format: Optional[str] = None) -> Any:
    """query (total_q, H, E), cu_seqlens_q (B + 1), key_blocks (N, block_size, Hkv, E),
    value_blocks (N, block_size, Hkv, Ev), block_tables (B, max_blocks), seq_lens (B) -> out
    (total_q, H, Ev), or (out, logsumexp (total_q, H), key_mass (B, max_blocks·block_size)).
    int8/float8 blocks: key_scales, value_scales float32 (N, block_size, Hkv); kv_format names
    the format of uint8 bits ("float8_e4m3", "float8_e5m2")."""


def varlen_attention(query: Array, key: Array, value: Array, cu_seqlens_q: Array,
                     cu_seqlens_k: Array, *, out: Optional[Array] = None,
                     options: Optional[ServingOptions] = None,
                     logsumexp: Union[None, bool, Array] = None) -> Any:
    """query (total_q, H, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev), cu_seqlens
    (B + 1) -> out (total_q, H, Ev), or (out, logsumexp (total_q, H), None)."""


class Rope:
    """Rotary position embeddings: base, interleaved (GPT-J) or half split (NeoX), rotary_dim."""
    @property
    def base(self) -> float: ...
    @property
    def interleaved(self) -> bool: ...
    @property
    def rotary_dim(self) -> int: ...
    def __init__(self, *, base: float = 10000.0, interleaved: bool = False,
                 rotary_dim: int = 0) -> None: ...
    def apply(self, x: Array, position_offset: int = 0) -> None:
        """x (..., L, D) rotated in place, token l at position position_offset + l."""
    def apply_at(self, x: Array, positions: Array) -> None:
        """x (tokens, ..., D) rotated in place, token t at positions[t] (int32/int64)."""


class PagedKvCache:
    """A paged K/V cache: key_blocks (num_blocks, block_size, kv_heads, head_dim), value_blocks
    (..., value_dim), NumPy views; dtype float32, float16, bfloat16, int8, float8_e4m3,
    float8_e5m2 (quantized: key_scales/value_scales (num_blocks, block_size, kv_heads))."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def value_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def free_blocks(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def key_blocks(self) -> Any:
        """NumPy view (num_blocks, block_size, kv_heads, head_dim)."""
    @property
    def value_blocks(self) -> Any:
        """NumPy view (num_blocks, block_size, kv_heads, value_dim)."""
    @property
    def key_scales(self) -> Any:
        """Quantized caches: float32 NumPy view (num_blocks, block_size, kv_heads)."""
    @property
    def value_scales(self) -> Any:
        """Quantized caches: float32 NumPy view (num_blocks, block_size, kv_heads)."""
    def __init__(self, num_blocks: int, *, block_size: int = 16, kv_heads: int = 1,
                 head_dim: int = 64, value_dim: int = 0, dtype: Any = "float32") -> None: ...
    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
    def fork(self, id: int) -> int:
        """A new sequence sharing id's blocks (copy on write); returns its id."""
    def remove_sequence(self, id: int) -> None:
        """Returns its blocks no other sequence shares to the free list."""
    def length(self, id: int) -> int:
        """Tokens appended so far (evicted ones included)."""
    def block_table(self, id: int) -> List[int]:
        """The blocks of sequence id in order, -1 for evicted ones."""
    def evict_outside_window(self, id: int, window: int) -> None:
        """Frees the blocks whose every token j < length - window."""
    def append(self, ids: List[int], key: Array, value: Array, cu_seqlens: Array, *,
               rope: Optional[Rope] = None) -> None:
        """key (total_new, kv_heads, head_dim), value (total_new, kv_heads, value_dim),
        cu_seqlens (B + 1)."""
    def attend(self, ids: List[int], query: Array, cu_seqlens_q: Array, *,
               out: Optional[Array] = None, options: Optional[ServingOptions] = None,
               logsumexp: Union[None, bool, Array] = None,
               key_mass: Union[None, bool, Array] = None) -> Any:
        """query (total_q, H, head_dim), cu_seqlens_q (B + 1) -> out (total_q, H, value_dim),
        or (out, logsumexp (total_q, H), key_mass (B, widest table·block_size))."""


class AttentionPlan:
    """A prepared call: query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), out
    (..., Lq, Ev) validated once."""
    @property
    def prepared(self) -> bool:
        """Whether run() takes the prepared path."""
    def __init__(self, query: Array, key: Array, value: Array, out: Array, *,
                 options: Optional[ServingOptions] = None, variable_key_length: bool = False,
                 need_logsumexp: bool = False) -> None: ...
    def run(self, query: Array, key: Array, value: Array, out: Array, *,
            logsumexp: Optional[Array] = None) -> None:
        """Writes out (..., Lq, Ev) (and logsumexp (..., Lq)) for new arrays of the layout."""
    def bind(self, query: Array, key: Array, value: Array, out: Array, *,
             logsumexp: Optional[Array] = None) -> "BoundPlan":
        """The plan tied to query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), out
        (..., Lq, Ev), rewritten in place between calls."""


class BoundPlan:
    """AttentionPlan.bind's result: calling it runs the plan on the bound arrays."""
    def __call__(self) -> None:
        """Runs the plan on the bound arrays: writes out (..., Lq, Ev)."""


def cpp_plan_seconds(plan: AttentionPlan, query: Array, key: Array, value: Array, out: Array,
                     calls: int, thread_cpu_time: bool) -> float:
    """Seconds per plan.run() in a C++ loop (python_bench.py's baseline)."""
