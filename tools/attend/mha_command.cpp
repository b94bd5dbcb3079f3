// mha_command.cpp: `attend mha --query X.npy [--key K.npy --value V.npy] --weights W.safetensors
// --heads H ... --out O.npy [--out-weights A.npy [--average-heads]]`.
//
// The weights are a torch.nn.MultiheadAttention state_dict saved as safetensors; the module's
// shape is read from it (embed_dim from out_proj.weight, kdim and vdim from k_proj_weight and
// v_proj_weight when present, bias from in_proj_bias). Everything is read, checked and computed
// before anything is written; the outputs are then written all-or-nothing.
#include "mha_command.hpp"

#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "attend/multihead.hpp"
#include "attend/safetensors.hpp"

namespace attend::cli {
namespace {

// Far above any real model; keeps embed_dim / heads meaningful.
constexpr uint64_t kMaxHeads = 1 << 20;

struct MhaArguments {
  std::string query_path, key_path, value_path;
  std::string weights_path, heads_text;
  std::string key_padding_mask_path, mask_path;
  bool causal = false;
  std::string threads_text;
  std::string output_path, attention_weights_path;
  bool average_heads = false;
};

void check_float_input(const std::string& option, const std::string& path, const Tensor& t) {
  if (t.dtype() != DType::kFloat32 && t.dtype() != DType::kFloat16) {
    throw Error(option + " " + path + ": dtype " + dtype_name(t.dtype()) +
                " is not supported (float32 or float16; convert with arr.astype(np.float32))");
  }
}

void check_mask_input(const std::string& option, const std::string& path, const Tensor& mask,
                      const char* hint) {
  if (is_floating(mask.dtype())) {
    throw Error(option + " " + path + ": dtype " + dtype_name(mask.dtype()) +
                " is floating point; a mask must be bool or integer (zero excludes). " + hint);
  }
}

// The module a state_dict describes, with its parameters loaded.
MultiHeadAttention load_module(const std::string& path, int64_t num_heads) {
  const std::string where = "--weights " + path;
  SafetensorsContents contents;
  try {
    contents = load_safetensors(path);
  } catch (const Error& e) {
    throw Error("--weights " + std::string(e.what()));
  }
  const auto& tensors = contents.tensors;
  const auto shape_of = [&](const std::string& name) -> std::optional<Shape> {
    const auto found = tensors.find(name);
    if (found == tensors.end()) return std::nullopt;
    return found->second.shape();
  };
  for (const char* unsupported : {"bias_k", "bias_v"}) {
    if (tensors.count(unsupported) != 0) {
      throw Error(where + ": has '" + unsupported +
                  "' (add_bias_kv=True), which attend mha does not support");
    }
  }
  const std::optional<Shape> out_weight = shape_of("out_proj.weight");
  if (!out_weight) {
    throw Error(where +
                ": missing tensor 'out_proj.weight' (expected a torch.nn."
                "MultiheadAttention state_dict: in_proj_weight or q/k/v_proj_weight, "
                "out_proj.weight, and with bias in_proj_bias and out_proj.bias)");
  }
  if (out_weight->rank() != 2 || (*out_weight)[0] != (*out_weight)[1] || (*out_weight)[0] < 1) {
    throw Error(where + ": tensor 'out_proj.weight' has shape " + out_weight->str() +
                ", expected (embed_dim, embed_dim)");
  }
  const int64_t embed_dim = (*out_weight)[0];
  if (embed_dim % num_heads != 0) {
    throw Error("--heads " + std::to_string(num_heads) + " does not divide embed_dim " +
                std::to_string(embed_dim) + " (from out_proj.weight " + out_weight->str() + " in " +
                path + ")");
  }
  MultiHeadOptions options;
  options.bias = tensors.count("in_proj_bias") != 0 || tensors.count("out_proj.bias") != 0;
  // Separate projections exist only when kdim or vdim differ from embed_dim; their second
  // dimension is the feature count of key and value.
  for (auto [name, target] :
       {std::pair{"k_proj_weight", &options.kdim}, std::pair{"v_proj_weight", &options.vdim}}) {
    if (const std::optional<Shape> shape = shape_of(name)) {
      if (shape->rank() != 2 || (*shape)[0] != embed_dim || (*shape)[1] < 1) {
        throw Error(where + ": tensor '" + name + "' has shape " + shape->str() +
                    ", expected (embed_dim " + std::to_string(embed_dim) + ", features)");
      }
      *target = (*shape)[1];
    }
  }
  const bool separate = tensors.count("q_proj_weight") != 0 ||
                        tensors.count("k_proj_weight") != 0 || tensors.count("v_proj_weight") != 0;
  if (separate && tensors.count("in_proj_weight") != 0) {
    throw Error(where + ": has both in_proj_weight and q/k/v_proj_weight");
  }
  if (separate && (options.kdim == 0 || options.kdim == embed_dim) &&
      (options.vdim == 0 || options.vdim == embed_dim)) {
    throw Error(where + ": q/k/v_proj_weight with kdim = vdim = embed_dim " +
                std::to_string(embed_dim) +
                "; PyTorch stores such a module as one in_proj_weight (" +
                std::to_string(3 * embed_dim) + ", " + std::to_string(embed_dim) + ")");
  }
  if (separate && (options.kdim == 0 || options.vdim == 0)) {
    throw Error(where + ": missing tensor '" +
                std::string(options.kdim == 0 ? "k_proj_weight" : "v_proj_weight") + "'");
  }
  MultiHeadAttention module(embed_dim, num_heads, options);
  try {
    module.load_state_dict(tensors);
  } catch (const Error& e) {
    throw Error(where + ": " + e.what());
  }
  return module;
}

void run_mha(const MhaArguments& arguments, const CLI::App& mha) {
  // 1. Options that need no file.
  const auto num_heads =
      static_cast<int64_t>(parse_integer("--heads", arguments.heads_text, 1, kMaxHeads));
  MultiHeadForwardOptions options;
  options.causal = arguments.causal;
  options.num_threads = threads_from(mha, arguments.threads_text, 0);
  if (arguments.key_path.empty() != arguments.value_path.empty()) {
    throw Error(
        "--key and --value go together (give both for cross-attention, neither for "
        "self-attention)");
  }
  if (arguments.average_heads && arguments.attention_weights_path.empty()) {
    throw Error("--average-heads needs --out-weights");
  }
  options.need_weights = !arguments.attention_weights_path.empty();
  options.average_weights_over_heads = arguments.average_heads;
  check_output_path("--out", arguments.output_path);
  if (options.need_weights) check_output_path("--out-weights", arguments.attention_weights_path);

  // 2. The module, then the inputs.
  const MultiHeadAttention module = load_module(arguments.weights_path, num_heads);
  const Tensor query = read_input("--query", arguments.query_path);
  check_float_input("--query", arguments.query_path, query);
  const bool self_attention = arguments.key_path.empty();
  Tensor key, value;
  if (!self_attention) {
    key = read_input("--key", arguments.key_path);
    value = read_input("--value", arguments.value_path);
    check_float_input("--key", arguments.key_path, key);
    check_float_input("--value", arguments.value_path, value);
  }
  Tensor key_padding_mask, attention_mask;
  if (!arguments.key_padding_mask_path.empty()) {
    key_padding_mask = read_input("--key-padding-mask", arguments.key_padding_mask_path);
    check_mask_input("--key-padding-mask", arguments.key_padding_mask_path, key_padding_mask,
                     "Nonzero marks a real token (PyTorch's True = padding is the opposite)");
    options.key_padding_mask = key_padding_mask.view();
  }
  if (!arguments.mask_path.empty()) {
    attention_mask = read_input("--mask", arguments.mask_path);
    check_mask_input("--mask", arguments.mask_path, attention_mask,
                     "An additive float mask (0 keeps, -inf drops) must be turned into a bool "
                     "one (mask == 0)");
    options.attn_mask = attention_mask.view();
  }

  // 3. Forward; it validates shapes and throws before computing anything.
  const TensorView query_view = query.view();
  const TensorView key_view = self_attention ? query_view : key.view();
  const TensorView value_view = self_attention ? query_view : value.view();
  MultiHeadResult result;
  try {
    result = module.forward(query_view, key_view, value_view, options);
  } catch (const Error& e) {
    throw Error("mha: " + std::string(e.what()));
  }
  // The output in the query's dtype.
  Tensor output;
  if (query.dtype() == DType::kFloat32) {
    output = std::move(result.output);
  } else {
    output = Tensor(query.dtype(), result.output.shape());
    convert(result.output.view(), output.view());
  }

  // 4. Outputs, all or nothing.
  std::vector<OutputFile> outputs = {{"--out", arguments.output_path, output.view()}};
  if (options.need_weights) {
    outputs.push_back({"--out-weights", arguments.attention_weights_path, result.weights.view()});
  }
  write_outputs(outputs);
  std::cout << wrote(outputs) << '\n';
}

}  // namespace

Command add_mha_command(CLI::App& app) {
  auto arguments = std::make_shared<MhaArguments>();
  CLI::App* mha = app.add_subcommand(
      "mha",
      "Multi-head attention (torch.nn.MultiheadAttention, batch_first) with weights from a "
      "safetensors state_dict, on .npy files");
  const auto file_option = [&](const char* name, std::string& target, const char* help) {
    return mha->add_option(name, target, help)->type_name("FILE");
  };
  file_option("--query", arguments->query_path, "query (N, L, E) or (L, E), float32 or float16")
      ->required();
  file_option("--key", arguments->key_path,
              "key (N, S, kdim); with --value, cross-attention (default: self-attention)");
  file_option("--value", arguments->value_path, "value (N, S, vdim)");
  file_option("--weights", arguments->weights_path,
              "safetensors with the module's state_dict (in_proj_weight or q/k/v_proj_weight, "
              "out_proj.weight, in_proj_bias, out_proj.bias)")
      ->required();
  mha->add_option("--heads", arguments->heads_text, "number of heads; must divide embed_dim")
      ->type_name("INT")
      ->required();
  file_option("--key-padding-mask", arguments->key_padding_mask_path,
              "(N, S) bool or integer: NONZERO = REAL TOKEN, zero = padding (the opposite of "
              "PyTorch's key_padding_mask; pass ~mask)");
  file_option("--mask", arguments->mask_path,
              "attn_mask (L, S) or (N·heads, L, S), bool or integer: zero excludes the key "
              "(the opposite of PyTorch's bool attn_mask)");
  mha->add_flag("--causal", arguments->causal, "query i sees key j only when j <= i + S - L");
  add_threads_option(*mha, arguments->threads_text, "all");
  file_option("--out", arguments->output_path, "output (N, L, E), dtype of the query")->required();
  file_option("--out-weights", arguments->attention_weights_path,
              "also write the attention weights, float32: (N, heads, L, S) per head");
  mha->add_flag("--average-heads", arguments->average_heads,
                "write the weights averaged over heads, (N, L, S)");
  return {mha, [arguments, mha] { run_mha(*arguments, *mha); }};
}

}  // namespace attend::cli
