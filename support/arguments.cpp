// arguments.cpp: checked numbers, error lines, suggestions and the progress-bar rule shared by
// the attend CLI and the examples.
#include "arguments.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <new>

#include "attend/error.hpp"
#include "quote.hpp"

namespace attend::support {
namespace {

// Edit distance with adjacent transpositions counted as one edit ("casual" -> "causal": 1).
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const size_t substitute = d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, substitute});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

// "--casual" of "--casual=1"; "" for what is not an option (values, negative numbers).
std::string option_word(const std::string& token) {
  if (token.size() < 2 || token[0] != '-') return "";
  if (token[1] != '-' && (std::isdigit(static_cast<unsigned char>(token[1])) || token[1] == '.')) {
    return "";  // -1, -0.5: a value
  }
  if (token == "--") return "";
  return token.substr(0, token.find('='));
}

// Every spelling of every option of `command` ("--causal", "-h").
std::vector<std::string> option_names(const CLI::App& command) {
  std::vector<std::string> names;
  for (const CLI::Option* option : command.get_options()) {
    for (const std::string& name : option->get_lnames()) names.push_back("--" + name);
    for (const std::string& name : option->get_snames()) names.push_back("-" + name);
  }
  return names;
}

bool known_option(const CLI::App* command, const std::string& word) {
  for (; command != nullptr; command = command->get_parent()) {
    if (command->get_option_no_throw(word) != nullptr) return true;
  }
  return false;
}

// "attend sdpa": the command's name after its parents'.
std::string command_path(const CLI::App& command) {
  std::string path = command.get_name();
  for (const CLI::App* parent = command.get_parent(); parent != nullptr;
       parent = parent->get_parent()) {
    path = parent->get_name() + " " + path;
  }
  return path;
}

}  // namespace

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

std::string nearest_name(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  size_t best_distance = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& name : names) {
    const size_t distance = edit_distance(word, name);
    if (distance < best_distance) {
      best = name;
      best_distance = distance;
    }
  }
  return best;
}

std::string parse_error_message(const CLI::App& app, const CLI::ParseError& error, int argc,
                                const char* const* argv, const RetiredOptions& retired) {
  // The command the options were for: the last subcommand parsed, or the program itself.
  const CLI::App* command = &app;
  for (std::vector<const CLI::App*> parsed = app.get_subcommands({}); !parsed.empty();) {
    const auto chosen = std::find_if(parsed.begin(), parsed.end(),
                                     [](const CLI::App* sub) { return sub->parsed(); });
    if (chosen == parsed.end()) break;
    command = *chosen;
    parsed = command->get_subcommands({});
  }
  const std::string key = command == &app ? "" : command->get_name();
  // The first word that is no option of the command: an unknown option says more than any
  // "--query is required" that CLI11 may have reported first.
  for (int i = 1; i < argc && argv[i] != nullptr; ++i) {
    const std::string word = option_word(argv[i]);
    if (word.empty() || known_option(command, word)) continue;
    if (const auto in_command = retired.find(key); in_command != retired.end()) {
      if (const auto found = in_command->second.find(word); found != in_command->second.end()) {
        return found->second;
      }
    }
    const std::string path = command_path(*command);
    std::string message = "unknown option " +
                          detail::printable_for_message(word, detail::kMaxQuotedBytes) + " for `" +
                          path + "`";
    const std::string nearest = nearest_name(word, option_names(*command));
    if (!nearest.empty()) message += "; did you mean " + nearest + "?";
    return message + " (all options: `" + path + " --help`)";
  }
  return error.what();
}

int run_checked(CLI::App& app, int argc, char** argv, const std::function<int()>& body) {
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::Success& e) {  // --help
      return app.exit(e);
    } catch (const CLI::ParseError& e) {
      print_error(parse_error_message(app, e, argc, argv));
      return kExitBadInput;
    }
    return body();
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
  } catch (const std::exception& e) {
    print_error(e.what());
  }
  return kExitBadInput;
}

void add_progress_options(CLI::App& command, ProgressChoice& choice,
                          const std::string& quiet_help) {
  CLI::Option* progress = command.add_flag(
      "--progress", choice.progress,
      "draw the progress bar on stderr even when it is not a terminal (default: only on one)");
  command.add_flag("--quiet", choice.quiet, quiet_help)->excludes(progress);
}

bool draw_progress(const ProgressChoice& choice) {
  if (choice.progress) return true;
  return !choice.quiet && ::isatty(STDERR_FILENO) == 1;
}

}  // namespace attend::support
