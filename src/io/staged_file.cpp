// staged_file.cpp: write a temporary file, flush it, rename it over the target (see
// staged_file.hpp).
#include "io/staged_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "attend/error.hpp"
#include "quote.hpp"

namespace attend::detail {
namespace {

// The directory that holds `path`, as open() and messages take it.
std::string directory_of(const std::string& path) {
  const std::filesystem::path directory = std::filesystem::path(path).parent_path();
  return directory.empty() ? "." : directory.string();
}

}  // namespace

StagedFile::StagedFile(std::string path) : path_(std::move(path)) {
  if (path_.empty()) throw Error("cannot write a file with an empty name");
  std::error_code ignored;
  if (std::filesystem::is_directory(path_, ignored)) fail("cannot write: it is a directory");

  // mkostemp replaces the X's with a name no other file in the directory has, and creates
  // the file with O_EXCL: two writers of one path never share a temporary file.
  std::string temporary = path_ + ".tmp-XXXXXX";
  const int fd = ::mkostemp(temporary.data(), O_CLOEXEC);
  if (fd < 0) {
    const int error_number = errno;
    const std::string directory = quote_for_message(directory_of(path_), kMaxNameBytes);
    if (error_number == ENOENT)
      fail("cannot create file: directory " + directory + " does not exist");
    if (error_number == ENOTDIR) fail("cannot create file: " + directory + " is not a directory");
    fail("cannot create file in directory " + directory, error_number);
  }
  fd_ = fd;
  temporary_path_ = std::move(temporary);
  // mkostemp creates the file private (0600); what attend writes is for everyone to read.
  if (::fchmod(fd_, 0644) != 0) fail("cannot set permissions", errno);
}

StagedFile::~StagedFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temporary_path_.empty()) ::unlink(temporary_path_.c_str());
}

void StagedFile::write(const void* data, size_t size) {
  if (fd_ < 0) fail("cannot write: the file was already flushed");
  // write() moves at most about 2 GiB at once on Linux.
  constexpr size_t kMaxChunk = size_t{1} << 30;
  size_t done = 0;
  while (done < size) {
    const size_t chunk = std::min(size - done, kMaxChunk);
    const ssize_t written = ::write(fd_, static_cast<const char*>(data) + done, chunk);
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) fail("cannot write", errno);
    done += static_cast<size_t>(written);
  }
}

void StagedFile::flush() {
  if (fd_ < 0) return;
  if (::fsync(fd_) != 0) fail("cannot flush to disk", errno);
  // After a successful fsync, close() has nothing left to lose.
  ::close(fd_);
  fd_ = -1;
}

void StagedFile::commit() {
  if (committed_) return;
  if (temporary_path_.empty()) fail("cannot commit: an earlier step failed");
  flush();
  if (::rename(temporary_path_.c_str(), path_.c_str()) != 0) {
    fail("cannot replace the file", errno);
  }
  temporary_path_.clear();
  committed_ = true;
  // The rename is durable once the directory is flushed. If that fails the new file is in
  // place all the same, so it is not reported as a failed write.
  const int directory_fd = ::open(directory_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory_fd >= 0) {
    (void)::fsync(directory_fd);
    ::close(directory_fd);
  }
}

void StagedFile::fail(const std::string& reason, int error_number) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temporary_path_.empty()) ::unlink(temporary_path_.c_str());
  temporary_path_.clear();
  std::string message = printable_for_message(path_) + ": " + reason;
  if (error_number != 0) message += std::string(": ") + std::strerror(error_number);
  throw Error(message);
}

}  // namespace attend::detail
