// train_demo_test: the reversal model of `attend train-demo`
// (examples/reverse_task/train_reverse.cpp). Its gradients against central finite differences of
// its own loss, Adam's bias-corrected first step, a full training run (the loss falls tenfold,
// every held-out sequence comes out reversed, the same seed gives bitwise the same run at 1 and 2
// threads), and the command run in-process: its summary, its SVG (balanced tags, curves drawn) and
// its argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "cli_in_process.hpp"
#include "train_reverse.hpp"
#include "training_curves.hpp"

namespace attend {
namespace {

using examples::ReverseTaskSettings;

// A model small enough to difference every parameter, with two layers so that the gradient
// flows through an attention layer into another one.
ReverseTaskSettings tiny_settings() {
  ReverseTaskSettings settings;
  settings.vocab_size = 5;
  settings.length = 4;
  settings.embed_dim = 8;
  settings.num_heads = 2;
  settings.num_layers = 2;
  settings.seed = 7;
  return settings;
}

TEST(TrainReverse, GradientsMatchCentralDifferences) {
  const ReverseTaskSettings settings = tiny_settings();
  examples::ReverseModel model(settings);
  const examples::ReverseBatch batch = examples::make_reverse_batch(settings, 3, settings.seed, 1);
  const examples::BatchResult analytic = model.run(batch, true);
  const std::map<std::string, TensorView> parameters = model.parameters();
  ASSERT_EQ(analytic.gradients.size(), parameters.size());

  // Every element of every parameter: (loss(p + h) − loss(p − h)) / 2h. The loss is a float32
  // computation (rounding ~1e-7 relative), so h = 1e-2 keeps rounding noise near 1e-5 while
  // the O(h²) truncation stays below the tolerance.
  constexpr float kStep = 1e-2f;
  double worst_excess = -1e300;
  std::string worst;
  int64_t checked = 0;
  for (const auto& [name, view] : parameters) {
    const auto found = analytic.gradients.find(name);
    ASSERT_NE(found, analytic.gradients.end()) << "no gradient for " << name;
    ASSERT_EQ(found->second.shape(), view.shape) << name;
    float* values = view.data_as<float>();
    for (int64_t i = 0; i < view.numel(); ++i, ++checked) {
      const float saved = values[i];
      values[i] = saved + kStep;
      const double loss_up = model.run(batch, false).loss;
      values[i] = saved - kStep;
      const double loss_down = model.run(batch, false).loss;
      values[i] = saved;
      const double numeric = (loss_up - loss_down) / (2.0 * kStep);
      const double got = found->second.data_as<float>()[i];
      const double tolerance = 2e-4 + 2e-2 * std::abs(numeric);
      const double excess = std::abs(got - numeric) - tolerance;
      if (excess > worst_excess) {
        worst_excess = excess;
        char text[200];
        std::snprintf(text, sizeof text,
                      "%s[%lld]: analytic %.6g, central difference %.6g, tolerance %.3g",
                      name.c_str(), static_cast<long long>(i), got, numeric, tolerance);
        worst = text;
      }
    }
  }
  EXPECT_GT(checked, 600);  // every parameter of the tiny model
  EXPECT_LE(worst_excess, 0.0) << "worst element: " << worst;
}

TEST(TrainReverse, BatchIsReversedAndKeyedBySeedAndStream) {
  const ReverseTaskSettings settings = tiny_settings();
  const examples::ReverseBatch batch = examples::make_reverse_batch(settings, 4, 1, 2);
  const int64_t L = settings.length;
  for (int64_t n = 0; n < 4; ++n) {
    for (int64_t i = 0; i < L; ++i) {
      const int64_t id = batch.ids.data_as<int64_t>()[n * L + i];
      EXPECT_TRUE(id >= 0 && id < settings.vocab_size) << id;
      EXPECT_EQ(batch.targets.data_as<int64_t>()[n * L + L - 1 - i], id);
    }
  }
  const auto same = [&](const examples::ReverseBatch& other) {
    return std::equal(batch.ids.data_as<int64_t>(), batch.ids.data_as<int64_t>() + 4 * L,
                      other.ids.data_as<int64_t>());
  };
  EXPECT_TRUE(same(examples::make_reverse_batch(settings, 4, 1, 2)));
  EXPECT_FALSE(same(examples::make_reverse_batch(settings, 4, 1, 3)));
  EXPECT_FALSE(same(examples::make_reverse_batch(settings, 4, 2, 2)));
}

TEST(TrainReverse, AdamFirstStepMovesEachParameterByTheLearningRate) {
  // With bias correction, step 1 is p −= lr·g/(|g| + ε): a move of lr against the sign of g,
  // whatever the gradient's size. Without the correction it would be lr·0.1/sqrt(0.001)·sign.
  std::vector<float> values = {1.0f, -2.0f, 0.5f};
  Tensor gradient(DType::kFloat32, Shape({3}));
  gradient.data_as<float>()[0] = 3.0f;
  gradient.data_as<float>()[1] = -1e-3f;
  gradient.data_as<float>()[2] = 250.0f;
  std::map<std::string, Tensor> gradients;
  gradients.emplace("p", std::move(gradient));
  examples::Adam optimizer({{"p", TensorView(values.data(), Shape({3}))}}, 0.1);
  optimizer.step(gradients);
  EXPECT_NEAR(values[0], 0.9f, 1e-5);
  EXPECT_NEAR(values[1], -1.9f, 1e-4);
  EXPECT_NEAR(values[2], 0.4f, 1e-5);
  // A constant gradient keeps m̂ = g and v̂ = g², so every later step is lr as well.
  optimizer.step(gradients);
  EXPECT_NEAR(values[0], 0.8f, 1e-5);

  std::map<std::string, Tensor> missing;
  EXPECT_THROW(optimizer.step(missing), Error);
}

TEST(TrainReverse, LearnsToReverseAndIsReproducible) {
  ReverseTaskSettings settings;  // the command's defaults
  settings.seed = 5;
  examples::ReverseModel model(settings);
  const examples::TrainingHistory history = examples::train_reverse(model, nullptr);
  ASSERT_GT(history.solved_at_step, 0) << "not solved within " << settings.max_steps;
  ASSERT_FALSE(history.losses.empty());
  EXPECT_EQ(static_cast<int64_t>(history.losses.size()), history.solved_at_step);
  EXPECT_EQ(history.evaluations.back().sequence_accuracy, 1.0);
  EXPECT_EQ(history.evaluations.back().token_accuracy, 1.0);
  EXPECT_LT(history.losses.back(), history.losses.front() / 10)
      << "first " << history.losses.front() << ", last " << history.losses.back();
  // Untrained, the model guesses: about 1/V of the tokens, ln V nats.
  EXPECT_LT(history.evaluations.front().token_accuracy, 0.3);
  EXPECT_GT(history.losses.front(), 0.5 * std::log(static_cast<double>(settings.vocab_size)));

  // The same seed at another thread count: bitwise the same run.
  settings.num_threads = 2;
  examples::ReverseModel again(settings);
  const examples::TrainingHistory repeated = examples::train_reverse(again, nullptr);
  EXPECT_EQ(repeated.solved_at_step, history.solved_at_step);
  ASSERT_EQ(repeated.losses.size(), history.losses.size());
  for (size_t i = 0; i < history.losses.size(); ++i) {
    ASSERT_EQ(repeated.losses[i], history.losses[i]) << "step " << i + 1;
  }

  // Another seed: another run.
  settings.seed = 6;
  settings.max_steps = 3;
  examples::ReverseModel other(settings);
  EXPECT_NE(examples::train_reverse(other, nullptr).losses[0], history.losses[0]);
}

TEST(TrainReverse, SettingsOutOfRangeAreRefused) {
  ReverseTaskSettings settings;
  settings.num_heads = 5;  // does not divide 32
  EXPECT_THROW(examples::ReverseModel{settings}, Error);
  settings = {};
  settings.vocab_size = 1;
  EXPECT_THROW(examples::validate(settings), Error);
  settings = {};
  settings.learning_rate = std::nan("");
  EXPECT_THROW(examples::validate(settings), Error);
}

// --- The command ----------------------------------------------------------------------------

// Checks that every element of `xml` is closed in order ("<a><b/></a>"); returns "" or what is
// wrong. Enough for the SVG writer's output (no CDATA, no '>' inside attribute values).
std::string unbalanced_tags(const std::string& xml) {
  std::vector<std::string> open;
  size_t position = xml.find("<svg");
  if (position == std::string::npos) return "no <svg> element";
  while ((position = xml.find('<', position)) != std::string::npos) {
    const size_t end = xml.find('>', position);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(position);
    const std::string tag = xml.substr(position + 1, end - position - 1);
    position = end + 1;
    if (tag.empty()) return "empty tag";
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return "unexpected </" + tag.substr(1);
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find(' ')));
    }
    if (open.empty()) return xml.find('<', position) == std::string::npos ? "" : "after root";
  }
  return "unclosed <" + open.back() + ">";
}

class TrainDemoCommand : public ::testing::Test {
 protected:
  test::TemporaryDirectory directory_;
};

TEST_F(TrainDemoCommand, TrainsAndWritesTheCurves) {
  const std::string svg_path = directory_ / "curves.svg";
  const test::CliRun run = test::run_cli({"train-demo", "--seed", "3", "--svg", svg_path});
  ASSERT_EQ(run.exit_status, 0) << run.err;
  EXPECT_EQ(run.err, "");
  EXPECT_NE(run.out.find("Reversed all 512 held-out sequences at step"), std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("sequences 100.00%"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("right\n"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("wrong"), std::string::npos) << run.out;

  const std::string svg = test::read_file_bytes(svg_path);
  ASSERT_FALSE(svg.empty());
  EXPECT_EQ(svg.rfind("</svg>\n"), svg.size() - 7);
  EXPECT_EQ(unbalanced_tags(svg), "");
  // Two loss curves and two accuracy curves, each with many points.
  size_t curves = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos;
       at = svg.find("<polyline", at + 1)) {
    const size_t points = svg.find("points=\"", at);
    const size_t points_end = svg.find('"', points + 8);
    EXPECT_GT(std::count(svg.begin() + static_cast<std::ptrdiff_t>(points),
                         svg.begin() + static_cast<std::ptrdiff_t>(points_end), ','),
              5);
    ++curves;
  }
  EXPECT_EQ(curves, 4u);
  for (const char* label : {"training step", "loss (nats, log scale)", "accuracy (%)",
                            "whole sequences", "100% of held-out sequences right at step"}) {
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  }
  // Written through a temporary file that is gone now.
  EXPECT_EQ(directory_.listing(), std::vector<std::string>{"curves.svg"});

  // --quiet: the summary only, and the same run.
  const test::CliRun quiet =
      test::run_cli({"train-demo", "--seed", "3", "--svg", svg_path, "--quiet"});
  ASSERT_EQ(quiet.exit_status, 0) << quiet.err;
  EXPECT_EQ(quiet.out.find("held-out loss"), std::string::npos) << quiet.out;
  const size_t summary = run.out.find("Reversed all");
  EXPECT_EQ(quiet.out.substr(0, quiet.out.find(" in ")),
            run.out.substr(summary, run.out.find(" in ", summary) - summary));
}

TEST_F(TrainDemoCommand, ReportsARunThatDidNotFinish) {
  const std::string svg_path = directory_ / "short.svg";
  const test::CliRun run =
      test::run_cli({"train-demo", "--steps", "4", "--svg", svg_path, "--quiet"});
  ASSERT_EQ(run.exit_status, 0) << run.err;
  EXPECT_NE(run.out.find("Not solved within 4 steps"), std::string::npos) << run.out;
  EXPECT_NE(test::read_file_bytes(svg_path).find("not solved within 4 steps"), std::string::npos);
}

TEST_F(TrainDemoCommand, BadArgumentsFailBeforeTraining) {
  const std::string missing_directory = directory_ / "no/such/x.svg";
  const struct {
    std::vector<std::string> arguments;
    const char* expected;
  } cases[] = {
      {{"train-demo", "--steps", "0"}, "--steps must be in [1,"},
      {{"train-demo", "--steps", "ten"}, "--steps"},
      {{"train-demo", "--layers", "9"}, "--layers must be in [1, 4]"},
      {{"train-demo", "--threads", "0"}, "--threads must be in [1,"},
      {{"train-demo", "--seed", "-1"}, "--seed"},
      {{"train-demo", "--svg", missing_directory}, "does not exist"},
      {{"train-demo", "--svg", directory_.path().string()}, "is a directory"},
  };
  for (const auto& c : cases) {
    const test::CliRun run = test::run_cli(c.arguments);
    EXPECT_EQ(run.exit_status, 2) << c.arguments.back();
    EXPECT_NE(run.err.find(c.expected), std::string::npos) << run.err;
    EXPECT_EQ(run.out, "") << c.arguments.back();
  }
}

}  // namespace
}  // namespace attend
