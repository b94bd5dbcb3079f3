// info_command.hpp: `attend info`, what this build and this machine offer.
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `info` subcommand to `app`.
Command add_info_command(CLI::App& app);

}  // namespace attend::cli
