// multihead_backward.cpp: MultiHeadAttention::backward, the forward's three steps in reverse.
//
// For a linear layer Y = X·Wᵀ + b with X (rows, in), W (out, in), Y (rows, out):
//   dX = dY·W,   dW = dYᵀ·X,   db = Σ_rows dY
//
//   3'. output projection   dHeads = dY·W_O (N, L, E);  d out_proj.weight = dYᵀ·heads;
//                           d out_proj.bias = Σ_rows dY
//   2'. attention           one SDPA backward over every head: (N, H, ·, D) views of the tape,
//                           writing dQ (N, L, H, D), dK, dV (N, S, H, D)
//   1'. input projections   per role r in (Q, K, V), with X_r its input and W_r its rows of
//                           in_proj_weight (or r_proj_weight):
//                           dX_r = dR·W_r,  dW_r = dRᵀ·X_r,  db_r = Σ_rows dR
//                           then inputs passed as one view get one gradient, the sum.
//
// Every product is the projection GEMM (detail::linear) on transposed copies, whose output
// elements each follow one fixed accumulation order, and bias sums run over rows in order:
// the gradients are bitwise identical at any thread count.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "attend/error.hpp"
#include "attend/multihead.hpp"
#include "attend/sdpa_backward.hpp"
#include "kernels/gemm.hpp"
#include "multihead/multihead_internal.hpp"

namespace attend {
namespace {

using detail::RowMatrix;

// (columns, rows) contiguous = transpose of the (rows, columns) matrix `m`.
Tensor transposed(const RowMatrix& m, int64_t rows, int64_t columns) {
  Tensor result(DType::kFloat32, Shape({columns, rows}));
  float* out = result.data_as<float>();
  // Blocks of 32 x 32 keep both the rows read and the rows written in cache.
  constexpr int64_t kBlock = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    for (int64_t c0 = 0; c0 < columns; c0 += kBlock) {
      const int64_t r_end = std::min(rows, r0 + kBlock), c_end = std::min(columns, c0 + kBlock);
      for (int64_t r = r0; r < r_end; ++r) {
        const float* row = m.data + r * m.row_stride;
        for (int64_t c = c0; c < c_end; ++c) out[c * rows + r] = row[c];
      }
    }
  }
  return result;
}

// dX(rows, in) = dY(rows, out) · W(out, in), row strides: dY `grad.row_stride`, W `in`, dX `in`.
void input_gradient(const RowMatrix& grad, int64_t rows, const float* weight, int64_t out_features,
                    int64_t in_features, float* grad_input, int num_threads) {
  if (rows == 0 || in_features == 0) return;
  // linear computes input·weightᵀ, so it takes Wᵀ (in, out) as its weight.
  const Tensor weight_transposed =
      transposed(RowMatrix{weight, in_features}, out_features, in_features);
  detail::project(grad, rows, weight_transposed.data_as<float>(), in_features, out_features,
                  nullptr, grad_input, in_features, num_threads);
}

// dW(out, in) = dY(rows, out)ᵀ · X(rows, in), from the transposes dYᵀ (out, rows) and
// Xᵀ (in, rows); dW has row stride `in`.
void weight_gradient(const Tensor& grad_transposed, const Tensor& input_transposed,
                     float* grad_weight, int num_threads) {
  const int64_t out_features = grad_transposed.shape()[0], rows = grad_transposed.shape()[1];
  const int64_t in_features = input_transposed.shape()[0];
  if (rows == 0) {  // no tokens: an empty sum
    std::memset(grad_weight, 0, sizeof(float) * static_cast<size_t>(out_features * in_features));
    return;
  }
  detail::project({grad_transposed.data_as<float>(), rows}, out_features,
                  input_transposed.data_as<float>(), in_features, rows, nullptr, grad_weight,
                  in_features, num_threads);
}

// db(out) = Σ_rows dY(rows, out) from the transpose dYᵀ (out, rows): each sum in row order,
// in float64, rounded once.
void bias_gradient(const Tensor& grad_transposed, float* grad_bias) {
  const int64_t out_features = grad_transposed.shape()[0], rows = grad_transposed.shape()[1];
  const float* g = grad_transposed.data_as<float>();
  for (int64_t o = 0; o < out_features; ++o) {
    double sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) sum += g[o * rows + r];
    grad_bias[o] = static_cast<float>(sum);
  }
}

// grad_output: float dtype, the output's shape.
void check_grad_output(const TensorView& grad_output, const Shape& expected) {
  if (grad_output.shape != expected) {
    throw Error("grad_output: shape " + grad_output.shape.str() +
                " differs from the output's shape " + expected.str());
  }
  if (grad_output.strides.rank() != grad_output.rank()) {
    throw Error("grad_output: strides " + grad_output.strides.str() + " do not match shape " +
                grad_output.shape.str());
  }
  if (grad_output.dtype != DType::kFloat32 && grad_output.dtype != DType::kFloat16 &&
      grad_output.dtype != DType::kBFloat16) {
    throw Error(std::string("grad_output: dtype ") + dtype_name(grad_output.dtype) +
                " is not supported (float32, float16 or bfloat16)");
  }
  if (grad_output.data == nullptr && grad_output.numel() > 0) {
    throw Error("grad_output: null data");
  }
}

void check_tape_tensor(const char* name, const Tensor& got, const Shape& expected) {
  const bool matches = expected.rank() == 0
                           ? got.empty()
                           : got.dtype() == DType::kFloat32 && got.shape() == expected &&
                                 (got.data() != nullptr || got.numel() == 0);
  if (!matches) {
    throw Error(std::string("tape.") + name + ": " +
                (got.empty() ? std::string("empty") : "shape " + got.shape().str()) +
                ", expected " + (expected.rank() == 0 ? std::string("empty") : expected.str()) +
                " for these query, key and value (fill the tape with forward() on the same "
                "inputs)");
  }
}

// One role (Q, K or V): its input, the input's transpose Xᵀ (in, rows) (empty when an earlier
// role has the same input) and the gradient of the input through this role, before inputs
// passed as one view are merged.
struct RoleGradient {
  const TensorView* input = nullptr;
  Tensor input_transposed;
  Tensor gradient;
};

}  // namespace

MultiHeadGradients MultiHeadAttention::backward(const TensorView& grad_output,
                                                const TensorView& query, const TensorView& key,
                                                const TensorView& value, const MultiHeadTape& tape,
                                                const MultiHeadForwardOptions& options) const {
  // Validation: inputs as the forward, grad_output of the output's shape, a tape whose shapes
  // are what the forward of these inputs leaves, the masks.
  const detail::MultiHeadProblem problem = detail::validate_multihead_inputs(
      query, key, value, embed_dim_, num_heads_, kdim_, vdim_, options.num_threads);
  const int64_t N = problem.batch, L = problem.query_len, S = problem.key_len;
  const int64_t E = embed_dim_, H = num_heads_, D = E / H, Hkv = kv_heads_, F = Hkv * D;
  const int num_threads = problem.num_threads;
  check_grad_output(grad_output, problem.output_shape());
  const detail::ProjectionGrouping grouping =
      detail::projection_grouping(query, key, value, packed_);
  detail::Projected q, k, v;  // into the tape, laid out as the forward's GEMMs wrote them
  switch (grouping) {
    case detail::ProjectionGrouping::kPackedSelf: {
      check_tape_tensor("query_projection", tape.query_projection, Shape({N, L, 3, H, D}));
      check_tape_tensor("key_projection", tape.key_projection, Shape());
      check_tape_tensor("value_projection", tape.value_projection, Shape());
      const float* base = tape.query_projection.data_as<float>();
      q = {base, L * 3 * E, 3 * E};
      k = {base + E, L * 3 * E, 3 * E};
      v = {base + 2 * E, L * 3 * E, 3 * E};
      break;
    }
    case detail::ProjectionGrouping::kPackedMemory: {
      check_tape_tensor("query_projection", tape.query_projection, Shape({N, L, H, D}));
      check_tape_tensor("key_projection", tape.key_projection, Shape({N, S, 2, H, D}));
      check_tape_tensor("value_projection", tape.value_projection, Shape());
      q = {tape.query_projection.data_as<float>(), L * E, E};
      k = {tape.key_projection.data_as<float>(), S * 2 * E, 2 * E};
      v = {tape.key_projection.data_as<float>() + E, S * 2 * E, 2 * E};
      break;
    }
    case detail::ProjectionGrouping::kSeparate: {
      check_tape_tensor("query_projection", tape.query_projection, Shape({N, L, H, D}));
      check_tape_tensor("key_projection", tape.key_projection, Shape({N, S, Hkv, D}));
      check_tape_tensor("value_projection", tape.value_projection, Shape({N, S, Hkv, D}));
      q = {tape.query_projection.data_as<float>(), L * E, E};
      k = {tape.key_projection.data_as<float>(), S * F, F};
      v = {tape.value_projection.data_as<float>(), S * F, F};
      break;
    }
  }
  check_tape_tensor("heads", tape.heads, Shape({N, L, H, D}));
  check_tape_tensor("logsumexp", tape.logsumexp, Shape({N, H, L}));
  const detail::AttentionMask mask = detail::build_attention_mask(options, problem);

  MultiHeadGradients gradients;
  const int64_t query_rows = N * L, key_rows = N * S;

  // 3'. Output projection: dHeads (N·L, E) = dY·W_O, d out_proj.weight = dYᵀ·heads,
  //     d out_proj.bias = Σ_rows dY.
  Tensor grad_output_storage;
  const RowMatrix grad_rows = detail::as_row_matrix(grad_output, grad_output_storage);
  const Tensor grad_output_transposed = transposed(grad_rows, query_rows, E);  // (E, N·L)
  Tensor grad_heads(DType::kFloat32, Shape({N, L, H, D}));
  input_gradient(grad_rows, query_rows, out_proj_weight_.data_as<float>(), E, E,
                 grad_heads.data_as<float>(), num_threads);
  {
    Tensor grad_weight(DType::kFloat32, Shape({E, E}));
    weight_gradient(grad_output_transposed,
                    transposed({tape.heads.data_as<float>(), E}, query_rows, E),
                    grad_weight.data_as<float>(), num_threads);
    gradients.parameters["out_proj.weight"] = std::move(grad_weight);
  }
  if (bias_) {
    Tensor grad_bias(DType::kFloat32, Shape({E}));
    bias_gradient(grad_output_transposed, grad_bias.data_as<float>());
    gradients.parameters["out_proj.bias"] = std::move(grad_bias);
  }

  // 2'. Attention: every head at once, from the tape's (N, H, ·, D) views, into separate
  //     dQ (N, L, H, D), dK and dV (N, S, Hkv, D) (views of one interleaved buffer would
  //     overlap in memory; with grouped-query attention the SDPA backward sums each group).
  Tensor grad_q(DType::kFloat32, Shape({N, L, H, D}));
  Tensor grad_k(DType::kFloat32, Shape({N, S, Hkv, D}));
  Tensor grad_v(DType::kFloat32, Shape({N, S, Hkv, D}));
  {
    const detail::Projected heads{tape.heads.data_as<float>(), L * E, E};
    const detail::Projected grad_heads_rows{grad_heads.data_as<float>(), L * E, E};
    AttentionGradientViews views;
    views.query = detail::Projected{grad_q.data_as<float>(), L * E, E}.heads_view(N, H, L, D);
    views.key = detail::Projected{grad_k.data_as<float>(), S * F, F}.heads_view(N, Hkv, S, D);
    views.value = detail::Projected{grad_v.data_as<float>(), S * F, F}.heads_view(N, Hkv, S, D);
    const AttentionOptions attention = detail::attention_options(options, mask, num_threads);
    scaled_dot_product_attention_backward_into(
        grad_heads_rows.heads_view(N, H, L, D), q.heads_view(N, H, L, D),
        k.heads_view(N, Hkv, S, D), v.heads_view(N, Hkv, S, D), heads.heads_view(N, H, L, D),
        tape.logsumexp.view(), views, attention);
  }

  // 1'. Input projections, one role at a time: dX_r = dR·W_r, dW_r = dRᵀ·X_r, db_r = Σ dR.
  Tensor grad_in_proj_weight, grad_in_proj_bias;
  if (packed_) grad_in_proj_weight = Tensor(DType::kFloat32, Shape({3 * E, E}));
  if (bias_) grad_in_proj_bias = Tensor(DType::kFloat32, Shape({E + 2 * F}));
  const TensorView* inputs[3] = {&query, &key, &value};
  const Tensor* grad_projections[3] = {&grad_q, &grad_k, &grad_v};
  const int64_t rows_of_role[3] = {query_rows, key_rows, key_rows};
  const int64_t features_of_role[3] = {E, kdim_, vdim_};
  const int64_t outputs_of_role[3] = {E, F, F};  // projected features (F = E unless GQA)
  const int64_t bias_offset[3] = {0, E, E + F};
  const char* weight_names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
  const TensorView weights_of_role[3] = {q_proj_weight(), k_proj_weight(), v_proj_weight()};
  RoleGradient roles[3];
  for (int role = 0; role < 3; ++role) {
    const TensorView& input = *inputs[role];
    const int64_t rows = rows_of_role[role], in_features = features_of_role[role];
    const int64_t out_features = outputs_of_role[role];
    const RowMatrix grad_projection{grad_projections[role]->data_as<float>(), out_features};
    const Tensor grad_transposed = transposed(grad_projection, rows, out_features);
    // Xᵀ once per distinct input (self-attention transposes the query once, not three times).
    // The first role with this view holds it; later ones read it there.
    RoleGradient& current = roles[role];
    current.input = &input;
    int transpose_owner = role;
    for (int earlier = 0; earlier < role; ++earlier) {
      if (detail::same_view(*roles[earlier].input, input)) {
        transpose_owner = earlier;
        break;
      }
    }
    if (transpose_owner == role) {
      Tensor input_storage;
      current.input_transposed =
          transposed(detail::as_row_matrix(input, input_storage), rows, in_features);
    }
    const Tensor& input_transposed = roles[transpose_owner].input_transposed;

    float* grad_weight;
    if (packed_) {
      grad_weight = grad_in_proj_weight.data_as<float>() + role * E * E;  // rows [rE, rE + E)
    } else {
      Tensor& slot = gradients.parameters[weight_names[role]];
      slot = Tensor(DType::kFloat32, Shape({out_features, in_features}));
      grad_weight = slot.data_as<float>();
    }
    weight_gradient(grad_transposed, input_transposed, grad_weight, num_threads);
    if (bias_) {
      bias_gradient(grad_transposed, grad_in_proj_bias.data_as<float>() + bias_offset[role]);
    }

    current.gradient = Tensor::zeros(DType::kFloat32, input.shape);
    input_gradient(grad_projection, rows, weights_of_role[role].data_as<float>(), out_features,
                   in_features, current.gradient.data_as<float>(), num_threads);
  }
  if (packed_) gradients.parameters["in_proj_weight"] = std::move(grad_in_proj_weight);
  if (bias_) gradients.parameters["in_proj_bias"] = std::move(grad_in_proj_bias);

  // One gradient per distinct input: a role whose input is the same view as an earlier role's
  // adds into that role's gradient (in role order, so the sums are deterministic).
  for (int role = 1; role < 3; ++role) {
    for (int earlier = 0; earlier < role; ++earlier) {
      if (roles[earlier].gradient.empty() ||
          !detail::same_view(*roles[earlier].input, *roles[role].input)) {
        continue;
      }
      float* total = roles[earlier].gradient.data_as<float>();
      const float* part = roles[role].gradient.data_as<float>();
      for (int64_t i = 0; i < roles[role].gradient.numel(); ++i) total[i] += part[i];
      roles[role].gradient = Tensor();
      break;
    }
  }
  gradients.query = std::move(roles[0].gradient);
  gradients.key = std::move(roles[1].gradient);
  gradients.value = std::move(roles[2].gradient);
  return gradients;
}

}  // namespace attend
