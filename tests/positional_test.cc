// positional_test: sinusoidal encoding against its formula, the add helper, learned tables
// and token lookup.
#include "attend/positional.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "attend/error.hpp"

namespace attend {
namespace {

TEST(Sinusoidal, MatchesTheFormulaAndKnownValues) {
  for (int64_t dim : {8, 7, 64}) {
    const Tensor pe = sinusoidal_positional_encoding(50, dim, 3);
    ASSERT_EQ(pe.shape(), Shape({50, dim}));
    for (int64_t row = 0; row < 50; ++row) {
      const double pos = static_cast<double>(row + 3);
      for (int64_t column = 0; column < dim; ++column) {
        // 10000^(-2i/d) written as exp(-2i·ln(10000)/d), as in the annotated transformer.
        const double angle = pos * std::exp(-static_cast<double>(column - column % 2) *
                                            std::log(10000.0) / static_cast<double>(dim));
        const double expected = column % 2 == 0 ? std::sin(angle) : std::cos(angle);
        ASSERT_NEAR(pe.data_as<float>()[row * dim + column], expected, 1e-6)
            << "position " << pos << ", column " << column << ", dim " << dim;
      }
    }
  }
  const Tensor first = sinusoidal_positional_encoding(2, 4);
  EXPECT_EQ(first.data_as<float>()[0], 0.0f);  // sin(0)
  EXPECT_EQ(first.data_as<float>()[1], 1.0f);  // cos(0)
  EXPECT_FLOAT_EQ(first.data_as<float>()[4], std::sin(1.0f));
  EXPECT_FLOAT_EQ(first.data_as<float>()[7], std::cos(0.01f));  // 1 / 10000^(2/4)
  EXPECT_THROW(sinusoidal_positional_encoding(3, 0), Error);
}

TEST(Sinusoidal, AddBroadcastsOverTheBatchThroughStrides) {
  const Tensor pe = sinusoidal_positional_encoding(3, 4);
  // x stored (L, N, d) = (3, 2, 4), read as (N, L, d) through strides.
  Tensor storage = Tensor::zeros(DType::kFloat32, Shape({3, 2, 4}));
  for (int64_t i = 0; i < 24; ++i) storage.data_as<float>()[i] = static_cast<float>(i);
  const TensorView x(storage.data(), DType::kFloat32, Shape({2, 3, 4}), Shape({4, 8, 1}));
  add_positional_encoding(x, pe.view());
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t l = 0; l < 3; ++l)
      for (int64_t c = 0; c < 4; ++c) {
        const int64_t flat = (l * 2 + n) * 4 + c;
        EXPECT_EQ(storage.data_as<float>()[flat],
                  static_cast<float>(flat) + pe.data_as<float>()[l * 4 + c]);
      }
  const Tensor wrong = sinusoidal_positional_encoding(4, 4);
  EXPECT_THROW(add_positional_encoding(x, wrong.view()), Error);
}

TEST(PositionEmbedding, ReturnsSettableRowsAndRefusesOutOfRange) {
  PositionEmbedding table(64, 32, 1);
  // N(0, 0.02²) over 2048 draws: the sample deviation lands within 10%.
  double sum_squares = 0;
  for (int64_t i = 0; i < 64 * 32; ++i)
    sum_squares += std::pow(table.table().data_as<float>()[i], 2);
  EXPECT_NEAR(std::sqrt(sum_squares / (64 * 32)), 0.02, 0.002);
  table.table().data_as<float>()[5 * 32 + 7] = 42.0f;
  const Tensor rows = table.forward(3, 4);
  EXPECT_EQ(rows.shape(), Shape({3, 32}));
  EXPECT_EQ(rows.data_as<float>()[32 + 7], 42.0f);
  EXPECT_THROW(table.forward(10, 60), Error);
}

TEST(TokenEmbedding, LooksUpRowsForAnyIntegerDType) {
  TokenEmbedding embedding(10, 4, 3);
  for (int64_t i = 0; i < 40; ++i) embedding.table().data_as<float>()[i] = static_cast<float>(i);
  Tensor ids(DType::kInt32, Shape({2, 3}));
  const int32_t values[] = {0, 9, 4, 4, 1, 2};
  for (int i = 0; i < 6; ++i) ids.data_as<int32_t>()[i] = values[i];
  const Tensor out = embedding.forward(ids.view());
  ASSERT_EQ(out.shape(), Shape({2, 3, 4}));
  for (int i = 0; i < 6; ++i)
    for (int c = 0; c < 4; ++c)
      EXPECT_EQ(out.data_as<float>()[i * 4 + c], float(values[i] * 4 + c));

  Tensor bad(DType::kInt64, Shape({3}));
  bad.data_as<int64_t>()[0] = 1;
  bad.data_as<int64_t>()[1] = 10;
  bad.data_as<int64_t>()[2] = -1;
  try {
    embedding.forward(bad.view());
    FAIL() << "id 10 accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("id 10 at (1)"), std::string::npos) << error.what();
  }
  Tensor floats = Tensor::zeros(DType::kFloat32, Shape({2}));
  EXPECT_THROW(embedding.forward(floats.view()), Error);
}

}  // namespace
}  // namespace attend
