// openvc::attention (call.h), the one-call entry: the same bytes as prepare_fp8 + attention_fp8 in every
// form (batched, packed uneven, key counts, causal, INT8 + smoothing + exp2), the LSE of the keys as given
// with K smoothing (against an exact host LSE and the unsmoothed call), capture in a CUDA graph replayed
// with new inputs, programmatic launches against plain ones (back to back, no synchronization between calls),
// the path choice and the argument checks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "openvc/call.h"
#include "openvc/launch.h"

namespace {

using openvc::testing::CapturedGraph;
using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::upload;

std::vector<__nv_bfloat16> random_bf16(size_t n, unsigned seed, float scale = 1.0f, float offset = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<__nv_bfloat16> h(n);
  for (auto& x : h) x = __float2bfloat16(offset + scale * dist(rng));
  return h;
}

// A call's inputs and outputs on the device: [rows, H, D] token tensors (batched rows = B * S).
struct Case {
  int b = 2, sq = 300, sk = 700, h = 3, d = 128;
  std::vector<int> cu_q, cu_k;  // packed offsets (empty: batched)
  std::vector<int> counts;      // key counts (empty: none)
  int64_t rows_q() const { return cu_q.empty() ? int64_t(b) * sq : cu_q.back(); }
  int64_t rows_k() const { return cu_k.empty() ? int64_t(b) * sk : cu_k.back(); }
  int nseq() const { return cu_q.empty() ? b : int(cu_q.size()) - 1; }
  int64_t lse_n() const { return cu_q.empty() ? int64_t(b) * h * sq : int64_t(h) * rows_q(); }
};

struct Buffers {
  DevBuf q, k, v, out, lse, cu_q, cu_k, counts;
  std::vector<__nv_bfloat16> hq, hk, hv;
  Buffers(const Case& c, unsigned seed, float k_offset = 0.0f)
      : q(c.rows_q() * c.h * c.d * 2), k(c.rows_k() * c.h * c.d * 2), v(c.rows_k() * c.h * c.d * 2),
        out(c.rows_q() * c.h * c.d * 2), lse(c.lse_n() * 4), cu_q(c.cu_q.size() * 4 + 4),
        cu_k(c.cu_k.size() * 4 + 4), counts(c.counts.size() * 4 + 4) {
    fill(c, seed, k_offset);
    if (!c.cu_q.empty()) upload(cu_q.p, c.cu_q), upload(cu_k.p, c.cu_k);
    if (!c.counts.empty()) upload(counts.p, c.counts);
  }
  void fill(const Case& c, unsigned seed, float k_offset = 0.0f) {
    hq = random_bf16(c.rows_q() * c.h * c.d, seed);
    hk = random_bf16(c.rows_k() * c.h * c.d, seed + 1, 1.0f, k_offset);
    hv = random_bf16(c.rows_k() * c.h * c.d, seed + 2);
    upload(q.p, hq), upload(k.p, hk), upload(v.p, hv);
  }
};

openvc::TokenTensorView view(const Case& c, const void* p, int s) {
  return {p, int64_t(s) * c.h * c.d, int64_t(c.h) * c.d, c.d};
}

openvc::AttentionCall call_of(const Case& c, const Buffers& bf) {
  openvc::AttentionCall a;
  a.heads = c.h, a.head_dim = c.d;
  a.batch = c.b, a.seqlen_q = c.sq, a.seqlen_k = c.sk;
  a.q = view(c, bf.q.p, c.sq), a.k = view(c, bf.k.p, c.sk), a.v = view(c, bf.v.p, c.sk);
  if (!c.cu_q.empty()) {
    a.cu_seqlens_q = bf.cu_q.as<int>(), a.cu_seqlens_k = bf.cu_k.as<int>(), a.num_seqs = c.nseq();
    a.max_seqlen_q = c.sq, a.max_seqlen_k = c.sk, a.total_q = c.rows_q(), a.total_k = c.rows_k();
  }
  if (!c.counts.empty()) a.seqused_k = bf.counts.as<int>();
  a.out = bf.out.p, a.out_stride_batch = int64_t(c.sq) * c.h * c.d, a.out_stride_seq = int64_t(c.h) * c.d;
  a.out_stride_head = c.d, a.lse = bf.lse.as<float>();
  return a;
}

// The step-wise calls (prepare_fp8 into own buffers, attention_fp8) with q . mean(K) added to the LSE the
// way the one call does, for the byte comparison. E4M3 without smoothing: Q quantized in the kernel, as the one
// call does it (Sm90FusedQ tests that against prepared Q; packed, a sequence's last tile then counts the rows
// after its end as zeros where prepared Q has the next sequence's codes, which may move FP32 roundings).
void stepwise(const openvc::AttentionCall& a, std::vector<uint16_t>* out, std::vector<float>* lse) {
  const bool packed = a.cu_seqlens_q != nullptr;
  const int64_t groups = packed ? a.num_seqs : a.batch, sq = packed ? a.max_seqlen_q : a.seqlen_q;
  const int64_t sk = packed ? a.max_seqlen_k : a.seqlen_k, rows_q = packed ? a.total_q : a.batch * sq;
  const int64_t rows_k = packed ? a.total_k : a.batch * sk, gh = groups * a.heads;
  const int64_t nq = openvc::num_quant_blocks(sq), nk = openvc::num_quant_blocks(sk);
  const bool int8 = a.qk_format == openvc::QkFormat::kInt8;
  DevBuf qc(rows_q * a.heads * a.head_dim), kc(rows_k * a.heads * a.head_dim);
  DevBuf qs(gh * (int8 ? sq : nq) * 4), ks(gh * nk * (int8 ? 8 : 1) * 4);
  DevBuf vp(gh * a.head_dim * openvc::packed_seqlen_k(sk)), vs(gh * 4);
  const int64_t n_lse = packed ? a.heads * rows_q : gh * sq;
  DevBuf term(n_lse * 4);
  DevBuf ws(openvc::prepare_workspace_bytes(int(groups), a.heads, int(sk), a.k_smoothing));
  openvc::PrepareParams p;
  p.dtype = a.dtype, p.qk_format = a.qk_format, p.heads = a.heads, p.head_dim = a.head_dim;
  p.batch = a.batch, p.seqlen_q = a.seqlen_q, p.seqlen_k = a.seqlen_k, p.q = a.q, p.k = a.k, p.v = a.v;
  if (packed) {
    p.cu_seqlens_q = a.cu_seqlens_q, p.cu_seqlens_k = a.cu_seqlens_k, p.num_seqs = a.num_seqs;
    p.max_seqlen_q = a.max_seqlen_q, p.max_seqlen_k = a.max_seqlen_k, p.total_q = a.total_q, p.total_k = a.total_k;
  }
  p.seqused_k = a.seqused_k;
  p.q_codes = qc.as<uint8_t>(), p.q_descale = qs.as<float>(), p.k_codes = kc.as<uint8_t>();
  p.k_descale = ks.as<float>(), p.v_packed = vp.as<uint8_t>(), p.v_descale = vs.as<float>();
  p.workspace = ws.p, p.workspace_bytes = ws.bytes, p.k_smoothing = a.k_smoothing;
  p.q_dot_k_mean = a.k_smoothing ? term.as<float>() : nullptr;
  ASSERT_TRUE(openvc::prepare_fp8(p, nullptr).ok());
  openvc::AttentionParams ap;
  ap.in = {a.batch, a.seqlen_q, a.seqlen_k, a.heads, a.head_dim, p.q_codes, p.q_descale, p.k_codes,
           p.k_descale, p.v_packed, p.v_descale, a.qk_format};
  ap.out = a.out, ap.out_stride_batch = a.out_stride_batch, ap.out_stride_seq = a.out_stride_seq;
  ap.out_stride_head = a.out_stride_head, ap.lse = a.lse, ap.causal = a.causal, ap.p_format = a.p_format;
  ap.cu_seqlens_q = p.cu_seqlens_q, ap.cu_seqlens_k = p.cu_seqlens_k, ap.num_seqs = p.num_seqs;
  ap.max_seqlen_q = p.max_seqlen_q, ap.max_seqlen_k = p.max_seqlen_k, ap.total_q = p.total_q;
  ap.total_k = p.total_k, ap.seqused_k = a.seqused_k;
  if (a.qk_format == openvc::QkFormat::kE4M3 && !a.k_smoothing && a.causal_chunk <= 1 &&
      a.blocks.num_blocks == nullptr) {   // call.cu's rule (these tests' Q views are TMA-readable)
    ap.in.q_codes = nullptr, ap.in.q_descale = nullptr;
    ap.q_unquantized = a.q, ap.q_unquantized_dtype = a.dtype;
  }
  const openvc::Status st = openvc::attention_fp8(ap, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  *out = download<uint16_t>(a.out, rows_q * a.heads * a.head_dim);
  *lse = download<float>(a.lse, n_lse);
  if (a.k_smoothing) {
    const std::vector<float> t = download<float>(term.p, n_lse);
    const float scale = 1.0f / std::sqrt(float(a.head_dim));
    for (int64_t i = 0; i < n_lse; ++i) (*lse)[i] = std::fmaf(scale, t[i], (*lse)[i]);
  }
}

void one_call(const openvc::AttentionCall& a, std::vector<uint16_t>* out, std::vector<float>* lse) {
  DevBuf ws(openvc::attention_workspace_bytes(a));
  CUDA_OK(cudaMemset(a.out, 0xFF, size_t(out->size()) * 2));
  const openvc::Status st = openvc::attention(a, ws.p, ws.bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  *out = download<uint16_t>(a.out, out->size());
  *lse = download<float>(a.lse, lse->size());
}

void expect_same_as_stepwise(const Case& c, openvc::AttentionCall a) {
  std::vector<uint16_t> o1, o2;
  std::vector<float> l1, l2;
  stepwise(a, &o1, &l1);
  o2.resize(o1.size()), l2.resize(l1.size());
  one_call(a, &o2, &l2);
  // Packed rows no sequence covers are not written: compare the covered ones.
  const int64_t row = int64_t(c.h) * c.d;
  for (int64_t t = 0; t < c.rows_q(); ++t)
    ASSERT_EQ(0, std::memcmp(&o1[t * row], &o2[t * row], row * 2)) << "output row " << t;
  for (size_t i = 0; i < l1.size(); ++i) ASSERT_EQ(l1[i], l2[i]) << "lse " << i;
}

// Exact LSE of batch entry 0's rows from the BF16 inputs (double), natural log.
std::vector<double> exact_lse(const Case& c, const Buffers& bf) {
  std::vector<double> lse(size_t(c.h) * c.sq);
  const double scale = 1.0 / std::sqrt(double(c.d));
  std::vector<double> s(c.sk);
  for (int h = 0; h < c.h; ++h)
    for (int i = 0; i < c.sq; ++i) {
      double m = -INFINITY;
      for (int j = 0; j < c.sk; ++j) {
        double acc = 0.0;
        for (int e = 0; e < c.d; ++e)
          acc += double(__bfloat162float(bf.hq[(size_t(i) * c.h + h) * c.d + e])) *
                 double(__bfloat162float(bf.hk[(size_t(j) * c.h + h) * c.d + e]));
        s[j] = acc * scale;
        m = std::max(m, s[j]);
      }
      double sum = 0.0;
      for (int j = 0; j < c.sk; ++j) sum += std::exp(s[j] - m);
      lse[size_t(h) * c.sq + i] = m + std::log(sum);
    }
  return lse;
}

}  // namespace

TEST(AttentionCall, SameBytesAsStepwiseEveryForm) {
  SKIP_WITHOUT_SM90();
  {
    Case c;
    Buffers bf(c, 1);
    expect_same_as_stepwise(c, call_of(c, bf));   // dense E4M3
    openvc::AttentionCall a = call_of(c, bf);
    a.causal = true, a.qk_format = openvc::QkFormat::kInt8, a.k_smoothing = true, a.p_format = openvc::PFormat::kExp2;
    expect_same_as_stepwise(c, a);
  }
  {
    Case c;
    c.counts = {700, 333};
    Buffers bf(c, 5);
    expect_same_as_stepwise(c, call_of(c, bf));   // key counts, E4M3
    openvc::AttentionCall a = call_of(c, bf);
    a.qk_format = openvc::QkFormat::kInt8, a.k_smoothing = true;
    expect_same_as_stepwise(c, a);
  }
  {
    Case c;
    c.b = 1, c.sq = 300, c.sk = 500, c.d = 64;
    c.cu_q = {0, 300, 300, 420}, c.cu_k = {0, 500, 629, 629};   // uneven, an empty query and an empty key sequence
    Buffers bf(c, 9);
    openvc::AttentionCall a = call_of(c, bf);
    expect_same_as_stepwise(c, a);
    a.causal = true, a.qk_format = openvc::QkFormat::kInt8, a.k_smoothing = true;
    expect_same_as_stepwise(c, a);
  }
}

// K smoothing with a channel offset in K: the one call's LSE is the exact LSE of the keys as given (within the
// quantization error) and the unsmoothed call's, not the smoothed keys' (which differs by scale * q . mean).
TEST(AttentionCall, SmoothingLseIsTheLseOfTheKeysAsGiven) {
  SKIP_WITHOUT_SM90();
  Case c;
  c.b = 1, c.sq = 256, c.sk = 640;
  Buffers bf(c, 21, /*k_offset=*/2.0f);
  const std::vector<double> exact = exact_lse(c, bf);
  for (auto fmt : {openvc::QkFormat::kE4M3, openvc::QkFormat::kInt8}) {
    openvc::AttentionCall a = call_of(c, bf);
    a.qk_format = fmt, a.k_smoothing = true;
    std::vector<uint16_t> out(size_t(c.rows_q()) * c.h * c.d);
    std::vector<float> lse(exact.size());
    one_call(a, &out, &lse);
    double err = 0.0, shift = 0.0;
    for (size_t i = 0; i < exact.size(); ++i) err = std::max(err, std::fabs(lse[i] - exact[i]));
    // Without the term the LSE would be off by |scale * q . mean(K)|, about 2 * sqrt(D) / sqrt(D) * |q| here.
    a.k_smoothing = false;
    std::vector<float> plain(exact.size());
    one_call(a, &out, &plain);
    for (size_t i = 0; i < exact.size(); ++i) shift = std::max(shift, std::fabs(double(plain[i]) - exact[i]));
    EXPECT_LT(err, fmt == openvc::QkFormat::kInt8 ? 0.05 : 0.25) << "max |lse - exact|, qk_format " << int(fmt);
    EXPECT_LT(shift, fmt == openvc::QkFormat::kInt8 ? 0.1 : 0.5) << "unsmoothed call (its own error with the K offset), qk_format " << int(fmt);
  }
}

TEST(AttentionCall, CapturedInACudaGraphAndReplayedWithNewInputs) {
  SKIP_WITHOUT_SM90();
  Case c;
  c.counts = {650, 123};
  Buffers bf(c, 31);
  openvc::AttentionCall a = call_of(c, bf);
  a.qk_format = openvc::QkFormat::kInt8, a.k_smoothing = true, a.p_format = openvc::PFormat::kExp2, a.causal = true;
  DevBuf ws(openvc::attention_workspace_bytes(a));
  // Global mode: while capturing, the driver refuses synchronizing or allocating calls (stream or device
  // synchronize, synchronous memcpy, cudaMalloc) from any thread, so one inside the library fails the capture.
  const CapturedGraph cg(cudaStreamCaptureModeGlobal,
                         [&](cudaStream_t s) { return openvc::attention(a, ws.p, ws.bytes, s); });
  ASSERT_TRUE(cg.status.ok()) << cg.status.message();
  CUDA_OK(cg.error);
  const size_t n_out = size_t(c.rows_q()) * c.h * c.d;
  for (unsigned seed : {41u, 51u}) {
    bf.fill(c, seed);
    const std::vector<int> counts = {int(seed) % 700, 700};   // the key counts change between replays too
    upload(bf.counts.p, counts);
    CUDA_OK(cg.launch());
    CUDA_OK(cudaStreamSynchronize(cg.stream));
    const std::vector<uint16_t> replayed = download<uint16_t>(bf.out.p, n_out);
    const std::vector<float> replayed_lse = download<float>(bf.lse.p, c.lse_n());
    std::vector<uint16_t> eager(n_out);
    std::vector<float> eager_lse(c.lse_n());
    one_call(a, &eager, &eager_lse);
    EXPECT_EQ(0, std::memcmp(replayed.data(), eager.data(), n_out * 2)) << "seed " << seed;
    EXPECT_EQ(0, std::memcmp(replayed_lse.data(), eager_lse.data(), eager_lse.size() * 4)) << "seed " << seed;
  }
}

// Programmatic launches (launch.h) give the plain launches' bytes, also when calls follow each other on one
// stream without synchronization and share the workspace: each kernel's early start may overlap only what
// it does not depend on. Eight calls per form, each into its own output, against the serial call.
TEST(AttentionCall, ProgrammaticLaunchesSameBytesBackToBack) {
  SKIP_WITHOUT_SM90();
  struct Form {
    Case c;
    openvc::QkFormat fmt;
    bool smooth, causal;
  };
  std::vector<Form> forms(3);
  forms[0].c.sq = forms[0].c.sk = 1000;                                     // batched E4M3: Q fused
  forms[0].fmt = openvc::QkFormat::kE4M3, forms[0].smooth = false, forms[0].causal = false;
  forms[1].c.counts = {600, 77};                                            // key counts, INT8 + smoothing
  forms[1].fmt = openvc::QkFormat::kInt8, forms[1].smooth = true, forms[1].causal = false;
  forms[2].c.b = 1, forms[2].c.sq = 420, forms[2].c.sk = 500, forms[2].c.d = 64;
  forms[2].c.cu_q = {0, 300, 300, 720}, forms[2].c.cu_k = {0, 500, 629, 1000};
  forms[2].fmt = openvc::QkFormat::kE4M3, forms[2].smooth = false, forms[2].causal = true;   // packed, D = 64
  const bool previous = openvc::set_programmatic_launch(false);
  for (size_t f = 0; f < forms.size(); ++f) {
    const Case& c = forms[f].c;
    Buffers bf(c, 61 + unsigned(f));
    openvc::AttentionCall a = call_of(c, bf);
    a.qk_format = forms[f].fmt, a.k_smoothing = forms[f].smooth, a.causal = forms[f].causal;
    const size_t n_out = size_t(c.rows_q()) * c.h * c.d, n_lse = size_t(c.lse_n());
    std::vector<uint16_t> serial(n_out);
    std::vector<float> serial_lse(n_lse);
    openvc::set_programmatic_launch(false);
    one_call(a, &serial, &serial_lse);
    openvc::set_programmatic_launch(true);
    DevBuf ws(openvc::attention_workspace_bytes(a));
    std::vector<std::unique_ptr<DevBuf>> outs, lses;
    for (int i = 0; i < 8; ++i) {
      outs.push_back(std::make_unique<DevBuf>(n_out * 2)), lses.push_back(std::make_unique<DevBuf>(n_lse * 4));
      CUDA_OK(cudaMemset(outs.back()->p, 0xFF, n_out * 2));
    }
    for (int i = 0; i < 8; ++i) {
      a.out = outs[i]->p, a.lse = lses[i]->as<float>();
      const openvc::Status st = openvc::attention(a, ws.p, ws.bytes, nullptr);
      ASSERT_TRUE(st.ok()) << st.message();
    }
    CUDA_OK(cudaDeviceSynchronize());
    const int64_t row = int64_t(c.h) * c.d;
    for (int i = 0; i < 8; ++i) {
      const std::vector<uint16_t> o = download<uint16_t>(outs[i]->p, n_out);
      const std::vector<float> l = download<float>(lses[i]->p, n_lse);
      for (int64_t t = 0; t < c.rows_q(); ++t)   // packed rows no sequence covers are not written
        ASSERT_EQ(0, std::memcmp(&o[t * row], &serial[t * row], row * 2)) << "form " << f << ", call " << i << ", row " << t;
      for (size_t j = 0; j < n_lse; ++j) ASSERT_EQ(serial_lse[j], l[j]) << "form " << f << ", call " << i << ", lse " << j;
    }
  }
  openvc::set_programmatic_launch(previous);
}

// The setting itself: no device needed.
TEST(LaunchSettings, SetReturnsThePreviousSetting) {
  const bool initial = openvc::programmatic_launch();
  EXPECT_EQ(initial, openvc::set_programmatic_launch(!initial));
  EXPECT_EQ(!initial, openvc::programmatic_launch());
  EXPECT_EQ(!initial, openvc::set_programmatic_launch(initial));
  EXPECT_EQ(initial, openvc::programmatic_launch());
}

// Argument checks and sizes: no device needed (attention_path on a device without sm_90a says general).
TEST(AttentionCallArgs, FieldsNamedAndWorkspaceSized) {
  Case c;
  openvc::AttentionCall a;
  a.heads = c.h, a.batch = c.b, a.seqlen_q = c.sq, a.seqlen_k = c.sk;
  openvc::AttentionPath path;
  a.heads = 0;
  EXPECT_NE(openvc::attention_path(a, 0, &path).message().find("call.heads"), std::string::npos);
  a.heads = c.h, a.head_dim = 96;
  EXPECT_NE(openvc::attention_path(a, 0, &path).message().find("call.head_dim"), std::string::npos);
  a.head_dim = 128, a.p_format = openvc::PFormat::kExp2;
  EXPECT_NE(openvc::attention_path(a, 0, &path).message().find("call.p_format"), std::string::npos);
  a.p_format = openvc::PFormat::kExpCast;
  int dummy = 0;
  a.cu_seqlens_q = &dummy;
  EXPECT_NE(openvc::attention_path(a, 0, &path).message().find("call.cu_seqlens_k"), std::string::npos);
  a.cu_seqlens_q = nullptr;
  // Sizes: E4M3 < INT8 (per-row Q and per-group K descales); the LSE term only with smoothing and an LSE.
  const size_t e4 = openvc::attention_workspace_bytes(a);
  a.qk_format = openvc::QkFormat::kInt8;
  const size_t i8 = openvc::attention_workspace_bytes(a);
  a.k_smoothing = true;
  const size_t sm = openvc::attention_workspace_bytes(a);
  float lse_dummy = 0.0f;
  a.lse = &lse_dummy;
  const size_t sm_lse = openvc::attention_workspace_bytes(a);
  EXPECT_LT(e4, i8);
  EXPECT_LT(i8, sm);
  EXPECT_GE(sm_lse, sm + size_t(c.b) * c.h * c.sq * 4);
  EXPECT_EQ(0u, e4 % 256);
  // A workspace too small is refused before anything runs (when a device is present).
  if (openvc::testing::missing_sm90().empty()) {
    a.lse = nullptr;
    DevBuf ws(256);
    const openvc::Status st = openvc::attention(a, ws.p, 256, nullptr);
    EXPECT_NE(st.message().find("attention_workspace_bytes(call)"), std::string::npos) << st.message();
  }
}
