// tiny_decoder.cpp: the model of tiny_decoder.hpp. The projections are attend's linear layer
// (attend/linear.hpp), the attention the paged cache's; norms, RoPE's positions and the
// residual adds are plain loops.
#include "tiny_decoder.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include "attend/linear.hpp"
#include "attend/rope.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"

namespace attend::example {
namespace {

Tensor random_matrix(int64_t rows, int64_t columns, std::mt19937_64& random) {
  Tensor t(DType::kFloat32, Shape({rows, columns}));
  const double bound = 1.0 / std::sqrt(static_cast<double>(columns));
  std::uniform_real_distribution<float> uniform(static_cast<float>(-bound),
                                                static_cast<float>(bound));
  for (int64_t n = 0; n < t.numel(); ++n) t.data_as<float>()[n] = uniform(random);
  return t;
}

// out (T, O) = in (T, I)·Wᵀ, W (O, I), by attend's projection GEMM (attend::linear_into: SIMD
// for this CPU, and as many threads as the product's size is worth, so a decoding step of a
// few sequences stays on one thread and a batch of 32 or a prompt chunk uses them all); added
// to out when `accumulate` (the residual: the product goes through `scratch` first).
void project(const std::vector<float>& in, const Tensor& w, std::vector<float>& out,
             bool accumulate, int threads, std::vector<float>& scratch) {
  const int64_t outputs = w.shape()[0], inputs = w.shape()[1];
  const auto tokens = static_cast<int64_t>(in.size()) / inputs;
  std::vector<float>& product = accumulate ? scratch : out;
  product.resize(static_cast<size_t>(tokens * outputs));
  linear_into(TensorView(in.data(), Shape({tokens, inputs})), w.view(), nullptr,
              TensorView(product.data(), Shape({tokens, outputs})), threads);
  if (accumulate) {
    for (size_t n = 0; n < product.size(); ++n) out[n] += product[n];
  }
}

// y (T, dim) = x·rsqrt(mean(x²) + 1e-6) per token, the sum in float64; y resized to x's size.
void rms_norm(const std::vector<float>& x, int64_t dim, std::vector<float>& y) {
  y.resize(x.size());
  for (size_t t = 0; t < x.size() / static_cast<size_t>(dim); ++t) {
    double sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += double{x[t * dim + i]} * x[t * dim + i];
    const auto scale = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(dim) + 1e-6));
    for (int64_t i = 0; i < dim; ++i) y[t * dim + i] = x[t * dim + i] * scale;
  }
}

}  // namespace

TinyDecoder::TinyDecoder(const TinyDecoderConfig& config)
    : config_(config), head_dim_(config.model_dim / config.heads) {
  if (config.model_dim % config.heads != 0 || config.heads % config.kv_heads != 0) {
    throw std::invalid_argument("TinyDecoder: heads must divide model_dim, kv_heads heads");
  }
  if (config_.num_threads <= 0) config_.num_threads = default_num_threads();
  std::mt19937_64 random(config.seed);
  embedding_ = random_matrix(config.vocab, config.model_dim, random);
  for (int64_t l = 0; l < config.layers; ++l) {
    Layer layer;
    const int64_t d = config.model_dim, kv = config.kv_heads * head_dim_;
    layer.wq = random_matrix(d, d, random);
    layer.wk = random_matrix(kv, d, random);
    layer.wv = random_matrix(kv, d, random);
    layer.wo = random_matrix(d, d, random);
    layer.w1 = random_matrix(config.mlp_dim, d, random);
    layer.w2 = random_matrix(d, config.mlp_dim, random);
    KvCacheConfig cache;
    cache.num_blocks = config.cache_blocks;
    cache.block_size = config.block_size;
    cache.kv_heads = config.kv_heads;
    cache.head_dim = head_dim_;
    layer.cache = std::make_unique<PagedKvCache>(cache);
    layers_.push_back(std::move(layer));
  }
}

int64_t TinyDecoder::add_sequence() {
  const int64_t id = layers_[0].cache->add_sequence();
  for (size_t l = 1; l < layers_.size(); ++l) {
    if (layers_[l].cache->add_sequence() != id) throw std::logic_error("caches out of step");
  }
  return id;
}

void TinyDecoder::remove_sequence(int64_t id) {
  for (Layer& layer : layers_) layer.cache->remove_sequence(id);
}

template <class Attend>
void TinyDecoder::forward(std::vector<float>& x, const std::vector<int64_t>& positions,
                          const Attend& attend_layer, Buffers& b) const {
  const int64_t d = config_.model_dim, tokens = static_cast<int64_t>(positions.size());
  Tensor position_tensor(DType::kInt64, Shape({tokens}));
  std::copy(positions.begin(), positions.end(), position_tensor.data_as<int64_t>());
  const int threads = config_.num_threads;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    rms_norm(x, d, b.normed);
    project(b.normed, layer.wq, b.q, false, threads, b.scratch);
    project(b.normed, layer.wk, b.k, false, threads, b.scratch);
    project(b.normed, layer.wv, b.v, false, threads, b.scratch);
    const TensorView qv(b.q.data(), Shape({tokens, config_.heads, head_dim_}));
    const TensorView kv(b.k.data(), Shape({tokens, config_.kv_heads, head_dim_}));
    const TensorView vv(b.v.data(), Shape({tokens, config_.kv_heads, head_dim_}));
    apply_rope_at(qv, position_tensor.view());
    apply_rope_at(kv, position_tensor.view());
    b.heads.resize(static_cast<size_t>(tokens * d));  // every row written by the attention
    attend_layer(l, qv, kv, vv,
                 TensorView(b.heads.data(), Shape({tokens, config_.heads, head_dim_})));
    project(b.heads, layer.wo, x, true, threads, b.scratch);
    rms_norm(x, d, b.normed);
    project(b.normed, layer.w1, b.hidden, false, threads, b.scratch);
    for (float& h : b.hidden) h = std::max(h, 0.0f);
    project(b.hidden, layer.w2, x, true, threads, b.scratch);
  }
}

std::vector<float> TinyDecoder::logits_of(const std::vector<float>& x,
                                          const std::vector<int64_t>& rows, Buffers& b) const {
  const int64_t d = config_.model_dim;
  b.heads.clear();  // the rows' hidden states, then normalized into b.normed
  for (const int64_t row : rows)
    b.heads.insert(b.heads.end(), x.begin() + row * d, x.begin() + (row + 1) * d);
  rms_norm(b.heads, d, b.normed);
  std::vector<float> logits;
  project(b.normed, embedding_, logits, false, config_.num_threads, b.scratch);
  return logits;
}

std::vector<int32_t> TinyDecoder::step(const std::vector<int64_t>& ids,
                                       const std::vector<std::vector<int32_t>>& tokens) {
  const int64_t d = config_.model_dim;
  std::vector<float> x;
  std::vector<int64_t> positions;
  Tensor cu(DType::kInt32, Shape({static_cast<int64_t>(ids.size()) + 1}));
  cu.data_as<int32_t>()[0] = 0;
  for (size_t s = 0; s < ids.size(); ++s) {
    const int64_t start = layers_[0].cache->length(ids[s]);
    for (size_t t = 0; t < tokens[s].size(); ++t) {
      const float* e = embedding_.data_as<float>() + tokens[s][t] * d;
      x.insert(x.end(), e, e + d);
      positions.push_back(start + static_cast<int64_t>(t));
    }
    cu.data_as<int32_t>()[s + 1] =
        cu.data_as<int32_t>()[s] + static_cast<int32_t>(tokens[s].size());
  }
  AttentionOptions options;
  options.causal = true;  // aligned to each sequence's cache length
  options.num_threads = config_.num_threads;
  forward(x, positions,
          [&](size_t l, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out) {
            layers_[l].cache->append(ids, k, v, cu.view());
            layers_[l].cache->attend(ids, q, cu.view(), out, options);
          },
          buffers_);
  std::vector<int64_t> last_rows;
  for (size_t s = 0; s < ids.size(); ++s) last_rows.push_back(cu.data_as<int32_t>()[s + 1] - 1);
  logits_ = logits_of(x, last_rows, buffers_);
  std::vector<int32_t> next;
  const auto vocab = static_cast<size_t>(config_.vocab);
  for (size_t s = 0; s < ids.size(); ++s) {
    const auto first = logits_.begin() + static_cast<std::ptrdiff_t>(s * vocab);
    next.push_back(static_cast<int32_t>(
        std::max_element(first, first + static_cast<std::ptrdiff_t>(vocab)) - first));
  }
  return next;
}

std::vector<float> TinyDecoder::logits_without_cache(const std::vector<int32_t>& tokens) const {
  const int64_t d = config_.model_dim, length = static_cast<int64_t>(tokens.size());
  std::vector<float> x;
  std::vector<int64_t> positions;
  for (int64_t t = 0; t < length; ++t) {
    const float* e = embedding_.data_as<float>() + tokens[static_cast<size_t>(t)] * d;
    x.insert(x.end(), e, e + d);
    positions.push_back(t);
  }
  AttentionOptions options;
  options.causal = true;
  Buffers buffers;
  forward(x, positions,
          [&](size_t, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out) {
            // (T, heads, E) as (heads, T, E): one dense causal call, K/V heads grouped.
            const auto heads_first = [](const TensorView& t) {
              return TensorView(t.data, t.dtype, Shape({t.shape[1], t.shape[0], t.shape[2]}),
                                Shape({t.strides[1], t.strides[0], t.strides[2]}));
            };
            scaled_dot_product_attention_into(heads_first(q), heads_first(k), heads_first(v),
                                              heads_first(out), nullptr, options);
          },
          buffers);
  return logits_of(x, {length - 1}, buffers);
}

uint64_t TinyDecoder::cache_bytes() const {
  uint64_t bytes = 0;
  for (const Layer& layer : layers_) bytes += layer.cache->bytes();
  return bytes;
}

int64_t TinyDecoder::cache_blocks_used() const {
  int64_t used = 0;
  for (const Layer& layer : layers_) {
    used += layer.cache->config().num_blocks - layer.cache->free_blocks();
  }
  return used;
}

}  // namespace attend::example
