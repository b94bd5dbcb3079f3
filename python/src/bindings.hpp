// bindings.hpp: what the binding files share.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <initializer_list>
#include <vector>

namespace attend_python {

namespace py = pybind11;

// Threads for a call: `requested` when > 0, else the process-wide setting of
// attend.set_num_threads, else every core this process may run on.
int resolve_num_threads(int requested);

// Sets the Python exception for a C++ one, as the module's pybind11 translator does (for
// functions that bypass pybind11's dispatcher).
void set_python_error(std::exception_ptr error);

// The parameter names of a function called through CPython's METH_FASTCALL | METH_KEYWORDS
// convention (fastcall.cpp), which the per-call entries use instead of pybind11's dispatcher
// (a few hundred nanoseconds a call). Made once (static), never destroyed.
class FastcallNames {
 public:
  FastcallNames(std::initializer_list<const char*> names);
  // The call's arguments in the order of the names, into out[0..size): the positional ones
  // first, then each keyword where its name is; those not given are null. False, raising
  // nothing, for more than `max_positional` positional arguments or a keyword unknown or given
  // twice.
  bool sort(PyObject* const* args, Py_ssize_t positional, PyObject* kwnames, int max_positional,
            PyObject** out) const;
  // sort(), also false where one of the first `required` is missing; raises a TypeError
  // naming `function` when false.
  bool sort_or_raise(const char* function, PyObject* const* args, size_t nargsf,
                     PyObject* kwnames, int required, int max_positional, PyObject** out) const;

 private:
  std::vector<PyObject*> names_;  // interned
};

// `method` (static storage) as a method of the class `cls`, called without pybind11's
// dispatcher: a method descriptor, replacing any attribute of that name.
void add_method(py::handle cls, PyMethodDef* method);

void bind_sdpa(py::module_& m);
void bind_modules(py::module_& m);
void bind_serving(py::module_& m);

}  // namespace attend_python
