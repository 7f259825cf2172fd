// Q quantized inside the attention kernel (AttentionParams::q_unquantized, kFusedQMode): the same output and
// LSE bits as prepare_fp8's Q codes and descales fed to attention_fp8, for BF16 and FP16 Q, head dim 128 and 64,
// plain and causal, partial last query tiles, Sq != Sk, a Q tensor with padded rows, many tiles per CTA and the
// zero strides of size-1 dimensions; packed sequences and key counts (the varlen modes); and the argument rules.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "openvc/attention.h"

namespace {

using openvc::testing::DevBuf;
using openvc::testing::download;
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
  const int64_t nq = openvc::num_quant_blocks(c.sq), nk = openvc::num_quant_blocks(c.sk), bh = int64_t(c.b) * c.h;
  DevBuf qc(size_t(c.b) * c.sq * c.h * c.d), kc(size_t(c.b) * c.sk * c.h * c.d);
  DevBuf qs(bh * nq * 4), ks(bh * nk * 4), vp(bh * c.d * openvc::packed_seqlen_k(c.sk)), vs(bh * 4);
  DevBuf ws(openvc::prepare_workspace_bytes(c.b, c.h, c.sk, false));
  openvc::PrepareParams pp;
  pp.dtype = c.dtype, pp.heads = c.h, pp.head_dim = c.d, pp.batch = c.b, pp.seqlen_q = c.sq, pp.seqlen_k = c.sk;
  const openvc::TokenTensorView qv = {q.p, c.zero_unit_strides && c.b == 1 ? 0 : bs,
                                      c.zero_unit_strides && c.sq == 1 ? 0 : ss, c.zero_unit_strides && c.h == 1 ? 0 : hs};
  pp.q = qv;
  pp.k = {k.p, int64_t(c.sk) * c.h * c.d, int64_t(c.h) * c.d, c.d};
  pp.v = {v.p, int64_t(c.sk) * c.h * c.d, int64_t(c.h) * c.d, c.d};
  pp.q_codes = qc.as<uint8_t>(), pp.q_descale = qs.as<float>(), pp.k_codes = kc.as<uint8_t>();
  pp.k_descale = ks.as<float>(), pp.v_packed = vp.as<uint8_t>(), pp.v_descale = vs.as<float>();
  pp.workspace = ws.p, pp.workspace_bytes = ws.bytes;
  const openvc::Status sp = openvc::prepare_fp8(pp, nullptr);
  ASSERT_TRUE(sp.ok()) << sp.message();

  const size_t nout = size_t(c.b) * c.sq * c.h * c.d, nlse = size_t(bh) * c.sq;
  DevBuf out_a(nout * 2), out_b(nout * 2), lse_a(nlse * 4), lse_b(nlse * 4);
  for (DevBuf* x : {&out_a, &out_b, &lse_a, &lse_b}) CUDA_OK(cudaMemset(x->p, 0xFF, x->bytes));
  openvc::AttentionParams ap;
  ap.in = {c.b, c.sq, c.sk, c.h, c.d, qc.as<uint8_t>(), qs.as<float>(), kc.as<uint8_t>(), ks.as<float>(),
           vp.as<uint8_t>(), vs.as<float>()};
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
  };
  for (const FusedCase& c : cases) {
    SCOPED_TRACE("b " + std::to_string(c.b) + " sq " + std::to_string(c.sq) + " sk " + std::to_string(c.sk) + " h " +
                 std::to_string(c.h) + " d " + std::to_string(c.d) + (c.causal ? " causal" : ""));
    run_fused_case(c);
  }
}

// The varlen modes (kFusedQMode | kVarlenMode): packed sequences, or batched Q with key counts, whose tiles' rows
// past a sequence's end belong to the next sequence and must stay out of its Q group.
struct VarlenFusedCase {
  int b, sq, sk, h, d;               // batched with key counts; packed: sq, sk the maximum lengths, b unused
  std::vector<int> cu_q, cu_k;       // packed offsets (empty: batched)
  std::vector<int> counts;           // key counts (batched)
  openvc::DType dtype;
  int q_head_pad;
  // Flat Q rows set to 40 (every head): the first rows past a sequence's end, which share a tile with its last
  // rows, so that a group that took them in would get another descale, and so other bits.
  std::vector<int64_t> spike_rows = {};
};

uint16_t bits_16(float f, openvc::DType dtype) {
  if (dtype == openvc::DType::kFloat16) {
    const __half v = __float2half(f);
    return *reinterpret_cast<const uint16_t*>(&v);
  }
  const __nv_bfloat16 v = __float2bfloat16(f);
  return *reinterpret_cast<const uint16_t*>(&v);
}

void run_varlen_fused_case(const VarlenFusedCase& c) {
  const bool packed = !c.cu_q.empty();
  const int groups = packed ? int(c.cu_q.size()) - 1 : c.b;
  const int64_t rows_q = packed ? c.cu_q.back() : int64_t(c.b) * c.sq;
  const int64_t rows_k = packed ? c.cu_k.back() : int64_t(c.b) * c.sk;
  const int64_t hs = c.d + c.q_head_pad, ss = int64_t(c.h) * hs, hd = int64_t(c.h) * c.d;
  std::vector<uint16_t> hq = random_16(size_t(rows_q * ss), 21 + c.d, c.dtype);
  for (int64_t r : c.spike_rows)
    for (int64_t i = 0; i < ss; ++i) hq[size_t(r * ss + i)] = bits_16(40.0f, c.dtype);
  const std::vector<uint16_t> hk = random_16(size_t(rows_k * hd), 22 + c.d, c.dtype);
  const std::vector<uint16_t> hv = random_16(size_t(rows_k * hd), 23 + c.d, c.dtype);
  DevBuf q(hq.size() * 2), k(hk.size() * 2), v(hv.size() * 2);
  ASSERT_TRUE(upload(q.p, hq) && upload(k.p, hk) && upload(v.p, hv));
  DevBuf cu_q(c.cu_q.size() * 4 + 4), cu_k(c.cu_k.size() * 4 + 4), counts(c.counts.size() * 4 + 4);
  if (packed) ASSERT_TRUE(upload(cu_q.p, c.cu_q) && upload(cu_k.p, c.cu_k));
  if (!c.counts.empty()) ASSERT_TRUE(upload(counts.p, c.counts));
  const int64_t nq = openvc::num_quant_blocks(c.sq), nk = openvc::num_quant_blocks(c.sk), gh = int64_t(groups) * c.h;
  DevBuf qc(size_t(rows_q * hd)), kc(size_t(rows_k * hd));
  DevBuf qs(gh * nq * 4), ks(gh * nk * 4), vp(gh * c.d * openvc::packed_seqlen_k(c.sk)), vs(gh * 4);
  DevBuf ws(openvc::prepare_workspace_bytes(groups, c.h, c.sk, false));
  openvc::PrepareParams pp;
  pp.dtype = c.dtype, pp.heads = c.h, pp.head_dim = c.d;
  if (packed) {
    pp.cu_seqlens_q = cu_q.as<int>(), pp.cu_seqlens_k = cu_k.as<int>(), pp.num_seqs = groups;
    pp.max_seqlen_q = c.sq, pp.max_seqlen_k = c.sk, pp.total_q = rows_q, pp.total_k = rows_k;
  } else {
    pp.batch = c.b, pp.seqlen_q = c.sq, pp.seqlen_k = c.sk;
  }
  if (!c.counts.empty()) pp.seqused_k = counts.as<int>();
  // One query per batch entry: sequence stride 0, as the Python views pass it for a size-1 dimension.
  const openvc::TokenTensorView qv = {q.p, packed ? 0 : int64_t(c.sq) * ss, c.sq == 1 && !packed ? 0 : ss, hs};
  pp.q = qv;
  pp.k = {k.p, packed ? 0 : int64_t(c.sk) * hd, hd, c.d};
  pp.v = {v.p, packed ? 0 : int64_t(c.sk) * hd, hd, c.d};
  pp.q_codes = qc.as<uint8_t>(), pp.q_descale = qs.as<float>(), pp.k_codes = kc.as<uint8_t>();
  pp.k_descale = ks.as<float>(), pp.v_packed = vp.as<uint8_t>(), pp.v_descale = vs.as<float>();
  pp.workspace = ws.p, pp.workspace_bytes = ws.bytes;
  const openvc::Status sp = openvc::prepare_fp8(pp, nullptr);
  ASSERT_TRUE(sp.ok()) << sp.message();

  const size_t nout = size_t(rows_q * hd), nlse = size_t(packed ? c.h * rows_q : gh * c.sq);
  DevBuf out_a(nout * 2), out_b(nout * 2), lse_a(nlse * 4), lse_b(nlse * 4);
  for (DevBuf* x : {&out_a, &out_b, &lse_a, &lse_b}) CUDA_OK(cudaMemset(x->p, 0xFF, x->bytes));
  openvc::AttentionParams ap;
  ap.in = {packed ? 1 : c.b, c.sq, c.sk, c.h, c.d, qc.as<uint8_t>(), qs.as<float>(), kc.as<uint8_t>(),
           ks.as<float>(), vp.as<uint8_t>(), vs.as<float>()};
  ap.out_stride_batch = packed ? 0 : int64_t(c.sq) * hd, ap.out_stride_seq = hd, ap.out_stride_head = c.d;
  ap.cu_seqlens_q = pp.cu_seqlens_q, ap.cu_seqlens_k = pp.cu_seqlens_k, ap.num_seqs = pp.num_seqs;
  ap.max_seqlen_q = pp.max_seqlen_q, ap.max_seqlen_k = pp.max_seqlen_k, ap.total_q = pp.total_q;
  ap.total_k = pp.total_k, ap.seqused_k = pp.seqused_k;
  ap.out = out_a.p, ap.lse = lse_a.as<float>();
  openvc::Status st = openvc::attention_fp8(ap, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  ap.in.q_codes = nullptr, ap.in.q_descale = nullptr;
  ap.q_unquantized = qv, ap.q_unquantized_dtype = c.dtype;
  ap.out = out_b.p, ap.lse = lse_b.as<float>();
  st = openvc::attention_fp8(ap, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(download<uint16_t>(out_a.p, nout), download<uint16_t>(out_b.p, nout));
  EXPECT_EQ(download<uint32_t>(lse_a.p, nlse), download<uint32_t>(lse_b.p, nlse));
}

TEST(Sm90FusedQ, VarlenSameBitsAsPreparedQ) {
  SKIP_WITHOUT_SM90();
  using openvc::DType;
  const VarlenFusedCase cases[] = {
      // packed, uneven: an empty query sequence, one of 720 rows (its last tile ends inside the next sequence)
      {0, 720, 1000, 3, 128, {0, 300, 300, 1020, 1100}, {0, 500, 629, 1629, 1700}, {}, DType::kBFloat16, 8,
       {300, 1020}},
      {0, 2500, 2500, 4, 64, {0, 2500, 2629, 5000}, {0, 2500, 2629, 5000}, {}, DType::kFloat16, 0, {2500, 2629}},
      // batched with key counts: a batch entry without keys (its tiles write zeros and -inf, no Q is read)
      {2, 700, 900, 3, 128, {}, {}, {900, 0}, DType::kBFloat16, 0, {700}},
      {3, 1000, 1000, 8, 64, {}, {}, {1, 500, 1000}, DType::kBFloat16, 16, {1000, 2000}},
      {2, 4096, 4100, 16, 128, {}, {}, {4100, 2049}, DType::kFloat16, 0},   // more tiles than SMs
      // one query per batch entry (decode): the flat rows step by the batch stride, the sequence stride 0
      {5, 1, 900, 4, 128, {}, {}, {900, 5, 0, 128, 129}, DType::kBFloat16, 8},
  };
  for (const VarlenFusedCase& c : cases) {
    SCOPED_TRACE(std::string(c.cu_q.empty() ? "key counts" : "packed") + " sq " + std::to_string(c.sq) + " sk " +
                 std::to_string(c.sk) + " h " + std::to_string(c.h) + " d " + std::to_string(c.d));
    run_varlen_fused_case(c);
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
  p.q_unquantized_dtype = openvc::DType::kBFloat16;
  // Key counts read Q as B * Sq flat rows: a batch stride other than Sq rows is refused, causal too.
  alignas(16) static int counts[2] = {128, 128};
  p.in.batch = 2, p.seqused_k = counts;
  p.q_unquantized.stride_batch = 256 * 128;
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("seqused_k"), std::string::npos) << st.message();
  p.q_unquantized.stride_batch = 128 * 128, p.causal = true;
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kUnsupported) << st.message();
  EXPECT_NE(st.message().find("q_unquantized"), std::string::npos) << st.message();
  p.in.batch = 1, p.seqused_k = nullptr, p.causal = false;
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
