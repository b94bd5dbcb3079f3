// positional.cpp: sinusoidal encoding, learned position table, token embedding lookup.
#include "attend/positional.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "attend/error.hpp"
#include "dtype_table.hpp"
#include "multihead/parameter_init.hpp"

namespace attend {
namespace {

// The integer at element `offset` of an integer-dtype view.
int64_t integer_at(const TensorView& ids, int64_t offset) {
  const char* p = static_cast<const char*>(ids.data) + offset * int64_t(dtype_size(ids.dtype));
  return detail::visit_dtype(ids.dtype, [&](auto row) -> int64_t {
    using Row = decltype(row);
    using Storage = typename Row::Storage;
    if constexpr (Row::kind == detail::DTypeKind::kInt || Row::kind == detail::DTypeKind::kUInt) {
      Storage value;
      std::memcpy(&value, p, sizeof value);
      if constexpr (std::is_same_v<Storage, uint64_t>) {
        return value > uint64_t(INT64_MAX) ? -1 : static_cast<int64_t>(value);
      }
      return static_cast<int64_t>(value);
    } else {
      throw Error(std::string("ids: dtype ") + dtype_name(ids.dtype) + " is not an integer");
    }
  });
}

void check_positive(const char* name, int64_t value) {
  if (value <= 0)
    throw Error(std::string(name) + " must be positive, got " + std::to_string(value));
}

}  // namespace

Tensor sinusoidal_positional_encoding(int64_t length, int64_t dim, int64_t offset) {
  if (length < 0) throw Error("length must be >= 0, got " + std::to_string(length));
  check_positive("dim", dim);
  if (offset < 0) throw Error("offset must be >= 0, got " + std::to_string(offset));
  // PE(pos, 2i) = sin(pos · 10000^(-2i/d)), PE(pos, 2i+1) = cos(the same angle). (length, dim)
  Tensor encoding(DType::kFloat32, Shape({length, dim}));
  float* out = encoding.data_as<float>();
  for (int64_t row = 0; row < length; ++row) {
    const auto position = static_cast<double>(row + offset);
    for (int64_t column = 0; column < dim; ++column) {
      const int64_t pair = column / 2;
      const double frequency =
          std::pow(10000.0, -2.0 * static_cast<double>(pair) / static_cast<double>(dim));
      const double angle = position * frequency;
      out[row * dim + column] =
          static_cast<float>(column % 2 == 0 ? std::sin(angle) : std::cos(angle));
    }
  }
  return encoding;
}

void add_positional_encoding(const TensorView& x, const TensorView& encoding) {
  if (x.dtype != DType::kFloat32 || encoding.dtype != DType::kFloat32) {
    throw Error(std::string("add_positional_encoding: x and encoding must be float32, got ") +
                dtype_name(x.dtype) + " and " + dtype_name(encoding.dtype));
  }
  if (x.rank() != 2 && x.rank() != 3) {
    throw Error("add_positional_encoding: x " + x.shape.str() + " should be (N, L, d) or (L, d)");
  }
  const int64_t L = x.shape.back(1), d = x.shape.back(0);
  if (encoding.shape != Shape({L, d})) {
    throw Error("add_positional_encoding: encoding " + encoding.shape.str() +
                " should be (L, d) = " + Shape({L, d}).str() + " to match x " + x.shape.str());
  }
  // x(n, l, c) += encoding(l, c)
  const int64_t batch = x.rank() == 3 ? x.shape[0] : 1;
  const int64_t batch_stride = x.rank() == 3 ? x.strides[0] : 0;
  float* base = x.data_as<float>();
  const float* table = encoding.data_as<const float>();
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t c = 0; c < d; ++c) {
        base[n * batch_stride + l * x.strides.back(1) + c * x.strides.back(0)] +=
            table[l * encoding.strides[0] + c * encoding.strides[1]];
      }
    }
  }
}

PositionEmbedding::PositionEmbedding(int64_t max_length, int64_t dim, uint64_t seed) {
  check_positive("max_length", max_length);
  check_positive("dim", dim);
  table_ = Tensor(DType::kFloat32, Shape({max_length, dim}));
  detail::ParameterRandom random(seed, 10);
  detail::fill_normal(table_, 0.02, random);
}

Tensor PositionEmbedding::forward(int64_t length, int64_t offset) const {
  const int64_t max_length = table_.shape()[0], dim = table_.shape()[1];
  if (length < 0 || offset < 0 || offset > max_length - length) {
    throw Error("PositionEmbedding: positions [" + std::to_string(offset) + ", " +
                std::to_string(offset + length) + ") are outside the table of " +
                std::to_string(max_length) + " positions");
  }
  Tensor rows(DType::kFloat32, Shape({length, dim}));
  if (length > 0) {
    std::memcpy(rows.data(), table_.data_as<float>() + offset * dim,
                static_cast<size_t>(length * dim) * sizeof(float));
  }
  return rows;
}

TokenEmbedding::TokenEmbedding(int64_t vocab_size, int64_t dim, uint64_t seed) {
  check_positive("vocab_size", vocab_size);
  check_positive("dim", dim);
  table_ = Tensor(DType::kFloat32, Shape({vocab_size, dim}));
  detail::ParameterRandom random(seed, 11);
  detail::fill_normal(table_, 1.0, random);
}

Tensor TokenEmbedding::forward(const TensorView& ids) const {
  if (is_floating(ids.dtype) || ids.dtype == DType::kBool) {
    throw Error(std::string("ids: dtype ") + dtype_name(ids.dtype) + " is not an integer");
  }
  if (ids.rank() >= Shape::kMaxRank) {
    throw Error("ids: rank " + std::to_string(ids.rank()) + " leaves no room for the embedding");
  }
  if (ids.strides.rank() != ids.rank()) {
    throw Error("ids: strides " + ids.strides.str() + " do not match shape " + ids.shape.str());
  }
  const int64_t dim = this->dim(), count = ids.numel();
  Shape out_shape = ids.shape;
  out_shape.push_back(dim);
  Tensor out(DType::kFloat32, out_shape);
  // out(index..., :) = table(ids(index...), :), indices walked in C order.
  Shape index;
  for (int d = 0; d < ids.rank(); ++d) index.push_back(0);
  for (int64_t flat = 0; flat < count; ++flat) {
    int64_t offset = 0;
    for (int d = 0; d < ids.rank(); ++d) offset += index[d] * ids.strides[d];
    const int64_t id = integer_at(ids, offset);
    if (id < 0 || id >= vocab_size()) {
      std::string position = "(";
      for (int d = 0; d < ids.rank(); ++d) position += (d ? ", " : "") + std::to_string(index[d]);
      throw Error("ids: id " + std::to_string(id) + " at " + position + ") is outside [0, " +
                  std::to_string(vocab_size()) + ")");
    }
    std::memcpy(out.data_as<float>() + flat * dim, table_.data_as<float>() + id * dim,
                static_cast<size_t>(dim) * sizeof(float));
    for (int d = ids.rank() - 1; d >= 0; --d) {
      if (++index[d] < ids.shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

}  // namespace attend
