// Q quantized inside the attention kernel (AttentionParams::q_unquantized, kFusedQMode): the same output and
// LSE bits as prepare_fp8's Q codes and descales fed to attention_fp8, for BF16 and FP16 Q, head dim 128 and 64,
// plain and causal, partial last query tiles, Sq != Sk, a Q tensor with padded rows, many tiles per CTA and the
// zero strides of size-1 dimensions; packed sequences and key counts (the varlen tiles); and the argument rules.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/prepare_test_util.h"
#include "openvc/attention.h"

namespace {

using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::PreparedDevice;
using openvc::testing::upload;

struct FusedCase {
  int b, sq, sk, h, d;
  bool causal;
  openvc::DType dtype;
  int q_head_pad;   // extra elements after each Q head row (the Q tensor's head stride is d + q_head_pad)
  bool zero_unit_strides = false;   // strides 0 for the dimensions of size 1 (as the Python views pass them)
};

// n random normal values as BF16 or FP16 bits.
std::vector<uint16_t> random_16(size_t n, unsigned seed, openvc::DType dtype) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> h(n);
  for (auto& x : h) {
    const float f = dist(rng);
    if (dtype == openvc::DType::kFloat16) {
      const __half v = __float2half(f);
      x = *reinterpret_cast<const uint16_t*>(&v);
    } else {
      const __nv_bfloat16 v = __float2bfloat16(f);
      x = *reinterpret_cast<const uint16_t*>(&v);
    }
  }
  return h;
}

void run_fused_case(const FusedCase& c) {
  const int64_t hs = c.d + c.q_head_pad, ss = int64_t(c.h) * hs, bs = int64_t(c.sq) * ss;
  const std::vector<uint16_t> hq = random_16(size_t(c.b) * bs, 11 + c.d, c.dtype);
  const std::vector<uint16_t> hk = random_16(size_t(c.b) * c.sk * c.h * c.d, 12 + c.d, c.dtype);
  const std::vector<uint16_t> hv = random_16(size_t(c.b) * c.sk * c.h * c.d, 13 + c.d, c.dtype);
  DevBuf q(hq.size() * 2), k(hk.size() * 2), v(hv.size() * 2);
  ASSERT_TRUE(upload(q.p, hq) && upload(k.p, hk) && upload(v.p, hv));
  const int64_t bh = int64_t(c.b) * c.h;
  const PreparedDevice prep(size_t(c.b) * c.sq * c.h * c.d, size_t(c.b) * c.sk * c.h * c.d,
                            bh * c.d * openvc::packed_seqlen_k(c.sk), bh, int(openvc::num_quant_blocks(c.sq)),
                            int(openvc::num_quant_blocks(c.sk)),
                            openvc::prepare_workspace_bytes(c.b, c.h, c.sk, false));
  openvc::PrepareParams pp;
  pp.dtype = c.dtype, pp.heads = c.h, pp.head_dim = c.d, pp.batch = c.b, pp.seqlen_q = c.sq, pp.seqlen_k = c.sk;
  const openvc::TokenTensorView qv = {q.p, c.zero_unit_strides && c.b == 1 ? 0 : bs,
                                      c.zero_unit_strides && c.sq == 1 ? 0 : ss, c.zero_unit_strides && c.h == 1 ? 0 : hs};
  pp.q = qv;
  pp.k = {k.p, int64_t(c.sk) * c.h * c.d, int64_t(c.h) * c.d, c.d};
  pp.v = {v.p, int64_t(c.sk) * c.h * c.d, int64_t(c.h) * c.d, c.d};
  prep.bind(pp);
  const openvc::Status sp = openvc::prepare_fp8(pp, nullptr);
  ASSERT_TRUE(sp.ok()) << sp.message();

  const size_t nout = size_t(c.b) * c.sq * c.h * c.d, nlse = size_t(bh) * c.sq;
  DevBuf out_a(nout * 2), out_b(nout * 2), lse_a(nlse * 4), lse_b(nlse * 4);
  for (DevBuf* x : {&out_a, &out_b, &lse_a, &lse_b}) CUDA_OK(cudaMemset(x->p, 0xFF, x->bytes));
  openvc::AttentionParams ap;
  ap.in = {c.b, c.sq, c.sk, c.h, c.d, pp.q_codes, pp.q_descale, pp.k_codes, pp.k_descale, pp.v_packed, pp.v_descale};
  ap.out_stride_batch = int64_t(c.sq) * c.h * c.d, ap.out_stride_seq = int64_t(c.h) * c.d, ap.out_stride_head = c.d;
  ap.causal = c.causal;
  ap.out = out_a.p, ap.lse = lse_a.as<float>();
  openvc::Status st = openvc::attention_fp8(ap, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  // The same call with the unquantized Q and no prepared Q at all.
  ap.in.q_codes = nullptr, ap.in.q_descale = nullptr;
  ap.q_unquantized = qv, ap.q_unquantized_dtype = c.dtype;
  ap.out = out_b.p, ap.lse = lse_b.as<float>();
  st = openvc::attention_fp8(ap, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(download<uint16_t>(out_a.p, nout), download<uint16_t>(out_b.p, nout));
  EXPECT_EQ(download<uint32_t>(lse_a.p, nlse), download<uint32_t>(lse_b.p, nlse));
}

TEST(Sm90FusedQ, SameBitsAsPreparedQ) {
  SKIP_WITHOUT_SM90();
  using openvc::DType;
  const FusedCase cases[] = {
      {2, 300, 700, 3, 128, false, DType::kBFloat16, 0},   // partial tiles, Sq != Sk
      {1, 1000, 1000, 2, 128, true, DType::kBFloat16, 8},   // causal, padded Q rows
      {2, 1000, 600, 2, 64, false, DType::kFloat16, 0},     // head dim 64, FP16
      {1, 777, 777, 3, 64, true, DType::kBFloat16, 16},     // head dim 64 causal, padded Q rows
      {1, 4096, 4096, 2, 128, false, DType::kFloat16, 0},   // 64 tiles
      // more tiles than SMs: each CTA quantizes tile after tile (the staging buffer refilled under the running
      // tile, the barriers' phases, q and q_amax reused)
      {4, 4096, 4096, 16, 128, false, DType::kBFloat16, 0},
      {2, 8192, 8192, 16, 64, true, DType::kBFloat16, 8},
      {2, 2000, 1000, 8, 128, true, DType::kFloat16, 0},    // causal, Sq > Sk: tiles without keys are skipped
      {1, 300, 500, 1, 128, false, DType::kBFloat16, 0, true},   // B = 1, H = 1 with zero strides
      // around the few-keys mode's bounds, many tiles: on prepared Q it ends at 6 blocks (kFewKeyBlocks), with Q
      // quantized in the kernel at 32 (kFewKeyBlocksFusedQ): each side's kernel against the other's, bit for bit
      {2, 4000, 768, 12, 128, false, DType::kBFloat16, 0},
      {2, 4000, 800, 12, 128, false, DType::kFloat16, 0},
      {1, 3000, 4096, 8, 128, false, DType::kBFloat16, 0},
      {1, 3000, 4200, 8, 128, false, DType::kFloat16, 0},
  };
  for (const FusedCase& c : cases) {
    SCOPED_TRACE("b " + std::to_string(c.b) + " sq " + std::to_string(c.sq) + " sk " + std::to_string(c.sk) + " h " +
                 std::to_string(c.h) + " d " + std::to_string(c.d) + (c.causal ? " causal" : ""));
    run_fused_case(c);
  }
}

// Packed sequences (and key counts over a batch): the varlen tiles with Q quantized in the kernel. A sequence's
// last tile holds the rows after its end in its TMA box (the next sequence's, or rows no sequence covers); the
// kernel counts them as zeros, so each sequence's rows must come out as the batched call (Q quantized in the
// kernel too, Sq = the sequence's length, its rows past Sq the TMA's zeros) on that sequence alone gives them,
// whatever those rows hold: sequences alternate between magnitudes 1 and 64 and the uncovered rows hold 4096, so a
// row counted in the wrong tile's amax changes that tile's codes. (Not against the packed call on prepared Q: its
// last tiles carry the next sequence's codes in those rows, which can trigger numerics section 4's warp-wide
// rebase and move the valid rows' FP32 rounding.)
struct PackedCase {
  std::vector<int> cu_q, cu_k;   // offsets; total_q may exceed cu_q.back() (uncovered rows)
  int total_q, h, d;
  bool causal;
  openvc::DType dtype;
  std::vector<int> counts;       // seqused_k (empty: none)
  int batch_sq = 0;              // > 0: a batch of cu_q.size() - 1 entries of this many rows, no offsets
};

// prepare_fp8 (K and V; Q omitted) and attention_fp8 with Q quantized in the kernel, for a batched (cu_q null) or
// packed call; the token views are [rows, H, D] with row stride h * d.
struct FusedCall {
  int nseq, sq, sk, h, d, total_q, total_k;
  const int *cu_q = nullptr, *cu_k = nullptr, *counts = nullptr;
  const void *q, *k, *v;
  bool causal;
  openvc::DType dtype;
  void* out;
  float* lse;
};
void run_fused_call(const FusedCall& f) {
  const bool packed = f.cu_q != nullptr;
  const int64_t row = int64_t(f.h) * f.d, nk = openvc::num_quant_blocks(f.sk), gh = int64_t(f.nseq) * f.h;
  DevBuf kc(size_t(f.total_k) * row + 16), ks(gh * nk * 4 + 4), vp(gh * f.d * openvc::packed_seqlen_k(f.sk) + 16);
  DevBuf vs(gh * 4), ws(openvc::prepare_workspace_bytes(f.nseq, f.h, f.sk, false));
  openvc::PrepareParams pp;
  pp.dtype = f.dtype, pp.heads = f.h, pp.head_dim = f.d;
  pp.k = {f.k, int64_t(f.sk) * row, row, f.d};
  pp.v = {f.v, int64_t(f.sk) * row, row, f.d};
  if (packed) {
    pp.cu_seqlens_q = f.cu_q, pp.cu_seqlens_k = f.cu_k, pp.num_seqs = f.nseq;
    pp.max_seqlen_q = f.sq, pp.max_seqlen_k = f.sk, pp.total_q = f.total_q, pp.total_k = f.total_k;
  } else {
    pp.batch = f.nseq, pp.seqlen_q = f.sq, pp.seqlen_k = f.sk;
  }
  pp.seqused_k = f.counts;
  pp.k_codes = kc.as<uint8_t>(), pp.k_descale = ks.as<float>(), pp.v_packed = vp.as<uint8_t>();
  pp.v_descale = vs.as<float>(), pp.workspace = ws.p, pp.workspace_bytes = ws.bytes;
  const openvc::Status sp = openvc::prepare_fp8(pp, nullptr);
  ASSERT_TRUE(sp.ok()) << sp.message();
  openvc::AttentionParams ap;
  ap.in = {packed ? 1 : f.nseq, f.sq, f.sk, f.h, f.d, nullptr, nullptr, kc.as<uint8_t>(), ks.as<float>(),
           vp.as<uint8_t>(), vs.as<float>()};
  ap.out_stride_batch = int64_t(f.sq) * row, ap.out_stride_seq = row, ap.out_stride_head = f.d;
  ap.causal = f.causal;
  ap.cu_seqlens_q = pp.cu_seqlens_q, ap.cu_seqlens_k = pp.cu_seqlens_k, ap.num_seqs = pp.num_seqs;
  ap.max_seqlen_q = pp.max_seqlen_q, ap.max_seqlen_k = pp.max_seqlen_k, ap.total_q = pp.total_q;
  ap.total_k = pp.total_k, ap.seqused_k = f.counts;
  ap.q_unquantized = {f.q, int64_t(f.sq) * row, row, f.d}, ap.q_unquantized_dtype = f.dtype;
  ap.out = f.out, ap.lse = f.lse;
  const openvc::Status st = openvc::attention_fp8(ap, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
}

void run_fused_packed_case(const PackedCase& c) {
  const int nseq = int(c.cu_q.size()) - 1;
  const bool packed = c.batch_sq == 0;
  int max_q = 0, max_k = 0;
  for (int i = 0; i < nseq; ++i)
    max_q = std::max(max_q, c.cu_q[i + 1] - c.cu_q[i]), max_k = std::max(max_k, c.cu_k[i + 1] - c.cu_k[i]);
  const int total_k = c.cu_k.back();
  const int64_t row = int64_t(c.h) * c.d;
  std::vector<uint16_t> hq = random_16(size_t(c.total_q) * row, 21 + c.d, c.dtype);
  // Scale each row's values by its sequence's magnitude (exact: powers of two).
  for (int t = 0; t < c.total_q; ++t) {
    int seq = nseq;
    for (int i = 0; i < nseq; ++i)
      if (t >= c.cu_q[i] && t < c.cu_q[i + 1]) seq = i;
    const float m = seq == nseq ? 4096.0f : (seq % 2 ? 64.0f : 1.0f);
    for (int64_t e = 0; e < row; ++e) {
      uint16_t& x = hq[size_t(t) * row + e];
      if (c.dtype == openvc::DType::kFloat16) {
        const __half v = __float2half(__half2float(*reinterpret_cast<const __half*>(&x)) * m);
        x = *reinterpret_cast<const uint16_t*>(&v);
      } else {
        const __nv_bfloat16 v = __float2bfloat16(__bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&x)) * m);
        x = *reinterpret_cast<const uint16_t*>(&v);
      }
    }
  }
  const std::vector<uint16_t> hk = random_16(size_t(total_k) * row, 22 + c.d, c.dtype);
  const std::vector<uint16_t> hv = random_16(size_t(total_k) * row, 23 + c.d, c.dtype);
  DevBuf q(hq.size() * 2), k(hk.size() * 2), v(hv.size() * 2), cu_q(c.cu_q.size() * 4), cu_k(c.cu_k.size() * 4);
  DevBuf counts(c.counts.size() * 4 + 4);
  ASSERT_TRUE(upload(q.p, hq) && upload(k.p, hk) && upload(v.p, hv));
  ASSERT_TRUE(upload(cu_q.p, c.cu_q) && upload(cu_k.p, c.cu_k));
  if (!c.counts.empty()) ASSERT_TRUE(upload(counts.p, c.counts));
  const size_t nout = size_t(c.total_q) * row, nlse = size_t(c.h) * c.total_q;
  DevBuf out(nout * 2), lse(nlse * 4);
  CUDA_OK(cudaMemset(out.p, 0xFF, out.bytes));
  CUDA_OK(cudaMemset(lse.p, 0xFF, lse.bytes));
  FusedCall f{nseq, packed ? max_q : c.batch_sq, packed ? max_k : c.cu_k[1], c.h, c.d, c.total_q, total_k};
  if (packed) f.cu_q = cu_q.as<int>(), f.cu_k = cu_k.as<int>();
  f.counts = c.counts.empty() ? nullptr : counts.as<int>();
  f.q = q.p, f.k = k.p, f.v = v.p, f.causal = c.causal, f.dtype = c.dtype, f.out = out.p, f.lse = lse.as<float>();
  run_fused_call(f);
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<uint16_t> ho = download<uint16_t>(out.p, nout);
  const std::vector<float> hl = download<float>(lse.p, nlse);   // batched [B, H, Sq]; packed [H, total_q]

  // Packed rows no sequence covers keep the poison.
  for (int t = packed ? c.cu_q.back() : c.total_q; t < c.total_q; ++t) {
    for (int64_t e = 0; e < row; ++e) ASSERT_EQ(0xFFFFu, ho[size_t(t) * row + e]) << "uncovered row " << t;
    for (int h = 0; h < c.h; ++h) ASSERT_TRUE(std::isnan(hl[size_t(h) * c.total_q + t])) << "uncovered row " << t;
  }
  // Each sequence alone, batched (B = 1, no key counts: its used keys sliced out, the batched plain path).
  for (int i = 0; i < nseq; ++i) {
    const int q0 = c.cu_q[i], k0 = c.cu_k[i], lq = c.cu_q[i + 1] - q0;
    const int lk = c.counts.empty() ? c.cu_k[i + 1] - k0 : std::min(c.cu_k[i + 1] - k0, c.counts[i]);
    if (lq == 0) continue;
    SCOPED_TRACE("sequence " + std::to_string(i));
    if (lk == 0) {   // no key: output 0, LSE -inf
      for (int64_t e = 0; e < int64_t(lq) * row; ++e) ASSERT_EQ(0u, ho[size_t(q0) * row + e]);
      for (int h = 0; h < c.h; ++h)
        for (int r = 0; r < lq; ++r) {
          const float got = packed ? hl[size_t(h) * c.total_q + q0 + r] : hl[(size_t(i) * c.h + h) * lq + r];
          ASSERT_EQ(-INFINITY, got);
        }
      continue;
    }
    DevBuf o1(size_t(lq) * row * 2), l1(size_t(c.h) * lq * 4);
    FusedCall g{1, lq, lk, c.h, c.d, lq, lk};
    g.q = q.as<uint16_t>() + q0 * row, g.k = k.as<uint16_t>() + k0 * row, g.v = v.as<uint16_t>() + k0 * row;
    g.causal = c.causal, g.dtype = c.dtype, g.out = o1.p, g.lse = l1.as<float>();
    run_fused_call(g);
    if (::testing::Test::HasFatalFailure()) return;
    const std::vector<uint16_t> so = download<uint16_t>(o1.p, size_t(lq) * row);
    const std::vector<float> sl = download<float>(l1.p, size_t(c.h) * lq);
    ASSERT_EQ(0, std::memcmp(so.data(), ho.data() + size_t(q0) * row, so.size() * 2));
    for (int h = 0; h < c.h; ++h)
      for (int r = 0; r < lq; ++r) {
        const float want = sl[size_t(h) * lq + r];
        const float got = packed ? hl[size_t(h) * c.total_q + q0 + r] : hl[(size_t(i) * c.h + h) * lq + r];
        ASSERT_EQ(0, std::memcmp(&want, &got, 4)) << "lse head " << h << " row " << r;
      }
  }
}

TEST(Sm90FusedQ, PackedSameBitsAsEachSequenceAlone) {
  SKIP_WITHOUT_SM90();
  using openvc::DType;
  const PackedCase cases[] = {
      // uneven sequences ending inside a tile, an empty query sequence, 77 uncovered rows at the end
      {{0, 300, 300, 1000, 1130}, {0, 500, 629, 1400, 1500}, 1207, 3, 128, false, DType::kBFloat16},
      {{0, 300, 300, 1000, 1130}, {0, 500, 629, 1400, 1500}, 1207, 3, 128, true, DType::kBFloat16},
      {{0, 257, 700, 701, 2000}, {0, 257, 700, 701, 2000}, 2048, 2, 64, true, DType::kFloat16},
      {{0, 129, 1129, 1300}, {0, 1000, 1128, 1700}, 1300, 4, 64, false, DType::kBFloat16},
      // key counts with the offsets, and more tiles than SMs
      {{0, 4000, 9000, 9001, 16000}, {0, 4000, 9000, 9001, 16000}, 16100, 8, 128, false, DType::kFloat16,
       {3000, 5000, 1, 128}},
      {{0, 4000, 9000, 9001, 16000}, {0, 4000, 9000, 9001, 16000}, 16000, 8, 128, true, DType::kBFloat16},
      // lengths that are multiples of 128 (no row after the end inside a tile) and one that is not
      {{0, 256, 640, 1024, 1100}, {0, 384, 640, 1024, 1500}, 1100, 2, 128, true, DType::kBFloat16},
      // key counts over a batch (the varlen tiles over flat Q rows; the next entry's rows after each one's end)
      {{0, 700, 1400, 2100}, {0, 900, 1800, 2700}, 2100, 3, 128, false, DType::kBFloat16, {900, 400, 1}, 700},
      {{0, 700, 1400, 2100}, {0, 900, 1800, 2700}, 2100, 2, 64, true, DType::kBFloat16, {900, 400, 0}, 700},
      // one query row per entry (decoding with key counts: the rows at stride_batch)
      {{0, 1, 2, 3, 4}, {0, 300, 600, 900, 1200}, 4, 4, 128, false, DType::kBFloat16, {300, 129, 0, 1}, 1},
  };
  for (const PackedCase& c : cases) {
    std::string offsets;
    for (int x : c.cu_q) offsets += " " + std::to_string(x);
    SCOPED_TRACE("cu_q" + offsets + " h " + std::to_string(c.h) + " d " + std::to_string(c.d) +
                 (c.causal ? " causal" : "") + (c.counts.empty() ? "" : " seqused_k") +
                 (c.batch_sq ? " batched" : ""));
    run_fused_packed_case(c);
  }
}

// The argument rules, before anything touches the device.
TEST(Sm90FusedQ, RejectsWhatItDoesNotTake) {
  alignas(16) static uint8_t fake[256];
  const float* f = reinterpret_cast<const float*>(fake);
  openvc::AttentionParams p;
  p.in = {1, 128, 128, 1, 128, nullptr, nullptr, fake, f, fake, f};
  p.out = fake, p.out_stride_batch = p.out_stride_seq = p.out_stride_head = 128;
  p.q_unquantized = {fake, 128 * 128, 128, 128};
  p.in.qk_format = openvc::QkFormat::kInt8;
  openvc::Status st = openvc::attention_fp8(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kUnsupported) << st.message();
  EXPECT_NE(st.message().find("q_unquantized"), std::string::npos) << st.message();
  p.in.qk_format = openvc::QkFormat::kE4M3;
  p.q_unquantized.stride_seq = 132;   // not a multiple of 8 elements
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("q_unquantized"), std::string::npos) << st.message();
  p.q_unquantized.stride_seq = 128;
  p.q_unquantized_dtype = static_cast<openvc::DType>(7);
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("q_unquantized_dtype"), std::string::npos) << st.message();
  // Key counts over a batch whose Q rows do not follow each other (the varlen tiles read them flat).
  int counts[2] = {128, 128};
  p.q_unquantized_dtype = openvc::DType::kBFloat16;
  p.in.batch = 2, p.seqused_k = counts;
  p.q_unquantized = {fake, 129 * 128, 128, 128};
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kUnsupported) << st.message();
  EXPECT_NE(st.message().find("q_unquantized.stride_batch"), std::string::npos) << st.message();
  p.in.batch = 1, p.seqused_k = nullptr, p.q_unquantized = {fake, 128 * 128, 128, 128};
  // prepare_fp8 without Q (K and V only) cannot write q . mean(K).
  openvc::PrepareParams pp;
  pp.batch = 1, pp.seqlen_q = 128, pp.seqlen_k = 128, pp.heads = 1;
  pp.k = pp.v = {fake, 128 * 128, 128, 128};
  pp.k_smoothing = true, pp.q_dot_k_mean = reinterpret_cast<float*>(fake);
  st = openvc::prepare_fp8(pp, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("q_dot_k_mean needs Q"), std::string::npos) << st.message();
}

}  // namespace
