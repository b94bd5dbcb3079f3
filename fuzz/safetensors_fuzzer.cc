// safetensors_fuzzer: attend::parse_safetensors on arbitrary bytes. A malformed image must
// end in an attend::Error whose message is printable (no control byte but '\n', nothing from
// 0x7f: names, dtypes and JSON are quoted escaped); anything else (a crash, a sanitizer
// report, a leak, another exception, a hang, a raw byte in the message) is a finding. Every parsed
// tensor must fit inside the input's data section, so its bytes are at most the input size.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "attend/error.hpp"
#include "attend/safetensors.hpp"
#include "test_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const attend::SafetensorsContents contents = attend::parse_safetensors(data, size, "<fuzz>");
    size_t total_bytes = 0;
    for (const auto& [name, tensor] : contents.tensors) {
      const auto expected_bytes =
          static_cast<size_t>(tensor.numel()) * attend::dtype_size(tensor.dtype());
      if (tensor.nbytes() != expected_bytes) std::abort();
      total_bytes += tensor.nbytes();
      const auto* bytes = static_cast<const unsigned char*>(tensor.data());
      unsigned checksum = 0;
      for (size_t i = 0; i < tensor.nbytes(); ++i) checksum += bytes[i];
      volatile unsigned sink = checksum;
      (void)sink;
    }
    // Tensors may not overlap in the data section, so together they fit in the input.
    if (total_bytes > size) std::abort();
  } catch (const attend::Error& e) {
    // Refusing the input is the expected outcome for most of them.
    if (attend::test::first_unprintable_byte(e.what()) != std::string_view::npos) std::abort();
  }
  return 0;
}
