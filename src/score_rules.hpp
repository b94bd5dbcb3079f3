// score_rules.hpp: the score rules' options at the API boundary (validated once, then turned
// into their part of SdpaParams). How the rules act on a score: score_rule_layer.hpp.
#pragma once

#include <optional>
#include <vector>

#include "attend/attention_options.hpp"
#include "attend/tensor.hpp"
#include "boundary/operands.hpp"
#include "sdpa_params.hpp"

namespace attend::detail {

// Throws attend::Error naming the argument: windows, softcap, ALiBi slopes, sinks, segment
// ids, prefix, user rules. scores_shape is (batch..., Lq, Lk).
void validate_score_rules(const AttentionOptions& options, const Shape& scores_shape);

// Fills the rules by position: causal, the alignment and the global positions
// (AttentionOptions::block), window and prefix of `p` (query_len and key_len already set).
void fill_positional_rules(SdpaParams& p, const AttentionOptions& options);

// Fills causal, the alignment, window, prefix, softcap, heads, slopes, sinks, segments and
// user rules of `p` (sizes already set).
void fill_score_rules(SdpaParams& p, const AttentionOptions& options, const Shape& scores_shape,
                      ScoreRuleInputs& storage);

}  // namespace attend::detail
