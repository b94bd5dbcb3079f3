// buffer_protocol.cpp: PEP 3118 buffers read as views (see protocols.hpp).
#include <cstring>
#include <optional>
#include <string>

#include "dtype_table.hpp"
#include "protocols.hpp"

namespace attend_python {
namespace {

using attend::DType;
using attend::detail::dtype_of_kind;
using attend::detail::DTypeKind;

// dtype of a PEP 3118 format string ("f", "<f", "=e", "?", ...) with `itemsize` bytes.
DType dtype_of_format(const char* format, Py_ssize_t itemsize, const char* name) {
  const char* f = format ? format : "B";
  if (*f == '@' || *f == '=' || *f == '<') {
    ++f;
  } else if (*f == '>' || *f == '!') {
    throw ArgumentTypeError(std::string(name) + ": big-endian data (format '" + format +
                            "') is not supported");
  }
  if (f[0] != '\0' && f[1] == '\0' && itemsize > 0) {
    // The format's kind; its size is the buffer's itemsize ('l' is 4 or 8 bytes).
    std::optional<DTypeKind> kind;
    if (std::strchr("fde", f[0])) kind = DTypeKind::kFloat;
    if (f[0] == '?') kind = DTypeKind::kBool;
    if (std::strchr("bhilq", f[0])) kind = DTypeKind::kInt;
    if (std::strchr("BHILQ", f[0])) kind = DTypeKind::kUInt;
    const std::optional<DType> d =
        kind ? dtype_of_kind(*kind, static_cast<size_t>(itemsize)) : std::nullopt;
    // 'f' is float32, 'd' float64 and 'e' float16 whatever the itemsize says.
    const size_t format_size = f[0] == 'f' ? 4 : f[0] == 'd' ? 8 : f[0] == 'e' ? 2 : 0;
    if (d && (format_size == 0 || format_size == static_cast<size_t>(itemsize))) return *d;
  }
  throw ArgumentTypeError(std::string(name) + ": dtype with buffer format '" + format + "' (" +
                          std::to_string(itemsize) +
                          " bytes) is not supported; attend reads float16/32/64, bool and "
                          "integer arrays");
}

attend::TensorView view_of_exported(const Py_buffer& buffer, const char* name) {
  check_rank(buffer.ndim, name);
  const DType dtype = dtype_of_format(buffer.format, buffer.itemsize, name);
  attend::Shape shape, strides;
  for (int d = 0; d < buffer.ndim; ++d) {
    shape.push_back(buffer.shape[d]);
    const Py_ssize_t bytes = buffer.strides[d];
    if (bytes % buffer.itemsize != 0) {
      throw attend::Error(std::string(name) + ": stride of " + std::to_string(bytes) +
                          " bytes in dimension " + std::to_string(d) +
                          " is not a whole number of " + std::to_string(buffer.itemsize) +
                          "-byte elements; attend cannot view it");
    }
    strides.push_back(bytes / buffer.itemsize);
  }
  return attend::TensorView(buffer.buf, dtype, shape, strides);
}

}  // namespace

attend::TensorView view_of_buffer(PyObject* object, Py_buffer* buffer, const char* name,
                                  bool writable) {
  const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(object, buffer, flags) != 0) {
    const std::string why = py::error_already_set().what();  // the Python error, cleared
    if (writable) {
      throw attend::Error(std::string(name) +
                          ": the array is read-only; an output must be writable (" + why + ")");
    }
    throw attend::Error(std::string(name) + ": cannot read its buffer (" + why + ")");
  }
  try {
    return view_of_exported(*buffer, name);
  } catch (...) {
    PyBuffer_Release(buffer);
    throw;
  }
}

}  // namespace attend_python
