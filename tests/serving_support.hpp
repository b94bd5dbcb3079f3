// serving_support.hpp: helpers shared by the serving tests (plans, ragged batches, the paged
// KV cache): error messages of a call, bitwise comparison.
#pragma once

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

}  // namespace attend::test
