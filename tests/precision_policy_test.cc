// precision_policy_test: which products bfloat16 work gets on each kind of CPU
// (boundary/operands.hpp: choose_bf16_products), as a table over CPU kinds that runs on any
// host, then this host's own choice seen in the kernels' names (skipped, with the reason,
// where the instructions are missing).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "boundary/operands.hpp"
#include "cpu_features.hpp"
#include "reduced_precision_support.hpp"
#include "test_support.hpp"

namespace attend::detail {
namespace {

using P = Bf16Products;
using S = ProductSite;

// The CPU kinds the policy names: AMD Zen 4 / Zen 5 (AVX512_BF16 that wins), Intel Sapphire
// Rapids and later (AMX), the same with AMX switched off or refused by the OS, Intel Cooper
// Lake (AVX512_BF16 at half the FMA's FLOP rate, no AMX), and a CPU without AVX512_BF16.
const Bf16Cpu kZen{"", false, true};
const Bf16Cpu kSapphireRapids{"", true, false};
const Bf16Cpu kSapphireRapidsNoAmx{"", false, false};
const Bf16Cpu kNoBf16{"this CPU has no AVX512_BF16", false, false};

struct Row {
  const char* cpu_name;
  Bf16Cpu cpu;
  S site;
  bool amx_fits;
  P automatic;  // bfloat16 inputs, ComputePrecision::kAuto
  P requested;  // ComputePrecision::kBFloat16 (any inputs)
};

TEST(PrecisionPolicy, EachCpuKindGetsItsProducts) {
  const Row table[] = {
      // AMD: AVX512_BF16 everywhere, for kAuto too.
      {"zen", kZen, S::kAttention, true, P::kAvx512Bf16, P::kAvx512Bf16},
      {"zen", kZen, S::kAttentionBackward, true, P::kAvx512Bf16, P::kAvx512Bf16},
      {"zen", kZen, S::kProjections, true, P::kAvx512Bf16, P::kAvx512Bf16},
      // Intel with AMX: tiles where the shape fits; elsewhere kAuto takes float32 products
      // (faster than vdpbf16ps there), kBFloat16 AVX512_BF16.
      {"spr", kSapphireRapids, S::kAttention, true, P::kAmxTiles, P::kAmxTiles},
      {"spr", kSapphireRapids, S::kAttention, false, P::kFloat32, P::kAvx512Bf16},
      {"spr", kSapphireRapids, S::kAttentionBackward, true, P::kAmxTiles, P::kAmxTiles},
      {"spr", kSapphireRapids, S::kProjections, true, P::kAmxTiles, P::kAmxTiles},
      // Intel without AMX (Cooper Lake; AMX switched off or refused by the OS).
      {"spr-no-amx", kSapphireRapidsNoAmx, S::kAttention, true, P::kFloat32, P::kAvx512Bf16},
      {"spr-no-amx", kSapphireRapidsNoAmx, S::kAttentionBackward, true, P::kFloat32,
       P::kAvx512Bf16},
      {"spr-no-amx", kSapphireRapidsNoAmx, S::kProjections, true, P::kFloat32, P::kAvx512Bf16},
  };
  for (const Row& row : table) {
    SCOPED_TRACE(std::string(row.cpu_name) + ", site " +
                 std::to_string(static_cast<int>(row.site)) +
                 (row.amx_fits ? "" : ", past FitsAmxTiles"));
    EXPECT_EQ(choose_bf16_products(row.cpu, DType::kBFloat16, ComputePrecision::kAuto, row.site,
                                   row.amx_fits),
              row.automatic);
    for (DType input : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
      EXPECT_EQ(
          choose_bf16_products(row.cpu, input, ComputePrecision::kBFloat16, row.site, row.amx_fits),
          row.requested);
      EXPECT_EQ(
          choose_bf16_products(row.cpu, input, ComputePrecision::kFloat32, row.site, row.amx_fits),
          P::kFloat32);
    }
    // Other inputs with the default precision: float32 products.
    EXPECT_EQ(choose_bf16_products(row.cpu, DType::kFloat32, ComputePrecision::kAuto, row.site,
                                   row.amx_fits),
              P::kFloat32);
    EXPECT_EQ(choose_bf16_products(row.cpu, DType::kFloat16, ComputePrecision::kAuto, row.site,
                                   row.amx_fits),
              P::kFloat32);
  }
}

TEST(PrecisionPolicy, WithoutAvx512Bf16DefaultIsFloat32AndRequestIsRefused) {
  for (S site : {S::kAttention, S::kAttentionBackward, S::kProjections}) {
    EXPECT_EQ(choose_bf16_products(kNoBf16, DType::kBFloat16, ComputePrecision::kAuto, site),
              P::kFloat32);
    test::expect_error(
        [&] { choose_bf16_products(kNoBf16, DType::kBFloat16, ComputePrecision::kBFloat16, site); },
        "this CPU has no AVX512_BF16");
  }
  // An AMX flag without AVX512_BF16 (a SIMD cap below AVX-512) never runs the tiles.
  const Bf16Cpu capped{"attend's SIMD target is capped below AVX-512", true, false};
  EXPECT_EQ(choose_bf16_products(capped, DType::kBFloat16, ComputePrecision::kAuto, S::kAttention),
            P::kFloat32);
}

// This host: bfloat16 inputs with the default precision in the forward's query tiles take the
// path the policy gives this CPU; the kernel's name says which.
TEST(PrecisionPolicy, ThisHostsForwardTakesThePolicysPath) {
  const Tensor q = test::random_tensor({1, 2, 64, 64}, 1, 1.0, DType::kBFloat16);
  const std::string kernel = attention_kernel(q.view(), q.view(), q.view());
  const P path = bf16_products(DType::kBFloat16, ComputePrecision::kAuto, S::kAttention);
  std::printf("this CPU (%s): bfloat16 inputs get %s\n",
              cpu_vendor() == CpuVendor::kIntel ? "Intel"
              : cpu_vendor() == CpuVendor::kAmd ? "AMD"
                                                : "other",
              bf16_compute_path().c_str());
  switch (path) {
    case P::kAmxTiles:
      EXPECT_EQ(kernel, "fused tiles (bfloat16 products, AMX tiles)");
      break;
    case P::kAvx512Bf16:
      EXPECT_EQ(kernel, "fused tiles (bfloat16 products)");
      break;
    case P::kFloat32:
      EXPECT_EQ(kernel, "fused tiles (bfloat16 K/V)");
      break;
  }
  if (!native_bf16_products()) {
    EXPECT_EQ(path, P::kFloat32);
    GTEST_SKIP() << "skipped the AMX and AVX512_BF16 cases: " << why_no_bf16_products();
  }
  // With AMX switched off, this CPU's kind decides: AVX512_BF16 on AMD, float32 elsewhere.
  const bool previous = amx_enabled();
  set_amx_enabled(false);
  const std::string without_amx = attention_kernel(q.view(), q.view(), q.view());
  set_amx_enabled(previous);
  EXPECT_EQ(without_amx, cpu_vendor() == CpuVendor::kAmd ? "fused tiles (bfloat16 products)"
                                                         : "fused tiles (bfloat16 K/V)");
  if (!amx_bf16_products()) GTEST_SKIP() << "skipped the AMX case: " << why_no_amx_bf16();
  EXPECT_EQ(path, P::kAmxTiles);
}

}  // namespace
}  // namespace attend::detail
