// Tests for the .npy reader and writer: round trips for every dtype, files written by numpy
// (tests/data/npy, made by scripts/make_npy_fixtures.py), Fortran order, and one test per kind
// of malformed file, each checking the key phrase of the error message.
#include "attend/npy.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "attend/error.hpp"
#include "half.hpp"
#include "test_support.hpp"

namespace attend {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = std::string(ATTEND_TEST_DATA_DIR) + "/npy/";

using test::read_file_bytes;
using test::write_file_bytes;

// A fresh directory per test, removed afterwards.
class NpyFiles : public ::testing::Test {
 protected:
  std::string file(const std::string& name) const { return directory_ / name; }
  std::vector<std::string> listing() const { return directory_.listing(); }
  test::TemporaryDirectory directory_;
};

// A .npy image built by hand: magic, version, header length, `dict` padded with spaces to a
// 64-byte boundary plus '\n', then `data`.
std::string npy_image(const std::string& dict, const std::string& data, int major = 1) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string header = dict;
  while ((prefix + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string image("\x93NUMPY", 6);
  image.push_back(static_cast<char>(major));
  image.push_back(0);
  for (size_t i = 0; i < prefix - 8; ++i) {
    image.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xFF));
  }
  return image + header + data;
}

std::string float_bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

// The error message of parse_npy on `image`, or "" when it did not throw.
std::string parse_error(const std::string& image) {
  try {
    (void)parse_npy(image.data(), image.size(), "test.npy");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_PARSE_ERROR(image, phrase)                          \
  do {                                                             \
    const std::string message = parse_error(image);                \
    EXPECT_EQ(message.rfind("test.npy: ", 0), 0u) << message;      \
    EXPECT_NE(message.find(phrase), std::string::npos) << message; \
  } while (0)

// ---------------------------------------------------------------------------------------
// Round trips

TEST_F(NpyFiles, RoundTripsEveryDtype) {
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kFloat64, DType::kBool,
                          DType::kInt8,    DType::kInt16,   DType::kInt32,   DType::kInt64,
                          DType::kUInt8,   DType::kUInt16,  DType::kUInt32,  DType::kUInt64};
  for (DType dtype : dtypes) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor original(dtype, Shape({2, 3, 5}));
    auto* bytes = static_cast<unsigned char*>(original.data());
    for (size_t i = 0; i < original.nbytes(); ++i) {
      bytes[i] = dtype == DType::kBool ? static_cast<unsigned char>(i % 3 == 0)
                                       : static_cast<unsigned char>(i * 37 + 11);
    }
    const std::string path = file(std::string(dtype_name(dtype)) + ".npy");
    write_npy(path, original.view());
    const Tensor loaded = read_npy(path);
    EXPECT_EQ(loaded.dtype(), dtype);
    EXPECT_EQ(loaded.shape(), original.shape());
    ASSERT_EQ(loaded.nbytes(), original.nbytes());
    EXPECT_EQ(std::memcmp(loaded.data(), original.data(), original.nbytes()), 0);
    // The data starts at a multiple of 64 bytes, as numpy writes it.
    EXPECT_EQ((read_file_bytes(path).size() - original.nbytes()) % 64, 0u);
  }
}

TEST_F(NpyFiles, RoundTripsScalarsAndEmptyArrays) {
  Tensor scalar(DType::kFloat32, Shape{});
  scalar.data_as<float>()[0] = 2.5f;
  write_npy(file("scalar.npy"), scalar.view());
  const Tensor loaded_scalar = read_npy(file("scalar.npy"));
  EXPECT_EQ(loaded_scalar.shape().rank(), 0);
  EXPECT_EQ(loaded_scalar.data_as<float>()[0], 2.5f);

  Tensor empty(DType::kInt32, Shape({3, 0, 2}));
  write_npy(file("empty.npy"), empty.view());
  const Tensor loaded_empty = read_npy(file("empty.npy"));
  EXPECT_EQ(loaded_empty.shape(), Shape({3, 0, 2}));
  EXPECT_EQ(loaded_empty.dtype(), DType::kInt32);
}

TEST_F(NpyFiles, StridedViewsAreWrittenInLogicalOrder) {
  // A (2, 3) tensor read transposed as (3, 2): the file holds the transpose in C order.
  std::vector<float> values = {0, 1, 2, 10, 11, 12};
  const TensorView transposed(values.data(), DType::kFloat32, Shape({3, 2}), Shape({1, 3}));
  write_npy(file("t.npy"), transposed);
  const Tensor loaded = read_npy(file("t.npy"));
  ASSERT_EQ(loaded.shape(), Shape({3, 2}));
  const float expected[] = {0, 10, 1, 11, 2, 12};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(loaded.data_as<float>()[i], expected[i]) << i;
}

// ---------------------------------------------------------------------------------------
// Files written by numpy

TEST(NpyNumpyFiles, WriterMatchesNumpyByteForByte) {
  // numpy's np.save of (10 * row + column + 0.5) as (2, 3) float32.
  Tensor values(DType::kFloat32, Shape({2, 3}));
  for (int row = 0; row < 2; ++row) {
    for (int column = 0; column < 3; ++column) {
      values.data_as<float>()[row * 3 + column] = 10.0f * row + column + 0.5f;
    }
  }
  const test::TemporaryDirectory directory;
  const std::string path = directory / "mine.npy";
  write_npy(path, values.view());
  EXPECT_EQ(read_file_bytes(path), read_file_bytes(kFixtures + "float32_c_2x3.npy"));
}

TEST(NpyNumpyFiles, ReadsCOrderFloat32) {
  const Tensor loaded = read_npy(kFixtures + "float32_c_2x3.npy");
  ASSERT_EQ(loaded.dtype(), DType::kFloat32);
  ASSERT_EQ(loaded.shape(), Shape({2, 3}));
  EXPECT_EQ(loaded.data_as<float>()[0], 0.5f);
  EXPECT_EQ(loaded.data_as<float>()[5], 12.5f);
}

TEST(NpyNumpyFiles, ReadsFortranOrderAsCContiguous) {
  // value(i, j, k) = 100 i + 10 j + k, stored by numpy in Fortran order.
  const Tensor loaded = read_npy(kFixtures + "float16_fortran_2x3x4.npy");
  ASSERT_EQ(loaded.dtype(), DType::kFloat16);
  ASSERT_EQ(loaded.shape(), Shape({2, 3, 4}));
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) {
      for (int k = 0; k < 4; ++k) {
        const float got = detail::f32_from_f16(loaded.data_as<uint16_t>()[(i * 3 + j) * 4 + k]);
        EXPECT_EQ(got, static_cast<float>(100 * i + 10 * j + k)) << i << j << k;
      }
    }
  }
}

TEST(NpyNumpyFiles, ReadsBoolAndInt64Masks) {
  for (const char* name : {"bool_tril_3x4.npy", "int64_tril_3x4.npy"}) {
    const Tensor loaded = read_npy(kFixtures + name);
    ASSERT_EQ(loaded.shape(), Shape({3, 4})) << name;
    Tensor as_float(DType::kFloat32, Shape({3, 4}));
    convert(loaded.view(), as_float.view());
    for (int row = 0; row < 3; ++row) {
      for (int column = 0; column < 4; ++column) {
        EXPECT_EQ(as_float.data_as<float>()[row * 4 + column], column <= row ? 1.0f : 0.0f)
            << name << " " << row << "," << column;
      }
    }
  }
  EXPECT_EQ(read_npy(kFixtures + "bool_tril_3x4.npy").dtype(), DType::kBool);
  EXPECT_EQ(read_npy(kFixtures + "int64_tril_3x4.npy").dtype(), DType::kInt64);
}

// ---------------------------------------------------------------------------------------
// Hand-made images: accepted variations

TEST(NpyParse, AcceptsAnyKeyOrderWhitespaceAndVersion2) {
  const std::string data = float_bytes({1, 2, 3, 4, 5, 6});
  for (const std::string& dict :
       {std::string("{'shape': (3, 2), 'fortran_order': False, 'descr': '<f4'}"),
        std::string("{ \"descr\" : \"<f4\" ,\n 'fortran_order':False,'shape':( 3 ,2 ) , }")}) {
    for (int major : {1, 2, 3}) {
      const std::string image = npy_image(dict, data, major);
      const Tensor t = parse_npy(image.data(), image.size(), "test.npy");
      EXPECT_EQ(t.shape(), Shape({3, 2})) << dict;
      EXPECT_EQ(t.data_as<float>()[5], 6.0f);
    }
  }
}

TEST(NpyParse, FortranOrderIsTransposedWhileReading) {
  // Logical (2, 3) = [[1, 2, 3], [4, 5, 6]] stored column by column.
  const std::string image = npy_image("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                                      float_bytes({1, 4, 2, 5, 3, 6}));
  const Tensor t = parse_npy(image.data(), image.size(), "test.npy");
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t.data_as<float>()[i], static_cast<float>(i + 1));
}

TEST(NpyParse, TrailingBytesAreIgnored) {
  const std::string image = npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
                                      float_bytes({7, 8}) + "garbage");
  const Tensor t = parse_npy(image.data(), image.size(), "test.npy");
  EXPECT_EQ(t.shape(), Shape({2}));
  EXPECT_EQ(t.data_as<float>()[1], 8.0f);
}

// ---------------------------------------------------------------------------------------
// Malformed images: each is an Error starting with the name and naming the problem

const std::string kGoodDict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
const std::string kFourFloats = float_bytes({1, 2, 3, 4});

TEST(NpyParse, RefusesBadMagic) {
  std::string image = npy_image(kGoodDict, kFourFloats);
  image[1] = 'M';
  EXPECT_PARSE_ERROR(image, "bad magic");
  EXPECT_PARSE_ERROR(std::string("\x93NU", 3), "bad magic");
  EXPECT_PARSE_ERROR(std::string(), "bad magic");
  EXPECT_PARSE_ERROR(std::string("\x93NUMPY\x01", 7), "too short");
}

TEST(NpyParse, RefusesUnknownVersion) {
  std::string image = npy_image(kGoodDict, kFourFloats);
  image[6] = 4;
  EXPECT_PARSE_ERROR(image, "version 4.0");
}

TEST(NpyParse, RefusesHeaderLengthThatLies) {
  std::string image = npy_image(kGoodDict, kFourFloats);
  image[8] = '\xff';
  image[9] = '\x7f';  // 32767 bytes of header in a file of ~80
  EXPECT_PARSE_ERROR(image, "runs past the end of the file");
  std::string short_by_one = npy_image(kGoodDict, kFourFloats);
  short_by_one[8] = static_cast<char>(short_by_one[8] - 1);  // header no longer ends in '\n'
  EXPECT_PARSE_ERROR(short_by_one, "does not end with a newline");
}

TEST(NpyParse, RefusesHeaderThatIsNotADict) {
  EXPECT_PARSE_ERROR(npy_image("['<f4', False, (2, 2)]", kFourFloats), "not a dict");
  EXPECT_PARSE_ERROR(npy_image("{'descr': '<f4', 'shape': (2, 2)}", kFourFloats),
                     "missing key 'fortran_order'");
  EXPECT_PARSE_ERROR(
      npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), 'x': 1}", kFourFloats),
      "unexpected key 'x'");
  EXPECT_PARSE_ERROR(
      npy_image("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 2)}",
                kFourFloats),
      "appears twice");
  EXPECT_PARSE_ERROR(
      npy_image("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2, 2)}", kFourFloats),
      "True or False");
  EXPECT_PARSE_ERROR(npy_image(kGoodDict + " extra", kFourFloats), "unexpected text");
  EXPECT_PARSE_ERROR(npy_image("{'descr': '<f4", kFourFloats), "unterminated string");
}

TEST(NpyParse, RefusesUnsupportedDtypes) {
  const auto with_descr = [](const std::string& descr) {
    return npy_image("{'descr': " + descr + ", 'fortran_order': False, 'shape': (2, 2), }",
                     std::string(64, '\0'));
  };
  EXPECT_PARSE_ERROR(with_descr("'float32'"), "not supported");
  EXPECT_PARSE_ERROR(with_descr("'<f3'"), "not supported");
  EXPECT_PARSE_ERROR(with_descr("'<x4'"), "not supported");
  EXPECT_PARSE_ERROR(with_descr("'f4'"), "not supported");
  EXPECT_PARSE_ERROR(with_descr("'<f16'"), "not supported");
  EXPECT_PARSE_ERROR(with_descr("'>f4'"), "big-endian");
  EXPECT_PARSE_ERROR(with_descr("'>i8'"), "big-endian");
  EXPECT_PARSE_ERROR(with_descr("'<c8'"), "complex");
  EXPECT_PARSE_ERROR(with_descr("'|O'"), "not supported");
  EXPECT_PARSE_ERROR(with_descr("'|O8'"), "object");
  EXPECT_PARSE_ERROR(with_descr("'|V8'"), "structured");
  EXPECT_PARSE_ERROR(with_descr("[('a', '<f4'), ('b', '<i4')]"), "structured");
  EXPECT_PARSE_ERROR(with_descr("'<U4'"), "string");
}

TEST(NpyParse, RefusesBadShapes) {
  const auto with_shape = [](const std::string& shape) {
    return npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }",
                     std::string(64, '\0'));
  };
  EXPECT_PARSE_ERROR(with_shape("(2, -1)"), "negative dimension");
  EXPECT_PARSE_ERROR(with_shape("(2, 1.5)"), "not a non-negative integer");
  EXPECT_PARSE_ERROR(with_shape("(2, x)"), "not a non-negative integer");
  EXPECT_PARSE_ERROR(with_shape("[2, 2]"), "must be a tuple");
  EXPECT_PARSE_ERROR(with_shape("(99999999999999999999,)"), "overflows a 64-bit integer");
  EXPECT_PARSE_ERROR(with_shape("(4294967296, 4294967296)"), "element count");
  EXPECT_PARSE_ERROR(with_shape("(4611686018427387904,)"), "byte size");
  EXPECT_PARSE_ERROR(with_shape("(1, 1, 1, 1, 1, 1, 1, 1, 1)"), "more than 8 dimensions");
  // Rank 8 itself is fine.
  EXPECT_EQ(parse_error(with_shape("(1, 1, 1, 1, 1, 1, 2, 2)")), "");
}

TEST(NpyParse, RefusesTruncatedDataBeforeAllocating) {
  const std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (32, 32), }";
  EXPECT_PARSE_ERROR(npy_image(header, std::string(100, '\0')),
                     "truncated data: expected 4096 bytes, found 100");
  // A petabyte claimed by a tiny file is refused by the size check, not by a failed allocation.
  EXPECT_PARSE_ERROR(
      npy_image("{'descr': '<f8', 'fortran_order': False, 'shape': (131072, 1048576), }", ""),
      "truncated data: expected 1099511627776 bytes, found 0");
}

// ---------------------------------------------------------------------------------------
// Header bytes in messages: escaped, cut when long, never raw on the terminal

TEST(NpyParse, MessagesShowHeaderBytesEscaped) {
  // A key holding \x05, an escape sequence that would turn a terminal red, a byte that is not
  // UTF-8 and a quote.
  const std::string key = std::string("de\x05") + "cr\x1b[31m\xff\"";
  const std::string message = parse_error(
      npy_image("{'" + key + "': '<f4', 'fortran_order': False, 'shape': (2, 2), }", kFourFloats));
  EXPECT_NE(message.find("unexpected key 'de\\x05cr\\x1b[31m\\xff\"'"), std::string::npos)
      << message;
  EXPECT_EQ(test::first_unprintable_byte(message), std::string::npos) << message;

  // A dtype that sets the terminal's title: "\x1b]0;...\x07".
  const std::string descr_message = parse_error(npy_image(
      "{'descr': '<f\x1b]0;title\x07', 'fortran_order': False, 'shape': (2, 2), }", kFourFloats));
  EXPECT_NE(descr_message.find("dtype '<f\\x1b]0;title\\x07' is not supported"), std::string::npos)
      << descr_message;
  EXPECT_EQ(test::first_unprintable_byte(descr_message), std::string::npos) << descr_message;

  // The name that starts the message is made printable too.
  const std::string image = npy_image(kGoodDict, "");
  try {
    (void)parse_npy(image.data(), image.size(), "Q\x1b[2J.npy");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("Q\\x1b[2J.npy: truncated data", 0), 0u) << e.what();
  }
}

TEST(NpyParse, LongKeysAreCutInMessages) {
  const std::string key(5000, 'k');
  const std::string message = parse_error(
      npy_image("{'" + key + "': '<f4', 'fortran_order': False, 'shape': (2, 2), }", kFourFloats));
  EXPECT_NE(message.find("unexpected key '" + std::string(64, 'k') + "...' (5000 bytes)"),
            std::string::npos)
      << message;
  EXPECT_LT(message.size(), 200u) << message;
}

// ---------------------------------------------------------------------------------------
// Files on disk

TEST_F(NpyFiles, ReadErrorsStartWithThePath) {
  const std::string missing = file("missing.npy");
  try {
    (void)read_npy(missing);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(missing + ": cannot open", 0), 0u) << e.what();
  }
  const std::string truncated = file("Q.npy");
  write_file_bytes(truncated,
                   npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (32, 32), }",
                             std::string(100, '\0')));
  try {
    (void)read_npy(truncated);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              truncated + ": truncated data: expected 4096 bytes, found 100");
  }
  EXPECT_THROW((void)read_npy(directory_.path().string()), Error);
  std::string lying = npy_image(kGoodDict, kFourFloats);
  lying[9] = '\x40';
  write_file_bytes(file("lying.npy"), lying);
  EXPECT_THROW((void)read_npy(file("lying.npy")), Error);
}

TEST_F(NpyFiles, FileReaderAgreesWithParser) {
  const std::string image = npy_image("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                                      float_bytes({1, 4, 2, 5, 3, 6}) + "tail", 2);
  write_file_bytes(file("f.npy"), image);
  const Tensor from_file = read_npy(file("f.npy"));
  const Tensor from_memory = parse_npy(image.data(), image.size(), "f.npy");
  ASSERT_EQ(from_file.shape(), from_memory.shape());
  EXPECT_EQ(std::memcmp(from_file.data(), from_memory.data(), from_file.nbytes()), 0);
}

TEST_F(NpyFiles, MissingDirectoryIsNamedAndNothingIsLeftBehind) {
  const std::string path = file("out/O.npy");
  float value = 1.0f;
  try {
    write_npy(path, TensorView(&value, Shape({1})));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              path + ": cannot create file: directory '" + file("out") + "' does not exist");
  }
  EXPECT_TRUE(listing().empty());
}

TEST_F(NpyFiles, FailedWriteLeavesTheOldFileUntouched) {
  const std::string path = file("O.npy");
  write_file_bytes(path, "old contents");
  uint16_t bfloat = 0x3F80;
  EXPECT_THROW(write_npy(path, TensorView(&bfloat, DType::kBFloat16, Shape({1}))), Error);
  EXPECT_EQ(read_file_bytes(path), "old contents");
  EXPECT_EQ(listing(), std::vector<std::string>{"O.npy"});  // no temporary file left
  // A directory as target is refused before anything is written.
  fs::create_directory(file("dir.npy"));
  float value = 1.0f;
  EXPECT_THROW(write_npy(file("dir.npy"), TensorView(&value, Shape({1}))), Error);
  EXPECT_EQ(listing().size(), 2u);
}

TEST_F(NpyFiles, StagedFilesAppearOnlyWhenCommitted) {
  float value = 3.0f;
  {
    StagedNpyFile staged(file("a.npy"), TensorView(&value, Shape({1})));
    EXPECT_FALSE(fs::exists(file("a.npy")));
    EXPECT_EQ(listing().size(), 1u);  // the temporary file
  }
  EXPECT_TRUE(listing().empty());
  {
    StagedNpyFile staged(file("b.npy"), TensorView(&value, Shape({1})));
    staged.commit();
  }
  EXPECT_EQ(listing(), std::vector<std::string>{"b.npy"});
  EXPECT_EQ(read_npy(file("b.npy")).data_as<float>()[0], 3.0f);
}

}  // namespace
}  // namespace attend
