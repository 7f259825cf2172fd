// Key block lists and chunked causal in the CPU reference (numerics section 5): against the dense call and
// against exact attention over the same keys; V descales per key block (section 4) against the head's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "attention_problem.h"
#include "openvc/reference.h"

namespace openvc::reference {
namespace {

// Key block lists (section 5): every block listed in order is the dense call bit for bit; a window list
// is exact attention over the listed keys (same FP8 operands) up to ExpCast, and an empty row gives 0 and
// lse -inf.
TEST(Attention, KeyBlockLists) {
  Problem p = make_problem({1000}, {1000}, 2, 128, 23);   // 8 query tiles, 8 key blocks (the last partial)
  const int tiles = 8;
  std::vector<int> all(size_t(tiles) * tiles), counts(tiles, tiles);
  for (int t = 0; t < tiles; ++t)
    for (int j = 0; j < tiles; ++j) all[size_t(t) * tiles + j] = j;
  KeyBlockLists lists{counts.data(), all.data(), 1, 1, tiles, tiles};
  AttentionOptions listed;
  listed.key_blocks = &lists;
  AttentionResult dense, got;
  ASSERT_TRUE(attention_expcast(p.in, AttentionOptions{}, &dense).ok());
  ASSERT_TRUE(attention_expcast(p.in, listed, &got).ok());
  EXPECT_EQ(got.out, dense.out);
  EXPECT_EQ(got.lse, dense.lse);

  // Tile t lists blocks t-1, t, t+1 (clipped); tile 5 none.
  std::vector<int> win(size_t(tiles) * 3, 0), n(tiles, 0);
  for (int t = 0; t < tiles; ++t)
    for (int j = std::max(t - 1, 0); j <= std::min(t + 1, tiles - 1) && t != 5; ++j) win[size_t(t) * 3 + n[t]++] = j;
  KeyBlockLists window{n.data(), win.data(), 1, 1, tiles, 3};
  listed.key_blocks = &window;
  ASSERT_TRUE(attention_expcast(p.in, listed, &got).ok());
  const testing::Qkv dq = dequantized(p.in);
  const int H = 2, D = 128, S = 1000;
  const float tau = 1.0f / std::sqrt(128.0f);
  std::vector<double> want(got.out.size(), 0.0);
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < S; ++i) {
      const int t = i / 128;
      if (t == 5) {
        EXPECT_TRUE(std::isinf(got.lse[size_t(h) * S + i]) && got.lse[size_t(h) * S + i] < 0);
        continue;
      }
      std::vector<double> w;
      double m = -1e300, l = 0;
      const int j0 = std::max(t - 1, 0) * 128, j1 = std::min((std::min(t + 1, tiles - 1) + 1) * 128, S);
      for (int j = j0; j < j1; ++j) {
        double dot = 0;
        for (int c = 0; c < D; ++c) dot += double(dq.q[(size_t(i) * H + h) * D + c]) * dq.k[(size_t(j) * H + h) * D + c];
        w.push_back(dot * tau);
        m = std::max(m, w.back());
      }
      for (double& x : w) l += (x = std::exp(x - m));
      for (int j = j0; j < j1; ++j)
        for (int c = 0; c < D; ++c) want[(size_t(i) * H + h) * D + c] += w[j - j0] / l * dq.v[(size_t(j) * H + h) * D + c];
    }
  const ErrorMetrics e = compare(got.out.data(), want.data(), int64_t(want.size()));
  std::printf("[ key block lists ] window vs exact on the same operands: rel_l2 %.5f\n", e.rel_l2);
  EXPECT_LT(e.rel_l2, 0.03);   // ExpCast's weights (about +-7%) on flat rows of a few hundred keys

  listed.causal = true;   // not combined
  EXPECT_EQ(attention_expcast(p.in, listed, &got).code(), StatusCode::kUnsupported);
}

// Chunked causal (section 5): the key limits, chunk 1 is plain causal bit for bit, and a chunk of 300 keys
// is as accurate against exact chunked-causal attention as plain causal against exact causal.
TEST(Attention, ChunkedCausal) {
  EXPECT_EQ(causal_key_limit(0, 10, 10, 1), 1);
  EXPECT_EQ(causal_key_limit(0, 10, 10, 4), 4);     // row 0's chunk: keys 0..3
  EXPECT_EQ(causal_key_limit(4, 10, 10, 4), 8);
  EXPECT_EQ(causal_key_limit(9, 10, 10, 4), 10);    // clamped to Sk
  EXPECT_EQ(causal_key_limit(0, 10, 6, 4), 0);      // Sq > Sk: p = -4 is chunk -1
  EXPECT_EQ(causal_key_limit(3, 10, 6, 4), 0);      // p = -1: chunk -1 too
  EXPECT_EQ(causal_key_limit(4, 10, 6, 4), 4);      // p = 0: chunk 0, keys 0..3
  Problem p = make_problem({1000}, {1000}, 2, 128, 29);
  AttentionOptions causal;
  causal.causal = true;
  AttentionResult plain, chunk1, chunked;
  ASSERT_TRUE(attention_expcast(p.in, causal, &plain).ok());
  causal.causal_chunk = 1;
  ASSERT_TRUE(attention_expcast(p.in, causal, &chunk1).ok());
  EXPECT_EQ(plain.out, chunk1.out);
  causal.causal_chunk = 300;
  ASSERT_TRUE(attention_expcast(p.in, causal, &chunked).ok());
  std::vector<double> exact, exact_plain;
  ASSERT_TRUE(attention_exact(p.x.q.data(), p.x.k.data(), p.x.v.data(), p.qs, p.ks, 0.0f, true, &exact, nullptr, 300).ok());
  ASSERT_TRUE(attention_exact(p.x.q.data(), p.x.k.data(), p.x.v.data(), p.qs, p.ks, 0.0f, true, &exact_plain).ok());
  const ErrorMetrics e = compare(chunked.out.data(), exact.data(), int64_t(exact.size()));
  const ErrorMetrics e1 = compare(plain.out.data(), exact_plain.data(), int64_t(exact.size()));
  const ErrorMetrics cross = compare(chunked.out.data(), exact_plain.data(), int64_t(exact.size()));
  std::printf("[ chunked causal 300 ] vs exact chunked %.5f (plain causal vs exact %.5f; vs exact plain %.5f)\n",
              e.rel_l2, e1.rel_l2, cross.rel_l2);
  EXPECT_LT(e.rel_l2, 1.5 * e1.rel_l2 + 1e-3);
  EXPECT_GT(cross.rel_l2, 10 * e.rel_l2);   // the chunk really changes the mask
  causal.causal = false;   // a chunk needs causal
  EXPECT_EQ(attention_expcast(p.in, causal, &chunked).code(), StatusCode::kInvalidArgument);
}

// V descales per key block (section 4, AttentionOptions::v_block_descale): the head's descale in every block
// is the plain call (up to the double rounding of where the descale is applied); a block's descale times 4
// moves the output as that block's values times 4 move exact attention on the same operands (up to ExpCast's
// weights); the LSE does not move.
TEST(Attention, VBlockDescales) {
  Problem p = make_problem({300, 700}, {1000, 260}, 2, 128, 31);
  const int H = 2, nb = p.ks.max_blocks();
  AttentionResult plain, same, scaled;
  ASSERT_TRUE(attention_expcast(p.in, AttentionOptions{}, &plain).ok());
  std::vector<float> vb(size_t(2) * H * nb);
  for (size_t g = 0; g < size_t(2) * H; ++g)
    for (int b = 0; b < nb; ++b) vb[g * nb + b] = p.in.v.descale[g];
  AttentionOptions opt;
  opt.v_block_descale = vb.data();
  ASSERT_TRUE(attention_expcast(p.in, opt, &same).ok());
  for (size_t i = 0; i < plain.out.size(); ++i) ASSERT_NEAR(same.out[i], plain.out[i], 1e-6 * (1 + std::fabs(plain.out[i])));
  EXPECT_EQ(same.lse, plain.lse);
  // Block 2 of every (sequence, head) 4x: the same as the values of its keys 4x, with the head's descale.
  for (size_t g = 0; g < size_t(2) * H; ++g) vb[g * nb + 2] *= 4.0f;
  ASSERT_TRUE(attention_expcast(p.in, opt, &scaled).ok());
  EXPECT_EQ(scaled.lse, plain.lse);
  testing::Qkv d = dequantized(p.in);
  for (int s = 0; s < 2; ++s)
    for (int t = 256; t < std::min(384, p.ks.length(s)); ++t)
      for (size_t e = 0; e < size_t(H) * 128; ++e) d.v[(size_t(p.ks.cu_seqlens[s]) + t) * H * 128 + e] *= 4.0f;
  // The output moves by the exact attention's move on the same operands (ExpCast weights differ from exact
  // ones only by the code rounding): compare the two changes.
  std::vector<double> e0, e1;
  testing::Qkv d0 = dequantized(p.in);
  ASSERT_TRUE(attention_exact(d0.q.data(), d0.k.data(), d0.v.data(), p.qs, p.ks, 0.0f, false, &e0).ok());
  ASSERT_TRUE(attention_exact(d.q.data(), d.k.data(), d.v.data(), p.qs, p.ks, 0.0f, false, &e1).ok());
  double num = 0, den = 0;
  for (size_t i = 0; i < plain.out.size(); ++i) {
    const double got = double(scaled.out[i]) - plain.out[i], want = e1[i] - e0[i];
    num += (got - want) * (got - want), den += want * want;
  }
  EXPECT_LT(std::sqrt(num / den), 0.05);   // ExpCast's per-weight error (about 3% RMS), not a wrong block
  EXPECT_GT(den, 0.0);
}

}  // namespace
}  // namespace openvc::reference
