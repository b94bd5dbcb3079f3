// bindings.hpp: what the binding files share.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

namespace attend_python {

namespace py = pybind11;

// Threads for a call: `requested` when > 0, else the process-wide setting of
// attend.set_num_threads, else every core this process may run on.
int resolve_num_threads(int requested);

// Sets the Python exception for a C++ one, as the module's pybind11 translator does (for
// functions that bypass pybind11's dispatcher).
void set_python_error(std::exception_ptr error);

void bind_sdpa(py::module_& m);
void bind_modules(py::module_& m);
void bind_serving(py::module_& m);

}  // namespace attend_python
