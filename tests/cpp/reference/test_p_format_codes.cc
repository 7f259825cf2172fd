// The P format's code functions (numerics section 10): exp2_code against an independent reading of E4M3's
// rounding of the exponential, exp2_poly_code (keys 64-127 of a block) within one step of it, and the split of
// a block by exp2_format_code. The format on the reference attention: test_int8_attention.cc (PFormat.*).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "openvc/reference.h"

namespace openvc::reference {
namespace {

// The E4M3 code nearest to v >= 0 (or NaN) read from the code table: an independent reading of
// e4m3_encode's rounding (ties to the even code, saturation to 448, NaN 0x7F).
uint8_t nearest_e4m3(double v) {
  if (std::isnan(v)) return 0x7F;
  if (v >= 448.0) return 0x7E;
  uint8_t best = 0;
  double best_d = v;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(static_cast<double>(e4m3_decode(static_cast<uint8_t>(c))) - v);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = static_cast<uint8_t>(c), best_d = d;
  }
  return best;
}

// exp2_code on a grid of x = acc * a/8 + 8 - M/8 (a = 8, M = 64: x = acc) against the code table, and
// its special values: -inf and far-negative x give 0, huge and +inf x saturate to 0x7E, NaN gives 0x7F,
// x = 8 (a key at the row max) gives 0x78 = 256 like ExpCast's code 120.
TEST(PFormat, Exp2CodeOnAGrid) {
  int checked = 0;
  for (int k = -24 * 256; k <= 12 * 256; ++k) {
    const float x = static_cast<float>(k) / 256.0f;
    const uint8_t want = nearest_e4m3(std::exp2(static_cast<double>(x)));
    ASSERT_EQ(exp2_code(x, 8.0f, 64.0f), want) << "x " << x;
    ++checked;
  }
  EXPECT_GT(checked, 9000);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(exp2_code(0.0f, 8.0f, 0.0f), 0x78);      // x = 8: 256
  EXPECT_EQ(exp2_code(0.0f, 8.0f, 64.0f), 0x38);     // x = 0: 1
  EXPECT_EQ(exp2_code(-9.0f, 8.0f, 64.0f), 0x01);    // 2^-9, the least subnormal
  EXPECT_EQ(exp2_code(-10.0f, 8.0f, 64.0f), 0x00);   // 2^-10: the tie rounds to the even code 0
  EXPECT_EQ(exp2_code(1.0f, 8.0f, 0.0f), 0x7E);      // x = 9: 512 saturates to 448
  EXPECT_EQ(exp2_code(1e30f, 8.0f, 0.0f), 0x7E);     // huge
  EXPECT_EQ(exp2_code(inf, 8.0f, 0.0f), 0x7E);       // +inf
  EXPECT_EQ(exp2_code(-inf, 8.0f, 0.0f), 0x00);      // -inf
  EXPECT_EQ(exp2_code(-1e30f, 8.0f, 0.0f), 0x00);
  EXPECT_EQ(exp2_code(0.0f, 8.0f, inf), 0x00);       // row max +inf: x = -inf
  EXPECT_EQ(exp2_code(nan, 8.0f, 0.0f), 0x7F);       // NaN score
  EXPECT_EQ(exp2_code(1.0f, nan, 0.0f), 0x7F);       // NaN multiplier
  EXPECT_EQ(exp2_code(1.0f, 8.0f, nan), 0x7F);       // NaN max
  // Huge row max (|M| past 2^23 code units): a key at the max still lands at code 0x78 here (x = 8
  // when fl(acc * a) = M), and every code stays finite.
  for (float acc : {1e6f, 3e7f, -3e7f, 1.2345e7f}) {
    const float a = 8.0f, m = acc * a;
    EXPECT_EQ(exp2_code(acc, a, m), 0x78) << acc;
    const uint8_t c = exp2_code(std::nextafter(acc, inf), a, m);
    EXPECT_LE(c, 0x7E) << acc;
  }
  // Monotone in the score, at most 256 at or below the max.
  uint8_t prev = 0;
  for (int k = -2000; k <= 0; ++k) {
    const uint8_t c = exp2_code(static_cast<float>(k) * 0.01f, 1.0f, 0.0f);
    EXPECT_GE(c, prev);
    EXPECT_LE(c, 0x78);
    prev = c;
  }
}

// exp2_poly_code (keys 64-127 of a block in the exp2 format) on a grid of x = acc * a + 120 - M (a = 1, M = 120:
// x = acc) against the E4M3 rounding of 2^((x - 120) / 8) * 256: never more than one code away over the normal
// codes, equal for at least 95% of them (CPU study: 96.7%), monotone, 0x78 at the max and for x past it (the
// clip), 0 at and below x = 0, NaN 0xFF; and the split of a block by exp2_format_code.
TEST(PFormat, Exp2PolyCodeWithinOneStep) {
  int equal = 0, checked = 0;
  uint8_t prev = 0;
  for (int k = -16 * 64; k <= 130 * 64; ++k) {
    const float x = static_cast<float>(k) / 64.0f;
    const uint8_t got = exp2_poly_code(x, 1.0f, 120.0f);
    ASSERT_GE(got, prev) << "x " << x;
    ASSERT_LE(got, 0x78) << "x " << x;
    prev = got;
    if (x <= 0.0f) {
      ASSERT_EQ(got, 0) << "x " << x;
      continue;
    }
    if (x < 8.0f || x > 120.0f) continue;   // E4M3 subnormals (p below 2^-14 of the max), the clip
    const uint8_t want = nearest_e4m3(std::exp2((static_cast<double>(x) - 120.0) / 8.0) * 256.0);
    ASSERT_LE(std::abs(int(got) - int(want)), 1) << "x " << x;
    equal += got == want;
    ++checked;
  }
  EXPECT_GT(checked, 7000);
  EXPECT_GE(equal, checked * 95 / 100) << equal << " of " << checked;
  std::printf("  [poly code] %d of %d grid points equal the E4M3 rounding of the exponential\n", equal, checked);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(exp2_poly_code(0.0f, 1.0f, 0.0f), 0x78);     // x = 120: 256, as exp2_code and ExpCast
  EXPECT_EQ(exp2_poly_code(5.0f, 1.0f, 0.0f), 0x78);     // past the max (huge rows): clipped to 120
  EXPECT_EQ(exp2_poly_code(-8.0f, 1.0f, 0.0f), 0x70);    // one octave down: 128
  EXPECT_EQ(exp2_poly_code(-inf, 1.0f, 0.0f), 0x00);
  EXPECT_EQ(exp2_poly_code(-1e30f, 1.0f, 0.0f), 0x00);
  EXPECT_EQ(exp2_poly_code(0.0f, 1.0f, inf), 0x00);      // row max +inf: x = -inf
  EXPECT_EQ(exp2_poly_code(nan, 1.0f, 0.0f), 0xFF);      // NaN: an E4M3 NaN
  EXPECT_EQ(exp2_poly_code(1.0f, nan, 0.0f), 0xFF);
  EXPECT_EQ(exp2_poly_code(1.0f, 1.0f, nan), 0xFF);
  // x = 102 (acc -18 at a = 1, M = 0): 2^-2.25 * 256 = 53.8 rounds to 52 (0x65); the polynomial gives 56 (0x66).
  ASSERT_EQ(exp2_code(-18.0f, 1.0f, 0.0f), 0x65);
  ASSERT_EQ(exp2_poly_code(-18.0f, 1.0f, 0.0f), 0x66);
  for (int key : {0, 63, 128, 191}) EXPECT_EQ(exp2_format_code(-18.0f, 1.0f, 0.0f, key), 0x65) << key;
  for (int key : {64, 127, 192, 255}) EXPECT_EQ(exp2_format_code(-18.0f, 1.0f, 0.0f, key), 0x66) << key;
}

}  // namespace
}  // namespace openvc::reference
