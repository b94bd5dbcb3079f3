// attend/npy.hpp: reading and writing NumPy .npy files.
//
// Reads format versions 1.0, 2.0 and 3.0 with little-endian (or byte-order free) dtypes:
// float16/32/64, bool, int8/16/32/64, uint8/16/32/64, in C or Fortran order. A Fortran-order
// file comes back as a C-contiguous Tensor of the same logical shape. Writes version 1.0
// (2.0 when the header needs it), C order. Every problem is an attend::Error whose message
// starts with the file name, e.g. "Q.npy: truncated data: expected 4096 bytes, found 100".
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "attend/tensor.hpp"

namespace attend {

namespace detail {
class StagedFile;  // the library's one atomic file writer (src/io/staged_file.hpp)
}

// Reads the .npy file at `path`. Checks the data size against the file size before
// allocating anything; bytes after the data are ignored.
Tensor read_npy(const std::string& path);

// Parses an in-memory .npy image of `size` bytes. `name_for_messages` starts every error
// message (a file name, or e.g. "<buffer>").
Tensor parse_npy(const void* data, size_t size, const std::string& name_for_messages);

// Writes `view` (any strides; its logical C-order contents) to `path` atomically: a temporary
// file of its own beside `path` is written, flushed to disk and renamed over `path`. On
// failure the temporary file is removed, `path` is untouched and an Error naming `path` is
// thrown. Several threads or processes may write one path at once: it ends up holding one
// of their files, whole.
// bfloat16 has no .npy dtype and is refused.
void write_npy(const std::string& path, const TensorView& view);

// The two halves of write_npy, for writing several files all-or-nothing: the constructor
// writes and flushes the temporary file (throwing as write_npy does), commit() renames it
// over the target. Destroying an uncommitted StagedNpyFile removes the temporary file.
//
//   StagedNpyFile output(out_path, out.view()), weights(weights_path, w.view());
//   output.commit();
//   weights.commit();
class StagedNpyFile {
 public:
  StagedNpyFile(const std::string& path, const TensorView& view);
  ~StagedNpyFile();
  StagedNpyFile(const StagedNpyFile&) = delete;
  StagedNpyFile& operator=(const StagedNpyFile&) = delete;

  // Renames the temporary file over the target. Throws Error (and removes the temporary
  // file) when the rename fails. A second call does nothing.
  void commit();

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<detail::StagedFile> file_;
};

}  // namespace attend
