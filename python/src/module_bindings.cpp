// module_bindings.cpp: the C++ modules (MultiHeadAttention, SpatialSelfAttention,
// PatchEmbedding, position and token embeddings) and the safetensors reader and writer.
//
// Parameters stay in the C++ objects; `parameters()` gives writable NumPy views of them under
// PyTorch's state_dict names (the views keep the object alive). Masks given here already have
// attend's polarity (nonzero keeps): attend/_modules.py converts PyTorch's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "arrays.hpp"
#include "attend/multihead.hpp"
#include "attend/positional.hpp"
#include "attend/safetensors.hpp"
#include "attend/spatial.hpp"
#include "bindings.hpp"

namespace attend_python {
namespace {

using attend::Tensor;
using attend::TensorView;

bool is_present(const TensorView& view) { return view.data != nullptr || view.rank() > 0; }

py::dict parameter_views(const std::map<std::string, TensorView>& views, py::handle owner,
                         const std::string& prefix = "") {
  py::dict result;
  for (const auto& [name, view] : views) {
    if (is_present(view)) result[py::str(prefix + name)] = numpy_view(view, owner);
  }
  return result;
}

// name -> array, copied into float tensors the C++ module then checks and takes.
std::map<std::string, Tensor> tensors_of(const py::dict& state) {
  std::map<std::string, Tensor> tensors;
  for (const auto& [key, value] : state) {
    const std::string name = py::str(key);
    const Borrowed array = borrow(value, name.c_str());
    tensors.emplace(name, Tensor::copy_of(array.view));
  }
  return tensors;
}

// What forward() keeps for backward(); opaque to Python.
struct Tape {
  attend::MultiHeadTape tape;
};

attend::MultiHeadForwardOptions forward_options(py::handle key_padding_mask, py::handle attn_mask,
                                                bool causal, bool need_weights, bool average,
                                                double dropout, uint64_t seed, int num_threads,
                                                std::optional<Borrowed>& padding,
                                                std::optional<Borrowed>& mask) {
  attend::MultiHeadForwardOptions o;
  padding = borrow_optional(key_padding_mask, "key_padding_mask");
  mask = borrow_optional(attn_mask, "attn_mask");
  if (padding) o.key_padding_mask = padding->view;
  if (mask) o.attn_mask = mask->view;
  o.causal = causal;
  o.need_weights = need_weights;
  o.average_weights_over_heads = average;
  o.dropout = dropout;
  o.seed = seed;
  o.num_threads = resolve_num_threads(num_threads);
  return o;
}

// The view with axes 0 and 1 exchanged: (L, N, E) read as (N, L, E), in place.
TensorView swap_leading_axes(TensorView view) {
  std::swap(view.shape[0], view.shape[1]);
  std::swap(view.strides[0], view.strides[1]);
  return view;
}

// forward(x, num_threads) of a module that maps one tensor to one (SpatialSelfAttention,
// PatchEmbedding): the result in x's kind (NumPy or torch), the GIL released while it runs.
template <class Module>
py::object forward_one(const Module& module, py::handle x, int num_threads) {
  const Borrowed input = borrow(x, "x");
  Tensor output;
  {
    py::gil_scoped_release release;
    output = module.forward(input.view, resolve_num_threads(num_threads));
  }
  return to_python(std::move(output), input.kind);
}

}  // namespace

// See bindings.hpp.
py::tuple multihead_forward(const attend::MultiHeadAttention& module, py::handle query,
                            py::handle key, py::handle value, py::handle key_padding_mask,
                            py::handle attn_mask, bool causal, bool need_weights, bool average,
                            double dropout, uint64_t seed, int num_threads, bool want_tape,
                            bool sequence_first) {
  // One borrow per distinct object, so that self-attention is seen as such (one view).
  const Borrowed q_own = borrow(query, "query");
  std::optional<Borrowed> k_own, v_own;
  if (!key.is(query)) k_own = borrow(key, "key");
  if (!value.is(query) && !value.is(key)) v_own = borrow(value, "value");
  const bool swap = sequence_first && q_own.view.rank() == 3;
  const auto in = [&](const TensorView& v) { return swap ? swap_leading_axes(v) : v; };
  const TensorView q = in(q_own.view);
  const TensorView k = k_own ? in(k_own->view) : q;
  const TensorView v = v_own ? in(v_own->view) : value.is(query) ? q : k;
  std::optional<Borrowed> padding, mask;
  const attend::MultiHeadForwardOptions options =
      forward_options(key_padding_mask, attn_mask, causal, need_weights, average, dropout, seed,
                      num_threads, padding, mask);
  std::unique_ptr<Tape> tape = want_tape ? std::make_unique<Tape>() : nullptr;
  attend::MultiHeadResult result;
  {
    py::gil_scoped_release release;
    result = module.forward(q, k, v, options, tape ? &tape->tape : nullptr);
  }
  py::object tape_object = tape ? py::cast(std::move(tape)) : py::none();
  return py::make_tuple(to_python(std::move(result.output), q_own.kind, std::nullopt, swap),
                        to_python_or_none(std::move(result.weights), q_own.kind), tape_object);
}

namespace {

// backward(grad_output, query, key, value, tape, key_padding_mask, attn_mask, causal,
// dropout, seed, num_threads) -> (d_query, d_key or None, d_value or None, {name: d_param})
// d_key is None when key is query (its gradient is in d_query), likewise d_value.
py::tuple multihead_backward(const attend::MultiHeadAttention& module, py::handle grad_output,
                             py::handle query, py::handle key, py::handle value, const Tape& tape,
                             py::handle key_padding_mask, py::handle attn_mask, bool causal,
                             double dropout, uint64_t seed, int num_threads) {
  const Borrowed d_o = borrow(grad_output, "grad_output");
  const Borrowed q = borrow(query, "query");
  std::optional<Borrowed> k_own, v_own;
  if (!key.is(query)) k_own = borrow(key, "key");
  if (!value.is(query) && !value.is(key)) v_own = borrow(value, "value");
  const TensorView k = k_own ? k_own->view : q.view;
  const TensorView v = v_own ? v_own->view : value.is(query) ? q.view : k;
  std::optional<Borrowed> padding, mask;
  const attend::MultiHeadForwardOptions options = forward_options(
      key_padding_mask, attn_mask, causal, false, false, dropout, seed, num_threads, padding, mask);
  attend::MultiHeadGradients gradients;
  {
    py::gil_scoped_release release;
    gradients = module.backward(d_o.view, q.view, k, v, tape.tape, options);
  }
  py::dict parameters;
  for (auto& [name, gradient] : gradients.parameters) {
    parameters[py::str(name)] = to_python(std::move(gradient), q.kind);
  }
  return py::make_tuple(to_python_or_none(std::move(gradients.query), q.kind),
                        to_python_or_none(std::move(gradients.key), q.kind),
                        to_python_or_none(std::move(gradients.value), q.kind), parameters);
}

// multihead_forward as a METH_FASTCALL function (the module first): pybind11's dispatcher
// costs about a microsecond for thirteen arguments.
PyObject* multihead_forward_fastcall(PyObject*, PyObject* const* args, Py_ssize_t count) {
  try {
    if (count != 13) throw attend::Error("internal: multihead_forward takes 13 arguments");
    const auto& module = py::handle(args[0]).cast<const attend::MultiHeadAttention&>();
    const auto flag = [&](int i) { return PyObject_IsTrue(args[i]) == 1; };
    const double dropout = PyFloat_AsDouble(args[9]);
    const uint64_t seed = PyLong_AsUnsignedLongLong(args[10]);
    const long num_threads = PyLong_AsLong(args[11]);
    if (PyErr_Occurred()) throw py::error_already_set();
    return multihead_forward(module, args[1], args[2], args[3], args[4], args[5], flag(6), flag(7),
                             flag(8), dropout, seed, static_cast<int>(num_threads), flag(12))
        .release()
        .ptr();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyMethodDef multihead_forward_method = {
    "multihead_forward",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(multihead_forward_fastcall)),
    METH_FASTCALL,
    "multihead_forward(module, query, key, value, key_padding_mask, attn_mask, causal, "
    "need_weights, average, dropout, seed, num_threads, want_tape) -> (output, weights or "
    "None, tape or None); masks nonzero keeps"};

}  // namespace

void bind_modules(py::module_& m) {
  m.attr("multihead_forward") =
      py::reinterpret_steal<py::object>(PyCFunction_New(&multihead_forward_method, nullptr));
  bind_multihead_call(m);
  py::class_<Tape>(m, "MultiHeadTape");

  py::class_<attend::MultiHeadAttention>(m, "MultiHeadAttention")
      .def(py::init([](int64_t embed_dim, int64_t num_heads, bool bias, int64_t kdim, int64_t vdim,
                       uint64_t seed) {
             attend::MultiHeadOptions options;
             options.bias = bias;
             options.kdim = kdim;
             options.vdim = vdim;
             return std::make_unique<attend::MultiHeadAttention>(embed_dim, num_heads, options,
                                                                 seed);
           }),
           py::arg("embed_dim"), py::arg("num_heads"), py::arg("bias") = true, py::arg("kdim") = 0,
           py::arg("vdim") = 0, py::arg("seed") = 0)
      .def_property_readonly("embed_dim", &attend::MultiHeadAttention::embed_dim)
      .def_property_readonly("num_heads", &attend::MultiHeadAttention::num_heads)
      .def_property_readonly("kdim", &attend::MultiHeadAttention::kdim)
      .def_property_readonly("vdim", &attend::MultiHeadAttention::vdim)
      .def_property_readonly("has_bias", &attend::MultiHeadAttention::has_bias)
      .def_property_readonly("packed_in_projection",
                             &attend::MultiHeadAttention::packed_in_projection)
      .def(
          "parameters",
          [](py::object self) {
            return parameter_views(self.cast<attend::MultiHeadAttention&>().state_dict(), self);
          },
          "state_dict name -> writable NumPy view of the C++ memory (in_proj_weight (3E, E) "
          "or q/k/v_proj_weight, in_proj_bias (3E), out_proj.weight (E, E), out_proj.bias (E))")
      .def(
          "load_state_dict",
          [](attend::MultiHeadAttention& module, const py::dict& state) {
            module.load_state_dict(tensors_of(state));
          },
          py::arg("state"), "Copies name -> array (the shapes of parameters()) into the module")
      .def("load", &attend::MultiHeadAttention::load, py::call_guard<py::gil_scoped_release>(),
           py::arg("path"), "Loads a safetensors file holding a state_dict")
      .def("save", &attend::MultiHeadAttention::save, py::call_guard<py::gil_scoped_release>(),
           py::arg("path"), "Saves the state_dict as a safetensors file")
      .def("backward", &multihead_backward, py::arg("grad_output"), py::arg("query"),
           py::arg("key"), py::arg("value"), py::arg("tape"), py::arg("key_padding_mask"),
           py::arg("attn_mask"), py::arg("causal"), py::arg("dropout"), py::arg("seed"),
           py::arg("num_threads"),
           "grad_output (N, L, E) of multihead_forward's call -> (d_query (N, L, E), d_key "
           "(N, S, kdim) or None, d_value (N, S, vdim) or None, {name: d_parameter}); None "
           "where key or value is the query object");

  py::class_<attend::SpatialSelfAttention>(m, "SpatialSelfAttention")
      .def(py::init(
               [](int64_t channels, int64_t num_heads, int64_t groups, double eps, uint64_t seed) {
                 attend::SpatialAttentionOptions options;
                 options.group_norm_groups = groups;
                 options.eps = eps;
                 return std::make_unique<attend::SpatialSelfAttention>(channels, num_heads, options,
                                                                       seed);
               }),
           py::arg("channels"), py::arg("num_heads"), py::arg("groups"), py::arg("eps"),
           py::arg("seed"))
      .def_property_readonly("channels", &attend::SpatialSelfAttention::channels, "C")
      .def("parameters",
           [](py::object self) {
             auto& module = self.cast<attend::SpatialSelfAttention&>();
             py::dict result = parameter_views(
                 {{"norm.weight", module.norm_weight()}, {"norm.bias", module.norm_bias()}}, self);
             result.attr("update")(
                 parameter_views(module.attention().state_dict(), self, "attention."));
             return result;
           })
      .def("forward", &forward_one<attend::SpatialSelfAttention>, py::arg("x"), py::arg("num_threads"),
           "x (N, C, H, W) -> (N, C, H, W)");

  py::class_<attend::PatchEmbedding>(m, "PatchEmbedding")
      .def(py::init([](int64_t in_channels, int64_t patch_size, int64_t embed_dim, bool class_token,
                       bool position_embeddings, int64_t image_height, int64_t image_width,
                       uint64_t seed) {
             attend::PatchEmbeddingOptions options;
             options.class_token = class_token;
             options.position_embeddings = position_embeddings;
             options.image_height = image_height;
             options.image_width = image_width;
             return std::make_unique<attend::PatchEmbedding>(in_channels, patch_size, embed_dim,
                                                             options, seed);
           }),
           py::arg("in_channels"), py::arg("patch_size"), py::arg("embed_dim"),
           py::arg("class_token"), py::arg("position_embeddings"), py::arg("image_height"),
           py::arg("image_width"), py::arg("seed"))
      .def("parameters",
           [](py::object self) {
             auto& module = self.cast<attend::PatchEmbedding&>();
             return parameter_views({{"projection.weight", module.projection_weight()},
                                     {"projection.bias", module.projection_bias()},
                                     {"class_token", module.class_token()},
                                     {"position_embeddings", module.position_embeddings()}},
                                    self);
           })
      .def("forward", &forward_one<attend::PatchEmbedding>, py::arg("x"), py::arg("num_threads"),
           "x (N, C, H, W) -> (N, [1 +] P, D)");

  py::class_<attend::PositionEmbedding>(m, "PositionEmbedding")
      .def(py::init<int64_t, int64_t, uint64_t>(), py::arg("max_length"), py::arg("dim"),
           py::arg("seed"))
      .def("parameters",
           [](py::object self) {
             return parameter_views({{"weight", self.cast<attend::PositionEmbedding&>().table()}},
                                    self);
           })
      .def(
          "forward",
          [](const attend::PositionEmbedding& module, int64_t length, int64_t offset) {
            return to_python(module.forward(length, offset), Kind::kNumpy);
          },
          py::arg("length"), py::arg("offset"),
          "-> rows [offset, offset + length) of the table, float32 (length, dim)");

  py::class_<attend::TokenEmbedding>(m, "TokenEmbedding")
      .def(py::init<int64_t, int64_t, uint64_t>(), py::arg("vocab_size"), py::arg("dim"),
           py::arg("seed"))
      .def("parameters",
           [](py::object self) {
             return parameter_views({{"weight", self.cast<attend::TokenEmbedding&>().table()}},
                                    self);
           })
      .def(
          "forward",
          [](const attend::TokenEmbedding& module, py::handle ids) {
            const Borrowed input = borrow(ids, "ids");
            Tensor output;
            {
              py::gil_scoped_release release;
              output = module.forward(input.view);
            }
            return to_python(std::move(output), input.kind);
          },
          py::arg("ids"), "ids (..., L) integers -> float32 (..., L, dim)");

  m.def(
      "sinusoidal_positional_encoding",
      [](int64_t length, int64_t dim, int64_t offset) {
        return to_python(attend::sinusoidal_positional_encoding(length, dim, offset), Kind::kNumpy);
      },
      py::arg("length"), py::arg("dim"), py::arg("offset"),
      "-> float32 (length, dim), positions [offset, offset + length)");
  m.def(
      "add_positional_encoding",
      [](py::handle x, py::handle encoding) {
        const Borrowed target = borrow(x, "x", /*writable=*/true);
        const Borrowed table = borrow(encoding, "encoding");
        py::gil_scoped_release release;
        attend::add_positional_encoding(target.view, table.view);
      },
      py::arg("x"), py::arg("encoding"), "x (N, L, d) or (L, d) += encoding (L, d), in place");

  m.def(
      "load_safetensors",
      [](const std::string& path) {
        attend::SafetensorsContents contents;
        {
          py::gil_scoped_release release;
          contents = attend::load_safetensors(path);
        }
        py::dict tensors;
        for (auto& [name, tensor] : contents.tensors) {
          tensors[py::str(name)] = to_python(std::move(tensor), Kind::kNumpy);
        }
        return py::make_tuple(tensors, contents.metadata);
      },
      py::arg("path"), "-> ({name: NumPy array of the stored shape}, {metadata key: value})");
  m.def(
      "save_safetensors",
      [](const std::string& path, const py::dict& tensors,
         const std::map<std::string, std::string>& metadata) {
        std::map<std::string, Borrowed> borrowed;
        std::map<std::string, TensorView> views;
        for (const auto& [key, value] : tensors) {
          const std::string name = py::str(key);
          auto [it, inserted] = borrowed.emplace(name, borrow(value, name.c_str()));
          views.emplace(name, it->second.view);
        }
        py::gil_scoped_release release;
        attend::save_safetensors(path, views, metadata);
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata"),
      "Writes name -> array (any shape, any strides) and metadata strings, atomically");
}

}  // namespace attend_python
