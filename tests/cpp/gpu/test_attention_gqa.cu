// Grouped-query attention (Fp8Inputs / PrepareParams / AttentionCall::kv_heads): K and V with fewer heads than Q
// give, bit for bit, the call on K and V with each head repeated heads / kv_heads times, in every fast call form
// (one call: dense, split tiles, few keys, causal, packed uneven, key counts, head dim 64, INT8 + smoothing with the
// LSE, exp2; step-wise prepare_fp8 with Q + attention_fp8, also with a KV cache's fields: K/V in two parts and V
// descales per key block), the prepared K/V arrays are those of the repeated heads,
// a captured call replays with new inputs, and the argument rules name kv_heads.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "openvc/call.h"

namespace {

using openvc::testing::CapturedGraph;
using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::upload;

struct Case {
  int b = 2, sq = 300, sk = 700, h = 6, hk = 2, d = 128;
  std::vector<int> cu_q, cu_k;  // packed offsets (empty: batched)
  std::vector<int> counts;      // key counts (empty: none)
  int group() const { return h / hk; }
  int64_t rows_q() const { return cu_q.empty() ? int64_t(b) * sq : cu_q.back(); }
  int64_t rows_k() const { return cu_k.empty() ? int64_t(b) * sk : cu_k.back(); }
  int nseq() const { return cu_q.empty() ? b : int(cu_q.size()) - 1; }
  int64_t lse_n() const { return cu_q.empty() ? int64_t(b) * h * sq : int64_t(h) * rows_q(); }
};

std::vector<__nv_bfloat16> random_bf16(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<__nv_bfloat16> x(n);
  for (auto& e : x) e = __float2bfloat16(dist(rng));
  return x;
}

// [rows, hk, d] -> [rows, hk * g, d], head j copied to heads j g .. j g + g - 1 (torch's repeat_interleave).
std::vector<__nv_bfloat16> repeat_heads(const std::vector<__nv_bfloat16>& x, int64_t rows, int hk, int g, int d) {
  std::vector<__nv_bfloat16> y(size_t(rows) * hk * g * d);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < hk * g; ++j)
      std::memcpy(&y[(size_t(r) * hk * g + j) * d], &x[(size_t(r) * hk + j / g) * d], size_t(d) * 2);
  return y;
}

// Q [rows_q, h, d], K and V [rows_k, hk, d], their repeated copies [rows_k, h, d], outputs and offsets.
struct Buffers {
  DevBuf q, k, v, k_rep, v_rep, out, lse, cu_q, cu_k, counts;
  Buffers(const Case& c, unsigned seed, float scale = 1.0f)
      : q(c.rows_q() * c.h * c.d * 2), k(c.rows_k() * c.hk * c.d * 2), v(c.rows_k() * c.hk * c.d * 2),
        k_rep(c.rows_k() * c.h * c.d * 2), v_rep(c.rows_k() * c.h * c.d * 2), out(c.rows_q() * c.h * c.d * 2),
        lse(c.lse_n() * 4), cu_q(c.cu_q.size() * 4 + 4), cu_k(c.cu_k.size() * 4 + 4), counts(c.counts.size() * 4 + 4) {
    fill(c, seed, scale);
    if (!c.cu_q.empty()) upload(cu_q.p, c.cu_q), upload(cu_k.p, c.cu_k);
    if (!c.counts.empty()) upload(counts.p, c.counts);
  }
  void fill(const Case& c, unsigned seed, float scale = 1.0f) {
    std::mt19937 rng(seed);
    const auto hq = random_bf16(c.rows_q() * c.h * c.d, rng, scale);
    const auto hk = random_bf16(c.rows_k() * c.hk * c.d, rng, scale);
    const auto hv = random_bf16(c.rows_k() * c.hk * c.d, rng, 1.0f);
    upload(q.p, hq), upload(k.p, hk), upload(v.p, hv);
    upload(k_rep.p, repeat_heads(hk, c.rows_k(), c.hk, c.group(), c.d));
    upload(v_rep.p, repeat_heads(hv, c.rows_k(), c.hk, c.group(), c.d));
  }
};

openvc::TokenTensorView view(const Case& c, const void* p, int s, int heads) {
  return {p, int64_t(s) * heads * c.d, int64_t(heads) * c.d, c.d};
}

// The call with grouped K/V (gqa) or with the repeated copies and kv_heads 0.
openvc::AttentionCall call_of(const Case& c, const Buffers& bf, bool gqa) {
  openvc::AttentionCall a;
  a.heads = c.h, a.head_dim = c.d, a.kv_heads = gqa ? c.hk : 0;
  a.batch = c.b, a.seqlen_q = c.sq, a.seqlen_k = c.sk;
  const int kh = gqa ? c.hk : c.h;
  a.q = view(c, bf.q.p, c.sq, c.h);
  a.k = view(c, gqa ? bf.k.p : bf.k_rep.p, c.sk, kh), a.v = view(c, gqa ? bf.v.p : bf.v_rep.p, c.sk, kh);
  if (!c.cu_q.empty()) {
    a.cu_seqlens_q = bf.cu_q.as<int>(), a.cu_seqlens_k = bf.cu_k.as<int>(), a.num_seqs = c.nseq();
    a.max_seqlen_q = c.sq, a.max_seqlen_k = c.sk, a.total_q = c.rows_q(), a.total_k = c.rows_k();
  }
  if (!c.counts.empty()) a.seqused_k = bf.counts.as<int>();
  a.out = bf.out.p, a.out_stride_batch = int64_t(c.sq) * c.h * c.d, a.out_stride_seq = int64_t(c.h) * c.d;
  a.out_stride_head = c.d, a.lse = bf.lse.as<float>();
  return a;
}

struct Result {
  std::vector<uint16_t> out;
  std::vector<float> lse;
};

Result run_call(const Case& c, const openvc::AttentionCall& a) {
  Result r;
  DevBuf ws(openvc::attention_workspace_bytes(a));
  EXPECT_EQ(cudaSuccess, cudaMemset(a.out, 0xFF, size_t(c.rows_q()) * c.h * c.d * 2));   // poison
  EXPECT_EQ(cudaSuccess, cudaMemset(a.lse, 0xFF, size_t(c.lse_n()) * 4));
  const openvc::Status st = openvc::attention(a, ws.p, ws.bytes, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  r.out = download<uint16_t>(a.out, size_t(c.rows_q()) * c.h * c.d);
  r.lse = download<float>(a.lse, c.lse_n());
  return r;
}

// Packed rows no sequence covers are not written: compare the covered ones (all of them when batched).
void expect_same(const Case& c, const Result& x, const Result& y, const char* what) {
  const int64_t row = int64_t(c.h) * c.d;
  ASSERT_EQ(x.out.size(), y.out.size());
  for (int64_t t = 0; t < c.rows_q(); ++t)
    ASSERT_EQ(0, std::memcmp(&x.out[t * row], &y.out[t * row], row * 2)) << what << ": output row " << t;
  if (c.cu_q.empty()) {
    for (size_t i = 0; i < x.lse.size(); ++i)
      ASSERT_EQ(0, std::memcmp(&x.lse[i], &y.lse[i], 4)) << what << ": lse " << i;
  } else {   // [H, total_q]: the covered tokens of every head
    for (int hh = 0; hh < c.h; ++hh)
      for (int64_t t = 0; t < c.rows_q(); ++t)
        ASSERT_EQ(0, std::memcmp(&x.lse[hh * c.rows_q() + t], &y.lse[hh * c.rows_q() + t], 4))
            << what << ": lse head " << hh << " token " << t;
  }
}

template <class Tweak>
void expect_gqa_equals_repeated(const Case& c, unsigned seed, const char* what, Tweak tweak, float scale = 1.0f) {
  Buffers bf(c, seed, scale);
  openvc::AttentionCall g = call_of(c, bf, true), r = call_of(c, bf, false);
  tweak(g), tweak(r);
  const Result rg = run_call(c, g), rr = run_call(c, r);
  expect_same(c, rg, rr, what);
}

}  // namespace

TEST(Sm90Gqa, OneCallEqualsRepeatedHeadsEveryForm) {
  SKIP_WITHOUT_SM90();
  auto none = [](openvc::AttentionCall&) {};
  auto causal = [](openvc::AttentionCall& a) { a.causal = true; };
  auto int8_smooth = [](openvc::AttentionCall& a) {
    a.qk_format = openvc::QkFormat::kInt8, a.k_smoothing = true;
  };
  auto exp2_causal = [](openvc::AttentionCall& a) {
    a.qk_format = openvc::QkFormat::kInt8, a.k_smoothing = true, a.p_format = openvc::PFormat::kExp2, a.causal = true;
  };
  {
    Case c;   // 6 query heads on 2 K/V heads, dense (Q quantized in the kernel)
    expect_gqa_equals_repeated(c, 11, "dense", none);
    expect_gqa_equals_repeated(c, 12, "causal", causal);
    expect_gqa_equals_repeated(c, 13, "int8 + smoothing, lse of the keys as given", int8_smooth, 2.0f);
    expect_gqa_equals_repeated(c, 14, "int8 + smoothing + exp2, causal", exp2_causal);
    expect_gqa_equals_repeated(c, 15, "split tiles", [](openvc::AttentionCall& a) {
      a.tile_split = openvc::TileSplit::kOn;
    });
  }
  {
    Case c;   // multi-query: one K/V head; few key blocks (the ping-pong mode)
    c.h = 5, c.hk = 1, c.sq = 520, c.sk = 600;
    expect_gqa_equals_repeated(c, 21, "mqa, few keys", none);
  }
  {
    Case c;   // key counts, head dim 64
    c.d = 64, c.h = 8, c.hk = 4, c.counts = {700, 129};
    expect_gqa_equals_repeated(c, 31, "key counts, head dim 64", none);
    expect_gqa_equals_repeated(c, 32, "key counts, head dim 64, causal int8", [](openvc::AttentionCall& a) {
      a.causal = true, a.qk_format = openvc::QkFormat::kInt8;
    });
  }
  {
    Case c;   // packed, uneven sequences (one empty)
    c.h = 4, c.hk = 2, c.cu_q = {0, 300, 300, 1071}, c.cu_k = {0, 500, 500, 1333};
    c.sq = 771, c.sk = 833;
    expect_gqa_equals_repeated(c, 41, "packed", none);
    expect_gqa_equals_repeated(c, 42, "packed causal", causal);
    expect_gqa_equals_repeated(c, 43, "packed int8 + smoothing", int8_smooth);
  }
}

// prepare_fp8 with Q (Q's and K's blocks then take a launch each) and attention_fp8 on its arrays: the K/V arrays of
// each K/V head equal those the repeated heads get, q . mean(K) of each query head too, and so does the output. Four
// forms: E4M3; INT8 with K smoothing; a KV cache's (E4M3 and INT8): K and V in two parts (kv_prefix_len keys from
// k_prefix / v_prefix) with V descales per 128-key block, read back by attention_fp8's v_descale_per_block; the E4M3
// cache form's K/V arrays equal the plain E4M3 form's on the same keys (the two-part read checked on its own; the
// cache's larger layouts, equal heads: test_prepare_out_layout.cu).
TEST(Sm90Gqa, StepwiseWithQMatchesRepeatedHeads) {
  SKIP_WITHOUT_SM90();
  struct Form {
    bool int8, cache;
    const char* name;
  };
  std::vector<uint8_t> plain_kc, plain_vp;   // the plain E4M3 form's grouped K/V arrays
  std::vector<float> plain_ks, plain_vs;
  for (const Form f : {Form{false, false, "e4m3"}, Form{true, false, "int8 + smoothing"},
                       Form{false, true, "e4m3, KV-cache fields"}, Form{true, true, "int8, KV-cache fields"}}) {
    const bool int8 = f.int8, smooth = f.int8 && !f.cache;
    Case c;
    c.h = 6, c.hk = 3;
    Buffers bf(c, 51 + int8);   // the same inputs with and without the cache's fields
    const int64_t gh = int64_t(c.b) * c.h;
    const int64_t nq = openvc::num_quant_blocks(c.sq), nk = openvc::num_quant_blocks(c.sk);
    const int64_t sk_pad = openvc::packed_seqlen_k(c.sk), kg = int8 ? 8 : 1, vd = f.cache ? nk : 1;
    const int prefix = f.cache ? 200 : 0;   // keys [0, 200) from k_prefix / v_prefix: across a block boundary
    struct Prepared {
      int64_t gk;
      DevBuf qc, qs, kc, ks, vp, vs, term, ws;
      Prepared(const Case& c, int kh, int64_t gh, int64_t nq, int64_t nk, int64_t kg, int64_t vd, int64_t sk_pad,
               bool int8, bool smooth)
          : gk(int64_t(c.b) * kh), qc(c.rows_q() * c.h * c.d), qs(gh * (int8 ? c.sq : nq) * 4),
            kc(c.rows_k() * kh * c.d), ks(gk * nk * kg * 4), vp(gk * c.d * sk_pad), vs(gk * vd * 4),
            term(c.lse_n() * 4), ws(openvc::prepare_workspace_bytes(c.b, c.h, c.sk, smooth)) {}
    };
    auto prepare = [&](bool gqa, Prepared& pr) {
      const int kh = gqa ? c.hk : c.h;
      CUDA_OK(cudaMemset(pr.kc.p, 0xAB, pr.kc.bytes));
      CUDA_OK(cudaMemset(pr.vp.p, 0xAB, pr.vp.bytes));
      CUDA_OK(cudaMemset(pr.vs.p, 0xFF, pr.vs.bytes));
      openvc::PrepareParams p;
      p.qk_format = int8 ? openvc::QkFormat::kInt8 : openvc::QkFormat::kE4M3, p.k_smoothing = smooth;
      p.batch = c.b, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.heads = c.h, p.kv_heads = gqa ? c.hk : 0, p.head_dim = c.d;
      p.q = view(c, bf.q.p, c.sq, c.h);
      const auto* k0 = static_cast<const char*>(gqa ? bf.k.p : bf.k_rep.p);
      const auto* v0 = static_cast<const char*>(gqa ? bf.v.p : bf.v_rep.p);
      const int64_t skip = int64_t(prefix) * kh * c.d * 2;   // k and v start after the prefix's rows
      p.k = view(c, k0 + skip, c.sk, kh), p.v = view(c, v0 + skip, c.sk, kh);
      if (f.cache) {
        p.kv_prefix_len = prefix, p.v_descale_per_block = true;
        p.k_prefix = view(c, k0, c.sk, kh), p.v_prefix = view(c, v0, c.sk, kh);
      }
      p.q_codes = pr.qc.as<uint8_t>(), p.q_descale = pr.qs.as<float>(), p.k_codes = pr.kc.as<uint8_t>();
      p.k_descale = pr.ks.as<float>(), p.v_packed = pr.vp.as<uint8_t>(), p.v_descale = pr.vs.as<float>();
      p.q_dot_k_mean = smooth ? pr.term.as<float>() : nullptr;
      p.workspace = pr.ws.p, p.workspace_bytes = pr.ws.bytes;
      const openvc::Status st = openvc::prepare_fp8(p, nullptr);
      ASSERT_TRUE(st.ok()) << st.message();
      openvc::AttentionParams ap;
      ap.in = {c.b, c.sq, c.sk, c.h, c.d, p.q_codes, p.q_descale, p.k_codes, p.k_descale, p.v_packed, p.v_descale,
               p.qk_format};
      ap.in.kv_heads = gqa ? c.hk : 0;
      ap.v_descale_per_block = f.cache;
      ap.out = bf.out.p, ap.out_stride_batch = int64_t(c.sq) * c.h * c.d, ap.out_stride_seq = int64_t(c.h) * c.d;
      ap.out_stride_head = c.d, ap.lse = bf.lse.as<float>();
      CUDA_OK(cudaMemset(bf.out.p, 0xFF, bf.out.bytes));
      const openvc::Status sa = openvc::attention_fp8(ap, nullptr);
      ASSERT_TRUE(sa.ok()) << sa.message();
      CUDA_OK(cudaDeviceSynchronize());
    };
    Prepared pg(c, c.hk, gh, nq, nk, kg, vd, sk_pad, int8, smooth), pr(c, c.h, gh, nq, nk, kg, vd, sk_pad, int8, smooth);
    prepare(true, pg);
    const auto out_g = download<uint16_t>(bf.out.p, bf.out.bytes / 2);
    const auto lse_g = download<float>(bf.lse.p, c.lse_n());
    prepare(false, pr);
    const auto out_r = download<uint16_t>(bf.out.p, bf.out.bytes / 2);
    const auto lse_r = download<float>(bf.lse.p, c.lse_n());
    for (const uint16_t x : out_g) ASSERT_NE(0xFFFF, x) << f.name << ": an output left poisoned";
    ASSERT_EQ(out_g, out_r) << f.name << " output";
    ASSERT_EQ(0, std::memcmp(lse_g.data(), lse_r.data(), lse_g.size() * 4)) << f.name << " lse";
    EXPECT_EQ(download<uint8_t>(pg.qc.p, pg.qc.bytes), download<uint8_t>(pr.qc.p, pr.qc.bytes)) << "Q codes";
    EXPECT_EQ(download<float>(pg.qs.p, pg.qs.bytes / 4), download<float>(pr.qs.p, pr.qs.bytes / 4)) << "Q descales";
    if (smooth) {
      EXPECT_EQ(download<float>(pg.term.p, c.lse_n()), download<float>(pr.term.p, c.lse_n())) << "q . mean(K)";
    }
    // K/V head j of the grouped arrays against head j g of the repeated ones.
    const auto kc_g = download<uint8_t>(pg.kc.p, pg.kc.bytes), kc_r = download<uint8_t>(pr.kc.p, pr.kc.bytes);
    const auto ks_g = download<float>(pg.ks.p, pg.ks.bytes / 4), ks_r = download<float>(pr.ks.p, pr.ks.bytes / 4);
    const auto vp_g = download<uint8_t>(pg.vp.p, pg.vp.bytes), vp_r = download<uint8_t>(pr.vp.p, pr.vp.bytes);
    const auto vs_g = download<float>(pg.vs.p, pg.vs.bytes / 4), vs_r = download<float>(pr.vs.p, pr.vs.bytes / 4);
    if (!int8 && !f.cache) plain_kc = kc_g, plain_ks = ks_g, plain_vp = vp_g, plain_vs = vs_g;
    if (!int8 && f.cache) {   // two parts and the cache's kernels: the plain preparation's bytes
      EXPECT_EQ(kc_g, plain_kc) << f.name << ": K codes against the plain form's";
      EXPECT_EQ(ks_g, plain_ks) << f.name << ": K descales against the plain form's";
      EXPECT_EQ(vp_g, plain_vp) << f.name << ": V codes against the plain form's";
      for (int64_t bj = 0; bj < int64_t(c.b) * c.hk; ++bj)
        for (int64_t i = 0; i < vd; ++i)
          EXPECT_EQ(vs_g[bj * vd + i], plain_vs[bj]) << f.name << ": V descale of K/V head row " << bj << " block " << i;
    }
    const int g = c.group();
    for (int b = 0; b < c.b; ++b)
      for (int j = 0; j < c.hk; ++j) {
        const int64_t bj = int64_t(b) * c.hk + j, bh = int64_t(b) * c.h + j * g;
        for (int s = 0; s < c.sk; ++s)
          ASSERT_EQ(0, std::memcmp(&kc_g[((int64_t(b) * c.sk + s) * c.hk + j) * c.d],
                                   &kc_r[((int64_t(b) * c.sk + s) * c.h + j * g) * c.d], c.d))
              << f.name << ": K codes b " << b << " head " << j << " key " << s;
        ASSERT_EQ(0, std::memcmp(&ks_g[bj * nk * kg], &ks_r[bh * nk * kg], nk * kg * 4)) << f.name << ": K descales";
        ASSERT_EQ(0, std::memcmp(&vp_g[bj * c.d * sk_pad], &vp_r[bh * c.d * sk_pad], c.d * sk_pad)) << "V codes";
        for (int64_t i = 0; i < vd; ++i) {
          ASSERT_EQ(vs_g[bj * vd + i], vs_r[bh * vd + i]) << f.name << ": V descale " << i;
          ASSERT_GT(vs_g[bj * vd + i], 0.0f) << f.name << ": V descale " << i << " not written";
        }
      }
  }
}

// A captured grouped call replayed with new inputs gives the eager call's bytes on them.
TEST(Sm90Gqa, CapturedCallReplaysWithNewInputs) {
  SKIP_WITHOUT_SM90();
  Case c;
  c.h = 8, c.hk = 2, c.sq = 640, c.sk = 1000;
  Buffers bf(c, 61);
  const openvc::AttentionCall a = call_of(c, bf, true);
  DevBuf ws(openvc::attention_workspace_bytes(a));
  CapturedGraph graph(cudaStreamCaptureModeGlobal,
                      [&](cudaStream_t s) { return openvc::attention(a, ws.p, ws.bytes, s); });
  ASSERT_TRUE(graph.status.ok()) << graph.status.message();
  ASSERT_EQ(cudaSuccess, graph.error);
  bf.fill(c, 62);
  CUDA_OK(cudaMemset(bf.out.p, 0xFF, bf.out.bytes));
  CUDA_OK(graph.launch());
  CUDA_OK(cudaStreamSynchronize(graph.stream));
  Result replay{download<uint16_t>(bf.out.p, bf.out.bytes / 2), download<float>(bf.lse.p, c.lse_n())};
  const Result eager = run_call(c, a);
  expect_same(c, replay, eager, "replay");
  const Result repeated = run_call(c, call_of(c, bf, false));
  expect_same(c, eager, repeated, "eager against repeated heads");
}

TEST(Sm90Gqa, ArgumentRulesNameKvHeads) {
  Case c;
  c.h = 6, c.hk = 4;   // not a divisor
  openvc::AttentionCall a;
  a.heads = c.h, a.kv_heads = c.hk, a.head_dim = c.d, a.batch = 1, a.seqlen_q = 128, a.seqlen_k = 128;
  openvc::AttentionPath path;
  const openvc::Status st = openvc::attention_path(a, 0, &path);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("kv_heads"), std::string::npos) << st.message();
  a.kv_heads = -1;
  EXPECT_NE(openvc::attention_path(a, 0, &path).message().find("kv_heads"), std::string::npos);

  openvc::PrepareParams p;
  p.batch = 1, p.seqlen_q = 128, p.seqlen_k = 128, p.heads = 6, p.kv_heads = 4;
  const openvc::Status sp = openvc::prepare_fp8(p, nullptr);
  EXPECT_FALSE(sp.ok());
  EXPECT_NE(sp.message().find("kv_heads"), std::string::npos) << sp.message();

  // Repair rows take K and V with Q's heads (checked before any pointer).
  openvc::AttentionParams ap;
  ap.in.batch = 1, ap.in.seqlen_q = 128, ap.in.seqlen_k = 128, ap.in.heads = 4, ap.in.kv_heads = 2;
  ap.repair.rows = 1;
  const openvc::Status sr = openvc::attention_fp8(ap, nullptr);
  EXPECT_FALSE(sr.ok());
  if (openvc::testing::missing_sm90().empty()) {   // without the device the check before it answers
    EXPECT_NE(sr.message().find("kv_heads"), std::string::npos) << sr.message();
  }
}
