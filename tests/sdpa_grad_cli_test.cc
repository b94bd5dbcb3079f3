// sdpa_grad_cli_test: `attend sdpa --grad-out ... --grad-query ... --grad-key ... --grad-value
// ... [--grad-bias ...]` (run in-process through attend_cli_main) against PyTorch autograd of the
// listing in float64 (scripts/make_sdpa_grad_golden.py, tests/data/sdpa_grad/), and the bad
// uses of the gradient options: exit status 2, one "error: " line, no output file created or
// changed.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/npy.hpp"
#include "cli_in_process.hpp"

namespace attend {
namespace {

namespace fs = std::filesystem;

using attend::test::run_cli;

const std::string kDataDir = std::string(ATTEND_TEST_DATA_DIR) + "/sdpa_grad/";

std::vector<double> as_doubles(const Tensor& t) {
  Tensor f(DType::kFloat64, t.shape());
  convert(t.view(), f.view());
  return std::vector<double>(f.data_as<double>(), f.data_as<double>() + f.numel());
}

size_t at(int64_t i) { return static_cast<size_t>(i); }

class TemporaryDirectory {
 public:
  TemporaryDirectory() {
    std::string pattern = (fs::temp_directory_path() / "attend_sdpa_grad_test_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw Error("mkdtemp failed");
    path_ = pattern;
  }
  ~TemporaryDirectory() { fs::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

  // Sorted names of the files in the directory.
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path path_;
};

// --- The golden cases ------------------------------------------------------------------------

struct GoldenCase {
  std::string name;
  std::vector<std::string> flags;  // extra `attend sdpa` options from cases.txt
  double scale = 0.0;              // --scale, else 1/sqrt(E)
  double dropout = 0.0;            // --dropout
  bool causal = false;             // --causal
  bool has_mask = false, has_bias = false;
  Tensor query, key, value, mask, bias, grad_output;
  // Expected, float64: output, weights after dropout, softmax before dropout, gradients.
  Tensor output, weights, probabilities, grad_query, grad_key, grad_value, grad_bias;
};

std::string part_path(const std::string& name, const std::string& part) {
  return kDataDir + name + "_" + part + ".npy";
}

GoldenCase load_case(const std::string& line) {
  GoldenCase c;
  std::istringstream words(line);
  words >> c.name;
  for (std::string word; words >> word;) c.flags.push_back(word);
  for (size_t i = 0; i + 1 < c.flags.size(); ++i) {
    if (c.flags[i] == "--scale") c.scale = std::stod(c.flags[i + 1]);
    if (c.flags[i] == "--dropout") c.dropout = std::stod(c.flags[i + 1]);
  }
  const auto read = [&](const char* part) { return read_npy(part_path(c.name, part)); };
  c.query = read("query");
  c.key = read("key");
  c.value = read("value");
  c.grad_output = read("grad_out");
  c.causal = std::find(c.flags.begin(), c.flags.end(), "--causal") != c.flags.end();
  c.has_mask = fs::exists(part_path(c.name, "mask"));
  if (c.has_mask) c.mask = read("mask");
  c.has_bias = fs::exists(part_path(c.name, "bias"));
  if (c.has_bias) {
    c.bias = read("bias");
    c.grad_bias = read("grad_bias");
  }
  c.output = read("output");
  c.weights = read("weights");
  c.probabilities = read("probabilities");
  c.grad_query = read("grad_query");
  c.grad_key = read("grad_key");
  c.grad_value = read("grad_value");
  if (c.scale == 0.0) c.scale = 1.0 / std::sqrt(static_cast<double>(c.query.shape().back(0)));
  return c;
}

std::vector<GoldenCase> load_cases() {
  std::ifstream list(kDataDir + "cases.txt");
  if (!list) throw Error(kDataDir + "cases.txt: cannot open");
  std::vector<GoldenCase> cases;
  for (std::string line; std::getline(list, line);) {
    if (line.empty() || line[0] == '#') continue;
    cases.push_back(load_case(line));
  }
  return cases;
}

// --- Error model -----------------------------------------------------------------------------
//
// How far attend's gradients may be from the exact (float64) ones, element by element. First
// order, u = 2^-24 (float32 accumulation; the float64 reference errs less), γ_n = n·u/(1 − n·u)
// the bound of an n-term float32 sum relative to the sum of its terms' magnitudes, κ = 1/(1 − p)
// with dropout, P the softmax (before dropout; the golden "probabilities"). For query row i of
// batch b, with every norm over the row's vector:
//
//   A_i = |scale|·||q_i||·max_j ||k_j|| + max_j |bias_ij|     bound of the scores' terms
//   δ_i = (γ_E + 4u)·A_i                                      error of every score
//   ρ_i = 2δ_i + u·(A_i + log Lk) + (Lk + 8)·u                relative error of a recomputed
//        weight P_ij = exp(s_ij − lse_i): two scores' errors (forward and backward), the
//        float32 log-sum-exp (|lse_i| <= A_i + log Lk) and the softmax's own roundings
//   G_i = ||dO_i||·max_j ||v_j||                              bound of |dP̃_ij| and |D_i|/κ
//   ε_i = (2δ_i + (Lk + E + 8)·u)·max|v|·κ                    error of the output O before
//        it is stored (tests/error_model.hpp)
//   σ_i = κ·G_i·(3ρ_i + γ_Lk + 2γ_Ev + 4u) + Σ_e |dO_ie|·(ε_i + r_ie)
//        error of dS_ij / P_ij: of dP_ij − D_i (the Ev-term dot products, D_i from O or from
//        Σ_j P̃_ij·dP̃_ij) and of the product with P_ij; r_ie = 2^-10·|O_ie| + 2^-24 when O
//        is stored as float16 (D_i computed from it), else 0
//   m_i = 2κ·G_i                                              |dS_ij| <= P_ij·m_i
//
// Each gradient is a sum of products; its error is the propagated error of its operands plus
// the n-term sum's rounding. dS_ij is exactly 0 where key j is excluded for query i (mask or
// causal; masked_fill passes no gradient), so P_ij counts as 0 there in dQ, dK and dBias:
//
//   dQ_ie  = scale·Σ_j dS_ij·k_je:   |scale|·Σ_j P_ij·(σ_i + γ_Lk·m_i)·|k_je|
//   dK_je  = scale·Σ_i dS_ij·q_ie:   |scale|·Σ_i P_ij·(σ_i + γ_Lq·m_i)·|q_ie|
//   dV_je  = Σ_i P̃_ij·dO_ie:         κ·Σ_i P_ij·(ρ_i + γ_Lq + u)·|dO_ie|
//   dBias_t = Σ over the (b, i, j) broadcast onto t of dS_ij:  Σ P_ij·(σ_i + γ_N·m_i), N terms
//
// The tolerance is kSafety (4) times that, plus the rounding of the stored result (u·|x| for
// float32, a float16 ulp 2^-10·|x| + 2^-24 for float16). The forward output and weights get the
// forward's bounds ε_i (plus a float16 ulp of max|v|·κ) and ρ_i·w_ij. Fully excluded rows: P from
// the golden (1/Lk for the listing's uniform rows, 0 for --zero-masked-rows, where every tolerance
// of theirs is 0).
constexpr double kUnitRoundoff = 1.0 / 16777216.0;  // 2^-24
constexpr double kSafety = 4.0;
constexpr double kHalfUlp = 1.0 / 1024.0;
constexpr double kHalfSubnormalUlp = 5.9604644775390625e-8;  // 2^-24
constexpr double kWeightsFloor = 7.888609052210118e-31;      // 2^-100

double gamma_n(int64_t n) {
  const double nu = static_cast<double>(n) * kUnitRoundoff;
  return nu / (1.0 - nu);
}

// For every element of the broadcast (batch..., Lq, Lk), the flat index of `shape`'s element
// it reads (shape right-aligned, size-1 dimensions repeated).
std::vector<int64_t> broadcast_index(const Shape& full, const Shape& shape) {
  std::vector<int64_t> index(at(full.numel()));
  const int offset = full.rank() - shape.rank();
  for (int64_t flat = 0; flat < full.numel(); ++flat) {
    int64_t rest = flat, source = 0, stride = 1;
    for (int d = full.rank() - 1; d >= 0; --d) {
      const int64_t coordinate = rest % full[d];
      rest /= full[d];
      if (d >= offset) {
        const int64_t size = shape[d - offset];
        if (size != 1) source += coordinate * stride;
        stride *= size;
      }
    }
    index[at(flat)] = source;
  }
  return index;
}

struct Tolerances {
  std::vector<double> output, weights, grad_query, grad_key, grad_value, grad_bias;
};

double stored_rounding(DType dtype, double expected) {
  return dtype == DType::kFloat16 ? kHalfUlp * std::abs(expected) + kHalfSubnormalUlp
                                  : kUnitRoundoff * std::abs(expected);
}

Tolerances gradient_tolerances(const GoldenCase& c) {
  const int64_t Lq = c.query.shape().back(1), E = c.query.shape().back(0);
  const int64_t Lk = c.key.shape().back(1), Ev = c.value.shape().back(0);
  const int64_t batch = c.query.numel() / (Lq * E);
  const double u = kUnitRoundoff, keep = 1.0 / (1.0 - c.dropout), scale = std::abs(c.scale);
  const bool half = c.query.dtype() == DType::kFloat16;
  const std::vector<double> q = as_doubles(c.query), k = as_doubles(c.key), v = as_doubles(c.value),
                            dO = as_doubles(c.grad_output), P = as_doubles(c.probabilities);
  Shape full = c.query.shape();
  full[full.rank() - 1] = Lk;  // (batch..., Lq, Lk)
  std::vector<double> bias_values, mask_values;
  std::vector<int64_t> bias_of, mask_of;  // flat (b, i, j) → flat bias (mask) index
  if (c.has_bias) {
    bias_values = as_doubles(c.bias);
    bias_of = broadcast_index(full, c.bias.shape());
  }
  if (c.has_mask) {
    mask_values = as_doubles(c.mask);
    mask_of = broadcast_index(full, c.mask.shape());
  }
  const auto excluded = [&](int64_t row, int64_t i, int64_t j) {
    if (c.causal && j > i + (Lk - Lq)) return true;
    return c.has_mask && mask_values[at(mask_of[at(row * Lk + j)])] == 0.0;
  };
  const std::vector<double> output = as_doubles(c.output);
  const auto norm2 = [](const double* x, int64_t n) {
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += x[e] * x[e];
    return std::sqrt(sum);
  };

  Tolerances t;
  t.output.assign(at(batch * Lq * Ev), 0.0);
  t.weights.assign(at(batch * Lq * Lk), 0.0);
  t.grad_query.assign(q.size(), 0.0);
  t.grad_key.assign(k.size(), 0.0);
  t.grad_value.assign(v.size(), 0.0);
  std::vector<double> bias_error_sum(bias_values.size(), 0.0);  // Σ P·σ per bias element
  std::vector<double> bias_magnitude(bias_values.size(), 0.0);  // Σ P·m
  std::vector<int64_t> bias_terms(bias_values.size(), 0);
  for (int64_t b = 0; b < batch; ++b) {
    double max_key_norm = 0.0, max_value_norm = 0.0, max_value = 0.0;
    for (int64_t j = 0; j < Lk; ++j) {
      max_key_norm = std::max(max_key_norm, norm2(&k[at((b * Lk + j) * E)], E));
      max_value_norm = std::max(max_value_norm, norm2(&v[at((b * Lk + j) * Ev)], Ev));
      for (int64_t e = 0; e < Ev; ++e) {
        max_value = std::max(max_value, std::abs(v[at((b * Lk + j) * Ev + e)]));
      }
    }
    for (int64_t i = 0; i < Lq; ++i) {
      const int64_t row = b * Lq + i;
      double max_bias = 0.0;
      for (int64_t j = 0; j < Lk && c.has_bias; ++j) {
        max_bias = std::max(max_bias, std::abs(bias_values[at(bias_of[at(row * Lk + j)])]));
      }
      const double a = scale * norm2(&q[at(row * E)], E) * max_key_norm + max_bias;
      const double score_error = (gamma_n(E) + 4 * u) * a;
      const double weight_error =
          2 * score_error + u * (a + std::log(static_cast<double>(Lk))) + (Lk + 8) * u;
      const double g = norm2(&dO[at(row * Ev)], Ev) * max_value_norm;
      const double output_error = (2 * score_error + (Lk + E + 8) * u) * max_value * keep;
      // Error of D_i = dO_i · O_i from the error of the stored O (float16: rounded too).
      double output_error_in_d = 0.0;
      for (int64_t e = 0; e < Ev; ++e) {
        const double rounding =
            half ? kHalfUlp * std::abs(output[at(row * Ev + e)]) + kHalfSubnormalUlp : 0.0;
        output_error_in_d += std::abs(dO[at(row * Ev + e)]) * (output_error + rounding);
      }
      const double sigma =
          keep * g * (3 * weight_error + gamma_n(Lk) + 2 * gamma_n(Ev) + 4 * u) + output_error_in_d;
      const double m = 2 * keep * g;

      for (int64_t e = 0; e < Ev; ++e) {
        t.output[at(row * Ev + e)] =
            kSafety * output_error + (half ? kHalfUlp * max_value * keep + kHalfSubnormalUlp : 0.0);
      }
      for (int64_t j = 0; j < Lk; ++j) {
        const double p = P[at(row * Lk + j)];
        // dS_ij, and with it the error of dQ, dK and dBias, is 0 where the key is excluded.
        const double p_scores = excluded(row, i, j) ? 0.0 : p;
        const int64_t key_row = b * Lk + j;
        t.weights[at(row * Lk + j)] = kSafety * weight_error * p * keep + kWeightsFloor;
        for (int64_t e = 0; e < E; ++e) {
          t.grad_query[at(row * E + e)] +=
              scale * p_scores * (sigma + gamma_n(Lk) * m) * std::abs(k[at(key_row * E + e)]);
          t.grad_key[at(key_row * E + e)] +=
              scale * p_scores * (sigma + gamma_n(Lq) * m) * std::abs(q[at(row * E + e)]);
        }
        for (int64_t e = 0; e < Ev; ++e) {
          t.grad_value[at(key_row * Ev + e)] +=
              keep * p * (weight_error + gamma_n(Lq) + u) * std::abs(dO[at(row * Ev + e)]);
        }
        if (c.has_bias) {
          const size_t target = at(bias_of[at(row * Lk + j)]);
          bias_error_sum[target] += p_scores * sigma;
          bias_magnitude[target] += p_scores * m;
          bias_terms[target] += 1;
        }
      }
    }
  }
  // Safety factor and the rounding of the stored results.
  const auto finish = [](std::vector<double>& tolerance, const Tensor& expected, DType stored) {
    const std::vector<double> x = as_doubles(expected);
    for (size_t n = 0; n < tolerance.size(); ++n) {
      tolerance[n] = kSafety * tolerance[n] + stored_rounding(stored, x[n]);
    }
  };
  finish(t.grad_query, c.grad_query, c.query.dtype());
  finish(t.grad_key, c.grad_key, c.key.dtype());
  finish(t.grad_value, c.grad_value, c.value.dtype());
  if (c.has_bias) {
    t.grad_bias.resize(bias_values.size());
    for (size_t n = 0; n < bias_values.size(); ++n) {
      t.grad_bias[n] = bias_error_sum[n] + gamma_n(bias_terms[n]) * bias_magnitude[n];
    }
    finish(t.grad_bias, c.grad_bias, c.bias.dtype());
  }
  return t;
}

// --- Comparison ------------------------------------------------------------------------------

// "(1, 0, 3)" for flat index `flat` of `shape`.
std::string index_text(const Shape& shape, int64_t flat) {
  std::vector<int64_t> coordinates(at(shape.rank()));
  for (int d = shape.rank() - 1; d >= 0; --d) {
    coordinates[at(d)] = flat % shape[d];
    flat /= shape[d];
  }
  std::string text = "(";
  for (size_t d = 0; d < coordinates.size(); ++d) {
    text += (d ? ", " : "") + std::to_string(coordinates[d]);
  }
  return text + ")";
}

// "" when every element of `got` is within `tolerance` of `expected`; otherwise the count of
// elements outside and the worst one (largest |got − expected| / tolerance).
std::string compare(const std::string& what, const Tensor& got, const Tensor& expected,
                    const std::vector<double>& tolerance) {
  if (got.shape() != expected.shape()) {
    return what + ": shape " + got.shape().str() + ", expected " + expected.shape().str();
  }
  const std::vector<double> g = as_doubles(got), x = as_doubles(expected);
  int64_t outside = 0, worst = -1;
  double worst_ratio = 0.0;
  for (size_t n = 0; n < g.size(); ++n) {
    const double difference = std::abs(g[n] - x[n]);
    const double ratio = tolerance[n] > 0 ? difference / tolerance[n] : (difference > 0) * 1e300;
    if (!(difference <= tolerance[n])) {
      ++outside;
      if (!(ratio <= worst_ratio)) {
        worst_ratio = ratio;
        worst = static_cast<int64_t>(n);
      }
    }
  }
  if (outside == 0) return "";
  std::ostringstream message;
  message.precision(9);
  message << what << ": " << outside << " of " << g.size() << " elements outside the tolerance; "
          << "worst at " << index_text(got.shape(), worst) << ": got " << g[at(worst)]
          << ", expected " << x[at(worst)] << ", tolerance " << tolerance[at(worst)];
  return message.str();
}

// The largest tolerance relative to the largest expected magnitude: the tolerance could catch
// an error of this fraction of the gradient's size.
double tolerance_fraction(const Tensor& expected, const std::vector<double>& tolerance) {
  double largest = 0.0;
  for (double x : as_doubles(expected)) largest = std::max(largest, std::abs(x));
  return *std::max_element(tolerance.begin(), tolerance.end()) / largest;
}

// --- The golden runs -------------------------------------------------------------------------

std::vector<std::string> input_arguments(const GoldenCase& c) {
  std::vector<std::string> arguments = {"sdpa",
                                        "--query",
                                        part_path(c.name, "query"),
                                        "--key",
                                        part_path(c.name, "key"),
                                        "--value",
                                        part_path(c.name, "value")};
  if (c.has_mask) arguments.insert(arguments.end(), {"--mask", part_path(c.name, "mask")});
  if (c.has_bias) arguments.insert(arguments.end(), {"--bias", part_path(c.name, "bias")});
  arguments.insert(arguments.end(), c.flags.begin(), c.flags.end());
  return arguments;
}

// Runs every golden case with `--backend backend` (forward and backward) and compares.
void expect_golden_gradients(const std::string& backend) {
  const std::vector<GoldenCase> cases = load_cases();
  ASSERT_GE(cases.size(), 10u);
  for (const GoldenCase& c : cases) {
    SCOPED_TRACE("case " + c.name + ", backend " + backend);
    TemporaryDirectory directory;
    std::vector<std::string> arguments = input_arguments(c);
    arguments.insert(arguments.end(),
                     {"--out", directory / "O.npy", "--out-weights", directory / "W.npy", "--grad-out",
                      part_path(c.name, "grad_out"), "--grad-query", directory / "dQ.npy",
                      "--grad-key", directory / "dK.npy", "--grad-value", directory / "dV.npy",
                      "--threads", "2", "--backend", backend});
    if (c.has_bias) arguments.insert(arguments.end(), {"--grad-bias", directory / "dB.npy"});
    const test::CliRun run = run_cli(arguments);
    ASSERT_EQ(run.exit_status, 0) << run.err;
    EXPECT_EQ(run.err, "");
    EXPECT_NE(run.out.find("dV.npy"), std::string::npos) << run.out;

    const Tensor output = read_npy(directory / "O.npy");
    const Tensor weights = read_npy(directory / "W.npy");
    const Tensor grad_query = read_npy(directory / "dQ.npy");
    const Tensor grad_key = read_npy(directory / "dK.npy");
    const Tensor grad_value = read_npy(directory / "dV.npy");
    EXPECT_EQ(output.dtype(), c.query.dtype());
    EXPECT_EQ(grad_query.dtype(), c.query.dtype());
    EXPECT_EQ(grad_key.dtype(), c.key.dtype());
    EXPECT_EQ(grad_value.dtype(), c.value.dtype());

    const Tolerances tolerance = gradient_tolerances(c);
    for (const std::string& failure :
         {compare("output", output, c.output, tolerance.output),
          compare("weights", weights, c.weights, tolerance.weights),
          compare("grad_query", grad_query, c.grad_query, tolerance.grad_query),
          compare("grad_key", grad_key, c.grad_key, tolerance.grad_key),
          compare("grad_value", grad_value, c.grad_value, tolerance.grad_value)}) {
      EXPECT_EQ(failure, "");
    }
    if (c.has_bias) {
      const Tensor grad_bias = read_npy(directory / "dB.npy");
      EXPECT_EQ(grad_bias.dtype(), c.bias.dtype());
      EXPECT_EQ(compare("grad_bias", grad_bias, c.grad_bias, tolerance.grad_bias), "");
    }

    // The dropout draws are the script's exactly: a weight is zero in both or in neither.
    const std::vector<double> got_weights = as_doubles(weights);
    const std::vector<double> expected_weights = as_doubles(c.weights);
    int64_t zero_pattern_differences = 0;
    for (size_t n = 0; n < got_weights.size() && weights.shape() == c.weights.shape(); ++n) {
      zero_pattern_differences += (got_weights[n] == 0.0) != (expected_weights[n] == 0.0);
    }
    EXPECT_EQ(zero_pattern_differences, 0) << "weights zeroed (dropped or masked) differently";

    // The tolerances can catch a 1% error of every gradient. 5% with float16 inputs: D_i comes
    // from the output rounded to float16 (2^-11 relative), and dS = P·(dP − D) cancels, so the
    // gradients are small next to the error that rounding may carry into them.
    const double meaningful = c.query.dtype() == DType::kFloat16 ? 5e-2 : 1e-2;
    EXPECT_LT(tolerance_fraction(c.grad_query, tolerance.grad_query), meaningful);
    EXPECT_LT(tolerance_fraction(c.grad_key, tolerance.grad_key), meaningful);
    EXPECT_LT(tolerance_fraction(c.grad_value, tolerance.grad_value), meaningful);
    if (c.has_bias) {
      EXPECT_LT(tolerance_fraction(c.grad_bias, tolerance.grad_bias),
                c.bias.dtype() == DType::kFloat16 ? 5e-2 : 1e-2);
    }
  }
}

// The float64 reference, then the default choice (the fused kernels where they accept the
// problem).
TEST(SdpaGradCli, ReferenceGradientsMatchPyTorchAutograd) { expect_golden_gradients("reference"); }
TEST(SdpaGradCli, GradientsMatchPyTorchAutograd) { expect_golden_gradients("auto"); }

// The comparison can fail: an element moved by twice its tolerance is reported with its index,
// one moved by half is not.
TEST(SdpaGradCli, ComparisonReportsTheWorstElement) {
  const GoldenCase c = load_case("bias_heads_broadcast --causal");
  const Tolerances tolerance = gradient_tolerances(c);
  Tensor moved(DType::kFloat64, c.grad_key.shape());
  convert(c.grad_key.view(), moved.view());
  const int64_t element = 7;
  const double step = tolerance.grad_key[at(element)];
  ASSERT_GT(step, 0.0);
  moved.data_as<double>()[element] += 0.5 * step;
  EXPECT_EQ(compare("grad_key", moved, c.grad_key, tolerance.grad_key), "");
  moved.data_as<double>()[element] += 1.5 * step;
  const std::string failure = compare("grad_key", moved, c.grad_key, tolerance.grad_key);
  EXPECT_NE(failure.find("1 of"), std::string::npos) << failure;
  EXPECT_NE(failure.find(index_text(c.grad_key.shape(), element)), std::string::npos) << failure;
}

TEST(SdpaGradCli, BroadcastIndexRepeatsSizeOneDimensions) {
  // (2, 3, 2) reading a (3, 1) array: element (b, i, j) reads i.
  const std::vector<int64_t> index = broadcast_index(Shape({2, 3, 2}), Shape({3, 1}));
  const std::vector<int64_t> expected = {0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2};
  EXPECT_EQ(index, expected);
}

// --- Bad uses of the gradient options --------------------------------------------------------

// Runs `attend sdpa` on the "bias_full" case with `extra` options; every output goes to
// `directory`. Expects exit 2, one "error: " line containing `phrase`, and the directory
// unchanged (pre-existing outputs byte-identical).
void expect_clean_failure(const std::vector<std::string>& extra, const std::string& phrase) {
  SCOPED_TRACE(phrase);
  TemporaryDirectory directory;
  std::ofstream(directory / "O.npy") << "previous output";
  std::ofstream(directory / "dQ.npy") << "previous gradient";
  write_npy(directory / "short_dO.npy", Tensor::zeros(DType::kFloat32, Shape({2, 4, 8})).view());
  write_npy(directory / "half_dO.npy", Tensor::zeros(DType::kFloat16, Shape({2, 5, 8})).view());
  const std::vector<std::string> before = directory.listing();
  std::vector<std::string> arguments = {"sdpa",
                                        "--query",
                                        part_path("bias_full", "query"),
                                        "--key",
                                        part_path("bias_full", "key"),
                                        "--value",
                                        part_path("bias_full", "value"),
                                        "--out",
                                        directory / "O.npy"};
  for (const std::string& word : extra) {
    // "@NAME" is a file in the temporary directory, "%PART" one of the golden case's.
    if (!word.empty() && word[0] == '@') {
      arguments.push_back(directory / word.substr(1));
    } else if (!word.empty() && word[0] == '%') {
      arguments.push_back(part_path("bias_full", word.substr(1)));
    } else {
      arguments.push_back(word);
    }
  }
  const test::CliRun run = run_cli(arguments);
  EXPECT_EQ(run.exit_status, 2) << run.err;
  EXPECT_EQ(run.err.rfind("error: ", 0), 0u) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_NE(run.err.find(phrase), std::string::npos)
      << "expected '" << phrase << "' in " << run.err;
  EXPECT_EQ(run.out, "");
  EXPECT_EQ(directory.listing(), before) << "a file was created or removed";
  EXPECT_EQ(test::read_file_bytes(directory / "O.npy"), "previous output");
  EXPECT_EQ(test::read_file_bytes(directory / "dQ.npy"), "previous gradient");
}

TEST(SdpaGradCli, BadGradientOptionsFailCleanly) {
  const std::vector<std::string> all_outputs = {"--grad-query", "@dQ.npy",      "--grad-key",
                                                "@dK.npy",      "--grad-value", "@dV.npy"};
  const auto with_outputs = [&](std::vector<std::string> words) {
    words.insert(words.end(), all_outputs.begin(), all_outputs.end());
    return words;
  };
  // Gradient files without --grad-out.
  expect_clean_failure({"--grad-query", "@dQ.npy"}, "--grad-query needs --grad-out");
  expect_clean_failure({"--bias", "%bias", "--grad-bias", "@dB.npy"},
                       "--grad-bias needs --grad-out");
  // --grad-out without every gradient file.
  expect_clean_failure({"--grad-out", "%grad_out", "--grad-query", "@dQ.npy"},
                       "missing: --grad-key, --grad-value");
  // --grad-bias without --bias.
  expect_clean_failure(with_outputs({"--grad-out", "%grad_out", "--grad-bias", "@dB.npy"}),
                       "--grad-bias needs --bias");
  // dO of the wrong shape or dtype, or missing.
  expect_clean_failure(with_outputs({"--grad-out", "@short_dO.npy"}),
                       "short_dO.npy: grad_output shape (2, 4, 8)");
  expect_clean_failure(with_outputs({"--grad-out", "@half_dO.npy"}), "dtype float16");
  expect_clean_failure(with_outputs({"--grad-out", "@nothere.npy"}), "nothere.npy: cannot open");
  // Two outputs naming one file; an output directory that does not exist.
  expect_clean_failure({"--grad-out", "%grad_out", "--grad-query", "@dQ.npy", "--grad-key",
                        "@dQ.npy", "--grad-value", "@dV.npy"},
                       "same file");
  expect_clean_failure({"--grad-out", "%grad_out", "--grad-query", "@dQ.npy", "--grad-key",
                        "@dK.npy", "--grad-value", "@nodir/dV.npy"},
                       "does not exist");
}

}  // namespace
}  // namespace attend
