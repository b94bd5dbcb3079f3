// grouped_query.cpp: grouped-query attention at the API boundary (see grouped_query.hpp).
#include "grouped_query.hpp"

#include <string>

#include "attend/error.hpp"
#include "boundary/views.hpp"

namespace attend::detail {

int64_t kv_group_of(const TensorView& q, const TensorView& k, const TensorView& v,
                    const AttentionOptions& options) {
  const int batch_rank = q.rank() - 2;
  const auto operands = [&] {
    return describe("query", q) + ", " + describe("key", k) + ", " + describe("value", v);
  };
  for (int d = 0; d + 1 < batch_rank; ++d) {
    if (k.shape[d] != q.shape[d] || v.shape[d] != q.shape[d]) {
      throw Error("batch dimension " + std::to_string(d) + " differs: " + operands());
    }
  }
  if (options.num_kv_heads < 0) {
    throw Error("num_kv_heads must be >= 0 (0: taken from key's shape), got " +
                std::to_string(options.num_kv_heads));
  }
  if (batch_rank == 0) {
    if (options.num_kv_heads > 1) {
      throw Error("num_kv_heads " + std::to_string(options.num_kv_heads) +
                  " needs a heads dimension: " + operands());
    }
    return 1;
  }
  const int head_dim = batch_rank - 1;
  const int64_t heads = q.shape[head_dim], kv_heads = k.shape[head_dim];
  if (v.shape[head_dim] != kv_heads) {
    throw Error("batch dimension " + std::to_string(head_dim) +
                " (heads) differs between key and value: " + operands());
  }
  if (options.num_kv_heads > 0 && options.num_kv_heads != kv_heads) {
    throw Error("num_kv_heads " + std::to_string(options.num_kv_heads) +
                " does not match the heads of key and value (batch dimension " +
                std::to_string(head_dim) + "): " + operands());
  }
  if (kv_heads == heads) return 1;
  if (kv_heads == 0 || heads % kv_heads != 0) {
    throw Error("batch dimension " + std::to_string(head_dim) + " differs: " + operands() +
                "; grouped-query attention needs the key/value heads (" + std::to_string(kv_heads) +
                ") to divide the query heads (" + std::to_string(heads) + ")");
  }
  if (batch_rank == kMaxBatchRank && q.shape[0] != 1) {
    throw Error("grouped-query attention takes at most " + std::to_string(kMaxBatchRank - 1) +
                " batch dimensions (the heads split in two): " + operands());
  }
  return heads / kv_heads;
}

// Batch dimensions move one place to the front; the heads dimension (stride s) splits into
// (group of G heads: G·s, head within the group: s) for a per-query-head operand.
OperandStrides split_query_heads(OperandStrides s, int64_t group) {
  const int64_t head = s.batch[kMaxBatchRank - 1];
  for (int d = 0; d + 2 < kMaxBatchRank; ++d) s.batch[d] = s.batch[d + 1];
  s.batch[kMaxBatchRank - 2] = head * group;
  s.batch[kMaxBatchRank - 1] = head;
  return s;
}

namespace {

// Key and value: their heads dimension is already the Hkv groups; broadcast over G.
OperandStrides split_kv_heads_strides(OperandStrides s) {
  const int64_t head = s.batch[kMaxBatchRank - 1];
  for (int d = 0; d + 2 < kMaxBatchRank; ++d) s.batch[d] = s.batch[d + 1];
  s.batch[kMaxBatchRank - 2] = head;
  s.batch[kMaxBatchRank - 1] = 0;
  return s;
}

}  // namespace

SdpaParams split_kv_heads(const SdpaParams& p, int64_t group) {
  SdpaParams s = p;
  const int64_t heads = p.batch_shape[kMaxBatchRank - 1];
  for (int d = 0; d + 2 < kMaxBatchRank; ++d) s.batch_shape[d] = p.batch_shape[d + 1];
  s.batch_shape[kMaxBatchRank - 2] = heads / group;
  s.batch_shape[kMaxBatchRank - 1] = group;
  s.key_strides = split_kv_heads_strides(p.key_strides);
  s.value_strides = split_kv_heads_strides(p.value_strides);
  s.key_scale_strides = split_kv_heads_strides(p.key_scale_strides);
  s.value_scale_strides = split_kv_heads_strides(p.value_scale_strides);
  for (OperandStrides* o :
       {&s.query_strides, &s.output_strides, &s.weights_strides, &s.logsumexp_strides,
        &s.mask_strides, &s.bias_strides, &s.segment_query_strides, &s.segment_key_strides}) {
    *o = split_query_heads(*o, group);
  }
  return s;
}

SdpaBackwardParams split_kv_heads(const SdpaBackwardParams& p, int64_t group) {
  SdpaBackwardParams s = p;
  s.forward = split_kv_heads(p.forward, group);
  // dK and dV are written per query head (into dense scratch, summed afterwards).
  for (OperandStrides* o : {&s.grad_output_strides, &s.logsumexp_strides, &s.grad_query_strides,
                            &s.grad_key_strides, &s.grad_value_strides, &s.grad_scores_strides}) {
    *o = split_query_heads(*o, group);
  }
  return s;
}

void sum_kv_groups(const Tensor& dense, const TensorView& out, int64_t group) {
  // out (outer..., Hkv, Lk, D) with strides; dense (outer..., Hkv·G, Lk, D) contiguous.
  const int r = out.rank();
  const int64_t kv_heads = out.shape[r - 3], length = out.shape[r - 2], dim = out.shape[r - 1];
  int64_t outer = 1;
  for (int d = 0; d < r - 3; ++d) outer *= out.shape[d];
  const float* src = dense.data_as<const float>();
  const int64_t head_size = length * dim;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t base = 0;  // offset of outer index o in `out`
    for (int64_t rest = o, d = r - 4; d >= 0; --d) {
      base += (rest % out.shape[static_cast<int>(d)]) * out.strides[static_cast<int>(d)];
      rest /= out.shape[static_cast<int>(d)];
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* first = src + (o * kv_heads + h) * group * head_size;
      float* dst = out.data_as<float>() + base + h * out.strides[r - 3];
      for (int64_t j = 0; j < length; ++j) {
        for (int64_t e = 0; e < dim; ++e) {
          double sum = 0;
          for (int64_t g = 0; g < group; ++g) sum += first[g * head_size + j * dim + e];
          dst[j * out.strides[r - 2] + e * out.strides[r - 1]] = static_cast<float>(sum);
        }
      }
    }
  }
}

}  // namespace attend::detail
