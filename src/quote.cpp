// quote.cpp: the one rule for text from outside in error messages (see quote.hpp).
#include "quote.hpp"

namespace attend::detail {
namespace {

bool is_printable(unsigned char byte) { return byte >= 0x20 && byte < 0x7f; }

// Appends `text`, cut to `max_bytes`, with every byte outside printable ASCII as \xNN, and
// also \ and ' as \\ and \' when `inside_quotes`.
void append_escaped(std::string& out, std::string_view text, size_t max_bytes, bool inside_quotes) {
  constexpr char kHexDigits[] = "0123456789abcdef";
  const std::string_view shown = text.substr(0, max_bytes);
  for (const char c : shown) {
    const auto byte = static_cast<unsigned char>(c);
    if (!is_printable(byte)) {
      out += "\\x";
      out += kHexDigits[byte >> 4];
      out += kHexDigits[byte & 0xF];
    } else if (inside_quotes && (c == '\\' || c == '\'')) {
      out += '\\';
      out += c;
    } else {
      out += c;
    }
  }
  if (shown.size() < text.size()) out += "...";
}

std::string length_note(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return "";
  return " (" + std::to_string(text.size()) + " bytes)";
}

}  // namespace

std::string quote_for_message(std::string_view text, size_t max_bytes) {
  std::string out = "'";
  append_escaped(out, text, max_bytes, /*inside_quotes=*/true);
  out += '\'';
  return out + length_note(text, max_bytes);
}

std::string printable_for_message(std::string_view text, size_t max_bytes) {
  std::string out;
  append_escaped(out, text, max_bytes, /*inside_quotes=*/false);
  return out + length_note(text, max_bytes);
}

}  // namespace attend::detail
