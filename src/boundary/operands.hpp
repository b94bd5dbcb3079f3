// boundary/operands.hpp: what the kernels read, chosen once per call: the precision of the
// products (wants_bf16_products), the operands converted to it (float32, or bfloat16 and
// float16 where a kernel reads them as they are), and the SdpaParams filled from validated
// arguments (make_params).
#pragma once

#include <optional>
#include <vector>

#include "attend/attention_options.hpp"
#include "attend/tensor.hpp"
#include "boundary/validation.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

// Converted copies of the score rules' inputs (float32 slopes and sinks, int32 segment ids).
struct ScoreRuleInputs {
  std::optional<Tensor> alibi_slopes, sinks, segment_query, segment_key;
  std::vector<float> default_slopes;
};
// Converted copies of inputs that were not float32 with a contiguous last dimension.
struct KernelInputs {
  std::optional<Tensor> query, key, value, mask, bias;
  ScoreRuleInputs rules;
};

// The precision policy: whether inputs of `input_dtype` computed at `compute`
// (AttentionOptions::compute) take bfloat16 products: kBFloat16 always, kAuto for bfloat16
// inputs where the CPU has them (cpu_features.hpp). attend::Error for kBFloat16 or kFloat16
// without their instructions, naming why. Used by make_params and by the layers that choose
// their projections' operands (multihead, spatial).
bool wants_bf16_products(DType input_dtype, ComputePrecision compute);
// Whether `compute` asks for float16 products (kFloat16 only: never chosen by kAuto, since
// they accumulate in float16 for a while: kernels/isa/avx512_fp16-inl.h); attend::Error where
// the CPU (or the SIMD cap) has no AVX512_FP16.
bool wants_f16_products(ComputePrecision compute);

// SdpaParams with sizes, inputs, mask, bias and options filled (outputs null); the inputs in
// the precision of the products (AttentionOptions::compute): float32, or bfloat16 or float16
// for the forward's query tiles (never `for_backward`; float16 only where its chains stay
// finite, else float32 products on the float16 operands). attend::Error for a precision the
// CPU lacks.
SdpaParams make_params(const TensorView& query, const TensorView& key, const TensorView& value,
                       const Problem& problem, const AttentionOptions& options,
                       KernelInputs& storage, bool for_backward = false);

}  // namespace attend::detail
