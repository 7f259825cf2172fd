// VC-Attention baseline (numerics section 7): k-means grouping, permutation invariance, V-Smooth
// accuracy against plain per-head V quantization, and argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "openvc/reference.h"
#include "test_inputs.h"

namespace openvc::reference {
namespace {

// Clustered ("video-like") V: every token is one of `centres` per-head centre vectors plus small
// noise, on top of a strong per-channel offset, rounded to BF16. labels[t * H + h] = the centre.
std::vector<float> clustered_v(const Sequences& seqs, uint32_t seed, std::vector<int>* labels, int centres = 8,
                               float spread = 1.0f, float offset = 3.0f, float noise = 0.05f) {
  const int H = seqs.num_heads, D = seqs.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> cen(static_cast<size_t>(H) * centres * D), off(static_cast<size_t>(H) * D);
  for (float& x : cen) x = spread * gauss(rng);
  for (float& x : off) x = offset * gauss(rng);
  std::vector<float> v(static_cast<size_t>(seqs.total_tokens()) * H * D);
  if (labels) labels->assign(static_cast<size_t>(seqs.total_tokens()) * H, 0);
  for (int64_t t = 0; t < seqs.total_tokens(); ++t) {
    for (int h = 0; h < H; ++h) {
      const int c = static_cast<int>(rng() % centres);
      if (labels) (*labels)[t * H + h] = c;
      for (int d = 0; d < D; ++d) {
        const float x = cen[(static_cast<size_t>(h) * centres + c) * D + d] + off[static_cast<size_t>(h) * D + d] +
                        noise * gauss(rng);
        v[(t * H + h) * D + d] = round_to_bf16(x);
      }
    }
  }
  return v;
}

std::vector<int> identity_permutation(const Sequences& seqs) {
  const int max_len = seqs.max_length();
  std::vector<int> p(static_cast<size_t>(seqs.count()) * seqs.num_heads * max_len, -1);
  for (int s = 0; s < seqs.count(); ++s) {
    for (int h = 0; h < seqs.num_heads; ++h) {
      for (int i = 0; i < seqs.length(s); ++i) p[(static_cast<size_t>(s) * seqs.num_heads + h) * max_len + i] = i;
    }
  }
  return p;
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<double> bd(b.begin(), b.end());
  return compare(a.data(), bd.data(), static_cast<int64_t>(a.size())).rel_l2;
}

TEST(ReferenceVc, GroupingHandCheckedTiesAndShortSequences) {
  Sequences seqs;
  seqs.cu_seqlens = {0, 4, 7};  // lengths 4 and 3: fewer tokens than kVcClusters
  seqs.num_heads = 1;
  seqs.head_dim = 2;
  // Sequence 0: A B A B. Init centroids = tokens 0..3 = A B A B; tokens equal to A tie between
  // clusters 0 and 2 and take 0, B takes 1; clusters 2 and 3 end empty and keep their centroids.
  // Sequence 1: three distinct tokens, each its own cluster: identity, then -1 padding.
  const std::vector<float> v = {1, 0, 0, 1, 1, 0, 0, 1, /**/ 5, 5, -3, 2, 0.5f, 0.25f};
  std::vector<int> perm;
  ASSERT_TRUE(vc_grouping(v.data(), seqs, &perm).ok());
  EXPECT_EQ(perm, (std::vector<int>{0, 2, 1, 3, /**/ 0, 1, 2, -1}));
}

TEST(ReferenceVc, GroupingIsADeterministicPermutationThatGathersClusters) {
  Sequences seqs;
  seqs.cu_seqlens = {0, 40, 640, 1664};  // 40 (< 64 clusters), 600, 1024
  seqs.num_heads = 2;
  seqs.head_dim = 128;
  std::vector<int> labels;
  const std::vector<float> v = clustered_v(seqs, 31, &labels);
  std::vector<int> p1, p2;
  ASSERT_TRUE(vc_grouping(v.data(), seqs, &p1).ok());
  ASSERT_TRUE(vc_grouping(v.data(), seqs, &p2).ok());
  EXPECT_EQ(p1, p2);
  const int H = seqs.num_heads, max_len = seqs.max_length();
  ASSERT_EQ(p1.size(), static_cast<size_t>(seqs.count()) * H * max_len);
  for (int s = 0; s < seqs.count(); ++s) {
    const int len = seqs.length(s);
    for (int h = 0; h < H; ++h) {
      const int* p = p1.data() + (static_cast<size_t>(s) * H + h) * max_len;
      std::vector<int> sorted(p, p + len);
      std::sort(sorted.begin(), sorted.end());
      std::vector<int> iota(len);
      std::iota(iota.begin(), iota.end(), 0);
      EXPECT_EQ(sorted, iota) << "sequence " << s << " head " << h;
      for (int i = len; i < max_len; ++i) ASSERT_EQ(p[i], -1);
      if (len < kVcClusters) {
        // One cluster per token, each seeded with itself: the stable sort keeps the original order.
        EXPECT_EQ(std::vector<int>(p, p + len), iota);
        continue;
      }
      // Well-separated centres: each k-means cluster holds one centre's tokens, so along the
      // permutation the centre changes at most kVcClusters - 1 times (natural order: ~7/8 of tokens).
      int changes = 0, natural_changes = 0;
      for (int i = 1; i < len; ++i) {
        const int64_t t0 = seqs.cu_seqlens[s];
        changes += labels[(t0 + p[i]) * H + h] != labels[(t0 + p[i - 1]) * H + h];
        natural_changes += labels[(t0 + i) * H + h] != labels[(t0 + i - 1) * H + h];
      }
      EXPECT_LT(changes, kVcClusters) << "sequence " << s << " head " << h;
      EXPECT_GT(natural_changes, len / 2);
    }
  }
}

// One 1024-token case shared by the accuracy tests: video-like Q/K, clustered V.
class ReferenceVcAccuracy : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    seqs_ = new Sequences(Sequences::Batched(1, 1024, 2, 128));
    x_ = new testing::Qkv(testing::video_like(*seqs_, *seqs_, 41));
    x_->v = clustered_v(*seqs_, 42, nullptr);
    exact_ = new std::vector<double>;
    ASSERT_TRUE(attention_exact(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, 0.0f, false, exact_).ok());
  }
  static void TearDownTestSuite() {
    delete seqs_;
    delete x_;
    delete exact_;
  }
  static ErrorMetrics vs_exact(const AttentionResult& r) {
    return compare(r.out.data(), exact_->data(), static_cast<int64_t>(exact_->size()));
  }
  static Sequences* seqs_;
  static testing::Qkv* x_;
  static std::vector<double>* exact_;
};
Sequences* ReferenceVcAccuracy::seqs_ = nullptr;
testing::Qkv* ReferenceVcAccuracy::x_ = nullptr;
std::vector<double>* ReferenceVcAccuracy::exact_ = nullptr;

TEST_F(ReferenceVcAccuracy, IdentityAndKmeansPermutationsAgree) {
  std::vector<int> perm;
  ASSERT_TRUE(vc_grouping(x_->v.data(), *seqs_, &perm).ok());
  AttentionOptions opt;
  AttentionResult grouped, plain;
  Status st = attention_vc(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, perm, opt, &grouped);
  ASSERT_TRUE(st.ok()) << st.message();
  st = attention_vc(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, identity_permutation(*seqs_), opt,
                    &plain);
  ASSERT_TRUE(st.ok()) << st.message();
  const double diff = rel_diff(grouped.out, plain.out);
  const ErrorMetrics eg = vs_exact(grouped), ei = vs_exact(plain);
  std::printf("VC: rel L2 vs exact: k-means permutation %.5f (cos %.6f), identity %.5f; between them %.5f\n",
              eg.rel_l2, eg.cosine, ei.rel_l2, diff);
  // The permutation is exact math; what remains is quantization and traversal (running max) effects.
  EXPECT_LT(diff, 0.02);
  EXPECT_LT(eg.rel_l2, 0.03);
  EXPECT_LT(ei.rel_l2, 0.03);
  EXPECT_GT(eg.cosine, 0.999);

  // LSE: natural log, close to the exact one. Q/K quantization moves scores by a few percent and
  // ExpCast's beta = -0.35 biases l by about 2^(-0.35/8), i.e. lse by about -0.03.
  std::vector<double> out, lse;
  ASSERT_TRUE(
      attention_exact(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, 0.0f, false, &out, &lse).ok());
  ASSERT_EQ(grouped.lse.size(), lse.size());
  double worst = 0, mean = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    worst = std::max(worst, std::fabs(grouped.lse[i] - lse[i]));
    mean += (grouped.lse[i] - lse[i]) / static_cast<double>(lse.size());
  }
  std::printf("VC lse - exact lse: mean %.4f, worst |.| %.4f\n", mean, worst);
  EXPECT_LT(std::fabs(mean), 0.06);
  EXPECT_LT(worst, 0.3);
}

TEST_F(ReferenceVcAccuracy, IdentityPermutationHasExpCastScoresOfSection3) {
  // With the identity permutation and natural order, Q8, K8, the multipliers, the running max and
  // the codes are those of attention_expcast; only the V path differs. So the rescale count matches
  // exactly and lse (a function of the codes and the max only) matches to double rounding.
  AttentionOptions opt;
  opt.mid_window_blocks = kNaturalOrder;
  AttentionResult vc, ec;
  ASSERT_TRUE(attention_vc(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, identity_permutation(*seqs_),
                           opt, &vc).ok());
  PreparedInputs prep;
  ASSERT_TRUE(prepare_inputs(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, &prep).ok());
  ASSERT_TRUE(attention_expcast(prep, opt, &ec).ok());
  EXPECT_EQ(vc.rescales, ec.rescales);
  EXPECT_GT(vc.rescales, 0);
  ASSERT_EQ(vc.lse.size(), ec.lse.size());
  for (size_t i = 0; i < vc.lse.size(); ++i) ASSERT_NEAR(vc.lse[i], ec.lse[i], 1e-5) << "row " << i;
}

TEST_F(ReferenceVcAccuracy, VSmoothBeatsPerHeadVQuantization) {
  std::vector<int> perm;
  ASSERT_TRUE(vc_grouping(x_->v.data(), *seqs_, &perm).ok());
  AttentionOptions opt;
  opt.mid_window_blocks = kNaturalOrder;  // same traversal for both
  AttentionResult vc, ec;
  ASSERT_TRUE(attention_vc(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, perm, opt, &vc).ok());
  PreparedInputs prep;
  ASSERT_TRUE(prepare_inputs(x_->q.data(), x_->k.data(), x_->v.data(), *seqs_, *seqs_, &prep).ok());
  ASSERT_TRUE(attention_expcast(prep, opt, &ec).ok());
  const ErrorMetrics e_vc = vs_exact(vc), e_ec = vs_exact(ec);
  std::printf("clustered V, rel L2 vs exact: attention_vc %.5f (max abs %.4g), attention_expcast %.5f (max abs %.4g)\n",
              e_vc.rel_l2, e_vc.max_abs, e_ec.rel_l2, e_ec.max_abs);
  EXPECT_LT(e_vc.rel_l2, e_ec.rel_l2);
}

TEST(ReferenceVc, PackedUnequalSequencesAndPartialBlocks) {
  Sequences qs, ks;
  qs.cu_seqlens = {0, 100, 400};
  ks.cu_seqlens = {0, 200, 533};
  qs.num_heads = ks.num_heads = 2;
  qs.head_dim = ks.head_dim = 128;
  testing::Qkv x = testing::video_like(qs, ks, 51);
  x.v = clustered_v(ks, 52, nullptr);
  std::vector<int> perm;
  ASSERT_TRUE(vc_grouping(x.v.data(), ks, &perm).ok());
  AttentionOptions opt;
  AttentionResult r;
  const Status st = attention_vc(x.q.data(), x.k.data(), x.v.data(), qs, ks, perm, opt, &r);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<double> exact;
  ASSERT_TRUE(attention_exact(x.q.data(), x.k.data(), x.v.data(), qs, ks, 0.0f, false, &exact).ok());
  const ErrorMetrics e = compare(r.out.data(), exact.data(), static_cast<int64_t>(exact.size()));
  std::printf("packed VC: rel L2 vs exact %.5f\n", e.rel_l2);
  EXPECT_LT(e.rel_l2, 0.03);
  ASSERT_EQ(r.lse.size(), static_cast<size_t>(2 * 2 * 300));
  // Rows past sequence 0's 100 queries have no softmax.
  EXPECT_TRUE(std::isinf(r.lse[150]) && r.lse[150] < 0);
  EXPECT_TRUE(std::isfinite(r.lse[99]));
}

TEST(ReferenceVc, ConstantVIsReproducedExactly) {
  // Every token holds the same BF16 row: each block mean is that row exactly, the residual and its
  // codes are zero, and A / l = mu * l / l returns the row bit for bit.
  const Sequences seqs = Sequences::Batched(1, 300, 2, 128);
  testing::Qkv x = testing::video_like(seqs, seqs, 61);
  const int H = seqs.num_heads, D = seqs.head_dim;
  for (int64_t t = 0; t < seqs.total_tokens(); ++t) {
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < D; ++c) x.v[(t * H + h) * D + c] = round_to_bf16(0.37f * (c - 60) + h);
    }
  }
  std::vector<int> perm;
  ASSERT_TRUE(vc_grouping(x.v.data(), seqs, &perm).ok());
  AttentionResult r;
  ASSERT_TRUE(attention_vc(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, perm, AttentionOptions{}, &r).ok());
  for (int64_t t = 0; t < seqs.total_tokens(); ++t) {
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < D; ++c) ASSERT_EQ(r.out[(t * H + h) * D + c], x.v[(t * H + h) * D + c]);
    }
  }
}

TEST(ReferenceVc, RejectsCausalAndMalformedPermutations) {
  const Sequences seqs = Sequences::Batched(1, 200, 2, 128);
  const testing::Qkv x = testing::video_like(seqs, seqs, 71);
  std::vector<int> perm = identity_permutation(seqs);
  AttentionResult r;
  AttentionOptions causal;
  causal.causal = true;
  Status st = attention_vc(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, perm, causal, &r);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("causal"), std::string::npos) << st.message();

  const AttentionOptions opt;
  std::vector<int> short_perm(perm.begin(), perm.end() - 1);
  EXPECT_EQ(attention_vc(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, short_perm, opt, &r).code(),
            StatusCode::kInvalidArgument);
  std::vector<int> dup = perm;
  dup[5] = 4;
  st = attention_vc(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, dup, opt, &r);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("permutation"), std::string::npos) << st.message();
  std::vector<int> out_of_range = perm;
  out_of_range[200 + 3] = 200;  // head 1
  EXPECT_EQ(attention_vc(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, out_of_range, opt, &r).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(attention_vc(x.q.data(), x.k.data(), x.v.data(), seqs, seqs, perm, opt, &r).ok());
}

}  // namespace
}  // namespace openvc::reference
