// INT8 Q/K attention (numerics section 9): the reference against an independent reading of the
// contract (exact integer scores, per-row multipliers, shared ExpCast/traversal), and its error against
// exact FP64 attention compared with the E4M3 mode's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "openvc/reference.h"
#include "test_inputs.h"

namespace openvc::reference {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using testing::packed;

// N(0, scale) BF16 tokens, plus an optional per-(head, channel) offset of N(0, offset).
std::vector<float> normal_tokens(const Sequences& s, uint32_t seed, float scale, float offset = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int H = s.num_heads, D = s.head_dim;
  std::vector<float> mu(static_cast<size_t>(H) * D);
  for (float& m : mu) m = offset * g(rng);
  std::vector<float> x(static_cast<size_t>(s.total_tokens()) * H * D);
  for (size_t i = 0; i < x.size(); ++i) x[i] = round_to_bf16(scale * g(rng) + mu[i % mu.size()]);
  return x;
}

struct Row {
  std::vector<double> out;
  float lse = kNegInf;
  int64_t rescales = 0;
};

// Section 9 read directly for query row i of (sequence s, head h): int64 dot products of the codes,
// a = expcast_multiplier(tau, descale of row i, descale of key block b), then sections 3-5 unchanged.
// l and the max follow the reference's double/FP32 operations one for one, so lse must match bit for bit.
Row contract_row(const PreparedInputs& in, const AttentionOptions& opt, int s, int h, int i) {
  const int H = in.q_seqs.num_heads, D = in.q_seqs.head_dim;
  const int sq = in.q_seqs.length(s), sk = in.k_seqs.length(s);
  const float tau = opt.softmax_scale > 0 ? opt.softmax_scale : 1.0f / std::sqrt(static_cast<float>(D));
  const int8_t* qi = &in.q8.codes[(static_cast<size_t>(in.q_seqs.cu_seqlens[s] + i) * H + h) * D];
  std::vector<float> acc(sk);
  for (int j = 0; j < sk; ++j) {
    const int8_t* kj = &in.k8.codes[(static_cast<size_t>(in.k_seqs.cu_seqlens[s] + j) * H + h) * D];
    int64_t dot = 0;
    for (int c = 0; c < D; ++c) dot += static_cast<int64_t>(qi[c]) * kj[c];
    EXPECT_LE(std::llabs(dot), static_cast<int64_t>(D) * 127 * 127);
    acc[j] = static_cast<float>(dot);
    EXPECT_EQ(static_cast<int64_t>(acc[j]), dot);  // exact in FP32
  }
  const size_t g = static_cast<size_t>(s) * H + h;
  const float dq = in.q8.descale[g * in.q8.groups + i];  // the row's own scale
  auto visible = [&](int j) { return j < sk && !(opt.causal && j > i + (sk - sq)); };
  auto v8 = [&](int j, int c) {
    return static_cast<double>(e4m3_decode(in.v.codes[(static_cast<size_t>(in.k_seqs.cu_seqlens[s] + j) * H + h) * D + c]));
  };
  Row row;
  row.out.assign(D, 0.0);
  const int n = (sk + 127) / 128;
  if (n == 0) return row;
  const int r0 = i / opt.query_tile * opt.query_tile;
  const int r_last = std::min(r0 + opt.query_tile, sq) - 1;
  const int nv = opt.causal ? causal_visible_blocks(r_last, sq, sk, 128) : n;
  if (nv == 0) return row;
  const std::vector<int> order = opt.causal ? key_block_order(nv - 1, nv, opt.mid_window_blocks)
                                            : key_block_order(diagonal_block(r0, sq, sk, 128), n, opt.mid_window_blocks);
  float m = kNegInf;
  double l = 0;
  std::vector<double> A(D, 0.0);
  // Key j's multiplier: the descale of its (block, key group), group ((j mod 8) / 2) + 4 ((j mod 128) >= 64).
  auto a_of = [&](int j) {
    const int kg = (j % 8) / 2 + ((j % 128) >= 64 ? 4 : 0);
    return expcast_multiplier(tau, dq, in.k8.descale[g * in.k8.groups + j / 128 * 8 + kg]);
  };
  for (int b : order) {
    float t = kNegInf;
    for (int j = b * 128; j < std::min(sk, b * 128 + 128); ++j)
      if (visible(j)) t = std::max(t, acc[j] * a_of(j));
    if (t == kNegInf) continue;
    if (t > m) {
      if (std::isfinite(m)) {
        const float alpha = std::exp2((m - t) / 8.0f);
        l *= alpha;
        for (double& x : A) x *= alpha;
        ++row.rescales;
      }
      m = t;
    }
    for (int j = b * 128; j < std::min(sk, b * 128 + 128); ++j) {
      if (!visible(j)) continue;
      // exp2: keys 64-127 of each block take the polynomial code (exp2_poly_code), the others exp2_code.
      const uint8_t code = opt.p_format != PFormat::kExp2 ? expcast_code(acc[j], a_of(j), m)
                           : (j % 128) >= 64               ? exp2_poly_code(acc[j], a_of(j), m)
                                                           : exp2_code(acc[j], a_of(j), m);
      const float p = e4m3_decode(code);
      if (p == 0.0f) continue;
      l += p;
      for (int c = 0; c < D; ++c) A[c] += p * v8(j, c);
    }
  }
  if (!std::isfinite(m)) return row;
  for (int c = 0; c < D; ++c) row.out[c] = in.v.descale[g] * A[c] / l;
  row.lse = static_cast<float>(std::log(2.0) * (static_cast<double>(m) / 8.0) + std::log(l / 256.0));
  return row;
}

struct Problem {
  Sequences qs, ks;
  std::vector<float> q, k, v;
};

Problem normal_problem(std::vector<int> q_lens, std::vector<int> k_lens, int H, int D, uint32_t seed,
                       float qk_scale = 1.0f, float k_offset = 0.0f) {
  Problem p{packed(q_lens, H, D), packed(k_lens, H, D), {}, {}, {}};
  p.q = normal_tokens(p.qs, seed, qk_scale);
  p.k = normal_tokens(p.ks, seed + 1, qk_scale, k_offset);
  p.v = normal_tokens(p.ks, seed + 2, 1.0f);
  return p;
}

PreparedInputs prepare(const Problem& p, QkFormat format, bool smoothing) {
  PreparedInputs in;
  PrepareOptions po;
  po.qk_format = format;
  po.k_smoothing = smoothing;
  EXPECT_TRUE(prepare_inputs(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, po, &in).ok());
  return in;
}

// Every row, lse and the rescale count against the contract, over traversal flavours, causal,
// Sq != Sk and packed sequences of uneven lengths, with and without K smoothing.
TEST(Int8Attention, MatchesContractRowByRow) {
  struct Case {
    std::vector<int> q, k;
    int D;
    float scale;
  };
  int64_t total_rescales = 0, rows_checked = 0;
  for (const Case& cs : {Case{{300}, {300}, 64, 1.0f}, Case{{170}, {420}, 32, 2.0f}, Case{{420}, {170}, 32, 1.0f},
                         Case{{150, 290}, {333, 90}, 128, 4.0f}}) {
    const Problem p = normal_problem(cs.q, cs.k, 2, cs.D, 40 + cs.D, cs.scale, 0.5f);
    for (bool smoothing : {false, true}) {
      const PreparedInputs in = prepare(p, QkFormat::kInt8, smoothing);
      for (int wp = 0; wp < 4; ++wp) {   // w in {natural, 0, 4} with ExpCast, w = 4 with exp2 P
        const int w = wp == 0 ? kNaturalOrder : wp == 1 ? 0 : 4;
        const PFormat pf = wp == 3 ? PFormat::kExp2 : PFormat::kExpCast;
        for (bool causal : {false, true}) {
          AttentionOptions opt;
          opt.p_format = pf;
          opt.query_tile = 64;
          opt.mid_window_blocks = w;
          opt.causal = causal;
          AttentionResult r;
          ASSERT_TRUE(attention_expcast(in, opt, &r).ok());
          int64_t rescales = 0;
          const int max_q = p.qs.max_length();
          for (int s = 0; s < p.qs.count(); ++s)
            for (int h = 0; h < 2; ++h)
              for (int i = 0; i < p.qs.length(s); ++i) {
                const Row want = contract_row(in, opt, s, h, i);
                rescales += want.rescales;
                ++rows_checked;
                const float got_lse = r.lse[(static_cast<size_t>(s) * 2 + h) * max_q + i];
                ASSERT_EQ(std::memcmp(&got_lse, &want.lse, sizeof(float)), 0)
                    << "lse " << got_lse << " vs " << want.lse << ": seq " << s << " head " << h << " row " << i
                    << " w " << w << " causal " << causal << " smoothing " << smoothing << " exp2 " << (pf == PFormat::kExp2);
                const float* o = &r.out[(static_cast<size_t>(p.qs.cu_seqlens[s] + i) * 2 + h) * cs.D];
                for (int c = 0; c < cs.D; ++c)
                  ASSERT_NEAR(o[c], want.out[c], 1e-6 * (std::fabs(want.out[c]) + 1e-3))
                      << "seq " << s << " head " << h << " row " << i << " w " << w << " causal " << causal;
              }
          EXPECT_EQ(r.rescales, rescales) << "w " << w << " causal " << causal;
          total_rescales += rescales;
        }
      }
    }
  }
  EXPECT_GT(total_rescales, 0);
  EXPECT_GT(rows_checked, 20000);
}

// One key block, one query row, codes written by hand: the score is the integer dot product and the
// multiplier uses the row's own Q descale (not its 128-row block's).
TEST(Int8Attention, HandComputedScoresUseTheRowScale) {
  const Sequences qs = packed({2}, 1, 4), ks = packed({3}, 1, 4);
  // Q row 0 amax 127 (descale 1), row 1 amax 12.7 (descale 0.1); K amax 127 (descale 1).
  const std::vector<float> q = {127.0f, 0.0f, -1.0f, 2.0f, 12.7f, 0.0f, 0.0f, 0.0f};
  const std::vector<float> k = {1.0f, 2.0f, 3.0f, 4.0f, -127.0f, 0.0f, 5.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const std::vector<float> v = {1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f};
  PreparedInputs in;
  PrepareOptions po;
  po.qk_format = QkFormat::kInt8;
  ASSERT_TRUE(prepare_inputs(q.data(), k.data(), v.data(), qs, ks, po, &in).ok());
  EXPECT_EQ(in.q8.descale, (std::vector<float>{1.0f, 12.7f / 127.0f}));
  // Keys 0, 1 are key group 0 (amax 127), key 2 group 1 (zeros); groups 2..7 hold no key.
  EXPECT_EQ(in.k8.descale, (std::vector<float>{1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}));
  AttentionOptions opt;
  opt.softmax_scale = 0.01f;
  AttentionResult r;
  ASSERT_TRUE(attention_expcast(in, opt, &r).ok());
  // Row 0: acc = {127 - 3 + 8, -127 * 127 - 5, 0} = {132, -16134, 0}.
  const float acc0[3] = {132.0f, -16134.0f, 0.0f};
  const float acc1[3] = {127.0f, -16129.0f, 0.0f};  // row 1 codes {127, 0, 0, 0}
  for (int i = 0; i < 2; ++i) {
    const float* acc = i == 0 ? acc0 : acc1;
    const float a = expcast_multiplier(0.01f, in.q8.descale[i], 1.0f);
    const float m = std::max({acc[0] * a, acc[1] * a, acc[2] * a});
    double l = 0, o[3] = {0, 0, 0};
    for (int j = 0; j < 3; ++j) {
      const double pj = e4m3_decode(expcast_code(acc[j], a, m));
      l += pj;
      o[j] = pj;
    }
    // V row j is the unit vector e_j: code 448 (0x7E), descale 1 / 448.
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(r.out[i * 4 + j], in.v.descale[0] * 448.0 * o[j] / l, 1e-6);
    EXPECT_EQ(r.out[i * 4 + 3], 0.0f);
    EXPECT_EQ(expcast_code(acc[0], a, m), 120);
    EXPECT_NEAR(r.lse[i], std::log(2.0) * m / 8.0 + std::log(l / 256.0), 1e-6);
  }
}

// Scores of the prepared operands (descale_Q * descale_K * acc * tau, the multiplier's inputs) against
// exact FP64 scores of the original inputs; the error's row mean is removed (softmax ignores it, and
// K smoothing shifts each row by q_i . mean). Returns the RMS over (sequence 0, all heads, rows, keys).
double centered_score_error(const Problem& p, const PreparedInputs& in) {
  const int H = p.qs.num_heads, D = p.qs.head_dim, sq = p.qs.length(0), sk = p.ks.length(0);
  const double tau = 1.0 / std::sqrt(static_cast<double>(D));
  const bool int8 = in.qk_format == QkFormat::kInt8;
  auto qv = [&](int i, int h, int c) {
    const size_t e = (static_cast<size_t>(i) * H + h) * D + c;
    return int8 ? in.q8.descale[static_cast<size_t>(h) * in.q8.groups + i] * static_cast<double>(in.q8.codes[e])
                : in.q.descale[static_cast<size_t>(h) * in.q.max_blocks + i / 128] * static_cast<double>(e4m3_decode(in.q.codes[e]));
  };
  auto kv = [&](int j, int h, int c) {
    const size_t e = (static_cast<size_t>(j) * H + h) * D + c;
    return int8 ? in.k8.descale[static_cast<size_t>(h) * in.k8.groups + int8_key_descale_index(j)] *
                      static_cast<double>(in.k8.codes[e])
                : in.k.descale[static_cast<size_t>(h) * in.k.max_blocks + j / 128] * static_cast<double>(e4m3_decode(in.k.codes[e]));
  };
  std::vector<double> kd(static_cast<size_t>(sk) * D);
  double ss = 0;
  int64_t n = 0;
  for (int h = 0; h < H; ++h) {
    for (int j = 0; j < sk; ++j)
      for (int c = 0; c < D; ++c) kd[static_cast<size_t>(j) * D + c] = kv(j, h, c);
    std::vector<double> qd(D), err(sk);
    for (int i = 0; i < sq; ++i) {
      for (int c = 0; c < D; ++c) qd[c] = qv(i, h, c);
      double mean = 0;
      for (int j = 0; j < sk; ++j) {
        double s_hat = 0, s = 0;
        for (int c = 0; c < D; ++c) {
          s_hat += qd[c] * kd[static_cast<size_t>(j) * D + c];
          s += static_cast<double>(p.q[(static_cast<size_t>(i) * H + h) * D + c]) * p.k[(static_cast<size_t>(j) * H + h) * D + c];
        }
        err[j] = tau * (s_hat - s);
        mean += err[j];
      }
      mean /= sk;
      for (int j = 0; j < sk; ++j) ss += (err[j] - mean) * (err[j] - mean);
      n += sk;
    }
  }
  return std::sqrt(ss / n);
}

double output_error(const Problem& p, const PreparedInputs& in, bool causal, PFormat pf = PFormat::kExpCast) {
  AttentionOptions opt;
  opt.causal = causal;
  opt.p_format = pf;
  AttentionResult r;
  EXPECT_TRUE(attention_expcast(in, opt, &r).ok());
  std::vector<double> ref;
  EXPECT_TRUE(attention_exact(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, 0.0f, causal, &ref).ok());
  return compare(r.out.data(), ref.data(), static_cast<int64_t>(ref.size())).rel_l2;
}

// Sharp scores (q, k x4; video-like with q, k RMS 3): INT8 Q/K must beat E4M3 Q/K by a margin, with
// and without smoothing, on the output and on the scores.
TEST(Int8Attention, MoreAccurateThanE4M3OnSharpScores) {
  for (int which = 0; which < 2; ++which) {
    Problem p;
    if (which == 0) {
      p = normal_problem({512}, {512}, 2, 128, 7, 4.0f);
    } else {
      p.qs = Sequences::Batched(1, 512, 2, 128);
      p.ks = p.qs;
      testing::Qkv x = testing::video_like(p.qs, p.ks, 23, 16, 6, 0.35f, 3.0f);
      p.q = x.q;
      p.k = x.k;
      p.v = x.v;
    }
    const char* name = which == 0 ? "N(0,1) q,k x4" : "video-like q,k rms 3";
    const PreparedInputs e4 = prepare(p, QkFormat::kE4M3, false);
    const PreparedInputs i8 = prepare(p, QkFormat::kInt8, false);
    const PreparedInputs i8s = prepare(p, QkFormat::kInt8, true);
    for (bool causal : {false, true}) {
      const double oe = output_error(p, e4, causal), oi = output_error(p, i8, causal), ois = output_error(p, i8s, causal);
      std::printf("[ int8 vs e4m3 ] %s causal %d: output rel_l2 e4m3 %.5f int8 %.5f (%.2fx) int8+smooth %.5f (%.2fx)\n",
                  name, causal, oe, oi, oi / oe, ois, ois / oe);
      EXPECT_LT(oi, 0.6 * oe) << name << " causal " << causal;
      EXPECT_LT(ois, 0.6 * oe) << name << " causal " << causal;
    }
    const double se = centered_score_error(p, e4), si = centered_score_error(p, i8), sis = centered_score_error(p, i8s);
    std::printf("[ int8 vs e4m3 ] %s: centered score RMS error (nats) e4m3 %.5f int8 %.5f (%.2fx) int8+smooth %.5f\n",
                name, se, si, si / se, sis);
    EXPECT_LT(si, 0.5 * se) << name;
    EXPECT_LT(sis, 0.5 * se) << name;
  }
}

// K with a large per-channel mean (offset N(0, 6) per channel on N(0, 1) keys): smoothing removes it
// from the K scales, so its score error drops; on K without an offset it never costs much.
TEST(Int8Attention, SmoothingHelpsKWithLargeChannelMean) {
  for (float offset : {0.0f, 6.0f}) {
    const Problem p = normal_problem({512}, {512}, 2, 128, 17, 2.0f, offset);
    const PreparedInputs plain = prepare(p, QkFormat::kInt8, false);
    const PreparedInputs smooth = prepare(p, QkFormat::kInt8, true);
    const double sp = centered_score_error(p, plain), ss = centered_score_error(p, smooth);
    const double op = output_error(p, plain, false), os = output_error(p, smooth, false);
    std::printf("[ int8 smoothing ] K channel offset %.1f: score RMS error plain %.5f smooth %.5f (%.2fx); "
                "output rel_l2 plain %.5f smooth %.5f (%.2fx)\n", offset, sp, ss, ss / sp, op, os, os / op);
    EXPECT_LT(ss, 1.05 * sp) << "offset " << offset;
    EXPECT_LT(os, 1.05 * op) << "offset " << offset;
    if (offset > 0) {
      EXPECT_LT(ss, 0.6 * sp);
      EXPECT_LT(os, 0.9 * op);
    }
  }
}

// K smoothing with E4M3 Q/K (section 1): the same channel means, then E4M3 per 128-key block. A large
// per-channel K offset costs E4M3 too; smoothing removes it.
TEST(Int8Attention, E4M3SmoothingHelpsKWithLargeChannelMean) {
  for (float offset : {0.0f, 6.0f}) {
    const Problem p = normal_problem({512}, {512}, 2, 128, 19, 1.0f, offset);
    const PreparedInputs plain = prepare(p, QkFormat::kE4M3, false);
    const PreparedInputs smooth = prepare(p, QkFormat::kE4M3, true);
    ASSERT_EQ(smooth.k.mean.size(), 2u * 128u);
    EXPECT_EQ(plain.q.codes, smooth.q.codes);  // Q is never smoothed
    const double op = output_error(p, plain, false), os = output_error(p, smooth, false);
    std::printf("[ e4m3 smoothing ] K channel offset %.1f: output rel_l2 plain %.5f smooth %.5f (%.2fx)\n", offset, op,
                os, os / op);
    EXPECT_LT(os, 1.1 * op) << "offset " << offset;
    if (offset > 0) EXPECT_LT(os, 0.9 * op);
  }
}

// Rows past nothing, empty key sequences, causal rows that see no key: 0 output and -inf lse, as in
// the E4M3 mode; a zero V residual repair changes nothing in INT8 mode either.
TEST(Int8Attention, EmptyRowsAndZeroRepair) {
  const Problem p = normal_problem({200, 40, 0}, {100, 0, 30}, 2, 32, 3);
  const PreparedInputs in = prepare(p, QkFormat::kInt8, true);
  AttentionOptions opt;
  opt.causal = true;
  AttentionResult r;
  ASSERT_TRUE(attention_expcast(in, opt, &r).ok());
  std::vector<double> ref, lse_ref;
  ASSERT_TRUE(attention_exact(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, 0.0f, true, &ref, &lse_ref).ok());
  ASSERT_EQ(r.lse.size(), lse_ref.size());
  for (size_t i = 0; i < lse_ref.size(); ++i) {
    if (std::isinf(lse_ref[i])) {
      EXPECT_TRUE(std::isinf(r.lse[i]) && r.lse[i] < 0) << i;
    } else {
      EXPECT_NEAR(r.lse[i], lse_ref[i], 0.4) << i;
    }
  }
  for (size_t i = 0; i < ref.size(); ++i)
    if (ref[i] == 0.0) EXPECT_EQ(r.out[i], 0.0f) << i;
  const double err = compare(r.out.data(), ref.data(), static_cast<int64_t>(ref.size())).rel_l2;
  std::printf("[ int8 empty rows ] causal packed {200, 40, 0} x {100, 0, 30}: rel_l2 %.5f\n", err);
  EXPECT_LT(err, 0.08);

  VRepair rep;
  rep.tokens_per_head = 2;
  rep.count = {0, 2, 0, 0, 0, 0};
  rep.offset = {0, 0, 2, 2, 2, 2};
  rep.tokens = {3, 77};
  rep.codes.assign(2 * 32, 0);
  PreparedInputs with_rep = in;
  with_rep.repair = &rep;
  AttentionResult rr;
  ASSERT_TRUE(attention_expcast(with_rep, opt, &rr).ok());
  EXPECT_EQ(r.out, rr.out);
  EXPECT_EQ(r.lse, rr.lse);
}

// docs/numerics.md "Non-finite input" holds in INT8 mode too (with smoothing, whose means are per
// (sequence, head)): a NaN or Inf in Q, K or V changes no output of another (sequence, head), bit for bit.
TEST(Int8Attention, NonFiniteInputStaysInItsSequenceAndHead) {
  for (int which = 0; which < 3; ++which) {
    for (float value : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      Problem p = normal_problem({300, 200}, {300, 200}, 3, 32, 21);
      const AttentionResult clean = [&] {
        AttentionResult r;
        EXPECT_TRUE(attention_expcast(prepare(p, QkFormat::kInt8, true), AttentionOptions{}, &r).ok());
        return r;
      }();
      std::vector<float>& x = which == 0 ? p.q : which == 1 ? p.k : p.v;
      const int H = 3, D = 32, tok = 300 + 150;  // sequence 1, token 150, head 2
      x[(static_cast<size_t>(tok) * H + 2) * D + 5] = value;
      AttentionResult got;
      ASSERT_TRUE(attention_expcast(prepare(p, QkFormat::kInt8, true), AttentionOptions{}, &got).ok());
      int64_t changed = 0, nonfinite_q_row = 0;
      for (int t = 0; t < 500; ++t)
        for (int h = 0; h < H; ++h)
          for (int c = 0; c < D; ++c) {
            const size_t i = (static_cast<size_t>(t) * H + h) * D + c;
            if (t >= 300 && h == 2) {
              if (t == tok && !std::isfinite(got.out[i])) ++nonfinite_q_row;
              continue;  // the (sequence, head) that holds the value
            }
            changed += std::memcmp(&got.out[i], &clean.out[i], sizeof(float)) != 0;
          }
      EXPECT_EQ(changed, 0) << "input " << which << " value " << value;
      // A NaN in Q codes 0 (section 9): that row stays finite, unlike the E4M3 fast path.
      if (which == 0 && std::isnan(value)) EXPECT_EQ(nonfinite_q_row, 0);
    }
  }
}

// Huge scores (q, k near 3e3: row maxima past 2^23 code units) take section 3's one-ulp slack in INT8
// mode too: every row's maximum still codes 120, so outputs and lse stay finite.
TEST(Int8Attention, HugeScoresStayFinite) {
  Problem p = normal_problem({200}, {260}, 2, 64, 31, 3000.0f);
  // exp2 P too: here M is about 2^27.5..2^29 code units (M/8 ~2e7..6e7), so M's own rounding and the addend's move
  // the max key's x by up to ~24 code units (y on keys 0-63 by ~3 around 8): the MUFU half saturates at 448 at most,
  // the polynomial half is clipped at 120, and the max key's code stays far above 0, so l > 0 (never NaN).
  for (int variant = 0; variant < 4; ++variant) {
    const bool smoothing = variant % 2 == 1;
    AttentionOptions opt;
    opt.p_format = variant >= 2 ? PFormat::kExp2 : PFormat::kExpCast;
    const PreparedInputs in = prepare(p, QkFormat::kInt8, smoothing);
    AttentionResult r;
    ASSERT_TRUE(attention_expcast(in, opt, &r).ok());
    float max_m = 0;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 200; ++i) {
        const Row want = contract_row(in, opt, 0, h, i);
        ASSERT_TRUE(std::isfinite(want.lse));
        ASSERT_EQ(std::memcmp(&r.lse[h * 200 + i], &want.lse, sizeof(float)), 0) << "head " << h << " row " << i;
        max_m = std::max(max_m, r.lse[h * 200 + i]);
      }
    for (float o : r.out) ASSERT_TRUE(std::isfinite(o));
    EXPECT_GT(max_m * 8.0f / std::log(2.0f), 8388608.0f);  // lse ~ ln2 * M / 8: M past 2^23 code units
  }
}


TEST(Int8Attention, BadArgumentsNameTheArgument) {
  const Problem p = normal_problem({130}, {130}, 2, 16, 5);
  PreparedInputs in;
  PrepareOptions po;
  po.k_smoothing = true;  // E4M3 with smoothing: K means subtracted before the blocks
  ASSERT_TRUE(prepare_inputs(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, po, &in).ok());
  EXPECT_EQ(in.k.mean.size(), 2u * 16u);
  po = {};
  po.qk_format = static_cast<QkFormat>(7);
  EXPECT_NE(prepare_inputs(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, po, &in).message().find("opt.qk_format"),
            std::string::npos);

  const PreparedInputs good = prepare(p, QkFormat::kInt8, false);
  EXPECT_TRUE(good.q.codes.empty() && good.k.codes.empty());
  AttentionResult r;
  auto msg = [&](const PreparedInputs& x) {
    Status s = attention_expcast(x, AttentionOptions{}, &r);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    return s.message();
  };
  PreparedInputs bad = good;
  bad.q8.groups = 2;
  EXPECT_NE(msg(bad).find("in.q8.groups: expected 130, got 2"), std::string::npos) << msg(bad);
  bad = good;
  bad.k8.group_tokens = 1;
  EXPECT_NE(msg(bad).find("in.k8.group_tokens"), std::string::npos);
  bad = good;
  bad.k8.codes[17] = -128;
  EXPECT_NE(msg(bad).find("in.k8.codes[17]: -128 is not a code"), std::string::npos);
  bad = good;
  bad.q8.descale.pop_back();
  EXPECT_NE(msg(bad).find("in.q8.descale"), std::string::npos);
  bad = good;
  bad.qk_format = QkFormat::kE4M3;  // E4M3 operands are empty
  EXPECT_NE(msg(bad).find("in.q.max_blocks"), std::string::npos);
  bad = good;
  bad.qk_format = static_cast<QkFormat>(3);
  EXPECT_NE(msg(bad).find("in.qk_format"), std::string::npos);

  // The default options are today's E4M3 preparation, byte for byte.
  PreparedInputs a, b;
  ASSERT_TRUE(prepare_inputs(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, &a).ok());
  ASSERT_TRUE(prepare_inputs(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, PrepareOptions{}, &b).ok());
  EXPECT_EQ(a.qk_format, QkFormat::kE4M3);
  EXPECT_EQ(a.q.codes, b.q.codes);
  EXPECT_EQ(a.k.codes, b.k.codes);
  EXPECT_EQ(a.q.descale, b.q.descale);
  EXPECT_TRUE(a.q8.codes.empty() && a.k8.codes.empty());
}

// ---- P format exp2 (numerics "P format") ----------------------------------------------------------

// The option on the reference attention, against exact FP64 attention (INT8 Q/K + K smoothing, S = 512,
// H = 2, D = 128). Measured (this test's prints):
//   N(0, 1):          ExpCast 0.03846 -> exp2 0.03556 (0.925x; 0.03546 with every key's code exact)
//   q, k x4 dense:    ExpCast 0.05431 -> exp2 0.05457 (1.005x)
//   q, k x4 causal:   ExpCast 0.04850 -> exp2 0.04870 (1.004x)
// exp2 removes ExpCast's exponential error, which is what dominates on N(0, 1) (the S = 4096 emulation of
// the spec: 4.15% -> 3.82%); on q, k x4 the error is the scores' (Q/K quantization, sharp softmax) and the
// P format does not matter (the emulation: 5.37% both). So: exp2 clearly better on N(0, 1), within 2%
// on x4 (NOT lower there: the brief's expectation does not hold for this input at S = 512).
TEST(PFormat, Exp2MoreAccurateThanExpCastOnInt8) {
  const Problem n = normal_problem({512}, {512}, 2, 128, 9, 1.0f);
  const PreparedInputs n8 = prepare(n, QkFormat::kInt8, true);
  const double nec = output_error(n, n8, false, PFormat::kExpCast), ne2 = output_error(n, n8, false, PFormat::kExp2);
  std::printf("[ p_format ] int8+smooth N(0,1) S=512: output rel_l2 expcast %.5f exp2 %.5f (%.3fx)\n", nec, ne2,
              ne2 / nec);
  EXPECT_LT(ne2, 0.95 * nec);
  const Problem p = normal_problem({512}, {512}, 2, 128, 7, 4.0f);
  const PreparedInputs i8s = prepare(p, QkFormat::kInt8, true);
  for (bool causal : {false, true}) {
    const double ec = output_error(p, i8s, causal, PFormat::kExpCast);
    const double e2 = output_error(p, i8s, causal, PFormat::kExp2);
    std::printf("[ p_format ] int8+smooth q,k x4 S=512 causal %d: output rel_l2 expcast %.5f exp2 %.5f (%.3fx)\n", causal,
                ec, e2, e2 / ec);
    EXPECT_LT(e2, 1.02 * ec) << "causal " << causal;
  }
  // A bad p_format is named.
  AttentionOptions opt;
  opt.p_format = static_cast<PFormat>(5);
  AttentionResult r;
  const Status st = attention_expcast(i8s, opt, &r);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("opt.p_format"), std::string::npos) << st.message();
}

// The LSE against exact attention (flat N(0,1) rows, where ExpCast's code rounding biases l by about +0.9%,
// ~0.009 nats): INT8 Q/K is no further from the exact LSE than E4M3 Q/K (INT8's scores are closer).
TEST(Int8Attention, LseAgainstExactNoWorseThanE4M3) {
  const Problem p = normal_problem({700}, {900}, 3, 128, 31);
  std::vector<double> ref, lse_ref;
  ASSERT_TRUE(attention_exact(p.q.data(), p.k.data(), p.v.data(), p.qs, p.ks, 0.0f, false, &ref, &lse_ref).ok());
  double mean_abs[2];
  for (int f = 0; f < 2; ++f) {
    const PreparedInputs in = prepare(p, f == 0 ? QkFormat::kE4M3 : QkFormat::kInt8, false);
    AttentionOptions opt;
    AttentionResult r;
    ASSERT_TRUE(attention_expcast(in, opt, &r).ok());
    ASSERT_EQ(r.lse.size(), lse_ref.size());
    double s = 0;
    for (size_t i = 0; i < lse_ref.size(); ++i) s += std::fabs(r.lse[i] - lse_ref[i]);
    mean_abs[f] = s / double(lse_ref.size());
  }
  std::printf("LSE mean |err| vs exact: E4M3 %.5f, INT8 %.5f\n", mean_abs[0], mean_abs[1]);
  EXPECT_LE(mean_abs[1], 1.2 * mean_abs[0] + 2e-3);
}

}  // namespace
}  // namespace openvc::reference
