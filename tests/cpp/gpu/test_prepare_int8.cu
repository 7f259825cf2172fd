// prepare_fp8 with qk_format kInt8 (numerics section 9) and with K smoothing (either format) against the
// CPU reference: Q/K codes and descales byte-identical in every call form (batched, packed sequences of
// uneven lengths with an empty one, key counts, head dim 64 and 128, BF16 and FP16, strided views),
// INT8 K per (128-key block, key group) [G, H, nk, 8], INT8 q_descale per row [G, H, max_seqlen_q] with 0
// past a sequence's end, smoothing means in the reference's blocked order, V unchanged. Every output and
// the workspace are poisoned with 0xAB first. K codes at or past a key count are not compared: prepare_fp8
// does not write them (attention never reads them), as for E4M3.
// Run: openvc_gpu_tests --gtest_filter='*PrepareInt8*:PrepareSmoothing*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/prepare_test_util.h"
#include "openvc/attention.h"
#include "openvc/reference.h"

namespace {

using openvc::DType;
using openvc::PrepareParams;
using openvc::QkFormat;
using namespace openvc::testing;
namespace ref = openvc::reference;

// One preparation problem. packed: sequences lens_q / lens_k back to back ([total, H, D], cu_seqlens);
// batched: lens_q = {Sq} x B and lens_k = {Sk} x B with equal lengths, as [B, S, H, D] views.
struct Case {
  std::string name;
  DType dtype;
  bool packed;
  std::vector<int> lens_q, lens_k;
  int H, D;
  QkFormat format;
  bool smoothing;
  std::vector<int> counts;  // optional key counts (seqused_k), one per sequence
  Layout layout = Layout::kContiguous;
};

std::vector<int> offsets(const std::vector<int>& lens) {
  std::vector<int> cu{0};
  for (int n : lens) cu.push_back(cu.back() + n);
  return cu;
}
int max_of(const std::vector<int>& lens) { return std::max(1, *std::max_element(lens.begin(), lens.end())); }
ref::Sequences sequences(const std::vector<int>& lens, int H, int D) {
  ref::Sequences s;
  s.cu_seqlens = offsets(lens);
  s.num_heads = H;
  s.head_dim = D;
  return s;
}

struct Inputs {
  Tensor q, k, v;  // [1, total, H, D] (batched: the same memory order as [B, S, H, D])
};
Inputs random_inputs(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int tq = offsets(c.lens_q).back(), tk = offsets(c.lens_k).back();
  return {random_tensor(c.dtype, 1, tq, c.H, c.D, rng), random_tensor(c.dtype, 1, tk, c.H, c.D, rng),
          random_tensor(c.dtype, 1, tk, c.H, c.D, rng)};
}

// Host copies of the reference's outputs in the GPU layouts.
struct Expected {
  std::vector<uint8_t> q_codes, k_codes;  // bytes ([total, H, D])
  std::vector<float> q_descale, k_descale, v_descale;
  std::vector<uint8_t> v_codes_cut;  // V codes of the valid keys only, [total_cut, H, D]
  std::vector<int> cu_cut;           // offsets of the valid keys
};

Expected reference(const Case& c, const Inputs& in) {
  const ref::Sequences qs = sequences(c.lens_q, c.H, c.D), ks = sequences(c.lens_k, c.H, c.D);
  const int* counts = c.counts.empty() ? nullptr : c.counts.data();
  Expected e;
  if (c.format == QkFormat::kInt8) {
    ref::Int8Quantized rq, rk;
    EXPECT_TRUE(ref::quantize_int8_rows(in.q.values.data(), qs, &rq).ok());
    EXPECT_TRUE(ref::quantize_int8_blocks(in.k.values.data(), ks, c.smoothing, &rk, counts).ok());
    e.q_codes.assign(rq.codes.size(), 0);
    std::memcpy(e.q_codes.data(), rq.codes.data(), rq.codes.size());
    e.k_codes.assign(rk.codes.size(), 0);
    std::memcpy(e.k_codes.data(), rk.codes.data(), rk.codes.size());
    e.q_descale = rq.descale;
    e.k_descale = rk.descale;
  } else {
    ref::BlockQuantized rq, rk;
    EXPECT_TRUE(ref::quantize_blocks(in.q.values.data(), qs, &rq).ok());
    EXPECT_TRUE(ref::quantize_key_blocks(in.k.values.data(), ks, c.smoothing, &rk, counts).ok());
    e.q_codes = rq.codes;
    e.k_codes = rk.codes;
    e.q_descale = rq.descale;
    e.k_descale = rk.descale;
  }
  // V over the valid keys (the sequences cut to their counts).
  std::vector<int> cut_lens;
  for (size_t s = 0; s < c.lens_k.size(); ++s)
    cut_lens.push_back(counts ? std::min(std::max(counts[s], 0), c.lens_k[s]) : c.lens_k[s]);
  const ref::Sequences vs = sequences(cut_lens, c.H, c.D);
  std::vector<float> kept;
  for (size_t s = 0; s < c.lens_k.size(); ++s)
    for (int t = 0; t < cut_lens[s]; ++t) {
      const float* row = &in.v.values[(size_t(ks.cu_seqlens[s]) + t) * c.H * c.D];
      kept.insert(kept.end(), row, row + size_t(c.H) * c.D);
    }
  ref::HeadQuantized rv;
  EXPECT_TRUE(ref::quantize_heads(kept.data(), vs, &rv).ok());
  e.v_descale = rv.descale;
  e.v_codes_cut = rv.codes;
  e.cu_cut = vs.cu_seqlens;
  return e;
}

// Runs prepare_fp8 on the case (outputs and workspace poisoned first) and compares every output. graph:
// captured into a CUDA graph on a non-blocking stream, then poisoned and replayed (stream order only).
void run_and_check(const Case& c, const Inputs& in, bool graph = false) {
  SCOPED_TRACE(c.name);
  const int G = int(c.lens_q.size()), H = c.H, D = c.D;
  const std::vector<int> cu_q = offsets(c.lens_q), cu_k = offsets(c.lens_k);
  const int max_q = max_of(c.lens_q), max_k = max_of(c.lens_k);
  const int nq = int(openvc::num_quant_blocks(max_q)), nk = int(openvc::num_quant_blocks(max_k));
  const int64_t sk_pad = openvc::packed_seqlen_k(max_k);
  const bool int8 = c.format == QkFormat::kInt8;
  const int q_per = int8 ? max_q : nq, k_per = int8 ? nk * openvc::kInt8KeyGroups : nk;
  const size_t tq = size_t(cu_q.back()), tk = size_t(cu_k.back());
  PreparedDevice dev(std::max<size_t>(tq * H * D, 16), std::max<size_t>(tk * H * D, 16), size_t(G) * H * D * sk_pad,
                     size_t(G) * H, q_per, k_per, openvc::prepare_workspace_bytes(G, H, max_k, c.smoothing));
  ASSERT_TRUE(dev.allocated()) << "cudaMalloc failed";
  DevBuf d_cu_q(cu_q.size() * 4), d_cu_k(cu_k.size() * 4), d_counts(std::max<size_t>(c.counts.size() * 4, 4));
  ASSERT_TRUE(upload(d_cu_q.p, cu_q) && upload(d_cu_k.p, cu_k));
  if (!c.counts.empty()) ASSERT_TRUE(upload(d_counts.p, c.counts));
  // Device copies: packed [total, H, D] (B = 1); batched: the same rows seen as [G, S, H, D].
  DevTensor dq(c.dtype, in.q, strides_of(c.layout, in.q.S, H, D));
  DevTensor dk(c.dtype, in.k, strides_of(c.layout, in.k.S, H, D));
  DevTensor dv(c.dtype, in.v, strides_of(c.layout, in.v.S, H, D));
  ASSERT_TRUE(dq.buf.p && dk.buf.p && dv.buf.p) << "cudaMalloc failed";

  PrepareParams p;
  p.dtype = c.dtype;
  p.qk_format = c.format;
  p.k_smoothing = c.smoothing;
  p.heads = H;
  p.head_dim = D;
  auto view = [&](const DevTensor& t, int S) {
    openvc::TokenTensorView v = t.view();
    v.stride_batch = c.packed ? 0 : S * t.st.s;  // batched: sequence b starts b * S token rows further
    return v;
  };
  if (c.packed) {
    p.cu_seqlens_q = d_cu_q.as<const int>();
    p.cu_seqlens_k = d_cu_k.as<const int>();
    p.num_seqs = G;
    p.max_seqlen_q = max_q;
    p.max_seqlen_k = max_k;
    p.total_q = int64_t(tq);
    p.total_k = int64_t(tk);
  } else {
    p.batch = G;
    p.seqlen_q = c.lens_q[0];
    p.seqlen_k = c.lens_k[0];
  }
  p.q = view(dq, c.lens_q[0]);
  p.k = view(dk, c.lens_k[0]);
  p.v = view(dv, c.lens_k[0]);
  if (!c.counts.empty()) p.seqused_k = d_counts.as<const int>();
  dev.bind(p);
  if (graph) {
    const CapturedGraph cg(cudaStreamCaptureModeThreadLocal,
                           [&](cudaStream_t stream) { return openvc::prepare_fp8(p, stream); });
    ASSERT_TRUE(cg.status.ok()) << cg.status.message();
    CUDA_OK(cg.error);
    for (int replay = 0; replay < 2; ++replay) {  // the second replay sees the first one's workspace
      dev.poison(cg.stream);
      CUDA_OK(cg.launch());
    }
    CUDA_OK(cudaStreamSynchronize(cg.stream));
  } else {
    dev.poison(0);
    const openvc::Status st = openvc::prepare_fp8(p, 0);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  CUDA_OK(cudaDeviceSynchronize());
  const PreparedHost got = dev.read(tq * H * D, tk * H * D);
  const Expected want = reference(c, in);

  expect_codes("q_codes", got.q_codes, want.q_codes, in.q);
  // K codes of the valid keys (past a key count they are not written).
  std::vector<uint8_t> k_got = got.k_codes, k_want = want.k_codes;
  for (int s = 0; s < G; ++s) {
    const int n = c.counts.empty() ? c.lens_k[s] : std::min(std::max(c.counts[s], 0), c.lens_k[s]);
    for (int t = n; t < c.lens_k[s]; ++t)
      for (int e = 0; e < H * D; ++e) k_got[(size_t(cu_k[s]) + t) * H * D + e] = k_want[(size_t(cu_k[s]) + t) * H * D + e];
  }
  expect_codes("k_codes", k_got, k_want, in.k);
  expect_floats("q_descale", got.q_descale, want.q_descale);
  expect_floats("k_descale", got.k_descale, want.k_descale);
  expect_floats("v_descale", got.v_descale, want.v_descale);
  // v_packed [G, H, D, sk_pad]: column 16 g + kappa holds valid key 16 g + kPackedKeyOrder[kappa], else 0.
  ASSERT_EQ(got.v_packed.size(), size_t(G) * H * D * sk_pad);
  int64_t bad = 0;
  for (int s = 0; s < G; ++s)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d)
        for (int64_t col = 0; col < sk_pad; ++col) {
          const int64_t key = col / 16 * 16 + openvc::kPackedKeyOrder[col % 16];
          const int n = want.cu_cut[s + 1] - want.cu_cut[s];
          const uint8_t w = key < n ? want.v_codes_cut[((want.cu_cut[s] + key) * H + h) * int64_t(D) + d] : 0;
          bad += got.v_packed[((int64_t(s) * H + h) * D + d) * sk_pad + col] != w;
        }
  EXPECT_EQ(bad, 0) << "v_packed bytes differ";
}

std::vector<Case> shape_cases() {
  std::vector<Case> v;
  for (QkFormat f : {QkFormat::kInt8, QkFormat::kE4M3})
    for (bool smooth : {false, true}) {
      if (f == QkFormat::kE4M3 && !smooth) continue;  // test_prepare*.cu
      for (DType t : {DType::kBFloat16, DType::kFloat16})
        for (int D : {128, 64}) {
          std::ostringstream o;
          o << (f == QkFormat::kInt8 ? "int8" : "e4m3") << (smooth ? "_smooth" : "") << "_"
            << (t == DType::kBFloat16 ? "bf16" : "f16") << "_D" << D;
          const std::string n = o.str();
          v.push_back({n + "_batched", t, false, {300, 300}, {700, 700}, 3, D, f, smooth});
          v.push_back({n + "_batched_short", t, false, {1}, {1}, 2, D, f, smooth});
          v.push_back({n + "_batched_counts_strided", t, false, {129, 129, 129}, {513, 513, 513}, 2, D, f, smooth,
                       {400, 0, 513}, Layout::kPadded});
          v.push_back({n + "_packed", t, true, {1, 300, 0, 1000}, {700, 5, 0, 129}, 2, D, f, smooth});
          v.push_back({n + "_packed_counts", t, true, {128, 0, 257, 64}, {300, 0, 999, 129}, 3, D, f, smooth,
                       {299, 0, 640, 200}, Layout::kPadded});
        }
    }
  return v;
}

class PrepareInt8Shapes : public ::testing::TestWithParam<Case> {};

TEST_P(PrepareInt8Shapes, ByteIdenticalToReference) {
  SKIP_WITHOUT_SM90();
  const Case c = GetParam();
  uint32_t seed = uint32_t(c.H * 31 + c.D);
  for (int n : c.lens_q) seed = seed * 7 + uint32_t(n);
  for (int n : c.lens_k) seed = seed * 5 + uint32_t(n);
  run_and_check(c, random_inputs(c, seed));
}

INSTANTIATE_TEST_SUITE_P(Prepare, PrepareInt8Shapes, ::testing::ValuesIn(shape_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// NaN, Inf and tiny values (BF16): NaN in a Q row and in a K channel, Inf in another head's K, a tiny INT8
// key group and a tiny Q row; smoothing on and off, both formats, batched and packed.
TEST(PrepareInt8, NonFiniteAndTinyInputs) {
  SKIP_WITHOUT_SM90();
  const float kNaN = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  for (QkFormat f : {QkFormat::kInt8, QkFormat::kE4M3})
    for (bool smooth : {false, true})
      for (bool packed : {false, true}) {
        if (f == QkFormat::kE4M3 && !smooth) continue;
        Case c{std::string(f == QkFormat::kInt8 ? "int8" : "e4m3") + (smooth ? "_smooth" : "") +
                   (packed ? "_packed" : "_batched"),
               DType::kBFloat16, packed, {256, 256}, {384, 384}, 3, 128, f, smooth};
        Inputs in = random_inputs(c, 99);
        const int H = c.H, D = c.D;
        auto qi = [&](int tok, int h, int d) { return (int64_t(tok) * H + h) * D + d; };
        in.q.set(c.dtype, qi(10, 0, 5), kNaN);                           // sequence 0, row 10
        for (int d = 0; d < D; ++d) in.q.set(c.dtype, qi(300, 1, d), 1e-38f * float(d % 3));  // tiny row
        in.k.set(c.dtype, qi(40, 0, 7), kNaN);                           // sequence 0, head 0, channel 7
        in.k.set(c.dtype, qi(384 + 200, 2, 9), kInf);                    // sequence 1, head 2
        for (int t = 0; t < 128; ++t)                                    // sequence 1, head 1, block 0,
          if (ref::int8_key_group(t) == 2)                               // key group 2: tiny
            for (int d = 0; d < D; ++d) in.k.set(c.dtype, qi(384 + t, 1, d), 1e-38f * float(1 + d % 2));
        run_and_check(c, in);
      }
}

// K plus an exactly representable per-channel offset (K multiples of 1/4 in [-4, 4], offsets multiples of 8
// in [-16, 16], 256 keys) gives, with smoothing, the same codes and descales on the GPU as K alone.
TEST(PrepareSmoothing, ExactChannelOffsetLeavesCodesUnchanged) {
  SKIP_WITHOUT_SM90();
  for (QkFormat f : {QkFormat::kInt8, QkFormat::kE4M3}) {
    Case c{f == QkFormat::kInt8 ? "int8" : "e4m3", DType::kBFloat16, false, {256, 256}, {256, 256}, 2, 128, f, true};
    Inputs a = random_inputs(c, 5), b = a;
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> q(-16, 16);
    for (int64_t i = 0; i < int64_t(a.k.values.size()); ++i) {
      const int d = int(i % 128), h = int(i / 128 % 2);
      const float k = 0.25f * float(q(rng));
      a.k.set(c.dtype, i, k);
      b.k.set(c.dtype, i, k + 8.0f * float((d + 3 * h) % 5 - 2));
      ASSERT_EQ(b.k.values[i], k + 8.0f * float((d + 3 * h) % 5 - 2));
    }
    run_and_check(c, a);
    run_and_check(c, b);
    const Expected ea = reference(c, a), eb = reference(c, b);
    EXPECT_TRUE(ea.k_codes == eb.k_codes);
    EXPECT_TRUE(ea.k_descale == eb.k_descale);
  }
}

// The smoothing means follow the blocked order on the GPU too: 2^53 in block 0, 128 ones in block 1,
// -2^53 in block 2 give mean 1/3 (a sequential sum would give 0), so k' and the codes differ from the
// sequential order's.
TEST(PrepareSmoothing, BlockedMeanOrder) {
  SKIP_WITHOUT_SM90();
  for (QkFormat f : {QkFormat::kInt8, QkFormat::kE4M3}) {
    Case c{f == QkFormat::kInt8 ? "int8" : "e4m3", DType::kBFloat16, true, {128}, {384}, 1, 64, f, true};
    Inputs in = random_inputs(c, 3);
    for (int d = 0; d < 64; ++d) {
      for (int t = 0; t < 384; ++t) in.k.set(c.dtype, int64_t(t) * 64 + d, 0.0f);
      in.k.set(c.dtype, d, 0x1p53f);
      for (int t = 128; t < 256; ++t) in.k.set(c.dtype, int64_t(t) * 64 + d, 1.0f);
      in.k.set(c.dtype, int64_t(256) * 64 + d, -0x1p53f);
    }
    run_and_check(c, in);
  }
}

// Sequences of more key blocks than the smoothing kernels load ahead of their additions (kSumChunk = 32 tokens of a
// block and 32 blocks): 71 blocks, the last of 40 keys, and a batch entry of 33 (seqused_k 4200), both formats. With
// random keys (FP16 and BF16) every chunk and tail is read once; with BF16 magnitudes in head 0 of entry 0 only the
// serial order gives the reference's mean: within block 0, 2^53 at token 0, ones at tokens 31-33 and -2^53 at token 39
// sum to 0 (summed per 32-token chunk they give 2); across blocks, 2^53 in block 31, ones in blocks 32-33 and -2^53 in
// block 34 sum to 0 (per 32-block chunk: 2), and a nonzero mean moves the codes of the ones-only blocks.
TEST(PrepareSmoothing, LongSequencesSumInOrderAcrossChunks) {
  SKIP_WITHOUT_SM90();
  for (QkFormat f : {QkFormat::kInt8, QkFormat::kE4M3})
    for (DType t : {DType::kBFloat16, DType::kFloat16}) {
      const Case c{std::string(f == QkFormat::kInt8 ? "int8" : "e4m3") + (t == DType::kBFloat16 ? "_bf16" : "_f16"), t,
                   false, {128, 128}, {9000, 9000}, 2, 128, f, true, {9000, 4200}};
      Inputs in = random_inputs(c, 29);
      if (t == DType::kBFloat16) {
        auto at = [](int token, int d) { return (int64_t(token) * 2 + 0) * 128 + d; };   // entry 0, head 0
        for (int d = 0; d < 128; ++d) {
          for (int k = 0; k < 9000; ++k) in.k.set(c.dtype, at(k, d), 0.0f);
          in.k.set(c.dtype, at(0, d), 0x1p53f);
          for (int k : {31, 32, 33}) in.k.set(c.dtype, at(k, d), 1.0f);
          in.k.set(c.dtype, at(39, d), -0x1p53f);
          in.k.set(c.dtype, at(31 * 128, d), 0x1p53f);
          in.k.set(c.dtype, at(32 * 128, d), 1.0f);
          in.k.set(c.dtype, at(33 * 128, d), 1.0f);
          in.k.set(c.dtype, at(34 * 128, d), -0x1p53f);
        }
      }
      SCOPED_TRACE(c.name);
      run_and_check(c, in);
    }
}

// prepare_fp8 with smoothing is stream-ordered (no host synchronization, no allocation): it captures into
// a CUDA graph whose replays write the reference's bytes.
TEST(PrepareSmoothing, CapturedInACudaGraph) {
  SKIP_WITHOUT_SM90();
  for (QkFormat f : {QkFormat::kInt8, QkFormat::kE4M3}) {
    const Case c{f == QkFormat::kInt8 ? "int8_graph" : "e4m3_graph", DType::kBFloat16, true, {300, 0, 129},
                 {1000, 0, 257}, 2, 128, f, true, {999, 0, 100}};
    run_and_check(c, random_inputs(c, 17), /*graph=*/true);
  }
}

// Argument checks (no device needed: they fail before any CUDA call): kInt8 with packed sequences, key
// counts and head dim 64 gets as far as the workspace check, which counts the smoothing parts.
TEST(PrepareInt8Args, AcceptedFormsAndWorkspace) {
  PrepareParams p;
  p.qk_format = QkFormat::kInt8;
  p.heads = 2;
  p.head_dim = 64;
  p.q = {fake_address(0x10000), 0, 2 * 64, 64};
  p.k = p.v = p.q;
  p.cu_seqlens_q = static_cast<const int*>(fake_address(0x90000));
  p.cu_seqlens_k = static_cast<const int*>(fake_address(0x90100));
  p.seqused_k = static_cast<const int*>(fake_address(0x90200));
  p.num_seqs = 3;
  p.max_seqlen_q = p.max_seqlen_k = 1000;
  p.total_q = p.total_k = 3000;
  bind_fake_outputs(p);
  p.k_smoothing = true;
  p.workspace_bytes = openvc::prepare_workspace_bytes(3, 2, 1000, false);
  openvc::Status st = openvc::prepare_fp8(p, nullptr);
  EXPECT_EQ(int(st.code()), int(openvc::StatusCode::kInvalidArgument)) << st.message();
  EXPECT_NE(st.message().find("prepare_workspace_bytes(num_seqs, heads, max_seqlen_k, k_smoothing, v_bias) = (3, 2, 1000, true, false)"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(st.message().find("qk_format"), std::string::npos) << st.message();
}

}  // namespace
