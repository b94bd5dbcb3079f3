// sdpa_command.hpp: `attend sdpa`, scaled dot-product attention on .npy files.
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `sdpa` subcommand to `app`.
Command add_sdpa_command(CLI::App& app);

}  // namespace attend::cli
