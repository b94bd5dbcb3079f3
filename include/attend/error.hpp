// attend/error.hpp: the one exception type the library throws.
#pragma once

#include <stdexcept>
#include <string>

namespace attend {

// Thrown for every problem the library detects: bad shapes or dtypes, out-of-range options,
// malformed files, allocations that cannot be satisfied. The message names the offending
// argument and its value or shape, e.g.
//   "key: shape (2, 7, 32) does not match query (2, 5, 64) in the last dimension (E)".
// Text from a file or from the caller that a message quotes (a header key, a dtype, a file
// name) is shown as printable ASCII, other bytes written \xNN, and cut when long, so that a
// message is safe to print to a terminal. Nothing is written to caller-provided outputs when
// an Error is thrown during validation.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace attend
