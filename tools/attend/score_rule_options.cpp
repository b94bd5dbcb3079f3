// score_rule_options.cpp: the score-rule options of `attend sdpa` and `attend ring`.
#include "score_rule_options.hpp"

#include <cmath>
#include <cstdint>

#include "attend/error.hpp"
#include "cli_common.hpp"
#include "quote.hpp"

namespace attend::cli {

void add_score_rule_options(CLI::App& command, ScoreRuleArguments& arguments) {
  command.add_flag("--causal", arguments.causal,
                   "query i sees key j only when j <= i' (i' = i + Lk - Lq bottom-right, i "
                   "top-left)");
  command
      .add_option("--causal-align", arguments.causal_align,
                  "bottom-right (default: i' = i + Lk - Lq, a decoder with a KV cache) or "
                  "top-left (i' = i, PyTorch's is_causal); also aligns --window and --alibi")
      ->type_name("CHOICE")
      ->check(CLI::IsMember({"bottom-right", "top-left"}));
  command
      .add_option("--window", arguments.window_text,
                  "sliding window LEFT[,RIGHT]: query i sees key j only when i' - LEFT <= j <= "
                  "i' + RIGHT (RIGHT default 0; -1: unbounded)")
      ->type_name("INT[,INT]");
  command.add_flag("--alibi", arguments.alibi,
                   "ALiBi with the paper's slopes for H heads (the last batch dimension): "
                   "score += slope_h * (j - i')");
  command
      .add_option("--softcap", arguments.softcap_text,
                  "logit soft-capping C > 0: score = C * tanh(score / C), after scaling, before "
                  "bias and masks")
      ->type_name("FLOAT");
  command.add_option("--scale", arguments.scale_text, "multiplies Q·Kᵀ (default 1/sqrt(E))")
      ->type_name("FLOAT");
  command.add_option("--dropout", arguments.dropout_text, "dropout probability in [0, 1)")
      ->type_name("FLOAT");
  command.add_option("--seed", arguments.seed_text, "dropout seed (Philox), default 0")
      ->type_name("INT");
  command
      .add_option("--backend", arguments.backend,
                  "the kernel: auto, fused or reference (default auto)")
      ->type_name("CHOICE")
      ->check(CLI::IsMember({"auto", "fused", "reference"}));
}

void apply_score_rule_options(const ScoreRuleArguments& arguments, const CLI::App& command,
                              AttentionOptions& options) {
  const auto given = [&](const char* option) { return command.count(option) > 0; };
  options.causal = arguments.causal;
  options.causal_alignment = arguments.causal_align == "top-left" ? CausalAlignment::kTopLeft
                                                                  : CausalAlignment::kBottomRight;
  if (given("--window")) {
    // LEFT or LEFT,RIGHT (RIGHT defaults to 0); -1 leaves a side unbounded.
    const size_t comma = arguments.window_text.find(',');
    const auto side = [](const std::string& text) {
      return text == "-1" ? kUnboundedWindow
                          : static_cast<int64_t>(parse_integer("--window", text, 0, INT64_MAX));
    };
    SlidingWindow window;
    window.left = side(arguments.window_text.substr(0, comma));
    window.right = comma == std::string::npos ? 0 : side(arguments.window_text.substr(comma + 1));
    options.window = window;
  }
  options.alibi = arguments.alibi;
  if (given("--softcap")) options.softcap = parse_number("--softcap", arguments.softcap_text);
  if (given("--scale")) {
    const double scale = parse_number("--scale", arguments.scale_text);
    if (!std::isfinite(scale)) {
      throw Error("--scale must be a finite number, got " +
                  detail::quote_for_message(arguments.scale_text));
    }
    options.scale = scale;
  }
  if (given("--dropout")) {
    options.dropout = parse_number("--dropout", arguments.dropout_text);
    if (!(options.dropout >= 0.0 && options.dropout < 1.0)) {
      throw Error("--dropout must be in [0, 1), got " +
                  detail::quote_for_message(arguments.dropout_text));
    }
  }
  if (given("--seed")) options.seed = parse_integer("--seed", arguments.seed_text, 0, UINT64_MAX);
  if (arguments.backend == "fused") {
    options.backend = Backend::kFused;
  } else if (arguments.backend == "reference") {
    options.backend = Backend::kReference;
  } else {
    options.backend = Backend::kAuto;
  }
}

}  // namespace attend::cli
