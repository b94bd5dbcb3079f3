// demo_command.hpp: `attend demo`, the main job: attention on a phrase, a U-Net feature map, a
// vision transformer's patches and a translation, with SVG pictures of the weights.
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `demo` subcommand to `app`.
Command add_demo_command(CLI::App& app);

}  // namespace attend::cli
