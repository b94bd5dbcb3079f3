// train_demo_command.hpp: `attend train-demo`, a small attention model trained end to end to
// reverse token sequences, with its loss curve printed and plotted.
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `train-demo` subcommand to `app`.
Command add_train_demo_command(CLI::App& app);

}  // namespace attend::cli
