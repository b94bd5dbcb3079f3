// sdpa_cases.hpp: the case grid of the differential harness (tests/data/sdpa_cases.txt) and
// the helpers every SDPA test shares: a case's inputs, a float64 copy of what the
// library reads (for the independent reference and the error model), worst-element
// comparison.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
#include "independent_reference.hpp"
#include "test_support.hpp"

namespace attend::test {

// One line of the case file: `name=... key=value ...`; missing keys keep these defaults.
struct SdpaCase {
  std::string name;
  int line = 0;                      // in the case file, for messages
  std::vector<int64_t> batch_shape;  // batch=2x3 ("-" or absent: none)
  int64_t query_len = 1;             // lq=
  int64_t key_len = 1;               // lk=
  int64_t head_dim = 1;              // e=
  int64_t value_dim = 1;             // ev=
  // mask=none | bool_full (batch..., Lq, Lk) | int32_lqlk (Lq, Lk) | uint8_keypad
  // (B0, 1, ..., 1, Lk): key padding per first batch index | int64_query (Lq, 1)
  std::string mask = "none";
  bool excluded_rows = false;  // excluded=1: some mask rows entirely zero
  // bias=none | full (batch..., Lq, Lk) float32 | broadcast (Lq, Lk) float32 | keys (Lk,)
  // float16
  std::string bias = "none";
  bool causal = false;                                            // causal=1
  FullyMaskedRows fully_masked_rows = FullyMaskedRows::kUniform;  // rows=uniform|zero
  double query_key_magnitude = 1.0;  // qk=: query and key uniform in ±qk
  double value_magnitude = 1.0;      // v=: value uniform in ±v
  std::optional<double> scale;       // scale= (absent: 1/sqrt(E))
  bool need_weights = true;          // weights=0|1
  // layout=contiguous | blhd: query, key, value stored (..., L, H, D) and viewed as
  // (..., H, L, D) through strides | shared_kv: key and value have stride 0 over the last
  // batch dimension (one K/V for every head).
  std::string layout = "contiguous";
  DType dtype = DType::kFloat32;  // dtype=f32|f16 of query, key, value and output
  double dropout = 0.0;           // dropout=
  uint64_t seed = 0;              // seed= (dropout)
  bool ill_conditioned = false;   // ill=1: the error model's bound is not meaningful
  // The score rules (attend/score_rules.hpp):
  CausalAlignment alignment = CausalAlignment::kBottomRight;  // align=bottom|top
  std::optional<SlidingWindow> window;                        // window=LEFT,RIGHT (-1: none)
  bool alibi = false;                                         // alibi=1: default slopes
  std::optional<double> softcap;                              // softcap=
  bool sinks = false;                                         // sinks=1: seeded, in ±2
  int64_t documents = 0;  // docs=N: N documents of seeded unequal lengths (keys; queries
                          // take the document of their aligned position)
  int64_t prefix = 0;     // prefix=
  // kv_heads=N: key and value with N heads (the last batch dimension) for the query's H:
  // grouped-query attention; 0: as many as the query.
  int64_t kv_heads = 0;
};

// Parses one case line; throws std::runtime_error naming the bad key or value.
SdpaCase parse_sdpa_case(const std::string& line);
// Every case of a file (blank lines and # comments skipped). Throws std::runtime_error.
std::vector<SdpaCase> load_sdpa_cases(const std::string& path);

// Inputs of one case: owning storage, the views the library gets, and a float64 copy of
// exactly what it reads (after float16 rounding and broadcasting through strides).
struct CaseInputs {
  Tensor query_storage, key_storage, value_storage, mask_storage, bias_storage;
  Tensor sinks_storage, segments_query_storage, segments_key_storage;
  TensorView query, key, value;
  AttentionOptions options;  // mask, bias, causal, scale, rows, dropout, seed, need_weights
  ReferenceProblem problem;
};
CaseInputs make_case_inputs(const SdpaCase& c);

// Element at a row-major (logical) position of any view, through its strides, as double.
double element_as_double(const TensorView& view, int64_t logical_index);
// Every element of a view in row-major order, as double.
std::vector<double> values_of(const TensorView& view);

// The float64 problem the library sees for these arguments (views of any dtype and layout).
// The score rules of `options` are written into it independently of the library: positions,
// documents (and causal) as a dense mask, ALiBi as a dense bias, softcap and sinks as such.
// User rules are not represented.
ReferenceProblem reference_problem(const TensorView& query, const TensorView& key,
                                   const TensorView& value, const AttentionOptions& options);

// The element of `got` farthest outside its tolerance, relative to it.
struct Worst {
  double excess = 0.0;  // |got − expected| / tolerance; > 1 fails; infinite for a lone NaN
  int64_t row = -1, column = -1;
  double got = 0.0, expected = 0.0, tolerance = 0.0;
  bool ok() const { return excess <= 1.0; }
};
// `got` and `expected` are (rows, columns) row-major; tolerance(row, expected) is absolute.
// Two NaNs agree; a NaN against a number does not.
Worst worst_element(const std::vector<double>& got, const std::vector<double>& expected,
                    int64_t columns, const std::function<double(int64_t, double)>& tolerance);
// "output at (b=1 of (2, 3), i=4, e=7): got ..., expected ..., |diff| ..., tolerance ..."
std::string describe_worst(const Worst& worst, const char* what, const char* column_name,
                           const ReferenceProblem& problem);

}  // namespace attend::test
