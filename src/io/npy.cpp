// npy.cpp: the NumPy .npy format
// (https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html).
//
// File layout: "\x93NUMPY", major and minor version bytes, header length (uint16 little-endian
// for version 1, uint32 for versions 2 and 3), the header (a Python dict literal with the keys
// 'descr', 'fortran_order' and 'shape', padded with spaces and ended by '\n'), then the data.
//
// Every size that comes from the file is checked against the bytes actually present before
// anything is allocated or read; arithmetic on it is overflow-checked.
#include "attend/npy.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "attend/error.hpp"
#include "dtype_table.hpp"
#include "io/staged_file.hpp"
#include "quote.hpp"

namespace attend {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the .npy reader and writer assume a little-endian host");

constexpr std::string_view kMagic("\x93NUMPY", 6);
// Bytes before the header: magic, two version bytes, then a 2-byte (v1) or 4-byte (v2, v3)
// header length.
constexpr size_t kVersion1Prefix = 10;
constexpr size_t kVersion2Prefix = 12;
// numpy pads the header so that the data starts at a multiple of this.
constexpr size_t kDataAlignment = 64;

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw Error(detail::printable_for_message(name) + ": " + what);
}

std::string system_error_text(int error_number) { return std::strerror(error_number); }

// ---------------------------------------------------------------------------------------
// Header

struct NpyHeader {
  DType dtype = DType::kFloat32;
  Shape shape;
  bool fortran_order = false;
  size_t data_offset = 0;   // bytes from the start of the file to the data
  uint64_t data_bytes = 0;  // numel · item size
};

uint32_t read_little_endian(const unsigned char* bytes, int count) {
  uint32_t value = 0;
  for (int i = count - 1; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

// Checks the magic string and version in the first bytes of a file of `total_size` bytes and
// returns where the data starts (the end of the header). `prefix` holds min(total_size, 12)
// bytes.
size_t find_data_offset(const unsigned char* prefix, size_t prefix_size, uint64_t total_size,
                        const std::string& name) {
  if (prefix_size < kMagic.size() || std::memcmp(prefix, kMagic.data(), kMagic.size()) != 0) {
    fail(name, "not a .npy file (bad magic string; expected \\x93NUMPY)");
  }
  if (prefix_size < kVersion1Prefix) {
    fail(name, "file too short for a .npy header (" + std::to_string(total_size) + " bytes)");
  }
  const int major = prefix[6], minor = prefix[7];
  size_t header_start = 0;
  uint32_t header_length = 0;
  if (major == 1) {
    header_start = kVersion1Prefix;
    header_length = read_little_endian(prefix + 8, 2);
  } else if (major == 2 || major == 3) {
    if (prefix_size < kVersion2Prefix) {
      fail(name, "file too short for a .npy header (" + std::to_string(total_size) + " bytes)");
    }
    header_start = kVersion2Prefix;
    header_length = read_little_endian(prefix + 8, 4);
  } else {
    fail(name, "unsupported .npy format version " + std::to_string(major) + "." +
                   std::to_string(minor) + " (1.0, 2.0 and 3.0 are read)");
  }
  const uint64_t data_offset = uint64_t{header_start} + header_length;
  if (data_offset > total_size) {
    fail(name, "header length " + std::to_string(header_length) +
                   " runs past the end of the file (" + std::to_string(total_size) + " bytes)");
  }
  return static_cast<size_t>(data_offset);
}

// Recursive-descent parser for the header dict, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 5, 64), }
// Keys may come in any order; whitespace is free; unknown or repeated keys are refused.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& name) : text_(text), name_(name) {}

  void parse(NpyHeader& header) {
    skip_space();
    if (!consume('{')) malformed("header is not a dict (expected '{')");
    std::optional<std::string> descr;
    std::optional<bool> fortran_order;
    std::optional<Shape> shape;
    while (true) {
      skip_space();
      if (consume('}')) break;
      const std::string key = parse_string("a dict key");
      skip_space();
      if (!consume(':')) malformed("expected ':' after key " + detail::quote_for_message(key));
      skip_space();
      if (key == "descr") {
        if (descr) malformed("key 'descr' appears twice");
        if (peek() == '[') fail(name_, "structured dtypes are not supported");
        descr = parse_string("the 'descr' value");
      } else if (key == "fortran_order") {
        if (fortran_order) malformed("key 'fortran_order' appears twice");
        fortran_order = parse_bool();
      } else if (key == "shape") {
        if (shape) malformed("key 'shape' appears twice");
        shape = parse_shape();
      } else {
        malformed("unexpected key " + detail::quote_for_message(key));
      }
      skip_space();
      if (consume(',')) continue;
      if (!consume('}')) malformed("expected ',' or '}'");
      break;
    }
    skip_space();
    if (position_ != text_.size()) malformed("unexpected text after the dict");
    if (!descr) malformed("missing key 'descr'");
    if (!fortran_order) malformed("missing key 'fortran_order'");
    if (!shape) malformed("missing key 'shape'");
    header.dtype = parse_descr(*descr);
    header.fortran_order = *fortran_order;
    header.shape = *shape;
  }

 private:
  [[noreturn]] void malformed(const std::string& what) {
    fail(name_, "malformed header: " + what + " at offset " + std::to_string(position_) +
                    " of the header");
  }

  char peek() const { return position_ < text_.size() ? text_[position_] : '\0'; }
  bool consume(char c) {
    if (position_ >= text_.size() || text_[position_] != c) return false;
    ++position_;
    return true;
  }
  void skip_space() {
    while (position_ < text_.size() && (text_[position_] == ' ' || text_[position_] == '\t' ||
                                        text_[position_] == '\n' || text_[position_] == '\r')) {
      ++position_;
    }
  }

  // A Python string literal in single or double quotes, without escapes.
  std::string parse_string(const char* what) {
    const char quote = peek();
    if (quote != '\'' && quote != '"') malformed(std::string("expected a string for ") + what);
    ++position_;
    const size_t start = position_;
    while (position_ < text_.size() && text_[position_] != quote) {
      if (text_[position_] == '\\') malformed("escape sequences in strings are not supported");
      ++position_;
    }
    if (position_ >= text_.size()) malformed("unterminated string");
    std::string value(text_.substr(start, position_ - start));
    ++position_;
    return value;
  }

  bool parse_bool() {
    for (auto [word, value] :
         {std::pair{std::string_view("True"), true}, std::pair{std::string_view("False"), false}}) {
      if (text_.substr(position_, word.size()) == word) {
        position_ += word.size();
        return value;
      }
    }
    malformed("'fortran_order' must be True or False");
  }

  // "(2, 5, 64)", "(7,)" or "()": non-negative decimal integers, at most Shape::kMaxRank.
  Shape parse_shape() {
    if (!consume('(')) malformed("'shape' must be a tuple");
    Shape shape;
    while (true) {
      skip_space();
      if (consume(')')) break;
      if (peek() == '-') {
        fail(name_, "negative dimension in shape at offset " + std::to_string(position_) +
                        " of the header");
      }
      if (peek() < '0' || peek() > '9') malformed("shape dimension is not a non-negative integer");
      int64_t dimension = 0;
      while (peek() >= '0' && peek() <= '9') {
        const int digit = peek() - '0';
        if (__builtin_mul_overflow(dimension, 10, &dimension) ||
            __builtin_add_overflow(dimension, digit, &dimension)) {
          fail(name_, "shape dimension overflows a 64-bit integer");
        }
        ++position_;
      }
      if (peek() == '.' || peek() == 'e' || peek() == 'E') {
        malformed("shape dimension is not a non-negative integer");
      }
      if (shape.rank() == Shape::kMaxRank) {
        fail(name_, "shape has more than " + std::to_string(Shape::kMaxRank) +
                        " dimensions (rank " + std::to_string(Shape::kMaxRank) +
                        " is the maximum)");
      }
      shape.push_back(dimension);
      skip_space();
      if (consume(',')) continue;
      if (!consume(')')) malformed("expected ',' or ')' in the shape");
      break;
    }
    return shape;
  }

  // "<f4", "|b1", ...: byte order, kind, item size.
  DType parse_descr(const std::string& descr) {
    const std::string quoted = detail::quote_for_message(descr);
    if (descr.size() < 3) fail(name_, "dtype " + quoted + " is not supported");
    const char byte_order = descr[0];
    const char kind = descr[1];
    const std::string size_text = descr.substr(2);
    if (size_text.find_first_not_of("0123456789") != std::string::npos) {
      fail(name_, "dtype " + quoted + " is not supported");
    }
    if (byte_order != '<' && byte_order != '>' && byte_order != '|' && byte_order != '=') {
      fail(name_, "dtype " + quoted + " has no byte order; it is not supported");
    }
    switch (kind) {
      case 'c':
        fail(name_, "complex dtype " + quoted + " is not supported");
      case 'O':
        fail(name_, "object dtype " + quoted + " is not supported");
      case 'V':
        fail(name_, "structured (void) dtype " + quoted + " is not supported");
      case 'U':
      case 'S':
      case 'a':
        fail(name_, "string dtype " + quoted + " is not supported");
      case 'M':
      case 'm':
        fail(name_, "datetime dtype " + quoted + " is not supported");
      default:
        break;
    }
    const size_t item_size = size_text.size() > 2 ? 0 : std::stoul(size_text);
    using detail::DTypeKind;
    std::optional<DType> dtype;
    if (kind == 'f' || kind == 'b' || kind == 'i' || kind == 'u') {
      dtype = detail::dtype_of_kind(kind == 'f'   ? DTypeKind::kFloat
                                    : kind == 'b' ? DTypeKind::kBool
                                    : kind == 'i' ? DTypeKind::kInt
                                                  : DTypeKind::kUInt,
                                    item_size);
    }
    if (!dtype) {
      fail(name_,
           "dtype " + quoted + " is not supported (float16/32/64, bool, int8-64 and uint8-64 are)");
    }
    if (byte_order == '>' && item_size > 1) {
      fail(name_, "big-endian dtype " + quoted + " is not supported; convert it with " +
                      "arr.astype(arr.dtype.newbyteorder('<'))");
    }
    return *dtype;
  }

  std::string_view text_;
  const std::string& name_;
  size_t position_ = 0;
};

// Parses the header in bytes [0, data_offset) (the prefix already checked by
// find_data_offset) and sizes the data.
NpyHeader parse_header(const unsigned char* bytes, size_t data_offset, const std::string& name) {
  const size_t header_start = bytes[6] == 1 ? kVersion1Prefix : kVersion2Prefix;
  const std::string_view text(reinterpret_cast<const char*>(bytes) + header_start,
                              data_offset - header_start);
  if (text.empty() || text.back() != '\n') {
    fail(name, "header does not end with a newline (is the header length " +
                   std::to_string(text.size()) + " wrong?)");
  }
  NpyHeader header;
  HeaderParser(text, name).parse(header);
  header.data_offset = data_offset;
  int64_t count = 1;
  for (int d = 0; d < header.shape.rank(); ++d) {
    if (__builtin_mul_overflow(count, header.shape[d], &count)) {
      fail(name, "element count of shape " + header.shape.str() + " overflows");
    }
  }
  int64_t bytes_needed = 0;
  if (__builtin_mul_overflow(count, static_cast<int64_t>(dtype_size(header.dtype)),
                             &bytes_needed)) {
    fail(name, "byte size of shape " + header.shape.str() + " " + dtype_name(header.dtype) +
                   " overflows");
  }
  header.data_bytes = static_cast<uint64_t>(bytes_needed);
  return header;
}

void check_data_size(const NpyHeader& header, uint64_t bytes_available, const std::string& name) {
  if (header.data_bytes > bytes_available) {
    fail(name, "truncated data: expected " + std::to_string(header.data_bytes) + " bytes, found " +
                   std::to_string(bytes_available));
  }
}

// Allocates the tensor, naming the file if that fails.
Tensor allocate(const NpyHeader& header, const std::string& name) {
  try {
    return Tensor(header.dtype, header.shape);
  } catch (const Error& e) {
    fail(name, e.what());
  }
}

// A C-contiguous tensor from `header.data_bytes` bytes at `data` (any alignment).
Tensor tensor_from_data(const NpyHeader& header, const void* data, const std::string& name) {
  Tensor tensor = allocate(header, name);
  if (header.data_bytes == 0) return tensor;
  if (!header.fortran_order || header.shape.rank() <= 1) {
    std::memcpy(tensor.data(), data, header.data_bytes);
    return tensor;
  }
  // Fortran order: element (i0, ..., in) sits at i0 + d0·(i1 + d1·(...)); read it through a
  // view with column-major strides and copy into row-major order.
  Shape fortran_strides = header.shape;
  int64_t stride = 1;
  for (int d = 0; d < header.shape.rank(); ++d) {
    fortran_strides[d] = stride;
    stride *= header.shape[d];
  }
  const TensorView source(const_cast<void*>(data), header.dtype, header.shape, fortran_strides);
  convert(source, tensor.view());
  return tensor;
}

// ---------------------------------------------------------------------------------------
// File helpers

// Closes a file descriptor when it goes out of scope.
struct FileDescriptor {
  int fd = -1;
  explicit FileDescriptor(int fd) : fd(fd) {}
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
};

// Reads up to `size` bytes; returns how many were read (fewer only at end of file).
size_t read_fully(int fd, void* buffer, size_t size, const std::string& name) {
  constexpr size_t kMaxChunk = size_t{1} << 30;
  size_t done = 0;
  while (done < size) {
    const size_t chunk = std::min(size - done, kMaxChunk);
    const ssize_t got = ::read(fd, static_cast<char*>(buffer) + done, chunk);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(name, "read error: " + system_error_text(errno));
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

// A pipe or other stream: read everything, then parse in memory.
Tensor read_stream(int fd, const std::string& name) {
  std::vector<unsigned char> bytes;
  unsigned char chunk[65536];
  while (true) {
    const size_t got = read_fully(fd, chunk, sizeof(chunk), name);
    bytes.insert(bytes.end(), chunk, chunk + got);
    if (got < sizeof(chunk)) break;
  }
  return parse_npy(bytes.data(), bytes.size(), name);
}

// ---------------------------------------------------------------------------------------
// Writing

const char* descr_of(DType dtype, const std::string& name) {
  const char* descr = detail::visit_dtype(dtype, [](auto row) { return row.npy_descr; });
  if (descr != nullptr) return descr;
  fail(name, std::string("dtype ") + dtype_name(dtype) +
                 " has no .npy equivalent; convert it to float32 first");
}

// Magic, version, header length and the padded header, ready to be followed by the data.
std::string npy_preamble(const TensorView& view, const std::string& name) {
  std::string dict = std::string("{'descr': '") + descr_of(view.dtype, name) +
                     "', 'fortran_order': False, 'shape': " + view.shape.str() + ", }";
  // Version 1 stores the header length in 2 bytes; longer headers need version 2.
  const size_t unpadded_v1 = kVersion1Prefix + dict.size() + 1;
  const bool version2 =
      (unpadded_v1 + kDataAlignment - 1) / kDataAlignment * kDataAlignment - kVersion1Prefix >
      std::numeric_limits<uint16_t>::max();
  const size_t prefix = version2 ? kVersion2Prefix : kVersion1Prefix;
  const size_t unpadded = prefix + dict.size() + 1;
  const size_t total = (unpadded + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
  dict.append(total - unpadded, ' ');
  dict.push_back('\n');
  const size_t header_length = dict.size();

  std::string preamble(kMagic);
  preamble.push_back(static_cast<char>(version2 ? 2 : 1));
  preamble.push_back(0);
  for (size_t i = 0; i < (version2 ? 4u : 2u); ++i) {
    preamble.push_back(static_cast<char>((header_length >> (8 * i)) & 0xFF));
  }
  return preamble + dict;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Public functions

Tensor parse_npy(const void* data, size_t size, const std::string& name_for_messages) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (bytes == nullptr && size > 0) fail(name_for_messages, "null buffer");
  const size_t data_offset =
      find_data_offset(bytes, std::min(size, kVersion2Prefix), size, name_for_messages);
  const NpyHeader header = parse_header(bytes, data_offset, name_for_messages);
  check_data_size(header, size - data_offset, name_for_messages);
  return tensor_from_data(header, bytes + data_offset, name_for_messages);
}

Tensor read_npy(const std::string& path) {
  const FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (file.fd < 0) fail(path, "cannot open: " + system_error_text(errno));
  struct stat status {};
  if (::fstat(file.fd, &status) != 0) fail(path, "cannot stat: " + system_error_text(errno));
  if (S_ISDIR(status.st_mode)) fail(path, "is a directory, not a .npy file");
  if (!S_ISREG(status.st_mode)) return read_stream(file.fd, path);

  // 1. The fixed prefix, then the whole header, sized against the file.
  const auto file_size = static_cast<uint64_t>(status.st_size);
  unsigned char prefix[kVersion2Prefix];
  const size_t prefix_size = read_fully(file.fd, prefix, sizeof(prefix), path);
  const size_t data_offset = find_data_offset(prefix, prefix_size, file_size, path);
  std::vector<unsigned char> header_bytes(data_offset);
  std::memcpy(header_bytes.data(), prefix, std::min(prefix_size, data_offset));
  if (data_offset > prefix_size) {
    const size_t rest = data_offset - prefix_size;
    if (read_fully(file.fd, header_bytes.data() + prefix_size, rest, path) != rest) {
      fail(path, "file shrank while being read");
    }
  }
  const NpyHeader header = parse_header(header_bytes.data(), data_offset, path);

  // 2. The data, checked against the file size before allocating.
  check_data_size(header, file_size - data_offset, path);
  Tensor raw = allocate(header, path);
  const size_t got = read_fully(file.fd, raw.data(), header.data_bytes, path);
  if (got != header.data_bytes) check_data_size(header, got, path);
  if (!header.fortran_order || header.shape.rank() <= 1) return raw;
  return tensor_from_data(header, raw.data(), path);
}

StagedNpyFile::StagedNpyFile(const std::string& path, const TensorView& view) : path_(path) {
  if (path.empty()) throw Error("write_npy: empty output path");
  if (view.strides.rank() != view.shape.rank()) {
    fail(path, "strides " + view.strides.str() + " do not match shape " + view.shape.str());
  }
  int64_t count = 1;
  for (int d = 0; d < view.rank(); ++d) {
    if (view.shape[d] < 0 || view.strides[d] < 0 ||
        __builtin_mul_overflow(count, view.shape[d], &count)) {
      fail(path, "invalid shape " + view.shape.str() + " or strides " + view.strides.str());
    }
  }
  if (view.data == nullptr && count > 0) fail(path, "data pointer is null");
  const std::string preamble = npy_preamble(view, path);

  // Contiguous data is written in place; anything else through a C-order copy.
  std::optional<Tensor> contiguous_copy;
  const void* data = view.data;
  if (count > 0 && !view.is_contiguous()) {
    contiguous_copy.emplace(Tensor::copy_of(view));
    data = contiguous_copy->data();
  }
  const size_t data_bytes = static_cast<size_t>(count) * dtype_size(view.dtype);

  file_ = std::make_unique<detail::StagedFile>(path);
  file_->write(preamble);
  if (data_bytes > 0) file_->write(data, data_bytes);
  file_->flush();
}

StagedNpyFile::~StagedNpyFile() = default;

void StagedNpyFile::commit() { file_->commit(); }

void write_npy(const std::string& path, const TensorView& view) {
  StagedNpyFile staged(path, view);
  staged.commit();
}

}  // namespace attend
