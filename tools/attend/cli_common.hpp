// cli_common.hpp: what every subcommand of the attend CLI shares: how a subcommand is
// registered, --threads, reading inputs, number parsing and error lines (support/arguments.hpp),
// all-or-nothing output writing and the "wrote ..." line.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "attend/tensor.hpp"

namespace attend::cli {

// The checked parsing the examples use too (support/arguments.hpp).
using support::parse_integer;
using support::parse_number;
using support::print_error;

// Exit status of a failed command (bad input, unreadable file, refused options).
inline constexpr int kExitError = support::kExitBadInput;

// Far above any core count; keeps the value an int.
inline constexpr uint64_t kMaxThreads = 1 << 16;

// --threads INT, the same in every subcommand; `when_absent` says in the help what its absence
// means ("all", "1 per rank").
void add_threads_option(CLI::App& command, std::string& text, const std::string& when_absent);

// The value of --threads in [1, kMaxThreads] when `command` was given it, else `when_absent`
// (0: the library's default, every core this process may use).
int threads_from(const CLI::App& command, const std::string& text, int when_absent);

// A subcommand: its CLI11 App (options bound to state owned by `run`) and what to do when it
// was chosen. `run` throws (attend::Error or any std::exception) to report a problem; it must
// not write any output file before everything that can fail has been checked.
struct Command {
  CLI::App* subcommand = nullptr;
  std::function<void()> run;
};

// Reads the .npy file `path` given to `option`; errors read "--query Q.npy: truncated ...".
Tensor read_input(const std::string& option, const std::string& path);

// Fails early, before any work, when `path` (given to `option`) cannot be an output file:
// its directory is missing or it is itself a directory. The write itself checks again.
void check_output_path(const std::string& option, const std::string& path);

// One file to write.
struct OutputFile {
  std::string option;  // "--out", for messages
  std::string path;
  TensorView contents;
};

// Writes every file or none (.npy, through StagedNpyFile): each goes to a temporary file
// first; the renames happen only after all of them were written and flushed. Refuses two
// outputs naming the same path.
void write_outputs(const std::vector<OutputFile>& files);

// "O.npy (2, 5, 64) float32"
std::string describe(const std::string& path, const TensorView& contents);

// What a command wrote, for its last line on stdout: "wrote A", "wrote A and B",
// "wrote A, B and C" (each item a path or describe()'s text).
std::string wrote(const std::vector<std::string>& items);
// The same for .npy outputs: "wrote O.npy (2, 5, 3) float32 and W.npy (2, 5, 7) float32".
std::string wrote(const std::vector<OutputFile>& files);

}  // namespace attend::cli
