// runtime_test: the SIMD dispatch cap (attend/runtime.hpp) is attend's own: it moves attend's
// kernels and nothing else in the process, a bad name is refused naming the compiled targets,
// and ScopedSimdCap (test_support.hpp) puts back the cap it found.
#include "attend/runtime.hpp"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <string>
#include <vector>

#include "attend/error.hpp"
#include "test_support.hpp"

namespace attend::test {
namespace {

TEST(SimdCap, CapsAttendAndLeavesHighwayAlone) {
  const std::vector<std::string> supported = supported_simd_targets();
  ASSERT_FALSE(supported.empty());
  const int64_t highway_before = hwy::SupportedTargets();
  {
    ScopedSimdCap cap(supported.back());  // the lowest target
    EXPECT_EQ(active_simd_target(), supported.back());
    EXPECT_EQ(supported_simd_targets(), std::vector<std::string>{supported.back()});
    // Highway's own view, which every other user of Highway in the program dispatches on, is
    // unchanged: no hwy::DisableTargets behind the user's back.
    EXPECT_EQ(hwy::SupportedTargets(), highway_before);
  }
  EXPECT_EQ(supported_simd_targets(), supported);
  EXPECT_EQ(hwy::SupportedTargets(), highway_before);
}

TEST(SimdCap, ScopedCapsNestAndRestoreWhatTheyFound) {
  const std::vector<std::string> supported = supported_simd_targets();
  {
    ScopedSimdCap outer(supported.back());
    {
      ScopedSimdCap inner(supported.front());  // a higher cap than the outer one: no cap
      EXPECT_EQ(active_simd_target(), supported.front());
    }
    EXPECT_EQ(active_simd_target(), supported.back());
  }
  EXPECT_EQ(active_simd_target(), supported.front());
}

TEST(SimdCap, UnknownTargetIsRefusedNamingTheCompiledOnes) {
  const std::string before = active_simd_target();
  try {
    set_max_simd_target("AVX9");
    FAIL() << "no error for AVX9";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("'AVX9' is not compiled in"), std::string::npos) << message;
    for (const std::string& target : compiled_simd_targets()) {
      EXPECT_NE(message.find(target), std::string::npos) << message;
    }
  }
  EXPECT_EQ(active_simd_target(), before);  // a refused cap changes nothing
}

}  // namespace
}  // namespace attend::test
