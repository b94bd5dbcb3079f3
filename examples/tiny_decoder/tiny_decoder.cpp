// tiny_decoder.cpp: the model of tiny_decoder.hpp. Plain loops for the projections (the
// example is about the attention and the cache), one OpenMP loop over their dot products.
#include "tiny_decoder.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

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

// Σ_i x[i]·w[i] in SIMD partial sums (vectorized; the order is fixed by the build, so the
// same bits at any thread count).
float dot(const float* x, const float* w, int64_t n) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * w[i];
  return sum;
}

// out (T, O) = in (T, I)·Wᵀ, W (O, I); added to out when `accumulate`.
void project(const std::vector<float>& in, const Tensor& w, std::vector<float>& out,
             bool accumulate, int threads) {
  const int64_t outputs = w.shape()[0], inputs = w.shape()[1];
  const auto tokens = static_cast<int64_t>(in.size()) / inputs;
  if (!accumulate) out.assign(static_cast<size_t>(tokens * outputs), 0.0f);
  const float* weights = w.data_as<float>();
  // Threads from 2^17 multiply-adds (tens of microseconds of these loops, against a few for
  // waking and joining a thread on idle cores): a decoding step of a few sequences stays on
  // one thread, a batch of 32 or a prompt chunk splits its dot products over all of them.
  const int64_t products = tokens * outputs;
  const bool parallel = products > 1 && products * inputs >= (int64_t{1} << 17);
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t n = 0; n < products; ++n) {
    const int64_t t = n / outputs, o = n % outputs;
    out[static_cast<size_t>(n)] += dot(in.data() + t * inputs, weights + o * inputs, inputs);
  }
}

std::vector<float> rms_norm(const std::vector<float>& x, int64_t dim) {
  std::vector<float> y(x.size());
  for (size_t t = 0; t < x.size() / static_cast<size_t>(dim); ++t) {
    double sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += double{x[t * dim + i]} * x[t * dim + i];
    const auto scale = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(dim) + 1e-6));
    for (int64_t i = 0; i < dim; ++i) y[t * dim + i] = x[t * dim + i] * scale;
  }
  return y;
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
                          const Attend& attend_layer) const {
  const int64_t d = config_.model_dim, tokens = static_cast<int64_t>(positions.size());
  Tensor position_tensor(DType::kInt64, Shape({tokens}));
  std::copy(positions.begin(), positions.end(), position_tensor.data_as<int64_t>());
  const int threads = config_.num_threads;
  std::vector<float> q, k, v, heads, hidden;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    const std::vector<float> n = rms_norm(x, d);
    project(n, layer.wq, q, false, threads);
    project(n, layer.wk, k, false, threads);
    project(n, layer.wv, v, false, threads);
    const TensorView qv(q.data(), Shape({tokens, config_.heads, head_dim_}));
    const TensorView kv(k.data(), Shape({tokens, config_.kv_heads, head_dim_}));
    const TensorView vv(v.data(), Shape({tokens, config_.kv_heads, head_dim_}));
    apply_rope_at(qv, position_tensor.view());
    apply_rope_at(kv, position_tensor.view());
    heads.assign(static_cast<size_t>(tokens * d), 0.0f);
    attend_layer(l, qv, kv, vv,
                 TensorView(heads.data(), Shape({tokens, config_.heads, head_dim_})));
    project(heads, layer.wo, x, true, threads);
    const std::vector<float> m = rms_norm(x, d);
    project(m, layer.w1, hidden, false, threads);
    for (float& h : hidden) h = std::max(h, 0.0f);
    project(hidden, layer.w2, x, true, threads);
  }
}

std::vector<float> TinyDecoder::logits_of(const std::vector<float>& x,
                                          const std::vector<int64_t>& rows) const {
  const int64_t d = config_.model_dim;
  std::vector<float> last;
  for (const int64_t row : rows)
    last.insert(last.end(), x.begin() + row * d, x.begin() + (row + 1) * d);
  std::vector<float> logits;
  project(rms_norm(last, d), embedding_, logits, false, config_.num_threads);
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
          });
  std::vector<int64_t> last_rows;
  for (size_t s = 0; s < ids.size(); ++s) last_rows.push_back(cu.data_as<int32_t>()[s + 1] - 1);
  logits_ = logits_of(x, last_rows);
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
          });
  return logits_of(x, {length - 1});
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
