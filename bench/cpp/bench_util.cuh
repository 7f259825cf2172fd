// Helpers of openvc_bench_attention (bench_attention.cu, its one translation unit): error checks, input fill, the SM copy ceiling, the
// sampled error against exact FP64 attention, INT8 code buffers, and CUDA-graph timing.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "openvc/attention.h"

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)
#define CHECK_OK(x)                                                                    \
  do {                                                                                 \
    openvc::Status s_ = (x);                                                           \
    if (!s_.ok()) {                                                                    \
      std::fprintf(stderr, "%s: %s\n", #x, s_.message().c_str());                     \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

static __global__ void fill_normal_bf16(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    // Sum of four uniform hashes: close enough to normal for timing, never zero-filled.
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    float acc = 0.0f;
    for (int r = 0; r < 4; ++r) {
      h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
      acc += float(h) * 2.3283064e-10f;
    }
    x[i] = __float2bfloat16((acc - 2.0f) * 1.7320508f);
  }
}

// SM copy (16-byte loads and stores): the device's copy ceiling. cudaMemcpyAsync between device
// buffers runs on the copy engines here and measured about 2.6 TB/s, well under what SMs move.
static __global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// rel L2 of out against exact FP64 attention (1/sqrt(D) scale) on `rows` sampled query rows of every head, batch 0,
// S = Sq = Sk ([S, H, D] BF16 host copies): the error of a P format on these N(0,1) inputs without a CPU pass
// over all rows.
inline double sampled_rel_l2(const std::vector<__nv_bfloat16>& q, const std::vector<__nv_bfloat16>& k,
                      const std::vector<__nv_bfloat16>& v, const std::vector<__nv_bfloat16>& out, int S, int H, int D,
                      int rows) {
  double num = 0, den = 0;
  std::vector<double> sc(S);
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < rows; ++r) {
      const int i = int((int64_t(r) * S) / rows + 17) % S;
      const __nv_bfloat16* qi = q.data() + (int64_t(i) * H + h) * D;
      double mx = -1e300;
      for (int j = 0; j < S; ++j) {
        const __nv_bfloat16* kj = k.data() + (int64_t(j) * H + h) * D;
        double acc = 0;
        for (int c = 0; c < D; ++c) acc += double(__bfloat162float(qi[c])) * __bfloat162float(kj[c]);
        sc[j] = acc / std::sqrt(double(D));
        mx = std::max(mx, sc[j]);
      }
      std::vector<double> o(D, 0.0);
      double l = 0;
      for (int j = 0; j < S; ++j) {
        const double p = std::exp(sc[j] - mx);
        l += p;
        const __nv_bfloat16* vj = v.data() + (int64_t(j) * H + h) * D;
        for (int c = 0; c < D; ++c) o[c] += p * __bfloat162float(vj[c]);
      }
      const __nv_bfloat16* oi = out.data() + (int64_t(i) * H + h) * D;
      for (int c = 0; c < D; ++c) {
        const double e = o[c] / l, g = __bfloat162float(oi[c]);
        num += (g - e) * (g - e), den += e * e;
      }
    }
  return std::sqrt(num / den);
}

// INT8 Q/K codes and descales of the benchmark's inputs (numerics section 9): Q per row, K descales [B, H, nk, 8]
// (key groups), in their own buffers, written by prepare_fp8 with the E4M3 preparation's other arguments (V too).
struct Int8Codes {
  uint8_t *q, *k;
  float *qs, *ks;
  openvc::PrepareParams prep;

  Int8Codes(const openvc::PrepareParams& pp, size_t n, int B, int H, int S, int64_t nb) : prep(pp) {
    CHECK_CUDA(cudaMalloc(&q, n));
    CHECK_CUDA(cudaMalloc(&k, n));
    CHECK_CUDA(cudaMalloc(&qs, size_t(B) * H * S * 4));
    CHECK_CUDA(cudaMalloc(&ks, size_t(B) * H * nb * openvc::kInt8KeyGroups * 4));
    prep.qk_format = openvc::QkFormat::kInt8;
    prep.q_codes = q, prep.q_descale = qs, prep.k_codes = k, prep.k_descale = ks;
  }
  Int8Codes(const Int8Codes&) = delete;
  Int8Codes& operator=(const Int8Codes&) = delete;
  ~Int8Codes() {
    CHECK_CUDA(cudaFree(q));
    CHECK_CUDA(cudaFree(k));
    CHECK_CUDA(cudaFree(qs));
    CHECK_CUDA(cudaFree(ks));
  }
  // The attention inputs of `a` switched to these codes.
  void use_in(openvc::AttentionParams& a) const {
    a.in.qk_format = openvc::QkFormat::kInt8;
    a.in.q_codes = q, a.in.q_descale = qs, a.in.k_codes = k, a.in.k_descale = ks;
  }
};

template <class F>
float graph_median_ms(F&& enqueue, cudaStream_t s, int rounds, int reps) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < reps; ++r) enqueue();
  CHECK_CUDA(cudaStreamEndCapture(s, &g));
  CHECK_CUDA(cudaGraphInstantiate(&ge, g, 0));
  CHECK_CUDA(cudaGraphLaunch(ge, s));  // warm-up
  CHECK_CUDA(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < rounds; ++r) {
    CHECK_CUDA(cudaEventRecord(a, s));
    CHECK_CUDA(cudaGraphLaunch(ge, s));
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / reps);
  }
  std::sort(t.begin(), t.end());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  CHECK_CUDA(cudaGraphExecDestroy(ge));
  CHECK_CUDA(cudaGraphDestroy(g));
  return t[t.size() / 2];
}

// Two entries timed in interleaved rounds, the order alternating (graph_median_ms of one replay each): the per-round
// times, their medians and the median of the paired ratios b / a. The spread between calls under the power cap is far
// larger than within a round.
struct PairedTimes {
  std::vector<float> a, b;
  float median_a, median_b, median_ratio;
};
template <class FA, class FB>
PairedTimes paired_rounds(FA&& fa, FB&& fb, cudaStream_t s, int rounds, int reps) {
  PairedTimes p;
  std::vector<float> ratio;
  for (int r = 0; r < rounds; ++r) {
    float t[2];
    for (int k = 0; k < 2; ++k) {
      const int e = (k + r) % 2;
      t[e] = e == 0 ? graph_median_ms(fa, s, 1, reps) : graph_median_ms(fb, s, 1, reps);
    }
    p.a.push_back(t[0]), p.b.push_back(t[1]), ratio.push_back(t[1] / t[0]);
  }
  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  p.median_a = median(p.a), p.median_b = median(p.b), p.median_ratio = median(ratio);
  return p;
}

// A device copy of `host` (freed at exit with the tool's other buffers).
inline int* device_ints(const std::vector<int>& host) {
  int* dev;
  CHECK_CUDA(cudaMalloc(&dev, host.size() * 4));
  CHECK_CUDA(cudaMemcpy(dev, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  return dev;
}

// Offsets {0, S, .., B S} on the device: the B batch entries of S tokens as packed sequences.
inline const int* device_batch_offsets(int B, int S) {
  std::vector<int> host(B + 1);
  for (int b = 0; b <= B; ++b) host[b] = b * S;
  return device_ints(host);
}

// The B batch entries of S tokens as packed sequences in the batched layout (offsets cu = {0, S, .., B S}: the same
// rows, codes and descales), for PrepareParams or AttentionParams.
template <class Params>
void as_packed_sequences(Params& p, const int* cu, int B, int S) {
  p.cu_seqlens_q = p.cu_seqlens_k = cu, p.max_seqlen_q = p.max_seqlen_k = S, p.num_seqs = B;
  p.total_q = p.total_k = int64_t(B) * S;
}
