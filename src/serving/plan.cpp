// plan.cpp: prepared attention calls (attend/plan.hpp). The plan keeps the SdpaParams the
// unprepared call would build, the kernel it would choose and what its layouts fix (the bytes
// each view spans, the options' tensors' ranges); run() checks the layouts, swaps the data
// pointers in and runs that kernel.
#include "attend/plan.hpp"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attend/error.hpp"
#include "grouped_query.hpp"
#include "kernels/kernel_list.hpp"
#include "sdpa_boundary.hpp"
#include "sdpa_params.hpp"

namespace attend {

struct AttentionPlan::State {
  AttentionOptions options;  // the planned options (user_rules point into them)
  bool variable_key_length = false;
  bool fast = false;                     // prepared path, else the unprepared call
  TensorView query, key, value, output;  // planned layouts
  detail::Problem problem;
  detail::KernelInputs inputs;  // converted copies of the options' tensors
  // Planned; grouped-query attention's view (split_kv_heads) taken once when Lk is fixed
  // (split_planned), else per call.
  detail::SdpaParams params;
  bool split_planned = false;
  detail::KernelRun kernel = nullptr;
  // Bytes each planned view spans (detail::byte_extent; key and value: with a fixed Lk only),
  // and the byte ranges of the options' tensors: the overlap checks of run() without
  // walking shapes.
  int64_t query_bytes = 0, key_bytes = 0, value_bytes = 0, output_bytes = 0;
  std::vector<detail::ByteRange> option_ranges;
};

namespace {

bool plain_float(const TensorView& t) {
  return t.dtype == DType::kFloat32 && (t.strides.back(0) == 1 || t.shape.back(0) <= 1);
}

[[noreturn]] void layout_error(const char* name, const TensorView& got, const TensorView& planned) {
  throw Error(std::string("AttentionPlan::run: ") + name + " " + got.shape.str() + " " +
              dtype_name(got.dtype) + " with strides " + got.strides.str() +
              " is not the planned " + planned.shape.str() + " " + dtype_name(planned.dtype) +
              " with strides " + planned.strides.str());
}

// Whether `got` has the planned dtype, shape and strides: one pass over the dimensions
// (inline: a plan compares four views per call).
bool same_layout(const TensorView& got, const TensorView& planned) {
  const int rank = got.rank();
  if (got.dtype != planned.dtype || rank != planned.rank() || got.strides.rank() != rank) {
    return false;
  }
  const int64_t *shape = got.shape.data(), *strides = got.strides.data();
  const int64_t *planned_shape = planned.shape.data(), *planned_strides = planned.strides.data();
  bool same = true;
  for (int d = 0; d < rank; ++d) {
    same &= shape[d] == planned_shape[d] && strides[d] == planned_strides[d];
  }
  return same;
}

// `got` has the planned layout (whose views span planned_bytes, nonzero unless empty).
void check_planned(const char* name, const TensorView& got, const TensorView& planned,
                   int64_t planned_bytes) {
  if (!same_layout(got, planned)) layout_error(name, got, planned);
  if (got.data == nullptr && planned_bytes > 0) {
    throw Error(std::string("AttentionPlan::run: ") + name + ": data pointer is null");
  }
}

// Key or value of a plan with variable Lk: the planned shape but for Lk, any valid strides.
void check_key_like(const char* name, const TensorView& got, const TensorView& planned) {
  bool same = got.dtype == planned.dtype && got.rank() == planned.rank();
  for (int d = 0; same && d < got.rank(); ++d) {
    same = d == got.rank() - 2 || got.shape[d] == planned.shape[d];
  }
  if (!same) layout_error(name, got, planned);
  detail::check_view(name, got);
  if (!plain_float(got)) {
    throw Error(std::string("AttentionPlan::run: ") + name +
                ": the last dimension must be contiguous, as planned");
  }
}

}  // namespace

AttentionPlan::AttentionPlan(const TensorView& query, const TensorView& key,
                             const TensorView& value, const TensorView& output,
                             const AttentionOptions& options, bool variable_key_length)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.options = options;
  s.variable_key_length = variable_key_length;
  s.problem = detail::validate_inputs(query, key, value, s.options);
  detail::check_output("output", output, s.problem.output_shape, query.dtype, query, key, value,
                       s.options);
  if (options.need_weights) {
    throw Error(
        "AttentionPlan: need_weights is not supported (a plan writes output and "
        "logsumexp); use scaled_dot_product_attention");
  }
  if (variable_key_length && (options.mask || options.bias || options.segment_ids_key)) {
    throw Error(
        "AttentionPlan: variable_key_length needs options without a key dimension "
        "(mask, bias and segment ids have one)");
  }
  s.query = query, s.key = key, s.value = value, s.output = output;
  s.query_bytes = detail::byte_extent(query);
  s.key_bytes = detail::byte_extent(key);
  s.value_bytes = detail::byte_extent(value);
  s.output_bytes = detail::byte_extent(output);
  for (const auto* t : {&s.options.mask, &s.options.bias, &s.options.alibi_slopes, &s.options.sinks,
                        &s.options.segment_ids_query, &s.options.segment_ids_key}) {
    if (t->has_value()) s.option_ranges.push_back(detail::byte_range(**t));
  }
  s.fast = plain_float(query) && plain_float(key) && plain_float(value) && plain_float(output);
  if (!s.fast) return;
  s.params = detail::make_params(query, key, value, s.problem, s.options, s.inputs);
  // An option that made the boundary copy an operand (another precision of the products)
  // would freeze the planning call's data into the plan: such plans run unprepared.
  if (s.inputs.query || s.inputs.key || s.inputs.value ||
      s.params.query != static_cast<const float*>(query.data) ||
      s.params.key != static_cast<const float*>(key.data) ||
      s.params.value != static_cast<const float*>(value.data)) {
    s.fast = false;
    return;
  }
  TensorView out = output;
  out.strides[out.rank() - 1] = 1;
  s.params.output_strides = detail::plain_strides(out);
  // Pointers of the planning views are not kept: run() sets every one.
  s.params.query = s.params.key = s.params.value = nullptr;
  s.params.output = nullptr;
  if (s.problem.kv_group > 1 && !variable_key_length) {
    s.params = detail::split_kv_heads(s.params, s.problem.kv_group);
    s.split_planned = true;
  }
  s.kernel = detail::chosen_kernel_run(s.problem.kv_group > 1 && !s.split_planned
                                           ? detail::split_kv_heads(s.params, s.problem.kv_group)
                                           : s.params,
                                       options.backend);
}

AttentionPlan::AttentionPlan(AttentionPlan&&) noexcept = default;
AttentionPlan& AttentionPlan::operator=(AttentionPlan&&) noexcept = default;
AttentionPlan::~AttentionPlan() = default;

bool AttentionPlan::prepared() const { return state_ && state_->fast; }

void AttentionPlan::run(const TensorView& query, const TensorView& key, const TensorView& value,
                        const TensorView& output, const TensorView* logsumexp) const {
  if (!state_) throw Error("AttentionPlan::run: the plan was moved from");
  const State& s = *state_;
  check_planned("query", query, s.query, s.query_bytes);
  if (s.variable_key_length) {
    check_key_like("key", key, s.key);
    check_key_like("value", value, s.value);
    const int64_t lk = key.shape.back(1);
    if (value.shape.back(1) != lk) {
      throw Error("AttentionPlan::run: " + detail::describe("value", value) + " does not match " +
                  detail::describe("key", key) + " in Lk");
    }
    if (lk == 0) throw Error("AttentionPlan::run: key length Lk is 0");
    if (s.options.prefix > lk) {
      throw Error("AttentionPlan::run: prefix " + std::to_string(s.options.prefix) +
                  " is beyond Lk = " + std::to_string(lk));
    }
  } else {
    check_planned("key", key, s.key, s.key_bytes);
    check_planned("value", value, s.value, s.value_bytes);
  }
  check_planned("output", output, s.output, s.output_bytes);
  if (logsumexp) {
    if (!s.options.need_logsumexp) {
      throw Error(
          "AttentionPlan::run: logsumexp given but the plan's options lack "
          "need_logsumexp");
    }
    detail::check_logsumexp("logsumexp", *logsumexp, s.problem.scores_shape);
  }
  const detail::ByteRange out = detail::byte_range(output.data, s.output_bytes);
  const detail::ByteRange lse = logsumexp ? detail::byte_range(*logsumexp) : detail::ByteRange{};
  const detail::ByteRange inputs[] = {
      detail::byte_range(query.data, s.query_bytes),
      s.variable_key_length ? detail::byte_range(key) : detail::byte_range(key.data, s.key_bytes),
      s.variable_key_length ? detail::byte_range(value)
                            : detail::byte_range(value.data, s.value_bytes)};
  for (const detail::ByteRange& input : inputs) {
    if (detail::ranges_overlap(out, input) || detail::ranges_overlap(lse, input)) {
      throw Error("AttentionPlan::run: an output overlaps the memory of an input");
    }
  }
  if (detail::ranges_overlap(lse, out)) {
    throw Error("AttentionPlan::run: logsumexp overlaps the memory of output");
  }
  for (const detail::ByteRange& t : s.option_ranges) {
    if (detail::ranges_overlap(out, t) || detail::ranges_overlap(lse, t)) {
      throw Error("AttentionPlan::run: an output overlaps the memory of an option's tensor");
    }
  }

  if (!s.fast) {
    AttentionOutputViews outputs;
    outputs.output = output;
    if (logsumexp) outputs.logsumexp = *logsumexp;
    scaled_dot_product_attention_into(query, key, value, outputs, s.options);
    return;
  }
  detail::SdpaParams p = s.params;
  p.query = query.data_as<const float>();
  p.key = key.data_as<const float>();
  p.value = value.data_as<const float>();
  p.output = output.data_as<float>();
  if (logsumexp) {
    p.logsumexp = logsumexp->data_as<float>();
    p.logsumexp_strides = detail::row_vector_strides(*logsumexp);
    if (s.split_planned) {
      p.logsumexp_strides = detail::split_query_heads(p.logsumexp_strides, s.problem.kv_group);
    }
  }
  if (s.variable_key_length) {
    TensorView k = key, v = value;
    k.strides[k.rank() - 1] = 1;
    v.strides[v.rank() - 1] = 1;
    p.key_len = key.shape.back(1);
    p.key_strides = detail::plain_strides(k);
    p.value_strides = detail::plain_strides(v);
    if (s.options.causal_alignment == CausalAlignment::kBottomRight) {
      p.diagonal_offset = p.key_len - p.query_len;
    }
  }
  if (p.batch * p.query_len == 0) return;
  if (s.problem.kv_group > 1 && !s.split_planned) {
    return s.kernel(detail::split_kv_heads(p, s.problem.kv_group));
  }
  s.kernel(p);
}

}  // namespace attend
