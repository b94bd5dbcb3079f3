// numpy_arrays.cpp: NumPy ndarrays read from the array object's own fields (data, dims,
// strides, dtype kind and size) without exporting a buffer (the export cost a few hundred
// nanoseconds per array, most of a small call's overhead), and results handed back as
// ndarrays (see protocols.hpp).
#include <pybind11/numpy.h>

#include <array>
#include <bit>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtype_table.hpp"
#include "protocols.hpp"

namespace attend_python {
namespace {

using attend::DType;
using attend::detail::DTypeKind;

// The NumPy C API's views of the array structs (pybind11's proxies) are NumPy 1.x's: NumPy
// 2.0 (C API feature version 0x12) moved the descriptor's fields. Later NumPy goes through the
// buffer protocol.
bool fields_readable() {
  static const bool readable = [] {
    const auto& api = py::detail::npy_api::get();
    return api.PyArray_GetNDArrayCFeatureVersion_() < 0x12;
  }();
  return readable;
}

// A descriptor's kind character and size as attend's dtype (the rule of dtype_of_format);
// nullopt for the others (complex, datetime, records, ...).
std::optional<DType> dtype_of_descriptor(const py::detail::PyArrayDescr_Proxy& descr) {
  std::optional<DTypeKind> kind;
  switch (descr.kind) {
    case 'f': kind = DTypeKind::kFloat; break;
    case 'b': kind = DTypeKind::kBool; break;
    case 'i': kind = DTypeKind::kInt; break;
    case 'u': kind = DTypeKind::kUInt; break;
    default: return std::nullopt;
  }
  // '=' native, '|' not applicable, '<' little-endian; '>' big-endian.
  const bool native = descr.byteorder == '=' || descr.byteorder == '|' ||
                      (descr.byteorder == '<' && std::endian::native == std::endian::little);
  if (!native || descr.subarray != nullptr || descr.elsize <= 0) return std::nullopt;
  return attend::detail::dtype_of_kind(*kind, static_cast<size_t>(descr.elsize));
}

py::dtype numpy_dtype(DType dtype) {
  if (dtype == DType::kBFloat16 || dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2) {
    throw ArgumentTypeError(std::string("a result of dtype ") + attend::dtype_name(dtype) +
                            " has no NumPy dtype; pass torch tensors to get it");
  }
  // attend's dtype names are NumPy's ("float32", "bool", "uint16", ...).
  // Never destroyed: Python may be finalized before static destructors run.
  static const auto* cache = new std::array<py::dtype, 13>{
      py::dtype("float32"), py::dtype("float16"), py::dtype("float32"), py::dtype("float64"),
      py::dtype("bool"),    py::dtype("int8"),    py::dtype("int16"),   py::dtype("int32"),
      py::dtype("int64"),   py::dtype("uint8"),   py::dtype("uint16"),  py::dtype("uint32"),
      py::dtype("uint64")};
  return (*cache)[static_cast<size_t>(dtype)];
}

// NumPy's shape and byte strides of a view of `shape` and `strides` (in elements).
std::pair<std::vector<py::ssize_t>, std::vector<py::ssize_t>> numpy_layout(
    const attend::Shape& shape, const attend::Shape& strides, DType dtype) {
  const auto itemsize = static_cast<py::ssize_t>(attend::dtype_size(dtype));
  std::vector<py::ssize_t> numpy_shape, numpy_strides;
  for (int d = 0; d < shape.rank(); ++d) {
    numpy_shape.push_back(shape[d]);
    numpy_strides.push_back(strides[d] * itemsize);
  }
  return {numpy_shape, numpy_strides};
}

}  // namespace

std::optional<attend::TensorView> view_of_ndarray(PyObject* object, bool writable) {
  static const py::detail::npy_api& api = py::detail::npy_api::get();
  if (Py_TYPE(object) != api.PyArray_Type_ || !fields_readable()) return std::nullopt;
  const auto* array = py::detail::array_proxy(object);
  const auto* descr = py::detail::array_descriptor_proxy(array->descr);
  const std::optional<DType> dtype = dtype_of_descriptor(*descr);
  if (!dtype || array->nd > attend::Shape::kMaxRank ||
      (writable && (array->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_) == 0)) {
    return std::nullopt;
  }
  attend::Shape shape, strides;
  for (int d = 0; d < array->nd; ++d) {
    if (array->strides[d] % descr->elsize != 0) return std::nullopt;
    shape.push_back(array->dimensions[d]);
    strides.push_back(array->strides[d] / descr->elsize);
  }
  return attend::TensorView(array->data, *dtype, shape, strides);
}

py::object numpy_result(attend::Tensor&& tensor, const attend::Shape& shape,
                        const attend::Shape& strides) {
  const auto [numpy_shape, numpy_strides] = numpy_layout(shape, strides, tensor.dtype());
  const py::dtype numpy_type = numpy_dtype(tensor.dtype());
  if (tensor.data() == nullptr) return py::array(numpy_type, numpy_shape, numpy_strides);
  auto* owner = new attend::Tensor(std::move(tensor));
  py::capsule base(owner, [](void* p) { delete static_cast<attend::Tensor*>(p); });
  return py::array(numpy_type, numpy_shape, numpy_strides, owner->data(), base);
}

py::object numpy_view(const attend::TensorView& view, py::handle owner) {
  const auto [shape, strides] = numpy_layout(view.shape, view.strides, view.dtype);
  return py::array(numpy_dtype(view.dtype), shape, strides, view.data, owner);
}

}  // namespace attend_python
