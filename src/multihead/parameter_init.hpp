// parameter_init.hpp: seeded initializers for learned parameters (Xavier, Kaiming, normal).
//
// A splitmix64 stream keyed by (seed, stream id) gives the same parameters for the same seed on
// every machine and thread count. It does not reproduce torch's generator bit for bit.
#pragma once

#include <cmath>
#include <cstdint>

#include "attend/tensor.hpp"

namespace attend::detail {

class ParameterRandom {
 public:
  // `stream` separates the parameters of one module (e.g. 0 = in_proj, 1 = out_proj).
  ParameterRandom(uint64_t seed, uint64_t stream)
      : state_(seed ^ (0xD1B54A32D192ED03ull * (stream + 1))) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double low, double high) { return low + (high - low) * uniform01(); }
  // Standard normal by Box-Muller (one value per call; the second is dropped for simplicity).
  double normal() {
    const double u1 = 1.0 - uniform01();  // (0, 1]
    const double u2 = uniform01();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

// Fills a contiguous float32 tensor with U(-bound, bound).
inline void fill_uniform(Tensor& tensor, double bound, ParameterRandom& random) {
  float* values = tensor.data_as<float>();
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    values[i] = static_cast<float>(random.uniform(-bound, bound));
  }
}

// Xavier (Glorot) uniform for a (fan_out, fan_in) weight: bound = sqrt(6 / (fan_in + fan_out)).
inline void fill_xavier_uniform(Tensor& weight, ParameterRandom& random) {
  const double fan_out = static_cast<double>(weight.shape()[0]);
  const double fan_in = static_cast<double>(weight.numel()) / fan_out;
  fill_uniform(weight, std::sqrt(6.0 / (fan_in + fan_out)), random);
}

// Fills a contiguous float32 tensor with N(0, std_dev²).
inline void fill_normal(Tensor& tensor, double std_dev, ParameterRandom& random) {
  float* values = tensor.data_as<float>();
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    values[i] = static_cast<float>(std_dev * random.normal());
  }
}

}  // namespace attend::detail
