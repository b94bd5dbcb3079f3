// sdpa_params.hpp: the one plain struct every attention kernel reads, filled and validated
// once by src/sdpa.cpp (after the model of flash-attention's flash.h).
//
// All tensors are float32 (mask: one byte per entry, nonzero keeps; query, key and value
// bfloat16 for bfloat16 products) with the last
// dimension of query, key, value, output and weights contiguous (stride 1). Every other
// stride is in elements and may be anything, including 0 for broadcast mask and bias.
// The batch is up to kMaxBatchRank leading dimensions; batch index b in [0, batch) is
// decomposed row-major over batch_shape (padded in front with 1s).
#pragma once

#include <cstdint>

#include "attend/score_mod.hpp"
#include "attend/tensor.hpp"

namespace attend::detail {

inline constexpr int kMaxBatchRank = 4;

// Strides of one (batch..., rows, columns) operand. columns stride is 1 except for mask and
// bias, which may broadcast along any dimension.
struct OperandStrides {
  int64_t batch[kMaxBatchRank] = {0, 0, 0, 0};
  int64_t row = 0;
  int64_t column = 1;
};

struct SdpaParams {
  // Sizes.
  int64_t batch_shape[kMaxBatchRank] = {1, 1, 1, 1};
  int64_t batch = 1;      // product of batch_shape
  int64_t query_len = 0;  // Lq
  int64_t key_len = 0;    // Lk ≥ 1
  int64_t head_dim = 0;   // E ≥ 1
  int64_t value_dim = 0;  // Ev ≥ 1

  // query (..., Lq, E), key (..., Lk, E), value (..., Lk, Ev): read only.
  const float* query = nullptr;
  OperandStrides query_strides;
  const float* key = nullptr;
  OperandStrides key_strides;
  const float* value = nullptr;
  OperandStrides value_strides;

  // Half-precision operands of the query tiles (bfloat16 or float16: half_dtype) in place of
  // the float32 pointers above (null then), with the same strides:
  //  - bfloat16 products (AttentionOptions::compute, AVX512_BF16 or AMX;
  //    kernels/isa/*_bf16-inl.h): query_half, key_half and value_half, all bfloat16;
  //  - half-precision K and V computed in float32 (half_kv): key_half and value_half,
  //    widened once per thread and batch index (packing-inl.h), query float32.
  // The row groups read K and V as stored instead (key_stored below); the boundary sets both
  // for half-precision K and V, each kernel reads its own.
  DType half_dtype = DType::kBFloat16;
  const uint16_t* query_half = nullptr;
  const uint16_t* key_half = nullptr;
  const uint16_t* value_half = nullptr;
  //  - float16 products (ComputePrecision::kFloat16, AVX512_FP16; kernels/isa/avx512_fp16-inl.h):
  //    the same three, all float16 (half_dtype kFloat16), in the same pair layout.
  //  - bfloat16 products on float32 queries and K/V as stored (kv_format, any of them) or
  //    through the block table: bf16_kv_products, the grouped-query tiles only
  //    (shape_policy.hpp, 5.), which round the queries to bfloat16 as they load them and
  //    widen K and V into bfloat16 pairs per thread and key span (query_tiles-inl.h,
  //    Bf16Operands::Pack): int8 and fp8 codes exactly, their scales applied in float32.
  bool bf16_kv_products = false;
  bool half_products() const { return query_half != nullptr || bf16_kv_products; }
  bool bf16_products() const { return half_products() && half_dtype == DType::kBFloat16; }
  bool f16_products() const { return half_products() && half_dtype == DType::kFloat16; }
  // bfloat16 products on AMX tiles (kernels/isa/amx_bf16.hpp) rather than AVX512_BF16:
  // chosen with them where amx_bf16_products() (cpu_features.hpp) allows.
  bool amx_tiles = false;
  bool half_kv() const { return key_half != nullptr; }
  //  - with half_kv, queries in half_dtype for the query tiles only (the boundary sets it where
  //    only they run: more queries than RunsInRowGroups takes, no stored K/V): query_widened
  //    in place of query (null then), same strides, widened exactly as the tiles load them.
  const uint16_t* query_widened = nullptr;

  // K and V as stored (the row groups and the reference; decoding reads every cached byte
  // once): key_stored and value_stored in kv_format (kv_format.hpp: float16, bfloat16,
  // int8, float8_e4m3 or float8_e5m2) in place of key and value (null then), with their
  // strides, widened to float32 in registers. The scaled formats (int8, fp8) hold
  // x = scale · widen(code) with one scale per (key row, K/V head): the scale of key row
  // `slot` of batch index b is key_scales[batch_offset(key_scale_strides, b) +
  // slot · key_scale_strides.row] (value_scales alike).
  DType kv_format = DType::kFloat32;
  const void* key_stored = nullptr;
  const void* value_stored = nullptr;
  const float* key_scales = nullptr;
  OperandStrides key_scale_strides;
  const float* value_scales = nullptr;
  OperandStrides value_scale_strides;
  bool stored_kv() const { return key_stored != nullptr; }

  // Key spans through a block table (paged K/V; FlashAttention's page_table and page_size):
  // key j of every batch index lives in storage row ("slot")
  // block_table[j / block_size] · block_rows + j % block_size, i.e. at
  // key + batch offset + slot · key_strides.row (V and the scales alike), so that a paged
  // cache is read in place whatever the block order. block_rows: rows from one block to the
  // next (block_size when a block's rows hold every head, Hkv · block_size when each head's
  // rows are adjacent). Null: slot j = j (contiguous keys). Read by the row groups, the
  // grouped-query tiles' bfloat16 pairs (bf16_kv_products) and the reference.
  const int32_t* block_table = nullptr;
  int64_t block_size = 0;
  int64_t block_rows = 0;
  int64_t key_slot(int64_t j) const {
    return block_table ? int64_t{block_table[j / block_size]} * block_rows + j % block_size : j;
  }

  // The backward's five products in bfloat16 (AVX512_BF16): the float32 operands rounded to
  // bfloat16 as the kernel packs them, P̃ and dS rounded before their products.
  bool bf16_backward = false;

  // output (..., Lq, Ev): written. weights (..., Lq, Lk): written when not null.
  float* output = nullptr;
  OperandStrides output_strides;
  float* weights = nullptr;
  OperandStrides weights_strides;

  // logsumexp (..., Lq): lse_i = log Σ_j exp(s_ij) (natural log), written when not null.
  // Its `row` stride steps along Lq; `column` is unused.
  float* logsumexp = nullptr;
  OperandStrides logsumexp_strides;

  // Optional mask (nonzero keeps) and bias, broadcast to (..., Lq, Lk) through strides.
  const uint8_t* mask = nullptr;
  OperandStrides mask_strides;
  const float* bias = nullptr;
  OperandStrides bias_strides;

  // The score rules (see attend/score_rules.hpp and score_rules.hpp, where they are applied).
  // Query i's aligned position is i' = i + diagonal_offset (Lk − Lq bottom-right, 0 top-left).
  bool causal = false;  // key j visible to query i iff j <= i'
  int64_t diagonal_offset = 0;
  // Global positions (AttentionOptions::block): query i is global row i + query_position,
  // key j global key j + key_position. The positional rules above are already expressed in
  // local indices (diagonal_offset and prefix absorb the offsets); the user rules and the
  // dropout draw take the global indices (global_query, global_key in score_rule_layer.hpp).
  int64_t query_position = 0;
  int64_t key_position = 0;
  bool block = false;  // AttentionOptions::block: the softmax also spans keys outside the call
  int64_t window_left = -1;   // key j visible iff j >= i' − window_left (-1: unbounded)
  int64_t window_right = -1;  // key j visible iff j <= i' + window_right (-1: unbounded)
  int64_t prefix = 0;         // keys j < prefix visible whatever causal and the window say
  float softcap = 0.0f;       // s = softcap·tanh(s / softcap) when > 0
  int64_t heads = 1;          // size of the last batch dimension: head h = b % heads
  const float* alibi_slopes = nullptr;  // [heads]: s += slope_h·(j − i') when not null
  const float* sinks = nullptr;         // [heads]: one more logit per row, no value
  // Segment ids (documents), broadcast to (..., Lq) and (..., Lk): `row` steps along L.
  const int32_t* segment_query = nullptr;
  OperandStrides segment_query_strides;
  const int32_t* segment_key = nullptr;
  OperandStrides segment_key_strides;
  const UserScoreRules* user_rules = nullptr;  // null without user rules

  float scale = 1.0f;  // multiplies Q·Kᵀ
  bool zero_fully_masked_rows = false;
  float dropout = 0.0f;  // p in [0, 1)
  uint64_t seed = 0;
  int num_threads = 1;  // ≥ 1, already resolved

  // Batch index b as coordinates over the batch dimensions of size > 1 (one division per
  // such dimension), however many operands then take their offsets from it. Only the
  // `count` dimensions that vary are kept: a runtime-length loop that the compiler does not
  // turn into one vector load of coordinates just written by scalar stores (a
  // store-forwarding stall, measured at a tenth of a short call).
  struct BatchCoordinates {
    int count = 0;
    int dim[kMaxBatchRank] = {};
    int64_t index[kMaxBatchRank] = {};
    // Offset (elements) of these coordinates in an operand with the given strides.
    int64_t offset(const OperandStrides& strides) const {
      int64_t offset = 0;
      for (int k = 0; k < count; ++k) offset += index[k] * strides.batch[dim[k]];
      return offset;
    }
  };
  BatchCoordinates batch_coordinates(int64_t b) const {
    BatchCoordinates c;
    for (int d = kMaxBatchRank - 1; d >= 0; --d) {
      if (batch_shape[d] == 1) continue;  // most batch dimensions: no division
      c.dim[c.count] = d;
      c.index[c.count++] = b % batch_shape[d];
      b /= batch_shape[d];
    }
    return c;
  }
  // Offset (elements) of batch index b in an operand with the given strides.
  int64_t batch_offset(const OperandStrides& strides, int64_t b) const {
    return batch_coordinates(b).offset(strides);
  }
  // Last key index query i may see under causality (inclusive); may be negative.
  int64_t causal_last_key(int64_t query_index) const { return query_index + diagonal_offset; }
};

// The backward pass (see attend/sdpa_backward.hpp). `forward` holds the sizes, inputs,
// mask, bias and options exactly as the forward saw them; forward.output is the forward's
// output O (read only here), forward.weights and forward.logsumexp are null.
struct SdpaBackwardParams {
  SdpaParams forward;
  const float* grad_output = nullptr;  // dO (..., Lq, Ev)
  OperandStrides grad_output_strides;
  const float* logsumexp = nullptr;  // (..., Lq), the forward's; `row` steps along Lq
  OperandStrides logsumexp_strides;

  float* grad_query = nullptr;  // dQ (..., Lq, E): written
  OperandStrides grad_query_strides;
  float* grad_key = nullptr;  // dK (..., Lk, E): written
  OperandStrides grad_key_strides;
  float* grad_value = nullptr;  // dV (..., Lk, Ev): written
  OperandStrides grad_value_strides;
  // dS (..., Lq, Lk), the gradient of the scores (zero where excluded), written when not
  // null: the API boundary reduces it to the bias gradient.
  float* grad_scores = nullptr;
  OperandStrides grad_scores_strides;
};

}  // namespace attend::detail
