// gemm.hpp: the projection GEMM of a Linear layer (Highway, one source for every SIMD target,
// dispatched at run time).
//
//   output(M, N) = input(M, K) · weight(N, K)ᵀ + bias(N)
//
// Row-major operands; `weight` is PyTorch's (out_features, in_features) matrix. The input may
// be bfloat16 (LinearParams::input_bf16). Each output
// element is accumulated by one fixed sequence (bias, then k = 0, 1, ..., K-1 with fused
// multiply-adds), so the result does not depend on the thread count; it may differ in the last
// bits between SIMD targets.
#pragma once

#include <cstdint>

namespace attend::detail {

struct LinearParams {
  int64_t rows = 0;              // M
  int64_t columns = 0;           // N (out_features)
  int64_t depth = 0;             // K (in_features)
  const float* input = nullptr;  // (M, K), row stride input_row_stride, column stride 1
  int64_t input_row_stride = 0;
  const float* weight = nullptr;  // (N, K), row stride weight_row_stride, column stride 1
  int64_t weight_row_stride = 0;
  const float* bias = nullptr;  // (N) or null
  float* output = nullptr;      // (M, N), row stride output_row_stride, column stride 1
  int64_t output_row_stride = 0;
  int num_threads = 1;  // ≥ 1
  // A bfloat16 (M, K) input (row stride input_row_stride) instead of `input`: with
  // bf16_products (the caller's precision policy, boundary/operands.hpp: ProductSite::
  // kProjections) and native_bf16_products(), bfloat16 products (vdpbf16ps), the weight
  // rounded to bfloat16 as it is packed, float32 accumulation and output. Up to 8 rows, or
  // otherwise, float32 products (the input widened exactly, the weight as given).
  const uint16_t* input_bf16 = nullptr;
  bool bf16_products = false;
  // With bf16_products, on AMX tiles (AMX-BF16, where amx_bf16_products() holds; else
  // AVX512_BF16): the same rounding of both operands, float32 accumulation from the bias.
  bool amx_tiles = false;
  // A bfloat16 (M, N) output (row stride output_row_stride) instead of `output`: each float32
  // result rounded to bfloat16 as convert rounds (bf16_from_f32: to nearest even, NaNs kept
  // quiet), the same bits as a float32 output converted afterwards. Written directly by the
  // AVX512_BF16 products; the other paths round a float32 result.
  uint16_t* output_bf16 = nullptr;
};

// Computes the product described by `params`. Throws attend::Error when the packing buffer
// cannot be allocated; the output must not overlap the input, weight or bias.
void linear(const LinearParams& params);

}  // namespace attend::detail
