// Tests for the attend executable, run as a subprocess in a fresh directory per test: a good
// run checked against the library's reference backend, and every kind of bad input, which
// must give exit status 2, exactly one "error: " line on stderr, and no output file created
// or changed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "attend/attend.hpp"
#include "attend/npy.hpp"
#include "cli_main.hpp"
#include "test_support.hpp"

extern char** environ;

namespace attend {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_status = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

using test::read_file_bytes;

// Deterministic values in [-1, 1) (a small linear congruential generator).
Tensor filled(const Shape& shape, uint32_t seed) {
  Tensor t(DType::kFloat32, shape);
  uint32_t state = seed * 2654435761u + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state = state * 1664525u + 1013904223u;
    t.data_as<float>()[i] = static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
  }
  return t;
}

class AttendCli : public ::testing::Test {
 protected:
  void SetUp() override {
    // Q (2, 5, 8), K (2, 7, 8), V (2, 7, 3), a bool mask (5, 7) and a bias (5, 7).
    write("Q.npy", filled(Shape({2, 5, 8}), 1));
    write("K.npy", filled(Shape({2, 7, 8}), 2));
    write("V.npy", filled(Shape({2, 7, 3}), 3));
    write("B.npy", filled(Shape({5, 7}), 4));
    Tensor mask(DType::kBool, Shape({5, 7}));
    for (int64_t i = 0; i < mask.numel(); ++i) mask.data_as<uint8_t>()[i] = (i % 3) != 1;
    write("M.npy", mask);
  }
  std::string path(const std::string& name) const { return directory_ / name; }
  void write(const std::string& name, const Tensor& t) const { write_npy(path(name), t.view()); }

  // Runs the attend binary with `arguments` in the test directory.
  RunResult run(const std::vector<std::string>& arguments) const {
#ifdef ATTEND_CLI_EMULATOR  // a cross build: the binary runs under the emulator
    std::vector<std::string> words = {ATTEND_CLI_EMULATOR, ATTEND_CLI_PATH};
#else
    std::vector<std::string> words = {ATTEND_CLI_PATH};
#endif
    words.insert(words.end(), arguments.begin(), arguments.end());
    std::vector<char*> argv;
    for (std::string& word : words) argv.push_back(word.data());
    argv.push_back(nullptr);

    const std::string out_path = path("stdout.txt"), err_path = path("stderr.txt");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_addopen(&actions, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    // The child runs in the test directory, so relative paths refer to it.
    posix_spawn_file_actions_addchdir_np(&actions, directory_.path().c_str());
    pid_t pid = 0;
    const int spawn_error = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);

    RunResult result;
    if (spawn_error != 0) {
      ADD_FAILURE() << "cannot run " << argv[0] << ": " << std::strerror(spawn_error);
      return result;
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    result.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    result.out = read_file_bytes(out_path);
    result.err = read_file_bytes(err_path);
    fs::remove(out_path);
    fs::remove(err_path);
    return result;
  }

  // The run failed as a bad input must: status 2, one "error: " line containing `phrase`,
  // nothing on stdout.
  static void expect_error(const RunResult& result, const std::string& phrase) {
    EXPECT_EQ(result.exit_status, 2) << result.err;
    EXPECT_EQ(result.err.rfind("error: ", 0), 0u) << result.err;
    ASSERT_FALSE(result.err.empty());
    EXPECT_EQ(result.err.find('\n'), result.err.size() - 1) << "more than one line:\n"
                                                            << result.err;
    EXPECT_NE(result.err.find(phrase), std::string::npos)
        << "expected '" << phrase << "' in: " << result.err;
    EXPECT_EQ(test::first_unprintable_byte(result.err), std::string::npos)
        << "a raw control or non-ASCII byte in: " << result.err;
    EXPECT_EQ(result.out, "");
  }

  // Sorted names of the files in the test directory.
  std::vector<std::string> listing() const { return directory_.listing(); }

  test::TemporaryDirectory directory_;
};

// The same computation through the library's reference backend.
AttentionResult reference(const std::string& directory, AttentionOptions options,
                          const char* mask = nullptr, const char* bias = nullptr) {
  const Tensor q = read_npy(directory + "/Q.npy");
  const Tensor k = read_npy(directory + "/K.npy");
  const Tensor v = read_npy(directory + "/V.npy");
  std::optional<Tensor> mask_tensor, bias_tensor;
  if (mask) {
    mask_tensor = read_npy(directory + "/" + mask);
    options.mask = mask_tensor->view();
  }
  if (bias) {
    bias_tensor = read_npy(directory + "/" + bias);
    options.bias = bias_tensor->view();
  }
  options.backend = Backend::kReference;
  return scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
}

// Largest |got - expected| over two float32 tensors of the same shape.
float max_difference(const Tensor& got, const Tensor& expected) {
  EXPECT_EQ(got.shape(), expected.shape());
  EXPECT_EQ(got.dtype(), DType::kFloat32);
  if (got.shape() != expected.shape()) return INFINITY;
  float worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    worst = std::max(worst, std::fabs(got.data_as<float>()[i] - expected.data_as<float>()[i]));
  }
  return worst;
}

// Outputs are weighted means of values in [-1, 1): float32 rounding differences between
// backends stay far below this.
constexpr float kTolerance = 1e-5f;

// ---------------------------------------------------------------------------------------
// Successful runs

TEST_F(AttendCli, SdpaMatchesTheReferenceBackend) {
  const RunResult result =
      run({"sdpa", "--query", "Q.npy", "--key", "K.npy", "--value", "V.npy", "--out", "O.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  EXPECT_EQ(result.err, "");
  EXPECT_EQ(result.out, "wrote O.npy (2, 5, 3) float32\n");
  const Tensor output = read_npy(path("O.npy"));
  const AttentionResult expected = reference(directory_.path().string(), {});
  EXPECT_LT(max_difference(output, expected.output), kTolerance);
}

// --compute-dtype bf16 gives the library's kBFloat16 result bit for bit where the CPU has
// bfloat16 products, and a one-line error where it does not; fp16 the same with float16
// products (AVX512_FP16).
TEST_F(AttendCli, ComputeDtypeSelectsThePrecisionOfTheProducts) {
  write("Q20.npy", filled(Shape({2, 20, 8}), 5));
  const std::vector<std::string> common = {"sdpa",  "--query",        "Q20.npy", "--key",
                                           "K.npy", "--value",        "V.npy",   "--out",
                                           "O.npy", "--compute-dtype"};
  std::vector<std::string> bf16 = common, fp16 = common;
  bf16.push_back("bf16");
  fp16.push_back("fp16");
  const RunResult f16_result = run(fp16);
  if (fp16_compute_path().find("with ComputePrecision::kFloat16") == std::string::npos) {
    expect_error(f16_result, "compute precision float16");
  } else {
    EXPECT_EQ(f16_result.exit_status, 0) << f16_result.err;
  }
  const RunResult result = run(bf16);
  if (bf16_compute_path().rfind("bfloat16", 0) != 0) {  // no AVX512_BF16, or capped away
    expect_error(result, "needs bfloat16 products");
    return;
  }
  ASSERT_EQ(result.exit_status, 0) << result.err;
  const Tensor q = read_npy(path("Q20.npy")), k = read_npy(path("K.npy")),
               v = read_npy(path("V.npy"));
  AttentionOptions options;
  options.compute = ComputePrecision::kBFloat16;
  const Tensor expected =
      scaled_dot_product_attention(q.view(), k.view(), v.view(), options).output;
  const Tensor output = read_npy(path("O.npy"));
  ASSERT_EQ(output.nbytes(), expected.nbytes());
  EXPECT_EQ(std::memcmp(output.data(), expected.data(), output.nbytes()), 0);
  // Not the float32 products' result: the rounding of the inputs shows.
  options.compute = ComputePrecision::kFloat32;
  const Tensor float32 = scaled_dot_product_attention(q.view(), k.view(), v.view(), options).output;
  EXPECT_GT(max_difference(output, float32), 0.0);
}

TEST_F(AttendCli, SdpaWithMaskBiasCausalScaleAndWeights) {
  const RunResult result =
      run({"sdpa",      "--query", "Q.npy",  "--key", "K.npy",         "--value", "V.npy",
           "--mask",    "M.npy",   "--bias", "B.npy", "--causal",      "--scale", "0.25",
           "--threads", "2",       "--out",  "O.npy", "--out-weights", "W.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  EXPECT_EQ(result.out, "wrote O.npy (2, 5, 3) float32 and W.npy (2, 5, 7) float32\n");
  AttentionOptions options;
  options.causal = true;
  options.scale = 0.25;
  options.need_weights = true;
  const AttentionResult expected = reference(directory_.path().string(), options, "M.npy", "B.npy");
  EXPECT_LT(max_difference(read_npy(path("O.npy")), expected.output), kTolerance);
  EXPECT_LT(max_difference(read_npy(path("W.npy")), expected.weights), kTolerance);
}

TEST_F(AttendCli, ScoreRulesMatchTheLibrary) {
  // Two heads (the last batch dimension of Q (2, 5, 8)): slopes, sinks and documents per head.
  write("S.npy", filled(Shape({2}), 11));
  Tensor documents(DType::kInt32, Shape({7}));
  for (int64_t j = 0; j < 7; ++j) documents.data_as<int32_t>()[j] = j < 3 ? 0 : 1;
  write("D.npy", documents);
  Tensor query_documents(DType::kInt64, Shape({5}));
  for (int64_t i = 0; i < 5; ++i) query_documents.data_as<int64_t>()[i] = i < 2 ? 0 : 1;
  write("DQ.npy", query_documents);
  const RunResult result = run({"sdpa",           "--query",         "Q.npy",    "--key",
                                "K.npy",          "--value",         "V.npy",    "--causal",
                                "--causal-align", "top-left",        "--window", "3",
                                "--alibi",        "--softcap",       "2.5",      "--sinks",
                                "S.npy",          "--segment-ids-q", "DQ.npy",   "--segment-ids-k",
                                "D.npy",          "--prefix",        "1",        "--out",
                                "O.npy",          "--out-weights",   "W.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  AttentionOptions options;
  options.causal = true;
  options.causal_alignment = CausalAlignment::kTopLeft;
  options.window = SlidingWindow{3, 0};
  options.alibi = true;
  options.softcap = 2.5;
  const Tensor sinks = read_npy(path("S.npy"));
  options.sinks = sinks.view();
  options.segment_ids_query = query_documents.view();
  options.segment_ids_key = documents.view();
  options.prefix = 1;
  options.need_weights = true;
  const AttentionResult expected = reference(directory_.path().string(), options);
  EXPECT_LT(max_difference(read_npy(path("O.npy")), expected.output), kTolerance);
  EXPECT_LT(max_difference(read_npy(path("W.npy")), expected.weights), kTolerance);
}

TEST_F(AttendCli, GroupedQueryAttentionFromShapesAndFlag) {
  // Multi-query: one K/V head for the query's two.
  write("K.npy", filled(Shape({1, 7, 8}), 2));
  write("V.npy", filled(Shape({1, 7, 3}), 3));
  const RunResult result = run({"sdpa", "--query", "Q.npy", "--key", "K.npy", "--value", "V.npy",
                                "--kv-heads", "1", "--out", "O.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  const AttentionResult expected = reference(directory_.path().string(), AttentionOptions{});
  EXPECT_LT(max_difference(read_npy(path("O.npy")), expected.output), kTolerance);
  const RunResult wrong = run({"sdpa", "--query", "Q.npy", "--key", "K.npy", "--value", "V.npy",
                               "--kv-heads", "2", "--out", "O2.npy"});
  EXPECT_NE(wrong.exit_status, 0);
  EXPECT_NE(wrong.err.find("num_kv_heads 2 does not match"), std::string::npos) << wrong.err;
}

TEST_F(AttendCli, SinkGradientIsWritten) {
  write("S.npy", filled(Shape({2}), 11));
  write("G.npy", filled(Shape({2, 5, 3}), 12));
  const RunResult result =
      run({"sdpa",   "--query",      "Q.npy",  "--key",      "K.npy",  "--value",
           "V.npy",  "--sinks",      "S.npy",  "--out",      "O.npy",  "--grad-out",
           "G.npy",  "--grad-query", "dQ.npy", "--grad-key", "dK.npy", "--grad-value",
           "dV.npy", "--grad-sinks", "dS.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  const Tensor q = read_npy(path("Q.npy")), k = read_npy(path("K.npy")),
               v = read_npy(path("V.npy"));
  const Tensor sinks = read_npy(path("S.npy")), g = read_npy(path("G.npy"));
  AttentionOptions options;
  options.sinks = sinks.view();
  options.need_logsumexp = true;
  const AttentionResult forward =
      scaled_dot_product_attention(q.view(), k.view(), v.view(), options);
  const AttentionGradients expected = scaled_dot_product_attention_backward(
      g.view(), q.view(), k.view(), v.view(), forward.output.view(), forward.logsumexp.view(),
      options);
  EXPECT_LT(max_difference(read_npy(path("dS.npy")), expected.sinks), kTolerance);
}

TEST_F(AttendCli, DropoutWithSeedMatchesTheLibrary) {
  const RunResult result =
      run({"sdpa", "--query", "Q.npy", "--key", "K.npy", "--value", "V.npy", "--dropout", "0.5",
           "--seed", "7", "--backend", "reference", "--out", "O.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  AttentionOptions options;
  options.dropout = 0.5;
  options.seed = 7;
  const AttentionResult expected = reference(directory_.path().string(), options);
  EXPECT_LT(max_difference(read_npy(path("O.npy")), expected.output), kTolerance);
}

TEST_F(AttendCli, SeedWithoutDropoutIsAccepted) {
  const RunResult result = run({"sdpa", "--query", "Q.npy", "--key", "K.npy", "--value", "V.npy",
                                "--seed", "42", "--out", "O.npy"});
  EXPECT_EQ(result.exit_status, 0) << result.err;
  EXPECT_TRUE(fs::exists(path("O.npy")));
}

TEST_F(AttendCli, Float16InputGivesFloat16Output) {
  for (const char* name : {"Q.npy", "K.npy", "V.npy"}) {
    const Tensor single = read_npy(path(name));
    Tensor half(DType::kFloat16, single.shape());
    convert(single.view(), half.view());
    write(std::string("h") + name, half);
  }
  const RunResult result =
      run({"sdpa", "--query", "hQ.npy", "--key", "hK.npy", "--value", "hV.npy", "--out", "O.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  EXPECT_EQ(result.out, "wrote O.npy (2, 5, 3) float16\n");
  const Tensor output = read_npy(path("O.npy"));
  ASSERT_EQ(output.dtype(), DType::kFloat16);
  Tensor output_single(DType::kFloat32, output.shape());
  convert(output.view(), output_single.view());
  // Inputs rounded to float16 (relative 2^-11) and the output rounded again: outputs of size
  // up to 1 differ from the float32 result by a few 1e-3.
  const AttentionResult expected = reference(directory_.path().string(), {});
  EXPECT_LT(max_difference(output_single, expected.output), 4e-3f);
}

TEST_F(AttendCli, FortranOrderInputIsRead) {
  // Q rewritten by hand in Fortran order: same logical values, different byte layout.
  const Tensor q = read_npy(path("Q.npy"));
  std::string dict = "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 5, 8), }";
  while ((10 + dict.size() + 1) % 64 != 0) dict.push_back(' ');
  dict.push_back('\n');
  std::string image("\x93NUMPY\x01\x00", 8);
  image.push_back(static_cast<char>(dict.size() & 0xFF));
  image.push_back(static_cast<char>(dict.size() >> 8));
  image += dict;
  for (int e = 0; e < 8; ++e) {
    for (int l = 0; l < 5; ++l) {
      for (int b = 0; b < 2; ++b) {
        const float value = q.data_as<float>()[(b * 5 + l) * 8 + e];
        image.append(reinterpret_cast<const char*>(&value), 4);
      }
    }
  }
  std::ofstream(path("Qf.npy"), std::ios::binary) << image;
  const RunResult result =
      run({"sdpa", "--query", "Qf.npy", "--key", "K.npy", "--value", "V.npy", "--out", "O.npy"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  const AttentionResult expected = reference(directory_.path().string(), {});
  EXPECT_LT(max_difference(read_npy(path("O.npy")), expected.output), kTolerance);
}

TEST_F(AttendCli, ServeBenchRunsEachConcurrency) {
  const RunResult result = run({"serve-bench", "--requests", "5", "--concurrency", "1,3",
                                "--prompt-max", "20", "--output-max", "6", "--threads", "1"});
  ASSERT_EQ(result.exit_status, 0) << result.err;
  EXPECT_NE(result.out.find("tokens/s"), std::string::npos) << result.out;
  // One row per level: concurrency, 5 requests. stderr is a file, not a terminal: no
  // progress bar unless --progress asks for one.
  EXPECT_NE(result.out.find("          1        5"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("          3        5"), std::string::npos) << result.out;
  EXPECT_EQ(result.err, "");
  const RunResult forced = run({"serve-bench", "--requests", "2", "--concurrency", "2",
                                "--prompt-max", "8", "--output-max", "2", "--progress"});
  ASSERT_EQ(forced.exit_status, 0) << forced.err;
  EXPECT_NE(forced.err.find("\rconcurrency   2 [##############################] 2/2 requests"),
            std::string::npos)
      << forced.err;
  expect_error(run({"serve-bench", "--progress", "--quiet"}), "--quiet");
  const RunResult bad = run({"serve-bench", "--concurrency", "0"});
  EXPECT_NE(bad.exit_status, 0);
  EXPECT_NE(bad.err.find("--concurrency"), std::string::npos) << bad.err;
}

TEST_F(AttendCli, InfoListsTargetsAndVersionPrints) {
  const RunResult info = run({"info"});
  ASSERT_EQ(info.exit_status, 0) << info.err;
  EXPECT_NE(info.out.find(std::string("attend ") + version()), std::string::npos) << info.out;
  for (const std::string& target : compiled_simd_targets()) {
    EXPECT_NE(info.out.find(target), std::string::npos) << target << " missing in " << info.out;
  }
  EXPECT_NE(info.out.find("SIMD target active:"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("default threads:"), std::string::npos) << info.out;

  const RunResult version_run = run({"--version"});
  EXPECT_EQ(version_run.exit_status, 0);
  EXPECT_EQ(version_run.out, std::string("attend ") + version() + "\n");

  const RunResult help = run({"sdpa", "--help"});
  EXPECT_EQ(help.exit_status, 0);
  EXPECT_NE(help.out.find("--query"), std::string::npos) << help.out;
  EXPECT_EQ(help.err, "");
}

// README.md's synopsis names every option of every subcommand, as `--help` lists them.
TEST_F(AttendCli, ReadmeSynopsisNamesEveryOption) {
  const std::string readme =
      read_file_bytes(std::string(ATTEND_TEST_DATA_DIR) + "/../../README.md");
  const size_t start = readme.find("## The command-line tool");
  ASSERT_NE(start, std::string::npos);
  const size_t end = readme.find("\n```\n", readme.find("```\n", start) + 4);
  const std::string synopsis = readme.substr(start, end + 1 - start);  // with its last newline
  std::vector<std::string> subcommands = {"demo", "sdpa",        "mha",       "bench",
                                          "info", "serve-bench", "train-demo"};
#ifdef ATTEND_HAVE_MPI
  subcommands.push_back("ring");
#endif
  for (const std::string& subcommand : subcommands) {
    SCOPED_TRACE(subcommand);
    EXPECT_TRUE(synopsis.find("attend " + subcommand + " ") != std::string::npos ||
                synopsis.find("attend " + subcommand + "\n") != std::string::npos)
        << synopsis;
    const RunResult help = run({subcommand, "--help"});
    ASSERT_EQ(help.exit_status, 0) << help.err;
    for (size_t at = help.out.find("--"); at != std::string::npos; at = help.out.find("--", at)) {
      size_t stop = at + 2;
      while (stop < help.out.size() &&
             (std::isalnum(static_cast<unsigned char>(help.out[stop])) || help.out[stop] == '-')) {
        ++stop;
      }
      const std::string option = help.out.substr(at, stop - at);
      at = stop;
      if (option == "--help" || option.size() < 3) continue;
      EXPECT_NE(synopsis.find(option), std::string::npos)
          << option << " of `attend " << subcommand << "` is missing from README.md's synopsis";
    }
  }
}

// ---------------------------------------------------------------------------------------
// Bad input: exit 2, one error line, no output written

struct BadCase {
  const char* label;
  std::vector<std::string> extra_arguments;  // after --query/--key/--value/--out O.npy
  const char* phrase;                        // expected in the error line
};

class AttendCliBadInput : public AttendCli {
 protected:
  // Runs sdpa with Q/K/V and --out O.npy plus `extra`, and checks it failed cleanly. When
  // `existing_output` is set, O.npy (and W.npy) exist before and must stay byte-identical.
  void expect_clean_failure(const BadCase& bad, bool existing_output) {
    SCOPED_TRACE(bad.label);
    const std::string old_contents = "previous output, must survive";
    if (existing_output) {
      std::ofstream(path("O.npy"), std::ios::binary) << old_contents;
      std::ofstream(path("W.npy"), std::ios::binary) << old_contents;
    }
    const std::vector<std::string> files_before = listing();
    std::vector<std::string> arguments = {"sdpa",    "--query", "Q.npy", "--key", "K.npy",
                                          "--value", "V.npy",   "--out", "O.npy"};
    arguments.insert(arguments.end(), bad.extra_arguments.begin(), bad.extra_arguments.end());
    expect_error(run(arguments), bad.phrase);
    EXPECT_EQ(listing(), files_before) << "a file was created or removed";
    if (existing_output) {
      EXPECT_EQ(read_file_bytes(path("O.npy")), old_contents);
      EXPECT_EQ(read_file_bytes(path("W.npy")), old_contents);
      fs::remove(path("O.npy"));
      fs::remove(path("W.npy"));
    }
  }
};

TEST_F(AttendCliBadInput, EveryBadInputFailsCleanly) {
  // Malformed inputs used below.
  {
    std::ofstream(path("garbage.npy"), std::ios::binary) << "this is not numpy";
    const std::string good = read_file_bytes(path("Q.npy"));
    std::ofstream(path("truncated.npy"), std::ios::binary) << good.substr(0, good.size() - 10);
    Tensor float_mask(DType::kFloat32, Shape({5, 7}));
    for (int64_t i = 0; i < float_mask.numel(); ++i) float_mask.data_as<float>()[i] = 1.0f;
    write("float_mask.npy", float_mask);
    write("wide_mask.npy", Tensor::zeros(DType::kBool, Shape({5, 6})));
    write("int_q.npy", Tensor::zeros(DType::kInt32, Shape({2, 5, 8})));
    write("short_k.npy", filled(Shape({2, 7, 4}), 9));
  }
  const std::vector<BadCase> cases = {
      {"missing file", {"--mask", "nothere.npy"}, "nothere.npy: cannot open"},
      {"directory as input", {"--bias", "."}, "directory"},
      {"not a .npy file", {"--mask", "garbage.npy"}, "bad magic"},
      {"truncated .npy", {"--bias", "truncated.npy"}, "truncated data"},
      {"float mask", {"--mask", "float_mask.npy"}, "--bias"},
      {"mask not broadcastable", {"--mask", "wide_mask.npy"}, "does not broadcast"},
      {"integer bias", {"--bias", "int_q.npy"}, "dtype int32"},
      {"repeated option", {"--key", "K.npy"}, "--key"},
      {"bias not broadcastable", {"--bias", "short_k.npy"}, "does not broadcast"},
      {"dropout 1", {"--dropout", "1"}, "--dropout"},
      {"dropout negative", {"--dropout", "-0.1"}, "--dropout"},
      {"dropout nan", {"--dropout", "nan"}, "--dropout"},
      {"scale text", {"--scale", "abc"}, "--scale"},
      {"scale inf", {"--scale", "inf"}, "finite"},
      {"scale nan", {"--scale", "nan"}, "finite"},
      {"scale with suffix", {"--scale", "0.5x"}, "not a number"},
      {"scale empty", {"--scale", ""}, "not a number"},
      {"mask empty", {"--mask", ""}, "--mask"},
      {"threads 0", {"--threads", "0"}, "--threads"},
      {"threads negative", {"--threads", "-2"}, "--threads"},
      {"threads text", {"--threads", "many"}, "--threads"},
      {"seed negative", {"--seed", "-1"}, "--seed"},
      {"backend unknown", {"--backend", "gpu"}, "--backend"},
      {"unknown option", {"--frobnicate"}, "--frobnicate"},
      {"option without value", {"--scale"}, "--scale"},
      {"weights directory missing", {"--out-weights", "nodir/W.npy"}, "does not exist"},
      {"weights same as out", {"--out-weights", "./O.npy"}, "same file"},
      {"weights is a directory", {"--out-weights", "."}, "directory"},
      {"the old name of --out-weights", {"--weights", "W.npy"}, "--weights is now --out-weights"},
      {"misspelt option",
       {"--casual"},
       "unknown option --casual for `attend sdpa`; did you mean --causal?"},
      {"window negative", {"--window", "-3"}, "--window"},
      {"window text", {"--window", "3,x"}, "--window"},
      {"window right with causal", {"--causal", "--window", "2,3"}, "window"},
      {"softcap zero", {"--softcap", "0"}, "softcap"},
      {"softcap nan", {"--softcap", "nan"}, "softcap"},
      {"causal-align unknown", {"--causal-align", "middle"}, "--causal-align"},
      {"prefix too long", {"--causal", "--prefix", "8"}, "prefix"},
      {"prefix without causal", {"--prefix", "2"}, "causal"},
      {"sinks wrong shape", {"--sinks", "B.npy"}, "sinks"},
      {"alibi slopes wrong shape", {"--alibi-slopes", "B.npy"}, "alibi_slopes"},
      {"segment ids alone", {"--segment-ids-q", "M.npy"}, "--segment-ids-k"},
      {"segment ids float", {"--segment-ids-q", "B.npy", "--segment-ids-k", "B.npy"}, "dtype"},
      {"grad-sinks without sinks", {"--grad-sinks", "dS.npy"}, "--sinks"},
  };
  for (const BadCase& bad : cases) {
    expect_clean_failure(bad, /*existing_output=*/false);
    expect_clean_failure(bad, /*existing_output=*/true);
  }
}

// Bytes of a crafted file, and arguments typed or pasted, reach the terminal escaped only.
TEST_F(AttendCliBadInput, ErrorLinesShowFileAndArgumentBytesEscaped) {
  // Q.npy with its key 'descr' turned into five bytes that would clear the screen and more.
  std::string hostile = read_file_bytes(path("Q.npy"));
  const size_t key = hostile.find("descr");
  ASSERT_NE(key, std::string::npos);
  hostile.replace(key, 5, "\x1b[2J\xff");
  std::ofstream(path("hostile.npy"), std::ios::binary) << hostile;
  const std::vector<BadCase> cases = {
      {"header key", {"--bias", "hostile.npy"}, R"(unexpected key '\x1b[2J\xff')"},
      {"scale", {"--scale", "\x1b[31m"}, R"(--scale: '\x1b[31m' is not a number)"},
      {"threads", {"--threads", "\x1b]0;title\x07"}, R"('\x1b]0;title\x07' is not a non-negative)"},
      {"path", {"--mask", "no\x1b[2J.npy"}, R"(no\x1b[2J.npy: cannot open)"},
      {"option name (CLI11's message)", {"--frobnicate\x1b[2J"}, R"(--frobnicate\x1b[2J)"},
  };
  for (const BadCase& bad : cases) expect_clean_failure(bad, /*existing_output=*/false);
  expect_error(run({"\x1b[2Jsdpa"}), R"(unknown subcommand '\x1b[2Jsdpa')");
}

TEST_F(AttendCliBadInput, WrongQueryDtypeAndShapeFailCleanly) {
  write("int_q.npy", Tensor::zeros(DType::kInt32, Shape({2, 5, 8})));
  write("vector.npy", filled(Shape({8}), 5));
  write("narrow_q.npy", filled(Shape({2, 5, 4}), 6));
  write("other_batch_q.npy", filled(Shape({3, 5, 8}), 7));
  for (const auto& [query, phrase] :
       {std::pair{"int_q.npy", "dtype int32"}, std::pair{"vector.npy", "(8,)"},
        std::pair{"narrow_q.npy", "last dimension"}, std::pair{"other_batch_q.npy", "batch"}}) {
    SCOPED_TRACE(query);
    std::ofstream(path("O.npy"), std::ios::binary) << "old";
    expect_error(
        run({"sdpa", "--query", query, "--key", "K.npy", "--value", "V.npy", "--out", "O.npy"}),
        phrase);
    EXPECT_EQ(read_file_bytes(path("O.npy")), "old");
  }
}

TEST_F(AttendCliBadInput, MissingOutputDirectoryAndRequiredOptions) {
  expect_error(
      run({"sdpa", "--query", "Q.npy", "--key", "K.npy", "--value", "V.npy", "--out", "out/O.npy"}),
      "directory 'out' does not exist");
  expect_error(run({"sdpa", "--query", "Q.npy", "--key", "K.npy", "--value", "V.npy"}),
               "--out is required");
  expect_error(run({"sdpa", "--key", "K.npy", "--value", "V.npy", "--out", "O.npy"}),
               "--query is required");
  expect_error(run({}), "subcommand is required");
  expect_error(run({"frobnicate"}), "unknown subcommand 'frobnicate'");
  const std::vector<std::string> inputs = {"B.npy", "K.npy", "M.npy", "Q.npy", "V.npy"};
  EXPECT_EQ(listing(), inputs);
}

// ---------------------------------------------------------------------------------------
// In-process entry point (what fuzzers call)

TEST(AttendCliInProcess, ReturnsTwoOnBadArgumentsAndNeverThrows) {
  // No arguments at all, even without argv[0]: an error, not a crash.
  testing::internal::CaptureStderr();
  EXPECT_EQ(attend_cli_main(0, nullptr), 2);
  EXPECT_EQ(testing::internal::GetCapturedStderr().rfind("error: a subcommand is required", 0), 0u);
  std::vector<std::string> words = {"attend", "sdpa", "--scale"};
  std::vector<char*> argv;
  for (std::string& word : words) argv.push_back(word.data());
  argv.push_back(nullptr);
  EXPECT_EQ(attend_cli_main(static_cast<int>(words.size()), argv.data()), 2);
  std::vector<std::string> info_words = {"attend", "info"};
  std::vector<char*> info_argv = {info_words[0].data(), info_words[1].data(), nullptr};
  EXPECT_EQ(attend_cli_main(2, info_argv.data()), 0);
}

}  // namespace
}  // namespace attend
