// fastcall.cpp: the arguments of functions and methods called through CPython's
// METH_FASTCALL | METH_KEYWORDS convention (see bindings.hpp).
#include "bindings.hpp"

namespace attend_python {

FastcallNames::FastcallNames(std::initializer_list<const char*> names) {
  for (const char* name : names) names_.push_back(PyUnicode_InternFromString(name));
}

bool FastcallNames::sort(PyObject* const* args, Py_ssize_t positional, PyObject* kwnames,
                         int max_positional, PyObject** out) const {
  const auto count = static_cast<Py_ssize_t>(names_.size());
  if (positional > max_positional || positional > count) return false;
  for (Py_ssize_t i = 0; i < count; ++i) out[i] = i < positional ? args[i] : nullptr;
  const Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t j = 0; j < keywords; ++j) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, j);
    Py_ssize_t found = -1;  // keywords in calls are interned: compare pointers first
    for (Py_ssize_t i = 0; i < count && found < 0; ++i) {
      if (name == names_[i]) found = i;
    }
    for (Py_ssize_t i = 0; i < count && found < 0; ++i) {
      if (PyUnicode_Compare(name, names_[i]) == 0) found = i;
    }
    if (found < 0 || out[found] != nullptr) return false;
    out[found] = args[positional + j];
  }
  return true;
}

bool FastcallNames::sort_or_raise(const char* function, PyObject* const* args, size_t nargsf,
                                  PyObject* kwnames, int required, int max_positional,
                                  PyObject** out) const {
  bool complete = sort(args, PyVectorcall_NARGS(nargsf), kwnames, max_positional, out);
  for (int i = 0; i < required && complete; ++i) complete = out[i] != nullptr;
  if (!complete) {
    PyErr_Format(PyExc_TypeError, "%s: wrong arguments (see help(%s))", function, function);
  }
  return complete;
}

void add_method(py::handle cls, PyMethodDef* method) {
  PyObject* descriptor = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), method);
  if (descriptor == nullptr) throw py::error_already_set();
  py::setattr(cls, method->ml_name, py::reinterpret_steal<py::object>(descriptor));
}

}  // namespace attend_python
