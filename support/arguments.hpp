// arguments.hpp: the checked command-line parsing that the attend CLI and the examples share:
// numbers read whole and range-checked, one "error: ..." line and exit status 2 for bad input,
// suggestions for misspelt options, and whether a progress bar may be drawn.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace attend::support {

// Exit status of a program given bad input (an unknown option, a malformed number, an
// unreadable file, refused options).
inline constexpr int kExitBadInput = 2;

// "error: " + the message on one line (newlines become "; ") to stderr, every byte outside
// printable ASCII written \xNN: a message may hold what the user typed (paths, CLI11's
// messages about options) or a file's bytes, and none of it may reach the terminal raw.
void print_error(const std::string& message);

// The whole of `text` as a number (strtod syntax); throws attend::Error naming `option`
// otherwise.
double parse_number(const std::string& option, const std::string& text);

// The whole of `text` as a decimal integer in [minimum, maximum]; throws attend::Error naming
// `option` otherwise ("--steps must be in [1, 100000], got 0").
uint64_t parse_integer(const std::string& option, const std::string& text, uint64_t minimum,
                       uint64_t maximum);

// Options a program no longer takes, by the command that took them ("" for the program
// itself, "sdpa" for `attend sdpa`): the message that replaces CLI11's "not expected".
using RetiredOptions = std::map<std::string, std::map<std::string, std::string>>;

// What to tell the user about a failed parse of `app` (argv as given to it): CLI11's message,
// except that an unknown option or subcommand is named with the nearest known one ("unknown
// option --casual for `attend sdpa`; did you mean --causal?"), and a retired option gets its
// message from `retired`.
std::string parse_error_message(const CLI::App& app, const CLI::ParseError& error, int argc,
                                const char* const* argv, const RetiredOptions& retired = {});

// The known name closest to `word` within an edit distance of 2 (or a third of its length,
// the larger), or "" when none is that close.
std::string nearest_name(const std::string& word, const std::vector<std::string>& names);

// main() of a program with arguments: parses `app` (--help prints the help and returns 0),
// then runs `body`. Bad arguments and any exception `body` throws print one "error: " line and
// give kExitBadInput; otherwise `body`'s status is returned.
int run_checked(CLI::App& app, int argc, char** argv, const std::function<int()>& body);

// Whether to draw a progress bar on stderr: --progress forces it, --quiet turns it off, and
// otherwise only a terminal gets one (a log file would fill with carriage returns).
struct ProgressChoice {
  bool progress = false;  // --progress
  bool quiet = false;     // --quiet
};
void add_progress_options(CLI::App& command, ProgressChoice& choice, const std::string& quiet_help);
bool draw_progress(const ProgressChoice& choice);

}  // namespace attend::support
