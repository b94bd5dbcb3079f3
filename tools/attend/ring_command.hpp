// ring_command.hpp: `attend ring`, attention with the sequence split over MPI ranks (built
// with attend_mpi only).
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `ring` subcommand to `app`.
Command add_ring_command(CLI::App& app);

}  // namespace attend::cli
