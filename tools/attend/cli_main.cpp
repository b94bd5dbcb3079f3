// cli_main.cpp: the attend command line: the CLI11 app, the list of subcommands and the one
// place where errors become "error: ..." on stderr and exit status 2.
//
// To add a subcommand: write <name>_command.{hpp,cpp} with `Command add_<name>_command(
// CLI::App&)` (see sdpa_command.cpp), add the .cpp to CMakeLists.txt and one line to
// `commands` below.
#include "cli_main.hpp"

#include <CLI/CLI.hpp>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "attend/runtime.hpp"
#include "bench_command.hpp"
#include "cli_common.hpp"
#include "demo_command.hpp"
#include "info_command.hpp"
#include "mha_command.hpp"
#include "quote.hpp"
#include "sdpa_command.hpp"
#include "serve_bench_command.hpp"
#ifdef ATTEND_HAVE_MPI
#include "ring_command.hpp"
#endif
#include "train_demo_command.hpp"

using attend::cli::Command;
using attend::cli::kExitError;
using attend::cli::print_error;

namespace {

// Options renamed since: the message that replaces "unknown option".
const attend::support::RetiredOptions kRetiredOptions = {
    {"sdpa",
     {{"--weights",
       "--weights is now --out-weights (the attention weights to write), the name every "
       "subcommand uses; `attend mha --weights` reads a module's parameters"}}},
    {"mha",
     {{"--attn-weights",
       "--attn-weights is now --out-weights (the attention weights to write), the name every "
       "subcommand uses"}}},
};

// What to say when no subcommand was recognised: CLI11 reports only "A subcommand is
// required", even when the first word is a misspelt one.
std::string missing_subcommand_message(const CLI::App& app, int argc, char** argv,
                                       const CLI::ParseError& error) {
  std::string names;
  std::vector<std::string> known;
  for (const CLI::App* subcommand : app.get_subcommands({})) {
    names += (names.empty() ? "" : ", ") + subcommand->get_name();
    known.push_back(subcommand->get_name());
  }
  if (argc > 1 && argv[1] != nullptr && argv[1][0] != '-') {
    const std::string nearest = attend::support::nearest_name(argv[1], known);
    return "unknown subcommand " + attend::detail::quote_for_message(argv[1]) +
           (nearest.empty() ? "" : "; did you mean " + nearest + "?") + " (available: " + names +
           ")";
  }
  if (argc <= 1) return "a subcommand is required (" + names + "); see attend --help";
  return attend::support::parse_error_message(app, error, argc, argv);
}

}  // namespace

int attend_cli_main(int argc, char** argv) {
  // A caller (a fuzzer) may pass no arguments at all, not even the program name.
  char program_name[] = "attend";
  char* no_arguments[] = {program_name, nullptr};
  if (argc < 1 || argv == nullptr) {
    argc = 1;
    argv = no_arguments;
  }
  try {
    CLI::App app("attend: scaled dot-product attention on the CPU", "attend");
    app.set_version_flag("--version", std::string("attend ") + attend::version());
    app.require_subcommand(1);
    // clang-format off
    const std::vector<Command> commands = {
        attend::cli::add_info_command(app),
        attend::cli::add_sdpa_command(app),
        attend::cli::add_bench_command(app),
        attend::cli::add_demo_command(app),
        attend::cli::add_mha_command(app),
        attend::cli::add_train_demo_command(app),
        attend::cli::add_serve_bench_command(app),
#ifdef ATTEND_HAVE_MPI
        attend::cli::add_ring_command(app),
#endif
    };
    // clang-format on
    try {
      app.parse(argc, argv);
    } catch (const CLI::Success& e) {  // --help, --version
      return app.exit(e);
    } catch (const CLI::ParseError& e) {
      print_error(app.get_subcommands().empty()
                      ? missing_subcommand_message(app, argc, argv, e)
                      : attend::support::parse_error_message(app, e, argc, argv, kRetiredOptions));
      return kExitError;
    }
    for (const Command& command : commands) {
      if (command.subcommand->parsed()) command.run();
    }
    return 0;
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
  } catch (const std::exception& e) {
    print_error(e.what());
  } catch (...) {
    print_error("unknown internal error");
  }
  return kExitError;
}
