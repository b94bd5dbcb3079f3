// sdpa.cpp: the entry points of scaled dot-product attention. Each validates once
// (boundary/validation.hpp), fills SdpaParams with the operands the kernel reads
// (boundary/operands.hpp) and output views (boundary/views.hpp), and runs the first kernel
// that accepts the problem (kernels/kernel_list.hpp; the reference last).
#include "attend/sdpa.hpp"

#include <optional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "cpu_features.hpp"
#include "grouped_query.hpp"
#include "kernels/fused_sdpa.hpp"
#include "kernels/kernel_list.hpp"
#include "kv_format.hpp"
#include "sdpa_boundary.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

namespace {

// K and V of `p` read in place from `stored` (its views stood in for key and value: the
// strides are the blocks' already).
void attach_stored_keys(SdpaParams& p, const StoredKeys& stored) {
  const TensorView& kb = stored.key_blocks;
  p.kv_format = kb.dtype;
  if (kb.dtype == DType::kFloat32) {
    p.key = stored.key_blocks.data_as<const float>();
    p.value = stored.value_blocks.data_as<const float>();
  } else {
    p.key = p.value = nullptr;
    p.key_stored = stored.key_blocks.data;
    p.value_stored = stored.value_blocks.data;
  }
  p.key_len = stored.length;
  p.block_table = stored.table;
  p.block_size = kb.shape[1];
  p.block_rows = stored.block_rows();
  // Scales (num_blocks, block_size, Hkv): one per (slot, head).
  const auto scale_strides = [&](const TensorView& scales) {
    OperandStrides s;
    s.batch[kMaxBatchRank - 1] = scales.strides[2];
    s.row = scales.strides[1];
    return s;
  };
  if (stored.key_scales) {
    p.key_scales = stored.key_scales->data_as<const float>();
    p.key_scale_strides = scale_strides(*stored.key_scales);
    p.value_scales = stored.value_scales->data_as<const float>();
    p.value_scale_strides = scale_strides(*stored.value_scales);
  }
}

// One call from its validated problem to the caller's outputs: the kernel's parameters
// (K/V heads split for grouped queries) and the copies they point into. Not movable once
// prepared (params points into inputs and the output copies).
struct PreparedCall {
  KernelInputs inputs;
  SdpaParams params;
  std::optional<Tensor> output_copy, weights_copy;
  AttentionOutputViews outputs;
  bool has_work = false;  // some row to compute
};

void prepare(const TensorView& query, const TensorView& key, const TensorView& value,
             const Problem& problem, const AttentionOutputViews& outputs,
             const AttentionOptions& options, const StoredKeys* stored, PreparedCall& call) {
  SdpaParams p = make_params(query, key, value, problem, options, call.inputs, false,
                             stored == nullptr);
  if (stored) attach_stored_keys(p, *stored);
  call.outputs = outputs;
  const TensorView out = writable_kernel_float(outputs.output, call.output_copy);
  p.output = out.data_as<float>();
  p.output_strides = plain_strides(out);
  if (outputs.weights) {
    const TensorView w = writable_kernel_float(*outputs.weights, call.weights_copy);
    p.weights = w.data_as<float>();
    p.weights_strides = plain_strides(w);
  }
  if (outputs.logsumexp) {
    p.logsumexp = outputs.logsumexp->data_as<float>();
    p.logsumexp_strides = row_vector_strides(*outputs.logsumexp);
  }
  call.has_work = p.batch * p.query_len > 0;
  call.params = problem.kv_group > 1 ? split_kv_heads(p, problem.kv_group) : p;
}

// The kernel's float32 results into the caller's outputs of other dtypes.
void finish(const PreparedCall& call) {
  if (call.output_copy) convert(call.output_copy->view(), call.outputs.output);
  if (call.weights_copy) convert(call.weights_copy->view(), *call.outputs.weights);
}

void run(const TensorView& query, const TensorView& key, const TensorView& value,
         const Problem& problem, const AttentionOutputViews& outputs,
         const AttentionOptions& options, const StoredKeys* stored = nullptr) {
  PreparedCall call;
  prepare(query, key, value, problem, outputs, options, stored, call);
  if (call.has_work) run_kernel(call.params, options.backend);
  finish(call);
}

}  // namespace

TensorView StoredKeys::stand_in(bool value, DType dtype) const {
  const TensorView& b = value ? value_blocks : key_blocks;
  return TensorView(b.data, dtype, Shape({b.shape[2], length, b.shape[3]}),
                    Shape({b.strides[2], b.strides[1], b.strides[3]}));
}

bool StoredKeys::readable_in_place() const {
  const int64_t rows = block_rows();
  const auto fits = [&](const TensorView& t) {
    const Shape& st = t.strides;
    return t.rank() == 4 && st[3] == 1 && st[1] > 0 && st[0] == rows * st[1] && t.shape[1] <= rows;
  };
  const auto scales_fit = [&](const TensorView* s) {
    return s == nullptr ||
           (s->rank() == 3 && s->dtype == DType::kFloat32 && s->strides[0] == rows * s->strides[1]);
  };
  // float16 only where the SIMD target widens it exactly (F16C), as the dense call does.
  return rows > 0 && is_kv_format(key_blocks.dtype) && key_blocks.dtype == value_blocks.dtype &&
         key_blocks.strides[0] % key_blocks.strides[1] == 0 && fits(key_blocks) &&
         fits(value_blocks) && scales_fit(key_scales) && scales_fit(value_scales) &&
         (key_scales == nullptr) == (value_scales == nullptr) &&
         (key_blocks.dtype != DType::kFloat16 || exact_f16_widening());
}

void run_over_stored_keys_batch(const std::vector<StoredKeysCall>& calls,
                                const AttentionOptions& options) {
  // Each checked as the dense problem of its query's dtype; run on float32 stand-ins (never
  // read: attach_stored_keys points the kernel at the blocks) with float32 products.
  AttentionOptions o = options;
  o.compute = ComputePrecision::kFloat32;
  std::vector<PreparedCall> prepared(calls.size());
  std::vector<SdpaParams> rows;  // the calls the row groups run, as one work list
  for (size_t n = 0; n < calls.size(); ++n) {
    const StoredKeysCall& c = calls[n];
    const Problem problem = validate_inputs(c.query, c.stored.stand_in(false, c.query.dtype),
                                            c.stored.stand_in(true, c.query.dtype), options);
    prepare(c.query, c.stored.stand_in(false, DType::kFloat32),
            c.stored.stand_in(true, DType::kFloat32), problem, c.outputs, o, &c.stored,
            prepared[n]);
    SdpaParams& p = prepared[n].params;
    if (stored_kv_bf16_products(c.stored.key_blocks.dtype, options, problem.kv_group, p.query_len,
                                p.key_len, p.head_dim, p.value_dim)) {
      p.bf16_kv_products = true;  // the grouped-query tiles on vdpbf16ps
      p.half_dtype = DType::kBFloat16;
    }
  }
  for (PreparedCall& call : prepared) {
    if (!call.has_work) continue;
    // The grouped-query tiles (bfloat16 products) run a call at a time, over all threads.
    if (chosen_kernel_run(call.params, o.backend) == fused_sdpa_rows &&
        !call.params.half_products()) {
      rows.push_back(call.params);
    } else {
      run_kernel(call.params, o.backend);
    }
  }
  if (rows.size() == 1) {
    fused_sdpa_rows(rows[0]);
  } else if (!rows.empty()) {
    fused_sdpa_rows_batch(rows.data(), static_cast<int64_t>(rows.size()));
  }
  for (const PreparedCall& call : prepared) finish(call);
}

}  // namespace attend::detail

namespace attend {

using detail::Problem;

AttentionResult scaled_dot_product_attention(const TensorView& query, const TensorView& key,
                                             const TensorView& value,
                                             const AttentionOptions& options) {
  const Problem problem = detail::validate_inputs(query, key, value, options);
  AttentionResult result;
  AttentionOutputViews outputs;
  if (options.need_weights) {
    const auto count = static_cast<uint64_t>(problem.scores_shape.numel());
    if (count > options.max_weights_bytes / sizeof(float)) {  // count · 4 may not fit 64 bits
      const std::string bytes =
          count <= UINT64_MAX / sizeof(float) ? std::to_string(count * sizeof(float)) : "over 2^64";
      throw Error("weights " + problem.scores_shape.str() + " would take " + bytes +
                  " bytes, over the limit of " + std::to_string(options.max_weights_bytes) +
                  " (max_weights_bytes)");
    }
    result.weights = Tensor(DType::kFloat32, problem.scores_shape);
    outputs.weights = result.weights.view();
  }
  if (options.need_logsumexp) {
    const Shape& s = problem.scores_shape;
    result.logsumexp = Tensor(DType::kFloat32, Shape::from(s.data(), s.rank() - 1));
    outputs.logsumexp = result.logsumexp.view();
  }
  result.output = Tensor(query.dtype, problem.output_shape);
  outputs.output = result.output.view();
  detail::run(query, key, value, problem, outputs, options);
  return result;
}

void scaled_dot_product_attention_into(const TensorView& query, const TensorView& key,
                                       const TensorView& value, const AttentionOutputViews& outputs,
                                       const AttentionOptions& options) {
  const Problem problem = detail::validate_inputs(query, key, value, options);
  detail::check_output("output", outputs.output, problem.output_shape, query.dtype, query, key,
                       value, options);
  if (outputs.weights) {
    detail::check_output("weights", *outputs.weights, problem.scores_shape, DType::kFloat32, query,
                         key, value, options);
    if (detail::overlaps(*outputs.weights, outputs.output)) {
      throw Error("weights overlaps the memory of output");
    }
  }
  if (outputs.logsumexp) {
    detail::check_logsumexp("logsumexp", *outputs.logsumexp, problem.scores_shape);
    detail::check_output("logsumexp", *outputs.logsumexp, outputs.logsumexp->shape, DType::kFloat32,
                         query, key, value, options);
    if (detail::overlaps(*outputs.logsumexp, outputs.output) ||
        (outputs.weights && detail::overlaps(*outputs.logsumexp, *outputs.weights))) {
      throw Error("logsumexp overlaps the memory of another output");
    }
  }
  detail::run(query, key, value, problem, outputs, options);
}

void scaled_dot_product_attention_into(const TensorView& query, const TensorView& key,
                                       const TensorView& value, const TensorView& output,
                                       const TensorView* weights, const AttentionOptions& options) {
  AttentionOutputViews outputs;
  outputs.output = output;
  if (weights) outputs.weights = *weights;
  scaled_dot_product_attention_into(query, key, value, outputs, options);
}

std::string attention_kernel(const TensorView& query, const TensorView& key,
                             const TensorView& value, const AttentionOptions& options) {
  const Problem problem = detail::validate_inputs(query, key, value, options);
  detail::KernelInputs inputs;
  detail::SdpaParams p = detail::make_params(query, key, value, problem, options, inputs);
  // The plan only asks whether weights are written (they rule out the key split).
  float unused = 0;
  if (options.need_weights) p.weights = &unused;
  if (problem.kv_group > 1) p = detail::split_kv_heads(p, problem.kv_group);
  return detail::chosen_kernel(p, options.backend);
}

double attention_flops(int64_t batch, int64_t query_len, int64_t key_len, int64_t head_dim,
                       int64_t value_dim, bool causal) {
  const double pairs =
      static_cast<double>(batch) * static_cast<double>(query_len) * static_cast<double>(key_len);
  const double flops = 2.0 * pairs * static_cast<double>(head_dim + value_dim);
  return causal ? flops / 2 : flops;
}

}  // namespace attend
