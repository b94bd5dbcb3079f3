// numpy_views.hpp: NumPy arrays read from the array object's own fields (data, dims, strides,
// dtype number), without exporting a buffer: the per-call path of prepared calls, where the
// buffer export (a few hundred nanoseconds per array) was most of the cost. Anything else
// (torch tensors, non-native byte order, other exporters) goes through borrow().
//
// Unlike borrow(), the array is not pinned by an export: it must not be resized by another
// thread while the call runs (a torch tensor is not pinned either).
#pragma once

#include <optional>

#include "arrays.hpp"

namespace attend_python {

// `object` as a view for the length of one call: NumPy ndarrays (exactly that type, native
// byte order, a dtype listed in numpy_views.cpp) read directly, everything else through
// borrow(), which `fallback` then holds (destroy with the GIL held), with borrow()'s errors.
struct InPlace {
  InPlace(py::handle object, const char* name, bool writable = false);
  attend::TensorView view;
  Kind kind = Kind::kNumpy;
  std::optional<Borrowed> fallback;
};

}  // namespace attend_python
