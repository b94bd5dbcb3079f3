// serving_bindings.cpp: the serving API (attend/kv_cache.hpp, varlen.hpp, rope.hpp, plan.hpp)
// for Python: attend.PagedKvCache, attend.paged_attention, attend.varlen_attention,
// attend.Rope, attend.AttentionPlan and attend.ServingOptions (the score rules of one call).
//
// Every array is borrowed in place (arrays.hpp: NumPy arrays from their fields, torch tensors
// through their data pointer and strides), the GIL is released while the C++ call runs, and the
// C++ call validates everything: a bad block table, length or dtype raises attend.Error (or
// attend.DTypeError) with the C++ message, before any output or cache block is written.
// Outputs are the caller's arrays when given (`out`, `logsumexp`, `key_mass`), else new ones
// of the query's kind.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <ctime>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "attend/error.hpp"
#include "attend/kv_cache.hpp"
#include "attend/plan.hpp"
#include "attend/rope.hpp"
#include "attend/varlen.hpp"
#include "bindings.hpp"

namespace attend_python {
namespace {

using attend::DType;
using attend::Shape;
using attend::Tensor;
using attend::TensorView;

DType dtype_named(const std::string& text) {
  // PyTorch's names ("torch.float8_e4m3fn") read as attend's.
  std::string name = text.rfind("torch.", 0) == 0 ? text.substr(6) : text;
  if (name == "float8_e4m3fn") name = "float8_e4m3";
  for (int d = 0; d <= static_cast<int>(DType::kFloat8E5M2); ++d) {
    if (name == attend::dtype_name(static_cast<DType>(d))) return static_cast<DType>(d);
  }
  throw ArgumentTypeError("dtype '" + text +
                          "' is unknown; cache formats: float32, float16, bfloat16, int8, "
                          "float8_e4m3, float8_e5m2");
}

// The score rules of a serving call, built once and passed to every call (the arrays it
// holds, ALiBi slopes and sinks, stay borrowed while it lives).
struct ServingOptions {
  attend::AttentionOptions options;
  std::optional<Borrowed> alibi_slopes, sinks;
  int num_threads = 0;

  // The options of one call: the thread count resolved now (attend.set_num_threads).
  attend::AttentionOptions resolved() const {
    attend::AttentionOptions o = options;
    o.num_threads = resolve_num_threads(num_threads);
    return o;
  }
};

std::optional<int64_t> optional_int(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return h.cast<int64_t>();
}

ServingOptions make_options(bool causal, const std::string& causal_alignment, py::handle window,
                            py::handle alibi, py::handle softcap, py::handle sinks,
                            int64_t prefix, py::handle scale, const std::string& masked_rows,
                            const std::string& compute, int num_threads) {
  ServingOptions s;
  attend::AttentionOptions& o = s.options;
  o.causal = causal;
  if (causal_alignment == "top_left") {
    o.causal_alignment = attend::CausalAlignment::kTopLeft;
  } else if (causal_alignment != "bottom_right") {
    throw attend::Error("causal_alignment must be 'bottom_right' or 'top_left', got '" +
                        causal_alignment + "'");
  }
  if (!window.is_none()) {
    const auto sides = window.cast<py::tuple>();
    if (sides.size() != 2) throw attend::Error("window must be (left, right), None for unbounded");
    const std::optional<int64_t> left = optional_int(sides[0]), right = optional_int(sides[1]);
    o.window = attend::SlidingWindow{left.value_or(attend::kUnboundedWindow),
                                     right.value_or(attend::kUnboundedWindow)};
  }
  if (alibi.ptr() == Py_True) {
    o.alibi = true;
  } else if (!alibi.is_none() && alibi.ptr() != Py_False) {
    s.alibi_slopes = borrow(alibi, "alibi");
    o.alibi = true;
    o.alibi_slopes = s.alibi_slopes->view;
  }
  if (!softcap.is_none()) o.softcap = softcap.cast<double>();
  s.sinks = borrow_optional(sinks, "sinks");
  if (s.sinks) o.sinks = s.sinks->view;
  o.prefix = prefix;
  if (!scale.is_none()) o.scale = scale.cast<double>();
  if (masked_rows == "zero") {
    o.fully_masked_rows = attend::FullyMaskedRows::kZero;
  } else if (masked_rows != "uniform") {
    throw attend::Error("masked_rows must be 'uniform' or 'zero', got '" + masked_rows + "'");
  }
  if (compute == "float32") {
    o.compute = attend::ComputePrecision::kFloat32;
  } else if (compute == "bfloat16") {
    o.compute = attend::ComputePrecision::kBFloat16;
  } else if (compute != "auto") {
    throw attend::Error("compute must be 'auto', 'float32' or 'bfloat16', got '" + compute + "'");
  }
  if (num_threads < 0) throw attend::Error("num_threads must be >= 0 (0 = default)");
  s.num_threads = num_threads;
  return s;
}

const ServingOptions& options_or_default(const ServingOptions* options) {
  static const ServingOptions defaults;
  return options != nullptr ? *options : defaults;
}

// An output: the caller's array (borrowed writable), or a new tensor of `shape` and `dtype`
// handed back as `kind`.
struct Output {
  std::optional<Borrowed> borrowed;
  std::optional<Tensor> owned;
  TensorView view;

  Output(py::handle given, const char* name, DType dtype, const Shape& shape) {
    if (!given.is_none()) {
      borrowed = borrow(given, name, true);
      view = borrowed->view;
    } else {
      owned = Tensor(dtype, shape);
      view = owned->view();
    }
  }
  // The array the caller gets: its own, or the new one.
  py::object result(py::handle given, Kind kind) {
    if (borrowed) return py::reinterpret_borrow<py::object>(given);
    return to_python(std::move(*owned), kind);
  }
};

// An optional output: None (not computed), True (a new array), or the caller's array.
struct OptionalOutput {
  std::optional<Output> output;
  OptionalOutput(py::handle given, const char* name, const Shape& shape) {
    if (given.is_none() || given.ptr() == Py_False) return;
    output.emplace(given.ptr() == Py_True ? py::none() : given, name, DType::kFloat32, shape);
  }
  const TensorView* view() const { return output ? &output->view : nullptr; }
  py::object result(py::handle given, Kind kind) {
    return output ? output->result(given.ptr() == Py_True ? py::none() : given, kind) : py::none();
  }
};

int64_t dim(const TensorView& t, int d) { return d < t.rank() ? t.shape[d] : 0; }

// (total_q, H, Ev) for a (total_q, H, E) query and values of width Ev.
Shape output_shape(const TensorView& query, int64_t value_dim) {
  return Shape({dim(query, 0), dim(query, 1), value_dim});
}

// The result of a call with optional extras: the output alone, or (output, logsumexp,
// key_mass) when either extra was asked for.
py::object results(Output& out, py::handle out_given, OptionalOutput& lse, py::handle lse_given,
                   OptionalOutput* mass, py::handle mass_given, Kind kind) {
  py::object o = out.result(out_given, kind);
  if (!lse.output && (mass == nullptr || !mass->output)) return o;
  return py::make_tuple(o, lse.result(lse_given, kind),
                        mass != nullptr ? mass->result(mass_given, kind) : py::none());
}

// ---- paged attention over caller blocks, ragged batches -----------------------------------

// The blocks' elements read as `kv_format` (None: as their own dtype): 8-bit floats have no
// NumPy dtype, so their bits come as uint8 (as PagedKvCache's storage views give them).
TensorView blocks_as(const Borrowed& blocks, py::handle kv_format, const char* name) {
  TensorView view = blocks.view;
  if (kv_format.is_none()) return view;
  const DType format = dtype_named(py::str(kv_format));
  if (attend::dtype_size(format) != attend::dtype_size(view.dtype)) {
    throw attend::Error(std::string(name) + " of dtype " + attend::dtype_name(view.dtype) +
                        " cannot be read as kv_format " + attend::dtype_name(format) +
                        " (elements of another size)");
  }
  view.dtype = format;
  return view;
}

py::object paged_attention(py::handle query, py::handle cu_seqlens_q, py::handle key_blocks,
                           py::handle value_blocks, py::handle block_tables, py::handle seq_lens,
                           py::handle out, const ServingOptions* options, py::handle logsumexp,
                           py::handle key_mass, py::handle key_scales, py::handle value_scales,
                           py::handle kv_format) {
  const Borrowed q = borrow(query, "query"), cu = borrow(cu_seqlens_q, "cu_seqlens_q");
  const Borrowed kb = borrow(key_blocks, "key_blocks"), vb = borrow(value_blocks, "value_blocks");
  const Borrowed tables = borrow(block_tables, "block_tables"), lens = borrow(seq_lens, "seq_lens");
  const TensorView kbv = blocks_as(kb, kv_format, "key_blocks");
  const TensorView vbv = blocks_as(vb, kv_format, "value_blocks");
  const std::optional<Borrowed> ks = borrow_optional(key_scales, "key_scales");
  const std::optional<Borrowed> vs = borrow_optional(value_scales, "value_scales");
  Output o(out, "out", q.view.dtype, output_shape(q.view, dim(vb.view, 3)));
  OptionalOutput lse(logsumexp, "logsumexp", Shape({dim(q.view, 0), dim(q.view, 1)}));
  OptionalOutput mass(key_mass, "key_mass",
                      Shape({dim(tables.view, 0), dim(tables.view, 1) * dim(kb.view, 1)}));
  const attend::AttentionOptions call = options_or_default(options).resolved();
  {
    py::gil_scoped_release release;
    attend::paged_attention_into(q.view, cu.view, kbv, vbv, tables.view, lens.view, o.view, call,
                                 lse.view(), mass.view(), ks ? &ks->view : nullptr,
                                 vs ? &vs->view : nullptr);
  }
  return results(o, out, lse, logsumexp, &mass, key_mass, q.kind);
}

py::object varlen_attention(py::handle query, py::handle key, py::handle value,
                            py::handle cu_seqlens_q, py::handle cu_seqlens_k, py::handle out,
                            const ServingOptions* options, py::handle logsumexp) {
  const Borrowed q = borrow(query, "query"), k = borrow(key, "key"), v = borrow(value, "value");
  const Borrowed cq = borrow(cu_seqlens_q, "cu_seqlens_q"),
                 ck = borrow(cu_seqlens_k, "cu_seqlens_k");
  Output o(out, "out", q.view.dtype, output_shape(q.view, dim(v.view, 2)));
  OptionalOutput lse(logsumexp, "logsumexp", Shape({dim(q.view, 0), dim(q.view, 1)}));
  const attend::AttentionOptions call = options_or_default(options).resolved();
  {
    py::gil_scoped_release release;
    attend::varlen_attention_into(q.view, k.view, v.view, cq.view, ck.view, o.view, call,
                                  lse.view());
  }
  return results(o, out, lse, logsumexp, nullptr, py::none(), q.kind);
}

// ---- RoPE ----------------------------------------------------------------------------------

attend::RopeOptions make_rope(double base, bool interleaved, int64_t rotary_dim) {
  attend::RopeOptions r;
  r.base = base;
  r.convention =
      interleaved ? attend::RopeConvention::kInterleaved : attend::RopeConvention::kHalfSplit;
  r.rotary_dim = rotary_dim;
  return r;
}

void rope_apply(const attend::RopeOptions& rope, py::handle x, int64_t position_offset) {
  const Borrowed view = borrow(x, "x", true);
  py::gil_scoped_release release;
  attend::apply_rope(view.view, position_offset, rope);
}

void rope_apply_at(const attend::RopeOptions& rope, py::handle x, py::handle positions) {
  const Borrowed view = borrow(x, "x", true), at = borrow(positions, "positions");
  py::gil_scoped_release release;
  attend::apply_rope_at(view.view, at.view, rope);
}

// ---- the paged KV cache --------------------------------------------------------------------

// A view of the cache's storage as a NumPy array that keeps the cache alive. bfloat16 and the
// 8-bit floats have no NumPy dtype: their bits, as uint16 and uint8.
py::object storage_view(TensorView view, py::handle cache) {
  if (view.data == nullptr && view.rank() == 0) return py::none();
  if (view.dtype == DType::kBFloat16) view.dtype = DType::kUInt16;
  if (view.dtype == DType::kFloat8E4M3 || view.dtype == DType::kFloat8E5M2) view.dtype = DType::kUInt8;
  return numpy_view(view, cache);
}

// A storage view of the cache `self` (key_blocks, ..., value_scales) as a property.
template <TensorView (attend::PagedKvCache::*storage)() const>
py::object storage_property(py::object self) {
  return storage_view((self.cast<const attend::PagedKvCache&>().*storage)(), self);
}

void cache_append(attend::PagedKvCache& cache, const std::vector<int64_t>& ids, py::handle key,
                  py::handle value, py::handle cu_seqlens, const attend::RopeOptions* rope) {
  const Borrowed k = borrow(key, "key"), v = borrow(value, "value");
  const Borrowed cu = borrow(cu_seqlens, "cu_seqlens");
  py::gil_scoped_release release;
  cache.append(ids, k.view, v.view, cu.view, rope);
}

py::object cache_attend(const attend::PagedKvCache& cache, const std::vector<int64_t>& ids,
                        py::handle query, py::handle cu_seqlens_q, py::handle out,
                        const ServingOptions* options, py::handle logsumexp, py::handle key_mass) {
  const Borrowed q = borrow(query, "query"), cu = borrow(cu_seqlens_q, "cu_seqlens_q");
  const attend::KvCacheConfig& config = cache.config();
  const int64_t value_dim = config.value_dim > 0 ? config.value_dim : config.head_dim;
  Output o(out, "out", q.view.dtype, output_shape(q.view, value_dim));
  OptionalOutput lse(logsumexp, "logsumexp", Shape({dim(q.view, 0), dim(q.view, 1)}));
  // key_mass: (B, widest block table · block_size), as the C++ call checks.
  int64_t widest = 0;
  if (!key_mass.is_none() && key_mass.ptr() == Py_True) {
    for (const int64_t id : ids) {
      widest = std::max<int64_t>(widest, static_cast<int64_t>(cache.block_table(id).size()));
    }
  }
  OptionalOutput mass(key_mass, "key_mass",
                      Shape({static_cast<int64_t>(ids.size()), widest * config.block_size}));
  const attend::AttentionOptions call = options_or_default(options).resolved();
  {
    py::gil_scoped_release release;
    cache.attend(ids, q.view, cu.view, o.view, call, lse.view(), mass.view());
  }
  return results(o, out, lse, logsumexp, &mass, key_mass, q.kind);
}

// ---- prepared calls ------------------------------------------------------------------------

// A plan and the options object whose arrays it captured (kept alive with it).
struct Plan {
  std::optional<attend::AttentionPlan> plan;
  py::object options;  // the ServingOptions, or None
};

Plan make_plan(py::handle query, py::handle key, py::handle value, py::handle out,
               py::object options_object, bool variable_key_length, bool need_logsumexp) {
  const Borrowed q = borrow(query, "query"), k = borrow(key, "key"), v = borrow(value, "value");
  const Borrowed o = borrow(out, "out", true);
  const ServingOptions* options =
      options_object.is_none() ? nullptr : options_object.cast<const ServingOptions*>();
  attend::AttentionOptions call = options_or_default(options).resolved();
  call.need_logsumexp = need_logsumexp;
  Plan p;
  p.options = std::move(options_object);
  py::gil_scoped_release release;
  p.plan.emplace(q.view, k.view, v.view, o.view, call, variable_key_length);
  return p;
}

void plan_run(const Plan& p, py::handle query, py::handle key, py::handle value, py::handle out,
              py::handle logsumexp) {
  const Borrowed q = borrow(query, "query"), k = borrow(key, "key"), v = borrow(value, "value");
  const Borrowed o = borrow(out, "out", true);
  std::optional<Borrowed> lse;
  if (!logsumexp.is_none()) lse = borrow(logsumexp, "logsumexp", true);
  py::gil_scoped_release release;
  p.plan->run(q.view, k.view, v.view, o.view, lse ? &lse->view : nullptr);
}

// AttentionPlan.run(query, key, value, out, *, logsumexp=None): the per-step call, through
// the METH_FASTCALL convention (bindings.hpp).
PyObject* plan_run_fastcall(PyObject* self, PyObject* const* args, size_t nargsf,
                            PyObject* kwnames) {
  static const FastcallNames names{"query", "key", "value", "out", "logsumexp"};
  PyObject* a[5];
  if (!names.sort_or_raise("AttentionPlan.run", args, nargsf, kwnames, 4, 4, a)) return nullptr;
  try {
    plan_run(cpp_object<Plan>(self), a[0], a[1], a[2], a[3],
             a[4] != nullptr ? a[4] : Py_None);
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// A plan bound to the arrays of a decode loop that rewrites them in place each step: a call
// reads no shapes or strides. NumPy arrays are held (ndarray.resize refuses an array with
// other references, unless told refcheck=False); a torch tensor's data pointer is read each
// call and, when it moved (resize_, set_), the tensor is read again in full. Shapes and
// strides are those at bind time.
class BoundPlan {
 public:
  BoundPlan(py::object plan, py::handle query, py::handle key, py::handle value, py::handle out,
            py::handle logsumexp)
      : plan_object_(std::move(plan)), plan_(plan_object_.cast<const Plan*>()) {
    bind(query, "query", false);
    bind(key, "key", false);
    bind(value, "value", false);
    bind(out, "out", true);
    if (!logsumexp.is_none()) bind(logsumexp, "logsumexp", true);
  }
  BoundPlan(BoundPlan&&) = default;
  BoundPlan(const BoundPlan&) = delete;

  void run() {
    for (Argument& a : arguments_) {
      if (a.borrowed.kind == Kind::kTorch && torch_data_ptr(a.array) != a.borrowed.view.data) {
        a.borrowed = borrow(a.array, a.name, a.writable);
      }
    }
    const TensorView* lse = arguments_.size() > 4 ? &arguments_[4].borrowed.view : nullptr;
    py::gil_scoped_release release;
    plan_->plan->run(arguments_[0].borrowed.view, arguments_[1].borrowed.view,
                     arguments_[2].borrowed.view, arguments_[3].borrowed.view, lse);
  }

 private:
  struct Argument {
    py::object array;
    const char* name;
    bool writable;
    Borrowed borrowed;
  };
  void bind(py::handle array, const char* name, bool writable) {
    arguments_.push_back(Argument{py::reinterpret_borrow<py::object>(array), name, writable,
                                  borrow(array, name, writable)});
  }

  py::object plan_object_;
  const Plan* plan_;
  std::vector<Argument> arguments_;
};

// BoundPlan.__call__() without pybind11's dispatcher.
PyObject* bound_plan_call(PyObject* self, PyObject*) {
  try {
    cpp_object<BoundPlan>(self).run();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// Seconds per plan.run() of the C++ API itself on borrowed arrays (python_bench.py's
// baseline for a planned decode call), of the calling thread's CPU time or wall time.
double cpp_plan_seconds(const Plan& p, py::handle query, py::handle key, py::handle value,
                        py::handle out, int calls, bool thread_cpu_time) {
  const Borrowed q = borrow(query, "query"), k = borrow(key, "key"), v = borrow(value, "value");
  const Borrowed o = borrow(out, "out", true);
  py::gil_scoped_release release;
  const auto now = [thread_cpu_time] {
    timespec t;
    clock_gettime(thread_cpu_time ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  };
  p.plan->run(q.view, k.view, v.view, o.view);
  const double start = now();
  for (int i = 0; i < calls; ++i) p.plan->run(q.view, k.view, v.view, o.view);
  return (now() - start) / calls;
}

// ---- docstrings (shapes as in the C++ headers) ----------------------------------------------

constexpr const char* kOptionsDoc = R"(ServingOptions(*, causal=False, causal_alignment="bottom_right", window=None, alibi=None, softcap=None, sinks=None, prefix=0, scale=None, masked_rows="uniform", compute="auto", num_threads=0)

The score rules of serving calls (attend::AttentionOptions), made once and passed as
`options=` to PagedKvCache.attend, paged_attention, varlen_attention and AttentionPlan.
causal: query i of a sequence sees key j <= i + Lk - Lq ("bottom_right", as a decoder with a
cache needs) or j <= i ("top_left"). window: (left, right), None for an unbounded side.
alibi: True (default slopes) or float32 slopes (H). softcap: cap·tanh(s/cap). sinks: float32
(H). prefix: keys visible to every query. scale: multiplies Q·Kᵀ (default 1/sqrt(E)).
masked_rows: "uniform" or "zero" for rows that see no key. compute: "auto", "float32" or
"bfloat16" products. num_threads: 0 = attend.set_num_threads's setting. The slopes and sinks
arrays are read in place while the options live.)";

constexpr const char* kPagedDoc = R"(paged_attention(query, cu_seqlens_q, key_blocks, value_blocks, block_tables, seq_lens, *, out=None, options=None, logsumexp=None, key_mass=None, key_scales=None, value_scales=None, kv_format=None)

Attention of a batch over caller-owned paged blocks (vLLM's layout), attend::paged_attention_into.
query (total_q, H, E), cu_seqlens_q int32 (B + 1) packing the B sequences' queries;
key_blocks (num_blocks, block_size, Hkv, E) and value_blocks (num_blocks, block_size, Hkv, Ev),
float32, float16 or bfloat16, or int8, float8_e4m3 or float8_e5m2 with key_scales and
value_scales, float32 (num_blocks, block_size, Hkv), one per token and head (kv_format names
the blocks' format where their dtype cannot: "float8_e4m3" for uint8 bits, as
PagedKvCache.key_blocks gives them); block_tables int32 (B, max_blocks), -1 for evicted leading
blocks; seq_lens int32 (B): sequence s attends to its seq_lens[s] cached tokens, its queries
being the last of them. Returns out (total_q, H, Ev) of query's dtype (the given array,
written in place, or a new one of query's kind). logsumexp: True or a float32 (total_q, H)
array; key_mass: True or a float32 (B, max_blocks·block_size) array, the weight each cached
token receives summed over heads and queries. With either, returns (out, logsumexp, key_mass).
Bad tables or lengths raise attend.Error before anything is written.)";

constexpr const char* kVarlenDoc = R"(varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, *, out=None, options=None, logsumexp=None)

Attention of a ragged batch packed without padding (FlashAttention's varlen convention):
query (total_q, H, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev), cu_seqlens_q and
cu_seqlens_k int32 (B + 1), 0 = cu[0] <= ... <= cu[B] = total; attention never crosses
sequences, Hkv may divide H. Returns out (total_q, H, Ev) of query's dtype (bitwise B dense
calls), or (out, logsumexp, None) with logsumexp True or a float32 (total_q, H) array.)";

constexpr const char* kRopeDoc = R"(Rope(*, base=10000.0, interleaved=False, rotary_dim=0)

Rotary position embeddings (attend/rope.hpp): pair k of the first rotary_dim (0: all D)
dimensions turns by pos·base^(-2k/R); pairs (x[k], x[k + R/2]) (half split, Hugging Face's
rotate_half) or (x[2k], x[2k+1]) (interleaved). Pass to PagedKvCache.append to rotate keys as
they are written, or apply it in place.)";

constexpr const char* kRopeApplyDoc = R"(apply(x, position_offset=0)

Rotates x (..., L, D) float32, float16 or bfloat16 in place, any strides: the token at index l
of the second-to-last dimension has position position_offset + l. For (B, L, H, D) pass
x.transpose(1, 2) (a view).)";

constexpr const char* kRopeApplyAtDoc = R"(apply_at(x, positions)

Rotates x (tokens, ..., D) in place (a packed (total, H, D) batch): token t has position
positions[t], int32 or int64 (tokens).)";

constexpr const char* kCacheDoc = R"(PagedKvCache(num_blocks, *, block_size=16, kv_heads=1, head_dim=64, value_dim=0, dtype="float32")

A paged key/value cache (attend::PagedKvCache): blocks of block_size tokens, block tables per
sequence, a free list, fork with copy on write, sliding-window eviction. dtype: float32,
float16, bfloat16, or a quantized format with a float32 scale per token and head: int8,
float8_e4m3, float8_e5m2 (torch dtypes and NumPy dtypes are read by name). key_blocks
(num_blocks, block_size, kv_heads, head_dim) and value_blocks (..., value_dim) are NumPy views
of the storage (the bits as uint16 for bfloat16, uint8 for the 8-bit floats); key_scales and
value_scales (num_blocks, block_size, kv_heads) float32 for quantized formats, else None.
The GIL is released in append and attend; threads may work on different sequences at once.)";

constexpr const char* kAppendDoc = R"(append(ids, key, value, cu_seqlens, *, rope=None)

Writes the new tokens of sequences ids (B ints): key (total_new, kv_heads, head_dim) and value
(total_new, kv_heads, value_dim) of any floating dtype, cu_seqlens int32 (B + 1) packing
them. With rope (an attend.Rope) the keys are rotated at their positions in their sequence as
they are written (key itself is not changed). A cache without enough free blocks is refused
before anything is written.)";

constexpr const char* kCacheAttendDoc = R"(attend(ids, query, cu_seqlens_q, *, out=None, options=None, logsumexp=None, key_mass=None)

Attention of the batch in one call: sequence ids[s] has the packed queries of cu_seqlens_q
(query (total_q, H, head_dim), cu_seqlens_q int32 (B + 1)), the last of its cached tokens:
decode steps (1 query) and speculative verification (up to 16 read the blocks in place)
or prefill chunks. Returns out (total_q, H, value_dim) of query's dtype (the given array or a
new one of query's kind); with logsumexp (True or float32 (total_q, H)) or key_mass (True or
float32 (B, widest block table·block_size)), returns (out, logsumexp, key_mass).)";

constexpr const char* kPlanDoc = R"(AttentionPlan(query, key, value, out, *, options=None, variable_key_length=False, need_logsumexp=False)

A prepared attention call (attend::AttentionPlan) for a loop that repeats one layout:
query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev), out (..., Lq, Ev). The layout and
options are validated once; run() checks the arrays have that layout and runs the kernel
chosen here, bitwise the unprepared call's result. variable_key_length: run() takes keys of
any length (a growing cache). prepared: whether run() takes the prepared path (float32 with
contiguous rows).)";

constexpr const char* kPlanRunDoc = R"(run(query, key, value, out, *, logsumexp=None)

One call on new arrays of the planned layout, written into out (..., Lq, Ev) (and logsumexp
(..., Lq) float32 when planned with need_logsumexp). The GIL is released while it runs.)";

constexpr const char* kPlanBindDoc = R"(bind(query, key, value, out, *, logsumexp=None) -> BoundPlan

The plan tied to these arrays, for a loop that rewrites them in place each step (copy the
new query into `query`, read `out`): calling the result runs the plan without reading any
shape or stride again, the cheapest call from Python. The arrays are held (NumPy's resize
refuses them); a torch tensor whose data pointer moved is read again; shapes and strides are
those at bind time.)";

constexpr const char* kBoundPlanDoc = R"(An AttentionPlan bound to its arrays (AttentionPlan.bind); call it
to run: out (..., Lq, Ev) is written from query (..., Lq, E), key and value (..., Lk, ·) as
they are now.)";

}  // namespace

void bind_serving(py::module_& m) {
  py::class_<ServingOptions>(m, "ServingOptions", kOptionsDoc)
      .def(py::init(&make_options), py::kw_only(), py::arg("causal") = false,
           py::arg("causal_alignment") = "bottom_right", py::arg("window") = py::none(),
           py::arg("alibi") = py::none(), py::arg("softcap") = py::none(),
           py::arg("sinks") = py::none(), py::arg("prefix") = 0, py::arg("scale") = py::none(),
           py::arg("masked_rows") = "uniform", py::arg("compute") = "auto",
           py::arg("num_threads") = 0)
      .def_property_readonly(
          "causal", [](const ServingOptions& s) { return s.options.causal; }, "causal masking")
      .def_property_readonly(
          "scale", [](const ServingOptions& s) { return s.options.scale; },
          "the score scale, None for 1/sqrt(E)")
      .def_property_readonly(
          "num_threads", [](const ServingOptions& s) { return s.num_threads; },
          "threads per call, 0 for attend.get_num_threads()");

  m.def("paged_attention", &paged_attention, kPagedDoc, py::arg("query"), py::arg("cu_seqlens_q"),
        py::arg("key_blocks"), py::arg("value_blocks"), py::arg("block_tables"),
        py::arg("seq_lens"), py::kw_only(), py::arg("out") = py::none(),
        py::arg("options") = nullptr, py::arg("logsumexp") = py::none(),
        py::arg("key_mass") = py::none(), py::arg("key_scales") = py::none(),
        py::arg("value_scales") = py::none(), py::arg("kv_format") = py::none());
  m.def("varlen_attention", &varlen_attention, kVarlenDoc, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::kw_only(),
        py::arg("out") = py::none(), py::arg("options") = nullptr,
        py::arg("logsumexp") = py::none());

  py::class_<attend::RopeOptions>(m, "Rope", kRopeDoc)
      .def(py::init(&make_rope), py::kw_only(), py::arg("base") = 10000.0,
           py::arg("interleaved") = false, py::arg("rotary_dim") = 0)
      .def_readonly("base", &attend::RopeOptions::base, "the frequency base (10000 in most models)")
      .def_readonly("rotary_dim", &attend::RopeOptions::rotary_dim,
                    "R, the leading dimensions rotated (0: all of D)")
      .def_property_readonly(
          "interleaved",
          [](const attend::RopeOptions& r) {
            return r.convention == attend::RopeConvention::kInterleaved;
          },
          "pairs (x[2k], x[2k+1]) (GPT-J) when True, else (x[k], x[k + R/2]) (NeoX)")
      .def("apply", &rope_apply, kRopeApplyDoc, py::arg("x"), py::arg("position_offset") = 0)
      .def("apply_at", &rope_apply_at, kRopeApplyAtDoc, py::arg("x"), py::arg("positions"));

  py::class_<attend::PagedKvCache>(m, "PagedKvCache", kCacheDoc)
      .def(py::init([](int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                       int64_t value_dim, py::handle dtype) {
             attend::KvCacheConfig config;
             config.num_blocks = num_blocks;
             config.block_size = block_size;
             config.kv_heads = kv_heads;
             config.head_dim = head_dim;
             config.value_dim = value_dim;
             config.dtype = dtype_named(py::str(dtype));
             return new attend::PagedKvCache(config);
           }),
           py::arg("num_blocks"), py::kw_only(), py::arg("block_size") = 16,
           py::arg("kv_heads") = 1, py::arg("head_dim") = 64, py::arg("value_dim") = 0,
           py::arg("dtype") = "float32")
      .def_property_readonly(
          "num_blocks", [](const attend::PagedKvCache& c) { return c.config().num_blocks; },
          "N, the blocks of the pool")
      .def_property_readonly(
          "block_size", [](const attend::PagedKvCache& c) { return c.config().block_size; },
          "tokens per block")
      .def_property_readonly(
          "kv_heads", [](const attend::PagedKvCache& c) { return c.config().kv_heads; },
          "Hkv, the key/value heads")
      .def_property_readonly(
          "head_dim", [](const attend::PagedKvCache& c) { return c.config().head_dim; },
          "E, the key dimension")
      .def_property_readonly(
          "value_dim",
          [](const attend::PagedKvCache& c) {
            const attend::KvCacheConfig& config = c.config();
            return config.value_dim > 0 ? config.value_dim : config.head_dim;
          },
          "Ev, the value dimension")
      .def_property_readonly(
          "dtype",
          [](const attend::PagedKvCache& c) { return attend::dtype_name(c.config().dtype); },
          "the blocks' dtype name (\"float32\", ..., \"float8_e5m2\")")
      .def_property_readonly("free_blocks", &attend::PagedKvCache::free_blocks,
                             "blocks no sequence holds")
      .def_property_readonly("nbytes", &attend::PagedKvCache::bytes,
                             "bytes of the blocks and scales")
      .def_property_readonly("key_blocks", &storage_property<&attend::PagedKvCache::key_blocks>,
                             "the keys, a NumPy view (num_blocks, block_size, kv_heads, head_dim)")
      .def_property_readonly("value_blocks", &storage_property<&attend::PagedKvCache::value_blocks>,
                             "the values, a NumPy view (num_blocks, block_size, kv_heads, "
                             "value_dim)")
      .def_property_readonly("key_scales", &storage_property<&attend::PagedKvCache::key_scales>,
                             "int8/float8 caches: the keys' float32 scales, a NumPy view "
                             "(num_blocks, block_size, kv_heads); else None")
      .def_property_readonly("value_scales", &storage_property<&attend::PagedKvCache::value_scales>,
                             "int8/float8 caches: the values' float32 scales, a NumPy view "
                             "(num_blocks, block_size, kv_heads); else None")
      .def("add_sequence", &attend::PagedKvCache::add_sequence,
           "add_sequence() -> int: a new empty sequence; returns its id")
      .def("fork", &attend::PagedKvCache::fork,
           "fork(id) -> int: a new sequence sharing id's blocks (copy on write of a shared, "
           "partly filled last block at the next append); returns its id",
           py::arg("id"))
      .def("remove_sequence", &attend::PagedKvCache::remove_sequence,
           "remove_sequence(id): returns its blocks no other sequence shares to the free list",
           py::arg("id"))
      .def("length", &attend::PagedKvCache::length,
           "length(id) -> int: tokens appended so far (evicted ones included)", py::arg("id"))
      .def("block_table", &attend::PagedKvCache::block_table,
           "block_table(id) -> list[int]: the blocks of sequence id in order, -1 for evicted ones",
           py::arg("id"))
      .def("evict_outside_window", &attend::PagedKvCache::evict_outside_window,
           "evict_outside_window(id, window): frees the blocks whose every token j < length - "
           "window (what a sliding window of that size never reads again)",
           py::arg("id"), py::arg("window"))
      .def("append", &cache_append, kAppendDoc, py::arg("ids"), py::arg("key"), py::arg("value"),
           py::arg("cu_seqlens"), py::kw_only(), py::arg("rope") = nullptr)
      .def("attend", &cache_attend, kCacheAttendDoc, py::arg("ids"), py::arg("query"),
           py::arg("cu_seqlens_q"), py::kw_only(), py::arg("out") = py::none(),
           py::arg("options") = nullptr, py::arg("logsumexp") = py::none(),
           py::arg("key_mass") = py::none());

  py::class_<BoundPlan> bound(m, "BoundPlan", kBoundPlanDoc);
  py::class_<Plan> plan(m, "AttentionPlan", kPlanDoc);
  plan
      .def(py::init(&make_plan), py::arg("query"), py::arg("key"), py::arg("value"),
           py::arg("out"), py::kw_only(), py::arg("options") = py::none(),
           py::arg("variable_key_length") = false, py::arg("need_logsumexp") = false)
      .def(
          "bind",
          [](py::object self, py::handle query, py::handle key, py::handle value, py::handle out,
             py::handle logsumexp) {
            return BoundPlan(std::move(self), query, key, value, out, logsumexp);
          },
          kPlanBindDoc, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"),
          py::kw_only(), py::arg("logsumexp") = py::none())
      .def_property_readonly("prepared", [](const Plan& p) { return p.plan->prepared(); },
                             "whether run() takes the prepared path");
  static PyMethodDef run_method = {
      "run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_run_fastcall)),
      METH_FASTCALL | METH_KEYWORDS, kPlanRunDoc};
  add_method(plan, &run_method);
  static PyMethodDef call_method = {
      "__call__", bound_plan_call, METH_NOARGS,
      "__call__($self, /)\n--\n\nRuns the plan on the bound arrays: writes out (..., Lq, Ev) "
      "(and logsumexp (..., Lq))."};
  add_method(bound, &call_method);
  m.def("cpp_plan_seconds", &cpp_plan_seconds, py::arg("plan"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("out"), py::arg("calls"), py::arg("thread_cpu_time"),
        "Seconds per AttentionPlan::run on query (..., Lq, E), key, value (..., Lk, E/Ev), out "
        "(..., Lq, Ev) in a C++ loop of `calls` (bench/python_bench.py's baseline).");
}

}  // namespace attend_python
