// train_reverse: trains a small attention model to reverse sequences of 8 tokens, on the CPU,
// in about a second, and plots its loss and accuracy.
//
//   ids (N, L) -> token embedding + sinusoidal positions -> self-attention + residual
//              -> linear head -> softmax cross-entropy against the reversed ids
//
// The forward and backward passes of the embedding, the residual, the head and the loss, and
// the Adam optimizer, are in examples/reverse_task/train_reverse.cpp (shared with `attend
// train-demo`); the attention's forward and backward come from the library
// (MultiHeadAttention::forward with a MultiHeadTape, then MultiHeadAttention::backward).
//
// Run: ./build/examples/train_reverse [curves.svg]
#include "train_reverse.hpp"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>

#include "arguments.hpp"
#include "attend/attend.hpp"
#include "staged_text_file.hpp"
#include "training_curves.hpp"

int main(int argc, char** argv) {
  CLI::App app("train_reverse: trains a small attention model to reverse token sequences",
               "train_reverse");
  std::string svg_path = "train_reverse.svg";
  app.add_option("SVG", svg_path, "where to write the curves (default train_reverse.svg)")
      ->type_name("FILE");
  return attend::support::run_checked(app, argc, argv, [&] {
    attend::examples::ReverseTaskSettings settings;  // V = 10, L = 8, E = 32, 4 heads, 1 layer
    settings.seed = 1;

    attend::examples::ReverseModel model(settings);
    const attend::examples::TrainingHistory history =
        attend::examples::train_reverse(model, &std::cout);
    if (history.solved_at_step > 0) {
      std::printf("Every held-out sequence reversed after %lld steps (%.1f s).\n",
                  static_cast<long long>(history.solved_at_step), history.seconds);
    } else {
      std::printf("Not solved within %lld steps.\n", static_cast<long long>(settings.max_steps));
    }
    std::cout << "New random sequences (not from the training stream):\n";
    attend::examples::print_reversal_examples(model, 4, std::cout);

    attend::support::StagedTextFile("svg", svg_path,
                                    attend::examples::training_curves_svg(settings, history))
        .commit();
    std::printf("Wrote %s\n", svg_path.c_str());
    return history.solved_at_step > 0 ? 0 : 1;
  });
}
