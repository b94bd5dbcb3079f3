// attend/linear.hpp: the projection of a Linear layer, the GEMM that MultiheadAttention's
// projections run (src/kernels/gemm.cc: Highway, dispatched per SIMD target at run time).
//
//   output (M, N) = input (M, K) · weight (N, K)ᵀ + bias (N)
//
// weight is PyTorch's nn.Linear weight (out_features, in_features). Every operand is float32
// with unit column stride; rows may be strided (a view of a wider buffer). Each output element
// is accumulated in one fixed order (bias, then k = 0, 1, ..., K-1 with fused multiply-adds),
// so the result is bitwise the same at any thread count; it may differ in the last bits
// between SIMD targets. Error model: |output - exact| <= (K + 2)·u·(|bias| + Σ_k |x_k·w_k|),
// u = 2^-24.
#pragma once

#include "attend/tensor.hpp"

namespace attend {

// input (M, K), weight (N, K), bias (N) or null, output (M, N): float32, last stride 1.
// The output must not overlap an input. num_threads 0: default_num_threads(); work below
// 2^22 multiply-adds per thread runs on fewer threads (one for a small product).
// Throws attend::Error on a bad dtype, rank, shape, stride or overlap, before writing.
void linear_into(const TensorView& input, const TensorView& weight, const TensorView* bias,
                 const TensorView& output, int num_threads = 0);

}  // namespace attend
