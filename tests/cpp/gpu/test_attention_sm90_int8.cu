// The INT8 Q/K mode on the GPU (numerics section 9): prepare_fp8 with qk_format kInt8 writes the codes
// and descales of the CPU reference bit for bit, and the sm_90a kernel's INT8 mode matches the reference's
// attention on the same codes (its scores are exact integers; only the FP8 PV accumulation differs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "openvc/attention.h"
#include "openvc/reference.h"
#include "reference/test_inputs.h"

namespace {

namespace ref = openvc::reference;
using namespace openvc::testing;

std::vector<float> normal_bf16(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = ref::round_to_bf16(scale * g(rng));
  return x;
}

std::vector<uint16_t> bf16_bits(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    b[i] = static_cast<uint16_t>(u >> 16);   // exact: x is BF16-rounded
  }
  return b;
}

struct Int8Case {
  int B, sq, sk, H;
  float qk_scale;   // q and k multiplied by this (sharp heads)
  bool video;
  // >= 0: this query row of (b, h) = (0, 0) times 1e4 as well, so that one warp's rows alone put the tile past
  // tile_may_be_huge's bound (scores of ~1e4 nats: not huge, every code the reference's).
  int huge_q_row = -1;
};

// Device buffers of one batched case (D = 128; q_descale per row; k_descale room for [B, H, nk, 8]).
struct Gpu {
  static size_t el(int b, int s, int h) { return size_t(b) * s * h * 128; }
  static size_t nk(int sk) { return size_t(openvc::num_quant_blocks(sk)); }
  explicit Gpu(const Int8Case& c)
      : q(el(c.B, c.sq, c.H) * 2), k(el(c.B, c.sk, c.H) * 2), v(el(c.B, c.sk, c.H) * 2), qc(el(c.B, c.sq, c.H)),
        kc(el(c.B, c.sk, c.H)), vp(size_t(c.B) * c.H * 128 * nk(c.sk) * 128), qs(size_t(c.B) * c.H * c.sq * 4),
        ks(size_t(c.B) * c.H * nk(c.sk) * openvc::kInt8KeyGroups * 4), vs(size_t(c.B) * c.H * 4),
        ws(std::max<size_t>(openvc::prepare_workspace_bytes(c.B, c.H, c.sk, false), 16)) {}
  DevBuf q, k, v, qc, kc, vp, qs, ks, vs, ws;
  openvc::PrepareParams pp;
};

void inputs(const Int8Case& c, std::vector<float>& q, std::vector<float>& k, std::vector<float>& v) {
  const int D = 128;
  const ref::Sequences qs = ref::Sequences::Batched(c.B, c.sq, c.H, D), ks = ref::Sequences::Batched(c.B, c.sk, c.H, D);
  if (c.video) {
    auto qkv = ref::testing::video_like(qs, ks, 77u + c.sq + c.sk);
    q = std::move(qkv.q), k = std::move(qkv.k), v = std::move(qkv.v);
  } else {
    q = normal_bf16(size_t(c.B) * c.sq * c.H * D, 5u + c.sq, 1.0f);
    k = normal_bf16(size_t(c.B) * c.sk * c.H * D, 6u + c.sk, 1.0f);
    v = normal_bf16(size_t(c.B) * c.sk * c.H * D, 7u + c.sk, 1.0f);
  }
  for (float& x : q) x = ref::round_to_bf16(x * c.qk_scale);
  for (float& x : k) x = ref::round_to_bf16(x * c.qk_scale);
  if (c.huge_q_row >= 0)
    for (int d = 0; d < D; ++d) {
      float& x = q[size_t(c.huge_q_row) * c.H * D + d];
      x = ref::round_to_bf16(x * 1e4f);
    }
}

// The case's inputs (q, k, v filled) and their INT8 preparation on the GPU.
void prepare_case(const Int8Case& c, std::vector<float>& q, std::vector<float>& k, std::vector<float>& v, Gpu& g) {
  inputs(c, q, k, v);
  const int D = 128;
  ASSERT_TRUE(upload(g.q.p, bf16_bits(q)) && upload(g.k.p, bf16_bits(k)) && upload(g.v.p, bf16_bits(v)));
  CUDA_OK(cudaMemset(g.qs.p, 0xFF, g.qs.bytes));   // NaN poison: every descale must be written
  CUDA_OK(cudaMemset(g.ks.p, 0xFF, g.ks.bytes));
  openvc::PrepareParams& p = g.pp;
  p.dtype = openvc::DType::kBFloat16;
  p.qk_format = openvc::QkFormat::kInt8;
  p.batch = c.B, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.heads = c.H, p.head_dim = D;
  p.q = {g.q.p, int64_t(c.sq) * c.H * D, int64_t(c.H) * D, D};
  p.k = {g.k.p, int64_t(c.sk) * c.H * D, int64_t(c.H) * D, D};
  p.v = {g.v.p, int64_t(c.sk) * c.H * D, int64_t(c.H) * D, D};
  p.q_codes = g.qc.as<uint8_t>(), p.q_descale = g.qs.as<float>(), p.k_codes = g.kc.as<uint8_t>();
  p.k_descale = g.ks.as<float>(), p.v_packed = g.vp.as<uint8_t>(), p.v_descale = g.vs.as<float>();
  p.workspace = g.ws.p, p.workspace_bytes = g.ws.bytes;
  const openvc::Status st = openvc::prepare_fp8(p, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
}


TEST(Sm90Int8, PrepareWritesTheReferenceCodesBitForBit) {
  SKIP_WITHOUT_SM90();
  for (const Int8Case& c : {Int8Case{2, 300, 700, 3, 1.0f, false}, Int8Case{1, 129, 1, 2, 4.0f, false},
                            Int8Case{1, 1000, 1000, 2, 1.0f, true}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Sq=" << c.sq << " Sk=" << c.sk << " H=" << c.H);
    std::vector<float> q, k, v;
    Gpu g(c);
    ASSERT_NO_FATAL_FAILURE(prepare_case(c, q, k, v, g));
    const ref::Sequences qs = ref::Sequences::Batched(c.B, c.sq, c.H, 128), ks = ref::Sequences::Batched(c.B, c.sk, c.H, 128);
    ref::Int8Quantized rq, rk;
    ASSERT_TRUE(ref::quantize_int8_rows(q.data(), qs, &rq).ok());
    ASSERT_TRUE(ref::quantize_int8_blocks(k.data(), ks, false, &rk).ok());
    const auto qc = download<int8_t>(g.qc.p, rq.codes.size()), kc = download<int8_t>(g.kc.p, rk.codes.size());
    const auto qd = download<float>(g.qs.p, rq.descale.size()), kd = download<float>(g.ks.p, rk.descale.size());
    int64_t bad_qc = 0, bad_kc = 0, bad_qd = 0, bad_kd = 0;
    for (size_t i = 0; i < qc.size(); ++i) bad_qc += qc[i] != rq.codes[i];
    for (size_t i = 0; i < kc.size(); ++i) bad_kc += kc[i] != rk.codes[i];
    for (size_t i = 0; i < qd.size(); ++i) bad_qd += std::memcmp(&qd[i], &rq.descale[i], 4) != 0;
    for (size_t i = 0; i < kd.size(); ++i) bad_kd += std::memcmp(&kd[i], &rk.descale[i], 4) != 0;
    EXPECT_EQ(bad_qc, 0) << "Q codes";
    EXPECT_EQ(bad_kc, 0) << "K codes";
    EXPECT_EQ(bad_qd, 0) << "Q row descales";
    EXPECT_EQ(bad_kd, 0) << "K block descales";
  }
}

TEST(Sm90Int8, AttentionMatchesTheReferenceOnTheSameCodes) {
  SKIP_WITHOUT_SM90();
  for (const Int8Case& c : {Int8Case{2, 300, 700, 3, 1.0f, false}, Int8Case{1, 1000, 1000, 2, 1.0f, true},
                            Int8Case{1, 777, 2049, 2, 4.0f, false}, Int8Case{1, 1, 257, 1, 1.0f, false},
                            // the warps of a warpgroup must agree on the huge-score steps (kernel.cuh)
                            Int8Case{1, 300, 700, 2, 1.0f, false, 5}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Sq=" << c.sq << " Sk=" << c.sk << " H=" << c.H
                                      << " x" << c.qk_scale << " huge row " << c.huge_q_row);
    const int D = 128, H = c.H;
    std::vector<float> q, k, v;
    Gpu g(c);
    ASSERT_NO_FATAL_FAILURE(prepare_case(c, q, k, v, g));
    const ref::Sequences qs = ref::Sequences::Batched(c.B, c.sq, H, D), ks = ref::Sequences::Batched(c.B, c.sk, H, D);
    ref::PrepareOptions po;
    po.qk_format = ref::QkFormat::kInt8;
    ref::PreparedInputs prep;
    ASSERT_TRUE(ref::prepare_inputs(q.data(), k.data(), v.data(), qs, ks, po, &prep).ok());
    ref::AttentionOptions opt;
    ref::AttentionResult want;
    ASSERT_TRUE(ref::attention_expcast(prep, opt, &want).ok());

    // The kernel reads K descales per key group, [B, H, nk, 8] (numerics section 9). A preparation that
    // writes one per block (the reference's layout says which) has them repeated for the 8 groups.
    const size_t bh_blocks = size_t(c.B) * H * Gpu::nk(c.sk);
    ASSERT_TRUE(prep.k8.descale.size() == bh_blocks || prep.k8.descale.size() == bh_blocks * 8);
    DevBuf kd_groups(bh_blocks * 8 * 4);
    const float* k_descale = g.pp.k_descale;
    if (prep.k8.descale.size() == bh_blocks) {
      const auto per_block = download<float>(g.ks.p, bh_blocks);
      std::vector<float> groups(bh_blocks * 8);
      for (size_t i = 0; i < groups.size(); ++i) groups[i] = per_block[i / 8];
      ASSERT_TRUE(upload(kd_groups.p, groups));
      k_descale = kd_groups.as<float>();
    }
    const size_t n = size_t(c.B) * c.sq * H * D;
    DevBuf dout(n * 2), dlse(size_t(c.B) * H * c.sq * 4);
    CUDA_OK(cudaMemset(dout.p, 0xFF, dout.bytes));
    CUDA_OK(cudaMemset(dlse.p, 0xFF, dlse.bytes));
    openvc::AttentionParams p;
    p.in = {c.B, c.sq, c.sk, H, D, g.pp.q_codes, g.pp.q_descale, g.pp.k_codes, k_descale, g.pp.v_packed,
            g.pp.v_descale};
    p.in.qk_format = openvc::QkFormat::kInt8;
    p.out = dout.p;
    p.out_stride_batch = int64_t(c.sq) * H * D, p.out_stride_seq = int64_t(H) * D, p.out_stride_head = D;
    p.lse = dlse.as<float>();
    const openvc::Status st = openvc::attention_fp8(p, nullptr);
    ASSERT_TRUE(st.ok()) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    const auto bits = download<uint16_t>(dout.p, n);
    const auto lse = download<float>(dlse.p, size_t(c.B) * H * c.sq);
    std::vector<float> got(n);
    std::vector<double> want_d(n);
    int64_t non_finite = 0;
    double ref_max = 0;
    for (size_t i = 0; i < n; ++i) {
      got[i] = bf16_to_float(bits[i]);
      non_finite += !std::isfinite(got[i]);
      want_d[i] = ref::round_to_bf16(want.out[i]);
      ref_max = std::max(ref_max, std::fabs(want_d[i]));
    }
    ASSERT_EQ(non_finite, 0) << "output elements left unwritten or NaN";
    const ref::ErrorMetrics e = ref::compare(got.data(), want_d.data(), int64_t(n));
    // Exact integer scores: the codes are the reference's; what differs is the FP8 tensor-core PV sum
    // (about 13 mantissa bits, truncating) before each FP32 flush.
    EXPECT_LE(e.rel_l2, 1e-2);
    EXPECT_LE(e.max_abs, 0.04 * ref_max + 1e-3);
    double lse_err = 0;
    for (int b = 0; b < c.B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < c.sq; ++i) {
          const float gl = lse[(size_t(b) * H + h) * c.sq + i], wl = want.lse[(size_t(b) * H + h) * c.sq + i];
          ASSERT_TRUE(std::isfinite(gl)) << "lse at b=" << b << " h=" << h << " i=" << i;
          lse_err = std::max(lse_err, std::fabs(double(gl) - wl));
        }
    EXPECT_LE(lse_err, 0.01);
    std::vector<double> exact;
    ASSERT_TRUE(ref::attention_exact(q.data(), k.data(), v.data(), qs, ks, 0.0f, false, &exact).ok());
    const ref::ErrorMetrics ek = ref::compare(got.data(), exact.data(), int64_t(n));
    const ref::ErrorMetrics er = ref::compare(want.out.data(), exact.data(), int64_t(n));
    EXPECT_LE(ek.rel_l2, 1.05 * er.rel_l2 + 1e-3);
    std::printf("  [int8 B=%d Sq=%d Sk=%d H=%d x%g] vs ref rel_l2 %.2e max_abs %.2e lse %.2e | vs exact gpu %.4f "
                "ref %.4f\n", c.B, c.sq, c.sk, H, c.qk_scale, e.rel_l2, e.max_abs, lse_err, ek.rel_l2, er.rel_l2);
  }
}

TEST(Sm90Int8, OtherModesAreRejectedByName) {
  SKIP_WITHOUT_SM90();
  const Int8Case c{1, 256, 256, 1, 1.0f, false};
  std::vector<float> q, k, v;
  Gpu g(c);
  ASSERT_NO_FATAL_FAILURE(prepare_case(c, q, k, v, g));
  DevBuf dout(size_t(256) * 128 * 2);
  openvc::AttentionParams p;
  p.in = {1, 256, 256, 1, 128, g.pp.q_codes, g.pp.q_descale, g.pp.k_codes, g.pp.k_descale, g.pp.v_packed,
          g.pp.v_descale};
  p.in.qk_format = openvc::QkFormat::kInt8;
  p.out = dout.p, p.out_stride_seq = 128, p.out_stride_head = 128;
  p.repair.rows = 1;   // repair rows take E4M3 Q/K only (causal, packed and key counts take INT8)
  openvc::Status st = openvc::attention_fp8(p, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("qk_format"), std::string::npos) << st.message();
  // prepare_fp8 takes kInt8 with seqused_k, packed sequences and head dim 64 (test_prepare_int8.cu).
}

}  // namespace
