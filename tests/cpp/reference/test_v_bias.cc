// The reference's V rounding bias (numerics section 4, "V rounding bias"): the fixed-point residual of one element,
// the sums quantize_heads keeps, and attention with the correction: uniform attention gives V's mean, which the
// uncorrected output misses; NaN residuals count 0; the options it does not combine with are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "openvc/reference.h"

namespace {

namespace ref = openvc::reference;

TEST(ReferenceVBias, ResidualFixedPoint) {
  // 1.03 codes as 1.0 (E4M3 steps of 0.125 in [1, 2)): residual 0.03 = 1966.08 units of 2^-16.
  EXPECT_EQ(ref::v_residual_fixed(1.03f, ref::e4m3_encode(1.03f)), 1966);
  EXPECT_EQ(ref::v_residual_fixed(-1.03f, ref::e4m3_encode(-1.03f)), -1966);
  EXPECT_EQ(ref::v_residual_fixed(2.0f, ref::e4m3_encode(2.0f)), 0);
  // Half a unit: ties to even (2^-17 = 0.5 units -> 0; 3 * 2^-17 = 1.5 units -> 2).
  EXPECT_EQ(ref::v_residual_fixed(1.0f + std::ldexp(1.0f, -17), 0x38), 0);
  EXPECT_EQ(ref::v_residual_fixed(1.0f + 3.0f * std::ldexp(1.0f, -17), 0x38), 2);
  // Top of the range: 440 codes as 448 or 416 (step 32), residual within 16.
  EXPECT_EQ(std::llabs(ref::v_residual_fixed(432.0f, ref::e4m3_encode(432.0f))), 16 * 65536);
  EXPECT_EQ(ref::v_residual_fixed(NAN, ref::e4m3_encode(NAN)), 0);
}

TEST(ReferenceVBias, UniformAttentionGivesTheMeanOfV) {
  const int sq = 64, sk = 700, H = 2, D = 16;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> noise(-0.01f, 0.01f);
  std::vector<float> q(size_t(sq) * H * D, 0.0f), k(size_t(sk) * H * D), v(size_t(sk) * H * D);
  for (auto& x : k) x = noise(rng) * 100.0f;
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + 0.0123f * float(i % D) + noise(rng);
  const ref::Sequences qs = ref::Sequences::Batched(1, sq, H, D), ks = ref::Sequences::Batched(1, sk, H, D);
  ref::PreparedInputs in;
  ASSERT_TRUE(ref::prepare_inputs(q.data(), k.data(), v.data(), qs, ks, &in).ok());
  ASSERT_EQ(in.v.residual_sums.size(), size_t(H) * D);
  ref::AttentionOptions opt;
  ref::AttentionResult plain, fixed;
  ASSERT_TRUE(ref::attention_expcast(in, opt, &plain).ok());
  opt.v_bias_correction = true;
  ASSERT_TRUE(ref::attention_expcast(in, opt, &fixed).ok());
  double err_plain = 0.0, err_fixed = 0.0;
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < D; ++c) {
      double mean = 0.0;
      for (int j = 0; j < sk; ++j) mean += v[(size_t(j) * H + h) * D + c];
      mean /= sk;
      for (int i = 0; i < sq; ++i) {
        const size_t o = (size_t(i) * H + h) * D + c;
        ASSERT_NEAR(fixed.out[o], mean, 1e-5 * std::fabs(mean));   // exact up to FP32 and 2^-17 roundings
        err_plain = std::max(err_plain, std::fabs(plain.out[o] - mean) / std::fabs(mean));
        err_fixed = std::max(err_fixed, std::fabs(fixed.out[o] - mean) / std::fabs(mean));
      }
    }
  EXPECT_GT(err_plain, 1e-3);   // the uncorrected mean is off by V's mean rounding error
  EXPECT_LT(err_fixed, 1e-5);
}

TEST(ReferenceVBias, NotWithRepairRowsOrBlockDescales) {
  const int S = 128, H = 1, D = 16;
  std::vector<float> x(size_t(S) * H * D, 0.5f);
  const ref::Sequences s = ref::Sequences::Batched(1, S, H, D);
  ref::PreparedInputs in;
  ASSERT_TRUE(ref::prepare_inputs(x.data(), x.data(), x.data(), s, s, &in).ok());
  ref::AttentionOptions opt;
  opt.v_bias_correction = true;
  std::vector<float> dvb(1, 1.0f);
  opt.v_block_descale = dvb.data();
  ref::AttentionResult res;
  const openvc::Status st = ref::attention_expcast(in, opt, &res);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("v_bias_correction"), std::string::npos) << st.message();
  opt.v_block_descale = nullptr;
  in.v.bias.clear();
  EXPECT_FALSE(ref::attention_expcast(in, opt, &res).ok());
}

}  // namespace
