// varlen.cpp: ragged batches (attend/varlen.hpp). Each sequence is a dense problem on strided
// views of the packed tensors: query (H, Lq_s, E) with strides (E, H·E, 1) from row
// cu_seqlens_q[s], key and value likewise; everything is validated before any output is
// written, then the sequences run (large ones on all threads, small ones side by side).
#include "attend/varlen.hpp"

#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa_backward.hpp"
#include "boundary/validation.hpp"
#include "boundary/views.hpp"
#include "serving/ragged.hpp"

namespace attend {
namespace {

using detail::check_packed_output;
using detail::RaggedSequence;
using detail::read_offsets;
using detail::schedule_sequences;
using detail::sequence_rows;
using detail::sequence_view;
using detail::threads_of;

void check_packed(const char* name, const TensorView& t) {
  detail::check_view(name, t);
  if (t.rank() != 3) {
    throw Error(detail::describe(name, t) + ": expected (total tokens, heads, dim)");
  }
}

// The checks shared by the forward and the backward: shapes, offsets, options; the
// sequences, each validated as the dense call on its views.
std::vector<RaggedSequence> validate(const TensorView& query, const TensorView& key,
                                     const TensorView& value, const TensorView& cu_q,
                                     const TensorView& cu_k, const AttentionOptions& options) {
  check_packed("query", query);
  check_packed("key", key);
  check_packed("value", value);
  if (key.shape[0] != value.shape[0] || key.shape[1] != value.shape[1]) {
    throw Error(detail::describe("key", key) + " and " + detail::describe("value", value) +
                " differ in tokens or heads");
  }
  if (options.mask || options.bias || options.segment_ids_query || options.segment_ids_key) {
    throw Error(
        "ragged attention: mask, bias and segment ids are not supported (the packing "
        "says which keys each query sees)");
  }
  if (options.dropout != 0.0) throw Error("ragged attention: dropout is not supported");
  if (options.need_weights) throw Error("ragged attention: need_weights is not supported");
  const std::vector<int64_t> q_offsets = read_offsets("cu_seqlens_q", cu_q, query.shape[0]);
  const std::vector<int64_t> k_offsets = read_offsets("cu_seqlens_k", cu_k, key.shape[0]);
  if (q_offsets.size() != k_offsets.size()) {
    throw Error("cu_seqlens_q has " + std::to_string(q_offsets.size()) +
                " offsets and cu_seqlens_k " + std::to_string(k_offsets.size()) +
                ": both should be B + 1");
  }
  std::vector<RaggedSequence> sequences;
  for (size_t s = 0; s + 1 < q_offsets.size(); ++s) {
    const RaggedSequence seq{q_offsets[s], q_offsets[s + 1] - q_offsets[s], k_offsets[s],
                             k_offsets[s + 1] - k_offsets[s]};
    if (seq.q_len > 0 && seq.k_len == 0) {
      throw Error("sequence " + std::to_string(s) + " has " + std::to_string(seq.q_len) +
                  " queries but no keys (softmax over no keys is undefined)");
    }
    if (seq.q_len > 0) {
      try {
        (void)detail::validate_inputs(sequence_view(query, seq.q_begin, seq.q_len),
                                      sequence_view(key, seq.k_begin, seq.k_len),
                                      sequence_view(value, seq.k_begin, seq.k_len), options);
      } catch (const Error& error) {
        throw Error("sequence " + std::to_string(s) + ": " + error.what());
      }
    }
    sequences.push_back(seq);
  }
  return sequences;
}

}  // namespace

void varlen_attention_into(const TensorView& query, const TensorView& key, const TensorView& value,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const TensorView& output, const AttentionOptions& options,
                           const TensorView* logsumexp) {
  const int threads = threads_of(options);
  const std::vector<RaggedSequence> sequences =
      validate(query, key, value, cu_seqlens_q, cu_seqlens_k, options);
  const std::vector<const TensorView*> inputs = {&query, &key, &value, &cu_seqlens_q,
                                                 &cu_seqlens_k};
  check_packed_output("output", output, Shape({query.shape[0], query.shape[1], value.shape[2]}),
                      query.dtype, inputs);
  if (logsumexp) {
    check_packed_output("logsumexp", *logsumexp, Shape({query.shape[0], query.shape[1]}),
                        DType::kFloat32, inputs);
    if (detail::overlaps(*logsumexp, output)) {
      throw Error("logsumexp overlaps the memory of output");
    }
  }
  AttentionOptions per_sequence = options;
  per_sequence.need_logsumexp = false;
  schedule_sequences(sequences, query.shape[1], query.shape[2] + value.shape[2], threads,
                     [&](size_t s, int sequence_threads) {
                       const RaggedSequence& seq = sequences[s];
                       AttentionOptions o = per_sequence;
                       o.num_threads = sequence_threads;
                       AttentionOutputViews outs;
                       outs.output = sequence_view(output, seq.q_begin, seq.q_len);
                       if (logsumexp)
                         outs.logsumexp = sequence_rows(*logsumexp, seq.q_begin, seq.q_len);
                       scaled_dot_product_attention_into(
                           sequence_view(query, seq.q_begin, seq.q_len),
                           sequence_view(key, seq.k_begin, seq.k_len),
                           sequence_view(value, seq.k_begin, seq.k_len), outs, o);
                     });
}

Tensor varlen_attention(const TensorView& query, const TensorView& key, const TensorView& value,
                        const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                        const AttentionOptions& options) {
  check_packed("query", query);
  check_packed("value", value);
  Tensor output(query.dtype, Shape({query.shape[0], query.shape[1], value.shape[2]}));
  varlen_attention_into(query, key, value, cu_seqlens_q, cu_seqlens_k, output.view(), options);
  return output;
}

void varlen_attention_backward_into(const TensorView& grad_output, const TensorView& query,
                                    const TensorView& key, const TensorView& value,
                                    const TensorView& output, const TensorView& logsumexp,
                                    const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                    const TensorView& grad_query, const TensorView& grad_key,
                                    const TensorView& grad_value, const AttentionOptions& options) {
  const int threads = threads_of(options);
  const std::vector<RaggedSequence> sequences =
      validate(query, key, value, cu_seqlens_q, cu_seqlens_k, options);
  const Shape out_shape({query.shape[0], query.shape[1], value.shape[2]});
  for (auto [name, t] : {std::pair{"grad_output", &grad_output}, std::pair{"output", &output}}) {
    detail::check_view(name, *t);
    if (t->shape != out_shape) {
      throw Error(detail::describe(name, *t) + " does not match " + out_shape.str());
    }
  }
  detail::check_view("logsumexp", logsumexp);
  if (logsumexp.shape != Shape({query.shape[0], query.shape[1]}) ||
      logsumexp.dtype != DType::kFloat32) {
    throw Error(detail::describe("logsumexp", logsumexp) + " should be float32 (total_q, H)");
  }
  const std::vector<const TensorView*> inputs = {
      &grad_output, &query, &key, &value, &output, &logsumexp, &cu_seqlens_q, &cu_seqlens_k};
  check_packed_output("grad_query", grad_query, query.shape, query.dtype, inputs);
  check_packed_output("grad_key", grad_key, key.shape, key.dtype, inputs);
  check_packed_output("grad_value", grad_value, value.shape, value.dtype, inputs);
  if (detail::overlaps(grad_query, grad_key) || detail::overlaps(grad_query, grad_value) ||
      detail::overlaps(grad_key, grad_value)) {
    throw Error("grad_query, grad_key and grad_value must not overlap");
  }
  // Keys of sequences without queries receive no gradient.
  for (const RaggedSequence& seq : sequences) {
    if (seq.q_len > 0 || seq.k_len == 0) continue;
    for (const TensorView* grad : {&grad_key, &grad_value}) {
      const TensorView view = sequence_view(*grad, seq.k_begin, seq.k_len);
      convert(Tensor::zeros(DType::kFloat32, view.shape).view(), view);
    }
  }
  schedule_sequences(
      sequences, query.shape[1], query.shape[2] + value.shape[2], threads,
      [&](size_t s, int sequence_threads) {
        const RaggedSequence& seq = sequences[s];
        AttentionOptions o = options;
        o.num_threads = sequence_threads;
        const auto q_rows = [&](const TensorView& t) {
          return sequence_view(t, seq.q_begin, seq.q_len);
        };
        const auto k_rows = [&](const TensorView& t) {
          return sequence_view(t, seq.k_begin, seq.k_len);
        };
        const AttentionGradientViews grads{q_rows(grad_query), k_rows(grad_key), k_rows(grad_value),
                                           std::nullopt, std::nullopt};
        scaled_dot_product_attention_backward_into(
            q_rows(grad_output), q_rows(query), k_rows(key), k_rows(value), q_rows(output),
            sequence_rows(logsumexp, seq.q_begin, seq.q_len), grads, o);
      });
}

}  // namespace attend
