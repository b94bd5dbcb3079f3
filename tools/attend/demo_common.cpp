// demo_common.cpp: see demo_common.hpp.
#include "demo_common.hpp"

#include <cmath>

#include "attend/error.hpp"

namespace attend::cli::demo {

// --- Small helpers ---------------------------------------------------------------------------

// A deterministic value in [-1, 1) for (seed, index): splitmix64, no global state.
double hashed_uniform(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + index * 0xBF58476D1CE4E5B9ull + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) / 4503599627370496.0 - 1.0;  // 2^52
}

std::string joined(const std::vector<std::string>& words) {
  std::string text;
  for (const std::string& word : words) text += (text.empty() ? "" : ", ") + word;
  return "[" + text + "]";
}

// Entropy −Σ w·ln w of one row of weights, in nats.
double entropy(const float* row, int64_t length) {
  double sum = 0;
  for (int64_t j = 0; j < length; ++j) {
    if (row[j] > 0) sum -= double{row[j]} * std::log(double{row[j]});
  }
  return sum;
}

int64_t argmax(const float* row, int64_t length) {
  return std::max_element(row, row + length) - row;
}


// One vocabulary for both languages of the text scenes.
const std::vector<std::string>& vocabulary() {
  static const std::vector<std::string> words = {"<pad>", "<bos>", "How",  "are", "you",
                                                 "?",     "Wie",   "geht", "es",  "dir"};
  return words;
}

// (1, L, dim) = embedding[ids(tokens)] + PE(0..L): the input of the first attention layer.
Tensor embed(const TokenEmbedding& table, const std::vector<std::string>& tokens) {
  const auto& words = vocabulary();
  Tensor ids(DType::kInt64, Shape({1, static_cast<int64_t>(tokens.size())}));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto found = std::find(words.begin(), words.end(), tokens[i]);
    if (found == words.end())
      throw Error("demo: token '" + tokens[i] + "' is not in the vocabulary");
    ids.data_as<int64_t>()[i] = found - words.begin();
  }
  Tensor x = table.forward(ids.view());
  const Tensor encoding = sinusoidal_positional_encoding(ids.shape()[1], table.dim());
  add_positional_encoding(x.view(), encoding.view());
  return x;
}

// For each head of weights (1, H, Lq, Lk): each query's most attended key with its weight, and
// the mean entropy of the rows against that of uniform weights over `real_keys` keys.
void print_head_summaries(std::ostream& out, const Tensor& weights,
                          const std::vector<std::string>& queries,
                          const std::vector<std::string>& keys, int64_t real_keys) {
  const int64_t H = weights.shape()[1], Lq = weights.shape()[2], Lk = weights.shape()[3];
  for (int64_t h = 0; h < H; ++h) {
    std::string line = formatted("    head %lld:", static_cast<long long>(h));
    double mean_entropy = 0;
    for (int64_t i = 0; i < Lq; ++i) {
      const float* row = weights.data_as<float>() + (h * Lq + i) * Lk;
      const int64_t best = argmax(row, Lk);
      line += formatted("  %s→%s %.2f", queries[static_cast<size_t>(i)].c_str(),
                        keys[static_cast<size_t>(best)].c_str(), double{row[best]});
      mean_entropy += entropy(row, Lk) / static_cast<double>(Lq);
    }
    out << line
        << formatted("   entropy %.2f nats (uniform %.2f)\n", mean_entropy,
                     std::log(static_cast<double>(real_keys)));
  }
}

std::string milliseconds_text(double ms) {
  return ms < 1.0 ? formatted("%.1f us", ms * 1e3) : formatted("%.2f ms", ms);
}

// --- Pictures ---------------------------------------------------------------------------------


void draw_titles(svg::Document& document, const std::string& title, const std::string& subtitle) {
  svg::TextStyle title_style;
  title_style.size = 17;
  title_style.bold = true;
  document.text(16, kTitleY, title, title_style);
  svg::TextStyle subtitle_style;
  subtitle_style.size = 11;
  subtitle_style.fill = "#555555";
  document.text(16, kSubtitleY, subtitle, subtitle_style);
}

size_t longest(const std::vector<std::string>& labels) {
  size_t length = 0;
  for (const std::string& label : labels) length = std::max(length, label.size());
  return length;
}

// Per-head heatmaps of weights (1, H, Lq, Lk), four panels a row, rows labelled with the
// queries and columns with the keys, one colour scale (0 to the largest weight).
std::string per_head_figure(const std::string& title, const std::string& subtitle,
                            const Tensor& weights, const std::vector<std::string>& queries,
                            const std::vector<std::string>& keys) {
  const int64_t H = weights.shape()[1], Lq = weights.shape()[2], Lk = weights.shape()[3];
  constexpr double kCell = 44, kGap = 28, kPanelHeader = 48;
  const int64_t panels_per_row = std::min<int64_t>(H, 4);
  const int64_t panel_rows = (H + panels_per_row - 1) / panels_per_row;
  const double label_width = 10 + 7.5 * static_cast<double>(longest(queries));
  const double panel_width = label_width + kCell * static_cast<double>(Lk) + kGap;
  const double panel_height = kPanelHeader + kCell * static_cast<double>(Lq) + kGap;
  const double top = 64;
  const double width = 16 + panel_width * static_cast<double>(panels_per_row) + 90;
  const double height = top + panel_height * static_cast<double>(panel_rows) + 30;

  double largest = 0;
  for (int64_t e = 0; e < weights.numel(); ++e) {
    largest = std::max(largest, double{weights.data_as<float>()[e]});
  }
  svg::Document document(width, height);
  draw_titles(document, title, subtitle);
  for (int64_t h = 0; h < H; ++h) {
    svg::Heatmap map;
    map.title = formatted("head %lld", static_cast<long long>(h));
    map.rows = Lq;
    map.columns = Lk;
    map.values.assign(weights.data_as<float>() + h * Lq * Lk,
                      weights.data_as<float>() + (h + 1) * Lq * Lk);
    map.value_max = largest;
    map.row_labels = queries;
    map.column_labels = keys;
    map.show_values = true;
    const double x = 16 + label_width + panel_width * static_cast<double>(h % panels_per_row);
    const double y = top + kPanelHeader + panel_height * static_cast<double>(h / panels_per_row);
    svg::draw_heatmap(document, x, y, kCell, map);
  }
  svg::draw_colour_bar(document, width - 70, top + kPanelHeader, 14, 160, 0.0, largest, "weight",
                       2);
  svg::TextStyle note;
  note.size = 10;
  note.fill = "#777777";
  document.text(16, height - 10,
                "Rows: queries; columns: keys; each row sums to 1. Weights are seeded "
                "initializations, not trained.",
                note);
  return document.str();
}

}  // namespace attend::cli::demo
