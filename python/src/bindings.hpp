// bindings.hpp: what the binding files share.
#pragma once

#include <pybind11/pybind11.h>

namespace attend_python {

namespace py = pybind11;

// Threads for a call: `requested` when > 0, else the process-wide setting of
// attend.set_num_threads, else every core this process may run on.
int resolve_num_threads(int requested);

void bind_sdpa(py::module_& m);
void bind_modules(py::module_& m);

}  // namespace attend_python
