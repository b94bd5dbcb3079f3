// checked_math.hpp: size arithmetic that throws attend::Error instead of overflowing.
#pragma once

#include <cstdint>
#include <string>

#include "attend/error.hpp"

namespace attend::detail {

inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t result;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &result)) {
    throw Error(std::string(what) + " overflows: " + std::to_string(a) + " * " + std::to_string(b));
  }
  return result;
}

inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t result;
  if (__builtin_add_overflow(a, b, &result)) {
    throw Error(std::string(what) + " overflows: " + std::to_string(a) + " + " + std::to_string(b));
  }
  return result;
}

}  // namespace attend::detail
