// multihead_call.cpp: attend.MultiheadAttention's common call, inference without masks or
// dropout, in one C call: attend._attend.multihead_call, and MultiheadAttention.__call__
// itself (a method descriptor on the Python class), which makes that call without running
// any Python; every other call goes to the Python __call__ (attend/_multihead.py, _call).
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "arrays.hpp"
#include "attend/error.hpp"
#include "attend/multihead.hpp"
#include "bindings.hpp"

namespace attend_python {
namespace {

// The call, or NotImplemented (a new reference), computing nothing, where
// MultiheadAttention.forward must decide: a torch input or parameter requires grad in grad
// mode, or a parameter is not the one in the C++ memory (replaced, or its .data re-pointed).
// `slots`: a tuple of (in_out_proj, key, address), one per parameter: parameters[key] (or
// out_proj_parameters[key]) must have data_ptr() == address; () without torch. Returns
// (output, weights or None) as a new reference; throws on errors.
PyObject* common_call(PyObject* module_object, PyObject* parameters_table,
                      PyObject* out_proj_table, PyObject* slots, PyObject* query, PyObject* key,
                      PyObject* value, bool need_weights, bool average, bool causal,
                      bool batch_first) {
  const auto& module = cpp_object<attend::MultiHeadAttention>(module_object);
  const Py_ssize_t parameters = PyTuple_Size(slots);
  if (parameters < 0) throw py::error_already_set();
  const bool grad = parameters > 0 && torch_grad_enabled();
  for (Py_ssize_t i = 0; i < parameters; ++i) {
    PyObject* slot = PyTuple_GET_ITEM(slots, i);
    PyObject* table = PyTuple_GET_ITEM(slot, 0) == Py_True ? out_proj_table : parameters_table;
    if (!PyDict_Check(table)) Py_RETURN_NOTIMPLEMENTED;
    PyObject* p = PyDict_GetItemWithError(table, PyTuple_GET_ITEM(slot, 1));  // borrowed
    if (p == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (p == nullptr || !is_torch_tensor(p)) Py_RETURN_NOTIMPLEMENTED;
    if (torch_data_ptr(p) != PyLong_AsVoidPtr(PyTuple_GET_ITEM(slot, 2)) ||
        (grad && requires_grad(p))) {
      Py_RETURN_NOTIMPLEMENTED;
    }
  }
  if (grad) {
    for (PyObject* input : {query, key, value}) {
      if (is_torch_tensor(input) && requires_grad(input)) Py_RETURN_NOTIMPLEMENTED;
    }
  }
  const py::handle none = Py_None;
  const py::tuple result = multihead_forward(module, query, key, value, none, none, causal,
                                             need_weights, average, 0.0, 0, 0, false,
                                             !batch_first);
  return PyTuple_Pack(2, PyTuple_GET_ITEM(result.ptr(), 0), PyTuple_GET_ITEM(result.ptr(), 1));
}

bool truth(PyObject* object) {
  const int value = PyObject_IsTrue(object);
  if (value < 0) throw py::error_already_set();
  return value == 1;
}

// multihead_call(module, parameters, out_proj_parameters, slots, query, key, value,
// need_weights, average, is_causal, batch_first) -> (output, weights or None), or
// NotImplemented: common_call.
PyObject* multihead_call_fastcall(PyObject*, PyObject* const* args, Py_ssize_t count) {
  try {
    if (count != 11) throw attend::Error("internal: multihead_call takes 11 arguments");
    return common_call(args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                       truth(args[7]), truth(args[8]), truth(args[9]), truth(args[10]));
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyMethodDef multihead_call_method = {
    "multihead_call",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(multihead_call_fastcall)),
    METH_FASTCALL,
    "multihead_call(module, parameters, out_proj_parameters, slots, query, key, value, "
    "need_weights, average, is_causal, batch_first) -> (output, weights or None) or "
    "NotImplemented: see multihead_call.cpp"};

// What MultiheadAttention.__call__ reads, set once by install_multihead_call. Never
// destroyed: Python may be finalized before static destructors run.
struct ModuleCall {
  PyTypeObject* cls = nullptr;   // attend.MultiheadAttention (a subclass takes the Python path)
  PyObject* fallback = nullptr;  // its Python __call__, MultiheadAttention._call
  PyObject* global_hooks = nullptr;  // torch.nn.modules.module's _global_*hooks dicts
  // Instance attributes (interned): hooks nn.Module.__call__ would run, then the state.
  std::vector<PyObject*> hook_names;
  PyObject *dropout, *training, *cpp, *parameters, *modules, *out_proj, *call_slots,
      *batch_first;
};
ModuleCall* g_call = nullptr;

PyObject* intern(const char* name) { return PyUnicode_InternFromString(name); }

// __call__(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
// average_attn_weights=True, is_causal=False), as nn.MultiheadAttention's.
const FastcallNames& call_names() {
  static const FastcallNames names{"query",           "key",          "value",
                                   "key_padding_mask", "need_weights", "attn_mask",
                                   "average_attn_weights", "is_causal"};
  return names;
}

// A borrowed item of an instance's __dict__, or null (no exception) when absent.
PyObject* item(PyObject* dict, PyObject* name) {
  PyObject* value = PyDict_GetItemWithError(dict, name);
  if (value == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return value;
}

// An instance's __dict__ (a Python class's instance: nn.Module and subclasses).
py::object instance_dict(PyObject* object) {
  PyObject* dict = PyObject_GenericGetDict(object, nullptr);
  if (dict == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(dict);
}

// The fast path of __call__: the result, or null without an exception where the Python
// __call__ must run (hooks, masks, dropout, gradients, replaced parameters, a subclass).
PyObject* fast_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const ModuleCall& c = *g_call;
  PyObject* a[8];
  if (Py_TYPE(self) != c.cls ||
      !call_names().sort(args, PyVectorcall_NARGS(nargsf), kwnames, 8, a) ||
      a[0] == nullptr || a[1] == nullptr || a[2] == nullptr ||
      (a[3] != nullptr && a[3] != Py_None) || (a[5] != nullptr && a[5] != Py_None)) {
    return nullptr;
  }
  const py::object dict_object = instance_dict(self);
  PyObject* dict = dict_object.ptr();
  for (PyObject* name : c.hook_names) {  // nn.Module.__call__ runs them: it must be called
    PyObject* hooks = item(dict, name);
    if (hooks != nullptr && hooks != Py_None && truth(hooks)) return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(c.global_hooks); ++i) {
    if (truth(PyTuple_GET_ITEM(c.global_hooks, i))) return nullptr;
  }
  PyObject* dropout = item(dict, c.dropout);
  PyObject* training = item(dict, c.training);
  PyObject* cpp = item(dict, c.cpp);
  PyObject* parameters = item(dict, c.parameters);
  PyObject* modules = item(dict, c.modules);
  PyObject* slots = item(dict, c.call_slots);
  PyObject* batch_first = item(dict, c.batch_first);
  if (!dropout || !training || !cpp || !parameters || !modules || !slots || !batch_first ||
      !PyDict_Check(modules) || !PyTuple_Check(slots) || (truth(dropout) && truth(training))) {
    return nullptr;
  }
  PyObject* out_proj = item(modules, c.out_proj);
  if (out_proj == nullptr) return nullptr;
  const py::object out_proj_dict = instance_dict(out_proj);
  PyObject* out_proj_parameters = item(out_proj_dict.ptr(), c.parameters);
  if (out_proj_parameters == nullptr) return nullptr;
  PyObject* result = common_call(cpp, parameters, out_proj_parameters, slots, a[0], a[1], a[2],
                                 a[4] == nullptr || truth(a[4]), a[6] == nullptr || truth(a[6]),
                                 a[7] != nullptr && truth(a[7]), truth(batch_first));
  if (result == Py_NotImplemented) {
    Py_DECREF(result);
    return nullptr;
  }
  return result;
}

// MultiheadAttention.__call__: fast_call, else the Python __call__ on the same arguments.
PyObject* module_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  try {
    if (PyObject* result = fast_call(self, args, nargsf, kwnames)) return result;
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  const Py_ssize_t positional = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t total = positional + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  std::vector<PyObject*> with_self(static_cast<size_t>(total) + 1);
  with_self[0] = self;
  for (Py_ssize_t i = 0; i < total; ++i) with_self[static_cast<size_t>(i) + 1] = args[i];
  return PyObject_Vectorcall(g_call->fallback, with_self.data(),
                             static_cast<size_t>(positional) + 1, kwnames);
}

PyMethodDef module_call_method = {
    "__call__",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(module_call)),
    METH_FASTCALL | METH_KEYWORDS,
    "module(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, "
    "average_attn_weights=True, is_causal=False) -> (output, weights or None): forward(), "
    "through nn.Module.__call__ where a hook is registered; the common call (no masks, no "
    "dropout, no gradient) in one C call"};

// install_multihead_call(cls, fallback, global_hooks, hook_attributes): cls.__call__ becomes
// module_call. hook_attributes: the names of an instance's hook tables this torch has (a call
// goes to the Python __call__ while one is neither missing, None nor empty).
void install_multihead_call(py::handle cls, py::handle fallback, py::tuple global_hooks,
                            py::tuple hook_attributes) {
  if (!PyType_Check(cls.ptr())) throw attend::Error("install_multihead_call: not a class");
  auto* c = g_call != nullptr ? g_call : new ModuleCall;
  c->cls = reinterpret_cast<PyTypeObject*>(cls.inc_ref().ptr());
  c->fallback = fallback.inc_ref().ptr();
  c->global_hooks = global_hooks.inc_ref().ptr();
  c->hook_names.clear();
  for (py::handle name : hook_attributes) {
    c->hook_names.push_back(intern(py::str(name).cast<std::string>().c_str()));
  }
  c->dropout = intern("dropout");
  c->training = intern("training");
  c->cpp = intern("_cpp");
  c->parameters = intern("_parameters");
  c->modules = intern("_modules");
  c->out_proj = intern("out_proj");
  c->call_slots = intern("_call_slots");
  c->batch_first = intern("batch_first");
  g_call = c;
  add_method(cls, &module_call_method);
}

}  // namespace

void bind_multihead_call(py::module_& m) {
  m.attr("multihead_call") =
      py::reinterpret_steal<py::object>(PyCFunction_New(&multihead_call_method, nullptr));
  m.def("_install_multihead_call", &install_multihead_call, py::arg("cls"), py::arg("fallback"),
        py::arg("global_hooks"), py::arg("hook_attributes"),
        "cls.__call__ becomes module_call (attend/_multihead.py calls this once)");
}

}  // namespace attend_python
