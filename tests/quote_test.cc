// quote_test: the rule for text from outside in error messages (src/quote.hpp): the output is
// printable ASCII, quoted text reads back unambiguously, long text is cut with its length.
#include "quote.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>

#include "test_support.hpp"

namespace attend::detail {
namespace {

// Reverses quote_for_message for text that was not cut: the quoted text without its quotes,
// \\, \' and \xNN decoded. Fails the test on anything else.
std::string unquote(const std::string& quoted) {
  EXPECT_GE(quoted.size(), 2u);
  EXPECT_EQ(quoted.front(), '\'');
  EXPECT_EQ(quoted.back(), '\'');
  std::string text;
  for (size_t i = 1; i + 1 < quoted.size(); ++i) {
    if (quoted[i] == '\'') ADD_FAILURE() << "unescaped quote at " << i << " in " << quoted;
    if (quoted[i] != '\\') {
      text += quoted[i];
    } else if (quoted[i + 1] == 'x') {
      text += static_cast<char>(std::stoi(quoted.substr(i + 2, 2), nullptr, 16));
      i += 3;
    } else {
      text += quoted[i + 1];
      ++i;
    }
  }
  return text;
}

TEST(QuoteForMessage, EscapesEveryByteOutsidePrintableAscii) {
  EXPECT_EQ(quote_for_message("descr"), "'descr'");
  EXPECT_EQ(quote_for_message(std::string("de\x05") + "cr"), R"('de\x05cr')");
  EXPECT_EQ(quote_for_message("\x1b[31mred"), R"('\x1b[31mred')");
  EXPECT_EQ(quote_for_message(std::string("\0\n\t\x7f\x80\xff", 6)),
            R"('\x00\x0a\x09\x7f\x80\xff')");
  EXPECT_EQ(quote_for_message(R"(it's a\b)"), R"('it\'s a\\b')");
  EXPECT_EQ(quote_for_message(""), "''");
}

TEST(QuoteForMessage, EveryByteStringReadsBackAndIsPrintable) {
  std::mt19937 generator(17);
  std::uniform_int_distribution<int> byte(0, 255), length(0, 64);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text(static_cast<size_t>(length(generator)), '\0');
    for (char& c : text) c = static_cast<char>(byte(generator));
    const std::string quoted = quote_for_message(text);
    ASSERT_EQ(test::first_unprintable_byte(quoted), std::string::npos) << quoted;
    ASSERT_EQ(quoted.find('\n'), std::string::npos) << quoted;
    ASSERT_EQ(unquote(quoted), text) << quoted;
  }
}

TEST(QuoteForMessage, CutsLongTextAndGivesItsLength) {
  EXPECT_EQ(quote_for_message(std::string(64, 'a')), "'" + std::string(64, 'a') + "'");
  EXPECT_EQ(quote_for_message(std::string(65, 'a')),
            "'" + std::string(64, 'a') + "...' (65 bytes)");
  EXPECT_EQ(quote_for_message(std::string(1'000'000, '\x1b'), 2),
            R"('\x1b\x1b...' (1000000 bytes))");
  EXPECT_EQ(quote_for_message("abcdef", 3), "'abc...' (6 bytes)");
}

TEST(PrintableForMessage, EscapesOnlyWhatIsNotPrintable) {
  EXPECT_EQ(printable_for_message("Q.npy"), "Q.npy");
  EXPECT_EQ(printable_for_message(R"(it's a\b)"), R"(it's a\b)");
  EXPECT_EQ(printable_for_message("dir/\x1b[2J.npy"), R"(dir/\x1b[2J.npy)");
  EXPECT_EQ(printable_for_message("line\nbreak\xc3\xa9"), R"(line\x0abreak\xc3\xa9)");
  EXPECT_EQ(printable_for_message(std::string(2000, 'p')),
            std::string(kMaxNameBytes, 'p') + "... (2000 bytes)");
  // A message whose quoted parts were escaped already reads the same.
  const std::string message = "Q.npy: unexpected key " + quote_for_message("\x05\\'");
  EXPECT_EQ(printable_for_message(message), message);
}

}  // namespace
}  // namespace attend::detail
