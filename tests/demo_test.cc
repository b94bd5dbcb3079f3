// demo_test: `attend demo` run in-process (attend_cli_main) into a temporary directory: every
// picture exists and is well-formed XML with an <svg> root of positive width and height, the
// labels are separate <text> elements (tokens escaped where needed), and a bad --out-dir is one
// error line with exit status 2. The well-formedness checker is strict and tested itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli_in_process.hpp"
#include "svg.hpp"

namespace attend {
namespace {

namespace fs = std::filesystem;

// --- A strict XML well-formedness checker ---------------------------------------------------

struct Element {
  std::string name;
  std::map<std::string, std::string> attributes;  // values unescaped
  std::vector<std::unique_ptr<Element>> children;
  std::string text;  // character data directly inside, unescaped
};

// Parses a whole document: an optional <?xml ...?> declaration, comments, exactly one root
// element. Throws std::runtime_error naming the offset of the first problem: unbalanced or
// mismatched tags, unquoted or duplicate attributes, a raw '<' or '&' outside a markup or an
// entity, an unknown entity, text outside the root.
class XmlParser {
 public:
  explicit XmlParser(std::string text) : text_(std::move(text)) {}

  std::unique_ptr<Element> parse_document() {
    if (text_.compare(0, 5, "<?xml") == 0) {
      const size_t end = text_.find("?>");
      if (end == std::string::npos) fail("unterminated XML declaration");
      position_ = end + 2;
    }
    skip_misc();
    if (!peek('<')) fail("expected the root element");
    auto root = parse_element();
    skip_misc();
    if (position_ != text_.size()) fail("content after the root element");
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(what + " at offset " + std::to_string(position_));
  }
  bool peek(char c) const { return position_ < text_.size() && text_[position_] == c; }
  bool starts(const char* prefix) const {
    return text_.compare(position_, std::strlen(prefix), prefix) == 0;
  }
  void expect(char c) {
    if (!peek(c)) fail(std::string("expected '") + c + "'");
    ++position_;
  }
  void skip_space() {
    while (position_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[position_])))
      ++position_;
  }
  // Whitespace and comments between markup at the top level.
  void skip_misc() {
    for (;;) {
      skip_space();
      if (starts("<!--")) {
        skip_comment();
      } else {
        return;
      }
    }
  }
  void skip_comment() {
    const size_t end = text_.find("-->", position_ + 4);
    if (end == std::string::npos) fail("unterminated comment");
    position_ = end + 3;
  }
  std::string parse_name() {
    const size_t begin = position_;
    auto is_start = [](char c) {
      return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':';
    };
    auto is_part = [&](char c) {
      return is_start(c) || std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '.';
    };
    if (position_ >= text_.size() || !is_start(text_[position_])) fail("expected a name");
    while (position_ < text_.size() && is_part(text_[position_])) ++position_;
    return text_.substr(begin, position_ - begin);
  }
  // Character data up to `stop` (exclusive), with entities replaced; a raw '<' is refused.
  std::string parse_characters(char stop) {
    std::string out;
    while (position_ < text_.size() && text_[position_] != stop) {
      const char c = text_[position_];
      if (c == '<') fail("raw '<' in character data");
      if (c == '&') {
        out += parse_entity();
      } else {
        out += c;
        ++position_;
      }
    }
    return out;
  }
  std::string parse_entity() {
    static const std::map<std::string, std::string> kEntities = {
        {"amp", "&"}, {"lt", "<"}, {"gt", ">"}, {"quot", "\""}, {"apos", "'"}};
    const size_t end = text_.find(';', position_);
    if (end == std::string::npos || end - position_ > 10) fail("'&' that starts no entity");
    const std::string name = text_.substr(position_ + 1, end - position_ - 1);
    std::string replacement;
    if (const auto found = kEntities.find(name); found != kEntities.end()) {
      replacement = found->second;
    } else if (name.size() > 1 && name[0] == '#' &&
               std::all_of(name.begin() + 1, name.end(),
                           [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      replacement = "?";  // numeric character reference; the value does not matter here
    } else {
      fail("unknown entity '&" + name + ";'");
    }
    position_ = end + 1;
    return replacement;
  }
  std::unique_ptr<Element> parse_element() {
    expect('<');
    auto element = std::make_unique<Element>();
    element->name = parse_name();
    for (;;) {
      const size_t before = position_;
      skip_space();
      if (starts("/>")) {
        position_ += 2;
        return element;
      }
      if (peek('>')) {
        ++position_;
        break;
      }
      if (position_ == before) fail("expected whitespace before an attribute");
      const std::string name = parse_name();
      skip_space();
      expect('=');
      skip_space();
      if (!peek('"') && !peek('\'')) fail("attribute '" + name + "' is not quoted");
      const char quote = text_[position_++];
      std::string value = parse_characters(quote);
      expect(quote);
      if (!element->attributes.emplace(name, value).second) {
        fail("duplicate attribute '" + name + "'");
      }
    }
    // Content: text, comments and child elements, then the matching end tag.
    for (;;) {
      if (position_ >= text_.size()) fail("element <" + element->name + "> is not closed");
      if (starts("</")) {
        position_ += 2;
        const std::string name = parse_name();
        if (name != element->name) fail("</" + name + "> closes <" + element->name + ">");
        skip_space();
        expect('>');
        return element;
      }
      if (starts("<!--")) {
        skip_comment();
      } else if (peek('<')) {
        element->children.push_back(parse_element());
      } else {
        element->text += parse_characters('<');
      }
    }
  }

  std::string text_;
  size_t position_ = 0;
};

std::unique_ptr<Element> parse_xml(const std::string& text) {
  return XmlParser(text).parse_document();
}

void collect_texts(const Element& element, std::vector<std::string>& texts) {
  if (element.name == "text") texts.push_back(element.text);
  for (const auto& child : element.children) collect_texts(*child, texts);
}

bool well_formed(const std::string& text) {
  try {
    parse_xml(text);
    return true;
  } catch (const std::runtime_error&) {
    return false;
  }
}

TEST(XmlChecker, AcceptsWellFormedAndRejectsMalformed) {
  EXPECT_TRUE(
      well_formed("<?xml version=\"1.0\"?>\n<svg a=\"1\" b='2'><g><text>x &amp; y"
                  "</text></g><!-- c --><rect/></svg>\n"));
  EXPECT_FALSE(well_formed("<svg><text>a & b</text></svg>"));   // raw &
  EXPECT_FALSE(well_formed("<svg><text>a < b</text></svg>"));   // raw <
  EXPECT_FALSE(well_formed("<svg width=10></svg>"));            // unquoted
  EXPECT_FALSE(well_formed("<svg a=\"1\" a=\"2\"></svg>"));     // duplicate
  EXPECT_FALSE(well_formed("<svg><g></svg>"));                  // mismatched
  EXPECT_FALSE(well_formed("<svg><g>"));                        // unclosed
  EXPECT_FALSE(well_formed("<svg></svg><svg></svg>"));          // two roots
  EXPECT_FALSE(well_formed("<svg a=\"x<y\"></svg>"));           // < in a value
  EXPECT_FALSE(well_formed("<svg><text>&nbsp;</text></svg>"));  // unknown entity
  EXPECT_FALSE(well_formed("<svg a=\"1\"b=\"2\"></svg>"));      // no space
}

TEST(SvgWriter, EscapesTextAndAttributes) {
  EXPECT_EQ(svg::escape_xml("<a & \"b\" 'c'>"), "&lt;a &amp; &quot;b&quot; &apos;c&apos;&gt;");
  svg::Document document(100, 50);
  document.text(1, 2, "<bos> & <pad>");
  svg::TextStyle style;
  style.fill = "\"><script>";
  document.text(1, 2, "x", style);
  const auto root = parse_xml(document.str());
  std::vector<std::string> texts;
  collect_texts(*root, texts);
  EXPECT_EQ(texts, (std::vector<std::string>{"<bos> & <pad>", "x"}));
}

// --- The demo ----------------------------------------------------------------------------------

using attend::test::run_cli;

std::string read_text(const fs::path& path) { return attend::test::read_file_bytes(path.string()); }

const std::vector<std::string> kPictures = {"phrase_self_attention.svg", "cross_attention.svg",
                                            "unet_attention.svg", "vit_attention.svg"};

// Runs the demo once for the whole suite (it takes about a second).
class Demo : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    directory_ = new attend::test::TemporaryDirectory;
    // A directory that does not exist yet: the demo creates it.
    run_ = new attend::test::CliRun(
        run_cli({"demo", "--out-dir", *directory_ / "pictures", "--threads", "2"}));
  }
  static void TearDownTestSuite() {
    delete directory_;
    delete run_;
  }
  static fs::path picture(const std::string& name) {
    return directory_->path() / "pictures" / name;
  }

  static attend::test::TemporaryDirectory* directory_;
  static attend::test::CliRun* run_;
};
attend::test::TemporaryDirectory* Demo::directory_ = nullptr;
attend::test::CliRun* Demo::run_ = nullptr;

TEST_F(Demo, SucceedsAndSaysWhatItIs) {
  ASSERT_EQ(run_->exit_status, 0) << run_->err;
  EXPECT_EQ(run_->err, "");
  for (const char* needle : {"not from training", "no network", "4096 positions", "4 heads",
                             "(1, 8, 4, 4)", "(1, 128, 64, 64)", "largest weight on <pad>: 0"}) {
    EXPECT_NE(run_->out.find(needle), std::string::npos) << needle << " missing from\n"
                                                         << run_->out;
  }
  for (const std::string& name : kPictures) {
    EXPECT_NE(run_->out.find(picture(name).string()), std::string::npos) << name;
  }
}

TEST_F(Demo, EveryPictureIsWellFormedSvg) {
  for (const std::string& name : kPictures) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fs::is_regular_file(picture(name)));
    std::unique_ptr<Element> root;
    ASSERT_NO_THROW(root = parse_xml(read_text(picture(name))));
    EXPECT_EQ(root->name, "svg");
    for (const char* dimension : {"width", "height"}) {
      ASSERT_EQ(root->attributes.count(dimension), 1u) << dimension;
      EXPECT_GT(std::atof(root->attributes.at(dimension).c_str()), 0.0) << dimension;
    }
  }
  // No temporary files left behind.
  for (const auto& entry : fs::directory_iterator(directory_->path() / "pictures")) {
    EXPECT_EQ(entry.path().extension(), ".svg") << entry.path();
  }
}

// Whether every one of `labels` is the whole content of some <text> element of `picture`.
void expect_labels(const fs::path& picture, const std::vector<std::string>& labels) {
  const auto root = parse_xml(read_text(picture));
  std::vector<std::string> texts;
  collect_texts(*root, texts);
  for (const std::string& label : labels) {
    EXPECT_NE(std::find(texts.begin(), texts.end(), label), texts.end())
        << picture << ": no <text> element holding exactly '" << label << "'";
  }
}

TEST_F(Demo, PhrasePictureLabelsEachToken) {
  expect_labels(picture("phrase_self_attention.svg"), {"How", "are", "you", "?"});
  // Eight heads: each token labels a row and a column of eight panels.
  const auto root = parse_xml(read_text(picture("phrase_self_attention.svg")));
  std::vector<std::string> texts;
  collect_texts(*root, texts);
  EXPECT_EQ(std::count(texts.begin(), texts.end(), "How"), 16);
  EXPECT_EQ(std::count(texts.begin(), texts.end(), "head 7"), 1);
}

// The query panels name blobs A, B and C: the input panel marks them, with (row, column).
TEST_F(Demo, UnetInputPanelMarksTheBlobs) {
  expect_labels(picture("unet_attention.svg"),
                {"blob A (18, 18)", "blob B (42, 46)", "blob C (48, 14)",
                 "query (18, 18), in blob A", "(row, column): row 0-63 down, column 0-63 across"});
}

TEST_F(Demo, CrossAttentionPictureLabelsBothLanguages) {
  // "<bos>" and "<pad>" are only readable back if they were escaped.
  expect_labels(picture("cross_attention.svg"),
                {"Wie", "geht", "es", "dir", "<pad>", "<bos>", "How", "are", "you"});
}

TEST(DemoErrors, OutDirUnderARegularFileIsOneErrorLine) {
  const attend::test::TemporaryDirectory temporary;
  const fs::path& directory = temporary.path();
  std::ofstream(directory / "file") << "not a directory";
  const attend::test::CliRun run =
      run_cli({"demo", "--out-dir", (directory / "file" / "pictures").string()});
  EXPECT_EQ(run.exit_status, 2);
  EXPECT_EQ(run.err.rfind("error: ", 0), 0u) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_NE(run.err.find("--out-dir"), std::string::npos) << run.err;
  EXPECT_EQ(run.out, "") << "fails before any work";
  const attend::test::CliRun bad_threads =
      run_cli({"demo", "--out-dir", (directory / "x").string(), "--threads", "zero"});
  EXPECT_EQ(bad_threads.exit_status, 2);
  EXPECT_EQ(std::count(bad_threads.err.begin(), bad_threads.err.end(), '\n'), 1);
  EXPECT_FALSE(fs::exists(directory / "x")) << "options are checked before the directory is made";
}

}  // namespace
}  // namespace attend
