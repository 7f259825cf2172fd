// The general attention path (openvc::attention_general) against the CPU reference fed the SAME
// quantized inputs and order. The kernel implements the reference arithmetic (exact FP8 dot products,
// the same codes, maxima and tile sums), so it must match the reference's output rounded to BF16
// almost everywhere; only A's FP32 accumulation (the reference keeps double) can move an element by
// one BF16 step. Also against exact FP64 attention: as accurate as the reference. Inputs are prepared
// on the host by the reference and packed here, so these tests do not depend on prepare_fp8.
// Run: openvc_gpu_tests --gtest_filter='GeneralAttention*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "openvc/general.h"
#include "openvc/reference.h"
#include "reference/test_inputs.h"

namespace {

namespace ref = openvc::reference;
using openvc::testing::bf16_to_float;
using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::pack_v;
using openvc::testing::upload;

struct Case {
  std::vector<int> lens_q, lens_k;  // one entry per sequence
  bool packed;                      // cu_seqlens (else batched: all lengths equal)
  int heads, head_dim;
  bool causal;
  int mid_window;                   // ref::kNaturalOrder for natural order
  bool video;                       // video-like inputs, else random normal
  int extra_max = 0;                // packed: max_seqlen_q/k given this much above the true maximum
  float softmax_scale = 0.0f;
  bool padded_out = false;          // output with gaps between tokens (must stay untouched)
};

std::vector<int> offsets(const std::vector<int>& lens) {
  std::vector<int> cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  return cu;
}

ref::Sequences sequences(const std::vector<int>& lens, int H, int D) {
  ref::Sequences s;
  s.cu_seqlens = offsets(lens);
  s.num_heads = H;
  s.head_dim = D;
  return s;
}

std::vector<float> random_normal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) {
    do v = ref::round_to_bf16(g(rng));
    while (v == 0.0f);
  }
  return x;
}

// Device copy of a host vector (at least 16 bytes, so empty arrays still get a valid pointer).
template <typename T>
struct Dev {
  DevBuf buf;
  explicit Dev(const std::vector<T>& h) : buf(std::max<size_t>(h.size() * sizeof(T), 16)) {
    if (!h.empty() && buf.p) upload(buf.p, h);
  }
  T* ptr() const { return buf.as<T>(); }
};

void run_case(const Case& c) {
  const int H = c.heads, D = c.head_dim, nseq = int(c.lens_q.size());
  SCOPED_TRACE(::testing::Message() << (c.packed ? "packed" : "batched") << " nseq=" << nseq << " Sq0="
                                    << c.lens_q[0] << " Sk0=" << c.lens_k[0] << " H=" << H << " D=" << D
                                    << (c.causal ? " causal" : "") << " w=" << c.mid_window
                                    << (c.video ? " video" : " normal"));
  const ref::Sequences qs = sequences(c.lens_q, H, D), ks = sequences(c.lens_k, H, D);
  const int total_q = qs.total_tokens(), total_k = ks.total_tokens();
  std::vector<float> q, k, v;
  if (c.video) {
    auto qkv = ref::testing::video_like(qs, ks, 1234u + total_q + 7u * total_k + H + D);
    q = std::move(qkv.q), k = std::move(qkv.k), v = std::move(qkv.v);
  } else {
    q = random_normal(size_t(total_q) * H * D, 11u + total_q);
    k = random_normal(size_t(total_k) * H * D, 12u + total_k);
    v = random_normal(size_t(total_k) * H * D, 13u + total_k);
  }
  ref::PreparedInputs prep;
  ASSERT_TRUE(ref::prepare_inputs(q.data(), k.data(), v.data(), qs, ks, &prep).ok());
  ref::AttentionOptions opt;
  opt.mid_window_blocks = c.mid_window;
  opt.causal = c.causal;
  opt.softmax_scale = c.softmax_scale;
  ref::AttentionResult want;
  ASSERT_TRUE(ref::attention_expcast(prep, opt, &want).ok());

  // Packed: the arrays are laid out for max_seqlen (possibly an upper bound above the true maximum).
  const int max_q = qs.max_length() + (c.packed ? c.extra_max : 0);
  const int max_k = ks.max_length() + (c.packed ? c.extra_max : 0);
  const int nq = int(openvc::num_quant_blocks(max_q)), nk = int(openvc::num_quant_blocks(max_k));
  auto relayout = [&](const std::vector<float>& d, int have, int want_blocks) {   // [nseq, H, blocks]
    std::vector<float> out(size_t(nseq) * H * want_blocks, 0.0f);
    for (size_t g = 0; g < size_t(nseq) * H; ++g)
      for (int b = 0; b < have; ++b) out[g * want_blocks + b] = d[g * have + b];
    return out;
  };
  const Dev<uint8_t> dq(prep.q.codes), dk(prep.k.codes), dv(pack_v(prep.v.codes, ks, nk));
  const Dev<float> dqs(relayout(prep.q.descale, prep.q.max_blocks, nq));
  const Dev<float> dks(relayout(prep.k.descale, prep.k.max_blocks, nk));
  const Dev<float> dvs(prep.v.descale);
  const Dev<int> dcu_q(qs.cu_seqlens), dcu_k(ks.cu_seqlens);

  // Output [total_q, H, D] (batched: the same memory as [B, Sq, H, D]), optionally with gaps.
  const int64_t s_head = D, s_seq = int64_t(H) * D + (c.padded_out ? 24 : 0);
  const size_t out_elems = size_t(std::max(total_q, 1)) * s_seq;
  DevBuf dout(out_elems * 2), dlse(std::max<size_t>(size_t(H) * total_q * 4, 16));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaMemsetAsync(dout.p, 0xFF, dout.bytes, stream));   // BF16 NaN poison
  CUDA_OK(cudaMemsetAsync(dlse.p, 0xFF, dlse.bytes, stream));   // FP32 NaN poison

  openvc::GeneralAttentionParams p;
  p.in.heads = H, p.in.head_dim = D;
  p.in.q_codes = dq.ptr(), p.in.q_descale = dqs.ptr(), p.in.k_codes = dk.ptr(), p.in.k_descale = dks.ptr();
  p.in.v_packed = dv.ptr(), p.in.v_descale = dvs.ptr();
  p.causal = c.causal;
  p.out = dout.p;
  p.out_stride_seq = s_seq, p.out_stride_head = s_head;
  p.lse = dlse.as<float>();
  p.softmax_scale = c.softmax_scale;
  p.mid_window_blocks = c.mid_window;
  // LSE: batched [B, H, Sq]; packed [H, total_q].
  auto lse_index = [&](int s, int h, int i) -> size_t {
    return c.packed ? size_t(h) * total_q + qs.cu_seqlens[s] + i : (size_t(s) * H + h) * c.lens_q[0] + i;
  };
  if (c.packed) {
    p.cu_seqlens_q = dcu_q.ptr(), p.cu_seqlens_k = dcu_k.ptr();
    p.total_q = total_q, p.total_k = total_k;
    p.num_seqs = nseq, p.max_seqlen_q = max_q, p.max_seqlen_k = max_k;
    p.lse_stride_head = total_q;
  } else {
    p.in.batch = nseq, p.in.seqlen_q = c.lens_q[0], p.in.seqlen_k = c.lens_k[0];
    p.out_stride_batch = int64_t(c.lens_q[0]) * s_seq;
    p.lse_stride_batch = int64_t(H) * c.lens_q[0], p.lse_stride_head = c.lens_q[0];
  }
  const openvc::Status st = openvc::attention_general(p, stream);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));

  const std::vector<uint16_t> out_bits = download<uint16_t>(dout.p, out_elems);
  const std::vector<float> lse = download<float>(dlse.p, size_t(H) * total_q);
  ASSERT_EQ(out_bits.size(), out_elems);
  const size_t n = size_t(total_q) * H * D;
  std::vector<float> got(n), want_bf16(n);
  int64_t non_finite = 0, gap_written = 0, differ = 0;
  for (int64_t t = 0; t < total_q; ++t)
    for (int64_t e = 0; e < s_seq; ++e) {
      const uint16_t bits = out_bits[t * s_seq + e];
      if (e >= int64_t(H) * D) {
        gap_written += bits != 0xFFFF;
        continue;
      }
      const size_t i = size_t(t) * H * D + e;
      got[i] = bf16_to_float(bits);
      want_bf16[i] = ref::round_to_bf16(want.out[i]);
      non_finite += !std::isfinite(got[i]);
      differ += got[i] != want_bf16[i];
    }
  ASSERT_EQ(non_finite, 0) << "output elements left unwritten or NaN";
  EXPECT_EQ(gap_written, 0) << "the kernel wrote between output rows";

  // Same arithmetic as the reference up to A's FP32 rounding: a BF16 step on rare elements only.
  std::vector<double> want_d(want_bf16.begin(), want_bf16.end());
  const ref::ErrorMetrics e = ref::compare(got.data(), want_d.data(), int64_t(n));
  double ref_max = 0;
  for (double x : want_d) ref_max = std::max(ref_max, std::fabs(x));
  EXPECT_LE(e.rel_l2, 1e-3);
  EXPECT_LE(e.max_abs, 1.0 / 128 * ref_max + 1e-6);   // at most one BF16 step of the largest value
  EXPECT_LE(double(differ), 0.01 * double(n) + 1) << differ << " of " << n << " BF16 values differ";

  // LSE: the same maxima and tile sums; only the last bits of l may differ.
  double lse_err = 0;
  int64_t lse_bad = 0, lse_rows = 0;
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < c.lens_q[s]; ++i) {
        const float g = lse[lse_index(s, h, i)], w = want.lse[(size_t(s) * H + h) * qs.max_length() + i];
        ++lse_rows;
        if (std::isinf(w) && w < 0) {
          lse_bad += !(std::isinf(g) && g < 0);   // no visible key: -inf like the reference
          continue;
        }
        if (!std::isfinite(g)) {
          ++lse_bad;
          continue;
        }
        lse_err = std::max(lse_err, std::fabs(double(g) - w));
      }
  EXPECT_EQ(lse_bad, 0) << "of " << lse_rows << " LSE rows";
  EXPECT_LE(lse_err, 1e-4);

  // Against exact attention on the original inputs: as accurate as the reference (within 10%), for
  // the output and for the LSE (the exact log-sum-exp).
  std::vector<double> exact, exact_lse;
  ASSERT_TRUE(ref::attention_exact(q.data(), k.data(), v.data(), qs, ks, c.softmax_scale, c.causal, &exact,
                                   &exact_lse).ok());
  const ref::ErrorMetrics ek = ref::compare(got.data(), exact.data(), int64_t(n));
  const ref::ErrorMetrics er = ref::compare(want.out.data(), exact.data(), int64_t(n));
  EXPECT_LE(ek.rel_l2, 1.1 * er.rel_l2 + 1e-4);
  double lse_ek = 0, lse_er = 0;
  int64_t finite_rows = 0;
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < c.lens_q[s]; ++i) {
        const double x = exact_lse[(size_t(s) * H + h) * qs.max_length() + i];
        const double w = want.lse[(size_t(s) * H + h) * qs.max_length() + i];
        const float g = lse[lse_index(s, h, i)];
        if (std::isinf(x)) {
          EXPECT_TRUE(std::isinf(g) && g < 0) << "exact lse -inf (no visible key) at s=" << s << " h=" << h << " i=" << i;
          continue;
        }
        ++finite_rows;
        lse_ek += std::fabs(double(g) - x);
        lse_er += std::fabs(w - x);
      }
  if (finite_rows > 0) {
    lse_ek /= double(finite_rows), lse_er /= double(finite_rows);
    EXPECT_LE(lse_ek, 1.1 * lse_er + 1e-5);
    // Sanity bound: ExpCast moves each weight by at most about 7.5% (numerics.md section 3), and FP8
    // quantization moves the scores (measured with the reference: up to 0.06 mean on these inputs).
    EXPECT_LE(lse_ek, 0.1);
  }
  std::printf("  [%s nseq=%d H=%d D=%d%s w=%d] vs ref: rel_l2 %.1e max_abs %.1e, %lld/%zu differ, lse %.1e | "
              "vs exact: gpu %.4f ref %.4f, lse mean %.4f ref %.4f\n",
              c.packed ? "packed" : "batched", nseq, H, D, c.causal ? " causal" : "", c.mid_window, e.rel_l2,
              e.max_abs, static_cast<long long>(differ), n, lse_err, ek.rel_l2, er.rel_l2, lse_ek, lse_er);
}

Case batched(int B, int sq, int sk, int H, int D, bool causal, int w, bool video) {
  return Case{std::vector<int>(B, sq), std::vector<int>(B, sk), false, H, D, causal, w, video};
}

TEST(GeneralAttention, BatchedNonCausalShapes) {
  SKIP_WITHOUT_SM90();
  for (int s : {1, 127, 128, 1000}) run_case(batched(2, s, s, 2, 128, false, 4, true));
  run_case(batched(1, 1000, 1000, 1, 128, false, ref::kNaturalOrder, false));
}

TEST(GeneralAttention, CausalSelf) {
  SKIP_WITHOUT_SM90();
  for (int d : {128, 64}) {
    run_case(batched(1, 1000, 1000, 2, d, true, 4, true));
    run_case(batched(2, 127, 127, 1, d, true, ref::kNaturalOrder, false));
  }
  run_case(batched(1, 1, 1, 1, 128, true, 4, false));
}

TEST(GeneralAttention, CausalCross) {
  SKIP_WITHOUT_SM90();
  run_case(batched(1, 300, 1000, 2, 128, true, 4, true));    // Sq < Sk: every row sees Sk - Sq + i + 1 keys
  run_case(batched(2, 1000, 300, 1, 64, true, 4, false));    // Sq > Sk: the first 700 rows see no key
  run_case(batched(1, 1000, 128, 1, 128, true, ref::kNaturalOrder, true));
}

TEST(GeneralAttention, CrossNonCausal) {
  SKIP_WITHOUT_SM90();
  run_case(batched(2, 200, 1000, 2, 64, false, ref::kNaturalOrder, true));
  run_case(batched(1, 1000, 200, 2, 64, false, 0, false));
  Case scaled = batched(1, 300, 700, 2, 128, false, 4, true);
  scaled.softmax_scale = 0.05f;
  scaled.padded_out = true;
  run_case(scaled);
}

TEST(GeneralAttention, PackedThreeSequences) {
  SKIP_WITHOUT_SM90();
  run_case(Case{{1, 300, 1000}, {1000, 300, 1}, true, 2, 128, false, 4, true});
  run_case(Case{{1, 300, 1000}, {1, 300, 1000}, true, 2, 64, true, 4, true});
  run_case(Case{{1, 300, 1000}, {700, 129, 1000}, true, 1, 128, true, ref::kNaturalOrder, false});
  // max_seqlen given above the true maximum (an upper bound is allowed), padded output rows.
  Case bound{{300, 1, 1000}, {1000, 300, 1}, true, 2, 64, false, 4, false};
  bound.extra_max = 200;
  bound.padded_out = true;
  run_case(bound);
}

TEST(GeneralAttention, PackedEmptySequences) {
  SKIP_WITHOUT_SM90();
  // An empty key sequence gives output 0 and lse -inf; an empty query sequence writes nothing.
  run_case(Case{{5, 0, 200, 130}, {0, 100, 130, 300}, true, 2, 128, false, 4, false});
  run_case(Case{{5, 0, 200, 130}, {0, 100, 130, 300}, true, 2, 64, true, 4, true});
}

// ---- argument checks (no device needed) ----------------------------------------------------------

void expect_invalid(const openvc::GeneralAttentionParams& p, const std::string& needle) {
  const openvc::Status st = openvc::attention_general(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kInvalidArgument) << needle << ": " << st.message();
  EXPECT_NE(st.message().find(needle), std::string::npos) << "expected '" << needle << "' in: " << st.message();
}

TEST(GeneralAttention, RejectsBadArguments) {
  alignas(16) static uint8_t fake[256];
  const float* f = reinterpret_cast<const float*>(fake);
  openvc::GeneralAttentionParams good;
  good.in = {1, 200, 300, 2, 128, fake, f, fake, f, fake, f};
  good.out = fake;
  good.out_stride_batch = 200 * 256, good.out_stride_seq = 256, good.out_stride_head = 128;
  auto p = good;
  p.in.head_dim = 96;
  expect_invalid(p, "in.head_dim: the general path takes 64 or 128, got 96");
  p = good, p.in.heads = 0;
  expect_invalid(p, "in.heads");
  p = good, p.in.seqlen_k = -1;
  expect_invalid(p, "seqlen_k >= 0");
  p = good, p.num_seqs = 2;
  expect_invalid(p, "only used with cu_seqlens");
  p = good, p.cu_seqlens_q = reinterpret_cast<const int*>(fake);
  expect_invalid(p, "packed sequences need both offset arrays");
  p.cu_seqlens_k = reinterpret_cast<const int*>(fake + 1);
  expect_invalid(p, "4-byte aligned");
  p.cu_seqlens_k = reinterpret_cast<const int*>(fake);
  expect_invalid(p, "num_seqs: expected 1..65535");
  p.num_seqs = 2, p.max_seqlen_q = -1;
  expect_invalid(p, "max_seqlen_q, max_seqlen_k: expected >= 0");
  p.max_seqlen_q = 10;   // total_q/total_k unset: offsets could not be clamped
  expect_invalid(p, "total_q, total_k: the token rows");
  p = good, p.in.v_packed = nullptr;
  expect_invalid(p, "in.v_packed must not be null");
  p = good, p.in.k_descale = reinterpret_cast<const float*>(fake + 2);
  expect_invalid(p, "in.k_descale is misaligned");
  p = good, p.out_stride_seq = 0;
  expect_invalid(p, "out strides");
  p = good, p.lse = reinterpret_cast<float*>(fake);   // lse strides left unset
  expect_invalid(p, "lse strides");
  p = good, p.softmax_scale = NAN;
  expect_invalid(p, "softmax_scale must be finite");
  p = good, p.mid_window_blocks = -2;
  expect_invalid(p, "mid_window_blocks must be >= 0 or kNaturalOrder");
  // No query rows: nothing to do, and nothing touches the device.
  p = good, p.in.seqlen_q = 0;
  EXPECT_TRUE(openvc::attention_general(p, nullptr).ok());
}

}  // namespace
