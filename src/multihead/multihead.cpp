// multihead.cpp: MultiHeadAttention, the three steps of the annotated transformer.
//
//   1. project    (N, L, E_in) · W_inᵀ -> (N, L, 3, H, D) or (N, L, H, D): one GEMM per tensor
//   2. attend     SDPA reads Q, K, V as (N, H, ·, D) through strides and writes (N, L, H, D)
//   3. project    (N, L, E) · W_Oᵀ -> (N, L, E)
//
// The backward pass is in multihead_backward.cpp; what both use is in multihead_internal.hpp.
#include "attend/multihead.hpp"

#include <cmath>
#include <utility>

#include "attend/error.hpp"
#include "attend/safetensors.hpp"
#include "boundary/operands.hpp"
#include "multihead/multihead_internal.hpp"
#include "multihead/parameter_init.hpp"
#include "quote.hpp"

namespace attend {

MultiHeadAttention::MultiHeadAttention(int64_t embed_dim, int64_t num_heads,
                                       const MultiHeadOptions& options, uint64_t seed)
    : embed_dim_(embed_dim),
      num_heads_(num_heads),
      kdim_(options.kdim == 0 ? embed_dim : options.kdim),
      vdim_(options.vdim == 0 ? embed_dim : options.vdim),
      kv_heads_(options.num_kv_heads == 0 ? num_heads : options.num_kv_heads),
      bias_(options.bias),
      packed_(kdim_ == embed_dim && vdim_ == embed_dim && kv_heads_ == num_heads) {
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
  if (kv_heads_ <= 0 || num_heads % kv_heads_ != 0) {
    throw Error("num_kv_heads " + std::to_string(kv_heads_) +
                " must be positive and divide num_heads " + std::to_string(num_heads));
  }
  const int64_t E = embed_dim, F = kv_heads_ * (embed_dim / num_heads);
  // As nn.MultiheadAttention._reset_parameters: Xavier uniform on the input projection(s),
  // zero biases, out_proj.weight from nn.Linear's default U(-1/sqrt(E), 1/sqrt(E)).
  detail::ParameterRandom in_random(seed, 0), out_random(seed, 1);
  if (packed_) {
    in_proj_weight_ = Tensor(DType::kFloat32, Shape({3 * E, E}));
    detail::fill_xavier_uniform(in_proj_weight_, in_random);
  } else {
    q_proj_weight_ = Tensor(DType::kFloat32, Shape({E, E}));
    k_proj_weight_ = Tensor(DType::kFloat32, Shape({F, kdim_}));
    v_proj_weight_ = Tensor(DType::kFloat32, Shape({F, vdim_}));
    detail::fill_xavier_uniform(q_proj_weight_, in_random);
    detail::fill_xavier_uniform(k_proj_weight_, in_random);
    detail::fill_xavier_uniform(v_proj_weight_, in_random);
  }
  out_proj_weight_ = Tensor(DType::kFloat32, Shape({E, E}));
  detail::fill_uniform(out_proj_weight_, 1.0 / std::sqrt(static_cast<double>(E)), out_random);
  if (bias_) {
    in_proj_bias_ = Tensor::zeros(DType::kFloat32, Shape({E + 2 * F}));
    out_proj_bias_ = Tensor::zeros(DType::kFloat32, Shape({E}));
  }
}

TensorView MultiHeadAttention::in_proj_weight() const {
  if (!packed_) {
    throw Error("in_proj_weight: this module has kdim " + std::to_string(kdim_) + ", vdim " +
                std::to_string(vdim_) + " and " + std::to_string(kv_heads_) +
                " K/V heads (embed_dim " + std::to_string(embed_dim_) + ", " +
                std::to_string(num_heads_) +
                " heads); use q_proj_weight, k_proj_weight and v_proj_weight");
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

namespace {

// Rows of `parts` (each (rows_i, columns) or (rows_i)) one after another, converted to
// float32; attend::Error naming a part missing or of another width.
Tensor concatenated_rows(const std::map<std::string, Tensor>& tensors,
                         std::initializer_list<const char*> names) {
  int64_t rows = 0, columns = -1;
  for (const char* name : names) {
    const auto found = tensors.find(name);
    if (found == tensors.end())
      throw Error(std::string("state_dict: missing tensor '") + name + "'");
    const Shape& shape = found->second.shape();
    const int64_t width = shape.rank() == 2 ? shape[1] : 0;
    if (shape.rank() < 1 || shape.rank() > 2 || (columns >= 0 && width != columns)) {
      throw Error(std::string("state_dict: tensor '") + name + "' has shape " + shape.str() +
                  ", which does not stack with the other projections");
    }
    columns = width;
    rows += shape[0];
  }
  Tensor result(DType::kFloat32, columns > 0 ? Shape({rows, columns}) : Shape({rows}));
  int64_t offset = 0;
  for (const char* name : names) {
    const Tensor& part = tensors.at(name);
    const int64_t count = part.numel();
    convert(part.view(),
            TensorView(result.data_as<float>() + offset, DType::kFloat32, part.shape()));
    offset += count;
  }
  return result;
}

}  // namespace

void MultiHeadAttention::load_state_dict(const std::map<std::string, Tensor>& tensors) {
  if (!tensors.count("out_proj.weight") && tensors.count("o_proj.weight")) {
    // A decoder model's names: q/k/v/o_proj.{weight,bias}, translated.
    std::map<std::string, Tensor> translated;
    if (packed_) {
      translated["in_proj_weight"] =
          concatenated_rows(tensors, {"q_proj.weight", "k_proj.weight", "v_proj.weight"});
    } else {
      translated["q_proj_weight"] = concatenated_rows(tensors, {"q_proj.weight"});
      translated["k_proj_weight"] = concatenated_rows(tensors, {"k_proj.weight"});
      translated["v_proj_weight"] = concatenated_rows(tensors, {"v_proj.weight"});
    }
    translated["out_proj.weight"] = concatenated_rows(tensors, {"o_proj.weight"});
    if (bias_) {
      translated["in_proj_bias"] =
          concatenated_rows(tensors, {"q_proj.bias", "k_proj.bias", "v_proj.bias"});
      translated["out_proj.bias"] = concatenated_rows(tensors, {"o_proj.bias"});
    }
    return load_state_dict(translated);
  }
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
    throw Error(detail::printable_for_message(safetensors_path) + ": " + error.what());
  }
}

void MultiHeadAttention::save(const std::string& safetensors_path) const {
  save_safetensors(safetensors_path, state_dict());
}

MultiHeadResult MultiHeadAttention::forward(const TensorView& query, const TensorView& key,
                                            const TensorView& value,
                                            const MultiHeadForwardOptions& options) const {
  return forward(query, key, value, options, nullptr);
}

MultiHeadResult MultiHeadAttention::forward(const TensorView& query, const TensorView& key,
                                            const TensorView& value,
                                            const MultiHeadForwardOptions& options,
                                            MultiHeadTape* tape) const {
  const detail::MultiHeadProblem problem = detail::validate_multihead_inputs(
      query, key, value, embed_dim_, num_heads_, kdim_, vdim_, options.num_threads);
  const bool batched = problem.batched;
  const int64_t N = problem.batch, L = problem.query_len, S = problem.key_len;
  const int64_t E = embed_dim_, H = num_heads_, D = E / H, Hkv = kv_heads_, F = Hkv * D;
  const int num_threads = problem.num_threads;
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
  const detail::AttentionMask mask = detail::build_attention_mask(options, problem);
  // bfloat16 products (the projections, the attention): never for a tape, whose float32
  // projections the backward reads.
  const bool bf16 = detail::wants_bf16_products(query.dtype, options.compute) && tape == nullptr;

  // 1. Project Q, K, V: one GEMM per distinct input, written as (N, length, parts, H, D).
  Tensor query_storage, key_storage, value_storage;
  Tensor query_projection, key_projection, value_projection;
  detail::Projected q, k, v;
  const float* in_bias = bias_ ? in_proj_bias_.data_as<float>() : nullptr;
  // Q, K, V biases at 0, E and E + F (F = E without grouped-query attention).
  const int64_t bias_offset[3] = {0, E, E + F};
  auto bias_part = [&](int part) { return in_bias ? in_bias + bias_offset[part] : nullptr; };
  const detail::RowMatrix query_rows = detail::as_row_matrix(query, query_storage, bf16);
  const detail::ProjectionGrouping grouping =
      detail::projection_grouping(query, key, value, packed_);
  if (grouping == detail::ProjectionGrouping::kPackedSelf) {
    query_projection = Tensor(DType::kFloat32, Shape({N, L, 3, H, D}));
    detail::project(query_rows, N * L, in_proj_weight_.data_as<float>(), 3 * E, E, in_bias,
                    query_projection.data_as<float>(), 3 * E, num_threads);
    const float* base = query_projection.data_as<float>();
    q = {base, L * 3 * E, 3 * E};
    k = {base + E, L * 3 * E, 3 * E};
    v = {base + 2 * E, L * 3 * E, 3 * E};
  } else {
    query_projection = Tensor(DType::kFloat32, Shape({N, L, H, D}));
    detail::project(query_rows, N * L, q_proj_weight().data_as<float>(), E, E, bias_part(0),
                    query_projection.data_as<float>(), E, num_threads);
    q = {query_projection.data_as<float>(), L * E, E};
    const detail::RowMatrix key_rows = detail::as_row_matrix(key, key_storage, bf16);
    if (grouping == detail::ProjectionGrouping::kPackedMemory) {
      // Cross-attention over one memory: K and V from rows [E, 3E) of in_proj_weight at once.
      key_projection = Tensor(DType::kFloat32, Shape({N, S, 2, H, D}));
      detail::project(key_rows, N * S, k_proj_weight().data_as<float>(), 2 * E, E, bias_part(1),
                      key_projection.data_as<float>(), 2 * E, num_threads);
      k = {key_projection.data_as<float>(), S * 2 * E, 2 * E};
      v = {key_projection.data_as<float>() + E, S * 2 * E, 2 * E};
    } else {
      const detail::RowMatrix value_rows = detail::as_row_matrix(value, value_storage, bf16);
      key_projection = Tensor(DType::kFloat32, Shape({N, S, Hkv, D}));
      value_projection = Tensor(DType::kFloat32, Shape({N, S, Hkv, D}));
      detail::project(key_rows, N * S, k_proj_weight().data_as<float>(), F, kdim_, bias_part(1),
                      key_projection.data_as<float>(), F, num_threads);
      detail::project(value_rows, N * S, v_proj_weight().data_as<float>(), F, vdim_, bias_part(2),
                      value_projection.data_as<float>(), F, num_threads);
      k = {key_projection.data_as<float>(), S * F, F};
      v = {value_projection.data_as<float>(), S * F, F};
    }
  }

  // With bfloat16 products, Q, K and V rounded to bfloat16 (the projections accumulate in
  // float32 first): views of the same layout into bfloat16 copies.
  // K and V have Hkv heads (grouped-query attention when fewer than H; the packed layouts
  // have Hkv = H).
  TensorView q_heads = q.heads_view(N, H, L, D), k_heads = k.heads_view(N, Hkv, S, D),
             v_heads = v.heads_view(N, Hkv, S, D);
  Tensor query_bf16, key_bf16, value_bf16;
  if (bf16) {
    const auto rounded = [](const Tensor& t, Tensor& copy) {
      if (t.empty()) return;
      copy = Tensor(DType::kBFloat16, t.shape());
      convert(t.view(), copy.view());
    };
    rounded(query_projection, query_bf16);
    rounded(key_projection, key_bf16);
    rounded(value_projection, value_bf16);
    const auto in_copy = [&](const detail::Projected& part, int64_t heads, int64_t length) {
      for (auto [source, copy] :
           {std::pair{&query_projection, &query_bf16}, std::pair{&key_projection, &key_bf16},
            std::pair{&value_projection, &value_bf16}}) {
        const float* base = source->empty() ? nullptr : source->data_as<float>();
        if (base != nullptr && part.data >= base && part.data < base + source->numel()) {
          return part.heads_view_in(*copy, base, N, heads, length, D);
        }
      }
      throw Error("multi-head attention: a projection outside its tensors");  // unreachable
    };
    q_heads = in_copy(q, H, L);
    k_heads = in_copy(k, Hkv, S);
    v_heads = in_copy(v, Hkv, S);
  }

  // 2. Attend: every head at once, reading (N, H, ·, D) views, writing (N, L, H, D) = (N, L, E)
  //    (and, for the tape, the log-sum-exp of each row (N, H, L)).
  const DType heads_dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;
  Tensor heads(heads_dtype, Shape({N, L, H, D}));
  AttentionOutputViews attention_outputs;
  attention_outputs.output =
      TensorView(heads.data(), heads_dtype, Shape({N, H, L, D}), Shape({L * E, D, E, 1}));
  MultiHeadResult result;
  Tensor per_head_weights;
  if (options.need_weights) {
    if (options.average_weights_over_heads) {
      per_head_weights = Tensor(DType::kFloat32, Shape({N, H, L, S}));
      result.weights = Tensor(DType::kFloat32, batched ? Shape({N, L, S}) : Shape({L, S}));
      attention_outputs.weights = per_head_weights.view();
    } else {
      result.weights = Tensor(DType::kFloat32, batched ? Shape({N, H, L, S}) : Shape({H, L, S}));
      attention_outputs.weights =
          TensorView(result.weights.data(), DType::kFloat32, Shape({N, H, L, S}));
    }
  }
  Tensor logsumexp;
  if (tape != nullptr) {
    logsumexp = Tensor(DType::kFloat32, Shape({N, H, L}));
    attention_outputs.logsumexp = logsumexp.view();
  }
  AttentionOptions attention = detail::attention_options(options, mask, num_threads);
  attention.need_logsumexp = tape != nullptr;
  if (bf16) attention.compute = ComputePrecision::kAuto;  // bfloat16 views: native products
  scaled_dot_product_attention_into(q_heads, k_heads, v_heads, attention_outputs, attention);
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
  result.output = Tensor(DType::kFloat32, problem.output_shape());
  detail::RowMatrix head_rows;
  head_rows.row_stride = E;
  if (bf16) {
    head_rows.data_bf16 = heads.data_as<const uint16_t>();
  } else {
    head_rows.data = heads.data_as<const float>();
  }
  detail::project(head_rows, N * L, out_proj_weight_.data_as<float>(), E, E,
                  bias_ ? out_proj_bias_.data_as<float>() : nullptr, result.output.data_as<float>(),
                  E, num_threads);
  if (bf16 && !options.float32_output) {
    Tensor rounded(DType::kBFloat16, result.output.shape());
    convert(result.output.view(), rounded.view());
    result.output = std::move(rounded);
  }

  if (tape != nullptr) {
    tape->query_projection = std::move(query_projection);
    tape->key_projection = std::move(key_projection);
    tape->value_projection = std::move(value_projection);
    tape->heads = std::move(heads);
    tape->logsumexp = std::move(logsumexp);
  }
  return result;
}

}  // namespace attend
