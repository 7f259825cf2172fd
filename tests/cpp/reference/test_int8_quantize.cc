// INT8 Q/K quantization (numerics section 9): hand-checked codes, per-row Q and per-block K groups,
// K smoothing means, key counts, edge cases, and an independent loop on random packed inputs.
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

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

using testing::packed;

std::vector<float> random_tokens(const Sequences& s, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(s.total_tokens()) * s.num_heads * s.head_dim);
  for (float& v : x) v = round_to_bf16(g(rng));
  return x;
}

TEST(Int8Encode, RoundHalfEvenClampNaN) {
  const std::vector<std::pair<float, int>> cases = {
      {0.5f, 0},    {1.5f, 2},      {2.5f, 2},       {3.5f, 4},      {-0.5f, 0},   {-1.5f, -2},  {-2.5f, -2},
      {0.49999997f, 0}, {0.50000006f, 1}, {126.5f, 126}, {125.5f, 126}, {-126.5f, -126}, {126.50001f, 127},
      {127.0f, 127}, {127.49f, 127}, {127.5f, 127},  {128.0f, 127},  {1e30f, 127}, {-1e30f, -127}, {-127.6f, -127},
      {kInf, 127},  {-kInf, -127},  {kNaN, 0},       {-0.0f, 0},     {1e-40f, 0},  {0.7f, 1},     {-0.7f, -1}};
  for (const auto& [x, want] : cases) EXPECT_EQ(int8_encode(x), want) << "x = " << x;
}

// Hand-checked rows: amax 127 gives scale_inv 1 and amax 254 gives 0.5 exactly, so the products are
// the written ties; NaN codes 0 and is left out of the amax; zero and tiny rows are zeros.
TEST(Int8Quantize, RowsHandChecked) {
  const Sequences s = packed({7}, 1, 8);
  const std::vector<float> x = {
      127.0f, 0.5f, 1.5f, 2.5f, -2.5f, -126.5f, 3.25f, kNaN,     // row 0: amax 127
      254.0f, 1.0f, 3.0f, 5.0f, -5.0f, -253.0f, -254.0f, 0.0f,  // row 1: amax 254
      0.0f,   0.0f, -0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f,          // row 2: zeros
      1e-37f, -2e-38f, 0.0f, 0.0f, 1e-38f, 0.0f, 0.0f, 0.0f,      // row 3: 127 / 1e-37 overflows
      1e-36f, -4e-37f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f,        // row 4: 127 / 1e-36 is finite
      kInf, 1.0f, -3.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f,            // row 5: Inf: scale_inv 0, descale Inf
      -0.75f, 0.25f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};         // row 6: amax 0.75, scale_inv 169.33
  Int8Quantized q;
  ASSERT_TRUE(quantize_int8_rows(x.data(), s, &q).ok());
  EXPECT_EQ(q.groups, 7);
  EXPECT_EQ(q.group_tokens, 1);
  EXPECT_TRUE(q.mean.empty());
  ASSERT_EQ(q.descale.size(), 7u);
  const std::vector<int8_t> want = {127, 0, 2, 2, -2, -126, 3, 0,  127, 0, 2, 2, -2, -126, -127, 0,
                                    0, 0, 0, 0, 0, 0, 0, 0,        0, 0, 0, 0, 0, 0, 0, 0,
                                    127, -51, 0, 0, 0, 0, 0, 0,    0, 0, 0, 0, 0, 0, 0, 0,
                                    -127, 42, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(q.codes[i], want[i]) << "element " << i;
  EXPECT_EQ(q.descale[0], 1.0f);
  EXPECT_EQ(q.descale[1], 2.0f);
  EXPECT_EQ(q.descale[2], 0.0f);
  EXPECT_EQ(q.descale[3], 0.0f);  // tiny: zeros, no infinite scale
  EXPECT_EQ(q.descale[4], 1e-36f / 127.0f);
  EXPECT_EQ(q.descale[5], kInf);
  EXPECT_EQ(q.descale[6], 0.75f / 127.0f);
  // Row 4: 1e-36 * fl(127 / 1e-36) = 126.99999 -> 127, -4e-37 * it = -50.8 -> -51.
  // Row 6: fl(127 / 0.75) = 169.33333; 0.25 * it = 42.33 -> 42; -0.75 * it = -127.
}

// Reconstruction of per-row Q: |descale * code - x| <= descale / 2 for every finite element, descales
// laid out [nseq, H, max_len] with 0 past a shorter sequence's end.
TEST(Int8Quantize, RowsPackedLayoutAndReconstruction) {
  const Sequences s = packed({5, 130, 0, 64}, 3, 16);
  std::vector<float> x = random_tokens(s, 7, 2.0f);
  x[(static_cast<size_t>(5 + 77) * 3 + 1) * 16 + 4] = 300.0f;  // sequence 1, token 77, head 1 only
  Int8Quantized q;
  ASSERT_TRUE(quantize_int8_rows(x.data(), s, &q).ok());
  ASSERT_EQ(q.groups, 130);
  ASSERT_EQ(q.descale.size(), 4u * 3 * 130);
  for (int b = 0; b < 4; ++b)
    for (int h = 0; h < 3; ++h)
      for (int i = 0; i < 130; ++i) {
        const float d = q.descale[(b * 3 + h) * 130 + i];
        if (i >= s.length(b)) {
          ASSERT_EQ(d, 0.0f) << b << " " << h << " " << i;
          continue;
        }
        const float* row = &x[(static_cast<size_t>(s.cu_seqlens[b] + i) * 3 + h) * 16];
        float amax = 0;
        for (int c = 0; c < 16; ++c) amax = std::max(amax, std::fabs(row[c]));
        ASSERT_EQ(d, amax / 127.0f);
        const int8_t* code = &q.codes[(static_cast<size_t>(s.cu_seqlens[b] + i) * 3 + h) * 16];
        int top = 0;
        for (int c = 0; c < 16; ++c) {
          ASSERT_GE(code[c], -127);
          top = std::max(top, std::abs(static_cast<int>(code[c])));
          ASSERT_LE(std::fabs(d * code[c] - row[c]), d * 0.5f * 1.0001f) << "row " << i << " channel " << c;
        }
        ASSERT_EQ(top, 127);  // the row's amax element codes +-127
      }
  EXPECT_EQ(q.descale[(1 * 3 + 1) * 130 + 77], 300.0f / 127.0f);
  EXPECT_LT(q.descale[(1 * 3 + 0) * 130 + 77], 20.0f / 127.0f);  // other heads of that token unaffected
}

// Key group of key j written from the wgmma fragment: thread t of a row quad holds columns 8m + 2t and
// 8m + 2t + 1 of the 128-key tile, m = 0..15; its keys with m < 8 are group t, with m >= 8 group t + 4.
int fragment_group(int j) {
  const int c = j % 128;
  const int m = c / 8, t = (c % 8) / 2;
  return t + (m >= 8 ? 4 : 0);
}

// Spec means read directly: per 128-key block a double sum of the valid keys in token order, the block
// sums added in block order in double, one rounding to FP32, one FP32 division by (float)count.
std::vector<float> spec_means(const float* x, const Sequences& s, const int* counts) {
  const int H = s.num_heads, D = s.head_dim;
  std::vector<float> mean(static_cast<size_t>(s.count()) * H * D, 0.0f);
  for (int b = 0; b < s.count(); ++b) {
    const int n = counts ? std::min(std::max(counts[b], 0), s.length(b)) : s.length(b);
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < D; ++c) {
        double total = 0;
        for (int blk = 0; blk * 128 < n; ++blk) {
          double bs = 0;
          for (int t = blk * 128; t < std::min(n, blk * 128 + 128); ++t)
            bs += x[(static_cast<size_t>(s.cu_seqlens[b] + t) * H + h) * D + c];
          total += bs;
        }
        if (n > 0) mean[(static_cast<size_t>(b) * H + h) * D + c] = static_cast<float>(total) / static_cast<float>(n);
      }
  }
  return mean;
}

// The contract of K read directly: optional key counts, the spec's blocked channel means, FP32
// subtraction, per-(block, key group) amax over valid keys, codes, and zeros for padding.
void expect_k_contract(const float* x, const Sequences& s, bool smoothing, const int* counts, const Int8Quantized& k) {
  const int H = s.num_heads, D = s.head_dim, nb = s.max_blocks();
  ASSERT_EQ(k.groups, nb * 8);
  ASSERT_EQ(k.group_tokens, 128);
  ASSERT_EQ(k.descale.size(), static_cast<size_t>(s.count()) * H * nb * 8);
  ASSERT_EQ(k.mean.size(), smoothing ? static_cast<size_t>(s.count()) * H * D : 0u);
  const std::vector<float> means = spec_means(x, s, counts);
  for (int b = 0; b < s.count(); ++b) {
    const int len = s.length(b);
    const int n = counts ? std::min(std::max(counts[b], 0), len) : len;
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(b) * H + h;
      auto at = [&](int t, int c) { return x[(static_cast<size_t>(s.cu_seqlens[b] + t) * H + h) * D + c]; };
      std::vector<float> mean(D, 0.0f);
      if (smoothing)
        for (int c = 0; c < D; ++c) {
          mean[c] = means[g * D + c];
          ASSERT_EQ(std::memcmp(&k.mean[g * D + c], &mean[c], 4), 0)
              << "mean " << k.mean[g * D + c] << " vs " << mean[c] << ": sequence " << b << " head " << h << " channel " << c;
        }
      std::vector<float> amax(static_cast<size_t>(nb) * 8, 0.0f);
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < D; ++c) {
          float& a = amax[t / 128 * 8 + fragment_group(t)];
          a = std::max(a, std::fabs(at(t, c) - mean[c]));  // std::max keeps a on NaN
        }
      for (int blk = 0; blk < nb; ++blk)
        for (int kg = 0; kg < 8; ++kg) {
          const float am = amax[blk * 8 + kg];
          float si = am > 0 ? 127.0f / am : 0.0f, de = am / 127.0f;
          if (!std::isfinite(si)) si = de = 0.0f;
          ASSERT_EQ(std::memcmp(&k.descale[(g * nb + blk) * 8 + kg], &de, 4), 0)
              << "sequence " << b << " head " << h << " block " << blk << " group " << kg;
        }
      for (int t = 0; t < len; ++t) {
        const float am = t < n ? amax[t / 128 * 8 + fragment_group(t)] : 0.0f;
        float scale_inv = am > 0 ? 127.0f / am : 0.0f;
        if (!std::isfinite(scale_inv)) scale_inv = 0.0f;
        for (int c = 0; c < D; ++c) {
          int want = 0;
          if (t < n) {
            const float y = (at(t, c) - mean[c]) * scale_inv;
            want = std::isnan(y) ? 0 : static_cast<int>(std::nearbyint(std::min(127.0f, std::max(-127.0f, y))));
          }
          ASSERT_EQ(k.codes[(static_cast<size_t>(s.cu_seqlens[b] + t) * H + h) * D + c], want)
              << "sequence " << b << " token " << t << " head " << h << " channel " << c;
        }
      }
    }
  }
}

TEST(Int8Quantize, KeyGroupsAreTheFragmentQuads) {
  for (int j = 0; j < 3 * 128; ++j) {
    ASSERT_EQ(int8_key_group(j), fragment_group(j)) << "key " << j;
    ASSERT_EQ(int8_key_descale_index(j), j / 128 * 8 + fragment_group(j)) << "key " << j;
  }
  int per_group[8] = {};
  for (int c = 0; c < 128; ++c) ++per_group[int8_key_group(c)];
  for (int kg = 0; kg < 8; ++kg) EXPECT_EQ(per_group[kg], 16) << "group " << kg;
  // Group 0 holds keys 0, 1, 8, 9, ..., 56, 57; group 4 keys 64, 65, ..., 120, 121; group 7 ends at 127.
  EXPECT_EQ(int8_key_group(1), 0);
  EXPECT_EQ(int8_key_group(57), 0);
  EXPECT_EQ(int8_key_group(2), 1);
  EXPECT_EQ(int8_key_group(63), 3);
  EXPECT_EQ(int8_key_group(64), 4);
  EXPECT_EQ(int8_key_group(127), 7);
  EXPECT_EQ(int8_key_group(128 + 6), 3);
}

// One outlier per (block, group) changes only its own group's descale: the other 7 groups of the block
// keep their scale (the point of the key groups).
TEST(Int8Quantize, OutlierStaysInItsKeyGroup) {
  const Sequences s = packed({256}, 1, 16);
  std::vector<float> x = random_tokens(s, 13, 1.0f);
  Int8Quantized base, out;
  ASSERT_TRUE(quantize_int8_blocks(x.data(), s, false, &base).ok());
  x[static_cast<size_t>(128 + 70) * 16 + 5] = 500.0f;  // block 1, key 70: group (70 % 8) / 2 + 4 = 7
  ASSERT_TRUE(quantize_int8_blocks(x.data(), s, false, &out).ok());
  ASSERT_EQ(out.groups, 16);
  for (int i = 0; i < 16; ++i) {
    if (i == 8 + 7) {
      EXPECT_EQ(out.descale[i], 500.0f / 127.0f);
    } else {
      EXPECT_EQ(out.descale[i], base.descale[i]) << "descale " << i;
    }
  }
  for (int t = 0; t < 256; ++t)
    for (int c = 0; c < 16; ++c)
      if (t / 128 != 1 || int8_key_group(t) != 7) EXPECT_EQ(out.codes[t * 16 + c], base.codes[t * 16 + c]);
  expect_k_contract(x.data(), s, false, nullptr, out);
}

TEST(Int8Quantize, BlocksPartialFinalBlock) {
  const Sequences s = packed({300}, 2, 32);
  std::vector<float> x = random_tokens(s, 3, 0.7f);
  x[(250 * 2 + 0) * 32 + 3] = 40.0f;  // block 1 of head 0 only (key 250: c = 122, group 5): not block 2
  Int8Quantized k;
  ASSERT_TRUE(quantize_int8_blocks(x.data(), s, false, &k).ok());
  ASSERT_EQ(k.groups, 24);
  EXPECT_EQ(k.descale[0 * 24 + 1 * 8 + 5], 40.0f / 127.0f);
  EXPECT_EQ(k.codes[(250 * 2 + 0) * 32 + 3], 127);
  for (int kg = 0; kg < 8; ++kg) {
    EXPECT_LT(k.descale[0 * 24 + 2 * 8 + kg], 10.0f / 127.0f);  // tokens [256, 300)
    // 44 keys (c = 0..43): groups 0..3 hold 11 or 12 each, groups 4..7 (c >= 64) none: descale 0.
    if (kg < 4) {
      EXPECT_GT(k.descale[0 * 24 + 2 * 8 + kg], 0.0f);
    } else {
      EXPECT_EQ(k.descale[0 * 24 + 2 * 8 + kg], 0.0f);
    }
  }
  expect_k_contract(x.data(), s, false, nullptr, k);
  // A final block of 3 keys (keys 0, 1 in group 0, key 2 in group 1): groups 2..7 hold no key, descale 0.
  const Sequences s3 = packed({3}, 1, 8);
  std::vector<float> y(3 * 8, 1.0f);
  ASSERT_TRUE(quantize_int8_blocks(y.data(), s3, false, &k).ok());
  EXPECT_EQ(k.descale, (std::vector<float>{1.0f / 127.0f, 1.0f / 127.0f, 0, 0, 0, 0, 0, 0}));
}

// Smoothing means by hand: a float division of the float-rounded double sum.
TEST(Int8Quantize, SmoothingMeanExact) {
  const Sequences s = packed({3}, 1, 4);
  // channel 0: 1, 2, 4 -> 7 / 3; channel 1: 1e8, 1, -1e8 -> 1 / 3 (a float running sum gives 0);
  // channel 2: constant 5 -> mean 5, k' = 0 everywhere; channel 3: -6, 0, 0 -> -2.
  // Keys 0 and 1 are key group 0, key 2 group 1.
  const std::vector<float> x = {1.0f, 1e8f, 5.0f, -6.0f, 2.0f, 1.0f, 5.0f, 0.0f, 4.0f, -1e8f, 5.0f, 0.0f};
  Int8Quantized k;
  ASSERT_TRUE(quantize_int8_blocks(x.data(), s, true, &k).ok());
  ASSERT_EQ(k.mean.size(), 4u);
  EXPECT_EQ(k.mean[0], 7.0f / 3.0f);
  EXPECT_EQ(k.mean[1], 1.0f / 3.0f);
  EXPECT_EQ(k.mean[2], 5.0f);
  EXPECT_EQ(k.mean[3], -2.0f);
  {
    float f = 0;  // the float running sum really differs on channel 1
    for (float v : {1e8f, 1.0f, -1e8f}) f += v;
    EXPECT_EQ(f, 0.0f);
  }
  // amax over k' = fl(k - mean): channel 1 holds 1e8 - 1/3 -> fl = 1e8 (group 0), -1e8 (group 1).
  EXPECT_EQ(k.descale[0], (1e8f - 1.0f / 3.0f) / 127.0f);
  EXPECT_EQ(k.descale[1], (1e8f + 1.0f / 3.0f) / 127.0f);
  EXPECT_EQ(k.codes[1], 127);
  EXPECT_EQ(k.codes[9], -127);
  EXPECT_EQ(k.codes[2], 0);
  EXPECT_EQ(k.codes[6], 0);
  expect_k_contract(x.data(), s, true, nullptr, k);

  // Without a dominant channel: group 0 (keys 0, 1) has amax |-6 - -2| = 4, group 1 (key 2) |0 - -2| = 2.
  const std::vector<float> y = {1.0f, 0.5f, 5.0f, -6.0f, 2.0f, 1.0f, 5.0f, 0.0f, 4.0f, -1.0f, 5.0f, 0.0f};
  ASSERT_TRUE(quantize_int8_blocks(y.data(), s, true, &k).ok());
  EXPECT_EQ(k.mean[1], static_cast<float>(0.5) / 3.0f);
  const float m0 = 7.0f / 3.0f;
  EXPECT_EQ(k.descale[0], 4.0f / 127.0f);
  EXPECT_EQ(k.descale[1], 2.0f / 127.0f);
  EXPECT_EQ(k.codes[3], -127);
  EXPECT_EQ(k.codes[7], 64);   // 2 * 31.75 = 63.5 -> tie to even 64
  EXPECT_EQ(k.codes[11], 127);  // 2 * 63.5
  EXPECT_EQ(k.codes[8], static_cast<int>(std::nearbyint((4.0f - m0) * (127.0f / 2.0f))));
  EXPECT_EQ(k.codes[8], 106);  // 1.6666667 * 63.5 = 105.83
  expect_k_contract(y.data(), s, true, nullptr, k);
}

// The means follow the spec's blocked order, not one sequential sum: block 0 holds 2^53, block 1 128 ones,
// block 2 -2^53. Sequentially every 1 is lost (2^53 + 1 rounds to 2^53, ties to even) and the mean is 0;
// the block sums are 2^53, 128 and -2^53 and their sum 128, so the mean is 128 / 384 = fl(1/3).
TEST(Int8Quantize, SmoothingMeanIsBlockedInTokenOrder) {
  const Sequences s = packed({384}, 1, 8);
  std::vector<float> x(384 * 8, 0.0f);
  for (int c = 0; c < 8; ++c) {
    x[0 * 8 + c] = 0x1p53f;
    for (int t = 128; t < 256; ++t) x[t * 8 + c] = 1.0f;
    x[256 * 8 + c] = -0x1p53f;
  }
  {
    double seq = 0;
    for (int t = 0; t < 384; ++t) seq += x[t * 8];
    EXPECT_EQ(seq, 0.0);  // the sequential double sum loses the ones
  }
  std::vector<float> mean;
  ASSERT_TRUE(k_smoothing_means(x.data(), s, nullptr, &mean).ok());
  ASSERT_EQ(mean.size(), 8u);
  for (int c = 0; c < 8; ++c) EXPECT_EQ(mean[c], 128.0f / 384.0f);
  EXPECT_EQ(mean, spec_means(x.data(), s, nullptr));
  // Key count 256 (keys of block 2 are padding): (2^53 + 128) rounds to 2^53 in FP32, / 256 = 2^45.
  const int count = 256;
  ASSERT_TRUE(k_smoothing_means(x.data(), s, &count, &mean).ok());
  for (int c = 0; c < 8; ++c) EXPECT_EQ(mean[c], 0x1p45f);
  Int8Quantized k;
  for (const int* kc : {static_cast<const int*>(nullptr), &count}) {
    ASSERT_TRUE(quantize_int8_blocks(x.data(), s, true, &k, kc).ok());
    expect_k_contract(x.data(), s, true, kc, k);
  }
}

// K + a per-channel offset quantizes, with smoothing, to the same codes and descales as K alone, bit for
// bit, when every value involved is exact: K multiples of 1/4 in [-4, 4], offsets multiples of 8 below 32
// in magnitude (BF16 holds k + o exactly), 256 keys per sequence (the means are exact).
std::vector<float> offset_k(const Sequences& s, uint32_t seed, bool with_offset) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> q(-16, 16);
  std::vector<float> x(static_cast<size_t>(s.total_tokens()) * s.num_heads * s.head_dim);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = static_cast<int>(i % s.head_dim), h = static_cast<int>(i / s.head_dim % s.num_heads);
    const float o = with_offset ? 8.0f * static_cast<float>((c + 3 * h) % 5 - 2) : 0.0f;
    x[i] = 0.25f * static_cast<float>(q(rng)) + o;
    EXPECT_EQ(round_to_bf16(x[i]), x[i]);
  }
  return x;
}

TEST(Int8Quantize, SmoothingRemovesAnExactChannelOffsetBitForBit) {
  const Sequences s = packed({256, 128}, 2, 32);
  const std::vector<float> plain = offset_k(s, 21, false), shifted = offset_k(s, 21, true);
  Int8Quantized a, b;
  ASSERT_TRUE(quantize_int8_blocks(plain.data(), s, true, &a).ok());
  ASSERT_TRUE(quantize_int8_blocks(shifted.data(), s, true, &b).ok());
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.descale, b.descale);
  for (size_t i = 0; i < a.mean.size(); ++i) {
    const int c = static_cast<int>(i % 32), h = static_cast<int>(i / 32 % 2);
    EXPECT_EQ(b.mean[i], a.mean[i] + 8.0f * static_cast<float>((c + 3 * h) % 5 - 2)) << i;
  }
  // Without smoothing the offset changes the codes.
  ASSERT_TRUE(quantize_int8_blocks(plain.data(), s, false, &a).ok());
  ASSERT_TRUE(quantize_int8_blocks(shifted.data(), s, false, &b).ok());
  EXPECT_NE(a.codes, b.codes);
}

// Key counts: keys at or past the count are padding (out of the mean and amax, coded 0, whatever they
// hold); the valid keys quantize exactly as the same sequences cut to their counts.
TEST(Int8Quantize, KeyCountsExcludePadding) {
  const Sequences s = packed({300, 200, 50}, 2, 16);
  std::vector<float> x = random_tokens(s, 11, 1.0f);
  for (int c = 0; c < 16; ++c) {
    x[(static_cast<size_t>(260) * 2 + 1) * 16 + c] = 1000.0f;  // sequence 0 token 260 (padding)
    x[(static_cast<size_t>(300 + 199) * 2 + 0) * 16 + c] = kNaN;  // sequence 1 last token (padding)
  }
  const int counts[3] = {250, 199, -4};  // -4 clamps to 0: the whole sequence is padding
  for (bool smoothing : {false, true}) {
    Int8Quantized k, cut;
    ASSERT_TRUE(quantize_int8_blocks(x.data(), s, smoothing, &k, counts).ok());
    expect_k_contract(x.data(), s, smoothing, counts, k);
    for (int kg = 0; kg < 8; ++kg) {
      EXPECT_EQ(k.descale[(0 * 2 + 1) * 24 + 2 * 8 + kg], 0.0f);  // block 2 of sequence 0: padding (keys >= 250)
      for (int h = 0; h < 2; ++h) EXPECT_EQ(k.descale[(2 * 2 + h) * 24 + kg], 0.0f);
    }
    // Same as quantizing the kept keys alone.
    const Sequences ks = packed({250, 199, 0}, 2, 16);
    std::vector<float> kept;
    for (int b = 0; b < 3; ++b)
      for (int t = 0; t < ks.length(b); ++t)
        for (int e = 0; e < 32; ++e) kept.push_back(x[(static_cast<size_t>(s.cu_seqlens[b] + t)) * 32 + e]);
    ASSERT_TRUE(quantize_int8_blocks(kept.data(), ks, smoothing, &cut).ok());
    ASSERT_EQ(cut.groups, 16);
    for (int b = 0; b < 3; ++b)
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 16; ++i)
          EXPECT_EQ(k.descale[(b * 2 + h) * 24 + i], cut.descale[(b * 2 + h) * 16 + i]) << b << h << i;
        for (int c = 0; c < 16 && smoothing; ++c)
          EXPECT_EQ(k.mean[(b * 2 + h) * 16 + c], cut.mean[(b * 2 + h) * 16 + c]);
      }
    for (int b = 0; b < 3; ++b)
      for (int t = 0; t < s.length(b); ++t)
        for (int e = 0; e < 32; ++e) {
          const int8_t got = k.codes[static_cast<size_t>(s.cu_seqlens[b] + t) * 32 + e];
          const int8_t want = t < ks.length(b) ? cut.codes[static_cast<size_t>(ks.cu_seqlens[b] + t) * 32 + e] : 0;
          ASSERT_EQ(got, want) << "sequence " << b << " token " << t;
        }
  }
}

TEST(Int8Quantize, BlocksRandomPackedAgainstContract) {
  const Sequences s = packed({130, 0, 257, 128, 1}, 3, 64);
  std::vector<float> x = random_tokens(s, 5, 1.5f);
  // A large channel mean on head 2 (smoothing's case) and a tiny block.
  for (int t = 0; t < s.total_tokens(); ++t)
    for (int c = 0; c < 64; ++c) x[(static_cast<size_t>(t) * 3 + 2) * 64 + c] += (c % 5) * 3.0f;
  for (int t = 130; t < 130 + 128; ++t)
    for (int c = 0; c < 64; ++c) x[(static_cast<size_t>(t) * 3 + 0) * 64 + c] = 1e-37f * (c % 3);
  const int counts[5] = {130, 0, 200, 1000, 1};
  for (bool smoothing : {false, true}) {
    for (const int* kc : {static_cast<const int*>(nullptr), counts}) {
      Int8Quantized k;
      ASSERT_TRUE(quantize_int8_blocks(x.data(), s, smoothing, &k, kc).ok());
      expect_k_contract(x.data(), s, smoothing, kc, k);
      if (!smoothing)
        for (int kg = 0; kg < 8; ++kg) EXPECT_EQ(k.descale[((2 * 3 + 0) * 3 + 0) * 8 + kg], 0.0f);  // tiny: zeros
    }
  }
}

TEST(Int8Quantize, NonFiniteStaysInItsGroup) {
  const Sequences s = packed({256}, 2, 8);
  std::vector<float> x = random_tokens(s, 9, 1.0f);
  x[(10 * 2 + 0) * 8 + 3] = kNaN;   // head 0, block 0, key 10: group 1
  x[(200 * 2 + 1) * 8 + 1] = kInf;  // head 1, block 1, key 200 (c = 72): group 4
  Int8Quantized k, q;
  ASSERT_TRUE(quantize_int8_blocks(x.data(), s, false, &k).ok());
  ASSERT_TRUE(quantize_int8_rows(x.data(), s, &q).ok());
  EXPECT_EQ(k.codes[(10 * 2 + 0) * 8 + 3], 0);  // NaN codes 0 and is left out of the amax
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isfinite(k.descale[i]) && k.descale[i] > 0.0f) << i;
  for (int i = 16; i < 32; ++i) {
    if (i == 16 + 8 + 4) {
      EXPECT_EQ(k.descale[i], kInf);  // Inf: descale Inf, codes 0 (scale_inv 0), in its key group only
    } else {
      EXPECT_TRUE(std::isfinite(k.descale[i]) && k.descale[i] > 0.0f) << i;
    }
  }
  for (int t = 128; t < 256; ++t)
    for (int c = 0; c < 8; ++c)
      if (int8_key_group(t) == 4) EXPECT_EQ(k.codes[(t * 2 + 1) * 8 + c], 0);
  expect_k_contract(x.data(), s, false, nullptr, k);
  EXPECT_EQ(q.codes[(10 * 2 + 0) * 8 + 3], 0);
  EXPECT_TRUE(std::isfinite(q.descale[0 * 256 + 10]));
  EXPECT_EQ(q.descale[1 * 256 + 200], kInf);
  // Smoothing: the NaN makes head 0's channel 3 mean NaN, so that channel codes 0 and is left out of
  // the maxima; head 1's Inf makes its channel 1 mean Inf and every group's descale Inf.
  ASSERT_TRUE(quantize_int8_blocks(x.data(), s, true, &k).ok());
  EXPECT_TRUE(std::isnan(k.mean[3]));
  for (int t = 0; t < 256; ++t) EXPECT_EQ(k.codes[(t * 2 + 0) * 8 + 3], 0);
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isfinite(k.descale[i]) && k.descale[i] > 0.0f) << i;
  for (int i = 16; i < 32; ++i) EXPECT_EQ(k.descale[i], kInf) << i;
  expect_k_contract(x.data(), s, true, nullptr, k);
}

// Tiny key groups (127 / amax overflows) are zeros while the other groups of the block keep their scale.
TEST(Int8Quantize, TinyKeyGroupIsZeros) {
  const Sequences s = packed({128}, 1, 8);
  std::vector<float> x(128 * 8, 0.0f);
  for (int t = 0; t < 128; ++t)
    for (int c = 0; c < 8; ++c) x[t * 8 + c] = int8_key_group(t) == 2 ? 1e-38f : 0.5f * (c + 1);
  Int8Quantized k;
  for (bool smoothing : {false, true}) {
    ASSERT_TRUE(quantize_int8_blocks(x.data(), s, smoothing, &k).ok());
    expect_k_contract(x.data(), s, smoothing, nullptr, k);
  }
  ASSERT_TRUE(quantize_int8_blocks(x.data(), s, false, &k).ok());
  EXPECT_EQ(k.descale[2], 0.0f);
  EXPECT_EQ(k.descale[3], 4.0f / 127.0f);
  for (int t = 0; t < 128; ++t)
    if (int8_key_group(t) == 2)
      for (int c = 0; c < 8; ++c) EXPECT_EQ(k.codes[t * 8 + c], 0);
}

TEST(Int8Quantize, BadArgumentsNameTheArgument) {
  Sequences s = packed({10}, 2, 4);
  std::vector<float> x(10 * 2 * 4, 1.0f);
  Int8Quantized q;
  EXPECT_NE(quantize_int8_rows(nullptr, s, &q).message().find("x must not be null"), std::string::npos);
  EXPECT_NE(quantize_int8_blocks(x.data(), s, true, nullptr).message().find("out must not be null"), std::string::npos);
  s.head_dim = 0;
  EXPECT_NE(quantize_int8_rows(x.data(), s, &q).message().find("head_dim must be > 0, got 0"), std::string::npos);
  s.head_dim = 4;
  s.cu_seqlens = {0, 8, 4};
  EXPECT_NE(quantize_int8_blocks(x.data(), s, false, &q).message().find("cu_seqlens"), std::string::npos);
  s.cu_seqlens = {0, 10};
  EXPECT_TRUE(quantize_int8_rows(x.data(), s, &q).ok());
  EXPECT_TRUE(quantize_int8_blocks(x.data(), s, true, &q).ok());
  for (int8_t c : q.codes) EXPECT_EQ(c, 0);  // constant K: k' = 0 everywhere
}

}  // namespace
}  // namespace openvc::reference
