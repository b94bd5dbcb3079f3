// arrays.hpp: Python arrays read as attend::TensorView in place, and attend::Tensor results
// handed back to Python, both without copying.
//
// In, by the first that applies: a torch tensor through data_ptr(), shape, stride() and dtype
// (what its DLPack export holds, read without making the export); a NumPy ndarray from its own
// fields (native byte order, a dtype attend reads); anything with the buffer protocol (PEP 3118
// buffers: ndarrays of other byte orders, memoryview, ...); any other object through its
// __dlpack__ capsule. Shapes and strides are taken as they are: a transposed or sliced array is
// a strided view, as the C++ views are. Out: the result's memory is owned by the returned array
// (a NumPy array whose base holds the attend::Tensor, or a torch tensor made by torch's
// from_dlpack), of the caller's kind: torch tensors in give torch tensors out. One file per
// protocol (protocols.hpp).
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <string>

#include "attend/error.hpp"
#include "attend/tensor.hpp"

namespace attend_python {

namespace py = pybind11;

// An argument of the wrong Python type or dtype: raised as attend.DTypeError, a TypeError.
class ArgumentTypeError : public attend::Error {
 public:
  using attend::Error::Error;
};

// What the caller passed, and so what results come back as.
enum class Kind : uint8_t { kNumpy, kTorch };

// The memory of a Python array as an attend::TensorView. Holds the array (torch, NumPy), its
// Py_buffer or its DLPack capsule until destroyed, which must happen with the GIL held.
class Borrowed {
 public:
  Borrowed() = default;
  Borrowed(Borrowed&& other) noexcept;
  Borrowed& operator=(Borrowed&& other) noexcept;
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  ~Borrowed();

  attend::TensorView view;
  Kind kind = Kind::kNumpy;
  // The array itself for a torch tensor (else None).
  py::handle object() const { return kind == Kind::kTorch ? py::handle(owner_) : py::none(); }

 private:
  friend Borrowed borrow(py::handle object, const char* name, bool writable);
  void release();
  py::object owner_;  // the array itself (torch, NumPy read from its fields), or the capsule
  Py_buffer buffer_{};
  bool has_buffer_ = false;
};

// `object` read in place. `name` starts every error message ("query: ..."). `writable`: the
// view is an output (a read-only NumPy array is refused). Throws ArgumentTypeError for an
// object that is no array or has an unsupported dtype, attend::Error for memory that cannot
// be viewed (not on the CPU, strides that are not whole elements, too many dimensions).
Borrowed borrow(py::handle object, const char* name, bool writable = false);
// None gives nullopt.
std::optional<Borrowed> borrow_optional(py::handle object, const char* name);

// `tensor` as a Python array of `kind`, owning its memory. `shape`, when given, replaces the
// tensor's (same element count; the tensor is contiguous, so this is a reshape).
// `swap_leading_axes`: the result is the view with axes 0 and 1 exchanged (strides swapped, no
// copy), as a (N, L, E) result read as (L, N, E).
py::object to_python(attend::Tensor&& tensor, Kind kind,
                     const std::optional<attend::Shape>& shape = std::nullopt,
                     bool swap_leading_axes = false);
// An empty tensor gives None.
py::object to_python_or_none(attend::Tensor&& tensor, Kind kind,
                             const std::optional<attend::Shape>& shape = std::nullopt);

// torch: tensor.requires_grad, and torch.is_grad_enabled() (torch must be loaded).
bool requires_grad(py::handle tensor);
// Whether `object` is a torch tensor (false while torch is not loaded).
bool is_torch_tensor(py::handle object);
// tensor.data_ptr() (a torch tensor).
const void* torch_data_ptr(py::handle tensor);
bool torch_grad_enabled();

// A view of memory owned by `owner` (a parameter of a module) as a writable NumPy array that
// keeps `owner` alive.
py::object numpy_view(const attend::TensorView& view, py::handle owner);

}  // namespace attend_python
