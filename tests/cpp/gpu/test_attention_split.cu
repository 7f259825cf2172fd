// Split tiles (kSplitTilesMode; numerics section 5, "Split tiles"): the persistent CTAs take contiguous ranges of the
// launch's key blocks and a cut tile's two parts are folded through the workspace. Against the CPU reference on the
// same codes and the same plan (reference::AttentionOptions::split_ctas), on small grids that cut many tiles (the
// few-keys and plain fused-Q modes, mid-window and natural order); the same bits on a second launch over the same
// workspace (the counts reset themselves) and, for tiles no boundary cuts, the bits of whole tiles; and the one-call
// path with TileSplit::kOn on the device's own grid, eager and replayed from a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/sm90/launch.h"
#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "openvc/attention.h"
#include "openvc/call.h"
#include "openvc/reference.h"
#include "reference/test_inputs.h"

namespace {

namespace ref = openvc::reference;
using openvc::testing::bf16_to_float;
using openvc::testing::CapturedGraph;
using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::pack_v;
using openvc::testing::upload;

struct SplitCase {
  const char* name;
  int b, sq, sk, h;
  int grid;                 // CTAs of the split launch
  int mid_window = 4;       // ref::kNaturalOrder: natural order
  bool video = false;       // video-like inputs, else normal
};

// Float inputs (BF16 values) of a case and the reference's prepared codes.
struct HostInputs {
  ref::Sequences qs, ks;
  std::vector<float> q, k, v;
  ref::PreparedInputs prep;
  std::vector<__nv_bfloat16> q16;
  std::vector<uint8_t> v_packed;
  explicit HostInputs(const SplitCase& c)
      : qs(ref::Sequences::Batched(c.b, c.sq, c.h, 128)), ks(ref::Sequences::Batched(c.b, c.sk, c.h, 128)) {
    if (c.video) {
      auto x = ref::testing::video_like(qs, ks, 5 + c.sq);
      q = std::move(x.q), k = std::move(x.k), v = std::move(x.v);
    } else {
      std::mt19937 rng(91 + c.sq + c.sk);
      std::normal_distribution<float> g(0.0f, 1.0f);
      auto fill = [&](size_t n) {
        std::vector<float> x(n);
        for (float& e : x) e = ref::round_to_bf16(g(rng));
        return x;
      };
      q = fill(size_t(qs.total_tokens()) * c.h * 128);
      k = fill(size_t(ks.total_tokens()) * c.h * 128);
      v = fill(size_t(ks.total_tokens()) * c.h * 128);
    }
    EXPECT_TRUE(ref::prepare_inputs(q.data(), k.data(), v.data(), qs, ks, &prep).ok());
    q16.resize(q.size());
    for (size_t i = 0; i < q.size(); ++i) q16[i] = __float2bfloat16(q[i]);
    v_packed = pack_v(prep.v.codes, ks, int(openvc::num_quant_blocks(c.sk)));
  }
};

// The device copies the fused-Q kernel reads: Q as BF16 rows, K and V as the reference's codes (V packed).
struct Inputs : HostInputs {
  DevBuf dq16, dk, dks, dv, dvs;
  explicit Inputs(const SplitCase& c)
      : HostInputs(c), dq16(q16.size() * 2), dk(prep.k.codes.size()), dks(prep.k.descale.size() * 4),
        dv(v_packed.size()), dvs(prep.v.descale.size() * 4) {
    EXPECT_TRUE(upload(dq16.p, q16) && upload(dk.p, prep.k.codes) && upload(dks.p, prep.k.descale) &&
                upload(dv.p, v_packed) && upload(dvs.p, prep.v.descale));
  }
};

openvc::AttentionParams fused_q_params(const SplitCase& c, const Inputs& in) {
  openvc::AttentionParams ap;
  ap.in = {c.b, c.sq, c.sk, c.h, 128, nullptr, nullptr, in.dk.as<uint8_t>(), in.dks.as<float>(),
           in.dv.as<uint8_t>(), in.dvs.as<float>()};
  ap.q_unquantized = {in.dq16.p, int64_t(c.sq) * c.h * 128, int64_t(c.h) * 128, 128};
  ap.q_unquantized_dtype = openvc::DType::kBFloat16;
  ap.out_stride_batch = int64_t(c.sq) * c.h * 128, ap.out_stride_seq = int64_t(c.h) * 128, ap.out_stride_head = 128;
  ap.mid_window_blocks = c.mid_window;
  return ap;
}

// The case on `grid` CTAs, split over `ws` (null: whole tiles), into poisoned outputs.
void launch(const SplitCase& c, const Inputs& in, int grid, void* ws, size_t ws_bytes, std::vector<uint16_t>* out,
            std::vector<float>* lse) {
  const size_t nout = size_t(c.b) * c.sq * c.h * 128, nlse = size_t(c.b) * c.h * c.sq;
  DevBuf o(nout * 2), l(nlse * 4);
  CUDA_OK(cudaMemset(o.p, 0xFF, o.bytes));
  CUDA_OK(cudaMemset(l.p, 0xFF, l.bytes));
  openvc::AttentionParams ap = fused_q_params(c, in);
  ap.out = o.p, ap.lse = l.as<float>();
  openvc::sm90::LaunchPlan plan;
  const openvc::Status sp = openvc::sm90::plan_attention(ap, nullptr, &plan);
  ASSERT_TRUE(sp.ok()) << sp.message();
  plan.grid = grid;
  if (ws != nullptr) {
    ASSERT_TRUE(openvc::sm90::split_tiles_eligible(plan));
    const openvc::Status su = openvc::sm90::use_split_tiles(&plan, ws, ws_bytes);
    ASSERT_TRUE(su.ok()) << su.message();
  }
  const openvc::Status sl = openvc::sm90::launch_plan(plan, nullptr);
  ASSERT_TRUE(sl.ok()) << sl.message();
  CUDA_OK(cudaDeviceSynchronize());
  *out = download<uint16_t>(o.p, nout);
  *lse = download<float>(l.p, nlse);
}

// A split workspace for `grid` CTAs: its arrival counts zeroed (the one-call path's preparation does it there), its
// partials NaN (every one read must have been written).
struct SplitWorkspace {
  DevBuf buf;
  bool ok;
  explicit SplitWorkspace(int grid)
      : buf(openvc::sm90::split_tiles_workspace_bytes(grid)),
        ok(buf.p != nullptr && cudaMemset(buf.p, 0xFF, buf.bytes) == cudaSuccess &&
           cudaMemset(buf.p, 0, size_t(openvc::sm90::split_tiles_arrival_words(grid)) * 4) == cudaSuccess) {}
};

// The tiles (b, h, qt) of a batched case that the plan on `grid` CTAs cuts (reference::split_cuts).
std::vector<bool> cut_tiles(const SplitCase& c, int grid) {
  const int nq = int(openvc::num_quant_blocks(c.sq)), n = int(openvc::num_quant_blocks(c.sk));
  const int64_t tiles = int64_t(c.b) * c.h * nq;
  std::vector<bool> cut(size_t(tiles), false);
  for (int64_t t = 0; t < tiles; ++t) cut[size_t(t)] = !ref::split_cuts(t, n, tiles, grid).empty();
  return cut;
}
// Whether output row i of (b, h) belongs to a tile the plan cuts.
bool in_cut_tile(const SplitCase& c, const std::vector<bool>& cut, int b, int h, int i) {
  const int nq = int(openvc::num_quant_blocks(c.sq));
  return cut[size_t((int64_t(b) * c.h + h) * nq + i / 128)];
}

// Output and LSE against the reference's, with the sm_90 suite's tolerances (test_attention_sm90.cu explains them),
// over every row and again over the rows of cut tiles alone (a fold error would be diluted by the others).
void expect_matches(const SplitCase& c, const std::vector<bool>& cut, const std::vector<uint16_t>& out,
                    const std::vector<float>& lse, const ref::AttentionResult& want) {
  ASSERT_EQ(out.size(), want.out.size());
  ASSERT_EQ(lse.size(), want.lse.size());
  std::vector<float> got(out.size()), got_cut;
  std::vector<double> want_d(want.out.begin(), want.out.end()), want_cut;
  int64_t non_finite = 0;
  for (size_t i = 0; i < out.size(); ++i) got[i] = bf16_to_float(out[i]), non_finite += !std::isfinite(got[i]);
  ASSERT_EQ(non_finite, 0) << "output elements left unwritten or NaN";
  for (int b = 0; b < c.b; ++b)
    for (int i = 0; i < c.sq; ++i)
      for (int h = 0; h < c.h; ++h)
        if (in_cut_tile(c, cut, b, h, i)) {
          const size_t o = ((size_t(b) * c.sq + i) * c.h + h) * 128;
          got_cut.insert(got_cut.end(), got.begin() + o, got.begin() + o + 128);
          want_cut.insert(want_cut.end(), want_d.begin() + o, want_d.begin() + o + 128);
        }
  ASSERT_FALSE(got_cut.empty());
  for (const auto& [g, w] : {std::pair{&got, &want_d}, std::pair{&got_cut, &want_cut}}) {
    const ref::ErrorMetrics e = ref::compare(g->data(), w->data(), int64_t(g->size()));
    double ref_max = 0;
    for (double x : *w) ref_max = std::max(ref_max, std::fabs(x));
    EXPECT_LE(e.rel_l2, c.video ? 5e-3 : 7.5e-3) << (g == &got ? "every row" : "rows of cut tiles");
    EXPECT_LE(e.max_abs, 0.04 * ref_max + 1e-3) << (g == &got ? "every row" : "rows of cut tiles");
  }
  double lse_err = 0;
  for (size_t i = 0; i < lse.size(); ++i) lse_err = std::max(lse_err, double(std::fabs(lse[i] - want.lse[i])));
  EXPECT_LE(lse_err, 0.03);
}

TEST(Sm90Split, MatchesTheReferenceOnItsPlan) {
  SKIP_WITHOUT_SM90();
  const SplitCase cases[] = {
      {"few keys fused Q (8 blocks), 7 CTAs", 2, 1000, 1000, 3, 7},
      {"few keys fused Q, 5 CTAs, natural order", 2, 1000, 1000, 3, 5, ref::kNaturalOrder},
      {"few keys fused Q, video-like, 11 CTAs", 2, 1000, 1000, 3, 11, 4, true},
      {"plain fused Q (33 blocks), 7 CTAs", 2, 1000, 4200, 2, 7},
  };
  for (const SplitCase& c : cases) {
    SCOPED_TRACE(c.name);
    const Inputs in(c);
    ref::AttentionOptions opt;
    opt.mid_window_blocks = c.mid_window;
    opt.split_ctas = c.grid;
    ref::AttentionResult want;
    ASSERT_TRUE(ref::attention_expcast(in.prep, opt, &want).ok());
    // The plan cuts tiles here (else the case tests nothing new).
    const std::vector<bool> cut = cut_tiles(c, c.grid);
    ASSERT_GT(std::count(cut.begin(), cut.end(), true), 0);
    SplitWorkspace ws(c.grid);
    ASSERT_TRUE(ws.ok);
    std::vector<uint16_t> out;
    std::vector<float> lse;
    ASSERT_NO_FATAL_FAILURE(launch(c, in, c.grid, ws.buf.p, ws.buf.bytes, &out, &lse));
    ASSERT_NO_FATAL_FAILURE(expect_matches(c, cut, out, lse, want));
  }
}

// Rows of tiles no boundary cuts: the bits of whole tiles; rows of cut tiles: some differ (the split ran).
void expect_whole_where_uncut(const SplitCase& c, const std::vector<bool>& cut, const std::vector<uint16_t>& split,
                              const std::vector<float>& lse_split, const std::vector<uint16_t>& whole,
                              const std::vector<float>& lse_whole) {
  int uncut_rows = 0, cut_rows_differing = 0;
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.h; ++h)
      for (int i = 0; i < c.sq; ++i) {
        const size_t o = ((size_t(b) * c.sq + i) * c.h + h) * 128, l = (size_t(b) * c.h + h) * c.sq + i;
        const bool same = std::memcmp(&split[o], &whole[o], 128 * 2) == 0 && lse_split[l] == lse_whole[l];
        if (in_cut_tile(c, cut, b, h, i)) {
          cut_rows_differing += !same;
        } else {
          ++uncut_rows;
          ASSERT_TRUE(same) << b << " " << h << " " << i;
        }
      }
  EXPECT_GT(uncut_rows, 0);
  EXPECT_GT(cut_rows_differing, 0);
}

TEST(Sm90Split, SameBitsEveryLaunchAndWholeTilesWhereNoBoundaryCuts) {
  SKIP_WITHOUT_SM90();
  for (const SplitCase& c : {SplitCase{"few keys", 2, 1000, 1000, 3, 7}, SplitCase{"plain", 2, 1000, 4200, 2, 7}}) {
    SCOPED_TRACE(c.name);
    const Inputs in(c);
    SplitWorkspace ws(c.grid);
    ASSERT_TRUE(ws.ok);
    std::vector<uint16_t> first, again, whole;
    std::vector<float> lse_first, lse_again, lse_whole;
    ASSERT_NO_FATAL_FAILURE(launch(c, in, c.grid, ws.buf.p, ws.buf.bytes, &first, &lse_first));
    // The same workspace, not zeroed again: the parts that folded reset their counts.
    ASSERT_NO_FATAL_FAILURE(launch(c, in, c.grid, ws.buf.p, ws.buf.bytes, &again, &lse_again));
    EXPECT_EQ(first, again);
    EXPECT_EQ(lse_first, lse_again);
    const std::vector<int> counts = download<int>(ws.buf.p, size_t(openvc::sm90::split_tiles_arrival_words(c.grid)));
    EXPECT_EQ(counts, std::vector<int>(counts.size(), 0));
    ASSERT_NO_FATAL_FAILURE(launch(c, in, c.grid, nullptr, 0, &whole, &lse_whole));
    ASSERT_NO_FATAL_FAILURE(expect_whole_where_uncut(c, cut_tiles(c, c.grid), first, lse_first, whole, lse_whole));
  }
}

// The one-call path (call.h, TileSplit::kOn) on the device's own grid: 9 heads of 2,048 tokens are 144 tiles of 16
// key blocks, so every range holds at least a tile on up to 144 SMs.
TEST(Sm90Split, OneCallOnRequestEagerAndReplayed) {
  SKIP_WITHOUT_SM90();
  int device = 0, sms = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The plan's grid: min(tiles, SMs) (launch.cu).
  const SplitCase c{"one call", 1, 2048, 2048, 9, std::min(sms, 9 * 16)};
  const std::vector<bool> cut = cut_tiles(c, c.grid);
  if (std::count(cut.begin(), cut.end(), true) == 0) GTEST_SKIP() << "no tile cut on " << sms << " SMs";
  const Inputs in(c);
  const size_t nout = size_t(c.sq) * c.h * 128, nlse = size_t(c.h) * c.sq;
  DevBuf k16(nout * 2), v16(nout * 2), out(nout * 2), lse(nlse * 4);
  std::vector<__nv_bfloat16> hk(in.k.size()), hv(in.v.size());
  for (size_t i = 0; i < hk.size(); ++i) hk[i] = __float2bfloat16(in.k[i]), hv[i] = __float2bfloat16(in.v[i]);
  ASSERT_TRUE(upload(k16.p, hk) && upload(v16.p, hv));
  openvc::AttentionCall a;
  a.heads = c.h, a.head_dim = 128, a.batch = 1, a.seqlen_q = c.sq, a.seqlen_k = c.sk;
  const openvc::TokenTensorView rows_q{in.dq16.p, int64_t(c.sq) * c.h * 128, int64_t(c.h) * 128, 128};
  a.q = rows_q, a.k = {k16.p, rows_q.stride_batch, rows_q.stride_seq, 128}, a.v = {v16.p, rows_q.stride_batch, rows_q.stride_seq, 128};
  a.out = out.p, a.out_stride_batch = rows_q.stride_batch, a.out_stride_seq = rows_q.stride_seq, a.out_stride_head = 128;
  a.lse = lse.as<float>();
  a.tile_split = openvc::TileSplit::kOn;
  DevBuf ws(openvc::attention_workspace_bytes(a));
  openvc::AttentionCall off = a;
  off.tile_split = openvc::TileSplit::kOff;
  EXPECT_GE(ws.bytes, openvc::attention_workspace_bytes(off) + openvc::sm90::split_tiles_workspace_bytes(sms));
  // A workspace's contents are anything (here -1 counts and NaN partials): the preparation zeroes the counts.
  CUDA_OK(cudaMemset(ws.p, 0xFF, ws.bytes));

  ref::AttentionOptions opt;
  opt.split_ctas = c.grid;
  ref::AttentionResult want;
  ASSERT_TRUE(ref::attention_expcast(in.prep, opt, &want).ok());
  CUDA_OK(cudaMemset(out.p, 0xFF, out.bytes));
  const openvc::Status st = openvc::attention(a, ws.p, ws.bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> eager = download<uint16_t>(out.p, nout);
  const std::vector<float> eager_lse = download<float>(lse.p, nlse);
  ASSERT_NO_FATAL_FAILURE(expect_matches(c, cut, eager, eager_lse, want));
  // kOff on the same inputs: whole tiles, so the split ran where the bits differ.
  const openvc::Status so = openvc::attention(off, ws.p, ws.bytes, nullptr);
  ASSERT_TRUE(so.ok()) << so.message();
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_NO_FATAL_FAILURE(expect_whole_where_uncut(c, cut, eager, eager_lse, download<uint16_t>(out.p, nout),
                                                   download<float>(lse.p, nlse)));

  const CapturedGraph cg(cudaStreamCaptureModeGlobal,
                         [&](cudaStream_t s) { return openvc::attention(a, ws.p, ws.bytes, s); });
  ASSERT_TRUE(cg.status.ok()) << cg.status.message();
  CUDA_OK(cg.error);
  for (int replay = 0; replay < 2; ++replay) {
    CUDA_OK(cudaMemset(out.p, 0xFF, out.bytes));
    CUDA_OK(cg.launch());
    CUDA_OK(cudaStreamSynchronize(cg.stream));
    EXPECT_EQ(download<uint16_t>(out.p, nout), eager) << "replay " << replay;
    EXPECT_EQ(download<float>(lse.p, nlse), eager_lse) << "replay " << replay;
  }
}

}  // namespace
