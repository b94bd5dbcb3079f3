// serve_bench_command.hpp: `attend serve-bench`, a synthetic continuous-batching load on the
// paged KV cache (the tiny decoder of examples/tiny_decoder).
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.hpp"

namespace attend::cli {

// Adds the `serve-bench` subcommand to `app`.
Command add_serve_bench_command(CLI::App& app);

}  // namespace attend::cli
