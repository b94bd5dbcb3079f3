// svg.hpp: a small SVG writer for the pictures of `attend demo` and of the training example's
// curves: text, rectangles, marks and lines, heatmap panels of attention weights with a colour
// scale, every label its own <text> element, every piece of text XML-escaped.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace attend::svg {

// `text` with &, <, >, " and ' replaced by entities, and control characters other than tab
// and newline (not allowed in XML 1.0) dropped.
std::string escape_xml(std::string_view text);

// "#rrggbb" of the colour that `fraction` (clamped to [0, 1]) maps to on a perceptually
// ordered dark-blue -> green -> yellow scale (anchors after matplotlib's viridis).
std::string colour_for(double fraction);

enum class Anchor { kStart, kMiddle, kEnd };

struct TextStyle {
  double size = 12;
  Anchor anchor = Anchor::kStart;
  bool bold = false;
  double rotate_degrees = 0;  // about the anchor point
  std::string fill = "#222222";
};

// One SVG document, built element by element; str() closes it.
class Document {
 public:
  Document(double width, double height);

  void text(double x, double y, std::string_view content, const TextStyle& style = {});
  void rect(double x, double y, double width, double height, const std::string& fill,
            const std::string& stroke = "", double stroke_width = 1);
  void circle(double cx, double cy, double r, const std::string& fill, const std::string& stroke,
              double stroke_width);
  // A filled path; `outline` is SVG path data ("M0 0h4v4h-4z...").
  void path(const std::string& outline, const std::string& fill);
  void line(double x1, double y1, double x2, double y2, const std::string& stroke,
            double stroke_width);
  // An open line through `points` ({x, y} pairs), unfilled (a curve of a plot).
  void polyline(const std::vector<std::array<double, 2>>& points, const std::string& stroke,
                double stroke_width);

  double width() const { return width_; }
  double height() const { return height_; }
  std::string str() const;

 private:
  double width_, height_;
  std::string body_;
};

// A point on a heatmap to mark (e.g. the query pixel): row and column of its cell.
struct Marker {
  int64_t row = 0, column = 0;
};

// One heatmap panel: values (rows × columns, row-major) coloured from value_min (dark) to
// value_max (bright).
struct Heatmap {
  std::string title;
  int64_t rows = 0, columns = 0;
  std::vector<double> values;
  double value_min = 0, value_max = 1;
  std::vector<std::string> row_labels;     // empty, or one per row (left of the grid)
  std::vector<std::string> column_labels;  // empty, or one per column (above, rotated)
  bool show_values = false;                // print each value in its cell (unquantized only)
  int value_decimals = 2;                  // ... with this many decimals (format_number)
  // > 0: values are quantized to this many colour levels and equal neighbours in a row are
  // merged (keeps a 64 × 64 panel small); 0: one rectangle per cell, exact colours.
  int colour_levels = 0;
  std::vector<Marker> markers;
};

// Draws `map` with its top-left grid corner at (x, y), cells of cell_size. Row labels go left
// of the grid, column labels above it (rotated when longer than a cell), the title above them:
// the caller leaves room for both.
void draw_heatmap(Document& document, double x, double y, double cell_size, const Heatmap& map);

// A vertical colour bar at (x, y) of the given size, labelled with `low` at the bottom and
// `high` at the top (printed with `precision` significant digits) and a caption.
void draw_colour_bar(Document& document, double x, double y, double width, double height,
                     double low, double high, const std::string& caption, int precision = 3);

// A number as short text: "0.412", "2.4e-04".
std::string format_number(double value, int precision = 3);

}  // namespace attend::svg
