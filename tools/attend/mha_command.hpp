// mha_command.hpp: `attend mha`, multi-head attention with PyTorch weights on .npy files.
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `mha` subcommand to `app`.
Command add_mha_command(CLI::App& app);

}  // namespace attend::cli
