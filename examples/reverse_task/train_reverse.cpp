// train_reverse.cpp: the reversal model, its forward and backward passes, Adam and the training
// loop (see train_reverse.hpp for the model).
#include "train_reverse.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "attend/error.hpp"

namespace attend::examples {
namespace {

// Salts that keep the generators of different purposes apart for one user seed.
constexpr uint64_t kBatchSalt = 0x6261746368000000;      // "batch"
constexpr uint64_t kEmbeddingSalt = 0x656d626564000000;  // "embed"
constexpr uint64_t kLayerSalt = 0x6c61796572000000;      // "layer"
constexpr uint64_t kHeadSalt = 0x6865616400000000;       // "head"

// SplitMix64's output function: a bijection that scatters nearby inputs.
uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9;
  x = (x ^ (x >> 27)) * 0x94d049bb133111eb;
  return x ^ (x >> 31);
}

// SplitMix64: small, fast, and the same sequence on every platform (std:: distributions are
// not specified bit for bit).
class Generator {
 public:
  Generator(uint64_t seed, uint64_t salt, uint64_t stream)
      : state_(mix(mix(seed ^ salt) + stream)) {}
  uint64_t next() { return mix(state_ += 0x9e3779b97f4a7c15); }
  // Uniform in [0, bound), bound < 2^32.
  int64_t below(int64_t bound) {
    return static_cast<int64_t>(((next() >> 32) * static_cast<uint64_t>(bound)) >> 32);
  }
  // Uniform in [-limit, limit).
  double symmetric(double limit) {
    return (static_cast<double>(next() >> 11) * 0x1.0p-53 * 2.0 - 1.0) * limit;
  }

 private:
  uint64_t state_;
};

void check_range(const char* name, int64_t value, int64_t minimum, int64_t maximum) {
  if (value < minimum || value > maximum) {
    throw Error(std::string(name) + " must be in [" + std::to_string(minimum) + ", " +
                std::to_string(maximum) + "], got " + std::to_string(value));
  }
}

// x += y, elementwise, float32 tensors of one shape (the residual connection and the sum of
// gradients that meet at one tensor).
void add_into(Tensor& x, const Tensor& y) {
  float* x_data = x.data_as<float>();
  const float* y_data = y.data_as<float>();
  for (int64_t i = 0; i < x.numel(); ++i) x_data[i] += y_data[i];
}

int64_t count_parameters(const std::map<std::string, TensorView>& parameters) {
  int64_t total = 0;
  for (const auto& entry : parameters) total += entry.second.numel();
  return total;
}

// "step   120  train loss  0.00395  held-out loss  0.00372  tokens  99.98%  sequences  99.80%"
// (the training loss is that of the last step's batch; none before the first step).
void print_evaluation(std::ostream& log, const Evaluation& evaluation,
                      const std::vector<double>& train_losses) {
  char train_loss[32] = "       -";
  if (!train_losses.empty())
    std::snprintf(train_loss, sizeof train_loss, "%8.5f", train_losses.back());
  char line[160];
  std::snprintf(line, sizeof line,
                "step %5lld  train loss %s  held-out loss %8.5f  tokens %6.2f%%  "
                "sequences %6.2f%%\n",
                static_cast<long long>(evaluation.step), train_loss, evaluation.loss,
                100.0 * evaluation.token_accuracy, 100.0 * evaluation.sequence_accuracy);
  log << line << std::flush;
}

}  // namespace

void validate(const ReverseTaskSettings& settings) {
  constexpr int64_t kMaxDim = 4096, kMaxBatch = 1 << 16;
  check_range("vocab_size", settings.vocab_size, 2, kMaxDim);
  check_range("length", settings.length, 1, kMaxDim);
  check_range("embed_dim", settings.embed_dim, 1, kMaxDim);
  check_range("num_heads", settings.num_heads, 1, settings.embed_dim);
  if (settings.embed_dim % settings.num_heads != 0) {
    throw Error("num_heads " + std::to_string(settings.num_heads) + " does not divide embed_dim " +
                std::to_string(settings.embed_dim));
  }
  check_range("num_layers", settings.num_layers, 1, 64);
  check_range("batch_size", settings.batch_size, 1, kMaxBatch);
  check_range("eval_batch_size", settings.eval_batch_size, 1, kMaxBatch);
  check_range("max_steps", settings.max_steps, 1, int64_t{1} << 40);
  check_range("eval_every", settings.eval_every, 1, int64_t{1} << 40);
  if (!(settings.learning_rate > 0 && settings.learning_rate < 1e3)) {
    throw Error("learning_rate must be in (0, 1000), got " +
                std::to_string(settings.learning_rate));
  }
  check_range("num_threads", settings.num_threads, 0, 1 << 16);
}

ReverseBatch make_reverse_batch(const ReverseTaskSettings& settings, int64_t batch_size,
                                uint64_t seed, uint64_t stream) {
  const int64_t length = settings.length;
  ReverseBatch batch{Tensor(DType::kInt64, Shape({batch_size, length})),
                     Tensor(DType::kInt64, Shape({batch_size, length}))};
  Generator generator(seed, kBatchSalt, stream);
  int64_t* ids = batch.ids.data_as<int64_t>();
  int64_t* targets = batch.targets.data_as<int64_t>();
  for (int64_t n = 0; n < batch_size; ++n) {
    for (int64_t i = 0; i < length; ++i) ids[n * length + i] = generator.below(settings.vocab_size);
    for (int64_t i = 0; i < length; ++i) targets[n * length + i] = ids[n * length + length - 1 - i];
  }
  return batch;
}

ReverseModel::ReverseModel(const ReverseTaskSettings& settings)
    : settings_((validate(settings), settings)),
      embedding_(settings.vocab_size, settings.embed_dim, mix(settings.seed ^ kEmbeddingSalt)),
      positions_(sinusoidal_positional_encoding(settings.length, settings.embed_dim)),
      head_weight_(DType::kFloat32, Shape({settings.vocab_size, settings.embed_dim})),
      head_bias_(Tensor::zeros(DType::kFloat32, Shape({settings.vocab_size}))) {
  for (int64_t l = 0; l < settings.num_layers; ++l) {
    layers_.emplace_back(settings.embed_dim, settings.num_heads, MultiHeadOptions{},
                         mix(settings.seed ^ kLayerSalt) + static_cast<uint64_t>(l));
  }
  // As torch.nn.Linear: U(-1/sqrt(E), 1/sqrt(E)).
  Generator generator(settings.seed, kHeadSalt, 0);
  const double limit = 1.0 / std::sqrt(static_cast<double>(settings.embed_dim));
  for (int64_t i = 0; i < head_weight_.numel(); ++i) {
    head_weight_.data_as<float>()[i] = static_cast<float>(generator.symmetric(limit));
  }
}

std::map<std::string, TensorView> ReverseModel::parameters() const {
  std::map<std::string, TensorView> parameters;
  parameters.emplace("embedding.weight", embedding_.table());
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (const auto& [name, view] : layers_[l].state_dict()) {
      parameters.emplace("layers." + std::to_string(l) + "." + name, view);
    }
  }
  parameters.emplace("head.weight", head_weight_.view());
  parameters.emplace("head.bias", head_bias_.view());
  return parameters;
}

BatchResult ReverseModel::run(const ReverseBatch& batch, bool with_gradients) const {
  // N sequences of L tokens, E features, V classes; rows = N·L positions.
  const int64_t N = batch.ids.shape()[0], L = settings_.length;
  const int64_t E = settings_.embed_dim, V = settings_.vocab_size, rows = N * L;
  if (batch.ids.shape() != Shape({N, L}) || batch.targets.shape() != Shape({N, L}) ||
      batch.targets.dtype() != DType::kInt64) {
    throw Error("batch: ids " + batch.ids.shape().str() + " and targets " +
                batch.targets.shape().str() + " must both be (N, " + std::to_string(L) +
                "), targets int64");
  }
  const int64_t* targets = batch.targets.data_as<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0 || targets[r] >= V) {
      throw Error("batch: target " + std::to_string(targets[r]) + " at row " + std::to_string(r) +
                  " is outside [0, " + std::to_string(V) + ")");
    }
  }

  // 1. Embedding and positions: x_0 (N, L, E) = table[ids] + PE.
  std::vector<Tensor> inputs;  // x_0 ... x_layers, each (N, L, E)
  inputs.push_back(embedding_.forward(batch.ids.view()));
  add_positional_encoding(inputs[0].view(), positions_.view());

  // 2. Layers: x_{l+1} = x_l + MHA_l(x_l, x_l, x_l).
  MultiHeadForwardOptions options;
  options.need_weights = false;
  options.num_threads = settings_.num_threads;
  std::vector<MultiHeadTape> tapes(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const TensorView x = inputs[l].view();
    MultiHeadResult attended =
        layers_[l].forward(x, x, x, options, with_gradients ? &tapes[l] : nullptr);
    add_into(attended.output, inputs[l]);
    inputs.push_back(std::move(attended.output));
  }

  // 3. Head: logits (rows, V) = x (rows, E) · Wᵀ (E, V) + b (V).
  const float* x = inputs.back().data_as<float>();
  const float* weight = head_weight_.data_as<float>();
  const float* bias = head_bias_.data_as<float>();
  std::vector<float> logits(static_cast<size_t>(rows * V));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < V; ++v) {
      float sum = bias[v];
      for (int64_t e = 0; e < E; ++e) sum += x[r * E + e] * weight[v * E + e];
      logits[static_cast<size_t>(r * V + v)] = sum;
    }
  }

  // 4. Cross-entropy per row: log Σ_v exp(logit_v) − logit_target, averaged over the rows;
  //    d loss / d logits (rows, V) = (softmax − one_hot(target)) / rows.
  std::vector<float> grad_logits(with_gradients ? logits.size() : 0);
  BatchResult result;
  result.predictions = Tensor(DType::kInt64, Shape({N, L}));
  double loss = 0;
  int64_t right_tokens = 0, right_sequences = 0, right_in_sequence = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * V;
    const int64_t predicted = std::max_element(row, row + V) - row;
    result.predictions.data_as<int64_t>()[r] = predicted;
    const double row_max = row[predicted];
    double exp_sum = 0;
    for (int64_t v = 0; v < V; ++v) exp_sum += std::exp(row[v] - row_max);
    const double log_sum_exp = row_max + std::log(exp_sum);
    loss += log_sum_exp - row[targets[r]];
    right_tokens += predicted == targets[r];
    right_in_sequence += predicted == targets[r];
    if (r % L == L - 1) {
      right_sequences += right_in_sequence == L;
      right_in_sequence = 0;
    }
    if (with_gradients) {
      for (int64_t v = 0; v < V; ++v) {
        const double probability = std::exp(row[v] - log_sum_exp);
        grad_logits[static_cast<size_t>(r * V + v)] =
            static_cast<float>((probability - (v == targets[r] ? 1.0 : 0.0)) / rows);
      }
    }
  }
  result.loss = loss / static_cast<double>(rows);
  result.token_accuracy = static_cast<double>(right_tokens) / static_cast<double>(rows);
  result.sequence_accuracy = static_cast<double>(right_sequences) / static_cast<double>(N);
  if (!with_gradients) return result;

  // 5. Head backward: dW (V, E) = dlogitsᵀ · x, db (V) = Σ_rows dlogits,
  //    dx (rows, E) = dlogits (rows, V) · W (V, E).
  Tensor grad_weight = Tensor::zeros(DType::kFloat32, head_weight_.shape());
  Tensor grad_bias = Tensor::zeros(DType::kFloat32, head_bias_.shape());
  Tensor grad_x = Tensor::zeros(DType::kFloat32, inputs.back().shape());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < V; ++v) {
      const float g = grad_logits[static_cast<size_t>(r * V + v)];
      grad_bias.data_as<float>()[v] += g;
      for (int64_t e = 0; e < E; ++e) {
        grad_weight.data_as<float>()[v * E + e] += g * x[r * E + e];
        grad_x.data_as<float>()[r * E + e] += g * weight[v * E + e];
      }
    }
  }
  result.gradients.emplace("head.weight", std::move(grad_weight));
  result.gradients.emplace("head.bias", std::move(grad_bias));

  // 6. Layers backward, last first. x_l feeds the residual and the attention (as query, key
  //    and value), so dx_l = dx_{l+1} + d attention / d x_l. For self-attention (one view
  //    passed three times) backward() returns that whole gradient in `query`.
  for (size_t l = layers_.size(); l-- > 0;) {
    const TensorView x_l = inputs[l].view();
    MultiHeadGradients attention =
        layers_[l].backward(grad_x.view(), x_l, x_l, x_l, tapes[l], options);
    if (!attention.key.empty() || !attention.value.empty()) {
      throw Error("MultiHeadAttention::backward: expected one input gradient for self-attention");
    }
    add_into(grad_x, attention.query);
    for (auto& [name, gradient] : attention.parameters) {
      result.gradients.emplace("layers." + std::to_string(l) + "." + name, std::move(gradient));
    }
  }

  // 7. Embedding backward: d table[id] (E) += dx_0[row] for every row holding id (the
  //    positional encoding is a constant).
  Tensor grad_table = Tensor::zeros(DType::kFloat32, Shape({V, E}));
  const int64_t* ids = batch.ids.data_as<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < E; ++e) {
      grad_table.data_as<float>()[ids[r] * E + e] += grad_x.data_as<float>()[r * E + e];
    }
  }
  result.gradients.emplace("embedding.weight", std::move(grad_table));
  return result;
}

Adam::Adam(std::map<std::string, TensorView> parameters, double learning_rate, double beta1,
           double beta2, double epsilon)
    : parameters_(std::move(parameters)),
      learning_rate_(learning_rate),
      beta1_(beta1),
      beta2_(beta2),
      epsilon_(epsilon) {
  for (const auto& [name, view] : parameters_) {
    if (view.dtype != DType::kFloat32 || !view.is_contiguous()) {
      throw Error("Adam: parameter '" + name + "' is not a contiguous float32 tensor");
    }
    const auto count = static_cast<size_t>(view.numel());
    moments_[name] = {std::vector<double>(count, 0.0), std::vector<double>(count, 0.0)};
  }
}

void Adam::step(const std::map<std::string, Tensor>& gradients) {
  // For each parameter p with gradient g, at step t (from 1):
  //   m = β1·m + (1 − β1)·g,  v = β2·v + (1 − β2)·g²
  //   p −= lr · m̂ / (sqrt(v̂) + ε),  m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t)
  ++steps_;
  const double first_correction = 1.0 - std::pow(beta1_, static_cast<double>(steps_));
  const double second_correction = 1.0 - std::pow(beta2_, static_cast<double>(steps_));
  for (auto& [name, view] : parameters_) {
    const auto found = gradients.find(name);
    if (found == gradients.end()) throw Error("Adam: no gradient for parameter '" + name + "'");
    if (found->second.shape() != view.shape) {
      throw Error("Adam: gradient of '" + name + "' has shape " + found->second.shape().str() +
                  ", the parameter " + view.shape.str());
    }
    const float* gradient = found->second.data_as<float>();
    float* parameter = view.data_as<float>();
    Moments& moments = moments_[name];
    for (size_t i = 0; i < moments.first.size(); ++i) {
      const double g = gradient[i];
      moments.first[i] = beta1_ * moments.first[i] + (1.0 - beta1_) * g;
      moments.second[i] = beta2_ * moments.second[i] + (1.0 - beta2_) * g * g;
      const double first = moments.first[i] / first_correction;
      const double second = moments.second[i] / second_correction;
      parameter[i] -= static_cast<float>(learning_rate_ * first / (std::sqrt(second) + epsilon_));
    }
  }
}

TrainingHistory train_reverse(ReverseModel& model, std::ostream* log) {
  const ReverseTaskSettings& settings = model.settings();
  Adam optimizer(model.parameters(), settings.learning_rate);
  // Stream 0 is the held-out batch; training step s draws stream s.
  const ReverseBatch held_out =
      make_reverse_batch(settings, settings.eval_batch_size, settings.seed, 0);
  if (log != nullptr) {
    *log << "Reversing sequences of " << settings.length << " tokens (vocabulary "
         << settings.vocab_size << "): token embedding + sinusoidal positions, "
         << settings.num_layers << " self-attention layer" << (settings.num_layers > 1 ? "s" : "")
         << " (E = " << settings.embed_dim << ", " << settings.num_heads
         << " heads) with residuals, a linear head; " << count_parameters(model.parameters())
         << " parameters.\nAdam, learning rate " << settings.learning_rate << ", batches of "
         << settings.batch_size << ", seed " << settings.seed << "; evaluated on "
         << settings.eval_batch_size << " held-out sequences every " << settings.eval_every
         << " steps.\n";
  }
  TrainingHistory history;
  const auto evaluate = [&](int64_t step) {
    const BatchResult result = model.run(held_out, false);
    history.evaluations.push_back(
        {step, result.loss, result.token_accuracy, result.sequence_accuracy});
    if (log != nullptr) print_evaluation(*log, history.evaluations.back(), history.losses);
    return result.sequence_accuracy == 1.0;
  };

  const auto start = std::chrono::steady_clock::now();
  evaluate(0);
  for (int64_t step = 1; step <= settings.max_steps; ++step) {
    const ReverseBatch batch = make_reverse_batch(settings, settings.batch_size, settings.seed,
                                                  static_cast<uint64_t>(step));
    const BatchResult result = model.run(batch, true);
    history.losses.push_back(result.loss);
    optimizer.step(result.gradients);
    if (step % settings.eval_every == 0 || step == settings.max_steps) {
      if (evaluate(step)) {
        history.solved_at_step = step;
        break;
      }
    }
  }
  history.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return history;
}

void print_reversal_examples(const ReverseModel& model, int64_t count, std::ostream& out) {
  const ReverseTaskSettings& settings = model.settings();
  // A stream no training step reaches.
  const ReverseBatch batch = make_reverse_batch(settings, count, settings.seed, ~uint64_t{0});
  const BatchResult result = model.run(batch, false);
  const int64_t L = settings.length;
  const auto tokens = [&](const Tensor& t, int64_t n) {
    std::string text;
    for (int64_t i = 0; i < L; ++i) {
      if (i > 0) text += ' ';
      text += std::to_string(t.data_as<int64_t>()[n * L + i]);
    }
    return text;
  };
  for (int64_t n = 0; n < count; ++n) {
    const bool right = tokens(result.predictions, n) == tokens(batch.targets, n);
    out << "  " << tokens(batch.ids, n) << "  ->  " << tokens(result.predictions, n) << "  "
        << (right ? "right" : "wrong (expected " + tokens(batch.targets, n) + ")") << '\n';
  }
}

}  // namespace attend::examples
