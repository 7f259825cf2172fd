// The V rounding bias correction (numerics section 4, "V rounding bias"): prepare_fp8's v_bias equals the
// reference's bit for bit (batched, packed uneven with an empty sequence, key counts, grouped K/V heads, head dim 64
// and 128, either Q/K format; the workspace and output poisoned first); the one call with the correction (INT8 Q/K,
// ExpCast or exp2 P, plain, causal, chunked causal, packed, key counts, head dim 64) writes the call without it plus
// v_bias per channel (rows that see no key stay 0), and with uniform attention (q = 0) it gives the mean of V, which the
// uncorrected call misses by V's mean rounding error; the argument rules (E4M3 calls refused).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "openvc/call.h"
#include "openvc/general.h"
#include "openvc/reference.h"

namespace {

using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::upload;

struct Case {
  int b = 2, sq = 300, sk = 700, h = 4, hk = 4, d = 128;
  std::vector<int> cu_k;     // packed key offsets (empty: batched); queries then use the same offsets
  std::vector<int> counts;   // key counts (empty: none)
  openvc::QkFormat fmt = openvc::QkFormat::kInt8;   // the correction's kernels are INT8 modes (mode.h)
  bool exp2 = false;         // p_format kExp2
  bool causal = false;
  int chunk = 1;             // causal_chunk
  int nseq() const { return cu_k.empty() ? b : int(cu_k.size()) - 1; }
  int64_t rows_k() const { return cu_k.empty() ? int64_t(b) * sk : cu_k.back(); }
  int64_t rows_q() const { return cu_k.empty() ? int64_t(b) * sq : cu_k.back(); }
};

std::vector<__nv_bfloat16> random_bf16(size_t n, unsigned seed, float scale, float channel_offset, int d) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> offset(d);
  for (auto& o : offset) o = channel_offset * dist(rng);
  std::vector<__nv_bfloat16> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = __float2bfloat16(offset[i % d] + scale * dist(rng));
  return x;
}

struct Device {
  DevBuf q, k, v, out, cu, counts;
  std::vector<__nv_bfloat16> hq, hk, hv;
  Device(const Case& c, unsigned seed, float q_scale = 1.0f)
      : q(c.rows_q() * c.h * c.d * 2), k(c.rows_k() * c.hk * c.d * 2), v(c.rows_k() * c.hk * c.d * 2),
        out(c.rows_q() * c.h * c.d * 2), cu(c.cu_k.size() * 4 + 4), counts(c.counts.size() * 4 + 4) {
    hq = random_bf16(c.rows_q() * c.h * c.d, seed, q_scale, 0.0f, c.d);
    hk = random_bf16(c.rows_k() * c.hk * c.d, seed + 1, 1.0f, 0.0f, c.d);
    // V: a constant per (sequence, K/V head, channel) off the E4M3 grid plus a little noise, so each channel's rounding
    // errors share a sign and the bias is several BF16 steps of the output, different for every sequence and head.
    std::mt19937 rng(seed + 2);
    std::uniform_real_distribution<float> noise(-0.002f, 0.002f);
    hv.resize(c.rows_k() * c.hk * c.d);
    for (int64_t t = 0; t < c.rows_k(); ++t) {
      int s = 0;
      if (c.cu_k.empty()) s = int(t / c.sk);
      else
        while (s + 1 < int(c.cu_k.size()) - 1 && t >= c.cu_k[s + 1]) ++s;
      for (int h = 0; h < c.hk; ++h)
        for (int e = 0; e < c.d; ++e)
          hv[(t * c.hk + h) * c.d + e] = __float2bfloat16(1.0f + 0.0123f * e + 0.37f * h + 0.11f * s + noise(rng));
    }
    upload(q.p, hq), upload(k.p, hk), upload(v.p, hv);
    if (!c.cu_k.empty()) upload(cu.p, c.cu_k);
    if (!c.counts.empty()) upload(counts.p, c.counts);
  }
};

openvc::AttentionCall call_of(const Case& c, const Device& dv, bool correction) {
  openvc::AttentionCall a;
  a.heads = c.h, a.kv_heads = c.hk, a.head_dim = c.d, a.qk_format = c.fmt, a.causal = c.causal;
  a.p_format = c.exp2 ? openvc::PFormat::kExp2 : openvc::PFormat::kExpCast, a.causal_chunk = c.chunk;
  a.batch = c.b, a.seqlen_q = c.sq, a.seqlen_k = c.sk;
  a.q = {dv.q.p, int64_t(c.sq) * c.h * c.d, int64_t(c.h) * c.d, c.d};
  a.k = {dv.k.p, int64_t(c.sk) * c.hk * c.d, int64_t(c.hk) * c.d, c.d};
  a.v = {dv.v.p, int64_t(c.sk) * c.hk * c.d, int64_t(c.hk) * c.d, c.d};
  if (!c.cu_k.empty()) {
    a.cu_seqlens_q = a.cu_seqlens_k = dv.cu.as<int>(), a.num_seqs = c.nseq();
    a.max_seqlen_q = a.max_seqlen_k = c.sk, a.total_q = a.total_k = c.rows_k();
  }
  if (!c.counts.empty()) a.seqused_k = dv.counts.as<int>();
  a.out = dv.out.p, a.out_stride_batch = int64_t(c.sq) * c.h * c.d, a.out_stride_seq = int64_t(c.h) * c.d;
  a.out_stride_head = c.d;
  a.v_bias_correction = correction;
  return a;
}

// prepare_fp8's V descales and bias ([G, Hk] and [G, Hk, D]).
void prepare_v(const Case& c, const Device& dv, std::vector<float>* v_descale, std::vector<float>* bias) {
  const openvc::AttentionCall a = call_of(c, dv, true);
  const int64_t g = c.nseq(), sq = c.cu_k.empty() ? c.sq : c.sk, sk = c.sk;
  const bool int8 = c.fmt == openvc::QkFormat::kInt8;
  DevBuf qc(c.rows_q() * c.h * c.d), kc(c.rows_k() * c.hk * c.d);
  DevBuf qs(g * c.h * (int8 ? sq : openvc::num_quant_blocks(sq)) * 4);
  DevBuf ks(g * c.hk * openvc::num_quant_blocks(sk) * (int8 ? 8 : 1) * 4);
  DevBuf vp(g * c.hk * c.d * openvc::packed_seqlen_k(sk)), vs(g * c.hk * 4), vb(g * c.hk * c.d * 4);
  DevBuf ws(openvc::prepare_workspace_bytes(int(g), c.h, int(sk), false, /*v_bias=*/true));
  CUDA_OK(cudaMemset(vb.p, 0xFF, vb.bytes));   // NaN: every value must be written
  CUDA_OK(cudaMemset(ws.p, 0x5A, ws.bytes));   // the sums and counts must be zeroed by the preparation itself
  openvc::PrepareParams p;
  p.qk_format = c.fmt, p.heads = c.h, p.kv_heads = c.hk, p.head_dim = c.d;
  p.batch = c.b, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.q = a.q, p.k = a.k, p.v = a.v;
  if (!c.cu_k.empty()) {
    p.cu_seqlens_q = p.cu_seqlens_k = a.cu_seqlens_k, p.num_seqs = a.num_seqs;
    p.max_seqlen_q = p.max_seqlen_k = c.sk, p.total_q = p.total_k = c.rows_k();
  }
  p.seqused_k = a.seqused_k;
  p.q_codes = qc.as<uint8_t>(), p.q_descale = qs.as<float>(), p.k_codes = kc.as<uint8_t>();
  p.k_descale = ks.as<float>(), p.v_packed = vp.as<uint8_t>(), p.v_descale = vs.as<float>();
  p.workspace = ws.p, p.workspace_bytes = ws.bytes;
  p.v_bias = vb.as<float>();
  const openvc::Status st = openvc::prepare_fp8(p, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  *v_descale = download<float>(vs.p, g * c.hk);
  *bias = download<float>(vb.p, g * c.hk * c.d);
}

// The reference's V bias: each sequence's valid keys (a key count shortens it).
std::vector<float> reference_bias(const Case& c, const Device& dv) {
  openvc::reference::Sequences seqs;
  seqs.num_heads = c.hk, seqs.head_dim = c.d, seqs.cu_seqlens = {0};
  std::vector<float> v;
  for (int s = 0; s < c.nseq(); ++s) {
    const int64_t start = c.cu_k.empty() ? int64_t(s) * c.sk : c.cu_k[s];
    int64_t len = c.cu_k.empty() ? c.sk : c.cu_k[s + 1] - c.cu_k[s];
    if (!c.cu_k.empty()) len = std::min<int64_t>(len, openvc::packed_seqlen_k(c.sk));   // max_seqlen_k's blocks
    if (!c.counts.empty()) len = std::min<int64_t>(len, std::max(c.counts[s], 0));
    for (int64_t t = start; t < start + len; ++t)
      for (int e = 0; e < c.hk * c.d; ++e) v.push_back(__bfloat162float(dv.hv[t * c.hk * c.d + e]));
    seqs.cu_seqlens.push_back(seqs.cu_seqlens.back() + int(len));
  }
  openvc::reference::HeadQuantized vq;
  EXPECT_TRUE(openvc::reference::quantize_heads(v.data(), seqs, &vq).ok());
  return vq.bias;
}

int keys_of(const Case& c, int s) {
  int n = c.cu_k.empty() ? c.sk : c.cu_k[s + 1] - c.cu_k[s];
  if (!c.counts.empty()) n = std::min(n, std::max(c.counts[s], 0));
  return n;
}

std::vector<float> run(const openvc::AttentionCall& a, int64_t n) {
  DevBuf ws(openvc::attention_workspace_bytes(a));
  EXPECT_EQ(cudaSuccess, cudaMemset(a.out, 0xFF, size_t(n) * 2));   // BF16 NaN poison
  const openvc::Status st = openvc::attention(a, ws.p, ws.bytes, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  const std::vector<__nv_bfloat16> o = download<__nv_bfloat16>(a.out, n);
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) f[i] = __bfloat162float(o[i]);
  return f;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back(Case{});
  Case d64;
  d64.d = 64, d64.sk = 513, d64.exp2 = true;
  out.push_back(d64);
  Case causal;
  causal.causal = true;
  out.push_back(causal);
  Case chunked;
  chunked.causal = true, chunked.chunk = 96, chunked.exp2 = true;
  out.push_back(chunked);
  Case gqa;
  gqa.h = 6, gqa.hk = 2, gqa.sk = 1000, gqa.exp2 = true;
  out.push_back(gqa);
  Case packed;
  packed.cu_k = {0, 260, 260, 1153, 1201}, packed.sk = 893, packed.causal = true;
  out.push_back(packed);
  Case packed64;
  packed64.cu_k = {0, 700, 701, 1500}, packed64.sk = 799, packed64.d = 64, packed64.exp2 = true;
  out.push_back(packed64);
  Case counts;
  counts.counts = {650, 37};
  out.push_back(counts);
  Case e4m3;   // the preparation's bias does not depend on the Q/K format
  e4m3.fmt = openvc::QkFormat::kE4M3;
  out.push_back(e4m3);
  Case tall;   // causal with more queries than keys: rows 0..399 see no key and must stay 0 in a tile that has keys
  tall.sq = 700, tall.sk = 300, tall.causal = true, tall.exp2 = true;
  out.push_back(tall);
  Case counted;   // causal with key counts: the second entry's first 263 rows see none of its 37 keys
  counted.causal = true, counted.counts = {650, 37};
  out.push_back(counted);
  Case cut;   // a packed sequence longer than max_seqlen_k (200): attention and the bias take its first 256 keys
  cut.cu_k = {0, 300, 400}, cut.sk = 200;
  out.push_back(cut);
  return out;
}

TEST(Sm90VBias, BiasEqualsTheReference) {
  if (!openvc::testing::missing_sm90().empty()) GTEST_SKIP() << openvc::testing::missing_sm90();
  int n = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(++n);
    Device dv(c, 100 + n);
    std::vector<float> descale, bias;
    prepare_v(c, dv, &descale, &bias);
    const std::vector<float> ref = reference_bias(c, dv);
    ASSERT_EQ(ref.size(), bias.size());
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(ref[i], bias[i]) << "bias " << i;   // NaN fails too
    bool nonzero = false;
    for (float x : bias) nonzero |= x != 0.0f;
    EXPECT_TRUE(nonzero);
  }
}

// With the correction, each output is the uncorrected one plus v_bias (BF16 roundings of both apart); rows that see
// no key stay 0.
TEST(Sm90VBias, OutputIsTheCallWithoutItPlusTheMeanResidual) {
  if (!openvc::testing::missing_sm90().empty()) GTEST_SKIP() << openvc::testing::missing_sm90();
  int n = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(++n);
    if (c.fmt != openvc::QkFormat::kInt8) continue;   // refused below (Sm90VBiasArgs)
    bool cut = false;   // rows past max_seqlen_q are not attended (left as poisoned), so that case checks its bias only
    for (size_t s = 0; s + 1 < c.cu_k.size(); ++s) cut |= c.cu_k[s + 1] - c.cu_k[s] > c.sk;
    if (cut) continue;
    Device dv(c, 200 + n);
    std::vector<float> descale, vbias;
    prepare_v(c, dv, &descale, &vbias);
    const int64_t count = c.rows_q() * c.h * c.d;
    const std::vector<float> plain = run(call_of(c, dv, false), count);
    const std::vector<float> fixed = run(call_of(c, dv, true), count);
    const int group = c.h / c.hk;
    double moved = 0.0, seen = 0.0;
    for (int s = 0; s < c.nseq(); ++s) {
      const int64_t r0 = c.cu_k.empty() ? int64_t(s) * c.sq : c.cu_k[s];
      const int64_t rows = c.cu_k.empty() ? c.sq : c.cu_k[s + 1] - c.cu_k[s];
      const int keys = keys_of(c, s);
      for (int64_t r = r0; r < r0 + rows; ++r)
        for (int h = 0; h < c.h; ++h) {
          const int64_t kvh = int64_t(s) * c.hk + h / group;
          const bool sees_keys = keys > 0 && !(c.causal && r - r0 + (keys - rows) < 0);
          for (int e = 0; e < c.d; ++e) {
            const int64_t i = (r * c.h + h) * c.d + e;
            const double bias = sees_keys ? double(vbias[kvh * c.d + e]) : 0.0;
            const float mag = std::max(std::max(std::fabs(plain[i]), std::fabs(fixed[i])), 1e-30f);
            const double tol = 2.0 * std::ldexp(1.0, std::ilogb(mag) - 7) + 1e-6;   // two BF16 steps
            ASSERT_NEAR(fixed[i], plain[i] + bias, tol + std::fabs(bias) * 1e-3) << "row " << r << " head " << h;
            moved += std::fabs(bias);
            seen += std::fabs(fixed[i] - plain[i]);
          }
        }
    }
    EXPECT_GT(moved, 0.0);
    EXPECT_GT(seen, 0.5 * moved);   // the outputs did move by about the bias (a no-op epilogue moves nothing)
  }
}

// Uniform attention (q = 0: every score 0, every P code 120): the corrected output is the mean of V's keys, which the
// uncorrected one misses by the mean of V's rounding errors. V is a per-channel constant off the E4M3 grid plus a
// little noise, so its rounding errors share a sign and the uncorrected mean is visibly off.
TEST(Sm90VBias, UniformAttentionGivesTheMeanOfV) {
  if (!openvc::testing::missing_sm90().empty()) GTEST_SKIP() << openvc::testing::missing_sm90();
  Case c;
  c.b = 1, c.sq = 130, c.sk = 2000, c.h = 2, c.hk = 2;
  Device dv(c, 7, /*q_scale=*/0.0f);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> noise(-0.002f, 0.002f);
  for (size_t i = 0; i < dv.hv.size(); ++i) dv.hv[i] = __float2bfloat16(1.0f + 0.0123f * float(i % c.d) + noise(rng));
  upload(dv.v.p, dv.hv);
  const int64_t count = c.rows_q() * c.h * c.d;
  const std::vector<float> plain = run(call_of(c, dv, false), count);
  const std::vector<float> fixed = run(call_of(c, dv, true), count);
  double err_plain = 0.0, err_fixed = 0.0, norm = 0.0;
  for (int h = 0; h < c.h; ++h)
    for (int e = 0; e < c.d; ++e) {
      double mean = 0.0;
      for (int j = 0; j < c.sk; ++j) mean += __bfloat162float(dv.hv[(size_t(j) * c.hk + h) * c.d + e]);
      mean /= c.sk;
      for (int r = 0; r < c.sq; ++r) {
        const size_t i = (size_t(r) * c.h + h) * c.d + e;
        err_plain += (plain[i] - mean) * (plain[i] - mean);
        err_fixed += (fixed[i] - mean) * (fixed[i] - mean);
        norm += mean * mean;
        // The mean is exact up to the FP32 sums and the BF16 output rounding.
        ASSERT_NEAR(fixed[i], mean, std::fabs(mean) * 6e-3) << "row " << r << " head " << h << " channel " << e;
      }
    }
  EXPECT_LT(err_fixed, 0.25 * err_plain) << std::sqrt(err_fixed / norm) << " vs " << std::sqrt(err_plain / norm);
}

TEST(Sm90VBiasArgs, RefusedWhereItDoesNotApply) {
  if (!openvc::testing::missing_sm90().empty()) GTEST_SKIP() << openvc::testing::missing_sm90();
  const Case c;
  DevBuf rs(size_t(c.nseq()) * c.hk * c.d * 4 + 16);
  // V block descales: refused naming the field.
  openvc::AttentionParams a;
  a.in.v_bias = rs.as<float>();
  a.v_descale_per_block = true;
  a.in.batch = 1, a.in.seqlen_q = 128, a.in.seqlen_k = 128, a.in.heads = 1;
  openvc::Status st = openvc::attention_fp8(a, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("v_bias"), std::string::npos) << st.message();
  // Misaligned.
  a.v_descale_per_block = false;
  a.in.v_bias = reinterpret_cast<const float*>(rs.as<char>() + 4);
  st = openvc::attention_fp8(a, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("v_bias"), std::string::npos) << st.message();
  // Not written by a KV cache's preparation.
  {
    Device dv(c, 3);
    openvc::AttentionCall call = call_of(c, dv, true);
    DevBuf kc(c.rows_k() * c.hk * c.d), ks(c.nseq() * c.hk * 8 * 4), vp(c.nseq() * c.hk * c.d * 1024), vs(c.nseq() * c.hk * 4);
    DevBuf ws(openvc::prepare_workspace_bytes(c.nseq(), c.h, c.sk, false, true));
    openvc::PrepareParams p;
    p.heads = c.h, p.head_dim = c.d, p.batch = c.b, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.k = call.k, p.v = call.v;
    p.k_codes = kc.as<uint8_t>(), p.k_descale = ks.as<float>(), p.v_packed = vp.as<uint8_t>(), p.v_descale = vs.as<float>();
    p.workspace = ws.p, p.workspace_bytes = ws.bytes, p.k_codes_rows = c.sk;
    p.v_bias = rs.as<float>();
    st = openvc::prepare_fp8(p, nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("v_bias"), std::string::npos) << st.message();
  }
  // E4M3 Q/K: no kernel has the correction (mode.h), refused naming the field; the one call names its own.
  a.in.v_bias = rs.as<float>();
  a.in.qk_format = openvc::QkFormat::kE4M3;
  st = openvc::attention_fp8(a, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kUnsupported) << st.message();
  EXPECT_NE(st.message().find("in.v_bias"), std::string::npos) << st.message();
  {
    Case e;
    e.fmt = openvc::QkFormat::kE4M3;
    Device dv(e, 4);
    const openvc::AttentionCall call = call_of(e, dv, true);
    DevBuf ws(openvc::attention_workspace_bytes(call));
    st = openvc::attention(call, ws.p, ws.bytes, nullptr);
    EXPECT_EQ(st.code(), openvc::StatusCode::kUnsupported) << st.message();
    EXPECT_NE(st.message().find("v_bias_correction"), std::string::npos) << st.message();
  }
  // The general path has none.
  openvc::GeneralAttentionParams g;
  g.in.v_bias = rs.as<float>();
  g.in.batch = 1, g.in.seqlen_q = 128, g.in.seqlen_k = 128, g.in.heads = 1;
  st = openvc::attention_general(g, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("v_bias"), std::string::npos) << st.message();
}

}  // namespace
