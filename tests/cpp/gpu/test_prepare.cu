// prepare_fp8 against the CPU reference (docs/numerics.md section 1): codes and descales must be
// byte-identical. Tests that launch kernels skip, with the reason, where no compute capability 9.0
// device is present; the argument checks run everywhere (they fail before any CUDA call).
// Packed sequences (cu_seqlens): test_prepare_varlen.cu.
// Run: openvc_gpu_tests --gtest_filter='Prepare*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/e4m3.cuh"
#include "gpu/gpu_test_util.h"
#include "gpu/prepare_test_util.h"
#include "openvc/attention.h"
#include "openvc/reference.h"

namespace {

using openvc::DType;
using openvc::PrepareParams;
using namespace openvc::testing;  // DevBuf, download, Tensor, DevTensor, expect_codes, ...
namespace ref = openvc::reference;

// ---- one problem: buffers, params, and the check against the reference -----------------------------

struct Shape {
  DType dtype;
  int B, Sq, Sk, H, D;
  Layout layout;
};
std::string shape_name(const Shape& s) {
  std::ostringstream o;
  o << (s.dtype == DType::kBFloat16 ? "bf16" : "f16") << "_B" << s.B << "_Sq" << s.Sq << "_Sk" << s.Sk << "_H"
    << s.H << "_D" << s.D << (s.layout == Layout::kPadded ? "_strided" : "");
  return o.str();
}

using Outputs = PreparedHost;

struct Problem {
  Shape sh;
  int nq, nk;
  int64_t sk_pad;
  PreparedDevice dev;
  PrepareParams params;

  explicit Problem(const Shape& s)
      : sh(s),
        nq(int(openvc::num_quant_blocks(s.Sq))),
        nk(int(openvc::num_quant_blocks(s.Sk))),
        sk_pad(openvc::packed_seqlen_k(s.Sk)),
        dev(size_t(s.B) * s.Sq * s.H * s.D, size_t(s.B) * s.Sk * s.H * s.D, size_t(s.B) * s.H * s.D * sk_pad,
            size_t(s.B) * s.H, nq, nk, openvc::prepare_workspace_bytes(s.B, s.H, s.Sk, false)) {
    params.dtype = s.dtype;
    params.batch = s.B;
    params.seqlen_q = s.Sq;
    params.seqlen_k = s.Sk;
    params.heads = s.H;
    params.head_dim = s.D;
    dev.bind(params);
  }
  bool allocated() const { return dev.allocated(); }
  void poison(cudaStream_t st) const { dev.poison(st); }
  Outputs read() const { return dev.read(dev.q_codes.bytes, dev.k_codes.bytes); }
};

// v_packed [B, H, D, Sk_pad]: column 16G + kappa holds key 16G + kPackedKeyOrder[kappa]; padding 0.
void expect_packed(const std::vector<uint8_t>& got, const std::vector<uint8_t>& ref_codes, const Shape& s,
                   int64_t sk_pad) {
  ASSERT_EQ(got.size(), size_t(s.B) * s.H * s.D * sk_pad);
  int64_t bad = 0;
  std::string first;
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h)
      for (int d = 0; d < s.D; ++d)
        for (int64_t col = 0; col < sk_pad; ++col) {
          const int64_t key = col / 16 * 16 + openvc::kPackedKeyOrder[col % 16];
          const uint8_t want = key < s.Sk ? ref_codes[((int64_t(b) * s.Sk + key) * s.H + h) * s.D + d] : 0;
          const uint8_t g = got[((int64_t(b) * s.H + h) * s.D + d) * sk_pad + col];
          if (g != want && bad++ == 0) {
            first = "b=" + std::to_string(b) + " h=" + std::to_string(h) + " d=" + std::to_string(d) +
                    " column=" + std::to_string(col) + " (key " + std::to_string(key) + "): got " + hex(g) +
                    ", reference " + hex(want);
          }
        }
  if (bad) ADD_FAILURE() << "v_packed: " << bad << " of " << got.size() << " bytes differ; first at " << first;
}

void expect_matches_reference(const Shape& s, int64_t sk_pad, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Outputs& out) {
  const auto qs = ref::Sequences::Batched(s.B, s.Sq, s.H, s.D);
  const auto ks = ref::Sequences::Batched(s.B, s.Sk, s.H, s.D);
  ref::BlockQuantized rq, rk;
  ref::HeadQuantized rv;
  ASSERT_TRUE(ref::quantize_blocks(q.values.data(), qs, &rq).ok());
  ASSERT_TRUE(ref::quantize_blocks(k.values.data(), ks, &rk).ok());
  ASSERT_TRUE(ref::quantize_heads(v.values.data(), ks, &rv).ok());
  expect_codes("q_codes", out.q_codes, rq.codes, q);
  expect_codes("k_codes", out.k_codes, rk.codes, k);
  expect_floats("q_descale", out.q_descale, rq.descale);
  expect_floats("k_descale", out.k_descale, rk.descale);
  expect_floats("v_descale", out.v_descale, rv.descale);
  expect_packed(out.v_packed, rv.codes, s, sk_pad);
}

// Uploads q/k/v with the shape's layout, runs prepare_fp8 on `stream` (poisoned outputs), reads back.
struct Inputs {
  Tensor q, k, v;
};
Inputs random_inputs(const Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in;
  in.q = random_tensor(s.dtype, s.B, s.Sq, s.H, s.D, rng);
  in.k = random_tensor(s.dtype, s.B, s.Sk, s.H, s.D, rng);
  in.v = random_tensor(s.dtype, s.B, s.Sk, s.H, s.D, rng);
  return in;
}

void run_and_check(const Shape& s, const Inputs& in, cudaStream_t stream) {
  Problem p(s);
  ASSERT_TRUE(p.allocated()) << "cudaMalloc failed";
  DevTensor dq(s.dtype, in.q, strides_of(s.layout, s.Sq, s.H, s.D));
  DevTensor dk(s.dtype, in.k, strides_of(s.layout, s.Sk, s.H, s.D));
  DevTensor dv(s.dtype, in.v, strides_of(s.layout, s.Sk, s.H, s.D));
  ASSERT_TRUE(dq.buf.p && dk.buf.p && dv.buf.p) << "cudaMalloc failed";
  p.params.q = dq.view();
  p.params.k = dk.view();
  p.params.v = dv.view();
  p.poison(stream);
  const openvc::Status st = openvc::prepare_fp8(p.params, stream);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaStreamSynchronize(stream));
  expect_matches_reference(s, p.sk_pad, in.q, in.k, in.v, p.read());
}

// ---- shapes -----------------------------------------------------------------------------------

class PrepareShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(PrepareShapes, ByteIdenticalToReference) {
  SKIP_WITHOUT_SM90();
  const Shape s = GetParam();
  run_and_check(s, random_inputs(s, uint32_t(s.B * 7919 + s.Sq * 31 + s.Sk * 17 + s.H * 3 + s.D)), 0);
}

std::vector<Shape> all_shapes() {
  std::vector<Shape> v;
  for (DType t : {DType::kBFloat16, DType::kFloat16})
    for (int D : {128, 64})
      for (int B : {1, 2})
        for (int H : {1, 3})
          for (int S : {1, 127, 128, 1000, 4097}) v.push_back({t, B, S, S, H, D, Layout::kContiguous});
  // Sq != Sk, and strided (padded) views.
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    v.push_back({t, 2, 1000, 4097, 3, 128, Layout::kContiguous});
    v.push_back({t, 1, 4097, 129, 2, 64, Layout::kContiguous});
    v.push_back({t, 2, 1000, 300, 3, 128, Layout::kPadded});
    v.push_back({t, 1, 255, 257, 2, 64, Layout::kPadded});
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Prepare, PrepareShapes, ::testing::ValuesIn(all_shapes()),
                         [](const ::testing::TestParamInfo<Shape>& i) { return shape_name(i.param); });

// ---- special inputs ---------------------------------------------------------------------------

class PrepareSpecial : public ::testing::TestWithParam<DType> {};

// All-zero groups: Q block 1 of head 1, K's partial last block of head 0, all of V head 1. Some
// zeros are -0.0 (code 0x80: the sign survives the multiply by scale_inv = 0).
TEST_P(PrepareSpecial, ZeroGroups) {
  SKIP_WITHOUT_SM90();
  const Shape s{GetParam(), 1, 300, 300, 2, 128, Layout::kContiguous};
  Inputs in = random_inputs(s, 11);
  for (int i = 128; i < 256; ++i)
    for (int d = 0; d < s.D; ++d) in.q.set(s.dtype, in.q.index(0, i, 1, d), d % 7 ? 0.0f : -0.0f);
  for (int i = 256; i < 300; ++i)
    for (int d = 0; d < s.D; ++d) in.k.set(s.dtype, in.k.index(0, i, 0, d), 0.0f);
  for (int i = 0; i < 300; ++i)
    for (int d = 0; d < s.D; ++d) in.v.set(s.dtype, in.v.index(0, i, 1, d), i % 5 ? 0.0f : -0.0f);
  run_and_check(s, in, 0);
}

// NaN and infinities follow the reference: NaN is ignored by amax and encodes as 0x7F; an infinite
// amax gives scale_inv 0, so finite values of that group become +-0 and the infinity NaN.
TEST_P(PrepareSpecial, NonFinite) {
  SKIP_WITHOUT_SM90();
  const Shape s{GetParam(), 1, 200, 200, 2, 64, Layout::kContiguous};
  Inputs in = random_inputs(s, 12);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  in.q.set(s.dtype, in.q.index(0, 5, 0, 3), nan);
  in.q.set(s.dtype, in.q.index(0, 150, 1, 60), -nan);
  in.k.set(s.dtype, in.k.index(0, 7, 1, 0), inf);
  in.k.set(s.dtype, in.k.index(0, 130, 0, 9), -inf);
  in.v.set(s.dtype, in.v.index(0, 42, 0, 1), nan);
  in.v.set(s.dtype, in.v.index(0, 199, 1, 63), -inf);
  run_and_check(s, in, 0);
}

// Tiny groups (numerics section 1): a group whose 448 / amax overflows (amax below ~1.3e-36: BF16
// subnormals, 1e-37 values) is all zeros with descale 0 — never a NaN code through an infinite scale.
// Q block 0 of head 0 at 1e-37, a K block of BF16 subnormals, all of V head 1 at 3e-38.
TEST_P(PrepareSpecial, TinyGroupsAreZeros) {
  SKIP_WITHOUT_SM90();
  const Shape s{GetParam(), 1, 300, 300, 2, 128, Layout::kContiguous};
  Inputs in = random_inputs(s, 13);
  const bool bf16 = s.dtype == DType::kBFloat16;
  // FP16 has no such values (its smallest subnormal is 6e-8): its tiny group is all zeros except one
  // subnormal, which must still give a finite scale.
  const float tq = bf16 ? 1e-37f : 6e-8f, tk = bf16 ? 9.2e-41f : 6e-8f, tv = bf16 ? 3e-38f : 1.2e-7f;
  for (int i = 0; i < 128; ++i)
    for (int d = 0; d < s.D; ++d) in.q.set(s.dtype, in.q.index(0, i, 0, d), (d % 3 ? tq : -tq) * (1 + i % 2));
  for (int i = 128; i < 256; ++i)
    for (int d = 0; d < s.D; ++d) in.k.set(s.dtype, in.k.index(0, i, 1, d), d % 5 ? tk : 0.0f);
  for (int i = 0; i < 300; ++i)
    for (int d = 0; d < s.D; ++d) in.v.set(s.dtype, in.v.index(0, i, 1, d), (i + d) % 4 ? tv : -tv);
  run_and_check(s, in, 0);
}

INSTANTIATE_TEST_SUITE_P(Prepare, PrepareSpecial, ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(i.param == DType::kBFloat16 ? "bf16" : "f16");
                         });

// ---- CUDA graph and non-default stream ---------------------------------------------------------

// prepare_fp8 captured once, replayed after the inputs changed, must equal an eager call on a
// non-default stream and the reference of the new inputs.
TEST(PrepareGraph, ReplayMatchesEagerAndReference) {
  SKIP_WITHOUT_SM90();
  const Shape s{DType::kBFloat16, 2, 1000, 777, 3, 128, Layout::kPadded};
  Problem p(s);
  ASSERT_TRUE(p.allocated());
  const Inputs first = random_inputs(s, 21), second = random_inputs(s, 22);
  DevTensor dq(s.dtype, first.q, strides_of(s.layout, s.Sq, s.H, s.D));
  DevTensor dk(s.dtype, first.k, strides_of(s.layout, s.Sk, s.H, s.D));
  DevTensor dv(s.dtype, first.v, strides_of(s.layout, s.Sk, s.H, s.D));
  p.params.q = dq.view();
  p.params.k = dk.view();
  p.params.v = dv.view();

  const CapturedGraph cg(cudaStreamCaptureModeThreadLocal,
                         [&](cudaStream_t stream) { return openvc::prepare_fp8(p.params, stream); });
  ASSERT_TRUE(cg.status.ok()) << cg.status.message();
  CUDA_OK(cg.error);
  const cudaStream_t stream = cg.stream;

  // New contents in the same buffers, then replay.
  DevTensor nq(s.dtype, second.q, dq.st), nk(s.dtype, second.k, dk.st), nv(s.dtype, second.v, dv.st);
  CUDA_OK(cudaMemcpy(dq.buf.p, nq.buf.p, dq.buf.bytes, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaMemcpy(dk.buf.p, nk.buf.p, dk.buf.bytes, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaMemcpy(dv.buf.p, nv.buf.p, dv.buf.bytes, cudaMemcpyDeviceToDevice));
  p.poison(stream);
  CUDA_OK(cg.launch());
  CUDA_OK(cudaStreamSynchronize(stream));
  const Outputs replayed = p.read();

  p.poison(stream);
  const openvc::Status st2 = openvc::prepare_fp8(p.params, stream);
  ASSERT_TRUE(st2.ok()) << st2.message();
  CUDA_OK(cudaStreamSynchronize(stream));
  const Outputs eager = p.read();

  EXPECT_TRUE(replayed.q_codes == eager.q_codes && replayed.k_codes == eager.k_codes &&
              replayed.v_packed == eager.v_packed && replayed.q_descale == eager.q_descale &&
              replayed.k_descale == eager.k_descale && replayed.v_descale == eager.v_descale)
      << "graph replay differs from the eager call";
  expect_matches_reference(s, p.sk_pad, second.q, second.k, second.v, eager);
}

// ---- the encoder alone --------------------------------------------------------------------------

__global__ void encode_kernel(const float* x, uint8_t* out, int n) {
  const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (i + 3 < n) {
    const uint32_t w = openvc::detail::e4m3_encode4(x[i], x[i + 1], x[i + 2], x[i + 3]);
    *reinterpret_cast<uint32_t*>(out + i) = w;  // i is a multiple of 4
  }
}

// detail::e4m3_encode4 against reference::e4m3_encode: special values, every bf16 and f16 value,
// the midpoints of neighbouring codes and their neighbours (round-half-even), and a float sweep.
TEST(PrepareE4m3, EncoderMatchesReference) {
  SKIP_WITHOUT_SM90();
  std::vector<float> x;
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.0f, 448.0f, 464.0f, std::nextafter(464.0f, 0.0f), std::nextafter(464.0f, inf), 480.0f,
                  1e30f, inf, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), 0x1p-10f, 0x1p-9f, 3 * 0x1p-10f, 0x1p-6f}) {
    x.push_back(v);
    x.push_back(-v);
  }
  for (uint32_t b = 0; b < 65536; ++b) {
    x.push_back(from_bits(DType::kBFloat16, uint16_t(b)));
    x.push_back(from_bits(DType::kFloat16, uint16_t(b)));
  }
  for (int c = 0; c < 0x7E; ++c) {
    const float mid = 0.5f * (ref::e4m3_decode(uint8_t(c)) + ref::e4m3_decode(uint8_t(c + 1)));
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, inf)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  }
  for (uint64_t b = 0; b < (1ull << 32); b += 997) {
    float v;
    const uint32_t u = uint32_t(b);
    std::memcpy(&v, &u, 4);
    x.push_back(v);
  }
  while (x.size() % 4) x.push_back(0.0f);
  const int n = int(x.size());
  DevBuf dx(x.size() * 4), dout(x.size());
  ASSERT_TRUE(dx.p && dout.p);
  CUDA_OK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  encode_kernel<<<(n / 4 + 255) / 256, 256>>>(dx.as<float>(), dout.as<uint8_t>(), n);
  CUDA_OK(cudaGetLastError());
  const auto got = download<uint8_t>(dout.p, x.size());
  ASSERT_EQ(got.size(), x.size());
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    const uint8_t want = ref::e4m3_encode(x[i]);
    if (got[i] != want && bad++ < 5) {
      uint32_t u;
      std::memcpy(&u, &x[i], 4);
      ADD_FAILURE() << "e4m3(" << x[i] << " = " << hex(u) << "): got " << hex(got[i]) << ", reference " << hex(want);
    }
  }
  EXPECT_EQ(bad, 0) << "of " << n << " values";
}

// ---- argument checks (no device needed: they fail before any CUDA call) -------------------------

// A fully valid parameter set over fake, aligned addresses; each test breaks one field.
PrepareParams valid_params() {
  PrepareParams p;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = 256;
  p.heads = 2;
  p.head_dim = 128;
  p.q = {fake_address(0x10000), 256 * 2 * 128, 2 * 128, 128};
  p.k = p.v = p.q;
  bind_fake_outputs(p);
  p.workspace_bytes = openvc::prepare_workspace_bytes(1, 2, 256, false);
  return p;
}

TEST(PrepareArgs, RejectsBadParameters) {
  using openvc::StatusCode;
  PrepareParams p = valid_params();
  p.head_dim = 96;
  expect_rejected(p, StatusCode::kUnsupported, "head_dim");
  p = valid_params();
  p.batch = 0;
  expect_rejected(p, StatusCode::kInvalidArgument, "batch");
  p = valid_params();
  p.seqlen_k = -3;
  expect_rejected(p, StatusCode::kInvalidArgument, "seqlen_k");
  p = valid_params();
  p.k.data = nullptr;
  expect_rejected(p, StatusCode::kInvalidArgument, "k.data");
  p = valid_params();
  p.v.data = reinterpret_cast<void*>(0x10008);
  expect_rejected(p, StatusCode::kInvalidArgument, "v.data");
  p = valid_params();
  p.q.stride_seq = 2 * 128 + 4;
  expect_rejected(p, StatusCode::kInvalidArgument, "q.stride_seq");
  p = valid_params();
  p.k_codes = nullptr;
  expect_rejected(p, StatusCode::kInvalidArgument, "k_codes");
  p = valid_params();
  p.v_descale = nullptr;
  expect_rejected(p, StatusCode::kInvalidArgument, "v_descale");
  p = valid_params();
  p.workspace_bytes = 4;
  expect_rejected(p, StatusCode::kInvalidArgument, "workspace_bytes");
  p = valid_params();
  p.dtype = static_cast<DType>(7);
  expect_rejected(p, StatusCode::kInvalidArgument, "dtype");
}

TEST(PrepareArgs, WorkspaceBytes) {
  EXPECT_EQ(openvc::prepare_workspace_bytes(0, 4, 100, false), 0u);
  EXPECT_EQ(openvc::prepare_workspace_bytes(0, 4, 100, true), 0u);
  EXPECT_GE(openvc::prepare_workspace_bytes(2, 56, 1000, false), 2u * 56u * 4u);
  EXPECT_EQ(openvc::prepare_workspace_bytes(2, 56, 1000, false) % 16, 0u);
  // Without smoothing max_seqlen_k is unused.
  EXPECT_EQ(openvc::prepare_workspace_bytes(2, 56, 1000, false), openvc::prepare_workspace_bytes(2, 56, 7, false));
  // Smoothing: V amax slots (16-byte rounded), double block sums [G, H, nk, 128], float means [G, H, 128].
  const size_t amax = (3u * 5u * 4u + 15u) / 16u * 16u;
  EXPECT_EQ(openvc::prepare_workspace_bytes(3, 5, 300, true), amax + 3u * 5u * 3u * 128u * 8u + 3u * 5u * 128u * 4u);
  EXPECT_EQ(openvc::prepare_workspace_bytes(3, 5, 300, true) % 16, 0u);
}

}  // namespace
