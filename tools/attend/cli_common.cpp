// cli_common.cpp: helpers shared by the attend subcommands.
#include "cli_common.hpp"

#include <filesystem>
#include <memory>

#include "attend/error.hpp"
#include "attend/npy.hpp"

namespace attend::cli {

namespace fs = std::filesystem;

void add_threads_option(CLI::App& command, std::string& text, const std::string& when_absent) {
  command
      .add_option("--threads", text,
                  "threads to use, 1 to " + std::to_string(kMaxThreads) + " (default " +
                      when_absent + "); results are the same bits at any count")
      ->type_name("INT");
}

int threads_from(const CLI::App& command, const std::string& text, int when_absent) {
  if (command.count("--threads") == 0) return when_absent;
  return static_cast<int>(parse_integer("--threads", text, 1, kMaxThreads));
}

Tensor read_input(const std::string& option, const std::string& path) {
  try {
    return read_npy(path);
  } catch (const Error& e) {
    throw Error(option + " " + e.what());
  }
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

std::string wrote(const std::vector<std::string>& items) {
  std::string summary = "wrote ";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) summary += i + 1 == items.size() ? " and " : ", ";
    summary += items[i];
  }
  return summary;
}

std::string wrote(const std::vector<OutputFile>& files) {
  std::vector<std::string> items;
  for (const OutputFile& file : files) items.push_back(describe(file.path, file.contents));
  return wrote(items);
}

}  // namespace attend::cli
