// The VC-Attention baseline on the GPU (numerics section 7, openvc/baselines.h) against the CPU reference:
// - vc_grouping: a valid permutation per (batch, head), the same bytes on every run, clusters gathered as
//   well as reference::vc_grouping gathers them (V-Smooth residual energy), identity for Sk <= 64;
// - vc_prepare: byte-identical to reference::vc_prepare for a given permutation (codes, descales, means);
// - attention_vc_fp8 on the GPU preparation against reference::attention_vc with the same permutation,
//   and the output's invariance to the permutation (grouping, identity, random);
// - graph capture of grouping + preparation; argument checks (these run without a GPU).
// Run: openvc_gpu_tests --gtest_filter='Vc*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "gpu/prepare_test_util.h"
#include "openvc/baselines.h"
#include "openvc/reference.h"
#include "reference/test_inputs.h"

namespace {

using openvc::DType;
using namespace openvc::testing;  // DevBuf, download, upload, Tensor, DevTensor, expect_codes, ...
namespace ref = openvc::reference;
constexpr int D = 128;

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
};

Tensor tensor_of(DType t, const std::vector<float>& x, int B, int S, int H) {
  Tensor out{B, S, H, D, std::vector<uint16_t>(x.size()), std::vector<float>(x.size())};
  for (size_t i = 0; i < x.size(); ++i) out.set(t, int64_t(i), x[i]);
  return out;
}

// V made of `centres` per-head centre vectors plus small noise over a per-channel offset; labels[(b*S+s)*H+h].
std::vector<float> clustered_v(int B, int S, int H, uint32_t seed, std::vector<int>* labels, int centres = 8) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> cen(size_t(H) * centres * D), off(size_t(H) * D), v(size_t(B) * S * H * D);
  for (float& x : cen) x = gauss(rng);
  for (float& x : off) x = 3.0f * gauss(rng);
  labels->assign(size_t(B) * S * H, 0);
  for (size_t t = 0; t < size_t(B) * S; ++t)
    for (int h = 0; h < H; ++h) {
      const int c = int(rng() % centres);
      (*labels)[t * H + h] = c;
      for (int d = 0; d < D; ++d)
        v[(t * H + h) * D + d] = cen[(size_t(h) * centres + c) * D + d] + off[size_t(h) * D + d] + 0.05f * gauss(rng);
    }
  return v;
}

std::vector<float> normal_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = g(rng);
  return x;
}

// Runs vc_grouping on a device copy of v (workspace and output poisoned first); [B, H, S] on the host.
std::vector<int> gpu_grouping(DType t, const DevTensor& v, int B, int S, int H, cudaStream_t st) {
  const size_t ws_bytes = openvc::vc_grouping_workspace_bytes(B, H, S);
  DevBuf perm(size_t(B) * H * S * 4), ws(ws_bytes);
  if (!perm.p || !ws.p || ws_bytes == 0) return {};
  cudaMemsetAsync(perm.p, 0xAB, perm.bytes, st);
  cudaMemsetAsync(ws.p, 0xAB, ws.bytes, st);
  openvc::VcGroupingParams p;
  p.dtype = t, p.batch = B, p.seqlen = S, p.heads = H;
  p.v = v.view();
  p.permutation = perm.as<int>();
  p.workspace = ws.p, p.workspace_bytes = ws.bytes;
  const openvc::Status status = openvc::vc_grouping(p, st);
  EXPECT_TRUE(status.ok()) << status.message();
  if (!status.ok() || cudaStreamSynchronize(st) != cudaSuccess) return {};
  return download<int>(perm.p, size_t(B) * H * S);
}

void expect_valid_permutation(const std::vector<int>& p, int BH, int S) {
  ASSERT_EQ(p.size(), size_t(BH) * S);
  std::vector<char> seen;
  for (int g = 0; g < BH; ++g) {
    seen.assign(S, 0);
    for (int i = 0; i < S; ++i) {
      const int x = p[size_t(g) * S + i];
      ASSERT_TRUE(x >= 0 && x < S && !seen[x]) << "group " << g << " position " << i << " holds " << x;
      seen[x] = 1;
    }
  }
}

// Sum over (b, h, 128-row block of the permuted order) of ||v - block mean||^2: what V-Smooth quantizes.
double smooth_energy(const std::vector<float>& v, const std::vector<int>& perm, int B, int S, int H) {
  double e = 0;
  std::vector<double> mean(D);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int* p = perm.data() + (size_t(b) * H + h) * S;
      auto row = [&](int i) { return v.data() + ((size_t(b) * S + p[i]) * H + h) * D; };
      for (int j0 = 0; j0 < S; j0 += 128) {
        const int j1 = std::min(S, j0 + 128);
        std::fill(mean.begin(), mean.end(), 0.0);
        for (int j = j0; j < j1; ++j)
          for (int d = 0; d < D; ++d) mean[d] += row(j)[d] / double(j1 - j0);
        for (int j = j0; j < j1; ++j)
          for (int d = 0; d < D; ++d) e += (row(j)[d] - mean[d]) * (row(j)[d] - mean[d]);
      }
    }
  return e;
}

std::vector<int> identity_permutation(int BH, int S) {
  std::vector<int> p(size_t(BH) * S);
  for (int g = 0; g < BH; ++g) std::iota(p.begin() + size_t(g) * S, p.begin() + size_t(g + 1) * S, 0);
  return p;
}

std::vector<int> random_permutation(int BH, int S, uint32_t seed) {
  std::vector<int> p = identity_permutation(BH, S);
  std::mt19937 rng(seed);
  for (int g = 0; g < BH; ++g) std::shuffle(p.begin() + size_t(g) * S, p.begin() + size_t(g + 1) * S, rng);
  return p;
}

// ---- grouping -------------------------------------------------------------------------------------------

struct GroupCase {
  DType dtype;
  int B, S, H;
  Layout layout;
  bool compare_reference;  // the reference k-means is slow for many heads
};

void run_grouping_case(const GroupCase& c) {
  SCOPED_TRACE(::testing::Message() << (c.dtype == DType::kBFloat16 ? "bf16" : "f16") << " B=" << c.B << " S=" << c.S
                                    << " H=" << c.H);
  std::vector<int> labels;
  const Tensor v = tensor_of(c.dtype, clustered_v(c.B, c.S, c.H, 100 + c.S + c.H, &labels), c.B, c.S, c.H);
  const DevTensor dv(c.dtype, v, strides_of(c.layout, c.S, c.H, D));
  ASSERT_NE(dv.buf.p, nullptr);
  Stream st;
  const std::vector<int> p1 = gpu_grouping(c.dtype, dv, c.B, c.S, c.H, st.s);
  const std::vector<int> p2 = gpu_grouping(c.dtype, dv, c.B, c.S, c.H, st.s);
  expect_valid_permutation(p1, c.B * c.H, c.S);
  EXPECT_TRUE(p1 == p2) << "two runs gave different permutations";
  // Well-separated centres: every cluster holds one centre's tokens, so along the permutation the
  // centre changes fewer than kVcClusters times (in natural order it changes at ~7/8 of the tokens).
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.H; ++h) {
      const int* p = p1.data() + (size_t(b) * c.H + h) * c.S;
      int changes = 0;
      for (int i = 1; i < c.S; ++i)
        changes += labels[(size_t(b) * c.S + p[i]) * c.H + h] != labels[(size_t(b) * c.S + p[i - 1]) * c.H + h];
      EXPECT_LT(changes, openvc::kVcClusters) << "b=" << b << " h=" << h;
    }
  // Sorted cluster ids still mix centres inside a 128-row block (ids follow the seed tokens, not the
  // centres), so the energy drops to ~0.5-0.8 of the natural order's on these inputs, not to 0.
  const double e_gpu = smooth_energy(v.values, p1, c.B, c.S, c.H);
  const double e_id = smooth_energy(v.values, identity_permutation(c.B * c.H, c.S), c.B, c.S, c.H);
  EXPECT_LT(e_gpu, 0.9 * e_id);
  if (c.compare_reference) {
    // Same initialisation and iterations in double: the groupings differ by near-ties only. (Even a
    // 1e-4 perturbation of V moves most positions of the reference's own permutation, but its energy
    // by < 2%.)
    std::vector<int> pr;
    ASSERT_TRUE(ref::vc_grouping(v.values.data(), ref::Sequences::Batched(c.B, c.S, c.H, D), &pr).ok());
    const double e_ref = smooth_energy(v.values, pr, c.B, c.S, c.H);
    std::printf("  smooth energy: gpu %.6g reference %.6g identity %.6g\n", e_gpu, e_ref, e_id);
    EXPECT_LE(e_gpu, 1.05 * e_ref);
  }
}

TEST(VcGrouping, ValidDeterministicAndGathersClusters) {
  SKIP_WITHOUT_SM90();
  // Partial last tile, several parts per (batch, head), strided input; then many heads (many CTAs).
  for (GroupCase c : {GroupCase{DType::kBFloat16, 2, 3000, 3, Layout::kPadded, true},
                      GroupCase{DType::kFloat16, 1, 1000, 2, Layout::kContiguous, true},
                      GroupCase{DType::kBFloat16, 1, 5000, 40, Layout::kContiguous, false}})
    run_grouping_case(c);
}

TEST(VcGrouping, ShortSequences) {
  SKIP_WITHOUT_SM90();
  // Sk <= 64: one cluster per token, each seeded with itself, so the stable sort keeps the order.
  for (int S : {1, 2, 40, 64, 65, 100}) {
    SCOPED_TRACE(::testing::Message() << "S=" << S);
    const int B = 1, H = 2;
    const Tensor v = tensor_of(DType::kBFloat16, normal_values(size_t(B) * S * H * D, 7 + S), B, S, H);
    const DevTensor dv(DType::kBFloat16, v, strides_of(Layout::kContiguous, S, H, D));
    Stream st;
    const std::vector<int> p = gpu_grouping(DType::kBFloat16, dv, B, S, H, st.s);
    expect_valid_permutation(p, B * H, S);
    if (S <= openvc::kVcClusters) EXPECT_TRUE(p == identity_permutation(B * H, S));
  }
}

// ---- preparation ----------------------------------------------------------------------------------------

struct PrepDevice {
  int B, Sq, Sk, H, nq, nk;
  DevBuf q_codes, q_descale, k_codes, k_descale, v_packed, v_desc, mean_scaled, mean16, perm, ws;
  PrepDevice(int b, int sq, int sk, int h)
      : B(b), Sq(sq), Sk(sk), H(h), nq(int(openvc::num_quant_blocks(sq))), nk(int(openvc::num_quant_blocks(sk))),
        q_codes(size_t(b) * sq * h * D), q_descale(size_t(b) * h * nq * 4), k_codes(size_t(b) * sk * h * D),
        k_descale(size_t(b) * h * nk * 4), v_packed(size_t(b) * h * D * openvc::packed_seqlen_k(sk)),
        v_desc(size_t(b) * h * D * 4), mean_scaled(size_t(b) * h * nk * D * 4), mean16(size_t(b) * h * nk * D * 2),
        perm(size_t(b) * h * sk * 4), ws(openvc::vc_prepare_workspace_bytes(b, h)) {}
  openvc::VcPrepareParams params(DType t, const DevTensor& q, const DevTensor& k, const DevTensor& v) const {
    openvc::VcPrepareParams p;
    p.dtype = t, p.batch = B, p.seqlen_q = Sq, p.seqlen_k = Sk, p.heads = H;
    p.q = q.view(), p.k = k.view(), p.v = v.view();
    p.permutation = perm.as<int>();
    p.q_codes = q_codes.as<uint8_t>(), p.q_descale = q_descale.as<float>();
    p.k_codes = k_codes.as<uint8_t>(), p.k_descale = k_descale.as<float>();
    p.v_packed = v_packed.as<uint8_t>(), p.v_channel_descale = v_desc.as<float>();
    p.block_mean_scaled = mean_scaled.as<float>(), p.block_mean = mean16.as<uint16_t>();
    p.workspace = ws.p, p.workspace_bytes = ws.bytes;
    return p;
  }
  // 0xAB everywhere (the workspace too): every output byte must be written, the amax zeroed by the kernels.
  void poison(cudaStream_t st) const {
    for (const DevBuf* b : {&q_codes, &q_descale, &k_codes, &k_descale, &v_packed, &v_desc, &mean_scaled, &mean16, &ws})
      cudaMemsetAsync(b->p, 0xAB, b->bytes, st);
  }
};

// Every output of the device preparation against reference::vc_prepare, byte for byte.
void expect_prepared_matches(const PrepDevice& dev, const ref::VcPrepared& rp, const Tensor& q, const Tensor& k) {
  const int B = dev.B, H = dev.H, Sk = dev.Sk;
  expect_codes("q_codes", download<uint8_t>(dev.q_codes.p, dev.q_codes.bytes), rp.q.codes, q);
  expect_floats("q_descale", download<float>(dev.q_descale.p, dev.q_descale.bytes / 4), rp.q.descale);
  expect_codes("k_codes (permuted)", download<uint8_t>(dev.k_codes.p, dev.k_codes.bytes), rp.k.codes, k);
  expect_floats("k_descale", download<float>(dev.k_descale.p, dev.k_descale.bytes / 4), rp.k.descale);
  const std::vector<uint8_t> vp = download<uint8_t>(dev.v_packed.p, dev.v_packed.bytes);
  const std::vector<uint8_t> vp_want = openvc::testing::pack_v(rp.v_codes, B, Sk, H, D);
  ASSERT_EQ(vp.size(), vp_want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < vp.size(); ++i)
    if (vp[i] != vp_want[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << "v_packed: first difference at byte " << first << ": got " << hex(vp[first]) << ", reference "
                     << hex(vp_want[first]);
  expect_floats("v_channel_descale", download<float>(dev.v_desc.p, dev.v_desc.bytes / 4), rp.channel_descale);
  const std::vector<uint16_t> m16 = download<uint16_t>(dev.mean16.p, dev.mean16.bytes / 2);
  std::vector<float> m16f(m16.size()), scaled_want(rp.block_mean.size());
  for (size_t i = 0; i < m16.size(); ++i) {
    const uint32_t u = uint32_t(m16[i]) << 16;
    std::memcpy(&m16f[i], &u, 4);
  }
  expect_floats("block_mean (BF16)", m16f, rp.block_mean);
  for (size_t i = 0; i < scaled_want.size(); ++i) {
    const size_t g = i / (size_t(dev.nk) * D);  // (b, h)
    scaled_want[i] = rp.block_mean[i] / rp.channel_descale[g * D + i % D];
  }
  expect_floats("block_mean_scaled", download<float>(dev.mean_scaled.p, dev.mean_scaled.bytes / 4), scaled_want);
}

TEST(VcPrepare, ByteIdenticalToReference) {
  SKIP_WITHOUT_SM90();
  const int B = 2, Sq = 300, Sk = 333, H = 3;
  for (DType t : {DType::kBFloat16, DType::kFloat16})
    for (Layout layout : {Layout::kContiguous, Layout::kPadded}) {
      SCOPED_TRACE(::testing::Message() << (t == DType::kBFloat16 ? "bf16" : "f16")
                                        << (layout == Layout::kPadded ? " strided" : ""));
      std::mt19937 rng(11 + int(t) + 2 * int(layout));
      const Tensor q = random_tensor(t, B, Sq, H, D, rng), k = random_tensor(t, B, Sk, H, D, rng);
      Tensor v = random_tensor(t, B, Sk, H, D, rng);
      for (int b = 0; b < B; ++b)  // head 1, channel 7 constant: its residual is zero, descale 1
        for (int s = 0; s < Sk; ++s) v.set(t, v.index(b, s, 1, 7), 0.75f);
      const std::vector<int> perm = random_permutation(B * H, Sk, 5);
      const DevTensor dq(t, q, strides_of(layout, Sq, H, D)), dk(t, k, strides_of(layout, Sk, H, D)),
          dv(t, v, strides_of(layout, Sk, H, D));
      PrepDevice dev(B, Sq, Sk, H);
      ASSERT_TRUE(upload(dev.perm.p, perm));
      Stream st;
      dev.poison(st.s);
      const openvc::Status status = openvc::vc_prepare(dev.params(t, dq, dk, dv), st.s);
      ASSERT_TRUE(status.ok()) << status.message();
      CUDA_OK(cudaStreamSynchronize(st.s));
      ref::VcPrepared rp;
      const ref::Sequences qs = ref::Sequences::Batched(B, Sq, H, D), ks = ref::Sequences::Batched(B, Sk, H, D);
      ASSERT_TRUE(ref::vc_prepare(q.values.data(), k.values.data(), v.values.data(), qs, ks, perm, &rp).ok());
      EXPECT_EQ(rp.channel_descale[(size_t(0) * H + 1) * D + 7], 1.0f);
      expect_prepared_matches(dev, rp, q, k);
    }
}

// Grouping then preparation captured in a CUDA graph: replays give the eager bytes (no host work
// hides in the calls, and the workspace needs no zeroing between replays).
TEST(VcPrepare, GraphReplayMatchesEager) {
  SKIP_WITHOUT_SM90();
  const int B = 1, S = 700, H = 2;
  const DType t = DType::kBFloat16;
  std::mt19937 rng(3);
  const Tensor q = random_tensor(t, B, S, H, D, rng), k = random_tensor(t, B, S, H, D, rng);
  std::vector<int> labels;
  const Tensor v = tensor_of(t, clustered_v(B, S, H, 9, &labels), B, S, H);
  const Strides s = strides_of(Layout::kContiguous, S, H, D);
  const DevTensor dq(t, q, s), dk(t, k, s), dv(t, v, s);
  PrepDevice dev(B, S, S, H);
  DevBuf gws(openvc::vc_grouping_workspace_bytes(B, H, S));
  openvc::VcGroupingParams gp;
  gp.dtype = t, gp.batch = B, gp.seqlen = S, gp.heads = H, gp.v = dv.view();
  gp.permutation = dev.perm.as<int>(), gp.workspace = gws.p, gp.workspace_bytes = gws.bytes;
  const openvc::VcPrepareParams pp = dev.params(t, dq, dk, dv);
  Stream st;
  ASSERT_TRUE(openvc::vc_grouping(gp, st.s).ok());
  ASSERT_TRUE(openvc::vc_prepare(pp, st.s).ok());
  CUDA_OK(cudaStreamSynchronize(st.s));
  const std::vector<int> perm = download<int>(dev.perm.p, size_t(B) * H * S);
  const std::vector<uint8_t> kc = download<uint8_t>(dev.k_codes.p, dev.k_codes.bytes);
  const std::vector<uint8_t> vpk = download<uint8_t>(dev.v_packed.p, dev.v_packed.bytes);
  const std::vector<float> ms = download<float>(dev.mean_scaled.p, dev.mean_scaled.bytes / 4);

  const CapturedGraph cg(cudaStreamCaptureModeGlobal, [&](cudaStream_t s) {
    const openvc::Status s1 = openvc::vc_grouping(gp, s);
    return s1.ok() ? openvc::vc_prepare(pp, s) : s1;
  });
  ASSERT_TRUE(cg.status.ok()) << cg.status.message();
  CUDA_OK(cg.error);
  for (int rep = 0; rep < 2; ++rep) {
    dev.poison(cg.stream);
    cudaMemsetAsync(dev.perm.p, 0xAB, dev.perm.bytes, cg.stream);
    cudaMemsetAsync(gws.p, 0xAB, gws.bytes, cg.stream);
    CUDA_OK(cg.launch());
    CUDA_OK(cudaStreamSynchronize(cg.stream));
    EXPECT_TRUE(download<int>(dev.perm.p, perm.size()) == perm);
    EXPECT_TRUE(download<uint8_t>(dev.k_codes.p, dev.k_codes.bytes) == kc);
    EXPECT_TRUE(download<uint8_t>(dev.v_packed.p, dev.v_packed.bytes) == vpk);
    EXPECT_TRUE(download<float>(dev.mean_scaled.p, ms.size()) == ms);
  }
  expect_valid_permutation(perm, B * H, S);
  ref::VcPrepared rp;
  const ref::Sequences seqs = ref::Sequences::Batched(B, S, H, D);
  ASSERT_TRUE(ref::vc_prepare(q.values.data(), k.values.data(), v.values.data(), seqs, seqs, perm, &rp).ok());
  expect_prepared_matches(dev, rp, q, k);
}

// ---- attention ------------------------------------------------------------------------------------------

struct AttnRun {
  std::vector<float> out;  // [B, S, H, D]
  std::vector<float> lse;  // [B, H, S]
};

// GPU preparation with `perm` (or with the GPU grouping when perm is empty, returned in *perm), then
// attention_vc_fp8; also checks the preparation against the reference.
AttnRun run_gpu_vc(DType t, const Tensor& q, const Tensor& k, const Tensor& v, std::vector<int>* perm) {
  const int B = q.B, S = q.S, H = q.H;
  const Strides s = strides_of(Layout::kContiguous, S, H, D);
  const DevTensor dq(t, q, s), dk(t, k, s), dv(t, v, s);
  Stream st;
  if (perm->empty()) *perm = gpu_grouping(t, dv, B, S, H, st.s);
  PrepDevice dev(B, S, S, H);
  if (perm->size() != size_t(B) * H * S || !upload(dev.perm.p, *perm)) return {};
  dev.poison(st.s);
  openvc::Status status = openvc::vc_prepare(dev.params(t, dq, dk, dv), st.s);
  EXPECT_TRUE(status.ok()) << status.message();
  const size_t nout = size_t(B) * S * H * D;
  DevBuf out(nout * 2), lse(size_t(B) * H * S * 4);
  cudaMemsetAsync(out.p, 0xFF, out.bytes, st.s);  // BF16 NaN: every element must be written
  cudaMemsetAsync(lse.p, 0xFF, lse.bytes, st.s);
  openvc::VcAttentionParams p;
  p.in = {B, S, S, H, D, dev.q_codes.as<uint8_t>(), dev.q_descale.as<float>(), dev.k_codes.as<uint8_t>(),
          dev.k_descale.as<float>(), dev.v_packed.as<uint8_t>(), nullptr};
  p.v_channel_descale = dev.v_desc.as<float>();
  p.block_mean_scaled = dev.mean_scaled.as<float>();
  p.out = out.p;
  p.out_stride_batch = int64_t(S) * H * D, p.out_stride_seq = int64_t(H) * D, p.out_stride_head = D;
  p.lse = lse.as<float>();
  status = openvc::attention_vc_fp8(p, st.s);
  EXPECT_TRUE(status.ok()) << status.message();
  if (!status.ok() || cudaStreamSynchronize(st.s) != cudaSuccess) return {};
  ref::VcPrepared rp;
  const ref::Sequences seqs = ref::Sequences::Batched(B, S, H, D);
  EXPECT_TRUE(ref::vc_prepare(q.values.data(), k.values.data(), v.values.data(), seqs, seqs, *perm, &rp).ok());
  expect_prepared_matches(dev, rp, q, k);
  AttnRun r;
  const std::vector<uint16_t> bits = download<uint16_t>(out.p, nout);
  r.out.resize(nout);
  for (size_t i = 0; i < nout; ++i) r.out[i] = from_bits(DType::kBFloat16, bits[i]);
  r.lse = download<float>(lse.p, size_t(B) * H * S);
  return r;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  const std::vector<double> bd(b.begin(), b.end());
  return ref::compare(a.data(), bd.data(), int64_t(a.size())).rel_l2;
}

struct Inputs {
  Tensor q, k, v;
};
Inputs video_inputs(DType t, int B, int S, int H, uint32_t seed) {
  const ref::Sequences seqs = ref::Sequences::Batched(B, S, H, D);
  const ref::testing::Qkv x = ref::testing::video_like(seqs, seqs, seed);
  return {tensor_of(t, x.q, B, S, H), tensor_of(t, x.k, B, S, H), tensor_of(t, x.v, B, S, H)};
}

TEST(VcAttention, MatchesReferenceWithSamePermutation) {
  SKIP_WITHOUT_SM90();
  struct C {
    DType t;
    int B, S, H;
  };
  for (C c : {C{DType::kBFloat16, 1, 1000, 2}, C{DType::kBFloat16, 2, 2048, 1}, C{DType::kFloat16, 1, 1500, 2}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " S=" << c.S << " H=" << c.H);
    const Inputs x = video_inputs(c.t, c.B, c.S, c.H, 31 + c.S);
    std::vector<int> perm;  // from the GPU grouping
    const AttnRun got = run_gpu_vc(c.t, x.q, x.k, x.v, &perm);
    ASSERT_FALSE(got.out.empty());
    int64_t non_finite = 0;
    for (float o : got.out) non_finite += !std::isfinite(o);
    ASSERT_EQ(non_finite, 0) << "output elements left unwritten or NaN";
    const ref::Sequences seqs = ref::Sequences::Batched(c.B, c.S, c.H, D);
    ref::AttentionResult want;
    ASSERT_TRUE(ref::attention_vc(x.q.values.data(), x.k.values.data(), x.v.values.data(), seqs, seqs, perm,
                                  ref::AttentionOptions{}, &want).ok());
    const std::vector<double> want_d(want.out.begin(), want.out.end());
    const ref::ErrorMetrics e = ref::compare(got.out.data(), want_d.data(), int64_t(want_d.size()));
    double ref_max = 0;
    for (double w : want_d) ref_max = std::max(ref_max, std::fabs(w));
    // Same tolerances as the fast path (test_attention_sm90.cu): the FP8 QK^T accumulator moves a few codes.
    EXPECT_LE(e.rel_l2, 5e-3);
    EXPECT_LE(e.max_abs, 0.04 * ref_max + 1e-3);
    double lse_max = 0, lse_mean = 0;
    for (size_t i = 0; i < want.lse.size(); ++i) {
      const double d = std::fabs(got.lse[i] - want.lse[i]);
      lse_max = std::max(lse_max, d);
      lse_mean += d / double(want.lse.size());
    }
    EXPECT_LE(lse_max, 0.03);
    EXPECT_LE(lse_mean, 5e-3);
    std::vector<double> exact;
    ASSERT_TRUE(ref::attention_exact(x.q.values.data(), x.k.values.data(), x.v.values.data(), seqs, seqs, 0.0f, false,
                                     &exact).ok());
    const double ek = ref::compare(got.out.data(), exact.data(), int64_t(exact.size())).rel_l2;
    const double er = ref::compare(want.out.data(), exact.data(), int64_t(exact.size())).rel_l2;
    EXPECT_LE(ek, 1.1 * er + 1e-3);
    std::printf("  [B=%d S=%d H=%d] vs reference: rel_l2 %.2e max_abs %.2e lse max %.1e mean %.1e | vs exact: "
                "kernel %.4f reference %.4f\n", c.B, c.S, c.H, e.rel_l2, e.max_abs, lse_max, lse_mean, ek, er);
  }
}

TEST(VcAttention, OutputInvariantToPermutation) {
  SKIP_WITHOUT_SM90();
  const int B = 1, S = 1000, H = 2;
  const Inputs x = video_inputs(DType::kBFloat16, B, S, H, 77);
  std::vector<int> grouped, identity = identity_permutation(B * H, S), shuffled = random_permutation(B * H, S, 9);
  const AttnRun a = run_gpu_vc(DType::kBFloat16, x.q, x.k, x.v, &grouped);
  const AttnRun b = run_gpu_vc(DType::kBFloat16, x.q, x.k, x.v, &identity);
  const AttnRun c = run_gpu_vc(DType::kBFloat16, x.q, x.k, x.v, &shuffled);
  ASSERT_FALSE(a.out.empty() || b.out.empty() || c.out.empty());
  // Permuting keys is exact math; what changes is the quantization (K blocks, V-Smooth blocks) and the
  // running-max order. The reference's own outputs differ by 0.45-0.7% between these permutations on
  // such inputs; the kernel adds its accumulator noise (<= 0.5% against the reference).
  const double ab = rel_l2(a.out, b.out), ac = rel_l2(a.out, c.out), bc = rel_l2(b.out, c.out);
  EXPECT_LE(ab, 0.015);
  EXPECT_LE(ac, 0.015);
  EXPECT_LE(bc, 0.015);
  const ref::Sequences seqs = ref::Sequences::Batched(B, S, H, D);
  std::vector<double> exact;
  ASSERT_TRUE(ref::attention_exact(x.q.values.data(), x.k.values.data(), x.v.values.data(), seqs, seqs, 0.0f, false,
                                   &exact).ok());
  auto vs_exact = [&](const AttnRun& r) { return ref::compare(r.out.data(), exact.data(), int64_t(exact.size())).rel_l2; };
  for (const AttnRun* r : {&a, &b, &c}) EXPECT_LE(vs_exact(*r), 0.012);
  std::printf("  permutations grouped/identity/random: pairwise rel_l2 %.4f %.4f %.4f; vs exact %.4f %.4f %.4f\n", ab,
              ac, bc, vs_exact(a), vs_exact(b), vs_exact(c));
}

// ---- CPU-only: the reference preparation by hand, and the argument checks -------------------------------

TEST(VcReference, PrepareHandChecked) {
  ref::Sequences seqs = ref::Sequences::Batched(1, 3, 1, 2);
  // Channel 0: 1, 2, 2 -> mean 5/3 -> float 1.6666666 -> BF16 1.6640625; channel 1 constant -> residual 0.
  const std::vector<float> v = {1, 0.5f, 2, 0.5f, 2, 0.5f};
  const std::vector<float> q = {1, 2, 3, 4, 5, 6}, k = {1, 1, 2, 2, 4, 4};
  const std::vector<int> perm = {2, 0, 1};
  ref::VcPrepared rp;
  ASSERT_TRUE(ref::vc_prepare(q.data(), k.data(), v.data(), seqs, seqs, perm, &rp).ok());
  EXPECT_EQ(rp.block_mean, (std::vector<float>{1.6640625f, 0.5f}));
  const float amax = 1.6640625f - 1.0f;
  EXPECT_EQ(rp.channel_descale, (std::vector<float>{amax / 448.0f, 1.0f}));
  EXPECT_EQ(rp.channel_scale_inv, (std::vector<float>{448.0f / amax, 0.0f}));
  // Permuted V rows: tokens 2, 0, 1 = 2, 1, 2 on channel 0.
  const float r[3] = {2.0f - 1.6640625f, 1.0f - 1.6640625f, 2.0f - 1.6640625f};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(rp.v_codes[2 * i], ref::e4m3_encode(r[i] * (448.0f / amax))) << "row " << i;
    EXPECT_EQ(rp.v_codes[2 * i + 1], 0) << "row " << i;
  }
  EXPECT_EQ(rp.v_codes[2], 0xFE);  // -amax -> -448
  // K is permuted before its block quantization: rows 4, 1, 2 (amax 4); Q keeps its order.
  EXPECT_EQ(rp.k.descale, (std::vector<float>{4.0f / 448.0f}));
  EXPECT_EQ(rp.k.codes[0], ref::e4m3_encode(448.0f));
  EXPECT_EQ(rp.k.codes[2], ref::e4m3_encode(1.0f * (448.0f / 4.0f)));
  EXPECT_EQ(rp.q.descale, (std::vector<float>{6.0f / 448.0f}));
  EXPECT_EQ(rp.q.codes[0], ref::e4m3_encode(1.0f * (448.0f / 6.0f)));
  // A malformed permutation is rejected with its position.
  const openvc::Status st = ref::vc_prepare(q.data(), k.data(), v.data(), seqs, seqs, {0, 0, 1}, &rp);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("permutation"), std::string::npos) << st.message();
}

template <typename T>
T* fake(uintptr_t addr) { return reinterpret_cast<T*>(addr); }  // never dereferenced: validation fails first

void expect_invalid(const openvc::Status& st, openvc::StatusCode code, const char* needle) {
  EXPECT_EQ(int(st.code()), int(code)) << st.message();
  EXPECT_NE(st.message().find(needle), std::string::npos) << "message '" << st.message() << "' lacks '" << needle << "'";
}

TEST(VcArgs, RejectsBadParameters) {
  using openvc::StatusCode;
  openvc::VcGroupingParams g;
  g.batch = 1, g.seqlen = 1000, g.heads = 2;
  g.v = {fake<const void>(0x10000), 2 * 1000 * D, 2 * D, D};
  g.permutation = fake<int>(0x20000);
  g.workspace = fake<void>(0x30000);
  g.workspace_bytes = openvc::vc_grouping_workspace_bytes(1, 2, 1000) - 1;
  expect_invalid(openvc::vc_grouping(g, nullptr), StatusCode::kInvalidArgument, "workspace_bytes");
  g.workspace_bytes += 1;
  g.permutation = fake<int>(0x20002);
  expect_invalid(openvc::vc_grouping(g, nullptr), StatusCode::kInvalidArgument, "permutation");
  g.v.stride_seq = 2 * D + 4;
  expect_invalid(openvc::vc_grouping(g, nullptr), StatusCode::kInvalidArgument, "v.stride_seq");
  g.head_dim = 64;
  expect_invalid(openvc::vc_grouping(g, nullptr), StatusCode::kUnsupported, "head_dim");
  g.head_dim = D, g.seqlen = 0;
  expect_invalid(openvc::vc_grouping(g, nullptr), StatusCode::kInvalidArgument, "seqlen");
  EXPECT_EQ(openvc::vc_grouping_workspace_bytes(1, 2, 1000, 64), 0u);
  EXPECT_GT(openvc::vc_grouping_workspace_bytes(1, 56, 73397), openvc::vc_grouping_workspace_bytes(1, 56, 7000));

  openvc::VcPrepareParams p;
  p.batch = 1, p.seqlen_q = 100, p.seqlen_k = 100, p.heads = 2;
  const openvc::TokenTensorView t{fake<const void>(0x10000), 2 * 100 * D, 2 * D, D};
  p.q = p.k = p.v = t;
  p.q_codes = p.k_codes = p.v_packed = fake<uint8_t>(0x40000);
  p.q_descale = p.k_descale = p.v_channel_descale = p.block_mean_scaled = fake<float>(0x50000);
  p.workspace = fake<void>(0x60000);
  p.workspace_bytes = openvc::vc_prepare_workspace_bytes(1, 2);
  expect_invalid(openvc::vc_prepare(p, nullptr), StatusCode::kInvalidArgument, "permutation");
  p.permutation = fake<const int>(0x70000);
  p.block_mean_scaled = fake<float>(0x50004);
  expect_invalid(openvc::vc_prepare(p, nullptr), StatusCode::kInvalidArgument, "block_mean_scaled");
  p.block_mean_scaled = fake<float>(0x50000);
  p.workspace_bytes -= 1;
  expect_invalid(openvc::vc_prepare(p, nullptr), StatusCode::kInvalidArgument, "workspace_bytes");
  p.workspace_bytes += 1;
  p.k.data = nullptr;
  expect_invalid(openvc::vc_prepare(p, nullptr), StatusCode::kInvalidArgument, "k.data");
  p.k = t, p.head_dim = 64;
  expect_invalid(openvc::vc_prepare(p, nullptr), StatusCode::kUnsupported, "head_dim");
  EXPECT_EQ(openvc::vc_prepare_workspace_bytes(2, 3), size_t(2 * 3 * D * 4));
}

}  // namespace
