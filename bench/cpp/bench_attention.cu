// Kernel-level timing of the C++ API (no Python): prepare_fp8 and attention_fp8 on random normal BF16
// inputs, each captured in a CUDA graph and replayed; medians over rounds. The product benchmark with
// anchors is open-vc-attn-bench; this tool is for quick kernel A/B runs on the device.
// Usage: openvc_bench_attention [S] [H] [B] [rounds] [mid_window_blocks]
//        [variants|prev|repair|int8|split|prep|onecall|packed|split-tiles]
//        [causal|int8|int8-causal|int8-exp2|int8-exp2-causal|varlen|varlen-causal|keys] ("packed causal": causal;
//        "onecall packed": the one call and the step-wise call on the B sequences packed)
// ("prev causal|int8|int8-causal|int8-exp2[-causal]|varlen|varlen-causal|keys": those instantiations of
// today's and the earlier kernel; with OPENVC_BENCH_HEAD_DIM=64, the head-dim-64 ones)
// OPENVC_BENCH_SK=N: N keys per sequence (N < S: text cross-attention, e.g. 512); the default path, the
// variants and onecall take it; the other sections refuse it (they assume Sk = S).
// With OPENVC_BENCH_VARIANTS defined and a 6th argument "variants", it also times the kernel variants
// with one stage removed or doubled (src/attention/sm90/probes.h: Probe), interleaved.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "openvc/attention.h"
#include "openvc/call.h"
#ifdef OPENVC_BENCH_VARIANTS
#include "attention/sm90/kernel_launch.cuh"
#ifdef OPENVC_BENCH_PREV
#include "attention/sm90prev/kernel_launch.cuh"   // scripts/prev_kernel.sh: an earlier commit's kernel
#endif
#endif

#include "bench_util.cuh"

#ifdef OPENVC_BENCH_PREV
// The earlier kernel's plain production instantiation on today's launch plan: the tensor maps and grid
// copied over, and the KernelParams bytes of the earlier layout (fields are only ever appended at the
// end, so the earlier struct is a prefix of today's). Earlier commits with the LaunchPlan /
// launch_kernel<Mode, Probe> interface (kernel_launch.cuh) only.
// kMode: plain (0), causal (4), head dim 64 (16), INT8 Q/K (32) and their combinations: bits that are the same in
// every commit with this interface.
template <int kMode>
openvc::Status launch_prev(const openvc::sm90::LaunchPlan& plan, cudaStream_t s) {
  namespace prev = openvc::sm90prev;
  static_assert(sizeof(prev::KernelParams) <= sizeof(openvc::sm90::KernelParams),
                "the earlier KernelParams must be a prefix of today's");
  prev::LaunchPlan pl;
  pl.tm_q = plan.tm_q, pl.tm_k = plan.tm_k, pl.tm_v = plan.tm_v, pl.tm_krep = plan.tm_krep, pl.tm_vrep = plan.tm_vrep;
  std::memcpy(&pl.kp, &plan.kp, sizeof(pl.kp));
  pl.grid = plan.grid;
  pl.mode = kMode;
  return prev::launch_kernel<kMode, prev::kNoProbe>(pl, s);
}
// The earlier kernel in the plan's mode: plain, causal, packed / key counts (varlen) and varlen causal, head dim 64
// (OPENVC_BENCH_HEAD_DIM=64) and both, INT8 Q/K dense, causal and head dim 64, INT8 with exp2 P dense and causal.
openvc::Status launch_prev_mode(const openvc::sm90::LaunchPlan& plan, cudaStream_t s) {
  switch (plan.mode) {
    case 0: return launch_prev<0>(plan, s);
    case 4: return launch_prev<4>(plan, s);
    case 8: return launch_prev<8>(plan, s);
    case 12: return launch_prev<12>(plan, s);
    case 16: return launch_prev<16>(plan, s);
    case 20: return launch_prev<20>(plan, s);
    case 32: return launch_prev<32>(plan, s);
    case 36: return launch_prev<36>(plan, s);
    case 48: return launch_prev<48>(plan, s);
    case 96: return launch_prev<96>(plan, s);
    case 100: return launch_prev<100>(plan, s);
    default: return openvc::Status::Unsupported("prev: no earlier kernel built for mode " + std::to_string(plan.mode));
  }
}
#endif

int main(int argc, char** argv) {
  const int S = argc > 1 ? std::atoi(argv[1]) : 73397;
  const int H = argc > 2 ? std::atoi(argv[2]) : 7;
  const int B = argc > 3 ? std::atoi(argv[3]) : 1;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 7;
  const int window = argc > 5 ? std::atoi(argv[5]) : 4;
  // OPENVC_BENCH_HEAD_DIM=64 times the head-dim-64 mode (the probes below are built for 128 only).
  const char* d_env = std::getenv("OPENVC_BENCH_HEAD_DIM");
  const int D = d_env != nullptr ? std::atoi(d_env) : openvc::kHeadDim;
  // OPENVC_BENCH_SK: keys per sequence when fewer than the S queries (text cross-attention, e.g. 512); the K and
  // V buffers keep S rows, of which the first Sk are keys.
  const char* sk_env = std::getenv("OPENVC_BENCH_SK");
  const int Sk = sk_env != nullptr ? std::atoi(sk_env) : S;
  if (Sk < 1 || Sk > S || (Sk != S && argc > 6 && std::string(argv[6]) != "variants" &&
                           std::string(argv[6]) != "onecall")) {
    std::fprintf(stderr, "OPENVC_BENCH_SK: 1..S keys, with the default path, \"variants\" or \"onecall\" only\n");
    return 1;
  }
  // OPENVC_BENCH_CAUSAL=1: the default line and the onecall section on causal calls (TFLOP/s count the visible half);
  // the other sections set causal themselves.
  const char* causal_var = std::getenv("OPENVC_BENCH_CAUSAL");
  const bool causal_env = causal_var != nullptr && std::atoi(causal_var) != 0;
  if (causal_env && ((argc > 6 && std::string(argv[6]) != "onecall") || Sk != S)) {
    std::fprintf(stderr, "OPENVC_BENCH_CAUSAL: with the default path or \"onecall\" only, Sk = S\n");
    return 1;
  }
  const size_t n = size_t(B) * S * H * D;
  const int64_t sp = openvc::packed_seqlen_k(S), nb = openvc::num_quant_blocks(S);
  __nv_bfloat16 *q, *k, *v, *out;
  uint8_t *qc, *kc, *vp;
  float *qs, *ks, *vs;
  void* ws;
  CHECK_CUDA(cudaMalloc(&q, n * 2));
  CHECK_CUDA(cudaMalloc(&k, n * 2));
  CHECK_CUDA(cudaMalloc(&v, n * 2));
  CHECK_CUDA(cudaMalloc(&out, n * 2));
  CHECK_CUDA(cudaMalloc(&qc, n));
  CHECK_CUDA(cudaMalloc(&kc, n));
  CHECK_CUDA(cudaMalloc(&vp, size_t(B) * H * D * sp));
  CHECK_CUDA(cudaMalloc(&qs, size_t(B) * H * nb * 4));
  CHECK_CUDA(cudaMalloc(&ks, size_t(B) * H * nb * 4));
  CHECK_CUDA(cudaMalloc(&vs, size_t(B) * H * 4));
  const size_t wsb = openvc::prepare_workspace_bytes(B, H, S, false);
  CHECK_CUDA(cudaMalloc(&ws, wsb));
  fill_normal_bf16<<<1024, 256>>>(q, n, 1);
  fill_normal_bf16<<<1024, 256>>>(k, n, 2);
  fill_normal_bf16<<<1024, 256>>>(v, n, 3);
  CHECK_CUDA(cudaDeviceSynchronize());

  openvc::PrepareParams pp;
  pp.dtype = openvc::DType::kBFloat16;
  pp.batch = B, pp.seqlen_q = S, pp.seqlen_k = Sk, pp.heads = H, pp.head_dim = D;
  const openvc::TokenTensorView view{nullptr, int64_t(S) * H * D, int64_t(H) * D, D};
  pp.q = view, pp.k = view, pp.v = view;
  pp.q.data = q, pp.k.data = k, pp.v.data = v;
  pp.q_codes = qc, pp.q_descale = qs, pp.k_codes = kc, pp.k_descale = ks, pp.v_packed = vp, pp.v_descale = vs;
  pp.workspace = ws, pp.workspace_bytes = wsb;
  openvc::AttentionParams ap;
  ap.in = {B, S, Sk, H, D, qc, qs, kc, ks, vp, vs};
  ap.out = out;
  ap.out_stride_batch = int64_t(S) * H * D, ap.out_stride_seq = int64_t(H) * D, ap.out_stride_head = D;
  ap.mid_window_blocks = window;
  ap.causal = causal_env;

  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // The kernel with Q quantized in it (the one-call path's kernel: BF16 Q, no prepared Q codes).
  openvc::AttentionParams af = ap;
  af.in.q_codes = nullptr, af.in.q_descale = nullptr;
  af.q_unquantized = pp.q, af.q_unquantized_dtype = openvc::DType::kBFloat16;
  // Warm-up: the attention kernel's launches 0 (prepared Q) and 1 (Q quantized in it), eager (`ncu --launch-skip`).
  CHECK_OK(openvc::prepare_fp8(pp, s));
  CHECK_OK(openvc::attention_fp8(ap, s));
  CHECK_OK(openvc::attention_fp8(af, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  const int reps = std::max(1, int(2e13 / (4.0 * S * Sk * H * D * B)));  // ~20 ms of work per replay
  if (argc > 6 && std::string(argv[6]) == "packed") {
    // The B sequences as packed ones in the batched layout (cu_seqlens {0, S, .., B S}: the same codes, descales
    // and packed V as the batched preparation) against the batched call: what the varlen mode costs on equal
    // work. One eager launch of each first (the attention kernel's launches 2 and 3 counting from 0, after the
    // warm-up above: `ncu --launch-skip 2` / `3`), then
    // interleaved rounds with the order alternating, paired ratios. Nothing else is timed.
    if (argc > 7 && std::string(argv[7]) == "causal") ap.causal = true;   // "packed causal": both causal
    openvc::AttentionParams apv = ap;
    as_packed_sequences(apv, device_batch_offsets(B, S), B, S);
    CHECK_OK(openvc::attention_fp8(ap, s));
    CHECK_OK(openvc::attention_fp8(apv, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    const double flop = 4.0 * B * H * double(S) * Sk * D / (ap.causal ? 2 : 1);
    const PairedTimes t = paired_rounds([&] { CHECK_OK(openvc::attention_fp8(ap, s)); },
                                        [&] { CHECK_OK(openvc::attention_fp8(apv, s)); }, s, rounds, reps);
    std::printf("packed%s S=%d H=%d B=%d: batched kernel %.1f TFLOP/s, packed (varlen mode) %.1f TFLOP/s (medians); "
                "packed / batched time %.4f (paired median of %d)\n", ap.causal ? " causal" : "", S, H, B,
                flop / t.median_a * 1e-9, flop / t.median_b * 1e-9, t.median_ratio, rounds);
    return 0;
  }
  const float t_prep = graph_median_ms([&] { CHECK_OK(openvc::prepare_fp8(pp, s)); }, s, rounds, reps);
  const float t_attn = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(ap, s)); }, s, rounds, reps);
  const float t_fused = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(af, s)); }, s, rounds, reps);
  const float t_full = graph_median_ms([&] {
    CHECK_OK(openvc::prepare_fp8(pp, s));
    CHECK_OK(openvc::attention_fp8(ap, s));
  }, s, rounds, reps);
  const double flop = 4.0 * B * H * double(S) * Sk * D / (ap.causal ? 2 : 1);
  // Device copy bandwidth (bytes read + written) on a buffer the size of Q, and the
  // bytes preparation must move: Q and K read (2 B) and written (1 B) once, V read twice (amax, then
  // cast) and written once: 11 bytes per element when Sk = S.
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const float t_copy = graph_median_ms([&] {
    copy_kernel<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(q), reinterpret_cast<uint4*>(out), n * 2 / 16);
  }, s, rounds, 4);
  const double copy_gbs = 2.0 * n * 2 / (t_copy * 1e6);
  const double prep_gbs = (3.0 * n + 8.0 * double(n) * Sk / S) / (t_prep * 1e6);   // K and V: Sk of the S rows
  if (Sk != S) std::printf("Sk=%d keys: ", Sk);
  std::printf("S=%d H=%d B=%d w=%d: attention %.3f ms %.1f TFLOP/s | Q in the kernel %.3f ms %.1f TFLOP/s | prepare "
              "%.3f ms (%.0f GB/s = %.0f%% of copy %.0f GB/s) | complete %.3f ms (+%.2f%% over attention)\n",
              S, H, B, window, t_attn, flop / t_attn * 1e-9, t_fused, flop / t_fused * 1e-9, t_prep, prep_gbs,
              100.0 * prep_gbs / copy_gbs, copy_gbs, t_full, 100.0 * (t_full / t_attn - 1.0));
  if (argc > 6 && std::string(argv[6]) == "int8") {
    // The INT8 Q/K mode (numerics section 9) against the E4M3 mode on the same BF16 inputs, dense and
    // causal, alternating in the same process (attention kernel and complete call, CUDA graphs, medians
    // of `rounds`). K descales [B, H, nk, 8] (key groups), all written by prepare_fp8.
    const Int8Codes i8(pp, n, B, H, S, nb);
    const openvc::PrepareParams& pp8 = i8.prep;
    openvc::AttentionParams ap8 = ap;
    i8.use_in(ap8);
    openvc::AttentionParams apc = ap, ap8c = ap8;
    apc.causal = ap8c.causal = true;
    // INT8 + P format exp2 (numerics "P format", kExp2PMode): the same codes, dense and causal.
    openvc::AttentionParams ap8x = ap8, ap8xc = ap8c;
    ap8x.p_format = ap8xc.p_format = openvc::PFormat::kExp2;
    CHECK_OK(openvc::prepare_fp8(pp8, s));
    CHECK_OK(openvc::attention_fp8(ap8, s));
    CHECK_OK(openvc::attention_fp8(ap8c, s));
    CHECK_OK(openvc::attention_fp8(ap8x, s));
    CHECK_OK(openvc::attention_fp8(ap8xc, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    const double flop_causal = flop / 2;   // the visible half (S = Sq = Sk)
    for (int r = 0; r < 3; ++r) {
      const float e4 = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(ap, s)); }, s, rounds, reps);
      const float i8 = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(ap8, s)); }, s, rounds, reps);
      const float i8_full = graph_median_ms([&] {
        CHECK_OK(openvc::prepare_fp8(pp8, s));
        CHECK_OK(openvc::attention_fp8(ap8, s));
      }, s, rounds, reps);
      const float e4c = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(apc, s)); }, s, rounds, reps);
      const float i8c = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(ap8c, s)); }, s, rounds, reps);
      const float x8 = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(ap8x, s)); }, s, rounds, reps);
      const float x8c = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(ap8xc, s)); }, s, rounds, reps);
      std::printf("  int8 round %d: dense attention e4m3 %.1f TFLOP/s, int8 %.1f TFLOP/s (int8/e4m3 %.3f); int8 "
                  "complete %.1f TFLOP/s | causal e4m3 %.1f, int8 %.1f TFLOP/s (int8/e4m3 %.3f)\n",
                  r, flop / e4 * 1e-9, flop / i8 * 1e-9, e4 / i8, flop / i8_full * 1e-9, flop_causal / e4c * 1e-9,
                  flop_causal / i8c * 1e-9, e4c / i8c);
      std::printf("  int8+exp2 round %d: dense %.1f TFLOP/s (exp2/expcast %.3f, exp2/e4m3 %.3f) | causal %.1f TFLOP/s "
                  "(exp2/expcast %.3f, exp2/e4m3 %.3f)\n",
                  r, flop / x8 * 1e-9, i8 / x8, e4 / x8, flop_causal / x8c * 1e-9, i8c / x8c, e4c / x8c);
    }
#ifdef OPENVC_BENCH_VARIANTS
    using namespace openvc::sm90;
    LaunchPlan pe, p8, p8x;   // E4M3, INT8 and INT8 + exp2 plans of the same inputs, shared by the probes below
    CHECK_OK(plan_attention(ap, nullptr, &pe));
    CHECK_OK(plan_attention(ap8, nullptr, &p8));
    CHECK_OK(plan_attention(ap8x, nullptr, &p8x));
    constexpr int kI8 = kInt8QkMode, kX8 = kExp2PMode | kInt8QkMode;
    // The INT8 score conversion: production (I2FP.F32.S32) against IADD + FADD (probe
    // kInt8ConvertMagic), dense, interleaved rounds with paired ratios; both give the same bytes.
    {
      std::vector<__nv_bfloat16> a(n), b(n);
      CHECK_OK((launch_kernel<kI8, kNoProbe>(p8, s)));
      CHECK_CUDA(cudaMemcpyAsync(a.data(), out, n * 2, cudaMemcpyDeviceToHost, s));
      CHECK_CUDA(cudaMemsetAsync(out, 0xFF, n * 2, s));
      CHECK_OK((launch_kernel<kI8, kInt8ConvertMagic>(p8, s)));
      CHECK_CUDA(cudaMemcpyAsync(b.data(), out, n * 2, cudaMemcpyDeviceToHost, s));
      CHECK_CUDA(cudaStreamSynchronize(s));
      size_t differ = 0;
      for (size_t i = 0; i < n; ++i) differ += std::memcmp(&a[i], &b[i], 2) != 0;
      std::vector<float> ratio;
      for (int r = 0; r < rounds; ++r) {
        const float tp = graph_median_ms([&] { CHECK_OK((launch_kernel<kI8, kNoProbe>(p8, s))); }, s, 1, reps);
        const float ti = graph_median_ms([&] { CHECK_OK((launch_kernel<kI8, kInt8ConvertMagic>(p8, s))); }, s, 1, reps);
        ratio.push_back(ti / tp);
      }
      std::sort(ratio.begin(), ratio.end());
      std::printf("  int8 conversion: IADD+FADD takes %+.2f%% time vs I2FP.F32.S32 (paired median of %d); %zu of %zu "
                  "outputs differ (expected 0)\n", 100.0 * (ratio[rounds / 2] - 1.0), rounds, differ, n);
    }
    // P-format and issue-order probes, interleaved, each timed against its base entry (paired medians):
    // kCorrectedExpCast (E4M3 and INT8 Q/K: ExpCast codes moved onto the exact exponential's E4M3 rounding by a
    // quadratic within the octave) against the same Q/K format's ExpCast, exp2 against INT8 ExpCast, and
    // kPingPong (consumers taking turns at the tensor cores: whether one warpgroup's exponentials hide behind
    // the other's products; the same bytes) against its mode. With B = 1, rel L2 against exact FP64 attention on
    // 64 sampled rows per head.
    {
      struct Entry {
        const char* name;
        std::function<openvc::Status()> launch;
        int base;   // the entry it is timed against
      };
      const Entry entries[] = {
          {"e4m3 expcast", [&] { return launch_kernel<kPlainMode, kNoProbe>(pe, s); }, 0},
          {"e4m3 corrected", [&] { return launch_kernel<kPlainMode, kCorrectedExpCast>(pe, s); }, 0},
          {"int8 expcast", [&] { return launch_kernel<kI8, kNoProbe>(p8, s); }, 2},
          {"int8 corrected", [&] { return launch_kernel<kI8, kCorrectedExpCast>(p8, s); }, 2},
          {"int8 exp2", [&] { return launch_kernel<kX8, kNoProbe>(p8x, s); }, 2},
          {"int8 ping-pong", [&] { return launch_kernel<kI8, kPingPong>(p8, s); }, 2},
          {"int8 exp2 ping-pong", [&] { return launch_kernel<kX8, kPingPong>(p8x, s); }, 4},
          // the exp2 format's split of the exponentials (keys 64-127 of each tile on the FMA pipe) against both
          // ends: every key on MUFU ex2 (the format before the split) and every key on the polynomial code
          {"int8 exp2 all MUFU", [&] { return launch_kernel<kX8, kExp2AllMufu>(p8x, s); }, 4},
          {"int8 exp2 all poly", [&] { return launch_kernel<kX8, kCorrectedExpCast>(p8x, s); }, 4},
      };
      constexpr int kE = int(sizeof(entries) / sizeof(entries[0]));
      double err[kE];
      std::vector<__nv_bfloat16> outs[kE];   // each entry's output (B = 1): same-result probes equal their base
      std::vector<__nv_bfloat16> hq(B == 1 ? n : 0), hk(hq.size()), hv(hq.size()), ho(hq.size());
      if (B == 1) {
        CHECK_CUDA(cudaMemcpy(hq.data(), q, n * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(hk.data(), k, n * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(hv.data(), v, n * 2, cudaMemcpyDeviceToHost));
      }
      for (int e = 0; e < kE; ++e) {
        err[e] = std::nan("");
        if (B != 1) continue;
        CHECK_CUDA(cudaMemsetAsync(out, 0xFF, n * 2, s));
        CHECK_OK(entries[e].launch());
        CHECK_CUDA(cudaMemcpyAsync(ho.data(), out, n * 2, cudaMemcpyDeviceToHost, s));
        CHECK_CUDA(cudaStreamSynchronize(s));
        err[e] = sampled_rel_l2(hq, hk, hv, ho, S, H, D, 64);
        outs[e] = ho;
      }
      std::vector<std::vector<float>> ratio(kE);
      for (int r = 0; r < rounds; ++r) {
        float t[kE];
        for (int e = 0; e < kE; ++e)
          t[(e + r) % kE] = graph_median_ms([&] { CHECK_OK(entries[(e + r) % kE].launch()); }, s, 1, reps);
        for (int e = 0; e < kE; ++e) ratio[e].push_back(t[e] / t[entries[e].base]);
      }
      for (int e = 0; e < kE; ++e) {
        std::sort(ratio[e].begin(), ratio[e].end());
        size_t differ = 0;
        const std::vector<__nv_bfloat16>& o = outs[e];
        const std::vector<__nv_bfloat16>& ob = outs[entries[e].base];
        for (size_t i = 0; i < o.size(); ++i) differ += std::memcmp(&o[i], &ob[i], 2) != 0;
        std::printf("  probe %-30s rel L2 vs exact %.4f | time vs %s %+.2f%% (paired median of %d) | %zu outputs "
                    "differ from it\n", entries[e].name, err[e], entries[entries[e].base].name,
                    100.0 * (ratio[e][rounds / 2] - 1.0), rounds, differ);
      }
    }
#endif
  }
#ifdef OPENVC_BENCH_VARIANTS
  if (argc > 6 && std::string(argv[6]) == "split") {
    // The exp2 P format's split of each tile's exponentials between MUFU ex2 and the polynomial on the FMA pipe, at
    // the head dim of OPENVC_BENCH_HEAD_DIM (the balance of the two pipes against the tensor cores depends on it):
    // 0, 1, 2 (production), 3 and 4 of the 4 key groups on the polynomial, each timed against the INT8 ExpCast
    // kernel of the same inputs (paired medians of interleaved rounds), with B = 1 the rel L2 against exact FP64
    // attention on 32 sampled rows per head.
    using namespace openvc::sm90;
    const Int8Codes i8(pp, n, B, H, S, nb);
    CHECK_OK(openvc::prepare_fp8(i8.prep, s));
    openvc::AttentionParams ap8 = ap;
    i8.use_in(ap8);
    openvc::AttentionParams ap8x = ap8;
    ap8x.p_format = openvc::PFormat::kExp2;
    LaunchPlan p8, p8x;
    CHECK_OK(plan_attention(ap8, nullptr, &p8));
    CHECK_OK(plan_attention(ap8x, nullptr, &p8x));
    constexpr int kI8 = kInt8QkMode, kX8 = kExp2PMode | kInt8QkMode, k64 = kHeadDim64Mode;
    const bool d64 = D == 64;
    auto pick = [&](auto mode, auto probe, const LaunchPlan& plan) -> std::function<openvc::Status()> {
      constexpr int kM = decltype(mode)::value, kP = decltype(probe)::value;
      if (d64) return [&plan, s] { return launch_kernel<kM | k64, kP>(plan, s); };
      return [&plan, s] { return launch_kernel<kM, kP>(plan, s); };
    };
    using std::integral_constant;
    using I = integral_constant<int, kI8>;
    using X = integral_constant<int, kX8>;
    struct Entry {
      const char* name;
      std::function<openvc::Status()> launch;
    };
    const Entry entries[] = {
        {"int8 expcast", pick(I{}, integral_constant<int, kNoProbe>{}, p8)},
        {"exp2 0/4 poly", pick(X{}, integral_constant<int, kExp2AllMufu>{}, p8x)},
        {"exp2 1/4 poly", pick(X{}, integral_constant<int, kExp2PolyQuarter>{}, p8x)},
        {"exp2 2/4 poly", pick(X{}, integral_constant<int, kNoProbe>{}, p8x)},
        {"exp2 3/4 poly", pick(X{}, integral_constant<int, kExp2PolyThreeQuarters>{}, p8x)},
        {"exp2 4/4 poly", pick(X{}, integral_constant<int, kCorrectedExpCast>{}, p8x)},
    };
    constexpr int kE = int(sizeof(entries) / sizeof(entries[0]));
    std::vector<__nv_bfloat16> hq(B == 1 ? n : 0), hk(hq.size()), hv(hq.size()), ho(hq.size());
    if (B == 1) {
      CHECK_CUDA(cudaMemcpy(hq.data(), q, n * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(hk.data(), k, n * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(hv.data(), v, n * 2, cudaMemcpyDeviceToHost));
    }
    double err[kE];
    for (int e = 0; e < kE; ++e) {
      err[e] = std::nan("");
      CHECK_CUDA(cudaMemsetAsync(out, 0xFF, n * 2, s));
      CHECK_OK(entries[e].launch());
      CHECK_CUDA(cudaStreamSynchronize(s));
      if (B != 1) continue;
      CHECK_CUDA(cudaMemcpy(ho.data(), out, n * 2, cudaMemcpyDeviceToHost));
      err[e] = sampled_rel_l2(hq, hk, hv, ho, S, H, D, 32);
    }
    std::vector<float> ratio[kE], best(kE, 1e30f);
    for (int r = 0; r < rounds; ++r) {
      float t[kE];
      for (int e = 0; e < kE; ++e) {
        t[e] = graph_median_ms([&] { CHECK_OK(entries[e].launch()); }, s, 1, reps);
        best[e] = std::min(best[e], t[e]);
      }
      for (int e = 0; e < kE; ++e) ratio[e].push_back(t[e] / t[0]);
    }
    for (int e = 0; e < kE; ++e) {   // best of the rounds (TF/s) and the paired median (the ratio)
      std::sort(ratio[e].begin(), ratio[e].end());
      std::printf("  split D=%d %-14s %.1f TFLOP/s | time vs int8 expcast %+.2f%% (paired median of %d) | rel L2 "
                  "%.5f\n", D, entries[e].name, flop / best[e] * 1e-9, 100.0 * (ratio[e][rounds / 2] - 1.0), rounds,
                  err[e]);
    }
  }
#endif
  if (argc > 6 && std::string(argv[6]) == "onecall") {
    // The one-call entry openvc::attention (batched E4M3: K and V prepared, Q quantized in the kernel) against
    // the step-wise call (prepare_fp8 of Q, K and V, then the kernel on prepared Q), interleaved rounds with
    // the order alternating, paired ratios: which way the complete call should go at this shape. "onecall
    // packed": both on the B sequences as packed ones (cu_seqlens {0, S, .., B S}).
    const bool as_packed = argc > 7 && std::string(argv[7]) == "packed";
    if (as_packed && Sk != S) std::exit((std::fprintf(stderr, "onecall packed: Sk must equal S\n"), 2));
    openvc::AttentionCall c;
    c.heads = H, c.head_dim = D, c.batch = B, c.seqlen_q = S, c.seqlen_k = Sk;
    c.q = pp.q, c.k = pp.k, c.v = pp.v, c.mid_window_blocks = window, c.causal = ap.causal;
    c.out = out, c.out_stride_batch = ap.out_stride_batch, c.out_stride_seq = ap.out_stride_seq;
    c.out_stride_head = ap.out_stride_head;
    openvc::PrepareParams ps = pp;
    openvc::AttentionParams as = ap;
    if (as_packed) {
      const int* cu = device_batch_offsets(B, S);
      as_packed_sequences(c, cu, B, S), as_packed_sequences(ps, cu, B, S), as_packed_sequences(as, cu, B, S);
    }
    const size_t wcb = openvc::attention_workspace_bytes(c);
    void* wc;
    CHECK_CUDA(cudaMalloc(&wc, wcb));
    const PairedTimes t = paired_rounds([&] { CHECK_OK(openvc::attention(c, wc, wcb, s)); },
                                        [&] {
                                          CHECK_OK(openvc::prepare_fp8(ps, s));
                                          CHECK_OK(openvc::attention_fp8(as, s));
                                        }, s, rounds, reps);
    for (int r = 0; r < rounds; ++r)
      std::printf("  onecall round %d: one-call %.3f ms %.1f TFLOP/s, step-wise %.3f ms %.1f TFLOP/s (%.4f)\n", r,
                  t.a[r], flop / t.a[r] * 1e-9, t.b[r], flop / t.b[r] * 1e-9, t.b[r] / t.a[r]);
    std::printf("onecall%s S=%d Sk=%d H=%d B=%d: one-call %.1f TFLOP/s, step-wise %.1f TFLOP/s (medians); step-wise / "
                "one-call time %.4f (paired median of %d)\n", as_packed ? " packed" : "", S, Sk, H, B,
                flop / t.median_a * 1e-9, flop / t.median_b * 1e-9, t.median_ratio, rounds);
    CHECK_CUDA(cudaFree(wc));
  }
  if (argc > 6 && std::string(argv[6]) == "split-tiles") {
    // The one call with split tiles (AttentionCall::tile_split kOn; numerics section 5, "Split tiles") against
    // whole tiles (kOff), interleaved rounds, paired ratios.
    if (Sk != S || ap.causal) std::exit((std::fprintf(stderr, "split-tiles: Sk = S, not causal\n"), 2));
    openvc::AttentionCall c;
    c.heads = H, c.head_dim = D, c.batch = B, c.seqlen_q = S, c.seqlen_k = Sk;
    c.q = pp.q, c.k = pp.k, c.v = pp.v, c.mid_window_blocks = window;
    c.out = out, c.out_stride_batch = ap.out_stride_batch, c.out_stride_seq = ap.out_stride_seq;
    c.out_stride_head = ap.out_stride_head;
    openvc::AttentionCall whole = c;
    c.tile_split = openvc::TileSplit::kOn, whole.tile_split = openvc::TileSplit::kOff;
    const size_t wcb = openvc::attention_workspace_bytes(c);
    void* wc;
    CHECK_CUDA(cudaMalloc(&wc, wcb));
    int dev = 0, sms = 0;
    CHECK_CUDA(cudaGetDevice(&dev));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const long long tiles = (long long)B * H * ((S + 127) / 128), nk = (Sk + 127) / 128;
    std::printf("split-tiles S=%d H=%d B=%d: %lld tiles of %lld key blocks, %d SMs (split where tiles * blocks / SMs "
                ">= blocks)\n", S, H, B, tiles, nk, sms);
    const PairedTimes t = paired_rounds([&] { CHECK_OK(openvc::attention(c, wc, wcb, s)); },
                                        [&] { CHECK_OK(openvc::attention(whole, wc, wcb, s)); }, s, rounds, reps);
    for (int r = 0; r < rounds; ++r)
      std::printf("  split-tiles round %d: split %.3f ms %.1f TFLOP/s, whole tiles %.3f ms %.1f TFLOP/s (%.4f)\n", r, t.a[r],
                  flop / t.a[r] * 1e-9, t.b[r], flop / t.b[r] * 1e-9, t.b[r] / t.a[r]);
    std::printf("split-tiles S=%d H=%d B=%d: split %.1f TFLOP/s, whole tiles %.1f TFLOP/s (medians); whole / split time "
                "%.4f (paired median of %d)\n", S, H, B, flop / t.median_a * 1e-9, flop / t.median_b * 1e-9,
                t.median_ratio, rounds);
    CHECK_CUDA(cudaFree(wc));
  }
  if (argc > 6 && std::string(argv[6]) == "prep") {
    // prepare_fp8 alone for each Q/K format, with and without K smoothing (its block sums and means first), in
    // CUDA graphs, medians of `rounds`, 3 rounds of the four interleaved: what a format's preparation adds.
    const Int8Codes i8(pp, n, B, H, S, nb);
    const size_t wss = openvc::prepare_workspace_bytes(B, H, S, true);
    void* ws_s;
    CHECK_CUDA(cudaMalloc(&ws_s, wss));
    openvc::PrepareParams e4s = pp, i8s = i8.prep;
    e4s.k_smoothing = i8s.k_smoothing = true;
    e4s.workspace = i8s.workspace = ws_s;
    e4s.workspace_bytes = i8s.workspace_bytes = wss;
    const int reps_prep = std::max(2, int(5e9 / double(n)));
    for (int r = 0; r < 3; ++r) {
      float t[4];
      const openvc::PrepareParams* forms[4] = {&pp, &e4s, &i8.prep, &i8s};
      for (int f = 0; f < 4; ++f)
        t[f] = graph_median_ms([&] { CHECK_OK(openvc::prepare_fp8(*forms[f], s)); }, s, rounds, reps_prep);
      std::printf("  prep round %d: e4m3 %.1f us, e4m3+smoothing %.1f us, int8 %.1f us, int8+smoothing %.1f us\n", r,
                  t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3);
    }
    CHECK_CUDA(cudaFree(ws_s));
  }
  if (argc > 6 && std::string(argv[6]) == "repair") {
    // Kernel-side cost of V residual repair tiles (the selection is timed by the Python benchmark):
    // round(budget * S) rows per head of arbitrary codes, visited after every original block.
    for (double budget : {0.0025, 0.005, 0.01, 0.02, 0.04, 0.08}) {
      const int rows = int(std::llround(budget * S));
      const int64_t rp = openvc::repair_padded_rows(rows);
      uint8_t *rk, *rv;
      float* rks;
      CHECK_CUDA(cudaMalloc(&rk, size_t(B) * H * rp * D));
      CHECK_CUDA(cudaMalloc(&rv, size_t(B) * H * rp * D));
      CHECK_CUDA(cudaMalloc(&rks, size_t(B) * H * rp * 4));
      CHECK_CUDA(cudaMemcpy(rk, kc, size_t(B) * H * rp * D, cudaMemcpyDeviceToDevice));
      CHECK_CUDA(cudaMemset(rv, 0x20, size_t(B) * H * rp * D));
      CHECK_CUDA(cudaMemcpy(rks, ks, size_t(B) * H * std::min<int64_t>(rp, nb) * 4, cudaMemcpyDeviceToDevice));
      openvc::AttentionParams rap = ap;
      rap.repair = {rows, rk, rks, rv, nullptr};
      const float t_plain = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(ap, s)); }, s, rounds, reps);
      const float t_rep = graph_median_ms([&] { CHECK_OK(openvc::attention_fp8(rap, s)); }, s, rounds, reps);
      std::printf("  repair budget %.4f: %d rows (%lld tiles) attention %.3f ms vs %.3f ms plain (%+.2f%%)\n", budget,
                  rows, (long long)(rp / 128), t_rep, t_plain, 100.0 * (t_rep / t_plain - 1.0));
      CHECK_CUDA(cudaFree(rk));
      CHECK_CUDA(cudaFree(rv));
      CHECK_CUDA(cudaFree(rks));
    }
  }
#ifdef OPENVC_BENCH_VARIANTS
  // "variants": every probe; "prev": production and the previous kernel only (side by side).
  if (argc > 6 && (std::string(argv[6]) == "variants" || std::string(argv[6]) == "prev")) {
    const bool only_prev = std::string(argv[6]) == "prev";
    using namespace openvc::sm90;
    struct V {
      const char* name;
      openvc::Status (*launch)(const LaunchPlan&, cudaStream_t);
    };
    // "prev causal" / "prev int8" / "prev int8-causal": those instantiations side by side (S = Sq = Sk).
    const std::string sel = only_prev && argc > 7 ? argv[7] : "";
    if (sel == "causal" || sel == "int8-causal" || sel == "varlen-causal") ap.causal = true;
    // "prev varlen" / "prev varlen-causal": the B sequences as packed ones (cu = {0, S, .., B*S}, the batched
    // layout); "prev keys": batched with key counts S - 64 * (b + 1) (the varlen mode's key-count form).
    if (sel == "varlen" || sel == "varlen-causal" || sel == "keys") {
      std::vector<int> host(B + 1);
      for (int b = 0; b <= B; ++b) host[b] = sel == "keys" ? std::max(0, S - 64 * (b + 1)) : b * S;
      const int* dev = device_ints(host);
      if (sel == "keys") {
        pp.seqused_k = dev, ap.seqused_k = dev;
      } else {
        as_packed_sequences(pp, dev, B, S);
        as_packed_sequences(ap, dev, B, S);
      }
      CHECK_OK(openvc::prepare_fp8(pp, s));
    }
    if (sel == "int8-exp2-causal") ap.causal = true;
    if (sel == "int8-exp2" || sel == "int8-exp2-causal") ap.p_format = openvc::PFormat::kExp2;
    std::optional<Int8Codes> i8;   // INT8 Q/K codes of the same inputs (numerics section 9), kept to the end
    if (sel == "int8" || sel == "int8-causal" || sel == "int8-exp2" || sel == "int8-exp2-causal") {
      i8.emplace(pp, n, B, H, S, nb);
      CHECK_OK(openvc::prepare_fp8(i8->prep, s));
      i8->use_in(ap);
    }
    const V variants[] = {
        {only_prev ? "production" : "plain mode (production above 6 key blocks)",
         only_prev ? launch_plan : launch_kernel<kPlainMode, kNoProbe>},
#ifdef OPENVC_BENCH_PREV
        {"previous kernel (scripts/prev_kernel.sh)", launch_prev_mode},
#endif
        {"ping-pong ordering", launch_kernel<kPlainMode, kPingPong>},
        {"float row max (FMNMX)", launch_kernel<kPlainMode, kFloatMax>},
        {"ping-pong + float max (before)", launch_kernel<kPlainMode, kPingPong | kFloatMax>},
        // the two orders that pay at 512 keys (OPENVC_BENCH_SK=512), together
        {"ping-pong + fp32 accumulate every tile", launch_kernel<kPlainMode, kPingPong | kFlushEvery1>},
        // the production mode at up to kFewKeyBlocks key blocks (ping-pong as the probe above, but Q's codes read from
        // shared memory: the probe keeps the plain mode's registers)
        {"few-keys mode", launch_kernel<kFewKeysMode, kNoProbe>},
        {"general loop (no specialized steps)", launch_kernel<kPlainMode, kGeneralLoop>},
        {"skip max", launch_kernel<kPlainMode, kSkipMax>},
        {"skip convert", launch_kernel<kPlainMode, kSkipConvert>},
        {"skip fp32 accumulate", launch_kernel<kPlainMode, kSkipAccumulate>},
        {"double convert", launch_kernel<kPlainMode, kDoubleConvert>},
        {"double max", launch_kernel<kPlainMode, kDoubleMax>},
        {"fp32 accumulate every tile", launch_kernel<kPlainMode, kFlushEvery1>},
        {"fp32 accumulate every 4 tiles", launch_kernel<kPlainMode, kFlushEvery4>},
        {"Q from shared memory (before)", launch_kernel<kPlainMode, kQFromSharedMemory>},
        {"idle producer warps quantize K and V meanwhile", launch_kernel<kPlainMode, kSpareWarpsQuantize>},
    };
    const int kNum = only_prev ? 2 : int(sizeof(variants) / sizeof(variants[0]));
    LaunchPlan plan;
    CHECK_OK(plan_attention(ap, nullptr, &plan));
    // kSpareWarpsQuantize's arrays (probe_spare_quantize.cuh: fields the plain mode never reads): the BF16 K and V
    // (the first Sk rows of each batch entry's S do not matter here: all n elements), and their codes.
    uint8_t* spare_codes;
    CHECK_CUDA(cudaMalloc(&spare_codes, 2 * n));
    plan.kp.vc_mean_scaled = reinterpret_cast<const float*>(k);
    plan.kp.repair_k_descale = reinterpret_cast<const float*>(v);
    plan.kp.vc_channel_descale = reinterpret_cast<const float*>(spare_codes);
    plan.kp.repair_rows = int(n / 4096);
    // Output of the production kernel, to show how far each variant's result moves (rel L2).
    std::vector<__nv_bfloat16> base(n), got(n);
    CHECK_OK(openvc::attention_fp8(ap, s));
    CHECK_CUDA(cudaMemcpyAsync(base.data(), out, n * 2, cudaMemcpyDeviceToHost, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    std::vector<double> rel(kNum);
    for (int v = 0; v < kNum; ++v) {
      CHECK_CUDA(cudaMemsetAsync(out, 0xFF, n * 2, s));  // poison: NaN bf16
      CHECK_OK(variants[v].launch(plan, s));
      CHECK_CUDA(cudaMemcpyAsync(got.data(), out, n * 2, cudaMemcpyDeviceToHost, s));
      CHECK_CUDA(cudaStreamSynchronize(s));
      double num = 0, den = 0;
      for (size_t i = 0; i < n; ++i) {
        const double a = __bfloat162float(got[i]), b = __bfloat162float(base[i]);
        num += (a - b) * (a - b), den += b * b;
      }
      rel[v] = std::sqrt(num / den);
    }
    // Interleaved rounds (every variant once per round, order rotating) and paired ratios against
    // production in the same round: the spread between calls is far larger than within one.
    std::vector<std::vector<float>> times(kNum), ratios(kNum);
    for (int r = 0; r < rounds; ++r) {
      std::vector<float> tr(kNum);
      for (int k = 0; k < kNum; ++k) {
        const int v = (k + r) % kNum;
        tr[v] = graph_median_ms([&] { CHECK_OK(variants[v].launch(plan, s)); }, s, 1, reps);
      }
      for (int v = 0; v < kNum; ++v) times[v].push_back(tr[v]), ratios[v].push_back(tr[v] / tr[0]);
    }
    for (int v = 0; v < kNum; ++v) {
      std::sort(times[v].begin(), times[v].end());
      std::sort(ratios[v].begin(), ratios[v].end());
      const float t = times[v][rounds / 2];
      std::printf("  variant %-34s %.3f ms %.1f TFLOP/s (%+.1f%% time vs the first row, paired median) rel L2 vs "
                  "attention_fp8 %.2e\n",
                  variants[v].name, t, flop / t * 1e-9, 100.0 * (ratios[v][rounds / 2] - 1.0), rel[v]);
    }
  }
#endif
  return 0;
}
