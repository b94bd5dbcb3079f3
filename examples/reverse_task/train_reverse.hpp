// train_reverse.hpp: a small attention-only encoder trained to reverse token sequences, end to
// end on the CPU: the model behind `attend train-demo` and examples/train_reverse.cpp.
//
//   ids (N, L) -> token embedding + sinusoidal positions           x_0 (N, L, E)
//   x_{l+1} = x_l + MultiHeadAttention_l(x_l, x_l, x_l)             self-attention, residual
//   logits  = x_layers · W_headᵀ + b_head                           (N, L, V)
//   loss    = mean over the N·L positions of cross-entropy(logits, target ids)
//
// The task: target(n, i) = ids(n, L − 1 − i). Each position must find its mirrored position,
// which only the positional encodings make possible; the token it finds there is the answer.
// The library gives the attention (forward and backward); the embedding, residual, linear head,
// cross-entropy and the Adam optimizer are written out here, with their shapes.
#pragma once

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "attend/multihead.hpp"
#include "attend/positional.hpp"
#include "attend/tensor.hpp"

namespace attend::examples {

struct ReverseTaskSettings {
  int64_t vocab_size = 10;  // V
  int64_t length = 8;       // L
  int64_t embed_dim = 32;   // E
  int64_t num_heads = 4;
  int64_t num_layers = 1;         // one suffices: each position looks up one other
  int64_t batch_size = 64;        // N of a training batch
  int64_t eval_batch_size = 512;  // held-out sequences, drawn once, never trained on
  int64_t max_steps = 2000;
  int64_t eval_every = 10;  // steps between evaluations (and log lines)
  double learning_rate = 1e-2;
  uint64_t seed = 1;    // parameters, training batches and the held-out batch all follow it
  int num_threads = 1;  // for the attention calls; results do not depend on it
};

// Throws attend::Error naming the first setting out of range.
void validate(const ReverseTaskSettings& settings);

// Sequences and their reversals, int64 (N, L) each.
struct ReverseBatch {
  Tensor ids;
  Tensor targets;
};

// `batch_size` uniformly random sequences from a generator keyed by (seed, stream): the same
// key gives the same batch.
ReverseBatch make_reverse_batch(const ReverseTaskSettings& settings, int64_t batch_size,
                                uint64_t seed, uint64_t stream);

// Loss, accuracy and (when asked for) the gradients of one batch.
struct BatchResult {
  double loss = 0;                          // mean cross-entropy, nats
  double token_accuracy = 0;                // fraction of positions whose argmax is the target
  double sequence_accuracy = 0;             // fraction of sequences right at every position
  Tensor predictions;                       // (N, L) int64, the argmax token at every position
  std::map<std::string, Tensor> gradients;  // d loss / d parameter, by parameter name
};

class ReverseModel {
 public:
  explicit ReverseModel(const ReverseTaskSettings& settings);

  // Forward pass; with `with_gradients` also the backward pass.
  BatchResult run(const ReverseBatch& batch, bool with_gradients) const;

  // Writable views of every parameter, by name: "embedding.weight" (V, E),
  // "layers.<l>.<MultiHeadAttention state_dict name>", "head.weight" (V, E), "head.bias" (V).
  std::map<std::string, TensorView> parameters() const;
  const ReverseTaskSettings& settings() const { return settings_; }

 private:
  ReverseTaskSettings settings_;
  TokenEmbedding embedding_;
  Tensor positions_;  // (L, E) sinusoidal encoding
  std::vector<MultiHeadAttention> layers_;
  Tensor head_weight_;  // (V, E)
  Tensor head_bias_;    // (V)
};

// Adam (Kingma & Ba) with bias correction, updating the parameters in place.
class Adam {
 public:
  Adam(std::map<std::string, TensorView> parameters, double learning_rate, double beta1 = 0.9,
       double beta2 = 0.999, double epsilon = 1e-8);
  // One update from gradients holding a tensor for every parameter (same name and shape).
  void step(const std::map<std::string, Tensor>& gradients);

 private:
  struct Moments {
    std::vector<double> first, second;
  };
  std::map<std::string, TensorView> parameters_;
  std::map<std::string, Moments> moments_;
  double learning_rate_, beta1_, beta2_, epsilon_;
  int64_t steps_ = 0;
};

struct Evaluation {
  int64_t step = 0;
  double loss = 0;  // on the held-out batch
  double token_accuracy = 0;
  double sequence_accuracy = 0;
};

struct TrainingHistory {
  std::vector<double> losses;           // training-batch loss after step 1, 2, ... (before
                                        // that step's update)
  std::vector<Evaluation> evaluations;  // held-out, every eval_every steps and at the end
  int64_t solved_at_step = 0;           // first evaluation at 100% sequences; 0: never
  double seconds = 0;                   // wall time of the training loop
};

// Trains `model` (with its settings) until the held-out sequence accuracy reaches 100% or
// max_steps, printing a header and one line per evaluation to `log` (when not null).
TrainingHistory train_reverse(ReverseModel& model, std::ostream* log);

// Prints `count` random sequences from a stream no training step draws, the model's output
// and whether it is right:
//   "3 1 4 1 5 9 2 6  ->  6 2 9 5 1 4 1 3  right"
void print_reversal_examples(const ReverseModel& model, int64_t count, std::ostream& out);

}  // namespace attend::examples
