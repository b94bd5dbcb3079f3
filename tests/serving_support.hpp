// serving_support.hpp: helpers shared by the serving tests (plans, ragged batches, the paged
// KV cache): error messages of a call, bitwise comparison.
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/tensor.hpp"

namespace attend::test {

// The attend::Error message of `call`, or a marker when it throws none.
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "<no attend::Error>";
}

// cu_seqlens of these lengths: int32 (B + 1), 0 first.
inline Tensor offsets(const std::vector<int64_t>& lengths) {
  Tensor cu(DType::kInt32, Shape({static_cast<int64_t>(lengths.size()) + 1}));
  cu.data_as<int32_t>()[0] = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    cu.data_as<int32_t>()[s + 1] = cu.data_as<int32_t>()[s] + static_cast<int32_t>(lengths[s]);
  }
  return cu;
}

inline bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Keys up to which a dense call (of at most kMaxShortQueries queries per head, no weights,
// mask, bias, documents, softcap or dropout) runs the short-key kernel rather than the row
// groups on targets of up to 8 lanes: shape_policy.hpp's kMaxShortKeys and kMaxShortLanes.
inline constexpr int64_t kShortKeys = 16;

// A paged result `got` against the dense (varlen) call's `want`, both with the batch's query
// tokens as leading dimension (sequence s: q_lens[s] tokens over lens[s] keys): the same bits
// for the tokens of sequences the dense call runs in the row groups (more than kShortKeys
// keys), within float32 rounding (2e-6 + 1e-5·|want|) for those its short-key kernel runs.
inline bool same_bits_past_short_keys(const Tensor& got, const Tensor& want,
                                      const std::vector<int64_t>& lens,
                                      const std::vector<int64_t>& q_lens,
                                      bool short_keys_run = true) {
  if (got.nbytes() != want.nbytes() || got.numel() != want.numel()) return false;
  int64_t tokens = 0;
  for (const int64_t q : q_lens) tokens += q;
  if (tokens == 0) return true;
  const int64_t per_token = got.numel() / tokens;
  const float* g = got.data_as<float>();
  const float* w = want.data_as<float>();
  int64_t n = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    const bool exact = !short_keys_run || lens[s] > kShortKeys;
    for (int64_t e = 0; e < q_lens[s] * per_token; ++e, ++n) {
      if (exact ? std::memcmp(g + n, w + n, sizeof(float)) != 0
                : !(std::abs(g[n] - w[n]) <= 2e-6f + 1e-5f * std::abs(w[n]) || g[n] == w[n])) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace attend::test
