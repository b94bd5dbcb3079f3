#include "sdpa_cases.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>

#include "float8.hpp"
#include "half.hpp"

namespace attend::test {
namespace {

[[noreturn]] void bad_case(const std::string& line, const std::string& why) {
  throw std::runtime_error("case line '" + line + "': " + why);
}

int64_t parse_int(const std::string& line, const std::string& key, const std::string& text) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty()) bad_case(line, key + "=" + text + " is not an integer");
  return value;
}

double parse_double(const std::string& line, const std::string& key, const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty()) bad_case(line, key + "=" + text + " is not a number");
  return value;
}

bool parse_flag(const std::string& line, const std::string& key, const std::string& text) {
  if (text == "0" || text == "1") return text == "1";
  bad_case(line, key + "=" + text + " is not 0 or 1");
}

std::string one_of(const std::string& line, const std::string& key, const std::string& text,
                   std::initializer_list<const char*> allowed) {
  for (const char* a : allowed) {
    if (text == a) return text;
  }
  bad_case(line, key + "=" + text + " is not a known value");
}

// FNV-1a of the case name: a seed that stays with the case when others are added.
uint32_t name_seed(const std::string& name) {
  uint32_t hash = 2166136261u;
  for (unsigned char c : name) hash = (hash ^ c) * 16777619u;
  return hash;
}

std::vector<int64_t> dims_of(const Shape& shape) {
  return std::vector<int64_t>(shape.data(), shape.data() + shape.rank());
}
Shape shape_of(const std::vector<int64_t>& dims) {
  return Shape::from(dims.data(), static_cast<int>(dims.size()));
}

// Storage of `storage_shape` filled with uniform values in `dtype`, read through a view of
// `shape` with `strides` (elements).
Tensor filled_storage(const Shape& storage_shape, DType dtype, uint32_t seed, double magnitude) {
  const std::vector<float> values = uniform_values(storage_shape.numel(), seed, magnitude);
  Tensor storage(dtype, storage_shape);
  for (size_t n = 0; n < values.size(); ++n) {
    if (dtype == DType::kFloat16) {
      storage.data_as<uint16_t>()[n] = detail::f16_from_f32(values[n]);
    } else {
      storage.data_as<float>()[n] = values[n];
    }
  }
  return storage;
}

// query, key or value of logical shape (batch..., L, D) in the case's layout.
Tensor make_operand(const SdpaCase& c, const std::string& layout, int64_t length, int64_t dim,
                    uint32_t seed, double magnitude, TensorView& view) {
  Shape shape = shape_of(c.batch_shape);
  shape.push_back(length);
  shape.push_back(dim);
  const int r = static_cast<int>(c.batch_shape.size());
  if (layout == "contiguous") {
    Tensor storage = filled_storage(shape, c.dtype, seed, magnitude);
    view = TensorView(storage.data(), c.dtype, shape);
    return storage;
  }
  if (r == 0) throw std::runtime_error("case " + c.name + ": layout " + layout + " needs a batch");
  const int64_t heads = c.batch_shape.back();
  if (layout == "blhd") {
    // Storage (..., L, H, D) viewed as (..., H, L, D).
    Shape storage_shape = shape;
    storage_shape[r - 1] = length;
    storage_shape[r] = heads;
    Tensor storage = filled_storage(storage_shape, c.dtype, seed, magnitude);
    Shape strides = contiguous_strides(storage_shape);
    const int64_t head_stride = strides[r], length_stride = strides[r - 1];
    strides[r - 1] = head_stride;
    strides[r] = length_stride;
    view = TensorView(storage.data(), c.dtype, shape, strides);
    return storage;
  }
  // shared_kv: storage (..., 1, L, D), stride 0 over the heads.
  Shape storage_shape = shape;
  storage_shape[r - 1] = 1;
  Tensor storage = filled_storage(storage_shape, c.dtype, seed, magnitude);
  Shape strides = contiguous_strides(storage_shape);
  strides[r - 1] = 0;
  view = TensorView(storage.data(), c.dtype, shape, strides);
  return storage;
}

// The case's mask, in its own dtype and shape. Zero excludes.
Tensor make_mask(const SdpaCase& c, uint32_t seed) {
  std::mt19937 random(seed);
  const auto draw = [&random] { return static_cast<double>(random() >> 8) / 16777216.0; };
  const int64_t Lq = c.query_len, Lk = c.key_len;
  const auto excluded_row = [&c](int64_t i) { return c.excluded_rows && i % 4 == 1; };
  if (c.mask == "bool_full") {
    Shape shape = shape_of(c.batch_shape);
    shape.push_back(Lq);
    shape.push_back(Lk);
    Tensor mask(DType::kBool, shape);
    auto* m = mask.data_as<uint8_t>();
    for (int64_t n = 0; n < shape.numel(); ++n) {
      const int64_t i = (n / Lk) % Lq;
      m[n] = (!excluded_row(i) && draw() < 0.8) ? 1 : 0;
    }
    return mask;
  }
  if (c.mask == "int32_lqlk") {
    Tensor mask(DType::kInt32, Shape({Lq, Lk}));
    const int32_t keeps[] = {1, 2, -3, 7};
    for (int64_t n = 0; n < Lq * Lk; ++n) {
      const bool keep = !excluded_row(n / Lk) && draw() >= 0.25;
      mask.data_as<int32_t>()[n] = keep ? keeps[random() % 4] : 0;
    }
    return mask;
  }
  if (c.mask == "uint8_keypad") {
    // (B0, 1, ..., 1, Lk): batch b0 sees keys [0, length(b0)); length 0 for b0 = 0 when
    // rows are to be excluded.
    const int r = static_cast<int>(c.batch_shape.size());
    const int64_t first = r > 0 ? c.batch_shape[0] : 1;
    Shape shape({first});
    for (int d = 1; d < r; ++d) shape.push_back(1);
    if (r > 0) shape.push_back(1);
    shape.push_back(Lk);
    Tensor mask(DType::kUInt8, shape);
    const int64_t step = std::max<int64_t>(1, Lk / 3);
    for (int64_t b0 = 0; b0 < first; ++b0) {
      const int64_t length =
          (c.excluded_rows && b0 == 0) ? 0 : std::max<int64_t>(1, Lk - ((b0 + 1) * step) % Lk);
      for (int64_t j = 0; j < Lk; ++j) mask.data_as<uint8_t>()[b0 * Lk + j] = j < length ? 255 : 0;
    }
    return mask;
  }
  // int64_query (Lq, 1): nonzero values keep every key of the row.
  Tensor mask(DType::kInt64, Shape({Lq, 1}));
  const int64_t keeps[] = {1, -1, 42};
  for (int64_t i = 0; i < Lq; ++i) mask.data_as<int64_t>()[i] = excluded_row(i) ? 0 : keeps[i % 3];
  return mask;
}

Tensor make_bias(const SdpaCase& c, uint32_t seed) {
  const int64_t Lq = c.query_len, Lk = c.key_len;
  if (c.bias == "full") {
    Shape shape = shape_of(c.batch_shape);
    shape.push_back(Lq);
    shape.push_back(Lk);
    return filled_storage(shape, DType::kFloat32, seed, 1.0);
  }
  if (c.bias == "broadcast") return filled_storage(Shape({Lq, Lk}), DType::kFloat32, seed, 1.0);
  return filled_storage(Shape({Lk}), DType::kFloat16, seed, 1.0);  // keys
}

}  // namespace

SdpaCase parse_sdpa_case(const std::string& line) {
  SdpaCase c;
  std::istringstream words(line);
  std::string word;
  while (words >> word) {
    const size_t equals = word.find('=');
    if (equals == std::string::npos) bad_case(line, "'" + word + "' is not key=value");
    const std::string key = word.substr(0, equals), value = word.substr(equals + 1);
    if (key == "name") {
      c.name = value;
    } else if (key == "batch") {
      c.batch_shape.clear();
      if (value != "-") {
        std::istringstream dims(value);
        std::string dim;
        while (std::getline(dims, dim, 'x')) c.batch_shape.push_back(parse_int(line, key, dim));
      }
    } else if (key == "lq") {
      c.query_len = parse_int(line, key, value);
    } else if (key == "lk") {
      c.key_len = parse_int(line, key, value);
    } else if (key == "e") {
      c.head_dim = parse_int(line, key, value);
    } else if (key == "ev") {
      c.value_dim = parse_int(line, key, value);
    } else if (key == "mask") {
      c.mask = one_of(line, key, value,
                      {"none", "bool_full", "int32_lqlk", "uint8_keypad", "int64_query"});
    } else if (key == "excluded") {
      c.excluded_rows = parse_flag(line, key, value);
    } else if (key == "bias") {
      c.bias = one_of(line, key, value, {"none", "full", "broadcast", "keys"});
    } else if (key == "causal") {
      c.causal = parse_flag(line, key, value);
    } else if (key == "rows") {
      c.fully_masked_rows = one_of(line, key, value, {"uniform", "zero"}) == "zero"
                                ? FullyMaskedRows::kZero
                                : FullyMaskedRows::kUniform;
    } else if (key == "qk") {
      c.query_key_magnitude = parse_double(line, key, value);
    } else if (key == "v") {
      c.value_magnitude = parse_double(line, key, value);
    } else if (key == "scale") {
      c.scale = parse_double(line, key, value);
    } else if (key == "weights") {
      c.need_weights = parse_flag(line, key, value);
    } else if (key == "layout") {
      c.layout = one_of(line, key, value, {"contiguous", "blhd", "shared_kv"});
    } else if (key == "dtype") {
      c.dtype =
          one_of(line, key, value, {"f32", "f16"}) == "f16" ? DType::kFloat16 : DType::kFloat32;
    } else if (key == "dropout") {
      c.dropout = parse_double(line, key, value);
    } else if (key == "seed") {
      c.seed = static_cast<uint64_t>(parse_int(line, key, value));
    } else if (key == "ill") {
      c.ill_conditioned = parse_flag(line, key, value);
    } else if (key == "align") {
      c.alignment = one_of(line, key, value, {"bottom", "top"}) == "top"
                        ? CausalAlignment::kTopLeft
                        : CausalAlignment::kBottomRight;
    } else if (key == "window") {
      const size_t comma = value.find(',');
      if (comma == std::string::npos) bad_case(line, "window= needs LEFT,RIGHT");
      c.window = SlidingWindow{parse_int(line, key, value.substr(0, comma)),
                               parse_int(line, key, value.substr(comma + 1))};
    } else if (key == "alibi") {
      c.alibi = parse_flag(line, key, value);
    } else if (key == "softcap") {
      c.softcap = parse_double(line, key, value);
    } else if (key == "sinks") {
      c.sinks = parse_flag(line, key, value);
    } else if (key == "docs") {
      c.documents = parse_int(line, key, value);
    } else if (key == "prefix") {
      c.prefix = parse_int(line, key, value);
    } else if (key == "kv_heads") {
      c.kv_heads = parse_int(line, key, value);
    } else {
      bad_case(line, "unknown key '" + key + "'");
    }
  }
  if (c.name.empty()) bad_case(line, "no name=");
  if (c.batch_shape.size() > 4) bad_case(line, "more than 4 batch dimensions");
  if (c.excluded_rows && c.mask == "none") bad_case(line, "excluded=1 needs a mask");
  return c;
}

std::vector<SdpaCase> load_sdpa_cases(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open the case file " + path);
  std::vector<SdpaCase> cases;
  std::string line;
  for (int number = 1; std::getline(file, line); ++number) {
    const size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    cases.push_back(parse_sdpa_case(line));
    cases.back().line = number;
  }
  return cases;
}

CaseInputs make_case_inputs(const SdpaCase& c) {
  const uint32_t seed = name_seed(c.name);
  const std::string kv_layout = c.layout;
  const std::string query_layout = c.layout == "shared_kv" ? "contiguous" : c.layout;
  CaseInputs in;
  in.query_storage = make_operand(c, query_layout, c.query_len, c.head_dim, seed + 1,
                                  c.query_key_magnitude, in.query);
  SdpaCase kv_case = c;  // grouped-query attention: fewer K/V heads
  if (c.kv_heads > 0) {
    if (c.batch_shape.empty())
      throw std::runtime_error("case " + c.name + ": kv_heads needs a batch");
    kv_case.batch_shape.back() = c.kv_heads;
  }
  in.key_storage = make_operand(kv_case, kv_layout, c.key_len, c.head_dim, seed + 2,
                                c.query_key_magnitude, in.key);
  in.value_storage = make_operand(kv_case, kv_layout, c.key_len, c.value_dim, seed + 3,
                                  c.value_magnitude, in.value);
  if (c.mask != "none") {
    in.mask_storage = make_mask(c, seed + 4);
    in.options.mask = in.mask_storage.view();
  }
  if (c.bias != "none") {
    in.bias_storage = make_bias(c, seed + 5);
    in.options.bias = in.bias_storage.view();
  }
  in.options.causal = c.causal;
  in.options.scale = c.scale;
  in.options.fully_masked_rows = c.fully_masked_rows;
  in.options.dropout = c.dropout;
  in.options.seed = c.seed;
  in.options.need_weights = c.need_weights;
  in.options.causal_alignment = c.alignment;
  in.options.window = c.window;
  in.options.alibi = c.alibi;
  in.options.softcap = c.softcap;
  in.options.prefix = c.prefix;
  const int64_t heads = c.batch_shape.empty() ? 1 : c.batch_shape.back();
  if (c.sinks) {
    in.sinks_storage = filled_storage(Shape({heads}), DType::kFloat32, seed + 6, 2.0);
    in.options.sinks = in.sinks_storage.view();
  }
  if (c.documents > 0) {
    // Document boundaries: seeded cut points of the keys; query i takes the document of
    // its aligned position (clamped to the keys).
    std::mt19937 random(seed + 7);
    std::vector<int64_t> cuts;
    for (int64_t d = 1; d < c.documents; ++d) {
      cuts.push_back(std::uniform_int_distribution<int64_t>(1, c.key_len - 1)(random));
    }
    std::sort(cuts.begin(), cuts.end());
    const auto document_of = [&](int64_t position) {
      return static_cast<int32_t>(std::upper_bound(cuts.begin(), cuts.end(), position) -
                                  cuts.begin());
    };
    const int64_t offset =
        c.alignment == CausalAlignment::kBottomRight ? c.key_len - c.query_len : 0;
    in.segments_query_storage = Tensor(DType::kInt32, Shape({c.query_len}));
    in.segments_key_storage = Tensor(DType::kInt64, Shape({c.key_len}));
    for (int64_t i = 0; i < c.query_len; ++i) {
      in.segments_query_storage.data_as<int32_t>()[i] =
          document_of(std::clamp<int64_t>(i + offset, 0, c.key_len - 1));
    }
    for (int64_t j = 0; j < c.key_len; ++j) {
      in.segments_key_storage.data_as<int64_t>()[j] = document_of(j);
    }
    in.options.segment_ids_query = in.segments_query_storage.view();
    in.options.segment_ids_key = in.segments_key_storage.view();
  }
  in.problem = reference_problem(in.query, in.key, in.value, in.options);
  return in;
}

double element_as_double(const TensorView& view, int64_t logical_index) {
  int64_t offset = 0;
  for (int d = view.rank() - 1; d >= 0; --d) {
    offset += (logical_index % view.shape[d]) * view.strides[d];
    logical_index /= view.shape[d];
  }
  const char* base =
      static_cast<const char*>(view.data) + static_cast<size_t>(offset) * dtype_size(view.dtype);
  const auto load = [base](auto sample) {
    decltype(sample) value;
    std::memcpy(&value, base, sizeof value);
    return value;
  };
  switch (view.dtype) {
    case DType::kFloat32:
      return load(float{});
    case DType::kFloat64:
      return load(double{});
    case DType::kFloat16:
      return detail::f32_from_f16(load(uint16_t{}));
    case DType::kBFloat16:
      return detail::f32_from_bf16(load(uint16_t{}));
    case DType::kFloat8E4M3:
      return detail::f32_from_e4m3(load(uint8_t{}));
    case DType::kFloat8E5M2:
      return detail::f32_from_e5m2(load(uint8_t{}));
    case DType::kBool:
    case DType::kUInt8:
      return load(uint8_t{});
    case DType::kInt8:
      return load(int8_t{});
    case DType::kInt16:
      return load(int16_t{});
    case DType::kInt32:
      return load(int32_t{});
    case DType::kInt64:
      return static_cast<double>(load(int64_t{}));
    case DType::kUInt16:
      return load(uint16_t{});
    case DType::kUInt32:
      return load(uint32_t{});
    case DType::kUInt64:
      return static_cast<double>(load(uint64_t{}));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

std::vector<double> values_of(const TensorView& view) {
  std::vector<double> values(static_cast<size_t>(view.numel()));
  for (int64_t n = 0; n < view.numel(); ++n)
    values[static_cast<size_t>(n)] = element_as_double(view, n);
  return values;
}

namespace {

// Segment id of position `index` along the last dimension of `ids` (..., L) read at batch
// index b (leading dimensions broadcast as the scores').
double segment_at(const TensorView& ids, const std::vector<int64_t>& batch_shape, int64_t b,
                  int64_t index, bool is_query) {
  std::vector<int64_t> shape = dims_of(ids.shape);
  // As a (..., L, 1) tensor for queries and a (..., 1, L) tensor for keys.
  if (is_query) {
    shape.push_back(1);
  } else {
    shape.insert(shape.end() - 1, 1);
  }
  const int64_t flat =
      broadcast_flat_index(shape, batch_shape, b, is_query ? index : 0, is_query ? 0 : index);
  return element_as_double(ids, flat);
}

// The score rules of `options`, written from their definitions (attend/score_rules.hpp)
// without the library's code: causal (either alignment), window, prefix and documents
// become a dense mask (ANDed with the given one), ALiBi a dense bias (added to the given
// one), softcap and sinks fields of the problem.
void add_score_rules(ReferenceProblem& p, const AttentionOptions& options) {
  const int64_t Lq = p.query_len, Lk = p.key_len, B = p.batch();
  const int64_t heads = p.batch_shape.empty() ? 1 : p.batch_shape.back();
  const int64_t offset = options.causal_alignment == CausalAlignment::kBottomRight ? Lk - Lq : 0;
  std::vector<int64_t> dense_shape = p.batch_shape;
  dense_shape.push_back(Lq);
  dense_shape.push_back(Lk);
  const bool positional = options.causal_alignment == CausalAlignment::kTopLeft ||
                          options.window.has_value() || options.prefix > 0;
  if (positional || options.segment_ids_query) {
    std::vector<int64_t> mask(static_cast<size_t>(B * Lq * Lk));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t aligned = i + offset;
        for (int64_t j = 0; j < Lk; ++j) {
          bool by_position = true;
          if (options.causal && j > aligned) by_position = false;
          if (options.window) {
            if (options.window->left >= 0 && j < aligned - options.window->left)
              by_position = false;
            if (options.window->right >= 0 && j > aligned + options.window->right)
              by_position = false;
          }
          if (j < options.prefix) by_position = true;
          bool keep = by_position;
          if (options.segment_ids_query &&
              segment_at(*options.segment_ids_query, p.batch_shape, b, i, true) !=
                  segment_at(*options.segment_ids_key, p.batch_shape, b, j, false)) {
            keep = false;
          }
          if (p.has_mask && p.mask[static_cast<size_t>(
                                broadcast_flat_index(p.mask_shape, p.batch_shape, b, i, j))] == 0) {
            keep = false;
          }
          mask[static_cast<size_t>((b * Lq + i) * Lk + j)] = keep ? 1 : 0;
        }
      }
    }
    p.has_mask = true;
    p.mask_shape = dense_shape;
    p.mask = std::move(mask);
    p.causal = false;  // in the mask now
  }
  if (options.alibi || options.alibi_slopes) {
    const std::vector<double> slopes =
        options.alibi_slopes ? values_of(*options.alibi_slopes) : [&] {
          std::vector<double> d;
          for (float s : default_alibi_slopes(heads)) d.push_back(s);
          return d;
        }();
    std::vector<double> bias(static_cast<size_t>(B * Lq * Lk));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < Lq; ++i) {
        for (int64_t j = 0; j < Lk; ++j) {
          bias[static_cast<size_t>((b * Lq + i) * Lk + j)] =
              bias_at(p, b, i, j) +
              slopes[static_cast<size_t>(b % heads)] * static_cast<double>(j - (i + offset));
        }
      }
    }
    p.has_bias = true;
    p.bias_shape = dense_shape;
    p.bias = std::move(bias);
  }
  if (options.softcap) p.softcap = *options.softcap;
  if (options.sinks) {
    const std::vector<double> sinks = values_of(*options.sinks);
    for (int64_t b = 0; b < B; ++b) p.sinks.push_back(sinks[static_cast<size_t>(b % heads)]);
  }
}

// Grouped-query attention: K or V (..., Hkv, L, D) as the dense (..., H, L, D) of the query's
// H heads, K/V head h / (H / Hkv) repeated for query head h (repeat_interleave).
std::vector<double> dense_heads(const std::vector<double>& values, const TensorView& query,
                                const TensorView& operand) {
  if (operand.rank() < 3 || operand.shape.back(2) == query.shape.back(2)) return values;
  const int64_t heads = query.shape.back(2), kv_heads = operand.shape.back(2);
  const int64_t group = heads / kv_heads, head_size = operand.shape.back(1) * operand.shape.back(0);
  const int64_t outer = static_cast<int64_t>(values.size()) / (kv_heads * head_size);
  std::vector<double> dense;
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t h = 0; h < heads; ++h) {
      const auto first = values.begin() + (o * kv_heads + h / group) * head_size;
      dense.insert(dense.end(), first, first + head_size);
    }
  }
  return dense;
}

}  // namespace

ReferenceProblem reference_problem(const TensorView& query, const TensorView& key,
                                   const TensorView& value, const AttentionOptions& options) {
  ReferenceProblem p;
  const int batch_rank = query.rank() - 2;
  p.batch_shape.assign(query.shape.data(), query.shape.data() + batch_rank);
  p.query_len = query.shape.back(1);
  p.key_len = key.shape.back(1);
  p.head_dim = query.shape.back(0);
  p.value_dim = value.shape.back(0);
  p.query = values_of(query);
  p.key = dense_heads(values_of(key), query, key);
  p.value = dense_heads(values_of(value), query, value);
  if (options.mask) {
    p.has_mask = true;
    p.mask_shape = dims_of(options.mask->shape);
    for (double m : values_of(*options.mask)) p.mask.push_back(m != 0.0 ? 1 : 0);
  }
  if (options.bias) {
    p.has_bias = true;
    p.bias_shape = dims_of(options.bias->shape);
    p.bias = values_of(*options.bias);
  }
  p.causal = options.causal;
  p.scale = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.zero_fully_masked_rows = options.fully_masked_rows == FullyMaskedRows::kZero;
  add_score_rules(p, options);
  return p;
}

Worst worst_element(const std::vector<double>& got, const std::vector<double>& expected,
                    int64_t columns, const std::function<double(int64_t, double)>& tolerance) {
  Worst worst;
  if (got.size() != expected.size()) {
    worst.excess = std::numeric_limits<double>::infinity();
    return worst;
  }
  for (size_t n = 0; n < got.size(); ++n) {
    const int64_t row = static_cast<int64_t>(n) / columns;
    const double tol = tolerance(row, expected[n]);
    const bool got_nan = std::isnan(got[n]), expected_nan = std::isnan(expected[n]);
    double excess = 0.0;
    if (got_nan != expected_nan) {
      excess = std::numeric_limits<double>::infinity();
    } else if (!got_nan) {
      const double diff = std::abs(got[n] - expected[n]);
      excess = diff == 0.0 ? 0.0 : diff / tol;
      if (std::isnan(excess)) excess = std::numeric_limits<double>::infinity();  // NaN tolerance
    }
    if (excess > worst.excess || worst.row < 0) {
      worst = {excess, row, static_cast<int64_t>(n) % columns, got[n], expected[n], tol};
    }
  }
  return worst;
}

std::string describe_worst(const Worst& worst, const char* what, const char* column_name,
                           const ReferenceProblem& problem) {
  std::ostringstream text;
  text.precision(9);
  const int64_t lq = std::max<int64_t>(problem.query_len, 1);
  text << what << " worst at (b=" << worst.row / lq << " of " << shape_of(problem.batch_shape).str()
       << ", i=" << worst.row % lq << ", " << column_name << "=" << worst.column << "): got "
       << worst.got << ", expected " << worst.expected << ", |diff| "
       << std::abs(worst.got - worst.expected) << ", tolerance " << worst.tolerance << " ("
       << worst.excess << " × tolerance)";
  return text.str();
}

}  // namespace attend::test
