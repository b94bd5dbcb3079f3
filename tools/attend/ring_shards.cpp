// ring_shards.cpp: see ring_shards.hpp.
#include "ring_shards.hpp"

#include <cstdint>

namespace attend::cli {
namespace {

// `length` rows of `t` from row `row` of its sequence dimension.
TensorView rows(TensorView t, int64_t row, int64_t length) {
  const int dim = t.rank() - 2;
  t.data = static_cast<float*>(t.data) + row * t.strides[dim];
  t.shape[dim] = length;
  return t;
}

}  // namespace

Tensor gather_rows(const TensorView& whole, const std::vector<mpi::ShardPiece>& pieces) {
  const int dim = whole.rank() - 2;
  Shape shape = whole.shape;
  shape[dim] = 0;
  for (const auto& p : pieces) shape[dim] += p.length;
  Tensor out(DType::kFloat32, shape);
  int64_t at = 0;
  for (const auto& p : pieces) {
    convert(rows(whole, p.offset, p.length), rows(out.view(), at, p.length));
    at += p.length;
  }
  return out;
}

void scatter_rows(const TensorView& shard, const std::vector<mpi::ShardPiece>& pieces,
                  const TensorView& whole) {
  int64_t at = 0;
  for (const auto& p : pieces) {
    convert(rows(shard, at, p.length), rows(whole, p.offset, p.length));
    at += p.length;
  }
}

}  // namespace attend::cli
