// Split tiles (numerics section 5, "Split tiles"): the CTA ranges' cuts (split_cuts) and the reference's parts,
// each an online softmax of its own from -inf, folded at the end, against a by-hand reading of the rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "attention_problem.h"
#include "openvc/reference.h"

namespace openvc::reference {
namespace {

using V = std::vector<int>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

TEST(SplitTiles, CutsOfAHandPlan) {
  // 4 tiles of 3 blocks on 5 CTAs: 12 units, q = 2, r = 2, ranges start at 0, 3, 6, 8, 10.
  EXPECT_EQ(split_cuts(0, 3, 4, 5), V{});
  EXPECT_EQ(split_cuts(1, 3, 4, 5), V{});
  EXPECT_EQ(split_cuts(2, 3, 4, 5), V{2});
  EXPECT_EQ(split_cuts(3, 3, 4, 5), V{1});
  // One CTA, or as many CTAs as tiles: no cut.
  for (int t = 0; t < 7; ++t) EXPECT_EQ(split_cuts(t, 5, 7, 1), V{}) << t;
  for (int t = 0; t < 7; ++t) EXPECT_EQ(split_cuts(t, 5, 7, 7), V{}) << t;
  // More CTAs than blocks of a tile: several cuts in one tile.
  EXPECT_EQ(split_cuts(0, 4, 1, 4), (V{1, 2, 3}));
  // 10 tiles of 4 blocks on 3 CTAs: the first 6 whole (two waves), the last 4 as 16 units in ranges of 6, 5, 5.
  for (int t = 0; t < 6; ++t) EXPECT_EQ(split_cuts(t, 4, 10, 3), V{}) << t;
  EXPECT_EQ(split_cuts(6, 4, 10, 3), V{});
  EXPECT_EQ(split_cuts(7, 4, 10, 3), V{2});
  EXPECT_EQ(split_cuts(8, 4, 10, 3), V{3});
  EXPECT_EQ(split_cuts(9, 4, 10, 3), V{});
  // Invalid arguments: no cut.
  EXPECT_EQ(split_cuts(0, 0, 4, 5), V{});
  EXPECT_EQ(split_cuts(4, 3, 4, 5), V{});
  EXPECT_EQ(split_cuts(0, 3, 4, 0), V{});
}

TEST(SplitTiles, CutsAreTheRangeStartsAndAtMostOneWhereRangesHoldATile) {
  std::mt19937 rng(20261204u);
  for (int trial = 0; trial < 300; ++trial) {
    const int tiles = 1 + int(rng() % 300), n = 1 + int(rng() % 40), ctas = 1 + int(rng() % 200);
    // Whole tiles first: all but the last one to two waves (none with fewer than two waves).
    int64_t head = 0;
    while (tiles - head >= 2 * ctas) head += ctas;
    const int64_t units = (tiles - head) * n, q = units / ctas, r = units % ctas;
    std::vector<int64_t> starts;   // every range start strictly inside a tile, as a unit of the whole sequence
    for (int64_t c = 1; c < ctas; ++c) {
      const int64_t b = c * q + std::min<int64_t>(c, r);
      if (b % n != 0) starts.push_back(head * n + b);
    }
    std::vector<int64_t> got;
    for (int t = 0; t < tiles; ++t) {
      const V cuts = split_cuts(t, n, tiles, ctas);
      ASSERT_TRUE(std::is_sorted(cuts.begin(), cuts.end()));
      for (int c : cuts) {
        ASSERT_GT(c, 0);
        ASSERT_LT(c, n);
        got.push_back(int64_t(t) * n + c);
      }
      // At least a tile per CTA (q >= n) cuts a tile at most once: the kernel's two-part combine.
      if (tiles >= ctas) ASSERT_LE(cuts.size(), 1u) << tiles << " " << n << " " << ctas;
      if (t < head) ASSERT_TRUE(cuts.empty()) << tiles << " " << n << " " << ctas;
    }
    // Ranges of zero units (q = 0) start where the one before ends: count each position once.
    starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
    ASSERT_EQ(got, starts) << tiles << " " << n << " " << ctas;
  }
}

double dq8(uint8_t c) { return e4m3_decode(c); }

// One query row of a split call by hand: its tile's key order cut at split_cuts, each part's zero-deadband
// running max from -inf, codes and weights as the contract; parts folded in order with FP32 factors
// 2^((m_part - M) / 8).
struct Out {
  std::vector<double> o;
  double lse;
};
Out by_hand_row(const PreparedInputs& in, int split_ctas, int s, int h, int i) {
  const int H = in.q_seqs.num_heads, D = in.q_seqs.head_dim;
  const int sq = in.q_seqs.length(s), sk = in.k_seqs.length(s);
  const float tau = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t g = static_cast<size_t>(s) * H + h;
  const uint8_t* qi = &in.q.codes[(static_cast<size_t>(in.q_seqs.cu_seqlens[s] + i) * H + h) * D];
  auto row_of = [&](const std::vector<uint8_t>& codes, int j) {
    return &codes[(static_cast<size_t>(in.k_seqs.cu_seqlens[s] + j) * H + h) * D];
  };
  const int n = (sk + 127) / 128, nq = (sq + 127) / 128, r0 = i / 128 * 128;
  const V order = key_block_order(diagonal_block(r0, sq, sk, 128), n, 4);
  const V cuts = split_cuts((int64_t(s) * H + h) * nq + i / 128, n, int64_t(in.q_seqs.count()) * H * nq, split_ctas);
  float M = kNegInf;
  double L = 0;
  std::vector<double> A(D, 0.0);
  size_t pos = 0;
  for (size_t part = 0; part <= cuts.size(); ++part) {
    const size_t end = part < cuts.size() ? size_t(cuts[part]) : order.size();
    float m = kNegInf;
    double l = 0;
    std::vector<double> a_part(D, 0.0);
    for (; pos < end; ++pos) {
      const int b = order[pos];
      const float a = expcast_multiplier(tau, in.q.descale[g * in.q.max_blocks + i / 128],
                                         in.k.descale[g * in.k.max_blocks + b]);
      std::vector<float> acc;
      float t = kNegInf;
      for (int j = b * 128; j < std::min(sk, b * 128 + 128); ++j) {
        double sum = 0;
        for (int c = 0; c < D; ++c) sum += dq8(qi[c]) * dq8(row_of(in.k.codes, j)[c]);
        acc.push_back(static_cast<float>(sum));
        t = std::max(t, acc.back() * a);
      }
      if (t > m) {
        if (std::isfinite(m)) {
          const double alpha = std::exp2((m - t) / 8.0f);
          l *= alpha;
          for (double& x : a_part) x *= alpha;
        }
        m = t;
      }
      for (int j = b * 128; j < std::min(sk, b * 128 + 128); ++j) {
        const double p = dq8(expcast_code(acc[j - b * 128], a, m));
        l += p;
        for (int c = 0; c < D; ++c) a_part[c] += p * dq8(row_of(in.v.codes, j)[c]);
      }
    }
    if (!std::isfinite(M)) {
      M = m, L = l, A = a_part;
      continue;
    }
    const float top = std::max(M, m);
    const double x = std::exp2((M - top) / 8.0f), y = std::exp2((m - top) / 8.0f);
    L = L * x + l * y;
    for (int c = 0; c < D; ++c) A[c] = A[c] * x + a_part[c] * y;
    M = top;
  }
  Out out{std::vector<double>(D), std::log(2.0) * (M / 8.0) + std::log(L / 256.0)};
  for (int c = 0; c < D; ++c) out.o[c] = in.v.descale[g] * A[c] / L;
  return out;
}

TEST(SplitTiles, ReferenceMatchesTheRuleByHand) {
  // 2 sequences x 2 heads x 3 query tiles (300 rows) of 5 key blocks (600 keys, the last partial): 12 tiles,
  // 60 units; 7 CTAs cut 6 of the tiles (ranges of 8-9 units), 25 CTAs cut tiles two or three times.
  Problem p = make_problem({300, 300}, {600, 600}, 2, 64, 7);
  for (int ctas : {7, 25}) {
    AttentionOptions opt;
    opt.split_ctas = ctas;
    AttentionResult r;
    ASSERT_TRUE(attention_expcast(p.in, opt, &r).ok());
    int cut_rows = 0;
    for (int s = 0; s < 2; ++s)
      for (int h = 0; h < 2; ++h)
        for (int i : {0, 5, 127, 128, 200, 256, 299}) {
          if (!split_cuts((int64_t(s) * 2 + h) * 3 + i / 128, 5, 12, ctas).empty()) ++cut_rows;
          const Out want = by_hand_row(p.in, ctas, s, h, i);
          const float* got = &r.out[(static_cast<size_t>(p.qs.cu_seqlens[s] + i) * 2 + h) * 64];
          for (int c = 0; c < 64; ++c)
            ASSERT_NEAR(got[c], want.o[c], 1e-5 * (1.0 + std::fabs(want.o[c]))) << ctas << " " << s << " " << h << " " << i;
          EXPECT_NEAR(r.lse[(static_cast<size_t>(s) * 2 + h) * 300 + i], want.lse, 1e-5) << ctas << " " << i;
        }
    EXPECT_GT(cut_rows, 0) << ctas;
  }
}

TEST(SplitTiles, UncutTilesKeepTheirBitsAndCutOnesStayCloseToExact) {
  Problem p = make_problem({300, 300}, {600, 600}, 2, 64, 11);
  AttentionResult whole, one_cta, split;
  ASSERT_TRUE(attention_expcast(p.in, AttentionOptions{}, &whole).ok());
  AttentionOptions opt;
  opt.split_ctas = 1;
  ASSERT_TRUE(attention_expcast(p.in, opt, &one_cta).ok());
  EXPECT_EQ(one_cta.out, whole.out);
  EXPECT_EQ(one_cta.lse, whole.lse);
  opt.split_ctas = 7;
  ASSERT_TRUE(attention_expcast(p.in, opt, &split).ok());
  std::vector<double> exact;
  ASSERT_TRUE(attention_exact(p.x.q.data(), p.x.k.data(), p.x.v.data(), p.qs, p.ks, 0.0f, false, &exact).ok());
  EXPECT_LT(compare(split.out.data(), exact.data(), int64_t(exact.size())).rel_l2, 0.06);
  // Codes against a part's own (lower or equal) max are no coarser: the split is as close as the whole.
  const double e_whole = compare(whole.out.data(), exact.data(), int64_t(exact.size())).rel_l2;
  const double e_split = compare(split.out.data(), exact.data(), int64_t(exact.size())).rel_l2;
  EXPECT_LT(e_split, 1.1 * e_whole);
  // Tiles without a cut are computed exactly as before.
  const int64_t H = 2, D = 64;
  for (int s = 0; s < 2; ++s)
    for (int h = 0; h < 2; ++h)
      for (int qt = 0; qt < 3; ++qt) {
        if (!split_cuts((s * H + h) * 3 + qt, 5, 12, 7).empty()) continue;
        for (int i = qt * 128; i < std::min(300, qt * 128 + 128); ++i)
          for (int c = 0; c < D; ++c) {
            const size_t k = (static_cast<size_t>(p.qs.cu_seqlens[s] + i) * H + h) * D + c;
            ASSERT_EQ(split.out[k], whole.out[k]) << s << " " << h << " " << i;
          }
      }
}

TEST(SplitTiles, RefusedWhereThePlanDoesNotApply) {
  Problem p = make_problem({300, 200}, {600, 600}, 2, 64, 3);
  AttentionOptions opt;
  opt.split_ctas = 7;
  AttentionResult r;
  Status st = attention_expcast(p.in, opt, &r);   // sequences of different lengths
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("split_ctas"), std::string::npos) << st.message();
  Problem b = make_problem({300, 300}, {600, 600}, 2, 64, 3);
  opt.causal = true;
  st = attention_expcast(b.in, opt, &r);
  EXPECT_NE(st.message().find("split_ctas"), std::string::npos) << st.message();
  opt.causal = false;
  opt.split_ctas = -1;
  st = attention_expcast(b.in, opt, &r);
  EXPECT_NE(st.message().find("split_ctas"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace openvc::reference
