// The differential harness: the fused kernel (Backend::kFused) against the reference
// (Backend::kReference, the listing in float64) over the case grid of
// tests/data/sdpa_cases.txt, on every SIMD target this build and this CPU support.
// Tolerances come from tests/error_model.hpp; failures print the worst element.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "error_model.hpp"
#include "independent_reference.hpp"
#include "sdpa_cases.hpp"

namespace attend::test {
namespace {

// One backend's result, as double: output (batch..., Lq, Ev), weights (batch..., Lq, Lk)
// or empty.
struct Outcome {
  std::vector<double> output, weights;
};

Outcome run_backend(const CaseInputs& in, Backend backend) {
  AttentionOptions options = in.options;
  options.backend = backend;
  const AttentionResult result = scaled_dot_product_attention(in.query, in.key, in.value, options);
  Outcome outcome;
  outcome.output = values_of(result.output.view());
  if (options.need_weights) outcome.weights = values_of(result.weights.view());
  return outcome;
}

// A case with its inputs, the fused kernel's tolerances and the reference result.
struct PreparedCase {
  SdpaCase spec;
  CaseInputs in;
  Tolerances tolerances;
  Outcome reference;
};

// Every case, with the reference run once per process: it does not depend on the SIMD
// target.
const std::vector<PreparedCase>& prepared_cases() {
  static const std::vector<PreparedCase> cases = [] {
    std::vector<PreparedCase> all;
    for (const SdpaCase& spec : load_sdpa_cases(ATTEND_TEST_DATA_DIR "/sdpa_cases.txt")) {
      PreparedCase c{spec, make_case_inputs(spec), {}, {}};
      ErrorModelOptions model;
      model.dropout = spec.dropout;
      model.half_output = spec.dtype == DType::kFloat16;
      c.tolerances = sdpa_tolerances(c.in.problem, model);
      c.reference = run_backend(c.in, Backend::kReference);
      all.push_back(std::move(c));
    }
    return all;
  }();
  return cases;
}

// Float32 lanes of a SIMD target by its name (Highway's): 16 for AVX-512, 8 for AVX2, else
// fewer.
int64_t fused_lanes_of(const std::string& target) {
  if (target.rfind("AVX3", 0) == 0 || target.rfind("AVX10", 0) == 0) return 16;
  return target == "AVX2" ? 8 : 4;
}

std::string where(const PreparedCase& c, const std::string& target) {
  return "case " + c.spec.name + " (sdpa_cases.txt:" + std::to_string(c.spec.line) + "), target " +
         target;
}

// The worst output element and the worst weight of `got` when outside the tolerances.
std::vector<std::string> differences(const PreparedCase& c, const Outcome& got,
                                     const Outcome& expected, const Tolerances& tolerances) {
  const ReferenceProblem& p = c.in.problem;
  std::vector<std::string> found;
  const Worst output = worst_element(got.output, expected.output, p.value_dim,
                                     [&](int64_t row, double) { return tolerances.output[row]; });
  if (!output.ok()) found.push_back(describe_worst(output, "output", "e", p));
  if (c.spec.need_weights) {
    const Worst weights =
        worst_element(got.weights, expected.weights, p.key_len,
                      [&](int64_t row, double e) { return tolerances.weight(row, e); });
    if (!weights.ok()) found.push_back(describe_worst(weights, "weights", "j", p));
  }
  return found;
}

// Properties any correct result has, whatever the reference says:
//   finite everywhere (the grid has no NaN or infinite inputs);
//   weights of a row sum to 1 (no dropout, not fully excluded);
//   excluded weights (mask or causal: j > i + Lk − Lq) are exactly 0 unless the whole row
//   is excluded;
//   fully excluded rows: uniform 1/Lk weights (kUniform, no dropout), or exactly zero
//   weights and output (kZero).
std::vector<std::string> property_violations(const PreparedCase& c, const Outcome& got) {
  const ReferenceProblem& p = c.in.problem;
  const Tolerances& tol = c.tolerances;
  const int64_t Lq = p.query_len, Lk = p.key_len, Ev = p.value_dim;
  std::vector<std::string> found;
  const auto at = [&](int64_t b, int64_t i, const char* column, int64_t index) {
    return " at (b=" + std::to_string(b) + ", i=" + std::to_string(i) + ", " + column + "=" +
           std::to_string(index) + ")";
  };
  for (size_t n = 0; n < got.output.size(); ++n) {
    if (!std::isfinite(got.output[n])) {
      found.push_back("output element " + std::to_string(n) + " is " +
                      std::to_string(got.output[n]));
      break;
    }
  }
  for (int64_t b = 0; b < p.batch() && found.size() < 8; ++b) {
    for (int64_t i = 0; i < Lq && found.size() < 8; ++i) {
      const int64_t row = b * Lq + i;
      const bool excluded_row = row_fully_excluded(p, b, i);
      const bool zero_row = excluded_row && p.zero_fully_masked_rows;
      for (int64_t e = 0; e < Ev && zero_row; ++e) {
        const double o = got.output[static_cast<size_t>(row * Ev + e)];
        if (o != 0.0) {
          found.push_back("fully excluded row (kZero): output " + std::to_string(o) + " is not 0" +
                          at(b, i, "e", e));
          break;
        }
      }
      if (!c.spec.need_weights) continue;
      const double* w = &got.weights[static_cast<size_t>(row * Lk)];
      double sum = 0.0;
      for (int64_t j = 0; j < Lk; ++j) {
        sum += w[j];
        if (!std::isfinite(w[j])) {
          found.push_back("weight " + std::to_string(w[j]) + at(b, i, "j", j));
          break;
        }
        if (zero_row && w[j] != 0.0) {
          found.push_back("fully excluded row (kZero): weight " + std::to_string(w[j]) +
                          " is not 0" + at(b, i, "j", j));
          break;
        }
        if (!excluded_row && !is_visible(p, b, i, j) && w[j] != 0.0) {
          found.push_back(std::string("excluded key") +
                          (p.causal && j > i + Lk - Lq ? " (causal)" : " (mask)") + ": weight " +
                          std::to_string(w[j]) + " is not 0" + at(b, i, "j", j));
          break;
        }
        const double uniform = 1.0 / static_cast<double>(Lk);
        if (excluded_row && !zero_row && c.spec.dropout == 0.0 && p.sinks.empty() &&
            std::abs(w[j] - uniform) > tol.weight(row, uniform)) {
          found.push_back("fully excluded row (kUniform): weight " + std::to_string(w[j]) +
                          " is not 1/Lk = " + std::to_string(uniform) + at(b, i, "j", j));
          break;
        }
      }
      const double sum_tolerance =
          tol.weights_relative[static_cast<size_t>(row)] + static_cast<double>(Lk) * kWeightsFloor;
      // A sink takes its share of the denominator: the keys' weights sum to less than 1.
      if (!zero_row && c.spec.dropout == 0.0 && p.sinks.empty() &&
          !(std::abs(sum - 1.0) <= sum_tolerance)) {
        found.push_back("weights sum to " + std::to_string(sum) + ", not 1 within " +
                        std::to_string(sum_tolerance) + " at (b=" + std::to_string(b) +
                        ", i=" + std::to_string(i) + ")");
      }
    }
  }
  return found;
}

TEST(CaseGrid, LoadsAndCoversEveryOptionKind) {
  const auto& cases = prepared_cases();
  ASSERT_GE(cases.size(), 40u);
  std::set<std::string> names, covered;
  for (const PreparedCase& c : cases) {
    EXPECT_TRUE(names.insert(c.spec.name).second) << "duplicate case name " << c.spec.name;
    const SdpaCase& s = c.spec;
    covered.insert("batch rank " + std::to_string(s.batch_shape.size()));
    covered.insert("mask " + s.mask);
    covered.insert("bias " + s.bias);
    covered.insert("layout " + s.layout);
    if (s.excluded_rows) {
      covered.insert(s.fully_masked_rows == FullyMaskedRows::kZero ? "excluded zero"
                                                                   : "excluded uniform");
    }
    if (s.causal) covered.insert(s.query_len < s.key_len ? "causal lq<lk" : "causal lq>=lk");
    if (s.causal && s.query_len > s.key_len) covered.insert("causal lq>lk");
    if (s.dtype == DType::kFloat16) covered.insert("float16");
    if (s.dropout > 0) covered.insert("dropout");
    if (!s.need_weights) covered.insert("no weights");
    if (s.scale) covered.insert("custom scale");
    if (s.query_key_magnitude >= 1000) covered.insert("large query/key");
    if (s.value_magnitude >= 1000) covered.insert("large value");
    if (s.ill_conditioned) covered.insert("ill-conditioned");
    if (s.alignment == CausalAlignment::kTopLeft) covered.insert("top-left");
    if (s.window) covered.insert("window");
    if (s.alibi) covered.insert("alibi");
    if (s.softcap) covered.insert("softcap");
    if (s.sinks) covered.insert("sinks");
    if (s.documents > 0) covered.insert("documents");
    if (s.prefix > 0) covered.insert("prefix");
    if (s.kv_heads > 0) covered.insert("grouped-query");
  }
  for (const char* rule : {"top-left", "window", "alibi", "softcap", "sinks", "documents", "prefix",
                           "grouped-query"}) {
    EXPECT_TRUE(covered.count(rule)) << "no case with the score rule " << rule;
  }
  for (const char* kind :
       {"batch rank 0",      "batch rank 1",     "batch rank 2",      "batch rank 3",
        "batch rank 4",      "mask none",        "mask bool_full",    "mask int32_lqlk",
        "mask uint8_keypad", "mask int64_query", "bias none",         "bias full",
        "bias broadcast",    "bias keys",        "layout contiguous", "layout blhd",
        "layout shared_kv",  "excluded zero",    "excluded uniform",  "causal lq<lk",
        "causal lq>lk",      "float16",          "dropout",           "no weights",
        "custom scale",      "large query/key",  "large value",       "ill-conditioned"}) {
    EXPECT_TRUE(covered.count(kind)) << "the case grid has no case with " << kind;
  }
}

TEST(CaseGrid, RejectsMalformedLines) {
  EXPECT_THROW(parse_sdpa_case("lq=3"), std::runtime_error);               // no name
  EXPECT_THROW(parse_sdpa_case("name=a lq=three"), std::runtime_error);    // not a number
  EXPECT_THROW(parse_sdpa_case("name=a mask=float"), std::runtime_error);  // unknown kind
  EXPECT_THROW(parse_sdpa_case("name=a colour=red"), std::runtime_error);  // unknown key
  EXPECT_THROW(parse_sdpa_case("name=a excluded=1"), std::runtime_error);  // needs a mask
  EXPECT_EQ(parse_sdpa_case("name=a batch=2x3 lq=4").batch_shape, (std::vector<int64_t>{2, 3}));
}

// The bound must be able to fail: under 1% of the values for every case, except the cases
// flagged ill-conditioned, where it must indeed be useless (else the flag is wrong).
TEST(ErrorModel, BoundIsMeaningfulExactlyWhenNotFlaggedIllConditioned) {
  for (const PreparedCase& c : prepared_cases()) {
    double worst_fraction = 0.0;
    for (size_t r = 0; r < c.tolerances.output.size(); ++r) {
      worst_fraction =
          std::max(worst_fraction, c.tolerances.output[r] / c.tolerances.value_scale[r]);
    }
    EXPECT_EQ(c.tolerances.meaningful(), !c.spec.ill_conditioned)
        << "case " << c.spec.name << ": output tolerance up to " << worst_fraction
        << " × max|v|, flagged ill=" << c.spec.ill_conditioned;
  }
}

TEST(ReferenceBackend, HasThePropertiesOnEveryCase) {
  for (const PreparedCase& c : prepared_cases()) {
    for (const std::string& problem : property_violations(c, c.reference)) {
      ADD_FAILURE() << where(c, "reference") << ": " << problem;
    }
  }
}

// The grid runs every fused path on every target, each as the kernel list names it: short
// keys, row groups and query tiles, with and without the key split.
TEST(CaseGrid, RunsEveryFusedPathOnEveryTarget) {
  for (const std::string& target : supported_simd_targets()) {
    ScopedSimdCap cap(target);
    std::set<std::string> paths;
    for (const PreparedCase& c : prepared_cases()) {
      const std::string kernel = attention_kernel(c.in.query, c.in.key, c.in.value, c.in.options);
      paths.insert(kernel.substr(0, kernel.find(" (")));
    }
    for (const char* path :
         {"fused short keys", "fused rows", "fused tiles", "fused rows + key split", "fused tiles + key split",
          "fused grouped-query tiles", "fused grouped-query tiles + key split"}) {
      // Under 8 lanes a query tile is never half empty at the grid's Lq, so row groups (and
      // their grouped-query tiles) never run.
      const bool from_rows = std::string(path).rfind("fused rows", 0) == 0 ||
                             std::string(path).rfind("fused grouped", 0) == 0;
      if (from_rows && fused_lanes_of(target) < 8) continue;
      EXPECT_TRUE(paths.count(path)) << "no case runs " << path << " on " << target;
    }
  }
}

// The oracle checked against the test's own float64 listing (no dropout there).
TEST(ReferenceBackend, MatchesTheIndependentListingOnEveryCase) {
  for (const PreparedCase& c : prepared_cases()) {
    if (c.spec.dropout > 0) continue;
    const ReferenceResult exact = independent_attention(c.in.problem);
    ErrorModelOptions model;
    model.accumulation = Accumulation::kFloat64;
    model.half_output = c.spec.dtype == DType::kFloat16;
    const Outcome expected{exact.output,
                           c.spec.need_weights ? exact.weights : std::vector<double>{}};
    for (const std::string& difference :
         differences(c, c.reference, expected, sdpa_tolerances(c.in.problem, model))) {
      ADD_FAILURE() << where(c, "reference") << " against the independent listing: " << difference;
    }
  }
}

// The harness can fail: a result pushed just outside the tolerance, a weight put above the
// causal diagonal, a nonzero fully excluded row are all reported; inside the tolerance is not.
TEST(Harness, ReportsPerturbedResults) {
  const PreparedCase* plain = nullptr;
  const PreparedCase* causal = nullptr;
  const PreparedCase* zero_rows = nullptr;
  for (const PreparedCase& c : prepared_cases()) {
    const bool simple = c.spec.need_weights && c.spec.dropout == 0 && !c.spec.ill_conditioned;
    if (simple && !plain && c.in.problem.batch() > 1 && c.spec.query_len > 4) plain = &c;
    if (simple && !causal && c.spec.causal && c.spec.mask == "none" && c.spec.query_len > 1 &&
        c.spec.query_len <= c.spec.key_len) {
      causal = &c;
    }
    if (simple && !zero_rows && c.spec.excluded_rows &&
        c.spec.fully_masked_rows == FullyMaskedRows::kZero) {
      zero_rows = &c;
    }
  }
  ASSERT_TRUE(plain && causal && zero_rows);

  const ReferenceProblem& p = plain->in.problem;
  const int64_t row = p.query_len + 3, e = 2;  // (b=1, i=3, e=2)
  const size_t at = static_cast<size_t>(row * p.value_dim + e);
  const double tolerance = plain->tolerances.output[static_cast<size_t>(row)];
  Outcome perturbed = plain->reference;
  perturbed.output[at] += 0.5 * tolerance;
  EXPECT_TRUE(differences(*plain, perturbed, plain->reference, plain->tolerances).empty());
  perturbed.output[at] += 2 * tolerance;
  const auto found = differences(*plain, perturbed, plain->reference, plain->tolerances);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_NE(found[0].find("output worst at (b=1"), std::string::npos) << found[0];
  EXPECT_NE(found[0].find("i=3, e=2"), std::string::npos) << found[0];

  perturbed = plain->reference;
  perturbed.weights[static_cast<size_t>(row * p.key_len + 1)] *= 1.0 + 1e-2;
  EXPECT_EQ(differences(*plain, perturbed, plain->reference, plain->tolerances).size(), 1u);
  perturbed.weights[static_cast<size_t>(row * p.key_len + 1)] = NAN;
  EXPECT_EQ(differences(*plain, perturbed, plain->reference, plain->tolerances).size(), 1u);

  // A weight above the causal diagonal of row 0 (j = Lk − Lq + 1 is the first hidden key).
  const ReferenceProblem& cp = causal->in.problem;
  perturbed = causal->reference;
  perturbed.weights[static_cast<size_t>(cp.key_len - cp.query_len + 1)] = 1e-30;
  auto problems = property_violations(*causal, perturbed);
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(problems[0].find("causal"), std::string::npos) << problems[0];

  // A fully excluded kZero row whose output is not zero.
  const ReferenceProblem& zp = zero_rows->in.problem;
  perturbed = zero_rows->reference;
  for (int64_t r = 0; r < zp.batch() * zp.query_len; ++r) {
    if (row_fully_excluded(zp, r / zp.query_len, r % zp.query_len)) {
      perturbed.output[static_cast<size_t>(r * zp.value_dim)] = 1e-20;
      break;
    }
  }
  problems = property_violations(*zero_rows, perturbed);
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(problems[0].find("kZero"), std::string::npos) << problems[0];
}

// The grouped-query tiles' one map of packed rows to (head, query position) is what the grid
// checks: on every grid case that runs them, the fused result passes, and swapping the output
// rows of any two packed rows of a group (heads g and g + 1 at one query, or queries i and
// i + 1 of one head: what a perturbed map would write) is reported.
TEST(GroupedQueryTiles, GridCatchesAPerturbedRowMap) {
  int cases = 0;
  for (const PreparedCase& c : prepared_cases()) {
    const std::string kernel = attention_kernel(c.in.query, c.in.key, c.in.value, c.in.options);
    if (kernel.rfind("fused grouped-query tiles", 0) != 0) continue;
    ++cases;
    const Outcome fused = run_backend(c.in, Backend::kFused);
    EXPECT_TRUE(differences(c, fused, c.reference, c.tolerances).empty()) << where(c, "best");
    const ReferenceProblem& p = c.in.problem;
    const int64_t heads = p.batch_shape.back(), group = heads / c.spec.kv_heads;
    const int64_t lq = p.query_len, ev = p.value_dim;
    // Row (batch index b, query i) of the output, b = outer·H + g.
    const auto swap_reported = [&](const Outcome& outcome, int64_t b0, int64_t i0, int64_t b1,
                                   int64_t i1) {
      Outcome perturbed = outcome;
      for (int64_t e = 0; e < ev; ++e) {
        std::swap(perturbed.output[static_cast<size_t>((b0 * lq + i0) * ev + e)],
                  perturbed.output[static_cast<size_t>((b1 * lq + i1) * ev + e)]);
      }
      return !differences(c, perturbed, c.reference, c.tolerances).empty();
    };
    // Whether swapping the two rows of `outcome` is reported; rows the reference itself cannot
    // tell apart (fully excluded rows, rows that see one key, of heads sharing V) are not
    // asked about (true).
    const auto swapped = [&](int64_t b0, int64_t i0, int64_t b1, int64_t i1) {
      return !swap_reported(c.reference, b0, i0, b1, i1) || swap_reported(fused, b0, i0, b1, i1);
    };
    for (int64_t g = 0; g + 1 < group; ++g) {
      for (int64_t i = 0; i < lq; ++i) {
        EXPECT_TRUE(swapped(g, i, g + 1, i)) << where(c, "best") << ": heads " << g << ", " << g + 1
                                             << " at query " << i;
      }
    }
    for (int64_t i = 0; i + 1 < lq; ++i) {
      EXPECT_TRUE(swapped(0, i, 0, i + 1)) << where(c, "best") << ": queries " << i << ", " << i + 1;
    }
  }
  if (fused_lanes_of(active_simd_target()) >= 8) {
    EXPECT_GE(cases, 10);
  }
}

class FusedAgainstReference : public ::testing::TestWithParam<std::string> {};

TEST_P(FusedAgainstReference, EveryCaseOfTheGrid) {
  const std::string target = GetParam();
  const auto& cases = prepared_cases();  // the reference runs before the cap
  ScopedSimdCap cap(target);
  ASSERT_EQ(active_simd_target(), target);
  for (const PreparedCase& c : cases) {
    SCOPED_TRACE(where(c, target));
    Outcome fused;
    try {
      fused = run_backend(c.in, Backend::kFused);
    } catch (const Error& error) {
      ADD_FAILURE() << where(c, target) << ": " << error.what();
      continue;
    }
    for (const std::string& difference : differences(c, fused, c.reference, c.tolerances)) {
      ADD_FAILURE() << where(c, target) << ": " << difference;
    }
    for (const std::string& problem : property_violations(c, fused)) {
      ADD_FAILURE() << where(c, target) << ": " << problem;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SupportedTargets, FusedAgainstReference,
                         ::testing::ValuesIn(supported_simd_targets()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace attend::test
