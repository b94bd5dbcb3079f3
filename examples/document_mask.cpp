// document_mask.cpp: packed sequences (several documents in one row of tokens) with causal
// attention inside each document, written by hand as a user mask rule and checked against
// the built-in segment ids: the same bits. Tiles of keys that no query of a tile may see are
// skipped by both.
//
//   keep(b, h, q, kv) = document[q] == document[kv]      (and causal: kv <= q)
#include <cstdio>
#include <cstring>
#include <vector>

#include "attend/attend.hpp"

int main() {
  // 4 heads over 600 packed tokens × 64: documents of 250, 100, 200 and 50 tokens.
  const int64_t heads = 4, length = 600, dim = 64;
  std::vector<int32_t> document(length);
  const int64_t ends[] = {250, 350, 550, 600};
  for (int64_t t = 0, d = 0; t < length; ++t) {
    if (t == ends[d]) ++d;
    document[static_cast<size_t>(t)] = static_cast<int32_t>(d);
  }
  std::vector<float> q(heads * length * dim), k(q.size()), v(q.size());
  for (size_t n = 0; n < q.size(); ++n) {
    q[n] = static_cast<float>((n * 7919) % 1000) / 1000.0f - 0.5f;
    k[n] = static_cast<float>((n * 104729) % 1000) / 1000.0f - 0.5f;
    v[n] = static_cast<float>((n * 1299709) % 1000) / 1000.0f - 0.5f;
  }
  const attend::Shape shape{heads, length, dim};
  const attend::TensorView query(q.data(), shape), key(k.data(), shape), value(v.data(), shape);

  // 1. The rule.
  const auto same_document = [&](int32_t /*b*/, int32_t /*h*/, int32_t q_index, int32_t kv) {
    return document[static_cast<size_t>(q_index)] == document[static_cast<size_t>(kv)];
  };

  // 2. The user rule and the built-in segment ids.
  attend::AttentionOptions user;
  user.causal = true;
  user.user_rules = attend::make_score_rules(attend::kNoScoreMod, same_document);
  attend::AttentionOptions built_in;
  built_in.causal = true;
  const attend::TensorView ids(document.data(), attend::DType::kInt32, attend::Shape{length});
  built_in.segment_ids_query = ids;
  built_in.segment_ids_key = ids;
  const attend::AttentionResult a = attend::scaled_dot_product_attention(query, key, value, user);
  const attend::AttentionResult b =
      attend::scaled_dot_product_attention(query, key, value, built_in);

  // 3. Bit for bit.
  const bool same = std::memcmp(a.output.data(), b.output.data(), a.output.nbytes()) == 0;
  std::printf("documents as a user mask_mod: output[last] = %.6f; %s the built-in segment ids\n",
              a.output.data_as<float>()[a.output.numel() - 1],
              same ? "bit for bit equal to" : "DIFFERENT from");
  return same ? 0 : 1;
}
