// sdpa_command.cpp: `attend sdpa --query Q.npy --key K.npy --value V.npy --out O.npy ...`,
// and with `--grad-out dO.npy --grad-query dQ.npy --grad-key dK.npy --grad-value dV.npy
// [--grad-bias dB.npy]` also the backward pass (the gradients of Σ O ⊙ dO).
//
// Reads every input, checks every option and computes the result (forward and backward)
// before writing anything; the outputs are then written all-or-nothing (cli_common.hpp), so
// a failed run leaves existing files untouched.
#include "sdpa_command.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "score_rule_options.hpp"

namespace attend::cli {
namespace {

struct SdpaArguments {
  std::string query_path, key_path, value_path;
  std::string mask_path, bias_path;
  std::string output_path, out_weights_path;
  // The backward pass: dO in, dQ, dK, dV and optionally dBias out.
  std::string grad_output_path;
  std::string grad_query_path, grad_key_path, grad_value_path, grad_bias_path;
  // The score rules (attend/score_rules.hpp): those `attend ring` shares, then sdpa's own.
  ScoreRuleArguments rules;
  std::string alibi_slopes_path;
  std::string sinks_path, grad_sinks_path;
  std::string segment_query_path, segment_key_path;
  std::string prefix_text;
  std::string kv_heads_text;
  bool zero_masked_rows = false;
  std::string threads_text;
  std::string compute_dtype = "auto";
};

// Q, K, V and the bias: the dtypes a .npy file can carry that the library computes in.
void check_float_input(const std::string& option, const std::string& path, const Tensor& t) {
  if (t.dtype() != DType::kFloat32 && t.dtype() != DType::kFloat16) {
    throw Error(option + " " + path + ": dtype " + dtype_name(t.dtype()) +
                " is not supported (float32 or float16; convert with arr.astype(np.float32))");
  }
}

void check_mask_input(const std::string& path, const Tensor& mask) {
  if (is_floating(mask.dtype())) {
    throw Error("--mask " + path + ": dtype " + dtype_name(mask.dtype()) +
                " is floating point; a mask must be bool or integer (zero excludes). For an "
                "additive float mask (0 keeps, -inf drops) use --bias instead");
  }
}

// The gradient options come as a group: --grad-out with --grad-query, --grad-key and
// --grad-value (--grad-bias optional, and only with --bias). Returns whether they were given.
bool check_gradient_options(const std::function<bool(const char*)>& given) {
  const char* const required_outputs[] = {"--grad-query", "--grad-key", "--grad-value"};
  if (!given("--grad-out")) {
    for (const char* option : {"--grad-query", "--grad-key", "--grad-value", "--grad-bias"}) {
      if (given(option)) {
        throw Error(std::string(option) +
                    " needs --grad-out dO.npy: the backward pass starts from the gradient of "
                    "the loss with respect to the output");
      }
    }
    return false;
  }
  std::string missing;
  for (const char* option : required_outputs) {
    if (!given(option)) missing += (missing.empty() ? "" : ", ") + std::string(option);
  }
  if (!missing.empty()) {
    throw Error(
        "--grad-out needs --grad-query, --grad-key and --grad-value to name the "
        "gradient files (missing: " +
        missing + ")");
  }
  if (given("--grad-bias") && !given("--bias")) {
    throw Error("--grad-bias needs --bias: there is no bias to differentiate");
  }
  return true;
}

// dO must be what the forward returned in shape and dtype; checked here so that the message
// names the file.
void check_grad_output(const std::string& path, const Tensor& grad_output, const Tensor& output) {
  if (grad_output.shape() != output.shape()) {
    throw Error("--grad-out " + path + ": grad_output shape " + grad_output.shape().str() +
                " differs from the output's " + output.shape().str() + " (..., Lq, Ev)");
  }
  if (grad_output.dtype() != output.dtype()) {
    throw Error("--grad-out " + path + ": grad_output dtype " + dtype_name(grad_output.dtype()) +
                " differs from the inputs' " + dtype_name(output.dtype()));
  }
}

ComputePrecision parse_compute_dtype(const std::string& name) {
  if (name == "fp32") return ComputePrecision::kFloat32;
  if (name == "bf16") return ComputePrecision::kBFloat16;
  if (name == "fp16") return ComputePrecision::kFloat16;
  return ComputePrecision::kAuto;
}

// `sdpa` is the subcommand, asked which options were given (an empty value still counts).
void run_sdpa(const SdpaArguments& arguments, const CLI::App& sdpa) {
  const auto given = [&](const char* option) { return sdpa.count(option) > 0; };
  // 1. Options that need no file.
  AttentionOptions options;
  apply_score_rule_options(arguments.rules, sdpa, options);
  options.fully_masked_rows =
      arguments.zero_masked_rows ? FullyMaskedRows::kZero : FullyMaskedRows::kUniform;
  options.num_threads = threads_from(sdpa, arguments.threads_text, 0);
  if (given("--prefix")) {
    options.prefix =
        static_cast<int64_t>(parse_integer("--prefix", arguments.prefix_text, 0, INT64_MAX));
  }
  if (given("--kv-heads")) {
    options.num_kv_heads =
        static_cast<int64_t>(parse_integer("--kv-heads", arguments.kv_heads_text, 1, INT64_MAX));
  }
  if (given("--segment-ids-q") != given("--segment-ids-k")) {
    throw Error(
        "--segment-ids-q and --segment-ids-k come together: documents need the ids of "
        "both the queries and the keys");
  }
  if (given("--grad-sinks") && !given("--sinks")) {
    throw Error("--grad-sinks needs --sinks: there are no sinks to differentiate");
  }
  if (given("--grad-sinks") && !given("--grad-out")) {
    throw Error("--grad-sinks needs --grad-out dO.npy (the backward pass)");
  }
  options.compute = parse_compute_dtype(arguments.compute_dtype);
  options.need_weights = given("--out-weights");
  const bool backward = check_gradient_options(given);
  options.need_logsumexp = backward;
  check_output_path("--out", arguments.output_path);
  if (options.need_weights) check_output_path("--out-weights", arguments.out_weights_path);
  if (backward) {
    check_output_path("--grad-query", arguments.grad_query_path);
    check_output_path("--grad-key", arguments.grad_key_path);
    check_output_path("--grad-value", arguments.grad_value_path);
    if (given("--grad-bias")) check_output_path("--grad-bias", arguments.grad_bias_path);
    if (given("--grad-sinks")) check_output_path("--grad-sinks", arguments.grad_sinks_path);
  }

  // 2. Inputs.
  const Tensor query = read_input("--query", arguments.query_path);
  const Tensor key = read_input("--key", arguments.key_path);
  const Tensor value = read_input("--value", arguments.value_path);
  check_float_input("--query", arguments.query_path, query);
  check_float_input("--key", arguments.key_path, key);
  check_float_input("--value", arguments.value_path, value);
  std::optional<Tensor> mask, bias;
  if (given("--mask")) {
    mask = read_input("--mask", arguments.mask_path);
    check_mask_input(arguments.mask_path, *mask);
    options.mask = mask->view();
  }
  if (given("--bias")) {
    bias = read_input("--bias", arguments.bias_path);
    check_float_input("--bias", arguments.bias_path, *bias);
    options.bias = bias->view();
  }

  std::optional<Tensor> alibi_slopes, sinks, segment_query, segment_key;
  if (given("--alibi-slopes")) {
    alibi_slopes = read_input("--alibi-slopes", arguments.alibi_slopes_path);
    check_float_input("--alibi-slopes", arguments.alibi_slopes_path, *alibi_slopes);
    options.alibi_slopes = alibi_slopes->view();
  }
  if (given("--sinks")) {
    sinks = read_input("--sinks", arguments.sinks_path);
    check_float_input("--sinks", arguments.sinks_path, *sinks);
    options.sinks = sinks->view();
  }
  if (given("--segment-ids-q")) {
    segment_query = read_input("--segment-ids-q", arguments.segment_query_path);
    segment_key = read_input("--segment-ids-k", arguments.segment_key_path);
    options.segment_ids_query = segment_query->view();
    options.segment_ids_key = segment_key->view();
  }

  std::optional<Tensor> grad_output;
  if (backward) {
    grad_output = read_input("--grad-out", arguments.grad_output_path);
    check_float_input("--grad-out", arguments.grad_output_path, *grad_output);
  }

  // 3. The attention itself; it validates shapes and throws before computing anything.
  const AttentionResult result =
      scaled_dot_product_attention(query.view(), key.view(), value.view(), options);

  // 4. The backward pass, from the forward's output and log-sum-exp. dBias (the size of the
  //    broadcast scores) is computed only when asked for.
  AttentionGradients gradients;
  if (backward) {
    check_grad_output(arguments.grad_output_path, *grad_output, result.output);
    gradients.query = Tensor(query.dtype(), query.shape());
    gradients.key = Tensor(key.dtype(), key.shape());
    gradients.value = Tensor(value.dtype(), value.shape());
    AttentionGradientViews views{gradients.query.view(), gradients.key.view(),
                                 gradients.value.view(), std::nullopt, std::nullopt};
    if (given("--grad-bias")) {
      gradients.bias = Tensor(bias->dtype(), bias->shape());
      views.bias = gradients.bias.view();
    }
    if (given("--grad-sinks")) {
      gradients.sinks = Tensor(sinks->dtype(), sinks->shape());
      views.sinks = gradients.sinks.view();
    }
    scaled_dot_product_attention_backward_into(grad_output->view(), query.view(), key.view(),
                                               value.view(), result.output.view(),
                                               result.logsumexp.view(), views, options);
  }

  // 5. Outputs, all or nothing.
  std::vector<OutputFile> outputs = {{"--out", arguments.output_path, result.output.view()}};
  if (options.need_weights) {
    outputs.push_back({"--out-weights", arguments.out_weights_path, result.weights.view()});
  }
  if (backward) {
    outputs.push_back({"--grad-query", arguments.grad_query_path, gradients.query.view()});
    outputs.push_back({"--grad-key", arguments.grad_key_path, gradients.key.view()});
    outputs.push_back({"--grad-value", arguments.grad_value_path, gradients.value.view()});
    if (given("--grad-bias")) {
      outputs.push_back({"--grad-bias", arguments.grad_bias_path, gradients.bias.view()});
    }
    if (given("--grad-sinks")) {
      outputs.push_back({"--grad-sinks", arguments.grad_sinks_path, gradients.sinks.view()});
    }
  }
  write_outputs(outputs);
  std::cout << wrote(outputs) << '\n';
}

}  // namespace

Command add_sdpa_command(CLI::App& app) {
  auto arguments = std::make_shared<SdpaArguments>();
  CLI::App* sdpa = app.add_subcommand(
      "sdpa",
      "Scaled dot-product attention: softmax(Q·Kᵀ·scale + bias, masked)·V on .npy files; with "
      "--grad-out also its gradients (backward pass)");
  // Paths, numbers and names are taken as text and checked by run_sdpa, so that every bad
  // value gets the same kind of message.
  const auto file_option = [&](const char* name, std::string& target, const char* help) {
    return sdpa->add_option(name, target, help)->type_name("FILE");
  };
  file_option("--query", arguments->query_path, "Q (..., Lq, E), float32 or float16")->required();
  file_option("--key", arguments->key_path, "K (..., Lk, E), same dtype as Q")->required();
  file_option("--value", arguments->value_path, "V (..., Lk, Ev), same dtype as Q")->required();
  file_option("--mask", arguments->mask_path,
              "bool or integer, broadcastable to (..., Lq, Lk); zero excludes a key");
  file_option("--bias", arguments->bias_path,
              "float32 or float16, broadcastable to (..., Lq, Lk); added to the scores");
  add_score_rule_options(*sdpa, arguments->rules);
  file_option("--alibi-slopes", arguments->alibi_slopes_path,
              "ALiBi with these slopes, float (H): score += slope_h * (j - i')");
  file_option("--sinks", arguments->sinks_path,
              "attention sinks, float (H): one more logit per head in each row's softmax "
              "denominator, with no value");
  file_option("--grad-sinks", arguments->grad_sinks_path, "write dSinks (H), dtype of --sinks");
  file_option("--segment-ids-q", arguments->segment_query_path,
              "document ids of the queries, integer (..., Lq): query i sees key j only when "
              "ids_q[i] == ids_k[j]");
  file_option("--segment-ids-k", arguments->segment_key_path,
              "document ids of the keys, integer (..., Lk)");
  sdpa->add_option("--prefix", arguments->prefix_text,
                   "prefix-LM: keys j < P are visible to every query; the rest follow --causal "
                   "or --window")
      ->type_name("INT");
  sdpa->add_option("--kv-heads", arguments->kv_heads_text,
                   "grouped-query attention: key and value have N heads (their last batch "
                   "dimension) dividing the query's; inferred from the shapes when absent")
      ->type_name("INT");
  sdpa->add_flag("--zero-masked-rows", arguments->zero_masked_rows,
                 "a fully masked query row gives zeros (default: uniform weights, as the "
                 "listing)");
  add_threads_option(*sdpa, arguments->threads_text, "all");
  sdpa->add_option("--compute-dtype", arguments->compute_dtype,
                   "precision of the products: auto, fp32, bf16 (inputs rounded to bfloat16, "
                   "AVX512_BF16 products; see `attend info`) or fp16 (default auto)")
      ->type_name("CHOICE")
      ->check(CLI::IsMember({"auto", "fp32", "bf16", "fp16"}));
  file_option("--out", arguments->output_path, "output (..., Lq, Ev), dtype of Q")->required();
  file_option("--out-weights", arguments->out_weights_path,
              "also write the attention weights (..., Lq, Lk), float32");
  // The backward pass.
  file_option("--grad-out", arguments->grad_output_path,
              "dO (..., Lq, Ev), dtype of Q: run the backward pass too (needs --grad-query, "
              "--grad-key, --grad-value)");
  file_option("--grad-query", arguments->grad_query_path, "write dQ (..., Lq, E), dtype of Q");
  file_option("--grad-key", arguments->grad_key_path, "write dK (..., Lk, E), dtype of K");
  file_option("--grad-value", arguments->grad_value_path, "write dV (..., Lk, Ev), dtype of V");
  file_option("--grad-bias", arguments->grad_bias_path,
              "write dBias: the shape and dtype of --bias, summed over the dimensions it was "
              "broadcast along");
  return {sdpa, [arguments, sdpa] { run_sdpa(*arguments, *sdpa); }};
}

}  // namespace attend::cli
