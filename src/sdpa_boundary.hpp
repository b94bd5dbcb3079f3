// sdpa_boundary.hpp: the API boundary's four rooms, for every entry point (the forward in
// sdpa.cpp, the backward, serving, multi-head): views (boundary/views.hpp), validation
// (boundary/validation.hpp), operands (boundary/operands.hpp), and here the one entry the
// paged cache shares with sdpa.cpp: attention over K and V read in place from block storage.
#pragma once

#include <cstdint>
#include <vector>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "boundary/operands.hpp"
#include "boundary/validation.hpp"
#include "boundary/views.hpp"

namespace attend::detail {

// K and V read in place from block storage (a paged cache's blocks; the key spans of
// sdpa_params.hpp): blocks (num_blocks, block_size, Hkv, D) of any K/V format (kv_format.hpp)
// whose last dimension is contiguous and whose block stride is a whole number of row
// strides, the same for K, V and the scales (readable_in_place); the `length` keys at the
// rows the block table `table` names (table[n]: the block of keys [n·block_size, ...)); the
// scaled formats' scales (num_blocks, block_size, Hkv), null otherwise.
struct StoredKeys {
  TensorView key_blocks, value_blocks;
  const TensorView* key_scales = nullptr;
  const TensorView* value_scales = nullptr;
  const int32_t* table = nullptr;
  int64_t length = 0;
  // A view (Hkv, length, D) of `dtype` with the blocks' strides, for the checks of the dense
  // problem (never read).
  TensorView stand_in(bool value, DType dtype) const;
  // Rows from one block to the next (SdpaParams::block_rows); 0 for a row stride of 0.
  int64_t block_rows() const {
    return key_blocks.strides[1] > 0 ? key_blocks.strides[0] / key_blocks.strides[1] : 0;
  }
  // Whether the kernels can read these blocks in place (else a gathered copy).
  bool readable_in_place() const;
};

// One call over stored keys: scaled_dot_product_attention_into of `query` (H, Lq, E) over
// `stored`, outputs checked by the caller (a sequence of a paged decoding step).
struct StoredKeysCall {
  TensorView query;
  StoredKeys stored;
  AttentionOutputViews outputs;
};
// Every call of `calls`, the same options for all: each validated as its dense problem
// first (an attend::Error before any output is written), float32 products on K and V
// widened in registers, or bfloat16 products in the grouped-query tiles where
// stored_kv_bf16_products (boundary/operands.hpp) says so; those the row groups run (all
// the others but for a forced reference backend) as one work list over the options' threads
// (fused_sdpa_rows_batch), the rest one after another. Each call's results are bitwise those of the dense call on it alone (the
// same row groups, key split and merge), whatever the other calls and the thread count.
void run_over_stored_keys_batch(const std::vector<StoredKeysCall>& calls,
                                const AttentionOptions& options);

}  // namespace attend::detail
