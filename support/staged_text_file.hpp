// staged_text_file.hpp: a text file (an SVG picture) written whole or not at all, for the CLI
// and the examples, through the library's one file writer (src/io/staged_file.hpp).
#pragma once

#include <memory>
#include <string>

namespace attend::detail {
class StagedFile;
}

namespace attend::support {

// The constructor writes `contents` to a temporary file beside `path` and flushes it to disk;
// commit() renames it over `path`; one never committed is removed. Errors throw attend::Error
// reading "<what> <path>: <reason>" (`what`: the option or role that named the path, e.g.
// "--svg"). Several files all or nothing: construct every one, then commit every one.
class StagedTextFile {
 public:
  StagedTextFile(const std::string& what, const std::string& path, const std::string& contents);
  ~StagedTextFile();
  StagedTextFile(StagedTextFile&&) noexcept;
  StagedTextFile& operator=(StagedTextFile&&) noexcept;

  void commit();

 private:
  std::string what_;
  std::unique_ptr<detail::StagedFile> file_;
};

}  // namespace attend::support
