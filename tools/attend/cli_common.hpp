// cli_common.hpp: what every subcommand of the attend CLI shares: how a subcommand is
// registered, reading inputs, number parsing, all-or-nothing output writing, error lines.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attend/tensor.hpp"

namespace attend::cli {

// Exit status of a failed command (bad input, unreadable file, refused options).
inline constexpr int kExitError = 2;

// A subcommand: its CLI11 App (options bound to state owned by `run`) and what to do when it
// was chosen. `run` throws (attend::Error or any std::exception) to report a problem; it must
// not write any output file before everything that can fail has been checked.
struct Command {
  CLI::App* subcommand = nullptr;
  std::function<void()> run;
};

// "error: " + the message on one line (newlines become "; ") to stderr, every byte outside
// printable ASCII written \xNN: a message may hold what the user typed (paths, CLI11's
// messages about options) or a file's bytes, and none of it may reach the terminal raw.
void print_error(const std::string& message);

// Reads the .npy file `path` given to `option`; errors read "--query Q.npy: truncated ...".
Tensor read_input(const std::string& option, const std::string& path);

// The whole of `text` as a number (strtod syntax); throws naming `option` otherwise.
double parse_number(const std::string& option, const std::string& text);

// The whole of `text` as a decimal integer in [minimum, maximum]; throws naming `option`.
uint64_t parse_integer(const std::string& option, const std::string& text, uint64_t minimum,
                       uint64_t maximum);

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

}  // namespace attend::cli
