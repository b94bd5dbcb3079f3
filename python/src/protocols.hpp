// protocols.hpp: the ways a Python array is read as an attend::TensorView and an attend::Tensor
// handed back, one file per protocol; arrays.cpp picks one per object (see arrays.hpp).
//   numpy_arrays.cpp     NumPy ndarrays: read from the array object's own fields; results as
//                        ndarrays owning the tensor
//   torch_tensors.cpp    torch tensors: read through their attributes; results through DLPack
//   dlpack_capsules.cpp  DLPack: other producers' __dlpack__ capsules, and the capsules torch
//                        results are made from
//   buffer_protocol.cpp  PEP 3118 buffers: anything else that exports one (an ndarray the
//                        field read does not take, memoryview, array.array, ...)
// Every reader takes shapes and strides as they are, and copies nothing.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>

#include "arrays.hpp"
#include "attend/tensor.hpp"
#include "dlpack.hpp"

namespace attend_python {

// Refuses more dimensions than attend's views hold (arrays.cpp).
void check_rank(int rank, const char* name);

// An exact numpy.ndarray of native byte order, a dtype attend reads, whole-element strides and
// (when `writable`) the writeable flag, read from its fields; nullopt for anything else,
// which the buffer protocol then reads or refuses with its message. Unlike a buffer export
// the read does not pin the array: the caller holds a reference (ndarray.resize then refuses).
std::optional<attend::TensorView> view_of_ndarray(PyObject* object, bool writable);
// `tensor` as an ndarray of `shape` and `strides` (in elements) that owns it.
py::object numpy_result(attend::Tensor&& tensor, const attend::Shape& shape,
                        const attend::Shape& strides);

// `object`'s PEP 3118 buffer, exported into `buffer` (which the caller releases with
// PyBuffer_Release once the view is no longer used; on an exception nothing is held).
attend::TensorView view_of_buffer(PyObject* object, Py_buffer* buffer, const char* name,
                                  bool writable);

// An object with __dlpack__: its capsule, kept in `capsule` (it owns the memory).
attend::TensorView view_of_dlpack(py::handle object, py::object* capsule, const char* name);
// A "dltensor" capsule owning `tensor`, viewed with `shape` and `strides`.
py::object dlpack_capsule(attend::Tensor&& tensor, const attend::Shape& shape,
                          const attend::Shape& strides);

// A torch tensor (is_torch_tensor) read in place.
attend::TensorView view_of_torch(py::handle tensor, const char* name);
// `tensor` as a torch tensor of `shape` and `strides` that owns it.
py::object torch_result(attend::Tensor&& tensor, const attend::Shape& shape,
                        const attend::Shape& strides);

}  // namespace attend_python
