// score_rule_options.hpp: the options of the score that `attend sdpa` and `attend ring` share
// (--causal, --causal-align, --window, --alibi, --softcap, --scale, --dropout, --seed,
// --backend), declared and parsed in one place into AttentionOptions.
#pragma once

#include <CLI/CLI.hpp>
#include <map>
#include <string>

#include "attend/sdpa.hpp"

namespace attend::cli {

// The options as typed; parsed by apply_score_rule_options.
struct ScoreRuleArguments {
  bool causal = false;
  std::string causal_align = "bottom-right";
  std::string window_text;
  bool alibi = false;
  // The texts of the rules given by one number (--softcap: the table in the .cpp), by option.
  std::map<std::string, std::string> number_texts;
  std::string scale_text, dropout_text, seed_text;
  std::string backend = "auto";
};

// Declares the options on `command`, bound to `arguments` (which must outlive it).
void add_score_rule_options(CLI::App& command, ScoreRuleArguments& arguments);

// Sets the fields of `options` that the given options name; throws attend::Error naming the
// option for a malformed or out-of-range value. `command` tells which options were given.
void apply_score_rule_options(const ScoreRuleArguments& arguments, const CLI::App& command,
                              AttentionOptions& options);

}  // namespace attend::cli
