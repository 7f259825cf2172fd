// The sm_90a ExpCast attention kernel against the CPU reference fed the SAME quantized inputs, tile
// sizes and key order (so the tolerance measures the kernel, not quantization), and against exact FP64
// attention on the original inputs. Inputs are prepared on the host by the reference and packed here,
// so these tests do not depend on the preparation kernels.
// Run: openvc_gpu_tests --gtest_filter='Sm90*'
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "attention/sm90/expcast.cuh"
#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "openvc/attention.h"
#include "openvc/reference.h"
#include "reference/test_inputs.h"

namespace {

namespace ref = openvc::reference;
using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::bf16_to_float;
using openvc::testing::pack_v;
using openvc::testing::upload;

// ---- ExpCast conversion, bit for bit ----------------------------------------------------------------

__global__ void expcast_codes_kernel(const float* acc, const float* a, const float* m, uint8_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = openvc::sm90::expcast_code(acc[i], a[i], m[i]);
}

TEST(Sm90Expcast, DeviceCodesMatchReferenceBitForBit) {
  SKIP_WITHOUT_SM90();
  const int n = 1 << 22;
  std::mt19937 rng(1234);
  std::normal_distribution<float> gauss(0.0f, 30.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<float> acc(n), a(n), m(n);
  for (int i = 0; i < n; ++i) {
    a[i] = std::ldexp(0.5f + uni(rng), -int(uni(rng) * 12));  // positive multipliers over many octaves
    acc[i] = gauss(rng);
    const float prod = acc[i] * a[i];
    // Row maxima at and above the score, so codes span 0..120; every fourth case is an exact tie:
    // pick m so that fma(acc, a, bias - m) lands on k + 0.5 (checked below by construction).
    m[i] = prod + uni(rng) * 130.0f;
    if (i % 4 == 0) {
      const float target = std::floor(uni(rng) * 121.0f) + 0.5f;
      acc[i] = std::ldexp(std::round(std::ldexp(acc[i], 6)), -6);  // few significant bits
      a[i] = std::ldexp(1.0f, -int(uni(rng) * 4));
      m[i] = ref::kCodeBias - (target - acc[i] * a[i]);
    }
  }
  DevBuf dacc(n * 4), da(n * 4), dm(n * 4), dout(n);
  ASSERT_TRUE(upload(dacc.p, acc) && upload(da.p, a) && upload(dm.p, m));
  CUDA_OK(cudaMemset(dout.p, 0xEE, n));
  expcast_codes_kernel<<<(n + 255) / 256, 256>>>(dacc.as<float>(), da.as<float>(), dm.as<float>(), dout.as<uint8_t>(), n);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = download<uint8_t>(dout.p, n);
  ASSERT_EQ(got.size(), size_t(n));
  int64_t mismatches = 0, ties = 0;
  for (int i = 0; i < n; ++i) {
    const float x = std::fma(acc[i], a[i], ref::kCodeBias - m[i]);
    if (x - std::floor(x) == 0.5f) ++ties;
    const uint8_t want = ref::expcast_code(acc[i], a[i], m[i]);
    if (got[i] != want && mismatches++ < 5)
      ADD_FAILURE() << "acc=" << acc[i] << " a=" << a[i] << " m=" << m[i] << " device " << int(got[i])
                    << " reference " << int(want);
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(ties, n / 16) << "the sweep must exercise round-half-to-even";
}

// ---- Attention ----------------------------------------------------------------------------------

struct Case {
  int batch, seqlen, heads;
  int mid_window;  // ref::kNaturalOrder for natural order
  bool video;      // video-like inputs, else random normal
  double repair_budget = 0.0;  // V residual repair rows (numerics section 6), 0: none
  // Random inputs whose every third query row scores negative against every key (positive keys, those
  // queries negative): the kernel's integer row max has a separate path for all-negative scores.
  bool negative_rows = false;
};

// Repair rows of the reference (groups in (b, h) order) in the kernel's RepairInputs layout.
struct RepairHost {
  int rows = 0;
  std::vector<uint8_t> k_codes, v_packed;
  std::vector<float> k_descale;
};
RepairHost repair_layout(const ref::PreparedInputs& prep, const ref::VRepair& rep, int B, int S, int H, int D) {
  RepairHost r;
  r.rows = rep.tokens_per_head;
  const int64_t rp = openvc::repair_padded_rows(r.rows);
  r.k_codes.assign(size_t(B) * H * rp * D, 0);
  r.v_packed.assign(size_t(B) * H * D * rp, 0);
  r.k_descale.assign(size_t(B) * H * rp, 0.0f);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const size_t g = size_t(b) * H + h;
      for (int i = 0; i < rep.count[g]; ++i) {
        const int tok = rep.tokens[rep.offset[g] + i];
        const uint8_t* kc = &prep.k.codes[((size_t(b) * S + tok) * H + h) * D];
        std::copy(kc, kc + D, &r.k_codes[(g * rp + i) * D]);
        r.k_descale[g * rp + i] = prep.k.descale[g * prep.k.max_blocks + tok / openvc::kQuantBlock];
      }
      for (int64_t col = 0; col < rp; ++col) {
        const int64_t row = (col / 16) * 16 + openvc::kPackedKeyOrder[col % 16];
        if (row >= rep.count[g]) continue;
        for (int d = 0; d < D; ++d)
          r.v_packed[(g * D + d) * rp + col] = rep.codes[(size_t(rep.offset[g]) + row) * D + d];
      }
    }
  return r;
}

std::vector<float> random_normal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = ref::round_to_bf16(g(rng));
  return x;
}

// The reference's prepared codes and descales of a batched call on the device (V packed for the kernel).
struct DevicePrepared {
  std::vector<uint8_t> vpacked;
  DevBuf dq, dk, dv, dqs, dks, dvs;
  bool uploaded;
  DevicePrepared(const ref::PreparedInputs& prep, int B, int S, int H, int D)
      : vpacked(pack_v(prep.v.codes, B, S, H, D)), dq(prep.q.codes.size()), dk(prep.k.codes.size()),
        dv(vpacked.size()), dqs(prep.q.descale.size() * 4), dks(prep.k.descale.size() * 4),
        dvs(prep.v.descale.size() * 4),
        uploaded(upload(dq.p, prep.q.codes) && upload(dk.p, prep.k.codes) && upload(dv.p, vpacked) &&
                 upload(dqs.p, prep.q.descale) && upload(dks.p, prep.k.descale) && upload(dvs.p, prep.v.descale)) {}
  openvc::Fp8Inputs inputs(int B, int S, int H, int D) const {
    return {B, S, S, H, D, dq.as<uint8_t>(), dqs.as<float>(), dk.as<uint8_t>(), dks.as<float>(),
            dv.as<uint8_t>(), dvs.as<float>()};
  }
};

void run_case(const Case& c) {
  const int B = c.batch, S = c.seqlen, H = c.heads, D = 128;
  SCOPED_TRACE(::testing::Message() << "B=" << B << " S=" << S << " H=" << H << " w=" << c.mid_window
                                    << (c.video ? " video" : c.negative_rows ? " negative rows" : " normal"));
  const ref::Sequences seqs = ref::Sequences::Batched(B, S, H, D);
  std::vector<float> q, k, v;
  if (c.video) {
    auto qkv = ref::testing::video_like(seqs, seqs, 77 + S + H);
    q = std::move(qkv.q), k = std::move(qkv.k), v = std::move(qkv.v);
  } else {
    const size_t n = size_t(B) * S * H * D;
    q = random_normal(n, 1 + S), k = random_normal(n, 2 + S), v = random_normal(n, 3 + S);
    if (c.negative_rows)
      for (size_t i = 0; i < n; ++i) {
        const bool negative_query = (i / (size_t(H) * D)) % 3 == 0;  // token index = i / (H D) mod S
        // Scores of one sign only carry no cancellation, so the FP8 tensor-core accumulation error
        // grows with their size; 0.25 keeps them in the range of the other cases.
        k[i] = ref::round_to_bf16(std::fabs(k[i]) + 0.25f);
        q[i] = ref::round_to_bf16((negative_query ? -0.25f : 0.25f) * (std::fabs(q[i]) + 0.25f));
      }
  }
  ref::PreparedInputs prep;
  ASSERT_TRUE(ref::prepare_inputs(q.data(), k.data(), v.data(), seqs, seqs, &prep).ok());
  ref::VRepair vrep;
  if (c.repair_budget > 0) {
    ASSERT_TRUE(ref::select_v_repair(v.data(), seqs, prep.v, c.repair_budget, &vrep).ok());
    prep.repair = &vrep;
  }
  ref::AttentionOptions opt;
  opt.mid_window_blocks = c.mid_window;
  ref::AttentionResult want;
  ASSERT_TRUE(ref::attention_expcast(prep, opt, &want).ok());

  const int nblk = int(openvc::num_quant_blocks(S));
  ASSERT_EQ(prep.q.max_blocks, nblk);
  const DevicePrepared dev(prep, B, S, H, D);
  const size_t nout = size_t(B) * S * H * D;
  DevBuf dout(nout * 2), dlse(size_t(B) * H * S * 4);
  ASSERT_TRUE(dev.uploaded);
  CUDA_OK(cudaMemset(dout.p, 0xFF, nout * 2));  // BF16 NaN poison: every element must be overwritten
  CUDA_OK(cudaMemset(dlse.p, 0xFF, size_t(B) * H * S * 4));

  const RepairHost rh = c.repair_budget > 0 ? repair_layout(prep, vrep, B, S, H, D) : RepairHost{};
  DevBuf drk(rh.k_codes.size()), drks(rh.k_descale.size() * 4), drv(rh.v_packed.size());
  ASSERT_TRUE(rh.rows == 0 || (upload(drk.p, rh.k_codes) && upload(drks.p, rh.k_descale) && upload(drv.p, rh.v_packed)));
  openvc::AttentionParams p;
  p.repair.rows = rh.rows;
  p.repair.k_codes = drk.as<uint8_t>();
  p.repair.k_descale = drks.as<float>();
  p.repair.v_packed = drv.as<uint8_t>();
  p.in = dev.inputs(B, S, H, D);
  p.out = dout.p;
  p.out_stride_batch = int64_t(S) * H * D;
  p.out_stride_seq = int64_t(H) * D;
  p.out_stride_head = D;
  p.lse = dlse.as<float>();
  p.mid_window_blocks = c.mid_window;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const openvc::Status st = openvc::attention_fp8(p, stream);
  ASSERT_TRUE(st.ok()) << st.message();
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));

  const std::vector<uint16_t> out_bits = download<uint16_t>(dout.p, nout);
  const std::vector<float> lse = download<float>(dlse.p, size_t(B) * H * S);
  std::vector<float> got(nout);
  int64_t non_finite = 0;
  for (size_t i = 0; i < nout; ++i) {
    got[i] = bf16_to_float(out_bits[i]);
    non_finite += !std::isfinite(got[i]);
  }
  ASSERT_EQ(non_finite, 0) << "output elements left unwritten or NaN";

  // Kernel vs reference on the same quantized inputs and order.
  std::vector<double> want_d(want.out.begin(), want.out.end());
  const ref::ErrorMetrics e = ref::compare(got.data(), want_d.data(), int64_t(nout));
  double ref_max = 0;
  for (double x : want_d) ref_max = std::max(ref_max, std::fabs(x));
  // The kernel's QK^T accumulates on the FP8 tensor cores (about 13 mantissa bits, truncating), the
  // reference exactly, so a few codes land on the other side of a rounding boundary; each such key's
  // weight moves by one E4M3 step (at most 12.5%), and BF16 output rounding adds 2^-8 relative.
  // 4% of the largest output covers a few such keys in one row. Random normal inputs give nearly
  // flat attention whose outputs shrink like 1/sqrt(S), which inflates the relative error; realistic
  // (video-like) inputs are held to the 0.5% of the contract.
  // Rows of one-signed scores give flat attention like random normal inputs, a little flatter still
  // (measured 8.0e-3 at S = 4097); a wrong row max would show against exact attention below.
  EXPECT_LE(e.rel_l2, c.video ? 5e-3 : c.negative_rows ? 1e-2 : 7.5e-3);
  EXPECT_LE(e.max_abs, 0.04 * ref_max + 1e-3);
  // LSE: the max in code units moves with the accumulator, which shifts every code of the row; the
  // ExpCast staircase turns that into a small lse change, well under one code step (ln(9/8)=0.118).
  double lse_err = 0, lse_mean = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < S; ++i) {
        const size_t idx = (size_t(b) * H + h) * S + i;
        const double d = std::fabs(lse[idx] - want.lse[idx]);
        lse_err = std::max(lse_err, d);
        lse_mean += d / (double(B) * H * S);
      }
  EXPECT_LE(lse_err, 0.03);
  EXPECT_LE(lse_mean, 5e-3);

  // Against exact attention: the kernel's error is within 10% of the reference's own.
  std::vector<double> exact;
  ASSERT_TRUE(ref::attention_exact(q.data(), k.data(), v.data(), seqs, seqs, 0.0f, false, &exact).ok());
  const ref::ErrorMetrics ek = ref::compare(got.data(), exact.data(), int64_t(nout));
  const ref::ErrorMetrics er = ref::compare(want.out.data(), exact.data(), int64_t(nout));
  EXPECT_LE(ek.rel_l2, 1.1 * er.rel_l2 + 1e-3);
  if (c.repair_budget > 0) {
    // Repair must help: the reference's own error against exact attention drops, and the kernel's too.
    ref::PreparedInputs plain = prep;
    plain.repair = nullptr;
    ref::AttentionResult want_plain;
    ASSERT_TRUE(ref::attention_expcast(plain, opt, &want_plain).ok());
    const ref::ErrorMetrics ep = ref::compare(want_plain.out.data(), exact.data(), int64_t(nout));
    // (The kernel's own FP8-accumulator noise is of the size of the gain at these lengths, so the
    // kernel is held to the reference above rather than to the unrepaired reference.)
    EXPECT_LT(er.rel_l2, ep.rel_l2);
    std::printf("  repair budget %.4f (%d rows): reference %.4f -> %.4f vs exact\n", c.repair_budget, rh.rows,
                ep.rel_l2, er.rel_l2);
  }
  std::printf("  [B=%d S=%d H=%d w=%d %s] vs ref: rel_l2 %.2e max_abs %.2e (|ref|max %.2f) lse max %.1e "
              "mean %.1e | vs exact: kernel %.4f reference %.4f\n",
              B, S, H, c.mid_window, c.video ? "video" : "normal", e.rel_l2, e.max_abs, ref_max, lse_err,
              lse_mean, ek.rel_l2, er.rel_l2);
}

TEST(Sm90Attention, SmallShapes) {
  SKIP_WITHOUT_SM90();
  for (Case c : {Case{1, 1, 1, 4, false}, Case{1, 127, 1, 4, false}, Case{1, 128, 2, 4, true},
                 Case{2, 1000, 3, 4, true}, Case{1, 1000, 1, ref::kNaturalOrder, false}})
    run_case(c);
}

// The steady state runs blocks 1 .. n-2 in pairs (the FP32 flush period) and the rest through the general step: 2 to
// 7 key blocks cover no pair, one pair with and without a remainder, and a last block that is full (640, 768 = 5, 6
// blocks) or partial. Up to 6 blocks (768) that is the few-keys mode (kFewKeyBlocks; these inputs are prepared: with
// Q quantized in the kernel it runs up to 32 and Sm90FusedQ.SameBitsAsPreparedQ holds it to these bits), from 7 the
// plain mode: 7, 9 and 11 blocks leave a remainder (800 partial; 1152, 1408 full; 1300 partial), 8 and 10 none (1024,
// 1280 full; 1200 partial).
TEST(Sm90Attention, KeyBlockCountsAroundTheFlushPeriod) {
  SKIP_WITHOUT_SM90();
  for (int S : {129, 300, 500, 640, 768, 800, 1024, 1152, 1200, 1280, 1300, 1408})
    for (int w : {4, ref::kNaturalOrder}) run_case(Case{1, S, 2, w, true});
}

// More tiles than SMs with few key blocks: each CTA runs several tiles of the few-keys mode, whose consumers take
// turns across the tile boundaries (192 tiles of 6 blocks).
TEST(Sm90Attention, ManyTilesOfFewKeyBlocks) {
  SKIP_WITHOUT_SM90();
  run_case(Case{2, 768, 16, 4, true});
}

TEST(Sm90Attention, RowsWhoseScoresAreAllNegative) {
  SKIP_WITHOUT_SM90();
  for (Case c : {Case{1, 1000, 2, 4, false, 0.0, true}, Case{2, 4097, 1, ref::kNaturalOrder, false, 0.0, true}})
    run_case(c);
}

TEST(Sm90Attention, LongerSequences) {
  SKIP_WITHOUT_SM90();
  for (Case c : {Case{1, 4096, 2, 4, true}, Case{2, 4096, 1, 4, false}, Case{1, 4097, 1, ref::kNaturalOrder, true}})
    run_case(c);
}

TEST(Sm90Attention, VResidualRepair) {
  SKIP_WITHOUT_SM90();
  // Budgets giving 1 row, a partial tile, exactly one tile and several tiles (with a padded last one).
  for (Case c : {Case{1, 200, 1, 4, true, 0.005}, Case{2, 1000, 2, 4, true, 0.05}, Case{1, 1024, 1, 4, true, 0.125},
                 Case{1, 4096, 2, 4, true, 0.08}, Case{1, 1000, 1, ref::kNaturalOrder, false, 0.02}})
    run_case(c);
}

// Repair rows whose residual codes are all zero must leave the output unchanged, bit for bit: they add
// only to the numerator, and only zeros.
TEST(Sm90Attention, ZeroResidualRepairChangesNothing) {
  SKIP_WITHOUT_SM90();
  const int B = 1, S = 1000, H = 2, D = 128;
  const ref::Sequences seqs = ref::Sequences::Batched(B, S, H, D);
  auto qkv = ref::testing::video_like(seqs, seqs, 4242);
  ref::PreparedInputs prep;
  ASSERT_TRUE(ref::prepare_inputs(qkv.q.data(), qkv.k.data(), qkv.v.data(), seqs, seqs, &prep).ok());
  ref::VRepair vrep;
  ASSERT_TRUE(ref::select_v_repair(qkv.v.data(), seqs, prep.v, 0.2, &vrep).ok());
  std::fill(vrep.codes.begin(), vrep.codes.end(), uint8_t(0));
  const RepairHost rh = repair_layout(prep, vrep, B, S, H, D);
  const DevicePrepared dev(prep, B, S, H, D);
  DevBuf drk(rh.k_codes.size()), drks(rh.k_descale.size() * 4), drv(rh.v_packed.size());
  ASSERT_TRUE(dev.uploaded && upload(drk.p, rh.k_codes) && upload(drks.p, rh.k_descale) &&
              upload(drv.p, rh.v_packed));
  const size_t nout = size_t(B) * S * H * D;
  DevBuf out_plain(nout * 2), out_rep(nout * 2);
  CUDA_OK(cudaMemset(out_plain.p, 0xFF, nout * 2));
  CUDA_OK(cudaMemset(out_rep.p, 0xFF, nout * 2));
  openvc::AttentionParams p;
  p.in = dev.inputs(B, S, H, D);
  p.out_stride_batch = int64_t(S) * H * D, p.out_stride_seq = int64_t(H) * D, p.out_stride_head = D;
  p.out = out_plain.p;
  ASSERT_TRUE(openvc::attention_fp8(p, nullptr).ok());
  p.out = out_rep.p;
  p.repair = {rh.rows, drk.as<uint8_t>(), drks.as<float>(), drv.as<uint8_t>(), nullptr};
  ASSERT_GT(rh.rows, 128) << "several repair tiles";
  ASSERT_TRUE(openvc::attention_fp8(p, nullptr).ok());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(download<uint16_t>(out_plain.p, nout), download<uint16_t>(out_rep.p, nout));
}

// The epilogue stores 8 outputs per instruction when out, its strides and every row fall on 16 bytes, else 2: an
// output off 16 bytes in one term at a time (the pointer, the head, sequence or batch stride; 4-byte aligned) must
// hold the dense output's bits, with a partial last query tile (S = 1000) and both output dtypes, and leave every
// element between its rows alone.
TEST(Sm90Attention, OutputStoresMatchOffSixteenBytes) {
  SKIP_WITHOUT_SM90();
  const int B = 2, S = 1000, H = 3, D = 128;
  const ref::Sequences seqs = ref::Sequences::Batched(B, S, H, D);
  auto qkv = ref::testing::video_like(seqs, seqs, 5151);
  ref::PreparedInputs prep;
  ASSERT_TRUE(ref::prepare_inputs(qkv.q.data(), qkv.k.data(), qkv.v.data(), seqs, seqs, &prep).ok());
  const DevicePrepared dev(prep, B, S, H, D);
  ASSERT_TRUE(dev.uploaded);
  openvc::AttentionParams p;
  p.in = dev.inputs(B, S, H, D);
  struct Layout {
    const char* what;
    int64_t offset, hs, ss, bs;   // elements
  };
  const int64_t hs0 = D, ss0 = int64_t(H) * D, bs0 = int64_t(S) * H * D;
  const Layout layouts[] = {{"pointer 4 bytes past 16", 2, hs0, ss0, bs0},
                            {"head stride D + 2", 0, D + 2, H * (D + 2), S * H * (D + 2)},
                            {"sequence stride H * D + 2", 0, hs0, ss0 + 2, S * (ss0 + 2)},
                            {"batch stride S * H * D + 2", 0, hs0, ss0, bs0 + 2}};
  for (const auto dtype : {openvc::DType::kBFloat16, openvc::DType::kFloat16}) {
    const size_t nout = size_t(B) * S * H * D;
    DevBuf dense(nout * 2);
    CUDA_OK(cudaMemset(dense.p, 0xFF, nout * 2));
    p.out_dtype = dtype;
    p.out = dense.p, p.out_stride_batch = bs0, p.out_stride_seq = ss0, p.out_stride_head = hs0;
    ASSERT_TRUE(openvc::attention_fp8(p, nullptr).ok());
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> want = download<uint16_t>(dense.p, nout);
    for (const Layout& l : layouts) {
      const int64_t n = l.offset + (B - 1) * l.bs + (S - 1) * l.ss + (H - 1) * l.hs + D;
      DevBuf buf(size_t(n) * 2);
      CUDA_OK(cudaMemset(buf.p, 0xFF, size_t(n) * 2));
      p.out = static_cast<uint16_t*>(buf.p) + l.offset;
      p.out_stride_batch = l.bs, p.out_stride_seq = l.ss, p.out_stride_head = l.hs;
      ASSERT_TRUE(openvc::attention_fp8(p, nullptr).ok()) << l.what;
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> got = download<uint16_t>(buf.p, size_t(n));
      std::vector<bool> output(size_t(n), false);
      int64_t differ = 0, others_written = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < S; ++i)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d) {
              const int64_t at = l.offset + b * l.bs + i * l.ss + h * l.hs + d;
              output[size_t(at)] = true;
              differ += got[size_t(at)] != want[size_t(((b * S + i) * H + h) * D + d)];
            }
      for (int64_t at = 0; at < n; ++at) others_written += !output[size_t(at)] && got[size_t(at)] != 0xFFFF;
      EXPECT_EQ(differ, 0) << l.what << ", dtype " << int(dtype);
      EXPECT_EQ(others_written, 0) << l.what << ", dtype " << int(dtype);
    }
  }
}

TEST(Sm90Attention, RejectsBadArguments) {
  openvc::AttentionParams p;
  openvc::Status st = openvc::attention_fp8(p, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("batch"), std::string::npos) << st.message();
  p.in = {1, 128, 128, 1, 96, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};   // 128 or 64 only
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_NE(st.message().find("head_dim"), std::string::npos) << st.message();
  // Unset (zero) output strides are rejected before anything touches the device.
  alignas(16) static uint8_t fake[64];
  const float* f = reinterpret_cast<const float*>(fake);
  p.in = {1, 128, 128, 1, 128, fake, f, fake, f, fake, f};
  p.out = fake;
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("out strides"), std::string::npos) << st.message();
  p.out_stride_batch = p.out_stride_seq = p.out_stride_head = 128;
  p.repair.rows = 3;  // repair rows without their tensors
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("repair.k_codes"), std::string::npos) << st.message();
  p.repair.rows = -1;
  st = openvc::attention_fp8(p, nullptr);
  EXPECT_NE(st.message().find("repair.rows"), std::string::npos) << st.message();
}

}  // namespace
