// dlpack_capsules.cpp: DLPack capsules read as views, and made to hand results to torch (see
// protocols.hpp; the structs in dlpack.hpp).
#include <optional>
#include <string>
#include <utility>

#include "dtype_table.hpp"
#include "protocols.hpp"

namespace attend_python {
namespace {

using attend::DType;
using attend::Shape;
using attend::detail::dtype_of_kind;
using attend::detail::DTypeKind;

DType dtype_of_dlpack(const DLDataType& t, const char* name) {
  if (t.lanes == 1 && t.bits % 8 == 0) {
    std::optional<DTypeKind> kind;
    if (t.code == kDLFloat) kind = DTypeKind::kFloat;
    if (t.code == kDLBfloat) kind = DTypeKind::kBFloat;
    if (t.code == kDLBool) kind = DTypeKind::kBool;
    if (t.code == kDLInt) kind = DTypeKind::kInt;
    if (t.code == kDLUInt) kind = DTypeKind::kUInt;
    if (kind) {
      if (const std::optional<DType> d = dtype_of_kind(*kind, t.bits / 8u)) return *d;
    }
  }
  throw ArgumentTypeError(std::string(name) + ": DLPack dtype (code " + std::to_string(t.code) +
                          ", " + std::to_string(t.bits) + " bits, " + std::to_string(t.lanes) +
                          " lanes) is not supported; attend reads float16/32/64, bfloat16, bool "
                          "and integer tensors");
}

DLDataType dlpack_dtype(DType dtype) {
  const auto [kind, bytes] = attend::detail::visit_dtype(dtype, [](auto row) {
    return std::pair{row.kind, sizeof(typename decltype(row)::Storage)};
  });
  if (kind == DTypeKind::kFloat || kind == DTypeKind::kBFloat) {
    return {static_cast<uint8_t>(kind == DTypeKind::kFloat ? kDLFloat : kDLBfloat),
            static_cast<uint8_t>(8 * bytes), 1};
  }
  throw attend::Error(std::string("results of dtype ") + attend::dtype_name(dtype) +
                      " cannot be returned");
}

std::string device_name(const DLDevice& device) {
  switch (device.device_type) {
    case kDLCUDA:
      return "cuda:" + std::to_string(device.device_id);
    case kDLCUDAHost:
      return "cuda_host";
  }
  return "DLPack device type " + std::to_string(device.device_type);
}

void check_cpu(const DLDevice& device, const char* name) {
  if (device.device_type != kDLCPU) {
    throw attend::Error(std::string(name) + ": data on " + device_name(device) +
                        "; attend computes on the CPU (move it there first, e.g. tensor.cpu())");
  }
}

// The view described by a DLPack capsule; the capsule (kept by the caller) owns the memory.
attend::TensorView view_of_capsule(py::handle capsule, const char* name) {
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    throw attend::Error(std::string(name) + ": __dlpack__ did not return a 'dltensor' capsule");
  }
  const DLTensor& t = managed->dl_tensor;
  check_cpu(t.device, name);
  check_rank(t.ndim, name);
  const DType dtype = dtype_of_dlpack(t.dtype, name);
  const Shape shape = Shape::from(t.shape, t.ndim);
  const Shape strides =
      t.strides != nullptr ? Shape::from(t.strides, t.ndim) : attend::contiguous_strides(shape);
  return attend::TensorView(static_cast<char*>(t.data) + t.byte_offset, dtype, shape, strides);
}

// A DLManagedTensor that owns an attend::Tensor: what a torch result is made from.
struct ExportedTensor {
  DLManagedTensor managed{};
  attend::Tensor tensor;
  int64_t shape[Shape::kMaxRank] = {};
  int64_t strides[Shape::kMaxRank] = {};
};

void delete_exported(DLManagedTensor* managed) {
  delete static_cast<ExportedTensor*>(managed->manager_ctx);
}

// A capsule nobody consumed (still named "dltensor") frees its tensor itself.
void delete_unconsumed_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  managed->deleter(managed);
}

}  // namespace

attend::TensorView view_of_dlpack(py::handle object, py::object* capsule, const char* name) {
  if (py::hasattr(object, "__dlpack_device__")) {
    const auto device = object.attr("__dlpack_device__")().cast<std::pair<int, int>>();
    check_cpu({device.first, device.second}, name);
  }
  *capsule = object.attr("__dlpack__")();
  return view_of_capsule(*capsule, name);
}

py::object dlpack_capsule(attend::Tensor&& tensor, const Shape& shape, const Shape& strides) {
  const DLDataType dtype = dlpack_dtype(tensor.dtype());
  static char empty_storage[64];  // data for zero-element results: DLPack wants a pointer
  auto* exported = new ExportedTensor;
  exported->tensor = std::move(tensor);
  DLTensor& t = exported->managed.dl_tensor;
  t.data = exported->tensor.data() ? exported->tensor.data() : empty_storage;
  t.device = {kDLCPU, 0};
  t.ndim = shape.rank();
  t.dtype = dtype;
  for (int d = 0; d < shape.rank(); ++d) {
    exported->shape[d] = shape[d];
    exported->strides[d] = strides[d];
  }
  t.shape = exported->shape;
  t.strides = exported->strides;
  t.byte_offset = 0;
  exported->managed.manager_ctx = exported;
  exported->managed.deleter = delete_exported;
  PyObject* capsule = PyCapsule_New(&exported->managed, "dltensor", delete_unconsumed_capsule);
  if (capsule == nullptr) {
    delete exported;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

}  // namespace attend_python
