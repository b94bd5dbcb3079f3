// score_rules.cpp: the score rules at the API boundary: validation of their options (every
// error names the argument) and their part of SdpaParams.
#include "score_rules.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "attend/error.hpp"
#include "boundary/views.hpp"

namespace attend {

std::vector<float> default_alibi_slopes(int64_t heads) {
  if (heads < 1)
    throw Error("default_alibi_slopes: heads must be >= 1, got " + std::to_string(heads));
  // Slopes 2^(-8/n), 2^(-16/n), ..., 2^(-8) for a power of two n.
  const auto geometric = [](int64_t n) {
    std::vector<float> slopes;
    const double start = std::exp2(-8.0 / static_cast<double>(n));
    double slope = start;
    for (int64_t h = 0; h < n; ++h, slope *= start) slopes.push_back(static_cast<float>(slope));
    return slopes;
  };
  int64_t power = 1;
  while (power * 2 <= heads) power *= 2;
  std::vector<float> slopes = geometric(power);
  const std::vector<float> doubled = geometric(2 * power);
  for (int64_t h = 0; static_cast<int64_t>(slopes.size()) < heads; h += 2) {
    slopes.push_back(doubled[static_cast<size_t>(h)]);
  }
  return slopes;
}

}  // namespace attend

namespace attend::detail {
namespace {

int64_t heads_of(const Shape& scores_shape) {
  return scores_shape.rank() > 2 ? scores_shape[scores_shape.rank() - 3] : 1;
}

// A (H) float vector of finite values: ALiBi slopes or sinks.
void check_per_head(const char* name, const TensorView& t, int64_t heads) {
  check_view(name, t);
  if (t.rank() != 1 || t.shape[0] != heads) {
    throw Error(describe(name, t) + " should have one value per head: shape (" +
                std::to_string(heads) + "), the last batch dimension");
  }
  if (!is_attention_float(t.dtype)) {
    throw Error(std::string(name) + ": dtype " + dtype_name(t.dtype) +
                " is not supported (float32, float16 or bfloat16)");
  }
  Tensor values(DType::kFloat32, t.shape);
  convert(t, values.view());
  for (int64_t h = 0; h < heads; ++h) {
    const float v = values.data_as<float>()[h];
    if (!std::isfinite(v)) {
      throw Error(std::string(name) + ": entry " + std::to_string(h) + " is not finite (" +
                  std::to_string(v) + ")");
    }
  }
}

// Segment ids (..., L) as a (..., L, 1) view, so that they broadcast as the scores' rows.
TensorView as_rows(const TensorView& t) {
  TensorView v = t;
  v.shape.push_back(1);
  v.strides.push_back(0);
  return v;
}

Shape rows_target(const Shape& scores_shape, int64_t length) {
  Shape target = Shape::from(scores_shape.data(), scores_shape.rank() - 2);
  target.push_back(length);
  target.push_back(1);
  return target;
}

void check_segments(const char* name, const TensorView& t, const Shape& scores_shape,
                    int64_t length) {
  check_view(name, t);
  if (is_floating(t.dtype) || t.dtype == DType::kBool) {
    throw Error(std::string(name) + ": dtype " + dtype_name(t.dtype) +
                " is not supported (an integer dtype: int8 to int64)");
  }
  if (t.rank() < 1 || t.shape.back(0) != length) {
    throw Error(describe(name, t) + " should end in the sequence length " + std::to_string(length));
  }
  (void)broadcast_strides(name, as_rows(t), rows_target(scores_shape, length));
  Tensor values(DType::kInt64, t.shape);
  convert(t, values.view());
  for (int64_t n = 0; n < values.numel(); ++n) {
    const int64_t v = values.data_as<int64_t>()[n];
    if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
      throw Error(std::string(name) + ": id " + std::to_string(v) + " at element " +
                  std::to_string(n) + " does not fit in 32 bits");
    }
  }
}

// int32 contiguous copy of segment ids, and their strides broadcast to (..., L).
const int32_t* segments_for_kernel(const char* name, const TensorView& t, const Shape& scores_shape,
                                   int64_t length, std::optional<Tensor>& storage,
                                   OperandStrides& strides) {
  storage.emplace(DType::kInt32, t.shape);
  convert(t, storage->view());
  strides = broadcast_strides(name, as_rows(storage->view()), rows_target(scores_shape, length));
  return storage->data_as<const int32_t>();
}

const float* per_head_for_kernel(const TensorView& t, std::optional<Tensor>& storage) {
  storage.emplace(DType::kFloat32, t.shape);
  convert(t, storage->view());
  return storage->data_as<const float>();
}

}  // namespace

void validate_score_rules(const AttentionOptions& options, const Shape& scores_shape) {
  // The common case, no rule at all, in a few loads (tiny calls pay for every instruction).
  if (!options.window && !options.softcap && !options.alibi_slopes && !options.sinks &&
      !options.segment_ids_query && !options.segment_ids_key && options.prefix == 0 &&
      !options.user_rules && !options.block) {
    return;
  }
  const int64_t Lq = scores_shape.back(1), Lk = scores_shape.back(0);
  // The whole problem's lengths: the block's own without AttentionOptions::block.
  const int64_t total_query_len = options.block ? options.block->query_len : Lq;
  const int64_t total_key_len = options.block ? options.block->key_len : Lk;
  if (options.block) {
    const BlockPositions& block = *options.block;
    for (auto [name, offset, length, total] :
         {std::tuple{"query", block.query_offset, Lq, block.query_len},
          std::tuple{"key", block.key_offset, Lk, block.key_len}}) {
      if (offset < 0 || total < length || offset > total - length) {
        const std::string whole = std::to_string(total) + " " + name + " positions";
        throw Error(std::string("block: the ") + std::to_string(length) + " " + name +
                    "s from offset " + std::to_string(offset) +
                    " do not lie within the whole problem's " + whole);
      }
    }
  }
  const int64_t heads = heads_of(scores_shape);
  if (options.window) {
    const SlidingWindow& w = *options.window;
    for (auto [side, value] : {std::pair{"left", w.left}, std::pair{"right", w.right}}) {
      if (value < 0 && value != kUnboundedWindow) {
        throw Error(std::string("window: the ") + side +
                    " side must be >= 0 or -1 (unbounded), got " + std::to_string(value));
      }
    }
    if (options.causal && w.right > 0) {
      throw Error("window: a right side of " + std::to_string(w.right) +
                  " means nothing with causal, which hides every key after the query's position "
                  "(use right = 0 or -1)");
    }
  }
  if (options.softcap && !(std::isfinite(*options.softcap) && *options.softcap > 0)) {
    throw Error("softcap must be finite and > 0, got " + std::to_string(*options.softcap));
  }
  if (options.alibi_slopes) check_per_head("alibi_slopes", *options.alibi_slopes, heads);
  if (options.sinks) check_per_head("sinks", *options.sinks, heads);
  if (options.segment_ids_query.has_value() != options.segment_ids_key.has_value()) {
    throw Error(std::string("segment ids: ") +
                (options.segment_ids_query ? "segment_ids_key" : "segment_ids_query") +
                " is missing; documents need the ids of both the queries and the keys");
  }
  if (options.segment_ids_query) {
    check_segments("segment_ids_query", *options.segment_ids_query, scores_shape, Lq);
    check_segments("segment_ids_key", *options.segment_ids_key, scores_shape, Lk);
  }
  if (options.prefix < 0 || options.prefix > total_key_len) {
    throw Error("prefix must be in [0, Lk = " + std::to_string(total_key_len) + "], got " +
                std::to_string(options.prefix));
  }
  if (options.prefix > 0 && !options.causal && !options.window) {
    throw Error("prefix " + std::to_string(options.prefix) +
                " needs causal or a window: without them every key is visible already");
  }
  if (options.user_rules && !options.user_rules->modify && !options.user_rules->mask) {
    throw Error("user_rules holds neither a score_mod nor a mask_mod (use make_score_rules)");
  }
  if (options.user_rules) {
    int64_t batch = 1;
    for (int d = 0; d + 2 < scores_shape.rank(); ++d) batch *= scores_shape[d];
    const int64_t largest = std::max({batch, total_query_len, total_key_len});
    if (largest > std::numeric_limits<int32_t>::max()) {
      throw Error("user_rules take int32 indices: batch, Lq and Lk must be below 2^31, got " +
                  std::to_string(largest));
    }
  }
}

void fill_positional_rules(SdpaParams& p, const AttentionOptions& options) {
  p.causal = options.causal;
  // Global positions i + query_position, j + key_position; the alignment is the whole
  // problem's, and the positional rules, in local indices, compare j with
  // i + diagonal_offset.
  const BlockPositions block =
      options.block ? *options.block : BlockPositions{0, 0, p.query_len, p.key_len};
  p.block = options.block.has_value();
  p.query_position = block.query_offset;
  p.key_position = block.key_offset;
  const int64_t alignment = options.causal_alignment == CausalAlignment::kBottomRight
                                ? block.key_len - block.query_len
                                : 0;
  p.diagonal_offset = alignment + block.query_offset - block.key_offset;
  if (options.window) {
    p.window_left = options.window->left;
    p.window_right = options.window->right;
  }
  p.prefix = std::clamp<int64_t>(options.prefix - block.key_offset, 0, p.key_len);
}

void fill_score_rules(SdpaParams& p, const AttentionOptions& options, const Shape& scores_shape,
                      ScoreRuleInputs& storage) {
  fill_positional_rules(p, options);
  p.heads = heads_of(scores_shape);
  if (!options.softcap && !options.alibi && !options.alibi_slopes && !options.sinks &&
      !options.segment_ids_query && !options.user_rules) {
    return;  // no rule beyond the positional ones: the defaults of SdpaParams
  }
  p.softcap = options.softcap ? static_cast<float>(*options.softcap) : 0.0f;
  if (options.alibi_slopes) {
    p.alibi_slopes = per_head_for_kernel(*options.alibi_slopes, storage.alibi_slopes);
  } else if (options.alibi) {
    storage.default_slopes = default_alibi_slopes(p.heads);
    p.alibi_slopes = storage.default_slopes.data();
  }
  if (options.sinks) p.sinks = per_head_for_kernel(*options.sinks, storage.sinks);
  if (options.segment_ids_query) {
    p.segment_query =
        segments_for_kernel("segment_ids_query", *options.segment_ids_query, scores_shape,
                            p.query_len, storage.segment_query, p.segment_query_strides);
    p.segment_key = segments_for_kernel("segment_ids_key", *options.segment_ids_key, scores_shape,
                                        p.key_len, storage.segment_key, p.segment_key_strides);
  }
  if (options.user_rules) p.user_rules = &*options.user_rules;
}

}  // namespace attend::detail
