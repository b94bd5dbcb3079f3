// bench_command.hpp: `attend bench`, the named benchmark cases against their targets.
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `bench` subcommand to `app`.
Command add_bench_command(CLI::App& app);

}  // namespace attend::cli
