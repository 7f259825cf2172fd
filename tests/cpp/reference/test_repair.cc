// V residual repair (numerics section 6): selection against a brute-force top-k, the budget rule and
// its validation, the repair codes, and the effect of repair rows on attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "openvc/reference.h"
#include "test_inputs.h"

namespace openvc::reference {
namespace {

// Residual of token t (absolute index) of head h, computed from the contract: FP32 reconstruction
// descale * decode, then one FP32 subtraction.
std::vector<float> residual_row(const std::vector<float>& v, const HeadQuantized& vq, const Sequences& seqs,
                                int s, int h, int64_t t) {
  const int H = seqs.num_heads, D = seqs.head_dim;
  const float descale = vq.descale[static_cast<size_t>(s) * H + h];
  std::vector<float> r(D);
  for (int c = 0; c < D; ++c) {
    const size_t e = (static_cast<size_t>(t) * H + h) * D + c;
    r[c] = v[e] - descale * e4m3_decode(vq.codes[e]);
  }
  return r;
}

// Brute force: energies of all tokens, full sort by (energy desc, index asc), first k.
std::vector<int> brute_force_top_k(const std::vector<float>& v, const HeadQuantized& vq, const Sequences& seqs,
                                   int s, int h, int k) {
  const int len = seqs.length(s);
  std::vector<std::pair<double, int>> e;
  for (int j = 0; j < len; ++j) {
    double sum = 0;
    for (float x : residual_row(v, vq, seqs, s, h, seqs.cu_seqlens[s] + j)) sum += static_cast<double>(x) * x;
    e.push_back({-sum, j});  // ascending (-energy, index) == (energy desc, index asc)
  }
  std::sort(e.begin(), e.end());
  std::vector<int> top;
  for (int i = 0; i < k; ++i) top.push_back(e[i].second);
  return top;
}

// Gaussian V rounded to BF16 with `outliers` tokens per head scaled by `outlier_gain`.
std::vector<float> v_with_outliers(const Sequences& seqs, uint32_t seed, int outliers, float outlier_gain) {
  const int H = seqs.num_heads, D = seqs.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(seqs.total_tokens()) * H * D);
  for (float& x : v) x = gauss(rng);
  for (int s = 0; s < seqs.count(); ++s) {
    for (int h = 0; h < H; ++h) {
      for (int n = 0; n < outliers; ++n) {
        const int64_t t = seqs.cu_seqlens[s] + (static_cast<int64_t>(rng()) % seqs.length(s));
        for (int c = 0; c < D; ++c) v[(static_cast<size_t>(t) * H + h) * D + c] *= outlier_gain;
      }
    }
  }
  for (float& x : v) x = round_to_bf16(x);
  return v;
}

TEST(ReferenceRepair, SelectionMatchesBruteForceTopK) {
  Sequences seqs;
  seqs.cu_seqlens = {0, 700, 1212};
  seqs.num_heads = 2;
  seqs.head_dim = 128;
  std::vector<float> v = v_with_outliers(seqs, 11, 6, 8.0f);
  // Exact ties: tokens 100, 40 and 300 of sequence 0, head 1 get the same large row, so their energies
  // are equal and they are all selected; the tie rule orders them 40, 100, 300.
  const int H = seqs.num_heads, D = seqs.head_dim;
  for (int t : {100, 40, 300}) {
    for (int c = 0; c < D; ++c) v[(static_cast<size_t>(t) * H + 1) * D + c] = round_to_bf16(7.3f + 0.11f * c);
  }
  HeadQuantized vq;
  ASSERT_TRUE(quantize_heads(v.data(), seqs, &vq).ok());
  const double budget = 0.05;
  VRepair rep;
  const Status st = select_v_repair(v.data(), seqs, vq, budget, &rep);
  ASSERT_TRUE(st.ok()) << st.message();

  EXPECT_EQ(rep.tokens_per_head, 35);  // round(0.05 * 700)
  ASSERT_EQ(rep.count.size(), 4u);
  ASSERT_EQ(rep.offset.size(), 4u);
  int expected_offset = 0;
  for (int s = 0; s < seqs.count(); ++s) {
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(s) * H + h;
      const int k = static_cast<int>(std::llround(budget * seqs.length(s)));
      EXPECT_EQ(rep.count[g], k);
      EXPECT_EQ(rep.offset[g], expected_offset);
      const std::vector<int> want = brute_force_top_k(v, vq, seqs, s, h, k);
      const std::vector<int> got(rep.tokens.begin() + rep.offset[g], rep.tokens.begin() + rep.offset[g] + rep.count[g]);
      EXPECT_EQ(got, want) << "sequence " << s << " head " << h;
      expected_offset += k;
    }
  }
  EXPECT_EQ(rep.tokens.size(), static_cast<size_t>(expected_offset));
  EXPECT_EQ(rep.codes.size(), rep.tokens.size() * D);
  // The tied trio in storage order (they outrank every Gaussian token).
  const std::vector<int> g1(rep.tokens.begin() + rep.offset[1], rep.tokens.begin() + rep.offset[1] + rep.count[1]);
  std::vector<int> trio;
  for (int t : g1) {
    if (t == 40 || t == 100 || t == 300) trio.push_back(t);
  }
  EXPECT_EQ(trio, (std::vector<int>{40, 100, 300}));
}

TEST(ReferenceRepair, BudgetRoundsHalfAwayFromZero) {
  Sequences seqs;
  seqs.cu_seqlens = {0, 10, 40, 41};  // lengths 10, 30, 1
  seqs.num_heads = 2;
  seqs.head_dim = 128;
  const std::vector<float> v = v_with_outliers(seqs, 5, 0, 1.0f);
  HeadQuantized vq;
  ASSERT_TRUE(quantize_heads(v.data(), seqs, &vq).ok());
  VRepair rep;
  ASSERT_TRUE(select_v_repair(v.data(), seqs, vq, 0.25, &rep).ok());
  // 2.5 -> 3, 7.5 -> 8, 0.25 -> 0.
  EXPECT_EQ(rep.tokens_per_head, 8);
  EXPECT_EQ(rep.count, (std::vector<int>{3, 3, 8, 8, 0, 0}));
  EXPECT_EQ(rep.offset, (std::vector<int>{0, 3, 6, 14, 22, 22}));
}

TEST(ReferenceRepair, ZeroRowsSelectNothing) {
  const Sequences seqs = Sequences::Batched(2, 1000, 2, 128);
  const std::vector<float> v = v_with_outliers(seqs, 6, 2, 10.0f);
  HeadQuantized vq;
  ASSERT_TRUE(quantize_heads(v.data(), seqs, &vq).ok());
  for (double budget : {0.0, 0.0004}) {  // 0 and round(0.4) = 0
    VRepair rep;
    rep.tokens = {1, 2, 3};  // stale content must be replaced
    ASSERT_TRUE(select_v_repair(v.data(), seqs, vq, budget, &rep).ok()) << budget;
    EXPECT_EQ(rep.tokens_per_head, 0);
    EXPECT_EQ(rep.count, std::vector<int>(4, 0));
    EXPECT_EQ(rep.offset, std::vector<int>(4, 0));
    EXPECT_TRUE(rep.tokens.empty());
    EXPECT_TRUE(rep.codes.empty());
  }
}

TEST(ReferenceRepair, InvalidBudgetIsRejectedByName) {
  const Sequences seqs = Sequences::Batched(1, 256, 2, 128);
  const std::vector<float> v = v_with_outliers(seqs, 7, 0, 1.0f);
  HeadQuantized vq;
  ASSERT_TRUE(quantize_heads(v.data(), seqs, &vq).ok());
  const double inf = std::numeric_limits<double>::infinity();
  for (double budget : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN(), inf, -inf}) {
    VRepair rep;
    const Status st = select_v_repair(v.data(), seqs, vq, budget, &rep);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << budget;
    EXPECT_NE(st.message().find("budget"), std::string::npos) << st.message();
  }
  // The largest valid budget below 1 is accepted.
  VRepair rep;
  EXPECT_TRUE(select_v_repair(v.data(), seqs, vq, std::nextafter(1.0, 0.0), &rep).ok());
  EXPECT_EQ(rep.count[0], 256);
}

TEST(ReferenceRepair, RepairCodesEncodeTheResidualWithTheVScale) {
  Sequences seqs;
  seqs.cu_seqlens = {0, 512, 1024};
  seqs.num_heads = 2;
  seqs.head_dim = 128;
  const std::vector<float> v = v_with_outliers(seqs, 8, 4, 12.0f);
  HeadQuantized vq;
  ASSERT_TRUE(quantize_heads(v.data(), seqs, &vq).ok());
  VRepair rep;
  ASSERT_TRUE(select_v_repair(v.data(), seqs, vq, 0.1, &rep).ok());
  const int H = seqs.num_heads, D = seqs.head_dim;
  double err2 = 0, res2 = 0, v2 = 0;
  for (int s = 0; s < seqs.count(); ++s) {
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(s) * H + h;
      const float descale = vq.descale[g], scale_inv = vq.scale_inv[g];
      for (int r = 0; r < rep.count[g]; ++r) {
        const int row = rep.offset[g] + r;
        const int64_t t = seqs.cu_seqlens[s] + rep.tokens[row];
        const std::vector<float> res = residual_row(v, vq, seqs, s, h, t);
        for (int c = 0; c < D; ++c) {
          const uint8_t code = rep.codes[static_cast<size_t>(row) * D + c];
          ASSERT_EQ(code, e4m3_encode(res[c] * scale_inv)) << "row " << row << " channel " << c;
          // descale * decode(code) is the residual to E4M3 precision: half a step of 2^-3 relative,
          // or half the subnormal step 2^-9 * descale.
          const double approx = static_cast<double>(descale) * e4m3_decode(code);
          const double bound = std::fabs(res[c]) * 0x1p-4 + descale * 0x1p-10;
          EXPECT_LE(std::fabs(approx - res[c]), bound * 1.0001);
          err2 += (approx - res[c]) * (approx - res[c]);
          res2 += static_cast<double>(res[c]) * res[c];
          const double vt = v[(static_cast<size_t>(t) * H + h) * D + c];
          v2 += vt * vt;
        }
      }
    }
  }
  // After repair the selected tokens' error is a few percent of what it was.
  std::printf("selected tokens: V quantization rel err %.4g, after repair %.4g\n", std::sqrt(res2 / v2),
              std::sqrt(err2 / v2));
  EXPECT_LT(err2, 0.01 * res2);
}

// Q and K video-like (realistic attention), V Gaussian with a few strong outlier tokens per head.
struct OutlierCase {
  Sequences seqs = Sequences::Batched(1, 1024, 2, 128);
  testing::Qkv x;
  std::vector<double> exact;
  PreparedInputs prep;
  OutlierCase() {
    x = testing::video_like(seqs, seqs, 21);
    x.v = v_with_outliers(seqs, 22, 8, 40.0f);
    EXPECT_TRUE(attention_exact(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, 0.0f, false, &exact).ok());
    EXPECT_TRUE(prepare_inputs(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, &prep).ok());
  }
};

TEST(ReferenceRepair, RepairLowersErrorOnOutlierTokens) {
  OutlierCase tc;
  AttentionOptions opt;
  AttentionResult plain, repaired;
  ASSERT_TRUE(attention_expcast(tc.prep, opt, &plain).ok());
  VRepair rep;
  ASSERT_TRUE(select_v_repair(tc.x.v.data(), tc.seqs, tc.prep.v, 0.02, &rep).ok());
  ASSERT_EQ(rep.count[0], 20);
  tc.prep.repair = &rep;
  const Status st = attention_expcast(tc.prep, opt, &repaired);
  ASSERT_TRUE(st.ok()) << st.message();
  const int64_t n = static_cast<int64_t>(tc.exact.size());
  const ErrorMetrics e0 = compare(plain.out.data(), tc.exact.data(), n);
  const ErrorMetrics e1 = compare(repaired.out.data(), tc.exact.data(), n);
  std::printf("outlier V, rel L2 vs exact: no repair %.5f, repair (rho=0.02) %.5f; max abs %.4g -> %.4g\n",
              e0.rel_l2, e1.rel_l2, e0.max_abs, e1.max_abs);
  EXPECT_LT(e1.rel_l2, e0.rel_l2);
  // Repair rows touch only the numerator: the running max and the denominator are unchanged.
  EXPECT_EQ(repaired.rescales, plain.rescales);
  EXPECT_EQ(repaired.lse, plain.lse);
}

TEST(ReferenceRepair, ZeroResidualRowsChangeNothing) {
  OutlierCase tc;
  AttentionOptions opt;
  AttentionResult plain, repaired;
  ASSERT_TRUE(attention_expcast(tc.prep, opt, &plain).ok());

  // (a) Real selected rows with their codes zeroed: same tokens, same scores, nothing added.
  VRepair rep;
  ASSERT_TRUE(select_v_repair(tc.x.v.data(), tc.seqs, tc.prep.v, 0.05, &rep).ok());
  std::fill(rep.codes.begin(), rep.codes.end(), 0);
  tc.prep.repair = &rep;
  ASSERT_TRUE(attention_expcast(tc.prep, opt, &repaired).ok());
  EXPECT_EQ(repaired.out, plain.out);
  EXPECT_EQ(repaired.lse, plain.lse);

  // (b) V that E4M3 represents exactly (scale 1: amax 448, small integers elsewhere): every residual
  // is zero, so the selected rows encode to all-zero codes and the output is unchanged bit for bit.
  std::vector<float> v(tc.x.v.size());
  std::mt19937 rng(4);
  for (float& x : v) x = static_cast<float>(static_cast<int>(rng() % 31) - 15);
  const int H = tc.seqs.num_heads, D = tc.seqs.head_dim;
  for (int h = 0; h < H; ++h) v[(static_cast<size_t>(17) * H + h) * D] = 448.0f;
  PreparedInputs prep;
  ASSERT_TRUE(prepare_inputs(tc.x.q.data(), tc.x.k.data(), v.data(), tc.seqs, tc.seqs, &prep).ok());
  ASSERT_EQ(prep.v.scale_inv[0], 1.0f);
  AttentionResult plain_b, repaired_b;
  ASSERT_TRUE(attention_expcast(prep, opt, &plain_b).ok());
  VRepair zero;
  ASSERT_TRUE(select_v_repair(v.data(), tc.seqs, prep.v, 0.1, &zero).ok());
  ASSERT_EQ(zero.count[0], 102);
  EXPECT_TRUE(std::all_of(zero.codes.begin(), zero.codes.end(), [](uint8_t c) { return c == 0; }));
  // All energies tie at zero: the lowest indices win.
  for (int r = 0; r < zero.count[1]; ++r) EXPECT_EQ(zero.tokens[zero.offset[1] + r], r);
  prep.repair = &zero;
  ASSERT_TRUE(attention_expcast(prep, opt, &repaired_b).ok());
  EXPECT_EQ(repaired_b.out, plain_b.out);
  EXPECT_EQ(repaired_b.rescales, plain_b.rescales);
}

}  // namespace
}  // namespace openvc::reference
