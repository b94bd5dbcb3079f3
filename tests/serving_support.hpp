// serving_support.hpp: helpers shared by the serving tests (plans, ragged batches, the paged
// KV cache): error messages of a call, bitwise comparison.
#pragma once

#include <cstring>
#include <functional>
#include <string>

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

inline bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

}  // namespace attend::test
