// sdpa_backward.cpp: the backward API boundary. Validate once (the forward's checks plus
// dO, O, logsumexp and the gradient views), normalize into SdpaBackwardParams, run the first
// backward kernel that accepts the problem, reduce dS to the bias gradient.
#include "attend/sdpa_backward.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "boundary/operands.hpp"
#include "boundary/validation.hpp"
#include "boundary/views.hpp"
#include "grouped_query.hpp"
#include "kernels/kernel_list.hpp"
#include "sdpa_params.hpp"

namespace attend {
namespace {

using detail::OperandStrides;
using detail::Problem;
using detail::SdpaBackwardParams;

// dO and O: (..., Lq, Ev), a floating dtype the forward accepts.
void check_forward_tensor(const char* name, const TensorView& t, const Problem& problem) {
  detail::check_view(name, t);
  if (t.shape != problem.output_shape) {
    throw Error(detail::describe(name, t) + " does not match the attention output " +
                problem.output_shape.str() + " (..., Lq, Ev)");
  }
  if (!detail::is_attention_float(t.dtype)) {
    throw Error(std::string(name) + ": dtype " + dtype_name(t.dtype) +
                " is not supported (float32, float16 or bfloat16)");
  }
}

// dBias = dS (scores_shape) summed over the dimensions along which bias broadcasts, in
// row-major order of dS (a fixed order: deterministic), accumulated in float64.
void reduce_to_bias(const Tensor& grad_scores, const detail::SdpaParams& p,
                    const TensorView& grad_bias) {
  Tensor sums = Tensor::zeros(DType::kFloat64, grad_bias.shape);
  const OperandStrides to = detail::broadcast_strides("bias", sums.view(), grad_scores.shape());
  auto* out = sums.data_as<double>();
  const float* ds = grad_scores.data_as<float>();
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t base = p.batch_offset(to, b);
    for (int64_t i = 0; i < p.query_len; ++i) {
      double* row = out + base + i * to.row;
      for (int64_t j = 0; j < p.key_len; ++j) row[j * to.column] += *ds++;
    }
  }
  Tensor as_float(DType::kFloat32, grad_bias.shape);
  for (int64_t n = 0; n < as_float.numel(); ++n) {
    as_float.data_as<float>()[n] = static_cast<float>(out[n]);
  }
  convert(as_float.view(), grad_bias);
}

// dSink_h = −Σ_{b of head h} Σ_i exp(sink_h − lse_bi)·D_bi with D = dO·O (the sink's own
// dP is 0: it has no value), in float64 and a fixed order.
void reduce_to_sinks(const SdpaBackwardParams& bp, const TensorView& grad_sinks) {
  const detail::SdpaParams& p = bp.forward;
  Tensor sums = Tensor::zeros(DType::kFloat64, grad_sinks.shape);
  auto* out = sums.data_as<double>();
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t h = b % p.heads;
    const float* o = p.output + p.batch_offset(p.output_strides, b);
    const float* g = bp.grad_output + p.batch_offset(bp.grad_output_strides, b);
    const float* lse = bp.logsumexp + p.batch_offset(bp.logsumexp_strides, b);
    for (int64_t i = 0; i < p.query_len; ++i) {
      double delta = 0;
      for (int64_t c = 0; c < p.value_dim; ++c) {
        delta +=
            double{o[i * p.output_strides.row + c]} * double{g[i * bp.grad_output_strides.row + c]};
      }
      const double p_sink =
          std::exp(double{p.sinks[h]} - double{lse[i * bp.logsumexp_strides.row]});
      out[h] -= p_sink * delta;
    }
  }
  convert(sums.view(), grad_sinks);
}

void run_backward(const TensorView& grad_output, const TensorView& query, const TensorView& key,
                  const TensorView& value, const TensorView& output, const TensorView& logsumexp,
                  const AttentionGradientViews& gradients, const Problem& problem,
                  const AttentionOptions& options) {
  detail::KernelInputs inputs;
  SdpaBackwardParams bp;
  bp.forward = detail::make_params(query, key, value, problem, options, inputs, true);
  detail::SdpaParams& p = bp.forward;
  // bfloat16 products as the precision policy says for the backward (the fused kernel rounds
  // the float32 operands as it packs them): on AMX tiles or AVX512_BF16.
  const detail::Bf16Products products =
      options.backend == Backend::kReference
          ? detail::Bf16Products::kFloat32
          : detail::bf16_products(query.dtype, options.compute,
                                  detail::ProductSite::kAttentionBackward);
  p.bf16_backward = products != detail::Bf16Products::kFloat32;
  p.amx_tiles = products == detail::Bf16Products::kAmxTiles;

  std::optional<Tensor> output_copy, grad_output_copy;
  const TensorView o = detail::as_kernel_float(output, output_copy);
  p.output = o.data_as<float>();
  p.output_strides = detail::plain_strides(o);
  const TensorView dout = detail::as_kernel_float(grad_output, grad_output_copy);
  bp.grad_output = dout.data_as<const float>();
  bp.grad_output_strides = detail::plain_strides(dout);
  bp.logsumexp = logsumexp.data_as<const float>();
  bp.logsumexp_strides = detail::row_vector_strides(logsumexp);

  std::optional<Tensor> dq_copy, dk_copy, dv_copy;
  const TensorView dq = detail::writable_kernel_float(gradients.query, dq_copy);
  const TensorView dk = detail::writable_kernel_float(gradients.key, dk_copy);
  const TensorView dv = detail::writable_kernel_float(gradients.value, dv_copy);
  bp.grad_query = dq.data_as<float>();
  bp.grad_query_strides = detail::plain_strides(dq);
  // Grouped-query attention: dK and dV per query head into dense scratch, then summed over
  // each group in a fixed order (detail::sum_kv_groups).
  Tensor dense_dk, dense_dv;
  const int64_t group = problem.kv_group;
  if (group > 1) {
    Shape dense_k = key.shape, dense_v = value.shape;
    dense_k[key.rank() - 3] *= group;
    dense_v[value.rank() - 3] *= group;
    dense_dk = Tensor(DType::kFloat32, dense_k);
    dense_dv = Tensor(DType::kFloat32, dense_v);
  }
  const TensorView dk_kernel = group > 1 ? dense_dk.view() : dk;
  const TensorView dv_kernel = group > 1 ? dense_dv.view() : dv;
  bp.grad_key = dk_kernel.data_as<float>();
  bp.grad_key_strides = detail::plain_strides(dk_kernel);
  bp.grad_value = dv_kernel.data_as<float>();
  bp.grad_value_strides = detail::plain_strides(dv_kernel);
  Tensor grad_scores;
  const bool bias_gradient = gradients.bias.has_value() && options.bias.has_value();
  if (bias_gradient) {
    grad_scores = Tensor::zeros(DType::kFloat32, problem.scores_shape);
    bp.grad_scores = grad_scores.data_as<float>();
    bp.grad_scores_strides = detail::plain_strides(grad_scores.view());
  }

  if (p.batch * p.query_len > 0 && group > 1) {
    detail::run_backward_kernel(detail::split_kv_heads(bp, group), options.backend);
    detail::sum_kv_groups(dense_dk, dk, group);
    detail::sum_kv_groups(dense_dv, dv, group);
  } else if (p.batch * p.query_len > 0) {
    detail::run_backward_kernel(bp, options.backend);
  } else {  // no queries: nothing flows to K and V
    convert(Tensor::zeros(DType::kFloat32, dk.shape).view(), dk);
    convert(Tensor::zeros(DType::kFloat32, dv.shape).view(), dv);
  }
  if (dq_copy) convert(dq_copy->view(), gradients.query);
  if (dk_copy) convert(dk_copy->view(), gradients.key);
  if (dv_copy) convert(dv_copy->view(), gradients.value);
  if (bias_gradient) reduce_to_bias(grad_scores, p, *gradients.bias);
  if (gradients.sinks && p.sinks) reduce_to_sinks(bp, *gradients.sinks);
}

Problem validate_backward(const TensorView& grad_output, const TensorView& query,
                          const TensorView& key, const TensorView& value, const TensorView& output,
                          const TensorView& logsumexp, const AttentionOptions& options) {
  const Problem problem = detail::validate_inputs(query, key, value, options);
  check_forward_tensor("grad_output", grad_output, problem);
  check_forward_tensor("output", output, problem);
  detail::check_logsumexp("logsumexp", logsumexp, problem.scores_shape);
  return problem;
}

}  // namespace

AttentionGradients scaled_dot_product_attention_backward(
    const TensorView& grad_output, const TensorView& query, const TensorView& key,
    const TensorView& value, const TensorView& output, const TensorView& logsumexp,
    const AttentionOptions& options) {
  const Problem problem =
      validate_backward(grad_output, query, key, value, output, logsumexp, options);
  AttentionGradients result;
  result.query = Tensor(query.dtype, query.shape);
  result.key = Tensor(key.dtype, key.shape);
  result.value = Tensor(value.dtype, value.shape);
  AttentionGradientViews views{result.query.view(), result.key.view(), result.value.view(), {}, {}};
  if (options.bias) {
    result.bias = Tensor(options.bias->dtype, options.bias->shape);
    views.bias = result.bias.view();
  }
  if (options.sinks) {
    result.sinks = Tensor(options.sinks->dtype, options.sinks->shape);
    views.sinks = result.sinks.view();
  }
  run_backward(grad_output, query, key, value, output, logsumexp, views, problem, options);
  return result;
}

void scaled_dot_product_attention_backward_into(const TensorView& grad_output,
                                                const TensorView& query, const TensorView& key,
                                                const TensorView& value, const TensorView& output,
                                                const TensorView& logsumexp,
                                                const AttentionGradientViews& gradients,
                                                const AttentionOptions& options) {
  const Problem problem =
      validate_backward(grad_output, query, key, value, output, logsumexp, options);
  std::vector<std::pair<const char*, const TensorView*>> written = {
      {"grad_query", &gradients.query},
      {"grad_key", &gradients.key},
      {"grad_value", &gradients.value}};
  detail::check_output("grad_query", gradients.query, query.shape, query.dtype, query, key, value,
                       options);
  detail::check_output("grad_key", gradients.key, key.shape, key.dtype, query, key, value, options);
  detail::check_output("grad_value", gradients.value, value.shape, value.dtype, query, key, value,
                       options);
  if (gradients.bias) {
    if (!options.bias) throw Error("grad_bias was given but the options have no bias");
    detail::check_output("grad_bias", *gradients.bias, options.bias->shape, options.bias->dtype,
                         query, key, value, options);
    written.push_back({"grad_bias", &*gradients.bias});
  }
  if (gradients.sinks) {
    if (!options.sinks) throw Error("grad_sinks was given but the options have no sinks");
    detail::check_output("grad_sinks", *gradients.sinks, options.sinks->shape, options.sinks->dtype,
                         query, key, value, options);
    written.push_back({"grad_sinks", &*gradients.sinks});
  }
  const std::pair<const char*, const TensorView*> read[] = {
      {"grad_output", &grad_output}, {"output", &output}, {"logsumexp", &logsumexp}};
  for (size_t a = 0; a < written.size(); ++a) {
    for (size_t b = a + 1; b < written.size(); ++b) {
      if (detail::overlaps(*written[a].second, *written[b].second)) {
        throw Error(std::string(written[a].first) + " overlaps the memory of " + written[b].first);
      }
    }
    for (const auto& [name, view] : read) {
      if (detail::overlaps(*written[a].second, *view)) {
        throw Error(std::string(written[a].first) + " overlaps the memory of " + name);
      }
    }
  }
  run_backward(grad_output, query, key, value, output, logsumexp, gradients, problem, options);
}

double attention_backward_flops(int64_t batch, int64_t query_len, int64_t key_len, int64_t head_dim,
                                int64_t value_dim, bool causal) {
  return 2.5 * attention_flops(batch, query_len, key_len, head_dim, value_dim, causal);
}

}  // namespace attend
