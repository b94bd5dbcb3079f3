// score_rule_options.cpp: the score-rule options of `attend sdpa` and `attend ring`.
#include "score_rule_options.hpp"

#include <cmath>
#include <cstdint>
#include <optional>

#include "attend/error.hpp"
#include "cli_common.hpp"
#include "quote.hpp"

namespace attend::cli {
namespace {

// The built-in rules given by one number: the option that takes it and the field it sets
// (the library checks the value's range and names the field).
struct NumberRule {
  const char* flag;
  const char* help;
  std::optional<double> AttentionOptions::*option;
};
constexpr NumberRule kNumberRules[] = {
    {"--softcap",
     "logit soft-capping C > 0: score = C * tanh(score / C), after scaling, before bias and "
     "masks",
     &AttentionOptions::softcap},
};

}  // namespace

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
  for (const NumberRule& rule : kNumberRules) {
    command.add_option(rule.flag, arguments.number_texts[rule.flag], rule.help)->type_name("FLOAT");
  }
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
  for (const NumberRule& rule : kNumberRules) {
    if (given(rule.flag)) {
      options.*rule.option = parse_number(rule.flag, arguments.number_texts.at(rule.flag));
    }
  }
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
