// npy_fuzzer: attend::parse_npy on arbitrary bytes. A malformed image must end in an
// attend::Error whose message is printable (no control byte but '\n', nothing from 0x7f:
// header bytes are quoted escaped); anything else (a crash, a sanitizer report, a leak,
// another exception, a hang, a raw byte in the message) is a finding. A parsed tensor must
// hold exactly numel × item size readable bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "attend/error.hpp"
#include "attend/npy.hpp"
#include "test_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const attend::Tensor tensor = attend::parse_npy(data, size, "<fuzz>");
    const auto expected_bytes =
        static_cast<size_t>(tensor.numel()) * attend::dtype_size(tensor.dtype());
    if (tensor.nbytes() != expected_bytes) std::abort();
    // Read every byte, so that ASan checks the whole allocation.
    const auto* bytes = static_cast<const unsigned char*>(tensor.data());
    unsigned checksum = 0;
    for (size_t i = 0; i < tensor.nbytes(); ++i) checksum += bytes[i];
    volatile unsigned sink = checksum;
    (void)sink;
  } catch (const attend::Error& e) {
    // Refusing the input is the expected outcome for most of them.
    if (attend::test::first_unprintable_byte(e.what()) != std::string_view::npos) std::abort();
  }
  return 0;
}
