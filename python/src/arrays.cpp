// arrays.cpp: see arrays.hpp. Which protocol reads an object and which makes a result; the
// protocols themselves are in the files protocols.hpp lists.
#include "arrays.hpp"

#include <string>
#include <utility>

#include "protocols.hpp"

namespace attend_python {

void check_rank(int rank, const char* name) {
  if (rank > attend::Shape::kMaxRank) {
    throw attend::Error(std::string(name) + ": " + std::to_string(rank) +
                        " dimensions, attend views hold at most " +
                        std::to_string(attend::Shape::kMaxRank));
  }
}

Borrowed::Borrowed(Borrowed&& other) noexcept
    : view(other.view),
      kind(other.kind),
      owner_(std::move(other.owner_)),
      buffer_(other.buffer_),
      has_buffer_(std::exchange(other.has_buffer_, false)) {}

Borrowed& Borrowed::operator=(Borrowed&& other) noexcept {
  if (this != &other) {
    release();
    view = other.view;
    kind = other.kind;
    owner_ = std::move(other.owner_);
    buffer_ = other.buffer_;
    has_buffer_ = std::exchange(other.has_buffer_, false);
  }
  return *this;
}

Borrowed::~Borrowed() { release(); }

void Borrowed::release() {
  if (has_buffer_) {
    PyBuffer_Release(&buffer_);
    has_buffer_ = false;
  }
  owner_ = py::object();
}

Borrowed borrow(py::handle object, const char* name, bool writable) {
  Borrowed b;
  PyObject* o = object.ptr();
  if (is_torch_tensor(object)) {
    b.kind = Kind::kTorch;
    b.view = view_of_torch(object, name);
    b.owner_ = py::reinterpret_borrow<py::object>(object);
  } else if (const std::optional<attend::TensorView> view = view_of_ndarray(o, writable)) {
    b.view = *view;
    b.owner_ = py::reinterpret_borrow<py::object>(object);
  } else if (PyObject_CheckBuffer(o)) {
    b.view = view_of_buffer(o, &b.buffer_, name, writable);
    b.has_buffer_ = true;
  } else if (py::hasattr(object, "__dlpack__")) {
    b.view = view_of_dlpack(object, &b.owner_, name);
  } else {
    throw ArgumentTypeError(std::string(name) +
                            ": expected a NumPy array, a torch tensor or an object with "
                            "__dlpack__, got " +
                            Py_TYPE(o)->tp_name);
  }
  return b;
}

std::optional<Borrowed> borrow_optional(py::handle object, const char* name) {
  if (object.is_none()) return std::nullopt;
  return borrow(object, name);
}

py::object to_python(attend::Tensor&& tensor, Kind kind,
                     const std::optional<attend::Shape>& shape, bool swap_leading_axes) {
  attend::Shape result_shape = shape ? *shape : tensor.shape();
  attend::Shape strides = attend::contiguous_strides(result_shape);
  if (swap_leading_axes && result_shape.rank() >= 2) {
    std::swap(result_shape[0], result_shape[1]);
    std::swap(strides[0], strides[1]);
  }
  return kind == Kind::kNumpy ? numpy_result(std::move(tensor), result_shape, strides)
                              : torch_result(std::move(tensor), result_shape, strides);
}

py::object to_python_or_none(attend::Tensor&& tensor, Kind kind,
                             const std::optional<attend::Shape>& shape) {
  if (tensor.empty()) return py::none();
  return to_python(std::move(tensor), kind, shape);
}

}  // namespace attend_python
