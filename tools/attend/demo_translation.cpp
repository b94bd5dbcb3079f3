// demo_translation.cpp: scene 4 of `attend demo` (demo_scenes.hpp), encoder-decoder.
#include "demo_scenes.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attend/multihead.hpp"
#include "attend/positional.hpp"
#include "demo_common.hpp"

namespace attend::cli {
using namespace demo;

// --- 4. Encoder-decoder ------------------------------------------------------------------------

DemoPicture run_translation_scene(const DemoSettings& settings, std::ostream& out) {
  out << "4. Encoder-decoder: \"Wie geht es dir\" -> \"How are you\"\n";
  // The source is padded to 6 as in a batch of sentences; the mask (nonzero = real token)
  // keeps every query off the padding.
  const std::vector<std::string> source = {"Wie", "geht", "es", "dir", "<pad>", "<pad>"};
  const std::vector<std::string> target = {"<bos>", "How", "are", "you"};
  constexpr int64_t kRealSourceTokens = 4;
  const auto source_length = static_cast<int64_t>(source.size());
  const TokenEmbedding table(static_cast<int64_t>(vocabulary().size()), kTextDim, kSeed);
  Tensor source_mask(DType::kUInt8, Shape({1, source_length}));
  for (int64_t j = 0; j < source_length; ++j) {
    source_mask.data_as<uint8_t>()[j] = j < kRealSourceTokens ? 1 : 0;
  }
  const MultiHeadAttention encoder_self(kTextDim, kTextHeads, {}, kSeed + 5);
  const MultiHeadAttention decoder_self(kTextDim, kTextHeads, {}, kSeed + 6);
  const MultiHeadAttention cross(kTextDim, kTextHeads, {}, kSeed + 7);
  MultiHeadForwardOptions options;
  options.num_threads = settings.num_threads;
  options.need_weights = true;
  options.average_weights_over_heads = false;

  // Each block is one attention sub-layer with its residual (no feed-forward or LayerNorm:
  // they do not change what the attention does).
  const auto add = [](Tensor& sum, const Tensor& term) {
    for (int64_t e = 0; e < sum.numel(); ++e) sum.data_as<float>()[e] += term.data_as<float>()[e];
  };
  const Stopwatch stopwatch;
  Tensor memory = embed(table, source);
  MultiHeadForwardOptions encoder_options = options;
  encoder_options.key_padding_mask = source_mask.view();
  const MultiHeadResult encoded =
      encoder_self.forward(memory.view(), memory.view(), memory.view(), encoder_options);
  add(memory, encoded.output);
  out << formatted(
      "   encoder: %s %s -> self-attention with key padding mask (1, 6) -> memory %s\n",
      joined(source).c_str(), embed(table, source).shape().str().c_str(),
      memory.shape().str().c_str());

  Tensor decoded = embed(table, target);
  MultiHeadForwardOptions decoder_options = options;
  decoder_options.causal = true;
  const MultiHeadResult masked_self =
      decoder_self.forward(decoded.view(), decoded.view(), decoded.view(), decoder_options);
  add(decoded, masked_self.output);
  double above_diagonal = 0;
  const int64_t target_length = static_cast<int64_t>(target.size());
  for (int64_t h = 0; h < kTextHeads; ++h) {
    for (int64_t i = 0; i < target_length; ++i) {
      for (int64_t j = i + 1; j < target_length; ++j) {
        above_diagonal = std::max(
            above_diagonal,
            double{
                masked_self.weights.data_as<float>()[(h * target_length + i) * target_length + j]});
      }
    }
  }
  out << formatted(
      "   decoder: %s %s -> causal self-attention (largest weight on a later "
      "token: %g)\n",
      joined(target).c_str(), decoded.shape().str().c_str(), above_diagonal);

  MultiHeadForwardOptions cross_options = options;
  cross_options.key_padding_mask = source_mask.view();
  const MultiHeadResult crossed =
      cross.forward(decoded.view(), memory.view(), memory.view(), cross_options);
  const double elapsed = stopwatch.milliseconds();
  double on_padding = 0;
  for (int64_t row = 0; row < kTextHeads * target_length; ++row) {
    for (int64_t j = kRealSourceTokens; j < source_length; ++j) {
      on_padding =
          std::max(on_padding, double{crossed.weights.data_as<float>()[row * source_length + j]});
    }
  }
  out << formatted(
      "   cross-attention: queries %s from the decoder, keys and values %s from "
      "the encoder -> output %s, weights %s (largest weight on <pad>: %g)\n",
      decoded.shape().str().c_str(), memory.shape().str().c_str(),
      crossed.output.shape().str().c_str(), crossed.weights.shape().str().c_str(), on_padding);
  out << "   three attention layers in " << milliseconds_text(elapsed) << "\n";
  out << "   per head, the German word each English position attends most:\n";
  print_head_summaries(out, crossed.weights, target, source, kRealSourceTokens);
  return {"cross_attention.svg",
          per_head_figure("Cross-attention: English queries over the German encoder output",
                          "Encoder self-attention over [Wie, geht, es, dir] (padded to 6), "
                          "decoder causal self-attention, then MultiHeadAttention(256, 8) with "
                          "a source key padding mask",
                          crossed.weights, target, source)};
}

}  // namespace attend::cli
