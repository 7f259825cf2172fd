// ExpCast codes (numerics section 3): hand-checked bytes, rounding, clipping and the statistics of the
// approximation against the correctly rounded E4M3 of 256 * exp(u).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include "openvc/reference.h"

namespace openvc::reference {
namespace {

// With a = 8*log2e, acc = u and row_max = 0 the code-domain offset is 8*log2e*u for u = s - max in nats.
uint8_t code_of_nats(float u) { return expcast_code(u, 8.0f * kLog2e, 0.0f); }

TEST(ExpCast, HandCheckedBytes) {
  // u = 0: x = 119.65 -> 120 = 0x78 = 256.0.
  EXPECT_EQ(code_of_nats(0.0f), 120);
  EXPECT_EQ(e4m3_decode(120), 256.0f);
  // u = -1: 119.65 - 11.5416 = 108.11 -> 108 = exp 13, mantissa 4 -> 2^6 * 1.5 = 96.
  EXPECT_EQ(code_of_nats(-1.0f), 108);
  EXPECT_EQ(e4m3_decode(108), 96.0f);
  // u = -0.17: 119.65 - 1.962 = 117.69 -> 118 = exp 14, mantissa 6 -> 2^7 * 1.75 = 224.
  EXPECT_EQ(code_of_nats(-0.17f), 118);
  EXPECT_EQ(e4m3_decode(118), 224.0f);
  // u = -10.4: 119.65 - 120.03 = -0.38 < 0 -> 0.
  EXPECT_EQ(code_of_nats(-10.4f), 0);
}

TEST(ExpCast, MultiplierIsLeftToRightFp32) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> d(0.001f, 2.0f);
  for (int n = 0; n < 10000; ++n) {
    const float tau = d(rng), dq = d(rng) / 448.0f, dk = d(rng) / 448.0f;
    volatile float a = 8.0f * kLog2e;  // volatile: force each FP32 rounding in order
    a = a * tau;
    a = a * dq;
    a = a * dk;
    ASSERT_EQ(expcast_multiplier(tau, dq, dk), a);
  }
}

TEST(ExpCast, RoundsHalfToEvenAndClips) {
  // row_max chosen so the bias is exactly 0: x = acc with a = 1.
  const float row_max = kCodeBias;
  ASSERT_EQ(kCodeBias - row_max, 0.0f);
  EXPECT_EQ(expcast_code(0.49f, 1.0f, row_max), 0);
  EXPECT_EQ(expcast_code(0.5f, 1.0f, row_max), 0);   // 0.5 -> 0 (even)
  EXPECT_EQ(expcast_code(1.5f, 1.0f, row_max), 2);   // 1.5 -> 2
  EXPECT_EQ(expcast_code(2.5f, 1.0f, row_max), 2);   // 2.5 -> 2
  EXPECT_EQ(expcast_code(5.5f, 1.0f, row_max), 6);
  EXPECT_EQ(expcast_code(6.5f, 1.0f, row_max), 6);
  EXPECT_EQ(expcast_code(6.51f, 1.0f, row_max), 7);
  EXPECT_EQ(expcast_code(-0.25f, 1.0f, row_max), 0);  // below 0 clips at 0
  EXPECT_EQ(expcast_code(-500.0f, 1.0f, row_max), 0);
  EXPECT_EQ(expcast_code(119.5f, 1.0f, row_max), 120);  // 119.5 -> 120
  EXPECT_EQ(expcast_code(120.5f, 1.0f, row_max), 120);  // clips at 120 (stale max)
  EXPECT_EQ(expcast_code(5000.0f, 1.0f, row_max), 120);
  EXPECT_EQ(expcast_code(1e30f, 1e30f, row_max), 120);  // +inf clips at 120
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(expcast_code(nan, 1.0f, 0.0f), 0);
  EXPECT_EQ(expcast_code(-inf, 1.0f, 0.0f), 0);
  EXPECT_EQ(expcast_code(1.0f, 1.0f, inf), 0);   // masked-like: -inf bias
  EXPECT_EQ(expcast_code(inf, 0.0f, 0.0f), 0);   // inf * 0 = NaN
}

TEST(ExpCast, RowMaximumGetsTopCode) {
  // The key that defines the max (row_max = fl(acc * a)) must land on code 120 (256.0).
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> acc(-3e4f, 3e4f), a(1e-4f, 0.2f);
  for (int n = 0; n < 100000; ++n) {
    const float x = acc(rng), y = a(rng);
    ASSERT_EQ(expcast_code(x, y, x * y), 120) << x << " * " << y;
  }
}

TEST(ExpCast, AgreementWithCorrectRoundingOverRange) {
  // Dense sweep of u = s - max in nats over [-9.7, 0]; the reference byte is the correctly rounded
  // E4M3 of 256 * exp(u).
  const int n = 1000000;
  int agree = 0;
  double rel_min = 1, rel_max = -1;
  for (int k = 0; k <= n; ++k) {
    const float u = static_cast<float>(-9.7 * k / n);
    const double target = 256.0 * std::exp(static_cast<double>(u));
    const uint8_t c = code_of_nats(u);
    agree += c == e4m3_encode(static_cast<float>(target));
    const double rel = e4m3_decode(c) / target - 1.0;
    rel_min = std::min(rel_min, rel);
    rel_max = std::max(rel_max, rel);
  }
  const double frac = static_cast<double>(agree) / (n + 1);
  std::printf("[ ExpCast ] agreement with RNE E4M3 of 256*exp(u), u in [-9.7, 0]: %.2f%%; "
              "relative error in [%.4f%%, %.4f%%]\n", 100 * frac, 100 * rel_min, 100 * rel_max);
  EXPECT_GE(frac, 0.78);
  EXPECT_LE(frac, 0.81);
  EXPECT_GE(rel_min, -0.073);
  EXPECT_LE(rel_max, 0.077);
  EXPECT_LE(rel_min, -0.06);  // the extremes are really reached: the sweep exercises the worst case
  EXPECT_GE(rel_max, 0.065);
}

TEST(ExpCast, CodesAreMonotoneInScore) {
  int prev = 0;
  for (int k = 0; k <= 200000; ++k) {
    const float u = static_cast<float>(-12.0 + 12.0 * k / 200000);
    const int c = code_of_nats(u);
    ASSERT_GE(c, prev) << "u = " << u;
    prev = c;
  }
  EXPECT_EQ(prev, 120);
}

}  // namespace
}  // namespace openvc::reference
