// multihead.cpp: MultiHeadAttention, the three steps of the annotated transformer.
//
//   1. project    (N, L, E_in) · W_inᵀ -> (N, L, 3, H, D) or (N, L, H, D): one GEMM per tensor
//   2. attend     SDPA reads Q, K, V as (N, H, ·, D) through strides and writes (N, L, H, D)
//   3. project    (N, L, E) · W_Oᵀ -> (N, L, E)
#include "attend/multihead.hpp"

#include <cmath>
#include <cstring>
#include <utility>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/safetensors.hpp"
#include "kernels/gemm.hpp"
#include "multihead/parameter_init.hpp"

namespace attend {
namespace {

bool is_float_input(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.shape == b.shape && a.strides == b.strides;
}

// A float32 (rows, features) matrix with column stride 1 over the (N, L, F) or (L, F) view `x`:
// `x` itself when its layout allows, else a float32 copy kept in `storage`.
struct RowMatrix {
  const float* data = nullptr;
  int64_t row_stride = 0;
};
RowMatrix as_row_matrix(const TensorView& x, Tensor& storage) {
  const int rank = x.rank();
  const int64_t features = x.shape.back(0), length = x.shape.back(1);
  const bool unit_columns = x.strides.back(0) == 1 || features <= 1;
  const bool rows_merge =
      rank == 2 || x.shape[0] <= 1 || length <= 1 || x.strides[0] == length * x.strides[1];
  if (x.dtype == DType::kFloat32 && unit_columns && rows_merge) {
    const int64_t row_stride = length > 1 || rank == 2 ? x.strides.back(1) : x.strides[0];
    return {x.data_as<const float>(), row_stride};
  }
  storage = Tensor(DType::kFloat32, x.shape);
  convert(x, storage.view());
  return {storage.data_as<const float>(), features};
}

// output(rows, out) = input(rows, in) · weight(out, in)ᵀ + bias(out).
void project(const RowMatrix& input, int64_t rows, const float* weight, int64_t out_features,
             int64_t in_features, const float* bias, float* output, int64_t output_row_stride,
             int num_threads) {
  detail::LinearParams p;
  p.rows = rows;
  p.columns = out_features;
  p.depth = in_features;
  p.input = input.data;
  p.input_row_stride = input.row_stride;
  p.weight = weight;
  p.weight_row_stride = in_features;
  p.bias = bias;
  p.output = output;
  p.output_row_stride = output_row_stride;
  p.num_threads = num_threads;
  detail::linear(p);
}

// One projected tensor (Q, K or V): token t of batch n, head h starts at
// data + n·batch_stride + t·token_stride + h·D.
struct Projected {
  const float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t token_stride = 0;

  // The (N, H, length, D) view the attention call reads.
  TensorView heads_view(int64_t batch, int64_t heads, int64_t length, int64_t head_dim) const {
    return TensorView(const_cast<float*>(data), DType::kFloat32,
                      Shape({batch, heads, length, head_dim}),
                      Shape({batch_stride, head_dim, token_stride, 1}));
  }
};

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

MultiHeadAttention::MultiHeadAttention(int64_t embed_dim, int64_t num_heads,
                                       const MultiHeadOptions& options, uint64_t seed)
    : embed_dim_(embed_dim),
      num_heads_(num_heads),
      kdim_(options.kdim == 0 ? embed_dim : options.kdim),
      vdim_(options.vdim == 0 ? embed_dim : options.vdim),
      bias_(options.bias),
      packed_(kdim_ == embed_dim && vdim_ == embed_dim) {
  if (embed_dim <= 0) throw Error("embed_dim must be positive, got " + std::to_string(embed_dim));
  if (num_heads <= 0) throw Error("num_heads must be positive, got " + std::to_string(num_heads));
  if (embed_dim % num_heads != 0) {
    throw Error("embed_dim " + std::to_string(embed_dim) + " is not divisible by num_heads " +
                std::to_string(num_heads));
  }
  if (kdim_ < 0 || vdim_ < 0) {
    throw Error("kdim and vdim must be >= 0 (0 = embed_dim), got " + std::to_string(kdim_) +
                " and " + std::to_string(vdim_));
  }
  const int64_t E = embed_dim;
  // As nn.MultiheadAttention._reset_parameters: Xavier uniform on the input projection(s),
  // zero biases, out_proj.weight from nn.Linear's default U(-1/sqrt(E), 1/sqrt(E)).
  detail::ParameterRandom in_random(seed, 0), out_random(seed, 1);
  if (packed_) {
    in_proj_weight_ = Tensor(DType::kFloat32, Shape({3 * E, E}));
    detail::fill_xavier_uniform(in_proj_weight_, in_random);
  } else {
    q_proj_weight_ = Tensor(DType::kFloat32, Shape({E, E}));
    k_proj_weight_ = Tensor(DType::kFloat32, Shape({E, kdim_}));
    v_proj_weight_ = Tensor(DType::kFloat32, Shape({E, vdim_}));
    detail::fill_xavier_uniform(q_proj_weight_, in_random);
    detail::fill_xavier_uniform(k_proj_weight_, in_random);
    detail::fill_xavier_uniform(v_proj_weight_, in_random);
  }
  out_proj_weight_ = Tensor(DType::kFloat32, Shape({E, E}));
  detail::fill_uniform(out_proj_weight_, 1.0 / std::sqrt(static_cast<double>(E)), out_random);
  if (bias_) {
    in_proj_bias_ = Tensor::zeros(DType::kFloat32, Shape({3 * E}));
    out_proj_bias_ = Tensor::zeros(DType::kFloat32, Shape({E}));
  }
}

TensorView MultiHeadAttention::in_proj_weight() const {
  if (!packed_) {
    throw Error("in_proj_weight: this module has kdim " + std::to_string(kdim_) + " and vdim " +
                std::to_string(vdim_) + " (embed_dim " + std::to_string(embed_dim_) +
                "); use q_proj_weight, k_proj_weight and v_proj_weight");
  }
  return in_proj_weight_.view();
}

TensorView MultiHeadAttention::q_proj_weight() const {
  if (!packed_) return q_proj_weight_.view();
  return TensorView(const_cast<float*>(in_proj_weight_.data_as<float>()),
                    Shape({embed_dim_, embed_dim_}));
}
TensorView MultiHeadAttention::k_proj_weight() const {
  if (!packed_) return k_proj_weight_.view();
  return TensorView(const_cast<float*>(in_proj_weight_.data_as<float>()) + embed_dim_ * embed_dim_,
                    Shape({embed_dim_, embed_dim_}));
}
TensorView MultiHeadAttention::v_proj_weight() const {
  if (!packed_) return v_proj_weight_.view();
  return TensorView(
      const_cast<float*>(in_proj_weight_.data_as<float>()) + 2 * embed_dim_ * embed_dim_,
      Shape({embed_dim_, embed_dim_}));
}
TensorView MultiHeadAttention::in_proj_bias() const {
  if (!bias_) throw Error("in_proj_bias: this module was built with bias = false");
  return in_proj_bias_.view();
}
TensorView MultiHeadAttention::out_proj_weight() const { return out_proj_weight_.view(); }
TensorView MultiHeadAttention::out_proj_bias() const {
  if (!bias_) throw Error("out_proj.bias: this module was built with bias = false");
  return out_proj_bias_.view();
}

std::map<std::string, TensorView> MultiHeadAttention::state_dict() const {
  std::map<std::string, TensorView> tensors;
  if (packed_) {
    tensors["in_proj_weight"] = in_proj_weight_.view();
  } else {
    tensors["q_proj_weight"] = q_proj_weight_.view();
    tensors["k_proj_weight"] = k_proj_weight_.view();
    tensors["v_proj_weight"] = v_proj_weight_.view();
  }
  tensors["out_proj.weight"] = out_proj_weight_.view();
  if (bias_) {
    tensors["in_proj_bias"] = in_proj_bias_.view();
    tensors["out_proj.bias"] = out_proj_bias_.view();
  }
  return tensors;
}

void MultiHeadAttention::load_state_dict(const std::map<std::string, Tensor>& tensors) {
  const auto expected = state_dict();
  // Check everything first, so that an error leaves the module unchanged.
  for (const auto& [name, destination] : expected) {
    const auto found = tensors.find(name);
    if (found == tensors.end()) {
      throw Error("state_dict: missing tensor '" + name + "' (expected shape " +
                  destination.shape.str() + ")");
    }
    const Tensor& source = found->second;
    if (source.shape() != destination.shape) {
      throw Error("state_dict: tensor '" + name + "' has shape " + source.shape().str() +
                  ", expected " + destination.shape.str());
    }
    if (!is_floating(source.dtype())) {
      throw Error("state_dict: tensor '" + name + "' has dtype " + dtype_name(source.dtype()) +
                  ", expected a floating dtype");
    }
  }
  for (const auto& [name, destination] : expected) convert(tensors.at(name).view(), destination);
}

void MultiHeadAttention::load(const std::string& safetensors_path) {
  SafetensorsContents contents = load_safetensors(safetensors_path);
  try {
    load_state_dict(contents.tensors);
  } catch (const Error& error) {
    throw Error(safetensors_path + ": " + error.what());
  }
}

void MultiHeadAttention::save(const std::string& safetensors_path) const {
  save_safetensors(safetensors_path, state_dict());
}

MultiHeadResult MultiHeadAttention::forward(const TensorView& query, const TensorView& key,
                                            const TensorView& value,
                                            const MultiHeadForwardOptions& options) const {
  // Validation: shapes (N, L, E), (N, S, kdim), (N, S, vdim) or unbatched (L, E), ...
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
  const bool batched = query.rank() == 3;
  const int64_t N = batched ? query.shape[0] : 1;
  const int64_t L = query.shape.back(1), S = key.shape.back(1);
  const int64_t E = embed_dim_, H = num_heads_, D = E / H;
  if (batched && (key.shape[0] != N || value.shape[0] != N)) {
    throw Error("batch sizes differ: query " + query.shape.str() + ", key " + key.shape.str() +
                ", value " + value.shape.str());
  }
  if (query.shape.back(0) != E) {
    throw Error("query: shape " + query.shape.str() + " should end in embed_dim " +
                std::to_string(E));
  }
  if (key.shape.back(0) != kdim_) {
    throw Error("key: shape " + key.shape.str() + " should end in kdim " + std::to_string(kdim_));
  }
  if (value.shape.back(0) != vdim_) {
    throw Error("value: shape " + value.shape.str() + " should end in vdim " +
                std::to_string(vdim_));
  }
  if (value.shape.back(1) != S) {
    throw Error("value " + value.shape.str() + " and key " + key.shape.str() +
                " differ in the key length S");
  }
  if (S == 0) throw Error("key: shape " + key.shape.str() + " has no keys (S = 0)");
  const int num_threads = options.num_threads > 0 ? options.num_threads : default_num_threads();
  if (options.need_weights) {
    // The per-head weights (N, H, L, S) float32 exist even when averaged: refuse them before
    // any work or allocation when they exceed the limit.
    const double bytes = 4.0 * static_cast<double>(N) * static_cast<double>(H) *
                         static_cast<double>(L) * static_cast<double>(S);
    if (bytes > static_cast<double>(options.max_weights_bytes)) {
      throw Error("weights " + Shape({N, H, L, S}).str() + " would take " +
                  std::to_string(static_cast<uint64_t>(bytes)) + " bytes, over the limit of " +
                  std::to_string(options.max_weights_bytes) +
                  " (max_weights_bytes); pass need_weights = false or raise the limit");
    }
  }

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
  std::optional<TensorView> mask;
  Tensor combined_mask;
  if (padding_view && attn_view) {
    // Both: one uint8 (N, 1 or H, L, S) mask keeping what both keep.
    const int64_t mask_heads = attn_view->shape[1];
    combined_mask = Tensor(DType::kUInt8, Shape({N, mask_heads, L, S}));
    auto* out = combined_mask.data_as<uint8_t>();
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
    mask = combined_mask.view();
  } else if (padding_view) {
    mask = padding_view;
  } else if (attn_view) {
    mask = attn_view;
  }

  // 1. Project Q, K, V: one GEMM per distinct input, written as (N, length, parts, H, D).
  Tensor query_storage, key_storage, value_storage;
  Tensor qkv, q_buffer, kv_buffer, k_buffer, v_buffer;
  Projected q, k, v;
  const float* in_bias = bias_ ? in_proj_bias_.data_as<float>() : nullptr;
  auto bias_part = [&](int part) { return in_bias ? in_bias + part * E : nullptr; };
  const RowMatrix query_rows = as_row_matrix(query, query_storage);
  if (packed_ && same_view(query, key) && same_view(key, value)) {
    qkv = Tensor(DType::kFloat32, Shape({N, L, 3, H, D}));
    project(query_rows, N * L, in_proj_weight_.data_as<float>(), 3 * E, E, in_bias,
            qkv.data_as<float>(), 3 * E, num_threads);
    const float* base = qkv.data_as<float>();
    q = {base, L * 3 * E, 3 * E};
    k = {base + E, L * 3 * E, 3 * E};
    v = {base + 2 * E, L * 3 * E, 3 * E};
  } else {
    q_buffer = Tensor(DType::kFloat32, Shape({N, L, H, D}));
    project(query_rows, N * L, q_proj_weight().data_as<float>(), E, E, bias_part(0),
            q_buffer.data_as<float>(), E, num_threads);
    q = {q_buffer.data_as<float>(), L * E, E};
    const RowMatrix key_rows = as_row_matrix(key, key_storage);
    if (packed_ && same_view(key, value)) {
      // Cross-attention over one memory: K and V from rows [E, 3E) of in_proj_weight at once.
      kv_buffer = Tensor(DType::kFloat32, Shape({N, S, 2, H, D}));
      project(key_rows, N * S, k_proj_weight().data_as<float>(), 2 * E, E, bias_part(1),
              kv_buffer.data_as<float>(), 2 * E, num_threads);
      k = {kv_buffer.data_as<float>(), S * 2 * E, 2 * E};
      v = {kv_buffer.data_as<float>() + E, S * 2 * E, 2 * E};
    } else {
      const RowMatrix value_rows = as_row_matrix(value, value_storage);
      k_buffer = Tensor(DType::kFloat32, Shape({N, S, H, D}));
      v_buffer = Tensor(DType::kFloat32, Shape({N, S, H, D}));
      project(key_rows, N * S, k_proj_weight().data_as<float>(), E, kdim_, bias_part(1),
              k_buffer.data_as<float>(), E, num_threads);
      project(value_rows, N * S, v_proj_weight().data_as<float>(), E, vdim_, bias_part(2),
              v_buffer.data_as<float>(), E, num_threads);
      k = {k_buffer.data_as<float>(), S * E, E};
      v = {v_buffer.data_as<float>(), S * E, E};
    }
  }

  // 2. Attend: every head at once, reading (N, H, ·, D) views, writing (N, L, H, D) = (N, L, E).
  Tensor heads(DType::kFloat32, Shape({N, L, H, D}));
  const TensorView heads_view(heads.data(), DType::kFloat32, Shape({N, H, L, D}),
                              Shape({L * E, D, E, 1}));
  MultiHeadResult result;
  Tensor per_head_weights;
  TensorView weights_view;
  if (options.need_weights) {
    if (options.average_weights_over_heads) {
      per_head_weights = Tensor(DType::kFloat32, Shape({N, H, L, S}));
      result.weights = Tensor(DType::kFloat32, batched ? Shape({N, L, S}) : Shape({L, S}));
      weights_view = per_head_weights.view();
    } else {
      result.weights = Tensor(DType::kFloat32, batched ? Shape({N, H, L, S}) : Shape({H, L, S}));
      weights_view = TensorView(result.weights.data(), DType::kFloat32, Shape({N, H, L, S}));
    }
  }
  AttentionOptions attention;
  attention.mask = mask;
  attention.causal = options.causal;
  attention.dropout = options.dropout;
  attention.seed = options.seed;
  attention.num_threads = num_threads;
  attention.backend = options.backend;
  scaled_dot_product_attention_into(q.heads_view(N, H, L, D), k.heads_view(N, H, S, D),
                                    v.heads_view(N, H, S, D), heads_view,
                                    options.need_weights ? &weights_view : nullptr, attention);
  if (options.need_weights && options.average_weights_over_heads) {
    // weights(n, i, j) = (1/H) Σ_h per_head(n, h, i, j), summed in head order.
    const float* per_head = per_head_weights.data_as<float>();
    float* averaged = result.weights.data_as<float>();
    const int64_t plane = L * S;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t e = 0; e < plane; ++e) {
        float sum = 0.0f;
        for (int64_t h = 0; h < H; ++h) sum += per_head[(n * H + h) * plane + e];
        averaged[n * plane + e] = sum / static_cast<float>(H);
      }
    }
  }

  // 3. Concatenate the heads (already adjacent in (N, L, H, D)) and project.
  result.output = Tensor(DType::kFloat32, batched ? Shape({N, L, E}) : Shape({L, E}));
  project({heads.data_as<float>(), E}, N * L, out_proj_weight_.data_as<float>(), E, E,
          bias_ ? out_proj_bias_.data_as<float>() : nullptr, result.output.data_as<float>(), E,
          num_threads);
  return result;
}

}  // namespace attend
