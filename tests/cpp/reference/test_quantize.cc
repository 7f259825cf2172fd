// Quantization (numerics section 1): block groups for Q/K, head groups for V, edge cases, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "openvc/reference.h"
#include "test_inputs.h"

namespace openvc::reference {
namespace {

std::vector<float> random_tokens(const Sequences& s, uint32_t seed, float scale, bool bf16) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(s.total_tokens()) * s.num_heads * s.head_dim);
  for (float& v : x) v = bf16 ? round_to_bf16(g(rng)) : testing::round_to_fp16(g(rng));
  return x;
}

// Checks one group against the contract: amax over exactly these tokens, single FP32 divisions,
// code = RNE E4M3 of x * scale_inv, and the reconstruction within E4M3's half-ulp.
void expect_group(const float* x, const uint8_t* codes, const Sequences& s, int h, int t0, int t1, float descale) {
  const int H = s.num_heads, D = s.head_dim;
  float amax = 0;
  for (int t = t0; t < t1; ++t)
    for (int c = 0; c < D; ++c) amax = std::max(amax, std::fabs(x[(static_cast<size_t>(t) * H + h) * D + c]));
  ASSERT_EQ(descale, amax / 448.0f) << "tokens [" << t0 << ", " << t1 << ") head " << h;
  const float scale_inv = amax > 0 ? 448.0f / amax : 0.0f;
  for (int t = t0; t < t1; ++t) {
    for (int c = 0; c < D; ++c) {
      const size_t i = (static_cast<size_t>(t) * H + h) * D + c;
      ASSERT_EQ(codes[i], e4m3_encode(x[i] * scale_inv)) << "token " << t << " channel " << c;
      const float recon = descale * e4m3_decode(codes[i]);
      const float bound = std::max(std::fabs(x[i]) * 0x1p-4f, descale * 0x1p-10f) * 1.0001f;
      ASSERT_LE(std::fabs(recon - x[i]), bound) << "token " << t << " channel " << c;
    }
  }
}

TEST(Quantize, AllZeroGroup) {
  const Sequences s = Sequences::Batched(1, 200, 2, 16);
  std::vector<float> x = random_tokens(s, 1, 1.0f, true);
  for (int t = 0; t < 128; ++t)
    for (int c = 0; c < 16; ++c) x[(t * 2 + 1) * 16 + c] = 0.0f;  // head 1, block 0
  BlockQuantized q;
  ASSERT_TRUE(quantize_blocks(x.data(), s, &q).ok());
  EXPECT_EQ(q.descale[1 * 2 + 0], 0.0f);
  EXPECT_GT(q.descale[1 * 2 + 1], 0.0f);
  for (int t = 0; t < 128; ++t)
    for (int c = 0; c < 16; ++c) EXPECT_EQ(q.codes[(t * 2 + 1) * 16 + c], 0);
  std::vector<float> zeros(200 * 2 * 16, 0.0f);
  HeadQuantized v;
  ASSERT_TRUE(quantize_heads(zeros.data(), s, &v).ok());
  EXPECT_EQ(v.descale, (std::vector<float>{0.0f, 0.0f}));
  EXPECT_EQ(v.scale_inv, (std::vector<float>{0.0f, 0.0f}));
  for (uint8_t c : v.codes) EXPECT_EQ(c, 0);
}

// Numerics section 1: where 448 / amax is not finite the group is zeros (scale_inv 0, descale 0), so
// no code is NaN; a group just above the threshold keeps a finite scale and real codes.
TEST(Quantize, TinyGroupsAreZeros) {
  const Sequences s = Sequences::Batched(1, 256, 1, 16);
  std::vector<float> x(256 * 16, 0.0f);
  for (int t = 0; t < 128; ++t)
    for (int c = 0; c < 16; ++c) x[t * 16 + c] = (c % 2 ? 1e-37f : -9.2e-41f);   // block 0: tiny
  for (int t = 128; t < 256; ++t)
    for (int c = 0; c < 16; ++c) x[t * 16 + c] = 2e-36f * float(1 + c % 3);       // block 1: small, finite
  BlockQuantized q;
  ASSERT_TRUE(quantize_blocks(x.data(), s, &q).ok());
  EXPECT_EQ(q.descale[0], 0.0f);
  for (int t = 0; t < 128; ++t)
    for (int c = 0; c < 16; ++c) EXPECT_EQ(q.codes[t * 16 + c] & 0x7F, 0) << "token " << t;
  EXPECT_GT(q.descale[1], 0.0f);
  EXPECT_TRUE(std::isfinite(448.0f / (q.descale[1] * 448.0f)));
  for (int t = 128; t < 256; ++t)
    for (int c = 0; c < 16; ++c) EXPECT_NE(q.codes[t * 16 + c] & 0x7F, 0x7F) << "token " << t;
  HeadQuantized v;
  ASSERT_TRUE(quantize_heads(x.data(), Sequences::Batched(1, 128, 1, 16), &v).ok());  // the tiny block alone
  EXPECT_EQ(v.descale[0], 0.0f);
  EXPECT_EQ(v.scale_inv[0], 0.0f);
  for (int i = 0; i < 128 * 16; ++i) EXPECT_EQ(v.codes[i] & 0x7F, 0);
}

TEST(Quantize, OneHugeValue) {
  const Sequences s = Sequences::Batched(1, 128, 1, 32);
  std::vector<float> x(128 * 32, 1.0f);
  x[77 * 32 + 5] = -12288.0f;
  BlockQuantized q;
  ASSERT_TRUE(quantize_blocks(x.data(), s, &q).ok());
  EXPECT_EQ(q.descale[0], 12288.0f / 448.0f);
  EXPECT_EQ(q.codes[77 * 32 + 5], 0xFE);  // -448
  const uint8_t small = e4m3_encode(1.0f * (448.0f / 12288.0f));  // 0.03646 -> 0.03515625 = 2^-5 * 1.125
  EXPECT_EQ(e4m3_decode(small), 0.03515625f);
  EXPECT_EQ(q.codes[0], small);
  EXPECT_EQ(q.codes[127 * 32 + 31], small);
  expect_group(x.data(), q.codes.data(), s, 0, 0, 128, q.descale[0]);
}

TEST(Quantize, PartialFinalBlockAndBf16Fp16Inputs) {
  for (bool bf16 : {true, false}) {
    const Sequences s = Sequences::Batched(1, 300, 3, 64);
    std::vector<float> x = random_tokens(s, 2, 0.7f, bf16);
    x[(250 * 3 + 0) * 64 + 3] = 40.0f;  // in block 1 only: must not leak into block 2
    BlockQuantized q;
    ASSERT_TRUE(quantize_blocks(x.data(), s, &q).ok());
    ASSERT_EQ(q.max_blocks, 3);
    ASSERT_EQ(q.descale.size(), 9u);
    ASSERT_EQ(q.codes.size(), x.size());
    EXPECT_EQ(q.descale[0 * 3 + 1], 40.0f / 448.0f);
    EXPECT_LT(q.descale[0 * 3 + 2], 10.0f / 448.0f);
    for (int h = 0; h < 3; ++h)
      for (int b = 0; b < 3; ++b)
        expect_group(x.data(), q.codes.data(), s, h, b * 128, std::min(300, b * 128 + 128), q.descale[h * 3 + b]);
    HeadQuantized v;
    ASSERT_TRUE(quantize_heads(x.data(), s, &v).ok());
    EXPECT_EQ(v.descale[0], 40.0f / 448.0f);
    EXPECT_EQ(v.scale_inv[0], 448.0f / 40.0f);
    for (int h = 0; h < 3; ++h) expect_group(x.data(), v.codes.data(), s, h, 0, 300, v.descale[h]);
  }
}

TEST(Quantize, GroupsDoNotSpanSequences) {
  // Three packed sequences of different lengths and magnitudes.
  Sequences s;
  s.cu_seqlens = {0, 130, 200, 456};
  s.num_heads = 2;
  s.head_dim = 8;
  std::vector<float> x = random_tokens(s, 3, 1.0f, true);
  for (int t = 130; t < 200; ++t)
    for (int c = 0; c < 16; ++c) x[t * 16 + c] = round_to_bf16(x[t * 16 + c] * 100.0f);  // sequence 1 is large
  BlockQuantized q;
  ASSERT_TRUE(quantize_blocks(x.data(), s, &q).ok());
  ASSERT_EQ(q.max_blocks, 2);  // ceil(256 / 128)
  for (int h = 0; h < 2; ++h) {
    // Sequence 0: block 0 = tokens [0, 128), block 1 = the 2 tokens [128, 130).
    expect_group(x.data(), q.codes.data(), s, h, 0, 128, q.descale[(0 * 2 + h) * 2 + 0]);
    expect_group(x.data(), q.codes.data(), s, h, 128, 130, q.descale[(0 * 2 + h) * 2 + 1]);
    // Sequence 1: one 70-token block; its second block does not exist and has descale 0.
    expect_group(x.data(), q.codes.data(), s, h, 130, 200, q.descale[(1 * 2 + h) * 2 + 0]);
    EXPECT_EQ(q.descale[(1 * 2 + h) * 2 + 1], 0.0f);
    EXPECT_GT(q.descale[(1 * 2 + h) * 2 + 0], 30 * q.descale[(0 * 2 + h) * 2 + 0]);
    expect_group(x.data(), q.codes.data(), s, h, 200, 328, q.descale[(2 * 2 + h) * 2 + 0]);
    expect_group(x.data(), q.codes.data(), s, h, 328, 456, q.descale[(2 * 2 + h) * 2 + 1]);
    // V: one group per (sequence, head).
    HeadQuantized v;
    ASSERT_TRUE(quantize_heads(x.data(), s, &v).ok());
    for (int b = 0; b < 3; ++b) {
      const int t0 = s.cu_seqlens[b], t1 = s.cu_seqlens[b + 1];
      expect_group(x.data(), v.codes.data(), s, h, t0, t1, v.descale[b * 2 + h]);
    }
  }
}

TEST(Quantize, Fp16RoundingHelperIsExact) {
  // The FP16 inputs above must really be FP16 values: check the helper on known cases.
  EXPECT_EQ(testing::round_to_fp16(1.0f + 0x1p-11f), 1.0f);                 // tie -> even
  EXPECT_EQ(testing::round_to_fp16(1.0f + 3 * 0x1p-11f), 1.0f + 0x1p-9f);   // tie -> even
  EXPECT_EQ(testing::round_to_fp16(0x1p-25f), 0.0f);                        // half the smallest subnormal
  EXPECT_EQ(testing::round_to_fp16(3 * 0x1p-25f), 0x1p-23f);                // 1.5 subnormal ulps -> 2
  EXPECT_EQ(testing::round_to_fp16(-1000.3f), -1000.5f);                    // ulp 0.5 in [512, 1024)
}

TEST(Quantize, BadArgumentsNameTheArgument) {
  Sequences s = Sequences::Batched(1, 10, 2, 0);
  std::vector<float> x(10 * 2 * 4, 1.0f);
  BlockQuantized q;
  Status st = quantize_blocks(x.data(), s, &q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("head_dim must be > 0, got 0"), std::string::npos) << st.message();
  s.head_dim = 4;
  s.num_heads = -1;
  st = quantize_blocks(x.data(), s, &q);
  EXPECT_NE(st.message().find("num_heads"), std::string::npos) << st.message();
  s.num_heads = 2;
  s.cu_seqlens = {0, 8, 4};
  st = quantize_heads(x.data(), s, nullptr);
  EXPECT_NE(st.message().find("cu_seqlens"), std::string::npos) << st.message();
  s.cu_seqlens = {1, 10};
  EXPECT_NE(quantize_blocks(x.data(), s, &q).message().find("cu_seqlens[0]"), std::string::npos);
  s.cu_seqlens = {0, 10};
  EXPECT_NE(quantize_blocks(nullptr, s, &q).message().find("x must not be null"), std::string::npos);
  EXPECT_NE(quantize_blocks(x.data(), s, nullptr).message().find("out must not be null"), std::string::npos);
  EXPECT_TRUE(quantize_blocks(x.data(), s, &q).ok());
}

// ---- K smoothing and key counts for E4M3 K (quantize_key_blocks) ----------------------------------

// E4M3 K read directly: the spec's blocked means, k' = fl(k - mean), per-block amax over the valid keys,
// codes e4m3(k' * scale_inv), zeros for padding.
void expect_key_blocks(const float* x, const Sequences& s, bool smoothing, const int* counts, const BlockQuantized& k) {
  const int H = s.num_heads, D = s.head_dim, nb = s.max_blocks();
  ASSERT_EQ(k.max_blocks, nb);
  ASSERT_EQ(k.descale.size(), static_cast<size_t>(s.count()) * H * nb);
  ASSERT_EQ(k.mean.size(), smoothing ? static_cast<size_t>(s.count()) * H * D : 0u);
  for (int b = 0; b < s.count(); ++b) {
    const int len = s.length(b), n = counts ? std::min(std::max(counts[b], 0), len) : len;
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(b) * H + h;
      auto at = [&](int t, int c) { return x[(static_cast<size_t>(s.cu_seqlens[b] + t) * H + h) * D + c]; };
      std::vector<float> mean(D, 0.0f);
      for (int c = 0; c < D && smoothing && n > 0; ++c) {
        double total = 0;
        for (int t0 = 0; t0 < n; t0 += 128) {
          double bs = 0;
          for (int t = t0; t < std::min(n, t0 + 128); ++t) bs += at(t, c);
          total += bs;
        }
        mean[c] = static_cast<float>(total) / static_cast<float>(n);
        ASSERT_EQ(std::memcmp(&mean[c], &k.mean[g * D + c], 4), 0) << "mean, head " << h << " channel " << c;
      }
      for (int blk = 0; blk < nb; ++blk) {
        float amax = 0;
        for (int t = blk * 128; t < std::min(n, blk * 128 + 128); ++t)
          for (int c = 0; c < D; ++c) amax = std::max(amax, std::fabs(at(t, c) - mean[c]));
        float si = amax > 0 ? 448.0f / amax : 0.0f, de = amax / 448.0f;
        if (!std::isfinite(si)) si = de = 0.0f;
        ASSERT_EQ(std::memcmp(&k.descale[g * nb + blk], &de, 4), 0) << "sequence " << b << " head " << h << " block " << blk;
        for (int t = blk * 128; t < std::min(len, blk * 128 + 128); ++t)
          for (int c = 0; c < D; ++c) {
            const uint8_t want = t < n ? e4m3_encode((at(t, c) - mean[c]) * si) : uint8_t(0);
            ASSERT_EQ(k.codes[(static_cast<size_t>(s.cu_seqlens[b] + t) * H + h) * D + c], want)
                << "sequence " << b << " token " << t << " head " << h << " channel " << c;
          }
      }
    }
  }
}

TEST(QuantizeKeyBlocks, WithoutSmoothingOrCountsIsQuantizeBlocks) {
  const Sequences s = testing::packed({300, 0, 128, 5}, 2, 32);
  const std::vector<float> x = random_tokens(s, 31, 2.0f, true);
  BlockQuantized a, b;
  ASSERT_TRUE(quantize_blocks(x.data(), s, &a).ok());
  ASSERT_TRUE(quantize_key_blocks(x.data(), s, false, &b).ok());
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.descale, b.descale);
  EXPECT_TRUE(b.mean.empty());
  expect_key_blocks(x.data(), s, false, nullptr, b);
}

TEST(QuantizeKeyBlocks, SmoothingAndKeyCountsAgainstContract) {
  const Sequences s = testing::packed({300, 0, 257, 128, 1}, 3, 64);
  std::vector<float> x = random_tokens(s, 5, 1.5f, true);
  for (int t = 0; t < s.total_tokens(); ++t)
    for (int c = 0; c < 64; ++c) x[(static_cast<size_t>(t) * 3 + 2) * 64 + c] += (c % 5) * 3.0f;
  x[(static_cast<size_t>(7) * 3 + 1) * 64 + 9] = std::numeric_limits<float>::quiet_NaN();  // sequence 0
  x[(static_cast<size_t>(310) * 3 + 0) * 64 + 2] = std::numeric_limits<float>::infinity();  // sequence 2
  for (int t = 300; t < 300 + 128; ++t)
    for (int c = 0; c < 64; ++c) x[(static_cast<size_t>(t) * 3 + 1) * 64 + c] = 1e-37f * (c % 3);  // tiny
  const int counts[5] = {290, 0, 200, 1000, -1};
  for (bool smoothing : {false, true})
    for (const int* kc : {static_cast<const int*>(nullptr), counts}) {
      BlockQuantized k;
      ASSERT_TRUE(quantize_key_blocks(x.data(), s, smoothing, &k, kc).ok());
      expect_key_blocks(x.data(), s, smoothing, kc, k);
      if (smoothing) {
        EXPECT_TRUE(std::isnan(k.mean[(0 * 3 + 1) * 64 + 9]));
        for (int t = 0; t < (kc ? 290 : 300); ++t) EXPECT_EQ(k.codes[(static_cast<size_t>(t) * 3 + 1) * 64 + 9], 0x7F);
      }
    }
}

// An exactly representable per-channel offset on K leaves the smoothed E4M3 codes and descales unchanged,
// bit for bit (K multiples of 1/4 in [-4, 4], offsets multiples of 8 in [-16, 16], 256 keys: exact means).
TEST(QuantizeKeyBlocks, SmoothingRemovesAnExactChannelOffsetBitForBit) {
  const Sequences s = testing::packed({256, 128}, 2, 32);
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> q(-16, 16);
  std::vector<float> plain(static_cast<size_t>(s.total_tokens()) * 2 * 32), shifted(plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    const int c = static_cast<int>(i % 32), h = static_cast<int>(i / 32 % 2);
    plain[i] = 0.25f * static_cast<float>(q(rng));
    shifted[i] = plain[i] + 8.0f * static_cast<float>((c + 3 * h) % 5 - 2);
    ASSERT_EQ(round_to_bf16(shifted[i]), shifted[i]);
  }
  BlockQuantized a, b;
  ASSERT_TRUE(quantize_key_blocks(plain.data(), s, true, &a).ok());
  ASSERT_TRUE(quantize_key_blocks(shifted.data(), s, true, &b).ok());
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.descale, b.descale);
  ASSERT_TRUE(quantize_key_blocks(shifted.data(), s, false, &b).ok());
  EXPECT_NE(a.codes, b.codes);
}

}  // namespace
}  // namespace openvc::reference
