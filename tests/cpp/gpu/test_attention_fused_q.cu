// Q quantized inside the attention kernel (AttentionParams::q_unquantized, kFusedQMode): the same output and
// LSE bits as prepare_fp8's Q codes and descales fed to attention_fp8, for BF16 and FP16 Q, head dim 128 and 64,
// plain and causal, partial last query tiles, Sq != Sk, a Q tensor with padded rows, many tiles per CTA and the
// zero strides of size-1 dimensions; and the argument rules.
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
      // the last key count of the few-keys mode (6 blocks) and the first of the plain mode (7), many tiles
      {2, 4000, 768, 12, 128, false, DType::kBFloat16, 0},
      {2, 4000, 800, 12, 128, false, DType::kFloat16, 0},
  };
  for (const FusedCase& c : cases) {
    SCOPED_TRACE("b " + std::to_string(c.b) + " sq " + std::to_string(c.sq) + " sk " + std::to_string(c.sk) + " h " +
                 std::to_string(c.h) + " d " + std::to_string(c.d) + (c.causal ? " causal" : ""));
    run_fused_case(c);
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
