// svg.cpp: the SVG writer behind the pictures of `attend demo` and `attend train-demo`.
#include "svg.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <vector>

namespace attend::svg {
namespace {

// Coordinates with at most two decimals, no trailing zeros: "12", "12.5", "0.33".
std::string coordinate(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.2f", value);
  std::string text = buffer;
  while (text.back() == '0') text.pop_back();
  if (text.back() == '.') text.pop_back();
  if (text == "-0") text = "0";
  return text;
}

const char* anchor_name(Anchor anchor) {
  switch (anchor) {
    case Anchor::kMiddle:
      return "middle";
    case Anchor::kEnd:
      return "end";
    default:
      return "start";
  }
}

// Where `value` lies between low and high, in [0, 1]; 0 when the range is empty.
double fraction_of(double value, double low, double high) {
  if (!(high > low) || !std::isfinite(value)) return 0.0;
  return std::clamp((value - low) / (high - low), 0.0, 1.0);
}

// Appends ` name="value"` with the value escaped.
void append_attribute(std::string& element, std::string_view name, std::string_view value) {
  element += ' ';
  element += name;
  element += "=\"";
  element += escape_xml(value);
  element += '"';
}

}  // namespace

std::string escape_xml(std::string_view text) {
  std::string escaped;
  escaped.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        escaped += "&amp;";
        break;
      case '<':
        escaped += "&lt;";
        break;
      case '>':
        escaped += "&gt;";
        break;
      case '"':
        escaped += "&quot;";
        break;
      case '\'':
        escaped += "&apos;";
        break;
      default:
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') escaped += c;
    }
  }
  return escaped;
}

std::string colour_for(double fraction) {
  // Nine anchors of the viridis scale (dark blue, blue, teal, green, yellow), interpolated
  // linearly in RGB.
  static constexpr std::array<std::array<double, 3>, 9> kAnchors = {{
      {0x44, 0x01, 0x54},
      {0x47, 0x2c, 0x7a},
      {0x3b, 0x52, 0x8b},
      {0x2c, 0x72, 0x8e},
      {0x21, 0x91, 0x8c},
      {0x28, 0xae, 0x80},
      {0x5e, 0xc9, 0x62},
      {0xad, 0xdc, 0x30},
      {0xfd, 0xe7, 0x25},
  }};
  const double position = std::clamp(std::isfinite(fraction) ? fraction : 0.0, 0.0, 1.0) *
                          static_cast<double>(kAnchors.size() - 1);
  const size_t lower = std::min(static_cast<size_t>(position), kAnchors.size() - 2);
  const double t = position - static_cast<double>(lower);
  char buffer[8];
  int channel[3];
  for (int c = 0; c < 3; ++c) {
    const double value = kAnchors[lower][c] * (1 - t) + kAnchors[lower + 1][c] * t;
    channel[c] = static_cast<int>(std::lround(value));
  }
  std::snprintf(buffer, sizeof buffer, "#%02x%02x%02x", channel[0], channel[1], channel[2]);
  return buffer;
}

std::string format_number(double value, int precision) {
  char buffer[32];
  if (value != 0 && (std::abs(value) < 1e-2 || std::abs(value) >= 1e4)) {
    std::snprintf(buffer, sizeof buffer, "%.*e", std::max(precision - 2, 0), value);
  } else {
    std::snprintf(buffer, sizeof buffer, "%.*f", precision, value);
  }
  return buffer;
}

Document::Document(double width, double height) : width_(width), height_(height) {}

void Document::text(double x, double y, std::string_view content, const TextStyle& style) {
  body_ += "<text";
  append_attribute(body_, "x", coordinate(x));
  append_attribute(body_, "y", coordinate(y));
  append_attribute(body_, "font-size", coordinate(style.size));
  append_attribute(body_, "text-anchor", anchor_name(style.anchor));
  append_attribute(body_, "fill", style.fill);
  if (style.bold) append_attribute(body_, "font-weight", "bold");
  if (style.rotate_degrees != 0) {
    append_attribute(body_, "transform",
                     "rotate(" + coordinate(style.rotate_degrees) + " " + coordinate(x) + " " +
                         coordinate(y) + ")");
  }
  body_ += '>';
  body_ += escape_xml(content);
  body_ += "</text>\n";
}

void Document::rect(double x, double y, double width, double height, const std::string& fill,
                    const std::string& stroke, double stroke_width) {
  body_ += "<rect";
  append_attribute(body_, "x", coordinate(x));
  append_attribute(body_, "y", coordinate(y));
  append_attribute(body_, "width", coordinate(width));
  append_attribute(body_, "height", coordinate(height));
  append_attribute(body_, "fill", fill);
  if (!stroke.empty()) {
    append_attribute(body_, "stroke", stroke);
    append_attribute(body_, "stroke-width", coordinate(stroke_width));
  }
  body_ += "/>\n";
}

void Document::circle(double cx, double cy, double r, const std::string& fill,
                      const std::string& stroke, double stroke_width) {
  body_ += "<circle";
  append_attribute(body_, "cx", coordinate(cx));
  append_attribute(body_, "cy", coordinate(cy));
  append_attribute(body_, "r", coordinate(r));
  append_attribute(body_, "fill", fill);
  append_attribute(body_, "stroke", stroke);
  append_attribute(body_, "stroke-width", coordinate(stroke_width));
  body_ += "/>\n";
}

void Document::path(const std::string& outline, const std::string& fill) {
  body_ += "<path";
  append_attribute(body_, "d", outline);
  append_attribute(body_, "fill", fill);
  body_ += "/>\n";
}

void Document::line(double x1, double y1, double x2, double y2, const std::string& stroke,
                    double stroke_width) {
  body_ += "<line";
  append_attribute(body_, "x1", coordinate(x1));
  append_attribute(body_, "y1", coordinate(y1));
  append_attribute(body_, "x2", coordinate(x2));
  append_attribute(body_, "y2", coordinate(y2));
  append_attribute(body_, "stroke", stroke);
  append_attribute(body_, "stroke-width", coordinate(stroke_width));
  body_ += "/>\n";
}

void Document::polyline(const std::vector<std::array<double, 2>>& points, const std::string& stroke,
                        double stroke_width) {
  std::string coordinates;
  for (const auto& [x, y] : points) {
    if (!coordinates.empty()) coordinates += ' ';
    coordinates += coordinate(x) + "," + coordinate(y);
  }
  body_ += "<polyline";
  append_attribute(body_, "points", coordinates);
  append_attribute(body_, "fill", "none");
  append_attribute(body_, "stroke", stroke);
  append_attribute(body_, "stroke-width", coordinate(stroke_width));
  append_attribute(body_, "stroke-linejoin", "round");
  body_ += "/>\n";
}

std::string Document::str() const {
  const std::string w = coordinate(width_), h = coordinate(height_);
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
         "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
         w + "\" height=\"" + h + "\" viewBox=\"0 0 " + w + " " + h +
         "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n"
         "<rect x=\"0\" y=\"0\" width=\"" +
         w + "\" height=\"" + h + "\" fill=\"#ffffff\"/>\n" + body_ + "</svg>\n";
}

void draw_heatmap(Document& document, double x, double y, double cell_size, const Heatmap& map) {
  const double grid_width = cell_size * static_cast<double>(map.columns);
  const double label_size = std::min(12.0, std::max(8.0, cell_size * 0.4));

  // 1. Cells. With colour_levels: the most common level is one rectangle under the whole grid,
  //    and each other level one <path> holding a rectangle per run of that level in a row.
  const auto cell_value = [&](int64_t r, int64_t c) {
    return map.values[static_cast<size_t>(r * map.columns + c)];
  };
  if (map.colour_levels > 0) {
    const auto level_of = [&](double value) {
      return static_cast<size_t>(
          std::lround(fraction_of(value, map.value_min, map.value_max) * map.colour_levels));
    };
    std::vector<int64_t> counts(static_cast<size_t>(map.colour_levels) + 1, 0);
    for (double value : map.values) ++counts[level_of(value)];
    const size_t background =
        static_cast<size_t>(std::max_element(counts.begin(), counts.end()) - counts.begin());
    std::vector<std::string> outlines(counts.size());
    for (int64_t r = 0; r < map.rows; ++r) {
      for (int64_t c = 0, run = 1; c < map.columns; c += run, run = 1) {
        const size_t level = level_of(cell_value(r, c));
        while (c + run < map.columns && level_of(cell_value(r, c + run)) == level) ++run;
        if (level == background) continue;
        // A hair larger than the run, so that anti-aliasing leaves no seams between cells.
        const double run_width = cell_size * static_cast<double>(run) + 0.3;
        std::string& outline = outlines[level];
        outline += 'M';
        outline += coordinate(x + cell_size * static_cast<double>(c));
        outline += ' ';
        outline += coordinate(y + cell_size * static_cast<double>(r));
        outline += 'h';
        outline += coordinate(run_width);
        outline += 'v';
        outline += coordinate(cell_size + 0.3);
        outline += "h-";
        outline += coordinate(run_width);
        outline += 'z';
      }
    }
    const auto colour_of_level = [&](size_t level) {
      return colour_for(static_cast<double>(level) / map.colour_levels);
    };
    document.rect(x, y, grid_width, cell_size * static_cast<double>(map.rows),
                  colour_of_level(background));
    for (size_t level = 0; level < outlines.size(); ++level) {
      if (!outlines[level].empty()) document.path(outlines[level], colour_of_level(level));
    }
  } else {
    for (int64_t r = 0; r < map.rows; ++r) {
      for (int64_t c = 0; c < map.columns; ++c) {
        const double value = cell_value(r, c);
        const double fraction = fraction_of(value, map.value_min, map.value_max);
        document.rect(x + cell_size * static_cast<double>(c),
                      y + cell_size * static_cast<double>(r), cell_size, cell_size,
                      colour_for(fraction));
        if (map.show_values) {
          TextStyle style;
          style.size = label_size * 0.9;
          style.anchor = Anchor::kMiddle;
          style.fill = fraction > 0.6 ? "#111111" : "#ffffff";
          document.text(x + cell_size * (static_cast<double>(c) + 0.5),
                        y + cell_size * (static_cast<double>(r) + 0.5) + style.size * 0.35,
                        format_number(value, map.value_decimals), style);
        }
      }
    }
  }
  document.rect(x, y, grid_width, cell_size * static_cast<double>(map.rows), "none", "#444444",
                0.8);

  // 2. Marked cells: a ring around the cell centre.
  for (const Marker& marker : map.markers) {
    const double cx = x + cell_size * (static_cast<double>(marker.column) + 0.5);
    const double cy = y + cell_size * (static_cast<double>(marker.row) + 0.5);
    const double radius = std::max(cell_size * 1.6, 4.0);
    document.circle(cx, cy, radius, "none", "#ffffff", 2.0);
    document.circle(cx, cy, radius + 1.5, "none", "#d62728", 1.5);
  }

  // 3. Labels: rows to the left, columns above (rotated when they would not fit a cell).
  for (size_t r = 0; r < map.row_labels.size(); ++r) {
    TextStyle style;
    style.size = label_size;
    style.anchor = Anchor::kEnd;
    document.text(x - 4, y + cell_size * (static_cast<double>(r) + 0.5) + label_size * 0.35,
                  map.row_labels[r], style);
  }
  size_t longest_column_label = 0;
  for (const std::string& label : map.column_labels) {
    longest_column_label = std::max(longest_column_label, label.size());
  }
  const bool rotate = static_cast<double>(longest_column_label) * label_size * 0.6 > cell_size;
  for (size_t c = 0; c < map.column_labels.size(); ++c) {
    TextStyle style;
    style.size = label_size;
    style.anchor = rotate ? Anchor::kStart : Anchor::kMiddle;
    style.rotate_degrees = rotate ? -45 : 0;
    document.text(x + cell_size * (static_cast<double>(c) + 0.5), y - 5, map.column_labels[c],
                  style);
  }
  if (!map.title.empty()) {
    TextStyle style;
    style.size = 13;
    style.bold = true;
    style.anchor = Anchor::kMiddle;
    const double label_height =
        map.column_labels.empty()
            ? 0.0
            : (rotate ? static_cast<double>(longest_column_label) * label_size * 0.5 : label_size);
    document.text(x + grid_width / 2, y - 10 - label_height, map.title, style);
  }
}

void draw_colour_bar(Document& document, double x, double y, double width, double height,
                     double low, double high, const std::string& caption, int precision) {
  constexpr int kSteps = 32;
  const double step = height / kSteps;
  for (int i = 0; i < kSteps; ++i) {
    // Step 0 (the top) is the brightest.
    const double fraction = 1.0 - (static_cast<double>(i) + 0.5) / kSteps;
    document.rect(x, y + step * i, width, step + 0.3, colour_for(fraction));
  }
  document.rect(x, y, width, height, "none", "#444444", 0.8);
  TextStyle style;
  style.size = 10;
  document.text(x + width + 4, y + 8, format_number(high, precision), style);
  document.text(x + width + 4, y + height, format_number(low, precision), style);
  style.anchor = Anchor::kMiddle;
  document.text(x + width / 2, y + height + 16, caption, style);
}

}  // namespace attend::svg
