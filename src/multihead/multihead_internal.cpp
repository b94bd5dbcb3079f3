// multihead_internal.cpp: what MultiHeadAttention's forward and backward share (see
// multihead_internal.hpp): validation of query/key/value, the combined attention mask, float32
// row matrices and the projection GEMM.
#include "multihead/multihead_internal.hpp"

#include <string>
#include <utility>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "boundary/operands.hpp"
#include "kernels/gemm.hpp"

namespace attend::detail {
namespace {

bool is_float_input(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

void check_mask_dtype(const char* name, const TensorView& mask) {
  if (is_floating(mask.dtype)) {
    throw Error(std::string(name) + ": dtype " + dtype_name(mask.dtype) +
                " is floating point; a mask must be bool or integer (zero excludes)");
  }
  if (mask.strides.rank() != mask.shape.rank()) {
    throw Error(std::string(name) + ": strides " + mask.strides.str() + " do not match shape " +
                mask.shape.str());
  }
}

// Whether the integer or bool element at `offset` (elements) is nonzero: any byte is.
bool mask_keeps(const TensorView& mask, int64_t offset) {
  const size_t size = dtype_size(mask.dtype);
  const auto* bytes = static_cast<const unsigned char*>(mask.data) + offset * int64_t(size);
  for (size_t i = 0; i < size; ++i) {
    if (bytes[i] != 0) return true;
  }
  return false;
}

}  // namespace

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.shape == b.shape && a.strides == b.strides;
}

Shape MultiHeadProblem::output_shape() const {
  return batched ? Shape({batch, query_len, embed_dim}) : Shape({query_len, embed_dim});
}

MultiHeadProblem validate_multihead_inputs(const TensorView& query, const TensorView& key,
                                           const TensorView& value, int64_t embed_dim,
                                           int64_t num_heads, int64_t kdim, int64_t vdim,
                                           int num_threads) {
  // Shapes (N, L, E), (N, S, kdim), (N, S, vdim) or unbatched (L, E), ...
  for (auto [name, t] :
       {std::pair{"query", &query}, std::pair{"key", &key}, std::pair{"value", &value}}) {
    if (t->rank() != 2 && t->rank() != 3) {
      throw Error(std::string(name) + ": shape " + t->shape.str() +
                  ", expected (N, length, features) or unbatched (length, features)");
    }
    if (t->strides.rank() != t->rank()) {
      throw Error(std::string(name) + ": strides " + t->strides.str() + " do not match shape " +
                  t->shape.str());
    }
    if (!is_float_input(t->dtype)) {
      throw Error(std::string(name) + ": dtype " + dtype_name(t->dtype) +
                  " is not supported (float32, float16 or bfloat16)");
    }
    if (t->data == nullptr && t->numel() > 0) throw Error(std::string(name) + ": null data");
  }
  if (key.rank() != query.rank() || value.rank() != query.rank()) {
    throw Error("query " + query.shape.str() + ", key " + key.shape.str() + " and value " +
                value.shape.str() + " must all be batched (3-D) or all unbatched (2-D)");
  }
  MultiHeadProblem p;
  p.batched = query.rank() == 3;
  p.batch = p.batched ? query.shape[0] : 1;
  p.query_len = query.shape.back(1);
  p.key_len = key.shape.back(1);
  p.embed_dim = embed_dim;
  p.num_heads = num_heads;
  p.head_dim = embed_dim / num_heads;
  p.num_threads = num_threads > 0 ? num_threads : default_num_threads();
  if (p.batched && (key.shape[0] != p.batch || value.shape[0] != p.batch)) {
    throw Error("batch sizes differ: query " + query.shape.str() + ", key " + key.shape.str() +
                ", value " + value.shape.str());
  }
  if (query.shape.back(0) != embed_dim) {
    throw Error("query: shape " + query.shape.str() + " should end in embed_dim " +
                std::to_string(embed_dim));
  }
  if (key.shape.back(0) != kdim) {
    throw Error("key: shape " + key.shape.str() + " should end in kdim " + std::to_string(kdim));
  }
  if (value.shape.back(0) != vdim) {
    throw Error("value: shape " + value.shape.str() + " should end in vdim " +
                std::to_string(vdim));
  }
  if (value.shape.back(1) != p.key_len) {
    throw Error("value " + value.shape.str() + " and key " + key.shape.str() +
                " differ in the key length S");
  }
  if (p.key_len == 0) throw Error("key: shape " + key.shape.str() + " has no keys (S = 0)");
  return p;
}

ProjectionGrouping projection_grouping(const TensorView& query, const TensorView& key,
                                       const TensorView& value, bool packed_in_projection) {
  if (!packed_in_projection) return ProjectionGrouping::kSeparate;
  if (same_view(query, key) && same_view(key, value)) return ProjectionGrouping::kPackedSelf;
  if (same_view(key, value)) return ProjectionGrouping::kPackedMemory;
  return ProjectionGrouping::kSeparate;
}

AttentionMask build_attention_mask(const MultiHeadForwardOptions& options,
                                   const MultiHeadProblem& problem) {
  const int64_t N = problem.batch, H = problem.num_heads, L = problem.query_len,
                S = problem.key_len;
  const bool batched = problem.batched;
  // Masks as (N, 1 or H, L, S) views, broadcast through zero strides.
  std::optional<TensorView> padding_view, attn_view;
  if (options.key_padding_mask) {
    const TensorView& m = *options.key_padding_mask;
    check_mask_dtype("key_padding_mask", m);
    const Shape expected = batched ? Shape({N, S}) : Shape({S});
    if (m.shape != expected) {
      throw Error("key_padding_mask: shape " + m.shape.str() + ", expected " + expected.str() +
                  " (N, S)");
    }
    const int64_t batch_stride = batched ? m.strides[0] : 0;
    padding_view = TensorView(m.data, m.dtype, Shape({N, 1, 1, S}),
                              Shape({batch_stride, 0, 0, m.strides.back(0)}));
  }
  if (options.attn_mask) {
    const TensorView& m = *options.attn_mask;
    check_mask_dtype("attn_mask", m);
    const Shape per_head = batched ? Shape({N * H, L, S}) : Shape({H, L, S});
    if (m.shape == Shape({L, S})) {
      attn_view = TensorView(m.data, m.dtype, Shape({1, 1, L, S}),
                             Shape({0, 0, m.strides[0], m.strides[1]}));
    } else if (m.shape == per_head) {
      attn_view = TensorView(m.data, m.dtype, Shape({N, H, L, S}),
                             Shape({H * m.strides[0], m.strides[0], m.strides[1], m.strides[2]}));
    } else {
      throw Error("attn_mask: shape " + m.shape.str() +
                  ", expected (L, S) = " + Shape({L, S}).str() + " or " +
                  (batched ? "(N·num_heads, L, S) = " : "(num_heads, L, S) = ") + per_head.str());
    }
  }
  AttentionMask mask;
  if (padding_view && attn_view) {
    // Both: one uint8 (N, 1 or H, L, S) mask keeping what both keep.
    const int64_t mask_heads = attn_view->shape[1];
    mask.storage = Tensor(DType::kUInt8, Shape({N, mask_heads, L, S}));
    auto* out = mask.storage.data_as<uint8_t>();
    const Shape& ps = padding_view->strides;
    const Shape& as = attn_view->strides;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < mask_heads; ++h) {
        for (int64_t i = 0; i < L; ++i) {
          for (int64_t j = 0; j < S; ++j) {
            const bool keep = mask_keeps(*padding_view, n * ps[0] + j * ps[3]) &&
                              mask_keeps(*attn_view, n * as[0] + h * as[1] + i * as[2] + j * as[3]);
            *out++ = keep ? 1 : 0;
          }
        }
      }
    }
    mask.view = mask.storage.view();
  } else if (padding_view) {
    mask.view = padding_view;
  } else if (attn_view) {
    mask.view = attn_view;
  }
  return mask;
}

AttentionOptions attention_options(const MultiHeadForwardOptions& options,
                                   const AttentionMask& mask, int num_threads) {
  AttentionOptions attention;
  attention.mask = mask.view;
  attention.causal = options.causal;
  attention.dropout = options.dropout;
  attention.seed = options.seed;
  attention.num_threads = num_threads;
  attention.backend = options.backend;
  return attention;
}

RowMatrix as_row_matrix(const TensorView& x, Tensor& storage, bool bf16) {
  const int rank = x.rank();
  const int64_t features = x.shape.back(0), length = x.shape.back(1);
  const bool unit_columns = x.strides.back(0) == 1 || features <= 1;
  const bool rows_merge =
      rank == 2 || x.shape[0] <= 1 || length <= 1 || x.strides[0] == length * x.strides[1];
  const DType dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;
  const auto matrix = [&](const void* data, int64_t row_stride) {
    RowMatrix m;
    m.row_stride = row_stride;
    if (bf16) {
      m.data_bf16 = static_cast<const uint16_t*>(data);
    } else {
      m.data = static_cast<const float*>(data);
    }
    return m;
  };
  if (x.dtype == dtype && unit_columns && rows_merge) {
    return matrix(x.data, length > 1 || rank == 2 ? x.strides.back(1) : x.strides[0]);
  }
  storage = Tensor(dtype, x.shape);
  convert(x, storage.view());
  return matrix(storage.data(), features);
}

void project(const RowMatrix& input, int64_t rows, const float* weight, int64_t out_features,
             int64_t in_features, const float* bias, float* output, int64_t output_row_stride,
             int num_threads) {
  LinearParams p;
  p.rows = rows;
  p.columns = out_features;
  p.depth = in_features;
  p.input = input.data;
  p.input_bf16 = input.data_bf16;
  const Bf16Products products =
      input.data_bf16 != nullptr
          ? bf16_products(DType::kBFloat16, ComputePrecision::kAuto, ProductSite::kProjections)
          : Bf16Products::kFloat32;
  p.bf16_products = products != Bf16Products::kFloat32;
  p.amx_tiles = products == Bf16Products::kAmxTiles;
  p.input_row_stride = input.row_stride;
  p.weight = weight;
  p.weight_row_stride = in_features;
  p.bias = bias;
  p.output = output;
  p.output_row_stride = output_row_stride;
  p.num_threads = num_threads;
  linear(p);
}

}  // namespace attend::detail
