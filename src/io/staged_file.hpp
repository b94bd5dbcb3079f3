// staged_file.hpp: the one way attend writes a file: whole, or not at all.
//
// A StagedFile is written to a temporary file of its own in the target's directory (named by
// mkostemp, so that no two writers, threads or processes, ever share one). commit() flushes
// it to disk, renames it over the target and flushes the directory. A reader of the target
// sees the old file or the new one, never a part of either; of several writers of one path
// the last rename wins, and each leaves a complete file. On any failure, and in the
// destructor when commit() was not reached, the temporary file is removed and the target is
// left as it was.
//
//   StagedFile file(path);
//   file.write(header.data(), header.size());
//   file.write(data, data_bytes);
//   file.commit();
//
// Several files all or nothing: construct and write every one, flush() every one, and only
// then commit() every one. After the flushes, a commit fails only when a rename does (the
// directory vanished, say); the files committed before it stay replaced.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace attend::detail {

class StagedFile {
 public:
  // Creates the temporary file (mode 0644) beside `path`. Every error is an attend::Error
  // "<path>: <reason>": `path` is a directory, its directory is missing or refuses a new
  // file, a write, flush or rename fails (with the system's reason).
  explicit StagedFile(std::string path);
  ~StagedFile();
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  // Appends `size` bytes at `data` to the temporary file.
  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }

  // Flushes what was written to disk (fsync) and closes the temporary file; nothing can be
  // written after it. commit() calls it when it was not called before.
  void flush();

  // Renames the temporary file over the target, then flushes the directory so that the new
  // name survives a crash. A second call does nothing.
  void commit();

  const std::string& path() const { return path_; }

 private:
  // Removes the temporary file and throws "<path>: <reason>[: strerror(error_number)]".
  [[noreturn]] void fail(const std::string& reason, int error_number = 0);

  std::string path_;
  std::string temporary_path_;  // empty once renamed or removed
  int fd_ = -1;                 // open from construction until flush()
  bool committed_ = false;
};

}  // namespace attend::detail
