// cli_common.cpp: helpers shared by the attend subcommands.
#include "cli_common.hpp"

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>

#include "attend/error.hpp"
#include "attend/npy.hpp"
#include "quote.hpp"

namespace attend::cli {

namespace fs = std::filesystem;

void print_error(const std::string& message) {
  std::string line;
  for (char c : message) {
    if (c == '\n') {
      line += "; ";
    } else if (c != '\r') {
      line += c;
    }
  }
  while (!line.empty() && (line.back() == ' ' || line.back() == ';')) line.pop_back();
  std::cerr << "error: " << detail::printable_for_message(line, std::string::npos) << '\n'
            << std::flush;
}

Tensor read_input(const std::string& option, const std::string& path) {
  try {
    return read_npy(path);
  } catch (const Error& e) {
    throw Error(option + " " + e.what());
  }
}

double parse_number(const std::string& option, const std::string& text) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(begin, &end);
  if (text.empty() || end == begin || *end != '\0') {
    throw Error(option + ": " + detail::quote_for_message(text) + " is not a number");
  }
  if (errno == ERANGE && (value > 1 || value < -1)) {
    throw Error(option + ": " + detail::quote_for_message(text) + " is out of range");
  }
  return value;
}

uint64_t parse_integer(const std::string& option, const std::string& text, uint64_t minimum,
                       uint64_t maximum) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
    throw Error(option + ": " + detail::quote_for_message(text) + " is not a non-negative integer");
  }
  uint64_t value = 0;
  for (char digit : text) {
    if (__builtin_mul_overflow(value, 10, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(digit - '0'), &value)) {
      throw Error(option + ": " + detail::quote_for_message(text) + " is out of range");
    }
  }
  if (value < minimum || value > maximum) {
    throw Error(option + " must be in [" + std::to_string(minimum) + ", " +
                std::to_string(maximum) + "], got " + text);
  }
  return value;
}

void check_output_path(const std::string& option, const std::string& path) {
  if (path.empty()) throw Error(option + ": empty path");
  std::error_code error;
  if (fs::is_directory(path, error)) {
    throw Error(option + " " + path + ": is a directory; name the file to write");
  }
  const fs::path directory = fs::path(path).parent_path();
  if (!directory.empty() && !fs::is_directory(directory, error)) {
    throw Error(option + " " + path + ": cannot create file: directory '" + directory.string() +
                "' does not exist");
  }
}

void write_outputs(const std::vector<OutputFile>& files) {
  for (size_t i = 0; i < files.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (fs::path(files[i].path).lexically_normal() ==
          fs::path(files[j].path).lexically_normal()) {
        throw Error(files[j].option + " and " + files[i].option + " name the same file " +
                    files[i].path);
      }
    }
  }
  // 1. Write and flush every temporary file; any failure removes them all (destructors).
  std::vector<std::unique_ptr<StagedNpyFile>> staged;
  for (const OutputFile& file : files) {
    try {
      staged.push_back(std::make_unique<StagedNpyFile>(file.path, file.contents));
    } catch (const Error& e) {
      throw Error(file.option + " " + e.what());
    }
  }
  // 2. Rename them into place. A rename within one directory fails only in rare cases
  //    (e.g. the directory vanished); later files are then not renamed.
  for (size_t i = 0; i < staged.size(); ++i) {
    try {
      staged[i]->commit();
    } catch (const Error& e) {
      throw Error(files[i].option + " " + e.what());
    }
  }
}

std::string describe(const std::string& path, const TensorView& contents) {
  return path + " " + contents.shape.str() + " " + dtype_name(contents.dtype);
}

}  // namespace attend::cli
