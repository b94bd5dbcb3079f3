// ragged.cpp: helpers of ragged batches shared by varlen.cpp and paged_attention.cpp.
#include "serving/ragged.hpp"

#include <string>
#include <vector>

#include "attend/error.hpp"
#include "boundary/views.hpp"

namespace attend::detail {

// The offsets of one cu_seqlens tensor, as int64.
std::vector<int64_t> read_offsets(const char* name, const TensorView& cu, int64_t total) {
  detail::check_view(name, cu);
  if (cu.dtype != DType::kInt32) {
    throw Error(std::string(name) + ": dtype " + dtype_name(cu.dtype) + " should be int32");
  }
  if (cu.rank() != 1 || cu.shape[0] < 1) {
    throw Error(detail::describe(name, cu) + " should be (B + 1) offsets, B >= 0");
  }
  std::vector<int64_t> offsets(static_cast<size_t>(cu.shape[0]));
  for (int64_t n = 0; n < cu.shape[0]; ++n) {
    offsets[static_cast<size_t>(n)] = cu.data_as<const int32_t>()[n * cu.strides[0]];
  }
  if (offsets[0] != 0) {
    throw Error(std::string(name) + "[0] is " + std::to_string(offsets[0]) + ", should be 0");
  }
  for (size_t n = 1; n < offsets.size(); ++n) {
    if (offsets[n] < offsets[n - 1]) {
      throw Error(std::string(name) + " is not non-decreasing: [" + std::to_string(n - 1) +
                  "] = " + std::to_string(offsets[n - 1]) + " > [" + std::to_string(n) +
                  "] = " + std::to_string(offsets[n]));
    }
  }
  if (offsets.back() != total) {
    throw Error(std::string(name) + "[B] is " + std::to_string(offsets.back()) +
                " but the packed tensor holds " + std::to_string(total) + " tokens");
  }
  return offsets;
}

// Sequence s of a packed (total, heads, dim) tensor as (heads, length, dim).
TensorView sequence_view(const TensorView& packed, int64_t begin, int64_t length) {
  TensorView v = packed;
  v.data = static_cast<char*>(packed.data) +
           begin * packed.strides[0] * static_cast<int64_t>(dtype_size(packed.dtype));
  if (length == 0) v.data = packed.data;
  v.shape = Shape({packed.shape[1], length, packed.shape[2]});
  v.strides = Shape({packed.strides[1], packed.strides[0], packed.strides[2]});
  return v;
}

// Sequence s of the (total_q, H) logsumexp as (H, Lq).
TensorView sequence_rows(const TensorView& packed, int64_t begin, int64_t length) {
  TensorView v = packed;
  v.data = static_cast<char*>(packed.data) + begin * packed.strides[0] * 4;
  v.shape = Shape({packed.shape[1], length});
  v.strides = Shape({packed.strides[1], packed.strides[0]});
  return v;
}

void check_packed_output(const char* name, const TensorView& out, const Shape& expected,
                         DType dtype, const std::vector<const TensorView*>& inputs) {
  detail::check_view(name, out);
  if (out.shape != expected) {
    throw Error(detail::describe(name, out) + " does not match the expected shape " +
                expected.str());
  }
  if (out.dtype != dtype) {
    throw Error(std::string(name) + ": dtype " + dtype_name(out.dtype) + " should be " +
                dtype_name(dtype));
  }
  for (int d = 0; d < out.rank() && out.numel() > 0; ++d) {
    if (out.strides[d] == 0 && out.shape[d] > 1) {
      throw Error(std::string(name) + ": zero stride in dimension " + std::to_string(d));
    }
  }
  for (const TensorView* input : inputs) {
    if (detail::overlaps(out, *input)) {
      throw Error(std::string(name) + " overlaps the memory of an input");
    }
  }
}

}  // namespace attend::detail
