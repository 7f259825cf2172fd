// The sm_90a fast path's causal, packed-sequence and key-count modes (attention_fp8) against the CPU
// reference on the same quantized inputs and order, and against exact FP64 attention; its behaviour on
// huge score spreads and on offsets that point outside the tensors. Cases: gpu/attention_case.h.
// Run: openvc_gpu_tests --gtest_filter='Sm90Modes*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "attention/sm90/expcast.cuh"
#include "gpu/attention_case.h"
#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "openvc/attention.h"
#include "openvc/general.h"
#include "openvc/reference.h"

namespace {

namespace ref = openvc::reference;
using namespace openvc::testing::attention_case;
using openvc::testing::bf16_to_float;
using openvc::testing::DevBuf;
using openvc::testing::download;
using openvc::testing::upload;

constexpr Path kFast = Path::kFast;

Case packed(std::vector<int> lq, std::vector<int> lk, int H, bool causal, int w, bool video) {
  Case c{std::move(lq), std::move(lk), true, H, 128, causal, w, video};
  c.path = kFast;
  return c;
}

TEST(Sm90Modes, CausalSelf) {
  SKIP_WITHOUT_SM90();
  run_case(batched(1, 1000, 1000, 2, 128, true, 4, true, kFast));
  run_case(batched(2, 1000, 1000, 1, 128, true, ref::kNaturalOrder, false, kFast));
  run_case(batched(2, 127, 127, 1, 128, true, 0, false, kFast));
  run_case(batched(1, 1, 1, 1, 128, true, 4, false, kFast));
  run_case(batched(1, 640, 640, 2, 128, true, 4, true, kFast));   // whole blocks: one masked block per tile
  // 168 tiles on at most 132 CTAs: the query-tile-major snake order over two rounds (launch.cu picks it
  // where the (batch, head)-major order would be unbalanced).
  run_case(batched(1, 3000, 3000, 7, 128, true, 4, true, kFast));
}

TEST(Sm90Modes, CausalCross) {
  SKIP_WITHOUT_SM90();
  run_case(batched(1, 300, 1000, 2, 128, true, 4, true, kFast));    // Sq < Sk: the diagonal spans two blocks
  run_case(batched(2, 1000, 300, 1, 128, true, 4, false, kFast));   // Sq > Sk: 700 rows see no key (0, -inf)
  run_case(batched(1, 1000, 128, 1, 128, true, ref::kNaturalOrder, true, kFast));
  run_case(batched(1, 200, 4000, 1, 128, true, 4, false, kFast));   // many full blocks behind the diagonal
}

// Chunked causal (numerics section 5): every key of the query's own chunk and the chunks before it.
// Chunks of 300, 1,560 and 3,600 tokens (not multiples of 128: tiles straddling a chunk edge mask up to
// chunk / 128 + 2 blocks per row), 128 and 129, Sq != Sk, both orders, head dim 64, packed with an empty
// sequence; fast and general paths.
TEST(Sm90Modes, ChunkedCausal) {
  SKIP_WITHOUT_SM90();
  for (Path path : {kFast, Path::kGeneral}) {
    Case c = batched(2, 1000, 1000, 2, 128, true, 4, true, path);
    c.causal_chunk = 300;
    run_case(c);
    c = batched(1, 2000, 3200, 1, 64, true, ref::kNaturalOrder, false, path);   // Sq < Sk
    c.causal_chunk = 1560;
    run_case(c);
    c = batched(1, 1500, 700, 2, 128, true, 4, true, path);   // Sq > Sk: the first rows see no key
    c.causal_chunk = 250;
    run_case(c);
    c = packed({1000, 0, 700}, {1000, 0, 900}, 2, true, 4, false);
    c.path = path, c.causal_chunk = 129;
    run_case(c);
    c = batched(1, 1000, 1000, 2, 128, true, 4, false, path);   // chunk = one key block
    c.causal_chunk = 128;
    run_case(c);
    c = batched(1, 4000, 4000, 1, 128, true, 4, true, path);    // a 720p frame: one edge at 3,600
    c.causal_chunk = 3600;
    run_case(c);
    c = packed({1000, 0, 700}, {1000, 0, 900}, 2, true, 4, false);   // head dim 64, packed
    c.head_dim = 64, c.path = path, c.causal_chunk = 300;
    run_case(c);
  }
}

TEST(Sm90Modes, PackedUneven) {
  SKIP_WITHOUT_SM90();
  run_case(packed({1, 300, 1000}, {1000, 300, 1}, 2, false, 4, true));
  run_case(packed({700, 129, 1000}, {1, 300, 1000}, 1, false, ref::kNaturalOrder, false));
  run_case(packed({1000, 1000}, {1000, 1000}, 2, false, 4, false));   // equal lengths
  Case bound = packed({300, 1, 1000}, {1000, 300, 1}, 2, false, 4, false);
  bound.extra_max = 200;    // max_seqlen above the true maximum
  bound.padded_out = true;  // output rows with gaps that must stay untouched
  run_case(bound);
}

TEST(Sm90Modes, PackedEmptyAndCausal) {
  SKIP_WITHOUT_SM90();
  // An empty key sequence gives output 0 and lse -inf; an empty query sequence writes nothing.
  run_case(packed({5, 0, 200, 130}, {0, 100, 130, 300}, 2, false, 4, false));
  run_case(packed({5, 0, 200, 130}, {0, 100, 130, 300}, 2, true, 4, false));
  run_case(packed({1000, 1, 300}, {1000, 1, 700}, 1, true, 4, true));
  run_case(packed({300, 900}, {700, 900}, 2, true, ref::kNaturalOrder, false));
  // More sequences than the compact tile space takes (kMaxCompactSeqs = 1024): the slot layout of
  // max_seqlen_q tiles per sequence, empty slots skipped; and just below the limit, compact.
  for (int nseq : {1030, 1000}) {
    std::vector<int> lq(nseq), lk(nseq);
    for (int i = 0; i < nseq; ++i) lq[i] = i % 7 == 0 ? 0 : 1 + i % 5, lk[i] = i % 11 == 0 ? 0 : 1 + i % 9;
    lq[3] = 300;   // one longer sequence: the others leave empty slots
    run_case(packed(lq, lk, 1, nseq == 1000, 4, false));
  }
}

TEST(Sm90Modes, KeyCountsPerBatchEntry) {
  SKIP_WITHOUT_SM90();
  // seqused_k: the unused keys of each entry hold NaN codes; different counts per entry, one of 0.
  for (bool causal : {false, true}) {
    Case c = batched(3, 700, 0, 2, 128, causal, 4, true, kFast);
    c.lens_k = {1000, 517, 1};
    c.slot_k = 1000;
    run_case(c);
    c.lens_k = {0, 128, 999};
    c.video = false;
    run_case(c);
  }
  Case g = batched(2, 300, 0, 1, 128, false, 4, true);   // the general path takes key counts too
  g.lens_k = {300, 45};
  g.slot_k = 333;
  run_case(g);
}

// Head dim 64 (kHeadDim64Mode): the same tiles and order with half-width rows, in every form the fast
// path takes: dense (one block, partial blocks, several flush periods), causal self and cross, packed
// uneven and empty sequences, key counts with NaN codes in the unused keys.
Case d64(Case c) {
  c.head_dim = 64;
  c.path = kFast;
  return c;
}

TEST(Sm90Modes, HeadDim64) {
  SKIP_WITHOUT_SM90();
  run_case(d64(batched(1, 1, 1, 1, 64, false, 4, false, kFast)));
  run_case(d64(batched(2, 300, 700, 3, 64, false, 4, true, kFast)));
  run_case(d64(batched(1, 1000, 1000, 2, 64, false, ref::kNaturalOrder, false, kFast)));
  run_case(d64(batched(1, 2000, 1500, 2, 64, false, 4, true, kFast)));
  run_case(d64(batched(1, 1000, 1000, 2, 64, true, 4, true, kFast)));
  run_case(d64(batched(2, 300, 1000, 1, 64, true, 4, false, kFast)));
  run_case(d64(batched(1, 1000, 300, 1, 64, true, ref::kNaturalOrder, false, kFast)));
  run_case(d64(packed({1, 300, 1000}, {1000, 300, 1}, 2, false, 4, true)));
  run_case(d64(packed({5, 0, 200, 130}, {0, 100, 130, 300}, 2, false, 4, false)));
  run_case(d64(packed({1000, 1, 300}, {1000, 1, 700}, 1, true, 4, true)));
  Case counts = d64(batched(3, 700, 0, 2, 64, false, 4, true, kFast));
  counts.lens_k = {1000, 517, 1};
  counts.slot_k = 1000;
  run_case(counts);
  counts.causal = true;
  counts.lens_k = {0, 128, 999};
  run_case(counts);
}

TEST(Sm90Modes, HugeScoreSpreadsStayFinite) {
  SKIP_WITHOUT_SM90();
  // q and k around 1e4 (scores ~1e9 nats), and a softmax scale of 1e7: the addend 119.65 - M loses
  // its low bits, and without the clip at 120 a code reached the NaN byte (numerics section 3).
  for (Path path : {Path::kFast, Path::kGeneral}) {
    for (bool causal : {false, true}) {
      Case c = batched(1, 500, 500, 2, 128, causal, 4, false, path);
      c.input_scale = 1e4f;
      c.finite_only = true;
      run_case(c);
      Case s = batched(1, 300, 700, 1, 128, causal, 4, true, path);
      s.softmax_scale = 1e7f;
      s.finite_only = true;
      run_case(s);
    }
  }
  // Head dim 64 on the fast path (its own instantiations of the clipped step).
  for (bool causal : {false, true}) {
    Case c = d64(batched(1, 500, 500, 2, 64, causal, 4, false, Path::kFast));
    c.input_scale = 1e4f;
    c.finite_only = true;
    run_case(c);
  }
}

// ---- ExpCast codes with huge running maxima, bit for bit against the reference ------------------------

__global__ void huge_codes_kernel(const float* acc, const float* a, const float* m, uint8_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = openvc::sm90::expcast_code(acc[i], a[i], m[i]);
}

TEST(Sm90Modes, HugeMaximaGiveCodesInRange) {
  SKIP_WITHOUT_SM90();
  const int n = 1 << 20;
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<float> acc(n), a(n), m(n);
  for (int i = 0; i < n; ++i) {
    // Running maxima from 2^20 to 2^100 code units: fl(acc * a) is the max or a few ulps below it.
    a[i] = std::ldexp(1.0f + uni(rng), int(uni(rng) * 60) - 10);
    acc[i] = std::ldexp(1.0f + uni(rng), 20 + int(uni(rng) * 30)) * (i % 3 ? 1.0f : -1.0f);
    const float prod = acc[i] * a[i];
    m[i] = i % 2 ? prod : std::nextafter(prod, INFINITY);
  }
  DevBuf dacc(n * 4), da(n * 4), dm(n * 4), dout(n);
  ASSERT_TRUE(upload(dacc.p, acc) && upload(da.p, a) && upload(dm.p, m));
  CUDA_OK(cudaMemset(dout.p, 0xEE, n));
  huge_codes_kernel<<<(n + 255) / 256, 256>>>(dacc.as<float>(), da.as<float>(), dm.as<float>(), dout.as<uint8_t>(), n);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = download<uint8_t>(dout.p, n);
  int64_t mismatches = 0, out_of_range = 0;
  for (int i = 0; i < n; ++i) {
    out_of_range += got[i] > 120;
    if (got[i] != ref::expcast_code(acc[i], a[i], m[i]) && mismatches++ < 5)
      ADD_FAILURE() << "acc=" << acc[i] << " a=" << a[i] << " m=" << m[i] << " device " << int(got[i])
                    << " reference " << int(ref::expcast_code(acc[i], a[i], m[i]));
  }
  EXPECT_EQ(out_of_range, 0);
  EXPECT_EQ(mismatches, 0);
}

// ---- offsets that point outside the tensors ----------------------------------------------------------

// cu_seqlens past the end, negative or decreasing: both paths clamp every offset to [0, total] on the
// device, so neither faults (compute-sanitizer memcheck runs this test on the device) and both write
// the same rows (the rows the clamped sequences cover) with the same values up to the fast path's
// tolerance; rows no clamped sequence covers keep their poison.
TEST(Sm90Modes, BadOffsetsNeverLeaveTheTensors) {
  SKIP_WITHOUT_SM90();
  const int H = 2, D = 128, total_q = 600, total_k = 700, nseq = 3, max_len = 400;
  const int nq = int(openvc::num_quant_blocks(max_len)), nk = nq;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> byte(0, 0x50);   // finite E4M3 codes up to 8.0, random sign
  auto codes = [&](size_t n) {
    std::vector<uint8_t> c(n);
    for (auto& x : c) x = uint8_t(byte(rng) | ((rng() & 1u) << 7));
    return c;
  };
  DevBuf dq(size_t(total_q) * H * D), dk(size_t(total_k) * H * D), dv(size_t(nseq) * H * D * nk * 128);
  std::vector<float> qs(size_t(nseq) * H * nq, 0.02f), ks(size_t(nseq) * H * nk, 0.02f), vs(size_t(nseq) * H, 0.01f);
  DevBuf dqs(qs.size() * 4), dks(ks.size() * 4), dvs(vs.size() * 4);
  ASSERT_TRUE(upload(dq.p, codes(dq.bytes)) && upload(dk.p, codes(dk.bytes)) && upload(dv.p, codes(dv.bytes)) &&
              upload(dqs.p, qs) && upload(dks.p, ks) && upload(dvs.p, vs));
  for (const std::vector<int>& cu_q : {std::vector<int>{0, 300, 100000, 2000000000}, std::vector<int>{-50, 200, 100, 600},
                                      std::vector<int>{0, 700, -1, 550}}) {
    const std::vector<int> cu_k = {0, -7, 650, 100000};
    DevBuf dcq(16), dck(16);
    ASSERT_TRUE(upload(dcq.p, cu_q) && upload(dck.p, cu_k));
    std::vector<std::vector<uint16_t>> outs;
    for (Path path : {Path::kFast, Path::kGeneral}) {
      DevBuf dout(size_t(total_q) * H * D * 2), dlse(size_t(H) * total_q * 4);
      CUDA_OK(cudaMemset(dout.p, 0xFF, dout.bytes));
      CUDA_OK(cudaMemset(dlse.p, 0xFF, dlse.bytes));
      openvc::Fp8Inputs in{0, 0, 0, H, D, dq.as<uint8_t>(), dqs.as<float>(), dk.as<uint8_t>(), dks.as<float>(),
                           dv.as<uint8_t>(), dvs.as<float>()};
      openvc::Status st;
      if (path == Path::kFast) {
        openvc::AttentionParams p;
        p.in = in, p.out = dout.p, p.out_stride_seq = H * D, p.out_stride_head = D, p.lse = dlse.as<float>();
        p.cu_seqlens_q = dcq.as<int>(), p.cu_seqlens_k = dck.as<int>();
        p.num_seqs = nseq, p.max_seqlen_q = p.max_seqlen_k = max_len, p.total_q = total_q, p.total_k = total_k;
        st = openvc::attention_fp8(p, nullptr);
      } else {
        openvc::GeneralAttentionParams p;
        p.in = in, p.out = dout.p, p.out_stride_seq = H * D, p.out_stride_head = D, p.lse = dlse.as<float>();
        p.lse_stride_head = total_q;
        p.cu_seqlens_q = dcq.as<int>(), p.cu_seqlens_k = dck.as<int>();
        p.num_seqs = nseq, p.max_seqlen_q = p.max_seqlen_k = max_len, p.total_q = total_q, p.total_k = total_k;
        st = openvc::attention_general(p, nullptr);
      }
      ASSERT_TRUE(st.ok()) << st.message();
      CUDA_OK(cudaDeviceSynchronize());
      outs.push_back(download<uint16_t>(dout.p, size_t(total_q) * H * D));
    }
    int64_t written_differently = 0, far = 0;
    for (size_t i = 0; i < outs[0].size(); ++i) {
      const bool w0 = outs[0][i] != 0xFFFF, w1 = outs[1][i] != 0xFFFF;
      written_differently += w0 != w1;
      if (w0 && w1) far += std::fabs(bf16_to_float(outs[0][i]) - bf16_to_float(outs[1][i])) > 0.05f;
    }
    EXPECT_EQ(written_differently, 0) << "cu_q[1] = " << cu_q[1];
    EXPECT_LE(far, int64_t(outs[0].size() / 100)) << "cu_q[1] = " << cu_q[1];
  }
}

}  // namespace
