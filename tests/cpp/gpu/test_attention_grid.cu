// The persistent grid does not change a tile's arithmetic: each call class gives the same output and LSE bits on
// the grid the host picks (one tile per CTA at these sizes) and on grids of 1, 2 and 7 CTAs, where every CTA runs
// tile after tile, reusing its K/V ring, barrier phases and Q buffers. Plain, causal, few keys, head dim 64, Q
// quantized in the kernel (the plain fused-Q mode above kFewKeyBlocksFusedQ key blocks, the few-keys one below),
// packed sequences, key counts, INT8 Q/K and the exp2 P format. causal_snake stays as planned for the host's grid
// (next_tile deals its rounds by gridDim).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "attention/sm90/launch.h"
#include "gpu/prepare_test_util.h"
#include "openvc/attention.h"

namespace {

using openvc::testing::DevBuf;
using openvc::testing::DevTensor;
using openvc::testing::download;
using openvc::testing::PreparedDevice;
using openvc::testing::random_tensor;
using openvc::testing::upload;

struct GridCase {
  const char* name;
  int b, sq, sk, h, d;
  bool causal = false;
  bool fused_q = false;        // q_unquantized (kFusedQMode)
  bool packed = false;         // the batch as packed sequences (cu_seqlens {0, Sq, .., B Sq})
  bool key_counts = false;     // seqused_k: entry i keeps Sk - 100 (i + 1) keys
  bool int8 = false;           // qk_format kInt8
  bool exp2 = false;           // p_format kExp2 (with int8)
};


// Runs the plan on `grid` CTAs (0: the host's choice) into poisoned outputs; returns output and LSE bits.
void run_on_grid(const openvc::AttentionParams& ap, int grid, size_t nout, size_t nlse, std::vector<uint16_t>* out,
                 std::vector<uint32_t>* lse) {
  DevBuf o(nout * 2), l(nlse * 4);
  CUDA_OK(cudaMemset(o.p, 0xFF, o.bytes));
  CUDA_OK(cudaMemset(l.p, 0xFF, l.bytes));
  openvc::AttentionParams a = ap;
  a.out = o.p, a.lse = l.as<float>();
  openvc::sm90::LaunchPlan plan;
  const openvc::Status sp = openvc::sm90::plan_attention(a, nullptr, &plan);
  ASSERT_TRUE(sp.ok()) << sp.message();
  ASSERT_GT(plan.grid, 7);
  if (grid > 0) plan.grid = grid;
  const openvc::Status sl = openvc::sm90::launch_plan(plan, nullptr);
  ASSERT_TRUE(sl.ok()) << sl.message();
  CUDA_OK(cudaDeviceSynchronize());
  *out = download<uint16_t>(o.p, nout);
  *lse = download<uint32_t>(l.p, nlse);
}

void run_grid_case(const GridCase& c) {
  SCOPED_TRACE(c.name);
  constexpr openvc::DType kBf16 = openvc::DType::kBFloat16;
  const size_t nq = size_t(c.b) * c.sq * c.h * c.d, nkv = size_t(c.b) * c.sk * c.h * c.d;
  std::mt19937 rng(21 + c.d);
  auto device_input = [&](int s) {   // [B, s, H, D] BF16, contiguous
    return DevTensor(kBf16, random_tensor(kBf16, c.b, s, c.h, c.d, rng),
                     strides_of(openvc::testing::Layout::kContiguous, s, c.h, c.d));
  };
  const DevTensor q = device_input(c.sq), k = device_input(c.sk), v = device_input(c.sk);
  const int64_t bh = int64_t(c.b) * c.h;
  // INT8: Q descales per row, K descales per key group (numerics section 9).
  const int nbq = int(openvc::num_quant_blocks(c.sq)), nbk = int(openvc::num_quant_blocks(c.sk));
  const PreparedDevice prep(nq, nkv, bh * c.d * openvc::packed_seqlen_k(c.sk), bh, c.int8 ? c.sq : nbq,
                            c.int8 ? nbk * openvc::kInt8KeyGroups : nbk,
                            openvc::prepare_workspace_bytes(c.b, c.h, c.sk, false));
  openvc::PrepareParams pp;
  pp.dtype = kBf16, pp.heads = c.h, pp.head_dim = c.d, pp.batch = c.b, pp.seqlen_q = c.sq, pp.seqlen_k = c.sk;
  pp.q = q.view(), pp.k = k.view(), pp.v = v.view();
  prep.bind(pp);
  if (c.int8) pp.qk_format = openvc::QkFormat::kInt8;
  std::vector<int> offsets(c.b + 1), counts(c.b);
  for (int i = 0; i <= c.b; ++i) offsets[i] = i * c.sq;
  for (int i = 0; i < c.b; ++i) counts[i] = c.sk - 100 * (i + 1);
  DevBuf cu(offsets.size() * 4), used(counts.size() * 4);
  ASSERT_TRUE(upload(cu.p, offsets) && upload(used.p, counts));
  if (c.key_counts) pp.seqused_k = used.as<int>();   // prepared with the counts the call uses (attention.h)
  const openvc::Status sp = openvc::prepare_fp8(pp, nullptr);
  ASSERT_TRUE(sp.ok()) << sp.message();

  openvc::AttentionParams ap;
  ap.in = {c.b, c.sq, c.sk, c.h, c.d, pp.q_codes, pp.q_descale, pp.k_codes, pp.k_descale, pp.v_packed, pp.v_descale};
  if (c.int8) ap.in.qk_format = openvc::QkFormat::kInt8;
  if (c.exp2) ap.p_format = openvc::PFormat::kExp2;
  ap.out_stride_batch = int64_t(c.sq) * c.h * c.d, ap.out_stride_seq = int64_t(c.h) * c.d, ap.out_stride_head = c.d;
  ap.causal = c.causal;
  if (c.fused_q) {
    ap.in.q_codes = nullptr, ap.in.q_descale = nullptr;
    ap.q_unquantized = pp.q, ap.q_unquantized_dtype = kBf16;
  }
  if (c.packed) {   // Sq = Sk: the batched preparation's codes are the packed layout's
    ap.cu_seqlens_q = ap.cu_seqlens_k = cu.as<int>(), ap.num_seqs = c.b;
    ap.max_seqlen_q = ap.max_seqlen_k = c.sq, ap.total_q = ap.total_k = int64_t(c.b) * c.sq;
  }
  if (c.key_counts) ap.seqused_k = used.as<int>();
  // packed: out [total_q, H, D] and lse [H, total_q] are the batched sizes
  const size_t nlse = size_t(bh) * c.sq;
  std::vector<uint16_t> out0, out;
  std::vector<uint32_t> lse0, lse;
  ASSERT_NO_FATAL_FAILURE(run_on_grid(ap, 0, nq, nlse, &out0, &lse0));
  for (int grid : {1, 2, 7}) {
    SCOPED_TRACE("grid " + std::to_string(grid));
    ASSERT_NO_FATAL_FAILURE(run_on_grid(ap, grid, nq, nlse, &out, &lse));
    EXPECT_EQ(out, out0);
    EXPECT_EQ(lse, lse0);
  }
}

TEST(Sm90Grid, SameBitsOnAnyGrid) {
  SKIP_WITHOUT_SM90();
  const GridCase cases[] = {
      {"plain", 2, 700, 900, 3, 128},
      {"plain fused Q", 2, 700, 4200, 3, 128, false, true},   // 33 key blocks: above kFewKeyBlocksFusedQ
      {"few keys fused Q, 8 blocks", 2, 700, 900, 3, 128, false, true},
      {"few keys", 2, 700, 300, 3, 128},
      {"few keys fused Q", 2, 700, 300, 3, 128, false, true},
      {"causal", 1, 1000, 1000, 4, 128, true},
      {"causal fused Q", 1, 1000, 1000, 4, 128, true, true},
      {"head dim 64", 2, 600, 800, 3, 64},
      {"head dim 64 causal fused Q", 1, 1000, 1000, 4, 64, true, true},
      {"packed", 3, 500, 500, 3, 128, false, false, true},
      {"packed causal fused Q", 3, 500, 500, 3, 128, true, true, true},
      {"key counts", 3, 500, 700, 3, 128, false, false, false, true},
      {"INT8", 2, 700, 900, 3, 128, false, false, false, false, true},
      {"INT8 causal head dim 64", 1, 1000, 1000, 4, 64, true, false, false, false, true},
      {"INT8 exp2", 2, 700, 900, 3, 128, false, false, false, false, true, true},
  };
  for (const GridCase& c : cases) ASSERT_NO_FATAL_FAILURE(run_grid_case(c));
}

}  // namespace
