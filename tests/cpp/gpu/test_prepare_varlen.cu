// prepare_fp8 on packed variable-length sequences (PrepareParams::cu_seqlens_q/k) against the CPU
// reference with the same Sequences: codes and descales byte-identical, each sequence quantized on its
// own, q/k descales [N, H, ceil(max_seqlen/128)] with 0 past a sequence's end, packed V
// [N, H, D, ceil(max_seqlen_k/128)*128] with each sequence from column 0 of its slab and zero padding.
// Outputs and workspace are poisoned first. Tests that launch kernels skip without an sm_90 device.
// Run: openvc_gpu_tests --gtest_filter='*PrepareVarlen*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/prepare_test_util.h"
#include "openvc/attention.h"
#include "openvc/reference.h"

namespace {

using openvc::DType;
using openvc::PrepareParams;
using namespace openvc::testing;
namespace ref = openvc::reference;

std::vector<int> offsets(const std::vector<int>& lens) {
  std::vector<int> cu{0};
  for (int n : lens) cu.push_back(cu.back() + n);
  return cu;
}
int max_of(const std::vector<int>& lens) { return *std::max_element(lens.begin(), lens.end()); }

struct Case {
  DType dtype;
  std::vector<int> lens_q, lens_k;
  int H, D;
  Layout layout;
  int extra_max = 0;  // added to max_seqlen_q/k: an upper bound larger than the longest sequence
};
std::string case_name(const Case& c) {
  std::ostringstream o;
  o << (c.dtype == DType::kBFloat16 ? "bf16" : "f16") << "_q";
  for (int n : c.lens_q) o << "_" << n;
  o << "_k";
  for (int n : c.lens_k) o << "_" << n;
  o << "_H" << c.H << "_D" << c.D << (c.layout == Layout::kPadded ? "_strided" : "")
    << (c.extra_max ? "_maxbound" : "");
  return o.str();
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }  // gtest's parameter printout

using Outputs = PreparedHost;

// Device outputs, offsets and params of one packed problem; q/k/v views are set by the caller.
struct VarlenProblem {
  Case c;
  std::vector<int> cu_q, cu_k;
  int nseq, max_q, max_k, nq, nk;
  int64_t sk_pad;
  DevBuf d_cu_q, d_cu_k;
  PreparedDevice dev;
  PrepareParams params;

  explicit VarlenProblem(const Case& cs)
      : c(cs),
        cu_q(offsets(cs.lens_q)),
        cu_k(offsets(cs.lens_k)),
        nseq(int(cs.lens_q.size())),
        max_q(max_of(cs.lens_q) + cs.extra_max),
        max_k(max_of(cs.lens_k) + cs.extra_max),
        nq(int(openvc::num_quant_blocks(max_q))),
        nk(int(openvc::num_quant_blocks(max_k))),
        sk_pad(openvc::packed_seqlen_k(max_k)),
        d_cu_q(cu_q.size() * 4),
        d_cu_k(cu_k.size() * 4),
        dev(std::max<size_t>(size_t(cu_q.back()) * cs.H * cs.D, 16),
            std::max<size_t>(size_t(cu_k.back()) * cs.H * cs.D, 16), size_t(nseq) * cs.H * cs.D * sk_pad,
            size_t(nseq) * cs.H, nq, nk, openvc::prepare_workspace_bytes(nseq, cs.H, max_k, false)) {
    if (d_cu_q.p) upload(d_cu_q.p, cu_q);
    if (d_cu_k.p) upload(d_cu_k.p, cu_k);
    params.dtype = cs.dtype;
    params.heads = cs.H;
    params.head_dim = cs.D;
    params.cu_seqlens_q = d_cu_q.as<const int>();
    params.cu_seqlens_k = d_cu_k.as<const int>();
    params.num_seqs = nseq;
    params.max_seqlen_q = max_q;
    params.max_seqlen_k = max_k;
    params.total_q = cu_q.back();
    params.total_k = cu_k.back();
    dev.bind(params);
  }
  bool allocated() const { return d_cu_q.p && d_cu_k.p && dev.allocated(); }
  void poison(cudaStream_t st) const { dev.poison(st); }
  Outputs read() const {
    return dev.read(size_t(cu_q.back()) * c.H * c.D, size_t(cu_k.back()) * c.H * c.D);
  }
};

// q/k descale [N, H, nb] against the reference's [N, H, ref.max_blocks] (nb >= max_blocks: 0 beyond).
void expect_block_descales(const char* what, const std::vector<float>& got, const ref::BlockQuantized& r, int nseq,
                           int H, int nb) {
  ASSERT_EQ(got.size(), size_t(nseq) * H * nb) << what;
  ASSERT_GE(nb, r.max_blocks) << what;
  std::vector<float> want(got.size(), 0.0f);
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < H; ++h)
      for (int b = 0; b < r.max_blocks; ++b)
        want[(size_t(s) * H + h) * nb + b] = r.descale[(size_t(s) * H + h) * r.max_blocks + b];
  expect_floats(what, got, want);
}

// v_packed [N, H, D, sk_pad]: column 16G + kappa of sequence s holds its key 16G + kPackedKeyOrder[kappa]
// (token cu[s] + key of the reference codes), and code 0 past the sequence's end.
void expect_packed(const std::vector<uint8_t>& got, const std::vector<uint8_t>& ref_codes,
                   const std::vector<int>& cu, int H, int D, int64_t sk_pad) {
  const int nseq = int(cu.size()) - 1;
  ASSERT_EQ(got.size(), size_t(nseq) * H * D * sk_pad);
  int64_t bad = 0;
  std::string first;
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d)
        for (int64_t col = 0; col < sk_pad; ++col) {
          const int64_t key = col / 16 * 16 + openvc::kPackedKeyOrder[col % 16];
          const uint8_t want =
              key < cu[s + 1] - cu[s] ? ref_codes[((cu[s] + key) * H + h) * int64_t(D) + d] : uint8_t(0);
          const uint8_t g = got[((int64_t(s) * H + h) * D + d) * sk_pad + col];
          if (g != want && bad++ == 0) {
            first = "seq=" + std::to_string(s) + " h=" + std::to_string(h) + " d=" + std::to_string(d) +
                    " column=" + std::to_string(col) + " (key " + std::to_string(key) + "): got " + hex(g) +
                    ", reference " + hex(want);
          }
        }
  if (bad) ADD_FAILURE() << "v_packed: " << bad << " of " << got.size() << " bytes differ; first at " << first;
}

ref::Sequences sequences(const std::vector<int>& cu, int H, int D) {
  ref::Sequences s;
  s.cu_seqlens = cu;
  s.num_heads = H;
  s.head_dim = D;
  return s;
}

void expect_matches_reference(const VarlenProblem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Outputs& out) {
  const int H = p.c.H, D = p.c.D;
  const auto qs = sequences(p.cu_q, H, D), ks = sequences(p.cu_k, H, D);
  ref::BlockQuantized rq, rk;
  ref::HeadQuantized rv;
  ASSERT_TRUE(ref::quantize_blocks(q.values.data(), qs, &rq).ok());
  ASSERT_TRUE(ref::quantize_blocks(k.values.data(), ks, &rk).ok());
  ASSERT_TRUE(ref::quantize_heads(v.values.data(), ks, &rv).ok());
  expect_codes("q_codes", out.q_codes, rq.codes, q);
  expect_codes("k_codes", out.k_codes, rk.codes, k);
  expect_block_descales("q_descale", out.q_descale, rq, p.nseq, H, p.nq);
  expect_block_descales("k_descale", out.k_descale, rk, p.nseq, H, p.nk);
  expect_floats("v_descale", out.v_descale, rv.descale);
  expect_packed(out.v_packed, rv.codes, p.cu_k, H, D, p.sk_pad);
}

// Packed [total, H, D] inputs (Tensor with B = 1, S = total).
struct Inputs {
  Tensor q, k, v;
};
Inputs random_inputs(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int tq = offsets(c.lens_q).back(), tk = offsets(c.lens_k).back();
  return {random_tensor(c.dtype, 1, tq, c.H, c.D, rng), random_tensor(c.dtype, 1, tk, c.H, c.D, rng),
          random_tensor(c.dtype, 1, tk, c.H, c.D, rng)};
}

// The packed views ignore stride_batch: set it to a value the batched checks would reject.
openvc::TokenTensorView packed_view(const DevTensor& t) {
  openvc::TokenTensorView v = t.view();
  v.stride_batch = 12345;
  return v;
}

void run_and_check(const Case& c, const Inputs& in) {
  VarlenProblem p(c);
  ASSERT_TRUE(p.allocated()) << "cudaMalloc failed";
  DevTensor dq(c.dtype, in.q, strides_of(c.layout, in.q.S, c.H, c.D));
  DevTensor dk(c.dtype, in.k, strides_of(c.layout, in.k.S, c.H, c.D));
  DevTensor dv(c.dtype, in.v, strides_of(c.layout, in.v.S, c.H, c.D));
  ASSERT_TRUE(dq.buf.p && dk.buf.p && dv.buf.p) << "cudaMalloc failed";
  p.params.q = packed_view(dq);
  p.params.k = packed_view(dk);
  p.params.v = packed_view(dv);
  p.poison(0);
  const openvc::Status st = openvc::prepare_fp8(p.params, 0);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  expect_matches_reference(p, in.q, in.k, in.v, p.read());
}

// ---- shapes -------------------------------------------------------------------------------------------

class PrepareVarlenShapes : public ::testing::TestWithParam<Case> {};

TEST_P(PrepareVarlenShapes, ByteIdenticalToReference) {
  SKIP_WITHOUT_SM90();
  const Case c = GetParam();
  uint32_t seed = uint32_t(c.H * 31 + c.D + c.extra_max);
  for (int n : c.lens_q) seed = seed * 7 + uint32_t(n);
  for (int n : c.lens_k) seed = seed * 5 + uint32_t(n);
  run_and_check(c, random_inputs(c, seed));
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (DType t : {DType::kBFloat16, DType::kFloat16})
    for (int D : {128, 64}) {
      v.push_back({t, {1, 300, 1000}, {1, 300, 1000}, 3, D, Layout::kContiguous});
      v.push_back({t, {128, 129}, {128, 129}, 2, D, Layout::kContiguous});
      // Different Q and K lengths per sequence, strided views (poisoned gaps).
      v.push_back({t, {1, 300, 1000}, {700, 5, 129}, 2, D, Layout::kPadded});
      // Empty sequences (descale 0, all-padding V slab) and max_seqlen an upper bound (extra blocks).
      v.push_back({t, {0, 257, 3}, {5, 0, 400}, 2, D, Layout::kContiguous, 200});
    }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Prepare, PrepareVarlenShapes, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return case_name(i.param); });

// ---- the batched case is cu = {0, S, 2S, ...} -----------------------------------------------------------

// The same contiguous [B, S, H, D] buffers prepared batched and as packed sequences of length S give
// identical bytes in every output.
TEST(PrepareVarlen, BatchedIsTheEqualLengthCase) {
  SKIP_WITHOUT_SM90();
  for (const auto& [t, B, S, H, D] : {std::tuple{DType::kBFloat16, 2, 1000, 3, 128},
                                      std::tuple{DType::kFloat16, 3, 129, 2, 64}}) {
    SCOPED_TRACE("S=" + std::to_string(S) + " D=" + std::to_string(D));
    const Case c{t, std::vector<int>(B, S), std::vector<int>(B, S), H, D, Layout::kContiguous};
    const Inputs in = random_inputs(c, 40 + S);
    DevTensor dq(t, in.q, strides_of(Layout::kContiguous, B * S, H, D));
    DevTensor dk(t, in.k, strides_of(Layout::kContiguous, B * S, H, D));
    DevTensor dv(t, in.v, strides_of(Layout::kContiguous, B * S, H, D));
    ASSERT_TRUE(dq.buf.p && dk.buf.p && dv.buf.p);

    VarlenProblem packed(c), batched(c);
    ASSERT_TRUE(packed.allocated() && batched.allocated());
    packed.params.q = packed_view(dq), packed.params.k = packed_view(dk), packed.params.v = packed_view(dv);
    PrepareParams& bp = batched.params;
    bp.cu_seqlens_q = bp.cu_seqlens_k = nullptr;
    bp.num_seqs = bp.max_seqlen_q = bp.max_seqlen_k = 0;
    bp.batch = B, bp.seqlen_q = bp.seqlen_k = S;
    const int64_t sb = int64_t(S) * H * D, ss = int64_t(H) * D;
    bp.q = {dq.buf.p, sb, ss, D}, bp.k = {dk.buf.p, sb, ss, D}, bp.v = {dv.buf.p, sb, ss, D};
    packed.poison(0);
    batched.poison(0);
    const openvc::Status s1 = openvc::prepare_fp8(packed.params, 0), s2 = openvc::prepare_fp8(bp, 0);
    ASSERT_TRUE(s1.ok()) << s1.message();
    ASSERT_TRUE(s2.ok()) << s2.message();
    CUDA_OK(cudaDeviceSynchronize());
    const Outputs a = packed.read(), b = batched.read();
    EXPECT_TRUE(a.q_codes == b.q_codes) << "q_codes";
    EXPECT_TRUE(a.k_codes == b.k_codes) << "k_codes";
    EXPECT_TRUE(a.v_packed == b.v_packed) << "v_packed";
    expect_floats("q_descale", a.q_descale, b.q_descale);
    expect_floats("k_descale", a.k_descale, b.k_descale);
    expect_floats("v_descale", a.v_descale, b.v_descale);
    expect_matches_reference(packed, in.q, in.k, in.v, a);
  }
}

// ---- CUDA graph: the offsets are read on the device only ----------------------------------------------

// Captured once with lengths {300, 1, 1000}; new offsets ({1000, 299, 2}, same totals and max) are
// written into the same device arrays and the graph replayed: the outputs follow the new sequences.
TEST(PrepareVarlen, GraphReplayFollowsNewOffsets) {
  SKIP_WITHOUT_SM90();
  const Case first{DType::kBFloat16, {300, 1, 1000}, {64, 1000, 237}, 2, 128, Layout::kPadded};
  const Case second{DType::kBFloat16, {1000, 299, 2}, {1000, 1, 300}, 2, 128, Layout::kPadded};
  const Inputs in = random_inputs(first, 77);
  VarlenProblem p(first);
  ASSERT_TRUE(p.allocated());
  DevTensor dq(first.dtype, in.q, strides_of(first.layout, in.q.S, first.H, first.D));
  DevTensor dk(first.dtype, in.k, strides_of(first.layout, in.k.S, first.H, first.D));
  DevTensor dv(first.dtype, in.v, strides_of(first.layout, in.v.S, first.H, first.D));
  p.params.q = packed_view(dq), p.params.k = packed_view(dk), p.params.v = packed_view(dv);

  const CapturedGraph cg(cudaStreamCaptureModeThreadLocal,
                         [&](cudaStream_t stream) { return openvc::prepare_fp8(p.params, stream); });
  ASSERT_TRUE(cg.status.ok()) << cg.status.message();
  CUDA_OK(cg.error);
  const cudaStream_t stream = cg.stream;

  p.poison(stream);
  CUDA_OK(cg.launch());
  CUDA_OK(cudaStreamSynchronize(stream));
  expect_matches_reference(p, in.q, in.k, in.v, p.read());

  VarlenProblem expected(second);  // host offsets and sizes of the second call, for the comparison
  ASSERT_TRUE(upload(p.d_cu_q.p, expected.cu_q) && upload(p.d_cu_k.p, expected.cu_k));
  ASSERT_EQ(expected.max_q, p.max_q);
  ASSERT_EQ(expected.max_k, p.max_k);
  p.poison(stream);
  CUDA_OK(cg.launch());
  CUDA_OK(cudaStreamSynchronize(stream));
  expect_matches_reference(expected, in.q, in.k, in.v, p.read());
}

// ---- argument checks (no device needed: they fail before any CUDA call) ---------------------------------

PrepareParams valid_packed_params() {
  PrepareParams p;
  p.heads = 2;
  p.head_dim = 128;
  p.q = {fake_address(0x10000), 0, 2 * 128, 128};
  p.k = p.v = p.q;
  p.cu_seqlens_q = static_cast<const int*>(fake_address(0x90000));
  p.cu_seqlens_k = static_cast<const int*>(fake_address(0x90100));
  p.num_seqs = 3;
  p.max_seqlen_q = p.max_seqlen_k = 1000;
  p.total_q = p.total_k = 3000;
  bind_fake_outputs(p);
  p.workspace_bytes = openvc::prepare_workspace_bytes(3, 2, 1000, false);
  return p;
}

TEST(PrepareVarlenArgs, RejectsBadParameters) {
  PrepareParams p = valid_packed_params();
  p.cu_seqlens_k = nullptr;
  expect_invalid(p, "cu_seqlens_k is null");
  p = valid_packed_params();
  p.cu_seqlens_q = nullptr;
  expect_invalid(p, "cu_seqlens_q is null");
  p = valid_packed_params();
  p.cu_seqlens_q = reinterpret_cast<const int*>(0x90002);
  expect_invalid(p, "cu_seqlens_q must be 4-byte aligned");
  p = valid_packed_params();
  p.num_seqs = 0;
  expect_invalid(p, "num_seqs");
  p = valid_packed_params();
  p.max_seqlen_q = 0;
  expect_invalid(p, "max_seqlen_q");
  p = valid_packed_params();
  p.max_seqlen_k = -5;
  expect_invalid(p, "max_seqlen_k");
  p = valid_packed_params();
  p.total_k = -1;  // unset: the offsets could not be clamped
  expect_invalid(p, "total_q and total_k");
  p = valid_packed_params();
  p.workspace_bytes = openvc::prepare_workspace_bytes(1, 2, 1000, false);  // sized for one sequence
  expect_invalid(p, "prepare_workspace_bytes(num_seqs, heads, max_seqlen_k, k_smoothing, v_bias) = (3, 2, 1000, false, false)");
  p = valid_packed_params();
  p.k_smoothing = true;  // the smoothing workspace is larger
  expect_invalid(p, "prepare_workspace_bytes(num_seqs, heads, max_seqlen_k, k_smoothing, v_bias) = (3, 2, 1000, true, false)");
  p = valid_packed_params();
  p.v.stride_seq = 2 * 128 + 4;
  expect_invalid(p, "v.stride_seq");
  // Batched inputs (no offsets) with packed-only fields set.
  p = valid_packed_params();
  p.cu_seqlens_q = p.cu_seqlens_k = nullptr;
  p.batch = 1, p.seqlen_q = p.seqlen_k = 256;
  expect_invalid(p, "num_seqs, max_seqlen_q and max_seqlen_k are for packed sequences");
}

}  // namespace
