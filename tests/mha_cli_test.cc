// mha_cli_test: `attend mha` (run in-process through attend_cli_main) against
// torch.nn.MultiheadAttention goldens (scripts/make_mha_cli_golden.py, tests/data/mha_cli/), and
// its bad inputs: exit status 2, exactly one "error: " line, no output file created or changed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/npy.hpp"
#include "attend/safetensors.hpp"
#include "cli_in_process.hpp"

namespace attend {
namespace {

namespace fs = std::filesystem;

const std::string kDataDir = std::string(ATTEND_TEST_DATA_DIR) + "/mha_cli/";

using attend::test::run_cli;

std::string read_bytes(const fs::path& path) {
  return attend::test::read_file_bytes(path.string());
}

std::vector<double> as_doubles(const Tensor& t) {
  Tensor f(DType::kFloat64, t.shape());
  convert(t.view(), f.view());
  return std::vector<double>(f.data_as<double>(), f.data_as<double>() + f.numel());
}

using attend::test::TemporaryDirectory;

// --- The golden cases ------------------------------------------------------------------------

struct GoldenCase {
  std::string name;
  int64_t heads = 0;
  bool causal = false, average = true;
  bool cross = false;
  std::map<std::string, Tensor> parameters;
  Tensor query, key, value, key_padding_mask, mask, output, weights;
};

bool has_part(const std::string& name, const std::string& part) {
  return fs::exists(kDataDir + name + "_" + part + ".npy");
}
std::string part_path(const std::string& name, const std::string& part) {
  return kDataDir + name + "_" + part + ".npy";
}

GoldenCase load_case(const std::string& name) {
  GoldenCase c;
  c.name = name;
  SafetensorsContents contents = load_safetensors(kDataDir + name + ".safetensors");
  c.heads = std::stoll(contents.metadata.at("heads"));
  c.causal = contents.metadata.at("causal") == "1";
  c.average = contents.metadata.at("average") == "1";
  c.parameters = std::move(contents.tensors);
  c.query = read_npy(part_path(name, "query"));
  c.cross = has_part(name, "key");
  c.key = read_npy(part_path(name, c.cross ? "key" : "query"));
  c.value = read_npy(part_path(name, c.cross ? "value" : "query"));
  if (has_part(name, "key_padding_mask")) {
    c.key_padding_mask = read_npy(part_path(name, "key_padding_mask"));
  }
  if (has_part(name, "mask")) c.mask = read_npy(part_path(name, "mask"));
  c.output = read_npy(part_path(name, "output"));
  c.weights = read_npy(part_path(name, "weights"));
  return c;
}

std::vector<std::string> golden_arguments(const GoldenCase& c, const std::string& out,
                                          const std::string& weights) {
  std::vector<std::string> arguments = {"mha",
                                        "--query",
                                        part_path(c.name, "query"),
                                        "--weights",
                                        kDataDir + c.name + ".safetensors",
                                        "--heads",
                                        std::to_string(c.heads),
                                        "--out",
                                        out,
                                        "--out-weights",
                                        weights,
                                        "--threads",
                                        "2"};
  if (c.cross) {
    arguments.insert(arguments.end(),
                     {"--key", part_path(c.name, "key"), "--value", part_path(c.name, "value")});
  }
  if (!c.key_padding_mask.empty()) {
    arguments.insert(arguments.end(),
                     {"--key-padding-mask", part_path(c.name, "key_padding_mask")});
  }
  if (!c.mask.empty()) arguments.insert(arguments.end(), {"--mask", part_path(c.name, "mask")});
  if (c.causal) arguments.push_back("--causal");
  if (c.average) arguments.push_back("--average-heads");
  return arguments;
}

// The module in float64, from the state_dict, with the error model's magnitudes.
//
// Error model (first order, u = 2^-24; a float32 sum of n terms errs by at most
// (n + 2)·u·Σ|terms|). Projections: δq = (K_in + 2)·u·(Σ|W||x| + |b|). Scores:
// δs = scale·Σ_d (δq_d|k_d| + |q_d|δk_d) + (D + 2)·u·scale·Σ|q_d k_d|. Softmax:
// δw_j = w_j·(δs_j + Σ_j' w_j' δs_j') + (S + 2)·u·w_j. Heads: δh = Σ_j (δw_j|v_j| + w_j δv_j) +
// (S + 2)·u·Σ w|v|. Output: δy = Σ|W_O||δh| + (E + 2)·u·(|b_O| + Σ|W_O||h|). torch errs as much
// as attend (factor 2), times a safety factor 2. A float16 output adds half a float16 ulp.
struct Expected {
  std::vector<double> output_tolerance, weights_tolerance;  // shapes of the goldens
};

Expected error_model(const GoldenCase& c) {
  const auto parameter = [&](const std::string& name) {
    const auto found = c.parameters.find(name);
    return found == c.parameters.end() ? std::vector<double>() : as_doubles(found->second);
  };
  const std::vector<double> out_weight = parameter("out_proj.weight");
  const std::vector<double> out_bias = parameter("out_proj.bias");
  const std::vector<double> in_bias = parameter("in_proj_bias");
  const int64_t E = static_cast<int64_t>(std::lround(std::sqrt(double(out_weight.size()))));
  const int64_t H = c.heads, D = E / H;
  const int64_t N = c.query.shape()[0], L = c.query.shape()[1], S = c.key.shape()[1];
  const int64_t kdim = c.key.shape()[2], vdim = c.value.shape()[2];
  std::vector<double> wq, wk, wv;
  if (c.parameters.count("in_proj_weight")) {
    const std::vector<double> packed = parameter("in_proj_weight");
    wq.assign(packed.begin(), packed.begin() + E * E);
    wk.assign(packed.begin() + E * E, packed.begin() + 2 * E * E);
    wv.assign(packed.begin() + 2 * E * E, packed.end());
  } else {
    wq = parameter("q_proj_weight");
    wk = parameter("k_proj_weight");
    wv = parameter("v_proj_weight");
  }
  const double u = std::ldexp(1.0, -24), scale = 1.0 / std::sqrt(double(D));
  const std::vector<double> x_query = as_doubles(c.query), x_key = as_doubles(c.key),
                            x_value = as_doubles(c.value);
  auto at = [](int64_t i) { return static_cast<size_t>(i); };

  // Projections (N, length, E): value and magnitude Σ|W||x| + |b|.
  struct Projected {
    std::vector<double> value, magnitude;
    int64_t depth;
  };
  auto project = [&](const std::vector<double>& x, int64_t rows, int64_t in,
                     const std::vector<double>& weight, int64_t bias_offset) {
    Projected p{std::vector<double>(at(rows * E)), std::vector<double>(at(rows * E)), in};
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < E; ++j) {
        const double b = in_bias.empty() ? 0.0 : in_bias[at(bias_offset + j)];
        double sum = b, magnitude = std::abs(b);
        for (int64_t k = 0; k < in; ++k) {
          sum += weight[at(j * in + k)] * x[at(r * in + k)];
          magnitude += std::abs(weight[at(j * in + k)] * x[at(r * in + k)]);
        }
        p.value[at(r * E + j)] = sum;
        p.magnitude[at(r * E + j)] = magnitude;
      }
    }
    return p;
  };
  const Projected q = project(x_query, N * L, E, wq, 0);
  const Projected k = project(x_key, N * S, kdim, wk, E);
  const Projected v = project(x_value, N * S, vdim, wv, 2 * E);

  const auto keeps = [&](int64_t n, int64_t h, int64_t i, int64_t j) {
    if (c.causal && j > i + (S - L)) return false;
    if (!c.key_padding_mask.empty() && c.key_padding_mask.data_as<uint8_t>()[n * S + j] == 0) {
      return false;
    }
    if (!c.mask.empty() && c.mask.data_as<uint8_t>()[((n * H + h) * L + i) * S + j] == 0) {
      return false;
    }
    return true;
  };

  std::vector<double> weights(at(N * H * L * S)), weights_error(weights.size());
  std::vector<double> head_value(at(N * L * E)), head_error(head_value.size());
  std::vector<double> scores(at(S)), score_error(at(S));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        const int64_t q_row = (n * L + i) * E + h * D;
        double row_max = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          const int64_t k_row = (n * S + j) * E + h * D;
          double dot = 0, propagated = 0, magnitude = 0;
          for (int64_t d = 0; d < D; ++d) {
            const double qd = q.value[at(q_row + d)], kd = k.value[at(k_row + d)];
            dot += qd * kd;
            propagated += double(q.depth + 2) * u * q.magnitude[at(q_row + d)] * std::abs(kd) +
                          std::abs(qd) * double(k.depth + 2) * u * k.magnitude[at(k_row + d)];
            magnitude += std::abs(qd * kd);
          }
          scores[at(j)] = keeps(n, h, i, j) ? scale * dot : -1e9;
          score_error[at(j)] =
              keeps(n, h, i, j) ? scale * (propagated + double(D + 2) * u * magnitude) : 0.0;
          row_max = std::max(row_max, scores[at(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += std::exp(scores[at(j)] - row_max);
        const int64_t w_row = ((n * H + h) * L + i) * S;
        double weighted_score_error = 0;
        for (int64_t j = 0; j < S; ++j) {
          weights[at(w_row + j)] = std::exp(scores[at(j)] - row_max) / sum;
          weighted_score_error += weights[at(w_row + j)] * score_error[at(j)];
        }
        for (int64_t j = 0; j < S; ++j) {
          const double w = weights[at(w_row + j)];
          weights_error[at(w_row + j)] =
              w * (score_error[at(j)] + weighted_score_error + double(S + 2) * u);
        }
        for (int64_t d = 0; d < D; ++d) {
          double value = 0, error = 0, magnitude = 0;
          for (int64_t j = 0; j < S; ++j) {
            const int64_t v_index = (n * S + j) * E + h * D + d;
            const double w = weights[at(w_row + j)], vd = v.value[at(v_index)];
            value += w * vd;
            error += weights_error[at(w_row + j)] * std::abs(vd) +
                     w * double(v.depth + 2) * u * v.magnitude[at(v_index)];
            magnitude += w * std::abs(vd);
          }
          head_value[at(q_row + d)] = value;
          head_error[at(q_row + d)] = error + double(S + 2) * u * magnitude;
        }
      }
    }
  }
  constexpr double kFactor = 4.0;  // torch and attend (2) times safety (2)
  const bool half_output = c.query.dtype() == DType::kFloat16;
  const std::vector<double> expected_output = as_doubles(c.output);
  Expected e;
  e.output_tolerance.resize(at(N * L * E));
  for (int64_t r = 0; r < N * L; ++r) {
    for (int64_t j = 0; j < E; ++j) {
      double propagated = 0, magnitude = out_bias.empty() ? 0.0 : std::abs(out_bias[at(j)]);
      for (int64_t m = 0; m < E; ++m) {
        const double w = std::abs(out_weight[at(j * E + m)]);
        propagated += w * head_error[at(r * E + m)];
        magnitude += w * std::abs(head_value[at(r * E + m)]);
      }
      double tolerance = kFactor * (propagated + double(E + 2) * u * magnitude);
      if (half_output) {  // rounding to float16: half an ulp, 2^-11 relative (2^-25 subnormal)
        tolerance += std::ldexp(1.0, -11) * (std::abs(expected_output[at(r * E + j)]) + tolerance) +
                     std::ldexp(1.0, -25);
      }
      e.output_tolerance[at(r * E + j)] = tolerance;
    }
  }
  if (c.average) {  // the mean over heads, plus its own rounding
    e.weights_tolerance.assign(at(N * L * S), 0.0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t p = 0; p < L * S; ++p) {
          const size_t from = at((n * H + h) * L * S + p);
          e.weights_tolerance[at(n * L * S + p)] +=
              kFactor * (weights_error[from] + double(H + 2) * u * weights[from]) / double(H);
        }
      }
    }
  } else {
    for (double error : weights_error) e.weights_tolerance.push_back(kFactor * error);
  }
  for (double& tolerance : e.weights_tolerance) tolerance += 1e-30;
  return e;
}

// Compares got (any float dtype) with expected (float32) elementwise, printing the worst.
void expect_close(const Tensor& got, const Tensor& expected, const std::vector<double>& tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.shape(), expected.shape()) << what;
  const std::vector<double> g = as_doubles(got), e = as_doubles(expected);
  ASSERT_EQ(tolerance.size(), e.size()) << what;
  double worst_ratio = 0, largest_tolerance = 0, largest_expected = 0;
  size_t worst = 0;
  for (size_t i = 0; i < e.size(); ++i) {
    const double ratio = std::abs(g[i] - e[i]) / tolerance[i];
    if (!(ratio <= worst_ratio)) {  // also catches NaN
      worst_ratio = std::isnan(ratio) ? INFINITY : ratio;
      worst = i;
    }
    largest_tolerance = std::max(largest_tolerance, tolerance[i]);
    largest_expected = std::max(largest_expected, std::abs(e[i]));
  }
  EXPECT_LE(worst_ratio, 1.0) << what << ": worst element " << worst << " of shape "
                              << expected.shape().str() << ": got " << g[worst] << ", expected "
                              << e[worst] << ", tolerance " << tolerance[worst];
  // The tolerances must be able to catch a real error.
  EXPECT_LT(largest_tolerance, 1e-2 * largest_expected) << what << ": tolerance too loose";
}

class MhaCliGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(MhaCliGolden, MatchesPyTorch) {
  const GoldenCase c = load_case(GetParam());
  TemporaryDirectory directory;
  const std::string out = directory / "O.npy", weights = directory / "A.npy";
  const attend::test::CliRun run = run_cli(golden_arguments(c, out, weights));
  ASSERT_EQ(run.exit_status, 0) << run.err;
  EXPECT_EQ(run.err, "");
  const Tensor got_output = read_npy(out), got_weights = read_npy(weights);
  EXPECT_EQ(got_output.dtype(), c.query.dtype()) << "the output has the query's dtype";
  EXPECT_EQ(got_weights.dtype(), DType::kFloat32);
  const Expected e = error_model(c);
  expect_close(got_output, c.output, e.output_tolerance, c.name + " output");
  expect_close(got_weights, c.weights, e.weights_tolerance, c.name + " weights");
}

TEST_P(MhaCliGolden, OneThreadGivesTheSameBits) {
  const GoldenCase c = load_case(GetParam());
  TemporaryDirectory directory;
  std::vector<std::string> two = golden_arguments(c, directory / "O2.npy", directory / "A2.npy");
  std::vector<std::string> one = golden_arguments(c, directory / "O1.npy", directory / "A1.npy");
  *(std::find(one.begin(), one.end(), "--threads") + 1) = "1";
  ASSERT_EQ(run_cli(two).exit_status, 0);
  ASSERT_EQ(run_cli(one).exit_status, 0);
  EXPECT_EQ(read_bytes(directory / "O1.npy"), read_bytes(directory / "O2.npy"));
  EXPECT_EQ(read_bytes(directory / "A1.npy"), read_bytes(directory / "A2.npy"));
}

INSTANTIATE_TEST_SUITE_P(PyTorch, MhaCliGolden,
                         ::testing::Values("self", "cross_kdim_vdim", "key_padding", "causal",
                                           "mask_and_padding", "no_bias", "half_query"),
                         [](const auto& info) { return info.param; });

// --- Bad inputs --------------------------------------------------------------------------------

class MhaCliBadInput : public ::testing::Test {
 protected:
  // A self-attention run of the "self" case writing into the temporary directory.
  std::vector<std::string> arguments(const std::string& weights_file) const {
    return {"mha",
            "--query",
            part_path("self", "query"),
            "--weights",
            weights_file,
            "--heads",
            "4",
            "--out",
            out_path(),
            "--out-weights",
            weights_out_path()};
  }
  std::string out_path() const { return directory_ / "O.npy"; }
  std::string weights_out_path() const { return directory_ / "A.npy"; }
  std::string golden_weights() const { return kDataDir + "self.safetensors"; }

  // The "self" state_dict with `edit` applied, saved in the temporary directory.
  template <typename Edit>
  std::string edited_weights(Edit edit) const {
    SafetensorsContents contents = load_safetensors(golden_weights());
    std::map<std::string, Tensor> tensors = std::move(contents.tensors);
    edit(tensors);
    std::map<std::string, TensorView> views;
    for (const auto& [name, tensor] : tensors) views[name] = tensor.view();
    const std::string path = directory_ / "edited.safetensors";
    save_safetensors(path, views);
    return path;
  }

  // Exit status 2, one "error: " line mentioning `needle`, no output file.
  void expect_refused(const std::vector<std::string>& words, const std::string& needle) const {
    const attend::test::CliRun run = run_cli(words);
    EXPECT_EQ(run.exit_status, 2);
    EXPECT_EQ(run.err.rfind("error: ", 0), 0u) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(needle), std::string::npos)
        << "expected '" << needle << "' in " << run.err;
    EXPECT_EQ(run.out, "");
    EXPECT_FALSE(fs::exists(out_path()));
    EXPECT_FALSE(fs::exists(weights_out_path()));
    for (const auto& entry : fs::directory_iterator(directory_.path())) {
      EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos)
          << "temporary file left: " << entry.path();
    }
  }

  TemporaryDirectory directory_;
};

TEST_F(MhaCliBadInput, MissingWeightTensor) {
  expect_refused(arguments(edited_weights([](auto& t) { t.erase("out_proj.bias"); })),
                 "out_proj.bias");
  expect_refused(arguments(edited_weights([](auto& t) { t.erase("in_proj_weight"); })),
                 "in_proj_weight");
  expect_refused(arguments(edited_weights([](auto& t) { t.erase("out_proj.weight"); })),
                 "out_proj.weight");
}

TEST_F(MhaCliBadInput, WrongTensorShape) {
  expect_refused(arguments(edited_weights([](auto& t) {
                   t["in_proj_bias"] = Tensor::zeros(DType::kFloat32, Shape({47}));
                 })),
                 "in_proj_bias");
  expect_refused(arguments(edited_weights([](auto& t) {
                   t["out_proj.weight"] = Tensor::zeros(DType::kFloat32, Shape({16, 8}));
                 })),
                 "out_proj.weight");
}

TEST_F(MhaCliBadInput, MissingFiles) {
  expect_refused(arguments(directory_ / "absent.safetensors"), "absent.safetensors");
  std::vector<std::string> words = arguments(golden_weights());
  words[2] = directory_ / "absent_query.npy";
  expect_refused(words, "--query");
}

TEST_F(MhaCliBadInput, HeadsNotDividingEmbedDim) {
  std::vector<std::string> words = arguments(golden_weights());
  words[6] = "3";
  expect_refused(words, "--heads 3");
  words[6] = "0";
  expect_refused(words, "--heads");
}

TEST_F(MhaCliBadInput, OutputDirectoryMissing) {
  std::vector<std::string> words = arguments(golden_weights());
  words[8] = (directory_.path() / "missing" / "O.npy").string();
  expect_refused(words, "does not exist");
}

TEST_F(MhaCliBadInput, BadMasksAndShapes) {
  const std::string float_mask = directory_ / "float_mask.npy";
  write_npy(float_mask, Tensor::zeros(DType::kFloat32, Shape({2, 5})).view());
  std::vector<std::string> words = arguments(golden_weights());
  words.insert(words.end(), {"--key-padding-mask", float_mask});
  expect_refused(words, "--key-padding-mask");
  fs::remove(float_mask);

  const std::string short_mask = directory_ / "short_mask.npy";
  write_npy(short_mask, Tensor::zeros(DType::kUInt8, Shape({2, 4})).view());
  words = arguments(golden_weights());
  words.insert(words.end(), {"--key-padding-mask", short_mask});
  expect_refused(words, "key_padding_mask");
  fs::remove(short_mask);

  // Query features (16) do not match kdim (12) of a cross-attention module.
  words = arguments(kDataDir + "cross_kdim_vdim.safetensors");
  words[6] = "2";
  words.insert(words.end(),
               {"--key", part_path("self", "query"), "--value", part_path("self", "query")});
  expect_refused(words, "kdim");
}

TEST_F(MhaCliBadInput, ExistingOutputsAreNotClobbered) {
  {
    std::ofstream(out_path()) << "keep me";
    std::ofstream(weights_out_path()) << "and me";
  }
  std::vector<std::string> words = arguments(golden_weights());
  words[6] = "3";
  const attend::test::CliRun run = run_cli(words);
  EXPECT_EQ(run.exit_status, 2);
  EXPECT_EQ(read_bytes(out_path()), "keep me");
  EXPECT_EQ(read_bytes(weights_out_path()), "and me");
}

}  // namespace
}  // namespace attend
