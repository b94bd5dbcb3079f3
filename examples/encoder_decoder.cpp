// encoder_decoder: one encoder and one decoder attention layer on "Wie geht es dir" -> "How are
// you", with untrained (seeded) parameters: it shows the data flow and the shapes, not a
// translation.
//
//   source ids (N, S) -> token embedding + sinusoidal positions -> encoder self-attention
//                        (padding keys masked)                  -> memory (N, S, d)
//   target ids (N, T) -> token embedding + sinusoidal positions -> decoder self-attention
//                        (causal) -> cross-attention over memory (source padding masked)
//
// Run: ./build/examples/encoder_decoder
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "attend/attend.hpp"

namespace {

constexpr int64_t kModelDim = 32;
constexpr int64_t kHeads = 4;

// Tiny vocabularies; id 0 is padding.
const std::vector<std::string> kGerman = {"<pad>", "Wie", "geht", "es", "dir", "dich"};
const std::vector<std::string> kEnglish = {"<pad>", "<bos>", "How", "are", "you"};

// (N, L) int64 ids -> (N, L, d) embeddings plus sinusoidal positions. (The annotated
// transformer also multiplies by sqrt(d); with an N(0, 1) table, as here, that would saturate
// the untrained softmax.)
attend::Tensor embed(const attend::TokenEmbedding& table, const attend::Tensor& ids) {
  attend::Tensor x = table.forward(ids.view());
  const attend::Tensor positions =
      attend::sinusoidal_positional_encoding(ids.shape()[1], kModelDim);
  attend::add_positional_encoding(x.view(), positions.view());
  return x;
}

// x += y, elementwise (the residual connection).
void add_into(attend::Tensor& x, const attend::Tensor& y) {
  for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] += y.data_as<float>()[i];
}

attend::Tensor ids_tensor(const std::vector<std::vector<int64_t>>& rows) {
  const auto batch = static_cast<int64_t>(rows.size()),
             length = static_cast<int64_t>(rows[0].size());
  attend::Tensor ids(attend::DType::kInt64, attend::Shape({batch, length}));
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t l = 0; l < length; ++l) ids.data_as<int64_t>()[n * length + l] = rows[n][l];
  return ids;
}

}  // namespace

int main() {
  try {
    // Batch of two sources: "Wie geht es dir" and "Wie geht es" (padded to 4 tokens).
    const attend::Tensor source = ids_tensor({{1, 2, 3, 4}, {1, 2, 3, 0}});
    const attend::Tensor target = ids_tensor({{1, 2, 3, 4}, {1, 2, 3, 4}});  // <bos> How are you
    // Key padding mask, ZERO EXCLUDES: 1 for real tokens, 0 for padding.
    attend::Tensor source_keep(attend::DType::kUInt8, source.shape());
    for (int64_t i = 0; i < source.numel(); ++i) {
      source_keep.data_as<uint8_t>()[i] = source.data_as<int64_t>()[i] != 0;
    }

    const attend::TokenEmbedding german(static_cast<int64_t>(kGerman.size()), kModelDim, 1);
    const attend::TokenEmbedding english(static_cast<int64_t>(kEnglish.size()), kModelDim, 2);
    const attend::MultiHeadAttention encoder_self(kModelDim, kHeads, {}, 3);
    const attend::MultiHeadAttention decoder_self(kModelDim, kHeads, {}, 4);
    const attend::MultiHeadAttention decoder_cross(kModelDim, kHeads, {}, 5);

    // Encoder: self-attention over the source, padding keys excluded.
    attend::Tensor memory = embed(german, source);
    attend::MultiHeadForwardOptions encoder_options;
    encoder_options.key_padding_mask = source_keep.view();
    encoder_options.need_weights = false;
    const attend::TensorView m = memory.view();
    add_into(memory, encoder_self.forward(m, m, m, encoder_options).output);

    // Decoder: causal self-attention, then cross-attention over the encoder's memory.
    attend::Tensor state = embed(english, target);
    attend::MultiHeadForwardOptions causal_options;
    causal_options.causal = true;
    const attend::TensorView s = state.view();
    const attend::MultiHeadResult self_result = decoder_self.forward(s, s, s, causal_options);
    add_into(state, self_result.output);
    attend::MultiHeadForwardOptions cross_options;
    cross_options.key_padding_mask = source_keep.view();
    const attend::MultiHeadResult cross =
        decoder_cross.forward(state.view(), memory.view(), memory.view(), cross_options);

    std::printf("source ids %s -> memory %s\n", source.shape().str().c_str(),
                memory.shape().str().c_str());
    std::printf("target ids %s -> decoder self-attention weights %s (causal)\n",
                target.shape().str().c_str(), self_result.weights.shape().str().c_str());
    std::printf("cross-attention output %s, weights %s (averaged over %lld heads)\n",
                cross.output.shape().str().c_str(), cross.weights.shape().str().c_str(),
                static_cast<long long>(kHeads));
    for (int64_t n = 0; n < 2; ++n) {
      std::printf("sentence %lld: '%s' attends to", static_cast<long long>(n), kEnglish[4].c_str());
      const int64_t S = source.shape()[1], T = target.shape()[1];
      for (int64_t j = 0; j < S; ++j) {
        std::printf("  %s %.3f",
                    kGerman[static_cast<size_t>(source.data_as<int64_t>()[n * S + j])].c_str(),
                    cross.weights.data_as<float>()[(n * T + (T - 1)) * S + j]);
      }
      std::printf("\n");
    }
    std::printf("SIMD target: %s\n", attend::active_simd_target().c_str());
  } catch (const attend::Error& error) {
    std::fprintf(stderr, "error: %s\n", error.what());
    return 1;
  }
  return 0;
}
