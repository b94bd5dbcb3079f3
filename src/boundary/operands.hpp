// boundary/operands.hpp: what the kernels read, chosen once per call: the precision of the
// products (wants_bf16_products), the operands converted to it (float32, or bfloat16 and
// float16 where a kernel reads them as they are), and the SdpaParams filled from validated
// arguments (make_params).
#pragma once

#include <cstdint>
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

// The precision policy: which products bfloat16 work gets on this CPU, decided here for every
// site that multiplies (the kernels only run what they are given).
//   kAmxTiles    AMX-BF16 tiles (kernels/isa/amx_bf16.hpp): the attention forward's query
//                tiles (where FitsAmxTiles, shape_policy.hpp), the attention backward and
//                the projections' GEMM;
//   kAvx512Bf16  vdpbf16ps register blocks (kernels/isa/avx512_bf16-inl.h): every site;
//   kFloat32     float32 products (bfloat16 values widened exactly; for kBFloat16 only where
//                a kernel has no bfloat16 products, e.g. decoding's row groups).
// Both bfloat16 paths share one error model (FlashAttention's rule, tests/bf16_test.cc).
enum class Bf16Products : uint8_t { kFloat32, kAvx512Bf16, kAmxTiles };
enum class ProductSite : uint8_t { kAttention, kAttentionBackward, kProjections };

// What the policy reads of the CPU (cpu_features.hpp), as data so that the rule is tested for
// every CPU kind on any host (tests/precision_policy_test.cc).
struct Bf16Cpu {
  const char* why_no_bf16 = "";  // why_no_bf16_products(): "" where vdpbf16ps can run
  bool amx = false;              // amx_bf16_products(): AMX-BF16 tiles usable now
  // vdpbf16ps wins over float32 FMAs: its FLOP rate is twice the FMA's on AMD Zen 4 and Zen 5
  // (one instruction per FMA slot, 32 multiply-adds against 16), half of it on Intel (Cooper
  // Lake, Sapphire Rapids and later: one port; this Xeon's probes 170 against 337 GFLOP/s),
  // where bfloat16 attention on it ran at 0.58x float32 (issue 22).
  bool dot_product_wins = false;
};
Bf16Cpu this_cpu_bf16();  // the values for this CPU, the SIMD cap and the AMX switch now

// The rule. kFloat32: kFloat32. kFloat16: kFloat32 (attend::Error where the CPU has no
// float16 products). kBFloat16: AMX tiles where the site has them, else AVX512_BF16;
// attend::Error without AVX512_BF16 (or capped below AVX-512), naming why. kAuto, bfloat16
// inputs: AMX tiles where the CPU has them; else AVX512_BF16 where it wins (AMD); else
// float32 products (Intel without AMX, shapes past FitsAmxTiles): faster there and exact in
// the products. kAuto, other inputs: kFloat32. `amx_fits`: the shape fits the forward's AMX
// operands (FitsAmxTiles; the backward and the projections pack per tile, so always fit).
Bf16Products choose_bf16_products(const Bf16Cpu& cpu, DType input_dtype, ComputePrecision compute,
                                  ProductSite site, bool amx_fits = true);
inline Bf16Products bf16_products(DType input_dtype, ComputePrecision compute, ProductSite site,
                                  bool amx_fits = true) {
  return choose_bf16_products(this_cpu_bf16(), input_dtype, compute, site, amx_fits);
}
// Whether the site computes bfloat16 products (on either path). Used by make_params and by the
// layers that choose their operands (multihead, spatial: the attention's choice).
inline bool wants_bf16_products(DType input_dtype, ComputePrecision compute,
                                ProductSite site = ProductSite::kAttention) {
  return bf16_products(input_dtype, compute, site) != Bf16Products::kFloat32;
}
// Whether `compute` asks for float16 products (kFloat16 only: never chosen by kAuto, since
// they accumulate in float16 for a while: kernels/isa/avx512_fp16-inl.h); attend::Error where
// the CPU (or the SIMD cap) has no AVX512_FP16.
bool wants_f16_products(ComputePrecision compute);

// Attention over K and V as stored in `format` (kv_format.hpp: a paged cache's blocks, read in
// place; sdpa_boundary.hpp's StoredKeys) with float32 queries: whether it computes on
// bfloat16 products in the grouped-query tiles (SdpaParams::bf16_kv_products; shape_policy.hpp,
// 5.), where the shape takes them (GroupsQueryRows of kv_group query heads per K/V head and
// query_len queries, FitsPackedBf16, only the rules of a row's position and head) on
// AVX512_BF16, and the precision says so:
//   kAuto       int8, float8_e4m3, float8_e5m2: yes (the codes are exact in bfloat16 and the
//               scales applied in float32, so only Q and P are rounded, 2^-9 each, well under
//               the quantization's 2^-8 to 2^-3); bfloat16: as the policy gives bfloat16
//               inputs vdpbf16ps (choose_bf16_products: AMD); float16, float32: no (float32
//               products, bitwise the widened inputs' results, as for float16 inputs
//               elsewhere);
//   kBFloat16   every format (float16 and float32 K/V rounded to bfloat16 as they are packed);
//   kFloat32, kFloat16: no.
// Otherwise the row groups run the call with float32 products on the widened K and V.
bool stored_kv_bf16_products(DType format, const AttentionOptions& options, int64_t kv_group,
                             int64_t query_len, int64_t key_len, int64_t head_dim,
                             int64_t value_dim);

// SdpaParams with sizes, inputs, mask, bias and options filled (outputs null); the inputs in
// the precision of the products (AttentionOptions::compute): float32, or bfloat16 or float16
// for the forward's query tiles (never `for_backward`; float16 only where its chains stay
// finite, else float32 products on the float16 operands). attend::Error for a precision the
// CPU lacks. `half_queries`: the caller runs the kernel on these operands as they are (no
// stored K/V attached afterwards), so half-precision queries computed in float32 may stay
// half for the query tiles (SdpaParams::query_widened) instead of a float32 copy.
SdpaParams make_params(const TensorView& query, const TensorView& key, const TensorView& value,
                       const Problem& problem, const AttentionOptions& options,
                       KernelInputs& storage, bool for_backward = false,
                       bool half_queries = false);

}  // namespace attend::detail
