// safetensors_test: round trips, a file written by an independent writer (the golden script),
// and one malformed image per validation rule.
#include "attend/safetensors.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "test_support.hpp"

namespace attend {
namespace {

namespace fs = std::filesystem;

// A safetensors image: 8-byte little-endian length, `header`, then `data_bytes` bytes 0, 1, ...
std::vector<unsigned char> image(const std::string& header, size_t data_bytes,
                                 uint64_t declared_length = UINT64_MAX) {
  const uint64_t length = declared_length == UINT64_MAX ? header.size() : declared_length;
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(length >> (8 * i)));
  bytes += header;
  for (size_t i = 0; i < data_bytes; ++i) bytes.push_back(static_cast<char>(i));
  return std::vector<unsigned char>(bytes.begin(), bytes.end());
}

std::string parse_error(const std::vector<unsigned char>& bytes) {
  try {
    (void)parse_safetensors(bytes.data(), bytes.size(), "image.safetensors");
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(Safetensors, ParsesAValidImage) {
  const auto bytes = image(
      R"({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 2],)"
      R"( "data_offsets": [0, 16]}, "b": {"dtype": "U8", "shape": [3], "data_offsets": [16, 19]},)"
      R"( "empty": {"dtype": "F16", "shape": [0, 4], "data_offsets": [19, 19]}})",
      19);
  const SafetensorsContents contents = parse_safetensors(bytes.data(), bytes.size(), "x");
  ASSERT_EQ(contents.tensors.size(), 3u);
  EXPECT_EQ(contents.metadata.at("format"), "pt");
  const Tensor& a = contents.tensors.at("a");
  EXPECT_EQ(a.shape(), Shape({2, 2}));
  EXPECT_EQ(a.dtype(), DType::kFloat32);
  uint32_t first;
  std::memcpy(&first, a.data(), 4);
  EXPECT_EQ(first, 0x03020100u);  // bytes 0, 1, 2, 3 little-endian
  EXPECT_EQ(contents.tensors.at("b").data_as<uint8_t>()[2], 18);
  EXPECT_EQ(contents.tensors.at("empty").shape(), Shape({0, 4}));
}

TEST(Safetensors, EveryMalformedImageIsAnErrorNamingTheProblem) {
  struct Case {
    std::vector<unsigned char> bytes;
    const char* expected;  // a phrase the message must contain
  };
  const std::string ok_entry = R"("t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
  const Case cases[] = {
      {{1, 2, 3}, "too short"},
      {image("{}", 0, 1000), "runs past the end"},
      {image("{not json", 0), "not valid JSON"},
      {image("[1, 2]", 0), "not a JSON object"},
      {image(R"({"t": 5})", 0), "'t'"},
      {image(R"({"t": {"dtype": "F32", "shape": [2]}})", 8), "data_offsets"},
      {image(R"({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}})", 8), "Q7"},
      {image(R"({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8), "negative"},
      {image(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8),
       "outside the data"},
      {image(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 4]}})", 8),
       "outside the data"},
      {image(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 12), "needs 12"},
      {image(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", 8),
       "not [begin, end]"},
      {image("{" + ok_entry + R"(, "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
             12),
       "overlap"},
      {image(R"({"__metadata__": {"k": 3}})", 0), "__metadata__"},
      {image(
           R"({"t": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 8]}})",
           8),
       "overflows"},
  };
  for (const Case& c : cases) {
    const std::string message = parse_error(c.bytes);
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "expected \"" << c.expected << "\" in: " << message;
    EXPECT_EQ(message.rfind("image.safetensors", 0), 0u) << message;
  }
}

// JSON escapes put any byte into a name or a dtype (\u001b is ESC); the messages show them
// escaped, and the parser's own message about raw bytes is made printable as well.
TEST(Safetensors, MessagesShowHeaderTextEscaped) {
  const struct {
    std::vector<unsigned char> bytes;
    std::string expected;
  } cases[] = {
      {image(R"({"de\u0005cr\u001b[31m": 5})", 0),
       R"(tensor 'de\x05cr\x1b[31m': header entry is not a JSON object)"},
      {image(R"({"t": {"dtype": "F\u001b]0;x\u0007", "shape": [2], "data_offsets": [0, 8]}})", 8),
       R"(unknown safetensors dtype 'F\x1b]0;x\x07')"},
      {image(R"({"__metadata__": {"k\u0000\u00ff'": 3}})", 0),  // U+00FF is C3 BF in UTF-8
       R"(value of 'k\x00\xc3\xbf\'' is not a string)"},
      {image(R"({"t": {"dtype": "F32", "shape": ["\u001b\u00ff"], "data_offsets": [0, 8]}})", 8),
       R"("shape" ["\u001b\u00ff"] holds a non-integer)"},
      {image("{\"t\x1b[2J\xff", 0), "not valid JSON"},
  };
  for (const auto& c : cases) {
    const std::string message = parse_error(c.bytes);
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "expected \"" << c.expected << "\" in: " << message;
    EXPECT_EQ(test::first_unprintable_byte(message), std::string::npos) << message;
  }
}

TEST(Safetensors, LongNamesAreCutInMessages) {
  const std::string name(5000, 'n');
  const std::string message = parse_error(image(R"({")" + name + R"(": 5})", 0));
  EXPECT_NE(message.find("tensor '" + std::string(64, 'n') + "...' (5000 bytes)"),
            std::string::npos)
      << message;
  EXPECT_LT(message.size(), 200u) << message;
}

TEST(Safetensors, SaveAndLoadRoundTripEveryDType) {
  const test::TemporaryDirectory dir;
  const std::string path = dir / "round_trip.safetensors";

  Tensor matrix(DType::kFloat32, Shape({3, 4}));
  for (int i = 0; i < 12; ++i) matrix.data_as<float>()[i] = static_cast<float>(i) * 0.25f - 1.0f;
  // The transpose (4, 3) through strides: saved as its logical contents.
  const TensorView transposed(matrix.data(), DType::kFloat32, Shape({4, 3}), Shape({1, 4}));
  Tensor halves(DType::kFloat16, Shape({5}));
  Tensor brains(DType::kBFloat16, Shape({2, 1}));
  Tensor ids(DType::kInt64, Shape({3}));
  Tensor flags(DType::kBool, Shape({2}));
  for (int i = 0; i < 5; ++i) halves.data_as<uint16_t>()[i] = static_cast<uint16_t>(0x3C00 + i);
  brains.data_as<uint16_t>()[0] = 0x3F80;
  brains.data_as<uint16_t>()[1] = 0xC000;
  for (int i = 0; i < 3; ++i) ids.data_as<int64_t>()[i] = int64_t{1} << (20 * i);
  flags.data_as<uint8_t>()[0] = 1;
  flags.data_as<uint8_t>()[1] = 0;
  save_safetensors(path,
                   {{"transposed", transposed},
                    {"halves", halves.view()},
                    {"brains", brains.view()},
                    {"ids", ids.view()},
                    {"flags", flags.view()}},
                   {{"written_by", "attend"}});

  const SafetensorsContents loaded = load_safetensors(path);
  EXPECT_EQ(loaded.metadata.at("written_by"), "attend");
  const Tensor& t = loaded.tensors.at("transposed");
  ASSERT_EQ(t.shape(), Shape({4, 3}));
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j)
      EXPECT_EQ(t.data_as<float>()[i * 3 + j], matrix.data_as<float>()[j * 4 + i]);
  for (const auto* name : {"halves", "brains", "ids", "flags"}) {
    const Tensor& original = std::string(name) == "halves"   ? halves
                             : std::string(name) == "brains" ? brains
                             : std::string(name) == "ids"    ? ids
                                                             : flags;
    const Tensor& back = loaded.tensors.at(name);
    EXPECT_EQ(back.dtype(), original.dtype()) << name;
    EXPECT_EQ(back.shape(), original.shape()) << name;
    EXPECT_EQ(std::memcmp(back.data(), original.data(), original.nbytes()), 0) << name;
  }
  // The data section starts 8-byte aligned, and no temporary file is left behind.
  const auto bytes = fs::file_size(path);
  EXPECT_EQ((bytes - (12 * 4 + 5 * 2 + 2 * 2 + 3 * 8 + 2)) % 8, 0u);
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"round_trip.safetensors"});
}

TEST(Safetensors, SaveIntoAMissingDirectoryFailsCleanly) {
  const test::TemporaryDirectory parent;
  const fs::path dir = parent.path() / "no_such_dir";
  Tensor x = Tensor::zeros(DType::kFloat32, Shape({2}));
  EXPECT_THROW(save_safetensors((dir / "x.safetensors").string(), {{"x", x.view()}}), Error);
  EXPECT_FALSE(fs::exists(dir));
}

TEST(Safetensors, ReadsAFileFromAnIndependentWriter) {
  // tests/data/mha/*.safetensors are written by scripts/make_mha_golden.py (json + struct).
  const SafetensorsContents contents =
      load_safetensors(std::string(ATTEND_TEST_DATA_DIR) + "/mha/float16_params.safetensors");
  EXPECT_EQ(contents.tensors.at("in_proj_weight").dtype(), DType::kFloat16);
  EXPECT_EQ(contents.tensors.at("in_proj_weight").shape(), Shape({48, 16}));
  EXPECT_EQ(contents.tensors.at("out_proj.bias").shape(), Shape({16}));
  EXPECT_EQ(contents.metadata.at("num_heads"), "4");
}

// A file that cannot be read says why, as the .npy reader does.
TEST(Safetensors, AnUnreadableFileSaysWhy) {
  const test::TemporaryDirectory directory;
  const auto message = [](const std::string& path) -> std::string {
    try {
      (void)load_safetensors(path);
    } catch (const Error& error) {
      return error.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(message("/nonexistent/attend/file.safetensors"),
            "/nonexistent/attend/file.safetensors: cannot open for reading: No such file or "
            "directory");
  EXPECT_EQ(message(directory.path().string()),
            directory.path().string() + ": is a directory, not a safetensors file");
}

}  // namespace
}  // namespace attend
