// attend/safetensors.hpp: reading and writing the safetensors format.
//
//   bytes [0, 8)        header length H, unsigned 64-bit little-endian
//   bytes [8, 8 + H)    JSON object: name -> {"dtype": "F32", "shape": [3, 4],
//                       "data_offsets": [begin, end]}, plus an optional "__metadata__"
//                       object of string -> string
//   bytes [8 + H, ...)  the data; offsets are relative to its start, little-endian, C order
//
// dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL. Every problem is
// an attend::Error whose message starts with the file name.
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "attend/tensor.hpp"

namespace attend {

struct SafetensorsContents {
  std::map<std::string, Tensor> tensors;        // in the file's dtype, contiguous
  std::map<std::string, std::string> metadata;  // "__metadata__", empty when absent
};

// Reads the safetensors file at `path`.
SafetensorsContents load_safetensors(const std::string& path);

// Parses an in-memory safetensors image of `size` bytes. `name_for_messages` starts every
// error message. Validates the header length against the size, the JSON, every dtype, shape
// and data_offsets pair (inside the data, matching shape × dtype size, not overlapping
// another tensor) before copying anything.
SafetensorsContents parse_safetensors(const void* data, size_t size,
                                      const std::string& name_for_messages);

// Writes `tensors` (any strides; their logical C-order contents) and `metadata` to `path`
// atomically: a temporary file of its own beside `path` is written, flushed to disk and
// renamed over it. On failure the temporary file is removed and `path` is untouched. Several
// threads or processes may save one path at once: it ends up holding one of their files,
// whole.
void save_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The safetensors dtype string ("F32", ...) of `dtype`, and back (attend::Error for unknown).
const char* safetensors_dtype_name(DType dtype);
DType dtype_from_safetensors_name(const std::string& name);

}  // namespace attend
