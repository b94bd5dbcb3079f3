// sdpa_bindings.cpp: attend.scaled_dot_product_attention's C entry, and attend._attend.sdpa
// and sdpa_backward, the calls under it, attend.attention and their autograd function.
//
// PyTorch's arguments become attend's: a bool attn_mask is attend's `mask` (nonzero keeps), a
// float one its `bias` (added), is_causal the causal rule aligned top-left. The common call
// is handled by the C entry (sdpa_entry), the rest by attend/_functional.py. Here every array
// is borrowed in place, the options are filled, the GIL is released for the computation, and
// the results come back as the query's kind.
//
// enable_gqa (grouped-query attention): query (..., Hq, Lq, E), key and value (..., Hkv, Lk, ·),
// Hq = G·Hkv, query head h reading key/value head h / G (as repeat_interleave(G, dim=-3)):
// attend's own grouped-query attention (AttentionOptions::num_kv_heads = Hkv), which reads K
// and V in place, takes every score rule (ALiBi and sinks per query head) and sums the
// gradients of K and V over each group in float64, in a fixed order.
#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "arrays.hpp"
#include "attend/error.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "bindings.hpp"

namespace attend_python {
namespace {

using attend::DType;
using attend::Shape;
using attend::Tensor;
using attend::TensorView;

// Bits of `flags`, set by sdpa_entry and attend/_functional.py.
enum Flag : int {
  kCausal = 1 << 0,
  kTopLeft = 1 << 1,  // causal, window and ALiBi aligned as PyTorch (query i at i)
  kNeedWeights = 1 << 2,
  kNeedLogsumexp = 1 << 3,
  kZeroMaskedRows = 1 << 4,  // FullyMaskedRows::kZero
  kGroupedQuery = 1 << 5,    // enable_gqa
  kBackendFused = 1 << 6,
  kBackendReference = 1 << 7,
  // Return NotImplemented, computing nothing, when a torch input requires grad in grad mode:
  // the caller then takes the differentiable path (attend/_autograd.py).
  kUnlessGradNeeded = 1 << 8,
  // `mask` is PyTorch's attn_mask: bool marks the keys that take part (attend's mask), float
  // is added to the scores (attend's bias).
  kPyTorchMask = 1 << 9,
  // AttentionOptions::compute: kFloat32 or kBFloat16 (neither: kAuto).
  kComputeFloat32 = 1 << 10,
  kComputeBFloat16 = 1 << 11,
};

// The key/value heads of an enable_gqa call (Hkv), after PyTorch's checks of the shapes.
int64_t kv_heads_of(const TensorView& q, const TensorView& k, const TensorView& v) {
  if (q.rank() < 3 || k.rank() != q.rank() || v.rank() != q.rank()) {
    throw attend::Error("enable_gqa: query " + q.shape.str() + ", key " + k.shape.str() +
                        " and value " + v.shape.str() +
                        " need the same rank with a head dimension (..., H, L, E)");
  }
  const int64_t query_heads = q.shape.back(2), kv_heads = k.shape.back(2);
  if (v.shape.back(2) != kv_heads) {
    throw attend::Error("enable_gqa: key " + k.shape.str() + " and value " + v.shape.str() +
                        " differ in the number of heads");
  }
  if (kv_heads == 0 || query_heads % kv_heads != 0) {
    throw attend::Error("enable_gqa: query " + q.shape.str() + " has " +
                        std::to_string(query_heads) + " heads, not a multiple of the " +
                        std::to_string(kv_heads) + " heads of key " + k.shape.str());
  }
  return kv_heads;
}

// One call's borrowed arrays and its options.
struct Call {
  Borrowed query, key, value;
  std::optional<Borrowed> mask, bias, alibi_slopes, sinks, segment_query, segment_key;
  attend::AttentionOptions options;
  TensorView q, k, v;
  Kind kind() const { return query.kind; }
};

std::optional<int64_t> optional_int(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return h.cast<int64_t>();
}

// rules: None, or attend._functional.ScoreRules, read by field name: window_left and
// window_right (None for unbounded; both None: no window), alibi (None, True or a (H) slopes
// array), sinks, segment_ids_query, segment_ids_key, prefix, and each rule given by one number
// (attend::for_each_score_rule's std::optional<double> options: softcap), None or a float.
void parse_rules(Call& call, py::handle rules) {
  if (rules.is_none()) return;
  const auto field = [&](const char* name) { return rules.attr(name); };
  attend::AttentionOptions& o = call.options;
  const std::optional<int64_t> left = optional_int(field("window_left")),
                               right = optional_int(field("window_right"));
  if (left || right) {
    o.window = attend::SlidingWindow{left.value_or(attend::kUnboundedWindow),
                                     right.value_or(attend::kUnboundedWindow)};
  }
  const py::object alibi = field("alibi");
  if (alibi.ptr() == Py_True) {
    o.alibi = true;
  } else if (!alibi.is_none()) {
    call.alibi_slopes = borrow(alibi, "alibi_slopes");
    o.alibi = true;
    o.alibi_slopes = call.alibi_slopes->view;
  }
  call.sinks = borrow_optional(field("sinks"), "sinks");
  if (call.sinks) o.sinks = call.sinks->view;
  call.segment_query = borrow_optional(field("segment_ids_query"), "segment_ids (query)");
  call.segment_key = borrow_optional(field("segment_ids_key"), "segment_ids (key)");
  if (call.segment_query) o.segment_ids_query = call.segment_query->view;
  if (call.segment_key) o.segment_ids_key = call.segment_key->view;
  o.prefix = field("prefix").cast<int64_t>();
  // The rules given by one number (softcap): each the field of its name, None when not given.
  attend::for_each_score_rule(o, [&](const char* name, auto& member) {
    if constexpr (std::is_same_v<std::decay_t<decltype(member)>, std::optional<double>>) {
      const py::object number = field(name);
      if (!number.is_none()) member = number.cast<double>();
    }
  });
}

// PyTorch's attn_mask: whether it is additive (float: attend's bias) rather than a bool mask
// of the keys that take part (attend's mask). Throws for any other dtype, and with is_causal.
bool is_additive_mask(attend::DType dtype, bool causal) {
  if (causal) {
    throw attend::Error(
        "attn_mask and is_causal=True were both given; PyTorch refuses this too. For causal "
        "attention with a mask pass window=(None, 0) with the mask");
  }
  if (dtype == attend::DType::kBool) return false;
  if (attend::is_floating(dtype)) return true;
  throw ArgumentTypeError(std::string("attn_mask: dtype ") + attend::dtype_name(dtype) +
                          " is neither bool (True: the key takes part) nor floating point "
                          "(added to the scores)");
}

Call parse_call(py::handle query, py::handle key, py::handle value, py::handle mask,
                py::handle bias, py::handle rules, py::handle scale, double dropout, uint64_t seed,
                int flags, int num_threads) {
  Call call;
  call.query = borrow(query, "query");
  call.key = borrow(key, "key");
  call.value = borrow(value, "value");
  attend::AttentionOptions& o = call.options;
  if ((flags & kPyTorchMask) && !mask.is_none()) {
    Borrowed attn_mask = borrow(mask, "attn_mask");
    const bool additive = is_additive_mask(attn_mask.view.dtype, (flags & kCausal) != 0);
    (additive ? call.bias : call.mask) = std::move(attn_mask);
  } else {
    call.mask = borrow_optional(mask, "mask");
    call.bias = borrow_optional(bias, "bias");
  }
  if (call.mask) o.mask = call.mask->view;
  if (call.bias) o.bias = call.bias->view;
  parse_rules(call, rules);
  if (!scale.is_none()) o.scale = scale.cast<double>();
  o.dropout = dropout;
  o.seed = seed;
  o.causal = (flags & kCausal) != 0;
  o.causal_alignment = (flags & kTopLeft) ? attend::CausalAlignment::kTopLeft
                                          : attend::CausalAlignment::kBottomRight;
  o.fully_masked_rows = (flags & kZeroMaskedRows) ? attend::FullyMaskedRows::kZero
                                                  : attend::FullyMaskedRows::kUniform;
  o.backend = (flags & kBackendReference) ? attend::Backend::kReference
              : (flags & kBackendFused)   ? attend::Backend::kFused
                                          : attend::Backend::kAuto;
  o.num_threads = resolve_num_threads(num_threads);
  o.compute = (flags & kComputeBFloat16)  ? attend::ComputePrecision::kBFloat16
              : (flags & kComputeFloat32) ? attend::ComputePrecision::kFloat32
                                          : attend::ComputePrecision::kAuto;

  call.q = call.query.view;
  call.k = call.key.view;
  call.v = call.value.view;
  if (flags & kGroupedQuery) {
    o.num_kv_heads = kv_heads_of(call.q, call.k, call.v);
  } else if (call.q.rank() >= 3) {
    // Without enable_gqa PyTorch refuses key/value heads that differ from the query's;
    // attend would infer grouped-query attention from such shapes: state the heads.
    o.num_kv_heads = call.q.shape.back(2);
  }
  return call;
}

// Shapes of the results as the caller sees them (query's heads unsplit).
struct ResultShapes {
  Shape output, weights, logsumexp;
};

ResultShapes result_shapes(const Call& call) {
  const TensorView &q = call.query.view, &k = call.key.view, &v = call.value.view;
  ResultShapes s;
  if (q.rank() < 2 || k.rank() < 2 || v.rank() < 2) return s;  // attend reports it
  for (int d = 0; d < q.rank() - 2; ++d) s.output.push_back(q.shape[d]);
  s.weights = s.output;
  s.logsumexp = s.output;
  s.output.push_back(q.shape.back(1));
  s.output.push_back(v.shape.back(0));
  s.weights.push_back(q.shape.back(1));
  s.weights.push_back(k.shape.back(1));
  s.logsumexp.push_back(q.shape.back(1));
  return s;
}

// Whether a torch input that autograd would differentiate (query, key, value, bias, sinks)
// requires grad while grad mode is on.
bool grad_needed(const Call& call) {
  bool any = false;
  for (const Borrowed* b : {&call.query, &call.key, &call.value, call.bias ? &*call.bias : nullptr,
                            call.sinks ? &*call.sinks : nullptr}) {
    if (b != nullptr && b->kind == Kind::kTorch && requires_grad(b->object())) any = true;
  }
  return any && torch_grad_enabled();
}

}  // namespace

// sdpa(query, key, value, mask, bias, rules, scale, dropout, seed, flags, num_threads, out)
// -> (output, weights or None, logsumexp or None) when weights or logsumexp are asked for,
// else the output alone (or NotImplemented, see kUnlessGradNeeded). `out`, when not None,
// receives the output (any strides) and is returned as it is.
py::object sdpa(py::handle query, py::handle key, py::handle value, py::handle mask,
                py::handle bias, py::handle rules, py::handle scale, double dropout, uint64_t seed,
                int flags, int num_threads, py::handle out) {
  Call call =
      parse_call(query, key, value, mask, bias, rules, scale, dropout, seed, flags, num_threads);
  if ((flags & kUnlessGradNeeded) && grad_needed(call)) {
    return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  }
  const ResultShapes shapes = result_shapes(call);
  const Kind kind = call.kind();
  std::optional<Borrowed> out_view;
  Tensor output, weights, logsumexp;
  attend::AttentionOutputViews views;
  if (!out.is_none()) {
    out_view = borrow(out, "out", /*writable=*/true);
    if (out_view->kind == Kind::kTorch && requires_grad(out)) {
      throw attend::Error("out: a tensor that requires grad cannot be written in place");
    }
    views.output = out_view->view;
  } else {
    output = Tensor(call.q.dtype, shapes.output);
    views.output = output.view();
  }
  if (flags & kNeedWeights) {
    weights = Tensor(DType::kFloat32, shapes.weights);
    views.weights = weights.view();
  }
  if (flags & kNeedLogsumexp) {
    logsumexp = Tensor(DType::kFloat32, shapes.logsumexp);
    views.logsumexp = logsumexp.view();
  }
  {
    py::gil_scoped_release release;
    attend::scaled_dot_product_attention_into(call.q, call.k, call.v, views, call.options);
  }
  py::object result_output =
      out_view ? py::reinterpret_borrow<py::object>(out) : to_python(std::move(output), kind);
  if (!(flags & (kNeedWeights | kNeedLogsumexp))) return result_output;
  return py::make_tuple(result_output, to_python_or_none(std::move(weights), kind),
                        to_python_or_none(std::move(logsumexp), kind));
}

// sdpa_backward(grad_output, query, key, value, output, logsumexp, mask, bias, rules, scale,
// dropout, seed, flags, num_threads, want_bias, want_sinks) -> (dq, dk, dv, dbias or None,
// dsinks or None), with the options of the forward that gave output and logsumexp.
py::tuple sdpa_backward(py::handle grad_output, py::handle query, py::handle key, py::handle value,
                        py::handle output, py::handle logsumexp, py::handle mask, py::handle bias,
                        py::handle rules, py::handle scale, double dropout, uint64_t seed,
                        int flags, int num_threads, bool want_bias, bool want_sinks) {
  Call call =
      parse_call(query, key, value, mask, bias, rules, scale, dropout, seed, flags, num_threads);
  const Kind kind = call.kind();
  Borrowed grad_output_view = borrow(grad_output, "grad_output");
  Borrowed output_view = borrow(output, "output");
  Borrowed logsumexp_view = borrow(logsumexp, "logsumexp");
  const TensorView &d_o = grad_output_view.view, &o = output_view.view,
                   &lse = logsumexp_view.view;

  Tensor dq(call.q.dtype, call.q.shape);
  Tensor dk(call.k.dtype, call.k.shape);
  Tensor dv(call.v.dtype, call.v.shape);
  Tensor dbias, dsinks;
  attend::AttentionGradientViews views{dq.view(), dk.view(), dv.view(), {}, {}};
  if (want_bias && call.options.bias) {
    dbias = Tensor(call.options.bias->dtype, call.options.bias->shape);
    views.bias = dbias.view();
  }
  if (want_sinks && call.options.sinks) {
    dsinks = Tensor(call.options.sinks->dtype, call.options.sinks->shape);
    views.sinks = dsinks.view();
  }
  {
    py::gil_scoped_release release;
    attend::scaled_dot_product_attention_backward_into(d_o, call.q, call.k, call.v, o, lse, views,
                                                       call.options);
  }
  return py::make_tuple(to_python(std::move(dq), kind), to_python(std::move(dk), kind),
                        to_python(std::move(dv), kind), to_python_or_none(std::move(dbias), kind),
                        to_python_or_none(std::move(dsinks), kind));
}

namespace {

// sdpa as a METH_FASTCALL function: pybind11's dispatcher costs about 0.5 us for twelve
// arguments, a sixth of the overhead budget of a small call.
PyObject* sdpa_fastcall(PyObject*, PyObject* const* args, Py_ssize_t count) {
  try {
    if (count != 12) throw attend::Error("internal: sdpa takes 12 arguments");
    const double dropout = PyFloat_AsDouble(args[7]);
    const uint64_t seed = PyLong_AsUnsignedLongLong(args[8]);
    const long flags = PyLong_AsLong(args[9]);
    const long num_threads = PyLong_AsLong(args[10]);
    if (PyErr_Occurred()) throw py::error_already_set();
    py::object result =
        sdpa(args[0], args[1], args[2], args[3], args[4], args[5], args[6], dropout, seed,
             static_cast<int>(flags), static_cast<int>(num_threads), args[11]);
    return result.release().ptr();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

// attend.scaled_dot_product_attention itself, in C: a Python function's frame and argument
// handling cost half a microsecond of the 3 us a small call may add. This handles PyTorch's
// arguments with return_weights, seed, num_threads and out; anything else (another keyword,
// dropout without a seed, a torch input that requires grad, wrong arguments) goes to the
// Python implementation, attend._functional.scaled_dot_product_attention, with the call as
// it was made.
enum EntryArgument : int {
  kQuery,
  kKey,
  kValue,
  kAttnMask,
  kDropoutP,
  kIsCausal,
  kScale,
  kEnableGqa,  // positional
  kReturnWeights,
  kSeed,
  kNumThreads,
  kOut,  // keyword only
  kEntryArguments
};
constexpr int kPositionalArguments = kEnableGqa + 1;

PyObject* python_implementation(PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  static PyObject* function = nullptr;  // never released: lives as long as the module
  if (function == nullptr) {
    PyObject* module = PyImport_ImportModule("attend._functional");
    if (module == nullptr) return nullptr;
    function = PyObject_GetAttrString(module, "scaled_dot_product_attention");
    Py_DECREF(module);
    if (function == nullptr) return nullptr;
  }
  return PyObject_Vectorcall(function, args, nargsf, kwnames);
}

PyObject* sdpa_entry(PyObject*, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  static const FastcallNames names{"query",     "key",        "value",          "attn_mask",
                                   "dropout_p", "is_causal",  "scale",          "enable_gqa",
                                   "return_weights", "seed",  "num_threads",    "out"};
  const auto defer = [&] { return python_implementation(args, nargsf, kwnames); };
  PyObject* a[kEntryArguments];
  if (!names.sort(args, PyVectorcall_NARGS(nargsf), kwnames, kPositionalArguments, a)) {
    return defer();
  }
  if (a[kQuery] == nullptr || a[kKey] == nullptr || a[kValue] == nullptr) return defer();
  const auto given = [&](int i) { return a[i] != nullptr && a[i] != Py_None; };
  const auto truth = [&](int i) { return a[i] != nullptr && PyObject_IsTrue(a[i]) == 1; };
  try {
    const double dropout = given(kDropoutP) ? PyFloat_AsDouble(a[kDropoutP]) : 0.0;
    const uint64_t seed = given(kSeed) ? PyLong_AsUnsignedLongLong(a[kSeed]) : 0;
    const long num_threads = given(kNumThreads) ? PyLong_AsLong(a[kNumThreads]) : 0;
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return defer();  // the Python implementation reports it
    }
    if (dropout != 0.0 && !given(kSeed)) return defer();  // the seed comes from torch or NumPy
    const bool return_weights = truth(kReturnWeights);
    int flags = kTopLeft | kUnlessGradNeeded | kPyTorchMask;
    if (truth(kIsCausal)) flags |= kCausal;
    if (truth(kEnableGqa)) flags |= kGroupedQuery;
    if (return_weights) flags |= kNeedWeights;
    const py::handle none = Py_None;
    const auto handle = [&](int i) { return a[i] ? py::handle(a[i]) : none; };
    py::object result =
        sdpa(a[kQuery], a[kKey], a[kValue], handle(kAttnMask), none, none, handle(kScale), dropout,
             seed, flags, static_cast<int>(num_threads), handle(kOut));
    if (result.ptr() == Py_NotImplemented) return defer();  // gradients: attend/_autograd.py
    if (!return_weights) return result.release().ptr();
    return py::make_tuple(result[py::int_(0)], result[py::int_(1)]).release().ptr();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyMethodDef sdpa_entry_method = {
    "scaled_dot_product_attention",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sdpa_entry)),
    METH_FASTCALL | METH_KEYWORDS, nullptr};  // the docstring is set from Python

PyMethodDef sdpa_method = {
    "sdpa", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sdpa_fastcall)),
    METH_FASTCALL,
    "sdpa(query, key, value, mask, bias, rules, scale, dropout, seed, "
    "flags, num_threads, out): see sdpa_bindings.cpp"};

}  // namespace

void bind_sdpa(py::module_& m) {
  m.attr("sdpa") = py::reinterpret_steal<py::object>(PyCFunction_New(&sdpa_method, nullptr));
  m.attr("scaled_dot_product_attention") =
      py::reinterpret_steal<py::object>(PyCFunction_New(&sdpa_entry_method, nullptr));
  // (mask, bias): PyTorch's attn_mask as attend's, by the rule of the C entry.
  m.def(
      "split_attn_mask",
      [](py::object attn_mask, bool is_causal) {
        const Borrowed view = borrow(attn_mask, "attn_mask");
        const bool additive = is_additive_mask(view.view.dtype, is_causal);
        return additive ? py::make_tuple(py::none(), attn_mask)
                        : py::make_tuple(attn_mask, py::none());
      },
      py::arg("attn_mask"), py::arg("is_causal"),
      "PyTorch's attn_mask (broadcastable to (..., Hq, Lq, Lk)) as attend's (mask, bias): bool -> "
      "(mask, None), float -> (None, mask)");
  // The entry's docstring (with its signature line, for inspect) is the Python
  // implementation's; set once at import (attend/__init__.py).
  m.def(
      "set_entry_doc",
      [](const std::string& doc) {
        static std::string* text = new std::string;  // outlives the function object
        *text = doc;
        sdpa_entry_method.ml_doc = text->c_str();
      },
      py::arg("doc"), "Sets scaled_dot_product_attention's docstring (once, at import)");
  m.def("sdpa_backward", &sdpa_backward, py::arg("grad_output"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("output"), py::arg("logsumexp"), py::arg("mask"), py::arg("bias"),
        py::arg("rules"), py::arg("scale"), py::arg("dropout"), py::arg("seed"), py::arg("flags"),
        py::arg("num_threads"), py::arg("want_bias"), py::arg("want_sinks"),
        "The gradients of sdpa's call: grad_output (..., Hq, Lq, Ev), query (..., Hq, Lq, E), "
        "key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev), output, logsumexp (..., Hq, Lq) -> "
        "(d_query, d_key, d_value, d_bias or None, d_sinks or None) of the inputs' shapes");
  m.attr("FLAG_CAUSAL") = int{kCausal};
  m.attr("FLAG_TOP_LEFT") = int{kTopLeft};
  m.attr("FLAG_NEED_WEIGHTS") = int{kNeedWeights};
  m.attr("FLAG_NEED_LOGSUMEXP") = int{kNeedLogsumexp};
  m.attr("FLAG_ZERO_MASKED_ROWS") = int{kZeroMaskedRows};
  m.attr("FLAG_GROUPED_QUERY") = int{kGroupedQuery};
  m.attr("FLAG_BACKEND_FUSED") = int{kBackendFused};
  m.attr("FLAG_BACKEND_REFERENCE") = int{kBackendReference};
  m.attr("FLAG_UNLESS_GRAD_NEEDED") = int{kUnlessGradNeeded};
  m.attr("FLAG_COMPUTE_FLOAT32") = int{kComputeFloat32};
  m.attr("FLAG_COMPUTE_BFLOAT16") = int{kComputeBFloat16};
}

}  // namespace attend_python
