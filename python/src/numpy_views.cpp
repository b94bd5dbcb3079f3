// numpy_views.cpp: see numpy_views.hpp.
#include "numpy_views.hpp"

#include <pybind11/numpy.h>

#include <string>

namespace attend_python {
namespace {

// NumPy's type numbers (numpy/ndarraytypes.h, NPY_TYPES) of the dtypes attend reads.
std::optional<attend::DType> dtype_of_type_number(int type_num) {
  using attend::DType;
  using api = py::detail::npy_api;
  switch (type_num) {
    case api::NPY_FLOAT_: return DType::kFloat32;
    case api::NPY_DOUBLE_: return DType::kFloat64;
    case api::NPY_BOOL_: return DType::kBool;
    case api::NPY_INT32_: return DType::kInt32;
    case api::NPY_INT64_: return DType::kInt64;
    case api::NPY_UINT8_: return DType::kUInt8;
    case api::NPY_INT8_: return DType::kInt8;
    default: return std::nullopt;  // float16 and the rest: through the buffer protocol
  }
}

}  // namespace

InPlace::InPlace(py::handle object, const char* name, bool writable) {
  static const py::detail::npy_api& api = py::detail::npy_api::get();
  PyObject* o = object.ptr();
  if (Py_TYPE(o) == api.PyArray_Type_) {
    const auto* array = py::detail::array_proxy(o);
    const auto* descr = py::detail::array_descriptor_proxy(array->descr);
    const std::optional<attend::DType> dtype = dtype_of_type_number(descr->type_num);
    const bool native = descr->byteorder != '>';  // '=', '<' (this is little-endian) or '|'
    const bool can_write = !writable || (array->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_) != 0;
    if (dtype && native && can_write && array->nd <= attend::Shape::kMaxRank) {
      attend::Shape shape, strides;
      bool whole = true;
      for (int d = 0; d < array->nd; ++d) {
        shape.push_back(array->dimensions[d]);
        whole = whole && array->strides[d] % descr->elsize == 0;
        strides.push_back(array->strides[d] / descr->elsize);
      }
      if (whole) {
        view = attend::TensorView(array->data, *dtype, shape, strides);
        return;
      }
    }
  }
  fallback = borrow(object, name, writable);  // the general path and its messages
  kind = fallback->kind;
  view = fallback->view;
}

}  // namespace attend_python
