// rope.cpp: rotary position embeddings (attend/rope.hpp). One table of cos/sin (float64) per
// distinct position of the call; each row of x turns through its position's entries.
#include "attend/rope.hpp"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "boundary/validation.hpp"
#include "boundary/views.hpp"

namespace attend {
namespace {

// Checks x and the options; returns R, the rotated dimensions.
int64_t check_rope(const TensorView& x, const RopeOptions& options, int min_rank) {
  detail::check_view("x", x);
  if (x.rank() < min_rank) {
    throw Error(detail::describe("x", x) + ": expected at least " + std::to_string(min_rank) +
                " dimensions");
  }
  if (!detail::is_attention_float(x.dtype)) {
    throw Error(std::string("x: dtype ") + dtype_name(x.dtype) +
                " is not supported (float32, float16 or bfloat16)");
  }
  if (!(std::isfinite(options.base) && options.base > 0)) {
    throw Error("rope base must be finite and > 0, got " + std::to_string(options.base));
  }
  const int64_t d = x.shape.back(0);
  const int64_t r = options.rotary_dim == 0 ? d : options.rotary_dim;
  if (r < 0 || r > d || r % 2 != 0) {
    throw Error("rotary_dim " + std::to_string(r) +
                " must be even and in [0, D = " + std::to_string(d) + "]");
  }
  for (int dim = 0; dim < x.rank(); ++dim) {
    if (x.strides[dim] == 0 && x.shape[dim] > 1) {
      throw Error("x: zero stride in dimension " + std::to_string(dim) +
                  " (rotating in place would write one element several times)");
    }
  }
  return r;
}

// cos and sin of pos·θ_k for k in [0, R/2).
void fill_angles(int64_t position, int64_t r, double base, double* cos_out, double* sin_out) {
  for (int64_t k = 0; k < r / 2; ++k) {
    const double theta = std::pow(base, -2.0 * static_cast<double>(k) / static_cast<double>(r));
    const double angle = static_cast<double>(position) * theta;
    cos_out[k] = std::cos(angle);
    sin_out[k] = std::sin(angle);
  }
}

// Rotates one row of R (of D) floats with stride `step`.
void rotate_row(float* row, int64_t step, int64_t r, RopeConvention convention, const double* c,
                const double* s) {
  for (int64_t k = 0; k < r / 2; ++k) {
    const int64_t ia = convention == RopeConvention::kHalfSplit ? k : 2 * k;
    const int64_t ib = convention == RopeConvention::kHalfSplit ? k + r / 2 : 2 * k + 1;
    const double a = row[ia * step], b = row[ib * step];
    row[ia * step] = static_cast<float>(a * c[k] - b * s[k]);
    row[ib * step] = static_cast<float>(b * c[k] + a * s[k]);
  }
}

// Visits every row (all indices but the last) of x: row(pointer offset, full index).
template <class Body>
void for_each_row(const TensorView& x, const Body& body) {
  const int rows_rank = x.rank() - 1;
  int64_t count = 1;
  for (int d = 0; d < rows_rank; ++d) count *= x.shape[d];
  std::vector<int64_t> index(static_cast<size_t>(rows_rank), 0);
  for (int64_t n = 0; n < count; ++n) {
    int64_t offset = 0, rest = n;
    for (int d = rows_rank - 1; d >= 0; --d) {
      index[static_cast<size_t>(d)] = rest % x.shape[d];
      rest /= x.shape[d];
      offset += index[static_cast<size_t>(d)] * x.strides[d];
    }
    body(offset, index);
  }
}

// float32 x itself, or a float32 copy converted back by the caller.
TensorView working_view(const TensorView& x, std::optional<Tensor>& copy) {
  if (x.dtype == DType::kFloat32) return x;
  copy.emplace(DType::kFloat32, x.shape);
  convert(x, copy->view());
  return copy->view();
}

}  // namespace

void apply_rope(const TensorView& x, int64_t position_offset, const RopeOptions& options) {
  const int64_t r = check_rope(x, options, 2);
  if (position_offset < 0) {
    throw Error("position_offset must be >= 0, got " + std::to_string(position_offset));
  }
  const int64_t length = x.shape.back(1);
  if (x.numel() == 0 || r == 0) return;
  std::vector<double> cos_table(static_cast<size_t>(length * r / 2));
  std::vector<double> sin_table(cos_table.size());
  for (int64_t l = 0; l < length; ++l) {
    fill_angles(position_offset + l, r, options.base, &cos_table[static_cast<size_t>(l * r / 2)],
                &sin_table[static_cast<size_t>(l * r / 2)]);
  }
  std::optional<Tensor> copy;
  const TensorView w = working_view(x, copy);
  const int64_t step = w.strides[w.rank() - 1];
  for_each_row(w, [&](int64_t offset, const std::vector<int64_t>& index) {
    const auto l = static_cast<size_t>(index.back() * r / 2);
    rotate_row(w.data_as<float>() + offset, step, r, options.convention, &cos_table[l],
               &sin_table[l]);
  });
  if (copy) convert(copy->view(), x);
}

void apply_rope_at(const TensorView& x, const TensorView& positions, const RopeOptions& options) {
  const int64_t r = check_rope(x, options, 2);
  detail::check_view("positions", positions);
  if (positions.dtype != DType::kInt32 && positions.dtype != DType::kInt64) {
    throw Error(std::string("positions: dtype ") + dtype_name(positions.dtype) +
                " should be int32 or int64");
  }
  if (positions.rank() != 1 || positions.shape[0] != x.shape[0]) {
    throw Error(detail::describe("positions", positions) +
                " should hold one position per token of " + detail::describe("x", x));
  }
  if (detail::overlaps(x, positions)) throw Error("x overlaps the memory of positions");
  std::vector<int64_t> pos(static_cast<size_t>(positions.shape[0]));
  for (int64_t t = 0; t < positions.shape[0]; ++t) {
    const int64_t at = t * positions.strides[0];
    pos[static_cast<size_t>(t)] = positions.dtype == DType::kInt32
                                      ? positions.data_as<const int32_t>()[at]
                                      : positions.data_as<const int64_t>()[at];
    if (pos[static_cast<size_t>(t)] < 0) {
      throw Error("positions[" + std::to_string(t) + "] is " +
                  std::to_string(pos[static_cast<size_t>(t)]) + ", should be >= 0");
    }
  }
  if (x.numel() == 0 || r == 0) return;
  std::optional<Tensor> copy;
  const TensorView w = working_view(x, copy);
  const int64_t step = w.strides[w.rank() - 1];
  std::vector<double> c(static_cast<size_t>(r / 2)), s(c.size());
  int64_t table_token = -1;
  for_each_row(w, [&](int64_t offset, const std::vector<int64_t>& index) {
    if (index[0] != table_token) {  // rows of one token are visited together
      table_token = index[0];
      fill_angles(pos[static_cast<size_t>(table_token)], r, options.base, c.data(), s.data());
    }
    rotate_row(w.data_as<float>() + offset, step, r, options.convention, c.data(), s.data());
  });
  if (copy) convert(copy->view(), x);
}

}  // namespace attend
