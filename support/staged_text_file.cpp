// staged_text_file.cpp: StagedTextFile over the library's StagedFile.
#include "staged_text_file.hpp"

#include "attend/error.hpp"
#include "io/staged_file.hpp"

namespace attend::support {

StagedTextFile::StagedTextFile(const std::string& what, const std::string& path,
                               const std::string& contents)
    : what_(what) {
  try {
    file_ = std::make_unique<detail::StagedFile>(path);
    file_->write(contents);
    file_->flush();
  } catch (const Error& e) {
    throw Error(what + " " + e.what());
  }
}

StagedTextFile::~StagedTextFile() = default;
StagedTextFile::StagedTextFile(StagedTextFile&&) noexcept = default;
StagedTextFile& StagedTextFile::operator=(StagedTextFile&&) noexcept = default;

void StagedTextFile::commit() {
  try {
    file_->commit();
  } catch (const Error& e) {
    throw Error(what_ + " " + e.what());
  }
}

}  // namespace attend::support
