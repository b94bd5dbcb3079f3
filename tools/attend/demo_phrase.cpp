// demo_phrase.cpp: scene 1 of `attend demo` (demo_scenes.hpp), self-attention over a phrase.
#include "demo_scenes.hpp"

#include <string>
#include <vector>

#include "attend/multihead.hpp"
#include "attend/positional.hpp"
#include "demo_common.hpp"

namespace attend::cli {
using namespace demo;

DemoPicture run_phrase_scene(const DemoSettings& settings, std::ostream& out) {
  const std::vector<std::string> tokens = {"How", "are", "you", "?"};
  out << "1. Self-attention over a phrase\n";
  const TokenEmbedding table(static_cast<int64_t>(vocabulary().size()), kTextDim, kSeed);
  const Tensor x = embed(table, tokens);
  out << "   tokens " << joined(tokens) << " -> embeddings + sinusoidal positions "
      << x.shape().str() << "\n";
  const MultiHeadAttention attention(kTextDim, kTextHeads, {}, kSeed + 1);
  MultiHeadForwardOptions options;
  options.need_weights = true;
  options.average_weights_over_heads = false;
  options.num_threads = settings.num_threads;
  // The first call starts the thread pool and touches fresh pages: time the second.
  (void)attention.forward(x.view(), x.view(), x.view(), options);
  const Stopwatch stopwatch;
  const MultiHeadResult result = attention.forward(x.view(), x.view(), x.view(), options);
  const double elapsed = stopwatch.milliseconds();
  out << formatted(
      "   MultiHeadAttention(256, 8 heads of 32): Q, K, V (1, 8, 4, 32) each; "
      "output %s, weights %s in %s (second call)\n",
      result.output.shape().str().c_str(), result.weights.shape().str().c_str(),
      milliseconds_text(elapsed).c_str());
  out << "   per head, each query's most attended key and weight:\n";
  print_head_summaries(out, result.weights, tokens, tokens, static_cast<int64_t>(tokens.size()));
  return {"phrase_self_attention.svg",
          per_head_figure("Self-attention over \"How are you?\"",
                          "MultiHeadAttention(256, 8 heads of 32) on token embeddings + "
                          "sinusoidal positional encoding (4 x 256)",
                          result.weights, tokens, tokens)};
}

}  // namespace attend::cli
