// alibi_score_mod.cpp: ALiBi (Press et al. 2022) written by hand as a user score rule, run
// through the fused forward and backward, and checked against the built-in rule: the two give
// the same bits. Copy the lambda to write your own score_mod.
//
//   score(b, h, q, kv) += slope_h · (kv − q')      q' = q + Lk − Lq (bottom-right alignment)
#include <cstdio>
#include <cstring>
#include <vector>

#include "attend/attend.hpp"

int main() {
  // 8 heads × 100 queries × 100 keys × 32, causal: a decoder layer's attention.
  const int64_t heads = 8, length = 100, dim = 32;
  std::vector<float> q(heads * length * dim), k(q.size()), v(q.size());
  for (size_t n = 0; n < q.size(); ++n) {
    q[n] = static_cast<float>((n * 7919) % 1000) / 1000.0f - 0.5f;
    k[n] = static_cast<float>((n * 104729) % 1000) / 1000.0f - 0.5f;
    v[n] = static_cast<float>((n * 1299709) % 1000) / 1000.0f - 0.5f;
  }
  const attend::Shape shape{heads, length, dim};
  const attend::TensorView query(q.data(), shape), key(k.data(), shape), value(v.data(), shape);

  // 1. The rule, generic in the score's type (attend::Dual for the backward's derivative).
  const std::vector<float> slopes = attend::default_alibi_slopes(heads);
  const int32_t offset = 0;  // Lk − Lq
  const auto alibi = [&](auto score, int32_t /*b*/, int32_t h, int32_t q_index, int32_t kv) {
    return score + slopes[static_cast<size_t>(h)] * static_cast<float>(kv - (q_index + offset));
  };

  // 2. The user rule and the built-in one, forward and backward.
  attend::AttentionOptions user;
  user.causal = true;
  user.need_logsumexp = true;
  user.user_rules = attend::make_score_rules(alibi);
  attend::AttentionOptions built_in = user;
  built_in.user_rules.reset();
  built_in.alibi = true;
  const attend::AttentionResult a = attend::scaled_dot_product_attention(query, key, value, user);
  const attend::AttentionResult b =
      attend::scaled_dot_product_attention(query, key, value, built_in);
  const attend::AttentionGradients ga = attend::scaled_dot_product_attention_backward(
      value, query, key, value, a.output.view(), a.logsumexp.view(), user);
  const attend::AttentionGradients gb = attend::scaled_dot_product_attention_backward(
      value, query, key, value, b.output.view(), b.logsumexp.view(), built_in);

  // 3. Bit for bit.
  const bool same = std::memcmp(a.output.data(), b.output.data(), a.output.nbytes()) == 0 &&
                    std::memcmp(ga.query.data(), gb.query.data(), ga.query.nbytes()) == 0 &&
                    std::memcmp(ga.key.data(), gb.key.data(), ga.key.nbytes()) == 0;
  std::printf(
      "ALiBi as a user score_mod: output[last] = %.6f, dQ[last] = %.6f; %s the built-in rule\n",
      a.output.data_as<float>()[a.output.numel() - 1],
      ga.query.data_as<float>()[ga.query.numel() - 1],
      same ? "bit for bit equal to" : "DIFFERENT from");
  return same ? 0 : 1;
}
