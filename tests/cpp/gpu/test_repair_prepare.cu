// prepare_v_repair (openvc/repair.h, numerics section 6) against the CPU reference's select_v_repair:
// the selected tokens and their order, the residual codes, the K copies and descales must be
// byte-identical; padding rows zero. Inputs go through the GPU prepare_fp8 first (byte-identical to
// the reference, test_prepare.cu). The end-to-end tests run attention_fp8 with the repair rows and
// compare with the reference attention (kernel tolerance of test_attention_sm90.cu). Argument checks
// run without a device. Run: openvc_gpu_tests --gtest_filter='Repair*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "gpu/prepare_test_util.h"
#include "openvc/attention.h"
#include "openvc/reference.h"
#include "openvc/repair.h"
#include "reference/test_inputs.h"

namespace {

using openvc::DType;
using openvc::RepairPrepareParams;
using openvc::RepairSelection;
using namespace openvc::testing;  // DevBuf, Tensor, DevTensor, PreparedDevice, Layout, ...
namespace ref = openvc::reference;
constexpr int D = 128;

struct Case {
  DType dtype;
  int B, S, H;
  double budget;
  Layout layout = Layout::kContiguous;
};

// Q, K and V on the device and their prepare_fp8 outputs (the selection tests pass q = k: the repair
// never reads Q).
struct Fp8 {
  Case c;
  Tensor q, k, v;
  DevTensor dq, dk, dv;
  PreparedDevice dev;
  openvc::PrepareParams pp;
  Fp8(const Case& cs, Tensor qq, Tensor kk, Tensor vv)
      : c(cs), q(std::move(qq)), k(std::move(kk)), v(std::move(vv)),
        dq(cs.dtype, q, strides_of(cs.layout, cs.S, cs.H, D)), dk(cs.dtype, k, strides_of(cs.layout, cs.S, cs.H, D)),
        dv(cs.dtype, v, strides_of(cs.layout, cs.S, cs.H, D)),
        dev(size_t(cs.B) * cs.S * cs.H * D, size_t(cs.B) * cs.S * cs.H * D,
            size_t(cs.B) * cs.H * D * openvc::packed_seqlen_k(cs.S), size_t(cs.B) * cs.H,
            int(openvc::num_quant_blocks(cs.S)), int(openvc::num_quant_blocks(cs.S)),
            openvc::prepare_workspace_bytes(cs.B, cs.H, cs.S, false)) {
    pp.dtype = cs.dtype;
    pp.batch = cs.B, pp.seqlen_q = pp.seqlen_k = cs.S, pp.heads = cs.H, pp.head_dim = D;
    pp.q = dq.view();
    pp.k = dk.view();
    pp.v = dv.view();
    dev.bind(pp);
  }
  bool run(cudaStream_t st) {
    return dq.buf.p && dk.buf.p && dv.buf.p && dev.allocated() && openvc::prepare_fp8(pp, st).ok();
  }
  // Repair parameters over this preparation; outputs and workspace are bound by RepairDevice.
  RepairPrepareParams params() const {
    RepairPrepareParams p;
    p.dtype = c.dtype;
    p.batch = c.B, p.seqlen_k = c.S, p.heads = c.H, p.head_dim = D;
    p.v = dv.view();
    p.k_codes = dev.k_codes.as<uint8_t>();
    p.k_descale = dev.k_descale.as<float>();
    p.v_packed = dev.v_packed.as<uint8_t>();
    p.v_descale = dev.v_descale.as<float>();
    p.budget = c.budget;
    return p;
  }
};

struct RepairHost {
  std::vector<int> tokens;
  std::vector<uint8_t> k_codes, v_packed;
  std::vector<float> k_descale;
};

struct RepairDevice {
  int G, rows;
  int64_t rpad;
  DevBuf tokens, k_codes, k_descale, v_packed, workspace;
  RepairDevice(int G_, int rows_, size_t ws)
      : G(G_), rows(rows_), rpad(openvc::repair_padded_rows(rows_)), tokens(size_t(G_) * rows_ * 4 + 4),
        k_codes(size_t(G_) * rpad * D + 16), k_descale(size_t(G_) * rpad * 4 + 4), v_packed(size_t(G_) * D * rpad + 16),
        workspace(ws) {}
  void bind(RepairPrepareParams& p) const {
    p.tokens = tokens.as<int>();
    p.repair_k_codes = k_codes.as<uint8_t>();
    p.repair_k_descale = k_descale.as<float>();
    p.repair_v_packed = v_packed.as<uint8_t>();
    p.workspace = workspace.p;
    p.workspace_bytes = workspace.bytes;
  }
  // 0xAB everywhere (workspace too); `keep_tokens` for kGivenTokens, whose tokens are an input.
  void poison(cudaStream_t st, bool keep_tokens = false) const {
    for (const DevBuf* b : {&tokens, &k_codes, &k_descale, &v_packed, &workspace})
      if (!(keep_tokens && b == &tokens)) cudaMemsetAsync(b->p, 0xAB, b->bytes, st);
  }
  RepairHost read() const {
    return {download<int>(tokens.p, size_t(G) * rows), download<uint8_t>(k_codes.p, size_t(G) * rpad * D),
            download<uint8_t>(v_packed.p, size_t(G) * D * rpad), download<float>(k_descale.p, size_t(G) * rpad)};
  }
};

// The reference's quantization of K and V, and the residual codes of any token.
struct RefPrep {
  ref::Sequences seqs;
  ref::BlockQuantized k;
  ref::HeadQuantized v;
};
RefPrep ref_prep(const Fp8& f) {
  RefPrep r{ref::Sequences::Batched(f.c.B, f.c.S, f.c.H, D), {}, {}};
  EXPECT_TRUE(ref::quantize_blocks(f.k.values.data(), r.seqs, &r.k).ok());
  EXPECT_TRUE(ref::quantize_heads(f.v.values.data(), r.seqs, &r.v).ok());
  return r;
}
// Section 6 residual codes of token j of group g, written out as the contract states them.
std::vector<uint8_t> residual_codes(const Fp8& f, const RefPrep& r, int g, int j) {
  const int b = g / f.c.H, h = g % f.c.H;
  std::vector<uint8_t> out(D);
  for (int c = 0; c < D; ++c) {
    const int64_t i = f.v.index(b, j, h, c);
    const float recon = r.v.descale[g] * ref::e4m3_decode(r.v.codes[i]);
    const float res = f.v.values[i] - recon;
    out[c] = ref::e4m3_encode(res * r.v.scale_inv[g]);
  }
  return out;
}

// The RepairInputs layout for `tokens` [G, rows] (out-of-range tokens: zero rows); codes_of(g, row)
// gives the residual codes of an in-range row.
template <typename CodesOf>
RepairHost expected_layout(const Fp8& f, const RefPrep& r, const std::vector<int>& tokens, int rows, CodesOf codes_of) {
  const int G = f.c.B * f.c.H, S = f.c.S, nk = int(openvc::num_quant_blocks(S));
  const int64_t rp = openvc::repair_padded_rows(rows);
  RepairHost e{tokens, std::vector<uint8_t>(size_t(G) * rp * D, 0), std::vector<uint8_t>(size_t(G) * D * rp, 0),
               std::vector<float>(size_t(G) * rp, 0.0f)};
  for (int g = 0; g < G; ++g) {
    const int b = g / f.c.H, h = g % f.c.H;
    for (int row = 0; row < rows; ++row) {
      const int j = tokens[size_t(g) * rows + row];
      if (j < 0 || j >= S) continue;
      std::memcpy(&e.k_codes[(g * rp + row) * D], &r.k.codes[f.k.index(b, j, h, 0)], D);
      e.k_descale[g * rp + row] = r.k.descale[size_t(g) * nk + j / 128];
      const std::vector<uint8_t> codes = codes_of(g, row, j);
      const int64_t col = row / 16 * 16 + [&] {
        for (int kappa = 0; kappa < 16; ++kappa)
          if (openvc::kPackedKeyOrder[kappa] == row % 16) return kappa;
        return -1;
      }();
      for (int c = 0; c < D; ++c) e.v_packed[(size_t(g) * D + c) * rp + col] = codes[c];
    }
  }
  return e;
}

template <typename T>
void expect_same(const char* what, const std::vector<T>& got, const std::vector<T>& want, int64_t row_bytes) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ == 0) first = int64_t(i);
  if (bad)
    ADD_FAILURE() << what << ": " << bad << " of " << got.size() << " differ; first at element " << first << " (row "
                  << first / row_bytes << "): got " << double(got[first]) << ", want " << double(want[first]);
}
void expect_rows(const RepairHost& got, const RepairHost& want, int rows, int64_t rpad, bool compare_tokens) {
  if (compare_tokens) expect_same("tokens", got.tokens, want.tokens, rows);
  expect_same("repair k_codes", got.k_codes, want.k_codes, D);
  expect_same("repair k_descale", got.k_descale, want.k_descale, rpad);
  expect_same("repair v_packed", got.v_packed, want.v_packed, rpad);
}

// The reference's repair rows of f's inputs in the RepairInputs layout.
RepairHost expected_energy(const Fp8& f, int rows) {
  const RefPrep r = ref_prep(f);
  ref::VRepair want;
  EXPECT_TRUE(ref::select_v_repair(f.v.values.data(), r.seqs, r.v, f.c.budget, &want).ok());
  EXPECT_EQ(want.tokens_per_head, rows);
  return expected_layout(f, r, want.tokens, rows, [&](int g, int row, int) {
    const uint8_t* cd = &want.codes[(size_t(want.offset[g]) + row) * D];
    return std::vector<uint8_t>(cd, cd + D);
  });
}

// Energy selection on the GPU (prepare_fp8 first) against select_v_repair.
void run_energy_case(Fp8& f, cudaStream_t st = nullptr) {
  const Case& c = f.c;
  SCOPED_TRACE(::testing::Message() << (c.dtype == DType::kBFloat16 ? "bf16" : "f16") << " B=" << c.B << " S=" << c.S
                                    << " H=" << c.H << " budget=" << c.budget);
  ASSERT_TRUE(f.run(st)) << "prepare_fp8 failed";
  int rows = -1;
  ASSERT_TRUE(openvc::repair_row_count(c.budget, c.S, &rows).ok());
  RepairDevice rd(c.B * c.H, rows, openvc::repair_workspace_bytes(c.B, c.H, c.S, rows));
  RepairPrepareParams p = f.params();
  rd.bind(p);
  rd.poison(st);
  const openvc::Status s = openvc::prepare_v_repair(p, st);
  ASSERT_TRUE(s.ok()) << s.message();
  CUDA_OK(cudaStreamSynchronize(st));
  EXPECT_EQ(openvc::repair_inputs(p).rows, rows);
  const RepairHost want = expected_energy(f, rows);
  if (rows > 0) expect_rows(rd.read(), want, rows, rd.rpad, true);
}

Fp8 random_fp8(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensor k = random_tensor(c.dtype, c.B, c.S, c.H, D, rng);
  Tensor v = random_tensor(c.dtype, c.B, c.S, c.H, D, rng);
  Tensor q = k;
  return Fp8(c, std::move(q), std::move(k), std::move(v));
}

// ---- selection and rows ------------------------------------------------------------------------

class RepairShapes : public ::testing::TestWithParam<Case> {};

TEST_P(RepairShapes, RowsByteIdenticalToReference) {
  SKIP_WITHOUT_SM90();
  const Case c = GetParam();
  Fp8 f = random_fp8(c, uint32_t(c.B * 131 + c.S * 7 + c.H + int(c.budget * 1e4)));
  run_energy_case(f);
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    // One row, partial tiles, exactly one tile, several tiles, most of the sequence; several select
    // chunks (S > 8192) per head.
    v.push_back({t, 1, 200, 1, 0.005});
    v.push_back({t, 1, 127, 2, 0.3});
    v.push_back({t, 2, 1000, 3, 0.05});
    v.push_back({t, 1, 1024, 1, 0.125});
    v.push_back({t, 1, 4097, 2, 0.08, Layout::kPadded});
    v.push_back({t, 2, 300, 2, 0.9, Layout::kPadded});
    v.push_back({t, 1, 20000, 2, 0.005});
  }
  v.push_back({DType::kBFloat16, 1, 70001, 1, 0.02});
  v.push_back({DType::kBFloat16, 1, 1, 1, 0.5});    // rows = 1 = Sk
  v.push_back({DType::kBFloat16, 1, 100, 1, 0.004});  // rows = 0: nothing to do
  return v;
}
INSTANTIATE_TEST_SUITE_P(Repair, RepairShapes, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           const Case& c = i.param;
                           return std::string(c.dtype == DType::kBFloat16 ? "bf16" : "f16") + "_B" +
                                  std::to_string(c.B) + "_S" + std::to_string(c.S) + "_H" + std::to_string(c.H) +
                                  "_rows" + std::to_string(std::llround(c.budget * c.S)) +
                                  (c.layout == Layout::kPadded ? "_strided" : "");
                         });

// Equal energies: head 0 has two thirds zero tokens (zero residual, reached by 60% rows), head 1
// duplicated rows, head 2 only exactly representable values (every residual 0); the order must still
// be (energy desc, token asc).
TEST(RepairSelect, TiesGoToTheLowerToken) {
  SKIP_WITHOUT_SM90();
  const Case c{DType::kBFloat16, 1, 9000, 3, 0.6};
  std::mt19937 rng(5);
  Tensor k = random_tensor(c.dtype, c.B, c.S, c.H, D, rng), v = random_tensor(c.dtype, c.B, c.S, c.H, D, rng);
  for (int j = 0; j < c.S; ++j)
    for (int d = 0; d < D; ++d) {
      if (j % 3 != 0) v.set(c.dtype, v.index(0, j, 0, d), 0.0f);                             // head 0: zeros
      if (j % 5 == 1) v.set(c.dtype, v.index(0, j, 1, d), v.values[v.index(0, 1, 1, d)]);   // head 1: copies
      v.set(c.dtype, v.index(0, j, 2, d), float(int(rng() % 9) - 4));                        // head 2: exact
    }
  v.set(c.dtype, v.index(0, 77, 2, 5), 448.0f);  // scale_inv = 1: small integers are exact E4M3 values
  Tensor q = k;
  Fp8 f(c, std::move(q), std::move(k), std::move(v));
  run_energy_case(f);
}

// NaN energy ranks as +inf (head 0); an infinite V makes every residual NaN (head 1).
TEST(RepairSelect, NonFiniteValues) {
  SKIP_WITHOUT_SM90();
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    const Case c{t, 1, 3000, 2, 0.01};
    std::mt19937 rng(6);
    Tensor k = random_tensor(t, 1, c.S, 2, D, rng), v = random_tensor(t, 1, c.S, 2, D, rng);
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    v.set(t, v.index(0, 2500, 0, 3), nan);
    v.set(t, v.index(0, 17, 0, 100), -nan);
    v.set(t, v.index(0, 1234, 1, 0), -inf);
    Tensor q = k;
    Fp8 f(c, std::move(q), std::move(k), std::move(v));
    run_energy_case(f);
  }
}

// Caller-given tokens (any order, duplicates, out-of-range entries -> zero rows).
TEST(RepairGiven, RowsForCallerTokens) {
  SKIP_WITHOUT_SM90();
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    const Case c{t, 2, 1500, 2, 0.0, Layout::kPadded};
    Fp8 f = random_fp8(c, 8);
    ASSERT_TRUE(f.run(nullptr));
    const int G = c.B * c.H, rows = 300;
    std::mt19937 rng(9);
    std::vector<int> tokens(size_t(G) * rows);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int(rng() % c.S);
    tokens[3] = tokens[4];
    tokens[10] = -1;
    tokens[rows + 7] = c.S;
    RepairDevice rd(G, rows, openvc::repair_workspace_bytes(c.B, c.H, c.S, rows));
    RepairPrepareParams p = f.params();
    p.selection = RepairSelection::kGivenTokens;
    p.given_rows = rows;
    rd.bind(p);
    rd.poison(nullptr, true);
    ASSERT_TRUE(upload(rd.tokens.p, tokens));
    const openvc::Status s = openvc::prepare_v_repair(p, nullptr);
    ASSERT_TRUE(s.ok()) << s.message();
    CUDA_OK(cudaDeviceSynchronize());
    const RefPrep r = ref_prep(f);
    const RepairHost e =
        expected_layout(f, r, tokens, rows, [&](int g, int, int j) { return residual_codes(f, r, g, j); });
    expect_rows(rd.read(), e, rows, rd.rpad, true);
  }
}

// prepare_fp8 + prepare_v_repair captured in one graph (global capture mode: any synchronizing call
// would break it), replayed on new inputs: equal to the reference, and to an eager call.
TEST(RepairGraph, ReplayMatchesEagerAndReference) {
  SKIP_WITHOUT_SM90();
  const Case c{DType::kBFloat16, 2, 5000, 3, 0.02, Layout::kPadded};
  Fp8 f = random_fp8(c, 31);
  const Fp8 second = random_fp8(c, 32);
  int rows = 0;
  ASSERT_TRUE(openvc::repair_row_count(c.budget, c.S, &rows).ok());
  RepairDevice rd(c.B * c.H, rows, openvc::repair_workspace_bytes(c.B, c.H, c.S, rows));
  RepairPrepareParams p = f.params();
  rd.bind(p);
  const CapturedGraph cg(cudaStreamCaptureModeGlobal, [&](cudaStream_t stream) {
    const openvc::Status s1 = openvc::prepare_fp8(f.pp, stream);
    return s1.ok() ? openvc::prepare_v_repair(p, stream) : s1;
  });
  ASSERT_TRUE(cg.status.ok()) << cg.status.message();
  CUDA_OK(cg.error);
  const cudaStream_t stream = cg.stream;

  const std::pair<DevTensor*, const DevTensor*> copies[] = {{&f.dq, &second.dq}, {&f.dk, &second.dk}, {&f.dv, &second.dv}};
  for (const auto& [dst, src] : copies)
    CUDA_OK(cudaMemcpy(dst->buf.p, src->buf.p, dst->buf.bytes, cudaMemcpyDeviceToDevice));
  f.q = second.q, f.k = second.k, f.v = second.v;
  rd.poison(stream);
  CUDA_OK(cg.launch());
  CUDA_OK(cudaStreamSynchronize(stream));
  const RepairHost replayed = rd.read();
  expect_rows(replayed, expected_energy(f, rows), rows, rd.rpad, true);

  rd.poison(stream);
  ASSERT_TRUE(openvc::prepare_fp8(f.pp, stream).ok() && openvc::prepare_v_repair(p, stream).ok());
  CUDA_OK(cudaStreamSynchronize(stream));
  const RepairHost eager = rd.read();
  EXPECT_TRUE(replayed.tokens == eager.tokens && replayed.k_codes == eager.k_codes &&
              replayed.v_packed == eager.v_packed && replayed.k_descale == eager.k_descale)
      << "graph replay differs from the eager call";
}

// ---- end to end: attention_fp8 with the GPU-prepared rows ----------------------------------------

Tensor from_values(DType t, const std::vector<float>& x, int B, int S, int H) {
  Tensor out{B, S, H, D, std::vector<uint16_t>(x.size()), std::vector<float>(x.size())};
  for (size_t i = 0; i < x.size(); ++i) out.set(t, int64_t(i), x[i]);
  return out;
}

struct AttnOut {
  std::vector<uint16_t> out;
  std::vector<float> lse;
};
// attention_fp8 on f's preparation, with the repair rows of rd (rows 0: plain).
AttnOut attend(const Fp8& f, const RepairPrepareParams* rp) {
  const Case& c = f.c;
  const size_t n = size_t(c.B) * c.S * c.H * D, nl = size_t(c.B) * c.H * c.S;
  DevBuf out(n * 2), lse(nl * 4);
  cudaMemset(out.p, 0xFF, n * 2);  // NaN poison
  cudaMemset(lse.p, 0xFF, nl * 4);
  openvc::AttentionParams p;
  p.in = {c.B, c.S, c.S, c.H, D, f.dev.q_codes.as<uint8_t>(), f.dev.q_descale.as<float>(), f.dev.k_codes.as<uint8_t>(),
          f.dev.k_descale.as<float>(), f.dev.v_packed.as<uint8_t>(), f.dev.v_descale.as<float>()};
  if (rp) p.repair = openvc::repair_inputs(*rp);
  p.out = out.p;
  p.out_stride_batch = int64_t(c.S) * c.H * D, p.out_stride_seq = int64_t(c.H) * D, p.out_stride_head = D;
  p.lse = lse.as<float>();
  const openvc::Status st = openvc::attention_fp8(p, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  cudaDeviceSynchronize();
  return {download<uint16_t>(out.p, n), download<float>(lse.p, nl)};
}

// Video-like inputs, energy selection: the output matches the reference's repaired attention within
// the kernel's tolerance (test_attention_sm90.cu), and repair lowers the error against exact attention.
TEST(RepairAttention, MatchesReferenceWithGpuPreparedRows) {
  SKIP_WITHOUT_SM90();
  for (double budget : {0.005, 0.05}) {
    const Case c{DType::kBFloat16, 1, 3000, 2, budget};
    const ref::Sequences seqs = ref::Sequences::Batched(c.B, c.S, c.H, D);
    auto qkv = ref::testing::video_like(seqs, seqs, 99);
    Fp8 f(c, from_values(c.dtype, qkv.q, c.B, c.S, c.H), from_values(c.dtype, qkv.k, c.B, c.S, c.H),
          from_values(c.dtype, qkv.v, c.B, c.S, c.H));
    ASSERT_TRUE(f.run(nullptr));
    int rows = 0;
    ASSERT_TRUE(openvc::repair_row_count(budget, c.S, &rows).ok());
    RepairDevice rd(c.B * c.H, rows, openvc::repair_workspace_bytes(c.B, c.H, c.S, rows));
    RepairPrepareParams p = f.params();
    rd.bind(p);
    rd.poison(nullptr);
    ASSERT_TRUE(openvc::prepare_v_repair(p, nullptr).ok());
    const AttnOut got = attend(f, &p);

    ref::PreparedInputs prep;
    ASSERT_TRUE(ref::prepare_inputs(qkv.q.data(), qkv.k.data(), qkv.v.data(), seqs, seqs, &prep).ok());
    ref::VRepair vrep;
    ASSERT_TRUE(ref::select_v_repair(qkv.v.data(), seqs, prep.v, budget, &vrep).ok());
    ref::AttentionResult want, want_plain;
    ASSERT_TRUE(ref::attention_expcast(prep, {}, &want_plain).ok());
    prep.repair = &vrep;
    ASSERT_TRUE(ref::attention_expcast(prep, {}, &want).ok());
    std::vector<double> exact;
    ASSERT_TRUE(ref::attention_exact(qkv.q.data(), qkv.k.data(), qkv.v.data(), seqs, seqs, 0.0f, false, &exact).ok());

    std::vector<float> out(got.out.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = openvc::testing::bf16_to_float(got.out[i]);
    const std::vector<double> want_d(want.out.begin(), want.out.end());
    double ref_max = 0;
    for (double x : want_d) ref_max = std::max(ref_max, std::fabs(x));
    const ref::ErrorMetrics e = ref::compare(out.data(), want_d.data(), int64_t(out.size()));
    EXPECT_LE(e.rel_l2, 5e-3) << "budget " << budget;
    EXPECT_LE(e.max_abs, 0.04 * ref_max + 1e-3) << "budget " << budget;
    double lse_max = 0;
    for (size_t i = 0; i < got.lse.size(); ++i) lse_max = std::max(lse_max, double(std::fabs(got.lse[i] - want.lse[i])));
    EXPECT_LE(lse_max, 0.03);
    const double kernel = ref::compare(out.data(), exact.data(), int64_t(out.size())).rel_l2;
    const double reference = ref::compare(want.out.data(), exact.data(), int64_t(out.size())).rel_l2;
    const double plain = ref::compare(want_plain.out.data(), exact.data(), int64_t(out.size())).rel_l2;
    // Repair lowers the reference's error; the kernel is held to the reference above (its own FP8
    // accumulator noise is of the size of the repair gain at these lengths).
    EXPECT_LT(reference, plain);
    std::printf("  budget %.3f (%d rows): vs reference %.2e; vs exact: plain %.4f, repaired reference %.4f, kernel %.4f\n",
                budget, rows, e.rel_l2, plain, reference, kernel);
  }
}

// Repairing tokens whose residual is zero changes nothing, bit for bit: given tokens of head 0, whose
// V holds only exact E4M3 values (every residual 0), and of head 1's all-zero V rows.
TEST(RepairAttention, ZeroResidualRepairChangesNothing) {
  SKIP_WITHOUT_SM90();
  const Case c{DType::kBFloat16, 1, 1500, 2, 0.1};
  const ref::Sequences seqs = ref::Sequences::Batched(c.B, c.S, c.H, D);
  auto qkv = ref::testing::video_like(seqs, seqs, 7);
  std::mt19937 rng(3);
  for (int j = 0; j < c.S; ++j)
    for (int d = 0; d < D; ++d) {
      qkv.v[(size_t(j) * c.H + 0) * D + d] = float(int(rng() % 17) - 8);              // head 0: integers
      if (j % 4 == 0) qkv.v[(size_t(j) * c.H + 1) * D + d] = 0.0f;                      // head 1: zero rows
    }
  qkv.v[size_t(5) * c.H * D + 9] = 448.0f;  // head 0's scale_inv = 1: the integers are exact
  Fp8 f(c, from_values(c.dtype, qkv.q, 1, c.S, c.H), from_values(c.dtype, qkv.k, 1, c.S, c.H),
        from_values(c.dtype, qkv.v, 1, c.S, c.H));
  ASSERT_TRUE(f.run(nullptr));
  const AttnOut plain = attend(f, nullptr);

  int rows = 0;
  ASSERT_TRUE(openvc::repair_row_count(c.budget, c.S, &rows).ok());
  RepairDevice rd(c.H, rows, openvc::repair_workspace_bytes(1, c.H, c.S, rows));
  RepairPrepareParams p = f.params();
  p.selection = RepairSelection::kGivenTokens;
  p.given_rows = rows;
  rd.bind(p);
  std::vector<int> tokens(size_t(c.H) * rows);
  for (int r = 0; r < rows; ++r) tokens[r] = (r * 7) % c.S, tokens[rows + r] = 4 * r;  // head 1: the zero rows
  ASSERT_TRUE(upload(rd.tokens.p, tokens));
  ASSERT_TRUE(openvc::prepare_v_repair(p, nullptr).ok());
  const std::vector<uint8_t> vp = download<uint8_t>(rd.v_packed.p, rd.v_packed.bytes);
  for (size_t i = 0; i < size_t(c.H) * D * rd.rpad; ++i) ASSERT_EQ(vp[i], 0) << "residual code " << i;
  const AttnOut repaired = attend(f, &p);
  EXPECT_EQ(plain.out, repaired.out);
  EXPECT_EQ(plain.lse, repaired.lse);
}

// ---- argument checks (no device needed: they fail before any CUDA call) -------------------------

RepairPrepareParams valid_params() {
  auto fake = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  RepairPrepareParams p;
  p.batch = 1, p.seqlen_k = 1000, p.heads = 2, p.head_dim = 128;
  p.v = {fake(0x10000), 1000 * 2 * 128, 2 * 128, 128};
  p.k_codes = static_cast<const uint8_t*>(fake(0x20000));
  p.k_descale = static_cast<const float*>(fake(0x30000));
  p.v_packed = static_cast<const uint8_t*>(fake(0x40000));
  p.v_descale = static_cast<const float*>(fake(0x50000));
  p.budget = 0.05;
  p.tokens = static_cast<int*>(fake(0x60000));
  p.repair_k_codes = static_cast<uint8_t*>(fake(0x70000));
  p.repair_k_descale = static_cast<float*>(fake(0x80000));
  p.repair_v_packed = static_cast<uint8_t*>(fake(0x90000));
  p.workspace = fake(0xA0000);
  p.workspace_bytes = size_t(1) << 40;
  return p;
}

void expect_rejected(const RepairPrepareParams& p, openvc::StatusCode code, const std::string& name) {
  const openvc::Status st = openvc::prepare_v_repair(p, nullptr);
  EXPECT_EQ(int(st.code()), int(code)) << st.message();
  EXPECT_NE(st.message().find(name), std::string::npos) << "message should name " << name << ": " << st.message();
}

TEST(RepairArgs, RejectsBadBudgetByName) {
  for (double b : {-0.01, 1.0, 1.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    RepairPrepareParams p = valid_params();
    p.budget = b;
    expect_rejected(p, openvc::StatusCode::kInvalidArgument, "budget");
    int rows = 0;
    const openvc::Status st = openvc::repair_row_count(b, 1000, &rows);
    EXPECT_EQ(int(st.code()), int(openvc::StatusCode::kInvalidArgument));
    EXPECT_NE(st.message().find("budget"), std::string::npos) << st.message();
  }
}

TEST(RepairArgs, RejectsBadParameters) {
  using openvc::StatusCode;
  RepairPrepareParams p = valid_params();
  p.cu_seqlens_k = reinterpret_cast<const int*>(0x1000);
  expect_rejected(p, StatusCode::kInvalidArgument, "cu_seqlens_k");
  p = valid_params();
  p.head_dim = 64;
  expect_rejected(p, StatusCode::kUnsupported, "head_dim");
  p = valid_params();
  p.heads = 0;
  expect_rejected(p, StatusCode::kInvalidArgument, "heads");
  p = valid_params();
  p.v.data = reinterpret_cast<const void*>(0x10008);
  expect_rejected(p, StatusCode::kInvalidArgument, "v.data");
  p = valid_params();
  p.v.stride_seq = 2 * 128 + 4;
  expect_rejected(p, StatusCode::kInvalidArgument, "v.stride_seq");
  p = valid_params();
  p.tokens = nullptr;
  expect_rejected(p, StatusCode::kInvalidArgument, "tokens");
  p = valid_params();
  p.repair_v_packed = reinterpret_cast<uint8_t*>(0x90004);
  expect_rejected(p, StatusCode::kInvalidArgument, "repair_v_packed");
  p = valid_params();
  p.v_descale = nullptr;
  expect_rejected(p, StatusCode::kInvalidArgument, "v_descale");
  p = valid_params();
  p.selection = RepairSelection::kGivenTokens;
  p.given_rows = -1;
  expect_rejected(p, StatusCode::kInvalidArgument, "given_rows");
  p = valid_params();
  p.dtype = static_cast<DType>(7);
  expect_rejected(p, StatusCode::kInvalidArgument, "dtype");
}

TEST(RepairArgs, ZeroRowsIsThePlainPathAndTouchesNothing) {
  RepairPrepareParams p;  // every pointer null
  p.batch = 1, p.seqlen_k = 100, p.heads = 1;
  p.budget = 0.004;       // 0.4 rows -> 0
  EXPECT_TRUE(openvc::prepare_v_repair(p, nullptr).ok());
  EXPECT_EQ(openvc::repair_inputs(p).rows, 0);
  p.budget = 0.0;
  EXPECT_TRUE(openvc::prepare_v_repair(p, nullptr).ok());
}

TEST(RepairArgs, RowCountRoundsHalfAwayFromZero) {
  const struct { double budget; int64_t s; int rows; } cases[] = {
      {0.005, 73397, 367}, {0.5, 1, 1}, {0.25, 2, 1}, {0.25, 6, 2}, {0.0, 5, 0}, {0.004, 100, 0}, {0.999, 10, 10}};
  for (const auto& c : cases) {
    int rows = -1;
    ASSERT_TRUE(openvc::repair_row_count(c.budget, c.s, &rows).ok());
    EXPECT_EQ(rows, c.rows) << c.budget << " * " << c.s;
  }
  EXPECT_EQ(openvc::repair_workspace_bytes(0, 1, 10, 1), 0u);
  EXPECT_GT(openvc::repair_workspace_bytes(1, 2, 10, 20), 0u);  // given tokens past Sk: block maxima only
}

TEST(RepairArgs, WorkspaceTooSmallIsRejected) {
  SKIP_WITHOUT_SM90();  // the size includes CUB's temp storage, a query that needs a device
  RepairPrepareParams p = valid_params();
  const size_t need = openvc::repair_workspace_bytes(1, 2, 1000, 50);
  ASSERT_GT(need, 0u);
  p.workspace_bytes = need - 1;
  expect_rejected(p, openvc::StatusCode::kInvalidArgument, "workspace_bytes");
}

}  // namespace
