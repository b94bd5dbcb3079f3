// grouped_query.hpp: grouped-query and multi-query attention (GQA/MQA) at the API boundary.
//
// Query (..., H, Lq, E) against key (..., Hkv, Lk, E) and value (..., Hkv, Lk, Ev) with
// H = G·Hkv: query head h reads K/V head h / G (PyTorch's enable_gqa, repeat_interleave
// order). The heads are the last batch dimension. No copy of K or V: the kernels see the
// batch (..., H) as (..., Hkv, G) with K and V broadcast (stride 0) over G, so a batch index
// b keeps its flat value (head_of(b) = b % H, dropout draws and user rules as for the dense
// problem) and the decode row groups, which take the heads of one K/V head as one group (all
// G of them up to kRowGroup, 8 at a time where 8 divides G), load each K/V vector once for
// the heads of a group.
#pragma once

#include <cstdint>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

// G = H / Hkv for these operands (1 without grouping). Checks that the batch dimensions of
// key and value equal query's except the last (heads), where K and V have Hkv heads dividing
// query's H, and options.num_kv_heads when given. Throws attend::Error naming the problem.
int64_t kv_group_of(const TensorView& query, const TensorView& key, const TensorView& value,
                    const AttentionOptions& options);

// The kernels' view of a grouped problem: batch (..., H) becomes (..., Hkv, G); every
// operand of a query head splits its head stride s into (G·s, s), key and value take
// (s_kv, 0). Needs batch_shape[0] == 1 (checked by kv_group_of: at most 3 batch dimensions).
SdpaParams split_kv_heads(const SdpaParams& p, int64_t group);
// The strides of one per-query-head operand in that view.
OperandStrides split_query_heads(OperandStrides s, int64_t group);
SdpaBackwardParams split_kv_heads(const SdpaBackwardParams& p, int64_t group);

// dK (..., Hkv, Lk, D) = Σ_g dense (..., Hkv·G + g, Lk, D) for g = 0..G−1 in this order,
// in float64 (a fixed order: bitwise the same at any thread count). `dense` is contiguous.
void sum_kv_groups(const Tensor& dense, const TensorView& out, int64_t group);

}  // namespace attend::detail
