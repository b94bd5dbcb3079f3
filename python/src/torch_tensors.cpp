// torch_tensors.cpp: torch tensors read in place through their attributes, and results handed
// to torch through a DLPack capsule (see protocols.hpp).
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "protocols.hpp"

namespace attend_python {
namespace {

using attend::DType;
using attend::Shape;

// torch's tensor type, dtypes and DLPack importer, looked up once the caller has imported
// torch (attend never imports torch itself: a NumPy user does not pay for it). Never
// destroyed: Python may be finalized before static destructors run.
struct TorchApi {
  PyTypeObject* tensor_type = nullptr;
  py::object from_dlpack;
  std::vector<std::pair<py::object, DType>> dtypes;  // torch.float32 -> kFloat32, ...
  py::object is_cpu, data_ptr, shape, stride, is_contiguous, dtype, device,
      requires_grad;  // interned names
  py::object is_grad_enabled;
  // torch.Tensor and nn.Parameter override none of these: their C functions on
  // torch._C._TensorBase, called directly for those two types (no attribute lookup, no
  // descriptor call per read).
  PyTypeObject* parameter_type = nullptr;
  PyGetSetDef *base_is_cpu = nullptr, *base_shape = nullptr, *base_dtype = nullptr,
              *base_requires_grad = nullptr;
  PyMethodDef *base_data_ptr = nullptr, *base_stride = nullptr, *base_is_contiguous = nullptr;
  bool descriptors = false;  // found
};

// The getter of a getset descriptor, or null.
PyGetSetDef* getset_of(py::handle descriptor) {
  if (Py_TYPE(descriptor.ptr()) != &PyGetSetDescr_Type) return nullptr;
  return reinterpret_cast<PyGetSetDescrObject*>(descriptor.ptr())->d_getset;
}

// The C function of a method descriptor taking no arguments (METH_NOARGS) or any (VARARGS |
// KEYWORDS, called with none), or null.
PyMethodDef* method_of(py::handle descriptor) {
  if (Py_TYPE(descriptor.ptr()) != &PyMethodDescr_Type) return nullptr;
  PyMethodDef* method = reinterpret_cast<PyMethodDescrObject*>(descriptor.ptr())->d_method;
  const int convention = method->ml_flags & ~(METH_CLASS | METH_STATIC | METH_COEXIST);
  const bool callable = convention == METH_NOARGS || convention == (METH_VARARGS | METH_KEYWORDS);
  return callable ? method : nullptr;
}

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
                             std::pair{&a->is_contiguous, "is_contiguous"},
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
    a->base_is_cpu = getset_of(base["is_cpu"]);
    a->base_shape = getset_of(base["shape"]);
    a->base_dtype = getset_of(base["dtype"]);
    a->base_requires_grad = getset_of(base["requires_grad"]);
    a->base_data_ptr = method_of(base["data_ptr"]);
    a->base_stride = method_of(base["stride"]);
    a->base_is_contiguous = method_of(base["is_contiguous"]);
    a->descriptors = a->base_is_cpu && a->base_shape && a->base_dtype && a->base_requires_grad &&
                     a->base_data_ptr && a->base_stride && a->base_is_contiguous;
  }
  api = a;
  return api;
}

// A getset attribute or a no-argument method of a torch tensor: through torch._C._TensorBase's
// C function for torch.Tensor and nn.Parameter, by name for subclasses (which may override).
bool exact(py::handle tensor, const TorchApi& torch) {
  const PyTypeObject* type = Py_TYPE(tensor.ptr());
  return torch.descriptors && (type == torch.tensor_type || type == torch.parameter_type);
}

py::object tensor_attribute(py::handle tensor, const TorchApi& torch, const py::object& name,
                            const PyGetSetDef* getter) {
  PyObject* value = exact(tensor, torch) ? getter->get(tensor.ptr(), getter->closure)
                                         : PyObject_GetAttr(tensor.ptr(), name.ptr());
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

py::object tensor_method(py::handle tensor, const TorchApi& torch, const py::object& name,
                         const PyMethodDef* method) {
  PyObject* self = tensor.ptr();
  PyObject* value;
  if (!exact(tensor, torch)) {
    value = PyObject_CallMethodNoArgs(self, name.ptr());
  } else if (method->ml_flags & METH_NOARGS) {
    value = method->ml_meth(self, nullptr);
  } else {
    static PyObject* const no_arguments = PyTuple_New(0);  // never released
    value = reinterpret_cast<PyCFunctionWithKeywords>(reinterpret_cast<void (*)()>(
        method->ml_meth))(self, no_arguments, nullptr);
  }
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

}  // namespace

// The attend dtype of a torch dtype object, or nullopt.
std::optional<DType> dtype_of(const TorchApi& torch, PyObject* dtype_object) {
  for (const auto& [candidate, d] : torch.dtypes) {
    if (candidate.ptr() == dtype_object) return d;
  }
  return std::nullopt;
}

// A torch tensor read through is_cpu, dtype, shape, is_contiguous() (stride() where it is
// not), data_ptr(): the fields its DLPack export carries, without the as_strided view
// torch.utils.dlpack.to_dlpack makes per call (0.45 us per tensor, most of the overhead budget
// of a small call). For torch.Tensor and nn.Parameter the reads are the C functions of
// torch._C._TensorBase, chosen once per tensor; the shape and strides go into the view's
// dimensions in one copy each.
attend::TensorView view_of_torch(py::handle tensor, const char* name) {
  const TorchApi& torch = *torch_api();
  const bool direct = exact(tensor, torch);
  PyObject* self = tensor.ptr();
  const auto guarded = [&](auto read) {
    try {
      return read();
    } catch (py::error_already_set& error) {
      throw attend::Error(std::string(name) + ": this tensor cannot be read in place (" +
                          error.what() + ")");
    }
  };
  const auto get = [&](const py::object& attribute, const PyGetSetDef* getter) {
    return guarded([&] {
      PyObject* value =
          direct ? getter->get(self, getter->closure) : PyObject_GetAttr(self, attribute.ptr());
      if (value == nullptr) throw py::error_already_set();
      return py::reinterpret_steal<py::object>(value);
    });
  };
  const auto call = [&](const py::object& method, const PyMethodDef* function) {
    return guarded([&] { return tensor_method(tensor, torch, method, function); });
  };
  if (get(torch.is_cpu, torch.base_is_cpu).ptr() != Py_True) {
    throw attend::Error(std::string(name) + ": a tensor on " +
                        std::string(py::str(tensor.attr(torch.device))) +
                        "; attend computes on the CPU (move it there first, e.g. tensor.cpu())");
  }
  const std::optional<DType> dtype = [&] {
    const py::object dtype_object = get(torch.dtype, torch.base_dtype);
    const std::optional<DType> d = dtype_of(torch, dtype_object.ptr());
    if (!d) {
      throw ArgumentTypeError(std::string(name) + ": dtype " + std::string(py::str(dtype_object)) +
                              " is not supported; attend reads float16/32/64, bfloat16, bool and "
                              "integer tensors");
    }
    return d;
  }();
  // A contiguous tensor (is_contiguous(): every dimension of size > 1 has the row-major
  // stride) gets the row-major strides computed from its shape, torch's contiguous strides:
  // stride[d] = prod(max(shape[j], 1), j > d). is_contiguous() builds no tuple and parses less
  // than stride(), which only non-contiguous tensors pay. The two differ only in the strides
  // of dimensions of size 1, which address nothing.
  int64_t dims[Shape::kMaxRank], steps[Shape::kMaxRank];
  Py_ssize_t rank;
  {
    const py::object shape_object = get(torch.shape, torch.base_shape);
    rank = PyTuple_GET_SIZE(shape_object.ptr());
    check_rank(static_cast<int>(rank), name);
    for (Py_ssize_t d = 0; d < rank; ++d) {
      dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape_object.ptr(), d));
    }
  }
  if (call(torch.is_contiguous, torch.base_is_contiguous).ptr() == Py_True) {
    int64_t step = 1;
    for (Py_ssize_t d = rank - 1; d >= 0; --d) {
      steps[d] = step;
      step *= dims[d] > 1 ? dims[d] : 1;
    }
  } else {
    const py::object strides_object = call(torch.stride, torch.base_stride);  // not sparse
    for (Py_ssize_t d = 0; d < rank; ++d) {
      steps[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides_object.ptr(), d));
    }
  }
  const py::object address = call(torch.data_ptr, torch.base_data_ptr);
  return attend::TensorView(PyLong_AsVoidPtr(address.ptr()), *dtype,
                            Shape::from(dims, static_cast<int>(rank)),
                            Shape::from(steps, static_cast<int>(rank)));
}

py::object torch_result(attend::Tensor&& tensor, const Shape& shape, const Shape& strides) {
  const TorchApi* torch = torch_api();
  if (torch == nullptr) throw attend::Error("torch results were asked for but torch is not loaded");
  const py::object capsule = dlpack_capsule(std::move(tensor), shape, strides);
  PyObject* result = PyObject_CallOneArg(torch->from_dlpack.ptr(), capsule.ptr());
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

bool requires_grad(py::handle tensor) {
  const TorchApi& torch = *torch_api();
  return tensor_attribute(tensor, torch, torch.requires_grad, torch.base_requires_grad).ptr() ==
         Py_True;
}

bool is_torch_tensor(py::handle object) {
  const TorchApi* torch = torch_api();
  if (torch == nullptr) return false;
  const PyTypeObject* type = Py_TYPE(object.ptr());
  return type == torch->tensor_type || type == torch->parameter_type ||
         PyObject_TypeCheck(object.ptr(), torch->tensor_type);
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

}  // namespace attend_python
