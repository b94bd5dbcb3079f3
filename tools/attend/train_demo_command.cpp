// train_demo_command.cpp: `attend train-demo [--steps N] [--layers L] [--seed S] [--svg PATH]
// [--threads T] [--quiet]`.
//
// Checks every option and the SVG path first, trains (train_reverse.cpp), printing a line per
// evaluation unless --quiet, then writes the loss and accuracy curves atomically.
#include "train_demo_command.hpp"

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "staged_text_file.hpp"
#include "train_reverse.hpp"
#include "training_curves.hpp"

namespace attend::cli {
namespace {

// A run of this many steps takes hours; a larger --steps is surely a typo.
constexpr uint64_t kMaxSteps = 10'000'000;

struct TrainDemoArguments {
  std::string steps_text, layers_text, seed_text, threads_text;
  std::string svg_path = "train-demo.svg";
  bool quiet = false;
};

void run_train_demo(const TrainDemoArguments& arguments, const CLI::App& command) {
  examples::ReverseTaskSettings settings;
  if (!arguments.steps_text.empty()) {
    settings.max_steps =
        static_cast<int64_t>(parse_integer("--steps", arguments.steps_text, 1, kMaxSteps));
  }
  if (!arguments.layers_text.empty()) {
    settings.num_layers =
        static_cast<int64_t>(parse_integer("--layers", arguments.layers_text, 1, 4));
  }
  if (!arguments.seed_text.empty()) {
    settings.seed = parse_integer("--seed", arguments.seed_text, 0, UINT64_MAX);
  }
  settings.num_threads = threads_from(command, arguments.threads_text, settings.num_threads);
  check_output_path("--svg", arguments.svg_path);

  examples::ReverseModel model(settings);
  const examples::TrainingHistory history =
      examples::train_reverse(model, arguments.quiet ? nullptr : &std::cout);
  const examples::Evaluation& last = history.evaluations.back();
  char summary[256];
  if (history.solved_at_step > 0) {
    std::snprintf(summary, sizeof summary,
                  "Reversed all %lld held-out sequences at step %lld in %.1f s (training loss "
                  "%.3g -> %.3g).\n",
                  static_cast<long long>(settings.eval_batch_size),
                  static_cast<long long>(history.solved_at_step), history.seconds,
                  history.losses.front(), history.losses.back());
  } else {
    std::snprintf(summary, sizeof summary,
                  "Not solved within %lld steps (%.1f s): %.2f%% of held-out sequences and "
                  "%.2f%% of tokens right (training loss %.3g -> %.3g).\n",
                  static_cast<long long>(history.losses.size()), history.seconds,
                  100.0 * last.sequence_accuracy, 100.0 * last.token_accuracy,
                  history.losses.front(), history.losses.back());
  }
  std::cout << summary;
  if (!arguments.quiet) {
    std::cout << "New random sequences (not from the training stream):\n";
    examples::print_reversal_examples(model, 4, std::cout);
  }
  support::StagedTextFile("--svg", arguments.svg_path,
                          examples::training_curves_svg(settings, history))
      .commit();
  std::cout << wrote({arguments.svg_path}) << '\n';
}

}  // namespace

Command add_train_demo_command(CLI::App& app) {
  auto arguments = std::make_shared<TrainDemoArguments>();
  CLI::App* command = app.add_subcommand(
      "train-demo",
      "Train a small attention model (token embedding, sinusoidal positions, self-attention, "
      "linear head, Adam) to reverse token sequences; prints the loss and accuracy, writes "
      "the curves as SVG");
  command
      ->add_option("--steps", arguments->steps_text,
                   "most training steps; stops earlier at 100% held-out sequences "
                   "(default 2000)")
      ->type_name("INT");
  command
      ->add_option("--layers", arguments->layers_text, "self-attention layers, 1 to 4 (default 1)")
      ->type_name("INT");
  command
      ->add_option("--seed", arguments->seed_text,
                   "seed of the parameters and of every batch (default 1)")
      ->type_name("INT");
  command
      ->add_option("--svg", arguments->svg_path,
                   "where to write the loss and accuracy curves (default train-demo.svg)")
      ->type_name("FILE");
  add_threads_option(*command, arguments->threads_text, "1: the model is tiny");
  command->add_flag("--quiet", arguments->quiet, "print only the summary");
  return {command, [arguments, command] { run_train_demo(*arguments, *command); }};
}

}  // namespace attend::cli
