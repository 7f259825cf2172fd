// E4M3 (FN) encode/decode and BF16 rounding against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "openvc/reference.h"

namespace openvc::reference {
namespace {

// E4M3 FN by definition: exp field e (4 bits, bias 7), mantissa m (3 bits); e == 0 is subnormal.
double definition_value(int code) {
  const int e = (code >> 3) & 0xF, m = code & 7;
  const double mag = e == 0 ? m * std::pow(2.0, -9) : std::pow(2.0, e - 7) * (1.0 + m / 8.0);
  return (code & 0x80) ? -mag : mag;
}

// Nearest E4M3 value by brute force over all finite codes, ties to the even code, saturating.
uint8_t brute_force_encode(float x) {
  if (std::isnan(x)) return 0x7F;
  const double ax = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double err = std::fabs(definition_value(c) - ax);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  if (ax >= 448.0) best = 0x7E;
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

TEST(E4M3, DecodeMatchesDefinition) {
  for (int c = 0; c <= 0x7E; ++c) {
    EXPECT_EQ(static_cast<double>(e4m3_decode(static_cast<uint8_t>(c))), definition_value(c)) << "code " << c;
    EXPECT_EQ(e4m3_decode(static_cast<uint8_t>(c | 0x80)), -e4m3_decode(static_cast<uint8_t>(c))) << c;
    if (c > 0) {
      EXPECT_GT(e4m3_decode(static_cast<uint8_t>(c)), e4m3_decode(static_cast<uint8_t>(c - 1)));
    }
  }
  // Landmarks: subnormals, smallest normal, 1, the ExpCast top code, largest finite.
  EXPECT_EQ(e4m3_decode(0x00), 0.0f);
  EXPECT_EQ(e4m3_decode(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_decode(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(e4m3_decode(0x08), 0x1p-6f);
  EXPECT_EQ(e4m3_decode(0x38), 1.0f);
  EXPECT_EQ(e4m3_decode(0x78), 256.0f);
  EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(e4m3_decode(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_decode(0xFF)));
}

TEST(E4M3, EncodeRoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(e4m3_encode(e4m3_decode(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(E4M3, MidpointsRoundToEven) {
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = e4m3_decode(static_cast<uint8_t>(c)), hi = e4m3_decode(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (lo + hi);  // exact: both have <= 4 significant bits
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(e4m3_encode(mid), even) << "between " << c << " and " << c + 1;
    EXPECT_EQ(e4m3_encode(-mid), even | 0x80);
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, 1e9f)), c + 1);
  }
  EXPECT_EQ(e4m3_encode(0x1p-10f), 0x00);        // half of the smallest subnormal: ties to 0
  EXPECT_EQ(e4m3_encode(3 * 0x1p-10f), 0x02);    // 1.5 * 2^-9 -> 2 * 2^-9
  EXPECT_EQ(e4m3_encode(15 * 0x1p-10f), 0x08);   // 7.5 * 2^-9 -> 2^-6 (subnormal carries into normal)
  EXPECT_EQ(e4m3_encode(1e-30f), 0x00);
  EXPECT_EQ(e4m3_encode(-1e-30f), 0x80);          // sign kept, like the hardware conversion
}

TEST(E4M3, SaturationAndNaN) {
  for (float x : {448.0f, 449.0f, 463.99f, 464.0f, 480.0f, 1e4f, 3e38f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(e4m3_encode(x), 0x7E) << x;
    EXPECT_EQ(e4m3_encode(-x), 0xFE) << x;
  }
  EXPECT_EQ(e4m3_encode(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(e4m3_encode(-std::numeric_limits<float>::quiet_NaN()), 0x7F);
}

TEST(E4M3, EncodeMatchesBruteForceNearest) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> log2mag(-14.0f, 9.5f);
  std::uniform_int_distribution<int> sign(0, 1);
  for (int n = 0; n < 300000; ++n) {
    const float x = (sign(rng) ? -1.0f : 1.0f) * std::exp2(log2mag(rng));
    ASSERT_EQ(e4m3_encode(x), brute_force_encode(x)) << "x = " << x;
  }
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(round_to_bf16(1.0f), 1.0f);
  EXPECT_EQ(round_to_bf16(1.0f + 0x1p-8f), 1.0f);                   // tie -> even (1.0)
  EXPECT_EQ(round_to_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);     // tie -> even (1 + 2/128)
  EXPECT_EQ(round_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 1.0f + 0x1p-7f);
  EXPECT_EQ(round_to_bf16(-1.0f - 0x1p-8f - 0x1p-20f), -1.0f - 0x1p-7f);
  EXPECT_EQ(round_to_bf16(3.4e38f), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::signaling_NaN())));
  EXPECT_EQ(round_to_bf16(0x1p-130f), 0x1p-130f);  // a bf16 subnormal is kept
}

}  // namespace
}  // namespace openvc::reference
