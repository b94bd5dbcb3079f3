// bindings.hpp: what the binding files share.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <initializer_list>
#include <vector>

namespace attend {
class MultiHeadAttention;
}

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

// The C++ object of a Python object of a pybind11-bound class T, for the per-call entries:
// an object of exactly T's bound type is read directly (pybind11's cast looks the type up in
// a table, about a tenth of a microsecond); anything else goes through the cast, which
// raises for an object that holds no T.
template <typename T>
T& cpp_object(PyObject* object) {
  static PyTypeObject* const type = reinterpret_cast<PyTypeObject*>(py::type::of<T>().ptr());
  if (Py_TYPE(object) == type) {
    auto* instance = reinterpret_cast<py::detail::instance*>(object);
    if (void* value = instance->get_value_and_holder().value_ptr()) return *static_cast<T*>(value);
  }
  return py::handle(object).cast<T&>();
}

// `method` (static storage) as a method of the class `cls`, called without pybind11's
// dispatcher: a method descriptor, replacing any attribute of that name.
void add_method(py::handle cls, PyMethodDef* method);

// A MultiHeadAttention forward (module_bindings.cpp) -> (output, weights or None, tape or None).
// query (N, L, E) (or (L, N, E) with sequence_first, read as (N, L, E) in place, the output
// returned so) or unbatched (L, E); key (N, S, kdim), value (N, S, vdim); masks already with
// attend's polarity (nonzero keeps), or None. A key or value that is the query object is read
// as the same view (self-attention: one projection GEMM).
py::tuple multihead_forward(const attend::MultiHeadAttention& module, py::handle query,
                            py::handle key, py::handle value, py::handle key_padding_mask,
                            py::handle attn_mask, bool causal, bool need_weights, bool average,
                            double dropout, uint64_t seed, int num_threads, bool want_tape,
                            bool sequence_first = false);

void bind_sdpa(py::module_& m);
void bind_modules(py::module_& m);
void bind_multihead_call(py::module_& m);
void bind_serving(py::module_& m);

}  // namespace attend_python
