// arrays.cpp: see arrays.hpp. Every path here is a pointer, a dtype, a shape and strides;
// nothing is copied.
#include "arrays.hpp"

#include <pybind11/numpy.h>

#include <array>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "dlpack.hpp"
#include "dtype_table.hpp"

namespace attend_python {
namespace {

using attend::DType;
using attend::Shape;
using attend::detail::dtype_of_kind;
using attend::detail::DTypeKind;

std::string type_name(py::handle object) { return Py_TYPE(object.ptr())->tp_name; }

// torch's tensor type, dtypes and DLPack importer, looked up once the caller has imported
// torch (attend never imports torch itself: a NumPy user does not pay for it). Never
// destroyed: Python may be finalized before static destructors run.
struct TorchApi {
  PyTypeObject* tensor_type = nullptr;
  py::object from_dlpack;
  std::vector<std::pair<py::object, DType>> dtypes;  // torch.float32 -> kFloat32, ...
  py::object is_cpu, data_ptr, shape, stride, dtype, device, requires_grad;  // interned names
  py::object is_grad_enabled;
  // torch.Tensor and nn.Parameter override none of these: their descriptors on
  // torch._C._TensorBase, used directly for those two types (no attribute lookup per read).
  PyTypeObject* parameter_type = nullptr;
  py::object base_is_cpu, base_shape, base_dtype, base_requires_grad;  // getset descriptors
  py::object base_data_ptr, base_stride;                               // method descriptors
  bool descriptors = false;                                            // found
};

const TorchApi* torch_api() {
  static TorchApi* api = nullptr;
  if (api != nullptr) return api;
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (torch == nullptr) return nullptr;
  py::handle module(torch);
  if (!py::hasattr(module, "Tensor") || !py::hasattr(module, "utils")) return nullptr;
  auto* a = new TorchApi;
  a->tensor_type = reinterpret_cast<PyTypeObject*>(module.attr("Tensor").ptr());
  // torch._C._from_dlpack takes the capsule directly; torch.utils.dlpack.from_dlpack wraps it
  // in Python-level checks that cost more than the rest of a small call.
  py::object c_module = module.attr("_C");
  a->from_dlpack = py::hasattr(c_module, "_from_dlpack")
                       ? c_module.attr("_from_dlpack")
                       : py::module_::import("torch.utils.dlpack").attr("from_dlpack");
  const std::pair<const char*, DType> names[] = {
      {"float32", DType::kFloat32}, {"float16", DType::kFloat16}, {"bfloat16", DType::kBFloat16},
      {"float64", DType::kFloat64}, {"bool", DType::kBool},       {"int8", DType::kInt8},
      {"int16", DType::kInt16},     {"int32", DType::kInt32},     {"int64", DType::kInt64},
      {"uint8", DType::kUInt8}};
  for (const auto& [name, dtype] : names) a->dtypes.emplace_back(module.attr(name), dtype);
  for (auto [field, name] : {std::pair{&a->is_cpu, "is_cpu"}, std::pair{&a->data_ptr, "data_ptr"},
                             std::pair{&a->shape, "shape"}, std::pair{&a->stride, "stride"},
                             std::pair{&a->dtype, "dtype"}, std::pair{&a->device, "device"},
                             std::pair{&a->requires_grad, "requires_grad"}}) {
    *field = py::reinterpret_steal<py::object>(PyUnicode_InternFromString(name));
  }
  a->is_grad_enabled = module.attr("is_grad_enabled");
  // torch 1.13's _TensorBase (TensorBase in later releases); without it, lookups by name.
  const char* base_name = py::hasattr(c_module, "_TensorBase") ? "_TensorBase" : "TensorBase";
  if (py::hasattr(c_module, base_name)) {
    const py::dict base = c_module.attr(base_name).attr("__dict__");
    a->parameter_type = reinterpret_cast<PyTypeObject*>(
        module.attr("nn").attr("parameter").attr("Parameter").ptr());
    a->base_is_cpu = base["is_cpu"];
    a->base_shape = base["shape"];
    a->base_dtype = base["dtype"];
    a->base_requires_grad = base["requires_grad"];
    a->base_data_ptr = base["data_ptr"];
    a->base_stride = base["stride"];
    a->descriptors = true;
  }
  api = a;
  return api;
}

// The Python error in flight as text, cleared.
std::string take_python_error() {
  py::error_already_set error;
  return error.what();
}

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

std::string device_name(const DLDevice& device) {
  switch (device.device_type) {
    case kDLCUDA:
      return "cuda:" + std::to_string(device.device_id);
    case kDLCUDAHost:
      return "cuda_host";
  }
  return "DLPack device type " + std::to_string(device.device_type);
}

void check_rank(int rank, const char* name) {
  if (rank > Shape::kMaxRank) {
    throw attend::Error(std::string(name) + ": " + std::to_string(rank) +
                        " dimensions, attend views hold at most " +
                        std::to_string(Shape::kMaxRank));
  }
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

// A torch tensor read through data_ptr(), shape, stride() and dtype: the fields its DLPack
// export carries, without the as_strided view torch.utils.dlpack.to_dlpack makes per call
// (0.45 us per tensor, most of the overhead budget of a small call).
// A getset attribute or a no-argument method of a torch tensor: through torch._C._TensorBase's
// descriptor for torch.Tensor and nn.Parameter, by name for subclasses (which may override).
py::object tensor_attribute(py::handle tensor, const TorchApi& torch, const py::object& name,
                            const py::object& descriptor) {
  PyTypeObject* type = Py_TYPE(tensor.ptr());
  PyObject* value;
  if (torch.descriptors && (type == torch.tensor_type || type == torch.parameter_type)) {
    value = Py_TYPE(descriptor.ptr())
                ->tp_descr_get(descriptor.ptr(), tensor.ptr(), reinterpret_cast<PyObject*>(type));
  } else {
    value = PyObject_GetAttr(tensor.ptr(), name.ptr());
  }
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

py::object tensor_method(py::handle tensor, const TorchApi& torch, const py::object& name,
                         const py::object& descriptor) {
  PyTypeObject* type = Py_TYPE(tensor.ptr());
  PyObject* self = tensor.ptr();
  const bool fast =
      torch.descriptors && (type == torch.tensor_type || type == torch.parameter_type);
  PyObject* value = fast ? PyObject_Vectorcall(descriptor.ptr(), &self, 1, nullptr)
                         : PyObject_CallMethodNoArgs(self, name.ptr());
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

attend::TensorView view_of_torch(py::handle tensor, const TorchApi& torch, const char* name) {
  const auto guarded = [&](auto read) {
    try {
      return read();
    } catch (py::error_already_set& error) {
      throw attend::Error(std::string(name) + ": this tensor cannot be read in place (" +
                          error.what() + ")");
    }
  };
  const auto get = [&](const py::object& attribute, const py::object& descriptor) {
    return guarded([&] { return tensor_attribute(tensor, torch, attribute, descriptor); });
  };
  const auto call = [&](const py::object& method, const py::object& descriptor) {
    return guarded([&] { return tensor_method(tensor, torch, method, descriptor); });
  };
  if (get(torch.is_cpu, torch.base_is_cpu).ptr() != Py_True) {
    throw attend::Error(std::string(name) + ": a tensor on " +
                        std::string(py::str(tensor.attr(torch.device))) +
                        "; attend computes on the CPU (move it there first, e.g. tensor.cpu())");
  }
  const py::object dtype_object = get(torch.dtype, torch.base_dtype);
  std::optional<DType> dtype;
  for (const auto& [candidate, d] : torch.dtypes) {
    if (candidate.ptr() == dtype_object.ptr()) dtype = d;
  }
  if (!dtype) {
    throw ArgumentTypeError(std::string(name) + ": dtype " + std::string(py::str(dtype_object)) +
                            " is not supported; attend reads float16/32/64, bfloat16, bool and "
                            "integer tensors");
  }
  const py::object strides_object = call(torch.stride, torch.base_stride);  // not sparse
  const py::object shape_object = get(torch.shape, torch.base_shape);
  const Py_ssize_t rank = PyTuple_GET_SIZE(shape_object.ptr());
  check_rank(static_cast<int>(rank), name);
  Shape shape, strides;
  for (Py_ssize_t d = 0; d < rank; ++d) {
    shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape_object.ptr(), d)));
    strides.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(strides_object.ptr(), d)));
  }
  void* data = PyLong_AsVoidPtr(call(torch.data_ptr, torch.base_data_ptr).ptr());
  return attend::TensorView(data, *dtype, shape, strides);
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

}  // namespace

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
  const TorchApi* torch = torch_api();
  if (torch != nullptr && PyObject_TypeCheck(o, torch->tensor_type)) {
    b.kind = Kind::kTorch;
    b.view = view_of_torch(object, *torch, name);
    b.owner_ = py::reinterpret_borrow<py::object>(object);
    return b;
  }
  if (PyObject_CheckBuffer(o)) {
    const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &b.buffer_, flags) != 0) {
      const std::string why = take_python_error();
      if (writable) {
        throw attend::Error(std::string(name) +
                            ": the array is read-only; an output must be writable (" + why + ")");
      }
      throw attend::Error(std::string(name) + ": cannot read its buffer (" + why + ")");
    }
    b.has_buffer_ = true;
    const Py_buffer& buffer = b.buffer_;
    check_rank(buffer.ndim, name);
    const DType dtype = dtype_of_format(buffer.format, buffer.itemsize, name);
    Shape shape, strides;
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
    b.view = attend::TensorView(buffer.buf, dtype, shape, strides);
    return b;
  }
  if (py::hasattr(object, "__dlpack__")) {
    if (py::hasattr(object, "__dlpack_device__")) {
      const auto device = object.attr("__dlpack_device__")().cast<std::pair<int, int>>();
      check_cpu({device.first, device.second}, name);
    }
    b.owner_ = object.attr("__dlpack__")();
    b.view = view_of_capsule(b.owner_, name);
    return b;
  }
  throw ArgumentTypeError(std::string(name) +
                          ": expected a NumPy array, a torch tensor or an object with "
                          "__dlpack__, got " +
                          type_name(object));
}

std::optional<Borrowed> borrow_optional(py::handle object, const char* name) {
  if (object.is_none()) return std::nullopt;
  return borrow(object, name);
}

py::object to_python(attend::Tensor&& tensor, Kind kind, const std::optional<Shape>& shape,
                     bool swap_leading_axes) {
  Shape result_shape = shape ? *shape : tensor.shape();
  Shape strides = attend::contiguous_strides(result_shape);
  if (swap_leading_axes && result_shape.rank() >= 2) {
    std::swap(result_shape[0], result_shape[1]);
    std::swap(strides[0], strides[1]);
  }
  if (kind == Kind::kNumpy) {
    const DType dtype = tensor.dtype();
    const size_t itemsize = attend::dtype_size(dtype);
    std::vector<py::ssize_t> numpy_shape, numpy_strides;
    for (int d = 0; d < result_shape.rank(); ++d) {
      numpy_shape.push_back(result_shape[d]);
      numpy_strides.push_back(strides[d] * static_cast<py::ssize_t>(itemsize));
    }
    const py::dtype numpy_type = numpy_dtype(dtype);
    if (tensor.data() == nullptr) return py::array(numpy_type, numpy_shape, numpy_strides);
    auto* owner = new attend::Tensor(std::move(tensor));
    py::capsule base(owner, [](void* p) { delete static_cast<attend::Tensor*>(p); });
    return py::array(numpy_type, numpy_shape, numpy_strides, owner->data(), base);
  }
  const TorchApi* torch = torch_api();
  if (torch == nullptr) throw attend::Error("torch results were asked for but torch is not loaded");
  auto* exported = new ExportedTensor;
  static char empty_storage[64];  // data for zero-element results: DLPack wants a pointer
  exported->tensor = std::move(tensor);
  DLTensor& t = exported->managed.dl_tensor;
  t.data = exported->tensor.data() ? exported->tensor.data() : empty_storage;
  t.device = {kDLCPU, 0};
  t.ndim = result_shape.rank();
  try {
    t.dtype = dlpack_dtype(exported->tensor.dtype());
  } catch (...) {
    delete exported;
    throw;
  }
  for (int d = 0; d < result_shape.rank(); ++d) {
    exported->shape[d] = result_shape[d];
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
  py::object owned_capsule = py::reinterpret_steal<py::object>(capsule);
  PyObject* result = PyObject_CallOneArg(torch->from_dlpack.ptr(), owned_capsule.ptr());
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

py::object to_python_or_none(attend::Tensor&& tensor, Kind kind,
                             const std::optional<Shape>& shape) {
  if (tensor.empty()) return py::none();
  return to_python(std::move(tensor), kind, shape);
}

bool requires_grad(py::handle tensor) {
  const TorchApi& torch = *torch_api();
  return tensor_attribute(tensor, torch, torch.requires_grad, torch.base_requires_grad).ptr() ==
         Py_True;
}

bool is_torch_tensor(py::handle object) {
  const TorchApi* torch = torch_api();
  return torch != nullptr && PyObject_TypeCheck(object.ptr(), torch->tensor_type);
}

const void* torch_data_ptr(py::handle tensor) {
  const TorchApi& torch = *torch_api();
  return PyLong_AsVoidPtr(tensor_method(tensor, torch, torch.data_ptr, torch.base_data_ptr).ptr());
}

bool torch_grad_enabled() {
  PyObject* value = PyObject_CallNoArgs(torch_api()->is_grad_enabled.ptr());
  if (value == nullptr) throw py::error_already_set();
  Py_DECREF(value);
  return value == Py_True;
}

py::object numpy_view(const attend::TensorView& view, py::handle owner) {
  const size_t itemsize = attend::dtype_size(view.dtype);
  std::vector<py::ssize_t> shape, strides;
  for (int d = 0; d < view.rank(); ++d) {
    shape.push_back(view.shape[d]);
    strides.push_back(view.strides[d] * static_cast<py::ssize_t>(itemsize));
  }
  return py::array(numpy_dtype(view.dtype), shape, strides, view.data, owner);
}

}  // namespace attend_python
