// dropout.hpp: the keep/drop draw for weight (batch, query, key), shared by every kernel.
//
// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) is a
// counter-based generator: a draw is a pure function of (seed, counter), so any thread can
// compute any weight's draw in any order, and a backward pass can regenerate the mask from
// the seed without storing it. One Philox call yields four 32-bit words, used for four
// consecutive keys: counter = (key / 4, query, batch low, batch high), word = key % 4.
#pragma once

#include <cstdint>

namespace attend::detail {

struct PhiloxWords {
  uint32_t word[4];
};

inline PhiloxWords philox4x32_10(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2,
                                 uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53u} * c0;
    const uint64_t p1 = uint64_t{0xCD9E8D57u} * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// A weight is kept when its 32-bit draw is >= threshold; P(keep) = 1 - threshold / 2^32.
inline uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
}

// Draws for keys [4·group, 4·group + 4) of (batch, query).
inline PhiloxWords dropout_draws(uint64_t seed, int64_t batch, int64_t query, int64_t group) {
  const auto b = static_cast<uint64_t>(batch);
  return philox4x32_10(seed, static_cast<uint32_t>(group), static_cast<uint32_t>(query),
                       static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32));
}

// Calls dropped(c) for every c in [0, count) whose draw for (batch, query, first_key + c) falls
// below the threshold: one Philox call per group of four keys, from any first key.
template <class Dropped>
void for_each_dropped(uint64_t seed, uint32_t threshold, int64_t batch, int64_t query,
                      int64_t first_key, int64_t count, const Dropped& dropped) {
  for (int64_t c = 0; c < count;) {
    const int64_t key = first_key + c;
    const PhiloxWords draws = dropout_draws(seed, batch, query, key / 4);
    for (int64_t w = key % 4; w < 4 && c < count; ++w, ++c) {
      if (draws.word[w] < threshold) dropped(c);
    }
  }
}

inline bool dropout_keep(uint64_t seed, uint32_t threshold, int64_t batch, int64_t query,
                         int64_t key) {
  return dropout_draws(seed, batch, query, key / 4).word[key % 4] >= threshold;
}

}  // namespace attend::detail
