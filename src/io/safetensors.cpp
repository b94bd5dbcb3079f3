// safetensors.cpp: the safetensors reader and writer (format in attend/safetensors.hpp).
//
// The reader validates the whole header (length, JSON, every entry) before it allocates or
// copies any tensor, so a malformed file costs no more than its header.
#include "attend/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <system_error>
#include <vector>

#include "attend/error.hpp"
#include "io/staged_file.hpp"
#include "quote.hpp"

namespace attend {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping");

// The reference implementation refuses headers over 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// A JSON value quoted in a message is cut beyond this; a shape of 8 twenty-digit dimensions
// fits.
constexpr size_t kMaxJsonBytes = 256;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::kFloat64, "F64"},   {DType::kFloat32, "F32"}, {DType::kFloat16, "F16"},
    {DType::kBFloat16, "BF16"}, {DType::kInt64, "I64"},   {DType::kInt32, "I32"},
    {DType::kInt16, "I16"},     {DType::kInt8, "I8"},     {DType::kUInt64, "U64"},
    {DType::kUInt32, "U32"},    {DType::kUInt16, "U16"},  {DType::kUInt8, "U8"},
    {DType::kBool, "BOOL"},
};

// One validated header entry.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;  // byte offsets into the data section
};

uint64_t read_u64_le(const unsigned char* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

// Throws `file: tensor 'name': what`; `file` is already printable.
[[noreturn]] void entry_error(const std::string& file, const std::string& name,
                              const std::string& what) {
  throw Error(file + ": tensor " + detail::quote_for_message(name) + ": " + what);
}

// A JSON value from the header as a message shows it: ASCII (\u escapes), cut when long.
std::string json_for_message(const nlohmann::json& value) {
  return detail::printable_for_message(value.dump(-1, ' ', /*ensure_ascii=*/true), kMaxJsonBytes);
}

Entry parse_entry(const std::string& file, const std::string& name, const nlohmann::json& value,
                  uint64_t data_size) {
  if (!value.is_object()) entry_error(file, name, "header entry is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) entry_error(file, name, std::string("missing \"") + field + "\"");
  }
  const auto& dtype = value["dtype"];
  if (!dtype.is_string()) entry_error(file, name, "\"dtype\" is not a string");
  Entry entry{name, DType::kFloat32, Shape(), 0, 0};
  try {
    entry.dtype = dtype_from_safetensors_name(dtype.get<std::string>());
  } catch (const Error& error) {
    entry_error(file, name, error.what());
  }

  const auto& shape = value["shape"];
  if (!shape.is_array()) entry_error(file, name, "\"shape\" is not an array");
  if (shape.size() > static_cast<size_t>(Shape::kMaxRank)) {
    entry_error(file, name,
                "rank " + std::to_string(shape.size()) + " exceeds the maximum " +
                    std::to_string(Shape::kMaxRank));
  }
  uint64_t bytes = dtype_size(entry.dtype);
  for (const auto& dim : shape) {
    if (!dim.is_number_unsigned()) {
      entry_error(file, name,
                  "\"shape\" " + json_for_message(shape) + " holds a non-integer or negative");
    }
    const auto d = dim.get<uint64_t>();
    if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        (d != 0 && bytes > std::numeric_limits<uint64_t>::max() / d)) {
      entry_error(file, name, "\"shape\" " + json_for_message(shape) + " overflows");
    }
    bytes *= d;
    entry.shape.push_back(static_cast<int64_t>(d));
  }

  const auto& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    entry_error(file, name,
                "\"data_offsets\" " + json_for_message(offsets) + " is not [begin, end]");
  }
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.begin > entry.end || entry.end > data_size) {
    entry_error(file, name,
                "data_offsets [" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) +
                    "] outside the data section of " + std::to_string(data_size) + " bytes");
  }
  if (entry.end - entry.begin != bytes) {
    entry_error(file, name,
                "data_offsets [" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) +
                    "] hold " + std::to_string(entry.end - entry.begin) + " bytes, but shape " +
                    entry.shape.str() + " of " + dtype_name(entry.dtype) + " needs " +
                    std::to_string(bytes));
  }
  return entry;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& entry : kDTypeNames) {
    if (entry.dtype == dtype) return entry.name;
  }
  throw Error(std::string("dtype ") + dtype_name(dtype) + " has no safetensors name");
}

DType dtype_from_safetensors_name(const std::string& name) {
  for (const auto& entry : kDTypeNames) {
    if (name == entry.name) return entry.dtype;
  }
  throw Error("unknown safetensors dtype " + detail::quote_for_message(name));
}

SafetensorsContents parse_safetensors(const void* data, size_t size,
                                      const std::string& name_for_messages) {
  const std::string file = detail::printable_for_message(name_for_messages);
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (size < 8) {
    throw Error(file + ": " + std::to_string(size) +
                " bytes is too short for the 8-byte header length");
  }
  const uint64_t header_size = read_u64_le(bytes);
  if (header_size > size - 8) {
    throw Error(file + ": header length " + std::to_string(header_size) + " runs past the end (" +
                std::to_string(size) + " bytes in all)");
  }
  if (header_size > kMaxHeaderBytes) {
    throw Error(file + ": header length " + std::to_string(header_size) + " exceeds " +
                std::to_string(kMaxHeaderBytes) + " bytes");
  }
  const uint64_t data_size = size - 8 - header_size;
  const unsigned char* data_section = bytes + 8 + header_size;

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_size);
  } catch (const nlohmann::json::exception& error) {
    throw Error(file +
                ": header is not valid JSON: " + detail::printable_for_message(error.what()));
  }
  if (!header.is_object()) throw Error(file + ": header is not a JSON object");

  SafetensorsContents contents;
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw Error(file + ": \"__metadata__\" is not a JSON object");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) {
          throw Error(file + ": \"__metadata__\" value of " + detail::quote_for_message(key) +
                      " is not a string");
        }
        contents.metadata[key] = text.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(file, name, value, data_size));
  }
  // No two tensors may share bytes (empty tensors occupy nothing).
  std::vector<const Entry*> by_offset;
  for (const Entry& entry : entries) {
    if (entry.end > entry.begin) by_offset.push_back(&entry);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      throw Error(file + ": tensors " + detail::quote_for_message(by_offset[i - 1]->name) +
                  " and " + detail::quote_for_message(by_offset[i]->name) +
                  " overlap in the data section");
    }
  }

  for (const Entry& entry : entries) {
    Tensor tensor(entry.dtype, entry.shape);
    if (entry.end > entry.begin) {
      std::memcpy(tensor.data(), data_section + entry.begin, entry.end - entry.begin);
    }
    contents.tensors.emplace(entry.name, std::move(tensor));
  }
  return contents;
}

SafetensorsContents load_safetensors(const std::string& path) {
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored)) {
    throw Error(detail::printable_for_message(path) + ": is a directory, not a safetensors file");
  }
  errno = 0;
  std::ifstream stream(path, std::ios::binary);
  if (!stream) {  // the standard library's open(2) left its reason in errno
    const int error_number = errno;
    throw Error(detail::printable_for_message(path) + ": cannot open for reading: " +
                (error_number != 0 ? std::strerror(error_number) : "unknown reason"));
  }
  stream.seekg(0, std::ios::end);
  const std::streamoff file_size = stream.tellg();
  if (file_size < 0)
    throw Error(detail::printable_for_message(path) + ": cannot determine the file size");
  stream.seekg(0, std::ios::beg);
  std::vector<char> buffer(static_cast<size_t>(file_size));
  if (!buffer.empty() && !stream.read(buffer.data(), file_size)) {
    throw Error(detail::printable_for_message(path) + ": read failed");
  }
  return parse_safetensors(buffer.data(), buffer.size(), path);
}

void save_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // 1. Contiguous copies where needed, and the header with running offsets.
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<Tensor> copies;
  std::vector<const void*> sources;
  std::vector<size_t> sizes;
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    if (name == "__metadata__") {
      throw Error(detail::printable_for_message(path) +
                  ": '__metadata__' is reserved, not a tensor name");
    }
    const void* source = view.data;
    if (!view.is_contiguous()) {
      copies.push_back(Tensor::copy_of(view));
      source = copies.back().data();
    }
    const uint64_t bytes = static_cast<uint64_t>(view.numel()) * dtype_size(view.dtype);
    nlohmann::json entry;
    entry["dtype"] = safetensors_dtype_name(view.dtype);
    entry["shape"] = nlohmann::json::array();
    for (int d = 0; d < view.rank(); ++d) entry["shape"].push_back(view.shape[d]);
    entry["data_offsets"] = {offset, offset + bytes};
    header[name] = entry;
    sources.push_back(source);
    sizes.push_back(static_cast<size_t>(bytes));
    offset += bytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception&) {  // a name or metadata text not in UTF-8
    throw Error(detail::printable_for_message(path) +
                ": tensor names and metadata must be valid UTF-8");
  }
  // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i)
    length_bytes[i] = static_cast<unsigned char>(header_text.size() >> (8 * i));

  // 2. The file, whole or not at all.
  detail::StagedFile file(path);
  file.write(length_bytes, 8);
  file.write(header_text);
  for (size_t i = 0; i < sources.size(); ++i) file.write(sources[i], sizes[i]);
  file.commit();
}

}  // namespace attend
