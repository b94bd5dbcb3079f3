// boundary/views.hpp: the strided views the API receives, as the kernels read them: checks of
// a view's own layout, overlap, the strides of broadcast and plain (batch..., rows, columns)
// operands, and float32 views with a contiguous last dimension (a copy or a staging tensor
// where the caller's view is not one). Shared by every entry point (sdpa, the backward,
// serving, multi-head).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "attend/tensor.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

// "name (2, 3, 4)"
std::string describe(const char* name, const TensorView& t);
// Null data, rank/stride mismatch, negative sizes or strides, byte offsets that overflow.
void check_view(const char* name, const TensorView& t);
// Bytes from a view's first element to one past the last it can touch (0 when empty): fixed
// by shape, strides and dtype, so a plan computes it once (plan.cpp).
int64_t byte_extent(const TensorView& t);
// Byte range [first, last) that a view can touch; empty views touch nothing (null first).
struct ByteRange {
  const char* first = nullptr;
  const char* last = nullptr;
};
ByteRange byte_range(const TensorView& t);
// [data, data + extent): a view's range from its byte_extent (a plan's, computed once).
ByteRange byte_range(const void* data, int64_t extent);
bool ranges_overlap(const ByteRange& a, const ByteRange& b);
// Whether the bytes the two views can touch intersect (empty views touch nothing).
bool overlaps(const TensorView& a, const TensorView& b);
// Strides (elements) of a view broadcast to (batch..., rows, columns) = `target`.
OperandStrides broadcast_strides(const char* name, const TensorView& t, const Shape& target);
// Strides of a (batch..., rows, columns) view whose column stride is 1.
OperandStrides plain_strides(const TensorView& t);
// Strides of a (batch..., rows) view: `row` steps along the last dimension.
OperandStrides row_vector_strides(const TensorView& t);
// The view when it is float32 with a contiguous last dimension, else a float32 copy.
TensorView as_kernel_float(const TensorView& t, std::optional<Tensor>& storage);
// An output to write: the view itself when it is float32 with a contiguous last dimension,
// else a float32 staging tensor in `storage` (the caller converts it back afterwards).
TensorView writable_kernel_float(const TensorView& out, std::optional<Tensor>& storage);

}  // namespace attend::detail
