// training_curves.cpp: the loss and accuracy curves of a training run as an SVG picture.
#include "training_curves.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "attend/error.hpp"
#include "svg.hpp"

namespace attend::examples {
namespace {

using Point = std::array<double, 2>;  // {x, y} in data units

// At most this many points per curve: a 2000-step run keeps the file small and the line
// readable (each point is the mean of its bucket of steps).
constexpr size_t kMaxCurvePoints = 400;

struct Series {
  std::string label;
  std::string colour;
  std::vector<Point> points;
};

struct Panel {
  std::string title, y_label;
  double left = 0, top = 0, width = 0, height = 0;  // plot area, pixels
  double x_low = 0, x_high = 1;
  double y_low = 0, y_high = 1;  // for a log axis: log10 of the range
  bool y_logarithmic = false;
  bool legend_at_bottom = false;  // where the curves leave room (accuracy ends at the top)
  std::vector<std::pair<double, std::string>> y_ticks;  // data value, label
  std::vector<Series> series;
};

// Steps between x ticks: 1, 2 or 5 × 10^k, giving at most about eight ticks.
double tick_step(double range) {
  const double rough = std::max(range, 1.0) / 8.0;
  const double decade = std::pow(10.0, std::floor(std::log10(rough)));
  for (double factor : {1.0, 2.0, 5.0}) {
    if (factor * decade >= rough) return std::max(1.0, factor * decade);
  }
  return std::max(1.0, 10.0 * decade);
}

std::string short_number(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g", value);
  return buffer;
}

void draw_panel(svg::Document& document, const Panel& panel) {
  const auto x_pixel = [&](double x) {
    return panel.left + (x - panel.x_low) / (panel.x_high - panel.x_low) * panel.width;
  };
  const auto y_pixel = [&](double y) {
    const double value = panel.y_logarithmic ? std::log10(y) : y;
    const double fraction = (value - panel.y_low) / (panel.y_high - panel.y_low);
    return panel.top + (1.0 - std::clamp(fraction, 0.0, 1.0)) * panel.height;
  };
  const double bottom = panel.top + panel.height;

  // 1. Grid and ticks.
  svg::TextStyle tick_style;
  tick_style.size = 10;
  tick_style.anchor = svg::Anchor::kEnd;
  for (const auto& [value, label] : panel.y_ticks) {
    const double y = y_pixel(value);
    document.line(panel.left, y, panel.left + panel.width, y, "#e4e4e4", 1);
    document.text(panel.left - 6, y + 3.5, label, tick_style);
  }
  tick_style.anchor = svg::Anchor::kMiddle;
  const double step = tick_step(panel.x_high - panel.x_low);
  for (double x = panel.x_low; x <= panel.x_high + 1e-9; x += step) {
    document.line(x_pixel(x), panel.top, x_pixel(x), bottom, "#f0f0f0", 1);
    document.line(x_pixel(x), bottom, x_pixel(x), bottom + 4, "#444444", 1);
    document.text(x_pixel(x), bottom + 16, short_number(x), tick_style);
  }
  document.rect(panel.left, panel.top, panel.width, panel.height, "none", "#444444", 1);

  // 2. Curves, clipped to the plot area by clamping.
  for (const Series& series : panel.series) {
    std::vector<Point> pixels;
    for (const auto& [x, y] : series.points) {
      if (!std::isfinite(y) || (panel.y_logarithmic && !(y > 0))) continue;
      pixels.push_back({x_pixel(x), y_pixel(y)});
    }
    if (!pixels.empty()) document.polyline(pixels, series.colour, 1.8);
  }

  // 3. Labels and legend.
  svg::TextStyle title_style;
  title_style.size = 13;
  title_style.bold = true;
  document.text(panel.left, panel.top - 10, panel.title, title_style);
  svg::TextStyle axis_style;
  axis_style.size = 11;
  axis_style.anchor = svg::Anchor::kMiddle;
  document.text(panel.left + panel.width / 2, bottom + 34, "training step", axis_style);
  axis_style.rotate_degrees = -90;
  document.text(panel.left - 46, panel.top + panel.height / 2, panel.y_label, axis_style);
  svg::TextStyle legend_style;
  legend_style.size = 11;
  const double legend_height = 16.0 * static_cast<double>(panel.series.size()) + 8;
  const double legend_x = panel.left + panel.width - 170;
  const double legend_top = panel.legend_at_bottom ? bottom - 10 - legend_height : panel.top + 10;
  document.rect(legend_x - 8, legend_top, 160, legend_height, "#ffffff", "#cccccc", 0.8);
  double legend_y = legend_top + 17;
  for (const Series& series : panel.series) {
    document.line(legend_x, legend_y - 4, legend_x + 22, legend_y - 4, series.colour, 2.5);
    document.text(legend_x + 28, legend_y, series.label, legend_style);
    legend_y += 16;
  }
}

// The per-step values, averaged over buckets of consecutive steps (steps count from 1).
std::vector<Point> bucketed(const std::vector<double>& values) {
  const size_t bucket =
      std::max<size_t>(1, (values.size() + kMaxCurvePoints - 1) / kMaxCurvePoints);
  std::vector<Point> points;
  for (size_t begin = 0; begin < values.size(); begin += bucket) {
    const size_t end = std::min(values.size(), begin + bucket);
    double sum = 0;
    for (size_t i = begin; i < end; ++i) sum += values[i];
    const double middle_step = static_cast<double>(begin + end + 1) / 2.0;
    points.push_back({middle_step, sum / static_cast<double>(end - begin)});
  }
  return points;
}

}  // namespace

std::string training_curves_svg(const ReverseTaskSettings& settings,
                                const TrainingHistory& history) {
  constexpr double kWidth = 760, kHeight = 640, kLeft = 80, kPlotWidth = 640;
  svg::Document document(kWidth, kHeight);
  svg::TextStyle heading;
  heading.size = 15;
  heading.bold = true;
  document.text(kLeft, 26,
                "attend train-demo: learning to reverse " + std::to_string(settings.length) +
                    "-token sequences",
                heading);
  svg::TextStyle summary_style;
  summary_style.size = 11;
  summary_style.fill = "#555555";
  const std::string outcome =
      history.solved_at_step > 0
          ? "100% of held-out sequences right at step " + std::to_string(history.solved_at_step)
          : "not solved within " + std::to_string(history.losses.size()) + " steps";
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f s", history.seconds);
  document.text(kLeft, 44,
                std::to_string(settings.num_layers) + " attention layer" +
                    (settings.num_layers > 1 ? "s" : "") +
                    ", E = " + std::to_string(settings.embed_dim) + ", " +
                    std::to_string(settings.num_heads) + " heads, Adam, seed " +
                    std::to_string(settings.seed) + "; " + outcome + " (" + seconds + ")",
                summary_style);

  const double last_step = std::max<double>(1.0, static_cast<double>(history.losses.size()));

  // Loss panel: log10 axis over whole decades around the values.
  Panel loss;
  loss.title = "Cross-entropy loss";
  loss.y_label = "loss (nats, log scale)";
  loss.left = kLeft;
  loss.top = 80;
  loss.width = kPlotWidth;
  loss.height = 220;
  loss.x_high = last_step;
  loss.y_logarithmic = true;
  Series train{"training batch", "#1f77b4", bucketed(history.losses)};
  Series held_out{"held-out", "#ff7f0e", {}};
  for (const Evaluation& evaluation : history.evaluations) {
    held_out.points.push_back({static_cast<double>(evaluation.step), evaluation.loss});
  }
  double low = 1e300, high = 0;
  for (const Series* series : {&train, &held_out}) {
    for (const auto& [x, y] : series->points) {
      if (std::isfinite(y) && y > 0) low = std::min(low, y), high = std::max(high, y);
    }
  }
  if (!(high > 0)) low = high = 1;
  loss.y_low = std::floor(std::log10(std::max(low, 1e-9)));
  loss.y_high = std::max(loss.y_low + 1, std::ceil(std::log10(high)));
  for (double decade = loss.y_low; decade <= loss.y_high; ++decade) {
    loss.y_ticks.push_back({std::pow(10.0, decade), short_number(std::pow(10.0, decade))});
  }
  loss.series = {std::move(train), std::move(held_out)};
  draw_panel(document, loss);

  // Accuracy panel, percent.
  Panel accuracy;
  accuracy.title = "Held-out accuracy";
  accuracy.y_label = "accuracy (%)";
  accuracy.left = kLeft;
  accuracy.top = 380;
  accuracy.width = kPlotWidth;
  accuracy.height = 200;
  accuracy.x_high = last_step;
  accuracy.y_high = 100;
  accuracy.legend_at_bottom = true;
  for (int percent = 0; percent <= 100; percent += 25) {
    accuracy.y_ticks.push_back({percent, std::to_string(percent)});
  }
  Series tokens{"tokens", "#2ca02c", {}};
  Series sequences{"whole sequences", "#d62728", {}};
  for (const Evaluation& evaluation : history.evaluations) {
    const auto step = static_cast<double>(evaluation.step);
    tokens.points.push_back({step, 100.0 * evaluation.token_accuracy});
    sequences.points.push_back({step, 100.0 * evaluation.sequence_accuracy});
  }
  accuracy.series = {std::move(tokens), std::move(sequences)};
  draw_panel(document, accuracy);
  return document.str();
}

}  // namespace attend::examples
